"""PyTorch's own make_graphed_callables tests, run against cgraph.

What runs: every test of class TestCuda in PyTorch's test/test_cuda.py that
calls make_graphed_callables, with its upstream decorators and
parametrizations (torch's parametrize/subtest/instantiate_parametrized_tests,
torch's TestCase), and with two changes: the text
``torch.cuda.make_graphed_callables`` becomes ``cgraph.make_graphed_callables``
(``torch.cuda.graph_pool_handle`` stays torch's), and the parametrizations
torch expects to fail only because torch refuses autocast's weight cache
(with_amp, cache_enabled, allow_unused_input = True, True, True: "make_graphed_
callables does not support the autocast caching") lose their
``unittest.expectedFailure``: cgraph supports the cache, so they must pass.
The other expected failure (an unused input without allow_unused_input)
still must raise.

Where the upstream text comes from: it is not in this repository. The project
keeps third-party code out of its commits, so this file carries no upstream
test code: at collection it reads PyTorch's file (or an excerpt of it) from
disk, keeps the TestCuda members that are not tests plus the tests that
mention make_graphed_callables, swaps the import, and execs the result with
the upstream file name and line numbers, so tracebacks point into it.

Sources, in precedence order (a later one adds only test names the earlier
ones lack):

* ``CGRAPH_TORCH_TEST_CUDA``: paths joined by os.pathsep, e.g. a checkout's
  ``test/test_cuda.py`` of the release under test; if set, only these, and
  every one must exist.
* otherwise the git-ignored excerpts in tests/upstream/ (carry that folder to
  a GPU machine; it is never committed):
  - test_cuda-000e43cd.py.txt: pytorch/pytorch test/test_cuda.py at
    000e43cdff99f30291164c1f2e90133f19fa83fb: the three tests
    test_graph_make_graphed_callables (2 parametrizations, both
    unittest.expectedFailure), ..._parameterless_nograd_module (4, one
    expectedFailure) and ..._same_pool;
  - test_cuda-pre-170826.py.txt: the two passing parametrizations that
    releases before December 2025 also listed for
    test_graph_make_graphed_callables (upstream marked them skipIfRocm,
    then dropped them);
  - test_cuda-newer-05ddebfc.py.txt: test_cuda_graph_inference_mode, newer
    than 000e43cd (probably absent from torch 2.11).

Without a source the expected test ids below are collected as placeholders.
With neither CGRAPH_TORCH_TEST_CUDA set nor tests/upstream/ present (a fresh
checkout) they skip, and their one-line reason says how to provide a source;
a GPU run that skips them shows so in its summary (pytest -rs).  With
CGRAPH_TORCH_TEST_CUDA naming a file that does not exist they fail, naming
it: a source asked for must be there.  Without CUDA every item is skipped:
``pytestmark`` (the project's ``gpu`` marker, see conftest.py) and
upstream's own class-level ``unittest.skipIf(not TEST_CUDA, ...)``.

The class keeps upstream's name TestCuda: torch's TestCase runs a test of a
class whose id contains "cuda" on a fresh non-default current stream
(``_do_cuda_non_default_stream = True`` upstream), and so does this file.

torch.testing._internal.common_utils needs numpy, and expecttest (see
_need_expecttest for the stand-in used where it is not installed). Upstream
names this torch lacks (psutil, TEST_CUDAMALLOCASYNC on torch 2.14) are left
unbound: none of these tests uses them (UPSTREAM_REPORT lists them).
"""

import ast
import importlib
import os
import unittest
from pathlib import Path

import pytest

import cgraph

pytestmark = pytest.mark.gpu

_OLD = "torch.cuda.make_graphed_callables"
_NEW = "cgraph.make_graphed_callables"
# torch's expected failure for autocast's cache, which cgraph supports.
_CACHE_XFAIL = "subtest((True, True, True), decorators=[unittest.expectedFailure])"
_CACHE_PASS = "subtest((True, True, True))"
_CLASS = "TestCuda"
_UPSTREAM = Path(__file__).resolve().parent / "upstream"
_DEFAULT_SOURCES = (
    "test_cuda-000e43cd.py.txt",
    "test_cuda-pre-170826.py.txt",
    "test_cuda-newer-05ddebfc.py.txt",
)

# The ids the default sources give (placeholders when none is found).
EXPECTED_TESTS = (
    "test_graph_make_graphed_callables_with_amp_cache_enabled_allow_unused_input",
    "test_graph_make_graphed_callables_without_amp_not_allow_unused_input",
    "test_graph_make_graphed_callables_without_amp_allow_unused_input",
    "test_graph_make_graphed_callables_with_amp_cache_disabled_allow_unused_input",
    "test_graph_make_graphed_callables_parameterless_nograd_module_without_amp_allow_unused_input",
    "test_graph_make_graphed_callables_parameterless_nograd_module_with_amp_cache_disabled_allow_unused_input",
    "test_graph_make_graphed_callables_parameterless_nograd_module_with_amp_cache_enabled_allow_unused_input",
    "test_graph_make_graphed_callables_parameterless_nograd_module_without_amp_not_allow_unused_input",
    "test_graph_make_graphed_callables_same_pool",
    "test_cuda_graph_inference_mode",
)


# Why the placeholders skip: no source was asked for, and none is here.
NO_SOURCE = ("no upstream test_cuda.py: set CGRAPH_TORCH_TEST_CUDA=/path/to/pytorch/test/"
             "test_cuda.py, or put the excerpts in tests/upstream/")


def _sources():
    """The upstream files to read, and the paths CGRAPH_TORCH_TEST_CUDA names
    that do not exist (then no files)."""
    listed = os.environ.get("CGRAPH_TORCH_TEST_CUDA")
    if listed:
        paths = [Path(p) for p in listed.split(os.pathsep) if p]
        missing = [str(p) for p in paths if not p.is_file()]
        return ([], missing) if missing else (paths, [])
    return [_UPSTREAM / n for n in _DEFAULT_SOURCES if (_UPSTREAM / n).is_file()], []


def _run_import(ns, node, missing):
    """One top-level import statement, name by name: a name this torch lacks
    (upstream imports many the make_graphed_callables tests never use) is
    recorded in ``missing`` instead of failing the whole statement."""
    if isinstance(node, ast.Import):
        for alias in node.names:
            try:
                module = importlib.import_module(alias.name)
            except Exception as e:
                missing.append(f"{alias.name} ({type(e).__name__})")
                continue
            if alias.asname:
                ns[alias.asname] = module
            else:
                top = alias.name.partition(".")[0]
                ns[top] = importlib.import_module(top)
        return
    if node.level:
        missing.append(f"relative import of {node.module}")
        return
    try:
        module = importlib.import_module(node.module)
    except Exception as e:
        missing.extend(f"{node.module}.{a.name} ({type(e).__name__})" for a in node.names)
        return
    for alias in node.names:
        if alias.name == "*":
            ns.update({k: v for k, v in vars(module).items() if not k.startswith("_")})
            continue
        try:
            value = getattr(module, alias.name)
        except AttributeError:
            try:
                value = importlib.import_module(f"{node.module}.{alias.name}")
            except Exception:
                missing.append(f"{node.module}.{alias.name}")
                continue
        ns[alias.asname or alias.name] = value


def _first_line(node):
    return min([d.lineno for d in node.decorator_list] + [node.lineno])


def _load(path, base_ns):
    """TestCuda of one source, reduced to its non-test members and the tests
    that mention make_graphed_callables, import swapped, instantiated."""
    text = path.read_text()
    tree = ast.parse(text, filename=str(path))
    lines = text.splitlines(keepends=True)
    ns = dict(base_ns)
    missing = []
    cls = None
    for node in tree.body:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            _run_import(ns, node, missing)
        elif isinstance(node, ast.ClassDef) and node.name == _CLASS:
            cls = node
    if cls is None:
        raise RuntimeError(f"{path}: no class {_CLASS}")

    dropped = set()
    kept_tests = []
    for stmt in cls.body:
        if isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef)) and stmt.name.startswith("test"):
            first = _first_line(stmt)
            if "make_graphed_callables" in "".join(lines[first - 1:stmt.end_lineno]):
                kept_tests.append(stmt.name)
            else:
                dropped.update(range(first, stmt.end_lineno + 1))
    start = _first_line(cls)
    body = ["\n" if i in dropped else lines[i - 1]
            for i in range(start, cls.end_lineno + 1)]
    source = "\n" * (start - 1) + "".join(body)
    if source.count(_OLD) < len(kept_tests):
        raise RuntimeError(f"{path}: a kept test does not call {_OLD}")
    source = source.replace(_OLD, _NEW).replace(_CACHE_XFAIL, _CACHE_PASS)

    exec(compile(source, str(path), "exec"), ns)
    klass = ns[_CLASS]
    ns["instantiate_parametrized_tests"](klass)
    return klass, ns, kept_tests, missing


def _need_expecttest():
    """torch.testing._internal.common_utils imports expecttest (a PyPI package
    torch does not depend on) only to derive its TestCase from
    expecttest.TestCase, which adds assertExpectedInline, a method none of
    these tests calls. Where it is not installed (a machine without network
    cannot install it), a stand-in module with a plain TestCase takes its
    place. Returns whether the stand-in was used."""
    try:
        import expecttest  # noqa: F401
        return False
    except ImportError:
        import sys
        import types

        stub = types.ModuleType("expecttest")
        stub.__doc__ = ("stand-in from tests/test_torch_make_graphed_callables.py: "
                        "expecttest is not installed")
        stub.TestCase = type("TestCase", (unittest.TestCase,), {})
        sys.modules["expecttest"] = stub
        return True


def _build():
    paths, missing = _sources()
    MISSING.extend(missing)
    if not paths:
        return None, []
    global EXPECTTEST_STAND_IN
    EXPECTTEST_STAND_IN = _need_expecttest()
    base = {"__name__": __name__, "__builtins__": __builtins__, "cgraph": cgraph}
    klass, ns, kept, missing = _load(paths[0], base)
    report = [(paths[0], kept, missing)]
    for path in paths[1:]:
        other, _, kept, missing = _load(path, ns)
        report.append((path, kept, missing))
        for name, value in vars(other).items():
            if name.startswith("test") and not hasattr(klass, name):
                setattr(klass, name, value)
    return klass, report


EXPECTTEST_STAND_IN = None
MISSING = []  # the paths CGRAPH_TORCH_TEST_CUDA names that do not exist
TestCuda, UPSTREAM_REPORT = _build()

def _placeholder(name, reason):
    def test(self):
        if MISSING:
            self.fail(f"{name}: CGRAPH_TORCH_TEST_CUDA names files that do not exist: "
                      f"{MISSING}; point it at PyTorch's test/test_cuda.py, or unset it "
                      "to use tests/upstream/")
        self.skipTest(reason)
    test.__name__ = name
    return test


if TestCuda is None:
    class TestCuda(unittest.TestCase):
        """Placeholders: no upstream source was read."""

    for _name in EXPECTED_TESTS:
        setattr(TestCuda, _name, _placeholder(_name, NO_SOURCE))
else:
    # An expected id no source read gave (its excerpt absent, or a release
    # that dropped it) is a named skip, never silently missing.
    _read = [str(path.name) for path, _, _ in UPSTREAM_REPORT]
    for _name in EXPECTED_TESTS:
        if not hasattr(TestCuda, _name):
            setattr(TestCuda, _name, _placeholder(
                _name, f"no source read gives it (read: {', '.join(_read)}; the default "
                       f"sources are {', '.join(_DEFAULT_SOURCES)})"))

"""Packaging checks on the CPU (they run in CI): what the built module
exports, that the sdist holds all that builds cgraph and installs into a
fresh environment, which torch an isolated build asks for, and the one
sentence for a torch without CUDA, at build and at import."""

import importlib.util
import os
import re
import site
import subprocess
import sys
import tarfile
import textwrap
import types
from pathlib import Path

import pytest
import torch

import cgraph

ROOT = Path(__file__).resolve().parent.parent
CPU_ONLY = "cgraph needs a CUDA build of PyTorch; this torch is CPU-only: "


def _load(name, path):
    """A module loaded from a file of the checkout (setup.py, the backend)
    without running anything under `if __name__ == "__main__"`."""
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(cmd, **kwargs):
    """Run a command; on failure the assertion shows the end of its output."""
    done = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, **kwargs)
    assert done.returncode == 0, f"{cmd} failed:\n{(done.stdout + done.stderr)[-4000:]}"
    return done.stdout


def _exported(shared_object):
    """Names `nm -D --defined-only` lists: what the dynamic linker can bind
    other libraries' calls to."""
    out = _run(["nm", "-D", "--defined-only", shared_object])
    return [line.split()[-1] for line in out.splitlines() if line.strip()]


def _without_pythonpath():
    env = dict(os.environ)
    env.pop("PYTHONPATH", None)
    return env


def test_module_exports_only_its_init():
    """Anything else exported (our functions, the inline members of torch's
    classes compiled into our objects) could take the place of another
    library's copy of the same symbol."""
    assert _exported(cgraph._C.__file__) == ["PyInit__C"]


@pytest.mark.slow
def test_sdist_builds_and_installs(tmp_path):
    """The sdist holds every file of csrc/ and the test helpers, and
    `pip install --no-build-isolation` of it into a fresh environment gives
    an importable cgraph of this version (one full build: minutes)."""
    _run([sys.executable, "-m", "build", "--sdist", "--no-isolation", "--outdir",
          tmp_path / "dist", ROOT])
    (sdist,) = (tmp_path / "dist").glob("cgraph-*.tar.gz")
    with tarfile.open(sdist) as tar:
        members = {Path(*Path(name).parts[1:]).as_posix() for name in tar.getnames()}
    wanted = {f"csrc/{p.name}" for p in (ROOT / "csrc").iterdir() if p.is_file()}
    wanted |= {f"tests/{p.name}" for p in (ROOT / "tests").glob("*.py")}
    wanted |= {"LICENSE", "README.md", "pyproject.toml", "setup.py", "_backend/cgraph_backend.py"}
    assert wanted <= members, f"missing from the sdist: {sorted(wanted - members)}"

    python = _fresh_venv(tmp_path / "venv")
    _run([python, "-m", "pip", "install", "-q", "--no-build-isolation", sdist],
         env=_without_pythonpath())
    out = _run([python, "-c", "import cgraph; print(cgraph.__version__); print(cgraph._C.__file__)"],
               cwd=tmp_path, env=_without_pythonpath())
    version, module = out.split()
    assert version == _load("_cgraph_version", ROOT / "cgraph" / "_version.py").__version__
    assert Path(module).is_relative_to(tmp_path / "venv"), module
    assert _exported(module) == ["PyInit__C"]


def _fresh_venv(folder):
    """A virtual environment that sees this one's packages (torch, pip,
    setuptools) behind its own: --system-site-packages, plus a .pth for
    where this Python is itself a virtual environment.  No pip of its own:
    Python 3.11's would bring setuptools 65, too old for pyproject.toml."""
    _run([sys.executable, "-m", "venv", "--system-site-packages", "--without-pip", folder])
    python = folder / "bin" / "python"
    purelib = _run([python, "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"])
    outer = [p for p in site.getsitepackages() if os.path.isdir(p)]
    Path(purelib.strip(), "outer.pth").write_text("\n".join(outer) + "\n")
    return python


def test_import_refuses_a_cpu_only_torch():
    """With torch.version.cuda None, as in a CPU-only torch, `import cgraph`
    raises one sentence before loading _C."""
    script = textwrap.dedent("""
        import sys, torch
        torch.version.cuda = None
        try:
            import cgraph
        except ImportError as e:
            print(e)
            print("cgraph._C" in sys.modules)
        else:
            print("imported")
    """)
    out = _run([sys.executable, "-c", script], cwd=ROOT).splitlines()
    assert out[0].startswith(CPU_ONLY + torch.__version__ + ". Install a CUDA build"), out
    assert out[1:] == ["False"], out


def test_build_refuses_a_cpu_only_torch():
    """setup.py's check stops the build with the same sentence; a CUDA
    torch passes."""
    setup = _load("cgraph_setup", ROOT / "setup.py")
    cpu = types.SimpleNamespace(__version__="2.13.0+cpu",
                                version=types.SimpleNamespace(cuda=None, hip=None))
    with pytest.raises(SystemExit, match="^" + re.escape(CPU_ONLY + "2.13.0+cpu. ")):
        setup.check_cuda_torch(cpu)
    setup.check_cuda_torch(types.SimpleNamespace(__version__="2.14.1+cu130",
                                                 version=types.SimpleNamespace(cuda="13.0")))
    rocm = types.SimpleNamespace(__version__="2.14.1+rocm7.0",
                                 version=types.SimpleNamespace(cuda=None, hip="7.0"))
    with pytest.raises(SystemExit, match="this torch is a ROCm build"):
        setup.check_cuda_torch(rocm)


def test_build_refuses_a_toolkit_older_than_the_one_torch_s_cuda_graph_is_laid_out_for(tmp_path):
    """at::cuda::CUDAGraph has members only under CUDA_VERSION >= 12040
    (torch 2.12 on), read from the first cuda.h the compiler finds (a pip
    CUDA wheel's before the toolkit's): one older than 12.4 beside a torch
    built with 12.4 or newer would lay out cgraph's subclass short of
    torch's object.  Refused, naming the header and the fix; a header
    without such members, an older torch CUDA, a newer cuda.h (the wheel's
    ahead of an old toolkit's) or none pass."""
    setup = _load("cgraph_setup", ROOT / "setup.py")
    wheel, home, empty = (tmp_path / name for name in ("wheel", "home", "empty"))
    for folder, version in ((wheel, 13000), (home / "include", 12030), (empty, None)):
        folder.mkdir(parents=True)
        if version is not None:
            (folder / "cuda.h").write_text(f"#pragma once\n#define CUDA_VERSION {version}\n")
    old = setup.compiled_cuda_header(str(home), [str(empty)])
    assert old == (str(home / "include" / "cuda.h"), 12030)
    # A wheel's cuda.h, searched before CUDA_HOME's (_cuda_library_includes), is the one compiled.
    assert setup.compiled_cuda_header(str(home), [str(wheel)]).version == 13000
    assert setup.compiled_cuda_header(None, [str(wheel)]).version == 13000
    assert setup.compiled_cuda_header(None, [str(empty)]) is None
    guarded = "#if !defined(USE_ROCM) && (defined(CUDA_VERSION) && CUDA_VERSION >= 12040)"
    with pytest.raises(SystemExit, match=r"found CUDA 12\.3 \(.*home/include/cuda\.h\), older "
                                         r"than this torch's CUDA 13\.0.*Install a CUDA toolkit "
                                         r"of 12\.4 or newer"):
        setup.check_cuda_toolkit("13.0", old, guarded)
    setup.check_cuda_toolkit("13.0", old, "class CUDAGraph {};")  # torch 2.11's header
    setup.check_cuda_toolkit("12.1", old, guarded)
    setup.check_cuda_toolkit("13.0", setup.compiled_cuda_header(str(home), [str(wheel)]), guarded)
    setup.check_cuda_toolkit("13.0", None, guarded)
    header = os.path.join(os.path.dirname(torch.__file__), "include", "ATen", "cuda",
                          "CUDAGraph.h")
    here = setup.compiled_cuda_header("/usr/local/cuda", setup._cuda_library_includes())
    setup.check_cuda_toolkit(torch.version.cuda, here, open(header).read())  # this build passes


def test_build_refuses_an_old_setuptools():
    """A Python 3.11 venv's setuptools 65 gets one sentence, not its schema error."""
    setup = _load("cgraph_setup", ROOT / "setup.py")
    with pytest.raises(SystemExit, match=r"needs setuptools>=77; this Python has 65\.5\.0: pip"):
        setup.check_setuptools("65.5.0")
    setup.check_setuptools("77.0.3")


def test_unity_groups_cover_every_file_once(tmp_path, monkeypatch):
    """The C++ files go into unity translation units (setup.py):
    each file in exactly one, as many units as asked and no more than files,
    the heavy files spread out, and a unit of one compiled as itself."""
    setup = _load("cgraph_setup", ROOT / "setup.py")
    sizes = {"a.cpp": 900, "b.cpp": 800, "c.cpp": 100, "d.cpp": 100, "e.cpp": 50}
    files = []
    for name, size in sizes.items():
        (tmp_path / name).write_text("x" * size)
        files.append(str(tmp_path / name))
    for count in (1, 2, 3, 5):
        groups = setup.unity_groups(files, count)
        assert len(groups) == count
        assert sorted(f for g in groups for f in g) == sorted(files)
    a, b = setup.unity_groups(files, 2)
    assert {Path(a[0]).name, Path(b[0]).name} == {"a.cpp", "b.cpp"}  # not together

    monkeypatch.delenv("CGRAPH_UNITY", raising=False)
    assert setup.unity_count(files, jobs=2, ninja=True) == 2
    assert setup.unity_count(files, jobs=16, ninja=True) == 5
    assert setup.unity_count(files, jobs=16, ninja=False) == 1  # compiled one at a time
    monkeypatch.setenv("CGRAPH_UNITY", "0")
    assert setup.unity_count(files, jobs=2, ninja=True) == 5
    monkeypatch.setenv("CGRAPH_UNITY", "3")
    assert setup.unity_count(files, jobs=2, ninja=False) == 3

    unity = tmp_path / "unity"
    assert setup.unity_sources(files, 5, folder=str(unity)) == sorted(files)
    sources = setup.unity_sources(files, 2, folder=str(unity))
    assert all(Path(s).parent == unity for s in sources)
    included = [line.split('"')[1] for s in sources for line in Path(s).read_text().splitlines()
                if line.startswith("#include")]
    assert sorted(included) == sorted(files)
    stamp = os.stat(sources[0]).st_mtime_ns
    setup.unity_sources(files, 2, folder=str(unity))  # unchanged: not rewritten
    assert os.stat(sources[0]).st_mtime_ns == stamp
    setup.unity_sources(files, 1, folder=str(unity))
    assert sorted(p.name for p in unity.iterdir()) == ["aten_unity_0.cpp"]  # stale one gone


def _has_gpu():
    return os.path.exists("/dev/nvidia0") or subprocess.run(
        "nvidia-smi -L 2>/dev/null | grep -q '^GPU '", shell=True).returncode == 0


@pytest.mark.skipif(_has_gpu(), reason="with a GPU, scripts/demo.sh installs and builds")
def test_demo_script_without_a_gpu_installs_nothing(tmp_path):
    """Without a GPU, scripts/demo.sh says what it would do and exits 0
    before it looks for Python: nothing installed or built."""
    env = dict(os.environ, PYTHON=str(tmp_path / "no-python"))
    done = subprocess.run(["bash", ROOT / "scripts" / "demo.sh"], capture_output=True,
                          text=True, env=env, cwd=tmp_path, timeout=60)
    assert done.returncode == 0, done.stdout + done.stderr
    assert "no NVIDIA GPU here" in done.stdout and "nothing installed" in done.stdout
    assert "make_graphed_callables" in done.stdout
    assert done.stderr == ""
    assert list(tmp_path.iterdir()) == []


def _backend():
    return _load("cgraph_backend", ROOT / "_backend" / "cgraph_backend.py")


def test_isolated_build_asks_for_the_installed_torch_release(tmp_path):
    """Under pip's build isolation (its sitecustomize takes the site-packages
    off sys.path), the backend still finds the installed torch, reads its
    release without importing it, and asks for exactly that release."""
    expected = f"torch=={torch.__version__.split('+')[0]}"
    assert _backend().get_requires_for_build_wheel() == [expected]

    script = textwrap.dedent(f"""
        import importlib.util, sys
        assert importlib.util.find_spec("torch") is None, "isolation failed"
        # pip's build environment has setuptools; these hooks do not use it.
        stub = type(sys)("setuptools.build_meta")
        stub.__all__ = []
        sys.modules.update({{"setuptools": type(sys)("setuptools"), "setuptools.build_meta": stub}})
        sys.path.insert(0, {str(ROOT / "_backend")!r})
        import cgraph_backend
        print(cgraph_backend.get_requires_for_build_wheel())
        print(cgraph_backend.get_requires_for_build_sdist())
        print("torch" in sys.modules)
    """)
    out = _run([sys.executable, "-c", script], env=_pip_isolation(tmp_path), cwd=tmp_path).splitlines()
    assert out == [f"['{expected}']"] * 2 + ["False"], out


def _pip_isolation(folder):
    """The environment pip runs build hooks in: PYTHONPATH names a folder whose
    sitecustomize.py takes the site-packages off sys.path, and user site off."""
    Path(folder, "sitecustomize.py").write_text(textwrap.dedent(f"""
        import os, sys
        drop = {{os.path.normcase(p) for p in {site.getsitepackages()!r}}}
        sys.path[:] = [p for p in sys.path if os.path.normcase(p) not in drop]
    """))
    return dict(os.environ, PYTHONPATH=str(folder), PYTHONNOUSERSITE="1")


def test_isolated_build_refuses_a_cpu_only_torch(tmp_path, monkeypatch):
    """The backend stops before pip downloads anything where the installed
    torch is CPU-only (its torch/version.py says cuda None)."""
    (tmp_path / "version.py").write_text(
        "from typing import Optional\n__version__ = '2.13.0+cpu'\ndebug = False\n"
        "cuda: Optional[str] = None\nhip: Optional[str] = None\n")
    backend = _backend()
    monkeypatch.setattr(backend, "_torch_folder", lambda: str(tmp_path))
    with pytest.raises(SystemExit, match=r"CPU-only: 2\.13\.0\+cpu\. Install a CUDA build"):
        backend.get_requires_for_build_wheel()
    monkeypatch.setattr(backend, "_torch_folder", lambda: None)
    assert backend.get_requires_for_build_wheel() == [backend.MIN_TORCH]

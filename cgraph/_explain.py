"""cgraph.explain: is a callable ready to be graphed, and if not, what to fix.

A CUDA graph replays the GPU work of one captured call: nothing the host
does (Python values read from tensors, copies to the host, CPU ops, the CPU
random generator, branches in Python) runs again, and shapes are fixed.
A capture that meets such a thing fails with a CaptureError naming one
cause; a thing a capture does not notice (a branch on a call counter, a
buffer replaced by a new tensor) makes replays silently differ from eager.

explain() finds all of them at once, without a GPU and without capturing:
it calls the callable eagerly, as make_graphed's warm-up would (a first call,
where lazy initialisation is no problem, then two calls that must agree, each
with a backward where outputs require grad), under a TorchFunctionMode and a
TorchDispatchMode that look at every op, with torch's synchronize and seeding
functions and nn.Module.__setattr__ patched to report.  It compares the ops
of the two checked calls, and looks at the arguments, the module and the
outputs.  Each problem names its kind (CaptureError's kind where one fits),
the op, the user's source line and the fix.  It never raises for what it
finds, and leaves the random generators, the module's buffers and
attributes and the grads as it found them.

What it cannot see is listed in explain's docstring.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import linecache
import os
import re
import sys
import traceback
from typing import Any, Callable, Iterator, NamedTuple

import torch
from torch import nn
from torch.overrides import TorchFunctionMode
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from . import _C, _describe, _fsdp
from ._capture import patched
from ._describe import _CONTAINERS, CONSTANT_TYPES, leaf_names

__all__ = ["explain", "Explanation", "Problem"]

# Frames in these directories are torch's or cgraph's: a problem's place is
# the first frame outside them (the user's line).
_SKIP_DIRS = (os.path.dirname(torch.__file__) + os.sep, os.path.dirname(__file__) + os.sep)
_WARMUP_CALLS, _CHECKED_CALLS = 1, 2
# The device type a graph runs on; every other device's tensors are host memory.
_GPU = "cuda"
# The kinds explain shares with CaptureError.kind, named by the native core's
# one list of them (CG_FAILURE_KINDS in csrc/cgraph.h), so the two agree.
_SYNC, _HOST_COPY, _RNG_CHANGED, _SEED_READ = (
    _C.FAILURE_KINDS[kind] for kind in (_C.FAILURE_SYNC, _C.FAILURE_HOST_COPY,
                                        _C.FAILURE_RNG_CHANGED, _C.FAILURE_SEED_READ))


class Problem(NamedTuple):
    """One thing a graph of the callable would get wrong."""

    kind: str  # CaptureError.kind where one fits ("sync", "host_copy", ...), else explain's own
    op: str  # what ran: "aten.nonzero", "Tensor.item", "torch.cuda.synchronize", ...
    where: str  # "file.py:LINE in func: code", or the argument/output/module it is about
    message: str  # what happened, and why a graph cannot do it
    fix: str  # what to do
    file: str | None = None  # the user's source file, when the problem has a line
    line: int | None = None


@dataclasses.dataclass(frozen=True, repr=False)
class Explanation:
    """What :func:`explain` found: ``problems`` (a tuple of :class:`Problem`),
    ``ok`` (no problem), ``device`` ("cuda", or "cpu" for a callable that ran
    on the CPU); ``str()`` is a readable report."""

    name: str
    problems: tuple[Problem, ...]
    device: str

    @property
    def ok(self) -> bool:
        return not self.problems

    @property
    def kinds(self) -> list[str]:
        """The kinds of the problems, in order (repeats included)."""
        return [p.kind for p in self.problems]

    def __str__(self) -> str:
        if self.ok:
            return f"cgraph.explain({self.name}): ready to graph; no problem found."
        count = len(self.problems)
        lines = [f"cgraph.explain({self.name}): {count} problem{'s' * (count != 1)} "
                 "to fix before graphing:"]
        for number, p in enumerate(self.problems, 1):
            op = f" {p.op}" if p.op else ""
            lines += [f"{number:>2}. [{p.kind}]{op} at {p.where}",
                      f"    {p.message}",
                      f"    fix: {p.fix}"]
        return "\n".join(lines)

    def __repr__(self) -> str:
        state = "ok" if self.ok else f"{len(self.problems)} problems {self.kinds}"
        return f"<cgraph.Explanation of {self.name} on {self.device}: {state}>"


def explain(fn: Callable[..., Any], sample_args: tuple,
            sample_kwargs: dict | None = None) -> Explanation:
    """Checks whether ``fn`` can be graphed with these arguments, and says
    what to fix where it cannot.  Never raises for what it finds (an
    exception of ``fn`` itself is a problem of kind ``"error"``); a
    ``sample_args`` that is not a tuple raises ``TypeError``, as in
    :func:`make_graphed`.

    It calls ``fn(*sample_args, **sample_kwargs)`` three times, eagerly, and
    where outputs require grad runs a backward each time
    (``torch.autograd.grad``: no ``.grad`` changes).  The first call is a
    warm-up, as in make_graphed: what it alone does (lazy initialisation) is
    left out of the report, unless a later call raised.  The other two are
    compared.  Nothing is captured and no GPU is needed: a callable on CPU
    tensors is checked as if its tensors were on the GPU, and the report's
    first problem (``"cpu_op"``) says it must move there.

    Kinds found (``Problem.kind``):

    * ``"sync"``: a value read by the host (``.item()``, ``if tensor:``,
      ``float(t)``, ``.tolist()``, ``print(t)``, ``torch.equal``), a shape
      that depends on the data (``nonzero``, ``x[mask]``, ``unique``,
      ``masked_select``), ``torch.cuda.synchronize()``, a pinned allocation.
    * ``"host_copy"``: ``.cpu()``, ``.numpy()``, ``.to("cpu")``, a copy
      from a CPU tensor to the GPU, ``torch.tensor(data, device="cuda")``.
    * ``"cpu_op"``: an op on CPU tensors (not 0-dim ones); on a CPU
      callable, its first op (one problem), and tensors made without
      ``device=`` that would stay on the CPU after moving.
    * ``"rng_changed"``: random numbers from the CPU generator; a seed or
      RNG state set (``torch.manual_seed``, ``torch.cuda.manual_seed``,
      ``set_rng_state``).  ``"seed_read"``: ``torch.cuda.initial_seed()``.
    * ``"control_flow"``: the two checked calls ran other ops, or ops from
      other lines (a branch on a counter or on random numbers).
      ``"dynamic_shape"``: the same op gave another shape or dtype.
    * ``"argument"``: an argument that is neither a tensor nor a constant (a
      transformers cache), or a CPU tensor of a CUDA callable.
      ``"module"``: a buffer that requires grad, fully_shard inside the module.
    * ``"output"``: an output on the CPU; ``"output_alias"``: an output that
      is an argument or a view of one.  ``"state"``: a tensor assigned to a
      module attribute during the call (a buffer replaced, not updated in
      place).  ``"input_mutation"``: an op writes into an argument that
      requires grad, or into one through ``.data``, which no version
      counter shows (another write is copied back after each replay).
      ``"error"``: the callable raised.

    Not seen: Python's ``random`` and ``numpy.random`` (no torch op runs);
    a global tensor assigned (only module attributes are watched); branches
    that happen to agree on both checked calls; syncs inside custom CUDA
    extensions or other libraries' kernels that torch does not dispatch;
    work on other streams and the legacy stream (needs a capture);
    ``torch.cuda.synchronize`` or seeding functions imported by name before
    the call (``from torch import manual_seed``).  Python state the callable
    changes (a call counter) stays changed; buffers, tensor attributes of the
    module, grads and the CPU and CUDA generators are put back.

    Example::

        import torch, cgraph
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU()).cuda()
        report = cgraph.explain(model, (torch.randn(8, 16, device="cuda"),))
        print(report)            # "ready to graph", or each problem, where and fix
        assert report.ok, report.problems
    """
    fn, args, kwargs = _checked(fn, sample_args, sample_kwargs)
    module = _module_of(fn)
    leaves = [t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
    rec = _Recorder(_device_of(module, leaves))
    names = leaf_names(_signature(fn), args, kwargs)
    rec.extend(_argument_problems(fn, args, kwargs, rec.device))
    rec.extend(_module_problems(fn))
    session = _Session(fn, args, kwargs, names, rec)
    with _state_kept(module, leaves):
        session.run()
    device = rec.device or (_GPU if rec.saw_gpu else "cpu")
    return Explanation(_name_of(fn), rec.problems(session.completed), device)


# ---- arguments, module ------------------------------------------------------


def _checked(fn, args, kwargs):
    """Misuse of explain itself raises, as make_graphed does."""
    if not callable(fn):
        raise TypeError(f"cgraph.explain: fn is a {type(fn).__name__}, not callable.")
    if not isinstance(args, tuple):
        hint = " (write (x,) for one tensor)" if isinstance(args, torch.Tensor) else ""
        raise TypeError(f"cgraph.explain: sample_args must be a tuple{hint}, "
                        f"got {type(args).__name__}.")
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError("cgraph.explain: sample_kwargs must be a dict of keyword arguments, "
                        f"got {type(kwargs).__name__}.")
    # DistributedDataParallel: make_graphed graphs the module inside (_api._unwrap_ddp).
    inner = getattr(fn, "module", None)
    if isinstance(fn, nn.parallel.DistributedDataParallel) and isinstance(inner, nn.Module):
        fn = inner
    return fn, args, kwargs


def _module_of(fn) -> nn.Module | None:
    """The module whose state the calls may change: fn, or the module of a
    bound method."""
    if isinstance(fn, nn.Module):
        return fn
    owner = getattr(fn, "__self__", None)
    return owner if isinstance(owner, nn.Module) else None


def _name_of(fn) -> str:
    if isinstance(fn, nn.Module):
        return type(fn).__name__
    return getattr(fn, "__qualname__", None) or type(fn).__name__


def _device_of(module: nn.Module | None, leaves: list) -> str | None:
    """"cuda" if any argument, parameter or buffer is a CUDA tensor, "cpu"
    if there are tensors but none is; None (decided by the warm-up call's
    ops) if there are no tensors at all."""
    tensors = [*leaves, *(module.parameters() if module else ()),
               *(module.buffers() if module else ())]
    if any(t.device.type == _GPU for t in tensors):
        return _GPU
    return "cpu" if tensors else None


def _signature(fn) -> inspect.Signature | None:
    try:
        return inspect.signature(fn.forward if isinstance(fn, nn.Module) else fn)
    except (TypeError, ValueError):
        return None


def _argument_problems(fn, args, kwargs, device) -> Iterator[Problem]:
    """The rules of cgraph._describe: tensors and constants nested in tuples,
    lists and dicts; anything else is the callable's to change."""
    names = leaf_names(_signature(fn), tuple(range(len(args))), dict.fromkeys(kwargs, 0))
    for name, value in zip(names, (*args, *kwargs.values())):
        yield from _argument_value_problems(name, value, device)


def _argument_value_problems(name: str, value, device) -> Iterator[Problem]:
    if isinstance(value, torch.Tensor):
        if device == _GPU and value.device.type == "cpu":
            yield Problem(
                "argument", "", f"argument '{name}'",
                f"'{name}' is a CPU tensor of shape {tuple(value.shape)}: a graph reads "
                "its inputs from GPU memory (a 0-dim CPU tensor would be read once, at "
                "capture, and replayed with that value).",
                f"pass it as a CUDA tensor ({name}.cuda()).")
        return
    if isinstance(value, CONSTANT_TYPES):
        return
    if isinstance(value, _CONTAINERS):
        items = value.items() if isinstance(value, dict) else enumerate(value)
        for key, child in items:
            yield from _argument_value_problems(f"{name}[{key!r}]", child, device)
        return
    kind = type(value).__name__
    if "Cache" in kind:  # transformers: past_key_values=DynamicCache(...)
        yield Problem(
            "argument", "", f"argument '{name}'",
            f"'{name}' is a {kind}, which the callable appends to: a Python side effect "
            "a graph replay would skip.",
            "call the model with use_cache=False (as training does), or leave this call "
            "eager.")
        return
    yield Problem(
        "argument", "", f"argument '{name}'",
        f"'{name}' is a {kind}; graphed callables take tensors and constants (None, int, "
        "float, bool, str, enum, torch.dtype, ...) nested in tuples, lists or dicts.",
        "bind other values with functools.partial, or pass the tensors they hold.")


def _module_problems(fn) -> Iterator[Problem]:
    """The refusals of cgraph._describe._target_fields, as problems."""
    if not isinstance(fn, nn.Module):
        return
    where = f"module {type(fn).__name__}"
    if _describe.is_graphed_callable(fn.__dict__.get("forward")):
        yield Problem("module", "", where, f"the module {_describe.GRAPHED_ALREADY}.",
                      _describe.GRAPHED_ALREADY_FIX)
    for name, buffer in fn.named_buffers():
        if buffer.requires_grad:
            yield Problem(
                "module", "", f"{where}, buffer '{name}'",
                f"buffer '{name}' requires grad; only parameters may be trainable in a "
                "graphed module.",
                "make it an nn.Parameter.")
    nested = _fsdp.nested(fn)
    if nested is not None:
        yield Problem(
            "module", "", f"{where}, submodule '{nested}'",
            f"fully_shard was applied to '{nested}' inside the module; its all-gathers "
            "would run once, at capture.", _fsdp.NESTED_FIX)
    owner = _fsdp.enclosing(fn)
    if owner is not None:
        yield Problem(
            "module", "", where,
            f"fully_shard manages its parameters as part of {type(owner).__name__}, a module "
            "around it, which frees them after each forward; a graph of this module alone "
            "would read them where they were at capture.", _fsdp.ENCLOSED_FIX)


# ---- where: the user's line -------------------------------------------------


class _Site(NamedTuple):
    file: str
    line: int
    func: str
    code: str

    def __str__(self) -> str:
        file = self.file
        here = os.getcwd() + os.sep
        if file.startswith(here):
            file = file[len(here):]
        return f"{file}:{self.line} in {self.func}: {self.code}"


def _is_user_file(filename: str) -> bool:
    return not filename.startswith(_SKIP_DIRS)


def _user_site(frame) -> _Site | None:
    """The first frame outside torch and cgraph, walking out from `frame`,
    short of explain's own call of the callable (beyond it lies the caller
    of explain, not the callable).  Without one, the forward of the
    innermost torch module (nn.Linear's), if any."""
    start = frame
    while frame is not None and frame.f_code not in _BOUNDARY:
        code = frame.f_code
        if _is_user_file(code.co_filename):
            return _site_of(code.co_filename, frame.f_lineno, code.co_name)
        frame = frame.f_back
    frame = start
    while frame is not None and frame.f_code not in _BOUNDARY:
        code = frame.f_code
        if code.co_name == "forward" and isinstance(frame.f_locals.get("self"), nn.Module):
            owner = type(frame.f_locals["self"]).__name__
            return _site_of(code.co_filename, frame.f_lineno, f"{owner}.forward")
        frame = frame.f_back
    return None


def _site_of(file: str, line: int, func: str) -> _Site:
    return _Site(file, line, func, linecache.getline(file, line).strip())


_TRACEBACK_FRAME = re.compile(r'File "(?P<file>.*)", line (?P<line>\d+), in (?P<func>.*)\n')


def _node_site(node) -> _Site | None:
    """For an op of a backward: the forward line that made its autograd node,
    from the traceback anomaly mode keeps (innermost frame last)."""
    stack = node.metadata.get("traceback_") if node is not None else None
    for entry in reversed(stack or ()):
        match = _TRACEBACK_FRAME.search(entry)
        if match and _is_user_file(match["file"]):
            return _site_of(match["file"], int(match["line"]), match["func"])
    return None


def _error_site(error: BaseException) -> _Site | None:
    """The innermost user frame of an exception's traceback."""
    for frame in reversed(traceback.extract_tb(error.__traceback__)):
        if _is_user_file(frame.filename):
            return _site_of(frame.filename, frame.lineno, frame.name)
    return None


# ---- the recorder -----------------------------------------------------------


class _InternalError(RuntimeError):
    """A bug in explain's own checks: raised, never reported as the callable's."""


class _Argument(NamedTuple):
    """A tensor argument of the checked calls, by the memory it lies in."""

    name: str
    tensor: torch.Tensor


class _Write(NamedTuple):
    """An op writing into an argument that needs no grad, whose version
    counter is read again once the op returned: a write that moved it is
    copied back after each replay (Note [Arguments written in place] in
    csrc/aten_replay.cpp); one that did not (through ``.data``) is not."""

    argument: _Argument
    version: int  # the argument's, before the op
    op: str
    site: Any


class _Op(NamedTuple):
    """One op of a checked call, for comparing calls."""

    phase: str  # "forward" or "backward"
    name: str
    outputs: tuple  # (shape, dtype, device type) per tensor output
    where: str
    site: _Site | None


class _Recorder:
    """What the checks saw: problems (deduplicated by kind, op and place;
    which were seen after the warm-up call) and the ops of each checked call."""

    def __init__(self, device: str | None):
        self.device = device  # _GPU, "cpu", or None until the warm-up call ran
        self.checking = False  # the callable is running (not explain's own work)
        self.call = -1  # which call: 0 is the warm-up; -1 before the calls
        self.saw_gpu = False  # an op of the warm-up call touched a GPU tensor
        self.phase = "forward"
        self.quiet = 0  # inside a host read already reported: its ops are not again
        self.calls: list[list[_Op]] = []  # the ops of each checked call
        self.first_op: _Op | None = None  # of any call
        self.arguments: dict[int, _Argument] = {}  # by the memory they lie in
        # Writes whose counters are read once their op returned: after
        # ADInplaceOrView, above the dispatch mode, moved them.
        self.writes: list[_Write] = []
        self._problems: dict[tuple, Problem] = {}
        self._after_warmup: set[tuple] = set()  # keys seen outside the warm-up call

    @property
    def tracing(self) -> bool:
        return self.checking and self.call >= _WARMUP_CALLS

    def add(self, kind: str, op: str, message: str, fix: str, site: _Site | None,
            where: str | None = None) -> None:
        if where is None:
            where = str(site) if site else "(no Python line: inside torch)"
        if self.phase == "backward":
            message = f"in the backward: {message}"
        key = (kind, where) if kind == "cpu_op" else (kind, op, where)
        self._problems.setdefault(key, Problem(kind, op, where, message, fix,
                                               site.file if site else None,
                                               site.line if site else None))
        if self.call != 0:
            self._after_warmup.add(key)

    def extend(self, problems) -> None:
        for p in problems:
            self.add(p.kind, p.op, p.message, p.fix, None, p.where)

    def first(self, problem: Problem) -> None:
        """Puts this problem before the others."""
        key = (problem.kind, "(first)")
        self._problems = {key: problem, **self._problems}
        self._after_warmup.add(key)

    def problems(self, completed: bool) -> tuple[Problem, ...]:
        """Every problem; once all calls completed, those of the warm-up call
        alone are left out (make_graphed's warm-up runs them eagerly, and
        lazy initialisation belongs there)."""
        return tuple(p for key, p in self._problems.items()
                     if not completed or key in self._after_warmup)

    def is_device(self, t: torch.Tensor) -> bool:
        """A tensor the graph would hold in GPU memory: CUDA tensors, and every
        CPU tensor of a callable that runs on the CPU."""
        return t.device.type == (self.device or _GPU)

    def is_host(self, t: torch.Tensor) -> bool:
        """A CPU tensor of a CUDA callable."""
        return self.device == _GPU and t.device.type == "cpu"


# ---- checks on every op -----------------------------------------------------


_FIX_VALUE = ("keep the value on the GPU and use it as a tensor (torch.where(cond, a, b) "
              "instead of `if tensor:`, clamp instead of min(float(t), ...)), or read it "
              "after the graphed call.")
_FIX_SHAPE = ("use a fixed-shape form (torch.where(mask, x, 0) or masked_fill instead of "
              "x[mask], torch.nonzero_static(x, size=n), repeat_interleave(..., "
              "output_size=n), one_hot(..., num_classes=n)), or do it outside the graphed "
              "callable.")
_FIX_TO_HOST = ("return the tensor and copy it to the host after the graphed call, or keep "
                "the work on the GPU.")
_FIX_FROM_HOST = ("pass the data in as a CUDA tensor argument, or make it once outside the "
                  "call (a registered buffer of the module).")
_FIX_CPU_OP = ("make the tensors on the GPU (device=x.device) and keep the work there, or "
               "do it outside the graphed callable.")
_FIX_CPU_RNG = ("draw random numbers on the GPU (device=x.device, torch.rand_like(x)), or "
                "draw them outside and pass them in.")

_T = torch.Tensor
# Tensor methods that hand a tensor's value to Python: a sync on the GPU.
_READS = {_T.item, _T.__bool__, _T.__float__, _T.__int__, _T.__index__, _T.__complex__,
          _T.tolist, _T.__format__, _T.__repr__}
# Tensor methods that copy a tensor to host memory.
_TO_HOST = {_T.cpu, _T.numpy, _T.__array__}
# torch functions that make a tensor from host data.
_FROM_DATA = {torch.tensor, torch.as_tensor, torch.asarray}
# torch functions drawing random numbers that make a tensor without a tensor argument.
_RANDOM_FACTORIES = {torch.rand, torch.randn, torch.randint, torch.randperm, torch.normal}
_FACTORIES = {torch.zeros, torch.ones, torch.empty, torch.full, torch.arange, torch.range,
              torch.linspace, torch.logspace, torch.eye, torch.tril_indices,
              torch.triu_indices, *_RANDOM_FACTORIES}

_VALUE_OPS = {"aten._local_scalar_dense", "aten.item", "aten.equal", "aten.is_nonzero",
              "aten.allclose"}
_COPY_OPS = {"aten._to_copy", "aten.copy_", "aten._copy_from", "aten._copy_from_and_resize"}
_MASK_INDEX_OPS = {"aten.index", "aten.index_put", "aten.index_put_", "aten._index_put_impl_"}
_PIN_OPS = {"aten._pin_memory", "aten.pin_memory"}


class _FunctionChecks(TorchFunctionMode):
    """Checks at the level the user wrote: Tensor methods and torch functions,
    where the value read, the copy or the factory's device= is visible."""

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        reported = rec.checking and not rec.quiet and self._check(func, args, kwargs)
        rec.quiet += reported
        try:
            out = func(*args, **kwargs)
        finally:
            rec.quiet -= reported
        if rec.checking and not rec.quiet and rec.device == "cpu":
            self._check_cpu_factory(func, args, kwargs, out)
        return out

    def _check(self, func, args, kwargs) -> bool:
        """Reports a host read, a copy to the host or from host data; True if
        it did (the ops it runs are then not reported again)."""
        try:
            found = self._problem(func, args, kwargs)
            if found is not None:
                self.rec.add(*found, _user_site(sys._getframe(2)))
            return found is not None
        except Exception as error:
            raise _InternalError(f"cgraph.explain: checking {func} failed") from error

    def _problem(self, func, args, kwargs) -> tuple[str, str, str, str] | None:
        """(kind, op, message, fix) of this call, or None."""
        rec, this = self.rec, args[0] if args else None
        on_device = isinstance(this, torch.Tensor) and rec.is_device(this)
        op = f"Tensor.{getattr(func, '__name__', func)}"
        if func in _READS and on_device:
            return (_SYNC, op, f"{op} hands a tensor's value to Python: the host waits for "
                    "the GPU, and a graph would replay with the value read at capture.",
                    _FIX_VALUE)
        if (func in _TO_HOST or func is _T.to and self._to_host(args, kwargs)) and on_device:
            return (_HOST_COPY, op, f"{op} copies a tensor to host memory: the host waits "
                    "for the GPU, and a graph cannot return host memory.", _FIX_TO_HOST)
        if func in _FROM_DATA and args and not isinstance(args[0], torch.Tensor) \
                and kwargs.get("device") is not None \
                and torch.device(kwargs["device"]).type == (rec.device or _GPU):
            name = f"torch.{func.__name__}"
            return (_HOST_COPY, name, f"{name}(data, device=...) copies host data to the "
                    "GPU on every call: a graph cannot record a copy from pageable host "
                    "memory.", _FIX_FROM_HOST)
        return None

    def _to_host(self, args, kwargs) -> bool:
        """Whether Tensor.to(...) targets the host.  On a CPU callable only
        the string "cpu" says so (x.to(y.device) is CPU too, and fine)."""
        if self.rec.device == "cpu":
            target = kwargs.get("device", args[1] if len(args) > 1 else None)
            return isinstance(target, str) and target.split(":")[0] == "cpu"
        kwargs = {k: v for k, v in kwargs.items() if k != "copy"}  # _parse_to refuses it
        try:
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
        except (TypeError, RuntimeError):
            return False  # the call itself will raise, and be reported
        return device is not None and device.type == "cpu"

    def _check_cpu_factory(self, func, args, kwargs, out) -> None:
        """On a CPU callable every tensor is on the CPU, so a tensor made by a
        factory without device= is the one that would stay there after the
        model moves to the GPU (and draw from the CPU generator)."""
        if func not in _FACTORIES and func not in _FROM_DATA:
            return
        caller = sys._getframe(2)
        if kwargs.get("device") is not None or not _is_user_file(caller.f_code.co_filename) \
                or _tensors((args, kwargs)):
            return
        site = _user_site(caller)
        name = f"torch.{func.__name__}"
        if func in _RANDOM_FACTORIES:
            self.rec.add(_RNG_CHANGED, name, f"{name} without device= draws from the CPU "
                         "generator, and stays on the CPU after the model moves to the GPU: a "
                         "graph would replay the numbers drawn at capture.", _FIX_CPU_RNG, site)
        elif isinstance(out, torch.Tensor) and out.dim() > 0:
            self.rec.add("cpu_op", name, f"{name} without device= makes a CPU tensor, which "
                         "stays on the CPU after the model moves to the GPU: a graph records "
                         "GPU work only.", _FIX_CPU_OP, site)


class _DispatchChecks(TorchDispatchMode):
    """Checks every aten op, whatever called it: syncs, data-dependent
    shapes, copies between host and GPU, CPU ops, the CPU generator; and
    records each op of a checked call for the comparison of calls."""

    def __init__(self, rec: _Recorder):
        super().__init__()
        self.rec = rec

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rec = self.rec
        if not rec.checking:
            return func(*args, **kwargs)
        try:
            _settle_writes(rec)
            name = str(func.overloadpacket)
            site = self._site()
            if not rec.quiet:
                self._before(func, name, args, kwargs, site)
        except Exception as error:
            raise _InternalError(f"cgraph.explain: checking {func} failed") from error
        out = func(*args, **kwargs)
        try:
            if not rec.quiet:
                self._after(func, name, args, kwargs, out, site)
            outputs = tuple((tuple(t.shape), t.dtype, t.device.type) for t in _tensors(out))
            op = _Op(rec.phase, name, outputs, str(site), site)
            rec.first_op = rec.first_op or op
            if rec.tracing:
                rec.calls[-1].append(op)
            elif rec.device is None:
                rec.saw_gpu = rec.saw_gpu or any(
                    t.device.type == _GPU for t in _tensors((args, kwargs, out)))
        except Exception as error:
            raise _InternalError(f"cgraph.explain: checking {func} failed") from error
        return out

    def _site(self) -> _Site | None:
        """The user's line; in a backward with no user frame on the stack (a
        built-in backward formula), the forward line that made the node."""
        site = _user_site(sys._getframe(2))
        if site is None and self.rec.phase == "backward":
            site = _node_site(torch._C._current_autograd_node())
        return site

    def _before(self, func, name, args, kwargs, site) -> None:
        rec = self.rec
        if name in _PIN_OPS or kwargs.get("pin_memory"):
            rec.add(_SYNC, name, f"{name} allocates pinned host memory, which synchronizes "
                    "the device.", "allocate pinned buffers once, outside the graphed "
                    "callable.", site)
        elif name in _COPY_OPS:
            if any(rec.is_device(t) for t in _tensors((args, kwargs))):
                self._check_argument_written(func, name, args, kwargs, site)  # buf[:, 0] = x
            if rec.device == _GPU:
                self._check_copy(name, args, kwargs, site)
        elif any(rec.is_device(t) for t in _tensors((args, kwargs))):
            self._check_argument_written(func, name, args, kwargs, site)
            if name in _VALUE_OPS or torch.Tag.data_dependent_output in func.tags:
                rec.add(_SYNC, name, f"{name} reads a tensor's value on the host: the host "
                        "waits for the GPU, and a graph would replay with the value read at "
                        "capture.", _FIX_VALUE, site)
            elif _data_dependent_shape(func, name, args, kwargs):
                what = ("indexes with a boolean mask" if name in _MASK_INDEX_OPS else
                        "makes a tensor whose shape depends on the data")
                rec.add(_SYNC, name, f"{name} {what}: the host waits for the GPU to learn "
                        "how many elements there are, and a graph has fixed shapes.",
                        _FIX_SHAPE, site)

    def _check_argument_written(self, func, name, args, kwargs, site) -> None:
        """An op writing into the memory of an argument of the call."""
        if not func._schema.is_mutable or not self.rec.arguments:
            return
        for position, argument in enumerate(func._schema.arguments):
            if argument.alias_info is None or not argument.alias_info.is_write:
                continue
            value = args[position] if position < len(args) else kwargs.get(argument.name)
            if not isinstance(value, torch.Tensor) or not value.untyped_storage().data_ptr():
                continue
            passed = self.rec.arguments.get(value.untyped_storage().data_ptr())
            if passed is None:
                continue
            if value.requires_grad:
                written = passed.name
                self.rec.add("input_mutation", name, f"{name} writes into argument "
                             f"'{written}' in place, which requires grad: a graph's copy of "
                             "such an argument is a leaf, which autograd lets no op write in "
                             "place (the warm-up raises).", "write into a copy "
                             f"({written} = {written}.clone()), or return the new value as an "
                             "output.", site)
            elif not passed.tensor.is_inference():  # which has no counter to read
                self.rec.writes.append(_Write(passed, passed.tensor._version, name, site))

    def _check_copy(self, name, args, kwargs, site) -> None:
        source, target = _copy_devices(name, args, kwargs)
        if source == _GPU and target == "cpu":
            self.rec.add(_HOST_COPY, name, f"{name} copies a GPU tensor to host memory: the "
                         "host waits for the GPU, and a graph cannot return host memory.",
                         _FIX_TO_HOST, site)
        elif source == "cpu" and target == _GPU:
            self.rec.add(_HOST_COPY, name, f"{name} copies a CPU tensor to the GPU: a graph "
                         "cannot record a copy from pageable host memory, and would not see "
                         "later values of the CPU tensor.", _FIX_FROM_HOST, site)

    def _after(self, func, name, args, kwargs, out, site) -> None:
        rec = self.rec
        if rec.device != _GPU or name in _COPY_OPS:
            return
        tensors = _tensors((args, kwargs, out))
        host = [t for t in tensors if rec.is_host(t)]
        if not host:
            return
        # An op with a GPU tensor draws from the GPU's generator, even where it
        # returns CPU tensors (flash attention's philox seed and offset).
        if torch.Tag.nondeterministic_seeded in func.tags and \
                not any(t.device.type == _GPU for t in tensors):
            rec.add(_RNG_CHANGED, name, f"{name} draws random numbers from the CPU "
                    "generator: a graph records GPU work only, and would replay the numbers "
                    "drawn at capture.", _FIX_CPU_RNG, site)
        elif any(t.dim() > 0 for t in host):
            rec.add("cpu_op", name, f"{name} works on CPU tensors: a graph records GPU work "
                    "only, so it would run once, at capture, and replays would reuse its "
                    "result.", _FIX_CPU_OP, site)


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in pytree.tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _data_dependent_shape(func, name, args, kwargs) -> bool:
    """Ops whose output shape depends on tensor values (torch tags them),
    but the forms that are given the size or index without a mask."""
    if name in _MASK_INDEX_OPS:
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(isinstance(i, torch.Tensor) and i.dtype in (torch.bool, torch.uint8)
                   for i in indices or ())
    if torch.Tag.dynamic_output_shape not in func.tags:
        return False
    if name == "aten.repeat_interleave":
        return kwargs.get("output_size") is None
    if name == "aten.one_hot":
        classes = args[1] if len(args) > 1 else kwargs.get("num_classes", -1)
        return classes == -1
    return True


def _settle_writes(rec: "_Recorder") -> None:
    """The writes into arguments noted before their ops ran: one that left
    the argument's version counter where it was (through ``.data``, whose
    counter is its own) cannot be copied back after a replay."""
    for write in rec.writes:
        if write.argument.tensor._version == write.version:
            written = write.argument.name
            rec.add("input_mutation", write.op, f"{write.op} writes into argument "
                    f"'{written}' through a tensor that does not share its version counter "
                    "(.data): cgraph cannot see the write to copy it back, so a replay "
                    "writes only the graph's copy of the argument.",
                    f"write into the argument itself ({written}.add_(...), not "
                    f"{written}.data.add_(...)), or return the new value as an output.",
                    write.site)
    rec.writes.clear()


def _copy_devices(name, args, kwargs) -> tuple[str | None, str | None]:
    """(source device type, target device type) of a copy op."""
    if name == "aten._to_copy":
        source = args[0].device
        target = kwargs.get("device") or source
        return source.type, torch.device(target).type
    if name == "aten.copy_":
        return args[1].device.type, args[0].device.type
    return args[0].device.type, args[1].device.type  # _copy_from(self, dst)


# ---- patches: synchronize, seeds, module attributes --------------------------


def _reporting(rec: _Recorder, kind: str, op: str, message: str, fix: str, original,
               from_torch_too: bool = False, call_original=lambda: True):
    """A stand-in for `original` that reports a problem when the user's code
    calls it (or anyone does, with from_torch_too), then calls it."""
    def stand_in(*args, **kwargs):
        caller = sys._getframe(1)
        if rec.checking and not rec.quiet and (
                from_torch_too or _is_user_file(caller.f_code.co_filename)):
            rec.add(kind, op, message, fix, _user_site(caller))
        return original(*args, **kwargs) if call_original() else None
    return stand_in


def _patches(rec: _Recorder) -> dict:
    """(owner, name) -> stand-in, for patched."""
    patches = {}
    sync_fix = ("remove it from the callable; synchronize after the graphed call if the "
                "host must wait.")
    # On a machine without a GPU (a CPU callable) there is nothing to wait for.
    cuda_up = torch.cuda.is_initialized
    syncs = [(torch.cuda, "synchronize", "torch.cuda.synchronize", cuda_up),
             (torch.cuda.Stream, "synchronize", "torch.cuda.Stream.synchronize", None),
             (torch.cuda.Event, "synchronize", "torch.cuda.Event.synchronize", None)]
    for owner, name, op, gate in syncs:
        patches[owner, name] = _reporting(
            rec, _SYNC, op, f"{op}() makes the host wait for the GPU; a graph cannot record "
            "it (capture fails).", sync_fix, getattr(owner, name), from_torch_too=True,
            call_original=gate or (lambda: True))
    seed_fix = ("seed outside the graphed callable; a graph would not reseed on replay. "
                "Draw random numbers on the GPU.")
    for owner, name in [(torch, "manual_seed"), (torch.random, "manual_seed"),
                        (torch, "seed"), (torch.random, "seed"),
                        (torch, "set_rng_state"), (torch.random, "set_rng_state"),
                        (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"),
                        (torch.cuda, "seed"), (torch.cuda, "seed_all"),
                        (torch.cuda, "set_rng_state"), (torch.cuda, "set_rng_state_all")]:
        op = f"{owner.__name__}.{name}"
        patches[owner, name] = _reporting(
            rec, _RNG_CHANGED, op, f"{op}() sets a random generator's state during the "
            "call: that happens once, at capture, and never on replay.", seed_fix,
            getattr(owner, name))
    patches[torch.cuda, "initial_seed"] = _reporting(
        rec, _SEED_READ, "torch.cuda.initial_seed", "torch.cuda.initial_seed() reads the "
        "CUDA generator's seed during the call, which a capture refuses.",
        "read the seed outside the graphed callable.", torch.cuda.initial_seed)
    patches[nn.Module, "__setattr__"] = _setattr_reporting(rec, nn.Module.__setattr__)
    return patches


def _setattr_reporting(rec: _Recorder, original):
    """nn.Module.__setattr__ reporting a tensor assigned to a module by the
    user's code during a checked call (not in a module's __init__)."""
    def __setattr__(module, name, value):
        caller = sys._getframe(1)
        if rec.checking and isinstance(value, torch.Tensor) \
                and _is_user_file(caller.f_code.co_filename) \
                and caller.f_code.co_name != "__init__":
            rec.add("state", f"{type(module).__name__}.{name} =",
                    f"a new tensor is assigned to '{name}' of the {type(module).__name__} on "
                    "every call: a graph writes into the tensors it captured, so after "
                    "replays the attribute keeps the tensor made at capture, in the graph's "
                    "memory, overwritten by each replay.",
                    f"update it in place (self.{name}.copy_(new), or mul_/add_), or return "
                    "it as an output.", _user_site(caller))
        return original(module, name, value)
    return __setattr__


# ---- the calls --------------------------------------------------------------


class _Session:
    """Calls the callable (warm-up, then the checked calls), each with a
    backward, under the checks; then compares the checked calls and looks at
    the outputs."""

    def __init__(self, fn, args, kwargs, names: list[str], rec: _Recorder):
        self.fn, self.args, self.kwargs, self.rec = fn, args, kwargs, rec
        self.names = names  # of the pytree leaves of (args, kwargs)
        self.completed = False  # every call ran without raising
        for name, leaf in zip(names, pytree.tree_leaves((args, kwargs))):
            if isinstance(leaf, torch.Tensor) and leaf.untyped_storage().data_ptr():
                rec.arguments.setdefault(leaf.untyped_storage().data_ptr(),
                                         _Argument(name, leaf))

    def run(self) -> None:
        rec = self.rec
        # Anomaly mode keeps each autograd node's forward traceback: the line
        # of a problem in a built-in backward (without NaN checks).
        with patched(_patches(rec)), \
                torch.autograd.set_detect_anomaly(True, check_nan=False), \
                _FunctionChecks(rec), _DispatchChecks(rec):
            for number in range(_WARMUP_CALLS + _CHECKED_CALLS):
                if number == _WARMUP_CALLS and rec.device is None:
                    rec.device = _GPU if rec.saw_gpu else "cpu"
                if not self._once(number):
                    break
            else:
                self.completed = True
        if self.completed:
            self._compare()
        if rec.device == "cpu":
            self._on_the_cpu()

    def _once(self, number: int) -> bool:
        """One call and its backward; False if the callable raised."""
        rec = self.rec
        rec.call = number
        if number >= _WARMUP_CALLS:
            rec.calls.append([])
        rec.checking, rec.phase = True, "forward"
        try:
            out = self._call()
            _settle_writes(rec)
            self._backward(out)
        except _InternalError:
            raise
        except Exception as error:
            rec.checking = False
            rec.add("error", type(error).__name__,
                    f"the callable raised {type(error).__name__}: {error}",
                    "fix the error: explain calls the callable eagerly with the sample "
                    "arguments, as make_graphed's warm-up would.", _error_site(error))
            return False
        finally:
            rec.checking, rec.phase = False, "forward"
        if number >= _WARMUP_CALLS:
            self._check_outputs(out)
        return True

    def _call(self):
        return self.fn(*self.args, **self.kwargs)

    def _backward(self, out) -> None:
        """torch.autograd.grad from every output that requires grad to every
        leaf it reaches: the backward runs, no .grad changes."""
        roots = [t for t in _tensors(out) if t.grad_fn is not None]
        leaves = _autograd_leaves(roots)
        if not leaves:
            return
        checking, self.rec.checking = self.rec.checking, False
        grads = [torch.ones_like(t) for t in roots]
        self.rec.checking, self.rec.phase = checking, "backward"
        torch.autograd.grad(roots, leaves, grads, allow_unused=True)

    def _check_outputs(self, out) -> None:
        rec = self.rec
        inputs = [(name, t) for name, t in zip(
            self.names, pytree.tree_leaves((self.args, self.kwargs)))
            if isinstance(t, torch.Tensor)]
        for path, value in pytree.tree_flatten_with_path(out)[0]:
            if not isinstance(value, torch.Tensor):
                continue
            where = "output" + pytree.keystr(path)
            if rec.device == _GPU and value.device.type != _GPU:
                rec.add("output", "", f"{where} is on {value.device}: a graph's outputs live in "
                        "its CUDA memory.", "return the CUDA tensor and call .cpu() after "
                        "the graphed call.", None, where)
            for name, t in inputs:
                if value.numel() and t.numel() and _same_memory(value, t):
                    rec.add("output_alias", "", f"{where} is argument '{name}' or a view of "
                            "it: a graph returns a view of its own copy of the argument, so "
                            "writes through the output no longer reach the tensor passed, "
                            "and the next call overwrites it.", "return a new tensor "
                            f"({name}.clone()) rather than the argument or a view of it.",
                            None, where)

    def _compare(self) -> None:
        """The checked calls must run the same ops from the same lines with
        the same shapes: a graph replays the ops of the call it captured."""
        first, *others = self.rec.calls
        for number, other in enumerate(others, _WARMUP_CALLS + 2):
            self._compare_two(first, other, number)

    def _compare_two(self, first: list[_Op], other: list[_Op], number: int) -> None:
        rec, before = self.rec, _WARMUP_CALLS + 1
        for a, b in zip(first, other):
            if (a.phase, a.name, a.where) != (b.phase, b.name, b.where):
                rec.add("control_flow", b.name, f"call {number} ran {b.name} ({b.phase}) "
                        f"where call {before} ran {a.name} at {a.where}: with the same "
                        "arguments the calls ran other ops, and a graph replays only the "
                        "ops of the call it captured.", _FIX_CONTROL, b.site)
                return
            if a.outputs != b.outputs:
                rec.add("dynamic_shape", b.name, f"{b.name} returned "
                        f"{_describe_outputs(b.outputs)} on call {number} and "
                        f"{_describe_outputs(a.outputs)} on call {before}, with the same "
                        "arguments: a graph has fixed shapes and dtypes.",
                        "keep shapes fixed on every call (pad to a maximum size); shapes that "
                        "follow the arguments' shapes are fine (one graph per shape).", b.site)
                return
        if len(first) != len(other):
            longer, number = (other, number) if len(other) > len(first) else (first, before)
            extra = longer[min(len(first), len(other))]
            rec.add("control_flow", extra.name, f"call {number} ran more ops than the other, "
                    f"from {extra.name} ({extra.phase}) on: with the same arguments the calls "
                    "ran other ops, and a graph replays only the ops of the call it captured.",
                    _FIX_CONTROL, extra.site)

    def _on_the_cpu(self) -> None:
        """A CPU callable: one problem, first, at its first op."""
        first = self.rec.first_op
        problem = Problem(
            "cpu_op", first.name if first else "",
            first.where if first and first.site else "(no op ran)",
            "the callable runs on the CPU (no argument, parameter or buffer is a CUDA "
            "tensor): a CUDA graph records GPU work only.",
            "move the module and the arguments to the GPU (module.cuda(), x.cuda()). The "
            "other checks treated these CPU tensors as if they were on the GPU.",
            first.site.file if first and first.site else None,
            first.site.line if first and first.site else None)
        self.rec.first(problem)


_FIX_CONTROL = ("make every call run the same ops: no Python branch on a call counter, random "
                "numbers or tensor values (compute both sides and pick with torch.where), or "
                "graph each branch as its own callable.")
# Frames past these are explain's caller, not the callable (see _user_site).
_BOUNDARY = frozenset({_Session._call.__code__, _Session._backward.__code__})


def _describe_outputs(outputs: tuple) -> str:
    return ", ".join(f"{list(shape)} {str(dtype).replace('torch.', '')}"
                     for shape, dtype, _ in outputs) or "nothing"


def _same_memory(a: torch.Tensor, b: torch.Tensor) -> bool:
    pointer = a.untyped_storage().data_ptr()
    return pointer != 0 and a.device == b.device and \
        pointer == b.untyped_storage().data_ptr()


def _autograd_leaves(roots: list[torch.Tensor]) -> list[torch.Tensor]:
    """Every leaf that requires grad reachable from roots (parameters,
    arguments, tensors in closures)."""
    leaves, seen, stack = {}, set(), [t.grad_fn for t in roots]
    while stack:
        node = stack.pop()
        if node is None or node in seen:
            continue
        seen.add(node)
        variable = getattr(node, "variable", None)
        if isinstance(variable, torch.Tensor):
            leaves[id(variable)] = variable
        stack.extend(next_node for next_node, _ in node.next_functions)
    return list(leaves.values())


# ---- state put back ---------------------------------------------------------


@contextlib.contextmanager
def _state_kept(module: nn.Module | None, leaves: list) -> Iterator[None]:
    """Puts back what the calls change that explain can reach: the CPU and
    CUDA generators, the module's parameters, buffers (values too) and
    tensor attributes, the arguments' values, and the grads of parameters
    and arguments."""
    cpu_rng = torch.random.get_rng_state()
    cuda_rng = torch.cuda.get_rng_state_all() if torch.cuda.is_initialized() else None
    modules = list(module.modules()) if module is not None else []
    saved = [(m, dict(m._parameters), dict(m._buffers), _tensor_attributes(m))
             for m in modules]
    with torch.no_grad():
        values = {id(b): (b, b.clone()) for m in modules for b in m._buffers.values()
                  if b is not None}
    # autograd.grad leaves .grad alone; the references are put back in case
    # the callable assigns grads itself.
    grads = [(t, t.grad) for t in [*leaves, *(module.parameters() if module else ())]
             if t.is_leaf]
    with torch.no_grad():  # a callable may write into them
        arguments = [(t, t.clone()) for t in leaves if not _overlaps_itself(t)]
    try:
        yield
    finally:
        torch.random.set_rng_state(cpu_rng)
        if cuda_rng is not None:
            torch.cuda.set_rng_state_all(cuda_rng)
        for m, parameters, buffers, attributes in saved:
            m._parameters.clear()
            m._parameters.update(parameters)
            m._buffers.clear()
            m._buffers.update(buffers)
            for name in _tensor_attributes(m):
                if name not in attributes:
                    del m.__dict__[name]
            m.__dict__.update(attributes)
        with torch.no_grad():
            for tensor, value in [*values.values(), *arguments]:
                # Not one resized by the callable (left so), nor one whose
                # elements share memory (an expanded mask, as transformers
                # builds), which no op can have written and none can copy into.
                if tensor.shape == value.shape and not _overlaps_itself(tensor):
                    tensor.copy_(value)
        for t, grad in grads:
            t.grad = grad


def _overlaps_itself(t: torch.Tensor) -> bool:
    return torch._debug_has_internal_overlap(t) == 1  # 2: cannot tell, copied as before


def _tensor_attributes(module: nn.Module) -> dict:
    return {k: v for k, v in module.__dict__.items() if isinstance(v, torch.Tensor)}

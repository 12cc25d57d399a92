"""The public entry points.  Thin: they check arguments the way torch does
(with messages that say what to do), describe each callable to the native
core, and wrap what comes back.  Warm-up, capture and replay are in csrc/."""

from __future__ import annotations

import atexit
import enum
import inspect
import weakref
from typing import Any, Callable, NamedTuple, Sequence

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel
from torch.utils import _pytree as pytree

from . import _C, _log
from ._capture import capture_session

__all__ = ["make_graphed_callables", "make_graphed", "GraphedModule", "graph_pool_handle",
           "reset_all"]

_CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}
# What a replay does to an earlier call's outputs still held: cgraph.h's
# cg_kept_outputs, Note [Outputs of earlier calls] in csrc/aten_replay.cpp.
_KEPT_OUTPUTS = {"copy": 0, "error": 1, "alias": 2}

# Non-tensor arguments a graph can bake in as constants: each call must pass
# the captured value again (checked in C on every call).
_CONSTANT_TYPES = (bool, int, float, complex, str, bytes, enum.Enum, torch.dtype,
                   torch.device, torch.layout, torch.memory_format)


# Every graphed callable not yet freed, for reset_all().
_live: "weakref.WeakSet[_C.Graphed]" = weakref.WeakSet()


def reset_all() -> None:
    """Free every live graphed callable's graphs, static tensors and pool memory.

    Call it before ``torch.distributed.destroy_process_group()`` or before
    re-graphing a whole model.  Later calls of a reset callable raise.  It also
    runs at interpreter exit, so graphs are freed while CUDA is still up.
    """
    for graphed in list(_live):
        graphed.reset()


atexit.register(reset_all)
_C.set_event_hook(_log.on_event)
_log.configure_from_environment()


def graph_pool_handle() -> tuple[int, int]:
    """A fresh memory-pool handle to share between captures (``pool=``).

    Interchangeable with :func:`torch.cuda.graph_pool_handle`.
    """
    _require_cuda()
    return _C.new_pool()


def make_graphed_callables(
    callables,
    sample_args,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool=None,
    capture_error_mode: str = "global",
    enable_annotations: bool = False,
    *,
    sample_kwargs=None,
    kept_outputs: str = "copy",
    guard_outputs: bool | None = None,
):
    """Drop-in for :func:`torch.cuda.make_graphed_callables`.

    Same arguments, same return structure: one callable in, one out; a tuple
    in, a tuple out; modules come back themselves with ``forward`` replaced.
    Graphs of a tuple of callables share one memory pool: capture forwards in
    the order they run, backwards in reverse, and replay in that order.

    ``sample_kwargs`` (keyword-only, as in Transformer Engine): keyword
    arguments for each callable, a dict (one callable) or a tuple of dicts.
    Calls must pass the same keywords.  Arguments may be pytrees of tensors
    and of constants (int, float, bool, str, enum, torch.dtype, ...); a
    constant is captured into the graph, and a call with another value
    raises ``ValueError`` naming it.

    Arguments the samples leave out may be passed with the callable's own
    default values (``mask=None``, ``use_cache=False``, as Hugging Face
    models spell them out): the call binds as the capture did and replays.

    ``kept_outputs`` (keyword-only): outputs live in the graph's memory,
    which the next call overwrites.  ``"copy"`` (the default): before that,
    every earlier output still referenced (a list of predictions, a loss
    kept for later, IPython's ``Out[]``, a tensor autograd saved) is moved
    to memory of its own, so it keeps its value; an output nobody holds
    costs nothing.  ``"error"``: reading such an output raises.  ``"alias"``:
    it silently shows the new values, as with torch.  ``guard_outputs=True``
    / ``False`` is the older spelling of ``"error"`` / ``"alias"``.

    Differences from torch, all toward eager semantics:

    * ``param.grad`` accumulates across backward passes exactly as in eager
      (torch hands out a buffer the next replay overwrites).
    * Outputs of earlier calls keep their values (``kept_outputs``).
    * A call made before the backward of the previous call ran (a siamese
      model, several micro-batch forwards) runs eagerly, so every backward
      is right; torch overwrites the activations that backward needs.
      ``stats["eager_pending"]`` counts them.
    * An argument of another shape or device raises ``ValueError``; one of
      another floating dtype is cast into the static input, as torch does.
    * Leaves that require grad but are neither arguments nor parameters (a
      tensor in a closure) get their grads; torch drops them silently.
    * Warm-up leaves module buffers (BatchNorm running stats) as they were.
    * Deleting the graphed callable returns its pool memory to the device.
    * Autocast works with its weight cache on (torch requires it off).
    * ``torch.utils.checkpoint`` works inside (``use_reentrant`` False or
      True), dropout included: the recompute redraws the forward's masks.
    * Replacing a parameter after capture (``load_state_dict(assign=True)``)
      raises on the next call instead of reading the old tensor.

    Example::

        import torch, cgraph
        model = torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.GELU()).cuda()
        x = torch.randn(8, 16, device="cuda", requires_grad=True)
        model = cgraph.make_graphed_callables(model, (x,))
        model(torch.randn(8, 16, device="cuda")).sum().backward()
    """
    if enable_annotations:
        raise ValueError(
            "cgraph: enable_annotations=True (torch.cuda.graph_annotations) is not "
            "supported yet; pass enable_annotations=False."
        )
    just_one = not isinstance(callables, tuple)
    if just_one:
        callables, sample_args, sample_kwargs = (callables,), (sample_args,), (sample_kwargs,)
    else:
        if not isinstance(sample_args, tuple) or len(sample_args) != len(callables):
            raise ValueError(
                f"cgraph: got {len(callables)} callables, so sample_args must be a tuple of "
                f"{len(callables)} tuples of tensors (one per callable)."
            )
        if sample_kwargs is None:
            sample_kwargs = (None,) * len(callables)
        elif not isinstance(sample_kwargs, tuple) or len(sample_kwargs) != len(callables):
            raise ValueError(
                f"cgraph: got {len(callables)} callables, so sample_kwargs must be a tuple of "
                f"{len(callables)} dicts (or None), one per callable."
            )
    targets = tuple(_unwrap_ddp(fn) for fn in callables)
    graphed = _graph(targets, sample_args, sample_kwargs, num_warmup_iters,
                     allow_unused_input, pool, capture_error_mode,
                     _kept_outputs(kept_outputs, guard_outputs))
    out = []
    for fn, target, g in zip(callables, targets, graphed):
        if isinstance(target, nn.Module):
            target.forward = g
            out.append(fn)
        else:
            out.append(g)
    return out[0] if just_one else tuple(out)


def make_graphed(
    fn: Callable[..., Any],
    sample_args: tuple,
    *,
    sample_kwargs: dict | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool=None,
    capture_error_mode: str = "global",
    kept_outputs: str = "copy",
    guard_outputs: bool | None = None,
):
    """Graph one callable.

    ``sample_kwargs``, ``kept_outputs`` and constant arguments work as in
    :func:`make_graphed_callables`.  Returns a :class:`GraphedModule` for an
    ``nn.Module`` (the module stays untouched inside it) and a graphed
    callable for anything else.  A ``DistributedDataParallel`` model comes
    back itself, with the module it wraps graphed: DDP's per-call
    bookkeeping and its gradient hooks keep running around the graphs.  Both have
    ``reset()``, which frees the graphs and their pool, and ``pool``, a
    handle to share with later captures.

    Example::

        import torch, cgraph
        mlp = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU()).cuda()
        graphed = cgraph.make_graphed(mlp, (torch.randn(32, 64, device="cuda"),))
        x = torch.randn(32, 64, device="cuda")
        torch.testing.assert_close(graphed(x), mlp(x))
        graphed.reset()
    """
    target = _unwrap_ddp(fn)
    (g,) = _graph((target,), (sample_args,), (sample_kwargs,), num_warmup_iters,
                  allow_unused_input, pool, capture_error_mode,
                  _kept_outputs(kept_outputs, guard_outputs))
    if target is not fn:  # DistributedDataParallel: see _unwrap_ddp
        target.forward = g
        return fn
    return GraphedModule(fn, g) if isinstance(fn, nn.Module) else g


class GraphedModule(nn.Module):
    """An ``nn.Module`` whose forward replays CUDA graphs of ``self.module``.

    Parameters, buffers and ``state_dict`` are those of the wrapped module
    (under ``module.``, as with DDP).  In the other train/eval mode than at
    capture, the wrapped module runs eagerly.  Build it with
    :func:`make_graphed`.
    """

    def __init__(self, module: nn.Module, graphed: _C.Graphed):
        super().__init__()
        self.module = module
        # Instance attributes, so nn.Module.__call__ goes straight to C.
        self.__dict__["_graphed"] = graphed
        self.__dict__["forward"] = graphed

    def reset(self) -> None:
        """Free the graphs, their static tensors and their memory pool."""
        self._graphed.reset()

    @property
    def pool(self) -> tuple[int, int]:
        """The graphs' memory pool, usable as ``pool=`` for later captures."""
        return self._graphed.pool

    @property
    def is_reset(self) -> bool:
        return self._graphed.is_reset

    @property
    def stats(self) -> dict[str, int]:
        """How often each replay path ran (see ``cgraph.Graphed.stats``)."""
        return self._graphed.stats

    @property
    def graphs(self) -> dict[str, dict[str, int] | None]:
        """What the forward and backward graphs are made of (see
        ``cgraph.Graphed.graphs``)."""
        return self._graphed.graphs

    def extra_repr(self) -> str:
        g = self._graphed
        state = "reset" if g.is_reset else f"inputs={g.num_inputs}, params={g.num_params}"
        return f"graphed: {state}, pool={g.pool}"


# ---- describing callables to the native core --------------------------------


def _unwrap_ddp(fn):
    """DistributedDataParallel's forward does per-call bookkeeping in Python
    (prepare_for_backward) that its gradient hooks rely on, so cgraph graphs
    the module inside and leaves DDP around it.  Collectives then run from
    DDP's hooks outside the graphs; none is ever captured."""
    return fn.module if isinstance(fn, DistributedDataParallel) else fn


def _require_cuda() -> None:
    if _C.device_count() == 0 or not torch.cuda.is_available():
        raise RuntimeError(
            "cgraph: no CUDA device is available (torch.cuda.is_available() is False). "
            "CUDA graphs need an NVIDIA GPU; run the callable eagerly on this machine."
        )


def _pool_id(pool) -> tuple[int, int] | None:
    if pool is None:
        return None
    if hasattr(pool, "id") and not isinstance(pool, tuple):  # torch.cuda.MemPool
        pool = pool.id
    if (
        isinstance(pool, tuple)
        and len(pool) == 2
        and all(isinstance(v, int) and not isinstance(v, bool) for v in pool)
    ):
        return pool
    raise TypeError(
        "cgraph: pool must be a handle from torch.cuda.graph_pool_handle(), "
        f"cgraph.graph_pool_handle(), a graphed callable's .pool, or a torch.cuda.MemPool; "
        f"got {pool!r}."
    )


def _kept_outputs(kept_outputs: str, guard_outputs: bool | None) -> str:
    """kept_outputs, or what the older guard_outputs said."""
    if guard_outputs is not None:
        older = "error" if guard_outputs else "alias"
        if kept_outputs not in ("copy", older):
            raise ValueError(
                f"cgraph: guard_outputs={guard_outputs} and kept_outputs={kept_outputs!r} "
                f"disagree; pass kept_outputs alone (guard_outputs={guard_outputs} is "
                f"kept_outputs={older!r})."
            )
        return older
    return kept_outputs


def _graph(callables, sample_args, sample_kwargs, num_warmup_iters, allow_unused_input, pool,
           capture_error_mode, kept_outputs):
    if capture_error_mode not in _CAPTURE_MODES:
        raise ValueError(
            f"cgraph: capture_error_mode must be one of {sorted(_CAPTURE_MODES)}, "
            f"got {capture_error_mode!r}."
        )
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 0:
        raise ValueError(
            f"cgraph: num_warmup_iters must be a non-negative int, got {num_warmup_iters!r}."
        )
    if kept_outputs not in _KEPT_OUTPUTS:
        raise ValueError(
            f"cgraph: kept_outputs must be one of {sorted(_KEPT_OUTPUTS)}, got {kept_outputs!r}."
        )
    claimed: set[int] = set()  # sample memory already used as a static input
    drafts = [_draft(i, fn, args, kwargs, claimed)
              for i, (fn, args, kwargs) in enumerate(zip(callables, sample_args, sample_kwargs))]
    pool_id = _pool_id(pool)
    _require_cuda()
    device = _device_of(drafts)
    specs = tuple(_C.CallableSpec(**draft.fields, device=device) for draft in drafts)
    with capture_session(specs):
        graphed = _C.graph_callables(specs, pool_id, num_warmup_iters, bool(allow_unused_input),
                                     _CAPTURE_MODES[capture_error_mode],
                                     _KEPT_OUTPUTS[kept_outputs])
    _live.update(graphed)
    return graphed


class _StateCheck:
    """verify(module), called by graphed.c after any module anywhere registered
    a parameter, buffer or submodule: raises if this module's parameters or
    buffers are no longer the tensors its graphs read."""

    __slots__ = ("index", "captured")

    def __init__(self, index: int, module: nn.Module):
        self.index = index
        self.captured = dict(_named_state(module))

    def __call__(self, module: nn.Module) -> None:
        now = dict(_named_state(module))
        for name in [*self.captured, *(k for k in now if k not in self.captured)]:
            if self.captured.get(name) is not now.get(name):
                raise RuntimeError(
                    f"cgraph: '{name}' of graphed module {self.index} "
                    f"({type(module).__name__}) was replaced after capture "
                    "(load_state_dict(assign=True), a new nn.Parameter or buffer, or a "
                    "removed one); the graphs would keep reading the old tensor. Graph the "
                    "module again after replacing it, or load weights in place "
                    "(load_state_dict without assign=True)."
                )


def _named_state(module: nn.Module):
    yield from module.named_parameters()
    yield from module.named_buffers()


def _modules_changed(*_):
    _C.modules_changed()


# Any parameter, buffer or submodule registered anywhere tells the native
# core to re-check graphed modules on their next call (see _StateCheck).
for _register in (nn.modules.module.register_module_parameter_registration_hook,
                  nn.modules.module.register_module_buffer_registration_hook,
                  nn.modules.module.register_module_module_registration_hook):
    _register(_modules_changed)


class Constant(NamedTuple):
    """A non-tensor sample argument captured into the graph: each call must
    pass the same value again (checked in csrc/arguments.c)."""

    position: int  # among the pytree leaves of (args, kwargs)
    name: str
    value: Any


class Default(NamedTuple):
    """A parameter of the callable the samples leave out, with a default a
    call may pass again (checked in csrc/arguments.c)."""

    name: str
    position: int  # its position among the positional parameters; -1: keyword only
    value: Any
    by_keyword: bool  # it may be passed by keyword


class _Draft(NamedTuple):
    """A callable's description, checked, short of the device, which depends
    on every callable and on CUDA (checked after the arguments)."""

    fields: dict  # CallableSpec's fields but the device
    leaves: list  # every pytree leaf of (args, kwargs)


def _draft(index: int, fn, args, kwargs, claimed: set[int]) -> _Draft:
    if not callable(fn):
        raise TypeError(f"cgraph: callable {index} is a {type(fn).__name__}, not callable.")
    if not isinstance(args, tuple):
        hint = " (write (x,) for one tensor)" if isinstance(args, torch.Tensor) else ""
        raise TypeError(
            f"cgraph: sample args of callable {index} must be a tuple{hint}, "
            f"got {type(args).__name__}."
        )
    if kwargs is None:
        kwargs = {}
    if not isinstance(kwargs, dict) or not all(isinstance(k, str) for k in kwargs):
        raise TypeError(
            f"cgraph: sample_kwargs of callable {index} must be a dict of keyword "
            f"arguments, got {type(kwargs).__name__}."
        )
    kwargs = dict(sorted(kwargs.items()))  # calls are flattened in this order too
    leaves, in_spec = pytree.tree_flatten((args, kwargs))
    leaves = [_static_input(leaf, claimed) if isinstance(leaf, torch.Tensor) else leaf
              for leaf in leaves]
    args, kwargs = pytree.tree_unflatten(leaves, in_spec)
    tensors, names, constants = _classify_leaves(index, leaves, _leaf_names(fn, args, kwargs))
    flat = not kwargs and all(isinstance(a, torch.Tensor) for a in args)
    module = isinstance(fn, nn.Module)
    fields = dict(
        index=index, **_target_fields(index, fn), args=args, kwargs=kwargs,
        kw_names=tuple(kwargs), tensors=tensors, names=names,
        params=tuple(fn.parameters()) if module else (),
        buffers=tuple(fn.buffers()) if module else (), flat=flat,
        in_spec=None if flat else in_spec, constants=constants,
        defaults=_defaults(fn, len(args), kwargs),
    )
    return _Draft(fields, leaves)


def _defaults(fn, nargs: int, kwargs: dict) -> tuple[Default, ...]:
    """The parameters of fn's signature that the samples (nargs positional
    arguments, these keywords) leave out, whose defaults are values a call
    can be compared with: None, and the constant types."""
    try:
        target = fn.forward if isinstance(fn, nn.Module) else fn
        parameters = list(inspect.signature(target).parameters.values())
    except (TypeError, ValueError):
        return ()
    defaults = []
    for position, p in enumerate(parameters):
        positional = p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)
        if p.default is p.empty or (positional and position < nargs) or p.name in kwargs:
            continue
        if p.kind in (p.VAR_POSITIONAL, p.VAR_KEYWORD):
            continue
        if p.default is None or isinstance(p.default, _CONSTANT_TYPES):
            defaults.append(Default(p.name, position if positional else -1, p.default,
                                    p.kind != p.POSITIONAL_ONLY))
    return tuple(defaults)


def _classify_leaves(index: int, leaves: list, names: list[str]):
    """The tensor leaves and their names, and the constants."""
    tensors, tensor_names, constants = [], [], []
    for position, (name, leaf) in enumerate(zip(names, leaves)):
        if isinstance(leaf, torch.Tensor):
            tensors.append(leaf)
            tensor_names.append(name)
        elif isinstance(leaf, _CONSTANT_TYPES):
            constants.append(Constant(position, name, leaf))
        else:
            raise TypeError(
                f"cgraph: sample argument '{name}' of callable {index} is a "
                f"{type(leaf).__name__}; graphed callables take tensors and constants "
                "(int, float, bool, str, enum, torch.dtype, ...) nested in tuples, lists or "
                "dicts. Bind other values with functools.partial."
            )
    return tuple(tensors), tuple(tensor_names), tuple(constants)


def _target_fields(index: int, fn) -> dict:
    """What to call, and for a module how to run it eagerly and check it."""
    if not isinstance(fn, nn.Module):
        return dict(function=fn, module=None, eager=None, eager_takes_module=False,
                    training=False, verify=None)
    if fn._forward_hooks or fn._forward_pre_hooks or fn._backward_hooks:
        raise ValueError(
            f"cgraph: module {index} ({type(fn).__name__}) has module hooks; they would "
            "run once, at capture, and never on replay. Remove them before graphing "
            "(you may register hooks afterwards), as torch requires."
        )
    if any(b.requires_grad for b in fn.buffers()):
        raise ValueError(
            f"cgraph: module {index} has a buffer that requires grad; only parameters "
            "may be trainable in a graphed module (make it an nn.Parameter)."
        )
    if "forward" in fn.__dict__:
        eager, takes_module = fn.__dict__["forward"], False
    else:
        eager, takes_module = type(fn).forward, True
    # The module weakly: module.forward holds the Graphed, which holds the spec.
    return dict(function=None, module=weakref.ref(fn), eager=eager,
                eager_takes_module=takes_module, training=fn.training,
                verify=_StateCheck(index, fn))


def _static_input(sample: torch.Tensor, claimed: set[int]) -> torch.Tensor:
    """Samples become the graphs' static input buffers.

    * Two that share memory (one tensor passed to several callables, or twice
      to one) would overwrite each other at replay, and backward would read
      the wrong activations; torch computes wrong grads without a word.  A
      sample whose memory an earlier sample already uses is replaced by a
      clone.
    * A sample with autograd history (the output of other ops) is replaced
      by a leaf over the same memory: the backward capture runs a plain
      .backward() that must stop at the graph's inputs (csrc/aten_capture.cpp,
      Note [Backward capture runs .backward()])."""
    key = sample.untyped_storage().data_ptr()
    if sample.numel() and key in claimed:
        sample = sample.detach().clone().requires_grad_(sample.requires_grad)
        key = sample.untyped_storage().data_ptr()
    elif sample.grad_fn is not None:
        sample = sample.detach().requires_grad_()
    claimed.add(key)
    return sample


def _leaf_names(fn, args, kwargs=None) -> list[str]:
    """A readable name per pytree leaf of ``(args, kwargs)``: the forward's
    parameter name for positional arguments ('x', "batch['mask']"), the
    keyword for keyword arguments, else the leaf's path ('args[2]')."""
    try:
        target = fn.forward if isinstance(fn, nn.Module) else fn
        positional = [p.name for p in inspect.signature(target).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
        positional = []
    names = []
    for path, _ in pytree.tree_flatten_with_path((args, kwargs or {}))[0]:
        (part, head), rest = path[:2], path[2:]
        if part.idx == 1:  # a keyword argument
            base = str(head.key)
        else:
            base = positional[head.idx] if head.idx < len(positional) else f"args[{head.idx}]"
        names.append(base + "".join(str(k) for k in rest))
    return names


def _device_of(drafts: Sequence[_Draft]) -> int:
    """The device of the first CUDA tensor among the samples and parameters,
    else the current one: the device every graph of one call runs on."""
    for draft in drafts:
        for t in (*draft.leaves, *draft.fields["params"]):
            if isinstance(t, torch.Tensor) and t.is_cuda:
                return t.device.index
    return torch.cuda.current_device()

"""The public entry points.  Thin: they check arguments the way torch does
(with messages that say what to do), describe each callable to the native
core, and wrap what comes back.  Warm-up, capture and replay are in csrc/."""

from __future__ import annotations

import atexit
import copy
import copyreg
import functools
import inspect
import sys
import time
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel

from . import _C, _describe, _fsdp, _group, _log
from ._buckets import Bucketed, refuse_sequence_first
from ._buckets import normalize as normalize_buckets
from ._capture import CaptureOptions, graph
from ._describe import Target, draft
from ._regraph import regraphing

__all__ = ["make_graphed_callables", "make_graphed", "GraphedModule", "graph_pool_handle",
           "reset_all"]

_CAPTURE_MODES = {"global": 0, "thread_local": 1, "relaxed": 2}
# What a replay does to an earlier call's outputs still held: cgraph.h's
# cg_kept_outputs, Note [Outputs of earlier calls] in csrc/aten_replay.cpp.
_KEPT_OUTPUTS = {"copy": 0, "error": 1, "alias": 2}
# make_graphed's default max_graphs: room for a few shapes (a short last
# batch, an eval batch size) and a second call before a backward, without
# letting a stream of new shapes fill the device.
_MAX_GRAPHS = 8


# Every graphed callable not yet freed, for reset_all().
_live: "weakref.WeakSet[_C.Graphed]" = weakref.WeakSet()
# Every graphed step that captured, for reset_all(): reset through its own
# reset(), which first moves the optimizer state its capture made out of the
# pool that reset frees (cgraph/_step.py's _out_of_the_pool).
_live_steps: weakref.WeakSet = weakref.WeakSet()  # of cgraph/_step.py's GraphedStep


class _Installed(NamedTuple):
    """A graphed callable cgraph set as a module's own ``forward`` (a module
    with hooks, a DDP model's module, graph_layers): at the callable's
    reset the module gets back the forward it had before (kept on the
    module, under _OWN_FORWARD, where there was one), so that it can be
    graphed again (reset_all before re-graphing).  Both weakly: an entry
    must not keep its key alive (the call is the graphed callable, or the
    buckets around it), nor the module (its previous forward may be bound
    to it), whose drop frees the graphs."""
    module: "weakref.ref[nn.Module]"
    call: weakref.ref


_OWN_FORWARD = "_cgraph_own_forward"
_installed: "weakref.WeakKeyDictionary[_C.Graphed, _Installed]" = weakref.WeakKeyDictionary()


def _install_forward(module: nn.Module, graphed: _C.Graphed, call) -> None:
    own = module.__dict__.get("forward")
    if own is None:
        module.__dict__.pop(_OWN_FORWARD, None)  # one a rolled-back graph_layers left
    else:
        module.__dict__[_OWN_FORWARD] = own
    _installed[graphed] = _Installed(weakref.ref(module), weakref.ref(call))
    module.forward = call


def _reduce_installed(call) -> tuple:
    """copyreg's reducer of a graphed callable (a cgraph.Graphed, or the
    buckets around one), which copy.deepcopy and pickle use: the forward
    its module had before graphing (Note [Copying a graphed model])."""
    graphed = call.graphed if isinstance(call, Bucketed) else call
    installed = _installed.get(graphed)
    module = installed.module() if installed is not None else None
    if module is None:  # a graphed function, or one whose module is gone
        raise TypeError(
            "cgraph: a graphed callable cannot be copied or pickled: its graphs replay into "
            "memory of its own and read the original's parameters. Copy or save what it "
            "graphs (the function, or the module) and graph the copy, or save a model's "
            "state_dict().")
    own = module.__dict__.get(_OWN_FORWARD)
    if own is None or _describe.is_graphed_callable(own):  # installed twice (the drop-in's
        return ClassForward, (module,)                      # (m, m)): the class's forward
    return _same, (own,)


def _same(value):
    return value


class ClassForward:
    """The forward of a copy of a module that cgraph had graphed in place:
    its class's forward, called on the copy (Note [Copying a graphed
    model]).  The copy is held weakly, so that it has no reference cycle
    through its own forward and goes when dropped, as a module does."""

    __slots__ = ("module", "__weakref__")

    def __init__(self, module: nn.Module):
        self.module = weakref.ref(module)

    def __call__(self, *args, **kwargs):
        module = self.module()
        return type(module).forward(module, *args, **kwargs)

    @property
    def __signature__(self) -> inspect.Signature:
        """The class forward's, bound: what binds a call (the Trainer's
        column pruning, a later graphing of the copy) reads it."""
        module = self.module()
        return inspect.signature(type(module).forward.__get__(module))

    def __reduce__(self) -> tuple:
        return ClassForward, (self.module(),)


copyreg.pickle(_C.Graphed, _reduce_installed)
copyreg.pickle(Bucketed, _reduce_installed)


def _uninstall_forward(graphed: _C.Graphed) -> None:
    """At graphed's reset: its module's forward as it was before graphing,
    unless something else was set there since."""
    installed = _installed.pop(graphed, None)
    module = installed.module() if installed is not None else None
    if module is None or module.__dict__.get("forward") is not installed.call():
        return
    own = module.__dict__.pop(_OWN_FORWARD, None)
    if own is None:
        del module.forward
    else:
        module.forward = own


def reset_all() -> None:
    """Free every live graphed callable's graphs, static tensors and pool memory.

    Call it before ``torch.distributed.destroy_process_group()`` or before
    re-graphing a whole model.  Later calls of a reset callable raise (a
    graphed step captures again on its next call; a module whose forward
    cgraph had set to the graphed callable, graph_layers' blocks among
    them, runs its own forward again).  A graphed step is reset through its
    own ``reset()``, which first copies the optimizer state its capture made
    out of its pool; where that copy fails (out of memory), every graph is
    still freed, and then the error is raised.  The graphs alone are also
    freed at interpreter exit, while CUDA is still up.
    """
    failed = []
    for step in list(_live_steps):
        try:
            step.reset()
        except Exception as e:  # its graph is freed all the same (GraphedStep._free)
            e.add_note(f"cgraph.reset_all(): {step!r} could not copy the optimizer state its "
                       "capture made out of its pool; every graph was freed, and that state "
                       "stays valid in the released pool, which stays reserved while the "
                       "state lives. Free memory before reset_all() to have it copied.")
            failed.append(e)
    _reset_graphs()
    if failed:  # every graph freed first
        raise failed[0]


def _reset_graphs() -> None:
    """reset_all's graphs."""
    for graphed in list(_live):
        graphed.reset()
        _fsdp.release(graphed)


def _at_exit() -> None:
    """The graphs freed while CUDA is up, and nothing else: no copies, no
    pool emptied (Note [Resets at exit] in csrc/aten_reset.cpp)."""
    _C.exiting()
    _reset_graphs()


# Note [destroy_process_group with live graphs]
# Q: torch.distributed.destroy_process_group() while graphs that captured NCCL
#    collectives are alive (a step graphed whole over DDP or FSDP2, a tensor-
#    parallel layer): what happens?
# A: It never returns: NCCL's finalization of a communicator waits until no graph
#    holds a reference to it, and a graph that captured one of its collectives
#    holds one until it is destroyed.  Measured on two H200s (torch 2.11): still
#    waiting after 45 s with torch's own torch.cuda.CUDAGraph and with cgraph's
#    graphs alike, and in an atexit handler registered after `import cgraph`
#    (it runs before cgraph's own); 0.4 s after reset_all().  So cgraph wraps
#    torch.distributed.destroy_process_group (the name in torch.distributed and
#    in distributed_c10d, where code looks it up at call time): destroying the
#    default group, which ends every group, first runs reset_all() (logged).
#    A subgroup destroyed alone is left as torch has it: graphs of other groups
#    stay, and which graph captured which group is not tracked (README Limits);
#    with graphs alive, a warning first says what to do, in case it hangs.
#    Not reached: a name bound before `import cgraph` (`from torch.distributed
#    import destroy_process_group`).
def _resets_first(destroy: Callable) -> Callable:
    """`destroy` (torch's destroy_process_group), after reset_all() where it
    ends every group."""
    if getattr(destroy, "_cgraph_resets_first", False):
        return destroy

    @functools.wraps(destroy)
    def destroy_process_group(group=None, *args, **kwargs):
        import torch.distributed as dist
        if (group is None or group is dist.GroupMember.WORLD) and (_live or _live_steps):
            _log.reset_before_destroy(len(_live))
            reset_all()
        elif group is not None and (_live or _live_steps):
            _log.destroy_subgroup_with_graphs(len(_live) + len(_live_steps))
        return destroy(group, *args, **kwargs)

    destroy_process_group._cgraph_resets_first = True
    return destroy_process_group


def _wrap_destroy_process_group() -> None:
    """Note [destroy_process_group with live graphs]."""
    import torch.distributed as dist
    if not dist.is_available():
        return
    from torch.distributed import distributed_c10d
    wrapped = _resets_first(distributed_c10d.destroy_process_group)
    distributed_c10d.destroy_process_group = wrapped
    dist.destroy_process_group = wrapped


def _on_event(event: str, graphed) -> None:
    """The native core's event hook: the log, and at a reset, FSDP's
    parameters that graphed homed go back to FSDP's own allocation (as
    reset_all and GraphedModule.reset do; a graph of graph_layers is reset
    through its block's forward), and the module's own forward is put back."""
    try:
        _log.on_event(event, graphed)
    finally:
        if event == "reset":
            try:
                _fsdp.release(graphed)
            finally:
                _uninstall_forward(graphed)


atexit.register(_at_exit)
_wrap_destroy_process_group()
_C.set_event_hook(_on_event)
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
    max_graphs: int | None = _MAX_GRAPHS,
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
    raises ``ValueError`` naming it.  A call nested as the samples were
    (exact tuples, lists and dicts with str keys; tensors, None, bool, int,
    float and str inside) is checked in C; any other (a named tuple, an
    ``OrderedDict``, an enum constant) goes through torch's ``tree_flatten``
    first, some tens of microseconds more per call, counted in
    ``stats["args_flattened"]``.

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
    * A call of another shape (a short last batch), or another constant or
      keyword, captures a graph for it on the spot and replays it from then
      on, as :func:`make_graphed` does (``max_graphs``, keyword-only: 8 by
      default; past that, calls run eagerly, logged once).  torch raises on
      such a call, or computes the wrong thing where the shape broadcasts.
      Callables graphed together (without ``pool=``) capture a new shape as
      they captured the first: into their one pool, forwards in the order
      they run, backwards in reverse.  ``max_graphs=1`` (or ``None``) keeps
      torch's rule: one graph, and another shape raises ``ValueError``.
    * A call made before the backward of the previous call ran (a siamese
      model, several micro-batch forwards) gets a graph instance of its own
      (with ``max_graphs=1``: runs eagerly, counted in
      ``stats["eager_pending"]``), so every backward is right; torch
      overwrites the activations that backward needs.
    * An argument on another device raises ``ValueError``; one of another
      floating dtype is cast into the static input, as torch does
      (:func:`make_graphed` gives it a graph of its own instead).
    * Leaves that require grad but are neither arguments nor parameters (a
      tensor in a closure) get their grads; torch drops them silently.
    * Warm-up leaves the buffers of the modules it graphs (BatchNorm running
      stats) as they were; a function calling a module keeps the warm-up's
      updates, as torch's does (README, Limits).
    * Deleting the graphed callable returns its pool memory to the device.
    * Autocast works with its weight cache on (torch requires it off).
    * ``torch.utils.checkpoint`` works inside (``use_reentrant`` False or
      True), dropout included: the recompute redraws the forward's masks.
    * Replacing a parameter after capture (``load_state_dict(assign=True)``)
      raises on the next call instead of reading the old tensor; so does a
      submodule replaced (a Dropout by an Identity).
    * A submodule switched between train and eval after capture
      (``bn.eval()``) gets a graph of its own mode (with ``max_graphs=1``:
      runs eagerly); torch replays the captured mode.
    * A parameter unfrozen after capture (``requires_grad_(True)``, a
      fine-tuning schedule) gets a graph whose backward computes its grad
      (with ``max_graphs=1``: raises, naming the fix); torch's replays
      compute no grad for it, silently.
    * An argument the callable writes in place (a cache filled inside
      ``forward``) is copied back into the tensor passed after each replay;
      torch leaves the caller's tensor as it was.
    * A sample that is a slice of more memory (``X[:64]``) gets a static
      input of its own; torch copies every later call into ``X``.

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
    for i, target in enumerate(targets):
        _fsdp.refuse_in_drop_in(i, target)
        first = next((j for j, t in enumerate(targets[:i]) if t is target), None)
        if isinstance(target, nn.Module) and first is not None:  # `is`: never a module's __eq__
            raise ValueError(
                f"cgraph: callable {i} is the module callable {first} is (or "
                "the module a DistributedDataParallel there wraps); a module has one forward "
                "to replace. Pass it once, and call it as often as the model does.")
    options = _options(num_warmup_iters, allow_unused_input, capture_error_mode,
                       _kept_outputs(kept_outputs, guard_outputs))
    limit = 1 if max_graphs is None else _max_graphs(max_graphs)
    described = [Target.of(i, fn) for i, fn in enumerate(targets)]
    pool_id = _pool_id(pool)
    graphed = _graph(described, sample_args, sample_kwargs, pool_id, options)
    if limit > 1:
        graphed = [_capturing_later(target, g, options, limit, together=len(described) > 1,
                                    pool_given=pool_id is not None)
                   for target, g in zip(described, graphed)]
        _live.update(graphed)
    out = []
    for fn, target, g in zip(callables, targets, graphed):
        if isinstance(target, nn.Module):
            _install_forward(target, g, g)
            out.append(fn)
        else:
            out.append(g)
    return out[0] if just_one else tuple(out)


def make_graphed(
    fn: Callable[..., Any],
    sample_args: tuple | None = None,
    *,
    sample_kwargs: dict | None = None,
    num_warmup_iters: int = 3,
    allow_unused_input: bool = False,
    pool=None,
    capture_error_mode: str = "global",
    kept_outputs: str = "copy",
    guard_outputs: bool | None = None,
    max_graphs: int = _MAX_GRAPHS,
    buckets=None,
):
    """Graph one callable.

    ``sample_kwargs``, ``kept_outputs`` and constant arguments work as in
    :func:`make_graphed_callables`.

    Several graphs: a call that none of the callable's graphs takes
    (tensors of another shape or dtype, another constant or keyword,
    another autocast or grad mode, outside ``torch.inference_mode()`` where
    the graph was captured in it, the module, or a submodule that reads its
    mode, in the other train/eval mode, an input that requires grad unlike
    the sample, a parameter unfrozen since) captures one more
    forward/backward pair for it on the spot, with the same warm-up and
    checks, and replays it from then on.  So does a call made while the
    backward of an earlier call of the same signature is still pending
    (several micro-batches' forwards, a siamese model), which gets an
    instance of its own; backwards then run in any order.  Graphs of one
    callable share its pool where they can.  Up to ``max_graphs`` graphs;
    past that a call runs eagerly, logged once (logger ``cgraph``) and
    counted in ``stats``.  ``max_graphs=None``: one graph, torch's rules.

    ``buckets`` (opt-in): sizes for the leading dimension (``[8, 16, 32]``)
    or per dimension (``{0: [8, 16], 1: [128, 256, 512]}``).  A call is
    padded up to the next bucket (Notes [What padded rows hold] and
    [Attention masks under sequence buckets] in cgraph/_buckets.py),
    replays that bucket's graph, and its outputs are sliced back; grads of
    the padded rows are dropped.
    This is exact only when padded rows cannot change the real ones: rows
    no op mixes (BatchNorm in training mode does: refused), or positions
    after the real ones under causal attention.  A size above the largest
    bucket is not padded (a graph of its own, or eager past max_graphs).
    Random ops (dropout) draw for the padded rows too, so their masks are
    as random as eager's but not the same numbers.

    Without ``sample_args`` nothing is captured until the first call, whose
    arguments (tensors copied) become the samples: warm-up runs on the
    copies, puts back every grad, buffer and the random-number state, then
    the graph is captured and replayed for the call.  Results are eager's
    throughout.  This graphs a model's layers without knowing how the model
    calls them; give them one ``pool`` and their graphs share its memory::

        pool = cgraph.graph_pool_handle()
        layers = model.model.layers
        model.model.layers = torch.nn.ModuleList(
            cgraph.make_graphed(l, pool=pool) for l in layers)

    Callables graphed without samples but with one ``pool`` each capture
    on their first call into that pool, keeping the activations of their
    captures allocated until their backward has run, so that the next
    layer's capture cannot take them.  Graphs of every shape and every
    layer then share one pool, as graphs captured together do, instead of
    a pool per layer (Note [One pool for separately graphed callables] in
    cgraph/_group.py).

    Returns a :class:`GraphedModule` for an
    ``nn.Module`` (the module stays untouched inside it, but for a module
    with hooks, whose ``forward`` becomes the graphed callable so that its
    hooks run around every call, as in eager) and a graphed
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
    inner = _unwrap_ddp(fn)
    if buckets is not None:  # before any capture
        buckets = normalize_buckets(buckets)
        refuse_sequence_first(inner, buckets)
    options = _options(num_warmup_iters, allow_unused_input, capture_error_mode,
                       _kept_outputs(kept_outputs, guard_outputs))
    target, pool_id = Target.of(0, inner), _pool_id(pool)
    limit = None if max_graphs is None else _max_graphs(max_graphs)
    if sample_args is not None and _fsdp.is_fsdp(inner):
        # Note [FSDP2's unsharded parameters in per-layer graphs]: FSDP
        # all-gathers the parameters inside its forward, so it captures there.
        _log.log.info("cgraph: %s is sharded by fully_shard: captured on its first call, "
                      "not from the samples", type(inner).__name__)
        sample_args = sample_kwargs = None
    if sample_args is None:
        if sample_kwargs is not None:
            raise ValueError("cgraph: sample_kwargs without sample_args; pass both, or "
                             "neither to capture on the first call.")
        _require_cuda()
        # max_graphs=None: torch's rules, its cast of another floating dtype too
        casts = limit is None
        g = (regraphing(target, options, limit or 1, casts=casts) if pool_id is None
             else _group.graphed_layer(target, pool_id, options, limit or 1, casts=casts))
        _live.add(g)
    else:
        (g,) = _graph([target], (sample_args,), (sample_kwargs,), pool_id, options)
        if limit is not None:
            g = regraphing(target, options, limit, first=g,
                           shared_pool=g.pool if pool_id is not None else None)
            _live.add(g)
    call = g
    if buckets is not None:
        call = Bucketed(g, buckets, inner if isinstance(inner, nn.Module) else None)
    if inner is not fn:  # DistributedDataParallel: see _unwrap_ddp
        _install_forward(inner, g, call)
        return fn
    if not isinstance(fn, nn.Module):
        return call
    if _has_hooks(fn):
        # Its hooks (FSDP2's all-gather and reshard among them) run around
        # every call, outside the graphs, as in eager: the wrapper calls the
        # module, whose forward is the graphed callable.
        _install_forward(fn, g, call)
        return GraphedModule(fn, g, _through_hooks(fn, g))
    return GraphedModule(fn, g, call)


def graphed_in_place(module: nn.Module, **make_graphed_kwargs) -> nn.Module:
    """make_graphed for a block inside a model (cgraph.graph_layers): the
    module itself comes back, its ``forward`` the graphed callable, as the
    drop-in returns modules, so every name in the model (state_dict keys,
    named_parameters, optimizer and distributed checkpoints) stays as it
    was.  Its graphs are ``module.forward`` (stats, num_graphs, reset)
    until they are reset, which gives the module its own forward back."""
    wrapper = make_graphed(module, **make_graphed_kwargs)
    if not _has_hooks(module):  # with hooks make_graphed did this already
        _install_forward(module, wrapper._graphed, wrapper.forward)
    return module


def is_graphed(module: nn.Module) -> bool:
    """Whether make_graphed, the drop-in or graph_layers graphed `module`."""
    return isinstance(module, GraphedModule) or _describe.is_graphed_callable(
        module.__dict__.get("forward"))


class _Wrapper(nn.Module):
    """A module around ``self.module`` that reads its attributes through."""

    def __getattr__(self, name: str):
        """Attributes of the wrapped module (a model reading
        ``layer.attention_type`` off a layer it calls), after the wrapper's
        own parameters, buffers and submodules."""
        try:
            return super().__getattr__(name)
        except AttributeError:
            module = self.__dict__.get("_modules", {}).get("module")  # {}: while unpickled
            if module is None:
                raise
            return getattr(module, name)


class GraphedModule(_Wrapper):
    """An ``nn.Module`` whose forward replays CUDA graphs of ``self.module``.

    Parameters, buffers and ``state_dict`` are those of the wrapped module
    (under ``module.``, as with DDP).  In the other train/eval mode than at
    capture it captures a graph for that mode (with ``max_graphs=None``, it
    runs the wrapped module eagerly, as torch does).  Build it with
    :func:`make_graphed`.
    """

    def __setattr__(self, name: str, value) -> None:
        """A name the wrapped module has (``graphed.head = nn.Linear(...)``,
        as its attributes are read through) is written there, where the
        graphs' own check sees it (a submodule, parameter or buffer replaced
        after capture is refused, naming the fix); written on the wrapper,
        it would shadow the module's and never reach the graphs.  And
        fully_shard(graphed_module) swaps this module's class, then the
        wrapped module's parameters without registering them: the graphed
        modules are checked again on their next call (StateCheck), which
        refuses it, naming the recipe (shard first, then graph)."""
        if name == "__class__":
            _describe.replaced_inside()
        if self._read_through(name):
            setattr(self.__dict__["_modules"]["module"], name, value)
            return
        super().__setattr__(name, value)

    def __delattr__(self, name: str) -> None:
        """As __setattr__: a name written through is deleted there."""
        if self._read_through(name):
            delattr(self.__dict__["_modules"]["module"], name)
            return
        super().__delattr__(name)

    def _read_through(self, name: str) -> bool:
        """Whether `name` is the wrapped module's, read through __getattr__:
        public, and not the wrapper's own (its training flag, its module).
        Private names stay the wrapper's: fully_shard's ``__class__`` swap
        and its markers (``_is_fsdp_managed_module``) are about the wrapper."""
        modules = self.__dict__.get("_modules", {})
        return (not name.startswith("_") and "module" in modules and name not in self.__dict__
                and name not in modules and hasattr(modules["module"], name))

    def __init__(self, module: nn.Module, graphed: _C.Graphed, forward=None):
        super().__init__()
        self.module = module
        # Instance attributes, so nn.Module.__call__ goes straight to C
        # (or to the padding of buckets=, which calls the graphs).
        self.__dict__["_graphed"] = graphed
        self.__dict__["forward"] = graphed if forward is None else forward

    def reset(self) -> None:
        """Free the graphs, their static tensors and their memory pool."""
        self._graphed.reset()
        _fsdp.release(self._graphed)

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

    @property
    def num_graphs(self) -> int:
        """How many forward/backward graph pairs are captured."""
        return self._graphed.num_graphs

    def extra_repr(self) -> str:
        """What the graphs are at a glance (also in a notebook's output):
        their argument shapes, replays, eager calls and pool memory."""
        g = self._graphed
        if g.is_reset or g.num_graphs == 0:
            return repr(g)
        return f"{repr(g)[1:-1]}, pool memory {_log.pool_mib(g.pools):.1f} MiB"

    def __reduce_ex__(self, protocol):
        """pickle (torch.save of a model): an EagerCopy, Note [Copying a graphed model]."""
        return _new_eager_copy, (), self._copied_state()

    def __deepcopy__(self, memo: dict) -> "EagerCopy":
        """copy.deepcopy (an EMA or SWA copy): an EagerCopy, Note [Copying a graphed model]."""
        twin = _new_eager_copy()
        memo[id(self)] = twin
        twin.__setstate__(copy.deepcopy(self._copied_state(), memo))
        return twin

    def _copied_state(self) -> dict:
        return {k: v for k, v in self.__dict__.items() if k not in ("_graphed", "forward")}


class EagerCopy(_Wrapper):
    """A copy of a :class:`GraphedModule` (``copy.deepcopy``, pickle): its
    module copied, run eagerly, its parameters under the same names
    (``module.``).  ``cgraph.make_graphed(copy.module)`` graphs it.

    Note [Copying a graphed model]
    Q: ``copy.deepcopy(model)`` (an EMA or SWA copy; Lightning's
       WeightAveraging) and ``torch.save(model)`` copy every attribute of
       every module, graphed callables among them.  What does the copy of a
       graphed module run?
    A: Its own module, eagerly.  Graphs cannot be copied: they replay into
       memory of their own and read the original's parameters (torch's
       make_graphed_callables sets forward to a closure, which deepcopy
       shares: its copy silently replays the original's graphs, and pickle
       refuses it).  A module whose forward cgraph set (graph_layers'
       blocks, the drop-in's modules, a module with hooks) is copied with
       the forward it had before graphing (``_reduce_installed``, registered
       with copyreg, which both use): its own, copied (a method rebound to
       the copy), or the class's, called on the copy (a ClassForward set as
       the copy's forward; the copy also carries the key _cgraph_own_forward
       where the original had one, which a later graphing of it replaces); a
       GraphedModule is copied as an EagerCopy of its module, so state_dict
       keys and parameter order match the original's.  A graphed function
       raises, naming the fix.  Graph the copy to graph it.  cgraph's other
       additions to a module copy as eager ones: graph_layers' cache hook as
       none (cgraph/_layers.py), its checkpointing class as the block's own.
    """

    def forward(self, *args, **kwargs):
        return self.module(*args, **kwargs)


def _new_eager_copy() -> EagerCopy:
    """An EagerCopy without state yet, which the copy's state fills."""
    return EagerCopy.__new__(EagerCopy)


def _unwrap_ddp(fn):
    """DistributedDataParallel's forward does per-call bookkeeping in Python
    (prepare_for_backward) that its gradient hooks rely on, so cgraph graphs
    the module inside and leaves DDP around it.  Collectives then run from
    DDP's hooks outside the graphs; none is ever captured.  Its bound
    forward is refused: graphed as a function, that bookkeeping would run
    at capture only, and the replays' grads would never be all-reduced."""
    if isinstance(getattr(fn, "__self__", None), DistributedDataParallel):
        raise ValueError(
            "cgraph: this is a DistributedDataParallel model's bound method "
            f"({getattr(fn, '__name__', 'forward')}); graphed as a function, DDP's per-call "
            "bookkeeping would run at capture only and the replays' grads would not be "
            "all-reduced. Graph the DDP model itself: cgraph.make_graphed(ddp_model).")
    return fn.module if isinstance(fn, DistributedDataParallel) else fn


def _through_hooks(module: nn.Module, graphed: _C.Graphed):
    """A GraphedModule's forward for a module with hooks: the module's call,
    its hooks around its forward, the graphed callable; after a reset, which
    puts the module's own forward back, it raises as the graphed callable
    does instead of running the module eagerly."""
    def forward(*args, **kwargs):
        if graphed.is_reset:
            return graphed(*args, **kwargs)  # raises the reset error (csrc/graphed.c)
        return module(*args, **kwargs)
    return forward


def _has_hooks(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks or module._backward_hooks
                or module._backward_pre_hooks)


def _require_cuda() -> None:
    if _C.device_count() == 0 or not torch.cuda.is_available():
        raise RuntimeError(
            "cgraph: no CUDA device is available (torch.cuda.is_available() is False). "
            "CUDA graphs need an NVIDIA GPU; run the callable eagerly on this machine."
        )
    # Every graph's memory is a private pool of torch's native allocator:
    # its static tensors, its outputs freed back into it, the pools graphs
    # share (csrc/aten_pool.cpp).  The cudaMallocAsync backend has none (a
    # training run aborted in a free under it).
    backend = torch.cuda.get_allocator_backend()
    if backend == "cudaMallocAsync":
        raise RuntimeError(
            "cgraph: PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) selects the "
            "cudaMallocAsync backend, which has no private memory pools; cgraph's graphs live "
            "in those of torch's native allocator. Remove backend:cudaMallocAsync from it "
            "(expandable_segments:True works), or run the callable eagerly.")
    if backend != "native":  # torch.cuda.memory.change_current_allocator
        raise RuntimeError(
            f"cgraph: torch's CUDA allocator is {backend!r} (a pluggable allocator), not torch's "
            "native one, in whose private memory pools cgraph's graphs live. Use the native "
            "allocator (no change_current_allocator), or run the callable eagerly.")


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


def _options(num_warmup_iters, allow_unused_input, capture_error_mode,
             kept_outputs) -> CaptureOptions:
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
    return CaptureOptions(num_warmup_iters, bool(allow_unused_input),
                          _CAPTURE_MODES[capture_error_mode], _KEPT_OUTPUTS[kept_outputs])


def _max_graphs(max_graphs) -> int:
    if isinstance(max_graphs, bool) or not isinstance(max_graphs, int) or max_graphs < 1:
        raise ValueError(
            f"cgraph: max_graphs must be a positive int (or None for one graph with torch's "
            f"rules), got {max_graphs!r}."
        )
    return min(max_graphs, sys.maxsize)  # as many as a C Py_ssize_t holds: no limit


def _capturing_later(target: Target, first: _C.Graphed, options: CaptureOptions, limit: int,
                     *, together: bool, pool_given: bool) -> _C.Graphed:
    """The drop-in's callable with its first graph, capturing the calls that
    graph does not take (up to ``limit`` graphs).  Callables graphed together
    capture a new shape as they captured the first: into their one pool,
    forwards in the order they run and backwards in reverse, as layers
    graphed one by one do (Note [One pool for separately graphed callables]
    in _group.py), so a short last batch costs one pool's growth, not a pool
    per callable; where the pool may not take a capture (a second pass), it
    goes to a pool of its own.  Later graphs stay out of a ``pool=`` the
    caller gave (alone or together): that pool may hold graphs cgraph does
    not know of, whose replays would overwrite what a pending backward
    needs."""
    if together and not pool_given:
        return _group.graphed_layer(target, first.pool, options, limit, first=first,
                                    casts=True)
    return regraphing(target, options, limit, first=first, casts=True,
                      shared_pool=first.pool if pool_given else None)


def _graph(targets, sample_args, sample_kwargs, pool_id, options):
    """The first graph of each callable, captured together."""
    claimed: set[int] = set()  # sample memory already used as a static input
    drafts = [draft(t, args, kwargs, claimed)
              for t, args, kwargs in zip(targets, sample_args, sample_kwargs)]
    _require_cuda()
    started = time.perf_counter()
    graphed = graph(drafts, pool_id, options)
    _live.update(graphed)
    _log.set_up(graphed, time.perf_counter() - started)
    return graphed

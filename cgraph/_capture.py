"""The capture session: every change cgraph makes to torch's globals while it
warms up and captures, in one context manager.

Note [Patches during capture]
While cgraph warms up and captures the callables of one make_graphed call,
and only then, it changes these globals of torch's, and puts each back when
the session ends, also when warm-up or capture raised:

1. The autocast weight cache is off (torch.set_autocast_cache_enabled):
   Note [Autocast's weight cache] below.
2. torch.cuda.get_rng_state and torch.cuda.set_rng_state ask the native
   core first, so torch.utils.checkpoint's recompute redraws its forward's
   masks: Note [RNG in checkpointed regions] in csrc/aten_rng.cpp.  Anything
   the core does not claim goes to torch, and so does torch.compile's own
   saving and restoring of the state around a compile.
3. torch.manual_seed, torch.random.manual_seed, torch.cuda.manual_seed and
   torch.cuda.manual_seed_all refuse while a stream captures: a graph would
   not reseed on replay.  (The native core also compares the host
   generators before and after each capture; a reseed to the state they
   already had escapes that.)  So does DTensor's RNG tracker, where a
   random op on a DTensor enters it (_distribute_region, or, on CUDA in
   newer torch, _compute_rng_offsets before its run_dtensor_rng_op): it
   moves the generator's offset on the host around every such op, which a
   replay would not repeat, and torch's own failure there (a host copy)
   names neither the op nor the fix.
4. torch.autograd.backward and torch.utils.checkpoint.detach_variable check
   what a use_reentrant=True checkpoint region reads: Note [Reentrant
   regions] below.
5. The CUDA generator's state is put back as the session found it: warm-up
   draws random numbers (dropout) that no eager run would have drawn, so a
   later call, eager or graphed, sees the stream it would have seen without
   graphing, and dropout masks equal eager's call for call.
6. torch._functorch.config.donated_buffer is off, so a torch.compile'd
   module compiled during warm-up does not hand its saved activations'
   memory to its backward: a backward compiled that way refuses to run while
   the activations are kept (retain_graph=True), which a capture into a
   shared pool= does (Note [Layers captured one by one into one pool] in
   csrc/aten_pool.cpp).  In a graph the pool reuses that memory anyway.
7. torch.compile's cudagraph trees (mode="reduce-overhead") refuse to run:
   their graphs cannot run inside a capture.  Where they recorded before
   (a training step's eager warm-up), their replay would first sync, and
   the failure would read as a sync instead of naming them.
8. A registered buffer assigned a new tensor (``self.ema = 0.9 * self.ema +
   0.1 * x.mean(0)``) is updated in place instead, where the two are alike:
   Note [A buffer assigned anew during set-up] below.

A training step's eager warm-up calls (cgraph/_step.py) run under items 1,
6 and 8 too: compiled code guards on such global state, and would otherwise
compile again inside the capture.

Refusals raise _C.Refusal(message, kind), which the capture turns into a
CaptureError naming the cause (Note [Capture failures] in csrc/capture.c).
"""

from __future__ import annotations

import contextlib
import sys
import threading
from typing import Iterator, NamedTuple, Sequence

import torch
import torch.utils.checkpoint as checkpoint_module
from torch import nn

from . import _C, _log
from ._describe import Draft, StateCheck, device_of


class CaptureOptions(NamedTuple):
    """How one make_graphed call warms up and captures, checked by _api and
    used again by every later capture of its callables (_regraph)."""

    num_warmup_iters: int
    allow_unused_input: bool
    capture_error_mode: int  # a cg_capture_mode
    kept_outputs: int  # a cg_kept_outputs


def graph(drafts: Sequence[Draft], pool: tuple[int, int] | None,
          options: CaptureOptions, warm_in_pool: bool = False, *,
          keep_activations: bool = False, step: bool = False) -> tuple[_C.Graphed, ...]:
    """Warms up and captures these callables together (csrc/capture.c), in
    one session: a Graphed per callable, with one graph each.  With
    ``warm_in_pool``, warm-up allocates from ``pool`` (Note [Warm-up in the
    pool] in csrc/aten_setup.cpp); with ``keep_activations``, the captures'
    activations stay allocated until their backward has run (Note [Layers
    captured one by one into one pool] in csrc/aten_pool.cpp).  With
    ``step``, the one callable is a whole training step (cgraph/_step.py):
    its backward runs inside its own capture, so Note [Reentrant regions]
    does not apply, and capture errors name the training step."""
    _refuse_saved_tensor_hooks(step)
    device = device_of(drafts)
    specs = tuple(_C.CallableSpec(**d.fields, device=device) for d in drafts)
    what = "the training step" if step else None
    with capture_session(specs, reentrant_checked=not step), _log.progress(len(specs)):
        graphed = _C.graph_callables(specs, pool, *options, warm_in_pool, keep_activations,
                                     what)
    for spec in specs:  # a module's spec has a StateCheck and a weakref to it
        if isinstance(spec.verify, StateCheck) and (module := spec.module()) is not None:
            spec.verify.adopt(module)
    return graphed


def _refuse_saved_tensor_hooks(step: bool) -> None:
    """A capture inside torch.utils.checkpoint (use_reentrant=False) or another
    saved_tensors_hooks region (save_on_cpu) around the graphed callable:
    the warm-up's and capture's backwards would save their tensors through
    the region's hooks, and the region's recompute calls the callable
    again, eagerly inside the backward, saving other tensors than the graph
    does (torch raises its "different number of tensors" CheckpointError at
    the warm-up's second backward; without warm-up a replay would read the
    activations of the capture's call; on torch 2.11, a crash).  Refused,
    naming the fix.  Not under no_grad(), where nothing is saved (an
    evaluation under save_on_cpu)."""
    if (not torch.is_grad_enabled()
            or torch._C._autograd._top_saved_tensors_default_hooks(False) is None):
        return
    where = ("a training step is graphed inside" if step else
             "a callable is graphed inside")
    fix = ("Call the graphed step outside the region; checkpoint inside the step." if step else
           "Checkpoint inside the graphed module instead: wrap each block with "
           "torch.distributed.algorithms._checkpoint.checkpoint_wrapper before graphing it "
           "(graph_layers moves transformers' gradient checkpointing inside by itself), or "
           "graph the whole step with make_graphed_step.")
    raise ValueError(
        f"cgraph: {where} torch.utils.checkpoint (use_reentrant=False) or another "
        "torch.autograd.graph.saved_tensors_hooks region (save_on_cpu) around it: its graphs "
        "keep their activations themselves, and the region's hooks would see the capture's "
        f"tensors (a checkpoint's recompute calls it again, eagerly). {fix}")


@contextlib.contextmanager
def capture_session(specs: Sequence[_C.CallableSpec],
                    reentrant_checked: bool = True) -> Iterator[None]:
    """The patches of Note [Patches during capture], for these callables."""
    reentrant = _reentrant_regions_checked(specs) if reentrant_checked else contextlib.nullcontext()
    with one_setup_at_a_time(), _rng_stream_kept(specs), _autocast_cache_off(), _rng_hooks(), \
            reentrant, _donated_buffers_off(), _cudagraph_trees_refused(), \
            _buffers_kept_in_place():
        yield


# Note [A buffer assigned anew during set-up]
# Q: A forward that assigns a registered buffer a new tensor each call (an
#    EMA, a step counter, VQ-VAE's codebook statistics) rather than
#    updating it in place: what does a graph of it do?
# A: Left alone, wrong, silently.  The capture records a read of the tensor
#    the buffer was as the capture began and a write into a new tensor of
#    the graph's pool, which becomes the buffer.  Every replay then reads
#    the first tensor (freed once nothing holds it: its memory reused) and
#    writes the second, so the buffer never accumulates; and the warm-up's
#    updates stay in the module, because the set-up puts buffers back by
#    copying into the tensors it saved (Note [A set-up puts back what it
#    changed], csrc/aten_setup.cpp), which the module no longer holds.  So
#    while a set-up is under way, a buffer assigned a tensor alike to the one
#    it holds (a plain strided tensor of the same shape, dtype and device,
#    neither requiring grad, not sharing its memory) keeps its tensor, with
#    the new values copied in (a global buffer-registration hook, torch's
#    nn.Module API): the warm-up is put back, and the graph reads and
#    writes one tensor, the module's, as eager reads and then replaces it.
#    Logged once per module class and buffer.  What differs from eager: the
#    buffer is the same tensor after each call, so a reference to it taken
#    before a call sees the new values.  Replaced as in eager, not copied
#    into: a buffer whose tensor the module holds under another name too (a
#    swap, ``self.a, self.b = self.b, self.a``; Hugging Face's rotary
#    ``original_inv_freq``, a plain attribute holding the first
#    ``inv_freq``), which a copy would overwrite; an inference tensor
#    outside inference mode, or one whose elements share memory, which
#    refuse the copy; and a tensor of another shape, dtype or kind (a cache
#    that grows), warned of at a capture, once per buffer: the graph would
#    read the tensor it replaced.  Not seen: an alias held elsewhere than on
#    the module (it gets the new values), and a plain tensor attribute (not
#    a registered buffer: cgraph.explain reports it, kind "state").  Also
#    around a graphed step's eager warm-up calls, so that compiled code sees
#    the same global hooks there as in the capture; dynamo does not trace
#    the hook (torch.compiler.disable).
@contextlib.contextmanager
def _buffers_kept_in_place() -> Iterator[None]:
    """Item 8 of Note [Patches during capture]."""
    handle = nn.modules.module.register_module_buffer_registration_hook(_assigned)
    try:
        yield
    finally:
        handle.remove()


@torch.compiler.disable
def _assigned(module: nn.Module, name: str, new):
    """The registration hook of Note [A buffer assigned anew during set-up]:
    the buffer's own tensor with `new`'s values, or None (replaced)."""
    old = module._buffers.get(name)
    if old is None or new is None or new is old or _held_twice(module, name, old, new):
        return None
    if not _alike(old, new):
        if getattr(new, "is_cuda", False) and torch.cuda.is_current_stream_capturing():
            _log.buffer_replaced_at_capture(module, name)
        return None
    with torch.no_grad():
        old.copy_(new)
    _log.buffer_kept_in_place(module, name)
    return old


def _held_twice(module: nn.Module, name: str, old, new) -> bool:
    """Whether `module` holds `old` or `new` under another name than the
    buffer `name` (a swap, an alias attribute)."""
    others = [t for n, t in module._buffers.items() if n != name]
    others += [v for v in vars(module).values() if isinstance(v, torch.Tensor)]
    return any(t is old or t is new for t in others)


def _alike(old, new) -> bool:
    """Whether buffer `old` can take `new`'s values in place (Note [A buffer
    assigned anew during set-up])."""
    return (type(old) is torch.Tensor and type(new) is torch.Tensor
            and old.layout == torch.strided and new.layout == torch.strided
            and not old.requires_grad and not new.requires_grad
            and old.shape == new.shape and old.dtype == new.dtype and old.device == new.device
            and (torch.is_inference_mode_enabled() or not old.is_inference())
            and torch._debug_has_internal_overlap(old) == 0
            and old.untyped_storage().data_ptr() != new.untyped_storage().data_ptr())


# Note [One set-up at a time]
# Q: Why does a set-up (warm-up and capture) started on a second thread
#    raise while one is under way on another?
# A: A set-up changes process-wide state until it ends: torch's globals (Note
#    [Patches during capture]: each patch saves what it finds and puts it
#    back at the end) and the native core's one RNG owner (csrc/aten_rng.cpp).
#    Two set-ups on two threads would interleave them: the second would save
#    the first's patches as torch's originals and put them back last, so they
#    would stay after both, and each would answer the other's checkpointed
#    regions with its own random streams (dropout masks silently wrong).
#    Waiting instead could hang: threads that drive one GPU each take part in
#    the same collectives, and a warm-up's all-reduce on one thread would
#    wait for a thread waiting for the set-up to end.  So the second raises
#    and says what to do.  A set-up inside another on the same thread (a
#    graphed layer's first call inside a training step being warmed up)
#    nests, and so does one inside a backward: autograd runs a CUDA backward
#    on a device thread of its own, where a checkpointed region's recompute
#    may call a graphed layer that captures (a backward on some other thread
#    passes too: autograd does not say whose backward it runs).  The native
#    core's pause of the garbage collector counts nesting too (Note [No
#    garbage collection while capturing], csrc/capture.c).
class _SetUp:
    """The thread whose set-up is under way (None when none is) and how
    many set-ups are open, nested in it."""

    lock = threading.Lock()
    thread: int | None = None
    depth = 0


@contextlib.contextmanager
def one_setup_at_a_time() -> Iterator[None]:
    """Note [One set-up at a time]."""
    me = threading.get_ident()
    inside_a_backward = torch._C._current_graph_task_id() != -1
    with _SetUp.lock:
        if _SetUp.thread not in (None, me) and not inside_a_backward:
            raise RuntimeError(
                "cgraph: another thread is warming up and capturing graphs now, and set-ups "
                "change process-wide state (Note [One set-up at a time] in "
                "cgraph/_capture.py). Graph from one thread, or let the other thread's "
                "make_graphed call (or first call of a new shape) finish before this one.")
        if _SetUp.thread is None:
            _SetUp.thread = me
        _SetUp.depth += 1
    try:
        yield
    finally:
        with _SetUp.lock:
            _SetUp.depth -= 1
            if _SetUp.depth == 0:
                _SetUp.thread = None


@contextlib.contextmanager
def _rng_stream_kept(specs: Sequence[_C.CallableSpec]) -> Iterator[None]:
    """Item 5 of Note [Patches during capture], on the callables' device."""
    if not specs:
        yield
        return
    device = specs[0].device
    state = torch.cuda.get_rng_state(device)
    try:
        yield
    finally:
        torch.cuda.set_rng_state(state, device)


@contextlib.contextmanager
def _autocast_cache_off() -> Iterator[None]:
    """Note [Autocast's weight cache]: inside an autocast region torch caches
    the low-precision copy of each weight until the region ends.  A copy
    cached during capture is freed at the region's exit while the graph keeps
    reading its memory, and a copy cached before capture is never refreshed
    after an optimizer step; so torch refuses cache_enabled=True.  cgraph
    turns the cache off while it warms up and captures: the graph then casts
    the weights on every replay, and the caller's region keeps its cache."""
    enabled = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(enabled)


def _cudagraph_trees_refused():
    """Item 7 of Note [Patches during capture]: torch.compile's reduce-overhead
    runs its own CUDA graphs (cudagraph trees), which cannot run inside
    cgraph's capture.  Where it ran before (a step's eager warm-up), its
    replay inside the capture first syncs, so the failure would read as a
    sync: refused at its entry instead, as what it is."""
    trees = sys.modules.get("torch._inductor.cudagraph_trees")
    manager = getattr(trees, "CUDAGraphTreeManager", None)
    if manager is None or not hasattr(manager, "_run"):
        return contextlib.nullcontext()

    run = manager._run

    def refuse(self, *args, **kwargs):
        # Another thread's compiled model (one training while this one sets
        # up) is not inside the set-up: it runs as it would.
        if threading.get_ident() != _SetUp.thread and not torch.cuda.is_current_stream_capturing():
            return run(self, *args, **kwargs)
        raise _C.Refusal("cgraph: torch.compile(mode='reduce-overhead') ran its own CUDA "
                         "graphs inside cgraph's capture.", _C.FAILURE_NESTED_GRAPHS)

    return patched({(manager, "_run"): refuse})


def _donated_buffers_off():
    """Item 6 of Note [Patches during capture]."""
    from torch._functorch import config
    if not hasattr(config, "donated_buffer"):
        return contextlib.nullcontext()
    return config.patch(donated_buffer=False)


@contextlib.contextmanager
def patched(patches: dict) -> Iterator[None]:
    """Sets each (owner, name) to its value for the duration, then puts the
    originals back (cgraph/_explain.py patches with it too)."""
    # Each original, or None where the owner only inherited it.
    saved = {(owner, name): vars(owner).get(name) for owner, name in patches}
    for (owner, name), value in patches.items():
        setattr(owner, name, value)
    try:
        yield
    finally:
        for (owner, name), original in saved.items():
            if original is None:
                delattr(owner, name)
            else:
                setattr(owner, name, original)


def _rng_hooks():
    """Items 2 and 3 of Note [Patches during capture]."""
    torch_get, torch_set = torch.cuda.get_rng_state, torch.cuda.set_rng_state

    def get_rng_state(device="cuda"):
        if asked_by_the_compiler():
            return torch_get(device)
        state = _C.rng_get_state(_cuda_index(device))
        return torch_get(device) if state is None else state

    def set_rng_state(new_state, device="cuda"):
        if asked_by_the_compiler() or not _C.rng_set_state(new_state, _cuda_index(device)):
            torch_set(new_state, device)

    seeds = ((torch, "manual_seed"), (torch.random, "manual_seed"),
             (torch.cuda, "manual_seed"), (torch.cuda, "manual_seed_all"))
    patches = {(torch.cuda, "get_rng_state"): get_rng_state,
               (torch.cuda, "set_rng_state"): set_rng_state}
    for key in seeds:
        seed = getattr(*key)
        patches[key] = _refused_while_capturing(
            seed, "cgraph: random generator state changed during capture: "
                  f"{seed.__module__}.{seed.__name__} was called.")
    patches.update(_dtensor_rng_refusals())
    return patched(patches)


def _refused_while_capturing(fn, message: str):
    """fn, raising a Refusal (rng_changed) with `message` instead while a
    stream captures: item 3 of Note [Patches during capture]."""
    def while_set_up(*args, **kwargs):
        if torch.cuda.is_current_stream_capturing():
            raise _C.Refusal(message, _C.FAILURE_RNG_CHANGED)
        return fn(*args, **kwargs)
    return while_set_up


_DTENSOR_RNG = (
    "cgraph: a random op on a DTensor (dropout on a tensor-parallel activation, or "
    "DTensor's init ops) ran inside the graphed callable: DTensor's RNG tracker moves the "
    "CUDA generator's offset on the host around each such op, which a graph would not "
    "repeat on replay. Run random ops on plain tensors: keep parallelize_module's "
    "use_local_output=True (the default) for the layers whose outputs they take, or call "
    ".to_local() before the op.")


def _dtensor_rng_refusals() -> dict:
    """Item 3 of Note [Patches during capture], for DTensor's RNG tracker:
    the tracker's methods that a random op on a DTensor enters, refusing
    while a stream captures.  Nothing where DTensor is not loaded: without
    it no DTensor exists to draw from."""
    random = sys.modules.get("torch.distributed.tensor._random")
    tracker = getattr(random, "OffsetBasedRNGTracker", None)
    if tracker is None:
        return {}
    return {(tracker, name): _refused_while_capturing(getattr(tracker, name), _DTENSOR_RNG)
            for name in ("_distribute_region", "_compute_rng_offsets") if hasattr(tracker, name)}


def asked_by_the_compiler() -> bool:
    """Whether the caller of the function asking this is torch.compile's own
    bookkeeping: dynamo and inductor save the CUDA RNG
    state around every compile and put it back, which is no region of the
    callable's (a compile in one warm-up call and not in the next must not
    change where the regions are), so torch answers it."""
    caller = sys._getframe(2).f_globals.get("__name__", "")
    return caller.startswith(("torch._dynamo.", "torch._inductor.", "torch._functorch."))


def _reentrant_regions_checked(specs):
    """Note [Reentrant regions]: while cgraph warms up and captures, a
    torch.utils.checkpoint region with use_reentrant=True may read leaves
    that require grad only if they are arguments or parameters of the
    graphed callables.  Its backward rebuilds the region's autograd graph and
    runs .backward() on it, so another leaf (a tensor in a closure) would get
    a grad at capture time and none at replay: that raises here instead
    (csrc/aten_warmup.cpp, Note [Backward capture runs .backward()])."""
    known = {id(t) for spec in specs for t in (*spec.tensors, *spec.params)}
    region_inputs: set[int] = set()
    detach_variable, backward = checkpoint_module.detach_variable, torch.autograd.backward

    def detach_and_note(inputs):
        detached = detach_variable(inputs)
        region_inputs.update(id(t) for t in detached if isinstance(t, torch.Tensor))
        return detached

    def checked_backward(tensors, *args, **kwargs):
        # A reentrant region's .backward() runs inside the backward being
        # warmed up or captured; one started outside every backward (another
        # thread training while this one sets up) is not the set-up's.
        if torch._C._current_graph_task_id() == -1:
            return backward(tensors, *args, **kwargs)
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        for leaf in _C.autograd_leaves([t for t in roots if isinstance(t, torch.Tensor)]):
            if id(leaf) not in known and id(leaf) not in region_inputs:
                raise _C.Refusal(
                    f"cgraph: a tensor of shape {tuple(leaf.shape)} that requires grad is "
                    "read inside a torch.utils.checkpoint(use_reentrant=True) region but is "
                    "neither an argument nor a parameter of the graphed callable, so its "
                    "grad would be computed once, at capture. Make it an nn.Parameter of the "
                    "module, pass it as an argument, or use use_reentrant=False.",
                    _C.FAILURE_REENTRANT_LEAF,
                )
        return backward(tensors, *args, **kwargs)

    return patched({(checkpoint_module, "detach_variable"): detach_and_note,
                     (torch.autograd, "backward"): checked_backward})


def _cuda_index(device) -> int:
    if isinstance(device, int):
        return device
    device = torch.device(device)
    return torch.cuda.current_device() if device.index is None else device.index

"""Layers sharded by FSDP2 (``torch.distributed.fsdp.fully_shard``), graphed
one by one: FSDP's hooks run around each graph, and the graph reads the
unsharded parameters at fixed homes.

Note [FSDP2's unsharded parameters in per-layer graphs]
Q: FSDP2 all-gathers a layer's parameters before its forward and frees them
   after (``reshard_after_forward``), and again around its backward.  A
   graph reads memory at the addresses it was captured with, and FSDP's
   unsharded parameters get new memory on every all-gather (their storage
   is resized to 0 and back).  How does a layer's graph read them?
A: cgraph gives them a fixed home.  FSDP copies the all-gathered
   parameters out into its all-gather outputs, whose storages the unsharded
   parameters view; at the layer's first capture (inside its forward, after
   FSDP's pre-forward hook: a graphed FSDP layer captures on its first call,
   samples or not) cgraph copies them into a home buffer, points those
   storages at it (``_C.lend_memory``, csrc/aten_lend.cpp: the StorageImpl
   itself is repointed, so the parameter, its views and weights autograd
   saved read the home) and replaces the FSDPParam's
   ``alloc_all_gather_outputs`` for that instance: from then on FSDP's
   "allocation" before each copy-out lends the home again, no allocation is
   made, and its copy-out writes straight into the memory the graph reads.
   FSDP's reshard frees the storage as before (``resize_(0)`` drops the
   loan); only the layer's compute is in the graph, FSDP's all-gathers,
   reduce-scatters and prefetching run from its hooks around it.  (With one
   rank FSDP copies into a storage it allocates itself; there the storage
   stays lent, at its full size, and has a home of its own: ``_Keeper``.)
   What it costs: no copy and no kernel per step.  Memory: a layer FSDP
   re-gathers before its backward (``reshard_after_forward`` True or an int)
   shares one home with every such layer of the same parameter layout (the
   decoder layers of a transformer): FSDP copies a layer out just before it
   runs, forward and backward, and frees it after, so a home serves one
   layer at a time; that is one unsharded layer held for good, in place of
   the copy-out buffers FSDP would allocate at each all-gather.  A layer
   kept unsharded from its forward to its backward
   (``reshard_after_forward=False``) has a home of its own: the unsharded
   parameters FSDP holds through the pass anyway, held between steps too.
   The layers sharing a home and one ``pool=`` share their unsharded grads'
   memory as well, one store per parameter of the layout (Note [One grad
   store per parameter] in csrc/aten_capture_backward.cpp): FSDP copies a
   layer's grads into its reduce-scatter and drops them before the next
   layer's backward, as eager frees them.
   Checked, never silently stale: each forward and backward replay checks
   that every parameter is where the graphs read it (csrc/aten_replay.cpp,
   Engine::check_param_memory), so a copy-out that did not go to the home
   raises; only the FSDP module itself is homed, so a module graphed inside
   another's FSDP unit is refused when graphed (``enclosing``); a shared home
   lent to a layer while another layer it serves is inside its forward or
   backward raises (``Home.lend``); one that is idle is resharded (Note [A
   layer kept unsharded in a shared home]). ``reset()`` gives FSDP its own
   allocation back, and the home is freed once no storage borrows it.

Note [A layer kept unsharded in a shared home]
Q: FSDP2 keeps a layer unsharded after its backward when told to
   (``set_reshard_after_backward(False)``, gradient accumulation that saves
   the next micro-batch's all-gathers), or after an explicit ``unshard()``.
   Its home is shared: the next layer's copy-out would overwrite it.  What
   then?
A: When a layer is lent the home, a layer still holding it that is idle
   (between its passes: FSDP's IDLE or POST_BACKWARD) is resharded, as
   ``reshard_after_backward=True`` would have: FSDP all-gathers it again
   before its next forward or backward, as it does any sharded layer, so
   results are eager's and only that all-gather is added.  Logged once.
   Its unsharded grads are FSDP's, not the home's, and stay (accumulation
   without reduce-scatter keeps them across micro-batches).  A holder inside
   its forward or backward would be read while overwritten: that raises.
   Layers sharded with ``reshard_after_forward=False`` have homes of their
   own and stay unsharded as FSDP keeps them.
"""

from __future__ import annotations

import functools
import warnings
import weakref
from typing import Callable

import torch
from torch import nn

from . import _C, _log

try:
    from torch.distributed.fsdp import FSDPModule
except ImportError:  # a torch built without distributed
    FSDPModule = None

_ALIGN = 256  # bytes: each parameter's home starts as the caching allocator's blocks do

# Homes shared by the layers FSDP re-gathers before backward, by (device,
# layout); a home lives while a parameter's lender holds it.
_shared: "weakref.WeakValueDictionary[tuple, Home]" = weakref.WeakValueDictionary()
# The models (FSDP roots' comm_ctx) a shared home was taken back from, logged once each.
_took_back: "weakref.WeakSet" = weakref.WeakSet()
# The FSDP parameters each graphed callable homed, for reset(); weakly: an
# FSDPParam holds its module, whose forward holds the graphed callable, so
# a list of them kept every graphed FSDP layer's graphs after its model was
# dropped.
_homed: "weakref.WeakKeyDictionary[_C.Graphed, weakref.WeakSet]" = weakref.WeakKeyDictionary()


def is_fsdp(module) -> bool:
    """Whether `module` is an FSDP2 module (``fully_shard`` was applied to it)."""
    return FSDPModule is not None and isinstance(module, FSDPModule)


def nested(module: nn.Module) -> str | None:
    """The name of the first FSDP2 module inside `module` (not itself), or
    None: a module graphed whole must not contain one, since its hooks
    (all-gathers, reduce-scatters) would run once, inside the capture."""
    if FSDPModule is None:
        return None
    return next((name for name, sub in module.named_modules()
                 if sub is not module and isinstance(sub, FSDPModule)), None)


def enclosing(module: nn.Module) -> nn.Module | None:
    """The FSDP2 module around `module` (not itself an FSDP module) whose
    fully_shard manages some of its parameters, or None.  FSDP reshards
    them after that module's forward and gathers them again before its
    backward, into memory it allocates then: a graph of `module` alone
    would read them where they were at capture.  (Only a graphed FSDP
    module itself gets a home: Note [FSDP2's unsharded parameters in
    per-layer graphs].)  Found through torch's registry of composable
    states, which fully_shard fills whether or not cgraph was imported
    first."""
    if FSDPModule is None or is_fsdp(module):
        return None
    mine = {id(p) for p in module.parameters()}
    if not mine:
        return None
    try:
        from torch.distributed._composable_state import _module_state_mapping
    except ImportError:  # a torch without it: the replays' address checks remain
        return None
    return next((owner for owner in list(_module_state_mapping.keys())
                 if is_fsdp(owner) and not mine.isdisjoint(faces(owner))), None)


ENCLOSED_FIX = ("Apply fully_shard to this module itself (before the module around it), then "
                "graph it; or graph the fully_shard-ed module around it instead.")


def refuse_enclosed(index: int, module: nn.Module) -> None:
    owner = enclosing(module)
    if owner is not None:
        raise ValueError(
            f"cgraph: module {index} ({type(module).__name__}) has parameters that fully_shard "
            f"manages as part of {type(owner).__name__}, a module around it: FSDP frees them "
            "after that module's forward and gathers them again before its backward, into "
            f"new memory, which a graph of this module alone would not read. {ENCLOSED_FIX}")


def refuse_other_sharding(index: int, module: nn.Module) -> None:
    """FSDP1 (FullyShardedDataParallel) and DeepSpeed ZeRO-3 gather and free
    parameters inside the module's forward, from Python, with host-side
    state: captured, they would run once.  Refused, naming FSDP2."""
    try:
        from torch.distributed.fsdp import FullyShardedDataParallel
    except ImportError:  # a torch built without distributed
        FullyShardedDataParallel = ()
    inside = next((name or "the module itself" for name, sub in module.named_modules()
                   if isinstance(sub, FullyShardedDataParallel)), None)
    if inside is not None:
        raise ValueError(
            f"cgraph: module {index} ({type(module).__name__}) holds FSDP1 "
            f"(FullyShardedDataParallel at {inside}), whose all-gathers and frees run inside "
            "its forward and would run once, at capture. Shard with FSDP2 instead "
            "(torch.distributed.fsdp.fully_shard on every layer and the root; Lightning's "
            "ModelParallelStrategy, Accelerate's fsdp_version=2), then graph each layer.")
    if any(hasattr(p, "ds_id") for p in module.parameters()):
        raise ValueError(
            f"cgraph: module {index} ({type(module).__name__}) has parameters partitioned by "
            "DeepSpeed ZeRO stage 3, gathered and freed by hooks inside its forward, which "
            "would run once, at capture. Use ZeRO stage 1 or 2, or FSDP2 (fully_shard), with "
            "per-layer graphs.")


NESTED_FIX = ("Graph each fully_shard-ed layer itself (cgraph.make_graphed(layer) for each "
              "layer), or graph the whole training step (cgraph.make_graphed_step).")


def refuse_nested(index: int, module: nn.Module) -> None:
    name = nested(module)
    if name is not None:
        raise ValueError(
            f"cgraph: module {index} ({type(module).__name__}) contains '{name}', to which "
            f"fully_shard was applied; its all-gathers would run once, at capture. {NESTED_FIX}")


def refuse_in_drop_in(index: int, module) -> None:
    """make_graphed_callables captures at once, before FSDP's first forward
    has set up its state: an FSDP layer must capture inside its forward."""
    if is_fsdp(module):
        raise ValueError(
            f"cgraph: callable {index} ({type(module).__name__}) is sharded by fully_shard; "
            "graph it with cgraph.make_graphed(layer) (optionally pool=), which captures on "
            "its first call, after FSDP's all-gather: Note [FSDP2's unsharded parameters in "
            "per-layer graphs] in cgraph/_fsdp.py.")


def faces(module: nn.Module) -> dict[int, object]:
    """id() of each face of the module's FSDP parameters (sharded DTensor,
    unsharded tensor), mapped to its FSDPParam: FSDP swaps one for the other
    on the module around every forward, which is not a replacement."""
    out = {}
    for p in (p for group in _param_groups(module) for p in group.fsdp_params):
        out[id(p.sharded_param)] = p
        unsharded = getattr(p, "_unsharded_param", None)
        if unsharded is not None:
            out[id(unsharded)] = p
    return out


class Home:
    """The memory the graphs of FSDP layers read their unsharded parameters
    from: one layer's, or shared by the layers of one layout that FSDP
    re-gathers before backward (Note [FSDP2's unsharded parameters in
    per-layer graphs])."""

    __slots__ = ("buffer", "views", "_holder", "__weakref__")

    def __init__(self, like: list[torch.Tensor]):
        offsets, size = [], 0
        for t in like:
            offsets.append(size)
            size += -(-t.numel() * t.element_size() // _ALIGN) * _ALIGN
        self.buffer = torch.empty(size, dtype=torch.uint8, device=like[0].device)
        self.views = [self.buffer[o:o + t.numel() * t.element_size()].view(t.dtype)
                      for o, t in zip(offsets, like)]
        self.holder = None

    @property
    def holder(self):
        """The FSDPParamGroup it was last lent to, while that lives (held
        weakly: a dropped model's layer is not kept alive by a home another
        model still shares)."""
        return self._holder() if self._holder is not None else None

    @holder.setter
    def holder(self, group) -> None:
        self._holder = weakref.ref(group) if group is not None else None

    def free_for(self, group) -> bool:
        """Whether lending it to `group` overwrites nothing a layer needs: the
        layer it was last lent to has been resharded since."""
        holder = self.holder  # once: a weak reference, which a collection may clear
        return holder is None or holder is group or not _unsharded(holder)

    def lend(self, group, outputs: list[torch.Tensor], views: list[torch.Tensor]) -> None:
        holder = self.holder
        if not self.free_for(group):
            _take_back(holder, group)
            # Logged once per model: FSDP's lazy init gives the groups under one
            # root one comm_ctx (and a notebook's second model may find the
            # first's home still alive, so not once per home).
            model = getattr(holder, "comm_ctx", self)
            if model not in _took_back:
                _took_back.add(model)
                _log.fsdp_home_taken_back(group_name(holder), group_name(group))
        self.holder = group
        _C.lend_memory(outputs, views)


def _take_back(holder, group) -> None:
    """The shared home, wanted by `group`, is still lent to `holder`:
    Note [A layer kept unsharded in a shared home]."""
    state, held, wanted = _training_state(holder), group_name(holder), group_name(group)
    if state == "UNKNOWN":
        raise RuntimeError(
            f"cgraph: FSDP layer {held} still holds the home its graphs share with "
            f"{wanted}, and this torch's FSDP does not say whether it is inside a pass "
            "(no _training_state), so cgraph cannot reshard it safely. Shard these layers "
            "with reshard_after_forward=False (each then gets a home of its own), and report "
            "your torch version.")
    if state not in ("IDLE", "POST_BACKWARD"):
        raise RuntimeError(
            f"cgraph: FSDP layers {held} and {wanted}, whose graphs share one "
            f"home for their unsharded parameters, were both unsharded inside a forward or "
            f"backward, so one would read the other's parameters ({held} is in FSDP's "
            f"{state}: a layer called inside another or twice in a pass, or one whose inputs "
            "need no grad, which FSDP reshards only at the end of the backward). Shard these "
            "layers with reshard_after_forward=False: each then gets a home of its own.")
    holder.reshard()


# Note [FSDP2's host state around a graphed step]
# Q: A step graphed whole (make_graphed_step) replays FSDP2's all-gathers,
#    reshards and reduce-scatters on the device; FSDP's host state (which
#    groups are unsharded, the memory their unsharded parameters view) stays
#    as the capture left it: every group sharded.  An eager forward between
#    replays (a torch.no_grad() evaluation, or a user's unshard()) leaves
#    groups unsharded: the root always (FSDP reshards the root in its
#    post-backward, which a forward without grad never runs), layers with
#    reshard_after_forward=False, and an int's layers resharded to their
#    smaller mesh.  What goes wrong, and what does cgraph do?
# A: Left so, FSDP's next eager forward finds them unsharded and gathers
#    nothing: a second evaluation read the parameters as the first gathered
#    them, before the optimizer steps the replays made since (eager's own
#    next training step reshards them).  And a capture after such a forward
#    would read the evaluation's memory, freed by the capture's reshard.
#    So before each capture and each replay (_step.py), every group of the
#    FSDP modules the step names that is idle and not sharded is resharded
#    (FSDP's own reshard(), host work that frees the unsharded memory): the
#    state the capture expects and leaves, and the one eager's training step
#    would leave.  Cost per replay: an attribute read and a compare per
#    group, about 3 us for a 32-layer model.
class Resharded:
    """The FSDP modules a step names and their param groups: resharded
    before its captures and replays where an eager forward left them
    unsharded, and put back to rest after a capture that failed inside
    FSDP's pass (Note [A capture that fails inside FSDP2's pass])."""

    __slots__ = ("modules", "groups")

    def __init__(self, roots) -> None:
        found = {id(m): m for root in roots for m in root.modules() if is_fsdp(m)}
        self.modules = tuple(found.values())
        self.groups = tuple(g for m in self.modules for g in _param_groups(m))

    def __call__(self) -> None:
        for g in self.groups:
            if not g.is_sharded and _training_state(g) == "IDLE":
                g.reshard()

    def after_failed_capture(self) -> None:
        roots = {id(s): s for s in (m._get_fsdp_state() for m in self.modules)
                 if getattr(s, "_is_root", None)}
        for state in roots.values():
            if _inside_a_pass(state):
                _reset_iter_state(state)


# Note [A capture that fails inside FSDP2's pass]
# Q: A step's capture that fails part-way (a host sync in a layer, or a
#    planted error after the forward) stops inside FSDP's forward or
#    backward: its root is still the iteration's forward root, its groups
#    FORWARD and unsharded into memory the capture never wrote (a capture
#    runs no kernel), the post-backward callback perhaps still queued.  The
#    caller goes on eagerly (Lightning's fallback, or a script that catches
#    CaptureError): what does FSDP do then?
# A: Its next forward skips the root's set-up (the root is still in a
#    pass), gathers nothing for the groups it finds unsharded and reads
#    their unwritten memory; ranks whose capture succeeded gather the root,
#    so the ranks' collectives no longer match (a hang).  After a failed
#    capture, on every rank, each FSDP root of the step still inside a pass
#    (its iteration root set, a state or group not IDLE, a group unsharded:
#    the root, which FSDP reshards only after the backward) is put back to
#    rest as torch 2.14's FSDPModule.reset_iter_state puts it, less that
#    reset's waits for the pass's CUDA events: those were recorded inside
#    the capture, and a stream outside it cannot wait on them.  A rank whose
#    capture succeeded (another one failed) is at rest already.  No rank
#    drops grads held for a later reduction: a capture never starts with
#    any (Note [Grad sync set outside a graphed step],
#    cgraph/_step_checks.py).
def _inside_a_pass(root_state) -> bool:
    ctx = root_state._state_ctx
    if ctx.iter_forward_root is not None or getattr(ctx, "post_backward_final_callback_queued",
                                                    False):
        return True
    for state in ctx.all_states:
        if state._training_state.name != "IDLE":
            return True
        if any(not g.is_sharded or _training_state(g) != "IDLE" for g in _state_groups(state)):
            return True
    return False


def _state_groups(state) -> list:
    groups = getattr(state, "_fsdp_param_groups", None)  # torch 2.14; 2.11 has one
    return list(groups) if groups is not None else [
        g for g in (state._fsdp_param_group,) if g is not None]


def after_failed_layer_capture(module: nn.Module) -> None:
    """After a per-layer capture of FSDP layer `module` raised inside its
    forward (an out-of-memory, a host sync), caught and gone on from: FSDP's
    post-forward never ran, so the layer stays unsharded, in its FORWARD
    state, holding the home its graphs may share with other layers, whose
    next forward would find it taken (_take_back raises).  Resharded and
    IDLE as that post-forward leaves it (reshard() while FORWARD reshards
    only what FSDP reshards after a forward); the next call gathers it
    again.  The root's pass state stays FSDP's own, as after any forward
    that raises: Note [A capture that fails inside FSDP2's pass] is the
    whole step's.  A failure here (out of memory again, resharding to an
    int's mesh) is warned of, not raised over the capture's own error."""
    try:
        for g in _param_groups(module):
            if _training_state(g) == "FORWARD":
                g.reshard()
                g._training_state = type(g._training_state).IDLE
        state = module._get_fsdp_state()
        if getattr(state._training_state, "name", None) == "FORWARD":
            state._training_state = type(state._training_state).IDLE
    except Exception as exc:  # noqa: BLE001
        warnings.warn(f"cgraph: could not put FSDP layer {type(module).__name__} back to rest "
                      f"after its failed capture ({exc!r}): it may still hold the memory its "
                      "graphs share with other layers. Call its reshard() before the next "
                      "forward.", stacklevel=3)


def _reset_iter_state(root_state) -> None:
    """torch 2.14's FSDPState._reset_iter_state, for any torch, less its waits
    for events recorded inside the failed capture."""
    comm = root_state._comm_ctx
    if hasattr(comm, "all_gather_state"):
        comm.all_gather_state = None
    for name in ("reduce_scatter_states", "post_forward_order", "_last_post_reduce_events"):
        getattr(comm, name, []).clear()
    if hasattr(comm, "reduce_scatter_state"):
        comm.reduce_scatter_state = None
    for state in root_state._state_ctx.all_states:
        getattr(state, "_modules_to_run_forward", set()).clear()
        state._training_state = type(state._training_state).IDLE
        for g in _state_groups(state):
            for name in ("_all_gather_result", "_post_reduce_event", "_all_reduce_state",
                         "_reshard_after_forward_event", "_partial_reduce_output"):
                if hasattr(g, name):
                    setattr(g, name, None)
            getattr(g, "_post_forward_indices", []).clear()
            g._training_state = type(g._training_state).IDLE
            for fsdp_param in g.fsdp_params:  # grads the capture never wrote
                unsharded = getattr(fsdp_param, "_unsharded_param", None)
                if unsharded is not None:
                    unsharded.grad = None
                if hasattr(fsdp_param, "unsharded_accumulated_grad"):
                    fsdp_param.unsharded_accumulated_grad = None
            g.reshard()
    root_state._state_ctx.iter_forward_root = None
    root_state._state_ctx.post_backward_final_callback_queued = False


def all_reduces(group) -> bool:
    """Whether `group` all-reduces its reduced grads across replicas (HSDP's
    replicate dimension), which its all_reduce_grads turns off."""
    return getattr(getattr(group, "mesh_info", None), "replicate_mesh_dim", None) is not None


def holding_grads(groups) -> str | None:
    """The name of the first of `groups` holding grads of earlier backwards
    in its own Python state for a later reduction, or None: Note [Grad sync
    set outside a graphed step] (cgraph/_step_checks.py).  Unsharded grads
    kept with reduce_grads off stay the unsharded parameters' .grad, or
    move to unsharded_accumulated_grad where the reduce dtype is another;
    an HSDP partial reduction is kept with all_reduce_grads off.  At rest
    after a reducing backward, FSDP holds none of them."""
    for g in groups:
        if getattr(g, "_partial_reduce_output", None) is not None or any(
                getattr(p, "unsharded_accumulated_grad", None) is not None
                or getattr(getattr(p, "_unsharded_param", None), "grad", None) is not None
                for p in g.fsdp_params):
            return group_name(g)
    return None


# Note [Grads FSDP2 holds, kept after a step's capture]
# Q: A step graphed whole over FSDP2 modules was captured while FSDP held no
#    grads for a later reduction.  Later, micro-batches run outside it under
#    set_requires_gradient_sync(False) (a batch-size ramp-up, an auxiliary
#    loss), and then the step: what does its replay do with the unsharded
#    grads FSDP holds from them?
# A: Nothing: its reduce-scatter reads the graph's own grads, so the held
#    ones are dropped where eager would add them in, silently.  A capture
#    that finds them is refused (Note [Grad sync set outside a graphed step]
#    in cgraph/_step_checks.py), but a replay cannot look for them at every
#    call: they sit in FSDP's own Python state, one attribute or two per
#    parameter (about 60 us of Python for 200 parameters).  So cgraph hears
#    of them instead: once a step that names FSDP groups is captured,
#    FSDPParamGroup.post_backward is wrapped for good (watch_held_grads), to
#    count the backwards that end with the group keeping its grads
#    (reduce_grads off, or HSDP's all-reduce off): held.backwards, one
#    integer.  A replay compares it with the count it last saw (GradSync in
#    cgraph/_step_checks.py); only where it moved does it walk the groups
#    (holding_grads), and where they hold grads the call steps eagerly
#    (adding them in, as eager does) and the next captures again.  A call
#    that would capture again while FSDP holds such grads steps eagerly too
#    (GraphedStep._fsdp_holds_grads; warned at the third in a row, naming
#    the fix: the micro-batches inside the step), so a batch-size ramp-up
#    that accumulates outside from some call on trains on, eagerly; only a
#    first capture that finds them refuses.  Replays run no Python, so the step's
#    own backwards that keep grads (micro-batches inside it) count only at
#    its capture and eager calls, before it reads the count again.
class _Held:
    """The backwards of FSDP2 groups that kept their grads for a later
    reduction, counted since watching began."""

    __slots__ = ("backwards",)

    def __init__(self) -> None:
        self.backwards = 0


held = _Held()


def watch_held_grads(groups) -> None:
    """Wraps the post_backward of each of `groups`' classes (FSDPParamGroup)
    once: Note [Grads FSDP2 holds, kept after a step's capture]."""
    for cls in {type(g) for g in groups}:
        post_backward = getattr(cls, "post_backward", None)
        if post_backward is not None and not getattr(post_backward, "_cgraph_counts", False):
            cls.post_backward = _counting_held(post_backward)


def _counting_held(post_backward: Callable) -> Callable:
    @functools.wraps(post_backward)
    def counted(group, *args, **kwargs):
        if not (group.reduce_grads and (getattr(group, "all_reduce_grads", True)
                                        or not all_reduces(group))):
            held.backwards += 1
        return post_backward(group, *args, **kwargs)

    counted._cgraph_counts = True
    return counted


def refuse_offloaded(groups) -> None:
    """Refuses a step graphed whole over an FSDP module that offloads its
    parameters to the CPU (CPUOffloadPolicy): FSDP waits on the host for
    the copies of its grads to the CPU, a sync no capture can hold, and a
    graph would not replay the host's work anyway (an optimizer stepping
    the CPU parameters would step them once, at capture)."""
    for g in groups:
        if any(getattr(p, "offload_to_cpu", False) for p in g.fsdp_params):
            raise ValueError(
                f"cgraph: FSDP module {group_name(g)} offloads its parameters to the CPU "
                "(CPUOffloadPolicy), and a step graphed whole cannot hold FSDP's copies to "
                "the host and its wait for them. Graph the layers instead "
                "(cgraph.make_graphed(layer) for each fully_shard-ed layer, FSDP's hooks "
                "running around them) and step the optimizer outside the graphs.")


def _training_state(group) -> str:
    state = getattr(group, "_training_state", None)
    return getattr(state, "name", "UNKNOWN")


def group_name(group) -> str:
    """An FSDP param group's module name, for messages."""
    fqn = getattr(group, "_module_fqn", None)
    return repr(fqn) if fqn else type(group.modules[0]).__name__


class _Keeper:
    """FSDPParam.free_unsharded_param of a homed parameter of a one-rank
    group: its storage stays lent, while its graphed callable is alive.
    With one rank, FSDP copies the sharded parameter into a storage it
    allocates itself (torch's alloc_storage, not alloc_all_gather_outputs);
    a storage kept at its full size is not allocated again."""

    __slots__ = ("param", "graphed")

    def __init__(self, param, graphed: _C.Graphed):
        self.param, self.graphed = param, weakref.ref(graphed)

    def __call__(self) -> None:
        graphed = self.graphed()
        if graphed is None or graphed.is_reset:
            _unhome(self.param)
            self.param.free_unsharded_param()


class _Lender:
    """FSDPParam.alloc_all_gather_outputs of a homed parameter: lends the
    home instead of allocating, while its graphed callable is alive."""

    __slots__ = ("param", "group", "home", "views", "graphed")

    def __init__(self, param, group, home: Home, views: list, graphed: _C.Graphed):
        self.param, self.group, self.home, self.views = param, group, home, views
        self.graphed = weakref.ref(graphed)

    def __call__(self) -> None:
        graphed = self.graphed()
        if graphed is None or graphed.is_reset:
            _unhome(self.param)
            self.param.alloc_all_gather_outputs()
            return
        self.home.lend(self.group, self.param.all_gather_outputs, self.views)


def home_parameters(module: nn.Module, graphed: _C.Graphed) -> None:
    """Before a capture of FSDP layer `module` (inside its forward): its
    unsharded parameters moved to their home, and FSDP's copy-outs sent
    there from now on.  A layer `graphed` homed already is left as it is."""
    group = _param_group(module)
    if group is None or _homed_by(group, graphed, module):
        return
    for p in group.fsdp_params:
        if hasattr(p._sharded_local_tensor, "fsdp_post_all_gather"):
            raise ValueError(
                f"cgraph: parameter '{p._param_fqn}' uses an FSDP2 all-gather extension "
                "(fsdp_pre_all_gather, as float8 training does), which per-layer graphs do "
                "not support; graph the whole step (cgraph.make_graphed_step) instead.")
    outputs = [t for p in group.fsdp_params for t in p.all_gather_outputs]
    if not outputs or not _unsharded(group):
        raise RuntimeError(
            f"cgraph: FSDP layer {type(module).__name__} is not unsharded at its capture; "
            "call it as FSDP does (through the model, or the layer itself), not its forward.")
    home = _home_for(group, outputs)
    with torch.no_grad():
        torch._foreach_copy_(home.views, outputs)
    home.lend(group, outputs, home.views)
    at = 0
    for p in group.fsdp_params:
        n = len(p.all_gather_outputs)
        p.alloc_all_gather_outputs = _Lender(p, group, home, home.views[at:at + n], graphed)
        if _one_rank(group):
            p.free_unsharded_param = _Keeper(p, graphed)
        at += n
    _homed.setdefault(graphed, weakref.WeakSet()).update(group.fsdp_params)
    _log.log.debug("FSDP layer %s: %d parameter(s) in a %s home of %.1f MiB",
                   type(module).__name__, len(group.fsdp_params),
                   "shared" if home is _shared.get(_key(outputs)) else "private",
                   home.buffer.numel() / 2**20)


def _homed_by(group, graphed: _C.Graphed, module: nn.Module) -> bool:
    """Whether an earlier capture of `graphed` homed the group already.  The
    lenders of a graphed callable dropped or reset since are removed (the
    layer graphed again); a group another live one homed is refused: one
    fully_shard of several modules makes one group for all of them, and its
    home can serve one graphed callable's captures only."""
    owners = {_owner(p) for p in group.fsdp_params}
    if owners - {graphed, None}:
        raise ValueError(
            f"cgraph: FSDP layer {type(module).__name__} shares its parameter group with a "
            "module another graphed callable captured (fully_shard applied to several modules "
            "at once), and a group's home serves one graphed callable. Apply fully_shard to "
            "each of those modules separately, then graph each.")
    if owners == {graphed}:
        return True
    for p in group.fsdp_params:
        _unhome(p)
    return False


def _owner(param) -> _C.Graphed | None:
    """The live graphed callable whose capture homed `param`, or None."""
    lender = param.__dict__.get("alloc_all_gather_outputs")
    graphed = lender.graphed() if isinstance(lender, _Lender) else None
    return None if graphed is None or graphed.is_reset else graphed


def release(graphed: _C.Graphed) -> None:
    """At reset(): the FSDP parameters `graphed` homed allocate as FSDP does
    again; a home is freed once no storage borrows it."""
    for p in list(_homed.pop(graphed, ())):
        _unhome(p)


def _home_for(group, outputs: list[torch.Tensor]) -> Home:
    """The shared home of this layout where FSDP re-gathers the layer
    before its backward and the home is free, else a home of its own."""
    if group.post_forward_mesh_info is None or _one_rank(group):  # not re-gathered
        return Home(outputs)
    key = _key(outputs)
    home = _shared.get(key)
    if home is None:
        home = _shared[key] = Home(outputs)
    elif not home.free_for(group):
        return Home(outputs)
    return home


def _key(outputs: list[torch.Tensor]) -> tuple:
    return (outputs[0].device, tuple((t.numel(), t.dtype) for t in outputs))


def _unhome(param) -> None:
    if isinstance(param.__dict__.get("alloc_all_gather_outputs"), _Lender):
        del param.alloc_all_gather_outputs
    if isinstance(param.__dict__.get("free_unsharded_param"), _Keeper):
        del param.free_unsharded_param


def _one_rank(group) -> bool:
    """Whether FSDP unshards the group as one rank (alloc_storage, not
    alloc_all_gather_outputs; its storage is kept: _Keeper): one shard, or
    no sharding at all (DDPMeshInfo: replicate())."""
    return getattr(group.mesh_info, "shard_mesh_size", 1) == 1


def _unsharded(group) -> bool:
    """Whether the group's all-gather outputs hold memory now."""
    return any(t.untyped_storage().nbytes() != 0
               for p in group.fsdp_params for t in p.all_gather_outputs)


def _param_groups(module: nn.Module) -> list:
    """Every FSDPParamGroup of an FSDP module (torch 2.14 may make several:
    a per-parameter mesh from shard_placement_fn), or [] where none."""
    if not is_fsdp(module):
        return []
    return _state_groups(module._get_fsdp_state())


def _param_group(module: nn.Module):
    """The FSDPParamGroup of an FSDP module, or None (no parameters of its
    own, or not an FSDP module); several are refused, naming the fix."""
    groups = _param_groups(module)
    if len(groups) > 1:
        raise ValueError(
            f"cgraph: FSDP layer {type(module).__name__} has {len(groups)} parameter groups "
            "(a per-parameter mesh from shard_placement_fn), which per-layer graphs do not "
            "support; shard its parameters over one mesh, or graph the whole step "
            "(cgraph.make_graphed_step).")
    return groups[0] if groups else None

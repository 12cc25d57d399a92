"""A whole training step in one CUDA graph: ``cgraph.make_graphed_step``.

The step is the user's own eager function (zero_grad, forward, loss,
backward, clip, GradScaler, optimizer.step), captured as one graph, so
everything on the host between kernels is gone.  The lifecycle, in the
order of the code below:

1. Warm-up: the first ``num_warmup_iters`` calls run the function eagerly.
   They are real steps (the docstring says so): n calls of the graphed step
   are n training steps, warm-up or not.  The optimizers the step uses are
   found there, through torch's global optimizer step hook.  They run where
   the capture will, allocating from the pool it takes, so the capture
   reuses their memory (Note [A step's warm-up in its pool] in
   csrc/aten_setup.cpp).
2. Capture, on the next call: each optimizer is made capturable (Note
   [Capturable optimizers]), the call's arguments are copied into static
   inputs, and the function is captured on a side stream.  The capture
   runs no kernel; that call's step is the first replay.
3. Replay: learning rates and other hyperparameters brought up to date,
   then one native call (Note [The step's hot path]): the arguments copied
   into the static inputs by the graph itself, the graph replayed, the
   outputs handed out (they keep their values across calls).
4. Reset: ``step.reset()`` frees the graph and its pool.

Note [Capturable optimizers]
Q: torch's optimizers keep state a graph cannot replay: a host-side step
   count and learning rate read as Python numbers.  How does one graph run
   the user's optimizer step after step?
A: Before capture, every param group that has torch's ``capturable`` flag
   (Adam, AdamW, ...) gets it set, and its ``step`` counters move to the
   device, as ``capturable=True`` would have made them.  The learning rate
   must change without a recapture (a scheduler steps between replays): an
   optimizer that reads it from the device (capturable Adam/AdamW, fused
   SGD) gets a device tensor in ``group["lr"]`` while it is captured, then
   the float back; before each replay, a group whose float changed since
   refills its tensor (one fill kernel).  A tensor lr off the parameters'
   device (``lr=torch.tensor(1e-3)``, on the CPU: fused kernels read it with
   ``.item()``, baking it in) is handled as a float: the user's tensor,
   which a scheduler fills in place, goes back after capture, and its value
   (``float()``, no GPU sync) is compared before each replay; a tensor lr on
   the parameters' device is read by the graph in place.  Any other
   hyperparameter baked into the graph as a number (SGD's lr unless fused,
   betas, weight decay, momentum) is compared before each replay, and a
   change recaptures, with a log line: nothing replays with a stale value.
   A change before every call (OneCycleLR's momentum) recaptures at every
   call, far slower than replays: warned once, at the third in a row.  A
   param group with no parameters steps nothing: none of its values is
   read or compared.  An optimizer is captured again too where its
   ``param_groups`` or ``state`` were replaced or grown since capture
   (``load_state_dict``, as resuming from a checkpoint does;
   ``add_param_group``; a group or its params list replaced), or that is
   gone, where the graph would go on stepping the tensors and reading the
   groups it captured: that call steps eagerly (creating the state of
   parameters added since: created inside a capture, it would be zeroed
   again at every replay), and the next one captures, after a ``reset()``
   too.  The optimizer counts as not found until it has stepped again, so
   a GradScaler skipping that step prolongs the warm-up.  A state emptied
   or refilled in place is not seen.  A GradScaler with such
   an optimizer: Note [GradScaler with any optimizer].  The capturable flags
   cgraph turned on stay on (its graph and recaptures need them), but the
   optimizer's ``state_dict()`` saves those groups with capturable off, as
   they were built, so that a checkpoint loads where an eager run's does
   (a CPU copy of the model; torch refuses capturable=True off the GPU).
   An lr the step sets itself (``group["lr"] = ...`` inside) would be baked
   in at its capture's value: refused at capture, naming the fix, where the
   optimizer reads it from the device; where it reads it on the host, each
   next call finds it changed since and captures again (correct, and warned
   of at the third such call in a row, naming the fix).

Note [GradScaler with any optimizer]
Q: GradScaler.step skips the optimizer's step when unscale_ found an inf or
   a NaN.  A fused optimizer takes found_inf on the device and skips inside
   its kernels; any other is skipped by the scaler on the host
   (``found_inf.item()``), a sync a graph cannot hold.  How does a graphed
   step skip it exactly as eager does?
A: While the step is captured, the scaler's host test is replaced by a CUDA
   conditional node (CUDA 12.4+): the optimizer's whole step is captured
   into the body of an "if found_inf is zero" node (cgraph records it
   itself, Note [Conditional regions] in csrc/aten_conditional.cpp; torch's
   begin_capture_to_if_node is 2.12+ only), so a replay runs it, or skips
   all of it (state, step counts and parameters untouched), as eager would.
   The scale itself is updated on the device by ``scaler.update()``, as
   before; its growth and backoff factors and growth interval go to that
   kernel as numbers, baked into the graph, so a change of them
   (``set_growth_factor``, ``load_state_dict``) recaptures, as a baked
   hyperparameter does (_ScalerFactors).  Cost per step when no
   inf occurs: a sum and a compare of one-element tensors, the kernel
   setting the node's condition, and the conditional node's launch of its
   body graph, a few microseconds of GPU time, none of host time.
   The body is captured once, so the optimizer must already have its state
   (momentum buffers, Adam moments): its first step would create it inside
   the body, every replay again.  A warm-up call whose step the scaler
   skipped (inf grads, common at fp16's first scales) therefore does not
   count: warm-up goes on until every such optimizer has stepped once.
   The same holds for a parameter trained later (unfrozen): after that
   change every such optimizer counts as unstepped again until a step the
   scaler does not skip made the parameter's state; and a capture that
   made state for such an optimizer anyway (a parameter unfrozen between
   warm-up calls) is dropped before its replay, and that call steps
   eagerly: inside the body, a replay whose found_inf is set would leave
   the new state unwritten, and it would be kept as the optimizer's.

Note [RNG inside a graphed step]
Q: How do dropout masks inside torch.utils.checkpoint (preserve_rng_state=
   True) come out as eager's in a graphed step?
A: As in per-layer graphs (Note [RNG in checkpointed regions],
   csrc/aten_rng.cpp): while captured, each torch.cuda.get_rng_state hands
   out a graph-safe generator state of its own, seeded at every replay at
   the offset where eager mode would be, and set_rng_state with it makes
   the recompute draw from there, so its masks are the forward's.  cgraph's
   own warm-up notes where those offsets fall; a step warms up eagerly
   instead (real steps, outside cgraph), so each warm-up call notes them
   itself (_warm_up_as_captured: the offset of the default generator at each
   get_rng_state, and how far the call moved it), and the last call's go to
   the engine with the captured call (CallableSpec.rng_warmup).  The
   recompute runs inside the same capture as the forward, where the
   region's state has moved on: setting a region's state back switches to a
   second state of that region, seeded at its start too.  The compiler's
   own asks (dynamo and inductor save and restore the state around each
   compile) are no regions: torch answers them, in warm-up and capture
   alike.  Random ops outside such regions (dropout, compiled code's
   seeds) draw from the default generator's graph-safe state, as every
   graph does.  Warm-up calls also run with autocast's weight cache and
   donated buffers off, as the capture will: compiled code guards on such
   global state, and a recompile at capture would run inside the capture.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import operator
import threading
import time
import warnings
import weakref
from typing import Any, Callable, NamedTuple

import torch
from torch.optim.optimizer import register_optimizer_step_pre_hook
from torch.utils import _pytree as pytree

from . import _C, _dtensor, _fsdp, _log, _optim, _ranks
from ._api import _live, _live_steps, _pool_id, _require_cuda
from ._capture import (CaptureOptions, _autocast_cache_off, _buffers_kept_in_place, _cuda_index,
                       _donated_buffers_off, asked_by_the_compiler, graph, one_setup_at_a_time,
                       patched)
from ._ddp import DDPInStep
from ._describe import CONSTANT_TYPES, Target, draft
from ._step_checks import GradSync, Marks, OtherGrads, SinceCapture, autocast_around, grad_mode
from ._step_grads import StepGrads
from ._step_pool import SharedPool
from ._modes import Modes, roots

__all__ = ["make_graphed_step", "GraphedStep"]

# CaptureError.kind of an RNG state asked for unlike in warm-up, as the native
# core names it (CG_FAILURE_KINDS in csrc/cgraph.h, the one list of kinds).
_RNG_REGIONS = _C.FAILURE_KINDS[_C.FAILURE_RNG_REGIONS]


def make_graphed_step(fn: Callable[..., Any], sample_args: tuple = (), *,
                      sample_kwargs: dict | None = None, num_warmup_iters: int = 3,
                      pool=None) -> "GraphedStep":
    """Graph a whole training step: ``step = make_graphed_step(fn, args)``.

    ``fn(*args, **kwargs)`` is an ordinary eager training step (zero_grad,
    forward, loss, backward, optionally ``clip_grad_norm_`` and a
    ``GradScaler``, ``optimizer.step()``) returning the loss or any pytree
    of tensors.  ``step(*args)`` then runs it: the first
    ``num_warmup_iters`` calls eagerly, the next one captures it into one
    CUDA graph, and every call from then on replays that graph.  Every call
    is one real training step, so n calls of ``step`` leave parameters,
    optimizer state, grads and the random-number stream as n eager calls of
    ``fn`` would.  Arguments are copied into the graph's inputs (calls pass
    tensors of ``sample_args``' shapes and devices, and the same constants; a
    tensor of another floating dtype is cast on the way in, as torch's
    ``make_graphed_callables`` casts it); the returned tensors keep their values
    across calls, and the step may return non-tensor values beside them.
    Arguments are data: one that requires grad is refused (the graph
    computes no grad for its copy of it).

    Optimizers are made capturable before capture (Note [Capturable
    optimizers] in cgraph/_step.py): torch.optim's optimizers work as built,
    those with a ``capturable=`` option, SGD, and Adagrad (Note [Optimizers
    without a capturable form]); LBFGS is refused.  An LR scheduler stepped
    between calls takes effect without recapture where the optimizer reads
    lr on the device (otherwise it recaptures, logged).  After an
    optimizer's ``load_state_dict`` or ``add_param_group`` (resuming from a
    checkpoint), the next call steps eagerly and the one after captures
    again (logged).  Capturable
    optimizers compute their step sizes on the device in float32, not on the
    host in float64: parameters then match eager's to float32 rounding, not
    bitwise (fused ones, SGD, Adagrad with lr_decay=0: bitwise).  A ``GradScaler`` works
    with any of them (Note [GradScaler with any optimizer]).  A
    ``DistributedDataParallel`` model built as usual may be called in ``fn``:
    its gradient allreduce is captured too, and the step stays eager until
    DDP has had the 11 forwards it needs (Note [DDP inside a graphed step]
    in cgraph/_ddp.py).  Python side effects in ``fn``
    (a counter, a print) run once, at capture.  A host sync in ``fn``
    (``.item()``, a branch on a tensor) or a draw from the CPU's random
    generator raises ``CaptureError`` naming it and the fix.

    Example::

        def train_step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            return loss

        step = cgraph.make_graphed_step(train_step, (x, y))
        for x, y in loader:
            loss = step(x, y)
            scheduler.step()
    """
    if not callable(fn):
        raise TypeError(f"cgraph: make_graphed_step takes a function, got {type(fn).__name__}.")
    if not isinstance(sample_args, tuple):
        raise TypeError("cgraph: sample_args must be a tuple (write (x,) for one tensor).")
    if not isinstance(num_warmup_iters, int) or num_warmup_iters < 1:
        raise ValueError(
            f"cgraph: num_warmup_iters must be at least 1 for a step, got {num_warmup_iters!r}: "
            "the first eager call finds the optimizers and creates their state, which a "
            "graph cannot do.")
    return GraphedStep(fn, sample_args, sample_kwargs or {}, num_warmup_iters, pool)


# How a step is captured: no warm-up there (its warm-up calls are the
# first real, eager steps), torch's default capture mode, outputs that keep
# their values (Note [Outputs of earlier calls] in csrc/aten_replay.cpp).
_OPTIONS = CaptureOptions(num_warmup_iters=0, allow_unused_input=False, capture_error_mode=0,
                          kept_outputs=0)


class _Static(NamedTuple):
    """The captured call: its static input tensors (pytree leaves of the
    call, constants left as they were) and structure."""

    leaves: list
    spec: Any


class _WarmPool(NamedTuple):
    """The step's own pool while it warms up: Note [A step's warm-up in its
    pool] (csrc/aten_setup.cpp).  ``hold`` is the reference that keeps it,
    and what warm-up left there, until the capture holds the pool itself."""

    device: int
    id: tuple[int, int]
    hold: object

    @classmethod
    def new(cls, device: int) -> "_WarmPool":
        pool = _C.new_pool()
        return cls(device, pool, _C.hold_pool(device, pool))


class _Containers(NamedTuple):
    """An optimizer's containers as the graph captured them: load_state_dict
    replaces param_groups and state, add_param_group grows param_groups, and
    code of one's own may replace a group or its params list.  Compared
    before each call (Note [Capturable optimizers]).  The state's length is
    not: reading ``state[p]`` of a parameter without state (a defaultdict)
    adds an entry, which must not capture again."""

    optimizer: weakref.ref
    param_groups: list
    groups: tuple  # per group: (the group dict, its params list, that list's length)
    state: dict

    @classmethod
    def of(cls, optimizer) -> "_Containers":
        groups = tuple((g, g["params"], len(g["params"])) for g in optimizer.param_groups)
        return cls(weakref.ref(optimizer), optimizer.param_groups, groups, optimizer.state)

    def replaced(self) -> bool:
        """Whether the optimizer is gone (the step now calls another, or
        none) or its containers are not those captured.  On every call: a
        loop, not a generator (about 0.4 us for two groups on the CI
        machine, a generator 0.6)."""
        ref, param_groups, groups, state = self
        optimizer = ref()
        if (optimizer is None or optimizer.param_groups is not param_groups
                or optimizer.state is not state or len(param_groups) != len(groups)):
            return True
        for g, (group, params, n) in zip(param_groups, groups):
            if g is not group or g["params"] is not params or len(params) != n:
                return True
        return False


@dataclasses.dataclass
class _Group:
    """One param group as the graph captured it."""

    group: dict
    lr: torch.Tensor | None  # the device lr the graph reads; None: baked in
    lr_value: float | None  # the float that lr holds
    baked: dict  # the values baked into the graph: compared before each replay
    baked_values: tuple  # baked's values, in its order


# GradScaler's settings that scaler.update() hands torch._amp_update_scale_
# as numbers, baked into the graph (Note [GradScaler with any optimizer]).
_SCALER_FACTORS = ("_growth_factor", "_backoff_factor", "_growth_interval")
_scaler_factors = operator.attrgetter(*_SCALER_FACTORS)

# The calls in a row captured again for a changed hyperparameter at which a
# step warns that it recaptures at every call (Note [Capturable optimizers]).
_STALE_WARNING_AT = 3


class _SyncChanges:
    """A step's calls that found grad sync set otherwise outside: warned of
    once, at the third of a run of them each at most SPAN calls after the
    last (gradient accumulation's cycles; not a rare change now and then)."""

    SPAN = 64
    __slots__ = ("run", "last", "warned")

    def __init__(self) -> None:
        self.run, self.last, self.warned = 0, None, False

    def warns(self, calls: int) -> bool:
        """Counts a change found at the step's `calls`-th call; whether to warn."""
        near = self.last is not None and calls - self.last <= self.SPAN
        self.run, self.last = (self.run + 1 if near else 1), calls
        if self.run < _STALE_WARNING_AT or self.warned:
            return False
        self.warned = True
        return True


class _ScalerFactors(NamedTuple):
    """A GradScaler's growth and backoff settings as the graph captured them
    (set_growth_factor and load_state_dict change them): compared before
    each replay, as a baked hyperparameter is."""

    scaler: weakref.ref
    values: tuple

    @classmethod
    def of(cls, scaler) -> "_ScalerFactors":
        return cls(weakref.ref(scaler), _scaler_factors(scaler))

    @classmethod
    def of_enabled(cls, scalers: list) -> "list[_ScalerFactors]":
        """Those of the enabled `scalers`: a disabled one (GradScaler(enabled=
        False), bf16 or fp32 training) has no settings and passes grads on."""
        return [cls.of(s) for s in scalers if s.is_enabled()]

    def changed(self) -> str | None:
        """The first setting that changed since capture, as state_dict names
        it; None if none did, or the scaler is gone (the step no longer
        calls it)."""
        scaler = self.scaler()
        if scaler is None or _scaler_factors(scaler) == self.values:
            return None
        return next(name.lstrip("_") for name, value in zip(_SCALER_FACTORS, self.values)
                    if getattr(scaler, name) != value)


# Note [The step's hot path]
# Q: What runs on the host when a captured step is called?
# A: The whole step is one graph replay, which costs about 13 us of host
#    time on the lent machines; anything in Python around it is of the same
#    order.  So a call goes from GraphedStep.__call__ (one check that no
#    hyperparameter baked into the graph changed and no optimizer's groups
#    or state were replaced, and a native pointer compare of each
#    parameter's grad before and after: Note [Grads around a graphed step]
#    in cgraph/_step_grads.py) straight to the native
#    graphed callable the step was captured as (csrc/graphed.c): arguments
#    checked in C, copied into the static inputs by memcpy nodes at the head
#    of the graph itself (Note [Argument copies inside the graph] in
#    csrc/aten_graph_nodes.cpp), the graph launched, and the outputs handed
#    out over the graph's memory, copied only if still held when the next
#    replay would overwrite them (Note [Outputs of earlier calls]).  The
#    step is captured by the same native session as make_graphed, with no
#    warm-up (the step's own eager calls were its warm-up) and no backward
#    graph (the step's outputs are detached: its backward is inside), and
#    called under no_grad, so that no output gets a grad_fn.  A call of
#    tensors only (``step(x, y)``) is checked in C without Python; one with
#    constants, keywords or nesting is walked in C beside the samples, or
#    goes through torch's pytree flattening where it is structured unlike
#    them, as any graphed callable's call (Note [Arguments walked in C] in
#    csrc/arguments.c).  Python
#    checks a call itself only when the native call refuses it, to name
#    what differs in the step's terms.


class GraphedStep:
    """A training step replayed as one CUDA graph; see make_graphed_step."""

    def __init__(self, fn, sample_args, sample_kwargs, num_warmup_iters, pool):
        self.fn = fn
        self.num_warmup_iters = num_warmup_iters
        self.pool = _pool_id(pool)
        self.sample = _flatten(sample_args, sample_kwargs)
        self.optimizers: weakref.WeakSet = weakref.WeakSet()
        self.scaled: weakref.WeakSet = weakref.WeakSet()  # stepped by a GradScaler
        self.ddp = DDPInStep()  # the DDP models it calls: Note [DDP inside a graphed step]
        self.graphed: _C.Graphed | None = None  # the captured step: Note [The step's hot path]
        self.static: _Static | None = None
        self.outputs: _Outputs | None = None  # None: the native call returns them as they are
        self.groups: list[_Group] = []
        self.scalers: weakref.WeakSet = weakref.WeakSet()  # the GradScalers it steps through
        # Their settings as captured: Note [GradScaler with any optimizer].
        self.scaler_factors: list[_ScalerFactors] = []
        self.containers: list[_Containers] = []  # Note [Capturable optimizers]
        # Calls in a row captured again for a changed hyperparameter, and
        # whether that was warned of: Note [Capturable optimizers].
        self.stale_in_a_row, self._warned_stale = 0, False
        # Calls that found grad sync set otherwise outside (no_sync(), FSDP's
        # set_requires_gradient_sync): Note [Grad sync set outside a graphed step].
        self.sync_changes = _SyncChanges()
        # Calls in a row stepped eagerly, after a capture, because FSDP held
        # grads of backwards outside: Note [Grads FSDP2 holds, kept after a
        # step's capture] (cgraph/_fsdp.py).
        self.held_in_a_row = 0
        self.grads: StepGrads | None = None  # Note [Grads around a graphed step]
        # What its capture found that code outside can change, checked
        # before each replay: Note [What a graphed step checks before a
        # replay] (cgraph/_step_checks.py).
        self.since: SinceCapture | None = None
        # The FSDP groups of the modules it names: Note [FSDP2's host state
        # around a graphed step] (cgraph/_fsdp.py).
        self.resharded = _fsdp.Resharded(())
        # Its capture made optimizer state (on some rank: captures_again; here:
        # made_at_capture): the next call captures again (Note [What a graphed
        # step checks before a replay], cgraph/_step_checks.py).
        self.captures_again = False
        self.made_at_capture: list[_Made] = []
        self.stats = {"eager": 0, "captures": 0, "replays": 0}
        self._waited = False  # logged that warm-up waits for a scaler's first step
        # The last warm-up call's CallableSpec.rng_warmup: Note [RNG inside a graphed step].
        self.rng_warmup: tuple | None = None
        # Where warm-up steps allocate until the first capture takes it.
        self.warm_pool: _WarmPool | None = None

    def __call__(self, *args, **kwargs):
        graphed = self.graphed
        if graphed is None or graphed.is_reset or self._stale():
            return self._warm_up_or_capture(args, kwargs)
        try:
            out = self._replay(graphed, args, kwargs)  # Note [The step's hot path]
        except (TypeError, ValueError):
            self._check(*_flatten(args, kwargs))  # the step's own words, if they apply
            raise
        self.stats["replays"] += 1
        return out

    def _warm_up_or_capture(self, args: tuple, kwargs: dict):
        """A call that does not replay: a warm-up step, or the call that
        captures (again) and then replays."""
        leaves, spec = _flatten(args, kwargs)
        self._check(leaves, spec)
        self._optimizer_replaced()  # since a reset() or reset_all(): Note [Capturable optimizers]
        if self.graphed is None and self.stats["eager"] < self.num_warmup_iters:
            return self._run_eagerly(args, kwargs)
        if self._fsdp_holds_grads():
            return self._run_eagerly(args, kwargs)
        if not self._capture(leaves, spec):  # dropped before its replay
            return self._run_eagerly(args, kwargs)
        out = self._replay(self.graphed, args, kwargs)
        self.stats["replays"] += 1
        return out

    def _fsdp_holds_grads(self) -> bool:
        """Whether an FSDP group the step's last capture named holds grads of
        backwards outside the step, after a capture (a first capture that
        finds them refuses, naming the fix): then the call steps eagerly,
        adding them in, where a capture would be refused.  Warned once, at
        the third such call in a row: Note [Grads FSDP2 holds, kept after a
        step's capture] (cgraph/_fsdp.py)."""
        held = (_fsdp.holding_grads(self.resharded.groups) if self.stats["captures"]
                else None)
        if held is None:
            self.held_in_a_row = 0
            return False
        self._held_once_more(f"FSDP's {held}")
        return True

    def _held_once_more(self, group: str) -> None:
        """One more call in a row that steps eagerly because `group` ("FSDP's
        'layers.0'") holds grads of backwards outside: the first found
        before a replay (_changed_since_capture), the next ones before a
        capture (_fsdp_holds_grads)."""
        self.held_in_a_row += 1
        if self.held_in_a_row == _STALE_WARNING_AT:
            _log.step_fsdp_holds_every_call(self, group, self.held_in_a_row)

    # -- 1. warm-up: real eager steps, optimizers found ----------------------

    def _run_eagerly(self, args, kwargs):
        step = self
        lrs: dict = {}  # each optimizer's lrs as its step began: _refuse_lrs_moved_inside

        def found(optimizer, args, kwargs):
            step.optimizers.add(optimizer)
            lrs[optimizer] = _lrs(optimizer)

        handle = register_optimizer_step_pre_hook(found)
        scaler_step = torch.amp.GradScaler.step
        # The optimizers a scaler steps in this call: one the step no longer
        # calls (replaced, kept alive elsewhere) must not be waited for.
        step.scaled.clear()

        def noted_scaler_step(scaler, optimizer, *a, **k):
            if scaler.is_enabled():  # a disabled one steps as plain optimizer.step()
                step.scaled.add(optimizer)
            step.scalers.add(scaler)
            return scaler_step(scaler, optimizer, *a, **k)

        torch.amp.GradScaler.step = noted_scaler_step
        try:
            device = _device(args, kwargs)
            with self.ddp.watch(), self._warm_up_as_captured(device):
                out = self._in_its_pool(device, args, kwargs)
        finally:
            torch.amp.GradScaler.step = scaler_step
            handle.remove()
        _refuse_lrs_moved_inside(lrs)
        _refuse_scalers_updated_outside(list(self.scalers))
        self.stats["eager"] += 1
        self.num_warmup_iters = self.ddp.warmup_iters(self)
        if self._unstepped():  # Note [GradScaler with any optimizer]
            self.num_warmup_iters = max(self.num_warmup_iters, self.stats["eager"] + 1)
        # Detached, as replays return them: a loss kept with its grad_fn
        # would keep this step's autograd graph, whose AccumulateGrad nodes
        # (on this stream) the capture would then reuse from its own stream.
        return pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)

    def _in_its_pool(self, device: int | None, args: tuple, kwargs: dict):
        """The step's eager call, on the capture stream, allocating from the
        pool its capture will take (Note [A step's warm-up in its pool] in
        csrc/aten_setup.cpp).  As called where that pool is not the step's
        own (pool= given: graphs may already live there), where the
        allocator cannot route there safely (expandable segments; and an
        allocator other than the native one, refused at the capture after)
        or without CUDA."""
        if device is None or self.pool is not None or not _C.can_call_in_pool():
            return self.fn(*args, **kwargs)
        if self.warm_pool is None or self.warm_pool.device != device:
            self.warm_pool = _WarmPool.new(device)
        with _accumulator_stream_unwarned(first=self.stats["eager"] == 0):
            return _C.call_in_pool(device, self.warm_pool.id, self.ddp.call,
                                   (self.fn, args, kwargs), {})

    @contextlib.contextmanager
    def _warm_up_as_captured(self, step_device: int | None):
        """A warm-up call of the step, under what its capture will change
        (Note [RNG inside a graphed step]): torch.cuda.get_rng_state noted as
        cgraph's own warm-up notes it, into ``self.rng_warmup`` when the call
        returns; autocast's cache and donated buffers off, as while captured
        and buffers assigned anew kept in place, as while captured (Note
        [Patches during capture] items 1, 6 and 8), so compiled code guarded
        on them compiles now, not at capture.  Without CUDA (a test's CPU
        stand-in), nothing is noted."""
        if step_device is None:
            with one_setup_at_a_time(), _autocast_cache_off(), _donated_buffers_off(), \
                    _buffers_kept_in_place(), _schedulers_refused():
                yield
            return
        generator = torch.cuda.default_generators[step_device]
        torch_get = torch.cuda.get_rng_state
        start, offsets = generator.get_offset(), []

        def get_rng_state(device="cuda"):
            if _cuda_index(device) == step_device and not asked_by_the_compiler():
                offsets.append(generator.get_offset() - start)
            return torch_get(device)

        with one_setup_at_a_time(), patched({(torch.cuda, "get_rng_state"): get_rng_state}), \
                _autocast_cache_off(), _donated_buffers_off(), _buffers_kept_in_place(), \
                _schedulers_refused():
            yield
        self.rng_warmup = (tuple(offsets), generator.get_offset() - start)

    def _unstepped(self) -> list:
        """Optimizers a GradScaler has skipped at every warm-up call so far:
        their state does not exist yet (Note [GradScaler with any optimizer])."""
        waiting = [opt for opt in self.scaled if opt not in self.optimizers]
        if waiting and not self._waited:
            self._waited = True
            _log.step_waits_for_a_step(self, waiting)
        return waiting

    def _check(self, leaves: list, spec) -> None:
        """Calls pass what the samples (or the first call) passed: plain
        tensors and constants."""
        for i, x in enumerate(leaves):
            if _dtensor.is_dtensor(x):
                raise ValueError(
                    f"cgraph: argument {i} of the graphed step (in pytree order) is a DTensor; "
                    "a graphed step takes plain tensors (DTensors flow anywhere inside it, "
                    "and it may return one). Pass the local tensor (x.to_local()) and remake "
                    "the DTensor inside the step (DTensor.from_local(local, mesh, "
                    "placements)), or pass the plain batch and let the first parallelized "
                    "layer distribute it (input_layouts).")
        want, want_spec = (self.static.leaves, self.static.spec) if self.static else self.sample
        if self.static is None and not want:  # no samples: the capture's call decides
            want, want_spec = leaves, spec
        if spec != want_spec:
            raise TypeError(f"cgraph: the step was graphed with arguments structured as "
                            f"{want_spec}, got {spec}.")
        for i, (got, w) in enumerate(zip(leaves, want)):
            if isinstance(got, torch.Tensor) and got.requires_grad:
                raise ValueError(
                    f"cgraph: step argument {i} requires grad. A graphed step's arguments are "
                    "data copied into the graph, which computes no grad for them: pass it "
                    "detached (x.detach()), or make it an nn.Parameter the step's optimizer "
                    "steps.")
            if isinstance(w, torch.Tensor):
                if not (isinstance(got, torch.Tensor) and _fits(got, w)):
                    raise ValueError(
                        f"cgraph: step argument {i} is {_describe(got)}, but the step was "
                        f"graphed with {_describe(w)}. A graphed step replays fixed shapes: "
                        "pad to the sample's shape, or graph one step per shape.")
            elif type(got) is not type(w) or got != w:
                raise ValueError(
                    f"cgraph: step argument {i} was graphed as {w!r}, got {_shown(got)}. A "
                    "graphed step replays the constants it was captured with: graph one step "
                    "per value (cgraph.make_graphed_step(functools.partial(fn, flag=True))), "
                    "or pass the value as a CUDA tensor and use it on the device "
                    "(torch.where).")

    # -- 2. capture ----------------------------------------------------------

    def _capture(self, leaves: list, spec) -> bool:
        """Captures the step, called with copies of this call's tensors
        (they become the static inputs), by the native capture session;
        where the ranks capture it together, after they agreed that every
        one did, and on whether any made optimizer state (Note [A capture
        that fails on one rank], cgraph/_ranks.py; Note [What a graphed step
        checks before a replay], cgraph/_step_checks.py).  False where it
        was dropped before its replay (Note [GradScaler with any
        optimizer]): the call steps eagerly."""
        started = time.perf_counter()
        recapture = self.graphed is not None
        took = _Took(roots=roots(self.fn, self.ddp.models()))
        together = self._holds_collectives(leaves, took.roots)  # before anything can fail
        put_back = _as_they_are(list(self.optimizers))
        self._captured(leaves, spec, took)
        try:
            self.captures_again = _ranks.agree(took.failure, "the training step's capture",
                                               together, holds=bool(took.made))
        except BaseException:
            # This rank's graph too, if it has one (another rank failed): a
            # caller going on replays nothing the others do not.
            self._undo(took, put_back)
            self._fsdp_at_rest()
            raise
        if self.captures_again and self._stepped_inside_a_condition():
            # Note [GradScaler with any optimizer]: the state this capture
            # made would be written inside the conditional node, or not.
            self._undo(took, put_back)
            self.captures_again = False
            _log.step_capture_dropped(self, self._stepped_inside_a_condition())
            self._warm_up_again(None)
            self._wait_for_unskipped_steps()
            return False
        self.outputs, self.grads = took.returned[0], took.grads[0]
        try:  # every record, or none: a half-built step would replay unchecked
            took.sync.captured()
            took.other_grads.captured(self.grads.cleared)
            self.since = SinceCapture(took.grad_mode, took.autocast,
                                      Marks(self.grads.params, took.roots, self.grads.label),
                                      took.modes, took.sync, took.other_grads, self.grads)
        except BaseException:
            self._undo(took, put_back)
            raise
        self.made_at_capture = took.made
        if self.captures_again:
            _log.step_state_made_at_capture(self, [m.optimizer for m in self.made_at_capture])
        self.containers = [_Containers.of(opt) for opt in list(self.optimizers)]
        _live.add(self.graphed)
        _live_steps.add(self)
        self.stats["captures"] += 1
        _log.step_captured(self, recapture, time.perf_counter() - started)
        return True

    def _undo(self, took: _Took, put_back: Callable[[], None]) -> None:
        """After a capture that failed (here, or on another rank) or was
        dropped: the graph freed, and the optimizers and every grad the
        capture gave as the call found them (`put_back`, _as_they_are;
        OtherGrads.put_back), without the optimizer state it made.  A
        capture runs no kernel: none of that memory was written, so a
        caller going on eagerly steps as if the call had not been made."""
        try:
            _forget(took.made)
            put_back()
            if took.other_grads is not None:
                took.other_grads.put_back()
        finally:
            # The capture's grads and outputs, memory of the graph's pool, go
            # before the graph releases it (held, the traceback keeps `took`).
            took.grads.clear()
            took.returned.clear()
            took.other_grads = None
            self.grads, self.outputs = None, None
            self._free()

    def _fsdp_at_rest(self) -> None:
        """After a failed capture: Note [A capture that fails inside FSDP2's
        pass] (cgraph/_fsdp.py).  A failure here is warned of, not raised
        over the capture's own error."""
        try:
            self.resharded.after_failed_capture()
        except Exception as exc:  # noqa: BLE001
            warnings.warn(f"cgraph: could not put FSDP's state back to rest after the failed "
                          f"capture ({exc!r}): the next eager FSDP step may read parameters "
                          "the capture never wrote, or hang. Restart the training loop from "
                          "a checkpoint, and report the error.", stacklevel=3)

    def _holds_collectives(self, leaves: list, named_modules: list) -> bool:
        """Whether the ranks capture this step together, and so agree on its
        capture: decided from what every rank running it holds alike."""
        params = [p for opt in list(self.optimizers) for g in opt.param_groups
                  for p in g["params"]]
        # A step without optimizers (a forward and backward over FSDP2 or
        # TP modules, `named_modules`) holds their collectives too.
        named = [p for m in named_modules for p in m.parameters()]
        return _ranks.may_hold_collectives(self.ddp.communicating(),
                                           [*params, *named, *leaves])

    def _captured(self, leaves: list, spec, took: _Took) -> None:
        """Refusals, static inputs, and the capture into ``self.graphed``,
        noting in `took` what it gave, or the error that stopped it (every
        rank hears of it before it is raised)."""
        warm = None
        try:
            took.modes = Modes.under(took.roots)  # as the call found them
            took.grad_mode, took.autocast = grad_mode(), autocast_around()
            self.resharded = _fsdp.Resharded(took.roots)
            _fsdp.refuse_offloaded(self.resharded.groups)
            self.resharded()  # Note [FSDP2's host state around a graphed step]
            took.sync = GradSync(self.resharded.groups, self.ddp.training(), self.ddp.models())
            state = _state_keys(self.optimizers)
            self._refuse_what_no_graph_can_step(took.sync)
            self._free()
            static = [_static_copy(x) if isinstance(x, torch.Tensor) else _constant(i, x)
                      for i, x in enumerate(leaves)]
            self.static = _Static(static, spec)
            # Held until the capture holds the pool itself: Note [A step's
            # warm-up in its pool].
            warm, self.warm_pool = self.warm_pool, None
            pool = self.pool if warm is None else warm.id
            self.groups = [self._capturable(opt, g) for opt in list(self.optimizers)
                           for g in opt.param_groups]
            self.scaler_factors = _ScalerFactors.of_enabled(list(self.scalers))
            args, kwargs = pytree.tree_unflatten(static, spec)
            drafted = draft(Target.of(0, self._captured_call(took.returned)), args, kwargs,
                            set())
            drafted.fields["rng_warmup"] = self.rng_warmup  # Note [RNG inside a graphed step]
            trained = [p for opt in list(self.optimizers) for g in opt.param_groups
                       for p in g["params"]]
            took.other_grads = OtherGrads(took.roots, set(map(id, trained)))
            shared = SharedPool.before_capture(self.pool, self.graphed,
                                               trained + list(took.other_grads.params))
            # The SGD check of device_resident_steps runs kernels: first, eagerly.
            try:
                with _optim.device_resident_steps(list(self.optimizers)), self._device_lrs(), \
                        _scaler_steps_on_the_device(), \
                        StepGrads.noted(list(self.optimizers), took.grads,
                                        took.other_grads.forget), _schedulers_refused(), \
                        took.other_grads.noting():
                    (self.graphed,) = graph([drafted], pool, _OPTIONS, step=True)
            finally:  # made by a failed capture too: forgotten then
                took.made = _state_made(self.optimizers, state)
            what = None if shared is None else shared.first_new_in_it(_kept_by(took))
            if what is not None:  # Note [A step captured into a shared pool]
                raise shared.refusal(what)
        except _C.CaptureError as exc:
            took.failure = exc
            if exc.kind == _RNG_REGIONS:
                took.failure = _rng_state_refused(exc)
                took.failure.__cause__ = exc.__cause__
        except BaseException as exc:  # noqa: BLE001 -- every rank hears of it, then it is raised
            took.failure = exc  # KeyboardInterrupt too: the others would wait in agree
        finally:
            if took.failure is not None:  # before the warm-up pool can go, below
                _forget(took.made)
            # The graph holds its pool now, if it was captured; else the
            # pool goes back, not kept by the error's traceback (this frame).
            warm = None  # noqa: F841

    def _refuse_what_no_graph_can_step(self, sync: GradSync) -> None:
        """Raises, naming the fix, before the capture copies its inputs and
        before the optimizers change (a CPU caller goes on as before, once
        the ranks agreed where they capture together).  A
        refused step keeps nothing for a capture: its warm-up pool goes back
        (what the warm-up calls cached there would otherwise stay reserved
        for as long as the step lives: a caller going on eagerly, as
        Lightning's scope="step" falls back), and so does a recapture's old
        graph (a hyperparameter it baked in changed; set back, it would
        replay a step now refused)."""
        try:
            for opt in list(self.optimizers):
                _check_capturable(opt, opt in self.scaled)
            self.ddp.before_capture()
            sync.refuse_unreduced()
            _require_cuda()
            for opt in list(self.optimizers):
                _check_on_the_gpu(opt)
        except BaseException:
            self.warm_pool = None
            self._free()  # a recapture's old graph, whose step was just refused
            raise

    def _captured_call(self, returned: list) -> Callable[..., Any]:
        """What the capture calls: the step (DDP's accumulators moved as
        Note [DDP inside a graphed step] says), its outputs detached and
        reduced to tensors (_Outputs), with the step's signature (errors name
        its parameters).  Appends the outputs' record to ``returned``."""
        fn, ddp = self.fn, self.ddp

        @functools.wraps(fn)
        def training_step(*args, **kwargs):
            record, tensors = _Outputs.split(ddp.call(fn, args, kwargs))
            returned.append(record)
            return tensors

        return training_step

    def _capturable(self, optimizer, group: dict) -> _Group:
        """Note [Capturable optimizers], for one param group."""
        if "capturable" in group and not group["capturable"]:
            _make_capturable(optimizer, group)
        if not group["params"]:  # steps nothing: no lr to read, nothing baked
            return _Group(group, None, None, {}, ())
        if "capturable" in group or isinstance(optimizer, _DEVICE_RESIDENT):
            for p in group["params"]:
                _state_to_device(optimizer.state.get(p, {}), p.device)
        read = _lr_read(optimizer, group)
        lr = _device_lr(optimizer, group, read)
        unread = lr is not None or read == "state"
        baked = {k: v for k, v in group.items() if k != "params" and not (k == "lr" and unread)}
        return _Group(group, lr, float(group["lr"]) if lr is not None else None, baked,
                      tuple(baked.values()))

    @contextlib.contextmanager
    def _device_lrs(self):
        """While captured, a group whose optimizer reads lr from the device
        holds the tensor the graph will read; its own lr comes back after,
        the same object (a scheduler fills a tensor lr in place)."""
        swapped = [(g, g.group["lr"]) for g in self.groups if g.lr is not None]
        for g, _ in swapped:
            g.group["lr"] = g.lr
        try:
            yield
        finally:
            # A group holding another group's device lr is fine: ZeRO's step
            # copies its own groups' values into its inner optimizer's.
            device_lrs = {id(g.lr) for g, _ in swapped}
            replaced = [g for g, _ in swapped if id(g.group["lr"]) not in device_lrs]
            for g, own in swapped:
                g.group["lr"] = own
        if replaced:  # the captured step read the lr it set, baked in
            raise RuntimeError(
                "cgraph: the graphed step sets the learning rate of a param group itself "
                "(group['lr'] = ...): the graph would step with the value of its capture at "
                f"every replay. Set it outside the step, before the call. {_SCHEDULER_FIX}")

    # -- 3. replay: the native call (Note [The step's hot path]) ---------------

    def _stale(self) -> bool:
        """Whether a value baked into the graph changed (an optimizer's
        hyperparameter, a GradScaler's settings) or an optimizer's groups or
        state were replaced (then the step is captured again), after
        refreshing the device lrs.  Counts the calls in a row it found a
        changed value (_recaptures); a replay starts them again."""
        if self.captures_again:  # the capture made optimizer state: replayed once
            self.captures_again = False
            # A change since counts as ever: an eager step first, then the capture.
            if not self._changed_since_capture():
                self._free()
            return True
        if self._optimizer_replaced() or self._changed_since_capture():
            return True
        for g in self.groups:
            group = g.group
            # float(): a CPU tensor lr (Note [Capturable optimizers]) is read without a sync.
            if g.lr is not None and float(group["lr"]) != g.lr_value:
                g.lr_value = float(group["lr"])
                g.lr.fill_(g.lr_value)  # one fill kernel, no sync
            if tuple(map(group.get, g.baked)) != g.baked_values:
                key = next(k for k, v in g.baked.items() if group.get(k) != v)
                return self._recaptures("optimizer", key)
        for factors in self.scaler_factors:
            key = factors.changed()
            if key is not None:
                return self._recaptures("GradScaler", key)
        self.stale_in_a_row = 0
        return False

    def _recaptures(self, owner: str, key: str) -> bool:
        """A value baked into the graph changed (the `owner`'s `key`): logged,
        and the step is captured again.  A change before every call makes
        every call a capture: warned once per step, at the third in a row."""
        _log.step_stale(self, owner, key)
        self._changed_in_a_row(owner, key)
        return True

    def _changed_in_a_row(self, owner: str, key: str) -> None:
        """Counts a call that found the `owner`'s `key` changed since capture;
        warns once per step at the third such call in a row."""
        self.stale_in_a_row += 1
        if self.stale_in_a_row == _STALE_WARNING_AT and not self._warned_stale:
            self._warned_stale = True
            _log.step_stale_every_call(self, owner, key, self.stale_in_a_row)

    def _optimizer_replaced(self) -> bool:
        """Whether an optimizer's groups or state were replaced or grown since
        capture, or it is gone; if so, warmed up again (_warm_up_again)."""
        for held in self.containers:
            if held.replaced():
                optimizer = held.optimizer()
                _log.step_optimizer_replaced(self, optimizer)
                self._warm_up_again(optimizer)
                return True
        return False

    def _changed_since_capture(self) -> bool:
        """Whether what the capture found changed since (SinceCapture: the
        grad mode or CUDA autocast around the call; a tensor it reads moved,
        was replaced, frozen or unfrozen; a module's mode; grad sync set
        outside, or grads FSDP holds from backwards outside; a grad set or
        cleared outside); if so, logged, and warmed up again: Note [What a
        graphed step checks before a replay] (cgraph/_step_checks.py)."""
        change = self.since.first_changed() if self.since is not None else None
        if change is None:
            return False
        _log.step_params_changed(self, change.what, change.how)
        self._changed_in_a_row("step", change.key)
        if change.key == "held grads":
            self._held_once_more(change.what)
        if change.key == "grad sync" and self.sync_changes.warns(
                self.stats["eager"] + self.stats["replays"]):
            _log.step_sync_flips(self, change.what, _STALE_WARNING_AT, _SyncChanges.SPAN)
        self._warm_up_again(None)
        if change.waits:
            self._wait_for_unskipped_steps()
        return True

    def _stepped_inside_a_condition(self) -> list:
        """The optimizers a GradScaler steps inside a conditional node (not
        fused: Note [GradScaler with any optimizer]), alike on every rank."""
        return [opt for opt in list(self.scaled)
                if not getattr(opt, "_step_supports_amp_scaling", False)]

    def _wait_for_unskipped_steps(self) -> None:
        """Each optimizer stepped inside a conditional node counts as not
        found until a step the scaler does not skip creates the state of
        parameters trained since: Note [GradScaler with any optimizer]."""
        for opt in self._stepped_inside_a_condition():
            self.optimizers.discard(opt)

    def _warm_up_again(self, optimizer) -> None:
        """What the graph steps is not what the optimizers step now: an
        optimizer's containers were replaced or grown, or it is gone
        (`optimizer` it, or None), or a parameter or a module's mode
        changed (_changed_since_capture).  The graph
        is freed, and the next call is an eager step, which creates the state
        of parameters added or unfrozen since (created inside a capture, it
        would be zeroed again at every replay), before the call after it
        captures.  An optimizer given counts as not found until it steps
        again, so a GradScaler skipping that step prolongs the warm-up (Note
        [GradScaler with any optimizer])."""
        self._free()
        self.containers = []
        if optimizer is not None:
            self.optimizers.discard(optimizer)
        self.num_warmup_iters = self.stats["eager"] + 1

    def _replay(self, graphed: _C.Graphed, args: tuple, kwargs: dict):
        """The native call, without grad: an argument that requires grad
        must not give the outputs a grad_fn (the step's backward is inside
        the graph); the parameters' grads around it as Note [Grads around a
        graphed step] says."""
        self.resharded()  # Note [FSDP2's host state around a graphed step] (_fsdp.py)
        self.grads.bring_in()
        with torch.no_grad():
            out = graphed(*args, **kwargs)
        self.grads.leave()
        self.since.other_grads.leave()
        self.since.sync.leave()
        return out if self.outputs is None else self.outputs.rebuild(out)

    # -- 4. reset --------------------------------------------------------------

    def reset(self) -> None:
        """Free the graph, its static tensors and its pool memory.  The next
        call captures again."""
        if self.graphed is not None:
            _log.step_reset(self)
        self._free()  # keeps self.containers: a change before the next call is still seen

    def _free(self) -> None:
        try:
            _out_of_the_pool(self.made_at_capture)  # before that pool goes
        finally:  # the graph freed even where a copy ran out of memory
            self.made_at_capture = []
            if self.graphed is not None:
                self.graphed.reset()
            self.graphed, self.static, self.outputs, self.groups = None, None, None, []
            self.since = None
            self.grads, self.scaler_factors = None, []

    def __repr__(self) -> str:
        name = getattr(self.fn, "__qualname__", type(self.fn).__name__)
        state = ("captured" if self.graphed is not None and not self.graphed.is_reset
                 else "not captured yet")
        return (f"GraphedStep({name}, {state}, eager={self.stats['eager']}, "
                f"captures={self.stats['captures']}, replays={self.stats['replays']})")


def _state_keys(optimizers) -> dict:
    """The state keys of every parameter of `optimizers` that has state, by id."""
    return {id(p): set(state) for opt in list(optimizers) for p, state in opt.state.items()}


class _Made(NamedTuple):
    """Optimizer state a capture made for one parameter: the keys of its
    `state` dict that were not there before."""

    optimizer: Any
    param: Any
    state: dict
    keys: tuple


def _state_made(optimizers, before: dict) -> list[_Made]:
    """The state `optimizers` have now under keys not in `before`
    (_state_keys): state a capture made."""
    return [_Made(opt, p, state, tuple(set(state) - before.get(id(p), set())))
            for opt in list(optimizers) for p, state in opt.state.items()
            if not set(state) <= before.get(id(p), set())]


def _forget(made: list[_Made]) -> None:
    """State a capture made, dropped after that capture failed (here or on
    another rank): its tensors were never written (a capture runs no
    kernel), so an eager step after it makes that state again, as it would
    have without the capture."""
    for m in made:
        for key in m.keys:
            m.state.pop(key, None)
        if not m.state:
            m.optimizer.state.pop(m.param, None)


def _out_of_the_pool(made: list[_Made]) -> None:
    """State a capture made, moved out of its graph's pool into memory of its
    own, with the values the replay gave it, before that graph is freed:
    it lives as long as the optimizer, and a pool released while blocks of
    it are still allocated is unsafe under expandable segments (Note [A
    step's warm-up in its pool], csrc/aten_setup.cpp) and keeps its
    segments reserved under the default allocator."""
    for m in made:
        for key in m.keys:
            value = m.state.get(key)
            if isinstance(value, torch.Tensor):
                m.state[key] = value.clone()


def _kept_by(took: "_Took") -> list:
    """What a capture left that Python alone holds, as (what, tensor)
    pairs: the grads of the parameters it trains or backpropagates into,
    and the optimizer state it made."""
    grads = took.grads[0]
    # `after`: the grads replays hand out (a held parameter has its own back
    # until the replay).
    kept = [(f"the grad of {grads.label(p)}", g) for p, g in zip(grads.params, grads.after)]
    kept += [(f"the grad of {w.label}", w.param.grad) for w in took.other_grads.watched]
    kept += [(f"{type(m.optimizer).__name__}'s state {key!r}", m.state.get(key))
             for m in took.made for key in m.keys]
    return kept


@dataclasses.dataclass
class _Took:
    """What one capture of a step gave on this rank, noted as it goes
    (GraphedStep._captured), or the error that stopped it."""

    returned: list = dataclasses.field(default_factory=list)  # _captured_call's _Outputs
    grads: list = dataclasses.field(default_factory=list)  # StepGrads.noted's record
    modes: Modes | None = None  # the modes of the modules it names, as the call found them
    grad_mode: tuple = (True, False)  # _step_checks.grad_mode() around the call
    autocast: torch.dtype | None = None  # _step_checks.autocast_around() around the call
    roots: list = dataclasses.field(default_factory=list)  # the modules it names
    sync: GradSync | None = None  # the grad sync of what it names, as the capture began
    other_grads: OtherGrads | None = None  # as the capture began
    made: list[_Made] = dataclasses.field(default_factory=list)  # optimizer state it made
    failure: BaseException | None = None


class _Outputs:
    """What a step returned, when it is more than tensors (None, a number
    beside the loss): the native call hands out tensors only, so the
    structure and the other leaves are kept here and the tensors put back
    after each replay.  A step returning only tensors (the loss, a tuple or
    dict of them) needs no record: the native call rebuilds those itself."""

    __slots__ = ("spec", "leaves")
    _TENSOR = object()  # where a tensor goes among the leaves

    def __init__(self, spec, leaves: list):
        self.spec, self.leaves = spec, leaves

    @classmethod
    def split(cls, out) -> tuple["_Outputs | None", Any]:
        """The record (None when not needed) and what the capture returns:
        the detached tensors, as returned or as a tuple.  A DTensor (the
        loss under loss_parallel()) crosses as its local tensor, remade
        around it after each replay (_DTensorOut)."""
        if isinstance(out, torch.Tensor) and not _dtensor.is_dtensor(out):
            return None, out.detach()
        leaves, spec = pytree.tree_flatten(out)
        if leaves and all(_plain_tensor(x) for x in leaves):
            return None, pytree.tree_map_only(torch.Tensor, torch.Tensor.detach, out)
        for x in leaves:
            if not isinstance(x, torch.Tensor):
                _refuse_opaque(x)
        tensors = tuple(x.detach().to_local() if _dtensor.is_dtensor(x) else x.detach()
                        for x in leaves if isinstance(x, torch.Tensor))
        kept = [_DTensorOut.of(x) if _dtensor.is_dtensor(x) else
                cls._TENSOR if isinstance(x, torch.Tensor) else x for x in leaves]
        return cls(spec, kept), tensors

    def rebuild(self, tensors: tuple):
        given = iter(tensors)
        return pytree.tree_unflatten(
            [next(given) if x is self._TENSOR else
             x.around(next(given)) if isinstance(x, _DTensorOut) else x for x in self.leaves],
            self.spec)


def _plain_tensor(x) -> bool:
    return isinstance(x, torch.Tensor) and not _dtensor.is_dtensor(x)


class _DTensorOut(NamedTuple):
    """Where a step returned a DTensor: how to remake it around its local
    tensor, which the native call hands out."""

    mesh: Any
    placements: tuple
    shape: torch.Size
    stride: tuple

    @classmethod
    def of(cls, t) -> "_DTensorOut":
        return cls(t.device_mesh, tuple(t.placements), t.shape, t.stride())

    def around(self, local: torch.Tensor):
        return _dtensor.DTensor.from_local(local, self.mesh, self.placements, run_check=False,
                                           shape=self.shape, stride=self.stride)


def _refuse_opaque(leaf) -> None:
    """A returned object holding tensors that torch's pytree does not see
    into (a plain dataclass, an object with tensor attributes) is a leaf
    kept as captured: every replay would return the capture's object, its
    tensors the capture's, rewritten in place by each replay (a list of
    losses would hold one tensor, its value the last step's)."""
    if isinstance(leaf, type):
        return
    if dataclasses.is_dataclass(leaf):
        values = [getattr(leaf, f.name, None) for f in dataclasses.fields(leaf)]
    else:
        values = list(getattr(leaf, "__dict__", {}).values())
    if any(isinstance(v, torch.Tensor) for v in pytree.tree_leaves(values)):
        how = ("torch.utils._pytree.register_dataclass(cls)" if dataclasses.is_dataclass(leaf)
               else "torch.utils._pytree.register_pytree_node")
        raise TypeError(
            f"cgraph: the graphed step returned a {type(leaf).__name__} holding tensors, "
            "which torch's pytree does not see into: every replay would return the "
            "capture's object, with the capture's tensors. Register its class as a pytree "
            f"node ({how}), or return the tensors in a tuple or dict.")


def _flatten(args: tuple, kwargs: dict):
    """A call's pytree leaves and structure, keywords in sorted order (as the
    native call flattens them)."""
    return pytree.tree_flatten((args, dict(sorted(kwargs.items()))))


def _fits(got: torch.Tensor, want: torch.Tensor) -> bool:
    """The native call's rule: same shape and device, and the same dtype or
    another floating one (cast by the copy into the static input)."""
    return got.shape == want.shape and got.device == want.device and (
        got.dtype == want.dtype or (got.dtype.is_floating_point and
                                    want.dtype.is_floating_point))


# Optimizers with no capturable form that cgraph steps on the device itself
# while the step is captured: Note [Optimizers without a capturable form].
_DEVICE_RESIDENT = (torch.optim.Adagrad,)


# Capturable optimizers whose single-tensor step reads a tensor lr back to the
# host (``alpha=-lr``), a sync a capture cannot hold.
_SINGLE_TENSOR_LR_ON_HOST = (torch.optim.Adadelta, torch.optim.RMSprop)


def _lr_read(optimizer, group: dict) -> str:
    """Where a param group's step reads its lr (Note [Capturable optimizers]):

    - "device": from a tensor on its parameters' device, every kernel (fused
      steps; capturable foreach and single-tensor ones): the graph reads it
      at each replay, refreshed before (_device_lr);
    - "host": as a number, baked into the graph, a change recapturing: a
      step neither fused nor capturable, and the single-tensor step of
      _SINGLE_TENSOR_LR_ON_HOST;
    - "state": only where it makes a parameter's state (Rprop's
      ``torch.full_like(grad, lr)``, on the host in any form), never in its
      update: neither swapped for a device tensor (a capture that makes
      state may read it) nor compared before a replay (a change after the
      state exists changes nothing, in eager too)."""
    if isinstance(optimizer, torch.optim.Rprop):
        return "state"
    if group.get("fused") or (group.get("capturable")
                              and not _reads_lr_on_the_host(optimizer, group)):
        return "device"
    return "host"


def _reads_lr_on_the_host(optimizer, group: dict) -> bool:
    if not isinstance(optimizer, _SINGLE_TENSOR_LR_ON_HOST):
        return False
    foreach, differentiable = group.get("foreach"), bool(group.get("differentiable"))
    if foreach is None:  # torch's own choice, as its step makes it
        from torch.optim.optimizer import _default_to_fused_or_foreach
        foreach = _default_to_fused_or_foreach(group["params"], differentiable, False)[1]
    return not foreach or differentiable


def _device_lr(optimizer, group: dict, read: str) -> torch.Tensor | None:
    """The device tensor the graph reads lr from, while captured, for a
    group whose step reads it there (`read`, _lr_read) and whose lr is a
    number or a tensor off its parameters' device (a CPU tensor, which
    fused kernels read on the host); None where the graph bakes lr in or
    reads the group's own tensor in place."""
    lr, device = group["lr"], group["params"][0].device
    if read == "host" and isinstance(lr, torch.Tensor):
        raise ValueError(
            f"cgraph: this {type(optimizer).__name__} has a tensor lr, but its step reads "
            "lr as a number, which the graph would keep at its value at capture (an LR "
            "scheduler changes a tensor lr in place, unseen). Pass lr as a float: a "
            "change then recaptures the step (logged).")
    if read != "device" or (isinstance(lr, torch.Tensor) and lr.device == device):
        return None
    # float32, as torch's own tensor lr for fused kernels, whatever the
    # default dtype (fused kernels read it as a float).
    return torch.tensor(float(lr), dtype=torch.float32, device=device)


def _lrs(optimizer) -> list[float]:
    return [float(group["lr"]) for group in optimizer.param_groups]


def _refuse_lrs_moved_inside(lrs: dict) -> None:
    """Raises if an optimizer's lr changed inside a warm-up call after its
    step began (`lrs`: each one's as it began): a scheduler stepped inside
    the step.  A capture would bake that change into the graph (a scheduler
    fills the device lr the graph reads, with the capture's value), and
    every replay would step with the lr of the capture's call."""
    for optimizer, before in lrs.items():
        now = _lrs(optimizer)[:len(before)]  # a group added inside: the others compared
        if now != before:
            raise RuntimeError(
                f"cgraph: the learning rate of {type(optimizer).__name__} changed inside the "
                f"graphed step after its step (from {before} to {now}): a scheduler.step() "
                f"inside the step? Every replay would step with the lr its capture saw. "
                f"{_SCHEDULER_FIX}")


# How to step a scheduler beside a graphed step: the end of both refusals.
_SCHEDULER_FIX = (
    "Call scheduler.step() after the graphed step (loss = step(x, y); scheduler.step()): "
    "cgraph reads each group's lr before every replay (Note [Capturable optimizers] in "
    "cgraph/_step.py).")
_SCHEDULER_INSIDE = (
    "cgraph: scheduler.step() was called inside the graphed step: a replay runs no Python, "
    "so the scheduler would step once, at capture, and every replay would step with that "
    f"lr. {_SCHEDULER_FIX}")


@contextlib.contextmanager
def _schedulers_refused():
    """While the step warms up or is captured, on this thread, every LR
    scheduler's step() raises, naming the fix (Note [What a graphed step
    checks before a replay] in cgraph/_step_checks.py); other threads' step as before."""
    me = threading.get_ident()
    base = torch.optim.lr_scheduler.LRScheduler
    made_now: set = set()  # ids of schedulers inside their __init__'s own step

    def refusing(step):
        @functools.wraps(step)
        def refused(scheduler, *args, **kwargs):
            if threading.get_ident() == me and id(scheduler) not in made_now:
                raise RuntimeError(_SCHEDULER_INSIDE)
            return step(scheduler, *args, **kwargs)
        return refused

    def initial_step(scheduler, *args, **kwargs):
        # A scheduler made lazily in the step's first (eager) call sets its
        # first lr in its __init__: let that step through.
        made_now.add(id(scheduler))
        try:
            return own_initial_step(scheduler, *args, **kwargs)
        finally:
            made_now.discard(id(scheduler))

    classes = [base, torch.optim.lr_scheduler.ReduceLROnPlateau]
    for cls in classes:  # a user's subclasses too, as they are now
        classes.extend(c for c in cls.__subclasses__() if c not in classes)
    patches = {(cls, "step"): refusing(vars(cls)["step"]) for cls in classes
               if "step" in vars(cls)}
    own_initial_step = vars(base).get("_initial_step")
    if own_initial_step is not None:
        patches[(base, "_initial_step")] = initial_step
    with patched(patches):
        yield


def _refuse_scalers_updated_outside(scalers: list) -> None:
    """Raises if a GradScaler stepped inside a warm-up call still holds that
    step's inf checks when the call returns: its update() runs outside the
    step.  A replay runs no Python, so the scaler would hold no checks at
    the update after it (torch raises "No inf checks were recorded"), and
    the scale would never follow the replayed steps' infs."""
    for scaler in scalers:
        if scaler.is_enabled() and scaler._per_optimizer_states:
            raise RuntimeError(
                "cgraph: a GradScaler steps inside the graphed step, but its update() runs "
                "outside it: a replay runs no Python, so the scaler would not see the "
                "replayed steps' inf checks. Call scaler.update() inside the step, right "
                "after scaler.step(optimizer), as torch's AMP recipe does.")


def _as_they_are(optimizers: list) -> Callable[[], None]:
    """What _capturable changes in `optimizers` (capturable flags, one-element
    state moved to the device), and the grads of their parameters (a capture
    gives a parameter without one a grad of the pool that no kernel wrote),
    as a function that puts it back: after a capture that failed or was
    dropped, the optimizers step eagerly as they did before.  The grads are
    held weakly: one the step dropped while captured is None again."""
    flags = [(g, g["capturable"]) for opt in optimizers for g in opt.param_groups
             if "capturable" in g]
    scalars = [(state, key, value) for opt in optimizers for state in opt.state.values()
               for key, value in state.items()
               if isinstance(value, torch.Tensor) and value.dim() == 0]
    grads = [(p, None if p.grad is None else weakref.ref(p.grad))
             for opt in optimizers for g in opt.param_groups for p in g["params"]]

    def put_back() -> None:
        for group, flag in flags:
            group["capturable"] = flag
        for state, key, value in scalars:
            state[key] = value
        for param, held in grads:
            grad = held() if held is not None else None
            if param.grad is not grad:
                param.grad = grad

    return put_back


# The param groups cgraph made capturable, by optimizer (weakly), which its
# state_dict() saves as they were configured: Note [Capturable optimizers].
_made_capturable: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _make_capturable(optimizer, group: dict) -> None:
    made = _made_capturable.get(optimizer)
    if made is None:
        made = _made_capturable[optimizer] = []
        optimizer.register_state_dict_post_hook(_saved_as_configured)
    # Groups replaced since (load_state_dict) are let go.
    made[:] = [g for g in made if any(g is h for h in optimizer.param_groups)]
    if not any(g is group for g in made):
        made.append(group)
    group["capturable"] = True


def _saved_as_configured(optimizer, state_dict: dict) -> dict:
    """An optimizer's state_dict post-hook: each group cgraph made capturable
    saved with capturable off, as its user built it, and (not fused) its
    step counts on the CPU, where torch keeps them then, so that a
    checkpoint loads where eager's does (a CPU copy of the model), and
    resumes as eager's (a step count on the GPU costs a non-capturable step
    a sync per parameter).  The saved state is copied, not the live one."""
    made = _made_capturable.get(optimizer, ())
    state = state_dict["state"]
    for group, saved in zip(optimizer.param_groups, state_dict["param_groups"]):
        if not any(g is group for g in made):
            continue
        saved["capturable"] = False
        if group.get("fused"):
            continue
        for index in saved["params"]:
            step = state.get(index, {}).get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                state[index] = {**state[index], "step": step.cpu()}
    return state_dict


def _state_to_device(state: dict, device: torch.device) -> None:
    """An optimizer's one-element state (step counts; NAdam's mu_product)
    moved to its parameter's device, as capturable=True keeps it."""
    for key, value in state.items():
        if isinstance(value, torch.Tensor) and value.dim() == 0 and value.device != device:
            state[key] = value.to(device, torch.float32 if key == "step" else value.dtype)


def _check_capturable(optimizer, scaled: bool) -> None:
    """Refuses, naming the fix, an optimizer a graph cannot step: one with
    no capturable form, or one a GradScaler steps through the host."""
    name = type(optimizer).__name__
    groups = optimizer.param_groups
    if isinstance(optimizer, torch.optim.LBFGS):
        raise ValueError(
            "cgraph: torch.optim.LBFGS evaluates its closure several times per step and "
            "decides on the host when to stop (line search, tolerances), which a graph cannot "
            "replay. Step it outside the graphed step, or graph the model with "
            "cgraph.make_graphed and keep LBFGS eager.")
    stepped_by_cgraph = (isinstance(optimizer, _DEVICE_RESIDENT)  # Note [Optimizers
                         and not any(g.get("fused") for g in groups))  # without a capturable form]
    if not (stepped_by_cgraph or isinstance(optimizer, torch.optim.SGD) or
            all("capturable" in g or g.get("fused") for g in groups)):
        raise ValueError(
            f"cgraph: {type(optimizer).__module__}.{name} has no capturable form (no "
            "capturable= or fused= option), so its step cannot be part of a graphed training "
            "step. Step it outside the graphed step, or use an optimizer that has one (Adam, "
            "AdamW, SGD, RMSprop, ...; Adagrad cgraph steps on the device itself).")
    if (scaled and not getattr(optimizer, "_step_supports_amp_scaling", False)
            and not _C.conditional_nodes()):
        fused = ("Build it with "
                 f"{name}(..., fused=True): the scaler then hands it the scale and found_inf "
                 "on the device" if isinstance(optimizer, _FUSED_ON_CUDA) else
                 f"{name} has no fused form that takes them on the device: use Adam, AdamW "
                 "or SGD with fused=True, a CUDA 12.4+ build, or step it outside the graphed "
                 "step")
        raise ValueError(
            f"cgraph: a GradScaler steps this {name} by reading found_inf on the host (a "
            "sync a graph cannot hold), and this torch or CUDA (before 12.4) has no "
            f"conditional graph nodes to skip it on the device. {fused}.")


# Optimizers with fused=True CUDA kernels, which take GradScaler's scale and
# found_inf on the device.
_FUSED_ON_CUDA = (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD)


def _check_on_the_gpu(optimizer) -> None:
    """Refuses an optimizer with a parameter off the GPU: a graph replays
    GPU work only, so its step would run once, at capture, and the
    parameters would keep that step's values while the losses went on."""
    for g, group in enumerate(optimizer.param_groups):
        for i, param in enumerate(group["params"]):
            if param.requires_grad and param.device.type != "cuda":  # frozen: never stepped
                raise ValueError(
                    f"cgraph: parameter {i} of param group {g} of {type(optimizer).__name__} "
                    f"is on {param.device.type}, and a CUDA graph replays GPU work only. Step "
                    "this optimizer outside the graphed step (under FSDP2's CPUOffloadPolicy, "
                    "graph the layers: cgraph.make_graphed(layer) works with CPU offload).")


def _scaler_steps_on_the_device():
    """Note [GradScaler with any optimizer]: while the step is captured,
    GradScaler's host test of found_inf becomes a conditional node around
    the optimizer's step."""
    def maybe_step(scaler, optimizer, optimizer_state, *args, **kwargs):
        found_inf = sum(optimizer_state["found_inf_per_device"].values())
        return _C.call_if((found_inf == 0).reshape(()), optimizer.step, args, kwargs)

    return patched({(torch.amp.GradScaler, "_maybe_opt_step"): maybe_step})


@contextlib.contextmanager
def _accumulator_stream_unwarned(first: bool):
    """In a step's first warm-up call, which runs on the capture stream
    before cgraph has found its DDP models, their grad accumulators (made
    with DDP) run on the caller's stream: autograd orders the two streams,
    and torch would warn of it (once per process, autograd/input_buffer.cpp).
    Later calls move them (DDPInStep.call).  torch's switch where it can be
    read back; else a filter, which spends that one warning."""
    get = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", None)
    if not first:  # DDPInStep.call moves them
        yield
    elif get is not None:
        was = get()
        torch._C._set_warn_on_accumulate_grad_stream_mismatch(False)
        try:
            yield
        finally:
            torch._C._set_warn_on_accumulate_grad_stream_mismatch(was)
    else:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "The AccumulateGrad node's stream does not match",
                                    UserWarning)
            yield


def _device(args: tuple, kwargs: dict) -> int | None:
    """The step's device: its first CUDA tensor argument's, else the current
    one; None without CUDA."""
    for leaf in pytree.tree_leaves((args, kwargs)):
        if isinstance(leaf, torch.Tensor) and leaf.is_cuda:
            return leaf.device.index
    return torch.cuda.current_device() if torch.cuda.is_available() else None


def _rng_state_refused(exc: BaseException) -> BaseException:
    """The step asked for the CUDA RNG state while captured unlike in its
    last warm-up call (Note [RNG inside a graphed step]): the CaptureError
    of kind ``rng_regions``, in a step's terms."""
    error = _C.CaptureError(
        "cgraph: capturing the training step failed: the step asked for the CUDA RNG state "
        "(torch.utils.checkpoint with preserve_rng_state=True does) a different number of "
        "times while captured than in its last warm-up call, so its checkpointed regions "
        "cannot be matched to their random streams. Make every call of the step take the "
        "same path (a region entered on some calls only cannot be graphed), or raise "
        f"num_warmup_iters if the first calls differ. Cause: {exc.__cause__}")
    error.kind = _RNG_REGIONS
    return error


def _static_copy(t: torch.Tensor) -> torch.Tensor:
    return t.detach().clone()


def _constant(i: int, value):
    if not isinstance(value, CONSTANT_TYPES):
        raise TypeError(f"cgraph: step argument {i} is a {type(value).__name__}; a graphed "
                        "step takes tensors and constants (None, int, float, bool, str, ...). "
                        "Bind other values with functools.partial or a closure.")
    return value


def _shown(x) -> str:
    """A value in a message: its repr if plain, else what it is (a tensor's
    repr would fill the message)."""
    return repr(x) if x is None or isinstance(x, (bool, int, float, str)) else _describe(x)


def _describe(x) -> str:
    if isinstance(x, torch.Tensor):
        return f"a {x.dtype} tensor of shape {tuple(x.shape)} on {x.device}"
    return f"a {type(x).__name__}"

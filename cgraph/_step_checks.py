"""What a graphed step's capture found that code outside the step can
change between calls, checked before each replay (SinceCapture): the grad
mode and CUDA autocast around the call, the memory of the tensors it reads,
its modules' modes, their grad sync and the grads FSDP holds, and the grads
no optimizer of it holds.  cgraph/_step.py builds the record at
capture and asks it before each replay; a change makes that call step
eagerly and the next capture again.

Note [What a graphed step checks before a replay]
Q: A step's graph steps the parameters in the memory they had at capture,
   makes grads for those that required grad then, and steps the optimizer
   state the capture found.  What if one of these changes between calls?
A: Before each replay, one native call (``_C.params_are``: a pointer and a
   flag per tensor, about 17 ns each on the CI machine) compares the memory
   (a DTensor's local shard's) and ``requires_grad`` of each parameter of
   the step's optimizers, and of the other parameters and buffers of the
   modules it names (Marks), with the capture's.  A tensor moved to other
   memory (``.to()``, ``p.data = ...``, an EMA copy moved to the CPU for an
   evaluation and back) would leave the graph reading, or writing, memory
   freed since; a parameter frozen since would still be stepped (eager's
   optimizer skips a parameter whose grad is None), one unfrozen never.
   On any change the graph is freed, the call steps eagerly (creating the
   state of a parameter unfrozen), and the next one captures, logged.  A
   capture that made optimizer state (a parameter without grad in every
   warm-up call gets one at the capture: unfrozen between them, or the
   first capture after a ``reset()``) would make it again at every replay:
   Adam's first step at every step, an SGD momentum buffer never
   accumulating.  Its graph is that first step, so it replays for the
   capturing call, as any capture does, and the next call captures again,
   with the state there, copied out of the first graph's pool before that
   pool goes (it lives as long as the optimizer: a released pool whose
   blocks are still allocated is unsafe under expandable segments, Note [A
   step's warm-up in its pool] in csrc/aten_setup.cpp, and keeps its
   segments reserved otherwise); where the ranks capture together, they
   agree on that in the gather that agrees on the capture (Note [A capture
   that fails on one rank], cgraph/_ranks.py), so that none captures while
   the others replay.  A capture that failed, here or on another rank,
   drops the state it made (never written: a capture runs no kernel); the
   optimizer's next step, eager or captured, makes it again.  The modes are
   those the capturing call found (a step that calls ``model.train()``
   itself, run between ``model.eval()`` calls, keeps its graph).  So is
   the grad mode around the call (grad enabled or not; and, for a step
   captured under ``torch.inference_mode()``, that mode): a training step
   called under no_grad() would replay its backward and optimizer step
   where eager raises, and one captured under inference_mode holds
   inference tensors that no call outside it may write.  An lr
   that changes inside the step after its optimizer stepped
   (``scheduler.step()`` in the step) is refused at the first warm-up
   call: the scheduler would fill the graph's device lr once, at capture,
   and every replay would step with that lr.  Modes: Note [The modules a
   graphed step's modes are read from] (cgraph/_modes.py).  Not seen:
   parameters replaced by new objects (``load_state_dict(assign=True)``),
   which the optimizer no longer steps
   in eager mode either, and the memory of a tensor subclass other than
   DTensor (float8 weights).  A change before every call captures at every
   call: warned once, at the third in a row, as a baked value is.

Note [Grads no optimizer of the step holds]
Q: A forward-and-backward step (micro-batches graphed, the optimizer
   stepped outside), or a part of the model trained by an optimizer the
   step does not call: autograd assigns those parameters' grads where they
   were None at capture, and adds into them where they existed; a replay
   repeats what the capture did, at the memory it did it in.  The grads of
   the step's optimizers' parameters follow Note [Grads around a graphed
   step] (cgraph/_step_grads.py).  What of these, which code outside sets
   to None (``zero_grad()``) or replaces between calls?
A: Each one's grad object as the capture began (weakly) and as it ended
   is kept (OtherGrads), frozen parameters left out.  Before a replay, one
   native pointer compare per parameter (``_C.grads_are``): a grad that is
   not the object it was as the capture began (None where it was a tensor,
   a tensor where it was None, another tensor) would be assigned where the
   graph adds or added to where it assigns; that call steps eagerly and the
   next captures again, from that state.  A grad the step clears itself
   (a zero_grad() inside, noted as Note [Grads around a graphed step]
   notes it) is made anew by every replay, so it is not checked; one the
   backward added into (its version moved: each grad is held through the
   capture, but where the step's zero_grad() clears it) is held from then
   on, so that a grad the step replaces after its backward
   (``p.grad = p.grad * mask``) is still checked.  After a
   replay, each parameter gets the grad the capture left, as an eager
   backward would give it.  A grad the capture left as it found it (the
   same object, not added into, not written in place: an evaluation step
   over a model a training step trains) is neither checked nor put back:
   putting the capture's object back would undo the training step's
   grads.  Not seen so: a step that only reads such a grad (its norm, for
   a log) with no backward through it; its replays read the memory of
   the grad its capture found.  So grads cleared to None before each call, or
   never cleared, replay; a pattern that alternates (cleared before every
   other call: micro-batches) captures at every other call, correct, and
   warned of at the third such call in a row.

Note [Grad sync set outside a graphed step]
Q: A step graphed whole replays the collectives its capture issued.  FSDP2's
   set_requires_gradient_sync(False) (or HSDP's set_requires_all_reduce)
   and DDP's no_sync(), called outside the step (micro-batches, each a call
   of a forward-and-backward step), decide whether the backward reduces its
   grads; DDP's last forward decides whether the next broadcasts rank 0's
   buffers.  What if they change between the capture and a replay?
A: Each replay would reduce, or not, as the capture did: the optimizer
   would step rank-local or stale grads.  So the settings the capture left
   (GradSync: FSDP's reduce_grads, all_reduce_grads and
   reshard_after_backward of each group of the modules the step names,
   DDP's require_backward_grad_sync of each DDP model the step trains,
   its forwards run with grad, under no_sync() or not) are compared
   before each replay, an attribute read each, and a change makes the
   call step eagerly and the next capture again, as a changed mode does.
   So gradient accumulation with no_sync() set outside (a
   forward-and-backward step per micro-batch, all but the last under
   no_sync()) is correct but captures once per accumulation cycle.  That
   is warned of once, at the third such change each within 64 calls of
   the last (_SyncChanges in cgraph/_step.py), naming the fix: the
   micro-batches inside the step, or one graphed step per setting, as
   cgraph/lightning.py makes.  And such a step waits for DDP's eleven
   grad-syncing forwards however many calls they take (Note [DDP inside a
   graphed step], 2).  A model whose buffers DDP broadcasts (BatchNorm,
   broadcast_buffers=True, the default) fares worse: its forward under
   no_sync() also turns the broadcast off, compared below, so with 3 or
   more micro-batches the calls alternate between finding a change
   (stepped eagerly) and capturing, and only the capturing calls replay
   (broadcast_buffers=False, or the micro-batches inside the step, avoid
   it); those changes are not counted for the warning, which an
   evaluation's forward outside would otherwise set off.  DDP's
   require_forward_param_sync, of a model that broadcasts buffers, is
   compared too, against its value as the capture began: a forward
   under no_grad() or no_sync() turns it off and eager's next forward then
   broadcasts nothing, where a replay would, and a capture after such a
   forward would never broadcast.  And a replay sets it as its capture's
   forward left it, as eager's forward does: a step graphed for evaluation
   under no_grad() turns it off for the training step's next call.  A
   capture that would start with an FSDP group not reducing (reduce_grads
   off; all_reduce_grads off on a group with a replicate dimension), or
   holding grads that earlier calls left for a later reduction, is
   refused, naming the fix: FSDP keeps those
   grads in its own Python state (unsharded grads, HSDP's partial
   reduction), assigned on the first micro-batch and added after, which no
   replay can follow; a replay would add into the memory the capture found,
   freed since.  A step that turns sync off and on itself, inside, ends with
   it on, as its capture and every replay do.  Grads held by backwards
   outside after a capture that found none are looked for only where such
   a backward ran (Note [Grads FSDP2 holds, kept after a step's capture],
   cgraph/_fsdp.py).  So a failed capture that
   puts FSDP back to rest (Note [A capture that fails inside FSDP2's pass],
   cgraph/_fsdp.py) drops no grads held for a later reduction.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any, Callable, NamedTuple

import torch

from . import _C, _dtensor, _fsdp
from ._ddp import broadcasts_buffers
from ._describe import _named_state, step_replacing_epoch, watch_for_steps
from ._modes import Modes
from ._step_grads import StepGrads, _local, give_grads


class Change(NamedTuple):
    """What changed since capture, for the log: `what` `how` ("parameter 0
    of param group 0 of SGD", "was frozen"); `key`, the kind of change,
    counted in a row (GraphedStep._changed_in_a_row); `waits`, whether
    optimizers stepped inside a GradScaler's condition count as not found
    again (a parameter unfrozen needs its state made by a step the scaler
    does not skip: Note [GradScaler with any optimizer] in cgraph/_step.py)."""

    what: str
    how: str
    key: str
    waits: bool = False


def grad_mode() -> tuple[bool, bool]:
    """(grad enabled, inference mode) now: a step replays under the grad
    mode of its capture, and one captured under inference_mode only under
    it (its static tensors are inference tensors); one captured outside
    also replays under it."""
    return torch.is_grad_enabled(), torch.is_inference_mode_enabled()


def autocast_around() -> torch.dtype | None:
    """CUDA autocast's dtype now, or None where it is off: a step captured
    under autocast replays its casts and lower-precision kernels, one
    captured outside replays full precision, whatever a later call runs
    under (torch.autocast around a call)."""
    return torch.get_autocast_dtype("cuda") if torch.is_autocast_enabled("cuda") else None


def _grad_mode_named(mode: tuple[bool, bool]) -> str:
    enabled, inference = mode
    return ("torch.inference_mode()" if inference else
            "grad enabled" if enabled else "torch.no_grad()")


class SinceCapture:
    """One record of what a step's capture found and each replay checks
    first, in the order asked: the grad mode and autocast around the call
    (grad_mode(), autocast_around()), the tensors it reads (Marks), the
    modes of the modules it names (Modes, cgraph/_modes.py), their grad
    sync and the grads FSDP holds for a later reduction (GradSync), the
    grads no optimizer of it holds (OtherGrads), then the grads of its
    optimizers' parameters that the graph makes (StepGrads.made: rule 4 of
    Note [Grads around a graphed step] in cgraph/_step_grads.py)."""

    __slots__ = ("grad_mode", "autocast", "marks", "modes", "sync", "other_grads",
                 "step_grads")

    def __init__(self, grad_mode: tuple[bool, bool], autocast: torch.dtype | None,
                 marks: "Marks", modes: Modes, sync: "GradSync", other_grads: "OtherGrads",
                 step_grads: "StepGrads"):
        self.grad_mode, self.autocast, self.marks, self.modes = grad_mode, autocast, marks, modes
        self.sync, self.other_grads, self.step_grads = sync, other_grads, step_grads

    def first_changed(self) -> Change | None:
        """The first change since capture, or None (a native compare or two
        per record: Note [The step's hot path] in cgraph/_step.py)."""
        now = grad_mode()
        if now != self.grad_mode and (now[0] != self.grad_mode[0] or self.grad_mode[1]):
            return Change("the grad mode around the call", f"changed from "
                          f"{_grad_mode_named(self.grad_mode)} to {_grad_mode_named(now)}",
                          "grad mode")
        if autocast_around() != self.autocast:
            return Change("CUDA autocast around the call", f"changed from {self.autocast} to "
                          f"{autocast_around()} (None: off)", "autocast")
        if not self.marks.same():
            return Change(*self.marks.first_changed(), "parameters", waits=True)
        if not self.modes.same():
            return Change("a module it calls", self.modes.first_changed(), "modes")
        label = self.sync.first_changed()
        if label is not None:
            return Change(label, "changed", "grad sync")
        label = self.sync.held_outside()
        if label is not None:
            return Change(f"FSDP's {label}", "holds unsharded grads of a backward outside the "
                          "step, not yet reduced, which a replay would drop", "held grads")
        label = self.sync.broadcast_changed()
        if label is not None:
            return Change(label, "changed", "buffer broadcast")
        label = self.other_grads.first_changed()
        if label is not None:
            return Change(f"the grad of {label}", "was set or cleared outside the step", "grads")
        label = self.step_grads.first_made_outside()
        if label is not None:
            return Change(f"the grad of {label}", "was made outside the step, where its graph "
                          "makes it anew", "grads")
        return None


def _labelled(modules, state_of: Callable, keep: Callable[[torch.Tensor], bool]) -> dict:
    """id -> (label, tensor): each tensor that `state_of(module)` names in
    `modules` and `keep` accepts, once, labelled ``Class.name`` as the
    first module naming it calls it."""
    found: dict = {}
    for module in modules:
        for name, t in state_of(module):
            if id(t) not in found and keep(t):
                found[id(t)] = (f"{type(module).__name__}.{name}", t)
    return found


class Marks:
    """Each tensor a step's graph reads or steps in place, with its memory
    and requires_grad at capture (one ``_C.param_marks`` tuple): the
    parameters of its optimizers, then the other parameters and the buffers
    of the modules it names (an EMA copy it updates, a frozen backbone,
    BatchNorm's running stats).  Note [What a graphed step checks before a
    replay].  Held strongly: a tensor moved away (``ema.cpu()``) keeps its
    old memory until the check sees the move, so no other tensor can take
    it and be written by a replay.  A tensor replaced in its module by
    another object (``model.to(torch.bfloat16)`` converting a buffer,
    ``module.buf = t``) is found by walking the modules again, only after a
    registration, conversion or swap on one of them (watch_for_steps in
    cgraph/_describe.py)."""

    __slots__ = ("params", "modules", "tensors", "marks", "labels", "epoch")

    def __init__(self, params: tuple, modules: list, label: Callable[[Any], str]):
        self.params, self.modules = params, tuple(modules)
        others = self._others()
        self.tensors = (*params, *(t for _, t in others.values()))
        self.labels = (*map(label, params), *(name for name, _ in others.values()))
        self.marks = _C.param_marks(self.tensors)
        self.epoch = watch_for_steps(self.modules)

    def _others(self) -> dict:
        """id -> (label, tensor): the modules' parameters no optimizer of the
        step holds and their buffers, now.  Tensors without memory of their
        own to compare (sparse ones; subclasses other than DTensor, such as
        a QLoRA base's NF4 weights) are left out."""
        stepped = {id(p) for p in self.params}

        def state_of(module):
            # FSDP2 swaps its modules' sharded and unsharded parameters
            # itself: their shards are the optimizers'.
            sharded = any(map(_fsdp.is_fsdp, module.modules()))
            return module.named_buffers() if sharded else _named_state(module)

        return _labelled(self.modules, state_of,
                         lambda t: id(t) not in stepped and has_memory(t))

    def same(self) -> bool:
        if not _C.params_are(self.tensors, self.marks):
            return False
        if self.epoch == step_replacing_epoch():
            return True
        now, held = [t for _, t in self._others().values()], self.tensors[len(self.params):]
        if len(now) != len(held) or any(a is not b for a, b in zip(now, held)):
            return False
        self.epoch = watch_for_steps(self.modules)  # submodules added since too
        return True

    def first_changed(self) -> tuple[str, str]:
        """(the first changed tensor's label, how it changed)."""
        now = _C.param_marks(self.tensors)
        changed = [k for k, (was, got) in enumerate(zip(self.marks, now)) if was != got]
        if not changed:
            held = {id(t) for t in self.tensors}
            label = next((name for name, t in self._others().values() if id(t) not in held),
                         "a buffer or parameter")
            return label, "was replaced (module.to(), a new tensor assigned)"
        k = changed[0]
        if now[k][1] != self.marks[k][1]:
            return self.labels[k], "was unfrozen" if now[k][1] else "was frozen"
        return self.labels[k], "moved to other memory (.to(), .data = ...)"


def has_memory(t: torch.Tensor) -> bool:
    """Whether _C.param_marks can read where `t`'s kernels read: a strided
    tensor of no dispatch subclass, or a DTensor (its local shard)."""
    return t.layout == torch.strided and (
        _dtensor.is_dtensor(t) or type(t).__torch_dispatch__ is torch.Tensor.__torch_dispatch__)


class _Watched(NamedTuple):
    """One parameter OtherGrads watches, as the capture began."""

    param: torch.Tensor
    label: str
    before: "weakref.ref | None"  # its grad (weakly: see OtherGrads), None where it had none
    version: int | None  # that grad's version: one written in place is touched too

    def grad_before(self) -> torch.Tensor | None:
        """Its grad as the capture began; None too where that one was freed
        since (the step's own zero_grad() set it to None)."""
        return None if self.before is None else self.before()


class OtherGrads:
    """The grads of the parameters of the modules a step names that none of
    its optimizers holds (a forward-and-backward step's; a part trained by
    an optimizer stepped outside), frozen ones left out: Note [Grads no
    optimizer of the step holds].  Each parameter's grad as the capture
    began (weakly; held strongly through the capture itself, but where the
    step's own zero_grad() frees it for the capture to reuse: noting,
    forget) and, for those the capture touched, as it ended."""

    __slots__ = ("watched", "started", "touched", "after", "checked", "checked_before")

    def __init__(self, modules: list, stepped: set):
        found = _labelled(modules, lambda m: m.named_parameters(),
                          lambda p: id(p) not in stepped and p.requires_grad)
        self.watched = tuple(
            _Watched(p, name, None if p.grad is None else weakref.ref(p.grad),
                     None if p.grad is None else _local(p.grad)._version)
            for name, p in found.values())
        # id(p) -> its grad as the capture began, held through it (noting)
        # unless the step's zero_grad() clears it (forget).
        self.started: dict = {}
        # Set once the capture returned: the parameters whose grad it added
        # into, made, replaced or cleared, and each one's grad as it ended.
        self.touched: tuple = ()
        self.after: tuple | None = None
        # The checked parameters and their grads as the capture began:
        # aligned, so that the check is one native call.
        self.checked: tuple = ()
        self.checked_before: tuple = ()

    @property
    def params(self) -> tuple:
        return tuple(w.param for w in self.watched)

    @contextlib.contextmanager
    def noting(self):
        """Around the capture: each grad held until captured() (or until
        the step's zero_grad() clears it: forget), so that one the backward
        added into (its version moved) and the step then replaced
        (``p.grad = p.grad * mask``) is still there to check: every replay
        adds into that memory.  Not by a post-accumulate-grad hook: torch
        keeps one registered after its handle is removed, and the
        parameter's per-layer graphs would take their slow grad path for
        good (csrc/aten_backward.cpp, delivered_by_autograd)."""
        self.started = {id(w.param): (w.grad_before(), w.version) for w in self.watched
                        if w.before is not None}
        yield

    def forget(self, params) -> None:
        """The step's zero_grad() clears these parameters' grads: the ones
        they had go back to the pool for the capture to reuse."""
        for p in params:
            self.started.pop(id(p), None)

    def captured(self, cleared: frozenset) -> None:
        """Once the capture returned.  A grad the capture left as it found
        it (the same object, not added into: a step without a backward
        through it, an evaluation) is no replay's business: neither checked
        nor put back, so that a training step's grads between its calls
        stay.  A grad the step cleared itself (zero_grad() inside) is made
        anew by every replay, whatever it was before the call, and so is one
        the backward did not add into that is gone since (set to None
        inside): not checked.  One the backward added into is, held, even
        where the step replaced it after."""
        read = {key: grad for key, (grad, version) in self.started.items()  # added into,
                if grad is not None and _local(grad)._version != version}  # or written
        self.started = {}
        kept, touched = [], []
        for w in self.watched:
            p, found = w.param, w.grad_before()
            if (id(p) not in read and p.grad is found
                    and (w.before is None) == (found is None)
                    and (found is None or _local(found)._version == w.version)):
                continue  # untouched
            touched.append(p)
            grad = read.get(id(p), found)
            if id(p) not in cleared and (w.before is None or grad is not None):
                kept.append((p, grad))
        self.touched = tuple(touched)
        self.after = tuple(p.grad for p in self.touched)
        self.checked = tuple(p for p, _ in kept)
        self.checked_before = tuple(grad for _, grad in kept)  # the starting grads that matter

    def put_back(self) -> None:
        """After a capture that failed or was dropped: each parameter gets
        its grad as the capture began (None where it had none, or where the
        step's own zero_grad() freed it, as an eager step failing there
        would leave it).  Not the capture's: no kernel wrote those, and the
        next backward would add into them."""
        for w in self.watched:
            grad = w.grad_before()
            if w.param.grad is not grad:
                w.param.grad = grad

    def first_changed(self) -> str | None:
        """The label of the first checked parameter whose grad is not the
        object it was when the capture began, or None."""
        if _C.grads_are(self.checked, self.checked_before):
            return None
        changed = next(p for p, was in zip(self.checked, self.checked_before)
                       if p.grad is not was)
        return next(w.label for w in self.watched if w.param is changed)

    def leave(self) -> None:
        """After a replay: each grad the capture touched, the one it left."""
        if self.after is not None:
            give_grads(self.touched, self.after)


class GradSync:
    """Whether the FSDP2 groups and DDP models a step names reduce their
    grads: Note [Grad sync set outside a graphed step].  One owner,
    attribute and label per setting, aligned, and its value as the capture
    began, then (captured()) as it left it; the FSDP groups, the one
    holding grads for a later reduction as the capture began
    (_fsdp.holding_grads), and FSDP's count of backwards that kept grads as
    last seen (Note [Grads FSDP2 holds, kept after a step's capture] in
    cgraph/_fsdp.py); and whether
    each DDP model that broadcasts buffers was to broadcast them as the
    capture began (require_forward_param_sync, compared with that) and as
    the capture left it (set again after each replay, as eager's forward
    sets it)."""

    __slots__ = ("owners", "names", "labels", "values", "groups", "holding", "backwards",
                 "broadcasting", "broadcast", "left")
    _FSDP = ("reduce_grads", "all_reduce_grads", "reshard_after_backward")

    def __init__(self, fsdp_groups, ddp_training: list, ddp_models: list):
        """`ddp_training`: the DDP models whose backward the step runs;
        `ddp_models`: every one it calls (DDPInStep)."""
        settings = [(g, name, f"FSDP's {name} of {_fsdp.group_name(g)}")
                    for g in fsdp_groups for name in self._FSDP if hasattr(g, name)]
        settings += [(m, "require_backward_grad_sync", "DDP's require_backward_grad_sync "
                      "(no_sync())") for m in ddp_training]
        self.owners = tuple(owner for owner, _, _ in settings)
        self.names = tuple(name for _, name, _ in settings)
        self.labels = tuple(label for _, _, label in settings)
        self.values = self._now()
        self.groups = tuple(fsdp_groups)
        self.holding = _fsdp.holding_grads(self.groups)
        _fsdp.watch_held_grads(self.groups)
        self.backwards = _fsdp.held.backwards
        self.broadcasting = tuple(m for m in ddp_models if broadcasts_buffers(m))
        self.broadcast = self._broadcast_now()
        self.left: tuple = ()

    def _broadcast_now(self) -> tuple:
        return tuple(m.require_forward_param_sync for m in self.broadcasting)

    def _now(self) -> tuple:
        return tuple(map(getattr, self.owners, self.names))

    def captured(self) -> None:
        """Once the capture returned: the settings it left are those every
        replay keeps (a step that turns sync off and on itself ends with it
        on)."""
        self.values = self._now()
        self.left = self._broadcast_now()
        self.backwards = _fsdp.held.backwards  # the step's own: none held after it

    def first_changed(self) -> str | None:
        """The label of the first grad sync setting changed since, or None."""
        now = self._now()
        if now != self.values:
            return next(label for label, was, got in zip(self.labels, self.values, now)
                        if got != was)
        return None

    def held_outside(self) -> str | None:
        """The name of the first FSDP group holding grads for a later
        reduction, where a backward that keeps them ran since the capture or
        the last look, or None: Note [Grads FSDP2 holds, kept after a step's
        capture] (cgraph/_fsdp.py).  An integer compare, and a walk of the
        groups only where it moved."""
        if _fsdp.held.backwards == self.backwards:
            return None
        self.backwards = _fsdp.held.backwards
        return _fsdp.holding_grads(self.groups)

    def broadcast_changed(self) -> str | None:
        """The label of DDP's buffer broadcast if it changed since, or None:
        a forward under no_grad() outside (an evaluation) or under no_sync()
        turns it off (so with gradient accumulation set outside, a model
        with buffers changes it at every call: below)."""
        if self.broadcasting and self._broadcast_now() != self.broadcast:
            return ("DDP's require_forward_param_sync (whether its forward broadcasts rank 0's "
                    "buffers, off after a forward under no_grad() or no_sync())")
        return None

    def leave(self) -> None:
        """After a replay: each DDP model's require_forward_param_sync as the
        capture's forward left it (off after a step that ran it under
        no_grad(), an evaluation step), as eager's forward would set it; the
        next call of any step reads it."""
        for model, value in zip(self.broadcasting, self.left):
            model.require_forward_param_sync = value

    def refuse_unreduced(self) -> None:
        """Refuses to capture a call that starts with an FSDP group not
        reducing its grads (HSDP's all-reduce included), or holding grads
        earlier calls left for a later reduction."""
        for owner, name, label, value in zip(self.owners, self.names, self.labels, self.values):
            if value:
                continue
            if name == "reduce_grads":
                _refuse_held(f"starts with {label} off (set_requires_gradient_sync(False) "
                             "before the call): FSDP then keeps the unsharded grads across "
                             "calls in its own Python state")
            if name == "all_reduce_grads" and _fsdp.all_reduces(owner):
                _refuse_held(f"starts with {label} off (set_requires_all_reduce(False) before "
                             "the call): FSDP then keeps HSDP's partial reduction across calls "
                             "in its own Python state")
        if self.holding is not None:
            _refuse_held(f"starts with FSDP's {self.holding} holding unsharded grads not yet "
                         "reduced (left by calls with sync off, or by a backward that raised, "
                         "or set by hand), in FSDP's own Python state")


def _refuse_held(what: str) -> None:
    raise ValueError(
        f"cgraph: this call of the step, which would capture it, {what}, which a replay "
        "cannot follow. Run the micro-batches inside the step, calling "
        "set_requires_gradient_sync(i == last) before each backward (the step then ends with "
        "sync on), or graph the layers instead (cgraph.make_graphed(layer) for each "
        "fully_shard-ed layer).")

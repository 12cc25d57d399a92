"""Ranks that agree on a capture.

Note [A capture that fails on one rank]
Q: A step graphed whole holds its collectives (DDP's allreduce, FSDP's
   all-gathers and reduce-scatters, TP's all-reduces) inside its graph, and
   every rank captures it at the same call.  If the capture fails on one
   rank, the others finish theirs and replay, and their collectives wait
   for a rank that never comes: a hang, with the cause on one rank's
   console.  How does every rank learn it?
A: After a whole-step capture, where torch.distributed is initialized with
   more than one rank, the ranks tell each other whether it succeeded: one
   all_gather_object on the default group, once per capture, none per
   replay.  A collective captured into a graph does not run at capture, so
   no rank is inside one then.  If any rank failed, every rank raises,
   naming each failed rank and its error; a failed rank raises its own
   error with that note.  The same gather tells whether any rank's capture
   made optimizer state: then every rank replays once and captures again
   (Note [What a graphed step checks before a replay], _step_checks.py),
   for one rank capturing while another replays would hang them both.  A
   failure before the capture (a refusal, the static inputs' memory) is
   agreed on too: each rank calls agree once per capture, wherever it
   stopped.
   Only a step that may hold collectives is agreed on: one that trains a
   DDP model (forwards with grad, under no_sync() too: its setting may
   change between calls) or calls one that broadcasts buffers (seen in its
   warm-up; not one evaluated under no_grad() without buffers, which
   issues none), or whose optimizers' parameters or arguments include a
   DTensor (FSDP2, tensor parallelism), decided before
   capture from what every rank running the step holds alike
   (may_hold_collectives).  A step without them may run on some ranks only
   (``if rank == 0: make_graphed_step(evaluate)``), where a gather on the
   default group would wait forever for the others.  Collectives the step
   issues itself (``dist.all_reduce`` of grads, with no DDP or DTensor) are
   not seen: a capture failing on one rank then raises there only (torchrun
   then stops the others when that rank exits), where agreeing on every
   step would hang a step graphed on some ranks only on every run.
   Per-layer graphs are not agreed on: their captures come on each rank's
   own first call with new shapes, which may differ between ranks (a short
   last batch on one of them).
   Under TORCH_DISTRIBUTED_DEBUG=DETAIL torch checks each collective's
   fingerprint with every rank as it is issued, captured ones too (on a
   gloo group, on the host).  A rank that failed before a collective the
   others captured then meets their check with the gather's own: torch
   raises its collective-mismatch error there and a failed barrier on the
   others (on two H200s, examples/ddp_step.py check 8: no hang), and the
   process group is unusable after, as DETAIL means it to be.  The failed
   rank raises its own error all the same, the gather's as its context and
   in a note: the cause stays named where it happened.
"""

from __future__ import annotations

from typing import Iterable

import torch.distributed as dist

from ._dtensor import is_dtensor


def may_hold_collectives(ddp_models: list, tensors: Iterable) -> bool:
    """Whether a step graphed whole may hold collectives, so that its ranks
    agree on its capture: it calls DDP models (`ddp_models`), or one of
    `tensors` (its optimizers' parameters and its arguments) is a DTensor."""
    return bool(ddp_models) or any(is_dtensor(t) for t in tensors)


def agree(failure: BaseException | None, what: str, together: bool = True, *,
          holds: bool = False) -> bool:
    """Raises on every rank if `what` failed on any (`failure`: this rank's
    error, or None), where the ranks run it `together`; otherwise, or
    without a process group of several ranks, raises `failure` if there is
    one.  Else returns whether `holds` on any rank running it together
    (here only, otherwise), told in the same gather: one per capture."""
    if not _several(together):
        if failure is not None:
            raise failure
        return holds
    why = None if failure is None else f"{type(failure).__name__}: {failure}"
    lost = None  # the gather's error, where it raised after this rank's own failure
    try:
        everyone = _gathered((why, holds))
    except Exception as gather:
        if failure is None:
            raise
        lost = gather
    if lost is not None:  # raised out here, not in the handler: failure's context stays
        failure.add_note(f"cgraph: {what} failed on this rank, and telling the other ranks "
                         f"failed too ({type(lost).__name__}: {lost}).")
        if failure.__context__ is None and failure.__cause__ is None:
            failure.__context__ = lost
        raise failure
    failed = {rank: why for rank, (why, _) in enumerate(everyone) if why is not None}
    if not failed:
        return any(held for _, held in everyone)
    message = (f"cgraph: {what} failed on rank(s) {sorted(failed)}, so every rank stops here "
               "instead of replaying collectives that the failed rank(s) would never join. "
               + " ".join(f"Rank {rank}: {why}" for rank, why in sorted(failed.items())))
    if failure is not None:
        failure.add_note(message)
        raise failure
    raise RuntimeError(message)


def _several(together: bool) -> bool:
    """Whether ranks running something `together` are several, in an
    initialized process group."""
    return (together and dist.is_available() and dist.is_initialized()
            and dist.get_world_size() > 1)


def _gathered(value) -> list:
    """Every rank's `value`, by rank (one all_gather_object on the default group)."""
    everyone: list = [None] * dist.get_world_size()
    dist.all_gather_object(everyone, value)
    return everyone

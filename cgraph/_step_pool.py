"""A training step captured into a pool= that other graphs share.

Note [A step captured into a shared pool]
Q: ``make_graphed_step(fn, pool=p)`` where graphs already live in ``p`` (a
   generator's and a discriminator's step given one pool, a step beside
   layers graphed with that pool).  A capture takes the pool's free blocks,
   among them the earlier graphs' temporaries, which each of their replays
   writes again (Note [Captures that share a pool] in csrc/aten_pool.cpp).
   The step's outputs are looked after there: the native ledger moves them
   out before an earlier graph replays.  But what the step's capture leaves
   that only Python holds -- the grads it assigns (``zero_grad()`` sets them
   to None first, by default), optimizer state it makes -- outlives every
   replay, and the ledger does not know it.  In an earlier graph's
   temporaries, that graph's next replay overwrites it: the optimizer would
   step with another graph's activations.  Can that be told, and when?
A: At the capture, at the cost of one snapshot of the pool, only where it
   can happen: ``pool=`` given and another live graph in that pool (cgraph's
   own: ``_live``).  The pool's segments are noted just before the capture,
   with the grads that exist then.  After it, every grad of the parameters
   the step trains or backpropagates into that is not one of those, and
   every optimizer state tensor it made, is looked up there: one that
   overlaps a segment the pool had before fails the capture, on every rank
   (cgraph/_ranks.py), with what to do.  Only new segments are the capture's
   own: any block of an older one an earlier graph may write, whether it
   was free as the capture began or freed during it (the kept activations
   and statics of layers graphed one by one are released as it starts; the
   step's own zero_grad() frees a block a longer grad then runs past), so
   the check is by segment, not by block.  Nothing is moved instead: the
   graph's kernels write that memory at their captured addresses.  A step
   whose grads and state all exist before its capture (zeroed in place,
   ``zero_grad(set_to_none=False)``, after eager warm-up steps, which with
   pool= run outside the pool) leaves nothing new there and shares the
   pool, saving its temporaries' memory.  Every capture is checked, a
   recapture too (a hyperparameter baked in changed): one first captured
   alone in its pool may be refused once another graph shares it.  The
   grads looked up are those replays hand out (StepGrads.after: a grad
   made outside the step is the parameter's again until the replay), and
   an existing grad counts as new where its memory moved (``.data = t``
   inside the step); a wrapper subclass's inner tensors are looked up.
   Conservative: the unused tail of a segment, or a block only a graph
   reset since wrote, counts too.  Not seen: graphs that torch.cuda.graph
   captured into the pool, which torch leaves to the user ("replay in
   capture order").
"""

from __future__ import annotations

import bisect
import weakref
from typing import NamedTuple

import torch

from . import _dtensor
from ._api import _live


class SharedPool(NamedTuple):
    """A shared pool as a step's capture began: its segments as sorted
    (start, end) address spans, the grads that existed then, and the other
    graphs that may write those segments."""

    starts: tuple
    ends: tuple
    existing: dict  # id -> (weak reference, its memory) of each grad that existed
    graphs: tuple  # repr() of each other live graph of the pool

    @classmethod
    def before_capture(cls, pool, own, params: list) -> "SharedPool | None":
        """None where no other live graph shares `pool` (or none was given):
        nothing to look up.  `params`: those whose grads the step may keep."""
        if pool is None:
            return None
        pool = tuple(pool)
        graphs = tuple(repr(g) for g in list(_live)
                       if g is not own and not g.is_reset and pool in g.pools)
        if not graphs:
            return None
        spans = sorted((s["address"], s["address"] + s["total_size"])
                       for s in torch.cuda.memory_snapshot(pool, include_traces=False)
                       if tuple(s.get("segment_pool_id", pool)) == pool)
        existing = {id(p.grad): (weakref.ref(p.grad), _memory_of(p.grad))
                    for p in params if p.grad is not None}
        return cls(tuple(s for s, _ in spans), tuple(e for _, e in spans), existing, graphs)

    def first_new_in_it(self, kept: list) -> str | None:
        """What the first of `kept` ((what, tensor) pairs: what the capture
        left for Python to hold) is that is new (not a grad that existed, in
        the memory it had) and overlaps a segment; None if none is."""
        for what, t in kept:
            if not isinstance(t, torch.Tensor):
                continue
            memory = _memory_of(t)
            was = self.existing.get(id(t))
            if was is not None and was[0]() is t and was[1] == memory:
                continue
            if any(self._overlaps(start, size) for start, size in memory):
                return what
        return None

    def _overlaps(self, start: int, size: int) -> bool:
        k = bisect.bisect_right(self.starts, start + size - 1) - 1
        return size > 0 and k >= 0 and start < self.ends[k]

    def refusal(self, what: str) -> RuntimeError:
        return RuntimeError(
            f"cgraph: the step's capture put {what} in memory of its pool= that "
            f"{len(self.graphs)} other graph(s) of that pool may write at each of their "
            f"replays (first: {self.graphs[0]}). Give the step a pool of its own (leave pool= "
            "out), or have its grads and optimizer state exist before it is captured "
            "(zero_grad(set_to_none=False) in the step): Note [A step captured into a shared "
            "pool] in cgraph/_step_pool.py.")


def _memory_of(t: torch.Tensor) -> tuple:
    """The (start, size) of each CUDA storage `t` reads: its own, a DTensor's
    local tensor's, a wrapper subclass's inner tensors' (float8 weights)."""
    if _dtensor.is_dtensor(t):
        return _memory_of(t._local_tensor)
    if type(t).__torch_dispatch__ is not torch.Tensor.__torch_dispatch__:
        flatten = getattr(t, "__tensor_flatten__", None)
        if flatten is None:
            return ()
        return tuple(m for name in flatten()[0] for m in _memory_of(getattr(t, name)))
    if not t.is_cuda or t.layout != torch.strided:
        return ()
    storage = t.untyped_storage()
    return ((storage.data_ptr(), storage.nbytes()),)

"""Callables graphed one by one without samples but with one ``pool=``: the
layers of a model, each ``cgraph.make_graphed(layer, pool=pool)``.  Each is
captured on its first call with new shapes, into that pool, beside the
layers before it.

Note [One pool for separately graphed callables]
Q: A callable graphed on its own captures its backward right after its
   forward, and the next capture in its pool may take the memory of its
   activations.  How do layers graphed one by one share one pool?
A: One pool serves several graphs only while no replay overwrites memory a
   pending backward still needs (Note [Captures that share a pool] in
   csrc/aten_pool.cpp).  So a member's captures keep their activations
   allocated until its backward has run (Note [Layers captured one by one
   into one pool], there): the next layer's capture, on its first call,
   cannot take them, and the forwards of a pass replay while the earlier
   layers' backwards are pending, backwards in reverse, as if the pass had
   been captured together.  Graphs of every shape and every layer then share
   one pool, instead of a pool per layer each holding its own temporaries
   and cached segments.  A call that cannot capture there now gets an
   instance in a pool of its own, as a callable graphed alone does: in a
   second pass, once a member was called again before its backward (a
   second micro-batch, with the first one's shapes or others: its captures
   in the shared pool could take the temporaries of the first micro-batch's
   backwards, which run before its own), or while a graph of the pool whose
   activations are no longer kept is pending (it was replayed after its
   activations were released, and a capture could take them).
   A call inside a backward (a checkpoint's recompute) that no graph takes
   runs eagerly: no capture runs inside autograd's backward.  The native
   core decides each such call (Note [Several graphs per callable] in
   csrc/graphed.c), and the pool's ledger keeps whether it is in a second
   pass (cg_pool_open_to_layers in csrc/aten_pool.cpp); a Member only
   captures where it is told.  Results are eager's throughout.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import torch
from torch.utils import _pytree as pytree

from . import _C
from ._capture import CaptureOptions
from ._describe import Target
from ._regraph import Regraph, _sample_of


class Member(Regraph):
    """on_miss of a callable graphed without samples with a ``pool=``: its
    graphs go into that pool, keeping their activations, when the native
    core's CaptureSite says so."""

    __slots__ = ("pool",)

    def __init__(self, target: Target, pool: tuple[int, int], options: CaptureOptions):
        super().__init__(target, options)
        self.pool = pool

    @contextlib.contextmanager
    def _samples(self, args: tuple, kwargs: dict, pool: tuple[int, int]) -> Iterator[tuple]:
        """In the shared pool, a tensor that is another member's static
        output is read in place (Note [A layer reading the one before it in
        place] in csrc/aten_pool.cpp): the sample is a view of that memory,
        which the member's engine holds while it needs it; the others are
        copied.  Warm-up calls the callable on it several times: one that
        changes its input in place would change that output each time, so
        its values are put back after the capture, and the replay changes
        it once, as the eager call would."""
        if pool != self.pool:
            with super()._samples(args, kwargs, pool) as samples:
                yield samples
            return
        read_in_place = []  # (the output, its version or None, its values)

        def sample(t: torch.Tensor) -> torch.Tensor:
            output = _C.static_output(t, pool)
            if output is None:
                return _sample_of(t)
            # An inference tensor (a capture under inference_mode) has no
            # version to read: its values are put back in any case.
            version = None if output.is_inference() else output._version
            read_in_place.append((output, version, output.detach().clone()))
            return output.requires_grad_(t.requires_grad)

        try:
            yield pytree.tree_map_only(torch.Tensor, sample, (args, kwargs))
        finally:
            with torch.no_grad():
                for output, version, values in read_in_place:
                    if version is None or output._version != version:
                        output.copy_(values)


def graphed_layer(target: Target, pool: tuple[int, int], options: CaptureOptions,
                  max_graphs: int, first: _C.Graphed | None = None,
                  casts: bool = False) -> _C.Graphed:
    """A callable graphed without samples with this pool=: it captures on
    its first call, and on each call its graphs do not take, up to
    ``max_graphs``, into the pool while it may (else into a pool of its own,
    as a callable graphed alone does).  Warm-up runs in the shared pool, in
    blocks no pending backward needs (Note [Warm-up in the pool] in
    csrc/aten_setup.cpp): beside it, it would take segments of its own on
    the capture stream.  A tensor the warm-up leaves there (state made on a
    first call with new shapes) is moved out; memory that cannot be moved
    makes the call raise, and every later capture of this layer, since the
    graphs captured before it would overwrite it.  ``first``: its first
    graph, captured with others into ``pool`` (the drop-in's callables
    graphed together); without it, the first call captures.  ``casts``: as
    regraphing's (cgraph/_regraph.py)."""
    return _C.new_graphed(Member(target, pool, options), max_graphs, first=first,
                          shared_pool=pool, layer=True, eager=target.run_eagerly, casts=casts)

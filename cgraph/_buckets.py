"""Padding to buckets (``make_graphed(..., buckets=...)``): a call is padded
up to the next bucket size, replays that bucket's graph, and its outputs are
sliced back, so a few graphs serve every size (as vLLM and SGLang pad batch
sizes).  Exact only when the padded rows cannot change the real ones:
rows of a batch that no op mixes (no BatchNorm in training mode), or
positions after the real ones under causal attention."""

from __future__ import annotations

import bisect
from typing import Any, Mapping, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import _C


def normalize(buckets) -> dict[int, tuple[int, ...]]:
    """``[8, 16, 32]`` (the leading dimension) or ``{dim: sizes}``, checked
    and sorted."""
    if isinstance(buckets, Mapping):
        items = dict(buckets)
    elif isinstance(buckets, Sequence) and not isinstance(buckets, str):
        items = {0: buckets}
    else:
        items = None
    if not items or not all(
            isinstance(d, int) and d >= 0 and len(s) > 0 and
            all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in s)
            for d, s in items.items()):
        raise ValueError(
            "cgraph: buckets must be sizes for the leading dimension ([8, 16, 32]) or a "
            f"dict of sizes per dimension ({{0: [8, 16], 1: [128, 256]}}); got {buckets!r}.")
    return {d: tuple(sorted(set(s))) for d, s in sorted(items.items())}


class Bucketed:
    """A graphed callable whose calls are padded up to bucket sizes.

    The size of each bucketed dimension is read from the call's first tensor
    argument that has it; every tensor argument with that size there is
    padded with zeros to the next bucket, and every output with the
    bucket's size in that same dimension is sliced back (an output laid out
    otherwise, heads before positions, is not: return (batch, seq, ...)).  Grads of padded rows are dropped
    (the slice's backward).  A size above the largest bucket is not padded:
    it gets a graph of its own, or runs eagerly past ``max_graphs``.  A
    tensor that broadcasts along a bucketed dimension is padded like the
    others when the call's size there is 1 (Llama's (1, T, d) rotary tables
    under a batch of 1), which costs that call a graph of its own."""

    __slots__ = ("graphed", "buckets", "module")

    def __init__(self, graphed: _C.Graphed, buckets: dict[int, tuple[int, ...]],
                 module: nn.Module | None):
        self.graphed = graphed
        self.buckets = buckets
        self.module = module if module is not None and _mixes_rows(module) else None

    def __call__(self, *args, **kwargs) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        padding = self._padding(leaves)
        if not padding:
            return self.graphed(*args, **kwargs)
        if 0 in padding and self.module is not None and self.module.training:
            raise ValueError(
                f"cgraph: {type(self.module).__name__} has BatchNorm in training mode, whose "
                "statistics mix the rows of a batch: padded rows would change the real ones. "
                "Leave out buckets for dimension 0, or graph it without buckets.")
        leaves = [_pad(t, padding) if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = self.graphed(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: _unpad(t, padding), out)

    def _padding(self, leaves: list) -> dict[int, tuple[int, int]]:
        """{dim: (size, bucket)} for the dimensions this call pads."""
        padding = {}
        for dim, sizes in self.buckets.items():
            first = next((t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > dim),
                         None)
            if first is None:
                continue
            n = first.shape[dim]
            k = bisect.bisect_left(sizes, n)
            if k < len(sizes) and sizes[k] != n:
                padding[dim] = (n, sizes[k])
        return padding

    def __getattr__(self, name: str):
        return getattr(self.graphed, name)  # stats, num_graphs, pool, reset, ...


def _pad(t: torch.Tensor, padding: dict[int, tuple[int, int]]) -> torch.Tensor:
    for dim, (n, bucket) in padding.items():
        if t.dim() > dim and t.shape[dim] == n:
            shape = list(t.shape)
            shape[dim] = bucket - n
            t = torch.cat([t, t.new_zeros(shape)], dim)
    return t


def _unpad(t: torch.Tensor, padding: dict[int, tuple[int, int]]) -> torch.Tensor:
    for dim, (n, bucket) in padding.items():
        if t.dim() > dim and t.shape[dim] == bucket:
            t = t.narrow(dim, 0, n)
    return t


def _mixes_rows(module: nn.Module) -> bool:
    return any(isinstance(m, nn.modules.batchnorm._BatchNorm) for m in module.modules())

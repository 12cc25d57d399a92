"""Padding to buckets (``make_graphed(..., buckets=...)``): a call is padded
up to the next bucket size, replays that bucket's graph, and its outputs are
sliced back, so a few graphs serve every size (as vLLM and SGLang pad batch
sizes).  Exact only when the padded rows cannot change the real ones:
rows of a batch that no op mixes (no BatchNorm in training mode), or
positions after the real ones under causal attention or masked out by an
attention mask (Note [Attention masks under sequence buckets]).

Note [What padded rows hold]
----------------------------
Why not zeros for floating-point tensors?  A padded row's outputs are sliced
off, so its upstream grads are zeros, but its activations still meet the
parameters in the backward (a weight's grad sums activation * upstream grad
over every row).  An op that is 0/0 at zero (``x / x.norm(dim=-1,
keepdim=True)``, an RMSNorm without eps) makes a zero row's activations NaN,
and NaN * 0 = NaN reaches the parameter grads where eager's are finite.  So
floating-point (and complex) tensors are padded with copies of their last
real row along the padded dimension: finite wherever the real rows are, and
inside the range the callable already handles.  A call of size 0 has no last
row, and is not padded (it gets a graph of its own).

Why zeros for integer and bool tensors along positions?  There 0 carries a
meaning the padding needs: a padding mask's 0 (or False) masks a position,
so padded keys stay out of the real rows' attention; token ids and labels
of 0 are valid values that no op divides by.  Copying the last column of a
(batch, seq) padding mask would let real queries attend to padded keys.  A
padding mask must therefore be integer or bool (as tokenizers return it): a
float one of ones and zeros is padded with its last column.  Along the
batch (dimension 0) every tensor is padded with copies of its last real
row, integers and bools too: a padded batch row then holds a real row's
tokens and mask, where zeros would mask every key of it (a hand-written
``masked_fill(-inf).softmax`` is NaN there, and the NaN reaches the
parameter grads).

Note [Attention masks under sequence buckets]
---------------------------------------------
Which tensors are read as attention masks?  For a bucketed dimension ``d >=
1`` whose size in this call is ``n``, a tensor ``t`` laid out ``(...,
queries, keys)`` for those positions, as Hugging Face passes its decoder
layers a ``(B, 1, T, T)`` mask, or T5 a ``(B, H, T, T)`` position bias.
Those positions are not at ``d`` in it, so the rule "pad every tensor with
size ``n`` at ``d``" misses them.  ``t`` is read as such a mask when all of:

- ``d < t.dim() - 2``: the bucketed dimension comes before the last two (a
  ``(B, T, T)`` mask under ``{1: ...}`` has its queries at ``d`` and is padded
  there alone, as any tensor: pass masks with a head dimension);
- ``t.shape[-1] == n`` and ``t.shape[-2]`` is ``n`` or 1 (a key-padding mask
  ``(B, 1, 1, T)`` that broadcasts over the queries);
- ``t.shape[d] == 1`` (broadcast over heads), or ``t`` has 4 dimensions and
  ``t.shape[d] != n`` (one mask per head).

These keep a weight ``(64, 64)`` passed as an argument at ``T = 64`` (2
dimensions), a ``(B, T, d)`` activation and a ``(B, T, H, hd)`` one (size
``n`` at ``d``) from being read as masks.  A heads-first ``(B, H, T, hd)``
tensor with ``hd == T`` is misread as one (and, returned at the bucket's
size, sliced in ``hd`` too): pass and return such tensors positions-first.

How is a mask padded?  The new key columns are masked (False, 0, or the
dtype's min for a float additive mask, as transformers fills them:
``torch.finfo(dtype).min``), so the real queries' attention is unchanged.
The new query rows attend to every key (True, 1, 0.0): a fully masked row is
NaN in a hand-written softmax over -inf (and zeros or a uniform average in
others), and a NaN there would reach the parameter grads through NaN * 0
(Note [What padded rows hold]); a row that attends to real keys is finite in
every implementation, and rows of attention are independent, so it touches
only its own padded query, whose output is sliced off.  (A real query row
that is fully masked, a left-padding token's under a float mask, averages
every key uniformly, so its output does change with the padded keys: a pad
token's, which the loss ignores.)  An output of the same layout at the
bucket's size (attention weights ``(B, H, T', T')``, a position bias) is
sliced back in both of its last two dimensions.
"""

from __future__ import annotations

import bisect
import weakref
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
    argument that has it (pass the hidden states before the mask, as Hugging
    Face's models do); every tensor argument with that size there is
    padded to the next bucket (floats with copies of their last real row,
    integers and bools with zeros: Note [What padded rows hold]), an
    attention mask ``(..., T, T)`` under sequence buckets in its last two
    dimensions (Note [Attention masks under sequence buckets]), and every
    output with the bucket's size in that same dimension is sliced back (an
    output laid out otherwise, heads before positions, is not: return
    (batch, seq, ...)).  Grads of padded rows are dropped (the slice's
    backward).  A size above the largest bucket is not padded: it gets a
    graph of its own, or runs eagerly past ``max_graphs``.  A tensor that
    broadcasts along a bucketed dimension is padded like the others when
    the call's size there is 1 (Llama's (1, T, d) rotary tables under a
    batch of 1), which costs that call a graph of its own.

    Example (``layer`` a Hugging Face decoder layer, ``mask`` its
    ``(B, 1, T, T)`` attention mask, ``rotary`` its ``(cos, sin)``)::

        graphed = cgraph.make_graphed(layer, buckets={1: [128, 256]})
        out = graphed(hidden, attention_mask=mask, position_embeddings=rotary)
        # T = 100: a replay of the 128 graph, out sliced back to (B, 100, d)
    """

    # __weakref__: a module whose forward it is keeps it weakly (_api._Installed).
    __slots__ = ("graphed", "buckets", "_module", "_batchnorms", "__weakref__")

    def __init__(self, graphed: _C.Graphed, buckets: dict[int, tuple[int, ...]],
                 module: nn.Module | None):
        self.graphed = graphed
        self.buckets = buckets
        # Weakly: it is often the module whose forward this is (graph_layers),
        # and a cycle would keep the graphs and their pool until a collection.
        batchnorms = _batchnorms(module) if module is not None else []
        self._module = weakref.ref(module) if batchnorms else None
        # Found once: a padded call reads only their modes.
        self._batchnorms = tuple((name, weakref.ref(m)) for name, m in batchnorms)

    @property
    def module(self) -> nn.Module | None:
        """The graphed module where it has BatchNorm (its mode is checked), else None."""
        return self._module() if self._module is not None else None

    def __call__(self, *args, **kwargs) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        padding = self._padding(leaves)
        if not padding:
            return self.graphed(*args, **kwargs)
        module = self.module
        mixing = _mixing_batchnorm(self._batchnorms)
        if mixing is not None:
            raise ValueError(
                f"cgraph: {type(module).__name__} has BatchNorm in training mode ({mixing!r}, "
                "or one without running statistics), whose statistics mix the rows of a "
                "batch and the positions of a sequence: padded rows or positions would "
                "change the real ones. Call it unpadded (a size in the buckets), or graph "
                "it without buckets.")
        leaves = [_pad(t, padding) if isinstance(t, torch.Tensor) else t for t in leaves]
        args, kwargs = pytree.tree_unflatten(leaves, spec)
        out = self.graphed(*args, **kwargs)
        return pytree.tree_map_only(torch.Tensor, lambda t: _unpad(t, padding), out)

    def _padding(self, leaves: list) -> dict[int, tuple[int, int]]:
        """{dim: (size, bucket)} for the dimensions this call pads."""
        padding = {}
        for dim, sizes in self.buckets.items():
            n = _size_at(leaves, dim)
            k = bisect.bisect_left(sizes, n)
            if n > 0 and k < len(sizes) and sizes[k] != n:  # 0: no last row to copy
                padding[dim] = (n, sizes[k])
        return padding

    def __getattr__(self, name: str):
        return getattr(self.graphed, name)  # stats, num_graphs, pool, reset, ...


def _size_at(leaves: list, dim: int) -> int:
    """The call's size at `dim`: the first tensor's, passing over masks that
    broadcast there (a (B, 1, T, T) mask passed before the hidden states:
    size 1 at a dimension d >= 1 with two more after it); 0 where no tensor
    has `dim`."""
    tensors = [t for t in leaves if isinstance(t, torch.Tensor) and t.dim() > dim]
    if not tensors:
        return 0
    unmasked = (t for t in tensors if not (dim >= 1 and t.shape[dim] == 1 and t.dim() > dim + 2))
    return next(unmasked, tensors[0]).shape[dim]


def _pad(t: torch.Tensor, padding: dict[int, tuple[int, int]]) -> torch.Tensor:
    for dim, (n, bucket) in padding.items():
        if _is_mask(t, dim, n):
            t = _pad_mask(t, n, bucket)
        elif t.dim() > dim and t.shape[dim] == n:
            t = _pad_rows(t, dim, n, bucket)
    return t


def _pad_rows(t: torch.Tensor, dim: int, n: int, bucket: int) -> torch.Tensor:
    """`t` padded at `dim` from `n` to `bucket` rows: Note [What padded rows hold]."""
    shape = list(t.shape)
    shape[dim] = bucket - n
    if dim == 0 or t.is_floating_point() or t.is_complex():
        # Detached: a stand-in value, whose grads are dropped as zeros' were.
        fill = t.narrow(dim, n - 1, 1).detach().expand(shape)
    else:
        fill = t.new_zeros(shape)
    return torch.cat([t, fill], dim)


def _is_mask(t: torch.Tensor, dim: int, n: int) -> bool:
    """Whether `t` is laid out (..., queries, keys) for the `n` positions at
    the bucketed `dim`: Note [Attention masks under sequence buckets]."""
    return (1 <= dim < t.dim() - 2 and t.shape[-1] == n and t.shape[-2] in (n, 1)
            and (t.shape[dim] == 1
                 # one mask per head; as many heads as positions, read as a mask too
                 or (t.dim() == 4 and (t.shape[dim] != n or t.shape[-2] == n))))


def _pad_mask(t: torch.Tensor, n: int, bucket: int) -> torch.Tensor:
    """Mask `t` padded to `bucket` keys, masked, and (unless its queries
    broadcast) to `bucket` queries that attend to every key, so that no
    row is fully masked: Note [Attention masks under sequence buckets]."""
    if t.is_floating_point():
        attend, masked = 0.0, torch.finfo(t.dtype).min  # additive, as transformers'
    else:
        attend, masked = 1, 0  # bool or 0/1 integers
    t = torch.cat([t, t.new_full((*t.shape[:-1], bucket - n), masked)], -1)
    if t.shape[-2] == n:
        t = torch.cat([t, t.new_full((*t.shape[:-2], bucket - n, bucket), attend)], -2)
    return t


def _unpad(t: torch.Tensor, padding: dict[int, tuple[int, int]]) -> torch.Tensor:
    for dim, (n, bucket) in padding.items():
        if _is_mask(t, dim, bucket):  # attention weights, a position bias
            t = t.narrow(-1, 0, n)
            if t.shape[-2] == bucket:
                t = t.narrow(-2, 0, n)
        elif t.dim() > dim and t.shape[dim] == bucket:
            t = t.narrow(dim, 0, n)
    return t


def _batchnorms(module: nn.Module) -> list:
    """(name, module) of each BatchNorm inside `module`."""
    return [(name or type(m).__name__, m) for name, m in module.named_modules()
            if isinstance(m, nn.modules.batchnorm._BatchNorm)]


def _mixing_batchnorm(batchnorms: tuple) -> str | None:
    """The name of one of these BatchNorms (name, weak reference) that
    normalizes with the call's own statistics now (training mode, or no
    running statistics), or None.  Its statistics run over every dimension
    but the channels', so a padded dimension of any bucket changes them;
    each one's mode is read at the call (a root in eval mode may hold one
    in training)."""
    for name, ref in batchnorms:
        m = ref()
        if m is not None and (m.training or not m.track_running_stats):
            return name
    return None

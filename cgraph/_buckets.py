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
padding mask passed positionally to a function must therefore be integer
or bool (as tokenizers return it): a float one there is padded with its
last column, as any float tensor; under a mask keyword a float one is
padded masked (Note [Attention masks under sequence buckets]).  Along the
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
size ``n`` at ``d``" misses them.  Names first, then shape:

- passed under a keyword of ``MASK_KEYWORDS``, or one ending in
  ``key_padding_mask`` (``nn.Transformer``'s ``src_key_padding_mask``,
  anywhere in that keyword's value), ``t`` is a mask when it has 2 or more dimensions and
  ``t.shape[-1] == n``, whatever its rank and its size at ``d``: ``(B, T)``
  key padding, ``(B, 1, T)`` and ``(B, 1, 1, T)`` key masks, ``(B, T, T)``,
  ``(B, 1, T, T)``, ``(B, H, T, T)``.  A 2-D one is read as (batch, keys),
  unless it is ``(n, n)`` beside a batch of another size (the size at
  dimension 0 of the call's first tensor of 2 or more dimensions not under
  a mask keyword, one of size 1 there passed over): then as (queries,
  keys), as ``nn.MultiheadAttention``'s and
  ``F.scaled_dot_product_attention``'s 2-D ``attn_mask``.  Where the batch
  is ``n`` too it is read as (batch, keys);
- passed under a keyword of ``NOT_MASK_KEYWORDS`` (the activations of
  attention: ``hidden_states``, ``query``, ``key_states``, ...), ``t`` is
  not a mask: it is padded at ``d`` like any tensor (a heads-first
  ``(B, H, T, hd)`` query with ``hd == T`` is left as it is);
- passed under any other keyword (T5's ``position_bias=``), or
  positionally to a function (a module's positional arguments are read
  under their names in its forward's signature), ``t`` is a mask by its
  shape alone, when all of:

  - ``d < t.dim() - 2``: the bucketed dimension comes before the last two
    (a ``(B, T, T)`` mask under ``{1: ...}`` has its queries at ``d`` and is
    padded there alone, as any tensor);
  - ``t.shape[-1] == n`` and ``t.shape[-2]`` is ``n`` or 1 (a key-padding
    mask ``(B, 1, 1, T)`` that broadcasts over the queries);
  - ``t.shape[d] == 1`` (broadcast over heads), or ``t`` has 4 dimensions
    and ``t.shape[d] != n`` (one mask per head).

  These keep a weight ``(64, 64)`` passed as an argument at ``T = 64`` (2
  dimensions), a ``(B, T, d)`` activation and a ``(B, T, H, hd)`` one (size
  ``n`` at ``d``) from being read as masks.  A heads-first ``(B, H, T, hd)``
  tensor with ``hd == T`` passed so is misread as one (and, returned at
  the bucket's size, sliced in ``hd`` too).

Why names?  Shape alone cannot tell a per-head mask ``(B, H, T, T)`` from a
heads-first ``(B, H, T, hd)`` tensor at ``hd == T``, nor a ``(B, T, T)`` mask
from a ``(B, T, d)`` activation at ``d == T``; the keyword can, and masks
are passed under these ones (``attention_mask=`` to Hugging Face's layers,
``attn_mask=`` as ``F.scaled_dot_product_attention`` and
``nn.MultiheadAttention`` take it, ``key_padding_mask=`` as
``nn.MultiheadAttention`` and fairseq do, ``mask=`` in gpt-fast).  Outputs
have no names: they are sliced by the positional rule.  Pass a mask of
another keyword with a head dimension.

A decoder layer's cross-attention reads an encoder's sequence, another one
than the bucketed: its states (``encoder_hidden_states``,
``key_value_states``) are padded along the batch only, and its masks and
biases (``encoder_attention_mask``, ``encoder_decoder_position_bias``,
``cross_attention_mask``), laid out ``(..., queries, encoder keys)``, in
their queries too (3 or more dimensions), with copies of the last real
query's row: new queries attend as it does, new keys there are none.

How is a mask padded?  The new key columns are masked, so the real queries'
attention is unchanged, and the new query rows (where ``t.shape[-2] == n``:
never in a 2-D mask but a ``(T, T)`` one read as queries and keys) attend
to every key.  Values as
``F.scaled_dot_product_attention`` and transformers read them: True or a
nonzero integer attends, False or 0 masks, and a float mask is added to the
scores (0.0 attends, the dtype's min masks, as transformers fills them:
``torch.finfo(dtype).min``).  Two exceptions, by name:

- ``key_padding_mask`` (and ``*_key_padding_mask``): True (nonzero) masks,
  as ``nn.MultiheadAttention``, ``nn.Transformer`` and fairseq define it,
  so its new keys are True (1), and a float one is added to the scores at
  any rank (its new keys the dtype's min).
  ``nn.MultiheadAttention``'s bool ``attn_mask`` masks with True too, as
  do ``nn.Transformer``'s ``src_mask`` and ``tgt_mask`` and
  ``nn.TransformerEncoder``'s ``mask``: read so where the
  graphed module is or holds an ``nn.MultiheadAttention`` (``_MHA_MASKS``);
  elsewhere the name cannot tell it from
  ``F.scaled_dot_product_attention``'s (True attends): pass it as a float
  mask, which both add;
- a 2-D float (batch, keys) mask under another name: Hugging Face's 2-D
  ``attention_mask`` is 1.0 attend / 0.0 masked where an additive one is
  0.0 attend / min masked: 0.0 masks in the first and attends in the
  second, and min the reverse (transformers casts a 2-D mask to bool), so
  no one value masks in both.  Its new keys get 0.0 where the mask holds a
  positive value (a 1/0 mask: some key attends), else the dtype's min (an
  additive mask, all zeros included: nothing masked), chosen on the device
  (one reduction and a ``where``, no sync).  An additive mask with a
  positive value (a bias, not a mask) is read as a 1/0 one.

Why must the new queries attend?  A fully masked row is NaN in a
hand-written softmax over -inf (and zeros or a uniform average in others),
and a NaN there would reach the parameter grads through NaN * 0 (Note
[What padded rows hold]); a row that attends to real keys is finite in
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
import inspect
import weakref
from typing import Any, Mapping, NamedTuple, Sequence

import torch
from torch import nn
from torch.utils import _pytree as pytree

from . import _C, _log

# Keywords under which a tensor is an attention mask under sequence buckets,
# whatever its shape (and any ending in _TRUE_MASK); under those of
# NOT_MASK_KEYWORDS it is not one; under others its shape decides: Note
# [Attention masks under sequence buckets].
MASK_KEYWORDS = frozenset({"attention_mask", "attn_mask", "mask", "causal_mask",
                           "key_padding_mask", "src_mask", "tgt_mask"})
NOT_MASK_KEYWORDS = frozenset({"hidden_states", "encoder_hidden_states", "x", "input",
                               "query", "key", "value", "query_states", "key_states",
                               "value_states", "q", "k", "v"})
# An encoder's sequence, handed to a decoder layer's cross-attention: another
# sequence than the bucketed one, whatever its length, so never padded along
# it (padded as the decoder's at the same length, its new keys would be
# attended, no mask covering them).  Along the batch it is padded as any tensor.
_OTHER_SEQUENCE = frozenset({"encoder_hidden_states", "key_value_states", "memory",
                             "memory_key_padding_mask"})
# Its masks and biases, (..., decoder queries, encoder keys): padded along the
# batch, and in their queries only (Note [Attention masks under sequence
# buckets]).
_CROSS_MASKS = frozenset({"encoder_attention_mask", "encoder_decoder_position_bias",
                          "cross_attention_mask", "memory_mask"})
# Either: what an encoder hands a decoder layer.
_ENCODERS = _OTHER_SEQUENCE | _CROSS_MASKS
# Flags by which a call says its attention is causal without a mask.
_CAUSAL_FLAGS = frozenset({"is_causal", "tgt_is_causal"})
# Masks whose True (or nonzero) masks, and whose floats are added to the
# scores at any rank (nn.MultiheadAttention's, nn.Transformer's, fairseq's):
# a keyword ending so.
_TRUE_MASK = "key_padding_mask"
# Keywords under which a module that is or holds an nn.MultiheadAttention
# reads a bool mask with True masking (a float one is added, as every
# convention adds it).
_MHA_MASKS = frozenset({"attn_mask", "src_mask", "tgt_mask", "mask"})


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
    attention mask under sequence buckets (a tensor passed under a keyword
    of ``MASK_KEYWORDS``, or a positional one laid out ``(..., T, T)``) in
    its keys and queries (Note [Attention masks under sequence buckets]),
    and every output with the bucket's size in that same dimension is
    sliced back (an output laid out otherwise, heads before positions, is
    not: return (batch, seq, ...)).  Grads of padded rows are dropped (the
    slice's backward).  A size above the largest bucket is not padded: it
    gets a graph of its own, or runs eagerly past ``max_graphs``.  A tensor
    that broadcasts along a bucketed dimension is padded like the others
    when the call's size there is 1 (Llama's (1, T, d) rotary tables under
    a batch of 1), which costs that call a graph of its own.

    Example (``layer`` a Hugging Face decoder layer, ``mask`` its
    ``(B, 1, T, T)`` attention mask, ``rotary`` its ``(cos, sin)``)::

        graphed = cgraph.make_graphed(layer, buckets={1: [128, 256]})
        out = graphed(hidden, attention_mask=mask, position_embeddings=rotary)
        # T = 100: a replay of the 128 graph, out sliced back to (B, 100, d)
    """

    # __weakref__: a module whose forward it is keeps it weakly (_api._Installed).
    __slots__ = ("graphed", "buckets", "_module", "_batchnorms", "_true_masks",
                 "_bidirectional", "_names", "_label", "_two_sequences", "__weakref__")

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
        # Keywords whose masks mask with True in this module's own forward.
        holds_mha = _holds_mha(module)
        self._true_masks = _MHA_MASKS if holds_mha else frozenset()
        # The module's name where its attention is not causal and none says
        # it is (an encoder's: BERT's; torch's nn.MultiheadAttention, which
        # has no such flag), else None: Note [A padded sequence with no mask].
        self._bidirectional = _bidirectional(module, holds_mha) if module is not None else None
        # The names its positional arguments are read under.
        self._names = _positional_names(module) if module is not None else ()
        self._label = type(module).__name__ if module is not None else "the graphed callable"
        # A forward taking a source and a target sequence (nn.Transformer
        # graphed whole): which tensors are whose, and whose length a call
        # has, the names cannot tell.
        self._two_sequences = {"src", "tgt"} <= set(self._names)

    @property
    def module(self) -> nn.Module | None:
        """The graphed module where it has BatchNorm (its mode is checked), else None."""
        return self._module() if self._module is not None else None

    def __call__(self, *args, **kwargs) -> Any:
        leaves, spec = pytree.tree_flatten((args, kwargs))
        if holds_nested(leaves):
            return self.graphed(*args, **kwargs)  # ragged: no size to pad; runs eagerly
        padding = self._padding(leaves)
        if not padding or _holds_cache(args, kwargs):
            # A call carrying a KV cache (generate()) runs eagerly (Regraph):
            # unpadded, so that the cache keeps real positions only.
            return self.graphed(*args, **kwargs)
        mixing = _mixing_batchnorm(self._batchnorms)
        if mixing is not None:
            raise ValueError(
                f"cgraph: {type(self.module).__name__} has BatchNorm in training mode ({mixing!r}, "
                "or one without running statistics), whose statistics mix the rows of a "
                "batch and the positions of a sequence: padded rows or positions would "
                "change the real ones. Call it unpadded (a size in the buckets), or graph "
                "it without buckets.")
        if any(dim >= 1 for dim in padding):  # names and the batch matter along sequences
            keywords = _keywords(args, kwargs, self._names)
            if self._two_sequences:
                _unpadded(self, _TWO_SEQUENCES)
                return self.graphed(*args, **kwargs)
            if self._bidirectional is not None and not _has_mask(leaves, keywords, padding):
                _unpadded(self, _UNMASKED)
                return self.graphed(*args, **kwargs)  # unpadded: a graph of its own size
            if _encoder_as_long(leaves, keywords, padding):
                _unpadded(self, _ENCODER_AT_BUCKET)
                return self.graphed(*args, **kwargs)
            call = _Call(_batch_of(leaves, keywords), self._true_masks)
        else:
            keywords, call = [None] * len(leaves), _Call(None, self._true_masks)
        padded = [_pad(t, padding, keyword, call) if isinstance(t, torch.Tensor) else t
                  for t, keyword in zip(leaves, keywords)]
        written = _Written.before(leaves, padded)
        args, kwargs = pytree.tree_unflatten(padded, spec)
        out = self.graphed(*args, **kwargs)
        written.back(padding)
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
    first = None  # on every call, at a bucket's size too: one pass, no list
    for t in leaves:
        if isinstance(t, torch.Tensor) and t.dim() > dim:
            if not (dim >= 1 and t.shape[dim] == 1 and t.dim() > dim + 2):
                return t.shape[dim]
            first = t if first is None else first
    return 0 if first is None else first.shape[dim]


# Note [A padded sequence with no mask]
# Q: Why is a call of a module with bidirectional attention not padded along
#    a sequence when it passes no mask?
# A: Nothing would mask the new keys, and every real query attends to every
#    key: the real positions' outputs change.  Hugging Face's encoders
#    (BERT, with sdpa) pass their layers no mask for a batch without padding
#    (an all-ones mask, dropped), which buckets= would have padded unmasked.
#    Causal attention needs no mask (no real query sees a later key), and a
#    mask, where one is passed, masks them (Note [Attention masks under
#    sequence buckets]).  So a module holding attention whose ``is_causal``
#    is False, and none whose is True, runs such a call at its own size (a
#    graph of its own, or eagerly past max_graphs), logged once; other
#    modules are padded as before: a decoder layer's causal self-attention
#    with a cross-attention (BART's, Whisper's) reads the encoder's
#    sequence, which is never padded with the decoder's (_OTHER_SEQUENCE;
#    its masks in their queries only, _CROSS_MASKS).  torch's
#    nn.MultiheadAttention (inside nn.TransformerEncoderLayer) has no
#    is_causal flag and attends both ways unless a mask says otherwise: a
#    module holding one and no attention that says is_causal=True counts as
#    not causal too.
def _bidirectional(module: nn.Module, holds_mha: bool) -> str | None:
    causal = {getattr(m, "is_causal", None) for m in module.modules()}
    bidirectional = (False in causal or holds_mha) and True not in causal
    return type(module).__name__ if bidirectional else None


_TORCH_TRANSFORMERS = (nn.MultiheadAttention, nn.Transformer, nn.TransformerEncoder,
                       nn.TransformerDecoder, nn.TransformerEncoderLayer,
                       nn.TransformerDecoderLayer)


def refuse_sequence_first(module, buckets: dict) -> None:
    """Buckets on dimension 0 of torch's own attention modules built
    sequence first (batch_first=False, their default; inputs (T, B, d)):
    buckets read dimension 0 as the batch, so the sequence would be padded
    as a batch, unmasked.  Raises, naming batch_first=True.  (Buckets on
    their dimension 1, the batch, pad it as one.)"""
    if 0 not in buckets or not isinstance(module, _TORCH_TRANSFORMERS):
        return
    attention = next((m for m in module.modules() if isinstance(m, nn.MultiheadAttention)),
                     None)
    if attention is not None and not attention.batch_first:
        raise ValueError(
            f"cgraph: buckets= on dimension 0 of {type(module).__name__}, built with "
            "batch_first=False (its inputs sequence first): buckets read dimension 0 as the "
            "batch, so its sequence would be padded as a batch, unmasked. Build it with "
            "batch_first=True, or bucket its batch (dimension 1).")


def _holds_mha(module: nn.Module | None) -> bool:
    return module is not None and any(isinstance(m, nn.MultiheadAttention)
                                      for m in module.modules())


def _encoder_as_long(leaves: list, keywords: list, padding: dict) -> bool:
    """Whether an encoder's sequence handed to a decoder layer (its states,
    masks or biases) is as long as a bucket this call pads a sequence to:
    what the layer returns of it (T5's cross-attention bias, (B, H, T, S))
    would then be read as the decoder's and sliced in its keys."""
    sizes = {d: bucket for d, (_, bucket) in padding.items() if d >= 1}
    for t, keyword in zip(leaves, keywords):
        if not isinstance(t, torch.Tensor) or keyword not in _ENCODERS:
            continue
        keys_last = keyword in _CROSS_MASKS or _masks_with_true(keyword)
        for d, bucket in sizes.items():
            at = -1 if keys_last else d
            if t.dim() > max(d, 1) and t.shape[at] == bucket:
                return True
    return False


def _positional_names(module: nn.Module) -> tuple:
    """The names of `module`'s forward's positional parameters, in order
    (a ``*args`` ends them); () where it has no signature to read."""
    try:
        params = inspect.signature(module.forward).parameters.values()
    except (TypeError, ValueError):
        return ()
    names = []
    for p in params:
        if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD):
            break
        names.append(p.name)
    return tuple(names)


def holds_nested(leaves) -> bool:
    """Whether any of a call's pytree `leaves` is a nested tensor
    (nn.TransformerEncoder's fast path makes one in evaluation), whose
    ragged shape no graph takes: such a call runs eagerly (Regraph in
    cgraph/_regraph.py)."""
    return any(isinstance(t, torch.Tensor) and t.is_nested for t in leaves)


def _holds_cache(args: tuple, kwargs: dict) -> bool:
    from ._describe import holds_cache  # which imports this module
    return holds_cache((args, kwargs))

def _has_mask(leaves: list, keywords: list, padding: dict) -> bool:
    """Whether a call padded along a sequence (`padding` beyond dimension
    0) passes an attention mask for it; True when it pads the batch only."""
    sequences = [(d, n) for d, (n, _) in padding.items() if d >= 1]
    if any(keyword in _CAUSAL_FLAGS and t is True for t, keyword in zip(leaves, keywords)):
        return True  # causal attention: no real query sees a new key
    return not sequences or any(
        isinstance(t, torch.Tensor) and keyword not in _OTHER_SEQUENCE
        and keyword not in _CROSS_MASKS and _is_mask(t, d, n, keyword)
        for t, keyword in zip(leaves, keywords) for d, n in sequences)


# Why a padded call ran at its own size instead, for the log (once per
# graphed callable and reason).
_UNMASKED = ("no attention mask", "its attention is not causal, so nothing would mask the "
             "new positions (Note [A padded sequence with no mask] in cgraph/_buckets.py). "
             "Pass a mask, or set is_causal = True on its attention module if it is causal, "
             "to pad such calls")
_TWO_SEQUENCES = ("a source and a target sequence", "which tensors belong to which "
                  "sequence, and so how to pad and mask them, cannot be told from their names; "
                  "graph the encoder and the decoder apart")
_ENCODER_AT_BUCKET = ("an encoder sequence as long as the bucket", "what it returns of the "
                      "encoder's sequence would be read as its own and sliced (Note "
                      "[Attention masks under sequence buckets] in cgraph/_buckets.py)")
_told: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _unpadded(bucketed: "Bucketed", why: tuple[str, str]) -> None:
    told = _told.setdefault(bucketed, set())
    if why not in told:
        told.add(why)
        _log.log.info("cgraph: a call of %s with %s is not padded to a bucket: %s; logged "
                      "once.", bucketed._label, *why)


def _batch_of(leaves: list, keywords: list) -> int | None:
    """A padded call's batch, its size at dimension 0, for telling a (T, T)
    mask from a (batch, keys) one: that of its first tensor of 2 or more
    dimensions that is not under a mask keyword, passing over those of size
    1 there (a (1, T) position table); None where there is none."""
    sizes = [t.shape[0] for t, keyword in zip(leaves, keywords)
             if isinstance(t, torch.Tensor) and t.dim() >= 2 and not _named_mask(keyword)]
    return next((b for b in sizes if b != 1), sizes[0] if sizes else None)


def _keywords(args: tuple, kwargs: dict, names: tuple) -> list[str | None]:
    """The keyword each leaf of a call was passed under, in the order
    pytree flattens ``(args, kwargs)``: the arguments' leaves, then each
    keyword's value's, in the dict's order.  A leaf passed positionally
    (a tensor, a flag) is read under its parameter's name in `names`; a leaf
    inside a positional container (``forward(self, x)`` with ``h, mask =
    x``), or past `names`, under none (None).  Read only for padded
    calls."""
    named = [*(names[i] if i < len(names) else None for i in range(len(args))), *kwargs]
    keywords = []
    for k, (name, v) in enumerate(zip(named, (*args, *kwargs.values()))):
        leaves = (v,) if isinstance(v, torch.Tensor) else pytree.tree_leaves(v)
        alone = len(leaves) == 1 and leaves[0] is v  # a tensor or a flag: no container
        keywords += [name if alone or k >= len(args) else None] * len(leaves)
    return keywords


class _Padded(NamedTuple):
    """A tensor of a padded call, its padded copy, and the copy's version
    before the call."""

    passed: torch.Tensor
    copy: torch.Tensor
    version: int


class _Written(NamedTuple):
    """The padded copies of a call's tensors: an argument the callable
    writes in place (a cache) is written in its padded copy, by eager code
    or by a replay's copy back (Note [Arguments written in place] in
    csrc/aten_replay.cpp), and its real rows go back into the tensor passed.
    An inference tensor has no version to read: its writes are not seen (as
    in the native core)."""

    copies: list[_Padded]

    @classmethod
    def before(cls, leaves: list, padded: list) -> "_Written":
        return cls([_Padded(t, p, p._version) for t, p in zip(leaves, padded)
                    if isinstance(t, torch.Tensor) and p is not t and not p.is_inference()])

    def back(self, padding: dict[int, tuple[int, int]]) -> None:
        for padded in self.copies:
            if padded.copy._version == padded.version:
                continue
            real = _unpad(padded.copy, padding)
            if real.shape != padded.passed.shape:
                # Read as a mask, whose new queries _unpad cuts along keys
                # only where their shape says so: not one eager writes.
                _log.log.warning("cgraph: a padded argument of shape %s was written in "
                                 "place, but its real rows could not be told apart; it is "
                                 "not copied back", tuple(padded.passed.shape))
                continue
            with torch.no_grad():
                padded.passed.copy_(real)


class _Call(NamedTuple):
    """How a padded call's masks are read: its batch (_batch_of), and the
    keywords whose masks mask with True in the graphed module (_MHA_MASKS)."""

    batch: int | None
    true_masks: frozenset


def _pad(t: torch.Tensor, padding: dict[int, tuple[int, int]], keyword: str | None,
         call: _Call) -> torch.Tensor:
    """`t`, passed under `keyword` (None: positionally to a function) in
    `call`, padded for every dimension of `padding`."""
    for dim, (n, bucket) in padding.items():
        if dim >= 1 and keyword in _OTHER_SEQUENCE:
            continue
        if dim >= 1 and keyword in _CROSS_MASKS:
            # (..., queries, encoder keys); nn.Transformer's memory_mask is (T, S).
            if (t.dim() >= 3 or keyword == "memory_mask") and t.shape[-2] == n:
                t = _last_rows(t, t.dim() - 2, n, bucket)
            continue
        if _is_mask(t, dim, n, keyword):
            # (T, T) beside a batch of another size: queries and keys.
            square = t.dim() == 2 and t.shape[0] == n and call.batch != n
            true = _masks_with_true(keyword) or keyword in call.true_masks
            t = _pad_mask(t, n, bucket, true, square)
        elif t.dim() > dim and t.shape[dim] == n:
            t = _pad_rows(t, dim, n, bucket)
    return t


def _pad_rows(t: torch.Tensor, dim: int, n: int, bucket: int) -> torch.Tensor:
    """`t` padded at `dim` from `n` to `bucket` rows: Note [What padded rows hold]."""
    if dim == 0 or t.is_floating_point() or t.is_complex():
        return _last_rows(t, dim, n, bucket)
    shape = list(t.shape)
    shape[dim] = bucket - n
    return torch.cat([t, t.new_zeros(shape)], dim)


def _last_rows(t: torch.Tensor, dim: int, n: int, bucket: int) -> torch.Tensor:
    """`t` padded at `dim` from `n` to `bucket` rows with copies of its last
    real row."""
    shape = list(t.shape)
    shape[dim] = bucket - n
    # Detached: a stand-in value, whose grads are dropped as zeros' were.
    return torch.cat([t, t.narrow(dim, n - 1, 1).detach().expand(shape)], dim)


def _is_mask(t: torch.Tensor, dim: int, n: int, keyword: str | None = None) -> bool:
    """Whether `t`, passed under `keyword` (None: positionally, or an
    output), is an attention mask (..., queries, keys) for the `n` positions
    at the bucketed `dim`: by name, else by shape (Note [Attention masks
    under sequence buckets])."""
    if _named_mask(keyword):
        return dim >= 1 and t.dim() >= 2 and t.shape[-1] == n
    if keyword in NOT_MASK_KEYWORDS:
        return False
    return (1 <= dim < t.dim() - 2 and t.shape[-1] == n and t.shape[-2] in (n, 1)
            and (t.shape[dim] == 1
                 # one mask per head; as many heads as positions, read as a mask too
                 or (t.dim() == 4 and (t.shape[dim] != n or t.shape[-2] == n))))


def _named_mask(keyword: str | None) -> bool:
    """Whether a tensor passed under `keyword` is a mask by its name."""
    return keyword in MASK_KEYWORDS or _masks_with_true(keyword)


def _masks_with_true(keyword: str | None) -> bool:
    return keyword is not None and keyword.endswith(_TRUE_MASK)


def _pad_mask(t: torch.Tensor, n: int, bucket: int, true: bool,
              square: bool) -> torch.Tensor:
    """Mask `t` (whose True masks, if `true`) padded to `bucket` keys,
    masked, and (where it is 3-D or more, or `square`: (queries, keys), and
    its queries do not broadcast) to `bucket` queries that attend to every
    key, so that no row is fully masked: Note [Attention masks under
    sequence buckets]."""
    if t.is_floating_point() and t.dim() == 2 and not (square or true):
        return _pad_keys(t, n, bucket, _float_key_mask_masked(t))
    if t.is_floating_point():
        attend, masked = 0.0, torch.finfo(t.dtype).min  # additive, as transformers'
    elif true:
        attend, masked = 0, 1  # True masks: nn.MultiheadAttention's key_padding_mask
    else:
        attend, masked = 1, 0  # bool or 0/1 integers, True attends
    t = _pad_keys(t, n, bucket, t.new_full((), masked))
    if (t.dim() > 2 or square) and t.shape[-2] == n:
        t = torch.cat([t, t.new_full((*t.shape[:-2], bucket - n, bucket), attend)], -2)
    return t


def _pad_keys(t: torch.Tensor, n: int, bucket: int, masked: torch.Tensor) -> torch.Tensor:
    """`t` with `bucket - n` new keys (last dimension) of the value `masked` (0-D)."""
    return torch.cat([t, masked.expand(*t.shape[:-1], bucket - n)], -1)


def _float_key_mask_masked(t: torch.Tensor) -> torch.Tensor:
    """The value that masks a key in `t`, a 2-D float mask (batch, keys)
    under a mask keyword, as a 0-D tensor on its device, read there (no
    sync): Hugging Face's 1.0-attends / 0.0-masks mask holds a positive
    value (a row attends somewhere); an additive one (0.0 attends, negative
    masks) holds none, all zeros included (nothing masked).  An empty one
    (a batch of 0) has no value to read: its new keys are empty too."""
    masked = t.new_full((), torch.finfo(t.dtype).min)
    return masked if t.numel() == 0 else torch.where(t.amax() > 0, t.new_zeros(()), masked)


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

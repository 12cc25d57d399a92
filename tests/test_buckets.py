"""What padding to buckets puts in the padded rows (cgraph/_buckets.py,
Note [What padded rows hold] and Note [Attention masks under sequence
buckets]).  The CPU tests stand a plain callable in for the graphed one
(Bucketed only calls it) and compare against the unpadded eager call:
padding changes the sizes of the reductions (a softmax over 16 keys, a
matmul over more rows), so results are held to torch.testing.assert_close's
float32 tolerances (rtol 1.3e-6, atol 1e-5) unless another is stated
(bitwise, or LAYER_TOLERANCE for a Hugging Face decoder layer).  The GPU
tests graph that layer for real."""

import copy
import logging

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from cgraph._buckets import MASK_KEYWORDS, Bucketed, _is_mask, normalize


def bucketed(fn, buckets):
    """`fn` padded to `buckets`, as make_graphed(..., buckets=) pads its graphs."""
    return Bucketed(fn, normalize(buckets), None)


class Recorder:
    """A stand-in for a graphed callable: keeps the arguments it was called
    with and returns the positional ones."""

    def __init__(self):
        self.args = self.kwargs = None

    def __call__(self, *args, **kwargs):
        self.args, self.kwargs = args, kwargs
        return args


def padding_mask(lengths, length):
    """A (B, 1, T, T) bool mask, True = attend: causal, keys past each
    row's length masked (right padding, as a batch of sentences has)."""
    keys = torch.arange(length)[None, :] < torch.tensor(lengths)[:, None]
    causal = torch.ones(length, length, dtype=torch.bool).tril()
    return causal[None, None] & keys[:, None, None, :]


def additive(mask, dtype=torch.float32):
    """A bool mask as transformers' eager attention takes it: 0 attends,
    the dtype's min masks."""
    return torch.where(mask, torch.zeros((), dtype=dtype), torch.finfo(dtype).min)


# ---- what the padded rows of ordinary tensors hold -------------------------------


def test_an_argument_written_in_place_gets_its_real_rows_back():
    """A cache filled in place in a padded call is written in its padded
    copy (by eager code, or by a replay's copy back): its real rows go
    back into the tensor passed, as the unpadded eager call leaves them."""
    def fill(x, cache):
        cache.add_(x.sum(-1, keepdim=True))
        return x * 2

    x, cache = torch.randn(3, 5, 4), torch.zeros(3, 5, 1)
    expected = cache + x.sum(-1, keepdim=True)
    out = bucketed(fill, {1: [8]})(x, cache)
    assert out.shape == x.shape and torch.equal(cache, expected)
    untouched = torch.zeros(3, 5, 1)
    bucketed(lambda x, cache: x * 2, {1: [8]})(x, untouched)
    assert torch.equal(untouched, torch.zeros(3, 5, 1))



def test_floats_are_padded_with_their_last_row_ints_and_bools_with_zeros():
    torch.manual_seed(0)
    hidden, ids = torch.randn(2, 5, 4), torch.randint(1, 9, (2, 5))
    keep = torch.ones(2, 5, dtype=torch.bool)
    recorder = Recorder()
    out = bucketed(recorder, {1: [8]})(hidden, ids, keep)
    padded_hidden, padded_ids, padded_keep = recorder.args
    assert padded_hidden.shape == (2, 8, 4) and padded_ids.shape == (2, 8)
    assert torch.equal(padded_hidden[:, :5], hidden)
    assert torch.equal(padded_hidden[:, 5:], hidden[:, 4:5].expand(2, 3, 4))
    assert torch.equal(padded_ids, torch.cat([ids, torch.zeros(2, 3, dtype=ids.dtype)], 1))
    assert torch.equal(padded_keep[:, 5:], torch.zeros(2, 3, dtype=torch.bool))
    # Outputs are sliced back, bitwise the arguments.
    for o, arg in zip(out, (hidden, ids, keep)):
        assert torch.equal(o, arg)


def test_batch_padding_copies_the_last_row_of_every_dtype_and_a_call_of_size_zero_is_not_padded():
    """Along the batch, integers and bools too: a padded row holds a real
    row's tokens and mask (zeros would mask all of its keys).  A call of
    size 0 has no row to copy and is left as it is (its own graph), where
    zeros would be NaN through a norm."""
    x = torch.arange(6.0).view(3, 2)
    mask = torch.tensor([[1, 1], [1, 0], [1, 1]])
    recorder = Recorder()
    bucketed(recorder, [4])(x, mask, mask.bool())
    assert torch.equal(recorder.args[0], torch.tensor([[0., 1.], [2., 3.], [4., 5.], [4., 5.]]))
    assert torch.equal(recorder.args[1], torch.tensor([[1, 1], [1, 0], [1, 1], [1, 1]]))
    assert torch.equal(recorder.args[2], recorder.args[1].bool())
    bucketed(recorder, [4])(torch.empty(0, 2))
    assert recorder.args[0].shape == (0, 2)


def test_a_mask_passed_before_the_hidden_states_does_not_set_the_length():
    """The call's length is read from a tensor that does not broadcast at the
    bucketed dimension: a (B, 1, T, T) mask passed first has 1 there."""
    mask, hidden = padding_mask([5, 3], 5), torch.randn(2, 5, 3)
    recorder = Recorder()
    bucketed(recorder, {1: [8]})(mask, hidden)
    assert recorder.args[0].shape == (2, 1, 8, 8) and recorder.args[1].shape == (2, 8, 3)


def test_attention_weights_with_as_many_heads_as_positions_are_sliced_in_their_positions():
    """(B, H, T', T') weights with H equal to the bucket (or a mask with H
    equal to the length) are read as laid out (..., queries, keys), not cut
    along their heads."""
    out = bucketed(lambda h, m: (h, torch.zeros(2, 8, 8, 8)), {1: [8]})(
        torch.randn(2, 5, 3), torch.ones(2, 5, 5, 5, dtype=torch.bool))
    assert out[0].shape == (2, 5, 3) and out[1].shape == (2, 8, 5, 5)
    recorder = Recorder()
    bucketed(recorder, {1: [8]})(torch.randn(2, 5, 3), torch.ones(2, 5, 5, 5, dtype=torch.bool))
    assert recorder.args[1].shape == (2, 5, 8, 8)


def test_a_bucketed_module_is_not_kept_alive_through_its_forward():
    """graph_layers sets a block's forward to its Bucketed, which knows the
    block (its BatchNorm's mode): weakly, so the block, and with it its
    graphs, goes when dropped, with the collector off."""
    import weakref

    from _helpers import collector_off
    block = nn.Sequential(nn.Linear(2, 2), nn.BatchNorm1d(2))
    block.forward = Bucketed(Recorder(), normalize([4]), block)
    assert block.forward.module is block
    gone = weakref.ref(block)
    with collector_off():
        del block
        assert gone() is None


def test_grads_of_padded_rows_are_dropped_not_added_to_the_last_row():
    """A callable that sums its rows, so the padded rows get grads (3 each,
    one from each real output row): they stay out of x's grad."""
    x = torch.randn(3, 2, requires_grad=True)
    out = bucketed(lambda t: t.sum(0, keepdim=True).expand(t.shape), [4])(x)
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((3, 2), 3.0))  # bitwise: the last row's is not 6


@pytest.mark.parametrize("buckets", [[8], {1: [8]}])
def test_a_norm_that_is_nan_at_zero_gets_finite_parameter_grads_as_eager(buckets):
    """x / x.norm() after a Linear without bias: a zero row is 0/0 there,
    and NaN * 0 would reach the weight's grad.  Rows of the last real row
    keep it finite: eager's grad."""
    torch.manual_seed(1)
    linear = nn.Linear(4, 4, bias=False)
    eager = copy.deepcopy(linear)

    def normalized(model):
        def forward(x):
            h = model(x)
            return h / h.norm(dim=-1, keepdim=True)
        return forward

    x, upstream = torch.randn(5, 3, 4), torch.randn(5, 3, 4)
    (bucketed(normalized(linear), buckets)(x) * upstream).sum().backward()
    (normalized(eager)(x) * upstream).sum().backward()
    assert linear.weight.grad.isfinite().all()
    torch.testing.assert_close(linear.weight.grad, eager.weight.grad)


# ---- attention masks under sequence buckets --------------------------------------


def attention(q, k, v, mask):
    """Attention by hand, the way eager implementations write it: a bool
    mask through masked_fill(-inf), whose fully masked rows are NaN."""
    scores = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, float("-inf"))
    elif mask.is_floating_point():
        scores = scores + mask
    else:
        scores = scores.masked_fill(mask == 0, float("-inf"))
    weights = scores.softmax(-1)
    return weights @ v, weights


def heads(x):
    """(B, T, 8) as two heads (B, 2, T, 4), heads before positions as
    attention takes them."""
    return x.view(x.shape[0], x.shape[1], 2, 4).transpose(1, 2)


def layer(x, mask):
    """A stand-in for a layer: positions-first in and out, attention
    weights heads-first out."""
    y, weights = attention(heads(x), heads(x * 0.5), heads(x + 1), mask)
    return y.transpose(1, 2).reshape(x.shape), weights


@pytest.mark.parametrize("kind", ["bool", "float", "long", "keys only"])
def test_an_attention_mask_is_padded_with_keys_masked_and_queries_attending_everything(kind):
    torch.manual_seed(2)
    mask = padding_mask([11, 7], 11)
    if kind == "float":
        mask = additive(mask)
    elif kind == "long":
        mask = mask.long()
    elif kind == "keys only":  # (B, 1, 1, T): masks keys, broadcasts over queries
        mask = mask[:, :, -1:, :]
    masked, attend = {torch.bool: (False, True), torch.float32: (torch.finfo().min, 0.0),
                      torch.long: (0, 1)}[mask.dtype]
    recorder = Recorder()
    bucketed(recorder, {1: [16, 32]})(torch.randn(2, 11, 8), mask)
    padded = recorder.args[1]
    assert padded.dtype == mask.dtype
    assert padded.shape == (2, 1, mask.shape[2] if kind == "keys only" else 16, 16)
    assert torch.equal(padded[..., :mask.shape[2], :11], mask)
    assert (padded[..., :mask.shape[2], 11:] == masked).all()
    assert (padded[..., mask.shape[2]:, :] == attend).all()


@pytest.mark.parametrize("kind", ["bool", "float", "keys only"])
def test_attention_on_a_padded_mask_keeps_real_rows_and_finite_padded_ones(kind):
    """Real queries as unpadded (the padded keys are masked for them), the
    padded queries finite (they attend to every key, where a fully masked
    row would be NaN through masked_fill(-inf)), the attention weights
    (B, H, T', T') sliced back in both last dimensions."""
    torch.manual_seed(3)
    mask = padding_mask([11, 7], 11)
    if kind == "float":
        mask = additive(mask)
    elif kind == "keys only":
        mask = mask[:, :, -1:, :]
    x = torch.randn(2, 11, 8)
    seen = {}

    def spy(x, mask):
        seen["out"] = layer(x, mask)
        return seen["out"]

    out, weights = bucketed(spy, {1: [16, 32]})(x, mask)
    out_e, weights_e = layer(x, mask)
    assert out.shape == out_e.shape and weights.shape == weights_e.shape == (2, 2, 11, 11)
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(weights, weights_e)
    assert all(t.isfinite().all() for t in seen["out"]), "padded rows are not finite"


def test_padded_attention_trains_as_eager():
    """A Linear before attention under a (B, 1, T, T) bool mask: the
    parameter grads equal eager's and are finite."""
    torch.manual_seed(4)
    linear = nn.Linear(8, 8)
    eager = copy.deepcopy(linear)
    mask = padding_mask([20, 13], 20)
    x, upstream = torch.randn(2, 20, 8), torch.randn(2, 20, 8)
    for model, call in ((linear, bucketed(layer, {1: [16, 32]})), (eager, layer)):
        (call(model(x), mask)[0] * upstream).sum().backward()
    for p, q in zip(linear.parameters(), eager.parameters()):
        assert p.grad.isfinite().all()
        torch.testing.assert_close(p.grad, q.grad)


def test_tensors_that_merely_have_the_length_are_not_read_as_masks():
    t = 64
    for shape in [(64, 64),          # a weight passed as an argument: 2 dimensions
                  (2, 64, 64),       # (B, T, T): the bucketed dimension is the queries'
                  (2, 64, 4, 64),    # (B, T, H, hd): the length at the bucketed dimension
                  (2, 64, 1, 64),    # (B, T, 1, hd)
                  (2, 3, 64, 16),    # (B, H, T, hd)
                  (2, 3, 5, 64, 64)]:  # 5 dimensions, 3 heads at the bucketed dimension
        assert not _is_mask(torch.empty(shape), 1, t), shape
    for shape in [(2, 1, 64, 64), (2, 4, 64, 64), (1, 1, 64, 64), (2, 1, 1, 64), (2, 64, 64, 64),
                  (2, 1, 3, 64, 64)]:
        assert _is_mask(torch.empty(shape), 1, t), shape
    assert not _is_mask(torch.empty(2, 1, 64, 64), 0, t)  # batch buckets: no mask rule


# ---- masks recognised by the keyword they are passed under ----------------------


def test_the_keyword_decides_before_the_shape():
    """Under a mask keyword any tensor of 2 or more dimensions whose last
    is the length; under an activation's keyword none; under another
    keyword (T5's position_bias=), positionally and for outputs, the shape
    rule."""
    assert {"attention_mask", "attn_mask", "mask", "causal_mask", "key_padding_mask",
            "src_mask", "tgt_mask"} == MASK_KEYWORDS
    for shape in [(2, 64), (2, 1, 64), (2, 64, 64), (2, 1, 64, 64), (2, 3, 64, 64)]:
        assert _is_mask(torch.empty(shape), 1, 64, "mask"), shape
    for shape in [(64,), (2, 64, 3), (2, 1, 64, 3)]:
        assert not _is_mask(torch.empty(shape), 1, 64, "attention_mask"), shape
    heads_first = torch.empty(2, 3, 64, 64)  # (B, H, T, hd) at hd == T
    assert not _is_mask(heads_first, 1, 64, "hidden_states")
    assert _is_mask(heads_first, 1, 64)  # positionally, by shape: misread
    assert not _is_mask(torch.empty(2, 1, 64, 64), 0, 64, "mask")  # batch buckets: no mask rule
    bias = torch.empty(1, 4, 64, 64)  # T5's position bias, passed by keyword
    assert _is_mask(bias, 1, 64, "position_bias") and not _is_mask(bias, 1, 64, "query")
    assert _is_mask(torch.empty(2, 64), 1, 64, "src_key_padding_mask")  # nn.Transformer's


def test_key_padding_masks_of_nn_transformer_mask_their_new_keys_with_true():
    """nn.Transformer's src_/tgt_/memory_key_padding_mask mask with True, as
    nn.MultiheadAttention's key_padding_mask: their new keys are True."""
    mask = torch.zeros(2, 11, dtype=torch.bool)
    recorder = Recorder()
    bucketed(recorder, {1: [16]})(torch.randn(2, 11, 8), src_key_padding_mask=mask)
    padded = recorder.kwargs["src_key_padding_mask"]
    assert padded.shape == (2, 16) and not padded[:, :11].any() and padded[:, 11:].all()


@pytest.mark.parametrize("dtype", [torch.bool, torch.float32])
def test_a_mask_without_a_head_dimension_is_padded_as_one_under_its_keyword(dtype):
    """A (B, T, T) mask under mask=, after a tuple and a None of other
    keywords: its new keys masked and its new queries attending to every
    key, as a (B, 1, T, T) one's.  By shape its queries are at the
    bucketed dimension: padded there alone, its keys left at 11."""
    mask = padding_mask([11, 7], 11)[:, 0]
    if dtype == torch.float32:
        mask = additive(mask)
    masked, attend = (False, True) if dtype == torch.bool else (torch.finfo().min, 0.0)
    rotary = (torch.randn(1, 11, 4), torch.randn(1, 11, 4))
    recorder = Recorder()
    bucketed(recorder, {1: [16, 32]})(torch.randn(2, 11, 8), position_embeddings=rotary,
                                      past_key_values=None, mask=mask)
    padded = recorder.kwargs["mask"]
    assert padded.dtype == dtype and padded.shape == (2, 16, 16)
    assert torch.equal(padded[:, :11, :11], mask)
    assert (padded[:, :11, 11:] == masked).all() and (padded[:, 11:, :] == attend).all()
    assert [t.shape for t in recorder.kwargs["position_embeddings"]] == [(1, 16, 4)] * 2


def block(linear):
    """A Linear, then attention under a (B, T, T) mask passed as mask=."""
    def forward(x, mask=None):
        return layer(linear(x), mask[:, None])  # one mask for both heads
    return forward


@pytest.mark.parametrize("kind", ["bool", "float"])
def test_attention_under_a_keyword_mask_without_heads_trains_as_eager(kind):
    """Output, attention weights (sliced back in both positions) and the
    Linear's grads as the unpadded eager call's; the padded queries' rows
    finite."""
    torch.manual_seed(6)
    linear = nn.Linear(8, 8)
    eager = copy.deepcopy(linear)
    mask = padding_mask([20, 13], 20)[:, 0]
    if kind == "float":
        mask = additive(mask)
    x, upstream = torch.randn(2, 20, 8), torch.randn(2, 20, 8)
    seen = {}

    def spy(x, mask=None):
        seen["out"] = block(linear)(x, mask=mask)
        return seen["out"]

    out, weights = bucketed(spy, {1: [16, 32]})(x, mask=mask)
    out_e, weights_e = block(eager)(x, mask=mask)
    assert seen["out"][0].shape == (2, 32, 8) and weights.shape == weights_e.shape
    assert all(t.isfinite().all() for t in seen["out"]), "padded rows are not finite"
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(weights, weights_e)
    (out * upstream).sum().backward()
    (out_e * upstream).sum().backward()
    for p, q in zip(linear.parameters(), eager.parameters()):
        assert p.grad.isfinite().all()
        torch.testing.assert_close(p.grad, q.grad)


def test_key_masks_under_their_keywords_pad_their_keys_masked_in_their_convention():
    """(B, T) and (B, 1, T) masks, a batch of 5 at a length of 5: only the
    keys padded (the batch is not read as queries), masked as each keyword
    means it: False or 0 where True attends, True under key_padding_mask
    (nn.MultiheadAttention's: True masks), whose float is added to the
    scores (the dtype's min masks).  A 2-D float under another keyword masks
    its new keys in its own convention, told on the device (Note [Attention
    masks under sequence buckets]): 0.0 in a 1/0 mask, min in an additive
    one."""
    keep = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]]).repeat(3, 1)[:5]
    masks = {"attention_mask": keep.bool(), "attn_mask": keep[:, None],
             "key_padding_mask": ~keep.bool(), "causal_mask": additive(keep.bool()),
             "mask": keep.float()}
    recorder = Recorder()
    bucketed(recorder, {1: [8]})(torch.randn(5, 5, 4), **masks)
    for name, row_0, row_1 in [("attention_mask", False, False), ("attn_mask", 0, 0),
                               ("key_padding_mask", True, True),
                               ("causal_mask", torch.finfo().min, torch.finfo().min),
                               ("mask", 0.0, 0.0)]:
        mask, padded = masks[name], recorder.kwargs[name]
        assert padded.shape == (*mask.shape[:-1], 8), name
        assert torch.equal(padded[..., :5], mask), name
        assert (padded[0, ..., 5:] == row_0).all() and (padded[1, ..., 5:] == row_1).all(), name
    float_keys = additive(keep.bool())  # a float key_padding_mask is added: min masks
    bucketed(recorder, {1: [8]})(torch.randn(5, 5, 4), key_padding_mask=float_keys)
    assert (recorder.kwargs["key_padding_mask"][:, 5:] == torch.finfo().min).all()


@pytest.mark.parametrize("convention", ["1/0", "additive", "additive, nothing masked"])
def test_a_2d_float_mask_under_a_mask_keyword_keeps_bidirectional_attention_exact(convention):
    """Hugging Face's 2-D float attention_mask (1.0 attends) and an additive
    one (0.0 attends), under bidirectional attention, where every real
    query sees every key: the new keys are masked in each convention, so
    the real outputs and weights are eager's.  An all-zeros additive mask
    masks nothing, and its new keys get min too.  Copying the last column
    (before) let row 0 attend to them."""
    torch.manual_seed(5)
    lengths = [11, 11] if convention == "additive, nothing masked" else [11, 7]
    keep = torch.arange(11)[None, :] < torch.tensor(lengths)[:, None]
    mask = keep.float() if convention == "1/0" else additive(keep)

    def bidirectional(x, attention_mask):
        m = attention_mask.bool() if convention == "1/0" else attention_mask
        return layer(x, m[:, None, None, :])

    x = torch.randn(2, 11, 8)
    out, weights = bucketed(bidirectional, {1: [16]})(x, attention_mask=mask)
    out_e, weights_e = bidirectional(x, mask)
    torch.testing.assert_close(out, out_e)
    torch.testing.assert_close(weights, weights_e)


def test_a_square_mask_under_a_mask_keyword_pads_queries_and_keys_beside_another_batch():
    """A (T, T) attn_mask, as F.scaled_dot_product_attention and
    nn.MultiheadAttention take it: beside a batch of 2 it is (queries,
    keys), padded in both, and the real outputs are eager's; beside a batch
    of T it is read as (batch, keys), its keys padded only."""
    torch.manual_seed(6)
    causal = torch.ones(11, 11, dtype=torch.bool).tril()

    def sdpa(x, attn_mask):
        q = heads(x)
        y = F.scaled_dot_product_attention(q, q * 0.5, q + 1, attn_mask=attn_mask)
        return y.transpose(1, 2).reshape(x.shape)

    x = torch.randn(2, 11, 8)
    torch.testing.assert_close(bucketed(sdpa, {1: [16]})(x, attn_mask=causal), sdpa(x, causal))
    recorder = Recorder()
    bucketed(recorder, {1: [16]})(torch.randn(2, 11, 8), attn_mask=causal)
    padded = recorder.kwargs["attn_mask"]
    assert padded.shape == (16, 16) and torch.equal(padded[:11, :11], causal)
    assert not padded[:11, 11:].any() and padded[11:].all()
    bucketed(recorder, {1: [16]})(torch.randn(11, 11, 8), attn_mask=causal)
    assert recorder.kwargs["attn_mask"].shape == (11, 16)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float16, torch.bfloat16])
def test_a_2d_float_mask_keeps_its_dtype_s_own_masking_value_and_an_empty_one_pads(dtype):
    """The masking value is made in the mask's dtype (float64's min does
    not fit a float32); a batch of 0 has no value to read, and pads."""
    recorder = Recorder()
    keep = torch.tensor([[1, 1, 1, 0, 0]]).bool()
    bucketed(recorder, {1: [8]})(torch.randn(1, 5, 4), attention_mask=additive(keep, dtype))
    padded = recorder.kwargs["attention_mask"]
    assert padded.dtype == dtype and (padded[:, 5:] == torch.finfo(dtype).min).all()
    bucketed(recorder, {1: [8]})(torch.randn(0, 5, 4), attention_mask=torch.ones(0, 5, dtype=dtype))
    assert recorder.kwargs["attention_mask"].shape == (0, 8)


def test_multihead_attention_graphed_itself_reads_its_bool_attn_mask_with_true_masking():
    """nn.MultiheadAttention's bool attn_mask masks with True, the other way
    round from F.scaled_dot_product_attention's: where the graphed module
    is one, its (T, T) causal mask's new keys are True (masked), and the
    real outputs are eager's."""
    torch.manual_seed(8)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    x = torch.randn(2, 11, 8)
    future = torch.ones(11, 11, dtype=torch.bool).triu(1)  # True: not allowed to attend

    def forward(query, key, value, attn_mask):
        return mha(query, key, value, attn_mask=attn_mask, need_weights=False)[0]

    out = Bucketed(forward, normalize({1: [16]}), mha)(x, x, x, attn_mask=future)
    torch.testing.assert_close(out, forward(x, x, x, future))


def test_the_batch_beside_a_square_mask_is_read_past_masks_and_broadcast_tables():
    """The batch that tells a (T, T) mask from a (batch, keys) one: not the
    mask's own rows when it comes first, not a (1, T) position table's."""
    causal = torch.ones(5, 5, dtype=torch.bool).tril()
    recorder = Recorder()
    bucketed(recorder, {1: [8]})(attn_mask=causal, x=torch.randn(2, 5, 4))
    assert recorder.kwargs["attn_mask"].shape == (8, 8)
    keep = torch.ones(5, 5, dtype=torch.bool)  # a (batch, keys) mask, batch 5
    bucketed(recorder, {1: [8]})(torch.arange(5)[None], torch.randn(5, 5, 4), attention_mask=keep)
    assert recorder.kwargs["attention_mask"].shape == (5, 8)


@pytest.mark.parametrize("causal", [False, True])
def test_a_call_with_no_mask_is_padded_only_where_attention_is_causal(causal, caplog):
    """Note [A padded sequence with no mask]: BERT's layers get no mask for
    a batch without padding; padded, every real query would attend to the
    new keys.  A module whose attention says is_causal=False runs such a
    call unpadded (logged once), and pads it when a mask comes; a causal
    one pads either way."""
    class Attention(nn.Module):
        is_causal = causal

    class Layer(nn.Module):
        def __init__(self):
            super().__init__()
            self.attention = Attention()

    recorder = Recorder()
    layer = Bucketed(recorder, normalize({1: [16]}), Layer())
    x = torch.randn(2, 11, 8)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        layer(x, attention_mask=None)
        layer(x, attention_mask=None)
    assert recorder.args[0].shape == (2, 16 if causal else 11, 8)
    assert caplog.text.count("is not padded to a bucket") == (0 if causal else 1), caplog.text
    layer(x, attention_mask=torch.ones(2, 11, dtype=torch.bool))
    assert recorder.args[0].shape == (2, 16, 8)


class _Attention(nn.Module):
    def __init__(self, causal):
        super().__init__()
        self.is_causal = causal


class DecoderLayer(nn.Module):
    """A decoder layer as transformers has them: causal self-attention, a
    cross-attention that says is_causal=False, the encoder's sequence among
    its arguments.  Its calls go to a Recorder."""

    def __init__(self):
        super().__init__()
        self.self_attn, self.encoder_attn = _Attention(True), _Attention(False)

    def forward(self, hidden_states, attention_mask=None, encoder_hidden_states=None,
                encoder_attention_mask=None, encoder_decoder_position_bias=None):
        raise AssertionError("the recorder stands in for the graphs")


def test_an_encoder_s_sequence_is_not_padded_with_the_decoder_s():
    """A decoder layer's cross-attention reads the encoder's states, another
    sequence: at the decoder's length too, they and their mask are padded
    along the batch only (padded with the decoder's, their new keys would
    be attended).  A decoder layer, whose self-attention says is_causal=True
    beside a cross-attention that says False, pads a call with no mask."""
    recorder = Recorder()
    layer = Bucketed(recorder, normalize({0: [4], 1: [16]}), DecoderLayer())
    memory, memory_mask = torch.randn(3, 11, 8), torch.ones(3, 11, dtype=torch.bool)
    layer(torch.randn(3, 11, 8), attention_mask=None, encoder_hidden_states=memory,
          encoder_attention_mask=memory_mask)
    assert recorder.args[0].shape == (4, 16, 8)
    assert recorder.kwargs["encoder_hidden_states"].shape == (4, 11, 8)
    assert recorder.kwargs["encoder_attention_mask"].shape == (4, 11)


def test_a_decoder_layer_s_positional_cross_attention_inputs_are_read_by_their_names():
    """transformers passes a decoder layer's encoder_hidden_states (and its
    mask) positionally: read under their names in the layer's forward, the
    encoder's states are padded along the batch only, and a (B, 1, T, S)
    cross-attention mask or T5's (1, H, T, S) bias in its queries only, with
    copies of the last real query's row (a bool row of zeros would mask
    every key).  Before, the states were padded as the decoder's (real
    queries attended to copies of the last encoder position), and the mask
    not at all (a shape error)."""
    recorder = Recorder()
    layer = Bucketed(recorder, normalize({1: [16]}), DecoderLayer())
    memory = torch.randn(3, 11, 8)  # the encoder's length, equal to the decoder's
    cross = torch.rand(3, 1, 11, 11) > 0.3
    bias = torch.randn(1, 2, 11, 5)
    layer(torch.randn(3, 11, 8), None, memory, cross, bias)
    hidden, _, padded_memory, padded_cross, padded_bias = recorder.args
    assert hidden.shape == (3, 16, 8) and torch.equal(padded_memory, memory)
    assert padded_cross.shape == (3, 1, 16, 11) and padded_bias.shape == (1, 2, 16, 5)
    assert torch.equal(padded_cross[:, :, :11], cross)
    assert torch.equal(padded_cross[:, :, 11:], cross[:, :, 10:].expand(3, 1, 5, 11))
    assert torch.equal(padded_bias[:, :, 11:], bias[:, :, 10:].expand(1, 2, 5, 5))


def test_a_torch_transformer_encoder_layer_pads_a_call_only_with_a_mask(caplog):
    """nn.TransformerEncoderLayer's nn.MultiheadAttention attends both ways
    and has no is_causal flag: a call with no mask runs at its own size
    (padded, its real queries would attend to the new keys), equal to eager;
    one with a key padding mask is padded, its real rows equal to eager's."""
    torch.manual_seed(0)
    layer = nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    calls = []

    def forward(*args, **kwargs):
        calls.append(args[0].shape[1])
        return layer(*args, **kwargs)

    graphed = Bucketed(forward, normalize({1: [16]}), layer)
    x = torch.randn(2, 11, 8)
    with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
        torch.testing.assert_close(graphed(x), layer(x))
        keep = torch.arange(11)[None, :] >= torch.tensor([[11], [7]])
        out = graphed(x, src_key_padding_mask=keep)
        want = layer(x, src_key_padding_mask=keep)
    torch.testing.assert_close(out[0], want[0])
    torch.testing.assert_close(out[1, :7], want[1, :7])
    assert calls == [11, 16] and "is not padded to a bucket" in caplog.text


def test_a_block_holding_multihead_attention_reads_its_positional_bool_mask_as_it_does():
    """A block passing its positional attn_mask on to nn.MultiheadAttention
    (True masks there): padded with its new keys masked in that convention,
    the real rows equal to eager.  Read by its name now, it was padded the
    other way round (new keys attended) until the block's MHA was seen."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, attn_mask):
            return self.attn(x, x, x, attn_mask=attn_mask, need_weights=False)[0]

    torch.manual_seed(0)
    block, x = Block().eval(), torch.randn(2, 11, 8)
    future = torch.ones(11, 11, dtype=torch.bool).triu(1)
    graphed = Bucketed(block.forward, normalize({1: [16]}), block)
    with torch.no_grad():
        torch.testing.assert_close(graphed(x, future), block(x, future))


def test_a_mask_inside_a_positional_container_is_read_by_its_shape():
    """forward(self, x) with h, mask = x (stages handing on a tuple): the
    mask inside is not read under the parameter's name (an activation's),
    but by its shape, and padded as a mask."""
    class Stage(nn.Module):
        is_causal = True

        def forward(self, x):
            raise AssertionError("the recorder stands in for the graphs")

    recorder = Recorder()
    mask = padding_mask([11, 7], 11)
    Bucketed(recorder, normalize({1: [16]}), Stage())((torch.randn(2, 11, 8), mask))
    (hidden, padded), = recorder.args
    assert hidden.shape == (2, 16, 8) and padded.shape == (2, 1, 16, 16)
    assert not padded[..., :11, 11:].any()  # new keys masked for the real queries


@pytest.mark.parametrize("causal", [False, True])
def test_a_torch_transformer_decoder_layer_keeps_its_memory_and_real_rows(causal, caplog):
    """nn.TransformerDecoderLayer: its memory (the encoder's sequence, here
    as long as the decoder's) is padded along the batch only, its key
    padding mask too; the call pads with tgt_key_padding_mask, or with a
    causal tgt_mask and tgt_is_causal=True.  Real rows equal to eager.
    Before, the memory was padded as the decoder's sequence: real queries
    attended to copies of its last position."""
    torch.manual_seed(0)
    layer = nn.TransformerDecoderLayer(8, 2, 16, dropout=0.0, batch_first=True).eval()
    calls = []

    def forward(*args, **kwargs):
        calls.append(args[0].shape[1])
        return layer(*args, **kwargs)

    graphed = Bucketed(forward, normalize({1: [16]}), layer)
    x, memory = torch.randn(2, 11, 8), torch.randn(2, 11, 8)
    keep = torch.arange(11)[None, :] >= torch.tensor([[11], [9]])  # True: ignore
    if causal:
        mask = nn.Transformer.generate_square_subsequent_mask(11)
        kwargs = dict(tgt_mask=mask, tgt_is_causal=True, memory_key_padding_mask=keep)
    else:
        kwargs = dict(tgt_key_padding_mask=keep)  # the memory's keys all attended
    with torch.no_grad():
        out, want = graphed(x, memory, **kwargs), layer(x, memory, **kwargs)
    real = slice(None) if causal else slice(0, 9)
    torch.testing.assert_close(out[0], want[0])
    torch.testing.assert_close(out[1, real], want[1, real])
    assert calls == [16]


def test_an_encoder_sequence_as_long_as_the_bucket_runs_the_call_unpadded(caplog):
    """T5's decoder layers return their cross-attention bias (B, H, T, S):
    at S equal to the bucket, it would be read as the decoder's own mask
    and sliced in its keys.  Such a call runs at its own size, logged."""
    class DecoderLayer(nn.Module):
        is_causal = True

        def forward(self, hidden_states, encoder_hidden_states=None):
            raise AssertionError("the recorder stands in for the graphs")

    recorder = Recorder()
    layer = Bucketed(recorder, normalize({1: [16]}), DecoderLayer())
    with caplog.at_level(logging.INFO, logger="cgraph"):
        layer(torch.randn(2, 11, 8), torch.randn(2, 16, 8))
    assert recorder.args[0].shape == (2, 11, 8) and "as long as the bucket" in caplog.text
    layer(torch.randn(2, 11, 8), torch.randn(2, 9, 8))
    assert recorder.args[0].shape == (2, 16, 8) and recorder.args[1].shape == (2, 9, 8)


def test_torch_s_transformer_graphed_whole_runs_unpadded_and_its_encoder_pads_masked(caplog):
    """nn.Transformer graphed whole takes two sequences (src, tgt) whose
    tensors the names cannot tell apart: its calls run at their own size
    (logged), equal to eager.  nn.TransformerEncoder's bool mask masks with
    True, as nn.MultiheadAttention's: padded so, equal to eager."""
    import cgraph
    torch.manual_seed(0)
    whole = nn.Transformer(8, 2, 1, 1, 16, dropout=0.0, batch_first=True).eval()
    calls = []

    def forward(*args, **kwargs):
        calls.append(args[0].shape[1])
        return whole(*args, **kwargs)

    graphed = Bucketed(forward, normalize({1: [16]}), whole)
    src, tgt = torch.randn(2, 11, 8), torch.randn(2, 11, 8)
    causal = nn.Transformer.generate_square_subsequent_mask(11)
    with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
        out = graphed(src, tgt, tgt_mask=causal, tgt_is_causal=True)
        torch.testing.assert_close(out, whole(src, tgt, tgt_mask=causal, tgt_is_causal=True))
    assert calls == [11] and "a source and a target sequence" in caplog.text
    encoder = nn.TransformerEncoder(nn.TransformerEncoderLayer(8, 2, 16, dropout=0.0,
                                                               batch_first=True), 2,
                                    enable_nested_tensor=False).eval()
    future = torch.ones(11, 11, dtype=torch.bool).triu(1)
    with torch.no_grad():
        out = Bucketed(encoder.forward, normalize({1: [16]}), encoder)(src, mask=future)
        torch.testing.assert_close(out, encoder(src, mask=future))
    with pytest.raises(ValueError, match="dimension 0 .*batch_first=False.*batch_first=True"):
        cgraph.make_graphed(nn.TransformerEncoderLayer(8, 2, 16), buckets=[16])


def test_a_causal_flag_passed_positionally_counts_as_a_mask():
    """forward(self, x, is_causal): is_causal=True passed positionally, read
    under its name, tells a module that holds no causal flag of its own
    that no real query sees a new key: padded."""
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.attn = nn.MultiheadAttention(8, 2, batch_first=True)

        def forward(self, x, is_causal=False):
            raise AssertionError("the recorder stands in for the graphs")

    recorder = Recorder()
    layer = Bucketed(recorder, normalize({1: [16]}), Block())
    layer(torch.randn(2, 11, 8), True)
    assert recorder.args[0].shape == (2, 16, 8)
    layer(torch.randn(2, 11, 8), False)
    assert recorder.args[0].shape == (2, 11, 8)


def test_a_call_carrying_a_kv_cache_is_not_padded():
    """generate() calls a graphed layer with its KV cache, which that call
    runs eagerly (Regraph): padded, the cache would keep the padded
    positions and every later step would attend to them.  Unpadded."""
    class DynamicCache:
        pass

    recorder = Recorder()
    x = torch.randn(2, 1, 8)
    bucketed(recorder, {1: [8]})(x, past_key_values=DynamicCache())
    assert recorder.args[0].shape == (2, 1, 8)
    bucketed(recorder, {1: [8]})(x)
    assert recorder.args[0].shape == (2, 8, 8)


def test_key_padding_mask_under_multihead_attention_keeps_the_real_outputs():
    """nn.MultiheadAttention (batch first) with a bool key_padding_mask,
    True = ignore: the padded keys are ignored as the real padding is, so
    the real outputs and the grads are eager's."""
    torch.manual_seed(7)
    mha = nn.MultiheadAttention(8, 2, batch_first=True)
    eager = copy.deepcopy(mha)
    x, upstream = torch.randn(2, 11, 8), torch.randn(2, 11, 8)
    ignore = torch.arange(11)[None, :] >= torch.tensor([[11], [7]])

    def call(model):
        return lambda x, key_padding_mask: model(x, x, x, key_padding_mask=key_padding_mask,
                                                 need_weights=False)[0]

    out = bucketed(call(mha), {1: [16]})(x, key_padding_mask=ignore)
    out_e = call(eager)(x, key_padding_mask=ignore)
    torch.testing.assert_close(out, out_e)
    (out * upstream).sum().backward()
    (out_e * upstream).sum().backward()
    for p, q in zip(mha.parameters(), eager.parameters()):
        torch.testing.assert_close(p.grad, q.grad)


def test_a_heads_first_tensor_under_another_keyword_is_not_read_as_a_mask():
    """(B, H, T, hd) at hd == T, and (B, H, 1, hd), under hidden_states= and
    query=: left as they are (their positions are not at the bucketed
    dimension), where by shape each reads as a mask and gains hd columns of
    the dtype's min.  Beside them a positional (B, 1, T, T) mask is padded
    as one, and positionally the heads-first tensor is still misread
    (README Limits)."""
    x, mask = torch.randn(2, 11, 8), padding_mask([11, 7], 11)
    heads_first, per_head = torch.randn(2, 3, 11, 11), torch.randn(2, 3, 1, 11)
    recorder = Recorder()
    bucketed(recorder, {1: [16]})(x, mask, hidden_states=heads_first, query=per_head)
    assert recorder.kwargs["hidden_states"] is heads_first and recorder.kwargs["query"] is per_head
    padded = recorder.args[1]
    assert padded.shape == (2, 1, 16, 16) and torch.equal(padded[..., :11, :11], mask)
    assert not padded[..., :11, 11:].any() and padded[..., 11:, :].all()
    bucketed(recorder, {1: [16]})(x, heads_first)
    assert recorder.args[1].shape == (2, 3, 16, 16)


# ---- a Hugging Face decoder layer ------------------------------------------------


def llama_layer(attention: str, device):
    transformers = pytest.importorskip("transformers")
    config = transformers.LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        use_cache=False, attn_implementation=attention)
    torch.manual_seed(5)
    from transformers.models.llama.modeling_llama import (LlamaDecoderLayer,
                                                          LlamaRotaryEmbedding)
    return (LlamaDecoderLayer(config, layer_idx=0).to(device),
            LlamaRotaryEmbedding(config).to(device))


def layer_call(layer, rope, lengths, length, attention, device):
    """One forward and backward of `layer` on a right-padded batch:
    returns its output and the parameter grads."""
    hidden = torch.randn(len(lengths), length, 64, device=device)
    upstream = torch.randn_like(hidden)  # drawn before a call that may capture
    mask = padding_mask(lengths, length).to(device)
    if attention == "eager":
        mask = additive(mask)
    rotary = rope(hidden, torch.arange(length, device=device)[None])
    out = layer(hidden, attention_mask=mask, position_embeddings=rotary)
    out = out[0] if isinstance(out, tuple) else out
    (out * upstream).sum().backward()
    return out.detach(), [p.grad.clone() for p in layer.parameters()]


# Kernels of other sizes (a softmax over 16 keys, not 11): float32 results
# differ in the last bits (at most 5e-7 relative on CPU); a mask padded
# wrongly changes them by order 1.
LAYER_TOLERANCE = dict(rtol=1e-5, atol=1e-5)


def assert_layer_as_eager(graphed, layer, eager, rope, attention, device):
    """Lengths 11 and 20 (buckets 16 and 32): output and parameter grads as
    eager's, within LAYER_TOLERANCE, and finite."""
    for step, length in enumerate((11, 20)):
        results = []
        for model, call in ((layer, graphed), (eager, eager)):
            model.zero_grad(set_to_none=True)
            torch.manual_seed(10 + step)
            results.append(layer_call(call, rope, [length, length - 4], length, attention,
                                      device))
        (out, grads), (out_e, grads_e) = results
        torch.testing.assert_close(out, out_e, **LAYER_TOLERANCE,
                                   msg=lambda m: f"length {length}: output: {m}")
        for i, (g, g_e) in enumerate(zip(grads, grads_e)):
            assert g.isfinite().all(), f"length {length}: grad {i} not finite"
            torch.testing.assert_close(g, g_e, **LAYER_TOLERANCE,
                                       msg=lambda m: f"length {length}: grad {i}: {m}")


@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_llama_layer_padded_with_its_mask_on_cpu(attention):
    """The padding alone, the eager layer standing in for its graphs: a
    float mask (eager) and a bool one (sdpa) padded beside the hidden
    states and the rotary tables."""
    layer, rope = llama_layer(attention, "cpu")
    eager = copy.deepcopy(layer)
    assert_layer_as_eager(bucketed(layer, {1: [16, 32]}), layer, eager, rope, attention, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("attention", ["eager", "sdpa"])
def test_a_llama_layer_graphed_with_sequence_buckets_takes_its_padding_mask(attention):
    """cgraph.make_graphed(layer, buckets={1: [16, 32]}) called as the model
    calls it, with a (B, 1, T, T) padding mask: one graph per bucket, eager's
    output and parameter grads."""
    import cgraph
    from _helpers import CUDA

    layer, rope = llama_layer(attention, CUDA)
    eager = copy.deepcopy(layer)
    graphed = cgraph.make_graphed(layer, buckets={1: [16, 32]})
    assert_layer_as_eager(graphed, layer, eager, rope, attention, CUDA)
    assert graphed.num_graphs == 2 and graphed.stats["eager_on_miss"] == 0, graphed.stats


def test_a_batchnorm_normalizing_with_the_calls_statistics_refuses_padding_of_any_dimension():
    """BatchNorm's statistics run over every dimension but the channels':
    padding positions (dimension 2 of a (B, C, L) input) changes them as
    padding rows does.  Each BatchNorm's own mode counts (the root's may
    differ), and one without running statistics uses the call's in eval
    mode too."""
    model = nn.Sequential(nn.Conv1d(2, 2, 1), nn.BatchNorm1d(2))
    x = torch.randn(3, 2, 5)
    for buckets in ([4], {2: [8]}):
        recorder = Recorder()
        model.train()
        with pytest.raises(ValueError, match="BatchNorm in training mode.*'1'.*mix the rows"):
            Bucketed(recorder, normalize(buckets), model)(x)
        model.eval()
        model[1].train()  # the root in eval mode, its BatchNorm not
        with pytest.raises(ValueError, match="BatchNorm in training mode"):
            Bucketed(recorder, normalize(buckets), model)(x)
        model[1].eval()
        Bucketed(recorder, normalize(buckets), model)(x)  # running statistics: padded
        assert recorder.args[0].shape != x.shape
    untracked = nn.Sequential(nn.BatchNorm1d(2, track_running_stats=False)).eval()
    with pytest.raises(ValueError, match="without running statistics"):
        Bucketed(Recorder(), normalize({2: [8]}), untracked)(x)


def test_a_batch_of_one_takes_its_size_from_the_first_tensor():
    """Batch buckets, a batch of 1 and a (T, d) table or a weight passed
    beside it (gpt-fast's freqs_cis): size 1, a bucket itself, so nothing
    is padded; only a mask layout at a dimension d >= 1 is passed over."""
    recorder = Recorder()
    x, table = torch.randn(1, 6, 4), torch.randn(6, 4)
    bucketed(recorder, [1, 2, 4, 8])(x, table)
    assert recorder.args[0] is x and recorder.args[1] is table
    bucketed(recorder, [2, 4])(x, table)
    assert recorder.args[0].shape == (2, 6, 4) and recorder.args[1].shape == (6, 4)

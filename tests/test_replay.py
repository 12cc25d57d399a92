"""Replay: a graphed callable's results against eager PyTorch.  Outputs,
input and parameter grads and buffers over several steps; per-call argument
copies and their guards (shape, dtype, device, keywords, constants, pytrees);
outputs of earlier calls; random numbers; train/eval and no_grad; what
`graphs`, `stats` and the profiler report; pools shared between callables
and memory returned on reset or deletion.  Results are compared with the
same steps run in eager mode (on a deep copy of the model), bitwise
(torch.equal) unless a test states a tolerance: a graph replays the same
kernels on the same data, and with the same generator state the same random
streams, as eager mode; the introspection and memory tests check counts and
the allocator's snapshot instead.  Upstream grads are dense random tensors,
like a real loss's; the one test of `.sum()` explains its tolerance."""

import collections
import copy
import enum
import gc
import logging

import pytest
import torch
from torch import nn

import cgraph
from _helpers import (CUDA, assert_equal, assert_grads_equal, backward_as_eager, mlp,
                      pool_segments, stack, twin)

pytestmark = pytest.mark.gpu


class _Mode(enum.IntEnum):
    ROTATE = 0


CosSin = collections.namedtuple("CosSin", "cos sin")


# ---- results against eager over steps ---------------------------------------


def layernorm_gelu():
    return nn.Sequential(nn.Linear(32, 64), nn.LayerNorm(64), nn.GELU(),
                         nn.Linear(64, 16)).to(CUDA), lambda: torch.randn(8, 32, device=CUDA,
                                                                         requires_grad=True)


class EmbedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(100, 32)
        self.proj = nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Linear(32, 16))

    def forward(self, ids):
        return self.proj(self.embed(ids))


def embedding():
    return EmbedMLP().to(CUDA), lambda: torch.randint(0, 100, (8, 4), device=CUDA)


MODELS = {"mlp": mlp, "layernorm_gelu": layernorm_gelu, "embedding": embedding}


@pytest.mark.parametrize("name", sorted(MODELS))
def test_matches_eager_bitwise_over_steps(name):
    torch.manual_seed(0)
    model, make_input = MODELS[name]()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    for step in range(4):
        x = make_input()
        xe = twin(x)
        out, out_e = model(x), eager(xe)
        assert_equal(out, out_e, f"step {step}: output")
        backward_as_eager(out, out_e, x, xe, f"step {step}: input grad")
        assert_grads_equal(model, eager, step)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
    stats = model.forward.stats
    assert (stats["forward"], stats["backward"], stats["eager_pending"],
            stats["eager_past_limit"], stats["eager_on_miss"]) == (4, 4, 0, 0, 0), stats


def test_batchnorm_running_stats_update_as_in_eager():
    torch.manual_seed(4)
    model = nn.Sequential(nn.Linear(16, 32), nn.BatchNorm1d(32), nn.ReLU()).to(CUDA)
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(
        model, (torch.randn(8, 16, device=CUDA, requires_grad=True),))
    for step in range(3):
        x = torch.randn(8, 16, device=CUDA, requires_grad=True)
        out, out_e = model(x), eager(twin(x))
        assert_equal(out, out_e, f"step {step}: output")
        backward_as_eager(out, out_e)
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            assert_equal(b, c, f"step {step}: buffer {name}")
    assert model.forward.stats["forward"] == 3 and model.forward.stats["eager_pending"] == 0


# ---- arguments and incoming grads: copies and guards ------------------------


class TwoInputs(nn.Module):
    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(16, 16), nn.Linear(16, 16)

    def forward(self, x, y):
        return self.a(x) * self.b(y), self.b(x)


def test_argument_copies_follow_every_call_and_match_eager():
    """Note [Argument copies inside the graph]: per call, each argument and
    incoming grad is copied by the graph (dense: a fresh tensor, the same
    tensor again; the stride-0 grad of .sum(), broadcast from its one
    element; no grad, zeros), not copied (the static buffer itself) or
    copied before the replay (a transposed view); an argument that is
    another argument's buffer is read before that buffer is refilled.  The
    sequence switches every slot between these states (Note [Incoming
    grads]).  The eager twin gets the same values, dense, so the kernels
    match bitwise."""
    torch.manual_seed(13)
    model = TwoInputs().to(CUDA)
    eager = copy.deepcopy(model)
    static_x, static_y = (torch.randn(8, 16, device=CUDA, requires_grad=True) for _ in range(2))
    graphed = cgraph.make_graphed(model, (static_x, static_y))  # samples become the buffers
    same = torch.randn(8, 16, device=CUDA)
    transposed = lambda: torch.randn(16, 8, device=CUDA).t()  # noqa: E731
    fresh = lambda: torch.randn(8, 16, device=CUDA)  # noqa: E731
    calls = [(fresh(), fresh()),           # graph, graph
             (same, static_y),             # graph, none
             (same, transposed()),         # graph (same address), ATen
             (static_x, fresh()),          # none, graph
             (transposed(), same),         # ATen, graph
             (fresh(), static_x)]          # graph, graph from a clone taken first
    for step, (x, y) in enumerate(calls):
        with torch.no_grad():  # refill the buffers, as a caller feeding them would
            static_x.copy_(torch.randn(8, 16, device=CUDA))
            static_y.copy_(torch.randn(8, 16, device=CUDA))
        dense = [t.detach().clone(memory_format=torch.contiguous_format) for t in (x, y)]
        out, side = graphed(x, y)
        out_e, side_e = eager(*dense)
        assert_equal(out, out_e, f"step {step}: output")
        assert_equal(side, side_e, f"step {step}: second output")
        if step % 2:  # the second output's grad: stride 0 here, dense ones in eager
            loss = (out * 3).sum() + side.sum()
            loss_e = (out_e * 3).sum() + (side_e * torch.ones_like(side_e)).sum()
        else:  # no grad for the second output: its buffer is zeroed
            upstream = torch.randn(8, 16, device=CUDA)
            loss, loss_e = (out * upstream).sum(), (out_e * upstream).sum()
        loss.backward()
        loss_e.backward()
        assert_grads_equal(model, eager, step)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
    stats = graphed.stats
    assert stats["copied_in_graph"] == 17 and stats["copied_before"] == 2, stats


def test_sum_loss_matches_eager_within_one_ulp():
    """`out.sum()` sends autograd an expanded (stride-0) grad; the graph
    copies it into a dense static buffer, and cuBLAS may pick another
    reduction order for a dense operand.  Tolerance: 1e-6 relative."""
    torch.manual_seed(3)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    for _ in range(2):
        x = make_input()
        xe = twin(x)
        model(x).sum().backward()
        eager(xe).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad, rtol=1e-6, atol=1e-7)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad, rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize(
    "bad, text",
    [
        (lambda: torch.randn(4, 32, device=CUDA), r"shape \[4, 32\].*captured with shape \[8, 32\]"),
        # Another floating dtype is cast (test_drop_in.py); an integer one is not.
        (lambda: torch.randint(0, 9, (8, 32), device=CUDA), "Long.*captured.*Float"),
        (lambda: torch.randn(8, 32), "cpu.*captured.*cuda"),
    ],
)
def test_other_shape_dtype_device_raise_value_error(bad, text):
    """With torch's rule of one graph (max_graphs=1); by default another
    shape captures: test_drop_in.py."""
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),), max_graphs=1)
    with pytest.raises(ValueError, match="argument 'input'.*" + text):
        model(bad())


# ---- keywords, constants and pytrees ----------------------------------------


class Gated(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, *, mask, scale=1.0):
        return self.lin(x) * mask * scale


def test_keyword_arguments_match_eager():
    torch.manual_seed(12)
    model = Gated().to(CUDA)
    eager = copy.deepcopy(model)
    sample = torch.randn(8, 16, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed(
        model, (sample,), sample_kwargs={"mask": torch.ones(8, 16, device=CUDA), "scale": 2.0})
    for step in range(2):
        x = torch.randn(8, 16, device=CUDA, requires_grad=True)
        xe = twin(x)
        mask = (torch.rand(8, 16, device=CUDA) > 0.5).float()
        out, out_e = graphed(x, scale=2.0, mask=mask), eager(xe, mask=mask, scale=2.0)
        assert_equal(out, out_e, f"step {step}: output")
        backward_as_eager(out, out_e, x, xe, f"step {step}: input grad")
        assert_grads_equal(model, eager, step)
        model.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)


@pytest.mark.parametrize(
    "call, error, text",
    [
        (lambda g, x, m: g(x, mask=m), TypeError, "missing keyword argument 'scale'"),
        (lambda g, x, m: g(x, mask=m, scale=2.0, bias=1), TypeError, "unexpected keyword.*'bias'"),
        (lambda g, x, m: g(x, mask=m, scale=3.0), ValueError, "'scale' was captured as 2.0, got 3.0"),
        (lambda g, x, m: g(x, mask=m, scale=2), ValueError, "'scale' was captured as 2.0, got 2"),
    ],
)
def test_keyword_and_constant_mismatches_raise(call, error, text):
    model = Gated().to(CUDA)
    mask = torch.ones(8, 16, device=CUDA)
    graphed = cgraph.make_graphed(model, (torch.randn(8, 16, device=CUDA),),
                                  sample_kwargs={"mask": mask, "scale": 2.0}, max_graphs=None)
    with pytest.raises(error, match=text):
        call(graphed, torch.randn(8, 16, device=CUDA), mask)


def test_positional_constants_are_guarded():
    def scaled(x, n, flag, dtype):
        y = x * n if flag else x
        return y.to(dtype)

    x = torch.randn(8, device=CUDA)
    graphed = cgraph.make_graphed(scaled, (x, 3, True, torch.float16), max_graphs=None)
    y = torch.randn(8, device=CUDA)
    assert_equal(graphed(y, 3, True, torch.float16), scaled(y, 3, True, torch.float16), "output")
    with pytest.raises(ValueError, match="argument 'n' was captured as 3, got 4"):
        graphed(y, 4, True, torch.float16)
    with pytest.raises(ValueError, match="'dtype' was captured as torch.float16"):
        graphed(y, 3, True, torch.bfloat16)


def test_pytrees_in_and_out():
    torch.manual_seed(13)
    lin = nn.Linear(16, 16).to(CUDA)
    eager = copy.deepcopy(lin)

    def f(batch, layers):
        h = layers[0](batch["x"]) + batch["skip"][0]
        return {"h": h, "parts": (h.sum(-1), [h * 2])}

    def sample():
        return {"x": torch.randn(4, 16, device=CUDA, requires_grad=True),
                "skip": [torch.randn(4, 16, device=CUDA)]}

    graphed = cgraph.make_graphed(lambda batch: f(batch, [lin]), (sample(),), max_graphs=None)
    batch = sample()
    twin_batch = {"x": twin(batch["x"]), "skip": [batch["skip"][0].clone()]}
    out, out_e = graphed(batch), f(twin_batch, [eager])
    assert list(out) == ["h", "parts"] and isinstance(out["parts"][1], list)
    for a, b in zip(torch.utils._pytree.tree_leaves(out), torch.utils._pytree.tree_leaves(out_e)):
        assert_equal(a, b, "output leaf")
    u1, u2 = torch.randn(4, 16, device=CUDA), torch.randn(4, device=CUDA)
    ((out["h"] * u1).sum() + (out["parts"][0] * u2).sum()).backward()
    ((out_e["h"] * u1).sum() + (out_e["parts"][0] * u2).sum()).backward()
    assert_equal(batch["x"].grad, twin_batch["x"].grad, "input grad")
    assert_equal(lin.weight.grad, eager.weight.grad, "closure module's weight grad")
    with pytest.raises(TypeError, match="structured as"):
        graphed({"x": batch["x"]})


class Rotary(nn.Module):
    """Called as a Hugging Face decoder layer is: keywords, a tuple of
    tensors among them, None and bool constants, a str constant."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(16, 16)

    def forward(self, x, *, position_embeddings, attention_mask=None, use_cache=False,
                mode="rotate", extra=None):
        cos, sin = position_embeddings
        h = self.lin(x) * cos + x * sin
        if attention_mask is not None:
            h = h * attention_mask
        return h if extra is None else h + extra["bias"][0] * extra["scale"]


def embeddings():
    return torch.randn(8, 16, device=CUDA), torch.randn(8, 16, device=CUDA)


def rotary_kwargs(position_embeddings, **changes):
    kwargs = dict(position_embeddings=position_embeddings, attention_mask=None,
                  use_cache=False, mode="rotate",
                  extra={"bias": [torch.randn(16, device=CUDA)], "scale": 2.0})
    kwargs.update(changes)
    return kwargs


def test_arguments_structured_as_the_samples_skip_tree_flatten():
    """Note [Arguments walked in C]: nested keywords walked natively, with
    eager's results; tree_flatten is not called.  (What the walk refuses
    or leaves to tree_flatten: tests/test_arguments.py, on the CPU.)"""
    torch.manual_seed(15)
    model = Rotary().to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(8, 16, device=CUDA, requires_grad=True),),
                                  sample_kwargs=rotary_kwargs(embeddings()))
    for step in range(3):
        x = torch.randn(8, 16, device=CUDA, requires_grad=True)
        xe = twin(x)
        kwargs = rotary_kwargs(embeddings())
        out, out_e = graphed(x, **kwargs), eager(xe, **kwargs)
        assert_equal(out, out_e, f"step {step}: output")
        backward_as_eager(out, out_e, x, xe, f"step {step}: input grad")
        assert_grads_equal(model, eager, step)
    stats = graphed.stats
    assert stats["forward"] == 3 and stats["graphs"] == 1 and stats["args_flattened"] == 0, stats


@pytest.mark.parametrize("changes", [
    lambda: dict(position_embeddings=CosSin(*embeddings())),
    lambda: dict(mode=_Mode.ROTATE),
], ids=["named tuple", "IntEnum constant"])
def test_arguments_the_walk_does_not_take_are_flattened_by_torch(changes):
    """A container or a leaf the native walk does not take goes to
    tree_flatten, as before the walk: eager's results, counted."""
    torch.manual_seed(16)
    model = Rotary().to(CUDA)
    eager = copy.deepcopy(model)
    fresh = {"position_embeddings": embeddings()}
    graphed = cgraph.make_graphed(model, (torch.randn(8, 16, device=CUDA),),
                                  sample_kwargs=rotary_kwargs(**{**fresh, **changes()}))
    for step in range(2):
        x = torch.randn(8, 16, device=CUDA)
        kwargs = rotary_kwargs(**{"position_embeddings": embeddings(), **changes()})
        assert_equal(graphed(x, **kwargs), eager(x, **kwargs), f"step {step}: output")
    assert graphed.stats["args_flattened"] == 2, graphed.stats


# ---- outputs of earlier calls -----------------------------------------------


def test_reading_an_overwritten_output_raises_and_the_latest_is_right():
    """kept_outputs='error': the read guard, for those who want it."""
    model = stack()
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),),
                                  kept_outputs="error")
    x1, x2 = torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA)
    with torch.no_grad():  # else the second call, before first's backward, runs eagerly
        first = graphed(x1)
        view = first[0]
        kept = first.clone()
        second = graphed(x2)
        assert_equal(second, model(x2), "latest output")
        assert_equal(kept, model(x1), "a clone taken before the next call")
    for stale in (first, view):
        with pytest.raises(RuntimeError, match="memory a later replay"):
            stale.sum()


@pytest.mark.parametrize("option", [{"kept_outputs": "alias"}, {"guard_outputs": False}],
                         ids=["kept_outputs", "guard_outputs"])
def test_unguarded_outputs_change_under_the_caller_as_in_torch(option):
    model = stack()
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),), **option)
    x1, x2 = torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA)
    with torch.no_grad():  # else the second call, before first's backward, runs eagerly
        first = graphed(x1)
        graphed(x2)
        assert_equal(first, model(x2), "the first output, overwritten by the second call")


def test_feeding_an_output_back_as_input_matches_eager():
    cell = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(CUDA)
    h0 = torch.randn(16, 64, device=CUDA)
    graphed = cgraph.make_graphed(cell, (h0.clone(),))
    h_graph, h_eager = h0, h0
    with torch.no_grad():
        for step in range(5):
            h_graph = graphed(h_graph)
            h_eager = cell(h_eager)
            assert_equal(h_graph, h_eager, f"step {step}")


# ---- random numbers ---------------------------------------------------------


def test_dropout_masks_change_per_replay_and_match_backward():
    """Each replay draws a new mask, the one eager dropout draws from the
    same generator state: two replays after one seeding equal two eager
    calls after the same seeding, and the backward applies the forward's
    mask, as eager's does."""
    drop = nn.Dropout(0.5).to(CUDA)
    x = torch.randn(4096, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed(drop, (x,))
    xe = twin(x)
    torch.cuda.manual_seed(21)
    first = graphed(x).detach().clone()
    second = graphed(x).detach().clone()
    torch.cuda.manual_seed(21)
    assert_equal(first, drop(xe).detach(), "first replay's mask")
    assert_equal(second, drop(xe).detach(), "second replay's mask")
    assert not torch.equal(first != 0, second != 0)
    assert 0.4 < (first == 0).float().mean().item() < 0.6
    torch.cuda.manual_seed(22)
    y = graphed(x)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
    torch.cuda.manual_seed(22)
    y_e = drop(xe)
    (y_e * upstream).sum().backward()
    assert_equal(y, y_e, "output")
    assert_equal(x.grad, xe.grad, "input grad")
    assert_equal(x.grad, upstream * (y != 0) * 2.0, "dropout backward mask")


def test_graph_written_seeds_match_eager_across_reseeds_and_large_offsets():
    """The graph writes its own Philox seed and base offset (Note [Seeding
    random numbers inside the graph]).  Masks, grads and the generator's
    position after each call are eager mode's, bit for bit, after a reseed
    and with the offset crossing 2**32 (the memset nodes of the high halves)."""
    torch.manual_seed(14)
    model = nn.Sequential(nn.Linear(32, 256), nn.ReLU(), nn.Dropout(0.3), nn.Linear(256, 16),
                          nn.Dropout(0.3)).to(CUDA)
    eager = copy.deepcopy(model)
    sample = lambda: torch.randn(8, 32, device=CUDA, requires_grad=True)  # noqa: E731
    graphed = cgraph.make_graphed(model, (sample(),))
    forward = graphed.graphs["forward"]
    assert forward["memsets"] == 4, forward  # seed, offset: 2 halves each
    # In one line ahead of the model's kernels: parallel memset roots cost
    # the GPU several microseconds more per launch.
    assert forward["roots"] == 1 and forward["edges"] == forward["nodes"] - 1, forward
    generator = torch.cuda.default_generators[torch.cuda.current_device()]
    for step, (seed, offset) in enumerate([(None, None), (123, None), (None, 2**32 - 4),
                                           (None, None), (7, 2**33 + 4), (None, None)]):
        if seed is not None:
            torch.cuda.manual_seed(seed)
        if offset is not None:
            generator.set_offset(offset)
        x = sample()
        start = torch.cuda.get_rng_state()
        out = graphed(x)
        after_graphed = torch.cuda.get_rng_state()
        torch.cuda.set_rng_state(start)
        xe = twin(x)
        out_e = eager(xe)
        assert torch.equal(after_graphed, torch.cuda.get_rng_state()), f"step {step}: offset"
        assert_equal(out, out_e, f"step {step}: output (dropout masks)")
        backward_as_eager(out, out_e, x, xe, f"step {step}: input grad")
        assert_grads_equal(graphed.module, eager, step)
    assert generator.get_offset() > 2**33


# ---- torch's conventions: train/eval, no_grad -------------------------------


def test_the_other_train_eval_mode_gets_a_graph_of_its_own():
    """The drop-in (max_graphs 8) captures a graph for eval mode beside the
    training one; each replays its own mode's dropout, as eager does."""
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)).to(CUDA)
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (torch.randn(8, 16, device=CUDA),))
    model.eval()
    eager.eval()
    x = torch.randn(8, 16, device=CUDA)
    assert_equal(model(x), eager(x), "eval-mode output")
    model.train()
    eager.train()
    torch.cuda.manual_seed(7)
    out = model(x)
    assert (out == 0).any()  # graphed train mode: dropout is back
    torch.cuda.manual_seed(7)  # eager dropout from the same generator state
    assert_equal(out, eager(x), "train-mode output (dropout mask)")
    stats = model.forward.stats
    assert model.forward.num_graphs == 2, stats
    assert stats["eager_on_miss"] == stats["eager_past_limit"] == 0, stats


class _FillsCache(nn.Module):
    """Writes its cache argument in place, as a KV cache is filled inside
    forward."""

    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(16, 4)

    def forward(self, x, cache, step):
        cache[:, step] = self.proj(x).detach()
        return x * 2, cache.sum(1)


def test_an_argument_written_in_place_is_copied_back_into_the_tensor_passed():
    """Note [Arguments written in place]: each replay copies the static input
    the forward wrote back into the caller's tensor, as eager leaves it
    (torch's graphs leave the caller's cache as it was); the sample itself
    passed again is written directly, with no copy."""
    torch.manual_seed(11)
    model = _FillsCache().to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)
    caches = [torch.zeros(8, 3, 4, device=CUDA) for _ in range(2)]
    expected = [c.clone() for c in caches]
    for step in range(3):
        for cache, want in zip(caches, expected):
            x = torch.randn(8, 16, device=CUDA)
            _, total = graphed(x, cache, step)
            _, total_e = eager(x, want, step)
            assert_equal(cache, want, f"step {step}: the cache passed")
            assert_equal(total, total_e, f"step {step}: what the forward read of it")
    assert graphed.num_graphs == 3 and graphed.stats["written_back"] == 6
    sample = torch.zeros(8, 3, 4, device=CUDA)
    drop_in = cgraph.make_graphed_callables(_FillsCache().to(CUDA),
                                            (torch.randn(8, 16, device=CUDA), sample, 0))
    x = torch.randn(8, 16, device=CUDA)
    drop_in(x, sample, 0)
    assert_equal(sample[:, 0], drop_in.proj(x), "the sample passed again, written in place")
    assert drop_in.forward.stats["written_back"] == 0


class _Halves(nn.Module):
    """Halves its argument in place and returns it plus one."""

    def forward(self, h):
        h.mul_(0.5)
        return h + 1


def test_written_arguments_under_inference_mode_alias_outputs_and_expanded_tensors():
    """Under torch.inference_mode the static inputs are inference tensors,
    which have no version counter: captured there, the graphs work (their
    writes go unseen). An earlier output passed back with
    kept_outputs='alias' is this replay's output too: the output wins, as
    eager's output is the value returned. An expanded argument the forward
    writes is refused before the replay, as eager refuses it."""
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)
    with torch.inference_mode():
        x = make_input()
        assert_equal(graphed(x), eager(x), "a capture under inference_mode")
    halves = cgraph.make_graphed(_Halves(), kept_outputs="alias")
    with torch.no_grad():
        h, h_e = torch.randn(8, 16, device=CUDA), None
        h_e = h.clone()
        h1 = halves(h)
        h1_e = _Halves()(h_e)
        assert_equal(h, h_e, "the argument, halved and copied back")
        assert_equal(halves(h1), _Halves()(h1_e), "an earlier output passed back")
        with pytest.raises(RuntimeError, match="expanded tensor"):
            halves(torch.randn(1, 16, device=CUDA).expand(8, 16))


def test_no_grad_replays_forward_only():
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    x = make_input()
    with torch.no_grad():
        out = model(x)
        expected = eager(x)
    assert out.grad_fn is None and not out.requires_grad
    assert_equal(out, expected, "no-grad output")


# ---- introspection: the GraphedModule, graphs, profiler ranges --------------


def test_make_graphed_returns_a_graphed_module():
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    assert isinstance(graphed, cgraph.GraphedModule)
    assert graphed.module is model and model.forward.__class__ is not cgraph.Graphed
    assert list(graphed.state_dict())[0].startswith("module.")
    x = make_input()
    assert_equal(graphed(x), eager(x), "output")


def test_graphs_describe_what_was_captured():
    """Graphed.graphs reads the captured graphs: each starts with one copy node
    per argument (Note [Argument copies inside the graph]), the backward with
    a second one for a broadcast grad (Note [Incoming grads]), and is a
    straight line of work; a pass with nothing to differentiate has no graph."""
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    shapes = graphed.graphs
    # The backward graph ends with both tails of Note [Parameter gradients]:
    # one fused launch each, for the six parameters.
    assert shapes["backward"]["kernels"] >= shapes["forward"]["kernels"] + 2, shapes
    for name, shape in shapes.items():
        assert shape["memcpys"] == (1 if name == "forward" else 2), (name, shape)
        assert shape["kernels"] >= 3, (name, shape)  # three Linear layers each way
        assert shape["nodes"] == (shape["kernels"] + shape["memcpys"] + shape["memsets"]
                                  + shape["others"]), (name, shape)
        assert shape["roots"] == 1 and shape["edges"] == shape["nodes"] - 1, (name, shape)
    frozen, _ = mlp()
    frozen.requires_grad_(False)
    no_grad = cgraph.make_graphed(frozen, (torch.randn(8, 32, device=CUDA),))
    assert no_grad.graphs["forward"] is not None and no_grad.graphs["backward"] is None
    graphed.reset()
    assert graphed.graphs == {"forward": None, "backward": None}


def test_profiler_shows_cgraph_ranges():
    """A graphed call shows up in torch.profiler under cgraph:: names, with the
    forward and backward graph launches as ranges of their own."""
    from torch.profiler import ProfilerActivity, profile

    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    x = make_input()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        graphed(x).sum().backward()
    names = {e.key for e in prof.key_averages()}
    assert {"cgraph::forward", "cgraph::replay_forward_graph",
            "cgraph::replay_backward_graph", "cgraph::parameter_grads"} <= names, names


# ---- pools: sharing and returning memory ------------------------------------


def test_several_callables_share_one_pool():
    """Forwards captured 1..N, backwards N..1, all in one pool."""
    torch.manual_seed(5)
    layers = tuple(nn.Sequential(nn.Linear(32, 32), nn.GELU()).to(CUDA) for _ in range(3))
    eager = copy.deepcopy(layers)
    samples = tuple((torch.randn(8, 32, device=CUDA, requires_grad=True),) for _ in layers)
    graphed = cgraph.make_graphed_callables(layers, samples)
    assert len({g.forward.pool for g in graphed}) == 1
    for step in range(3):
        x = torch.randn(8, 32, device=CUDA, requires_grad=True)
        xe = twin(x)
        h, he = x, xe
        for g, e in zip(graphed, eager):
            h, he = g(h), e(he)
        assert_equal(h, he, f"step {step}: output")
        backward_as_eager(h, he, x, xe, f"step {step}: input grad")
        for i, (g, e) in enumerate(zip(graphed, eager)):
            for p, q in zip(g.parameters(), e.parameters()):
                assert_equal(p.grad, q.grad, f"step {step}: layer {i} grad")
            g.zero_grad(set_to_none=True)
            e.zero_grad(set_to_none=True)


def test_pool_handle_shared_between_two_calls():
    torch.manual_seed(6)
    handle = torch.cuda.graph_pool_handle()
    nets = [mlp()[0] for _ in range(2)]
    eager = copy.deepcopy(nets)
    sample = lambda: torch.randn(8, 32, device=CUDA, requires_grad=True)  # noqa: E731
    a = cgraph.make_graphed_callables(nets[0], (sample(),), pool=handle)
    b = cgraph.make_graphed_callables(nets[1], (sample(),), pool=handle)
    assert a.forward.pool == b.forward.pool == handle
    for step in range(2):
        # Replay in capture order: all of a, then all of b.
        for g, e in ((a, eager[0]), (b, eager[1])):
            x = sample()
            out, out_e = g(x), e(twin(x))
            assert_equal(out, out_e, f"step {step}: output")
            backward_as_eager(out, out_e)
            assert_grads_equal(g, e, step)


def test_reset_returns_pool_memory():
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    graphed(make_input()).sum().backward()
    pool = graphed.pool
    assert pool_segments(pool), "the graphs should own pool memory"
    graphed.reset()
    assert pool_segments(pool) == []
    with pytest.raises(RuntimeError, match="reset"):
        graphed(make_input())


@pytest.mark.parametrize("how", ["drop-in", "with a hook", "in place"])
def test_deleting_the_module_returns_pool_memory_without_gc(how):
    """No cycle: the graphed forward holds its module weakly, and so does
    what a reset needs to give a module its own forward back (a module
    with hooks, graph_layers' blocks)."""
    model, make_input = mlp()
    gc.disable()
    try:
        if how == "drop-in":
            model = cgraph.make_graphed_callables(model, (make_input(),))
        elif how == "with a hook":
            model.register_forward_pre_hook(lambda module, args: None)
            model = cgraph.make_graphed(model, (make_input(),)).module
        else:
            cgraph._api.graphed_in_place(model, sample_args=(make_input(),))
        model(make_input()).sum().backward()
        pool = model.forward.pool
        assert pool_segments(pool)
        del model
        assert pool_segments(pool) == []
    finally:
        gc.enable()


class _CachesOnFirstCall(nn.Module):
    """A forward that registers a buffer on its first call, as older rotary
    embeddings made their cos/sin tables."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)

    def forward(self, x):
        if not hasattr(self, "table"):
            self.register_buffer("table", torch.linspace(0, 1, 16, device=x.device))
        return self.linear(x) * self.table


class _AssignsItsBuffers(nn.Module):
    """A forward that assigns its buffers new tensors at every call, as
    hand-written running statistics do: an EMA of the inputs' mean, which
    the output reads, and a call count."""

    def __init__(self):
        super().__init__()
        self.linear = nn.Linear(16, 16)
        self.register_buffer("ema", torch.zeros(16))
        self.register_buffer("calls", torch.zeros((), dtype=torch.long))

    def forward(self, x):
        with torch.no_grad():
            self.ema = 0.9 * self.ema + 0.1 * x.mean(0)
            self.calls = self.calls + 1
        return self.linear(x) * self.ema


@pytest.mark.parametrize("samples", [True, False], ids=["with_samples", "first_call"])
def test_buffers_assigned_anew_by_the_forward_accumulate_as_in_eager(samples, caplog,
                                                                     monkeypatch):
    """Note [A buffer assigned anew during set-up] (cgraph/_capture.py): the
    buffers keep their tensors, the warm-up's updates are put back, and
    every replay reads and updates them: outputs, grads and buffers equal
    eager's, call for call.  Before, each replay read the tensor the capture
    began with (freed since) and the warm-up's updates stayed."""
    monkeypatch.setattr(cgraph._log, "_told_buffers", set())  # logged once per process
    torch.manual_seed(0)
    model = _AssignsItsBuffers().to(CUDA)
    eager = copy.deepcopy(model)
    ema = model.ema
    with caplog.at_level(logging.INFO, logger="cgraph"):
        graphed = cgraph.make_graphed(
            model, (torch.randn(4, 16, device=CUDA, requires_grad=True),) if samples else None)
        for step in range(4):
            xs = torch.randn(4, 16, device=CUDA)
            out, out_e = graphed(xs), eager(xs)
            assert_equal(out, out_e, f"call {step}")
            backward_as_eager(out, out_e)
            assert_grads_equal(model, eager, step)
            assert_equal(model.ema, eager.ema, f"ema after call {step}")
            assert_equal(model.calls, eager.calls, f"calls after call {step}")
    assert model.ema is ema
    assert graphed.stats["forward"] == 4 and graphed.num_graphs == 1, graphed.stats
    assert any("_AssignsItsBuffers.ema was assigned a new tensor" in r.getMessage()
               for r in caplog.records)


@pytest.mark.parametrize("samples", [True, False], ids=["with_samples", "first_call"])
def test_a_buffer_registered_on_the_first_call_is_read_by_every_replay(samples):
    """The buffer the forward registers in warm-up is the graphs' own, not a
    replacement: every later call replays (it used to raise 'replaced after
    capture' on each), equal to eager's; a buffer registered after the
    capture still raises."""
    torch.manual_seed(0)
    model = _CachesOnFirstCall().to(CUDA)
    eager = copy.deepcopy(model)
    x = torch.randn(4, 16, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed(model, (x,) if samples else None)
    for step in range(3):
        xs = torch.randn(4, 16, device=CUDA)
        out, out_e = graphed(xs), eager(xs)
        assert_equal(out, out_e, f"call {step}")
        backward_as_eager(out, out_e)
        assert_grads_equal(model, eager, step)
    assert graphed.stats["forward"] == 3 and graphed.num_graphs == 1, graphed.stats
    model.register_buffer("later", torch.ones(1, device=CUDA))
    with pytest.raises(RuntimeError, match="'later' was added to graphed module 0"):
        graphed(torch.randn(4, 16, device=CUDA))

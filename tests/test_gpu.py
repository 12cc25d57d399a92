"""GPU tests: cgraph against eager PyTorch.  Skipped without CUDA.

Comparisons are bitwise (torch.equal) unless a test says otherwise: a graph
replays the same kernels on the same data as eager mode, so anything else is
a bug.  Upstream grads are dense random tensors, like a real loss's; the one
test of `.sum()` explains its tolerance."""

import copy
import gc

import pytest
import torch
from torch import nn

import cgraph
from _helpers import assert_equal

pytestmark = pytest.mark.gpu
CUDA = "cuda"


# ---- helpers -----------------------------------------------------------------


def assert_grads_equal(graphed_model, eager_model, step):
    for (name, p), q in zip(graphed_model.named_parameters(), eager_model.parameters()):
        if p.grad is None and q.grad is None:
            continue  # frozen in both
        assert_equal(p.grad, q.grad, f"step {step}: grad of {name}")


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 16)).to(CUDA), lambda: torch.randn(8, 32, device=CUDA,
                                                                         requires_grad=True)


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


def twin(x):
    """An independent copy of an input for the eager run."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def pool_segments(pool):
    return [s for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool)]


# ---- the correctness list of issue 2 -----------------------------------------


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
        upstream = torch.randn_like(out)
        (out * upstream).sum().backward()
        (out_e * upstream).sum().backward()
        if x.requires_grad:
            assert_equal(x.grad, xe.grad, f"step {step}: input grad")
        assert_grads_equal(model, eager, step)
        for m in (model, eager):
            m.zero_grad(set_to_none=True)


def test_grad_accumulation_without_zero_grad():
    """pytorch issue 181723: torch hands its static grad buffer out as .grad
    and the next replay overwrites it."""
    torch.manual_seed(1)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    for step in range(3):  # .grad starts as None, then accumulates
        x = make_input()
        upstream = torch.randn(8, 16, device=CUDA)
        (model(x) * upstream).sum().backward()
        (eager(twin(x)) * upstream).sum().backward()
        assert_grads_equal(model, eager, step)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float64])
def test_grad_tails_match_eager_in_every_float_dtype(dtype):
    """The tails are cgraph's own kernel (csrc/tensor_lists.cu): a copy,
    then adds in the parameters' dtype, rounded once as ATen's add_ rounds.
    The 1000 x 600 weight spreads over many blocks; the biases' sizes are
    not multiples of 16 bytes (the kernel's byte path)."""
    torch.manual_seed(3)
    model = nn.Sequential(nn.Linear(600, 1000), nn.ReLU(), nn.Linear(1000, 7)).to(CUDA, dtype)
    eager = copy.deepcopy(model)
    make_input = lambda: torch.randn(8, 600, device=CUDA, dtype=dtype)  # noqa: E731
    graphed = cgraph.make_graphed(model, (make_input(),))
    for step in range(3):  # .grad starts as None (copy tail), then accumulates (add tail)
        x = make_input()
        upstream = torch.randn(8, 7, device=CUDA, dtype=dtype)
        (graphed(x) * upstream).sum().backward()
        (eager(x) * upstream).sum().backward()
        assert_grads_equal(model, eager, step)
    assert graphed.stats["grads_copied"] == 1 and graphed.stats["grads_added"] == 2


def test_held_grad_is_never_overwritten():
    torch.manual_seed(2)
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),))
    model(make_input()).sum().backward()
    held = model[0].weight.grad
    kept = held.clone()
    model.zero_grad(set_to_none=True)
    model(make_input()).sum().backward()
    assert model[0].weight.grad is not held
    assert_equal(held, kept, "a .grad the user kept")


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
        (lambda: torch.randn(8, 32, device=CUDA, dtype=torch.float64), "Double.*captured.*Float"),
        (lambda: torch.randn(8, 32), "cpu.*captured.*cuda"),
    ],
)
def test_other_shape_dtype_device_raise_value_error(bad, text):
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),))
    with pytest.raises(ValueError, match="argument 'input'.*" + text):
        model(bad())


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


def test_deleting_the_module_returns_pool_memory_without_gc():
    model, make_input = mlp()
    gc.disable()  # no cycle: the graphed forward holds its module weakly
    try:
        model = cgraph.make_graphed_callables(model, (make_input(),))
        model(make_input()).sum().backward()
        pool = model.forward.pool
        assert pool_segments(pool)
        del model
        assert pool_segments(pool) == []
    finally:
        gc.enable()


def test_dropout_masks_change_per_replay_and_match_backward():
    drop = nn.Dropout(0.5).to(CUDA)
    x = torch.randn(4096, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed(drop, (x,))
    first = graphed(x).detach().clone()
    second = graphed(x).detach().clone()
    assert not torch.equal(first != 0, second != 0)
    assert 0.4 < (first == 0).float().mean().item() < 0.6
    y = graphed(x)
    upstream = torch.randn_like(y)
    (y * upstream).sum().backward()
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
        upstream = torch.randn_like(out)
        (out * upstream).sum().backward()
        (out_e * upstream).sum().backward()
        assert_equal(x.grad, xe.grad, f"step {step}: input grad")
        assert_grads_equal(graphed.module, eager, step)
    assert generator.get_offset() > 2**33


def test_a_replay_inside_another_capture_is_refused():
    """A launch cannot be recorded into another graph; torch.cuda.graph around
    a graphed callable fails with what to do, and the callable still works."""
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    x = make_input()
    with pytest.raises(RuntimeError, match="call the eager callable"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            graphed(x)
    eager = copy.deepcopy(model)
    assert_equal(graphed(x), eager(x), "output after the refusal")


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
        upstream = torch.randn_like(out)
        (out * upstream).sum().backward()
        (out_e * upstream).sum().backward()
        for (name, b), c in zip(model.named_buffers(), eager.buffers()):
            assert_equal(b, c, f"step {step}: buffer {name}")


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
        upstream = torch.randn_like(h)
        (h * upstream).sum().backward()
        (he * upstream).sum().backward()
        assert_equal(x.grad, xe.grad, f"step {step}: input grad")
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
            upstream = torch.randn_like(out)
            (out * upstream).sum().backward()
            (out_e * upstream).sum().backward()
            assert_grads_equal(g, e, step)


# ---- torch's conventions ----------------------------------------------------


def test_other_train_eval_mode_runs_eagerly():
    torch.manual_seed(7)
    model = nn.Sequential(nn.Linear(16, 16), nn.Dropout(0.5)).to(CUDA)
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (torch.randn(8, 16, device=CUDA),))
    model.eval()
    eager.eval()
    x = torch.randn(8, 16, device=CUDA)
    assert_equal(model(x), eager(x), "eval-mode output")
    model.train()
    assert (model(x) == 0).any()  # graphed train mode: dropout is back


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


def test_closure_leaf_gets_its_grad():
    """torch's make_graphed_callables differentiates only args and module
    parameters; a weight in a closure would silently get no grad."""
    torch.manual_seed(8)
    w = torch.randn(16, 16, device=CUDA, requires_grad=True)
    we = twin(w)

    def f(x):
        return torch.tanh(x @ w)

    graphed = cgraph.make_graphed(f, (torch.randn(8, 16, device=CUDA),))
    assert graphed.num_params == 1
    x = torch.randn(8, 16, device=CUDA)
    upstream = torch.randn(8, 16, device=CUDA)
    (graphed(x) * upstream).sum().backward()
    (torch.tanh(x @ we) * upstream).sum().backward()
    assert_equal(w.grad, we.grad, "closure weight grad")


def test_parameter_hooks_run_through_autograd():
    torch.manual_seed(9)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(1) or g * 2)
    eager[0].weight.register_hook(lambda g: g * 2)
    x = make_input()
    upstream = torch.randn(8, 16, device=CUDA)
    (model(x) * upstream).sum().backward()
    (eager(twin(x)) * upstream).sum().backward()
    assert calls == [1]
    assert_grads_equal(model, eager, 0)


def test_post_accumulate_grad_hooks_run_per_replay_not_at_capture():
    torch.manual_seed(10)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    seen = []
    model[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    model = cgraph.make_graphed_callables(model, (make_input(),))
    assert seen == [], "the hook ran during warm-up or capture"
    for step in range(2):
        x = make_input()
        upstream = torch.randn(8, 16, device=CUDA)
        (model(x) * upstream).sum().backward()
        (eager(twin(x)) * upstream).sum().backward()
        assert len(seen) == step + 1
        assert_equal(seen[-1], eager[0].weight.grad, f"step {step}: grad the hook saw")
    assert_grads_equal(model, eager, 1)


def test_sample_with_autograd_history_grads_reach_that_history():
    """The sample is the output of other ops; the backward graph stops at
    it, and its grad flows on through the caller's autograd graph."""
    torch.manual_seed(11)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    scale = torch.full((), 2.0, device=CUDA, requires_grad=True)
    scale_e = twin(scale)
    model = cgraph.make_graphed_callables(model, (make_input() * scale,))
    x = make_input()
    upstream = torch.randn(8, 16, device=CUDA)
    (model(x * scale) * upstream).sum().backward()
    (eager(x * scale_e) * upstream).sum().backward()
    assert_equal(scale.grad, scale_e.grad, "grad of the caller's leaf")
    assert_grads_equal(model, eager, 0)


def test_unused_parameter_needs_allow_unused_input():
    torch.manual_seed(12)
    model, make_input = mlp()
    model.unused = nn.Parameter(torch.zeros(3, device=CUDA))
    with pytest.raises(RuntimeError, match=r"parameter \d+ \(shape \[3\]\).*allow_unused_input"):
        cgraph.make_graphed_callables(model, (make_input(),))
    graphed = cgraph.make_graphed_callables(model, (make_input(),), allow_unused_input=True)
    graphed(make_input()).sum().backward()
    assert model.unused.grad is None


def test_backward_after_a_second_forward_raises():
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),))
    first_loss = model(make_input()).sum()
    model(make_input())
    with pytest.raises(RuntimeError, match="ran forward 1 more time"):
        first_loss.backward()


def test_input_requiring_grad_unlike_its_sample_raises():
    model, _ = mlp()
    model = cgraph.make_graphed_callables(model, (torch.randn(8, 32, device=CUDA),))
    with pytest.raises(RuntimeError, match="requires grad, but its sample did not"):
        model(torch.randn(8, 32, device=CUDA, requires_grad=True))


def test_moved_parameter_raises():
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),))
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="moved to new memory"):
        model(make_input())


def test_capture_failure_is_explained_and_recoverable():
    x = torch.randn(8, device=CUDA)

    def syncs(t):
        return t * t.sum().item()

    with pytest.raises(cgraph.CaptureError, match=r"\.item\(\)") as info:
        cgraph.make_graphed(syncs, (x,))
    assert info.value.__cause__ is not None
    # The process is fully usable: eager work, and a new capture.
    assert_equal(x * 2, x + x, "eager after a failed capture")
    graphed = cgraph.make_graphed(lambda t: t * 2, (x,))
    assert_equal(graphed(x), x * 2, "capture after a failed capture")


# ---- the parameter-grad paths of Note [Parameter gradients] -----------------


def test_training_with_adam_uses_the_copy_tail_and_matches_eager():
    torch.manual_seed(10)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (model, eager)]
    for step in range(3):
        x = make_input()
        upstream = torch.randn(8, 16, device=CUDA)
        for net, opt, inp in ((graphed, opts[0], x), (eager, opts[1], twin(x))):
            opt.zero_grad(set_to_none=True)
            (net(inp) * upstream).sum().backward()
            opt.step()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert_equal(p, q, f"step {step}: parameter after Adam")
    # Each step's input and incoming grad are dense: the graphs copy them in.
    assert graphed.stats == {"forward": 3, "backward": 3, "grads_copied": 3,
                             "grads_added": 0, "grads_slow": 0,
                             "copied_in_graph": 6, "copied_before": 0}


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


def test_accumulation_uses_the_add_tail():
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    for _ in range(3):
        graphed(make_input()).sum().backward()
    assert graphed.stats["grads_copied"] == 1 and graphed.stats["grads_added"] == 2


def test_grad_paths_switch_between_backwards_of_one_graph():
    """The tails are optional parts of the backward graph, switched before
    each replay: copy, add, the slow path (neither tail) and back, in every
    order, each matching eager accumulation bitwise.  A tail left on would
    add twice or overwrite; one left off would leave a stale grad."""
    torch.manual_seed(12)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    # Every switch: copy->add, add->add, add->copy, copy->slow, slow->copy,
    # add->slow, copy->copy.  (The slow path leaves a .grad that is not
    # cgraph's, so only zero_grad leads back to the tails.)
    plan = ["copy", "add", "add", "copy", "slow", "copy", "add", "slow", "copy", "copy", "add"]
    expected = {"copy": "grads_copied", "add": "grads_added", "slow": "grads_slow"}
    for step, path in enumerate(plan):
        for net in (model, eager):
            if path == "copy":
                net.zero_grad(set_to_none=True)
            elif path == "slow":
                net[0].weight.grad = torch.full_like(net[0].weight, 0.5)
        before = graphed.stats
        x = make_input()
        upstream = torch.randn(8, 16, device=CUDA)
        (graphed(x) * upstream).sum().backward()
        (eager(twin(x)) * upstream).sum().backward()
        assert_grads_equal(model, eager, f"{step} ({path})")
        after = graphed.stats
        assert after[expected[path]] == before[expected[path]] + 1, (step, path, after)


@pytest.mark.parametrize("twist", ["assigned_grad", "frozen_after_capture", "held_grad"])
def test_unusual_grad_states_take_the_slow_path_and_match_eager(twist):
    torch.manual_seed(11)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    held = []
    for step in range(3):
        for net in (model, eager):
            if twist == "assigned_grad":
                net[0].weight.grad = torch.ones_like(net[0].weight)
            if twist == "frozen_after_capture" and step == 1:
                net[2].weight.requires_grad_(False)
        x = make_input()
        upstream = torch.randn(8, 16, device=CUDA)
        (graphed(x) * upstream).sum().backward()
        (eager(twin(x)) * upstream).sum().backward()
        assert_grads_equal(model, eager, step)
        if twist == "held_grad":
            held.append((model[0].weight.grad, model[0].weight.grad.clone()))
        for net in (model, eager):
            net.zero_grad(set_to_none=True)
    for grad, value in held:
        assert_equal(grad, value, "a .grad kept across zero_grad")
    assert graphed.stats["grads_slow"] >= 1


# ---- keywords, constants and pytrees ------------------------------------------


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
        upstream = torch.randn_like(out)
        (out * upstream).sum().backward()
        (out_e * upstream).sum().backward()
        assert_equal(x.grad, xe.grad, f"step {step}: input grad")
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
                                  sample_kwargs={"mask": mask, "scale": 2.0})
    with pytest.raises(error, match=text):
        call(graphed, torch.randn(8, 16, device=CUDA), mask)


def test_positional_constants_are_guarded():
    def scaled(x, n, flag, dtype):
        y = x * n if flag else x
        return y.to(dtype)

    x = torch.randn(8, device=CUDA)
    graphed = cgraph.make_graphed(scaled, (x, 3, True, torch.float16))
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

    graphed = cgraph.make_graphed(lambda batch: f(batch, [lin]), (sample(),))
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

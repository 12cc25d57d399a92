"""Autograd through graphed callables: the parameter-grad paths of Note
[Parameter gradients] (grads computed in place and handed out, the copy
tail, the add tail and the general path, switched per backward, with an
optimizer, in every float dtype), grads that
accumulate or are held by the caller, tensor and post-accumulate hooks,
grads reaching closure leaves and the caller's autograd history, unused
parameters, backward-order and requires-grad errors, and autocast with its
weight cache.  Grads, parameters and what hooks see are compared with the
same steps run in eager mode on a deep copy of the model, bitwise
(torch.equal); the autocast tests state their tolerance; the error tests
check the error's text, the path tests the `stats` counters."""

import copy

import pytest
import torch
from torch import nn

import cgraph
from _helpers import CUDA, assert_equal, assert_grads_equal, mlp, stack, twin

pytestmark = pytest.mark.gpu


# ---- parameter grads: the copy tail, the add tail and the slow path ---------


def test_grad_accumulation_without_zero_grad():
    """Grads accumulate over steps without zero_grad as eager's do, where
    torch hands its static grad buffer out as .grad and the next replay
    overwrites it."""
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


def test_accumulation_moves_the_handed_grads_once_then_adds():
    """The backward graph computes the grads in place and hands them out as
    .grad (Note [Parameter gradients]).  The second micro-batch's forward
    would overwrite them while .grad holds them, so it moves each to memory
    of its own first, once; the backwards add into those."""
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    for _ in range(3):
        graphed(make_input()).sum().backward()
    stats = graphed.stats
    assert (stats["grads_copied"], stats["grads_slow"], stats["grads_added"]) == (1, 2, 0), stats
    assert stats["param_grads_copied"] == len(list(model.parameters())), stats


def test_grads_are_the_pool_memory_the_backward_computed_them_in():
    """Eager's .grad is the tensor its backward computed.  A graphed one is
    the memory the backward graph computed it in: in the callable's pool, not
    a second copy outside it."""
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    graphed(make_input()).sum().backward()
    in_pool = [(s["address"], s["address"] + s["total_size"])
               for s in torch.cuda.memory_snapshot()
               if tuple(s["segment_pool_id"]) == tuple(graphed.pool)]
    for name, p in model.named_parameters():
        address = p.grad.data_ptr()
        assert any(lo <= address < hi for lo, hi in in_pool), f"{name}.grad is outside the pool"


def test_second_graph_of_a_parameter_adds_into_the_grads_the_first_handed_out():
    """Two shapes, two graphs, one step: the second graph's add tail
    accumulates into the grads the first computed in place, bitwise as
    eager accumulates."""
    torch.manual_seed(4)
    model, _ = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, max_graphs=4)
    for step in range(3):
        for net in (model, eager):
            net.zero_grad(set_to_none=True)
        for rows in (8, 4):
            x = torch.randn(rows, 32, device=CUDA)
            upstream = torch.randn(rows, 16, device=CUDA)
            (graphed(x) * upstream).sum().backward()
            (eager(twin(x)) * upstream).sum().backward()
        assert_grads_equal(model, eager, step)
    assert graphed.num_graphs == 2
    assert graphed.stats["grads_added"] >= 2, graphed.stats
    assert graphed.stats["param_grads_copied"] == 0, graphed.stats


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
    # A second graph of the model shares its grad stores, and has the tails.
    sharer = cgraph.make_graphed(model, (make_input(),))
    for step in range(3):  # .grad starts as None (copy tail), then accumulates (add tail)
        x = make_input()
        upstream = torch.randn(8, 7, device=CUDA, dtype=dtype)
        (sharer(x) * upstream).sum().backward()
        (eager(x) * upstream).sum().backward()
        assert_grads_equal(model, eager, step)
    assert sharer.stats["grads_copied"] == 1 and sharer.stats["grads_added"] == 2
    for net in (model, eager):  # the first graph: in place, then the general path
        net.zero_grad(set_to_none=True)
    for step in range(3):
        x = make_input()
        upstream = torch.randn(8, 7, device=CUDA, dtype=dtype)
        (graphed(x) * upstream).sum().backward()
        (eager(x) * upstream).sum().backward()
        assert_grads_equal(model, eager, step)


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
                             "copied_in_graph": 6, "copied_before": 0,
                             "written_back": 0, "outputs_copied": 0, "outputs_invalidated": 0,
                             "input_grads_copied": 0, "param_grads_copied": 0,
                             "eager_pending": 0,
                             "eager_past_limit": 0, "eager_on_miss": 0,
                             "args_flattened": 0, "graphs": 1}


@pytest.mark.parametrize("graph", ["first", "second"])
def test_grad_paths_switch_between_backwards_of_one_graph(graph):
    """The tails are optional parts of the backward graph, switched before
    each replay: copy, add, the general path (neither tail) and back, in
    every order, each matching eager accumulation bitwise.  A tail left on
    would add twice or overwrite; one left off would leave a stale grad.
    The first graph of a model computes its grads in place and has no
    tails: accumulating takes the general path after moving the grads."""
    torch.manual_seed(12)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    if graph == "second":  # shares the first one's stores, through its tails
        graphed = cgraph.make_graphed(model, (make_input(),))
    # Every switch: copy->add, add->add, add->copy, copy->slow, slow->copy,
    # add->slow, copy->copy.  (The general path leaves a .grad that is not
    # cgraph's, so only zero_grad leads back to the tails.)
    plan = ["copy", "add", "add", "copy", "slow", "copy", "add", "slow", "copy", "copy", "add"]
    expected = {"copy": "grads_copied", "add": "grads_added", "slow": "grads_slow"}
    if graph == "first":
        expected["add"] = "grads_slow"
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


@pytest.mark.parametrize("twist", ["assigned_grad", "frozen_after_capture", "held_grad",
                                   "frozen_before_backward"])
def test_unusual_grad_states_match_eager(twist):
    """frozen_before_backward: a parameter frozen between the forward and
    its backward gets no grad, as autograd's AccumulateGrad skips it (before,
    the backward replay still handed it one)."""
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
        outs = graphed(x), eager(twin(x))
        if twist == "frozen_before_backward" and step == 1:
            for net in (model, eager):
                net[2].weight.requires_grad_(False)
        for out in outs:
            (out * upstream).sum().backward()
        assert_grads_equal(model, eager, step)
        if twist == "held_grad":
            held.append((model[0].weight.grad, model[0].weight.grad.clone()))
        for net in (model, eager):
            net.zero_grad(set_to_none=True)
    for grad, value in held:
        assert_equal(grad, value, "a .grad kept across zero_grad")
    # A kept .grad is the memory the backward graph computes in: the next
    # forward moves it out of the way, and that backward computes in place.
    stats = graphed.stats
    if twist == "held_grad":
        assert stats["param_grads_copied"] == 2 and stats["grads_slow"] == 0, stats
    else:
        assert stats["grads_slow"] >= 1, stats


# ---- hooks ------------------------------------------------------------------


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


def test_parameter_hooks_registered_before_graphing_run_once_per_backward():
    """Note [Grad accumulators during capture] (csrc/aten_setup.cpp): a
    tensor hook registered before graphing is set aside with the grad
    accumulator, so warm-up and capture do not run it and the backward
    graph does not hold it; AccumulateGrad runs it once per replay.  Before,
    the captured grad was hooked and the replay hooked it again (g * 4)."""
    torch.manual_seed(12)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    calls = []
    model[0].weight.register_hook(lambda g: calls.append(1) or g * 2)
    eager[0].weight.register_hook(lambda g: g * 2)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    assert calls == [], "the hook ran during warm-up or capture"
    for step in range(2):
        x = make_input()
        upstream = torch.randn(8, 16, device=CUDA)
        (model(x) * upstream).sum().backward()
        (eager(twin(x)) * upstream).sum().backward()
        assert len(calls) == step + 1
        assert_grads_equal(model, eager, step)


def test_hooks_of_a_leaf_read_from_a_closure_run_once_per_backward():
    """A leaf the forward reads outside its parameters (adopted at warm-up:
    Engine::adopt_hidden_leaves) has its accumulator and hooks set aside as
    a parameter's: the optimizer-in-backward pattern (a post-accumulate-grad
    hook that steps) stepped at warm-up and was captured into the backward
    graph before."""
    torch.manual_seed(13)
    w = torch.randn(32, 16, device=CUDA, requires_grad=True)
    w_e = w.detach().clone().requires_grad_()
    seen, calls = [], []
    for leaf, log in ((w, True), (w_e, False)):
        leaf.register_hook(lambda g, log=log: (calls.append(1) if log else None) or g * 2)
    w.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.clone()))
    graphed = cgraph.make_graphed_callables(lambda x: torch.tanh(x @ w),
                                            (torch.randn(8, 32, device=CUDA),))
    assert (calls, seen) == ([], []), "a hook ran during warm-up or capture"
    for step in range(2):
        x, upstream = torch.randn(8, 32, device=CUDA), torch.randn(8, 16, device=CUDA)
        (graphed(x) * upstream).sum().backward()
        (torch.tanh(x @ w_e) * upstream).sum().backward()
        assert (len(calls), len(seen)) == (step + 1, step + 1)
        assert_equal(w.grad, w_e.grad, f"step {step}: the closure leaf's grad")
        assert_equal(seen[-1], w_e.grad, f"step {step}: the grad the hook saw")


def test_a_hook_the_forward_registers_on_its_first_call_runs_once_per_backward():
    """Note [Grad accumulators during capture]: a forward that registers a
    tensor hook on its first call (the first warm-up's) on a parameter with
    none before.  The hook went on the tensor after it was set aside, so the
    set-up's backwards ran it and the capture's graph held it, then
    AccumulateGrad ran it again at each replay: g * 4 where eager has g * 2."""
    class HooksOnFirstCall(nn.Module):
        def __init__(self, log):
            super().__init__()
            self.lin, self.log, self.hooked = nn.Linear(32, 16), log, False

        def forward(self, x):
            if not self.hooked:
                self.lin.weight.register_hook(lambda g: self.log.append(1) or g * 2)
                self.hooked = True
            return torch.tanh(self.lin(x))

    torch.manual_seed(14)
    calls, calls_e = [], []
    model, eager = HooksOnFirstCall(calls).to(CUDA), HooksOnFirstCall(calls_e).to(CUDA)
    eager.load_state_dict(model.state_dict())
    model = cgraph.make_graphed_callables(model, (torch.randn(8, 32, device=CUDA),))
    assert calls == [], "the hook ran during warm-up or capture"
    for step in range(2):
        x, upstream = torch.randn(8, 32, device=CUDA), torch.randn(8, 16, device=CUDA)
        (model(x) * upstream).sum().backward()
        (eager(twin(x)) * upstream).sum().backward()
        assert (len(calls), len(calls_e)) == (step + 1, step + 1)
        assert_grads_equal(model, eager, step)


def test_hooks_on_a_closure_leafs_accumulator_node_run_once_per_backward():
    """A closure leaf whose AccumulateGrad node carries hooks, held as DDP's
    reducer and _apply_optimizer_in_backward hold it.  The first warm-up's
    forward builds its graph on that node before the leaf is found and set
    aside (Engine::adopt_hidden_leaves), so the node's hooks went aside too:
    before, they ran at the first warm-up (an optimizer in backward stepped
    there)."""
    torch.manual_seed(15)
    w = torch.randn(32, 16, device=CUDA, requires_grad=True)
    w_e = twin(w)
    nodes = [leaf.view_as(leaf).grad_fn.next_functions[0][0] for leaf in (w, w_e)]
    runs = [[], []]
    for node, ran in zip(nodes, runs):
        node.register_hook(lambda grads_in, grads_out, ran=ran: ran.append(1))
        node.register_prehook(lambda grads_out, ran=ran: ran.append(0))
    graphed = cgraph.make_graphed_callables(lambda x: torch.tanh(x @ w),
                                            (torch.randn(8, 32, device=CUDA),))
    assert runs[0] == [], "the node's hooks ran during warm-up or capture"
    for step in range(2):
        x, upstream = torch.randn(8, 32, device=CUDA), torch.randn(8, 16, device=CUDA)
        (graphed(x) * upstream).sum().backward()
        (torch.tanh(x @ w_e) * upstream).sum().backward()
        assert runs[0] == runs[1] == [0, 1] * (step + 1), runs
        assert_equal(w.grad, w_e.grad, f"step {step}: the closure leaf's grad")


def test_a_double_backward_through_a_graphed_callable_raises():
    """create_graph=True (a gradient penalty): the replayed grads have no
    history, so a second backward would silently miss the graphed part.
    Refused, naming the fix; the next call and backward go on."""
    model, make_input = mlp()
    graphed = cgraph.make_graphed_callables(model, (make_input(),))
    x = make_input()
    with pytest.raises(RuntimeError, match=r"create_graph=True.*Run it eagerly.*"
                                           r"type\(module\).forward"):
        torch.autograd.grad(graphed(x).sum(), x, create_graph=True)
    x = make_input()
    graphed(x).sum().backward()
    assert x.grad is not None


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


def test_a_weight_tied_across_callables_graphed_together_keeps_its_accumulator():
    """Note [A set-up puts back what it changed] (csrc/aten_setup.cpp): an
    embedding and a head sharing one weight, graphed in one call, each set
    the weight's grad accumulator aside; put back in the order taken, the
    original node was lost, and hooks held on it (as DDP's reducer holds
    its hooks) never ran again.  Here a hook on the node, held from before
    graphing, runs once per backward, as eager's does."""
    torch.manual_seed(11)

    def tied():
        embed, head = nn.Embedding(64, 32).to(CUDA), nn.Linear(32, 64, bias=False).to(CUDA)
        head.weight = embed.weight
        return embed, head

    def accumulator(p):  # the AccumulateGrad node, held as DDP holds it
        return p.view_as(p).grad_fn.next_functions[0][0]

    (embed, head), (embed_e, head_e) = tied(), tied()
    head_e.weight = embed_e.weight = nn.Parameter(embed.weight.detach().clone())
    nodes, runs = [accumulator(embed.weight), accumulator(embed_e.weight)], [[], []]
    for node, ran in zip(nodes, runs):
        node.register_hook(lambda grads_in, grads_out, ran=ran: ran.append(1))
    ids = lambda: torch.randint(0, 64, (8, 4), device=CUDA)  # noqa: E731
    g_embed, g_head = cgraph.make_graphed_callables(
        (embed, head), ((ids(),), (torch.randn(8, 4, 32, device=CUDA, requires_grad=True),)))
    assert accumulator(embed.weight) is nodes[0], "the weight's accumulator was replaced"
    for step in range(2):
        tokens, upstream = ids(), torch.randn(8, 4, 64, device=CUDA)
        (g_head(g_embed(tokens)) * upstream).sum().backward()
        (head_e(embed_e(tokens)) * upstream).sum().backward()
        assert len(runs[0]) == len(runs[1]) == step + 1, runs
    assert_equal(embed.weight.grad, embed_e.weight.grad, "the tied weight's grad")


def test_a_failed_capture_puts_back_the_running_stats_warm_up_moved():
    """Note [A set-up puts back what it changed]: warm-up's BatchNorm
    updates are undone when the capture fails (here a host sync inside
    it), as when it succeeds; they stayed before."""
    class SyncsWhenCaptured(nn.Sequential):
        def forward(self, x):
            if torch.cuda.is_current_stream_capturing():
                x.sum().item()  # a host sync: the capture fails
            return super().forward(x)

    torch.manual_seed(12)
    model = SyncsWhenCaptured(nn.Linear(16, 16), nn.BatchNorm1d(16)).to(CUDA)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(cgraph.CaptureError) as info:
        cgraph.make_graphed(model, (torch.randn(8, 16, device=CUDA, requires_grad=True),))
    assert info.value.kind == "sync", info.value
    for name, value in model.state_dict().items():
        assert_equal(value, before[name], f"{name} after the failed capture")


# ---- closure leaves, the caller's autograd history, unused parameters -------


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


# ---- errors: backward order, requires_grad ----------------------------------


def test_a_second_forward_before_the_first_backward_runs_eagerly():
    """Note [Calls before their backwards]: the first call's backward still
    reads the graph's activations, so with one graph (max_graphs=1, torch's
    rule) the second call runs eagerly and both backwards give eager's
    grads (torch's would be wrong).  By default it gets a graph of its own:
    test_drop_in.py."""
    torch.manual_seed(20)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),), max_graphs=1)
    x1, x2 = make_input(), make_input()
    first_loss, second_loss = model(x1).square().sum(), model(x2).sum()
    first_loss.backward()
    second_loss.backward()
    eager(twin(x1)).square().sum().backward()
    eager(twin(x2)).sum().backward()
    assert_grads_equal(model, eager, "after both backwards")
    stats = model.forward.stats
    assert stats["eager_pending"] == 1 and stats["forward"] == 1 and stats["backward"] == 1


def test_input_requiring_grad_unlike_its_sample_is_accepted_until_a_backward_needs_it():
    """With torch's rule of one graph (max_graphs=1), as torch: the call
    replays; only a backward that needs that input's grad raises, saying
    what to do.  (By default such a call captures a graph of its own, as
    make_graphed's does: test_shapes.py.)"""
    torch.manual_seed(21)
    model, _ = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (torch.randn(8, 32, device=CUDA),),
                                          max_graphs=1)
    x = torch.randn(8, 32, device=CUDA, requires_grad=True)
    out = model(x)
    assert out.requires_grad
    assert_equal(out, eager(x), "output")
    with pytest.raises(RuntimeError, match="requires grad, but its sample did not.*"
                                           r"sample.requires_grad_\(\)"):
        out.sum().backward()
    assert x.grad is None
    del out  # its backward never ran: the next call would run eagerly
    # The same argument detached replays and trains as eager does (a dense
    # upstream grad: .sum()'s stride-0 one is one ulp off, see test_replay.py).
    upstream = torch.randn(8, 16, device=CUDA)
    (model(x.detach()) * upstream).sum().backward()
    (eager(x.detach()) * upstream).sum().backward()
    assert_grads_equal(model, eager, "after the refused backward")
    assert model.forward.stats["forward"] == 2 and model.forward.stats["eager_pending"] == 0


# ---- autocast ---------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_its_weight_cache_matches_eager_over_optimizer_steps(dtype):
    """torch refuses cache_enabled=True (the default).  With it, a graph that
    baked in a cached cast would keep using stale weights after each step;
    lr=0.05 moves the weights far outside the stated tolerance."""
    torch.manual_seed(0)
    eager = stack()
    graphed_model = copy.deepcopy(eager)
    x0 = torch.randn(16, 64, device=CUDA, requires_grad=True)
    with torch.autocast(CUDA, dtype=dtype):  # cache_enabled=True
        graphed = cgraph.make_graphed(graphed_model, (x0,))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(graphed_model.parameters(), lr=0.05)
    first = None
    tol = dict(rtol=1.6e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-4)
    for step in range(4):
        x = torch.randn(16, 64, device=CUDA)
        upstream = torch.randn(16, 64, device=CUDA)
        outs = []
        for model, opt in ((eager, opt_e), (graphed, opt_g)):
            with torch.autocast(CUDA, dtype=dtype):
                out = model(x)
                loss = (out.float() * upstream).sum()
            loss.backward()
            outs.append(out.detach().clone())
            opt.step()
            opt.zero_grad()
        assert outs[1].dtype == dtype and outs[1].isfinite().all()
        torch.testing.assert_close(outs[1], outs[0], **tol, msg=f"step {step}: output")
        if step == 0:
            first = (x, outs[1])
        for (name, p), q in zip(graphed_model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=f"step {step}: {name} after the step")
    # The steps moved the output beyond the tolerance: a stale cast would show.
    with torch.autocast(CUDA, dtype=dtype):
        again = graphed(first[0])
    assert not torch.allclose(again, first[1], **tol)


def test_calling_outside_the_captured_autocast_raises():
    model = stack()
    x = torch.randn(16, 64, device=CUDA)
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        graphed = cgraph.make_graphed(model, (x,), max_graphs=None)
        graphed(x)
    with pytest.raises(RuntimeError, match=r"captured with CUDA autocast enabled .*called with "
                                           r"it disabled"):
        graphed(x)
    with torch.autocast(CUDA, dtype=torch.float16):
        with pytest.raises(RuntimeError, match="dtype Half"):
            graphed(x)

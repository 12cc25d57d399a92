"""What replacing torch.cuda.make_graphed_callables with cgraph's must not
break, and what it fixes: outputs kept across calls keep their values,
several calls before their backwards give eager's grads (eagerly, or in any
order), a short last batch captures a graph of its own, arguments equal to the callable's own defaults replay, an input of
another floating dtype is cast as torch casts it, and a graphed training
script prints nothing.  Comparisons are bitwise against eager PyTorch."""

import copy
import logging
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import cgraph
from _helpers import CUDA, assert_equal, assert_grads_equal, backward_as_eager, mlp, stack, twin

pytestmark = pytest.mark.gpu


# ---- outputs kept across calls ------------------------------------------------


def test_kept_outputs_keep_their_values_and_cost_one_copy_each():
    """Note [Outputs of earlier calls]: a list of predictions, a view of one,
    and IPython's Out[] all hold outputs of earlier calls."""
    torch.manual_seed(30)
    model = stack()
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),))
    xs = [torch.randn(16, 64, device=CUDA) for _ in range(4)]
    with torch.no_grad():
        predictions = [graphed(x) for x in xs]
        first_row = predictions[0][0]
        for i, (x, y) in enumerate(zip(xs, predictions)):
            assert_equal(y, model(x), f"prediction {i}")
        assert_equal(first_row, model(xs[0])[0], "a view of the first prediction")
        total = predictions[0] + predictions[1]
        assert_equal(total, model(xs[0]) + model(xs[1]), "two calls' outputs together")
    # Calls 2..4 each found the previous call's output held: one copy each.
    assert graphed.stats["outputs_copied"] == 3, graphed.stats


@pytest.mark.parametrize("kept", ["copy", "error"])
def test_a_replay_over_a_held_output_is_logged_once(kept, caplog):
    """The copy (or the read guard) a held output costs is logged, once per
    callable, and counted."""
    model = stack()
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),),
                                  kept_outputs=kept)
    with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
        held = [graphed(torch.randn(16, 64, device=CUDA)) for _ in range(3)]
    verb = {"copy": "copied to memory of its own", "error": "it now raises when read"}[kept]
    lines = [r.getMessage() for r in caplog.records if verb in r.getMessage()]
    assert len(lines) == 1 and "callable 0 (Sequential)" in lines[0], caplog.text
    counter = {"copy": "outputs_copied", "error": "outputs_invalidated"}[kept]
    assert graphed.stats[counter] == 2 and len(held) == 3, graphed.stats


def test_outputs_nobody_keeps_cost_nothing():
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    for _ in range(4):
        graphed(make_input()).sum().backward()
    assert graphed.stats["outputs_copied"] == 0, graphed.stats


def test_a_loss_kept_for_later_keeps_its_value_and_its_backward():
    """losses.append(loss) without .item(): the graphed output (and what
    autograd saved from it) stays valid across later calls and backwards."""
    torch.manual_seed(31)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    kept, kept_eager = [], []
    for step in range(3):
        x = make_input()
        out, out_e = graphed(x), eager(twin(x))
        kept.append(out)
        kept_eager.append(out_e.detach())
        out.square().mean().backward()
        out_e.square().mean().backward()
        assert_grads_equal(model, eager, step)
    for step, (a, b) in enumerate(zip(kept, kept_eager)):
        assert_equal(a.detach(), b, f"output of step {step}")


# ---- several calls before their backwards -------------------------------------


class Siamese(nn.Module):
    def __init__(self):
        super().__init__()
        self.encoder = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.1),
                                     nn.Linear(64, 16))

    def forward(self, x):
        return self.encoder(x)


@pytest.mark.parametrize("max_graphs", [None, 8], ids=["eagerly", "instances"])
def test_two_forwards_before_one_backward_match_eager(max_graphs):
    """A siamese loss: torch's graphs would overwrite the first call's
    activations (wrong grads, relative error 1).  With one graph (torch's
    rules) cgraph runs the second call eagerly; with room for more it
    captures a second instance and both calls replay.  Dropout included:
    the generator moves as in eager."""
    torch.manual_seed(32)
    encoder = Siamese().to(CUDA)
    eager = copy.deepcopy(encoder)
    sample = torch.randn(8, 32, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed(encoder, (sample,), max_graphs=max_graphs)
    for step in range(3):
        a, b = torch.randn(8, 32, device=CUDA), torch.randn(8, 32, device=CUDA)
        torch.cuda.manual_seed(100 + step)
        loss = (graphed(a) - graphed(b)).square().sum()
        torch.cuda.manual_seed(100 + step)
        loss_e = (eager(a) - eager(b)).square().sum()
        assert_equal(loss, loss_e, f"step {step}: loss")
        loss.backward()
        loss_e.backward()
        assert_grads_equal(encoder, eager, step)
        # Each step from no grads: eager sums both calls' grads before its one
        # AccumulateGrad, cgraph adds them one by one, which rounds alike
        # only when the sum starts empty.
        encoder.zero_grad(set_to_none=True)
        eager.zero_grad(set_to_none=True)
    stats = graphed.stats
    if max_graphs is None:
        assert stats["eager_pending"] == 3 and stats["backward"] == 3
    else:
        assert stats["eager_pending"] == 0 and stats["graphs"] == 2
        assert stats["forward"] == 6 and stats["backward"] == 6


def test_the_drop_in_captures_a_short_last_batch_logged_and_counted(caplog):
    """The drop-in's default (max_graphs=8): a batch of another size
    captures a graph for it, as make_graphed does, with make_graphed's log
    line and stats; training equals eager's.  torch raises here."""
    torch.manual_seed(34)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    model = cgraph.make_graphed_callables(model, (make_input(),))
    caplog.set_level(logging.INFO, logger="cgraph")
    for rows in (None, 3, None, 3):
        x = make_input() if rows is None else torch.randn(rows, 32, device=CUDA,
                                                         requires_grad=True)
        xe = twin(x)
        assert_equal(model(x), eager(xe), f"output ({rows or 'sample'} rows)")
        # A dense upstream grad: sum()'s is stride-0, which eager hands cuBLAS
        # as is and a graph as a dense buffer, one ulp apart by design
        # (test_autograd.py, Note [Incoming grads] in csrc/aten_backward.cpp).
        upstream = torch.randn(x.shape[0], 16, device=CUDA)
        (model(x) * upstream).sum().backward()
        (eager(xe) * upstream).sum().backward()
        assert_equal(x.grad, xe.grad, f"input grad ({rows or 'sample'} rows)")
        assert_grads_equal(model, eager, rows)
    stats = model.forward.stats
    assert stats["graphs"] == 2 and stats["eager_past_limit"] == 0, stats
    assert any("captured graph 2" in r.getMessage() and "(3, 32)" in r.getMessage()
               for r in caplog.records), [r.getMessage() for r in caplog.records]


def test_callables_graphed_together_capture_a_short_batch_in_their_one_pool():
    """A tuple of callables (two blocks and a head) graphed together: a short
    last batch captures each one's graph for it in the group's pool, in the
    order they run, as the first graphs were (not a pool per callable), and
    training equals eager's, batch after batch of either size."""
    torch.manual_seed(35)
    blocks = [stack(width=64, depth=2) for _ in range(2)]
    head = nn.Linear(64, 16).to(CUDA)
    eager = [copy.deepcopy(m) for m in (*blocks, head)]
    x = torch.randn(8, 64, device=CUDA, requires_grad=True)
    h = torch.randn(8, 64, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed_callables((*blocks, head), ((x,), (h,), (h,)))
    for step, rows in enumerate((8, 3, 8, 3, 3)):
        x = torch.randn(rows, 64, device=CUDA, requires_grad=True)
        xe = twin(x)
        out = graphed[2](graphed[1](graphed[0](x)))
        out_e = eager[2](eager[1](eager[0](xe)))
        assert_equal(out, out_e, f"step {step} ({rows} rows): output")
        upstream = torch.randn(rows, 16, device=CUDA)
        (out * upstream).sum().backward()
        (out_e * upstream).sum().backward()
        assert_equal(x.grad, xe.grad, f"step {step}: input grad")
        for k, (g, e) in enumerate(zip(graphed, eager)):
            assert_grads_equal(g, e, f"{step}, callable {k}")
    pool = graphed[0].forward.pool
    for k, g in enumerate(graphed):
        assert g.forward.num_graphs == 2, (k, g.forward.stats)
        assert g.forward.pools == [pool], (k, g.forward.pools, pool)
        assert g.forward.stats["eager_pending"] == g.forward.stats["eager_on_miss"] == 0


def test_the_drop_in_with_max_graphs_1_keeps_torchs_rule():
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),), max_graphs=1)
    with pytest.raises(ValueError, match=r"captured with shape"):
        model(torch.randn(3, 32, device=CUDA))
    assert model.forward.stats["graphs"] == 1


def test_a_later_graph_leaves_parameters_it_does_not_use_without_grad():
    """allow_unused_input=False checks the first graph.  In eval mode a
    train-only auxiliary head (torchvision's Inception) reads no parameter:
    that call's graph gives them no grad, as eager does (it raised, asking
    for allow_unused_input, in the middle of a saliency map)."""
    class WithAux(nn.Module):
        def __init__(self):
            super().__init__()
            self.body, self.aux = nn.Linear(32, 16), nn.Linear(16, 16)

        def forward(self, x):
            h = torch.relu(self.body(x))
            return h + self.aux(h) if self.training else h

    torch.manual_seed(15)
    model = WithAux().to(CUDA)
    eager = copy.deepcopy(model)
    x = torch.randn(8, 32, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed_callables(model, (x,))
    for m in (graphed, eager):
        m.eval()
    x = torch.randn(8, 32, device=CUDA, requires_grad=True)
    xe = twin(x)
    backward_as_eager(graphed(x), eager(xe), x, xe)
    assert model.aux.weight.grad is None and eager.aux.weight.grad is None
    assert_grads_equal(model, eager, 0)


def test_micro_batches_forwards_first_then_backwards_in_any_order():
    """A pipeline schedule: k forwards, then their backwards in another
    order.  Every backward sees its own forward's activations."""
    torch.manual_seed(33)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),))
    xs = [make_input() for _ in range(3)]
    losses = [graphed(x).square().sum() for x in xs]
    losses_e = [eager(twin(x)).square().sum() for x in xs]
    for k in (1, 0, 2):
        losses[k].backward()
        losses_e[k].backward()
    assert_grads_equal(model, eager, "after three micro-batches")
    assert graphed.stats["graphs"] == 3 and graphed.stats["eager_pending"] == 0


# ---- defaults are not arguments --------------------------------------------------


class Block(nn.Module):
    """Called as Hugging Face models call their layers: every optional
    argument spelled out."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(32, 32)

    def forward(self, hidden, attention_mask=None, scale=1.0, use_cache=False,
                output_attentions=False, *, position_ids=None):
        out = self.lin(hidden) * scale
        return out if attention_mask is None else out * attention_mask


def test_arguments_equal_to_the_callables_defaults_replay():
    torch.manual_seed(34)
    block = Block().to(CUDA)
    eager = copy.deepcopy(block)
    graphed = cgraph.make_graphed(block, (torch.randn(4, 32, device=CUDA),))
    x = torch.randn(4, 32, device=CUDA)
    calls = [((x, None), {}), ((x,), {"use_cache": False, "output_attentions": False}),
             ((x, None, 1.0), {"position_ids": None}), ((x,), {"attention_mask": None})]
    for i, (args, kwargs) in enumerate(calls):
        with torch.no_grad():
            assert_equal(graphed(*args, **kwargs), eager(*args, **kwargs), f"call {i}")
    assert graphed.stats["forward"] == len(calls)


@pytest.mark.parametrize("call, error, text", [
    (lambda g, x: g(x, use_cache=True), ValueError, "'use_cache' is True.*default False"),
    (lambda g, x: g(x, scale=1), ValueError, "'scale' is 1.*default 1.0"),
    (lambda g, x: g(x, torch.ones(4, 32, device=CUDA)), ValueError,
     "'attention_mask' is a Tensor.*default None"),
    (lambda g, x: g(x, colour="red"), TypeError, "unexpected keyword argument 'colour'"),
])
def test_other_values_for_left_out_arguments_raise(call, error, text):
    block = Block().to(CUDA)
    graphed = cgraph.make_graphed(block, (torch.randn(4, 32, device=CUDA),), max_graphs=None)
    with pytest.raises(error, match=text):
        call(graphed, torch.randn(4, 32, device=CUDA))


# ---- an input of another floating dtype -----------------------------------------


def test_an_input_of_another_floating_dtype_is_cast_and_its_grad_comes_back_in_its_dtype():
    """With one graph, as torch copies into its static input: the graph
    computes in the sample's dtype, and autograd casts the grad to the
    input's."""
    torch.manual_seed(35)
    model, make_input = mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (make_input(),), max_graphs=None)  # torch's rules
    x = torch.randn(8, 32, device=CUDA, dtype=torch.float16, requires_grad=True)
    xe = twin(x)
    out, out_e = graphed(x), eager(xe.float())
    assert out.dtype == torch.float32
    assert_equal(out, out_e, "output")
    backward_as_eager(out, out_e, x, xe, "input grad, in the input's dtype")
    assert x.grad.dtype == torch.float16
    assert_grads_equal(model, eager, "after a cast input")


def test_with_several_graphs_another_dtype_gets_a_graph_that_computes_as_eager():
    """make_graphed: a function without parameters keeps the call's dtype,
    as eager does (the cast computed in the sample's and returned it); a
    float32 module called with half raises eager's error, where the cast
    computed in float32 without a word.  The drop-in casts, as torch's
    does, with its several graphs too."""
    def act(x):
        return torch.nn.functional.gelu(x) * 2

    graphed = cgraph.make_graphed(act, (torch.randn(8, 32, device=CUDA),))
    x = torch.randn(8, 32, device=CUDA, dtype=torch.bfloat16)
    out = graphed(x)
    assert out.dtype == torch.bfloat16 and graphed.num_graphs == 2
    assert_equal(out, act(x), "bf16 output")
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    with pytest.raises(RuntimeError) as raised:
        graphed(make_input().half())
    assert "dtype" in f"{raised.value} {raised.value.__cause__}", raised.value
    with pytest.raises(RuntimeError, match="dtype"):
        model(make_input().half())
    drop_in = cgraph.make_graphed_callables(copy.deepcopy(model), (make_input(),))
    x = make_input()
    with torch.no_grad():
        assert_equal(drop_in(x.half()), model(x.half().float()), "the drop-in, cast")
    assert drop_in.forward.num_graphs == 1


# ---- quiet --------------------------------------------------------------------------


QUIET_SCRIPT = textwrap.dedent("""
    import torch, cgraph
    from torch import nn
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(0.1), nn.Linear(128, 10)).cuda()
    opt = torch.optim.AdamW(model.parameters())
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    model = cgraph.make_graphed_callables(model, (x,))
    for step in range(5):
        opt.zero_grad()
        loss = nn.functional.cross_entropy(model(torch.randn(32, 64, device="cuda")),
                                           torch.randint(0, 10, (32,), device="cuda"))
        loss.backward()
        opt.step()
    torch.cuda.synchronize()
    print("trained", loss.item() > 0)
""")


def test_a_graphed_training_script_prints_no_warning():
    """torch's own make_graphed_callables prints cuBLAS's "no current CUDA
    context" warning; Note [A CUDA context on autograd's thread]."""
    env = {**os.environ, "PYTHONWARNINGS": "default", "CGRAPH_LOGS": ""}
    done = subprocess.run([sys.executable, "-W", "default", "-c", QUIET_SCRIPT],
                          capture_output=True, text=True, timeout=300, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "trained True"
    assert done.stderr == "", done.stderr


# ---- copies: Note [Copying a graphed model] -----------------------------------


def test_an_ema_copy_of_a_trained_graphed_model_runs_eagerly_on_its_own_weights():
    """copy.deepcopy after graphed training (an EMA model; Lightning's
    WeightAveraging copies the module so): the copy computes what the
    original computes, eagerly, on parameters of its own; the original
    keeps replaying its graphs. torch's drop-in shares the graphed forward
    with the copy, which replays the original's graphs on its weights."""
    torch.manual_seed(31)
    model = nn.Sequential(stack(), nn.Linear(64, 8).to(CUDA))
    x = torch.randn(16, 64, device=CUDA, requires_grad=True)
    cgraph.make_graphed_callables(model[0], (x,))  # the module itself, forward replaced
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(16, 64, device=CUDA)).square().mean().backward()
        opt.step()
        opt.zero_grad()
    ema = copy.deepcopy(model)
    replays = model[0].forward.stats["forward"]
    y = torch.randn(16, 64, device=CUDA)
    assert_equal(ema(y), model(y), "the copy against the graphed original")
    assert model[0].forward.stats["forward"] == replays + 1  # the original still replays
    assert not isinstance(ema[0].__dict__.get("forward"), cgraph.Graphed)
    with torch.no_grad():
        for p in ema.parameters():
            p.mul_(0.5)
    fresh = nn.Sequential(stack(), nn.Linear(64, 8).to(CUDA))
    fresh.load_state_dict(ema.state_dict())
    assert_equal(ema(y), fresh(y), "the copy on its own weights")
    assert not torch.equal(ema(y), model(y))

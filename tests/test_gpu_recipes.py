"""GPU tests of issue 6 on one GPU: activation checkpointing and torch.compile
inside graphed callables, and teardown.  The two-GPU DDP test is
tests/test_ddp.py.

Comparisons are bitwise: with the same generator state, a graph replays the
same kernels on the same data and the same random streams as eager mode."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cgraph
from _helpers import assert_equal

pytestmark = pytest.mark.gpu
CUDA = "cuda"


class Checkpointed(nn.Module):
    """Dropout before, inside and after two checkpointed regions."""

    def __init__(self, p=0.25, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Dropout(p)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(p), nn.Linear(128, 64))
            for _ in range(2))
        self.out = nn.Dropout(p)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.out(h)


def run_step(model, x, upstream, seed):
    """One forward and backward from a known generator state; returns the
    output, the input's grad and the generator state after the step."""
    torch.cuda.manual_seed(seed)
    out = model(x)
    (out * upstream).sum().backward()
    return out.detach().clone(), x.grad.clone(), torch.cuda.get_rng_state()


@pytest.mark.parametrize("reentrant", [False, True], ids=["non-reentrant", "reentrant"])
@pytest.mark.parametrize("p", [0.0, 0.25], ids=["no-dropout", "dropout"])
def test_checkpoint_matches_eager_checkpoint_bitwise(p, reentrant):
    torch.manual_seed(0)
    eager = Checkpointed(p, use_reentrant=reentrant).to(CUDA)
    graphed_model = copy.deepcopy(eager)
    graphed = cgraph.make_graphed(graphed_model,
                                  (torch.randn(32, 64, device=CUDA, requires_grad=True),))
    for step in range(3):
        x = torch.randn(32, 64, device=CUDA)
        upstream = torch.randn(32, 64, device=CUDA)
        xe, xg = x.clone().requires_grad_(), x.clone().requires_grad_()
        out_e, grad_e, rng_e = run_step(eager, xe, upstream, seed=100 + step)
        out_g, grad_g, rng_g = run_step(graphed, xg, upstream, seed=100 + step)
        assert_equal(out_g, out_e, f"step {step}: output")
        assert_equal(grad_g, grad_e, f"step {step}: input grad")
        for (name, pg), pe in zip(graphed_model.named_parameters(), eager.parameters()):
            assert_equal(pg.grad, pe.grad, f"step {step}: grad of {name}")
        assert torch.equal(rng_g, rng_e), f"step {step}: the generator moved unlike eager"
    if p:
        assert (out_g == 0).float().mean().item() > 0.1, "dropout did not drop"


def test_checkpointed_dropout_masks_differ_per_call():
    model = Checkpointed(0.5).to(CUDA)
    x = torch.randn(32, 64, device=CUDA)
    graphed = cgraph.make_graphed(model, (x,))
    first = graphed(x).clone()
    second = graphed(x).clone()
    assert not torch.equal(first, second)


def test_reentrant_region_reading_a_closure_leaf_is_refused_with_advice():
    """Its grad would be computed at capture only (Note [Backward capture
    runs .backward()])."""
    w = torch.randn(64, 64, device=CUDA, requires_grad=True)

    def f(x):
        return checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=True)

    with pytest.raises(RuntimeError) as info:  # in warm-up, before any capture
        cgraph.make_graphed(f, (torch.randn(8, 64, device=CUDA, requires_grad=True),))
    text = f"{info.value} {info.value.__cause__}"
    assert "use_reentrant=True" in text and "nn.Parameter" in text, text
    # The process stays usable, reentrant regions included.
    model = Checkpointed(0.25, use_reentrant=True).to(CUDA)
    graphed = cgraph.make_graphed(model, (torch.randn(32, 64, device=CUDA, requires_grad=True),))
    graphed(torch.randn(32, 64, device=CUDA)).sum().backward()


# ---- torch.compile inside ------------------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compiled_module_inside_matches_the_compiled_module_run_eagerly(mode):
    """Bitwise in default mode.  max-autotune may pick GEMM kernels that
    reduce in a run-dependent order (split-K); measured on an H200: a 1-ulp
    (2.4e-7) weight-grad difference in one run of three.  Its grads get a
    tolerance of a few ulps; its outputs stay bitwise."""
    grads_equal = assert_equal if mode == "default" else (
        lambda a, e, what: torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=what))
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(),
                          nn.Linear(64, 64)).to(CUDA)
    compiled = torch.compile(block, mode=mode)
    head = nn.Linear(64, 8).to(CUDA)

    def step(x):
        return head(compiled(x) + x)

    graphed = cgraph.make_graphed(step, (torch.randn(16, 64, device=CUDA, requires_grad=True),))
    params = list(block.parameters()) + list(head.parameters())
    for i in range(3):
        x = torch.randn(16, 64, device=CUDA)
        upstream = torch.randn(16, 8, device=CUDA)
        # As in warm-up, the compiled module sees an input requiring grad (no
        # recompilation for another guard).
        expected = step(x.clone().requires_grad_())
        (expected * upstream).sum().backward()
        expected_grads = [p.grad.clone() for p in params]
        for p in params:
            p.grad = None
        actual = graphed(x)
        (actual * upstream).sum().backward()
        assert_equal(actual, expected.detach(), f"call {i}: output")
        for k, (p, g) in enumerate(zip(params, expected_grads)):
            grads_equal(p.grad, g, f"call {i}: grad {k}")
        for p in params:
            p.grad = None


def test_reduce_overhead_inside_is_refused_with_advice():
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU()).to(CUDA)
    compiled = torch.compile(block, mode="reduce-overhead")
    x = torch.randn(16, 64, device=CUDA, requires_grad=True)
    with pytest.raises(cgraph.CaptureError, match="max-autotune-no-cudagraphs"):
        cgraph.make_graphed(compiled, (x,))
    assert_equal(block(x), block(x), "eager after the refusal")


# ---- teardown ---------------------------------------------------------------------------


def test_reset_all_frees_every_graph_and_its_pool():
    models = [nn.Linear(256, 256).to(CUDA) for _ in range(3)]
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    graphed = [cgraph.make_graphed(m, (x,)) for m in models]
    for g in graphed:
        g(x).sum().backward()
    pools = [g.pool for g in graphed]
    cgraph.reset_all()
    torch.cuda.synchronize()
    assert all(g.is_reset for g in graphed)
    for pool in pools:
        assert not [s for s in torch.cuda.memory_snapshot()
                    if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool)]
    with pytest.raises(RuntimeError, match="reset"):
        graphed[0](x)


def test_interpreter_exit_with_live_graphs_is_clean():
    script = textwrap.dedent("""
        import torch, cgraph
        from torch import nn
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU()).cuda()
        x = torch.randn(8, 64, device="cuda", requires_grad=True)
        graphed = cgraph.make_graphed(model, (x,))
        keep = graphed(x)
        keep.sum().backward()
        print("done", flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    assert run.stdout.strip() == "done"
    noisy = [line for line in run.stderr.splitlines()
             if any(w in line for w in ("Error", "error", "terminate", "Segmentation"))]
    assert not noisy, run.stderr


def test_checkpoint_compile_example_checks_out():
    run = subprocess.run([sys.executable, "-m", "examples.checkpoint_compile"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count(": OK") == 10, run.stdout

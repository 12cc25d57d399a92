"""Integration on one GPU: activation checkpointing (both use_reentrant
modes, with dropout inside and around the regions) and torch.compile inside
graphed callables, the checkpoint_compile example, and teardown (reset_all,
interpreter exit with live graphs).  Comparisons are bitwise against the
same model run eagerly from the same generator state, unless a test states
a tolerance.  The two-GPU DDP test is tests/test_ddp.py."""

import copy
import os
import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn

import cgraph
from _helpers import (CUDA, Checkpointed, assert_equal, inductor_deterministic, pool_segments,
                      run_step, state_as_captured)

pytestmark = pytest.mark.gpu


# ---- activation checkpointing -----------------------------------------------


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
    """Two calls after one seeding draw new masks, the ones two eager calls
    draw after the same seeding."""
    model = Checkpointed(0.5).to(CUDA)
    eager = copy.deepcopy(model)
    x = torch.randn(32, 64, device=CUDA)
    graphed = cgraph.make_graphed(model, (x,))
    torch.cuda.manual_seed(5)
    first = graphed(x).clone()
    second = graphed(x).clone()
    assert not torch.equal(first, second)
    torch.cuda.manual_seed(5)
    assert_equal(first, eager(x), "first call")
    assert_equal(second, eager(x), "second call")


# ---- torch.compile inside ---------------------------------------------------


@pytest.mark.parametrize("mode", ["default", "max-autotune-no-cudagraphs"])
def test_compiled_module_inside_matches_the_compiled_module_run_eagerly(mode):
    """Bitwise in default mode, against the compiled module called eagerly
    under the global state cgraph compiled it in (state_as_captured: the
    same compiled code, not a recompile, which was 1 ulp off on shared
    GPUs).  max-autotune may pick GEMM kernels that reduce in a
    run-dependent order (split-K), and breaks near-ties between kernels by
    timing: measured on an H200, a 1-ulp (2.4e-7) weight-grad difference in
    one run of three; on an H100 with other test processes on the GPU, a
    1-ulp output difference.  Its outputs and grads get a tolerance of a
    few ulps."""
    grads_equal = assert_equal if mode == "default" else (
        lambda a, e, what: torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-6, msg=what))
    torch.manual_seed(0)
    block = nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU(),
                          nn.Linear(64, 64)).to(CUDA)
    compiled = torch.compile(block, mode=mode)
    head = nn.Linear(64, 8).to(CUDA)

    def step(x):
        return head(compiled(x) + x)

    with inductor_deterministic(mode == "default"):
        graphed = cgraph.make_graphed(step, (torch.randn(16, 64, device=CUDA, requires_grad=True),))
        params = list(block.parameters()) + list(head.parameters())
        for i in range(3):
            x = torch.randn(16, 64, device=CUDA)
            upstream = torch.randn(16, 8, device=CUDA)
            # As in warm-up, the compiled module sees an input requiring grad (no
            # recompilation for another guard).
            with state_as_captured():
                expected = step(x.clone().requires_grad_())
                (expected * upstream).sum().backward()
            expected_grads = [p.grad.clone() for p in params]
            for p in params:
                p.grad = None
            actual = graphed(x)
            (actual * upstream).sum().backward()
            grads_equal(actual, expected.detach(), f"call {i}: output")
            for k, (p, g) in enumerate(zip(params, expected_grads)):
                grads_equal(p.grad, g, f"call {i}: grad {k}")
            for p in params:
                p.grad = None


def test_compiled_layers_graphed_into_one_pool_match_compiled_layers():
    """Layers captured one by one into one pool= keep their activations
    through capture (retain_graph=True), which a backward compiled with
    donated buffers refuses; cgraph compiles without them (Note [Patches
    during capture], item 6)."""
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.LayerNorm(64), nn.GELU()).to(CUDA)
              for _ in range(2)]
    twins = copy.deepcopy(blocks)
    for block in blocks + twins:
        block.forward = torch.compile(block.forward)
    pool = cgraph.graph_pool_handle()
    sample = (torch.randn(16, 64, device=CUDA, requires_grad=True),)
    graphed = [cgraph.make_graphed(b, sample, pool=pool) for b in blocks]
    for i in range(3):
        x = torch.randn(16, 64, device=CUDA)
        outs = []
        for layers in (graphed, twins):
            h = x.clone().requires_grad_()
            for layer in layers:
                h = layer(h)
            h.sum().backward()
            outs.append(h.detach())
        assert_equal(outs[0], outs[1], f"call {i}: output")
        for k, (b, t) in enumerate(zip(blocks, twins)):
            for p, q in zip(b.parameters(), t.parameters()):
                assert_equal(p.grad, q.grad, f"call {i}: grad of block {k}")
                p.grad = q.grad = None


# ---- examples ---------------------------------------------------------------


def test_checkpoint_compile_example_checks_out():
    run = subprocess.run([sys.executable, "-m", "examples.checkpoint_compile"],
                         capture_output=True, text=True, timeout=300,
                         cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert run.stdout.count(": OK") == 10, run.stdout


# ---- teardown ---------------------------------------------------------------


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
        assert not pool_segments(pool)
    with pytest.raises(RuntimeError, match="reset"):
        graphed[0](x)


def test_interpreter_exit_with_live_graphs_is_clean():
    """Note [Resets at exit] (csrc/aten_reset.cpp): the graphs are freed at
    exit, and nothing else runs on the device: the output still held gets no
    copy of its own (an atexit handler registered before cgraph's import runs
    after cgraph's and counts the device's allocations)."""
    script = textwrap.dedent("""
        import atexit, torch
        allocations = lambda: torch.cuda.memory_stats()["allocation.all.allocated"]
        atexit.register(lambda: print("after", allocations(), flush=True))
        import cgraph
        from torch import nn
        model = nn.Sequential(nn.Linear(64, 64), nn.GELU()).cuda()
        x = torch.randn(8, 64, device="cuda", requires_grad=True)
        graphed = cgraph.make_graphed(model, (x,))
        keep = graphed(x)
        keep.sum().backward()
        torch.cuda.synchronize()
        print("done", allocations(), flush=True)
    """)
    run = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0, run.stderr
    done, after = run.stdout.split()[:2], run.stdout.split()[2:]
    assert done[0] == "done" and after[0] == "after", run.stdout
    assert after[1] == done[1], f"allocations at exit: {run.stdout}"
    noisy = [line for line in run.stderr.splitlines()
             if any(w in line for w in ("Error", "error", "terminate", "Segmentation"))]
    assert not noisy, run.stderr

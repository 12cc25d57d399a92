"""The memory graphs hold beyond eager's: Note [One cuBLAS workspace per
stream] (csrc/aten_workspace.cpp) and Note [Replays on another stream]
(csrc/aten_replay.cpp).  Results are compared bitwise against eager
PyTorch."""

import copy
import logging
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import cgraph
from _helpers import CUDA, ROOT, assert_equal, assert_grads_equal, pool_segments, square_loss_step

pytestmark = pytest.mark.gpu


def settled_reserved():
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    return torch.cuda.memory_reserved()


def cublas_workspace_bytes():
    """What torch reserves for one (handle, stream) workspace: the growth of
    one GEMM's first run on a fresh stream, less its 2 MiB result segment."""
    a = torch.randn(64, 64, device=CUDA)
    before = settled_reserved()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        a @ a
    grown = settled_reserved() - before - (2 << 20)
    torch._C._cuda_clearCublasWorkspaces()  # that stream's entry, and any other
    return grown


def layers_and_head(seed):
    torch.manual_seed(seed)
    return [nn.Linear(256, 256).to(CUDA) for _ in range(4)], nn.Linear(256, 256).to(CUDA)


def graph_each(layers):
    """Each layer graphed on its own, so each has a pool of its own.  The
    samples become the static inputs, as in torch: fresh tensors each."""
    return [cgraph.make_graphed(layer, (torch.randn(64, 256, device=CUDA, requires_grad=True),))
            for layer in layers]


def train_step(layers, head, x):
    y = x
    for layer in layers:
        y = torch.relu(layer(y))
    head(y).sum().backward()


def test_separately_graphed_layers_share_eager_modes_cublas_workspace():
    """Four layers graphed one by one (four pools) beside an eager head, as
    per-layer graphs of a language model leave its LM head: graphing them
    reserves no workspace of its own.  Before, each pool held one (32 MiB
    on Hopper), and eager mode held two (the caller's thread and autograd's
    device thread); now all of them use one.  Grads stay bitwise eager's."""
    workspace = cublas_workspace_bytes()
    assert workspace >= (1 << 20), workspace
    layers, head = layers_and_head(50)
    eager_layers, eager_head = copy.deepcopy(layers), copy.deepcopy(head)
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    train_step(layers, head, x)  # eager: both threads' workspaces exist
    before = settled_reserved()
    graphed = graph_each(layers)
    for _ in range(3):
        train_step(graphed, head, x)
    grown = settled_reserved() - before
    assert len({g.pool for g in graphed}) == 4
    largest = max(s["total_size"] for g in graphed for s in pool_segments(g.pool))
    assert largest < workspace, (largest, workspace)
    assert grown < workspace, (grown, workspace)
    for m in (*layers, head, *eager_layers, eager_head):
        m.zero_grad(set_to_none=True)
    x.grad = None
    train_step(graphed, head, x)
    expected_x_grad = x.grad
    x.grad = None
    train_step(eager_layers, eager_head, x)
    assert_equal(expected_x_grad, x.grad, "the input's grad")
    for g, e in zip((*layers, head), (*eager_layers, eager_head)):
        assert_grads_equal(g, e, "after graphing")


def test_graphs_keep_their_workspace_when_torch_clears_its_own():
    """torch.compile clears torch's workspace entries around each recording
    (torch._C._cuda_clearCublasWorkspaces).  The graphs' workspace is
    cgraph's, and torch's entries only alias it, so the clear frees nothing
    a replay writes: memory handed out after it keeps its contents, and
    results stay eager's.  (Guards the aliases: were they to own the
    workspace, the clear would free it under the graphs.)"""
    layers, head = layers_and_head(51)
    eager_layers, eager_head = copy.deepcopy(layers), copy.deepcopy(head)
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    graphed = graph_each(layers)
    train_step(graphed, head, x)
    torch._C._cuda_clearCublasWorkspaces()
    # Whatever the clear freed is handed out again here.
    junk = [torch.full((8 << 20,), float("nan"), device=CUDA) for _ in range(4)]
    for m in (*layers, head):
        m.zero_grad(set_to_none=True)
    train_step(graphed, head, x)
    train_step(eager_layers, eager_head, x)
    for g, e in zip((*layers, head), (*eager_layers, eager_head)):
        assert_grads_equal(g, e, "after torch cleared its workspaces")
    torch.cuda.synchronize()
    assert all(bool(j.isnan().all()) for j in junk), "a replay wrote memory it does not own"


def test_a_replay_on_another_stream_is_ordered_with_the_callers():
    """Note [Replays on another stream]: the replay waits for the caller
    stream's work, and the caller stream's later work waits for the replay,
    so reading its output there without a wait_stream still sees it."""
    torch.manual_seed(52)
    model = nn.Sequential(nn.Linear(256, 256), nn.GELU(), nn.Linear(256, 256)).to(CUDA)
    x1, x2 = (torch.randn(64, 256, device=CUDA) for _ in range(2))
    graphed = cgraph.make_graphed(model, (torch.randn_like(x1),))
    with torch.no_grad():
        graphed(x1)  # the output buffer holds model(x1)
        expected = model(x2)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            torch.cuda._sleep(50_000_000)  # the side stream is still busy...
            out = graphed(x2)
        seen = out.clone()  # ...when the caller stream reads the output
    assert_equal(seen, expected, "the output read on the caller stream")


def test_a_later_graphs_first_gemm_does_not_look_like_warm_up_state(caplog):
    """Note [Warm-up in the pool]: the pool check counts memory a warm-up
    leaves allocated.  A later shape whose warm-up runs the callable's first
    GEMM makes the shared workspace; that is not the warm-up's, so the
    earlier graph stays in its pool and both results are eager's."""
    weight = torch.randn(256, 256, device=CUDA, requires_grad=True)

    def gemm_for_big_batches(x):
        return x @ weight if x.shape[0] > 4 else x * 2

    graphed = cgraph.make_graphed(gemm_for_big_batches)  # captures on the first calls
    small = torch.randn(2, 256, device=CUDA, requires_grad=True)
    big = torch.randn(8, 256, device=CUDA, requires_grad=True)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for _ in range(4):
            graphed(small).sum().backward()
        for _ in range(4):
            graphed(big).sum().backward()
    assert graphed.num_graphs == 2
    assert not any("those graphs are dropped" in r.getMessage() for r in caplog.records)
    for x in (small, big):
        weight.grad = x.grad = None
        graphed(x).sum().backward()
        got = (weight.grad, x.grad)
        weight.grad = x.grad = None
        gemm_for_big_batches(x).sum().backward()
        assert_equal(got[1], x.grad, f"the input's grad, batch {x.shape[0]}")
        if got[0] is not None:
            assert_equal(got[0], weight.grad, f"the weight's grad, batch {x.shape[0]}")


def test_set_up_after_eager_steps_allocates_no_workspace_of_its_own():
    """After eager steps, the warm-up and capture use the workspace eager
    GEMMs use from their first GEMM, and that workspace is one of eager
    mode's own: setting graphs up adds no workspace-sized peak beyond the
    pools (before, warm-up made one per thread on the capture stream, then
    the shared one was allocated beside them)."""
    workspace = cublas_workspace_bytes()
    layers, head = layers_and_head(53)
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    train_step(layers, head, x)  # eager: both threads' workspaces exist
    before = settled_reserved()
    torch.cuda.reset_peak_memory_stats()
    graphed = graph_each(layers)
    torch.cuda.synchronize()
    pools = sum(s["total_size"] for g in graphed for s in pool_segments(g.pool))
    # Beyond the pools the graphs keep: no workspace, not even for a while
    # (the shared one is one of eager mode's).
    growth = torch.cuda.max_memory_reserved() - before - pools
    assert growth < workspace / 2, (growth, workspace, pools)
    train_step(graphed, head, x)


def test_set_up_before_any_gemm_holds_one_workspace():
    """Graphs set up before any GEMM has run, as a script that graphs its
    model before training does (or after torch.compile cleared torch's
    entries): the warm-up's GEMMs on the caller's thread and on autograd's
    use the shared workspace from their first GEMM (Note [Naming a
    thread's cuBLAS handle], csrc/aten_workspace.cpp), so the set-up's peak
    holds one workspace.  Before,
    each thread got one of torch's on the capture stream, and the shared one
    came after them.  Grads stay bitwise eager's."""
    workspace = cublas_workspace_bytes()  # ends with torch's entries cleared
    torch.manual_seed(55)
    layer = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(CUDA)
    eager = copy.deepcopy(layer)
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    before = settled_reserved()
    torch.cuda.reset_peak_memory_stats()
    graphed = cgraph.make_graphed(layer, (torch.randn_like(x),))
    torch.cuda.synchronize()
    growth = torch.cuda.max_memory_reserved() - before
    assert growth < 1.5 * workspace, (growth, workspace)
    graphed(x).square().sum().backward()
    graphed_x_grad, x.grad = x.grad, None
    eager(x).square().sum().backward()
    assert_equal(graphed_x_grad, x.grad, "the input's grad")
    assert_grads_equal(layer, eager, "after a set-up before any GEMM")


def test_a_set_up_gives_the_caches_free_segments_back_first():
    """A set-up empties the cache before its warm-up, as torch.cuda.graph
    does: a free segment that eager work left on the caller stream (64 MiB
    here; in varlen's first pass, the last step's loss segment) cannot serve
    the warm-up on the capture stream, and holding both would raise the
    set-up's peak.  Here the set-up needs less than that segment, so the
    peak stays at what was reserved before it.  Results stay eager's."""
    torch.manual_seed(56)
    layer = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(CUDA)
    eager = copy.deepcopy(layer)
    x = torch.randn(64, 256, device=CUDA, requires_grad=True)
    sample = torch.randn_like(x)
    layer(x).sum().backward()  # eager: both threads' workspaces exist
    layer.zero_grad(set_to_none=True)
    x.grad = None
    settled_reserved()
    del_me = torch.empty(64 << 20, dtype=torch.uint8, device=CUDA)
    del del_me  # a free 64 MiB segment, cached on the caller stream
    torch.cuda.synchronize()
    before = torch.cuda.memory_reserved()
    torch.cuda.reset_peak_memory_stats()
    graphed = cgraph.make_graphed(layer, (sample,))
    torch.cuda.synchronize()
    peak = torch.cuda.max_memory_reserved()
    assert peak <= before, (peak - before) / 2**20
    out = graphed(x)
    out.sum().backward()
    graphed_x_grad, x.grad = x.grad, None
    expected = eager(x)
    expected.sum().backward()
    assert_equal(out, expected, "the output")
    assert_equal(graphed_x_grad, x.grad, "the input's grad")
    assert_grads_equal(layer, eager, "after a set-up that emptied the cache")


def test_a_graphed_steps_pool_holds_no_workspace():
    """make_graphed_step captures with no warm-up of its own: its eager
    calls' threads are the ones the shared workspace is made for, so its
    capture takes none from the pool, and the step trains as eager does."""
    workspace = cublas_workspace_bytes()
    torch.manual_seed(54)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 256)).to(CUDA)
    eager = copy.deepcopy(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1)
    xs = [torch.randn(64, 256, device=CUDA) for _ in range(5)]

    step = cgraph.make_graphed_step(square_loss_step(model, opt), (xs[0],))
    losses = [step(x).clone() for x in xs]
    losses_e = [square_loss_step(eager, opt_e)(x) for x in xs]
    largest = max(s["total_size"] for s in pool_segments(step.graphed.pool))
    assert largest < workspace, (largest, workspace)
    for k, (a, b) in enumerate(zip(losses, losses_e)):
        assert_equal(a, b, f"loss {k}")
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_equal(p, q, "a parameter after five steps")


def test_incoming_grad_buffers_are_temporaries_of_the_backward_graph():
    """The buffer the backward graph reads an output's incoming grad from is
    filled at the start of each backward replay and read within it, so the
    capture frees it into the pool, as its other temporaries (Note
    [Incoming grads] in csrc/aten_backward.cpp): after the set-up the pool
    holds the static output and the input's grad, not a third buffer of
    that size.  Grads stay bitwise eager's, with incoming grads dense, one
    element broadcast (.sum()) and zero in part (a slice's)."""
    n = 4 << 20  # 16 MiB of float32 per buffer

    def fn(x):
        return x * 3

    sample = torch.randn(n, device=CUDA, requires_grad=True)
    graphed = cgraph.make_graphed(fn, (sample,))
    torch.cuda.synchronize()
    held = sum(s["allocated_size"] for s in pool_segments(graphed.pool))
    assert held <= 2 * sample.nbytes + (1 << 20), held / sample.nbytes
    for k, make_loss in enumerate((lambda y: (y * w).sum(), lambda y: y.sum(),
                                   lambda y: (y[: n // 2] * w[: n // 2]).sum())):
        w = torch.randn(n, device=CUDA)
        x = torch.randn(n, device=CUDA, requires_grad=True)
        out = graphed(x)
        make_loss(out).backward()
        graphed_grad, x.grad = x.grad, None
        expected = fn(x)
        make_loss(expected).backward()
        assert_equal(out, expected, f"output {k}")
        assert_equal(graphed_grad, x.grad, f"the input's grad {k}")


def _first_steps(graphed: bool) -> tuple[int, list, int]:
    """Five training steps of eight 16 MiB weights at a batch of 2 (the
    grads dwarf the activations), the step zeroing its grads with
    set_to_none=True before its backward, as torch's default does: peak
    reserved bytes above a clean start, the losses, and the grads' bytes.
    Graphed, the five calls are three warm-up steps, the capture and a
    replay."""
    torch.cuda.synchronize()
    torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.manual_seed(0)
    model = nn.Sequential(*(nn.Linear(2048, 2048, bias=False) for _ in range(8))).to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x, y = torch.randn(2, 2048, device=CUDA), torch.randint(0, 2048, (2,), device=CUDA)

    def step(x, y):
        opt.zero_grad(set_to_none=True)
        loss = nn.functional.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        return loss.detach()

    if graphed:
        step = cgraph.make_graphed_step(step, (x, y))
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_reserved()
    losses = [step(x, y) for _ in range(5)]
    torch.cuda.synchronize()
    if graphed:
        assert step.stats == {"eager": 3, "captures": 1, "replays": 2}, step.stats
    peak = torch.cuda.max_memory_reserved() - base
    grads = sum(p.numel() * p.element_size() for p in model.parameters())
    return peak, [loss.clone() for loss in losses], grads


def test_a_step_captures_in_the_memory_its_warm_up_steps_left():
    """Note [A step's warm-up in its pool] (csrc/aten_setup.cpp): the capture
    reuses the grads' memory the last warm-up step's zero_grad freed, where it
    took a second set of grads beside them before (peak a grads' size above
    eager's): five graphed calls peak within a quarter of the grads of five
    eager steps.  The warm-up steps' losses, kept in the step's pool through
    the capture and the replays, keep their values: every loss is eager's."""
    eager, eager_losses, grads = _first_steps(graphed=False)
    graphed, losses, _ = _first_steps(graphed=True)
    assert graphed - eager < grads // 4, (graphed, eager, grads)
    for i, (loss, eager_loss) in enumerate(zip(losses, eager_losses)):
        assert_equal(loss, eager_loss, f"loss {i}")


# ---- torch's other allocator settings ------------------------------------------

# Scripts run in a process of their own: the allocator is configured before
# CUDA starts.  What they share:
_SCRIPT_PRELUDE = r'''
import copy, gc, sys
import torch
import torch.nn.functional as F
from torch import nn
import cgraph

def mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 10)).cuda()

def batch(i, n=32):
    torch.manual_seed(100 + i)
    return torch.randn(n, 64, device="cuda"), torch.randint(0, 10, (n,), device="cuda")

def make_step(net, opt):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        return loss
    return step
'''

_ALLOCATOR_SCRIPT = _SCRIPT_PRELUDE + r'''
def same(a, b, what):
    for (name, p), q in zip(a.named_parameters(), b.parameters()):
        if not torch.equal(p, q):
            sys.exit(f"{what}: parameter {name} differs from eager")

if cgraph._C.can_call_in_pool():
    sys.exit("a step's warm-up would run in its pool under " + sys.argv[1])

# A step graphed whole, as eager, then reset and trained on eagerly.
model, eager = mlp(), mlp()
opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (model, eager)]
step, plain = cgraph.make_graphed_step(make_step(model, opts[0])), make_step(eager, opts[1])
if torch.cuda.get_allocator_backend() != "native":  # refused at the capture, naming the fix
    for i in range(3):
        step(*batch(i))
    try:
        step(*batch(3))
    except RuntimeError as exc:
        print("REFUSED", exc, flush=True)
    try:
        cgraph.make_graphed(mlp())
    except RuntimeError as exc:
        print("REFUSED", exc, flush=True)
    sys.exit(0)
for i in range(8):
    if not torch.equal(step(*batch(i)), plain(*batch(i))):
        sys.exit(f"step: loss {i} differs from eager")
step.reset()
for i in range(8, 10):
    make_step(model, opts[0])(*batch(i))
    plain(*batch(i))
same(model, eager, "step")
stats = dict(step.stats)

# A module graphed per call shape (a short last batch captures one more graph).
model, eager = mlp(), mlp()
opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
graphed = cgraph.make_graphed(model)
for i in range(6):
    n = 32 if i < 4 else 20
    for net, opt in ((graphed, opts[0]), (eager, opts[1])):
        make_step(net, opt)(*batch(i, n))
same(model, eager, "graphed module")
graphs = graphed.num_graphs
graphed.reset()
del graphed, step
torch.cuda.synchronize()
torch.cuda.empty_cache()
print("ALLOCATOR OK", stats, graphs, flush=True)
'''


_BEHIND_SCRIPT = _SCRIPT_PRELUDE + r"""
def segments(pool):
    return [s for s in torch.cuda.memory_snapshot() if tuple(s["segment_pool_id"]) == pool]

# A module: an output of a replay queued behind a second of sleep, held across reset().
net = mlp()
graphed = cgraph.make_graphed(net)
x = batch(0)[0]
for _ in range(4):
    graphed(x).sum().backward()
with torch.no_grad():
    expect = net(x)
torch.cuda._sleep(2 * 10**9)
out = graphed(x)
graphs, pool = graphed.num_graphs, tuple(graphed.pool)
graphed.reset()
torch.cuda.synchronize()
print("MODULE KEPT", graphs, torch.equal(out, expect), len(segments(pool)), flush=True)

# A module dropped, not reset, likewise: its output moves out of the pool
# under expandable segments, and the pool's memory goes back.
net = mlp()
graphed = cgraph.make_graphed(net)
for _ in range(4):
    graphed(x).sum().backward()
with torch.no_grad():
    expect = net(x)
pool = tuple(graphed.pool)
torch.cuda._sleep(2 * 10**9)
out = graphed(x).detach()
del graphed, net
gc.collect()
torch.cuda.synchronize()
left = segments(pool)
print("DROPPED KEPT", torch.equal(out, expect), sum(s["allocated_size"] for s in left),
      len(left), flush=True)

# A step graphed whole: its loss, likewise, against an eager twin.
model, twin = mlp(), mlp()
step = cgraph.make_graphed_step(make_step(model, torch.optim.SGD(model.parameters(), lr=0.1)))
plain = make_step(twin, torch.optim.SGD(twin.parameters(), lr=0.1))
for i in range(5):
    step(*batch(i)), plain(*batch(i))
expect = plain(*batch(5))
torch.cuda._sleep(2 * 10**9)
loss = step(*batch(5))
replays = step.stats["replays"]
grads = [p.grad for p in model.parameters()]
step.reset()
torch.cuda.synchronize()
same = all(torch.equal(p, q) for p, q in zip(model.parameters(), twin.parameters()))
kept = all(p.grad is g and torch.equal(g, q.grad)
           for p, g, q in zip(model.parameters(), grads, twin.parameters()))
print("STEP KEPT", replays, torch.equal(loss, expect), same, kept, flush=True)
"""


@pytest.mark.parametrize("conf", ["expandable_segments:True", "expandable_segments:False"])
def test_a_reset_while_the_gpu_is_behind_keeps_held_outputs(conf):
    """Note [Emptying a pool under expandable segments] (csrc/aten_reset.cpp):
    reset() right after a replay whose kernels, and the copies giving its
    held output memory of its own, still wait behind a second of
    torch.cuda._sleep.  Under expandable segments torch's allocator unmapped
    the pool's pages after waiting for the capture stream alone: an illegal
    memory access every time on an H200 (at random in the allocator test
    below, under load).  The output and a step's loss keep eager's values.
    A module dropped without reset() while its output is held: under
    expandable segments the output moves out of the pool first, so the pool
    is emptied with nothing of it allocated (an emptied pool with blocks
    still allocated can be erased under them).  The step's grads, which its
    capture made in its pool, are the same objects with eager's values."""
    run = subprocess.run([sys.executable, "-c", _BEHIND_SCRIPT], cwd=ROOT, timeout=240,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT, "PYTORCH_CUDA_ALLOC_CONF": conf})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert "MODULE KEPT 1 True 0\n" in run.stdout, run.stdout
    expandable = conf == "expandable_segments:True"
    assert ("DROPPED KEPT True 0 0\n" if expandable else "DROPPED KEPT True") in run.stdout, \
        run.stdout
    assert "STEP KEPT 3 True True True\n" in run.stdout, run.stdout


@pytest.mark.parametrize("conf", ["expandable_segments:True", "backend:cudaMallocAsync"])
def test_training_under_torch_s_other_allocator_settings_matches_eager(conf):
    """PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True (Megatron's and
    torchtitan's usual setting): a step's warm-up cannot run in its pool
    there (_C.can_call_in_pool), and a released pool whose blocks are still
    allocated is unsafe (Note [A step's warm-up in its pool]); the check
    that keeps the warm-up out once read the setting wrong, and an H200 met
    an illegal memory access.  A step graphed whole and a module graphed per
    shape train as eager, bitwise, and reset() and empty_cache() after them
    go through.  The
    cudaMallocAsync backend has no private pools: a step's capture and
    make_graphed are refused, naming the fix (the process aborted in a free
    before)."""
    run = subprocess.run([sys.executable, "-c", _ALLOCATOR_SCRIPT, conf], cwd=ROOT, timeout=240,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT, "PYTORCH_CUDA_ALLOC_CONF": conf})
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    if "cudaMallocAsync" in conf:
        assert run.stdout.count("REFUSED cgraph: PYTORCH_CUDA_ALLOC_CONF (or PYTORCH_ALLOC_CONF) "
                                "selects the cudaMallocAsync backend") == 2, run.stdout
        return
    assert "ALLOCATOR OK {'eager': 3, 'captures': 1, 'replays': 5} 2" in run.stdout, run.stdout

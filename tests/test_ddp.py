"""DistributedDataParallel with cgraph.  On GPUs, the examples run under
torchrun and the tests assert each rank's report of every check:
examples/ddp.py (graphed layers inside DDP, a graphed model wrapped in DDP;
two GPUs) and examples/ddp_step.py (a DDP training step graphed whole, its
allreduce in the graph: Note [DDP inside a graphed step]; one GPU, and two).
On the CPU, a one-process gloo group checks the warm-up DDP needs, the
refusal of find_unused_parameters, and that DDP's hooks survive the move of
its grad accumulators."""

import contextlib
import logging
import weakref
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgraph
from _helpers import assert_equal, assert_logged, torchrun

@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_recipes_on_two_gpus():
    out = torchrun("ddp.py", 2)
    for rank in (0, 1):
        for check in ("graphed layers in DDP: grads equal", "overlap:",
                      "graphed DDP model: grads equal", "teardown:"):
            assert f"rank {rank} {check}" in out, out


STEP_CHECKS = ("graphed DDP step: losses, parameters and grads equal to eager DDP",
               "warm-up: {'eager': 11, 'captures': 1, 'replays': 5}",
               "allreduce in the graph:", "buffers after a forward under no_grad():",
               "buffers around a graphed evaluation:",
               "gradient accumulation, no_sync() outside:",
               "gradient accumulation, one graphed step per setting:",
               "static_graph with an unused parameter:",
               "a capture failing on one rank before the forward:",
               "a capture failing on one rank after the backward:",
               "teardown:")


def assert_step_checks(out, ranks):
    for rank in range(ranks):
        for check in STEP_CHECKS:
            assert f"rank {rank} {check}" in out, out


@pytest.mark.gpu
def test_a_ddp_step_graphed_whole_on_one_gpu():
    """One rank: no reduction to see in the grads, but the comm hook's GPU
    counter shows DDP's reduction replaying with the graph."""
    assert_step_checks(torchrun("ddp_step.py", 1), 1)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_ddp_step_graphed_whole_on_two_gpus():
    """Two ranks, each its own data: grads equal eager DDP's only if the
    graph averages them."""
    assert_step_checks(torchrun("ddp_step.py", 2), 2)


# ---- on the CPU: a one-process gloo group -------------------------------------

@pytest.fixture
def gloo():
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


def test_destroying_the_default_group_resets_every_graph_first(monkeypatch, caplog):
    """Note [destroy_process_group with live graphs] (cgraph/_api.py): NCCL's
    finalization waits for every graph holding one of its collectives, so
    destroying the default group (every group) runs reset_all() first; a
    subgroup destroyed alone does not, but warns first, in case it hangs;
    nor does a process with no graphs."""
    from torch.distributed import distributed_c10d

    from cgraph import _api

    class Step:  # a live graphed step's stand-in
        pass

    resets = []
    monkeypatch.setattr(_api, "reset_all", lambda: resets.append("reset"))
    monkeypatch.setattr(_api, "_live", weakref.WeakSet())  # other tests' graphs aside
    monkeypatch.setattr(_api, "_live_steps", weakref.WeakSet())
    assert dist.destroy_process_group is distributed_c10d.destroy_process_group
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    step = Step()
    _api._live_steps.add(step)
    with caplog.at_level(logging.WARNING, logger="cgraph"):
        dist.destroy_process_group(dist.new_group([0]))
    assert resets == []
    assert_logged(caplog, "destroy_process_group(subgroup): 1 graphed", "reset_all()")
    dist.destroy_process_group()
    assert resets == ["reset"] and not dist.is_initialized()
    _api._live_steps.discard(step)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    dist.destroy_process_group()
    assert resets == ["reset"], "no graph alive: nothing to reset"


def cpu_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.Tanh(), nn.Linear(16, 4))


def batches(n):
    torch.manual_seed(1)
    return [(torch.randn(6, 8), torch.randint(0, 4, (6,))) for _ in range(n)]


def ddp_step(model, opt, forwards=1, no_sync=0):
    """`no_sync` micro-batches under DDP's no_sync, then `forwards` synced."""

    def step(x, y):
        opt.zero_grad()
        for _ in range(no_sync):
            with model.no_sync():
                F.cross_entropy(model(x), y).backward()
        for _ in range(forwards):
            loss = F.cross_entropy(model(x), y)
            loss.backward()
        opt.step()
        return loss

    return step


@pytest.mark.parametrize("forwards,no_sync,eager", [(1, 0, 11), (2, 0, 6), (1, 2, 11)],
                         ids=["one-forward", "two-synced-forwards", "no_sync-not-counted"])
def test_a_step_calling_ddp_stays_eager_for_11_ddp_forwards(gloo, caplog, forwards, no_sync,
                                                            eager):
    """Note [DDP inside a graphed step], 2: num_warmup_iters=3 is raised to
    what DDP needs, counting only the forwards that sync grads; logged."""
    model = DDP(cpu_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(eager)
    step = cgraph.make_graphed_step(ddp_step(model, opt, forwards, no_sync), data[0],
                                    num_warmup_iters=3)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for x, y in data:
            step(x, y)
    assert step.stats == {"eager": eager, "captures": 0, "replays": 0}
    assert step.num_warmup_iters == eager
    assert (step.ddp.pace[model].synced, step.ddp.pace[model].with_grad) == (forwards,
                                                                           forwards + no_sync)
    assert f"{eager} eager steps before capture, not 3" in caplog.text


def test_a_step_without_ddp_keeps_its_warmup(gloo):
    model = cpu_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgraph.make_graphed_step(ddp_step(model, opt), batches(1)[0], num_warmup_iters=2)
    for x, y in batches(2):
        step(x, y)
    assert step.num_warmup_iters == 2 and not step.ddp.models()


def test_a_steps_first_call_counts_ddp_forwards_without_a_global_hook(gloo):
    """Note [DDP inside a graphed step], 2: the first call counts DDP's
    forwards through DDP's _pre_forward, not a global module hook, which
    torch.compile would trace into a module it compiles in that call (whose
    graph then differed from eager's by an ulp); the patch goes after it."""
    from torch.nn.modules import module as torch_module
    model = DDP(cpu_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = ddp_step(model, opt)
    hooks = []

    def step(x, y):
        hooks.append(len(torch_module._global_forward_pre_hooks)
                     + len(torch_module._global_forward_hooks))
        return train(x, y)

    original = DDP._pre_forward
    graphed = cgraph.make_graphed_step(step, batches(1)[0])
    graphed(*batches(1)[0])
    assert hooks == [0] and graphed.ddp.pace[model].synced == 1
    assert DDP._pre_forward is original, "the patch outlived the first call"


def test_first_calls_counting_ddp_forwards_may_end_in_any_order(gloo):
    """Two steps' first calls (two threads) overlapping, ending in the order
    they began: DDP's _pre_forward stays patched while either runs, each
    counts its own forwards, and the original is back after both."""
    from cgraph._ddp import DDPInStep
    original = DDP._pre_forward
    model = DDP(cpu_model())
    first, second = DDPInStep(), DDPInStep()
    outer, inner = first.watch(), second.watch()
    outer.__enter__()
    inner.__enter__()
    model(batches(1)[0][0])
    outer.__exit__(None, None, None)
    assert DDP._pre_forward is not original
    model(batches(1)[0][0])
    inner.__exit__(None, None, None)
    assert DDP._pre_forward is original
    assert first.pace[model].synced == 1 and second.pace[model].synced == 2


def test_a_first_call_that_raises_leaves_the_count_to_the_next(gloo):
    """A first call that raises before its DDP forward counts nothing; the
    next call counts, and the warm-up is raised as DDP needs."""
    model = DDP(cpu_model())
    train = ddp_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    calls = []

    def step(x, y):
        calls.append(x)
        if len(calls) == 1:
            raise RuntimeError("planted")
        return train(x, y)

    graphed = cgraph.make_graphed_step(step, batches(1)[0], num_warmup_iters=3)
    with pytest.raises(RuntimeError, match="planted"):
        graphed(*batches(1)[0])
    graphed(*batches(1)[0])
    assert graphed.ddp.pace[model].synced == 1 and graphed.num_warmup_iters == 11


def test_no_sync_set_outside_the_step_waits_for_ddp_s_forwards_and_is_compared(gloo, caplog):
    """Gradient accumulation with one call per micro-batch, no_sync()
    around all but the last, the step's first call among them: its first
    call syncs no grad, yet the step stays eager until DDP has run 11
    grad-syncing forwards (33 calls at 3 micro-batches), and DDP's
    require_backward_grad_sync is the step's, compared before a replay
    (Note [Grad sync set outside a graphed step]).  Before, the model
    counted as syncing nothing: the step captured after 3 calls, and a
    graph captured under one setting replayed under the other."""
    from cgraph._step_checks import GradSync

    model = DDP(cpu_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def forward_backward(x, y):
        F.cross_entropy(model(x), y).backward()

    step = cgraph.make_graphed_step(forward_backward, batches(1)[0], num_warmup_iters=3)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for i, (x, y) in enumerate(batches(33)):
            with model.no_sync() if i % 3 < 2 else contextlib.nullcontext():
                step(x, y)
            if i % 3 == 2:
                opt.step()
                opt.zero_grad(set_to_none=False)
            assert step.num_warmup_iters == max(3, min(i + 2, 33)), i  # one more while DDP waits
    assert step.stats == {"eager": 33, "captures": 0, "replays": 0}
    assert model._get_ddp_logging_data()["iteration"] == 10
    assert "however many calls that takes" in caplog.text
    assert step.ddp.training() == [model] and step.ddp.communicating() == [model]
    with model.no_sync():
        sync = GradSync([], step.ddp.training(), step.ddp.models())
        sync.captured()
        assert sync.first_changed() is None
    assert "require_backward_grad_sync" in sync.first_changed()


@pytest.mark.parametrize("before, warmup", [(11, 3), (5, 6), (9, 3)])
def test_a_ddp_model_trained_before_the_step_waits_only_for_the_forwards_left(
        gloo, caplog, before, warmup):
    """DDP's own count of its grad-syncing forwards: a model trained
    eagerly for 11 steps first has run them, so the step keeps its
    num_warmup_iters; one trained for 5 waits 6 calls, logged so (before,
    11 more calls either way); one trained for 9 needs 2, fewer than the
    step's 3: nothing logged (a review found "2 eager steps before capture,
    not 3" logged, and 3 run)."""
    model = DDP(cpu_model())
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    train = ddp_step(model, opt)
    for x, y in batches(before):
        train(x, y)
    step = cgraph.make_graphed_step(train, batches(1)[0], num_warmup_iters=3)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for x, y in batches(warmup):
            step(x, y)
            assert step.num_warmup_iters == warmup
    assert model._get_ddp_logging_data()["iteration"] == 10
    logged = "eager steps before capture" in caplog.text
    assert logged == (warmup > 3), caplog.text
    assert not logged or f"{warmup} eager steps before capture, not 3" in caplog.text


@pytest.mark.parametrize("before", [0, 3])
def test_a_ddp_model_trained_under_no_sync_at_every_call_is_warned_of(gloo, caplog, before):
    """DDP counts no forward under no_sync(): such a step never captures
    (its capture would wait for DDP's 11 grad-syncing forwards), said in a
    warning after 22 calls, once; also for a model DDP counted a few
    synced forwards of before the step (a review found it not warned of)."""
    model = DDP(cpu_model())
    train = ddp_step(model, torch.optim.SGD(model.parameters(), lr=0.1))
    for x, y in batches(before):
        train(x, y)

    def forward_backward(x, y):
        F.cross_entropy(model(x), y).backward()

    step = cgraph.make_graphed_step(forward_backward, batches(1)[0], num_warmup_iters=3)
    with caplog.at_level(logging.WARNING, logger="cgraph"), model.no_sync():
        for x, y in batches(30):
            step(x, y)
    assert step.stats["eager"] == 30 and step.num_warmup_iters == 31
    assert caplog.text.count("22 calls in, a DistributedDataParallel model it trains has "
                             "synced grads at most once") == 1, caplog.text


def test_find_unused_parameters_is_refused_at_capture_with_the_fix(gloo):
    model = DDP(cpu_model(), find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    data = batches(12)
    step = cgraph.make_graphed_step(ddp_step(model, opt), data[0])
    for x, y in data[:11]:
        step(x, y)
    with pytest.raises(ValueError, match="find_unused_parameters=False"):
        step(*data[11])  # the capture: refused before any CUDA call


def test_ddp_s_buffer_broadcast_is_compared_with_its_setting_as_the_capture_began(gloo):
    """Note [Grad sync set outside a graphed step]: DDP broadcasts rank 0's
    buffers (BatchNorm's running stats) at a forward that follows a
    grad-syncing one, not after a forward under no_grad(); a replay
    broadcasts as its capture began.  The setting, read from a real DDP
    model: a forward under no_grad() since capture is a change, one with
    grad is not; a model without buffers broadcasts nothing to compare."""
    from cgraph._step_checks import GradSync

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)))
    x = torch.randn(6, 8)
    model(x).sum().backward()  # as the capture leaves it: broadcast at the next forward
    sync = GradSync([], [model], [model])
    sync.captured()
    assert sync.broadcast_changed() is None
    with torch.no_grad():
        model(x)
    assert "require_forward_param_sync" in sync.broadcast_changed()
    assert sync.first_changed() is None  # not a grad sync setting: no accumulation warning
    model(x).sum().backward()
    assert sync.broadcast_changed() is None
    with torch.no_grad():
        model(x)
    # A capture right after: replays would never broadcast.
    began_off = GradSync([], [model], [model])
    model(x).sum().backward()  # the capture's own forward turns it on
    began_off.captured()
    assert "require_forward_param_sync" in began_off.broadcast_changed()
    plain = DDP(cpu_model())
    with torch.no_grad():
        plain(x)
    unbuffered = GradSync([], [plain], [plain])
    assert unbuffered.broadcast_changed() is None and not unbuffered.broadcasting


def test_an_evaluation_step_s_ddp_model_is_found_and_its_flag_left_as_eager_leaves_it(gloo):
    """A step whose DDP forward runs under no_grad() (an evaluation): the
    model is found, trained by no forward (its warm-up is a plain step's; a
    find_unused_parameters model is not refused: it searches nothing
    without grad), and after a replay DDP's require_forward_param_sync is
    what the capture's forward left, off, as eager's forward leaves it.
    Before, the model was not found, and a replay left the flag on: the
    training step's next forward broadcast rank 0's buffers where eager's
    does not."""
    from cgraph._ddp import DDPInStep
    from cgraph._step_checks import GradSync

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(8, 4), nn.BatchNorm1d(4)), find_unused_parameters=True)
    x = torch.randn(6, 8)
    found = DDPInStep()
    with found.watch(), torch.no_grad():
        model(x)
    assert found.models() == [model] and found.training() == []
    assert found.warmup_iters(SimpleNamespace(num_warmup_iters=3)) == 3
    found.before_capture()  # not refused
    model(x).sum().backward()  # a training step: the next forward broadcasts
    sync = GradSync([], found.training(), found.models())
    with torch.no_grad():
        model(x)  # the capture's forward
    sync.captured()
    model(x).sum().backward()  # the training step again
    assert model.require_forward_param_sync
    sync.leave()  # after the evaluation's replay
    assert not model.require_forward_param_sync
    # The ranks agree on its capture (a collective), but not on that of a
    # model without buffers evaluated so: it issues none, and such a step
    # may run on rank 0 only.
    assert found.communicating() == [model]
    plain, only = DDP(cpu_model()), DDPInStep()
    with only.watch(), torch.no_grad():
        plain(torch.randn(6, 8))
    assert only.models() == [plain] and only.communicating() == []


def test_ddp_hooks_survive_the_captured_call(gloo, caplog):
    """The captured call moves DDP's grad accumulators (alive: DDP keeps
    them; on the CPU, onto the stream they had) and back: the same nodes,
    DDP's hooks still on them, so its reduction still runs (else DDP's next
    forward raises "Expected to have finished reduction"), and training
    matches an eager twin."""
    model, eager = DDP(cpu_model()), DDP(cpu_model())
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager))
    data = batches(14)
    fn, fn_e = ddp_step(model, opt), ddp_step(eager, opt_e)
    step = cgraph.make_graphed_step(fn, data[0])
    for x, y in data[:11]:
        step(x, y)
        fn_e(x, y)
    for x, y in data[11:13]:  # as _capture calls it, without a graph
        with caplog.at_level(logging.DEBUG, logger="cgraph"):
            step.ddp.call(fn, (x, y), {})
        fn_e(x, y)
    assert "4 grad accumulators of 1 DDP model(s)" in caplog.text
    fn(*data[13])  # DDP checks here that the last reduction finished
    fn_e(*data[13])
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_equal(p, q, "parameter")
        assert_equal(p.grad, q.grad, "grad")


def test_the_captured_call_reports_the_accumulators_it_moved():
    """Parameters whose accumulator is alive move (a kept node: its hooks
    still run); those without one are skipped."""
    kept, fresh = nn.Parameter(torch.randn(3)), nn.Parameter(torch.randn(3))
    node = kept.view_as(kept).grad_fn.next_functions[0][0]
    ran = []
    node.register_hook(lambda grad_inputs, grad_outputs: ran.append(True))
    from cgraph import _C
    out, moved = _C.call_with_accumulators_here(
        [kept, fresh], lambda x: ((kept + fresh) * x).sum().backward() or "done",
        (torch.ones(3),), {})
    assert (out, moved, ran) == ("done", 1, [True])
    assert kept.view_as(kept).grad_fn.next_functions[0][0] is node


@pytest.mark.parametrize("api", ["make_graphed", "make_graphed_callables"])
def test_a_ddp_model_s_bound_forward_is_refused_naming_the_model(gloo, api):
    """Graphed as a function, DDP's forward would do its per-call
    bookkeeping (prepare_for_backward) at capture only, and no replay's
    grads would be all-reduced: refused before anything is captured."""
    from torch.nn.parallel import DistributedDataParallel
    ddp = DistributedDataParallel(cpu_model())
    x = torch.randn(6, 8)
    with pytest.raises(ValueError, match=r"Graph the DDP model itself: cgraph.make_graphed"):
        if api == "make_graphed":
            cgraph.make_graphed(ddp.forward, (x,))
        else:
            cgraph.make_graphed_callables((ddp.forward,), ((x,),))

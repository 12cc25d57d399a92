"""make_graphed_step on the CPU (no capture): warm-up calls are eager
steps, and a GradScaler's skipped steps do not count towards it (Note
[GradScaler with any optimizer] in cgraph/_step.py); the bookkeeping a
capture leaves (device lrs, baked values, replaced optimizers) set up as a
capture sets it; and when ranks agree on a capture.  The GPU tests of the
step are in tests/test_step.py."""

import gc
import logging
import os
import subprocess
import sys
import types
import warnings

import pytest
import torch
from torch import nn

import cgraph
from cgraph import _ranks
from cgraph._modes import roots
from cgraph._step import _Containers, _ScalerFactors
from _helpers import ROOT


def as_captured(step, *optimizers):
    """The bookkeeping a capture of `step` leaves for `optimizers` (its
    groups and containers), set without a GPU."""
    step.groups = [step._capturable(opt, g) for opt in optimizers for g in opt.param_groups]
    step.containers = [_Containers.of(opt) for opt in optimizers]


def scheduled(scheduler):
    """scheduler.step(), whose warning of no optimizer step first does not apply here."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Detected call of `lr_scheduler.step")
        scheduler.step()


def test_warm_up_goes_on_until_a_grad_scaler_has_let_the_optimizer_step(caplog):
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def train_step(x):
        opt.zero_grad()
        loss = model(x).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    step = cgraph.make_graphed_step(train_step, (torch.randn(3, 4),), num_warmup_iters=1)
    inf = torch.full((3, 4), float("inf"))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for x in (inf, inf):
            step(x)
            assert not opt.state and step.num_warmup_iters == step.stats["eager"] + 1
        step(torch.randn(3, 4))  # the scaler lets this one step: the buffers exist
    assert "momentum_buffer" in opt.state[model.weight]
    assert step.stats == {"eager": 3, "captures": 0, "replays": 0}
    assert step.num_warmup_iters == 3  # the next call captures
    assert scaler.get_scale() == 2.0**8
    assert set(step.scalers) == {scaler}  # its settings are compared after capture
    waits = [r for r in caplog.records if "skipped every step of SGD" in r.getMessage()]
    assert len(waits) == 1, caplog.text


def test_the_first_warm_up_call_leaves_torch_s_accumulator_warning_as_it_was():
    """The first warm-up call turns off torch's warning of a grad accumulator
    on another stream (DDP's, before cgraph has found the model: Note [A
    step's warm-up in its pool] in csrc/aten_setup.cpp) and puts the switch
    back as the user had it; later calls leave it alone."""
    import pytest
    from cgraph._step import _accumulator_stream_unwarned
    get = getattr(torch._C, "_warn_on_accumulate_grad_stream_mismatch", None)
    if get is None:
        pytest.skip("this torch cannot read the switch back (cgraph filters the warning)")
    was = get()
    try:
        for user_setting in (True, False):
            torch._C._set_warn_on_accumulate_grad_stream_mismatch(user_setting)
            with _accumulator_stream_unwarned(first=True):
                assert get() is False
            assert get() is user_setting
            with _accumulator_stream_unwarned(first=False):
                assert get() is user_setting
    finally:
        torch._C._set_warn_on_accumulate_grad_stream_mismatch(was)


def test_an_optimizer_loaded_grown_or_gone_is_seen_as_replaced():
    """Note [Capturable optimizers]: load_state_dict replaces an optimizer's
    groups and state, add_param_group grows them, and so can code of one's
    own; a captured step notices before its next call (the GPU test:
    test_an_optimizer_loaded_or_grown_after_capture_is_captured_again)."""
    model, unused = nn.Linear(4, 2), nn.Parameter(torch.zeros(1))
    opt = torch.optim.AdamW([*model.parameters(), unused])
    model(torch.randn(3, 4)).sum().backward()
    opt.step()
    held = _Containers.of(opt)
    opt.zero_grad()
    opt.param_groups[0]["lr"] = 0.5  # a scheduler's change: the hyperparameter check's
    opt.state[model.weight]["exp_avg"].zero_()  # in place: the graph's tensors still
    opt.state[unused]  # a read adds an entry (a defaultdict): not a replacement
    assert not held.replaced()
    changes = [lambda: opt.load_state_dict(opt.state_dict()),
               lambda: opt.add_param_group({"params": [nn.Parameter(torch.zeros(2))]}),
               lambda: opt.param_groups.__setitem__(0, dict(opt.param_groups[0])),
               lambda: opt.param_groups[0]["params"].append(nn.Parameter(torch.zeros(2))),
               lambda: opt.param_groups[0].__setitem__("params", [model.weight])]
    for change in changes:
        held = _Containers.of(opt)
        change()
        assert held.replaced(), change
    held = _Containers.of(opt)
    opt = None  # the changes above hold it only through this name
    gc.collect()
    assert held.replaced()  # gone: the step now calls another optimizer, or none


def test_a_replaced_optimizer_warms_up_again_until_it_has_stepped():
    """After add_param_group the next call steps eagerly, creating the new
    parameters' state, which a capture would zero at every replay; a
    GradScaler skipping that step (inf grads) prolongs the warm-up, as it
    does the first one.  On the CPU: the containers are set as a capture
    sets them."""
    torch.manual_seed(0)
    model, extra = nn.Linear(4, 2), nn.Parameter(torch.zeros(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)

    def train_step(x):
        opt.zero_grad()
        loss = (model(x) + extra).sum()
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    step = cgraph.make_graphed_step(train_step, (torch.randn(3, 4),), num_warmup_iters=1)
    step(torch.randn(3, 4))
    step.containers = [_Containers.of(opt)]  # as after a capture
    opt.add_param_group({"params": [extra]})
    step(torch.full((3, 4), float("inf")))  # eager again; the scaler skips the step
    assert step.stats["eager"] == 2 and step.num_warmup_iters == 3
    assert opt not in step.optimizers and extra not in opt.state
    step(torch.randn(3, 4))  # eager; this one steps
    assert step.stats == {"eager": 3, "captures": 0, "replays": 0}
    assert opt in step.optimizers and "momentum_buffer" in opt.state[extra]
    assert step.num_warmup_iters == 3  # the next call captures


# ---- Note [Capturable optimizers]: lr, baked values, without a GPU ---------

def test_a_cpu_tensor_lr_is_read_from_a_device_tensor_refilled_before_each_replay():
    """A fused kernel reads a CPU tensor lr with .item() at capture, baking
    it in: the graph reads a tensor on the parameters' device instead (meta
    here, standing in for CUDA), the user's tensor comes back after the
    capture, and a scheduler's fill_ of it is carried over before the next
    replay, without a recapture.  The GPU test:
    test_an_lr_scheduler_on_a_cpu_tensor_lr_or_an_empty_group_matches_eager."""
    lr = torch.tensor(1e-3)
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3, device="meta"))], lr=lr, fused=True)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, opt)
    (group,) = step.groups
    assert group.lr.device.type == "meta" and "lr" not in group.baked
    with step._device_lrs():
        assert opt.param_groups[0]["lr"] is group.lr
    assert opt.param_groups[0]["lr"] is lr  # the scheduler fills this one
    group.lr = torch.zeros(())  # a CPU stand-in for the graph's tensor, to read it back
    scheduled(scheduler)
    assert not step._stale()
    assert group.lr.item() == group.lr_value == lr.item() == torch.tensor(5e-4).item()


def test_a_tensor_lr_on_the_parameters_device_is_read_in_place_and_a_number_one_refused():
    """A tensor lr on the parameters' device is the graph's to read in place,
    as before; an optimizer whose step reads lr as a number is refused, as
    before (a scheduler's fill_ would go unseen)."""
    step = cgraph.make_graphed_step(lambda: None)
    lr = torch.tensor(1e-3)
    opt = torch.optim.AdamW([nn.Parameter(torch.zeros(3))], lr=lr, fused=True)
    as_captured(step, opt)
    assert step.groups[0].lr is None and step.groups[0].baked["lr"] is lr
    sgd = torch.optim.SGD([nn.Parameter(torch.zeros(3, device="meta"))], lr=lr)
    with pytest.raises(ValueError, match="reads lr as a number"):
        as_captured(step, sgd)


def test_an_empty_param_group_gets_no_device_lr_and_nothing_compared():
    """torch lets a group have no parameters (weight decay split by a filter
    that matched none): it steps nothing, so nothing of it is read."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW([{"params": list(model.parameters())},
                             {"params": [], "weight_decay": 0.0}], lr=1e-3, fused=True)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, opt)
    empty = step.groups[1]
    assert empty.lr is None and empty.baked == {}
    opt.param_groups[1]["lr"], opt.param_groups[1]["betas"] = 0.5, (0.8, 0.9)
    assert not step._stale()


@pytest.mark.parametrize("cycle_momentum", [True, False])
def test_a_scheduler_changing_betas_at_every_call_is_warned_of_once(cycle_momentum, caplog):
    """OneCycleLR cycles Adam's betas at every step (cycle_momentum=True, its
    default), which the graph bakes in: every call captures the step again.
    That is logged at each, and warned of once, at the third in a row,
    naming the fix; a replay (nothing changed) starts the count again."""
    model = nn.Linear(4, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=1e-2, total_steps=20,
                                                    cycle_momentum=cycle_momentum)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, opt)
    stale = []
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for _ in range(5):
            scheduled(scheduler)
            stale.append(step._stale())
            if stale[-1]:
                as_captured(step, opt)  # the call captures again
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert step.groups[0].lr.item() == torch.tensor(opt.param_groups[0]["lr"]).item()
    if not cycle_momentum:  # lr alone changes: read from the device
        assert stale == [False] * 5 and not warned and not caplog.records
        return
    assert stale == [True] * 5 and step.stale_in_a_row == 5
    assert len(warned) == 1, warned
    assert "'betas' changed before each of the last 3 calls" in warned[0]
    assert "cycle_momentum=False" in warned[0]
    assert not step._stale() and step.stale_in_a_row == 0  # a replay


@pytest.mark.parametrize("setting", ["growth_factor", "backoff_factor", "growth_interval"])
def test_a_grad_scaler_setting_changed_after_capture_captures_again(setting, caplog):
    """scaler.update() hands its growth and backoff factors and growth
    interval to the graph as numbers (Note [GradScaler with any
    optimizer]): a change (set_*, load_state_dict) captures again."""
    scaler = torch.amp.GradScaler("cpu", growth_interval=1)
    step = cgraph.make_graphed_step(lambda: None)
    step.scaler_factors = [_ScalerFactors.of(scaler)]
    assert not step._stale()
    if setting == "growth_interval":
        scaler.load_state_dict({**scaler.state_dict(), "growth_interval": 5})
    else:
        getattr(scaler, f"set_{setting}")(0.25 if setting == "backoff_factor" else 4.0)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        assert step._stale()
    assert f"the GradScaler's '{setting}' changed since capture" in caplog.text


def test_a_disabled_grad_scaler_has_no_settings_to_compare():
    """GradScaler(enabled=use_fp16) with use_fp16 False sets no factors: a
    step through it is captured as one without it."""
    enabled = torch.amp.GradScaler("cpu")
    factors = _ScalerFactors.of_enabled([torch.amp.GradScaler("cpu", enabled=False), enabled])
    assert [f.scaler() for f in factors] == [enabled]


# ---- Note [A capture that fails on one rank] (cgraph/_ranks.py) --------------

def test_ranks_agree_on_a_steps_capture_only_where_it_may_hold_collectives(mesh):
    """A step without DDP or DTensors may be graphed on some ranks only
    (rank 0's evaluation): no agreement, which would wait for the others.
    DTensor parameters (FSDP2, TP) or arguments, and DDP models, have the
    ranks agree."""
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate
    from torch.nn.parallel import DistributedDataParallel

    def holds(step, leaves):
        return step._holds_collectives(leaves, roots(step.fn, step.ddp.models()))

    x = torch.randn(3, 4)
    step = cgraph.make_graphed_step(lambda x: None, (x,))
    step.optimizers.add(torch.optim.SGD(nn.Linear(4, 2).parameters(), lr=0.1))
    assert not holds(step, [x])
    assert holds(step, [DTensor.from_local(x, mesh, [Replicate()])])
    sharded = nn.Linear(4, 2)
    fully_shard(sharded, mesh=mesh)
    step.optimizers.add(sgd := torch.optim.SGD(sharded.parameters(), lr=0.1))
    assert holds(step, [x])
    step.optimizers.discard(sgd)
    ddp = DistributedDataParallel(nn.Linear(4, 2))
    step = cgraph.make_graphed_step(lambda x: ddp(x).sum().backward(), (x,))
    step(x)  # warm-up: the DDP model is found
    assert holds(step, [x])


class _NoCapturableForm(torch.optim.Optimizer):
    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                p.add_(p.grad, alpha=-group["lr"])


@pytest.mark.parametrize("argument", ["plain", "dtensor"])
def test_a_refusal_before_capture_goes_through_the_ranks_agreement(argument, mesh, monkeypatch):
    """Each rank calls agree once per capture, wherever it stopped: a rank
    refused before capturing (here an optimizer with no capturable form)
    meets the ranks that captured in the same gather."""
    from torch.distributed.tensor import DTensor, Replicate

    agreed = []

    def agree(failure, what, together=True, *, holds=False):
        agreed.append((type(failure), together))
        if failure is not None:
            raise failure
        return holds

    monkeypatch.setattr(_ranks, "agree", agree)
    model = nn.Linear(4, 2)
    if argument == "dtensor":  # its parameters DTensors, as TP makes them
        for name, p in list(model.named_parameters()):
            setattr(model, name, nn.Parameter(DTensor.from_local(p.detach(), mesh,
                                                                 [Replicate()])))
    opt = _NoCapturableForm(model.parameters())
    x = torch.randn(3, 4)

    def train_step(x):
        opt.zero_grad()
        if argument == "dtensor":
            model(DTensor.from_local(x, mesh, [Replicate()])).to_local().sum().backward()
        else:
            model(x).sum().backward()
        opt.step()

    step = cgraph.make_graphed_step(train_step, (x,), num_warmup_iters=1)
    step(x)
    with pytest.raises(ValueError, match="no capturable form"):
        step(x)
    assert agreed == [(ValueError, argument == "dtensor")]


def test_a_failed_rank_whose_gather_fails_too_raises_its_own_error(monkeypatch):
    """Note [A capture that fails on one rank], under
    TORCH_DISTRIBUTED_DEBUG=DETAIL: the agreement's gather itself raises
    (torch's collective-mismatch check, the others having captured a
    collective this rank never issued).  The failed rank raises its own
    error, naming the gather's; a rank whose capture succeeded raises the
    gather's error.  Before, the failed rank's error was lost."""
    def mismatch(value):
        raise RuntimeError("Detected mismatch between collectives on ranks")

    monkeypatch.setattr(_ranks, "_several", lambda together: together)
    monkeypatch.setattr(_ranks, "_gathered", mismatch)
    with pytest.raises(ValueError, match="planted at capture") as raised:
        _ranks.agree(ValueError("planted at capture"), "the training step's capture")
    assert ("the training step's capture failed on this rank, and telling the other ranks "
            "failed too (RuntimeError: Detected mismatch") in " ".join(raised.value.__notes__)
    assert "Detected mismatch" in str(raised.value.__context__)
    try:  # an error raised while handling another keeps that one as its context
        try:
            raise KeyError("the user's")
        except KeyError:
            raise ValueError("planted at capture")  # noqa: B904
    except ValueError as raised_here:
        own = raised_here
    with pytest.raises(ValueError, match="planted at capture") as raised:
        _ranks.agree(own, "the training step's capture")
    assert isinstance(raised.value.__context__, KeyError), raised.value.__context__
    with pytest.raises(RuntimeError, match="Detected mismatch"):
        _ranks.agree(None, "the training step's capture")


def test_a_failed_capture_puts_back_the_grads_it_gave_where_there_were_none(monkeypatch):
    """A forward-and-backward step (its optimizer outside) whose capture
    assigns grads and then fails: each parameter's grad is None again, as
    the call found it, not the capture's (memory no kernel wrote).  The
    capture is faked on the CPU: it assigns the grads, as its backward
    would, then raises."""
    model = nn.Linear(4, 2)

    def failing(*args, **kwargs):
        for p in model.parameters():
            p.grad = torch.ones_like(p)
        raise RuntimeError("planted after the backward")

    monkeypatch.setattr(cgraph._step, "_require_cuda", lambda: None)
    monkeypatch.setattr(cgraph._step, "graph", failing)
    x = torch.randn(3, 4)
    step = cgraph.make_graphed_step(lambda x: model(x).sum().backward(), (x,),
                                    num_warmup_iters=1)
    step(x)  # warm-up: grads made, then cleared outside as an optimizer step would
    model.zero_grad()
    with pytest.raises(RuntimeError, match="planted after the backward"):
        step(x)
    assert [p.grad for p in model.parameters()] == [None, None]


def test_a_dtensor_argument_is_refused_naming_the_local_tensor(mesh):
    """A graphed step takes plain tensors: a DTensor argument is refused at
    the first call, naming to_local() and from_local() inside the step."""
    from torch.distributed.tensor import DTensor, Replicate

    x = DTensor.from_local(torch.randn(3, 4), mesh, [Replicate()])
    step = cgraph.make_graphed_step(lambda batch: batch)
    with pytest.raises(ValueError, match=r"argument 0 of the graphed step.*is a DTensor.*"
                                         r"to_local\(\).*from_local"):
        step({"tokens": x})


def test_an_interrupted_capture_is_agreed_on_and_drops_the_state_it_made(monkeypatch):
    """A KeyboardInterrupt inside the capture goes through the ranks'
    agreement as any failure (the others would otherwise wait there), and
    the optimizer state the capture made (never written: a capture runs no
    kernel) is dropped with it.  The capture is faked on the CPU: it steps
    the optimizer, as a captured step would, then is interrupted."""
    agreed = []

    def agree(failure, what, together=True, *, holds=False):
        agreed.append(type(failure))
        if failure is not None:
            raise failure
        return holds

    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)

    def interrupted(*args, **kwargs):
        model.bias.grad = torch.ones(2)
        opt.step()  # makes the bias's momentum buffer, as the captured step would
        raise KeyboardInterrupt

    monkeypatch.setattr(_ranks, "agree", agree)
    monkeypatch.setattr(cgraph._step, "_require_cuda", lambda: None)
    monkeypatch.setattr(cgraph._step, "_check_on_the_gpu", lambda opt: None)
    monkeypatch.setattr(cgraph._step, "graph", interrupted)
    model.bias.requires_grad_(False)

    def train_step(x):
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()

    x = torch.randn(3, 4)
    step = cgraph.make_graphed_step(train_step, (x,), num_warmup_iters=1)
    step(x)  # warm-up: the bias is frozen, so it has no state
    model.bias.requires_grad_(True)
    with pytest.raises(KeyboardInterrupt):
        step(x)
    assert agreed == [KeyboardInterrupt]
    assert model.bias not in opt.state and "momentum_buffer" in opt.state[model.weight]


@pytest.mark.parametrize("conf, in_pool", [
    ("", True), ("expandable_segments:False", True),
    ("expandable_segments:True", False), ("max_split_size_mb:64,expandable_segments:True", False),
    ("backend:cudaMallocAsync", False)])
def test_a_step_warms_up_in_its_pool_only_where_torch_s_allocator_can_route_there(conf, in_pool):
    """Read from PYTORCH_CUDA_ALLOC_CONF as torch's allocator reads it: with
    expandable segments the warm-up stays on the caller's stream (Note [A
    step's warm-up in its pool]).  The check read the setting through a
    header that answers False in every extension, so it let warm-ups into
    the pool under expandable_segments:True, where an H200 then met an
    illegal memory access."""
    code = "import cgraph._C as C; print('IN POOL', C.can_call_in_pool())"
    run = subprocess.run([sys.executable, "-W", "ignore", "-c", code], cwd=ROOT, timeout=120,
                         capture_output=True, text=True,
                         env={**os.environ, "PYTHONPATH": ROOT, "PYTORCH_CUDA_ALLOC_CONF": conf})
    assert f"IN POOL {in_pool}" in run.stdout, run.stdout + run.stderr


@pytest.mark.parametrize("key, apart, warned", [
    ("grad sync", 3, True), ("grad sync", 65, False), ("buffer broadcast", 3, False)])
def test_grad_sync_set_otherwise_outside_again_and_again_is_warned_of_once(
        caplog, key, apart, warned):
    """Note [Grad sync set outside a graphed step]: a call that finds grad
    sync changed steps eagerly and the next captures again.  Three such
    calls each within 64 calls of the last (gradient accumulation's cycles,
    no_sync() set outside) warn once, naming the recipes; rare changes far
    apart, or DDP's buffer broadcast turned off by an evaluation's forward
    outside, do not."""
    from cgraph._step_checks import Change

    step = cgraph.make_graphed_step(lambda x: x * 2, (torch.ones(2),))
    change = Change("DDP's require_backward_grad_sync (no_sync())", "changed", key)
    with caplog.at_level(logging.WARNING, logger="cgraph"):
        for _ in range(4):
            step.since = types.SimpleNamespace(first_changed=lambda: change)  # as captured
            assert step._changed_since_capture()
            step.stats["replays"] += apart
    assert caplog.text.count("changed 3 times, each within 64 calls of the last") == warned
    if warned:
        assert "Run the micro-batches inside the step" in caplog.text

"""A whole training step in one graph (cgraph.make_graphed_step): n calls
are n eager training steps, for the optimizers as users build them, with
LR schedulers, GradScaler, clipping and gradient accumulation inside, and
host syncs refused with the fix.  Each test runs the same step eagerly on
a deep copy from the same random state and compares bitwise, or with the
float32 tolerance stated where the optimizer's math differs."""

import contextlib
import copy
import functools
import logging
import os
import subprocess
import sys
import random

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgraph
from _helpers import (CUDA, ROOT, assert_equal, assert_logged, inductor_deterministic,
                      state_as_captured)

pytestmark = pytest.mark.gpu


def model_and_data(seed=60, dropout=0.1):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(dropout),
                          nn.Linear(64, 10)).to(CUDA)
    batches = [(torch.randn(16, 32, device=CUDA), torch.randint(0, 10, (16,), device=CUDA))
               for _ in range(8)]
    return model, batches


def make_step(model, opt, scaler=None, clip=None, dtype=None):
    def step(x, y):
        opt.zero_grad()
        with torch.autocast("cuda", dtype=dtype, enabled=dtype is not None):
            loss = F.cross_entropy(model(x), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            if clip is not None:
                scaler.unscale_(opt)
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            scaler.step(opt)
            scaler.update()
        else:
            loss.backward()
            if clip is not None:
                nn.utils.clip_grad_norm_(model.parameters(), clip)
            opt.step()
        return loss
    return step


def run(step_fn, batches, after_step=None):
    """Calls step_fn on each batch from one CUDA random state; returns the
    losses (copies)."""
    torch.cuda.manual_seed(7)
    losses = []
    for x, y in batches:
        losses.append(step_fn(x, y).detach().clone())
        if after_step is not None:
            after_step()
    return losses


# Grads of a float16 autocast forward whose parameters differ from eager's by
# float32 rounding (capturable optimizers' step sizes): one float16 rounding
# (2**-10 relative) apart at most.
FP16_GRADS = dict(rtol=2e-3, atol=1e-5)


# Capturable optimizers' float32 step sizes against eager's float64 ones:
# parameters one float32 rounding apart per step, compounded through the
# grads.  Measured on an H100 (torch 2.11): at most 4.9e-7 (RAdam, Adam,
# AdamW), 5.4e-9 in the first moments.  assert_close's default atol (1e-5)
# would pass an update 5% wrong (RAdam moves its parameters by 1.8e-4 in 8
# steps); these would not.
FLOAT32_STEPS = dict(rtol=1.3e-6, atol=2e-6)
STATE = dict(rtol=1e-5, atol=2e-8)
# The same under float16 autocast, whose grads round to 2**-10: at most
# 6.0e-6 measured (AdamW, foreach, GradScaler); their state is compared with
# assert_close's default.
FP16_STEPS = dict(rtol=1.3e-6, atol=1e-5)


def assert_same_training(model, eager, losses, losses_e, exact=True, grad_tolerance=None,
                         tolerance=FLOAT32_STEPS):
    check = assert_equal if exact else (
        lambda a, b, what: torch.testing.assert_close(a, b, **tolerance,
                                                      msg=lambda m: f"{what}: {m}"))
    for i, (a, b) in enumerate(zip(losses, losses_e)):
        tolerance = dict(rtol=0, atol=0) if exact else {}
        torch.testing.assert_close(a, b, equal_nan=True, **tolerance,
                                   msg=lambda m: f"loss of step {i}: {m}")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        check(p, q, f"parameter {name}")
        if grad_tolerance is None:
            check(p.grad, q.grad, f"grad of {name}")
        else:
            torch.testing.assert_close(p.grad, q.grad, **grad_tolerance,
                                       msg=lambda m, name=name: f"grad of {name}: {m}")


OPTIMIZERS = {
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-default": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-foreach": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, foreach=True),
    "sgd-fused": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9, fused=True),
    "adam-fused": lambda ps: torch.optim.Adam(ps, lr=1e-2, fused=True),
}


def test_a_gradient_penalty_step_trains_as_eager():
    """A step with a double backward (WGAN-GP's gradient penalty:
    autograd.grad with create_graph=True, then the loss's backward through
    that grad), graphed whole: every loss and parameter eager's, bitwise,
    through warm-up, capture and replays.  The double backward is kernels
    the capture records like any other."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 1)).to(CUDA)
    eager = copy.deepcopy(model)
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3, fused=True) for m in (model, eager)]

    def penalized(net, opt):
        def step(x):
            opt.zero_grad()
            x = x.detach().requires_grad_()
            out = net(x)
            (grad,) = torch.autograd.grad(out.sum(), x, create_graph=True)
            loss = out.mean() + 10 * ((grad.norm(2, dim=1) - 1) ** 2).mean()
            loss.backward()
            opt.step()
            return loss
        return step

    graphed, plain = cgraph.make_graphed_step(penalized(model, opts[0])), penalized(eager, opts[1])
    for i in range(8):
        x = torch.randn(64, 16, device=CUDA)
        assert_equal(graphed(x), plain(x), f"loss {i}")
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_equal(p, q, f"parameter {name}")
    assert graphed.stats == {"eager": 3, "captures": 1, "replays": 5}, graphed.stats


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_n_calls_are_n_eager_steps(name):
    """Parameters, grads, losses (dropout on) equal eager's after every
    step; warm-up calls are real steps; outputs keep their values."""
    model, batches = model_and_data()
    eager = copy.deepcopy(model)
    opt, opt_e = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](eager.parameters())
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0], num_warmup_iters=2)
    losses = run(step, batches)
    losses_e = run(make_step(eager, opt_e), batches)
    assert_same_training(model, eager, losses, losses_e)
    assert step.stats == {"eager": 2, "captures": 1, "replays": 6}
    for (p, q) in zip(opt.state.values(), opt_e.state.values()):
        for key in q:
            assert_equal(p[key].to(q[key].device).to(q[key].dtype), q[key], f"state {key}")


@pytest.mark.parametrize("hyper, fused", [
    (dict(momentum=0.9), True), (dict(), True), (dict(momentum=0.9, weight_decay=1e-4), True),
    (dict(momentum=0.9, foreach=False), True),
    (dict(momentum=0.9, nesterov=True), False),  # foreach Nesterov changes p.grad itself
], ids=["momentum", "plain", "weight-decay", "single-tensor", "nesterov-unfused"])
def test_an_unfused_sgd_is_replayed_as_the_fused_kernel_with_eagers_bits(hyper, fused,
                                                                         monkeypatch):
    """Note [An unfused SGD stepped by the fused kernel]: the foreach (or
    single-tensor) SGD of a graphed step (float32, and float16 autocast
    under a GradScaler) is captured as torch's fused kernel where the Note
    allows, and n graphed steps equal n eager unfused steps bit for bit
    either way: parameters, grads, momentum buffers."""
    fused_calls = []
    from torch.optim import sgd as torch_sgd  # the module (torch.optim.sgd is not an attribute)
    fused_sgd = torch_sgd._fused_sgd

    def counting(params, *args, **kwargs):
        fused_calls.append(any(p is q for p in params for q in model.parameters()))
        return fused_sgd(params, *args, **kwargs)

    monkeypatch.setattr(torch_sgd, "_fused_sgd", counting)
    for dtype in (None, torch.float16):
        fused_calls.clear()
        model, batches = model_and_data(dropout=0.0)
        eager = copy.deepcopy(model)
        opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1, **hyper) for m in (model, eager))
        scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10) if dtype else None
                   for _ in range(2)]
        step = cgraph.make_graphed_step(make_step(model, opt, scalers[0], dtype=dtype),
                                        batches[0], num_warmup_iters=2)
        losses = run(step, batches)
        losses_e = run(make_step(eager, opt_e, scalers[1], dtype=dtype), batches)
        assert_same_training(model, eager, losses, losses_e)
        for p, q in zip(opt.state.values(), opt_e.state.values()):
            if "momentum_buffer" in q and q["momentum_buffer"] is not None:
                assert_equal(p["momentum_buffer"], q["momentum_buffer"], "momentum buffer")
        assert step.stats["captures"] == 1 and step.stats["replays"] == 6, step.stats
        assert any(fused_calls) == fused, f"{dtype}: fused kernel in the step: {fused_calls}"


def _every_optimizer():
    """torch.optim's optimizers (LBFGS and SparseAdam aside; Adafactor and
    Muon, in newer torch, have no capturable form), at their defaults (SGD
    with momentum), single-tensor, and fused where they have it."""
    made = {}
    for cls in (torch.optim.Adadelta, torch.optim.Adagrad, torch.optim.Adam,
                torch.optim.AdamW, torch.optim.Adamax, torch.optim.ASGD, torch.optim.NAdam,
                torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Rprop, torch.optim.SGD):
        name = cls.__name__.lower()
        extra = {"lr": 0.05, "momentum": 0.9} if cls is torch.optim.SGD else {}
        made[name] = functools.partial(cls, **extra)
        made[name + "-single-tensor"] = functools.partial(cls, foreach=False, **extra)
        if cls in (torch.optim.Adam, torch.optim.AdamW, torch.optim.SGD):
            made[name + "-fused"] = functools.partial(cls, fused=True, **extra)
    return made


EVERY_OPTIMIZER = _every_optimizer()


@pytest.mark.parametrize("name", list(EVERY_OPTIMIZER))
def test_every_optimizer_steps_inside_the_graph_as_eager(name):
    """n graphed steps are n eager steps: parameters, grads, losses and
    optimizer state.  Optimizers made capturable compute their step sizes
    on the device in float32 where eager computes them on the host in
    float64 (Adam's, NAdam's bias corrections): compared with
    assert_close's float32 tolerance.  SGD and Adagrad with its default
    lr_decay=0 (Note [Optimizers without a capturable form]): bitwise."""
    exact = name.split("-")[0] in ("sgd", "adagrad")
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    make = EVERY_OPTIMIZER[name]
    opt, opt_e = make(model.parameters()), make(eager.parameters())
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0])
    losses = run(step, batches)
    losses_e = run(make_step(eager, opt_e), batches)
    assert step.stats == {"eager": 3, "captures": 1, "replays": 5}, step.stats
    assert_same_training(model, eager, losses, losses_e, exact=exact)
    for p, q in zip(opt.state.values(), opt_e.state.values()):
        for key, value in q.items():
            if isinstance(value, torch.Tensor):
                torch.testing.assert_close(p[key].to(value.device, value.dtype), value,
                                           **STATE, msg=lambda m, key=key: f"state {key}: {m}")


def test_lbfgs_is_refused_naming_why():
    model, batches = model_and_data(dropout=0.0)
    opt = torch.optim.LBFGS(model.parameters())

    def step(x, y):
        def closure():
            opt.zero_grad()
            loss = F.cross_entropy(model(x), y)
            loss.backward()
            return loss
        return opt.step(closure)

    graphed = cgraph.make_graphed_step(step, batches[0], num_warmup_iters=1)
    graphed(*batches[0])
    with pytest.raises(ValueError, match="LBFGS evaluates its closure"):
        graphed(*batches[1])


@pytest.mark.parametrize("name", ["adam", "adamw"])
def test_adam_is_made_capturable(name):
    """Built without capturable=True: cgraph sets it.  Capturable Adam
    computes its step size on the device in float32, eager's on the host in
    float64: parameters agree to float32 rounding (assert_close)."""
    make = torch.optim.Adam if name == "adam" else torch.optim.AdamW
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opt, opt_e = make(model.parameters(), lr=1e-2), make(eager.parameters(), lr=1e-2)
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0])
    losses = run(step, batches)
    losses_e = run(make_step(eager, opt_e), batches)
    assert_same_training(model, eager, losses, losses_e, exact=False)
    assert opt.param_groups[0]["capturable"] and step.stats["captures"] == 1


@pytest.mark.parametrize("fused", [True, False], ids=["sgd-fused", "sgd-foreach"])
def test_a_cosine_schedule_with_warm_up_matches_eager(fused):
    """50 steps of linear warm-up then cosine decay, stepped between calls.
    Fused SGD reads lr from the device: no recapture; foreach SGD bakes it
    in: each change recaptures (logged), and the result is still eager's."""
    torch.manual_seed(61)
    model = nn.Sequential(nn.Linear(16, 16), nn.Tanh(), nn.Linear(16, 4)).to(CUDA)
    eager = copy.deepcopy(model)
    batches = [(torch.randn(8, 16, device=CUDA), torch.randint(0, 4, (8,), device=CUDA))
               for _ in range(50)]

    def schedule(opt):
        warm = torch.optim.lr_scheduler.LinearLR(opt, start_factor=0.1, total_iters=10)
        cosine = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=40)
        return torch.optim.lr_scheduler.SequentialLR(opt, [warm, cosine], milestones=[10])

    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9, fused=fused)
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.1, momentum=0.9, fused=fused)
    sched, sched_e = schedule(opt), schedule(opt_e)
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0])
    losses = run(step, batches, sched.step)
    losses_e = run(make_step(eager, opt_e), batches, sched_e.step)
    assert_same_training(model, eager, losses, losses_e)
    captures = step.stats["captures"]
    assert captures == 1 if fused else captures > 40  # lr changes at almost every step


OPTIMIZERS_WITH_A_SCHEDULE = {
    # A CPU tensor lr, which the fused kernel reads on the host (.item()):
    # the graph reads a device copy, refilled before each replay.
    "cpu-tensor-lr": lambda ps: torch.optim.AdamW(ps, lr=torch.tensor(1e-2), fused=True),
    # A group with no parameters beside the model's: it steps nothing.
    "empty-group": lambda ps: torch.optim.AdamW(
        [{"params": ps}, {"params": [], "weight_decay": 0.0}], lr=1e-2, fused=True),
}


@pytest.mark.parametrize("name", list(OPTIMIZERS_WITH_A_SCHEDULE))
def test_an_lr_scheduler_on_a_cpu_tensor_lr_or_an_empty_group_matches_eager(name):
    """StepLR changes lr at every step (a tensor lr in place, with fill_):
    one capture, and eager's results bit for bit (Note [Capturable
    optimizers])."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    make = OPTIMIZERS_WITH_A_SCHEDULE[name]
    opt, opt_e = make(list(model.parameters())), make(list(eager.parameters()))
    sched, sched_e = (torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.7)
                      for o in (opt, opt_e))
    lr = opt.param_groups[0]["lr"]
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0])
    losses = run(step, batches, sched.step)
    losses_e = run(make_step(eager, opt_e), batches, sched_e.step)
    assert_same_training(model, eager, losses, losses_e)
    assert step.stats == {"eager": 3, "captures": 1, "replays": 5}, step.stats
    if isinstance(lr, torch.Tensor):
        assert opt.param_groups[0]["lr"] is lr  # the user's, which the scheduler fills
    assert float(opt.param_groups[0]["lr"]) == float(opt_e.param_groups[0]["lr"]) < 1e-3


def test_a_grad_scaler_growth_factor_changed_after_capture_captures_again():
    """scaler.update() hands the graph its growth factor as a number: set
    after capture, it captures the step again (Note [GradScaler with any
    optimizer]), and the scale grows as eager's does."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**4, growth_interval=1)
               for _ in range(2)]
    calls = [0, 0]

    def change_after_the_fifth(i):
        def after_step():
            calls[i] += 1
            if calls[i] == 5:
                scalers[i].set_growth_factor(4.0)
        return after_step

    step = cgraph.make_graphed_step(make_step(model, opts[0], scalers[0], dtype=torch.float16),
                                    batches[0])
    losses = run(step, batches, change_after_the_fifth(0))
    losses_e = run(make_step(eager, opts[1], scalers[1], dtype=torch.float16), batches,
                   change_after_the_fifth(1))
    assert_same_training(model, eager, losses, losses_e)
    assert_equal(scalers[0]._scale, scalers[1]._scale, "the scale")
    assert scalers[0].get_scale() == 2.0**4 * 2.0**5 * 4.0**3
    assert step.stats == {"eager": 3, "captures": 2, "replays": 5}, step.stats


def test_a_disabled_grad_scaler_steps_as_eager():
    """GradScaler(enabled=use_fp16) with use_fp16 False (bf16 training):
    scale, step and update pass through; one capture, eager's results."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    scalers = [torch.amp.GradScaler("cuda", enabled=False) for _ in range(2)]
    step = cgraph.make_graphed_step(make_step(model, opts[0], scalers[0], dtype=torch.bfloat16),
                                    batches[0])
    losses = run(step, batches)
    losses_e = run(make_step(eager, opts[1], scalers[1], dtype=torch.bfloat16), batches)
    assert_same_training(model, eager, losses, losses_e)
    assert step.stats == {"eager": 3, "captures": 1, "replays": 5}, step.stats


def test_grad_scaler_skips_a_step_with_an_inf_as_eager_does():
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    batches[4] = (batches[4][0] * float("inf"), batches[4][1])  # an inf at step 4
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in range(2)]
    step = cgraph.make_graphed_step(make_step(model, opts[0], scalers[0], clip=1.0,
                                              dtype=torch.float16), batches[0])
    losses = run(step, batches)
    losses_e = run(make_step(eager, opts[1], scalers[1], clip=1.0, dtype=torch.float16),
                   batches)
    assert_same_training(model, eager, losses, losses_e)
    assert_equal(scalers[0]._scale, scalers[1]._scale, "the scale after the skipped step")
    assert scalers[0].get_scale() == 2.0**9
    assert step.stats == {"eager": 3, "captures": 1, "replays": 5}, step.stats  # step 4 replayed


def test_clip_grad_norm_inside_matches_eager():
    model, batches = model_and_data()
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5, fused=True) for m in (model, eager)]
    step = cgraph.make_graphed_step(make_step(model, opts[0], clip=0.05), batches[0])
    assert_same_training(model, eager, run(step, batches),
                         run(make_step(eager, opts[1], clip=0.05), batches))
    assert step.stats == {"eager": 3, "captures": 1, "replays": 5}, step.stats


def test_gradient_accumulation_in_one_graph():
    """Three micro-batches' forwards and backwards, then one optimizer step."""
    model, _ = model_and_data()
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]

    def accumulate(net, opt):
        def step(xs, ys):
            opt.zero_grad()
            total = 0
            for x, y in zip(xs.unbind(), ys.unbind()):
                loss = F.cross_entropy(net(x), y) / xs.shape[0]
                loss.backward()
                total = total + loss.detach()
            opt.step()
            return total
        return step

    batches = [(torch.randn(3, 16, 32, device=CUDA), torch.randint(0, 10, (3, 16), device=CUDA))
               for _ in range(6)]
    step = cgraph.make_graphed_step(accumulate(model, opts[0]), batches[0])
    assert_same_training(model, eager, run(step, batches),
                         run(accumulate(eager, opts[1]), batches))
    assert step.stats == {"eager": 3, "captures": 1, "replays": 3}, step.stats


def forward_backward(net, micro, planted=None):
    """A forward-and-backward step (the optimizer stepped outside) over one
    of `micro` micro-batches, returning its loss; each error of `planted`
    raised, one per capture, after the backward."""
    def step(x, y):
        loss = F.cross_entropy(net(x), y) / micro
        loss.backward()
        if planted and torch.cuda.is_current_stream_capturing():
            raise planted.pop()
        return loss.detach()
    return step


@pytest.mark.parametrize("micro", [1, 2])
def test_a_forward_and_backward_step_with_grads_cleared_outside_matches_eager(micro):
    """Note [Grads no optimizer of the step holds]: micro-batches graphed as
    a forward-and-backward step, the optimizer stepped and the grads
    cleared (to None) outside it.  One micro-batch per optimizer step: the
    grads are None before every call, as at capture, and the step replays;
    before, every replay wrote grads nobody held.  Two: the grads are None
    before every other call, so the step captures at those calls and runs
    the others eagerly.  Bitwise equal to eager either way."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]

    step, step_e = cgraph.make_graphed_step(forward_backward(model, micro), batches[0]), \
        forward_backward(eager, micro)
    for k, (x, y) in enumerate(batches):
        if k % micro == 0:
            for opt in opts:
                opt.zero_grad()
        assert_equal(step(x, y), step_e(x, y), f"call {k}: the loss")
        if k % micro == micro - 1:
            for opt in opts:
                opt.step()
    assert_same_training(model, eager, [], [])
    if micro == 1:
        assert step.stats == {"eager": 3, "captures": 1, "replays": 5}, step.stats
    else:
        assert step.stats["captures"] >= 2, step.stats


@pytest.mark.parametrize("micro", [1, 2])
def test_a_failed_capture_of_a_forward_and_backward_step_leaves_the_grads_as_found(micro):
    """Note [Grads no optimizer of the step holds]: a capture that raises
    after the backward, caught and gone on from.  One micro-batch: the
    grads were None before the call, and are None after it; before, each
    parameter kept the grad the capture assigned, memory no kernel wrote,
    and the optimizer outside stepped with it.  Two: the call finds the
    first micro-batch's grads and leaves them with their values (as before:
    the capture's backward added into them in place).  Training
    goes on bitwise equal to an eager twin that skipped the failed call's
    batch, and the next call captures again."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    planted = [RuntimeError("planted after the backward")]
    step = cgraph.make_graphed_step(forward_backward(model, micro, planted), batches[0])
    step_e = forward_backward(eager, micro)
    for k, (x, y) in enumerate(batches):
        if k % micro == 0:
            for opt in opts:
                opt.zero_grad()
        if k == 3:  # the call that captures
            found = [p.grad for p in model.parameters()]
            with pytest.raises(RuntimeError, match="planted after the backward"):
                step(x, y)
            assert step.stats["captures"] == 0, step.stats
            for i, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
                assert p.grad is found[i], f"parameter {i}: another grad than the call found"
                if q.grad is not None:
                    assert_equal(p.grad, q.grad, f"parameter {i}: the grad found")
        else:
            assert_equal(step(x, y), step_e(x, y), f"call {k}: the loss")
        if k % micro == micro - 1:
            for opt in opts:
                opt.step()
    assert_same_training(model, eager, [], [])
    assert step.stats["captures"] >= 1 and step.stats["replays"] >= 1, step.stats
    if micro == 1:
        assert step.stats == {"eager": 3, "captures": 1, "replays": 4}, step.stats


def test_outputs_keep_their_values_and_grads_are_this_steps():
    model, batches = model_and_data(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0], num_warmup_iters=1)
    kept = [step(*b) for b in batches[:4]]
    copies = [k.clone() for k in kept]
    step(*batches[4])
    for i, (k, c) in enumerate(zip(kept, copies)):
        assert_equal(k, c, f"loss {i} kept across calls")
    # p.grad is the latest step's grad: the graph's zero_grad and backward.
    x, y = batches[5]
    probe = copy.deepcopy(model)
    F.cross_entropy(probe(x), y).backward()
    step(x, y)
    for p, q in zip(model.parameters(), probe.parameters()):
        assert_equal(p.grad, q.grad, "grad after a replay")
    # Note [The step's hot path]: the graph copied every argument in itself,
    # and each held loss was copied once, before the replay that followed it.
    native = step.graphed.stats
    assert native["forward"] == step.stats["replays"] == 5, (native, step.stats)
    assert native["copied_in_graph"] == 10 and native["copied_before"] == 0, native
    assert native["outputs_copied"] == 3, native  # replays 1-3; the 4th was not held


@pytest.mark.parametrize("body, match, kind", [
    ("item", r"training step.*\.item\(\)", "sync"),
    ("branch", r"training step.*\.item\(\)", "sync"),  # a Python branch on a tensor
    # A CPU draw would be baked into the graph at capture and never drawn again.
    ("cpu_random", "training step.*host-side random", "rng_changed"),
    # mixup's weight drawn from NumPy's or Python's global generator: the same
    # (Note [Python's random numbers drawn during capture], csrc/capture.c).
    ("numpy_mixup", "training step.*would reuse that one draw", "rng_changed"),
    ("python_random", "training step.*would reuse that one draw", "rng_changed"),
], ids=["item", "branch", "cpu_random", "numpy_mixup", "python_random"])
def test_a_host_sync_or_cpu_draw_in_the_step_is_refused_with_the_fix(body, match, kind):
    model, batches = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)

    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        if body == "item":
            print(loss.item())
        elif body == "branch" and loss > 100:
            loss = loss * 0
        elif body == "cpu_random":
            loss = loss * (1 + torch.rand(()))
        elif body == "numpy_mixup":
            np = pytest.importorskip("numpy")
            loss = loss * float(np.random.beta(0.4, 0.4))
        elif body == "python_random":
            loss = loss * (1 + random.random())
        loss.backward()
        opt.step()
        return loss

    graphed = cgraph.make_graphed_step(step, batches[0], num_warmup_iters=1)
    graphed(*batches[0])
    with pytest.raises(cgraph.CaptureError, match=match) as info:
        graphed(*batches[1])
    assert info.value.kind == kind


def test_an_optimizer_steps_as_before_after_a_capture_that_failed():
    """A capture that fails leaves the optimizer as it found it (capturable
    off, step counts on the host): a caller going on eagerly (Lightning's
    scope="step" falls back so) steps as eager does, bitwise."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]

    def make_step(net, opt, sync):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(net(x), y)
            if sync:
                loss.item()
            loss.backward()
            opt.step()
            return loss
        return step

    graphed = cgraph.make_graphed_step(make_step(model, opts[0], True), batches[0],
                                       num_warmup_iters=1)
    graphed(*batches[0])
    with pytest.raises(cgraph.CaptureError):
        graphed(*batches[1])
    group, state = opts[0].param_groups[0], opts[0].state[next(model.parameters())]
    assert group["capturable"] is False and state["step"].device.type == "cpu"
    for x, y in batches[1:]:
        make_step(model, opts[0], False)(x, y)
    for x, y in batches:
        make_step(eager, opts[1], False)(x, y)
    for i, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        assert torch.equal(p, q), f"parameter {i}"


def test_a_refused_capture_gives_back_the_memory_its_warm_up_cached():
    """A step refused at its capture (an optimizer with no capturable form)
    keeps neither the pool its warm-up ran in, with the activations cached
    there, nor static copies of its arguments: a caller going on eagerly gets
    the memory back (482 MiB were kept here before)."""
    class Plain(torch.optim.Optimizer):
        def __init__(self, params):
            super().__init__(params, {"lr": 0.1})

        @torch.no_grad()
        def step(self):
            for group in self.param_groups:
                for p in group["params"]:
                    p.add_(p.grad, alpha=-group["lr"])

    if not cgraph._C.can_call_in_pool():  # expandable segments, cudaMallocAsync
        pytest.skip("this allocator runs a step's warm-up in the device's cache")
    model = nn.Linear(1024, 1024).to(CUDA)
    opt, x = Plain(model.parameters()), torch.randn(4096, 1024, device=CUDA)

    def step(x):
        opt.zero_grad(set_to_none=False)  # the grads stay where the first step below put them
        loss = model(x.repeat(4, 1)).square().mean()
        loss.backward()
        opt.step()

    step(x)  # so no tensor the warm-up makes outlives it: the pool can go back whole
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_reserved()
    graphed = cgraph.make_graphed_step(step, num_warmup_iters=1)
    graphed(x)
    refused = False
    try:
        graphed(x)
    except ValueError as exc:  # not pytest.raises: its traceback would keep the frame
        refused = "no capturable form" in str(exc)
    assert refused
    torch.cuda.empty_cache()
    kept = torch.cuda.memory_reserved() - before
    segments = [(s["segment_pool_id"], s["total_size"] >> 20, s["allocated_size"] >> 20)
                for s in torch.cuda.memory_snapshot()]  # (pool, MiB, MiB allocated) each
    assert kept < 16 << 20, f"{kept / 2**20:.0f} MiB kept: {segments}"


class CheckpointedBlocks(nn.Module):
    """Two blocks with dropout, each checkpointed: the recompute must redraw
    the forward's masks (preserve_rng_state=True) or the grads are wrong."""

    def __init__(self, use_reentrant, preserve_rng_state=True):
        super().__init__()
        self.stem = nn.Linear(32, 32)  # so use_reentrant=True regions get inputs with grad
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(32, 32), nn.GELU(), nn.Dropout(0.3)) for _ in range(2))
        self.head = nn.Linear(32, 10)
        self.kwargs = dict(use_reentrant=use_reentrant, preserve_rng_state=preserve_rng_state)

    def forward(self, x):
        from torch.utils.checkpoint import checkpoint
        x = self.stem(x)
        for block in self.blocks:
            x = checkpoint(block, x, **self.kwargs)
        return self.head(nn.functional.dropout(x, 0.1))


def train_both(make_model, steps=6, num_warmup_iters=2, wrap=lambda m: m,
               eager_under=contextlib.nullcontext):
    """The same model trained by a graphed step and eagerly (inside
    eager_under()), from one CUDA random state, each called through
    wrap(model); returns (graphed step, losses, losses eager, models)."""
    torch.manual_seed(61)
    model = make_model().to(CUDA)
    eager = copy.deepcopy(model)
    batches = [(torch.randn(16, 32, device=CUDA), torch.randint(0, 10, (16,), device=CUDA))
               for _ in range(steps)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    graphed = cgraph.make_graphed_step(make_step(wrap(model), opts[0]), batches[0],
                                       num_warmup_iters=num_warmup_iters)
    generator = torch.cuda.default_generators[torch.device(CUDA).index or 0]
    losses = run(graphed, batches)
    offset = generator.get_offset()
    with eager_under():
        losses_e = run(make_step(wrap(eager), opts[1]), batches)
    assert offset == generator.get_offset(), "the CUDA generator's offset after the steps"
    return graphed, losses, losses_e, (model, eager)


@pytest.mark.parametrize("use_reentrant", [False, True])
def test_checkpointed_dropout_in_the_step_redraws_eager_masks(use_reentrant):
    """Note [RNG inside a graphed step]: checkpoint with preserve_rng_state
    (both kinds) inside a whole step, dropout in and after the regions: n
    graphed steps are n eager steps bitwise (losses, parameters, grads), and
    the default generator ends where eager's does (train_both)."""
    graphed, losses, losses_e, (model, eager) = train_both(
        lambda: CheckpointedBlocks(use_reentrant))
    assert graphed.stats["captures"] == 1 and graphed.stats["replays"] == 4, graphed.stats
    assert_same_training(model, eager, losses, losses_e)


def test_a_step_that_checkpoints_on_some_calls_only_is_refused_naming_why():
    """A region entered at capture but not in the last warm-up call cannot
    be matched to a random stream."""
    from torch.utils.checkpoint import checkpoint
    model, batches = model_and_data(dropout=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    calls = [0]

    def step(x, y):
        calls[0] += 1
        opt.zero_grad()
        out = checkpoint(model, x, use_reentrant=False) if calls[0] > 1 else model(x)
        loss = F.cross_entropy(out, y)
        loss.backward()
        opt.step()
        return loss

    graphed = cgraph.make_graphed_step(step, batches[0], num_warmup_iters=1)
    graphed(*batches[0])
    with pytest.raises(cgraph.CaptureError, match="different number of times") as info:
        graphed(*batches[1])
    assert info.value.kind == "rng_regions"


def compiled_model(model):
    return torch.compile(model)


def compiled_blocks(model):
    model[0].compile()  # the body, in place
    return model


def autotuned_model(model):
    return torch.compile(model, mode="max-autotune-no-cudagraphs")


@pytest.mark.parametrize("wrap", [compiled_model, compiled_blocks, autotuned_model])
def test_a_compiled_model_with_dropout_in_the_step_trains_as_compiled_eager(wrap):
    """torch.compile of the whole model (default mode, and
    max-autotune-no-cudagraphs) or of a block in place, dropout inside the
    compiled code: graphed steps equal the same compiled model stepped
    eagerly, bitwise in default mode (the same kernels; their seeds come
    from the default generator's graph-safe state).  max-autotune compiles
    the two copies separately and may pick GEMM kernels that reduce in
    another order for each (tests/test_integration.py): float32 tolerance.
    In default mode the eager copy runs under the state cgraph compiled in
    (state_as_captured), so it runs the code compiled in cgraph's warm-up:
    compiled a second time, under autocast's cache, its kernels were 1 ulp
    off in 2 of 3 suite runs on a shared H200."""
    torch._dynamo.reset()

    def make():
        body = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Dropout(0.2), nn.Linear(64, 32))
        return nn.Sequential(body, nn.GELU(), nn.Linear(32, 10))

    exact = wrap is not autotuned_model
    with inductor_deterministic(exact):
        graphed, losses, losses_e, (model, eager) = train_both(
            make, wrap=wrap, eager_under=state_as_captured if exact else contextlib.nullcontext)
    assert graphed.stats["captures"] == 1, graphed.stats
    assert_same_training(model, eager, losses, losses_e, exact=exact)


def test_a_compiled_function_that_zeroes_grads_inside_the_step_trains_as_eager():
    """README, Limits: compiled code inside a graphed step that calls
    zero_grad() (a compiled forward-and-backward), which dynamo guards on
    and cgraph patches while it captures (Note [Grads around a graphed
    step]): it compiles again inside the capture, and the graphed step
    trains as the same function compiled and run eagerly, to float32
    tolerance (the twins are compiled apart, under different guards)."""
    torch._dynamo.reset()
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)

    def compiled_step(m):
        opt = torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9)

        @torch.compile
        def forward_backward(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(m(x), y)
            loss.backward()
            return loss

        def step(x, y):
            loss = forward_backward(x, y)
            opt.step()
            return loss
        return step

    graphed = cgraph.make_graphed_step(compiled_step(model), batches[0], num_warmup_iters=2)
    with inductor_deterministic():
        losses = run(graphed, batches)
        losses_e = run(compiled_step(eager), batches)
    assert graphed.stats["captures"] == 1 and graphed.stats["replays"] == 6, graphed.stats
    assert_same_training(model, eager, losses, losses_e, exact=False)


def test_a_reduce_overhead_model_in_the_step_is_refused_naming_why():
    torch._dynamo.reset()
    model, batches = model_and_data(dropout=0.0)
    compiled = torch.compile(model, mode="reduce-overhead")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    graphed = cgraph.make_graphed_step(make_step(compiled, opt), batches[0],
                                       num_warmup_iters=2)
    for x, y in batches[:2]:
        graphed(x, y)
    with pytest.raises(cgraph.CaptureError) as info:
        graphed(*batches[2])
    assert info.value.kind == "nested_graphs", info.value


@pytest.mark.parametrize("returns", ["none", "dict"])
def test_a_step_may_return_none_or_numbers_beside_its_tensors(returns):
    """The native call hands out tensors only; what else the step returned
    comes back around them, call after call, and training equals eager's."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, fused=True) for m in (model, eager)]

    def make(m, opt):
        train = make_step(m, opt)

        def step(x, y):
            loss = train(x, y)
            if returns == "dict":
                return {"loss": loss, "rows": x.shape[0], "note": None}
        return step

    graphed, plain = cgraph.make_graphed_step(make(model, opts[0]), num_warmup_iters=1), \
        make(eager, opts[1])
    for i, (x, y) in enumerate(batches[:4]):
        got, want = graphed(x, y), plain(x, y)
        if returns == "none":
            assert got is None and want is None, got
        else:
            assert (got["rows"], got["note"]) == (16, None), got
            assert_equal(got["loss"], want["loss"], f"loss {i}")
    assert graphed.stats == {"eager": 1, "captures": 1, "replays": 3}
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_equal(p, q, "parameter after 4 steps")


def test_an_argument_that_requires_grad_is_refused_and_outputs_have_no_grad_fn():
    model, batches = model_and_data(dropout=0.0)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = cgraph.make_graphed_step(make_step(model, opt), num_warmup_iters=1)
    x, y = batches[0]
    with pytest.raises(ValueError, match="step argument 0 requires grad.*x.detach"):
        step(x.clone().requires_grad_(), y)
    for b in batches[:3]:
        loss = step(*b)
    assert step.stats["replays"] == 2 and loss.grad_fn is None and not loss.requires_grad


def test_arguments_of_another_shape_raise():
    model, batches = model_and_data()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0])
    with pytest.raises(ValueError, match=r"step argument 0 is .*\(8, 32\).*\(16, 32\)"):
        step(torch.randn(8, 32, device=CUDA), torch.randint(0, 10, (8,), device=CUDA))


@pytest.mark.parametrize("call", ["positional", "keywords"])
def test_constants_and_keywords_replay_and_other_arguments_raise_after_capture(call):
    """A positional call with a constant (the replay path of Note [The
    step's hot path]) and one with a keyword (the general path) replay as
    eager steps; after capture, another constant or shape still raises."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, fused=True) for m in (model, eager)]

    def make(m, opt):
        def step(x, y, scale, smoothing=0.0):
            opt.zero_grad()
            loss = F.cross_entropy(m(x) * scale, y, label_smoothing=smoothing)
            loss.backward()
            opt.step()
            return loss
        return step

    graphed, plain = make(model, opts[0]), make(eager, opts[1])
    graphed = cgraph.make_graphed_step(graphed, num_warmup_iters=1)  # the first call decides
    extra = {"smoothing": 0.1} if call == "keywords" else {}
    for i, (x, y) in enumerate(batches[:5]):
        assert_equal(graphed(x, y, 2.0, **extra), plain(x, y, 2.0, **extra), f"loss {i}")
    assert graphed.stats == {"eager": 1, "captures": 1, "replays": 4}
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_equal(p, q, "parameter after 5 steps")
    with pytest.raises(ValueError, match=r"step argument 2 was graphed as 2.0, got 3.0.*"
                                         r"graph one step per value"):
        graphed(*batches[5], 3.0, **extra)
    with pytest.raises(ValueError, match=r"step argument 0 is .*\(8, 32\).*\(16, 32\)"):
        graphed(batches[5][0][:8], batches[5][1][:8], 2.0, **extra)
    assert graphed.stats["replays"] == 4


UNFUSED = {
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=0.1),
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "rmsprop": lambda ps: torch.optim.RMSprop(ps, lr=1e-3),
}


@pytest.mark.parametrize("name", list(UNFUSED))
def test_grad_scaler_with_an_unfused_optimizer_skips_an_inf_step_as_eager_does(name):
    """Note [GradScaler with any optimizer]: the optimizer's step is a
    conditional node on found_inf.  An inf at step 4: that step changes no
    parameter and no optimizer state, in the graph as in eager.  AdamW and
    RMSprop are made capturable (float32 step sizes on the device, eager's
    in float64 on the host): compared with assert_close; SGD bitwise."""
    exact = name.startswith("sgd")
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    batches[4] = (batches[4][0] * float("inf"), batches[4][1])
    opt, opt_e = UNFUSED[name](model.parameters()), UNFUSED[name](eager.parameters())
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in range(2)]
    step = cgraph.make_graphed_step(make_step(model, opt, scalers[0], clip=1.0,
                                              dtype=torch.float16), batches[0])
    losses = run(step, batches)
    losses_e = run(make_step(eager, opt_e, scalers[1], clip=1.0, dtype=torch.float16),
                   batches)
    assert step.stats["captures"] == 1 and step.stats["replays"] == 5, step.stats
    assert_same_training(model, eager, losses, losses_e, exact=exact,
                         grad_tolerance=None if exact else FP16_GRADS, tolerance=FP16_STEPS)
    assert_equal(scalers[0]._scale, scalers[1]._scale, "the scale")
    assert scalers[0].get_scale() == 2.0**9
    for p, q in zip(opt.state.values(), opt_e.state.values()):
        for key in q:
            torch.testing.assert_close(p[key].to(q[key].device, q[key].dtype), q[key],
                                       msg=lambda m, key=key: f"state {key}: {m}")


def test_warm_up_waits_for_the_first_step_a_grad_scaler_does_not_skip():
    """fp16 at a huge first scale: the scaler skips the first steps (inf
    grads) while it halves the scale.  The momentum buffers appear at the
    first step it does not skip; capture waits for it, then the graphed
    steps equal eager's."""
    model, batches = model_and_data(dropout=0.0)
    batches = batches * 4
    eager = copy.deepcopy(model)
    opt, opt_e = (torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager))
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**40) for _ in range(2)]
    step = cgraph.make_graphed_step(make_step(model, opt, scalers[0], dtype=torch.float16),
                                    batches[0], num_warmup_iters=1)
    losses = run(step, batches)
    losses_e = run(make_step(eager, opt_e, scalers[1], dtype=torch.float16), batches)
    assert step.stats["eager"] > 1 and step.stats["captures"] == 1, step.stats
    assert_same_training(model, eager, losses, losses_e)
    assert_equal(scalers[0]._scale, scalers[1]._scale, "the scale")


def scaled_step_zeroed_outside(model, opt, scaler):
    def step(x, y):
        with torch.autocast("cuda", dtype=torch.float16):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss
    return step


@pytest.mark.parametrize("zeroed", ["inside", "outside"])
@pytest.mark.parametrize("unfrozen_at", [3, 1], ids=["after-capture", "before-capture"])
def test_a_layer_unfrozen_under_a_grad_scaler_gets_its_state_from_a_step_not_skipped(
        unfrozen_at, zeroed):
    """Note [GradScaler with any optimizer]: the first layer unfrozen after
    capture (call 3), or between the warm-up call and the capture (call 1),
    and that call's step skipped by the scaler (an inf): its momentum
    buffers are made by the first step the scaler does not skip, as eager's
    are.  Before, a capture made them inside the conditional node, unwritten
    where the scaler skipped, and kept them.  With the grads zeroed outside
    the step, a dropped capture gives back the grads it found (the pool's
    unwritten ones stayed, and the eager step added into them).  SGD:
    bitwise."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    batches[unfrozen_at] = (batches[unfrozen_at][0] * float("inf"), batches[unfrozen_at][1])
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9) for m in (model, eager)]
    scalers = [torch.amp.GradScaler("cuda", init_scale=2.0**10) for _ in range(2)]
    steps = [make_step(m, o, s, dtype=torch.float16) if zeroed == "inside"
             else scaled_step_zeroed_outside(m, o, s)
             for m, o, s in zip((model, eager), opts, scalers)]
    steps[0] = cgraph.make_graphed_step(steps[0], batches[0], num_warmup_iters=1)
    losses = [[], []]
    for m in (model, eager):
        m[0].requires_grad_(False)
    for i, (x, y) in enumerate(batches):
        for m, opt, step, out in zip((model, eager), opts, steps, losses):
            if i == unfrozen_at:
                m[0].requires_grad_(True)
            if zeroed == "outside":
                opt.zero_grad()
            out.append(step(x, y).detach().clone())
    assert_same_training(model, eager, *losses)
    for p, q in zip(model.parameters(), eager.parameters()):
        assert_equal(opts[0].state[p]["momentum_buffer"], opts[1].state[q]["momentum_buffer"],
                     "momentum buffer")
    assert steps[0].stats["replays"] >= 3, steps[0].stats


def test_a_grad_scaler_with_an_unfused_optimizer_is_refused_without_conditional_nodes(
        monkeypatch):
    from cgraph import _step
    monkeypatch.setattr(_step._C, "conditional_nodes", lambda: False)
    model, batches = model_and_data(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cuda")
    step = cgraph.make_graphed_step(make_step(model, opt, scaler, dtype=torch.float16),
                                    batches[0], num_warmup_iters=1)
    step(*batches[0])
    with pytest.raises(ValueError,
                       match=r"conditional graph nodes.*AdamW\(\.\.\., fused=True\)"):
        step(*batches[1])


def test_a_disabled_grad_scaler_needs_no_conditional_nodes(monkeypatch):
    """GradScaler(enabled=use_fp16) without fp16 steps as optimizer.step()
    and reads no found_inf: an unfused optimizer is graphed without
    conditional nodes (it was refused, naming fused=True)."""
    from cgraph import _step
    monkeypatch.setattr(_step._C, "conditional_nodes", lambda: False)
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2) for m in (model, eager)]
    scalers = [torch.amp.GradScaler("cuda", enabled=False) for _ in range(2)]
    step = cgraph.make_graphed_step(make_step(model, opts[0], scalers[0]), batches[0],
                                    num_warmup_iters=1)
    losses = run(step, batches)
    losses_e = run(make_step(eager, opts[1], scalers[1]), batches)
    assert step.stats["captures"] == 1 and step.stats["replays"] >= 1, step.stats
    # Capturable AdamW computes its step sizes in float32 on the device.
    assert_same_training(model, eager, losses, losses_e, exact=False)


def test_a_step_reset_or_dropped_after_warming_up_in_its_pool_trains_on_as_eager():
    """Note [A step's warm-up in its pool] (csrc/aten_setup.cpp): the AdamW
    moments the warm-up steps made in the step's pool outlive the graph that
    pool went to.  After step.reset() the next call captures again (into a
    pool of its own), and after the step is dropped the optimizer steps
    eagerly: losses, parameters and grads stay eager's, bitwise."""
    import gc
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    step = cgraph.make_graphed_step(make_step(model, opts[0]), batches[0])
    losses = run(step, batches[:5])
    step.reset()
    losses += run(step, batches[5:7])
    assert step.stats == {"eager": 3, "captures": 2, "replays": 4}, step.stats
    del step
    gc.collect()
    torch.cuda.empty_cache()  # the released pools' free memory goes; the moments stay
    losses += run(make_step(model, opts[0]), batches[7:])
    losses_e = run(make_step(eager, opts[1]), batches)
    assert_same_training(model, eager, losses, losses_e)


# Note [Grads around a graphed step] (cgraph/_step_grads.py): grads made, or
# set to None, outside the step between calls.

def outside_backward(net, x, y):
    F.cross_entropy(net(x), y).backward()


@pytest.mark.parametrize("set_to_none", [True, False], ids=["set-to-none", "zeroed"])
@pytest.mark.parametrize("name", ["adamw-fused", "sgd-default"])
def test_an_optimizer_step_graphed_alone_steps_each_calls_grads_as_eager(name, set_to_none):
    """Per-layer graphs (or eager layers) with the optimizer step graphed
    on its own: each call's grads are made outside the step, new tensors
    when zero_grad() sets them to None.  The last step's grads are kept (a
    log of them, say), so new ones cannot land where they were: before,
    the graph read the capturing call's grads again at every replay."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opt, opt_e = OPTIMIZERS[name](model.parameters()), OPTIMIZERS[name](eager.parameters())
    optimizer_step = cgraph.make_graphed_step(opt.step)
    kept = []
    for i, (x, y) in enumerate(batches):
        for net, o, stepper in ((model, opt, optimizer_step), (eager, opt_e, opt_e.step)):
            kept.append([p.grad for p in net.parameters()])
            o.zero_grad(set_to_none=set_to_none)
            outside_backward(net, x, y)
            stepper()
        del kept[:-2]
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_equal(p, q, f"parameter {n} after step {i}")
            assert_equal(p.grad, q.grad, f"grad of {n} after step {i}")
    assert optimizer_step.stats == {"eager": 3, "captures": 1, "replays": 5}
    grads = optimizer_step.grads
    assert [p.grad for p in model.parameters()] == list(grads.held_grads)
    opt.zero_grad()
    with pytest.raises(ValueError, match="parameter 0 of param group 0 of .*None.*zero_grad"):
        optimizer_step()


def finish(net, opt):
    """A step that ends a micro-batch cycle: backward, the optimizer step,
    then zero_grad() (at its end, not its start)."""
    def step(x, y):
        loss = F.cross_entropy(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad()
        return loss
    return step


def test_micro_batches_accumulated_outside_the_step_and_grads_cleared_inside_match_eager():
    """The first micro-batch's backward outside the step, the second's
    inside it, then the optimizer step and zero_grad(): the graph reads the
    grads made outside, and leaves none, as eager does."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    graphed = cgraph.make_graphed_step(finish(model, opts[0]), batches[0], num_warmup_iters=1)
    plain = finish(eager, opts[1])
    for i in range(0, len(batches), 2):
        (x1, y1), (x2, y2) = batches[i], batches[i + 1]
        for net, step in ((model, graphed), (eager, plain)):
            outside_backward(net, x1, y1)
            step(x2, y2)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_equal(p, q, f"parameter {n} after step {i // 2}")
            assert p.grad is None and q.grad is None, (p.grad, q.grad)
    assert graphed.stats == {"eager": 1, "captures": 1, "replays": 3}, graphed.stats


def test_micro_batches_outside_from_a_later_call_on_are_added_as_eager(caplog):
    """Backward, step and zero_grad() inside, captured while no micro-batch
    ran outside (a batch-size ramp-up, an auxiliary loss every few steps):
    the graph makes the grads.  A call after a backward outside steps
    eagerly (logged) and the next captures again, holding the grads made
    outside: eager's results, bitwise.  Before, every replay dropped the
    grads made outside, silently (rule 4 of Note [Grads around a graphed
    step])."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    graphed = cgraph.make_graphed_step(finish(model, opts[0]), batches[0], num_warmup_iters=1)
    plain = finish(eager, opts[1])
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for i, (x, y) in enumerate(batches):
            losses = []
            for net, step in ((model, graphed), (eager, plain)):
                if i >= 3:  # the ramp-up's end: a micro-batch outside from here on
                    outside_backward(net, *batches[i - 1])
                losses.append(step(x, y))
            assert_equal(*losses, f"loss of call {i}")
            for (n, p), q in zip(model.named_parameters(), eager.parameters()):
                assert_equal(p, q, f"parameter {n} after call {i}")
                assert p.grad is None and q.grad is None, (p.grad, q.grad)
    assert_logged(caplog, "the grad of parameter 0 of param group 0 of AdamW",
                  "was made outside the step")
    assert graphed.stats == {"eager": 2, "captures": 2, "replays": len(batches) - 2}, \
        graphed.stats


def test_grads_the_step_replaces_after_its_backward_added_into_them_match_eager():
    """Rule 1 of Note [Grads around a graphed step]: grads zeroed in place
    outside (set_to_none=False); the step's backward adds into them, then the
    step replaces them (p.grad = p.grad * 0.5) before its optimizer steps.
    Every replay adds into the first grads, which the step holds, with the
    grads zeroed outside copied in first: eager's results, bitwise.  Before,
    the first grads were freed at capture and replays added into that
    memory."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]

    def make(net, opt):
        def step(x, y):
            loss = F.cross_entropy(net(x), y)
            loss.backward()
            for p in net.parameters():
                p.grad = p.grad * 0.5
            opt.step()
            return loss.detach()
        return step

    for net in (model, eager):
        for p in net.parameters():
            p.grad = torch.zeros_like(p)
    graphed = cgraph.make_graphed_step(make(model, opts[0]), batches[0], num_warmup_iters=1)
    plain = make(eager, opts[1])
    for i, (x, y) in enumerate(batches):
        for opt in opts:
            opt.zero_grad(set_to_none=False)
        assert_equal(graphed(x, y), plain(x, y), f"loss of call {i}")
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_equal(p, q, f"parameter {n} after call {i}")
            assert_equal(p.grad, q.grad, f"grad of {n} after call {i}")
    assert graphed.stats == {"eager": 1, "captures": 1, "replays": len(batches) - 1}, \
        graphed.stats


class _RunningMean(nn.Module):
    """Scales its input by a running mean of it, assigned anew each call."""

    def __init__(self):
        super().__init__()
        self.register_buffer("mean", torch.ones(32))

    def forward(self, x):
        with torch.no_grad():
            self.mean = 0.8 * self.mean + 0.2 * x.abs().mean(0)
        return x / self.mean


def test_a_buffer_the_forward_assigns_anew_accumulates_inside_a_graphed_step():
    """Note [A buffer assigned anew during set-up] (cgraph/_capture.py) in a
    step graphed whole: its capture keeps the buffer's tensor, so replays
    read and update the module's running mean; loss, parameters and the
    buffer equal eager's, bitwise.  Before, every replay read the tensor the
    capture began with."""
    model, batches = model_and_data(dropout=0.0)
    model = nn.Sequential(_RunningMean(), *model).to(CUDA)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, fused=True) for m in (model, eager)]
    step = cgraph.make_graphed_step(make_step(model, opts[0]), batches[0], num_warmup_iters=1)
    plain = make_step(eager, opts[1])
    for i, (x, y) in enumerate(batches):
        assert_equal(step(x, y), plain(x, y), f"loss of call {i}")
        assert_equal(model[0].mean, eager[0].mean, f"running mean after call {i}")
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_equal(p, q, f"parameter {n} after call {i}")
    assert step.stats == {"eager": 1, "captures": 1, "replays": len(batches) - 1}, step.stats


def test_grads_set_to_none_between_calls_are_the_steps_own_after_each_replay():
    """zero_grad() outside the step as well as inside: after each call the
    parameters hold that step's grads, as after an eager step (before,
    they were left None)."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, fused=True) for m in (model, eager)]
    step = cgraph.make_graphed_step(make_step(model, opts[0]), batches[0], num_warmup_iters=1)
    plain = make_step(eager, opts[1])
    for i, (x, y) in enumerate(batches):
        for opt, fn in zip(opts, (step, plain)):
            opt.zero_grad()
            fn(x, y)
        for (n, p), q in zip(model.named_parameters(), eager.parameters()):
            assert_equal(p.grad, q.grad, f"grad of {n} after step {i}")
            assert_equal(p, q, f"parameter {n} after step {i}")


@pytest.mark.parametrize("change", ["load_state_dict", "add_param_group"])
def test_an_optimizer_loaded_or_grown_after_capture_is_captured_again(change):
    """Resuming from a checkpoint in the same process: load_state_dict
    replaces the optimizer's param groups and state, so the graph would
    step the old state and read the old groups' lr (a scheduler changes
    the new ones); add_param_group adds parameters the graph never steps.
    Either captures the step again (Note [Capturable optimizers]): eager's
    results, bitwise."""
    model, batches = model_and_data(dropout=0.0)
    eager = copy.deepcopy(model)
    biases = [nn.Parameter(torch.zeros(10, device=CUDA)) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-2, fused=True) for m in (model, eager)]
    schedulers = [torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.7) for opt in opts]

    def make(net, opt, bias):
        def step(x, y):
            opt.zero_grad()
            loss = F.cross_entropy(net(x) + bias, y)
            loss.backward()
            opt.step()
            return loss
        return step

    steps = [cgraph.make_graphed_step(make(model, opts[0], biases[0]), batches[0],
                                      num_warmup_iters=1),
             make(eager, opts[1], biases[1])]
    saved = []
    for i, (x, y) in enumerate(batches * 2):
        if i == 3:
            saved = [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict()))
                     for m, o in zip((model, eager), opts)]
        if i == 6:
            for (model_state, opt_state), m, o, bias in zip(saved, (model, eager), opts, biases):
                if change == "load_state_dict":
                    m.load_state_dict(model_state)  # in place: the graph's parameters
                    o.load_state_dict(opt_state)
                else:
                    o.add_param_group({"params": [bias], "lr": 1e-2})
        losses = [step(x, y) for step in steps]
        assert_equal(losses[0], losses[1], f"loss of step {i}")
        for scheduler in schedulers:
            scheduler.step()
    for (name, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_equal(p, q, f"parameter {name}")
    assert_equal(biases[0], biases[1], "the bias")
    assert steps[0].stats == {"eager": 2, "captures": 2, "replays": 14}, steps[0].stats


GARBAGE_DURING_CAPTURE = """
import gc, torch, torch.nn.functional as F, cgraph
model = torch.nn.Linear(8, 4).cuda()
opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
pinned = torch.ones(1024).pin_memory()
pinned.to("cuda", non_blocking=True)  # its free records an event on the default stream
torch.cuda.synchronize()
holder = [pinned]
del pinned

def step(x):
    if torch.cuda.is_current_stream_capturing():
        cycle = {"pinned": holder.pop()}
        cycle["self"] = cycle
        del cycle  # garbage, in the youngest generation
        junk = [[] for _ in range(1000)]  # allocations that start collections
    opt.zero_grad()
    loss = F.mse_loss(model(x), torch.zeros(4, 4, device="cuda"))
    loss.backward()
    opt.step()
    return loss

gc.set_threshold(1, 1, 1)
graphed = cgraph.make_graphed_step(step, (torch.randn(4, 8, device="cuda"),),
                                   num_warmup_iters=1)
for _ in range(3):
    graphed(torch.randn(4, 8, device="cuda"))
torch.cuda.synchronize()
assert gc.isenabled() and graphed.stats["captures"] == 1, graphed.stats
print("ok")
"""


def test_garbage_that_appears_while_a_step_is_captured_is_collected_after_it():
    """Note [No garbage collection while capturing] (csrc/capture.c): a
    cycle holding a pinned tensor that a non_blocking copy used becomes
    garbage inside the capture; collected there, its free would record an
    event on the default stream inside the capture, and abort the process
    from a destructor.  In a process of its own, which that would end."""
    run = subprocess.run([sys.executable, "-c", GARBAGE_DURING_CAPTURE], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": ROOT})
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout + run.stderr[-3000:]


def test_a_checkpoint_of_a_graphed_optimizer_loads_on_the_cpu_and_keeps_the_live_state():
    """Note [Capturable optimizers]: the graph needs capturable=True and step
    counts on the device; a state_dict() saved meanwhile has the groups as
    built and their step counts on the CPU, as eager's, loads into a CPU
    copy and steps there, and leaves the live optimizer as it is."""
    model, batches = model_and_data(dropout=0.0)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)  # foreach: made capturable
    step = cgraph.make_graphed_step(make_step(model, opt), batches[0])
    run(step, batches)
    assert step.stats["replays"] >= 1, step.stats
    saved = opt.state_dict()
    assert [g["capturable"] for g in saved["param_groups"]] == [False]
    assert all(s["step"].device.type == "cpu" for s in saved["state"].values())
    assert opt.param_groups[0]["capturable"] and all(s["step"].is_cuda
                                                      for s in opt.state.values())
    cpu = copy.deepcopy(model).cpu()
    cpu_opt = torch.optim.AdamW(cpu.parameters(), lr=1e-2)
    cpu_opt.load_state_dict(saved)
    for p in cpu.parameters():
        p.grad = torch.ones_like(p)
    cpu_opt.step()
    run(step, batches[:2])  # the graphed step goes on replaying
    assert step.stats["captures"] == 1, step.stats

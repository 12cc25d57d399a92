"""make_graphed_step's warm-up on the CPU (no capture): warm-up calls are
eager steps, and a GradScaler's skipped steps do not count towards it
(Note [GradScaler with any optimizer] in cgraph/_step.py).  The GPU tests
of the step are in tests/test_step.py."""

import gc
import logging

import torch
from torch import nn

import cgraph


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
    from cgraph._step import _Containers

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
    from cgraph._step import _Containers

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

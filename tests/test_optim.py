"""cgraph's device-resident Adagrad (Note [Optimizers without a capturable
form] in cgraph/_optim.py), on the CPU: the same steps as torch's Adagrad,
bitwise with the default lr_decay=0, to float32 rounding with another; and
the bounds of Note [An unfused SGD stepped by the fused kernel] there.  Their
use inside a graphed step is tested on a GPU in tests/test_step.py."""

import contextlib
import copy

import pytest
import torch
from torch import nn

from cgraph import _optim

SETTINGS = {
    "default": {},
    "weight-decay": {"weight_decay": 0.1},
    "maximize": {"maximize": True, "weight_decay": 0.1},
    "lr-decay": {"lr_decay": 0.01},
    "accumulator": {"initial_accumulator_value": 0.5, "eps": 1e-6},
}


def no_host_reads(*args):
    raise AssertionError("a device-resident step read a tensor on the host")


def train(model, opt, device_resident, steps=5):
    torch.manual_seed(1)
    for _ in range(steps):
        opt.zero_grad()
        model(torch.randn(4, 8)).square().mean().backward()
        if device_resident:
            # torch's Adagrad reads each step count with .item(): a graph could not
            with _optim.device_resident_steps(), pytest.MonkeyPatch.context() as m:
                m.setattr(torch.Tensor, "item", no_host_reads)
                opt.step()
        else:
            opt.step()


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single-tensor"])
@pytest.mark.parametrize("name", list(SETTINGS))
def test_device_resident_adagrad_steps_as_torchs(name, foreach):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 8), nn.Tanh(), nn.Linear(8, 2))
    twin = copy.deepcopy(model)
    opts = [torch.optim.Adagrad(m.parameters(), lr=0.1, foreach=foreach, **SETTINGS[name])
            for m in (model, twin)]
    train(model, opts[0], device_resident=True)
    train(twin, opts[1], device_resident=False)
    exact = "lr_decay" not in SETTINGS[name]
    for p, q in zip(model.parameters(), twin.parameters()):
        if exact:
            assert torch.equal(p, q)
        else:
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
        for key in ("sum", "step"):
            torch.testing.assert_close(opts[0].state[p][key], opts[1].state[q][key],
                                       rtol=0 if exact else 1e-6, atol=0 if exact else 1e-7)


def test_complex_parameters_step_as_torchs():
    torch.manual_seed(0)
    p = nn.Parameter(torch.randn(3, dtype=torch.complex64))
    q = nn.Parameter(p.detach().clone())
    for foreach in (True, False):
        opts = [torch.optim.Adagrad([t], lr=0.1, foreach=foreach) for t in (p, q)]
        for resident, (t, opt) in ((True, (p, opts[0])), (False, (q, opts[1]))):
            t.grad = torch.ones_like(t) * (1 + 2j)
            if resident:
                with _optim.device_resident_steps():
                    opt.step()
            else:
                opt.step()
        assert torch.equal(p, q)


def test_sparse_gradients_are_refused_with_the_fix():
    embedding = nn.Embedding(10, 4, sparse=True)
    opt = torch.optim.Adagrad(embedding.parameters(), foreach=False)
    embedding(torch.tensor([1, 2])).sum().backward()
    with _optim.device_resident_steps(), pytest.raises(ValueError, match="sparse=False"):
        opt.step()


def test_one_element_state_moves_to_the_parameters_device():
    from cgraph._step import _state_to_device
    state = {"step": torch.tensor(3.0, dtype=torch.float64), "mu_product": torch.tensor(0.5),
             "sum": torch.zeros(4), "momentum_buffer": None}
    _state_to_device(state, torch.device("meta"))
    assert state["step"].device.type == "meta" and state["step"].dtype == torch.float32
    assert state["mu_product"].device.type == "meta"
    assert state["sum"].device.type == "cpu" and state["momentum_buffer"] is None


# ---- SGD: Note [An unfused SGD stepped by the fused kernel] -----------------


def fused_never_called(*args, **kwargs):
    raise AssertionError("an SGD step the check did not cover ran the fused kernel")


@pytest.mark.parametrize("foreach", [True, False], ids=["foreach", "single-tensor"])
def test_sgd_steps_it_was_not_checked_for_are_torchs_own(foreach, monkeypatch):
    """Inside device_resident_steps, an SGD call the check did not cover
    (CPU tensors here: nothing is checked) steps with torch's own unfused
    step, bit for bit, and the fused kernel is never called."""
    from torch.optim import sgd as torch_sgd
    monkeypatch.setattr(torch_sgd, "_fused_sgd", fused_never_called)
    torch.manual_seed(2)
    model = nn.Linear(8, 4)
    twin = copy.deepcopy(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=0.9, foreach=foreach)
            for m in (model, twin)]
    for step in range(3):
        for m, opt, patched in ((model, opts[0], True), (twin, opts[1], False)):
            opt.zero_grad()
            m(torch.ones(2, 8) * step).square().mean().backward()
            with _optim.device_resident_steps(opts[:1]) if patched else contextlib.nullcontext():
                opt.step()
    for p, q in zip(model.parameters(), twin.parameters()):
        assert torch.equal(p, q)


def test_sgd_hyperparameters_outside_the_check_step_unfused():
    """The hyperparameters the fused kernel is used for: the checked ones
    only, for the step they were checked against; Nesterov, maximize,
    dampening, a tensor lr or weight decay, another lr or a keyword a newer
    torch adds keep torch's unfused step."""
    base = dict(weight_decay=0.0, momentum=0.9, lr=0.1, dampening=0.0, nesterov=False,
                maximize=False, has_sparse_grad=False)
    key = _optim._SGDKey("_multi_tensor_sgd", 0, 0.1, 0.9, 0.0)
    checked = {key: True}
    assert _optim._checked_hyperparameters("_multi_tensor_sgd", 0, base, checked)
    assert not _optim._checked_hyperparameters("_single_tensor_sgd", 0, base, checked)
    assert not _optim._checked_hyperparameters("_multi_tensor_sgd", 1, base, checked)
    for change in ({"nesterov": True}, {"maximize": True}, {"dampening": 0.1},
                   {"lr": torch.tensor(0.1)}, {"weight_decay": torch.tensor(0.0)},
                   {"lr": 0.2}, {"newer_keyword": 1}):
        assert not _optim._checked_hyperparameters("_multi_tensor_sgd", 0,
                                                   {**base, **change}, checked), change

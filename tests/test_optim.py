"""cgraph's device-resident Adagrad (Note [Optimizers without a capturable
form] in cgraph/_optim.py), on the CPU: the same steps as torch's Adagrad,
bitwise with the default lr_decay=0, to float32 rounding with another.  Its
use inside a graphed step is tested on a GPU in tests/test_step.py."""

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

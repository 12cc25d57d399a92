"""Tensor parallelism (DTensor) with cgraph.  On GPUs, examples/tp.py runs
under torchrun and the tests assert each rank's report: per-layer graphs
and the whole step under TP on two GPUs, with sequence parallelism and a
loss-parallel head too, and FSDP2 x TP on four.  On the
CPU, a one-process gloo group checks Note [DTensor parameters in per-layer
graphs] without graphs: a module run on the leaves gives its DTensor
parameters the grads eager gives them."""

import pytest
import torch
from torch import nn
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               parallelize_module)

import cgraph
from cgraph import _describe, _dtensor
from _helpers import assert_equal
from test_ddp import torchrun
from test_fsdp import assert_checks

CHECKS = ("TP per-layer graphs", "TP whole step", "TP+SP per-layer graphs", "TP+SP whole step",
          "TP compiled per-layer graphs", "TP dropout on a DTensor in a graphed step",
          "TP whole step, a capture failing on one rank before the forward",
          "TP whole step, a capture failing on one rank after the backward", "teardown:")


@pytest.mark.gpu
def test_tp_on_one_gpu():
    """A TP mesh of one: DTensor parameters, leaves and DTensor grads all
    there, the all-reduces of one rank."""
    assert_checks(torchrun("tp.py", 1), 1, CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_tp_on_two_gpus():
    assert_checks(torchrun("tp.py", 2), 2, CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_tp_and_fsdp_on_a_2d_mesh_on_four_gpus():
    assert_checks(torchrun("tp.py", 4), 4,
                  (*CHECKS, "FSDP2 x TP per-layer graphs", "FSDP2 x TP whole step"))


# ---- on the CPU: a one-process gloo group -------------------------------------

def mlp(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16, bias=False), nn.Tanh(), nn.Linear(16, 8))
    parallelize_module(model, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
    return model


def test_a_module_run_on_leaves_gives_dtensor_grads_as_eager(mesh):
    """Two backwards (the second accumulates), on leaves and eagerly: the
    same DTensor grads, of the parameters' placements; the leaves keep none."""
    model, eager = mlp(mesh), mlp(mesh)
    on_leaves = _dtensor.forward_on_leaves(nn.Sequential.forward)
    for seed in (1, 2):
        torch.manual_seed(seed)
        x = torch.randn(4, 8)
        on_leaves(model, x).square().sum().backward()
        eager(x).square().sum().backward()
    for p, q in zip(model.parameters(), eager.parameters()):
        assert isinstance(p.grad, DTensor) and p.grad.placements == q.grad.placements
        assert_equal(p.grad.to_local(), q.grad.to_local(), "grad")
        assert _dtensor.local_leaf(p).grad is None
    leaf = _dtensor.local_leaf(model[0].weight)
    assert leaf is _dtensor.local_leaf(model[0].weight)  # one per parameter
    assert leaf.data_ptr() == model[0].weight.to_local().data_ptr()


def test_a_dtensor_parameter_frozen_or_unfrozen_runs_on_leaves_as_eager(mesh):
    """A parameter frozen after its leaf was made gets no grad (the leaf
    still requires grad where graphs were captured with it); unfrozen, the
    leaf requires grad again and its grads reach the parameter."""
    model, eager = mlp(mesh), mlp(mesh)
    on_leaves = _dtensor.forward_on_leaves(nn.Sequential.forward)
    weight = model[0].weight
    leaf = _dtensor.local_leaf(weight)
    weight.requires_grad_(False)
    (leaf * 2).sum().backward()  # a replay captured before the freeze: the leaf's grad
    assert weight.grad is None and leaf.grad is None
    for frozen in (True, False):
        for m in (model, eager):
            m[0].weight.requires_grad_(not frozen)
            m.zero_grad(set_to_none=True)
        x = torch.randn(4, 8)
        on_leaves(model, x).square().sum().backward()
        eager(x).square().sum().backward()
        for p, q in zip(model.parameters(), eager.parameters()):
            assert (p.grad is None) == (q.grad is None), f"frozen={frozen}"
            if q.grad is not None:
                assert_equal(p.grad.to_local(), q.grad.to_local(), f"grad, frozen={frozen}")
        assert _dtensor.local_leaf(model[0].weight) is leaf and leaf.grad is None
    assert len(leaf._post_accumulate_grad_hooks) == 1  # not one more per unfreeze


def test_a_dtensor_argument_is_refused_naming_use_local_output(mesh):
    model = mlp(mesh)
    x = DTensor.from_local(torch.randn(4, 8), mesh, [Replicate()])
    with pytest.raises(ValueError, match="use_local_output=True"):
        cgraph.make_graphed(model, (x,))


@pytest.mark.parametrize("instance_forward", [False, True], ids=["class", "instance"])
def test_a_dtensor_module_runs_on_its_leaves_whatever_its_forward(mesh, instance_forward):
    """Note [DTensor parameters in per-layer graphs] (cgraph/_dtensor.py): the
    module's parameters are DTensors over the leaves the native core takes
    grads of, whether the module runs its class's forward or one set on the
    instance (block.forward = torch.compile(block.forward), as README and
    graph_layers advise); with the instance's, the DTensors themselves were
    read and the first call raised."""
    model = mlp(mesh)
    if instance_forward:
        model.forward = model.forward
    weight, seen = model[0].weight, []
    model[0].register_forward_pre_hook(lambda m, a: seen.append(m.weight is weight))
    _describe.Target.of(0, model).run_eagerly((torch.randn(4, 8),), {})
    assert seen == [False]  # swapped for a DTensor over local_leaf(weight)


def test_dtensors_rng_tracker_is_refused_while_capturing_and_only_then(mesh, monkeypatch):
    """Item 3 of Note [Patches during capture] (cgraph/_capture.py): during a
    set-up, the tracker methods a random op on a DTensor enters refuse
    (rng_changed, naming the fix) while a stream captures, and run torch's
    own otherwise.  On GPUs, examples/tp.py's dropout on a DTensor is
    refused; here torch's dispatch must still enter one of them."""
    import inspect
    from torch.distributed.tensor import _dispatch, _random
    from cgraph import _C, _capture

    entered = [name for name in ("_distribute_region", "_compute_rng_offsets")
               if name in inspect.getsource(_dispatch)]
    assert entered, "DTensor's dispatch enters neither patched tracker method: patch another"
    capturing = [False]
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: capturing[0])
    tracker = _random.OffsetBasedRNGTracker
    torchs = {name: (lambda self, spec, name=name: name) for name in entered}  # stand-ins
    for name, method in torchs.items():
        monkeypatch.setattr(tracker, name, method)
    with _capture._rng_hooks():
        for name in entered:
            capturing[0] = False
            assert getattr(object.__new__(tracker), name)(None) == name  # a warm-up: torch's runs
            capturing[0] = True
            with pytest.raises(_C.Refusal, match="use_local_output=True") as info:
                getattr(object.__new__(tracker), name)(None)
            assert info.value.args[1] == _C.FAILURE_RNG_CHANGED
    assert all(vars(tracker)[name] is torchs[name] for name in entered), "put back after"

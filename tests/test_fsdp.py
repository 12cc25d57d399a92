"""FSDP2 (fully_shard) with cgraph.  On GPUs, examples/fsdp.py runs under
torchrun and the tests assert each rank's report of every check: per-layer
graphs inside FSDP2 (reshard_after_forward True, False, an int on four
GPUs; bf16 parameters; CPU offload; activation checkpointing; explicit
prefetching; with the optimizer step graphed too; grads accumulated over
micro-batches, layers kept unsharded or not), a step graphed whole (with
micro-batches, with activation checkpointing, resumed from a state dict,
evaluated between steps, micro-batches outside from a later call on),
graphing before sharding refused, teardown.  On the CPU, a one-process gloo
group checks the refusals and that FSDP swapping its parameters is not a
replacement."""

import copy
import logging

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

import cgraph
from types import SimpleNamespace

from cgraph import _fsdp, _ranks
from cgraph._describe import StateCheck
from test_ddp import torchrun

PER_LAYER = ("per-layer graphs, reshard_after_forward=True",
             "per-layer graphs, reshard_after_forward=False, pool, samples",
             "per-layer graphs, bf16 params fp32 reduce, pool",
             "per-layer graphs, CPU offload:", "CPU offload: a graphed optimizer step refused",
             "CPU offload: a step graphed whole refused",
             "per-layer graphs, activation checkpointing, pool:",
             "per-layer graphs, explicit prefetching, bf16 params fp32 reduce, pool:",
             "per-layer graphs, graphed again after reset:",
             "per-layer graphs, graphed optimizer step, grads set to None",
             "per-layer graphs, graphed optimizer step, grads zeroed",
             "per-layer graphs, grads accumulated:",
             "per-layer graphs, grads accumulated, bf16 params fp32 reduce:",
             "per-layer graphs, grads accumulated, kept unsharded:",
             "per-layer graphs, grads accumulated, kept unsharded, reshard_after_forward=False:")
CHECKS = (*PER_LAYER, "graphed FSDP2 step:", "graphed FSDP2 step, 2 micro-batches:",
          "graphed FSDP2 step, activation checkpointing:",
          "graphed FSDP2 step, resumed from a state dict:",
          "graphed FSDP2 step, evaluated between steps:",
          "graphed FSDP2 forward and backward, grad sync set outside:",
          "graphed FSDP2 forward and backward, grad sync set outside, bf16 params fp32 reduce:",
          "graphed FSDP2 step, micro-batches outside from a later call on:",
          "graph then shard: refused", "graph then shard the root only: refused",
          "failed capture: raised on every rank",
          "failed capture inside a layer: raised on every rank", "teardown:")


def assert_checks(out, ranks, checks):
    for rank in range(ranks):
        for check in checks:
            assert f"rank {rank} {check}" in out, out


@pytest.mark.gpu
def test_fsdp_on_one_gpu():
    """One rank: the all-gathers and reduce-scatters are a copy each, but
    FSDP's hooks, parameter swaps and homes are all there."""
    assert_checks(torchrun("fsdp.py", 1), 1, CHECKS[:-3] + CHECKS[-1:])


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_fsdp_on_two_gpus():
    assert_checks(torchrun("fsdp.py", 2), 2, CHECKS)


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 4, reason="needs four GPUs")
def test_fsdp_on_four_gpus():
    assert_checks(torchrun("fsdp.py", 4), 4,
                  (*CHECKS, "per-layer graphs, reshard_after_forward=2"))


LLAMA = ("llama, every decoder layer graphed: 20 losses and the parameters bitwise equal",
         "llama, the whole step graphed: 20 losses and the parameters bitwise equal")


@pytest.mark.gpu
@pytest.mark.parametrize("gpus", [2, 4])
def test_a_hugging_face_llama_under_fsdp_trains_as_eager(gpus):
    """examples/fsdp_llama.py: 220M parameters, bf16, 20 steps, per-layer
    graphs and the whole step, each bitwise equal to eager FSDP2."""
    pytest.importorskip("transformers")
    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    assert_checks(torchrun("fsdp_llama.py", gpus), gpus, LLAMA)


# ---- on the CPU: a one-process gloo group -------------------------------------

def sharded_pair(mesh):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def test_a_layer_whose_capture_failed_inside_its_forward_is_put_back_to_rest(mesh):
    """_fsdp.after_failed_layer_capture: a layer's per-layer capture raised
    inside its FSDP forward (stood in for by a forward pre-hook that raises
    after FSDP's), so FSDP's post-forward never ran: the layer stays
    unsharded and FORWARD, and on two or more ranks it would keep the home
    its graphs share with other layers, whose next forward raises.  Put
    back, it is resharded and IDLE, and training goes on as an eager twin's
    that never made the failed call."""
    torch.manual_seed(0)
    base = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    models = [copy.deepcopy(base) for _ in range(2)]
    for model in models:
        for layer in (model[0], model[1], model):
            fully_shard(layer, mesh=mesh)
    planted = [RuntimeError("planted at capture")]

    def fails_once(module, args):
        if planted:
            raise planted.pop()

    models[0][1].register_forward_pre_hook(fails_once)
    x = torch.randn(3, 4)
    with pytest.raises(RuntimeError, match="planted at capture"):
        models[0](x)
    group = _fsdp._param_groups(models[0][1])[0]
    assert group._training_state.name == "FORWARD" and not group.is_sharded
    _fsdp.after_failed_layer_capture(models[0][1])
    state = models[0][1]._get_fsdp_state()
    assert group._training_state.name == "IDLE" and group.is_sharded
    assert state._training_state.name == "IDLE"
    for model in models:
        model(x).sum().backward()
    for (name, p), q in zip(models[0].named_parameters(), models[1].parameters()):
        assert torch.equal(p.grad.full_tensor(), q.grad.full_tensor()), name


@pytest.mark.parametrize("fails, shared, put_back", [
    ("check", False, True), ("capture", False, True), ("warmup_state", True, True),
    ("warmup_state", False, False)])
def test_a_failed_per_layer_capture_puts_the_layer_back_unless_the_core_asks_again(
        mesh, monkeypatch, fails, shared, put_back):
    """Regraph (cgraph/_regraph.py), for an FSDP layer: a failure anywhere in
    its capture (the argument check, the capture) puts the layer back to
    rest, but a warmup_state failure in a pool of the layer's own, after
    which the core drops that pool and asks again for this same call
    (recover_from_warm_up in csrc/graphed.c), where the layer must still be
    unsharded.  In the pool shared with other layers that failure is
    raised: put back too."""
    from cgraph import _regraph
    from cgraph._capture import CaptureOptions
    from cgraph._describe import Target

    layer = nn.Linear(4, 4)
    fully_shard(layer, mesh=mesh)
    put = []
    error = RuntimeError("planted")
    if fails == "warmup_state":
        error.kind = "warmup_state"
    monkeypatch.setattr(_fsdp, "after_failed_layer_capture", put.append)
    monkeypatch.setattr(_fsdp, "home_parameters", lambda module, graphed: None)
    def raises(*args, **kwargs):
        raise error

    monkeypatch.setattr(_regraph, "_check_device", raises if fails == "check" else
                        lambda *args: None)
    monkeypatch.setattr(_regraph, "graph", raises)
    regraph = _regraph.Regraph(Target.of(0, layer), CaptureOptions(3, False, 0, 0))
    site = SimpleNamespace(pool=(0, 1), warm_in_pool=True, keep_activations=shared,
                           pending=False, asks_again=not shared)
    with pytest.raises(RuntimeError, match="planted"):
        regraph(SimpleNamespace(num_graphs=1), (torch.randn(2, 4),), {}, site)
    assert put == ([layer] if put_back else []), put


def test_a_module_containing_fsdp_modules_is_refused(mesh):
    with pytest.raises(ValueError, match="Graph each fully_shard-ed layer itself"):
        cgraph.make_graphed(sharded_pair(mesh))


@pytest.mark.parametrize("around", ["the root only", "a unit of two layers"])
def test_a_module_inside_an_fsdp_unit_is_refused_naming_the_recipe(mesh, around):
    """FSDP frees the parameters of a module inside the unit it shards after
    the unit's forward and gathers them again, elsewhere, before its
    backward: only a graphed FSDP module itself reads them at a home."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    if around == "a unit of two layers":
        fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    inner = model[0][1]
    owner = "Sequential" if around == "a unit of two layers" else "FSDPSequential"
    with pytest.raises(ValueError, match=rf"manages as part of .*{owner}.*Apply fully_shard to "
                                         "this module itself"):
        cgraph.make_graphed(inner)
    with pytest.raises(ValueError, match="a module around it"):
        cgraph.make_graphed_callables(inner, (torch.randn(2, 4),))
    unit = model[0] if around == "a unit of two layers" else model
    assert _fsdp.enclosing(unit) is None and _fsdp.enclosing(nn.ReLU()) is None
    problems = cgraph.explain(inner, (torch.randn(2, 4),)).problems
    assert [p.fix for p in problems if p.kind == "module"] == [_fsdp.ENCLOSED_FIX]


def test_fsdp1_and_zero3_modules_are_refused_naming_fsdp2():
    """Their gathers and frees run inside the forward, from Python: captured,
    once.  (FSDP1 stood in for by a subclass that skips its set-up.)"""
    from torch.distributed.fsdp import FullyShardedDataParallel

    class FSDP1(FullyShardedDataParallel):
        def __init__(self, module):
            nn.Module.__init__(self)
            self.inner = module

    model = nn.Sequential(FSDP1(nn.Linear(4, 4)), nn.Linear(4, 4))
    with pytest.raises(ValueError, match=r"FSDP1 \(FullyShardedDataParallel at 0\).*fully_shard"):
        cgraph.make_graphed(model)
    zero3 = nn.Linear(4, 4)
    zero3.weight.ds_id = 0
    with pytest.raises(ValueError, match="ZeRO stage 3.*stage 1 or 2"):
        cgraph.make_graphed_callables(zero3, (torch.randn(2, 4),))


def test_the_drop_in_refuses_fsdp_modules_naming_make_graphed(mesh):
    with pytest.raises(ValueError, match=r"cgraph.make_graphed\(layer\)"):
        cgraph.make_graphed_callables(sharded_pair(mesh)[0], (torch.randn(2, 4),))


def test_a_graphed_step_reshards_the_idle_groups_an_eager_forward_left_unsharded(monkeypatch):
    """Note [FSDP2's host state around a graphed step]: the groups of the
    FSDP modules a step names, each once; before a capture or a replay,
    those idle and unsharded (the root after an evaluation) are resharded,
    none inside a pass."""
    class Group:
        def __init__(self, sharded, state):
            self.is_sharded, self._training_state = sharded, SimpleNamespace(name=state)
            self.resharded = 0

        def reshard(self):
            self.resharded += 1
            self.is_sharded = True

    root = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2), nn.ReLU())
    groups = {id(root): [Group(False, "IDLE")], id(root[0]): [Group(True, "IDLE")],
              id(root[1]): [Group(False, "FORWARD")]}
    monkeypatch.setattr(_fsdp, "is_fsdp", lambda m: id(m) in groups)
    monkeypatch.setattr(_fsdp, "_param_groups", lambda m: groups[id(m)])
    resharded = _fsdp.Resharded([root, root[0]])  # the layer named too: once
    assert len(resharded.groups) == 3
    resharded()
    resharded()
    assert [g.resharded for gs in groups.values() for g in gs] == [1, 0, 0]


def test_a_pass_left_midway_is_put_back_to_rest_and_one_at_rest_is_left(mesh, monkeypatch):
    """Note [A capture that fails inside FSDP2's pass]: a forward whose
    backward never comes (where a failed capture leaves FSDP) leaves the
    root unsharded, its pre-backward hooks pending.  after_failed_capture
    puts every group back to rest and sharded, without waiting on the
    pass's events (torch's own reset would: recorded inside a capture, a
    stream outside it cannot wait on them), and the next forward computes
    what a fresh twin's does.  A model at rest (a rank whose capture
    succeeded) is not touched."""
    model, twin = sharded_pair(mesh), sharded_pair(mesh)
    x = torch.randn(2, 4)
    resharded = _fsdp.Resharded([model])
    touched = []
    real = _fsdp._reset_iter_state
    monkeypatch.setattr(_fsdp, "_reset_iter_state", lambda s: touched.append(s) or real(s))
    resharded.after_failed_capture()  # never called: lazily initialised, no root yet
    model(x)
    assert not all(g.is_sharded for g in resharded.groups)
    state = model._get_fsdp_state()
    monkeypatch.setattr(type(state), "_reset_iter_state",
                        lambda self: pytest.fail("torch's reset waits on captured events"),
                        raising=False)
    resharded.after_failed_capture()
    assert touched == [state]
    assert state._state_ctx.iter_forward_root is None
    assert not state._state_ctx.post_backward_final_callback_queued
    assert all(g.is_sharded and _fsdp._training_state(g) == "IDLE" for g in resharded.groups)
    resharded.after_failed_capture()  # at rest now
    assert touched == [state]
    assert torch.equal(model(x), twin(x))


def test_a_step_graphed_whole_refuses_fsdp_cpu_offload():
    """FSDP waits on the host for its grads' copies to the CPU: refused
    before the capture, naming the per-layer recipe.  (Stand-ins for the
    param groups; examples/fsdp.py refuses a real one on two GPUs.)"""
    def group(fqn, *offloaded):
        params = [SimpleNamespace(offload_to_cpu=o) for o in offloaded]
        return SimpleNamespace(fsdp_params=params, _module_fqn=fqn)

    _fsdp.refuse_offloaded([group("layers.0", False, False), group("", )])
    with pytest.raises(ValueError, match=r"FSDP module 'layers.1' offloads.*CPUOffloadPolicy.*"
                                         r"cgraph.make_graphed\(layer\)"):
        _fsdp.refuse_offloaded([group("layers.0", False), group("layers.1", False, True)])


def test_fsdp_swapping_its_parameters_is_not_a_replacement(mesh):
    """Around every forward FSDP puts the unsharded parameters on the module
    and the sharded ones back: both are the captured parameter."""
    model = sharded_pair(mesh)
    check = StateCheck(0, model[0])
    checked = []
    # After FSDP's pre-forward hook: the unsharded parameters are on the module.
    model[0].register_forward_pre_hook(
        lambda m, args: checked.append(hasattr(m.weight, "to_local")) or check(m))
    model(torch.randn(2, 4)).sum().backward()
    check(model[0])  # the sharded ones again
    assert checked == [False] and hasattr(model[0].weight, "to_local")


def test_sharding_a_graphed_module_names_the_recipe(mesh):
    layer = nn.Linear(4, 4)
    check = StateCheck(0, layer)
    fully_shard(layer, mesh=mesh)
    with pytest.raises(RuntimeError, match="shard first"):
        check(layer)


def test_sharding_a_graphed_module_wrapper_swaps_the_wrapper_s_class_only(mesh):
    """fully_shard(make_graphed(layer)) swaps the GraphedModule's class and
    marks it: a wrapper writing its module's public names through
    (GraphedModule.__setattr__) must keep those, so the wrapped layer keeps
    its class and its graphs are still the wrapper's."""
    from cgraph._api import GraphedModule
    layer = nn.Linear(4, 4)
    graphed = GraphedModule(layer, cgraph._C.new_graphed(lambda *a: False))
    fully_shard(graphed, mesh=mesh)
    assert type(layer) is nn.Linear and isinstance(graphed, GraphedModule)
    assert "_graphed" in graphed.__dict__ and "GraphedModule" in repr(graphed)


@pytest.mark.parametrize("sharded", ["the root only", "a module inside"])
def test_sharding_around_a_graphed_module_after_graphing_names_the_recipe(mesh, sharded):
    """Note [Sharding after graphing] (cgraph/_describe.py): fully_shard of the
    root alone, or of a module inside the graphed one, replaces the graphed
    module's parameters without a registration and leaves its class; FSDP's
    parameter group tells cgraph, and its next call raises naming the
    recipe instead of reading the old tensors."""
    model = nn.Sequential(nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4)), nn.Linear(4, 4))
    check = StateCheck(0, model[0])  # model[0] graphed
    if sharded == "a module inside":
        fully_shard(model[0][1], mesh=mesh)
    fully_shard(model, mesh=mesh)
    assert type(model[0]) is nn.Sequential  # no class check can see it
    with pytest.raises(RuntimeError, match="shard first"):
        check(model[0])


def test_a_fully_shard_that_fails_midway_still_makes_graphed_modules_check(mesh, monkeypatch):
    """Note [Sharding after graphing]: FSDP's parameter group raising after it
    replaced some parameters (the second FSDPParam here) still tells the
    graphed modules, whose next call raises instead of reading the old
    tensors."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    check = StateCheck(0, model[0])
    made, torchs = [], _fsdp_param_group.FSDPParam

    def second_fails(*args, **kwargs):
        if made:
            raise RuntimeError("planted in the second FSDPParam")
        made.append(torchs(*args, **kwargs))
        return made[-1]

    monkeypatch.setattr(_fsdp_param_group, "FSDPParam", second_fails)
    with pytest.raises(RuntimeError, match="planted"):
        fully_shard(model, mesh=mesh)
    with pytest.raises(RuntimeError, match="shard first"):
        check(model[0])


# ---- Note [A capture that fails on one rank]: two CPU processes, gloo ---------

def _agree(rank, port, queue):
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        _ranks.agree(RuntimeError("planted on rank 1") if rank == 1 else None, "a test capture")
        queue.put((rank, "no error"))
    except RuntimeError as e:
        queue.put((rank, " ".join([str(e), *getattr(e, "__notes__", [])])))
    finally:
        dist.destroy_process_group()


def test_a_capture_failing_on_one_rank_raises_on_every_rank_naming_it():
    import socket

    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    queue = ctx.SimpleQueue()
    mp.spawn(_agree, args=(port, queue), nprocs=2, join=True)
    said = dict(queue.get() for _ in range(2))
    for rank in (0, 1):
        assert "a test capture failed on rank(s) [1]" in said[rank], said
        assert "Rank 1: RuntimeError: planted on rank 1" in said[rank], said
    assert said[1].startswith("planted on rank 1"), said  # its own error, with the note


def test_without_a_process_group_the_failure_is_raised_as_it_is():
    with pytest.raises(ValueError, match="^mine$"):
        _ranks.agree(ValueError("mine"), "a test capture")
    _ranks.agree(None, "a test capture")


def test_explain_finds_fully_shard_inside_the_module(mesh):
    report = cgraph.explain(sharded_pair(mesh), (torch.randn(2, 4),))
    modules = [p for p in report.problems if p.kind == "module"]
    assert len(modules) == 1 and modules[0].where == "module FSDPSequential, submodule '0'"
    assert "make_graphed(layer)" in modules[0].fix


# ---- Note [FSDP2's unsharded parameters in per-layer graphs]: which home ------

class FakeGroup(SimpleNamespace):
    """Weakly referable, as an FSDPParamGroup (a Home holds its holder so)."""


def fake_group(reshards: bool, sizes=(16, 8), ranks=2):
    """An FSDPParamGroup as _fsdp reads it: all-gather outputs (allocated:
    unsharded), whether FSDP re-gathers it before backward, how many ranks
    it shards over."""
    params = [SimpleNamespace(all_gather_outputs=[torch.empty(n)]) for n in sizes]
    return FakeGroup(fsdp_params=params, post_forward_mesh_info=object() if reshards
                           else None, mesh_info=SimpleNamespace(shard_mesh_size=ranks),
                           modules=[nn.Identity()])


def outputs_of(group):
    return [t for p in group.fsdp_params for t in p.all_gather_outputs]


def reshard(group):
    for t in outputs_of(group):
        t.untyped_storage().resize_(0)


def test_layers_regathered_before_backward_share_one_home_per_layout():
    first, second, other = fake_group(True), fake_group(True), fake_group(True, (4,))
    home = _fsdp._home_for(first, outputs_of(first))
    home.holder = first
    reshard(first)  # FSDP freed it after its forward: the home is free
    assert _fsdp._home_for(second, outputs_of(second)) is home
    assert _fsdp._home_for(other, outputs_of(other)) is not home  # another layout
    assert [v.numel() for v in home.views] == [16, 8]
    assert all((v.data_ptr() - home.buffer.data_ptr()) % 256 == 0 for v in home.views)


@pytest.mark.parametrize("reshards,ranks", [(False, 2), (True, 1)],
                         ids=["kept-unsharded-until-backward", "one-rank"])
def test_a_layer_not_regathered_before_its_backward_gets_a_home_of_its_own(reshards, ranks):
    kept = fake_group(reshards, ranks=ranks)
    assert _fsdp._home_for(kept, outputs_of(kept)) is not _fsdp._home_for(kept, outputs_of(kept))


def test_a_shared_home_is_not_lent_over_a_layer_still_unsharded():
    first, second = fake_group(True), fake_group(True)
    home = _fsdp._home_for(first, outputs_of(first))
    home.holder = first  # lent to it, and FSDP has not resharded it
    assert _fsdp._home_for(second, outputs_of(second)) is not home  # at capture: another


@pytest.mark.parametrize("state", ["FORWARD", "PRE_BACKWARD"])
def test_a_shared_home_held_inside_a_pass_is_not_lent_over(state):
    first, second = fake_group(True), fake_group(True)
    home = _fsdp._home_for(first, outputs_of(first))
    home.holder = first
    first._training_state = SimpleNamespace(name=state)  # FSDP's TrainingState, as read
    with pytest.raises(RuntimeError, match="both unsharded inside a forward or backward.*"
                                           f"in FSDP's {state}.*inputs need no grad.*"
                                           "reshard_after_forward=False"):
        home.lend(second, outputs_of(second), home.views)
    assert home.holder is first


@pytest.mark.parametrize("state", ["POST_BACKWARD", "IDLE"])
def test_an_idle_layer_kept_unsharded_in_a_shared_home_is_resharded(state, monkeypatch, caplog):
    """Note [A layer kept unsharded in a shared home]: FSDP's
    set_reshard_after_backward(False) keeps a layer unsharded after its
    backward; the next layer lent the home reshards it, logged once per
    home (not once per process: a second model's homes log again)."""
    first, second = fake_group(True), fake_group(True)
    home = _fsdp._home_for(first, outputs_of(first))
    home.holder = first
    first._training_state = SimpleNamespace(name=state)
    first.reshard = lambda: reshard(first)
    lent = []
    monkeypatch.setattr(_fsdp, "_C", SimpleNamespace(lend_memory=lambda o, v: lent.append(o)))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        home.lend(second, outputs_of(second), home.views)
        assert not _fsdp._unsharded(first) and home.holder is second
        assert lent == [outputs_of(second)]
        second.reshard = lambda: reshard(second)  # still unsharded, idle
        second._training_state = SimpleNamespace(name="IDLE")
        home.lend(first, outputs_of(first), home.views)  # taken back a second time
        assert not _fsdp._unsharded(second) and home.holder is first
        third, fourth = fake_group(True, (4,)), fake_group(True, (4,))
        third.reshard = lambda: reshard(third)
        third._training_state = SimpleNamespace(name="IDLE")
        other = _fsdp._home_for(third, outputs_of(third))  # another layout's home
        other.holder = third
        other.lend(fourth, outputs_of(fourth), other.views)  # taken back: its first
    assert caplog.text.count("cgraph resharded it") == 2, caplog.text  # once per home


def test_per_param_mesh_groups_do_not_crash_param_group(mesh):
    """torch 2.14 makes two FSDPParamGroups on one module for a per-parameter
    mesh (shard_placement_fn), where its _fsdp_param_group raises an
    AssertionError; every group's parameters are faces."""
    from torch.distributed.device_mesh import DeviceMesh
    from torch.distributed.fsdp._fully_shard import _fsdp_common
    from torch.distributed.tensor import Shard
    if not hasattr(_fsdp_common, "ShardPlacementResult"):
        pytest.skip("this torch has no per-parameter meshes (ShardPlacementResult)")
    FSDPMeshInfo, ShardPlacementResult = (_fsdp_common.FSDPMeshInfo,
                                          _fsdp_common.ShardPlacementResult)
    ep = FSDPMeshInfo(DeviceMesh.from_group(dist.new_group([0]), "cpu"), shard_mesh_dim=0)
    layer = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4))
    expert = layer[1].weight
    fully_shard(layer, mesh=mesh, shard_placement_fn=lambda p: ShardPlacementResult(
        Shard(0), ep) if p is expert else None)
    assert len(_fsdp.faces(layer)) >= 4  # every parameter's sharded face, not an AssertionError


def test_a_replicate_only_group_counts_as_one_rank(mesh):
    """replicate() (DDPMeshInfo, no shard_mesh_size): FSDP unshards it by the
    one-rank path (alloc_storage, not alloc_all_gather_outputs), so its
    storage must be kept (_Keeper); taken for two ranks, the next call
    raised that a parameter moved after capture."""
    from torch.distributed._composable.replicate_with_fsdp import replicate
    layer = nn.Linear(4, 4)
    replicate(layer, mesh=mesh)
    assert _fsdp._one_rank(_fsdp._param_group(layer))


def test_a_second_model_of_the_same_layout_logs_its_take_back(caplog, monkeypatch):
    """Logged once per model: a second model of the same layout, built while
    the first one's home is alive (a notebook's second run, the old model
    not yet collected), gets the same Home and logs its own take-back."""
    caplog.set_level(logging.INFO, logger="cgraph")
    monkeypatch.setattr(_fsdp, "_C", SimpleNamespace(lend_memory=lambda o, v: None))
    homes = []
    for _ in range(2):  # model A, then model B of the same layout
        first, second = fake_group(True), fake_group(True)
        first.comm_ctx = second.comm_ctx = type("CommContext", (), {})()  # one per root
        out = [t for p in first.fsdp_params for t in p.all_gather_outputs]
        home = _fsdp._home_for(first, out)
        homes.append(home)
        home.holder = first
        first._training_state = SimpleNamespace(name="IDLE")
        first.reshard = lambda first=first: [t.untyped_storage().resize_(0)
                                             for p in first.fsdp_params
                                             for t in p.all_gather_outputs]
        home.lend(second, [], home.views)
        second.reshard = lambda second=second: [t.untyped_storage().resize_(0)
                                               for p in second.fsdp_params
                                               for t in p.all_gather_outputs]
        second.reshard()
    assert homes[0] is homes[1]
    assert caplog.text.count("cgraph resharded it") == 2, caplog.text


class FakeGraphed:
    is_reset = False


def test_one_group_of_several_modules_is_homed_for_one_graphed_callable_only():
    """fully_shard([a, b]) gives a and b one parameter group, so one home:
    graphed apart, the second capture is refused (its graph would lean on
    the first's lenders, which the first's reset takes away); the lenders
    of a graphed callable dropped since are removed, to be homed again."""
    group = fake_group(True)
    first, second = FakeGraphed(), FakeGraphed()
    for p in group.fsdp_params:
        p.alloc_all_gather_outputs = _fsdp._Lender(p, group, None, [], first)
    assert _fsdp._homed_by(group, first, nn.Identity())
    with pytest.raises(ValueError, match="shares its parameter group.*fully_shard to each"):
        _fsdp._homed_by(group, second, nn.Identity())
    first.is_reset = True
    assert not _fsdp._homed_by(group, second, nn.Identity())
    assert not any("alloc_all_gather_outputs" in p.__dict__ for p in group.fsdp_params)


def test_an_unknown_training_state_is_not_taken_for_idle():
    """A group without _training_state (renamed in some torch) is not taken
    for idle and resharded: refused, saying why and what to do."""
    first, second = fake_group(True), fake_group(True)
    home = _fsdp.Home([t for p in first.fsdp_params for t in p.all_gather_outputs])
    home.holder = first
    first.reshard = lambda: pytest.fail("resharded a group whose state is unknown")
    with pytest.raises(RuntimeError, match="does not say whether it is inside a pass.*"
                                           "reshard_after_forward=False"):
        home.lend(second, [], home.views)

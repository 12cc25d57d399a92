"""What a graphed step checks before a replay (Note [What a graphed step
checks before a replay] in cgraph/_step_checks.py): a parameter frozen,
unfrozen or moved to other memory since capture, a capture that made optimizer
state, and an lr changed inside the step.  The GPU tests train a graphed
step and its eager twin (a deep copy, a second optimizer) on the same
batches and compare after every call: bitwise, except foreach AdamW, which
the step makes capturable (step sizes in float32 on the device, eager's in
float64 on the host: test_adam_is_made_capturable in tests/test_step.py),
compared with assert_close's float32 tolerance.  The CPU tests drive the
checks themselves, without a capture."""

import copy
import logging
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgraph
from _helpers import CUDA, assert_equal, assert_logged, in_pool
from cgraph import _C
from cgraph._modes import Modes
from cgraph._step import (_forget, _lrs, _out_of_the_pool, _Outputs, _refuse_lrs_moved_inside,
                          _refuse_scalers_updated_outside, _schedulers_refused, _state_keys,
                          _state_made)
from cgraph._step_checks import GradSync, Marks, OtherGrads, SinceCapture
from cgraph._step_grads import StepGrads

OPTIMIZERS = {
    "adamw-foreach": lambda ps: torch.optim.AdamW(ps, lr=1e-2),
    "adamw-fused": lambda ps: torch.optim.AdamW(ps, lr=1e-2, fused=True),
    "sgd-momentum": lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9),
}
# Made capturable by the step: float32 step sizes on the device (module docstring).
NOT_BITWISE = {"adamw-foreach"}


def model_and_batches(n=7, seed=0):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 32), nn.Tanh(),
                          nn.Linear(32, 8)).to(CUDA)
    batches = [(torch.randn(16, 32, device=CUDA), torch.randint(0, 8, (16,), device=CUDA))
               for _ in range(n)]
    return model, batches


def train_step(model, opt, scheduler=None):
    def step(x, y):
        opt.zero_grad()
        loss = F.cross_entropy(model(x), y)
        loss.backward()
        opt.step()
        if scheduler is not None:
            scheduler.step()
        return loss
    return step


class Twins:
    """A graphed step (num_warmup_iters=1) and its eager twin: a model each,
    an optimizer each, the same batches."""

    def __init__(self, name, frozen=False, scheduled=False):
        self.model, self.batches = model_and_batches()
        if frozen:
            self.model[0].requires_grad_(False)
        self.eager = copy.deepcopy(self.model)
        self.opts = [OPTIMIZERS[name](m.parameters()) for m in self.models]
        self.schedulers = [torch.optim.lr_scheduler.StepLR(o, step_size=1, gamma=0.5)
                           for o in self.opts] if scheduled else []
        self.step = cgraph.make_graphed_step(train_step(self.model, self.opts[0]),
                                             self.batches[0], num_warmup_iters=1)
        self.plain = train_step(self.eager, self.opts[1])
        self.check = check_of(name)

    @property
    def models(self):
        return self.model, self.eager

    def call(self, i):
        """Call i of both, then their schedulers; the losses compared."""
        losses = [fn(*self.batches[i]) for fn in (self.step, self.plain)]
        self.check(*losses, f"loss of call {i}")
        for scheduler in self.schedulers:
            scheduler.step()

    def each(self, change):
        for model in self.models:
            change(model)

    def assert_same_training(self, with_state=True):
        """Parameters, grads and (with_state) optimizer state: eager's."""
        for (n, p), q in zip(self.model.named_parameters(), self.eager.parameters()):
            self.check(p, q, f"parameter {n}")
            if p.grad is not None or q.grad is not None:
                self.check(p.grad, q.grad, f"grad of {n}")
            if with_state:
                self.assert_same_state(p, q, n)

    def assert_same_state(self, p, q, n):
        state, state_e = (o.state.get(t, {}) for o, t in zip(self.opts, (p, q)))
        assert set(state) == set(state_e), f"state of {n}: {set(state)} != {set(state_e)}"
        for key, value in state_e.items():
            if isinstance(value, torch.Tensor):
                self.check(state[key].to(value.device, value.dtype), value,
                           f"state {key!r} of {n}")


def check_of(name):
    if name not in NOT_BITWISE:
        return assert_equal

    def close(actual, expected, what):
        torch.testing.assert_close(actual, expected, msg=lambda m: f"{what}: {m}")
    return close


def assert_warmed_up_again(t, caplog, change):
    """After a capture, two replays and a change of model[0] before call 4:
    call 4 stepped eagerly, call 5 captured again (logged, naming the
    parameter and the change)."""
    assert t.step.stats == {"eager": 2, "captures": 2, "replays": 5}, t.step.stats
    label = f"parameter 0 of param group 0 of {type(t.opts[0]).__name__}"
    assert_logged(caplog, label, f"{change} since capture")


def snapshot(module):
    return [p.detach().clone() for p in module.parameters()]


# ---- a parameter frozen, unfrozen or moved after capture (GPU) ---------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_layer_frozen_after_capture_is_no_longer_stepped(name, caplog):
    """model[0] frozen after the capture and two replays: eager's optimizer
    skips its parameters (their grads are None), so the step runs eagerly
    once and captures again.  Before, the graph went on making model[0]'s
    grads and stepping it, frozen or not."""
    t = Twins(name)
    for i in range(4):  # warm-up, capture, two replays
        t.call(i)
    assert t.step.stats == {"eager": 1, "captures": 1, "replays": 3}, t.step.stats
    t.each(lambda m: m[0].requires_grad_(False))
    frozen = snapshot(t.model[0])
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for i in range(4, 7):
            t.call(i)
    t.assert_same_training()
    for p, was in zip(t.model[0].parameters(), frozen):
        assert_equal(p, was, "a parameter of model[0], frozen")
        assert p.grad is None
    assert_warmed_up_again(t, caplog, "was frozen")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_layer_unfrozen_after_capture_is_stepped_from_then_on(name, caplog):
    """model[0] frozen (but in the optimizer) until after the capture and two
    replays, then unfrozen: the next call steps eagerly, creating its
    optimizer state (Adam's moments, SGD's momentum buffers), and the one
    after captures again.  Before, the graph, captured without model[0]'s
    grads, never stepped it."""
    t = Twins(name, frozen=True)
    for i in range(4):
        t.call(i)
    assert t.step.stats == {"eager": 1, "captures": 1, "replays": 3}, t.step.stats
    assert not any(t.opts[0].state.get(p) for p in t.model[0].parameters())
    before = snapshot(t.model[0])
    t.each(lambda m: m[0].requires_grad_(True))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for i in range(4, 7):
            t.call(i)
    t.assert_same_training()
    assert all(t.opts[0].state.get(p) for p in t.model[0].parameters())
    assert not any(torch.equal(p, b) for p, b in zip(t.model[0].parameters(), before))
    assert_warmed_up_again(t, caplog, "was unfrozen")


@pytest.mark.gpu
def test_a_training_step_called_under_no_grad_raises_as_eager_and_trains_on_after(caplog):
    """A training step captured with grad, called under no_grad(): eager
    raises at the backward; before, the replay ran the captured backward
    and optimizer step anyway.  The call runs eagerly (and raises as eager
    does), and the calls after it train as eager, captured again."""
    t = Twins("sgd-momentum")
    for i in range(3):  # warm-up, capture, replay
        t.call(i)
    with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
        for fn in (t.step, t.plain):
            with pytest.raises(RuntimeError, match="does not require grad"):
                fn(*t.batches[3])
    for i in range(4, 7):
        t.call(i)
    t.assert_same_training()
    assert t.step.stats == {"eager": 2, "captures": 2, "replays": 4}, t.step.stats
    assert_logged(caplog, "the grad mode around the call",
                  "changed from grad enabled to torch.no_grad()")


@pytest.mark.gpu
def test_an_evaluation_step_beside_a_training_step_replays_and_leaves_its_grads():
    """A training step and an evaluation step (its forward only, called
    under no_grad()), each graphed, over one model, in turn: the evaluation
    replays from its capture on and leaves the training step's grads as
    they are.  Before, it checked those grads (changed by every training
    call: it captured again at every call) and put its capture's back."""
    t = Twins("adamw-fused")
    evaluate = cgraph.make_graphed_step(lambda x: t.model(x), num_warmup_iters=1)
    for i in range(6):
        t.call(i)
        grads = [p.grad for p in t.model.parameters()]
        x = t.batches[i][0]
        with torch.no_grad():
            assert_equal(evaluate(x), t.eager(x), f"evaluation {i}")
        assert all(p.grad is g for p, g in zip(t.model.parameters(), grads)), i
    t.assert_same_training()
    assert evaluate.stats == {"eager": 1, "captures": 1, "replays": 5}, evaluate.stats


@pytest.mark.gpu
def test_an_evaluation_step_captured_under_inference_mode_runs_eagerly_outside_it(caplog):
    """An evaluation step captured under inference_mode() holds inference
    tensors; called under no_grad() with an argument ATen copies into its
    static input (not contiguous), it raised torch's "Inplace update to
    inference tensor outside InferenceMode".  Now that call runs eagerly,
    logged, and every output is eager's."""
    model, batches = model_and_batches()
    step = cgraph.make_graphed_step(lambda x: model(x), num_warmup_iters=1)
    with torch.inference_mode():
        for x, _ in batches[:3]:  # warm-up, capture, replay
            assert_equal(step(x), model(x), "under inference_mode")
    x = batches[3][0].t().contiguous().t()  # its values, another layout
    with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
        out = step(x)
        assert_equal(out, model(x), "under no_grad()")
    assert not out.is_inference()
    assert step.stats == {"eager": 2, "captures": 1, "replays": 2}, step.stats
    assert_logged(caplog, "changed from torch.inference_mode() to torch.no_grad()")


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_a_layer_unfrozen_between_warm_up_and_capture_gets_its_state_once(name, caplog):
    """model[0] frozen in the one warm-up call, unfrozen before the next:
    that call's capture makes model[0]'s optimizer state inside the graph,
    which is right for its own replay (a first step) only, so the next call
    captures again, with the state there.  Before, every replay made that
    state again: Adam's first step at every step (moments and step count
    zeroed), an SGD momentum buffer that never accumulated."""
    t = Twins(name, frozen=True)
    t.call(0)
    t.each(lambda m: m[0].requires_grad_(True))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        t.call(1)
    assert t.step.stats == {"eager": 1, "captures": 1, "replays": 1}, t.step.stats
    assert_logged(caplog, f"its capture made {type(t.opts[0]).__name__}'s state for 2 "
                  "parameter(s)")
    t.assert_same_training()
    for i in range(2, 7):
        t.call(i)
    t.assert_same_training()
    assert t.step.stats == {"eager": 1, "captures": 2, "replays": 6}, t.step.stats


@pytest.mark.gpu
def test_reset_all_moves_the_state_a_capture_made_out_of_its_pool():
    """cgraph.reset_all() resets a graphed step through the step's own
    reset(): the optimizer state its capture made (model[0] unfrozen after
    the warm-up) gets memory of its own, with the replay's values, before
    the pool goes.  Before, reset_all reset the step's graph alone, and that
    state was left allocated in the released pool (unsafe under expandable
    segments: Note [A step's warm-up in its pool], csrc/aten_setup.cpp).
    The step then captures again and trains as eager."""
    t = Twins("sgd-momentum", frozen=True)
    t.call(0)
    t.each(lambda m: m[0].requires_grad_(True))
    t.call(1)
    pool = t.step.graphed.pool
    made = t.opts[0].state[t.model[0].weight]["momentum_buffer"]
    assert in_pool(made, pool), "the capture made model[0]'s momentum buffer in its pool"
    cgraph.reset_all()
    moved = t.opts[0].state[t.model[0].weight]["momentum_buffer"]
    assert moved is not made and not in_pool(moved, pool)
    t.assert_same_training()
    for i in range(2, 6):
        t.call(i)
    t.assert_same_training()
    assert t.step.stats == {"eager": 1, "captures": 2, "replays": 5}, t.step.stats


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_state_a_failed_capture_made_is_dropped_and_eager_steps_make_it_again(name):
    """As above, but the capture fails after the optimizer stepped (an error
    planted in the step): the state it made for model[0] was never written
    (a capture runs no kernel), so it is dropped with the error, and the
    caller stepping eagerly from there trains as eager."""
    t = Twins(name, frozen=True)
    inner = train_step(t.model, t.opts[0])

    def planted(x, y):
        loss = inner(x, y)
        if torch.cuda.is_current_stream_capturing():
            raise RuntimeError("planted after opt.step()")
        return loss
    step = cgraph.make_graphed_step(planted, t.batches[0], num_warmup_iters=1)
    t.check(step(*t.batches[0]), t.plain(*t.batches[0]), "loss of the warm-up call")
    t.each(lambda m: m[0].requires_grad_(True))
    with pytest.raises(RuntimeError, match="planted after opt.step"):
        step(*t.batches[1])
    assert all(p not in t.opts[0].state for p in t.model[0].parameters())
    for i in range(1, 7):
        t.check(inner(*t.batches[i]), t.plain(*t.batches[i]), f"loss of eager call {i}")
    t.assert_same_training()


@pytest.mark.gpu
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_parameters_moved_to_other_memory_after_capture_are_stepped_there(name, caplog):
    """p.data = p.data.clone() on every parameter after the capture and a
    replay: the next call steps eagerly and the one after captures again.
    Before, the graph went on reading and stepping the parameters' old
    memory, freed since, and the parameters kept their values."""
    t = Twins(name)
    for i in range(3):  # warm-up, capture, one replay
        t.call(i)

    def moved(model):
        with torch.no_grad():
            for p in model.parameters():
                p.data = p.data.clone()

    was = [p.data_ptr() for p in t.model.parameters()]
    t.each(moved)
    assert all(p.data_ptr() != w for p, w in zip(t.model.parameters(), was))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        for i in range(3, 7):
            t.call(i)
    t.assert_same_training()
    assert t.step.stats == {"eager": 2, "captures": 2, "replays": 5}, t.step.stats
    assert_logged(caplog, "parameter 0 of param group 0 of", "moved to other memory")


# ---- schedulers: outside the step, never inside ------------------------------

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw-fused", "adamw-foreach"])
def test_a_scheduler_stepped_after_each_call_matches_eager(name):
    """StepLR halves lr after every call: the graph reads it from the device,
    refilled before each replay, with no capture again."""
    t = Twins(name, scheduled=True)
    for i in range(5):
        t.call(i)
    t.assert_same_training()
    assert t.step.stats == {"eager": 1, "captures": 1, "replays": 4}, t.step.stats
    assert _lrs(t.opts[0]) == _lrs(t.opts[1]) == [1e-2 * 0.5**5]


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("fused", [False, True], ids=["adamw-foreach", "adamw-fused"])
@pytest.mark.parametrize("step_size", [1, 100], ids=["lr-moves", "lr-flat-in-warm-up"])
def test_a_scheduler_stepped_inside_the_step_is_refused_naming_the_fix(device, fused,
                                                                         step_size):
    """A capture would bake the lr of its own call into every replay: the
    first (eager) call refuses it, saying where scheduler.step() goes, even
    where the lr does not move in the warm-up calls (step_size=100)."""
    torch.manual_seed(0)
    model = nn.Linear(8, 4).to(device)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=step_size, gamma=0.5)
    x, y = torch.randn(4, 8, device=device), torch.randint(0, 4, (4,), device=device)
    step = cgraph.make_graphed_step(train_step(model, opt, scheduler), (x, y))
    with pytest.raises(RuntimeError, match=r"scheduler\.step\(\) was called inside the "
                                           r"graphed step.*after the graphed step"):
        step(x, y)
    scheduler.step()  # outside a set-up, it steps as ever
    assert scheduler.last_epoch == 1


# ---- the checks themselves, on the CPU -----------------------------------------

def test_an_lr_changed_since_its_optimizer_stepped_is_refused():
    """_refuse_lrs_moved_inside: each optimizer's lrs as its step began
    against now.  A float lr or a tensor lr filled in place is refused; a
    group added since (add_param_group) is not compared, nor are lrs that
    did not change."""
    a, b = nn.Parameter(torch.zeros(2)), nn.Parameter(torch.zeros(2))
    sgd = torch.optim.SGD([{"params": [a]}, {"params": [b], "lr": 0.5}], lr=0.1)
    adamw = torch.optim.AdamW([nn.Parameter(torch.zeros(2))], lr=torch.tensor(1e-3))
    began = {sgd: _lrs(sgd), adamw: _lrs(adamw)}
    assert began[sgd] == [0.1, 0.5]
    _refuse_lrs_moved_inside(began)  # nothing changed
    sgd.param_groups[1]["lr"] = 0.25
    with pytest.raises(RuntimeError, match=r"learning rate of SGD changed inside the graphed "
                                           r"step after its step \(from \[0\.1, 0\.5\] to "
                                           r"\[0\.1, 0\.25\]\): a scheduler\.step\(\)"):
        _refuse_lrs_moved_inside(began)
    sgd.param_groups[1]["lr"] = 0.5
    adamw.param_groups[0]["lr"].fill_(5e-4)  # as a scheduler changes a tensor lr
    with pytest.raises(RuntimeError, match="learning rate of AdamW changed"):
        _refuse_lrs_moved_inside(began)
    adamw.param_groups[0]["lr"].fill_(1e-3)
    sgd.add_param_group({"params": [nn.Parameter(torch.zeros(2))], "lr": 0.7})
    _refuse_lrs_moved_inside(began)  # a group added: the others compared, unchanged
    sgd.param_groups[0]["lr"] = 0.2
    with pytest.raises(RuntimeError, match="learning rate of SGD changed"):
        _refuse_lrs_moved_inside(began)


def test_a_scheduler_inside_a_cpu_step_is_refused_and_one_after_each_call_is_not():
    """The refusal comes from the warm-up call itself (on the CPU, no
    capture ever), and a scheduler stepped after the call is not refused."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scheduler = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    x, y = torch.randn(3, 4), torch.randint(0, 2, (3,))
    outside = cgraph.make_graphed_step(train_step(model, opt), (x, y), num_warmup_iters=2)
    for _ in range(2):
        outside(x, y)
        scheduler.step()
    assert outside.stats["eager"] == 2 and _lrs(opt) == [0.025]
    inside = cgraph.make_graphed_step(train_step(model, opt, scheduler), (x, y))
    with pytest.raises(RuntimeError, match=r"scheduler\.step\(\) was called inside"):
        inside(x, y)


def adamw_with_state():
    """A CPU AdamW over two parameters, one of which (`old`) has stepped."""
    old, new = nn.Parameter(torch.ones(3)), nn.Parameter(torch.ones(2))
    opt = torch.optim.AdamW([old, new], lr=1e-2)
    old.grad = torch.full((3,), 0.5)
    opt.step()
    return opt, old, new


def test_state_made_since_the_keys_were_taken_is_found_per_parameter():
    """_state_keys before a capture, _state_made after it: an optimizer
    per parameter whose state gained keys (a new parameter's state, or an
    SGD momentum buffer beside an entry that existed); none where a step
    only updated state in place."""
    opt, old, new = adamw_with_state()
    before = _state_keys([opt])
    assert before == {id(old): {"step", "exp_avg", "exp_avg_sq"}}
    old.grad = torch.full((3,), 0.5)
    opt.step()  # old's state updated, none made
    assert _state_made([opt], before) == []
    new.grad = torch.full((2,), 0.25)
    opt.step()  # as a capture would step it: new's state is made
    (made,) = _state_made([opt], before)
    assert made.optimizer is opt and made.state is opt.state[new]
    assert set(made.keys) == {"step", "exp_avg", "exp_avg_sq"}
    kept = dict(opt.state[old])
    values = {k: v.clone() for k, v in opt.state[new].items()}
    was = dict(opt.state[new])
    _out_of_the_pool([made])  # before the graph's pool goes: copies, same values
    for k, v in opt.state[new].items():
        assert v is not was[k] and torch.equal(v, values[k]), k
    assert all(opt.state[old][k] is v for k, v in kept.items()), "state from before stays"
    p = nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sgd.state[p]["kept"] = torch.zeros(1)
    before = _state_keys([sgd])
    p.grad = torch.ones(3)
    sgd.step()
    assert [m.keys for m in _state_made([sgd], before)] == [("momentum_buffer",)]


def test_state_a_failed_capture_made_is_forgotten_and_no_other():
    """_forget, after a capture that failed: the keys it made go, and a
    parameter's entry with them where the capture made all of it; the
    state that was there before stays, the same tensors."""
    opt, old, new = adamw_with_state()
    p = nn.Parameter(torch.ones(3))
    sgd = torch.optim.SGD([p], lr=0.1, momentum=0.9)
    sgd.state[p]["kept"] = kept = torch.zeros(1)
    before = _state_keys([opt, sgd])
    was = dict(opt.state[old])
    for q in (old, new, p):
        q.grad = torch.ones_like(q)
    opt.step()
    sgd.step()
    _forget(_state_made([opt, sgd], before))
    assert new not in opt.state and set(opt.state) == {old}
    assert set(opt.state[old]) == set(was)
    assert dict(sgd.state[p]) == {"kept": kept}


def test_a_grad_scaler_updated_outside_the_step_is_refused_naming_the_fix():
    """A scaler that still holds its step's inf checks when the warm-up call
    returns is updated outside the step: refused (a replay would leave it no
    checks, and torch's update() would raise "No inf checks were
    recorded"); one updated inside passes."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    x = torch.randn(3, 4)
    for inside in (True, False):
        scaler = torch.amp.GradScaler("cpu")

        def step(x):
            opt.zero_grad()
            scaler.scale(model(x).pow(2).mean()).backward()
            scaler.step(opt)
            if inside:
                scaler.update()

        graphed = cgraph.make_graphed_step(step, (x,))
        if inside:
            graphed(x)
            _refuse_scalers_updated_outside([scaler])
            continue
        with pytest.raises(RuntimeError, match=r"update\(\) runs outside it.*inside the step"):
            graphed(x)


def as_captured(step, model, opt):
    """The grads and parameter marks a capture of `step` leaves, set on the
    CPU: the step called eagerly inside StepGrads.noted, as the capture
    calls it."""
    step.optimizers.add(opt)
    into = []
    with StepGrads.noted([opt], into):
        train_step(model, opt)(torch.randn(3, 4), torch.randint(0, 2, (3,)))
    step.grads = into[0]
    step.since = since(step, model)


def since(step, model):
    """The record a capture leaves (SinceCapture): `model`'s tensors, no
    modes read, no grad sync, no other grads."""
    others = OtherGrads([], set())
    others.captured(frozenset())
    return SinceCapture((True, False), None,
                        Marks(step.grads.params, [model], step.grads.label),
                        Modes.now(()), GradSync([], [], []), others, step.grads)


def moved(p):
    with torch.no_grad():
        p.data = p.data.clone()


def in_place(p):
    with torch.no_grad():
        p.mul_(2.0)
    p.data.add_(1.0)
    p.grad = None


CHANGES = {
    "was frozen": (None, lambda p: p.requires_grad_(False)),
    "was unfrozen": (lambda p: p.requires_grad_(False), lambda p: p.requires_grad_(True)),
    "moved to other memory": (None, moved),
    None: (None, in_place),  # the same memory, the same flag: nothing to see
}


@pytest.mark.parametrize("what", list(CHANGES), ids=str)
def test_a_parameter_frozen_unfrozen_or_moved_since_capture_warms_the_step_up_again(
        what, caplog):
    """_params_changed through _stale, without a GPU: a change of a
    parameter's memory or requires_grad is named (logged) and the step is
    to run eagerly once more; values changed in place are not a change."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    before, change = CHANGES[what]
    if before is not None:
        before(model.weight)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, model, opt)
    assert not step._stale()
    change(model.weight)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        stale = step._stale()
    if what is None:
        assert not stale and step.grads is not None and not caplog.records
        return
    assert stale and step.grads is None
    assert step.num_warmup_iters == step.stats["eager"] + 1
    assert_logged(caplog, "parameter 0 of param group 0 of SGD", f"{what} ")


def test_a_call_under_another_autocast_than_its_capture_warms_up_again(caplog, monkeypatch):
    """A step captured outside autocast replays full precision, one captured
    under bf16 autocast its casts and bf16 kernels: a call under another
    autocast (or its dtype) runs eagerly, named, and the next captures
    again.  CUDA autocast read, as the graphs' kernels are CUDA's (stood in
    for on the CPU by patching what the check reads)."""
    from cgraph import _step_checks
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    around = [None]
    monkeypatch.setattr(_step_checks, "autocast_around", lambda: around[0])
    as_captured(step, model, opt)
    assert not step._stale()
    around[0] = torch.bfloat16
    with caplog.at_level(logging.INFO, logger="cgraph"):
        assert step._stale() and step.grads is None
    assert_logged(caplog, "CUDA autocast around the call",
                  "changed from None to torch.bfloat16 (None: off) since capture")
    as_captured(step, model, opt)
    step.since.autocast = torch.bfloat16
    assert not step._stale()
    around[0] = torch.float16
    assert step._stale()


@pytest.mark.gpu
def test_autocast_around_reads_cuda_autocast():
    from cgraph._step_checks import autocast_around
    assert autocast_around() is None
    with torch.autocast("cuda", dtype=torch.bfloat16, enabled=True):
        assert autocast_around() is torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert autocast_around() is None


@pytest.mark.parametrize("mode", ["no_grad", "inference_mode"])
def test_a_call_under_another_grad_mode_than_its_capture_warms_up_again(mode, caplog):
    """A step captured with grad, called under no_grad() or inference_mode():
    a replay would run its backward and optimizer step, where eager raises
    (or steps, where the step enables grad itself); so the call runs
    eagerly, named, and the next one with grad captures again."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, model, opt)
    assert not step._stale()
    context = torch.no_grad() if mode == "no_grad" else torch.inference_mode()
    with caplog.at_level(logging.INFO, logger="cgraph"), context:
        assert step._stale() and step.grads is None
    named = "torch.no_grad()" if mode == "no_grad" else "torch.inference_mode()"
    assert_logged(caplog, "the grad mode around the call",
                  f"changed from grad enabled to {named} since capture")
    # Captured under no_grad(): it replays under inference_mode too, its
    # static tensors being plain; captured under inference_mode, not under
    # no_grad().
    as_captured(step, model, opt)
    step.since.grad_mode = (False, False)
    with torch.inference_mode():
        assert not step._stale()
    step.since.grad_mode = (False, True)
    with torch.no_grad():
        assert step._stale()


@pytest.mark.parametrize("what", ["running_mean", "weight"])
def test_a_buffer_or_a_parameter_no_optimizer_steps_moved_since_capture_warms_up_again(
        what, caplog):
    """Marks: the graph also reads the other tensors of the modules the step
    names (BatchNorm's running stats, a frozen backbone, an EMA copy it
    updates), and one moved since capture (ema.cpu(); ema.cuda()) would be
    read, or written, at memory freed since: named, and the step runs
    eagerly once more."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[2].parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, model, opt)
    assert len(step.since.marks.tensors) == 2 + 4 + 3  # stepped, other parameters, buffers
    assert not step._stale()
    moved(getattr(model[0 if what == "weight" else 1], what))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        assert step._stale() and step.grads is None
    index = 0 if what == "weight" else 1
    assert_logged(caplog, f"Sequential.{index}.{what}", "moved to other memory")


def test_grads_no_optimizer_of_the_step_holds_are_checked_before_and_put_back_after(caplog):
    """Note [Grads no optimizer of the step holds]: the grads of parameters
    the step's optimizers do not hold, cleared before the capture as before
    each call, replay, and each gets the grad the capture left; one not
    cleared before a call (the graph would assign where eager adds) makes
    that call eager, named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, model, opt)
    for p in model[0].parameters():
        p.grad = None  # zero_grad() outside, before the capture
    step.since.other_grads = OtherGrads([model], {id(p) for p in model[1].parameters()})
    assert len(step.since.other_grads.params) == 2
    model(torch.randn(3, 4)).sum().backward()  # the grads the capture makes
    step.since.other_grads.captured(frozenset())
    made = [p.grad for p in model[0].parameters()]
    for p in model[0].parameters():
        p.grad = None  # zero_grad() outside, before this call
    assert not step._stale()
    step.since.other_grads.leave()
    assert all(p.grad is g for p, g in zip(model[0].parameters(), made))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        assert step._stale() and step.since is None  # not cleared this time
    assert_logged(caplog, "the grad of Sequential.0.weight", "set or cleared outside the step")


def test_a_grad_the_backward_added_into_then_replaced_is_held_and_checked():
    """A step that replaces a grad after its backward added into it (a
    mask: p.grad = p.grad * mask): every replay adds into the starting
    grad's memory, so that grad is held (noted by a post-accumulate-grad
    hook around the capture) and a call that finds another grad steps
    eagerly.  Before, the starting grad, held weakly, was freed and left
    unchecked: replays added into freed memory."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()  # grads from outside, added into
    others = OtherGrads([model], set())
    started = [p.grad for p in others.params]
    with others.noting():
        model(torch.randn(3, 4)).sum().backward()
        for p in model.parameters():
            p.grad = p.grad * 2.0
    del started
    others.captured(frozenset())
    assert len(others.checked) == 2
    assert others.first_changed() == "Linear.weight"  # the replaced grad, after leave()
    # Seen without a hook: torch keeps a post-accumulate-grad hook after its
    # handle is removed (per-layer graphs' slow path for good).
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())


def test_grads_the_step_clears_itself_are_not_checked_before_a_replay():
    """A forward-and-backward step that calls zero_grad() itself (the
    optimizer stepped outside): the capture makes those grads anew, so the
    grads found before a call do not matter; each replay leaves the
    capture's.  Frozen parameters are left out.  Before, the warm-up's grads
    were taken for the capture's starting state, and every other call
    captured again."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    model[1].bias.requires_grad_(False)
    model(torch.randn(3, 4)).sum().backward()  # the last warm-up's grads
    others = OtherGrads([model], set())
    assert len(others.params) == 3
    model.zero_grad()  # inside the capture
    model(torch.randn(3, 4)).sum().backward()
    others.captured(frozenset(map(id, model.parameters())))
    made = [p.grad for p in others.params]
    assert others.first_changed() is None
    for p in model.parameters():
        p.grad = torch.zeros_like(p)  # anything, before the next call
    assert others.first_changed() is None
    others.leave()
    assert all(p.grad is g for p, g in zip(others.params, made))


def test_a_failed_capture_puts_back_the_grads_no_optimizer_of_the_step_holds():
    """OtherGrads.put_back, after a capture that failed: a grad the capture
    assigned where there was none is None again (no kernel wrote it), one
    it replaced is the one found, and one the step's own zero_grad() freed
    is None, as an eager step that failed there would leave it."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2), nn.Linear(2, 2))
    model(torch.randn(3, 4)).sum().backward()
    model[0].zero_grad()  # no grads: assigned by the capture
    found = [p.grad for p in model[1].parameters()]  # replaced by it
    others = OtherGrads([model], set())
    with StepGrads.noted([], [], others.forget), others.noting():  # as a capture nests them
        model[2].zero_grad()  # freed by the step itself
        model(torch.randn(3, 4)).sum().backward()
        for p in model[1].parameters():
            p.grad = p.grad * 2.0
    assert all(p.grad is not None for p in model.parameters())
    others.put_back()
    assert [p.grad for p in model[0].parameters()] == [None, None]
    assert all(p.grad is g for p, g in zip(model[1].parameters(), found))
    assert [p.grad for p in model[2].parameters()] == [None, None]


def test_a_shared_pool_check_flags_new_memory_in_the_pool_s_segments(monkeypatch):
    """SharedPool.first_new_in_it (Note [A step captured into a shared pool]),
    its memory stood in for on the CPU: a new tensor overlapping a segment the
    pool had before the capture is named, wherever in it it starts (a grad
    that begins before a segment and runs into it too); one outside every
    segment, an empty one, and a grad that existed, in the memory it had, are
    not; an existing grad whose memory moved (.data = t) counts as new."""
    import weakref

    from cgraph import _step_pool

    memory: dict = {}
    monkeypatch.setattr(_step_pool, "_memory_of", lambda t: memory[id(t)])
    kept, moved, outside, into, empty, inside = (torch.zeros(1) for _ in range(6))
    memory.update({id(kept): ((1100, 64),), id(moved): ((5100, 64),),
                   id(outside): ((3000, 64),), id(into): ((4990, 64),),
                   id(empty): ((1500, 0),), id(inside): ((1900, 50),)})
    existing = {id(kept): (weakref.ref(kept), ((1100, 64),)),
                id(moved): (weakref.ref(moved), ((2500, 64),))}
    shared = _step_pool.SharedPool((1000, 5000), (2000, 6000), existing, ("a graph",))
    assert shared.first_new_in_it([("kept", kept), ("outside", outside), ("empty", empty),
                                   ("not a tensor", None)]) is None
    assert shared.first_new_in_it([("kept", kept), ("moved", moved)]) == "moved"
    assert shared.first_new_in_it([("outside", outside), ("into", into)]) == "into"
    assert shared.first_new_in_it([("inside", inside)]) == "inside"
    assert "leave pool= out" in str(shared.refusal("the grad of x"))


def test_grads_a_capture_left_as_it_found_them_are_neither_checked_nor_put_back():
    """An evaluation step (no backward) over a model that a training step
    trains: the grads it found are the training step's, which change
    between its calls.  Before, they were checked (every call of the
    evaluation step captured again, warned) and put back after each replay
    (the objects of its capture: the training step's grads undone)."""
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    model(torch.randn(3, 4)).sum().backward()  # the training step's grads
    others = OtherGrads([model], set())
    with others.noting():
        with torch.no_grad():
            model(torch.randn(3, 4))
    others.captured(frozenset())
    assert others.checked == () and others.touched == ()
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()  # the training step again
    trained = [p.grad for p in model.parameters()]
    assert others.first_changed() is None
    others.leave()
    assert all(p.grad is g for p, g in zip(model.parameters(), trained))
    # Written in place without a backward (clip_grad_norm_ in a step of its
    # own): touched, so a grad replaced since is seen.
    clipped = OtherGrads([model], set())
    with clipped.noting():
        torch.nn.utils.clip_grad_norm_(model.parameters(), 0.1)
    clipped.captured(frozenset())
    assert len(clipped.touched) == 2 and len(clipped.checked) == 2
    model.zero_grad()
    model(torch.randn(3, 4)).sum().backward()
    assert clipped.first_changed() == "Linear.weight"


@pytest.mark.parametrize("how", ["converted", "assigned"])
def test_a_buffer_replaced_by_another_tensor_since_capture_warms_up_again(how, caplog):
    """Marks: a buffer replaced in its module by a new object, its old one
    unmoved (model.to(torch.bfloat16) converting the fp32 buffer of a bf16
    model, parameters already bf16; or module.buf = t): found by walking the
    modules again after the conversion or registration, named."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4)).to(torch.bfloat16)
    model[0].register_buffer("inv_freq", torch.ones(2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    step.optimizers.add(opt)
    into = []
    with StepGrads.noted([opt], into):
        pass
    step.grads = into[0]
    step.since = since(step, model)
    assert not step._stale()
    torch.nn.Linear(2, 2)  # a registration elsewhere: walked again, nothing replaced
    assert not step._stale()
    if how == "converted":
        model.to(torch.bfloat16)
    else:
        model[0].inv_freq = torch.zeros(2)
    with caplog.at_level(logging.INFO, logger="cgraph"):
        assert step._stale()
    assert_logged(caplog, "Sequential.0.inv_freq", "was replaced")


@pytest.mark.parametrize("owner", ["fsdp", "ddp"])
def test_grad_sync_set_outside_the_step_since_capture_warms_up_again(owner, caplog):
    """Note [Grad sync set outside a graphed step], with stand-ins for an
    FSDP param group and a DDP model: a replay would reduce grads, or not,
    as the capture did; a change is named and the step runs eagerly once
    more.  A call that would capture with FSDP's sync off is refused."""
    group = fsdp_group()
    ddp = SimpleNamespace(require_backward_grad_sync=True)
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    as_captured(step, model, opt)
    step.since.sync = GradSync([group], [ddp], [ddp])
    assert not step._stale()
    if owner == "fsdp":
        group.reduce_grads, said = False, "FSDP's reduce_grads of 'layers.0'"
    else:
        ddp.require_backward_grad_sync, said = False, "DDP's require_backward_grad_sync"
    with caplog.at_level(logging.INFO, logger="cgraph"):
        assert step._stale() and step.grads is None and step.since is None
    assert_logged(caplog, said, "changed since capture")
    refused = GradSync([group], [ddp], [ddp])
    if owner == "ddp":
        refused.refuse_unreduced()  # DDP's grads accumulate in .grad, which a replay follows
        return
    with pytest.raises(ValueError, match=r"starts with FSDP's reduce_grads of 'layers.0' off.*"
                                         r"set_requires_gradient_sync\(i == last\)"):
        refused.refuse_unreduced()


def fsdp_group(hsdp=False, **settings):
    """A stand-in for an FSDP2 param group of one parameter, at rest: every
    setting on, nothing held for a later reduction."""
    return SimpleNamespace(**{"reduce_grads": True, "all_reduce_grads": True,
                              "reshard_after_backward": True, **settings},
                           _module_fqn="layers.0", _partial_reduce_output=None,
                           fsdp_params=[SimpleNamespace(unsharded_accumulated_grad=None)],
                           mesh_info=SimpleNamespace(replicate_mesh_dim=0 if hsdp else None))


def test_a_capture_starting_with_grads_fsdp_holds_for_a_later_reduction_is_refused():
    """Note [Grad sync set outside a graphed step]: HSDP's all-reduce off
    (set_requires_all_reduce(False)) keeps a partial reduction across calls,
    and a group may hold grads that earlier calls with sync off left (the
    last micro-batch's call capturing): a replay would add into memory freed
    since, and FSDP's next eager call would miss what replays reduced.
    Refused, naming the group.  all_reduce_grads off without a replicate
    dimension does nothing in FSDP: not refused."""
    GradSync([fsdp_group(hsdp=False, all_reduce_grads=False)], [], []).refuse_unreduced()
    with pytest.raises(ValueError, match=r"all_reduce_grads of 'layers.0' off \(set_requires_all"
                                         r"_reduce\(False\).*HSDP's partial reduction"):
        GradSync([fsdp_group(hsdp=True, all_reduce_grads=False)], [], []).refuse_unreduced()
    held = fsdp_group(hsdp=True)
    held._partial_reduce_output = torch.zeros(2)
    accumulated = fsdp_group()
    accumulated.fsdp_params[0].unsharded_accumulated_grad = torch.zeros(2)
    for group in (held, accumulated):
        with pytest.raises(ValueError, match=r"starts with FSDP's 'layers.0' holding unsharded "
                                             r"grads not yet reduced"):
            GradSync([group], [], []).refuse_unreduced()


def fsdp_pair(mesh, mixed: bool):
    """Two Linears, each and their Sequential fully_shard-ed (bf16 parameters
    and fp32 reduction if `mixed`), and their FSDP parameter groups."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    from cgraph import _fsdp
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    policy = ({"mp_policy": MixedPrecisionPolicy(param_dtype=torch.bfloat16,
                                                 reduce_dtype=torch.float32)} if mixed else {})
    for layer in (*model, model):
        fully_shard(layer, mesh=mesh, **policy)
    return model, _fsdp.Resharded([model]).groups


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-params-fp32-reduce"])
def test_a_real_fsdp_model_holding_grads_of_a_call_with_sync_off_refuses_a_capture(mesh, mixed):
    """The refusal above, on real FSDP2 modules: a backward with sync off
    leaves the unsharded grads on the unsharded parameters (fp32), or in
    FSDP's accumulated grads (another reduce dtype); a capture starting so
    is refused.  After a reducing backward, FSDP holds none: not refused."""
    model, groups = fsdp_pair(mesh, mixed)
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4)).sum().backward()
    model.set_requires_gradient_sync(True)
    with pytest.raises(ValueError, match="holding unsharded grads not yet reduced"):
        GradSync(groups, [], []).refuse_unreduced()
    model(torch.randn(3, 4)).sum().backward()  # the last micro-batch: reduced
    GradSync(groups, [], []).refuse_unreduced()


@pytest.mark.parametrize("mixed", [False, True], ids=["fp32", "bf16-params-fp32-reduce"])
def test_grads_fsdp_holds_from_a_backward_outside_after_capture_are_seen(mesh, mixed,
                                                                        monkeypatch):
    """Note [Grads FSDP2 holds, kept after a step's capture]: after a
    capture that found none, a backward outside with sync off leaves grads
    FSDP holds for the step's reduce-scatter, which a replay would drop.
    The next look names the group holding them; one after a reducing
    backward (nothing held), or with no backward since, finds nothing and
    walks no group."""
    from cgraph import _fsdp
    model, groups = fsdp_pair(mesh, mixed)
    sync = GradSync(groups, [], [])
    sync.captured()
    model(torch.randn(3, 4)).sum().backward()  # reducing: nothing held, nothing counted
    assert sync.held_outside() is None
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4)).sum().backward()
    model.set_requires_gradient_sync(True)
    assert sync.held_outside() is not None
    model(torch.randn(3, 4)).sum().backward()  # the held grads reduced in, outside
    model.set_requires_gradient_sync(False)
    model(torch.randn(3, 4)).sum().backward()
    model.set_requires_gradient_sync(True)
    model(torch.randn(3, 4)).sum().backward()
    walked = []
    walk = _fsdp.holding_grads
    monkeypatch.setattr(_fsdp, "holding_grads", lambda gs: walked.append(gs) or walk(gs))
    assert sync.held_outside() is None and len(walked) == 1  # counted, but none held
    assert sync.held_outside() is None and len(walked) == 1  # nothing since: no walk
    post_backward = type(groups[0]).post_backward
    _fsdp.watch_held_grads(groups)  # once per class, however often asked
    assert type(groups[0]).post_backward is post_backward and post_backward._cgraph_counts


def test_after_a_capture_calls_starting_with_grads_fsdp_holds_step_eagerly(monkeypatch,
                                                                         caplog):
    """Note [Grads FSDP2 holds, kept after a step's capture]: a call that
    would capture again while FSDP holds grads of backwards outside steps
    eagerly instead of being refused (a batch-size ramp-up accumulating
    outside trains on), warned at the third in a row, naming the fix; the
    count starts again at a call without them.  Before any capture, the
    capture refuses, naming the fix (the test above)."""
    from cgraph import _fsdp
    torch.manual_seed(0)
    model = nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    step = cgraph.make_graphed_step(lambda: None)
    held = ["'layers.0'"]
    monkeypatch.setattr(_fsdp, "holding_grads", lambda groups: held[0])
    assert not step._fsdp_holds_grads()
    as_captured(step, model, opt)
    step.stats["captures"] = 1
    # The first such call is found before its replay (GradSync.held_outside).
    monkeypatch.setattr(GradSync, "held_outside", lambda sync: "'layers.0'")
    with caplog.at_level(logging.WARNING, logger="cgraph"):
        assert step._stale() and step.grads is None
        assert step._fsdp_holds_grads() and not caplog.records  # the second, before a capture
        assert step._fsdp_holds_grads()  # the third
    assert_logged(caplog, "FSDP's 'layers.0' held unsharded grads", "each of the last 3 calls",
                  "set_requires_gradient_sync(i == last)")
    held[0] = None
    assert not step._fsdp_holds_grads() and step.held_in_a_row == 0


def test_a_step_returning_an_object_holding_tensors_pytree_cannot_see_is_refused():
    """Such an object is a leaf kept as captured: every replay would return
    the capture's object and tensors.  Refused, naming the registration;
    an object holding no tensors (a string, a plain value) is kept."""
    import dataclasses

    @dataclasses.dataclass
    class Out:
        loss: torch.Tensor
        n: int

    class Holder:
        def __init__(self):
            self.losses = [torch.ones(())]

    with pytest.raises(TypeError, match=r"returned a Out holding tensors.*register_dataclass"):
        _Outputs.split(Out(torch.ones(()), 3))
    with pytest.raises(TypeError, match=r"returned a Holder holding tensors.*register_pytree_node"):
        _Outputs.split((torch.ones(()), Holder()))
    record, tensors = _Outputs.split((torch.ones(()), "done", 3))
    assert record.rebuild(tensors)[1:] == ("done", 3)


def test_a_dtensor_output_crosses_as_its_local_tensor_and_comes_back_a_dtensor(mesh):
    """The loss under loss_parallel() is a DTensor: the native call hands
    out its local tensor, and the record remakes the DTensor around it
    after each replay, of its mesh, placements, shape and stride."""
    from torch.distributed.tensor import DTensor, Replicate

    loss = DTensor.from_local(torch.tensor(2.5), mesh, [Replicate()])
    record, tensors = _Outputs.split((loss, {"n": 3}))
    assert len(tensors) == 1 and type(tensors[0]) is torch.Tensor
    local = torch.tensor(4.0)
    out, n = record.rebuild((local,))
    assert isinstance(out, DTensor) and out.placements == (Replicate(),) and n == {"n": 3}
    assert out.to_local() is local or torch.equal(out.to_local(), local)
    record, tensors = _Outputs.split(loss)
    assert isinstance(record.rebuild(tensors), DTensor)


def test_a_dtensor_parameter_is_marked_by_its_local_shard(mesh):
    """A DTensor's own tensor has no memory: the marks compare its local
    shard's, and its requires_grad."""
    from torch.distributed.tensor import Shard, distribute_tensor

    param = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    marks = _C.param_marks((param,))
    assert marks == ((param._local_tensor.data_ptr(), True),)
    assert _C.params_are((param,), marks)
    param.requires_grad_(False)
    assert not _C.params_are((param,), marks)


def test_param_marks_refuse_what_they_cannot_compare_with_a_cgraph_message():
    """param_marks and params_are take the tuples the step hands them; any
    other argument is refused, naming the function, rather than read."""
    with pytest.raises(TypeError, match="cgraph: param_marks takes a tuple"):
        _C.param_marks([torch.zeros(1)])
    marks = _C.param_marks((torch.zeros(1),))
    with pytest.raises(RuntimeError, match="cgraph: params_are: 2 parameters but 1 marks"):
        _C.params_are((torch.zeros(1), torch.zeros(1)), marks)
    with pytest.raises(TypeError, match="cgraph: params_are: mark 0 is not one"):
        _C.params_are((torch.zeros(1),), ((1, 2, 3),))
    with pytest.raises(TypeError, match="cgraph: params_are: parameter 0 is not a tensor"):
        _C.params_are((1,), marks)


# ---- train/eval modes (Note [The modules a graphed step's modes are read from]) ----

@pytest.mark.gpu
@pytest.mark.parametrize("name", ["adamw-fused", "sgd-momentum"])
def test_a_batchnorm_switched_to_eval_after_capture_is_replayed_in_eval(name):
    """bn.eval() after capture (freezing BatchNorm mid-training): the step
    warms up and captures again, in eval mode; the old code kept replaying
    batch statistics and updating the running ones."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.BatchNorm1d(64), nn.Tanh(),
                          nn.Linear(64, 8)).to(CUDA)
    eager = copy.deepcopy(model)
    opts = [OPTIMIZERS[name](m.parameters()) for m in (model, eager)]
    step = cgraph.make_graphed_step(train_step(model, opts[0]), num_warmup_iters=1)
    plain = train_step(eager, opts[1])
    batches = [(torch.randn(16, 32, device=CUDA), torch.randint(0, 8, (16,), device=CUDA))
               for _ in range(7)]
    for i, (x, y) in enumerate(batches):
        if i == 4:
            model[1].eval()
            eager[1].eval()
            frozen = model[1].running_mean.clone()
        assert_equal(step(x, y), plain(x, y), f"loss of call {i}")
    for (n, p), q in zip(model.named_parameters(), eager.parameters()):
        assert_equal(p, q, f"parameter {n}")
    for n in ("running_mean", "running_var", "num_batches_tracked"):
        assert_equal(getattr(model[1], n), getattr(eager[1], n), n)
    assert_equal(model[1].running_mean, frozen, "running mean after eval()")
    assert step.stats == {"eager": 2, "captures": 2, "replays": 5}, step.stats


def test_the_modes_compared_are_those_of_the_modules_the_step_names():
    """roots and Modes.under: the step's closure and globals, a bound method's
    object's modules, a helper one call deeper; of their submodules, the
    roots and those whose methods read `training`."""
    from cgraph._modes import Modes, roots
    model = nn.Sequential(nn.Linear(4, 4), nn.Dropout(0.1), nn.LayerNorm(4),
                          nn.BatchNorm1d(4))
    loss_module = nn.MSELoss()

    def loss_of(x):  # a helper the step names: its modules count too
        return loss_module(model(x), x)

    def step(x):
        return loss_of(x)

    modes = Modes.under(roots(step, []))
    assert sorted(type(m).__name__ for m in modes.modules) == ["BatchNorm1d", "Dropout",
                                                                "MSELoss", "Sequential"]
    assert modes.same()
    model[3].eval()
    assert not modes.same() and modes.first_changed() == "BatchNorm1d was switched to eval"
    model[3].train()
    assert modes.same()

    class Runner:
        def __init__(self):
            self.net = nn.Sequential(nn.Linear(2, 2), nn.Dropout())

        def step(self, x):
            return self.net(x)

    runner = Runner()
    modes = Modes.under(roots(runner.step, []))
    assert [type(m).__name__ for m in modes.modules] == ["Sequential", "Dropout"]
    runner.net.eval()
    assert not modes.same()
    with pytest.raises(ValueError, match="cgraph: modes_are: 1 modules but 0 modes"):
        _C.modes_are((model,), ())


def _agree_on_rank(rank: int, port: int, results) -> None:
    import torch.distributed as dist
    from cgraph import _ranks
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                            world_size=2)
    try:
        what = "a test capture"
        results[rank] = (_ranks.agree(None, what, holds=rank == 1),
                         _ranks.agree(None, what, holds=False),
                         _ranks.agree(None, what, together=False, holds=rank == 1))
    finally:
        dist.destroy_process_group()


def test_ranks_that_capture_together_agree_whether_any_made_optimizer_state():
    """_ranks.agree over two gloo processes: state made on rank 1 alone
    makes both capture again (one capturing while the other replays would
    hang their collectives); not together, each rank answers for itself."""
    import socket
    import torch.multiprocessing as mp
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_agree_on_rank, args=(port, results), nprocs=2, join=True)
    assert dict(results) == {0: (True, False, False), 1: (True, False, True)}


def test_a_scheduler_made_in_the_step_passes_its_own_first_step_and_no_other():
    """_schedulers_refused: a scheduler made lazily in the step's first call
    sets its first lr in its __init__ (let through); any step after, a
    subclass's own step that skips super().step() and ReduceLROnPlateau's
    included, is refused; outside the set-up every one steps as ever."""
    opt = torch.optim.SGD([nn.Parameter(torch.zeros(2))], lr=0.1)

    class Own(torch.optim.lr_scheduler.LRScheduler):
        def get_lr(self):
            return [0.1]

        def step(self, epoch=None):  # never calls super().step()
            pass

    with _schedulers_refused():
        made = torch.optim.lr_scheduler.LambdaLR(opt, lambda epoch: 0.5)
        assert _lrs(opt) == [0.05]
        own, plateau = Own(opt), torch.optim.lr_scheduler.ReduceLROnPlateau(opt)
        for step in (made.step, own.step, lambda: plateau.step(1.0)):
            with pytest.raises(RuntimeError, match=r"scheduler\.step\(\) was called inside"):
                step()
    made.step()
    own.step()
    plateau.step(1.0)


def test_modes_are_read_from_callable_objects_compiled_methods_and_defaults():
    """roots through a callable object (its attributes), a
    torch.compile'd bound method, functools.wraps, a lambda's default, a
    plain object's attribute and a dict's value; an object whose __dict__
    raises names none, without raising."""
    import functools
    from cgraph._modes import Modes, roots
    model = nn.Sequential(nn.Linear(2, 2), nn.Dropout())

    class Runner:
        def __init__(self):
            self.net = model

        def __call__(self, x):
            return self.net(x)

        def step(self, x):
            return self.net(x)

    runner = Runner()

    @functools.wraps(runner.step)
    def wrapped(x):
        return runner.step(x)

    class Opaque:
        @property
        def __dict__(self):
            raise RuntimeError("no attributes to read")

        def __call__(self, x):
            return x

    class Trainer:  # a plain object, not callable
        def __init__(self):
            self.model, self.lr = model, 0.1

    trainer, models = Trainer(), {"policy": model, "batches": list(range(100))}
    for step in (runner, torch.compile(runner.step), wrapped, lambda x, m=model: m(x),
                 lambda x: trainer.model(x), lambda x: models["policy"](x)):
        assert [type(m).__name__ for m in Modes.under(roots(step, [])).modules] == [
            "Sequential", "Dropout"], step
    assert Modes.under(roots(Opaque(), [])).modules == ()

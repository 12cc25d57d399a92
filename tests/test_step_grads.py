"""Note [Grads around a graphed step] (cgraph/_step_grads.py) on the CPU:
which grads a capture notes as made outside the step, and what happens to
the parameters' grads before and after each replay.  The "capture" here is
the step called eagerly inside StepGrads.noted, as the real capture calls
it; the graph's reads are stood in for by reading the held grads.  The GPU
tests (tests/test_step.py) train against eager."""

import gc
import weakref

import pytest
import torch
from torch import nn

from cgraph._step_grads import StepGrads


def model_and_optimizer():
    torch.manual_seed(0)
    model = nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def backward(model, seed):
    torch.manual_seed(seed)
    model(torch.randn(2, 4)).sum().backward()


def noted(opt, step):
    into = []
    with StepGrads.noted([opt], into):
        step()
    return into[0]


def test_grads_made_outside_an_optimizer_step_are_held_and_refilled_before_each_replay():
    model, opt = model_and_optimizer()
    backward(model, 1)
    grads = noted(opt, opt.step)  # an optimizer step graphed alone
    assert grads.held == tuple(model.parameters())
    assert all(h is p.grad for h, p in zip(grads.held_grads, model.parameters()))

    opt.zero_grad()  # set to None, then new grads: the graph would read freed memory
    backward(model, 2)
    fresh = [p.grad.clone() for p in model.parameters()]
    grads.bring_in()
    for p, held, want in zip(model.parameters(), grads.held_grads, fresh):
        assert p.grad is held, "the parameter's grad is the one the graph reads again"
        assert torch.equal(held, want), "with this call's values"
    grads.leave()
    assert all(p.grad is h for p, h in zip(model.parameters(), grads.held_grads))

    opt.zero_grad(set_to_none=False)  # zeroed in place: nothing to copy
    backward(model, 3)
    before = [p.grad for p in model.parameters()]
    grads.bring_in()
    assert [p.grad for p in model.parameters()] == before


def test_grads_the_step_makes_where_none_were_are_noted_and_one_made_outside_is_seen():
    """Rule 4: backward, step, zero_grad() at its end, captured with no
    grad made outside: the graph makes (assigns) those grads.  A grad made
    outside before a later call is named, so that call steps eagerly (an
    eager backward adds into it); None or a grad the step cleared is not."""
    model, opt = model_and_optimizer()

    def step():
        backward(model, 1)
        opt.step()
        opt.zero_grad()
    grads = noted(opt, step)
    assert grads.made == tuple(model.parameters()) and not grads.held and not grads.skipped
    assert grads.first_made_outside() is None
    backward(model, 2)  # a micro-batch outside, from this call on
    assert grads.first_made_outside() == "parameter 0 of param group 0 of SGD"
    opt.zero_grad()

    def cleared_first():
        opt.zero_grad()
        backward(model, 1)
        opt.step()
    grads = noted(opt, cleared_first)
    backward(model, 2)  # dropped by the step's own zero_grad(), as in eager
    assert grads.made == () and grads.first_made_outside() is None


def test_a_grad_the_backward_added_into_and_the_step_replaced_is_held():
    """Rule 1: grads zeroed in place outside; the step's backward adds into
    them, then replaces them (p.grad = p.grad * 0.5) before its optimizer
    steps.  Every replay adds into the first grads (freed at capture, were
    they not held): they are held, the replaced ones are what each replay
    leaves (rule 3), and before the next replay the grads zeroed outside
    are copied into the held ones.  Before, neither was noted."""
    model, opt = model_and_optimizer()
    backward(model, 1)
    opt.zero_grad(set_to_none=False)
    first = [p.grad for p in model.parameters()]

    def step():
        backward(model, 2)
        for p in model.parameters():
            p.grad = p.grad * 0.5
        opt.step()
    grads = noted(opt, step)
    assert grads.held == tuple(model.parameters()) and not grads.made
    assert all(h is f for h, f in zip(grads.held_grads, first))
    # No hook registered to see it: torch keeps a post-accumulate-grad hook
    # after its handle is removed, and per-layer graphs then take their slow
    # path for that parameter (csrc/aten_backward.cpp, delivered_by_autograd).
    assert all(p._post_accumulate_grad_hooks is None for p in model.parameters())
    assert all(p.grad is f for p, f in zip(model.parameters(), first)), "the capturing replay's"
    grads.leave()
    replaced = [p.grad for p in model.parameters()]
    assert all(r is a and r is not f for r, a, f in zip(replaced, grads.after, first))
    opt.zero_grad(set_to_none=False)  # zeroes the replaced ones, outside
    grads.bring_in()
    assert all(p.grad is f and not f.any() for p, f in zip(model.parameters(), first))


def test_a_grad_of_none_at_a_replay_raises_naming_the_parameter():
    model, opt = model_and_optimizer()
    backward(model, 1)
    grads = noted(opt, opt.step)
    opt.zero_grad()
    model.bias.grad = torch.zeros(3)
    with pytest.raises(ValueError, match=r"parameter 0 of param group 0 of SGD.*None"):
        grads.bring_in()
    assert model.bias.grad is not grads.held_grads[1], "nothing changed before the checks"


def test_a_dtensor_grad_of_other_placements_raises_and_one_of_the_same_is_copied_locally(mesh):
    """torch checks a grad's shape, dtype and device when it is set; a
    DTensor's placements only the step can check."""
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
    param = nn.Parameter(distribute_tensor(torch.randn(4, 3), mesh, [Shard(0)]))
    opt = torch.optim.SGD([param], lr=0.1)
    param.grad = distribute_tensor(torch.ones(4, 3), mesh, [Shard(0)])
    grads = noted(opt, opt.step)
    param.grad = distribute_tensor(torch.full((4, 3), 2.0), mesh, [Shard(0)])
    grads.bring_in()
    assert param.grad is grads.held_grads[0]
    assert torch.equal(param.grad.to_local(), torch.full((4, 3), 2.0))
    param.grad = DTensor.from_local(torch.zeros(4, 3), mesh, [Replicate()])
    with pytest.raises(ValueError, match=r"placed \(Replicate\(\),\).*placed \(Shard"):
        grads.bring_in()


@pytest.mark.parametrize("how", ["zero_grad first", "closure", "module zero_grad"])
def test_a_step_that_makes_its_grads_holds_none_and_leaves_its_own_after_each_replay(how):
    """The grads seen when the optimizer's step returns: a closure that
    zeroes and runs backward inside optimizer.step makes them too (as
    Lightning's steps do)."""
    model, opt = model_and_optimizer()
    backward(model, 1)  # the warm-up's last grads
    warm = weakref.ref(model.weight.grad)

    def closure():
        (model if how == "module zero_grad" else opt).zero_grad()
        backward(model, 2)

    def step():
        if how == "closure":
            opt.step(closure)
        else:
            closure()
            opt.step()

    grads = noted(opt, step)
    gc.collect()
    assert warm() is None, "the warm-up's grads were not kept for the capture to reuse"
    assert grads.held == () and grads.skipped == ()
    made = [p.grad for p in model.parameters()]
    opt.zero_grad()  # outside, between calls
    grads.bring_in()
    grads.leave()
    assert [p.grad for p in model.parameters()] == made, "an eager step leaves its grads"


def test_a_step_that_sets_grads_to_none_after_stepping_leaves_none_after_each_replay():
    """Micro-batches accumulated outside, the last inside, then step and
    zero_grad(): the graph reads the outside grads, and leaves none."""
    model, opt = model_and_optimizer()
    backward(model, 1)

    def step():
        backward(model, 2)  # accumulates into the grads made outside
        opt.step()
        opt.zero_grad()

    grads = noted(opt, step)
    assert grads.held == tuple(model.parameters())
    assert grads.after == (None, None)
    # The capturing call replays next: it reads the grads its call began with.
    assert all(p.grad is h for p, h in zip(model.parameters(), grads.held_grads))
    grads.bring_in()
    grads.leave()
    assert all(p.grad is None for p in model.parameters())
    backward(model, 3)
    grads.bring_in()
    assert all(p.grad is h for p, h in zip(model.parameters(), grads.held_grads))
    grads.leave()
    assert all(p.grad is None for p in model.parameters())


@pytest.mark.parametrize("ddp_like", [False, True], ids=["zeroed", "same-object"])
def test_grads_zeroed_in_place_inside_the_step_are_not_held_and_stay_the_parameters(ddp_like):
    """zero_grad(set_to_none=False) inside the step, or a grad that is the
    same tensor again after zero_grad() (DDP's bucket views): the graph
    zeroes and accumulates, reading nothing they held; set to None outside,
    they are the parameters' again after the replay, and nothing raises."""
    model, opt = model_and_optimizer()
    backward(model, 1)
    views = [p.grad for p in model.parameters()]

    def step():
        opt.zero_grad(set_to_none=ddp_like)
        if ddp_like:
            for p, v in zip(model.parameters(), views):
                p.grad = v.zero_()
        backward(model, 2)
        opt.step()

    grads = noted(opt, step)
    assert grads.held == () and grads.skipped == ()
    assert grads.after == tuple(views)
    opt.zero_grad()  # outside, between calls
    grads.bring_in()
    grads.leave()
    assert [p.grad for p in model.parameters()] == views


def test_a_parameter_without_a_grad_when_stepped_is_skipped_and_a_grad_later_raises():
    model, opt = model_and_optimizer()
    backward(model, 1)
    model.bias.grad = None  # unused in the capturing call

    grads = noted(opt, opt.step)
    assert grads.held == (model.weight,) and grads.skipped == (model.bias,)
    grads.bring_in()
    backward(model, 2)
    with pytest.raises(ValueError, match=r"parameter 1 of param group 0 of SGD was None.*"
                                         r"step.reset\(\)"):
        grads.bring_in()


def test_a_failed_capture_puts_back_the_grads_made_outside():
    """Micro-batches accumulated outside: a capture that fails after the
    step's own zero_grad() leaves the grads the call began with, for the
    eager step that follows (Lightning's fallback) or a retry."""
    model, opt = model_and_optimizer()
    backward(model, 1)
    began = [p.grad for p in model.parameters()]

    def step():
        opt.step()
        opt.zero_grad()
        raise RuntimeError("planted")

    into = []
    with pytest.raises(RuntimeError, match="planted"):
        with StepGrads.noted([opt], into):
            step()
    assert into == [] and [p.grad for p in model.parameters()] == began


def test_grads_are_compares_each_parameters_grad_by_identity():
    from cgraph import _C
    a, b = torch.zeros(2, requires_grad=True), torch.zeros(3, requires_grad=True)
    a.grad = torch.ones(2)
    assert _C.grads_are((a, b), (a.grad, None))
    assert not _C.grads_are((a, b), (a.grad.clone(), None))
    assert not _C.grads_are((a, b), (a.grad, torch.zeros(3)))
    assert not _C.grads_are((b,), (a.grad,))
    assert _C.grads_are((), ())
    with pytest.raises(TypeError, match="parameter 0 is not a tensor"):
        _C.grads_are((1,), (None,))
    with pytest.raises(RuntimeError, match="1 parameters but 2 grads"):
        _C.grads_are((a,), (None, None))


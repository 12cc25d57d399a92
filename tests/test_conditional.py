"""Conditional regions of a capture (Note [Conditional regions] in
csrc/aten_conditional.cpp): what a region records runs at a replay only
where its flag on the device is true then; its temporaries come from the
graph's pool; regions nest; a region that raises fails the capture and
leaves nothing behind.  Checked against the same arithmetic done eagerly."""

import pytest
import torch

import cgraph
from cgraph import _C
from _helpers import CUDA, assert_equal

pytestmark = pytest.mark.gpu

needs_conditional_nodes = pytest.mark.skipif(
    not _C.conditional_nodes(), reason="no conditional graph nodes (CUDA or driver < 12.4)")


def call_if(flag, fn, *args):
    """fn(*args) where flag holds: a region while captured, else eagerly
    (warm-up calls run the step eagerly)."""
    if torch.cuda.is_current_stream_capturing():
        return _C.call_if(flag, fn, args, {})
    return fn(*args) if flag else None


def test_call_if_outside_a_capture_by_cgraph_says_so():
    flag = torch.ones((), dtype=torch.bool, device=CUDA)
    with pytest.raises(RuntimeError, match="needs a capture by cgraph"):
        _C.call_if(flag, lambda: None, (), {})


def test_call_if_refuses_a_flag_that_is_not_a_tensor():
    """Read as a tensor unchecked, a Python int was garbage."""
    with pytest.raises(TypeError, match="the flag must be a tensor.*not int"):
        _C.call_if(1, lambda: None, (), {})


@needs_conditional_nodes
def test_a_region_runs_where_its_flag_is_true_at_replay():
    """The region adds x * 2 (a temporary made inside the region, from the
    pool) to a running total only where x sums above zero."""
    total = torch.zeros(4, device=CUDA)

    def step(x):
        call_if(x.sum() > 0, lambda: total.add_(x * 2))
        return total * 1

    xs = [torch.full((4,), v, device=CUDA) for v in (1.0, -1.0, 3.0, -2.0, 0.5, 2.0, -4.0)]
    graphed = cgraph.make_graphed_step(step, (xs[0],), num_warmup_iters=1)
    outs = [graphed(x).clone() for x in xs]
    expected, running = [], torch.zeros(4, device=CUDA)
    for x in xs:
        if x.sum() > 0:
            running += x * 2
        expected.append(running.clone())
    assert graphed.stats["replays"] == len(xs) - 1, graphed.stats
    for k, (out, want) in enumerate(zip(outs, expected)):
        assert_equal(out, want, f"call {k}")


@needs_conditional_nodes
def test_regions_nest():
    total = torch.zeros(2, device=CUDA)

    def inner(x):
        total.add_(x)
        call_if(x[0] > 10, lambda: total.mul_(0.5))

    def step(x):
        call_if(x[0] > 0, inner, x)
        return total.clone()

    xs = [torch.tensor([v, 1.0], device=CUDA) for v in (1.0, 20.0, -3.0, 12.0, 2.0, -1.0)]
    graphed = cgraph.make_graphed_step(step, (xs[0],), num_warmup_iters=1)
    outs = [graphed(x) for x in xs]
    running = torch.zeros(2, device=CUDA)
    for k, (x, out) in enumerate(zip(xs, outs)):
        if x[0] > 0:
            running += x
            if x[0] > 10:
                running *= 0.5
        assert_equal(out, running, f"call {k}")


@needs_conditional_nodes
def test_a_region_that_raises_fails_the_capture_and_the_next_capture_works():
    total = torch.zeros(3, device=CUDA)
    fail = [False]

    def body(x):
        total.add_(x)
        if fail[0]:
            raise KeyError("inside the region")

    def step(x):
        call_if(x.sum() > 0, body, x)
        return total.clone()

    x = torch.ones(3, device=CUDA)
    graphed = cgraph.make_graphed_step(step, (x,), num_warmup_iters=1)
    graphed(x)
    fail[0] = True
    with pytest.raises(cgraph.CaptureError, match="inside the region") as failed:
        graphed(x)
    assert isinstance(failed.value.__cause__, KeyError)
    assert torch.cuda.current_stream() == torch.cuda.default_stream()
    fail[0] = False
    before = total.clone()
    again = cgraph.make_graphed_step(step, (x,), num_warmup_iters=1)
    for _ in range(3):
        again(x)
    assert again.stats["replays"] == 2, again.stats
    assert_equal(total, before + 3, "the total after three steps")

"""Capture failures and refusals.  A capture that fails (a host sync, a
print, the legacy stream, reseeding, host random numbers) raises a
CaptureError that names the cause, returns its pool and leaves the process
usable; what cgraph refuses up front (a host output, a replay inside
another capture, torch.compile's reduce-overhead inside, a reentrant
checkpoint reading a closure leaf) says what to do instead; parameters
moved or replaced after capture raise on the next call, while in-place
loads and unrelated modules do not.  Each test checks the error's type and
the words of its advice; most then check that the process is still usable:
eager work, a new capture or the same callable give eager PyTorch's results,
bitwise."""

import copy
import random

import pytest
import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cgraph
from _helpers import CUDA, Checkpointed, assert_equal, assert_grads_equal, mlp, run_step, stack

pytestmark = pytest.mark.gpu


# ---- capture failures: explained and recoverable ----------------------------


def test_capture_failure_is_explained_and_recoverable():
    x = torch.randn(8, device=CUDA)

    def syncs(t):
        return t * t.sum().item()

    with pytest.raises(cgraph.CaptureError, match=r"\.item\(\)") as info:
        cgraph.make_graphed(syncs, (x,))
    assert info.value.__cause__ is not None and info.value.kind == "sync"
    # The process is fully usable: eager work, and a new capture.
    assert_equal(x * 2, x + x, "eager after a failed capture")
    graphed = cgraph.make_graphed(lambda t: t * 2, (x,))
    assert_equal(graphed(x), x * 2, "capture after a failed capture")


def _on_default_stream(t):
    with torch.cuda.stream(torch.cuda.default_stream()):
        return t * 2


# case: (callable, words of the advice, the kinds CaptureError.kind may name).
# Where torch may report one cause two ways (a refused copy, or CUDA's
# "not permitted while capturing"), both kinds are right.
FAILURES = {
    "item": (lambda t: t * t.sum().item(), r"\.item\(\)", {"sync"}),
    "cpu": (lambda t: t * t.sum().cpu(), r"\.cpu\(\)", {"sync", "host_copy"}),
    "print": (lambda t: print(t) or t * 2, r"print\(tensor\)", {"sync", "host_copy"}),
    "synchronize": (lambda t: torch.cuda.synchronize() or t * 2, r"synchroni", {"sync"}),
    "default_stream": (_on_default_stream, r"default \(legacy\) stream", {"legacy_stream"}),
    "manual_seed": (lambda t: torch.manual_seed(0) and nn.functional.dropout(t, 0.5),
                    r"seeded a random generator", {"rng_changed"}),
    "cuda_manual_seed": (lambda t: torch.cuda.manual_seed(torch.cuda.initial_seed() + 1)
                         or t * 2, r"seeded a random generator", {"seed_read", "rng_changed"}),
    "cpu_rand": (lambda t: t * torch.rand(()), r"host-side random numbers", {"rng_changed"}),
    # Note [Python's random numbers drawn during capture] (csrc/capture.c).
    "python_random": (lambda t: t * random.random(), r"would reuse that one draw", {"rng_changed"}),
    "numpy_random": (lambda t: t * float(_numpy().random.rand()), r"would reuse that one draw",
                     {"rng_changed"}),
}


def _numpy():
    return pytest.importorskip("numpy")


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_capture_failures_name_the_cause_and_leave_the_process_usable(case):
    body, advice, kinds = FAILURES[case]
    x = torch.randn(8, device=CUDA)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(cgraph.CaptureError, match=advice) as info:
        cgraph.make_graphed(body, (x,))
    assert info.value.__cause__ is not None
    assert info.value.kind in kinds, (info.value.kind, info.value.__cause__)
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved + (2 << 20), "the pool was not returned"
    # Eager work, RNG and a new capture all still work.
    assert_equal(x * 2, x + x, "eager after a failed capture")
    assert torch.nn.functional.dropout(x, 0.5).isfinite().all()
    graphed = cgraph.make_graphed(lambda t: t * 3, (x,))
    assert_equal(graphed(x), x * 3, "capture after a failed capture")


# ---- refusals with advice ---------------------------------------------------


@pytest.mark.parametrize("raised", [KeyboardInterrupt, torch.OutOfMemoryError])
def test_an_interrupt_or_out_of_memory_inside_a_capture_goes_on_as_raised(raised):
    """Ctrl-C during a capture must stop the program, and callers catch
    torch.OutOfMemoryError to try a smaller batch: neither becomes a
    CaptureError advising about syncs.  The process stays usable."""
    x, calls = torch.randn(8, device=CUDA), []

    def interrupted(t):
        calls.append(1)
        if len(calls) >= 2:  # the capture (after one warm-up call)
            raise raised("CUDA out of memory (planted)" if raised is not KeyboardInterrupt
                         else None)
        return t * 2

    with pytest.raises(raised) as info:
        cgraph.make_graphed(interrupted, (x,), num_warmup_iters=1)
    assert not isinstance(info.value, cgraph.CaptureError)
    graphed = cgraph.make_graphed(lambda t: t * 2, (x,))
    assert_equal(graphed(x), x * 2, "a capture after the interrupted one")


def test_a_host_output_is_refused_with_advice():
    x = torch.randn(8, device=CUDA)
    with pytest.raises(ValueError, match=r"output 0 of the callable is on cpu"):
        cgraph.make_graphed(lambda t: (t * 2).to("cpu", non_blocking=True), (x,))


def test_none_among_the_outputs_comes_back_in_place():
    """Note [None among the outputs] (cgraph/_describe.py): a None beside
    the tensors (a Hugging Face block's unused attention weights) is
    returned where the callable put it; other non-tensors stay refused."""
    x = torch.randn(8, device=CUDA, requires_grad=True)
    for graphed in (cgraph.make_graphed(lambda t: (t * 2, None, {"a": None, "b": t + 1}), (x,)),
                    cgraph.make_graphed_callables(lambda t: (t * 2, None), (x,))):
        out = graphed(x)
        assert out[1] is None and len(out) in (2, 3)
        assert_equal(out[0], x * 2, "the tensor beside None")
        if len(out) == 3:
            assert out[2]["a"] is None and list(out[2]) == ["a", "b"]
            assert_equal(out[2]["b"], x + 1, "the tensor in the dict")
        out[0].sum().backward()
        assert_equal(x.grad, torch.full_like(x, 2.0), "the grad through it")
        x.grad = None
    with pytest.raises(TypeError, match=r"output 1 \(counting tensors.*None is not counted\) "
                                        r"is a int.*return it as a tensor"):
        cgraph.make_graphed(lambda t: (t * 2, None, 3), (x,))


def test_a_replay_inside_another_capture_is_refused():
    """A launch cannot be recorded into another graph; torch.cuda.graph around
    a graphed callable fails with what to do, and the callable still works."""
    model, make_input = mlp()
    graphed = cgraph.make_graphed(model, (make_input(),))
    x = make_input()
    with pytest.raises(RuntimeError, match="call the eager callable"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            graphed(x)
    eager = copy.deepcopy(model)
    assert_equal(graphed(x), eager(x), "output after the refusal")


def test_reduce_overhead_inside_is_refused_with_advice():
    block = nn.Sequential(nn.Linear(64, 64), nn.GELU()).to(CUDA)
    compiled = torch.compile(block, mode="reduce-overhead")
    x = torch.randn(16, 64, device=CUDA, requires_grad=True)
    with pytest.raises(cgraph.CaptureError, match="max-autotune-no-cudagraphs") as info:
        cgraph.make_graphed(compiled, (x,))
    assert info.value.kind == "nested_graphs"
    assert_equal(block(x), block(x), "eager after the refusal")


def test_reentrant_region_reading_a_closure_leaf_is_refused_with_advice():
    """Its grad would be computed at capture only (Note [Backward capture
    runs .backward()])."""
    w = torch.randn(64, 64, device=CUDA, requires_grad=True)

    def f(x):
        return checkpoint(lambda t: torch.tanh(t @ w), x, use_reentrant=True)

    with pytest.raises(cgraph.CaptureError) as info:  # in warm-up, before any capture
        cgraph.make_graphed(f, (torch.randn(8, 64, device=CUDA, requires_grad=True),))
    assert info.value.kind == "reentrant_leaf" and "warming up callable 0" in str(info.value)
    text = f"{info.value} {info.value.__cause__}"
    assert "use_reentrant=True" in text and "nn.Parameter" in text, text
    # The process stays usable, reentrant regions included: a graphed step
    # equals the eager step from the same generator state.
    model = Checkpointed(0.25, use_reentrant=True).to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(32, 64, device=CUDA, requires_grad=True),))
    x, upstream = torch.randn(32, 64, device=CUDA), torch.randn(32, 64, device=CUDA)
    out, grad, rng = run_step(graphed, x.clone().requires_grad_(), upstream, seed=7)
    out_e, grad_e, rng_e = run_step(eager, x.clone().requires_grad_(), upstream, seed=7)
    assert_equal(out, out_e, "output after the refusal")
    assert_equal(grad, grad_e, "input grad after the refusal")
    assert_grads_equal(model, eager, "after the refusal")
    assert torch.equal(rng, rng_e), "the generator moved unlike eager"


# ---- parameters moved or replaced after capture -----------------------------


def test_moved_parameter_raises():
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),))
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="moved to new memory"):
        model(make_input())


def test_a_parameter_moved_between_forward_and_backward_raises_at_the_backward():
    """The backward graph reads the parameters too: memory freed between a
    call's forward and its backward (FSDP2's reshard of a module around the
    graphed one, .data = ...) would be read stale."""
    model, make_input = mlp()
    model = cgraph.make_graphed_callables(model, (make_input(),))
    out = model(make_input())
    model[0].weight.data = model[0].weight.data.clone()
    with pytest.raises(RuntimeError, match="not where the backward graph reads it"):
        out.sum().backward()


def test_load_state_dict_with_assign_raises_and_in_place_load_works():
    torch.manual_seed(0)
    model = stack()
    other = stack()
    x = torch.randn(16, 64, device=CUDA)
    graphed = cgraph.make_graphed_callables(model, (x,))
    model.load_state_dict(other.state_dict())  # in place: the graph sees it
    with torch.no_grad():
        assert_equal(graphed(x), other(x), "after an in-place load_state_dict")
    model.load_state_dict(stack().state_dict(), assign=True)
    with pytest.raises(RuntimeError, match=r"'0\.weight' of graphed module 0 .* replaced"):
        graphed(x)


def test_a_submodule_replaced_after_capture_raises():
    """A Dropout replaced by an Identity holds no tensor: before, the graphs
    went on dropping out.  A loss module attached under a new name passes."""
    model = nn.Sequential(nn.Linear(64, 64), nn.Dropout(0.5)).to(CUDA)
    x = torch.randn(16, 64, device=CUDA)
    graphed = cgraph.make_graphed(model, (x,))
    model.loss = nn.MSELoss()
    graphed(x)
    model[1] = nn.Identity()
    with pytest.raises(RuntimeError, match=r"submodule '1' of graphed module 0 .*replaced"):
        graphed(x)


def test_a_new_parameter_object_raises_but_unrelated_modules_do_not():
    model = stack()
    x = torch.randn(16, 64, device=CUDA)
    graphed = cgraph.make_graphed(model, (x,))
    nn.Linear(4, 4)  # parameters registered elsewhere: a re-check, which passes
    nn.ModuleList([model])[:1]  # held in a new list (Hugging Face's layers[:n]): a class check
    out = graphed(x)
    with torch.no_grad():
        assert_equal(out, model(x), "output after another module's parameters were made")
    model[2].bias = nn.Parameter(torch.zeros(64, device=CUDA))
    with pytest.raises(RuntimeError, match=r"'module\.2\.bias'|'2\.bias'"):
        graphed(x)

"""GPU tests of issue 5: what torch's make_graphed_callables refuses or gets
silently wrong, and cgraph handles: autocast with its cache, outputs of
earlier calls, capture failures, parameters replaced after capture.

Comparisons are bitwise unless a test states its tolerance."""

import copy

import pytest
import torch
from torch import nn

import cgraph
from _helpers import assert_equal

pytestmark = pytest.mark.gpu
CUDA = "cuda"


def stack(width=64, depth=3):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).to(CUDA)


# ---- autocast ------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_autocast_with_its_weight_cache_matches_eager_over_optimizer_steps(dtype):
    """torch refuses cache_enabled=True (the default).  With it, a graph that
    baked in a cached cast would keep using stale weights after each step;
    lr=0.05 moves the weights far outside the stated tolerance."""
    torch.manual_seed(0)
    eager = stack()
    graphed_model = copy.deepcopy(eager)
    x0 = torch.randn(16, 64, device=CUDA, requires_grad=True)
    with torch.autocast(CUDA, dtype=dtype):  # cache_enabled=True
        graphed = cgraph.make_graphed(graphed_model, (x0,))
    opt_e = torch.optim.SGD(eager.parameters(), lr=0.05)
    opt_g = torch.optim.SGD(graphed_model.parameters(), lr=0.05)
    first = None
    tol = dict(rtol=1.6e-2, atol=1e-3) if dtype == torch.bfloat16 else dict(rtol=1e-3, atol=1e-4)
    for step in range(4):
        x = torch.randn(16, 64, device=CUDA)
        upstream = torch.randn(16, 64, device=CUDA)
        outs = []
        for model, opt in ((eager, opt_e), (graphed, opt_g)):
            with torch.autocast(CUDA, dtype=dtype):
                out = model(x)
                loss = (out.float() * upstream).sum()
            loss.backward()
            outs.append(out.detach().clone())
            opt.step()
            opt.zero_grad()
        assert outs[1].dtype == dtype and outs[1].isfinite().all()
        torch.testing.assert_close(outs[1], outs[0], **tol, msg=f"step {step}: output")
        if step == 0:
            first = (x, outs[1])
        for (name, p), q in zip(graphed_model.named_parameters(), eager.parameters()):
            torch.testing.assert_close(p, q, **tol, msg=f"step {step}: {name} after the step")
    # The steps moved the output beyond the tolerance: a stale cast would show.
    with torch.autocast(CUDA, dtype=dtype):
        again = graphed(first[0])
    assert not torch.allclose(again, first[1], **tol)


def test_calling_outside_the_captured_autocast_raises():
    model = stack()
    x = torch.randn(16, 64, device=CUDA)
    with torch.autocast(CUDA, dtype=torch.bfloat16):
        graphed = cgraph.make_graphed(model, (x,))
        graphed(x)
    with pytest.raises(RuntimeError, match=r"captured with CUDA autocast enabled .*called with "
                                           r"it disabled"):
        graphed(x)
    with torch.autocast(CUDA, dtype=torch.float16):
        with pytest.raises(RuntimeError, match="dtype Half"):
            graphed(x)


# ---- outputs of earlier calls ------------------------------------------------------


def test_reading_an_overwritten_output_raises_and_the_latest_is_right():
    model = stack()
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),))
    x1, x2 = torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA)
    first = graphed(x1)
    view = first[0]
    kept = first.clone()
    second = graphed(x2)
    with torch.no_grad():
        assert_equal(second, model(x2), "latest output")
        assert_equal(kept, model(x1), "a clone taken before the next call")
    for stale in (first, view):
        with pytest.raises(RuntimeError, match="has replayed since"):
            stale.sum()


def test_unguarded_outputs_change_under_the_caller_as_in_torch():
    model = stack()
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),),
                                  guard_outputs=False)
    x1, x2 = torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA)
    first = graphed(x1)
    graphed(x2)
    with torch.no_grad():
        assert_equal(first, model(x2), "the first output, overwritten by the second call")


def test_feeding_an_output_back_as_input_matches_eager():
    cell = nn.Sequential(nn.Linear(64, 64), nn.Tanh()).to(CUDA)
    h0 = torch.randn(16, 64, device=CUDA)
    graphed = cgraph.make_graphed(cell, (h0.clone(),))
    h_graph, h_eager = h0, h0
    with torch.no_grad():
        for step in range(5):
            h_graph = graphed(h_graph)
            h_eager = cell(h_eager)
            assert_equal(h_graph, h_eager, f"step {step}")


# ---- capture failures --------------------------------------------------------------


def _on_default_stream(t):
    with torch.cuda.stream(torch.cuda.default_stream()):
        return t * 2


FAILURES = {
    "item": (lambda t: t * t.sum().item(), r"\.item\(\)"),
    "cpu": (lambda t: t * t.sum().cpu(), r"\.cpu\(\)"),
    "print": (lambda t: print(t) or t * 2, r"print\(tensor\)"),
    "synchronize": (lambda t: torch.cuda.synchronize() or t * 2, r"synchroni"),
    "default_stream": (_on_default_stream, r"default \(legacy\) stream"),
    "manual_seed": (lambda t: torch.manual_seed(0) and nn.functional.dropout(t, 0.5),
                    r"seeded a random generator"),
    "cuda_manual_seed": (lambda t: torch.cuda.manual_seed(torch.cuda.initial_seed() + 1)
                         or t * 2, r"seeded a random generator"),
    "cpu_rand": (lambda t: t * torch.rand(()), r"host-side random numbers"),
}


@pytest.mark.parametrize("case", sorted(FAILURES))
def test_capture_failures_name_the_cause_and_leave_the_process_usable(case):
    body, advice = FAILURES[case]
    x = torch.randn(8, device=CUDA)
    torch.cuda.empty_cache()
    reserved = torch.cuda.memory_reserved()
    with pytest.raises(cgraph.CaptureError, match=advice) as info:
        cgraph.make_graphed(body, (x,))
    assert info.value.__cause__ is not None
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    assert torch.cuda.memory_reserved() <= reserved + (2 << 20), "the pool was not returned"
    # Eager work, RNG and a new capture all still work.
    assert_equal(x * 2, x + x, "eager after a failed capture")
    assert torch.nn.functional.dropout(x, 0.5).isfinite().all()
    graphed = cgraph.make_graphed(lambda t: t * 3, (x,))
    assert_equal(graphed(x), x * 3, "capture after a failed capture")


def test_a_host_output_is_refused_with_advice():
    x = torch.randn(8, device=CUDA)
    with pytest.raises(ValueError, match=r"output 0 of the callable is on cpu"):
        cgraph.make_graphed(lambda t: (t * 2).to("cpu", non_blocking=True), (x,))


# ---- parameters replaced after capture --------------------------------------------------


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


def test_a_new_parameter_object_raises_but_unrelated_modules_do_not():
    model = stack()
    x = torch.randn(16, 64, device=CUDA)
    graphed = cgraph.make_graphed(model, (x,))
    nn.Linear(4, 4)  # registering parameters elsewhere triggers a re-check only
    graphed(x)
    model[2].bias = nn.Parameter(torch.zeros(64, device=CUDA))
    with pytest.raises(RuntimeError, match=r"'module\.2\.bias'|'2\.bias'"):
        graphed(x)

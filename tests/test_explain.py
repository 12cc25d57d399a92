"""cgraph.explain: a readiness report, never an exception.  A clean model is
ready (on the GPU) or has exactly one problem, that it runs on the CPU; each
kind of problem is found with its op and the user's line (marked `# @name`
in this file); the report reads well; the callable's exceptions are
reported and explain's misuse raises; random generators, buffers,
attributes and grads are left as found.  CPU tests run in CI; the GPU tests
repeat the kinds on CUDA tensors, where the host/GPU distinctions are real."""

import random

import pytest
import torch
from torch import nn

import cgraph
from cgraph import Explanation, Problem

SOURCE = open(__file__).read().splitlines()


def line_of(marker: str) -> int:
    """The line of this file marked `# @marker`."""
    lines = [n for n, text in enumerate(SOURCE, 1) if text.rstrip().endswith(f"# @{marker}")]
    assert len(lines) == 1, (marker, lines)
    return lines[0]


def found(report: Explanation, *, on_cpu: bool):
    """(kind, op, line) of each problem; on the CPU, after the first one,
    which must say the callable runs on the CPU."""
    problems = list(report.problems)
    if on_cpu:
        assert problems and problems[0].kind == "cpu_op", report
        assert "runs on the CPU" in problems[0].message
        problems = problems[1:]
    for p in problems:
        if p.line is not None:
            assert p.file == __file__, p
            assert p.where.startswith(f"{_shown(__file__)}:{p.line} in "), p
    return [(p.kind, p.op, p.line) for p in problems]


def _shown(path: str) -> str:
    import os
    here = os.getcwd() + os.sep
    return path[len(here):] if path.startswith(here) else path


class Block(nn.Module):
    """A clean model: scale, linear, norm, GELU, dropout, batch norm."""

    def __init__(self, width=16):
        super().__init__()
        self.scale = nn.Parameter(torch.ones(width))
        self.linear = nn.Linear(width, width)
        self.norm = nn.LayerNorm(width)
        self.drop = nn.Dropout(0.25)
        self.bn = nn.BatchNorm1d(width)

    def forward(self, x):
        h = x * self.scale  # @clean-first-op
        h = self.drop(nn.functional.gelu(self.norm(self.linear(h))))
        return self.bn(h) + x


# ---- CPU: a clean model, state left as found ---------------------------------


def test_a_clean_cpu_model_has_one_problem_it_runs_on_the_cpu():
    model = Block()
    x = torch.randn(8, 16, requires_grad=True)
    stats = model.bn.running_mean.clone(), model.bn.num_batches_tracked.clone()
    rng = torch.random.get_rng_state()
    report = cgraph.explain(model, (x,))
    assert report.device == "cpu" and not report.ok
    assert found(report, on_cpu=True) == []
    first = report.problems[0]
    assert (first.kind, first.op, first.line) == ("cpu_op", "aten.mul", line_of("clean-first-op"))
    assert "module.cuda()" in first.fix
    # Left as found: buffers, generator, grads, the module's attributes.
    assert torch.equal(model.bn.running_mean, stats[0])
    assert torch.equal(model.bn.num_batches_tracked, stats[1])
    assert torch.equal(torch.random.get_rng_state(), rng)
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    assert model.training


def test_buffers_and_attributes_replaced_are_put_back():
    class Replaces(nn.Module):
        def __init__(self):
            super().__init__()
            self.register_buffer("running", torch.zeros(4))

        def forward(self, x):
            self.running = self.running * 0.9 + x  # @state-buffer
            self.last = x * 2  # @state-attribute
            return x * self.running

    model = Replaces()
    running = model.running
    report = cgraph.explain(model, (torch.ones(4),))
    assert found(report, on_cpu=True) == [
        ("state", "Replaces.running =", line_of("state-buffer")),
        ("state", "Replaces.last =", line_of("state-attribute")),
    ]
    assert "copy_" in report.problems[1].fix
    assert model.running is running and torch.equal(running, torch.zeros(4))
    assert "last" not in model.__dict__


def test_what_only_the_first_call_does_is_warm_up_not_a_problem():
    """make_graphed warms up eagerly before capturing: lazy initialisation,
    even with a sync, is fine there."""
    class Lazy(nn.Module):
        table = None

        def forward(self, x):
            if self.table is None:
                self.table = torch.arange(4) * x.sum().item()
            return x * 2

    model = Lazy()
    report = cgraph.explain(model, (torch.ones(4),))
    assert found(report, on_cpu=True) == []
    assert "table" not in model.__dict__  # put back as found


# ---- CPU: one test per kind ----------------------------------------------------


def _item(x):
    return x * x.sum().item()  # @item


def _branch_on_tensor(x):
    if x.sum() > 0:  # @bool
        return x * 2
    return x * 3


def _to_cpu(x):
    return x.cpu() * 2  # @cpu


def _to_list(x):
    return x * len(x.tolist())  # @tolist


def _float(x):
    return x * float(x.max())  # @float


def _print(x):
    print(x)  # @print
    return x * 2


def _nonzero(x):
    return torch.nonzero(x).sum() + x  # @nonzero


def _equal(x):
    return x * 2 if torch.equal(x, x) else x  # @equal


def _manual_seed(x):
    torch.manual_seed(0)  # @manual_seed
    return x * 2


def _cuda_manual_seed(x):
    torch.cuda.manual_seed(0)  # @cuda_manual_seed
    return x * 2


def _cpu_rand(x):
    return x * torch.rand(())  # @cpu_rand


def _factory_without_device(x):
    return x + torch.zeros(8)  # @factory


def _factory_with_device(x):
    return x + torch.zeros(8, device=x.device, dtype=x.dtype)


def _synchronize(x):
    torch.cuda.synchronize()  # @synchronize
    return x * 2


def _raises(x):
    raise ValueError("no such layer")  # @raises


CPU_CASES = {
    "item": (_item, [("sync", "Tensor.item", "item")]),
    "bool": (_branch_on_tensor, [("sync", "Tensor.__bool__", "bool")]),
    "cpu": (_to_cpu, [("host_copy", "Tensor.cpu", "cpu")]),
    "tolist": (_to_list, [("sync", "Tensor.tolist", "tolist")]),
    "float": (_float, [("sync", "Tensor.__float__", "float")]),
    "print": (_print, [("sync", "Tensor.__repr__", "print")]),
    "nonzero": (_nonzero, [("sync", "aten.nonzero", "nonzero")]),
    "equal": (_equal, [("sync", "aten.equal", "equal")]),
    "manual_seed": (_manual_seed, [("rng_changed", "torch.manual_seed", "manual_seed")]),
    "cuda_manual_seed": (_cuda_manual_seed,
                         [("rng_changed", "torch.cuda.manual_seed", "cuda_manual_seed")]),
    "cpu_rand": (_cpu_rand, [("rng_changed", "torch.rand", "cpu_rand")]),
    "factory": (_factory_without_device, [("cpu_op", "torch.zeros", "factory")]),
    "factory_with_device": (_factory_with_device, []),
    "synchronize": (_synchronize, [("sync", "torch.cuda.synchronize", "synchronize")]),
    "raises": (_raises, [("error", "ValueError", "raises")]),
}


@pytest.mark.parametrize("case", sorted(CPU_CASES))
def test_each_kind_is_found_with_its_op_and_line_on_the_cpu(case, capsys):
    fn, expected = CPU_CASES[case]
    x = torch.randn(8)
    cpu_rng = torch.random.get_rng_state()
    report = cgraph.explain(fn, (x,))
    assert found(report, on_cpu=True) == [(k, op, line_of(m)) for k, op, m in expected]
    assert torch.equal(torch.random.get_rng_state(), cpu_rng)


def test_a_mask_is_found_in_the_forward_and_its_backward():
    def masked(x):
        return x[x > 0].sum()  # @mask

    report = cgraph.explain(masked, (torch.randn(8, requires_grad=True),))
    assert found(report, on_cpu=True) == [("sync", "aten.index", line_of("mask")),
                                          ("sync", "aten.index_put", line_of("mask"))]
    assert report.problems[2].message.startswith("in the backward: ")


class _ItemInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    def backward(ctx, grad):
        return grad * grad.sum().item()  # @backward-item


def test_a_sync_in_a_custom_backward_is_found_at_its_line():
    report = cgraph.explain(_ItemInBackward.apply, (torch.randn(8, requires_grad=True),))
    problems = found(report, on_cpu=True)
    assert problems == [("sync", "aten._local_scalar_dense", line_of("backward-item"))]
    assert report.problems[1].message.startswith("in the backward: ")


class _Alternates(nn.Module):
    """Python control flow on a call counter: a graph keeps one branch."""

    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        if self.calls % 2:
            return x * 2  # @odd-call
        return x + 1


class _Grows(nn.Module):
    def __init__(self):
        super().__init__()
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return x[: self.calls] * 2  # @grows


def test_control_flow_that_changes_between_calls_is_found():
    report = cgraph.explain(_Alternates(), (torch.randn(8),))
    assert found(report, on_cpu=True) == [("control_flow", "aten.mul", line_of("odd-call"))]
    assert "aten.add" in report.problems[1].message


def test_a_shape_that_changes_between_calls_is_found():
    report = cgraph.explain(_Grows(), (torch.randn(8),))
    assert found(report, on_cpu=True) == [("dynamic_shape", "aten.slice", line_of("grows"))]
    assert "[3] float32" in report.problems[1].message


def test_branches_that_agree_on_both_calls_are_not_control_flow():
    """The honest limit: explain compares two calls, it does not prove."""
    report = cgraph.explain(lambda x: x * 2 if random.random() < 2 else x + 1,
                            (torch.randn(8),))
    assert found(report, on_cpu=True) == []


class DynamicCache:
    """Like transformers' cache: the layer appends to it."""

    def __init__(self):
        self.keys = []


def test_arguments_that_are_not_tensors_or_constants_are_found():
    def layer(x, scale, past_key_values=None, helper=None):
        if past_key_values is not None:
            past_key_values.keys.append(x)
        return x * scale

    report = cgraph.explain(layer, (torch.randn(8), 2.0),
                            {"past_key_values": DynamicCache(), "helper": object()})
    arguments = [p for p in report.problems if p.kind == "argument"]
    assert [p.where for p in arguments] == ["argument 'past_key_values'", "argument 'helper'"]
    assert "use_cache=False" in arguments[0].fix
    assert "functools.partial" in arguments[1].fix
    assert found(report, on_cpu=True) == [("argument", "", None), ("argument", "", None)]


def test_module_hooks_are_no_problem():
    """The module's own hooks run around every call of its graphs."""
    model = nn.Linear(4, 4)
    model.register_forward_hook(lambda *_: None)
    report = cgraph.explain(model, (torch.randn(2, 4),))
    assert found(report, on_cpu=True) == []


def test_an_argument_that_requires_grad_written_in_place_is_found_and_put_back():
    """Written in place, an argument that needs no grad is no problem (each
    replay copies it back: Note [Arguments written in place]); one that
    requires grad is, as its static copy is a leaf."""
    def accumulate(total, x):
        total.add_(x)  # @input-mutation
        return x * 2

    total = torch.zeros(8)
    assert found(cgraph.explain(accumulate, (total, torch.ones(8))), on_cpu=True) == []

    def fill(cache, x):
        cache[:, 0] = x  # a view: counted, copied back
        return x * 2

    assert found(cgraph.explain(fill, (torch.zeros(4, 8), torch.ones(4))), on_cpu=True) == []

    def through_data(total, x):
        total.data.add_(x)  # @through-data
        return x * 2

    report = cgraph.explain(through_data, (torch.zeros(8), torch.ones(8)))
    assert found(report, on_cpu=True) == [
        ("input_mutation", "aten.add_", line_of("through-data"))]
    assert ".data" in report.problems[1].message

    def through_detach(total, x):
        total.detach().add_(x)  # detach() shares the counter: copied back
        return x * 2

    assert found(cgraph.explain(through_detach, (torch.zeros(8), torch.ones(8))),
                 on_cpu=True) == []
    # An argument whose elements share memory (transformers' expanded causal
    # mask) is read, never written: it is not put back (copy_ would raise).
    mask = torch.ones(1, 1, 4, 4).expand(2, 1, 4, 4)
    assert found(cgraph.explain(lambda x, m: x * m, (torch.ones(2, 1, 4, 4), mask)),
                 on_cpu=True) == []
    total = torch.zeros(8, requires_grad=True) * 1  # not a leaf: eager takes the write
    report = cgraph.explain(accumulate, (total, torch.ones(8)))
    assert found(report, on_cpu=True) == [
        ("input_mutation", "aten.add_", line_of("input-mutation"))]
    assert "'total'" in report.problems[1].message
    assert torch.equal(total, torch.zeros(8))


def test_an_argument_written_by_a_copy_or_a_slice_assignment_is_found():
    """A tensor that requires grad, filled in place (cache[:, pos] = x) or
    copied into (.copy_): both are aten.copy_, which explain read only for
    device moves."""
    def fill(cache, x):
        cache[:, 0] = x  # @slice-assigned
        return cache.sum(0)

    def copy(buf, x):
        buf.copy_(x)  # @copied
        return x * 2

    for fn, line in [(fill, "slice-assigned"), (copy, "copied")]:
        written = torch.zeros(4, 8) if fn is fill else torch.zeros(8)
        written = written.requires_grad_() * 1
        report = cgraph.explain(fn, (written, torch.ones(4) if fn is fill else torch.ones(8)))
        assert ("input_mutation", "aten.copy_", line_of(line)) in found(report, on_cpu=True)


def test_an_output_that_is_an_argument_is_found():
    report = cgraph.explain(lambda x, y: (x[0], y * 2), (torch.randn(8), torch.randn(8)))
    assert found(report, on_cpu=True) == [("output_alias", "", None)]
    assert report.problems[1].where == "output[0]"
    assert "x.clone()" in report.problems[1].fix


# ---- the report -------------------------------------------------------------


def test_the_report_reads_as_a_numbered_list_with_where_and_fix():
    report = cgraph.explain(_item, (torch.randn(8),))
    text = str(report)
    lines = text.splitlines()
    assert lines[0] == "cgraph.explain(_item): 2 problems to fix before graphing:"
    assert lines[1].startswith(" 1. [cpu_op] aten.sum at ")
    assert lines[4] == (f" 2. [sync] Tensor.item at {_shown(__file__)}:{line_of('item')} "
                        "in _item: return x * x.sum().item()  # @item")
    assert lines[5].startswith("    Tensor.item hands a tensor's value to Python")
    assert lines[6].startswith("    fix: keep the value on the GPU")
    assert len(lines) == 7
    assert repr(report) == ("<cgraph.Explanation of _item on cpu: 2 problems "
                            "['cpu_op', 'sync']>")
    ready = Explanation("f", (), "cuda")
    assert ready.ok and str(ready) == "cgraph.explain(f): ready to graph; no problem found."
    assert repr(ready) == "<cgraph.Explanation of f on cuda: ok>"
    assert isinstance(report.problems[1], Problem) and report.problems[1]._asdict()["fix"]


def test_the_same_problem_at_the_same_place_is_listed_once():
    def loop(x):
        for _ in range(3):
            x = x * x.sum().item()  # @loop
        return x

    assert found(cgraph.explain(loop, (torch.randn(8),)), on_cpu=True) == [
        ("sync", "Tensor.item", line_of("loop"))]


def test_misuse_of_explain_raises_like_make_graphed():
    with pytest.raises(TypeError, match=r"write \(x,\)"):
        cgraph.explain(nn.Linear(4, 4), torch.randn(2, 4))
    with pytest.raises(TypeError, match="sample_kwargs must be a dict"):
        cgraph.explain(nn.Linear(4, 4), (torch.randn(2, 4),), [1])
    with pytest.raises(TypeError, match="not callable"):
        cgraph.explain(3, ())


def test_patches_are_put_back():
    originals = (torch.manual_seed, torch.cuda.synchronize, torch.cuda.manual_seed,
                 nn.Module.__setattr__, torch.cuda.Stream.synchronize)
    cgraph.explain(_raises, (torch.randn(2),))
    assert (torch.manual_seed, torch.cuda.synchronize, torch.cuda.manual_seed,
            nn.Module.__setattr__, torch.cuda.Stream.synchronize) == originals
    assert not torch.is_anomaly_enabled()


# ---- GPU: the same, on CUDA tensors -----------------------------------------


def _cuda_ones(x):
    return x + torch.ones(8).to(x.device)  # @h2d


def _cuda_to_host(x):
    return x.to("cpu") * 2  # @to-cpu


def _cuda_tensor_from_data(x):
    return x + torch.tensor([1.0] * 8, device=x.device)  # @from-data


def _cuda_cpu_op(x):
    return x * torch.arange(8).sum().to(x.device)  # @cpu-op


def _cuda_cpu_output(x):
    return (x * 2).cpu()  # @cpu-output


GPU_CASES = {
    "item": (_item, [("sync", "Tensor.item", "item")]),
    "bool": (_branch_on_tensor, [("sync", "Tensor.__bool__", "bool")]),
    "tolist": (_to_list, [("sync", "Tensor.tolist", "tolist")]),
    "print": (_print, [("sync", "Tensor.__repr__", "print")]),
    "nonzero": (_nonzero, [("sync", "aten.nonzero", "nonzero")]),
    "equal": (_equal, [("sync", "aten.equal", "equal")]),
    # The copy, the op on its CPU result, and a CPU output.
    "to_cpu": (_to_cpu, [("host_copy", "Tensor.cpu", "cpu"), ("cpu_op", "aten.mul", "cpu"),
                         ("output", "", None)]),
    "to_host": (_cuda_to_host, [("host_copy", "Tensor.to", "to-cpu"),
                                ("cpu_op", "aten.mul", "to-cpu"), ("output", "", None)]),
    "h2d": (_cuda_ones, [("cpu_op", "aten.ones", "h2d"), ("host_copy", "aten._to_copy", "h2d")]),
    "from_data": (_cuda_tensor_from_data, [("host_copy", "torch.tensor", "from-data")]),
    "cpu_op": (_cuda_cpu_op, [("cpu_op", "aten.arange", "cpu-op"),
                              ("host_copy", "aten._to_copy", "cpu-op")]),
    "manual_seed": (_manual_seed, [("rng_changed", "torch.manual_seed", "manual_seed")]),
    "cuda_manual_seed": (_cuda_manual_seed,
                         [("rng_changed", "torch.cuda.manual_seed", "cuda_manual_seed")]),
    "cpu_rand": (_cpu_rand, [("rng_changed", "aten.rand", "cpu_rand")]),
    "synchronize": (_synchronize, [("sync", "torch.cuda.synchronize", "synchronize")]),
    "cpu_output": (_cuda_cpu_output, [("host_copy", "Tensor.cpu", "cpu-output"),
                                      ("output", "", None)]),
    "raises": (_raises, [("error", "ValueError", "raises")]),
    "written_back": (lambda x: x.mul_(2), [("output_alias", "", None)]),  # needs no grad
}


@pytest.mark.gpu
def test_a_clean_cuda_model_is_ready_and_left_as_found():
    model = Block().cuda()
    x = torch.randn(8, 16, device="cuda", requires_grad=True)
    stats = model.bn.running_mean.clone()
    cpu_rng, cuda_rng = torch.random.get_rng_state(), torch.cuda.get_rng_state()
    report = cgraph.explain(model, (x,))
    assert report.ok and report.problems == () and report.device == "cuda", str(report)
    assert str(report) == "cgraph.explain(Block): ready to graph; no problem found."
    assert torch.equal(model.bn.running_mean, stats)
    assert torch.equal(torch.random.get_rng_state(), cpu_rng)
    assert torch.equal(torch.cuda.get_rng_state(), cuda_rng)
    assert x.grad is None and all(p.grad is None for p in model.parameters())
    graphed = cgraph.make_graphed(model, (x,))  # and it does graph
    graphed(x).sum().backward()
    graphed.reset()


@pytest.mark.gpu
@pytest.mark.parametrize("case", sorted(GPU_CASES))
def test_each_kind_is_found_with_its_op_and_line_on_cuda(case, capsys):
    fn, expected = GPU_CASES[case]
    report = cgraph.explain(fn, (torch.randn(8, device="cuda"),))
    assert report.device == "cuda"
    assert found(report, on_cpu=False) == [
        (k, op, None if m is None else line_of(m)) for k, op, m in expected], str(report)


@pytest.mark.gpu
def test_control_flow_and_shapes_on_cuda():
    x = torch.randn(8, device="cuda", requires_grad=True)
    assert found(cgraph.explain(_Alternates().cuda(), (x,)), on_cpu=False) == [
        ("control_flow", "aten.mul", line_of("odd-call"))]
    assert found(cgraph.explain(_Grows().cuda(), (x,)), on_cpu=False) == [
        ("dynamic_shape", "aten.slice", line_of("grows"))]


@pytest.mark.gpu
def test_a_mask_and_a_backward_sync_on_cuda():
    x = torch.randn(8, device="cuda", requires_grad=True)

    def masked(t):
        return t[t > 0].sum()  # @cuda-mask

    assert found(cgraph.explain(masked, (x,)), on_cpu=False) == [
        ("sync", "aten.index", line_of("cuda-mask")),
        ("sync", "aten.index_put", line_of("cuda-mask"))]
    assert found(cgraph.explain(_ItemInBackward.apply, (x,)), on_cpu=False) == [
        ("sync", "aten._local_scalar_dense", line_of("backward-item"))]


@pytest.mark.gpu
def test_a_cpu_argument_of_a_cuda_callable_is_found():
    report = cgraph.explain(lambda x, s: x * s, (torch.randn(8, device="cuda"),
                                                 torch.tensor(2.0)))
    assert found(report, on_cpu=False) == [("argument", "", None)]
    assert report.problems[0].where == "argument 's'"

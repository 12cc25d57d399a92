"""Several graphs per callable (Note [Several graphs per callable] in
csrc/graphed.c): a call no graph takes captures one on the spot, graphs of
one callable share its pool, calls past max_graphs run eagerly and say so,
and a callable graphed without samples captures on its first call.
Comparisons are bitwise against eager PyTorch."""

import copy
import logging
import re

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import cgraph
from _helpers import (CUDA, assert_equal, assert_grads_equal, in_pool, inductor_deterministic,
                      square_loss_step, twin)

pytestmark = pytest.mark.gpu


def dropout_mlp(width=64):
    return nn.Sequential(nn.Linear(width, 128), nn.GELU(), nn.Dropout(0.25),
                         nn.Linear(128, width)).to(CUDA)


def train_step(model, opt, x, upstream, seed):
    torch.cuda.manual_seed(seed)
    opt.zero_grad(set_to_none=True)
    out = model(x)
    (out * upstream).sum().backward()
    opt.step()
    return out


def trains_as_eager(graphed, model, eager, steps, seed, momentum=0.0, before=None):
    """SGD steps of `graphed` (over `model`) and `eager` from one seed each:
    outputs, grads and buffers (BatchNorm's statistics) equal at every
    step.  `before(step)` runs ahead of each."""
    opts = [torch.optim.SGD(m.parameters(), lr=0.1, momentum=momentum) for m in (model, eager)]
    for step in range(steps):
        if before is not None:
            before(step)
        x, upstream = torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA)
        out = train_step(graphed, opts[0], x, upstream, seed=seed + step)
        out_e = train_step(eager, opts[1], x, upstream, seed=seed + step)
        assert_equal(out, out_e, f"step {step}: output")
        assert_grads_equal(model, eager, step)
        for (name, b), b_e in zip(model.named_buffers(), eager.buffers()):
            assert_equal(b, b_e, f"step {step}: buffer {name}")


def test_each_new_batch_size_captures_a_graph_and_every_step_matches_eager():
    """The short last batch of an epoch and an eval batch size: one graph
    each, dropout masks and Adam steps as eager's."""
    torch.manual_seed(40)
    model = dropout_mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(16, 64, device=CUDA),))
    opts = [torch.optim.Adam(m.parameters(), lr=1e-3) for m in (model, eager)]
    for step, rows in enumerate([16, 16, 5, 16, 5, 9]):
        x, upstream = torch.randn(rows, 64, device=CUDA), torch.randn(rows, 64, device=CUDA)
        out = train_step(graphed, opts[0], x, upstream, seed=step)
        out_e = train_step(eager, opts[1], x, upstream, seed=step)
        assert_equal(out, out_e, f"step {step} ({rows} rows): output")
        assert_grads_equal(model, eager, step)
    stats = graphed.stats
    assert stats["graphs"] == 3 and stats["forward"] == 6 and stats["backward"] == 6
    assert stats["eager_past_limit"] == 0 and stats["eager_pending"] == 0
    assert [s.tensors[0].shape[0] for s in graphed._graphed.specs] == [16, 5, 9]


def test_graphs_of_one_callable_share_its_pool():
    """A later graph reuses the activations' memory of the earlier ones (free
    blocks of the pool between replays): the pool grows by much less than
    the second graph needs on its own."""
    torch.manual_seed(41)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(CUDA)

    def reserved_by(build):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved()
        result = build()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        return result, torch.cuda.memory_reserved() - before

    big = torch.randn(2048, 1024, device=CUDA, requires_grad=True)
    small = torch.randn(1024, 1024, device=CUDA, requires_grad=True)
    graphed, _ = reserved_by(lambda: cgraph.make_graphed(model, (big,)))
    _, grown = reserved_by(lambda: graphed(small).sum().backward())
    alone, alone_size = reserved_by(lambda: cgraph.make_graphed(copy.deepcopy(model), (small,)))
    assert graphed.num_graphs == 2
    assert grown < 0.6 * alone_size, (grown, alone_size)


def test_graphs_of_one_callable_share_one_grad_store_per_parameter():
    """Note [One grad store per parameter]: a second graph adds no
    parameter-sized memory (a 4 MiB weight, tiny activations), and grads of
    two shapes in one step accumulate as eager's, across several steps."""
    torch.manual_seed(44)
    model = nn.Linear(1024, 1024).to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)  # captures on the first calls
    xs = [torch.randn(rows, 1024, device=CUDA) for rows in (2, 3, 2, 3, 2, 3)]
    graphed(xs[0]).sum().backward()  # warm-up calls, then the first graph
    for _ in range(3):
        graphed(xs[0]).sum().backward()
    model.zero_grad(set_to_none=True)
    before = torch.cuda.memory_allocated()
    graphed(xs[1]).sum().backward()  # the second graph
    grown = torch.cuda.memory_allocated() - before
    assert graphed.num_graphs == 2
    weight_bytes = model.weight.numel() * model.weight.element_size()
    assert grown < weight_bytes / 4, (grown, weight_bytes)
    for step in range(2):
        for m in (model, eager):
            m.zero_grad(set_to_none=True)
        for x in xs:
            (graphed(x) * 1.5).sum().backward()
            (eager(x) * 1.5).sum().backward()
        assert_grads_equal(model, eager, f"step {step}")


def test_a_later_graph_warms_up_in_the_pool_of_the_earlier_ones():
    """Note [Warm-up in the pool]: capturing a second shape reserves far
    less than the eager step its warm-up runs would on its own (its
    activations reuse the first graph's temporaries), and the results stay
    eager's."""
    torch.manual_seed(45)
    model = nn.Sequential(nn.Linear(1024, 4096), nn.GELU(), nn.Linear(4096, 1024)).to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(2048, 1024, device=CUDA),))
    x = torch.randn(1536, 1024, device=CUDA)

    def peak_growth(step):
        torch.cuda.synchronize()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_reserved()
        step()
        torch.cuda.synchronize()
        return torch.cuda.max_memory_reserved() - before

    eager_step = peak_growth(lambda: copy.deepcopy(eager)(x).sum().backward())
    model.zero_grad(set_to_none=True)
    eager.zero_grad(set_to_none=True)
    grown = peak_growth(lambda: graphed(x).sum().backward())
    assert graphed.num_graphs == 2
    assert grown < 0.5 * eager_step, (grown, eager_step)
    eager(x).sum().backward()
    assert_grads_equal(model, eager, "the capturing call")
    for step in range(2):
        for rows in (2048, 1536):
            y = torch.randn(rows, 1024, device=CUDA)
            assert_equal(graphed(y), eager(y), f"step {step}: {rows} rows")


class CachePerShape(nn.Module):
    """Keeps a tensor made on the first call with each batch size: state a
    warm-up makes and a replay of another shape's graph must not overwrite."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(64, 64)
        self.cache = {}

    def forward(self, x):
        rows = x.shape[0]
        if rows not in self.cache:
            self.cache[rows] = torch.arange(rows * 64, device=x.device).view(rows, 64) / 7.0
        return self.lin(x) * self.cache[rows]


def alternate_shapes_against_eager(model, eager, graphed, rows_seq):
    """Calls the graphed model and its eager twin with each row count in
    turn, outputs and grads compared bitwise."""
    for step, rows in enumerate(rows_seq):
        x = torch.randn(rows, 64, device=CUDA)
        out, want = graphed(x), eager(x)
        assert_equal(out, want, f"step {step}: {rows} rows")
        out.sum().backward()
        want.sum().backward()
        assert_grads_equal(model, eager, f"step {step}: {rows} rows")


def test_state_made_by_a_later_warm_up_is_moved_out_of_the_pool(caplog):
    """Note [Warm-up in the pool]: the cache made while warming up the
    second shape, in the first graph's pool, would sit in blocks the first
    graph overwrites; cgraph moves it to memory of its own, so no graph is
    dropped, and every result equals eager's."""
    torch.manual_seed(46)
    model = CachePerShape().to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(64, 64, device=CUDA),))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        alternate_shapes_against_eager(model, eager, graphed, (64, 48) * 3)
    assert not any("those graphs are dropped" in r.getMessage() for r in caplog.records)
    assert graphed.num_graphs == 2
    assert not in_pool(model.cache[48], graphed.pool)


class HistoryPerShape(CachePerShape):
    """Keeps, per batch size, a tensor that requires grad: its autograd
    history holds memory only C++ reaches (layer_norm's saved mean and rstd,
    never Python tensors)."""

    def forward(self, x):
        rows = x.shape[0]
        if rows not in self.cache:
            base = torch.arange(rows * 64, device=x.device).view(rows, 64) / 7.0
            self.cache[rows] = F.layer_norm(base * self.lin.bias[:1], (64,))
        return self.lin(x) * self.cache[rows].detach()


def test_state_only_cpp_holds_after_a_later_warm_up_drops_the_earlier_graphs(caplog):
    """Note [Warm-up in the pool]: memory a warm-up left in the pool that no
    Python tensor holds cannot be moved; the callable's earlier graphs there
    are dropped (captured again when their shape returns), logged, and every
    result equals eager's."""
    torch.manual_seed(47)
    model = HistoryPerShape().to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(64, 64, device=CUDA),))
    with caplog.at_level(logging.INFO, logger="cgraph"):
        alternate_shapes_against_eager(model, eager, graphed, (64, 48) * 3)
    assert any("those graphs are dropped" in r.getMessage() for r in caplog.records)
    assert graphed.num_graphs == 2


def test_past_max_graphs_calls_run_eagerly_logged_once(caplog):
    torch.manual_seed(42)
    model = dropout_mlp().eval()
    graphed = cgraph.make_graphed(model, (torch.randn(4, 64, device=CUDA),), max_graphs=2)
    with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
        for rows in (4, 5, 6, 7, 6):
            x = torch.randn(rows, 64, device=CUDA)
            assert_equal(graphed(x), model(x), f"{rows} rows")
    stats = graphed.stats
    assert stats["graphs"] == 2 and stats["eager_past_limit"] == 3
    limits = [r for r in caplog.records if "max_graphs=2" in r.getMessage()]
    assert len(limits) == 1 and limits[0].levelno == logging.WARNING
    assert "eager_past_limit" in limits[0].getMessage()
    assert any("captured graph 2" in r.getMessage() for r in caplog.records)


def test_captures_and_resets_are_logged_with_time_and_pool_memory(caplog):
    """What the log says: the first capture (time and pool memory), a later
    graph (its pool memory) and a reset (graphs and memory freed); the same
    for a graphed step."""
    torch.manual_seed(43)
    model = nn.Linear(32, 32).to(CUDA)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, fused=True)
    step = square_loss_step(model, opt)

    with caplog.at_level(logging.INFO, logger="cgraph"):
        graphed = cgraph.make_graphed(model, (torch.randn(8, 32, device=CUDA),))
        graphed(torch.randn(4, 32, device=CUDA)).sum().backward()
        graphed.reset()
        graphed_step = cgraph.make_graphed_step(step, (torch.randn(8, 32, device=CUDA),),
                                                num_warmup_iters=1)
        for _ in range(2):
            graphed_step(torch.randn(8, 32, device=CUDA))
        graphed_step.reset()
    text = "\n".join(r.getMessage() for r in caplog.records)
    number = r"[0-9]+\.[0-9]"
    for pattern in (rf"captured callable 0 \(Linear\) in {number}+ s; pool memory [1-9]",
                    rf"callable 0 \(Linear\): captured graph 2 for a call no graph takes "
                    rf"\(tensors \(4, 32\)\) in {number}+ s; its pools hold [1-9]",
                    r"callable 0 \(Linear\): reset: 2 graph\(s\) freed; their pools held [1-9]",
                    rf"GraphedStep\([^,]*step, .*\): captured in {number}+ s; its pool holds [1-9]",
                    r"GraphedStep\([^,]*step, .*\): reset: its graph freed"):
        assert re.search(pattern, text), (pattern, text)


def test_max_graphs_none_keeps_torch_rules():
    model = dropout_mlp()
    graphed = cgraph.make_graphed(model, (torch.randn(4, 64, device=CUDA),), max_graphs=None)
    with pytest.raises(ValueError, match=r"captured with shape \[4, 64\]"):
        graphed(torch.randn(5, 64, device=CUDA))
    with pytest.raises(ValueError, match="max_graphs must be a positive int"):
        cgraph.make_graphed(model, (torch.randn(4, 64, device=CUDA),), max_graphs=0)


def test_a_tensor_on_another_device_still_raises():
    graphed = cgraph.make_graphed(dropout_mlp(), (torch.randn(4, 64, device=CUDA),))
    with pytest.raises(ValueError, match="is on cpu, but the graphs run on cuda"):
        graphed(torch.randn(4, 64))


def test_constants_autocast_and_grad_mode_are_part_of_the_signature():
    torch.manual_seed(43)
    lin = nn.Linear(32, 32).to(CUDA)
    eager = copy.deepcopy(lin)

    def scaled(x, scale):
        return lin(x) * scale

    def scaled_e(x, scale):
        return eager(x) * scale

    graphed = cgraph.make_graphed(scaled, (torch.randn(8, 32, device=CUDA), 2.0))
    x = torch.randn(8, 32, device=CUDA, requires_grad=True)
    for scale in (2.0, 3.0, 2.0):
        assert_equal(graphed(x, scale), scaled_e(x, scale), f"scale {scale}")
    with torch.autocast("cuda", dtype=torch.bfloat16):
        assert_equal(graphed(x, 2.0), scaled_e(x, 2.0), "under autocast")
    with torch.no_grad():
        assert_equal(graphed(x, 2.0), scaled_e(x, 2.0), "under no_grad")
    # An input that requires grad unlike the sample: a graph with its grad.
    xe = twin(x)
    graphed(x, 2.0).sum().backward()
    scaled_e(xe, 2.0).sum().backward()
    assert_equal(x.grad, xe.grad, "grad of an input whose sample did not require grad")
    assert_grads_equal(lin, eager, "after the backward")
    # Graphs: scale 2.0, scale 3.0, autocast, and x requiring grad; the
    # no_grad call replays a graph captured with grad.
    assert graphed.num_graphs == 4 and graphed.stats["eager_past_limit"] == 0


def test_a_graph_captured_under_no_grad_is_not_replayed_with_grad():
    """An eval loop first, then training: the no_grad graph has no backward,
    so the training call gets a graph of its own."""
    torch.manual_seed(44)
    model = dropout_mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)
    x = torch.randn(8, 64, device=CUDA)
    with torch.no_grad():
        torch.cuda.manual_seed(0)
        out = graphed(x)
        torch.cuda.manual_seed(0)
        assert_equal(out, eager(x), "no_grad output")
    upstream = torch.randn(8, 64, device=CUDA)
    torch.cuda.manual_seed(1)
    (graphed(x) * upstream).sum().backward()
    torch.cuda.manual_seed(1)
    (eager(x) * upstream).sum().backward()
    assert_grads_equal(model, eager, "after the training call")
    assert graphed.num_graphs == 2


def test_eval_mode_gets_its_own_graph():
    torch.manual_seed(45)
    model = dropout_mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, (torch.randn(8, 64, device=CUDA),))
    x = torch.randn(8, 64, device=CUDA)
    for mode in ("eval", "train", "eval"):
        getattr(graphed, mode)()
        getattr(eager, mode)()
        torch.cuda.manual_seed(2)
        out = graphed(x).detach()  # else its backward stays pending: the next call
        torch.cuda.manual_seed(2)  # would need an instance of its own
        assert_equal(out, eager(x), f"{mode} output")
    assert graphed.num_graphs == 2 and graphed.stats["forward"] == 3


def test_a_submodule_switched_to_eval_after_capture_gets_its_own_graph():
    """Note [Submodules' modes in per-module graphs]: BatchNorm frozen
    (bn.eval()) while the model trains, then the dropout switched off: each
    combination of modes is a graph of its own, every step equal to eager
    (before, the replays kept the captured modes: batch statistics and
    running-stat updates, dropout on)."""
    torch.manual_seed(47)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.GELU(), nn.Dropout(0.25),
                          nn.Linear(128, 64)).to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)

    def switch(step):
        if step in (2, 4):
            for m in (model, eager):
                m[1 if step == 2 else 3].eval()

    trains_as_eager(graphed, model, eager, steps=6, seed=20, before=switch)
    assert graphed.num_graphs == 3 and graphed.stats["forward"] == 6


def test_a_parameter_unfrozen_after_capture_gets_a_graph_that_computes_its_grad():
    """A fine-tuning schedule: the first layer frozen while the rest trains,
    unfrozen at step 2 (the call captures a graph whose backward computes
    its grad), frozen again at step 4 (that graph replays, the grad
    dropped): every step equal to eager.  With max_graphs=None and samples
    the unfrozen call raises, naming the fix (before, every callable
    raised)."""
    torch.manual_seed(53)
    model = dropout_mlp()
    eager = copy.deepcopy(model)
    for m in (model, eager):
        m[0].requires_grad_(False)
    graphed = cgraph.make_graphed(model)

    def switch(step):
        if step in (2, 4):
            for m in (model, eager):
                m[0].requires_grad_(step == 2)

    trains_as_eager(graphed, model, eager, steps=6, seed=30, before=switch)
    assert graphed.num_graphs == 2 and graphed.stats["forward"] == 6

    frozen = dropout_mlp()
    frozen[0].requires_grad_(False)
    one = cgraph.make_graphed(frozen, (torch.randn(4, 64, device=CUDA),), max_graphs=None)
    frozen[0].requires_grad_(True)
    with pytest.raises(RuntimeError, match="did not at capture.*graph the callable again"):
        one(torch.randn(4, 64, device=CUDA))


def test_a_graph_captured_under_inference_mode_serves_calls_under_it_only():
    """A quick evaluation under inference_mode() before training, through a
    module graphed without samples: its graph (inference static tensors)
    replays for calls under inference_mode only.  A call under no_grad()
    with an argument ATen copies into the static input (not contiguous)
    raised torch's "Inplace update to inference tensor outside
    InferenceMode"; it now gets a graph of its own, as training does, every
    output eager's.  With max_graphs=None and samples such a call raises,
    naming the fix, as it does for a graph whose samples were made under
    inference_mode."""
    torch.manual_seed(59)
    model = dropout_mlp().eval()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)
    with torch.inference_mode():
        for _ in range(2):
            x = torch.randn(16, 64, device=CUDA)
            assert_equal(graphed(x), eager(x), "under inference_mode")
    x = torch.randn(64, 16, device=CUDA).t()
    with torch.no_grad():
        out = graphed(x)
        assert_equal(out, eager(x), "under no_grad()")
    assert not out.is_inference() and graphed.num_graphs == 2
    model.train()
    eager.train()
    trains_as_eager(graphed, model, eager, steps=3, seed=40)
    assert graphed.num_graphs == 3

    # One graph, torch's rules: captured under inference_mode, or outside it
    # with a sample made under it.
    under, made_under = dropout_mlp().eval(), dropout_mlp().eval()
    with torch.inference_mode():
        one = cgraph.make_graphed(under, (torch.randn(4, 64, device=CUDA),), max_graphs=None)
        sample = torch.randn(4, 64, device=CUDA)
    with torch.no_grad():
        other = cgraph.make_graphed(made_under, (sample,), max_graphs=None)
    for g in (one, other):
        with torch.no_grad(), pytest.raises(RuntimeError, match="captured under "
                                            r"torch.inference_mode\(\).*Call it under"):
            g(torch.randn(64, 4, device=CUDA).t())


class _Titan(nn.Module):
    """torchtitan's layout: the blocks in an nn.ModuleDict."""

    def __init__(self, dropout=0.1):
        super().__init__()
        self.layers = nn.ModuleDict({str(i): nn.Sequential(nn.Linear(64, 64), nn.GELU(),
                                                           nn.Dropout(dropout))
                                     for i in range(3)})

    def forward(self, x):
        for block in self.layers.values():
            x = block(x) + x
        return x


def test_graph_layers_trains_a_module_dict_of_blocks_as_eager():
    torch.manual_seed(49)
    model = _Titan().to(CUDA)
    eager = copy.deepcopy(model)
    assert cgraph.graph_layers(model) is model
    trains_as_eager(model, model, eager, steps=4, seed=30)
    assert all(block.forward.stats["forward"] == 4 for block in model.layers.values())


def test_graph_layers_trains_blocks_in_torchtitans_checkpoint_wrapper_as_eager():
    """torchtitan's activation checkpointing wraps each block
    (checkpoint_wrapper, non-reentrant); graphed, the recompute and its
    dropout masks run inside the backward graph, bitwise eager's."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    torch.manual_seed(51)
    model = _Titan().to(CUDA)
    for key, block in list(model.layers.items()):
        model.layers[key] = checkpoint_wrapper(block)
    eager = copy.deepcopy(model)
    cgraph.graph_layers(model)
    trains_as_eager(model, model, eager, steps=4, seed=40)
    assert all(block.forward.stats["backward"] == 4 for block in model.layers.values())


def test_graph_layers_trains_torchtitans_compiled_blocks_as_they_train_compiled():
    """torchtitan compiles each block and puts the OptimizedModule back in
    its ModuleDict: graph_layers graphs those, capturing the compiled
    kernels.  The eager twin's blocks compile apart, and may pick kernels
    1 ulp off (README, Limits): float32 tolerance, and Inductor without
    on-device benchmarking (this model's outputs grow to 1e4 in three SGD
    steps, so 1 ulp at step 0 broke that tolerance at step 2 on a GPU shared
    with other test processes; bitwise when alone)."""
    torch._dynamo.reset()
    torch.manual_seed(50)
    model = _Titan(dropout=0.0).to(CUDA)
    eager = copy.deepcopy(model)
    for m in (model, eager):
        for key, block in list(m.layers.items()):
            m.layers[key] = torch.compile(block)
    cgraph.graph_layers(model)
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, eager)]
    with inductor_deterministic():
        for step in range(3):
            x, upstream = torch.randn(16, 64, device=CUDA), torch.randn(16, 64, device=CUDA)
            out = train_step(model, opts[0], x, upstream, seed=step)
            out_e = train_step(eager, opts[1], x, upstream, seed=step)
            torch.testing.assert_close(out, out_e, msg=f"step {step}: output")
            for (name, p), q in zip(model.named_parameters(), eager.parameters()):
                torch.testing.assert_close(p, q, msg=f"step {step}: {name}")
    assert all(isinstance(block.forward, cgraph.Graphed) and block.forward.num_graphs == 1
               for block in model.layers.values())


def test_the_drop_in_runs_a_call_with_a_submodule_in_another_mode_eagerly():
    """With one graph (torch's rules), a submodule's other mode runs
    eagerly, as the module's own other mode does."""
    torch.manual_seed(48)
    model = dropout_mlp()
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed_callables(model, (torch.randn(8, 64, device=CUDA),),
                                            max_graphs=1)
    x = torch.randn(8, 64, device=CUDA)
    for m in (model, eager):
        next(k for k in m.modules() if isinstance(k, nn.Dropout)).eval()
    with torch.no_grad():
        assert_equal(graphed(x), eager(x), "output with the dropout in eval")
    assert graphed.forward.stats["forward"] == 0


def test_capture_on_first_call_equals_eager_from_the_first_step():
    """make_graphed(module) with no samples: the first call captures, on
    copies of its arguments, and replays; warm-up leaves grads, buffers and
    the random-number stream as they were, so every step (dropout masks,
    BatchNorm statistics, SGD) equals eager's."""
    torch.manual_seed(46)
    model = nn.Sequential(nn.Linear(64, 128), nn.BatchNorm1d(128), nn.GELU(), nn.Dropout(0.25),
                          nn.Linear(128, 64)).to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model)
    assert graphed.num_graphs == 0
    trains_as_eager(graphed, model, eager, steps=4, seed=10, momentum=0.9)
    assert graphed.num_graphs == 1 and graphed.stats["forward"] == 4


def test_random_stream_after_capture_is_the_one_eager_would_see():
    """Warm-up draws dropout masks; the generator is put back, so the next
    draw equals the one without graphing."""
    model, sample = dropout_mlp(), torch.randn(8, 64, device=CUDA)
    torch.cuda.manual_seed(3)
    expected = torch.rand(4, device=CUDA)
    torch.cuda.manual_seed(3)
    cgraph.make_graphed(model, (sample,))
    assert_equal(torch.rand(4, device=CUDA), expected, "the draw after graphing")


def test_a_dataloader_epoch_with_a_short_last_batch():
    torch.manual_seed(47)
    model = dropout_mlp().eval()
    graphed = cgraph.make_graphed(model)
    data = torch.utils.data.TensorDataset(torch.randn(10, 64))
    with torch.no_grad():
        for (x,) in torch.utils.data.DataLoader(data, batch_size=4, drop_last=False):
            x = x.to(CUDA)
            assert_equal(graphed(x), model(x), f"batch of {len(x)}")
    assert graphed.num_graphs == 2  # 4 rows, then 2


def test_graphed_together_callables_capture_new_shapes_in_their_own_pools():
    """Graphed together, callables share one pool; a later graph of one of
    them stays out of it (it could reuse memory another callable's pending
    backward needs) and the per-layer chain still matches eager."""
    torch.manual_seed(48)
    layers = [nn.Sequential(nn.Linear(64, 64), nn.GELU()).to(CUDA) for _ in range(3)]
    eager = copy.deepcopy(layers)
    samples = [torch.randn(8, 64, device=CUDA, requires_grad=True) for _ in layers]
    graphed = cgraph.make_graphed_callables(tuple(layers), tuple((s,) for s in samples),
                                            max_graphs=4)
    for rows in (8, 3, 8, 3):
        x = torch.randn(rows, 64, device=CUDA, requires_grad=True)
        xe = twin(x)
        h, h_e = x, xe
        for g, e in zip(graphed, eager):
            h, h_e = g(h), e(h_e)
        upstream = torch.randn_like(h)
        (h * upstream).sum().backward()
        (h_e * upstream).sum().backward()
        assert_equal(x.grad, xe.grad, f"{rows} rows: input grad")
        for g, e in zip(graphed, eager):
            assert_grads_equal(g, e, rows)
    first_pool = graphed[0].forward.pool
    for g in graphed:
        specs, pools = g.forward.specs, g.forward.pools
        assert len(specs) == 2
        assert pools[0] == first_pool and first_pool not in pools[1:], pools


class FakeCache:
    """What transformers passes as past_key_values with use_cache=True."""

    def __init__(self):
        self.layers = []


def test_a_call_with_a_cache_runs_eagerly_and_samples_with_one_are_refused():
    """A call carrying a cache (generate() through graphed layers) runs
    eagerly, appending as eager does, counted in eager_on_miss; samples
    carrying one are refused, naming the fix."""
    layer = nn.Linear(64, 64).to(CUDA)

    def block(x, past_key_values=None):
        if past_key_values is not None:
            past_key_values.layers.append(x)
        return layer(x)

    graphed = cgraph.make_graphed(block)
    x, cache = torch.randn(4, 64, device=CUDA), FakeCache()
    with torch.no_grad():
        assert_equal(graphed(x, past_key_values=cache), layer(x), "the eager call's output")
    assert len(cache.layers) == 1 and graphed.num_graphs == 0
    assert graphed.stats["eager_on_miss"] == 1, graphed.stats
    with pytest.raises(TypeError, match="past_key_values.*FakeCache.*use_cache=False"):
        cgraph.make_graphed(block, (x,), sample_kwargs={"past_key_values": FakeCache()})


# ---- buckets ------------------------------------------------------------------
# Padding changes the GEMMs' shapes, so cuBLAS may pick other kernels than
# eager's for the real rows: outputs and grads are compared with
# torch.testing.assert_close's float32 tolerances (rtol 1.3e-6, atol 1e-5).


def test_buckets_pad_rows_and_slice_outputs_back():
    torch.manual_seed(49)
    model = nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 16)).to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, buckets=[8, 16])
    for rows in (5, 8, 12, 3, 16, 20):
        x = torch.randn(rows, 32, device=CUDA, requires_grad=True)
        xe = twin(x)
        out, out_e = graphed(x), eager(xe)
        assert out.shape == (rows, 16)
        torch.testing.assert_close(out, out_e)
        upstream = torch.randn(rows, 16, device=CUDA)
        (out * upstream).sum().backward()
        (out_e * upstream).sum().backward()
        torch.testing.assert_close(x.grad, xe.grad)
        for p, q in zip(model.parameters(), eager.parameters()):
            torch.testing.assert_close(p.grad, q.grad)
    # Buckets 8 and 16, and 20 rows above the largest: a graph of its own.
    assert graphed.num_graphs == 3 and graphed.stats["eager_past_limit"] == 0


def test_buckets_along_the_sequence_of_a_causal_block():
    """Positions after the real ones cannot change them under causal
    attention: padding the sequence is exact for the real positions."""
    torch.manual_seed(50)

    class Causal(nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv = nn.Linear(32, 96)

        def forward(self, x):
            b, t, _ = x.shape
            q, k, v = self.qkv(x).view(b, t, 3, 2, 16).permute(2, 0, 3, 1, 4)
            y = nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)
            return y.transpose(1, 2).reshape(b, t, 32)  # outputs sliced along dim 1 too

    model = Causal().to(CUDA)
    eager = copy.deepcopy(model)
    graphed = cgraph.make_graphed(model, buckets={1: [16, 32]})
    for length in (12, 16, 30):
        x = torch.randn(2, length, 32, device=CUDA)
        torch.testing.assert_close(graphed(x), eager(x))
    assert graphed.num_graphs == 2


def test_buckets_refuse_batchnorm_in_training_mode():
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16)).to(CUDA)
    graphed = cgraph.make_graphed(model, buckets=[8])
    with pytest.raises(ValueError, match="BatchNorm in training mode.*mix the rows"):
        graphed(torch.randn(5, 16, device=CUDA))
    graphed.eval()
    with torch.no_grad():
        x = torch.randn(5, 16, device=CUDA)
        torch.testing.assert_close(graphed(x), model(x))


def test_repr_says_what_the_graphs_are():
    graphed = cgraph.make_graphed(dropout_mlp().eval())
    assert "no graph yet" in repr(graphed)
    with torch.no_grad():
        graphed(torch.randn(8, 64, device=CUDA))
        graphed(torch.randn(4, 64, device=CUDA))
    text = repr(graphed)
    assert ("Graphed of Sequential: 2 graphs [(8, 64)] [(4, 64)], 2 replays, 0 eager calls"
            in text), text
    assert "pool memory" in text and "MiB" in text
    def double(x):
        return x * 2

    doubled = cgraph.make_graphed(double, (torch.randn(3, device=CUDA),))
    expected = f"<cgraph.Graphed of {double.__qualname__}: 1 graph [(3,)], 0 replays"
    assert repr(doubled).startswith(expected), repr(doubled)
    graphed.reset()
    assert "reset" in repr(graphed)


def test_a_long_set_up_shows_a_progress_bar(capsys, monkeypatch):
    pytest.importorskip("tqdm")
    from cgraph import _log
    import time

    monkeypatch.setattr(_log, "_interactive", lambda: True)

    def slow(x):
        time.sleep(0.15)
        return x * 2

    layers = (slow, slow)
    cgraph.make_graphed_callables(layers, ((torch.randn(4, device=CUDA),),) * 2)
    assert "cgraph: graphing 2 callables" in capsys.readouterr().err


def test_transformer_encoder_layers_take_nested_tensors_in_evaluation_eagerly(caplog):
    """nn.TransformerEncoder in evaluation, a padding mask given, turns its
    batch into a nested tensor for its layers' fast path: a graphed layer
    runs such a call eagerly (logged), as its eager twin does, and training
    and evaluation calls without a mask replay; with buckets too.  Before,
    matching the call to the evaluation graph (its other arguments alike)
    read the nested tensor's sizes, which it has none of (torch's internal
    error).  A layer graphed by torch's rules (samples, max_graphs=None)
    raises, naming the fix."""
    torch.manual_seed(23)
    layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0, batch_first=True)
    eager = nn.TransformerEncoder(layer, 2, enable_nested_tensor=True).to(CUDA)
    x = torch.randn(4, 10, 32, device=CUDA)
    mask = torch.zeros(4, 10, dtype=torch.bool, device=CUDA)
    mask[1:, 7:] = True
    for buckets in (None, {1: [16]}):
        model = copy.deepcopy(eager)
        cgraph.graph_layers(model, buckets=buckets)
        for _ in range(2):
            for net in (model, eager):
                net.train()
            assert_equal(model(x, src_key_padding_mask=mask),
                         eager(x, src_key_padding_mask=mask), f"training output, {buckets}")
            for net in (model, eager):
                net.eval()
            with caplog.at_level(logging.INFO, logger="cgraph"), torch.no_grad():
                assert_equal(model(x), eager(x), f"evaluation output, no mask, {buckets}")
                assert_equal(model(x, src_key_padding_mask=mask),
                             eager(x, src_key_padding_mask=mask),
                             f"evaluation output, {buckets}")
        assert any("nested tensor" in r.getMessage() for r in caplog.records)
        forward = model.layers[0].forward  # a Bucketed around the graphs, with buckets
        assert getattr(forward, "graphed", forward).stats["eager_on_miss"] == 2, buckets
    one = cgraph.make_graphed(copy.deepcopy(layer).to(CUDA).eval(), (x,), max_graphs=None)
    with pytest.raises(ValueError, match="is a nested tensor.*max_graphs of 1 or more"):
        one(torch.nested.nested_tensor([x[0, :7], x[1]]))


def test_a_callable_graphed_inside_an_outer_checkpoint_is_refused_naming_the_fix():
    """torch.utils.checkpoint (use_reentrant=False) around a graphed block
    that captures on its first call: its warm-up's backwards would save
    through the checkpoint's hooks, and the recompute calls the block again
    eagerly (torch's "different number of tensors" CheckpointError, as a
    CaptureError advising about syncs).  Refused, naming checkpoint_wrapper;
    the block still runs eagerly outside."""
    from torch.utils.checkpoint import checkpoint
    torch.manual_seed(29)
    block = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to(CUDA)
    graphed = cgraph.make_graphed(block)
    x = torch.randn(4, 16, device=CUDA, requires_grad=True)
    with pytest.raises(ValueError, match=r"inside torch.utils.checkpoint.*checkpoint_wrapper"):
        checkpoint(graphed, x, use_reentrant=False)
    with torch.autograd.graph.save_on_cpu(), pytest.raises(ValueError, match="save_on_cpu"):
        graphed(x)
    assert_equal(graphed(x), block(x), "a call outside after the refusals")

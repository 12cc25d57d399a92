"""The workloads, and the variants that run their training step.

A workload is a model, its inputs (already on the device, the same every step)
and one training step:

* ``overhead-L``: L x ``Linear(16, 16)`` in a Sequential, input (8, 16) that
  requires grad; step ``model(x).sum().backward()`` (grads accumulate, no
  optimizer).  The kernels are tiny, so the step time is launch and framework
  overhead.
* ``mlp``: 784 -> 8 x [Linear(., 512), ReLU, Dropout(0.1)] -> Linear(512, 10),
  batch 64, Adam(lr=1e-3, fused=True), cross-entropy.
* ``gpt-N``: N pre-LN transformer blocks (d=256, 4 heads, T=128, vocab 1024,
  learned position embedding), batch 4, AdamW(lr=1e-3, fused=True),
  cross-entropy over the vocab.

The mlp and gpt steps are ``opt.zero_grad(set_to_none=True);
cross_entropy(model(x), y).backward(); opt.step()``.  Their optimizers are
the fused implementations, as torchtitan configures by default and as
Megatron's FusedAdam does: a step of a few kernel launches rather than
several Python-driven multi-tensor ops (the foreach default costs about
0.5 ms of host time per step on the H200 hosts, more than a graphed
forward and backward of these models).  Every variant runs the same
optimizer; the floor's is also ``capturable=True``.

A variant is how that step runs (:func:`prepare`): ``eager``;
``compile-default`` and ``compile-reduce-overhead`` (``torch.compile`` of the
model); ``torch-mgc-*`` and ``cgraph-*`` (``make_graphed_callables`` of torch
or cgraph on the whole model or on each layer, loss and optimizer outside);
``floor`` (raw ``torch.cuda.graph`` captures replayed with no autograd around
them: the least a step can cost); ``floor-eager-opt`` (mlp, gpt: forward,
loss and backward as one raw graph, then the same eager optimizer step as
every graphed variant); ``floor-eager-loss`` (mlp, gpt: the model's forward
and backward as two raw graphs with the eager loss and its autograd
backward between them, then the eager optimizer: the least a step costs
when only the model is graphed, as in the ``*-whole`` variants).  Neither
eager-part floor runs ``zero_grad``: their grads are the graphs' own.

``cgraph-step`` (mlp, gpt: the step as the user writes it, zero_grad,
loss, backward and the optimizer as built, through
``cgraph.make_graphed_step``: one graph, the inputs copied in each step) is
the one to hold against ``floor`` and ``floor-copies`` (the floor plus a
``copy_`` of each input into the graph's static copy before the replay).

``compile-reduce-overhead`` fails on the overhead workloads, by torch's
design: their step accumulates ``.grad`` across steps, and under
cudagraph trees those grads are outputs of the backward graph that its
next replay overwrites, so torch raises "accessing tensor output of
CUDAGraphs that has been overwritten" at the second step
(``torch.compiler.cudagraph_mark_step_begin()`` per step does not change
that).  cgraph accumulates them as eager mode does.
"""

from __future__ import annotations

import functools
import itertools
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

VARIANTS = (
    "eager",
    "compile-default",
    "compile-reduce-overhead",
    "torch-mgc-whole",
    "torch-mgc-layer",
    "cgraph-whole",
    "cgraph-whole-unguarded",
    "cgraph-whole-shapes",
    "cgraph-layer",
    "cgraph-step",
    "cgraph-compiled-step",
    "cgraph-step-amp",
    "cgraph-step-amp-fused",
    "cgraph-step-sgd",
    "cgraph-step-sgd-fused",
    "floor",
    "floor-copies",
    "floor-eager-opt",
    "floor-eager-loss",
)
# cgraph-whole-unguarded: guard_outputs=False, to measure what guarding the
# outputs of earlier calls costs (csrc/aten_replay.cpp, Note [Outputs of
# earlier calls]).  cgraph-whole-shapes: max_graphs=8, the call path that
# looks a graph up among several (Note [Several graphs per callable] in
# csrc/graphed.c), here with one graph: what the lookup costs.
_WHOLE_SCALING = ("eager", "torch-mgc-whole", "cgraph-whole", "cgraph-whole-unguarded",
                  "cgraph-whole-shapes", "floor")
_LAYER_SCALING = ("eager", "torch-mgc-layer", "cgraph-layer", "floor")
# cgraph-compiled-step: each transformer block (gpt) or the whole model (mlp)
# torch.compile'd (default mode) inside the graphed step.  cgraph-step-amp:
# float16 autocast, a GradScaler and SGD with momentum as most AMP scripts
# build it (not fused: the scaler's skip is a conditional node, Note
# [GradScaler with any optimizer] in cgraph/_step.py); cgraph-step-amp-fused:
# the same with SGD(fused=True), whose kernels take found_inf themselves.
# cgraph-step-sgd and -sgd-fused: the same two optimizers in float32 without
# a scaler, to tell what the unfused optimizer costs from what the scaler's
# skip costs.
_SGD_STEPS = ("amp", "amp-fused", "sgd", "sgd-fused")
_STEP_VARIANTS = ("cgraph-step", "cgraph-compiled-step",
                  *(f"cgraph-step-{kind}" for kind in _SGD_STEPS))
# The eager-part floors need a loss and an optimizer step, which the overhead
# step has not.
_NO_OPTIMIZER = tuple(v for v in VARIANTS
                      if v not in ("floor-copies", "floor-eager-opt", "floor-eager-loss",
                                   *_STEP_VARIANTS))

# torch.compile compiles (and reduce-overhead records its graphs) during the
# first steps; setup time covers this many.
COMPILE_STEPS = 3
# Side-stream warm-up iterations before a raw capture, as in the PyTorch docs.
FLOOR_WARMUP_ITERS = 3


@dataclass(frozen=True)
class Workload:
    """One row group of the results: a model family at one size.

    ``torch_ref`` is the variant that the "vs torch" ratios divide by.
    """

    name: str
    family: str
    size: int
    variants: tuple[str, ...]
    torch_ref: str = "torch-mgc-whole"


WORKLOADS = {
    w.name: w
    for w in (
        Workload("overhead-8", "overhead", 8, _WHOLE_SCALING),
        Workload("overhead-32", "overhead", 32, _NO_OPTIMIZER),
        Workload("overhead-128", "overhead", 128, _WHOLE_SCALING),
        Workload("mlp", "mlp", 8, VARIANTS),
        Workload("gpt-6", "gpt", 6, VARIANTS),
        Workload("gpt-24", "gpt", 24, (*_LAYER_SCALING, "compile-reduce-overhead",
                                       "cgraph-step", "cgraph-compiled-step"),
                 torch_ref="torch-mgc-layer"),
    )
}


def smallest_workloads() -> list[str]:
    """The smallest size of each family, in catalogue order (``--quick``)."""
    smallest: dict[str, Workload] = {}
    for w in WORKLOADS.values():
        if w.family not in smallest or w.size < smallest[w.family].size:
            smallest[w.family] = w
    return [w.name for w in smallest.values()]


# ---- models and inputs ---------------------------------------------------------


class Block(nn.Module):
    """Pre-LN transformer block: causal self-attention, then an MLP, each
    around a residual."""

    def __init__(self, d: int, heads: int):
        super().__init__()
        self.heads = heads
        self.ln1 = nn.LayerNorm(d)
        self.qkv = nn.Linear(d, 3 * d)
        self.proj = nn.Linear(d, d)
        self.ln2 = nn.LayerNorm(d)
        self.mlp = nn.Sequential(nn.Linear(d, 4 * d), nn.GELU(), nn.Linear(4 * d, d))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        qkv = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, d // self.heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (b, heads, t, d / heads)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, d))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned position embedding, ``blocks`` x :class:`Block`,
    final LayerNorm and LM head.  Takes token ids (batch, T), returns logits."""

    def __init__(self, blocks: int, vocab: int, d: int, heads: int, context: int):
        super().__init__()
        self.tok = nn.Embedding(vocab, d)
        self.pos = nn.Embedding(context, d)
        self.blocks = nn.Sequential(*(Block(d, heads) for _ in range(blocks)))
        self.ln_f = nn.LayerNorm(d)
        self.head = nn.Linear(d, vocab)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos.weight[: idx.shape[1]]
        return self.head(self.ln_f(self.blocks(x)))


@dataclass
class Problem:
    """A built workload: the model and inputs on their device, and what the
    variants need to run its step."""

    model: nn.Module
    x: torch.Tensor
    y: torch.Tensor | None  # targets; None for the backward-only overhead step
    optimizer: Callable[..., torch.optim.Optimizer] | None  # factory(params, **kwargs)
    layers: tuple[nn.Module, ...]  # graphed one by one by the *-layer variants
    layer_samples: Callable[[], tuple[tuple[torch.Tensor], ...]]  # their sample args


def _overhead(layers: int, device: str) -> Problem:
    randn = functools.partial(torch.randn, device=device)
    model = nn.Sequential(*(nn.Linear(16, 16) for _ in range(layers))).to(device)
    return Problem(
        model=model,
        x=randn(8, 16, requires_grad=True),
        y=None,
        optimizer=None,
        layers=tuple(model),
        layer_samples=lambda: tuple((randn(8, 16, requires_grad=True),)
                                    for _ in range(layers)),
    )


def _mlp(blocks: int, device: str) -> Problem:
    randn = functools.partial(torch.randn, device=device)
    widths = [784] + [512] * blocks
    model = nn.Sequential(
        *(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Dropout(0.1))
          for i, o in itertools.pairwise(widths)),
        nn.Linear(512, 10),
    ).to(device)
    return Problem(
        model=model,
        x=randn(64, 784),
        y=torch.randint(0, 10, (64,), device=device),
        optimizer=functools.partial(torch.optim.Adam, lr=1e-3, fused=True),
        layers=tuple(model),
        # The model input needs no grad; later layers receive activations.
        layer_samples=lambda: ((randn(64, 784),),)
        + tuple((randn(64, 512, requires_grad=True),) for _ in range(blocks)),
    )


def _gpt(blocks: int, device: str, vocab: int = 1024, d: int = 256, heads: int = 4,
         context: int = 128, batch: int = 4) -> Problem:
    model = GPT(blocks, vocab, d, heads, context).to(device)
    return Problem(
        model=model,
        x=torch.randint(0, vocab, (batch, context), device=device),
        y=torch.randint(0, vocab, (batch, context), device=device),
        optimizer=functools.partial(torch.optim.AdamW, lr=1e-3, fused=True),
        layers=tuple(model.blocks),  # embeddings, final LayerNorm and head stay eager
        layer_samples=lambda: tuple((torch.randn(batch, context, d, device=device,
                                                 requires_grad=True),)
                                    for _ in range(blocks)),
    )


_FAMILIES = {"overhead": _overhead, "mlp": _mlp, "gpt": _gpt}


def build(workload: Workload, device: str = "cuda") -> Problem:
    """The workload's model and inputs on ``device``, seeded.  (The
    benchmark runs on CUDA; the tests build on CPU to check shapes.)"""
    torch.manual_seed(0)
    return _FAMILIES[workload.family](workload.size, device)


# ---- variants ------------------------------------------------------------------


def prepare(problem: Problem, variant: str) -> Callable[[], object]:
    """Set ``variant`` up on ``problem`` and return its training step.

    Everything a variant does before its first timed step happens here, so
    the time of this call (synchronized) is the variant's setup time: graph
    warm-up and capture, or ``COMPILE_STEPS`` steps for torch.compile.
    """
    if variant not in VARIANTS:
        raise ValueError(f"unknown variant {variant!r}; the variants are {', '.join(VARIANTS)}")
    if variant == "floor":
        return _floor(problem)
    if variant == "floor-copies":
        return _floor_whole_step(problem, copy_inputs=True)
    if variant == "floor-eager-opt":
        return _floor_eager_optimizer(problem)
    if variant == "floor-eager-loss":
        return _floor_eager_loss(problem)
    if variant in _STEP_VARIANTS:
        suffix = variant.removeprefix("cgraph-step-")
        return _cgraph_step(problem, compiled=variant == "cgraph-compiled-step",
                            sgd=suffix if suffix in _SGD_STEPS else None)
    step = _train_step(problem, _forward(problem, variant))
    if variant.startswith("compile-"):
        for _ in range(COMPILE_STEPS):
            step()
    return step


def _forward(problem: Problem, variant: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """What the step calls as its forward under ``variant``."""
    model = problem.model
    if variant == "eager":
        return model
    if variant.startswith("compile-"):
        return torch.compile(model, mode=variant.removeprefix("compile-"))
    guarded = not variant.endswith("-unguarded")
    shapes = variant.endswith("-shapes")
    library, scope = variant.removesuffix("-unguarded").removesuffix("-shapes").rsplit("-", 1)
    make_graphed_callables = _graphing_function(library, guarded)
    if shapes:
        make_graphed_callables = functools.partial(make_graphed_callables, max_graphs=8)
    if scope == "whole":
        sample = problem.x.detach().clone().requires_grad_(problem.x.requires_grad)
        return make_graphed_callables(model, (sample,))
    # Modules come back themselves with forward replaced, so the model now
    # runs each layer through its graphs.
    make_graphed_callables(problem.layers, problem.layer_samples())
    return model


def _graphing_function(library: str, guard_outputs: bool) -> Callable:
    if library == "torch-mgc":
        return torch.cuda.make_graphed_callables
    import cgraph  # not built: this variant fails alone, as an error row

    return functools.partial(cgraph.make_graphed_callables, guard_outputs=guard_outputs)


def _loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.flatten(0, -2), y.flatten())


def _train_step(problem: Problem, forward: Callable) -> Callable[[], None]:
    x, y = problem.x, problem.y
    if problem.optimizer is None:

        def step() -> None:
            forward(x).sum().backward()

        return step
    opt = problem.optimizer(problem.model.parameters())

    def step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(forward(x), y).backward()
        opt.step()

    return step


def _cgraph_step(problem: Problem, compiled: bool = False,
                 sgd: str | None = None) -> Callable[[], object]:
    """The mlp and gpt step, unchanged, through ``cgraph.make_graphed_step``;
    set-up runs its eager warm-up steps and the capture (the capturing call
    is a step too, as the floor's set-up runs its warm-up).  ``compiled``:
    the blocks (gpt) or the model (mlp) compiled inside; ``sgd`` ("amp",
    "amp-fused", "sgd", "sgd-fused"): SGD with momentum, unfused or fused,
    in the float16 GradScaler step ("amp") or in float32 instead of the
    workload's optimizer."""
    import cgraph  # not built: this variant fails alone, as an error row

    model, x, y = problem.model, problem.x, problem.y
    forward = _compiled_blocks(problem) if compiled else model
    if sgd is None:
        opt = problem.optimizer(model.parameters())
        train_step = _plain_step(forward, opt)
    else:
        # Unfused: as constructed by default (foreach on CUDA); fused=False
        # would pick the single-tensor step.
        fused = {"fused": True} if sgd.endswith("-fused") else {}
        opt = torch.optim.SGD(model.parameters(), lr=1e-2, momentum=0.9, **fused)
        train_step = (_scaled_step(forward, opt, torch.amp.GradScaler("cuda"))
                      if sgd.startswith("amp") else _plain_step(forward, opt))
    warmup = FLOOR_WARMUP_ITERS + (COMPILE_STEPS if compiled else 0)
    step = cgraph.make_graphed_step(train_step, (x, y), num_warmup_iters=warmup)
    for _ in range(warmup + 1):
        step(x, y)
    return functools.partial(step, x, y)


def _plain_step(forward: Callable, opt: torch.optim.Optimizer) -> Callable:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        loss = _loss(forward(x), y)
        loss.backward()
        opt.step()
        return loss

    return train_step


def _scaled_step(forward: Callable, opt: torch.optim.Optimizer,
                 scaler: torch.amp.GradScaler) -> Callable:
    def train_step(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        opt.zero_grad(set_to_none=True)
        with torch.autocast("cuda", dtype=torch.float16):
            loss = _loss(forward(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt)
        scaler.update()
        return loss

    return train_step


def _compiled_blocks(problem: Problem) -> Callable:
    """The model with each gpt block compiled in place (default mode), or
    the whole mlp compiled."""
    model = problem.model
    if isinstance(model, GPT):
        for block in model.blocks:
            block.compile()
        return model
    return torch.compile(model)


class _Replay:
    """Replays raw CUDA graphs in order, holding their static tensors alive
    (the inputs they read among them)."""

    def __init__(self, graphs: tuple[torch.cuda.CUDAGraph, ...], static: object):
        self.graphs = graphs
        self.static = static

    def __call__(self) -> None:
        for graph in self.graphs:
            graph.replay()


def _warm_up_on_side_stream(fn: Callable[[], object]) -> None:
    """Run ``fn`` a few times on a side stream, so lazy initialization
    (cuBLAS handles, optimizer state) happens before capture."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(FLOOR_WARMUP_ITERS):
            fn()
    torch.cuda.current_stream().wait_stream(stream)


def _floor(problem: Problem) -> _Replay:
    """The step as raw CUDA graphs with no autograd or Python around them."""
    if problem.optimizer is None:
        return _floor_forward_backward(problem)
    return _floor_whole_step(problem)


def _floor_forward_backward(problem: Problem) -> _Replay:
    """overhead: a forward graph and a backward graph,
    ``torch.autograd.grad(out, [x, *params], grad_out)`` with a static
    ``grad_out`` of ones (the gradient of ``.sum()``), sharing one pool."""
    model, x = problem.model, problem.x
    inputs = (x, *model.parameters())
    with torch.no_grad():
        grad_out = torch.ones_like(model(x))
    _warm_up_on_side_stream(lambda: torch.autograd.grad(model(x), inputs, grad_out))
    pool = torch.cuda.graph_pool_handle()
    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    with torch.cuda.graph(fwd, pool=pool):
        out = model(x)
    with torch.cuda.graph(bwd, pool=pool):
        grads = torch.autograd.grad(out, inputs, grad_out)
    return _Replay((fwd, bwd), static=(x, out, grads))


def _floor_eager_optimizer(problem: Problem) -> Callable[[], None]:
    """mlp, gpt: forward, loss and backward in one raw graph, captured as in
    :func:`_floor_whole_step` (grads allocated by the capture, refilled by
    each replay), then the eager optimizer step the graphed variants run."""
    model, x, y = problem.model, problem.x, problem.y
    opt = problem.optimizer(model.parameters())

    def warm_up_step() -> None:
        opt.zero_grad(set_to_none=True)
        _loss(model(x), y).backward()

    _warm_up_on_side_stream(warm_up_step)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        _loss(model(x), y).backward()
    replay = _Replay((graph,), static=(x, y))

    def step() -> None:
        replay()
        opt.step()

    return step


def _floor_eager_loss(problem: Problem) -> Callable[[], None]:
    """mlp, gpt: the model's forward and backward as two raw graphs sharing
    one pool, the loss eager between them: the forward graph's logits go
    into the loss as a leaf, autograd computes its grad, which is copied
    into the backward graph's static grad_out.  The backward graph's
    ``backward(grad_out)``, captured with grads set to None, allocates the
    parameters' grads from the pool, and each replay refills them.  What is
    left is what a step of the model graphed as a whole cannot avoid
    (except ``zero_grad``): the loss, the autograd engine around its
    backward, and the optimizer."""
    model, x, y = problem.model, problem.x, problem.y
    opt = problem.optimizer(model.parameters())
    with torch.no_grad():
        grad_out = torch.ones_like(model(x))

    def warm_up_step() -> None:
        opt.zero_grad(set_to_none=True)
        model(x).backward(grad_out)

    _warm_up_on_side_stream(warm_up_step)
    pool = torch.cuda.graph_pool_handle()
    fwd, bwd = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(fwd, pool=pool):
        logits = model(x)
    with torch.cuda.graph(bwd, pool=pool):
        logits.backward(grad_out)
    forward = _Replay((fwd,), static=(x, logits))

    def step() -> None:
        forward()
        leaf = logits.detach().requires_grad_()
        _loss(leaf, y).backward()
        grad_out.copy_(leaf.grad)
        bwd.replay()
        opt.step()

    return step


def _floor_whole_step(problem: Problem, copy_inputs: bool = False) -> Callable[[], None]:
    """mlp, gpt: forward, loss, backward and optimizer step (``capturable=True``)
    in one graph, by the whole-network capture recipe of the PyTorch CUDA
    graphs docs: warm up on a side stream, set grads to None, then capture,
    so that backward allocates the grads from the graph's private pool and
    each replay refills them.  With ``copy_inputs`` (``floor-copies``), the
    graph reads static copies of the inputs, and each step first copies the
    workload's inputs into them (``copy_``, as the docs' recipe and
    ``make_graphed_callables`` do): the floor of a step that takes its batch
    as an argument, as ``cgraph-step`` does."""
    model = problem.model
    x, y = (problem.x.clone(), problem.y.clone()) if copy_inputs else (problem.x, problem.y)
    opt = problem.optimizer(model.parameters(), capturable=True)

    def whole_step() -> torch.Tensor:
        loss = _loss(model(x), y)
        loss.backward()
        opt.step()
        return loss

    def warm_up_step() -> None:
        opt.zero_grad(set_to_none=True)
        whole_step()

    _warm_up_on_side_stream(warm_up_step)
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        loss = whole_step()
    replay = _Replay((graph,), static=(x, y, loss))
    if not copy_inputs:
        return replay
    batch = (problem.x, problem.y)

    def step() -> None:
        x.copy_(batch[0])
        y.copy_(batch[1])
        replay()

    return step

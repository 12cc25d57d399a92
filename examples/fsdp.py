"""FSDP2 (fully_shard) with cgraph, on two GPUs or four: from the repository
root after a build,

    PYTHONPATH=. torchrun --nproc_per_node=2 examples/fsdp.py   # or 1, or 4

The recipe for per-layer graphs is the eager one, then one line:

    for layer in model.layers:
        fully_shard(layer, mp_policy=mp)
    fully_shard(model, mp_policy=mp)
    model.layers = nn.ModuleList(cgraph.make_graphed(l, pool=pool) for l in model.layers)

FSDP's hooks keep running around each layer's graphs (the all-gather
before its forward, the reshard after, the reduce-scatter after its
backward, and their prefetching); only the layer's compute replays.  The
graphs read the unsharded parameters at fixed homes (Note [FSDP2's
unsharded parameters in per-layer graphs] in cgraph/_fsdp.py).

Each rank checks, against an eager FSDP2 twin (same weights, same sharding,
each rank its own data), and prints one line per check (tests/test_fsdp.py
reads them):

1. per-layer graphs, for each sharding below: every loss, every sharded grad
   and the sharded parameters after each AdamW step bitwise equal to eager
   FSDP2's, and every step after the first replayed the layers' graphs.
   Shardings: reshard_after_forward True; False with pool= and samples; bf16
   parameters with fp32 reduction (MixedPrecisionPolicy) and pool=; on four
   GPUs, reshard_after_forward=2.  Then the same with the optimizer step
   graphed too (``cgraph.make_graphed_step(opt.step)``, fused AdamW, bf16
   parameters): FSDP2 hands it grads made outside it, new tensors each step
   where zero_grad() sets them to None, the same ones zeroed where it does not
   (Note [Grads around a graphed step] in cgraph/_step_grads.py).  With CPU
   offload (CPUOffloadPolicy), the optimizer step graphed is refused, and so
   is the step graphed whole.  Explicit
   prefetching (set_modules_to_forward_prefetch and ..._backward_prefetch: each
   layer all-gathers the next one's parameters, which FSDP copies out into the
   shared home only when that layer runs).  Gradient accumulation as FSDP2 does
   it: two micro-batches per step, reduce-scattering after the last only
   (set_requires_gradient_sync), in fp32 and in bf16 with fp32 reduction, and
   with the layers kept unsharded between micro-batches
   (set_reshard_after_backward(False)).  Activation checkpointing inside each
   sharded layer (checkpoint_wrapper, then fully_shard, as torchtitan applies
   it).  Every layer reset and graphed again, then the model dropped
   without a reset (its memory given back).
2. a whole step graphed: make_graphed_step around the FSDP2 model's step
   (fused AdamW), its all-gathers and reduce-scatters inside the graph:
   losses and parameters bitwise equal to eager FSDP2's; then a step that
   accumulates two micro-batches, one with activation checkpointing, and
   one resumed from the sharded state dicts of the model and optimizer.
3. graphing first and sharding after (every layer and the root, or the root
   alone) is refused, naming this recipe.
4. teardown: reset() of every graph gives back all memory of the graphed
   model once the model is dropped.
5. a whole-step capture that fails on one rank (an error planted there,
   inside FSDP's pass) raises on every rank, naming that rank and its
   error, instead of leaving the others to replay collectives it never
   joins (Note [A capture that fails on one rank] in cgraph/_ranks.py);
   eager steps after it equal eager FSDP2's; then
   dist.destroy_process_group() returns.
6. a forward-and-backward step graphed whole, called per micro-batch with
   FSDP's grad sync set outside it: FSDP keeps the unsharded grads of the
   calls with sync off in its own Python state, which no replay can
   follow, so the capture is refused, naming the fix, whether it falls on a
   call with sync off or on the last micro-batch's (grads held); the calls
   before it, and the training continued eagerly after, equal to eager
   FSDP2's.
"""

import contextlib
import copy
import gc
import os
import time

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.fsdp import (CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy,
                                    fully_shard)

import cgraph

VOCAB, DIM, HEADS, DEPTH, SEQ, BATCH, STEPS = 512, 256, 4, 4, 64, 4, 5
MICRO = 2  # micro-batches per optimizer step where grads accumulate


class Block(nn.Module):
    """A Llama-style decoder block: RMSNorm, causal attention, SwiGLU."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.qkv, self.out = nn.Linear(DIM, 3 * DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.gate_up = nn.Linear(DIM, 4 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        b, s, _ = x.shape
        q, k, v = self.qkv(self.attn_norm(x)).view(b, s, 3, HEADS, -1).transpose(1, 3).unbind(2)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out(a.transpose(1, 2).reshape(b, s, DIM))
        gate, up = self.gate_up(self.mlp_norm(x)).chunk(2, dim=-1)
        return x + self.down(F.silu(gate) * up)


class Toy(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block() for _ in range(DEPTH))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def sharded(reshard=True, mp=False, offload=False, checkpointed=False, prefetch=False):
    torch.manual_seed(0)  # the same weights on every rank and in both twins
    model = Toy().cuda()
    if checkpointed:  # activation checkpointing inside each sharded layer, as torchtitan does
        model.layers = nn.ModuleList(checkpoint_wrapper(layer) for layer in model.layers)
    policy = (MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
              if mp else MixedPrecisionPolicy())
    where = CPUOffloadPolicy() if offload else OffloadPolicy()
    for layer in model.layers:
        fully_shard(layer, reshard_after_forward=reshard, mp_policy=policy, offload_policy=where)
    fully_shard(model, mp_policy=policy, offload_policy=where)
    if prefetch:  # explicit prefetching, as torchtitan sets it: the next layer in each pass
        layers = list(model.layers)
        for i, layer in enumerate(layers):
            layer.set_modules_to_forward_prefetch(layers[i + 1:i + 2])
            layer.set_modules_to_backward_prefetch(layers[max(i - 1, 0):i])
    return model


def batch(step, rank):
    g = torch.Generator(device="cuda").manual_seed(1000 * step + rank)  # each rank its own
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda", generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def loss_of(model, tokens, targets):
    return F.cross_entropy(model(tokens).flatten(0, 1).float(), targets.flatten())


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def same(a, b, what, rank, name):
    if not torch.equal(local(a), local(b)):
        diff = (local(a).double() - local(b).double()).abs().max().item()
        raise SystemExit(f"rank {rank} {name}: {what} differs from eager FSDP2 "
                         f"(max |diff| {diff:.3g})")


def home_of(layer):
    """The home a graphed layer's unsharded parameters live in (Note [FSDP2's
    unsharded parameters in per-layer graphs]): one for all the layers FSDP
    re-gathers before backward, one each where it does not."""
    group = layer.module._get_fsdp_state()._fsdp_param_group
    lenders = {p.__dict__.get("alloc_all_gather_outputs") for p in group.fsdp_params}
    homes = {getattr(lender, "home", None) for lender in lenders}
    if len(homes) != 1 or None in homes:
        raise SystemExit(f"{type(layer.module).__name__}: parameters not homed: {lenders}")
    return homes.pop()


@contextlib.contextmanager
def reduced_grads_seen(seen):
    """Records, by FSDPParam, where the unsharded grads lie that FSDP's
    post-backward hands to its reduce-scatter."""
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as groups
    reduce = groups.foreach_reduce

    def recording(fsdp_params, unsharded_grads, *args, **kwargs):
        for p, g in zip(fsdp_params, unsharded_grads):
            seen.setdefault(id(p), set()).add(g.data_ptr())
        return reduce(fsdp_params, unsharded_grads, *args, **kwargs)

    groups.foreach_reduce = recording
    try:
        yield
    finally:
        groups.foreach_reduce = reduce


def grad_places(layers, seen):
    """How many places the unsharded grads of each parameter of a layer lay
    in, over every layer and step: one where the layers' graphs share a grad
    store per parameter (Note [One grad store per parameter] in
    csrc/aten_capture_backward.cpp), a layer's each where they do not."""
    params = [layer.module._get_fsdp_state()._fsdp_param_group.fsdp_params for layer in layers]
    return [len(set().union(*(seen[id(ps[j])] for ps in params))) for j in range(len(params[0]))]


def per_layer(rank, name, reshard=True, mp=False, pool=False, samples=False, offload=False,
              checkpointed=False, prefetch=False):
    """Recipe 1: every layer graphed after sharding, trained beside an eager twin."""
    eager, model = (sharded(reshard, mp, offload, checkpointed, prefetch) for _ in range(2))
    shared = cgraph.graph_pool_handle() if pool else None
    sample = (torch.randn(BATCH, SEQ, DIM, device="cuda"),) if samples else None
    model.layers = nn.ModuleList(cgraph.make_graphed(layer, sample, pool=shared)
                                 for layer in model.layers)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    seen = {}  # from the second step on: the first one's grads come from its captures
    train_beside(eager, model, opts, rank, name, lambda step: reduced_grads_seen(seen)
                 if step else contextlib.nullcontext())
    for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        same(p, q, f"parameter {k}", rank, name)
    one_home = reshard is not False and dist.get_world_size() > 1
    homes = {id(home) for home in map(home_of, model.layers)}
    if len(homes) != (1 if one_home else DEPTH):
        raise SystemExit(f"rank {rank} {name}: {len(homes)} parameter homes for {DEPTH} layers")
    # Layers captured one by one into one pool make regular grad stores,
    # shared by the layers lent one home; others compute their grads in place.
    places = grad_places(model.layers, seen)
    if set(places) != {1 if one_home and pool and not samples else DEPTH}:
        raise SystemExit(f"rank {rank} {name}: each parameter's unsharded grads lay in "
                         f"{places} places over {DEPTH} layers")
    replays = [layer.stats["forward"] for layer in model.layers]
    if min(replays) < STEPS - 1:
        raise SystemExit(f"rank {rank} {name}: the layers replayed {replays} times in {STEPS} "
                         f"steps, stats {[layer.stats for layer in model.layers]}")
    print(f"rank {rank} {name}: losses, grads and parameters equal to eager FSDP2 over "
          f"{STEPS} steps, layers replayed {replays}, {len(homes)} parameter home(s), unsharded "
          f"grads in {places[0]} place(s) per parameter after the first step: OK", flush=True)
    if offload:
        optimizer_step_off_the_gpu_is_refused(rank, opts[1])
        offloaded_step_is_refused(rank)
    for layer in model.layers:
        layer.reset()  # FSDP allocates its unsharded parameters itself again
    lenders = [p for layer in model.layers
               for p in layer.module._get_fsdp_state()._fsdp_param_group.fsdp_params
               if "alloc_all_gather_outputs" in p.__dict__]
    if lenders:
        raise SystemExit(f"rank {rank} {name}: {len(lenders)} parameters still homed after reset")


def graphed_again_after_reset(rank, name="per-layer graphs, graphed again after reset"):
    """Recipe 1, then every layer reset and graphed anew (reset_all before
    re-graphing, as a notebook cell run twice does): the reset gives each
    layer its own forward back, and the new graphs home its parameters
    afresh and train as eager.  Then the model dropped without a reset:
    its graphs, their pool and the homes go with it."""
    before = torch.cuda.memory_allocated()
    eager, model = sharded(), sharded()
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    for graphing in range(2):
        if graphing:
            cgraph.reset_all()
        model.layers = nn.ModuleList(cgraph.make_graphed(getattr(layer, "module", layer))
                                     for layer in model.layers)
        train_beside(eager, model, opts, rank, f"{name} ({graphing})",
                     lambda step: contextlib.nullcontext())
    replays = [layer.stats["forward"] for layer in model.layers]
    if min(replays) < STEPS - 1:
        raise SystemExit(f"rank {rank} {name}: the layers replayed {replays} times")
    del eager, model, opts
    gc.collect()
    left = torch.cuda.memory_allocated() - before
    if left > 0:
        raise SystemExit(f"rank {rank} {name}: {left} bytes still allocated after dropping "
                         "the graphed model without a reset")
    print(f"rank {rank} {name}: losses and grads equal to eager FSDP2 over 2 x {STEPS} "
          f"steps, layers replayed {replays} after graphing again; dropped without a reset, "
          "its memory given back: OK", flush=True)


def train_beside(eager, model, opts, rank, name, around_backward, steppers=None,
                 set_to_none=True):
    """STEPS steps of both twins, losses and sharded grads compared bitwise;
    around_backward(step): a context the backwards run in; steppers: what
    steps each twin's optimizer (its step method unless given)."""
    for step in range(STEPS):
        tokens, targets = batch(step, rank)
        losses = [loss_of(m, tokens, targets) for m in (eager, model)]
        with around_backward(step):
            for loss in losses:
                loss.backward()
        same(losses[1], losses[0], f"step {step} loss", rank, name)
        for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
            same(p.grad, q.grad, f"step {step} grad {k}", rank, name)
        for opt, step_it in zip(opts, steppers or [opt.step for opt in opts]):
            step_it()
            opt.zero_grad(set_to_none=set_to_none)


def refused_at_capture(rank, name, graphed, calls, words):
    """The graphed step's first call steps eagerly (its warm-up); its second,
    the capture, raises a ValueError that says `words`."""
    graphed(*calls[0])
    try:
        graphed(*calls[1])
    except ValueError as e:
        if not all(w in str(e) for w in words):
            raise
    else:
        raise SystemExit(f"rank {rank}: {name}: graphed, not refused")
    print(f"rank {rank} {name} refused: OK", flush=True)


def optimizer_step_off_the_gpu_is_refused(rank, opt):
    """An optimizer of CPU-offloaded parameters, graphed: refused at capture,
    naming the fix (a graph would step them once, at capture)."""
    refused_at_capture(rank, "CPU offload: a graphed optimizer step",
                       cgraph.make_graphed_step(opt.step, num_warmup_iters=1), [(), ()],
                       ["is on cpu", "cgraph.make_graphed(layer)"])


def offloaded_step_is_refused(rank):
    """A step graphed whole over a CPU-offloaded model, its optimizer
    stepped outside: refused at capture, naming the per-layer recipe (FSDP
    waits on the host for its grads' copies to the CPU, which no capture
    can hold)."""
    model = sharded(offload=True)

    def step(tokens, targets):
        loss = loss_of(model, tokens, targets)
        loss.backward()
        return loss.detach()

    refused_at_capture(rank, "CPU offload: a step graphed whole",
                       cgraph.make_graphed_step(step, num_warmup_iters=1),
                       [batch(0, rank), batch(1, rank)],
                       ["CPUOffloadPolicy", "cgraph.make_graphed(layer)"])


def accumulating(rank, name, mp=False, reshard=True, keep_unsharded=False):
    """Recipe 1 with gradient accumulation as FSDP2 does it: MICRO
    micro-batches per optimizer step, reduce-scattering after the last only
    (set_requires_gradient_sync(False) before the others), so the unsharded
    grads of every layer accumulate across micro-batches; keep_unsharded:
    set_reshard_after_backward(False) too, which keeps the layers unsharded
    between micro-batches (where they share a home, cgraph reshards an idle
    one: Note [A layer kept unsharded in a shared home] in cgraph/_fsdp.py)."""
    eager, model = sharded(reshard, mp), sharded(reshard, mp)
    shared = cgraph.graph_pool_handle()
    model.layers = nn.ModuleList(cgraph.make_graphed(layer, pool=shared)
                                 for layer in model.layers)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3) for m in (eager, model)]
    for step in range(STEPS):
        for micro in range(MICRO):
            last = micro == MICRO - 1
            for m in (eager, model):
                m.set_requires_gradient_sync(last)
                if keep_unsharded:
                    m.set_reshard_after_backward(last)
            tokens, targets = batch(MICRO * step + micro, rank)
            losses = [loss_of(m, tokens, targets) for m in (eager, model)]
            for loss in losses:
                loss.backward()
            same(losses[1], losses[0], f"step {step} micro-batch {micro} loss", rank, name)
        for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
            same(p.grad, q.grad, f"step {step} grad {k}", rank, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        same(p, q, f"parameter {k}", rank, name)
    replays = [layer.stats["forward"] for layer in model.layers]
    if min(replays) < MICRO * STEPS - 1:
        raise SystemExit(f"rank {rank} {name}: the layers replayed {replays} times in "
                         f"{MICRO * STEPS} micro-batches")
    print(f"rank {rank} {name}: losses, grads and parameters equal to eager FSDP2 over "
          f"{STEPS} steps of {MICRO} micro-batches, layers replayed {replays}: OK", flush=True)
    for layer in model.layers:
        layer.reset()


def per_layer_and_optimizer_step(rank, set_to_none):
    """Recipe 1 with the optimizer step graphed too (make_graphed_step
    around opt.step): FSDP2 hands it the reduced grads made outside it,
    new tensors each step when zero_grad() sets them to None (Note [Grads
    around a graphed step] in cgraph/_step_grads.py)."""
    name = ("per-layer graphs, graphed optimizer step, grads "
            + ("set to None" if set_to_none else "zeroed"))
    eager, model = sharded(mp=True), sharded(mp=True)
    shared = cgraph.graph_pool_handle()
    model.layers = nn.ModuleList(cgraph.make_graphed(layer, pool=shared)
                                 for layer in model.layers)
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in (eager, model)]
    optimizer_step = cgraph.make_graphed_step(opts[1].step)
    train_beside(eager, model, opts, rank, name, lambda step: contextlib.nullcontext(),
                 steppers=[opts[0].step, optimizer_step], set_to_none=set_to_none)
    for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        same(p, q, f"parameter {k}", rank, name)
    if optimizer_step.stats["replays"] != STEPS - 3:
        raise SystemExit(f"rank {rank} {name}: {optimizer_step.stats}")
    print(f"rank {rank} {name}: losses, grads and parameters equal to eager FSDP2 over "
          f"{STEPS} steps, optimizer step {optimizer_step.stats}: OK", flush=True)
    optimizer_step.reset()


def whole_step(rank, micro=1, checkpointed=False, resumed=False, evaluated=False):
    """Recipe 2: make_graphed_step around the FSDP2 model's step; with
    micro > 1, the step accumulates grads over that many micro-batches,
    reduce-scattering after the last only (set_requires_gradient_sync);
    resumed: both twins load, after step 5, the model's and optimizer's
    sharded state dicts saved after step 2 (the step warms up and captures
    again: Note [Capturable optimizers] in cgraph/_step.py); evaluated: both
    twins evaluate under torch.no_grad() before every step, which leaves
    FSDP's root unsharded (Note [FSDP2's host state around a graphed step]
    in cgraph/_fsdp.py), between warm-up and capture and between replays."""
    name = ("graphed FSDP2 step" + (f", {micro} micro-batches" if micro > 1 else "")
            + (", activation checkpointing" if checkpointed else "")
            + (", resumed from a state dict" if resumed else "")
            + (", evaluated between steps" if evaluated else ""))
    models = [sharded(mp=True, checkpointed=checkpointed) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]

    def train_step(model, opt):
        def step(tokens, targets):
            opt.zero_grad()
            losses = []
            for i, (t, y) in enumerate(zip(tokens.chunk(micro), targets.chunk(micro))):
                if micro > 1:
                    model.set_requires_gradient_sync(i == micro - 1)
                loss = loss_of(model, t, y) / micro
                loss.backward()
                losses.append(loss.detach())
            opt.step()
            return torch.stack(losses).sum()
        return step

    def data(step):
        pieces = [batch(micro * step + i, rank) for i in range(micro)]
        return tuple(torch.cat(parts) for parts in zip(*pieces))

    eager = train_step(models[0], opts[0])
    graphed = cgraph.make_graphed_step(train_step(models[1], opts[1]), data(0))
    steps, saved = 8, None
    for step in range(steps):
        if resumed and step == 3:
            saved = [(copy.deepcopy(m.state_dict()), copy.deepcopy(o.state_dict()))
                     for m, o in zip(models, opts)]
        if resumed and step == 6:
            for (model_state, opt_state), m, o in zip(saved, models, opts):
                m.load_state_dict(model_state)
                o.load_state_dict(opt_state)
        if evaluated:
            with torch.no_grad():
                tokens, targets = batch(100 + step, rank)
                same(loss_of(models[1], tokens, targets), loss_of(models[0], tokens, targets),
                     f"evaluation before step {step}", rank, name)
        tokens, targets = data(step)
        same(graphed(tokens, targets), eager(tokens, targets), f"step {step} loss", rank, name)
    if graphed.stats["captures"] != (2 if resumed else 1):  # resumed: captured again
        raise SystemExit(f"rank {rank} {name}: {graphed.stats}, captures unlike the plan's")
    for k, (p, q) in enumerate(zip(models[1].parameters(), models[0].parameters())):
        same(p, q, f"parameter {k}", rank, name)
    print(f"rank {rank} {name}: losses and parameters equal to eager FSDP2 over "
          f"{steps} steps, {graphed.stats}: OK", flush=True)
    graphed.reset()


def micro_batches_outside_later(rank):
    """Note [Grads FSDP2 holds, kept after a step's capture] in
    cgraph/_fsdp.py: a step (zero_grad, forward, backward, step) graphed
    while no grads were held; from step 4 on, before some calls, a
    micro-batch runs outside it with grad sync off, whose unsharded grads
    FSDP holds for the step's reduce-scatter.  Each such call steps eagerly,
    adding them in (three in a row too), and the next without them captures
    again: losses and parameters equal to eager FSDP2's."""
    name = "graphed FSDP2 step, micro-batches outside from a later call on"
    models = [sharded(mp=True) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]

    def train_step(model, opt):
        def step(tokens, targets):
            opt.zero_grad()
            loss = loss_of(model, tokens, targets)
            loss.backward()
            opt.step()
            return loss.detach()
        return step

    eager = train_step(models[0], opts[0])
    graphed = cgraph.make_graphed_step(train_step(models[1], opts[1]), batch(0, rank))
    outside, steps = (4, 6, 7, 8), 10
    for step in range(steps):
        if step in outside:
            for model in models:
                model.set_requires_gradient_sync(False)
                loss_of(model, *batch(100 + step, rank)).backward()
                model.set_requires_gradient_sync(True)
        tokens, targets = batch(step, rank)
        same(graphed(tokens, targets), eager(tokens, targets), f"step {step} loss", rank, name)
    if graphed.stats["captures"] != 3:  # at call 3, 5 and 9
        raise SystemExit(f"rank {rank} {name}: {graphed.stats}, captures unlike the plan's")
    for k, (p, q) in enumerate(zip(models[1].parameters(), models[0].parameters())):
        same(p, q, f"parameter {k}", rank, name)
    print(f"rank {rank} {name}: each such call stepped eagerly, losses and parameters equal "
          f"to eager FSDP2 over {steps} steps, {graphed.stats}: OK", flush=True)
    graphed.reset()


def graph_then_shard_is_refused(rank, name, layers=True):
    """Recipe 3: graphing first, sharding after: every layer and the root,
    or the root alone, whose fully_shard replaces the graphed layers'
    parameters without registering them (Note [Sharding after graphing] in
    cgraph/_describe.py)."""
    torch.manual_seed(0)
    model = Toy().cuda()
    model.layers = nn.ModuleList(cgraph.make_graphed(layer) for layer in model.layers)
    model(batch(0, rank)[0])  # captures, unsharded
    for layer in model.layers if layers else ():  # the GraphedModules
        fully_shard(layer)
    fully_shard(model)
    try:
        model(batch(1, rank)[0])
    except RuntimeError as e:
        if "shard first" not in str(e):
            raise
        print(f"rank {rank} {name}: refused, naming the recipe: OK", flush=True)
    else:
        raise SystemExit(f"rank {rank} {name}: not refused")
    cgraph.reset_all()


def failing_capture(rank, world, inside_a_layer=False):
    """Recipe 5: the step's capture fails on the last rank only, inside
    FSDP's pass: between its forward and its backward, or inside the second
    layer's forward, after FSDP gathered that layer's parameters; then every
    rank goes on with eager steps, equal to a twin's that never graphed
    (Note [A capture that fails inside FSDP2's pass] in cgraph/_fsdp.py)."""
    name = "failed capture" + (" inside a layer" if inside_a_layer else "")
    models = [sharded(mp=True) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]

    def planted(*_):
        if rank == world - 1 and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("planted at capture")

    if inside_a_layer:  # after FSDP's own pre-forward hook, registered first
        models[1].layers[1].register_forward_pre_hook(planted)

    def train_step(model, opt, plant):
        def step(tokens, targets):
            opt.zero_grad()
            loss = loss_of(model, tokens, targets)
            if plant and not inside_a_layer:
                planted()
            loss.backward()
            opt.step()
            return loss
        return step

    eager, step = train_step(models[0], opts[0], False), train_step(models[1], opts[1], True)
    graphed = cgraph.make_graphed_step(step, batch(0, rank))
    failed_at = None
    for n in range(5):
        try:
            loss = graphed(*batch(n, rank))
        except RuntimeError as e:
            said = " ".join([str(e), *getattr(e, "__notes__", [])])
            if f"failed on rank(s) [{world - 1}]" not in said or "planted at capture" not in said:
                raise
            failed_at = n
            break
        same(loss, eager(*batch(n, rank)), f"step {n} loss", rank, name)
    if failed_at is None:
        raise SystemExit(f"rank {rank}: a capture that failed on rank {world - 1} did not raise")
    for n in range(failed_at + 1, failed_at + 4):  # eagerly, as a caller going on would
        same(step(*batch(n, rank)), eager(*batch(n, rank)), f"eager step {n} after it", rank,
             name)
    for k, (p, q) in enumerate(zip(models[1].parameters(), models[0].parameters())):
        same(p, q, f"parameter {k}", rank, name)
    print(f"rank {rank} {name}: raised on every rank, naming rank {world - 1} and its "
          "error; three eager steps after it equal to eager FSDP2's: OK", flush=True)
    cgraph.reset_all()


def sync_set_outside(rank):
    """Note [Grad sync set outside a graphed step] in cgraph/_step_checks.py: a
    forward-and-backward step graphed whole, called once per micro-batch,
    FSDP's grad sync set outside it (on for the last of two) and the
    optimizer stepped outside.  FSDP keeps the first micro-batch's unsharded
    grads in its own Python state for the last one's reduction: a capture on
    either call is refused, naming the fix (the first, with sync off; the
    last, holding those grads, whose memory a replay would add into after
    it was freed).  The eager calls before each refusal, and the step
    finished eagerly after it, are equal to eager FSDP2's."""
    for mp in (True, False):  # FSDP holds the grads elsewhere without a reduce dtype
        _sync_set_outside(rank, mp)
    cgraph.reset_all()


def _sync_set_outside(rank, mp):
    name = "graphed FSDP2 forward and backward, grad sync set outside"
    models = [sharded(mp=mp) for _ in range(2)]
    opts = [torch.optim.AdamW(m.parameters(), lr=1e-3, fused=True) for m in models]

    def forward_backward(model):
        def step(tokens, targets):
            loss = loss_of(model, tokens, targets) / MICRO
            loss.backward()
            return loss.detach()
        return step

    eager = forward_backward(models[0])
    refused = []
    for warmup in (MICRO + 1, MICRO):  # the capture on the last micro-batch, then the first
        graphed = cgraph.make_graphed_step(forward_backward(models[1]), batch(0, rank),
                                           num_warmup_iters=warmup)
        for step in range(2):
            for opt in opts:
                opt.zero_grad()
            for i in range(MICRO):
                for model in models:
                    model.set_requires_gradient_sync(i == MICRO - 1)
                tokens, targets = batch(MICRO * step + i, rank)
                try:
                    loss = graphed(tokens, targets)
                except ValueError as e:
                    if "set_requires_gradient_sync(i == last)" not in str(e):
                        raise
                    refused.append("holding grads" if i == MICRO - 1 else "off")
                    graphed = forward_backward(models[1])  # on eagerly, as a caller would
                    loss = graphed(tokens, targets)
                same(loss, eager(tokens, targets), f"step {step} micro-batch {i} loss", rank,
                     name)
            for opt in opts:
                opt.step()
    if refused != ["holding grads", "off"]:
        raise SystemExit(f"rank {rank} {name}: captures refused {refused}, planned: one "
                         "holding grads, one with sync off")
    for k, (p, q) in enumerate(zip(models[1].parameters(), models[0].parameters())):
        same(p, q, f"parameter {k}", rank, name)
    print(f"rank {rank} {name}{', bf16 params fp32 reduce' if mp else ''}: captures refused on "
          "the last micro-batch (grads held) and on the first (sync off), naming the fix; "
          "losses and parameters equal to eager FSDP2 over 2 x 2 steps: OK", flush=True)


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    dist.barrier()
    before = torch.cuda.memory_allocated()

    per_layer(rank, "per-layer graphs, reshard_after_forward=True")
    per_layer(rank, "per-layer graphs, reshard_after_forward=False, pool, samples",
              reshard=False, pool=True, samples=True)
    per_layer(rank, "per-layer graphs, bf16 params fp32 reduce, pool", mp=True, pool=True)
    if world >= 4:
        per_layer(rank, "per-layer graphs, reshard_after_forward=2", reshard=2, pool=True)
    per_layer(rank, "per-layer graphs, CPU offload", offload=True)
    # The offloaded models hold pinned memory in reference cycles, left to
    # the collector: no collection starts inside the captures that follow
    # (Note [No garbage collection while capturing], csrc/capture.c).
    per_layer(rank, "per-layer graphs, activation checkpointing, pool", pool=True,
              checkpointed=True)
    per_layer(rank, "per-layer graphs, explicit prefetching, bf16 params fp32 reduce, pool",
              mp=True, pool=True, prefetch=True)
    graphed_again_after_reset(rank)
    per_layer_and_optimizer_step(rank, set_to_none=True)
    per_layer_and_optimizer_step(rank, set_to_none=False)
    accumulating(rank, "per-layer graphs, grads accumulated")
    accumulating(rank, "per-layer graphs, grads accumulated, bf16 params fp32 reduce", mp=True)
    accumulating(rank, "per-layer graphs, grads accumulated, kept unsharded",
                 keep_unsharded=True)
    accumulating(rank, "per-layer graphs, grads accumulated, kept unsharded, "
                 "reshard_after_forward=False", reshard=False, keep_unsharded=True)
    whole_step(rank)
    whole_step(rank, micro=MICRO)
    whole_step(rank, checkpointed=True)
    whole_step(rank, resumed=True)
    whole_step(rank, evaluated=True)
    sync_set_outside(rank)
    micro_batches_outside_later(rank)
    graph_then_shard_is_refused(rank, "graph then shard")
    graph_then_shard_is_refused(rank, "graph then shard the root only", layers=False)

    cgraph.reset_all()
    gc.collect()
    after = torch.cuda.memory_allocated()
    if after > before:
        raise SystemExit(f"rank {rank}: {after - before} bytes still allocated after reset and "
                         "dropping every model")
    if world > 1:
        failing_capture(rank, world)
        failing_capture(rank, world, inside_a_layer=True)
    dist.barrier()
    started = time.perf_counter()
    dist.destroy_process_group()
    print(f"rank {rank} teardown: memory given back ({after - before} bytes), "
          f"destroy_process_group in {time.perf_counter() - started:.2f} s: OK", flush=True)


if __name__ == "__main__":
    main()

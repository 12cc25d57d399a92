"""Tensor parallelism (DTensor) with cgraph, and FSDP2 x TP on a 2-D mesh:
from the repository root after a build,

    PYTHONPATH=. torchrun --nproc_per_node=2 examples/tp.py   # or 4: adds 2-D

The recipes are the eager ones, then one line: each Llama-style block is
parallelized (``parallelize_module``: q, k, v, gate and up
``ColwiseParallel``, o and down ``RowwiseParallel``), then graphed
(``cgraph.make_graphed(block)``); the all-reduces TP issues inside a block
are part of its graphs.  Its DTensor parameters are read through plain
leaves over their local memory and get DTensor grads of their placements
(Note [DTensor parameters in per-layer graphs] in cgraph/_dtensor.py).

Each rank checks, against an eager twin (same weights, same
parallelization), and prints one line per check (tests/test_tp.py reads
them):

1. TP, per-layer graphs: every loss, every grad (a DTensor of its
   parameter's placements) and the parameters after each AdamW step
   bitwise equal to eager TP's.
2. TP, the whole step graphed (make_graphed_step, fused AdamW stepping
   DTensor state inside the graph): losses and parameters bitwise equal.
3. TP with sequence parallelism and a loss-parallel head, as torchtitan
   plans a Llama (``SP_PLAN``: the norms ``SequenceParallel``, the
   residual stream a shard of the sequence between them; the embedding
   and the head sharded by vocabulary, the loss under ``loss_parallel()``):
   per-layer graphs (the all-gathers and reduce-scatters of the sequence
   inside each block's graphs) and the whole step (returning the loss as
   loss_parallel() makes it, a DTensor), losses and parameters bitwise
   equal to eager's.  A norm's weight grad is a DTensor of the
   weight's placement (Replicate), reduced inside the backward graph, where
   eager leaves it Partial for the optimizer to reduce: the same sums.
4. TP with each block's forward compiled on the instance
   (``block.forward = torch.compile(block.forward)``), then graphed:
   losses, grads and parameters bitwise equal to the same compiled blocks
   run eagerly, and no recompile after the first step.
5. Dropout on a DTensor inside a graphed step is refused (``rng_changed``),
   naming the fix: DTensor's RNG tracker moves the generator's offset on
   the host around the op, which a replay would not repeat.
6. TP, the whole step, its first capture failing on the last rank (an
   error planted there before the forward, so that the other ranks
   captured collectives it never issued; or after the backward): every
   rank raises at that call, naming the rank and its error; the next call
   captures again, no call is eager after it, and the losses of the other
   calls and the parameters after are bitwise eager's, whose twin skips
   the failed call's batch.
7. On four GPUs, FSDP2 x TP on a (2, 2) mesh as torchtitan lays it out (TP
   inside a pair of GPUs, FSDP across pairs): per-layer graphs (FSDP's
   hooks around each graph, its unsharded parameters DTensors over the TP
   mesh at their homes) and the whole step, each bitwise equal to eager.
"""

import contextlib
import os

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (ColwiseParallel, RowwiseParallel,
                                               SequenceParallel, loss_parallel,
                                               parallelize_module)

import cgraph

VOCAB, DIM, HEADS, DEPTH, SEQ, BATCH, STEPS = 512, 256, 4, 3, 64, 4, 4
HEAD_DIM = DIM // HEADS
PLAN = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(),
        "o": RowwiseParallel(), "gate": ColwiseParallel(), "up": ColwiseParallel(),
        "down": RowwiseParallel()}
# Sequence parallel, torchtitan's way: between the norms the residual stream
# is this rank's shard of the sequence (a plain tensor), the projections
# gather it and scatter their sums back.
SP_PLAN = {"attn_norm": SequenceParallel(), "mlp_norm": SequenceParallel(),
           **{n: ColwiseParallel(input_layouts=Shard(1)) for n in ("q", "k", "v", "gate", "up")},
           **{n: RowwiseParallel(output_layouts=Shard(1)) for n in ("o", "down")}}
SP_TOP_PLAN = {"embed": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
               "norm": SequenceParallel(),
               "head": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1),
                                       use_local_output=False)}  # logits sharded by vocabulary


class Block(nn.Module):
    """A Llama-style block whose heads and MLP columns TP splits."""

    def __init__(self):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.gate, self.up = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.down = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        h = self.attn_norm(x)
        q, k, v = (proj(h) for proj in (self.q, self.k, self.v))
        b, s = q.shape[:2]  # the whole sequence, also where x is a shard of it (SP)
        q, k, v = (t.view(b, s, -1, HEAD_DIM).transpose(1, 2) for t in (q, k, v))  # this rank's heads
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.o(a.transpose(1, 2).reshape(b, s, -1))
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


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


def parallel(tp_mesh, dp_mesh=None, sp=False):
    torch.manual_seed(0)  # the same weights on every rank and in both twins
    model = Toy().cuda()
    for layer in model.layers:
        parallelize_module(layer, tp_mesh, SP_PLAN if sp else PLAN)
        if dp_mesh is not None:
            fully_shard(layer, mesh=dp_mesh)
    if sp:
        parallelize_module(model, tp_mesh, SP_TOP_PLAN)
    if dp_mesh is not None:
        fully_shard(model, mesh=dp_mesh)
    return model


def batch(step, dp_rank):
    g = torch.Generator(device="cuda").manual_seed(1000 * step + dp_rank)  # per TP group
    tokens = torch.randint(0, VOCAB, (BATCH, SEQ + 1), device="cuda", generator=g)
    return tokens[:, :-1], tokens[:, 1:]


def adamw(model, **options):
    """AdamW over parameter groups of one kind each (plain, DTensor on a 1-D
    mesh, on a 2-D one): a foreach or fused optimizer batches a group's
    parameters into one op, which must not mix them."""
    kinds = {}
    for p in model.parameters():
        kinds.setdefault(p.device_mesh.ndim if hasattr(p, "device_mesh") else 0, []).append(p)
    return torch.optim.AdamW([{"params": ps} for ps in kinds.values()], lr=1e-3, **options)


def backward_of(model, tokens, targets, as_dtensor=False):
    """The mean cross entropy, its backward run; of logits sharded by
    vocabulary (SP_TOP_PLAN) under loss_parallel(), which both need.
    Returns this rank's loss, a plain tensor, or as loss_parallel() made it
    (a Replicate DTensor) with `as_dtensor`."""
    logits = model(tokens)
    with loss_parallel() if hasattr(logits, "placements") else contextlib.nullcontext():
        loss = F.cross_entropy(logits.flatten(0, 1).float(), targets.flatten())
        loss.backward()
    return (loss if as_dtensor else local(loss)).detach()


def local(t):
    return t.to_local() if hasattr(t, "to_local") else t


def same(a, b, what, rank, name):
    if type(a) is not type(b):
        raise SystemExit(f"rank {rank} {name}: {what} is a {type(a).__name__}, eager's a "
                         f"{type(b).__name__}")
    if hasattr(a, "placements") and a.placements != b.placements:
        raise SystemExit(f"rank {rank} {name}: {what} placements {a.placements} != "
                         f"{b.placements}")
    if not torch.equal(local(a), local(b)):
        diff = (local(a).double() - local(b).double()).abs().max().item()
        raise SystemExit(f"rank {rank} {name}: {what} differs from eager (max |diff| {diff:.3g})")


def same_grad(p, q, what, rank, name):
    """p.grad as eager's q.grad; where eager's is Partial (a sequence-parallel
    norm's weight, reduced by the optimizer), p's is the sum it stands for,
    of the parameter's placements (Note [DTensor parameters in per-layer
    graphs] in cgraph/_dtensor.py)."""
    a, b = p.grad, q.grad
    if hasattr(b, "placements") and a.placements != b.placements and any(
            x.is_partial() for x in b.placements):
        if a.placements != p.placements:
            raise SystemExit(f"rank {rank} {name}: {what} placements {a.placements}, not the "
                             f"parameter's {p.placements}")
        a, b = a.full_tensor(), b.full_tensor()
    same(a, b, what, rank, name)


def compile_layers(model):
    """Each block's forward compiled on the instance, as README advises for a
    block to be graphed (cgraph runs it on the leaves of its DTensors)."""
    for layer in model.layers:
        layer.forward = torch.compile(layer.forward)
    return model


@contextlib.contextmanager
def as_captured(step, compiled):
    """Eager's twin of compiled layers runs under the state cgraph warms up
    and captures under (autocast's weight cache off, which dynamo guards
    on), so both twins run the code of one compile; from the second step on,
    a recompile raises (a replay runs no compiled code, and eager's twin
    runs what it compiled at the first)."""
    if not compiled:
        yield
        return
    cache = torch.is_autocast_cache_enabled()
    torch.set_autocast_cache_enabled(False)
    try:
        with torch._dynamo.config.patch(error_on_recompile=step > 0):
            yield
    finally:
        torch.set_autocast_cache_enabled(cache)


def per_layer(rank, name, meshes, dp_rank, sp=False, compiled=False):
    eager, model = parallel(*meshes, sp=sp), parallel(*meshes, sp=sp)
    if compiled:
        eager, model = compile_layers(eager), compile_layers(model)
    model.layers = nn.ModuleList(cgraph.make_graphed(layer) for layer in model.layers)
    opts = [adamw(m) for m in (eager, model)]
    for step in range(STEPS):
        tokens, targets = batch(step, dp_rank)
        with as_captured(step, compiled):
            losses = [backward_of(m, tokens, targets) for m in (eager, model)]
        same(losses[1], losses[0], f"step {step} loss", rank, name)
        for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
            same_grad(p, q, f"step {step} grad {k}", rank, name)
        for opt in opts:
            opt.step()
            opt.zero_grad()
    for k, (p, q) in enumerate(zip(model.parameters(), eager.parameters())):
        same(p, q, f"parameter {k}", rank, name)
    replays = [layer.stats["forward"] for layer in model.layers]
    if min(replays) < STEPS - 1:
        raise SystemExit(f"rank {rank} {name}: layers replayed {replays} in {STEPS} steps")
    print(f"rank {rank} {name}: losses, DTensor grads and parameters equal to eager over "
          f"{STEPS} steps, layers replayed {replays}: OK", flush=True)
    cgraph.reset_all()


def whole_step(rank, name, meshes, dp_rank, sp=False, fail_at=None):
    """The step graphed whole against eager's.  With `fail_at` ("before the
    forward" or "after the backward"), its first capture fails there on the
    last rank (an error planted): every rank raises at that call, naming
    that rank and its error (Note [A capture that fails on one rank] in
    cgraph/_ranks.py), and the next call captures again; eager's twin skips
    that call's batch (a failed capture runs no kernel).  Before the
    forward, the other ranks captured collectives the failed one never
    issued."""
    world = dist.get_world_size()
    models = [parallel(*meshes, sp=sp), parallel(*meshes, sp=sp)]
    opts = [adamw(m, fused=True) for m in models]
    armed = [fail_at is not None and rank == world - 1]

    def plant(model, where):
        if (where == fail_at and armed[0] and model is models[1]
                and torch.cuda.is_current_stream_capturing()):
            armed[0] = False
            raise RuntimeError("planted at capture")

    def train_step(model, opt):
        def step(tokens, targets):
            opt.zero_grad()
            plant(model, "before the forward")
            loss = backward_of(model, tokens, targets, as_dtensor=sp)  # sp: a DTensor
            plant(model, "after the backward")
            opt.step()
            return loss
        return step

    eager = train_step(models[0], opts[0])
    graphed = cgraph.make_graphed_step(train_step(models[1], opts[1]), batch(0, dp_rank))
    steps, failed = 7, []
    for step in range(steps):
        tokens, targets = batch(step, dp_rank)
        try:
            loss = graphed(tokens, targets)
        except RuntimeError as e:
            said = " ".join([str(e), *getattr(e, "__notes__", [])])
            named = world == 1 or f"failed on rank(s) [{world - 1}]" in said
            if not (fail_at and "planted at capture" in said and named):
                raise
            failed.append(step)
            continue
        same(loss, eager(tokens, targets), f"step {step} loss", rank, name)
    for k, (p, q) in enumerate(zip(models[1].parameters(), models[0].parameters())):
        same(p, q, f"parameter {k}", rank, name)
    # After 3 eager steps the capture (DTensor shards and modes as captured:
    # no recapture); after a failed one, at the next call, eager no more.
    want = {"eager": 3, "captures": 1, "replays": steps - 3 - len(failed)}
    if graphed.stats != want or failed != ([3] if fail_at else []):
        raise SystemExit(f"rank {rank} {name}: {graphed.stats} (want {want}), raised at steps "
                         f"{failed}")
    raised = f"raised on every rank at step 3, naming rank {world - 1}; " if fail_at else ""
    print(f"rank {rank} {name}: {raised}losses and parameters equal to eager over {steps} "
          f"steps, {graphed.stats}: OK", flush=True)
    graphed.reset()


def random_op_on_a_dtensor_is_refused(rank, name, tp_mesh):
    """Dropout on a DTensor inside a graphed step: DTensor's RNG tracker moves
    the generator's offset on the host around the op, which a replay would
    not repeat; the capture is refused (rng_changed), naming the fix."""
    torch.manual_seed(0)  # the same weights and input on every rank
    model = nn.Sequential(nn.Linear(DIM, DIM), nn.Dropout(0.1), nn.Linear(DIM, DIM)).cuda()
    parallelize_module(model, tp_mesh, {"0": ColwiseParallel(use_local_output=False),
                                        "2": RowwiseParallel()})
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)

    def step(x):
        opt.zero_grad()
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        return loss

    x = torch.randn(BATCH, DIM, device="cuda")
    graphed = cgraph.make_graphed_step(step, (x,))
    try:
        for _ in range(5):
            graphed(x)
    except cgraph.CaptureError as e:
        if e.kind != "rng_changed" or "use_local_output=True" not in str(e):
            raise SystemExit(f"rank {rank} {name}: refused as {e.kind}: {e}") from e
        print(f"rank {rank} {name}: refused ({e.kind}), naming use_local_output: OK",
              flush=True)
        graphed.reset()
    else:
        raise SystemExit(f"rank {rank} {name}: graphed, {graphed.stats}")


def main():
    dist.init_process_group("nccl")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    torch.backends.cuda.matmul.allow_tf32 = False
    tp = (init_device_mesh("cuda", (world,)), None)
    per_layer(rank, "TP per-layer graphs", tp, 0)
    whole_step(rank, "TP whole step", tp, 0)
    per_layer(rank, "TP+SP per-layer graphs", tp, 0, sp=True)
    per_layer(rank, "TP compiled per-layer graphs", tp, 0, compiled=True)
    random_op_on_a_dtensor_is_refused(rank, "TP dropout on a DTensor in a graphed step", tp[0])
    whole_step(rank, "TP+SP whole step, loss-parallel head", tp, 0, sp=True)
    for where in ("before the forward", "after the backward"):
        whole_step(rank, f"TP whole step, a capture failing on one rank {where}", tp, 0,
                   fail_at=where)
    if world == 4:
        mesh = init_device_mesh("cuda", (2, 2), mesh_dim_names=("dp", "tp"))
        two_d = (mesh["tp"], mesh["dp"])
        dp_rank = mesh["dp"].get_local_rank()
        per_layer(rank, "FSDP2 x TP per-layer graphs", two_d, dp_rank)
        whole_step(rank, "FSDP2 x TP whole step", two_d, dp_rank)
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} teardown: OK", flush=True)


if __name__ == "__main__":
    main()

"""DDP on two GPUs with cgraph: from the repository root after a build,

    PYTHONPATH=. torchrun --nproc_per_node=2 examples/ddp.py

Two recipes, each checked against an eager DDP twin (same weights, same
data, same comm hook), gradients compared bit for bit:

1. graphed layers inside DDP: each block is graphed on its own, then the
   model is wrapped.  DDP's hooks fire as each block's backward graph
   replays, so the allreduce of late blocks overlaps the backward of earlier
   ones (checked: the first bucket is reduced before the last block's
   backward replays).
2. a graphed DDP model: cgraph.make_graphed(ddp_model, ...) graphs the
   wrapped module and returns the DDP object, so DDP's per-call bookkeeping
   and hooks run as usual.

No collective is captured into a graph: they run from DDP's hooks between
and after replays.  So none of the full-step-capture precautions apply
(11 warm-up iterations, DDP built on a side stream,
TORCH_NCCL_ASYNC_ERROR_HANDLING=0).  Teardown: cgraph.reset_all() and then
dist.destroy_process_group().  A step graphed whole, its allreduce inside the
graph: examples/ddp_step.py.
"""

import os

import torch
import torch.distributed as dist
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

import cgraph

WIDTH, DEPTH, BATCH, STEPS = 256, 6, 32, 4


def blocks():
    torch.manual_seed(0)  # the same weights on every rank
    return nn.Sequential(*[nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.GELU())
                           for _ in range(DEPTH)]).cuda()


def allreduce_mean(probe=lambda: None):
    """The comm hook both twins use, so their reductions are the same math.
    `probe` runs when a bucket is handed to the hook."""

    def hook(state, bucket):
        probe()
        buffer = bucket.buffer().div_(dist.get_world_size())
        return dist.all_reduce(buffer, async_op=True).get_future().then(lambda f: f.value()[0])

    return hook


def wrap(model, hook):
    ddp = DDP(model, device_ids=[torch.cuda.current_device()], bucket_cap_mb=0.3)
    ddp.register_comm_hook(None, hook)
    return ddp


def train_and_compare(name, graphed, eager, graphed_params, eager_params, rank,
                      on_step=lambda step: None):
    for step in range(STEPS):
        torch.manual_seed(1000 * step + rank)  # different data per rank
        x = torch.randn(BATCH, WIDTH, device="cuda")
        upstream = torch.randn(BATCH, WIDTH, device="cuda")
        on_step(step)
        for model in (eager, graphed):
            (model(x) * upstream).sum().backward()
        for k, (p, q) in enumerate(zip(graphed_params, eager_params)):
            if not torch.equal(p.grad, q.grad):
                raise SystemExit(f"rank {rank} {name}: step {step} grad {k} differs from eager DDP")
            p.grad, q.grad = None, None
    print(f"rank {rank} {name}: grads equal to eager DDP over {STEPS} steps: OK", flush=True)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    sample = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)

    # 1. Graphed layers inside DDP.
    eager = wrap(blocks(), allreduce_mean())
    model = blocks()
    layers = cgraph.make_graphed_callables(tuple(model), tuple((sample,) for _ in model))
    replays = lambda: sum(layer.forward.stats["backward"] for layer in layers)  # noqa: E731
    at_step_start, at_buckets = [0], []  # backward replays, per step and per bucket

    def on_step(step):
        at_step_start[0] = replays()
        at_buckets.clear()

    graphed = wrap(model, allreduce_mean(lambda: at_buckets.append(replays() - at_step_start[0])))
    train_and_compare("graphed layers in DDP", graphed, eager, list(model.parameters()),
                      list(eager.module.parameters()), rank, on_step)
    # Overlap, in the last step: the first bucket reached the hook while
    # some blocks' backward graphs had not replayed yet.
    if not at_buckets or at_buckets[0] >= DEPTH:
        raise SystemExit(f"rank {rank}: no overlap: buckets reduced after {at_buckets} of "
                         f"{DEPTH} backward graphs")
    print(f"rank {rank} overlap: buckets reduced after {at_buckets} of {DEPTH} backward "
          "graphs had replayed: OK", flush=True)

    # 2. A graphed DDP model.
    eager2 = wrap(blocks(), allreduce_mean())
    ddp = wrap(blocks(), allreduce_mean())
    ddp = cgraph.make_graphed(ddp, (sample,))
    assert isinstance(ddp, DDP)
    train_and_compare("graphed DDP model", ddp, eager2, list(ddp.module.parameters()),
                      list(eager2.module.parameters()), rank)

    cgraph.reset_all()
    dist.barrier()
    dist.destroy_process_group()
    print(f"rank {rank} teardown: reset_all + destroy_process_group: OK", flush=True)


if __name__ == "__main__":
    main()

"""Where the sharded workload's memory sits: for each variant, rank 0's peak
reserved and allocated memory during set-up (the eager steps, compiles and
captures before the step is timed) and over five steps after it, and the
reserved bytes of each memory pool at the end (pool (0, 0) is the caching
allocator's default; a graph's private pool is another).  The model, regimes
and variants are benchmarks/sharded.py's, FSDP2 layout.  Run with torchrun,
from the repository root after a build::

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m benchmarks.sharded_memory --regimes small,large

It splits what benchmarks.sharded reports as one peak: a graphed step whose
set-up peak is above eager's but whose steady peak is not holds memory only
while it captures (benchmarks/README.md, "sharded").  A variant name ending
in ``+zeroed`` sets the model's grads to None before each call up to the
capturing one, as the step's own first line does: the capture then does not
hold the last warm-up step's grads in the default pool beside its own in
the graph's.  Peaks are above what was reserved after the last variant was
cleared away (printed as the base; about zero).
"""

from __future__ import annotations

import argparse
import collections
import gc

import torch
import torch.distributed as dist

import cgraph
from benchmarks import sharded

GIB = 2**30
VARIANTS = ("eager", "cgraph-step", "cgraph-step+zeroed", "cgraph-layer")


def by_pool() -> dict:
    """Reserved GiB of each memory pool on this device."""
    pools: collections.Counter = collections.Counter()
    for segment in torch.cuda.memory_snapshot():
        pools[tuple(segment.get("segment_pool_id", (0, 0)))] += segment["total_size"]
    return {pool: round(size / GIB, 2) for pool, size in pools.items()}


def peaks(since: tuple[int, int]) -> tuple[float, float]:
    """(reserved, allocated) peak GiB above `since`, then resets the peaks."""
    out = ((torch.cuda.max_memory_reserved() - since[0]) / GIB,
           (torch.cuda.max_memory_allocated() - since[1]) / GIB)
    torch.cuda.reset_peak_memory_stats()
    return out


def clear() -> tuple[int, int]:
    """Frees what the last variant left (its FSDP2 model's reference cycles,
    the cuBLAS workspaces torch keeps per stream, cached segments) and
    returns (reserved, allocated) bytes now: the base the peaks are above."""
    gc.collect()
    if hasattr(torch._C, "_cuda_clearCublasWorkspaces"):
        torch._C._cuda_clearCublasWorkspaces()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    return torch.cuda.memory_reserved(), torch.cuda.memory_allocated()


def measure(variant: str, meshes, ids) -> str:
    name, _, suffix = variant.partition("+")
    if name not in sharded.VARIANTS or suffix not in ("", "zeroed"):
        raise ValueError(f"unknown variant {variant!r}: one of {sharded.VARIANTS}, "
                         "optionally with '+zeroed'")
    base = clear()
    model = sharded.build("fsdp", meshes)
    step = sharded.prepare(name, model, ids)
    for _ in range(sharded.SETUP_STEPS + 1):
        # Up to the capturing call: after it the grads are the graph's.
        if suffix and getattr(step, "stats", {}).get("captures") == 0:
            model.zero_grad(set_to_none=True)
        step(ids)
    setup = peaks(base)
    torch.cuda.empty_cache()  # the steady window starts from what the step holds
    torch.cuda.reset_peak_memory_stats()
    for _ in range(5):
        step(ids)
    torch.cuda.synchronize()
    steady = peaks(base)
    line = (f"{variant}: base {base[0] / GIB:.2f} GiB; set-up peak reserved {setup[0]:.2f} "
            f"(allocated {setup[1]:.2f}), steady peak reserved {steady[0]:.2f} (allocated "
            f"{steady[1]:.2f}); reserved by pool, absolute {by_pool()}")
    cgraph.reset_all()
    del model, step
    return line


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--regimes", default="small")
    args = parser.parse_args()
    meshes = sharded.start()
    for regime in args.regimes.split(","):
        ids = sharded.batch_of(regime, dist.get_rank())
        for variant in args.variants.split(","):
            line = measure(variant, meshes, ids)
            if dist.get_rank() == 0:
                print(f"{regime} {line}", flush=True)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

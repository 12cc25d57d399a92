"""How busy the GPU is in the sharded workload's step: what a graph of the
same kernels can take off it.  The model, layouts, regimes and variants are
benchmarks/sharded.py's.  Run with torchrun, from the repository root after
a build::

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m benchmarks.sharded_gpu --regimes large --variants eager,cgraph-step

Each variant sets up as in benchmarks/sharded.py, times --steps steps
without the profiler (the step's wall time), then records --profiled steps
with ``torch.profiler`` and reads rank 0's device timeline: *busy* is the
union of every kernel, copy and memset on the device, over all streams;
*compute* the union of all but NCCL's kernels; *NCCL exposed* what NCCL's
kernels add to compute's union (communication nothing else overlaps);
*idle* the wall time less busy.  A CUDA graph replays the kernels eager
launches, so it can take the idle time off the step and no more: busy / wall
is about the least step time, as a share of this variant's, that graphing
these kernels can reach (about: the profiler stretches what it traces, and
NCCL's kernels count as busy while they wait for the other ranks).  Meant
for the GPU-bound regime: at a host-bound batch NCCL's kernels mostly wait
for the other ranks' hosts, which the profiler slows too, and busy exceeds
the unprofiled wall time (170% for eager at the small batch on 2 x H200).
"""

from __future__ import annotations

import argparse
import gc
import json
import tempfile

import torch
import torch.distributed as dist
from torch.profiler import ProfilerActivity, profile

import cgraph
from benchmarks import sharded

ACTIVITY = ("kernel", "gpu_memcpy", "gpu_memset")


def union(spans: list[tuple[float, float]]) -> float:
    """The length of the union of [start, end) spans."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(spans):
        if end > reach:
            total += end - max(start, reach)
            reach = end
    return total


def timeline(prof) -> dict[str, float]:
    """busy, compute and NCCL-exposed microseconds over the profiled steps,
    from the device's activity in the trace."""
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        with open(f.name) as trace:
            events = json.load(trace)["traceEvents"]
    # Rank 0 profiles its own device only; an event without a device is its.
    device = torch.cuda.current_device()
    spans = [(e["ts"], e["ts"] + e["dur"], "nccl" in e["name"].lower()) for e in events
             if e.get("cat") in ACTIVITY and "dur" in e
             and e.get("args", {}).get("device", device) == device]
    if not spans:
        raise RuntimeError("the profiler recorded no device activity; is CUPTI available?")
    busy = union([(a, b) for a, b, _ in spans])
    compute = union([(a, b) for a, b, nccl in spans if not nccl])
    return {"busy": busy, "compute": compute, "nccl exposed": busy - compute,
            "nccl": sum(b - a for a, b, nccl in spans if nccl)}


def measure(variant, layout, meshes, regime, steps, profiled, dp_rank):
    ids = sharded.batch_of(regime, dp_rank)
    try:  # a variant that fails (a row saying why) leaves no graphs to the next
        model, step = sharded.set_up(variant, layout, meshes, ids)
        wall = sharded.seconds_per_step(step, ids, steps) * 1e6
        dist.barrier()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            for _ in range(profiled):
                step(ids)
            torch.cuda.synchronize()
        spans = {k: v / profiled for k, v in timeline(prof).items()}
        del model, step, prof
    finally:
        cgraph.reset_all()
    gc.collect()
    torch.cuda.empty_cache()
    return wall, spans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("fsdp", "2d"), default="fsdp")
    parser.add_argument("--variants", default="eager,cgraph-step")
    parser.add_argument("--regimes", default="large")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--profiled", type=int, default=3)
    args = parser.parse_args()
    meshes = sharded.start(args.layout)
    rank = dist.get_rank()
    lines = []
    for regime in args.regimes.split(","):
        for variant in args.variants.split(","):
            try:
                wall, s = measure(variant, args.layout, meshes, regime, args.steps,
                                  args.profiled, meshes[0].get_local_rank())
                ms = {k: v / 1e3 for k, v in s.items()}
                cells = (f"{wall / 1e3:.1f} | {ms['busy']:.1f} ({s['busy'] / wall:.0%}) | "
                         f"{max(wall - s['busy'], 0) / 1e3:.1f} | {ms['compute']:.1f} | "
                         f"{ms['nccl']:.1f} | {ms['nccl exposed']:.1f}")
            except Exception as e:  # noqa: BLE001 -- a failed variant is a row
                cells = sharded.failed(e)
            lines.append(f"| {regime} | {variant} | {cells} |")
            if rank == 0:
                print(lines[-1], flush=True)
    sharded.finish(f"sharded_gpu, layout {args.layout}, {dist.get_world_size()} x "
                   f"{torch.cuda.get_device_name()}, torch {torch.__version__}, rank 0, ms per "
                   f"step ({args.steps} timed, {args.profiled} profiled)",
                   ("regime", "variant", "wall", "busy (of wall)", "idle", "compute",
                    "NCCL kernels", "NCCL exposed"), lines)


if __name__ == "__main__":
    main()

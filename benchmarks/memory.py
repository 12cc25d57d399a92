"""Where one variant's reserved memory goes.

    python3 -m benchmarks.memory WORKLOAD VARIANT [--steps N]
    python3 -m benchmarks.memory varlen VARIANT [--steps N]

Sets the variant up as :mod:`benchmarks.variant` does (the process's one-time
costs paid first and freed) or, for ``varlen``, as :mod:`benchmarks.varlen`
does; runs ``--steps`` training steps (varlen: cycles through its shapes);
then prints the peak reserved and allocated memory and the segments of
``torch.cuda.memory_snapshot()`` grouped by owner (``eager``: the device's
own cache; ``pool (a, b)``: a graph pool), stream and kind of segment
(``small``: the 2 MiB segments of blocks up to 1 MiB; ``large``: the 20 MiB
segments of blocks up to 10 MiB; ``huge``: a segment per larger block).  For
``varlen``, ``--steps`` is at least one cycle, so every shape's graphs exist.
Each group: MiB reserved, MiB allocated and how many segments.

A diagnostic, not a benchmark: one process, one set-up.  The breakdowns in
benchmarks/README.md ("Where the reserved memory goes") come from it.
"""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Callable, Iterable

import torch

MIB = 2**20
SMALL_SEGMENT, LARGE_SEGMENT = 2 * MIB, 20 * MIB


@dataclasses.dataclass
class Group:
    """The segments of one owner, stream and kind."""

    reserved_mib: float = 0.0
    allocated_mib: float = 0.0
    segments: int = 0


def _kind(seg: dict) -> str:
    size = seg["total_size"]
    if seg.get("segment_type", "small" if size <= SMALL_SEGMENT else "large") == "small":
        return "small"
    return "large" if size == LARGE_SEGMENT else "huge"


def group_segments(snapshot: Iterable[dict]) -> dict[tuple[str, str, str], Group]:
    """Segments of ``torch.cuda.memory_snapshot()`` by (owner, stream, kind).
    Streams are named by first appearance (the default stream is
    ``default``), since their handles mean nothing to a reader."""
    streams: dict[int, str] = {0: "default"}
    groups: dict[tuple[str, str, str], Group] = {}
    for seg in snapshot:
        pool = tuple(seg.get("segment_pool_id") or (0, 0))
        owner = "eager" if pool == (0, 0) else f"pool {pool}"
        stream = streams.setdefault(seg["stream"], f"stream {len(streams)}")
        group = groups.setdefault((owner, stream, _kind(seg)), Group())
        group.reserved_mib += seg["total_size"] / MIB
        group.allocated_mib += seg["allocated_size"] / MIB
        group.segments += 1
    return dict(sorted(groups.items()))


def _train(workload: str, variant: str, steps: int) -> Callable[..., object]:
    """Sets ``variant`` up and trains ``steps`` steps; returns the step, which
    keeps the model, its optimizer and its graphs alive for the snapshot."""
    if workload == "varlen":
        from .varlen import _steps, trainer

        step, _ = trainer(variant)
        torch.cuda.reset_peak_memory_stats()
        shapes = _steps()
        for k in range(max(steps, len(shapes))):  # every shape at least once
            step(shapes[k % len(shapes)])
        return step
    from .variant import _pay_one_time_costs
    from .workloads import WORKLOADS, build, prepare

    _pay_one_time_costs(workload)
    problem = build(WORKLOADS[workload])
    torch.cuda.reset_peak_memory_stats()
    step = prepare(problem, variant)
    for _ in range(steps):
        step()
    return step


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.memory",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("workload", help="a workload of benchmarks.workloads, or varlen")
    parser.add_argument("variant")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("memory: no CUDA device; run this on a machine with an NVIDIA GPU.")
        return 0
    step = _train(args.workload, args.variant, args.steps)
    torch.cuda.synchronize()
    print(f"{args.workload} {args.variant}: peak reserved "
          f"{torch.cuda.max_memory_reserved() / MIB:.1f} MiB, peak allocated "
          f"{torch.cuda.max_memory_allocated() / MIB:.1f} MiB; segments now:")
    for (owner, stream, kind), g in group_segments(torch.cuda.memory_snapshot()).items():
        print(f"  {owner:<14} {stream:<10} {kind:<6} {g.reserved_mib:7.1f} MiB reserved "
              f"{g.allocated_mib:7.1f} allocated  {g.segments:3d} segments")
    del step  # alive until here: its tensors are what "allocated" counts
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Where a training step's host time goes, phase by phase.

    python3 -m benchmarks.breakdown [--workloads W,...] [--variants V,...] [--steps N]

For each (workload, variant) it runs the step of :mod:`benchmarks.workloads`
split into its phases (``zero_grad``, ``forward``, ``loss``, ``backward``,
``step`` for the optimizer workloads; ``forward``, ``sum``, ``backward`` for
the overhead ones), drains the GPU before each phase, and prints the median
host time of each: what enqueueing that phase costs the CPU.  It also times a
few primitives of this host (one ATen op, one raw graph replay, the autograd
engine's least backward) so the phases can be read against them.

A diagnostic, not a benchmark: all variants share one process, and phases
timed apart add up to more than the step (each starts from an idle GPU).
The ratios that count come from :mod:`benchmarks.run`.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .variant import _times
from .workloads import WORKLOADS, _forward, _loss, build

DEFAULT_VARIANTS = "eager,torch-mgc-whole,cgraph-whole,cgraph-layer"


def _median_us(fn: Callable[[], object], steps: int) -> float:
    """Median host µs of ``fn``, each call after a synchronize (the runner's
    host loop)."""
    return statistics.median(_times(fn, steps, wait_for_gpu=False)) * 1e6


def primitives(steps: int) -> dict[str, float]:
    """Host µs of a few things every step is made of, on this host."""
    x = torch.randn(8, 16, device="cuda")
    leaf = torch.randn(8, 16, device="cuda", requires_grad=True)
    graph = torch.cuda.CUDAGraph()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        x.add_(1)
    torch.cuda.synchronize()
    with torch.cuda.graph(graph):
        x.add_(1)
    return {
        "aten x.add_(1)": _median_us(lambda: x.add_(1), steps),
        "graph.replay() (1 kernel)": _median_us(graph.replay, steps),
        "leaf.sum().backward()": _median_us(lambda: leaf.sum().backward(), steps),
    }


def phases(problem, variant: str) -> list[tuple[str, Callable[[], object]]]:
    """The step of ``variant`` on ``problem`` as named phases, run in order."""
    forward = _forward(problem, variant)
    x, y = problem.x, problem.y
    state: dict[str, torch.Tensor] = {}
    if problem.optimizer is None:
        return [
            ("forward", lambda: state.__setitem__("out", forward(x))),
            ("sum", lambda: state.__setitem__("loss", state.pop("out").sum())),
            ("backward", lambda: state.pop("loss").backward()),
        ]
    opt = problem.optimizer(problem.model.parameters())
    return [
        ("zero_grad", lambda: opt.zero_grad(set_to_none=True)),
        ("forward", lambda: state.__setitem__("out", forward(x))),
        ("loss", lambda: state.__setitem__("loss", _loss(state.pop("out"), y))),
        ("backward", lambda: state.pop("loss").backward()),
        ("step", opt.step),
    ]


def breakdown(workload: str, variant: str, steps: int, warmup: int) -> dict[str, float]:
    """Median host µs per phase of ``variant``'s step on ``workload``."""
    steps_of = phases(build(WORKLOADS[workload]), variant)
    for _ in range(warmup):
        for _, fn in steps_of:
            fn()
    times: dict[str, list[float]] = {name: [] for name, _ in steps_of}
    for _ in range(steps):
        for name, fn in steps_of:
            torch.cuda.synchronize()
            start = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m benchmarks.breakdown",
                                     description=__doc__.strip().splitlines()[0])
    parser.add_argument("--workloads", default="overhead-32,mlp,gpt-6")
    parser.add_argument("--variants", default=DEFAULT_VARIANTS)
    parser.add_argument("--steps", type=int, default=100)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("breakdown: no CUDA device; run this on a machine with an NVIDIA GPU.")
        return 0
    print("primitives, host µs: " + ", ".join(
        f"{k} {v:.1f}" for k, v in primitives(args.steps).items()), flush=True)
    for workload in args.workloads.split(","):
        for variant in args.variants.split(","):
            if variant not in WORKLOADS[workload].variants or variant.startswith("floor"):
                continue
            try:
                row = breakdown(workload, variant, args.steps, warmup=10)
            except Exception as e:  # noqa: BLE001 -- a diagnostic: report and go on
                print(f"{workload:<12} {variant:<24} error: {type(e).__name__}: {e}")
                continue
            cells = "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
            print(f"{workload:<12} {variant:<24} sum {sum(row.values()):7.1f} | {cells}",
                  flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

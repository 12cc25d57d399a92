"""Where a training step's time goes, phase by phase.

    python3 -m benchmarks.breakdown [--workloads W,...] [--variants V,...] [--steps N]

For each (workload, variant) it runs the step of :mod:`benchmarks.workloads`
split into its phases (``zero_grad``, ``forward``, ``loss``, ``backward``,
``step`` for the optimizer workloads; ``forward``, ``sum``, ``backward`` for
the overhead ones) and prints two lines:

* ``host``: the median host time of each phase, the GPU drained before each:
  what enqueueing that phase costs the CPU;
* ``waits``: how long the GPU waits for the host during each phase of a
  whole step run from an idle GPU, as the runner's wall loop runs it: the
  phase's GPU time (CUDA events between the phases) minus the same with the
  host far ahead (a sleep kernel first, so every launch is queued before the
  GPU gets there).  What the step's wall time has beyond its GPU time is
  the sum of these waits, which name the phases that make a step
  host-bound.  Each wait includes the host time of recording one event
  (a few µs).

It also times a few primitives of this host (one ATen op, one raw graph
replay, the autograd engine's least backward, with and without its device
threads) so the phases can be read against them.

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
    times = {
        "aten x.add_(1)": _median_us(lambda: x.add_(1), steps),
        "graph.replay() (1 kernel)": _median_us(graph.replay, steps),
        "leaf.sum().backward()": _median_us(lambda: leaf.sum().backward(), steps),
    }
    # The engine hands CUDA work to a device thread and waits for it: the
    # difference is the price of those two thread switches.
    with torch.autograd.set_multithreading_enabled(False):
        times["same, on the calling thread"] = _median_us(lambda: leaf.sum().backward(), steps)
    return times


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


def gpu_waits(workload: str, variant: str, steps: int, warmup: int,
              host_us: float) -> dict[str, float]:
    """Median µs the GPU waits for the host in each phase of ``variant``'s
    step on ``workload`` (see the module docstring), plus ``gpu`` (the
    step's GPU time with the host ahead) and ``wall`` (its GPU time from an
    idle GPU, event to event).  ``host_us``: about the step's host time, to
    size the sleep that puts the host ahead."""
    # torch.cuda._sleep counts GPU cycles (under 2 GHz): twice the host time.
    sleep_cycles = int(4000 * max(host_us, 500.0))
    steps_of = phases(build(WORKLOADS[workload]), variant)
    for _ in range(warmup):
        for _, fn in steps_of:
            fn()
    events = [torch.cuda.Event(enable_timing=True) for _ in range(len(steps_of) + 1)]
    spans = {ahead: [[] for _ in range(len(steps_of) + 1)] for ahead in (False, True)}
    for i in range(2 * steps):
        ahead = bool(i % 2)
        torch.cuda.synchronize()
        if ahead:
            torch.cuda._sleep(sleep_cycles)
        events[0].record()
        for (_, fn), event in zip(steps_of, events[1:], strict=True):
            fn()
            event.record()
        torch.cuda.synchronize()
        for k, (start, end) in enumerate(zip(events, events[1:])):
            spans[ahead][k].append(start.elapsed_time(end) * 1e3)
        spans[ahead][-1].append(events[0].elapsed_time(events[-1]) * 1e3)
    real = [statistics.median(t) for t in spans[False]]
    ahead = [statistics.median(t) for t in spans[True]]
    waits = {name: max(r - a, 0.0) for (name, _), r, a in zip(steps_of, real, ahead)}
    return {**waits, "gpu": ahead[-1], "wall": real[-1]}


def _print_row(workload: str, variant: str, what: str, row: dict[str, float]) -> None:
    cells = "  ".join(f"{k} {v:7.1f}" for k, v in row.items())
    print(f"{workload:<12} {variant:<24} {what:<6} {cells}", flush=True)


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
                host = breakdown(workload, variant, args.steps, warmup=10)
                waits = gpu_waits(workload, variant, args.steps, warmup=10,
                                  host_us=sum(host.values()))
            except Exception as e:  # noqa: BLE001 -- a diagnostic: report and go on
                print(f"{workload:<12} {variant:<24} error: {type(e).__name__}: {e}")
                continue
            _print_row(workload, variant, "host", {**host, "sum": sum(host.values())})
            _print_row(workload, variant, "waits", waits)
    return 0


if __name__ == "__main__":
    sys.exit(main())

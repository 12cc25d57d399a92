"""Set-up time of a graphed training step against the raw floor's, by phase.

``python3 -m benchmarks.step_setup gpt-6`` sets up ``floor`` and
``cgraph-step`` six times each in one process, alternating which goes first,
and prints each set-up's time and, for the step, its phases: the eager
warm-up calls (real training steps), the capture, and the replay that makes
the capturing call a training step too (the floor's set-up trains no step).
Then the floor's own phases once: its side-stream warm-up and its capture.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

from . import variant, workloads

ROUNDS = 6


def _timed(phases: dict, cls, name: str) -> None:
    """Wraps cls.name to add its synchronized time to phases[name]."""
    original = getattr(cls, name)

    def timed(self, *args, **kwargs):
        torch.cuda.synchronize()
        start = time.perf_counter()
        result = original(self, *args, **kwargs)
        torch.cuda.synchronize()
        phases.setdefault(name, []).append(time.perf_counter() - start)
        return result

    setattr(cls, name, timed)


def _floor_phases(workload: str) -> tuple[float, float]:
    """The floor's side-stream warm-up and capture, in seconds."""
    problem = workloads.build(workloads.WORKLOADS[workload])
    model, x, y = problem.model, problem.x, problem.y
    opt = problem.optimizer(model.parameters(), capturable=True)

    def whole_step() -> None:
        workloads._loss(model(x), y).backward()
        opt.step()

    def warm_up_step() -> None:
        opt.zero_grad(set_to_none=True)
        whole_step()

    torch.cuda.synchronize()
    start = time.perf_counter()
    workloads._warm_up_on_side_stream(warm_up_step)
    torch.cuda.synchronize()
    warmed = time.perf_counter()
    graph = torch.cuda.CUDAGraph()
    opt.zero_grad(set_to_none=True)
    with torch.cuda.graph(graph):
        whole_step()
    torch.cuda.synchronize()
    return warmed - start, time.perf_counter() - warmed


def main(workload: str) -> None:
    from cgraph._step import GraphedStep

    variant._pay_one_time_costs(workload)
    phases: dict[str, list[float]] = {}
    for name in ("_run_eagerly", "_capture", "_warm_up_or_capture"):
        _timed(phases, GraphedStep, name)
    totals: dict[str, list[float]] = {"floor": [], "cgraph-step": []}
    for r in range(ROUNDS):
        for v in ("floor", "cgraph-step") if r % 2 == 0 else ("cgraph-step", "floor"):
            phases.clear()
            seconds = variant._timed_setup(workload, v)[2]
            totals[v].append(seconds)
            line = f"round {r} {v:11s} {seconds * 1e3:6.1f} ms"
            if v == "cgraph-step":
                eager, capture = sum(phases["_run_eagerly"]), sum(phases["_capture"])
                replay = sum(phases["_warm_up_or_capture"]) - eager - capture
                line += (f": eager steps {eager * 1e3:.1f}, capture {capture * 1e3:.1f}, "
                         f"the capturing call's replay {replay * 1e3:.1f}")
            print(line, flush=True)
    for v, seconds in totals.items():
        print(f"{v}: median {statistics.median(seconds) * 1e3:.1f} ms, "
              f"range {min(seconds) * 1e3:.1f}-{max(seconds) * 1e3:.1f}")
    warm_up, capture = _floor_phases(workload)
    print(f"floor phases: side-stream warm-up {warm_up * 1e3:.1f} ms, capture {capture * 1e3:.1f} ms")


if __name__ == "__main__":
    if len(sys.argv) != 2 or sys.argv[1] not in workloads.WORKLOADS:
        sys.exit(f"usage: python3 -m benchmarks.step_setup WORKLOAD (one of "
                 f"{', '.join(workloads.WORKLOADS)})")
    main(sys.argv[1])

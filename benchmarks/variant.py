"""Measure one variant of one workload, in a process of its own.

    python3 -m benchmarks.variant WORKLOAD VARIANT '{"steps": 200, "warmup": 20}'

Prints one JSON object as the last line of stdout.  The runner starts one
such process per variant, so a CUDA error, a crash or leftover allocator
state in one variant cannot affect the others.  An exception propagates
(non-zero exit, traceback on stderr); the runner records it as an error row.

What is measured, all on the current CUDA device:

* ``setup_s``: :func:`benchmarks.workloads.prepare`, synchronized before and
  after: graph warm-up and capture, or compilation (about 0 for eager).
  One-time costs that every variant pays once per process, whoever comes
  first, are paid before the clock starts: CUDA and cuBLAS initialization
  (an eager step of the model on a throwaway copy, whose memory is then
  freed), importing ``torch._dynamo`` (the first optimizer, torch.compile
  and torch's make_graphed_callables each import it: seconds on a cold
  host) and importing cgraph.  For the graph variants (``torch-mgc-*``,
  ``cgraph-*``), whose setup takes tens of milliseconds, it is the median
  of ``SETUP_REPEATS`` set-ups on fresh copies of the model, the first
  being the one whose steps are timed; torch.compile's later set-ups would
  hit its cache, so compile variants are set up once.
* ``host_us``: median time to enqueue one step: synchronize, then
  ``perf_counter`` around the step with no synchronize inside.
* ``wall_us``: median time of one step until the GPU has finished it:
  synchronize, then ``perf_counter`` around the step and a synchronize.
  This is the step of a loop that synchronizes every step (``loss.item()``
  for logging): the GPU idles while the host runs up to its first launch,
  and wherever the host falls behind.
* ``pipe_us``: time per step of steps run back to back, synchronized only
  before the first and after the last: the step of a loop that never
  synchronizes, where the host runs ahead across steps, so a step costs
  about the larger of its host and its GPU time.  The median over rounds.
  The host, wall and pipelined loops alternate in ``ROUNDS`` rounds.
* ``peak_mib``: ``torch.cuda.max_memory_allocated`` over setup, warm-up and
  both timed loops (peak stats reset after the model and inputs exist, so it
  counts them, the optimizer state, activations and graph pools).
* ``peak_reserved_mib``: ``torch.cuda.max_memory_reserved`` over the same
  span.  A graph's temporaries are free blocks of its pool, so they count as
  reserved, not allocated: for graphed variants this is the fairer figure.

Both timed loops run ``steps`` steps in all, after ``warmup`` untimed steps.
"""

from __future__ import annotations

import gc
import json
import statistics
import sys
import time
from collections.abc import Callable

import torch

from .workloads import WORKLOADS, Problem, build, prepare

SETUP_REPEATS = 5  # set-ups timed per graph variant (see the module docstring)
ROUNDS = 5  # the host, wall and pipelined loops alternate in this many rounds


def _times(step: Callable[[], object], steps: int, wait_for_gpu: bool) -> list[float]:
    times = []
    for _ in range(steps):
        torch.cuda.synchronize()
        start = time.perf_counter()
        step()
        if wait_for_gpu:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
    return times


def _pipelined(step: Callable[[], object], steps: int) -> float:
    """Seconds per step of ``steps`` steps with no synchronize between them."""
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(steps):
        step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / steps


def _step_times_us(step: Callable[[], object], steps: int) -> tuple[float, float, float]:
    """Median host, wall and pipelined time per step (µs) of ``steps``
    steps each, the three loops interleaved in ``ROUNDS`` rounds so that a
    slow spell of the host (it is shared) weighs on all alike."""
    host, wall, pipe = [], [], []
    for r in range(ROUNDS):
        n = steps // ROUNDS + (r < steps % ROUNDS)
        host += _times(step, n, wait_for_gpu=False)
        wall += _times(step, n, wait_for_gpu=True)
        if n:
            pipe.append(_pipelined(step, n))
    return tuple(statistics.median(t) * 1e6 for t in (host, wall, pipe))


def _pay_one_time_costs(workload: str) -> None:
    """What the first variant of a process would otherwise pay inside its
    setup time (see the module docstring)."""
    import torch._dynamo  # noqa: F401

    try:
        import cgraph  # noqa: F401
    except ImportError:  # not built: only the cgraph variants fail, as error rows
        pass
    prepare(build(WORKLOADS[workload]), "eager")()
    torch.cuda.synchronize()
    # Its memory must not count as the variant's: that includes the cuBLAS
    # workspaces it left on the default stream, which each variant makes for
    # itself (eager mode one per thread; cgraph one that its graphs share
    # with eager GEMMs: Note [One cuBLAS workspace per stream]).
    torch._C._cuda_clearCublasWorkspaces()
    gc.collect()
    torch.cuda.empty_cache()


def _timed_setup(workload: str, variant: str) -> tuple[Problem, Callable[[], object], float]:
    """A fresh copy of the workload (keep it alive while the step runs: raw
    graphs read its inputs), the variant's step on it, and the seconds the
    set-up took."""
    problem = build(WORKLOADS[workload])
    torch.cuda.synchronize()
    start = time.perf_counter()
    step = prepare(problem, variant)
    torch.cuda.synchronize()
    return problem, step, time.perf_counter() - start


def measure(workload: str, variant: str, steps: int, warmup: int) -> dict:
    """One result row: setup, host and wall time per step, peak memory."""
    _pay_one_time_costs(workload)
    torch.cuda.reset_peak_memory_stats()
    problem, step, setup_s = _timed_setup(workload, variant)
    for _ in range(warmup):
        step()
    host_us, wall_us, pipe_us = _step_times_us(step, steps)
    row = {
        "workload": workload,
        "variant": variant,
        "host_us": host_us,
        "wall_us": wall_us,
        "pipe_us": pipe_us,
        "peak_mib": torch.cuda.max_memory_allocated() / 2**20,
        "peak_reserved_mib": torch.cuda.max_memory_reserved() / 2**20,
        "setup_s": setup_s,
        "device": torch.cuda.get_device_name(),
    }
    if variant.startswith(("torch-mgc-", "cgraph-")):
        setups = [setup_s] + [_timed_setup(workload, variant)[2]
                              for _ in range(SETUP_REPEATS - 1)]
        row["setup_s"] = statistics.median(setups)
    return row


def main(argv: list[str]) -> int:
    if len(argv) != 3:
        print("usage:", __doc__.strip().splitlines()[2].strip(), file=sys.stderr)
        return 2
    workload, variant, options = argv[0], argv[1], json.loads(argv[2])
    row = measure(workload, variant, steps=options["steps"], warmup=options["warmup"])
    print(json.dumps(row), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

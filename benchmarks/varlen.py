"""The ``varlen`` workload: shapes that change between steps.

    python3 -m benchmarks.varlen                 # every variant, 2 processes each
    python3 -m benchmarks.varlen --variants eager,cgraph-whole --repeats 3

The gpt-6 model (benchmarks/workloads.py) trained with sequence lengths
cycling through ``LENGTHS``, batch ``BATCH`` but ``LAST_BATCH`` on the last
step of each cycle (a short last batch), AdamW (fused).  Variants:

* ``eager``;
* ``compile-default``, ``compile-dynamic`` (``dynamic=True``) and
  ``compile-reduce-overhead`` (cudagraph trees: a graph per shape);
* ``cgraph-layer`` / ``cgraph-whole``: each block, or the whole model,
  graphed with ``cgraph.make_graphed`` and no samples: a graph per shape,
  captured on its first call;
* ``cgraph-layer-pool``: the blocks graphed with one ``pool=``: each block
  captures on its first call with new shapes, every block's graphs in that
  pool (Note [One pool for separately graphed callables] in
  cgraph/_group.py);
* ``cgraph-layer-buckets`` / ``cgraph-whole-buckets``: the same with
  ``buckets={0: [BATCH], 1: BUCKETS}``: calls padded up to the bucket
  (exact: rows are independent and attention is causal) and outputs sliced;
  ``cgraph-layer-pool-buckets``: the blocks with one ``pool=`` and buckets.

Each variant runs in a process of its own: ``WARM_CYCLES`` untimed cycles
(compilation, captures), then ``cycles`` timed ones, synchronized per step.
Reported per variant: mean step time, graphs captured (cgraph), and peak
allocated and reserved memory over the whole run against eager's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

import torch
import torch.nn.functional as F

LENGTHS = (128, 96, 64, 112)
BATCH, LAST_BATCH = 8, 5
BUCKETS = (64, 128)
WARM_CYCLES = 2
VARIANTS = ("eager", "compile-default", "compile-dynamic", "compile-reduce-overhead",
            "cgraph-layer", "cgraph-layer-pool", "cgraph-whole", "cgraph-layer-buckets",
            "cgraph-layer-pool-buckets", "cgraph-whole-buckets")
VOCAB = 1024


def _steps():
    """(batch, length) of each step of one cycle."""
    return [(LAST_BATCH if i == len(LENGTHS) - 1 else BATCH, t) for i, t in enumerate(LENGTHS)]


def _prepare(variant: str):
    """The model and what the step calls as its forward; the graphed
    callables, to count their graphs."""
    from .workloads import GPT

    torch.manual_seed(0)
    model = GPT(6, VOCAB, 256, 4, max(LENGTHS)).cuda()
    if variant == "eager":
        return model, model, []
    if variant.startswith("compile-"):
        kind = variant.removeprefix("compile-")
        if kind == "dynamic":
            return model, torch.compile(model, dynamic=True), []
        return model, torch.compile(model, mode=kind), []
    import cgraph

    kwargs = {"buckets": {0: [BATCH], 1: list(BUCKETS)}} if variant.endswith("-buckets") else {}
    if variant.startswith("cgraph-layer"):
        if variant.startswith("cgraph-layer-pool"):  # the blocks' graphs share one pool
            kwargs["pool"] = cgraph.graph_pool_handle()
        blocks = [cgraph.make_graphed(b, **kwargs) for b in model.blocks]
        model.blocks = torch.nn.Sequential(*blocks)
        return model, model, blocks
    graphed = cgraph.make_graphed(model, **kwargs)
    return model, graphed, [graphed]


def trainer(variant: str):
    """A training step of ``variant`` for a given (batch, length) of
    :func:`_steps`, with its data made; and the graphed callables."""
    model, forward, graphed = _prepare(variant)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    data = {(b, t): (torch.randint(0, VOCAB, (b, t), device="cuda"),
                     torch.randint(0, VOCAB, (b, t), device="cuda")) for b, t in _steps()}

    def step(shape):
        x, y = data[shape]
        opt.zero_grad(set_to_none=True)
        F.cross_entropy(forward(x).flatten(0, -2), y.flatten()).backward()
        opt.step()

    return step, graphed


def measure(variant: str, cycles: int) -> dict:
    torch.cuda.init()
    step, graphed = trainer(variant)
    torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for _ in range(WARM_CYCLES):
        for shape in _steps():
            step(shape)
    torch.cuda.synchronize()
    warm_s = time.perf_counter() - started
    times = []
    for _ in range(cycles):
        for shape in _steps():
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            step(shape)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - t0)
    mib = 2**20
    return {"variant": variant, "step_us": 1e6 * sum(times) / len(times),
            "warm_s": warm_s, "graphs": sum(g.num_graphs for g in graphed) if graphed else None,
            "eager_calls": sum(g.stats["eager_past_limit"] for g in graphed) if graphed else None,
            "peak_mib": torch.cuda.max_memory_allocated() / mib,
            "reserved_mib": torch.cuda.max_memory_reserved() / mib}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--cycles", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2, help="processes per variant (fastest kept)")
    p.add_argument("--one", help=argparse.SUPPRESS)  # measure one variant, print its JSON
    a = p.parse_args(argv)
    if a.one:
        print(json.dumps(measure(a.one, a.cycles)))
        return 0
    variants = a.variants.split(",")
    best: dict[str, dict] = {}
    for r in range(a.repeats):
        for v in (variants if r % 2 == 0 else variants[::-1]):  # alternate the order
            proc = subprocess.run([sys.executable, "-m", "benchmarks.varlen", "--one", v,
                                   "--cycles", str(a.cycles)], capture_output=True, text=True)
            if proc.returncode != 0:
                best.setdefault(v, {"variant": v, "error": proc.stderr.strip()[-300:]})
                continue
            row = json.loads(proc.stdout.strip().splitlines()[-1])
            if "step_us" not in best.get(v, {}) or row["step_us"] < best[v]["step_us"]:
                best[v] = row
    _print(variants, best)
    return 0


def _print(variants, best) -> None:
    eager = best.get("eager", {})
    print(f"varlen: gpt-6, lengths {LENGTHS}, batch {BATCH} (last step {LAST_BATCH}), "
          f"buckets {BUCKETS}; {torch.cuda.get_device_name()}, torch {torch.__version__}")
    print(f"{'variant':26s} {'step µs':>9s} {'warm s':>7s} {'graphs':>6s} {'peak/eager':>10s} "
          f"{'resv/eager':>10s}")
    for v in variants:
        row = best.get(v, {})
        if "error" in row or not row:
            print(f"{v:26s} error: {row.get('error', 'missing')[-200:]}")
            continue
        ratio = (lambda k: f"{row[k] / eager[k]:.2f}x" if k in eager else "-")
        graphs = "-" if row["graphs"] is None else str(row["graphs"])
        print(f"{v:26s} {row['step_us']:9.1f} {row['warm_s']:7.2f} {graphs:>6s} "
              f"{ratio('peak_mib'):>10s} {ratio('reserved_mib'):>10s}")


if __name__ == "__main__":
    sys.exit(main())

"""Run the benchmarks: every variant of every workload, each in a process of
its own, then a table, a JSON file and a chart.

    python3 -m benchmarks.run [--workloads W,...] [--variants V,...]
                              [--steps N] [--repeats R] [--quick] [--out DIR]

Per variant (see :mod:`benchmarks.variant` for how each is measured): median
host, wall and pipelined time per step in µs, peak allocated memory in MiB
and setup time in s, plus the ratios

* wall/torch, host/torch: to torch's make_graphed_callables on the same
  workload (``torch-mgc-whole``; for workloads graphed only per layer, such
  as gpt-24, ``torch-mgc-layer``);
* wall/floor, pipe/floor: to the raw-CUDA-graph floor of the same workload,
  for a step from an idle GPU (wall) and for steps back to back (pipe).

Each variant runs in ``--repeats`` processes (default 3), the variants
taking turns, and its row is that of the process with the least wall time:
see :func:`best_of` for why.  ``spread`` is its slowest process's wall time
over its fastest's.

Writes ``results.json`` and ``chart.png`` (if matplotlib is installed) to
``--out`` (default benchmarks/results/), and copies them to ``$OUT`` when that
is set.  A variant that fails or crashes becomes a row with an ``error``; the
runner still exits 0.  Without a CUDA device it says so and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch

from .workloads import VARIANTS, WORKLOADS, smallest_workloads

STEPS, WARMUP, REPEATS = 200, 20, 3
QUICK_STEPS, QUICK_WARMUP, QUICK_REPEATS = 10, 3, 1
VARIANT_TIMEOUT_S = 300  # generous for a cold torch.compile of gpt-6
REPO_ROOT = Path(__file__).resolve().parent.parent
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
RATIOS = ("wall_vs_torch", "wall_vs_floor", "pipe_vs_floor", "host_vs_torch", "peak_vs_eager",
          "mem_vs_eager")


# ---- what to run -------------------------------------------------------------


def plan(workloads: str | None, variants: str | None, quick: bool) -> list[tuple[str, str]]:
    """(workload, variant) pairs to run, in catalogue order.

    ``workloads`` and ``variants`` are comma lists (None: all; with ``quick``,
    the smallest workload of each family).  A workload may be named by its
    family ("overhead": every overhead size).  Each workload runs only the
    requested variants that apply to it.  Raises ValueError on unknown names
    or an empty plan.
    """
    if workloads is None:
        chosen = set(smallest_workloads() if quick else WORKLOADS)
    else:
        chosen = set()
        for name in workloads.split(","):
            matches = {w.name for w in WORKLOADS.values() if name in (w.name, w.family)}
            if not matches:
                raise ValueError(f"unknown workload {name!r}; the workloads are "
                                 f"{', '.join(WORKLOADS)}")
            chosen |= matches
    wanted = set(VARIANTS if variants is None else variants.split(","))
    unknown = sorted(wanted - set(VARIANTS))
    if unknown:
        raise ValueError(f"unknown variant(s) {', '.join(unknown)}; the variants are "
                         f"{', '.join(VARIANTS)}")
    pairs = [(w.name, v) for w in WORKLOADS.values() if w.name in chosen
             for v in w.variants if v in wanted]
    if not pairs:
        raise ValueError("none of the requested variants applies to the requested workloads")
    return pairs


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python3 -m benchmarks.run",
        description="Benchmark cgraph against eager, torch.compile, torch's "
                    "make_graphed_callables and a raw-CUDA-graph floor.")
    parser.add_argument("--workloads", help=f"comma list of {', '.join(WORKLOADS)} or "
                        "families (overhead, mlp, gpt); default: all, or the smallest of "
                        "each family with --quick")
    parser.add_argument("--variants", help=f"comma list of {', '.join(VARIANTS)}; "
                        "default: all that apply to each workload")
    parser.add_argument("--steps", type=int, help=f"timed steps per loop (default {STEPS}, "
                        f"{QUICK_STEPS} with --quick)")
    parser.add_argument("--repeats", type=int, help="processes per variant, the fastest "
                        f"reported (default {REPEATS}, {QUICK_REPEATS} with --quick)")
    parser.add_argument("--quick", action="store_true",
                        help="smoke test: smallest sizes, few steps")
    parser.add_argument("--out", type=Path, default=RESULTS_DIR,
                        help="folder for results.json and chart.png (default %(default)s)")
    args = parser.parse_args(argv)
    for name in ("steps", "repeats"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            parser.error(f"--{name} must be at least 1")
    try:
        args.plan = plan(args.workloads, args.variants, args.quick)
    except ValueError as e:
        parser.error(str(e))
    return args


# ---- running one variant ----------------------------------------------------


def run_variant(workload: str, variant: str, steps: int, warmup: int) -> dict:
    """One result row, measured by ``python -m benchmarks.variant`` in a
    subprocess; an error row if that fails, crashes or times out."""
    options = json.dumps({"steps": steps, "warmup": warmup})
    cmd = [sys.executable, "-m", "benchmarks.variant", workload, variant, options]
    try:
        proc = subprocess.run(cmd, cwd=REPO_ROOT, capture_output=True, text=True,
                              timeout=VARIANT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return {"workload": workload, "variant": variant,
                "error": f"timed out after {VARIANT_TIMEOUT_S} s"}
    if proc.returncode == 0:
        try:
            return json.loads(proc.stdout.strip().splitlines()[-1])
        except (IndexError, json.JSONDecodeError):
            pass
    stderr = proc.stderr.strip().splitlines()
    return {"workload": workload, "variant": variant,
            "error": f"exit code {proc.returncode}: {stderr[-1] if stderr else 'no result line'}",
            "stderr_tail": stderr[-15:]}


def best_of(repeats: list[dict]) -> dict:
    """One variant's row from the rows of its repeated processes: the row of
    the process with the least wall time (with that process's host time and
    memory), set-up time the median over the processes, and ``wall_spread``
    (slowest wall time over fastest).  The first error row if any process
    failed: a flaky variant is reported, not hidden.

    Why the fastest process: the lent machines are virtual machines whose
    vCPUs do not run at one speed, and one process can run all its Python up
    to twice as slowly as the next, for its whole life (measured on one H100
    host: the same variant's host time per step 314 µs in one process, 725
    in the next; a Python loop pinned to vCPU 0 or 3 ran 1.5 times slower
    than on vCPUs 7, 8 or 15).  That noise only ever adds time, it hits the host-bound
    rows (eager, graphed layers) and not the GPU-bound floors, and one
    process per variant left ratios to chance.  The least of a few repeats
    is the nearest to what the machine does undisturbed, which is why
    timeit reports the least of its repeats too; every variant is measured
    the same way, and ``spread`` shows how much noise there was.
    """
    errors = [r for r in repeats if "error" in r]
    if errors:
        return errors[0]
    best = min(repeats, key=lambda r: r["wall_us"])
    walls = [r["wall_us"] for r in repeats]
    return {**best, "setup_s": statistics.median(r["setup_s"] for r in repeats),
            "repeats": len(repeats), "wall_spread": max(walls) / min(walls)}


# ---- ratios, table, JSON, chart --------------------------------------------


def add_ratios(rows: list[dict]) -> list[dict]:
    """The rows with the ``RATIOS`` added: a row's time or memory over its
    reference's (the workload's ``torch_ref`` variant, ``floor`` or
    ``eager``) in the same workload; None for an error row, where the
    reference is missing or failed, or where either lacks the measure
    (results from before it was measured)."""
    ok = {(r["workload"], r["variant"]): r for r in rows if "error" not in r}

    def ratio(row: dict, ref_variant: str, key: str) -> float | None:
        ref = ok.get((row["workload"], ref_variant))
        if "error" in row or ref is None or row.get(key) is None or ref.get(key) is None:
            return None
        return row[key] / ref[key]

    out = []
    for row in rows:
        torch_ref = WORKLOADS[row["workload"]].torch_ref
        out.append({**row,
                    "wall_vs_torch": ratio(row, torch_ref, "wall_us"),
                    "wall_vs_floor": ratio(row, "floor", "wall_us"),
                    "pipe_vs_floor": ratio(row, "floor", "pipe_us"),
                    "host_vs_torch": ratio(row, torch_ref, "host_us"),
                    "peak_vs_eager": ratio(row, "eager", "peak_mib"),
                    "mem_vs_eager": ratio(row, "eager", "peak_reserved_mib")})
    return out


def torch_references(rows: list[dict]) -> dict[str, str]:
    """The "vs torch" reference variant of each workload in ``rows``."""
    return {r["workload"]: WORKLOADS[r["workload"]].torch_ref for r in rows}


_COLUMNS = (  # header, key, format
    ("host µs", "host_us", "{:.1f}"),
    ("wall µs", "wall_us", "{:.1f}"),
    ("pipe µs", "pipe_us", "{:.1f}"),
    ("peak MiB", "peak_mib", "{:.1f}"),
    ("resv MiB", "peak_reserved_mib", "{:.1f}"),
    ("setup s", "setup_s", "{:.2f}"),
    ("wall/torch", "wall_vs_torch", "{:.2f}x"),
    ("wall/floor", "wall_vs_floor", "{:.2f}x"),
    ("pipe/floor", "pipe_vs_floor", "{:.2f}x"),
    ("host/torch", "host_vs_torch", "{:.2f}x"),
    ("peak/eager", "peak_vs_eager", "{:.2f}x"),
    ("resv/eager", "mem_vs_eager", "{:.2f}x"),
    ("spread", "wall_spread", "{:.2f}x"),
)


def format_table(rows: list[dict]) -> str:
    """The rows (with ratios) as a fixed-width table and its footnote."""
    lines = [f"{'workload':<13} {'variant':<24}"
             + "".join(f" {header:>10}" for header, _, _ in _COLUMNS)]
    for row in rows:
        head = f"{row['workload']:<13} {row['variant']:<24}"
        if "error" in row:
            lines.append(f"{head} error: {row['error']}")
            continue
        cells = ("-" if row.get(key) is None else fmt.format(row[key]) for _, key, fmt in _COLUMNS)
        lines.append(head + "".join(f" {cell:>10}" for cell in cells))
    refs = torch_references(rows)
    default = "torch-mgc-whole"
    others = ", ".join(f"{w}: {v}" for w, v in refs.items() if v != default)
    lines += [
        "",
        f"wall/torch, host/torch: over {default} of the same workload"
        + (f" ({others})" if others else "")
        + "; wall/floor, pipe/floor: over floor of the same workload (wall: one step "
        "from an idle GPU; pipe: steps back to back, no synchronize between); peak/eager, "
        "resv/eager: peak allocated and peak reserved memory over eager's; spread: slowest "
        "process's wall time over the fastest's, whose row this is; -: reference missing "
        "or failed.",
    ]
    return "\n".join(lines)


def write_json(path: Path, rows: list[dict], meta: dict) -> None:
    path.write_text(json.dumps({"meta": meta, "results": rows}, indent=2) + "\n")


def draw_chart(rows: list[dict], path: Path, title: str) -> bool:
    """Wall time per step as horizontal bars, one group per workload, on a
    shared log scale; a dashed line marks each workload's floor.  Returns
    False (and says why) when there is no chart to draw."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        from matplotlib.ticker import FuncFormatter
    except ImportError:
        print("matplotlib is not installed: no chart (pip install matplotlib).")
        return False
    times = [r["wall_us"] for r in rows if "error" not in r]
    if not times:
        print("no successful variant: no chart.")
        return False
    lo, hi = min(times) / 2, max(times) * 5  # room for the labels right of the bars
    workloads = list(dict.fromkeys(r["workload"] for r in rows))
    groups = [[r for r in rows if r["workload"] == w] for w in workloads]
    colors = {v: plt.cm.tab10(i) for i, v in enumerate(VARIANTS)}
    colors["floor"] = "0.35"
    fig, axes = plt.subplots(
        len(groups), 1, sharex=True, squeeze=False,
        figsize=(10, 0.3 * len(rows) + 0.75 * len(groups) + 0.8),
        gridspec_kw={"height_ratios": [len(g) for g in groups]})
    for ax, workload, group in zip(axes[:, 0], workloads, groups, strict=True):
        ax.set_xscale("log")
        for y, row in enumerate(group):
            if "error" in row:
                ax.text(lo * 1.1, y, "error", va="center", fontsize=8, color="crimson")
                continue
            wall = row["wall_us"]
            ax.barh(y, wall - lo, left=lo, height=0.7, color=colors[row["variant"]])
            label = f"{wall:,.0f} µs"
            if row["variant"] != "floor" and row.get("wall_vs_floor") is not None:
                label += f"  ({row['wall_vs_floor']:.1f}x floor)"
            ax.text(wall * 1.06, y, label, va="center", fontsize=8)
            if row["variant"] == "floor":
                ax.axvline(wall, color="black", linestyle="--", linewidth=1)
        ax.set_yticks(range(len(group)), [r["variant"] for r in group], fontsize=9)
        ax.set_ylim(len(group) - 0.5, -0.5)
        ax.set_title(workload, loc="left", fontsize=10, fontweight="bold")
        ax.grid(axis="x", which="major", alpha=0.3)
    ax = axes[-1, 0]
    ax.set_xlim(lo, hi)
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _: f"{v:g}"))
    ax.set_xlabel("wall time per training step, µs (log scale, lower is better; "
                  "dashed line: floor)")
    fig.suptitle(title, fontsize=11)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return True


# ---- main ---------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("benchmarks: no CUDA device (torch.cuda.is_available() is False), so nothing "
              "to measure; run this on a machine with an NVIDIA GPU.")
        return 0
    steps = args.steps or (QUICK_STEPS if args.quick else STEPS)
    warmup = QUICK_WARMUP if args.quick else WARMUP
    repeats = args.repeats or (QUICK_REPEATS if args.quick else REPEATS)

    # The variants take turns, so a slow spell of the host falls on several
    # variants' processes rather than on all of one variant's.
    runs: dict[tuple[str, str], list[dict]] = {pair: [] for pair in args.plan}
    total = repeats * len(args.plan)
    for i, (workload, variant) in enumerate(args.plan * repeats, 1):
        start = time.perf_counter()
        row = run_variant(workload, variant, steps, warmup)
        result = (f"error: {row['error']}" if "error" in row
                  else f"{row['wall_us']:.1f} µs wall, {row['host_us']:.1f} µs host")
        print(f"[{i}/{total}] {workload} {variant}: {result} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)
        for line in row.get("stderr_tail", ()):
            print(f"    {line}", flush=True)
        runs[(workload, variant)].append(row)
    rows = add_ratios([best_of(runs[pair]) for pair in args.plan])

    device = next((r["device"] for r in rows if "device" in r), "unknown device")
    meta = {"device": device, "torch": torch.__version__, "python": platform.python_version(),
            "steps": steps, "warmup": warmup, "repeats": repeats,
            "torch_reference": torch_references(rows)}
    print(f"\n{device}, torch {torch.__version__}: medians of {steps} steps "
          f"after {warmup} warm-up steps, the fastest of {repeats} processes\n")
    print(format_table(rows))

    args.out.mkdir(parents=True, exist_ok=True)
    outputs = [args.out / "results.json"]
    write_json(outputs[0], rows, meta)
    if draw_chart(rows, args.out / "chart.png", f"Wall time per training step, {device}"):
        outputs.append(args.out / "chart.png")
    copy_to = os.environ.get("OUT")
    copy = bool(copy_to) and Path(copy_to).resolve() != args.out.resolve()
    for path in outputs if copy else ():
        shutil.copy(path, copy_to)
    print("\nwrote " + ", ".join(str(p) for p in outputs)
          + (f" (copied to {copy_to})" if copy else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

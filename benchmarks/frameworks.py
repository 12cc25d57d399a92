"""The frameworks workload: the same kind of small, host-bound model trained
through the Hugging Face Trainer, Lightning and an Accelerate loop, each
without cgraph and with its layers graphed, and Lightning's with its whole
step graphed too (the examples' own runs:
examples/hf_trainer.py, examples/lightning_callback.py,
examples/accelerate_loop.py), alternating in one process; Lightning's also
with the mlp configuration (lightning_mlp), whose step the host bounds most.  On one GPU, from
the repository root after a build::

    python3 -m benchmarks.frameworks --repeats 3               # host-bound
    python3 -m benchmarks.frameworks --repeats 3 --size large  # GPU-bound

Prints, per framework and variant, the median time per optimizer step over
the repeats (each repeat's own median over its steps after the fifth), the
spread of the repeats, and the ratio to the framework's eager time.  Every
graphed run is also checked equal to its eager twin (losses and
parameters), as the examples do; where eager itself is not deterministic
(two eager runs end apart: the GPT's attention backward at the large size),
no further from it than ten times that distance, printed.
"""

from __future__ import annotations

import argparse
import gc
import statistics

import torch

# lightning_mlp: Lightning's example with the mlp configuration of
# benchmarks/workloads.py (MLP there), the most host-bound step.
FRAMEWORKS = ("hf_trainer", "lightning_callback", "lightning_mlp", "accelerate_loop")


def runs(name: str, size: str = "small") -> dict:
    """The runs of the example `name` at `size` (examples/_compare.py's
    SIZES), by variant ("eager" first), each returning (losses or None,
    parameters, ms per step)."""
    if name not in FRAMEWORKS:
        raise SystemExit(f"unknown framework {name!r}: choose from {', '.join(FRAMEWORKS)}")
    if name == "lightning_mlp" and size != "small":
        raise SystemExit("lightning_mlp has one size (the mlp configuration): drop --size "
                         "or leave lightning_mlp out")
    if name == "hf_trainer":
        from cgraph.transformers import CUDAGraphsCallback
        from examples import hf_trainer
        return {"eager": lambda: hf_trainer.train([], size=size),
                "cgraph-layers": lambda: hf_trainer.train([CUDAGraphsCallback()], size=size)}
    if name in ("lightning_callback", "lightning_mlp"):
        from cgraph.lightning import CUDAGraphs
        from examples import lightning_callback
        model = "mlp" if name == "lightning_mlp" else "gpt"

        def run(*callbacks):
            return lambda: (None, *lightning_callback.train(list(callbacks), size=size,
                                                           model=model))

        return {"eager": run(), "cgraph-layers": run(CUDAGraphs()),
                "cgraph-step": run(CUDAGraphs(scope="step"))}
    from examples import accelerate_loop
    return {"eager": lambda: accelerate_loop.train(graphed=False, size=size),
            "cgraph-layers": lambda: accelerate_loop.train(graphed=True, size=size)}


def measure(name: str, repeats: int, size: str = "small") -> dict[str, list[float]]:
    """ms per step of each variant, `repeats` times, alternating; each
    graphed run checked equal to the eager run before it, or, where two
    eager runs differ (a nondeterministic kernel: the GPT's attention
    backward at the large size), no further from it than _NEAR times as far
    as they are from each other."""
    variants = runs(name, size)
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    spread = None  # how far apart two eager runs end: 0.0 where bitwise
    for _ in range(repeats):
        expected = _collected(variants["eager"])
        times["eager"].append(expected[2])
        if spread is None:
            spread = _distance(_collected(variants["eager"]), expected)
            if spread == float("inf"):
                raise SystemExit(f"{name}: two eager runs cannot be compared (NaN in one, "
                                 "or other shapes): nothing to check graphed runs against")
            if spread:
                print(f"{name}: two eager runs differ (max |diff| {spread:.3g}): graphed runs "
                      f"are checked within {_NEAR}x that", flush=True)
        for variant, run in variants.items():
            if variant == "eager":
                continue
            actual = _collected(run)
            distance = _distance(actual, expected)
            if distance > _NEAR * spread:
                raise SystemExit(f"{name}: the {variant} run's losses or parameters differ "
                                 f"from eager's (max |diff| {distance:.3g}, two eager runs "
                                 f"{spread:.3g})")
            times[variant].append(actual[2])
    return times


# How much further from eager than eager from itself a graphed run may end,
# where eager is not deterministic.
_NEAR = 10


def _collected(run):
    """A run from a clean slate: the last run's models (trainers keep
    reference cycles) and their graph pools collected first."""
    gc.collect()
    torch.cuda.empty_cache()
    return run()


def _distance(actual, expected) -> float:
    """The largest difference between two runs' parameters and losses: 0.0
    where they are bitwise equal, inf where they cannot be compared."""
    (losses, params, _), (losses_e, params_e, _) = actual, expected
    if len(params) != len(params_e) or not params:
        return float("inf")
    pairs = list(zip(params, params_e))
    if losses_e is not None:
        pairs.append((torch.as_tensor(losses), torch.as_tensor(losses_e)))
    distance = 0.0
    for a, b in pairs:
        if a.shape != b.shape:
            return float("inf")
        if not torch.equal(a, b):
            both_nan = a.isnan() & b.isnan()  # the same NaN in both: no distance
            diff = (a.double() - b.double()).abs().masked_fill(both_nan, 0).max().item()
            distance = max(distance, diff if diff == diff else float("inf"))  # NaN on one side
    return distance


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--frameworks", default=None,
                        help=f"comma-separated, of {', '.join(FRAMEWORKS)} (default: all; "
                        "with --size large, all but lightning_mlp, which has one size)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--size", choices=("small", "large"), default="small",
                        help="small: a host-bound step (the examples' own); large: a "
                        "GPU-bound one (examples/_compare.py's SIZES)")
    args = parser.parse_args()
    print(f"frameworks, {torch.cuda.get_device_name()}, torch {torch.__version__}, "
          f"{args.repeats} repeats, size {args.size}")
    print("| framework | variant | ms per step (spread) | / eager | steps/s |")
    print("|---|---|---|---|---|")
    names = (args.frameworks.split(",") if args.frameworks else
             [n for n in FRAMEWORKS if args.size == "small" or n != "lightning_mlp"])
    for name in names:
        times = measure(name, args.repeats, args.size)
        eager_ms = statistics.median(times["eager"])
        for variant, ms_list in times.items():
            ms = statistics.median(ms_list)
            print(f"| {name} | {variant} | {ms:.1f} ({min(ms_list):.1f}-{max(ms_list):.1f}) | "
                  f"{ms / eager_ms:.2f}x | {1e3 / ms:.1f} |", flush=True)


if __name__ == "__main__":
    main()

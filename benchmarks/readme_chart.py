"""Draws the README's chart (benchmarks/chart.png) from the README's table.

    python3 -m benchmarks.readme_chart

The numbers are the README's current table (wall µs per training step,
fastest of 3 processes on an H100, torch 2.11); update both together.
"""

from __future__ import annotations

from pathlib import Path

from .run import draw_chart

# workload -> {variant: wall µs}, as in the README's table.
TABLE = {
    "overhead-32": {"eager": 3417, "torch-mgc-whole": 1151, "cgraph-whole": 322,
                    "floor": 301},
    "mlp": {"eager": 2977, "torch-mgc-whole": 1131, "torch-mgc-layer": 1934,
            "cgraph-whole": 614, "cgraph-layer": 959, "floor": 409},
    "gpt-6": {"eager": 11866, "compile-reduce-overhead": 3921, "torch-mgc-whole": 2941,
              "torch-mgc-layer": 4011, "cgraph-whole": 2280, "cgraph-layer": 2746,
              "floor": 2153},
}


def rows() -> list[dict]:
    out = []
    for workload, walls in TABLE.items():
        for variant, wall in walls.items():
            out.append({"workload": workload, "variant": variant, "wall_us": float(wall),
                        "wall_vs_floor": wall / walls["floor"]})
    return out


if __name__ == "__main__":
    path = Path(__file__).with_name("chart.png")
    draw_chart(rows(), path, "cgraph vs eager, torch.compile and torch's "
               "make_graphed_callables (H100, torch 2.11)")
    print(f"wrote {path}")

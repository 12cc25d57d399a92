"""The demo: graph a small model, check it against eager, time a training step.

    python3 -m cgraph.demo

Prints whether cgraph matches eager bitwise, then the median time of one
forward+backward step for eager PyTorch, torch.cuda.make_graphed_callables
and cgraph, measured side by side.  Without a CUDA device it says so and
exits cleanly.
"""

import contextlib
import copy
import re
import statistics
import sys
import time
import warnings

import torch
from torch import nn

import cgraph

LAYERS, WIDTH, BATCH, STEPS = 16, 256, 32, 200
# torch's warning about its own graphs' backward (from torch's
# make_graphed_callables, run here only for comparison): 20 lines that are
# not the demo's result.
TORCH_MGC_WARNING = re.escape("The AccumulateGrad node's stream does not match")


def model() -> nn.Module:
    torch.manual_seed(0)
    blocks = []
    for _ in range(LAYERS):
        blocks += [nn.Linear(WIDTH, WIDTH), nn.GELU()]
    return nn.Sequential(*blocks).cuda()


def step_time(fn, x, upstream) -> float:
    """Median wall time of one synchronized forward+backward step, in µs."""
    times = []
    for i in range(STEPS + 20):
        torch.cuda.synchronize()
        start = time.perf_counter()
        (fn(x) * upstream).sum().backward()
        torch.cuda.synchronize()
        if i >= 20:
            times.append((time.perf_counter() - start) * 1e6)
    return statistics.median(times)


@contextlib.contextmanager
def torch_mgc_warning_silenced():
    """Around torch's make_graphed_callables and its steps only, so that any
    other warning, and any from cgraph, still shows."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=TORCH_MGC_WARNING, category=UserWarning)
        yield


def main() -> int:
    if not torch.cuda.is_available():
        print("cgraph demo: no CUDA device here (torch.cuda.is_available() is False); "
              "CUDA graphs need an NVIDIA GPU. Nothing to run.")
        return 0
    eager = model()
    ours = copy.deepcopy(eager)
    theirs = copy.deepcopy(eager)
    sample = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
    ours = cgraph.make_graphed_callables(ours, (sample,))
    with torch_mgc_warning_silenced():
        theirs = torch.cuda.make_graphed_callables(
            theirs, (sample.detach().clone().requires_grad_(),))

    x = torch.randn(BATCH, WIDTH, device="cuda", requires_grad=True)
    upstream = torch.randn(BATCH, WIDTH, device="cuda")
    out_e, out_c = eager(x), ours(x)
    (out_e * upstream).sum().backward()
    (out_c * upstream).sum().backward()
    same = torch.equal(out_e, out_c) and all(
        torch.equal(p.grad, q.grad) for p, q in zip(eager.parameters(), ours.parameters()))
    print(f"cgraph vs eager, {LAYERS}x Linear({WIDTH})+GELU, batch {BATCH}: "
          f"outputs and grads {'bitwise equal' if same else 'DIFFER'}")

    times = {"eager": step_time(eager, x, upstream)}
    with torch_mgc_warning_silenced():
        times["torch mgc"] = step_time(theirs, x, upstream)
    times["cgraph"] = step_time(ours, x, upstream)
    print(f"{'variant':<10} {'µs/step':>9} {'speed-up':>9}")
    for name, t in times.items():
        print(f"{name:<10} {t:9.1f} {times['eager'] / t:8.2f}x")
    print(f"cgraph is {times['torch mgc'] / times['cgraph']:.2f}x faster than "
          "torch.cuda.make_graphed_callables per step")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())

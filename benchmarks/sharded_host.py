"""Where the host time of the sharded workload's small-batch step goes, FSDP2
layout: the step split into forward, backward, optimizer step and the wait
for the GPU at its end, and within it the time spent in FSDP2's hooks and
in the decoder layers' forwards (eager compute, or the graphs' replays).
The model and regime are benchmarks/sharded.py's, and so are the variants
that run the step eagerly around their layers: ``eager`` and
``cgraph-layer`` (``compile`` and ``cgraph-compiled-layer`` run too, but
Dynamo traces the timing wrapper around a layer's forward).  Run with
torchrun, from the repository root after a build::

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 \\
        -m benchmarks.sharded_host --variants eager,cgraph-layer,eager,cgraph-layer

FSDP2's hooks are timed by wrapping the methods of torch's FSDPState and
FSDPParamGroup that its hooks call (before any model is built: the hooks
hold bound methods), counting only the outermost call; a layer's forward by
wrapping the ``forward`` FSDP's hooks run around.  Each figure is host time,
milliseconds per step, the mean over --steps steps, rank 0's; every step
starts on an idle GPU; "forward" includes ``zero_grad()``, and the hooks'
share of the step counts the wait for the GPU at its end in the step.
Per-layer graphs cannot take less host time than FSDP2's hooks, which they
leave to run around every layer as eager does (cgraph/_fsdp.py).
"""

from __future__ import annotations

import argparse
import collections
import functools
import gc
import time

import torch
import torch.distributed as dist
from torch.distributed.fsdp._fully_shard import _fsdp_param_group, _fsdp_state

from benchmarks import sharded

HOOKS = ((_fsdp_state.FSDPState, ("_pre_forward", "_post_forward", "_pre_backward",
                                  "_root_post_backward_final_callback")),
         (_fsdp_param_group.FSDPParamGroup, ("pre_backward", "post_backward")))
LAYER = "decoder layers' forwards"

spent: collections.Counter = collections.Counter()
_depth = [0]


def timed(key: str, fn):
    """fn, adding its time to spent[key] unless a timed call encloses it."""
    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if _depth[0]:
            return fn(*args, **kwargs)
        _depth[0] += 1
        started = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            spent[key] += time.perf_counter() - started
            _depth[0] -= 1
    return wrapper


def time_fsdp_hooks() -> None:
    for cls, names in HOOKS:
        for name in names:
            if hasattr(cls, name):  # torch releases differ
                setattr(cls, name, timed("FSDP2 " + name, getattr(cls, name)))


def measure(variant: str, meshes, steps: int) -> tuple[dict, dict]:
    """(phases, spent) in ms per step for one fresh model of `variant`."""
    ids = sharded.batch_of("small", dist.get_rank())
    model = sharded.build("fsdp", meshes)
    sharded.prepare(variant, model, ids)  # graphs the layers; its step is not used
    for layer in model.model.layers:
        inner = getattr(layer, "module", layer)  # a GraphedModule's, whose forward is the graph
        inner.forward = timed(LAYER, inner.forward)
    opt = sharded.optimizer(model)
    for _ in range(sharded.SETUP_STEPS + 2):
        opt.zero_grad()
        model(input_ids=ids, labels=ids).loss.backward()
        opt.step()
    spent.clear()
    phases: collections.Counter = collections.Counter()
    for _ in range(steps):
        torch.cuda.synchronize()
        dist.barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        opt.step()
        t3 = time.perf_counter()
        torch.cuda.synchronize()
        t4 = time.perf_counter()
        phases.update({"forward": t1 - t0, "backward": t2 - t1, "optimizer": t3 - t2,
                       "GPU wait": t4 - t3, "step": t4 - t0})
    per_step = {k: v / steps * 1e3 for k, v in phases.items()}
    hooks = {k: v / steps * 1e3 for k, v in sorted(spent.items())}
    del model, opt
    gc.collect()
    torch.cuda.empty_cache()
    return per_step, hooks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--variants", default="eager,cgraph-layer,eager,cgraph-layer")
    parser.add_argument("--steps", type=int, default=20)
    args = parser.parse_args()
    whole = [v for v in args.variants.split(",") if v.endswith(("-step", "-opt"))]
    if whole:
        parser.error(f"{', '.join(whole)}: this times eager optimizer steps and a graphed step "
                     "has no phases or hooks on the host to time; use benchmarks.sharded")
    time_fsdp_hooks()
    meshes = sharded.start()
    rank = dist.get_rank()
    for variant in args.variants.split(","):
        per_step, hooks = measure(variant, meshes, args.steps)
        if rank == 0:
            fsdp = sum(v for k, v in hooks.items() if k.startswith("FSDP2"))
            print(f"== {variant}, host ms per step (mean of {args.steps}): "
                  + ", ".join(f"{k} {v:.1f}" for k, v in per_step.items()))
            for key, ms in hooks.items():
                print(f"   {key:42s} {ms:6.2f}")
            print(f"   {'FSDP2 hooks, all':42s} {fsdp:6.2f} "
                  f"({fsdp / per_step['step']:.0%} of the step)", flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

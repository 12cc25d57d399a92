"""The sharded workload: a Llama (Hugging Face ``LlamaForCausalLM``, random
init, about 220M parameters: hidden 1024, 12 decoder layers) under FSDP2,
or under FSDP2 x TP on a 2-D mesh (TP inside pairs of GPUs, FSDP across
them, as torchtitan lays it out), bf16 parameters with fp32 reduction, one
training step (forward, loss, backward, fused AdamW) per call.  Run with
torchrun, from the repository root after a build::

    python3 -m torch.distributed.run --standalone --nproc_per_node=2 -m benchmarks.sharded
    python3 -m torch.distributed.run --standalone --nproc_per_node=4 -m benchmarks.sharded \\
        --layout 2d

Variants: ``eager``; ``compile`` (each decoder layer ``torch.compile``-d,
default mode, as torchtitan does); ``cgraph-layer`` (each decoder layer
``cgraph.make_graphed(layer, pool=pool)`` after sharding); ``cgraph-layer-opt``
(the same, and the optimizer step graphed on its own:
``cgraph.make_graphed_step(opt.step)``, grads zeroed, not set to None, between
steps); ``cgraph-step``
(``cgraph.make_graphed_step`` around the step: its collectives and the
optimizer inside the graph); ``cgraph-compiled-layer`` (each layer's forward
compiled on the instance, then graphed); ``cgraph-compiled-step`` (each
decoder layer compiled as in ``compile``, the step graphed whole).  Regimes: ``small`` (1 x 256
tokens per data-parallel rank: the host-bound regime) and ``large`` (8 x 4096:
GPU-bound).

Each variant builds a fresh model, sets up (eager steps, captures,
compiles), then times ``--steps`` steps ``--repeats`` times; the table (rank
0 prints it) has the median step time and the spread of the repeats,
tokens per second over all ranks, and rank 0's peak allocated and reserved
memory from set-up on (above what was allocated and reserved before it), each
also against eager's.
"""

from __future__ import annotations

import argparse
import gc
import os
import statistics
import time

import torch
import torch.distributed as dist
from torch import nn

import cgraph

CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
              max_position_embeddings=4096, use_cache=False)
REGIMES = {"small": (1, 256), "large": (8, 4096)}  # (batch, sequence) per data-parallel rank
VARIANTS = ("eager", "compile", "cgraph-layer", "cgraph-layer-opt", "cgraph-step",
            "cgraph-compiled-layer", "cgraph-compiled-step")
SETUP_STEPS = 4  # eager steps, or compiles, before timing; make_graphed_step captures at 4


def start(layout: str = "fsdp"):
    """For a script run under torchrun: the process group, this rank's GPU,
    and the meshes of `layout` (data-parallel, tensor-parallel or None)."""
    dist.init_process_group("nccl")
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", dist.get_rank())))
    from torch.distributed.device_mesh import init_device_mesh
    world = dist.get_world_size()
    if layout == "2d":
        mesh = init_device_mesh("cuda", (world // 2, 2), mesh_dim_names=("dp", "tp"))
        return mesh["dp"], mesh["tp"]
    return init_device_mesh("cuda", (world,)), None


def failed(e: Exception) -> str:
    """A variant's failure, as one table cell."""
    cause = f" Cause: {e.__cause__}" if e.__cause__ is not None else ""
    return f"failed: {type(e).__name__}: {e}{cause}"[:400].replace("\n", " ")


def finish(title: str, columns: tuple, lines: list) -> None:
    """Rank 0 prints the table of `lines`; every rank leaves the group."""
    if dist.get_rank() == 0:
        print(f"\n{title}\n| {' | '.join(columns)} |\n|{'---|' * len(columns)}")
        print("\n".join(lines))
    dist.barrier()
    dist.destroy_process_group()


def tp_plan():
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
    return {"self_attn.q_proj": ColwiseParallel(), "self_attn.k_proj": ColwiseParallel(),
            "self_attn.v_proj": ColwiseParallel(), "self_attn.o_proj": RowwiseParallel(),
            "mlp.gate_proj": ColwiseParallel(), "mlp.up_proj": ColwiseParallel(),
            "mlp.down_proj": RowwiseParallel()}


def unpadded_causal_attention() -> str:
    """An attention implementation for batches with neither padding nor packed
    sequences, registered with transformers: plain SDPA with
    ``is_causal=True`` and no mask, in eager and in captures alike.

    Why: transformers (5.17 to 5.24 at least) cannot skip the causal mask
    inside a CUDA stream capture.  Llama's forward passes ``position_ids``,
    and whether they hold packed sequences is a value it may not read while
    capturing, so a captured forward builds a dense 4-D mask and runs masked
    attention (cuDNN's kernels 3x slower at 8 x 4096 tokens on H100/H200;
    without cuDNN, memory-efficient attention instead of flash) where eager
    reads the values and passes ``is_causal=True``.  A name with no mask
    function registered makes transformers build no mask at all."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    AttentionInterface.register("sdpa_unpadded", sdpa_attention_forward)
    return "sdpa_unpadded"


def build(layout: str, meshes):
    """The model, sharded; every rank the same weights."""
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
    from torch.distributed.tensor.parallel import parallelize_module
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**CONFIG, attn_implementation=unpadded_causal_attention())
    model = LlamaForCausalLM(config).cuda()
    dp, tp = meshes
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        if layout == "2d":
            parallelize_module(layer, tp, tp_plan())
        fully_shard(layer, mesh=dp, mp_policy=policy)
    fully_shard(model, mesh=dp, mp_policy=policy)
    return model


def optimizer(model):
    """Fused AdamW over groups of one kind each (plain, DTensor on a 1-D
    mesh, on a 2-D one), which a fused step must not mix."""
    kinds: dict = {}
    for p in model.parameters():
        kinds.setdefault(p.device_mesh.ndim if hasattr(p, "device_mesh") else 0, []).append(p)
    return torch.optim.AdamW([{"params": ps} for ps in kinds.values()], lr=1e-4, fused=True)


def prepare(variant: str, model, sample):
    """The step to time, set up as `variant` says."""
    layers = model.model.layers
    if variant in ("compile", "cgraph-compiled-step"):
        for layer in layers:
            layer.compile()
    elif variant in ("cgraph-layer", "cgraph-layer-opt", "cgraph-compiled-layer"):
        if variant == "cgraph-compiled-layer":
            for layer in layers:
                layer.forward = torch.compile(layer.forward)
        pool = cgraph.graph_pool_handle()
        model.model.layers = nn.ModuleList(cgraph.make_graphed(layer, pool=pool)
                                           for layer in layers)
    opt = optimizer(model)
    # cgraph-layer-opt: the optimizer step graphed on its own, its grads
    # zeroed in place (Note [Grads around a graphed step]: set to None,
    # FSDP2's new grads would be copied into the graph's, beside them).
    optimizer_step = cgraph.make_graphed_step(opt.step) if variant.endswith("-opt") else opt.step
    set_to_none = not variant.endswith("-opt")

    def step(ids):
        opt.zero_grad(set_to_none=set_to_none)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer_step()
        return loss

    graph_step = variant in ("cgraph-step", "cgraph-compiled-step")
    return cgraph.make_graphed_step(step, (sample,)) if graph_step else step


def batch_of(regime: str, dp_rank: int) -> torch.Tensor:
    """This data-parallel rank's token ids (a TP group shares them)."""
    batch, seq = REGIMES[regime]
    g = torch.Generator(device="cuda").manual_seed(dp_rank)
    return torch.randint(0, CONFIG["vocab_size"], (batch, seq), device="cuda", generator=g)


def set_up(variant: str, layout: str, meshes, ids):
    """A fresh model and the step `variant` makes of it, past its set-up
    (eager steps, captures, compiles)."""
    model = build(layout, meshes)
    step = prepare(variant, model, ids)
    for _ in range(SETUP_STEPS + 1):
        step(ids)
    return model, step


def seconds_per_step(step, ids, steps: int) -> float:
    """Wall time per step over `steps` steps, all ranks starting together
    on an idle GPU."""
    torch.cuda.synchronize()
    dist.barrier()
    started = time.perf_counter()
    for _ in range(steps):
        step(ids)
    torch.cuda.synchronize()
    return (time.perf_counter() - started) / steps


def measure(variant, layout, meshes, regime, steps, repeats, dp_rank):
    ids = batch_of(regime, dp_rank)
    gc.collect()  # the last variant's FSDP2 model: its hooks make reference cycles
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = (torch.cuda.memory_allocated(), torch.cuda.memory_reserved())  # NCCL's, the ids
    try:  # a variant that fails (a row saying why) leaves no graphs to the next
        model, step = set_up(variant, layout, meshes, ids)
        times = [seconds_per_step(step, ids, steps) for _ in range(repeats)]
        memory = (torch.cuda.max_memory_allocated() - base[0],
                  torch.cuda.max_memory_reserved() - base[1])
        del model, step
    finally:
        cgraph.reset_all()
    return times, memory


def row(variant, regime, result, eager, tokens):
    if isinstance(result, str):
        return f"| {regime} | {variant} | {result} | | | | | |"
    times, (alloc, reserved) = result
    ms = statistics.median(times) * 1e3
    spread = f"{min(times) * 1e3:.1f}-{max(times) * 1e3:.1f}"
    if isinstance(eager, str):
        return f"| {regime} | {variant} | {ms:.1f} ({spread}) | | {tokens / ms * 1e3:,.0f} | " \
               f"{alloc / 2**30:.2f} | {reserved / 2**30:.2f} | |"
    e_ms = statistics.median(eager[0]) * 1e3
    e_alloc, e_res = eager[1]
    return (f"| {regime} | {variant} | {ms:.1f} ({spread}) | {ms / e_ms:.2f}x | "
            f"{tokens / ms * 1e3:,.0f} | {alloc / 2**30:.2f} ({alloc / e_alloc:.2f}x) | "
            f"{reserved / 2**30:.2f} ({reserved / e_res:.2f}x) |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--layout", choices=("fsdp", "2d"), default="fsdp")
    parser.add_argument("--variants", default=",".join(VARIANTS))
    parser.add_argument("--regimes", default=",".join(REGIMES))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    meshes = start(args.layout)
    rank, world = dist.get_rank(), dist.get_world_size()
    dp_rank = meshes[0].get_local_rank()
    lines = []
    for regime in args.regimes.split(","):
        batch, seq = REGIMES[regime]
        tokens = batch * seq * meshes[0].size()  # a TP group shares its batch
        eager = None
        for variant in args.variants.split(","):
            try:
                result = measure(variant, args.layout, meshes, regime, args.steps,
                                 args.repeats, dp_rank)
            except Exception as e:  # noqa: BLE001 -- a failed variant is a row
                result = failed(e)
            eager = result if variant == "eager" else eager
            lines.append(row(variant, regime, result, "n/a" if eager is None else eager,
                             tokens))
            if rank == 0:
                print(lines[-1], flush=True)
    finish(f"sharded, layout {args.layout}, {world} x {torch.cuda.get_device_name()}, torch "
           f"{torch.__version__}, {args.steps} steps x {args.repeats} repeats",
           ("regime", "variant", "step ms (spread)", "/ eager", "tokens/s",
            "peak allocated GiB", "peak reserved GiB"), lines)


if __name__ == "__main__":
    main()

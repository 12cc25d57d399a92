"""A Hugging Face Llama under FSDP2 with cgraph, on two GPUs or four: from the
repository root after a build,

    PYTHONPATH=. torchrun --nproc_per_node=2 examples/fsdp_llama.py

A LlamaForCausalLM of about 220M parameters (random init: hidden 1024, 12
decoder layers), every decoder layer and the root fully_shard-ed with bf16
parameters and fp32 gradient reduction (MixedPrecisionPolicy; the optimizer
steps fp32 shards), grads clipped to norm 1, AdamW, 20 steps, each rank its
own batch.  Four runs
from the same weights:

1. eager FSDP2, foreach AdamW: the reference for 2;
2. every decoder layer graphed after sharding
   (``cgraph.make_graphed(layer, pool=pool)``): FSDP's all-gathers and
   reduce-scatters run from its hooks around each layer's graphs;
3. eager FSDP2, fused AdamW: the reference for 4;
4. the whole training step graphed (``cgraph.make_graphed_step``), its
   collectives and the fused AdamW inside the graph.

Each rank checks that the losses of all 20 steps and the parameter shards
after them are bitwise equal to its reference's, and that each graphed run
gives back all the memory it allocated once its graphs are reset and its
model dropped; it prints one line per check (tests/test_fsdp.py reads them), with
each run's step time and peak memory.
"""

import gc
import os
import time

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from transformers import LlamaConfig, LlamaForCausalLM

import cgraph

STEPS, BATCH, SEQ = 20, 2, 256
CONFIG = dict(vocab_size=32000, hidden_size=1024, intermediate_size=2816,
              num_hidden_layers=12, num_attention_heads=16, num_key_value_heads=16,
              max_position_embeddings=SEQ, use_cache=False, attn_implementation="sdpa")


def llama():
    torch.manual_seed(0)  # the same weights on every rank and in every run
    model = LlamaForCausalLM(LlamaConfig(**CONFIG)).cuda()
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    for layer in model.model.layers:
        fully_shard(layer, mp_policy=policy)
    fully_shard(model, mp_policy=policy)
    return model


def batches(rank):
    g = torch.Generator(device="cuda").manual_seed(1000 + rank)  # each rank its own data
    return [torch.randint(0, CONFIG["vocab_size"], (BATCH, SEQ), device="cuda", generator=g)
            for _ in range(STEPS)]


def train_step(model, opt):
    def step(ids):
        opt.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        # Clipped as torchtitan and the Trainer do: the norm of DTensor grads,
        # all-reduced (inside the graph, where the step is graphed whole).
        nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        return loss
    return step


def allocated():
    """Memory allocated on this GPU, less torch's cuBLAS workspaces: torch
    keeps one per stream that ran a matmul, for the life of the process,
    and cgraph's set-ups drop those of the streams they captured on."""
    torch._C._cuda_clearCublasWorkspaces()
    return torch.cuda.memory_allocated()


def run(how, data):
    """Trains a fresh model `how` ("eager", "layers" or "step"), fused
    AdamW or not; returns the losses, the parameter shards, the mean step
    time of the last 10 steps and the peak memory.  Exits if a graphed run
    leaves memory allocated after its graphs are reset and its model
    dropped."""
    graphed, fused = how in ("layers", "step"), how.endswith("fused") or how == "step"
    before = allocated()
    model = llama()
    if how == "layers":
        pool = cgraph.graph_pool_handle()
        model.model.layers = nn.ModuleList(cgraph.make_graphed(layer, pool=pool)
                                           for layer in model.model.layers)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, fused=fused)
    step = train_step(model, opt)
    if how == "step":
        step = cgraph.make_graphed_step(step, (data[0],))
    torch.cuda.reset_peak_memory_stats()
    losses, times = [], []
    for ids in data:
        torch.cuda.synchronize()
        started = time.perf_counter()
        losses.append(step(ids).detach().cpu())
        torch.cuda.synchronize()
        times.append(time.perf_counter() - started)
    shards = [p.to_local().detach().cpu() for p in model.parameters()]  # off the GPU
    memory = (torch.cuda.max_memory_allocated(), torch.cuda.max_memory_reserved())
    if graphed and os.environ.get("CGRAPH_MEMORY"):  # where the graphs' memory goes
        pools = {tuple(p) for layer in model.model.layers for p in layer._graphed.pools} \
            if how == "layers" else {tuple(p) for p in step.graphed.pools}
        print(f"{how}: allocated now {torch.cuda.memory_allocated() / 2**30:.2f} GiB, "
              f"graph pools {cgraph._log.pool_mib(pools) / 1024:.2f} GiB", flush=True)
    if how == "step" and step.stats["captures"] != 1:  # shards and modes as captured
        raise SystemExit(f"rank {dist.get_rank()} step: {step.stats}, captured more than once")
    if graphed:
        cgraph.reset_all()
    del model, opt, step
    gc.collect()  # FSDP2's hooks hold a model in reference cycles
    left = allocated() - before
    if graphed and left > 0:  # an eager run may leave torch's one-time state (its reference)
        raise SystemExit(f"rank {dist.get_rank()} {how}: {left} bytes still allocated after "
                         "reset and dropping the model")
    torch.cuda.empty_cache()
    return losses, shards, sum(times[-10:]) / 10, memory


def compare(name, got, want, rank):
    for k, (a, b) in enumerate(zip(got[0], want[0])):
        if not torch.equal(a, b):
            raise SystemExit(f"rank {rank} {name}: step {k} loss {a.item()} != eager's {b.item()}")
    for k, (a, b) in enumerate(zip(got[1], want[1])):
        if not torch.equal(a, b):
            diff = (a.double() - b.double()).abs().max().item()
            raise SystemExit(f"rank {rank} {name}: parameter {k} differs (max |diff| {diff:.3g})")
    gib = 2**30
    print(f"rank {rank} {name}: {STEPS} losses and the parameters bitwise equal to eager "
          f"FSDP2's; step {got[2] * 1e3:.1f} ms vs {want[2] * 1e3:.1f} ms eager; peak "
          f"allocated {got[3][0] / gib:.2f} vs {want[3][0] / gib:.2f} GiB, reserved "
          f"{got[3][1] / gib:.2f} vs {want[3][1] / gib:.2f} GiB: OK", flush=True)


def main():
    dist.init_process_group("nccl")
    rank = dist.get_rank()
    torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", rank)))
    data = batches(rank)
    eager = run("eager", data)
    compare("llama, every decoder layer graphed", run("layers", data), eager, rank)
    eager_fused = run("eager-fused", data)
    compare("llama, the whole step graphed", run("step", data), eager_fused, rank)
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()

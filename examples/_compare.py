"""What the trainer examples (hf_trainer.py, lightning_callback.py,
accelerate_loop.py) print: whether the run with cgraph ended where the run
without it did, and the time per optimizer step of each; under torchrun, each
rank prints its own, prefixed with its rank."""

import os
from typing import NamedTuple

import torch


class Size(NamedTuple):
    """A model and batch size of the trainer examples."""

    width: int  # hidden size
    batch: int  # sequences per micro-batch
    tokens: int  # tokens per sequence


# "small": the examples' own, a step the host bounds (cgraph's case: 3-8x
# faster); "large": one the GPU bounds, where graphs can only match eager
# (benchmarks/frameworks.py --size large).
SIZES = {"small": Size(width=256, batch=4, tokens=128),
         "large": Size(width=1024, batch=8, tokens=1024)}


def llama(size: Size):
    """The random-init Llama of examples/hf_trainer.py and
    examples/accelerate_loop.py at `size`: 4 decoder layers, eager attention,
    no dropout, no cache (runs compare bitwise).  Seed first."""
    import transformers  # not needed by the Lightning example
    config = transformers.LlamaConfig(vocab_size=1024, hidden_size=size.width,
                                      intermediate_size=2 * size.width, num_hidden_layers=4,
                                      num_attention_heads=size.width // 64,
                                      num_key_value_heads=size.width // 64,
                                      attn_implementation="eager", use_cache=False)
    return transformers.LlamaForCausalLM(config)


def report(eager, graphed, steps: int, label: str = "cgraph") -> None:
    """`eager` and `graphed`: (losses or None, parameters, ms per step) of
    each run; `label` names the graphed run.  Exits non-zero if the runs
    differ."""
    (eager_losses, eager_params, eager_ms), (losses, params, ms) = eager, graphed
    same = all(torch.equal(p, q) for p, q in zip(params, eager_params))
    if eager_losses is not None:
        same = same and (torch.equal(losses, eager_losses) if torch.is_tensor(losses)
                         else losses == eager_losses)
    what = "parameters" if eager_losses is None else "losses and parameters"
    rank = f"rank {os.environ['RANK']} " if int(os.environ.get("WORLD_SIZE", "1")) > 1 else ""
    print(f"{rank}{label}: {what} equal to eager's after {steps} steps: {same}")
    print(f"{rank}ms per step: eager {eager_ms:.1f}, {label} {ms:.1f} ({ms / eager_ms:.2f}x)")
    if not same:
        raise SystemExit("the graphed run differs from eager's")

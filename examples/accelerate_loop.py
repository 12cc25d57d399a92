"""A training loop wrapped by Accelerate, with the model's layers graphed by
``cgraph.graph_layers`` before ``accelerator.prepare``, against the same
loop without it.  On one GPU, from the repository root after a build (`bash
scripts/gpu.sh` builds in place):

    python3 -m examples.accelerate_loop

The model is the same random-init Llama as examples/hf_trainer.py (4
decoder layers, hidden 256: the host bounds its step), trained for 40
optimizer steps with ``mixed_precision="bf16"`` and 2-step gradient
accumulation (``accelerator.accumulate``).  Checks that both runs end with
the same losses and parameters (eager attention, no dropout: bitwise) and
prints the median time per optimizer step of each.  Under torchrun
(``torchrun --nproc_per_node=2 examples/accelerate_loop.py``) Accelerate
wraps the graphed model in DDP and gives each rank its share of the
batches; each rank checks its own runs.
"""

import statistics
import time

import accelerate
import torch

import cgraph
from examples._compare import SIZES, llama, report

STEPS, ACCUMULATE = 40, 2


def batches(size):
    tokens = torch.Generator().manual_seed(0)
    data = torch.randint(0, 1024, (size.batch * STEPS * ACCUMULATE, size.tokens),
                         generator=tokens)
    return torch.utils.data.DataLoader(data, batch_size=size.batch)


def train(graphed: bool, size="small"):
    """One run: (losses, parameters, median ms per optimizer step).  `size`:
    a key of examples/_compare.py's SIZES."""
    size = SIZES[size]
    accelerator = accelerate.Accelerator(mixed_precision="bf16",
                                         gradient_accumulation_steps=ACCUMULATE)
    accelerate.utils.set_seed(0)
    model = llama(size)
    if graphed:
        model = cgraph.graph_layers(model.to(accelerator.device))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, optimizer, data = accelerator.prepare(model, optimizer, batches(size))
    losses, times, started = [], [], None
    for i, ids in enumerate(data):
        if i % ACCUMULATE == 0:
            torch.cuda.synchronize()
            started = time.perf_counter()
        with accelerator.accumulate(model):
            loss = model(input_ids=ids, labels=ids).loss
            accelerator.backward(loss)
            optimizer.step()
            optimizer.zero_grad()
        losses.append(loss.detach())
        if i % ACCUMULATE == ACCUMULATE - 1:
            torch.cuda.synchronize()
            times.append(time.perf_counter() - started)
    params = [p.detach().clone() for p in accelerator.unwrap_model(model).parameters()]
    return torch.stack(losses), params, statistics.median(times[5:]) * 1e3


def main():
    report(train(graphed=False), train(graphed=True), STEPS)


if __name__ == "__main__":
    main()

"""Lightning with cgraph's callback, against the same run without it.  On
one GPU, from the repository root after a build (`bash scripts/gpu.sh`
builds in place):

    python3 -m examples.lightning_callback

A LightningModule around a small GPT-style model (6 blocks of width 256:
the host bounds its step), trained for 40 steps on synthetic tokens with
``precision="bf16-mixed"``, ``accumulate_grad_batches=2``, the sanity-check
validation and a validation pass: once as is, once with
``callbacks=[CUDAGraphs()]``, which graphs every block when training
starts, and once with ``CUDAGraphs(scope="step")``, which graphs each whole
training step.  Checks that each graphed run ends with the eager run's
parameters (no dropout: bitwise) and prints the median time per optimizer
step of each.  Under torchrun (``torchrun --nproc_per_node=2
examples/lightning_callback.py``), each process is one rank of Lightning's
DDP strategy, and each rank checks its own runs.  ``train(model="mlp")``
trains the MLP below instead (benchmarks/frameworks.py's lightning_mlp).
"""

import os
import statistics
import time

import lightning
import torch
from torch import nn

from cgraph.lightning import CUDAGraphs
from examples._compare import SIZES, report

STEPS = 40


class Block(nn.Module):
    def __init__(self, width):
        super().__init__()
        self.norm = nn.LayerNorm(width)
        self.attn = nn.MultiheadAttention(width, width // 64, batch_first=True)
        self.mlp = nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                                 nn.Linear(4 * width, width))

    def forward(self, x):
        h = self.norm(x)
        mask = nn.Transformer.generate_square_subsequent_mask(x.shape[1], device=x.device)
        x = x + self.attn(h, h, h, attn_mask=mask, need_weights=False)[0]
        return x + self.mlp(x)


class GPT(lightning.LightningModule):
    def __init__(self, width=256, depth=6, vocab=1024):
        super().__init__()
        self.embed = nn.Embedding(vocab, width)
        self.blocks = nn.ModuleList(Block(width) for _ in range(depth))
        self.head = nn.Linear(width, vocab)

    def forward(self, ids):
        h = self.embed(ids)
        for block in self.blocks:
            h = block(h)
        return self.head(h)

    def loss(self, ids):
        logits = self(ids[:, :-1])
        return nn.functional.cross_entropy(logits.flatten(0, 1), ids[:, 1:].flatten())

    def training_step(self, ids, i):
        loss = self.loss(ids)
        self.log("loss", loss)
        return loss

    def validation_step(self, ids, i):
        self.log("val_loss", self.loss(ids))

    def configure_optimizers(self):
        # fused: what a graphed step runs as is (an unfused AdamW is made
        # capturable there, equal to eager's to float32 rounding, not bitwise).
        return torch.optim.AdamW(self.parameters(), lr=1e-3, fused=True)


class MLP(lightning.LightningModule):
    """The model of benchmarks/workloads.py's mlp configuration: 8 blocks of
    Linear, ReLU and dropout (784 -> 512 -> ... -> 10), a batch of 64, fused
    Adam; trained as the GPT is here (bf16-mixed, two micro-batches per
    step), where that workload steps float32 once.  The host bounds its step
    even more than the GPT's.  Dropout is on: a graphed step draws the eager
    run's masks."""

    def __init__(self, depth=8):
        super().__init__()
        widths = [784] + [512] * depth
        self.blocks = nn.Sequential(*(nn.Sequential(nn.Linear(i, o), nn.ReLU(), nn.Dropout(0.1))
                                      for i, o in zip(widths, widths[1:])))
        self.head = nn.Linear(512, 10)

    def training_step(self, batch, i):
        x, y = batch
        loss = nn.functional.cross_entropy(self.head(self.blocks(x)), y)
        self.log("loss", loss)
        return loss

    def validation_step(self, batch, i):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self.head(self.blocks(x)), y))

    def configure_optimizers(self):
        return torch.optim.Adam(self.parameters(), lr=1e-3, fused=True)


def _data(model, size):
    """Synthetic training data for `model` ("gpt": token ids; "mlp":
    features and labels), the same on every run."""
    rows = size.batch * STEPS * 2
    generator = torch.Generator().manual_seed(0)
    if model == "mlp":
        return torch.utils.data.TensorDataset(
            torch.randn(rows, 784, generator=generator),
            torch.randint(0, 10, (rows,), generator=generator))
    return torch.randint(0, 1024, (rows, size.tokens + 1), generator=generator)


class StepTimes(lightning.Callback):
    """Wall time of each optimizer step, the GPU's work included."""

    def __init__(self):
        self.times, self.started = [], None

    def on_train_batch_start(self, trainer, module, batch, i):
        if i % 2 == 0:  # the first micro-batch of an optimizer step
            torch.cuda.synchronize()
            self.started = time.perf_counter()

    def on_train_batch_end(self, trainer, module, outputs, batch, i):
        if i % 2 == 1:
            torch.cuda.synchronize()
            self.times.append(time.perf_counter() - self.started)


def train(callbacks, precision="bf16-mixed", size="small", model="gpt"):
    """One run: (parameters, median ms per optimizer step).  `size`: a key
    of examples/_compare.py's SIZES; `model`: "gpt" (GPT at that size) or
    "mlp" (MLP, batches of 64: `size` unused)."""
    size = SIZES[size] if model == "gpt" else SIZES["small"]._replace(batch=64)
    lightning.seed_everything(0, verbose=False)
    module = GPT(width=size.width) if model == "gpt" else MLP()
    data = _data(model, size)
    train_data = torch.utils.data.DataLoader(data, batch_size=size.batch)
    val_data = torch.utils.data.DataLoader(torch.utils.data.Subset(data, range(4 * size.batch)),
                                           batch_size=size.batch)
    timer = StepTimes()
    devices = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's processes
    trainer = lightning.Trainer(accelerator="gpu", devices=devices,
                                strategy="ddp" if devices > 1 else "auto", precision=precision,
                                max_steps=STEPS, accumulate_grad_batches=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, val_check_interval=STEPS,
                                callbacks=[timer, *callbacks])
    trainer.fit(module, train_data, val_data)
    params = [p.detach().clone() for p in module.parameters()]
    return params, statistics.median(timer.times[5:]) * 1e3


def main():
    eager = (None, *train([]))
    report(eager, (None, *train([CUDAGraphs()])), STEPS, "cgraph layers")
    step = CUDAGraphs(scope="step")
    report(eager, (None, *train([step])), STEPS, "cgraph step")
    if not (step.stats and step.stats["replays"]):  # not fallen back to layers
        raise SystemExit(f"the step was not graphed: {step.stats}")


if __name__ == "__main__":
    main()

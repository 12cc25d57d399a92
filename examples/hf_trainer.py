"""The Hugging Face Trainer with cgraph's callback, against the same run
without it.  On one GPU, from the repository root after a build (`bash
scripts/gpu.sh` builds in place):

    python3 -m examples.hf_trainer

A random-init Llama small enough that the host bounds its step (4 decoder
layers, hidden 256), trained for 40 steps on synthetic tokens with bf16
autocast and 2-step gradient accumulation, once as is and once with
``callbacks=[CUDAGraphsCallback()]``, which graphs every decoder layer when
training starts.  Checks that both runs end with the same losses and
parameters (eager attention, no dropout: bitwise) and prints the median
time per optimizer step of each.  Under torchrun (``torchrun
--nproc_per_node=2 examples/hf_trainer.py``) the Trainer trains with DDP,
inside which the callback graphs the layers; each rank checks its own runs.
"""

import statistics
import tempfile
import time

import torch
import transformers
from transformers.trainer_utils import set_seed

from cgraph.transformers import CUDAGraphsCallback
from examples._compare import SIZES, llama, report

STEPS = 40


class Tokens(torch.utils.data.Dataset):
    def __init__(self, size):
        self.size = size

    def __len__(self):
        return self.size.batch * STEPS * 2

    def __getitem__(self, i):
        ids = torch.randint(0, 1024, (self.size.tokens,),
                            generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


class StepTimes(transformers.TrainerCallback):
    """Wall time of each optimizer step, the GPU's work included."""

    def __init__(self):
        self.times, self.started = [], None

    def on_step_begin(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.started = time.perf_counter()

    def on_step_end(self, args, state, control, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter() - self.started)


def train(callbacks, size="small"):
    """One run: (losses, parameters, median ms per optimizer step).  `size`:
    a key of examples/_compare.py's SIZES."""
    size = SIZES[size]
    set_seed(0)
    model = llama(size)
    timer = StepTimes()
    with tempfile.TemporaryDirectory() as out:
        args = transformers.TrainingArguments(
            output_dir=out, max_steps=STEPS, per_device_train_batch_size=size.batch,
            gradient_accumulation_steps=2, bf16=True, report_to=[], save_strategy="no",
            logging_steps=1, seed=0, data_seed=0, disable_tqdm=True)
        trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(size),
                                       callbacks=[timer, *callbacks])
        trainer.train()
    losses = [entry["loss"] for entry in trainer.state.log_history if "loss" in entry]
    params = [p.detach().clone() for p in model.parameters()]
    return losses, params, statistics.median(timer.times[5:]) * 1e3


def main():
    report(train([]), train([CUDAGraphsCallback()]), STEPS)


if __name__ == "__main__":
    main()

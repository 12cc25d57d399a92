"""The framework callbacks on the CPU, inside the real trainers: the Hugging
Face Trainer (cgraph.transformers.CUDAGraphsCallback) and Lightning
(cgraph.lightning.CUDAGraphs).  Graphing is stood in for by a forward that
counts its calls and runs the block's own (graphs need a GPU), so these
check the wiring: the blocks are graphed when training starts, the
trainer's own loop then calls them (training and evaluation), and a second
fit leaves them as they are.  On GPUs, the tests below train each framework
with and without cgraph and compare (the examples, on one GPU and on two
under torchrun); tests/test_transformers.py checks graph_layers on real
Hugging Face models."""

import os
import re
import subprocess
import sys

import pytest
import torch
from torch import nn

from _helpers import StandIn, torchrun


def tiny_llama(transformers):
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, use_cache=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)


class Tokens(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        ids = torch.randint(0, 64, (16,), generator=torch.Generator().manual_seed(i))
        return {"input_ids": ids, "labels": ids}


def test_hf_trainer_callback_graphs_the_decoder_layers_at_train_start(stand_in, tmp_path):
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from cgraph.transformers import CUDAGraphsCallback
    model = tiny_llama(transformers)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=2, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, gradient_accumulation_steps=2, report_to=[],
        save_strategy="no", eval_strategy="steps", eval_steps=2, logging_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   eval_dataset=Tokens(), callbacks=[CUDAGraphsCallback()])
    trainer.train()
    assert [type(layer.forward) for layer in model.model.layers] == [StandIn, StandIn]
    assert model.config.use_cache is False
    # 2 steps x 2 micro-batches, then evaluation: 4 batches of 2.
    assert [layer.forward.calls for layer in model.model.layers] == [8, 8]
    trainer.train()  # a second run: the graphed blocks are kept
    assert len(stand_in) == 2


def test_lightning_callback_graphs_the_blocks_when_training_starts(stand_in):
    lightning = pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU())
                                        for _ in range(3))
            self.head = nn.Linear(16, 64)

        def forward(self, ids):
            h = self.embed(ids)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

        def training_step(self, batch, i):
            loss = nn.functional.cross_entropy(self(batch).flatten(0, 1), batch.flatten())
            self.log("loss", loss)
            return loss

        def validation_step(self, batch, i):
            self.log("val", self(batch).mean())

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    data = torch.utils.data.DataLoader(torch.randint(0, 64, (8, 12)), batch_size=2)
    module = Module()
    trainer = lightning.Trainer(accelerator="cpu", max_steps=2, accumulate_grad_batches=2,
                                limit_val_batches=1, val_check_interval=2, logger=False,
                                enable_checkpointing=False, enable_progress_bar=False,
                                enable_model_summary=False, callbacks=[CUDAGraphs()])
    trainer.fit(module, data, data)
    assert all(type(block.forward) is StandIn for block in module.blocks)
    # Graphed after the sanity check (one batch: limit_val_batches), then 2
    # steps x 2 micro-batches, and one validation batch after every second
    # training batch (val_check_interval counts batches).
    assert [block.forward.calls for block in module.blocks] == [6, 6, 6]


# ---- on a GPU: trained through the trainer, equal to the same run eagerly -----


def _hf_run(transformers, tmp_path, callbacks, setting):
    from transformers.trainer_utils import set_seed
    set_seed(0)
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, use_cache=False,
                                      attn_implementation="eager")
    model = transformers.LlamaForCausalLM(config)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), max_steps=4, per_device_train_batch_size=2,
        gradient_accumulation_steps=2, report_to=[], save_strategy="no", logging_steps=1,
        seed=0, data_seed=0, **{setting: True} if setting else {})
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=callbacks)
    trainer.train()
    losses = [e["loss"] for e in trainer.state.log_history if "loss" in e]
    return losses, [p.detach().cpu() for p in model.parameters()]


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [None, "bf16", "gradient_checkpointing"])
def test_hf_trainer_with_the_callback_trains_as_without_it(tmp_path, setting):
    """Plain, bf16 autocast, and gradient checkpointing (each decoder layer
    checkpointed inside its own graphs)."""
    if torch.cuda.device_count() > 1:
        pytest.skip("several GPUs visible: the Trainer would use DataParallel, which the "
                    "callback refuses (tested on the CPU)")
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from cgraph.transformers import CUDAGraphsCallback
    eager = _hf_run(transformers, tmp_path, [], setting)
    graphed = _hf_run(transformers, tmp_path, [CUDAGraphsCallback()], setting)
    assert graphed[0] == eager[0]
    for i, (g, e) in enumerate(zip(graphed[1], eager[1])):
        assert torch.equal(g, e), f"parameter {i}"


EXAMPLES = [("hf_trainer", ("transformers", "accelerate")), ("lightning_callback", ("lightning",)),
            ("accelerate_loop", ("accelerate", "transformers"))]


@pytest.mark.gpu
@pytest.mark.parametrize("example, needs", EXAMPLES)
def test_trainer_examples_train_as_eager(example, needs):
    """Each example trains its model with and without cgraph and exits
    non-zero unless losses and parameters are equal; the timings it prints
    are not checked here (benchmarks time).  On one GPU: the HF Trainer
    would use DataParallel over several."""
    for package in needs:
        pytest.importorskip(package)
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    one_gpu = {**os.environ, "CUDA_VISIBLE_DEVICES": str(torch.cuda.current_device())
               if "CUDA_VISIBLE_DEVICES" not in os.environ
               else os.environ["CUDA_VISIBLE_DEVICES"].split(",")[0]}
    run = subprocess.run([sys.executable, "-m", f"examples.{example}"], capture_output=True,
                         text=True, timeout=300, cwd=root, env=one_gpu)
    assert run.returncode == 0, run.stdout + run.stderr[-3000:]
    assert "equal to eager's" in run.stdout and ": True" in run.stdout, run.stdout


@pytest.mark.parametrize("setting, match", [
    ({"n_gpu": 2}, "torchrun --nproc_per_node"), ({"torch_compile": True}, "torch_compile=False")])
def test_hf_callback_refuses_what_it_cannot_graph(setting, match, stand_in):
    pytest.importorskip("transformers")
    from types import SimpleNamespace

    from cgraph.transformers import CUDAGraphsCallback
    args = SimpleNamespace(**{"n_gpu": 1, "torch_compile": False, **setting})
    with pytest.raises(ValueError, match=match):
        CUDAGraphsCallback().on_train_begin(args, None, None, model=nn.Linear(2, 2))
    assert stand_in == []


def test_lightning_callback_refuses_a_module_compiled_whole(stand_in):
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.utilities.compile import from_compiled

    from cgraph.lightning import CUDAGraphs

    class Module(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.blocks = nn.ModuleList(nn.Linear(4, 4) for _ in range(2))

    module = from_compiled(torch.compile(Module()))  # what trainer.fit(compiled) does
    with pytest.raises(ValueError, match=r"compiled whole.*torch.compile\(block.forward\)"):
        CUDAGraphs().on_train_start(None, module)
    assert stand_in == []


@pytest.mark.gpu
@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
@pytest.mark.parametrize("example, needs", EXAMPLES)
def test_trainer_examples_train_as_eager_on_two_gpus(example, needs):
    """Each example under torchrun on two GPUs: DDP as each framework sets it
    up (Lightning's ddp strategy, the HF Trainer's and Accelerate's DDP),
    with the layers graphed inside it; every rank's graphed run ends where
    its eager run did."""
    for package in needs:
        pytest.importorskip(package)
    out = torchrun(f"{example}.py", 2, timeout=600)
    for rank in (0, 1):
        assert re.search(rf"rank {rank} .*equal to eager's after \d+ steps: True", out), out


@pytest.mark.gpu
def test_lightning_callback_with_16_mixed_precision_trains_as_without_it(monkeypatch):
    """precision="16-mixed": Lightning's GradScaler around graphed blocks,
    with accumulate_grad_batches=2 and validation (examples/lightning_callback.py's
    run), ends with eager's parameters, bitwise."""
    pytest.importorskip("lightning")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    monkeypatch.syspath_prepend(root)
    import lightning

    import cgraph
    from cgraph.lightning import CUDAGraphs
    from examples import lightning_callback

    class Seen(lightning.Callback):
        def on_train_end(self, trainer, module):
            self.module = module

    seen = Seen()
    eager_params, _ = lightning_callback.train([], precision="16-mixed")
    graphed_params, _ = lightning_callback.train([CUDAGraphs(), seen], precision="16-mixed")
    for i, (g, e) in enumerate(zip(graphed_params, eager_params)):
        assert torch.equal(g, e), f"parameter {i}"
    for block in seen.module.blocks:  # graphed, and every training call replayed
        graphed = block.__dict__.get("forward")
        assert isinstance(graphed, cgraph.Graphed), block
        assert graphed.num_graphs >= 1 and graphed.stats["eager_past_limit"] == 0, graphed.stats

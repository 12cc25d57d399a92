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
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from _helpers import StandIn, tiny_llama, torchrun


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
    assert model.config.use_cache is args.use_cache  # the Trainer's setting, not cgraph's
    # 2 steps x 2 micro-batches, then evaluation: 4 batches of 2.
    assert [layer.forward.calls for layer in model.model.layers] == [8, 8]
    trainer.train()  # a second run: the graphed blocks are kept
    assert len(stand_in) == 2


def test_lightning_callback_graphs_the_blocks_when_training_starts(stand_in):
    lightning = pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs

    data = torch.utils.data.DataLoader(torch.randint(0, 64, (8, 12)), batch_size=2)
    module = step_module(lightning)("sgd")
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
    stats = [layer.forward.stats for layer in model.model.layers if callbacks]
    return losses, [p.detach().cpu() for p in model.parameters()], stats


@pytest.mark.gpu
@pytest.mark.parametrize("setting", [None, "bf16", "gradient_checkpointing"])
def test_hf_trainer_with_the_callback_trains_as_without_it(tmp_path, setting, request):
    """Plain, bf16 autocast, and gradient checkpointing (each decoder layer
    checkpointed inside its own graphs); every layer replays its graphs,
    no call of it runs eagerly.  Where several GPUs are visible (the
    Trainer would use DataParallel over them, which the callback refuses:
    tested on the CPU), in a process that sees the first one."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    if torch.cuda.device_count() > 1:
        _again_on_one_gpu(request.node.nodeid)
        return
    from cgraph.transformers import CUDAGraphsCallback
    eager = _hf_run(transformers, tmp_path, [], setting)
    graphed = _hf_run(transformers, tmp_path, [CUDAGraphsCallback()], setting)
    assert graphed[0] == eager[0]
    for i, (g, e) in enumerate(zip(graphed[1], eager[1])):
        assert torch.equal(g, e), f"parameter {i}"
    for stats in graphed[2]:
        assert stats["forward"] > 0 and stats["eager_on_miss"] == stats["eager_past_limit"] == 0, \
            stats


def _again_on_one_gpu(nodeid: str) -> None:
    """Runs the test `nodeid` in a pytest process that sees one GPU (the
    first visible one), and fails unless it passed there."""
    first = os.environ.get("CUDA_VISIBLE_DEVICES", str(torch.cuda.current_device()))
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                          "-rfEs", nodeid], capture_output=True, text=True, timeout=600,
                         cwd=root, env={**os.environ, "CUDA_VISIBLE_DEVICES": first.split(",")[0]})
    assert run.returncode == 0 and "1 passed" in run.stdout, run.stdout + run.stderr


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


# ---- Lightning, scope="step": the whole training step graphed ----------------


def lightning_run(lightning, callbacks, *, accelerator="cpu", precision="32-true",
                  optimizer="sgd", accumulate=1, max_steps=8, module_class=None, clip=None,
                  ckpt_path=None, save_to=None):
    """Fits a small LightningModule (dropout on, self.log of the loss on
    step and on epoch, a validation loop, 13 samples in batches of 2: a
    short last batch) and returns (parameters, what its logger got, global
    step, the head's grad after each batch).  From the checkpoint at
    `ckpt_path` if given; saves one to `save_to` if given."""

    class Recorder(lightning.pytorch.loggers.Logger):
        def __init__(self):
            super().__init__()
            self.metrics = []

        name = property(lambda self: "recorder")
        version = property(lambda self: 0)

        def log_hyperparams(self, *args, **kwargs):
            pass

        def log_metrics(self, metrics, step=None):
            self.metrics.append((step, dict(metrics)))

    class Grads(lightning.Callback):
        """The head's grad after each training batch (None if unset)."""

        def __init__(self):
            self.seen = []

        def on_train_batch_end(self, trainer, module, outputs, batch, i):
            grad = module.head.weight.grad
            self.seen.append(None if grad is None else grad.detach().cpu().clone())

    torch.manual_seed(0)
    module = (module_class or step_module(lightning))(optimizer)
    recorder, grads = Recorder(), Grads()
    data = torch.randint(0, 64, (13, 12), generator=torch.Generator().manual_seed(0))
    trainer = lightning.Trainer(
        accelerator=accelerator, devices=1, precision=precision, max_steps=max_steps,
        accumulate_grad_batches=accumulate, gradient_clip_val=clip, logger=recorder,
        log_every_n_steps=1,
        limit_val_batches=2, enable_checkpointing=False, enable_progress_bar=False,
        enable_model_summary=False, callbacks=[*callbacks, grads])
    loader = torch.utils.data.DataLoader(data, batch_size=2)
    trainer.fit(module, loader, loader, ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return ([p.detach().cpu() for p in module.parameters()], recorder.metrics, trainer.global_step,
            grads.seen)


def step_module(lightning):
    class Module(lightning.LightningModule):
        def __init__(self, optimizer):
            super().__init__()
            self.optimizer = optimizer
            self.embed = nn.Embedding(64, 16)
            self.blocks = nn.ModuleList(nn.Sequential(nn.Linear(16, 16), nn.GELU(),
                                                      nn.Dropout(0.1)) for _ in range(3))
            self.head = nn.Linear(16, 64)

        def forward(self, ids):
            h = self.embed(ids)
            for block in self.blocks:
                h = h + block(h)
            return self.head(h)

        def loss(self, ids):
            return nn.functional.cross_entropy(self(ids).flatten(0, 1).float(), ids.flatten())

        def training_step(self, batch, i):
            loss = self.loss(batch)
            self.log("loss", loss)
            self.log("epoch_loss", loss, on_step=False, on_epoch=True)
            return loss

        def validation_step(self, batch, i):
            self.log("val", self.loss(batch))

        def configure_optimizers(self):
            if self.optimizer == "sgd":  # lr baked into the graph: no scheduler
                return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)
            opt = (torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9, fused=True)
                   if self.optimizer == "sgd-fused"
                   else torch.optim.AdamW(self.parameters(), lr=1e-2, fused=True))
            schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1 / (1 + s))
            return {"optimizer": opt, "lr_scheduler": {"scheduler": schedule, "interval": "step"}}

    return Module


@pytest.mark.parametrize("accumulate, optimizer", [(1, "sgd"), (2, "adamw")])
def test_lightning_step_scope_keeps_lightning_s_books_then_falls_back(stand_in, caplog,
                                                                        accumulate, optimizer):
    """On the CPU the step's warm-up calls run (Lightning's run inside
    make_graphed_step, self.log recorded and logged after each call, grads
    zeroed in place when accumulating), then its capture fails (no GPU):
    logged, that batch runs eagerly and the layers are graphed instead.  The
    run ends where the run without the callback does: parameters, every
    logged value, global_step."""
    lightning = pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs
    eager = lightning_run(lightning, [], accumulate=accumulate, optimizer=optimizer)
    callback = CUDAGraphs(scope="step")
    with caplog.at_level("INFO", logger="cgraph"):
        graphed = lightning_run(lightning, [callback], accumulate=accumulate,
                                optimizer=optimizer)
    assert graphed[1] == eager[1] and graphed[2] == eager[2] == 8
    for i, (g, e) in enumerate(zip(graphed[0], eager[0])):
        assert torch.equal(g, e), f"parameter {i}"
    # No GPU here; or, on a GPU machine, a module on the CPU.
    assert re.search(r"the step's capture failed \((RuntimeError: cgraph: no CUDA device"
                     r"|ValueError: cgraph: argument 'batch' is on cpu"
                     r"|ValueError: cgraph: parameter 0 of param group 0 of \w+ is on cpu)",
                     caplog.text)
    # Warm-up calls until the first phase's capture: 3 batches; accumulating,
    # the zero-and-accumulate phase's fourth batch is the next epoch's first.
    assert callback.stats == {"phases": 1 if accumulate == 1 else 3, "eager": 3 if accumulate == 1
                              else 7, "captures": 0, "replays": 0}
    assert len(stand_in) == 3  # the layers, graphed instead


def test_lightning_step_scope_falls_back_on_a_logged_number(stand_in, caplog):
    """A number logged inside the step would replay as captured: after the
    first batch (logged as it is), the layers are graphed instead."""
    lightning = pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs

    class Module(step_module(lightning)):
        def training_step(self, batch, i):
            self.log("lr", self.trainer.optimizers[0].param_groups[0]["lr"])
            return super().training_step(batch, i)

    eager = lightning_run(lightning, [], module_class=Module, optimizer="adamw")
    with caplog.at_level("INFO", logger="cgraph"):
        graphed = lightning_run(lightning, [CUDAGraphs(scope="step")], module_class=Module,
                                optimizer="adamw")
    assert graphed[1] == eager[1]
    assert "self.log('lr', ...) in training_step logs a float" in caplog.text
    assert len(stand_in) == 3


@pytest.mark.parametrize("override, why", [
    ("automatic_optimization", "optimizes manually"),
    ("on_after_backward", "Module.on_after_backward is overridden"),
    ("clip_gradients", "Clipping.clip_gradients is overridden"),
    ("ddp_comm_hook", "DDP's communication hook or model averaging"),
    ("callback", "the Probe callback's on_before_optimizer_step")])
def test_lightning_step_scope_graphs_layers_where_the_loop_has_host_logic(stand_in, caplog,
                                                                          override, why):
    """Python that would run inside the step, once at capture: the layers
    are graphed instead, naming it."""
    lightning = pytest.importorskip("lightning")
    from lightning.pytorch.strategies import DDPStrategy

    from cgraph.lightning import CUDAGraphs

    class Module(step_module(lightning)):
        def on_after_backward(self):
            pass

    class Clipping(step_module(lightning)):
        def clip_gradients(self, *args, **kwargs):
            pass

    class Probe(lightning.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            pass

    module = {"on_after_backward": Module, "clip_gradients": Clipping}.get(
        override, step_module(lightning))("sgd")
    module.automatic_optimization = override != "automatic_optimization"
    kwargs = {"callbacks": [Probe()]} if override == "callback" else {}
    if override == "ddp_comm_hook":
        kwargs["strategy"] = DDPStrategy(ddp_comm_hook=lambda state, bucket: None)
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, **kwargs)
    with caplog.at_level("INFO", logger="cgraph"):
        CUDAGraphs(scope="step").on_train_start(trainer, module)
    assert why in caplog.text and "graphing the layers instead" in caplog.text
    assert len(stand_in) == 3


def test_lightning_step_scope_trains_eagerly_where_no_layers_can_be_graphed_either(caplog):
    """Manual optimization in a module without repeated blocks: neither the
    step nor the layers can be graphed; the fit goes on eagerly, logged, and
    ends where it does without the callback."""
    lightning = pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs

    class Manual(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.automatic_optimization = False
            self.net = nn.Linear(12, 12)

        def training_step(self, batch, i):
            opt = self.optimizers()
            opt.zero_grad()
            self.manual_backward(self.net(batch.float()).square().mean())
            opt.step()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    def fit(callbacks):
        torch.manual_seed(0)
        module = Manual()
        trainer = lightning.Trainer(accelerator="cpu", max_steps=3, logger=False,
                                    enable_checkpointing=False, enable_progress_bar=False,
                                    enable_model_summary=False, callbacks=callbacks)
        trainer.fit(module, torch.utils.data.DataLoader(torch.randn(6, 12), batch_size=2))
        return module.net.weight.detach().clone()

    eager = fit([])
    with caplog.at_level("INFO", logger="cgraph"):
        graphed = fit([CUDAGraphs(scope="step")])
    assert torch.equal(graphed, eager)
    assert "optimizes manually" in caplog.text
    assert "the layers cannot be graphed either" in caplog.text
    assert "training runs eagerly" in caplog.text
    # A mistake of the user's is not swallowed: a layers= path that is not there.
    with pytest.raises(ValueError, match="Name the list of blocks by its path"):
        fit([CUDAGraphs(scope="step", layers="missing")])


def test_lightning_step_scope_names_what_keeps_every_batch_eager():
    """Batches unlike the graphed one run eagerly (a short last batch);
    where they all differ, the warning at the tenth in a row names the part
    and the fix: a value that changes with every batch (a file name) is
    baked into a graph, a tensor of another shape needs padding."""
    pytest.importorskip("lightning")
    from cgraph.lightning import _difference_named, _signature
    graphed = _signature({"x": torch.zeros(2, 3), "path": "a.png"})
    said = _difference_named(graphed, _signature({"x": torch.zeros(2, 3), "path": "b.png"}))
    assert "part 1 of the batch, a str, was 'a.png' and is now 'b.png'" in said
    assert "out of the batch" in said
    said = _difference_named(graphed, _signature({"x": torch.zeros(3, 3), "path": "a.png"}))
    assert said.startswith("part 0 of the batch, a tensor, was ((2, 3)") and "Pad" in said
    assert "structure" in _difference_named(graphed, _signature({"y": torch.zeros(2, 3)}))


def test_lightning_callback_refuses_an_unknown_scope():
    pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs
    with pytest.raises(ValueError, match=r"scope must be one of \('layers', 'step'\)"):
        CUDAGraphs(scope="model")


@pytest.mark.gpu
@pytest.mark.parametrize("precision, optimizer, accumulate, clip", [
    ("32-true", "adamw-fused", 1, None), ("32-true", "sgd-fused", 2, None),
    ("16-mixed", "sgd", 1, None), ("bf16-mixed", "adamw-fused", 2, None),
    ("32-true", "sgd", 2, 0.05), ("16-mixed", "sgd", 1, 0.05)])
def test_lightning_step_scope_trains_as_eager(precision, optimizer, accumulate, clip):
    """The whole step graphed, against the same fit without the callback:
    parameters bitwise, every logged value, global_step.  Dropout draws
    eager's masks; the LR schedule steps the device lr; with accumulation
    three phases are graphed (zero and accumulate, accumulate and step, and
    the epoch's last batch); the grads after each batch are eager's, also
    after each epoch's validation has set them to None; the short last batch of 1 runs eagerly where
    its phase was graphed with batches of 2; 16-mixed's GradScaler skips
    through a conditional node with SGD unfused; Lightning's gradient
    clipping (gradient_clip_val, after the scaler's unscale_ under
    16-mixed) runs inside the graph."""
    assert_step_scope_trains_as_eager(pytest.importorskip("lightning"), precision, optimizer,
                                      accumulate, clip)


def assert_step_scope_trains_as_eager(lightning, precision: str, optimizer: str,
                                      accumulate: int, clip: float | None = None) -> None:
    """A fit of 16 steps with CUDAGraphs(scope="step") against the same fit
    without it, in `lightning`'s namespace: parameters bitwise, every logged
    value, global_step, the grads after each batch."""
    from cgraph.lightning import CUDAGraphs
    kwargs = dict(accelerator="gpu", precision=precision, optimizer=optimizer,
                  accumulate=accumulate, max_steps=16, clip=clip)
    eager = lightning_run(lightning, [], **kwargs)
    callback = CUDAGraphs(scope="step")
    graphed = lightning_run(lightning, [callback], **kwargs)
    assert graphed[2] == eager[2] == 16
    for i, (g, e) in enumerate(zip(graphed[0], eager[0])):
        assert torch.equal(g, e), f"parameter {i}"
    assert graphed[1] == eager[1]
    # Each batch's grads, also after each validation (which sets them to None).
    assert len(graphed[3]) == len(eager[3])
    for i, (g, e) in enumerate(zip(graphed[3], eager[3])):
        assert (g is None and e is None) or torch.equal(g, e), f"grad after batch {i}"
    assert callback.stats["captures"] >= 1 and callback.stats["replays"] >= 8, callback.stats


@pytest.mark.gpu
def test_lightning_step_scope_follows_an_accumulation_schedule_and_an_unfreezing():
    """Lightning's GradientAccumulationScheduler (1 batch per step, then 2
    from epoch 1: the loss's divisor changes) and a callback unfreezing the
    first block at epoch 1 (the graphs' backward and optimizer step must
    cover it from then on): the step is graphed again for each, and the fit
    ends where eager's does."""
    lightning = pytest.importorskip("lightning")

    class Frozen(step_module(lightning)):
        def __init__(self, optimizer):
            super().__init__(optimizer)
            self.blocks[0].requires_grad_(False)

    class Unfreeze(lightning.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                module.blocks[0].requires_grad_(True)

    def fit(callbacks):
        schedule = lightning.pytorch.callbacks.GradientAccumulationScheduler({0: 1, 1: 2})
        return lightning_run(lightning, [*callbacks, Unfreeze(), schedule], accelerator="gpu",
                             optimizer="adamw-fused", max_steps=16, module_class=Frozen)

    assert_fits_alike(fit, captures=2, replays=2)


def assert_fits_alike(fit, captures: int, replays: int) -> None:
    """fit(callbacks) of 16 steps without cgraph and with CUDAGraphs(scope=
    "step"): parameters bitwise, every logged value, and at least so many
    captures and replays."""
    from cgraph.lightning import CUDAGraphs
    eager = fit([])
    callback = CUDAGraphs(scope="step")
    graphed = fit([callback])
    assert graphed[2] == eager[2] == 16
    for i, (g, e) in enumerate(zip(graphed[0], eager[0])):
        assert torch.equal(g, e), f"parameter {i}"
    assert graphed[1] == eager[1]
    stats = callback.stats
    assert stats["captures"] >= captures and stats["replays"] >= replays, stats


def _assert_same_state(got, want, where: str) -> None:
    """A checkpoint's state as eager's: tensors bitwise (dtype too), the
    rest equal, through dicts, lists and tuples."""
    assert type(got) is type(want), f"{where}: {type(got).__name__} != {type(want).__name__}"
    if isinstance(want, torch.Tensor):
        assert got.dtype == want.dtype and torch.equal(got, want), f"{where}: {got} != {want}"
    elif isinstance(want, dict):
        assert got.keys() == want.keys(), f"{where}: keys {list(got)} != {list(want)}"
        for key in want:
            _assert_same_state(got[key], want[key], f"{where}[{key!r}]")
    elif isinstance(want, (list, tuple)):
        assert len(got) == len(want), f"{where}: {len(got)} items != {len(want)}"
        for i, (g, w) in enumerate(zip(got, want)):
            _assert_same_state(g, w, f"{where}[{i}]")
    else:
        assert got == want, f"{where}: {got!r} != {want!r}"


@pytest.mark.gpu
@pytest.mark.parametrize("precision, optimizer", [("32-true", "adamw-fused"), ("16-mixed", "sgd")])
def test_lightning_step_scope_resumed_from_a_checkpoint_trains_as_eager(tmp_path, precision,
                                                                        optimizer):
    """A fit of 7 steps (one epoch) saved to a checkpoint, then a new
    module and trainer resuming from it to 16 steps (fit(ckpt_path=...)
    loads the optimizer's state, the LR scheduler's and, under 16-mixed,
    the GradScaler's into objects the new steps then graph), each half with
    CUDAGraphs(scope="step") and each without: the checkpoints' weights and
    optimizer, scheduler and precision states equal (a graphed fit saves
    what an eager one saves: the optimizer as built, not as cgraph made it
    capturable), and the resumed fit's parameters bitwise, every value it
    logged, and its global_step."""
    lightning = pytest.importorskip("lightning")
    from cgraph.lightning import CUDAGraphs
    kwargs = dict(accelerator="gpu", precision=precision, optimizer=optimizer)
    runs, stats, saved = [], [], []
    for graphed in (False, True):
        callbacks = (lambda: [CUDAGraphs(scope="step")]) if graphed else list
        path = str(tmp_path / f"{'graphed' if graphed else 'eager'}.ckpt")
        saved.append(path)
        first = callbacks()
        lightning_run(lightning, first, max_steps=7, save_to=path, **kwargs)
        second = callbacks()
        runs.append(lightning_run(lightning, second, max_steps=16, ckpt_path=path, **kwargs))
        stats += [(c.stats, c is second[0]) for c in first + second]
    checkpoints = [torch.load(path, map_location="cpu", weights_only=False) for path in saved]
    states = [{key: value for key, value in c.items()
               if key in ("state_dict", "optimizer_states", "lr_schedulers")
               or "Precision" in key} for c in checkpoints]
    assert states[0].keys() == states[1].keys()
    for key in states[0]:
        _assert_same_state(states[1][key], states[0][key], key)
    eager, graphed = runs
    assert graphed[2] == eager[2] == 16
    for i, (g, e) in enumerate(zip(graphed[0], eager[0])):
        assert torch.equal(g, e), f"parameter {i}"
    assert graphed[1] == eager[1]
    # Both halves graph the step; the resumed one replays at least 3 of its 9 batches.
    assert all(s["captures"] >= 1 and (s["replays"] >= 3 or not resumed)
               for s, resumed in stats), stats


@pytest.mark.gpu
def test_lightning_step_scope_with_accumulation_leaves_a_frozen_layer_where_eager_does():
    """With accumulate_grad_batches=2 the step zeroes grads in place; a head
    frozen at epoch 1 must lose its grad there as eager's zero_grad makes it
    None, or AdamW's weight decay would go on moving it at every replay."""
    lightning = pytest.importorskip("lightning")

    class Freeze(lightning.Callback):
        def on_train_epoch_start(self, trainer, module):
            if trainer.current_epoch == 1:
                module.head.requires_grad_(False)

    def fit(callbacks):
        return lightning_run(lightning, [*callbacks, Freeze()], accelerator="gpu",
                             optimizer="adamw-fused", accumulate=2, max_steps=16)

    assert_fits_alike(fit, captures=1, replays=4)


# ---- Lightning's two namespaces: lightning.pytorch and pytorch_lightning ------

PACKAGES = ["lightning", "pytorch_lightning"]


def lightning_package(name):
    """The package `name` as step_module and lightning_run use it
    (lightning.Trainer, lightning.pytorch.loggers...): pytorch_lightning is
    lightning.pytorch's code under a name of its own (Note [Two namespaces
    of Lightning] in cgraph/lightning.py)."""
    if name == "lightning":
        return pytest.importorskip("lightning")
    pl = pytest.importorskip("pytorch_lightning")
    return SimpleNamespace(Trainer=pl.Trainer, LightningModule=pl.LightningModule,
                           Callback=pl.Callback, pytorch=pl)


@pytest.mark.parametrize("package", PACKAGES)
def test_lightning_callback_is_taken_by_both_trainers(package, stand_in):
    """One CUDAGraphs class for either Trainer: given alone (the Trainer
    tests it against its own Callback, else takes it for a list) or in a
    list, and it graphs the blocks when the fit starts."""
    lightning = lightning_package(package)
    from cgraph.lightning import CUDAGraphs
    callback = CUDAGraphs()
    assert isinstance(callback, lightning.Callback)
    trainer = lightning.Trainer(accelerator="cpu", logger=False, enable_checkpointing=False,
                                callbacks=callback)
    assert callback in trainer.callbacks
    lightning_run(lightning, [callback], max_steps=2)
    assert len(stand_in) == 3


def test_lightning_step_scope_graphs_a_pytorch_lightning_trainer_s_step(stand_in, caplog):
    """scope="step" in a pytorch_lightning Trainer is not refused at train
    start for its namespace: the step's warm-up calls run, then its capture
    fails on the CPU, and the fit ends where the one without the callback
    does (as test_lightning_step_scope_keeps_lightning_s_books_then_falls_back
    checks with lightning.Trainer)."""
    lightning = lightning_package("pytorch_lightning")
    from cgraph.lightning import CUDAGraphs
    eager = lightning_run(lightning, [])
    callback = CUDAGraphs(scope="step")
    with caplog.at_level("INFO", logger="cgraph"):
        graphed = lightning_run(lightning, [callback])
    assert graphed[1] == eager[1] and graphed[2] == eager[2] == 8
    for i, (g, e) in enumerate(zip(graphed[0], eager[0])):
        assert torch.equal(g, e), f"parameter {i}"
    assert "the step's capture failed" in caplog.text and "strategy" not in caplog.text
    assert callback.stats == {"phases": 1, "eager": 3, "captures": 0, "replays": 0}
    assert len(stand_in) == 3  # after the capture failed


@pytest.mark.parametrize("package", PACKAGES)
@pytest.mark.parametrize("case, why", [
    (None, None),
    ("automatic_optimization", "the module optimizes manually"),
    ("on_after_backward", "Module.on_after_backward is overridden"),
    ("ddp_comm_hook", "DDP's communication hook or model averaging"),
    ("strategy", "not the Mine strategy"),
    ("64-true", "not the DoublePrecision plugin"),
    ("callback", "the Probe callback's on_before_optimizer_step"),
    ("other package's callback", "the Probe callback's on_before_optimizer_step"),
    ("other package's plain callback", None)])
def test_lightning_step_scope_decides_alike_in_both_packages(package, case, why):
    """The step scope's decision at train start in either namespace: the
    same reasons to graph the layers instead, and none that is only the
    namespace.  The trainer takes a list holding the other package's
    callbacks as well; theirs are compared with their own Callback."""
    lightning = lightning_package(package)
    from cgraph.lightning import CUDAGraphs, _why_not_the_step
    callbacks_from = lightning
    if case is not None and case.startswith("other package's"):
        callbacks_from = lightning_package(PACKAGES[1 - PACKAGES.index(package)])

    class Module(step_module(lightning)):
        def on_after_backward(self):
            pass

    class Probe(callbacks_from.Callback):
        def on_before_optimizer_step(self, trainer, module, optimizer):
            pass

    class Plain(callbacks_from.Callback):
        def on_train_epoch_end(self, trainer, module):
            pass

    class Mine(lightning.pytorch.strategies.SingleDeviceStrategy):
        pass

    module = (Module if case == "on_after_backward" else step_module(lightning))("sgd")
    module.automatic_optimization = case != "automatic_optimization"
    callback = CUDAGraphs(scope="step")
    other = {"callback": Probe, "other package's callback": Probe,
             "other package's plain callback": Plain}.get(case)
    kwargs = {"callbacks": [callback] + ([other()] if other else [])}
    if case == "ddp_comm_hook":
        kwargs["strategy"] = lightning.pytorch.strategies.DDPStrategy(
            ddp_comm_hook=lambda state, bucket: None)
    elif case == "strategy":
        kwargs["strategy"] = Mine(device=torch.device("cpu"))
    elif case == "64-true":
        kwargs["precision"] = "64-true"
    trainer = lightning.Trainer(accelerator="cpu", devices=1, logger=False,
                                enable_checkpointing=False, **kwargs)
    found = _why_not_the_step(trainer, module, callback)
    assert (found is None) if why is None else (why in found), found


@pytest.mark.parametrize("hidden", [("pytorch_lightning",), ("lightning",),
                                    ("lightning", "pytorch_lightning")])
def test_lightning_callback_imports_with_either_package_alone(hidden):
    """cgraph.lightning where a package is not installed (hidden: None in
    sys.modules, whose import fails as an absent package's does): the
    callback derives from the other's Callback; with neither, the
    ImportError says what to install."""
    for name in {"lightning", "pytorch_lightning"} - set(hidden):
        pytest.importorskip(name)
    code = (f"import sys\nfor name in {hidden!r}: sys.modules[name] = None\n"
            "from cgraph.lightning import CUDAGraphs\n"
            "print([base.__module__ for base in CUDAGraphs.__bases__])\n")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, cwd=root)
    if len(hidden) == 2:
        assert run.returncode != 0 and "ImportError: cgraph: " in run.stderr, run.stderr
        assert "pip install lightning" in run.stderr, run.stderr
        return
    assert run.returncode == 0, run.stderr[-3000:]
    left = "pytorch_lightning" if hidden == ("lightning",) else "lightning.pytorch"
    assert run.stdout.split("\n")[-2] == f"['{left}.callbacks.callback']", run.stdout


def test_lightning_callback_imports_beside_a_broken_second_package():
    """A pytorch_lightning that fails to import (a stale install: here a
    module without its submodules) beside a working lightning is left out;
    alone, its failure is raised."""
    pytest.importorskip("lightning")
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    broken = ("import sys, types\n"
              "sys.modules['pytorch_lightning'] = types.ModuleType('pytorch_lightning')\n")
    for hide_lightning in (False, True):
        code = (broken + ("sys.modules['lightning'] = None\n" if hide_lightning else "") +
                "from cgraph.lightning import CUDAGraphs\n"
                "print([base.__module__ for base in CUDAGraphs.__bases__])\n")
        run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                             timeout=300, cwd=root)
        if hide_lightning:
            assert run.returncode != 0 and "pytorch_lightning.plugins" in run.stderr, run.stderr
        else:
            assert run.returncode == 0, run.stderr[-3000:]
            assert run.stdout.split("\n")[-2] == "['lightning.pytorch.callbacks.callback']"


@pytest.mark.gpu
def test_lightning_step_scope_in_a_pytorch_lightning_trainer_trains_as_eager():
    """The whole step graphed in a pytorch_lightning Trainer (bf16-mixed:
    its MixedPrecision plugin; accumulation in three phases; fused AdamW with
    an LR schedule), against the same fit without the callback: parameters
    bitwise, every logged value, global_step, the grads after each batch."""
    assert_step_scope_trains_as_eager(lightning_package("pytorch_lightning"), "bf16-mixed",
                                      "adamw-fused", 2)


# ---- auto_find_batch_size: a retry at a smaller batch size graphs again ------


def test_hf_callback_graphs_again_when_the_batch_size_changes_under_auto_find(stand_in, caplog):
    """The Trainer's retry after running out of memory begins training again
    at a smaller batch size: the callback's graphs for the failed size are
    reset (each block's own forward back) and the blocks graphed again,
    logged; at the same size, or without auto_find_batch_size, they are kept."""
    transformers = pytest.importorskip("transformers")
    from cgraph.transformers import CUDAGraphsCallback
    model, callback = tiny_llama(transformers), CUDAGraphsCallback()
    args = SimpleNamespace(n_gpu=1, torch_compile=False, auto_find_batch_size=True)

    def begin(batch_size, **setting):
        callback.on_train_begin(SimpleNamespace(**{**vars(args), **setting}),
                                SimpleNamespace(train_batch_size=batch_size), None, model=model)
        return [layer.forward for layer in model.model.layers]

    first = begin(8)
    assert begin(8) == first and begin(7, auto_find_batch_size=False) == first
    with caplog.at_level("INFO", logger="cgraph"):
        again = begin(7)
    assert all(f.is_reset for f in first) and not any(f.is_reset for f in again)
    assert all(isinstance(f, StandIn) and f not in first for f in again)
    assert [b for b, _ in stand_in] == list(model.model.layers) * 2
    assert caplog.text.count("starts again at batch size 7, after running out of memory "
                             "at 8") == 1, caplog.text
    assert begin(7) == again


def test_hf_callback_leaves_blocks_the_user_graphed_at_any_batch_size(stand_in):
    transformers = pytest.importorskip("transformers")
    import cgraph
    from cgraph.transformers import CUDAGraphsCallback
    model, callback = tiny_llama(transformers), CUDAGraphsCallback()
    cgraph.graph_layers(model)
    mine = [layer.forward for layer in model.model.layers]
    args = SimpleNamespace(n_gpu=1, torch_compile=False, auto_find_batch_size=True)
    for batch_size in (8, 7):
        callback.on_train_begin(args, SimpleNamespace(train_batch_size=batch_size), None,
                                model=model)
    assert [layer.forward for layer in model.model.layers] == mine
    assert not any(f.is_reset for f in mine) and len(stand_in) == 2


def test_hf_trainer_retrying_a_smaller_batch_graphs_the_blocks_again(stand_in, tmp_path):
    """Inside the real Trainer: the first step at batch size 4 raises an
    out-of-memory error, the Trainer (auto_find_batch_size) trains again at
    a smaller size, and the blocks the callback graphed at 4 are reset and
    graphed again; the retry's calls go to the new graphs alone."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    from cgraph.transformers import CUDAGraphsCallback

    class OutOfMemoryOnce(transformers.TrainerCallback):
        sizes = []

        def on_step_begin(self, args, state, control, **kwargs):
            self.sizes.append(state.train_batch_size)
            if len(self.sizes) == 1:
                raise RuntimeError("CUDA out of memory. Tried to allocate 2.00 GiB")

    model = tiny_llama(transformers)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=4,
        auto_find_batch_size=True, report_to=[], save_strategy="no")
    oom = OutOfMemoryOnce()
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   callbacks=[CUDAGraphsCallback(), oom])
    trainer.train()
    assert oom.sizes[0] == 4 and 0 < oom.sizes[1] < 4, oom.sizes
    first, again = stand_in[:2], stand_in[2:]
    assert [b for b, _ in first] == [b for b, _ in again] == list(model.model.layers)
    assert all(layer.forward.calls == 1 and not layer.forward.is_reset
               for layer in model.model.layers)


def test_hf_trainer_with_use_cache_keeps_it_in_the_config_and_gives_the_blocks_none(
        stand_in, tmp_path):
    """TrainingArguments(use_cache=True) sets the model's config.use_cache;
    the callback leaves it, so the checkpoint says use_cache true, while the
    Trainer's training and evaluation forwards (use_cache unset) hand the
    graphed blocks no cache."""
    transformers = pytest.importorskip("transformers")
    pytest.importorskip("accelerate")
    import json

    from cgraph._describe import holds_cache
    from cgraph.transformers import CUDAGraphsCallback
    model = tiny_llama(transformers)
    caches = []
    for layer in model.model.layers:
        layer.register_forward_pre_hook(
            lambda m, args, kwargs: caches.append(holds_cache((args, kwargs))), with_kwargs=True)
    args = transformers.TrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, max_steps=1, per_device_train_batch_size=2,
        per_device_eval_batch_size=2, use_cache=True, report_to=[], save_strategy="no",
        eval_strategy="steps", eval_steps=1)
    trainer = transformers.Trainer(model=model, args=args, train_dataset=Tokens(),
                                   eval_dataset=Tokens(), callbacks=[CUDAGraphsCallback()])
    trainer.train()
    assert model.config.use_cache is True
    # One training batch, then 4 evaluation batches, through each of 2 layers.
    assert caches == [False] * 10
    assert [layer.forward.calls for layer in model.model.layers] == [5, 5]
    trainer.save_model(str(tmp_path / "saved"))
    with open(tmp_path / "saved" / "config.json") as f:
        assert json.load(f)["use_cache"] is True

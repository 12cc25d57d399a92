"""cgraph for the Hugging Face Trainer: one callback.

    from cgraph.transformers import CUDAGraphsCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[CUDAGraphsCallback()])

Needs ``transformers`` (``pip install cgraph[transformers]``).
"""

from __future__ import annotations

import gc
import weakref

import torch
from transformers import TrainerCallback

from . import _layers
from ._log import log

__all__ = ["CUDAGraphsCallback"]


class CUDAGraphsCallback(TrainerCallback):
    """Graphs the model's repeated blocks (:func:`cgraph.graph_layers`) when
    training begins, after the Trainer has prepared (wrapped) the model.

    Each block captures on its first call, one graph per shape, train and
    eval mode, and autocast state, so mixed precision, gradient accumulation,
    gradient checkpointing and evaluation keep working.  The Trainer sets
    ``config.use_cache`` from ``TrainingArguments.use_cache`` (False by
    default); where that is on, the Trainer's forwards, which leave
    ``use_cache`` unset, run without a KV cache (logged), and the config
    and checkpoints keep it on.  Batches
    padded to varying lengths make a graph per length, up to ``max_graphs``
    (then eager, logged): pad to a fixed length, or pass ``buckets=``
    through to :func:`cgraph.make_graphed`.

    A second ``train()`` keeps the graphs.  With ``auto_find_batch_size``,
    the Trainer's retry at a smaller batch size after running out of memory
    frees the graphs the callback captured (each block's ``forward.reset()``)
    and graphs the blocks again (logged), so the retry does not run beside
    the failed size's graphs.  Blocks graphed before training are left as
    they are.

    Keywords go to :func:`cgraph.graph_layers` (``layers=``, ``pool=``,
    ``buckets=``, ``max_graphs=``...)."""

    def __init__(self, **graph_layers_kwargs):
        self.graph_layers_kwargs = graph_layers_kwargs
        # The blocks this callback graphed and the batch size then; weakly:
        # the graphs go with the model.
        self._graphed: "weakref.WeakSet[torch.nn.Module]" = weakref.WeakSet()
        self._batch_size = None

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        _refuse_what_cannot_be_graphed(args)
        batch_size = getattr(state, "train_batch_size", None)
        if (getattr(args, "auto_find_batch_size", False) and len(self._graphed)
                and batch_size != self._batch_size):
            log.info("cgraph: CUDAGraphsCallback: the Trainer starts again at batch size %s, "
                     "after running out of memory at %s (auto_find_batch_size): the graphs "
                     "the callback captured are freed and the blocks graphed again",
                     batch_size, self._batch_size)
            self._reset_graphed()
        if _layers.graph_layers_once(model, "CUDAGraphsCallback", **self.graph_layers_kwargs):
            self._graphed.update(_graphed_blocks(model))  # the callback's, not the user's
            self._batch_size = batch_size

    def _reset_graphed(self) -> None:
        """Reset each block this callback graphed (which gives it its own
        forward back) and let the graphs' memory go, so that a retry at a
        smaller batch size does not run beside them."""
        for block in list(self._graphed):
            if _layers.is_graphed(block):
                block.forward.reset()
        self._graphed.clear()
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def _graphed_blocks(model: torch.nn.Module) -> list:
    return [m for m in model.modules() if _layers.is_graphed(m)]


def _refuse_what_cannot_be_graphed(args) -> None:
    if getattr(args, "n_gpu", 1) > 1:  # one process, several GPUs: nn.DataParallel
        raise ValueError(
            f"cgraph: CUDAGraphsCallback: the Trainer runs on {args.n_gpu} GPUs in one process "
            "(torch.nn.DataParallel), which would replay each graph on GPUs it was not "
            "captured on. Launch one process per GPU (torchrun --nproc_per_node=N "
            "train.py), or make one GPU visible (CUDA_VISIBLE_DEVICES=0).")
    if getattr(args, "torch_compile", False):
        raise ValueError(
            "cgraph: CUDAGraphsCallback: torch_compile=True compiles the whole model around "
            "the layers the callback would graph. Pass torch_compile=False; to compile as "
            "well, compile each layer's forward before training (layer.forward = "
            "torch.compile(layer.forward)): cgraph graphs compiled forwards.")

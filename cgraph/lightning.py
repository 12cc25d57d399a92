"""cgraph for Lightning: one callback.

    from cgraph.lightning import CUDAGraphs
    trainer = lightning.Trainer(callbacks=[CUDAGraphs()])

Needs ``lightning`` (``pip install cgraph[lightning]``).
"""

from __future__ import annotations

from lightning.pytorch.callbacks import Callback

from ._layers import graph_layers_once

__all__ = ["CUDAGraphs"]


class CUDAGraphs(Callback):
    """Graphs the LightningModule's repeated blocks
    (:func:`cgraph.graph_layers`) when training starts: after the strategy
    has set the module up (DDP wraps it then) and after the sanity-check
    validation, which runs under ``torch.inference_mode``, where torch up to
    2.11 must not capture a process's first graph (pytorch#172706).

    Each block captures on its first call, one graph per shape, train and
    eval mode, and autocast state: ``precision="16-mixed"`` or
    ``"bf16-mixed"``, ``accumulate_grad_batches`` and the validation loop
    keep working, and ``self.log`` of the loss is untouched.

    Keywords go to :func:`cgraph.graph_layers` (``layers=``, ``pool=``,
    ``buckets=``, ``max_graphs=``...)."""

    def __init__(self, **graph_layers_kwargs):
        self.graph_layers_kwargs = graph_layers_kwargs

    def on_train_start(self, trainer, pl_module) -> None:
        if getattr(pl_module, "_compiler_ctx", None):  # trainer.fit(torch.compile(module))
            raise ValueError(
                "cgraph: CUDAGraphs: the LightningModule was compiled whole (torch.compile), "
                "around the blocks the callback would graph. Fit the module uncompiled; to "
                "compile as well, compile each block's forward (block.forward = "
                "torch.compile(block.forward)): cgraph graphs compiled forwards.")
        graph_layers_once(pl_module, "CUDAGraphs", **self.graph_layers_kwargs)

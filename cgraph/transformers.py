"""cgraph for the Hugging Face Trainer: one callback.

    from cgraph.transformers import CUDAGraphsCallback
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[CUDAGraphsCallback()])

Needs ``transformers`` (``pip install cgraph[transformers]``).
"""

from __future__ import annotations

from transformers import TrainerCallback

from ._layers import graph_layers_once

__all__ = ["CUDAGraphsCallback"]


class CUDAGraphsCallback(TrainerCallback):
    """Graphs the model's repeated blocks (:func:`cgraph.graph_layers`) when
    training begins, after the Trainer has prepared (wrapped) the model.

    Each block captures on its first call, one graph per shape, train and
    eval mode, and autocast state, so mixed precision, gradient accumulation,
    gradient checkpointing and evaluation keep working; the cache is turned
    off (logged).  Batches padded to varying lengths make a graph per length,
    up to ``max_graphs`` (then eager, logged): pad to a fixed length, or pass
    ``buckets=`` through to :func:`cgraph.make_graphed`.

    Keywords go to :func:`cgraph.graph_layers` (``layers=``, ``pool=``,
    ``buckets=``, ``max_graphs=``...)."""

    def __init__(self, **graph_layers_kwargs):
        self.graph_layers_kwargs = graph_layers_kwargs

    def on_train_begin(self, args, state, control, model=None, **kwargs):
        if model is None:
            return
        graph_layers_once(model, "CUDAGraphsCallback", **self.graph_layers_kwargs)

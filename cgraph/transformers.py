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
        _refuse_what_cannot_be_graphed(args)
        graph_layers_once(model, "CUDAGraphsCallback", **self.graph_layers_kwargs)


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

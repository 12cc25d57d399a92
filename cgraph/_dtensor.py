"""DTensor parameters (tensor parallelism: ``parallelize_module``; the
unsharded parameters of FSDP2 on a 2-D mesh) in per-layer graphs.

Note [DTensor parameters in per-layer graphs]
Q: A DTensor is a Python wrapper around a local tensor: the wrapper has no
   memory of its own, its shape is the global one, and its grad must be a
   DTensor of the same placements.  The native core reads a parameter's
   memory and hands out grads of its shape.  How does a layer with DTensor
   parameters get graphed?
A: The graphs read each DTensor parameter's local tensor, through a plain
   leaf over the same memory (``local_leaf``, one per parameter, kept): at
   warm-up, capture and eager calls the module runs with each DTensor
   parameter replaced by ``DTensor.from_local(leaf, ...)`` of its mesh,
   placements, shape and stride (``forward_on_leaves``), so its DTensor ops
   (and the collectives TP's hooks issue inside the layer, captured with
   them) read the leaf's memory, the parameter's own, which the optimizer
   updates in place.  The native core sees plain leaves: it checks their
   memory on every replay and computes their grads.  A hook after each
   leaf's grad is accumulated hands it on as the parameter's grad: a DTensor
   of the parameter's placements over that memory, added into a grad the
   parameter holds, as AccumulateGrad would.  The hook makes the leaf's grad
   go through autograd (Note [Parameter gradients] in csrc/aten_backward.cpp):
   a copy of its grad per backward, one kernel per parameter.  A parameter
   frozen after capture gets no grad (the hook drops the graph's); one
   unfrozen after capture is not seen by the replays (the leaf the graphs
   were captured with computes no grad, and is synced to its parameter only
   when the layer captures again, another shape's graph), as README's
   Limits say.
   DTensor arguments and outputs are refused, naming use_local_output=True
   (sequence parallelism planned as torchtitan plans it passes plain shards
   of the sequence between blocks, and DTensors only inside them; a norm's
   weight grad then comes back reduced, of the weight's placement, through
   from_local's backward, where eager leaves it Partial); inside a step
   graphed whole (make_graphed_step) DTensors flow anywhere, and it may
   return one (cgraph/_step.py, _DTensorOut); its arguments are plain.
"""

from __future__ import annotations

import weakref

import torch
from torch.nn.utils.stateless import _reparametrize_module
from torch.utils import _pytree as pytree
from torch.utils.weak import WeakIdKeyDictionary

try:
    from torch.distributed.tensor import DTensor
except ImportError:  # a torch built without distributed
    DTensor = None

# The leaf each DTensor parameter's graphs read, for as long as the parameter lives.
_leaves: "WeakIdKeyDictionary[torch.Tensor, torch.Tensor]" = WeakIdKeyDictionary()


def is_dtensor(t) -> bool:
    return DTensor is not None and isinstance(t, DTensor)


def local_leaf(param: torch.Tensor) -> torch.Tensor:
    """The plain leaf over `param`'s local memory that the graphs read; for
    a tensor that is not a DTensor, the tensor itself."""
    if not is_dtensor(param):
        return param
    local = param._local_tensor
    leaf = _leaves.get(param)
    if leaf is None or leaf.untyped_storage()._cdata != local.untyped_storage()._cdata:
        leaf = _leaves[param] = local.detach().requires_grad_()
        # Once, frozen or not: the hook drops the grads of a frozen parameter.
        leaf.register_post_accumulate_grad_hook(_GradToParam(param))
    if leaf.requires_grad != param.requires_grad:  # frozen, or unfrozen, since
        leaf.requires_grad_(param.requires_grad)
    return leaf


class _GradToParam:
    """Post-accumulate-grad hook of a leaf: its grad, as a DTensor of the
    parameter's placements, becomes (or is added into) the parameter's."""

    __slots__ = ("param",)

    def __init__(self, param: torch.Tensor):
        self.param = weakref.ref(param)

    def __call__(self, leaf: torch.Tensor) -> None:
        param, grad = self.param(), leaf.grad
        leaf.grad = None
        # A parameter frozen after its graphs were captured: their leaf still
        # requires grad, and eager would compute none for it.
        if param is None or grad is None or not param.requires_grad:
            return
        grad = DTensor.from_local(grad, param.device_mesh, param.placements, run_check=False,
                                  shape=param.shape, stride=param.stride())
        if param.grad is None:
            param.grad = grad
        else:
            param.grad += grad


def forward_on_leaves(forward):
    """`forward(module, *args, **kwargs)` run with each DTensor parameter of
    the module replaced by a DTensor over its leaf (Note [DTensor
    parameters in per-layer graphs]); as it is for a module without any."""

    def call(module, *args, **kwargs):
        swaps = {name: _over_leaf(p) for name, p in module.named_parameters()
                 if is_dtensor(p)}
        if not swaps:  # FSDP's unsharded parameters of a 1-D mesh are plain tensors
            return forward(module, *args, **kwargs)
        with _reparametrize_module(module, swaps):
            out = forward(module, *args, **kwargs)
        refuse_dtensors(out, "returns")
        return out

    return call


def refuse_dtensors(tree, what: str) -> None:
    """DTensor arguments and outputs are not graphed per layer."""
    if DTensor is not None and any(is_dtensor(t) for t in pytree.tree_leaves(tree)):
        raise ValueError(
            f"cgraph: a graphed layer {what} a DTensor (SequenceParallel, or "
            "use_local_output=False); per-layer graphs take and return plain tensors. Use "
            "ColwiseParallel/RowwiseParallel with use_local_output=True around the layer, or "
            "graph the whole step (cgraph.make_graphed_step), inside which DTensors flow "
            "anywhere.")


def _over_leaf(param):
    return DTensor.from_local(local_leaf(param), param.device_mesh, param.placements,
                              run_check=False, shape=param.shape, stride=param.stride())

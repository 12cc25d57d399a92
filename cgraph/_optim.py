"""Optimizer steps a graph can replay, for torch optimizers that have no
capturable form: Note [Optimizers without a capturable form].

Note [Optimizers without a capturable form]
Q: torch's Adagrad has no ``capturable=`` option: its step size
   ``lr / (1 + (step - 1) * lr_decay)`` is computed on the host from the step
   count (``step.item()``), a sync a graph cannot hold.  How does a graphed
   step run it?
A: While the step is captured, torch's two Adagrad implementations (foreach
   and single-tensor) are replaced by these, which do the same arithmetic in
   the same order with the step count on the device (moved there before
   capture, as capturable optimizers' are).  With ``lr_decay=0`` (the
   default) the step size does not depend on the count at all: it is eager's
   Python float, and the result is eager's bit for bit.  With another
   ``lr_decay`` it is computed on the device in float32 where eager computes
   it in float64, so results agree to float32 rounding.  ``lr`` and the other
   hyperparameters are baked into the graph and compared before each replay
   (Note [Capturable optimizers] in cgraph/_step.py).  Sparse gradients are
   refused.
"""

from __future__ import annotations

import contextlib

import torch
from torch.optim import adagrad

from ._capture import patched

__all__ = ["device_resident_steps"]


def device_resident_steps():
    """While a step is captured: Adagrad's implementations, replaced by
    those of Note [Optimizers without a capturable form]."""
    if not hasattr(adagrad, "_multi_tensor_adagrad"):
        return contextlib.nullcontext()
    return patched({(adagrad, "_multi_tensor_adagrad"): _multi_tensor_adagrad,
                    (adagrad, "_single_tensor_adagrad"): _single_tensor_adagrad})


def _minus_step_sizes(steps: list, lr: float, lr_decay: float) -> list:
    """-lr / (1 + (step - 1) * lr_decay) for each step count (already
    incremented): eager's float where it does not depend on the count."""
    if lr_decay == 0:
        return [-lr] * len(steps)
    return [torch.full_like(s, -lr).div_(s.sub(1).mul_(lr_decay).add_(1)) for s in steps]


def _refuse_sparse(grads: list) -> None:
    if any(g.is_sparse for g in grads):
        raise ValueError(
            "cgraph: Adagrad got a sparse gradient (nn.Embedding(sparse=True)); its sparse "
            "update depends on which rows are present, which a graph cannot replay. Use "
            "sparse=False, or step this optimizer outside the graphed step.")


def _multi_tensor_adagrad(params, grads, state_sums, state_steps, grad_scale, found_inf, *,
                          lr, weight_decay, lr_decay, eps, has_sparse_grad, maximize,
                          differentiable, has_complex):
    """torch.optim.adagrad._multi_tensor_adagrad with the step size of Note
    [Optimizers without a capturable form]; the same foreach ops in the
    same order."""
    if not params:
        return
    _refuse_sparse(grads)
    lr = float(lr)
    if has_complex:
        from torch.optim.optimizer import _view_as_real
        _view_as_real(params, grads, state_sums)
    if maximize:
        grads = torch._foreach_neg(grads)
    torch._foreach_add_(state_steps, 1)
    if weight_decay != 0:
        if maximize:
            torch._foreach_add_(grads, params, alpha=weight_decay)
        else:
            grads = torch._foreach_add(grads, params, alpha=weight_decay)
    minus_clr = _minus_step_sizes(state_steps, lr, lr_decay)
    torch._foreach_addcmul_(state_sums, grads, grads, value=1)
    std = torch._foreach_sqrt(state_sums)
    torch._foreach_add_(std, eps)
    if lr_decay != 0:  # a tensor per parameter: one multiply each
        numerator = [g.mul(c) for g, c in zip(grads, minus_clr)]
    elif weight_decay != 0 or maximize:
        torch._foreach_mul_(grads, minus_clr)
        numerator = grads
    else:
        numerator = torch._foreach_mul(grads, minus_clr)
    torch._foreach_addcdiv_(params, numerator, std)


def _single_tensor_adagrad(params, grads, state_sums, state_steps, grad_scale, found_inf, *,
                           lr, weight_decay, lr_decay, eps, has_sparse_grad, maximize,
                           differentiable, has_complex):
    """torch.optim.adagrad._single_tensor_adagrad with the step size of Note
    [Optimizers without a capturable form]."""
    _refuse_sparse(grads)
    lr = float(lr)
    for param, grad, state_sum, step in zip(params, grads, state_sums, state_steps):
        step += 1
        grad = grad if not maximize else -grad
        if weight_decay != 0:
            grad = grad.add(param, alpha=weight_decay)
        if torch.is_complex(param):
            grad, state_sum, param = (torch.view_as_real(t) for t in (grad, state_sum, param))
        state_sum.addcmul_(grad, grad, value=1)
        std = state_sum.sqrt().add_(eps)
        (minus_clr,) = _minus_step_sizes([step], lr, lr_decay)
        if lr_decay == 0:
            param.addcdiv_(grad, std, value=minus_clr)
        else:  # addcdiv's value must be a number: value * (grad / std), spelled out
            param.add_(grad.div(std).mul_(minus_clr))

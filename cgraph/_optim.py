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

Note [An unfused SGD stepped by the fused kernel]
Q: SGD's foreach step launches several kernels per chunk of parameters
   (momentum, weight decay, update), its single-tensor step (foreach=False,
   or fused=False passed) several per parameter, its fused twin one per
   chunk.  In a graphed mlp step the single-tensor step cost 16% of the
   step's time, in float32 or under a GradScaler.  Must a graph replay
   torch's unfused kernels?
A: No, where the fused kernel computes the same bits: the replay then
   launches what the fused optimizer's does.  While the step is captured,
   torch's ``_multi_tensor_sgd`` and ``_single_tensor_sgd`` are replaced by
   functions that call ``_fused_sgd`` for a call whose hyperparameters were
   checked equal to that step's on this device before the capture, and
   whose tensors the fused kernel takes as the unfused step does: plain
   float32 CUDA tensors, dense, grads of the params' dtype, no scaler
   arguments (an unfused SGD never gets them), momentum buffers all made or
   none.  Nesterov, maximize, dampening, a tensor hyperparameter and
   differentiable=True are left to torch (foreach Nesterov adds the momentum
   into p.grad, the fused kernel does not).  Anything else, and a device
   where the check disagrees, steps with torch's unfused kernels as before.
   lr stays a number baked into the graph (a change recaptures), as for the
   unfused step; eager steps (warm-up, a step outside the graph) are
   torch's own.
   The check (fused_sgd_matches) is empirical: both run three steps, the
   first creating the momentum buffers, on 117k random float32 values of
   every scale from 1e-8 to 1e8 with the group's hyperparameters, and must
   agree bit for bit, grads included.  Read from the source, the two could
   round differently (the fused kernel multiplies by lr and momentum in
   double, foreach in float); measured, they agree: fused and foreach on
   H200s with torch 2.11, momentum 0 and 0.9, weight decay 1e-4, lr 0.01
   and 0.1, over 5 steps of 460k values and 8 graphed training steps.  A
   torch or device where they do not fails the check and keeps foreach.
"""

from __future__ import annotations

import numbers
from typing import NamedTuple

import torch
from torch.optim import adagrad, sgd

from ._capture import patched

__all__ = ["device_resident_steps"]

# torch's unfused SGD steps, by the name sgd() calls them by: foreach (the
# default on CUDA) and single-tensor (foreach=False, or fused=False passed).
_TORCH_SGD_STEPS = {name: getattr(sgd, name) for name in ("_multi_tensor_sgd",
                                                          "_single_tensor_sgd")
                    if hasattr(sgd, name)}


def device_resident_steps(optimizers=()):
    """While a step is captured: Adagrad's implementations, replaced by
    those of Note [Optimizers without a capturable form], and SGD's unfused
    steps by the fused kernel where `optimizers`' SGD groups check equal
    (Note [An unfused SGD stepped by the fused kernel])."""
    patches = {}
    if hasattr(adagrad, "_multi_tensor_adagrad"):
        patches.update({(adagrad, "_multi_tensor_adagrad"): _multi_tensor_adagrad,
                        (adagrad, "_single_tensor_adagrad"): _single_tensor_adagrad})
    if not hasattr(sgd, "_fused_sgd"):
        return patched(patches)
    groups = [g for opt in optimizers if isinstance(opt, torch.optim.SGD)
              for g in opt.param_groups if _fusable_group(g)]
    for name in _TORCH_SGD_STEPS:
        keys = {_sgd_key(name, g["params"][0].device.index, g) for g in groups}
        checked = {key: fused_sgd_matches(*key) for key in keys}
        patches[(sgd, name)] = _sgd_stepped_fused_where(name, checked)
    return patched(patches)


# ---- SGD: Note [An unfused SGD stepped by the fused kernel] -----------------


class _SGDKey(NamedTuple):
    """What the fused kernel's bits may depend on, besides the values, and
    the unfused step they must equal (a name in _TORCH_SGD_STEPS)."""

    step: str
    device: int
    lr: float
    momentum: float
    weight_decay: float


def _covered(hyper) -> bool:
    """Whether the check covers these SGD settings (a param group, or the
    keywords of a step call): numbers for lr, momentum and weight decay, no
    dampening, maximize or Nesterov (torch's foreach Nesterov adds the
    momentum into the grads themselves, p.grad changes; the fused kernel
    does not)."""
    return (not hyper.get("maximize") and hyper.get("dampening", 0) == 0
            and not hyper.get("nesterov")
            and all(_a_number(hyper[k]) for k in ("lr", "momentum", "weight_decay")))


def _sgd_key(step: str, device: int, hyper) -> _SGDKey:
    return _SGDKey(step, device, float(hyper["lr"]), float(hyper["momentum"]),
                   float(hyper["weight_decay"]))


def _fusable_group(group: dict) -> bool:
    """A group an unfused step would run (neither fused nor differentiable),
    with settings the check covers."""
    params = group["params"]
    return (bool(params) and not group.get("fused") and not group.get("differentiable")
            and params[0].is_cuda and _covered(group))


def _a_number(x) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool)


def _fusable_tensors(params: list, grads: list, buffers: list) -> bool:
    """Tensors the fused kernel takes as foreach does: plain, dense,
    contiguous float32 CUDA tensors on one device, buffers all made or none."""
    device = params[0].device
    if not (all(b is None for b in buffers) or all(b is not None for b in buffers)):
        return False
    return all(type(t.data) is torch.Tensor and t.dtype == torch.float32 and t.is_cuda
               and t.device == device and t.layout == torch.strided and t.is_contiguous()
               for t in [*params, *grads, *(b for b in buffers if b is not None)])


def _sgd_stepped_fused_where(name: str, checked: dict):
    """torch.optim.sgd's unfused step `name`, calling _fused_sgd for a call
    whose hyperparameters `checked` found equal and whose tensors it takes."""
    unfused = _TORCH_SGD_STEPS[name]

    def unfused_or_fused(params, grads, momentum_buffer_list, grad_scale, found_inf,
                         **hyper):
        # Grad mode on: a differentiable=True group (its step records
        # autograd history), which the check does not cover.
        fused = (params and grad_scale is None and found_inf is None
                 and not torch.is_grad_enabled()
                 and _checked_hyperparameters(name, params[0].device.index, hyper, checked)
                 and _fusable_tensors(params, grads, momentum_buffer_list))
        step = sgd._fused_sgd if fused else unfused
        step(params, grads, momentum_buffer_list, grad_scale, found_inf, **hyper)

    return unfused_or_fused


# The keywords torch's _multi_tensor_sgd and _fused_sgd take.  Another keyword
# (a newer torch) steps unfused.
_SGD_KEYWORDS = {"weight_decay", "momentum", "lr", "dampening", "nesterov", "maximize",
                 "has_sparse_grad"}


def _checked_hyperparameters(step: str, device: int, hyper: dict, checked: dict) -> bool:
    if set(hyper) != _SGD_KEYWORDS or hyper["has_sparse_grad"] or not _covered(hyper):
        return False
    return checked.get(_sgd_key(step, device, hyper), False)


_MATCHES: dict[_SGDKey, bool] = {}


def fused_sgd_matches(step: str, device: int, lr: float, momentum: float,
                      weight_decay: float) -> bool:
    """Whether torch's fused SGD kernel steps float32 tensors on `device` to
    the same bits as its unfused `step` (a name in _TORCH_SGD_STEPS) with
    these hyperparameters, leaving the grads as the unfused step leaves
    them: three steps each (the first makes the momentum buffers) from the
    same random values, of every scale from 1e-8 to 1e8 (the last bits
    differ first where an update is tiny or huge against its parameter),
    sizes with ragged tails.  Runs eagerly (not inside a capture);
    remembered per process."""
    key = _SGDKey(step, device, lr, momentum, weight_decay)
    if key not in _MATCHES:
        generator = torch.Generator(device=f"cuda:{device}").manual_seed(0)

        def randn(shape):
            # Values of every scale from 1e-8 to 1e8, so that the update is
            # tiny, comparable or huge against a parameter's last bit.
            scale = torch.rand(shape, device=f"cuda:{device}", generator=generator)
            return torch.randn(shape, device=f"cuda:{device}", generator=generator) * (
                10.0 ** (scale * 16 - 8))

        shapes = [(100_003,), (257, 65), (3,)]
        params = [randn(s) for s in shapes]
        twins = [p.clone() for p in params]
        buffers, twin_buffers = [None] * len(shapes), [None] * len(shapes)
        hyper = dict(weight_decay=weight_decay, momentum=momentum, lr=lr, dampening=0.0,
                     nesterov=False, maximize=False, has_sparse_grad=False)
        same = True
        for _ in range(3):
            grads = [randn(s) for s in shapes]
            unfused_grads = [g.clone() for g in grads]
            _TORCH_SGD_STEPS[step](params, unfused_grads, buffers, None, None, **hyper)
            sgd._fused_sgd(twins, grads, twin_buffers, None, None, **hyper)
            pairs = [*zip(params, twins), *zip(unfused_grads, grads)]
            if momentum != 0:
                pairs += zip(buffers, twin_buffers)
            same = same and all(torch.equal(a, b) for a, b in pairs)
        _MATCHES[key] = same
    return _MATCHES[key]


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

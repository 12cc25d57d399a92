"""cgraph: CUDA graphs for PyTorch callables.

A drop-in for :func:`torch.cuda.make_graphed_callables` whose replay path
runs in C: inputs are checked and copied, the forward graph replayed and the
backward node wired without Python, and parameter grads accumulate as in
eager mode.

Example::

    import torch, cgraph

    model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.GELU()).cuda()
    x = torch.randn(32, 64, device="cuda", requires_grad=True)
    graphed = cgraph.make_graphed(model, (x,))
    for _ in range(3):
        graphed(torch.randn(32, 64, device="cuda")).sum().backward()
    graphed.reset()   # frees graphs and their memory pool
"""

import torch  # loads libtorch before the extension

from ._cuda_check import require_cuda_torch

require_cuda_torch(torch)  # a CPU-only torch: one sentence, not "libc10_cuda.so: cannot open"

from . import _C  # noqa: E402
from ._version import __version__
from ._api import (GraphedModule, graph_pool_handle, make_graphed, make_graphed_callables,
                   reset_all)
from ._explain import Explanation, Problem, explain
from ._layers import graph_layers
from ._step import GraphedStep, make_graphed_step

CaptureError = _C.CaptureError
Graphed = _C.Graphed

__all__ = [
    "CaptureError",
    "Explanation",
    "Graphed",
    "GraphedModule",
    "GraphedStep",
    "Problem",
    "explain",
    "graph_layers",
    "graph_pool_handle",
    "make_graphed",
    "make_graphed_callables",
    "make_graphed_step",
    "reset_all",
]

"""Activation checkpointing and torch.compile inside one graphed callable,
checked against eager mode.  On one GPU, from the repository root after a
build (`bash scripts/gpu.sh` builds in place):

    python3 -m examples.checkpoint_compile

The model: dropout, two transformer-style MLP blocks under
torch.utils.checkpoint (dropout inside: the recompute must redraw the
forward's masks; run once with use_reentrant=False, once with True), and a torch.compile'd head (default mode;
'max-autotune-no-cudagraphs' works too; 'reduce-overhead' is refused: cgraph
already removes the launch overhead it targets).  Both runs start each step
from the same generator state, so outputs and grads must match bit for bit.
"""

import copy

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

import cgraph


class Model(nn.Module):
    def __init__(self, use_reentrant, width=256):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.drop = nn.Dropout(0.1)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 4 * width), nn.GELU(),
                          nn.Dropout(0.1), nn.Linear(4 * width, width))
            for _ in range(2))
        self.head = torch.compile(nn.Sequential(nn.LayerNorm(width), nn.Linear(width, 64)))

    def forward(self, x):
        h = self.drop(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.head(h)


def step(model, x, upstream, seed):
    torch.cuda.manual_seed(seed)
    out = model(x)
    (out * upstream).sum().backward()
    return out.detach().clone()


def check(use_reentrant):
    torch.manual_seed(0)
    eager = Model(use_reentrant).cuda()
    twin = copy.deepcopy(eager)
    sample = torch.randn(64, 256, device="cuda", requires_grad=True)
    graphed = cgraph.make_graphed(twin, (sample,))
    for i in range(5):
        x = torch.randn(64, 256, device="cuda", requires_grad=True)
        upstream = torch.randn(64, 64, device="cuda")
        expected = step(eager, x, upstream, seed=i)
        actual = step(graphed, x.detach().requires_grad_(), upstream, seed=i)
        same = torch.equal(actual, expected) and all(
            torch.equal(p.grad, q.grad) for p, q in zip(twin.parameters(), eager.parameters()))
        print(f"use_reentrant={use_reentrant} step {i}: output and "
              f"{sum(1 for _ in eager.parameters())} grads bitwise equal to eager: "
              f"{'OK' if same else 'MISMATCH'}")
        if not same:
            raise SystemExit(1)
        for p in (*twin.parameters(), *eager.parameters()):
            p.grad = None
    graphed.reset()


def main():
    for use_reentrant in (False, True):
        check(use_reentrant)


if __name__ == "__main__":
    main()

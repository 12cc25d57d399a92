"""Helpers shared by the test files, one copy each: bitwise comparison with
eager PyTorch (outputs, parameter grads, an eager twin of an input), the
probe of a graph pool's memory, and the models more than one file builds
(with a seeded forward-and-backward step for the checkpointed one).  A
helper that one file alone uses lives in that file; torchrun runs the
examples that several test files launch on several GPUs."""

import contextlib
import gc
import os
import subprocess
import sys
import weakref

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

CUDA = "cuda"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def torchrun(example, nproc, timeout=300):
    """Runs examples/<example> under torchrun with `nproc` processes from the
    repository root; returns its stdout, failing with its output's tail if
    it exits non-zero or runs past `timeout` seconds.  On a timeout torchrun
    is sent SIGTERM, which it passes to its ranks (started in sessions of
    their own, which killing torchrun alone would leave holding the GPUs),
    and the tail says where they were."""
    run = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--standalone",
         f"--nproc_per_node={nproc}", os.path.join(ROOT, "examples", example)],
        cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        env={**os.environ, "PYTHONPATH": ROOT})
    try:
        out, err = run.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        run.terminate()
        try:
            out, err = run.communicate(timeout=60)
        except subprocess.TimeoutExpired:
            run.kill()
            out, err = run.communicate()
        raise AssertionError(f"{example} on {nproc} ranks ran past {timeout} s (a hang?):\n"
                             + out[-3000:] + err[-3000:]) from None
    print(out)
    assert run.returncode == 0, out[-3000:] + err[-3000:]
    return out


def assert_equal(actual, expected, what):
    """Bitwise equality, with the largest difference in the message."""
    assert actual is not None and expected is not None, f"{what}: missing ({actual}, {expected})"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal to eager, max |diff| = {diff:.3g}")


def assert_grads_equal(graphed_model, eager_model, step):
    for (name, p), q in zip(graphed_model.named_parameters(), eager_model.parameters()):
        if p.grad is None and q.grad is None:
            continue  # frozen in both
        assert_equal(p.grad, q.grad, f"step {step}: grad of {name}")


def backward_as_eager(out, out_e, x=None, xe=None, what="input grad"):
    """Backward through a graphed output and eager's with one random upstream
    grad; where the graphed call's input `x` requires grad, its grad must be
    eager's (`xe`'s) bitwise."""
    upstream = torch.randn_like(out)
    (out * upstream).sum().backward()
    (out_e * upstream).sum().backward()
    if x is not None and x.requires_grad:
        assert_equal(x.grad, xe.grad, what)


def twin(x):
    """An independent copy of an input for the eager run."""
    return x.detach().clone().requires_grad_(x.requires_grad)


def assert_logged(caplog, *parts):
    """One of cgraph's log records says every one of `parts`."""
    messages = [r.getMessage() for r in caplog.records if r.name == "cgraph"]
    assert any(all(part in m for part in parts) for m in messages), (parts, messages)


def pool_segments(pool):
    return [s for s in torch.cuda.memory_snapshot()
            if tuple(s.get("segment_pool_id", (0, 0))) == tuple(pool)]


def in_pool(t, pool):
    """Whether tensor `t`'s memory lies in a segment of graph pool `pool`."""
    address = t.untyped_storage().data_ptr()
    return any(s["address"] <= address < s["address"] + s["total_size"]
               for s in pool_segments(pool))


def square_loss_step(model, opt):
    """An ordinary eager training step of `model` under `opt`, returning
    the loss: the step several files graph with make_graphed_step."""

    def step(x):
        opt.zero_grad()
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        return loss

    return step


# ---- models -----------------------------------------------------------------


def mlp():
    return nn.Sequential(nn.Linear(32, 64), nn.GELU(), nn.Linear(64, 64), nn.ReLU(),
                         nn.Linear(64, 16)).to(CUDA), lambda: torch.randn(8, 32, device=CUDA,
                                                                         requires_grad=True)


def stack(width=64, depth=3):
    layers = []
    for _ in range(depth):
        layers += [nn.Linear(width, width), nn.GELU()]
    return nn.Sequential(*layers).to(CUDA)


class Checkpointed(nn.Module):
    """Dropout before, inside and after two checkpointed regions."""

    def __init__(self, p=0.25, use_reentrant=False):
        super().__init__()
        self.use_reentrant = use_reentrant
        self.inp = nn.Dropout(p)
        self.blocks = nn.ModuleList(
            nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Dropout(p), nn.Linear(128, 64))
            for _ in range(2))
        self.out = nn.Dropout(p)

    def forward(self, x):
        h = self.inp(x)
        for block in self.blocks:
            h = h + checkpoint(block, h, use_reentrant=self.use_reentrant)
        return self.out(h)


def run_step(model, x, upstream, seed):
    """One forward and backward from a known generator state; returns the
    output, the input's grad and the generator state after the step."""
    torch.cuda.manual_seed(seed)
    out = model(x)
    (out * upstream).sum().backward()
    return out.detach().clone(), x.grad.clone(), torch.cuda.get_rng_state()


class StandIn:
    """What a block's forward becomes where graphing is stood in for (on
    the CPU: tests/test_layers.py, tests/test_trainers.py): the forward
    make_graphed would capture (the block's own if it has one, else its
    class's), counting its calls."""

    def __init__(self, block):
        self.own = block.__dict__.get("forward")
        self.forward = (self.own if self.own is not None
                        else type(block).forward.__get__(block))
        self.block = weakref.ref(block)
        self.calls = 0
        self.is_reset = False

    def __call__(self, *args, **kwargs):
        self.calls += 1
        return self.forward(*args, **kwargs)

    def reset(self):
        """As a graphed forward's reset(): the block gets its own forward back."""
        self.is_reset = True
        block = self.block()
        if block is not None and block.__dict__.get("forward") is self:
            del block.forward
            if self.own is not None:
                block.forward = self.own


@contextlib.contextmanager
def state_as_captured():
    """The global state cgraph warms up and captures a callable under, as
    far as torch.compile guards on it: autocast's weight cache off (Note
    [Autocast's weight cache] in cgraph/_capture.py).  A compiled reference
    called under it runs the code compiled in cgraph's warm-up.  Called
    outside it, dynamo recompiles, and the second compile's kernels may
    pick other configs than the first's by timing them (1 ulp apart, on
    H100s and H200s shared with other test processes).  A recompile raises
    here, so such a reference is never a second compile."""
    from cgraph._capture import _autocast_cache_off  # cgraph's own, not a copy of it
    with _autocast_cache_off(), torch._dynamo.config.patch(error_on_recompile=True):
        yield


def inductor_deterministic(on=True):
    """Inductor without on-device benchmarking (torch._inductor.config.
    deterministic): it picks some reduction kernels' configs by timing them,
    and a compiled reference and its graphed twin, compiled separately, can
    pick two that sum in another order on a busy GPU (1 ulp, seen when the
    GPU was shared with other test processes).  Not for max-autotune, whose
    template benchmarking this mode refuses.  A no-op on a torch without it."""
    import torch._inductor.config as inductor

    if not on or not hasattr(inductor, "deterministic"):
        return contextlib.nullcontext()
    return inductor.patch(deterministic=True)


@contextlib.contextmanager
def collector_off():
    """The garbage collector off inside: what is dropped there goes by its
    reference counts alone, so whatever is still alive is in a cycle."""
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


def tiny_llama(transformers):
    """A Hugging Face LlamaForCausalLM of two layers, its KV cache on, seeded."""
    config = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                      num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, use_cache=True)
    torch.manual_seed(0)
    return transformers.LlamaForCausalLM(config)

"""DDP on two GPUs, in a file of its own because it needs two: the test runs
examples/ddp.py under torchrun, which checks both DDP recipes (graphed layers
inside DDP, and a graphed model wrapped in DDP) against eager DDP with
bitwise-equal grads, that the allreduce overlaps the backward, and teardown;
the test asserts each rank's report of every check.  Skipped with fewer than
two GPUs."""

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_ddp_recipes_on_two_gpus():
    run = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
         os.path.join(ROOT, "examples", "ddp.py")],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
        env={**os.environ, "PYTHONPATH": ROOT})
    print(run.stdout)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    for rank in (0, 1):
        for check in ("graphed layers in DDP: grads equal", "overlap:",
                      "graphed DDP model: grads equal", "teardown:"):
            assert f"rank {rank} {check}" in run.stdout, run.stdout

"""cgraph's checked invariants (Note [Checked invariants] in
csrc/aten_checks.cpp): the debug checks are switched by CGRAPH_DEBUG and
cgraph._C._debug, they pass on a correct run, and a planted fault makes the
check that guards the broken rule fire instead of a silently wrong result."""

import contextlib
import os
import subprocess
import sys

import pytest
import torch
from torch import nn

import cgraph
from cgraph import _C

from _helpers import CUDA, assert_equal


@contextlib.contextmanager
def debug(fault=None):
    was = _C._debug()
    _C._debug(True, fault)
    try:
        yield
    finally:
        _C._debug(was)


def test_cgraph_debug_in_the_environment_turns_the_checks_on():
    code = "import cgraph; print(cgraph._C._debug())"
    for value, expected in (("1", "True"), ("0", "False"), ("", "False")):
        env = dict(os.environ, CGRAPH_DEBUG=value)
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                             text=True, check=True).stdout.split()
        assert out[-1] == expected, (value, out)


def test_an_unknown_fault_is_refused_and_changes_nothing():
    was = _C._debug()
    with pytest.raises(ValueError, match="skip_later_moves"):
        _C._debug(True, "no_such_fault")
    assert _C._debug() == was


def _two_layers_in_one_pool():
    torch.manual_seed(3)
    layers = tuple(nn.Sequential(nn.Linear(16, 16), nn.GELU()).to(CUDA) for _ in range(2))
    samples = tuple((torch.randn(4, 16, device=CUDA, requires_grad=True),) for _ in layers)
    return cgraph.make_graphed_callables(layers, samples)


@pytest.mark.gpu
def test_a_planted_fault_fires_the_check_of_the_rule_it_breaks():
    """Graphed together, the second layer's forward is captured after the
    first's, so a replay of the first may overwrite the second's output: a
    kept output must move first.  With that move skipped, the debug check
    raises before the replay; without the fault the output keeps its value."""
    first, second = _two_layers_in_one_pool()
    x = torch.randn(4, 16, device=CUDA, requires_grad=True)
    kept = second(first(x))
    kept.sum().backward()
    value = kept.detach().clone()
    with debug("skip_later_moves"), pytest.raises(RuntimeError, match="cgraph invariant"):
        first(torch.randn(4, 16, device=CUDA, requires_grad=True))
    with debug():
        second(first(torch.randn(4, 16, device=CUDA, requires_grad=True))).sum().backward()
    assert_equal(kept, value, "the kept output after a later replay")
    assert second.forward.stats["outputs_copied"] >= 1

"""Shared by the GPU test files."""

import torch


def assert_equal(actual, expected, what):
    """Bitwise equality, with the largest difference in the message."""
    assert actual is not None and expected is not None, f"{what}: missing ({actual}, {expected})"
    if not torch.equal(actual, expected):
        diff = (actual.double() - expected.double()).abs().max().item()
        raise AssertionError(f"{what}: not bitwise equal to eager, max |diff| = {diff:.3g}")

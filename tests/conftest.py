import gc

import pytest
import torch

CUDA = torch.cuda.is_available()


def pytest_collection_modifyitems(config, items):
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords and not CUDA:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _fresh_allocator():
    """Each GPU test starts with nothing cached, so memory checks are exact."""
    yield
    if CUDA:
        gc.collect()
        torch.cuda.synchronize()
        torch.cuda.empty_cache()

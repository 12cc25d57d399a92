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


@pytest.fixture
def mesh():
    """A one-process gloo group and its one-device CPU mesh, for the CPU
    tests of FSDP2 and DTensor (tests/test_fsdp.py, tests/test_tp.py)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        yield init_device_mesh("cpu", (1,))
    finally:
        dist.destroy_process_group()


@pytest.fixture
def stand_in(monkeypatch):
    """cgraph.graph_layers with graphing stood in for (graphs need a GPU):
    each block's forward becomes a _helpers.StandIn.  Returns the calls of
    graphed_in_place, (block, keywords) each."""
    from _helpers import StandIn
    from cgraph import _layers
    calls = []

    def graphed_in_place(block, **kwargs):
        calls.append((block, kwargs))
        block.forward = StandIn(block)
        return block

    monkeypatch.setattr(_layers, "graphed_in_place", graphed_in_place)
    monkeypatch.setattr(_layers, "is_graphed",
                        lambda m: isinstance(m.__dict__.get("forward"), StandIn))
    monkeypatch.setattr(_layers, "graph_pool_handle", lambda: (0, 77))
    return calls

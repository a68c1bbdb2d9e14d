import pytest
import torch


@pytest.fixture(autouse=True, scope="module")
def _single_thread():
    """The tiny models here are latency-bound: one intra-op thread avoids spin-wait contention on small CPUs."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)

import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _threads():
    # Same thread count in every test process: CPU reductions stay bitwise reproducible.
    torch.set_num_threads(2)
    yield

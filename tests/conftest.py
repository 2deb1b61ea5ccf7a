import pytest
import torch


@pytest.fixture(autouse=True, scope="session")
def _threads():
    # Same thread count in every test process: CPU reductions stay bitwise reproducible.
    torch.set_num_threads(2)
    yield


@pytest.fixture(autouse=True)
def _no_leaked_sdpa_observers():
    """A test that leaves a detector or metrics attached (on a model that outlives it) must not
    leave torch's ``scaled_dot_product_attention`` wrapped for the next test: its observers are
    removed when it ends, and the function is restored."""
    yield
    from sdcscope.observe import attention

    for observer in list(attention._taps):
        attention._taps.discard(observer)
    if attention._original:
        torch.nn.functional.scaled_dot_product_attention = attention._original[0]
        attention._original.clear()


@pytest.fixture(scope="session")
def sharded_runs(tmp_path_factory):
    """The FSDP2 and tensor-parallel runs of ``helpers.sharded_checkpoint_runs``, trained once per
    session for the sharded-checkpoint tests (tests/sharded) and the tamper probes
    (tests/reliability); the tests copy what they change."""
    from helpers import sharded_checkpoint_runs

    return sharded_checkpoint_runs(tmp_path_factory.mktemp("sharded_checkpoints"))

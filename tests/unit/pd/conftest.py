"""The PD state-machine tests step several real engines in this one process."""

import pytest
import torch


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """On two shared cores torch's second OpenMP thread only spins: a v4-tiny forward took ~1 s
    instead of ~20 ms under load. The engines here are stepped one after the other anyway."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)

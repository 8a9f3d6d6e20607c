"""The PD state-machine tests step several real engines in this one process, one after the
other: one torch thread each (see the root conftest's one_torch_thread)."""

import pytest


@pytest.fixture(scope="module", autouse=True)
def _one_thread_per_module(one_torch_thread):
    yield

"""The fault matrix (bench/harness/fault_matrix.py; `dsv4 bench faults` runs it whole): each cell
states its expected outcome, then runs it on real processes and is judged by it.

The default run has the short form: PD, one fault of each kind (a frozen decode, a failed and a
corrupted KV transfer, a burst past the queue bound, clients leaving mid-stream) on one
cluster. The whole matrix (every mode; engines, the router and `dsv4 up` killed; a lost
notification, a full KV pool, an overloaded tokenizer) is slow-marked."""

from __future__ import annotations

import pytest

from bench.harness import fault_matrix as fm

SHORT = ("decode_sigstop", "transfer_fails", "transfer_corrupted", "queue_burst", "client_churn")


def _failed(cells: list[dict]) -> list[str]:
    return [f"{c['mode']} x {c['fault']}: {c}" for c in cells if c["applicable"] and not c["passed"]]


def test_short_matrix_in_pd_costs_no_client_an_error(tiny_model, tmp_path):
    cells = fm.run_matrix(tiny_model, tmp_path, ("pd",), SHORT)
    assert [c["fault"] for c in cells] == list(SHORT)
    assert not _failed(cells), _failed(cells)
    corrupted = next(c for c in cells if c["fault"] == "transfer_corrupted")
    assert corrupted["noticed"] >= 1, corrupted
    for c in cells:
        assert c["expect"] == fm.EXPECT[c["fault"]]  # said before it ran


@pytest.mark.slow  # ten minutes or more: every mode, engines, the router and `dsv4 up` killed and restarted
def test_whole_matrix(tiny_model, tmp_path):
    cells = fm.run_matrix(tiny_model, tmp_path)
    assert len(cells) == len(fm.MODES) * len(fm.FAULTS)
    assert not _failed(cells), _failed(cells)


@pytest.mark.slow  # the cells with no peer, and the ones that fixed a component, on their own
@pytest.mark.parametrize(
    "fault", ["router_sigkill", "up_sigkill", "tokenizer_overload", "kv_pool_full", "planned_roll"]
)
def test_cell_alone(tiny_model, tmp_path, fault):
    cells = fm.run_matrix(tiny_model, tmp_path, ("pd",), (fault,))
    assert not _failed(cells), _failed(cells)
    if fault in ("router_sigkill", "up_sigkill"):
        assert cells[0]["dropped"] >= 1, cells  # the kill landed mid-stream: something was tried

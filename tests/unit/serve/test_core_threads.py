"""The engine core leaves one CPU to the HTTP process (see engine_core.cpu_threads)."""

from dsv4_serve.engine_core import cpu_threads


def test_every_cpu_but_one_unless_the_user_chose():
    assert cpu_threads(2, {}) == 1
    assert cpu_threads(16, {}) == 15
    assert cpu_threads(1, {}) is None  # nothing to leave
    assert cpu_threads(8, {"OMP_NUM_THREADS": "4"}) is None  # the user's choice stands

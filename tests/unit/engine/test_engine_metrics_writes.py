"""EngineMetrics skips rewriting a gauge whose value did not change (the engine sets every gauge
each loop iteration): what /metrics renders must still follow every change."""

from dsv4_engine.metrics import EngineMetrics


def _line(text: str, head: str) -> str:
    return next(line for line in text.splitlines() if line.startswith(head))


def test_gauges_follow_every_change_when_unchanged_writes_are_skipped():
    m = EngineMetrics("mono", "m")
    for v in (5, 5, 3, 3, 0, 7):
        m.set("num_running_reqs", v)
        text = m.render().decode()
        assert _line(text, "dsv4:num_running_reqs{").endswith(f" {float(v)}")
    for v in (100, 100, 40, 0):
        m.set_state("prefix_cache_state_bytes", "kv", v)
        m.set_state("prefix_cache_state_bytes", "swa_kv", v + 1)
        text = m.render().decode()
        assert _line(text, 'dsv4:prefix_cache_state_bytes{model_name="m",role="mono",state="kv"}').endswith(
            f" {float(v)}"
        )
        assert _line(text, 'dsv4:prefix_cache_state_bytes{model_name="m",role="mono",state="swa_kv"}').endswith(
            f" {float(v + 1)}"
        )

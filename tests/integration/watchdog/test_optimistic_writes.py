"""The one optimistic-concurrency loop (KubeApi.patch_with_retry) and the watchdog's policy state
written over it: a write that raced another re-reads and rebuilds; the stored state is never
overwritten when someone else wrote it since this watchdog did."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest

from bench.harness.kmock_cluster import ClusterClient
from watchdog_harness import API, NS, PLURAL, WatchdogCluster, deployment

from dsv4_operator import spec as S
from dsv4_operator.kube import ApiError, KubeApi, PatchAborted, load_configuration
from dsv4_operator.remediation.daemon import DeploymentWatchdog, StateConflict
from dsv4_operator.telemetry import OperatorMetrics
from dsv4_operator.watchdog.policy import STATE_ANNOTATION, PolicyState, RemediationRecord


@pytest.fixture
async def api(kube_cluster: WatchdogCluster, kubeconfig: Path) -> KubeApi:
    client = KubeApi(await load_configuration(str(kubeconfig)))
    yield client
    await client.close()


async def test_a_raced_write_is_rebuilt_from_a_fresh_read(api: KubeApi, kube_client: ClusterClient) -> None:
    await kube_client.create(deployment("flash", remediation={}), PLURAL)
    seen: list[str] = []

    async def build(cr: dict) -> dict:
        seen.append(cr["metadata"]["resourceVersion"])
        if len(seen) == 1:  # someone else writes between our read and our write
            await kube_client.patch(API, PLURAL, NS, "flash", {"metadata": {"labels": {"other": "writer"}}})
        return {"metadata": {"annotations": {"mine": str(len(seen))}}}

    written = await api.patch_with_retry(S.API_VERSION, S.KIND, NS, "flash", build)
    assert len(seen) == 2 and seen[0] != seen[1]
    assert written["metadata"]["annotations"]["mine"] == "2" and written["metadata"]["labels"]["other"] == "writer"

    with pytest.raises(PatchAborted):
        await api.patch_with_retry(
            S.API_VERSION, S.KIND, NS, "flash", lambda cr: (_ for _ in ()).throw(PatchAborted("no"))
        )
    assert await api.patch_with_retry(S.API_VERSION, S.KIND, NS, "gone", lambda cr: {}) is None

    async def always_raced(cr: dict) -> dict:
        await kube_client.patch(
            API, PLURAL, NS, "flash", {"metadata": {"labels": {"n": cr["metadata"]["resourceVersion"]}}}
        )
        return {"metadata": {"annotations": {"never": "x"}}}

    with pytest.raises(ApiError) as e:
        await api.patch_with_retry(S.API_VERSION, S.KIND, NS, "flash", always_raced, attempts=3)
    assert e.value.status == 409


async def test_the_policy_state_is_not_overwritten_when_another_writer_changed_it(
    api: KubeApi, kube_client: ClusterClient
) -> None:
    cr = await kube_client.create(deployment("flash", remediation={}), PLURAL)
    watchdog = DeploymentWatchdog(lambda: api, OperatorMetrics(), cr, lambda *e: None, logging.getLogger("t"))
    rec = RemediationRecord(pod="flash-prefill-0", role="prefill", reason="stuck_inflight", started_at=1.0, attempt=1)
    mine = PolicyState(active={"flash-prefill-0": rec})
    await watchdog._persist_state(mine)
    stored = (await kube_client.get(API, PLURAL, NS, "flash"))["metadata"]["annotations"][STATE_ANNOTATION]
    assert stored == mine.to_json()

    theirs = PolicyState().to_json()  # a second operator (a deposed leader) wrote the state
    await kube_client.patch(API, PLURAL, NS, "flash", {"metadata": {"annotations": {STATE_ANNOTATION: theirs}}})
    with pytest.raises(StateConflict) as e:
        await watchdog._persist_state(PolicyState(reported=frozenset({"flash-prefill-0"})))
    assert e.value.stored == theirs
    after = (await kube_client.get(API, PLURAL, NS, "flash"))["metadata"]["annotations"][STATE_ANNOTATION]
    assert after == theirs

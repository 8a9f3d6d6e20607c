"""Run inside the prefill "pod"'s network namespace by test_pd_pods.py: what the router does for
one PD request, with prefill's transfer stalled; then an admin abort on prefill, which prefill
must pass on to decode at the URL decode advertised. Prints one JSON line."""

from __future__ import annotations

import json
import sys
import threading
import time

import httpx

prefill, decode, boot_host, boot_port, secret, admin = sys.argv[1:7]
pd = {"Authorization": f"Bearer {secret}"}
adm = {"Authorization": f"Bearer {admin}"}

deadline = time.monotonic() + 120
for url in (prefill, decode):
    while True:
        try:
            if httpx.get(url + "/ready", timeout=1).status_code == 200:
                break
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            print(json.dumps({"error": f"{url} not ready"}))
            sys.exit(1)
        time.sleep(0.3)

httpx.post(
    prefill + "/admin/faults", json={"fault": "stall_transfer", "count": 1}, headers=adm, timeout=10
).raise_for_status()
body = {
    "prompt": list(range(20, 60)),
    "max_tokens": 4,
    "temperature": 0,
    "bootstrap_host": boot_host,
    "bootstrap_port": int(boot_port),
    "bootstrap_room": 4343,
}
res: dict = {}
threading.Thread(
    target=lambda: res.update(p=httpx.post(prefill + "/v1/completions", json=body, headers=pd, timeout=120)),
    daemon=True,
).start()


def decode_leg() -> None:
    r = httpx.post(decode + "/v1/completions", json=body, headers=pd, timeout=120)
    res.update(d=r, d_at=time.monotonic())


leg = threading.Thread(target=decode_leg, daemon=True)
leg.start()
peer = None
while time.monotonic() < deadline:
    loads = httpx.get(prefill + "/v1/loads", timeout=5).json()
    inflight = loads.get("inflight_requests") or []
    if inflight and inflight[0].get("peer"):
        peer = inflight[0]["peer"]
        break
    time.sleep(0.1)
aborted_at = time.monotonic()
httpx.post(prefill + "/admin/abort", json={"all": True}, headers=adm, timeout=10).raise_for_status()
leg.join(30)
d = res.get("d")
print(
    json.dumps(
        {
            "peer": peer,
            "decode_status": d.status_code if d is not None else None,
            "decode_seconds": round(res["d_at"] - aborted_at, 2) if d is not None else None,
        }
    )
)

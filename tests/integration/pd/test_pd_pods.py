"""Prefill and decode as the operator's manifests run them in pods: each engine in its own
network namespace (its own loopback, one address on a shared link), started with the builtin
engine command line from dsv4_operator.manifests (listening on 0.0.0.0, same port in both
"pods", $(POD_IP) expanded from the environment as the kubelet does). A prefill-side abort must
reach decode at the address decode advertised, not at 0.0.0.0 (prefill's own loopback there).

Needs root (ip netns); skipped elsewhere with the reason. Issue 32, item 7."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from dsv4_operator import manifests as M
from dsv4_operator.spec import parse_spec

SECRET, ADMIN = "pd-secret-for-pods", "admin-token-for-pods"
PORT, BOOT = 8100, 9100  # the same in both pods, as the manifests make them
DRIVER = Path(__file__).with_name("pod_pair_driver.py")


def _netns_works() -> bool:
    if os.geteuid() != 0 or shutil.which("ip") is None:
        return False
    name = f"dsv4probe{uuid.uuid4().hex[:6]}"
    ok = subprocess.run(["ip", "netns", "add", name], capture_output=True).returncode == 0
    subprocess.run(["ip", "netns", "del", name], capture_output=True)
    return ok


pytestmark = [
    pytest.mark.slow,  # two engines and a driver: ~20 s
    pytest.mark.skipif(not _netns_works(), reason="needs root and `ip netns` (two network namespaces)"),
]


def _sh(*args: str) -> None:
    subprocess.run(args, check=True, capture_output=True)


@pytest.fixture
def two_pods():
    """Two network namespaces joined by a veth pair: {"prefill": (ns, ip), "decode": (ns, ip)}."""
    tag = uuid.uuid4().hex[:6]
    a, b, net = f"dsv4p{tag}", f"dsv4d{tag}", f"10.{200 + int(tag[:2], 16) % 50}.{int(tag[2:4], 16)}"
    pods = {"prefill": (a, f"{net}.2"), "decode": (b, f"{net}.3")}
    _sh("ip", "netns", "add", a)
    _sh("ip", "netns", "add", b)
    try:
        _sh("ip", "link", "add", f"va{tag}", "type", "veth", "peer", "name", f"vb{tag}")
        _sh("ip", "link", "set", f"va{tag}", "netns", a)
        _sh("ip", "link", "set", f"vb{tag}", "netns", b)
        for (ns, ip), dev in ((pods["prefill"], f"va{tag}"), (pods["decode"], f"vb{tag}")):
            _sh("ip", "-n", ns, "addr", "add", f"{ip}/24", "dev", dev)
            _sh("ip", "-n", ns, "link", "set", dev, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")
        yield pods
    finally:
        subprocess.run(["ip", "netns", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", b], capture_output=True)


def pod_command(model: Path, role: str) -> list[str]:
    """The builtin engine command line the operator puts in the StatefulSet, with the test's
    small-model arguments appended as a user's `engine.args` would be."""
    spec = parse_spec(
        {
            "model": {"name": "tiny", "path": str(model)},
            "engine": {
                "image": "i",
                "port": PORT,
                "args": [
                    "--kv-pages",
                    "64",
                    "--page-size",
                    "16",
                    "--enable-fault-injection",
                    "--pd-secret",
                    SECRET,
                    "--admin-token",
                    ADMIN,
                    "--device",
                    "cpu",
                ],
            },
            "transfer": {"bootstrapPort": BOOT},
            "prefill": {"gpusPerPod": 0},
            "decode": {"gpusPerPod": 0},
        }
    )
    return M.engine_command(spec, role)


def kubelet_expand(command: list[str], env: dict[str, str]) -> list[str]:
    out = []
    for arg in command:
        for key, value in env.items():
            arg = arg.replace(f"$({key})", value)
        out.append(arg)
    return out


def test_a_prefill_abort_reaches_decode_in_another_pod(two_pods, tiny_model, tmp_path) -> None:
    procs = []
    try:
        for role, (ns, ip) in two_pods.items():
            cmd = kubelet_expand(pod_command(tiny_model, role), {"POD_IP": ip})
            assert cmd[:2] == ["dsv4", "serve"]
            log = open(tmp_path / f"{role}.log", "wb")
            procs.append(
                subprocess.Popen(
                    ["ip", "netns", "exec", ns, sys.executable, "-m", "dsv4_cli", *cmd[1:]],
                    stdout=log,
                    stderr=subprocess.STDOUT,
                    env={**os.environ, "POD_IP": ip, "PYTHONUNBUFFERED": "1"},
                    start_new_session=True,
                )
            )
        (p_ns, p_ip), (_, d_ip) = two_pods["prefill"], two_pods["decode"]
        out = subprocess.run(
            [
                "ip",
                "netns",
                "exec",
                p_ns,
                sys.executable,
                str(DRIVER),
                f"http://{p_ip}:{PORT}",
                f"http://{d_ip}:{PORT}",
                p_ip,
                str(BOOT),
                SECRET,
                ADMIN,
            ],
            capture_output=True,
            text=True,
            timeout=240,
            env=os.environ,
        )
        logs = "\n".join((tmp_path / f"{r}.log").read_text(errors="replace")[-2000:] for r in two_pods)
        assert out.returncode == 0, out.stdout + out.stderr + logs
        result = json.loads(out.stdout.strip().splitlines()[-1])
        assert result["peer"] == f"http://{d_ip}:{PORT}", result
        # Decode hears of the abort at once (its own deadline is bootstrap + transfer: 600 s).
        assert result["decode_status"] is not None and result["decode_status"] >= 500, result
        assert result["decode_seconds"] < 15, result
    finally:
        for p in procs:
            p.terminate()
        for p in procs:
            try:
                p.wait(15)
            except subprocess.TimeoutExpired:
                p.kill()

"""The few facts about `nixl_cu12` that the KV transfer layer depends on, in one place.

NIXL is imported lazily so that modules importing the PD package stay importable (and
fast) where only the pure parts are used.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

log = logging.getLogger(__name__)

# Name that prep_xfer_dlist takes for the initiator's own (local) side of a transfer.
LOCAL_SIDE = "NIXL_INIT_AGENT"


def create_agent(name: str) -> Any:
    """A NIXL agent on the UCX backend WITHOUT a progress thread.

    The default progress thread spins a full core even when idle; without it the owner must
    poll (check_xfer_state / get_new_notifs) for transfers and connection setup to advance.
    """
    from nixl_cu12 import nixl_agent, nixl_agent_config

    agent = nixl_agent(name, nixl_agent_config(enable_prog_thread=False, backends=["UCX"]))
    if "UCX" not in agent.backends:
        raise RuntimeError("NIXL has no UCX backend plugin; KV transfer needs it")
    return agent


def mem_type_of(tensor: torch.Tensor) -> tuple[str, int]:
    """NIXL memory type and device id of a tensor: host memory is DRAM on device 0."""
    if tensor.is_cuda:
        return "VRAM", int(tensor.get_device())
    return "DRAM", 0


def describe_error(exc: BaseException) -> str:
    """One line naming a NIXL failure; the exception type is the useful part
    (nixlRemoteDisconnectError, nixlBackendError, ...), its text usually just the code."""
    text = str(exc).strip()
    name = type(exc).__name__
    return f"{name}: {text}" if text and text != name else name


def is_remote_disconnect(exc: BaseException) -> bool:
    """True for the error NIXL raises once a peer's connection is gone (peer died or
    restarted). After it every call towards that peer fails until the peer is re-added."""
    return type(exc).__name__ == "nixlRemoteDisconnectError"

"""docs/deploy-v4-flash.md quotes scripts/v4_memory.py's table as it is now (issue 43): the memory
per GPU from V4-Flash's shapes, the engine's tensor list and its state list. The shapes the script
carries are transformers' DeepseekV4Config defaults (checked in the slow test)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[3]
sys.path.insert(0, str(REPO / "scripts"))
import v4_memory  # noqa: E402

DOC = REPO / "docs" / "deploy-v4-flash.md"
MARK = "<!-- scripts/v4_memory.py -->\n"


def test_the_doc_quotes_the_current_table() -> None:
    text = DOC.read_text()
    quoted = text.split(MARK, 1)[1].split("<!-- /scripts/v4_memory.py -->", 1)[0]
    assert quoted == v4_memory.render(v4_memory.flash_config(), [2, 4, 8], v4_memory.GPUS, 6.0), (
        "run: python scripts/v4_memory.py and paste its output into docs/deploy-v4-flash.md"
    )


def test_the_doc_quotes_the_current_capacity_table() -> None:
    text = DOC.read_text()
    quoted = text.split("<!-- scripts/v4_memory.py --capacity 96 8 -->\n", 1)[1]
    quoted = quoted.split("<!-- /scripts/v4_memory.py --capacity -->", 1)[0]
    assert quoted == v4_memory.render_capacity(v4_memory.flash_config(), 96.0, 8, 6.0), (
        "run: python scripts/v4_memory.py --capacity 96 8 and paste its output into docs/deploy-v4-flash.md"
    )


def test_the_arithmetic_follows_the_shapes() -> None:
    s = v4_memory.sizes(v4_memory.flash_config())
    # 43 layers x 256 experts x 3 projections of 2048 x 4096, half a byte a value plus a scale per 32.
    assert s.routed == pytest.approx(43 * 256 * 3 * 2048 * 4096 * (0.5 + 1 / 32))
    # Paged state per token: 20 CSA layers hold a 512-wide entry and a 128-wide index key per 4
    # tokens, 23 HCA layers a 512-wide entry per 128 tokens, in bf16.
    assert s.kv_per_token == pytest.approx(20 * (512 + 128) * 2 / 4 + 23 * 512 * 2 / 128)
    assert v4_memory.weights_per_gpu(s, 8) < v4_memory.weights_per_gpu(s, 4) < v4_memory.weights_per_gpu(s, 2)


@pytest.mark.slow
def test_the_shapes_are_transformers_v4_flash_defaults() -> None:
    from transformers import DeepseekV4Config

    defaults = DeepseekV4Config().to_dict()
    assert {k: defaults[k] for k in v4_memory.FLASH} == v4_memory.FLASH

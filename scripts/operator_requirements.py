"""Print the pinned requirements the operator needs: pyproject's dependencies minus the engine's
heavy ones (torch, Triton, NIXL, ...), which `dsv4 operator` never imports.

images/operator.Dockerfile installs these and then the project with --no-deps, so the operator
image stays slim; tests/unit/chart/test_images.py proves the operator imports without them.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# Distribution -> the modules it provides (what the test blocks when importing the operator).
ENGINE_ONLY: dict[str, tuple[str, ...]] = {
    "torch": ("torch",),
    "triton": ("triton",),
    "numpy": ("numpy",),
    "nixl-cu12": ("nixl_cu12", "nixl"),
    "safetensors": ("safetensors",),
    "tokenizers": ("tokenizers",),
}


def distribution_name(requirement: str) -> str:
    return re.split(r"[\s<>=!~;\[]", requirement.strip(), maxsplit=1)[0].lower().replace("_", "-")


def operator_requirements(pyproject: Path) -> list[str]:
    deps = tomllib.loads(pyproject.read_text())["project"]["dependencies"]
    skip = {name.lower() for name in ENGINE_ONLY}
    return [d for d in deps if distribution_name(d) not in skip]


def main(argv: list[str]) -> int:
    pyproject = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parent.parent / "pyproject.toml"
    sys.stdout.write("".join(f"{r}\n" for r in operator_requirements(pyproject)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

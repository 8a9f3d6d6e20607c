"""Build the CPU backend's native kernels ahead of time, for named ISA levels, into a folder
an image ships (engines then load them through DSV4_NATIVE_DIR and need no compiler).

    python -m dsv4_kernels.build_native OUT_DIR [--isa x86-64-v3]

The folder must stay root's (or the engine user's) and writable by no one else: the engine
refuses libraries it cannot trust (dsv4_kernels.native.unsafe_chain)."""

from __future__ import annotations

import argparse
import platform
from pathlib import Path

from dsv4_kernels import native


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("out_dir", type=Path)
    p.add_argument(
        "--isa",
        action="append",
        choices=[lvl for lvl in native.ISA_LEVELS if lvl != "native"],
        help="an ISA level to build for (repeatable; default: every level of this architecture: "
        "x86-64-v4, -v3 and -v2 on x86, armv8-a on aarch64); an engine loads the set of the level "
        "its DSV4_NATIVE_ISA resolves to",
    )
    a = p.parse_args()
    for level in a.isa or native.machine_levels(platform.machine()):
        for so in native.build_prebuilt(a.out_dir, level):
            print(so)


if __name__ == "__main__":
    main()

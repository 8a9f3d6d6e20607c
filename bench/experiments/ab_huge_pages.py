"""2 MB pages under the weights and the KV pool (dsv4_kernels.huge_pages) on and off: whole decode
steps, in-process engines (bench/suites/decode_breakdown.py, 1 torch thread, CPU time of the stepping
thread), the two sides in alternating processes (a collapsed page cannot be split back inside one
process), best of each side's runs. Greedy tokens of the first prompts are compared.

    python -m bench.experiments.ab_huge_pages --model DIR [-c 8 -c 32] [--pairs 3] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import tempfile
from pathlib import Path
from bench import module_argv, module_env


def one_run(model: str, conc: list[int], huge: bool, steps: int, rounds: int) -> dict:
    out = Path(tempfile.mkdtemp()) / "run.json"
    cmd = module_argv("bench.suites.decode_breakdown", "--model", f"m={model}", "--out", out)
    cmd += [f"-c{c}" for c in conc] + ["--steps", str(steps), "--rounds", str(rounds)]
    env = module_env({**os.environ, "DSV4_NO_HUGE_PAGES": "0" if huge else "1", "OMP_NUM_THREADS": "1"})
    subprocess.run(cmd, env=env, check=True, capture_output=True)
    return {r["concurrency"]: r for r in json.loads(out.read_text())["models"]["m"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("-c", "--concurrency", type=int, action="append")
    p.add_argument("--pairs", type=int, default=3, help="off/on process pairs (the order alternates)")
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--out")
    a = p.parse_args()
    conc = a.concurrency or [8, 32]
    load0 = list(os.getloadavg())
    runs: dict = {"off": [], "on": []}
    for i in range(a.pairs):
        for side in ("off", "on") if i % 2 == 0 else ("on", "off"):
            runs[side].append(one_run(a.model, conc, side == "on", a.steps, a.rounds))
    result = {"model": a.model, "load_average_start": load0, "pairs": a.pairs, "by_concurrency": {}}
    for c in conc:
        cpu = {s: [r[c]["step_cpu_ms_best"] for r in runs[s]] for s in runs}
        heads = {s: [r[c]["greedy_head_round0"] for r in runs[s]] for s in runs}
        result["by_concurrency"][f"c{c}"] = {
            "step_cpu_ms_best": {s: min(v) for s, v in cpu.items()},
            "speedup": round(min(cpu["off"]) / min(cpu["on"]), 3),
            "step_cpu_ms_each_run": cpu,
            "greedy_tokens_identical": all(h == heads["off"][0] for hs in heads.values() for h in hs),
        }
        print(f"c{c}: off {min(cpu['off'])} on {min(cpu['on'])} ms ({result['by_concurrency'][f'c{c}']['speedup']}x)")
    result["load_average_end"] = list(os.getloadavg())
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()

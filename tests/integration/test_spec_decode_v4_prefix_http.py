"""A real `dsv4 serve` on v4-tiny with its MTP block, speculating with the prefix cache on (the
default): two growing conversations at once, three rounds each, answer the official client
exactly as an in-process engine with neither speculation nor cache; later rounds report cached
tokens inside the previous answer; /v1/loads shows the snapshots restored and the drafts; every
page and slot row comes back."""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest

from bench.harness.commands import serving
from dsv4_wire import EngineFlags
from test_pd import loads
from test_v4_pd import wait_idle

ROUNDS, MAX_TOKENS = 3, 14


@pytest.fixture(scope="module")
def v4_mtp(tmp_path_factory):
    from dsv4_engine.checkpoint import init_checkpoint

    return init_checkpoint(tmp_path_factory.mktemp("v4mtp") / "v4-tiny-mtp", preset="v4-tiny", seed=0, mtp=True)


def reference(model, prompts: list[list[int]]) -> list[list[int]]:
    """Greedy answers of an in-process engine without speculation and without a cache (stepped
    by hand: deterministic)."""
    import torch

    from dsv4_engine.engine import Engine
    from dsv4_engine.engine_args import EngineArgs
    from dsv4_engine.sampling_params import SamplingParams
    from dsv4_engine.sequence import Sequence

    n = torch.get_num_threads()
    torch.set_num_threads(1)
    out: dict[int, list[int]] = {}
    try:
        engine = Engine(EngineArgs(model=str(model), device="cpu", kv_pages=64, enable_prefix_cache=False))
        seqs = [
            Sequence(
                f"q{i}",
                list(p),
                SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True),
                sink=lambda o, i=i: out.setdefault(i, []).extend(o.token_ids),
            )
            for i, p in enumerate(prompts)
        ]
        for s in seqs:
            engine.submit(s)
        for _ in range(2000):
            if all(s.finished for s in seqs):
                break
            engine.step()
    finally:
        torch.set_num_threads(n)
    return [out[i] for i in range(len(prompts))]


@pytest.mark.slow
def test_v4_conversations_with_speculation_and_the_cache_over_http(v4_mtp, tmp_path):
    args = ["--model", v4_mtp, "--kv-pages", 64, "--served-model-name", "m"]
    args += [EngineFlags.SPECULATIVE_ALGORITHM, "mtp", EngineFlags.SPECULATIVE_NUM_STEPS, 3]
    rng = random.Random(8)
    convos = [[rng.randrange(2, 250) for _ in range(n)] for n in (21, 38)]
    with serving(args, tmp_path / "spec.log", env={"OMP_NUM_THREADS": "1"}) as url:
        client = openai.OpenAI(base_url=f"{url}/v1", api_key="none", max_retries=0, timeout=120)

        def ask(prompt):
            return client.completions.create(
                model="m",
                prompt=prompt,
                max_tokens=MAX_TOKENS,
                temperature=0,
                extra_body={"ignore_eos": True, "return_token_ids": True},
            )

        cached, floor = [], []
        for _ in range(ROUNDS):
            want = reference(v4_mtp, convos)
            with ThreadPoolExecutor(len(convos)) as pool:
                answers = list(pool.map(ask, convos))
            assert [a.choices[0].model_extra["token_ids"] for a in answers] == want
            cached.append([a.usage.prompt_tokens_details.cached_tokens for a in answers])
            # boundary 16 (v4-tiny's page): the next round resumes at the latest boundary this
            # one reached before its last step (at most k + 1 = 4 tokens), in its answer
            floor.append([(len(c) + MAX_TOKENS - 1 - 4) // 16 * 16 for c in convos])
            convos = [c + w + [rng.randrange(2, 250) for _ in range(5)] for c, w in zip(convos, want)]
        assert cached[0] == [0, 0], cached
        for r in (1, 2):
            for c in range(2):
                assert cached[r][c] % 16 == 0 and cached[r][c] >= floor[r - 1][c] > 0, (cached, floor)
        wait_idle(url)
        ld = loads(url)
        assert ld["prefix_cache"]["enabled"] and ld["prefix_cache"]["snapshots_restored"] >= 4, ld["prefix_cache"]
        assert ld["speculative"]["mean_acceptance_length"] >= 1

"""A request as the engine sees it: tokens, pages, progress and how it ended."""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch

from dsv4_engine.request_output import RequestOutput
from dsv4_engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from dsv4_engine.pd.request_info import PDRequestInfo


class SeqStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"


@dataclass(eq=False)
class Sequence:
    rid: str
    prompt_ids: list[int]
    params: SamplingParams
    sink: Callable[[RequestOutput], None] = lambda out: None
    output_ids: list[int] = field(default_factory=list)
    # Parallel to output_ids when params.logprobs is set (see RequestOutput.logprobs).
    output_logprobs: list[dict] = field(default_factory=list)
    pages: list[int] = field(default_factory=list)
    slot: Optional[int] = None  # row in the pool's slot states while running (models that have them)
    num_computed: int = 0  # tokens whose KV is in `pages`
    # Prefix cache bookkeeping (dsv4_engine.prefix_cache): the leading `num_cached_pages` of
    # `pages` are in the cache and `cache_node` is the last of them. `num_cached_tokens`: reused
    # at admission.
    cache_node: Any = None
    num_cached_pages: int = 0
    # Models with slot states: the node (and snapshot id) of the deepest snapshot this request
    # kept, superseded when it keeps a deeper one (prefix_cache.PrefixCache._supersede).
    snapshot_node: Any = None
    snapshot_id: Optional[int] = None
    cache_branch: int = 0  # deepest boundary its prompt shares with cached pages (found at admission)
    num_cached_tokens: int = 0
    # n > 1: the other choices of one request name its first choice (`share_prefix_of`, a rid),
    # found among the running requests at admission (`prefix_leader`); they reuse its prompt pages.
    share_prefix_of: Optional[str] = None
    prefix_leader: Optional["Sequence"] = None
    status: SeqStatus = SeqStatus.WAITING
    finish_reason: Optional[str] = None
    error: Optional[str] = None  # why it failed, when it did (told to the PD peer too)
    arrival: float = field(default_factory=time.monotonic)
    first_token_time: Optional[float] = None
    last_token_time: Optional[float] = None
    generator: Optional[torch.Generator] = None
    detok: Any = None  # IncrementalDetokenizer, set by the engine
    text: str = ""  # generated text so far, for stop strings
    emitted_text_len: int = 0
    num_preemptions: int = 0
    prefill_only: bool = False  # PD prefill: stop after the first token, KV goes to decode
    # PD decode: the prompt as its prefill tokenizes it on its own, when prompt_ids spliced
    # remembered chat answers (dsv4_serve.chat.answer_memo): decode then tells prefill its ids.
    plain_prompt_ids: Optional[list[int]] = None
    pd: Optional["PDRequestInfo"] = None  # PD bookkeeping (room, peer, deadlines), owned by dsv4_engine.pd
    # Structured output (dsv4_engine.structured): the compiled grammar, set at admission, and the
    # request's position in it, built on first use from output_ids and freed when the request
    # ends or is preempted (rebuilt from output_ids on resume).
    grammar: Any = None
    matcher: Any = None

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_ids) + len(self.output_ids)

    def token_at(self, i: int) -> int:
        n = len(self.prompt_ids)
        return self.prompt_ids[i] if i < n else self.output_ids[i - n]

    @property
    def finished(self) -> bool:
        return self.status is SeqStatus.FINISHED

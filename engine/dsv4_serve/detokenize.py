"""Token ids from the engine core -> the text a client sees, in the HTTP process.

The core (`Engine.detokenize = False`) sends token ids only and ends requests on EOS, stop
token ids and length. Text, stop strings and the hold-back of text that could still become a
stop string happen here, off the engine's GIL, with the rules the in-process engine has
(`Engine._stop_reason` / `_emit`): the token that completes a stop string is kept, its text cut
at the stop string; EOS and stop token ids add no text; a stop string wins over length at the
same token. A stop string ends the request here first; the caller then tells the core to finish
it (the core may have run a step further meanwhile: those tokens are never shown).
"""

from __future__ import annotations

from typing import Optional

from dsv4_engine.sampling_params import SamplingParams
from dsv4_engine.request_output import RequestOutput
from dsv4_engine.tokenizer import IncrementalDetokenizer, Tokenizer


class OutputProcessor:
    """One request's outputs, core -> client. `stopped` turns True when a stop string ended it."""

    def __init__(self, tokenizer: Optional[Tokenizer], params: SamplingParams):
        """tokenizer None: outputs pass through as they are (PD prefill: its text is never shown)."""
        self.detok = IncrementalDetokenizer(tokenizer) if tokenizer is not None else None
        self.params = params
        self.text = ""
        self.emitted = 0  # characters of text already sent
        self.completion = 0  # tokens shown to the client
        self.stopped = False
        self._hold = max((len(s) - 1 for s in params.stop), default=0)
        self._longest = max((len(s) for s in params.stop), default=0)

    def resume(self, output_ids: list[int]) -> None:
        """Continue a migrated request: the state this processor would have after showing
        `output_ids` (text decoded, the same hold-back still held), nothing of it sent again."""
        if self.detok is None or not output_ids:
            return
        for tok in output_ids:
            self.text += self.detok.add(tok)
        self.completion = len(output_ids)
        self.emitted = max(0, len(self.text) - self._hold)

    def process(self, out: RequestOutput) -> RequestOutput:
        if self.detok is None:
            return out
        kept: list[int] = []
        finished, reason = out.finished, out.finish_reason
        for i, tok in enumerate(out.token_ids):
            kept.append(tok)
            self.completion += 1
            if out.finished and out.finish_reason == "stop" and i == len(out.token_ids) - 1:
                break  # the core stopped on EOS or a stop token id: no text for it
            self.text += self.detok.add(tok)
            # stop strings count only once min_tokens are out (as vLLM)
            if self.params.stop and self.completion >= self.params.min_tokens and self._cut_at_stop():
                finished, reason, self.stopped = True, "stop", True
                break
        hold = 0 if finished else self._hold
        upto = max(self.emitted, len(self.text) - hold)
        delta = self.text[self.emitted : upto]
        self.emitted = upto
        logprobs = out.logprobs[: len(kept)] if out.logprobs is not None else None
        return RequestOutput(
            out.rid,
            kept,
            delta,
            finished,
            reason,
            out.error if reason == out.finish_reason else None,
            out.error_code,
            out.prompt_tokens,
            self.completion,
            logprobs,
            out.cached_tokens,
        )

    def _cut_at_stop(self) -> bool:
        start = max(0, self.emitted - self._longest)
        hits = [i for i in (self.text.find(s, start) for s in self.params.stop) if i >= 0]
        if hits:
            self.text = self.text[: min(hits)]
            return True
        return False

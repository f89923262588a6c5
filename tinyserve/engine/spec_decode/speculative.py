"""Speculative decoding: before each step, guess the next tokens of every decoding sequence cheaply, so that
one forward pass can verify several (engine/spec_decode/rejection_sampler.py keeps the longest accepted run plus one
token of the target's own, which makes the output the target model's alone).

The guess here is prompt lookup (n-gram; the other proposer, a draft model, is engine/spec_decode/draft_model.py): the longest suffix of the sequence, ngram_max down to ngram_min
tokens, that occurred earlier in its prompt or output proposes the tokens that followed its latest earlier
occurrence. It costs no model, only a search (bytes.rfind over the token ids as int32), and pays off when
the output copies its input: summaries, edits, code changes.

A sequence proposes only when speculation cannot change what it would get: no grammar (its mask covers one
position), no repetition / presence / frequency penalty and no pending min_tokens (each would make a
position's distribution depend on the proposed tokens before it), no prompt logprobs still to compute. The
proposal is cut to the tokens its max_tokens and context can still take. A step with more running
sequences than disable_by_batch_size proposes nothing: a batch that large already keeps the linears busy.
"""

from __future__ import annotations

from array import array

from tinyserve.config import SpeculativeConfig
from tinyserve.engine.loop.request import Request, RequestStatus
from tinyserve.engine.observability.stats import SpecDecodeStats

_INT32_BYTES = 4


def ngram_proposal(token_ids: list[int], ngram_min: int, ngram_max: int, k: int) -> list[int]:
    """Up to k tokens that followed the latest earlier occurrence of the longest matching suffix."""
    if k <= 0 or len(token_ids) <= ngram_min:
        return []
    haystack = array("i", token_ids).tobytes()
    for n in range(min(ngram_max, len(token_ids) - 1), ngram_min - 1, -1):
        suffix = haystack[-n * _INT32_BYTES:]
        end = len(haystack) - _INT32_BYTES  # an occurrence must end before the suffix's last token
        while (at := haystack.rfind(suffix, 0, end)) >= 0:
            if at % _INT32_BYTES == 0:  # aligned on a token, not inside one
                start = at // _INT32_BYTES + n
                return token_ids[start : start + k]
            end = at + len(suffix) - 1
    return []


def can_speculate(request: Request) -> bool:
    """A running sequence whose next step is a decode, and whose distributions do not depend on it."""
    p = request.sampling_params
    return (request.status is RequestStatus.RUNNING and request.num_computed_tokens == request.num_tokens - 1
            and request.matcher is None and not request.needs_prompt_logprobs
            and p.repetition_penalty == 1.0 and p.presence_penalty == 0.0 and p.frequency_penalty == 0.0
            and request.num_output_tokens >= p.min_tokens)


def tokens_left(request: Request, max_model_len: int) -> int:
    """Tokens the request may still get: by max_tokens and by its context."""
    limits = [max_model_len - request.num_tokens]
    if request.max_total_tokens is not None:
        limits.append(request.max_total_tokens - request.num_tokens)
    if request.sampling_params.max_tokens is not None:
        limits.append(request.sampling_params.max_tokens - request.num_output_tokens)
    return min(limits)


def proposal_sizes(config: SpeculativeConfig, running: list[Request], max_model_len: int) -> list[tuple[Request, int]]:
    """(request, the most tokens it may propose, >= 1) for the running requests that may propose this step;
    every running request's spec_token_ids is cleared. None propose in a step with more running sequences
    than disable_by_batch_size."""
    for request in running:
        request.spec_token_ids = []
    if config.disable_by_batch_size is not None and len(running) > config.disable_by_batch_size:
        return []
    # a step emits the accepted proposals plus one token: leave room for that one
    sizes = ((r, min(config.num_speculative_tokens, tokens_left(r, max_model_len) - 1))
             for r in running if can_speculate(r))
    return [(request, k) for request, k in sizes if k > 0]


class NgramProposer:
    """Sets each running request's spec_token_ids for the next step (empty where it proposes nothing)."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int):
        self.config = config
        self.max_model_len = max_model_len
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    def propose(self, running: list[Request]) -> None:
        cfg = self.config
        for request, k in proposal_sizes(cfg, running, self.max_model_len):
            request.spec_token_ids = ngram_proposal(request.all_token_ids, cfg.ngram_min, cfg.ngram_max, k)

    def release(self, request: Request) -> None:
        """Nothing to drop: prompt lookup keeps no state of a request's."""

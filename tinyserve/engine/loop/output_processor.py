"""Turns a request's step into a RequestOutput: its text delta from the request's incremental
detokenizer, logprobs (and the prompt's, once), and usage plus timings on the final output of each sample. Holds no state of its
own: the detokenizer lives on the Request and goes with it."""

from __future__ import annotations

from tinyserve.engine.loop.detokenizer import IncrementalDetokenizer
from tinyserve.engine.loop.request import Request
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.types import FinishReason, RequestMetrics, RequestOutput, TokenLogprob, Usage


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer

    def add(self, request: Request) -> None:
        params = request.sampling_params
        request.detokenizer = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop,
            params.include_stop_str_in_output,
        )

    @staticmethod
    def new_text(request: Request, position: int) -> tuple[str, bool]:
        """Text delta for the request's output token at `position` (the next it has not decoded), and
        whether it completed a stop string."""
        detok = request.detokenizer
        text = detok.step(request.output_token_ids[position : position + 1])
        return text, detok.stop_hit is not None

    @staticmethod
    def token_output(request: Request, text: str, num_new: int,
                     logprobs: list[TokenLogprob] | None) -> RequestOutput:
        """The output carrying the request's num_new new tokens; for a finished request also its held text
        (unless a stop string cut it) and its usage."""
        detok = request.detokenizer
        if request.is_finished and detok.stop_hit is None:
            text += detok.flush()
        return _output(request, text, request.output_token_ids[len(request.output_token_ids) - num_new:],
                       logprobs or None)

    @staticmethod
    def final_without_token(request: Request, error: str | None = None) -> RequestOutput:
        """Final output of a request ended from outside a token (abort, timeout, outgrown pool): its held text."""
        detok = request.detokenizer
        text = detok.flush() if detok is not None and detok.stop_hit is None else ""
        return _output(request, text, [], None, error)

    @staticmethod
    def final_without_text(request: Request, error: str | None = None) -> RequestOutput:
        """Final output that never touches the request's detokenizer (it may be what failed): held text is dropped."""
        return _output(request, "", [], None, error)


def _output(request: Request, text: str, ids: list[int], logprobs: list[TokenLogprob] | None,
            error: str | None = None) -> RequestOutput:
    usage = metrics = None
    reason: FinishReason | None = request.finish_reason
    if reason is not None:
        usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
        metrics = RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finished_time=request.finished_time,
            num_preemptions=request.num_preemptions,
        )
    return RequestOutput(
        request_id=request.request_id, index=request.index, new_text=text, new_token_ids=ids,
        finish_reason=reason, usage=usage, logprobs=logprobs, error=error, metrics=metrics,
        prompt_index=request.prompt_index, prompt_logprobs=_prompt_logprobs_to_send(request),
    )


def _prompt_logprobs_to_send(request: Request) -> list[TokenLogprob] | None:
    """The prompt's logprobs, once per sample: on its first output after they are all computed (sample 0
    computes them; the scheduler keeps its siblings from running ahead of them)."""
    owner = request.parent or request
    if request.has_sent_prompt_logprobs or owner.prompt_logprobs is None or owner.needs_prompt_logprobs:
        return None
    request.has_sent_prompt_logprobs = True
    return list(owner.prompt_logprobs)

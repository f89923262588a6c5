"""Turns the scheduler's per-step request updates into RequestOutputs: text deltas from the incremental
detokenizer, stop strings, logprobs, and usage plus timings on the final output of each sample."""

from __future__ import annotations

from tinyserve.engine.detokenizer import IncrementalDetokenizer
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.types import FinishReason, Request, RequestMetrics, RequestOutput, TokenLogprob, Usage


def user_request_id(request: Request) -> str:
    """Samples of one user request carry ids '<user id>#<index>'."""
    return request.request_id.rpartition("#")[0]


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}

    def add(self, request: Request) -> None:
        params = request.sampling_params
        self._detokenizers[request.request_id] = IncrementalDetokenizer(
            self.tokenizer, request.prompt_token_ids, params.skip_special_tokens, params.stop
        )

    def new_text(self, request: Request) -> tuple[str, bool]:
        """Text delta for the token a request just got, and whether it completed a stop string (the
        caller then finishes the request with STOP before asking for its output)."""
        detok = self._detokenizers[request.request_id]
        text = detok.step(request.output_token_ids[-1:])
        return text, detok.stop_hit is not None and not request.is_finished

    def token_output(self, request: Request, text: str, logprobs: TokenLogprob | None) -> RequestOutput:
        """The output carrying one new token (and the final usage if the request is now finished)."""
        detok = self._detokenizers[request.request_id]
        if request.is_finished and detok.stop_hit is None:
            text += detok.flush()
        return self._output(request, text, request.output_token_ids[-1:], request.finish_reason,
                            [logprobs] if logprobs else None)

    def finished_without_token(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """Final output of a request ended from outside (abort, timeout, error): no new token."""
        detok = self._detokenizers.get(request.request_id)
        text = detok.flush() if detok is not None and detok.stop_hit is None else ""
        return self._output(request, text, [], reason, None, error)

    def finished_without_text(self, request: Request, reason: FinishReason, error: str | None = None) -> RequestOutput:
        """Final output that never touches the request's detokenizer (it may be what failed): held text is dropped."""
        self._detokenizers.pop(request.request_id, None)
        return self._output(request, "", [], reason, None, error)

    def _output(self, request: Request, text: str, ids: list[int], reason: FinishReason | None,
                logprobs: list[TokenLogprob] | None, error: str | None = None) -> RequestOutput:
        usage = metrics = None
        if reason is not None:
            self._detokenizers.pop(request.request_id, None)
            usage = Usage(request.num_prompt_tokens, request.num_output_tokens, request.num_cached_tokens)
            metrics = RequestMetrics(
                arrival_time=request.arrival_time,
                first_scheduled_time=request.first_scheduled_time,
                first_token_time=request.first_token_time,
                finished_time=request.finished_time,
                num_preemptions=request.num_preemptions,
            )
        return RequestOutput(
            request_id=user_request_id(request), index=request.index, new_text=text, new_token_ids=ids,
            finish_reason=reason, usage=usage, logprobs=logprobs, error=error, metrics=metrics,
        )

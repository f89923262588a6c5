"""The synchronous engine: add_request / step / abort over one model, one KV pool, one scheduler.

A step: the scheduler picks (request, chunk) pairs; the runner runs them as one batch and samples; the
scheduler appends tokens and finishes what hit a stop condition; the output processor turns that into
text deltas. Nothing here knows about HTTP.

Failure isolation: an exception that one request's data can cause fails that request, never the engine.
In a per-request stage (applying its token, detokenizing, stop strings, building its output) it fails
that request alone; in the batch stage (the forward pass and the sampler) it fails every request of the
step. Either way each gets one final output with FinishReason.ERROR and a short message, its blocks and
sampler state are freed, and the traceback is logged with the request ids. step() raises only on a
broken invariant (AssertionError) or when MAX_CONSECUTIVE_FAILED_STEPS batch stages failed in a row:
then the fault is the engine's, not a request's.
"""

from __future__ import annotations

import logging
import time
from dataclasses import replace

from tinyserve.config import EngineConfig
from tinyserve.engine.block_manager import BlockManager
from tinyserve.engine.memory import (
    keep_freed_host_memory,
    map_large_buffers_apart,
    resolve_cache_config,
    resolve_max_model_len,
)
from tinyserve.engine.model_runner import ModelRunner, StepResult
from tinyserve.engine.output_processor import OutputProcessor
from tinyserve.engine.scheduler import Scheduler
from tinyserve.engine.stats import EngineStats
from tinyserve.loader.model_loader import LoadedModel, load_model
from tinyserve.models.registry import device_and_dtype
from tinyserve.types import FinishReason, Request, RequestOutput, SamplingParams, SchedulerOutput

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILED_STEPS = 3
# what a failed request's client reads: the traceback stays in the log
GENERATION_FAILED = "generation failed"


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None):
        if loaded is None:
            map_large_buffers_apart()  # so that loading leaves no holes in the heap (engine/memory.py)
            loaded = load_model(config.model, config.dtype, config.device, config.quantization)
        self.model_config = loaded.config
        self.tokenizer = loaded.tokenizer
        device, dtype = device_and_dtype(loaded.model)
        max_model_len = resolve_max_model_len(config.scheduler.max_model_len, loaded.config)
        scheduler_config = replace(config.scheduler, max_model_len=max_model_len)
        cache_config = resolve_cache_config(config.cache, loaded.config, dtype, device, max_model_len)
        self.config = replace(config, cache=cache_config, scheduler=scheduler_config)
        self.max_model_len = max_model_len
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            hash_seed=f"{loaded.source}:{dtype}:{config.quantization}",  # cached KV is per weights
        )
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        if device.type == "cpu":
            keep_freed_host_memory()
        self.runner = ModelRunner(loaded.model, cache_config.num_blocks, cache_config.block_size, config.seed)
        self.outputs = OutputProcessor(self.tokenizer)
        self._samples: dict[str, list[str]] = {}  # user request id -> its samples' internal ids
        self.num_steps = 0
        self.num_failed_requests = 0
        self._num_consecutive_failed_steps = 0

    # ---- requests in -----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Meaning checks the server turns into 400s; ValueError names the field and the numbers."""
        if not prompt_token_ids:
            raise ValueError("prompt must not be empty")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise ValueError(f"prompt token ids must be in [0, {vocab})")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise ValueError(
                f"prompt has {n} tokens, but the model's context is {self.max_model_len} tokens "
                "(at least one token must be left to generate)"
            )
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise ValueError(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
                f"the model's context of {self.max_model_len} tokens"
            )
        if any(not 0 <= t < vocab for t in params.logit_bias_ids):
            raise ValueError(f"logit_bias keys must be token ids in [0, {vocab})")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise ValueError(f"stop_token_ids must be token ids in [0, {vocab})")

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                    priority: int = 0, arrival_time: float | None = None, cache_salt: str | None = None) -> list[int]:
        """Queue a request (its n samples); returns the prompt token ids. Only requests with the same
        cache_salt share prefix-cache blocks (None: the shared cache)."""
        if request_id in self._samples:
            raise ValueError(f"request id {request_id!r} is already in flight")
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params)
        arrival = time.monotonic() if arrival_time is None else arrival_time
        ids = [f"{request_id}#{i}" for i in range(params.n)]
        for index, internal_id in enumerate(ids):
            request = Request(
                request_id=internal_id, prompt_token_ids=prompt_ids, sampling_params=params,
                arrival_time=arrival, priority=priority, index=index,
                parent_id=ids[0] if index else None,
                eos_token_ids=frozenset(self.model_config.eos_token_ids),
                max_total_tokens=self.max_model_len, cache_salt=cache_salt,
            )
            self.outputs.add(request)
            self.scheduler.add_request(request)
        self._samples[request_id] = ids
        logger.debug("request %s queued: %d prompt tokens, n=%d", request_id, len(prompt_ids), params.n)
        return prompt_ids

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT,
              error: str | None = None) -> list[RequestOutput]:
        """Cancel every unfinished sample of a request now (blocks freed); their final outputs."""
        finals = []
        for internal_id in self._samples.pop(request_id, []):
            request = self.scheduler.get_request(internal_id)
            if request is not None and self.scheduler.finish_request(internal_id, reason):
                self.runner.free(internal_id)
                try:
                    finals.append(self.outputs.finished_without_token(request, reason, error))
                except Exception:  # its detokenizer failed: the abort still ends it, without its held text
                    logger.exception("request %s: final output failed", internal_id)
                    finals.append(self.outputs.finished_without_text(request, reason, error))
        return finals

    def set_paused(self, request_id: str, paused: bool) -> None:
        """A paused request's samples are not scheduled until resumed (a running one is preempted, a
        waiting one set aside: it holds no seat or block and blocks nobody). Unknown id: no-op."""
        for internal_id in self._samples.get(request_id, []):
            self.scheduler.set_paused(internal_id, paused)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    def has_schedulable_requests(self) -> bool:
        """Unfinished requests that are not all paused: a step now would do something."""
        return self.scheduler.has_schedulable_requests()

    # ---- one step ---------------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """schedule -> execute (the batch stage) -> update -> detokenize and build outputs (per request)."""
        scheduled = self.scheduler.schedule()
        for request_id in scheduled.finished_ids:
            self.runner.free(request_id)
        try:
            result = self._execute(scheduled)
        except AssertionError:
            raise
        except Exception as exc:
            return self._fail_batch(scheduled, exc)
        self._num_consecutive_failed_steps = 0
        return self._collect(self.scheduler.update_from_output(scheduled, result.sampled), result)

    def _execute(self, scheduled: SchedulerOutput) -> StepResult:
        """The batch stage: one forward pass and one sample over every scheduled request."""
        if scheduled.is_empty:
            return StepResult({}, {})
        tables = [self.block_manager.block_table(r.request_id) for r, _ in scheduled.scheduled]
        result = self.runner.execute(scheduled.scheduled, tables)
        self.num_steps += 1
        return result

    def _collect(self, changed: list[Request], result: StepResult) -> list[RequestOutput]:
        outputs = []
        for request in changed:
            try:
                outputs.append(self._output_of(request, result))
            except AssertionError:
                raise
            except Exception:
                logger.exception("request %s failed while its output was built", request.request_id)
                outputs.append(self._fail(request))
            if request.is_finished:
                self._forget_sample(request)
        return outputs

    def _output_of(self, request: Request, result: StepResult) -> RequestOutput:
        """Detokenize the request's new token, apply stop strings, build its output."""
        is_sampled = request.request_id in result.sampled
        if request.finish_reason is FinishReason.ERROR:  # failed in update_from_output, which logged it
            return self._fail(request)
        if request.is_finished and is_sampled:
            # finished by update_from_output (EOS, length); every other finish (abort, stop string,
            # outgrown pool) comes back in the next step's finished_ids, where step() frees it
            self.runner.free(request.request_id)
        if not is_sampled:
            # finished in schedule() without a new token (it outgrew the whole KV pool)
            return self.outputs.finished_without_token(request, request.finish_reason)
        text, stop_hit = self.outputs.new_text(request)
        if stop_hit:
            self.scheduler.finish_request(request.request_id, FinishReason.STOP)
        return self.outputs.token_output(request, text, result.logprobs.get(request.request_id))

    def _fail_batch(self, scheduled: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        self._num_consecutive_failed_steps += 1
        failed = [r for r, _ in scheduled.scheduled if not r.is_finished]
        logger.error("step failed in the forward pass or sampler (%d in a row); failing requests %s",
                     self._num_consecutive_failed_steps, [r.request_id for r in failed], exc_info=exc)
        outputs = [self._fail(request) for request in failed]
        for request in failed:
            self._forget_sample(request)
        if self._num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(f"{MAX_CONSECUTIVE_FAILED_STEPS} steps in a row failed in the batch stage") from exc
        # every scheduled request is finished now, so this applies nothing and only hands back the
        # requests that schedule() finished on its own (outgrown), whose final outputs are still due
        return outputs + self._collect(self.scheduler.update_from_output(scheduled, {}), StepResult({}, {}))

    def _fail(self, request: Request) -> RequestOutput:
        """Finish a request with ERROR (if still in flight) and free all it holds; its final output."""
        self.scheduler.finish_request(request.request_id, FinishReason.ERROR)
        self.runner.free(request.request_id)
        self.num_failed_requests += 1
        return self.outputs.finished_without_text(request, FinishReason.ERROR, GENERATION_FAILED)

    def _forget_sample(self, request: Request) -> None:
        user_id = request.request_id.rpartition("#")[0]
        ids = self._samples.get(user_id)
        if ids is not None and all(self.scheduler.get_request(i) is None for i in ids):
            del self._samples[user_id]

    # ---- observability ----------------------------------------------------------------------------

    def stats(self) -> EngineStats:
        prefix = self.block_manager.prefix_stats
        return EngineStats(
            num_running=self.scheduler.num_running,
            num_waiting=self.scheduler.num_waiting,
            kv_cache_usage=self.block_manager.usage,
            num_free_blocks=self.block_manager.num_free_blocks,
            num_blocks=self.block_manager.num_blocks,
            num_preemptions=self.scheduler.num_preemptions,
            prefix_cache_queries=prefix.num_query_tokens,
            prefix_cache_hits=prefix.num_hit_tokens,
            num_steps=self.num_steps,
            num_failed_requests=self.num_failed_requests,
            num_paused=self.scheduler.num_paused,
        )

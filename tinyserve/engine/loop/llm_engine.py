"""The synchronous engine: add_request / step / abort over one model, one KV pool, one scheduler.

A step, in stages: schedule (the scheduler picks (request, chunk) pairs) -> execute (the runner runs them
as one batch and samples) -> update (the scheduler appends the tokens and reports EOS and length limits)
-> detokenize (text deltas; stop strings) -> release (every request that ended) -> outputs. Nothing
here knows about HTTP.

One lifecycle: the engine owns every unfinished request, through the RequestGroup of its user request
id, and every way a request ends (EOS, a stop id or string, length, the pool outgrown, abort, timeout,
an error) goes through `_end_request`, which takes it out of the scheduler and drops all it held: blocks,
seeded generator, detokenizer, and its group once the group's last sample has ended.

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
from tinyserve.engine.execution import rank_setup
from tinyserve.engine.scheduling.block_manager import BlockManager
from tinyserve.engine.execution.cuda_graphs import decode_graphs_apply
from tinyserve.engine.loop.generation_defaults import resolve_sampling_defaults
from tinyserve.layers.rotary import cover_positions
from tinyserve.engine.memory.malloc_tuning import keep_freed_host_memory
from tinyserve.engine.spec_decode.draft_model import DraftModelProposer, check_same_tokenizer, load_draft_model_in_pieces
from tinyserve.engine.memory.sizing import (held_weight_bytes, kv_bytes_per_token, kv_pool_dtype, resolve_cache_config,
                                    resolve_max_model_len)
from tinyserve.engine.memory.fit_check import check_checkpoint_fits, load_allowance, size_kv_pool
from tinyserve.engine.execution.model_runner import ModelRunner, StepResult
from tinyserve.engine.loop.output_processor import OutputProcessor
from tinyserve.engine.observability.recent_activity import RecentActivity, StepRecord
from tinyserve.engine.loop.request import Request, RequestGroup, SchedulerOutput
from tinyserve.engine.scheduling.scheduler import Scheduler
from tinyserve.engine.spec_decode.speculative import NgramProposer
from tinyserve.engine.observability.stats import EngineStats
from tinyserve.engine.sampling.grammar_budget import clip
from tinyserve.engine.sampling.structured_output import StructuredOutputs
from tinyserve.layers.kv_cache import KVLayout, layer_caches
from tinyserve.loader.model_loader import LoadedModel, load_model_in_pieces, resolve_device
from tinyserve.models.registry import device_and_dtype
from tinyserve.parallel.group import RankFailure
from tinyserve.parallel.launch import Ranks
from tinyserve.types import FinishReason, InvalidRequest, Job, RequestOutput, SamplingParams, TokenLogprob, run_to_end

logger = logging.getLogger(__name__)

MAX_CONSECUTIVE_FAILED_STEPS = 3
# what a failed request's client reads: the traceback stays in the log
GENERATION_FAILED = "generation failed"
CANCELLED = (FinishReason.ABORT, FinishReason.TIMEOUT)  # ended from outside: no error of their own


class LLMEngine:
    def __init__(self, config: EngineConfig, loaded: LoadedModel | None = None, draft: LoadedModel | None = None):
        """Load `config.model` (unless `loaded` is given) and, for speculative method "draft", the draft model
        (unless `draft` is given), and set up, in one piece; a server builds its engines with
        `build_in_pieces`, the same work, between the steps of the models it serves."""
        run_to_end(self._set_up(config, loaded, draft))

    @classmethod
    def build_in_pieces(cls, config: EngineConfig) -> Job[LLMEngine]:
        """LLMEngine(config) as a job (tinyserve/types.py), pieces of at most one tensor's work each."""
        engine = cls.__new__(cls)  # set up by _set_up, as __init__ does
        yield from engine._set_up(config, None, None)
        return engine

    def _set_up(self, config: EngineConfig, loaded: LoadedModel | None, draft: LoadedModel | None) -> Job[None]:
        ranks = None  # tensor / pipeline parallel: this rank's group (engine/execution/rank_setup.py)
        if loaded is None and config.parallel.world_size > 1:
            ranks = rank_setup.join(config)
        try:
            yield from self._set_up_with(config, loaded, draft, ranks)
        except BaseException:
            if ranks is not None:
                ranks.close(wait_s=5.0)
            raise

    def _set_up_with(self, config: EngineConfig, loaded: LoadedModel | None, draft: LoadedModel | None,
                     ranks: Ranks | None) -> Job[None]:
        allowance = None  # what this load may take of the host's memory (engine/memory/fit_check.py)
        if loaded is None:
            if ranks is not None:
                loaded = yield from rank_setup.load_shard(config, ranks)
            else:
                allowance = load_allowance(config.cache, resolve_device(config.device))
                check_checkpoint_fits(config.model, allowance)
                loaded = yield from load_model_in_pieces(config.model, config.dtype, config.device, config.quantization,
                                                          read_timeout_s=config.load_read_timeout)
        elif ranks is None:  # loaded before this engine: its weights are already out of what is available
            allowance = load_allowance(config.cache, device_and_dtype(loaded.model)[0],
                                       held_weight_bytes(loaded.model))
        if config.speculative.method == "draft":
            if draft is None:
                draft = yield from load_draft_model_in_pieces(config)
            check_same_tokenizer(loaded, draft)
        else:
            assert draft is None, "a draft model without speculative method 'draft'"
        self.model_config = loaded.config
        self.quantization = loaded.quantization  # as resolved at load: "int4", "int8", or None (float)
        self.tokenizer = (loaded.tokenizer if config.chat_template is None
                          else loaded.tokenizer.with_chat_template(config.chat_template))
        # for the fields a request leaves out; the server and tinyserve.LLM apply them
        self.sampling_defaults = resolve_sampling_defaults(config, loaded)
        device, dtype = device_and_dtype(loaded.model)
        max_model_len = resolve_max_model_len(config.scheduler.max_model_len, loaded.config)
        draft_bytes = kv_bytes_per_token(draft.config, device_and_dtype(draft.model)[1]) if draft else 0
        layout = KVLayout.for_windows(loaded.config.layer_sliding_windows())
        cache = config.cache
        kv_dtype = kv_pool_dtype(cache, dtype)
        if ranks is not None:  # the blocks every rank's budget holds
            layout, num_blocks = rank_setup.agree_num_blocks(config, ranks, loaded, kv_dtype)
            cache = replace(cache, num_blocks=num_blocks)
        weights = held_weight_bytes(loaded.model) + (held_weight_bytes(draft.model) if draft else 0)
        cache, max_model_len = size_kv_pool(cache, config.scheduler, loaded.config, layout, kv_dtype, device,
                                            allowance, weights, max_model_len, draft_bytes)
        scheduler_config = replace(config.scheduler, max_model_len=max_model_len)
        cache_config = resolve_cache_config(cache, loaded.config, kv_dtype, device, max_model_len,
                                            scheduler_config.max_num_batched_tokens, layout, draft_bytes)
        self.config = replace(config, cache=cache_config, scheduler=scheduler_config)
        self.max_model_len = max_model_len
        for model in [loaded.model, *([draft.model] if draft else [])]:
            cover_positions(model, max_model_len, device)  # the rotary tables, for the positions served
        self.block_manager = BlockManager(
            cache_config.num_blocks, cache_config.block_size, cache_config.enable_prefix_caching,
            hash_seed=f"{loaded.source}:{dtype}:{loaded.quantization}:{kv_dtype}",  # cached KV is per weights
            group_windows=layout.group_windows,
        )
        self.scheduler = Scheduler(scheduler_config, self.block_manager)
        if device.type == "cpu":
            keep_freed_host_memory()
        self.structured_outputs = StructuredOutputs(self.tokenizer, loaded.config.vocab_size,
                                                    loaded.config.eos_token_ids)
        kv_slots = {}
        # CUDA graphs' padding rows write to a scratch block past the BlockManager's (engine/execution/cuda_graphs.py)
        graphs = decode_graphs_apply(device, config.enforce_eager, ranks is not None)
        pool_blocks = cache_config.num_blocks + (1 if graphs else 0)
        for slot, pool in rank_setup.rank_kv_slots(loaded, layout, pool_blocks, cache_config.block_size,
                                                   kv_dtype, device):
            kv_slots[slot] = pool
            yield
        self.runner = ModelRunner(loaded.model, cache_config.num_blocks, cache_config.block_size, config.seed,
                                  fill_bitmask=self.structured_outputs.fill_bitmask,
                                  kv_cache=layer_caches(layout, kv_slots), layout=layout, ranks=ranks)
        if graphs:
            self.runner.stage.capture_decode_graphs(scheduler_config.max_num_seqs, max_model_len,
                                                    capture=device.type == "cuda")
        self.outputs = OutputProcessor(self.tokenizer)
        self.proposer: NgramProposer | DraftModelProposer | None = None
        if config.speculative.method == "ngram":
            self.proposer = NgramProposer(config.speculative, max_model_len)
        elif config.speculative.method == "draft":
            self.proposer = DraftModelProposer(config.speculative, max_model_len, draft.model,
                                               loaded.config.vocab_size, cache_config.num_blocks,
                                               cache_config.block_size)
        self._groups: dict[str, RequestGroup] = {}  # user request id -> its unfinished samples' group
        self.num_steps = 0
        self.num_prefill_tokens = 0
        self.num_failed_requests = 0
        self.activity = RecentActivity()  # recent steps and finishes, for the server's live view
        self._num_consecutive_failed_steps = 0

    # requests in

    def default_sampling_params(self, **fields) -> SamplingParams:
        """SamplingParams with this engine's sampling defaults, and `fields` (any SamplingParams field) over them."""
        return SamplingParams(**{**self.sampling_defaults.as_fields(), **fields})

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Meaning checks the server turns into 400s: InvalidRequest names the field and the numbers.
        Each entry runs them once: add_request here, the server's intake before AsyncEngine.submit."""
        self.config.limits.check_sampling(params)
        if not prompt_token_ids:
            raise InvalidRequest("prompt must not be empty", param="prompt")
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise InvalidRequest(f"prompt token ids must be in [0, {vocab})", param="prompt")
        n = len(prompt_token_ids)
        if n >= self.max_model_len:
            raise InvalidRequest(
                f"prompt has {n} tokens, but the model's context is {self.max_model_len} tokens "
                "(at least one token must be left to generate)", param="prompt", code="context_length_exceeded")
        if params.max_tokens is not None and n + params.max_tokens > self.max_model_len:
            raise InvalidRequest(
                f"prompt ({n} tokens) + max_tokens ({params.max_tokens}) = {n + params.max_tokens} exceeds "
                f"the model's context of {self.max_model_len} tokens", param="max_tokens",
                code="context_length_exceeded")
        if any(not 0 <= t < vocab for t in params.logit_bias_ids):
            raise InvalidRequest(f"logit_bias keys must be token ids in [0, {vocab})", param="logit_bias")
        if any(not 0 <= t < vocab for t in params.stop_token_ids):
            raise InvalidRequest(f"stop_token_ids must be token ids in [0, {vocab})", param="stop_token_ids")
        if params.structured_output is not None:  # compiled once and cached: the server compiled it already
            self.structured_outputs.compile(params.structured_output)

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, priority: int = 0,
                    arrival_time: float | None = None, cache_salt: str | None = None,
                    prompt_index: int = 0) -> list[int]:
        """Queue one prompt of a request (its n samples); returns the prompt token ids. A request with
        several prompts adds each under its own prompt_index. Only requests with the same cache_salt
        share prefix-cache blocks (None: the shared cache)."""
        prompt_ids = self.tokenizer.encode(prompt) if isinstance(prompt, str) else list(prompt)
        self.validate(prompt_ids, params)
        self.add_validated(request_id, prompt_ids, params, priority, arrival_time, cache_salt, prompt_index)
        return prompt_ids

    def add_validated(self, request_id: str, prompt_ids: list[int], params: SamplingParams, priority: int = 0,
                      arrival_time: float | None = None, cache_salt: str | None = None,
                      prompt_index: int = 0) -> None:
        """add_request for a prompt its caller has validated (AsyncEngine: the server's intake did)."""
        group = self._groups.get(request_id)
        if group is not None and any(r.prompt_index == prompt_index for r in group.samples):
            raise ValueError(f"request id {request_id!r} is already in flight")
        arrival = time.monotonic() if arrival_time is None else arrival_time
        samples: list[Request] = []
        for index in range(params.n):
            request = Request(
                request_id=request_id, prompt_token_ids=prompt_ids, sampling_params=params,
                arrival_time=arrival, priority=priority, index=index, prompt_index=prompt_index,
                parent=samples[0] if samples else None,
                # sample 0 scores the prompt; its siblings share its list (OutputProcessor)
                prompt_logprobs=[] if params.prompt_logprobs is not None and index == 0 else None,
                eos_token_ids=frozenset(self.model_config.eos_token_ids),
                max_total_tokens=self.max_model_len, cache_salt=cache_salt,
            )
            if params.structured_output is not None:
                request.matcher = self.structured_outputs.matcher(params.structured_output)
            self.scheduler.add_request(request)  # the first one raises if the prompt cannot fit the pool
            self.outputs.add(request)
            samples.append(request)
        self._groups.setdefault(request_id, RequestGroup(request_id)).samples.extend(samples)
        logger.debug("request %s queued: %d prompt tokens, n=%d", request_id, len(prompt_ids), params.n)

    def abort(self, request_id: str, reason: FinishReason = FinishReason.ABORT) -> list[RequestOutput]:
        """Cancel every unfinished sample of a request now (blocks freed); their final outputs, finished
        with `reason` (ABORT, or TIMEOUT for a deadline)."""
        group = self._groups.get(request_id)
        finals = []
        for request in group.unfinished if group is not None else []:
            self._end_request(request, reason)
            finals.append(self._output_of(request, None))
        return finals

    def set_paused(self, request_id: str, paused: bool) -> None:
        """A paused request's samples are not scheduled until resumed (a running one is preempted, a
        waiting one set aside: it holds no seat or block and blocks nobody). Unknown id: no-op."""
        group = self._groups.get(request_id)
        for request in group.unfinished if group is not None else []:
            self.scheduler.set_paused(request, paused)

    def has_unfinished_requests(self) -> bool:
        return self.scheduler.has_unfinished_requests()

    # tensor / pipeline parallel

    @property
    def has_ranks(self) -> bool:
        """Other ranks compute with this one (they wait for its steps, and it should check on them while idle)."""
        return self.runner.ranks is not None

    def keep_alive(self) -> None:
        """While idle: RankFailure unless every other rank is still there."""
        self.runner.keep_alive()

    def close(self) -> None:
        """Release what outlives the object: the other ranks (sent home) and the group."""
        self.runner.close()

    def has_schedulable_requests(self) -> bool:
        """Unfinished requests that are not all paused: a step now would do something."""
        return self.scheduler.has_schedulable_requests()

    # one step

    def step(self) -> list[RequestOutput]:
        """schedule -> execute -> update -> detokenize -> release -> outputs, in step order."""
        start = time.perf_counter()
        if self.proposer is not None:
            self.proposer.propose(self.scheduler.running)
        plan = self.scheduler.schedule()
        # read before update moves num_computed_tokens: a request with more than its newest token left to
        # compute is in its prompt (or recomputing after a preemption); the rest are decodes
        num_prefill = sum(n for request, n in plan.scheduled if request.num_tokens - request.num_computed_tokens > 1)
        self.num_prefill_tokens += num_prefill
        try:
            result = self._execute(plan)
        except (AssertionError, RankFailure):  # a broken invariant, or a rank lost: the engine's end
            raise
        except Exception as exc:
            return self._fail_batch(plan, exc)
        self._num_consecutive_failed_steps = 0
        for num_proposed, num_accepted in result.proposals.values():
            self.proposer.stats.count(num_proposed, num_accepted)
        # (request, why it ended or None, its text delta or None when it got no token to show, new tokens)
        ends: list[tuple[Request, FinishReason | None, str | None, int]] = [
            (request, FinishReason.LENGTH, None, 0) for request in plan.outgrown]
        num_generated = 0
        for request, reason, num_new in self.scheduler.update(plan, result.sampled):
            num_generated += num_new
            if request.matcher is not None and reason is not FinishReason.ERROR:
                assert num_new <= 1, "a constrained request never proposes"
                reason = self._advance_matcher(request, reason)
            ends.append(self._detokenize(request, reason, num_new))
        outputs = []
        for request, reason, text, num_new in ends:
            if reason is not None:
                self._end_request(request, reason)
            logprobs = result.logprobs.get(request)
            outputs.append(self._output_of(request, text, num_new, logprobs[:num_new] if logprobs else None))
        if plan.scheduled:
            end = time.perf_counter()
            self.activity.record_step(StepRecord(time.monotonic(), end - start, len(plan.scheduled), num_prefill,
                                                 plan.num_batched_tokens - num_prefill, num_generated))
        return outputs

    def _execute(self, plan: SchedulerOutput) -> StepResult:
        """The batch stage: one forward pass and one sample over every scheduled request."""
        if plan.is_empty:
            return StepResult({}, {})
        result = self.runner.execute(plan.scheduled)
        self.num_steps += 1
        for request, scored in result.prompt_logprobs.items():
            request.prompt_logprobs.extend(scored)
            assert len(request.prompt_logprobs) <= request.num_prompt_tokens - 1, f"{request} scored twice"
        return result

    @staticmethod
    def _advance_matcher(request: Request, reason: FinishReason | None) -> FinishReason | None:
        """Feed the new token to the request's grammar. Its language complete (nothing but EOS may follow),
        the request ends with STOP at once; a token the grammar refuses (only a bug lets one through the
        mask) fails it."""
        if not request.matcher.consume_token(request.output_token_ids[-1]):
            logger.error("%s: the grammar refused token %d: %s", request, request.output_token_ids[-1],
                         clip(request.matcher.get_error()))
            return FinishReason.ERROR
        if reason is None and request.matcher.is_stopped():
            return FinishReason.STOP
        return reason

    def _detokenize(self, request: Request, reason: FinishReason | None,
                    num_new: int) -> tuple[Request, FinishReason | None, str | None, int]:
        """The text of the request's num_new new tokens, one token at a time: a token that completes a
        stop string ends it with STOP and is its last (the tokens after it are dropped); a failure ends it
        with ERROR."""
        if reason is FinishReason.ERROR:  # failed in the scheduler's update, which logged it
            return request, reason, None, 0
        text = ""
        try:
            for position in range(request.num_output_tokens - num_new, request.num_output_tokens):
                delta, stop_hit = self.outputs.new_text(request, position)
                text += delta
                if stop_hit:
                    num_dropped = request.num_output_tokens - position - 1
                    del request.output_token_ids[position + 1 :]
                    request.num_computed_tokens = min(request.num_computed_tokens, request.num_tokens - 1)
                    # a token that both ends the request (EOS, length) and completes a stop string keeps
                    # the first reason; dropping tokens after it can only drop an end condition they met
                    return request, FinishReason.STOP if reason is None or num_dropped else reason, text, \
                        num_new - num_dropped
        except Exception:
            logger.exception("%s failed while its text was decoded", request)
            return request, FinishReason.ERROR, None, 0
        return request, reason, text, num_new

    def _end_request(self, request: Request, reason: FinishReason) -> None:
        """The one exit of a request: out of the scheduler (its blocks freed), its generator dropped, its
        group forgotten after its last sample. The detokenizer goes once the final output is built."""
        self.scheduler.remove(request)
        if self.proposer is not None:
            self.proposer.release(request)
        request.finish_reason = reason
        request.finished_time = time.monotonic()
        self.activity.record_finish(request.arrival_time, request.first_token_time, request.finished_time,
                                    request.num_output_tokens)
        request.generator = None
        request.matcher = None
        if reason is FinishReason.ERROR:
            self.num_failed_requests += 1
        group = self._groups.get(request.request_id)
        if group is not None and not group.unfinished:
            del self._groups[request.request_id]
        logger.debug("finished %s (%s, %d output tokens, %d blocks free)", request, reason.value,
                     request.num_output_tokens, self.block_manager.num_free_blocks)

    def _output_of(self, request: Request, text: str | None, num_new: int = 0,
                   logprobs: list[TokenLogprob] | None = None) -> RequestOutput:
        """The request's output for this step: its token and text delta (`text`), or, when it got no
        token to show (`text` None), the final output of a request ended from outside. A failure here
        fails the request alone."""
        try:
            if request.finish_reason is FinishReason.ERROR:
                return self.outputs.final_without_text(request, GENERATION_FAILED)
            if text is None:
                return self.outputs.final_without_token(request)
            return self.outputs.token_output(request, text, num_new, logprobs)
        except AssertionError:
            raise
        except Exception:
            logger.exception("%s failed while its output was built", request)
            if not request.is_finished:
                self._end_request(request, FinishReason.ERROR)
            elif request.finish_reason not in CANCELLED:  # an abort still ends it, without its text
                request.finish_reason = FinishReason.ERROR
                self.num_failed_requests += 1
            error = None if request.finish_reason in CANCELLED else GENERATION_FAILED
            return self.outputs.final_without_text(request, error)
        finally:
            if request.is_finished:
                request.detokenizer = None

    def _fail_batch(self, plan: SchedulerOutput, exc: Exception) -> list[RequestOutput]:
        """The forward pass or the sampler failed: every scheduled request fails with ERROR (the ones
        that outgrew the pool still end with LENGTH)."""
        self._num_consecutive_failed_steps += 1
        failed = [r for r, _ in plan.scheduled if not r.is_finished]
        logger.error("step failed in the forward pass or sampler (%d in a row); failing %s",
                     self._num_consecutive_failed_steps, failed, exc_info=exc)
        ends = [(r, FinishReason.ERROR) for r in failed] + [(r, FinishReason.LENGTH) for r in plan.outgrown]
        outputs = []
        for request, reason in ends:
            self._end_request(request, reason)
            outputs.append(self._output_of(request, None))
        if self._num_consecutive_failed_steps >= MAX_CONSECUTIVE_FAILED_STEPS:
            raise RuntimeError(f"{MAX_CONSECUTIVE_FAILED_STEPS} steps in a row failed in the batch stage") from exc
        return outputs

    # observability

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
            num_prefill_tokens=self.num_prefill_tokens,
            num_cached_blocks=self.block_manager.num_cached_blocks,
            worst_running_priority=max((r.priority for r in self.scheduler.running), default=None),
            spec_decode=self.proposer.stats.copy() if self.proposer is not None else None,
        )

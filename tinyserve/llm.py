"""The offline API vLLM users know: `LLM(model=...).generate(prompts, params)` and `.chat(...)`.

All prompts go into one engine at once and are batched by the scheduler; results come back in prompt order.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tinyserve.config import (CacheConfig, DType, EngineConfig, GenerationConfigSource, ParallelConfig, QuantizationMode,
                              SchedulerConfig, SpeculativeConfig)
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.types import FinishReason, SamplingParams, TokenLogprob, Usage

Prompt = str | list[int]


@dataclass
class SampleResult:
    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    finish_reason: FinishReason | None = None
    logprobs: list[TokenLogprob] | None = None


@dataclass
class GenerationResult:
    """One prompt's result. `text`, `token_ids`, `finish_reason` and `logprobs` are those of the first
    sample; `outputs` holds all n; `usage` counts the prompt once and every sample's tokens."""

    prompt: Prompt
    prompt_token_ids: list[int]
    outputs: list[SampleResult]
    usage: Usage

    @property
    def text(self) -> str:
        return self.outputs[0].text

    @property
    def token_ids(self) -> list[int]:
        return self.outputs[0].token_ids

    @property
    def finish_reason(self) -> FinishReason | None:
        return self.outputs[0].finish_reason

    @property
    def logprobs(self) -> list[TokenLogprob] | None:
        return self.outputs[0].logprobs


class LLM:
    # The keywords flatten EngineConfig and its cache and scheduler configs, whose defaults they read.
    def __init__(self, model: str = EngineConfig.model, dtype: DType = EngineConfig.dtype,
                 device: str = EngineConfig.device, *,
                 quantization: QuantizationMode | None = EngineConfig.quantization,
                 max_num_seqs: int = SchedulerConfig.max_num_seqs,
                 max_num_batched_tokens: int = SchedulerConfig.max_num_batched_tokens,
                 max_model_len: int | None = SchedulerConfig.max_model_len,
                 kv_cache_memory: float | None = CacheConfig.kv_cache_memory_gib,
                 num_kv_blocks: int | None = CacheConfig.num_blocks, block_size: int = CacheConfig.block_size,
                 enable_prefix_caching: bool = CacheConfig.enable_prefix_caching, seed: int = EngineConfig.seed,
                 generation_config: GenerationConfigSource = EngineConfig.generation_config,
                 override_generation_config: dict | None = None,
                 speculative: SpeculativeConfig | None = None,
                 tensor_parallel_size: int = ParallelConfig.tensor_parallel_size,
                 pipeline_parallel_size: int = ParallelConfig.pipeline_parallel_size,
                 enforce_eager: bool = EngineConfig.enforce_eager,
                 kv_cache_dtype: str = CacheConfig.kv_cache_dtype):
        """With tensor / pipeline parallel the other ranks run as subprocesses on this machine until
        `close()` (or this process's end)."""
        config = EngineConfig(
            model=model, dtype=dtype, device=device, quantization=quantization, seed=seed,
            generation_config=generation_config, override_generation_config=override_generation_config or {},
            cache=CacheConfig(block_size=block_size, kv_cache_memory_gib=kv_cache_memory,
                              enable_prefix_caching=enable_prefix_caching, num_blocks=num_kv_blocks,
                              kv_cache_dtype=kv_cache_dtype),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_num_batched_tokens=max_num_batched_tokens,
                                      max_model_len=max_model_len),
            speculative=speculative or SpeculativeConfig(),
            parallel=ParallelConfig(tensor_parallel_size, pipeline_parallel_size), enforce_eager=enforce_eager,
        )
        self._start(config)

    @classmethod
    def from_config(cls, config: EngineConfig) -> LLM:
        """An LLM over a whole EngineConfig (every engine flag, as `tinyserve serve` builds it)."""
        llm = cls.__new__(cls)
        llm._start(config)
        return llm

    def _start(self, config: EngineConfig) -> None:
        self.engine = LLMEngine(config)
        self.tokenizer = self.engine.tokenizer

    def close(self) -> None:
        """Stop the other ranks (tensor / pipeline parallel); a no-op in one process."""
        self.engine.close()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def generate(self, prompts: Prompt | list[Prompt],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """Without `params`, the engine's default sampling (the checkpoint's, as vLLM's LLM.generate)."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params_list = params if isinstance(params, list) else [params or self.engine.default_sampling_params()] * len(prompts)
        if len(params_list) != len(prompts):
            raise ValueError(f"got {len(params_list)} SamplingParams for {len(prompts)} prompts")
        results = []
        for i, (prompt, p) in enumerate(zip(prompts, params_list)):
            ids = self.engine.add_request("generate", prompt, p, prompt_index=i)
            samples = [SampleResult(index=k, logprobs=[] if p.logprobs is not None else None) for k in range(p.n)]
            results.append(GenerationResult(prompt, ids, samples, Usage(len(ids), 0)))
        while self.engine.has_unfinished_requests():
            for out in self.engine.step():
                result = results[out.prompt_index]
                sample = result.outputs[out.index]
                sample.text += out.new_text
                sample.token_ids.extend(out.new_token_ids)
                if out.logprobs:
                    sample.logprobs.extend(out.logprobs)
                if out.finished:
                    sample.finish_reason = out.finish_reason
                    u = result.usage
                    result.usage = Usage(u.prompt_tokens, u.completion_tokens + out.usage.completion_tokens,
                                         max(u.cached_tokens, out.usage.cached_tokens))
        return results

    def chat(self, conversations: list[dict] | list[list[dict]],
             params: SamplingParams | list[SamplingParams] | None = None) -> list[GenerationResult]:
        """Apply the model's chat template (with the assistant generation prompt) to each conversation."""
        if conversations and isinstance(conversations[0], dict):
            conversations = [conversations]
        prompts = [self.tokenizer.encode(self.tokenizer.apply_chat_template(c), add_special_tokens=False)
                   for c in conversations]
        return self.generate(prompts, params)

"""Frozen configuration dataclasses. Values derived at start-up come from `resolve()`-style functions
that return new objects (dataclasses.replace); nothing mutates a config after it is built."""

from __future__ import annotations

import ipaddress

from dataclasses import dataclass, field
from typing import Literal, get_args

from tinyserve.request_limits import RequestLimits

# The defaults of every setting live in the dataclasses below (and these constants): cli.py's arguments,
# tinyserve.LLM's keywords and the benchmark configs read them from here rather than repeat them.
DEFAULT_MODEL = "smollm2-135m"
DType = Literal["auto", "float32", "bfloat16", "float16"]
DTYPES: tuple[str, ...] = get_args(DType)  # the choices of --dtype and of EngineConfig.dtype
# weight-only formats (layers/quant.py): int8 and int4 round the activations to int8 for integer dots (as
# llama.cpp does); w4a16 keeps int4's codes (int8's for the head and 5-8-bit tensors) with the activations
# as they are (csrc/quantized_matmul_a16.cpp)
Quantization = Literal["int8", "int4", "w4a16"]
QUANTIZATIONS: tuple[str, ...] = get_args(Quantization)
# --quantization: "auto" runs a GGUF whose linears the file stores quantized through our integer kernels
# (int4 mode: the file's codes, its 5-8-bit tensors at int8), where they run (CPU, bfloat16), as llama.cpp
# serves the same file; anything else keeps its dtype. "none" forces the float path.
QuantizationMode = Literal["auto", "none", "int8", "int4", "w4a16"]
QUANTIZATION_MODES: tuple[str, ...] = get_args(QuantizationMode)
# Where the default sampling fields come from (--generation-config, as vLLM's): "auto" from the checkpoint,
# "vllm" the neutral values of SamplingDefaults below (OpenAI's, and vLLM's own defaults).
GenerationConfigSource = Literal["auto", "vllm"]
GENERATION_CONFIG_SOURCES: tuple[str, ...] = get_args(GenerationConfigSource)
SamplingDefaultField = Literal["temperature", "top_p", "top_k", "min_p", "repetition_penalty"]
SAMPLING_DEFAULT_FIELDS: tuple[str, ...] = get_args(SamplingDefaultField)
# llama.cpp's own defaults (common_params_sampling), which a GGUF gets under "auto" for each field its
# general.sampling.* metadata does not set, as llama.cpp does
LLAMA_CPP_SAMPLING_DEFAULTS = {"temperature": 0.8, "top_k": 40, "top_p": 0.95, "min_p": 0.05}


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling as in HF's `rope_scaling` (only the kinds the supported models use), or
    "freq_factors": a divisor per inverse frequency, given outright, the form in which llama.cpp's converter
    writes a Llama 3.x's llama3 scaling into a GGUF (its rope_freqs tensor). ModelConfig checks their count."""

    rope_type: Literal["linear", "llama3", "freq_factors"]
    factor: float = 1.0  # linear, llama3
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only
    freq_factors: tuple[float, ...] | None = None  # freq_factors only: [head_dim // 2], each > 0

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3", "freq_factors"):
            raise ValueError(f"rope_scaling.rope_type must be 'linear', 'llama3' or 'freq_factors', "
                             f"got {self.rope_type!r}")
        if not 0 < self.factor < float("inf"):  # also false for NaN
            raise ValueError(f"rope_scaling.factor must be > 0 and finite, got {self.factor}")
        if (self.freq_factors is not None) != (self.rope_type == "freq_factors"):
            raise ValueError("rope_scaling.freq_factors must be given with rope_type 'freq_factors', and only then")
        bad = [(i, f) for i, f in enumerate(self.freq_factors or ()) if not 0 < f < float("inf")]  # NaN too
        if bad:
            raise ValueError(f"rope_scaling.freq_factors (GGUF rope_freqs.weight) must each be > 0 and finite, "
                             f"got {bad[0][1]} at index {bad[0][0]}")
        if self.rope_type != "llama3":
            return
        # rope_inv_freq divides by low_freq_factor and by high_freq_factor - low_freq_factor
        if not 0 < self.low_freq_factor < self.high_freq_factor < float("inf"):
            raise ValueError(f"rope_scaling.low_freq_factor and high_freq_factor must satisfy 0 < low < high "
                             f"(finite), got {self.low_freq_factor} and {self.high_freq_factor}")
        if not isinstance(self.original_max_position_embeddings, int) or self.original_max_position_embeddings < 1:
            raise ValueError(f"rope_scaling.original_max_position_embeddings must be an integer >= 1, "
                             f"got {self.original_max_position_embeddings!r}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one checkpoint, read from config.json or GGUF metadata."""

    architecture: str  # family key in models.registry: "llama", "qwen2", "qwen3", "gpt2", "gemma3"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    # None: hidden_size // num_attention_heads. __post_init__ resolves it, so a built config always holds
    # an int (and dataclasses.replace passes that int on).
    head_dim: int | None = None
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral-style sliding-window attention: each token attends to at most this many tokens, itself
    # included (layers/attention.py), in every layer. None: full attention.
    sliding_window: int | None = None
    # Gemma 3: per layer, whether the window applies (its local layers; the global ones attend to the
    # whole context). None: every layer has the window (Mistral's).
    layer_is_sliding: tuple[bool, ...] | None = None
    # the rotary base of the windowed layers, without rope_scaling (Gemma 3's rope_local_base_freq);
    # None: rope_theta, as every other layer
    rope_local_theta: float | None = None
    query_pre_attn_scalar: float | None = None  # attention scale is its ** -0.5 (Gemma); None: head_dim's
    final_logit_softcapping: float | None = None  # logits = cap * tanh(logits / cap); None: no cap

    # Upper bounds on the sizes, each well above every released model's value (the largest known in
    # brackets), so that a config past one is corrupt or hostile. Checked here, before a model is built
    # from the config, so that no kernel divides by a zero size and no layer asks for absurd memory.
    MAX_SIZES = {
        "vocab_size": 1 << 24,  # the sampler's float32 token ids are exact up to 2**24 (Gemma 3: 262,144)
        "hidden_size": 1 << 16,  # (Llama 3.1 405B: 16,384)
        "num_hidden_layers": 1024,  # (405B: 126)
        "num_attention_heads": 1024,  # (405B: 128)
        "num_key_value_heads": 1024,
        "intermediate_size": 1 << 20,  # (405B: 53,248)
        "head_dim": 1024,  # (Gemma: 256); None means hidden_size / num_attention_heads
        "max_position_embeddings": 1 << 24,  # (Llama 4 Scout: 10M)
    }
    # Rotary families build cos/sin tables of max_position_embeddings x head_dim float32 entries when the
    # model is constructed, before a weight is read (layers/rotary.py): at most 2**28 entries, a few GiB
    # (Qwen2.5-1M: 1,010,000 x 128, 1.3e8).
    MAX_ROTARY_TABLE = 1 << 28

    def __post_init__(self) -> None:
        self._check_sizes()
        if self.head_dim is None:
            if self.hidden_size % self.num_attention_heads:
                raise ValueError(f"hidden_size ({self.hidden_size}) must be divisible by num_attention_heads "
                                 f"({self.num_attention_heads}) when head_dim is not given")
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
            if self.head_dim > self.MAX_SIZES["head_dim"]:
                raise ValueError(f"head_dim (hidden_size / num_attention_heads = {self.head_dim}) must be <= "
                                 f"{self.MAX_SIZES['head_dim']}")
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )
        self._check_head_layout()
        factors = self.rope_scaling.freq_factors if self.rope_scaling is not None else None
        if factors is not None and len(factors) != self.head_dim // 2:  # one per rotated pair of dims
            raise ValueError(f"rope_scaling.freq_factors (GGUF rope_freqs.weight) must hold head_dim // 2 = "
                             f"{self.head_dim // 2} values, got {len(factors)}")
        for name in ("norm_eps", "rope_theta"):  # eps: 1 / sqrt(mean + eps); theta: the rotary base
            if not 0 < getattr(self, name) < float("inf"):  # also false for NaN
                raise ValueError(f"{name} must be > 0 and finite, got {getattr(self, name)}")
        if self.sliding_window is not None and (not isinstance(self.sliding_window, int) or self.sliding_window < 1):
            raise ValueError(f"sliding_window must be an integer >= 1 (or unset), got {self.sliding_window!r}")
        self._check_gemma_fields()

    def layer_sliding_windows(self) -> tuple[int | None, ...]:
        """Each attention layer's sliding window (None: full attention): the one place models and the
        decode plan (layers/attention_metadata.py) read it, so a family with per-layer windows sets it here."""
        if self.layer_is_sliding is None:
            return (self.sliding_window,) * self.num_hidden_layers
        return tuple(self.sliding_window if is_sliding else None for is_sliding in self.layer_is_sliding)

    def _check_gemma_fields(self) -> None:
        if self.layer_is_sliding is not None:
            if (len(self.layer_is_sliding) != self.num_hidden_layers
                    or not all(isinstance(b, bool) for b in self.layer_is_sliding)):
                raise ValueError(f"layer_is_sliding must hold one bool per layer ({self.num_hidden_layers}), "
                                 f"got {self.layer_is_sliding!r}")
            if any(self.layer_is_sliding) and self.sliding_window is None:
                raise ValueError("layer_is_sliding marks windowed layers, but sliding_window is unset")
        for name in ("rope_local_theta", "query_pre_attn_scalar", "final_logit_softcapping"):
            value = getattr(self, name)
            if value is not None and not 0 < value < float("inf"):  # also false for NaN
                raise ValueError(f"{name} must be > 0 and finite (or unset), got {value}")

    def _check_sizes(self) -> None:
        for name, limit in self.MAX_SIZES.items():
            value = getattr(self, name)
            if name == "head_dim" and value is None:  # derived in __post_init__, checked there
                continue
            if not isinstance(value, int) or isinstance(value, bool):
                raise ValueError(f"{name} must be an integer, got {value!r}")
            if not 1 <= value <= limit:
                derived = " (or None: hidden_size / num_attention_heads)" if name == "head_dim" else ""
                raise ValueError(f"{name} must be in [1, {limit}]{derived}, got {value}")

    def _check_head_layout(self) -> None:
        """What the families' layers assume of head_dim (given, or derived above)."""
        if self.architecture == "gpt2":  # c_attn's 3 * hidden_size outputs are split into heads
            if self.head_dim * self.num_attention_heads != self.hidden_size:
                raise ValueError(f"head_dim ({self.head_dim}) x num_attention_heads ({self.num_attention_heads}) "
                                 f"must equal hidden_size ({self.hidden_size}) for gpt2")
            return
        if self.head_dim % 2:  # rotary turns pairs of dims
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.max_position_embeddings * self.head_dim > self.MAX_ROTARY_TABLE:
            raise ValueError(f"max_position_embeddings ({self.max_position_embeddings}) x head_dim "
                             f"({self.head_dim}) must be <= {self.MAX_ROTARY_TABLE} (the rotary tables)")


KV_CACHE_DTYPES = ("auto", "int8")


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    # The KV pool in GiB; None: auto (`--kv-cache-memory auto`). Auto on CUDA: memory_fraction of the free device
    # memory after the weights. Auto on CPU (engine/memory/fit_check.py): what max_num_seqs full contexts need, no
    # more; memory_fraction of what the process may still use after the weights and activations, but at least
    # cpu_kv_cache_memory_gib where that much is left and at most cpu_kv_cache_max_gib (a small model on a large
    # machine does not hold half of it); within memory_share_gib, all of the share left.
    kv_cache_memory_gib: float | None = None
    memory_fraction: float = 0.5  # of free memory, when no explicit budget is given
    cpu_kv_cache_memory_gib: float = 1.0  # auto's floor on CPU, where memory allows
    cpu_kv_cache_max_gib: float = 4.0  # auto's ceiling on CPU outside a --memory-budget (vLLM's CPU KV space)
    # this model's share of the server's --memory-budget (weights + KV pool + activations), set by the
    # registry (server/registry/model_registry.py); None: no budget
    memory_share_gib: float | None = None
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # derived at start-up from the budget; set directly only in tests
    # "auto": the model's dtype; "int8": codes with a float16 scale per token and head (layers/kv_cache.py),
    # ~1.9x the tokens in the same bytes
    kv_cache_dtype: str = "auto"

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if self.memory_share_gib is not None and self.memory_share_gib <= 0:
            raise ValueError(f"memory_share_gib must be > 0 GiB, got {self.memory_share_gib}")
        if not 0 < self.cpu_kv_cache_memory_gib <= self.cpu_kv_cache_max_gib:
            raise ValueError(f"cpu_kv_cache_memory_gib must be in (0, cpu_kv_cache_max_gib "
                             f"{self.cpu_kv_cache_max_gib:g}], got {self.cpu_kv_cache_memory_gib}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise ValueError(f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's context length (derived at start-up)
    # aging: one priority level is worth this many seconds of waiting, so a request is overtaken (or
    # preempted) by better-priority arrivals for at most priority_aging_s x (their priority gap) seconds
    priority_aging_s: float = 60.0

    def __post_init__(self) -> None:
        if not self.priority_aging_s > 0:
            raise ValueError(f"priority_aging_s must be > 0, got {self.priority_aging_s}")
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


SpeculativeMethod = Literal["ngram", "draft"]
SPECULATIVE_METHODS: tuple[str, ...] = get_args(SpeculativeMethod)


@dataclass(frozen=True)
class SpeculativeConfig:
    """Speculative decoding (engine/spec_decode/speculative.py): a proposer guesses up to num_speculative_tokens next
    tokens of each decoding sequence, one forward verifies them, and rejection sampling keeps the longest
    accepted run plus one token of the target's, so the output is the target's alone (lossless)."""

    # None: off; "ngram": prompt lookup over the sequence itself; "draft": a draft model's greedy guesses
    method: SpeculativeMethod | None = None
    num_speculative_tokens: int = 4  # proposed tokens per sequence and step, at most
    # n-gram lookup: the longest suffix of ngram_max .. ngram_min tokens that occurred before proposes
    # what followed its latest earlier occurrence
    ngram_min: int = 2
    ngram_max: int = 4
    # a step with more running sequences than this proposes nothing: the batch already fills the linears
    # (vLLM's disable_by_batch_size); None: always propose
    disable_by_batch_size: int | None = 8
    # method "draft": the draft model (alias, GGUF file or HF folder) with the target's tokenizer, and its
    # weight format; quantized, it runs in bfloat16, else in the engine's dtype
    draft_model: str | None = None
    draft_quantization: Quantization | None = None

    def __post_init__(self) -> None:
        if self.method is not None and self.method not in SPECULATIVE_METHODS:
            raise ValueError(f"speculative method must be one of {', '.join(SPECULATIVE_METHODS)}; "
                             f"got {self.method!r}")
        if (self.method == "draft") != (self.draft_model is not None):
            raise ValueError("a draft model is given with speculative method 'draft', and only with it "
                             f"(method {self.method!r}, draft model {self.draft_model!r})")
        if self.draft_quantization is not None and (self.draft_model is None
                                                    or self.draft_quantization not in QUANTIZATIONS):
            raise ValueError(f"draft_quantization must be one of {', '.join(QUANTIZATIONS)}, with a draft model; "
                             f"got {self.draft_quantization!r}")
        if not 1 <= self.num_speculative_tokens <= 16:
            raise ValueError(f"num_speculative_tokens must be in [1, 16], got {self.num_speculative_tokens}")
        if not 1 <= self.ngram_min <= self.ngram_max:
            raise ValueError(f"ngram_min and ngram_max must satisfy 1 <= min <= max, got "
                             f"{self.ngram_min}, {self.ngram_max}")
        if self.disable_by_batch_size is not None and self.disable_by_batch_size < 1:
            raise ValueError(f"disable_by_batch_size must be >= 1, got {self.disable_by_batch_size}")


@dataclass(frozen=True)
class SamplingDefaults:
    """The sampling fields a request that leaves them out gets (named as SamplingParams' fields); an explicit
    request field always wins. Resolved once at start-up (engine/loop/generation_defaults.py), from the checkpoint
    or these neutral values, then EngineConfig.override_generation_config. Ranges are SamplingParams' own,
    checked there."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int | None = None  # None: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0

    def as_fields(self) -> dict[str, float | int | None]:
        return {name: getattr(self, name) for name in SAMPLING_DEFAULT_FIELDS}


@dataclass(frozen=True)
class ParallelConfig:
    """Tensor x pipeline parallel (tinyserve/parallel/): T x P ranks, rank r in pipeline stage r // T at
    tensor rank r % T. Rank 0 serves, schedules and samples; the others run their shard of each step."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    # Where the ranks meet (torch.distributed's TCP store). None: this process starts the other ranks itself,
    # on this machine, at a free loopback port; set (with `rank`) when a launcher such as torchrun started
    # every rank.
    master_addr: str | None = None
    master_port: int | None = None
    rank: int = 0
    local_rank: int | None = None  # the rank's index on its machine (its GPU); None: `rank`
    # a collective that waits this long for another rank fails, and with it the engine (never a hang)
    timeout_s: float = 30.0

    @property
    def world_size(self) -> int:
        return self.tensor_parallel_size * self.pipeline_parallel_size

    def __post_init__(self) -> None:
        for name in ("tensor_parallel_size", "pipeline_parallel_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if not 0 <= self.rank < self.world_size:
            raise ValueError(f"rank must be in [0, {self.world_size}), got {self.rank}")
        if (self.master_addr is None) != (self.master_port is None):
            raise ValueError("master_addr and master_port are given together, or neither")
        if self.master_addr is None and self.rank != 0:
            raise ValueError("a rank other than 0 needs master_addr and master_port")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # alias, path to a .gguf file, or a Hugging Face checkpoint folder
    dtype: DType = "auto"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    # QUANTIZATION_MODES above; None is "none". Resolved at load (loader/model_loader.py, resolve_quantization).
    quantization: QuantizationMode | None = "auto"
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    speculative: SpeculativeConfig = field(default_factory=SpeculativeConfig)
    # the default sampling fields: from the checkpoint ("auto") or neutral ("vllm"), then these fields
    # (SamplingDefaults' names; top_k -1 or 0 means no cut) over them
    generation_config: GenerationConfigSource = "auto"
    override_generation_config: dict[str, float | int | None] = field(default_factory=dict)
    # Jinja source of a chat template used instead of the checkpoint's (--chat-template FILE, as vLLM's): for
    # checkpoints without one, such as a base model's GGUF. None: the checkpoint's, if it has one.
    chat_template: str | None = None
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    # CUDA: decode steps run eagerly instead of replaying CUDA graphs (vLLM's --enforce-eager)
    enforce_eager: bool = False
    # a load fails when a read of the model's files gives no data for this long (loader/file_reads.py)
    load_read_timeout: float = 30.0
    # the caps every request this engine takes is checked against (LLMEngine.validate); a server sets its own
    limits: RequestLimits = field(default_factory=RequestLimits)

    def __post_init__(self) -> None:
        if self.dtype not in DTYPES:
            raise ValueError(f"dtype must be one of {', '.join(DTYPES)}; got {self.dtype!r}")
        if self.generation_config not in GENERATION_CONFIG_SOURCES:
            raise ValueError(f"generation_config must be one of {', '.join(GENERATION_CONFIG_SOURCES)}; "
                             f"got {self.generation_config!r}")
        unknown = sorted(set(self.override_generation_config) - set(SAMPLING_DEFAULT_FIELDS))
        if unknown:
            raise ValueError(f"override_generation_config: unknown field {unknown[0]!r} (known: "
                             f"{', '.join(SAMPLING_DEFAULT_FIELDS)})")
        for name, value in self.override_generation_config.items():
            is_top_k = name == "top_k"  # None (or -1, 0): no top-k cut
            if not (is_top_k and value is None) and (not isinstance(value, (int,) if is_top_k else (int, float))
                                                     or isinstance(value, bool)):
                kind = "an integer" if is_top_k else "a number"
                raise ValueError(f"override_generation_config: {name} must be {kind}, got {value!r}")
        if not self.load_read_timeout > 0:
            raise ValueError(f"load_read_timeout must be > 0; got {self.load_read_timeout!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATION_MODES:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATION_MODES)}; "
                             f"got {self.quantization!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP layer's settings (tinyserve serve). Limits of None mean no limit."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    grpc_port: int | None = None  # the gRPC API (server/grpc_api/grpc_service.py) on host:grpc_port too; None: off
    served_model_names: tuple[str, ...] = ()  # () : the engine's model string
    api_key: str | None = None  # required as "Authorization: Bearer <key>" on the API routes when set
    # the admin API (/admin/models/*: load, unload, swap to a path on this machine); off, its routes are
    # 404. On, it needs an api_key unless the server listens on loopback only.
    enable_admin_api: bool = False
    # waiting (unscheduled) samples; beyond it new requests get 503 at once, and a request of more samples
    # (prompts x n) than this gets 400
    max_queue: int | None = 256
    request_timeout: float | None = None  # seconds from arrival; then the request is aborted
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM / SIGINT
    allowed_origins: tuple[str, ...] = ()  # CORS: off unless origins are given ("*" for any)
    stall_timeout: float = 60.0  # /health is 503 when work is pending and no step finished for this long
    warmup: bool = True  # one short generation before reporting ready
    limits: RequestLimits = field(default_factory=RequestLimits)  # every cap on one request: request_limits.py
    # Special-token text in chat messages (e.g. "<|im_start|>") is encoded as plain text so a user
    # cannot forge a turn; True renders it as control tokens, for trusted clients only.
    allow_special_tokens_in_messages: bool = False
    # A request field this server does not know is a 400 naming it (code unknown_parameter), so that no
    # field is ignored in silence; True ignores unknown fields, for clients that send other servers' extras.
    allow_unknown_fields: bool = False
    # Connection limits, so slow or idle peers cannot hold the server's memory or sockets:
    stream_write_timeout: float = 30.0  # a stream whose client reads nothing for this long is aborted
    body_read_timeout: float = 30.0  # seconds from a request's start to its last body byte; then 408
    max_connections: int = 2048  # concurrent connections (uvicorn limit_concurrency); beyond it 503
    keep_alive_timeout: float = 5.0  # an idle keep-alive connection is closed after this many seconds
    # Several models (server/registry/model_registry.py). `models` are (name, path) served beside the engine's
    # model; `models_dir` is searched for more, loaded when first asked for.
    models: tuple[tuple[str, str], ...] = ()
    models_dir: str | None = None
    max_loaded_models: int | None = None  # beyond it the least recently used idle model is unloaded
    memory_budget_gib: float | None = None  # weights + KV pools of the loaded models; each gets its share
    idle_unload: float | None = None  # seconds without a request after which a model is unloaded
    drain_timeout: float = 30.0  # swap / unload: seconds in-flight requests get before they are aborted
    # "fixed": up to max_queue samples wait; "adaptive": the limit follows measured TTFT to hold target_ttft
    # seconds (server/intake/admission.py), max_queue still the ceiling
    admission: Literal["fixed", "adaptive"] = "fixed"
    target_ttft: float | None = None

    @property
    def is_loopback_only(self) -> bool:
        """Whether `host` reaches this machine alone: localhost or a loopback address (127.0.0.0/8, ::1).
        Any other name, "0.0.0.0" and "::" listen beyond it."""
        if self.host == "localhost":
            return True
        try:
            return ipaddress.ip_address(self.host.strip("[]")).is_loopback
        except ValueError:  # a host name: whatever it resolves to, it is not known to be loopback
            return False

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.grpc_port is not None and not 0 <= self.grpc_port <= 65535:
            raise ValueError(f"grpc_port must be in [0, 65535], got {self.grpc_port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        if self.enable_admin_api and self.api_key is None and not self.is_loopback_only:
            raise ValueError(f"enable_admin_api: the admin API loads files named by its callers, so beyond "
                             f"loopback (host {self.host!r}) it needs an API key (--api-key-file)")
        if self.max_queue is not None and self.max_queue < 1:  # 0 would refuse every request (400)
            raise ValueError(f"max_queue must be >= 1 (or unset: no limit), got {self.max_queue}")
        if self.max_loaded_models is not None and self.max_loaded_models < 1:
            raise ValueError(f"max_loaded_models must be >= 1 (or unset: no limit), got {self.max_loaded_models}")
        names = [name for name, _ in self.models]
        if len(set(names)) != len(names):
            raise ValueError(f"models: each name once, got {names}")
        if self.memory_budget_gib is not None and self.memory_budget_gib <= 0:
            raise ValueError(f"memory_budget_gib must be > 0 GiB, got {self.memory_budget_gib}")
        for name in ("request_timeout", "stall_timeout", "idle_unload"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        for name in ("shutdown_timeout", "drain_timeout"):
            if getattr(self, name) < 0:
                raise ValueError(f"{name} must be >= 0 seconds, got {getattr(self, name)}")
        if self.admission not in ("fixed", "adaptive"):
            raise ValueError(f"admission must be fixed or adaptive, got {self.admission!r}")
        if (self.admission == "adaptive") != (self.target_ttft is not None):
            raise ValueError("admission adaptive and target_ttft go together (the target is what it holds)")
        if self.target_ttft is not None and not self.target_ttft > 0:
            raise ValueError(f"target_ttft must be > 0 seconds, got {self.target_ttft}")
        if self.max_connections < 1:
            raise ValueError(f"max_connections must be >= 1, got {self.max_connections}")
        for name in ("stream_write_timeout", "body_read_timeout", "keep_alive_timeout"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 seconds, got {getattr(self, name)}")

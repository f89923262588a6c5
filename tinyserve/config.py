"""Frozen configuration dataclasses. Values derived at start-up come from `resolve()`-style functions
that return new objects (dataclasses.replace); nothing mutates a config after it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DEFAULT_MODEL = "smollm2-135m"
DType = Literal["auto", "float32", "bfloat16", "float16"]
QUANTIZATIONS = ("int8", "int4")  # weight-only formats (layers/quant.py)


@dataclass(frozen=True)
class RopeScaling:
    """Rotary frequency scaling as in HF's `rope_scaling` (only the kinds the supported models use)."""

    rope_type: Literal["linear", "llama3"]
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3 only

    def __post_init__(self) -> None:
        if self.rope_type not in ("linear", "llama3"):
            raise ValueError(f"rope_scaling.rope_type must be 'linear' or 'llama3', got {self.rope_type!r}")
        if self.factor <= 0:
            raise ValueError(f"rope_scaling.factor must be > 0, got {self.factor}")


@dataclass(frozen=True)
class ModelConfig:
    """Hyper-parameters of one checkpoint, read from config.json or GGUF metadata."""

    architecture: str  # family key in models.registry: "llama", "qwen2", "qwen3", "gpt2"
    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    intermediate_size: int
    max_position_embeddings: int
    norm_eps: float
    head_dim: int = 0  # 0: hidden_size // num_attention_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # bias on q/k/v projections (Qwen2)
    qk_norm: bool = False  # RMSNorm on each head of q and k (Qwen3)
    hidden_act: str = "silu"
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    # Mistral-style sliding-window attention: each token sees at most this many previous tokens. The
    # attention layers do not implement the window, so the engine must cap the context (max_model_len)
    # at it; within the window, full attention is exact. None: no window.
    sliding_window: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim == 0:
            object.__setattr__(self, "head_dim", self.hidden_size // self.num_attention_heads)
        if self.num_attention_heads % self.num_key_value_heads:
            raise ValueError(
                f"num_attention_heads ({self.num_attention_heads}) must be a multiple of "
                f"num_key_value_heads ({self.num_key_value_heads})"
            )

    def kv_bytes_per_token(self, dtype_size: int) -> int:
        """2 (K and V) x layers x kv_heads x head_dim x dtype size."""
        return 2 * self.num_hidden_layers * self.num_key_value_heads * self.head_dim * dtype_size


@dataclass(frozen=True)
class CacheConfig:
    block_size: int = 16  # tokens per KV block
    kv_cache_memory_gib: float | None = None  # explicit budget; None: a fraction of free device memory
    memory_fraction: float = 0.5  # of free memory, when no explicit budget is given
    enable_prefix_caching: bool = True
    num_blocks: int | None = None  # derived at start-up from the budget; set directly only in tests

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.kv_cache_memory_gib is not None and self.kv_cache_memory_gib <= 0:
            raise ValueError(f"kv_cache_memory must be > 0 GiB, got {self.kv_cache_memory_gib}")
        if not 0 < self.memory_fraction <= 1:
            raise ValueError(f"memory_fraction must be in (0, 1], got {self.memory_fraction}")
        if self.num_blocks is not None and self.num_blocks < 1:
            raise ValueError(f"num_blocks must be >= 1, got {self.num_blocks}")


@dataclass(frozen=True)
class SchedulerConfig:
    max_num_seqs: int = 64  # sequences in one step
    max_num_batched_tokens: int = 512  # tokens in one step (decodes + prefill chunks)
    max_model_len: int | None = None  # None: the model's context length (derived at start-up)

    def __post_init__(self) -> None:
        if self.max_num_seqs < 1:
            raise ValueError(f"max_num_seqs must be >= 1, got {self.max_num_seqs}")
        if self.max_num_batched_tokens < 1:
            raise ValueError(f"max_num_batched_tokens must be >= 1, got {self.max_num_batched_tokens}")
        if self.max_model_len is not None and self.max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {self.max_model_len}")


@dataclass(frozen=True)
class EngineConfig:
    model: str = DEFAULT_MODEL  # alias, path to a .gguf file, or a Hugging Face checkpoint folder
    dtype: DType = "auto"
    device: str = "auto"  # "auto", "cpu", "cuda", "cuda:1", ...
    quantization: str | None = None  # weight-only "int8" / "int4" (CPU, bfloat16); see layers/quant.py
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")
        if self.quantization is not None and self.quantization not in QUANTIZATIONS:
            raise ValueError(f"quantization must be one of {', '.join(QUANTIZATIONS)} (or unset); "
                             f"got {self.quantization!r}")


@dataclass(frozen=True)
class ServerConfig:
    """The HTTP layer's settings (tinyserve serve). Limits of None mean no limit."""

    host: str = "127.0.0.1"  # loopback unless told otherwise
    port: int = 8000
    served_model_names: tuple[str, ...] = ()  # () : the engine's model string
    api_key: str | None = None  # required as "Authorization: Bearer <key>" on the API routes when set
    max_queue: int | None = 256  # waiting (unscheduled) samples; beyond it new requests get 503 at once
    request_timeout: float | None = None  # seconds from arrival; then the request is aborted
    shutdown_timeout: float = 30.0  # seconds in-flight requests get to finish on SIGTERM / SIGINT
    max_body_bytes: int = 4 << 20  # larger request bodies get 413
    allowed_origins: tuple[str, ...] = ()  # CORS: off unless origins are given ("*" for any)
    stall_timeout: float = 60.0  # /health is 503 when work is pending and no step finished for this long
    warmup: bool = True  # one short generation before reporting ready

    def __post_init__(self) -> None:
        if not 0 <= self.port <= 65535:
            raise ValueError(f"port must be in [0, 65535], got {self.port}")
        if self.api_key is not None and not self.api_key:
            raise ValueError("api_key must not be empty (leave it unset to disable authentication)")
        if self.max_queue is not None and self.max_queue < 0:
            raise ValueError(f"max_queue must be >= 0, got {self.max_queue}")
        for name in ("request_timeout", "stall_timeout"):
            value = getattr(self, name)
            if value is not None and value <= 0:
                raise ValueError(f"{name} must be > 0 seconds, got {value}")
        if self.shutdown_timeout < 0:
            raise ValueError(f"shutdown_timeout must be >= 0 seconds, got {self.shutdown_timeout}")
        if self.max_body_bytes < 1024:
            raise ValueError(f"max_body_bytes must be >= 1024, got {self.max_body_bytes}")

"""Frozen configuration dataclasses. Values derived at start-up come from `resolve()`-style functions
that return new objects (dataclasses.replace); nothing mutates a config after it is built."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

DEFAULT_MODEL = "smollm2-135m"
DType = Literal["auto", "float32", "bfloat16", "float16"]


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
    seed: int = 0
    cache: CacheConfig = field(default_factory=CacheConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)

    def __post_init__(self) -> None:
        if self.dtype not in ("auto", "float32", "bfloat16", "float16"):
            raise ValueError(f"dtype must be one of auto, float32, bfloat16, float16; got {self.dtype!r}")

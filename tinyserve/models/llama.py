"""The Llama family: Llama 2/3, TinyLlama, SmolLM2, Mistral; Qwen2 and Qwen3 reuse it with their flags.

Pre-norm decoder: x += attn(rmsnorm(x)); x += mlp(rmsnorm(x)), each add fused into the norm after it.
GQA attention over the paged KV cache (Mistral's within its sliding window), rotary positions, SwiGLU
MLP, tied or untied LM head. Knows nothing of requests: it maps flattened tokens of many sequences (with
their positions and attention metadata) to hidden states.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.config import ModelConfig
from tinyserve.layers import ops
from tinyserve.layers.attention import Attention
from tinyserve.layers.attention_metadata import AttentionMetadata
from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.embedding import Embedding
from tinyserve.layers.linear import Linear, MergedLinear, TiedLMHead, row_parallel_linear
from tinyserve.layers.norm import RMSNorm
from tinyserve.layers.rotary import RotaryEmbedding
from tinyserve.parallel.group import SINGLE, TensorParallelGroup
from tinyserve.parallel.shard import ModelShard, check_tensor_parallel, column_slice, kv_head_slice

# The residual stream between layers, and between pipeline stages: (the last layer's MLP output, the
# stream before it), or (the embeddings, None) before the first layer.
Stream = tuple[torch.Tensor, torch.Tensor | None]


class LlamaAttention(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = SINGLE):
        """tp: this rank's share of the heads (parallel/shard.py)."""
        super().__init__()
        self.head_dim = config.head_dim
        self.num_heads = config.num_attention_heads // tp.size
        self.num_kv_heads, kv_slice = kv_head_slice(config.num_key_value_heads, self.head_dim, tp)
        q_size, kv_size = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        q_slice = column_slice(config.num_attention_heads * self.head_dim, tp)
        self.qkv_proj = MergedLinear(config.hidden_size, [q_size, kv_size, kv_size], bias=config.attention_bias,
                                     shard_slices=[q_slice, kv_slice, kv_slice])
        self.o_proj = row_parallel_linear(q_size, config.hidden_size, False, tp)
        self.q_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        self.k_norm = RMSNorm(self.head_dim, config.norm_eps) if config.qk_norm else None
        scale = None if config.query_pre_attn_scalar is None else config.query_pre_attn_scalar**-0.5
        self.attn = Attention(self.num_heads, self.num_kv_heads, self.head_dim, layer_index, scale,
                              sliding_window=config.layer_sliding_windows()[layer_index])

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.qkv_proj(x)  # [num_tokens, (heads + 2 * kv_heads) * head_dim]
        q, k, v = qkv.split(self.qkv_proj.output_sizes, dim=-1)
        q = q.view(num_tokens, self.num_heads, self.head_dim)
        k = k.view(num_tokens, self.num_kv_heads, self.head_dim)
        v = v.view(num_tokens, self.num_kv_heads, self.head_dim)
        if self.q_norm is not None:  # Qwen3 and Gemma 3 normalize each head before rotating it
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = ops.rotary(q, k, *rope)  # in place where the kernel takes them: qkv is this call's own
        out = self.attn(q, k, v, meta)  # [num_tokens, heads, head_dim]
        return self.o_proj(out.reshape(num_tokens, -1))


# hidden_act -> the gated activation on a fused gate_up output: SwiGLU (Llama, Qwen), GeGLU (Gemma)
_GATED_ACTS = {"silu": ops.silu_and_mul, "gelu_pytorch_tanh": ops.gelu_tanh_and_mul}


class LlamaMLP(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        size = config.intermediate_size // tp.size
        rows = column_slice(config.intermediate_size, tp)
        self.gate_up_proj = MergedLinear(config.hidden_size, [size, size], bias=False, shard_slices=[rows, rows])
        self.down_proj = row_parallel_linear(size, config.hidden_size, False, tp)
        self.act_and_mul = _GATED_ACTS[config.hidden_act]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(self.act_and_mul(self.gate_up_proj(x)))


class LlamaDecoderLayer(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.self_attn = LlamaAttention(config, layer_index, tp)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.norm_eps)
        self.mlp = LlamaMLP(config, tp)

    def forward(self, rope: tuple[torch.Tensor, torch.Tensor], x: torch.Tensor, residual: torch.Tensor | None,
                meta: AttentionMetadata) -> tuple[torch.Tensor, torch.Tensor]:
        """x: the previous layer's MLP output (or the embeddings, with residual None); residual: the
        stream before it. Each residual add is fused into the norm that follows it, so a layer returns
        (MLP output, stream) and the next layer (or the final norm) adds them."""
        if residual is None:
            residual, h = x, self.input_layernorm(x)
        else:
            h, residual = self.input_layernorm(x, residual)
        h = self.self_attn(rope, h, meta)
        h, residual = self.post_attention_layernorm(h, residual)
        return self.mlp(h), residual


class MissingLayer(nn.Module):
    """The place of a layer another pipeline stage holds (keeps the others' parameter names)."""


class LlamaModel(nn.Module):  # a container: never called
    def __init__(self, config: ModelConfig, shard: ModelShard):
        super().__init__()
        tp = shard.tp
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp) if shard.holds_ends else None
        self.layers = nn.ModuleList(LlamaDecoderLayer(config, i, tp) if i in shard.layers else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)  # shared by all layers: one per step
        self.norm = RMSNorm(config.hidden_size, config.norm_eps) if shard.holds_ends else None


class LlamaForCausalLM(DirectCall, nn.Module):
    # checkpoint projection -> (our merged module, shard index); the loader uses this to fill MergedLinears
    packed_modules = {
        "q_proj": ("qkv_proj", 0), "k_proj": ("qkv_proj", 1), "v_proj": ("qkv_proj", 2),
        "gate_proj": ("gate_up_proj", 0), "up_proj": ("gate_up_proj", 1),
    }
    stream_width = 2  # tensors in a Stream between pipeline stages: x and the residual

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        """shard: the part this rank holds (tensor / pipeline parallel); None: the whole model."""
        super().__init__()
        self.config = config
        self.shard = shard = shard or ModelShard.whole(config.num_hidden_layers)
        check_tensor_parallel(config, shard.tp.size)
        self.model = LlamaModel(config, shard)
        self.lm_head = None
        if shard.holds_ends:
            self.lm_head = (TiedLMHead(self.model.embed_tokens) if config.tie_word_embeddings
                            else Linear(config.hidden_size, config.vocab_size // shard.tp.size, bias=False,
                                        is_lm_head=True, weight_slice=column_slice(config.vocab_size, shard.tp)))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size]"""
        return self.final_norm(self.run_layers(self.embed(input_ids), positions, meta))

    # A pipeline stage runs the part it holds: embed (stage 0), run_layers (each stage), final_norm (stage 0,
    # on what the last stage sends back).

    def embed(self, input_ids: torch.Tensor) -> Stream:
        return self.model.embed_tokens(input_ids), None

    def run_layers(self, stream: Stream, positions: torch.Tensor, meta: AttentionMetadata) -> Stream:
        """This rank's layers over the stream."""
        x, residual = stream
        rope = self.model.rotary_emb(positions, x.dtype)
        for i in self.shard.layers:
            x, residual = self.model.layers[i](rope, x, residual, meta)
        return x, residual

    def final_norm(self, stream: Stream) -> torch.Tensor:
        x, residual = stream
        return self.model.norm(x) if residual is None else self.model.norm(x, residual)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden_size] -> [n, vocab_size]; only the positions that are sampled get here. Tensor parallel:
        each rank's vocabulary slice, gathered on tensor rank 0 (None on the others)."""
        return self.shard.tp.gather_to_first(self.lm_head(hidden))

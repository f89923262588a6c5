"""Gemma 3 (text): the Llama block rearranged, with local and global attention layers interleaved.

Sandwich-norm decoder: x += post_attn_norm(attn(input_norm(x))); x += post_ff_norm(mlp(pre_ff_norm(x))),
each norm Gemma's x / rms(x) * (1 + w) in float32 (layers/norm.py), so no residual add is fused into a
norm as Llama's are. Local layers attend within the sliding window with their own rotary base
(rope_local_base_freq); global layers attend to the whole context with rope_theta and its rope_scaling
(ModelConfig.layer_sliding_windows says which is which). q and k are RMS-normalized per head before the
rotation, the attention scale is query_pre_attn_scalar ** -0.5, the MLP is GeGLU (tanh GELU), the
embeddings are scaled by sqrt(hidden_size) and the released LM heads are tied to them (unscaled). Attention logit
softcapping (Gemma 2) is refused by the loader; final logit softcapping is applied where a config sets it.
"""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.config import ModelConfig
from tinyserve.layers.attention_metadata import AttentionMetadata
from tinyserve.layers.direct_call import DirectCall
from tinyserve.layers.embedding import Embedding
from tinyserve.layers.linear import Linear, TiedLMHead
from tinyserve.layers.norm import GemmaRMSNorm
from tinyserve.layers.rotary import RotaryEmbedding
from tinyserve.models.llama import LlamaAttention, LlamaForCausalLM, LlamaMLP, MissingLayer
from tinyserve.parallel.group import SINGLE, TensorParallelGroup
from tinyserve.parallel.shard import ModelShard, check_tensor_parallel, column_slice

Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin [num_tokens, 1, head_dim]


class Gemma3Attention(LlamaAttention):
    """Llama's attention (its scale from query_pre_attn_scalar) with Gemma's (1 + w) norms on q and k."""

    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = SINGLE):
        super().__init__(config, layer_index, tp)
        self.q_norm = GemmaRMSNorm(self.head_dim, config.norm_eps)
        self.k_norm = GemmaRMSNorm(self.head_dim, config.norm_eps)
        self.is_sliding = self.attn.sliding_window is not None  # picks the local rotary table


class Gemma3DecoderLayer(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int, tp: TensorParallelGroup = SINGLE):
        super().__init__()
        size, eps = config.hidden_size, config.norm_eps
        self.input_layernorm = GemmaRMSNorm(size, eps)
        self.self_attn = Gemma3Attention(config, layer_index, tp)
        self.post_attention_layernorm = GemmaRMSNorm(size, eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(size, eps)
        self.mlp = LlamaMLP(config, tp)  # GeGLU: config.hidden_act is gelu_pytorch_tanh
        self.post_feedforward_layernorm = GemmaRMSNorm(size, eps)

    def forward(self, local_rope: Rope, global_rope: Rope, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """x [num_tokens, hidden_size], the residual stream -> the stream after this layer."""
        rope = local_rope if self.self_attn.is_sliding else global_rope
        x = x + self.post_attention_layernorm(self.self_attn(rope, self.input_layernorm(x), meta))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3Model(nn.Module):  # a container: never called
    def __init__(self, config: ModelConfig, shard: ModelShard):
        super().__init__()
        tp = shard.tp
        self.embed_tokens = Embedding(config.vocab_size, config.hidden_size, tp) if shard.holds_ends else None
        self.layers = nn.ModuleList(Gemma3DecoderLayer(config, i, tp) if i in shard.layers else MissingLayer()
                                    for i in range(config.num_hidden_layers))
        # one table per kind of layer, each gathered once per step
        self.rotary_emb = RotaryEmbedding(config.head_dim, config.max_position_embeddings, config.rope_theta,
                                          config.rope_scaling)
        local_theta = config.rope_theta if config.rope_local_theta is None else config.rope_local_theta
        self.rotary_emb_local = RotaryEmbedding(config.head_dim, config.max_position_embeddings, local_theta)
        self.norm = GemmaRMSNorm(config.hidden_size, config.norm_eps) if shard.holds_ends else None


class Gemma3ForCausalLM(DirectCall, nn.Module):
    packed_modules = LlamaForCausalLM.packed_modules  # the same q/k/v and gate/up names
    stream_width = 1  # the residual stream alone between pipeline stages

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        """shard: the part this rank holds (tensor / pipeline parallel); None: the whole model."""
        super().__init__()
        self.config = config
        self.shard = shard = shard or ModelShard.whole(config.num_hidden_layers)
        check_tensor_parallel(config, shard.tp.size)
        self.model = Gemma3Model(config, shard)
        self.lm_head = None
        if shard.holds_ends:
            self.lm_head = (TiedLMHead(self.model.embed_tokens) if config.tie_word_embeddings  # as released
                            else Linear(config.hidden_size, config.vocab_size // shard.tp.size, bias=False,
                                        is_lm_head=True, weight_slice=column_slice(config.vocab_size, shard.tp)))
        self.embed_scale = config.hidden_size**0.5
        self.softcap = config.final_logit_softcapping

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size]"""
        return self.final_norm(self.run_layers(self.embed(input_ids), positions, meta))

    # The pipeline stages' parts, as LlamaForCausalLM's; the stream is the residual stream alone.

    def embed(self, input_ids: torch.Tensor) -> tuple[torch.Tensor]:
        x = self.model.embed_tokens(input_ids)
        # NOTE: the scale is rounded to the model dtype first, as transformers does (sqrt(640) in bfloat16)
        return (x * torch.tensor(self.embed_scale, dtype=x.dtype),)

    def run_layers(self, stream: tuple[torch.Tensor], positions: torch.Tensor,
                   meta: AttentionMetadata) -> tuple[torch.Tensor]:
        (x,) = stream
        local_rope = self.model.rotary_emb_local(positions, x.dtype)
        global_rope = self.model.rotary_emb(positions, x.dtype)
        for i in self.shard.layers:
            x = self.model.layers[i](local_rope, global_rope, x, meta)
        return (x,)

    def final_norm(self, stream: tuple[torch.Tensor]) -> torch.Tensor:
        return self.model.norm(stream[0])

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """[n, hidden_size] -> [n, vocab_size]; only the positions that are sampled get here (tensor parallel:
        on tensor rank 0, None on the others)."""
        logits = self.shard.tp.gather_to_first(self.lm_head(hidden))
        if self.softcap is None or logits is None:
            return logits
        return torch.tanh(logits / self.softcap) * self.softcap

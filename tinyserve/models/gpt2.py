"""GPT-2: learned absolute positions, LayerNorm, fused c_attn, gelu_new MLP, tied LM head.

Pre-norm decoder: x += attn(ln_1(x)); x += mlp(ln_2(x)). Multi-head attention (as many K/V heads as
query heads) over the paged KV cache, no rotary. Parameter names are Hugging Face's, so the loader maps
them one to one; the checkpoint's c_attn already holds q, k and v stacked, so nothing is packed.
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
from tinyserve.layers.linear import Linear, TiedLMHead
from tinyserve.layers.norm import LayerNorm
from tinyserve.parallel.shard import ModelShard


class GPT2Attention(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.num_heads, self.head_dim = config.num_attention_heads, config.head_dim
        hidden = config.hidden_size
        self.c_attn = Linear(hidden, 3 * hidden)  # q, k, v stacked on the output dim
        self.c_proj = Linear(hidden, hidden)
        self.attn = Attention(self.num_heads, self.num_heads, self.head_dim, layer_index)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        num_tokens = x.shape[0]
        qkv = self.c_attn(x).view(num_tokens, 3, self.num_heads, self.head_dim)
        q, k, v = qkv.unbind(1)  # each [num_tokens, heads, head_dim]
        out = self.attn(q, k, v, meta)
        return self.c_proj(out.reshape(num_tokens, -1))


class GPT2MLP(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.c_fc = Linear(config.hidden_size, config.intermediate_size)
        self.c_proj = Linear(config.intermediate_size, config.hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.c_proj(ops.gelu_tanh(self.c_fc(x)))


class GPT2Block(DirectCall, nn.Module):
    def __init__(self, config: ModelConfig, layer_index: int):
        super().__init__()
        self.ln_1 = LayerNorm(config.hidden_size, config.norm_eps)
        self.attn = GPT2Attention(config, layer_index)
        self.ln_2 = LayerNorm(config.hidden_size, config.norm_eps)
        self.mlp = GPT2MLP(config)

    def forward(self, x: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), meta)
        return x + self.mlp(self.ln_2(x))


class GPT2Model(nn.Module):  # a container: never called
    def __init__(self, config: ModelConfig):
        super().__init__()
        self.wte = Embedding(config.vocab_size, config.hidden_size)
        self.wpe = Embedding(config.max_position_embeddings, config.hidden_size)
        self.h = nn.ModuleList(GPT2Block(config, i) for i in range(config.num_hidden_layers))
        self.ln_f = LayerNorm(config.hidden_size, config.norm_eps)


class GPT2LMHeadModel(DirectCall, nn.Module):
    packed_modules: dict[str, tuple[str, int]] = {}
    # Hugging Face stores these as Conv1D weights, [in, out]; loader/hf.py transposes them to nn.Linear's
    # [out, in]. (llama.cpp's converter already transposed them in GGUF files.)
    conv1d_weights = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
    # The original GPT-2 checkpoints were saved from the bare GPT2Model: their names lack this prefix.
    checkpoint_prefix = "transformer"

    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        super().__init__()
        if shard is not None and not shard.is_whole:
            raise ValueError("GPT-2 runs in one process: tensor and pipeline parallel take the llama, qwen2, "
                             "qwen3 and gemma3 families")
        self.config = config
        self.shard = ModelShard.whole(config.num_hidden_layers)
        self.transformer = GPT2Model(config)
        self.lm_head = (TiedLMHead(self.transformer.wte) if config.tie_word_embeddings
                        else Linear(config.hidden_size, config.vocab_size, bias=False, is_lm_head=True))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """input_ids, positions [num_tokens] -> final hidden states [num_tokens, hidden_size].
        Positions must be < max_position_embeddings: the table has no row past it."""
        x = self.transformer.wte(input_ids) + self.transformer.wpe(positions)
        for block in self.transformer.h:
            x = block(x, meta)
        return self.transformer.ln_f(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """[n, hidden_size] -> [n, vocab_size]"""
        return self.lm_head(hidden)

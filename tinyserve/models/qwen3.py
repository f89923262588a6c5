"""Qwen3 (dense): the Llama block with an RMSNorm over each head of q and of k, applied before the rotary
embedding (its weight is [head_dim], shared by all heads). q/k/v biases follow `attention_bias`, off in
the released checkpoints; head_dim is set explicitly and need not be hidden_size / num_heads.
"""

from __future__ import annotations

from dataclasses import replace

from tinyserve.config import ModelConfig
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.parallel.shard import ModelShard


class Qwen3ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        super().__init__(replace(config, qk_norm=True), shard)

"""Qwen2 (and Qwen2.5): the Llama block with a bias on the q, k and v projections (not on o_proj).

Everything else (GQA over the paged cache, rotary, SwiGLU, RMSNorm, tied or untied head) is llama.py's.
"""

from __future__ import annotations

from dataclasses import replace

from tinyserve.config import ModelConfig
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.parallel.shard import ModelShard


class Qwen2ForCausalLM(LlamaForCausalLM):
    def __init__(self, config: ModelConfig, shard: ModelShard | None = None):
        # Qwen2 checkpoints always carry q/k/v biases, whatever the config file says (it has no such key).
        super().__init__(replace(config, attention_bias=True), shard)

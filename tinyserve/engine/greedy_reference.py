"""The simplest correct generation: one sequence, greedy, its own small KV pool with a contiguous block
table. A yardstick for tests (the engine must produce the same tokens) and nothing more."""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.layers.attention_metadata import AttentionMetadata
from tinyserve.layers.kv_cache import allocate_kv_cache
from tinyserve.models.registry import device_and_dtype


@torch.inference_mode()
def forward_sequence(model: nn.Module, token_ids: list[int], block_size: int = 16,
                     step_tokens: int | None = None, cpu_attention: bool = False,
                     kv_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Logits at every position of one sequence: [len(token_ids), vocab] float32. In one prefill, or in
    steps of `step_tokens` tokens (1: as decoding computes them, which may take other kernels: with
    `cpu_attention`, decode attention runs in the engine's C++ kernel, else in torch ops). kv_dtype: the
    pool's (torch.int8: the 8-bit pool, read by the C++ kernel), the model's when None."""
    step = step_tokens or max(len(token_ids), 1)
    runner = _ReferenceRunner(model, len(token_ids), block_size, cpu_attention, kv_dtype)
    return torch.cat([runner.run(token_ids[i:i + step], i).float() for i in range(0, len(token_ids), step)])


@torch.inference_mode()
def greedy_generate(model: nn.Module, prompt_ids: list[int], max_new_tokens: int,
                    eos_token_ids: frozenset[int] = frozenset(), block_size: int = 16,
                    cpu_attention: bool = False, kv_dtype: torch.dtype | None = None) -> list[int]:
    runner = _ReferenceRunner(model, len(prompt_ids) + max_new_tokens, block_size, cpu_attention, kv_dtype)
    logits = runner.run(prompt_ids, 0)
    output: list[int] = []
    while True:
        next_id = int(logits[-1].argmax())
        output.append(next_id)
        if next_id in eos_token_ids or len(output) == max_new_tokens:
            return output
        logits = runner.run([next_id], len(prompt_ids) + len(output) - 1)


class _ReferenceRunner:
    def __init__(self, model: nn.Module, max_len: int, block_size: int, cpu_attention: bool,
                 kv_dtype: torch.dtype | None):
        self.device, dtype = device_and_dtype(model)
        self.model, self.block_size = model, block_size
        self.cpu_attention = cpu_attention
        num_blocks = -(-max_len // block_size)
        self.kv_caches = allocate_kv_cache(model.config, num_blocks, block_size, kv_dtype or dtype, self.device)
        self.block_table = list(range(num_blocks))

    def run(self, token_ids: list[int], start: int) -> torch.Tensor:
        n = len(token_ids)
        meta = AttentionMetadata.build(
            [list(range(start, start + n))],  # contiguous table: slot == position
            [[self.block_table]], seq_lens=[start + n], query_lens=[n], block_size=self.block_size,
            num_blocks=len(self.block_table), num_heads=self.model.config.num_attention_heads,
            num_kv_heads=self.model.config.num_key_value_heads, device=self.device, cpu_attention=self.cpu_attention,
            kv_caches=self.kv_caches, group_windows=[self.model.config.layer_sliding_windows()],
        )
        ids = torch.tensor(token_ids, device=self.device)
        positions = torch.arange(start, start + n, device=self.device)
        return self.model.compute_logits(self.model(ids, positions, meta))

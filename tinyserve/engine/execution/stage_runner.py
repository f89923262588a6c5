"""One rank's part of a step's forward: from a StepPlan to the final hidden states (stage 0) and the logits
(tensor rank 0 of stage 0).

In one process that is the model's forward over the whole batch. With pipeline stages, the step comes in
micro-batches: stage 0 embeds and runs its layers over each and sends it on, so that stage 1 works on
micro-batch 0 while stage 0 computes micro-batch 1; the last stage sends each back to stage 0, which
applies the final norm. With tensor parallel every rank of a stage runs the same layers on its shard, the
layers' collectives keeping them in step; the LM head's calls are made by every rank of stage 0 (each
holds a slice of the vocabulary), in the plan's order.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import torch
from torch import nn

from tinyserve.engine.execution.cuda_graphs import DecodeGraphs
from tinyserve.engine.execution.step_plan import MicroBatchPlan, StepPlan
from tinyserve.layers.attention_metadata import AttentionMetadata
from tinyserve.layers.kv_cache import KVCache, KVLayout
from tinyserve.layers.host_to_device import int64_tensor
from tinyserve.layers.ops import cpu_attention_applies, paged_kernel_applies
from tinyserve.models.registry import device_and_dtype
from tinyserve.parallel.launch import Ranks
from tinyserve.parallel.shard import kv_head_slice


class StageRunner:
    """Holds no state between steps besides the KV pool it is handed (owned by whoever allocated it)."""

    def __init__(self, model: nn.Module, kv_caches: Sequence[KVCache | None], layout: KVLayout, num_blocks: int,
                 block_size: int, ranks: Ranks | None = None):
        """kv_caches: one per layer of the whole model, None for the layers other stages hold."""
        self.model = model
        self.device, self.dtype = device_and_dtype(model)
        self.kv_caches, self.layout = tuple(kv_caches), layout
        self.num_blocks, self.block_size = num_blocks, block_size
        self.ranks = ranks
        config, tp = model.config, model.shard.tp
        self.num_heads = config.num_attention_heads // tp.size  # this rank's
        self.num_kv_heads, _ = kv_head_slice(config.num_key_value_heads, config.head_dim, tp)
        self.group_windows = layout.group_layer_windows(config.layer_sliding_windows())
        # The decode plan's kernel-or-torch choice, made once; the kernels build (or load) here, at
        # start-up, not in the first timed step.
        self.cpu_attention = cpu_attention_applies(self.device, self.dtype, config.head_dim)
        self.paged_kernel = paged_kernel_applies(self.device)
        if any(cache is not None and cache.quantized for cache in self.kv_caches) and not self.cpu_attention:
            raise ValueError(
                f"--kv-cache-dtype int8 needs our C++ decode kernel, which does not apply to this model here "
                f"(device {self.device}, dtype {self.dtype}, head_dim {config.head_dim}; it runs on CPU in float32 "
                f"or bfloat16, head_dim 16/32/64/128/256): use --kv-cache-dtype auto")
        self.decode_graphs: DecodeGraphs | None = None  # CUDA: decode steps replay these (capture_decode_graphs)
        # pipeline parallel: seconds computing, and seconds in forwards (the rest waits on other stages)
        self.busy_s = self.forward_s = 0.0

    def inputs(self, mb: MicroBatchPlan) -> tuple[torch.Tensor, torch.Tensor, AttentionMetadata]:
        """A micro-batch's token ids, positions and attention metadata, on the device."""
        meta = AttentionMetadata.build(mb.slot_mappings, mb.block_tables, mb.seq_lens, mb.query_lens,
                                       block_size=self.block_size, num_blocks=self.num_blocks,
                                       num_heads=self.num_heads, num_kv_heads=self.num_kv_heads, device=self.device,
                                       cpu_attention=self.cpu_attention, kv_caches=self.kv_caches,
                                       paged_kernel=self.paged_kernel, layer_groups=self.layout.layer_groups,
                                       group_windows=self.group_windows)
        return int64_tensor(mb.input_ids, self.device), int64_tensor(mb.positions, self.device), meta

    def forward(self, plan: StepPlan) -> torch.Tensor | None:
        """[num_tokens, hidden] final hidden states of the step's tokens, in plan order, on stage 0; None on
        the other stages."""
        if self.ranks is None or self.ranks.topology.pp_size == 1:
            if self.decode_graphs is not None and len(plan.micro_batches) == 1:
                if self.decode_graphs.applies(plan.micro_batches[0]):
                    return self.decode_graphs.run(plan.micro_batches[0])
            hidden = [self.model(*self.inputs(mb)) for mb in plan.micro_batches]
            return hidden[0] if len(hidden) == 1 else torch.cat(hidden)
        return self._pipeline(plan.micro_batches)

    def capture_decode_graphs(self, max_num_seqs: int, max_model_len: int, capture: bool = True) -> None:
        """Decode steps from now on replay CUDA graphs (engine/execution/cuda_graphs.py); the pools hold the scratch
        block past num_blocks. capture=False: the same buffers, run eagerly (tests on CPU)."""
        self.decode_graphs = DecodeGraphs(self.model, self.kv_caches, self.layout, self.group_windows,
                                          self.num_blocks, self.block_size, max_num_seqs, max_model_len, self.device)
        self.decode_graphs.capture(capture)

    def _pipeline(self, micro_batches: list[MicroBatchPlan]) -> torch.Tensor | None:
        topology, channel, model = self.ranks.topology, self.ranks.channel, self.model
        stage, last = topology.stage, topology.pp_size - 1
        start = time.perf_counter()
        hidden = []
        for mb in micro_batches:
            compute_start = time.perf_counter()
            ids, positions, meta = self.inputs(mb)  # built before the wait for the previous stage
            if stage != 0:
                self.busy_s += time.perf_counter() - compute_start
                shapes = [(len(mb.input_ids), model.config.hidden_size)] * model.stream_width
                stream = channel.recv(shapes, self.dtype, self.device, stage - 1)
                compute_start = time.perf_counter()
            stream = model.run_layers(model.embed(ids) if stage == 0 else stream, positions, meta)
            self.busy_s += time.perf_counter() - compute_start
            channel.send(stream, stage + 1 if stage < last else 0)
        if stage == 0:
            for mb in micro_batches:
                shapes = [(len(mb.input_ids), model.config.hidden_size)] * model.stream_width
                stream = channel.recv(shapes, self.dtype, self.device, last)
                compute_start = time.perf_counter()
                hidden.append(model.final_norm(stream))
                self.busy_s += time.perf_counter() - compute_start
        channel.wait_sent()
        self.forward_s += time.perf_counter() - start
        if stage != 0:
            return None
        return hidden[0] if len(hidden) == 1 else torch.cat(hidden)

    def describe_bubble(self) -> str:
        """How much of its pipelined forwards this rank spent computing (the rest waited on other stages)."""
        share = self.busy_s / self.forward_s if self.forward_s else 0.0
        return (f"computed {self.busy_s:.2f} s of {self.forward_s:.2f} s in pipelined forwards "
                f"({share:.0%}; waiting {1 - share:.0%})")

    def logits(self, hidden: torch.Tensor, rows: list[int]) -> torch.Tensor | None:
        """[len(rows), vocab] float32 logits of hidden's rows (on tensor rank 0; None on the others)."""
        return self.model.compute_logits(hidden[int64_tensor(rows, hidden.device)])

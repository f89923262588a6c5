"""CUDA graphs for decode steps: the model's forward captured once per batch-size bucket at start-up, and
replayed for every decode-only step (vLLM's and nano-vllm's scheme).

A decode step of a small model on a GPU is hundreds of small kernels, and the time goes into launching
them from Python, not into running them. A graph launches the whole forward in one call. It replays
fixed addresses and shapes, so its inputs live in static buffers sized to the largest bucket: the step's
values are written into a pinned host mirror, copied over in one H2D copy, and the step is padded up to
the bucket. A padded row is a one-token sequence at position 0 whose K/V slot and block table point at
a scratch block the pool holds past the BlockManager's blocks, so padding never writes or reads a real
sequence's KV. Attention is the Triton kernel (layers/kernels/triton_attention.py), which reads lengths and
tables from the device and so replays correctly for any contents.

Only decode-only steps of one process replay (prefill chunks and tensor / pipeline parallel run eagerly),
up to the largest bucket's rows; `--enforce-eager` turns graphs off. The logits and the sampler run after
the replay, eagerly, on the rows that sample.

`capture=False` builds the same buffers and fills and runs the forward eagerly over them: how the padding
and the scratch block are tested on a CPU.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch
from torch import nn

from tinyserve.engine.execution.step_plan import MicroBatchPlan
from tinyserve.layers.attention_metadata import AttentionMetadata, GroupTables, check_tables, padded_tables
from tinyserve.layers.kv_cache import KVCache, KVLayout
from tinyserve.layers.ops import paged_kernel_applies

logger = logging.getLogger(__name__)


def decode_graphs_apply(device: torch.device, enforce_eager: bool, has_ranks: bool) -> bool:
    """Whether decode steps replay graphs: on CUDA, in one process, with the Triton attention kernel, unless
    --enforce-eager."""
    return device.type == "cuda" and not enforce_eager and not has_ranks and paged_kernel_applies(device)


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, then every multiple of 8, up to the first that holds max_num_seqs: padding costs at most
    7 rows past 8, and each bucket is one more graph to capture."""
    sizes = [1, 2, 4, 8]
    while sizes[-1] < max_num_seqs:
        sizes.append(sizes[-1] + 8)
    return [s for s in sizes if s < max_num_seqs] + [next(s for s in sizes if s >= max_num_seqs)]


class DecodeGraphs:
    """The static input buffers, one graph (and its output) per bucket, and the fill of a step into them."""

    def __init__(self, model: nn.Module, kv_caches: Sequence[KVCache], layout: KVLayout,
                 group_windows: Sequence[frozenset[int | None]], num_blocks: int, block_size: int,
                 max_num_seqs: int, max_model_len: int, device: torch.device):
        """num_blocks: the BlockManager's; the pools hold one more, the scratch block `num_blocks`."""
        assert all(cache.key.shape[1] == num_blocks + 1 for cache in kv_caches if cache is not None)
        self.model, self.layout, self.device = model, layout, device
        self.num_blocks, self.block_size, self.scratch = num_blocks, block_size, num_blocks
        self.windows = [next(iter(w)) if len(w) == 1 else None for w in group_windows]
        self.sizes = graph_batch_sizes(max_num_seqs)
        rows, self.width = self.sizes[-1], -(-max_model_len // block_size)
        num_groups = layout.num_groups
        # one int64 buffer: ids, positions, seq_lens, query starts (rows + 1), each group's slots, then each
        # group's tables [rows, width]; a step copies the part before the tables and its rows of each table
        self.head = rows * (4 + num_groups) + 1
        numel = self.head + num_groups * rows * self.width
        self.host = torch.zeros(numel, dtype=torch.int64, pin_memory=device.type == "cuda")
        self.static = torch.zeros(numel, dtype=torch.int64, device=device)
        self._copied: torch.cuda.Event | None = None  # the last H2D copy, before the host mirror is rewritten
        self.host_views, self.static_views = self._views(self.host, rows), self._views(self.static, rows)
        self.host_views["query_start"].copy_(torch.arange(rows + 1))  # every row one query token
        self.static.copy_(self.host)
        self.metas = {size: self._meta(size, kv_caches) for size in self.sizes}
        self.graphs: dict[int, torch.cuda.CUDAGraph | None] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def _views(self, buffer: torch.Tensor, rows: int) -> dict:
        views, offset = {}, 0
        for name, count in (("ids", rows), ("positions", rows), ("seq_lens", rows), ("query_start", rows + 1)):
            views[name], offset = buffer[offset : offset + count], offset + count
        num_groups = self.layout.num_groups
        views["slots"] = [buffer[offset + g * rows : offset + (g + 1) * rows] for g in range(num_groups)]
        tables = buffer[self.head :].view(num_groups, rows, self.width)
        views["tables"] = [tables[g] for g in range(num_groups)]
        return views

    def _meta(self, size: int, kv_caches: Sequence[KVCache]) -> AttentionMetadata:
        views = self.static_views
        groups = tuple(GroupTables(slots[:size], tables[:size], {window: ()})
                       for slots, tables, window in zip(views["slots"], views["tables"], self.windows, strict=True))
        return AttentionMetadata(
            groups=groups, layer_groups=self.layout.layer_groups, seq_lens=views["seq_lens"][:size],
            seq_lens_host=[1] * size, query_lens_host=[1] * size, num_decodes=size, block_size=self.block_size,
            cpu_attention=False, kv_caches=tuple(kv_caches), paged_kernel=True,
            query_start_loc=views["query_start"][: size + 1], max_query_len=1)

    def applies(self, mb: MicroBatchPlan) -> bool:
        """A decode-only step that fits the largest bucket and the tables' width (and graphs were captured)."""
        return (bool(self.graphs) and len(mb.query_lens) <= self.sizes[-1] and all(n == 1 for n in mb.query_lens)
                and max(mb.seq_lens) <= self.width * self.block_size)

    def capture(self, capture: bool = True) -> None:
        """One graph per bucket, largest first, sharing one memory pool (a smaller graph's tensors fit in
        what the larger left), each after one eager run on a side stream (Triton compiles, cuBLAS picks its
        kernels there). Logs the buckets, the time and the memory. capture=False: eager over the buffers."""
        start = time.perf_counter()
        if not capture:
            self.graphs = dict.fromkeys(self.sizes)
            return
        torch.cuda.synchronize(self.device)
        before = torch.cuda.memory_reserved(self.device)
        try:
            self._capture_all()
        except RuntimeError as error:  # a model whose forward cannot be captured still serves, eagerly
            self.graphs, self.outputs = {}, {}
            logger.warning("CUDA graph capture failed, decode steps run eagerly: %s", error)
            return
        torch.cuda.synchronize(self.device)
        logger.info("captured CUDA graphs of decode steps for batch sizes %s in %.1f s, %.0f MiB",
                    self.sizes, time.perf_counter() - start,
                    (torch.cuda.memory_reserved(self.device) - before) / 2**20)

    def _capture_all(self) -> None:
        pool = torch.cuda.graph_pool_handle()
        side = torch.cuda.Stream(self.device)
        for size in reversed(self.sizes):
            self._fill_padding(size)
            args = (self.static_views["ids"][:size], self.static_views["positions"][:size], self.metas[size])
            side.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(side):
                self.model(*args)
            torch.cuda.current_stream(self.device).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.model(*args)
            self.graphs[size] = graph

    def _fill_padding(self, size: int) -> None:
        """Every row of a bucket a padding row (for the capture's warm-up)."""
        self._fill(MicroBatchPlan([], [], [[] for _ in self.windows], [[] for _ in self.windows], [], []), size)

    def run(self, mb: MicroBatchPlan) -> torch.Tensor:
        """[num_seqs, hidden] final hidden states of a decode-only step (where applies())."""
        num_seqs = len(mb.query_lens)
        size = next(s for s in self.sizes if s >= num_seqs)
        self._fill(mb, size)
        graph = self.graphs[size]
        if graph is None:  # capture=False
            views = self.static_views
            return self.model(views["ids"][:size], views["positions"][:size], self.metas[size])[:num_seqs]
        graph.replay()
        return self.outputs[size][:num_seqs]

    def _fill(self, mb: MicroBatchPlan, size: int) -> None:
        """The step's rows, then padding rows up to `size`, into the host mirror and over to the device."""
        if self._copied is not None and not self._copied.query():
            self._copied.synchronize()  # the previous step's copy must have read the mirror (long done, as a rule)
        n, views = len(mb.query_lens), self.host_views
        views["ids"][:n] = torch.tensor(mb.input_ids, dtype=torch.int64)
        views["positions"][:n] = torch.tensor(mb.positions, dtype=torch.int64)
        views["seq_lens"][:n] = torch.tensor(mb.seq_lens, dtype=torch.int64)
        views["ids"][n:size] = 0
        views["positions"][n:size] = 0
        views["seq_lens"][n:size] = 1
        for g, window in enumerate(self.windows):
            slots, tables = views["slots"][g], views["tables"][g]
            if n:
                step_slots = torch.tensor(mb.slot_mappings[g], dtype=torch.int64)
                step_tables = padded_tables(mb.block_tables[g], mb.seq_lens, mb.query_lens, self.block_size, window)
                check_tables(step_slots, step_tables, [len(t) for t in mb.block_tables[g]], mb.seq_lens,
                             mb.query_lens, self.block_size, self.num_blocks)
                slots[:n] = step_slots
                tables[:n, : step_tables.shape[1]] = step_tables
            slots[n:size] = self.scratch * self.block_size
            tables[n:size, 0] = self.scratch
        self.static[: self.head].copy_(self.host[: self.head], non_blocking=True)
        for host_tables, static_tables in zip(views["tables"], self.static_views["tables"], strict=True):
            static_tables[:size].copy_(host_tables[:size], non_blocking=True)
        if self.device.type == "cuda":
            self._copied = torch.cuda.Event()
            self._copied.record()

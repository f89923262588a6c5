"""Tensor / pipeline parallel start-up, the same on every rank: join the group, choose this rank's shard of
the model, load it, and size its part of the KV pool.

- The shard: every rank reads the checkpoint's header, weighs each layer (its parameters at the load dtype)
  and reports its memory; the stage split (parallel/dispatch.py) follows from those, the same on every rank.
- The pool: each rank's budget holds some number of blocks of its own layers' K/V heads; the group takes the
  least, so that a block id names the same tokens on every rank and rank 0's block manager speaks for all.

Rank 0 starts the other ranks on this machine (as subprocesses running `tinyserve worker`, its engine
config handed over as JSON) unless a launcher such as torchrun started them.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import socket
import sys
import zlib
from dataclasses import dataclass

import torch

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, ParallelConfig, SchedulerConfig, SpeculativeConfig
from tinyserve.engine.memory.sizing import held_weight_bytes, host_free_bytes, rank_num_blocks
from tinyserve.layers.kv_cache import KVCache, KVLayout, kv_cache_slots, layer_caches
from tinyserve.loader.model_loader import LoadedModel, load_model_in_pieces, resolve_device, weight_bytes_by_layer
from tinyserve.parallel.dispatch import MIB, split_layers
from tinyserve.parallel.launch import Ranks, join_group, rank_device, start_local_ranks
from tinyserve.parallel.shard import ModelShard, kv_head_slice
from tinyserve.types import Job

logger = logging.getLogger(__name__)

CONFIG_ENV = "TINYSERVE_ENGINE_CONFIG"  # a started rank's engine config, as JSON (cli.py reads it)


def config_to_json(config: EngineConfig) -> str:
    return json.dumps(dataclasses.asdict(config))


def config_from_json(text: str) -> EngineConfig:
    fields = json.loads(text)
    nested = {"cache": CacheConfig, "scheduler": SchedulerConfig, "speculative": SpeculativeConfig,
              "parallel": ParallelConfig}
    return EngineConfig(**{k: nested[k](**v) if k in nested else v for k, v in fields.items()})


def join(config: EngineConfig) -> Ranks:
    """Rank 0: start the other ranks unless a launcher did; every rank: join the group."""
    parallel, started = config.parallel, []
    if config.speculative.method == "draft":
        raise ValueError("speculative decoding with a draft model runs in one process: without "
                         "--tensor-parallel-size / --pipeline-parallel-size, or with --speculative-method ngram")
    if parallel.master_addr is None:
        command = [sys.executable, "-m", "tinyserve.cli", "worker"]
        parallel, started = start_local_ranks(parallel, command, {CONFIG_ENV: config_to_json(config)})
    device = rank_device(resolve_device(config.device), parallel)
    try:
        ranks = join_group(parallel, device, started_here=bool(started))
    except BaseException:
        for proc in started:
            proc.kill()
        raise
    ranks.started = started
    return ranks


def _memory_id(device: torch.device) -> int:
    """Ranks with the same id draw on the same memory: a host's (CPU), or one GPU."""
    return zlib.crc32(f"{socket.gethostname()}/{device}".encode())


def choose_shard(ranks: Ranks, config: ModelConfig, dtype: torch.dtype, device: torch.device) -> ModelShard:
    """This rank's layers: the stage split from each layer's bytes and each stage's memory (the least of its
    ranks', times its ranks: each holds 1 / T of the stage). Ranks on one memory (a host's CPU ranks) share
    it; a CPU rank also takes an equal share of its host's cores."""
    topology = ranks.topology
    free = torch.cuda.mem_get_info(device)[0] if device.type == "cuda" else host_free_bytes()
    reports = ranks.host.all_gather_ints([_memory_id(device), free])
    sharing = [sum(1 for other, _ in reports if other == host) for host, _ in reports]
    budgets = [free // n for (_, free), n in zip(reports, sharing)]
    if device.type == "cpu":
        ranks.threads_before = torch.get_num_threads()
        torch.set_num_threads(max(1, min(torch.get_num_threads(), (os.cpu_count() or 1) // sharing[topology.rank])))
    stage_budgets = [topology.tp_size * min(budgets[topology.rank_at(s, t)] for t in range(topology.tp_size))
                     for s in range(topology.pp_size)]
    layer_bytes, end_bytes = weight_bytes_by_layer(config, dtype)
    split = split_layers(layer_bytes, end_bytes, stage_budgets)
    if topology.rank == 0 and topology.pp_size > 1:
        logger.info("pipeline stages (layers by weight bytes and memory): %s", split.describe(stage_budgets))
    return ModelShard(config.num_hidden_layers, split.layers[topology.stage], ranks.tp)


def load_shard(config: EngineConfig, ranks: Ranks) -> Job[LoadedModel]:
    """This rank's shard of config.model, loaded tensor by tensor (only its own parts are read)."""
    device = ranks.device
    loaded = yield from load_model_in_pieces(
        config.model, config.dtype, str(device), config.quantization,
        shard_for=lambda model_config, dtype: choose_shard(ranks, model_config, dtype, device))
    shard = loaded.model.shard
    logger.info("rank %d: layers %d-%d%s, tensor rank %d of %d: %.1f MiB of weights",
                ranks.topology.rank, shard.layers.start, shard.layers.stop - 1,
                " with the embedding, final norm and LM head" if shard.holds_ends else "",
                shard.tp.rank, shard.tp.size, held_weight_bytes(loaded.model) / MIB)
    return loaded


@dataclass
class RankPool:
    layout: KVLayout
    num_blocks: int
    kv_caches: list[KVCache | None]  # per layer of the whole model; None for the layers other stages hold


def agree_num_blocks(config: EngineConfig, ranks: Ranks, loaded: LoadedModel,
                     kv_dtype: torch.dtype) -> tuple[KVLayout, int]:
    """The pool's layout and the blocks every rank's budget holds (the least of them), in a pool of kv_dtype."""
    layout = KVLayout.for_windows(loaded.config.layer_sliding_windows())
    shard = loaded.model.shard
    num_kv_heads, _ = kv_head_slice(loaded.config.num_key_value_heads, loaded.config.head_dim, shard.tp)
    own = rank_num_blocks(config.cache, loaded.config, layout, shard.layers, num_kv_heads, kv_dtype, ranks.device)
    return layout, ranks.host.all_reduce_min(own)


def rank_kv_slots(loaded: LoadedModel, layout: KVLayout, num_blocks: int, block_size: int, kv_dtype: torch.dtype,
                  device: torch.device):
    """This rank's pool slots, one at a time (kv_cache_slots): its KV heads, its layers' slots."""
    shard = loaded.model.shard
    num_kv_heads, _ = kv_head_slice(loaded.config.num_key_value_heads, loaded.config.head_dim, shard.tp)
    return kv_cache_slots(loaded.config, layout, num_blocks, block_size, kv_dtype, device, num_kv_heads, shard.layers)


def allocate_pool(config: EngineConfig, ranks: Ranks, loaded: LoadedModel, kv_dtype: torch.dtype) -> RankPool:
    layout, num_blocks = agree_num_blocks(config, ranks, loaded, kv_dtype)
    slots = dict(rank_kv_slots(loaded, layout, num_blocks, config.cache.block_size, kv_dtype, ranks.device))
    return RankPool(layout, num_blocks, layer_caches(layout, slots))

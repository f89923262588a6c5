"""A rank other than 0: its shard of the model and of the KV pool, and rank 0's steps, until rank 0 stops.

It schedules and samples nothing: each step arrives as a StepPlan (engine/execution/step_plan.py), the same rank 0
computes from, and the rank runs its part (StageRunner): its layers, its stage's sends, and on stage 0
its slices of the LM-head calls. It returns nothing but what those collectives carry. Rank 0 gone (its
connections closed) or a collective timed out, it exits rather than wait.
"""

from __future__ import annotations

import logging
import signal

import torch

from tinyserve.config import EngineConfig
from tinyserve.engine.execution import rank_setup, step_plan
from tinyserve.engine.memory.sizing import kv_pool_dtype
from tinyserve.engine.execution.stage_runner import StageRunner
from tinyserve.engine.execution.step_plan import MessageKind
from tinyserve.models.registry import device_and_dtype
from tinyserve.parallel.group import RankFailure
from tinyserve.types import run_to_end

logger = logging.getLogger(__name__)


def run_worker(config: EngineConfig) -> int:
    """The process's exit code: 0 when rank 0 said stop, 1 when the group broke."""
    # a terminal's Ctrl-C is the server's to handle: it drains with this rank's help, then says stop
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    ranks = rank_setup.join(config)
    try:
        loaded = run_to_end(rank_setup.load_shard(config, ranks))
        kv_dtype = kv_pool_dtype(config.cache, device_and_dtype(loaded.model)[1])
        pool = rank_setup.allocate_pool(config, ranks, loaded, kv_dtype)
        stage = StageRunner(loaded.model, pool.kv_caches, pool.layout, pool.num_blocks, config.cache.block_size,
                            ranks)
        _serve_steps(stage, ranks)
        if ranks.topology.pp_size > 1:
            logger.info("rank %d: %s", config.parallel.rank, stage.describe_bubble())
    except RankFailure as exc:
        logger.error("rank %d: %s; exiting", config.parallel.rank, exc)
        return 1
    finally:
        ranks.close(wait_s=0.0)
    return 0


@torch.inference_mode()
def _serve_steps(stage: StageRunner, ranks) -> None:
    holds_logits = ranks.topology.stage == 0
    while True:
        kind, plan = step_plan.receive(ranks.host)
        if kind == MessageKind.STOP:
            return
        if kind == MessageKind.HEARTBEAT:
            continue
        hidden = stage.forward(plan)
        if holds_logits:  # this rank's vocabulary slice of each LM-head call, in rank 0's order
            for rows in plan.logit_calls:
                stage.logits(hidden, rows)

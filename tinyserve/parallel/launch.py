"""Bringing the ranks together: start the other ranks on this machine (or find them started by a launcher
such as torchrun), join torch.distributed's group, and make the groups each part of a step uses.

Self-started ranks are plain subprocesses running the engine's worker command, with their rank and the
rendezvous address in their environment; they find each other through torch.distributed's TCP store on a
free loopback port. Nothing here speaks a protocol of its own.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import subprocess
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

from tinyserve.config import ParallelConfig
from tinyserve.parallel.group import HostGroup, StageChannel, TensorParallelGroup, Topology

logger = logging.getLogger(__name__)

# how long a rank waits for rank 0's next message (the step collectives keep ParallelConfig.timeout_s)
MESSAGE_WAIT = datetime.timedelta(days=7)

# the environment a started rank reads (cli.py's `worker` command), as torchrun names it
RANK_ENV = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclass
class Ranks:
    """This process's membership: who it is and the groups it computes with."""

    topology: Topology
    device: torch.device  # the device this rank computes on
    tp: TensorParallelGroup
    host: HostGroup
    channel: StageChannel
    started: list[subprocess.Popen] = field(default_factory=list)  # ranks this process started (rank 0 only)
    # CPU: torch's compute threads before this rank took its share of the host's cores, given back on close
    # (rank 0 runs in the caller's process, which may go on to run an engine of its own)
    threads_before: int | None = None

    def close(self, wait_s: float = 10.0) -> None:
        """Leave the group, which closes this rank's connections (a rank still waiting on one then fails
        and exits), then wait for the ranks this process started, killing any still there after wait_s."""
        if dist.is_initialized():
            dist.destroy_process_group()
        if self.threads_before is not None:
            torch.set_num_threads(self.threads_before)
            self.threads_before = None
        for proc in self.started:
            try:
                proc.wait(timeout=wait_s)
            except subprocess.TimeoutExpired:
                logger.warning("rank process %d did not exit: killing it", proc.pid)
                proc.kill()
                proc.wait()


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_local_ranks(config: ParallelConfig, command: list[str], env: dict[str, str]) -> tuple[ParallelConfig,
                                                                                                list[subprocess.Popen]]:
    """Start ranks 1 .. world_size - 1 on this machine, each `command` with `env` and its rank, at a free
    loopback port; returns rank 0's config (with the address) and the processes."""
    from dataclasses import replace

    config = replace(config, master_addr="127.0.0.1", master_port=free_port(), rank=0, local_rank=0)
    procs = []
    for rank in range(1, config.world_size):
        rank_env = {**os.environ, **env, "RANK": str(rank), "LOCAL_RANK": str(rank),
                    "WORLD_SIZE": str(config.world_size), "MASTER_ADDR": config.master_addr,
                    "MASTER_PORT": str(config.master_port)}
        # a session of its own: a terminal's Ctrl-C reaches the server, which drains with its ranks' help
        procs.append(subprocess.Popen(command, env=rank_env, start_new_session=True))
    return config, procs


def rank_device(device: torch.device, config: ParallelConfig) -> torch.device:
    """A rank's device: on CUDA its own GPU (by local rank) unless one was named."""
    if device.type == "cuda" and device.index is None and config.world_size > 1:
        return torch.device("cuda", config.local_rank if config.local_rank is not None else config.rank)
    return device


def join_group(config: ParallelConfig, device: torch.device, started_here: bool) -> Ranks:
    """Join the group (every rank calls this, with the same sizes) and make the groups: one per pipeline
    stage for the tensor-parallel collectives, gloo for host messages. started_here: this process started
    the others (rank 0 then hosts the rendezvous store at the address it chose); otherwise the ranks were
    started with torchrun's environment (RANK_ENV), which `env://` reads (and under torchrun, finds the
    agent's store through)."""
    assert config.master_addr is not None and config.master_port is not None
    backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    init_method = f"tcp://{config.master_addr}:{config.master_port}" if started_here else "env://"
    dist.init_process_group(backend, init_method=init_method, rank=config.rank, world_size=config.world_size,
                            timeout=datetime.timedelta(seconds=config.timeout_s))
    topology = Topology(config.rank, config.tensor_parallel_size, config.pipeline_parallel_size)
    tp = TensorParallelGroup()
    for stage in range(topology.pp_size):  # every rank creates every group, in the same order
        members = [topology.rank_at(stage, t) for t in range(topology.tp_size)]
        group = dist.new_group(members) if topology.tp_size > 1 else None
        if stage == topology.stage and group is not None:
            tp = TensorParallelGroup(topology.tp_rank, topology.tp_size, group, first_rank=members[0])
    # The step messages' own group: a rank waits there for rank 0's next step, however long the server idles
    # (a dead rank 0 still ends the wait at once: its connections close).
    host = HostGroup(dist.new_group(backend="gloo", timeout=MESSAGE_WAIT))
    logger.info("rank %d of %d joined (%s): pipeline stage %d of %d, tensor rank %d of %d", config.rank,
                config.world_size, backend, topology.stage, topology.pp_size, topology.tp_rank, topology.tp_size)
    return Ranks(topology, device, tp, host, StageChannel(topology))

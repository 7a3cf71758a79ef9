"""Tensor-parallel ranks 1..N-1 of an engine, one process each (rank 0 is the engine itself).

The scheduler runs once, on rank 0. Each step rank 0 broadcasts the plain ``SchedulerOutput``
(torch.distributed's object broadcast: gloo on CPU, NCCL on GPU, one GPU per rank); every rank
applies the same cache operations to its share of the KV cache and runs the same forward pass
over its share of the heads, the row-parallel projections all-reducing their partial sums; rank
0 alone samples.

The ranks are started either by the engine (``spawn``, on this machine) or by a launcher such as
``torchrun``, on one machine or several: then every process runs ``kvserve serve`` with the
launcher's ``RANK``/``WORLD_SIZE``/``LOCAL_RANK``/``MASTER_ADDR``/``MASTER_PORT`` set, rank 0
serves and the others run ``run_rank``. A rank that has died is noticed before the next step
is sent (``EngineDeadError``), and a collective waiting on a rank that died during a step gives
up after ``TIMEOUT``. The steps go out over a group of their own, on which ranks wait for rank
0 as long as ``IDLE`` (the engine may sit idle, or load a large model first).
"""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os
import socket
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.core.config import CacheConfig
from engine.core.errors import EngineDeadError
from engine.core.scheduler import SchedulerOutput
from engine.worker.config import RunnerConfig
from engine.worker.model_runner import ModelRunner
from models.tensor_parallel import TPRank

log = logging.getLogger("kvserve.engine")
TIMEOUT = datetime.timedelta(seconds=60)
IDLE = datetime.timedelta(days=365)
LAUNCHER_ENV = ("RANK", "WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT")


@dataclasses.dataclass(frozen=True)
class Launch:
    """Where a rank runs and how it finds the others."""

    tp: TPRank
    local_rank: int  # its GPU on this machine
    ranks_here: int  # ranks sharing this machine's CPU cores
    init_method: str


def launched(size: int) -> Launch | None:
    """This process's place when a launcher (torchrun) started the ranks, from the environment
    it sets; None when none did. Its world size must be ``size`` (--tensor-parallel-size)."""
    env = os.environ
    if not all(k in env for k in LAUNCHER_ENV):
        return None
    world = int(env["WORLD_SIZE"])
    if world != size:
        raise ValueError(
            f"the launcher started {world} ranks (WORLD_SIZE) but --tensor-parallel-size is "
            f"{size}; they must be equal"
        )
    local = int(env.get("LOCAL_RANK", 0))
    here = int(env.get("LOCAL_WORLD_SIZE", world))
    return Launch(TPRank(int(env["RANK"]), world), local, here, "env://")


def rank_device(config: RunnerConfig, local_rank: int) -> torch.device:
    """A rank's device: on CUDA the machine's GPU ``local_rank`` unless one is named."""
    device = config.torch_device
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", local_rank)
    return device


def threads_per_rank(ranks_here: int) -> int:
    return max(1, (os.cpu_count() or 1) // ranks_here)


def _init(launch: Launch, device: torch.device) -> dist.ProcessGroup:
    """Joins the ranks; returns the group the steps are sent over."""
    if device.type == "cuda":
        if device.index is not None:  # rank 0 runs on the current GPU
            torch.cuda.set_device(device)
    else:
        torch.set_num_threads(threads_per_rank(launch.ranks_here))
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=launch.init_method, rank=launch.tp.rank, world_size=launch.tp.size,
        timeout=TIMEOUT,
    )  # fmt: skip
    return dist.new_group(timeout=IDLE)


def _broadcast(group: dist.ProcessGroup, obj=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0, group=group)
    return box[0]


class Workers:
    """Starts ranks 1..size-1, unless a launcher has, and joins rank 0 (this process) to their
    group."""

    def __init__(self, config: RunnerConfig):
        size = config.tensor_parallel_size
        launch = launched(size)
        self.procs = []
        if launch is None:
            with socket.socket() as s:
                s.bind(("127.0.0.1", 0))
                port = s.getsockname()[1]
            launch = Launch(TPRank(0, size), 0, size, f"tcp://127.0.0.1:{port}")
            ctx = mp.get_context("spawn")
            self.procs = [
                ctx.Process(target=run_rank, args=(config, _rank(launch, r)), daemon=True)
                for r in range(1, size)
            ]
            for p in self.procs:
                p.start()
        self.group = _init(launch, config.torch_device)
        self._finalizer = weakref.finalize(self, _stop, self.procs, self.group)

    def start(self, cache_config: CacheConfig) -> None:
        """Every rank allocates the same pools as rank 0."""
        _broadcast(self.group, cache_config)

    def step(self, out: SchedulerOutput) -> None:
        dead = [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            codes = [self.procs[r - 1].exitcode for r in dead]
            raise EngineDeadError(
                f"tensor-parallel rank(s) {dead} exited (codes {codes}); the engine stops"
            )
        try:
            _broadcast(self.group, out)
        except (RuntimeError, dist.DistError) as e:  # a launched rank is gone
            raise EngineDeadError(
                f"tensor-parallel ranks unreachable ({e}); the engine stops"
            ) from e

    def stop(self) -> None:
        self._finalizer()


def _rank(launch: Launch, rank: int) -> Launch:
    return dataclasses.replace(launch, tp=TPRank(rank, launch.tp.size), local_rank=rank)


def _stop(procs: list, group: dist.ProcessGroup) -> None:
    if all(p.is_alive() for p in procs):
        try:
            _broadcast(group)
        except Exception:  # a rank is gone: the others are terminated below
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    if dist.is_initialized():
        dist.destroy_process_group()


def run_rank(config: RunnerConfig, launch: Launch) -> None:
    """A rank other than 0: runs the steps rank 0 sends until it sends None."""
    device = rank_device(config, launch.local_rank)
    group = _init(launch, device)
    log.info("tensor-parallel rank %d of %d on %s", launch.tp.rank, launch.tp.size, device)
    runner = ModelRunner(dataclasses.replace(config, device=str(device)), launch.tp)
    runner.allocate_kv_cache(_broadcast(group))
    while (out := _broadcast(group)) is not None:
        runner.execute(out, sample=False)
    dist.destroy_process_group()

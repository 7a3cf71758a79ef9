"""Tensor-parallel ranks 1..N-1 of an engine, one process each (rank 0 is the engine itself).

The scheduler runs once, on rank 0. Each step rank 0 broadcasts the plain ``SchedulerOutput``
(torch.distributed's object broadcast: gloo on CPU, NCCL on GPU); every rank applies the same
cache operations to its share of the KV cache and runs the same forward pass over its share of
the heads, the row-parallel projections all-reducing their partial sums; rank 0 alone samples.
A rank that has died is noticed before the next step is sent (``EngineDeadError``), and a
collective waiting on a rank that died during a step gives up after ``TIMEOUT``.
"""

from __future__ import annotations

import datetime
import logging
import os
import socket
import weakref

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from engine.args import EngineArgs
from engine.config import CacheConfig
from engine.errors import EngineDeadError
from engine.model_runner import build_runner, resolve_device
from engine.scheduler import SchedulerOutput
from models.tensor_parallel import TPRank

log = logging.getLogger("kvserve.engine")
TIMEOUT = datetime.timedelta(seconds=60)


def threads_per_rank(size: int) -> int:
    return max(1, (os.cpu_count() or 1) // size)


def _init(rank: int, size: int, port: int, device: torch.device) -> None:
    backend = "nccl" if device.type == "cuda" else "gloo"
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=size,
        timeout=TIMEOUT,
    )  # fmt: skip


def _broadcast(obj=None):
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


class Workers:
    """Starts ranks 1..size-1 and joins rank 0 (this process) to their group."""

    def __init__(self, args: EngineArgs, device: torch.device):
        size = args.tensor_parallel_size
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        ctx = mp.get_context("spawn")
        self.procs = [
            ctx.Process(target=_worker, args=(args, TPRank(r, size), port), daemon=True)
            for r in range(1, size)
        ]
        for p in self.procs:
            p.start()
        if device.type == "cpu":
            torch.set_num_threads(threads_per_rank(size))
        _init(0, size, port, device)
        self._finalizer = weakref.finalize(self, _stop, self.procs)

    def start(self, cache_config: CacheConfig) -> None:
        """Every rank allocates the same pools as rank 0."""
        _broadcast(cache_config)

    def step(self, out: SchedulerOutput) -> None:
        dead = [i + 1 for i, p in enumerate(self.procs) if not p.is_alive()]
        if dead:
            codes = [self.procs[r - 1].exitcode for r in dead]
            raise EngineDeadError(
                f"tensor-parallel rank(s) {dead} exited (codes {codes}); the engine stops"
            )
        _broadcast(out)

    def stop(self) -> None:
        self._finalizer()


def _stop(procs: list) -> None:
    if all(p.is_alive() for p in procs):
        try:
            _broadcast(None)
        except Exception:  # a rank is gone: the others are terminated below
            pass
    for p in procs:
        p.join(timeout=10)
        if p.is_alive():
            p.terminate()
    if dist.is_initialized():
        dist.destroy_process_group()


def _worker(args: EngineArgs, tp: TPRank, port: int) -> None:
    device = resolve_device(args.device)
    if device.type == "cpu":
        torch.set_num_threads(threads_per_rank(tp.size))
    _init(tp.rank, tp.size, port, device)
    runner = build_runner(args, tp)
    runner.allocate_kv_cache(_broadcast())
    while (out := _broadcast()) is not None:
        runner.execute(out, sample=False)
    dist.destroy_process_group()

"""Attention backends: one typed interface, a name registry, chosen once per engine.

A backend owns every operation on the paged cache: writing new K/V, prefill and decode
attention, re-rotating cached keys after a context shift, and copying whole blocks (swap).
``torch`` is the plain reference; ``cpu`` is it with the C++ decode kernels of ``kernels.cpu``
(float32 caches; the default on CPU where they build); ``triton`` runs the Triton kernels on
CUDA.
Shapes are those of ``kernels.reference``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from typing import Any, ClassVar

import torch
import torch.nn.functional as F

from kernels import reference
from kernels.launch import Launch
from kernels.rotary import RopeLayout, delta_cos_sin, rotate_reference


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether a decode step's launches depend only on shapes (not on data, and without host
    # syncs), so that they can be captured once in a CUDA graph and replayed.
    capturable: ClassVar[bool] = False

    @abstractmethod
    def write_cache(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter ``rows`` [T, H, D] into ``cache`` [N, bs, H, D]; slot -1 is skipped."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        cu_seqlens_q: torch.Tensor,
        prefix_lens: torch.Tensor,
        scale: float,
        window: int,
    ) -> torch.Tensor:
        """Chunks of new tokens attending causally to themselves and their cached prefix."""

    def plan_decode(
        self, block_tables: torch.Tensor, seq_lens: torch.Tensor, block_size: int, window: int
    ) -> Any:
        """What ``decode`` would otherwise recompute in every layer: made once per step and
        KV-cache group by the model runner, passed to ``decode`` as ``plan``."""
        return None

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int,
        plan: Any = None,
    ) -> torch.Tensor:
        """One query token per sequence, already written to the cache -> [B, Hq, Dv]."""

    @abstractmethod
    def rotate_keys(
        self, cache: torch.Tensor, blocks: torch.Tensor, delta: int, layout: RopeLayout
    ) -> None:
        """Move the keys held in ``blocks`` by ``delta`` positions, in place."""

    def copy_blocks(
        self, src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
    ) -> None:
        """Copy whole blocks ``src[src_ids]`` to ``dst[dst_ids]``, possibly across devices."""
        rows = src[src_ids.to(src.device)]
        # Device to host must be synchronous: the host rows are read right away.
        dst[dst_ids.to(dst.device)] = rows.to(dst.device, non_blocking=dst.is_cuda)


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_cache(self, cache, rows, slots):
        reference.write_cache(cache, rows, slots)

    def prefill(self, q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens,
                scale, window):  # fmt: skip
        return reference.prefill_attention(
            q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale, window
        )

    def plan_decode(self, block_tables, seq_lens, block_size, window):
        return reference.gather_plan(block_tables, seq_lens, block_size, window)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale, window, plan=None):
        return reference.decode_attention(
            q, k_cache, v_cache, block_tables, seq_lens, scale, window, plan
        )

    def rotate_keys(self, cache, blocks, delta, layout):
        rotate_reference(cache, blocks, delta, layout)


def sdpa_attend(q, k, v, scale, mask):
    """``reference._attend`` by torch's fused attention (no score matrix per head group
    materialized; about 2x at a 128-token prompt on CPU)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


class CpuBackend(TorchBackend):
    """The torch reference, with decode attention and cache writes by the C++ kernels and
    prefill attention by torch's fused attention."""

    name = "cpu"

    def __init__(self) -> None:
        from kernels import cpu

        why = cpu.load()
        if why is not None:
            raise RuntimeError(f"the cpu attention backend is unavailable: {why}")
        self._cpu = cpu

    def prefill(self, q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens,
                scale, window):  # fmt: skip
        attend = sdpa_attend if q.dtype == torch.float32 else None
        return reference.prefill_attention(
            q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale, window,
            attend,
        )  # fmt: skip

    def write_cache(self, cache, rows, slots):
        if self._cpu.usable(cache) and cache.stride(2) == cache.shape[3]:
            self._cpu.write_cache(cache, rows, slots)
        else:
            reference.write_cache(cache, rows, slots)

    def plan_decode(self, block_tables, seq_lens, block_size, window):
        return None

    def rotate_keys(self, cache, blocks, delta, layout):
        if not self._cpu.usable(cache) or cache.stride(-1) != 1:
            return super().rotate_keys(cache, blocks, delta, layout)
        if blocks.numel() and delta:
            cos, sin = delta_cos_sin(layout, delta)
            self._cpu.rotate_keys(cache, blocks, cos, sin, layout.start, layout.interleaved)

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale, window, plan=None):
        if self._cpu.usable(k_cache):
            return self._cpu.decode_attention(
                q, k_cache, v_cache, block_tables, seq_lens, scale, window
            )
        return super().decode(q, k_cache, v_cache, block_tables, seq_lens, scale, window)


class TritonBackend(AttentionBackend):
    """The Triton kernels. Each operation builds its launches (``kernels.launch.Launch``) and
    hands them to ``run``, which launches them; ``sms`` overrides the device's multiprocessor
    count that decode splits are planned for. Both are there so that the launches of a model's
    steps can be collected, and compiled ahead of time for a GPU that is not present."""

    name = "triton"
    capturable = True

    def __init__(
        self, run: Callable[[Launch], None] = Launch.__call__, sms: int | None = None
    ) -> None:
        from kernels import rotary, triton_attention

        self._attention = triton_attention
        self._rotary = rotary
        self._run = run
        self._sms = sms

    def _launch(self, launches: list[Launch]) -> None:
        for launch in launches:
            self._run(launch)

    def write_cache(self, cache, rows, slots):
        self._launch(self._attention.write_cache_launches(cache, rows, slots))

    def prefill(self, q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens,
                scale, window):  # fmt: skip
        out, launches = self._attention.prefill_launches(
            q, k, v, k_cache, v_cache, block_tables, cu_seqlens_q, prefix_lens, scale, window
        )
        self._launch(launches)
        return out

    def decode(self, q, k_cache, v_cache, block_tables, seq_lens, scale, window, plan=None):
        out, launches = self._attention.decode_launches(
            q, k_cache, v_cache, block_tables, seq_lens, scale, window, sms=self._sms
        )
        self._launch(launches)
        return out

    def rotate_keys(self, cache, blocks, delta, layout):
        self._launch(self._rotary.rotate_launches(cache, blocks, delta, layout))


BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (TorchBackend, CpuBackend, TritonBackend)
}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def default_backend(device: torch.device, cpu_kernels: bool = True) -> str:
    """triton on CUDA; on CPU, cpu where its kernels are wanted and build, else torch."""
    if device.type == "cuda":
        return "triton"
    from kernels import cpu

    return "cpu" if cpu_kernels and cpu.load() is None else "torch"


def get_backend(
    name: str | None, device: torch.device, cpu_kernels: bool = True
) -> AttentionBackend:
    """The backend called ``name``, or the device's own (``default_backend``) when None."""
    if name is None:
        name = default_backend(device, cpu_kernels)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {backend_names()}")
    return BACKENDS[name]()

"""Attention backends: one interface, selected by name (``torch`` on CPU, ``triton`` on CUDA)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from kernels import reference


@dataclass(frozen=True)
class AttentionBackend:
    """Three operations over the paged cache; signatures as in ``kernels.reference``.

    ``plan_decode``, when a backend has one, computes once per step what ``decode`` would
    otherwise recompute in every layer; its result is passed to ``decode`` as ``plan``.
    """

    name: str
    write_cache: Callable
    decode: Callable
    prefill: Callable
    plan_decode: Callable | None = None


def _torch_backend() -> AttentionBackend:
    return AttentionBackend(
        "torch",
        reference.write_cache,
        reference.decode_attention,
        reference.prefill_attention,
        reference.plan_decode,
    )


def _triton_backend() -> AttentionBackend:
    from kernels import triton_attention

    return AttentionBackend(
        "triton",
        triton_attention.write_cache,
        triton_attention.decode_attention,
        triton_attention.prefill_attention,
    )


_BACKENDS: dict[str, Callable[[], AttentionBackend]] = {
    "torch": _torch_backend,
    "triton": _triton_backend,
}


def get_backend(name: str) -> AttentionBackend:
    if name not in _BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {sorted(_BACKENDS)}")
    return _BACKENDS[name]()


def default_backend_name(device: str) -> str:
    return "triton" if device.startswith("cuda") else "torch"

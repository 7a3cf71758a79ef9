"""Re-rotating cached keys: the torch reference against RoPE at the new positions, the Triton
kernel (under ``TRITON_INTERPRET=1`` without a GPU) against the reference, and a whole context
shift over Full, sliding-window ring and MLA caches read back through the block tables.

Tolerances: fp32 1e-5 (one extra rotation in fp32 of values of magnitude ~1); bf16 one unit in
the last place either way (2e-2 absolute, 1/64 relative), as the two round their fp32 results.
"""

from __future__ import annotations

import pytest
import torch

from engine.core.config import CacheConfig
from engine.core.kv_manager import KVCacheManager
from engine.core.scheduler import CacheShift
from engine.worker.model_runner import rotate_shifted_keys
from kernels import reference, rotary
from kernels.backend import CpuBackend, TorchBackend
from kernels.rotary import RopeLayout, rotate_reference
from models.kv_spec import FullAttentionSpec, KVCacheGroup, MLASpec, SlidingWindowSpec
from models.layers import rope_inv_freq

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: dict(atol=1e-5, rtol=0), torch.bfloat16: dict(atol=2e-2, rtol=2**-6)}


def rope(x: torch.Tensor, pos: torch.Tensor, layout: RopeLayout) -> torch.Tensor:
    """x [T, H, D] with its rotary part rotated to positions ``pos`` [T] (from scratch)."""
    i1, i2 = layout.pair_indices()
    angle = pos.double()[:, None] * layout.inv_freq.double()[None, :]
    cos, sin = angle.cos()[:, None, :], angle.sin()[:, None, :]
    out = x.double().clone()
    x1, x2 = out[..., i1].clone(), out[..., i2].clone()
    out[..., i1] = x1 * cos - x2 * sin
    out[..., i2] = x2 * cos + x1 * sin
    return out.to(x.dtype)


LAYOUTS = {
    "half-split": (4, 64, RopeLayout(rope_inv_freq(64, 10000.0))),
    "interleaved": (2, 32, RopeLayout(rope_inv_freq(32, 1e6), interleaved=True)),
    "mla-tail": (1, 48, RopeLayout(rope_inv_freq(16, 10000.0), start=32)),
    "mla-tail-interleaved": (1, 48, RopeLayout(rope_inv_freq(16, 500.0), 32, interleaved=True)),
}


def filled_cache(heads, dim, layout, num_blocks=6, bs=4, dtype=torch.float32, seed=0):
    """A cache whose slot s holds a random key roped at position s; also the raw keys."""
    gen = torch.Generator().manual_seed(seed)
    raw = torch.randn(num_blocks * bs, heads, dim, generator=gen)
    pos = torch.arange(num_blocks * bs)
    cache = rope(raw, pos, layout).view(num_blocks, bs, heads, dim).to(dtype)
    return cache, raw, pos


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("delta", [-12, -1000, 7])
def test_reference_rotation_equals_rope_at_the_new_position(name, delta):
    heads, dim, layout = LAYOUTS[name]
    cache, raw, pos = filled_cache(heads, dim, layout)
    blocks = torch.tensor([1, 4])
    rotate_reference(cache, blocks, delta, layout)
    flat = cache.view(-1, heads, dim)
    moved = torch.cat([torch.arange(4, 8), torch.arange(16, 20)])
    expected = rope(raw[moved], pos[moved] + delta, layout)
    torch.testing.assert_close(flat[moved], expected, **TOL[torch.float32])
    untouched = torch.tensor([i for i in range(24) if i not in moved.tolist()])
    torch.testing.assert_close(flat[untouched], rope(raw[untouched], pos[untouched], layout))
    if layout.start:  # the latent part of an MLA row never moves
        torch.testing.assert_close(flat[moved][..., : layout.start], raw[moved][..., :32])


def test_triton_kernel_runs_under_the_interpreter_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(rotary._rotate_kernel, InterpretedFunction)


@pytest.mark.parametrize("name", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_rotation_matches_the_reference(name, dtype):
    heads, dim, layout = LAYOUTS[name]
    cache, _, _ = filled_cache(heads, dim, layout, dtype=dtype)
    cache = cache.to(DEVICE)
    expected = cache.clone()
    blocks = torch.tensor([5, 0, 3])
    rotary.rotate_triton(cache, blocks, -37, layout)
    rotate_reference(expected, blocks, -37, layout)
    torch.testing.assert_close(cache.float(), expected.float(), **TOL[dtype])


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_cpu_rotation_matches_the_reference(name):
    from kernels import cpu

    why = cpu.load()
    if why is not None:
        pytest.skip(f"CPU kernels: {why}")
    heads, dim, layout = LAYOUTS[name]
    cache, _, _ = filled_cache(heads, dim, layout)
    expected = cache.clone()
    blocks = torch.tensor([5, 0, 3])
    CpuBackend().rotate_keys(cache, blocks, -1037, layout)
    rotate_reference(expected, blocks, -1037, layout)
    torch.testing.assert_close(cache, expected, **TOL[torch.float32])
    with pytest.raises(RuntimeError, match="outside the cache"):
        CpuBackend().rotate_keys(cache, torch.tensor([6]), 3, layout)


# ---- a whole shift: KV manager table edits, then the rotation, read back by position ----


def _group_cache(group: KVCacheGroup, num_blocks: int, bs: int):
    spec = group.spec
    if isinstance(spec, MLASpec):
        k = torch.full((num_blocks, bs, 1, spec.row_width), float("nan"))
        return k, k[..., : spec.kv_lora_rank]
    shape = (num_blocks, bs, spec.num_kv_heads, spec.head_dim)
    return torch.full(shape, float("nan")), torch.full(shape, float("nan"))


@pytest.mark.parametrize(
    "groups",
    [
        [KVCacheGroup(FullAttentionSpec(2, 16), (0, 1))],
        [KVCacheGroup(MLASpec(32, 16), (0, 1))],
        [
            KVCacheGroup(SlidingWindowSpec(2, 16, window_size=10), (0,)),  # a ring of 4 blocks
            KVCacheGroup(FullAttentionSpec(2, 16), (1,)),
        ],
    ],
    ids=["full", "mla", "ring+full"],
)
@pytest.mark.parametrize("backend", ["torch", "cpu"])
def test_after_a_shift_kept_keys_equal_keys_roped_at_their_new_positions(groups, backend):
    if backend == "cpu":
        from kernels import cpu

        if cpu.load() is not None:
            pytest.skip(f"CPU kernels: {cpu.load()}")
    bs, n, keep = 4, 39, 8
    layouts = [
        RopeLayout(rope_inv_freq(16, 10000.0), start=32, interleaved=True)
        if isinstance(g.spec, MLASpec)
        else RopeLayout(rope_inv_freq(16, 10000.0 * (gi + 1)))
        for gi, g in enumerate(groups)
    ]
    kv = KVCacheManager(CacheConfig(groups, bs, (16,) * len(groups)))
    tables = kv.new_tables()
    kv.allocate(tables, n)
    caches, raw = {}, {}
    for gi, g in enumerate(groups):
        for layer in g.layer_ids:
            k, v = _group_cache(g, 16, bs)
            width = k.shape[-1]
            raw[layer] = torch.randn(
                n, k.shape[2], width, generator=torch.Generator().manual_seed(layer)
            )
            window = g.spec.window
            table = torch.tensor(tables[gi], dtype=torch.int32)
            live = torch.arange(max(0, n - window) if window else 0, n)
            slots = reference._positions_to_slots(table, live, bs, window)
            reference.write_cache(k, rope(raw[layer][live], live, layouts[gi]), slots)
            caches[layer] = (k, v)
    kv_caches = [caches[i] for i in range(len(caches))]
    key_rope = [layouts[gi] for gi, g in enumerate(groups) for _ in g.layer_ids]

    count = kv.max_discard(tables, n, keep)
    assert count >= bs
    moved, _ = kv.drop(tables, n, keep, count)
    backend = CpuBackend() if backend == "cpu" else TorchBackend()
    rotate_shifted_keys(backend, kv_caches, groups, key_rope, CacheShift("r", -count, moved))

    # Old position p >= keep + count is now p - count; the kept ones stay.
    new_len = n - count
    old_of_new = torch.cat([torch.arange(keep), torch.arange(keep + count, n)])
    for gi, g in enumerate(groups):
        window = g.spec.window
        table = torch.tensor(tables[gi], dtype=torch.int32)
        # What the next token attends to: the whole context, or its window.
        needed = torch.arange(max(0, new_len + 1 - window) if window else 0, new_len)
        for layer in g.layer_ids:
            got = reference.gather_cache(kv_caches[layer][0], table, needed, window)
            expected = rope(raw[layer][old_of_new[needed]], needed, layouts[gi])
            torch.testing.assert_close(got, expected, atol=1e-5, rtol=0)
    kv.check_integrity([tables])

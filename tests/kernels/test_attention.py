"""Triton paged attention against the plain-torch reference, and the reference against SDPA.

Without a GPU the Triton kernels run under ``TRITON_INTERPRET=1`` (set by conftest before triton
is imported). Every cache slot a kernel must not read holds NaN: slots past a sequence, slots of
positions older than the window, and table entries past a sequence (they point at a block that is
NaN throughout). A read outside the allowed positions therefore turns the output into NaN.

Tolerances: fp32 caches 1e-4 (the kernels use full-fp32 dots, no tf32, as the reference does);
bf16 caches 2e-2, since probabilities enter the P @ V product rounded to bf16. The interpreter
cannot multiply bf16 itself, so there the kernels' bf16 dots run on fp32 copies of the same
bf16 operands (exact products; only the summation order differs from the GPU).
"""

from __future__ import annotations

import ctypes
import json
import math
import os
from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F

from kernels import reference
from kernels.backend import AttentionMetadata, get_backend

triton_attention = pytest.importorskip("kernels.triton_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def _openblas_libraries() -> list[tuple[ctypes.CDLL, str, str]]:
    """Every OpenBLAS loaded in this process (numpy bundles its own) and its symbol prefix."""
    try:
        with open("/proc/self/maps") as maps:
            paths = {line.split()[-1] for line in maps if "openblas" in line.lower()}
    except OSError:
        return []
    found = []
    for path in sorted(paths):
        lib = ctypes.CDLL(path)
        for prefix, suffix in (("scipy_openblas_", "64_"), ("openblas_", "")):
            if hasattr(lib, f"{prefix}set_num_threads{suffix}"):
                found.append((lib, prefix, suffix))
                break
    return found


@pytest.fixture(scope="module", autouse=True)
def _single_threaded_interpreter_dots():
    # The interpreter runs each tl.dot as a small numpy matmul. On a loaded 2-core machine
    # OpenBLAS worker threads spin against each other and make each one ~100x slower.
    if torch.cuda.is_available():
        yield
        return
    saved = []
    for lib, prefix, suffix in _openblas_libraries():
        set_threads = getattr(lib, f"{prefix}set_num_threads{suffix}")
        saved.append((set_threads, getattr(lib, f"{prefix}get_num_threads{suffix}")()))
        set_threads(1)
    yield
    for set_threads, threads in saved:
        set_threads(threads)


def test_kernels_run_under_interpreter_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    assert os.environ.get("TRITON_INTERPRET") == "1"
    assert isinstance(triton_attention._decode_kernel, InterpretedFunction)


@dataclass
class PagedCache:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor


def _ragged_lens(block_size: int, long: int = 300) -> list[int]:
    return [1, block_size - 1, block_size, block_size + 1, long]


def _paged_cache(
    keep: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    dk: int,
    dv: int,
    block_size: int,
    dtype: torch.dtype,
    window: int = 0,
    mla: bool = False,
    seed: int = 0,
) -> PagedCache:
    """A NaN-filled cache holding random K/V only at positions [lo, hi) of each sequence.

    Physical blocks are shuffled; table entries no sequence uses point at a NaN block. With a
    window the table is a ring of ceil(window / bs) + 1 entries.
    """
    gen = torch.Generator().manual_seed(seed)
    ends = [hi for _, hi in keep]
    if window > 0:
        width = math.ceil(window / block_size) + 1
    else:
        width = max(math.ceil(max(ends) / block_size), 1) + 1
    num_blocks = len(keep) * width + 1
    poison = num_blocks - 1
    physical = torch.randperm(num_blocks - 1, generator=gen).view(len(keep), width)
    tables = torch.full((len(keep), width), poison, dtype=torch.int32)
    k_cache = torch.full((num_blocks, block_size, num_kv_heads, dk), float("nan"), dtype=dtype)
    if mla:
        v_cache = k_cache[..., :dv]
    else:
        v_cache = torch.full((num_blocks, block_size, num_kv_heads, dv), float("nan"), dtype=dtype)
    for i, (lo, hi) in enumerate(keep):
        used = min(math.ceil(hi / block_size), width)
        tables[i, :used] = physical[i, :used].int()
        pos = torch.arange(lo, hi)
        logical = pos // block_size % width if window > 0 else pos // block_size
        slots = tables[i, logical].long() * block_size + pos % block_size
        reference.write_cache(
            k_cache, torch.randn(len(pos), num_kv_heads, dk, generator=gen), slots
        )
        if not mla:
            rows = torch.randn(len(pos), num_kv_heads, dv, generator=gen)
            reference.write_cache(v_cache, rows, slots)
    k_cache = k_cache.to(DEVICE)
    v_cache = k_cache[..., :dv] if mla else v_cache.to(DEVICE)  # keep MLA's v a view of k
    return PagedCache(k_cache, v_cache, tables.to(DEVICE))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, dtype: torch.dtype) -> None:
    assert not actual.isnan().any(), "kernel read a slot outside the sequence"
    tol = TOL[dtype]
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


def _run_decode(
    lens: list[int],
    *,
    num_kv_heads: int,
    group: int,
    dk: int,
    dv: int,
    block_size: int,
    dtype: torch.dtype,
    num_splits: int | None,
    window: int = 0,
    mla: bool = False,
) -> None:
    keep = [(max(0, n - window) if window else 0, n) for n in lens]
    cache = _paged_cache(
        keep, num_kv_heads=num_kv_heads, dk=dk, dv=dv, block_size=block_size, dtype=dtype,
        window=window, mla=mla,
    )  # fmt: skip
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), num_kv_heads * group, dk, generator=gen).to(DEVICE, dtype)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, cache.k_cache, cache.v_cache, cache.tables, seq_lens, dk**-0.5, window)
    expected = reference.decode_attention(*args)
    actual = triton_attention.decode_attention(*args, num_splits=num_splits)
    assert actual.shape == (len(lens), num_kv_heads * group, dv)
    assert actual.dtype == dtype
    _assert_close(actual, expected, dtype)


# Every head dim and every group size meets both block sizes and split-K on and off, without
# the full product (the interpreter is slow).
DECODE_GRID = [
    (64, 1, 16, 1), (64, 3, 32, 4), (64, 4, 16, 4), (64, 8, 32, 1),
    (128, 1, 32, 4), (128, 3, 16, 1), (128, 4, 32, 1), (128, 8, 16, 4),
    (256, 1, 16, 4), (256, 3, 32, 1), (256, 4, 32, 4), (256, 8, 16, 1),
]  # fmt: skip


@pytest.mark.parametrize(("head_dim", "group", "block_size", "num_splits"), DECODE_GRID)
def test_decode_matches_reference(head_dim, group, block_size, num_splits):
    _run_decode(
        _ragged_lens(block_size), num_kv_heads=2, group=group, dk=head_dim, dv=head_dim,
        block_size=block_size, dtype=torch.float32, num_splits=num_splits,
    )  # fmt: skip


@pytest.mark.parametrize(("group", "num_splits", "window"), [(1, 1, 0), (4, 3, 0), (3, 2, 24)])
def test_decode_bf16_cache(group, num_splits, window):
    lens = [*_ragged_lens(16), 70] if window else _ragged_lens(16)
    _run_decode(
        lens, num_kv_heads=2, group=group, dk=128, dv=128, block_size=16, dtype=torch.bfloat16,
        num_splits=num_splits, window=window,
    )  # fmt: skip


@pytest.mark.parametrize("num_splits", [1, 2])
@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [8, 40])
def test_decode_sliding_window_over_ring(window, block_size, num_splits):
    # Lengths below, at and past the window, and several times the ring (slots reused).
    lens = [1, window - 1, window, window + 1, block_size + 1, 5 * window + 3, 300]
    _run_decode(
        lens, num_kv_heads=2, group=4, dk=64, dv=64, block_size=block_size,
        dtype=torch.float32, num_splits=num_splits, window=window,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dk", "dv", "num_heads", "dtype", "num_splits"),
    [
        (576, 512, 16, torch.float32, 1),
        (576, 512, 16, torch.bfloat16, 3),
        (576, 512, 16, torch.float32, 20),  # the merge sums 512-wide outputs 8 splits a pass
        (80, 48, 128, torch.float32, 2),  # 128 heads in one group: several head tiles
        (576, 512, 128, torch.bfloat16, 2),  # DeepSeek's shape: two 64-head tiles
    ],
)
def test_decode_mla_latent_view(dk, dv, num_heads, dtype, num_splits):
    _run_decode(
        [1, 17, 200], num_kv_heads=1, group=num_heads, dk=dk, dv=dv, block_size=16,
        dtype=dtype, num_splits=num_splits, mla=True,
    )  # fmt: skip


def test_mla_decode_tile_is_64_heads_where_a_step_is_one_cache_block():
    # 64 heads fit a thread's registers only with one table entry per step (16 keys): block
    # sizes that are multiples of 16 and no window ring; fp32 and the rest take 32.
    tile = triton_attention.decode_tile
    assert tile(torch.bfloat16, 576, 128) == triton_attention.Tile(64, 16, 8, 3)
    assert tile(torch.float16, 576, 128, block_size=32).rows == 64
    assert tile(torch.bfloat16, 576, 128, block_size=8).rows == 32
    assert tile(torch.bfloat16, 576, 128, window=512).rows == 32
    assert tile(torch.float32, 576, 128).rows == 32
    assert tile(torch.bfloat16, 576, 16).rows == 16


def test_decode_splits_more_than_blocks():
    # Most splits of the short sequences are empty and must not disturb the merge.
    _run_decode(
        [1, 2, 40], num_kv_heads=1, group=3, dk=64, dv=64, block_size=16,
        dtype=torch.float32, num_splits=16,
    )  # fmt: skip


def _run_prefill(
    chunks: list[tuple[int, int]],
    *,
    num_kv_heads: int,
    group: int,
    dk: int,
    dv: int,
    block_size: int,
    dtype: torch.dtype,
    window: int = 0,
    mla: bool = False,
) -> None:
    """``chunks``: (prefix_len, new tokens) per sequence."""
    keep = [(max(0, p - window + 1) if window else 0, p) for p, _ in chunks]
    cache = _paged_cache(
        keep, num_kv_heads=num_kv_heads, dk=dk, dv=dv, block_size=block_size, dtype=dtype,
        window=window, mla=mla,
    )  # fmt: skip
    if window == 0:
        # The table must also cover the positions this chunk will occupy.
        width = math.ceil(max(p + n for p, n in chunks) / block_size)
        extra = cache.tables[:, -1:].expand(-1, max(0, width - cache.tables.shape[1]))
        cache.tables = torch.cat([cache.tables, extra], 1)
    gen = torch.Generator().manual_seed(2)
    total = sum(n for _, n in chunks)
    hq = num_kv_heads * group
    q = torch.randn(total, hq, dk, generator=gen).to(DEVICE, dtype)
    k = torch.randn(total, num_kv_heads, dk, generator=gen).to(DEVICE, dtype)
    v = k[..., :dv] if mla else torch.randn(total, num_kv_heads, dv, generator=gen)
    v = v.to(DEVICE, dtype)
    cu = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).int()
    prefix = torch.tensor([p for p, _ in chunks], dtype=torch.int32, device=DEVICE)
    args = (q, k, v, cache.k_cache, cache.v_cache, cache.tables, cu, prefix, dk**-0.5, window)
    expected = reference.prefill_attention(*args)
    actual = triton_attention.prefill_attention(*args)
    assert actual.shape == (total, hq, dv)
    _assert_close(actual, expected, dtype)
    if DEVICE == "cpu":  # the CPU backend's prefill (torch's fused attention at float32)
        meta = AttentionMetadata(
            slot_mapping=torch.full((total,), -1), block_tables=cache.tables,
            seq_lens=prefix + cu.diff().int(), prefix_lens=prefix, cu_seqlens_q=cu,
            num_decodes=0, window=window,
        )  # fmt: skip
        backend = get_backend("cpu", torch.device("cpu"))
        ours = backend.prefill(q, k, v, (cache.k_cache, cache.v_cache), meta, dk**-0.5)
        _assert_close(ours, expected, dtype)


def test_a_steps_metadata_splits_into_its_decodes_and_its_prefill_chunks():
    # Three decodes, then chunks of 6 and 3 new tokens.
    cu = torch.tensor([0, 1, 2, 3, 9, 12], dtype=torch.int32)
    prefix = torch.tensor([4, 9, 1, 0, 20], dtype=torch.int32)
    meta = AttentionMetadata(
        slot_mapping=torch.arange(12), block_tables=torch.arange(10).view(5, 2).int(),
        seq_lens=prefix + cu.diff(), prefix_lens=prefix, cu_seqlens_q=cu, num_decodes=3,
        window=8, decode_plan="plan",
    )  # fmt: skip
    decodes, prefills = meta.decodes, meta.prefills
    assert decodes.num_decodes == 3 and decodes.decode_plan == "plan"
    assert decodes.cu_seqlens_q.tolist() == [0, 1, 2, 3]
    assert decodes.seq_lens.tolist() == [5, 10, 2]
    assert decodes.block_tables.tolist() == [[0, 1], [2, 3], [4, 5]]
    assert prefills.num_decodes == 0 and prefills.window == 8
    assert prefills.cu_seqlens_q.tolist() == [0, 6, 9]
    assert prefills.prefix_lens.tolist() == [0, 20]
    assert prefills.slot_mapping.tolist() == list(range(3, 12))
    assert decodes.decodes is decodes and prefills.prefills is prefills
    assert meta.decodes is decodes  # made once per step


def _ragged_chunks(block_size: int) -> list[tuple[int, int]]:
    bs = block_size
    return [(0, 1), (0, bs + 1), (bs - 1, 1), (bs, bs - 1), (3, bs), (bs + 1, 2), (0, 200)]


@pytest.mark.parametrize(("head_dim", "group", "block_size"), [row[:3] for row in DECODE_GRID])
def test_prefill_matches_reference(head_dim, group, block_size):
    _run_prefill(
        _ragged_chunks(block_size), num_kv_heads=2, group=group, dk=head_dim, dv=head_dim,
        block_size=block_size, dtype=torch.float32,
    )  # fmt: skip


def test_prefill_long_prefix_and_empty_chunk():
    _run_prefill(
        [(250, 3), (0, 0), (100, 40)], num_kv_heads=2, group=4, dk=64, dv=64, block_size=16,
        dtype=torch.float32,
    )  # fmt: skip


def test_prefill_bf16_cache():
    _run_prefill(
        _ragged_chunks(16), num_kv_heads=2, group=4, dk=128, dv=128, block_size=16,
        dtype=torch.bfloat16,
    )  # fmt: skip


@pytest.mark.parametrize("block_size", [16, 32])
@pytest.mark.parametrize("window", [8, 40])
def test_prefill_sliding_window_over_ring(window, block_size):
    # Prefixes below and past the window; chunks longer than the window.
    chunks = [(0, 1), (0, window + 5), (window - 1, 3), (window + 1, 1), (3 * window + 7, 70)]
    _run_prefill(
        chunks, num_kv_heads=2, group=4, dk=64, dv=64, block_size=block_size,
        dtype=torch.float32, window=window,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("dk", "dv", "num_heads", "dtype"),
    [
        (576, 512, 16, torch.float32),
        (80, 48, 128, torch.float32),
        (576, 512, 16, torch.bfloat16),  # 32 rows: 16 heads of 2 queries
        (576, 512, 128, torch.bfloat16),  # 64 rows: 64 heads of one query
    ],
)
def test_prefill_mla_latent_view(dk, dv, num_heads, dtype):
    _run_prefill(
        [(0, 5), (17, 20), (40, 1)], num_kv_heads=1, group=num_heads, dk=dk, dv=dv,
        block_size=16, dtype=dtype, mla=True,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("heads", "dim", "dtype", "strided"),
    [
        (2, 64, torch.float32, False),
        (1, 576, torch.float32, False),
        (3, 40, torch.bfloat16, False),
        (2, 64, torch.float32, True),
    ],
)
def test_write_cache_matches_reference_and_skips_padding(heads, dim, dtype, strided):
    gen = torch.Generator().manual_seed(3)
    num_blocks, block_size = 6, 16
    shape = (num_blocks, block_size, heads, dim)
    if strided:
        # A view into a wider buffer, as a cache carved out of one allocation.
        base = torch.full((num_blocks, block_size, heads, dim + 8), float("nan"), dtype=dtype)
        make = lambda: base.clone()[..., 4 : 4 + dim]  # noqa: E731
    else:
        make = lambda: torch.full(shape, float("nan"), dtype=dtype)  # noqa: E731
    expected, actual = make().to(DEVICE), make().to(DEVICE)
    slots = torch.tensor([5, -1, 17, 0, -1, 95, 40], dtype=torch.int64, device=DEVICE)
    rows = torch.randn(len(slots), heads, dim + 2, generator=gen)[..., 1 : 1 + dim].to(DEVICE)
    reference.write_cache(expected, rows, slots)
    triton_attention.write_cache(actual, rows, slots)
    # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: one ulp.
    rtol = 2**-7 if dtype == torch.bfloat16 and DEVICE == "cpu" else 0.0
    torch.testing.assert_close(actual, expected, atol=0, rtol=rtol, equal_nan=True)
    assert actual.isnan().sum() == expected.numel() - 5 * heads * dim


def test_write_cache_then_decode_as_the_engine_does():
    bs, hkv, d, lens = 16, 2, 64, [3, 20]
    cache = _paged_cache([(0, 0), (0, 0)], num_kv_heads=hkv, dk=d, dv=d, block_size=bs,
                         dtype=torch.float32)  # fmt: skip
    tables = torch.stack([torch.tensor([0, 1]), torch.tensor([2, 3])]).int().to(DEVICE)
    gen = torch.Generator().manual_seed(4)
    for name in ("ref", "triton"):
        k_cache, v_cache = cache.k_cache.clone(), cache.v_cache.clone()
        mod = reference if name == "ref" else triton_attention
        for i, n in enumerate(lens):
            pos = torch.arange(n, device=DEVICE)
            slots = tables[i][pos // bs].long() * bs + pos % bs
            kv = torch.randn(2, n, hkv, d, generator=gen.manual_seed(10 + i)).to(DEVICE)
            mod.write_cache(k_cache, kv[0], slots)
            mod.write_cache(v_cache, kv[1], slots)
        q = torch.randn(2, hkv * 3, d, generator=gen.manual_seed(5)).to(DEVICE)
        seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
        out = mod.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125)
        if name == "ref":
            expected = out
    _assert_close(out, expected, torch.float32)


# The reference against a second oracle: SDPA on contiguous, non-paged K/V.


def _sdpa(q, k, v, scale, mask):
    """q [Tq, Hq, D], k/v [Tk, Hkv, D] -> [Tq, Hq, Dv] via SDPA (GQA by repeating K/V heads)."""
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, 1)
    v = v.repeat_interleave(group, 1)
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask, scale=scale
    )
    return out.transpose(0, 1)


@pytest.mark.parametrize("window", [0, 7])
def test_reference_matches_sdpa_on_contiguous_cache(window):
    gen = torch.Generator().manual_seed(6)
    n, hkv, group, d, bs = 37, 2, 3, 32, 8
    q = torch.randn(n, hkv * group, d, generator=gen, dtype=torch.float64)
    k = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
    v = torch.randn(n, hkv, d, generator=gen, dtype=torch.float64)
    pos = torch.arange(n)
    mask = pos[None, :] <= pos[:, None]
    if window:
        mask &= pos[None, :] > pos[:, None] - window
    expected = _sdpa(q, k, v, d**-0.5, mask)

    # Prefill: the first 20 tokens cached (identity table), the rest as a new chunk.
    width = math.ceil(window / bs) + 1 if window else math.ceil(n / bs)
    num_blocks = width
    k_cache = torch.zeros(num_blocks, bs, hkv, d, dtype=torch.float64)
    v_cache = torch.zeros_like(k_cache)
    table = torch.arange(width, dtype=torch.int32)[None]
    split = 20
    slots = reference._positions_to_slots(table[0], pos, bs, window)
    reference.write_cache(k_cache, k[:split], slots[:split])
    reference.write_cache(v_cache, v[:split], slots[:split])
    cu = torch.tensor([0, n - split], dtype=torch.int32)
    prefix = torch.tensor([split], dtype=torch.int32)
    out = reference.prefill_attention(
        q[split:], k[split:], v[split:], k_cache, v_cache, table, cu, prefix, d**-0.5, window
    )
    # The reference computes in fp32 whatever the input dtype.
    torch.testing.assert_close(out, expected[split:], atol=1e-5, rtol=1e-5)

    # Decode of the last token after writing everything through the (ring) table.
    reference.write_cache(k_cache, k, slots)
    reference.write_cache(v_cache, v, slots)
    seq_lens = torch.tensor([n], dtype=torch.int32)
    out = reference.decode_attention(q[-1:], k_cache, v_cache, table, seq_lens, d**-0.5, window)
    torch.testing.assert_close(out, expected[-1:], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(
    "prefix,n,recent",
    [(0, 37, 32), (0, 1, 32), (5, 1, 32), (31, 2, 32), (37, 40, 32), (100, 1, 32), (10, 100, 45),
     (200, 300, 128)],
)  # fmt: skip
def test_split_recent_attention_is_one_softmax_over_both_sets_of_keys(prefix, n, recent):
    """The CPU backend's chunk over recent rows, by parts (flash attention over the older keys,
    shifted by slicing, and the recent band) against one softmax over both sets of keys under
    the reference's masks: rows before and after their first older key, chunks of one row."""
    from kernels.backend import split_recent_attend

    gen = torch.Generator().manual_seed(prefix + n)
    hkv, group, d = 2, 3, 16
    first = max(0, prefix - recent + 1)
    q = torch.randn(n, hkv * group, d, generator=gen)
    k_a, v_a, k_b, v_b = (
        torch.randn(prefix + n - at, hkv, d, generator=gen) for at in (0, 0, first, first)
    )
    pos_q = torch.arange(prefix, prefix + n)[:, None]
    pos_a, pos_b = torch.arange(prefix + n)[None], torch.arange(first, prefix + n)[None]
    mask = torch.cat([pos_a <= pos_q - recent, (pos_b <= pos_q) & (pos_b > pos_q - recent)], 1)
    want = reference._attend(q, torch.cat([k_a, k_b]), torch.cat([v_a, v_b]), 0.3, mask)
    got = split_recent_attend(q, k_a, v_a, k_b, v_b, prefix, recent, 0.3)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.slow
def test_engine_with_triton_backend_generates_the_torch_backend_tokens(smollm2_dir):
    from engine import LLM, SamplingParams

    # Three prompts of different lengths; a 16-token step budget splits the longest into
    # prefill chunks over a cached prefix while the others already decode.
    prompts = [
        "The capital of France is",
        "def fibonacci(n):\n    ",
        "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    ]
    params = SamplingParams(max_tokens=3, temperature=0)
    tokens = {}
    for backend in ("torch", "triton"):
        llm = LLM(
            str(smollm2_dir), max_model_len=128, num_kv_blocks=16, block_size=16,
            max_num_batched_tokens=16, attention_backend=backend,
        )  # fmt: skip
        assert llm.engine.runner.backend.name == backend
        assert len(llm.tokenizer.encode(prompts[2])) > 16  # really chunked
        tokens[backend] = [out.outputs[0].token_ids for out in llm.generate(prompts, params)]
    assert tokens["triton"] == tokens["torch"]
    assert all(len(t) == 3 for t in tokens["torch"])


def test_bench_smoke_runs_and_writes_both_copies(tmp_path, capsys):
    from bench import kernel_speed as bench

    assert bench.main(["--smoke", "--out", str(tmp_path / "smoke")]) == 0
    table = capsys.readouterr().out
    assert (
        sum(line.startswith("| ") for line in table.splitlines()) == len(bench.smoke_shapes()) + 1
    )
    assert "differs" not in table  # SDPA over the gathered K/V agrees with the kernel
    record = json.loads((tmp_path / "smoke.json").read_text())
    assert len(record["rows"]) == len(bench.smoke_shapes())
    assert all(row["sdpa_us"] is not None for row in record["rows"])  # the column is filled
    assert "| shape |" in (tmp_path / "smoke.md").read_text()


def test_bench_over_quantized_caches_counts_their_bytes(tmp_path, capsys):
    from bench import kernel_speed as bench

    argv = ["--smoke", "--kv", "bfloat16", "int8", "int4", "--only", "4/2/32 2x64", "--out"]
    assert bench.main([*argv, str(tmp_path / "kv")]) == 0
    assert "differs" not in capsys.readouterr().out  # SDPA over the dequantized rows agrees
    rows = json.loads((tmp_path / "kv.json").read_text())["rows"]
    mib = {(r["shape"], r["kv"]): r["kv_mib"] for r in rows}
    # Rows of 32 values: bf16 64 bytes, int8 32 + a 4-byte scale, int4 16 + a 2-byte scale.
    for shape in {r["shape"] for r in rows}:
        assert mib[shape, "int8"] / mib[shape, "bfloat16"] == 36 / 64
        assert mib[shape, "int4"] / mib[shape, "bfloat16"] == 18 / 64
    assert all(r["vs_first"] == 1.0 for r in rows if r["kv"] == "bfloat16")

"""The Triton kernels over every KV-cache format (``kernels.kv_quant``): int8, fp8_e4m3 and int4
rows with their scales inside, and float16/bfloat16 caches under a model of another dtype,
against the torch reference reading the same cache (``kernels.reference``), for the three
layouts: GQA, a sliding-window ring, and MLA's values as a view of its key rows.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), so the shapes are
small. Every slot a kernel must not read is poisoned: a float cache holds NaN there, a quantized
one 0xFF bytes, whose scales (float32 for int8 and fp8, float16 per int4 group) are NaN. Table
entries past a sequence point at a block poisoned throughout. A read outside the allowed
positions turns the output into NaN.

Tolerances follow what the kernels multiply in: the model's dtype over a quantized cache, the
cache's over a float one. In float32, 1e-4 (both sides dequantize the same bytes exactly; the
kernels add the rotation of the query and the output, in float32). In 16 bits, 2e-2, as in
``test_attention``. The write kernel stores the reference's bytes exactly under the interpreter;
on a GPU, where torch's CUDA kernels quantize the reference, 1% of the bytes may differ.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import pytest
import torch

from kernels import kv_quant, launch, reference
from kernels.backend import AttentionMetadata, TorchBackend, TritonBackend
from kernels.paged import ForwardContext
from kernels.rotary import RopeLayout

triton_attention = pytest.importorskip("kernels.triton_attention")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
QUANTIZED = (torch.int8, torch.float8_e4m3fn, torch.uint8)
HALF = (torch.float16, torch.bfloat16)
NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.uint8: "int4",
         torch.float16: "f16", torch.bfloat16: "bf16", torch.float32: "f32"}  # fmt: skip
BLOCK_SIZE = 16
PAIR = (torch.int8, torch.uint8)  # keys in int8, values in int4 (models.kv_spec.kv_pair)


def _halves(dtype) -> tuple[torch.dtype, torch.dtype]:
    """The key and value caches' dtypes of a cache dtype or a pair of them."""
    return dtype if isinstance(dtype, tuple) else (dtype, dtype)


@dataclass(frozen=True)
class Layout:
    num_kv_heads: int
    group: int
    dk: int
    dv: int
    window: int = 0
    mla: bool = False


LAYOUTS = {
    "gqa": Layout(2, 3, 64, 64),
    "ring": Layout(2, 2, 64, 64, window=24),
    # Keys of 128 + 64 values, as MLA's 512 + 64: a power-of-two part and a tail.
    "mla": Layout(1, 8, 192, 128, mla=True),
    # DeepSeek's own widths, on a GPU only (slow under the interpreter).
    "mla576": Layout(1, 16, 576, 512, mla=True),
}
ON_GPU = pytest.mark.skipif(DEVICE == "cpu", reason="a GPU-sized layout")


def _model_dtype(cache_dtype) -> torch.dtype:
    """A model dtype other than the cache's: float32 over a quantized cache checks the
    dequantized values to 1e-4; a 16-bit cache sits under a model of the other 16-bit dtype."""
    cache_dtype = _halves(cache_dtype)[0]
    if cache_dtype in QUANTIZED:
        return torch.float32
    return torch.bfloat16 if cache_dtype == torch.float16 else torch.float32


def _tolerance(model: torch.dtype, cache) -> float:
    cache = _halves(cache)[0]
    dot = model if cache in QUANTIZED else cache
    return 1e-4 if dot == torch.float32 else 2e-2


def _row_width(dtype: torch.dtype, dim: int) -> int:
    return kv_quant.quantize(torch.zeros(1, dim), dtype).shape[-1]


def _poisoned(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    if dtype in QUANTIZED:
        return torch.full(shape, 0xFF, dtype=torch.uint8).view(dtype)
    return torch.full(shape, float("nan"), dtype=dtype)


def test_poison_reads_as_nan():
    for dtype in (*QUANTIZED, *HALF):
        rows = _poisoned((3, 2, _row_width(dtype, 64)), dtype)
        assert kv_quant.dequantize(rows).isnan().all(), dtype


@dataclass
class Caches:
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    tables: torch.Tensor


def _caches(
    keep: list[tuple[int, int]],
    layout: Layout,
    dtype: torch.dtype,
    reach: list[int] | None = None,
    seed: int = 0,
) -> Caches:
    """Poisoned caches holding random K/V (written by the reference) at positions [lo, hi) of
    each sequence, in shuffled blocks. A sequence's table maps blocks up to position
    ``reach[i]`` (its steps write there; default hi) and a block more, to a poisoned block;
    with a window it is a ring."""
    gen = torch.Generator().manual_seed(seed)
    bs, heads = BLOCK_SIZE, layout.num_kv_heads
    reach = reach or [hi for _, hi in keep]
    if layout.window:
        width = math.ceil(layout.window / bs) + 1
    else:
        width = math.ceil(max(reach) / bs) + 1
    num_blocks = len(keep) * width + 1
    physical = torch.randperm(num_blocks - 1, generator=gen).view(len(keep), width)
    tables = torch.full((len(keep), width), num_blocks - 1, dtype=torch.int32)
    keys, values = _halves(dtype)
    k_cache = _poisoned((num_blocks, bs, heads, _row_width(keys, layout.dk)), keys)
    v_shape = (num_blocks, bs, heads, _row_width(values, layout.dv))
    v_cache = k_cache[..., : v_shape[-1]] if layout.mla else _poisoned(v_shape, values)
    for i, (lo, hi) in enumerate(keep):
        used = min(math.ceil(reach[i] / bs), width)
        tables[i, :used] = physical[i, :used].int()
        if hi == lo:
            continue
        pos = torch.arange(lo, hi)
        logical = pos // bs % width if layout.window else pos // bs
        slots = tables[i, logical].long() * bs + pos % bs
        reference.write_cache(
            k_cache, torch.randn(len(pos), heads, layout.dk, generator=gen), slots
        )
        if not layout.mla:
            rows = torch.randn(len(pos), heads, layout.dv, generator=gen)
            reference.write_cache(v_cache, rows, slots)
    k_cache = k_cache.to(DEVICE)
    v_cache = k_cache[..., : v_shape[-1]] if layout.mla else v_cache.to(DEVICE)
    return Caches(k_cache, v_cache, tables.to(DEVICE))


def _assert_close(actual: torch.Tensor, expected: torch.Tensor, tol: float) -> None:
    assert not actual.isnan().any(), "kernel read a slot outside the sequence"
    torch.testing.assert_close(actual.float(), expected.float(), atol=tol, rtol=tol)


CASES = [
    pytest.param(dtype, name, id=f"{NAMES[dtype]}-{name}")
    for dtype in (*QUANTIZED, *HALF)
    for name in LAYOUTS
    if name != "mla576"
] + [pytest.param(PAIR, name, id=f"int8+int4-{name}") for name in ("gqa", "ring")]
# A 16-bit model over quantized caches: dots in bf16, the rotated query rounded to it.
BF16_MODEL = [
    pytest.param(torch.int8, "gqa", id="int8-gqa"),
    pytest.param(torch.float8_e4m3fn, "ring", id="fp8-ring"),
    pytest.param(torch.uint8, "mla", id="int4-mla"),
    pytest.param(PAIR, "gqa", id="int8+int4-gqa"),
    *(pytest.param(d, "mla576", id=f"{NAMES[d]}-mla576", marks=ON_GPU) for d in QUANTIZED),
]


def _decode(dtype: torch.dtype, layout: Layout, model: torch.dtype, num_splits: int) -> None:
    window = layout.window
    lens = [1, 15, 17, 70] if not window else [1, window - 1, window + 1, 3 * window + 5]
    keep = [(max(0, n - window) if window else 0, n) for n in lens]
    caches = _caches(keep, layout, dtype)
    gen = torch.Generator().manual_seed(1)
    heads = layout.num_kv_heads * layout.group
    q = torch.randn(len(lens), heads, layout.dk, generator=gen).to(DEVICE, model)
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    args = (q, caches.k_cache, caches.v_cache, caches.tables, seq_lens, layout.dk**-0.5, window)
    expected = reference.decode_attention(*args)
    actual = triton_attention.decode_attention(*args, num_splits=num_splits)
    assert actual.shape == (len(lens), heads, layout.dv) and actual.dtype == model
    _assert_close(actual, expected, _tolerance(model, dtype))


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_decode_reads_the_cache_format(dtype, layout):
    _decode(dtype, LAYOUTS[layout], _model_dtype(dtype), num_splits=3)


@pytest.mark.parametrize(("dtype", "layout"), BF16_MODEL)
def test_decode_bf16_model_over_a_quantized_cache(dtype, layout):
    _decode(dtype, LAYOUTS[layout], torch.bfloat16, num_splits=1)


def _prefill(dtype: torch.dtype, layout: Layout, model: torch.dtype) -> None:
    """Chunks over a cached prefix (and without one); with a window, prefixes past it and a
    chunk longer than it. The chunk's own keys are read back from the cache's format."""
    window = layout.window
    if window:
        chunks = [(0, window + 6), (window - 1, 3), (2 * window + 7, 20)]
    else:
        chunks = [(0, 5), (17, 9), (40, 1)]
    keep = [(max(0, p - window + 1) if window else 0, p) for p, _ in chunks]
    caches = _caches(keep, layout, dtype)
    gen = torch.Generator().manual_seed(2)
    total = sum(n for _, n in chunks)
    heads = layout.num_kv_heads * layout.group
    q = torch.randn(total, heads, layout.dk, generator=gen).to(DEVICE, model)
    k = torch.randn(total, layout.num_kv_heads, layout.dk, generator=gen).to(DEVICE, model)
    if layout.mla:
        v = k[..., : layout.dv]
    else:
        v = torch.randn(total, layout.num_kv_heads, layout.dv, generator=gen).to(DEVICE, model)
    cu = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).int()
    prefix = torch.tensor([p for p, _ in chunks], dtype=torch.int32, device=DEVICE)
    args = (
        q, k, v, caches.k_cache, caches.v_cache, caches.tables, cu, prefix, layout.dk**-0.5,
        window,
    )  # fmt: skip
    expected = reference.prefill_attention(*args)
    actual = triton_attention.prefill_attention(*args)
    assert actual.shape == (total, heads, layout.dv) and actual.dtype == model
    _assert_close(actual, expected, _tolerance(model, dtype))


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_prefill_reads_the_cache_format_and_its_own_rows_as_written(dtype, layout):
    _prefill(dtype, LAYOUTS[layout], _model_dtype(dtype))


@pytest.mark.parametrize(("dtype", "layout"), BF16_MODEL)
def test_prefill_bf16_model_over_a_quantized_cache(dtype, layout):
    _prefill(dtype, LAYOUTS[layout], torch.bfloat16)


# Layers whose last tokens are also held by recent rows (float32 here, so that both passes are
# checked to float32's tolerance; a ring of that window): the main cache read for older keys
# only. With the ring layout's window of 24, 20 recent tokens
# leave it 4 older ones; 30 leave it none.
RECENT = [
    pytest.param(torch.int8, "gqa", 20, id="int8-gqa-20"),
    pytest.param(PAIR, "gqa", 20, id="int8+int4-gqa-20"),
    pytest.param(torch.uint8, "ring", 20, id="int4-ring-20"),
    pytest.param(torch.int8, "ring", 30, id="int8-ring-30"),
]


def _recent_caches(keep: list[tuple[int, int]], layout: Layout, dtype, recent: int):
    """Main caches holding ``keep``, and recent rows holding each sequence's last ``recent``
    positions of it (``reach``: one past its end)."""
    reach = [hi + 1 for _, hi in keep]
    main = _caches(keep, layout, dtype, reach=reach, seed=7)
    rkeep = [(max(lo, hi - recent), hi) for lo, hi in keep]
    ring = _caches(rkeep, replace(layout, window=recent), torch.float32, reach=reach, seed=8)
    return main, ring


@pytest.mark.parametrize(("dtype", "layout", "recent"), RECENT)
def test_decode_reads_recent_rows_as_the_reference(dtype, layout, recent):
    layout = LAYOUTS[layout]
    window = layout.window
    lens = [1, 15, 17, 70]
    keep = [(max(0, n - window) if window else 0, n) for n in lens]
    main, ring = _recent_caches(keep, layout, dtype, recent)
    heads = layout.num_kv_heads * layout.group
    q = torch.randn(len(lens), heads, layout.dk, generator=torch.Generator().manual_seed(9))
    q = q.to(DEVICE, _model_dtype(dtype))
    seq_lens = torch.tensor(lens, dtype=torch.int32, device=DEVICE)
    expected = reference.recent_decode_attention(
        q, main.k_cache, main.v_cache, main.tables, seq_lens, ring.k_cache, ring.v_cache,
        ring.tables, recent, layout.dk**-0.5, window,
    )  # fmt: skip
    actual = triton_attention.recent_decode(
        launch.run, q, (main.k_cache, main.v_cache), main.tables, seq_lens,
        (ring.k_cache, ring.v_cache), ring.tables, recent, layout.dk**-0.5, window,
    )  # fmt: skip
    _assert_close(actual, expected, _tolerance(q.dtype, dtype))


@pytest.mark.parametrize(("dtype", "layout", "recent"), RECENT)
def test_prefill_reads_recent_rows_as_the_reference(dtype, layout, recent):
    layout = LAYOUTS[layout]
    window = layout.window
    chunks = [(0, 25), (17, 9), (40, 1), (3, 30)]
    keep = [(max(0, p - window + 1) if window else 0, p) for p, _ in chunks]
    main, ring = _recent_caches(keep, layout, dtype, recent)
    gen = torch.Generator().manual_seed(10)
    total, heads, model = (
        sum(n for _, n in chunks),
        layout.num_kv_heads * layout.group,
        torch.float32,
    )
    q = torch.randn(total, heads, layout.dk, generator=gen).to(DEVICE, model)
    k = torch.randn(total, layout.num_kv_heads, layout.dk, generator=gen).to(DEVICE, model)
    v = torch.randn(total, layout.num_kv_heads, layout.dv, generator=gen).to(DEVICE, model)
    cu = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).int()
    prefix = torch.tensor([p for p, _ in chunks], dtype=torch.int32, device=DEVICE)
    expected = reference.recent_prefill_attention(
        q, k, v, main.k_cache, main.v_cache, main.tables, cu, prefix, ring.k_cache,
        ring.v_cache, ring.tables, recent, layout.dk**-0.5, window,
    )  # fmt: skip
    actual = triton_attention.recent_prefill(
        launch.run, q, k, v, (main.k_cache, main.v_cache), main.tables, cu, prefix,
        (ring.k_cache, ring.v_cache), ring.tables, recent, layout.dk**-0.5, window,
    )  # fmt: skip
    _assert_close(actual, expected, _tolerance(model, dtype))


def _assert_same_bytes(actual: torch.Tensor, expected: torch.Tensor) -> None:
    if actual.dtype not in QUANTIZED:
        # The interpreter truncates fp32 -> bf16 where the GPU rounds to nearest even: one ulp.
        rtol = 2**-7 if actual.dtype == torch.bfloat16 and DEVICE == "cpu" else 0.0
        torch.testing.assert_close(actual, expected, atol=0, rtol=rtol, equal_nan=True)
        return
    a, e = actual.view(torch.uint8), expected.view(torch.uint8)
    if DEVICE == "cpu":
        assert torch.equal(a, e), f"{int((a != e).sum())} bytes differ"
    else:
        assert (a != e).float().mean() < 0.01


@pytest.mark.parametrize("dtype", QUANTIZED, ids=[NAMES[d] for d in QUANTIZED])
@pytest.mark.parametrize(
    ("heads", "dim", "model"),
    [(2, 64, torch.bfloat16), (1, 576, torch.float32), (3, 96, torch.float32)],
)
def test_write_cache_stores_the_reference_bytes_and_skips_padding(dtype, heads, dim, model):
    # bf16 rows land on the e4m3 grid's halfway points more often than float32 ones.
    gen = torch.Generator().manual_seed(3)
    shape = (6, BLOCK_SIZE, heads, _row_width(dtype, dim))
    expected, actual = _poisoned(shape, dtype).to(DEVICE), _poisoned(shape, dtype).to(DEVICE)
    slots = torch.tensor([5, -1, 17, 0, -1, 95, 40], dtype=torch.int64, device=DEVICE)
    rows = torch.randn(len(slots), heads, dim, generator=gen) * 3
    rows[0, 0] = 0.0  # a row of zeros: scale 0
    rows[2, 0, :8] = 0.0  # an int4 group of zeros besides non-zero ones
    rows = rows.to(DEVICE, model)
    reference.write_cache(expected, rows, slots)
    triton_attention.write_cache(actual, rows, slots)
    _assert_same_bytes(actual, expected)
    assert (actual.view(torch.uint8) == 0xFF).all(-1).sum() == shape[0] * shape[
        1
    ] * heads - 5 * heads


@pytest.mark.parametrize("dtype", QUANTIZED, ids=[NAMES[d] for d in QUANTIZED])
def test_write_cache_rounds_ties_and_subnormals_as_torch(dtype):
    # Largest magnitudes 127 (int8) and 448 (fp8) make the scale 1: the values are quantized
    # as they are, halfway cases and e4m3's subnormals included.
    ties = [0.5, 1.5, 2.5, -0.5, -2.5, 126.5, 1.0625, 1.1875, -1.0625, 2**-10, 3 * 2**-10,
            -(2**-11), 2**-7 + 2**-11, 0.0, -0.0, 17.0, 18.0, 19.0, 2**-9, 7 * 2**-10]  # fmt: skip
    top = 448.0 if dtype == torch.float8_e4m3fn else 127.0
    row = torch.tensor([top, *ties] + [0.25 * i for i in range(43)])
    rows = torch.stack([row, -row, row.flip(0) / 3]).view(3, 1, 64).to(DEVICE)
    shape = (1, BLOCK_SIZE, 1, _row_width(dtype, 64))
    expected, actual = _poisoned(shape, dtype).to(DEVICE), _poisoned(shape, dtype).to(DEVICE)
    slots = torch.tensor([0, 1, 2], device=DEVICE)
    reference.write_cache(expected, rows, slots)
    triton_attention.write_cache(actual, rows, slots)
    _assert_same_bytes(actual, expected)


def step_qkv(layout: Layout, tokens: int, gen: torch.Generator, model: torch.dtype):
    """A step's random q, k, v for ``tokens`` new tokens (MLA: v is k's latent part)."""
    heads = layout.num_kv_heads * layout.group
    q = torch.randn(tokens, heads, layout.dk, generator=gen).to(DEVICE, model)
    k = torch.randn(tokens, layout.num_kv_heads, layout.dk, generator=gen).to(DEVICE, model)
    v = k[..., : layout.dv]
    if not layout.mla:
        v = torch.randn(v.shape, generator=gen).to(DEVICE, model)
    return q, k, v


def _step_metadata(caches: Caches, chunks: list[tuple[int, int]], num_decodes: int, window: int):
    """A step's metadata: sequence i has ``chunks[i] = (prefix, new)`` (decodes first, one new
    token each), its new tokens' slots through its table."""
    bs = BLOCK_SIZE
    slots = []
    for i, (p, n) in enumerate(chunks):
        pos = torch.arange(p, p + n)
        logical = pos // bs % caches.tables.shape[1] if window else pos // bs
        slots.append(caches.tables[i].cpu()[logical].long() * bs + pos % bs)
    prefix = torch.tensor([p for p, _ in chunks], dtype=torch.int32)
    new = torch.tensor([n for _, n in chunks], dtype=torch.int32)
    return AttentionMetadata(
        slot_mapping=torch.cat(slots).to(DEVICE), block_tables=caches.tables,
        seq_lens=(prefix + new).to(DEVICE), prefix_lens=prefix.to(DEVICE),
        cu_seqlens_q=torch.cat([torch.zeros(1), new.cumsum(0)]).int().to(DEVICE),
        num_decodes=num_decodes, window=window,
    )  # fmt: skip


ENGINE_CASES = (
    [
        pytest.param(dtype, name, id=f"{NAMES[dtype]}-{name}")
        for dtype in QUANTIZED
        for name in LAYOUTS
        if name != "mla576"
    ]
    + [pytest.param(PAIR, name, id=f"int8+int4-{name}") for name in ("gqa", "ring")]
    + [pytest.param(torch.bfloat16, "gqa", id="bf16-gqa")]
)


@pytest.mark.parametrize(("dtype", "layout"), ENGINE_CASES)
def test_backend_steps_write_then_read_as_the_torch_backend(dtype, layout):
    # Two steps through ``AttentionBackend.forward``: decodes beside prefill chunks over cached
    # prefixes, then decodes only, over what the first step wrote. Both backends start from
    # the same caches; they must write the same rows and attend alike.
    layout = LAYOUTS[layout]
    model = _model_dtype(dtype)
    window = layout.window
    first = [(20, 1), (3, 1), (9, 12), (40, 7)]
    keep = [(max(0, p - window + 1) if window else 0, p) for p, _ in first]
    caches = _caches(keep, layout, dtype, reach=[p + n + 1 for p, n in first], seed=5)
    ours = (caches.k_cache, caches.v_cache)
    k_copy = caches.k_cache.clone()
    theirs = (k_copy, k_copy[..., : ours[1].shape[-1]] if layout.mla else ours[1].clone())
    gen = torch.Generator().manual_seed(6)
    for chunks, num_decodes in ((first, 2), ([(p + n, 1) for p, n in first], 4)):
        meta = _step_metadata(caches, chunks, num_decodes, window)
        tokens = sum(n for _, n in chunks)
        q, k, v = step_qkv(layout, tokens, gen, model)
        outs = []
        for backend, kv in ((TritonBackend(), ours), (TorchBackend(), theirs)):
            ctx = ForwardContext.planned(backend, [meta], [kv], (0,))
            outs.append(ctx.attention(0, q, k, v, layout.dk**-0.5))
        _assert_close(outs[0], outs[1], _tolerance(model, dtype))
        _assert_same_bytes(ours[0], theirs[0])
        _assert_same_bytes(ours[1], theirs[1])


def test_triton_backend_stays_capturable_and_moves_quantized_keys_as_the_reference():
    assert TritonBackend.capturable
    layout = RopeLayout(1.0 / 10000 ** (torch.arange(0, 64, 2) / 64))
    for dtype in QUANTIZED:
        caches = _caches([(0, 30)], LAYOUTS["gqa"], dtype)
        blocks = caches.tables[0, :2].long()
        expected = caches.k_cache.clone()
        TorchBackend().rotate_keys(expected, blocks, -7, layout)
        TritonBackend().rotate_keys(caches.k_cache, blocks, -7, layout)
        assert torch.equal(caches.k_cache.view(torch.uint8), expected.view(torch.uint8))

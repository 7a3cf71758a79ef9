"""The C++ CPU kernels over KV caches in every format of ``kernels.kv_quant``, on every build the
machine runs, against the torch reference reading and writing the same format.

Cache writes must store what ``kv_quant.quantize`` stores, byte for byte (int4: within one
quantization step, its rotation summing in another order). Decode attention and the fused decoder
layers must read what the reference reads: the tests' caches are poisoned outside the sequences
(NaN values, or NaN scales in the quantized formats) so that a row read past a sequence shows.
Layouts: grouped-query full attention, a sliding window over a ring of blocks, and MLA's single
head whose values are a prefix of its key rows; head dims 64 and 32, lengths around the block
size.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kernels import cpu, reference
from kernels.backend import AttentionMetadata, get_backend
from kernels.kv_quant import (
    GROUP_BYTES,
    KV_DTYPES,
    QUANTIZED,
    SCALE_BYTES,
    dequantize,
    quantize,
    rotate,
)
from models.kv_spec import kv_pair

why = cpu.load()
pytestmark = pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}")

FORMATS = list(KV_DTYPES)
# Keys and values in two quantized formats (models.kv_spec.kv_pair); an MLA cache has one.
PAIRS = ["int8/int4", "int4/fp8_e4m3"]


def cache_dtypes(fmt: str) -> tuple[torch.dtype, torch.dtype]:
    """The key and value caches' dtypes of a format or pair."""
    return tuple(KV_DTYPES[d] for d in kv_pair(fmt))


NAN16 = torch.tensor([float("nan")], dtype=torch.float16).view(torch.uint8)
NAN32 = torch.tensor([float("nan")]).view(torch.uint8)


def row_width(dtype: torch.dtype, dim: int) -> int:
    """Elements of a cache row of ``dim`` values."""
    return quantize(torch.zeros(1, dim), dtype).shape[-1]


def poisoned(shape: tuple[int, int, int], dim: int, dtype: torch.dtype, g) -> torch.Tensor:
    """A cache [*shape, row] whose every row reads as NaN: NaN values, or random values under
    NaN scales."""
    full = (*shape, row_width(dtype, dim))
    if dtype not in QUANTIZED:
        return torch.full(full, float("nan"), dtype=dtype)
    raw = torch.randint(0, 256, full, dtype=torch.uint8, generator=g)
    if dtype == torch.uint8:
        raw.view(*shape, -1, GROUP_BYTES)[..., :2] = NAN16
    else:
        raw[..., :SCALE_BYTES] = NAN32
    return raw.view(dtype)


def paged(lens, bs, heads, dims, dtype, window, seed, filled=None, shared_values=False):
    """Key and value caches ([N, bs, heads, row] in ``dtype``, or the key and value dtypes of
    a pair, key rows of dims[0] values and value rows of dims[1]) holding each sequence's
    context (its first ``filled`` positions, default all of ``lens``) through a shuffled block
    table; poisoned elsewhere. With ``shared_values`` the values are a prefix of the key rows
    (MLA)."""
    g = torch.Generator().manual_seed(seed)
    width = max((n + bs - 1) // bs for n in lens) if not window else (window + bs - 1) // bs + 1
    n_blocks = len(lens) * width + 3
    dk, dv = dims
    k_dtype, v_dtype = dtype if isinstance(dtype, tuple) else (dtype, dtype)
    k_cache = poisoned((n_blocks, bs, heads), dk, k_dtype, g)
    if shared_values:
        v_cache = k_cache[..., : row_width(k_dtype, dv)]
    else:
        v_cache = poisoned((n_blocks, bs, heads), dv, v_dtype, g)
    tables = torch.randperm(n_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    for i, n in enumerate(lens if filled is None else filled):
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        if len(pos) == 0:
            continue
        logical = pos // bs % width if window else pos // bs
        slots = tables[i, logical] * bs + pos % bs
        reference.write_cache(k_cache, 2 * torch.randn(len(pos), heads, dk, generator=g), slots)
        if not shared_values:
            values = 2 * torch.randn(len(pos), heads, dv, generator=g)
            reference.write_cache(v_cache, values, slots)
    return k_cache, v_cache, tables.int(), torch.tensor(lens, dtype=torch.int32)


def stored_values(cache: torch.Tensor) -> torch.Tensor:
    """A cache's values as stored: quantized ones still rotated (``rotate`` is its own
    inverse)."""
    values = dequantize(cache)
    return rotate(values) if cache.dtype in QUANTIZED else values


def quantization_step(cache: torch.Tensor) -> torch.Tensor:
    """Per value, the step between neighbouring stored values at its scale (an upper bound)."""
    values = stored_values(cache)
    if cache.dtype == torch.uint8:
        g = cache.view(torch.uint8).reshape(*cache.shape[:-1], -1, GROUP_BYTES)
        d = g[..., :2].contiguous().view(torch.float16).float().abs()
        return d.repeat_interleave(32, -1).reshape(values.shape)
    if cache.dtype == torch.int8:
        scale = cache[..., :SCALE_BYTES].contiguous().view(torch.uint8).view(torch.float32)
        return scale.abs().expand(values.shape)
    relative = {torch.float8_e4m3fn: 2**-3, torch.bfloat16: 2**-7, torch.float16: 2**-10}
    smallest = values.abs().amax(-1, keepdim=True) / 448 * 2**-9  # fp8's subnormal step
    return values.abs() * relative.get(cache.dtype, 1e-6) + smallest


def rows_for_writing(t: int, heads: int, dim: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    rows = torch.randn(t, heads, dim, generator=g)
    rows[:, :, 3] *= 20  # an outlier channel, as keys have
    rows[0] = 0.0  # a zero row: scale 0
    rows[1] *= 1e-3
    rows[2, 0, 5] = -rows[2, 0].abs().max() * 2  # the largest magnitude negative
    return rows


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("dim", [64, 32, 96])
def test_write_cache_stores_what_the_reference_stores(isa, fmt, dim):
    dtype = KV_DTYPES[fmt]
    n_blocks, bs, heads, t = 5, 16, 3, 37
    ours = poisoned((n_blocks, bs, heads), dim, dtype, torch.Generator().manual_seed(0))
    ref = ours.clone()
    rows = rows_for_writing(t, heads, dim, seed=dim)
    slots = torch.randperm(n_blocks * bs, generator=torch.Generator().manual_seed(1))[:t]
    slots[[4, 9]] = -1
    cpu.write_cache(ours, rows, slots, isa=isa)
    reference.write_cache(ref, rows, slots)
    same = ours.view(torch.uint8) == ref.view(torch.uint8)
    if KV_DTYPES[fmt] not in QUANTIZED:
        assert same.all()
        return
    # The rotation sums in another order than the reference's matrix product: a value may land
    # on the other side of a rounding boundary, one step away.
    assert same.float().mean() > 0.99
    untouched = torch.ones(n_blocks * bs, dtype=torch.bool)
    untouched[slots[slots >= 0]] = False
    assert same.view(n_blocks * bs, -1)[untouched].all()
    written = slots[slots >= 0]
    a, b = (c.view(n_blocks * bs, heads, -1)[written] for c in (ours, ref))
    err = (stored_values(a) - stored_values(b)).abs()
    assert (err <= quantization_step(b) * 1.01 + 1e-6).all()


def test_write_cache_refuses_a_slot_outside_and_rows_that_are_not_whole():
    cache = torch.zeros(2, 4, 1, row_width(torch.int8, 32), dtype=torch.int8)
    with pytest.raises(RuntimeError, match="outside"):
        cpu.write_cache(cache, torch.randn(1, 1, 32), torch.tensor([8]))
    with pytest.raises(RuntimeError, match="no whole row"):
        bad = torch.zeros(2, 4, 1, 30, dtype=torch.uint8)
        cpu.write_cache(bad, torch.randn(1, 1, 32), torch.tensor([0]))


LAYOUTS = {  # query heads, KV heads, window, lengths, MLA (values a prefix of the key rows)
    "gqa": (8, 2, 0, [1, 15, 16, 17, 33, 70], False),
    "parts": (6, 2, 0, [300], False),  # one sequence: its context in parts, merged
    "ring": (6, 3, 24, [5, 24, 25, 70, 257], False),
    "mla": (5, 1, 0, [1, 17, 40, 129], True),
}


def tolerance(fmt: str) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if fmt == "float32" else dict(rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize(
    "fmt,layout",
    # An MLA cache's values are a part of its key rows: one format.
    [
        (f, name)
        for f in FORMATS + PAIRS
        for name in sorted(LAYOUTS)
        if f in FORMATS or name != "mla"
    ],
)
@pytest.mark.parametrize("dim,bs", [(64, 16), (32, 16), (64, 5)])
def test_decode_attention_reads_what_the_reference_reads(isa, fmt, layout, dim, bs):
    hq, hkv, window, lens, mla = LAYOUTS[layout]
    # MLA's key rows hold the values and a rotary part; int4 rotates both in blocks alike.
    dims = (dim + 64, dim) if mla else (dim, dim)
    k_cache, v_cache, tables, seq_lens = paged(
        lens, bs, hkv, dims, cache_dtypes(fmt), window, seed=dim + bs, shared_values=mla
    )
    q = torch.randn(len(lens), hq, dims[0], generator=torch.Generator().manual_seed(2))
    scale = dims[0] ** -0.5
    ours = cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, window, isa=isa)
    ref = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, scale, window)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, ref, **tolerance(fmt))


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("fmt,ring", [("int8", "float16"), ("int4", "float32"),
                                      ("int8/int4", "bfloat16")])  # fmt: skip
@pytest.mark.parametrize("layout", ["gqa", "parts", "ring"])
@pytest.mark.parametrize("tokens", [7, 20])
def test_decode_attention_reads_recent_rows_as_the_reference_reads_them(
    isa, fmt, ring, layout, tokens
):
    """A sequence's last ``tokens`` positions from the recent rows (a ring of that window),
    older ones from the main cache (itself a ring with a window)."""
    hq, hkv, window, lens, _ = LAYOUTS[layout]
    dims, bs = (64, 64), 8
    main = paged(lens, bs, hkv, dims, cache_dtypes(fmt), window, seed=3)
    rk, rv, rtables, _ = paged(lens, bs, hkv, dims, KV_DTYPES[ring], tokens, seed=4)
    q = torch.randn(len(lens), hq, 64, generator=torch.Generator().manual_seed(5))
    k_cache, v_cache, tables, seq_lens = main
    ours = cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window, isa=isa,
                                recent=(rk, rv, rtables, tokens))  # fmt: skip
    ref = reference.recent_decode_attention(q, k_cache, v_cache, tables, seq_lens, rk, rv,
                                            rtables, tokens, 0.125, window)  # fmt: skip
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, ref, **tolerance(fmt))


def test_decode_attention_refuses_int4_values_rotated_in_other_blocks():
    k_cache, v_cache, tables, lens = paged([5], 4, 1, (96, 64), torch.uint8, 0, 0, None, True)
    with pytest.raises(RuntimeError, match="rotation blocks"):
        cpu.decode_attention(torch.randn(1, 2, 96), k_cache, v_cache, tables, lens, 0.1, 0)


def test_decode_attention_refuses_a_float_half_beside_a_quantized_one():
    dtypes = (torch.float16, torch.int8)
    k_cache, v_cache, tables, lens = paged([5], 4, 1, (32, 32), dtypes, 0, 0)
    with pytest.raises(RuntimeError, match="two quantized ones"):
        cpu.decode_attention(torch.randn(1, 2, 32), k_cache, v_cache, tables, lens, 0.1, 0)


@pytest.mark.parametrize("fmt", ["bfloat16", "int8", "int4"])
def test_cpu_backend_takes_the_kernels_for_every_format(monkeypatch, fmt):
    backend = get_backend("cpu", torch.device("cpu"))
    dtype = KV_DTYPES[fmt]
    k_cache, v_cache, tables, seq_lens = paged([9, 3], 4, 2, (32, 32), dtype, 0, seed=5)
    calls = []
    for name in ("decode_attention", "write_cache"):
        kernel = getattr(cpu, name)
        monkeypatch.setattr(cpu, name, lambda *a, k=kernel, n=name: calls.append(n) or k(*a))
    meta = AttentionMetadata(
        slot_mapping=torch.full((2,), -1), block_tables=tables, seq_lens=seq_lens,
        prefix_lens=seq_lens - 1, cu_seqlens_q=torch.arange(3, dtype=torch.int32),
        num_decodes=2,
    )  # fmt: skip
    q = torch.randn(2, 4, 32)
    ref = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, 0)
    torch.testing.assert_close(backend.decode(q, (k_cache, v_cache), meta, 0.2), ref)
    half = backend.decode(q.bfloat16(), (k_cache, v_cache), meta, 0.2)
    assert half.dtype == torch.bfloat16
    expected = k_cache.clone()
    rows, slots = torch.randn(3, 2, 32), torch.tensor([0, -1, 6])
    backend.write_cache(k_cache, rows, slots)
    reference.write_cache(expected, rows, slots)
    assert calls == ["decode_attention", "decode_attention", "write_cache"]
    if dtype not in QUANTIZED:  # else the rotation may round a value to a neighbouring step
        assert torch.equal(k_cache.view(torch.uint8), expected.view(torch.uint8))
    else:
        torch.testing.assert_close(
            dequantize(k_cache), dequantize(expected), atol=0.1, rtol=0.1, equal_nan=True
        )


# The fused decoder layers: a step through every layer of a tiny model in one call (the CPU
# backend) against its modules layer by layer (the torch backend), caches in each format.

MODELS = {  # a tiny checkpoint's kind and config overrides
    "llama64": ("llama", dict(head_dim=64)),
    "llama32": (
        "llama",
        dict(head_dim=32, hidden_size=96, num_attention_heads=6, num_key_value_heads=3),
    ),
    "gemma3": ("gemma3", {}),  # head_dim 32; a sliding window of 32 over its ring, a full layer
}

STEPS = [  # model, (cached tokens, new tokens) per sequence, decodes first
    ("llama64", [(0, 1), (15, 1), (16, 1), (17, 1), (40, 1)]),
    ("llama64", [(149, 1)]),  # a long context in parts
    ("llama64", [(0, 17)]),  # a prompt
    ("llama64", [(8, 1), (31, 1), (16, 20), (15, 17), (0, 6)]),  # decodes and chunks
    ("llama32", [(33, 1), (1, 1), (70, 50)]),  # a chunk after a long prefix
    ("llama32", [(3, 1), (16, 16), (0, 1)]),
    ("gemma3", [(69, 1), (8, 1), (32, 1)]),
    ("gemma3", [(40, 1), (10, 50), (0, 45)]),  # chunks longer than the window
]


# Per format, how far the hidden states and caches of the two paths may differ.
FUSED_ATOL = {
    "float32": 1e-4,
    "float16": 3e-4,
    "bfloat16": 4e-3,
    "int8": 4e-3,
    "fp8_e4m3": 2e-2,
    "int4": 5e-2,
}


def model_loader(tmp_path_factory, models: dict):
    """Loads (config, plain model, model fitted to the kernels) of a ``models`` name, once."""
    from models.config import ModelConfig
    from models.loader import load_model
    from tests.helpers import save_tiny_gemma3, save_tiny_llama

    @functools.cache
    def load(name: str):
        kind, overrides = models[name]
        path = tmp_path_factory.mktemp(name)
        (save_tiny_llama if kind == "llama" else save_tiny_gemma3)(path, **overrides)
        cfg = ModelConfig.from_dir(path)
        plain = load_model(cfg, torch.float32, torch.device("cpu"))
        fast = load_model(cfg, torch.float32, torch.device("cpu"))
        assert get_backend("cpu", torch.device("cpu")).prepare(fast) > 0
        return cfg, plain, fast

    return load


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model_loader(tmp_path_factory, MODELS)


def step_inputs(cfg, model, seqs, dtype, bs=16):
    """Token ids, positions, caches (per layer) and metadata (per group) of one step."""
    from kernels.paged import AttentionMetadata

    b = len(seqs)
    prefix = torch.tensor([p for p, _ in seqs], dtype=torch.int32)
    new = torch.tensor([n for _, n in seqs])
    seq_lens = prefix + new.int()
    num_decodes = next((i for i, (_, n) in enumerate(seqs) if n != 1), b)
    row = torch.repeat_interleave(torch.arange(b), new)
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = new.cumsum(0)
    pos = prefix[row].long() + torch.arange(len(row)) - cu[row].long()
    # A decode's own position holds an older row (read back if its slot is -1); a chunk's
    # cached prefix only.
    filled = [p + 1 if i < num_decodes else p for i, (p, _) in enumerate(seqs)]
    groups = type(model).kv_cache_groups(cfg, "float32")
    layer_to_group, caches, metas = [0] * cfg.num_layers, [None] * cfg.num_layers, []
    for g, group in enumerate(groups):
        window = getattr(group.spec, "window_size", 0)
        dims = (cfg.head_dim, cfg.head_dim)
        k_cache, v_cache, tables, _ = paged(
            seq_lens.tolist(), bs, cfg.num_kv_heads, dims, dtype, window, 11 + g, filled
        )
        for layer in group.layer_ids:
            layer_to_group[layer], caches[layer] = g, (k_cache, v_cache)
        width = tables.shape[1]
        logical = pos // bs % width if window else pos // bs
        slots = tables[row, logical].long() * bs + pos % bs
        if window:  # within a chunk the ring wraps: only the last width * bs tokens are kept
            slots[pos < (seq_lens.long() - width * bs)[row]] = -1
        if len(row) > 1:
            slots[1] = -1  # a token whose K/V is not kept (the scheduler's -1)
        metas.append(
            AttentionMetadata(slots, tables, seq_lens, prefix, cu, num_decodes, window)
        )  # fmt: skip
    ids = torch.randint(0, cfg.vocab_size, (len(row),), generator=torch.Generator().manual_seed(1))
    return ids, pos, caches, metas, tuple(layer_to_group)


def run_step(model, backend, inputs):
    """The model's hidden states over one step, and the caches it leaves (copies)."""
    from kernels.paged import ForwardContext

    ids, pos, caches, metas, layer_to_group = inputs
    copies = [(k.clone(), v.clone()) for k, v in caches]
    ctx = ForwardContext(get_backend(backend, torch.device("cpu")), metas, copies, layer_to_group)
    with torch.no_grad():
        return model(ids, pos, ctx), copies


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("fmt", [*FORMATS, PAIRS[0]])
@pytest.mark.parametrize("model,seqs", STEPS)
def test_fused_decoder_layers_match_the_modules_in_every_format(
    monkeypatch, tiny_model, isa, fmt, model, seqs
):
    """Decodes write (quantizing) and read the cache; prefill chunks read their own keys and
    values as the cache gives them back, and their prefix from it."""
    monkeypatch.setenv(cpu.ISA_ENV, isa)
    cfg, plain, fast = tiny_model(model)
    inputs = step_inputs(cfg, plain, seqs, cache_dtypes(fmt))
    calls = []
    fused = cpu.decoder_layers
    monkeypatch.setattr(cpu, "decoder_layers", lambda *a, **k: calls.append(1) or fused(*a, **k))
    out_plain, caches_plain = run_step(plain, "torch", inputs)
    out_fast, caches_fast = run_step(fast, "cpu", inputs)
    assert calls == [1]  # all the layers in one call
    assert not out_fast.isnan().any()
    # The two paths' keys and values differ by float rounding (their sums run in other orders),
    # which may move a value to its neighbouring step in one cache and not the other; that step
    # then reaches the next layers' inputs. Such steps stay within FUSED_ATOL, which a prefill
    # chunk reading its own keys and values unrounded misses by 3x (bfloat16) to 10x and more.
    atol = max(FUSED_ATOL[d] for d in kv_pair(fmt))
    for ours, ref in zip(caches_fast, caches_plain):
        for a, c in zip(ours, ref):
            err = (stored_values(a) - stored_values(c)).abs().nan_to_num()
            assert (err <= quantization_step(c).nan_to_num() * 1.01 + atol).all()
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-4, atol=atol)

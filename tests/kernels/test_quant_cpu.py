"""The C++ CPU kernels on weights in GGUF block formats, against the reference: the weights
dequantized by gguf-py (``kernels.quant.dequantize``) and multiplied in float64.

The kernels round each activation row to two int8 digits per block, x = d (q + ql / 254) with
d = max|x over its block| / 127 (blocks of 64 values where the matrix has a K-format part,
summed in integers with those formats' sub-scales; of 32 otherwise, as Q8_0). A value moves by
at most half the low digit's step, d / 508, and an output by at most
``sum_k |w[n, k]| * max|x over k's block| / (127 * 508)``: the bound each output is held to
(times 1.02, plus float32 rounding of the sums). Every other step is exact integer arithmetic
or float32 sums.

Block contents: the 32-value formats come from gguf-py's quantizer; the K formats (which it does
not quantize) are random bits under finite, modest fp16 scales, or rows of a real model file
when one is in the cache (``~/.cache/kvserve/gguf``).
"""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch

from kernels import cpu
from kernels.quant import (
    K_SCALES,
    QuantLinear,
    dequantize,
    dequantize_rows,
    quantize,
    random_blocks,
)
from kernels.weights import FORMATS, DecoderLayerWeights, Weight

why = cpu.load()
pytestmark = pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}")

BLOCK_FORMATS = [f for f in FORMATS if f != "dense"]
K_FORMATS = tuple(K_SCALES)
GGUF_CACHE = Path.home() / ".cache" / "kvserve" / "gguf"


def reference(x: torch.Tensor, parts) -> torch.Tensor:
    w = torch.cat([dequantize(p).double() for p in parts])
    y = x.double() @ w.T
    biases = [p.bias if p.bias is not None else torch.zeros(p.out_features) for p in parts]
    return y + torch.cat(biases).double()


def bound(x: torch.Tensor, parts) -> torch.Tensor:
    """The largest error activation rounding allows per output (module docstring)."""
    block = 64 if any(p.format in K_FORMATS for p in parts) else 32
    w = torch.cat([dequantize(p).double() for p in parts]).abs()
    amax = x.double().abs().view(x.shape[0], -1, block).amax(-1)
    step = amax.repeat_interleave(block, dim=1) / (127 * 508)
    return 1.02 * step @ w.T + 1e-5 * (x.double().abs() @ w.T) + 1e-5


def assert_within_bound(y, x, parts):
    err = (y.double() - reference(x, parts)).abs()
    limit = bound(x, parts)
    worst = (err / limit).max().item()
    assert worst <= 1.0, f"error {worst:.3f} times the rounding bound"


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
@pytest.mark.parametrize("rows", [1, 2, 3, 5, 6, 8, 9, 17, 64, 70])
@pytest.mark.parametrize("packed", [False, True], ids=["file", "packed"])
def test_linear_of_each_format_within_the_rounding_bound(isa, fmt, rows, packed):
    k = 3 * FORMATS[fmt].block if fmt in K_FORMATS else 160
    w = Weight(random_blocks(fmt, 40 if packed else 37, k, seed=rows), None, fmt)
    if packed:
        (w,) = cpu.repacked(w)
        assert w.packed
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    x[:, :5] *= 8  # an outlier per row, as activations have
    assert_within_bound(cpu.linear(x, w, isa=isa), x, (w,))


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_repacking_keeps_every_value_of_the_file(fmt):
    """gguf-py's dequantization of the file layout is the oracle of the repacked one."""
    k = 2 * FORMATS[fmt].block if fmt in K_FORMATS else 96
    w = Weight(random_blocks(fmt, 24, k, seed=5), None, fmt)
    (packed,) = cpu.repacked(w)
    assert packed.data.shape == w.data.shape and not torch.equal(packed.data, w.data)
    torch.testing.assert_close(dequantize(packed), dequantize(w), rtol=0, atol=0)
    ids = torch.tensor([23, 0, 9, 9])
    torch.testing.assert_close(dequantize_rows(packed, ids), dequantize(w)[ids], rtol=0, atol=0)


def test_only_matrices_of_whole_groups_of_rows_are_repacked():
    parts = (Weight(random_blocks("q8_0", 12, 64, seed=1), None, "q8_0"),)
    assert cpu.repacked(parts) == parts
    with pytest.raises(ValueError, match="multiple of 8 rows"):
        Weight(parts[0].data, None, "q8_0", packed=True)
    with pytest.raises(RuntimeError, match="multiple of 8 rows"):
        cpu.ops().linear(torch.randn(1, 64), [parts[0].data], [None], [8 + 256])


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize(
    "formats",
    [("q4_k", "q6_k"), ("q5_0", "q8_0", "dense"), ("q4_k", "q8_0"), ("q4_1", "q5_1", "q4_0")],
)
@pytest.mark.parametrize("rows", [1, 7, 30])
@pytest.mark.parametrize("packed", [False, True], ids=["file", "packed"])
def test_mixed_parts_with_biases_are_stacked_by_rows(isa, formats, rows, packed):
    k = 512
    g = torch.Generator().manual_seed(len(formats) * 100 + rows)
    parts = tuple(
        Weight(torch.randn(n, k, generator=g), torch.randn(n, generator=g))
        if fmt == "dense"
        else Weight(random_blocks(fmt, n, k, seed=n), torch.randn(n, generator=g), fmt)
        for fmt, n in zip(formats, (24, 16, 8) if packed else (19, 13, 6))
    )
    if packed:
        parts = cpu.repacked(parts)
        assert all(p.packed for p in parts if p.format != "dense")
    x = torch.randn(rows, k, generator=g)
    assert_within_bound(cpu.linear(x, parts, isa=isa), x, parts)


def test_both_builds_give_the_same_sums():
    """The byte products are exact integers on either instruction set."""
    if len(cpu.isas()) < 2:
        pytest.skip("one build on this machine")
    w = Weight(random_blocks("q4_k", 24, 512, seed=3), None, "q4_k")
    x = torch.randn(5, 512)
    outs = [cpu.linear(x, w, isa=isa) for isa in cpu.isas()]
    torch.testing.assert_close(outs[0], outs[1], rtol=1e-6, atol=1e-5)


def test_linear_refuses_a_misshapen_or_unknown_block_format():
    w = Weight(torch.zeros(4, 34, dtype=torch.uint8), None, "q8_0")  # one block: 32 inputs
    with pytest.raises(RuntimeError, match="features"):
        cpu.linear(torch.randn(1, 64), w)
    with pytest.raises(RuntimeError, match="unknown format"):
        cpu.ops().linear(torch.randn(1, 64), [w.data], [None], [99])
    with pytest.raises(RuntimeError, match="whole blocks of 34 bytes"):
        cpu.ops().linear(torch.randn(1, 32), [torch.zeros(4, 35, dtype=torch.uint8)], [None], [8])


@functools.cache
def _file_rows(rows: int = 24) -> dict[str, torch.Tensor]:
    """The first rows of a tensor of each block format in the smaller cached GGUF files (the
    reader's start-up grows with the file's vocabulary)."""
    from models.gguf_import import open_gguf

    found: dict[str, torch.Tensor] = {}
    files = sorted(GGUF_CACHE.glob("*.gguf"), key=lambda p: p.stat().st_size)
    for path in [p for p in files if p.stat().st_size < 300e6]:
        for t in open_gguf(path).tensors:
            fmt = t.tensor_type.name.lower()
            if fmt in FORMATS and fmt not in found and len(t.data.shape) == 2:
                found[fmt] = torch.from_numpy(t.data[:rows].copy())
    return found


@pytest.mark.parametrize("fmt", BLOCK_FORMATS)
def test_rows_of_a_real_model_file(fmt):
    data = _file_rows().get(fmt) if GGUF_CACHE.is_dir() else None
    if data is None:
        pytest.skip(f"no {fmt} tensor in the model files under {GGUF_CACHE}")
    w = Weight(data, None, fmt)
    (packed,) = cpu.repacked(w)
    torch.testing.assert_close(dequantize(packed), dequantize(w), rtol=0, atol=0)
    x = torch.randn(9, w.in_features)
    for isa in cpu.isas():
        assert_within_bound(cpu.linear(x, w, isa=isa), x, (w,))
        assert_within_bound(cpu.linear(x, packed, isa=isa), x, (packed,))


@pytest.mark.parametrize("repack", [True, False])
def test_a_tied_head_and_its_embedding_share_one_copy_once_prepared(repack):
    """Repacking replaces the file's layout: the embedding then reads the head's copy."""
    from torch import nn

    from kernels.backend import CpuBackend
    from kernels.quant import QuantEmbedding

    w = Weight(random_blocks("q4_k", 40, 256, seed=7), None, "q4_k")
    model = nn.Module()
    model.embed = QuantEmbedding(w)
    model.lm_head = QuantLinear((model.embed.stored,))
    ids = torch.tensor([[3, 39], [0, 17]])
    before = model.embed(ids)
    assert CpuBackend(repack=repack).prepare(model) == 1
    (head,) = model.lm_head.parts
    assert head.packed == repack == model.embed.packed
    assert head.data is model.embed.data
    assert head.data.shape == w.data.shape
    torch.testing.assert_close(model.embed(ids), before, rtol=0, atol=0)
    x = torch.randn(2, 256)
    assert_within_bound(model.lm_head(x), x, (w,))


def test_fast_linear_over_quantized_parts_keeps_buffers_and_output():
    parts = (
        Weight(random_blocks("q4_k", 20, 256, seed=1), torch.randn(20), "q4_k"),
        Weight(random_blocks("q6_k", 12, 256, seed=2), None, "q6_k"),
    )
    ref = QuantLinear(parts)
    fast = cpu.FastLinear(ref.parts)
    assert dict(fast.named_buffers()).keys() == dict(ref.named_buffers()).keys()
    assert all(a.data is b.data for a, b in zip(fast.parts, parts))
    x = torch.randn(3, 256)
    assert_within_bound(fast(x), x, parts)


@pytest.fixture(scope="module")
def wide_llama_dir(tmp_path_factory):
    """A tiny Llama whose matrices take K formats (inputs a multiple of 256), with biases."""
    from tests.helpers import save_tiny_llama

    path = tmp_path_factory.mktemp("wide-llama")
    save_tiny_llama(path, hidden_size=256, intermediate_size=512, attention_bias=True)
    return path


def _quantized(model):
    """The model's projections as QuantLinear parts of mixed formats (q|k, v; gate, up)."""
    from models.layers import DecoderLayer

    plan = {"qkv_proj": ("q4_k", "q6_k"), "o_proj": ("q5_0",), "gate_up_proj": ("q4_k", "q8_0"),
            "down_proj": ("q6_k",)}  # fmt: skip
    for layer in model.modules():
        if not isinstance(layer, DecoderLayer):
            continue
        for parent in (layer.self_attn, layer.mlp):
            for name, formats in plan.items():
                linear = getattr(parent, name, None)
                if linear is None:
                    continue
                w, b = linear.weight.detach(), linear.bias
                cut = w.shape[0] - (layer.self_attn.num_kv_heads * layer.self_attn.head_dim
                                    if name == "qkv_proj" else w.shape[0] // 2)  # fmt: skip
                pieces = [(0, cut), (cut, w.shape[0])] if len(formats) == 2 else [(0, w.shape[0])]
                setattr(parent, name, QuantLinear(tuple(
                    Weight(_to_format(w[i:j], f), None if b is None else b.detach()[i:j], f)
                    for f, (i, j) in zip(formats, pieces)
                )))  # fmt: skip


def _to_format(w: torch.Tensor, fmt: str) -> torch.Tensor:
    """w in ``fmt``: quantized where gguf-py can, else random K blocks scaled like w."""
    if fmt not in K_FORMATS:
        return quantize(w, fmt)
    return random_blocks(fmt, w.shape[0], w.shape[1], seed=w.shape[0], size=0.02)


def _quantized_model(model_dir, prepared: bool):
    from kernels.backend import get_backend
    from models.config import ModelConfig
    from models.loader import load_model

    cfg = ModelConfig.from_dir(model_dir)
    model = load_model(cfg, torch.float32, torch.device("cpu"))
    _quantized(model)
    if prepared:
        assert get_backend("cpu", torch.device("cpu")).prepare(model) > 0
        assert not any(isinstance(m, QuantLinear) for m in model.modules())
    return cfg, model


@pytest.mark.parametrize("seqs", [[(5, 1), (17, 1)], [(3, 1), (0, 12)], [(0, 40)]])
def test_fused_layers_on_quantized_parts_match_the_modules(wide_llama_dir, monkeypatch, seqs):
    """One ``cpu.decoder_layers`` call against the same layers module by module: with the
    kernel's FastLinear modules, and with the QuantLinear modules on the torch path (the
    reference). The two routes give the products inputs that differ in the last bits, which
    round to other low digits; each is held to the two digits' precision (5e-5 to 7e-5 of the
    hidden state's norm measured here, where int8 activations alone gave a few percent)."""
    from kernels.backend import CpuBackend
    from tests.kernels.test_cpu import run_step

    cfg, fast = _quantized_model(wide_llama_dir, prepared=True)
    _, modules = _quantized_model(wide_llama_dir, prepared=True)
    _, plain = _quantized_model(wide_llama_dir, prepared=False)
    unfused = CpuBackend()
    unfused.decoder_layers = lambda *args: None  # module by module, on the kernels
    (out_fast, caches_fast), (out_modules, caches_modules) = run_step(
        cfg, fast, modules, seqs, monkeypatch, plain_backend=unfused
    )

    def relative(a: torch.Tensor, b: torch.Tensor) -> float:
        a, b = a.nan_to_num(), b.nan_to_num()  # unused cache slots hold NaN in both
        return ((a - b).norm() / b.norm()).item()

    assert relative(out_fast, out_modules) <= 2e-4
    for ours, ref in zip(caches_fast, caches_modules):
        for a, c in zip(ours, ref):
            assert relative(a, c) <= 2e-4
            assert torch.equal(a.isnan(), c.isnan())
    (out_fast, _), (out_plain, _) = run_step(cfg, fast, plain, seqs, monkeypatch)
    assert relative(out_fast, out_plain) <= 2e-4


def test_the_isa_variable_forces_a_build_the_machine_can_run(monkeypatch):
    monkeypatch.setattr(cpu, "_cpu_flags", lambda: {"avx2", "fma", "f16c"})
    monkeypatch.setattr(cpu.platform, "machine", lambda: "x86_64")
    assert cpu.isas() == ["avx2"]
    assert cpu.chosen_isa() == "avx2"
    monkeypatch.setenv(cpu.ISA_ENV, "avx512")
    with pytest.raises(RuntimeError, match="cannot run it .lacks avx512_vnni, avx512bw"):
        cpu.chosen_isa()
    monkeypatch.setenv(cpu.ISA_ENV, "sse2")
    with pytest.raises(ValueError, match="known builds are avx2, avx512"):
        cpu.chosen_isa()


def test_fused_layers_may_store_a_matrix_in_different_numbers_of_parts():
    """Layers of one model split a matrix differently (Q4_K_M keeps v in Q6_K in some layers
    only): layer 0's qkv in two parts, layer 1's in one, against both in one part."""
    import dataclasses
    from types import SimpleNamespace

    g = torch.Generator().manual_seed(0)
    hidden, hq, hkv, dim, inter = 64, 2, 1, 32, 64
    r = lambda *shape: torch.randn(*shape, generator=g) * 0.1  # noqa: E731
    qkv = r((hq + 2 * hkv) * dim, hidden)
    one = DecoderLayerWeights(
        input_norm=torch.ones(hidden), qkv=(Weight(qkv),), o=(Weight(r(hidden, hq * dim)),),
        mlp_norm=torch.ones(hidden), gate_up=(Weight(r(2 * inter, hidden)),),
        down=(Weight(r(hidden, inter)),),
    )  # fmt: skip
    two = dataclasses.replace(one, qkv=(Weight(qkv[:96]), Weight(qkv[96:])))
    int32 = functools.partial(torch.tensor, dtype=torch.int32)
    meta = SimpleNamespace(
        slot_mapping=torch.tensor([5]), block_tables=int32([[0, 1]]), seq_lens=int32([6]),
        prefix_lens=int32([5]), cu_seqlens_q=int32([0, 1]), num_decodes=1, window=0,
    )  # fmt: skip
    x, cache = r(1, hidden), (r(2, 4, hkv, dim), r(2, 4, hkv, dim))
    rope = [(torch.ones(1, dim), torch.zeros(1, dim))] * 2
    config = (1e-6, 0.0, dim**-0.5, hq, "silu")

    def run(layers):
        caches = [tuple(c.clone() for c in cache) for _ in layers]
        return cpu.decoder_layers(x, rope, layers, caches, [meta, meta], config)

    torch.testing.assert_close(run([two, one]), run([one, one]), rtol=1e-6, atol=1e-6)

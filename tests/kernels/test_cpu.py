"""The C++ CPU kernels (kernels.cpu) against their plain torch counterparts.

Every op is compared with the reference the torch path runs (kernels.reference, models.layers,
F.linear) on shapes that cover the kernels' edge cases: row counts on both sides of the few-rows
and tiled paths and with remainders, feature counts that are not multiples of the vector width,
windows that wrap the block ring, a value cache that is a strided view of the key cache (MLA),
and slots to skip. A model fitted to the kernels (``CpuBackend.prepare``) keeps its parameters and
its outputs.
"""

from __future__ import annotations

import dataclasses
import functools
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kernels import cpu, reference
from kernels.backend import AttentionMetadata, get_backend
from kernels.reference import apply_rope
from kernels.weights import DecoderLayerWeights, Weight
from models.layers import ACTIVATIONS, GatedMLP, RMSNorm

why = cpu.load()
pytestmark = pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}")


@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 6, 7, 8, 13, 17, 64])
@pytest.mark.parametrize("k", [64, 72, 61, 605])
def test_linear_matches_f_linear(rows, k):
    torch.manual_seed(rows * 100 + k)
    x, w, b = torch.randn(rows, k), torch.randn(37, k), torch.randn(37)
    torch.testing.assert_close(cpu.linear(x, Weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-4)
    torch.testing.assert_close(cpu.linear(x, Weight(w, b)), F.linear(x, w, b), rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows,k,n", [(200, 1030, 29), (8000, 16, 29), (40, 576, 103)])
def test_linear_of_many_rows_in_whole_and_partial_tiles(rows, k, n):
    torch.manual_seed(rows)
    x, w, b = torch.randn(rows, k), torch.randn(n, k), torch.randn(n)
    torch.testing.assert_close(cpu.linear(x, Weight(w, b)), F.linear(x, w, b), rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [1, 2, 5, 8, 9, 40])
def test_16_bit_matrices_times_float32_inputs(isa, dtype, rows):
    """float16 / bfloat16 parts (beside a float32 one, biases float32) are widened exactly:
    the products are float64's over the same 16-bit values, in every tile and tail."""
    torch.manual_seed(rows)
    k, x = 605, torch.randn(rows, 605)
    w = torch.randn(29, k).to(dtype)
    wide = torch.randn(10, k)
    b = torch.randn(29)
    parts = (Weight(w[:13], b[:13]), Weight(wide), Weight(w[13:]))
    got = cpu.linear(x, parts, isa)
    expected = x.double() @ torch.cat([w[:13].double(), wide.double(), w[13:].double()]).T
    expected[:, :13] += b[:13].double()
    torch.testing.assert_close(got.double(), expected, rtol=1e-5, atol=1e-4)


def test_linear_keeps_leading_dims_and_reads_non_contiguous_input():
    x = torch.randn(2, 3, 40)[:, :, :32]
    w = torch.randn(24, 32)
    assert cpu.linear(x, Weight(w)).shape == (2, 3, 24)
    torch.testing.assert_close(cpu.linear(x, Weight(w)), F.linear(x, w), rtol=1e-5, atol=1e-4)


def test_linear_refuses_other_dtypes_and_mismatched_features():
    with pytest.raises(RuntimeError, match="float32"):
        cpu.linear(torch.randn(1, 8, dtype=torch.bfloat16), Weight(torch.randn(4, 8)))
    with pytest.raises(RuntimeError, match=r"unknown format \(GGML type -1\)"):
        cpu.linear(torch.randn(1, 8), Weight(torch.randn(4, 8, dtype=torch.float64)))
    with pytest.raises(RuntimeError, match="features"):
        cpu.linear(torch.randn(1, 9), Weight(torch.randn(4, 8)))


def _paged(lens, bs, heads, dim, window, seed, filled=None):
    """Caches holding each sequence's context (its first ``filled`` positions, default all of
    ``lens``) through a shuffled block table; NaN elsewhere."""
    g = torch.Generator().manual_seed(seed)
    width = max((n + bs - 1) // bs for n in lens) if not window else (window + bs - 1) // bs + 1
    n_blocks = len(lens) * width + 3
    k_cache = torch.full((n_blocks, bs, heads, dim), float("nan"))
    v_cache = torch.full((n_blocks, bs, heads, dim), float("nan"))
    tables = torch.randperm(n_blocks, generator=g)[: len(lens) * width].view(len(lens), width)
    for i, n in enumerate(lens if filled is None else filled):
        first = max(0, n - window) if window else 0
        pos = torch.arange(first, n)
        logical = pos // bs % width if window else pos // bs
        blocks, offsets = tables[i, logical], pos % bs
        k_cache[blocks, offsets] = torch.randn(len(pos), heads, dim, generator=g)
        v_cache[blocks, offsets] = torch.randn(len(pos), heads, dim, generator=g)
    return k_cache, v_cache, tables.int(), torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize(
    "lens,hq,hkv,window",
    [
        ([1], 4, 4, 0),
        ([5, 33, 17], 9, 3, 0),
        ([40, 7, 64], 8, 1, 0),
        ([70, 9], 4, 2, 24),
        ([300], 9, 3, 0),  # one sequence: its context in parts, merged
        ([257], 4, 1, 100),  # in parts over a window's ring
    ],
)
def test_decode_attention_matches_reference(lens, hq, hkv, window):
    k_cache, v_cache, tables, seq_lens = _paged(lens, 8, hkv, 64, window, seed=len(lens))
    q = torch.randn(len(lens), hq, 64)
    ours = cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window)
    ref = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window)
    assert not ours.isnan().any()
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_decode_attention_reads_a_strided_value_view_as_mla_does():
    k_cache, _, tables, seq_lens = _paged([19, 6], 4, 1, 80, 0, seed=3)
    v_cache = k_cache[..., :64]  # the latent part of each key row
    q = torch.randn(2, 5, 80)
    ours = cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, 0)
    ref = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, 0)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_write_cache_matches_reference_and_skips_minus_one():
    cache, expected = torch.zeros(4, 8, 2, 16), torch.zeros(4, 8, 2, 16)
    rows = torch.randn(5, 2, 16)
    slots = torch.tensor([3, -1, 31, 8, -1])
    cpu.write_cache(cache, rows, slots)
    reference.write_cache(expected, rows, slots)
    assert torch.equal(cache, expected)
    with pytest.raises(RuntimeError, match="outside"):
        cpu.write_cache(cache, rows[:1], torch.tensor([32]))


def test_cpu_backend_decodes_other_query_and_cache_dtypes():
    backend = get_backend("cpu", torch.device("cpu"))
    k_cache, v_cache, tables, seq_lens = _paged([9, 3], 4, 2, 32, 0, seed=5)
    q = torch.randn(2, 4, 32)
    meta = AttentionMetadata(
        slot_mapping=torch.full((2,), -1), block_tables=tables, seq_lens=seq_lens,
        prefix_lens=seq_lens - 1, cu_seqlens_q=torch.arange(3, dtype=torch.int32),
        num_decodes=2,
    )  # fmt: skip
    ref = reference.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.2, 0)
    torch.testing.assert_close(backend.decode(q, (k_cache, v_cache), meta, 0.2), ref)
    half = backend.decode(q.bfloat16(), (k_cache.bfloat16(), v_cache.bfloat16()), meta, 0.2)
    torch.testing.assert_close(half.float(), ref, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("offset", [0.0, 1.0])
def test_rms_norm_matches_the_module(offset):
    norm = RMSNorm(72, 1e-6, offset)
    nn.init.normal_(norm.weight)
    x = torch.randn(5, 3, 72) * 4
    ours = cpu.rms_norm(x, norm.weight, norm.eps, norm.offset)
    torch.testing.assert_close(ours, norm(x), rtol=1e-5, atol=1e-5)


def test_rope_matches_the_torch_rotation():
    x = torch.randn(6, 3, 64)[:, :, :]
    pos = torch.arange(6).float()[:, None] * torch.rand(32)[None, :]
    cos, sin = torch.cat([pos, pos], -1).cos(), torch.cat([pos, pos], -1).sin()
    torch.testing.assert_close(cpu.rope(x, cos, sin), apply_rope(x, cos, sin), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("activation", sorted(ACTIVATIONS))
def test_gated_activation_matches_the_module(activation):
    mlp = GatedMLP(40, 56, activation, bias=True)
    x = torch.randn(3, 40)
    with torch.no_grad():
        ours = mlp.down_proj(cpu.gated_act(mlp.gate_up_proj(x), activation))
        torch.testing.assert_close(ours, mlp(x), rtol=1e-5, atol=1e-5)


def _plain_and_fast(model_dir):
    from models.config import ModelConfig
    from models.loader import load_model

    cfg = ModelConfig.from_dir(model_dir)
    plain = load_model(cfg, torch.float32, torch.device("cpu"))
    fast = load_model(cfg, torch.float32, torch.device("cpu"))
    assert get_backend("cpu", torch.device("cpu")).prepare(fast) > 0
    return cfg, plain, fast


def test_a_model_on_the_kernels_keeps_parameters_ties_and_logits(tiny_llama_dir):
    cfg, plain, fast = _plain_and_fast(tiny_llama_dir)
    plain_params = dict(plain.named_parameters())
    fast_params = dict(fast.named_parameters())
    assert plain_params.keys() == fast_params.keys()
    for name, p in plain_params.items():
        assert torch.equal(p, fast_params[name]), name
    if cfg.get("tie_word_embeddings", False):
        assert fast.lm_head.weight is fast.model.embed_tokens.weight
    x = torch.randn(4, cfg.hidden_size)
    layer_plain, layer_fast = plain.model.layers[0], fast.model.layers[0]
    torch.testing.assert_close(
        layer_fast.mlp(layer_fast.post_attention_layernorm(x)),
        layer_plain.mlp(layer_plain.post_attention_layernorm(x)),
        rtol=1e-5,
        atol=1e-5,
    )
    torch.testing.assert_close(
        fast.compute_logits(x), plain.compute_logits(x), rtol=1e-5, atol=1e-4
    )


@pytest.mark.parametrize("tied", [False, True])
def test_a_16_bit_model_narrows_its_matrices_once_and_keeps_float32_activations(tmp_path, tied):
    from models.config import ModelConfig
    from models.loader import load_model
    from tests.helpers import save_tiny_llama

    save_tiny_llama(tmp_path, tie_word_embeddings=tied)
    cfg = ModelConfig.from_dir(tmp_path)
    backend = get_backend("cpu", torch.device("cpu"), weights=torch.bfloat16)
    assert backend.load_dtype(torch.bfloat16) == torch.float32
    plain = load_model(cfg, torch.float32, torch.device("cpu"))
    model = load_model(cfg, torch.float32, torch.device("cpu"))
    backend.prepare(model)
    matrices = [m for m in model.modules() if hasattr(m, "parts")]
    assert len(matrices) == 4 * cfg.num_layers + 1
    assert {p.data.dtype for m in matrices for p in m.parts} == {torch.bfloat16}
    embed = model.model.embed_tokens
    assert embed.data.dtype == torch.bfloat16
    assert (embed.data.data_ptr() == model.lm_head.parts[0].data.data_ptr()) == tied
    assert {p.dtype for p in model.parameters() if p.dim() == 1} == {torch.float32}
    ids = torch.tensor([3, 1, 4])
    rounded = plain.model.embed_tokens.weight[ids].bfloat16().float()
    assert torch.equal(embed(ids), rounded) and embed(ids).dtype == torch.float32
    x = torch.randn(3, cfg.hidden_size)
    head = plain.lm_head.weight.bfloat16().double()
    torch.testing.assert_close(
        model.compute_logits(x).double(), x.double() @ head.T, rtol=1e-5, atol=1e-4
    )


@pytest.fixture(scope="module")
def tiny_gemma3_dir(tmp_path_factory):
    from tests.helpers import save_tiny_gemma3

    path = tmp_path_factory.mktemp("tiny-gemma3")
    save_tiny_gemma3(path)
    return path


@pytest.fixture(scope="module")
def tiny_biased_llama_dir(tmp_path_factory):
    from tests.helpers import save_tiny_llama

    path = tmp_path_factory.mktemp("tiny-biased-llama")
    save_tiny_llama(path, attention_bias=True)
    return path


@pytest.mark.parametrize(
    "model,seqs,threads",
    [  # (cached tokens, new tokens) per sequence, decodes first
        ("llama", [(0, 1)], None),
        ("llama", [(149, 1)], None),  # attention over parts of the context
        ("llama", [(4, 1), (32, 1), (16, 1), (7, 1)], None),
        ("llama", [(4, 1), (32, 1), (16, 1), (7, 1)], 3),  # shares of uneven sizes
        ("llama", [(3 * i, 1) for i in range(13)], None),  # past FEW rows: the tiles
        ("llama", [(0, 37)], None),  # a prompt: blocks of query rows
        ("llama", [(8, 1), (40, 1), (13, 37), (5, 0), (0, 6)], None),  # decodes and chunks
        ("llama", [(70, 50)], 3),  # a chunk after a long prefix
        ("biased_llama", [(8, 1), (0, 1), (29, 1)], 1),
        ("biased_llama", [(3, 1), (0, 12)], 1),
        ("gemma3", [(69, 1), (8, 1), (32, 1)], None),  # a sliding window over its ring
        ("gemma3", [(39, 1), (1, 1)], 1),
        ("gemma3", [(40, 1), (10, 50), (0, 45)], None),  # chunks longer than the window
    ],
)
def test_fused_decoder_layers_match_the_modules_and_write_the_same_caches(
    request, monkeypatch, model, seqs, threads
):
    """A step of decodes and prefill chunks through every layer of the model in one kernel call
    (the CPU backend) against the modules layer by layer (the torch backend): hidden states
    and caches."""
    if threads is not None:
        before = torch.get_num_threads()
        torch.set_num_threads(threads)
        request.addfinalizer(lambda: torch.set_num_threads(before))
    cfg, plain, fast = _plain_and_fast(request.getfixturevalue(f"tiny_{model}_dir"))
    assert len(type(plain).kv_cache_groups(cfg, "float32")) == (2 if model == "gemma3" else 1)
    (out_fast, caches_fast), (out_plain, caches_plain) = run_step(
        cfg, fast, plain, seqs, monkeypatch
    )
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-4, atol=1e-4)
    for ours, ref in zip(caches_fast, caches_plain):
        for a, c in zip(ours, ref):
            torch.testing.assert_close(a, c, rtol=1e-5, atol=1e-5, equal_nan=True)


def run_step(cfg, fast, plain, seqs, monkeypatch, plain_backend="torch"):
    """One step of ``seqs`` ((cached tokens, new tokens) per sequence, decodes first) through
    ``fast`` on the CPU backend, checked to be one ``cpu.decoder_layers`` call, and through
    ``plain`` on ``plain_backend`` (a name or a backend): each one's (hidden states, caches)."""
    from kernels.paged import AttentionMetadata, ForwardContext

    bs, b = 8, len(seqs)
    prefix = torch.tensor([p for p, _ in seqs], dtype=torch.int32)
    new = torch.tensor([n for _, n in seqs])
    seq_lens = prefix + new.int()
    num_decodes = next((i for i, (_, n) in enumerate(seqs) if n != 1), b)
    row = torch.repeat_interleave(torch.arange(b), new)  # each new token's sequence
    cu = torch.zeros(b + 1, dtype=torch.int32)
    cu[1:] = new.cumsum(0)
    pos = prefix[row].long() + torch.arange(len(row)) - cu[row].long()
    # A decode's own position holds an older value (it is read back if its slot is -1); a
    # chunk's cached prefix only.
    filled = [p + 1 if i < num_decodes else p for i, (p, _) in enumerate(seqs)]
    groups = type(plain).kv_cache_groups(cfg, "float32")
    layer_to_group = [0] * cfg.num_layers
    metas, caches = [], [None] * cfg.num_layers
    for g, group in enumerate(groups):
        window = getattr(group.spec, "window_size", 0)
        k_cache, v_cache, tables, _ = _paged(
            seq_lens.tolist(), bs, cfg.num_kv_heads, cfg.head_dim, window, 11 + g, filled
        )
        for layer in group.layer_ids:
            layer_to_group[layer] = g
            caches[layer] = (k_cache, v_cache)
        width = tables.shape[1]
        logical = pos // bs % width if window else pos // bs
        slots = tables[row, logical].long() * bs + pos % bs
        if window:  # within a chunk the ring wraps: only the last width * bs tokens are kept
            slots[pos < (seq_lens.long() - width * bs)[row]] = -1
        if len(row) > 1:
            slots[1] = -1  # a token whose K/V is not kept (the scheduler's -1)
        metas.append(
            AttentionMetadata(
                slot_mapping=slots,
                block_tables=tables,
                seq_lens=seq_lens,
                prefix_lens=prefix,
                cu_seqlens_q=cu,
                num_decodes=num_decodes,
                window=window,
            )  # fmt: skip
        )
    ids = torch.randint(0, cfg.vocab_size, (len(row),), generator=torch.Generator().manual_seed(1))

    def run(m, backend):
        copies = [(k.clone(), v.clone()) for k, v in caches]
        if isinstance(backend, str):
            backend = get_backend(backend, torch.device("cpu"))
        ctx = ForwardContext(backend, metas, copies, tuple(layer_to_group))
        return m(ids, pos, ctx), copies, ctx

    calls = []
    fused = cpu.decoder_layers
    monkeypatch.setattr(cpu, "decoder_layers", lambda *a, **k: calls.append(1) or fused(*a, **k))
    out_plain, caches_plain, _ = run(plain, plain_backend)
    out_fast, caches_fast, _ = run(fast, "cpu")
    assert calls == [1]  # all the layers in one call
    return (out_fast, caches_fast), (out_plain, caches_plain)


def _tiny_layer():
    """One tiny layer's weights and a function running one decode through it by
    ``cpu.decoder_layers`` (the same input and caches each call)."""
    g = torch.Generator().manual_seed(0)
    hidden, hq, hkv, dim, inter, bs = 16, 2, 1, 8, 12, 4

    def r(*shape):
        return torch.randn(*shape, generator=g) * 0.1

    weights = DecoderLayerWeights(
        input_norm=torch.ones(hidden), qkv=(Weight(r((hq + 2 * hkv) * dim, hidden)),),
        o=(Weight(r(hidden, hq * dim)),), mlp_norm=torch.ones(hidden),
        gate_up=(Weight(r(2 * inter, hidden)),), down=(Weight(r(hidden, inter)),),
    )  # fmt: skip
    int32 = functools.partial(torch.tensor, dtype=torch.int32)
    meta = SimpleNamespace(  # the fields of AttentionMetadata that the kernel reads
        slot_mapping=torch.tensor([5]), block_tables=int32([[0, 1]]), seq_lens=int32([6]),
        prefix_lens=int32([5]), cu_seqlens_q=int32([0, 1]), num_decodes=1, window=0,
    )  # fmt: skip
    x, caches = r(1, hidden), [(r(2, bs, hkv, dim), r(2, bs, hkv, dim))]
    rope, config = [(torch.ones(1, dim), torch.zeros(1, dim))], (1e-6, 0.0, dim**-0.5, hq, "silu")
    return weights, lambda w: cpu.decoder_layers(x, rope, [w], caches, [meta], config)


def test_fused_layer_binds_its_weights_by_name_not_by_position(monkeypatch):
    weights, run = _tiny_layer()
    expected = run(weights)
    named = DecoderLayerWeights.named_tensors
    monkeypatch.setattr(
        DecoderLayerWeights, "named_tensors", lambda w: dict(reversed(named(w).items()))
    )
    assert torch.equal(run(weights), expected)


@pytest.mark.parametrize(
    "change,error",
    [
        (lambda t: {**t, "gate_proj": t["gate_up"]}, "unknown weight name 'gate_proj'"),
        (lambda t: {k: v for k, v in t.items() if k != "down"}, "'down' is missing"),
        (lambda t: {**t, "input_norm": None}, "'input_norm' is missing"),
        (lambda t: {**t, "q_norm": torch.ones(3)}, "'q_norm' has 3 values, not 8"),
    ],
)
def test_fused_layer_refuses_unknown_missing_and_misshapen_weights(monkeypatch, change, error):
    weights, run = _tiny_layer()
    named = DecoderLayerWeights.named_tensors
    monkeypatch.setattr(DecoderLayerWeights, "named_tensors", lambda w: change(named(w)))
    with pytest.raises(RuntimeError, match=error):
        run(weights)


@pytest.mark.parametrize("matrix", ["gate_up", "down"])
def test_fused_layer_refuses_an_mlp_bias_it_would_not_add(matrix):
    weights, run = _tiny_layer()
    (w,) = getattr(weights, matrix)
    biased = dataclasses.replace(weights, **{matrix: (Weight(w.data, torch.ones(w.out_features)),)})
    with pytest.raises(RuntimeError, match=f"'{matrix}_bias' must be None"):
        run(biased)

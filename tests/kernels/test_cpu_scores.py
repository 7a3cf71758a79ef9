"""Importance scores from the C++ CPU kernels, on every build the machine runs, against the torch
reference adding them (``kernels.reference``).

Paged decode attention is compared with ``reference.decode_attention`` directly; prefill chunks,
which only the fused decoder layers read in C++, through a step of the fused layers against the
modules on the torch backend (``reference.prefill_attention``). Scores start random: the kernels
add to them, and the slots of no counted row keep theirs bit for bit. ``score_from`` counts some
sequences, none of others, and cuts chunks in the middle of a block of query rows. Two sequences
sharing a block (a cached prefix) both add to its scores.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from kernels import cpu, reference
from kernels.backend import get_backend
from kernels.kv_quant import KV_DTYPES
from tests.kernels.test_cpu_kv import FUSED_ATOL, model_loader, paged, step_inputs

why = cpu.load()
pytestmark = pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}")

FORMATS = list(KV_DTYPES)
NONE = 2**31 - 1  # a score_from that counts no row (the model runner's NO_SCORES)


def random_scores(cache: torch.Tensor, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.rand(cache.shape[0], cache.shape[1], cache.shape[2], generator=g)


def untouched(scores: torch.Tensor, table: torch.Tensor, lens, counted) -> torch.Tensor:
    """Per slot of ``scores``, whether no counted sequence reads it."""
    read = torch.zeros(scores.shape[0] * scores.shape[1], dtype=torch.bool)
    bs = scores.shape[1]
    for row, n, c in zip(table.long(), lens, counted):
        if c:
            pos = torch.arange(n)
            read[row[pos // bs] * bs + pos % bs] = True
    return ~read


DECODES = {  # query heads, KV heads, lengths, MLA (values a prefix of the key rows)
    "gqa": (8, 2, [1, 15, 16, 17, 33, 70], False),
    "mha": (3, 3, [5, 40, 2], False),
    "parts": (6, 2, [300], False),  # one sequence: its context in parts, merged
    "mla": (5, 1, [1, 17, 40, 129], True),
}


def decode_case(layout: str, fmt: str, bs: int = 16):
    hq, hkv, lens, mla = DECODES[layout]
    dims = (96, 32) if mla else (64, 64)
    k_cache, v_cache, tables, seq_lens = paged(
        lens, bs, hkv, dims, KV_DTYPES[fmt], 0, seed=len(lens), shared_values=mla
    )
    q = torch.randn(len(lens), hq, dims[0], generator=torch.Generator().manual_seed(2))
    # Counted from the first slot, from the query's own (its length - 1), or not (from its
    # length on), in turn.
    froms = [(0, n - 1, n, NONE)[i % 4] for i, n in enumerate(lens)]
    return q, k_cache, v_cache, tables, seq_lens, torch.tensor(froms, dtype=torch.int32)


def tolerance(fmt: str) -> dict:
    return dict(rtol=1e-5, atol=1e-5) if fmt == "float32" else dict(rtol=1e-4, atol=2e-5)


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("layout", sorted(DECODES))
def test_decode_adds_the_scores_the_reference_adds(isa, fmt, layout):
    q, k_cache, v_cache, tables, seq_lens, froms = decode_case(layout, fmt)
    before = random_scores(k_cache, seed=3)
    ours, ref = before.clone(), before.clone()
    args = (q, k_cache, v_cache, tables, seq_lens, q.shape[-1] ** -0.5, 0)
    out = cpu.decode_attention(*args, isa=isa, scores=ours, score_from=froms)
    expected = reference.decode_attention(*args, scores=ref, score_from=froms)
    torch.testing.assert_close(out, expected, **tolerance(fmt))
    torch.testing.assert_close(ours, ref, **tolerance(fmt))
    lens = seq_lens.tolist()
    counted = [n - 1 >= f for n, f in zip(lens, froms.tolist())]
    same = untouched(before, tables, lens, counted).view(before.shape[:2])
    assert torch.equal(ours[same], before[same])
    assert not torch.equal(ours[~same], before[~same]) or not any(counted)


def test_decode_counting_no_row_leaves_the_scores_and_output_as_they_were():
    q, k_cache, v_cache, tables, seq_lens, _ = decode_case("gqa", "bfloat16")
    before = random_scores(k_cache, seed=4)
    scores = before.clone()
    none = torch.full_like(seq_lens, NONE)
    args = (q, k_cache, v_cache, tables, seq_lens, 0.125, 0)
    out = cpu.decode_attention(*args, scores=scores, score_from=none)
    assert torch.equal(scores, before)
    assert torch.equal(out, cpu.decode_attention(*args))


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("lens", [[40, 37, 70], [200, 180]])  # [200, 180]: both in parts
def test_decode_sequences_sharing_blocks_add_both_their_scores(request, threads, lens):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    request.addfinalizer(lambda: torch.set_num_threads(before))
    k_cache, v_cache, tables, seq_lens = paged(lens, 16, 2, (64, 64), torch.float16, 0, seed=7)
    tables[1:, :2] = tables[0, :2]  # a cached prefix of two blocks
    q = torch.randn(len(lens), 4, 64, generator=torch.Generator().manual_seed(1))
    froms = torch.zeros(len(lens), dtype=torch.int32)
    ours, ref = random_scores(k_cache, 5), random_scores(k_cache, 5)
    args = (q, k_cache, v_cache, tables, seq_lens, 0.125, 0)
    cpu.decode_attention(*args, scores=ours, score_from=froms)
    reference.decode_attention(*args, scores=ref, score_from=froms)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)


def test_decode_refuses_scores_over_a_window_and_of_another_shape():
    q, k_cache, v_cache, tables, seq_lens, froms = decode_case("gqa", "float32")
    scores = random_scores(k_cache, 0)
    with pytest.raises(RuntimeError, match="full attention only"):
        cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, 8, scores, froms)
    with pytest.raises(RuntimeError, match="beside the cache"):
        cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.1, 0, scores[..., :1], froms)


def test_cpu_backend_decodes_with_scores_by_the_kernel(monkeypatch):
    from kernels.backend import AttentionMetadata

    q, k_cache, v_cache, tables, seq_lens, froms = decode_case("gqa", "int8")
    calls = []
    kernel = cpu.decode_attention
    monkeypatch.setattr(
        cpu, "decode_attention", lambda *a, **kw: calls.append(1) or kernel(*a, **kw)
    )
    b = len(seq_lens)
    meta = AttentionMetadata(
        slot_mapping=torch.full((b,), -1), block_tables=tables, seq_lens=seq_lens,
        prefix_lens=seq_lens - 1, cu_seqlens_q=torch.arange(b + 1, dtype=torch.int32),
        num_decodes=b, score_from=froms,
    )  # fmt: skip
    ours, ref = random_scores(k_cache, 6), random_scores(k_cache, 6)
    backend = get_backend("cpu", torch.device("cpu"))
    out = backend.decode(q, (k_cache, v_cache), meta, 0.125, ours)
    expected = reference.decode_attention(
        q, k_cache, v_cache, tables, seq_lens, 0.125, scores=ref, score_from=froms
    )
    assert calls == [1]
    torch.testing.assert_close(out, expected, **tolerance("int8"))
    torch.testing.assert_close(ours, ref, **tolerance("int8"))


# The fused decoder layers: a step of decodes and prefill chunks through every layer in one call,
# against the modules on the torch backend, each with its layers' scores.

MODELS = {  # a tiny checkpoint's kind and config overrides
    "llama": ("llama", dict(head_dim=64)),  # two query heads per KV head
    "llama_g3": (
        "llama",
        dict(head_dim=32, hidden_size=96, num_attention_heads=6, num_key_value_heads=2),
    ),
    "gemma3": ("gemma3", {}),  # a sliding layer (never scored) and a full one
}


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory):
    return model_loader(tmp_path_factory, MODELS)


SCORED_STEPS = [  # model, (cached tokens, new tokens) per sequence, score_from (None: no row)
    ("llama", [(0, 1), (15, 1), (16, 1), (40, 1)], [0, 15, 17, None]),
    ("llama", [(149, 1)], [0]),  # a long context in parts
    ("llama", [(10, 37)], [30]),  # counted from the middle of the chunk's second row block
    ("llama", [(8, 1), (31, 1), (16, 20), (15, 17), (0, 6)], [8, None, 16, 40, 0]),
    ("llama_g3", [(33, 1), (1, 1), (70, 50)], [0, 0, 100]),
    ("gemma3", [(40, 1), (10, 50), (0, 45)], [0, 30, 0]),
]

# Per format, how far the two paths' scores may differ: their keys are computed in other orders,
# and a key that rounds to its neighbouring step in one path only moves its probabilities.
SCORES_ATOL = {
    "float32": 1e-5,
    "float16": 2e-3,
    "bfloat16": 4e-3,
    "int8": 4e-3,
    "fp8_e4m3": 2e-2,
    "int4": 5e-2,
}


def scored_step(cfg, model, seqs, froms, dtype, share: bool = False):
    """``step_inputs`` with scores (one tensor per layer of a full-attention group) and its
    metadata's score_from; ``share``: the second sequence reads the first one's first block."""
    ids, pos, caches, metas, layer_to_group = step_inputs(cfg, model, seqs, dtype)
    from_tensor = torch.tensor([NONE if f is None else f for f in froms], dtype=torch.int32)
    metas = [
        m if m.window else dataclasses.replace(m, score_from=from_tensor) for m in metas
    ]  # fmt: skip
    if share:
        metas[0].block_tables[1, 0] = metas[0].block_tables[0, 0]
    scores = [
        None if metas[g].window else random_scores(caches[layer][0], seed=layer)
        for layer, g in enumerate(layer_to_group)
    ]
    return ids, pos, caches, metas, layer_to_group, scores


def run_scored(model, backend, inputs):
    """The model's hidden states over one step, and the caches and scores it leaves (copies)."""
    from kernels.paged import ForwardContext

    ids, pos, caches, metas, layer_to_group, scores = inputs
    copies = [(k.clone(), v.clone()) for k, v in caches]
    kept = [None if s is None else s.clone() for s in scores]
    backend = get_backend(backend, torch.device("cpu"))
    ctx = ForwardContext(backend, metas, copies, layer_to_group, kept)
    with torch.no_grad():
        return model(ids, pos, ctx), copies, kept


def check_fused_scores(monkeypatch, inputs, plain, fast, fmt):
    calls = []
    fused = cpu.decoder_layers
    monkeypatch.setattr(cpu, "decoder_layers", lambda *a, **kw: calls.append(1) or fused(*a, **kw))
    out_plain, _, scores_plain = run_scored(plain, "torch", inputs)
    out_fast, _, scores_fast = run_scored(fast, "cpu", inputs)
    assert calls == [1]  # all the layers in one call
    torch.testing.assert_close(out_fast, out_plain, rtol=1e-4, atol=FUSED_ATOL[fmt])
    ids, pos, caches, metas, layer_to_group, before = inputs
    for layer, (ours, ref) in enumerate(zip(scores_fast, scores_plain)):
        if ref is None:
            assert ours is None
            continue
        torch.testing.assert_close(ours, ref, rtol=1e-4, atol=SCORES_ATOL[fmt])
        # Slots that no counted row reads and that the step does not write keep their scores.
        meta = metas[layer_to_group[layer]]
        lens, froms = meta.seq_lens.tolist(), meta.score_from.tolist()
        counted = [n - 1 >= f for n, f in zip(lens, froms)]
        same = untouched(before[layer], meta.block_tables, lens, counted)
        same[meta.slot_mapping[meta.slot_mapping >= 0]] = False
        same = same.view(before[layer].shape[:2])
        assert torch.equal(ours[same], before[layer][same])


@pytest.mark.parametrize("isa", cpu.isas())
@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("model,seqs,froms", SCORED_STEPS)
def test_fused_layers_add_the_scores_the_modules_add(
    monkeypatch, tiny_model, isa, fmt, model, seqs, froms
):
    monkeypatch.setenv(cpu.ISA_ENV, isa)
    cfg, plain, fast = tiny_model(model)
    inputs = scored_step(cfg, plain, seqs, froms, KV_DTYPES[fmt])
    check_fused_scores(monkeypatch, inputs, plain, fast, fmt)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("seqs", [[(40, 1), (37, 1)], [(20, 30), (18, 40)], [(33, 1), (20, 9)]])
def test_fused_layers_sequences_sharing_a_block_add_both_their_scores(
    request, monkeypatch, tiny_model, threads, seqs
):
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    request.addfinalizer(lambda: torch.set_num_threads(before))
    cfg, plain, fast = tiny_model("llama")
    inputs = scored_step(cfg, plain, seqs, [0, 0], torch.float32, share=True)
    check_fused_scores(monkeypatch, inputs, plain, fast, "float32")

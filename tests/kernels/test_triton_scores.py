"""Importance scores accumulated by the Triton kernels against the torch reference
(``kernels.reference``): ``_decode_scores_kernel`` after split-K decode (its splits'
normalizers combined) and ``_prefill_scores_kernel`` after prefill, over every cache format,
under a float32 and a bf16 model, GQA and MLA latents, ragged lengths, and ``score_from``
cutting a chunk, and a query tile, in two; and the ``triton`` backend's steps.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest), so the shapes are
small. The caches are those of ``test_triton_kv``: slots a kernel must not read are poisoned
(NaN when read), so a read outside a sequence turns its scores into NaN. Scores start random:
a slot that no counted row reads must keep its value exactly, which is what proves that
uncounted rows and sequences add nothing. Two sequences share a block, whose scores both add
to. Tolerances are ``test_triton_kv``'s (1e-4 where the dots run in float32, 2e-2 in 16 bits).
"""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from kernels import reference
from kernels.backend import TorchBackend, TritonBackend
from kernels.paged import ForwardContext
from tests.kernels.test_triton_kv import (
    DEVICE,
    LAYOUTS,
    NAMES,
    QUANTIZED,
    _caches,
    _model_dtype,
    _step_metadata,
    _tolerance,
    step_qkv,
)

triton_attention = pytest.importorskip("kernels.triton_attention")

NEVER = torch.iinfo(torch.int32).max  # a sequence none of whose rows counts
FORMATS = (torch.float32, torch.bfloat16, torch.float16, *QUANTIZED)
CASES = [
    pytest.param(dtype, name, id=f"{NAMES[dtype]}-{name}")
    for dtype in FORMATS
    for name in ("gqa", "mla")
]


def _scores(caches) -> torch.Tensor:
    n, bs, heads = caches.k_cache.shape[:3]
    return torch.rand(n, bs, heads, generator=torch.Generator().manual_seed(9)).to(DEVICE)


def _assert_scores(actual, expected, before, tol: float) -> None:
    assert not actual.isnan().any(), "kernel read a slot outside the sequence"
    assert not torch.equal(expected, before), "the case counts no row"
    untouched = expected == before
    assert torch.equal(actual[untouched], before[untouched]), "an uncounted row added a score"
    torch.testing.assert_close(actual, expected, atol=tol, rtol=tol)


def _int32(values: list[int]) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.int32, device=DEVICE)


def _decode(dtype, layout_name: str, froms: list[int], num_splits: int = 1, model=None):
    """Decodes of 1, 17, 15 and 40 tokens -> the scores the kernels leave, the reference's,
    the scores before, and the tolerance. ``model``: the query's dtype (default
    ``test_triton_kv``'s for the cache)."""
    layout = LAYOUTS[layout_name]
    lens = [1, 17, 15, 40]
    score_from = _int32(froms)
    caches = _caches([(0, n) for n in lens], layout, dtype)
    caches.tables[3, 0] = caches.tables[1, 0]  # a shared prefix block: both add to its scores
    model = model or _model_dtype(dtype)
    gen = torch.Generator().manual_seed(1)
    q = torch.randn(len(lens), layout.num_kv_heads * layout.group, layout.dk, generator=gen)
    q = q.to(DEVICE, model)
    args = (q, caches.k_cache, caches.v_cache, caches.tables, _int32(lens), layout.dk**-0.5)
    before = _scores(caches)
    expected = before.clone()
    out_expected = reference.decode_attention(*args, scores=expected, score_from=score_from)
    actual = before.clone()
    out = triton_attention.decode_attention(
        *args, num_splits=num_splits, scores=actual, score_from=score_from
    )
    tol = _tolerance(model, dtype)
    torch.testing.assert_close(out.float(), out_expected.float(), atol=tol, rtol=tol)
    return actual, expected, before, tol


# Counted: the first two decodes (their queries sit at slots 0 and 16) and the last.
DECODE_FROM = [0, 16, 15, 5]


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_decode_adds_the_reference_scores(dtype, layout):
    _assert_scores(*_decode(dtype, layout, DECODE_FROM))


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_decode_scores_combine_the_splits_normalizers(layout):
    # 3 splits of 40 keys in tiles of 32: the last split is empty (its log-sum-exp -inf).
    _assert_scores(*_decode(torch.float32, layout, DECODE_FROM, num_splits=3))


def _prefill(dtype, layout_name: str, froms: list[int], model=None):
    """Chunks (prefix, new) of (0, 5), (17, 9), (40, 1), (8, 6), as ``_decode``."""
    layout = LAYOUTS[layout_name]
    chunks = [(0, 5), (17, 9), (40, 1), (8, 6)]
    caches = _caches([(0, p) for p, _ in chunks], layout, dtype, reach=[p + n for p, n in chunks])
    model = model or _model_dtype(dtype)
    gen = torch.Generator().manual_seed(2)
    total, kv_heads = sum(n for _, n in chunks), layout.num_kv_heads
    q = torch.randn(total, kv_heads * layout.group, layout.dk, generator=gen).to(DEVICE, model)
    k = torch.randn(total, kv_heads, layout.dk, generator=gen).to(DEVICE, model)
    v = k[..., : layout.dv]
    if not layout.mla:
        v = torch.randn(total, kv_heads, layout.dv, generator=gen).to(DEVICE, model)
    cu = torch.tensor([0] + [n for _, n in chunks], device=DEVICE).cumsum(0).int()
    prefix = _int32([p for p, _ in chunks])
    args = (q, k, v, caches.k_cache, caches.v_cache, caches.tables, cu, prefix, layout.dk**-0.5)
    before = _scores(caches)
    expected, actual = before.clone(), before.clone()
    score_from = _int32(froms)
    reference.prefill_attention(*args, scores=expected, score_from=score_from)
    triton_attention.prefill_attention(*args, scores=actual, score_from=score_from)
    return actual, expected, before, _tolerance(model, dtype)


# Rows from slot 2 of the first chunk and slot 20 of the second (mid-chunk, and in fp32 GQA
# mid-tile: 8 queries of 4 heads a tile), none of the third, all of the fourth.
PREFILL_FROM = [2, 20, NEVER, 0]


@pytest.mark.parametrize(("dtype", "layout"), CASES)
def test_prefill_adds_the_reference_scores(dtype, layout):
    _assert_scores(*_prefill(dtype, layout, PREFILL_FROM))


QUANTIZED_CASES = [
    pytest.param(torch.int8, "gqa", id="int8-gqa"),
    pytest.param(torch.uint8, "mla", id="int4-mla"),
]


@pytest.mark.parametrize(("dtype", "layout"), QUANTIZED_CASES)
def test_scores_of_a_bf16_model_over_a_quantized_cache(dtype, layout):
    # The dots in bf16, the rotated query rounded to it.
    _assert_scores(*_decode(dtype, layout, DECODE_FROM, model=torch.bfloat16))
    _assert_scores(*_prefill(dtype, layout, PREFILL_FROM, model=torch.bfloat16))


@pytest.mark.parametrize("layout", ["gqa", "mla"])
def test_rows_before_score_from_leave_the_scores_alone(layout):
    # score_from one past each sequence's last row: every row is read, none counts.
    for actual, expected, before, _ in (
        _decode(torch.int8, layout, [1, 17, 15, 40]),
        _prefill(torch.int8, layout, [5, 26, 41, 14]),
    ):
        assert torch.equal(expected, before)
        assert torch.equal(actual, before)


@pytest.mark.parametrize(("dtype", "layout"), QUANTIZED_CASES)
def test_backend_steps_add_the_torch_backends_scores(dtype, layout):
    # ``AttentionBackend.forward``: decodes beside prefill chunks, then decodes only; the
    # written slots' scores are cleared, then the counted rows add theirs, by the kernels.
    launched = []

    def run(launch):
        launched.append(launch.kernel.__name__)
        launch()

    layout = LAYOUTS[layout]
    model = _model_dtype(dtype)
    first = [(20, 1), (3, 1), (9, 12), (40, 7)]
    caches = _caches([(0, p) for p, _ in first], layout, dtype, reach=[p + n + 1 for p, n in first])
    ours = (caches.k_cache, caches.v_cache)
    k_copy = caches.k_cache.clone()
    theirs = (k_copy, k_copy[..., : ours[1].shape[-1]] if layout.mla else ours[1].clone())
    our_scores, their_scores = _scores(caches), _scores(caches)
    gen = torch.Generator().manual_seed(6)
    steps = ((first, 2, [0, NEVER, 14, 44]), ([(p + n, 1) for p, n in first], 4, [0, 5, NEVER, 0]))
    for chunks, num_decodes, froms in steps:
        meta = _step_metadata(caches, chunks, num_decodes, layout.window)
        meta = replace(meta, score_from=_int32(froms))
        tokens = sum(n for _, n in chunks)
        q, k, v = step_qkv(layout, tokens, gen, model)
        outs = []
        for backend, kv, scores in ((TritonBackend(run), ours, our_scores),
                                    (TorchBackend(), theirs, their_scores)):  # fmt: skip
            ctx = ForwardContext.planned(backend, [meta], [kv], (0,), [scores])
            outs.append(ctx.attention(0, q, k, v, layout.dk**-0.5))
        tol = _tolerance(model, dtype)
        torch.testing.assert_close(outs[0].float(), outs[1].float(), atol=tol, rtol=tol)
        torch.testing.assert_close(our_scores, their_scores, atol=tol, rtol=tol)
    assert {"_decode_scores_kernel", "_prefill_scores_kernel"} <= set(launched)

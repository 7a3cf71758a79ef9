"""int4 keys quantized per channel over groups of 32 tokens (``kernels.kv_quant``): the codes
against a plain per-channel quantizer written from the format's description, the row sizes
the spec counts, and the paged path (a backend's attention over prefill chunks and decodes,
with the recent rows beside) against attention over the whole sequence, read as the format
promises: a token's last ``recent`` keys as the recent rows hold them, older ones by their
groups."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import pytest
import torch

from kernels import kv_quant, reference
from kernels.backend import AttentionMetadata, get_backend
from models.kv_spec import row_bytes

G = kv_quant.CHANNEL_GROUP


def _isas() -> list[str]:
    from kernels import cpu

    return cpu.isas()


def keys(*shape, seed=0) -> torch.Tensor:
    """Keys with the channel structure of real ones: offsets and a few wide channels."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(*shape, generator=g) + 3 * torch.randn(shape[-1], generator=g)
    x[..., 5] *= 30
    return x


def _f16(v: float, up: bool) -> float:
    """v rounded to a float16 toward +inf (``up``) or -inf."""
    f = np.float16(v)
    if (float(f) < v) if up else (float(f) > v):
        f = np.nextafter(f, np.float16(np.inf if up else -np.inf), dtype=np.float16)
    return float(f)


def plain_quantizer(x: torch.Tensor) -> torch.Tensor:
    """One group [32, H, D] per head and channel, as the module's docstring says: grid ends
    in float16 rounded outwards, a minimum code rounded down, a scale code rounded up."""
    out = torch.empty_like(x, dtype=torch.float64)
    for h in range(x.shape[1]):
        col = x[:, h].double()
        lo, hi = col.min(0).values.tolist(), col.max(0).values.tolist()
        lo0 = _f16(min(lo), up=False)
        dlo = _f16((max(lo) - lo0) / 255, up=True) or 1.0
        lows = [lo0 + min(255, max(0, math.floor((a - lo0) / dlo))) * dlo for a in lo]
        spans = [(b - a) / 15 for a, b in zip(lows, hi)]
        ds = _f16(max(spans) / 255, up=True) or 1.0
        for d, (low, span) in enumerate(zip(lows, spans)):
            s = min(255, math.ceil(span / ds)) * ds
            q = ((col[:, d] - low) / s).round().clamp(0, 15) if s else 0
            out[:, h, d] = low + s * q
    return out.float()


@pytest.mark.parametrize("dim", [32, 64, 128, 256])
def test_rows_take_the_bytes_the_spec_counts_and_read_back_as_the_plain_quantizer(dim):
    x = keys(2, G, 2, dim)
    stored = kv_quant.quantize_channels(x)
    assert stored.dtype == torch.uint8 and kv_quant.per_channel(stored)
    assert stored.shape[-1] == row_bytes("int4", dim, keys=True) == row_bytes("int4", dim) + 1
    assert kv_quant.value_dim(stored) == dim
    got = kv_quant.dequantize_channels(stored)
    for i in range(2):
        torch.testing.assert_close(got[i], plain_quantizer(x[i]).float(), atol=1e-4, rtol=1e-5)
    # Each value within half a step of its channel's range over 15 steps (and the codes'
    # rounding, at most a step of either grid).
    span = (x.amax(1, keepdim=True) - x.amin(1, keepdim=True)) / 15
    assert ((got - x).abs() <= span * 0.5 + span / 8 + 1e-3 * x.abs().amax()).all()


def test_whole_blocks_go_back_and_forth_per_group():
    x = keys(3, 2 * G, 2, 64)
    cache = torch.zeros(3, 2 * G, 2, row_bytes("int4", 64, keys=True), dtype=torch.uint8)
    cache[:] = kv_quant.store_blocks(x, cache)
    got = kv_quant.read_blocks(cache)
    torch.testing.assert_close(got[:, :G], kv_quant.fake_quantize_channels(x[:, :G]))
    torch.testing.assert_close(got[:, G:], kv_quant.fake_quantize_channels(x[:, G:]))


@dataclass
class OneLayer:
    """A step of one layer (``kernels.backend.Step``) with its recent rows."""

    cache: tuple
    meta: AttentionMetadata
    ring: tuple
    ring_meta: AttentionMetadata

    def layer(self, layer_id):
        return self.cache, self.meta

    def layer_scores(self, layer_id):
        return None

    def recent(self, layer_id):
        return self.ring, self.ring_meta


def _meta(table, starts, lens, bs, window=0, decodes=0):
    """Metadata of sequences at ``starts`` with ``lens`` new tokens, their blocks ``table``."""
    width = table.shape[1]
    slots, cu = [], [0]
    for i, (s, n) in enumerate(zip(starts, lens)):
        for p in range(s, s + n):
            logical = p // bs % width if window else p // bs
            # Within one chunk a ring wraps: only its last width * bs tokens are written.
            kept = not window or p >= s + n - width * bs
            slots.append(int(table[i, logical]) * bs + p % bs if kept else -1)
        cu.append(cu[-1] + n)
    return AttentionMetadata(
        torch.tensor(slots), table.int(), torch.tensor([s + n for s, n in zip(starts, lens)]).int(),
        torch.tensor(starts).int(), torch.tensor(cu).int(), decodes, window,
    )  # fmt: skip


@pytest.mark.parametrize("backend", ["torch", "cpu"])
@pytest.mark.parametrize("recent,bs", [(32, 32), (45, 64)])
def test_attention_over_steps_reads_older_keys_by_their_groups(backend, recent, bs):
    """Two sequences through prefill chunks of several sizes (one straddling a group, one
    longer than the recent rows), then decodes, against attention over the whole sequence."""
    if backend == "cpu":
        from kernels import cpu

        if cpu.load() is not None:
            pytest.skip("the cpu kernels do not build here")
    be = get_backend(backend, torch.device("cpu"), False, False, torch.float32)
    h, hq, d, n_seq, length = 2, 4, 64, 2, 170
    g = torch.Generator().manual_seed(1)
    k_all = keys(n_seq, length, h, d, seed=2)
    v_all = torch.randn(n_seq, length, h, d, generator=g)
    q_all = torch.randn(n_seq, length, hq, d, generator=g)
    blocks = -(-length // bs)
    table = torch.arange(n_seq * blocks).view(n_seq, blocks)
    ring_len = -(-recent // bs) + 1
    ring_table = torch.arange(n_seq * ring_len).view(n_seq, ring_len) + 1
    cache = (
        torch.zeros(n_seq * blocks, bs, h, row_bytes("int4", d, keys=True), dtype=torch.uint8),
        torch.zeros(n_seq * blocks, bs, h, row_bytes("int4", d), dtype=torch.uint8),
    )
    ring = tuple(torch.zeros(n_seq * ring_len + 1, bs, h, d, dtype=torch.float16) for _ in "kv")
    scale = d**-0.5
    # The whole sequence read as the caches give it back: older keys by groups (of the values
    # the recent rows hold), values per token, the recent ones as float16 holds them.
    k_old = kv_quant.fake_quantize_channels(k_all[:, : length // G * G].half().float())
    k_old = torch.cat([k_old, k_all[:, length // G * G :]], 1)
    v_old = kv_quant.fake_quantize(v_all, torch.uint8)
    k_new, v_new = k_all.half().float(), v_all.half().float()

    def expected(i, t):
        p = torch.arange(t + 1)
        near = (p > t - recent)[:, None, None]
        kk, vv = (
            torch.where(near, k_new[i, : t + 1], k_old[i, : t + 1]),
            torch.where(near, v_new[i, : t + 1], v_old[i, : t + 1]),
        )
        qq = q_all[i, t].view(h, hq // h, d)
        p = torch.softmax(torch.einsum("hgd,phd->hgp", qq, kk) * scale, -1)
        return torch.einsum("hgp,phd->hgd", p, vv).reshape(hq, d)

    steps = [(37, 21), (40, 70), (60, 1), (1, 1)] + [(1, 1)] * 12
    pos = [0, 0]
    for a, b in steps:
        lens = [min(a, length - pos[0]), min(b, length - pos[1])]
        decodes = 2 if lens == [1, 1] else 0
        meta = _meta(table, pos, lens, bs, decodes=decodes)
        ring_meta = _meta(ring_table, pos, lens, bs, window=recent, decodes=decodes)
        rows = [range(pos[i], pos[i] + lens[i]) for i in range(2)]
        new = [
            torch.cat([x[i, list(r)] for i, r in enumerate(rows)]) for x in (q_all, k_all, v_all)
        ]
        out = be.forward(*new, 0, OneLayer(cache, meta, ring, ring_meta), scale)
        want = torch.stack([expected(i, t) for i, r in enumerate(rows) for t in r])
        torch.testing.assert_close(out, want, atol=2e-4, rtol=1e-4)
        pos = [p + n for p, n in zip(pos, lens)]


def _blocks(n: int, bs: int, h: int, d: int, fmt: str, seed: int) -> torch.Tensor:
    """n blocks of random rows in ``fmt``: int4 keys by their groups."""
    x = keys(n, bs, h, d, seed=seed)
    if fmt == "int4 keys":
        return kv_quant.quantize_channels(x.unflatten(1, (-1, G))).flatten(1, 2)
    return kv_quant.quantize(x, kv_quant.KV_DTYPES[fmt])


@pytest.mark.parametrize("isa", _isas())
@pytest.mark.parametrize("value", ["int4", "int8"])
@pytest.mark.parametrize(
    "lens,hq,window,recent,bs",
    [([40, 200, 97], 4, 0, 32, 32), ([300], 8, 0, 45, 64), ([150, 70], 4, 100, 32, 32)],
)
def test_cpu_paged_decode_reads_int4_keys_by_their_groups(isa, value, lens, hq, window, recent, bs):
    """The C++ kernels' paged decode (every build this CPU runs; one long sequence cut in
    parts) against the reference, older keys per channel beside recent rows in float16."""
    from kernels import cpu

    h, d = 2, 64
    width = -(-window // bs) + 1 if window else -(-max(lens) // bs)
    ring = -(-recent // bs) + 1
    k_cache = _blocks(len(lens) * width, bs, h, d, "int4 keys", 1)
    v_cache = _blocks(len(lens) * width, bs, h, d, value, 2)
    rk, rv = (_blocks(len(lens) * ring, bs, h, d, "float16", s) for s in (3, 4))
    tables = torch.randperm(len(lens) * width).view(len(lens), width).int()
    rtables = torch.randperm(len(lens) * ring).view(len(lens), ring).int()
    seq_lens = torch.tensor(lens).int()
    q = torch.randn(len(lens), hq, d, generator=torch.Generator().manual_seed(5))
    ours = cpu.decode_attention(q, k_cache, v_cache, tables, seq_lens, 0.125, window, isa=isa,
                                recent=(rk, rv, rtables, recent))  # fmt: skip
    ref = reference.recent_decode_attention(q, k_cache, v_cache, tables, seq_lens, rk, rv,
                                            rtables, recent, 0.125, window)  # fmt: skip
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)

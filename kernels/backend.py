"""Attention backends: one typed interface, a name registry, chosen once per engine.

A backend owns every operation on the paged cache: writing new K/V, prefill and decode
attention, re-rotating cached keys after a context shift, and copying whole blocks (swap). It
takes a step as one object, as mini-sglang's backends take their batch: a layer's cache and its
KV-cache group's ``AttentionMetadata`` (``kernels.paged.ForwardContext`` holds them by layer).
``torch`` is the plain reference; ``cpu`` is it with the C++ kernels of ``kernels.cpu`` (caches
in every format of ``kernels.kv_quant``; the default on CPU where they build), which can also run
a float32 model's linear layers (``prepare``) and whole decoder layers in one call
(``decoder_layers``); ``triton`` runs the Triton kernels on CUDA. Shapes are those of
``kernels.reference``.

The model runner orders each step's sequences decodes first (one new token each), then prefill
chunks; ``AttentionMetadata.decodes`` and ``.prefills`` are the two parts as metadata of their
own, which is what ``decode`` and ``prefill`` take::

    sequences:  [ d0  d1  d2 | p0 ------ | p1 --- ]     num_decodes = 3
    rows:         0   1   2    3 ... 8     9 .. 11      cu_seqlens_q = [0, 1, 2, 3, 9, 12]
    decodes:    [ d0  d1  d2 ]                          cu_seqlens_q = [0, 1, 2, 3]
    prefills:                [ p0 ------ | p1 --- ]     cu_seqlens_q = [0, 6, 9]
"""

from __future__ import annotations

import functools
from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from kernels import reference
from kernels.kv_quant import CHANNEL_GROUP, per_channel
from kernels.launch import Launch, Launcher
from kernels.rotary import RopeLayout, delta_cos_sin, rotate_reference
from kernels.weights import DENSE_TYPES, DecoderLayerWeights, Weight

KVCache = tuple[torch.Tensor, torch.Tensor]  # a layer's (k_cache, v_cache); v may view k (MLA)


@dataclass(frozen=True)
class AttentionMetadata:
    """Tensors of one KV-cache group for one step (B sequences, T new tokens). The block size
    is the cache's (``kv_cache[0].shape[1]``), not repeated here."""

    slot_mapping: torch.Tensor  # int64 [T], -1 = do not write
    block_tables: torch.Tensor  # int32 [B, W]
    seq_lens: torch.Tensor  # int32 [B], context length after this step
    prefix_lens: torch.Tensor  # int32 [B], tokens cached before this step
    cu_seqlens_q: torch.Tensor  # int32 [B + 1], rows of new tokens per sequence
    num_decodes: int  # the first num_decodes sequences have exactly one new token
    window: int = 0
    decode_plan: Any = None  # ``plan_decode``'s, made once per step for every layer of the group
    # int32 [B]: rows at or after this slot add their attention to the keys' importance scores
    # (``kernels.reference``); None: no row does.
    score_from: torch.Tensor | None = None

    @functools.cached_property
    def decodes(self) -> AttentionMetadata:
        """The first ``num_decodes`` sequences alone, with the decode plan (views: made once
        per step, and valid inside a captured CUDA graph)."""
        nd = self.num_decodes
        if nd == self.seq_lens.shape[0]:
            return self
        return AttentionMetadata(
            self.slot_mapping[:nd], self.block_tables[:nd], self.seq_lens[:nd],
            self.prefix_lens[:nd], self.cu_seqlens_q[: nd + 1], nd, self.window, self.decode_plan,
            None if self.score_from is None else self.score_from[:nd],
        )  # fmt: skip

    @functools.cached_property
    def prefills(self) -> AttentionMetadata:
        """The prefill chunks alone, their rows counted from 0."""
        nd = self.num_decodes
        if nd == 0:
            return self
        return AttentionMetadata(
            self.slot_mapping[nd:], self.block_tables[nd:], self.seq_lens[nd:],
            self.prefix_lens[nd:], self.cu_seqlens_q[nd:] - nd, 0, self.window,
            score_from=None if self.score_from is None else self.score_from[nd:],
        )  # fmt: skip


@dataclass(frozen=True)
class Rotary:
    """How a layer turns its new queries and keys before attention: RMSNorm per head first
    where ``norms`` gives (q weight, k weight, eps, offset) (Gemma 3), then rotary by cos/sin
    [T, D] (half-split, ``reference.apply_rope``), then ``key_offset`` [Hkv, D] subtracted from
    the keys (``models.llama.LlamaAttention.center_keys``). Handed to the backend with the
    projections, so that a decode step turns and writes them in one kernel."""

    cos: torch.Tensor
    sin: torch.Tensor
    key_offset: torch.Tensor | None = None
    norms: tuple[torch.Tensor, torch.Tensor, float, float] | None = None


@dataclass(frozen=True)
class LatentRotary:
    """How an MLA layer makes its query and cached row (``models.deepseek_v3``): the latent
    normalized by RMSNorm ``norm`` (weight, eps), the rotary parts (its queries' and the key's)
    rotated by cos/sin [T, P / 2] over pairs (``reference.apply_rope_pairs``: ``interleave``
    pairs neighbours, DeepSeek's layout), each row written half-split."""

    cos: torch.Tensor
    sin: torch.Tensor
    interleave: bool
    norm: tuple[torch.Tensor, float]


class Step(Protocol):
    """What a backend reads of a step (``kernels.paged.ForwardContext``)."""

    def layer(self, layer_id: int) -> tuple[KVCache, AttentionMetadata]:
        """A layer's cache and its KV-cache group's metadata."""
        ...

    def layer_scores(self, layer_id: int) -> torch.Tensor | None:
        """A layer's importance scores [N, bs, Hkv] when its group keeps them."""
        ...

    def recent(self, layer_id: int) -> tuple[KVCache, AttentionMetadata] | None:
        """The cache and metadata of a layer's recent tokens (``models.kv_spec.with_recent``),
        or None where it has none."""
        ...


class WholeLayer(Protocol):
    """A pre-norm decoder layer as a backend that runs whole layers takes it
    (``models.layers.DecoderLayer``)."""

    @property
    def layer_id(self) -> int: ...  # whose cache and group metadata it reads

    @property
    def weights(self) -> DecoderLayerWeights: ...

    @property
    def constants(self) -> tuple[float, float, float, int, str]:
        """RMSNorm eps and weight offset, attention scale, query heads, MLP activation."""
        ...


class AttentionBackend(ABC):
    name: ClassVar[str]
    # Whether a decode step's launches depend only on shapes (not on data, and without host
    # syncs), so that they can be captured once in a CUDA graph and replayed.
    capturable: ClassVar[bool] = False

    @abstractmethod
    def write_cache(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Scatter ``rows`` [T, H, D] into ``cache`` [N, bs, H, D]; slot -1 is skipped."""

    @abstractmethod
    def prefill(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Chunks of new tokens (``meta``: prefill chunks only) attending causally to
        themselves and their cached prefix -> [T, Hq, Dv]. With ``scores``, the rows
        ``meta.score_from`` names add their attention to the keys' scores."""

    def plan_decode(self, meta: AttentionMetadata, kv_cache: KVCache) -> Any:
        """What ``decode`` would otherwise recompute in every layer: made once per step and
        KV-cache group (``kernels.paged.ForwardContext.planned``) for its decodes (``meta``),
        and read back from ``meta.decode_plan``. None: nothing to plan."""
        return None

    @abstractmethod
    def decode(
        self,
        q: torch.Tensor,
        kv_cache: KVCache,
        meta: AttentionMetadata,
        scale: float,
        scores: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """One query token per sequence (``meta``: decodes only), already written to the
        cache -> [B, Hq, Dv]; with ``scores``, as ``prefill``."""

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        layer_id: int,
        batch: Step,
        scale: float,
        rotary: Rotary | None = None,
    ) -> torch.Tensor:
        """A layer's attention over the step: q [T, Hq, Dk], k [T, Hkv, Dk], v [T, Hkv, Dv]
        -> [T, Hq, Dv], q and k turned by ``rotary`` first where given; writes k and v to the
        layer's cache. Prefill attention runs before the cache write, because a sliding-window
        chunk may overwrite ring slots that its own first tokens still read; decode runs after
        it. A layer that keeps importance scores clears
        those of the slots it writes, and adds to them where ``meta.score_from`` asks."""
        kv_cache, meta, scores = self._layer(layer_id, batch)
        recent = batch.recent(layer_id)
        if recent is not None:
            if rotary is not None:
                q, k = self.rotate(q, k, rotary)
            return self._attend(q, k, v, kv_cache, meta, scale, None, recent)
        if q.shape[0] == meta.num_decodes and rotary is not None:
            q = self.rotate_and_write(q, k, v, rotary, kv_cache, meta.slot_mapping)
            return self._decode(q, kv_cache, meta, scale, scores)
        if rotary is not None:
            q, k = self.rotate(q, k, rotary)
        return self._attend(q, k, v, kv_cache, meta, scale, scores)

    def latent_forward(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        layer_id: int,
        batch: Step,
        scale: float,
        rotary: LatentRotary,
    ) -> torch.Tensor:
        """``forward`` of an MLA layer: its query [T, H, R + P] and cached row [T, 1, R + P]
        made of the absorbed query q_latent [T, H, R], the rotary query q_pe [T, H, P], the
        latent c_kv [T, R] and the rotary key k_pe [T, P] by ``rotary``
        (``latent_rows``); the value is the row's first R columns."""
        kv_cache, meta, scores = self._layer(layer_id, batch)
        rows = (q_latent, q_pe, c_kv, k_pe, rotary)
        if q_latent.shape[0] == meta.num_decodes:
            q = self.latent_rows_and_write(*rows, kv_cache, meta.slot_mapping)
            return self._decode(q, kv_cache, meta, scale, scores)
        query, key = self.latent_rows(*rows)
        v = key[..., : c_kv.shape[-1]]
        return self._attend(query, key, v, kv_cache, meta, scale, scores)

    def _layer(self, layer_id: int, batch: Step):
        """A layer's cache, metadata and the importance scores this step adds to (None: none),
        the scores of the slots it writes cleared."""
        kv_cache, meta = batch.layer(layer_id)
        scores = batch.layer_scores(layer_id)
        if scores is not None:
            reference.clear_scores(scores, meta.slot_mapping)
            scores = scores if meta.score_from is not None else None
        return kv_cache, meta, scores

    def _decode(self, q, kv_cache: KVCache, meta: AttentionMetadata, scale, scores):
        """A step of decodes only, its rows already written."""
        return self.decode(q, kv_cache, meta.decodes, scale, scores).to(q.dtype)

    def _attend(
        self, q, k, v, kv_cache: KVCache, meta: AttentionMetadata, scale, scores, recent=None
    ):
        """Attention of a step's turned rows, which it writes to the cache. ``recent``: the
        cache and metadata of the layer's recent rows (``Step.recent``), which it writes too:
        each row reads its last ``window`` keys and values from there, older ones from
        ``kv_cache`` (``recent_prefill``, ``recent_decode``; no scores)."""
        nd = meta.num_decodes
        outs = []
        if q.shape[0] > nd:
            rows = (q[nd:], k[nd:], v[nd:], kv_cache, meta.prefills)
            outs.append(
                self.prefill(*rows, scale, scores) if recent is None
                else self.recent_prefill(*rows, recent[0], recent[1].prefills, scale)
            )  # fmt: skip
        if recent is not None and per_channel(kv_cache[0]):
            self.write_key_groups(k, kv_cache[0], meta, *recent)
            self.write_cache(kv_cache[1], v, meta.slot_mapping)
        else:
            self.write_kv(k, v, kv_cache, meta.slot_mapping)
        if recent is not None:
            self.write_kv(k, v, recent[0], recent[1].slot_mapping)
        if nd:
            outs.insert(0, (
                self.decode(q[:nd], kv_cache, meta.decodes, scale, scores) if recent is None
                else self.recent_decode(q[:nd], kv_cache, meta.decodes, recent[0],
                                        recent[1].decodes, scale)
            ))  # fmt: skip
        # A step of one kind returns its kernel's output as it is: no copy.
        out = outs[0] if len(outs) == 1 else torch.cat(outs)
        return out.to(q.dtype)

    def recent_prefill(
        self, q, k, v, kv_cache: KVCache, meta, recent_cache: KVCache, recent_meta, scale
    ):
        """``prefill`` of a layer with recent rows (``_attend``), before its writes."""
        return reference.recent_prefill_attention(
            q, k, v, *kv_cache, meta.block_tables, meta.cu_seqlens_q, meta.prefix_lens,
            *recent_cache, recent_meta.block_tables, recent_meta.window, scale, meta.window,
            self._prefill_attend(q), self._prefill_split(q),
        )  # fmt: skip

    def _prefill_attend(self, q: torch.Tensor) -> Callable | None:
        """What computes a prefill chunk's attention in the reference (None: its own)."""
        return None

    def _prefill_split(self, q: torch.Tensor) -> Callable | None:
        """What computes a chunk's attention over recent rows by parts (None: ``attend``)."""
        return None

    def recent_decode(self, q, kv_cache: KVCache, meta, recent_cache: KVCache, recent_meta, scale):
        """``decode`` of a layer with recent rows (``_attend``), its rows written."""
        return reference.recent_decode_attention(
            q, *kv_cache, meta.block_tables, meta.seq_lens, *recent_cache,
            recent_meta.block_tables, recent_meta.window, scale, meta.window,
        )  # fmt: skip

    def write_key_groups(self, k, k_cache, meta, recent_cache: KVCache, recent_meta) -> None:
        """The groups of int4 keys (``kernels.kv_quant``) a step's keys complete, before the
        step writes its recent rows (``_attend``)."""
        reference.write_key_groups(
            k_cache, k, meta.block_tables, meta.cu_seqlens_q, meta.prefix_lens, recent_cache[0],
            recent_meta.block_tables, recent_meta.window, meta.window,
        )  # fmt: skip

    def write_kv(self, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache, slots) -> None:
        """A step's new keys and values into the layer's cache (MLA's values are part of its
        keys' rows: written with them)."""
        k_cache, v_cache = kv_cache
        self.write_cache(k_cache, k, slots)
        if v_cache.untyped_storage() is not k_cache.untyped_storage():
            self.write_cache(v_cache, v, slots)

    def rotate(
        self, q: torch.Tensor, k: torch.Tensor, rotary: Rotary
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """q [T, Hq, D] and k [T, Hkv, D] turned by ``rotary``."""
        if rotary.norms is not None:
            wq, wk, eps, offset = rotary.norms
            q, k = self.rms_norm(q, wq, eps, offset), self.rms_norm(k, wk, eps, offset)
        q, k = self.rope(q, k, rotary.cos, rotary.sin)
        if rotary.key_offset is not None:
            k = k - rotary.key_offset.to(k.dtype)
        return q, k

    def rotate_and_write(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        rotary: Rotary,
        kv_cache: KVCache,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """``rotate``, then ``write_kv`` of the turned keys; returns the turned queries. A
        decode step's door: a backend may do it in one kernel."""
        q, k = self.rotate(q, k, rotary)
        self.write_kv(k, v, kv_cache, slots)
        return q

    def latent_rows(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        rotary: LatentRotary,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """An MLA step's query [T, H, R + P] and key rows [T, 1, R + P] (``latent_forward``)."""
        cos, sin, interleave = rotary.cos, rotary.sin, rotary.interleave
        q_pe = reference.apply_rope_pairs(q_pe, cos, sin, interleave)
        k_pe = reference.apply_rope_pairs(k_pe[:, None, :], cos, sin, interleave)
        latent = self.rms_norm(c_kv, *rotary.norm, 0.0)[:, None, :]
        return torch.cat([q_latent, q_pe], dim=-1), torch.cat([latent, k_pe], dim=-1)

    def latent_rows_and_write(
        self,
        q_latent: torch.Tensor,
        q_pe: torch.Tensor,
        c_kv: torch.Tensor,
        k_pe: torch.Tensor,
        rotary: LatentRotary,
        kv_cache: KVCache,
        slots: torch.Tensor,
    ) -> torch.Tensor:
        """``latent_rows``, the key rows written to the cache; returns the query. A decode
        step's door: a backend may do it in one kernel."""
        query, key = self.latent_rows(q_latent, q_pe, c_kv, k_pe, rotary)
        self.write_kv(key, key[..., : c_kv.shape[-1]], kv_cache, slots)
        return query

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The dtype a model served in ``dtype`` is loaded in, before ``prepare``."""
        return dtype

    def rms_norm(
        self, x: torch.Tensor, weight: torch.Tensor, eps: float, offset: float
    ) -> torch.Tensor:
        """``reference.rms_norm`` of x [..., D] by weight [D]."""
        return reference.rms_norm(x, weight, eps, offset)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        offset: float,
        before: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``reference.add_rms_norm``: (normalized, sum) of ``residual + x``."""
        return reference.add_rms_norm(x, residual, weight, eps, offset, before)

    def act_mul(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """``reference.act_mul``: a gated MLP's act(gate) * up."""
        return reference.act_mul(x, activation)

    def rope(
        self, q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """``reference.apply_rope`` of a step's queries [T, Hq, D] and keys [T, Hk, D]."""
        return reference.apply_rope(q, cos, sin), reference.apply_rope(k, cos, sin)

    def prepare(self, model: nn.Module) -> int:
        """Fit a loaded model to this backend's kernels, once, before its first step (the
        model runner calls it). Returns how many modules changed."""
        return 0

    def decoder_layers(
        self,
        layers: Sequence[WholeLayer],
        x: torch.Tensor,
        rope: list[tuple[torch.Tensor, torch.Tensor]],
        batch: Step,
    ) -> torch.Tensor | None:
        """``x`` through ``layers`` (``rope`` their (cos, sin)) when this backend runs whole
        decoder layers and can run these on this step; None: the modules must run."""
        return None

    @abstractmethod
    def rotate_keys(
        self, cache: torch.Tensor, blocks: torch.Tensor, delta: int, layout: RopeLayout
    ) -> None:
        """Move the keys held in ``blocks`` by ``delta`` positions, in place."""

    def copy_blocks(
        self, src: torch.Tensor, dst: torch.Tensor, src_ids: torch.Tensor, dst_ids: torch.Tensor
    ) -> None:
        """Copy whole blocks ``src[src_ids]`` to ``dst[dst_ids]``, possibly across devices."""
        rows = src[src_ids.to(src.device)]
        # Device to host must be synchronous: the host rows are read right away.
        dst[dst_ids.to(dst.device)] = rows.to(dst.device, non_blocking=dst.is_cuda)


def _reference_prefill(q, k, v, kv_cache: KVCache, meta, scale: float, attend=None, scores=None):
    """``reference.prefill_attention`` over a step's prefill chunks."""
    return reference.prefill_attention(
        q, k, v, *kv_cache, meta.block_tables, meta.cu_seqlens_q, meta.prefix_lens, scale,
        meta.window, attend, scores, meta.score_from,
    )  # fmt: skip


def _reference_decode(q, kv_cache: KVCache, meta, scale: float, scores=None):
    """``reference.decode_attention`` over a step's decodes."""
    return reference.decode_attention(
        q, *kv_cache, meta.block_tables, meta.seq_lens, scale, meta.window, meta.decode_plan,
        scores, meta.score_from,
    )  # fmt: skip


class TorchBackend(AttentionBackend):
    name = "torch"

    def write_cache(self, cache, rows, slots):
        reference.write_cache(cache, rows, slots)

    def prefill(self, q, k, v, kv_cache, meta, scale, scores=None):
        return _reference_prefill(q, k, v, kv_cache, meta, scale, scores=scores)

    def plan_decode(self, meta, kv_cache):
        block_size = kv_cache[0].shape[1]
        return reference.gather_plan(meta.block_tables, meta.seq_lens, block_size, meta.window)

    def decode(self, q, kv_cache, meta, scale, scores=None):
        return _reference_decode(q, kv_cache, meta, scale, scores)

    def rotate_keys(self, cache, blocks, delta, layout):
        rotate_reference(cache, blocks, delta, layout)


def _whole_groups(metas, recents) -> bool:
    """Whether the C++ layers take a step over int4 keys (``kernels.kv_quant``): one whose
    prefill chunks read quantized keys of groups cached whole before them only, as decodes and
    short chunks (a prefix hit's last token, a speculative verify) do; a longer chunk reads
    the groups it completes, quantized in torch."""
    recent = next((r for r in recents if r is not None), None)
    if recent is None:
        return False
    meta, nd, window = metas[0], metas[0].num_decodes, recent[1].window
    rows = meta.cu_seqlens_q[nd + 1 :] - meta.cu_seqlens_q[nd:-1]
    return bool((rows <= window - meta.prefix_lens[nd:] % CHANNEL_GROUP).all())


def sdpa_attend(q, k, v, scale, mask):
    """``reference._attend`` by torch's fused attention (no score matrix per head group
    materialized; about 2x at a 128-token prompt on CPU)."""
    out = F.scaled_dot_product_attention(
        q.transpose(0, 1)[None], k.transpose(0, 1)[None], v.transpose(0, 1)[None],
        attn_mask=mask, scale=scale, enable_gqa=True,
    )  # fmt: skip
    return out[0].transpose(0, 1)


def split_recent_attend(q, k_a, v_a, k_b, v_b, prefix: int, recent: int, scale: float):
    """A chunk's attention over a full-attention layer with recent rows
    (``reference.recent_prefill_attention``'s ``split``), as parts merged by their
    log-sum-exps: the row at position t = prefix + i reads the older keys k_a at p <= t - recent
    by torch's flash attention, its causal mask shifted by slicing the rows and keys, and the
    recent band, ``recent`` keys of k_b a row, directly. One mask over both sets of keys would
    have every row attend all of them: about four times the work of a 2048-token chunk."""
    n = q.shape[0]
    parts = [(0, *_band(q, k_b, v_b, prefix, recent, scale))]  # (first row, output, lse)
    d = prefix - recent  # row i reads k_a[: i + d + 1]
    if d >= 0:  # every row reads k_a[: d + 1], and row i the i - 1 after
        parts.append((0, *_flash(q, k_a[: d + 1], v_a[: d + 1], scale, causal=False)))
        if n > 1:
            parts.append((1, *_flash(q[1:], k_a[d + 1 : d + n], v_a[d + 1 : d + n], scale, True)))
    elif n > -d:  # rows from -d on read k_a[: i + d + 1]
        parts.append((-d, *_flash(q[-d:], k_a[: n + d], v_a[: n + d], scale, causal=True)))
    top = parts[0][2].clone()  # the band has a key for every row
    for r0, _, lse in parts[1:]:
        top[r0:] = torch.maximum(top[r0:], lse)
    out, total = torch.zeros_like(parts[0][1]), torch.zeros_like(top)
    for r0, o, lse in parts:
        w = torch.exp(lse - top[r0:])
        out[r0:] += o * w[..., None]
        total[r0:] += w
    return out / total[..., None]


def _flash(q, k, v, scale: float, causal: bool):
    """(output, log-sum-exp) of rows q [n, Hq, D] over k, v [S, Hkv, D] (row r of
    ``causal`` reads their first r + 1)."""
    g = q.shape[1] // k.shape[1]
    out, lse = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        q.transpose(0, 1)[None], k.transpose(0, 1).repeat_interleave(g, 0)[None],
        v.transpose(0, 1).repeat_interleave(g, 0)[None], is_causal=causal, scale=scale,
    )  # fmt: skip
    return out[0].transpose(0, 1), lse[0].T


def _band(q, k_b, v_b, prefix: int, recent: int, scale: float):
    """(output, log-sum-exp) of rows q [n, Hq, D] at prefix + i over the ``recent`` keys
    up to each, from k_b, v_b (positions from prefix - (len(k_b) - n) on)."""
    n, hq, dk = q.shape
    hkv = k_b.shape[1]
    pad = recent - 1 - (k_b.shape[0] - n)  # row i's keys: the padded rows i .. i + recent - 1
    kw = F.pad(k_b, (0, 0, 0, 0, pad, 0)).unfold(0, recent, 1)  # [n, Hkv, D, recent]
    vw = F.pad(v_b, (0, 0, 0, 0, pad, 0)).unfold(0, recent, 1)
    s = torch.einsum("nhgd,nhdr->nhgr", q.reshape(n, hkv, hq // hkv, dk), kw) * scale
    padded = torch.arange(n)[:, None] + torch.arange(recent)[None, :] < pad
    s = s.masked_fill(padded[:, None, None, :], float("-inf"))
    lse = torch.logsumexp(s, -1)
    out = torch.einsum("nhgr,nhdr->nhgd", torch.exp(s - lse[..., None]), vw)
    return out.reshape(n, hq, -1), lse.reshape(n, hq)


class CpuBackend(TorchBackend):
    """The torch reference, with decode attention and cache writes by the C++ kernels (which
    read and write every cache format, and add to importance scores) and prefill attention by
    torch's fused attention.

    ``model_kernels``: whether the kernels also run the model, decided once by the model
    runner: its float32 and block-format linear layers (``prepare``) and, in a step of up to
    ``cpu.MAX_ROWS`` new tokens, all its decoder layers in one call (``decoder_layers``).
    Not for a tensor-parallel rank: the fused layer would skip the all-reduces, and a swapped
    projection would drop the hook that makes them. ``repack``: block-format weights are
    repacked once for the products (``cpu.repacked``). ``weights``: the dtype of the dense
    matrices the kernels multiply, float16 or bfloat16 for half the bytes per step (the model
    is then loaded in float32, its activations stay float32 and its linear layers' matrices
    and embeddings are narrowed by ``prepare``)."""

    name = "cpu"

    def __init__(
        self, model_kernels: bool = True, repack: bool = True, weights: torch.dtype = torch.float32
    ) -> None:
        from kernels import cpu

        why = cpu.load()
        if why is not None:
            raise RuntimeError(f"the cpu attention backend is unavailable: {why}")
        if weights not in DENSE_TYPES:
            raise ValueError(
                f"the cpu kernels multiply float32, float16 or bfloat16, not {weights}"
            )
        self._cpu = cpu
        self.model_kernels, self.repack = model_kernels, repack
        self.weights = weights

    def load_dtype(self, dtype: torch.dtype) -> torch.dtype:
        return torch.float32 if self.model_kernels else dtype

    def prefill(self, q, k, v, kv_cache, meta, scale, scores=None):
        return _reference_prefill(q, k, v, kv_cache, meta, scale, self._prefill_attend(q), scores)

    def _prefill_attend(self, q):
        return sdpa_attend if q.dtype == torch.float32 else None

    def _prefill_split(self, q):
        return split_recent_attend if q.dtype == torch.float32 else None

    def write_cache(self, cache, rows, slots):
        if self._cpu.takes_cache(cache) and cache.stride(2) == cache.shape[3]:
            self._cpu.write_cache(cache, rows, slots)
        else:
            reference.write_cache(cache, rows, slots)

    def plan_decode(self, meta, kv_cache):
        return None  # the kernel walks the block table itself; the fallback plans per call

    def rotate_keys(self, cache, blocks, delta, layout):
        # A quantized cache's rows are dequantized, rotated and stored again by the reference.
        if not self._cpu.usable(cache) or cache.stride(-1) != 1:
            return super().rotate_keys(cache, blocks, delta, layout)
        if blocks.numel() and delta:
            cos, sin = delta_cos_sin(layout, delta)
            self._cpu.rotate_keys(cache, blocks, cos, sin, layout.start, layout.interleaved)

    def decode(self, q, kv_cache, meta, scale, scores=None):
        if all(self._cpu.takes_cache(c) for c in kv_cache) and self._takes_scores(scores, meta):
            return self._cpu.decode_attention(
                q, *kv_cache, meta.block_tables, meta.seq_lens, scale, meta.window, scores,
                meta.score_from,
            )  # fmt: skip
        return _reference_decode(q, kv_cache, meta, scale, scores)

    def recent_decode(self, q, kv_cache, meta, recent_cache, recent_meta, scale):
        if not all(self._cpu.reads_cache(c) for c in (*kv_cache, *recent_cache)):
            return super().recent_decode(q, kv_cache, meta, recent_cache, recent_meta, scale)
        recent = (*recent_cache, recent_meta.block_tables, recent_meta.window)
        return self._cpu.decode_attention(
            q, *kv_cache, meta.block_tables, meta.seq_lens, scale, meta.window, recent=recent
        )

    def _takes_scores(self, scores, meta) -> bool:
        """Whether the kernels add to these scores (None: none to add): full attention only."""
        return scores is None or (meta.window == 0 and self._cpu.takes_scores(scores))

    def prepare(self, model: nn.Module) -> int:
        """Every float32 nn.Linear becomes a ``FastLinear`` over the same parameters (names
        and ties kept): ``cpu.linear`` reads a decode step's weights at the memory's bandwidth,
        for the LM head and every projection outside the fused layers. Every ``QuantLinear``
        becomes one over its parts (the same buffers), which multiplies them in their block
        formats instead of dequantizing them at every call."""
        if not self.model_kernels:
            return 0
        from kernels.quant import QuantEmbedding, QuantLinear

        swapped, repacked, narrowed = 0, {}, {}

        def narrow(weight: nn.Parameter) -> nn.Parameter:
            # One narrowed copy per matrix: a tied embedding and LM head share it.
            if weight.dtype == self.weights:
                return weight
            if id(weight) not in narrowed:
                narrowed[id(weight)] = nn.Parameter(weight.detach().to(self.weights), False)
            return narrowed[id(weight)]

        for parent in list(model.modules()):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear) and self._cpu.usable(child.weight):
                    fast = self._cpu.FastLinear.of_linear(narrow(child.weight), child.bias)
                elif isinstance(child, nn.Embedding) and self.weights != torch.float32:
                    fast = QuantEmbedding(Weight(narrow(child.weight)))
                elif isinstance(child, QuantLinear) and self._fits(child.parts):
                    parts = child.parts
                    fast = self._cpu.FastLinear(
                        self._cpu.repacked(parts, repacked) if self.repack else parts
                    )
                else:
                    continue
                setattr(parent, name, fast)
                swapped += 1
        # An embedding tied to a repacked head reads the head's copy: one copy, not two.
        for module in model.modules():
            if isinstance(module, QuantEmbedding):
                stored = module.stored
                key = (stored.data.data_ptr(), tuple(stored.data.shape))
                if key in repacked:
                    module.adopt(Weight(repacked[key], None, stored.format, packed=True))
        return swapped

    def _fits(self, parts) -> bool:
        """Whether the kernel reads these parts: on the CPU, dense ones float32, float16 or
        bfloat16 and contiguous, biases float32."""
        return all(
            p.data.device.type == "cpu"
            and (p.format != "dense" or p.data.dtype in DENSE_TYPES)
            and (p.bias is None or self._cpu.usable(p.bias))
            for p in parts
        )

    def decoder_layers(self, layers, x, rope, batch):
        """One ``cpu.decoder_layers`` call, which writes and reads the caches itself (decodes
        and prefill chunks alike, in the caches' formats) and adds to the importance scores,
        where it applies: at most ``MAX_ROWS`` rows, no MLP bias (the fused layer adds none)."""
        if not self.model_kernels or x.shape[0] > self._cpu.MAX_ROWS:
            return None
        weights = [layer.weights for layer in layers]
        if any(p.bias is not None for w in weights for p in w.gate_up + w.down):
            return None
        caches, metas = zip(*(batch.layer(layer.layer_id) for layer in layers))
        recents = [batch.recent(layer.layer_id) for layer in layers]
        held = [c for kv in caches for c in kv] + [c for r in recents if r for c in r[0]]
        takes = self._cpu.reads_cache if _whole_groups(metas, recents) else self._cpu.takes_cache
        if not all(takes(c) for c in held):
            return None
        kept = [batch.layer_scores(layer.layer_id) for layer in layers]
        added = [s if m.score_from is not None else None for s, m in zip(kept, metas)]
        if not all(self._takes_scores(s, m) for s, m in zip(added, metas)):
            return None
        for s, m in zip(kept, metas):
            if s is not None:
                reference.clear_scores(s, m.slot_mapping)
        return self._cpu.decoder_layers(
            x, rope, weights, list(caches), list(metas), layers[0].constants, added,
            recents=recents,
        )  # fmt: skip


class TritonBackend(AttentionBackend):
    """The Triton kernels. Each operation builds its launches (``kernels.launch.Launch``) and
    hands them to ``run``, which launches them (by default a ``Launcher`` of this backend's
    own); ``sms`` overrides the device's multiprocessor count that decode splits are planned
    for. Both are there so that the launches of a model's steps can be collected, and compiled
    ahead of time for a GPU that is not present."""

    name = "triton"
    capturable = True

    def __init__(self, run: Callable[[Launch], None] | None = None, sms: int | None = None) -> None:
        from kernels import (
            kv_quant,
            rotary,
            triton_act,
            triton_attention,
            triton_norm,
            triton_quant,
            triton_rope,
        )

        self._kv_quant = kv_quant
        self._attention = triton_attention
        self._rotary = rotary
        self._quant = triton_quant
        self._norm = triton_norm
        self._rope = triton_rope
        self._act = triton_act
        self._run = run or Launcher()
        self._sms = sms

    def rms_norm(self, x, weight, eps, offset):
        out, launch = self._norm.rms_norm_launch(x, weight, eps, offset)
        self._run(launch)
        return out

    def rope(self, q, k, cos, sin):
        q, k, launch = self._rope.rope_launch(q, k, cos, sin)
        self._run(launch)
        return q, k

    def add_rms_norm(self, x, residual, weight, eps, offset, before=None):
        out, total, launch = self._norm.add_rms_norm_launch(
            x, residual, weight, eps, offset, before
        )
        self._run(launch)
        return out, total

    def act_mul(self, x, activation):
        out, launch = self._act.act_mul_launch(x, activation)
        self._run(launch)
        return out

    def rotate_and_write(self, q, k, v, rotary, kv_cache, slots):
        # Float caches of their own (not MLA's shared rows): one kernel; else the two steps.
        k_cache, v_cache = kv_cache
        quantized = any(self._kv_quant.is_quantized(c) for c in kv_cache)
        if quantized or v_cache.untyped_storage() is k_cache.untyped_storage():
            return super().rotate_and_write(q, k, v, rotary, kv_cache, slots)
        q, launch = self._rope.rotate_write_launch(q, k, v, rotary, k_cache, v_cache, slots)
        self._run(launch)
        return q

    def latent_rows_and_write(self, q_latent, q_pe, c_kv, k_pe, rotary, kv_cache, slots):
        cache = kv_cache[0]
        if self._kv_quant.is_quantized(cache):
            return super().latent_rows_and_write(
                q_latent, q_pe, c_kv, k_pe, rotary, kv_cache, slots
            )
        q, launch = self._rope.latent_rows_write_launch(
            q_latent, q_pe, c_kv, k_pe, rotary, cache, slots
        )
        self._run(launch)
        return q

    def _launch(self, launches: list[Launch]) -> None:
        for launch in launches:
            self._run(launch)

    def write_cache(self, cache, rows, slots):
        self._launch(self._attention.write_cache_launches(cache, rows, slots))

    def prefill(self, q, k, v, kv_cache, meta, scale, scores=None):
        # A quantized cache holds rotated rows: the query is rotated to meet them, the output
        # back (torch matmuls around the launches, as in decode). The scores need no turning
        # back: a rotation keeps every q.k.
        attention, (k_cache, v_cache) = self._attention, kv_cache
        out, launches = attention.prefill_launches(
            attention.rotated_query(q, k_cache), k, v, k_cache, v_cache, meta.block_tables,
            meta.cu_seqlens_q, meta.prefix_lens, scale, meta.window, scores=scores,
            score_from=meta.score_from,
        )  # fmt: skip
        self._launch(launches)
        return attention.rotated_output(out, v_cache, q.dtype)

    def decode(self, q, kv_cache, meta, scale, scores=None):
        attention, (k_cache, v_cache) = self._attention, kv_cache
        out, launches = attention.decode_launches(
            attention.rotated_query(q, k_cache), k_cache, v_cache, meta.block_tables,
            meta.seq_lens, scale, meta.window, sms=self._sms, scores=scores,
            score_from=meta.score_from,
        )  # fmt: skip
        self._launch(launches)
        return attention.rotated_output(out, v_cache, q.dtype)

    def recent_prefill(self, q, k, v, kv_cache, meta, recent_cache, recent_meta, scale):
        return self._attention.recent_prefill(
            self._launch, q, k, v, kv_cache, meta.block_tables, meta.cu_seqlens_q,
            meta.prefix_lens, recent_cache, recent_meta.block_tables, recent_meta.window, scale,
            meta.window,
        )  # fmt: skip

    def recent_decode(self, q, kv_cache, meta, recent_cache, recent_meta, scale):
        return self._attention.recent_decode(
            self._launch, q, kv_cache, meta.block_tables, meta.seq_lens, recent_cache,
            recent_meta.block_tables, recent_meta.window, scale, meta.window, self._sms,
        )  # fmt: skip

    def rotate_keys(self, cache, blocks, delta, layout):
        if self._kv_quant.is_quantized(cache):  # the rotary kernel moves float values only
            rotate_reference(cache, blocks, delta, layout)
            return
        self._launch(self._rotary.rotate_launches(cache, blocks, delta, layout))

    def prepare(self, model: nn.Module) -> int:
        """Every ``QuantLinear`` and ``QuantEmbedding`` becomes its ``kernels.triton_quant``
        module over the same buffers, launching through ``run``: block-format weights are read
        as stored, never dequantized whole."""
        return self._quant.swap_modules(model, self._run)


BACKENDS: dict[str, type[AttentionBackend]] = {
    b.name: b for b in (TorchBackend, CpuBackend, TritonBackend)
}


def backend_names() -> tuple[str, ...]:
    return tuple(BACKENDS)


def default_backend(device: torch.device, cpu_kernels: bool = True) -> str:
    """triton on CUDA; on CPU, cpu where its kernels are wanted and build, else torch."""
    if device.type == "cuda":
        return "triton"
    from kernels import cpu

    return "cpu" if cpu_kernels and cpu.load() is None else "torch"


def get_backend(
    name: str | None,
    device: torch.device,
    cpu_kernels: bool = True,
    repack: bool = True,
    weights: torch.dtype = torch.float32,
) -> AttentionBackend:
    """The backend called ``name``, or the device's own (``default_backend``) when None.
    ``cpu_kernels``: whether the ``cpu`` backend also runs the model, ``repack`` whether it
    repacks block-format weights, ``weights`` its dense matrices' dtype (``CpuBackend``)."""
    if name is None:
        name = default_backend(device, cpu_kernels)
    if name not in BACKENDS:
        raise ValueError(f"unknown attention backend {name!r}; choose from {backend_names()}")
    if name == CpuBackend.name:
        return CpuBackend(model_kernels=cpu_kernels, repack=repack, weights=weights)
    return BACKENDS[name]()

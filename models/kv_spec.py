"""KV-cache specs: the memory *format* of one group of layers, apart from the allocator.

The allocator (the engine's KV manager) is generic; it asks a spec how many blocks a sequence of
``n`` tokens holds and how many bytes one token costs. Pure Python: no torch here.

Per-layer cache tensors (allocated by the model runner, read by ``kernels``):

- ``FullAttentionSpec`` / ``SlidingWindowSpec``: K and V, each ``[num_blocks, block_size,
  num_kv_heads, head_dim]``. Query heads of a GQA group read the same K/V rows.
- ``MLASpec``: one tensor ``[num_blocks, block_size, 1, kv_lora_rank + qk_rope_head_dim]``;
  the value is the view ``[..., :kv_lora_rank]`` of the same rows (MQA over latents).

A spec's ``dtype`` is the cache's (``KV_DTYPES``), or a key/value pair of quantized ones
(``int8/int4``: keys in int8, values in int4; ``kv_pair``); a quantized one stores each head's
row in ``row_bytes`` bytes, its scales inside the row, so a block stays the unit everything moves.

Sliding window as a ring: a sequence holds at most ``ring_len = ceil(window / block_size) + 1``
blocks, and position p lives in ``table[(p // block_size) % ring_len]``::

    window = 8, block_size = 4 -> ring_len = 3 (12 slots)
    positions:  0  1  2  3 | 4  5  6  7 | 8  9 10 11 | 12 13 14 15
    table idx:      0      |     1      |     2      |     0 (reused)
    attending from p = 13:  positions 6..13 (window counts the current token)
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from math import ceil

DTYPE_BYTES = {"float32": 4, "float16": 2, "bfloat16": 2, "float8_e4m3fn": 1}
DTYPES = ("float32", "bfloat16", "float16")  # what models and caches can be served in
# What a cache may store its rows in besides those (``kernels.kv_quant`` lays them out): one
# byte per value and a float32 scale per token and head, or 4 bits per value and a float16
# scale per group of 32 values (int4 keys: 8-bit codes of a minimum and a scale per channel
# and group of 32 tokens, which the cache's blocks and the recent rows must hold whole).
QUANTIZED_KV = ("int8", "fp8_e4m3", "int4")
KV_DTYPES = DTYPES + QUANTIZED_KV
INT4_GROUP = 32
CHANNEL_GROUP = 32  # tokens per scale of int4 keys; a block holds whole groups


def kv_pair(dtype: str) -> tuple[str, str]:
    """The key and value caches' dtypes of a spec's ``dtype``: ``"int8/int4"`` -> ("int8",
    "int4"), ``"int8"`` -> ("int8", "int8"). Raises for a pair that is not of two quantized
    dtypes (a float cache gains nothing by keeping its halves apart)."""
    key, _, value = dtype.partition("/")
    if not value:
        return dtype, dtype
    if key not in QUANTIZED_KV or value not in QUANTIZED_KV:
        raise ValueError(
            f"a KV cache dtype pair is keys/values of {', '.join(QUANTIZED_KV)}, not {dtype!r}"
        )
    return key, value


def int4_keys(dtype: str) -> bool:
    """Whether a cache of ``dtype`` (``auto`` included) stores its keys in int4."""
    return kv_pair(dtype)[0] == "int4"


def channel_keys(spec) -> bool:
    """Whether a spec's keys are int4, quantized per channel over groups of ``CHANNEL_GROUP``
    tokens (an MLA cache's rows are keys and values at once: quantized per token)."""
    return not isinstance(spec, MLASpec) and int4_keys(spec.dtype)


def keys_quantized(dtype: str) -> bool:
    """Whether the keys of a cache of ``dtype`` are stored quantized."""
    return kv_pair(dtype)[0] in QUANTIZED_KV


def row_bytes(dtype: str, dim: int, keys: bool = False) -> int:
    """Bytes of one head's row of ``dim`` values in a cache of ``dtype`` (a ``KV_DTYPES``);
    ``keys``: of a key cache, where int4 rows also hold a share of their group's per-channel
    codes (``kernels.kv_quant``)."""
    if dtype in QUANTIZED_KV and dim % INT4_GROUP:
        raise ValueError(
            f"--kv-cache-dtype {dtype} needs head sizes that are multiples of 32 (rows are "
            f"stored rotated in blocks of 32 or 64 values), not {dim}"
        )
    if dtype == "int4":
        per_token = dim // INT4_GROUP * (2 + INT4_GROUP // 2)
        return per_token + (1 if keys else 0)
    if dtype in QUANTIZED_KV:
        return dim + 4
    return dim * DTYPE_BYTES[dtype]


@dataclass(frozen=True)
class FullAttentionSpec:
    """Full attention; MHA when num_kv_heads == num_heads, GQA/MQA when fewer."""

    num_kv_heads: int
    head_dim: int
    dtype: str = "float32"

    @property
    def window(self) -> int:
        return 0

    @property
    def bytes_per_token(self) -> int:
        """Bytes one token costs in one layer (K and V)."""
        key, value = kv_pair(self.dtype)
        return self.num_kv_heads * (
            row_bytes(key, self.head_dim, keys=True) + row_bytes(value, self.head_dim)
        )

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        """Blocks a sequence of ``num_tokens`` cached tokens holds."""
        return ceil(num_tokens / block_size)

    def table_width(self, max_model_len: int, block_size: int) -> int:
        return ceil(max_model_len / block_size)


@dataclass(frozen=True)
class SlidingWindowSpec(FullAttentionSpec):
    """Local attention over the last ``window`` positions (current token included), as a ring."""

    window_size: int = 0

    @property
    def window(self) -> int:
        return self.window_size

    def ring_len(self, block_size: int) -> int:
        return ceil(self.window_size / block_size) + 1

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        return min(ceil(num_tokens / block_size), self.ring_len(block_size))

    def table_width(self, max_model_len: int, block_size: int) -> int:
        # The ring addressing in the kernels takes the table width as ring_len.
        return self.ring_len(block_size)


@dataclass(frozen=True)
class MLASpec:
    """DeepSeek-style compressed latent ``c_kv`` plus the roped key part, shared by all heads."""

    kv_lora_rank: int
    qk_rope_head_dim: int
    dtype: str = "float32"

    def __post_init__(self) -> None:
        if "/" in self.dtype:
            raise ValueError(
                f"--kv-cache-dtype {self.dtype}: an MLA cache's values are a part of its key "
                "rows, so keys and values have one dtype"
            )

    @property
    def window(self) -> int:
        return 0

    @property
    def row_width(self) -> int:
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def bytes_per_token(self) -> int:
        return row_bytes(self.dtype, self.row_width)

    def num_blocks(self, num_tokens: int, block_size: int) -> int:
        return ceil(num_tokens / block_size)

    def table_width(self, max_model_len: int, block_size: int) -> int:
        return ceil(max_model_len / block_size)


KVSpec = FullAttentionSpec | SlidingWindowSpec | MLASpec


@dataclass(frozen=True)
class KVCacheGroup:
    """Layers that share one layout and so one block table per sequence."""

    spec: KVSpec
    layer_ids: tuple[int, ...]
    # Whether each layer also keeps a float32 importance score per token and KV head (MLA: per
    # token), which attention accumulates for eviction by importance.
    scored: bool = False
    # Whether the group holds the recent tokens of another group's layers (``with_recent``):
    # its layer ids are theirs plus the model's layer count.
    recent: bool = False

    @property
    def score_heads(self) -> int:
        return getattr(self.spec, "num_kv_heads", 1)

    @property
    def bytes_per_token(self) -> int:
        scores = 4 * self.score_heads if self.scored else 0
        return (self.spec.bytes_per_token + scores) * len(self.layer_ids)


def sliding_window_in(groups: list[KVCacheGroup], dtype: str) -> list[KVCacheGroup]:
    """``groups`` with the sliding-window layers' caches in ``dtype`` (``--kv-cache-dtype-skip-
    layers sliding_window``: a model's local layers kept at a higher precision than its global
    ones, as vLLM's flag of that name keeps them)."""
    return [replace(g, spec=replace(g.spec, dtype=dtype)) if g.spec.window else g for g in groups]


def with_recent(
    groups: list[KVCacheGroup], num_layers: int, tokens: int, dtype: str
) -> list[KVCacheGroup]:
    """``groups`` and, for each that quantizes its keys or values, a group holding its layers'
    last ``tokens`` tokens in ``dtype`` (``--kv-cache-recent-tokens``): a window of that many
    tokens, as a ring, whose layer ids are the model's plus ``num_layers``. Attention reads a
    query's last ``tokens`` keys and values from there and the older ones quantized, as KIVI
    keeps its most recent tokens in full precision."""
    out = list(groups)
    for g in groups:
        if not any(d in QUANTIZED_KV for d in kv_pair(g.spec.dtype)):
            continue
        if isinstance(g.spec, MLASpec):
            raise ValueError("--kv-cache-recent-tokens does not take an MLA cache")
        spec = SlidingWindowSpec(g.spec.num_kv_heads, g.spec.head_dim, dtype, window_size=tokens)
        out.append(KVCacheGroup(spec, tuple(num_layers + i for i in g.layer_ids), recent=True))
    if len(out) == len(groups):
        raise ValueError("--kv-cache-recent-tokens needs a quantized --kv-cache-dtype")
    return out

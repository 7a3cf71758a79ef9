"""Triton paged attention: cache write, split-K decode, variable-length prefill over a prefix.

Signatures match ``kernels.reference``. Layouts (see there): caches ``[N, bs, Hkv, D]`` with any
strides (v may be a view of k, as for MLA), block tables ``[B, W]`` int32, a ring of width W when
``window > 0``.

Design:
  - One program owns all query heads of one KV head (or a tile of them when the group is large,
    as MLA's 128 heads): each K/V tile is loaded once and multiplied against the whole group.
  - Softmax is online, in fp32 and base 2 (``scale * log2 e`` folded into the scores).
  - A key width that is not a power of two (576 = 512 + 64) is two dots, a power-of-two part and
    a masked tail, so no lane is wasted on padding to 1024.
  - Decode splits the context into ``num_splits`` parts (flash-decoding) that write a partial
    output and its log-sum-exp; a second kernel merges them. The split count comes from the
    table width, not from ``seq_lens``, so choosing it never waits for the device.
  - K/V tiles are copied to shared memory asynchronously (cp.async), the next one in flight
    while the current one is multiplied (3 stages; see ``_attend``), the block table read a
    tile ahead of the copies.
  - Sliding window: only positions in ``[p - window + 1, p]`` are visited, so the cost per token
    is bounded by the window whatever the context length.
  - Importance scores (``reference``: ``scores``, ``score_from``): a key's probability needs its
    row's final softmax max and sum, known in decode only once its splits are merged. The
    attention kernels store each row's log-sum-exp (decode: each split's), and a scoring kernel
    runs after each on its grid (``_decode_scores_kernel``, ``_prefill_scores_kernel``): it
    reads the keys again (keys only, once per head tile) and turns their logits into the
    probabilities it adds. Keeping the logits instead would take a float per query head and
    context position (gigabytes at long contexts, and stores in the decode loop); recomputing
    costs one more read of K, in scored steps only, and leaves the attention loops and their
    registers as they were (a scoring pass inside the prefill kernel spills on MLA's tile).
    Programs overlap on keys (query and head tiles, shared prefix blocks): the adds are atomic.

Cache formats (``kernels.kv_quant``; the cache dtype names one, ``KV`` in the kernels):
  - A quantized cache is passed to the kernels as bytes (a uint8 view), whatever its dtype: the
    kernels decode int8 and e4m3 themselves, so that sm_80 (no e4m3 type in Triton) and the
    interpreter read them as sm_90 does.
  - Writes quantize in the kernel, one program per token and head row, as ``kv_quant.quantize``.
  - Reads dequantize K/V tiles in registers. int8 and fp8 tiles are converted as they are stored
    and their row scales applied to the scores (keys) and the probabilities (values), one
    multiply per key rather than per value; int4 tiles are scaled per group of 32 as they are
    unpacked, their columns in the order the two nibbles of a byte come out (value j, then
    j + 16), which the query load and the output store follow. Quantized rows are stored
    rotated (``kv_quant.rotated``): the callers rotate the query before and the output after
    (``rotated_query``, ``rotated_output``), so no row is rotated back.
  - dots run in the model's dtype (the query's) over a quantized cache, in the cache's dtype
    over a float one.
  - A prefill chunk's own keys and values are read as the cache gives them back: quantized into
    rows of their own by the write kernel (``read_back_launches``), then read like the cache.

Files (none over 400 lines: tests/test_layout.py), each importing only those listed before
it, never this ``__init__``, which re-exports what other modules use:
  - ``formats``: the cache formats as the kernels name them, the write kernels, the loaders
    that read quantized rows in the attention kernels, and the host helpers of the formats
    (the byte view, ``KV`` and ``ALIGN``, the rotations).
  - ``attend``: the attention loop the kernels share (``_attend``), the query load, and the
    scoring loop (``_add_scores``).
  - ``decode``: the split-K decode kernel, the merge of its splits, its scoring kernel.
  - ``prefill``: the prefill kernel and its scoring kernel.
  - ``plans``: tiles, precision and the decode split plan (``launch_plan``).
  - ``launches``: the launch code of the cache write, decode and prefill.

The package may import ``kernels.kv_quant``, ``kernels.launch``, torch, triton and its own
modules.
"""

from __future__ import annotations

from kernels.triton_attention.decode import _decode_kernel
from kernels.triton_attention.formats import rotated_output, rotated_query
from kernels.triton_attention.launches import (
    decode_attention,
    decode_launches,
    prefill_attention,
    prefill_launches,
    read_back_launches,
    write_cache,
    write_cache_launches,
)
from kernels.triton_attention.plans import (
    MAX_SPLITS,
    MERGE_VALUES,
    MIN_SPLIT_TOKENS,
    PROGRAMS_PER_SM,
    SCORE_SPLITS,
    SEQS_PER_PASS,
    LaunchPlan,
    Tile,
    choose_num_splits,
    decode_tile,
    device_sms,
    launch_plan,
    prefill_tile,
)
from kernels.triton_attention.recent import recent_decode, recent_prefill

__all__ = [
    "LaunchPlan",
    "MAX_SPLITS",
    "MERGE_VALUES",
    "MIN_SPLIT_TOKENS",
    "PROGRAMS_PER_SM",
    "SCORE_SPLITS",
    "SEQS_PER_PASS",
    "Tile",
    "_decode_kernel",
    "choose_num_splits",
    "decode_attention",
    "decode_launches",
    "decode_tile",
    "device_sms",
    "launch_plan",
    "prefill_attention",
    "prefill_launches",
    "prefill_tile",
    "read_back_launches",
    "recent_decode",
    "recent_prefill",
    "rotated_output",
    "rotated_query",
    "write_cache",
    "write_cache_launches",
]

"""The Triton kernels as the launch code asks for them, compiled for Hopper (sm_90) and Ampere
(sm_80) without a GPU: each fits the target's shared memory, keeps its registers out of local
memory, and a model's steps never ask for a new variant (see ``kernel_variants``). The current
triton compiles for sm_90, and the triton the GPU image's torch brings (3.6.0 for torch 2.11)
for sm_90 as well: a kernel that compiles or fits on one version only fails here. Ampere's
smaller shared memory is checked with ``KVSERVE_KERNEL_TARGETS=sm_90,sm_80`` (the current
triton for both; a third compile of every variant, outside the default run for its time).

The variants come from the serving code path run on meta tensors for four real model shapes
(SmolLM2-135M: 9/3 heads of 64, Llama-3-8B: 32/8 of 128, Gemma 3 270M: 4/1 of 256 with a
512-token window on 5 of 6 layers, DeepSeek-V3: MLA over 576-wide latents for 128 heads), in
fp32, fp16 and bf16, over batch sizes, table widths and decode/prefill mixes chosen around the
values Triton specializes on; and under bf16, over caches of every quantized KV dtype (int8,
fp8_e4m3, int4) for the same four models, one of each layout at least. The block-format
kernels come from two Q4_K_M files' matrices (Qwen2.5-Coder 0.5B: q5_0, q8_0, q4_k and q6_k at
widths 896 and 4864; 1.5B: q4_k and q6_k at 1536 and 8960, a 151936-row table) over step sizes
around the GEMV/matmul boundary. They are compiled in a separate process, where the kernels
are JIT functions rather than interpreted ones.

Bounds:
  - shared memory per block (Triton's dynamic plus the cubin's static) within the target's
    opt-in limit (``kernel_variants.TARGETS``);
  - no spills: a stack frame of 0 bytes (where ptxas puts spilled registers) for every kernel,
    prefill included. A spill in the loop of an attention kernel costs a local-memory round
    trip per key tile, the traffic the kernels exist to avoid, and every layout has a tile that
    does without: no bound above 0 is needed.
  - pipelined K/V loads: every decode and prefill variant copies its K/V tiles to shared
    memory with cp.async, and every one compiled with 3 or more stages (all decode variants
    are) leaves the next tile's copies in flight while it computes on the current one. int4
    tiles excepted: a group's 16 bytes follow its 2-byte scale, so no load of them is aligned
    to the 4 bytes a cp.async copies at least; they are read straight into registers.
  - variants: one per (model, dtype, KV dtype, KV-cache group, kernel). Every step (batch
    size, context length, number of decodes, table width) launches the variant the first step
    compiled, so a server compiles a fixed set of kernels x cache groups per dtype, all of them
    in its first steps (``_kernels``); over a quantized cache the write kernel has two (the
    cache's slots, and a prefill chunk's own rows quantized to be read back) and no kernel
    re-rotates keys (they move in torch). A group that keeps importance scores adds the two
    scoring kernels. The layer's norms and activation are rows of their own, ``group`` naming
    what each serves (``hidden``, ``q_lora``, ``mlp``).
    A quantized matrix part compiles one variant per kernel and tile: the GEMV's for 1, 2 and
    4 rows (``triton_quant.gemv_tile``), the matmul's decode-batch and prefill tiles
    (``triton_quant.matmul_tile``), the row dequantizer.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

from tests.kernels import kernel_variants

ROOT = Path(__file__).resolve().parents[2]
SCORE_KERNELS = {"_decode_scores_kernel", "_prefill_scores_kernel"}
ATTENTION_KERNELS = {"_decode_kernel", "_merge_kernel", "_prefill_kernel", *SCORE_KERNELS}
LAYER_KERNELS = {"_rms_norm_kernel", "_add_rms_norm_kernel", "_act_mul_kernel"}
QUANT_KERNELS = {"_quant_gemv_kernel", "_quant_matmul_kernel", "_dequantize_rows_kernel"}
# Variants a part or cache group may compile per kernel (else 1): the GEMV one per step size
# rounded up to a power of 2 (1, 2, 4 rows), the matmul its two tiles, a quantized cache's write
# kernel two per format (a key/value pair: four).
TILES = {"_quant_gemv_kernel": 3, "_quant_matmul_kernel": 2, "_write_quantized_kernel": 2}
# The models of each cache layout, and the KV dtypes a cache may be served in.
LAYOUTS = {"gqa": {"SmolLM2-135M", "Llama-3-8B"}, "ring": {"Gemma-3-270M"},
           "mla": {"DeepSeek-V3"}}  # fmt: skip


# Triton as the GPU image's torch brings it (torch 2.11: triton 3.6.0), installed beside the
# current one by the Makefile; it compiles for the image's card (sm_90) too.
IMAGE_TRITON = ("3.6.0", Path(sys.prefix) / "triton-3.6.0", "sm_90")


def targets() -> list[str]:
    """The targets the current triton compiles for (``KVSERVE_KERNEL_TARGETS``, default sm_90)."""
    names = os.environ.get("KVSERVE_KERNEL_TARGETS", "sm_90").split(",")
    unknown = set(names) - set(kernel_variants.TARGETS)
    assert not unknown, f"KVSERVE_KERNEL_TARGETS: unknown {sorted(unknown)}"
    return names


def _compile_in_subprocesses() -> dict:
    """``kernel_variants`` run once per target with the current triton and once for the
    image's card with the image's triton, side by side (one core each); each row names the
    triton that compiled it."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.setdefault("TRITON_DEFAULT_FP_FUSION", "1")  # Triton's default, said out loud
    version, path, image_target = IMAGE_TRITON
    if not (path / "triton").is_dir():
        pytest.fail(f"triton {version} is not installed under {path} (make install puts it there)")
    image_env = {**env, "PYTHONPATH": os.pathsep.join([str(path), env["PYTHONPATH"]])}
    command = [sys.executable, "-m", "tests.kernels.kernel_variants"]
    jobs = [(target, "current", env) for target in targets()]
    jobs.append((image_target, version, image_env))
    runs = [
        subprocess.Popen([*command, target], cwd=ROOT, env=job_env, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
        for target, _, job_env in jobs
    ]  # fmt: skip
    rows, skip = [], None
    try:
        for run, (_, triton_version, _) in zip(runs, jobs):
            out, err = run.communicate(timeout=1200)
            assert run.returncode == 0, err[-4000:]
            result = json.loads(out.splitlines()[-1])
            skip = skip or result.get("skip")
            rows += [{**r, "triton": triton_version} for r in result.get("rows", [])]
    finally:
        for run in runs:
            if run.poll() is None:
                run.kill()
                run.wait()
    return {"skip": skip} if skip else {"rows": rows}


@pytest.fixture(scope="module")
def rows() -> list[dict]:
    pytest.importorskip("triton")
    result = _compile_in_subprocesses()
    if "skip" in result:
        print(f"kernel variants not compiled: {result['skip']}")
        pytest.skip(result["skip"])
    print(kernel_variants.table(result["rows"]))
    return result["rows"]


def _kernels(model: str, kv: str) -> set[str]:
    """The kernels a model's steps launch: attention; a decode step's turn-and-write in one
    kernel (``_latent_rows_kernel`` for MLA), a prefill step's rotary (GQA) and per-head or
    latent norms (Gemma, MLA) before attention and the cache write, whole blocks re-rotated
    after a context shift; the layer's norms and activation (recorded under its own dtype).
    A quantized cache's rows are turned first and quantized as they are written, its keys
    re-rotated by torch."""
    if model in kernel_variants.QUANT_MODELS:
        return QUANT_KERNELS
    mla, gemma = model in LAYOUTS["mla"], model in LAYOUTS["ring"]
    turn = set() if mla else {"_rope_kernel"}
    turn |= {"_rms_norm_kernel"} if mla or gemma else set()
    if "+" in kv:  # recent rows beside: written as floats; decodes in one split, no scores
        return {"_decode_kernel", "_prefill_kernel", "_write_quantized_kernel",
                "_write_cache_kernel"} | turn  # fmt: skip
    if kv in (*kernel_variants.KV_DTYPES, *kernel_variants.KV_PAIRS):
        return ATTENTION_KERNELS | turn | {"_write_quantized_kernel"}
    fused = {"_latent_rows_kernel"} if mla else {"_rotate_write_kernel"}
    written = {"_write_cache_kernel", "_rotate_kernel"}
    return ATTENTION_KERNELS | turn | fused | written | LAYER_KERNELS


def test_every_model_dtype_and_target_launches_every_kernel(rows):
    assert {r["triton"] for r in rows} == {"current", IMAGE_TRITON[0]}
    seen = defaultdict(set)
    for row in rows:
        seen[row["model"], row["dtype"], row["kv"], row["target"]].add(row["kernel"])
    expected = (
        {
            (m, d, kernel_variants.kv_name(dtype) if m in kernel_variants.MODELS else "", t)
            for m in (*kernel_variants.MODELS, *kernel_variants.QUANT_MODELS)
            for d, dtype in kernel_variants.DTYPES.items()
            for t in targets()
        }
        | {
            (m, kernel_variants.KV_MODEL_DTYPE, kv, t)
            for m in kernel_variants.KV_MODELS
            for kv in kernel_variants.KV_DTYPES
            for t in targets()
        }
        | {
            (m, kernel_variants.KV_MODEL_DTYPE, kv, t)
            for m in kernel_variants.KV_PAIR_MODELS
            for kv in kernel_variants.KV_PAIRS
            for t in targets()
        }
    )
    assert set(seen) == expected
    wrong = {key: kernels for key, kernels in seen.items() if kernels != _kernels(key[0], key[2])}
    assert not wrong, wrong


def test_every_kv_dtype_is_compiled_for_every_layout_without_spills(rows):
    from kernels.kv_quant import KV_DTYPES

    for kv in KV_DTYPES:
        mine = [r for r in rows if r["kv"] == kv]
        for target in targets():
            for layout, models in LAYOUTS.items():
                attention = {
                    r["kernel"] for r in mine if r["model"] in models and r["target"] == target
                }
                assert {"_decode_kernel", "_prefill_kernel"} <= attention, (kv, target, layout)
        spilling = [r for r in mine if r["stack"] > 0 or r["shared"] > r["max_shared"]]
        assert not spilling, (kv, kernel_variants.table(spilling))
    for kv in kernel_variants.KV_PAIRS:
        mine = [r for r in rows if r["kv"] == kv]
        for target in targets():
            for model in kernel_variants.KV_PAIR_MODELS:
                attention = {
                    r["kernel"] for r in mine if r["model"] == model and r["target"] == target
                }
                assert {"_decode_kernel", "_prefill_kernel"} <= attention, (kv, target, model)
        spilling = [r for r in mine if r["stack"] > 0 or r["shared"] > r["max_shared"]]
        assert not spilling, (kv, kernel_variants.table(spilling))


def test_every_stored_format_of_the_quantized_models_is_compiled(rows):
    for model, m in kernel_variants.QUANT_MODELS.items():
        stored = {m["table"]} | {
            fmt for slot in ("qkv", "o", "gate_up", "down") for way in m[slot] for fmt, _ in way
        }
        compiled = {r["group"].split(":")[1] for r in rows if r["model"] == model}
        assert compiled == stored, (model, compiled, stored)


def test_every_variant_fits_the_targets_shared_memory(rows):
    over = [r for r in rows if r["shared"] > r["max_shared"]]
    assert not over, kernel_variants.table(over)


def test_no_variant_spills_registers(rows):
    spilling = [r for r in rows if r["stack"] > 0]
    assert not spilling, kernel_variants.table(spilling)


def test_attention_kernels_pipeline_their_kv_loads(rows):
    # The K/V tiles are indirect loads (through the block table) that Triton's pipeliner turns
    # into cp.async copies; with 3 stages the loop waits for all but the newest tile's copy
    # groups (cp.async.wait_group N, N >= 1), so that tile's loads overlap the math.
    def named(rs):
        keys = ("model", "dtype", "target", "kernel", "num_stages", "async_copies", "in_flight")
        return [tuple(r[k] for k in keys) for r in rs]

    attention = [r for r in rows if r["kernel"] in ("_decode_kernel", "_prefill_kernel")]
    assert any(r["kv"] == "int4" for r in attention)
    attention = [r for r in attention if "int4" not in r["kv"]]  # none of its loads is aligned
    synchronous = [r for r in attention if r["async_copies"] == 0]
    assert not synchronous, named(synchronous)
    decode = [r for r in attention if r["kernel"] == "_decode_kernel"]
    shallow = [r for r in decode if r["num_stages"] < 3]
    assert decode and not shallow, named(shallow)
    serial = [r for r in attention if r["num_stages"] >= 3 and r["in_flight"] < 1]
    assert not serial, named(serial)


def test_q4_k_gemv_reads_its_quants_in_16_byte_loads(rows):
    # A one-row decode is bound by the weight's bytes: its quants must come in 16-byte loads,
    # not a byte at a time. q4_k's blocks (144 bytes, quants at 16) are the aligned ones. (With
    # 2 or 4 rows a program's tile holds 8 bytes of quants a thread: those load 8 at a time.)
    gemv = [r for r in rows if r["kernel"] == "_quant_gemv_kernel" and r["group"].endswith("q4_k")]
    one_row = [r for r in gemv if r["params"]["BLOCK_M"] == 1]
    narrow = [r for r in one_row if r["wide_loads"] == 0]
    assert one_row and not narrow, kernel_variants.table(narrow)


def _allowed_variants(kv: str, kernel: str) -> int:
    """Variants a group may compile of a kernel: TILES', twice the write kernel's for a pair
    of formats, and two of attention with recent rows (the older rows', the recent ones')."""
    pair = "/" in kv and kernel in TILES
    recent = "+" in kv and kernel in ("_decode_kernel", "_prefill_kernel")
    return TILES.get(kernel, 1) * (2 if pair or recent else 1)


def test_one_variant_per_model_dtype_group_and_kernel(rows):
    variants = defaultdict(set)
    for r in rows:
        key = r["triton"], r["model"], r["dtype"], r["kv"], r["target"], r["group"], r["kernel"]
        variants[key].add(r["variant"])
    several = {k: v for k, v in variants.items() if len(v) > _allowed_variants(k[3], k[-1])}
    assert not several, sorted(several)


def test_resources_are_read_from_the_compiled_kernels(rows):
    # Every kernel holds registers; the attention kernels stage their dot operands in shared
    # memory. Zeros here would mean the counters were not read.
    assert all(r["registers"] > 0 for r in rows)
    attention = [r for r in rows if r["kernel"] in ("_decode_kernel", "_prefill_kernel")]
    assert attention and all(r["shared"] > 0 for r in attention)

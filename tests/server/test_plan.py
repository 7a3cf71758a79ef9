"""`kvserve plan` against hand-computed KV-cache sizes, from config.json alone (no weights)."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from engine.capacity import make_plan
from engine.core.config import GIB
from models.kv_spec import FullAttentionSpec, KVCacheGroup, MLASpec, SlidingWindowSpec
from server.cli import main as kvserve
from tests.helpers import tiny_deepseek_v3_config

DTYPE_BYTES = {"float32": 4, "bfloat16": 2}
ROOT = Path(__file__).resolve().parents[2]


def main(argv: list[str]) -> int:
    return kvserve(["plan", *argv])


def write_config(folder, **fields):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(fields))
    return folder


@pytest.fixture
def llama_dir(tmp_path):
    return write_config(
        tmp_path / "llama",
        architectures=["LlamaForCausalLM"],
        vocab_size=128,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=1024,
    )


@pytest.fixture
def deepseek_dir(tmp_path):
    pytest.importorskip("transformers")
    config = tiny_deepseek_v3_config(architectures=["DeepseekV3ForCausalLM"])
    config.save_pretrained(tmp_path / "deepseek")
    return tmp_path / "deepseek"


def expected_row(bytes_per_token: int, gib: float, block_size: int, max_len: int):
    blocks = int(gib * GIB) // (bytes_per_token * block_size)
    return blocks, blocks * block_size, blocks // -(-max_len // block_size)


@pytest.mark.parametrize(
    ("dtype", "kv", "stored", "row_bytes"),
    [("float32", "float32", "float32", 64), ("bfloat16", "auto", "bfloat16", 32),
     ("float32", "auto", "float16", 32), ("float32", "int8", "int8", 32 + 4)],
)  # fmt: skip
def test_llama_plan_is_k_and_v_per_kv_head_per_layer(llama_dir, dtype, kv, stored, row_bytes,
                                                     capsys):  # fmt: skip
    """``row_bytes``: a head's row of 16 values (int8: of 32, the least its rotation blocks
    take, and its float32 scale)."""
    if kv == "int8":
        config = json.loads((llama_dir / "config.json").read_text())
        (llama_dir / "config.json").write_text(json.dumps({**config, "hidden_size": 128}))
    per_token = 2 * 2 * row_bytes * 3  # K and V x kv_heads x layers
    flags = ["--model", str(llama_dir), "--kv-cache-memory", "0.25", "--dtype", dtype]
    assert main([*flags, "--kv-cache-dtype", kv]) == 0
    out = capsys.readouterr().out
    plan_kv = None if kv == "auto" else kv
    (row,) = make_plan(str(llama_dir), 0.25, dtype=dtype, kv_cache_dtype=plan_kv).rows
    blocks, tokens, seqs = expected_row(per_token, 0.25, 16, 1024)
    assert (row.bytes_per_token, row.num_blocks, row.tokens) == (per_token, blocks, tokens)
    assert row.max_seqs_at_full_len == seqs
    line = next(line for line in out.splitlines() if line.startswith("FullAttentionSpec"))
    row = ["3", f"{per_token:,}", str(blocks), f"{tokens:,}", str(seqs)]
    assert line.split()[1:] == [stored, *row]
    assert f"bytes/token: {per_token:,} (3 x {per_token // 3:,} FullAttentionSpec)" in out


def test_a_tensor_parallel_plan_is_one_ranks_share_of_the_kv_heads(llama_dir, capsys):
    per_token = 2 * 1 * 16 * 2 * 3  # 2 KV heads over 2 ranks: one each, bfloat16, 3 layers
    argv = ["--model", str(llama_dir), "--kv-cache-memory", "0.25", "--tensor-parallel-size", "2"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "per rank of 2" in out
    (row,) = make_plan(str(llama_dir), 0.25, tensor_parallel_size=2).rows
    assert row.bytes_per_token == per_token
    assert row.num_blocks == expected_row(per_token, 0.25, 16, 1024)[0]
    with pytest.raises(SystemExit):
        main(["--model", str(llama_dir), "--kv-cache-memory", "1", "--tensor-parallel-size", "3"])
    assert "4 attention heads, 2 KV heads and 128 MLP columns do not divide over 3" in (
        capsys.readouterr().err
    )


def test_a_tensor_parallel_mla_plan_keeps_the_whole_latent_on_every_rank(deepseek_dir, capsys):
    """MLA caches one latent row for all heads: splitting the heads leaves each rank all of it."""
    per_token = (32 + 8) * 2 * 2  # (kv_lora_rank + rope) x bfloat16 x layers, as with one rank
    argv = ["--model", str(deepseek_dir), "--kv-cache-memory", "0.25", "--max-model-len", "200"]
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    assert "per rank of 2 (each holds the whole latent cache" in capsys.readouterr().out
    (one,) = make_plan(str(deepseek_dir), 0.25, 200).rows
    (row,) = make_plan(str(deepseek_dir), 0.25, 200, tensor_parallel_size=2).rows
    assert row == one
    assert row.bytes_per_token == per_token
    with pytest.raises(SystemExit):
        main([*argv, "--tensor-parallel-size", "3"])
    err = capsys.readouterr().err
    assert "4 attention heads and 32 expert MLP columns do not divide over 3 ranks" in err
    assert "--tensor-parallel-size can be 1, 2, 4 for this model" in err


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_deepseek_plan_is_one_latent_row_per_layer(deepseek_dir, dtype, capsys):
    assert not list(deepseek_dir.glob("*.safetensors"))  # the plan needs no weights
    per_token = (32 + 8) * DTYPE_BYTES[dtype] * 2  # (kv_lora_rank + rope) x layers
    args = ["--model", str(deepseek_dir), "--kv-cache-memory", "0.25", "--max-model-len", "200"]
    assert main([*args, "--dtype", dtype, "--kv-cache-dtype", dtype, "--block-size", "32"]) == 0
    out = capsys.readouterr().out
    (row,) = make_plan(str(deepseek_dir), 0.25, 200, 32, dtype, kv_cache_dtype=dtype).rows
    blocks, tokens, seqs = expected_row(per_token, 0.25, 32, 200)
    assert (row.kind, row.num_layers, row.bytes_per_token) == ("MLASpec", 2, per_token)
    assert (row.num_blocks, row.tokens, row.max_seqs_at_full_len) == (blocks, tokens, seqs)
    assert f"bytes/token: {per_token:,} (2 x {per_token // 2:,} MLASpec)" in out
    assert "max_model_len 200" in out


def test_deepseek_v3_full_shapes_plan_from_config_alone(tmp_path, capsys):
    folder = write_config(
        tmp_path / "v3",
        architectures=["DeepseekV3ForCausalLM"],
        vocab_size=129280,
        hidden_size=7168,
        num_hidden_layers=61,
        num_attention_heads=128,
        kv_lora_rank=512,
        qk_rope_head_dim=64,
        qk_nope_head_dim=128,
        v_head_dim=128,
        max_position_embeddings=163840,
    )
    assert main(["--model", str(folder), "--kv-cache-memory", "40", "--dtype", "bfloat16"]) == 0
    out = capsys.readouterr().out
    assert "bytes/token: 70,272 (61 x 1,152 MLASpec)" in out  # 61 x 576 values x 2 bytes
    # A 163840-token sequence: 10240 blocks of 16 x 70,272 bytes.
    assert "one 163840-token sequence holds 10,980.0 MiB" in out


# Per model: its KV-cache groups, and K/V (or latent) values per token over all layers.
LAYOUTS = {
    "SmolLM2-135M": (
        lambda d: [KVCacheGroup(FullAttentionSpec(3, 64, d), tuple(range(30)))],
        30 * 2 * 3 * 64,
    ),
    "Gemma-3-270M": (
        lambda d: [
            KVCacheGroup(SlidingWindowSpec(1, 256, d, window_size=512), tuple(range(15))),
            KVCacheGroup(FullAttentionSpec(1, 256, d), tuple(range(15, 18))),
        ],
        18 * 2 * 1 * 256,
    ),
    "DeepSeek-V3": (
        lambda d: [KVCacheGroup(MLASpec(512, 64, d), tuple(range(61)))],
        61 * (512 + 64),
    ),
}


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("model", sorted(LAYOUTS))
def test_bytes_per_token_at_real_model_shapes(model, dtype):
    make_groups, values_per_token = LAYOUTS[model]
    groups = make_groups(dtype)
    assert sum(g.bytes_per_token for g in groups) == values_per_token * DTYPE_BYTES[dtype]


def test_mla_latent_is_far_smaller_than_per_head_kv_at_v3_shapes():
    mla = MLASpec(512, 64, "bfloat16").bytes_per_token
    # Decompressed, each of 128 heads would keep a 192-wide key and a 128-wide value.
    per_head = 128 * (128 + 64 + 128) * 2
    assert mla == 1152
    assert per_head / mla > 70


def test_plan_rejects_a_block_size_that_is_not_a_power_of_two(llama_dir):
    with pytest.raises(SystemExit) as e:
        main(["--model", str(llama_dir), "--kv-cache-memory", "1", "--block-size", "24"])
    assert e.value.code == 2


def capacity_table(text: str) -> list[str]:
    """The capacity table's header and group rows, as `format_capacity` writes them."""
    lines = text.splitlines()
    header = ["group", "dtype", "layers"]
    start = next(i for i, line in enumerate(lines) if line.split()[:3] == header)
    rows = [lines[start]]
    for line in lines[start + 1 :]:
        if not line.split() or not line.split()[0].split("(")[0].endswith("Spec"):
            break
        rows.append(line)
    return rows


def serve_log_until_started(argv: list[str], timeout_s: float = 300) -> str:
    """`kvserve serve` in a child process, its log up to the line saying it listens."""
    cmd = [sys.executable, "-m", "server.cli", "serve", *argv, "--port", "0"]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, cwd=ROOT)
    timer = threading.Timer(timeout_s, proc.kill)
    timer.start()
    log = []
    try:
        for line in proc.stderr:
            log.append(line)
            if "Uvicorn running on" in line:
                break
    finally:
        timer.cancel()
        proc.terminate()
        proc.wait(timeout=30)
    return "".join(log)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_dir", "gemma3_dir"])
def test_serve_logs_the_capacity_that_plan_prints(model, request, capsys):
    folder = request.getfixturevalue(model)
    flags = ["--model", str(folder), "--kv-cache-memory", "0.1", "--max-model-len", "4096"]
    flags += ["--dtype", "float32", "--block-size", "32"]
    assert main(flags) == 0
    planned = capacity_table(capsys.readouterr().out)
    log = serve_log_until_started(flags)
    assert "Uvicorn running on" in log, log[-2000:]
    assert capacity_table(log) == planned
    fit = min(int(row.split()[-1]) for row in planned[1:])
    assert f": {fit} sequences of max_model_len 4096 fit in the KV cache" in log
    groups = {"smollm2_dir": 1, "gemma3_dir": 2}[model]  # gemma3: sliding-window + full
    assert len(planned) == 1 + groups
    assert all(int(row.split()[4]) > 0 for row in planned[1:])  # blocks in every pool


@pytest.mark.slow
def test_a_gguf_file_is_planned_with_its_weights_at_their_stored_size(capsys, smollm2_dir):
    """The Q4_1 file's matrices count at their stored bytes; the converted float32 folder of
    the same model at 4 bytes a value, and at Q8_0's 34 bytes per 32 with --quantization."""
    from models.fetch import gguf_path

    gguf = gguf_path("smollm2-135m-instruct", progress=False)
    assert main(["--model", str(gguf), "--kv-cache-memory", "1"]) == 0
    line = capsys.readouterr().out.strip().splitlines()[-1]
    stored = float(line.split()[1].replace(",", "")) * 2**20
    assert 0.9 * gguf.stat().st_size < stored < 1.1 * gguf.stat().st_size
    fp32 = make_plan(str(smollm2_dir), 1.0, weight_dtype="float32").weight_bytes
    q8 = make_plan(str(smollm2_dir), 1.0, quantization="q8_0").weight_bytes
    embed = 49152 * 576 * 4  # the (tied) embedding stays float32
    assert fp32 == pytest.approx(134_515_008 * 4, rel=1e-3)
    assert q8 - embed == pytest.approx((fp32 - embed) * 34 / 32 / 4, rel=0.01)


def test_the_host_tier_has_its_own_rows(llama_dir, capsys):
    """--kv-host-cache-gib: blocks of the same bytes in host memory, and the tokens they keep."""
    assert main(["--model", str(llama_dir), "--kv-cache-memory", "1", "--dtype", "float32",
                 "--kv-host-cache-gib", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    (device,) = [l for l in out if l.startswith("FullAttentionSpec ") and "host" not in l]
    (host,) = [line for line in out if line.startswith("FullAttentionSpec (host tier)")]
    device_blocks, host_blocks = int(device.split()[4]), int(host.split()[6])
    assert abs(host_blocks - 2 * device_blocks) <= 2  # each rounded down
    assert int(host.split()[7].replace(",", "")) == host_blocks * 16


def test_the_disk_tier_has_its_own_rows(llama_dir, capsys):
    """--kv-disk-cache-gib under a host tier: files of a block and a header each, no more of
    them than the bound holds."""
    from engine.worker.disk_tier import file_overhead

    assert main(["--model", str(llama_dir), "--kv-cache-memory", "1", "--dtype", "float32",
                 "--kv-host-cache-gib", "1", "--kv-disk-cache-gib", "4"]) == 0  # fmt: skip
    out = capsys.readouterr().out.splitlines()
    (disk,) = [line for line in out if line.startswith("FullAttentionSpec (disk tier)")]
    bytes_per_token, blocks = int(disk.split()[5].replace(",", "")), int(disk.split()[6])
    file_bytes = bytes_per_token * 16 + file_overhead(16)
    assert blocks * file_bytes <= 4 * 2**30 < (blocks + 1) * file_bytes

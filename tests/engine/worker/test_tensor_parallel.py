"""Tensor parallelism on CPU over gloo: N ranks (processes) give the tokens one rank gives."""

from __future__ import annotations

import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest

from engine import LLM, SamplingParams
from engine.core.errors import EngineDeadError
from models.tokenizer import Tokenizer
from server.cli import main as kvserve
from tests.helpers import (
    free_port,
    random_prompt,
    save_tiny_deepseek_v3,
    save_tiny_gemma3,
    wait_until_healthy,
)

ROOT = Path(__file__).resolve().parents[3]

pytestmark = pytest.mark.slow


ENGINE = dict(num_kv_blocks=64, block_size=8, max_num_batched_tokens=24)


def greedy(model_dir, prompts: list[list[int]], tp: int, **kw) -> list[list[int]]:
    llm = LLM(str(model_dir), device="cpu", tensor_parallel_size=tp, **ENGINE, **kw)
    try:
        params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
        return [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
    finally:
        llm.engine.shutdown()


def test_two_ranks_give_the_tokens_of_one_gqa_and_sliding_window(tiny_llama_dir, tmp_path):
    """Llama (4 query heads, 2 KV heads) and Gemma 3 (interleaved sliding window), chunked
    prefills beside decodes."""
    prompts = [random_prompt(n, 120, seed=n) for n in (5, 30, 47)]
    assert greedy(tiny_llama_dir, prompts, 2) == greedy(tiny_llama_dir, prompts, 1)
    save_tiny_gemma3(tmp_path)
    long = [random_prompt(n, 250, seed=n) for n in (9, 70)]  # past the 32-token window
    assert greedy(tmp_path, long, 2) == greedy(tmp_path, long, 1)


def test_heads_that_do_not_divide_are_refused_with_the_sizes_that_work(smollm2_dir):
    with pytest.raises(ValueError, match="9 attention heads and 3 KV heads do not divide over 2"):
        LLM(str(smollm2_dir), device="cpu", tensor_parallel_size=2)


def test_smollm2_over_three_ranks_equals_one(smollm2_dir):
    ids = Tokenizer.from_dir(smollm2_dir).encode("The capital of France is")
    one = greedy(smollm2_dir, [ids], 1, max_model_len=256)
    assert greedy(smollm2_dir, [ids], 3, max_model_len=256) == one


def test_a_rank_that_dies_ends_the_engine_with_an_error(tiny_llama_dir):
    llm = LLM(str(tiny_llama_dir), device="cpu", tensor_parallel_size=2, num_kv_blocks=32,
              block_size=8)  # fmt: skip
    try:
        llm.generate([random_prompt(5, 120)], SamplingParams(max_tokens=2))
        worker = llm.engine.workers.procs[0]
        worker.kill()
        worker.join()
        with pytest.raises(EngineDeadError, match=r"rank\(s\) \[1\] exited"):
            llm.generate([random_prompt(5, 120)], SamplingParams(max_tokens=2))
    finally:
        llm.engine.shutdown()


def test_two_ranks_give_the_tokens_of_one_mla_with_experts(tmp_path):
    """DeepSeek-V3 (MLA heads split, latent replicated; a dense layer, then a mixture of
    experts split per expert), chunked prefills beside decodes."""
    save_tiny_deepseek_v3(tmp_path)
    prompts = [random_prompt(n, 128, seed=n) for n in (5, 30, 47)]
    assert greedy(tmp_path, prompts, 2) == greedy(tmp_path, prompts, 1)


def completion_tokens(url: str, prompt: list[int]) -> list[int]:
    body = {"prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True,
            "logprobs": 0}  # fmt: skip
    r = httpx.post(url + "/v1/completions", json=body, timeout=60)
    assert r.status_code == 200, r.text
    tokens = r.json()["choices"][0]["logprobs"]["tokens"]  # "token_id:N" without a tokenizer
    return [int(t.removeprefix("token_id:")) for t in tokens]


def test_ranks_started_by_torchrun_serve_the_tokens_of_one_rank(tiny_llama_dir, tmp_path):
    """`torchrun --nproc-per-node 2 -m server.cli serve --tensor-parallel-size 2`: rank 0 serves
    HTTP and schedules, rank 1 runs the steps it is sent; concurrent requests batch together."""
    prompts = [random_prompt(n, 120, seed=n) for n in (5, 30, 47)]
    port = free_port()
    flags = [f"--{k.replace('_', '-')}={v}" for k, v in ENGINE.items()]
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
        "-m", "server.cli", "serve", "--model", str(tiny_llama_dir), "--device", "cpu",
        "--tensor-parallel-size", "2", *flags, "--port", str(port), "--log-level", "warning",
    ]  # fmt: skip
    log = open(tmp_path / "torchrun.log", "w+")
    proc = subprocess.Popen(argv, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
                            env={**os.environ, "OMP_NUM_THREADS": "1"})  # fmt: skip
    try:
        url = f"http://127.0.0.1:{port}"
        wait_until_healthy(proc, url, 60)
        with ThreadPoolExecutor(len(prompts)) as pool:
            served = list(pool.map(lambda p: completion_tokens(url, p), prompts))
    except AssertionError:
        log.seek(0)
        raise AssertionError(log.read()[-4000:]) from None
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert served == greedy(tiny_llama_dir, prompts, 1)


def test_a_launcher_world_size_other_than_the_tensor_parallel_size_is_refused(
    tiny_llama_dir, monkeypatch, capsys
):
    env = {"RANK": "0", "WORLD_SIZE": "3", "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": "1"}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    with pytest.raises(SystemExit) as exit:
        kvserve(["serve", "--model", str(tiny_llama_dir), "--tensor-parallel-size", "2"])
    assert exit.value.code == 2
    assert "launcher started 3 ranks (WORLD_SIZE) but --tensor-parallel-size is 2" in (
        capsys.readouterr().err
    )


def test_two_ranks_of_a_quantized_model_give_the_tokens_of_one(tiny_llama_dir):
    """Both on the reference path (ranks run no C++ layers): each rank's share of a matrix
    quantizes to the blocks of the whole one, the row-parallel ones split on block edges."""
    prompts = [random_prompt(n, 120, seed=n) for n in (5, 30)]
    one = greedy(tiny_llama_dir, prompts, 1, quantization="q8_0", cpu_kernels=False)
    assert greedy(tiny_llama_dir, prompts, 2, quantization="q8_0") == one


def test_block_format_matrices_split_on_block_boundaries_or_are_refused():
    import torch

    from kernels.quant import dequantize, quantize
    from kernels.weights import Weight
    from models.tensor_parallel import TPRank, shard_weights

    full = torch.randn(6, 128)
    w = Weight(quantize(full, "q8_0"), None, "q8_0")
    names = ("model.layers.0.mlp.gate_proj.weight", "model.layers.0.mlp.down_proj.weight")
    dense = dequantize(w)
    for rank in (0, 1):
        (_, column), (_, row) = shard_weights([(n, w) for n in names], TPRank(rank, 2))
        torch.testing.assert_close(dequantize(column), dense.chunk(2, dim=0)[rank])
        torch.testing.assert_close(dequantize(row), dense.chunk(2, dim=1)[rank])
    with pytest.raises(ValueError, match=r"128 inputs in blocks of 32: they do not split over 3"):
        list(shard_weights([(names[1], w)], TPRank(0, 3)))

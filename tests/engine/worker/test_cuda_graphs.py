"""Decode steps from CUDA graphs give the tokens and logits of eager steps (GPU only), and the
engine says why it runs eagerly where graphs cannot be used."""

from __future__ import annotations

import pytest
import torch

from engine import LLM
from engine.worker.cuda_graphs import batch_sizes
from tests.helpers import (
    TINY_DEEPSEEK_V3,
    TINY_GEMMA3,
    TINY_LLAMA,
    generate_with_logits,
    random_prompt,
    save_tiny_deepseek_v3,
    save_tiny_gemma3,
    save_tiny_llama,
)

pytest.importorskip("transformers")
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")


def test_batch_sizes_cover_every_batch_up_to_max_num_seqs():
    assert batch_sizes(1) == [1]
    assert batch_sizes(5) == [1, 2, 4, 5]
    assert batch_sizes(64) == [1, 2, 4, 8, 16, 24, 32, 48, 64]
    for n in range(1, 300):
        sizes = batch_sizes(n)
        assert sizes == sorted(set(sizes)) and sizes[-1] == min(n, 256)


def test_cpu_engine_runs_eagerly_and_says_why(tmp_path):
    save_tiny_llama(tmp_path)
    llm = LLM(str(tmp_path), device="cpu", max_model_len=64, num_kv_blocks=8)
    assert llm.engine.runner.graphs is None
    assert llm.engine.runner.graphs_unavailable() == "not on CUDA"


@cuda
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("arch", ["llama", "gemma3", "deepseek_v3"])
def test_graphs_give_the_greedy_tokens_of_eager_steps(tmp_path, monkeypatch, arch, dtype):
    save, fields = {
        "llama": (save_tiny_llama, TINY_LLAMA),
        "gemma3": (save_tiny_gemma3, TINY_GEMMA3),
        "deepseek_v3": (save_tiny_deepseek_v3, TINY_DEEPSEEK_V3),
    }[arch]
    save(tmp_path)
    # 5 and 3 running sequences replay padded graphs (8 and 4); the long prompt is prefilled in
    # chunks while the others decode (eager steps), and Gemma's local ring wraps (window 32).
    prompts = [random_prompt(n, fields["vocab_size"], seed=n) for n in (1, 7, 30, 70, 5)]
    runs, replays = [], []
    for eager in (True, False):
        llm = LLM(
            str(tmp_path), device="cuda", dtype=dtype, max_model_len=160, num_kv_blocks=64,
            block_size=16, max_num_seqs=8, max_num_batched_tokens=32, enforce_eager=eager,
        )  # fmt: skip
        assert (llm.engine.runner.graphs is None) == eager
        if not eager:
            graphs = llm.engine.runner.graphs

            def counted(step, run=graphs.run):
                replays.append(len(step.input_ids))
                return run(step)

            monkeypatch.setattr(graphs, "run", counted)
        runs.append(generate_with_logits(llm, prompts, monkeypatch, max_tokens=40))
    # Replays happened, some of them padded to a larger captured batch.
    assert any(n not in batch_sizes(8) for n in replays)
    tol = 1e-4 if dtype == "float32" else 3e-2
    for (eager_tokens, eager_logits), (graph_tokens, graph_logits) in zip(*runs):
        assert graph_tokens == eager_tokens
        assert (graph_logits - eager_logits).abs().max().item() < tol

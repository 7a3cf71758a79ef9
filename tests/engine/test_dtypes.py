"""Every ``--dtype`` on every device and attention backend serves, greedy, what transformers
computes at that dtype on the same weights: the model runner alone decides whether the C++
library runs the model's layers, and the backend and the start-up log take that answer. Where
it does, a 16-bit dtype narrows the matrices only (the activations stay float32): transformers'
float32 model over the same narrowed matrices is then the oracle, as close as float32's."""

from __future__ import annotations

import copy

import pytest
import torch

from engine import LLM
from engine.worker.model_runner import model_kernels_off
from kernels import cpu
from models.kv_spec import DTYPES
from tests.helpers import (
    TINY_LLAMA,
    assert_greedy_as,
    generate_with_logits,
    random_prompt,
    save_tiny_llama,
)

pytest.importorskip("transformers")

MAX_TOKENS = 12
# Largest logit difference from transformers at the same dtype: float32 is exact up to the
# order of sums; two correct half-precision computations round differently (measured on this
# model: up to 0.17 apart, transformers' float16 as far from float32 as that).
TOL = {"float32": 1e-4, "bfloat16": 0.25, "float16": 0.25}
PROMPTS = [random_prompt(n, TINY_LLAMA["vocab_size"], seed=n) for n in (1, 9, 23)]


def combinations() -> list[tuple[str, str, str, bool]]:
    """(device, dtype, attention backend, cpu kernels) for every device this machine has."""
    cases = []
    for dtype in DTYPES:
        cases += [("cpu", dtype, "torch", False), ("cpu", dtype, "cpu", False)]
        cases.append(("cpu", dtype, "cpu", True))
        cases += [("cuda", dtype, backend, False) for backend in ("torch", "triton")]
    return cases


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("llama_dtypes")
    return path, save_tiny_llama(path)


@pytest.mark.parametrize(("device", "dtype", "backend", "kernels"), combinations())
def test_every_dtype_serves_greedy_as_transformers_does(
    checkpoint, device, dtype, backend, kernels, monkeypatch, one_thread
):
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    if backend == "cpu" and cpu.load() is not None:
        pytest.skip(f"the C++ kernels are unavailable: {cpu.load()}")
    path, model = checkpoint
    narrowed = kernels and dtype != "float32"  # float32 activations over 16-bit matrices
    llm = LLM(
        str(path), dtype=dtype, kv_cache_dtype="float32" if narrowed else dtype, device=device,
        attention_backend=backend, cpu_kernels=kernels, max_model_len=64, num_kv_blocks=16,
        block_size=16, max_num_batched_tokens=16,
    )  # fmt: skip
    runner = llm.engine.runner
    off = model_kernels_off(runner.config)
    # A CPU model with its kernels asked for runs its layers on them, in every dtype.
    assert (off is None) == kernels
    assert runner.cpu_kernels.startswith("on") == (off is None)
    assert getattr(runner.backend, "model_kernels", False) == (off is None)
    matrices = [m for m in runner.model.modules() if hasattr(m, "parts")]
    if kernels:
        assert {p.data.dtype for m in matrices for p in m.parts} == {getattr(torch, dtype)}
        assert {p.dtype for p in runner.model.parameters() if p.dim() == 1} == {torch.float32}

    results = generate_with_logits(llm, PROMPTS, monkeypatch, MAX_TOKENS)
    # A copy: casting the shared model down and back would round its float32 weights.
    oracle = copy.deepcopy(model).to(device=device, dtype=getattr(torch, dtype))
    tol = TOL[dtype]
    if narrowed:
        oracle, tol = copy.deepcopy(model), TOL["float32"]
        for m in oracle.modules():
            if isinstance(m, torch.nn.Linear | torch.nn.Embedding):
                m.weight.data = m.weight.data.to(getattr(torch, dtype)).float()
    for prompt, (tokens, logits) in zip(PROMPTS, results):
        with torch.no_grad():
            ids = torch.tensor([prompt + tokens[:-1]], device=device)
            ref = oracle(ids).logits[0, len(prompt) - 1 :].float().cpu()
        assert (logits - ref).abs().max().item() < tol
        assert_greedy_as(tokens, ref, tol)

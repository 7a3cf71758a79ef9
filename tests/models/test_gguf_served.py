"""GGUF files served directly, their matrices in their block formats, against transformers'
float32 forward of the same file (its matrices dequantized by gguf-py). For SmolLM2 and Gemma 3
transformers reads the converted float32 folder instead, which holds the same values (gguf-py's
dequantization of the same file) and loads in a fraction of the time."""

from __future__ import annotations

import pytest
import torch

from bench.drift import compare, kvserve_logprobs, reference_logprobs, reference_model, text_ids
from engine import LLM, SamplingParams
from kernels.quant import QuantLinear
from models.fetch import gguf_path, served_gguf
from models.tokenizer import Tokenizer

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    " ".join(f"Item {i}: {i * 7} is {'even' if i % 2 == 0 else 'odd'}." for i in range(24)),
]


CONVERTED = {"smollm2-135m-instruct": "smollm2_dir", "gemma3-270m": "gemma3_dir"}


@pytest.fixture(scope="module")
def qwen05_reference(qwen05_dir):
    """transformers' float32 Qwen 0.5B from the GGUF file, loaded once for the module."""
    return reference_model(qwen05_dir)


def _folder(name: str, request):
    if name == "qwen2.5-coder-0.5b-instruct":
        return request.getfixturevalue("qwen05_dir")
    return served_gguf(gguf_path(name, progress=False))


def _reference(name: str, folder, request):
    from transformers import AutoModelForCausalLM

    if name == "qwen2.5-coder-0.5b-instruct":
        return request.getfixturevalue("qwen05_reference")
    if name in CONVERTED:
        converted = request.getfixturevalue(CONVERTED[name])
        return AutoModelForCausalLM.from_pretrained(converted, dtype=torch.float32).eval()
    return reference_model(folder)


@pytest.mark.parametrize(
    "name", ["qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma3-270m"]
)
def test_concurrent_greedy_tokens_equal_transformers_on_the_same_gguf(name, request):
    folder = _folder(name, request)
    # A small token budget puts the long prompt through several prefill chunks while the others
    # decode in the same steps.
    llm = LLM(str(folder), max_model_len=1024, num_kv_blocks=96, max_num_batched_tokens=64)
    runner = llm.engine.runner
    linears = [m for m in runner.model.modules() if hasattr(m, "parts")]
    assert linears and all(p.format != "dense" for m in linears for p in m.parts)
    assert not any(isinstance(m, torch.nn.Linear) for m in runner.model.modules())
    ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len(ids[3]) > 2 * 64
    outs = llm.generate(ids, SamplingParams(max_tokens=10, temperature=0))
    hf = _reference(name, folder, request)
    for prompt, out in zip(ids, outs):
        with torch.no_grad():
            ref = hf.generate(torch.tensor([prompt]), max_new_tokens=10, do_sample=False)
        assert out.outputs[0].token_ids == ref[0, len(prompt) :].tolist()
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks


def test_qwen_05b_drift_from_transformers_over_500_tokens(qwen05_dir, qwen05_reference):
    ids = text_ids(Tokenizer.from_dir(qwen05_dir), 500)
    ref = reference_logprobs(qwen05_dir, ids, qwen05_reference)
    got = compare(kvserve_logprobs(qwen05_dir, ids), ref, ids)
    assert got["mean_kld"] <= 2e-3 and got["top1"] >= 0.99, got


def test_the_torch_path_is_the_dequantized_reference(qwen05_dir):
    """The reference forward of a QuantLinear equals F.linear over gguf-py's dequantized rows,
    mixed-format parts and biases included (Qwen2's q|k in Q5_0 and v in Q8_0, with biases)."""
    from kernels.quant import dequantize
    from models.config import ModelConfig
    from models.loader import load_model

    model = load_model(ModelConfig.from_dir(qwen05_dir), torch.float32, torch.device("cpu"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, QuantLinear) and qkv.formats == ("q5_0", "q8_0")
    assert [p.bias is not None for p in qkv.parts] == [True, True]
    x = torch.randn(3, qkv.in_features, dtype=torch.float64)
    weight = torch.cat([dequantize(p).double() for p in qkv.parts])
    expected = x @ weight.T + qkv.bias.double()
    torch.testing.assert_close(qkv(x.float()).double(), expected, rtol=1e-4, atol=1e-4)

"""Gemma 3 against transformers: a small random checkpoint whose 64-token window wraps the ring
many times in a fast test, and the real 270M checkpoint on a prompt three windows long."""

from __future__ import annotations

import textwrap
from math import ceil
from pathlib import Path
from types import MappingProxyType

import pytest
import torch

from engine import LLM, SamplingParams
from kernels.backend import TorchBackend
from kernels.reference import apply_rope
from models.config import ModelConfig
from models.gemma3 import Gemma3ForCausalLM, rope_parameters
from models.kv_spec import FullAttentionSpec, SlidingWindowSpec
from models.layers import rope_cos_sin
from models.loader import load_model
from tests.helpers import random_prompt, tiny_gemma3

transformers = pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

TINY_VOCAB = 512
TINY_WINDOW = 64
BLOCK = 16
TINY_LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention"]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> tuple[Path, torch.nn.Module]:
    """A random Gemma 3 with every feature the real one has plus GQA, a query scalar that is
    not head_dim, final softcapping and untied embeddings (tied ones make random models repeat
    one token)."""
    model = tiny_gemma3(
        vocab_size=TINY_VOCAB,
        layer_types=TINY_LAYERS,
        sliding_window=TINY_WINDOW,
        query_pre_attn_scalar=24,
        final_logit_softcapping=30.0,
        max_position_embeddings=4096,
    )
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:  # transformers starts them at 0, which hides a missing (1 + w)
                param.normal_(0, 0.3)
    path = tmp_path_factory.mktemp("tiny-gemma3")
    model.save_pretrained(path)
    return path, model


def hf_greedy(model, ids: list[int], max_new_tokens: int) -> tuple[list[int], torch.Tensor]:
    """transformers' greedy tokens and its log-probabilities [steps, vocab]."""
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]),
            max_new_tokens=max_new_tokens,
            do_sample=False,
            output_logits=True,
            return_dict_in_generate=True,
        )
    logprobs = torch.log_softmax(torch.stack(out.logits)[:, 0].float(), dim=-1)
    return out.sequences[0, len(ids) :].tolist(), logprobs


def assert_logprobs_close(logprobs, ref: torch.Tensor, atol: float) -> None:
    """Chosen and top-k log-probabilities equal the reference's."""
    worst = 0.0
    for step, record in enumerate(logprobs):
        pairs = [(record.token_id, record.logprob), *record.top]
        for token, value in pairs:
            worst = max(worst, abs(value - ref[step, token].item()))
    assert worst < atol, f"log-probabilities differ from transformers by {worst:.2e}"


def test_kv_cache_groups_put_local_layers_in_a_ring_and_global_ones_in_full(tiny):
    path, _ = tiny
    groups = Gemma3ForCausalLM.kv_cache_groups(ModelConfig.from_dir(path), "float32")
    assert [type(g.spec) for g in groups] == [SlidingWindowSpec, FullAttentionSpec]
    # transformers masks kv_idx > q_idx - sliding_window: the window counts the current token,
    # as our spec's does, so the two sizes are the same number.
    assert groups[0].spec.window == TINY_WINDOW
    assert groups[0].layer_ids == (0, 1, 3)
    assert groups[1].layer_ids == (2,)
    assert (groups[0].spec.num_kv_heads, groups[0].spec.head_dim) == (2, 32)


def test_rope_and_layer_pattern_read_from_older_flat_config_keys():
    hf = {
        "num_hidden_layers": 12,
        "rope_theta": 1e6,
        "rope_local_base_freq": 1e4,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0},
        "sliding_window_pattern": 6,
        "sliding_window": 1024,
        "num_attention_heads": 8,
        "num_key_value_heads": 4,
        "head_dim": 256,
        "hidden_size": 2560,
    }
    cfg = ModelConfig(Path("."), MappingProxyType(hf))
    rope = rope_parameters(cfg)
    assert rope["full_attention"] == {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6}
    assert rope["sliding_attention"] == {"rope_theta": 1e4}
    groups = Gemma3ForCausalLM.kv_cache_groups(cfg, "float32")
    assert groups[1].layer_ids == (5, 11)
    assert groups[0].spec.window == 1024


def test_context_shift_rotates_each_layer_with_its_own_rope_base(tiny):
    """A key cached at position p and re-rotated by -d equals the key rotated at p - d, with the
    local base on sliding layers and the global one on full layers, as transformers has them."""
    path, hf = tiny
    model = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
    key = torch.randn(BLOCK, 2, 32, generator=torch.Generator().manual_seed(0))
    positions, delta = torch.arange(1000, 1000 + BLOCK), 600
    for layer_id, kind in enumerate(TINY_LAYERS):
        layout = model.cached_key_rope(layer_id)
        assert torch.equal(layout.inv_freq, getattr(hf.model.rotary_emb, f"{kind}_inv_freq"))
        cache = apply_rope(key, *rope_cos_sin(positions, layout.inv_freq, key.dtype))[None]
        TorchBackend().rotate_keys(cache, torch.tensor([0]), -delta, layout)
        moved = apply_rope(key, *rope_cos_sin(positions - delta, layout.inv_freq, key.dtype))
        torch.testing.assert_close(cache[0], moved, atol=1e-3, rtol=0)


class WriteOncePerSlot(TorchBackend):
    def write_cache(self, cache: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        # The CPU scatter lets the last duplicate win, which happens to be right; a GPU scatter
        # picks any, so tokens the ring overwrites within their own chunk must not be written.
        written = slots[slots >= 0]
        assert written.unique().numel() == written.numel(), "two tokens of a step share a slot"
        super().write_cache(cache, rows, slots)


def test_window_edges_and_self_wrapping_chunks_match_transformers(tiny):
    """Prompts around the window and ring sizes (64 and 80 slots) prefilled in 100-token chunks,
    so a chunk overwrites ring slots it has itself just filled, decoding alongside each other."""
    path, hf = tiny
    lengths = [5, 63, 64, 65, 79, 80, 81, 177, 400]
    prompts = [random_prompt(n, TINY_VOCAB, seed) for seed, n in enumerate(lengths)]
    llm = LLM(
        str(path),
        kv_cache_dtype="float32",
        max_model_len=1024,
        num_kv_blocks=128,
        block_size=BLOCK,
        max_num_batched_tokens=100,
    )
    runner = llm.engine.runner
    runner.backend = WriteOncePerSlot()
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True, logprobs=5)
    outs = llm.generate(prompts, params)
    for ids, out in zip(prompts, outs):
        assert out.outputs[0].finish_reason == "length", "the engine failed the request"
        ref_tokens, ref_logprobs = hf_greedy(hf, ids, 40)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {len(ids)} tokens"
        assert_logprobs_close(out.outputs[0].logprobs, ref_logprobs, atol=1e-4)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks


def test_3000_token_sequence_holds_at_most_ring_len_local_blocks(tiny):
    path, hf = tiny
    llm = LLM(
        str(path),
        kv_cache_dtype="float32",
        max_model_len=4096,
        num_kv_blocks=400,
        block_size=BLOCK,
        max_num_batched_tokens=256,
    )
    engine = llm.engine
    ring_group = next(
        i for i, g in enumerate(engine.runner.groups) if isinstance(g.spec, SlidingWindowSpec)
    )
    ring_len = engine.runner.groups[ring_group].spec.ring_len(BLOCK)
    assert ring_len == ceil(TINY_WINDOW / BLOCK) + 1
    full_group = 1 - ring_group
    prompts = {
        "long": random_prompt(2960, TINY_VOCAB, 100),
        "short": random_prompt(30, TINY_VOCAB, 101),
    }
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True, logprobs=0)
    for rid, ids in prompts.items():
        engine.add_request(rid, ids, params)
    tokens: dict[str, list[int]] = {rid: [] for rid in prompts}
    logprobs: dict[str, list] = {rid: [] for rid in prompts}
    most_local_blocks = 0
    while engine.has_unfinished:
        for delta in engine.step():
            tokens[delta.request_id] += delta.outputs[0].token_ids
            logprobs[delta.request_id] += delta.outputs[0].logprobs
        live = engine.scheduler.live_requests
        for req in live:
            local, full = req.block_tables[ring_group], req.block_tables[full_group]
            assert len(local) <= ring_len
            assert len(full) == ceil(req.num_computed_tokens / BLOCK)
            most_local_blocks = max(most_local_blocks, len(local))
        engine.kv.check_integrity([req.block_tables for req in live])
    assert most_local_blocks == ring_len
    assert len(prompts["long"]) + len(tokens["long"]) >= 3000
    assert engine.kv.num_free_blocks == engine.kv.num_total_blocks
    engine.kv.check_integrity([])
    for rid, ids in prompts.items():
        ref_tokens, ref_logprobs = hf_greedy(hf, ids, 48)
        assert tokens[rid] == ref_tokens, rid
        assert_logprobs_close(logprobs[rid], ref_logprobs, atol=1e-4)


# -- the real checkpoint -----------------------------------------------------------------------

SHORT_PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n",
    "Once upon a time, in a small village,",
]


@pytest.mark.slow
def test_long_prompt_and_concurrent_short_ones_equal_transformers(gemma3_dir):
    """1,600 prompt tokens (three windows of 512) in 512-token chunks, 64 greedy tokens, while
    three short prompts prefill and decode in the same steps."""
    llm = LLM(
        str(gemma3_dir),
        kv_cache_dtype="float32",
        max_model_len=2048,
        num_kv_blocks=300,
        block_size=BLOCK,
        max_num_batched_tokens=512,
    )
    # Python source is predictable text: the greedy path keeps clear of near ties.
    long_ids = llm.tokenizer.encode(Path(textwrap.__file__).read_text())[:1600]
    assert len(long_ids) == 1600
    prompts = [llm.tokenizer.encode(p) for p in SHORT_PROMPTS] + [long_ids]
    new_tokens = [24, 24, 24, 64]
    params = [
        SamplingParams(temperature=0, max_tokens=n, ignore_eos=True, logprobs=0) for n in new_tokens
    ]
    outs = llm.generate(prompts, params)
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks
    del llm
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gemma3_dir), dtype=torch.float32
    ).eval()
    for ids, n, out in zip(prompts, new_tokens, outs):
        ref_tokens, ref_logprobs = hf_greedy(hf, ids, n)
        assert out.outputs[0].token_ids == ref_tokens, f"prompt of {len(ids)} tokens"
        assert_logprobs_close(out.outputs[0].logprobs, ref_logprobs, atol=1e-3)

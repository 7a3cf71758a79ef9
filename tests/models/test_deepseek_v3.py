"""DeepSeek-V3 (MLA + MoE) through the engine against transformers on the same random weights."""

from __future__ import annotations

import copy
import json

import pytest
import torch

from engine import LLM
from models import deepseek_v3
from models.config import ModelConfig
from models.deepseek_v3 import DeepseekV3ForCausalLM, MoE, rope_frequencies, softmax_scale
from models.kv_spec import MLASpec
from models.loader import iter_safetensors, load_model
from tests.helpers import TINY_DEEPSEEK_V3 as TINY
from tests.helpers import generate_with_logits, naive_loop_moe, random_prompt, tiny_deepseek_v3

transformers = pytest.importorskip("transformers")

MAX_TOKENS = 32
TOL = 1e-4


def make_checkpoint(path, **overrides):
    """A random fp32 DeepseekV3ForCausalLM saved to ``path``; returns the transformers model."""
    model = tiny_deepseek_v3(**overrides)
    with torch.no_grad():
        for layer in model.model.layers[model.config.first_k_dense_replace :]:
            # A non-zero bias changes which experts are chosen but not their weights.
            layer.mlp.gate.e_score_correction_bias.uniform_(-0.3, 0.3)
    model.save_pretrained(path)
    return model


def engine(path, **kw) -> LLM:
    args = dict(max_model_len=192, num_kv_blocks=48, block_size=16, device="cpu")
    return LLM(str(path), dtype="float32", kv_cache_dtype="float32", **{**args, **kw})


def reference_logits(model, prompt: list[int], tokens: list[int]) -> torch.Tensor:
    """transformers' logits for the positions that produced ``tokens`` (teacher-forced)."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + tokens[:-1]])).logits[0]
    return logits[len(prompt) - 1 :]


def assert_matches_reference(model, prompts, results) -> float:
    worst = 0.0
    for prompt, (tokens, logits) in zip(prompts, results):
        assert len(tokens) == MAX_TOKENS
        ref = reference_logits(model, prompt, tokens)
        assert logits.shape == ref.shape
        worst = max(worst, (logits - ref).abs().max().item())
        assert tokens == ref.argmax(dim=-1).tolist()
    assert worst < TOL
    return worst


def prompt_of(length: int, seed: int) -> list[int]:
    return random_prompt(length, TINY["vocab_size"], seed, low=0)


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path = tmp_path_factory.mktemp("deepseek_v3")
    return path, make_checkpoint(path)


def test_logits_and_greedy_tokens_match_transformers(checkpoint, monkeypatch):
    path, model = checkpoint
    prompts = [prompt_of(20, 1)]
    assert_matches_reference(
        model, prompts, generate_with_logits(engine(path), prompts, monkeypatch, MAX_TOKENS)
    )


def test_chunked_prefill_matches_transformers(checkpoint, monkeypatch):
    path, model = checkpoint
    prompts = [prompt_of(45, 2)]
    llm = engine(path, max_num_batched_tokens=16)
    assert_matches_reference(
        model, prompts, generate_with_logits(llm, prompts, monkeypatch, MAX_TOKENS)
    )


def test_concurrent_prompts_of_different_lengths_match_transformers(checkpoint, monkeypatch):
    path, model = checkpoint
    # Lengths around block boundaries; a small budget mixes decodes with prefill chunks.
    prompts = [prompt_of(n, 10 + n) for n in (1, 15, 17, 33, 50)]
    llm = engine(path, max_num_batched_tokens=24)
    assert_matches_reference(
        model, prompts, generate_with_logits(llm, prompts, monkeypatch, MAX_TOKENS)
    )


def test_yarn_rope_without_q_lora_or_interleave_matches_transformers(tmp_path, monkeypatch):
    yarn = {
        "rope_type": "yarn",
        "rope_theta": 10000.0,
        "factor": 4.0,
        "original_max_position_embeddings": 32,
        "mscale": 1.0,
        "mscale_all_dim": 0.7,
        "beta_fast": 32,
        "beta_slow": 1,
    }
    model = make_checkpoint(tmp_path, q_lora_rank=None, rope_interleave=False, rope_parameters=yarn)
    prompts = [prompt_of(40, 3), prompt_of(9, 4)]  # runs past original_max_position_embeddings
    results = generate_with_logits(engine(tmp_path), prompts, monkeypatch, MAX_TOKENS)
    assert_matches_reference(model, prompts, results)


def test_cache_holds_one_latent_row_per_token_and_layer(checkpoint):
    path, _ = checkpoint
    llm = engine(path, num_kv_blocks=8)
    runner = llm.engine.runner
    (group,) = runner.groups
    row = TINY["kv_lora_rank"] + TINY["qk_rope_head_dim"]
    assert group.spec == MLASpec(TINY["kv_lora_rank"], TINY["qk_rope_head_dim"], "float32")
    assert group.bytes_per_token == TINY["num_hidden_layers"] * row * 4
    assert len(runner.kv_caches) == TINY["num_hidden_layers"]
    for k_cache, v_cache in runner.kv_caches:
        assert k_cache.shape == (8, 16, 1, row)
        assert v_cache.shape == (8, 16, 1, TINY["kv_lora_rank"])
        assert v_cache.data_ptr() == k_cache.data_ptr()  # the value is a view of the key row


def test_yarn_frequencies_and_scale_of_a_v3_config_equal_transformers(tmp_path):
    # DeepSeek-V3's own config.json spells rope as rope_theta + rope_scaling with "type".
    hf_fields = {
        "rope_theta": 10000,
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
            "beta_fast": 32,
            "beta_slow": 1,
        },
        "max_position_embeddings": 163840,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
    }
    (tmp_path / "config.json").write_text(
        json.dumps({"architectures": ["DeepseekV3ForCausalLM"], **hf_fields})
    )
    ours = ModelConfig.from_dir(tmp_path)
    config = transformers.DeepseekV3Config(**hf_fields)
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale

    inv_freq, factor = rope_frequencies(ours)
    ref_inv_freq, ref_factor = ROPE_INIT_FUNCTIONS["yarn"](config)
    assert torch.equal(inv_freq, ref_inv_freq)
    assert factor == ref_factor
    ref_scale = yarn_apply_mscale(config.rope_parameters, config.qk_head_dim**-0.5)
    assert softmax_scale(ours) == pytest.approx(ref_scale, rel=1e-12)
    assert softmax_scale(ours) > 1.8 * 192**-0.5  # mscale(40) ** 2 ~ 1.87


@pytest.fixture(scope="module")
def moe_layers(checkpoint):
    """Our MoE and transformers' on the same weights (the checkpoint's last layer)."""
    path, model = checkpoint
    theirs = model.model.layers[-1].mlp
    ours = MoE(ModelConfig.from_dir(path))
    # transformers holds its experts stacked under the same names and layout; the shared
    # experts' gate and up are ours packed, as the loader packs them.
    state = theirs.state_dict()
    gate, up = (state.pop(f"shared_experts.{p}_proj.weight") for p in ("gate", "up"))
    state["shared_experts.gate_up_proj.weight"] = torch.cat([gate, up])
    ours.load_state_dict(state)
    return ours.eval(), theirs


# How the routed experts run: the default (gathered up to GATHER_MAX_TOKENS tokens, grouped
# above), each path forced at every size, and the gathered path one token per chunk.
PATHS = {
    "default": {},
    "gathered": {"GATHER_MAX_TOKENS": 10**9},
    "grouped": {"GATHER_MAX_TOKENS": 0},
    "gathered in chunks": {"GATHER_MAX_TOKENS": 10**9, "GATHER_CHUNK_BYTES": 1},
}


@pytest.mark.parametrize("tokens", [1, 5, 64, 300])
@pytest.mark.parametrize("path", list(PATHS))
def test_moe_equals_the_per_expert_loop_and_transformers(moe_layers, monkeypatch, path, tokens):
    ours, theirs = moe_layers
    for name, value in PATHS[path].items():
        monkeypatch.setattr(deepseek_v3, name, value)
    x = torch.randn(tokens, TINY["hidden_size"], generator=torch.Generator().manual_seed(tokens))
    with torch.no_grad():
        out = ours(x)
        loop, ref = naive_loop_moe(ours, x), theirs(x[None])[0]
    assert len(ours.gate(x)[1].unique()) > min(tokens, 3)  # routing spreads the tokens
    assert (out - loop).abs().max().item() < 1e-5
    assert (out - ref).abs().max().item() < 1e-5


@pytest.mark.parametrize("path", ["gathered", "grouped"])
def test_moe_in_bfloat16_equals_the_per_expert_loop(moe_layers, monkeypatch, path):
    ours, _ = moe_layers
    for name, value in PATHS[path].items():
        monkeypatch.setattr(deepseek_v3, name, value)
    moe = copy.deepcopy(ours)
    for name, param in moe.named_parameters():
        if name != "gate.e_score_correction_bias":  # fp32 at any model dtype
            param.data = param.data.bfloat16()
    x = torch.randn(40, TINY["hidden_size"], generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        out, loop = moe(x.bfloat16()), naive_loop_moe(moe, x.bfloat16())
    assert out.dtype == torch.bfloat16
    # The loop adds each expert's share in bf16; the paths sum the shares in fp32.
    assert (out.float() - loop.float()).abs().max().item() < 2e-2 * loop.float().abs().max()


def test_per_expert_checkpoint_tensors_fill_the_stacked_experts(checkpoint):
    path, model = checkpoint
    ours = load_model(ModelConfig.from_dir(path), torch.float32, torch.device("cpu"))
    for layer, theirs in zip(ours.model.layers[1:], model.model.layers[1:]):
        for name in ("gate_up_proj", "down_proj"):
            mine = getattr(layer.mlp.experts, name)
            assert torch.equal(mine, getattr(theirs.mlp.experts, name))


def test_a_checkpoint_missing_one_expert_weight_is_refused(checkpoint):
    path, _ = checkpoint
    model = DeepseekV3ForCausalLM(ModelConfig.from_dir(path))
    gone = "model.layers.1.mlp.experts.3.up_proj.weight"
    weights = ((n, t) for n, t in iter_safetensors(path) if n != gone)
    with pytest.raises(ValueError, match=r"lacks \['model.layers.1.mlp.experts.gate_up_proj'\]"):
        model.load_weights(weights)

"""The engine with KV caches in every dtype: against transformers reading the same quantized
keys and values, on every layout (GQA, sliding-window ring, MLA latents), with prefix caching,
swap and recompute preemption, context shift, tensor parallelism and speculative decoding; the
pool whole again after every run."""

from __future__ import annotations

import contextlib

import pytest
import torch

from engine import LLM, SamplingParams
from kernels import kv_quant
from models.kv_spec import QUANTIZED_KV, kv_pair, row_bytes
from tests.helpers import (
    generate_with_logits,
    random_prompt,
    save_tiny_deepseek_v3,
    save_tiny_gemma3,
    save_tiny_llama,
)

pytest.importorskip("transformers")
pytestmark = pytest.mark.usefixtures("one_thread")

DTYPES = ("float16", "bfloat16", "int8", "fp8_e4m3", "int4")
PAIR = "int8/int4"  # keys in int8, values in int4 (``kv_pair``); not for MLA, whose are one
VOCAB = 256
# Head sizes int4 takes (multiples of 32); Qwen2-style biases, so keys are cached less their
# offset; MLA rows of 64 + 64 (both rotated in blocks of 64).
LLAMA = dict(vocab_size=VOCAB, hidden_size=128, attention_bias=True, max_position_embeddings=512)
GEMMA = dict(vocab_size=VOCAB)
DEEPSEEK = dict(vocab_size=VOCAB, kv_lora_rank=64, qk_rope_head_dim=64, qk_nope_head_dim=32)


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    root = tmp_path_factory.mktemp("kv-dtypes")
    save_tiny_llama(root / "llama", **LLAMA)
    save_tiny_gemma3(root / "gemma3", **GEMMA)
    save_tiny_deepseek_v3(root / "deepseek", **DEEPSEEK)
    return root


def make(path, kv: str, **kw) -> LLM:
    args = dict(max_model_len=128, num_kv_blocks=64, block_size=8, device="cpu", dtype="float32")
    return LLM(str(path), kv_cache_dtype=kv, **{**args, **kw})


def greedy(n: int, **kw) -> SamplingParams:
    return SamplingParams(max_tokens=n, temperature=0, ignore_eos=True, **kw)


def tokens(outs) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in outs]


def assert_pool_whole(llm: LLM) -> None:
    kv = llm.engine.kv
    assert kv.num_free_blocks == kv.num_total_blocks
    assert kv.num_free_host_blocks == kv.num_total_host_blocks


def cases(*models: str, pair: bool = True) -> list:
    """(model, kv) of every dtype, and of the pair where the model's cache takes one."""
    return [(m, kv) for m in models for kv in DTYPES] + [
        (m, PAIR) for m in models if pair and m != "deepseek"
    ]


@pytest.mark.parametrize("model,kv", cases("llama", "gemma3", "deepseek"))
def test_caches_are_stored_in_the_dtype_the_spec_counts(models, model, kv):
    llm = make(models / model, kv)
    runner = llm.engine.runner
    # int4 keys keep recent rows beside (tests/engine/test_kv_recent.py)
    for group in (g for g in runner.groups if not g.recent):
        assert group.spec.dtype == kv
        k_cache, v_cache = runner.kv_caches[group.layer_ids[0]]
        key, value = kv_pair(kv)
        assert k_cache.dtype == kv_quant.KV_DTYPES[key]
        assert v_cache.dtype == kv_quant.KV_DTYPES[value]
        rows = k_cache.shape[2] * k_cache.shape[3] * k_cache.element_size()
        if v_cache.untyped_storage() is not k_cache.untyped_storage():
            rows += v_cache.shape[2] * v_cache.shape[3] * v_cache.element_size()
        assert rows == group.spec.bytes_per_token
    text = llm.engine.metrics.registry.get_sample_value(
        "kvserve:kv_cache_bytes_per_token", {"group": "0", "dtype": kv}
    )
    assert text == runner.groups[0].bytes_per_token


def test_auto_is_float16_for_a_float32_model(models):
    llm = make(models / "llama", "auto")
    assert llm.engine.runner.kv_caches[0][0].dtype == torch.float16
    assert make(models / "llama", "auto", dtype="bfloat16").engine.runner.groups[0].spec.dtype == (
        "bfloat16"
    )


def test_the_sliding_window_layers_keep_auto_dtype_where_told(models):
    from engine.capacity import make_plan

    llm = make(models / "gemma3", "int8", kv_cache_dtype_skip_layers="sliding_window")
    runner = llm.engine.runner
    dtypes = {bool(g.spec.window): g.spec.dtype for g in runner.groups}
    assert dtypes == {True: "float16", False: "int8"}
    for group in runner.groups:
        k_cache, v_cache = runner.kv_caches[group.layer_ids[0]]
        assert k_cache.dtype == v_cache.dtype == kv_quant.KV_DTYPES[group.spec.dtype]
    plan = make_plan(
        str(models / "gemma3"), 0.01, 128, 8, "float32", kv_cache_dtype="int8",
        kv_skip_sliding=True,
    )  # fmt: skip
    assert sorted(row.dtype for row in plan.rows) == ["float16", "int8"]
    prompt = random_prompt(40, VOCAB, seed=6)
    assert len(tokens(llm.generate([prompt], greedy(20)))[0]) == 20
    assert_pool_whole(llm)


@pytest.mark.parametrize("kv", ["int8/float16", "float16/int8", "int8/int9", "int8/int4/int4"])
def test_a_pair_is_of_two_quantized_dtypes(models, kv):
    with pytest.raises(ValueError, match="pair"):
        make(models / "llama", kv)


def test_an_mla_cache_takes_one_dtype(models):
    with pytest.raises(ValueError, match="one dtype"):
        make(models / "deepseek", PAIR)


def test_int4_refuses_a_head_size_it_cannot_group(tmp_path):
    save_tiny_llama(tmp_path, vocab_size=VOCAB)  # head_dim 16
    with pytest.raises(ValueError, match="multiples of 32"):
        make(tmp_path, "int4")


@contextlib.contextmanager
def quantized_hf_keys_and_values(hf, kv: str, offsets: list[torch.Tensor | None]):
    """transformers' Llama with every key (once rotated, less the layer's offset) and value read
    back as a cache of ``kv`` (a dtype, or a key/value pair) gives it."""
    from transformers.models.llama import modeling_llama

    (key, value), layer = (kv_quant.KV_DTYPES[d] for d in kv_pair(kv)), [0]

    def read_back(x, offset, dtype):  # x [B, H, T, D]
        rows = x.transpose(1, 2)
        if offset is not None:
            rows = rows - offset
        rows = kv_quant.fake_quantize(rows.float(), dtype)
        return (rows + offset if offset is not None else rows).transpose(1, 2).to(x.dtype)

    original = modeling_llama.apply_rotary_pos_emb

    def rotate(q, k, cos, sin, *args, **kwargs):
        q, k = original(q, k, cos, sin, *args, **kwargs)
        return q, read_back(k, offsets[layer[0]], key)

    hooks = []
    for i, block in enumerate(hf.model.layers):
        attn = block.self_attn
        hooks.append(attn.register_forward_pre_hook(lambda m, a, i=i: layer.__setitem__(0, i)))
        d = attn.head_dim

        def values(m, a, out, d=d):
            b, t = out.shape[:2]
            v = out.view(b, t, -1, d).transpose(1, 2)
            return read_back(v, None, value).transpose(1, 2).reshape(b, t, -1)

        hooks.append(attn.v_proj.register_forward_hook(values))
    modeling_llama.apply_rotary_pos_emb = rotate
    try:
        yield
    finally:
        modeling_llama.apply_rotary_pos_emb = original
        for h in hooks:
            h.remove()


# Mean |difference| of log-softmax rows allowed: a value on the other side of a rounding boundary
# (the kernels' rotation sums in another order than the reference's matrix) moves a logit by
# about one quantization step of the attention it feeds.
TOLERANCE = {"float16": 1e-4, "bfloat16": 1e-3, "int8": 2e-3, "fp8_e4m3": 1e-2, "int4": 3e-2}
TOLERANCE[PAIR] = TOLERANCE["int4"]


@pytest.mark.parametrize("backend", ["cpu", "torch"])
@pytest.mark.parametrize("kv", [*(d for d in DTYPES if d != "int4"), PAIR])  # int4: test_kv_recent
def test_logits_are_transformers_reading_the_same_quantized_keys_and_values(
    models, kv, backend, monkeypatch
):
    from transformers import AutoModelForCausalLM

    llm = make(models / "llama", kv, attention_backend=backend)
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (5, 19, 40)]
    results = generate_with_logits(llm, prompts, monkeypatch, max_tokens=12)
    attn = [layer.self_attn for layer in llm.engine.runner.model.model.layers]
    offsets = [a.key_offset for a in attn]
    assert (kv_pair(kv)[0] in QUANTIZED_KV) == all(o is not None for o in offsets)
    hf = AutoModelForCausalLM.from_pretrained(models / "llama", dtype=torch.float32).eval()
    for prompt, (out, logits) in zip(prompts, results):
        ids = torch.tensor([prompt + out[:-1]])
        with torch.no_grad(), quantized_hf_keys_and_values(hf, kv, offsets):
            expect = hf(ids).logits[0, len(prompt) - 1 :]
        ours, theirs = logits.log_softmax(-1), expect.log_softmax(-1)
        assert (ours - theirs).abs().mean() < TOLERANCE[kv]
        assert (ours.argmax(-1) == theirs.argmax(-1)).float().mean() >= 0.9
    assert_pool_whole(llm)


def test_the_key_offset_is_the_key_bias_rotated_as_a_context_rotates_it_on_average(models):
    """Checked against rotating the bias at every position with the model's own rope."""
    from kernels.reference import apply_rope
    from models.layers import rope_cos_sin
    from models.llama import OFFSET_POSITIONS

    model = make(models / "llama", "int8").engine.runner.model
    attn = model.model.layers[1].self_attn
    bias = checkpoint_tensors(models / "llama")["model.layers.1.self_attn.k_proj.bias"]
    bias = bias.view(1, -1, attn.head_dim)
    cos, sin = rope_cos_sin(torch.arange(OFFSET_POSITIONS), model.inv_freq, torch.float32)
    rotated = apply_rope(bias.expand(OFFSET_POSITIONS, -1, -1).contiguous(), cos, sin)
    torch.testing.assert_close(attn.key_offset, rotated.mean(0), atol=1e-5, rtol=1e-4)
    plain = make(models / "llama", "float16").engine.runner.model
    assert all(layer.self_attn.key_offset is None for layer in plain.model.layers)


def checkpoint_tensors(path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return {k: v for f in sorted(path.glob("*.safetensors")) for k, v in load_file(f).items()}


@pytest.mark.parametrize("model,kv", cases("llama", "gemma3", "deepseek"))
def test_prefix_caching_and_preemption_give_the_tokens_of_a_request_alone(models, model, kv):
    """A shared prefix read from cached quantized blocks, and requests preempted by swap or
    recompute, give the tokens each gets alone; the pools are whole after."""
    shared = random_prompt(40, VOCAB, seed=1)  # over a block of 32 (int4's)
    prompts = [shared + random_prompt(4 + i, VOCAB, seed=10 + i) for i in range(6)]
    params = [greedy(24 + 2 * i) for i in range(6)]
    alone = [tokens(make(models / model, kv).generate([p], q))[0] for p, q in zip(prompts, params)]
    blocks = 4 if kv == "int4" else 14  # of 32 tokens or 8
    for mode in ("recompute", "swap"):
        llm = make(models / model, kv, num_kv_blocks=blocks, preemption_mode=mode,
                   swap_space_gib=0.01)  # fmt: skip
        assert tokens(llm.generate(prompts, params)) == alone
        assert llm.engine.metrics.registry.get_sample_value(
            "kvserve:num_preemptions_total", {"mode": mode}
        )
        assert llm.engine.metrics.registry.get_sample_value("kvserve:prefix_cache_hits_total")
        assert_pool_whole(llm)


@pytest.mark.parametrize("model,kv", cases("llama", "gemma3", "deepseek"))
def test_a_shifting_context_runs_on_quantized_keys_as_on_the_reference(models, model, kv):
    """Generation three times past max_model_len with context shift: the cpu backend (keys
    re-rotated by the reference, read by the kernels) gives the torch backend's tokens."""
    from engine.core.context_overflow import ContextOverflow

    prompt = random_prompt(20, VOCAB, seed=3)
    params = greedy(150, overflow=ContextOverflow("shift", 4, 16))
    outs = {}
    for backend in ("cpu", "torch"):
        # int4's blocks of 32: a context that n_keep and n_discard, rounded to blocks, fit in
        length = 96 if kv == "int4" else 48
        llm = make(models / model, kv, max_model_len=length, attention_backend=backend)
        outs[backend] = tokens(llm.generate([prompt], params))[0]
        assert len(outs[backend]) == 150
        assert_pool_whole(llm)
    same = sum(a == b for a, b in zip(outs["cpu"], outs["torch"]))
    assert same >= 140, f"{same} of 150"


@pytest.mark.parametrize("kv", ["int8", "int4"])
def test_tensor_parallel_ranks_quantize_their_heads_as_one_rank_does(models, kv):
    prompts = [random_prompt(n, VOCAB, seed=n) for n in (6, 17)]
    one = tokens(make(models / "llama", kv).generate(prompts, greedy(16)))
    llm = make(models / "llama", kv, tensor_parallel_size=2)
    try:
        assert tokens(llm.generate(prompts, greedy(16))) == one
        assert_pool_whole(llm)
    finally:
        llm.engine.shutdown()


@pytest.mark.parametrize("kv", ["float16", "int8", "int4", PAIR])
def test_speculative_decoding_over_a_quantized_cache_keeps_the_tokens(models, kv):
    repeat = random_prompt(12, VOCAB, seed=4)
    prompts = [repeat * 3, random_prompt(30, VOCAB, seed=5)]
    plain = tokens(make(models / "llama", kv).generate(prompts, greedy(30)))
    llm = make(models / "llama", kv, speculative_method="ngram", num_speculative_tokens=3)
    assert tokens(llm.generate(prompts, greedy(30))) == plain
    assert llm.engine.metrics.registry.get_sample_value(
        "kvserve:spec_decode_num_draft_tokens_total", {"method": "ngram"}
    )
    assert_pool_whole(llm)


def test_a_quantized_block_costs_what_plan_says(models):
    from engine.capacity import make_plan

    plan = make_plan(str(models / "llama"), 0.01, 128, 8, "float32", kv_cache_dtype="int8")
    (row,) = plan.rows
    assert row.dtype == "int8"
    assert row.bytes_per_token == 2 * 2 * row_bytes("int8", 32) * 2  # K, V x heads x layers
    plan = make_plan(str(models / "llama"), 0.01, 128, 8, "float32", kv_cache_dtype=PAIR)
    (row,) = plan.rows
    assert row.dtype == PAIR
    assert row.bytes_per_token == (row_bytes("int8", 32) + row_bytes("int4", 32)) * 2 * 2


PROMPTS = (
    'def fibonacci(n):\n    """Return the n-th Fibonacci number."""\n',
    "The three laws of thermodynamics are",
    "SELECT name, COUNT(*) FROM orders JOIN customers ON",
)


@pytest.mark.slow
@pytest.mark.parametrize("model", ["smollm2_dir", "qwen05_dir"])
def test_real_models_decode_greedily_from_float16_keys_as_from_float32(request, model):
    path = request.getfixturevalue(model)
    outs = {}
    for kv in ("float32", "float16"):
        llm = LLM(str(path), kv_cache_dtype=kv, max_model_len=512, num_kv_blocks=64)
        prompts = [llm.tokenizer.encode(p) for p in PROMPTS]
        outs[kv] = tokens(llm.generate(prompts, greedy(32)))
    assert outs["float16"] == outs["float32"]


# What each quantized dtype may cost on Qwen2.5-Coder-0.5B, teacher forced over 192 tokens of
# prose against float32 keys and values (measured: int8 ~7e-4, fp8 ~3e-3, int4 ~3e-4 mean KLD,
# its last 32 tokens read from the recent rows; bench/results/kv-cache-*.md over 2048 tokens).
BOUNDS = {"int8": (3e-3, 0.95), "fp8_e4m3": (0.1, 0.85), "int4": (1e-2, 0.95)}


@pytest.mark.slow
def test_quantized_caches_cost_qwen_what_they_are_stated_to(qwen05_dir):
    from bench import quality
    from engine.args import EngineArgs
    from models.tokenizer import Tokenizer

    text = " ".join(
        f"Chapter {i}. The river ran past the old mill, and the miller counted his sacks of "
        f"flour twice before he sold {i + 3} of them at the market in town."
        for i in range(20)
    )
    ids = Tokenizer.from_dir(qwen05_dir).encode(text)[:192]
    base = EngineArgs(model=str(qwen05_dir), max_model_len=208, num_kv_blocks=64)
    costs = quality.kv_dtype_costs(base, ids, ["float32", *BOUNDS])
    assert costs["float32"].kld_mean == 0
    for kv, (kld, top1) in BOUNDS.items():
        assert 0 < costs[kv].kld_mean < kld, (kv, costs[kv])
        assert costs[kv].top1 >= top1, (kv, costs[kv])
    assert costs["int8"].kld_mean < costs["fp8_e4m3"].kld_mean

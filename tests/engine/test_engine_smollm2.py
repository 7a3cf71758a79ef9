"""The engine against transformers on the same converted SmolLM2 weights."""

from dataclasses import replace

import pytest
import torch

from engine import LLM, SamplingParams
from engine.detokenizer import IncrementalDetokenizer
from tests.helpers import assert_greedy_as

pytestmark = pytest.mark.slow

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
    " ".join(
        f"Item {i}: the number {i * 7} is {'even' if i % 2 == 0 else 'odd'}." for i in range(40)
    ),
]


def _llm(path, **kw) -> LLM:
    # A small token budget forces the long prompt through several prefill chunks while the
    # others decode in the same steps.
    return LLM(
        str(path),
        max_model_len=1024,
        num_kv_blocks=160,
        block_size=16,
        max_num_batched_tokens=96,
        kv_cache_dtype="float32",  # transformers' float32 keys and values
        **kw,
    )


@pytest.fixture(scope="module")
def llm(smollm2_dir):
    return _llm(smollm2_dir)


@pytest.fixture(scope="module")
def hf_model(smollm2_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=torch.float32
    ).eval()


def test_concurrent_greedy_tokens_equal_transformers(llm, hf_model):
    _assert_equal_transformers(llm, hf_model)


def test_the_plain_torch_path_equals_transformers_too(smollm2_dir, hf_model):
    plain = _llm(smollm2_dir, cpu_kernels=False)
    assert plain.engine.runner.cpu_kernels == "off"
    assert plain.engine.runner.backend.name == "torch"
    _assert_equal_transformers(plain, hf_model)


def _assert_equal_transformers(llm, hf_model):
    prompt_ids = [llm.tokenizer.encode(p) for p in PROMPTS]
    assert len(prompt_ids[3]) > 3 * 96  # really chunked
    params = SamplingParams(max_tokens=32, temperature=0, logprobs=0)
    outs = llm.generate(prompt_ids, params)
    for ids, out in zip(prompt_ids, outs):
        with torch.no_grad():
            ref = hf_model.generate(
                torch.tensor([ids]),
                max_new_tokens=32,
                do_sample=False,
                output_logits=True,
                return_dict_in_generate=True,
            )
        ref_ids = ref.sequences[0, len(ids) :].tolist()
        assert out.outputs[0].token_ids == ref_ids
        ref_logprobs = [
            torch.log_softmax(step[0].float(), -1)[t].item() for step, t in zip(ref.logits, ref_ids)
        ]
        ours = [lp.logprob for lp in out.outputs[0].logprobs]
        assert max(abs(a - b) for a, b in zip(ours, ref_logprobs)) < 1e-3
    assert llm.engine.kv.num_free_blocks == llm.engine.kv.num_total_blocks


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_half_precision_serves_greedy_as_transformers_at_that_dtype(smollm2_dir, dtype):
    transformers = pytest.importorskip("transformers")
    llm = LLM(str(smollm2_dir), dtype=dtype, max_model_len=256, num_kv_blocks=32)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_dir), dtype=getattr(torch, dtype)
    ).eval()
    chat = llm.tokenizer.encode_chat(
        [{"role": "user", "content": "What is the capital of France?"}]
    )
    prompts = [chat, llm.tokenizer.encode(PROMPTS[1])]
    outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, ignore_eos=True))
    for ids, out in zip(prompts, outs):
        tokens = out.outputs[0].token_ids
        assert out.outputs[0].error is None and len(tokens) == 16
        with torch.no_grad():
            ref = hf(torch.tensor([ids + tokens[:-1]])).logits[0, len(ids) - 1 :]
        # bfloat16 logits near 25 are 0.125 apart: ties within two steps of the rounding pass.
        assert_greedy_as(tokens, ref, 0.25)
    assert "Paris" in outs[0].outputs[0].text


def test_prefix_caching_keeps_the_greedy_tokens(llm, smollm2_dir):
    from tests.helpers import run_waves

    questions = [" Which items are odd?", " Name the largest number.", " How many items?"]
    prompts = [llm.tokenizer.encode(PROMPTS[3] + q) for q in questions]
    waves = [[(p, 6) for p in prompts[:2]], [(p, 6) for p in prompts]]
    tokens, cached = run_waves(llm, waves)
    assert tokens == run_waves(_llm(smollm2_dir, enable_prefix_caching=False), waves)[0]
    shared = len(llm.tokenizer.encode(PROMPTS[3])) // 16 * 16
    assert min(cached[2:]) >= shared - 16 > 0


def test_chat_answer_is_sensible(llm):
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0].outputs[0]
    assert "Paris" in out.text
    assert out.finish_reason == "stop"  # ended by <|im_end|>, which is not in the text
    assert "<|im_end|>" not in out.text


def test_stop_string_cuts_the_text_and_reports_itself(llm):
    ids = llm.tokenizer.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    full = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0))[0].outputs[0].text
    stop = "Paris"
    out = llm.generate([ids], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
    assert out.outputs[0].text == full[: full.index(stop)]
    assert out.outputs[0].finish_reason == "stop" and out.outputs[0].stop_reason == stop


def test_seeded_sampling_repeats_and_differs_by_seed(llm):
    ids = llm.tokenizer.encode("My favourite food is")
    p = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234, ignore_eos=True)
    a, b = llm.generate([ids, ids], [p, p])
    c = llm.generate([ids], replace(p, seed=99))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids
    assert a.outputs[0].token_ids != c.outputs[0].token_ids


def test_top_k_one_is_greedy(llm):
    ids = llm.tokenizer.encode("The three primary colours are")
    greedy = llm.generate([ids], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    top1 = llm.generate(
        [ids], SamplingParams(max_tokens=12, temperature=0.8, top_k=1, seed=3, ignore_eos=True)
    )
    assert greedy[0].outputs[0].token_ids == top1[0].outputs[0].token_ids


def test_incremental_detokenizer_never_emits_broken_utf8(smollm2_dir):
    from models.tokenizer import Tokenizer

    tok = Tokenizer.from_dir(smollm2_dir)
    text = "Prix: 12€ — naïve café 🚀🎉 你好世界  double  spaces\nend"
    ids = tok.encode(text)
    det = IncrementalDetokenizer(tok, SamplingParams())
    pieces = []
    for t in ids:
        det.add([t])
        pieces.append(det.take(finished=False))
    det.flush()
    pieces.append(det.take(finished=True))
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) == tok.decode(ids) == text


def test_prompt_logprobs_equal_transformers_through_chunks_and_a_warm_cache(llm, hf_model):
    """Every prompt token's logprob and top alternatives, from prefill chunks of 96 tokens;
    the prompt was cached by an earlier request, and is computed again for its logits."""
    ids = llm.tokenizer.encode(PROMPTS[3])
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0))  # warms the cache
    params = SamplingParams(max_tokens=2, temperature=0, prompt_logprobs=3)
    (out,) = llm.generate([ids], params)
    assert out.num_cached_tokens == 0
    with torch.no_grad():
        ref = torch.log_softmax(hf_model(torch.tensor([ids])).logits[0].float(), -1)
    got = out.prompt_logprobs
    assert len(got) == len(ids) and got[0] is None
    for p, record in enumerate(got[1:]):
        assert record.token_id == ids[p + 1]
        assert abs(record.logprob - ref[p, ids[p + 1]].item()) < 1e-3
        ref_top = torch.topk(ref[p], 3)
        assert [t for t, _ in record.top] == ref_top.indices.tolist()
        assert max(abs(v - r) for (_, v), r in zip(record.top, ref_top.values.tolist())) < 1e-3

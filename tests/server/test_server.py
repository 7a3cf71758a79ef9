"""The HTTP server on a real uvicorn with the real engine and model, driven by the openai client."""

from __future__ import annotations

import contextlib
import math
import sys
from collections.abc import Iterator
from importlib.metadata import EntryPoint
from types import SimpleNamespace

import httpx
import pytest

from engine.args import EngineArgs
from tests.helpers import serve_in_thread

SERVED_NAME = "smollm2"
MAX_MODEL_LEN = 512
NUM_KV_BLOCKS = 128
CHAT = [{"role": "user", "content": "What is the capital of France?"}]


@contextlib.contextmanager
def real_server(model_dir) -> Iterator[tuple[object, str]]:
    """The real engine with small settings behind a served app: (engine, base URL)."""
    from engine.async_engine import AsyncEngine
    from server.app import build_app
    from server.args import ServerArgs

    args = EngineArgs(
        model=str(model_dir),
        device="cpu",
        kv_cache_dtype="float32",  # scored as transformers' float32 forward scores
        max_model_len=MAX_MODEL_LEN,
        num_kv_blocks=NUM_KV_BLOCKS,
        max_num_seqs=8,
        max_num_batched_tokens=1024,
    )
    engine = AsyncEngine(args)
    try:
        with serve_in_thread(build_app(engine, ServerArgs(served_model_name=SERVED_NAME))) as url:
            yield engine, url
    finally:
        engine.shutdown()


def tokenize(url: str, **body) -> list[int]:
    r = httpx.post(f"{url}/tokenize", json=body)
    assert r.status_code == 200, r.text
    return r.json()["tokens"]


# ---- chat ----


@pytest.mark.slow
def test_greedy_chat_answers_paris_and_counts_usage(client, served):
    _, url = served
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=24
    )
    assert r.id.startswith("chatcmpl-") and r.object == "chat.completion"
    assert r.model == SERVED_NAME and r.created > 0
    choice = r.choices[0]
    assert choice.message.role == "assistant"
    assert "Paris" in choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert r.usage.prompt_tokens == len(tokenize(url, messages=CHAT))
    assert 0 < r.usage.completion_tokens <= 24
    assert r.usage.total_tokens == r.usage.prompt_tokens + r.usage.completion_tokens


@pytest.mark.slow
def test_chat_stream_matches_non_stream_and_reports_usage(client):
    kwargs = dict(model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=12)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(
        client.chat.completions.create(
            **kwargs, stream=True, stream_options={"include_usage": True}
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(c.id == chunks[0].id and c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    finishes = [c.choices[0].finish_reason for c in chunks if c.choices]
    assert finishes[-1] == whole.choices[0].finish_reason
    assert all(f is None for f in finishes[:-1])
    last = chunks[-1]
    assert last.choices == [] and last.usage == whole.usage
    assert all(c.usage is None for c in chunks[:-1])


@pytest.mark.slow
def test_chat_n2_gives_two_choices(client):
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=1.0, seed=7, max_tokens=8, n=2
    )
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert all(c.message.content and c.finish_reason for c in r.choices)
    assert 2 <= r.usage.completion_tokens <= 16


@pytest.mark.slow
def test_chat_n2_stream_ends_every_choice(client):
    chunks = list(
        client.chat.completions.create(
            model=SERVED_NAME, messages=CHAT, max_tokens=6, n=2, seed=3, stream=True
        )
    )
    roles = {c.choices[0].index for c in chunks if c.choices[0].delta.role == "assistant"}
    ends = {c.choices[0].index: c.choices[0].finish_reason for c in chunks}
    assert roles == {0, 1}
    assert set(ends) == {0, 1} and all(ends.values())


@pytest.mark.slow
def test_seed_makes_sampling_reproducible(client):
    def sample(seed: int) -> str:
        r = client.chat.completions.create(
            model=SERVED_NAME, messages=CHAT, temperature=1.0, seed=seed, max_tokens=12
        )
        return r.choices[0].message.content

    first = sample(1234)
    assert sample(1234) == first
    assert sample(99) != first


@pytest.mark.slow
def test_chat_logprobs_are_the_greedy_choice(client):
    r = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=8, logprobs=True, top_logprobs=3
    )
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        best = entry.top_logprobs[0]
        assert best.token == entry.token
        assert math.isclose(best.logprob, entry.logprob, abs_tol=1e-4)
        assert [t.logprob for t in entry.top_logprobs] == sorted(
            (t.logprob for t in entry.top_logprobs), reverse=True
        )
        assert entry.bytes == list(entry.token.encode())
    # The tokens may end with an end-of-turn token that the text leaves out.
    assert "".join(e.token for e in content).startswith(r.choices[0].message.content)


@pytest.mark.slow
def test_stop_string_ends_the_answer_before_it(client):
    kwargs = dict(model=SERVED_NAME, messages=CHAT, temperature=0, max_tokens=24)
    full = client.chat.completions.create(**kwargs).choices[0].message.content
    words = full.split()
    assert len(words) >= 3, full
    stop = words[2]
    cut = full.index(stop)
    r = client.chat.completions.create(**kwargs, stop=[stop, "zzzz-never"])
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].message.content == full[:cut]
    assert stop not in r.choices[0].message.content


# ---- completions ----


PROMPT = "The quick brown fox"


@pytest.mark.slow
def test_completion_counts_tokens_and_honours_max_tokens(client, served):
    _, url = served
    r = client.completions.create(
        model=SERVED_NAME,
        prompt=PROMPT,
        temperature=0,
        max_tokens=8,
        extra_body={"ignore_eos": True},
    )
    assert r.id.startswith("cmpl-") and r.object == "text_completion"
    assert r.choices[0].finish_reason == "length"
    assert r.usage.completion_tokens == 8
    assert r.usage.prompt_tokens == len(tokenize(url, prompt=PROMPT))


def test_logit_bias_removes_and_forces_tokens(client, served):
    _, url = served
    kwargs = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=1, temperature=0, logprobs=1)
    top = client.completions.create(**kwargs).choices[0].logprobs.tokens[0]
    (top_id,) = tokenize(url, prompt=top)  # the greedy token, a single one for this prompt
    banned = client.completions.create(**kwargs, logit_bias={str(top_id): -100})
    assert banned.choices[0].logprobs.tokens[0] != top
    forced = client.completions.create(**{**kwargs, "max_tokens": 3}, logit_bias={"1024": 100})
    expected = httpx.post(f"{url}/detokenize", json={"tokens": [1024] * 3}).json()["prompt"]
    assert forced.choices[0].text == expected


def test_continuous_usage_stats_put_usage_in_every_chunk(client):
    chunks = list(
        client.chat.completions.create(
            model=SERVED_NAME, messages=CHAT, max_tokens=5, temperature=0, stream=True,
            stream_options={"include_usage": True, "continuous_usage_stats": True},
            extra_body={"ignore_eos": True}, service_tier="auto", prompt_cache_key="k",
        )
    )  # fmt: skip
    assert all(c.usage is not None for c in chunks)
    counts = [c.usage.completion_tokens for c in chunks]
    assert counts == sorted(counts) and counts[0] == 0 and counts[-1] == 5


def test_a_repeated_prompt_reports_cached_tokens_until_the_cache_is_reset(client, served):
    _, url = served
    prompt = "A unique preamble for the prefix cache test. " + "The sea is calm tonight. " * 12
    n = len(tokenize(url, prompt=prompt))
    kwargs = dict(model=SERVED_NAME, prompt=prompt, max_tokens=4, temperature=0)
    first = client.completions.create(**kwargs)
    second = client.completions.create(**kwargs)
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    assert second.usage.prompt_tokens_details.cached_tokens == (n - 1) // 16 * 16 > 0
    assert second.choices[0].text == first.choices[0].text
    metrics = httpx.get(f"{url}/metrics").text
    hits = [ln for ln in metrics.splitlines() if ln.startswith("kvserve:prefix_cache_hits_total")]
    assert hits and float(hits[0].split()[-1]) > 0
    assert "kvserve:prefix_cache_queries_total" in metrics
    reset = httpx.post(f"{url}/reset_prefix_cache")
    assert reset.status_code == 200 and reset.json()["blocks"] > 0
    third = client.completions.create(**kwargs)
    assert third.usage.prompt_tokens_details.cached_tokens == 0


@pytest.mark.slow
def test_completion_defaults_to_16_tokens(client):
    r = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, temperature=0, extra_body={"ignore_eos": True}
    )
    assert r.usage.completion_tokens == 16


@pytest.mark.slow
def test_completion_stream_matches_non_stream(client):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPT, temperature=0, max_tokens=10)
    whole = client.completions.create(**kwargs)
    chunks = list(
        client.completions.create(**kwargs, stream=True, stream_options={"include_usage": True})
    )
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == whole.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage == whole.usage


@pytest.mark.slow
def test_completion_batch_and_token_prompts_match_single_prompts(client, served):
    _, url = served
    prompts = [PROMPT, "Once upon a time"]
    kwargs = dict(model=SERVED_NAME, temperature=0, max_tokens=6)
    singles = [client.completions.create(prompt=p, **kwargs).choices[0].text for p in prompts]
    batch = client.completions.create(prompt=prompts, **kwargs)
    assert [c.index for c in batch.choices] == [0, 1]
    assert [c.text for c in batch.choices] == singles
    by_ids = client.completions.create(prompt=tokenize(url, prompt=prompts[1]), **kwargs)
    assert by_ids.choices[0].text == singles[1]


@pytest.mark.slow
def test_completion_n2_stream_with_seed(client):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPT, max_tokens=6, n=2, seed=11)
    whole = client.completions.create(**kwargs)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**kwargs, stream=True):
        texts[chunk.choices[0].index] += chunk.choices[0].text
    assert texts == {c.index: c.text for c in whole.choices}


@pytest.mark.slow
def test_completion_logprobs_legacy_format(client):
    r = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, temperature=0, max_tokens=6, logprobs=2
    )
    lp = r.choices[0].logprobs
    n = r.usage.completion_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == n
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(n)]
    for token, logprob, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs):
        assert logprob <= 0 and 1 <= len(top) <= 3
        assert math.isclose(max(top.values()), logprob, abs_tol=1e-4)
        assert math.isclose(top[token], logprob, abs_tol=1e-4)
    assert "".join(lp.tokens).startswith(r.choices[0].text)


def test_echo_scores_the_prompt_as_transformers_does(client, served, smollm2_dir):
    """lm-evaluation-harness's loglikelihood request: token ids, echo, max_tokens 0."""
    transformers = pytest.importorskip("transformers")
    import torch

    _, url = served
    text = "The quick brown fox jumps over the lazy dog, and the dog does not mind."
    ids = tokenize(url, prompt=text)
    r = client.completions.create(
        model=SERVED_NAME, prompt=ids, echo=True, max_tokens=0, logprobs=1, temperature=0
    )
    choice = r.choices[0]
    lp = choice.logprobs
    assert choice.text == text and r.usage.completion_tokens == 0
    assert len(lp.tokens) == len(ids) and lp.token_logprobs[0] is None
    assert lp.top_logprobs[0] is None and lp.text_offset[0] == 0
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(smollm2_dir), dtype=torch.float32)
    with torch.no_grad():
        ref = torch.log_softmax(hf(torch.tensor([ids])).logits[0].float(), -1)
    expected = [ref[p, ids[p + 1]].item() for p in range(len(ids) - 1)]
    assert max(abs(a - b) for a, b in zip(lp.token_logprobs[1:], expected)) < 1e-3
    best = [ref[p].max().item() for p in range(len(ids) - 1)]
    assert all(abs(max(top.values()) - b) < 1e-3 for top, b in zip(lp.top_logprobs[1:], best))


def test_echo_streams_the_prompt_first_and_matches_non_stream(client):
    kwargs = dict(model=SERVED_NAME, prompt=PROMPT, echo=True, logprobs=0, max_tokens=4,
                  temperature=0)  # fmt: skip
    whole = client.completions.create(**kwargs).choices[0]
    chunks = [c.choices[0] for c in client.completions.create(**kwargs, stream=True) if c.choices]
    assert whole.text.startswith(PROMPT) and chunks[0].text.startswith(PROMPT)
    assert "".join(c.text for c in chunks) == whole.text
    streamed = [t for c in chunks if c.logprobs for t in c.logprobs.tokens]
    assert streamed == whole.logprobs.tokens
    offsets = [o for c in chunks if c.logprobs for o in c.logprobs.text_offset]
    assert offsets == whole.logprobs.text_offset
    plain = client.completions.create(**{**kwargs, "echo": False}).choices[0]
    assert whole.text == PROMPT + plain.text
    assert whole.logprobs.tokens[-4:] == plain.logprobs.tokens


def test_prompt_logprobs_in_vllm_shape(client, served):
    _, url = served
    ids = tokenize(url, prompt=PROMPT)
    extra = {"prompt_logprobs": 2}
    r = client.completions.create(
        model=SERVED_NAME, prompt=PROMPT, max_tokens=1, temperature=0, extra_body=extra
    )
    plp = r.choices[0].model_extra["prompt_logprobs"]
    assert len(plp) == len(ids) and plp[0] is None
    for token, entry in zip(ids[1:], plp[1:]):
        own = entry[str(token)]
        assert own["rank"] >= 1 and own["logprob"] <= 0 and own["decoded_token"]
        ranked = sorted(entry.values(), key=lambda e: -e["logprob"])
        assert {e["rank"] for e in entry.values()} >= {1, 2}
        assert ranked[0]["rank"] == 1
    chat = client.chat.completions.create(
        model=SERVED_NAME, messages=CHAT, max_tokens=1, temperature=0, extra_body=extra
    )
    assert chat.model_extra["prompt_logprobs"][0] is None


@pytest.mark.parametrize(
    "body, param",
    [
        ({"prompt": "x", "max_tokens": 0}, "max_tokens"),
        ({"prompt": "x", "prompt_logprobs": 21}, "prompt_logprobs"),
        ({"messages": CHAT, "echo": True}, "echo"),
    ],
)
def test_bad_echo_and_prompt_logprobs_get_400(served, body, param):
    _, url = served
    path = "chat/completions" if "messages" in body else "completions"
    r = httpx.post(f"{url}/v1/{path}", json=body)
    assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text


# ---- the rest of the surface ----


@pytest.mark.slow
def test_models_health_and_tokenizer_endpoints(client, served):
    _, url = served
    models = client.models.list()
    assert [m.id for m in models.data] == [SERVED_NAME]
    assert httpx.get(f"{url}/health").status_code == 200
    assert httpx.get(f"{url}/ready").status_code == 200
    r = httpx.post(f"{url}/tokenize", json={"model": SERVED_NAME, "prompt": PROMPT}).json()
    assert r["count"] == len(r["tokens"]) and r["max_model_len"] == MAX_MODEL_LEN
    back = httpx.post(f"{url}/detokenize", json={"tokens": r["tokens"]}).json()
    assert back["prompt"] == PROMPT


@pytest.mark.slow
def test_tokenize_counts_up_to_max_model_len_and_refuses_past_it_naming_the_field(served):
    from server.protocol import MAX_MESSAGES
    from tests.server.test_server_errors import assert_error

    _, url = served

    def post(path: str = "/tokenize", **body) -> httpx.Response:
        return httpx.post(url + path, json=body, timeout=60)

    # SmolLM2 splits digits one by one and adds no BOS: n digits are n tokens.
    r = post(prompt="1" * MAX_MODEL_LEN, return_token_strs=True)
    assert r.status_code == 200, r.text
    assert r.json()["count"] == MAX_MODEL_LEN and r.json()["token_strs"] == ["1"] * MAX_MODEL_LEN
    error = assert_error(post(prompt="1" * (MAX_MODEL_LEN + 1)), 400, "prompt")
    assert error["code"] == "context_length_exceeded"
    assert f"is {MAX_MODEL_LEN} tokens" in error["message"]
    assert f"`prompt` is {MAX_MODEL_LEN + 1} tokens long" in error["message"]
    # Far past it, refused from its length alone: no token spans that many characters.
    error = assert_error(post(prompt="1" * 4_000_000, return_token_strs=True), 400, "prompt")
    assert error["code"] == "context_length_exceeded" and "at least" in error["message"]
    chat = [{"role": "user", "content": "1" * 100}] * 6
    error = assert_error(post(messages=chat), 400, "messages")
    assert error["code"] == "context_length_exceeded"
    # As OpenAI, a chat of more messages than it takes is refused as its body is validated.
    chat = [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)
    for r in (post(messages=chat), post("/v1/chat/completions", messages=chat, max_tokens=1)):
        error = assert_error(r, 400, "messages")
        assert f"maximum length {MAX_MESSAGES}, but got an array with length" in error["message"]


# ---- the command line ----


def test_serve_flags_build_engine_args():
    from engine.args import from_cli_args
    from server.cli import build_parser

    argv = ["serve", "--model", "m", "--max-model-len", "512", "--kv-cache-memory", "0.5"]
    argv += ["--attention-backend", "torch", "--seed", "3", "--served-model-name", "x"]
    ns = build_parser().parse_args(argv)
    args = from_cli_args(ns)
    assert args == EngineArgs(
        model="m", max_model_len=512, kv_cache_memory_gib=0.5, attention_backend="torch", seed=3
    )
    assert (ns.host, ns.port, ns.served_model_name) == ("127.0.0.1", 8000, "x")


def test_serve_rejects_two_kv_sizes_and_bad_engine_values(capsys):
    from server.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--num-kv-blocks", "8", "--kv-cache-memory", "1"])
    with pytest.raises(SystemExit):
        main(["serve", "--model", "m", "--block-size", "3"])
    assert "block_size" in capsys.readouterr().err


def test_pass_through_subcommands_get_their_own_argv(monkeypatch):
    import server.cli as cli

    assert {"bench", "tune"} <= set(cli.client_commands())  # the bench package's entry points
    seen = []
    fake = SimpleNamespace(main=lambda argv: seen.append(argv) or 0)
    monkeypatch.setitem(sys.modules, "fake_bench", fake)
    fake_ep = EntryPoint("bench", "fake_bench:main", "kvserve.commands")
    monkeypatch.setattr(cli, "client_commands", lambda: {"bench": fake_ep})
    assert cli.main(["bench", "--num-prompts", "3", "--help"]) == 0
    assert seen == [["--num-prompts", "3", "--help"]]

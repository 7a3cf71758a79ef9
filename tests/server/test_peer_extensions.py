"""vLLM's and llama.cpp's extensions to the OpenAI API, checked against the real model: token
ids against its tokenizer, timings against usage."""

from __future__ import annotations

import importlib.metadata
import json

import httpx
import pytest

from tests.server.test_server import CHAT, MAX_MODEL_LEN, SERVED_NAME, tokenize

pytestmark = pytest.mark.slow

PROMPT = "The capital of France is"


def post(url: str, path: str, **body) -> httpx.Response:
    return httpx.post(f"{url}{path}", json={"model": SERVED_NAME, **body}, timeout=120)


def ok(url: str, path: str, **body) -> dict:
    r = post(url, path, **body)
    assert r.status_code == 200, r.text
    return r.json()


def stream(url: str, path: str, **body) -> list[dict]:
    """The chunks of a streamed answer, [DONE] left out."""
    body = {"model": SERVED_NAME, "stream": True, **body}
    with httpx.stream("POST", f"{url}{path}", json=body, timeout=120) as r:
        assert r.status_code == 200, r.read()
        lines = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert lines[-1] == "[DONE]"
    return [json.loads(line) for line in lines[:-1]]


def detokenize(url: str, ids: list[int]) -> str:
    return ok(url, "/detokenize", tokens=ids)["prompt"]


# ---- return_token_ids ----


def test_completion_token_ids_match_the_tokenizer(served):
    _, url = served
    body = ok(url, "/v1/completions", prompt=PROMPT, max_tokens=8, temperature=0,
              return_token_ids=True)  # fmt: skip
    choice = body["choices"][0]
    assert choice["prompt_token_ids"] == tokenize(url, prompt=PROMPT)
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert detokenize(url, choice["token_ids"]) == choice["text"]


def test_chat_token_ids_match_the_tokenizer(served):
    _, url = served
    body = ok(url, "/v1/chat/completions", messages=CHAT, max_tokens=8, temperature=0,
              return_token_ids=True)  # fmt: skip
    assert body["prompt_token_ids"] == tokenize(url, messages=CHAT)
    choice = body["choices"][0]
    assert len(choice["token_ids"]) == body["usage"]["completion_tokens"]
    assert detokenize(url, choice["token_ids"]) == choice["message"]["content"]


def test_without_the_extensions_the_answer_keeps_openai_shape(served):
    _, url = served
    body = ok(url, "/v1/chat/completions", messages=CHAT, max_tokens=2)
    assert "prompt_token_ids" not in body and "token_ids" not in body["choices"][0]
    chunks = stream(url, "/v1/completions", prompt=PROMPT, max_tokens=2)
    assert all("timings" not in c and "token_ids" not in c["choices"][0] for c in chunks)


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_streamed_token_ids_add_up_to_the_whole(served, path):
    _, url = served
    body = dict(max_tokens=10, temperature=0, return_token_ids=True)
    body.update({"prompt": PROMPT} if "chat" not in path else {"messages": CHAT})
    whole = ok(url, path, **body)
    chunks = stream(url, path, **body)
    ids = [t for c in chunks for choice in c["choices"] for t in choice.get("token_ids", [])]
    choice = whole["choices"][0]
    assert ids == choice["token_ids"]
    prompt_ids = whole["prompt_token_ids"] if "chat" in path else choice["prompt_token_ids"]
    if "chat" in path:
        carrying = [c["prompt_token_ids"] for c in chunks if "prompt_token_ids" in c]
    else:
        carrying = [ch["prompt_token_ids"] for c in chunks for ch in c["choices"]
                    if "prompt_token_ids" in ch]  # fmt: skip
    assert carrying == [prompt_ids]  # once, in the first chunk


# ---- /version, /tokenizer_info ----


def test_version_and_tokenizer_info(served):
    engine, url = served
    r = httpx.get(f"{url}/version")
    assert r.status_code == 200
    assert r.json() == {"version": importlib.metadata.version("kvserve")}
    info = httpx.get(f"{url}/tokenizer_info").json()
    tok = engine.tokenizer
    assert info["vocab_size"] == tok.vocab_size
    assert info["model_max_length"] == MAX_MODEL_LEN
    assert info["eos_token_id"] in tok.eos_token_ids
    assert info["eos_token"] == tok.token_str(info["eos_token_id"])
    assert info["tokenizer_class"] and info["chat_template"]


# ---- truncate_prompt_tokens ----


@pytest.mark.parametrize("side", ["left", "right", None])
def test_truncate_prompt_tokens_keeps_one_side(served, side):
    _, url = served
    ids = tokenize(url, prompt="one two three four five six seven eight nine ten")
    extra = {"truncation_side": side} if side else {}
    body = ok(url, "/v1/completions", prompt=ids, max_tokens=1, truncate_prompt_tokens=4,
              return_token_ids=True, **extra)  # fmt: skip
    kept = ids[:4] if side == "right" else ids[-4:]  # left is the default
    assert body["choices"][0]["prompt_token_ids"] == kept
    assert body["usage"]["prompt_tokens"] == 4


def test_truncate_prompt_tokens_on_chat_and_minus_one(served):
    _, url = served
    body = ok(url, "/v1/chat/completions", messages=CHAT, max_tokens=1,
              truncate_prompt_tokens=3, return_token_ids=True)  # fmt: skip
    assert body["prompt_token_ids"] == tokenize(url, messages=CHAT)[-3:]
    body = ok(url, "/v1/completions", prompt=PROMPT, max_tokens=1, truncate_prompt_tokens=-1)
    assert body["usage"]["prompt_tokens"] == len(tokenize(url, prompt=PROMPT))


@pytest.mark.parametrize("value", [0, -2, MAX_MODEL_LEN + 1])
def test_bad_truncate_prompt_tokens_is_a_400_naming_it(served, value):
    _, url = served
    r = post(url, "/v1/completions", prompt=PROMPT, max_tokens=1, truncate_prompt_tokens=value)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == "truncate_prompt_tokens"


# ---- llama.cpp timings ----


def check_timings(timings: dict, usage: dict) -> None:
    assert timings["predicted_n"] == usage["completion_tokens"]
    assert timings["prompt_n"] + timings["cache_n"] == usage["prompt_tokens"]
    assert timings["cache_n"] == usage["prompt_tokens_details"]["cached_tokens"]
    assert timings["prompt_ms"] > 0 and timings["predicted_ms"] >= 0
    if timings["prompt_n"]:
        assert timings["prompt_per_token_ms"] == pytest.approx(
            timings["prompt_ms"] / timings["prompt_n"]
        )


@pytest.mark.parametrize("path", ["/v1/completions", "/v1/chat/completions"])
def test_timings_count_what_usage_counts(served, path):
    _, url = served
    body = {"prompt": PROMPT} if "chat" not in path else {"messages": CHAT}
    whole = ok(url, path, max_tokens=6, **body)
    check_timings(whole["timings"], whole["usage"])
    chunks = stream(url, path, max_tokens=6, timings_per_token=True,
                    stream_options={"include_usage": True}, **body)  # fmt: skip
    assert all("timings" in c for c in chunks)
    predicted = [c["timings"]["predicted_n"] for c in chunks]
    assert predicted == sorted(predicted)
    check_timings(chunks[-1]["timings"], chunks[-1]["usage"])


# ---- prompt_logprobs with n > 1, return_progress ----


def test_chat_prompt_logprobs_with_n_above_one(served):
    _, url = served
    body = ok(url, "/v1/chat/completions", messages=CHAT, max_tokens=2, n=2, prompt_logprobs=1)
    assert len(body["choices"]) == 2
    assert len(body["prompt_logprobs"]) == body["usage"]["prompt_tokens"]


def test_return_progress_is_refused_by_name(served):
    _, url = served
    r = post(url, "/v1/completions", prompt=PROMPT, max_tokens=1, stream=True,
             return_progress=True)  # fmt: skip
    assert r.status_code == 400
    assert r.json()["error"]["param"] == "return_progress"
    ok(url, "/v1/completions", prompt=PROMPT, max_tokens=1, return_progress=False)

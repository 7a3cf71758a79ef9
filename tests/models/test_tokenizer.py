"""The runtime tokenizer against transformers' own GGUF tokenizers and chat templates."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tokenizers import AddedToken, normalizers, pre_tokenizers, processors
from tokenizers import Tokenizer as HFTokenizer
from tokenizers import models as tk_models

from models.tokenizer import Tokenizer, TooManyTokens

ALIASES = {
    "smollm2": "smollm2-135m-instruct",
    "gemma3": "gemma3-270m",
    "qwen2": "qwen2.5-coder-0.5b-instruct",
}
FOLDERS = {"smollm2": "smollm2_dir", "gemma3": "gemma3_dir", "qwen2": "qwen05_dir"}

TEXTS = [
    "Hello world",
    " leading space",
    "   three leading spaces",
    "double  spaces   and\ttabs\n\nnew paragraph\n\n\n",
    "def f(x):\n    return x**2  # square\n\nprint(f(12))\n",
    "1234567890 3.14159 1,000,000 2024-01-31",
    "naïve café, 日本語のテキスト, Ελληνικά, مرحبا",
    "emoji 😀👍🏽 family 👨‍👩‍👧 flags 🇫🇷",
    "<|im_start|>user\nhi<|im_end|>\n<start_of_turn>model\nok<end_of_turn>\n<bos><eos>",
    "a\u00a0b\u200bc",
    "",
    " ",
    "\n",
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "Answer in one word."},
        {"role": "user", "content": "  Capital of Spain?  "},
        {"role": "assistant", "content": "Madrid."},
        {"role": "user", "content": "And of Italy? 🇮🇹"},
    ],
]


@pytest.fixture(scope="module")
def gguf_tokenizers():
    """transformers' tokenizer built straight from each GGUF (the oracle), loaded once."""
    from transformers import AutoTokenizer

    from bench.drift import fast_gguf_reader
    from models.fetch import gguf_path

    cache = {}

    def get(name: str):
        if name not in cache:
            path = gguf_path(ALIASES[name], progress=False)
            with fast_gguf_reader():
                cache[name] = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        return cache[name]

    return get


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3", "qwen2"])
def test_ids_and_decode_match_transformers_gguf_tokenizer(name, request, gguf_tokenizers):
    tok = Tokenizer.from_dir(request.getfixturevalue(FOLDERS[name]))
    ref = gguf_tokenizers(name)
    for text in TEXTS:
        ids = tok.encode(text)
        assert ids == ref.encode(text), text
        assert tok.encode(text, add_special_tokens=False) == ref.encode(
            text, add_special_tokens=False
        )
        assert tok.decode(ids) == ref.decode(ids, skip_special_tokens=True), text
        assert tok.decode(ids, skip_special_tokens=False) == ref.decode(ids), text
        plain = tok.encode(text, add_special_tokens=False)
        if "<" not in text:
            assert tok.decode(plain) == text


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3", "qwen2"])
def test_chat_template_matches_transformers(name, request):
    from transformers import AutoTokenizer

    folder = request.getfixturevalue(FOLDERS[name])
    tok = Tokenizer.from_dir(folder)
    ref = AutoTokenizer.from_pretrained(folder)
    assert tok.has_chat_template
    for chat in CHATS:
        for add_prompt in (True, False):
            text = tok.apply_chat_template(chat, add_generation_prompt=add_prompt)
            assert text == ref.apply_chat_template(
                chat, tokenize=False, add_generation_prompt=add_prompt
            )
            expected = ref.apply_chat_template(
                chat, tokenize=True, add_generation_prompt=add_prompt, return_dict=False
            )
            assert tok.encode_chat(chat, add_generation_prompt=add_prompt) == list(expected)


@pytest.mark.slow
def test_smollm2_special_tokens(smollm2_dir):
    tok = Tokenizer.from_dir(smollm2_dir)
    assert tok.vocab_size == 49152
    assert tok.bos_token_id == 1
    assert tok.eos_token_ids == (2,)
    assert tok.encode("Hi") == tok.encode("Hi", add_special_tokens=False)
    ids = tok.encode_chat(CHATS[0])
    assert ids[0] == tok.encode("<|im_start|>")[0] and ids.count(1) == 3
    assert tok.token_str(tok.encode(" Paris")[0]) == " Paris"


@pytest.mark.slow
def test_gemma3_special_tokens_and_single_bos(gemma3_dir):
    tok = Tokenizer.from_dir(gemma3_dir)
    assert tok.vocab_size == 262144
    assert tok.bos_token_id == 2
    assert tok.eos_token_ids == (1, 106)
    assert tok.encode("Hi")[0] == 2 and tok.encode("Hi", add_special_tokens=False)[0] != 2
    ids = tok.encode_chat(CHATS[1])
    assert ids[0] == 2 and ids.count(2) == 1
    assert tok.token_str(106) == "<end_of_turn>"
    assert tok.decode(tok.encode("Hello  world")) == "Hello  world"


# Small synthetic folders: the chat and BOS handling without a real model.


def _write_folder(path: Path, template: str | None, add_bos: bool) -> Path:
    words = ["<bos>", "<eos>", "<turn>", "h", "i", "hi", " "]
    model = tk_models.BPE({w: i for i, w in enumerate(words)}, [("h", "i")])
    hf = HFTokenizer(model)
    hf.pre_tokenizer = pre_tokenizers.Split(" ", behavior="isolated")
    hf.add_special_tokens([AddedToken(w, special=True, normalized=False) for w in words[:3]])
    if add_bos:
        hf.post_processor = processors.TemplateProcessing(
            single="<bos> $A", special_tokens=[("<bos>", 0)]
        )
    hf.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<bos>", "eos_token": "<eos>"}
    if template is not None:
        config["chat_template"] = template
    (path / "tokenizer_config.json").write_text(json.dumps(config))
    (path / "generation_config.json").write_text(json.dumps({"eos_token_id": [1, 2]}))
    return path


PLAIN_TEMPLATE = (
    "{% for m in messages %}{% if m['role'] == 'tool' %}{{ raise_exception('no tools') }}"
    "{% endif %}<turn>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<turn>{% endif %}"
)


def test_eos_ids_gather_every_source(tmp_path):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=False))
    assert tok.eos_token_ids == (1, 2)
    assert tok.bos_token_id == 0


def test_encode_chat_adds_the_missing_bos_once(tmp_path):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=True))
    chat = [{"role": "user", "content": "hi"}]
    assert tok.encode_chat(chat) == [0, 2, 5, 2]
    with_bos = Tokenizer.from_dir(
        _write_folder(tmp_path, "{{ bos_token }}" + PLAIN_TEMPLATE, add_bos=True)
    )
    assert with_bos.encode_chat(chat) == [0, 2, 5, 2]


def test_missing_chat_template_is_a_clear_error(tmp_path):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, None, add_bos=False))
    assert not tok.has_chat_template
    with pytest.raises(ValueError, match="no chat template"):
        tok.apply_chat_template([{"role": "user", "content": "hi"}])


@pytest.mark.parametrize(
    "messages",
    [
        [],
        "hi",
        ["hi"],
        [{"content": "hi"}],
        [{"role": 3, "content": "hi"}],
        [{"role": "user", "content": 5}],
    ],
)
def test_malformed_messages_are_rejected(tmp_path, messages):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=False))
    with pytest.raises(ValueError):
        tok.apply_chat_template(messages)


def test_template_exceptions_become_value_errors(tmp_path):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=False))
    with pytest.raises(ValueError, match="no tools"):
        tok.apply_chat_template([{"role": "tool", "content": "x"}])
    broken = Tokenizer.from_dir(_write_folder(tmp_path, "{% for %}", add_bos=False))
    with pytest.raises(ValueError, match="does not compile"):
        broken.apply_chat_template([{"role": "user", "content": "hi"}])


def test_none_content_is_dropped_like_transformers(tmp_path):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=False))
    text = tok.apply_chat_template([{"role": "assistant", "content": None}], False)
    assert text == "<turn>"


TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The weather in a city",
            "parameters": {
                "type": "object",
                "properties": {"city": {"type": "string"}, "unit": {"enum": ["C", "F"]}},
                "required": ["city"],
            },
        },
    }
]
TOOL_TURNS = [
    {"role": "user", "content": "Weather in Oslo?"},
    {"role": "assistant", "content": None, "tool_calls": [{"id": "call_1", "type": "function",
     "function": {"name": "get_weather", "arguments": {"city": "Oslo"}}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18 C and sunny"},
]  # fmt: skip


@pytest.mark.slow
def test_qwen2_template_renders_tools_and_tool_turns_as_transformers(qwen05_dir):
    from transformers import AutoTokenizer

    tok = Tokenizer.from_dir(qwen05_dir)
    ref = AutoTokenizer.from_pretrained(qwen05_dir)
    for chat in (TOOL_TURNS[:1], TOOL_TURNS):
        text = tok.apply_chat_template(chat, tools=TOOLS)
        assert text == ref.apply_chat_template(
            chat, tools=TOOLS, tokenize=False, add_generation_prompt=True
        )
    assert "<tools>" in text and '"name": "get_weather"' in text
    assert "<tool_call>" in text and "<tool_response>\n18 C and sunny" in text
    assert tok.eos_token_ids == (151645, 151643)


# ---- a bound on tokens from a text's length alone ----


def test_encode_refuses_past_max_tokens_from_the_length_or_the_count(tmp_path):
    tok = Tokenizer.from_dir(_write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=False))
    assert tok.max_token_chars == len("<turn>")  # the longest entry, an added token
    text = "hi" * 100  # 100 tokens; its 200 characters show at least ceil(200 / 6) = 34
    assert tok.min_tokens(text) == 34 <= len(tok.encode(text))
    assert tok.encode(text, max_tokens=100) == tok.encode(text)
    with pytest.raises(TooManyTokens) as counted:
        tok.encode(text, max_tokens=99)
    assert (counted.value.count, counted.value.exact) == (100, True)
    with pytest.raises(TooManyTokens) as guessed:
        tok.encode(text, max_tokens=33)
    assert (guessed.value.count, guessed.value.exact) == (34, False)
    chat = [{"role": "user", "content": text}]  # <turn>, 100 tokens, <turn>
    assert len(tok.encode_chat(chat, max_tokens=102)) == 102
    with pytest.raises(TooManyTokens):
        tok.encode_chat(chat, max_tokens=101)


@pytest.mark.parametrize(
    "normalizer, pre_tokenizer",
    [
        (normalizers.NFC(), None),  # composes characters: a text may shorten before it is split
        (normalizers.Strip(), None),
        (None, pre_tokenizers.WhitespaceSplit()),  # drops the whitespace between words
        (None, pre_tokenizers.Split(" ", behavior="removed")),
    ],
)
def test_no_length_bound_where_text_can_vanish_before_it_is_split(
    tmp_path, normalizer, pre_tokenizer
):
    folder = _write_folder(tmp_path, PLAIN_TEMPLATE, add_bos=False)
    hf = HFTokenizer.from_file(str(folder / "tokenizer.json"))
    if normalizer is not None:
        hf.normalizer = normalizer
    if pre_tokenizer is not None:
        hf.pre_tokenizer = pre_tokenizer
    hf.save(str(folder / "tokenizer.json"))
    tok = Tokenizer.from_dir(folder)
    assert tok.max_token_chars is None and tok.min_tokens("hi " * 1000) == 0


@pytest.mark.slow
def test_min_tokens_never_exceeds_smollm2s_count(smollm2_dir):
    tok = Tokenizer.from_dir(smollm2_dir)
    assert tok.max_token_chars is not None
    longest = max(tok._tok.get_vocab(with_added_tokens=True), key=len)
    runs = [" " * 5000, "\n" * 3000, "-" * 4000, "1" * 2000, "ab" * 3000, longest * 50]
    for text in TEXTS + runs + ["".join(TEXTS) * 20]:
        for special in (True, False):
            assert tok.min_tokens(text) <= len(tok.encode(text, special)), text[:40]

"""The needle dataset: prompts of the asked length with the needle at the asked depth, exact-match
scoring, and a JSON round trip that keeps every token id; on a word-level tokenizer, no model."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterable

import pytest

from bench import needle


class WordTokenizer:
    """One token per word with the whitespace before it, so pieces concatenate exactly."""

    def __init__(self) -> None:
        self.words: list[str] = []
        self.ids: dict[str, int] = {}

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [self.ids.setdefault(w, len(self.ids)) for w in re.findall(r"\s*\S+|\s+$", text)]

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        words = list(self.ids)
        return "".join(words[i] for i in ids)

    def apply_chat_template(self, messages: list[dict]) -> str:
        return f"<user> {messages[0]['content']} <assistant> "


# Ten-word sentences: sentence ends every ten tokens, so a needle lands within ten of its depth.
HAYSTACK = " ".join(f"Word{i} one two three four five six seven eight nine." for i in range(200))


@pytest.fixture
def tok() -> WordTokenizer:
    return WordTokenizer()


@pytest.mark.parametrize("chat", [False, True])
@pytest.mark.parametrize("length", [300, 1000])
def test_prompt_has_the_asked_length_and_ends_with_the_question(tok, length, chat):
    dataset = needle.build_dataset(tok, HAYSTACK, [length], n_keys=2, chat=chat)
    for sample in dataset.samples:
        assert len(sample.prompt_ids) == sample.length == length
        text = tok.decode(sample.prompt_ids)
        ending = " <assistant> The pass key is" if chat else " The pass key is"
        assert text.endswith("\n\nWhat is the pass key?" + ending)
        assert text.startswith("<user> " + needle.INTRO if chat else needle.INTRO)


@pytest.mark.parametrize("depth", needle.DEPTHS + (0.0, 1.0))
def test_needle_sits_at_the_asked_depth_after_a_sentence(tok, depth):
    head_tail = needle.frame(tok, chat=False)
    sample = needle.build_sample(tok, tok.encode(HAYSTACK), head_tail, 1000, depth, "48213")
    ids = sample.prompt_ids
    span = tok.decode(ids[sample.needle_start : sample.needle_end])
    assert span == needle.NEEDLE.format(key="48213")
    head = len(tok.encode(head_tail[0]))
    hay_len = 1000 - head - len(tok.encode(head_tail[1])) - len(tok.encode(span))
    before = sample.needle_start - head
    assert round(depth * hay_len) - 10 < before <= round(depth * hay_len)
    if before:
        assert tok.decode(ids[sample.needle_start - 1 : sample.needle_start]).endswith(".")


def test_haystack_too_short_is_refused(tok):
    with pytest.raises(ValueError, match="haystack"):
        needle.build_dataset(tok, "Short text.", [500])


def test_passkeys_are_reproducible_and_distinct():
    keys = needle.passkeys(20, seed=3)
    assert keys == needle.passkeys(20, seed=3) != needle.passkeys(20, seed=4)
    assert len(set(keys)) == 20 and all(len(k) == 5 and k.isdigit() for k in keys)


@pytest.mark.parametrize(
    ("generated", "correct"),
    [
        (" 48213", True),
        (" 48213. Remember it.", True),
        ("48213 is the pass key", True),
        (" is 48213.\n\nThe", True),
        (" 4821", False),  # too few digits
        (" 482134", False),  # too many
        (" 48231", False),  # wrong digits
        (" 12345. The pass key is 48213", False),  # only the first number counts
        (" I don't know", False),
        ("", False),
    ],
)
def test_exact_match_reads_the_first_digits(generated, correct):
    assert needle.is_correct(generated, "48213") is correct


def test_json_round_trip_keeps_every_id(tok, tmp_path):
    dataset = needle.build_dataset(tok, HAYSTACK, [300, 500], depths=[0.2, 0.8], n_keys=3)
    path = tmp_path / "needle.json"
    needle.save(dataset, path)
    loaded = needle.load(path)
    assert loaded == dataset
    assert len(loaded.samples) == 12 and len({s.id for s in loaded.samples}) == 12


def test_load_refuses_other_json(tmp_path):
    path = tmp_path / "other.json"
    path.write_text('{"meta": {}, "samples": []}')
    with pytest.raises(ValueError, match="not a"):
        needle.load(path)


def test_importing_needle_pulls_in_no_kvserve_or_torch():
    # The kvpress peer shares this module from another environment.
    code = (
        "import sys, bench.needle; "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'engine', 'models', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"

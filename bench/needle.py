"""Needle retrieval: a pass key hidden at a chosen depth of a long real text, asked for at the
end. It judges KV-cache eviction: a policy that evicts the needle's keys loses the answer.

A prompt is built in token ids, piece by piece, so its length and the needle's place are exact
under the model's tokenizer::

    [ frame head ][ haystack ...... ][ needle ][ ...... haystack ][ frame tail ]
                  |<- depth * hay ->|
    |<------------------------------- length ---------------------------------->|

The haystack is a public-domain text (``alice``); the needle goes in at the last sentence end
at or before ``depth`` of the haystack, so it never splits a sentence. The frame holds the
instructions and the question; it ends with "The pass key is", so the first digits generated are
the answer (``is_correct``).

A dataset is saved as JSON with the prompts as token ids, so a process in another environment
(the kvpress peer, ``bench/kvpress_peer.py``) reads exactly the ids kvserve reads. This module
imports nothing outside the standard library at its top, so that peer can share it.

    python -m bench.needle --lengths 2048 --out bench/results/needle-2k.json
"""

from __future__ import annotations

import argparse
import json
import random
import re
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

FORMAT = "kvserve-needle/1"
MODEL = "qwen2.5-coder-0.5b-instruct"
DEPTHS = (0.1, 0.3, 0.5, 0.7, 0.9)
MAX_NEW_TOKENS = 8
INTRO = (
    "There is an important piece of information hidden inside a lot of irrelevant text. "
    "Find it and memorize it. I will quiz you about it."
)
NEEDLE = " The pass key is {key}. Remember it. {key} is the pass key."
QUESTION = "What is the pass key?"
ANSWER_START = "The pass key is"
_NUMBER = re.compile(r"\d+")
# A token that closes a sentence (with any closing quote and space after it) or a paragraph;
# a single line break does not, as the text is wrapped mid-sentence.
_SENTENCE_END = re.compile(r"([.!?]['\"’”)]*\s*|\n\s*\n\s*)$")


class TextTokenizer(Protocol):
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]: ...

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str: ...


@dataclass(frozen=True)
class Sample:
    id: str
    length: int  # tokens in the prompt
    depth: float  # the asked depth; needle_start says where the needle landed
    answer: str
    prompt_ids: list[int]
    needle_start: int  # the needle's token span in prompt_ids, [start, end)
    needle_end: int


@dataclass(frozen=True)
class Dataset:
    samples: list[Sample]
    meta: dict[str, Any] = field(default_factory=dict)


# --- scoring ------------------------------------------------------------------------------


def first_number(text: str) -> str | None:
    """The first run of digits in ``text``, or None."""
    match = _NUMBER.search(text)
    return match.group() if match else None


def is_correct(generated: str, answer: str) -> bool:
    """Exact match: the first digits generated are the pass key, no more and no fewer."""
    return first_number(generated) == answer


# --- building -----------------------------------------------------------------------------


def passkeys(n: int, seed: int) -> list[str]:
    """``n`` distinct five-digit pass keys, the same for the same seed."""
    return [str(k) for k in random.Random(seed).sample(range(10_000, 100_000), n)]


def frame(tokenizer: TextTokenizer, chat: bool) -> tuple[str, str]:
    """The text before and after the haystack. Raw text ends with the answer's start; the chat
    form asks in a user turn and starts the assistant's reply with it, so both make the model
    say the digits first."""
    head = f"{INTRO}\n\n"
    tail = f"\n\n{QUESTION}"
    if not chat:
        return head, f"{tail} {ANSWER_START}"
    mark = "\x00HAYSTACK\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": head + mark + tail}])
    before, after = text.split(mark)
    return before, after + ANSWER_START


def _sentence_ends(tokenizer: TextTokenizer, ids: Sequence[int]) -> list[int]:
    """The cuts (positions between tokens) that follow a sentence end; 0 counts as one."""
    cuts = [0]
    for i, token in enumerate(ids):
        if _SENTENCE_END.search(tokenizer.decode([token])):
            cuts.append(i + 1)
    return cuts


def build_sample(
    tokenizer: TextTokenizer,
    haystack_ids: Sequence[int],
    head_tail: tuple[str, str],
    length: int,
    depth: float,
    key: str,
    cuts: Sequence[int] | None = None,
) -> Sample:
    """One prompt of exactly ``length`` tokens: the frame around the first haystack tokens that
    fit, with the needle at the last sentence end at or before ``depth`` of them. ``cuts`` are
    ``haystack_ids``' sentence ends, when the caller has them already."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"depth {depth} is not in [0, 1]")
    head = tokenizer.encode(head_tail[0], add_special_tokens=False)
    tail = tokenizer.encode(head_tail[1], add_special_tokens=False)
    needle = tokenizer.encode(NEEDLE.format(key=key), add_special_tokens=False)
    hay_len = length - len(head) - len(tail) - len(needle)
    if hay_len < 0:
        raise ValueError(f"{length} tokens cannot hold the frame and the needle")
    if hay_len > len(haystack_ids):
        raise ValueError(f"the haystack has {len(haystack_ids)} tokens, {hay_len} are needed")
    hay = list(haystack_ids[:hay_len])
    if cuts is None:
        cuts = _sentence_ends(tokenizer, hay)
    cut = max(c for c in cuts if c <= round(depth * hay_len))
    prompt = head + hay[:cut] + needle + hay[cut:] + tail
    start = len(head) + cut
    return Sample(
        id=f"{length}-d{depth:g}-{key}",
        length=length,
        depth=depth,
        answer=key,
        prompt_ids=prompt,
        needle_start=start,
        needle_end=start + len(needle),
    )


def build_dataset(
    tokenizer: TextTokenizer,
    haystack: str,
    lengths: Sequence[int],
    depths: Sequence[float] = DEPTHS,
    n_keys: int = 4,
    seed: int = 0,
    chat: bool = False,
) -> Dataset:
    """Every length x depth x key; the same keys at every depth and length."""
    hay_ids = tokenizer.encode(haystack, add_special_tokens=False)
    cuts = _sentence_ends(tokenizer, hay_ids[: max(lengths)])
    head_tail = frame(tokenizer, chat)
    samples = [
        build_sample(tokenizer, hay_ids, head_tail, length, depth, key, cuts)
        for length in lengths
        for depth in depths
        for key in passkeys(n_keys, seed)
    ]
    meta = {
        "format": FORMAT,
        "prompt_format": "chat" if chat else "raw",
        "seed": seed,
        "max_new_tokens": MAX_NEW_TOKENS,
        "needle": NEEDLE,
        "frame": list(head_tail),
    }
    return Dataset(samples, meta)


def make_dataset(
    lengths: Sequence[int],
    depths: Sequence[float] = DEPTHS,
    n_keys: int = 4,
    seed: int = 0,
    chat: bool = False,
    model: str = MODEL,
    text: str = "alice",
) -> Dataset:
    """The dataset under a kvserve model's own tokenizer (fetched if missing), with a named
    public-domain text as the haystack."""
    from bench.quality import load_text
    from models.fetch import fetch
    from models.tokenizer import Tokenizer

    tokenizer = Tokenizer.from_dir(fetch(model))
    dataset = build_dataset(tokenizer, load_text(text), lengths, depths, n_keys, seed, chat)
    dataset.meta.update(model=model, haystack=text)
    return dataset


# --- files --------------------------------------------------------------------------------


def save(dataset: Dataset, path: str | Path) -> None:
    """One sample a line, so a diff of two datasets reads sample by sample."""
    rows = ",\n".join(json.dumps(asdict(s), separators=(",", ":")) for s in dataset.samples)
    meta = json.dumps(dataset.meta, indent=1)
    Path(path).write_text(f'{{"meta": {meta},\n"samples": [\n{rows}\n]}}\n', encoding="utf-8")


def load(path: str | Path) -> Dataset:
    data = json.loads(Path(path).read_text(encoding="utf-8"))
    if data["meta"].get("format") != FORMAT:
        raise ValueError(f"{path} is not a {FORMAT} dataset")
    return Dataset([Sample(**s) for s in data["samples"]], data["meta"])


def main(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048])
    parser.add_argument("--depths", type=float, nargs="+", default=list(DEPTHS))
    parser.add_argument("--keys", type=int, default=4, help="pass keys per length and depth")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--chat", action="store_true", help="ask in the chat template")
    parser.add_argument("--model", default=MODEL)
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    dataset = make_dataset(args.lengths, args.depths, args.keys, args.seed, args.chat, args.model)
    save(dataset, args.out)
    print(f"{len(dataset.samples)} prompts -> {args.out}")


if __name__ == "__main__":
    main()

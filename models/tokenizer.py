"""The runtime tokenizer: `tokenizer.json` plus the chat template of a model folder."""

from __future__ import annotations

import ctypes
import ctypes.util
import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer

# Texts at least this long are encoded into hundreds of bytes per token, which the allocator
# keeps in the encoding thread's arena once freed: a few long texts would hold that much for
# good. Past this length, the freed memory is handed back to the system.
_TRIM_AFTER_CHARS = 1 << 17
_LIBC = ctypes.CDLL(ctypes.util.find_library("c"))
_malloc_trim = getattr(_LIBC, "malloc_trim", None)  # glibc's; elsewhere nothing to do


def _read_json(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text("utf-8")) if path.is_file() else {}


def _token_text(value: Any) -> str | None:
    # tokenizer_config.json spells a special token either as a string or as an AddedToken dict.
    if isinstance(value, dict):
        return value.get("content")
    return value


def _as_ids(value: Any) -> list[int]:
    if value is None:
        return []
    if isinstance(value, int):
        return [value]
    return [int(v) for v in value]


def _raise_exception(message: str) -> None:
    raise jinja2.exceptions.TemplateError(message)


def _tojson(x: Any, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    # Jinja's own tojson escapes HTML characters, which would change the prompt text.
    return json.dumps(
        x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys
    )


def _strftime_now(fmt: str) -> str:
    return datetime.now().strftime(fmt)


def _compile_template(source: str) -> jinja2.Template:
    # The environment transformers renders chat templates in, so prompts match it byte for byte.
    env = ImmutableSandboxedEnvironment(
        trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols]
    )
    env.filters["tojson"] = _tojson
    env.globals["raise_exception"] = _raise_exception
    env.globals["strftime_now"] = _strftime_now
    return env.from_string(source)


def _check_messages(messages: Any) -> list[dict[str, Any]]:
    if not isinstance(messages, Sequence) or isinstance(messages, (str, bytes)) or not messages:
        raise ValueError("messages must be a non-empty list of {'role', 'content'} dicts")
    checked = []
    for i, message in enumerate(messages):
        if not isinstance(message, dict):
            raise ValueError(f"message {i} is not a dict: {message!r}")
        role = message.get("role")
        if not isinstance(role, str) or not role:
            raise ValueError(f"message {i} has no string 'role'")
        content = message.get("content")
        if content is not None and not isinstance(content, (str, list)):
            raise ValueError(f"message {i} 'content' must be a string or a list of parts")
        # Templates handle a missing key, but many render a None content as the text "None".
        checked.append({k: v for k, v in message.items() if v is not None})
    return checked


# Normalizers that never shorten a text (a Replace only when its content is no shorter than its
# literal pattern), and pre-tokenizers that drop none of it: after them, every character of the
# text is still there to be covered by some token.
_LENGTH_KEEPING = frozenset({"NFD", "NFKD", "Lowercase", "Prepend"})
_TEXT_KEEPING = frozenset({"ByteLevel", "Metaspace", "Digits", "Punctuation", "UnicodeScripts"})


def _keeps_length(normalizer: dict[str, Any] | None) -> bool:
    if normalizer is None:
        return True
    kind = normalizer.get("type")
    if kind == "Sequence":
        return all(_keeps_length(n) for n in normalizer.get("normalizers", []))
    if kind == "Replace":
        literal = (normalizer.get("pattern") or {}).get("String")
        return literal is not None and len(normalizer.get("content", "")) >= len(literal)
    return kind in _LENGTH_KEEPING


def _keeps_text(pre_tokenizer: dict[str, Any] | None) -> bool:
    if pre_tokenizer is None:
        return True
    kind = pre_tokenizer.get("type")
    if kind == "Sequence":
        return all(_keeps_text(p) for p in pre_tokenizer.get("pretokenizers", []))
    if pre_tokenizer.get("behavior") == "Removed":
        return False
    return kind == "Split" or kind in _TEXT_KEEPING


def _max_token_chars(config: dict[str, Any]) -> int | None:
    """The most characters of text one token can stand for, from a tokenizer.json: its longest
    vocabulary entry. A byte-level entry spells one byte per character, and a character is at
    least one byte; a SentencePiece entry spells one character per character. None where no
    such bound holds: a model that folds unknown text of any length into one token, or a
    normalizer or pre-tokenizer that may shorten the text before it is split."""
    model = config.get("model") or {}
    folds_unknown = model.get("unk_token") is not None and not model.get("byte_fallback")
    keeps = _keeps_length(config.get("normalizer")) and _keeps_text(config.get("pre_tokenizer"))
    if model.get("type") != "BPE" or folds_unknown or not keeps:
        return None
    words = [*model.get("vocab", {}), *(t["content"] for t in config.get("added_tokens", []))]
    return max(map(len, words), default=None)


class TooManyTokens(Exception):
    """A text over the ``max_tokens`` it was encoded with: ``count`` tokens, or at least that
    many where ``exact`` is False (refused from its length, before it was encoded)."""

    def __init__(self, count: int, exact: bool):
        super().__init__(f"{'' if exact else 'at least '}{count} tokens")
        self.count = count
        self.exact = exact


class Tokenizer:
    """Encodes, decodes and renders chats for one converted model folder."""

    def __init__(
        self,
        tokenizer: _HFTokenizer,
        tokenizer_config: dict[str, Any],
        eos_token_ids: Iterable[int],
        bos_token_id: int | None,
        chat_template: str | None,
    ):
        self._tok = tokenizer
        self._special_vars = {
            name: text
            for name in ("bos_token", "eos_token", "unk_token", "pad_token")
            if (text := _token_text(tokenizer_config.get(name))) is not None
        }
        self.vocab_size: int = tokenizer.get_vocab_size(with_added_tokens=True)
        self.tokenizer_class: str = tokenizer_config.get("tokenizer_class") or (
            "PreTrainedTokenizerFast"  # what transformers loads a bare tokenizer.json as
        )
        self.bos_token_id = bos_token_id
        self.eos_token_ids: tuple[int, ...] = tuple(dict.fromkeys(eos_token_ids))
        self._chat_template = chat_template
        self._compiled: jinja2.Template | None = None
        probe = tokenizer.encode("", add_special_tokens=True).ids
        self._adds_bos = bos_token_id is not None and probe[:1] == [bos_token_id]
        self.max_token_chars = _max_token_chars(json.loads(tokenizer.to_str()))

    @classmethod
    def from_dir(cls, path: str | Path) -> Tokenizer:
        folder = Path(path)
        tok_file = folder / "tokenizer.json"
        if not tok_file.is_file():
            raise ValueError(f"{folder} has no tokenizer.json")
        tok = _HFTokenizer.from_file(str(tok_file))
        tcfg = _read_json(folder / "tokenizer_config.json")
        gen = _read_json(folder / "generation_config.json")
        cfg = _read_json(folder / "config.json")

        def token_id(name: str) -> int | None:
            text = _token_text(tcfg.get(name))
            return tok.token_to_id(text) if text is not None else None

        eos = _as_ids(gen.get("eos_token_id")) + _as_ids(cfg.get("eos_token_id"))
        if (eos_id := token_id("eos_token")) is not None:
            eos.append(eos_id)
        bos = token_id("bos_token")
        if bos is None:
            bos = gen.get("bos_token_id", cfg.get("bos_token_id"))

        template = tcfg.get("chat_template")
        jinja_file = folder / "chat_template.jinja"
        if template is None and jinja_file.is_file():
            template = jinja_file.read_text("utf-8")
        if isinstance(template, list):
            # A list of named templates; the one named "default" is the chat one.
            named = {t.get("name"): t.get("template") for t in template}
            template = named.get("default")
        return cls(tok, tcfg, eos, bos, template)

    @property
    def has_chat_template(self) -> bool:
        return bool(self._chat_template)

    @property
    def chat_template(self) -> str | None:
        return self._chat_template

    @property
    def template_takes_tools(self) -> bool:
        """Whether the chat template renders the ``tools`` it is given."""
        return bool(self._chat_template) and "tools" in self._chat_template

    def encode(
        self, text: str, add_special_tokens: bool = True, max_tokens: int | None = None
    ) -> list[int]:
        """Raises ValueError for text that is not valid Unicode (a lone surrogate), and
        TooManyTokens for one over ``max_tokens``: before encoding it where its length shows it
        (``min_tokens``), else before its ids become a Python list. Releases the GIL while it
        works (``encode`` holds it; ``encode_batch`` does not), so a long text encoded in a
        worker thread never pauses the threads around it."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the text is not valid Unicode: {e.reason} at character {e.start}"
            ) from None
        if max_tokens is not None and (at_least := self.min_tokens(text)) > max_tokens:
            raise TooManyTokens(at_least, exact=False)
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        count = len(encoding)
        ids = encoding.ids if max_tokens is None or count <= max_tokens else None
        del encoding
        if len(text) >= _TRIM_AFTER_CHARS and _malloc_trim is not None:
            _malloc_trim(0)  # a ctypes call: the GIL is released meanwhile
        if ids is None:
            raise TooManyTokens(count, exact=True)
        return ids

    def min_tokens(self, text: str) -> int:
        """How many tokens ``text`` has at least, from its length alone (0 where the vocabulary
        bounds no token's length)."""
        if self.max_token_chars is None:
            return 0
        return -(-len(text) // self.max_token_chars)

    def decode(self, ids: Iterable[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    def token_str(self, token_id: int) -> str:
        return self._tok.decode([token_id], skip_special_tokens=False)

    def apply_chat_template(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
    ) -> str:
        if not self._chat_template:
            raise ValueError("this model has no chat template; send a plain prompt instead")
        checked = _check_messages(messages)
        if self._compiled is None:
            try:
                self._compiled = _compile_template(self._chat_template)
            except jinja2.TemplateError as e:
                raise ValueError(f"the model's chat template does not compile: {e}") from e
        try:
            return self._compiled.render(
                messages=checked,
                tools=tools,
                documents=None,
                add_generation_prompt=add_generation_prompt,
                **self._special_vars,
            )
        except jinja2.TemplateError as e:
            raise ValueError(f"chat template rejected the messages: {e}") from e
        except (TypeError, KeyError, IndexError, AttributeError) as e:
            raise ValueError(f"chat template failed on the messages: {e!r}") from e

    def encode_chat(
        self,
        messages: list[dict[str, Any]],
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        max_tokens: int | None = None,
    ) -> list[int]:
        """The rendered chat as ids, with exactly one BOS when the model wants one; raises
        TooManyTokens as ``encode`` does.

        Templates usually write the BOS themselves, so the text is encoded without special
        tokens; one is prepended only when the tokenizer adds BOS and the template did not.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        ids = self.encode(text, False, max_tokens)
        if self._adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        if max_tokens is not None and len(ids) > max_tokens:
            raise TooManyTokens(len(ids), exact=True)
        return ids

"""The runtime tokenizer: `tokenizer.json` plus the chat template of a model folder."""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from datetime import datetime
from pathlib import Path
from typing import Any

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HFTokenizer


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

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Raises ValueError for text that is not valid Unicode (a lone surrogate). Releases
        the GIL while it works (``encode`` holds it; ``encode_batch`` does not), so a long text
        encoded in a worker thread never pauses the threads around it."""
        try:
            text.encode("utf-8")
        except UnicodeEncodeError as e:
            raise ValueError(
                f"the text is not valid Unicode: {e.reason} at character {e.start}"
            ) from None
        (encoding,) = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)
        return encoding.ids

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
    ) -> list[int]:
        """The rendered chat as ids, with exactly one BOS when the model wants one.

        Templates usually write the BOS themselves, so the text is encoded without special
        tokens; one is prepended only when the tokenizer adds BOS and the template did not.
        """
        text = self.apply_chat_template(messages, add_generation_prompt, tools)
        ids = self.encode(text, False)
        if self._adds_bos and ids[:1] != [self.bos_token_id]:
            ids.insert(0, self.bos_token_id)
        return ids

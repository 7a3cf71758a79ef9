"""A checkpoint's config.json, parsed once; every model reads its fields through it."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Any


@dataclass(frozen=True, eq=False)
class ModelConfig:
    """A checkpoint's config.json, with the fields every model reads as properties."""

    path: Path
    hf: MappingProxyType

    @classmethod
    def from_dir(cls, path: str | Path) -> ModelConfig:
        path = Path(path)
        with open(path / "config.json") as f:
            raw = json.load(f)
        text = raw.get("text_config")
        if isinstance(text, dict) and "architectures" not in raw:
            raw = {**text, "architectures": raw.get("architectures")}
        return cls(path, MappingProxyType(raw))

    def __reduce__(self):
        # Sent whole to tensor-parallel ranks; a mappingproxy does not pickle, its dict does.
        return _rebuild, (self.path, dict(self.hf))

    def get(self, key: str, default: Any = None) -> Any:
        return self.hf.get(key, default)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def architecture(self) -> str:
        archs = self.get("architectures") or []
        if not archs:
            raise ValueError(f"{self.path}/config.json names no architecture")
        return archs[0]

    @property
    def vocab_size(self) -> int:
        return self.hf["vocab_size"]

    @property
    def hidden_size(self) -> int:
        return self.hf["hidden_size"]

    @property
    def num_layers(self) -> int:
        return self.hf["num_hidden_layers"]

    @property
    def num_heads(self) -> int:
        return self.hf["num_attention_heads"]

    @property
    def num_kv_heads(self) -> int:
        return self.get("num_key_value_heads") or self.num_heads

    @property
    def head_dim(self) -> int:
        return self.get("head_dim") or self.hidden_size // self.num_heads

    @property
    def max_position_embeddings(self) -> int:
        return self.get("max_position_embeddings", 2048)

    @property
    def eos_token_ids(self) -> tuple[int, ...]:
        eos = self.get("eos_token_id")
        if eos is None:
            return ()
        return tuple(eos) if isinstance(eos, list) else (eos,)


def _rebuild(path: Path, hf: dict) -> ModelConfig:
    return ModelConfig(path, MappingProxyType(hf))

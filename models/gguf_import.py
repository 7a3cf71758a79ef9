"""Convert a GGUF checkpoint into a Hugging Face model folder.

The folder holds float32 `model.safetensors` with transformers' tensor names, a `config.json` with
the keys transformers writes for the architecture, `generation_config.json`, and a `tokenizer.json`
rebuilt from the GGUF vocabulary with `tokenizers`. Supported: `llama` (SmolLM2), `qwen2` and
`gemma3`.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGUFReader
from gguf.quants import dequantize
from safetensors.numpy import save_file
from tokenizers import (
    AddedToken,
    Regex,
    Tokenizer,
    decoders,
    models,
    normalizers,
    pre_tokenizers,
    processors,
)
from tqdm import tqdm

from kernels.weights import FORMATS, Weight

log = logging.getLogger(__name__)

# GGUF token types (llama.cpp's llama_token_type).
_TOKEN_CONTROL = 3
_TOKEN_USER_DEFINED = 4

# Gemma 3's instruction template (google/gemma-3-*-it). The GGUF of a base model carries none, but
# the tokenizer has the turn markers, so chat requests still get the format the family was tuned on.
GEMMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}\n"
    "{%- if messages[0]['role'] == 'system' -%}\n"
    "    {%- if messages[0]['content'] is string -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'] + '\\n\\n' -%}\n"
    "    {%- else -%}\n"
    "        {%- set first_user_prefix = messages[0]['content'][0]['text'] + '\\n\\n' -%}\n"
    "    {%- endif -%}\n"
    "    {%- set loop_messages = messages[1:] -%}\n"
    "{%- else -%}\n"
    '    {%- set first_user_prefix = "" -%}\n'
    "    {%- set loop_messages = messages -%}\n"
    "{%- endif -%}\n"
    "{%- for message in loop_messages -%}\n"
    "    {%- if (message['role'] == 'user') != (loop.index0 % 2 == 0) -%}\n"
    '        {{ raise_exception("Conversation roles must alternate '
    'user/assistant/user/assistant/...") }}\n'
    "    {%- endif -%}\n"
    "    {%- if (message['role'] == 'assistant') -%}\n"
    '        {%- set role = "model" -%}\n'
    "    {%- else -%}\n"
    "        {%- set role = message['role'] -%}\n"
    "    {%- endif -%}\n"
    "    {{ '<start_of_turn>' + role + '\\n' + (first_user_prefix if loop.first else \"\") }}\n"
    "    {%- if message['content'] is string -%}\n"
    "        {{ message['content'] | trim }}\n"
    "    {%- elif message['content'] is iterable -%}\n"
    "        {%- for item in message['content'] -%}\n"
    "            {%- if item['type'] == 'image' -%}\n"
    "                {{ '<start_of_image>' }}\n"
    "            {%- elif item['type'] == 'text' -%}\n"
    "                {{ item['text'] | trim }}\n"
    "            {%- endif -%}\n"
    "        {%- endfor -%}\n"
    "    {%- else -%}\n"
    '        {{ raise_exception("Invalid content type") }}\n'
    "    {%- endif -%}\n"
    "    {{ '<end_of_turn>\\n' }}\n"
    "{%- endfor -%}\n"
    "{%- if add_generation_prompt -%}\n"
    "    {{'<start_of_turn>model\\n'}}\n"
    "{%- endif -%}\n"
)

_ATTN_MLP = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}


class Metadata:
    """The key/value section of a GGUF file, with the architecture prefix handled."""

    def __init__(self, reader: GGUFReader):
        self.values: dict[str, Any] = {k: f.contents() for k, f in reader.fields.items()}
        self.arch: str = self.values["general.architecture"]

    def get(self, key: str, default: Any = None) -> Any:
        return self.values.get(key, default)

    def arch_get(self, key: str, default: Any = None) -> Any:
        return self.values.get(f"{self.arch}.{key}", default)

    def require(self, key: str) -> Any:
        value = self.arch_get(key)
        if value is None:
            raise ValueError(f"GGUF metadata lacks {self.arch}.{key}")
        return value


def _f32(value: float) -> float:
    # GGUF stores float32; its shortest decimal (1e-05, not 9.999999747378752e-06) is the value
    # the original config had.
    return float(str(np.float32(value)))


@dataclass(frozen=True)
class _Arch:
    config: Callable[[Metadata, bool], dict[str, Any]]
    layer_tensors: Mapping[str, str]
    fix_tensor: Callable[[str, np.ndarray, dict[str, Any]], np.ndarray]
    default_chat_template: str | None = None


def _common_config(meta: Metadata, tied: bool) -> dict[str, Any]:
    scaling = meta.arch_get("rope.scaling.type", "none")
    if scaling != "none" and meta.arch_get("rope.scaling.factor", 1.0) != 1.0:
        # Which layers a scaled rope applies to differs per family; refuse rather than guess.
        raise ValueError(f"GGUF rope scaling {scaling!r} is not supported")
    n_heads = int(meta.require("attention.head_count"))
    hidden = int(meta.require("embedding_length"))
    head_dim = meta.arch_get("attention.key_length") or meta.arch_get("rope.dimension_count")
    vocab_size = meta.arch_get("vocab_size") or len(meta.get("tokenizer.ggml.tokens"))
    return {
        "attention_bias": False,
        "attention_dropout": 0.0,
        "bos_token_id": meta.get("tokenizer.ggml.bos_token_id"),
        "dtype": "float32",
        "eos_token_id": meta.get("tokenizer.ggml.eos_token_id"),
        "head_dim": int(head_dim or hidden // n_heads),
        "hidden_size": hidden,
        "initializer_range": 0.02,
        "intermediate_size": int(meta.require("feed_forward_length")),
        "max_position_embeddings": int(meta.require("context_length")),
        "num_attention_heads": n_heads,
        "num_hidden_layers": int(meta.require("block_count")),
        "num_key_value_heads": int(meta.arch_get("attention.head_count_kv", n_heads)),
        "pad_token_id": meta.get("tokenizer.ggml.padding_token_id"),
        "rms_norm_eps": _f32(meta.require("attention.layer_norm_rms_epsilon")),
        "tie_word_embeddings": tied,
        "use_cache": True,
        "vocab_size": int(vocab_size),
    }


def _llama_config(meta: Metadata, tied: bool) -> dict[str, Any]:
    return {
        **_common_config(meta, tied),
        "architectures": ["LlamaForCausalLM"],
        "hidden_act": "silu",
        "mlp_bias": False,
        "model_type": "llama",
        "pretraining_tp": 1,
        "rope_parameters": {
            "rope_theta": _f32(meta.arch_get("rope.freq_base", 10000.0)),
            "rope_type": "default",
        },
    }


def _llama_fix(name: str, w: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp interleaves the rotary halves of each q/k head; transformers rotates halves.
    if name.endswith((".attn_q.weight", ".attn_k.weight")):
        key = "num_attention_heads" if ".attn_q." in name else "num_key_value_heads"
        n = config[key]
        rows, cols = w.shape
        w = w.reshape(n, rows // n // 2, 2, cols).swapaxes(1, 2).reshape(rows, cols)
    return w


def _qwen2_config(meta: Metadata, tied: bool) -> dict[str, Any]:
    config = _common_config(meta, tied)
    tokens = meta.get("tokenizer.ggml.tokens")
    eos = [config["eos_token_id"]]
    # The instruct models end a turn with <|im_end|> and a document with <|endoftext|>.
    if "<|endoftext|>" in tokens and tokens.index("<|endoftext|>") not in eos:
        eos.append(tokens.index("<|endoftext|>"))
    return {
        **config,
        "architectures": ["Qwen2ForCausalLM"],
        "eos_token_id": eos,
        "hidden_act": "silu",
        "max_window_layers": config["num_hidden_layers"],
        "model_type": "qwen2",
        "rope_parameters": {
            "rope_theta": _f32(meta.arch_get("rope.freq_base", 1_000_000.0)),
            "rope_type": "default",
        },
        "sliding_window": None,
        "use_sliding_window": False,
    }


def _no_fix(name: str, w: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp stores Qwen2 with the rotary halves as transformers has them (rope type NEOX).
    return w


# Gemma 3 keeps its attention layout out of the file: five sliding-window layers, then a global one,
# with separate rope bases for each kind.
_GEMMA3_GLOBAL_EVERY = 6
_GEMMA3_LOCAL_ROPE_THETA = 10000.0


def _gemma3_config(meta: Metadata, tied: bool) -> dict[str, Any]:
    config = _common_config(meta, tied)
    n_layers = config["num_hidden_layers"]
    layer_types = [
        "full_attention" if (i + 1) % _GEMMA3_GLOBAL_EVERY == 0 else "sliding_attention"
        for i in range(n_layers)
    ]
    eos = [config["eos_token_id"]]
    tokens = meta.get("tokenizer.ggml.tokens")
    if "<end_of_turn>" in tokens:
        eos.append(tokens.index("<end_of_turn>"))
    return {
        **config,
        "_sliding_window_pattern": _GEMMA3_GLOBAL_EVERY,
        "architectures": ["Gemma3ForCausalLM"],
        "attn_logit_softcapping": None,
        "eos_token_id": eos,
        "final_logit_softcapping": None,
        "hidden_activation": "gelu_pytorch_tanh",
        "layer_types": layer_types,
        "model_type": "gemma3_text",
        "query_pre_attn_scalar": config["head_dim"],
        "rope_parameters": {
            "full_attention": {
                "rope_theta": _f32(meta.arch_get("rope.freq_base", 1_000_000.0)),
                "rope_type": "default",
            },
            "sliding_attention": {"rope_theta": _GEMMA3_LOCAL_ROPE_THETA, "rope_type": "default"},
        },
        "sliding_window": int(meta.require("attention.sliding_window")),
        "use_bidirectional_attention": False,
    }


def _gemma3_fix(name: str, w: np.ndarray, config: dict[str, Any]) -> np.ndarray:
    # llama.cpp folds Gemma's (1 + w) RMSNorm scale into the stored weight; transformers adds the 1.
    if name.endswith("norm.weight"):
        w = w - 1.0
    return w


_ARCHS: dict[str, _Arch] = {
    "llama": _Arch(
        config=_llama_config,
        layer_tensors={
            **_ATTN_MLP,
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        fix_tensor=_llama_fix,
    ),
    "qwen2": _Arch(
        config=_qwen2_config,
        layer_tensors={
            **_ATTN_MLP,
            "attn_norm": "input_layernorm",
            "ffn_norm": "post_attention_layernorm",
        },
        fix_tensor=_no_fix,
    ),
    "gemma3": _Arch(
        config=_gemma3_config,
        layer_tensors={
            **_ATTN_MLP,
            "attn_q_norm": "self_attn.q_norm",
            "attn_k_norm": "self_attn.k_norm",
            "attn_norm": "input_layernorm",
            "post_attention_norm": "post_attention_layernorm",
            "ffn_norm": "pre_feedforward_layernorm",
            "post_ffw_norm": "post_feedforward_layernorm",
        },
        fix_tensor=_gemma3_fix,
        default_chat_template=GEMMA3_CHAT_TEMPLATE,
    ),
}


def _hf_tensor_name(gguf_name: str, layer_tensors: Mapping[str, str]) -> str:
    base, _, suffix = gguf_name.rpartition(".")
    parts = base.split(".")
    if parts[0] == "blk" and len(parts) == 3 and parts[2] in layer_tensors:
        return f"model.layers.{parts[1]}.{layer_tensors[parts[2]]}.{suffix}"
    if base in _GLOBAL_TENSORS:
        return f"{_GLOBAL_TENSORS[base]}.{suffix}"
    raise ValueError(f"no Hugging Face name for GGUF tensor {gguf_name!r}")


# Byte-level families that split text with their own regex before the merges apply: llama.cpp's
# name for it (tokenizer.ggml.pre) -> the pattern of the family's tokenizer.json.
_PRE_SPLIT = {
    "qwen2": (
        r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
        r"|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}


def _byte_level_tokenizer(meta: Metadata) -> Tokenizer:
    tokens: list[str] = meta.get("tokenizer.ggml.tokens")
    pre = meta.get("tokenizer.ggml.pre", "default")
    if pre not in ("default", "gpt2", "smollm", *_PRE_SPLIT):
        raise ValueError(f"unsupported GGUF byte-level pre-tokenizer {pre!r}")
    # Every byte-level token is spelled in the byte alphabet; one that is not gets respelled.
    alphabet = set(pre_tokenizers.ByteLevel.alphabet())
    spell = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    vocab = {
        (t if set(t) <= alphabet else "".join(p for p, _ in spell.pre_tokenize_str(t))): i
        for i, t in enumerate(tokens)
    }
    merges = [tuple(m.split(" ")) for m in meta.get("tokenizer.ggml.merges")]
    tok = Tokenizer(models.BPE(vocab, merges, continuing_subword_prefix="", end_of_word_suffix=""))
    if pre in _PRE_SPLIT:
        tok.normalizer = normalizers.NFC()
        tok.pre_tokenizer = pre_tokenizers.Sequence([
            pre_tokenizers.Split(Regex(_PRE_SPLIT[pre]), behavior="isolated"),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ])  # fmt: skip
    else:
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # A control token outside the byte alphabet is a llama.cpp mislabel, not a real token.
    _add_gguf_tokens(tok, meta, keep=lambda t: set(t) <= alphabet)
    return tok


def _vocab_merges(vocab: dict[str, int]) -> list[tuple[str, str]]:
    """BPE merges implied by a vocabulary that stores none.

    A token is reachable by merging any split of it into two vocabulary tokens. The merges are
    ranked by the token's id, its position in the file (Gemma's scores do not follow its merge
    order), and within one token the longer left part first, as transformers orders them.
    """
    merges = []
    for token in sorted(vocab, key=vocab.__getitem__):
        for k in range(len(token) - 1, 0, -1):
            left, right = token[:k], token[k:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def _gemma_tokenizer(meta: Metadata) -> Tokenizer:
    # Runs of spaces are stored as real spaces, but the normalizer turns text spaces into "▁"
    # before lookup.
    tokens = [
        "▁" * len(t) if " " in t and not t.strip() else t for t in meta.get("tokenizer.ggml.tokens")
    ]
    vocab = {t: i for i, t in enumerate(tokens)}
    unk_id = meta.get("tokenizer.ggml.unknown_token_id")
    tok = Tokenizer(
        models.BPE(
            vocab,
            _vocab_merges(vocab),
            unk_token=tokens[unk_id] if unk_id is not None else None,
            fuse_unk=True,
            byte_fallback=True,
        )
    )
    tok.normalizer = normalizers.Replace(" ", "▁")
    tok.pre_tokenizer = pre_tokenizers.Split(" ", behavior="merged_with_previous")
    tok.decoder = decoders.Sequence(
        [decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse()]
    )
    _add_gguf_tokens(tok, meta, keep=lambda t: t in vocab)
    return tok


def _add_gguf_tokens(tok: Tokenizer, meta: Metadata, keep: Callable[[str], bool]) -> None:
    """Control tokens become special added tokens, user-defined ones plain added tokens.

    Both must match whole in text (llama.cpp does so), or `<start_of_turn>` and `\\n\\n` would
    be cut into pieces.
    """
    tokens = meta.get("tokenizer.ggml.tokens")
    types = meta.get("tokenizer.ggml.token_type") or []
    vocab = tok.get_vocab()
    special, plain = [], []
    for token, kind in zip(tokens, types):
        if kind == _TOKEN_CONTROL and keep(token):
            special.append(AddedToken(token, special=True, normalized=False))
        elif kind == _TOKEN_USER_DEFINED and token in vocab:
            plain.append(AddedToken(token, special=False, normalized=False))
    tok.add_special_tokens(special)
    tok.add_tokens(plain)


def _set_bos_template(tok: Tokenizer, bos: str | None) -> None:
    if bos is None:
        tok.post_processor = processors.TemplateProcessing(single="$A:0", pair="$A:0 $B:1")
        return
    tok.post_processor = processors.TemplateProcessing(
        single=f"{bos}:0 $A:0",
        pair=f"{bos}:0 $A:0 {bos}:1 $B:1",
        special_tokens=[(bos, tok.token_to_id(bos))],
    )


def build_tokenizer(meta: Metadata) -> Tokenizer:
    """A `tokenizers.Tokenizer` equal to the one transformers builds from the same GGUF."""
    kind = meta.get("tokenizer.ggml.model")
    if kind == "gpt2":
        tok = _byte_level_tokenizer(meta)
    elif kind == "llama" and meta.arch == "gemma3":
        tok = _gemma_tokenizer(meta)
    else:
        raise ValueError(f"unsupported GGUF tokenizer {kind!r} for architecture {meta.arch!r}")
    tokens = meta.get("tokenizer.ggml.tokens")
    bos_id = meta.get("tokenizer.ggml.bos_token_id")
    add_bos = _add_bos(meta)
    _set_bos_template(tok, tokens[bos_id] if add_bos and bos_id is not None else None)
    return tok


def _add_bos(meta: Metadata) -> bool:
    # A sentencepiece vocabulary that does not say otherwise gets a BOS in llama.cpp.
    default = meta.get("tokenizer.ggml.model") == "llama"
    return bool(meta.get("tokenizer.ggml.add_bos_token", default))


def _token_name(meta: Metadata, key: str) -> str | None:
    token_id = meta.get(f"tokenizer.ggml.{key}")
    return None if token_id is None else meta.get("tokenizer.ggml.tokens")[token_id]


def _tokenizer_config(meta: Metadata, arch: _Arch, config: dict[str, Any]) -> dict[str, Any]:
    tokens = meta.get("tokenizer.ggml.tokens")
    out: dict[str, Any] = {
        "add_bos_token": _add_bos(meta),
        "add_eos_token": bool(meta.get("tokenizer.ggml.add_eos_token", False)),
        "bos_token": _token_name(meta, "bos_token_id"),
        "chat_template": meta.get("tokenizer.chat_template") or arch.default_chat_template,
        "clean_up_tokenization_spaces": False,
        "eos_token": _token_name(meta, "eos_token_id"),
        "model_max_length": config["max_position_embeddings"],
        "pad_token": _token_name(meta, "padding_token_id"),
        "tokenizer_class": "TokenizersBackend",
        "unk_token": _token_name(meta, "unknown_token_id"),
    }
    if meta.arch == "gemma3" and "<mask>" in tokens:
        out["mask_token"] = "<mask>"
    return {k: v for k, v in out.items() if v is not None}


def _generation_config(config: dict[str, Any]) -> dict[str, Any]:
    keys = ("bos_token_id", "eos_token_id", "pad_token_id")
    return {k: config[k] for k in keys if config.get(k) is not None}


def _write_json(path: Path, data: dict[str, Any]) -> None:
    path.write_text(json.dumps(data, indent=2, sort_keys=True, ensure_ascii=False) + "\n", "utf-8")


class _Reader(GGUFReader):
    """gguf-py's reader, parsing from a plain array view of its memory map: the reader takes
    one slice per value of the header, and slices of an ``np.memmap`` each run the subclass's
    finalizer (a 150k-token vocabulary: 8 s to read the header, 2 s this way). The fields and
    tensors are the same; their arrays are plain views of the same map."""

    def _get(self, offset, dtype, count=1, override_order=None):
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self._plain = self.data.view(np.ndarray)
        end = offset + np.dtype(dtype).itemsize * int(count)
        arr = plain[offset:end].view(dtype=dtype)[: int(count)]
        order = self.byte_order if override_order is None else override_order
        return arr.view(arr.dtype.newbyteorder(order))


def open_gguf(gguf_path: str | Path) -> GGUFReader:
    """The file's header and tensors (memory-mapped), read by gguf-py."""
    return _Reader(str(gguf_path))


def _open(gguf_path: str | Path) -> tuple[GGUFReader, Metadata, _Arch]:
    reader = open_gguf(gguf_path)
    meta = Metadata(reader)
    arch = _ARCHS.get(meta.arch)
    if arch is None:
        supported = ", ".join(sorted(_ARCHS))
        raise ValueError(f"unsupported GGUF architecture {meta.arch!r}; supported: {supported}")
    return reader, meta, arch


def _write_folder(
    gguf_path: str | Path, out_dir: str | Path, extras: Mapping[str, Any] | None
) -> tuple[GGUFReader, _Arch, dict[str, Any], Path]:
    """The folder's JSON files and tokenizer; returns what writing the weights needs."""
    reader, meta, arch = _open(gguf_path)
    tied = all(t.name != "output.weight" for t in reader.tensors)
    config = {**arch.config(meta, tied), **(extras or {})}
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    build_tokenizer(meta).save(str(out / "tokenizer.json"))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(meta, arch, config))
    _write_json(out / "generation_config.json", _generation_config(config))
    _write_json(out / "config.json", config)
    return reader, arch, config, out


def convert_gguf(
    gguf_path: str | Path,
    out_dir: str | Path,
    progress: bool = True,
    extras: Mapping[str, Any] | None = None,
) -> Path:
    """Write a Hugging Face folder for `gguf_path` into `out_dir` and return it.

    `extras` are config.json keys the file cannot express for this particular model; they are
    applied over what the file and the architecture defaults give.
    """
    reader, arch, config, out = _write_folder(gguf_path, out_dir, extras)
    tensors: dict[str, np.ndarray] = {}
    for t in tqdm(reader.tensors, desc="Converting tensors", unit="tensor", disable=not progress):
        w = dequantize(t.data, t.tensor_type).astype(np.float32, copy=False)
        w = arch.fix_tensor(t.name, w, config)
        tensors[_hf_tensor_name(t.name, arch.layer_tensors)] = np.ascontiguousarray(w)
    weights = out / "model.safetensors"
    save_file(tensors, str(weights), metadata={"format": "pt"})
    # safetensors leaves its file private (0600); a cache shared with a server running as another
    # user needs it readable like the JSON files beside it.
    weights.chmod(0o644)
    return out


def describe_gguf(
    gguf_path: str | Path, out_dir: str | Path, extras: Mapping[str, Any] | None = None
) -> Path:
    """Write the folder a GGUF file is served from, without converting its weights: the JSON
    files and tokenizer of ``convert_gguf`` and ``GGUF_LINK``, a link to the file, whose tensors
    the loader reads in their stored formats (``read_gguf_tensors``)."""
    _, _, _, out = _write_folder(gguf_path, out_dir, extras)
    link = out / GGUF_LINK
    link.unlink(missing_ok=True)
    link.symlink_to(Path(gguf_path).resolve())
    return out


GGUF_LINK = "model.gguf"


def read_gguf_tensors(gguf_path: str | Path, config: Mapping[str, Any]):
    """(transformers name, tensor) for every tensor of the file: a ``Weight`` in its block
    format where kernels compute on that format, else a float32 tensor (norms, biases, F16 and
    formats without a kernel, dequantized here with a log line saying so)."""
    reader, _, arch = _open(gguf_path)
    unconverted: dict[str, int] = {}
    for t in reader.tensors:
        name = _hf_tensor_name(t.name, arch.layer_tensors)
        fmt = t.tensor_type.name.lower()
        if fmt in FORMATS and fmt != "dense":
            data = arch.fix_tensor(t.name, np.array(t.data), config)
            yield name, Weight(torch.from_numpy(np.ascontiguousarray(data)), None, fmt)
            continue
        if t.tensor_type.name not in ("F32", "F16", "BF16"):
            unconverted[t.tensor_type.name] = unconverted.get(t.tensor_type.name, 0) + 1
        w = np.array(dequantize(t.data, t.tensor_type), dtype=np.float32)  # off the file's map
        yield name, torch.from_numpy(np.ascontiguousarray(arch.fix_tensor(t.name, w, config)))
    for kind, count in sorted(unconverted.items()):
        log.info("%d %s tensors of %s dequantized to float32 at load: no kernel computes on %s",
                 count, kind, Path(gguf_path).name, kind)  # fmt: skip

"""Architecture registry and loading of checkpoint folders: safetensors, or the GGUF file a
folder links to (``models.gguf_import.describe_gguf``), whose matrices stay in their block
formats: every linear layer (and embedding) whose checkpoint matrices come as block-format
``Weight``s becomes a ``kernels.quant.QuantLinear`` (``QuantEmbedding``) over them."""

from __future__ import annotations

import contextlib
import importlib
import math
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from kernels.quant import QuantEmbedding, QuantLinear, quantize
from kernels.weights import FORMATS, QUANTIZABLE, Weight
from models.config import ModelConfig
from models.interface import CausalLM
from models.layers import PackedLinear
from models.tensor_parallel import NO_TP, TPRank, all_reduce_row_outputs, shard_weights

ARCHITECTURES = {
    "LlamaForCausalLM": "models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "models.llama:LlamaForCausalLM",
    "Qwen2ForCausalLM": "models.llama:LlamaForCausalLM",
    "Gemma3ForCausalLM": "models.gemma3:Gemma3ForCausalLM",
    "DeepseekV3ForCausalLM": "models.deepseek_v3:DeepseekV3ForCausalLM",
}


def model_class(cfg: ModelConfig) -> type[CausalLM]:
    target = ARCHITECTURES.get(cfg.architecture)
    if target is None:
        supported = ", ".join(sorted(ARCHITECTURES))
        raise ValueError(f"architecture {cfg.architecture!r} is not supported ({supported})")
    module, name = target.split(":")
    return getattr(importlib.import_module(module), name)


def iter_safetensors(path: Path):
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no .safetensors files in {path}")
    for file in files:
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def stored_weight_bytes(cfg: ModelConfig, dtype_bytes: int, quantization: str | None = None) -> int:
    """Bytes the model's weights take once loaded, read from the checkpoint's headers: block
    formats at their stored size, float tensors at ``dtype_bytes`` per value, and with
    ``quantization`` the float matrices of linear layers in that format (an estimate: every
    2-D tensor but the embedding)."""
    from models.gguf_import import GGUF_LINK, open_gguf

    total = 0
    if (cfg.path / GGUF_LINK).exists():
        for t in open_gguf(cfg.path / GGUF_LINK).tensors:
            fmt = t.tensor_type.name.lower()
            total += int(t.n_bytes) if fmt in FORMATS else int(t.n_elements) * dtype_bytes
        return total
    for file in sorted(cfg.path.glob("*.safetensors")):
        with safe_open(file, framework="pt") as f:
            for name in f.keys():
                shape = f.get_slice(name).get_shape()
                numel = math.prod(shape)
                if quantization and len(shape) == 2 and "embed" not in name:
                    spec = FORMATS[quantization]
                    total += numel // spec.block * spec.block_bytes
                else:
                    total += numel * dtype_bytes
    return total


def iter_checkpoint(cfg: ModelConfig):
    """(name, tensor or block-format ``Weight``) of the folder's checkpoint."""
    from models.gguf_import import GGUF_LINK, read_gguf_tensors

    if (cfg.path / GGUF_LINK).exists():
        return read_gguf_tensors(cfg.path / GGUF_LINK, cfg.hf)
    return iter_safetensors(cfg.path)


@contextlib.contextmanager
def _uninitialized():
    """Linear and embedding weights left as allocated: the checkpoint overwrites or replaces
    every one, and filling gigabytes of floats with random values first costs seconds (and
    makes the pages of matrices about to be replaced by quantized ones resident)."""
    saved = {cls: cls.reset_parameters for cls in (nn.Linear, nn.Embedding)}
    try:
        for cls in saved:
            cls.reset_parameters = lambda self: None
        yield
    finally:
        for cls, reset in saved.items():
            cls.reset_parameters = reset


def load_model(
    cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    tp: TPRank = NO_TP,
    quantization: str | None = None,
) -> CausalLM:
    """Build the model for ``cfg`` (a rank's share: ``shard_config``) and fill it from the
    folder's checkpoint; ``quantization`` (a block format) stores its float linear layers in
    that format."""
    cls = model_class(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device), _uninitialized():
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    tensors = shard_weights(iter_checkpoint(cfg), tp)
    model.load_weights(place_quantized(model, tensors, device))
    if quantization is not None:
        quantize_linears(model, quantization)
    if tp.size > 1:
        all_reduce_row_outputs(model)
    _return_freed_memory()
    return model.eval()


def _return_freed_memory() -> None:
    """Hands the heap's free pages back to the system (glibc's malloc_trim). Loading copies
    every tensor once or twice (out of the file, then packed); glibc keeps the freed copies'
    pages, about half the weights' size (500 MB for Qwen2.5-Coder-1.5B), resident otherwise."""
    import ctypes
    import ctypes.util

    name = ctypes.util.find_library("c")
    try:
        trim = ctypes.CDLL(name).malloc_trim if name else None
    except (OSError, AttributeError):  # not glibc
        trim = None
    if trim is not None:
        trim(0)


def quantize_linears(model: nn.Module, fmt: str) -> None:
    """Every float nn.Linear of the model becomes a QuantLinear in ``fmt``."""
    if fmt not in QUANTIZABLE:
        raise ValueError(f"cannot quantize to {fmt!r}; it can be {', '.join(QUANTIZABLE)}")
    block = FORMATS[fmt].block
    for parent in list(model.modules()):
        for name, child in list(parent.named_children()):
            if type(child) not in (nn.Linear, PackedLinear):
                continue
            if child.in_features % block:
                raise ValueError(
                    f"{name} has {child.in_features} inputs, not a multiple of {fmt}'s blocks "
                    f"of {block}"
                )
            bias = None if child.bias is None else child.bias.detach().float()
            data = quantize(child.weight, fmt)
            setattr(parent, name, QuantLinear((Weight(data, bias, fmt),)))


def _module_of(model: nn.Module, name: str) -> tuple[str, int] | None:
    """The linear or embedding module a checkpoint matrix fills and its part there."""
    piece = packed_piece(model, name)
    if piece is not None:
        param, (rows,) = piece
        module = param.rpartition(".")[0]
        packed = model.get_submodule(module)
        return module, next(i for i in range(len(packed.out_sizes)) if packed.part(i) == rows)
    module = name.rpartition(".")[0]
    try:
        found = model.get_submodule(module)
    except AttributeError:
        return None
    return (module, 0) if isinstance(found, (nn.Linear, nn.Embedding)) else None


def _parts(weights: dict[int, Weight], biases: dict[int, torch.Tensor]) -> tuple[Weight, ...]:
    """A module's pieces in order, adjacent pieces of one format joined into one part."""
    parts: list[Weight] = []
    for i in sorted(weights):
        w = Weight(weights[i].data, biases.get(i), weights[i].format)
        if parts and parts[-1].format == w.format and (parts[-1].bias is None) == (w.bias is None):
            last = parts[-1]
            bias = None if w.bias is None else torch.cat([last.bias, w.bias])
            w = Weight(torch.cat([last.data, w.data]), bias, w.format)
            parts[-1] = w
        else:
            parts.append(w)
    return tuple(parts)


def place_quantized(model: nn.Module, tensors: Iterable, device: torch.device) -> list:
    """Swap each module that a block-format ``Weight`` fills for its quantized counterpart
    (its dense pieces and biases become parts of it); returns the tensors left for
    ``load_weights``. A tied LM head follows a quantized embedding."""
    tensors = list(tensors)
    quantized = {}
    for name, t in tensors:
        if isinstance(t, Weight) and t.format != "dense":
            where = _module_of(model, name)
            if where is None:
                raise ValueError(f"checkpoint tensor {name!r} has no place in the model")
            quantized[where[0]] = {}
    rest, pieces = [], {m: ({}, {}) for m in quantized}
    for name, t in tensors:
        where = _module_of(model, name)
        if where is None or where[0] not in quantized:
            rest.append((name, t))
            continue
        weights, biases = pieces[where[0]]
        if name.endswith(".bias"):
            biases[where[1]] = t.to(device)
        else:
            data = t if isinstance(t, Weight) else Weight(t)
            weights[where[1]] = Weight(data.data.to(device), None, data.format)
    for module, (weights, biases) in pieces.items():
        parent, _, child = module.rpartition(".")
        if isinstance(model.get_submodule(module), nn.Embedding):
            (weight,) = weights.values()
            replacement = QuantEmbedding(weight, model.get_submodule(module).weight.dtype)
        else:
            replacement = QuantLinear(_parts(weights, biases))
        setattr(model.get_submodule(parent) if parent else model, child, replacement)
    embed = model.get_submodule("model.embed_tokens") if hasattr(model, "model") else None
    head = getattr(model, "lm_head", None)
    if isinstance(embed, QuantEmbedding) and isinstance(head, nn.Linear):
        if model.config.get("tie_word_embeddings", False):
            model.lm_head = QuantLinear((embed.stored,))
    return rest


def packed_piece(model: nn.Module, name: str) -> tuple[str, tuple] | None:
    """Where a checkpoint tensor of a projection the model packs with others goes (its
    ``packed_modules_mapping``: ``q_proj`` -> part 0 of ``qkv_proj``): (parameter name, its
    rows), or None for a name that is not one."""
    mapping = getattr(model, "packed_modules_mapping", {})
    parts = name.split(".")
    if len(parts) < 2 or parts[-2] not in mapping:
        return None
    packed, index = mapping[parts[-2]]
    module_name = ".".join([*parts[:-2], packed])
    try:
        module = model.get_submodule(module_name)
    except AttributeError:
        return None
    return f"{module_name}.{parts[-1]}", (module.part(index),)


@torch.no_grad()
def load_by_name(model: nn.Module, weights, pieces=None) -> None:
    """Copy checkpoint tensors into parameters of the same name; every parameter must be set.

    ``pieces(name)`` places a checkpoint tensor that fills only part of a parameter (one expert
    of a stacked weight): it returns ``(parameter name, index)`` for such a name, ``index``
    taken of the parameter, or None for any other. Projections the model packs
    (``packed_piece``) are placed the same way, so q, k and v (gate and up) are fused once,
    here. A parameter filled in pieces is set once its pieces, each given once, add up to all
    of it."""
    params = dict(model.named_parameters())
    missing = set(params)
    tied = model.config.get("tie_word_embeddings", False)
    filled: dict[str, int] = {}  # elements written so far of parameters filled in pieces
    seen_pieces: set[str] = set()
    for name, tensor in weights:
        place = pieces(name) if pieces is not None else None
        if place is None:
            place = packed_piece(model, name)
        if place is not None:
            if name in seen_pieces:
                raise ValueError(f"checkpoint tensor {name!r} appears twice")
            seen_pieces.add(name)
            param_name, index = place
            target = params[param_name][index]
            filled[param_name] = filled.get(param_name, 0) + target.numel()
            if filled[param_name] == params[param_name].numel():
                missing.discard(param_name)
        elif name not in params:
            if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        else:
            target = params[name]
            missing.discard(name)
        if target.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint {tuple(tensor.shape)}, model {tuple(target.shape)}"
            )
        target.copy_(tensor)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")

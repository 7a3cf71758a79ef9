"""Architecture registry and safetensors loading of Hugging Face checkpoint folders."""

from __future__ import annotations

import importlib
from pathlib import Path

import torch
from safetensors import safe_open
from torch import nn

from models.config import ModelConfig
from models.interface import CausalLM
from models.tensor_parallel import NO_TP, TPRank, all_reduce_row_outputs, shard_weights

ARCHITECTURES = {
    "LlamaForCausalLM": "models.llama:LlamaForCausalLM",
    "MistralForCausalLM": "models.llama:LlamaForCausalLM",
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


def load_model(
    cfg: ModelConfig, dtype: torch.dtype, device: torch.device, tp: TPRank = NO_TP
) -> CausalLM:
    """Build the model for ``cfg`` (a rank's share: ``shard_config``) and fill it from the
    folder's safetensors files."""
    cls = model_class(cfg)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device(device):
            model = cls(cfg)
    finally:
        torch.set_default_dtype(previous)
    model.load_weights(shard_weights(iter_safetensors(cfg.path), tp))
    if tp.size > 1:
        all_reduce_row_outputs(model)
    return model.eval()


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

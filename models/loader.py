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


def load_by_name(model: nn.Module, weights) -> None:
    """Copy checkpoint tensors into parameters of the same name; every parameter must be set."""
    params = dict(model.named_parameters())
    missing = set(params)
    tied = model.config.get("tie_word_embeddings", False)
    for name, tensor in weights:
        if name not in params:
            if (tied and name == "lm_head.weight") or name.endswith("rotary_emb.inv_freq"):
                continue
            raise ValueError(f"checkpoint tensor {name!r} has no place in {type(model).__name__}")
        param = params[name]
        if param.shape != tensor.shape:
            raise ValueError(
                f"{name}: checkpoint {tuple(tensor.shape)}, model {tuple(param.shape)}"
            )
        with torch.no_grad():
            param.copy_(tensor)
        missing.discard(name)
    if missing:
        raise ValueError(f"checkpoint lacks {sorted(missing)[:5]} ({len(missing)} tensors)")

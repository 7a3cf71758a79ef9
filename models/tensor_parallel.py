"""Tensor parallelism for the GQA/MHA layouts (Llama family, Gemma 3): each of N ranks holds
1/N of the attention heads (query and KV) and of the MLP's columns; the attention output and
MLP down projections are row-parallel, their partial sums all-reduced over torch.distributed.
Embeddings, norms and the LM head are replicated.

A rank builds its model from ``shard_config`` (the per-rank head and MLP sizes, so every module
and the KV cache come out at the rank's shape) and loads ``shard_weights`` of the checkpoint.
Heads must divide by N: a model whose query or KV heads do not (SmolLM2: 9 and 3 over 2 ranks)
is refused with the sizes that work, rather than padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch import nn

from models.config import ModelConfig

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Gemma3ForCausalLM")
COLUMN = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")  # output features split
ROW = ("o_proj", "down_proj")  # input features split; outputs all-reduced


@dataclass(frozen=True)
class TPRank:
    rank: int
    size: int


NO_TP = TPRank(0, 1)


def check(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError when ``cfg`` cannot be split over ``size`` ranks, saying why."""
    if size == 1:
        return
    if cfg.architecture not in SUPPORTED:
        raise ValueError(
            f"tensor parallelism supports {', '.join(SUPPORTED)}; not {cfg.architecture}"
        )
    heads, kv = cfg.num_heads, cfg.num_kv_heads
    if heads % size or kv % size or cfg.hf["intermediate_size"] % size:
        fits = [n for n in range(1, kv + 1) if heads % n == 0 and kv % n == 0]
        raise ValueError(
            f"{heads} attention heads and {kv} KV heads do not divide over {size} ranks; "
            f"--tensor-parallel-size can be {', '.join(map(str, fits))} for this model"
        )


def shard_config(cfg: ModelConfig, tp: TPRank) -> ModelConfig:
    """The config a rank builds: its share of the heads and of the MLP, same head size."""
    if tp.size == 1:
        return cfg
    check(cfg, tp.size)
    hf = dict(cfg.hf)
    hf.update(
        head_dim=cfg.head_dim,
        num_attention_heads=cfg.num_heads // tp.size,
        num_key_value_heads=cfg.num_kv_heads // tp.size,
        intermediate_size=cfg.hf["intermediate_size"] // tp.size,
    )
    return ModelConfig(cfg.path, MappingProxyType(hf))


def shard_weights(weights, tp: TPRank):
    """The checkpoint's tensors as rank ``tp.rank`` holds them."""
    for name, tensor in weights:
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if tp.size > 1 and module in COLUMN:
            tensor = tensor.chunk(tp.size, dim=0)[tp.rank]
        elif tp.size > 1 and module in ROW:
            if parts[-1] == "weight":
                tensor = tensor.chunk(tp.size, dim=1)[tp.rank]
            elif tp.rank:  # a bias is added once, by rank 0
                tensor = torch.zeros_like(tensor)
        yield name, tensor.contiguous()


def all_reduce_row_outputs(model: nn.Module) -> None:
    """Sum the row-parallel projections' partial outputs over the ranks."""

    def reduce(module, inputs, output):
        dist.all_reduce(output)
        return output

    for name, module in model.named_modules():
        if name.rsplit(".", 1)[-1] in ROW:
            module.register_forward_hook(reduce)

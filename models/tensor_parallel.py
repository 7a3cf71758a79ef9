"""Tensor parallelism: each of N ranks holds 1/N of every layer's attention heads and MLP
columns; the attention output and MLP down projections are row-parallel, their partial sums
all-reduced over torch.distributed. Embeddings, norms and the LM head are replicated.

Per layout:

- GQA/MHA (Llama family, Gemma 3): query and KV heads split, so a rank caches 1/N of the K/V.
- MLA (DeepSeek-V3): the query heads (``q_proj`` / ``q_b_proj`` outputs) and ``kv_b_proj``'s
  per-head up-projections split by head; the compressed latent (``q_a_proj``,
  ``kv_a_proj_with_mqa``, their norms, the rotary key) is replicated. One latent serves every
  head, so every rank caches all of it: MLA's KV bytes per rank do not shrink with N.
- Mixture of experts: each expert's (and the shared experts') intermediate columns split as a
  dense MLP's; the router is replicated, so every rank picks the same experts, and the block's
  combined output is all-reduced once rather than once per expert.

A rank builds its model from ``shard_config`` (the per-rank head and MLP sizes, so every module
and the KV cache come out at the rank's shape) and loads ``shard_weights`` of the checkpoint.
Sharding reads the checkpoint's own tensors, q, k and v (gate and up) each split on its own,
before the loader packs them (``models.loader.packed_piece``): a rank's ``qkv_proj`` is its
query heads, then its KV heads' keys, then their values; its ``gate_up_proj`` its gate columns,
then the same up columns.
Heads must divide by N: a model whose query or KV heads do not (SmolLM2: 9 and 3 over 2 ranks)
is refused with the sizes that work, rather than padded.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import MappingProxyType

import torch
import torch.distributed as dist
from torch import nn

from kernels.weights import FORMATS, Weight
from models.config import ModelConfig

GQA = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Gemma3ForCausalLM")
MLA = ("DeepseekV3ForCausalLM",)
SUPPORTED = GQA + MLA
# Output features split (every one lays its heads or columns out contiguously); checkpoint names.
COLUMN = ("q_proj", "k_proj", "v_proj", "q_b_proj", "kv_b_proj", "gate_proj", "up_proj")
ROW = ("o_proj", "down_proj")  # input features split; outputs all-reduced
EXPERTS = ("experts", "shared_experts")  # a module holding these is reduced once, after them
WORDS = {
    "num_attention_heads": "attention heads",
    "num_key_value_heads": "KV heads",
    "intermediate_size": "MLP columns",
    "moe_intermediate_size": "expert MLP columns",
}


@dataclass(frozen=True)
class TPRank:
    rank: int
    size: int


NO_TP = TPRank(0, 1)


def split_sizes(cfg: ModelConfig) -> dict[str, int]:
    """The config.json fields of which each rank holds 1/N, with their full values."""
    sizes = {"num_attention_heads": cfg.num_heads}
    if cfg.architecture in GQA:
        sizes["num_key_value_heads"] = cfg.num_kv_heads
    sizes["intermediate_size"] = cfg.hf["intermediate_size"]
    if cfg.architecture in MLA:
        sizes["moe_intermediate_size"] = cfg.hf["moe_intermediate_size"]
    return sizes


def check(cfg: ModelConfig, size: int) -> None:
    """Raises ValueError when ``cfg`` cannot be split over ``size`` ranks, saying why."""
    if size == 1:
        return
    if cfg.architecture not in SUPPORTED:
        raise ValueError(
            f"tensor parallelism supports {', '.join(SUPPORTED)}; not {cfg.architecture}"
        )
    sizes = split_sizes(cfg)
    bad = [f"{n} {WORDS[key]}" for key, n in sizes.items() if n % size]
    if bad:
        fits = [
            n for n in range(1, min(sizes.values()) + 1) if all(v % n == 0 for v in sizes.values())
        ]
        what = bad[0] if len(bad) == 1 else f"{', '.join(bad[:-1])} and {bad[-1]}"
        raise ValueError(
            f"{what} do not divide over {size} ranks; "
            f"--tensor-parallel-size can be {', '.join(map(str, fits))} for this model"
        )


def shard_config(cfg: ModelConfig, tp: TPRank) -> ModelConfig:
    """The config a rank builds: its share of the heads and of the MLPs, same head size (and,
    for MLA, the same latent)."""
    if tp.size == 1:
        return cfg
    check(cfg, tp.size)
    hf = dict(cfg.hf)
    hf["head_dim"] = cfg.head_dim
    hf.update({key: n // tp.size for key, n in split_sizes(cfg).items()})
    return ModelConfig(cfg.path, MappingProxyType(hf))


def _shard_blocks(name: str, w: Weight, tp: TPRank) -> Weight:
    """A block-format matrix's share: output rows split anywhere, input features only on block
    boundaries (a block's values share its scales)."""
    module = name.split(".")[-2]
    if module in COLUMN:
        return Weight(w.data.chunk(tp.size, dim=0)[tp.rank].contiguous(), w.bias, w.format)
    block = FORMATS[w.format].block
    if w.in_features % (block * tp.size):
        fits = [n for n in range(1, w.in_features // block + 1) if w.in_features % (block * n) == 0]
        raise ValueError(
            f"{name} is {w.format} with {w.in_features} inputs in blocks of {block}: they do not "
            f"split over {tp.size} ranks; --tensor-parallel-size can be "
            f"{', '.join(map(str, fits[:8]))} for this model"
        )
    return Weight(w.data.chunk(tp.size, dim=1)[tp.rank].contiguous(), w.bias, w.format)


def shard_weights(weights, tp: TPRank):
    """The checkpoint's tensors as rank ``tp.rank`` holds them."""
    for name, tensor in weights:
        parts = name.split(".")
        module = parts[-2] if len(parts) > 1 else ""
        if isinstance(tensor, Weight):
            if tp.size > 1 and module in COLUMN + ROW:
                tensor = _shard_blocks(name, tensor, tp)
            yield name, tensor
            continue
        if tp.size > 1 and module in COLUMN:
            tensor = tensor.chunk(tp.size, dim=0)[tp.rank]
        elif tp.size > 1 and module in ROW:
            if parts[-1] == "weight":
                tensor = tensor.chunk(tp.size, dim=1)[tp.rank]
            elif tp.rank:  # a bias is added once, by rank 0
                tensor = torch.zeros_like(tensor)
        yield name, tensor.contiguous()


def reduced_modules(model: nn.Module) -> list[str]:
    """The modules whose outputs are partial sums over the ranks: row-parallel projections
    outside mixtures of experts, and each mixture of experts as a whole."""
    names = []
    for name, module in model.named_modules():
        parts = name.split(".")
        if any(p in EXPERTS for p in parts):
            continue
        if parts[-1] in ROW or any(hasattr(module, e) for e in EXPERTS):
            names.append(name)
    return names


def all_reduce_row_outputs(model: nn.Module) -> None:
    """Sum the partial outputs of ``reduced_modules`` over the ranks."""

    def reduce(module, inputs, output):
        dist.all_reduce(output)
        return output

    for name in reduced_modules(model):
        model.get_submodule(name).register_forward_hook(reduce)

"""Projections that read the same input are packed once, when the checkpoint is loaded: q, k and
v into ``qkv_proj``, gate and up into ``gate_up_proj`` (``packed_modules_mapping``), whole or as
a tensor-parallel rank's share of each part. The oracle is the checkpoint's own tensors."""

from __future__ import annotations

import pytest
import torch

from models.config import ModelConfig
from models.loader import iter_safetensors, load_model, model_class
from models.tensor_parallel import NO_TP, TPRank, shard_config
from tests.helpers import save_tiny_llama

pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A tiny Llama with biased q, k, v (4 query heads, 2 KV heads) and its tensors by name."""
    path = tmp_path_factory.mktemp("tiny-llama-biased")
    save_tiny_llama(path, attention_bias=True)
    return path, dict(iter_safetensors(path))


def _rows(tensor: torch.Tensor, tp: TPRank) -> torch.Tensor:
    return tensor.chunk(tp.size, dim=0)[tp.rank]


# Per packed module: its block, its checkpoint parts in order, the tensors it packs.
PACKED = [
    ("self_attn", "qkv_proj", ("q_proj", "k_proj", "v_proj"), ("weight", "bias")),
    ("mlp", "gate_up_proj", ("gate_proj", "up_proj"), ("weight",)),
]


@pytest.mark.parametrize("tp", [NO_TP, TPRank(0, 2), TPRank(1, 2)], ids=str)
def test_packed_weights_are_the_checkpoint_parts_each_sharded_then_side_by_side(checkpoint, tp):
    path, tensors = checkpoint
    cfg = shard_config(ModelConfig.from_dir(path), tp)
    model = load_model(cfg, torch.float32, torch.device("cpu"), tp)
    for i, layer in enumerate(model.model.layers):
        for block, packed, parts, kinds in PACKED:
            module = layer.get_submodule(f"{block}.{packed}")
            for kind in kinds:
                names = [f"model.layers.{i}.{block}.{part}.{kind}" for part in parts]
                expected = torch.cat([_rows(tensors[n], tp) for n in names])
                assert torch.equal(getattr(module, kind), expected), (i, packed, kind)


def test_a_checkpoint_lacking_one_part_or_giving_one_twice_is_refused(checkpoint):
    path, tensors = checkpoint
    cfg = ModelConfig.from_dir(path)
    gone = "model.layers.1.self_attn.k_proj.weight"
    with pytest.raises(ValueError, match=r"lacks \['model.layers.1.self_attn.qkv_proj.weight'\]"):
        model_class(cfg)(cfg).load_weights((n, t) for n, t in tensors.items() if n != gone)
    again = "model.layers.0.mlp.up_proj.weight"
    with pytest.raises(ValueError, match="appears twice"):
        model_class(cfg)(cfg).load_weights([*tensors.items(), (again, tensors[again])])

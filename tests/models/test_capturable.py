"""The decode forward of every model a CUDA graph can capture, checked on CPU: each model runs a
decode step of every captured batch size on the meta device (no data) under a dispatch mode
that fails on whatever would sync with the host (``.item()``, ``.tolist()``, ``bool(t)``), on
shapes that depend on values (nonzero, unique, masked_select, ...), and on tensors built from
host data or copied to the host."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from engine.worker.cuda_graphs import BATCH_SIZES
from kernels.backend import AttentionBackend, AttentionMetadata
from kernels.paged import ForwardContext
from models import deepseek_v3
from models.config import ModelConfig
from models.deepseek_v3 import GATHER_MAX_TOKENS
from models.kv_spec import MLASpec
from models.loader import model_class
from tests.helpers import TINY_DEEPSEEK_V3, TINY_GEMMA3, TINY_LLAMA, naive_loop_moe

transformers = pytest.importorskip("transformers")

aten = torch.ops.aten
# Ops whose result the host must read (a sync), or whose output shape depends on the values.
SYNCING = {
    aten._local_scalar_dense,  # .item(), float(t), int(t), bool(t)
    aten.is_nonzero,
    aten.equal,
    aten.allclose,
    aten.nonzero,
    aten.nonzero_static,
    aten.argwhere,
    aten._unique,
    aten._unique2,
    aten.unique_dim,
    aten.unique_consecutive,
    aten.masked_select,
    aten.bincount,
    aten._assert_async,
}


def value_dependent(func, kwargs) -> bool:
    """Whether ``func`` syncs, or sizes its output by the values of its inputs."""
    if func.overloadpacket is aten.repeat_interleave:  # repeats given as a tensor
        return kwargs.get("output_size") is None
    return func.overloadpacket in SYNCING


class HostSyncError(AssertionError):
    pass


class NoHostSync(TorchDispatchMode):
    """Fails on an op that syncs with the host or has a value-dependent output shape, and on
    any tensor or device that is not ``meta`` (a tensor built from host data, a copy to the
    host: ``.tolist()``, ``.cpu()``). Runs on meta tensors, so nothing reads data either."""

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if value_dependent(func, kwargs):
            raise HostSyncError(f"{func} syncs with the host or has a value-dependent shape")
        for leaf in tree_leaves((args, kwargs)):
            device = leaf.device if isinstance(leaf, torch.Tensor) else leaf
            if isinstance(device, torch.device) and device.type != "meta":
                raise HostSyncError(f"{func} on a {device.type} tensor or device")
        return func(*args, **kwargs)


class CachelessBackend(AttentionBackend):
    """Decode attention without a cache: the output is the query's first Dv columns. Enough to
    run the model's side of a decode step; the real backends say themselves whether they can be
    captured (``AttentionBackend.capturable``)."""

    name = "cacheless"

    def write_cache(self, cache, rows, slots):
        pass

    def prefill(self, *args):
        raise NotImplementedError("decode steps only")

    def decode(self, q, kv_cache, meta, scale, scores=None):
        return q[..., : kv_cache[1].shape[-1]].clone()

    def rotate_keys(self, cache, blocks, delta, layout):
        raise NotImplementedError


def decode_context(model, cfg: ModelConfig, batch: int) -> ForwardContext:
    """A decode step of ``batch`` sequences, one new token each, every tensor on meta."""
    groups = model.kv_cache_groups(cfg, "float32")
    meta = dict(device="meta", dtype=torch.int32)
    metadata = [
        AttentionMetadata(
            slot_mapping=torch.empty(batch, device="meta", dtype=torch.long),
            block_tables=torch.empty(batch, 4, **meta),
            seq_lens=torch.empty(batch, **meta),
            prefix_lens=torch.empty(batch, **meta),
            cu_seqlens_q=torch.empty(batch + 1, **meta),
            num_decodes=batch,
            window=g.spec.window,
        )
        for g in groups
    ]
    caches, layer_to_group = {}, {}
    for gi, g in enumerate(groups):
        for layer in g.layer_ids:
            layer_to_group[layer] = gi
            if isinstance(g.spec, MLASpec):
                k = torch.empty(8, 16, 1, g.spec.row_width, device="meta")
                caches[layer] = (k, k[..., : g.spec.kv_lora_rank])
            else:
                shape = (8, 16, g.spec.num_kv_heads, g.spec.head_dim)
                caches[layer] = (torch.empty(shape, device="meta"),) * 2
    n = len(caches)
    return ForwardContext(
        CachelessBackend(),
        metadata,
        [caches[i] for i in range(n)],
        tuple(layer_to_group[i] for i in range(n)),
    )


# Per architecture: its transformers config class and the tiny fields the other tests use.
TINY = {
    "LlamaForCausalLM": ("LlamaConfig", TINY_LLAMA),
    "Gemma3ForCausalLM": (
        "Gemma3TextConfig",
        {"num_hidden_layers": len(TINY_GEMMA3["layer_types"]), **TINY_GEMMA3},
    ),
    "DeepseekV3ForCausalLM": ("DeepseekV3Config", TINY_DEEPSEEK_V3),
}


def tiny_config(tmp_path, architecture: str) -> ModelConfig:
    """The config.json of the tiny model, as the engine reads it."""
    config_class, fields = TINY[architecture]
    getattr(transformers, config_class)(architectures=[architecture], **fields).save_pretrained(
        tmp_path
    )
    return ModelConfig.from_dir(tmp_path)


def build_on_meta(cfg: ModelConfig, dtype: torch.dtype):
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with torch.device("meta"):
            return model_class(cfg)(cfg).eval()
    finally:
        torch.set_default_dtype(previous)


def decode_step(model, cfg: ModelConfig, batch: int) -> torch.Tensor:
    """A decode step of ``batch`` sequences under ``NoHostSync`` -> hidden states."""
    ids = torch.empty(batch, dtype=torch.long, device="meta")
    positions = torch.empty(batch, dtype=torch.long, device="meta")
    ctx = decode_context(model, cfg, batch)
    with torch.inference_mode(), NoHostSync():
        return model(ids, positions, ctx)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("architecture", list(TINY))
def test_decode_forward_makes_no_host_sync_at_any_captured_batch_size(
    tmp_path, architecture, dtype
):
    cfg = tiny_config(tmp_path, architecture)
    model = build_on_meta(cfg, dtype)
    assert model.cuda_graphs
    for batch in BATCH_SIZES:
        hidden = decode_step(model, cfg, batch)
        assert hidden.shape == (batch, cfg.hidden_size) and hidden.dtype == dtype


def test_every_captured_decode_batch_takes_the_gathered_moe_path():
    assert max(BATCH_SIZES) <= GATHER_MAX_TOKENS


@pytest.mark.parametrize(
    "fails",
    [
        lambda x: x.sum().item(),
        lambda x: x.tolist(),
        lambda x: bool((x > 0).any()),
        lambda x: x.unique(),
        lambda x: torch.where(x > 0),
        lambda x: x * torch.tensor(2.0),
        lambda x: x.cpu(),
        lambda x: x.repeat_interleave(torch.full((4,), 2, device="meta"), dim=0),
    ],
)
def test_the_check_fails_on_host_syncs_and_host_data(fails):
    x = torch.empty(4, 8, device="meta")
    with pytest.raises(HostSyncError), NoHostSync():
        fails(x)


def test_the_check_fails_on_the_per_expert_loop_and_on_the_grouped_moe(tmp_path, monkeypatch):
    cfg = tiny_config(tmp_path, "DeepseekV3ForCausalLM")
    model = build_on_meta(cfg, torch.float32)
    moe = model.model.layers[-1].mlp
    with pytest.raises(HostSyncError, match="unique"), NoHostSync():
        naive_loop_moe(moe, torch.empty(3, cfg.hidden_size, device="meta"))
    monkeypatch.setattr(deepseek_v3, "GATHER_MAX_TOKENS", 0)
    with pytest.raises(HostSyncError, match="bincount"):
        decode_step(model, cfg, 3)

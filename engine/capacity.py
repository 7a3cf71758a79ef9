"""What a KV cache holds: per group, bytes per token, blocks, token slots and full-length
sequences. The engine logs this table at start-up and ``kvserve plan`` prints it from a
config.json alone (no weights), both from the same ``CacheConfig``, so the numbers agree."""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.config import GIB, CacheConfig, split_memory
from engine.worker.config import auto_kv_dtype, cache_groups
from engine.worker.disk_tier import disk_pool_sizes
from models.config import ModelConfig
from models.fetch import resolve_model
from models.kv_spec import MLASpec
from models.loader import model_class, stored_weight_bytes
from models.tensor_parallel import TPRank, shard_config


@dataclass(frozen=True)
class GroupCapacity:
    kind: str
    dtype: str
    num_layers: int
    bytes_per_token: int
    num_blocks: int
    tokens: int  # token slots in the pool
    max_seqs_at_full_len: int  # sequences of max_model_len that fit at once


def capacity(cache: CacheConfig, max_model_len: int) -> list[GroupCapacity]:
    rows = []
    for g, n in zip(cache.groups, cache.num_blocks):
        kind = "RecentTokens" if g.recent else type(g.spec).__name__
        if g.spec.window:
            kind += f"(window={g.spec.window})"
        rows.append(
            GroupCapacity(
                kind=kind,
                dtype=g.spec.dtype,
                num_layers=len(g.layer_ids),
                bytes_per_token=g.bytes_per_token,
                num_blocks=n,
                tokens=n * cache.block_size,
                max_seqs_at_full_len=n // max(1, cache.blocks_per_seq(g, max_model_len)),
            )
        )
    return rows


def format_capacity(cache: CacheConfig, max_model_len: int) -> str:
    lines = [
        f"{'group':<32} {'dtype':>9} {'layers':>6} {'bytes/token':>12} {'blocks':>8} "
        f"{'tokens':>10} {'seqs@' + str(max_model_len):>10}"
    ]
    for r in capacity(cache, max_model_len):
        lines.append(
            f"{r.kind:<32} {r.dtype:>9} {r.num_layers:>6} {r.bytes_per_token:>12,} "
            f"{r.num_blocks:>8} {r.tokens:>10,} {r.max_seqs_at_full_len:>10}"
        )
    # The lower tiers: host memory (the swap pool shares it), then disk files.
    tiers = [("host tier", cache.num_host_blocks if cache.host_tier else ()),
             ("disk tier", cache.num_disk_blocks)]  # fmt: skip
    for name, blocks in tiers:
        for g, n in zip(cache.groups, blocks):
            kind = f"{type(g.spec).__name__} ({name})"
            lines.append(
                f"{kind:<32} {g.spec.dtype:>9} {len(g.layer_ids):>6} {g.bytes_per_token:>12,} "
                f"{n:>8} {n * cache.block_size:>10,} {'':>10}"
            )
    return "\n".join(lines)


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    dtype: str  # the KV cache's
    memory_bytes: int
    max_model_len: int
    cache: CacheConfig
    tensor_parallel_size: int = 1  # memory and cache are one rank's
    weight_bytes: int = 0  # all ranks together, as stored once loaded

    @property
    def rows(self) -> list[GroupCapacity]:
        return capacity(self.cache, self.max_model_len)

    @property
    def bytes_per_token(self) -> int:
        """All layers together, for a token inside every window."""
        return sum(g.bytes_per_token for g in self.cache.groups)

    @property
    def bytes_per_full_sequence(self) -> int:
        """What one max_model_len sequence holds; window groups stop growing at their ring."""
        c = self.cache
        return sum(c.blocks_per_seq(g, self.max_model_len) * c.bytes_per_block(g) for g in c.groups)


def make_plan(
    model: str,
    kv_cache_memory_gib: float,
    max_model_len: int | None = None,
    block_size: int = 16,
    dtype: str = "bfloat16",
    tensor_parallel_size: int = 1,
    weight_dtype: str = "float32",
    quantization: str | None = None,
    kv_cache_dtype: str | None = None,
    kv_skip_sliding: bool = False,
    kv_recent_tokens: int = 0,
    kv_host_cache_gib: float = 0.0,
    kv_disk_cache_gib: float = 0.0,
) -> Plan:
    """With tensor parallelism, one rank's plan: its share of the KV heads in its memory (for
    MLA, the whole latent cache: every rank holds it)."""
    cfg = ModelConfig.from_dir(resolve_model(model))
    rank_cfg = shard_config(cfg, TPRank(0, tensor_parallel_size))
    kv_dtype = kv_cache_dtype or auto_kv_dtype(dtype)
    groups = cache_groups(model_class(cfg), rank_cfg, kv_dtype, dtype, kv_skip_sliding,
                          kv_recent_tokens)  # fmt: skip
    max_len = max_model_len or cfg.max_position_embeddings
    memory = int(kv_cache_memory_gib * GIB)
    blocks = split_memory(groups, memory, block_size, max_len)
    tier = kv_host_cache_gib > 0
    host = split_memory(groups, int(kv_host_cache_gib * GIB), block_size, max_len) if tier else ()
    disk = ()
    if tier and kv_disk_cache_gib > 0:
        disk = disk_pool_sizes(groups, kv_disk_cache_gib, block_size, max_len)
    cache = CacheConfig(groups, block_size, blocks, host, tier, tier, disk)
    weights = stored_weight_bytes(cfg, 4 if weight_dtype == "float32" else 2, quantization)
    return Plan(cfg, kv_dtype, memory, max_len, cache, tensor_parallel_size, weights)


def format_plan(plan: Plan) -> str:
    header = (
        f"model {plan.model.name} ({plan.model.architecture}), {plan.dtype} KV cache of "
        f"{plan.memory_bytes / GIB:g} GiB, block size {plan.cache.block_size}, "
        f"max_model_len {plan.max_model_len}"
    )
    if plan.tensor_parallel_size > 1:
        n = plan.tensor_parallel_size
        if any(isinstance(g.spec, MLASpec) for g in plan.cache.groups):
            header += f"; per rank of {n} (each holds the whole latent cache, shared by all heads)"
        else:
            header += f"; per rank of {n} (each holds 1/{n} of the KV heads)"
    layout = " + ".join(
        f"{len(g.layer_ids)} x {g.spec.bytes_per_token:,} {type(g.spec).__name__}"
        for g in plan.cache.groups
    )
    summary = (
        f"bytes/token: {plan.bytes_per_token:,} ({layout}); one {plan.max_model_len}-token "
        f"sequence holds {plan.bytes_per_full_sequence / (1 << 20):,.1f} MiB"
    )
    weights = f"weights: {plan.weight_bytes / (1 << 20):,.1f} MiB as stored once loaded" + (
        " (all ranks together)" if plan.tensor_parallel_size > 1 else ""
    )
    return "\n".join([header, format_capacity(plan.cache, plan.max_model_len), summary, weights])

"""`kvserve plan`: what a KV-cache budget holds for a model, from its config.json alone.

No weights are read: the model class says how its layers group into cache layouts
(``kv_cache_groups``), and ``engine.capacity`` splits the memory and counts blocks exactly as
the engine does at start-up, so the numbers here are the ones the server will log.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from engine.capacity import GIB, GroupCapacity, capacity, format_capacity, split_memory
from engine.config import EngineArgs, ModelConfig
from engine.kv_spec import KVCacheGroup
from models.fetch import resolve_model
from models.loader import model_class

DTYPES = ("float32", "bfloat16", "float16")


@dataclass(frozen=True)
class Plan:
    model: ModelConfig
    dtype: str
    memory_bytes: int
    block_size: int
    max_model_len: int
    groups: list[KVCacheGroup]
    rows: list[GroupCapacity]

    @property
    def bytes_per_token(self) -> int:
        """All layers together, for a token inside every window."""
        return sum(g.bytes_per_token for g in self.groups)

    @property
    def bytes_per_full_sequence(self) -> int:
        """What one max_model_len sequence holds; window groups stop growing at their ring."""
        return sum(
            g.spec.num_blocks(self.max_model_len, self.block_size)
            * g.bytes_per_block(self.block_size)
            for g in self.groups
        )


def make_plan(
    model: str,
    kv_cache_memory_gib: float,
    max_model_len: int | None = None,
    block_size: int = 16,
    dtype: str = "bfloat16",
) -> Plan:
    cfg = ModelConfig.from_dir(resolve_model(model))
    groups = model_class(cfg).kv_cache_groups(cfg, dtype)
    max_len = max_model_len or cfg.max_position_embeddings
    memory = int(kv_cache_memory_gib * GIB)
    num_blocks = split_memory(groups, memory, block_size, max_len)
    rows = capacity(groups, num_blocks, block_size, max_len)
    return Plan(cfg, dtype, memory, block_size, max_len, groups, rows)


def summary(plan: Plan) -> str:
    layout = " + ".join(
        f"{len(g.layer_ids)} x {g.spec.bytes_per_token:,} {type(g.spec).__name__}"
        for g in plan.groups
    )
    return (
        f"bytes/token: {plan.bytes_per_token:,} ({layout}); one {plan.max_model_len}-token "
        f"sequence holds {plan.bytes_per_full_sequence / (1 << 20):,.1f} MiB"
    )


def format_plan(plan: Plan) -> str:
    header = (
        f"model {plan.model.name} ({plan.model.architecture}), {plan.dtype} KV cache of "
        f"{plan.memory_bytes / GIB:g} GiB, block size {plan.block_size}, "
        f"max_model_len {plan.max_model_len}"
    )
    return "\n".join([header, format_capacity(plan.rows, plan.max_model_len), summary(plan)])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="kvserve plan", description=__doc__.splitlines()[0])
    parser.add_argument("--model", required=True, help="model folder, or an alias from `fetch`")
    parser.add_argument(
        "--kv-cache-memory", type=float, required=True, metavar="GIB", help="KV cache size in GiB"
    )
    parser.add_argument("--max-model-len", type=int, default=None, help="default: trained context")
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block")
    parser.add_argument(
        "--dtype", choices=DTYPES, default="bfloat16", help="KV cache dtype (default: bfloat16)"
    )
    return parser


def main(argv: list[str]) -> int:
    parser = build_parser()
    ns = parser.parse_args(argv)
    try:
        # The same checks the engine applies to these flags.
        EngineArgs(
            model=ns.model,
            dtype=ns.dtype,
            block_size=ns.block_size,
            kv_cache_memory_gib=ns.kv_cache_memory,
            max_model_len=ns.max_model_len,
        )
        plan = make_plan(ns.model, ns.kv_cache_memory, ns.max_model_len, ns.block_size, ns.dtype)
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    print(format_plan(plan))
    return 0

"""Kernels one decode step launches on the CUDA path, per decoder layer, counted without a GPU.

    python -m bench.kernel_count [--models smollm2-135m ...] [--batch 1] [--context 1024]
        [--out PREFIX]

Each model is built on the meta device in bfloat16 at its real shape (random weights: nothing
is allocated) and runs one decode step through the serving code path: its forward over the
``triton`` attention backend, whose launches are collected instead of run (the kernels of the
``kernels.triton_attention`` package and ``kernels.triton_quant``), under a dispatch mode that
counts every torch operator reaching the device except views and metadata (each launches at
least one CUDA kernel there). Hooks on the decoder layers split the count into what each layer
launches and what runs outside them (embedding, rotary tables, final norm). On an H100
torch.profiler counted 44 kernels per SmolLM2 layer in eager bf16 decode
(../shared/gpu-h100-2026-11-26).
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from datetime import datetime, timezone
from pathlib import Path
from types import MappingProxyType

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from bench.decode_step import SHAPES
from kernels.backend import AttentionBackend, TritonBackend

# Operators that launch nothing on the device: views, metadata, allocation.
NO_KERNEL = frozenset({
    "view", "_unsafe_view", "expand", "expand_as", "t", "transpose", "permute", "slice",
    "select", "unsqueeze", "squeeze", "as_strided", "detach", "alias", "reshape",
    "_reshape_alias", "split", "split_with_sizes", "unbind", "chunk", "narrow", "view_as",
    "unflatten", "flatten", "movedim", "empty", "empty_like", "empty_strided", "new_empty",
    "lift_fresh",
})  # fmt: skip

# Shapes beside bench.decode_step's: DeepSeek-V3's (MLA).
MODELS = {
    **{name: (arch, fields) for name, (_, arch, fields) in SHAPES.items()},
    "deepseek-v3-4l": ("DeepseekV3ForCausalLM", dict(
        vocab_size=129280, hidden_size=7168, intermediate_size=18432, num_hidden_layers=4,
        first_k_dense_replace=4, num_attention_heads=128, num_key_value_heads=128,
        kv_lora_rank=512, q_lora_rank=1536, qk_rope_head_dim=64, qk_nope_head_dim=128,
        v_head_dim=128, max_position_embeddings=163840, tie_word_embeddings=False)),
}  # fmt: skip
BLOCK_SIZE = 16
SMS = 132  # an H100 SXM's multiprocessors, which the decode plan splits contexts for


class Unfused(TritonBackend):
    """The Triton backend with norms, residual adds, rotary and MLP activations by the torch
    reference (the base class's), each cache write a launch of its own."""

    rms_norm = AttentionBackend.rms_norm
    rope = AttentionBackend.rope
    add_rms_norm = AttentionBackend.add_rms_norm
    act_mul = AttentionBackend.act_mul
    rotate_and_write = AttentionBackend.rotate_and_write
    latent_rows_and_write = AttentionBackend.latent_rows_and_write


class Counter(TorchDispatchMode):
    """Counts the device operators dispatched while active, by name."""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        # An operator that hands back its input (a cast to the dtype it has) launches nothing.
        if name not in NO_KERNEL and not (args and out is args[0]):
            self.ops[name] += 1
        return out


def model_config(name: str):
    from models.config import ModelConfig

    arch, fields = MODELS[name]
    return ModelConfig(Path(name), MappingProxyType({"architectures": [arch], **fields}))


def _step(model, cfg, backend, batch: int, context: int):
    """The forward context of a decode step of ``batch`` sequences of ``context`` tokens, its
    caches in bfloat16 on the meta device, and the step's input ids and positions."""
    from kernels.backend import AttentionMetadata
    from kernels.paged import ForwardContext
    from models.kv_spec import MLASpec, row_bytes

    meta = dict(device="meta")
    groups = model.kv_cache_groups(cfg, "bfloat16")
    layer_to_group = [0] * cfg.num_layers
    metas, caches = [], {}
    for g, group in enumerate(groups):
        spec = group.spec
        for layer in group.layer_ids:
            layer_to_group[layer] = g
        width = spec.table_width(context, BLOCK_SIZE)
        ints = dict(dtype=torch.int32, **meta)
        metas.append(AttentionMetadata(
            slot_mapping=torch.empty(batch, dtype=torch.int64, **meta),
            block_tables=torch.empty(batch, width, **ints), seq_lens=torch.empty(batch, **ints),
            prefix_lens=torch.empty(batch, **ints), cu_seqlens_q=torch.empty(batch + 1, **ints),
            num_decodes=batch, window=spec.window,
        ))  # fmt: skip
        mla = isinstance(spec, MLASpec)
        heads = 1 if mla else spec.num_kv_heads
        dk = spec.row_width if mla else spec.head_dim
        rows = row_bytes(spec.dtype, dk) // 2
        k = torch.empty(batch * width, BLOCK_SIZE, heads, rows, dtype=torch.bfloat16, **meta)
        v = k[..., : row_bytes(spec.dtype, spec.kv_lora_rank) // 2] if mla else torch.empty_like(k)
        caches[g] = (k, v)
    kv_caches = [caches[layer_to_group[layer]] for layer in range(cfg.num_layers)]
    ctx = ForwardContext.planned(backend, metas, kv_caches, tuple(layer_to_group))
    ids = torch.empty(batch, dtype=torch.int64, **meta)
    return ctx, ids, torch.empty(batch, dtype=torch.int64, **meta)


def count(name: str, batch: int = 1, context: int = 1024, fused: bool = True) -> dict:
    """Per decoder layer (the mean over layers) and outside them: torch operators by name and
    Triton launches by kernel, of one decode step of ``name``. ``fused=False``: norms, residual
    adds, rotary and activations by the torch reference, as the CUDA path ran them on
    2026-11-26 (its H100 profile)."""
    from models.layers import use_backend
    from models.loader import model_class

    cfg = model_config(name)
    with torch.device("meta"):
        model = model_class(cfg)(cfg).to(torch.bfloat16)
    launches: list = []
    backend = (TritonBackend if fused else Unfused)(run=launches.append, sms=SMS)
    use_backend(model, backend)
    backend.prepare(model)
    ctx, ids, positions = _step(model, cfg, backend, batch, context)
    launches.clear()
    counter = Counter()
    inside: dict[str, collections.Counter] = {"ops": collections.Counter(),
                                              "launches": collections.Counter()}  # fmt: skip
    marks: list = []

    def before(module, args):
        marks.append((counter.ops.copy(), len(launches)))

    def after(module, args, out):
        ops, n = marks.pop()
        inside["ops"].update(counter.ops - ops)
        inside["launches"].update(launch.kernel.__name__ for launch in launches[n:])

    for layer in model.model.layers:
        layer.register_forward_pre_hook(before)
        layer.register_forward_hook(after)
    with counter, torch.inference_mode():
        model.compute_logits(model(ids, positions, ctx))
    every_launch = collections.Counter(launch.kernel.__name__ for launch in launches)
    layers = cfg.num_layers
    per_layer = (sum(inside["ops"].values()) + sum(inside["launches"].values())) / layers
    total = sum(counter.ops.values()) + len(launches)
    return dict(
        model=name, layers=layers, batch=batch, context=context, per_layer=per_layer,
        outside=total - per_layer * layers, total=total,
        layer_ops={k: v / layers for k, v in inside["ops"].most_common()},
        layer_launches={k: v / layers for k, v in inside["launches"].most_common()},
        launches=dict(every_launch),
    )  # fmt: skip


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        f"# Kernels per decode step on the CUDA path, bf16, {rows[0]['date']}",
        "",
        "Counted on the meta device (no GPU): torch operators that reach the device, views and",
        "metadata excepted, plus Triton launches. Eager decode, batch "
        f"{rows[0]['batch']}, context {rows[0]['context']}, decode plans for {SMS} SMs.",
        "",
        f"Command: `{command}`",
        "",
        "| model | layers | kernels per layer | outside the layers | step | per layer: operators "
        "| per layer: Triton |",
        "|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ops = ", ".join(f"{k} {v:g}" for k, v in r["layer_ops"].items())
        tri = ", ".join(f"{k.strip('_')} {v:g}" for k, v in r["layer_launches"].items())
        lines.append(
            f"| {r['model']} | {r['layers']} | {r['per_layer']:.1f} | {r['outside']:.0f} "
            f"| {r['total']} | {ops} | {tri} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kernel_count", description=__doc__)
    parser.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--context", type=int, default=1024)
    parser.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = parser.parse_args(argv)
    date = datetime.now(timezone.utc).strftime("%Y-%m-%d")
    rows = []
    for name in args.models:
        row = {**count(name, args.batch, args.context), "date": date}
        rows.append(row)
        print(f"{name}: {row['per_layer']:.1f} kernels per layer, {row['total']} per step",
              flush=True)  # fmt: skip
    words = sys.argv[1:] if argv is None else argv
    command = " ".join(["python -m bench.kernel_count", *words])
    if args.out:
        Path(f"{args.out}.json").write_text(json.dumps(rows, indent=1) + "\n")
        Path(f"{args.out}.md").write_text(markdown(rows, command))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

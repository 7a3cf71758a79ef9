"""Candidate KV-cache quantization schemes, measured before any kernel reads them: the model
(transformers over the GGUF file's weights, in float32) attends over keys and values that are
quantized and dequantized in torch, and its logits are compared with float32 K/V.

    python -m bench.kv_schemes [--model qwen2.5-coder-0.5b-instruct] [--tokens 2048]
        [--schemes NAME ...] [--out PREFIX]

The text and rows are those of ``bench.kv_cache``: the first ``--tokens`` tokens of ``alice``
teacher forced in one context, the second half's rows scored (perplexity, mean and
99th-percentile KLD, top-1 agreement against float32 K/V).

A scheme quantizes keys and values each one way:

- ``int8``, ``int4``: today's formats (``kernels.kv_quant``: rows rotated, one scale a row or
  a group of 32 values), keys less their offset (``models.llama.rotated_bias_mean``) as the
  engine caches them;
- ``ch4``: keys per channel, 4-bit with a minimum (KIVI): per head and channel one scale and
  one minimum over the ``group`` tokens of a block, in float16, no rotation; ``int4 keys``:
  the engine's int4 keys, the same over 32 tokens with each channel's scale and minimum in 8
  bits, on float16 grids per head and group, as Q4_K codes its sub-blocks' scales.

``recent``: the query's own block of ``block`` tokens, and the ``recent - 1`` blocks before it,
are read as they are, not quantized: a block's per-channel scales exist only once it is full,
so the engine would hold the block being written (and a few before it, KIVI's residual of 32
to 128 tokens) at a higher precision, quantizing a block when it leaves that window.

Bits per value count the stored scales and minimums; capacity is float32's 32 bits over the
mean of the key's and the value's.
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

import torch

from bench.cpu import cpu_model
from bench.quality import Divergence, kl_rows, load_text
from kernels import kv_quant
from models.fetch import resolve_model
from models.llama import rotated_bias_mean
from models.tokenizer import Tokenizer

BLOCK = 16  # tokens a cache block holds (the engine's default)


def token_format(dtype: torch.dtype) -> Callable[[torch.Tensor], torch.Tensor]:
    """Today's row formats: x [..., T, D] as a cache of ``dtype`` gives it back."""
    return lambda x: kv_quant.fake_quantize(x, dtype)


def per_channel(x: torch.Tensor, group: int, bits: int = 4) -> torch.Tensor:
    """x [B, H, T, D] quantized per (head, channel) over each ``group`` tokens: q in
    [0, 2^bits - 1], x = q * scale + minimum, scale and minimum in float16."""
    b, h, t, d = x.shape
    pad = -t % group
    g = torch.nn.functional.pad(x, (0, 0, 0, pad)).view(b, h, -1, group, d)
    lo, hi = g.amin(3, keepdim=True), g.amax(3, keepdim=True)
    top = 2**bits - 1
    scale = ((hi - lo) / top).half().float()
    lo = lo.half().float()
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = torch.clamp(torch.round((g - lo) / scale), 0, top)
    return (q * scale + lo).view(b, h, -1, d)[:, :, :t]


def int4_keys(x: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, D] as the engine's int4 keys give it back (``kernels.kv_quant``: per channel
    over groups of 32 tokens, 8-bit codes), quantized from the float16 values its recent rows
    hold; the last, partial group as it is (the engine reads it from the recent rows)."""
    t = x.shape[2]
    full = t - t % kv_quant.CHANNEL_GROUP
    rows = x[:, :, :full].half().float().transpose(1, 2)
    quantized = kv_quant.fake_quantize_channels(rows).transpose(1, 2)
    return torch.cat([quantized, x[:, :, full:]], 2)


@dataclass(frozen=True)
class Side:
    """How one of K or V is stored: a name, its fake quantizer, bits per value with scales."""

    name: str
    quantize: Callable[[torch.Tensor], torch.Tensor] | None
    bits: Callable[[int], float]  # head size -> bits per value
    centered: bool = True  # keys less their offset first (per-token formats need it)


def sides(group: int = BLOCK) -> dict[str, Side]:
    return {
        "f32": Side("f32", None, lambda d: 32),
        "int8": Side("int8", token_format(torch.int8), lambda d: 8 + 32 / d),
        "int4": Side("int4", token_format(torch.uint8), lambda d: 4 + 16 / 32),
        f"ch4/{group}": Side(
            f"ch4/{group}", lambda x: per_channel(x, group), lambda d: 4 + 32 / group, False
        ),
        # the engine's: 8-bit codes per channel, three float16 grid ends per head and group
        "int4 keys": Side("int4 keys", int4_keys, lambda d: 4 + 8 * kv_quant.channel_tail(d) / d),
    }


@dataclass(frozen=True)
class Scheme:
    key: Side
    value: Side
    recent: int = 0  # the query's own block and the recent - 1 before it read unquantized
    block: int = BLOCK
    # The dtype the recent keys and values are read back in: the engine's recent rows'
    # (float16 for a float32 model).
    rounded: torch.dtype | None = None

    @property
    def name(self) -> str:
        tail = ""
        if self.recent:
            tail = f", last {self.recent * self.block} tokens by {self.block} unquantized"
        return f"K {self.key.name} / V {self.value.name}{tail}"


def schemes() -> list[Scheme]:
    s, s32 = sides(), sides(32)
    return [
        Scheme(s["int4"], s["int4"]),
        Scheme(s["int8"], s["int4"]),
        Scheme(s["f32"], s["int4"]),
        Scheme(s["int4"], s["f32"]),
        Scheme(s["f32"], s["int4"], 1),
        Scheme(s["int8"], s["int4"], 1),
        Scheme(s["int8"], s["int4"], 8),
        Scheme(s["int8"], s["int8"]),
        Scheme(s["ch4/16"], s["int4"], 1),
        Scheme(s["ch4/16"], s["int4"], 2),
        Scheme(s["ch4/16"], s["int4"], 8),
        Scheme(s32["ch4/32"], s["int4"], 1, 32),
        Scheme(s32["ch4/32"], s["int4"], 4, 32),
        Scheme(s32["int4 keys"], s["int4"], 1, 32),
        Scheme(s32["int4 keys"], s["int4"], 2, 32),
        Scheme(s32["int4 keys"], s["int4"], 4, 32),
    ]


class FakeQuantizedAttention:
    """A transformers attention function (``AttentionInterface``) over fake-quantized K/V."""

    def __init__(self, offsets: list[torch.Tensor]):
        self.offsets = offsets  # per layer [1, Hkv, 1, D], None without a key bias
        self.scheme: Scheme | None = None

    @staticmethod
    def _stored(side: Side, x: torch.Tensor, offset: torch.Tensor | None = None) -> torch.Tensor:
        """x as the cache gives it back; keys less ``offset`` while quantized."""
        if side.quantize is None:
            return x
        if side.centered and offset is not None:
            return side.quantize(x - offset) + offset
        return side.quantize(x)

    def __call__(self, module, query, key, value, attention_mask, scaling, dropout=0.0, **kw):
        t = query.shape[2]
        offset = self.offsets[module.layer_idx]
        k_read = self._stored(self.scheme.key, key, offset)
        v_read = self._stored(self.scheme.value, value)
        if self.scheme.rounded is not None:
            centered = key if offset is None else key - offset
            key = centered.to(self.scheme.rounded).float() + (0 if offset is None else offset)
            value = value.to(self.scheme.rounded).float()
        group = query.shape[1] // key.shape[1]
        key, value, k_read, v_read = (x.repeat_interleave(group, 1)
                                      for x in (key, value, k_read, v_read))  # fmt: skip
        pos = torch.arange(t, device=query.device)
        causal = pos[None, :] <= pos[:, None]
        block = pos // self.scheme.block
        own = block[:, None] - block[None, :] < self.scheme.recent  # (query, key)
        scores = torch.where(own, query @ key.transpose(-1, -2), query @ k_read.transpose(-1, -2))
        p = (scores * scaling).masked_fill(~causal, float("-inf")).softmax(-1)
        out = (p * own) @ value + (p * ~own) @ v_read
        return out.transpose(1, 2).contiguous(), None


def attach(model) -> FakeQuantizedAttention:
    """Puts a transformers model (Llama-like: ``model.model.layers[i].self_attn``) on fake-
    quantized attention; returns that attention, whose ``scheme`` says how."""
    from transformers import AttentionInterface

    inv_freq = model.model.rotary_emb.inv_freq
    offsets = []
    for layer in model.model.layers:
        a = layer.self_attn
        bias = a.k_proj.bias
        if bias is None:
            offsets.append(None)
            continue
        b = bias.detach().float().view(-1, a.head_dim)
        offsets.append(rotated_bias_mean(b, inv_freq)[None, :, None, :])
    attention = FakeQuantizedAttention(offsets)
    AttentionInterface.register("kvserve_fake_quantized", attention)
    model.config._attn_implementation = "kvserve_fake_quantized"
    return attention


def load(model_name: str):
    """(the transformers model over the GGUF file's weights in float32, its fake-quantized
    attention, the tokenizer)."""
    from transformers import AutoModelForCausalLM

    path = resolve_model(model_name, progress=False)
    model = AutoModelForCausalLM.from_pretrained(path, gguf_file="model.gguf", dtype=torch.float32)
    return model.eval(), attach(model), Tokenizer.from_dir(path)


def measure(model, attention, ids: list[int], chosen: list[Scheme]) -> list[dict]:
    n = len(ids)
    rows, target = slice(n // 2, n - 1), torch.tensor(ids[n // 2 + 1 :])[:, None]

    def logprobs(scheme: Scheme) -> torch.Tensor:
        attention.scheme = scheme
        with torch.no_grad():
            return model(torch.tensor([ids])).logits[0, rows].float().log_softmax(-1)

    s = sides()
    reference = logprobs(Scheme(s["f32"], s["f32"]))
    ppl_ref = math.exp(-reference.gather(1, target).mean().item())
    d = model.model.layers[0].self_attn.head_dim
    results = []
    for scheme in chosen:
        start = time.perf_counter()
        got = logprobs(scheme)
        div = Divergence.of(*(x.double().numpy() for x in kl_rows(reference, got)))
        bits = (scheme.key.bits(d) + scheme.value.bits(d)) / 2
        results.append(dict(
            scheme=scheme.name, key_bits=scheme.key.bits(d), value_bits=scheme.value.bits(d),
            capacity=32 / bits, kld=div.kld_mean, kld_p99=div.kld_p99, top1=div.top1,
            ppl=math.exp(-got.gather(1, target).mean().item()), ppl_ref=ppl_ref,
        ))  # fmt: skip
        r = results[-1]
        print(f"{r['scheme']}: KLD {r['kld']:.2e}, top-1 {r['top1']:.2%} "
              f"({time.perf_counter() - start:.0f} s)", flush=True)  # fmt: skip
    return results


def markdown(results: list[dict]) -> str:
    lines = [
        "| scheme | K bits | V bits | vs float32 | perplexity | mean KLD | p99 KLD | top-1 |",
        "|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        lines.append(
            f"| {r['scheme']} | {r['key_bits']:.2f} | {r['value_bits']:.2f} "
            f"| {r['capacity']:.2f}x | {r['ppl']:.4f} ({r['ppl'] / r['ppl_ref'] - 1:+.1%}) "
            f"| {r['kld']:.2e} | {r['kld_p99']:.2e} | {r['top1']:.2%} |"
        )
    return "\n".join(lines) + f"\n\nfloat32 K/V perplexity: {results[0]['ppl_ref']:.4f}."


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.kv_schemes", description=__doc__)
    parser.add_argument("--model", default="qwen2.5-coder-0.5b-instruct")
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--text", default="alice")
    parser.add_argument("--schemes", nargs="+", help="names of the schemes to run (substrings)")
    parser.add_argument("--out", help="write PREFIX.md")
    args = parser.parse_args(argv)
    chosen = [s for s in schemes() if not args.schemes or any(n in s.name for n in args.schemes)]
    if not chosen:
        parser.error(f"no scheme matches {args.schemes}; known: {[s.name for s in schemes()]}")
    model, attention, tokenizer = load(args.model)
    ids = tokenizer.encode(load_text(args.text), add_special_tokens=False)[: args.tokens]
    table = markdown(measure(model, attention, ids, chosen))
    print(table)
    if args.out:
        date = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        command = "python -m bench.kv_schemes " + " ".join(sys.argv[1:] if argv is None else argv)
        head = (f"# KV quantization schemes on {args.model}\n\n{date}, {cpu_model()}, "
                f"`{command}`\n\nThe first {len(ids)} tokens of `{args.text}`, rows "
                f"{len(ids) // 2 + 1}..{len(ids) - 1}, against float32 K/V.\n\n")  # fmt: skip
        Path(f"{args.out}.md").write_text(head + table + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Where a CUDA-graphs decode step's time goes: the wall time per step against the GPU kernel
time per step, with the kernels that take it.

    python -m bench.step_profile [--models smollm2-135m qwen2.5-1.5b] [--batch 1 64] [--host]

Random bf16 weights at each shape (``bench.decode_step.SHAPES``), a 1,024-token prompt per
sequence. Wall: (generate 65 tokens - generate 1) / 64. Kernel time: the profiler's device time
over generate(33) less generate(1), per kernel, / 32; what the wall holds beyond it is host work
and gaps between launches.

``--host``: the host's time per kernel launch (``launch_cost``), then where the host's time
goes under a served-like load instead: 2 x batch requests of
256 tokens, at most ``batch`` at once, each asking 64-192 tokens, so that new prompts' chunks
keep joining running decodes (mixed steps) as in a load test. Python's profiler over the run
lists the functions by their own time (``DecodeGraphs.run`` calls against the engine's steps:
how many steps replayed a graph).
"""

from __future__ import annotations

import argparse
import io
import statistics
import tempfile
import time
from pathlib import Path

import torch

from bench.decode_step import SHAPES, build_checkpoint
from engine import LLM, SamplingParams

STEPS = 32


def _generate(llm: LLM, prompts: list[list[int]], tokens: int) -> float:
    params = SamplingParams(temperature=0, max_tokens=tokens, ignore_eos=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    llm.generate(prompts, params)
    torch.cuda.synchronize()
    return time.perf_counter() - start


def _kernel_us(llm: LLM, prompts: list[list[int]], tokens: int) -> dict[str, tuple[float, int]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        _generate(llm, prompts, tokens)
    return {e.key: (e.self_device_time_total, e.count) for e in prof.key_averages()
            if e.self_device_time_total > 0}  # fmt: skip


def profile_batch(llm: LLM, vocab: int, batch: int, top: int) -> list[str]:
    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (1024,), generator=gen).tolist()] * batch
    _generate(llm, prompts, 4)  # warm-up: kernels compiled, graphs captured
    walls = [(_generate(llm, prompts, 65) - _generate(llm, prompts, 1)) / 64 * 1e3
             for _ in range(2)]  # fmt: skip
    many, one = _kernel_us(llm, prompts, STEPS + 1), _kernel_us(llm, prompts, 1)
    per_step = {k: ((t - one.get(k, (0, 0))[0]) / 1e3 / STEPS, (c - one.get(k, (0, 0))[1]) / STEPS)
                for k, (t, c) in many.items()}  # fmt: skip
    gpu = sum(ms for ms, _ in per_step.values())
    lines = [f"batch {batch}: wall {statistics.median(walls):.3f} ms/step, "
             f"GPU kernels {gpu:.3f} ms/step", "", "| ms/step | calls/step | kernel |",
             "|---|---|---|"]  # fmt: skip
    for key, (ms, calls) in sorted(per_step.items(), key=lambda kv: -kv[1][0])[:top]:
        lines.append(f"| {ms:.4f} | {calls:.1f} | `{key[:90]}` |")
    return lines


def profile_host(llm: LLM, vocab: int, batch: int, top: int) -> list[str]:
    import cProfile
    import pstats

    gen = torch.Generator().manual_seed(batch)
    prompts = [torch.randint(3, vocab, (256,), generator=gen).tolist() for _ in range(2 * batch)]
    params = [SamplingParams(temperature=0, max_tokens=int(n), ignore_eos=True)
              for n in torch.randint(64, 193, (2 * batch,), generator=gen)]  # fmt: skip
    llm.generate(prompts[:batch], params[:batch])  # warm-up: kernels compiled, graphs captured
    profiler = cProfile.Profile()
    torch.cuda.synchronize()
    start = time.perf_counter()
    profiler.enable()
    outs = llm.generate(prompts, params)
    profiler.disable()
    torch.cuda.synchronize()
    wall = time.perf_counter() - start
    tokens = sum(len(o.outputs[0].token_ids) for o in outs)
    stream = io.StringIO()
    stats = pstats.Stats(profiler, stream=stream).sort_stats("tottime")
    stats.print_stats(top)
    stats.sort_stats("cumulative").print_stats(top)
    text = stream.getvalue()
    body = text[text.index("   ncalls") :] if "   ncalls" in text else text
    return [f"host, {2 * batch} requests, at most {batch} at once: {wall:.2f} s for {tokens} "
            f"tokens ({tokens / wall:.0f} tok/s, under the profiler)", "", "```", body.rstrip(),
            "```"]  # fmt: skip


def launch_cost(launches: int = 2000) -> list[str]:
    """The host's time per launch of the decode kernel (Qwen2.5-1.5B's heads, batch 64):
    through Triton's JIT (``Launch``: arguments bound and specialized, cache looked up, every
    call), through ``Launcher`` (what the Triton backend launches with), and through the
    compiled kernel's launcher alone (what a launch costs without any dispatch)."""
    from kernels.launch import Launcher
    from kernels.triton_attention import decode_launches

    gen = torch.Generator(device="cuda").manual_seed(0)
    blocks, bs = 64 * 64, 16
    k_cache = torch.randn(blocks, bs, 2, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    tables = torch.arange(blocks, device="cuda", dtype=torch.int32).view(64, 64)
    q = torch.randn(64, 12, 128, generator=gen, device="cuda", dtype=torch.bfloat16)
    lens = torch.full((64,), 1000, device="cuda", dtype=torch.int32)
    _, found = decode_launches(q, k_cache, k_cache, tables, lens, 128**-0.5, num_splits=1)
    launch = found[0]

    def compiled_launcher():
        compiled = launch.kernel[launch.grid](*launch.args, **launch.params)
        _, rest = Launcher.keep(launch.kernel, compiled, launch)
        runner, values = compiled[launch.grid], (*launch.args, *rest)
        return lambda: runner(*values)

    def kept():
        launcher = Launcher()
        launcher(launch)  # the first launch compiles and keeps the variant
        return lambda: launcher(launch)

    lines = [f"host time per launch of `{launch.kernel.__name__}`, {launches} launches:"]
    calls = {"Triton JIT (Launch)": lambda: launch, "kernels.launch.Launcher": kept,
             "compiled launcher alone": compiled_launcher}  # fmt: skip
    for name, make in calls.items():
        try:
            call = make()
            call()
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(launches):
                call()
            host = (time.perf_counter() - start) / launches * 1e6
            torch.cuda.synchronize()
            lines.append(f"- {name}: {host:.1f} µs")
        except Exception as exc:  # the launcher's calling convention is Triton's own
            lines.append(f"- {name}: failed: {type(exc).__name__}: {exc}")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m bench.step_profile", description=__doc__)
    parser.add_argument("--models", nargs="+", default=["smollm2-135m", "qwen2.5-1.5b"],
                        choices=list(SHAPES))  # fmt: skip
    parser.add_argument("--batch", nargs="+", type=int, default=[1, 64])
    parser.add_argument("--top", type=int, default=14, help="kernels listed per batch")
    parser.add_argument("--out", type=Path, help="write the tables to OUT.md")
    parser.add_argument("--host", action="store_true", help="profile the host under a load")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        parser.error("needs a CUDA device")
    lines = [f"# Decode step profile, {torch.cuda.get_device_name()}, torch {torch.__version__}"]
    if args.host:
        lines += ["", *launch_cost()]
        print("\n".join(lines), flush=True)
    with tempfile.TemporaryDirectory() as folder:
        for name in args.models:
            path = build_checkpoint(name, Path(folder))
            llm = LLM(str(path), dtype="bfloat16", max_model_len=1200,
                      max_num_seqs=max(args.batch), max_num_batched_tokens=2048,
                      kv_cache_memory_gib=8, enable_prefix_caching=False)  # fmt: skip
            for batch in args.batch:
                how = profile_host if args.host else profile_batch
                found = how(llm, SHAPES[name][2]["vocab_size"], batch, args.top)
                lines += ["", f"## {name}", "", *found]
                print("\n".join(lines[-len(found) - 3 :]), flush=True)
            del llm
            torch.cuda.empty_cache()
    if args.out:
        args.out.with_suffix(".md").write_text("\n".join(lines) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

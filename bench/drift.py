"""How far kvserve's quantized path drifts from transformers on the same GGUF file.

    python -m bench.drift [--models qwen2.5-coder-0.5b-instruct smollm2-135m-instruct ...]
        [--tokens 1000] [--out PREFIX]

Teacher-forced over one text (``--tokens`` tokens of a Python standard-library module's source:
the same text on every machine, and code for the code models): transformers' float32 forward
of the GGUF file (its matrices dequantized by gguf-py) is the reference; kvserve serves the same
file with its matrices kept in their block formats, on every CPU kernel path this machine can
run (``kernels.cpu.isas``; each path in a process of its own, since a process loads one). Per
model and path: the mean KL divergence KL(reference || kvserve) over the positions, the share of
positions whose most likely token agrees (top-1), and the perplexity of each.
"""

from __future__ import annotations

import argparse
import contextlib
import inspect
import json
import os
import subprocess
import sys
import tempfile
import textwrap
from datetime import datetime, timezone
from pathlib import Path

import torch

MODELS = ("qwen2.5-coder-0.5b-instruct", "smollm2-135m-instruct", "gemma3-270m")
SOURCE = textwrap  # the text: a module every Python 3.11 ships


def text_ids(tokenizer, tokens: int) -> list[int]:
    ids = tokenizer.encode(inspect.getsource(SOURCE))
    if len(ids) < tokens:
        raise ValueError(f"the text has {len(ids)} tokens, fewer than {tokens}")
    return ids[:tokens]


def served_folder(alias: str) -> Path:
    """The folder that serves the alias's GGUF file in its block formats."""
    from models.fetch import fetch, gguf_path, served_gguf

    folder = fetch(alias, progress=False)
    if (folder / "model.gguf").exists():
        return folder
    return served_gguf(gguf_path(alias, progress=False))


def kvserve_logprobs(folder: Path, ids: list[int]) -> torch.Tensor:
    """Log-probabilities [len(ids) - 1, vocab] of kvserve's forward of ``ids`` (one prefill,
    in chunks), rows predicting tokens 1 ..."""
    from engine import LLM, SamplingParams

    llm = LLM(str(folder), max_model_len=len(ids) + 16, num_kv_blocks=len(ids) // 16 + 4)
    model = llm.engine.runner.model
    rows: list[torch.Tensor] = []
    compute = model.compute_logits

    def recording(hidden: torch.Tensor) -> torch.Tensor:
        logits = compute(hidden)
        rows.append(torch.log_softmax(logits.float(), -1))
        return logits

    model.compute_logits = recording
    llm.generate([ids], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0))
    return torch.cat(rows)[: len(ids) - 1]


def reference_model(folder: Path):
    """transformers' float32 model of the folder's GGUF file (its matrices dequantized)."""
    from transformers import AutoModelForCausalLM

    path = (folder / "model.gguf").resolve()
    with fast_gguf_reader():
        return AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name,
                                                    dtype=torch.float32).eval()  # fmt: skip


@contextlib.contextmanager
def fast_gguf_reader():
    """transformers' GGUF loads (models, tokenizers) parse the header with kvserve's reader:
    gguf-py's, which takes a quarter-minute over a 150k-token vocabulary, reading from a plain
    view of the map (``models.gguf_import.open_gguf``, the same fields and tensors)."""
    from unittest import mock

    from models.gguf_import import open_gguf

    with mock.patch("gguf.GGUFReader", lambda path, *args, **kwargs: open_gguf(path)):
        yield


def reference_logprobs(folder: Path, ids: list[int], model=None) -> torch.Tensor:
    """transformers' log-probabilities of ``ids``, by ``model`` (loaded once by the caller, a
    half-minute for a 0.5B GGUF) or by ``reference_model(folder)``."""
    model = reference_model(folder) if model is None else model
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1)


def compare(ours: torch.Tensor, ref: torch.Tensor, ids: list[int]) -> dict[str, float]:
    """Mean KL(ref || ours), top-1 agreement and both perplexities over the positions."""
    kld = (ref.exp() * (ref - ours)).sum(-1)
    target = torch.tensor(ids[1:])
    nll = lambda lp: -lp.gather(1, target[:, None]).mean().item()  # noqa: E731
    return {
        "mean_kld": kld.mean().item(),
        "top1": (ours.argmax(-1) == ref.argmax(-1)).float().mean().item(),
        "ppl": float(torch.tensor(nll(ours)).exp()),
        "ppl_reference": float(torch.tensor(nll(ref)).exp()),
        "positions": len(ids) - 1,
    }


def _one_path(folder: str, ids_file: str, out_file: str) -> None:
    ids = json.loads(Path(ids_file).read_text())
    torch.save(kvserve_logprobs(Path(folder), ids), out_file)


def measure(alias: str, tokens: int) -> list[dict]:
    from kernels import cpu
    from models.tokenizer import Tokenizer

    folder = served_folder(alias)
    ids = text_ids(Tokenizer.from_dir(folder), tokens)
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        ids_file = Path(tmp) / "ids.json"
        ids_file.write_text(json.dumps(ids))
        outs = {}
        for isa in cpu.isas():
            out = Path(tmp) / f"{isa}.pt"
            env = {**os.environ, "KVSERVE_CPU_ISA": isa}
            code = "import sys; from bench.drift import _one_path; _one_path(*sys.argv[1:])"
            subprocess.run([sys.executable, "-c", code, str(folder), str(ids_file), str(out)],
                           env=env, check=True)  # fmt: skip
            outs[isa] = out
        ref = reference_logprobs(folder, ids)
        for isa, out in outs.items():
            rows.append({"model": alias, "path": isa, **compare(torch.load(out), ref, ids)})
    return rows


def markdown(rows: list[dict]) -> str:
    lines = ["| model | CPU path | mean KLD | top-1 agreement | ppl kvserve | ppl transformers |",
             "|---|---|---|---|---|---|"]  # fmt: skip
    for r in rows:
        lines.append(f"| {r['model']} | {r['path']} | {r['mean_kld']:.2e} | {100 * r['top1']:.2f}% "
                     f"| {r['ppl']:.3f} | {r['ppl_reference']:.3f} |")  # fmt: skip
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.drift", description=__doc__.split("\n")[0])
    p.add_argument("--models", nargs="+", default=list(MODELS))
    p.add_argument("--tokens", type=int, default=1000)
    p.add_argument("--out", help="write PREFIX.md and PREFIX.json")
    args = p.parse_args(argv)
    rows = [row for alias in args.models for row in measure(alias, args.tokens)]
    text = markdown(rows)
    print(text)
    if args.out:
        stamp = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
        cmd = "python -m bench.drift " + " ".join(argv if argv is not None else sys.argv[1:])
        from bench.cpu import cpu_model

        box = f"{os.cpu_count()} cores, {cpu_model()}, torch {torch.__version__}"
        Path(f"{args.out}.md").write_text(
            f"# Quantized-path drift\n\n{stamp}, {box}, `{cmd}`\n\n{text}\n"
        )
        Path(f"{args.out}.json").write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

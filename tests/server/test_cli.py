"""`kvserve` subcommands fail with one line on stderr and exit status 2, never a traceback."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import gguf
import pytest

from server.cli import main

KVSERVE = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "kvserve"


def fails(argv: list[str], capsys) -> str:
    """The one stderr line of a `kvserve` run that must exit with status 2."""
    with pytest.raises(SystemExit) as e:
        main(argv)
    assert e.value.code == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1, lines
    return lines[0]


@pytest.fixture
def phi3_gguf(tmp_path) -> Path:
    """A GGUF file of an architecture the converter does not know (header and metadata only)."""
    path = tmp_path / "phi3.gguf"
    writer = gguf.GGUFWriter(str(path), "phi3")
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def test_convert_names_the_unsupported_architecture_and_the_supported_ones(
    phi3_gguf, tmp_path, capsys
):
    line = fails(["convert", str(phi3_gguf), str(tmp_path / "out")], capsys)
    assert line == (
        "kvserve convert: unsupported GGUF architecture 'phi3'; supported: gemma3, llama, qwen2"
    )


def test_convert_of_a_missing_or_non_gguf_file(tmp_path, capsys):
    missing = tmp_path / "nope.gguf"
    assert fails(["convert", str(missing), str(tmp_path / "out")], capsys) == (
        f"kvserve convert: no such file: {missing}"
    )
    text = tmp_path / "notes.gguf"
    text.write_text("not a GGUF file\n")
    assert fails(["convert", str(text), str(tmp_path / "out")], capsys) == (
        f"kvserve convert: {text} is not a GGUF file (no GGUF magic at its start)"
    )


def test_the_installed_command_prints_no_traceback(phi3_gguf, tmp_path):
    if not KVSERVE.exists():
        pytest.skip("no .venv/bin/kvserve")
    proc = subprocess.run(
        [str(KVSERVE), "convert", str(phi3_gguf), str(tmp_path / "out")],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2
    assert "Traceback" not in proc.stderr
    last = proc.stderr.strip().splitlines()[-1]
    assert last.startswith("kvserve convert: unsupported GGUF architecture 'phi3'")


def test_fetch_of_an_unknown_alias_lists_the_known_ones(capsys):
    line = fails(["fetch", "no-such-model"], capsys)
    assert line.startswith("kvserve fetch: unknown model 'no-such-model'; known aliases: ")
    assert "smollm2-135m-instruct" in line


def test_serve_of_a_gguf_file_of_an_unknown_architecture_names_the_known_ones(
    phi3_gguf, capsys, tmp_path, monkeypatch
):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    line = fails(["serve", "--model", str(phi3_gguf)], capsys)
    assert line == (
        "kvserve serve: unsupported GGUF architecture 'phi3'; supported: gemma3, llama, qwen2"
    )
    assert not list((tmp_path / "home" / "served").iterdir())  # nothing half-built left


def test_serve_of_a_missing_model_or_an_unsupported_architecture(tmp_path, capsys):
    line = fails(["serve", "--model", str(tmp_path / "absent")], capsys)
    assert "neither a model folder nor a known alias" in line
    folder = tmp_path / "qwen"
    folder.mkdir()
    line = fails(["serve", "--model", str(folder)], capsys)
    assert line == f"kvserve serve: {folder / 'config.json'}: No such file or directory"
    (folder / "config.json").write_text(json.dumps({"architectures": ["Phi3ForCausalLM"]}))
    line = fails(["serve", "--model", str(folder)], capsys)
    assert line.startswith("kvserve serve: architecture 'Phi3ForCausalLM' is not supported (")
    assert "LlamaForCausalLM" in line


def test_plan_of_a_gguf_file_of_an_unknown_architecture(phi3_gguf, capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("KVSERVE_HOME", str(tmp_path / "home"))
    line = fails(["plan", "--model", str(phi3_gguf), "--kv-cache-memory", "1"], capsys)
    assert line.startswith("kvserve plan: unsupported GGUF architecture 'phi3'")


def test_bad_engine_flags_are_one_line_too(capsys):
    line = fails(["serve", "--model", "m", "--block-size", "3"], capsys)
    assert line.startswith("kvserve serve: ") and "block_size" in line


@pytest.mark.parametrize("dtype", ["int4", "int8"])
def test_a_kv_dtype_the_models_heads_cannot_take_is_one_line(tiny_llama_dir, capsys, dtype):
    """Quantized rows are rotated in blocks of 32 or 64 values; the tiny Llama's heads have
    16."""
    for command in (["serve"], ["plan", "--kv-cache-memory", "1"]):
        line = fails([*command, "--model", str(tiny_llama_dir), "--kv-cache-dtype", dtype], capsys)
        assert line == (
            f"kvserve {command[0]}: --kv-cache-dtype {dtype} needs head sizes that are multiples "
            "of 32 (rows are stored rotated in blocks of 32 or 64 values), not 16"
        )


def test_overflow_flags_their_policy_ignores_or_the_context_cannot_hold_are_one_line(
    tiny_llama_dir, capsys
):
    serve = ["serve", "--model", str(tiny_llama_dir), "--max-model-len", "64"]
    line = fails([*serve, "--context-overflow", "truncate", "--context-n-discard", "8"], capsys)
    assert line.startswith("kvserve serve: overflow.n_discard does not apply to policy")
    line = fails([*serve, "--context-overflow", "shift", "--context-n-discard", "64"], capsys)
    assert line == (
        "kvserve serve: overflow.n_discard must be less than the context length (64 tokens); "
        "got 64."
    )

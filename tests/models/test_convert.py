"""GGUF conversion against transformers loading the same GGUF file directly.

Tiny synthetic GGUF files cover both architectures in seconds; the slow tests repeat the check
on the two real checkpoints.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
from tokenizers import pre_tokenizers

from models.fetch import ALIASES, MARKER, fetch, gguf_path, resolve_model
from models.gguf_import import convert_gguf
from models.tokenizer import Tokenizer

TOKEN_NORMAL, TOKEN_CONTROL, TOKEN_USER, TOKEN_BYTE = 1, 3, 4, 6


def _hf_model(folder: Path, gguf_file: str | None = None):
    from transformers import AutoModelForCausalLM

    from bench.drift import fast_gguf_reader

    with fast_gguf_reader():
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=gguf_file,
                                                     dtype=torch.float32)  # fmt: skip
    return model.eval()


def _logits(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def _add_f32(writer: gguf.GGUFWriter, name: str, w: np.ndarray) -> None:
    writer.add_tensor(name, w.astype(np.float32))


def _add_q8(writer: gguf.GGUFWriter, name: str, w: np.ndarray) -> None:
    q = gguf.quants.quantize(w.astype(np.float32), gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor(name, q, raw_dtype=gguf.GGMLQuantizationType.Q8_0)


def _finish(writer: gguf.GGUFWriter) -> None:
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _write_tiny_llama(path: Path, rng: np.random.Generator) -> None:
    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())
    merges = ["Ġ t", "h e", "Ġt he", "Ġ a", "i n"]
    tokens = specials + alphabet + [m.replace(" ", "") for m in merges]
    hidden, ffn, heads, kv_heads, layers = 64, 96, 4, 2, 2
    head_dim = hidden // heads

    w = gguf.GGUFWriter(str(path), "llama")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_freq_base(100000.0)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(len(tokens))
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([TOKEN_CONTROL] * len(specials) + [TOKEN_NORMAL] * (len(tokens) - 3))
    w.add_token_merges(merges)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_add_bos_token(False)
    w.add_chat_template("{% for m in messages %}{{ m['content'] }}{% endfor %}")

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    _add_q8(w, "token_embd.weight", randn(len(tokens), hidden))
    _add_f32(w, "output_norm.weight", 1 + randn(hidden))
    for i in range(layers):
        _add_q8(w, f"blk.{i}.attn_q.weight", randn(hidden, hidden))
        _add_q8(w, f"blk.{i}.attn_k.weight", randn(kv_heads * head_dim, hidden))
        _add_f32(w, f"blk.{i}.attn_v.weight", randn(kv_heads * head_dim, hidden))
        _add_f32(w, f"blk.{i}.attn_output.weight", randn(hidden, hidden))
        _add_f32(w, f"blk.{i}.ffn_gate.weight", randn(ffn, hidden))
        _add_f32(w, f"blk.{i}.ffn_up.weight", randn(ffn, hidden))
        _add_q8(w, f"blk.{i}.ffn_down.weight", randn(hidden, ffn))
        _add_f32(w, f"blk.{i}.attn_norm.weight", 1 + randn(hidden))
        _add_f32(w, f"blk.{i}.ffn_norm.weight", 1 + randn(hidden))
    _finish(w)


def _write_tiny_gemma3(path: Path, rng: np.random.Generator) -> None:
    specials = ["<pad>", "<eos>", "<bos>", "<unk>", "<mask>", "<start_of_turn>", "<end_of_turn>"]
    user = ["\n", "\n\n", "  ", "   "]
    byte_tokens = [f"<0x{b:02X}>" for b in range(256)]
    words = ["▁", "h", "e", "l", "o", "w", "r", "d", "▁h", "he", "ll", "▁he", "llo", "▁hello"]
    words += ["▁w", "or", "▁wor", "▁world", "▁▁"]
    tokens = specials + user + byte_tokens + words
    types = [TOKEN_CONTROL] * len(specials) + [TOKEN_USER] * len(user)
    types += [TOKEN_BYTE] * len(byte_tokens) + [TOKEN_NORMAL] * len(words)
    # Six layers so that the last one is global, and a window shorter than the test prompt.
    hidden, ffn, heads, head_dim, layers, window = 64, 96, 2, 256, 6, 4

    w = gguf.GGUFWriter(str(path), "gemma3")
    w.add_context_length(128)
    w.add_embedding_length(hidden)
    w.add_feed_forward_length(ffn)
    w.add_block_count(layers)
    w.add_head_count(heads)
    w.add_head_count_kv(1)
    w.add_key_length(head_dim)
    w.add_value_length(head_dim)
    w.add_rope_freq_base(1_000_000.0)
    w.add_layer_norm_rms_eps(1e-6)
    w.add_sliding_window(window)
    w.add_tokenizer_model("llama")
    w.add_tokenizer_pre("default")
    w.add_token_list(tokens)
    w.add_token_scores([0.0] * len(tokens))
    w.add_token_types(types)
    w.add_bos_token_id(2)
    w.add_eos_token_id(1)
    w.add_unk_token_id(3)
    w.add_pad_token_id(0)
    w.add_add_bos_token(True)

    def randn(*shape):
        return rng.standard_normal(shape).astype(np.float32) * 0.2

    _add_q8(w, "token_embd.weight", randn(len(tokens), hidden))
    _add_f32(w, "output_norm.weight", 1 + randn(hidden))
    for i in range(layers):
        _add_q8(w, f"blk.{i}.attn_q.weight", randn(heads * head_dim, hidden))
        _add_q8(w, f"blk.{i}.attn_k.weight", randn(head_dim, hidden))
        _add_f32(w, f"blk.{i}.attn_v.weight", randn(head_dim, hidden))
        _add_q8(w, f"blk.{i}.attn_output.weight", randn(hidden, heads * head_dim))
        _add_f32(w, f"blk.{i}.attn_q_norm.weight", 1 + randn(head_dim))
        _add_f32(w, f"blk.{i}.attn_k_norm.weight", 1 + randn(head_dim))
        _add_f32(w, f"blk.{i}.ffn_gate.weight", randn(ffn, hidden))
        _add_f32(w, f"blk.{i}.ffn_up.weight", randn(ffn, hidden))
        _add_q8(w, f"blk.{i}.ffn_down.weight", randn(hidden, ffn))
        for norm in ("attn_norm", "post_attention_norm", "ffn_norm", "post_ffw_norm"):
            _add_f32(w, f"blk.{i}.{norm}.weight", 1 + randn(hidden))
    _finish(w)


TINY = {"llama": _write_tiny_llama, "gemma3": _write_tiny_gemma3}
TINY_TEXTS = ["hello world", " the thin  hello\n\nworld", "héllo 😀", "<bos>he<end_of_turn>"]


@pytest.fixture(params=sorted(TINY))
def tiny(request, tmp_path):
    source = tmp_path / f"tiny-{request.param}.gguf"
    TINY[request.param](source, np.random.default_rng(0))
    out = convert_gguf(source, tmp_path / "hf", progress=False)
    return source, out


def test_tiny_model_logits_match_transformers_gguf_load(tiny):
    source, out = tiny
    ids = [int(i) for i in np.random.default_rng(1).integers(7, 40, size=11)]
    ours = _logits(_hf_model(out), ids)
    ref = _logits(_hf_model(source.parent, source.name), ids)
    torch.testing.assert_close(ours, ref, atol=1e-5, rtol=1e-5)


def test_tiny_tokenizer_matches_transformers_gguf_tokenizer(tiny):
    from transformers import AutoTokenizer

    source, out = tiny
    ours = Tokenizer.from_dir(out)
    ref = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name)
    for text in TINY_TEXTS:
        assert ours.encode(text) == ref.encode(text), text
        ids = ours.encode(text)
        assert ours.decode(ids, skip_special_tokens=False) == ref.decode(ids), text


def test_tiny_config_is_what_transformers_writes(tiny, tmp_path):
    from transformers import AutoConfig

    _, out = tiny
    AutoConfig.from_pretrained(out).save_pretrained(tmp_path / "saved")
    saved = json.loads((tmp_path / "saved" / "config.json").read_text())
    saved.pop("transformers_version")
    assert json.loads((out / "config.json").read_text()) == saved


def test_gemma3_layout_not_stored_in_the_file(tmp_path):
    source = tmp_path / "tiny.gguf"
    _write_tiny_gemma3(source, np.random.default_rng(0))
    out = convert_gguf(source, tmp_path / "hf", progress=False, extras={"sliding_window": 8})
    config = json.loads((out / "config.json").read_text())
    assert config["layer_types"] == ["sliding_attention"] * 5 + ["full_attention"]
    assert config["rope_parameters"] == {
        "full_attention": {"rope_theta": 1_000_000.0, "rope_type": "default"},
        "sliding_attention": {"rope_theta": 10_000.0, "rope_type": "default"},
    }
    assert config["eos_token_id"] == [1, 6]
    assert config["sliding_window"] == 8
    assert Tokenizer.from_dir(out).has_chat_template


def test_fetch_is_atomic_and_converts_once(tmp_path, monkeypatch):
    import models.fetch as fetch_module

    source = tmp_path / "tiny.gguf"
    _write_tiny_llama(source, np.random.default_rng(0))
    monkeypatch.setattr(fetch_module, "gguf_path", lambda alias, home, progress: source)
    home = tmp_path / "home"

    def interrupted(gguf_file, out_dir, **kwargs):
        Path(out_dir).mkdir(parents=True)
        (Path(out_dir) / "config.json").write_text("{}")
        raise KeyboardInterrupt

    monkeypatch.setattr(fetch_module, "convert_gguf", interrupted)
    with pytest.raises(KeyboardInterrupt):
        fetch("smollm2-135m-instruct", home=home, progress=False)
    assert list((home / "models").iterdir()) == []

    monkeypatch.setattr(fetch_module, "convert_gguf", convert_gguf)
    folder = fetch("smollm2-135m-instruct", home=home, progress=False)
    assert folder == home / "models" / "smollm2-135m-instruct" and (folder / MARKER).is_file()
    monkeypatch.setattr(fetch_module, "convert_gguf", interrupted)
    assert fetch("smollm2-135m-instruct", home=home, progress=False) == folder


def test_resolve_model_accepts_folders_and_rejects_unknown_names(tmp_path):
    assert resolve_model(str(tmp_path)) == tmp_path
    with pytest.raises(ValueError, match="smollm2-135m-instruct"):
        resolve_model("no-such-model")
    # llama.cpp users pass the .gguf file itself: one that is not there is named as such.
    with pytest.raises(ValueError, match=r"model.Q8_0.gguf': no such GGUF file"):
        resolve_model(str(tmp_path / "model.Q8_0.gguf"))


# The real checkpoints.

PROMPT = "The capital of France is Paris. The capital of Germany is"


@pytest.fixture(scope="module")
def smollm2_models(smollm2_dir):
    source = gguf_path("smollm2-135m-instruct", progress=False)
    return _hf_model(smollm2_dir), _hf_model(source.parent, source.name)


@pytest.mark.slow
def test_smollm2_folder_logits_match_transformers_gguf_load(smollm2_dir, smollm2_models):
    ours, ref = smollm2_models
    ids = Tokenizer.from_dir(smollm2_dir).encode(PROMPT)
    torch.testing.assert_close(_logits(ours, ids), _logits(ref, ids), atol=1e-4, rtol=1e-4)


@pytest.mark.slow
def test_smollm2_greedy_chat_answer_names_paris(smollm2_dir, smollm2_models):
    model, _ = smollm2_models
    tok = Tokenizer.from_dir(smollm2_dir)
    ids = tok.encode_chat([{"role": "user", "content": "What is the capital of France?"}])
    with torch.no_grad():
        out = model.generate(
            torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=2
        )
    assert "Paris" in tok.decode(out[0, len(ids) :].tolist())


@pytest.mark.slow
def test_gemma3_folder_logits_match_transformers_gguf_load(gemma3_dir):
    source = gguf_path("gemma3-270m", progress=False)
    ids = Tokenizer.from_dir(gemma3_dir).encode(PROMPT)
    ours = _logits(_hf_model(gemma3_dir), ids)
    ref = _logits(_hf_model(source.parent, source.name), ids)
    torch.testing.assert_close(ours, ref, atol=1e-4, rtol=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("name", ["smollm2", "gemma3"])
def test_real_config_is_what_transformers_writes(name, request, tmp_path):
    from transformers import AutoConfig

    folder = request.getfixturevalue(f"{name}_dir")
    AutoConfig.from_pretrained(folder).save_pretrained(tmp_path)
    saved = json.loads((tmp_path / "config.json").read_text())
    saved.pop("transformers_version")
    assert json.loads((folder / "config.json").read_text()) == saved


@pytest.mark.slow
def test_fetch_is_idempotent(smollm2_dir):
    start = time.perf_counter()
    again = fetch("smollm2-135m-instruct", progress=False)
    assert time.perf_counter() - start < 2.0
    assert again == smollm2_dir and (again / MARKER).is_file()
    assert resolve_model("smollm2-135m-instruct") == smollm2_dir
    assert set(ALIASES) >= {"smollm2-135m-instruct", "gemma3-270m"}


@pytest.mark.slow
def test_the_reader_reads_what_gguf_py_reads(smollm2_dir):
    """``open_gguf`` parses the header from a plain view of the map; every field and tensor
    equals gguf-py's own reader's."""
    from models.gguf_import import open_gguf

    path = gguf_path("smollm2-135m-instruct", progress=False)
    ours, theirs = open_gguf(path), gguf.GGUFReader(path)
    assert list(ours.fields) == list(theirs.fields)
    for name, field in theirs.fields.items():
        got = ours.fields[name]
        assert (got.offset, got.data, got.types) == (field.offset, field.data, field.types)
        assert all(np.array_equal(a, b) for a, b in zip(got.parts, field.parts, strict=True))
    assert ours.data_offset == theirs.data_offset
    for got, tensor in zip(ours.tensors, theirs.tensors, strict=True):
        assert (got.name, got.tensor_type, got.data_offset) == (
            tensor.name, tensor.tensor_type, tensor.data_offset)  # fmt: skip
        assert np.array_equal(got.data, tensor.data)

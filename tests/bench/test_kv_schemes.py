"""bench.kv_schemes: its per-channel quantizer against a loop over channels, and its attention
against transformers' own on a small random Qwen2 (keys with a bias, GQA)."""

from __future__ import annotations

import pytest
import torch

from bench import kv_schemes

transformers = pytest.importorskip("transformers")


def test_per_channel_quantizes_each_channel_over_each_group_of_tokens():
    x = torch.randn(1, 2, 40, 8, generator=torch.Generator().manual_seed(0)) * 3 + 1
    got = kv_schemes.per_channel(x, group=16)
    for h in range(2):
        for c in range(8):
            for start in (0, 16, 32):  # the last group holds 8 tokens
                g = x[0, h, start : start + 16, c]
                lo = g.min().half().float()
                scale = ((g.max() - g.min()) / 15).half().float()
                q = torch.clamp(torch.round((g - lo) / scale), 0, 15)
                assert torch.equal(got[0, h, start : start + 16, c], q * scale + lo)
    assert (got - x).abs().max() < (x.amax() - x.amin()) / 15  # within a step of any scale


@pytest.fixture(scope="module")
def tiny():
    config = transformers.Qwen2Config(
        vocab_size=64, hidden_size=128, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )  # fmt: skip
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(config).eval()
    with torch.no_grad():  # a key bias large enough that centering matters
        for layer in model.model.layers:
            layer.self_attn.k_proj.bias.normal_(0, 4)
    ids = torch.randint(0, 64, (1, 40), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = model(ids).logits[0]
    return model, kv_schemes.attach(model), ids, expected


def _logits(tiny, scheme):
    model, attention, ids, _ = tiny
    attention.scheme = scheme
    with torch.no_grad():
        return model(ids).logits[0]


def test_float32_scheme_is_transformers_attention(tiny):
    s = kv_schemes.sides()
    got = _logits(tiny, kv_schemes.Scheme(s["f32"], s["f32"]))
    assert torch.allclose(got, tiny[3], atol=1e-4, rtol=1e-4)


def test_a_querys_own_block_is_read_unquantized(tiny):
    s = kv_schemes.sides()
    quantized = _logits(tiny, kv_schemes.Scheme(s["int4"], s["int4"]))
    recent = _logits(tiny, kv_schemes.Scheme(s["int4"], s["int4"], recent=1))
    two = _logits(tiny, kv_schemes.Scheme(s["int4"], s["int4"], recent=2, block=8))
    expected = tiny[3]
    # Queries of the first block see only their own block's keys: as float32.
    assert torch.allclose(recent[:16], expected[:16], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(quantized[:16], expected[:16], atol=1e-3)
    # Later queries read the earlier blocks quantized.
    assert not torch.allclose(recent[16:], expected[16:], atol=1e-3)
    # Two blocks of 8: the first 16 queries read none quantized, the 17th its first 8 keys.
    assert torch.allclose(two[:16], expected[:16], atol=1e-4, rtol=1e-4)
    assert not torch.allclose(two[16], expected[16], atol=1e-3)


def test_the_engines_int4_keys_keep_every_value_within_a_step_of_its_channels_range():
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(1, 2, 70, 32, generator=gen) * 3 + torch.randn(1, 2, 1, 32, generator=gen) * 20
    got = kv_schemes.int4_keys(x)
    g, q = x[:, :, :64].half().float().view(1, 2, 2, 32, 32), got[:, :, :64].view(1, 2, 2, 32, 32)
    step = (g.amax(3, keepdim=True) - g.amin(3, keepdim=True)) / 15
    assert ((q - g).abs() <= step).all()  # nothing clipped beyond its channel's range
    assert not torch.equal(q, kv_schemes.per_channel(x[:, :, :64], group=32))  # 8-bit codes
    assert torch.equal(got[:, :, 64:], x[:, :, 64:])  # the partial group as it is

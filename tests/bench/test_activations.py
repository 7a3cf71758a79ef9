"""The int8 activations of the block-format products keep Qwen2.5-Coder-0.5B's predictions
within the gate (bench.activations) at both kinds of multi-row step: a few rows, and register
tiles."""

import pytest

from bench import activations, quality
from kernels import cpu
from models.tokenizer import Tokenizer

why = cpu.load()
pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(why is not None, reason=f"kernels.cpu unavailable: {why}"),
]


def test_rounded_activations_pass_the_gate_on_qwen(qwen05_dir):
    # Steps of 64 rows (register tiles), then one of 3 (the few-row products).
    ids = Tokenizer.from_dir(qwen05_dir).encode(quality.load_text("alice"))[: 2 * 64 + 3]
    ppl, costs = activations.chunk_costs(str(qwen05_dir), ids, [64])
    assert 1 < ppl < 100  # the reference reads the text as text
    for cost in costs.values():
        assert cost.rows == len(ids) - 1
        assert cost.kld_mean <= activations.MAX_KLD and cost.top1 >= activations.MIN_TOP1, cost
        assert abs(cost.perplexity - ppl) / ppl < 0.01

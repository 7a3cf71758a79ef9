"""The block-format Triton kernels (``kernels.triton_quant``) against gguf-py's dequantizer.

Without a GPU the kernels run under ``TRITON_INTERPRET=1`` (set by conftest before triton is
imported). The oracle is ``kernels.quant.dequantize`` (gguf-py, an implementation independent of
ours) and a float64 product. gguf-py quantizes only the 32-value formats; for q4_k, q5_k and q6_k
the blocks are random bytes with finite fp16 scales, which reach every bit of every field.

The rows stored after a weight's are NaN, so that a read past its last row shows in the output.
Tolerances, relative to the largest possible partial sum (|x| @ |W|^T): fp32 1e-5 (fp32 products
in the interpreter); 16-bit 1e-2, since weights enter the product rounded to the activations'
dtype, as in ``QuantLinear.forward``, and the output is rounded again. The row dequantizer must
equal the reference to the bit (in bf16: the interpreter rounds fp32 to bf16 toward zero).
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from kernels.backend import TritonBackend
from kernels.quant import QuantEmbedding, QuantLinear, dequantize, quantize
from kernels.weights import FORMATS, Weight

triton_quant = pytest.importorskip("kernels.triton_quant")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
BLOCK_FORMATS = [f for f in FORMATS if f != "dense"]
K_QUANTS = ("q4_k", "q5_k", "q6_k")
DECODE, PREFILL = triton_quant.GEMV_ROWS - 1, 37  # the GEMV kernel, the matmul kernel
TOL = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 1e-2}


def _random_blocks(fmt: str, rows: int, cols: int, gen: torch.Generator) -> torch.Tensor:
    """Random bytes in ``fmt``'s blocks, their fp16 scales finite (d, and dmin where there)."""
    spec = FORMATS[fmt]
    blocks = torch.randint(0, 256, (rows, cols // spec.block, spec.block_bytes), generator=gen)
    blocks = blocks.to(torch.uint8)
    for at in (208,) if fmt == "q6_k" else (0, 2):
        scale = torch.randn(rows, cols // spec.block, 1, generator=gen) * 0.01
        blocks[..., at : at + 2] = scale.half().view(torch.uint8)
    return blocks.reshape(rows, -1)


def _weight(fmt: str, rows: int, cols: int, seed: int, bias: bool = True) -> Weight:
    gen = torch.Generator().manual_seed(seed)
    if fmt in K_QUANTS:
        data = _random_blocks(fmt, rows, cols, gen)
    else:
        dense = torch.randn(rows, cols, generator=gen)
        data = dense if fmt == "dense" else quantize(dense, fmt)
    b = torch.randn(rows, generator=gen) if bias else None
    # The rows after the weight's, in the same storage, are NaN (0xff bytes: a NaN fp16 scale);
    # a kernel that reads past its last row turns its output into NaN.
    poison = torch.full((3, data.shape[1]), 0xFF if fmt != "dense" else float("nan"))
    data = torch.cat([data, poison.to(data.dtype)]).to(DEVICE)[:rows]
    return Weight(data, None if b is None else b.to(DEVICE), fmt)


def _cols(fmt: str) -> int:
    """Two blocks of a k-quant; three 32-value blocks, which end inside a 64-wide K tile."""
    return 512 if fmt in K_QUANTS else 96


def _reference(x: torch.Tensor, parts) -> tuple[torch.Tensor, torch.Tensor]:
    """(x W^T + bias in float64 over weights rounded to x's dtype, the bound |x| @ |W|^T)."""
    w = torch.cat([dequantize(p).to(x.dtype) for p in parts]).double()
    bias = torch.cat([
        p.bias.double() if p.bias is not None else torch.zeros(p.out_features, device=w.device)
        for p in parts
    ])  # fmt: skip
    x64 = x.double()
    return x64 @ w.T + bias, x64.abs() @ w.abs().T + bias.abs()


def _assert_close(actual, x, parts) -> None:
    expected, bound = _reference(x, parts)
    assert actual.dtype == x.dtype and actual.shape == expected.shape
    error = (actual.double() - expected).abs().max().item()
    assert error <= TOL[x.dtype] * bound.max().item(), (error, bound.max().item())


def test_kernels_run_under_interpreter_without_gpu():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present; kernels are compiled")
    from triton.runtime.interpreter import InterpretedFunction

    assert isinstance(triton_quant._quant_matmul_kernel, InterpretedFunction)


@pytest.mark.parametrize("rows", [DECODE, PREFILL])
@pytest.mark.parametrize("fmt", list(FORMATS))
def test_linear_matches_dequantized_product(fmt, rows):
    w = _weight(fmt, 13, _cols(fmt), seed=rows)  # 13 outputs: a partial tile
    x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    _assert_close(triton_quant.linear(x, (w,)), x, (w,))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("rows", [DECODE, PREFILL])
@pytest.mark.parametrize("fmt", ["q5_0", "q8_0", "q4_k", "q6_k"])
def test_linear_in_16_bit_rounds_weights_as_the_reference(fmt, rows, dtype):
    w = _weight(fmt, 13, _cols(fmt), seed=rows)
    x = torch.randn(rows, w.in_features, generator=torch.Generator().manual_seed(2))
    x = x.to(DEVICE, dtype)
    _assert_close(triton_quant.linear(x, (w,)), x, (w,))


@pytest.mark.parametrize("rows", [1, 2, DECODE])
@pytest.mark.parametrize("fmt", ["q4_k", "q6_k", "q8_0"])
def test_gemv_steps_over_rows_longer_than_its_tile(fmt, rows):
    # Six k-quant blocks: more than one step of the GEMV's tile, the last one partial.
    w = _weight(fmt, 13, 1536, seed=11)
    x = torch.randn(rows, 1536, generator=torch.Generator().manual_seed(12)).to(DEVICE)
    assert 1536 > triton_quant.gemv_tile(rows, 13, fmt).block_k
    _assert_close(triton_quant.linear(x, (w,)), x, (w,))


@pytest.mark.parametrize("rows", [1, triton_quant.GEMV_ROWS, PREFILL])
def test_mixed_format_parts_stack_by_output_rows(rows):
    # As a Q4_K_M file keeps v in q6_k beside q and k in q4_k; a part without a bias.
    parts = (
        _weight("q4_k", 24, 256, seed=3),
        _weight("q6_k", 7, 256, seed=4, bias=False),
        _weight("q8_0", 9, 256, seed=5),
    )
    x = torch.randn(2, rows, 256, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    y = triton_quant.linear(x, parts)
    assert y.shape == (2, rows, 40)
    _assert_close(y.reshape(-1, 40), x.reshape(-1, 256), parts)


def test_step_size_picks_the_kernel_and_no_rows_launch_nothing():
    w = _weight("q4_0", 8, 64, seed=7)
    for rows, kernel in ((1, "_quant_gemv_kernel"), (triton_quant.GEMV_ROWS, "_quant_gemv_kernel"),
                         (triton_quant.GEMV_ROWS + 1, "_quant_matmul_kernel")):  # fmt: skip
        _, launches = triton_quant.linear_launches(torch.empty(rows, 64), (w,))
        assert [launch.kernel.__name__ for launch in launches] == [kernel]
    out, launches = triton_quant.linear_launches(torch.empty(0, 64), (w,))
    assert out.shape == (0, 8) and launches == []


@pytest.mark.parametrize("fmt", list(FORMATS))
def test_row_dequantizer_equals_the_reference(fmt):
    w = _weight(fmt, 11, _cols(fmt), seed=8, bias=False)
    ids = torch.tensor([[10, 0, 3], [3, 7, 10]], device=DEVICE)
    expected = dequantize(w)[ids]
    assert torch.equal(triton_quant.embedding(ids, w), expected)
    assert torch.equal(triton_quant.embedding(ids, w, torch.float16), expected.half())
    assert torch.equal(triton_quant.embedding(ids, w, torch.bfloat16), _bfloat16(expected))


def _bfloat16(x: torch.Tensor) -> torch.Tensor:
    """x in bf16 as the kernels round it: to nearest even on a GPU, toward zero under the
    interpreter (its fp32 -> bf16 conversion drops the low 16 bits)."""
    if triton_quant._interpreted():
        return (x.view(torch.int32) & ~0xFFFF).view(torch.float32).bfloat16()
    return x.bfloat16()


class _Tiny(nn.Module):
    """An embedding and an LM head sharing one table, a quantized and a dense projection."""

    def __init__(self):
        super().__init__()
        table = _weight("q8_0", 10, 64, seed=9, bias=False)
        self.embed = QuantEmbedding(table)
        self.proj = QuantLinear((_weight("q5_0", 64, 64, seed=10),))
        self.lm_head = QuantLinear((table,))
        self.norm = nn.Linear(64, 64)

    def forward(self, ids):
        return self.lm_head(self.proj(self.embed(ids)))


def test_prepare_swaps_quant_modules_over_the_same_buffers():
    model = _Tiny().to(DEVICE)
    ids = torch.tensor([1, 9, 4], device=DEVICE)
    expected = model(ids)
    seen = []
    model.proj.register_forward_hook(lambda module, inputs, output: seen.append(output.shape))
    stored = {name: b.data_ptr() for name, b in model.named_buffers()}

    assert TritonBackend().prepare(model) == 3
    assert isinstance(model.embed, triton_quant.TritonQuantEmbedding)
    assert isinstance(model.proj, triton_quant.TritonQuantLinear)
    assert isinstance(model.lm_head, triton_quant.TritonQuantLinear)
    assert type(model.norm) is nn.Linear
    assert {name: b.data_ptr() for name, b in model.named_buffers()} == stored
    assert model.lm_head.parts[0].data is model.embed.data  # still tied
    assert TritonBackend().prepare(model) == 0  # already on the kernels

    actual = model(ids)
    assert seen == [(3, 64)]  # the hook came along (tensor parallelism's all-reduce)
    assert (actual - expected).abs().max() <= 1e-4 * expected.abs().max()


def test_prepare_hands_launches_to_the_backends_run():
    launches = []
    model = _Tiny().to(DEVICE)
    TritonBackend(run=launches.append).prepare(model)
    model.lm_head(torch.zeros(2, 64, device=DEVICE))
    model.embed(torch.zeros(3, dtype=torch.int64, device=DEVICE))
    kernels = [launch.kernel.__name__ for launch in launches]
    assert kernels == ["_quant_gemv_kernel", "_dequantize_rows_kernel"]

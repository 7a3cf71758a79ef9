"""A gated MLP's ``act(gate) * up`` in one Triton kernel, in the arithmetic of
``kernels.reference.act_mul``: the activation in fp32 rounded to the model's dtype, then the
product rounded (torch's two kernels, each rounding its output). GELU's tanh form is written
through the sigmoid: 0.5 x (1 + tanh(y)) = x sigmoid(2y)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kernels.launch import Launch

# transformers' hidden_act names -> the kernel's ACT.
_SILU = tl.constexpr(0)
_GELU_TANH = tl.constexpr(1)
ACTIVATIONS = {"silu": 0, "gelu_pytorch_tanh": 1, "gelu_tanh": 1}


@triton.jit
def _act_mul_kernel(x_ptr, out_ptr, N, ACT: tl.constexpr, BLOCK: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    j = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = j < N
    dtype = out_ptr.dtype.element_ty
    gate = tl.load(x_ptr + t * 2 * N + j, mask=ok, other=0.0).to(tl.float32)
    up = tl.load(x_ptr + t * 2 * N + N + j, mask=ok, other=0.0).to(tl.float32)
    if ACT == _SILU:
        a = gate / (1.0 + tl.exp(-gate))
    else:
        # 2 * sqrt(2 / pi), written out: the interpreter and the compiler both take a literal.
        a = gate * tl.sigmoid(1.5957691216057308 * (gate + 0.044715 * gate * gate * gate))
    y = a.to(dtype).to(tl.float32) * up
    tl.store(out_ptr + t * N + j, y.to(dtype), mask=ok)


def act_mul_launch(x: torch.Tensor, activation: str) -> tuple[torch.Tensor, Launch]:
    """``act(gate) * up`` of x [T, 2 * N] (gate columns, then up) into a new [T, N], and the
    launch that writes it."""
    x = x.contiguous()
    n = x.shape[-1] // 2
    out = torch.empty(*x.shape[:-1], n, dtype=x.dtype, device=x.device)
    block = min(triton.next_power_of_2(n), 1024)
    grid = (x.numel() // (2 * n), triton.cdiv(n, block))
    params = dict(ACT=ACTIVATIONS[activation], BLOCK=block, num_warps=4)
    return out, Launch(_act_mul_kernel, grid, (x, out, n), params)

"""The Triton gated activation (``kernels.triton_act``) against ``kernels.reference.act_mul``,
under the interpreter on the CPU (on a GPU where there is one)."""

from __future__ import annotations

import pytest
import torch

from kernels import reference
from kernels.backend import TritonBackend

pytest.importorskip("triton")
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
# fp32: exp and the sigmoid form of GELU's tanh differ from torch's by a few units of fp32;
# half precision rounds the activation and the product as torch does, one unit where the fp32
# activation straddles a rounding boundary. Triton's interpreter casts float32 to bfloat16 by
# truncation (``test_triton_rope``): on the CPU each bf16 rounding may be a unit further off.
TOL = {torch.float32: 1e-5, torch.float16: 2**-10,
       torch.bfloat16: 2**-7 if DEVICE == "cuda" else 3 * 2**-7}  # fmt: skip


# The interpreter's exp overflows to inf for large negative gates, as the GPU's does: the
# activation is then 0, as it should be.
@pytest.mark.filterwarnings("ignore:overflow encountered in exp")
@pytest.mark.parametrize("dtype", list(TOL))
@pytest.mark.parametrize("activation", sorted(reference.ACTIVATIONS))
@pytest.mark.parametrize("inter", [48, 1500])
def test_gate_times_up_equals_the_reference(dtype, activation, inter):
    g = torch.Generator().manual_seed(inter)
    x = (torch.randn(3, 2 * inter, generator=g) * 4).to(DEVICE, dtype)
    got = TritonBackend().act_mul(x, activation)
    expected = reference.act_mul(x, activation)
    assert got.dtype == dtype and got.shape == (3, inter)
    torch.testing.assert_close(got.float(), expected.float(), rtol=TOL[dtype], atol=TOL[dtype])

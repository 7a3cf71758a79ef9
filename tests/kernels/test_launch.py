"""``kernels.launch.Launcher``'s key against Triton's own specialization.

A launcher keeps one compiled variant per key and calls it for every later launch of that key,
so two launches with one key must be one variant of Triton's. The oracle is Triton's binder
(``tests/kernels/kernel_variants.Specializer``, what ``JITFunction.run`` derives at a launch),
which needs JIT kernels: it runs in a subprocess without ``TRITON_INTERPRET``, over launches of
the norm kernels whose tensors are aligned or not and whose sizes and strides are 1,
multiples of 16 or neither.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]

SCRIPT = """
import json, sys, torch
from tests.kernels.kernel_variants import Specializer, unavailable

if unavailable():
    print(json.dumps({"skip": unavailable()}))
    sys.exit()
from kernels import triton_norm
from kernels.launch import _specialization

specializer = Specializer(90)
pairs = []
for dim in (1, 16, 48, 100):
    for offset in (0, 1, 8):
        for width in (dim, dim + 1, dim + 16):  # rows' stride
            base = torch.randn(3 * width + offset, dtype=torch.bfloat16)
            x = base[offset:].view(3, width)[:, :dim]
            weight = torch.ones(dim, dtype=torch.bfloat16)
            _, launch = triton_norm.rms_norm_launch(x, weight, 1e-6, 0.0)
            _, _, both = triton_norm.add_rms_norm_launch(x, x.clone(), weight, 1e-6, 0.0)
            for found in (launch, both):
                ours = repr((found.kernel.__name__, _specialization(found.args),
                             tuple(found.params.items())))
                pairs.append((ours, specializer.variant(found).key))
print(json.dumps({"pairs": pairs}))
"""


def test_equal_launcher_keys_are_one_triton_variant():
    pytest.importorskip("triton")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    done = subprocess.run(
        [sys.executable, "-c", SCRIPT], cwd=ROOT, env=env, text=True, capture_output=True
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.splitlines()[-1])
    if "skip" in result:
        pytest.skip(result["skip"])
    pairs = result["pairs"]
    variants: dict[str, set[str]] = {}
    for ours, triton in pairs:
        variants.setdefault(ours, set()).add(triton)
    assert all(len(v) == 1 for v in variants.values()), variants
    # The launches differ where Triton specializes (alignment, sizes of 1 and of multiples of
    # 16): the check has variants to tell apart.
    assert len({t for _, t in pairs}) > 4

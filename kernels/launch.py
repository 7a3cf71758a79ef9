"""A Triton kernel launch as plain data: the kernel, its grid, its arguments, its meta-parameters.

The launch functions of ``triton_attention`` (its ``launches``) and ``rotary`` build these and
run them. Because a launch is data, the exact variants the launch code asks Triton for (the
constexprs, and the specialization Triton derives from the arguments) can also be compiled
ahead of time for a target GPU without one, from the same code path.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True)
class Launch:
    """``kernel[grid](*args, **params)``; ``params`` holds the constexprs, num_warps, num_stages."""

    kernel: Any
    grid: tuple[int, ...]
    args: tuple
    params: dict[str, Any]

    def __call__(self) -> None:
        self.kernel[self.grid](*self.args, **self.params)


def run(launches: Iterable[Launch]) -> None:
    """Launch each, in order."""
    for launch in launches:
        launch()


def _specialization(args: tuple) -> tuple:
    """A key at least as fine as the specialization Triton derives from the arguments: a
    tensor's dtype and whether it is 16-byte aligned; an integer's equality to 1, divisibility
    by 16 and width (i32, i64 or u64); other values' types."""
    key = []
    for a in args:
        if isinstance(a, torch.Tensor):
            key.append((a.dtype, a.data_ptr() % 16 == 0))
        elif isinstance(a, int) and not isinstance(a, bool):
            key.append((a == 1, a % 16 == 0, -(2**31) <= a < 2**31, a >= 2**63))
        else:
            key.append(type(a))
    return tuple(key)


class Launcher:
    """Runs launches as ``Launch`` does, calling each compiled variant's launcher directly after
    its first launch.

    Triton's ``kernel[grid](...)`` binds and specializes every argument and looks its variant
    up again on every call: on an H200's host 52 µs per decode-attention launch, of which its
    compiled launcher takes 17 (``python -m bench.step_profile --host``), and an eager step
    makes ~250 launches. Here a variant is kept under a key that refines Triton's own (the
    kernel, ``_specialization`` of the arguments, the params): launches with one key are one
    variant of Triton's, and a new key is launched through Triton once. The interpreter's
    kernels, which compile nothing, always are."""

    def __init__(self) -> None:
        # Resolved once, not per launch (triton is imported only where this backend runs).
        from triton import knobs
        from triton.runtime import driver
        from triton.runtime.jit import JITFunction

        self._knobs, self._driver, self._jit = knobs, driver, JITFunction
        self._variants: dict[tuple, tuple[Any, tuple] | None] = {}

    def __call__(self, launch: Launch) -> None:
        kernel = launch.kernel
        if not isinstance(kernel, self._jit):
            launch()
            return
        key = (kernel, _specialization(launch.args), tuple(launch.params.items()))
        found = self._variants.get(key)  # every param a constexpr or option: hashable
        if found is None:
            compiled = kernel[launch.grid](*launch.args, **launch.params)
            self._variants[key] = self.keep(kernel, compiled, launch)
            return
        compiled, rest = found
        grid = (*launch.grid, 1, 1)
        active, hooks = self._driver.active, self._knobs.runtime
        stream = active.get_current_stream(active.get_current_device())
        args = (*launch.args, *rest)
        compiled.run(
            grid[0], grid[1], grid[2], stream, compiled.function, compiled.packed_metadata,
            compiled.launch_metadata(launch.grid, stream, *args),
            hooks.launch_enter_hook, hooks.launch_exit_hook, *args,
        )  # fmt: skip

    @staticmethod
    def keep(kernel: Any, compiled: Any, launch: Launch) -> tuple[Any, tuple] | None:
        """The compiled variant and the values of the parameters after the positional
        arguments, in signature order (its launcher takes them all, constexprs included)."""
        if hasattr(compiled, "result"):  # an asynchronous compile's future
            compiled = compiled.result()
        rest = []
        for param in kernel.params[len(launch.args) :]:
            if param.name in launch.params:
                rest.append(launch.params[param.name])
            elif param.has_default:
                rest.append(param.default)
            else:
                return None
        return compiled, tuple(rest)

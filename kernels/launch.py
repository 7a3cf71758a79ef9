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

"""How much device memory the KV cache may take, measured at start-up.

The runner loads the weights, then runs one dummy step as large as the scheduler can make
(``max_num_batched_tokens`` prompt tokens, logits for every sequence); the peak of torch's
allocator during that step is the activation memory. What the process and others hold outside
torch's allocator (the CUDA context, library workspaces) is the rest of the device's used
memory. The KV cache gets what ``gpu_memory_utilization`` of the device leaves after all three.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.core.config import GIB


@dataclass(frozen=True)
class MemoryProfile:
    """Device memory in bytes at start-up."""

    total: int
    weights: int  # torch's allocation after loading the model
    activations: int  # the dummy step's peak above weights and its own small cache
    other: int  # in use on the device outside torch's allocator
    utilization: float  # the share of ``total`` kvserve may use

    @property
    def kv_cache(self) -> int:
        return int(self.total * self.utilization) - self.weights - self.activations - self.other

    def describe(self) -> str:
        parts = [
            ("weights", self.weights),
            ("activations", self.activations),
            ("outside torch", self.other),
            ("KV cache", max(self.kv_cache, 0)),
        ]
        used = ", ".join(f"{name} {n / GIB:.2f}" for name, n in parts)
        return f"memory (GiB) of {self.total / GIB:.2f} at {self.utilization:.0%}: {used}"

    def check(self, max_num_batched_tokens: int) -> int:
        """The KV cache's bytes; raises when nothing is left for it."""
        if self.kv_cache > 0:
            return self.kv_cache
        raise ValueError(
            f"No device memory left for the KV cache ({self.describe()}): raise "
            f"--gpu-memory-utilization, lower --max-num-batched-tokens "
            f"({max_num_batched_tokens}) or set --kv-cache-memory."
        )


def dummy_lengths(num_tokens: int, max_num_seqs: int, max_model_len: int) -> list[int]:
    """Prompt lengths of the largest step the scheduler can make: ``num_tokens`` tokens over as
    few sequences as ``max_model_len`` allows, but at least as many as it can sample for
    (``max_num_seqs``, when there are that many tokens), so logits are as wide as they get."""
    n = min(max(-(-num_tokens // max_model_len), max_num_seqs), num_tokens)
    base, extra = divmod(num_tokens, n)
    return [base + (i < extra) for i in range(n)]

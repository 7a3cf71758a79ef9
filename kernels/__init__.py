"""Attention over the paged KV cache: the backend interface and its registry (``backend``), a
plain torch reference that is also the CPU path (``reference``), Triton kernels for CUDA
(``triton_attention``, ``rotary``), and the per-step context model layers call (``paged``).

The bottom layer: it may import torch and triton, nothing else of kvserve.
"""

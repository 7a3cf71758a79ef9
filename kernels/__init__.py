"""Attention over the paged KV cache: the backend interface and its registry (``backend``), a
plain torch reference (``reference``), float32 CPU kernels in C++ (``cpu``, the default on x86
CPUs with AVX2), Triton kernels for CUDA (``triton_attention``, a package split by job,
``rotary``), and the per-step context model layers call (``paged``).

The bottom layer: it may import torch and triton, nothing else of kvserve.
"""

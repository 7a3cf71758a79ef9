"""The engine's pure-Python core: requests and their queue, the scheduler, the KV manager with
one table manager per cache spec over block pools, the context-overflow and preemption
policies, sampling parameters and plain outputs. It decides; ``engine.worker`` computes.

It may import ``engine.core`` and ``models.kv_spec`` only: no torch, no numpy (checked by
tests/test_layout.py), so every decision here is testable without tensors.
"""

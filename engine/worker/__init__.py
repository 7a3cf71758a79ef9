"""Everything in the engine that touches tensors: the model runner (one step from the
scheduler's plain output), its step inputs, CUDA graphs, tensor-parallel ranks, the sampler,
structured outputs and the memory profile, configured by one ``RunnerConfig``.

It may import ``engine.core``, models and kernels; never the engine's hub (``engine.args``,
``engine.llm_engine``), server or bench.
"""

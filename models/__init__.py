"""Model definitions and everything that describes a checkpoint: ``ModelConfig``, the KV-cache
specs a model declares (``kv_spec``), the ``CausalLM`` protocol every model follows
(``interface``), safetensors loading and the architecture registry (``loader``), GGUF import,
offline fetching, tokenizer and chat templates.

It may import kernels (attention, rotary layouts); never engine, server or bench.
"""

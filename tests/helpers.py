"""Pieces several test modules share: tiny random checkpoints, greedy generation that records
the logits each token was sampled from, and an app served on a background uvicorn."""

from __future__ import annotations

import contextlib
import socket
import threading
import time
from collections import defaultdict
from collections.abc import Iterator
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

    from engine import LLM

# Larger than the default 0.02 initializer range so attention (and routing) are far from uniform.
TINY_LLAMA = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.2,
    tie_word_embeddings=False,
)

# Untied embeddings: tied ones make random models repeat one token.
TINY_GEMMA3 = dict(
    vocab_size=256,
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    layer_types=["sliding_attention", "full_attention"],
    sliding_window=32,
    max_position_embeddings=1024,
    rope_parameters={
        "full_attention": {"rope_type": "default", "rope_theta": 1e6},
        "sliding_attention": {"rope_type": "default", "rope_theta": 1e4},
    },
    initializer_range=0.2,
    tie_word_embeddings=False,
    pad_token_id=0,
    bos_token_id=2,
    eos_token_id=1,
)

TINY_DEEPSEEK_V3 = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=96,
    moe_intermediate_size=32,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    first_k_dense_replace=1,
    n_routed_experts=8,
    num_experts_per_tok=2,
    n_group=2,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    q_lora_rank=32,
    kv_lora_rank=32,
    qk_nope_head_dim=16,
    qk_rope_head_dim=8,
    v_head_dim=16,
    max_position_embeddings=256,
    initializer_range=0.2,
)


def _random_model(config_class: str, model_class: str, fields: dict) -> torch.nn.Module:
    """A transformers model of ``model_class`` with seed-0 random fp32 weights."""
    import torch
    import transformers

    torch.manual_seed(0)
    config = getattr(transformers, config_class)(**fields)
    return getattr(transformers, model_class)(config).to(torch.float32).eval()


def tiny_llama(**overrides) -> torch.nn.Module:
    return _random_model("LlamaConfig", "LlamaForCausalLM", {**TINY_LLAMA, **overrides})


def tiny_gemma3(**overrides) -> torch.nn.Module:
    fields = {**TINY_GEMMA3, **overrides}
    fields.setdefault("num_hidden_layers", len(fields["layer_types"]))
    return _random_model("Gemma3TextConfig", "Gemma3ForCausalLM", fields)


def tiny_deepseek_v3_config(**overrides):
    import transformers

    return transformers.DeepseekV3Config(**{**TINY_DEEPSEEK_V3, **overrides})


def tiny_deepseek_v3(**overrides) -> torch.nn.Module:
    fields = {**TINY_DEEPSEEK_V3, **overrides}
    return _random_model("DeepseekV3Config", "DeepseekV3ForCausalLM", fields)


def naive_loop_moe(moe, x: torch.Tensor) -> torch.Tensor:
    """A ``models.deepseek_v3.MoE`` computed as it was before its routing stayed on the device:
    a loop over the chosen experts (``ids.unique().tolist()``), each run on its tokens and its
    output added at them in the model dtype. The reference for both of its paths."""
    import torch
    import torch.nn.functional as F

    weights, ids = moe.gate(x)
    experts = moe.experts
    out = torch.zeros_like(x)
    for e in ids.unique().tolist():
        token, slot = torch.where(ids == e)
        gate, up = F.linear(x[token], experts.gate_up_proj[e]).chunk(2, dim=-1)
        y = F.linear(experts.act(gate) * up, experts.down_proj[e])
        out.index_add_(0, token, (y * weights[token, slot, None]).to(x.dtype))
    if moe.shared_experts is not None:
        out = out + moe.shared_experts(x)
    return out


def save_tiny_llama(path, **overrides) -> torch.nn.Module:
    model = tiny_llama(**overrides)
    model.save_pretrained(path)
    return model


def save_tiny_gemma3(path, **overrides) -> torch.nn.Module:
    model = tiny_gemma3(**overrides)
    model.save_pretrained(path)
    return model


def save_tiny_deepseek_v3(path, **overrides) -> torch.nn.Module:
    model = tiny_deepseek_v3(**overrides)
    model.save_pretrained(path)
    return model


def random_prompt(n: int, vocab: int, seed: int = 0, low: int = 3) -> list[int]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return torch.randint(low, vocab, (n,), generator=g).tolist()


def generate_with_logits(llm: LLM, prompts: list[list[int]], monkeypatch, max_tokens: int):
    """Greedy generation; returns per prompt (token ids, the logits each token was sampled from)."""
    import torch

    from engine import SamplingParams

    seen = defaultdict(list)
    sample = llm.engine.runner.sampler.sample

    def recording_sample(logits, request_ids, *args):
        for rid, row in zip(request_ids, logits):
            seen[rid].append(row.detach().float().cpu())
        return sample(logits, request_ids, *args)

    monkeypatch.setattr(llm.engine.runner.sampler, "sample", recording_sample)
    params = SamplingParams(temperature=0, max_tokens=max_tokens, ignore_eos=True)
    outs = llm.generate(prompts, params)
    return [(o.outputs[0].token_ids, torch.stack(seen[o.request_id])) for o in outs]


def assert_greedy_as(tokens: list[int], ref: torch.Tensor, tol: float) -> None:
    """``tokens`` are the greedy choices of the reference logits ``ref`` [len(tokens), V] (the
    oracle run teacher-forced on ``tokens``), up to ties within ``tol``: half-precision logits
    of two correct computations round differently, and bfloat16 ones tie exactly now and then."""
    import torch

    ref = ref.float().cpu()
    chosen = ref.gather(1, torch.tensor(tokens)[:, None])[:, 0]
    best = ref.max(-1).values
    assert (chosen >= best - tol).all(), (tokens, ref.argmax(-1).tolist())
    clear = ref.topk(2).values.diff(dim=-1)[:, 0].abs() > tol
    assert torch.equal(torch.tensor(tokens)[clear], ref.argmax(-1)[clear])


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until_healthy(proc, url: str, seconds: float) -> None:
    """Polls ``url``/health until it answers 200; fails if the server process ``proc`` (a
    Popen) exits first or ``seconds`` pass."""
    import httpx

    deadline = time.monotonic() + seconds
    while True:
        assert proc.poll() is None, f"the server exited with {proc.returncode}"
        assert time.monotonic() < deadline, "the server did not start"
        with contextlib.suppress(httpx.HTTPError):
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        time.sleep(0.2)


@contextlib.contextmanager
def serve_in_thread(app, **config) -> Iterator[str]:
    """Runs ``app`` on uvicorn (``config``: more uvicorn.Config settings) in a background thread
    on a free loopback port; yields its base URL."""
    import uvicorn

    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", **config))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.01)
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        server.should_exit = True
        thread.join(timeout=10)
        sock.close()


def run_waves(llm: LLM, waves: list[list[tuple[list[int], int]]]):
    """Each wave's (prompt ids, max_tokens) requests together, greedy, a wave after the last
    one ended, checking the pools after every step: (tokens, cached prompt tokens) per request."""
    from engine import SamplingParams

    engine = llm.engine
    tokens, cached, n = {}, {}, 0
    for wave in waves:
        for prompt, max_tokens in wave:
            params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
            engine.add_request(f"r{n}", prompt, params)
            n += 1
        while engine.has_unfinished:
            for out in engine.step():
                tokens.setdefault(out.request_id, []).extend(out.outputs[0].token_ids)
                cached[out.request_id] = out.num_cached_tokens
            live = engine.scheduler.live_requests
            engine.kv.check_integrity([r.block_tables for r in live], [r.host_tables for r in live])
    ids = [f"r{i}" for i in range(n)]
    return [tokens[i] for i in ids], [cached[i] for i in ids]

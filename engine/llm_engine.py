"""The synchronous engine: requests in, one step at a time, output deltas out."""

from __future__ import annotations

import logging

import torch
from models.fetch import resolve_model
from models.tokenizer import Tokenizer

from engine.capacity import GIB, capacity, format_capacity, split_memory
from engine.config import EngineArgs, ModelConfig, SchedulerConfig
from engine.detokenizer import IncrementalDetokenizer
from engine.errors import RequestError
from engine.kv_manager import KVCacheManager
from engine.model_runner import ModelRunner
from engine.outputs import CompletionOutput, RequestOutput
from engine.request import Request
from engine.sampling_params import SamplingParams
from engine.scheduler import Scheduler
from kernels.backend import default_backend_name, get_backend

log = logging.getLogger("kvserve.engine")


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


class LLMEngine:
    def __init__(self, args: EngineArgs):
        self.args = args
        path = resolve_model(args.model)
        self.model_config = ModelConfig.from_dir(path)
        # Random-weight test checkpoints may come without a tokenizer: token-id prompts only.
        has_tokenizer = (path / "tokenizer.json").exists()
        self.tokenizer = Tokenizer.from_dir(path) if has_tokenizer else None
        self.device = resolve_device(args.device)
        dtype = args.dtype or ("bfloat16" if self.device.type == "cuda" else "float32")
        self.max_model_len = args.max_model_len or self.model_config.max_position_embeddings
        tokenizer_eos = self.tokenizer.eos_token_ids if self.tokenizer else ()
        eos = tuple(dict.fromkeys(tokenizer_eos + self.model_config.eos_token_ids))
        backend = get_backend(args.attention_backend or default_backend_name(self.device.type))
        self.runner = ModelRunner(self.model_config, dtype, self.device, backend, args.seed, eos)
        groups = self.runner.groups
        if args.num_kv_blocks is not None:
            num_blocks = (args.num_kv_blocks,) * len(groups)
        else:
            num_blocks = split_memory(
                groups, self._kv_memory_bytes(), args.block_size, self.max_model_len
            )
        self.runner.allocate_kv_cache(num_blocks, args.block_size)
        self.kv = KVCacheManager(groups, num_blocks, args.block_size)
        sched_config = SchedulerConfig(
            args.max_num_seqs, args.max_num_batched_tokens, self.max_model_len
        )
        self.scheduler = Scheduler(sched_config, self.kv, eos)
        self.capacity = capacity(groups, num_blocks, args.block_size, self.max_model_len)
        self._detokenizers: dict[str, IncrementalDetokenizer] = {}
        log.info(
            "model %s (%s, %s on %s, %s attention), max_model_len %d\n%s",
            self.model_config.name,
            self.model_config.architecture,
            dtype,
            self.device,
            backend.name,
            self.max_model_len,
            format_capacity(self.capacity, self.max_model_len),
        )

    def _kv_memory_bytes(self) -> int:
        if self.args.kv_cache_memory_gib is not None:
            return int(self.args.kv_cache_memory_gib * GIB)
        if self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            return int(free * 0.9)
        return GIB

    # -- requests -----------------------------------------------------------------------------

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        n = len(prompt_token_ids)
        if n == 0:
            raise RequestError("The prompt is empty.", param="prompt")
        limit = self.max_model_len
        vocab = self.model_config.vocab_size
        if any(not 0 <= t < vocab for t in prompt_token_ids):
            raise RequestError(f"Token ids must be in [0, {vocab}).", param="prompt")
        wanted = n + (params.max_tokens or 0)
        if n >= limit or wanted > limit:
            raise RequestError(
                f"This model's maximum context length is {limit} tokens. However, you requested "
                f"{wanted} tokens ({n} in the messages, {params.max_tokens or 0} in the "
                "completion). Please reduce the length of the messages or completion.",
                param="messages",
                code="context_length_exceeded",
            )
        if not self.kv.can_ever_fit(min(limit, wanted if params.max_tokens else limit)):
            raise RequestError(
                f"The KV cache cannot hold {wanted} tokens of one request; "
                "reduce the request or raise --num-kv-blocks / --kv-cache-memory.",
                param="max_tokens",
            )

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        params: SamplingParams,
        priority: int = 0,
    ) -> None:
        self.validate(prompt_token_ids, params)
        req = Request(request_id, list(prompt_token_ids), params, priority=priority)
        self.scheduler.add_request(req)
        self._detokenizers[request_id] = IncrementalDetokenizer(self.tokenizer, params)

    def abort(self, request_id: str) -> RequestOutput | None:
        req = self.scheduler.abort(request_id)
        if req is None:
            return None
        self._detokenizers.pop(request_id, None)
        return RequestOutput(
            request_id,
            req.prompt_token_ids,
            [CompletionOutput(0, finish_reason="abort")],
            finished=True,
        )

    @property
    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished

    # -- one step -----------------------------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        out = self.scheduler.schedule()
        if not out.scheduled:
            self.runner.sampler.forget(out.finished_ids)
            return []
        try:
            sampled = self.runner.execute(out)
        except Exception:
            log.exception("engine step failed; failing its %d requests", len(out.scheduled))
            return self._fail([s.request_id for s in out.scheduled])
        got = self.scheduler.update(out, {rid: tok for rid, (tok, _) in sampled.items()})
        return [self._output(req, sampled[req.request_id]) for req in got]

    def _output(self, req: Request, sample) -> RequestOutput:
        token, logprob = sample
        det = self._detokenizers[req.request_id]
        stop = det.add([token])
        if stop is not None:
            self.scheduler.finish(req, "stop", stop)
        elif req.finished:
            det.flush()
        if req.finished:
            del self._detokenizers[req.request_id]
        completion = CompletionOutput(
            0,
            det.take(req.finished),
            [token],
            [logprob] if logprob is not None else None,
            req.finish_reason,
            req.stop_reason,
        )
        return RequestOutput(req.request_id, req.prompt_token_ids, [completion], req.finished)

    def _fail(self, request_ids: list[str]) -> list[RequestOutput]:
        outs = []
        for rid in request_ids:
            req = self.scheduler.requests.get(rid)
            if req is None:
                continue
            self.scheduler.finish(req, "error")
            self._detokenizers.pop(rid, None)
            outs.append(
                RequestOutput(
                    rid, req.prompt_token_ids, [CompletionOutput(0, finish_reason="error")], True
                )
            )
        return outs

    def stats(self) -> dict:
        return {
            "running": len(self.scheduler.running),
            "waiting": len(self.scheduler.waiting),
            "kv_free_blocks": self.kv.num_free_blocks,
            "kv_total_blocks": self.kv.num_total_blocks,
            "kv_usage": self.kv.usage(),
            "num_preemptions": self.scheduler.num_preemptions,
        }

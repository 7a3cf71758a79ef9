"""A draft model for speculative decoding: proposes the tokens the target then verifies.

The draft is a second ``ModelRunner`` with a KV cache of its own that uses the target's block
ids: block b of a sequence holds the target's keys in the target's pools and the draft's in
the draft's. Every block decision the scheduler makes (growing, freeing, prefix sharing,
copy-on-write, ring copies, swaps, shifts) then holds for both caches, and the draft's cache ops
are the target's, carried out on its own tensors.

Before a step's forward pass the draft, for each speculating request, computes the tokens its
cache lacks (``draft_context``: what the target accepted since it last ran, or a whole prompt)
together with the request's last token, and then one token per step until it has drafted
``num_drafts``, each its most likely one. It writes its keys into the slots the scheduler gave
the drafts; those of rejected drafts are written over later, or given back with their blocks.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from engine.core.config import CacheConfig
from engine.core.sampling_params import SamplingParams
from engine.core.scheduler import ScheduledRequest, SchedulerOutput
from engine.core.speculation import LAG_TOKENS
from engine.worker.config import RunnerConfig
from engine.worker.model_runner import ModelRunner
from models.kv_spec import KVCacheGroup

# The draft's own choices are greedy: a draft proposes one token with certainty, which is what
# the sampler's acceptance rule assumes.
GREEDY = SamplingParams(max_tokens=None, temperature=0.0)


class Drafter:
    def __init__(self, config: RunnerConfig, max_num_batched_tokens: int):
        self.runner = ModelRunner(replace(config, kv_scores=False))  # it keeps recent tokens
        self.max_chunk = max_num_batched_tokens

    @property
    def groups(self) -> list[KVCacheGroup]:
        return self.runner.groups

    def check(self, target_groups: list[KVCacheGroup], target_vocab: int) -> None:
        """Raises unless the draft's cache can share the target's block tables, and its
        tokens are the target's."""
        draft = self.runner.config.model_config
        if draft.vocab_size != target_vocab:
            raise ValueError(
                f"the draft model's vocabulary ({draft.vocab_size} tokens) differs from the "
                f"target's ({target_vocab}): they do not share a tokenizer"
            )
        kinds = [(type(g.spec).__name__, g.spec.window) for g in self.groups]
        target = [(type(g.spec).__name__, g.spec.window) for g in target_groups]
        if kinds != target:
            raise ValueError(
                f"the draft model's KV-cache groups {kinds} differ from the target's {target}: "
                "its blocks cannot follow the target's tables"
            )

    def bytes_per_block(self, block_size: int) -> int:
        return sum(g.bytes_per_token for g in self.groups) * block_size

    def allocate_kv_cache(self, target: CacheConfig) -> None:
        """As many blocks as the target's pools (and swap pools), in the draft's shapes."""
        self.runner.allocate_kv_cache(
            CacheConfig(
                self.groups, target.block_size, target.num_blocks, target.num_host_blocks,
                target.prefix_caching,
            )
        )  # fmt: skip

    @torch.inference_mode()
    def propose(self, out: SchedulerOutput) -> tuple[int, float, float]:
        """Carries out the step's cache ops on the draft's cache, then fills the draft slots of
        the speculating requests (``token_ids`` gains ``num_drafts`` tokens). Returns how many
        one-token draft steps it ran after the first and the seconds they took (what one more
        drafted position costs), and the seconds it spent on prompt chunks and on contexts it
        had fallen behind on (a cost of starting to draft, not of drafting)."""
        if out.has_cache_ops:
            self.runner.apply_cache_ops(out, draft=True)
        start = time.perf_counter()
        todo = [s for s in out.scheduled if s.num_drafts]
        # Behind by more than a step's accepted drafts: it did not draft for a while.
        behind = {s.request_id for s in todo if len(s.draft_context) > LAG_TOKENS}
        work = [(s, s.draft_start, s.draft_context + s.token_ids)
                for s in out.scheduled if s.draft_prefill]  # fmt: skip
        work += [(s, s.draft_start, s.draft_context) for s in todo if s.request_id in behind]
        if work:
            self._compute(work)
        catch_up = time.perf_counter() - start
        if not todo:
            return 0, 0.0, catch_up
        drafts = self._first(todo, behind)
        steps, start = 0, time.perf_counter()
        while True:
            going = [s for s in todo if len(drafts[s.request_id]) < s.num_drafts]
            if not going:
                break
            batch = [
                self._chunk(s, drafts[s.request_id][-1:], s.start_pos + len(drafts[s.request_id]))
                for s in going
            ]
            for rid, token in self._greedy(batch, num_decodes=len(batch)).items():
                drafts[rid].append(token)
            steps += 1
        for s in todo:
            s.token_ids = s.token_ids + drafts[s.request_id]
        return steps, time.perf_counter() - start, catch_up

    def _first(self, todo: list[ScheduledRequest], behind: set[str]) -> dict[str, list[int]]:
        """Each request's first draft, computing first what the draft lacks of its context
        (but for the requests ``behind``, whose context is computed already)."""
        work = [
            (s, s.start_pos, s.token_ids[:1])
            if s.request_id in behind
            else (s, s.draft_start, s.draft_context + s.token_ids[:1])
            for s in todo
        ]
        rest = self._compute(work, keep_last=True)
        batch = [self._chunk(s, tokens, start) for s, start, tokens in rest]
        batch.sort(key=lambda s: len(s.token_ids) != 1)  # one-token sequences first
        num_decodes = sum(1 for s in batch if len(s.token_ids) == 1)
        return {rid: [t] for rid, t in self._greedy(batch, num_decodes).items()}

    def _compute(
        self, work: list[tuple[ScheduledRequest, int, list[int]]], keep_last: bool = False
    ) -> list[tuple[ScheduledRequest, int, list[int]]]:
        """Computes (request, start position, tokens) into the draft's cache, in pieces of at
        most a step's token budget; with ``keep_last`` each request's last piece is left, and
        returned, for a step that samples."""
        while True:
            long = [w for w in work if len(w[2]) > (self.max_chunk if keep_last else 0)]
            if not long:
                return work
            pieces, work = [], [w for w in work if w not in long]
            for s, start, tokens in long:
                head = tokens[: self.max_chunk]
                pieces.append(self._chunk(s, head, start, sample=False))
                if len(tokens) > len(head):
                    work.append((s, start + len(head), tokens[len(head) :]))
            self.runner.execute(SchedulerOutput(pieces, num_decodes=0))

    def _greedy(self, batch: list[ScheduledRequest], num_decodes: int) -> dict[str, int]:
        sampled, _ = self.runner.execute(SchedulerOutput(batch, num_decodes=num_decodes))
        return {rid: tokens[0][0] for rid, tokens in sampled.items()}

    @staticmethod
    def _chunk(
        s: ScheduledRequest, tokens: list[int], start: int, sample: bool = True
    ) -> ScheduledRequest:
        return ScheduledRequest(s.request_id, tokens, start, s.block_tables, sample, GREEDY, [], [])

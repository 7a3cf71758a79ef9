"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from engine.outputs import TokenLogprob
from engine.sampling_params import SamplingParams
from engine.structured import Grammars, apply_bitmask


class Sampler:
    def __init__(
        self,
        seed: int,
        eos_token_ids: tuple[int, ...],
        device: torch.device,
        grammars: Grammars | None = None,
    ):
        self.device = device
        self.eos_token_ids = list(eos_token_ids)
        self.generator = torch.Generator(device=device).manual_seed(seed)
        self.request_generators: dict[str, torch.Generator] = {}
        self.grammars = grammars  # None: no tokenizer, no constraints

    def forget(self, request_ids: list[str]) -> None:
        for rid in request_ids:
            self.request_generators.pop(rid, None)
        if self.grammars is not None:
            self.grammars.forget(request_ids)

    def start_masks(self, request_ids: list[str], params: list[SamplingParams]) -> Future | None:
        """Starts filling the token masks of the constrained requests among those about to be
        sampled (their rows in order); None when there are none."""
        constrained = [(r, p.structured) for r, p in zip(request_ids, params) if p.structured]
        return self.grammars.fill_async(constrained) if constrained else None

    def _generator(self, request_id: str, params: SamplingParams) -> torch.Generator:
        if params.seed is None:
            return self.generator
        gen = self.request_generators.get(request_id)
        if gen is None:
            gen = torch.Generator(device=self.device).manual_seed(params.seed % 2**64)
            self.request_generators[request_id] = gen
        return gen

    def sample(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        masks: Future | None = None,
    ) -> list[tuple[int, TokenLogprob | None] | Exception]:
        """logits [n, V] for n requests -> (token id, logprob record or None) per request, or
        the exception sampling raised for that request alone (the others are unaffected).
        ``masks``: from ``start_masks`` for the same requests."""
        logits = logits.float()
        if masks is not None:
            rows = [i for i, p in enumerate(params) if p.structured]
            constrained = logits[rows]
            apply_bitmask(constrained, masks.result())
            logits[rows] = constrained
        results = self._sample(logits, request_ids, params, prompt_ids, output_ids)
        for i, p in enumerate(params):
            if p.structured and not isinstance(results[i], Exception):
                try:
                    self.grammars.accept(request_ids[i], results[i][0])
                except Exception as e:
                    results[i] = e
        return results

    def _sample(self, logits, request_ids, params, prompt_ids, output_ids) -> list:
        if all(
            p.greedy
            and p.logprobs is None
            and not _has_penalty(p)
            and not p.logit_bias
            and not p.forced
            for p in params
        ):
            if all(p.min_tokens == 0 for p in params):
                return [(t, None) for t in logits.argmax(dim=-1).tolist()]
        results = []
        for i, p in enumerate(params):
            try:
                row = self._process(logits[i], p, prompt_ids[i], output_ids[i])
                if p.forced:
                    token = p.forced[len(output_ids[i])]
                else:
                    token = self._choose(row, p, self._generator(request_ids[i], p))
                results.append((token, _logprob(row, token, p.logprobs)))
            except Exception as e:
                results.append(e)
        return results

    def _process(
        self, row: torch.Tensor, p: SamplingParams, prompt: list[int], output: list[int]
    ) -> torch.Tensor:
        row = row.clone()
        if p.logit_bias:
            ids, bias = zip(*p.logit_bias)
            row[torch.tensor(ids, device=row.device)] += torch.tensor(bias, device=row.device)
        if p.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(prompt) | set(output)), device=row.device)
            if seen.numel():
                vals = row[seen]
                row[seen] = torch.where(
                    vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty
                )
        if (p.frequency_penalty or p.presence_penalty) and output:
            counts = torch.bincount(
                torch.tensor(output, device=row.device), minlength=row.shape[0]
            ).to(row.dtype)
            row -= p.frequency_penalty * counts + p.presence_penalty * (counts > 0).to(row.dtype)
        if len(output) < p.min_tokens:
            banned = list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)
            if banned:
                row[torch.tensor(banned, device=row.device)] = float("-inf")
        return row

    @staticmethod
    def _choose(row: torch.Tensor, p: SamplingParams, gen: torch.Generator) -> int:
        if p.greedy:
            return int(row.argmax())
        # Shifted to a maximum of 0 first, the scaled row cannot overflow at any temperature.
        row = (row - row.max()) / p.temperature
        if p.top_k > 0 and p.top_k < row.shape[0]:
            kth = torch.topk(row, p.top_k).values[-1]
            row = row.masked_fill(row < kth, float("-inf"))
        probs = torch.softmax(row, dim=-1)
        ids = None
        if p.top_p < 1.0:
            probs, ids = _top_p(probs, p.top_p)
        if p.min_p > 0:
            probs = probs.masked_fill(probs < p.min_p * probs.max(), 0.0)
        i = _draw(probs, gen)
        return i if ids is None else int(ids[i])


def _top_p(probs: torch.Tensor, top_p: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The most likely tokens until their mass reaches ``top_p`` (the one crossing it kept):
    their probabilities, descending, and ids. Sorts only as many candidates as it takes (a full
    sort of a large vocabulary costs more on a CPU than the decode step's attention)."""
    k, n = 64, probs.shape[0]
    while True:
        k = min(k, n)
        values, ids = probs.topk(k)
        before = values.cumsum(0) - values
        if k == n or before[-1] > top_p:
            keep = before <= top_p
            return values[keep], ids[keep]
        k *= 8


def _draw(probs: torch.Tensor, gen: torch.Generator) -> int:
    """An index drawn with probability proportional to ``probs`` (non-negative, some positive),
    by inverting the cumulative sum (``torch.multinomial`` is ~20x slower over a vocabulary)."""
    cdf = probs.cumsum(0)
    u = torch.rand(1, generator=gen, device=probs.device, dtype=cdf.dtype) * cdf[-1]
    i = int(torch.searchsorted(cdf, u, right=True))
    if i >= probs.shape[0]:  # u rounded up to the total: the last token with any mass
        i = int(probs.nonzero()[-1])
    return i


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def _logprob(row: torch.Tensor, token: int, k: int | None) -> TokenLogprob | None:
    return None if k is None else logprobs_of(row[None], [token], k)[0]


def logprobs_of(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of ``logits`` [n, V]: the logprob of its token and the ``k`` best."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    ids = torch.tensor(token_ids, device=logprobs.device)
    chosen = logprobs.gather(1, ids[:, None])
    ranks = ((logprobs > chosen).sum(1) + 1).tolist()
    chosen = chosen[:, 0].tolist()
    if k == 0:
        return [TokenLogprob(t, lp, [], r) for t, lp, r in zip(token_ids, chosen, ranks)]
    values, top_ids = torch.topk(logprobs, k)
    return [
        TokenLogprob(t, lp, list(zip(i, v)), r)
        for t, lp, i, v, r in zip(token_ids, chosen, top_ids.tolist(), values.tolist(), ranks)
    ]

"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

All rows of a step are processed together in tensor ops, and the chosen tokens come back to the
host in one transfer (one more when logprobs are asked for): on an accelerator a per-request
loop would wait on the device once per request per step.

The draw inverts each row's cumulative distribution at a uniform number drawn for that row:
one number per sampled row per step, from the request's own generator when it has a seed (so
its tokens do not depend on the rest of the batch), else from the shared one. The exponential
race (argmax of probs / q, q ~ Exp(1)) would need a number per vocabulary entry: over a
49152-token vocabulary that costs about 1 ms a row on a CPU, against 0.06 ms for the cumulative
sum and search.
"""

from __future__ import annotations

from concurrent.futures import Future
from itertools import chain

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
        # Top-p by a full sort of the rows asking for it where sorting is cheap and a host sync
        # is not; on a CPU, where sorting a large vocabulary costs more than the decode step's
        # attention, by a top-k grown until it holds the mass.
        self.full_sort = torch.device(device).type != "cpu"

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
        n, vocab = logits.shape
        results: list = [None] * n
        rows, shared, seeded, seeded_draws = [], [], [], []
        for i, p in enumerate(params):
            try:
                self._check(p, prompt_ids[i], output_ids[i], vocab)
                if not p.greedy and not p.forced:
                    if p.seed is None:
                        shared.append(i)
                    else:
                        gen = self._generator(request_ids[i], p)
                        seeded_draws.append(torch.rand(1, generator=gen, device=self.device))
                        seeded.append(i)
                rows.append(i)
            except Exception as e:
                results[i] = e
        if not rows:
            return results
        # Each sampled row's uniform number, drawn once: a retry row by row draws the same token.
        uniform = torch.zeros(n, device=logits.device)
        if shared:
            draws = torch.rand(len(shared), generator=self.generator, device=self.device)
            uniform[_index(shared, logits.device)] = draws.to(logits.device)
        if seeded:
            uniform[_index(seeded, logits.device)] = torch.cat(seeded_draws).to(logits.device)
        inputs = (logits, uniform, params, prompt_ids, output_ids)
        try:
            for i, result in zip(rows, self._sample_rows(rows, *inputs)):
                results[i] = result
        except Exception as e:
            if len(rows) == 1:
                results[rows[0]] = e
                return results
            # Something in the batch broke a batched op: row by row, so that only its own
            # request gets the exception.
            for i in rows:
                try:
                    results[i] = self._sample_rows([i], *inputs)[0]
                except Exception as e:
                    results[i] = e
        return results

    def _check(self, p: SamplingParams, prompt: list[int], output: list[int], vocab: int) -> None:
        """Refuses what would index outside the vocabulary (on an accelerator an index out of
        range breaks the device, not just the request) or past the forced tokens. The prompt
        and output ids of penalized requests are checked as their batch tensors are built."""
        if p.forced:
            if len(output) >= len(p.forced):
                raise IndexError(f"all {len(p.forced)} forced tokens are already out")
            _check_ids([p.forced[len(output)]], vocab, "forced")
        if p.logit_bias:
            _check_ids([t for t, _ in p.logit_bias], vocab, "logit_bias")
        if len(output) < p.min_tokens:
            _check_ids(self._banned(p), vocab, "stop_token_ids")

    def _banned(self, p: SamplingParams) -> list[int]:
        """The tokens ``min_tokens`` holds back."""
        return list(p.stop_token_ids) + ([] if p.ignore_eos else self.eos_token_ids)

    def _sample_rows(
        self,
        rows: list[int],
        logits: torch.Tensor,
        uniform: torch.Tensor,
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
    ) -> list[tuple[int, TokenLogprob | None]]:
        """The (token, logprob record or None) of each of ``rows``, batched."""
        params = [params[i] for i in rows]
        outputs = [output_ids[i] for i in rows]
        x = self._process(logits, rows, params, [prompt_ids[i] for i in rows], outputs)
        device = x.device
        tokens = torch.empty(len(rows), dtype=torch.long, device=device)
        greedy = [j for j, p in enumerate(params) if p.greedy and not p.forced]
        if len(greedy) == len(rows):
            tokens = x.argmax(dim=-1)
        elif greedy:
            index = _index(greedy, device)
            tokens[index] = x[index].argmax(dim=-1)
        drawn = [j for j, p in enumerate(params) if not p.greedy and not p.forced]
        if drawn:
            index = _index(drawn, device)
            rows_uniform = uniform[_index([rows[j] for j in drawn], device)]
            tokens[index] = self._draw(x[index], [params[j] for j in drawn], rows_uniform)
        forced = [j for j, p in enumerate(params) if p.forced]
        if forced:
            values = [params[j].forced[len(outputs[j])] for j in forced]
            tokens[_index(forced, device)] = torch.tensor(values, device=device)
        scored = [j for j, p in enumerate(params) if p.logprobs is not None]
        if scored:  # queued on the device before the tokens come back
            index = _index(scored, device)
            k = max(params[j].logprobs for j in scored)
            packed = _logprob_table(x[index], tokens[index], k)
        chosen = tokens.tolist()
        records: list[TokenLogprob | None] = [None] * len(rows)
        if scored:
            table = packed.tolist()
            ks = [params[j].logprobs for j in scored]
            for j, record in zip(scored, _records(table, [chosen[j] for j in scored], ks)):
                records[j] = record
        return list(zip(chosen, records))

    def _process(
        self,
        logits: torch.Tensor,
        rows: list[int],
        params: list[SamplingParams],
        prompts: list[list[int]],
        outputs: list[list[int]],
    ) -> torch.Tensor:
        """A copy of ``rows`` of ``logits`` with logit_bias, the repetition penalty (over the
        prompt and output tokens), the frequency and presence penalties (over the output
        tokens) and min_tokens' bans applied, in that order."""
        device = logits.device
        x = logits[_index(rows, device)]
        vocab = x.shape[1]
        bias = [(j, t, b) for j, p in enumerate(params) for t, b in p.logit_bias]
        if bias:
            js, ids, values = zip(*bias)
            at = (_index(js, device), _index(ids, device))
            x[at] += torch.tensor(values, device=device)
        repeat = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
        if repeat:
            index = _index(repeat, device)
            at = _flat([chain(prompts[j], outputs[j]) for j in repeat], vocab, device)
            seen = torch.zeros(len(repeat), vocab, dtype=torch.bool, device=device)
            seen[at] = True
            penalty = _column([params[j].repetition_penalty for j in repeat], device)
            vals = x[index]
            x[index] = torch.where(
                seen, torch.where(vals > 0, vals / penalty, vals * penalty), vals
            )
        counted = [
            j
            for j, p in enumerate(params)
            if (p.frequency_penalty or p.presence_penalty) and outputs[j]
        ]
        if counted:
            index = _index(counted, device)
            at = _flat([outputs[j] for j in counted], vocab, device)
            counts = torch.zeros(len(counted), vocab, device=device)
            counts.index_put_(at, torch.ones(at[0].shape[0], device=device), accumulate=True)
            frequency = _column([params[j].frequency_penalty for j in counted], device)
            presence = _column([params[j].presence_penalty for j in counted], device)
            x[index] -= frequency * counts + presence * (counts > 0).to(x.dtype)
        banned = [
            (j, t)
            for j, p in enumerate(params)
            if len(outputs[j]) < p.min_tokens
            for t in self._banned(p)
        ]
        if banned:
            js, ids = zip(*banned)
            x[_index(js, device), _index(ids, device)] = float("-inf")
        return x

    def _draw(
        self, x: torch.Tensor, params: list[SamplingParams], uniform: torch.Tensor
    ) -> torch.Tensor:
        """Processed logits [m, V] of sampled rows -> their tokens [m]: the first token whose
        cumulative mass reaches each row's uniform number (scaled to the mass kept)."""
        probs = self._filter(x, params)
        cdf = probs.cumsum(dim=-1)
        # 1 - u lies in (0, 1]: the target is positive and at most the kept mass, so the first
        # cumulative sum reaching it ends on a token with mass (a token without any adds
        # nothing, and cannot be the first to reach it).
        target = (1 - uniform[:, None]) * cdf[:, -1:]
        # Clamped: a row without mass anywhere (not a number) still names a token.
        return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=x.shape[1] - 1)

    def _filter(self, x: torch.Tensor, params: list[SamplingParams]) -> torch.Tensor:
        """Processed logits [m, V] of sampled rows -> their probabilities after temperature,
        top-k, top-p and min-p (those filtered out 0; not renormalized)."""
        device, vocab = x.device, x.shape[1]
        # Shifted to a maximum of 0 first, the scaled rows cannot overflow at any temperature.
        temperature = _column([p.temperature for p in params], device)
        x = (x - x.amax(dim=-1, keepdim=True)) / temperature
        top_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        if top_k:
            index = _index(top_k, device)
            ks = [params[j].top_k for j in top_k]
            vals = x[index]
            kth = vals.topk(max(ks)).values.gather(1, _index(ks, device)[:, None] - 1)
            x[index] = vals.masked_fill(vals < kth, float("-inf"))
        probs = torch.softmax(x, dim=-1)
        top_p = [j for j, p in enumerate(params) if p.top_p < 1.0]
        if top_p:
            index = _index(top_p, device)
            vals = probs[index]
            mass = torch.tensor([params[j].top_p for j in top_p], device=device)
            probs[index] = vals.masked_fill(~_top_p(vals, mass, self.full_sort), 0.0)
        min_p = [j for j, p in enumerate(params) if p.min_p > 0]
        if min_p:
            index = _index(min_p, device)
            vals = probs[index]
            floor = _column([params[j].min_p for j in min_p], device)
            probs[index] = vals.masked_fill(vals < floor * vals.amax(dim=-1, keepdim=True), 0.0)
        return probs


def _top_p(probs: torch.Tensor, top_p: torch.Tensor, full_sort: bool) -> torch.Tensor:
    """Per row of ``probs`` [m, V], which tokens to keep: the most likely until their mass
    reaches the row's ``top_p`` (the one crossing it kept). ``full_sort`` False sorts only as
    many candidates as it takes: a top-k grown until every row's mass is in."""
    m, n = probs.shape
    keep = torch.zeros(m, n, dtype=torch.bool, device=probs.device)
    if full_sort:
        values, ids = probs.sort(dim=-1, descending=True)
        before = values.cumsum(dim=-1) - values
        return keep.scatter_(1, ids, before <= top_p[:, None])
    todo = torch.arange(m, device=probs.device)
    k = 64
    while todo.numel():
        k = min(k, n)
        values, ids = probs[todo].topk(k)
        before = values.cumsum(dim=-1) - values
        done = before[:, -1] > top_p[todo] if k < n else torch.ones_like(todo, dtype=torch.bool)
        rows = todo[done]
        keep[rows[:, None], ids[done]] = before[done] <= top_p[rows, None]
        todo = todo[~done]
        k *= 8
    return keep


def _index(values, device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long).to(device)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values).to(device)[:, None]


def _check_ids(ids: list[int], vocab: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} names tokens outside the vocabulary of {vocab}: {bad[:5]}")


def _flat(lists, vocab: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """Token id lists -> (row, id) index tensors of every entry, checked on the host."""
    lists = [list(ids) for ids in lists]
    ids = torch.tensor(list(chain.from_iterable(lists)), dtype=torch.long)
    if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= vocab):
        raise ValueError(f"token ids outside the vocabulary of {vocab}")
    lengths = torch.tensor([len(ids) for ids in lists])
    rows = torch.repeat_interleave(torch.arange(len(lists)), lengths)
    return rows.to(device), ids.to(device)


def _has_penalty(p: SamplingParams) -> bool:
    return p.repetition_penalty != 1.0 or bool(p.frequency_penalty) or bool(p.presence_penalty)


def _logprob_table(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """Per row of ``logits`` [n, V], on its device, one float64 row to bring back at once:
    the logprob of its token, its rank, and the ``k`` best logprobs and their ids."""
    logprobs = torch.log_softmax(logits.float(), dim=-1)
    chosen = logprobs.gather(1, token_ids[:, None])
    ranks = (logprobs > chosen).sum(1, keepdim=True) + 1
    columns = [chosen, ranks]
    if k:
        values, top_ids = torch.topk(logprobs, k)
        columns += [values, top_ids]
    return torch.cat([c.double() for c in columns], dim=1)


def _records(table: list[list[float]], token_ids: list[int], ks: list[int]) -> list[TokenLogprob]:
    records = []
    for row, t, k in zip(table, token_ids, ks):
        width = (len(row) - 2) // 2
        values, ids = row[2 : 2 + k], row[2 + width : 2 + width + k]
        top = [(int(i), v) for i, v in zip(ids, values)]
        records.append(TokenLogprob(t, row[0], top, int(row[1])))
    return records


def logprobs_of(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """For each row of ``logits`` [n, V]: the logprob of its token and the ``k`` best."""
    ids = torch.tensor(token_ids, dtype=torch.long).to(logits.device)
    return _records(_logprob_table(logits, ids, k).tolist(), token_ids, [k] * len(token_ids))

"""Turn logits into next tokens: penalties, temperature, top-k/top-p/min-p, seeds, logprobs.

All rows of a step are processed together in tensor ops, and the chosen tokens come back to the
host in one transfer (one more when logprobs are asked for): on an accelerator a per-request
loop would wait on the device once per request per step.

The draw inverts each row's cumulative distribution at a uniform number drawn for that row:
one number per sampled row per step, from the request's own generator when it has a seed (so
its tokens do not depend on the rest of the batch), else from the shared one. The exponential
race (argmax of probs / q, q ~ Exp(1)) would need a number per vocabulary entry: over a
49152-token vocabulary that costs about 1 ms a row on a CPU, against 0.06 ms for the cumulative
sum and search. Rows with a top-p draw from their nucleus (sorted, found by a full sort on an
accelerator, by a growing top-k on a CPU); the others never sort.
"""

from __future__ import annotations

from collections import Counter
from concurrent.futures import Future
from itertools import chain

import numpy as np
import torch

from engine.core.errors import RequestError
from engine.core.outputs import TokenLogprob
from engine.core.sampling_params import SamplingParams
from engine.worker.structured import Grammars, allows_any_but, apply_bitmask

# On a CPU, the rows drawn together at most: about this many bytes of logits.
CPU_CHUNK_BYTES = 2 << 20


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

    def start_masks(
        self,
        request_ids: list[str],
        params: list[SamplingParams],
        drafts: list[list[int]] | None = None,
    ) -> Future | None:
        """Starts filling the token masks of the constrained requests among those about to be
        sampled (their rows in order, a row per draft more with ``drafts``); None when there
        are none."""
        drafts = drafts or [[] for _ in params]
        chosen = [i for i, p in enumerate(params) if p.structured]
        if not chosen:
            return None
        constrained = [(request_ids[i], params[i].structured) for i in chosen]
        return self.grammars.fill_async(constrained, [drafts[i] for i in chosen])

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
        refused: dict[int, Exception] = {}
        if masks is not None:
            chosen = [i for i, p in enumerate(params) if p.structured]
            bitmask = masks.result()
            for row, i in enumerate(chosen):
                found = self._refused(request_ids[i], params[i], [output_ids[i]], bitmask, row)
                if found is not None:
                    refused[i] = found[1]
            _apply_masks(logits, chosen, bitmask)
        results = self._sample(logits, request_ids, params, prompt_ids, output_ids, refused)
        for i, p in enumerate(params):
            if p.structured and not isinstance(results[i], Exception):
                try:
                    self.grammars.accept(request_ids[i], p.structured, results[i][0])
                except Exception as e:
                    results[i] = e
        return results

    def _refused(
        self,
        request_id: str,
        p: SamplingParams,
        outputs: list[list[int]],
        bitmask: np.ndarray,
        first_row: int,
    ) -> tuple[int, RequestError] | None:
        """For a constrained request with a mask row per entry of ``outputs`` (the output each
        row follows) from ``first_row`` of ``bitmask``: the first of its rows it cannot sample,
        and why, or None. Row 0 when its constraint has failed; else a row where min_tokens
        holds back all the constraint allows (it has ended before min_tokens), where any token
        sampled would be one the constraint refuses."""
        refused = self.grammars.refusal(request_id, p.structured)
        if refused is not None:
            return 0, refused
        held_back, vocab = p.held_back(self.eos_token_ids), self.grammars.vocab_size
        for t, output in enumerate(outputs):
            row = bitmask[first_row + t]
            if len(output) < p.min_tokens and not allows_any_but(row, held_back, vocab):
                message = (
                    f"min_tokens is {p.min_tokens}, but after {len(output)} token(s) the "
                    f"{p.structured.kind} allows only what min_tokens holds back (its end)."
                )
                return t, RequestError(message, param="min_tokens")
        return None

    def verify(
        self,
        logits: torch.Tensor,
        request_ids: list[str],
        params: list[SamplingParams],
        prompt_ids: list[list[int]],
        output_ids: list[list[int]],
        drafts: list[list[int]],
        masks: Future | None = None,
    ) -> list[list[tuple[int, TokenLogprob | None]] | Exception]:
        """Speculative decoding's sampling: request i has ``len(drafts[i]) + 1`` rows of
        ``logits`` (the target's at its last known token and at each draft). Returns per
        request the drafts it accepts and one token of the target's own after them, each
        with its logprob record, or the exception that request alone raised.

        Each row is sampled as decoding without drafts would sample it (the same filters, the
        same uniform number from the same generator, drawn only for the rows that yield a
        token), and a draft is accepted while it equals the row's token. For a draft that
        proposes one token with certainty this is Leviathan et al.'s rule: the draft d is kept
        with probability p(d), and otherwise the token follows p without d, renormalized; so
        each token follows p exactly, greedy tokens are the target's own, and a seeded request
        gives the tokens it gives without speculation."""
        if not any(drafts):
            singles = self.sample(logits, request_ids, params, prompt_ids, output_ids, masks)
            return [r if isinstance(r, Exception) else [r] for r in singles]
        logits = logits.float()
        counts = [len(d) + 1 for d in drafts]
        starts = [sum(counts[:i]) for i in range(len(counts))]
        refused: dict[int, tuple[int, RequestError]] = {}  # from the row on that it names
        if masks is not None:
            chosen = [i for i, p in enumerate(params) if p.structured]
            bitmask = masks.result()
            row = 0
            for i in chosen:
                outputs = [output_ids[i] + drafts[i][:t] for t in range(counts[i])]
                found = self._refused(request_ids[i], params[i], outputs, bitmask, row)
                if found is not None:
                    refused[i] = found
                row += counts[i]
            rows = [r for i in chosen for r in range(starts[i], starts[i] + counts[i])]
            _apply_masks(logits, rows, bitmask)
        results: list = [None] * len(params)
        for i, (rid, p, d) in enumerate(zip(request_ids, params, drafts)):
            try:
                rows = logits[starts[i] : starts[i] + counts[i]]
                results[i] = self._verify_one(rows, rid, p, prompt_ids[i], output_ids[i], d)
                # A refused row matters only if the drafts before it were accepted.
                if i in refused and len(results[i]) > refused[i][0]:
                    raise refused[i][1]
                if p.structured:
                    for token, _ in results[i]:
                        self.grammars.accept(rid, p.structured, token)
            except Exception as e:
                results[i] = e
        return results

    def _verify_one(
        self,
        logits: torch.Tensor,
        request_id: str,
        p: SamplingParams,
        prompt: list[int],
        output: list[int],
        drafts: list[int],
    ) -> list[tuple[int, TokenLogprob | None]]:
        """One request's rows [k + 1, V] against its ``k`` drafts (``verify``)."""
        k, vocab = len(drafts), logits.shape[1]
        outputs = [output + drafts[:t] for t in range(k + 1)]  # what each row follows
        for out in outputs:
            self._check(p, prompt, out, vocab)
        x = self._process(logits, list(range(k + 1)), [p] * (k + 1), [prompt] * (k + 1), outputs)
        if p.greedy:
            best = x.argmax(dim=-1).tolist()
            j = 0
            while j < k and best[j] == drafts[j]:
                j += 1
            tokens = best[: j + 1]
        else:
            gen = self._generator(request_id, p)
            tokens = []
            for t in range(k + 1):
                uniform = torch.rand(1, generator=gen, device=self.device).to(x.device)
                tokens.append(int(self._draw_rows(x[t : t + 1], [p], uniform)[0]))
                if t == k or tokens[-1] != drafts[t]:
                    break
        records: list[TokenLogprob | None] = [None] * len(tokens)
        if p.logprobs is not None:
            table = _logprob_table(x[: len(tokens)], _index(tokens, x.device), p.logprobs)
            records = _records(table.tolist(), tokens, [p.logprobs] * len(tokens))
        return list(zip(tokens, records))

    def _sample(self, logits, request_ids, params, prompt_ids, output_ids, refused) -> list:
        """``refused``: the exceptions of the rows not to sample, by row."""
        if all(
            p.greedy
            and p.logprobs is None
            and not _has_penalty(p)
            and not p.logit_bias
            and not p.forced
            for p in params
        ):
            if all(p.min_tokens == 0 for p in params):
                tokens = logits.argmax(dim=-1).tolist()
                return [refused.get(i, (t, None)) for i, t in enumerate(tokens)]
        n, vocab = logits.shape
        results: list = [None] * n
        rows, shared, seeded, seeded_draws = [], [], [], []
        for i, p in enumerate(params):
            if i in refused:
                results[i] = refused[i]
                continue
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
        draws = torch.rand(len(shared), generator=self.generator, device=self.device)
        if len(shared) == n:
            uniform = draws.to(logits.device)
        else:
            uniform = torch.zeros(n, device=logits.device)
            if shared:
                uniform[_index(shared, logits.device)] = draws.to(logits.device)
            if seeded:
                seeded_draws = torch.cat(seeded_draws).to(logits.device)
                uniform[_index(seeded, logits.device)] = seeded_draws
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
            _check_ids(p.held_back(self.eos_token_ids), vocab, "stop_token_ids")

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
        device, n = x.device, len(rows)
        tokens = torch.empty(n, dtype=torch.long, device=device)
        greedy = [j for j, p in enumerate(params) if p.greedy and not p.forced]
        if greedy:
            index = _subset(greedy, n, device)
            tokens = _put(tokens, index, _take(x, index).argmax(dim=-1))
        drawn = [j for j, p in enumerate(params) if not p.greedy and not p.forced]
        if drawn:
            index = _subset(drawn, n, device)
            at = _subset([rows[j] for j in drawn], uniform.shape[0], device)
            rows_uniform = _take(uniform, at)
            drawn_params = [params[j] for j in drawn]
            picked = self._draw(x, index, drawn_params, rows_uniform)
            tokens = _put(tokens, index, picked)
        forced = [j for j, p in enumerate(params) if p.forced]
        if forced:
            values = torch.tensor([params[j].forced[len(outputs[j])] for j in forced])
            tokens = _put(tokens, _subset(forced, n, device), _to(values, device))
        scored = [j for j, p in enumerate(params) if p.logprobs is not None]
        if scored:  # queued on the device before the tokens come back
            index = _subset(scored, n, device)
            k = max(params[j].logprobs for j in scored)
            packed = _logprob_table(_take(x, index), _take(tokens, index), k)
        chosen = tokens.tolist()
        records: list[TokenLogprob | None] = [None] * n
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
        """``rows`` of ``logits`` with logit_bias, the repetition penalty (over the prompt and
        output tokens), the frequency and presence penalties (over the output tokens) and
        min_tokens' bans applied, in that order; a copy unless there is nothing to apply. The
        penalties touch only the tokens seen, not whole rows."""
        device = logits.device
        bias = [(j, t, b) for j, p in enumerate(params) for t, b in p.logit_bias]
        repeat = [j for j, p in enumerate(params) if p.repetition_penalty != 1.0]
        counted = [
            j
            for j, p in enumerate(params)
            if (p.frequency_penalty or p.presence_penalty) and outputs[j]
        ]
        banned = [
            (j, t)
            for j, p in enumerate(params)
            if len(outputs[j]) < p.min_tokens
            for t in p.held_back(self.eos_token_ids)
        ]
        x = _take(logits, _subset(rows, logits.shape[0], device))
        if not (bias or repeat or counted or banned):
            return x
        if x is logits:
            x = x.clone()
        vocab = x.shape[1]
        if bias:
            js, ids, values = zip(*bias)
            at = (_index(js, device), _index(ids, device))
            x[at] += _to(torch.tensor(values), device)
        if repeat:
            js, ids = _seen([[prompts[j], outputs[j]] for j in repeat], vocab)
            penalty = torch.tensor([params[j].repetition_penalty for j in repeat])[js]
            at = (_to(torch.tensor(repeat)[js], device), _to(ids, device))
            penalty = _to(penalty, device)
            vals = x[at]
            x[at] = torch.where(vals > 0, vals / penalty, vals * penalty)
        if counted:
            js, ids, counts = _seen([[outputs[j]] for j in counted], vocab, count=True)
            frequency = torch.tensor([params[j].frequency_penalty for j in counted])[js]
            presence = torch.tensor([params[j].presence_penalty for j in counted])[js]
            at = (_to(torch.tensor(counted)[js], device), _to(ids, device))
            x[at] -= _to(frequency * counts.to(frequency.dtype) + presence, device)
        if banned:
            js, ids = zip(*banned)
            x[_index(js, device), _index(ids, device)] = float("-inf")
        return x

    def _draw(
        self,
        x: torch.Tensor,
        index: torch.Tensor | None,
        params: list[SamplingParams],
        uniform: torch.Tensor,
    ) -> torch.Tensor:
        """Rows ``index`` (None: all) of processed logits ``x`` [n, V], sampled rows -> their
        tokens [m], drawn from what the filters keep at each row's uniform number."""
        m, vocab = len(params), x.shape[1]
        rows = max(1, CPU_CHUNK_BYTES // (vocab * x.element_size()))
        if x.device.type != "cpu" or m <= rows:
            return self._draw_rows(_take(x, index), params, uniform, own=index is not None)
        # A few rows at a time stay in the cache through the passes over them (about 10%
        # faster at 64 rows), and their temporaries stay small: temporaries of the whole batch,
        # several times the size of its logits, can have glibc hand the memory back to the
        # system and fault it in again every step (2.5x slower at 64 rows, measured so).
        tokens = []
        for a in range(0, m, rows):
            part = x[a : a + rows] if index is None else x.index_select(0, index[a : a + rows])
            own = index is not None  # a copy, to scale in place; x's own rows are not
            tokens.append(self._draw_rows(part, params[a : a + rows], uniform[a : a + rows], own))
        return torch.cat(tokens)

    def _draw_rows(
        self,
        x: torch.Tensor,
        params: list[SamplingParams],
        uniform: torch.Tensor,
        own: bool = False,
    ) -> torch.Tensor:
        """Processed logits [m, V] of sampled rows -> their tokens [m]. ``own``: ``x`` may be
        overwritten."""
        m = x.shape[0]
        probs, nucleus = self._filter(x, params, own)
        if nucleus is None:
            return _invert(probs, uniform)
        tokens = torch.empty(m, dtype=torch.long, device=x.device)
        js, values, ids = nucleus
        index = _subset(js, m, x.device)
        picked = ids.gather(1, _invert(values, _take(uniform, index))[:, None]).squeeze(1)
        tokens = _put(tokens, index, picked)
        rest = sorted(set(range(m)) - set(js))
        if rest:
            index = _index(rest, x.device)
            tokens[index] = _invert(_take(probs, index), uniform[index])
        return tokens

    def _filter(
        self, x: torch.Tensor, params: list[SamplingParams], own: bool = False
    ) -> tuple[torch.Tensor, tuple[list[int], torch.Tensor, torch.Tensor] | None]:
        """Processed logits [m, V] of sampled rows -> their probabilities after temperature,
        top-k and min-p (those filtered out 0; not renormalized), and for the rows with a
        top-p, (those rows, their nucleus's probabilities after min-p, its token ids): their
        rows of the probabilities are left unfiltered, a draw takes them from the nucleus."""
        device, vocab = x.device, x.shape[1]
        m = len(params)
        # Shifted to a maximum of 0 first, the scaled rows cannot overflow at any temperature.
        temperature = _column([p.temperature for p in params], device)
        top = x.amax(dim=-1, keepdim=True)
        x = (x.sub_(top) if own else x - top).div_(temperature)
        # x and probs are this function's own now: the filters work in place.
        top_k = [j for j, p in enumerate(params) if 0 < p.top_k < vocab]
        if top_k:
            index = _subset(top_k, m, device)
            ks = [params[j].top_k for j in top_k]
            vals = _take(x, index)
            kth = vals.topk(max(ks)).values.gather(1, _index(ks, device)[:, None] - 1)
            x = _put(x, index, vals.masked_fill_(vals < kth, float("-inf")))
        probs = torch.softmax(x, dim=-1)
        top_p = [j for j, p in enumerate(params) if p.top_p < 1.0]
        nucleus = None
        if top_p:
            mass = _to(torch.tensor([params[j].top_p for j in top_p]), device)
            values, ids = _top_p(_take(probs, _subset(top_p, m, device)), mass, self.full_sort)
            # The nucleus is sorted: its first probability is the row's largest.
            values = _min_p(values, [params[j].min_p for j in top_p], values[:, :1])
            nucleus = (top_p, values, ids)
        rest = [j for j, p in enumerate(params) if p.top_p == 1.0 and p.min_p > 0]
        if rest:
            index = _subset(rest, m, device)
            vals = _take(probs, index)
            floors = [params[j].min_p for j in rest]
            probs = _put(probs, index, _min_p(vals, floors, vals.amax(dim=-1, keepdim=True)))
        return probs, nucleus


def _apply_masks(logits: torch.Tensor, rows: list[int], bitmask: np.ndarray) -> None:
    """The grammar masks (one per row of ``rows``, in order) applied to those rows, in place."""
    constrained = logits[rows]
    apply_bitmask(constrained, bitmask)
    logits[rows] = constrained


def _min_p(probs: torch.Tensor, min_p: list[float], top: torch.Tensor) -> torch.Tensor:
    """``probs`` [m, n] (its own) less those below each row's ``min_p`` of its largest
    probability ``top`` [m, 1], in place."""
    if not any(min_p):
        return probs
    low = probs < _to(torch.tensor(min_p), probs.device)[:, None] * top
    return probs.masked_fill_(low, 0.0)


def _invert(probs: torch.Tensor, uniform: torch.Tensor) -> torch.Tensor:
    """Per row of ``probs`` [m, n] (non-negative, not necessarily summing to 1; overwritten):
    the first column whose cumulative sum reaches the row's ``uniform`` number scaled to the
    total."""
    cdf = probs.cumsum_(dim=-1)
    # 1 - u lies in (0, 1]: the target is positive and at most the total, so the first
    # cumulative sum reaching it ends on a column with mass (one without any adds nothing, and
    # cannot be the first to reach it).
    target = (1 - uniform[:, None]) * cdf[:, -1:]
    # Clamped: a row without mass anywhere (not a number) still names a column.
    return torch.searchsorted(cdf, target).squeeze(1).clamp_(max=probs.shape[1] - 1)


def _top_p(
    probs: torch.Tensor, top_p: torch.Tensor, full_sort: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Per row of ``probs`` [m, V], its nucleus: the most likely tokens until their mass
    reaches the row's ``top_p`` (the one crossing it kept), as probabilities [m, K] in
    descending order, 0 past the nucleus, and their token ids [m, K]. ``full_sort`` False
    sorts only as many candidates as it takes: a top-k grown until every row's mass is in."""
    m, n = probs.shape
    if full_sort:
        values, ids = probs.sort(dim=-1, descending=True)
        before = values.cumsum(dim=-1) - values
        return values.masked_fill_(before > top_p[:, None], 0.0), ids
    groups = []
    todo = None  # all rows; then those whose nucleus is not in yet
    k = 64
    while True:
        k = min(k, n)
        values, ids = _take(probs, todo).topk(k)
        before = values.cumsum(dim=-1) - values
        mass = _take(top_p, todo)
        values.masked_fill_(before > mass[:, None], 0.0)
        done = None if k == n else before[:, -1] > mass
        if done is None or bool(done.all()):  # a host read: this path is for a CPU
            groups.append((todo, values, ids))
            break
        if todo is None:
            todo = torch.arange(m, device=probs.device)
        if bool(done.any()):
            groups.append((todo[done], values[done], ids[done]))
            todo = todo[~done]
        k *= 8
    if len(groups) == 1 and values.shape[0] == m:  # all rows in the same round
        return values, ids
    values = torch.zeros(m, k, device=probs.device)
    ids = torch.zeros(m, k, dtype=torch.long, device=probs.device)
    for rows, group_values, group_ids in groups:
        values[rows, : group_values.shape[1]] = group_values
        ids[rows, : group_ids.shape[1]] = group_ids
    return values, ids


def _to(host: torch.Tensor, device: torch.device) -> torch.Tensor:
    """A host tensor on ``device`` without waiting for the device's queued work (a blocking
    copy would: a sync per copy). The host memory is staged before the call returns."""
    return host.to(device, non_blocking=True)


def _index(values, device: torch.device) -> torch.Tensor:
    return _to(torch.tensor(values, dtype=torch.long), device)


def _subset(js: list[int], n: int, device: torch.device) -> torch.Tensor | None:
    """The index of rows ``js`` out of ``n``; None when they are all of them, in order."""
    return None if js == list(range(n)) else _index(js, device)


def _take(x: torch.Tensor, index: torch.Tensor | None) -> torch.Tensor:
    """Those rows of ``x`` (a copy), or ``x`` itself for all of them."""
    # index_select copies whole rows: on a CPU about 3x faster than x[index].
    return x if index is None else x.index_select(0, index)


def _put(x: torch.Tensor, index: torch.Tensor | None, rows: torch.Tensor) -> torch.Tensor:
    """``x`` with those rows replaced by ``rows`` (``rows`` itself for all of them)."""
    if index is None:
        return rows
    x[index] = rows
    return x


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return _to(torch.tensor(values), device)[:, None]


def _check_ids(ids: list[int], vocab: int, what: str) -> None:
    bad = [t for t in ids if not 0 <= t < vocab]
    if bad:
        raise ValueError(f"{what} names tokens outside the vocabulary of {vocab}: {bad[:5]}")


def _seen(groups: list[list[list[int]]], vocab: int, count: bool = False):
    """Per group of token id lists, its distinct ids (and with ``count``, how often each
    occurs): host tensors of (group, id[, count]) entries, checked against the vocabulary."""
    js, ids, counts = [], [], []
    for j, lists in enumerate(groups):
        if count:
            seen = Counter(chain.from_iterable(lists))
            counts += seen.values()
        else:
            seen = set().union(*lists)
        js += [j] * len(seen)
        ids += seen
    if ids and (min(ids) < 0 or max(ids) >= vocab):
        raise ValueError(f"token ids outside the vocabulary of {vocab}")
    tensors = torch.tensor(js, dtype=torch.long), torch.tensor(ids, dtype=torch.long)
    return (*tensors, torch.tensor(counts)) if count else tensors


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
    ids = _index(token_ids, logits.device)
    return _records(_logprob_table(logits, ids, k).tolist(), token_ids, [k] * len(token_ids))

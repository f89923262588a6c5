"""Sampler: the next token of every sequence in a step, from logits [batch, vocab].

The logits are adjusted and cut (`logits_processing`), greedy rows take the argmax, and each sampled row
draws by inverting its CDF over its candidates: with u ~ U(0, 1], the first candidate whose cumulative
probability reaches u * total is candidate i with probability probs[i], and a candidate of probability
0 is never reached. One uniform per row (not one per vocabulary entry, as an exponential race needs), so a
seeded request draws its own u from its own generator and gets the same tokens whatever else is in the
batch (which candidates a row has depends on its own parameters alone).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.sampling import logits_processing
from tinyserve.engine.sampling.logits_processing import AdjustParams, Candidates
from tinyserve.engine.loop.request import Request
from tinyserve.layers import ops
from tinyserve.types import TokenLogprob

# odd 64-bit constant mixed into the seed of sample i > 0 of a seeded n > 1 request: siblings must differ
_SIBLING_SEED_MIX = 0x9E3779B97F4A7C15


@dataclass
class TokenMasks:
    """The step's grammar masks: bitmask row i (one bit per token, 32 to an int32 word) says which tokens
    batch row rows[i] may draw."""

    bitmask: torch.Tensor  # [num_constrained, words] int32
    rows: list[int]

    def applied_to(self, logits: torch.Tensor) -> torch.Tensor:
        """A float32 copy of logits [batch, vocab] with -inf on every forbidden token."""
        masked = logits.float() if logits.dtype != torch.float32 else logits.clone()
        rows = torch.tensor(self.rows, dtype=torch.int64)
        ops.apply_token_bitmask(masked, self.bitmask, rows)
        return masked


@dataclass
class SamplerOutput:
    next_token_ids: list[int]  # one per request, in batch order
    logprobs: list[TokenLogprob | None]  # None where sampling_params.logprobs is None


class Sampler:
    """Picks one token per row. A seeded request draws from its own generator (`Request.generator`, made on
    its first draw on the logits' device, dropped with the request when it finishes); unseeded rows share
    one generator per device. A seeded generator advances by one draw per sampled token; the engine
    never resamples a token (preemption recomputes KV only), so the stream stays in step."""

    def __init__(self, seed: int = 0) -> None:
        self.seed = seed
        self._shared_generators: dict[torch.device, torch.Generator] = {}

    def __call__(self, logits: torch.Tensor, requests: list[Request],
                 token_masks: TokenMasks | None = None) -> SamplerOutput:
        assert logits.dim() == 2 and logits.shape[0] == len(requests), (
            f"logits {tuple(logits.shape)} for {len(requests)} requests"
        )
        # constrained rows draw from the grammar's allowed tokens; logprobs still come from the raw logits
        draw_from = logits if token_masks is None else token_masks.applied_to(logits)
        if all(logits_processing.is_plain_greedy(r) for r in requests):
            next_token_ids = ops.argmax(draw_from)  # the fast path: [batch], in our kernel on the CPU
        else:
            next_token_ids = self._sample(draw_from.float(), requests)
        return _to_output(logits, next_token_ids, requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """[batch, vocab] float32 -> [batch] int64."""
        logits = logits_processing.adjusted(logits, requests, AdjustParams.build(requests, logits.device))
        # every cut keeps a row's max, so greedy rows take the argmax of the adjusted logits
        if any(r.sampling_params.is_greedy for r in requests):
            next_ids = ops.argmax(logits)  # [batch]; sampled rows are overwritten below
        else:
            next_ids = torch.empty(len(requests), dtype=torch.int64, device=logits.device)
        groups = logits_processing.cut(logits, requests)
        if not groups:
            return next_ids
        uniforms = self.uniforms(requests, logits.device)  # [batch, 1]
        for candidates in groups:
            rows = torch.tensor(candidates.rows, device=logits.device)
            next_ids.index_copy_(0, rows, draw(candidates, uniforms.index_select(0, rows)))
        return next_ids

    def uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
        """[batch, 1] u ~ U(0, 1] (1 - U[0, 1), so a target is never 0, which would pick a leading
        0-probability token): one batched draw from the shared generator, then each seeded row redrawn
        from its own generator."""
        u = torch.empty(len(requests), 1, device=device)
        p = [r.sampling_params for r in requests]
        own = [(i, r) for i, r in enumerate(requests) if p[i].seed is not None and not p[i].is_greedy]
        if len(own) < len(requests):  # greedy rows draw too, so u is never left uninitialized
            u.uniform_(generator=self._shared_generator(device))
        for i, request in own:
            u[i].uniform_(generator=self._request_generator(request, device))
        return u.neg_().add_(1.0)

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        if device not in self._shared_generators:
            self._shared_generators[device] = torch.Generator(device=device).manual_seed(self.seed)
        return self._shared_generators[device]

    @staticmethod
    def _request_generator(request: Request, device: torch.device) -> torch.Generator:
        if request.generator is None:
            seed = request.sampling_params.seed ^ (request.index * _SIBLING_SEED_MIX % 2**64)
            request.generator = torch.Generator(device=device).manual_seed(seed)
        return request.generator


def draw(candidates: Candidates, uniforms: torch.Tensor) -> torch.Tensor:
    """[rows] token ids: the first candidate whose CDF reaches u * total (left side)."""
    cdf = candidates.logits.softmax(dim=-1).cumsum_(dim=-1)  # [rows, width]; flat across cut entries
    targets = uniforms * cdf[:, -1:]  # [rows, 1] in (0, total]
    positions = torch.searchsorted(cdf, targets).clamp_(max=cdf.shape[1] - 1)  # the clamp guards rounding
    return candidates.token_ids(_never_a_cut_token(cdf, positions, candidates.logits).squeeze(1))


def _never_a_cut_token(cdf: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A drawn token must have probability > 0: its CDF step is positive. torch's CPU cumsum runs along
    the row in order, accumulating in double, so the CDF never falls and this always holds there; a
    parallel scan (CUDA) can dip by a rounding step where a cut token sits, and such a row takes its
    argmax instead (never a cut token). Two gathers per row; on the host the common case skips the
    argmax, on a device the choice stays there (no sync before the step's one copy of the ids)."""
    step_end = cdf.gather(1, ids)
    step_start = torch.where(ids > 0, cdf.gather(1, (ids - 1).clamp_(min=0)), 0.0)
    has_mass = step_end > step_start  # [batch, 1]
    if has_mass.device.type == "cpu" and bool(has_mass.all()):
        return ids
    return torch.where(has_mass, ids, logits.argmax(dim=-1, keepdim=True))


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """[batch, vocab] float32 logits the sampler draws from (softmax of them): adjusted, and on sampled
    rows -inf on every token the cuts dropped; greedy rows adjusted only (their argmax is the draw)."""
    logits = logits_processing.adjusted(logits.float(), requests, AdjustParams.build(requests, logits.device))
    out = logits.clone()
    for candidates in logits_processing.cut(logits, requests):
        rows = torch.tensor(candidates.rows, device=logits.device)
        out.index_copy_(0, rows, candidates.over_vocab(logits.shape[1]))
    return out


def _to_output(logits: torch.Tensor, next_token_ids: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """The step's one host sync. Logprobs come from log_softmax of the raw logits (before any processing,
    as vLLM by default); they travel with the ids in one float32 tensor: exact for ids < 2**24, and
    no float64, which some devices lack."""
    lp_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not lp_rows:
        return SamplerOutput(next_token_ids.tolist(), [None] * len(requests))
    max_k = max(requests[i].sampling_params.logprobs for i in lp_rows)
    table = logprob_table(logits, next_token_ids, lp_rows, max_k)  # [num_lp_rows, 1 + 2 * max_k]
    flat = torch.cat([next_token_ids.float(), table.flatten()]).tolist()
    batch, width = len(requests), 1 + 2 * max_k
    logprobs: list[TokenLogprob | None] = [None] * batch
    for j, i in enumerate(lp_rows):
        row = flat[batch + j * width : batch + (j + 1) * width]
        k = requests[i].sampling_params.logprobs
        top = tuple((int(row[1 + max_k + m]), row[1 + m]) for m in range(k))
        logprobs[i] = TokenLogprob(token_id=int(flat[i]), logprob=row[0], top=top)
    return SamplerOutput([int(t) for t in flat[:batch]], logprobs)


def logprob_table(
    logits: torch.Tensor, next_token_ids: torch.Tensor, rows: list[int], k: int
) -> torch.Tensor:
    """[len(rows), 1 + 2k] float32 per row: the sampled token's logprob, top-k logprobs (best first),
    then their ids."""
    index = torch.tensor(rows, device=logits.device)
    logprobs = logits.index_select(0, index).float().log_softmax(dim=-1)  # [len(rows), vocab]
    chosen = logprobs.gather(1, next_token_ids.index_select(0, index)[:, None])  # [len(rows), 1]
    top = logprobs.topk(k, dim=-1)  # k == 0 gives empty [len(rows), 0]
    return torch.cat([chosen, top.values, top.indices.float()], dim=1)


def prompt_token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int) -> list[TokenLogprob]:
    """Row i's logprob of token_ids[i] (the prompt token that follows its position), its rank (1 + the tokens
    strictly more likely) and the top k, from raw logits [rows, vocab], as sampled tokens' logprobs are.
    One host sync; ids and ranks travel as float32, exact below 2**24."""
    logprobs = logits.float().log_softmax(dim=-1)  # [rows, vocab]
    ids = torch.tensor(token_ids, dtype=torch.int64, device=logits.device)[:, None]  # [rows, 1]
    chosen = logprobs.gather(1, ids)  # [rows, 1]
    ranks = (logprobs > chosen).sum(dim=-1, keepdim=True).float() + 1.0  # [rows, 1]
    top = logprobs.topk(k, dim=-1)  # k == 0 gives empty [rows, 0]
    table = torch.cat([chosen, ranks, top.values, top.indices.float()], dim=1).tolist()  # [rows, 2 + 2k]
    return [TokenLogprob(token_id=t, logprob=row[0], rank=int(row[1]),
                         top=tuple((int(row[2 + k + m]), row[2 + m]) for m in range(k)))
            for t, row in zip(token_ids, table)]

"""Sampler: the next token of every sequence in a step, from logits [batch, vocab].

Per-request parameters become tensors once per step and every processor runs on the whole batch, in the
order logit_bias -> repetition penalty -> presence/frequency penalties -> min_tokens -> temperature ->
top-k -> top-p -> min-p. The draw inverts each row's CDF: with u ~ U(0, 1], the first token whose cumulative
probability reaches u * total is token i with probability probs[i], and a token of probability 0 is never
reached. One uniform per row (not one per vocabulary entry, as an exponential race needs), so a seeded
request draws its own u from its own generator and gets the same tokens whatever else is in the batch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.request import Request
from tinyserve.layers import ops
from tinyserve.types import SamplingParams, TokenLogprob

_NEG_INF = float("-inf")
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
        if all(_is_plain_greedy(r) for r in requests):
            # the fast path. The float32 cast is exact and pays for itself: argmax over bfloat16 rows
            # is slower than cast + argmax on CPU (docs/PERFORMANCE.md, "Numbers behind the code's comments")
            next_token_ids = draw_from.float().argmax(dim=-1)  # [batch]
        else:
            next_token_ids = self._sample(draw_from.float(), requests)
        return _to_output(logits, next_token_ids, requests)

    def _sample(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """[batch, vocab] float32 -> [batch] int64."""
        params = _BatchParams.build(requests, logits.shape[1], logits.device)
        logits = _process(logits, requests, params)
        # the cuts always keep a row's max, so greedy rows can take the argmax of the processed logits
        greedy_ids = logits.argmax(dim=-1) if params.has_greedy else None
        if params.all_greedy:
            return greedy_ids
        cdf = logits.softmax(dim=-1).cumsum_(dim=-1)  # [batch, vocab]; flat across cut tokens
        targets = self._uniforms(requests, logits.device) * cdf[:, -1:]  # [batch, 1] in (0, total]
        # the first index whose CDF reaches the target (left side); the clamp only guards rounding
        sampled_ids = torch.searchsorted(cdf, targets).clamp_(max=cdf.shape[1] - 1)  # [batch, 1]
        sampled_ids = _never_a_cut_token(cdf, sampled_ids, logits).squeeze(1)
        return sampled_ids if greedy_ids is None else torch.where(params.is_greedy, greedy_ids, sampled_ids)

    def _uniforms(self, requests: list[Request], device: torch.device) -> torch.Tensor:
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


def _never_a_cut_token(cdf: torch.Tensor, ids: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """A drawn token must have probability > 0: its CDF step is positive. torch's CPU cumsum runs along
    the row in order, accumulating in double, so the CDF never falls and this always holds there; a
    parallel scan (CUDA) can dip by a rounding step where a cut token sits, and such a row takes its
    argmax instead (never a cut token). Two gathers per row, and a sync the step pays anyway."""
    step_end = cdf.gather(1, ids)
    step_start = torch.where(ids > 0, cdf.gather(1, (ids - 1).clamp_(min=0)), 0.0)
    has_mass = step_end > step_start  # [batch, 1]
    if bool(has_mass.all()):
        return ids
    return torch.where(has_mass, ids, logits.argmax(dim=-1, keepdim=True))


def process_logits(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """[batch, vocab] float32 logits the sampler draws from (softmax of them): bias, penalties, min_tokens,
    temperature (1 on greedy rows), then -inf on tokens cut by top-k, top-p or min-p."""
    return _process(logits.float(), requests, _BatchParams.build(requests, logits.shape[1], logits.device))


def _process(logits: torch.Tensor, requests: list[Request], params: _BatchParams) -> torch.Tensor:
    """Never writes into the caller's tensor: every step before the temperature division is out of place,
    and the in-place cuts run on that division's result."""
    logits = _apply_sparse_updates(logits, requests)
    logits = _apply_penalties(logits, requests, params)
    logits = logits / params.temperature
    if params.max_top_k is not None:
        _apply_top_k(logits, params)
    if params.top_p_rows:
        _apply_top_p(logits, params)
    if params.has_min_p:
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p): no softmax needed
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + params.log_min_p, _NEG_INF)
    return logits


@dataclass
class _BatchParams:
    """One step's sampling parameters on the logits' device (row i = requests[i]) plus host-side flags that
    decide which passes run at all."""

    temperature: torch.Tensor  # [batch, 1] float32; 1.0 on greedy rows, which take the argmax instead
    top_k: torch.Tensor  # [batch] int64 in [1, vocab]; vocab where off
    top_p: torch.Tensor  # [batch, 1] float32
    log_min_p: torch.Tensor  # [batch, 1] float32; -inf where off
    repetition_penalty: torch.Tensor  # [batch, 1]
    presence_penalty: torch.Tensor  # [batch, 1]
    frequency_penalty: torch.Tensor  # [batch, 1]
    is_greedy: torch.Tensor  # [batch] bool
    has_greedy: bool
    all_greedy: bool
    max_top_k: int | None  # largest top_k among rows that set one below vocab; None: no top-k pass
    top_p_rows: list[int]  # rows with top_p < 1, the only rows sorted
    has_min_p: bool
    has_repetition: bool
    has_presence_frequency: bool

    @classmethod
    def build(cls, requests: list[Request], vocab_size: int, device: torch.device) -> _BatchParams:
        sps = [r.sampling_params for r in requests]
        top_ks = [vocab_size if p.top_k is None else min(p.top_k, vocab_size) for p in sps]
        rows = [
            (1.0 if p.is_greedy else p.temperature, k, p.top_p, p.min_p, p.repetition_penalty,
             p.presence_penalty, p.frequency_penalty, float(p.is_greedy))
            for p, k in zip(sps, top_ks)
        ]
        # [batch, 8] float32 (top_k < 2**24 is exact): one host-to-device copy for all parameters
        table = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)
        cut_ks = [k for k in top_ks if k < vocab_size]
        return cls(
            temperature=table[:, 0:1], top_k=table[:, 1].long(), top_p=table[:, 2:3],
            log_min_p=table[:, 3:4].log(), repetition_penalty=table[:, 4:5], presence_penalty=table[:, 5:6],
            frequency_penalty=table[:, 6:7], is_greedy=table[:, 7].bool(),
            has_greedy=any(p.is_greedy for p in sps), all_greedy=all(p.is_greedy for p in sps),
            max_top_k=max(cut_ks) if cut_ks else None,
            top_p_rows=[i for i, p in enumerate(sps) if p.top_p < 1.0 and not p.is_greedy],
            has_min_p=any(p.min_p > 0.0 for p in sps),
            has_repetition=any(p.repetition_penalty != 1.0 for p in sps),
            has_presence_frequency=any(_has_presence_frequency(p) for p in sps),
        )


def _has_presence_frequency(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def _min_tokens_blocked_ids(request: Request) -> frozenset[int]:
    """Ids masked while the request is under min_tokens: its stop token ids, and EOS unless ignore_eos."""
    p = request.sampling_params
    if request.num_output_tokens >= p.min_tokens:
        return frozenset()
    return p.stop_token_id_set if p.ignore_eos else p.stop_token_id_set | request.eos_token_ids


def _is_plain_greedy(request: Request) -> bool:
    p = request.sampling_params
    return (p.is_greedy and not p.logit_bias_ids and p.repetition_penalty == 1.0
            and not _has_presence_frequency(p) and not _min_tokens_blocked_ids(request))


def _apply_sparse_updates(logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
    """Adds logit_bias, and -inf on ids blocked by min_tokens, in one index_put (out of place). Each
    request's bias ids and values were made tuples once (SamplingParams), so a row costs list extends.
    NOTE: -inf absorbs the penalties applied next, so masking here equals masking after them."""
    vocab_size = logits.shape[1]
    rows, cols, values = [], [], []
    for i, request in enumerate(requests):
        p = request.sampling_params
        if p.logit_bias_ids:
            if max(p.logit_bias_ids) >= vocab_size:  # LLMEngine.validate refuses these: a bug upstream
                raise ValueError(f"logit_bias ids of {request.request_id} reach beyond vocab {vocab_size}")
            rows += [i] * len(p.logit_bias_ids)
            cols += p.logit_bias_ids
            values += p.logit_bias_values
        # a stop id outside the logits' vocab can never be sampled: nothing to mask
        blocked = [t for t in _min_tokens_blocked_ids(request) if 0 <= t < vocab_size]
        rows += [i] * len(blocked)
        cols += blocked
        values += [_NEG_INF] * len(blocked)
    if not rows:
        return logits
    index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)  # [2, num_updates]
    value = torch.tensor(values, dtype=torch.float32).to(logits.device)  # [num_updates]
    return logits.index_put((index[0], index[1]), value, accumulate=True)


def _apply_penalties(logits: torch.Tensor, requests: list[Request], params: _BatchParams) -> torch.Tensor:
    """Repetition (transformers/CTRL: over prompt + output, score < 0 ? score * p : score / p), then
    OpenAI presence/frequency over output tokens: logit -= frequency * count + presence * (count > 0).
    Rows without a penalty pass an empty history and neutral values. Out of place."""
    vocab_size, device = logits.shape[1], logits.device
    if params.has_repetition:
        histories = [r.all_token_ids if r.sampling_params.repetition_penalty != 1.0 else [] for r in requests]
        seen = _token_counts(histories, vocab_size, device) > 0  # [batch, vocab] bool
        penalty = params.repetition_penalty
        logits = torch.where(seen, torch.where(logits < 0, logits * penalty, logits / penalty), logits)
    if params.has_presence_frequency:
        outputs = [r.output_token_ids if _has_presence_frequency(r.sampling_params) else [] for r in requests]
        counts = _token_counts(outputs, vocab_size, device)  # [batch, vocab] float32
        logits = logits - counts * params.frequency_penalty - (counts > 0).float() * params.presence_penalty
    return logits


def _token_counts(token_ids: list[list[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """[batch, vocab] float32 occurrences of each id in each row's list: rows padded with id vocab_size
    into [batch, max_len], scatter-added into vocab_size + 1 columns, pad column dropped. Ids beyond the
    logits' vocab (a prompt id the lm_head cannot emit) land in the pad column, as in transformers."""
    max_len = max(len(ids) for ids in token_ids)
    padded = [ids + [vocab_size] * (max_len - len(ids)) for ids in token_ids]
    index = torch.tensor(padded, dtype=torch.int64).clamp_(max=vocab_size).to(device)  # [batch, max_len]
    counts = torch.zeros(len(token_ids), vocab_size + 1, device=device)
    counts.scatter_add_(1, index, torch.ones(index.shape, device=device))
    return counts[:, :vocab_size]


def _apply_top_k(logits: torch.Tensor, params: _BatchParams) -> None:
    """In place: drop logits below each row's k-th largest (ties kept, as transformers' TopKLogitsWarper).
    One topk of the largest k in the batch, never a full sort."""
    top_values = logits.topk(params.max_top_k, dim=-1).values  # [batch, max_top_k], descending
    kth = params.top_k.clamp(max=params.max_top_k) - 1  # [batch]
    cutoff = top_values.gather(1, kth[:, None])  # [batch, 1]
    cutoff = torch.where(params.top_k[:, None] < logits.shape[1], cutoff, _NEG_INF)  # rows without top-k
    logits.masked_fill_(logits < cutoff, _NEG_INF)


def _apply_top_p(logits: torch.Tensor, params: _BatchParams) -> None:
    """In place: keep the shortest prefix of each top-p row, sorted descending, whose mass reaches top_p
    (a token stays if the mass strictly before it is < top_p, as transformers' TopPLogitsWarper with
    min_tokens_to_keep=1). The step's only sort, over the top-p rows alone."""
    all_rows = len(params.top_p_rows) == logits.shape[0]
    rows = None if all_rows else torch.tensor(params.top_p_rows, device=logits.device)
    sub = logits if rows is None else logits.index_select(0, rows)  # [num_top_p, vocab]
    top_p = params.top_p if rows is None else params.top_p.index_select(0, rows)  # [num_top_p, 1]
    sorted_logits = sub.sort(dim=-1, descending=True).values
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [num_top_p, vocab]
    # tokens before the first whose cumulative mass reaches top_p, plus that one
    num_keep = ((cumulative < top_p).sum(dim=-1, keepdim=True) + 1).clamp_(max=logits.shape[1])
    cutoff = sorted_logits.gather(1, num_keep - 1)  # [num_top_p, 1]; ties at the cutoff are kept
    if rows is None:
        logits.masked_fill_(logits < cutoff, _NEG_INF)
    else:
        logits.index_copy_(0, rows, sub.masked_fill(sub < cutoff, _NEG_INF))


def _to_output(logits: torch.Tensor, next_token_ids: torch.Tensor, requests: list[Request]) -> SamplerOutput:
    """The step's one host sync. Logprobs come from log_softmax of the raw logits (before any processing,
    as vLLM by default); they travel with the ids in one float32 tensor: exact for ids < 2**24, and
    no float64, which some devices lack."""
    lp_rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
    if not lp_rows:
        return SamplerOutput(next_token_ids.tolist(), [None] * len(requests))
    max_k = max(requests[i].sampling_params.logprobs for i in lp_rows)
    table = _logprob_table(logits, next_token_ids, lp_rows, max_k)  # [num_lp_rows, 1 + 2 * max_k]
    flat = torch.cat([next_token_ids.float(), table.flatten()]).tolist()
    batch, width = len(requests), 1 + 2 * max_k
    logprobs: list[TokenLogprob | None] = [None] * batch
    for j, i in enumerate(lp_rows):
        row = flat[batch + j * width : batch + (j + 1) * width]
        k = requests[i].sampling_params.logprobs
        top = tuple((int(row[1 + max_k + m]), row[1 + m]) for m in range(k))
        logprobs[i] = TokenLogprob(token_id=int(flat[i]), logprob=row[0], top=top)
    return SamplerOutput([int(t) for t in flat[:batch]], logprobs)


def _logprob_table(
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

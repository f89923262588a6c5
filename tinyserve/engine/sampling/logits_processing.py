"""What a step does to its logits before the draw, in the order logit_bias -> min_tokens -> repetition
penalty -> presence/frequency penalties -> temperature (`adjusted`, every row over the whole vocabulary),
then top-k -> top-p -> min-p (`cut`, sampled rows only: greedy rows take the argmax, which every cut keeps).

A row with top-k leaves the cuts as its k best tokens, found by one topk, not the vocabulary: its top-p and
min-p then run on those k sorted values and its draw on k entries. Without that, top-p sorts the whole
vocabulary of each row, and with the GGUF defaults (top-k 40, top-p 0.95) every request pays it."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.loop.request import Request
from tinyserve.types import SamplingParams

_NEG_INF = float("-inf")
# A temperature or repetition penalty is a float32 divisor here: one below float32's smallest normal (the API
# takes any value > 0) would round to 0, and a masked logit times 0 is NaN (the gRPC fuzz drew a token its
# grammar forbids that way). Held at it, a divided logit can still pass float32's range: held at its largest.
_F32 = torch.finfo(torch.float32)


@dataclass
class AdjustParams:
    """One step's parameters for the adjustments, on the logits' device (row i = requests[i]), plus the
    host-side flags that decide which passes run at all."""

    temperature: torch.Tensor  # [batch, 1] float32; 1.0 on greedy rows, which take the argmax instead
    repetition_penalty: torch.Tensor  # [batch, 1]
    presence_penalty: torch.Tensor  # [batch, 1]
    frequency_penalty: torch.Tensor  # [batch, 1]
    has_repetition: bool
    has_presence_frequency: bool

    @classmethod
    def build(cls, requests: list[Request], device: torch.device) -> AdjustParams:
        sps = [r.sampling_params for r in requests]
        rows = [(1.0 if p.is_greedy else max(p.temperature, _F32.tiny), max(p.repetition_penalty, _F32.tiny),
                 p.presence_penalty, p.frequency_penalty) for p in sps]
        table = torch.tensor(rows, dtype=torch.float32).to(device, non_blocking=True)  # one copy, [batch, 4]
        return cls(
            temperature=table[:, 0:1], repetition_penalty=table[:, 1:2], presence_penalty=table[:, 2:3],
            frequency_penalty=table[:, 3:4], has_repetition=any(p.repetition_penalty != 1.0 for p in sps),
            has_presence_frequency=any(_has_presence_frequency(p) for p in sps),
        )


@dataclass
class Candidates:
    """What a group of sampled rows may still draw: logits [rows, width] (-inf on cut entries) of the
    tokens ids [rows, width]; ids None when width is the whole vocabulary in id order."""

    rows: list[int]  # the group's rows in the batch
    logits: torch.Tensor
    ids: torch.Tensor | None

    def token_ids(self, positions: torch.Tensor) -> torch.Tensor:
        """[rows] positions in the width -> [rows] token ids."""
        return positions if self.ids is None else self.ids.gather(1, positions[:, None]).squeeze(1)

    def over_vocab(self, vocab_size: int) -> torch.Tensor:
        """[rows, vocab] with -inf on every token that is not a candidate."""
        if self.ids is None:
            return self.logits
        full = torch.full((len(self.rows), vocab_size), _NEG_INF, device=self.logits.device)
        return full.scatter_(1, self.ids, self.logits)


def adjusted(logits: torch.Tensor, requests: list[Request], params: AdjustParams) -> torch.Tensor:
    """[batch, vocab] float32 logits after bias, min_tokens, penalties and temperature. Out of place: the
    caller's tensor is never written. A logit divided past float32's range is held at its largest (_F32):
    +inf would make its row's softmax NaN."""
    logits = _apply_sparse_updates(logits, requests)
    logits = _apply_penalties(logits, requests, params)
    return (logits / params.temperature).clamp_(max=_F32.max)


def cut(logits: torch.Tensor, requests: list[Request]) -> list[Candidates]:
    """The cuts of every sampled (non-greedy) row of the adjusted logits, in at most two groups: rows
    with top-k (candidates: their k best) and rows without (the whole vocabulary)."""
    vocab_size = logits.shape[1]
    sampled = [i for i, r in enumerate(requests) if not r.sampling_params.is_greedy]
    with_k = [i for i in sampled if _top_k(requests[i].sampling_params, vocab_size) < vocab_size]
    without_k = [i for i in sampled if _top_k(requests[i].sampling_params, vocab_size) == vocab_size]
    groups = []
    for rows, cut_group in ((with_k, _cut_top_k_rows), (without_k, _cut_full_rows)):
        if rows:
            sps = [requests[i].sampling_params for i in rows]
            sub = logits if len(rows) == logits.shape[0] else logits.index_select(
                0, torch.tensor(rows, device=logits.device))
            groups.append(cut_group(rows, sub, sps))
    return groups


def _top_k(p: SamplingParams, vocab_size: int) -> int:
    return vocab_size if p.top_k is None else min(p.top_k, vocab_size)


def _column(values: list[float], device: torch.device) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32).to(device, non_blocking=True)[:, None]  # [rows, 1]


def _cut_top_k_rows(rows: list[int], logits: torch.Tensor, sps: list[SamplingParams]) -> Candidates:
    """One topk of the group's largest k; a row keeps exactly its own k best, as llama.cpp (transformers
    also keeps a token tied with the k-th; keeping ties only as far as the group's largest k reaches
    would make a row's candidates depend on the batch). The values come sorted, so top-p needs no sort
    and min-p's max is the first column."""
    vocab_size, device = logits.shape[1], logits.device
    ks = [_top_k(p, vocab_size) for p in sps]
    values, ids = logits.topk(max(ks), dim=-1)  # [rows, max_k], descending
    beyond_k = torch.arange(values.shape[1], device=device) >= torch.tensor(ks, device=device)[:, None]
    values.masked_fill_(beyond_k, _NEG_INF)
    if any(p.top_p < 1.0 for p in sps):
        _apply_top_p_sorted(values, values, _column([p.top_p if p.top_p < 1.0 else 2.0 for p in sps], device))
    if any(p.min_p > 0.0 for p in sps):
        log_min_p = _column([p.min_p for p in sps], device).log_()  # -inf where off
        values.masked_fill_(values < values[:, :1] + log_min_p, _NEG_INF)
    return Candidates(rows, values, ids)


def _cut_full_rows(rows: list[int], logits: torch.Tensor, sps: list[SamplingParams]) -> Candidates:
    """Rows without top-k keep the whole vocabulary in id order; those with top-p sort their row (the
    step's only sort)."""
    device = logits.device  # the cuts are in place: the whole batch's adjusted logits, or a copy of rows
    top_p_rows = [j for j, p in enumerate(sps) if p.top_p < 1.0]
    if len(top_p_rows) == len(sps):
        top_p = _column([p.top_p for p in sps], device)
        _apply_top_p_sorted(logits, logits.sort(dim=-1, descending=True).values, top_p)
    elif top_p_rows:
        index = torch.tensor(top_p_rows, device=device)
        sub = logits.index_select(0, index)  # [num_top_p, vocab]
        top_p = _column([sps[j].top_p for j in top_p_rows], device)
        _apply_top_p_sorted(sub, sub.sort(dim=-1, descending=True).values, top_p)
        logits.index_copy_(0, index, sub)
    if any(p.min_p > 0.0 for p in sps):
        # p < min_p * p_max  <=>  logit < logit_max + log(min_p): no softmax needed
        log_min_p = _column([p.min_p for p in sps], device).log_()
        logits.masked_fill_(logits < logits.amax(dim=-1, keepdim=True) + log_min_p, _NEG_INF)
    return Candidates(rows, logits, None)


def _apply_top_p_sorted(logits: torch.Tensor, sorted_logits: torch.Tensor, top_p: torch.Tensor) -> None:
    """In place on logits: keep the shortest prefix of each row's sorted_logits (its values, descending,
    possibly a -inf tail) whose mass reaches top_p (a token stays if the mass strictly before it is < top_p,
    as transformers' TopPLogitsWarper with min_tokens_to_keep=1); ties at the cutoff are kept. top_p above
    1 keeps everything."""
    cumulative = sorted_logits.softmax(dim=-1).cumsum(dim=-1)  # [rows, width]
    # tokens before the first whose cumulative mass reaches top_p, plus that one
    num_keep = ((cumulative < top_p).sum(dim=-1, keepdim=True) + 1).clamp_(max=sorted_logits.shape[1])
    cutoff = sorted_logits.gather(1, num_keep - 1)  # [rows, 1]
    logits.masked_fill_(logits < cutoff, _NEG_INF)


def _has_presence_frequency(p: SamplingParams) -> bool:
    return p.presence_penalty != 0.0 or p.frequency_penalty != 0.0


def min_tokens_blocked_ids(request: Request) -> frozenset[int]:
    """Ids masked while the request is under min_tokens: its stop token ids, and EOS unless ignore_eos."""
    p = request.sampling_params
    if request.num_output_tokens >= p.min_tokens:
        return frozenset()
    return p.stop_token_id_set if p.ignore_eos else p.stop_token_id_set | request.eos_token_ids


def is_plain_greedy(request: Request) -> bool:
    p = request.sampling_params
    return (p.is_greedy and not p.logit_bias_ids and p.repetition_penalty == 1.0
            and not _has_presence_frequency(p) and not min_tokens_blocked_ids(request))


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
        blocked = [t for t in min_tokens_blocked_ids(request) if 0 <= t < vocab_size]
        rows += [i] * len(blocked)
        cols += blocked
        values += [_NEG_INF] * len(blocked)
    if not rows:
        return logits
    index = torch.tensor([rows, cols], dtype=torch.int64).to(logits.device)  # [2, num_updates]
    value = torch.tensor(values, dtype=torch.float32).to(logits.device)  # [num_updates]
    return logits.index_put((index[0], index[1]), value, accumulate=True)


def _apply_penalties(logits: torch.Tensor, requests: list[Request], params: AdjustParams) -> torch.Tensor:
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

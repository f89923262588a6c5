"""Verifying proposed tokens so that the output has exactly the target model's distribution (the rule of
Leviathan et al. 2023 and Chen et al. 2023, for a proposal that is a point mass, as prompt lookup's is).

A sequence with proposal x_1..x_k has k + 1 rows of logits: row j is the target's distribution p_j after
the sequence and x_1..x_j. Each row is processed exactly as the sampler processes a row (bias, temperature,
top-k, top-p, min-p: logits_processing), so p_j is the distribution plain decoding would draw from. Then,
for j = 1..k in order: accept x_j with probability p_j(x_j); at the first rejection draw the token from the
residual, p_j with x_j removed and renormalised, and stop; if all k are accepted, draw one more token from
p_{k+1}. Accepting with probability p(x) and otherwise drawing from norm(p - p(x) * onehot(x)) gives token x
with probability p(x) and any other y with (1 - p(x)) * p(y) / (1 - p(x)) = p(y): the target's own draw.
A greedy row accepts while x_j is its argmax and otherwise emits the argmax, the token plain greedy emits.

Uniforms come from the request's own generator when it is seeded (Sampler.uniforms), so a seeded request is
reproducible with speculation on; the values it draws differ from plain decoding's, the distribution not.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tinyserve.engine.sampling import logits_processing
from tinyserve.engine.sampling.logits_processing import AdjustParams, Candidates
from tinyserve.engine.loop.request import Request
from tinyserve.engine.sampling.sampler import Sampler, TokenMasks, draw, logprob_table
from tinyserve.layers import ops
from tinyserve.types import TokenLogprob

_NEG_INF = float("-inf")


@dataclass
class VerifyOutput:
    token_ids: list[list[int]]  # per request: its accepted proposals, then the target's token
    logprobs: list[list[TokenLogprob] | None]  # per request, one per token, where asked for
    num_accepted: list[int]  # per request: how many of its proposed tokens were accepted


def verify(sampler: Sampler, logits: torch.Tensor, requests: list[Request], proposals: list[list[int]],
           token_masks: TokenMasks | None = None) -> VerifyOutput:
    """logits [sum(1 + len(p) for p in proposals), vocab]: each request's rows in order, as above."""
    row_requests = [r for r, p in zip(requests, proposals) for _ in range(1 + len(p))]
    assert logits.dim() == 2 and logits.shape[0] == len(row_requests), f"logits {tuple(logits.shape)}"
    device = logits.device
    draw_from = logits.float() if token_masks is None else token_masks.applied_to(logits)
    adjusted = logits_processing.adjusted(draw_from, row_requests, AdjustParams.build(row_requests, device))
    proposed = torch.tensor([t for p in proposals for t in [*p, 0]], device=device)  # [rows]; 0 on last rows
    has_proposal = torch.tensor([j < len(p) for p in proposals for j in range(1 + len(p))], device=device)
    # p_j(x_j) per row, and the token drawn in case of rejection (or after the last proposal)
    drawn = ops.argmax(adjusted)  # greedy rows keep it: the argmax of p_j
    is_greedy = torch.tensor([r.sampling_params.is_greedy for r in row_requests], device=device)
    accept_prob = (is_greedy & (drawn == proposed)).float()  # sampled rows get p_j(x_j) below
    groups = logits_processing.cut(adjusted, row_requests)
    if groups:
        draw_uniforms = sampler.uniforms(row_requests, device)  # [rows, 1]
        for candidates in groups:
            rows = torch.tensor(candidates.rows, device=device)
            prob, residual = _split(candidates, proposed.index_select(0, rows), has_proposal.index_select(0, rows))
            accept_prob.index_copy_(0, rows, prob)
            drawn.index_copy_(0, rows, draw(residual, draw_uniforms.index_select(0, rows)))
    spec_rows = [i for i, is_proposal in enumerate(has_proposal.tolist()) if is_proposal]
    accept_uniforms = sampler.uniforms([row_requests[i] for i in spec_rows], device)[:, 0]  # [spec rows]
    is_accepted = torch.zeros(len(row_requests), dtype=torch.bool, device=device)
    spec_index = torch.tensor(spec_rows, dtype=torch.int64, device=device)
    is_accepted.index_copy_(0, spec_index, accept_uniforms <= accept_prob.index_select(0, spec_index))
    emitted = torch.where(is_accepted, proposed, drawn)  # [rows]: the token each row would emit
    return _outputs(logits, requests, proposals, emitted, is_accepted)


def _split(candidates: Candidates, proposed: torch.Tensor,
           has_proposal: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(p(x) per row [rows], the residual's candidates: p with x removed, on rows that propose x)."""
    if candidates.ids is None:
        is_proposed = torch.zeros_like(candidates.logits, dtype=torch.bool).scatter_(1, proposed[:, None], True)
    else:
        is_proposed = candidates.ids == proposed[:, None]  # [rows, width]; at most one True per row
    probs = candidates.logits.softmax(dim=-1)
    prob = (probs * is_proposed).sum(dim=-1)
    # a row whose p(x) is 1 has an empty residual (all -inf); it always accepts, so its draw is never used
    residual = candidates.logits.masked_fill(is_proposed & has_proposal[:, None], _NEG_INF)
    return prob, Candidates(candidates.rows, residual, candidates.ids)


def _outputs(logits: torch.Tensor, requests: list[Request], proposals: list[list[int]], emitted: torch.Tensor,
             is_accepted: torch.Tensor) -> VerifyOutput:
    """Each request's tokens up to and including its first row that is not an accepted proposal."""
    emitted_ids, accepted = emitted.tolist(), is_accepted.tolist()  # the step's one host sync
    out = VerifyOutput([], [], [])
    first = 0
    for request, proposal in zip(requests, proposals):
        num_accepted = 0
        while num_accepted < len(proposal) and accepted[first + num_accepted]:
            num_accepted += 1
        out.token_ids.append(emitted_ids[first : first + num_accepted + 1])
        out.num_accepted.append(num_accepted)
        k = request.sampling_params.logprobs
        out.logprobs.append(None if k is None else _token_logprobs(logits, emitted, emitted_ids, first,
                                                                    num_accepted + 1, k))
        first += 1 + len(proposal)
    return out


def _token_logprobs(logits: torch.Tensor, emitted: torch.Tensor, emitted_ids: list[int], first: int, num: int,
                    k: int) -> list[TokenLogprob]:
    """Logprobs of the tokens rows first..first + num - 1 emit, from the raw logits, as the sampler's."""
    rows = list(range(first, first + num))
    table = logprob_table(logits, emitted, rows, k).tolist()  # [num, 1 + 2k]
    return [TokenLogprob(token_id=emitted_ids[row], logprob=entry[0],
                         top=tuple((int(entry[1 + k + m]), entry[1 + m]) for m in range(k)))
            for row, entry in zip(rows, table)]

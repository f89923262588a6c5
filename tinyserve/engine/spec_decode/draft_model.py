"""Speculative decoding's second proposer: a draft model with the target's tokenizer (a smaller model of the
family, or the same one quantized) guesses each sequence's next k tokens, greedily, over a KV pool of its own.

Per step, for the sequences that may speculate (speculative.can_speculate): one forward brings each one's
draft K/V up to its last token and gives its first guess (a prefill chunk for a sequence new to the draft,
else the one or few tokens the last step added), then k - 1 batched decode forwards give the others. The
guesses are point masses, as prompt lookup's are, so engine/spec_decode/rejection_sampler.py verifies them with the same
rule, and the output is the target's alone.

Rolling back costs nothing: the draft's K/V of a position stays valid while the sequence's token there is the
one the draft was fed. Before a sequence drafts again, its guesses the target accepted are kept (they are its
tokens now) and the rest are forgotten; their slots are overwritten by the next forward. A sequence's draft
state (its blocks) lives until the request is released; when the pool is short, sequences that do not draft
this step give theirs back, and a sequence that still does not fit drafts nothing (it decodes plainly).
A sequence new to the draft is prefilled whole in its first forward, outside the step's token budget: the
draft is the cheap model, and a prompt is prefilled by it once.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
from torch import nn

from tinyserve.config import EngineConfig, SpeculativeConfig
from tinyserve.engine.loop.request import Request
from tinyserve.engine.spec_decode.speculative import proposal_sizes
from tinyserve.engine.observability.stats import SpecDecodeStats
from tinyserve.layers.attention_metadata import AttentionMetadata
from tinyserve.layers.kv_cache import allocate_kv_cache
from tinyserve.layers.host_to_device import int64_tensor
from tinyserve.layers.ops import cpu_attention_applies, paged_kernel_applies
from tinyserve.loader.model_loader import LoadedModel, load_model_in_pieces
from tinyserve.types import Job
from tinyserve.models.registry import device_and_dtype

logger = logging.getLogger(__name__)


# compared between the two tokenizers: words, digits, code, accents, CJK and emoji
_TOKENIZER_PROBE = "The quick brown fox, 1234567890; def f(x): return x**2 # café naïve 東京 🙂\n\tend"


def load_draft_model_in_pieces(config: EngineConfig) -> Job[LoadedModel]:
    """The draft model of config.speculative, on the target's device (a job, as load_model_in_pieces)."""
    spec = config.speculative
    dtype = "bfloat16" if spec.draft_quantization else config.dtype  # weight-only formats run in bfloat16
    return (yield from load_model_in_pieces(spec.draft_model, dtype, config.device, spec.draft_quantization))


def check_same_tokenizer(target: LoadedModel, draft: LoadedModel) -> None:
    """A draft's guesses are token ids: they mean something only in the target's vocabulary."""
    a, b = target.tokenizer, draft.tokenizer
    if a.vocab_size != b.vocab_size or a.encode(_TOKENIZER_PROBE) != b.encode(_TOKENIZER_PROBE):
        raise ValueError(f"the draft model {draft.source.name} does not share the tokenizer of {target.source.name} "
                         f"(vocabularies of {b.vocab_size} and {a.vocab_size} tokens, or other token ids)")


@dataclass(eq=False)
class _DraftSequence:
    """One request's state in the draft's pool."""

    block_table: list[int] = field(default_factory=list)
    num_computed: int = 0  # leading tokens of the request whose K/V are in the pool
    guesses: list[int] = field(default_factory=list)  # fed after those in the last step, their K/V cached too

    def roll_back(self, request: Request) -> None:
        """Keep the guesses the target accepted; the draft must still be fed the request's last token."""
        n = self.num_computed
        for guess in self.guesses:
            if n >= request.num_tokens or _token_at(request, n) != guess:
                break
            n += 1
        self.num_computed = min(n, request.num_tokens - 1)
        self.guesses = []


def _token_at(request: Request, position: int) -> int:
    num_prompt = request.num_prompt_tokens
    return request.prompt_token_ids[position] if position < num_prompt else request.output_token_ids[position - num_prompt]


class DraftModelProposer:
    """Sets each running request's spec_token_ids for the next step from the draft model's greedy guesses."""

    def __init__(self, config: SpeculativeConfig, max_model_len: int, model: nn.Module, vocab_size: int,
                 num_blocks: int, block_size: int):
        if model.config.max_position_embeddings < max_model_len:
            raise ValueError(f"the draft model's context ({model.config.max_position_embeddings} tokens) is "
                             f"shorter than the engine's max_model_len ({max_model_len})")
        self.config = config
        self.max_model_len = max_model_len
        self.model = model
        self.vocab_size = min(vocab_size, model.config.vocab_size)  # guesses are target token ids
        self.device, self.dtype = device_and_dtype(model)
        self.block_size, self.num_blocks = block_size, num_blocks
        self.kv_cache = allocate_kv_cache(model.config, num_blocks, block_size, self.dtype, self.device)
        self.sliding_windows = frozenset(model.config.layer_sliding_windows())  # one decode plan per window
        self.cpu_attention = cpu_attention_applies(self.device, self.dtype, model.config.head_dim)
        self.paged_kernel = paged_kernel_applies(self.device)
        self._free_blocks = list(range(num_blocks - 1, -1, -1))
        self._sequences: dict[Request, _DraftSequence] = {}
        self.stats = SpecDecodeStats(config.num_speculative_tokens)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free_blocks)

    def propose(self, running: list[Request]) -> None:
        drafting: list[tuple[Request, _DraftSequence, int]] = []
        for request, k in proposal_sizes(self.config, running, self.max_model_len):
            sequence = self._sequence_for(request, k, [r for r, _, _ in drafting])
            if sequence is not None:
                drafting.append((request, sequence, k))
        if not drafting:
            return
        try:
            self._draft(drafting)
        except Exception:  # a failed draft costs the step its speedup, never a request
            logger.exception("the draft model failed; this step decodes without proposals")
            for request, sequence, _ in drafting:
                request.spec_token_ids = []
                sequence.guesses = []

    def release(self, request: Request) -> None:
        """The request ended: its draft blocks go back to the pool."""
        sequence = self._sequences.pop(request, None)
        if sequence is not None:
            self._free_blocks.extend(reversed(sequence.block_table))

    @torch.inference_mode()
    def _draft(self, drafting: list[tuple[Request, _DraftSequence, int]]) -> None:
        # first forward: catch up to the last token, first guess
        feeds = [(s, r.all_token_ids[s.num_computed :]) for r, s, _ in drafting]
        guesses = self._forward(feeds)
        for (request, sequence, _), guess in zip(drafting, guesses):
            sequence.num_computed = request.num_tokens
            request.spec_token_ids = [guess]
        for position in range(1, max(k for _, _, k in drafting)):
            going = [(r, s) for r, s, k in drafting if k > position]
            guesses = self._forward([(s, r.spec_token_ids[-1:]) for r, s in going])
            for (request, sequence), guess in zip(going, guesses):
                sequence.guesses.append(request.spec_token_ids[-1])  # fed: its K/V are in the pool
                request.spec_token_ids.append(guess)

    def _forward(self, feeds: list[tuple[_DraftSequence, list[int]]]) -> list[int]:
        """feeds[i] = (sequence, the tokens after its cached ones): their K/V written, each one's argmax next."""
        # decodes first, longest context first, as AttentionMetadata requires
        order = sorted(range(len(feeds)), key=lambda i: (len(feeds[i][1]) != 1, -_cached(feeds[i][0])))
        input_ids, positions, slots, seq_lens, query_lens, tables, last_rows = [], [], [], [], [], [], []
        bs = self.block_size
        for i in order:
            sequence, tokens = feeds[i]
            start = _cached(sequence)
            end = start + len(tokens)
            input_ids += tokens
            positions += range(start, end)
            slots += (sequence.block_table[p // bs] * bs + p % bs for p in range(start, end))
            seq_lens.append(end)
            query_lens.append(len(tokens))
            tables.append(sequence.block_table)
            last_rows.append(len(input_ids) - 1)
        meta = AttentionMetadata.build([slots], [tables], seq_lens, query_lens, block_size=bs,
                                       num_blocks=self.num_blocks, num_heads=self.model.config.num_attention_heads,
                                       num_kv_heads=self.model.config.num_key_value_heads, device=self.device,
                                       cpu_attention=self.cpu_attention, kv_caches=self.kv_cache,
                                       paged_kernel=self.paged_kernel,
                                       group_windows=[self.sliding_windows])
        hidden = self.model(int64_tensor(input_ids, self.device), int64_tensor(positions, self.device), meta)
        rows = int64_tensor(last_rows, self.device)
        next_ids = self.model.compute_logits(hidden[rows])[:, : self.vocab_size].argmax(dim=-1).tolist()
        out = [0] * len(feeds)
        for row, i in enumerate(order):
            out[i] = next_ids[row]
        return out

    def _sequence_for(self, request: Request, k: int, drafting: list[Request]) -> _DraftSequence | None:
        """The request's draft state rolled back, with blocks for the positions this step feeds (up to
        num_tokens + k - 2); None if the pool cannot hold them even after the sequences that are not
        drafting this step gave theirs back."""
        sequence = self._sequences.get(request)
        if sequence is None:
            sequence = self._sequences[request] = _DraftSequence()
        sequence.roll_back(request)
        needed = -(-(request.num_tokens + k - 1) // self.block_size) - len(sequence.block_table)
        if needed > len(self._free_blocks):
            keep = {request, *drafting}
            for other in [r for r in self._sequences if r not in keep]:  # they re-prefill when they draft again
                self.release(other)
        if needed > len(self._free_blocks):
            return None
        sequence.block_table += (self._free_blocks.pop() for _ in range(needed))
        return sequence


def _cached(sequence: _DraftSequence) -> int:
    """Positions whose K/V the draft pool holds for the sequence (its tokens, then its guesses)."""
    return sequence.num_computed + len(sequence.guesses)

"""Streaming detokenization of one sequence: new token ids in, new text out, cut before any stop string."""

from __future__ import annotations

import functools
from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinyserve.loader.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output: a SentencePiece "\u2581word" only shows its space after a token,
# and a character split across the prompt/output boundary needs its first bytes.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"  # what decoding makes of an incomplete UTF-8 sequence
# Tokens that may pend without releasing text: a UTF-8 character has at most 4 bytes, so more than this
# is a run of skipped special tokens or invalid bytes, and the window moves on (see _decode_window).
_MAX_PENDING_TOKENS = 8


class StopMatcher:
    """Aho-Corasick automaton over a request's stop strings, fed the text as it streams.

    A state is a trie node: the longest suffix of the text so far that some stop string starts with.
    So its depth is how much text to hold back, and a stop string has completed iff the node (or a node
    on its failure chain) ends one. Feeding a character costs amortized O(1), whatever the number and
    length of the stop strings. Immutable once built: detokenizers with the same stops share one.
    """

    def __init__(self, stop: tuple[str, ...]) -> None:
        self._children: list[dict[str, int]] = [{}]
        self.depth = [0]
        for s in stop:
            node = 0
            for ch in s:
                if ch not in self._children[node]:
                    self._children.append({})
                    self.depth.append(self.depth[node] + 1)
                    self._children[node][ch] = len(self._children) - 1
                node = self._children[node][ch]
        ends = {self._node_of(s) for s in stop}
        self._fail = [0] * len(self._children)
        self._is_match = [node in ends for node in range(len(self._children))]
        frontier = list(self._children[0].values())  # breadth first: a node's failure link is shallower
        while frontier:
            next_frontier = []
            for node in frontier:
                for ch, child in self._children[node].items():
                    self._fail[child] = self._next(self._fail[node], ch) if node else 0
                    self._is_match[child] = self._is_match[child] or self._is_match[self._fail[child]]
                    next_frontier.append(child)
            frontier = next_frontier

    def feed(self, state: int, text: str) -> tuple[int, bool]:
        """(state after `text`, whether a stop string completed in it; the state is then the one where)."""
        for ch in text:
            state = self._next(state, ch)
            if self._is_match[state]:
                return state, True
        return state, False

    def _next(self, state: int, ch: str) -> int:
        while state and ch not in self._children[state]:
            state = self._fail[state]
        return self._children[state].get(ch, 0)

    def _node_of(self, s: str) -> int:
        node = 0
        for ch in s:
            node = self._children[node][ch]
        return node


@functools.lru_cache(maxsize=256)
def stop_matcher(stop: tuple[str, ...]) -> StopMatcher:
    """Shared by the n samples of a request, and by requests repeating the same stops."""
    return StopMatcher(stop)


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas for streaming.

    Decoding: a sliding window, as vLLM's prefix/read offsets. ids[prefix_offset:read_offset] is text already
    released; each step decodes ids[prefix_offset:] and releases what lies past that, so a step decodes a few
    tokens, never the whole output. While the window's text ends in U+FFFD (a character whose bytes span
    several tokens) nothing is released and the window grows until the character is complete, or until
    more than _MAX_PENDING_TOKENS tokens pend (skipped special tokens, invalid bytes): then the tokens that
    add nothing are dropped, or the window moves on past the last complete character, or, if there is
    none, past everything, U+FFFD included, as flush().

    Stop strings: decoded text that is, or could still grow into, a stop string is held in `_held` (its length
    is the depth of the StopMatcher state). When a stop string appears, `stop_hit` is set, the text before the
    earliest-starting stop string (through its end, with include_stop_str) is released and the rest is dropped; after that step() and flush() return "".
    flush() releases whatever is held when the sequence ends for another reason.

    Invariant: `text` is the concatenation of everything returned; with no stop string hit, `text` after flush()
    equals decoding prompt tail + output minus decoding the prompt tail, which for byte-level BPE is exactly
    tokenizer.decode(output_ids). (A SentencePiece output keeps the space of its first word: it continues the
    prompt's text.)
    """

    def __init__(
        self,
        tokenizer: Tokenizer,
        prompt_token_ids: Sequence[int],
        skip_special_tokens: bool = True,
        stop: tuple[str, ...] = (),
        include_stop_str: bool = False,  # the released text ends with the stop string, not before it
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._include_stop_str = include_stop_str
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._matcher = stop_matcher(self._stop) if self._stop else None
        self._stop_state = 0  # the matcher's state after all decoded text
        # prompt tail + output ids (less skipped special tokens dropped from a pinned window)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached until offsets move
        self._held = ""  # decoded text not yet released: it may be the start of a stop string
        self.text = ""  # everything released so far
        self.stop_hit: str | None = None

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add the sequence's new ids; returns the text they complete (possibly "")."""
        if self.stop_hit is not None:
            return ""
        self._ids.extend(new_token_ids)
        return self._cut_at_stop(self._decode_window(final=False))

    def flush(self) -> str:
        """The sequence ended (length, eos, abort): release held text, even an incomplete character."""
        if self.stop_hit is not None:
            return ""
        released = self._cut_at_stop(self._decode_window(final=True))
        if self.stop_hit is None:
            released, self.text, self._held = released + self._held, self.text + self._held, ""
        return released

    def _decode(self, token_ids: list[int]) -> str:
        return self._tokenizer.decode(token_ids, skip_special_tokens=self._skip_special_tokens)

    def _decode_window(self, final: bool) -> str:
        """New text past the released window; "" while it ends in a partial character (unless final)."""
        if self._prefix_text is None:
            self._prefix_text = self._decode(self._ids[self._prefix_offset : self._read_offset])
        text = self._decode(self._ids[self._prefix_offset :])
        if self._is_complete(text) or (final and len(text) > len(self._prefix_text)):
            return self._move_window(len(self._ids), text)
        if len(self._ids) - self._read_offset > _MAX_PENDING_TOKENS:
            return self._unpin_window(text)
        return ""

    def _is_complete(self, text: str) -> bool:
        # NOTE: a skipped special token adds no text, so it is not complete either.
        return len(text) > len(self._prefix_text) and not text.endswith(_REPLACEMENT)

    def _unpin_window(self, text: str) -> str:
        """More than _MAX_PENDING_TOKENS tokens pend and `text` (the window's decode) is incomplete. Drop
        the pending tokens that decode to nothing (skipped special tokens) if the text stays the same;
        else release up to the last pending token that completes a character; else (invalid UTF-8)
        release everything as it decodes. A few decodes, once per _MAX_PENDING_TOKENS tokens."""
        pending = self._ids[self._read_offset :]
        kept = [t for t in pending if self._decode([t])]
        released_ids = self._ids[self._prefix_offset : self._read_offset]
        if len(kept) < len(pending) and self._decode(released_ids + kept) == text:
            self._ids[self._read_offset :] = kept
            return ""
        for end in range(len(self._ids) - 1, self._read_offset, -1):
            shorter = self._decode(self._ids[self._prefix_offset : end])
            if self._is_complete(shorter):
                return self._move_window(end, shorter)
        return self._move_window(len(self._ids), text)

    def _move_window(self, end: int, text: str) -> str:
        """ids[:end] are released: `text` (the decode of ids[prefix_offset:end]) past the prefix is new."""
        delta = text[len(self._prefix_text) :]
        self._prefix_offset, self._read_offset, self._prefix_text = self._read_offset, end, None
        return delta

    def _cut_at_stop(self, delta: str) -> str:
        """Cut at the first stop string, hold back a tail that may start one, release the rest."""
        if self._matcher is None:
            self.text += delta
            return delta
        pending = self._held + delta
        self._stop_state, is_hit = self._matcher.feed(self._stop_state, delta)
        if is_hit:
            # By the hold-back rule no stop string can start in released text, so searching `pending`
            # suffices; the earliest start wins (the stop that completed first may start later)
            found = [(pending.find(s), s) for s in self._stop if s in pending]
            cut, self.stop_hit = min(found, key=lambda f: f[0])
            if self._include_stop_str:
                cut += len(self.stop_hit)
            released, self._held = pending[:cut], ""
        else:
            keep = self._matcher.depth[self._stop_state]
            released, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += released
        return released

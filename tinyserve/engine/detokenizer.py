"""Streaming detokenization of one sequence: new token ids in, new text out, cut before any stop string."""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tinyserve.loader.tokenizer import Tokenizer

# Prompt tokens decoded ahead of the output: a SentencePiece "\u2581word" only shows its space after a token,
# and a character split across the prompt/output boundary needs its first bytes.
_CONTEXT_TOKENS = 5
_REPLACEMENT = "\ufffd"  # what decoding makes of an incomplete UTF-8 sequence


class IncrementalDetokenizer:
    """Turns one sequence's token ids into text deltas for streaming.

    Decoding: a sliding window, as vLLM's prefix/read offsets. ids[prefix_offset:read_offset] is text already
    released; each step decodes ids[prefix_offset:] and releases what lies past that, so a step decodes a few
    tokens, never the whole output. While the window's text ends in U+FFFD (a character whose bytes span
    several tokens) nothing is released and the window grows until the character is complete.

    Stop strings: decoded text that is, or could still grow into, a stop string is held in `_held`. When a stop
    string appears, `stop_hit` is set, the text before it is released and the rest is dropped; after that step()
    and flush() return "". flush() releases whatever is held when the sequence ends for another reason.

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
    ) -> None:
        assert all(stop), "stop strings must be non-empty"
        self._tokenizer = tokenizer
        self._skip_special_tokens = skip_special_tokens
        self._stop = tuple(stop)
        self._ids = list(prompt_token_ids[-_CONTEXT_TOKENS:])  # prompt tail + all output ids
        self._prefix_offset = 0
        self._read_offset = len(self._ids)
        self._prefix_text: str | None = None  # decode(ids[prefix_offset:read_offset]), cached until offsets move
        self._held = ""  # decoded text not yet released: it may be the start of a stop string
        self.text = ""  # everything released so far
        self.stop_hit: str | None = None

    @property
    def is_stopped(self) -> bool:
        return self.stop_hit is not None

    def step(self, new_token_ids: Sequence[int]) -> str:
        """Add the sequence's new ids; returns the text they complete (possibly "")."""
        if self.stop_hit is not None:
            return ""
        self._ids.extend(new_token_ids)
        return self._release(self._decode_window(final=False))

    def flush(self) -> str:
        """The sequence ended (length, eos, abort): release held text, even an incomplete character."""
        if self.stop_hit is not None:
            return ""
        released = self._release(self._decode_window(final=True))
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
        # NOTE: a skipped special token adds no text; the window then simply grows.
        if len(text) <= len(self._prefix_text) or (text.endswith(_REPLACEMENT) and not final):
            return ""
        self._prefix_offset, self._read_offset = self._read_offset, len(self._ids)
        delta, self._prefix_text = text[len(self._prefix_text) :], None
        return delta

    def _release(self, delta: str) -> str:
        """Cut at the first stop string, hold back a tail that may start one, release the rest."""
        if not self._stop:
            self.text += delta
            return delta
        pending = self._held + delta
        # By the hold-back rule no stop string can start in released text, so searching `pending` suffices.
        found = [(pending.find(s), s) for s in self._stop if s in pending]
        if found:
            cut, self.stop_hit = min(found, key=lambda f: f[0])
            released, self._held = pending[:cut], ""
        else:
            keep = self._stop_prefix_len(pending)
            released, self._held = pending[: len(pending) - keep], pending[len(pending) - keep :]
        self.text += released
        return released

    def _stop_prefix_len(self, text: str) -> int:
        """Length of the longest suffix of `text` that some stop string starts with (0 if none)."""
        longest = max(len(s) for s in self._stop) - 1
        for length in range(min(len(text), longest), 0, -1):
            tail = text[-length:]
            if any(s.startswith(tail) for s in self._stop):
                return length
        return 0

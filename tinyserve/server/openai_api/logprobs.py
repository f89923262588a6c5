"""TokenLogprob -> OpenAI's two logprobs formats (legacy completions and chat)."""

from __future__ import annotations

import itertools

from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.server.openai_api.responses import (ChatLogprobs, ChatTokenLogprob, CompletionLogprobs, PromptLogprob,
                                        PromptLogprobs, TopLogprob)
from tinyserve.types import TokenLogprob


class TokenTexts:
    """Each token's text on its own (as OpenAI reports it) and its raw bytes, memoised per token id. A
    token holding part of a multi-byte character has text U+FFFD but its own partial bytes, so a client
    can join the bytes of consecutive tokens into the exact UTF-8 text."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self._texts: dict[int, str] = {}
        self._bytes: dict[int, list[int]] = {}

    def text(self, token_id: int) -> str:
        text = self._texts.get(token_id)
        if text is None:
            text = self._texts[token_id] = self.tokenizer.decode([token_id], skip_special_tokens=False)
        return text

    def bytes(self, token_id: int) -> list[int]:
        raw = self._bytes.get(token_id)
        if raw is None:
            raw = self._bytes[token_id] = list(self.tokenizer.token_bytes(token_id))
        return raw


def _finite(logprob: float) -> float:
    return max(logprob, -9999.0)  # JSON has no -inf


def completion_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob], text_offset: int) -> CompletionLogprobs:
    """{tokens, token_logprobs, top_logprobs, text_offset}; offsets continue from `text_offset`."""
    tokens, offsets = [], []
    for lp in logprobs:
        offsets.append(text_offset)
        token = texts.text(lp.token_id)
        tokens.append(token)
        text_offset += len(token)
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[_finite(lp.logprob) for lp in logprobs],
        top_logprobs=[{texts.text(t): _finite(v) for t, v in lp.top} for lp in logprobs],
        text_offset=offsets,
    )


def chat_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob]) -> ChatLogprobs:
    """{content: [{token, logprob, bytes, top_logprobs: [{token, logprob, bytes}]}]}"""
    def entry(token_id: int, logprob: float) -> dict:
        return {"token": texts.text(token_id), "logprob": _finite(logprob), "bytes": texts.bytes(token_id)}

    return ChatLogprobs(content=[
        ChatTokenLogprob(**entry(lp.token_id, lp.logprob), top_logprobs=[TopLogprob(**entry(t, v)) for t, v in lp.top])
        for lp in logprobs])


def echoed_prompt_logprobs(texts: TokenTexts, prompt_ids: list[int], logprobs: list[TokenLogprob],
                           k: int) -> CompletionLogprobs:
    """An echoed prompt's tokens in the legacy format (offsets from 0): `logprobs` are the engine's for
    prompt tokens 1.. (top k or more, best first), so the first token's logprob and top are null."""
    assert len(logprobs) == len(prompt_ids) - 1, (len(logprobs), len(prompt_ids))
    tokens = [texts.text(t) for t in prompt_ids]
    offsets = [0, *itertools.accumulate(map(len, tokens[:-1]))]
    return CompletionLogprobs(
        tokens=tokens,
        token_logprobs=[None] + [_finite(lp.logprob) for lp in logprobs],
        top_logprobs=[None] + [{texts.text(t): _finite(v) for t, v in lp.top[:k]} for lp in logprobs],
        text_offset=offsets,
    )


def prompt_logprobs(texts: TokenTexts, logprobs: list[TokenLogprob], k: int) -> PromptLogprobs:
    """vLLM's format: null for the first prompt token, then per token {id: {logprob, rank, decoded_token}} of
    the token itself and of the top k (ranks 1..k), the token first."""
    def entry(token_id: int, logprob: float, rank: int) -> tuple[str, PromptLogprob]:
        return str(token_id), PromptLogprob(logprob=_finite(logprob), rank=rank, decoded_token=texts.text(token_id))

    entries: PromptLogprobs = [None]
    for lp in logprobs:
        position = dict([entry(lp.token_id, lp.logprob, lp.rank)])
        for rank, (token_id, logprob) in enumerate(lp.top[:k], start=1):
            position.setdefault(*entry(token_id, logprob, rank))
        entries.append(position)
    return entries

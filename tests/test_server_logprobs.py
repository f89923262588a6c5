"""Logprob values end to end: concurrent requests with different settings share engine steps, and each
token's logprob and top-k over HTTP are checked against a reference computed here.

The reference: one float32 forward of prompt + generated tokens through engine/greedy_reference.py's dense
single-sequence path (contiguous block table, no batching, no sampler; its logits match transformers',
tests/test_llama.py), then log_softmax in float64. Logprobs are of the raw logits (before temperature),
so sampled requests are checked as well as greedy ones. The generated ids come from a spy on the engine:
the HTTP bodies carry token texts, not ids.
"""

import asyncio

import httpx
import torch

from tinyserve.engine.greedy_reference import forward_sequence

TOLERANCE = 2e-3  # float32 logits of a batched paged step against one dense sequence
CHAT = [{"role": "user", "content": "Name three colors."}]
# name -> (endpoint, body): logprobs with top-k of 5, 3 and 0, none, n=2 sampled; four lengths
REQUESTS = {
    "completion top-5": ("/v1/completions", {"prompt": "The capital of France is", "max_tokens": 6,
                                             "temperature": 0, "logprobs": 5}),
    "chat top-3": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 5, "temperature": 0,
                                            "logprobs": True, "top_logprobs": 3}),
    "chat top-0": ("/v1/chat/completions", {"messages": CHAT, "max_tokens": 4, "temperature": 0,
                                            "logprobs": True}),
    "completion no logprobs": ("/v1/completions", {"prompt": "Once upon a time", "max_tokens": 8,
                                                   "temperature": 0}),
    "completion n=2 sampled top-2": ("/v1/completions", {"prompt": "def parse(line):", "max_tokens": 4,
                                                         "temperature": 0.8, "seed": 7, "n": 2, "logprobs": 2}),
}


async def _send_all(srv, spy) -> dict[str, dict]:
    """Every request of REQUESTS at once, the engine held until all are queued; name -> response body."""
    async with httpx.AsyncClient(base_url=srv.base_url, timeout=120) as client:
        async def one(path: str, body: dict) -> dict:
            r = await client.post(path, json={**body, "ignore_eos": True})
            assert r.status_code == 200, r.text
            return r.json()

        spy.gate.clear()
        try:
            tasks = [asyncio.create_task(one(path, body)) for path, body in REQUESTS.values()]
            while srv.state.engine.num_in_flight < len(REQUESTS) and not any(t.done() for t in tasks):
                await asyncio.sleep(0.01)
        finally:
            spy.gate.set()
        results = await asyncio.gather(*tasks)
    return dict(zip(REQUESTS, results))


def _reference(model, prompt_ids: list[int], output_ids: list[int]) -> torch.Tensor:
    """[len(output_ids), vocab] float64 logprobs of the distribution each output token was drawn from."""
    logits = forward_sequence(model, prompt_ids + output_ids)  # [num_tokens, vocab]
    return torch.log_softmax(logits.double(), dim=-1)[len(prompt_ids) - 1 : -1]


def _top_entries(endpoint: str, choice: dict) -> list[tuple[str, float, list[tuple[str, float]]]]:
    """Per token: (its text, its logprob, [(alternative's text, logprob), ...] best first)."""
    lp = choice["logprobs"]
    if endpoint == "/v1/completions":
        return [(t, v, sorted(top.items(), key=lambda kv: -kv[1]))
                for t, v, top in zip(lp["tokens"], lp["token_logprobs"], lp["top_logprobs"], strict=True)]
    return [(c["token"], c["logprob"], [(a["token"], a["logprob"]) for a in c["top_logprobs"]])
            for c in lp["content"]]


def _check_token(where: str, token_id: int, entry: tuple, row: torch.Tensor, k: int, is_greedy: bool,
                 text_of) -> float:
    """One token's logprobs over HTTP against its reference row; returns |logprob - reference|."""
    text, logprob, top = entry
    assert text == text_of(token_id), where
    diff = abs(logprob - row[token_id].item())
    assert diff <= TOLERANCE, (where, logprob, row[token_id].item())
    assert len(top) == k, where
    best = row.topk(k + 4)  # a few more: an alternative may tie with the k-th
    assert all(abs(v - e) <= TOLERANCE for (_, v), e in zip(top, best.values[:k].tolist())), (where, top)
    alternatives = list(zip(map(text_of, best.indices.tolist()), best.values.tolist()))
    for alternative, value in top:  # each one is a top token, with its own logprob
        assert any(alternative == t and abs(value - v) <= TOLERANCE for t, v in alternatives), where
    if is_greedy and k:
        assert top[0] == (text, logprob), where  # the argmax is what was sampled, with the same value
    return diff


def test_logprobs_of_a_mixed_batch_match_a_reference(spied_server, smollm2_loaded):
    srv, spy = spied_server
    responses = asyncio.run(_send_all(srv, spy))
    # the requests did share steps: one batch held rows asking top-5, top-3 and no logprobs at once
    assert any({5, 3, None} <= {k for _, k in batch} for batch in spy.batches), spy.batches
    text_of = lambda i: srv.state.engine.tokenizer.decode([i], skip_special_tokens=False)  # noqa: E731
    diffs = []
    for name, (endpoint, body) in REQUESTS.items():
        response = responses[name]
        k = body.get("logprobs") if endpoint == "/v1/completions" else body.get("top_logprobs", 0)
        is_greedy = body["temperature"] == 0
        for choice in response["choices"]:
            output_ids = spy.token_ids[(response["id"], choice["index"])]
            assert len(output_ids) == body["max_tokens"], name
            reference = _reference(smollm2_loaded.model, spy.prompts[response["id"]], output_ids)
            if is_greedy:  # the sampled token is the reference's argmax (up to a near tie)
                chosen = reference.gather(1, torch.tensor(output_ids)[:, None]).squeeze(1)
                assert torch.all(reference.max(dim=-1).values - chosen <= TOLERANCE), name
            if "logprobs" not in body:
                assert choice["logprobs"] is None, name
                continue
            entries = _top_entries(endpoint, choice)
            assert len(entries) == len(output_ids), name
            diffs += [_check_token(f"{name}, choice {choice['index']}, token {i}", token_id, entry, reference[i], k,
                                   is_greedy, text_of)
                      for i, (token_id, entry) in enumerate(zip(output_ids, entries))]
    print(f"max |logprob - reference| over {len(diffs)} tokens: {max(diffs):.2e}")
    assert len(diffs) == 6 + 5 + 4 + 2 * 4

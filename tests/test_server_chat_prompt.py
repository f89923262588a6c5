"""The prompt ids a chat completion hands the engine, over HTTP, against the chat template rendered apart.

The oracle: the GGUF's own template string (read from its metadata, not through our Tokenizer) rendered
by a jinja2 environment built here, and the ids transformers' apply_chat_template gave for the same
conversations, frozen below. The server's side: what LLMEngine.add_validated received (a spy on the
engine the server steps), the response's usage.prompt_tokens, and /tokenize with the same messages.
"""

import httpx
import jinja2
import jinja2.ext
import pytest
from gguf import GGUFReader
from jinja2.sandbox import ImmutableSandboxedEnvironment

SYSTEM = {"role": "system", "content": "You are a geography teacher."}
USER = {"role": "user", "content": "What is the capital of France?"}
GENERATION_PROMPT_IDS = [1, 520, 9531, 198]  # "<|im_start|>assistant\n"
# (messages as sent, messages as the template sees them, add_generation_prompt, transformers' ids)
CASES = {
    "system and user, generation prompt": (
        [SYSTEM, USER], [SYSTEM, USER], True,
        [1, 9690, 198, 2683, 359, 253, 12973, 3743, 30, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649,
         47, 2, 198, 1, 520, 9531, 198]),
    "assistant turn to continue, no generation prompt": (
        [SYSTEM, USER, {"role": "assistant", "content": "Paris"}],
        [SYSTEM, USER, {"role": "assistant", "content": "Paris"}], False,
        [1, 9690, 198, 2683, 359, 253, 12973, 3743, 30, 2, 198, 1, 4093, 198, 1780, 314, 260, 3575, 282, 4649,
         47, 2, 198, 1, 520, 9531, 198, 38634, 2, 198]),
    "developer role and text parts": (
        [{"role": "developer", "content": "Answer in one word."},
         {"role": "user", "content": [{"type": "text", "text": "Capital of Italy?"},
                                      {"type": "text", "text": "Be brief."}]}],
        [{"role": "system", "content": "Answer in one word."},
         {"role": "user", "content": "Capital of Italy?\nBe brief."}], True,
        [1, 9690, 198, 21350, 281, 582, 2229, 30, 2, 198, 1, 4093, 198, 39832, 282, 7158, 47, 198, 6077, 5453,
         30, 2, 198, 1, 520, 9531, 198]),
}


@pytest.fixture(scope="module")
def gguf_template(smollm2_path) -> jinja2.Template:
    """The GGUF's template, compiled the way transformers compiles chat templates."""
    source = GGUFReader(smollm2_path).fields["tokenizer.chat_template"].contents()
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=[jinja2.ext.loopcontrols])
    return env.from_string(source)


def _literal(messages: list[dict], add_generation_prompt: bool) -> str:
    """ChatML as SmolLM2 writes it (its template adds a default system turn only when there is none)."""
    turns = "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages)
    return turns + ("<|im_start|>assistant\n" if add_generation_prompt else "")


@pytest.mark.parametrize("case", CASES)
def test_chat_prompt_ids_are_the_template_rendered_apart(spied_server, gguf_template, case):
    srv, spy = spied_server
    sent, seen_by_template, add_generation_prompt, expected = CASES[case]
    rendered = gguf_template.render(messages=seen_by_template, add_generation_prompt=add_generation_prompt,
                                    bos_token="<|im_start|>", eos_token="<|im_end|>")
    assert rendered == _literal(seen_by_template, add_generation_prompt)  # the oracles agree with each other
    assert srv.state.engine.tokenizer.encode(rendered, add_special_tokens=False) == expected
    assert "You are a helpful AI assistant named SmolLM" not in rendered  # the client's system turn is kept
    assert (expected[-len(GENERATION_PROMPT_IDS):] == GENERATION_PROMPT_IDS) == add_generation_prompt

    body = {"messages": sent, "add_generation_prompt": add_generation_prompt}
    r = httpx.post(srv.base_url + "/v1/chat/completions", json={**body, "max_tokens": 1, "temperature": 0},
                   timeout=60)
    assert r.status_code == 200, r.text
    assert spy.prompts[r.json()["id"]] == expected  # what the engine was queued with
    assert r.json()["usage"]["prompt_tokens"] == len(expected)
    tokenized = httpx.post(srv.base_url + "/tokenize", json=body, timeout=60).json()
    assert tokenized["tokens"] == expected and tokenized["count"] == len(expected)

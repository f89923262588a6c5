"""Chat on a model whose checkpoint has no chat template (a base model's GGUF, here a tiny Gemma 3 written as
llama.cpp's converter writes the real one): over HTTP, /v1/chat/completions and /tokenize with messages are
a 400 in OpenAI's shape that says what to do, while /v1/completions serves; with a template given
(EngineConfig.chat_template, `tinyserve serve --chat-template FILE`), the prompt is that template rendered
apart (jinja2 here) and encoded."""

from __future__ import annotations

import httpx
import jinja2
import pytest
from test_gemma3_gguf import tiny_gemma3, write_gemma3_gguf

from tinyserve.cli import build_parser
from tinyserve.cli_engine import engine_config_from_args
from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.model_loader import load_model
from tinyserve.server.launcher import BackgroundServer

# Gemma's turn format, as its instruction-tuned checkpoints write it (the base GGUF carries none)
TEMPLATE = ("{{ bos_token }}{% for m in messages %}<start_of_turn>{{ 'model' if m['role'] == 'assistant' else "
            "m['role'] }}\n{{ m['content'] }}<end_of_turn>\n{% endfor %}"
            "{% if add_generation_prompt %}<start_of_turn>model\n{% endif %}")
MESSAGES = [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "ok"},
            {"role": "user", "content": "abc"}]


@pytest.fixture(scope="module")
def tiny_loaded(tmp_path_factory):
    path = write_gemma3_gguf(tmp_path_factory.mktemp("chat") / "base.gguf", tiny_gemma3())
    return load_model(str(path), dtype="float32", device="cpu")


def _server(loaded, chat_template: str | None) -> BackgroundServer:
    engine = EngineConfig(model=str(loaded.source), dtype="float32", device="cpu", chat_template=chat_template,
                          cache=CacheConfig(kv_cache_memory_gib=0.02), scheduler=SchedulerConfig(max_model_len=256))
    return BackgroundServer(engine, ServerConfig(port=0, warmup=False), lambda cfg: LLMEngine(cfg, loaded=loaded))


def test_without_a_template_chat_is_a_400_that_names_the_flag(tiny_loaded):
    assert tiny_loaded.tokenizer.chat_template is None
    with _server(tiny_loaded, None) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 4})
        tokenize = client.post("/tokenize", json={"messages": MESSAGES})
        completion = client.post("/v1/completions", json={"prompt": "abc", "max_tokens": 4, "temperature": 0,
                                                               "ignore_eos": True})
    for response in (chat, tokenize):
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert (error["type"], error["param"], error["code"]) == ("invalid_request_error", "messages",
                                                                  "chat_template_missing")
        assert "no chat template" in error["message"] and "--chat-template FILE" in error["message"]
    assert completion.status_code == 200 and completion.json()["usage"]["completion_tokens"] == 4


def test_a_given_template_renders_the_prompt(tiny_loaded):
    rendered = jinja2.Environment().from_string(TEMPLATE).render(messages=MESSAGES, add_generation_prompt=True,
                                                                  bos_token="<bos>")
    expected = tiny_loaded.tokenizer.encode(rendered, add_special_tokens=False)
    assert expected[:2] == [2, 4]  # <bos> <start_of_turn>: the template's control tokens became their ids
    with _server(tiny_loaded, TEMPLATE) as srv, httpx.Client(base_url=srv.base_url, timeout=60) as client:
        tokenize = client.post("/tokenize", json={"messages": MESSAGES})
        chat = client.post("/v1/chat/completions", json={"messages": MESSAGES, "max_tokens": 3, "temperature": 0,
                                                         "ignore_eos": True})
    assert tokenize.status_code == 200 and tokenize.json()["tokens"] == expected
    assert chat.status_code == 200, chat.text
    assert chat.json()["usage"]["prompt_tokens"] == len(expected)
    assert chat.json()["usage"]["completion_tokens"] == 3


def test_the_serve_flag_reads_the_file(tmp_path):
    path = tmp_path / "gemma.jinja"
    path.write_text(TEMPLATE, encoding="utf-8")
    args = build_parser().parse_args(["serve", "--model", "m.gguf", "--chat-template", str(path)])
    assert engine_config_from_args(args).chat_template == TEMPLATE
    assert engine_config_from_args(build_parser().parse_args(["serve"])).chat_template is None
    missing = build_parser().parse_args(["serve", "--chat-template", str(tmp_path / "nope.jinja")])
    with pytest.raises(ValueError, match="--chat-template .*nope.jinja.* cannot be read"):
        engine_config_from_args(missing)


def test_a_template_that_does_not_compile_fails_the_load_naming_the_line(tiny_loaded):
    with pytest.raises(ModelLoadError, match="chat template: line 2"):
        tiny_loaded.tokenizer.with_chat_template("{{ bos_token }}\n{% for m in messages %}")
    with_template = tiny_loaded.tokenizer.with_chat_template(TEMPLATE)
    assert with_template.chat_template == TEMPLATE and tiny_loaded.tokenizer.chat_template is None

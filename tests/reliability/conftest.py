"""A live server on a tiny random Llama (2 layers, hidden 64) with the default model's real tokenizer:
the protocol, tokenizer and chat-template paths are the real ones, while a step is so cheap that
thousands of requests fit in a test.

Each server builds its own random model (a seed per server); the tokenizer is immutable and shared.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass, replace
from functools import partial
import resource

import pytest
import torch

from tinyserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from tinyserve.engine.loop.llm_engine import LLMEngine
from tinyserve.loader.gguf.checkpoint import open_gguf
from tinyserve.loader.model_loader import LoadedModel, resolve_model_path
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.server.launcher import BackgroundServer
from tinyserve.server.state import ServerState

TINY_MAX_MODEL_LEN = 128  # fuzzed max_tokens can never run long: a sample ends within 128 steps


def tiny_engine_config(max_model_len: int = TINY_MAX_MODEL_LEN, num_blocks: int = 1024, **scheduler_fields) -> EngineConfig:
    """float32 on CPU; 1,024 blocks of 16 tokens leave room for a 128-sample request before preemption."""
    scheduler = SchedulerConfig(**{"max_num_seqs": 64, "max_num_batched_tokens": 512, **scheduler_fields,
                                   "max_model_len": max_model_len})
    return EngineConfig(dtype="float32", device="cpu", cache=CacheConfig(num_blocks=num_blocks), scheduler=scheduler)


TINY_ENGINE = tiny_engine_config()
EngineWrapper = Callable[[LLMEngine], object]  # gets the built LLMEngine, returns what the server steps


@dataclass
class TinyServer:
    base_url: str
    state: ServerState
    background: BackgroundServer

    @property
    def llm_engine(self):
        return self.state.engine.engine

    @property
    def num_blocks(self) -> int:
        return self.llm_engine.block_manager.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.llm_engine.block_manager.num_free_blocks


OPEN_FILES_WANTED = 8192  # client and server ends of thousands of connections share this process


@pytest.fixture(scope="session", autouse=True)
def open_file_limit() -> None:
    """Raise the soft descriptor limit (CI's may be 1,024) as far as the hard limit allows."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and soft < OPEN_FILES_WANTED:
        resource.setrlimit(resource.RLIMIT_NOFILE, (OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY
                                                    else min(OPEN_FILES_WANTED, hard), hard))


@pytest.fixture(scope="session")
def default_tokenizer() -> Tokenizer:
    """The default model's tokenizer and chat template, read from its GGUF (no weights loaded)."""
    return Tokenizer.from_gguf(open_gguf(resolve_model_path("smollm2-135m")))


def tiny_loaded_model(tokenizer: Tokenizer, max_model_len: int = TINY_MAX_MODEL_LEN, seed: int = 0) -> LoadedModel:
    """A fresh random Llama over the tokenizer's whole vocabulary, float32 on CPU."""
    config = ModelConfig(
        architecture="llama", vocab_size=tokenizer.vocab_size, hidden_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
        max_position_embeddings=max_model_len, norm_eps=1e-5, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_ids=tuple(sorted(tokenizer.eos_token_ids)),
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for param in model.parameters():
            param.normal_(0, 0.2)
    return LoadedModel(model.eval().requires_grad_(False), config, tokenizer, resolve_model_path("smollm2-135m"))


@contextmanager
def tiny_server(tokenizer: Tokenizer, *, wrap_engine: EngineWrapper | None = None,
                engine_config: EngineConfig | None = None, max_model_len: int = TINY_MAX_MODEL_LEN,
                num_blocks: int = 1024, scheduler_overrides: dict | None = None,
                max_position_embeddings: int | None = None, **server_overrides) -> Iterator[TinyServer]:
    """A started BackgroundServer on a free loopback port. `server_overrides` are ServerConfig fields
    (warmup is off unless asked for). The engine is `engine_config` if given, else tiny_engine_config(
    max_model_len, num_blocks, **scheduler_overrides); the model's context is `max_position_embeddings`
    (default: the engine's max_model_len). `wrap_engine` gets the LLMEngine before the server starts and
    returns what the server steps (fault injection)."""
    if engine_config is None:
        engine_config = tiny_engine_config(max_model_len, num_blocks, **(scheduler_overrides or {}))
    config = replace(ServerConfig(port=0, warmup=False), **server_overrides)

    def build(cfg: EngineConfig):
        context = max_position_embeddings or cfg.scheduler.max_model_len
        engine = LLMEngine(cfg, loaded=tiny_loaded_model(tokenizer, context))
        return engine if wrap_engine is None else wrap_engine(engine)

    background = BackgroundServer(engine_config, config, build).start()
    try:
        yield TinyServer(background.base_url, background.state, background)
    finally:
        background.stop()


@pytest.fixture(scope="session")
def tiny_server_factory(default_tokenizer) -> Callable[..., AbstractContextManager[TinyServer]]:
    """`with tiny_server_factory(wrap_engine=..., max_model_len=..., **server_overrides) as server:`
    (the fixture form of tiny_server, for tests that do not import this module)."""
    return partial(tiny_server, default_tokenizer)


@pytest.fixture(scope="module")
def live_tiny_server(default_tokenizer) -> Iterator[TinyServer]:
    """One tiny server per test module, with the default ServerConfig (but no warm-up)."""
    with tiny_server(default_tokenizer) as server:
        yield server

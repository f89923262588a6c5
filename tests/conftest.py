"""Shared fixtures: the default model (SmolLM2-135M-Instruct Q4_1 GGUF) loaded by us and by transformers, and a
live server on it whose engine an EngineSpy watches."""

import threading
from collections import defaultdict

import pytest
import torch

from tinyserve.loader.gguf.checkpoint import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.model_loader import build_model, resolve_model_path


def pytest_sessionstart(session):
    """Build (or load) the C++ kernels before any test runs: a first build takes minutes on a slow
    machine, and inside a test it would run against that test's own deadline (a server's start, say)."""
    from tinyserve.layers.kernels import cpu_kernels

    if cpu_kernels.load() is None:
        print("\nC++ CPU kernels unavailable: tests run the torch-op path")


@pytest.fixture(scope="session")
def smollm2_path():
    return resolve_model_path("smollm2-135m")


def _ours(path, dtype):
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    return build_model(config, gguf_tensors(reader, config), dtype, torch.device("cpu"))


@pytest.fixture(scope="session")
def smollm2_fp32(smollm2_path):
    return _ours(smollm2_path, torch.float32)


@pytest.fixture(scope="session")
def smollm2_bf16(smollm2_path):
    from tinyserve.layers.linear import can_pack

    if not can_pack(torch.bfloat16, torch.device("cpu")):
        # --dtype auto is float32 on such a CPU; whole-model bf16 runs there take torch's reference path
        # (over 15 minutes for one test on a Zen 3 without AVX512)
        pytest.skip("this CPU has no bfloat16 matmul kernels (AVX512-BF16 / AMX): bf16 is not its default mode")
    return _ours(smollm2_path, torch.bfloat16)


@pytest.fixture(scope="session")
def hf_smollm2(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoModelForCausalLM.from_pretrained(
        str(smollm2_path.parent), gguf_file=smollm2_path.name, dtype=torch.float32
    ).eval()


@pytest.fixture(scope="session")
def hf_smollm2_tokenizer(smollm2_path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(smollm2_path.parent), gguf_file=smollm2_path.name)


@pytest.fixture(scope="session")
def smollm2_loaded():
    """The default model as the engine loads it (model + config + tokenizer), float32 on CPU."""
    from tinyserve.loader.model_loader import load_model

    return load_model("smollm2-135m", dtype="float32", device="cpu")


@pytest.fixture
def tiny_llama():
    """A factory of small random float32 Llamas (2 layers, GQA), tied or not."""
    from tinyserve.config import ModelConfig
    from tinyserve.models.llama import LlamaForCausalLM

    def make(tied: bool):
        config = ModelConfig(architecture="llama", vocab_size=320, hidden_size=64, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, intermediate_size=96,
                             max_position_embeddings=256, norm_eps=1e-5, tie_word_embeddings=tied)
        torch.manual_seed(0)
        model = LlamaForCausalLM(config)
        with torch.no_grad():
            for param in model.parameters():
                param.normal_(0, 0.2)
        return model.eval().requires_grad_(False)

    return make


class EngineSpy:
    """Wraps the LLMEngine a server steps (use `wrap` in its engine factory) and records, on the engine
    thread: the prompt ids each request id was queued with, each step's batch as (request id, logprobs k)
    pairs, and every token each (request id, sample index) got. While `gate` is clear, a step
    waits for it (so that requests sent together are all queued before the first of them runs)."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.prompts: dict[str, list[int]] = {}
        self.batches: list[list[tuple[str, int | None]]] = []
        self.token_ids: dict[tuple[str, int], list[int]] = defaultdict(list)

    def wrap(self, engine):
        # add_validated: where every prompt enters the engine (add_request and the AsyncEngine's thread)
        add_validated, execute, step = engine.add_validated, engine.runner.execute, engine.step

        def spying_add_validated(request_id, prompt_ids, *args, **kwargs):
            self.prompts[request_id] = list(prompt_ids)
            return add_validated(request_id, prompt_ids, *args, **kwargs)

        def spying_execute(scheduled):
            self.batches.append([(r.request_id, r.sampling_params.logprobs) for r, _ in scheduled])
            return execute(scheduled)

        def spying_step():
            assert self.gate.wait(60), "the test never opened the gate"
            outputs = step()
            for out in outputs:
                self.token_ids[(out.request_id, out.index)] += out.new_token_ids
            return outputs

        engine.add_validated, engine.runner.execute, engine.step = spying_add_validated, spying_execute, spying_step
        return engine


def start_default_model_server(loaded, wrap=lambda engine: engine, **server_fields):
    """A started live server on the default model (`loaded`), float32, no warm-up, 2,048-token context;
    `wrap(engine)` may instrument its LLMEngine."""
    from tinyserve.config import CacheConfig, EngineConfig, SchedulerConfig, ServerConfig
    from tinyserve.engine.loop.llm_engine import LLMEngine
    from tinyserve.server.launcher import BackgroundServer

    engine = EngineConfig(dtype="float32", cache=CacheConfig(kv_cache_memory_gib=0.25),
                          scheduler=SchedulerConfig(max_model_len=2048))
    return BackgroundServer(engine, ServerConfig(port=0, warmup=False, **server_fields),
                            lambda cfg: wrap(LLMEngine(cfg, loaded=loaded))).start()


@pytest.fixture(scope="module")
def spied_server(smollm2_loaded):
    """(a live server on the default model, float32, no warm-up; the EngineSpy on its engine), one per module."""
    spy = EngineSpy()
    srv = start_default_model_server(smollm2_loaded, spy.wrap)
    yield srv, spy
    srv.stop()


@pytest.fixture(scope="session")
def word_tokenizer():
    """A factory of word-level tokenizers over `vocab_size` tokens "t0", "t1", ...: the engine needs a tokenizer
    to detokenize, and tests of tiny random models feed token ids (the default model's tokenizer takes
    seconds to read from its GGUF)."""
    import functools

    import tokenizers

    from tinyserve.loader.tokenizer import Tokenizer

    @functools.cache
    def make(vocab_size: int):
        words = {f"t{i}": i for i in range(vocab_size)}
        backend = tokenizers.Tokenizer(tokenizers.models.WordLevel(words, unk_token="t0"))
        backend.pre_tokenizer = tokenizers.pre_tokenizers.WhitespaceSplit()
        return Tokenizer(backend)

    return make


class _LogitsRecorder:
    """Stands in for a ModelRunner's sampler: keeps a float32 copy of each logits row it is given (the
    model's raw logits, before any sampling parameter), then samples as the engine's own sampler does."""

    def __init__(self, sampler):
        self.sampler = sampler
        # (request id, sample index) -> one [vocab] row per sampled token
        self.rows: dict[tuple[str, int], list[torch.Tensor]] = {}

    def __call__(self, logits, requests, token_masks=None):
        for row, request in zip(logits, requests):
            self.rows.setdefault((request.request_id, request.index), []).append(row.float().clone())
        return self.sampler(logits, requests, token_masks)

    def __getattr__(self, name):
        return getattr(self.sampler, name)


@pytest.fixture
def record_logits():
    """record(engine) -> {(request id, sample index): [logits of each token the engine sampled]}, filled
    as the engine steps."""

    def record(engine) -> dict[tuple[str, int], list[torch.Tensor]]:
        recorder = _LogitsRecorder(engine.runner.sampler)
        engine.runner.sampler = recorder
        return recorder.rows

    return record


def save_random_hf_checkpoint(folder, architecture: str, tokenizer, seed: int) -> str:
    """A small random checkpoint of `architecture` (llama, qwen2) with `tokenizer`'s vocabulary, saved as
    an HF folder the server can load (safetensors + the tokenizer's files)."""
    transformers = pytest.importorskip("transformers")
    model_class, config_class = {"llama": (transformers.LlamaForCausalLM, transformers.LlamaConfig),
                                 "qwen2": (transformers.Qwen2ForCausalLM, transformers.Qwen2Config)}[architecture]
    config = config_class(vocab_size=len(tokenizer), hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                          num_key_value_heads=1, intermediate_size=64, max_position_embeddings=256,
                          tie_word_embeddings=True)
    torch.manual_seed(seed)
    model = model_class(config)
    with torch.no_grad():  # spread logits, so that greedy ties are rare
        for param in model.parameters():
            param.normal_(0, 0.3)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def random_hf_folders(tmp_path_factory, hf_smollm2_tokenizer) -> dict[str, str]:
    """Two random checkpoints of different architectures on the default model's tokenizer: llama, qwen."""
    root = tmp_path_factory.mktemp("models")
    return {"llama": save_random_hf_checkpoint(root / "llama", "llama", hf_smollm2_tokenizer, 1),
            "qwen": save_random_hf_checkpoint(root / "qwen", "qwen2", hf_smollm2_tokenizer, 2)}

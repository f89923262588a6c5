"""Shared fixtures: the default model (SmolLM2-135M-Instruct Q4_1 GGUF) loaded by us and by transformers."""

import pytest
import torch

from tinyserve.loader.gguf import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.model_loader import build_model, resolve_model_path


def pytest_sessionstart(session):
    """Build (or load) the C++ kernels before any test runs: a first build takes minutes on a slow
    machine, and inside a test it would run against that test's own deadline (a server's start, say)."""
    from tinyserve.layers import cpu_kernels

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

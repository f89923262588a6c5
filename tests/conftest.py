"""Shared fixtures: the default model (SmolLM2-135M-Instruct Q4_1 GGUF) loaded by us and by transformers."""

import pytest
import torch

from tinyserve.loader.gguf import gguf_model_config, gguf_tensors, open_gguf
from tinyserve.loader.model_loader import build_model, resolve_model_path


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

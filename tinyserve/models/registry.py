"""Architecture family key -> model class. Hugging Face `architectures` names map onto the same keys."""

from __future__ import annotations

import torch
from torch import nn

from tinyserve.models.gemma3 import Gemma3ForCausalLM
from tinyserve.models.gpt2 import GPT2LMHeadModel
from tinyserve.models.llama import LlamaForCausalLM
from tinyserve.models.qwen2 import Qwen2ForCausalLM
from tinyserve.models.qwen3 import Qwen3ForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
    "qwen2": Qwen2ForCausalLM,
    "qwen3": Qwen3ForCausalLM,
    "gpt2": GPT2LMHeadModel,
    "gemma3": Gemma3ForCausalLM,
}

# config.json `architectures[0]` -> family key
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "GPT2LMHeadModel": "gpt2",
    "Gemma3ForCausalLM": "gemma3",
}


def get_model_class(family: str) -> type[nn.Module]:
    if family not in MODEL_CLASSES:
        raise ValueError(f"architecture {family!r} is not supported (supported: {', '.join(sorted(MODEL_CLASSES))})")
    return MODEL_CLASSES[family]


def family_of_hf_architecture(name: str) -> str:
    if name not in HF_ARCHITECTURES:
        supported = ", ".join(sorted(HF_ARCHITECTURES))
        raise ValueError(f"architecture {name!r} is not supported (supported: {supported})")
    return HF_ARCHITECTURES[name]


def device_and_dtype(model: nn.Module) -> tuple[torch.device, torch.dtype]:
    """Where a loaded model computes, and in what dtype: its first parameter that holds memory (a
    quantized model's matrices live in kernel layouts, their parameters on the meta device)."""
    param = next(p for p in model.parameters() if not p.is_meta)
    return param.device, param.dtype

"""Architecture family key -> model class. Hugging Face `architectures` names map onto the same keys."""

from __future__ import annotations

from torch import nn

from tinyserve.models.llama import LlamaForCausalLM

MODEL_CLASSES: dict[str, type[nn.Module]] = {
    "llama": LlamaForCausalLM,
}

# config.json `architectures[0]` -> family key
HF_ARCHITECTURES = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "llama",
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

"""Explicit weight-name maps. Checkpoint names are Hugging Face's; GGUF files use llama.cpp's names, which
are mapped to Hugging Face's first. Anything a map does not name is an unexpected tensor (an error)."""

from __future__ import annotations

import re

# llama.cpp per-layer suffix -> Hugging Face per-layer suffix, for the Llama family (incl. Qwen2/Qwen3).
_LLAMA_GGUF_LAYER = {
    "attn_norm": "input_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_LLAMA_GGUF_GLOBAL = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Gemma 3's sandwich norms: llama.cpp's ffn_norm is the norm before the MLP (pre_feedforward_layernorm)
_GEMMA3_GGUF_LAYER = {
    **{k: v for k, v in _LLAMA_GGUF_LAYER.items() if k != "ffn_norm"},
    "post_attention_norm": "post_attention_layernorm",
    "ffn_norm": "pre_feedforward_layernorm",
    "post_ffw_norm": "post_feedforward_layernorm",
}
_GPT2_GGUF_LAYER = {
    "attn_norm": "ln_1",
    "attn_qkv": "attn.c_attn",
    "attn_output": "attn.c_proj",
    "ffn_norm": "ln_2",
    "ffn_up": "mlp.c_fc",
    "ffn_down": "mlp.c_proj",
}
_GPT2_GGUF_GLOBAL = {
    "token_embd": "transformer.wte",
    "position_embd": "transformer.wpe",
    "output_norm": "transformer.ln_f",
    "output": "lm_head",
}
_GGUF_MAPS = {
    "llama": (_LLAMA_GGUF_GLOBAL, _LLAMA_GGUF_LAYER, "model.layers"),
    "qwen2": (_LLAMA_GGUF_GLOBAL, _LLAMA_GGUF_LAYER, "model.layers"),
    "qwen3": (_LLAMA_GGUF_GLOBAL, _LLAMA_GGUF_LAYER, "model.layers"),
    "gpt2": (_GPT2_GGUF_GLOBAL, _GPT2_GGUF_LAYER, "transformer.h"),
    "gemma3": (_LLAMA_GGUF_GLOBAL, _GEMMA3_GGUF_LAYER, "model.layers"),
}
_LAYER_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)$")
_GLOBAL_NAME = re.compile(r"(\w+)\.(weight|bias)$")


def gguf_to_hf_name(architecture: str, name: str) -> str | None:
    """`blk.3.attn_q.weight` -> `model.layers.3.self_attn.q_proj.weight`; None if the map has no entry."""
    global_map, layer_map, layer_prefix = _GGUF_MAPS[architecture]
    if m := _LAYER_NAME.match(name):
        suffix = layer_map.get(m.group(2))
        return None if suffix is None else f"{layer_prefix}.{m.group(1)}.{suffix}.{m.group(3)}"
    if m := _GLOBAL_NAME.match(name):
        base = global_map.get(m.group(1))
        return None if base is None else f"{base}.{m.group(2)}"
    return None


def to_param_name(hf_name: str, packed_modules: dict[str, tuple[str, int]]) -> tuple[str, int | None]:
    """Checkpoint name -> (our parameter name, shard index in a MergedLinear or None)."""
    parts = hf_name.split(".")
    for i, part in enumerate(parts):
        if part in packed_modules:
            merged, shard = packed_modules[part]
            return ".".join(parts[:i] + [merged] + parts[i + 1 :]), shard
    return hf_name, None

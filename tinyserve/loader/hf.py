"""Hugging Face checkpoint folders: hyper-parameters from config.json (and generation_config.json), tensors
from safetensors files, memory-mapped and read one at a time. Pickled `.bin` weights are refused: loading
them would run arbitrary code from the checkpoint."""

from __future__ import annotations

import json
import math
import os
import re
from collections.abc import Iterator
from functools import partial
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from tinyserve.config import SAMPLING_DEFAULT_FIELDS, ModelConfig, RopeScaling
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.weights import NamedTensor, TensorSource
from tinyserve.models.registry import family_of_hf_architecture, get_model_class

# Buffers some checkpoints carry that we recompute or never need: rotary tables, GPT-2's causal mask.
_IGNORED = re.compile(r"(rotary_emb\.inv_freq|\.attn\.bias|\.attn\.masked_bias)$")
_SUPPORTED_ACTS = {"llama": ("silu",), "qwen2": ("silu",), "qwen3": ("silu",),
                   "gpt2": ("gelu_new", "gelu_pytorch_tanh"), "gemma3": ("gelu_pytorch_tanh",)}


def _read_json(path: Path) -> dict[str, Any]:
    try:
        value = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise ModelLoadError(f"{path}: not readable JSON ({type(exc).__name__}: {exc})") from None
    if not isinstance(value, dict):
        raise ModelLoadError(f"{path}: not a JSON object")
    return value


def _read_config(folder: Path) -> dict[str, Any]:
    path = folder / "config.json"
    if not path.is_file():
        raise ModelLoadError(f"{folder}: no config.json (not a Hugging Face checkpoint folder)")
    return _read_json(path)


def _family(raw: dict[str, Any]) -> str:
    architectures = raw.get("architectures") or []
    if not isinstance(architectures, list) or not architectures or not isinstance(architectures[0], str):
        raise ModelLoadError("config.json names no architecture (`architectures` is missing, empty or not a list)")
    try:
        return family_of_hf_architecture(architectures[0])
    except ValueError as exc:
        raise ModelLoadError(f"config.json: {exc}") from None


def _require(raw: dict[str, Any], key: str) -> Any:
    if raw.get(key) is None:
        raise ModelLoadError(f"config.json is missing {key!r}")
    return raw[key]


# JSON values are converted here, so that a string, a list or NaN where a number belongs is an error that
# names its key (not a TypeError), and a float is not truncated into a size.
def _as_int(value: Any, key: str) -> int:
    if isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, float) and value.is_integer():  # some exporters write 4096.0
        return int(value)
    raise ModelLoadError(f"config.json: {key} must be an integer, got {value!r}")


def _as_float(value: Any, key: str) -> float:
    if isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
        return float(value)
    raise ModelLoadError(f"config.json: {key} must be a finite number, got {value!r}")


def _int(raw: dict[str, Any], key: str) -> int:
    return _as_int(_require(raw, key), key)


def _rope(raw: dict[str, Any]) -> tuple[float, RopeScaling | None]:
    """(rope_theta, scaling). transformers >= 5 writes `rope_parameters` (theta inside it); older configs
    write `rope_theta` at the top and `rope_scaling` (null, or keyed by `type` or `rope_type`)."""
    params = raw.get("rope_parameters") or raw.get("rope_scaling") or {}
    if not isinstance(params, dict):
        raise ModelLoadError(f"config.json: rope parameters must be an object, got {params!r}")
    if params and not ({"rope_type", "type", "rope_theta"} & params.keys()):
        raise ModelLoadError(f"config.json: per-layer rope parameters are not supported ({sorted(params)})")
    theta = _as_float(params.get("rope_theta", raw.get("rope_theta", 10000.0)), "rope_theta")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind == "default":
        return theta, None
    if kind not in ("linear", "llama3"):
        raise ModelLoadError(f"config.json: rope scaling type {kind!r} is not supported (supported: linear, llama3)")
    try:
        if kind == "linear":
            return theta, RopeScaling("linear", factor=_as_float(params["factor"], "rope_scaling.factor"))
        return theta, RopeScaling(
            "llama3", **{key: _as_float(params[key], f"rope_scaling.{key}")
                         for key in ("factor", "low_freq_factor", "high_freq_factor")},
            original_max_position_embeddings=_as_int(params["original_max_position_embeddings"],
                                                     "rope_scaling.original_max_position_embeddings"),
        )
    except KeyError as exc:
        raise ModelLoadError(f"config.json: {kind} rope scaling is missing {exc}") from None


def _llama_fields(raw: dict[str, Any], family: str) -> dict[str, Any]:
    """Llama, Mistral, Qwen2, Qwen3 (and Gemma 3) share these names."""
    # Qwen2 always has q/k/v biases (its config has no key for it). Llama's and Qwen3's attention_bias
    # would also put a bias on o_proj, which our LlamaAttention does not have.
    attention_bias = family == "qwen2" or bool(raw.get("attention_bias", False))
    if attention_bias and family != "qwen2":
        raise ModelLoadError(f"config.json: attention_bias=true is not supported for {family} (bias on o_proj)")
    if raw.get("mlp_bias"):
        raise ModelLoadError("config.json: mlp_bias=true is not supported")
    theta, scaling = _rope(raw)
    num_heads = _int(raw, "num_attention_heads")
    # Mistral sets sliding_window alone, for every layer. Qwen configs carry one that applies only with
    # use_sliding_window, and then only to the layers from max_window_layers on, which ModelConfig's one
    # window for all layers cannot say.
    if family != "llama" and raw.get("use_sliding_window"):
        raise ModelLoadError(f"config.json: use_sliding_window=true is not supported for {family} "
                             "(a window on the layers from max_window_layers on)")
    window = raw.get("sliding_window") if family in ("llama", "gemma3") else None
    return dict(
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=_int(raw, "hidden_size"),
        num_hidden_layers=_int(raw, "num_hidden_layers"),
        num_attention_heads=num_heads,
        num_key_value_heads=_as_int(raw.get("num_key_value_heads") or num_heads, "num_key_value_heads"),
        intermediate_size=_int(raw, "intermediate_size"),
        max_position_embeddings=_int(raw, "max_position_embeddings"),
        norm_eps=_as_float(_require(raw, "rms_norm_eps"), "rms_norm_eps"),
        head_dim=_as_int(raw["head_dim"], "head_dim") if raw.get("head_dim") else None,  # None: hidden / heads
        rope_theta=theta,
        rope_scaling=scaling,
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        attention_bias=attention_bias,
        qk_norm=family in ("qwen3", "gemma3"),
        hidden_act=raw.get("hidden_act", "silu"),
        sliding_window=None if window is None else _as_int(window, "sliding_window"),
    )


def _gemma3_fields(raw: dict[str, Any]) -> dict[str, Any]:
    """Llama's names, plus local/global layers each with its own rotary base. transformers >= 5 writes
    `rope_parameters` keyed by layer type; older configs `rope_theta` (+ `rope_scaling`) for the global
    layers and `rope_local_base_freq` for the local ones."""
    for key in ("attn_logit_softcapping", "use_bidirectional_attention"):
        if raw.get(key):
            raise ModelLoadError(f"config.json: {key}={raw[key]!r} is not supported for gemma3")
    params = raw.get("rope_parameters") or {}
    if isinstance(params, dict) and "full_attention" in params:
        local = params.get("sliding_attention") or {}
        if local.get("rope_type", "default") != "default":
            raise ModelLoadError(f"config.json: rope scaling on gemma3's sliding layers is not supported ({local})")
        local_theta = local.get("rope_theta", 10000.0)
        raw = {**raw, "rope_parameters": {"rope_theta": 1e6, **(params["full_attention"] or {})}}
    else:
        local_theta = raw.get("rope_local_base_freq", 10000.0)
        raw = {"rope_theta": 1e6, **raw}  # transformers' defaults for Gemma 3's global and local bases
    num_layers = _int(raw, "num_hidden_layers")
    pattern = _as_int(raw.get("sliding_window_pattern", 6), "sliding_window_pattern")  # every pattern-th global
    layer_types = raw.get("layer_types") or [
        "full_attention" if (i + 1) % pattern == 0 else "sliding_attention" for i in range(num_layers)]
    if not isinstance(layer_types, list) or not set(layer_types) <= {"sliding_attention", "full_attention"}:
        raise ModelLoadError(f"config.json: layer_types must list sliding_attention or full_attention, "
                             f"got {layer_types!r}")
    fields = _llama_fields({**raw, "hidden_act": raw.get("hidden_activation", "gelu_pytorch_tanh")}, "gemma3")
    return dict(fields, tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
                layer_is_sliding=tuple(t == "sliding_attention" for t in layer_types),
                rope_local_theta=_as_float(local_theta, "rope_local_base_freq"),
                query_pre_attn_scalar=_as_float(_require(raw, "query_pre_attn_scalar"), "query_pre_attn_scalar"),
                final_logit_softcapping=(None if raw.get("final_logit_softcapping") is None else
                                         _as_float(raw["final_logit_softcapping"], "final_logit_softcapping")))


def _gpt2_fields(raw: dict[str, Any]) -> dict[str, Any]:
    if raw.get("scale_attn_by_inverse_layer_idx") or not raw.get("scale_attn_weights", True):
        raise ModelLoadError("config.json: GPT-2 attention scaling other than 1/sqrt(head_dim) is not supported")
    hidden, num_heads = _int(raw, "n_embd"), _int(raw, "n_head")
    return dict(
        vocab_size=_int(raw, "vocab_size"),
        hidden_size=hidden,
        num_hidden_layers=_int(raw, "n_layer"),
        num_attention_heads=num_heads,
        num_key_value_heads=num_heads,
        intermediate_size=_as_int(raw.get("n_inner") or 4 * hidden, "n_inner"),
        max_position_embeddings=_int(raw, "n_positions"),
        norm_eps=_as_float(raw.get("layer_norm_epsilon", 1e-5), "layer_norm_epsilon"),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", True)),
        hidden_act=raw.get("activation_function", "gelu_new"),
    )


def _as_ids(value: Any, key: str) -> list[int]:
    """eos_token_id (and rarely bos) is an int, a list of ints, or null."""
    values = [] if value is None else value if isinstance(value, list) else [value]
    return [_as_int(v, key) for v in values]


def hf_model_config(folder: str | Path) -> ModelConfig:
    """The checkpoint's hyper-parameters, checked (ModelConfig's bounds) before anything is built from them."""
    folder = Path(folder)
    raw = _read_config(folder)
    family = _family(raw)
    try:
        read = {"gpt2": _gpt2_fields, "gemma3": _gemma3_fields}.get(family, partial(_llama_fields, family=family))
        fields = read(raw)
        if fields["hidden_act"] not in _SUPPORTED_ACTS[family]:
            raise ModelLoadError(f"config.json: activation {fields['hidden_act']!r} is not supported for {family}")
        generation = (_read_json(folder / "generation_config.json")
                      if (folder / "generation_config.json").is_file() else {})
        bos_ids = _as_ids(generation.get("bos_token_id", raw.get("bos_token_id")), "bos_token_id")
        eos_ids = _as_ids(generation.get("eos_token_id"), "eos_token_id") + _as_ids(raw.get("eos_token_id"),
                                                                                    "eos_token_id")
        return ModelConfig(
            architecture=family, **fields, bos_token_id=bos_ids[0] if bos_ids else None,
            eos_token_ids=tuple(dict.fromkeys(eos_ids)),  # de-duplicated, first-seen order
        )
    except ModelLoadError:
        raise
    except ValueError as exc:  # ModelConfig's and RopeScaling's checks
        raise ModelLoadError(f"{folder / 'config.json'}: {exc}") from None


def hf_sampling_fields(folder: str | Path) -> dict[str, float | int | None]:
    """The sampling fields a folder's generation_config.json sets (SamplingDefaults' names; {} without the
    file), as vLLM's `--generation-config auto` reads them. `do_sample: false` is HF's greedy: temperature 0.
    NOTE: HF's GenerationConfig defaults do_sample to false, but checkpoints that set a temperature without
    do_sample mean to sample (and vLLM samples them), so only an explicit false means greedy."""
    path = Path(folder) / "generation_config.json"
    raw = _read_json(path) if path.is_file() else {}
    fields: dict[str, float | int | None] = {}
    for key in SAMPLING_DEFAULT_FIELDS:
        value = raw.get(key)
        if value is None:
            continue
        if key == "top_k":
            if not isinstance(value, int) or isinstance(value, bool):
                raise ModelLoadError(f"{path}: top_k must be an integer, got {value!r}")
            fields[key] = value
        elif isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value):
            fields[key] = float(value)
        else:
            raise ModelLoadError(f"{path}: {key} must be a finite number, got {value!r}")
    if raw.get("do_sample") is False:
        fields["temperature"] = 0.0
    return fields


def _weight_files(folder: Path) -> list[Path]:
    """The safetensors files of a checkpoint: the shards its index lists, or the single model.safetensors."""
    index = folder / "model.safetensors.index.json"
    if index.is_file():
        weight_map = _read_json(index).get("weight_map")
        if not isinstance(weight_map, dict) or not weight_map:
            raise ModelLoadError(f"{index}: no weight_map")
        names = list(dict.fromkeys(weight_map.values()))
        if not all(isinstance(name, str) for name in names):
            raise ModelLoadError(f"{index}: weight_map values must be file names (strings)")
        files = [_shard_path(folder, index, name) for name in sorted(names)]
        for path in files:
            if not path.is_file():
                raise ModelLoadError(f"{index} lists {path.name}, which is missing")
        return files
    if (folder / "model.safetensors").is_file():
        return [folder / "model.safetensors"]
    if any(folder.glob("*.bin")) or any(folder.glob("*.pt")):
        raise ModelLoadError(f"{folder}: only safetensors weights are supported (found pickled .bin/.pt files)")
    raise ModelLoadError(f"{folder}: no weight files (model.safetensors or model.safetensors.index.json)")


def _shard_path(folder: Path, index: Path, name: str) -> Path:
    """The file an index names, refused unless it lies inside the folder: the index is data from the
    checkpoint, and `../` or an absolute path would open any file on the machine. The name is resolved
    lexically and each folder on its way must be a real one, but the file itself may be a link: Hugging
    Face's cache links every file of a snapshot to a blob outside it."""
    relative = os.path.normpath(name) if name and "\x00" not in name else ""
    parts = Path(relative).parts
    if not parts or Path(relative).is_absolute() or ".." in parts:
        raise ModelLoadError(f"{index}: weight_map file {name!r} is outside the model folder")
    path = folder / relative
    if path.parent.resolve() != folder.resolve().joinpath(*parts[:-1]):
        raise ModelLoadError(f"{index}: weight_map file {name!r} is outside the model folder (through a link)")
    return path


def _open(path: Path):
    try:
        return safe_open(str(path), framework="pt", device="cpu")
    except Exception as exc:  # SafetensorError, OSError: a truncated or corrupt file
        raise ModelLoadError(f"{path}: not a readable safetensors file ({type(exc).__name__}: {exc})") from None


def _producer(handle, path: Path, name: str, transpose: bool) -> TensorSource:
    def fetch(rows: None = None) -> torch.Tensor:  # safetensors copies the bytes out of its mapping
        try:
            return handle.get_tensor(name)
        except Exception as exc:
            raise ModelLoadError(f"{path}: tensor {name!r} cannot be read ({type(exc).__name__}: {exc})") from None

    def decode(tensor: torch.Tensor, rows: None = None) -> torch.Tensor:
        return tensor.t() if transpose else tensor  # Conv1D [in, out] -> Linear [out, in]

    try:  # from the header: nothing is read
        shape = tuple(handle.get_slice(name).get_shape())
    except Exception as exc:
        raise ModelLoadError(f"{path}: tensor {name!r} cannot be read ({type(exc).__name__}: {exc})") from None
    return TensorSource(shape[::-1] if transpose else shape, lambda: decode(fetch()), fetch=fetch, decode=decode)


def hf_tensors(folder: str | Path) -> Iterator[NamedTensor]:
    """Yield (Hugging Face name, producer of a CPU tensor in the file's dtype) for every tensor. The
    handles stay open (memory-mapped) as long as a producer refers to them."""
    folder = Path(folder)
    model_class = get_model_class(_family(_read_config(folder)))
    conv1d = getattr(model_class, "conv1d_weights", ())
    handles = [(path, _open(path)) for path in _weight_files(folder)]
    names = [name for _, handle in handles for name in handle.keys()]
    prefix = getattr(model_class, "checkpoint_prefix", None)
    add_prefix = prefix is not None and not any(n.startswith(prefix + ".") for n in names)
    for path, handle in handles:
        for name in handle.keys():
            hf_name = f"{prefix}.{name}" if add_prefix and not name.startswith("lm_head.") else name
            yield hf_name, _producer(handle, path, name, hf_name.endswith(conv1d))


def hf_ignored(name: str, config: ModelConfig) -> bool:
    """Tensors safely skipped: recomputed buffers, and a tied model's lm_head (its embedding is the head;
    transformers ties them the same way, whatever the file holds)."""
    return bool(_IGNORED.search(name)) or (config.tie_word_embeddings and name == "lm_head.weight")

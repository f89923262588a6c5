"""GGUF files (llama.cpp's format), read by loader/gguf/file_format.py and dequantized by the `gguf` library:
hyper-parameters from the metadata (and from the rope_freqs tensor: Llama 3.x's rotary scaling), tensors
dequantized to float32 one at a time (a large one by blocks of rows), renamed to Hugging Face's names, and
llama.cpp's converter's changes undone: its Q/K row permutation (Llama, Mistral), so that the rotary layout
is Hugging Face's again, and the 1 it adds to Gemma 3's norm weights (its converter writes 1 + w; our
GemmaRMSNorm, as transformers', holds w)."""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from functools import partial
from pathlib import Path

import gguf
import numpy as np
import torch

from tinyserve.config import ModelConfig, RopeScaling
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.gguf.blocks import CODE_BITS, SUPERBLOCK_CODES, file_codes
from tinyserve.loader.gguf.file_format import GGUFFile, GGUFTensor
from tinyserve.loader.names import gguf_to_hf_name
from tinyserve.loader.weights import FileCodes, NamedTensor, TensorSource

logger = logging.getLogger(__name__)

# GGUF `general.architecture` -> our family key
_ARCHITECTURES = {"llama": "llama", "mistral": "llama", "qwen2": "qwen2", "qwen3": "qwen3", "gpt2": "gpt2",
                  "gemma3": "gemma3"}
_HIDDEN_ACTS = {"gpt2": "gelu_new", "gemma3": "gelu_pytorch_tanh"}  # the others: silu
# read into ModelConfig.rope_scaling, not into a parameter; as llama.cpp, for the llama family only (another
# family's file with it is refused: its tensor is unexpected)
_ROPE_FREQS = "rope_freqs.weight"
# each supported tensor type -> the bits of its codes (TensorSource.stored_bits; None: a float type). A K-quant
# mix (Q4_K_M) keeps some tensors at 5-8 bits on purpose; `--quantization int4` keeps those at int8. The types
# of 4 bits or fewer that none of our formats holds as they are (Q2_K, Q3_K, the IQ types, TQ, MXFP4, NVFP4)
# load through a conversion: dequantized by rows (the gguf library) and quantized again by the format's rule,
# int4 per 32 weights (logged per type at load, with the file's bytes); the float path takes their values.
_TYPE_BITS = (("F32", None), ("F16", None), ("BF16", None), ("Q8_0", 8), ("Q4_0", 4), ("Q4_1", 4), ("Q5_0", 5),
              ("Q5_1", 5), ("Q4_K", 4), ("Q5_K", 5), ("Q6_K", 6))
_CONVERTED_TYPE_BITS = (("Q2_K", 2), ("Q3_K", 3), ("IQ4_NL", 4), ("IQ4_XS", 4), ("IQ3_XXS", 3), ("IQ3_S", 3),
                        ("IQ2_XXS", 2), ("IQ2_XS", 2), ("IQ2_S", 2), ("IQ1_S", 1), ("IQ1_M", 1), ("TQ1_0", 1),
                        ("TQ2_0", 2), ("MXFP4", 4), ("NVFP4", 4))
_STORED_BITS = {  # the gguf library names the newer types or not, by its version
    getattr(gguf.GGMLQuantizationType, name): bits for name, bits in _TYPE_BITS + _CONVERTED_TYPE_BITS
    if hasattr(gguf.GGMLQuantizationType, name)
}


def gguf_linears_quantized(reader: GGUFFile) -> bool:
    """Whether the file stores every matrix of its blocks (the linears: norms are vectors) in a quantized
    type, as llama.cpp's quantizer writes them: `--quantization auto` then serves its codes."""
    matrices = [t for t in reader.tensors if t.name.startswith("blk.") and len(t.shape) == 2]
    return bool(matrices) and all(_STORED_BITS.get(t.tensor_type) is not None for t in matrices)


def open_gguf(path: str | Path) -> GGUFFile:
    try:
        return GGUFFile(path)
    except Exception as exc:  # a truncated or corrupt file fails in assorted ways (struct, mmap, unicode)
        raise ModelLoadError(f"{path}: not a readable GGUF file ({type(exc).__name__}: {exc})") from None


def field(reader: GGUFFile, key: str, default=None):
    return reader.metadata.get(key, default)


def gguf_architecture(reader: GGUFFile) -> tuple[str, str]:
    """(the file's own architecture name, our family key); unknown ones list what is supported."""
    arch = field(reader, "general.architecture")
    if arch not in _ARCHITECTURES:
        supported = ", ".join(sorted(_ARCHITECTURES))
        raise ModelLoadError(f"GGUF architecture {arch!r} is not supported (supported: {supported})")
    return arch, _ARCHITECTURES[arch]


def _number(value, key: str, kind: type[int] | type[float]):
    """A metadata value as int or float; an array or a string (per-layer head counts, a damaged file) is
    an error that names its key."""
    if isinstance(value, (bool, str, bytes, list)) or value is None:
        raise ModelLoadError(f"GGUF metadata: {key} must be a number, got {value!r}")
    return kind(value)


def gguf_model_config(reader: GGUFFile) -> ModelConfig:
    """The file's hyper-parameters, checked (ModelConfig's bounds) before anything is built from them."""
    arch, family = gguf_architecture(reader)

    def get(key: str, kind: type[int] | type[float], default=None):
        value = field(reader, f"{arch}.{key}", default)
        if value is None:
            raise ModelLoadError(f"GGUF metadata is missing {arch}.{key}")
        return _number(value, f"{arch}.{key}", kind)

    tokens = field(reader, "tokenizer.ggml.tokens")
    vocab_size = get("vocab_size", int, len(tokens) if tokens else 0)
    if not vocab_size:
        raise ModelLoadError(f"GGUF metadata gives no vocabulary size ({arch}.vocab_size)")
    tensor_names = {t.name for t in reader.tensors}
    norm_eps_key = "attention.layer_norm_epsilon" if family == "gpt2" else "attention.layer_norm_rms_epsilon"
    num_heads = get("attention.head_count", int)
    gemma = _gemma3_fields(reader, get, num_heads) if family == "gemma3" else {}
    try:
        return ModelConfig(
            architecture=family,
            vocab_size=vocab_size,
            hidden_size=get("embedding_length", int),
            num_hidden_layers=get("block_count", int),
            num_attention_heads=num_heads,
            num_key_value_heads=get("attention.head_count_kv", int, num_heads),
            intermediate_size=get("feed_forward_length", int),
            max_position_embeddings=get("context_length", int),
            norm_eps=get(norm_eps_key, float),
            head_dim=get("attention.key_length", int, 0) or None,  # absent or 0: hidden / heads (ModelConfig)
            rope_theta=get("rope.freq_base", float, 10000.0),
            rope_scaling=_rope_scaling(reader, arch, family),
            tie_word_embeddings="output.weight" not in tensor_names,
            attention_bias="blk.0.attn_q.bias" in tensor_names,
            qk_norm="blk.0.attn_q_norm.weight" in tensor_names or family == "gemma3",
            hidden_act=_HIDDEN_ACTS.get(family, "silu"),
            # llama.cpp's key for a window on every layer (a converted Mistral may carry it), or on Gemma 3's
            # local layers; absent: none
            sliding_window=get("attention.sliding_window", int, 0) or None,
            **gemma,
        )
    except ModelLoadError:
        raise
    except ValueError as exc:  # ModelConfig's and RopeScaling's checks
        raise ModelLoadError(f"{reader.path}: GGUF metadata: {exc}") from None


def _gemma3_fields(reader: GGUFFile, get, num_heads: int) -> dict:
    """What llama.cpp's converter leaves out of a Gemma 3 GGUF, taken as llama.cpp's gemma3 code takes it: every
    6th layer global, the others local (the file may say otherwise in attention.sliding_window_pattern), the
    local layers' rotary base 10000 (rope.freq_base_swa where the file has it), the attention scale
    1/sqrt(head_dim), but 1/sqrt(hidden / heads) for the 27B model (62 layers), whose config says so."""
    arch = "gemma3"
    if field(reader, f"{arch}.attn_logit_softcapping"):
        raise ModelLoadError(f"GGUF metadata: {arch}.attn_logit_softcapping is not supported")
    num_layers, hidden = get("block_count", int), get("embedding_length", int)
    pattern_key = f"{arch}.attention.sliding_window_pattern"
    pattern = field(reader, pattern_key, 6)
    if isinstance(pattern, list):  # llama.cpp's per-layer form: true where the layer is local
        if len(pattern) != num_layers or not all(isinstance(p, bool) for p in pattern):
            raise ModelLoadError(f"GGUF metadata: {pattern_key} must hold one bool per layer, got {pattern!r}")
        is_sliding = tuple(pattern)
    else:
        period = _number(pattern, pattern_key, int)
        if period < 1:
            raise ModelLoadError(f"GGUF metadata: {pattern_key} must be >= 1, got {period}")
        is_sliding = tuple((i + 1) % period != 0 for i in range(num_layers))
    head_dim = get("attention.key_length", int, 0) or hidden // num_heads
    softcap = get("final_logit_softcapping", float, 0.0) or None
    return dict(layer_is_sliding=is_sliding, rope_local_theta=get("rope.freq_base_swa", float, 10000.0),
                query_pre_attn_scalar=float(hidden // num_heads if num_layers == 62 else head_dim),
                final_logit_softcapping=softcap)


# general.sampling.* keys (llama.cpp's model-embedded recommendations) -> SamplingDefaults' names
_SAMPLING_KEYS = {"temp": "temperature", "top_k": "top_k", "top_p": "top_p", "min_p": "min_p",
                  "penalty_repeat": "repetition_penalty"}


def gguf_sampling_fields(reader: GGUFFile) -> dict[str, float | int | None]:
    """The sampling fields the file recommends in its general.sampling.* metadata ({} for none), as llama.cpp
    reads them; f32 values are rounded to 6 digits, so that 0.95 is not 0.949999988. Keys llama.cpp has and we
    have no sampler for (mirostat, xtc, penalty_last_n, sequence) are not read."""
    fields: dict[str, float | int | None] = {}
    for suffix, name in _SAMPLING_KEYS.items():
        key = f"general.sampling.{suffix}"
        value = field(reader, key)
        if value is not None:
            fields[name] = _number(value, key, int) if name == "top_k" else round(_number(value, key, float), 6)
    return fields


def _rope_scaling(reader: GGUFFile, arch: str, family: str) -> RopeScaling | None:
    """The metadata's linear scaling, or the rope_freqs tensor's per-frequency divisors (llama.cpp's converter
    writes a Llama 3.x's llama3 scaling as that tensor, with no scaling type). llama.cpp would apply both where
    a file has both; its converter writes one or the other, so such a file is refused, not guessed at."""
    kind = field(reader, f"{arch}.rope.scaling.type")
    rope_freqs = next((t for t in reader.tensors if t.name == _ROPE_FREQS and family == "llama"), None)
    if rope_freqs is not None:
        if kind not in (None, "none"):
            raise ModelLoadError(f"GGUF has both a {_ROPE_FREQS} tensor and {arch}.rope.scaling.type {kind!r}; "
                                 f"only one of them is supported")
        # a bound before the values become a tuple: head_dim // 2 of the largest head_dim ModelConfig allows
        if len(rope_freqs.shape) != 1 or rope_freqs.shape[0] > ModelConfig.MAX_SIZES["head_dim"] // 2:
            raise ModelLoadError(f"GGUF tensor {_ROPE_FREQS!r} must be 1-d [head_dim // 2], got {rope_freqs.shape}")
        return RopeScaling("freq_factors", freq_factors=tuple(float(f) for f in _dequantize(rope_freqs)))
    if kind in (None, "none"):
        return None
    if kind != "linear":
        raise ModelLoadError(f"GGUF rope scaling {kind!r} is not supported (supported: linear)")
    factor_key = f"{arch}.rope.scaling.factor"
    return RopeScaling("linear", factor=_number(field(reader, factor_key, 1.0), factor_key, float))


def _unpermute_rope_rows(w: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp interleaves each head's rotary halves; restore Hugging Face's half-split layout. The rows
    split into heads of an even head_dim: the shape was matched to the config's before any read."""
    shape = w.shape
    return w.reshape(num_heads, shape[0] // num_heads // 2, 2, *shape[1:]).swapaxes(1, 2).reshape(shape)


def _fetch(tensor: GGUFTensor, rows: tuple[int, int] | None = None) -> np.ndarray:
    """The tensor's bytes (or those of its rows [start, stop) alone: its data's first axis is its rows), copied
    out of the mapped file: the read of a load's I/O thread, where the pages fault in (loader/file_reads.py)."""
    return np.array(tensor.data if rows is None else tensor.data[rows[0]:rows[1]])


def _dequantize(tensor: GGUFTensor, rows: tuple[int, int] | None = None, data: np.ndarray | None = None) -> np.ndarray:
    """The values of the tensor, or of its rows [start, stop) alone, from `data` (_fetch's copy of them; None:
    read from the mapping here)."""
    if tensor.tensor_type not in _STORED_BITS:
        raise ModelLoadError(f"tensor {tensor.name!r} has unsupported type {tensor.tensor_type.name}")
    if data is None:
        data = tensor.data if rows is None else tensor.data[rows[0]:rows[1]]
    shape = tensor.shape if rows is None else (rows[1] - rows[0], *tensor.shape[1:])
    try:
        return gguf.quants.dequantize(data, tensor.tensor_type).reshape(shape)
    except Exception as exc:
        raise ModelLoadError(f"tensor {tensor.name!r} cannot be read ({type(exc).__name__}: {exc})") from None


def _float32_tensor(w: np.ndarray) -> torch.Tensor:
    if w.dtype != np.float32:
        w = w.astype(np.float32)
    with warnings.catch_warnings():  # F32 tensors are read-only views of the mapped file: we only read
        warnings.simplefilter("ignore", UserWarning)
        return torch.from_numpy(w)


def gguf_tensors(reader: GGUFFile, config: ModelConfig) -> Iterator[NamedTensor]:
    """Yield (Hugging Face name, producer of a float32 CPU tensor) for every tensor in the file, with the bits
    its type stores (TensorSource.stored_bits). A tensor whose rows llama.cpp did not permute can also be
    read by blocks of rows (TensorSource.read_rows)."""
    arch, family = gguf_architecture(reader)
    permute = arch in ("llama", "mistral")  # llama.cpp permutes Q/K only for these
    # Gemma's norms (input, post-attention, pre/post-FFN, q/k, final) all end in norm.weight, as the
    # converter's test for adding 1 does
    shifts_norms = family == "gemma3"
    _check_types(reader)
    for tensor in reader.tensors:
        if tensor.name == _ROPE_FREQS and family == "llama":  # read by gguf_model_config
            continue
        hf_name = gguf_to_hf_name(family, tensor.name)
        if hf_name is None:
            raise ModelLoadError(f"GGUF tensor {tensor.name!r} is unexpected for architecture {arch!r}")
        num_heads = None
        if permute and ".q_proj." in hf_name:
            num_heads = config.num_attention_heads
        elif permute and ".k_proj." in hf_name:
            num_heads = config.num_key_value_heads

        shift = 1.0 if shifts_norms and hf_name.endswith("norm.weight") else 0.0

        def decode(data: np.ndarray, rows: tuple[int, int] | None, tensor=tensor, num_heads=num_heads,
                   shift=shift) -> torch.Tensor:
            w = _dequantize(tensor, rows, data)
            w = w if num_heads is None else _unpermute_rope_rows(w, num_heads)
            return _float32_tensor(w - np.float32(shift) if shift else w)

        fetch = partial(_fetch, tensor)

        def produce(fetch=fetch, decode=decode) -> torch.Tensor:
            return decode(fetch(None), None)

        def read_rows(start: int, stop: int, fetch=fetch, decode=decode) -> torch.Tensor:
            return decode(fetch((start, stop)), (start, stop))

        code_bits = CODE_BITS.get(tensor.tensor_type)
        decode_codes = None if code_bits is None else partial(_decode_codes, tensor, num_heads)
        superblocks, convert = None, SUPERBLOCK_CODES.get(tensor.tensor_type)
        if convert is not None and len(tensor.shape) == 2:
            superblocks = partial(_decode_codes, tensor, num_heads, convert=convert)
        # the norms and the permuted Q/K are read whole: only other matrices are read by blocks of rows
        rows = read_rows if num_heads is None and not shift else None
        yield hf_name, TensorSource(tensor.shape, produce, rows, _STORED_BITS.get(tensor.tensor_type), fetch, decode,
                                    code_bits, decode_codes, partial(reader.release, tensor), superblocks)


_CONVERTED = {name for name, _ in _CONVERTED_TYPE_BITS}


def _check_types(reader: GGUFFile) -> None:
    """Before any tensor is read: a type we cannot read is refused naming the tensor and its type, and the
    types read through a conversion (dequantized by rows, quantized again) are logged with their bytes."""
    converted: dict[str, list[int]] = {}  # type -> [tensors, bytes in the file]
    for tensor in reader.tensors:
        if tensor.tensor_type not in _STORED_BITS:
            raise ModelLoadError(f"tensor {tensor.name!r} has type {tensor.tensor_type.name}, which tinyserve "
                                 f"does not read (supported: {', '.join(t.name for t in _STORED_BITS)})")
        if tensor.tensor_type.name in _CONVERTED:
            entry = converted.setdefault(tensor.tensor_type.name, [0, 0])
            entry[0] += 1
            entry[1] += tensor.data.nbytes
    if converted:
        logger.warning("these tensor types have no format of their own here and are dequantized by rows and "
                       "quantized again (int4 per 32 weights, a head int8; the float path takes their values): "
                       "%s", ", ".join(f"{name} ({count} tensors, {size / (1 << 20):.0f} MiB in the file)"
                                       for name, (count, size) in converted.items()))


def _decode_codes(tensor: GGUFTensor, num_heads: int | None, data: np.ndarray, rows: tuple[int, int] | None,
                  convert=None) -> FileCodes:
    """The group codes of the tensor's rows in `data` (_fetch's bytes), Q/K rows unpermuted as _dequantize's;
    convert: bytes -> codes of another kind (blocks.SUPERBLOCK_CODES: a K-quant's)."""
    if num_heads is not None:
        data = _unpermute_rope_rows(data, num_heads)
    return file_codes(tensor.tensor_type, data) if convert is None else convert(data)

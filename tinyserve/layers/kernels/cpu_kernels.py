"""Our C++ CPU kernels (csrc/), compiled on first use by torch's extension builder and cached per machine:
loading them, and one thin wrapper per kernel. Only layers/ops.py calls these; it decides where they apply
(and the GGUF loader, loader/gguf/blocks.py, its Q4_0 / Q4_1 repacking).

- attention over the paged KV pool, decodes and prefill chunks in one call (csrc/paged_attention.cpp): torch
  has no paged attention for the CPU, and doing it with torch ops copied every sequence's K (a chunk's whole
  cached prefix) once per layer;
- the per-token elementwise work of a layer (csrc/fused_ops.cpp): RMSNorm with its residual add,
  rotary, SiLU-and-multiply, each one call instead of 3-8 eager ops;
- matmuls for the linears in bfloat16, int8 and int4 (csrc/bf16_matmul.cpp, csrc/quantized_matmul.cpp,
  csrc/int8_channel_matmul.cpp), and int4, int8 and GGUF Q4_K, Q5_0, Q5_1, Q5_K and Q6_K with unrounded
  activations (csrc/quantized_matmul_a16.cpp, its formats in csrc/a16_formats.h):
  weights interleaved 16 rows per vector lane, read at close to memory speed (docs/PERFORMANCE.md); and
  in float32 for steps of a few tokens (csrc/f32_matmul.cpp), on torch's own [out, in] matrix;
- a GGUF's Q4_0 / Q4_1 blocks and Q4_K / Q5_K / Q6_K super-blocks into the kernels' nibble order at load
  (csrc/gguf_nibbles.cpp): the same bytes as loader/gguf/blocks.py's torch ops, in one pass;
- greedy decoding's argmax over the logits (csrc/row_argmax.cpp): torch's CPU argmax compares index by index;
- the step's K and V into the pool (csrc/kv_write.cpp), both in one call: copied into a float pool, or each
  token's head rounded with its scale into an 8-bit one (~10 ops a tensor in torch).

They are built for float32 and bfloat16 on CPU (KERNEL_DTYPES), by `make setup` (`python -m
tinyserve.layers.kernels.cpu_kernels`), else by the first process that needs them: g++ and ninja compile every
source, and later processes load the cached library from ~/.cache/torch_extensions (or
$TORCH_EXTENSIONS_DIR). The build is named by a hash of the sources, flags and torch install, and
compiles copies of the sources kept beside it, so checkouts with the same kernels and environment share one
build and a changed kernel gets its own (torch keys a build by name and recompiles whenever the source paths
change).
Build and load times: docs/PERFORMANCE.md, "Numbers behind the code's comments".
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType

import torch

logger = logging.getLogger(__name__)

_CSRC = Path(__file__).with_name("csrc")
_SOURCES = ("bindings.cpp", "paged_attention.cpp", "fused_ops.cpp", "quantized_matmul.cpp",
            "bf16_matmul.cpp", "f32_matmul.cpp", "token_bitmask.cpp", "int8_channel_matmul.cpp",
            "kv_write.cpp", "row_argmax.cpp", "quantized_matmul_a16.cpp", "gguf_nibbles.cpp")
ATTENTION_HEAD_DIMS = (16, 32, 64, 128, 256)  # the head sizes the attention kernel is compiled for
KERNEL_DTYPES = (torch.float32, torch.bfloat16)  # the dtypes every kernel is compiled for
# -march=native: the build is per machine (its cache too). -ffast-math lets the compiler reassociate the
# dot products and sums into vector lanes and call the vectorized expf; inputs are finite scores. The attention
# and W4A16 kernels turn it off for themselves (a pragma): their outputs must not depend on a step's shape.
# (Compiler flags do not reach the link step, so the process's float mode is not changed.)
_CFLAGS = ["-O3", "-march=native", "-ffast-math", "-fopenmp"]


@contextlib.contextmanager
def _exclusive_build(name: str) -> Iterator[None]:
    """One build at a time across processes, and never a wait on a dead one. torch's own build lock is a
    plain file that a build killed mid-way (Ctrl-C, a timeout) leaves behind, and every later start then
    waits on it forever; an flock is released when its process dies. Holding ours, no other tinyserve
    process is building, so a torch lock file still there is stale and is removed."""
    from torch.utils.cpp_extension import _get_build_directory

    build_dir = Path(_get_build_directory(name, verbose=False))
    with open(build_dir / "tinyserve-build.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        (build_dir / "lock").unlink(missing_ok=True)
        yield


def build_name() -> str:
    """The build's name: a hash of every source and header, the flags, torch's version and its folder. The
    folder because the compile commands name its include paths, and ninja rebuilds every object whose
    command changed: two environments (two checkouts' venvs) sharing one build rebuilt it at every switch."""
    digest = hashlib.sha256(f"{_CFLAGS} {torch.__version__} {Path(torch.__file__).resolve().parent}".encode())
    for source in sorted(_CSRC.iterdir()):
        if source.suffix in (".cpp", ".h"):
            digest.update(source.name.encode() + b"\0" + source.read_bytes() + b"\0")
    return f"tinyserve_cpu_kernels_{digest.hexdigest()[:16]}"


def _staged_sources(build_dir: Path) -> list[str]:
    """Copies of the sources in the build's own folder: the same paths whichever checkout builds."""
    staged = build_dir / "src"
    staged.mkdir(exist_ok=True)
    for source in _CSRC.iterdir():
        if source.suffix in (".cpp", ".h") and not (staged / source.name).exists():
            shutil.copyfile(source, staged / f".{source.name}.tmp")
            os.replace(staged / f".{source.name}.tmp", staged / source.name)  # never a half-copied file
    return [str(staged / name) for name in _SOURCES]


@functools.cache
def load() -> ModuleType | None:
    """The compiled kernels, or None (logged once) if they cannot be built here."""
    from torch.utils.cpp_extension import _get_build_directory, load as build

    # torch runs the first `ninja` on PATH. Ours (installed beside this interpreter) goes first, so every
    # process uses one version: another version discards the build log and rebuilds everything (~1 min).
    path = os.environ.get("PATH", "")
    os.environ["PATH"] = str(Path(sys.executable).parent) + os.pathsep + path
    name = build_name()
    try:
        with _exclusive_build(name):
            build_dir = Path(_get_build_directory(name, verbose=False))
            if (build_dir / f"{name}.so").exists():
                logger.debug("loading the C++ CPU kernels from %s", build_dir)
            else:
                logger.info("compiling the C++ CPU kernels for this machine into %s (once; a few minutes)", build_dir)
            return build(name=name, sources=_staged_sources(build_dir), extra_cflags=_CFLAGS, verbose=False)
    except (RuntimeError, OSError, ImportError, subprocess.SubprocessError) as error:
        # no compiler, no ninja, a failed build or load: the torch-op path still works
        logger.warning("C++ CPU kernels unavailable, using torch ops (slower): %s", error)
        return None
    finally:
        os.environ["PATH"] = path


def _named(name: str, kernel, *args):
    """kernel(*args), named for torch.profiler when one is recording (benchmarks/step_breakdown.py sorts
    ops by name; a pybind call is otherwise invisible to it). Naming has a cost per call (docs/PERFORMANCE.md,
    "Decode step now, by batch"), so only then."""
    if torch.autograd.profiler._is_profiler_enabled:
        with torch.profiler.record_function(name):
            return kernel(*args)
    return kernel(*args)


def paged_attention(q: torch.Tensor, key: torch.Tensor, value: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, window: int | None = None,
                    key_scale: torch.Tensor | None = None, value_scale: torch.Tensor | None = None, *,
                    query_start_loc: torch.Tensor | None = None, soft_cap: float | None = None) -> torch.Tensor:
    """q [num_tokens, heads, head_dim]: each sequence's new tokens, in order (without query_start_loc, one
    token a sequence); key/value [kv_heads, num_blocks, block_size, head_dim]; block_tables [num_seqs, width]
    int64; seq_lens [num_seqs] int64 (this step's tokens included); query_start_loc [num_seqs + 1] int64,
    where each sequence's rows start (the total last) -> [num_tokens, heads, head_dim]. The query at position
    p attends to keys up to p. window: each query attends to its last `window` keys (itself included), None
    to all; soft_cap: scores become soft_cap * tanh(score / soft_cap). An int8 pool comes with key_scale /
    value_scale, [kv_heads, num_blocks, block_size] float16."""
    return _named("tinyserve::paged_attention", load().paged_attention, q.contiguous(), key, value, block_tables,
                  seq_lens, query_start_loc, scale, window, soft_cap, key_scale, value_scale)


def write_kv(key: torch.Tensor, value: torch.Tensor, key_pool: torch.Tensor, value_pool: torch.Tensor,
             slot_mapping: torch.Tensor, key_scale: torch.Tensor | None = None,
             value_scale: torch.Tensor | None = None) -> None:
    """key, value [tokens, kv_heads, head_dim] (rows may be strided) into their pools [kv_heads, num_blocks,
    block_size, head_dim] at slot_mapping [tokens] int64, in place: copied into a pool of their dtype, or
    rounded into an int8 pool with its float16 row scales [kv_heads, num_blocks, block_size]."""
    _named("tinyserve::write_kv", load().write_kv, key, value, key_pool, value_pool, slot_mapping, key_scale,
           value_scale)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return _named("tinyserve::rms_norm", load().rms_norm, x, weight, eps)


def add_rms_norm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """residual += x in place (rounded to the dtype), then rms_norm(residual)."""
    return _named("tinyserve::add_rms_norm", load().add_rms_norm, x, residual, weight, eps)


def rotary_(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> None:
    """q [tokens, heads, head_dim] and k [tokens, kv_heads, head_dim] (rows may be strided) rotated in place;
    cos/sin [tokens, 1, head_dim]."""
    _named("tinyserve::rotary", load().rotary_, q, k, cos, sin)


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """x [..., 2 * d] -> silu(x[..., :d]) * x[..., d:]"""
    return _named("tinyserve::silu_and_mul", load().silu_and_mul, x)


def int4_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                out_features: int) -> torch.Tensor:
    """x [tokens, in] bfloat16 times an int4 weight in layers/quant.py's layout -> [tokens, out]; minimums None:
    w = (code - 8) * scale (a GGUF Q4_0's)."""
    return _named("tinyserve::int4_matmul", load().int4_matmul, x, codes, scales, minimums, out_features)


def w4a16_rounds_to_bfloat16() -> bool:
    """Whether the W4A16 kernels of 4- to 6-bit codes (all but w8a16_matmul) round x to bfloat16 before their dot
    products: the fold of csrc/a16_fold.h, on CPUs with AVX512-BF16; elsewhere x stays as it is."""
    return load().w4a16_rounds_to_bfloat16()


def w4a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, minimums: torch.Tensor | None,
                 out_features: int) -> torch.Tensor:
    """int4_matmul with x unrounded: each weight widened to float32, float32 sums (csrc/quantized_matmul_a16.cpp);
    on AVX512-BF16 CPUs x rounded to bfloat16 and bfloat16 dot products (w4a16_rounds_to_bfloat16)."""
    return _named("tinyserve::w4a16_matmul", load().w4a16_matmul, x, codes, scales, minimums, out_features)


def w8a16_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """int8_matmul with x unrounded (csrc/quantized_matmul_a16.cpp)."""
    return _named("tinyserve::w8a16_matmul", load().w8a16_matmul, x, codes, scales, out_features)


def w4a16_superblock_matmul(x: torch.Tensor, codes: torch.Tensor, d: torch.Tensor, dmin: torch.Tensor,
                            sub_scales: torch.Tensor, sub_mins: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [tokens, in] float32 or bfloat16, unrounded, times a GGUF Q4_K weight in layers/quant.py's
    Int4SuperblockWeight layout -> [tokens, out] (csrc/quantized_matmul_a16.cpp)."""
    return _named("tinyserve::w4a16_superblock_matmul", load().w4a16_superblock_matmul, x, codes, d, dmin,
                  sub_scales, sub_mins, out_features)


def w5a16_matmul(x: torch.Tensor, codes: torch.Tensor, high_bits: torch.Tensor, scales: torch.Tensor,
                 minimums: torch.Tensor | None, out_features: int) -> torch.Tensor:
    """x [tokens, in] float32 or bfloat16, unrounded, times a GGUF Q5_0 / Q5_1 weight in layers/quant.py's
    Int5Weight layout -> [tokens, out] (csrc/quantized_matmul_a16.cpp); minimums None: w = (code - 16) * scale
    (Q5_0's)."""
    return _named("tinyserve::w5a16_matmul", load().w5a16_matmul, x, codes, high_bits, scales, minimums, out_features)


def w5a16_superblock_matmul(x: torch.Tensor, codes: torch.Tensor, high_bits: torch.Tensor, d: torch.Tensor,
                            dmin: torch.Tensor, sub_scales: torch.Tensor, sub_mins: torch.Tensor,
                            out_features: int) -> torch.Tensor:
    """x [tokens, in] float32 or bfloat16, unrounded, times a GGUF Q5_K weight in layers/quant.py's
    Int5SuperblockWeight layout -> [tokens, out] (csrc/quantized_matmul_a16.cpp)."""
    return _named("tinyserve::w5a16_superblock_matmul", load().w5a16_superblock_matmul, x, codes, high_bits, d, dmin,
                  sub_scales, sub_mins, out_features)


def w6a16_superblock_matmul(x: torch.Tensor, codes: torch.Tensor, high_bits: torch.Tensor, d: torch.Tensor,
                            sub_scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [tokens, in] float32 or bfloat16, unrounded, times a GGUF Q6_K weight in layers/quant.py's
    Int6SuperblockWeight layout -> [tokens, out] (csrc/quantized_matmul_a16.cpp)."""
    return _named("tinyserve::w6a16_superblock_matmul", load().w6a16_superblock_matmul, x, codes, high_bits, d,
                  sub_scales, out_features)


def int8_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [tokens, in] bfloat16 times an int8 weight in layers/quant.py's layout -> [tokens, out]."""
    return _named("tinyserve::int8_matmul", load().int8_matmul, x, codes, scales, out_features)


def int8_channel_matmul(x: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [tokens, in] bfloat16 times an int8 weight with one scale per row (layers/quant.py's
    Int8ChannelWeight), the inputs rounded to int8 per token -> [tokens, out]."""
    return _named("tinyserve::int8_channel_matmul", load().int8_channel_matmul, x, codes, scales, out_features)


def bf16_matmul(x: torch.Tensor, weight: torch.Tensor, out_features: int) -> torch.Tensor:
    """x [tokens, in] bfloat16 times a bfloat16 weight in layers/linear.py's interleaved layout -> [tokens, out]."""
    return _named("tinyserve::bf16_matmul", load().bf16_matmul, x, weight, out_features)


def f32_matmul(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """x [tokens, in] float32 times a plain [out, in] float32 weight -> [tokens, out]."""
    return _named("tinyserve::f32_matmul", load().f32_matmul, x, weight)


def q4_nibble_codes(blocks: torch.Tensor, with_minimums: bool) -> list[torch.Tensor]:
    """A GGUF Q4_0 (with_minimums False) or Q4_1 tensor's rows, uint8 [rows, 18 or 20 * blocks] contiguous ->
    [codes [rows, 16 * blocks] uint8 in the int4 kernels' nibble order, scales [rows, blocks] float16] and Q4_1's
    minimums: loader/gguf/blocks.py's nibble_codes in one pass."""
    return load().q4_nibble_codes(blocks, with_minimums)


def q45_k_codes(blocks: torch.Tensor, five_bits: bool) -> list[torch.Tensor]:
    """A GGUF Q4_K (five_bits False) or Q5_K tensor's rows, uint8 [rows, 144 or 176 * super-blocks] contiguous ->
    [codes, d, dmin, sub_scales, sub_mins] (and Q5_K's high_bits) as SuperblockCodes (Int5SuperblockCodes) hold
    them: loader/gguf/blocks.py's superblock_codes (int5_superblock_codes) in one pass."""
    return load().q45_k_codes(blocks, five_bits)


def q6_k_codes(blocks: torch.Tensor) -> list[torch.Tensor]:
    """A GGUF Q6_K tensor's rows, uint8 [rows, 210 * super-blocks] contiguous -> [codes, high_bits, d, sub_scales]
    as Int6SuperblockCodes holds them: loader/gguf/blocks.py's int6_superblock_codes in one pass."""
    return load().q6_k_codes(blocks)


def row_argmax(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] float32 or bfloat16, contiguous -> [rows] int64, torch.argmax(dim=-1)'s answer."""
    return _named("tinyserve::row_argmax", load().row_argmax, logits)


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor) -> None:
    """In place: -inf on logits[rows[i], t] wherever bit t of bitmask[i] is 0 (32 tokens per int32 word)."""
    _named("tinyserve::apply_token_bitmask", load().apply_token_bitmask, logits, bitmask, rows)


if __name__ == "__main__":  # `make setup`: build (or find) the kernels now rather than at the first start
    logging.basicConfig(level="INFO", format="%(message)s")
    sys.exit(0 if load() is not None else 1)

"""A kernel design measured before it is built (issue 47, the default's speed on AVX512-BF16 CPUs): one token
times a Q4_1 (Int4Weight) matrix by bfloat16 dot products of the file's codes, against the landed W4A16 kernel
(csrc/quantized_matmul_a16.cpp, float32 FMAs on each widened weight).

The design ("the fold"): each 4-bit code c goes into a bfloat16 pair as the exact 128 + c (bits 0x4300 | c), two
codes a 32-bit lane, with no conversion; `vdpbf16ps` multiplies them with the activations' bfloat16 pair
(broadcast) into float32 sums, 32 multiply-adds an instruction; each group of 32 inputs then adds
scale * sum + (minimum - 128 * scale) * sum(x) once. The activations are rounded to bfloat16 at the matmul
only (the README's question still answers Paris that way: docs/PERFORMANCE.md). The pairs are the kernels'
existing nibble order (byte k of a lane holds inputs 8c + k and 8c + 4 + k), so the activations are paired to
match once a token. Prints time, weights/s and the error against the float32 kernel (relative to its largest
output). Needs AVX512-BF16 (exits saying so elsewhere).

    .venv/bin/python benchmarks/bf16_fold_matvec.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

import torch
from torch.utils.cpp_extension import load_inline

from tinyserve.layers.kernels import cpu_kernels
from tinyserve.layers.quant import Int4Weight

SOURCE = r"""
#include <immintrin.h>
#include <omp.h>
// Prototype: one token x Int4Weight (Q4_1 layout of layers/quant.py) by bf16 dot products of the codes as 128 + c.
// xp: [K/2] uint32 bf16 pairs (x[8c+k], x[8c+4+k]); xsum: [groups] float sum of bf16(x) per group.
template <int R>
void run(const uint8_t* codes, const at::Half* scales, const at::Half* mins, const uint32_t* xp, const float* xsum,
         int64_t blocks, int64_t groups, float* out) {
  const __m512i m0f = _mm512_set1_epi32(0x0F), bias = _mm512_set1_epi32(0x43004300);
#pragma omp parallel for schedule(static)
  for (int64_t b0 = 0; b0 < blocks; b0 += R) {
    __m512 acc[R];
    for (int r = 0; r < R; ++r) acc[r] = _mm512_setzero_ps();
    for (int64_t g = 0; g < groups; ++g) {
      __m512 d[R];
      for (int r = 0; r < R; ++r) d[r] = _mm512_setzero_ps();
      for (int c = 0; c < 4; ++c) {
        __m512i w[R];
        for (int r = 0; r < R; ++r) w[r] = _mm512_loadu_si512(codes + ((b0 + r) * groups + g) * 256 + c * 64);
#pragma GCC unroll 4
        for (int k = 0; k < 4; ++k) {
          const __m512bh xv = (__m512bh)_mm512_set1_epi32((int)xp[g * 16 + c * 4 + k]);
          for (int r = 0; r < R; ++r) {
            const __m512i lo = _mm512_and_si512(_mm512_srli_epi32(w[r], 8 * k), m0f);
            const __m512i hi = _mm512_slli_epi32(_mm512_and_si512(_mm512_srli_epi32(w[r], 8 * k + 4), m0f), 16);
            const __m512i pair = _mm512_ternarylogic_epi32(lo, hi, bias, 0xFE);  // lo | hi | bias
            d[r] = _mm512_dpbf16_ps(d[r], (__m512bh)pair, xv);
          }
        }
      }
      for (int r = 0; r < R; ++r) {
        const __m512 s = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(scales + ((b0 + r) * groups + g) * 16)));
        const __m512 m = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i*)(mins + ((b0 + r) * groups + g) * 16)));
        const __m512 mp = _mm512_fnmadd_ps(_mm512_set1_ps(128.f), s, m);
        acc[r] = _mm512_fmadd_ps(s, d[r], acc[r]);
        acc[r] = _mm512_fmadd_ps(mp, _mm512_set1_ps(xsum[g]), acc[r]);
      }
    }
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(out + (b0 + r) * 16, acc[r]);
  }
}
torch::Tensor fold_matvec(torch::Tensor x, torch::Tensor codes, torch::Tensor scales, torch::Tensor mins, int64_t n) {
  const int64_t k = x.size(0), groups = k / 32, blocks = n / 16;
  auto xb = x.to(torch::kBFloat16).contiguous();
  const uint16_t* xh = (const uint16_t*)xb.data_ptr();
  std::vector<uint32_t> xp(k / 2);
  std::vector<float> xsum(groups);
  for (int64_t g = 0; g < groups; ++g) {
    float s = 0;
    for (int c = 0; c < 4; ++c)
      for (int kk = 0; kk < 4; ++kk) {
        const uint16_t a = xh[g * 32 + 8 * c + kk], b = xh[g * 32 + 8 * c + 4 + kk];
        xp[g * 16 + c * 4 + kk] = a | ((uint32_t)b << 16);
      }
    for (int i = 0; i < 32; ++i) { uint32_t bits = (uint32_t)xh[g * 32 + i] << 16; float f; memcpy(&f, &bits, 4); s += f; }
    xsum[g] = s;
  }
  auto out = torch::empty({n});
  run<4>(codes.data_ptr<uint8_t>(), scales.data_ptr<at::Half>(), mins.data_ptr<at::Half>(), xp.data(), xsum.data(),
         blocks, groups, out.data_ptr<float>());
  return out;
}
"""


def _median_s(fn, reps: int = 30) -> float:
    fn()
    times = []
    for _ in range(reps):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main() -> None:
    if "avx512_bf16" not in Path("/proc/cpuinfo").read_text():
        sys.exit("this CPU has no AVX512-BF16: the design needs vdpbf16ps")
    fold = load_inline("bf16_fold_matvec", cpp_sources=[SOURCE], functions=["fold_matvec"],
                       extra_cflags=["-O3", "-march=native", "-fopenmp"], extra_ldflags=["-fopenmp"])
    for n, k in [(8192, 2048), (2048, 8192), (2048, 2048)]:
        weight = Int4Weight.quantize(torch.randn(n, k) * 0.02)[0]
        x = torch.randn(1, k)
        landed = lambda: cpu_kernels.w4a16_matmul(x, weight.codes, weight.scales, weight.minimums, n)  # noqa: E731
        design = lambda: fold.fold_matvec(x[0], weight.codes, weight.scales, weight.minimums, n)  # noqa: E731
        error = (design() - landed()[0]).abs().max().item() / landed().abs().max().item()
        t_landed, t_design = _median_s(landed), _median_s(design)
        print(f"{n} x {k}: float32 FMAs {t_landed * 1e3:.3f} ms ({n * k / t_landed / 1e9:.0f} Gw/s), bfloat16 fold "
              f"{t_design * 1e3:.3f} ms ({n * k / t_design / 1e9:.0f} Gw/s), {t_design / t_landed:.2f}x the time; "
              f"error {error:.1e}")


if __name__ == "__main__":
    main()

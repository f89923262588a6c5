// bfloat16 matmul for steps of a few tokens (decode): out[t, n] = sum_k x[t, k] * w[n, k].
//
// Why our own: oneDNN's bf16 kernels read the weights well below memory speed when a step holds one
// token (they are built for large matrices; docs/PERFORMANCE.md, "Numbers behind the code's comments").
// Like our quantized kernels (quantized_matmul.cpp), this one interleaves 16 output rows, one per vector
// lane, so every 64-byte load is one AVX512-BF16 dot instruction per token: 16 rows x 2 inputs, summed in
// float32.
//
// Layout (tinyserve/layers/weight_format.py packs it): rows in blocks of 16 (the last padded with zero rows);
// per block, for each pair of inputs p, 64 bytes: row l's weights of inputs 2p and 2p + 1 at bytes 4l.

#include "row_blocks.h"

#include <immintrin.h>

namespace {

using tinyserve::kRows;
using tinyserve::to_float;

#if defined(__AVX512BF16__)

// One block of 16 rows for T tokens from t0; out[t * 16 + l]. With few tokens, each token keeps C
// accumulators over alternating input pairs, so that the dot instructions do not wait on each other.
template <int T, int C>
void block(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, int64_t t0, float* out) {
  __m512 acc[T][C];
  for (int t = 0; t < T; ++t)
    for (int c = 0; c < C; ++c) acc[t][c] = _mm512_setzero_ps();
  const int64_t pairs = k / 2;
  for (int64_t p = 0; p < pairs; p += C) {
    for (int c = 0; c < C; ++c) {
      const __m512bh rows = (__m512bh)_mm512_loadu_si512(w + (p + c) * 2 * kRows);
      for (int t = 0; t < T; ++t) {
        const int32_t two = *reinterpret_cast<const int32_t*>(x + (t0 + t) * k + 2 * (p + c));
        acc[t][c] = _mm512_dpbf16_ps(acc[t][c], rows, (__m512bh)_mm512_set1_epi32(two));
      }
    }
  }
  for (int t = 0; t < T; ++t) {
    for (int c = 1; c < C; ++c) acc[t][0] = _mm512_add_ps(acc[t][0], acc[t][c]);
    _mm512_storeu_ps(out + t * kRows, acc[t][0]);
  }
}

#else  // portable: the same sums one by one, for CPUs without AVX512-BF16

template <int T, int C>
void block(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, int64_t t0, float* out) {
  for (int t = 0; t < T; ++t)
    for (int l = 0; l < kRows; ++l) {
      float total = 0.f;
      for (int64_t i = 0; i < k; ++i) total += to_float(w[(i / 2) * 2 * kRows + 2 * l + i % 2]) * to_float(x[(t0 + t) * k + i]);
      out[t * kRows + l] = total;
    }
}

#endif

template <int T>
void pass(const c10::BFloat16* w, const c10::BFloat16* x, int64_t k, int64_t t0, float* out) {
  // k is a multiple of 16 (checked), so 8 pairs divide it
  constexpr int C = T == 1 ? 8 : T == 2 ? 4 : T <= 4 ? 2 : 1;
  block<T, C>(w, x, k, t0, out);
}

}  // namespace

torch::Tensor bf16_matmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t out_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "bf16_matmul: x must be [tokens, in] bfloat16");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kBFloat16 && weight.is_contiguous(),
              "bf16_matmul: weight 2-d bfloat16, contiguous");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "bf16_matmul: inputs must be on the CPU");
  // the row blocks are counted from out_features: it must be positive for them to cover the output
  TORCH_CHECK(out_features >= 1 && x.size(1) >= 16, "bf16_matmul: out_features must be >= 1 and in >= 16");
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features, blocks = (n + kRows - 1) / kRows;
  TORCH_CHECK(k % 16 == 0 && weight.size(0) == blocks && weight.size(1) == k * kRows, "bf16_matmul: shapes do not match");
  TORCH_CHECK(tokens >= 1, "bf16_matmul: no tokens");
  const auto xc = x.contiguous();
  auto out = torch::empty({tokens, n}, x.options());
  const auto* xp = xc.data_ptr<c10::BFloat16>();
  const auto* wp = weight.data_ptr<c10::BFloat16>();
  auto* op = out.data_ptr<c10::BFloat16>();
  tinyserve::for_row_blocks(n, tokens, op, [&](int64_t b, int64_t t0, auto tokens_in_pass, float* o) {
    pass<decltype(tokens_in_pass)::value>(wp + b * k * kRows, xp, k, t0, o);
  });
  return out;
}

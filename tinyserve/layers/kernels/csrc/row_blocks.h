// What our matmul kernels (bf16_matmul.cpp, quantized_matmul.cpp) share: the output rows in blocks of 16,
// one row per vector lane, split over the threads; per block the tokens 8 at a time (the accumulators of 8
// tokens fill the registers), so a block's weights stay in cache between passes; the float32 sums rounded
// into out [tokens, n] (bfloat16, or float32 as they are).
#pragma once

#include "float_types.h"

#include <algorithm>
#include <type_traits>
#include <vector>

namespace tinyserve {

constexpr int kRows = 16;
constexpr int kMaxTokens = 8;

// Rounds one block's float32 sums result[t * 16 + l] into out [tokens, n] (its rows b * 16 ..).
template <typename Out>
void store_block(int64_t n, int64_t tokens, int64_t b, const float* result, Out* out) {
  const int64_t rows = std::min<int64_t>(kRows, n - b * kRows);
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t l = 0; l < rows; ++l) out[t * n + b * kRows + l] = round_to<Out>(result[t * kRows + l]);
}

// pass(block, float* result) computes every token of one block into result[t * 16 + l].
template <typename Out, typename Pass>
void for_each_row_block(int64_t n, int64_t tokens, Out* out, Pass&& pass) {
  const int64_t blocks = (n + kRows - 1) / kRows;
#pragma omp parallel
  {
    std::vector<float> result(tokens * kRows);
#pragma omp for schedule(static)
    for (int64_t b = 0; b < blocks; ++b) {
      pass(b, result.data());
      store_block(n, tokens, b, result.data(), out);
    }
  }
}

// pass(block, t0, std::integral_constant<int, T>{}, float* out) computes tokens t0 .. t0 + T - 1 of one
// block into out[t * 16 + l]; T is a compile-time constant so that the kernel's accumulators are registers.
template <typename Out, typename Pass>
void for_row_blocks(int64_t n, int64_t tokens, Out* out, Pass&& pass) {
  for_each_row_block(n, tokens, out, [&](int64_t b, float* result) {
    for (int64_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
      float* o = result + t0 * kRows;
      switch (std::min<int64_t>(kMaxTokens, tokens - t0)) {
        case 1: pass(b, t0, std::integral_constant<int, 1>{}, o); break;
        case 2: pass(b, t0, std::integral_constant<int, 2>{}, o); break;
        case 3: pass(b, t0, std::integral_constant<int, 3>{}, o); break;
        case 4: pass(b, t0, std::integral_constant<int, 4>{}, o); break;
        case 5: pass(b, t0, std::integral_constant<int, 5>{}, o); break;
        case 6: pass(b, t0, std::integral_constant<int, 6>{}, o); break;
        case 7: pass(b, t0, std::integral_constant<int, 7>{}, o); break;
        default: pass(b, t0, std::integral_constant<int, 8>{}, o); break;
      }
    }
  });
}

}  // namespace tinyserve

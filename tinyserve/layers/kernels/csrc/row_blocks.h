// What our matmul kernels (bf16_matmul.cpp, quantized_matmul.cpp) share: the output rows in blocks of 16,
// one row per vector lane, split over the threads; per block the tokens 8 at a time (the accumulators of 8
// tokens fill the registers), so a block's weights stay in cache between passes; the float32 sums rounded
// into out [tokens, n] (bfloat16, or float32 as they are).
#pragma once

#include "float_types.h"

#include <immintrin.h>

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

#if defined(__AVX2__)
// Integer dots on AVX2, which has no byte dot into int32 (AVX512-VNNI's vpdpbusd); llama.cpp's recipe:
// _mm256_maddubs_epi16 multiplies unsigned by signed bytes and adds pairs into int16 (saturating), then
// _mm256_madd_epi16 with ones adds those pairs into int32. Int8 codes are stored plus 128, and
// (code + 128) * input pairs would saturate (255 * 127 * 2 > 32767), so the signed code s goes in as
// |s| (0..128, read unsigned) times the input with s's sign (inputs are -127..127, never -128, so the
// flip is safe): at most 128 * 127 * 2 = 32512, and the dot comes out signed (no 128 * sum to subtract).
struct SignedCodes {  // 32 int8 codes stored plus 128: 4 per int32 lane (one output row per lane)
  __m256i codes, magnitudes;
  explicit SignedCodes(const uint8_t* p)
      : codes(_mm256_xor_si256(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)), _mm256_set1_epi8(char(0x80)))),
        magnitudes(_mm256_abs_epi8(codes)) {}
  // acc + each lane's 4 codes times the same 4 inputs (one int32), exact
  __m256i dot(__m256i acc, int32_t four_inputs) const {
    const __m256i pairs = _mm256_maddubs_epi16(magnitudes, _mm256_sign_epi8(_mm256_set1_epi32(four_inputs), codes));
    return _mm256_add_epi32(acc, _mm256_madd_epi16(pairs, _mm256_set1_epi16(1)));
  }
};
#endif

}  // namespace tinyserve

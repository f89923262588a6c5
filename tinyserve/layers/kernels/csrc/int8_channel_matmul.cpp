// int8 x int8 matmul with one float scale per output row (W8A8 per channel), for prefill:
//   out[t, n] = w_scale[n] * sum_s x_scale[t, s] * sum_{k in span s} w_code[n, k] * x_code[t, k],
// the inputs rounded to int8 per span of 32 as in quantized_matmul.cpp (x_scale = max |x| of the span / 127).
//
// Why: the per-group kernels (quantized_matmul.cpp) scale every 32 inputs by the weight's scale and the
// input's (subtract, convert, multiply by two scales, add: about half as many instructions as the integer
// dots, on the same ports), so they prefill at bfloat16's rate. With one weight scale per row, that is a
// multiply per output at the end, and a span of 32 inputs costs 8 `vpdpbusd` (64 byte products each,
// exact int32 sums) and one convert-and-add: 1.6-2x bfloat16 (docs/PERFORMANCE.md, "Prefill at the
// integer rate"). Why spans and not one scale per token, which would leave no float work in the loop at all: the
// inputs' outliers then cost SmolLM2-135M 3% perplexity (same section).
//
// Layout (tinyserve/layers/quant.py, Int8ChannelWeight, packs it): the int8 per-group layout's codes with
// K rounded up to a multiple of 4 (zero weights pad it). Rows in blocks of 16 (the last padded with zero
// rows); per block, for every 4 inputs q, 64 bytes: bytes 4l + j hold row l's code of input 4q + j, plus
// 128 (the instruction multiplies unsigned by signed bytes). scales [blocks * 16] float32.
// Since the codes are stored plus 128, each span's dot is 128 * (the sum of the span's int8 inputs) too
// much; per token, those times the spans' scales are one float subtracted at the end.
//
// Tiling: a tile of R blocks (16R rows) by T tokens keeps R x T int32 accumulators (one span) and as many
// float32 ones in registers; each 64-byte load of weights serves T tokens and each broadcast of 4 inputs
// serves R blocks. Threads take row tiles; a tile's weights (16R x K bytes) stay in L2 while every token
// passes over them.

#include "row_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace {

using tinyserve::kRows;
using tinyserve::to_float;

constexpr int64_t kSpan = 32;  // inputs per activation scale

// IEEE division (see quantized_matmul.cpp): the test's formula divides exactly too.
__attribute__((optimize("no-fast-math"), noinline)) float exact_divide(float a, float b) { return a / b; }

// The inputs rounded per span: [tokens, K4] int8 (zeros past K), [tokens, spans] scales, and per token the
// float the +128 of the codes adds: 128 * sum_s scale[t, s] * (sum of span s's int8 inputs).
struct TokenCodes {
  int64_t k4, spans;
  std::vector<int8_t> values;
  std::vector<float> scales, offsets;

  TokenCodes(const c10::BFloat16* x, int64_t tokens, int64_t k)
      : k4((k + 3) / 4 * 4), spans((k + kSpan - 1) / kSpan), values(tokens * k4, 0), scales(tokens * spans),
        offsets(tokens) {
#pragma omp parallel for schedule(static) if (tokens * k >= 16384)
    for (int64_t t = 0; t < tokens; ++t) {
      float offset = 0.f;
      for (int64_t s = 0; s < spans; ++s) {
        const int64_t first = s * kSpan, count = std::min(kSpan, k - first);
        const int32_t code_sum = round_span(x + t * k + first, count, t * k4 + first, t * spans + s);
        offset += 128.f * scales[t * spans + s] * static_cast<float>(code_sum);
      }
      offsets[t] = offset;
    }
  }
  const int32_t* four(int64_t t) const { return reinterpret_cast<const int32_t*>(values.data() + t * k4); }

 private:
  // Rounds `count` (<= 64) inputs into values[at ..]; sets scales[ts]; returns the sum of the int8 values.
  int32_t round_span(const c10::BFloat16* in, int64_t count, int64_t at, int64_t ts) {
    int8_t* out = values.data() + at;
#if defined(__AVX512F__) && defined(__AVX512BW__)
    __m512 v[kSpan / 16];
    __m512 amax = _mm512_setzero_ps();
    for (int i = 0; i < kSpan / 16; ++i) {  // zeros past count
      const int64_t left = std::clamp<int64_t>(count - 16 * i, 0, 16);
      const __mmask16 mask = left == 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      const __m256i raw = _mm256_maskz_loadu_epi16(mask, in + 16 * i);
      v[i] = _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
      amax = _mm512_max_ps(amax, _mm512_abs_ps(v[i]));
    }
    const float top = _mm512_reduce_max_ps(amax);
    const float inverse = top > 0.f ? exact_divide(127.f, top) : 0.f;
    __m512i sum = _mm512_setzero_si512();
    for (int i = 0; i < kSpan / 16; ++i) {
      const int64_t left = std::clamp<int64_t>(count - 16 * i, 0, 16);
      const __mmask16 mask = left == 16 ? __mmask16(0xffff) : __mmask16((1u << left) - 1);
      // one rounding of x * inverse, to nearest even (the default mode), as nearbyint below
      const __m512i q = _mm512_cvtps_epi32(_mm512_mul_ps(v[i], _mm512_set1_ps(inverse)));
      _mm_mask_storeu_epi8(out + 16 * i, mask, _mm512_cvtepi32_epi8(q));
      sum = _mm512_add_epi32(sum, q);
    }
    const int32_t code_sum = _mm512_reduce_add_epi32(sum);
#else
    float top = 0.f;
    for (int64_t i = 0; i < count; ++i) top = std::max(top, std::fabs(to_float(in[i])));
    const float inverse = top > 0.f ? exact_divide(127.f, top) : 0.f;
    int32_t code_sum = 0;
    for (int64_t i = 0; i < count; ++i) {
      out[i] = static_cast<int8_t>(std::nearbyint(to_float(in[i]) * inverse));
      code_sum += out[i];
    }
#endif
    scales[ts] = exact_divide(top, 127.f);
    return code_sum;
  }
};

// value rounded to bfloat16 (nearest even), as c10::BFloat16 rounds
inline uint16_t to_bf16_bits(float value) {
  uint32_t bits;
  std::memcpy(&bits, &value, sizeof(bits));
  return static_cast<uint16_t>((bits + 0x7fff + ((bits >> 16) & 1)) >> 16);
}

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

// acc += unsigned bytes of a times signed bytes of b, 4 per lane. NOTE: inline assembly because GCC 12
// copies the accumulator of _mm512_dpbusd_epi32 into a scratch register and back, and with a tile's 24
// accumulators spills them to the stack: 203 against 401 GOP/s on one core (docs/PERFORMANCE.md).
inline __m512i dpbusd(__m512i acc, __m512i a, __m512i b) {
  asm("vpdpbusd %2, %1, %0" : "+v"(acc) : "v"(a), "v"(b));
  return acc;
}

// R blocks from block b0, T tokens from t0: the whole input dim, then out[t, 16 (b0 + r) + l] for the
// rows that exist (n of them in all).
template <int R, int T>
void tile(const uint8_t* codes, const float* row_scales, const TokenCodes& in, int64_t b0, int64_t t0, int64_t n,
          c10::BFloat16* out) {
  const int64_t quads = in.k4 / 4, block_bytes = in.k4 * kRows;
  const uint8_t* w = codes + b0 * block_bytes;
  const int32_t* x[T];
  const float* x_scales[T];
#pragma GCC unroll 8
  for (int t = 0; t < T; ++t) x[t] = in.four(t0 + t), x_scales[t] = in.scales.data() + (t0 + t) * in.spans;
  __m512 sums[R][T];
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) sums[r][t] = _mm512_setzero_ps();
  for (int64_t s = 0, q0 = 0; q0 < quads; ++s, q0 += kSpan / 4) {
    __m512i acc[R][T];
#pragma GCC unroll 4
    for (int r = 0; r < R; ++r)
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) acc[r][t] = _mm512_setzero_si512();
    const int64_t q1 = std::min(quads, q0 + kSpan / 4);
    for (int64_t q = q0; q < q1; ++q) {
      __m512i rows[R];
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) rows[r] = _mm512_loadu_si512(w + r * block_bytes + q * 64);
#pragma GCC unroll 8
      for (int t = 0; t < T; ++t) {
        const __m512i four = _mm512_set1_epi32(x[t][q]);  // each lane: its row's 4 codes times these 4 inputs
#pragma GCC unroll 4
        for (int r = 0; r < R; ++r) acc[r][t] = dpbusd(acc[r][t], rows[r], four);
      }
    }
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512 x_scale = _mm512_set1_ps(x_scales[t][s]);
#pragma GCC unroll 4
      for (int r = 0; r < R; ++r) sums[r][t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(acc[r][t]), x_scale, sums[r][t]);
    }
  }
#pragma GCC unroll 4
  for (int r = 0; r < R; ++r) {
    const int64_t row0 = (b0 + r) * kRows, count = std::min<int64_t>(kRows, n - row0);
    const __mmask16 mask = count >= 16 ? __mmask16(0xffff) : __mmask16((1u << count) - 1);
    const __m512 scale = _mm512_loadu_ps(row_scales + row0);
#pragma GCC unroll 8
    for (int t = 0; t < T; ++t) {
      const __m512 value = _mm512_mul_ps(_mm512_sub_ps(sums[r][t], _mm512_set1_ps(in.offsets[t0 + t])), scale);
      // round to nearest even on the bits, as to_bf16_bits
      const __m512i bits = _mm512_castps_si512(value);
      const __m512i odd = _mm512_and_si512(_mm512_srli_epi32(bits, 16), _mm512_set1_epi32(1));
      const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(bits, _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff))), 16);
      _mm256_mask_storeu_epi16(out + (t0 + t) * n + row0, mask, _mm512_cvtepi32_epi16(rounded));
    }
  }
}

#elif defined(__AVX2__)

// AVX2 without VNNI (llama.cpp's recipe there, see tinyserve::SignedCodes): each 64-byte piece as two
// 32-byte halves, rows 0-7 and 8-15, one int32 lane per row, a block's half at a time (16 registers). The
// dots come out signed, so the tokens' offsets (the +128 of the codes) are not subtracted.
template <int R, int T>
void tile(const uint8_t* codes, const float* row_scales, const TokenCodes& in, int64_t b0, int64_t t0, int64_t n,
          c10::BFloat16* out) {
  const int64_t quads = in.k4 / 4, block_bytes = in.k4 * kRows;
  for (int r = 0; r < R; ++r)
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7 of block b0 + r
      const uint8_t* w = codes + (b0 + r) * block_bytes + 32 * h;
      __m256 sums[T];
      for (int t = 0; t < T; ++t) sums[t] = _mm256_setzero_ps();
      for (int64_t s = 0, q0 = 0; q0 < quads; ++s, q0 += kSpan / 4) {
        __m256i acc[T];
        for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_si256();
        for (int64_t q = q0; q < std::min(quads, q0 + kSpan / 4); ++q) {
          const tinyserve::SignedCodes piece(w + q * 64);
          for (int t = 0; t < T; ++t) acc[t] = piece.dot(acc[t], in.four(t0 + t)[q]);
        }
        for (int t = 0; t < T; ++t)
          sums[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(acc[t]), _mm256_set1_ps(in.scales[(t0 + t) * in.spans + s]), sums[t]);
      }
      const int64_t row0 = (b0 + r) * kRows + 8 * h;
      const __m256 scale = _mm256_loadu_ps(row_scales + row0);
      for (int t = 0; t < T; ++t) {
        alignas(32) float values[8];
        _mm256_store_ps(values, _mm256_mul_ps(sums[t], scale));
        for (int64_t l = 0; l < std::min<int64_t>(8, n - row0); ++l) out[(t0 + t) * n + row0 + l].x = to_bf16_bits(values[l]);
      }
    }
}

#else  // portable: the same sums one by one, for CPUs without AVX2

template <int R, int T>
void tile(const uint8_t* codes, const float* row_scales, const TokenCodes& in, int64_t b0, int64_t t0, int64_t n,
          c10::BFloat16* out) {
  const int64_t block_bytes = in.k4 * kRows;
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < T; ++t)
      for (int l = 0; l < kRows && (b0 + r) * kRows + l < n; ++l) {
        const uint8_t* w = codes + (b0 + r) * block_bytes;
        const int8_t* xq = in.values.data() + (t0 + t) * in.k4;
        float sum = 0.f;
        for (int64_t s = 0; s < in.spans; ++s) {
          int32_t dot = 0;
          for (int64_t i = s * kSpan; i < std::min(in.k4, (s + 1) * kSpan); ++i)
            dot += w[(i / 4) * 64 + 4 * l + i % 4] * xq[i];
          sum += in.scales[(t0 + t) * in.spans + s] * static_cast<float>(dot);
        }
        const int64_t row = (b0 + r) * kRows + l;
        out[(t0 + t) * n + row].x = to_bf16_bits((sum - in.offsets[t0 + t]) * row_scales[row]);
      }
}

#endif

// tile<R, T> with R and T known at compile time (1 <= R <= kMaxBlocks, 1 <= T <= kMaxTokens)
constexpr int kMaxBlocks = 3, kMaxTokens = 4;

template <int R>
void tile_tokens(int tokens_in_tile, const uint8_t* codes, const float* scales, const TokenCodes& in, int64_t b0,
                 int64_t t0, int64_t n, c10::BFloat16* out) {
  switch (tokens_in_tile) {
    case 1: return tile<R, 1>(codes, scales, in, b0, t0, n, out);
    case 2: return tile<R, 2>(codes, scales, in, b0, t0, n, out);
    case 3: return tile<R, 3>(codes, scales, in, b0, t0, n, out);
    default: return tile<R, 4>(codes, scales, in, b0, t0, n, out);
  }
}

void run_tile(int blocks_in_tile, int tokens_in_tile, const uint8_t* codes, const float* scales, const TokenCodes& in,
              int64_t b0, int64_t t0, int64_t n, c10::BFloat16* out) {
  switch (blocks_in_tile) {
    case 1: return tile_tokens<1>(tokens_in_tile, codes, scales, in, b0, t0, n, out);
    case 2: return tile_tokens<2>(tokens_in_tile, codes, scales, in, b0, t0, n, out);
    default: return tile_tokens<3>(tokens_in_tile, codes, scales, in, b0, t0, n, out);
  }
}

}  // namespace

torch::Tensor int8_channel_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                  int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              "int8_channel_matmul: inputs must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kBFloat16, "int8_channel_matmul: x must be [tokens, in] bfloat16");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() && scales.dim() == 1 &&
                  scales.scalar_type() == at::kFloat && scales.is_contiguous(),
              "int8_channel_matmul: codes 2-d uint8, scales 1-d float32, contiguous");
  TORCH_CHECK(out_features >= 1 && x.size(1) >= 1, "int8_channel_matmul: out_features and in must be >= 1");
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features, blocks = (n + kRows - 1) / kRows;
  TORCH_CHECK(codes.size(0) == blocks && codes.size(1) == (k + 3) / 4 * 4 * kRows && scales.size(0) == blocks * kRows,
              "int8_channel_matmul: shapes do not match");
  TORCH_CHECK(tokens >= 1, "int8_channel_matmul: no tokens");
  const auto xc = x.contiguous();
  const TokenCodes in(xc.data_ptr<c10::BFloat16>(), tokens, k);
  auto out = torch::empty({tokens, n}, x.options());
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = scales.data_ptr<float>();
  auto* op = out.data_ptr<c10::BFloat16>();
  const int64_t row_tiles = (blocks + kMaxBlocks - 1) / kMaxBlocks;
#pragma omp parallel for schedule(static)
  for (int64_t rt = 0; rt < row_tiles; ++rt) {
    const int64_t b0 = rt * kMaxBlocks;
    const int blocks_in_tile = static_cast<int>(std::min<int64_t>(kMaxBlocks, blocks - b0));
    for (int64_t t0 = 0; t0 < tokens; t0 += kMaxTokens)
      run_tile(blocks_in_tile, static_cast<int>(std::min<int64_t>(kMaxTokens, tokens - t0)), cp, sp, in, b0, t0, n, op);
  }
  return out;
}

// Weight-only int4 and int8 matmuls for steps of a few tokens (decode): out[t, n] = sum_k x[t, k] w[n, k],
// with per group of 32 inputs w = code * scale + minimum (int4: GGUF's Q4_1) or w = code * scale (int8:
// GGUF's Q8_0), scale and minimum in float16 (those formats' own type, so such a file loses nothing).
//
// Why our own: at a few tokens per step a linear reads its weights once and does little else, so it runs
// as fast as the weights can be decoded and streamed; torch's int4 and int8 CPU kernels streamed them
// far slower (docs/PERFORMANCE.md, "Speed modes"). Two choices, both llama.cpp's on x86:
// - each group of 32 inputs is rounded to int8 with one float scale (per step, cheap: a few rows), so
//   that codes times inputs are integer dot instructions (AVX512-VNNI; on AVX2, maddubs and madd) with
//   exact int32 sums;
// - the weights are interleaved by 16 output rows, one row per vector lane: a lane sums its own row,
//   and no horizontal sum is left at the end of a row.
//
// Layout (tinyserve/layers/quant.py packs it). Rows are taken in blocks of 16 (the last padded with
// zero rows); K inputs make G = K / 32 groups. Per block, group by group:
//   codes   int4: 4 chunks of 64 bytes; in chunk c, bytes 4l .. 4l + 3 belong to the block's row l, and
//                 byte j holds the code (0..15) of input 8c + j in its low nibble, 8c + 4 + j in its high;
//           int8: 8 chunks of 64 bytes; in chunk c, bytes 4l + j hold row l's code of input 4c + j, plus
//                 128 (the instruction multiplies unsigned by signed bytes);
//   scales  [blocks, G * 16] float16, the 16 rows' scales of group g side by side; minimums (int4) alike, or
//           none (GGUF Q4_0's rule, w = (code - 8) * scale): then the minimum is -8 * scale, computed in
//           float32, exact, so the output is the same bits as with that minimum stored.
// With the inputs x[t, g] ~ x_scale[t, g] * xq[t, g] (int8):
//   out[t, n] = sum_g scale[n, g] * x_scale[t, g] * (codes[n, g] . xq[t, g]) (+ minimum[n, g] * sum(x[t, g])),
// where the sums of x are exact (float32), so a group's minimum adds no rounding of its own.

#include "row_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <optional>
#include <vector>

namespace {

using tinyserve::to_float;

using tinyserve::kRows;

constexpr int kGroup = 32;

// IEEE division, as torch divides: -ffast-math would multiply by an approximate reciprocal, and an input
// on a rounding boundary would then round the other way than the formula in tests/test_quant.py.
__attribute__((optimize("no-fast-math"), noinline)) float exact_divide(float a, float b) { return a / b; }

// The inputs rounded for the integer dot: per token and group, 32 int8 values, their float scale, their
// integer sum and the exact sum of the inputs. A prefill step rounds thousands of inputs per token and
// layer; one by one on one thread, that was a measurable share of the int linears' time at 64-512 tokens
// (docs/PERFORMANCE.md, "Numbers behind the code's comments"), so groups are rounded a vector at a time,
// on all threads when there are many.
#if defined(__AVX512F__) && defined(__AVX512BW__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) {  // 16 bfloat16: a float's upper half each
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))), 16));
}
#elif defined(__AVX2__)
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {  // 8 bfloat16: a float's upper half each
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))), 16));
}
#endif

struct QuantizedInputs {
  int64_t groups;
  std::vector<int8_t> values;       // [tokens, K]
  std::vector<float> scales, sums;  // [tokens, G]
  std::vector<int32_t> value_sums;  // [tokens, G]

  template <typename T>  // bfloat16 or float32 inputs; bfloat16 widens to float32 exactly, so both round alike
  QuantizedInputs(const T* x, int64_t tokens, int64_t k)
      : groups(k / kGroup), values(tokens * k), scales(tokens * groups), sums(tokens * groups),
        value_sums(tokens * groups) {
    const int64_t count = tokens * groups;
#pragma omp parallel for schedule(static) if (count >= 512)
    for (int64_t tg = 0; tg < count; ++tg) round_group(x + tg * kGroup, tg);
  }
  const int32_t* four(int64_t t, int64_t g, int i) const {  // inputs i .. i + 3 of a group, as one int32
    return reinterpret_cast<const int32_t*>(values.data() + (t * groups + g) * kGroup + i);
  }

 private:
  template <typename T>
  void round_group(const T* in, int64_t tg) {
#if defined(__AVX512F__) && defined(__AVX512BW__)
    const __m512 a = load16(in), b = load16(in + 16);
    const float amax = _mm512_reduce_max_ps(_mm512_max_ps(_mm512_abs_ps(a), _mm512_abs_ps(b)));
    const float inverse = amax > 0.f ? exact_divide(127.f, amax) : 0.f;
    // one rounding of x * inverse, to nearest even (the default mode), as nearbyint below
    const __m512i qa = _mm512_cvtps_epi32(_mm512_mul_ps(a, _mm512_set1_ps(inverse)));
    const __m512i qb = _mm512_cvtps_epi32(_mm512_mul_ps(b, _mm512_set1_ps(inverse)));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values.data() + tg * kGroup), _mm512_cvtepi32_epi8(qa));
    _mm_storeu_si128(reinterpret_cast<__m128i*>(values.data() + tg * kGroup + 16), _mm512_cvtepi32_epi8(qb));
    sums[tg] = _mm512_reduce_add_ps(_mm512_add_ps(a, b));
    value_sums[tg] = _mm512_reduce_add_epi32(_mm512_add_epi32(qa, qb));
#elif defined(__AVX2__)
    __m256 v[4], top = _mm256_setzero_ps(), total = _mm256_setzero_ps();
    for (int i = 0; i < 4; ++i) {
      v[i] = load8(in + 8 * i);
      top = _mm256_max_ps(top, _mm256_andnot_ps(_mm256_set1_ps(-0.f), v[i]));
      total = _mm256_add_ps(total, v[i]);
    }
    alignas(32) float lanes[8];
    _mm256_store_ps(lanes, top);
    const float amax = *std::max_element(lanes, lanes + 8);
    const float inverse = amax > 0.f ? exact_divide(127.f, amax) : 0.f;
    __m256i q[4];  // one rounding of x * inverse, to nearest even (the default mode), as nearbyint below
    for (int i = 0; i < 4; ++i) q[i] = _mm256_cvtps_epi32(_mm256_mul_ps(v[i], _mm256_set1_ps(inverse)));
    // the packs work per 128-bit lane: the permute puts the 4-byte pieces back in input order
    const __m256i bytes = _mm256_packs_epi16(_mm256_packs_epi32(q[0], q[1]), _mm256_packs_epi32(q[2], q[3]));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(values.data() + tg * kGroup),
                        _mm256_permutevar8x32_epi32(bytes, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7)));
    _mm256_store_ps(lanes, total);
    sums[tg] = std::accumulate(lanes, lanes + 8, 0.f);
    alignas(32) int32_t ints[8];
    _mm256_store_si256(reinterpret_cast<__m256i*>(ints), _mm256_add_epi32(_mm256_add_epi32(q[0], q[1]), _mm256_add_epi32(q[2], q[3])));
    value_sums[tg] = std::accumulate(ints, ints + 8, 0);
#else
    float amax = 0.f, sum = 0.f;
    for (int i = 0; i < kGroup; ++i) {
      amax = std::max(amax, std::fabs(to_float(in[i])));
      sum += to_float(in[i]);
    }
    const float inverse = amax > 0.f ? exact_divide(127.f, amax) : 0.f;
    int32_t value_sum = 0;
    for (int i = 0; i < kGroup; ++i) {
      const auto value = static_cast<int8_t>(std::nearbyint(to_float(in[i]) * inverse));
      values[tg * kGroup + i] = value;
      value_sum += value;
    }
    sums[tg] = sum;
    value_sums[tg] = value_sum;
#endif
    scales[tg] = exact_divide(amax, 127.f);
  }
};

template <int Bits>
constexpr int64_t group_bytes() { return kGroup * kRows * Bits / 8; }

constexpr float kInt4ZeroCode = 8.f;  // int4 without minimums: w = (code - 8) * scale

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)

inline __m512 load_halves(const at::Half* p) {
  return _mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p)));
}

// One block of 16 rows for T tokens (the first token is t0): out[t * 16 + l] for row l.
template <int Bits, int T>
void block(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, const QuantizedInputs& in,
           int64_t t0, float* out) {
  const __m512i low_nibbles = _mm512_set1_epi8(0x0f);
  __m512 acc[T];
  for (int t = 0; t < T; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t g = 0; g < in.groups; ++g) {
    const uint8_t* group = codes + g * group_bytes<Bits>();
    __m512i dot[T];
    for (int t = 0; t < T; ++t) dot[t] = _mm512_setzero_si512();
    if constexpr (Bits == 4) {
      for (int c = 0; c < 4; ++c) {
        const __m512i bytes = _mm512_loadu_si512(group + c * 64);
        const __m512i low = _mm512_and_si512(bytes, low_nibbles);
        const __m512i high = _mm512_and_si512(_mm512_srli_epi16(bytes, 4), low_nibbles);
        for (int t = 0; t < T; ++t) {  // each lane: its row's 4 codes times the same 4 inputs
          dot[t] = _mm512_dpbusd_epi32(dot[t], low, _mm512_set1_epi32(*in.four(t0 + t, g, 8 * c)));
          dot[t] = _mm512_dpbusd_epi32(dot[t], high, _mm512_set1_epi32(*in.four(t0 + t, g, 8 * c + 4)));
        }
      }
    } else {
      for (int c = 0; c < 8; ++c) {
        const __m512i bytes = _mm512_loadu_si512(group + c * 64);
        for (int t = 0; t < T; ++t)
          dot[t] = _mm512_dpbusd_epi32(dot[t], bytes, _mm512_set1_epi32(*in.four(t0 + t, g, 4 * c)));
      }
      for (int t = 0; t < T; ++t)  // the codes were stored plus 128
        dot[t] = _mm512_sub_epi32(dot[t], _mm512_set1_epi32(128 * in.value_sums[(t0 + t) * in.groups + g]));
    }
    const __m512 scale = load_halves(scales + g * kRows);
    const __m512 minimum = minimums == nullptr ? _mm512_mul_ps(scale, _mm512_set1_ps(-kInt4ZeroCode))
                                               : load_halves(minimums + g * kRows);  // int4's alone
    for (int t = 0; t < T; ++t) {
      const int64_t tg = (t0 + t) * in.groups + g;
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot[t]), _mm512_mul_ps(scale, _mm512_set1_ps(in.scales[tg])), acc[t]);
      if constexpr (Bits == 4) acc[t] = _mm512_fmadd_ps(minimum, _mm512_set1_ps(in.sums[tg]), acc[t]);
    }
  }
  for (int t = 0; t < T; ++t) _mm512_storeu_ps(out + t * kRows, acc[t]);
}

#elif defined(__AVX2__)

// AVX2 without VNNI (llama.cpp's recipe there, see tinyserve::SignedCodes): each 64-byte chunk as two
// 32-byte halves, rows 0-7 and 8-15, one int32 lane per row. int4: codes 0..15 times inputs -127..127 make
// at most 2 * 15 * 127 = 3810 per maddubs pair, so a group's 8 maddubs (16 products per int16) sum to at
// most 30480 < 32767: added in int16, one madd per group.
template <int Bits, int T>
void block(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, const QuantizedInputs& in,
           int64_t t0, float* out) {
  if constexpr (T > 4) {  // 16 registers hold 4 tokens' accumulators; a token's sums do not depend on the others
    block<Bits, 4>(codes, scales, minimums, in, t0, out);
    block<Bits, T - 4>(codes, scales, minimums, in, t0 + 4, out + 4 * kRows);
  } else {
    const __m256i low_nibbles = _mm256_set1_epi8(0x0f), ones = _mm256_set1_epi16(1);
    for (int h = 0; h < 2; ++h) {  // rows 8h .. 8h + 7
      __m256 acc[T];
      for (int t = 0; t < T; ++t) acc[t] = _mm256_setzero_ps();
      for (int64_t g = 0; g < in.groups; ++g) {
        const uint8_t* group = codes + g * group_bytes<Bits>() + 32 * h;
        __m256i dot[T];
        for (int t = 0; t < T; ++t) dot[t] = _mm256_setzero_si256();
        if constexpr (Bits == 4) {
          for (int c = 0; c < 4; ++c) {
            const __m256i bytes = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(group + c * 64));
            const __m256i low = _mm256_and_si256(bytes, low_nibbles);
            const __m256i high = _mm256_and_si256(_mm256_srli_epi16(bytes, 4), low_nibbles);
            for (int t = 0; t < T; ++t) {  // int16 pair sums of each row's codes times the same inputs
              const __m256i lows = _mm256_maddubs_epi16(low, _mm256_set1_epi32(*in.four(t0 + t, g, 8 * c)));
              const __m256i highs = _mm256_maddubs_epi16(high, _mm256_set1_epi32(*in.four(t0 + t, g, 8 * c + 4)));
              dot[t] = _mm256_add_epi16(dot[t], _mm256_add_epi16(lows, highs));
            }
          }
          for (int t = 0; t < T; ++t) dot[t] = _mm256_madd_epi16(dot[t], ones);
        } else {
          for (int c = 0; c < 8; ++c) {
            const tinyserve::SignedCodes chunk(group + c * 64);
            for (int t = 0; t < T; ++t) dot[t] = chunk.dot(dot[t], *in.four(t0 + t, g, 4 * c));
          }
        }
        const __m256 scale = _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(scales + g * kRows + 8 * h)));
        const __m256 minimum =  // int4's alone
            minimums == nullptr
                ? _mm256_mul_ps(scale, _mm256_set1_ps(-kInt4ZeroCode))
                : _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(minimums + g * kRows + 8 * h)));
        for (int t = 0; t < T; ++t) {  // the same float steps as the AVX512 path
          const int64_t tg = (t0 + t) * in.groups + g;
          acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot[t]), _mm256_mul_ps(scale, _mm256_set1_ps(in.scales[tg])), acc[t]);
          if constexpr (Bits == 4) acc[t] = _mm256_fmadd_ps(minimum, _mm256_set1_ps(in.sums[tg]), acc[t]);
        }
      }
      for (int t = 0; t < T; ++t) _mm256_storeu_ps(out + t * kRows + 8 * h, acc[t]);
    }
  }
}

#else  // portable: the same sums one by one, for CPUs without AVX2

template <int Bits, int T>
void block(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, const QuantizedInputs& in,
           int64_t t0, float* out) {
  for (int t = 0; t < T; ++t)
    for (int l = 0; l < kRows; ++l) {
      float total = 0.f;
      for (int64_t g = 0; g < in.groups; ++g) {
        const uint8_t* group = codes + g * group_bytes<Bits>();
        const int8_t* xq = in.values.data() + ((t0 + t) * in.groups + g) * kGroup;
        int32_t dot = 0;
        for (int i = 0; i < kGroup; ++i) {
          if constexpr (Bits == 4) {
            const uint8_t byte = group[(i / 8) * 64 + 4 * l + i % 4];
            dot += ((i % 8 < 4) ? byte & 0xf : byte >> 4) * xq[i];
          } else {
            dot += (group[(i / 4) * 64 + 4 * l + i % 4] - 128) * xq[i];
          }
        }
        const int64_t tg = (t0 + t) * in.groups + g;
        const float scale = static_cast<float>(scales[g * kRows + l]);
        total += scale * in.scales[tg] * dot;
        if constexpr (Bits == 4) {
          const float minimum =
              minimums == nullptr ? scale * -kInt4ZeroCode : static_cast<float>(minimums[g * kRows + l]);
          total += minimum * in.sums[tg];
        }
      }
      out[t * kRows + l] = total;
    }
}

#endif

template <int Bits>
torch::Tensor matmul(const char* name, const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     const at::Half* minimums, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(),
              name, ": inputs must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), name,
              ": x must be [tokens, in] bfloat16 or float32");
  TORCH_CHECK(codes.dim() == 2 && scales.dim() == 2 && codes.scalar_type() == at::kByte &&
                  scales.scalar_type() == at::kHalf && codes.is_contiguous() && scales.is_contiguous(),
              name, ": codes uint8, scales float16, contiguous, 2-d");
  // the row blocks are counted from out_features: it must be positive for them to cover the output
  TORCH_CHECK(out_features >= 1 && x.size(1) >= kGroup, name, ": out_features must be >= 1 and in >= ", kGroup);
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features, blocks = (n + kRows - 1) / kRows;
  TORCH_CHECK(k % kGroup == 0 && codes.size(0) == blocks && codes.size(1) == k / kGroup * group_bytes<Bits>() &&
                  scales.size(0) == blocks && scales.size(1) == k / kGroup * kRows,
              name, ": shapes do not match");
  TORCH_CHECK(tokens >= 1, name, ": no tokens");
  const auto xc = x.contiguous();
  auto out = torch::empty({tokens, n}, x.options());
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = scales.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  tinyserve::dispatch_float_types(x, name, [&](auto element) {
    using T = decltype(element);
    const QuantizedInputs in(xc.data_ptr<T>(), tokens, k);
    tinyserve::for_row_blocks(n, tokens, out.data_ptr<T>(), [&](int64_t b, int64_t t0, auto tokens_in_pass, float* o) {
      block<Bits, decltype(tokens_in_pass)::value>(cp + b * groups * group_bytes<Bits>(), sp + b * groups * kRows,
                                                   minimums == nullptr ? nullptr : minimums + b * groups * kRows, in, t0, o);
    });
  });
  return out;
}

}  // namespace

// minimums: none for GGUF Q4_0's rule, w = (code - 8) * scale.
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& minimums, int64_t out_features) {
  if (!minimums.has_value()) return matmul<4>("int4_matmul", x, codes, scales, nullptr, out_features);
  TORCH_CHECK(minimums->device().is_cpu() && minimums->scalar_type() == at::kHalf && minimums->is_contiguous() &&
                  minimums->sizes() == scales.sizes(),
              "int4_matmul: minimums float16, contiguous, shaped as the scales");
  return matmul<4>("int4_matmul", x, codes, scales, minimums->data_ptr<at::Half>(), out_features);
}

torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                          int64_t out_features) {
  return matmul<8>("int8_matmul", x, codes, scales, nullptr, out_features);
}

// The int4 (GGUF Q4_1) and int8 (Q8_0) weights times unrounded activations (W4A16, W8A16), bfloat16 or
// float32, the output in the activations' dtype:
// out[t, n] = sum_k x[t, k] w[n, k], with per group of 32 inputs w = code * scale + minimum (int4) or
// w = code * scale (int8), in Int4Weight's and Int8Weight's layouts (quantized_matmul.cpp describes them).
//
// Why: quantized_matmul.cpp rounds each group of 32 activations to int8 before its integer dot, as
// llama.cpp does; that rounding moves a small model's logits enough to change its greedy answers
// (docs/PERFORMANCE.md, "W4A16"). Here the activations stay as they are: each weight is widened in
// registers to float32 (code * scale + minimum: one rounding; code * scale: exact) and multiplied into a
// float32 sum per row and token.
//
// The numerics do not depend on the step's shape: each (token, row) sum runs over the inputs in the same
// order whatever the number of tokens in the step or their tiling (the tokens of a pass share the widened
// weights, not their sums), so a token's output is the same bits in a decode step of one, a batch of 64 or
// a prefill chunk of 512 (tests/test_quant.py checks it).

#include "row_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>

// Not -ffast-math here: it lets the compiler regroup a lane's chain of sums (for more instructions in
// flight), and it regrouped them differently for one token than for eight, which made a token's output
// depend on the step it was in. Products still fuse into FMAs (-ffp-contract=fast, GCC's default).
#pragma GCC optimize("no-fast-math", "fp-contract=fast")

namespace {

using tinyserve::kRows;

constexpr int kGroup = 32;

template <int Bits>
constexpr int64_t group_bytes() { return kGroup * kRows * Bits / 8; }  // int4: 4 chunks of 64 bytes; int8: 8

// A block's 16 rows, one per vector lane, in GCC's vector extensions rather than one instruction set's
// intrinsics: one AVX-512 register of 16 floats, or (kParts = 2) two AVX2 registers of 8. The two halves are
// written out as such: GCC lowers a 64-byte vector on AVX2 through memory (the accumulators lived on the stack
// and prefill ran at 14 GFLOP/s). Every lane does the same operations in the same order on each machine (a
// lane's sum never mixes with another's), so the kernel's numerics are the same on every x86 CPU with FMA,
// and this file's tests exercise the path a machine runs.
#ifdef __AVX512F__
constexpr int kParts = 1;
constexpr int kTile = 8;  // tokens per pass: 8 accumulators of 32 registers
#else
constexpr int kParts = 2;
constexpr int kTile = 4;  // 8 accumulators of AVX2's 16 registers
#endif
constexpr int kWidth = kRows / kParts;
typedef float lanes __attribute__((vector_size(kWidth * 4)));
typedef uint32_t ulanes __attribute__((vector_size(kWidth * 4)));

// The widened weights of up to kChunkGroups groups of one block (16 KiB: they stay in L1) are computed once
// and then multiplied with every token of the step, kTile tokens at a time: the widening is paid once per
// step, not once per pass.
constexpr int kChunkGroups = 8;

// float16 scales and minimums to float32 (exact either way): one vcvtph2ps where the CPU has it (c10::Half's
// conversion is a dozen scalar instructions a value, which made a one-token step a third slower).
inline lanes load_halves(const at::Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<lanes>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  lanes v;
  for (int l = 0; l < kWidth; ++l) v[l] = static_cast<float>(p[l]);
  return v;
#endif
}

// Groups g0 .. g0 + count - 1 of a block, widened: w[j * kParts + p] = part p of the rows' weights of input
// g0 * 32 + j.
template <int Bits>
void widen(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, int64_t g0, int64_t count,
           lanes* w) {
  constexpr uint32_t kMask = Bits == 4 ? 0x0f : 0xff;
  constexpr int kChunks = Bits == 4 ? 4 : 8, kPerChunk = Bits == 4 ? 8 : 4;
  for (int64_t g = g0; g < g0 + count; ++g) {
    const uint8_t* group = codes + g * group_bytes<Bits>();
    for (int p = 0; p < kParts; ++p) {
      const lanes scale = load_halves(scales + g * kRows + p * kWidth);
      // int4: w = code * scale + minimum; int8: the codes are stored plus 128, so w = code * scale - 128 * scale
      const lanes offset = Bits == 4 ? load_halves(minimums + g * kRows + p * kWidth) : scale * -128.f;
      for (int c = 0; c < kChunks; ++c) {
        ulanes bytes;  // lane l: row (p * kWidth + l)'s 4 bytes of chunk c
        __builtin_memcpy(&bytes, group + c * 64 + p * kWidth * 4, sizeof(bytes));
        for (int i = 0; i < kPerChunk; ++i) {  // int4: input 8c + i, byte i % 4's low nibble for i < 4; int8: 4c + i
          const int shift = Bits == 4 ? 8 * (i % 4) + 4 * (i / 4) : 8 * i;
          w[((g - g0) * kGroup + kPerChunk * c + i) * kParts + p] =
              __builtin_convertvector((bytes >> shift) & kMask, lanes) * scale + offset;
        }
      }
    }
  }
}

// T tokens (the first t0) times `inputs` widened weights from input i0: sum[t * 16 + l] += x . w, in input order.
template <int T>
void multiply(const lanes* w, int64_t inputs, const float* x, int64_t k, int64_t i0, int64_t t0, float* sum) {
  lanes acc[T][kParts];
  for (int t = 0; t < T; ++t) __builtin_memcpy(&acc[t], sum + (t0 + t) * kRows, sizeof(acc[t]));
  for (int64_t j = 0; j < inputs; ++j)
    for (int t = 0; t < T; ++t) {
      const float xv = x[(t0 + t) * k + i0 + j];
      for (int p = 0; p < kParts; ++p) acc[t][p] += xv * w[j * kParts + p];
    }
  for (int t = 0; t < T; ++t) __builtin_memcpy(sum + (t0 + t) * kRows, &acc[t], sizeof(acc[t]));
}

// One block of 16 rows for every token: sum[t * 16 + l] for row l. x is float32 [tokens, K].
template <int Bits>
void block(const uint8_t* codes, const at::Half* scales, const at::Half* minimums, const float* x, int64_t k,
           int64_t tokens, float* sum) {
  lanes w[kChunkGroups * kGroup * kParts];
  std::fill(sum, sum + tokens * kRows, 0.f);
  const int64_t groups = k / kGroup;
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t count = std::min<int64_t>(kChunkGroups, groups - g0), inputs = count * kGroup;
    widen<Bits>(codes, scales, minimums, g0, count, w);
    int64_t t0 = 0;
    for (; t0 + kTile <= tokens; t0 += kTile) multiply<kTile>(w, inputs, x, k, g0 * kGroup, t0, sum);
    switch (tokens - t0) {  // the last tokens, fewer than a pass
      case 1: multiply<1>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
      case 2: multiply<2>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
      case 3: multiply<3>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
#ifdef __AVX512F__
      case 4: multiply<4>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
      case 5: multiply<5>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
      case 6: multiply<6>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
      case 7: multiply<7>(w, inputs, x, k, g0 * kGroup, t0, sum); break;
#endif
      default: break;
    }
  }
}

template <int Bits>
torch::Tensor matmul(const char* name, const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                     const at::Half* minimums, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu() && codes.device().is_cpu() && scales.device().is_cpu(), name,
              ": inputs must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), name,
              ": x must be [tokens, in] bfloat16 or float32");
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == at::kByte && codes.is_contiguous() &&
                  scales.dim() == 2 && scales.scalar_type() == at::kHalf && scales.is_contiguous(),
              name, ": codes uint8, scales float16, contiguous, 2-d");
  TORCH_CHECK(out_features >= 1 && x.size(1) >= kGroup, name, ": out_features must be >= 1 and in >= ", kGroup);
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features, blocks = (n + kRows - 1) / kRows;
  TORCH_CHECK(k % kGroup == 0 && codes.size(0) == blocks && codes.size(1) == k / kGroup * group_bytes<Bits>() &&
                  scales.size(0) == blocks && scales.size(1) == k / kGroup * kRows,
              name, ": shapes do not match");
  TORCH_CHECK(tokens >= 1, name, ": no tokens");
  const auto xf = x.to(at::kFloat).contiguous();  // exact: bfloat16 is float32's top half
  auto out = torch::empty({tokens, n}, x.options());
  const float* xp = xf.data_ptr<float>();
  const auto* cp = codes.data_ptr<uint8_t>();
  const auto* sp = scales.data_ptr<at::Half>();
  const int64_t groups = k / kGroup;
  auto pass = [&](int64_t b, float* sum) {
    block<Bits>(cp + b * groups * group_bytes<Bits>(), sp + b * groups * kRows,
                minimums == nullptr ? nullptr : minimums + b * groups * kRows, xp, k, tokens, sum);
  };
  if (x.scalar_type() == at::kFloat)
    tinyserve::for_each_row_block(n, tokens, out.data_ptr<float>(), pass);
  else
    tinyserve::for_each_row_block(n, tokens, out.data_ptr<c10::BFloat16>(), pass);
  return out;
}

}  // namespace

torch::Tensor w4a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const torch::Tensor& minimums, int64_t out_features) {
  TORCH_CHECK(minimums.device().is_cpu() && minimums.scalar_type() == at::kHalf && minimums.is_contiguous() &&
                  minimums.sizes() == scales.sizes(),
              "w4a16_matmul: minimums float16, contiguous, shaped as the scales");
  return matmul<4>("w4a16_matmul", x, codes, scales, minimums.data_ptr<at::Half>(), out_features);
}

torch::Tensor w8a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           int64_t out_features) {
  return matmul<8>("w8a16_matmul", x, codes, scales, nullptr, out_features);
}

// W4A16 by bfloat16 dot products on AVX512-BF16 CPUs ("the fold"; docs/PERFORMANCE.md "The fold"): the
// formats of a16_formats.h whose codes have 4 to 6 bits (Q4_0, Q4_1, Q4_K, Q5_0, Q5_1, Q5_K, Q6_K; Q8_0's bytes
// stay on float32 FMAs). Included by quantized_matmul_a16.cpp alone, inside its anonymous namespace and under
// its float pragmas.
//
// A code c (4 to 6 bits) goes into a bfloat16 as the exact value 128 + c (bits 0x4300 | c: 128's exponent, c
// in the low mantissa bits), two codes a 32-bit lane: inputs 8c + i and 8c + i + 2 of a chunk, i = 0, 4, 1, 5,
// which in Int4Weight's nibble order sit at bits 4q and 16 + 4q of a lane (pair q), and in the wide codes'
// bytes at bytes 0 and 2 of `low` or `high`, shifted by 8 for the second two: a pair is a shift and one
// and-or. vdpbf16ps multiplies each lane's pair by the activations' bfloat16 pair and adds both products into a
// float32 sum D of the scale's inputs, 32 multiply-adds an instruction (the products are exact: 8 significant
// bits times 8). With w = c * scale + offset,
//     sum_i x_i w_i = scale * D + (offset - 128 * scale) * X,   X = sum_i x_i,
// two FMAs a scale (a group of 32 inputs; Q6_K's 16). The 128s cancel in float32 (D carries 128 X: ~17 of its
// 24 bits are left for the codes' part, far below the rounding of x). The activations are rounded to bfloat16
// once, here (x itself where it is bfloat16), and paired as the codes are (FoldedX). A (token, row) sum is the
// same instructions in the same order in every step shape: fused for a few tokens, staged in L1 for more, so a
// token's output has the same bits in any step (tests/test_quant.py).
#pragma once

#if defined(__AVX512BF16__)

template <class Groups>
constexpr bool kFolds = Groups::kBits == 4;  // nibbles, with or without a high plane

// The activations of a step, rounded to bfloat16 and paired as the codes are: per token, group g and chunk c
// of 8 inputs, pair q (0..3) = inputs 8c + i (low half) and 8c + i + 2 (high half), i = 0, 4, 1, 5, at
// g * 16 + 4c + q; and per token, group and scale, X, the sum of the scale's rounded inputs.
struct FoldedX {
  int64_t pairs_per_token, sums_per_token;
  std::vector<uint32_t> pairs;
  std::vector<float> sums;
  const uint32_t* pair(int64_t t, int64_t i) const { return pairs.data() + t * pairs_per_token + i; }
  float sum(int64_t t, int64_t i) const { return sums[t * sums_per_token + i]; }
};

template <int Scales>
FoldedX folded_x(const torch::Tensor& x) {
  const int64_t tokens = x.size(0), k = x.size(1), groups = k / 32;
  FoldedX f{k / 2, groups * Scales, std::vector<uint32_t>(tokens * k / 2), std::vector<float>(tokens * groups * Scales)};
  // word w of a group's pairs: chunk c = w / 8 holds its even inputs, then its odd ones (pairs (0, 2), (4, 6),
  // (1, 3), (5, 7))
  alignas(64) static const uint16_t kOrder[32] = {0,  2,  4,  6,  1,  3,  5,  7,  8,  10, 12, 14, 9,  11, 13, 15,
                                                  16, 18, 20, 22, 17, 19, 21, 23, 24, 26, 28, 30, 25, 27, 29, 31};
  const __m512i order = _mm512_load_si512(kOrder);
  const bool is_float = x.scalar_type() == at::kFloat;
  const float* xf = is_float ? x.data_ptr<float>() : nullptr;
  const auto* xh = is_float ? nullptr : reinterpret_cast<const uint16_t*>(x.data_ptr<c10::BFloat16>());
#pragma omp parallel for schedule(static) if (tokens >= 16)  // each token's pairs and sums alone: the same bits
  for (int64_t t = 0; t < tokens; ++t)
    for (int64_t g = 0; g < groups; ++g) {
      const int64_t at = t * k + g * 32;
      const __m512i halves =  // 32 bfloat16, inputs in order (float32 rounded to nearest even)
          is_float ? (__m512i)_mm512_cvtne2ps_pbh(_mm512_loadu_ps(xf + at + 16), _mm512_loadu_ps(xf + at))
                   : _mm512_loadu_si512(xh + at);
      _mm512_storeu_si512(f.pairs.data() + t * (k / 2) + g * 16, _mm512_permutexvar_epi16(order, halves));
      float part[2];
      for (int h = 0; h < 2; ++h) {  // inputs 16h .. 16h + 15 widened back to float32 (exact), summed
        const __m256i sixteen = h == 0 ? _mm512_castsi512_si256(halves) : _mm512_extracti64x4_epi64(halves, 1);
        part[h] = _mm512_reduce_add_ps((__m512)_mm512_slli_epi32(_mm512_cvtepu16_epi32(sixteen), 16));
      }
      if constexpr (Scales == 2) {
        f.sums[(t * groups + g) * 2] = part[0];
        f.sums[(t * groups + g) * 2 + 1] = part[1];
      } else {
        f.sums[t * groups + g] = part[0] + part[1];
      }
    }
  return f;
}

// Pair q (0..3) of a chunk: its inputs' codes as 128 + code, bfloat16, in a lane's halves (FoldedX's order).
template <class Groups>
inline __m512bh folded_pair(const Chunk<Groups>& chunk, int q) {
  ulanes v;
  if constexpr (Groups::kHighBits == 0)
    v = (chunk.low >> (4 * q)) & 0x000F000Fu;  // nibbles: bits 4q and 16 + 4q
  else
    v = ((q % 2 == 0 ? chunk.low : chunk.high) >> (8 * (q / 2))) & 0x00FF00FFu;  // bytes 0 and 2, then 1 and 3
  return reinterpret_cast<__m512bh>(v | 0x43004300u);
}

// A scale's shift, offset - 128 * scale: what the 128s of its codes add, taken back with X.
inline lanes folded_shift(lanes scale, lanes offset) {
  return reinterpret_cast<lanes>(_mm512_fnmadd_ps(_mm512_set1_ps(128.f), reinterpret_cast<__m512>(scale),
                                                  reinterpret_cast<__m512>(offset)));
}

// acc + the scale's sum: scale * D + shift * X, in this order.
inline __m512 folded_scale(__m512 acc, __m512 d, lanes scale, lanes shift, float x_sum) {
  return _mm512_fmadd_ps(reinterpret_cast<__m512>(shift), _mm512_set1_ps(x_sum),
                         _mm512_fmadd_ps(reinterpret_cast<__m512>(scale), d, acc));
}

inline __m512 folded_dot(__m512 d, __m512bh pair, const uint32_t* x_pair) {
  return _mm512_dpbf16_ps(d, pair, reinterpret_cast<__m512bh>(_mm512_set1_epi32(static_cast<int>(*x_pair))));
}

// folded_blocks asks for each block's codes this many groups ahead (1 KiB): R blocks side by side are R streams
// of codes (and of scales) at once, more than the hardware prefetcher keeps up with; the 1B's one-token linears
// took 0.79x the time with it, 2 and 4 groups alike, 8 worse (docs/PERFORMANCE.md "The fold").
constexpr int kPrefetchGroups = 4;

// T tokens (a decode step of a few sequences) times R blocks side by side, straight from registers:
// sums[r][t * 16 + l].
template <int T, int R, class Groups>
void folded_blocks(const uint8_t* const* codes, const Groups* groups, const FoldedX& x, int64_t k, float* const* sums) {
  using C = Chunk<Groups>;
  constexpr int kPairs = 16 / Groups::kScales;  // pairs a scale
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_setzero_ps();
  const int64_t n_groups = k / kGroup;
  for (int64_t g = 0; g < n_groups; ++g) {
    if (g + kPrefetchGroups < n_groups)
      for (int r = 0; r < R; ++r)
        for (int line = 0; line < group_bytes<Groups::kBits>(); line += 64)
          _mm_prefetch(reinterpret_cast<const char*>(codes[r]) + (g + kPrefetchGroups) * group_bytes<Groups::kBits>() + line,
                       _MM_HINT_T0);
    for (int h = 0; h < Groups::kScales; ++h) {
      __m512 d[T][R];
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) d[t][r] = _mm512_setzero_ps();
      for (int c = h * C::kPerScale; c < (h + 1) * C::kPerScale; ++c) {
        C chunk[R];
        for (int r = 0; r < R; ++r) chunk[r] = C(codes[r], groups[r], g, c, 0);
#pragma GCC unroll 4
        for (int q = 0; q < 4; ++q) {
          __m512bh pair[R];
          for (int r = 0; r < R; ++r) pair[r] = folded_pair(chunk[r], q);
          for (int t = 0; t < T; ++t) {
            const uint32_t* xp = x.pair(t, g * 16 + 4 * c + q);
            for (int r = 0; r < R; ++r) d[t][r] = folded_dot(d[t][r], pair[r], xp);
          }
        }
      }
      static_assert(C::kPerScale * 4 == kPairs);
      for (int r = 0; r < R; ++r) {
        lanes scale, offset;
        groups[r].get(g, h, 0, scale, offset);
        const lanes shift = folded_shift(scale, offset);
        for (int t = 0; t < T; ++t)
          acc[t][r] = folded_scale(acc[t][r], d[t][r], scale, shift, x.sum(t, g * Groups::kScales + h));
      }
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[r] + t * kRows, acc[t][r]);
}

// Blocks b0 .. b0 + count - 1 (count <= R) through folded_blocks, R side by side, the rest fewer at a time.
template <int T, int R, class Groups, class BlockCodes>
void folded_run(BlockCodes block_codes, const Groups& weight, const FoldedX& x, int64_t k, int64_t b0, int count,
                float (*result)[T * kRows]) {
  if constexpr (R >= 1) {
    if (count >= R) {
      const uint8_t* run_codes[R];
      Groups run_groups[R];
      float* sums[R];
      for (int r = 0; r < R; ++r) {
        run_codes[r] = block_codes(b0 + r);
        run_groups[r] = weight.at(b0 + r, k / kGroup);
        sums[r] = result[r];
      }
      folded_blocks<T, R>(run_codes, run_groups, x, k, sums);
      b0 += R, count -= R, result += R;
    }
    if constexpr (R > 1) folded_run<T, R / 2>(block_codes, weight, x, k, b0, count, result);
  }
}

// Every block of a T-token step (T <= 4), runs of 8 / T blocks (for_each_run).
template <int T, class Groups, class Out>
void folded_fused_matmul(const uint8_t* codes, const Groups& weight, const FoldedX& x, int64_t k, int64_t n,
                         Out* out) {
  constexpr int R = std::max(1, 8 / T);
  const int64_t groups = k / kGroup;
  auto block_codes = [&](int64_t b) { return codes + b * groups * group_bytes<Groups::kBits>(); };
  for_each_run<T, R>(n, out, [&](int64_t b0, int count, float (*result)[T * kRows]) {
    folded_run<T, R>(block_codes, weight, x, k, b0, count, result);
  });
}

// The staged path's tile: 8 tokens times 2 blocks, 16 sums in flight, enough to keep vdpbf16ps' units busy
// through its latency (one block's 8 tokens left them idle: ~0.6x oneDNN's bfloat16 rate at 512 tokens; 6 x 2
// took 0.76-0.88x its time, 8 x 2 another 0.93-0.97x, 8 x 3 no better; docs/PERFORMANCE.md "The fold's staged
// tile").
constexpr int kFoldTokens = 8;
constexpr int kFoldBlocks = 2;

// One block's pairs of up to kChunkGroups groups (8 KiB, in L1), with their scales and shifts.
template <class Groups>
struct StagedChunk {
  __m512bh pairs[kChunkGroups * 16];
  lanes scales[kChunkGroups * Groups::kScales], shifts[kChunkGroups * Groups::kScales];

  void stage(const uint8_t* codes, const Groups& groups, int64_t g0, int64_t count) {
    using C = Chunk<Groups>;
    for (int64_t g = 0; g < count; ++g) {
      for (int h = 0; h < Groups::kScales; ++h) {
        lanes offset;
        groups.get(g0 + g, h, 0, scales[g * Groups::kScales + h], offset);
        shifts[g * Groups::kScales + h] = folded_shift(scales[g * Groups::kScales + h], offset);
      }
      for (int c = 0; c < C::kCount; ++c) {
        const C chunk(codes, groups, g0 + g, c, 0);
        for (int q = 0; q < 4; ++q) pairs[g * 16 + 4 * c + q] = folded_pair(chunk, q);
      }
    }
  }
};

// R staged blocks times T of the step's tokens from t0, over the chunk's count groups from g0:
// sums[r][t * 16 + l] carried on.
template <int T, int R, class Groups>
void folded_multiply(const StagedChunk<Groups>* chunks, int64_t g0, int64_t count, const FoldedX& x, int64_t t0,
                     float* const* sums) {
  constexpr int kPairs = 16 / Groups::kScales;
  __m512 acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = _mm512_loadu_ps(sums[r] + (t0 + t) * kRows);
  for (int64_t g = 0; g < count; ++g)
    for (int h = 0; h < Groups::kScales; ++h) {
      __m512 d[T][R];
      for (int t = 0; t < T; ++t)
        for (int r = 0; r < R; ++r) d[t][r] = _mm512_setzero_ps();
      const int64_t first = (g0 + g) * 16 + h * kPairs;
      for (int q = 0; q < kPairs; ++q)
        for (int t = 0; t < T; ++t)
          for (int r = 0; r < R; ++r)
            d[t][r] = folded_dot(d[t][r], chunks[r].pairs[g * 16 + h * kPairs + q], x.pair(t0 + t, first + q));
      const int64_t s = g * Groups::kScales + h;
      for (int t = 0; t < T; ++t) {
        const float x_sum = x.sum(t0 + t, (g0 + g) * Groups::kScales + h);
        for (int r = 0; r < R; ++r)
          acc[t][r] = folded_scale(acc[t][r], d[t][r], chunks[r].scales[s], chunks[r].shifts[s], x_sum);
      }
    }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) _mm512_storeu_ps(sums[r] + (t0 + t) * kRows, acc[t][r]);
}

// Every token of a longer step: blocks kFoldBlocks at a time (the threads split the runs), each run's pairs
// staged kChunkGroups groups at a time, then the tokens kFoldTokens at a time.
template <class Groups, class Out>
void folded_staged_matmul(const uint8_t* codes, const Groups& weight, const FoldedX& x, int64_t k, int64_t tokens,
                          int64_t n, Out* out) {
  const int64_t groups = k / kGroup, blocks = (n + kRows - 1) / kRows;
  const int64_t runs = (blocks + kFoldBlocks - 1) / kFoldBlocks;
#pragma omp parallel
  {
    std::vector<float> result(kFoldBlocks * tokens * kRows);
    std::vector<StagedChunk<Groups>> chunks(kFoldBlocks);
#pragma omp for schedule(static)
    for (int64_t run = 0; run < runs; ++run) {
      const int64_t b0 = run * kFoldBlocks;
      const int count = static_cast<int>(std::min<int64_t>(kFoldBlocks, blocks - b0));
      float* sums[kFoldBlocks];
      Groups run_groups[kFoldBlocks];
      for (int r = 0; r < count; ++r) {
        sums[r] = result.data() + r * tokens * kRows;
        run_groups[r] = weight.at(b0 + r, groups);
      }
      std::fill(result.begin(), result.end(), 0.f);
      for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
        const int64_t in_chunk = std::min<int64_t>(kChunkGroups, groups - g0);
        for (int r = 0; r < count; ++r)
          chunks[r].stage(codes + (b0 + r) * groups * group_bytes<Groups::kBits>(), run_groups[r], g0, in_chunk);
        in_passes<kFoldTokens>(tokens, [&](int64_t t0, auto tile) {
          if (count == kFoldBlocks)
            folded_multiply<decltype(tile)::value, kFoldBlocks>(chunks.data(), g0, in_chunk, x, t0, sums);
          else  // the last run: its blocks one at a time
            for (int r = 0; r < count; ++r)
              folded_multiply<decltype(tile)::value, 1>(chunks.data() + r, g0, in_chunk, x, t0, sums + r);
        });
      }
      for (int r = 0; r < count; ++r) tinyserve::store_block(n, tokens, b0 + r, sums[r], out);
    }
  }
}

template <class Groups, class Out>
void folded_matmul(const torch::Tensor& x, const uint8_t* codes, const Groups& weight, int64_t n, Out* out) {
  const int64_t tokens = x.size(0), k = x.size(1);
  const FoldedX folded = folded_x<Groups::kScales>(x);
  switch (tokens) {
    case 1: return folded_fused_matmul<1>(codes, weight, folded, k, n, out);
    case 2: return folded_fused_matmul<2>(codes, weight, folded, k, n, out);
    case 3: return folded_fused_matmul<3>(codes, weight, folded, k, n, out);
    case 4: return folded_fused_matmul<4>(codes, weight, folded, k, n, out);
    default: return folded_staged_matmul(codes, weight, folded, k, tokens, n, out);
  }
}

#endif  // __AVX512BF16__

// The int4 (GGUF Q4_1), int8 (Q8_0), int4 super-block (Q4_K) and wide-code (Q5_0, Q5_1, Q5_K, Q6_K) weights
// times unrounded activations (W4A16, W8A16), bfloat16 or float32, the output in the activations' dtype:
// out[t, n] = sum_k x[t, k] w[n, k], with w = code * scale + offset per group of 32 inputs (Q6_K: per 16), in
// the layouts of layers/quant.py's Int4Weight, Int8Weight (quantized_matmul.cpp describes them),
// Int4SuperblockWeight, Int5Weight, Int5SuperblockWeight and Int6SuperblockWeight (a16_formats.h describes the
// wide codes' high plane). The formats differ only in how a group's scale, offset and high bits are read (the
// Groups structs of a16_formats.h); the widening and the sums are one code path.
//
// Why: quantized_matmul.cpp rounds each group of 32 activations to int8 before its integer dot, as
// llama.cpp does; that rounding moves a small model's logits enough to change its greedy answers
// (docs/PERFORMANCE.md, "W4A16"). Here the activations stay as they are: each weight is widened in
// registers to float32 (code * scale + offset: at most one rounding, each Groups struct says where) and
// multiplied into a float32 sum per row and token.
//
// On a CPU with AVX512-BF16 the formats of 4- to 6-bit codes (all but Int8Weight) take a16_fold.h's path
// instead: x rounded to bfloat16 once, the codes into bfloat16 pairs as they are, bfloat16 dot products, each
// group's scale and offset applied once (1.4-2x faster; w4a16_rounds_to_bfloat16 says which path a build has).
//
// The numerics do not depend on the step's shape: each (token, row) sum runs over the inputs in the same
// order whatever the number of tokens in the step or their tiling (the tokens of a pass share the widened
// weights, not their sums), so a token's output is the same bits in a decode step of one, a batch of 64 or
// a prefill chunk of 512 (tests/test_quant.py checks it).

#include "row_blocks.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>

// Not -ffast-math here: it lets the compiler regroup a lane's chain of sums (for more instructions in
// flight), and it regrouped them differently for one token than for eight, which made a token's output
// depend on the step it was in. Products still fuse into FMAs (-ffp-contract=fast, GCC's default).
#pragma GCC optimize("no-fast-math", "fp-contract=fast")

namespace {

using tinyserve::kRows;

constexpr int kGroup = 32;

#include "a16_formats.h"

#ifdef __AVX512F__
constexpr int kTile = 8;  // tokens per pass: 8 accumulators of 32 registers
#else
constexpr int kTile = 6;  // 12 accumulators of AVX2's 16 registers (with 4 tokens' 8, 1.4x slower from 64 tokens)
#endif

template <int Bits>
constexpr int64_t group_bytes() { return kGroup * kRows * Bits / 8; }  // int4: 4 chunks of 64 bytes; int8: 8

// The widened weights of up to kChunkGroups groups of one block (16 KiB: they stay in L1) are computed once
// and then multiplied with every token of the step, kTile tokens at a time: the widening is paid once per
// step, not once per pass.
constexpr int kChunkGroups = 8;

// A vector of codes (each below 256) widened: code * scale + offset, rounded once (one FMA). The codes go in
// as signed int32, which AVX2 converts in one instruction; as unsigned GCC splits each into two halves and
// converts both (six instructions for one).
inline lanes widened(ulanes code, lanes scale, lanes offset) {
  return __builtin_convertvector(reinterpret_cast<ilanes>(code), lanes) * scale + offset;
}

// A chunk of a group's codes (int4: 8 inputs, int8: 4) for part p of a block's rows, as read from memory once:
// `low` and `high` hold every input's code, which code(i) shifts and masks out (lane l: row p * kWidth + l).
template <class Groups>
struct Chunk {
  static constexpr int Bits = Groups::kBits, HighBits = Groups::kHighBits;
  static constexpr int kCount = Bits == 4 ? 4 : 8, kInputs = Bits == 4 ? 8 : 4;  // chunks a group, inputs a chunk
  static constexpr int kPerScale = kCount / Groups::kScales;
  ulanes low, high;  // wide codes: byte k of each holds input 8c + k's (8c + 4 + k's) code; else both the bytes

  Chunk() = default;
  // Chunk c of group g of a block (its codes from `codes`, its high plane from `groups`).
  Chunk(const uint8_t* codes, const Groups& groups, int64_t g, int c, int p) {
    ulanes bytes;  // lane l: row (p * kWidth + l)'s 4 bytes of chunk c
    __builtin_memcpy(&bytes, codes + g * group_bytes<Bits>() + c * 64 + p * kWidth * 4, sizeof(bytes));
    low = high = bytes;
    if constexpr (HighBits > 0) {
      using Plane = HighPlane<HighBits>;
      const ulanes plane = groups.high(g, c / Plane::kSpanChunks, p);
      low = Plane::codes(bytes, plane, c % Plane::kSpanChunks, 0);
      high = Plane::codes(bytes >> 4, plane, c % Plane::kSpanChunks, 1);
    }
  }

  // Input i's codes (int4: input 8c + i, byte i % 4's low nibble for i < 4; int8: input 4c + i).
  ulanes code(int i) const {
    if constexpr (HighBits > 0) return ((i < 4 ? low : high) >> (8 * (i % 4))) & 0xff;
    return (low >> (Bits == 4 ? 8 * (i % 4) + 4 * (i / 4) : 8 * i)) & (Bits == 4 ? 0x0fu : 0xffu);
  }
};

// Groups g0 .. g0 + count - 1 of a block, widened: w[j * kParts + p] = part p of the rows' weights of input
// g0 * 32 + j.
template <class Groups>
void widen(const uint8_t* codes, const Groups& groups, int64_t g0, int64_t count, lanes* w) {
  using C = Chunk<Groups>;
  for (int64_t g = g0; g < g0 + count; ++g)
    for (int p = 0; p < kParts; ++p)
      for (int h = 0; h < Groups::kScales; ++h) {
        lanes scale, offset;
        groups.get(g, h, p, scale, offset);
        for (int c = h * C::kPerScale; c < (h + 1) * C::kPerScale; ++c) {
          const C chunk(codes, groups, g, c, p);
          for (int i = 0; i < C::kInputs; ++i)
            w[((g - g0) * kGroup + C::kInputs * c + i) * kParts + p] = widened(chunk.code(i), scale, offset);
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

// pass(t0, std::integral_constant<int, T>{}) for a step's tokens Tile at a time from t0 = 0, then for the last
// ones, fewer than a pass (T a compile-time constant: the passes' sums live in registers).
template <int Tile, class Pass>
void in_passes(int64_t tokens, Pass&& pass) {
  static_assert(Tile <= 8);
  int64_t t0 = 0;
  for (; t0 + Tile <= tokens; t0 += Tile) pass(t0, std::integral_constant<int, Tile>{});
  auto last = [&](auto left) {
    if constexpr (decltype(left)::value < Tile) pass(t0, left);
  };
  switch (tokens - t0) {
    case 1: return last(std::integral_constant<int, 1>{});
    case 2: return last(std::integral_constant<int, 2>{});
    case 3: return last(std::integral_constant<int, 3>{});
    case 4: return last(std::integral_constant<int, 4>{});
    case 5: return last(std::integral_constant<int, 5>{});
    case 6: return last(std::integral_constant<int, 6>{});
    case 7: return last(std::integral_constant<int, 7>{});
    default: return;
  }
}

// One block of 16 rows for every token: sum[t * 16 + l] for row l. x is float32 [tokens, K].
template <class Groups>
void block(const uint8_t* codes, const Groups& scales, const float* x, int64_t k, int64_t tokens, float* sum) {
  lanes w[kChunkGroups * kGroup * kParts];
  std::fill(sum, sum + tokens * kRows, 0.f);
  const int64_t groups = k / kGroup;
  for (int64_t g0 = 0; g0 < groups; g0 += kChunkGroups) {
    const int64_t count = std::min<int64_t>(kChunkGroups, groups - g0), inputs = count * kGroup;
    widen(codes, scales, g0, count, w);
    in_passes<kTile>(tokens, [&](int64_t t0, auto tile) {
      multiply<decltype(tile)::value>(w, inputs, x, k, g0 * kGroup, t0, sum);
    });
  }
}

// Steps of a few tokens (a decode step of one to four sequences): the widened weights go straight from
// registers into the sums, several blocks at a time. With one token a block has only kParts sums, each a chain
// of dependent FMAs (one a 4-5 cycles), and staging the widened weights in L1 costs a store and a load per
// vector; R blocks side by side give kParts * R independent chains and nothing goes through memory. Each
// (token, row) sum is the same FMAs on the same widened weights in the same input order as block()'s, so a
// token's output has the same bits either way (tests/test_quant.py checks it).
template <int T, int R, class Groups>
void fused_blocks(const uint8_t* const* codes, const Groups* groups, const float* x, int64_t k, float* const* sums) {
  using C = Chunk<Groups>;
  lanes acc[T][R][kParts];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r)
      for (int p = 0; p < kParts; ++p) acc[t][r][p] = lanes{};
  const int64_t n_groups = k / kGroup;
  for (int64_t g = 0; g < n_groups; ++g)
    for (int h = 0; h < Groups::kScales; ++h) {
      lanes scale[R][kParts], offset[R][kParts];
      for (int r = 0; r < R; ++r)
        for (int p = 0; p < kParts; ++p) groups[r].get(g, h, p, scale[r][p], offset[r][p]);
      for (int c = h * C::kPerScale; c < (h + 1) * C::kPerScale; ++c) {
        C chunk[R][kParts];
        for (int r = 0; r < R; ++r)
          for (int p = 0; p < kParts; ++p) chunk[r][p] = C(codes[r], groups[r], g, c, p);
#pragma GCC unroll 8
        for (int i = 0; i < C::kInputs; ++i) {
          float xv[T];
          for (int t = 0; t < T; ++t) xv[t] = x[t * k + g * kGroup + C::kInputs * c + i];
          for (int r = 0; r < R; ++r)
            for (int p = 0; p < kParts; ++p) {
              const lanes w = widened(chunk[r][p].code(i), scale[r][p], offset[r][p]);
              for (int t = 0; t < T; ++t) acc[t][r][p] += xv[t] * w;
            }
        }
      }
    }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) __builtin_memcpy(sums[r] + t * kRows, &acc[t][r], sizeof(acc[t][r]));
}

// Blocks side by side in fused_blocks for a step of T tokens: enough for 8 chains of sums on AVX-512 (8 blocks
// for one token); on AVX2 for 4 (2 blocks for one token, 1 for two or more). There each block holds 8 vectors
// through its groups (scale, offset, sums and codes of its two halves), and 4 blocks' 32 spilled to the stack:
// 2 blocks ran one token 1.15-1.35x faster (Zen 3, docs/PERFORMANCE.md "W4A16 at one token: fewer blocks side
// by side"), 1 block about as fast.
#ifdef __AVX512F__
constexpr int kChains = 8;
#else
constexpr int kChains = 4;
#endif
template <int T>
constexpr int kSideBySide = std::max(1, kChains / (kParts * T));

// Runs of R blocks of a T-token step split over the threads: run(b0, count, result) computes blocks b0 ..
// b0 + count - 1 (count <= R) into result[0 .. count - 1], which are then stored into out.
template <int T, int R, class Out, class Run>
void for_each_run(int64_t n, Out* out, Run&& run) {
  const int64_t blocks = (n + kRows - 1) / kRows, runs = (blocks + R - 1) / R;
#pragma omp parallel
  {
    float result[R][T * kRows];
#pragma omp for schedule(static)
    for (int64_t i = 0; i < runs; ++i) {
      const int64_t b0 = i * R;
      const int count = static_cast<int>(std::min<int64_t>(R, blocks - b0));
      run(b0, count, result);
      for (int r = 0; r < count; ++r) tinyserve::store_block(n, T, b0 + r, result[r], out);
    }
  }
}

// All blocks of a T-token step through fused_blocks, runs of kSideBySide<T> blocks.
template <int T, class Groups, class Out>
void fused_matmul(const uint8_t* codes, const Groups& weight, const float* x, int64_t k, int64_t n, Out* out) {
  constexpr int R = kSideBySide<T>;
  const int64_t groups = k / kGroup;
  auto block_codes = [&](int64_t b) { return codes + b * groups * group_bytes<Groups::kBits>(); };
  for_each_run<T, R>(n, out, [&](int64_t b0, int count, float (*result)[T * kRows]) {
    if (count == R) {
      const uint8_t* run_codes[R];
      Groups run_groups[R];
      float* sums[R];
      for (int r = 0; r < R; ++r) {
        run_codes[r] = block_codes(b0 + r);
        run_groups[r] = weight.at(b0 + r, groups);
        sums[r] = result[r];
      }
      fused_blocks<T, R>(run_codes, run_groups, x, k, sums);
    } else {  // the last blocks, fewer than a run
      for (int r = 0; r < count; ++r) {
        const uint8_t* one_codes[1] = {block_codes(b0 + r)};
        const Groups one_groups[1] = {weight.at(b0 + r, groups)};
        float* sums[1] = {result[r]};
        fused_blocks<T, 1>(one_codes, one_groups, x, k, sums);
      }
    }
  });
}

// The weight's blocks of 16 rows and groups of 32 inputs, x and out_features checked.
struct Shape {
  int64_t blocks, groups;
};

#include "a16_fold.h"

Shape check_x(const char* name, const torch::Tensor& x, int64_t out_features) {
  TORCH_CHECK(x.device().is_cpu(), name, ": inputs must be on the CPU");
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == at::kBFloat16 || x.scalar_type() == at::kFloat), name,
              ": x must be [tokens, in] bfloat16 or float32");
  TORCH_CHECK(out_features >= 1 && x.size(1) >= kGroup && x.size(1) % kGroup == 0, name,
              ": out_features must be >= 1 and in a multiple of ", kGroup);
  TORCH_CHECK(x.size(0) >= 1, name, ": no tokens");
  return {(out_features + kRows - 1) / kRows, x.size(1) / kGroup};
}

// One of the weight's tensors: [blocks, per_block] of `dtype`, contiguous, on the CPU.
void check_part(const char* name, const char* what, const torch::Tensor& t, at::ScalarType dtype, int64_t blocks,
                int64_t per_block) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == dtype && t.is_contiguous() && t.dim() == 2, name, ": ",
              what, " must be ", dtype, ", contiguous, 2-d, on the CPU");
  TORCH_CHECK(t.size(0) == blocks && t.size(1) == per_block, name, ": shapes do not match (", what, ")");
}

template <class Groups>
torch::Tensor matmul(const char* name, const torch::Tensor& x, const torch::Tensor& codes, const Groups& scales,
                     int64_t out_features) {
  const Shape shape = check_x(name, x, out_features);
  check_part(name, "codes", codes, at::kByte, shape.blocks, shape.groups * group_bytes<Groups::kBits>());
  const int64_t tokens = x.size(0), k = x.size(1), n = out_features, groups = shape.groups;
  auto out = torch::empty({tokens, n}, x.options());
  const auto* cp = codes.data_ptr<uint8_t>();
#if defined(__AVX512BF16__)
  if constexpr (kFolds<Groups>) {  // a16_fold.h
    const auto xc = x.contiguous();
    if (x.scalar_type() == at::kFloat)
      folded_matmul(xc, cp, scales, n, out.data_ptr<float>());
    else
      folded_matmul(xc, cp, scales, n, out.data_ptr<c10::BFloat16>());
    return out;
  }
#endif
  const auto xf = x.to(at::kFloat).contiguous();  // exact: bfloat16 is float32's top half
  const float* xp = xf.data_ptr<float>();
  auto pass = [&](int64_t b, float* sum) {
    block(cp + b * groups * group_bytes<Groups::kBits>(), scales.at(b, groups), xp, k, tokens, sum);
  };
  auto run = [&](auto* o) {
    switch (tokens) {  // steps of up to kTile tokens: fused_blocks (the same sums: the same bits)
      case 1: return fused_matmul<1>(cp, scales, xp, k, n, o);
      case 2: return fused_matmul<2>(cp, scales, xp, k, n, o);
      case 3: return fused_matmul<3>(cp, scales, xp, k, n, o);
      case 4: return fused_matmul<4>(cp, scales, xp, k, n, o);
      default: return tinyserve::for_each_row_block(n, tokens, o, pass);
    }
  };
  if (x.scalar_type() == at::kFloat)
    run(out.data_ptr<float>());
  else
    run(out.data_ptr<c10::BFloat16>());
  return out;
}

// The readers of a weight's parts, each checked against x's shape. No minimums: w = (code - zero_code) * scale.
Int4Groups int4_groups(const char* name, const Shape& shape, const torch::Tensor& scales,
                       const std::optional<torch::Tensor>& minimums, float zero_code) {
  check_part(name, "scales", scales, at::kHalf, shape.blocks, shape.groups * kRows);
  if (!minimums.has_value()) return {scales.data_ptr<at::Half>(), nullptr, zero_code};
  check_part(name, "minimums", *minimums, at::kHalf, shape.blocks, shape.groups * kRows);
  return {scales.data_ptr<at::Half>(), minimums->data_ptr<at::Half>(), zero_code};
}

void check_superblocks(const char* name, const Shape& shape) {
  TORCH_CHECK(shape.groups % kSuperGroups == 0, name, ": in must be a multiple of ", kSuperGroups * kGroup);
}

SuperblockGroups superblock_groups(const char* name, const Shape& shape, const torch::Tensor& d,
                                   const torch::Tensor& dmin, const torch::Tensor& sub_scales,
                                   const torch::Tensor& sub_mins) {
  check_superblocks(name, shape);
  check_part(name, "d", d, at::kHalf, shape.blocks, shape.groups / kSuperGroups * kRows);
  check_part(name, "dmin", dmin, at::kHalf, shape.blocks, shape.groups / kSuperGroups * kRows);
  check_part(name, "sub_scales", sub_scales, at::kByte, shape.blocks, shape.groups * kRows);
  check_part(name, "sub_mins", sub_mins, at::kByte, shape.blocks, shape.groups * kRows);
  return {d.data_ptr<at::Half>(), dmin.data_ptr<at::Half>(), sub_scales.data_ptr<uint8_t>(),
          sub_mins.data_ptr<uint8_t>()};
}

template <int HighBits>
HighPlane<HighBits> high_plane(const char* name, const Shape& shape, const torch::Tensor& high_bits) {
  check_part(name, "high_bits", high_bits, at::kByte, shape.blocks, shape.groups * HighPlane<HighBits>::kGroupBytes);
  return {high_bits.data_ptr<uint8_t>()};
}

}  // namespace

bool w4a16_rounds_to_bfloat16() {
#if defined(__AVX512BF16__)
  return true;  // a16_fold.h
#else
  return false;
#endif
}

torch::Tensor w4a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& minimums, int64_t out_features) {
  const char* name = "w4a16_matmul";
  const Shape shape = check_x(name, x, out_features);
  return matmul(name, x, codes, int4_groups(name, shape, scales, minimums, 8.f), out_features);
}

torch::Tensor w8a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           int64_t out_features) {
  const char* name = "w8a16_matmul";
  const Shape shape = check_x(name, x, out_features);
  check_part(name, "scales", scales, at::kHalf, shape.blocks, shape.groups * kRows);
  return matmul(name, x, codes, Int8Groups{scales.data_ptr<at::Half>()}, out_features);
}

torch::Tensor w4a16_superblock_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                                      const torch::Tensor& dmin, const torch::Tensor& sub_scales,
                                      const torch::Tensor& sub_mins, int64_t out_features) {
  const char* name = "w4a16_superblock_matmul";
  const Shape shape = check_x(name, x, out_features);
  return matmul(name, x, codes, superblock_groups(name, shape, d, dmin, sub_scales, sub_mins), out_features);
}

torch::Tensor w5a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& high_bits,
                           const torch::Tensor& scales, const std::optional<torch::Tensor>& minimums,
                           int64_t out_features) {
  const char* name = "w5a16_matmul";
  const Shape shape = check_x(name, x, out_features);
  return matmul(name, x, codes,
                Int5Groups{int4_groups(name, shape, scales, minimums, 16.f), high_plane<1>(name, shape, high_bits)},
                out_features);
}

torch::Tensor w5a16_superblock_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                                      const torch::Tensor& high_bits, const torch::Tensor& d,
                                      const torch::Tensor& dmin, const torch::Tensor& sub_scales,
                                      const torch::Tensor& sub_mins, int64_t out_features) {
  const char* name = "w5a16_superblock_matmul";
  const Shape shape = check_x(name, x, out_features);
  return matmul(name, x, codes,
                Int5SuperblockGroups{superblock_groups(name, shape, d, dmin, sub_scales, sub_mins),
                                     high_plane<1>(name, shape, high_bits)},
                out_features);
}

torch::Tensor w6a16_superblock_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                                      const torch::Tensor& high_bits, const torch::Tensor& d,
                                      const torch::Tensor& sub_scales, int64_t out_features) {
  const char* name = "w6a16_superblock_matmul";
  const Shape shape = check_x(name, x, out_features);
  check_superblocks(name, shape);
  check_part(name, "d", d, at::kHalf, shape.blocks, shape.groups / kSuperGroups * kRows);
  check_part(name, "sub_scales", sub_scales, at::kChar, shape.blocks, shape.groups * 2 * kRows);
  return matmul(name, x, codes,
                Int6SuperblockGroups{d.data_ptr<at::Half>(), sub_scales.data_ptr<int8_t>(),
                                     high_plane<2>(name, shape, high_bits)},
                out_features);
}

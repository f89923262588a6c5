// A GGUF tensor's blocks -> the kernels' formats (layers/quant.py), in one pass over the file's bytes.
// Q4_0 / Q4_1: per block of 32 weights, its float16 d (and Q4_1's m) and its 16 code bytes regrouped into the
// int4 kernels' chunk order by the word operations loader/gguf/blocks.py's nibble_codes describes. Q4_K, Q5_K and
// Q6_K: below. blocks.py runs each in torch ops where the kernels are not built; tests/test_gguf_blocks.py (Q4_x)
// and tests/test_gguf_q4_k.py (the K-quants) hold the two to the same bytes.
// Why here: the torch ops took ~0.5 s of a 1B Q4_0 model's ~5 s start (a copy to align the codes, a dozen word
// ops over the whole tensor, a stack), this pass a few tens of ms.

#include <torch/extension.h>

#include <cstring>
#include <vector>

std::vector<torch::Tensor> q4_nibble_codes(const torch::Tensor& blocks, bool with_minimums) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              "q4_nibble_codes: blocks must be uint8 [rows, bytes], contiguous, on the CPU");
  const int64_t block_bytes = with_minimums ? 20 : 18, at = block_bytes - 16;
  TORCH_CHECK(blocks.size(1) % block_bytes == 0, "q4_nibble_codes: a row is not whole blocks of ", block_bytes);
  const int64_t rows = blocks.size(0), per_row = blocks.size(1) / block_bytes;
  auto codes = torch::empty({rows, per_row * 16}, blocks.options());
  auto halves = blocks.options().dtype(at::kHalf);
  auto scales = torch::empty({rows, per_row}, halves);
  auto minimums = with_minimums ? torch::empty({rows, per_row}, halves) : torch::Tensor();
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t* out = codes.data_ptr<uint8_t>();
  auto* scale_out = reinterpret_cast<uint16_t*>(scales.data_ptr<at::Half>());
  auto* minimum_out = with_minimums ? reinterpret_cast<uint16_t*>(minimums.data_ptr<at::Half>()) : nullptr;
  constexpr uint32_t kLow = 0x0f0f0f0fu, kHigh = 0xf0f0f0f0u;
#pragma omp parallel for schedule(static)
  for (int64_t row = 0; row < rows; ++row)
    for (int64_t j = 0; j < per_row; ++j) {
      const int64_t i = row * per_row + j;
      const uint8_t* block = in + i * block_bytes;
      std::memcpy(scale_out + i, block, 2);
      if (with_minimums) std::memcpy(minimum_out + i, block + 2, 2);
      uint32_t w[4], chunk[4];
      std::memcpy(w, block + at, 16);
      chunk[0] = (w[0] & kLow) | ((w[1] & kLow) << 4);
      chunk[1] = (w[2] & kLow) | ((w[3] & kLow) << 4);
      chunk[2] = ((w[0] >> 4) & kLow) | (w[1] & kHigh);
      chunk[3] = ((w[2] >> 4) & kLow) | (w[3] & kHigh);
      std::memcpy(out + i * 16, chunk, 16);
    }
  if (with_minimums) return {codes, scales, minimums};
  return {codes, scales};
}

// The K-quants' super-blocks of 256 weights, the same way (loader/gguf/blocks.py's superblock_codes,
// int5_superblock_codes and int6_superblock_codes describe each layout and run it in torch ops where the kernels
// are not built): the codes' runs of 32 bytes into the kernels' nibble order, the 6-bit sub-block values
// unpacked a byte each, Q5_K's and Q6_K's high bits into the kernels' high plane.

namespace {

constexpr uint32_t kLowBits = 0x0f0f0f0fu, kHighBits = 0xf0f0f0f0u;

// 32 bytes of 4-bit codes (8 words: byte i holds input i of one group in its low nibble and of another in its
// high) -> the two groups' 16 bytes each in the int4 kernels' order (byte 4c + b: inputs 8c + b, 8c + b + 4).
inline void nibble_run(const uint8_t* in, uint8_t* out) {
  uint32_t w[8], even[4], odd[4];
  std::memcpy(w, in, 32);
  for (int c = 0; c < 4; ++c) {
    even[c] = (w[2 * c] & kLowBits) | ((w[2 * c + 1] << 4) & kHighBits);
    odd[c] = ((w[2 * c] >> 4) & kLowBits) | (w[2 * c + 1] & kHighBits);
  }
  std::memcpy(out, even, 16);
  std::memcpy(out + 16, odd, 16);
}

// Q4_K's and Q5_K's 12 bytes of packed 6-bit values -> the 8 sub-blocks' scales and minimums.
inline void sub_block_values(const uint8_t* packed, uint8_t* scales, uint8_t* mins) {
  for (int j = 0; j < 4; ++j) {
    scales[j] = packed[j] & 63;
    mins[j] = packed[j + 4] & 63;
    scales[j + 4] = (packed[j + 8] & 15) | ((packed[j] >> 6) << 4);
    mins[j + 4] = (packed[j + 8] >> 4) | ((packed[j + 4] >> 6) << 4);
  }
}

// rows of super-blocks of block_bytes -> [rows, super-blocks] and the sizes of one
struct SuperblockRows {
  int64_t rows, per_row;
};

SuperblockRows superblock_rows(const torch::Tensor& blocks, int64_t block_bytes, const char* name) {
  TORCH_CHECK(blocks.device().is_cpu() && blocks.scalar_type() == at::kByte && blocks.dim() == 2 &&
                  blocks.is_contiguous(),
              name, ": blocks must be uint8 [rows, bytes], contiguous, on the CPU");
  TORCH_CHECK(blocks.size(1) % block_bytes == 0, name, ": a row is not whole super-blocks of ", block_bytes);
  return {blocks.size(0), blocks.size(1) / block_bytes};
}

}  // namespace

std::vector<torch::Tensor> q45_k_codes(const torch::Tensor& blocks, bool five_bits) {
  const int64_t block_bytes = five_bits ? 176 : 144, codes_at = five_bits ? 48 : 16;
  const auto [rows, per_row] = superblock_rows(blocks, block_bytes, "q45_k_codes");
  const auto bytes = blocks.options();
  auto codes = torch::empty({rows, per_row * 128}, bytes);
  auto d = torch::empty({rows, per_row}, bytes.dtype(at::kHalf));
  auto dmin = torch::empty({rows, per_row}, bytes.dtype(at::kHalf));
  auto scales = torch::empty({rows, per_row * 8}, bytes);
  auto mins = torch::empty({rows, per_row * 8}, bytes);
  auto high = five_bits ? torch::empty({rows, per_row * 32}, bytes) : torch::Tensor();
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t *codes_out = codes.data_ptr<uint8_t>(), *scales_out = scales.data_ptr<uint8_t>();
  uint8_t *mins_out = mins.data_ptr<uint8_t>(), *high_out = five_bits ? high.data_ptr<uint8_t>() : nullptr;
  auto* d_out = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  auto* dmin_out = reinterpret_cast<uint16_t*>(dmin.data_ptr<at::Half>());
  const int64_t total = rows * per_row;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; ++i) {
    const uint8_t* block = in + i * block_bytes;
    std::memcpy(d_out + i, block, 2);
    std::memcpy(dmin_out + i, block + 2, 2);
    sub_block_values(block + 4, scales_out + i * 8, mins_out + i * 8);
    for (int s = 0; s < 4; ++s) nibble_run(block + codes_at + 32 * s, codes_out + i * 128 + 32 * s);
    if (five_bits) {
      // qh byte l: bit j the high bit of input l of sub-block j -> per sub-block j a word whose byte k holds
      // inputs 4m + k at bit m (qh's word m, byte k, bit j)
      uint32_t qh[8], plane[8] = {};
      std::memcpy(qh, block + 16, 32);
      for (int j = 0; j < 8; ++j)
        for (int m = 0; m < 8; ++m) plane[j] |= ((qh[m] >> j) & 0x01010101u) << m;
      std::memcpy(high_out + i * 32, plane, 32);
    }
  }
  if (five_bits) return {codes, d, dmin, scales, mins, high};
  return {codes, d, dmin, scales, mins};
}

std::vector<torch::Tensor> q6_k_codes(const torch::Tensor& blocks) {
  constexpr int64_t kBlockBytes = 210;  // ql 0-127, qh 128-191, int8 scales 192-207, float16 d 208-209
  const auto [rows, per_row] = superblock_rows(blocks, kBlockBytes, "q6_k_codes");
  const auto bytes = blocks.options();
  auto codes = torch::empty({rows, per_row * 128}, bytes);
  auto high = torch::empty({rows, per_row * 64}, bytes);
  auto d = torch::empty({rows, per_row}, bytes.dtype(at::kHalf));
  auto scales = torch::empty({rows, per_row * 16}, bytes.dtype(at::kChar));
  const uint8_t* in = blocks.data_ptr<uint8_t>();
  uint8_t *codes_out = codes.data_ptr<uint8_t>(), *high_out = high.data_ptr<uint8_t>();
  auto* d_out = reinterpret_cast<uint16_t*>(d.data_ptr<at::Half>());
  auto* scales_out = scales.data_ptr<int8_t>();
  const int64_t total = rows * per_row;
#pragma omp parallel for schedule(static)
  for (int64_t i = 0; i < total; ++i) {
    const uint8_t* block = in + i * kBlockBytes;
    std::memcpy(d_out + i, block + 208, 2);
    std::memcpy(scales_out + i * 16, block + 192, 16);
    // ql's runs 2n + r hold quarters r (low nibbles) and r + 2 (high) of half n: groups 4n + 2e + r, e the
    // nibble; out in group order
    uint8_t run[2][32];
    for (int n = 0; n < 2; ++n) {
      for (int r = 0; r < 2; ++r) nibble_run(block + 32 * (2 * n + r), run[r]);
      for (int e = 0; e < 2; ++e)
        for (int r = 0; r < 2; ++r) std::memcpy(codes_out + i * 128 + 64 * n + 32 * e + 16 * r, run[r] + 16 * e, 16);
    }
    // qh byte 32n + l holds input l of groups 4n + q at bits 2q, 2q + 1 -> per half h of group 4n + q a word whose
    // byte k holds inputs 16h + 4m + k at bits 2m (qh's word 8n + 4h + m, byte k, moved by 2m - 2q)
    uint32_t qh[16], plane[16];
    std::memcpy(qh, block + 128, 64);
    for (int n = 0; n < 2; ++n)
      for (int q = 0; q < 4; ++q)
        for (int h = 0; h < 2; ++h) {
          uint32_t word = 0;
          for (int m = 0; m < 4; ++m) word |= ((qh[8 * n + 4 * h + m] >> (2 * q)) & 0x03030303u) << (2 * m);
          plane[8 * n + 2 * q + h] = word;
        }
    std::memcpy(high_out + i * 64, plane, 64);
  }
  return {codes, high, d, scales};
}

// A GGUF Q4_0 / Q4_1 tensor's blocks -> NibbleCodes' parts (layers/quant.py), in one pass over the file's bytes:
// per block of 32 weights, its float16 d (and Q4_1's m) and its 16 code bytes regrouped into the int4 kernels'
// chunk order by the word operations loader/gguf/blocks.py's nibble_codes describes (and runs in torch ops where
// the kernels are not built; tests/test_gguf_blocks.py holds the two to the same bytes).
// Why here: the torch ops took ~0.5 s of a 1B model's ~5 s start (a copy to align the codes, a dozen word ops
// over the whole tensor, a stack), this pass a few tens of ms.

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

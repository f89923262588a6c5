// Constrained decoding's token mask applied to the logits: -inf on every token a grammar forbids.
//
// Why a kernel: the mask comes as one bit per token (the grammar library's bitmask, 32 tokens per int32
// word). Unpacked by torch ops it becomes [rows, vocab] shifts, a bool tensor and a masked fill, a few
// passes over 49k entries per row; here one pass writes -inf, and most words of a constrained step are 0
// (all 32 tokens forbidden), which is a plain fill.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include <cstdint>
#include <limits>

// logits [batch, vocab] float32, contiguous, written in place; bitmask [num_masked, words] int32 with
// words * 32 >= vocab; rows [num_masked] int64: row i of the bitmask masks logits row rows[i]. Bit b of
// word w allows token 32 * w + b.
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& rows) {
  TORCH_CHECK(logits.dim() == 2 && logits.scalar_type() == torch::kFloat32 && logits.is_contiguous(),
              "logits must be a contiguous [batch, vocab] float32 tensor");
  TORCH_CHECK(bitmask.dim() == 2 && bitmask.scalar_type() == torch::kInt32 && bitmask.is_contiguous(),
              "bitmask must be a contiguous [rows, words] int32 tensor");
  TORCH_CHECK(rows.dim() == 1 && rows.scalar_type() == torch::kInt64 && rows.size(0) == bitmask.size(0),
              "rows must be int64, one per bitmask row");
  const int64_t batch = logits.size(0), vocab = logits.size(1), words = bitmask.size(1);
  TORCH_CHECK(words * 32 >= vocab, "bitmask has ", words, " words, too few for ", vocab, " tokens");
  const int64_t* row_ids = rows.data_ptr<int64_t>();
  for (int64_t i = 0; i < rows.size(0); ++i)
    TORCH_CHECK(0 <= row_ids[i] && row_ids[i] < batch, "row ", row_ids[i], " outside the batch of ", batch);
  const float neg_inf = -std::numeric_limits<float>::infinity();
  float* out = logits.data_ptr<float>();
  const int32_t* masks = bitmask.data_ptr<int32_t>();
  at::parallel_for(0, rows.size(0), 1, [&](int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
      float* row = out + row_ids[i] * vocab;
      const uint32_t* mask = reinterpret_cast<const uint32_t*>(masks + i * words);
      for (int64_t w = 0; w * 32 < vocab; ++w) {
        const uint32_t word = mask[w];
        if (word == 0xFFFFFFFFu) continue;
        const int64_t start = w * 32, stop = start + 32 < vocab ? start + 32 : vocab;
        if (word == 0) {
          for (int64_t t = start; t < stop; ++t) row[t] = neg_inf;
        } else {
          for (int64_t t = start; t < stop; ++t)
            if (!((word >> (t - start)) & 1u)) row[t] = neg_inf;
        }
      }
    }
  });
}

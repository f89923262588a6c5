// Greedy decoding's pick: the index of each row's largest logit, the first one on ties, as torch.argmax.
//
// Why a kernel: torch's CPU argmax compares index by index and is slower on bfloat16 rows than a float32
// copy and an argmax of that; both cost more per step at batch 64 than all the norms together
// (docs/PERFORMANCE.md, "The step outside the kernels"). Here each row is two passes the compiler
// vectorizes: its max (and whether it holds a NaN, which torch takes as the largest), then the first
// block of 64 that holds that max, searched index by index.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_types.h"

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace {

using tinyserve::to_float;

inline uint32_t bits_of(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  return bits;
}

template <typename T>
int64_t row_argmax(const T* row, int64_t n) {
  float best = -std::numeric_limits<float>::infinity();
  uint32_t nan = 0;  // a bit test: -ffast-math assumes comparisons never see a NaN
  for (int64_t i = 0; i < n; ++i) {
    const float v = to_float(row[i]);
    best = std::max(best, v);
    nan |= static_cast<uint32_t>((bits_of(v) & 0x7fffffffu) > 0x7f800000u);
  }
  if (nan != 0) {
    for (int64_t i = 0; i < n; ++i)
      if ((bits_of(to_float(row[i])) & 0x7fffffffu) > 0x7f800000u) return i;
  }
  constexpr int64_t kBlock = 64;
  for (int64_t start = 0; start < n; start += kBlock) {
    const int64_t end = std::min(n, start + kBlock);
    uint32_t hit = 0;
    for (int64_t i = start; i < end; ++i) hit |= static_cast<uint32_t>(to_float(row[i]) == best);
    if (hit == 0) continue;
    for (int64_t i = start; i < end; ++i)
      if (to_float(row[i]) == best) return i;
  }
  return 0;  // n == 0 is refused by the caller; not reached
}

}  // namespace

// logits [rows, vocab] float32 or bfloat16, contiguous -> [rows] int64
torch::Tensor row_argmax(const torch::Tensor& logits) {
  TORCH_CHECK(logits.device().is_cpu() && logits.dim() == 2 && logits.is_contiguous() && logits.size(1) >= 1,
              "row_argmax: logits must be a contiguous [rows, vocab >= 1] tensor on the CPU");
  const int64_t rows = logits.size(0), vocab = logits.size(1);
  auto out = torch::empty({rows}, logits.options().dtype(at::kLong));
  int64_t* ids = out.data_ptr<int64_t>();
  tinyserve::dispatch_float_types(logits, "row_argmax", [&](auto tag) {
    using T = decltype(tag);
    const T* data = logits.data_ptr<T>();
    at::parallel_for(0, rows, 4, [&](int64_t begin, int64_t end) {
      for (int64_t r = begin; r < end; ++r) ids[r] = row_argmax(data + r * vocab, vocab);
    });
  });
  return out;
}

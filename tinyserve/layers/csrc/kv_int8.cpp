// Writing a step's K or V into the 8-bit pool (`--kv-cache-dtype int8`): each token's head rounded to int8
// codes with one float16 scale, absmax / 127 of its row, scattered to its slot. One call per layer and
// tensor, where the torch formula (layers/kv_cache.py, quantize_rows then two index_copy_) is ~10 ops each:
// at batch 16 their dispatch alone was most of the int8 pool's extra cost (docs/PERFORMANCE.md, "8-bit KV
// cache").
//
// The values are the formula's exactly: scale = half(absmax * (1/127)), codes = round-half-even(x * (1 /
// float(scale))) clamped to +-127, a zero row has scale 0 and codes 0 (tests/test_kv_cache_int8.py).

#include <torch/extension.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>

namespace {

using tinyserve::to_float;

template <typename T>
void write_rows(const T* x, const int64_t* slots, int8_t* pool, at::Half* pool_scale, int64_t tokens, int64_t heads,
                int64_t dim, int64_t pool_rows) {
  constexpr float kInvMax = 1.f / 127.f;
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = x + (t * heads + h) * dim;
      float absmax = 0.f;
      for (int64_t i = 0; i < dim; ++i) absmax = std::max(absmax, std::fabs(to_float(row[i])));
      const at::Half scale = static_cast<at::Half>(absmax * kInvMax);
      const float scale32 = static_cast<float>(scale);
      const float inv = scale32 == 0.f ? 1.f : 1.f / scale32;
      const int64_t dest = h * pool_rows + slots[t];  // the slot's row in this head's part of the pool
      int8_t* codes = pool + dest * dim;
      for (int64_t i = 0; i < dim; ++i) {
        const float code = std::nearbyint(to_float(row[i]) * inv);  // the default mode: half to even
        codes[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
      }
      pool_scale[dest] = scale;
    }
  }
}

}  // namespace

// x [tokens, kv_heads, head_dim] float32 or bfloat16; pool [kv_heads, num_blocks, block_size, head_dim] int8;
// pool_scale [kv_heads, num_blocks, block_size] float16; slot_mapping [tokens] int64 (block * block_size +
// offset). Writes in place.
void write_kv_int8(const torch::Tensor& x, torch::Tensor& pool, torch::Tensor& pool_scale,
                   const torch::Tensor& slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && pool.dim() == 4 && pool_scale.dim() == 3 && slot_mapping.dim() == 1,
              "write_kv_int8: bad ranks");
  TORCH_CHECK(x.device().is_cpu() && pool.device().is_cpu() && pool_scale.device().is_cpu() &&
                  slot_mapping.device().is_cpu(),
              "write_kv_int8: all inputs must be on the CPU");
  TORCH_CHECK(x.is_contiguous() && pool.is_contiguous() && pool_scale.is_contiguous() && slot_mapping.is_contiguous(),
              "write_kv_int8: inputs must be contiguous");
  TORCH_CHECK(pool.scalar_type() == at::kChar && pool_scale.scalar_type() == at::kHalf &&
                  slot_mapping.scalar_type() == at::kLong,
              "write_kv_int8: pool int8, scales float16, slot_mapping int64");
  TORCH_CHECK(x.size(0) == slot_mapping.size(0) && x.size(1) == pool.size(0) && x.size(2) == pool.size(3) &&
                  pool_scale.sizes() == pool.sizes().slice(0, 3),
              "write_kv_int8: shapes do not match");
  const int64_t pool_rows = pool.size(1) * pool.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < x.size(0); ++t)  // the scatter is unchecked below
    TORCH_CHECK(slots[t] >= 0 && slots[t] < pool_rows, "write_kv_int8: slot_mapping[", t, "] = ", slots[t],
                " is outside the pool [0, ", pool_rows, ")");
  auto run = [&](auto* data) {
    write_rows(data, slots, pool.data_ptr<int8_t>(), pool_scale.data_ptr<at::Half>(), x.size(0), x.size(1),
               x.size(2), pool_rows);
  };
  if (x.scalar_type() == at::kFloat) {
    run(x.data_ptr<float>());
  } else {
    TORCH_CHECK(x.scalar_type() == at::kBFloat16, "write_kv_int8: x must be float32 or bfloat16");
    run(x.data_ptr<at::BFloat16>());
  }
}

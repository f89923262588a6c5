// Writing a step's K and V into the layer's pool, both in one call: copied into a float pool, or rounded
// into the 8-bit pool (`--kv-cache-dtype int8`), each token's head to int8 codes with one float16 scale,
// absmax / 127 of its row. Where the torch formula (layers/kv_cache.py) is two index_copy_ calls, and for
// the 8-bit pool ~10 ops per tensor, each with its dispatch and, for K and V views of the fused qkv
// output, a copy to make them contiguous (docs/PERFORMANCE.md, "8-bit KV cache" and "The step outside
// the kernels").
//
// The 8-bit values are the formula's exactly: scale = half(absmax * (1/127)), codes = round-half-even(x *
// (1 / float(scale))) clamped to +-127, a zero row has scale 0 and codes 0 (tests/test_kv_cache_int8.py).

#include <torch/extension.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <optional>

namespace {

using tinyserve::to_float;

// One token's head (dim values) into the int8 codes and float16 scale at its pool row.
template <typename T>
void quantize_row(const T* row, int8_t* codes, at::Half* scale_out, int64_t dim) {
  constexpr float kInvMax = 1.f / 127.f;
  float absmax = 0.f;
  for (int64_t i = 0; i < dim; ++i) absmax = std::max(absmax, std::fabs(to_float(row[i])));
  const at::Half scale = static_cast<at::Half>(absmax * kInvMax);
  const float scale32 = static_cast<float>(scale);
  const float inv = scale32 == 0.f ? 1.f : 1.f / scale32;
  for (int64_t i = 0; i < dim; ++i) {
    const float code = std::nearbyint(to_float(row[i]) * inv);  // the default mode: half to even
    codes[i] = static_cast<int8_t>(std::min(127.f, std::max(-127.f, code)));
  }
  *scale_out = scale;
}

// x [tokens, heads, dim] with strided rows -> its pool ([heads, pool_rows, dim]) at rows slots[t].
template <typename T>
void write_rows(const torch::Tensor& x, const int64_t* slots, torch::Tensor& pool,
                const std::optional<torch::Tensor>& pool_scale) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2), stride = x.stride(0);
  const int64_t pool_rows = pool.size(1) * pool.size(2);
  const T* data = x.data_ptr<T>();
  int8_t* codes = pool_scale.has_value() ? pool.data_ptr<int8_t>() : nullptr;
  at::Half* scales = pool_scale.has_value() ? pool_scale->data_ptr<at::Half>() : nullptr;
  T* values = pool_scale.has_value() ? nullptr : pool.data_ptr<T>();
  for (int64_t t = 0; t < tokens; ++t) {
    for (int64_t h = 0; h < heads; ++h) {
      const T* row = data + t * stride + h * dim;
      const int64_t dest = h * pool_rows + slots[t];  // the slot's row in this head's part of the pool
      if (codes != nullptr)
        quantize_row(row, codes + dest * dim, scales + dest, dim);
      else
        std::memcpy(values + dest * dim, row, dim * sizeof(T));
    }
  }
}

void check_side(const torch::Tensor& x, const torch::Tensor& pool, const std::optional<torch::Tensor>& pool_scale,
                const torch::Tensor& slot_mapping) {
  TORCH_CHECK(x.dim() == 3 && pool.dim() == 4, "write_kv: x must be [tokens, kv_heads, head_dim], pool 4-d");
  TORCH_CHECK(x.device().is_cpu() && pool.device().is_cpu(), "write_kv: all inputs must be on the CPU");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "write_kv: each token's heads must be contiguous");
  TORCH_CHECK(pool.is_contiguous(), "write_kv: the pool must be contiguous");
  TORCH_CHECK(x.size(0) == slot_mapping.size(0) && x.size(1) == pool.size(0) && x.size(2) == pool.size(3),
              "write_kv: shapes do not match");
  TORCH_CHECK(x.scalar_type() == at::kFloat || x.scalar_type() == at::kBFloat16,
              "write_kv: x must be float32 or bfloat16");
  if (pool_scale.has_value()) {
    TORCH_CHECK(pool.scalar_type() == at::kChar && pool_scale->scalar_type() == at::kHalf &&
                    pool_scale->device().is_cpu() && pool_scale->is_contiguous() &&
                    pool_scale->sizes() == pool.sizes().slice(0, 3),
                "write_kv: an 8-bit pool is int8 codes with contiguous float16 scales [kv_heads, blocks, block_size]");
  } else {
    TORCH_CHECK(pool.scalar_type() == x.scalar_type(), "write_kv: a float pool must be in x's dtype");
  }
}

}  // namespace

// key, value [tokens, kv_heads, head_dim] float32 or bfloat16 (rows may be strided: views of qkv);
// key_pool, value_pool [kv_heads, num_blocks, block_size, head_dim] in their dtype, or int8 with
// key_scale, value_scale [kv_heads, num_blocks, block_size] float16; slot_mapping [tokens] int64 (block *
// block_size + offset). Writes in place.
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_pool, torch::Tensor& value_pool,
              const torch::Tensor& slot_mapping, const std::optional<torch::Tensor>& key_scale,
              const std::optional<torch::Tensor>& value_scale) {
  TORCH_CHECK(slot_mapping.dim() == 1 && slot_mapping.device().is_cpu() && slot_mapping.is_contiguous() &&
                  slot_mapping.scalar_type() == at::kLong,
              "write_kv: slot_mapping must be a contiguous int64 vector on the CPU");
  TORCH_CHECK(key_scale.has_value() == value_scale.has_value(), "write_kv: both scales or neither");
  check_side(key, key_pool, key_scale, slot_mapping);
  check_side(value, value_pool, value_scale, slot_mapping);
  TORCH_CHECK(value.scalar_type() == key.scalar_type() && value_pool.sizes() == key_pool.sizes(),
              "write_kv: K and V must match");
  const int64_t pool_rows = key_pool.size(1) * key_pool.size(2);
  const int64_t* slots = slot_mapping.data_ptr<int64_t>();
  for (int64_t t = 0; t < slot_mapping.size(0); ++t)  // the scatter is unchecked below
    TORCH_CHECK(slots[t] >= 0 && slots[t] < pool_rows, "write_kv: slot_mapping[", t, "] = ", slots[t],
                " is outside the pool [0, ", pool_rows, ")");
  tinyserve::dispatch_float_types(key, "write_kv", [&](auto tag) {
    using T = decltype(tag);
    write_rows<T>(key, slots, key_pool, key_scale);
    write_rows<T>(value, slots, value_pool, value_scale);
  });
}

// The per-token elementwise work of a decoder layer, one call each on CPU: RMSNorm (with the residual
// add before it), rotary embedding, SiLU-and-multiply.
//
// Why: in eager torch each is 3-8 ops (casts, pow, mean, rsqrt, muls, roll, chunk), each a dispatch,
// an allocation and a pass over memory: ~25 ops per layer, a large share of a decode step
// (docs/PERFORMANCE.md, "Elementwise work in C++"). Each kernel rounds where the torch formula rounds
// (tinyserve/layers/ops.py), so the two paths agree to the last bit but for the order of float32 sums.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace {

using tinyserve::round_to;
using tinyserve::to_float;

// Rows split over threads only when there are enough elements to pay for waking the pool: about 8k (a
// batch of 16 rows of SmolLM2's 576 or 1536 values splits in two or more).
constexpr int64_t kElementsPerTask = 8192;

inline int64_t rows_per_task(int64_t width) { return std::max<int64_t>(1, kElementsPerTask / width); }

// out = weight * T(x / rms(x)), rms in float32; with a residual: residual = T(x + residual) first, and
// that sum is what is normalized (the pre-norm decoder's stream).
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, rows_per_task(width), [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      float sum_sq = 0.f;
      if (residual != nullptr) {
        T* res = residual + r * width;
        // two loops of one store each: a bfloat16 both stored and read back kept the one loop scalar
        for (int64_t i = 0; i < width; ++i) row[i] = to_float(round_to<T>(to_float(xr[i]) + to_float(res[i])));
        for (int64_t i = 0; i < width; ++i) res[i] = round_to<T>(row[i]);  // exact: row holds T's values
      } else {
        for (int64_t i = 0; i < width; ++i) row[i] = to_float(xr[i]);
      }
      for (int64_t i = 0; i < width; ++i) sum_sq += row[i] * row[i];
      const float inv_rms = 1.f / std::sqrt(sum_sq / static_cast<float>(width) + eps);
      T* o = out + r * width;
      for (int64_t i = 0; i < width; ++i)
        o[i] = round_to<T>(to_float(weight[i]) * to_float(round_to<T>(row[i] * inv_rms)));
    }
  });
}

// x [tokens, heads, head_dim] -> x * cos + rotate_half(x) * sin in place, with rotate_half's sign folded
// into sin (cos, sin [tokens, head_dim], as layers/rotary.py builds them). Each head is read into a float
// row first (the second half's result needs the first half's input); the two halves are separate loops
// so that each vectorizes (an index that wraps around at the half did not).
template <typename T>
void rotate_head(T* x, const T* c, const T* s, float* row, int64_t dim) {
  const int64_t half = dim / 2;
  for (int64_t i = 0; i < dim; ++i) row[i] = to_float(x[i]);
  // torch rounds each product and the sum to T: x * cos, roll(x) * sin, then their sum
  auto rotated = [&](int64_t i, float other) {
    const float a = to_float(round_to<T>(row[i] * to_float(c[i])));
    const float b = to_float(round_to<T>(other * to_float(s[i])));
    return round_to<T>(a + b);
  };
  for (int64_t i = 0; i < half; ++i) x[i] = rotated(i, row[i + half]);
  for (int64_t i = half; i < dim; ++i) x[i] = rotated(i, row[i - half]);
}

template <typename T>
void rotary_rows(T* q, int64_t q_stride, int64_t q_heads, T* k, int64_t k_stride, int64_t k_heads, const T* cos,
                 const T* sin, int64_t tokens, int64_t dim) {
  at::parallel_for(0, tokens, rows_per_task((q_heads + k_heads) * dim), [&](int64_t begin, int64_t end) {
    std::vector<float> row(dim);
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < q_heads; ++h) rotate_head(q + t * q_stride + h * dim, c, s, row.data(), dim);
      for (int64_t h = 0; h < k_heads; ++h) rotate_head(k + t * k_stride + h * dim, c, s, row.data(), dim);
    }
  });
}

// x [tokens, 2 * d] (gate, up) -> T(silu(gate)) * up, [tokens, d]
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, rows_per_task(d), [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const T* gate = x + r * 2 * d;
      const T* up = gate + d;
      T* o = out + r * d;
      for (int64_t i = 0; i < d; ++i) {
        const float g = to_float(gate[i]);
        const float silu = to_float(round_to<T>(g / (1.f + std::exp(-g))));
        o[i] = round_to<T>(silu * to_float(up[i]));
      }
    }
  });
}

// The kernels read rows of x.size(-1) elements by pointer and divide numel by that width: a width of 0
// (a model with hidden_size or intermediate_size 0) would divide by zero.
void check_rows(const torch::Tensor& x, const char* name) {
  TORCH_CHECK(x.device().is_cpu(), name, ": x must be on the CPU");
  TORCH_CHECK(x.is_contiguous() && x.dim() >= 1, name, ": x must be contiguous");
  TORCH_CHECK(x.size(-1) >= 1, name, ": the last dim of x must be >= 1");
}

// weight is read as weight[0 .. width - 1] by pointer: a strided or expanded view would be read wrong,
// or past its storage.
void check_weight(const torch::Tensor& weight, const torch::Tensor& x, const char* name) {
  TORCH_CHECK(weight.device().is_cpu() && weight.is_contiguous() && weight.scalar_type() == x.scalar_type() &&
                  weight.numel() == x.size(-1),
              name, ": bad weight (must be contiguous, on the CPU, x's dtype, x.size(-1) elements)");
}

}  // namespace

torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps) {
  check_rows(x, "rms_norm");
  check_weight(weight, x, "rms_norm");
  auto out = torch::empty_like(x);
  const int64_t width = x.size(-1);
  tinyserve::dispatch_float_types(x, "rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), nullptr, weight.data_ptr<T>(), out.data_ptr<T>(), x.numel() / width, width,
                     static_cast<float>(eps));
  });
  return out;
}

// residual += x (in place, rounded to the dtype), returns rms_norm(residual)
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps) {
  check_rows(x, "add_rms_norm");
  TORCH_CHECK(residual.device().is_cpu() && residual.is_contiguous() && residual.sizes() == x.sizes() &&
                  residual.scalar_type() == x.scalar_type(),
              "add_rms_norm: residual must match x");
  check_weight(weight, x, "add_rms_norm");
  auto out = torch::empty_like(x);
  const int64_t width = x.size(-1);
  tinyserve::dispatch_float_types(x, "add_rms_norm", [&](auto tag) {
    using T = decltype(tag);
    rms_norm_rows<T>(x.data_ptr<T>(), residual.data_ptr<T>(), weight.data_ptr<T>(), out.data_ptr<T>(),
                     x.numel() / width, width, static_cast<float>(eps));
  });
  return out;
}

// q and k may be views into the fused qkv output: their rows (tokens) may be strided, each row's heads
// contiguous. Both are rotated in place, in one call.
void rotary_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(q.device().is_cpu() && k.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rotary: inputs must be on the CPU");
  for (const auto* x : {&q, &k}) {
    TORCH_CHECK(x->dim() == 3 && x->size(2) >= 2 && x->size(2) % 2 == 0,
                "rotary: q and k must be [tokens, heads, even head_dim]");
    TORCH_CHECK(x->stride(2) == 1 && x->stride(1) == x->size(2), "rotary: each token's heads must be contiguous");
  }
  TORCH_CHECK(k.size(0) == q.size(0) && k.size(2) == q.size(2) && k.scalar_type() == q.scalar_type(),
              "rotary: q and k must have the same tokens, head_dim and dtype");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == q.size(0) * q.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == q.scalar_type() &&
                  sin.scalar_type() == q.scalar_type(),
              "rotary: cos and sin must be [tokens, head_dim] in q's dtype");
  tinyserve::dispatch_float_types(q, "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(q.data_ptr<T>(), q.stride(0), q.size(1), k.data_ptr<T>(), k.stride(0), k.size(1),
                   cos.data_ptr<T>(), sin.data_ptr<T>(), q.size(0), q.size(2));
  });
}

torch::Tensor silu_and_mul(const torch::Tensor& x) {
  check_rows(x, "silu_and_mul");
  TORCH_CHECK(x.size(-1) % 2 == 0, "silu_and_mul: last dim must be even");  // and >= 1 (check_rows): d >= 1
  auto sizes = x.sizes().vec();
  const int64_t d = sizes.back() / 2;
  sizes.back() = d;
  auto out = torch::empty(sizes, x.options());
  tinyserve::dispatch_float_types(x, "silu_and_mul", [&](auto tag) {
    using T = decltype(tag);
    silu_and_mul_rows<T>(x.data_ptr<T>(), out.data_ptr<T>(), x.numel() / (2 * d), d);
  });
  return out;
}

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

#include <cmath>
#include <vector>

namespace {

using tinyserve::round_to;
using tinyserve::to_float;

// Rows split over threads only when there are enough of them to pay for waking the pool.
constexpr int64_t kRowsPerTask = 16;

// out = weight * T(x / rms(x)), rms in float32; with a residual: residual = T(x + residual) first, and
// that sum is what is normalized (the pre-norm decoder's stream).
template <typename T>
void rms_norm_rows(const T* x, T* residual, const T* weight, T* out, int64_t rows, int64_t width, float eps) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
    std::vector<float> row(width);
    for (int64_t r = begin; r < end; ++r) {
      const T* xr = x + r * width;
      float sum_sq = 0.f;
      if (residual != nullptr) {
        T* res = residual + r * width;
        for (int64_t i = 0; i < width; ++i) {
          const T sum = round_to<T>(to_float(xr[i]) + to_float(res[i]));
          res[i] = sum;
          row[i] = to_float(sum);
        }
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

// x [tokens, heads, head_dim] -> x * cos + rotate_half(x) * sin, with rotate_half's sign folded into sin
// (cos, sin [tokens, head_dim], as layers/rotary.py builds them).
template <typename T>
void rotary_rows(const T* x, int64_t token_stride, const T* cos, const T* sin, T* out, int64_t tokens, int64_t heads,
                 int64_t dim) {
  const int64_t half = dim / 2;
  at::parallel_for(0, tokens, kRowsPerTask, [&](int64_t begin, int64_t end) {
    for (int64_t t = begin; t < end; ++t) {
      const T* c = cos + t * dim;
      const T* s = sin + t * dim;
      for (int64_t h = 0; h < heads; ++h) {
        const T* xr = x + t * token_stride + h * dim;
        T* o = out + (t * heads + h) * dim;
        for (int64_t i = 0; i < dim; ++i) {
          const float rolled = to_float(xr[i < half ? i + half : i - half]);
          // torch rounds each product and the sum to T: x * cos, roll(x) * sin, then their sum
          const float a = to_float(round_to<T>(to_float(xr[i]) * to_float(c[i])));
          const float b = to_float(round_to<T>(rolled * to_float(s[i])));
          o[i] = round_to<T>(a + b);
        }
      }
    }
  });
}

// x [tokens, 2 * d] (gate, up) -> T(silu(gate)) * up, [tokens, d]
template <typename T>
void silu_and_mul_rows(const T* x, T* out, int64_t rows, int64_t d) {
  at::parallel_for(0, rows, kRowsPerTask, [&](int64_t begin, int64_t end) {
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

// x may be a view into the fused qkv output: its rows (tokens) may be strided, each row's heads contiguous.
torch::Tensor rotary(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  TORCH_CHECK(x.device().is_cpu() && cos.device().is_cpu() && sin.device().is_cpu(),
              "rotary: inputs must be on the CPU");
  TORCH_CHECK(x.dim() == 3 && x.size(2) >= 2 && x.size(2) % 2 == 0,
              "rotary: x must be [tokens, heads, even head_dim]");
  TORCH_CHECK(x.stride(2) == 1 && x.stride(1) == x.size(2), "rotary: each token's heads must be contiguous");
  TORCH_CHECK(cos.is_contiguous() && sin.is_contiguous() && cos.numel() == x.size(0) * x.size(2) &&
                  sin.numel() == cos.numel() && cos.scalar_type() == x.scalar_type() &&
                  sin.scalar_type() == x.scalar_type(),
              "rotary: cos and sin must be [tokens, head_dim] in x's dtype");
  auto out = torch::empty_like(x);
  tinyserve::dispatch_float_types(x, "rotary", [&](auto tag) {
    using T = decltype(tag);
    rotary_rows<T>(x.data_ptr<T>(), x.stride(0), cos.data_ptr<T>(), sin.data_ptr<T>(), out.data_ptr<T>(), x.size(0),
                   x.size(1), x.size(2));
  });
  return out;
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

// float32 matmul for steps of a few tokens: out[t, n] = sum_k x[t, k] * w[n, k], w the plain [n, k] matrix.
//
// Why our own: torch's float32 GEMM reads the weights well below memory speed at 2-8 tokens, the rows of a
// speculative verify step (docs/PERFORMANCE.md, "A float32 kernel for steps of a few tokens"). The weight
// stays torch's [out, in] tensor, so F.linear still takes the large steps (prefill) from the same memory.
//
// A group of R output rows at a time: each vector of R rows' weights is loaded once and multiplied into T
// tokens' accumulators (T and R compile-time, so the accumulators are registers); tokens 8 at a time, the
// group's rows staying in cache between passes; the lanes summed once at the end of a row.

#include <torch/extension.h>

#include <algorithm>
#include <type_traits>

namespace {

#if defined(__AVX512F__)
constexpr int kLanes = 16;
#else
constexpr int kLanes = 8;  // AVX2: 16 vector registers, so 8-float vectors keep 8 tokens' sums in them
#endif
// a vector of kLanes floats that may be loaded from any float's address
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));

constexpr int kMaxTokens = 8;

template <int T, int R>
void rows(const float* w, const float* x, int64_t k, int64_t n, float* out) {
  // rows w[r * k ..] of the group, tokens x[t * k ..]; out[t * n + r]
  Lanes acc[T][R];
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) acc[t][r] = Lanes{};
  const int64_t body = k - k % kLanes;
  for (int64_t i = 0; i < body; i += kLanes) {
    Lanes weights[R];
    for (int r = 0; r < R; ++r) weights[r] = *reinterpret_cast<const Lanes*>(w + r * k + i);
    for (int t = 0; t < T; ++t) {
      const Lanes inputs = *reinterpret_cast<const Lanes*>(x + t * k + i);
      for (int r = 0; r < R; ++r) acc[t][r] += weights[r] * inputs;
    }
  }
  for (int t = 0; t < T; ++t)
    for (int r = 0; r < R; ++r) {
      float total = 0.f;
      for (int l = 0; l < kLanes; ++l) total += acc[t][r][l];
      for (int64_t i = body; i < k; ++i) total += w[r * k + i] * x[t * k + i];
      out[t * n + r] = total;
    }
}

// rows per group: more rows give the few-token sums more independent chains; fewer leave registers for
// more tokens' accumulators
template <int T>
constexpr int kGroupRows = T <= 2 ? 4 : T <= 4 ? 2 : 1;

template <int R>
void group(const float* w, const float* x, int64_t k, int64_t n, int64_t tokens, float* out) {
  for (int64_t t0 = 0; t0 < tokens; t0 += kMaxTokens) {
    const float* xt = x + t0 * k;
    float* o = out + t0 * n;
    switch (std::min<int64_t>(kMaxTokens, tokens - t0)) {
      case 1: rows<1, R>(w, xt, k, n, o); break;
      case 2: rows<2, R>(w, xt, k, n, o); break;
      case 3: rows<3, R>(w, xt, k, n, o); break;
      case 4: rows<4, R>(w, xt, k, n, o); break;
      case 5: rows<5, R>(w, xt, k, n, o); break;
      case 6: rows<6, R>(w, xt, k, n, o); break;
      case 7: rows<7, R>(w, xt, k, n, o); break;
      default: rows<8, R>(w, xt, k, n, o); break;
    }
  }
}

template <int R>
void all_rows(const float* w, const float* x, int64_t k, int64_t n, int64_t tokens, float* out) {
  const int64_t groups = n / R;
#pragma omp parallel for schedule(static)
  for (int64_t g = 0; g < groups; ++g) group<R>(w + g * R * k, x, k, n, tokens, out + g * R);
  for (int64_t row = groups * R; row < n; ++row) group<1>(w + row * k, x, k, n, tokens, out + row);
}

}  // namespace

torch::Tensor f32_matmul(const torch::Tensor& x, const torch::Tensor& weight) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == at::kFloat, "f32_matmul: x must be [tokens, in] float32");
  TORCH_CHECK(weight.dim() == 2 && weight.scalar_type() == at::kFloat && weight.is_contiguous(),
              "f32_matmul: weight must be [out, in] float32, contiguous");
  TORCH_CHECK(x.device().is_cpu() && weight.device().is_cpu(), "f32_matmul: inputs must be on the CPU");
  TORCH_CHECK(x.size(1) == weight.size(1), "f32_matmul: x has ", x.size(1), " inputs, the weight ", weight.size(1));
  const int64_t tokens = x.size(0), k = x.size(1), n = weight.size(0);
  const auto xc = x.contiguous();
  auto out = torch::empty({tokens, n}, x.options());
  if (tokens == 0 || n == 0) return out;
  const float* xp = xc.data_ptr<float>();
  const float* wp = weight.data_ptr<float>();
  float* op = out.data_ptr<float>();
  // the group size is chosen by the step's token count (its first pass of up to 8)
  switch (std::min<int64_t>(kMaxTokens, tokens)) {
    case 1: case 2: all_rows<kGroupRows<1>>(wp, xp, k, n, tokens, op); break;
    case 3: case 4: all_rows<kGroupRows<4>>(wp, xp, k, n, tokens, op); break;
    default: all_rows<kGroupRows<8>>(wp, xp, k, n, tokens, op); break;
  }
  return out;
}

// What the CPU kernels share: reading bfloat16 as float32, rounding back, and choosing the element type.
#pragma once

#include <torch/extension.h>

#include <cstring>

namespace tinyserve {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {  // bfloat16 is float32's top half: a shift the compiler vectorizes
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float f;
  std::memcpy(&f, &bits, sizeof(f));
  return f;
}

template <typename T>
inline T round_to(float x) { return static_cast<T>(x); }

// Round to nearest even, NaN to the quiet NaN: c10::BFloat16's own rounding, bit for bit, without its
// branch on NaN, so that loops that store bfloat16 vectorize (its constructor's branch kept them scalar).
template <>
inline c10::BFloat16 round_to<c10::BFloat16>(float x) {
  uint32_t bits;
  std::memcpy(&bits, &x, sizeof(bits));
  const uint32_t rounded = (bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16;
  const bool nan = (bits & 0x7fffffffu) > 0x7f800000u;  // a bit test: -ffast-math drops x != x
  return c10::BFloat16(static_cast<uint16_t>(nan ? 0x7fc0u : rounded), c10::BFloat16::from_bits());
}

// Calls run(T{}) with T the tensor's element type: float32 or bfloat16, the types the kernels are built for.
template <typename F>
void dispatch_float_types(const torch::Tensor& t, const char* name, F&& run) {
  if (t.scalar_type() == at::kBFloat16) run(c10::BFloat16{});
  else if (t.scalar_type() == at::kFloat) run(float{});
  else TORCH_CHECK(false, name, ": dtype ", t.scalar_type(), " is not supported");
}

}  // namespace tinyserve

// The Python module of our CPU kernels: tinyserve/layers/kernels/cpu_kernels.py builds and loads it.

#include <torch/extension.h>

#include <optional>
#include <vector>

torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const std::optional<torch::Tensor>& query_start_loc, double scale,
                              std::optional<int64_t> window, std::optional<double> soft_cap,
                              const std::optional<torch::Tensor>& key_scale,
                              const std::optional<torch::Tensor>& value_scale);
torch::Tensor rms_norm(const torch::Tensor& x, const torch::Tensor& weight, double eps);
torch::Tensor add_rms_norm(const torch::Tensor& x, torch::Tensor& residual, const torch::Tensor& weight, double eps);
void rotary_(torch::Tensor& q, torch::Tensor& k, const torch::Tensor& cos, const torch::Tensor& sin);
torch::Tensor silu_and_mul(const torch::Tensor& x);
torch::Tensor int4_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                          const std::optional<torch::Tensor>& minimums, int64_t out_features);
torch::Tensor bf16_matmul(const torch::Tensor& x, const torch::Tensor& weight, int64_t out_features);
torch::Tensor f32_matmul(const torch::Tensor& x, const torch::Tensor& weight);
torch::Tensor int8_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                          int64_t out_features);
torch::Tensor int8_channel_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                                  int64_t out_features);
torch::Tensor row_argmax(const torch::Tensor& logits);
bool w4a16_rounds_to_bfloat16();
torch::Tensor w4a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           const std::optional<torch::Tensor>& minimums, int64_t out_features);
torch::Tensor w8a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& scales,
                           int64_t out_features);
torch::Tensor w4a16_superblock_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& d,
                                      const torch::Tensor& dmin, const torch::Tensor& sub_scales,
                                      const torch::Tensor& sub_mins, int64_t out_features);
torch::Tensor w5a16_matmul(const torch::Tensor& x, const torch::Tensor& codes, const torch::Tensor& high_bits,
                           const torch::Tensor& scales, const std::optional<torch::Tensor>& minimums,
                           int64_t out_features);
torch::Tensor w5a16_superblock_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                                      const torch::Tensor& high_bits, const torch::Tensor& d,
                                      const torch::Tensor& dmin, const torch::Tensor& sub_scales,
                                      const torch::Tensor& sub_mins, int64_t out_features);
torch::Tensor w6a16_superblock_matmul(const torch::Tensor& x, const torch::Tensor& codes,
                                      const torch::Tensor& high_bits, const torch::Tensor& d,
                                      const torch::Tensor& sub_scales, int64_t out_features);
std::vector<torch::Tensor> q4_nibble_codes(const torch::Tensor& blocks, bool with_minimums);
std::vector<torch::Tensor> q45_k_codes(const torch::Tensor& blocks, bool five_bits);
std::vector<torch::Tensor> q6_k_codes(const torch::Tensor& blocks);
void apply_token_bitmask(torch::Tensor& logits, const torch::Tensor& bitmask, const torch::Tensor& rows);
void write_kv(const torch::Tensor& key, const torch::Tensor& value, torch::Tensor& key_pool, torch::Tensor& value_pool,
              const torch::Tensor& slot_mapping, const std::optional<torch::Tensor>& key_scale,
              const std::optional<torch::Tensor>& value_scale);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_attention", &paged_attention, "attention of decodes and prefill chunks over the paged KV pool",
        py::arg("q"), py::arg("key"), py::arg("value"), py::arg("block_tables"), py::arg("seq_lens"),
        py::arg("query_start_loc") = py::none(), py::arg("scale") = 1.0, py::arg("window") = py::none(),
        py::arg("soft_cap") = py::none(), py::arg("key_scale") = py::none(), py::arg("value_scale") = py::none());
  m.def("rms_norm", &rms_norm, "weight * x / rms(x)");
  m.def("add_rms_norm", &add_rms_norm, "residual += x in place, then rms_norm(residual)");
  m.def("rotary_", &rotary_, "q, k = x * cos + rotate_half(x) * sin, in place");
  m.def("silu_and_mul", &silu_and_mul, "silu(gate) * up");
  m.def("int4_matmul", &int4_matmul,
        "x times an int4 weight (groups of 32, float16 scale and minimum, or none: (code - 8) * scale)");
  m.def("bf16_matmul", &bf16_matmul, "x times a bfloat16 weight interleaved by 16 rows");
  m.def("f32_matmul", &f32_matmul, "x times a plain [out, in] float32 weight, for steps of a few tokens");
  m.def("int8_matmul", &int8_matmul, "x times an int8 weight (groups of 32, float16 scale)");
  m.def("int8_channel_matmul", &int8_channel_matmul, "x times an int8 weight with one scale per row, x rounded per token");
  m.def("write_kv", &write_kv, "K and V into their slots of the pool (an 8-bit pool's rounded, with a scale per row)",
        py::arg("key"), py::arg("value"), py::arg("key_pool"), py::arg("value_pool"), py::arg("slot_mapping"),
        py::arg("key_scale") = py::none(), py::arg("value_scale") = py::none());
  m.def("w4a16_rounds_to_bfloat16", &w4a16_rounds_to_bfloat16,
        "whether the W4A16 kernels of 4- to 6-bit codes round x to bfloat16 (the fold, on AVX512-BF16 CPUs)");
  m.def("w4a16_matmul", &w4a16_matmul, "x times an int4 weight, x as it is (float32 sums of widened weights; AVX512-BF16: a16_fold.h)");
  m.def("w8a16_matmul", &w8a16_matmul, "x times an int8 weight, x as it is (float32 sums of widened weights)");
  m.def("w4a16_superblock_matmul", &w4a16_superblock_matmul,
        "x times a GGUF Q4_K weight (super-blocks of 256: d, dmin, 6-bit scales and mins), x as it is");
  m.def("w5a16_matmul", &w5a16_matmul,
        "x times a GGUF Q5_0 / Q5_1 weight (5-bit codes, groups of 32: scale and minimum, or none (Q5_0): "
        "(code - 16) * scale), x as it is");
  m.def("w5a16_superblock_matmul", &w5a16_superblock_matmul,
        "x times a GGUF Q5_K weight (5-bit codes, Q4_K's super-block scales), x as it is");
  m.def("w6a16_superblock_matmul", &w6a16_superblock_matmul,
        "x times a GGUF Q6_K weight (6-bit codes, d per 256 inputs, int8 scales per 16), x as it is");
  m.def("q4_nibble_codes", &q4_nibble_codes,
        "a GGUF Q4_0 / Q4_1 tensor's blocks -> the int4 kernels' nibble order, scales (and Q4_1's minimums)");
  m.def("q45_k_codes", &q45_k_codes,
        "a GGUF Q4_K / Q5_K tensor's super-blocks -> codes in the int4 kernels' nibble order, d, dmin, the "
        "sub-blocks' scales and minimums (and Q5_K's high bits in the kernels' plane)");
  m.def("q6_k_codes", &q6_k_codes,
        "a GGUF Q6_K tensor's super-blocks -> low 4 bits in the int4 kernels' nibble order, the high 2 bits' "
        "plane, d, int8 scales");
  m.def("row_argmax", &row_argmax, "each row's first index of its largest value (NaN the largest), as torch.argmax");
  m.def("apply_token_bitmask", &apply_token_bitmask, "-inf on the logits of tokens a grammar's bitmask forbids");
}

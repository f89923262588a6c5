// Decode attention over the paged KV pool on CPU: one query token per sequence, read K and V in place.
//
// Why a kernel of our own: with torch ops, a decode step gathers every sequence's K blocks into a copy
// (index_select), multiplies it in small batched matmuls of 3 query rows, adds a padding mask, softmaxes
// and sums V: K crosses memory three times and every op is paid once per layer. Here each
// (sequence, kv head) job walks its block table once: the group's query heads are dotted with each K row
// as it is read, softmaxed in float32, and V rows are accumulated as they are read. No copy, no padding,
// one call per layer.
//
// Layout (tinyserve/layers/attention.py): pool [kv_heads, num_blocks, block_size, head_dim]; query head
// h reads kv head h / (heads / kv_heads). Scores, softmax and sums are float32 whatever the pool's dtype.
//
// An int8 pool (`--kv-cache-dtype int8`) holds codes with one float16 scale per row (token and kv head):
// a row is code x scale, so a K row's scale multiplies its dot products and a V row's its softmax weight,
// one multiply per row and group head, and the inner loops are the same as over a float pool.
//
// Sliding window W (a layer's, or none): the token at position len - 1 attends to positions
// max(0, len - W) .. len - 1. The walk starts at the block holding the first of them, so the blocks
// before the window are never read.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_types.h"

#include <algorithm>
#include <cmath>
#include <optional>
#include <vector>

namespace {

using tinyserve::to_float;

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, num_blocks, block_size, table_stride;
  float scale;
  std::optional<int64_t> window;  // keys per query, itself included; none: the whole sequence

  int64_t first_key(int64_t len) const { return window ? std::max<int64_t>(0, len - *window) : 0; }
};

inline float to_float(int8_t x) { return static_cast<float>(x); }

// D is a template parameter so that the per-row loops have a fixed trip count and vectorize. KV is the
// pool's element type: T, or int8_t with key_scale / value_scale (one per row), which are null otherwise.
template <typename T, typename KV, int D>
void decode_attention(const T* q, const KV* key, const KV* value, const at::Half* key_scale,
                      const at::Half* value_scale, const int64_t* tables, const int64_t* seq_lens, T* out,
                      const Shape& s) {
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t num_jobs = s.num_seqs * s.num_kv_heads;
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_jobs);
  // Sequences come longest first; jobs are dealt round-robin so that each thread gets long and short ones
  // (parallel_for's contiguous ranges would give one thread all the long ones).
  at::parallel_for(0, num_threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    std::vector<float> scores, query(group * D), acc(group * D), inv_sum(group);
    for (int64_t thread = first_thread; thread < last_thread; ++thread) {
      for (int64_t job = thread; job < num_jobs; job += num_threads) {
        const int64_t seq = job / s.num_kv_heads, kv_head = job % s.num_kv_heads, end = seq_lens[seq];
        const int64_t begin = s.first_key(end), len = end - begin;  // keys begin .. end - 1, as t = 0 .. len - 1
        const int64_t* table = tables + seq * s.table_stride;
        const int64_t pool_rows = kv_head * s.num_blocks;  // first block of this kv head in the pool
        // Walk block by block from the window's first block, token by token within a block: no division
        // per token. visit(t, row, scale): the row's elements and its scale (1 in a float pool).
        auto for_each_row = [&](const KV* pool, const at::Half* pool_scale, auto&& visit) {
          const int64_t end_block = (end + s.block_size - 1) / s.block_size;
          const int64_t block_bytes = s.block_size * D * static_cast<int64_t>(sizeof(KV));
          for (int64_t b = begin / s.block_size; b < end_block; ++b) {
            const int64_t block_row = (pool_rows + table[b]) * s.block_size;  // the block's first row
            const KV* block = pool + block_row * D;
            if (b + 1 < end_block) {  // blocks are scattered: fetch the next one while this one is used
              const char* next = reinterpret_cast<const char*>(pool + (pool_rows + table[b + 1]) * s.block_size * D);
              for (int64_t byte = 0; byte < block_bytes; byte += 64) __builtin_prefetch(next + byte);
            }
            const int64_t first = b * s.block_size;
            const int64_t i0 = std::max(begin, first) - first, n = std::min(s.block_size, end - first);
            for (int64_t i = i0; i < n; ++i)
              visit(first + i - begin, block + i * D, pool_scale ? static_cast<float>(pool_scale[block_row + i]) : 1.f);
          }
        };
        for (int64_t g = 0; g < group; ++g)
          for (int d = 0; d < D; ++d)
            query[g * D + d] = to_float(q[(seq * s.num_heads + kv_head * group + g) * D + d]) * s.scale;

        scores.resize(group * len);  // [group, len]
        for_each_row(key, key_scale, [&](int64_t t, const KV* k, float row_scale) {
          float k32[D];
          for (int d = 0; d < D; ++d) k32[d] = to_float(k[d]);
          for (int64_t g = 0; g < group; ++g) {
            float dot = 0.f;
            for (int d = 0; d < D; ++d) dot += query[g * D + d] * k32[d];
            scores[g * len + t] = dot * row_scale;
          }
        });
        for (int64_t g = 0; g < group; ++g) {  // softmax numerators in place, 1 / denominator kept
          float* sc = scores.data() + g * len;
          float max = sc[0];
          for (int64_t t = 1; t < len; ++t) max = std::max(max, sc[t]);
          float sum = 0.f;
          for (int64_t t = 0; t < len; ++t) {
            sc[t] = std::exp(sc[t] - max);
            sum += sc[t];
          }
          inv_sum[g] = 1.f / sum;
        }
        std::fill(acc.begin(), acc.end(), 0.f);
        for_each_row(value, value_scale, [&](int64_t t, const KV* v, float row_scale) {
          float v32[D];
          for (int d = 0; d < D; ++d) v32[d] = to_float(v[d]);
          for (int64_t g = 0; g < group; ++g) {
            const float w = scores[g * len + t] * row_scale;
            for (int d = 0; d < D; ++d) acc[g * D + d] += w * v32[d];
          }
        });
        for (int64_t g = 0; g < group; ++g)
          for (int d = 0; d < D; ++d)
            out[(seq * s.num_heads + kv_head * group + g) * D + d] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
      }
    }
  });
}

template <typename T, typename KV>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                       const at::Half* key_scale, const at::Half* value_scale, const torch::Tensor& tables,
                       const torch::Tensor& seq_lens, torch::Tensor& out, const Shape& s) {
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<T>(), key.data_ptr<KV>(), value.data_ptr<KV>(), key_scale, value_scale,
           tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), out.data_ptr<T>(), s);
  };
  switch (q.size(2)) {
    case 16: run(decode_attention<T, KV, 16>); break;
    case 32: run(decode_attention<T, KV, 32>); break;
    case 64: run(decode_attention<T, KV, 64>); break;
    case 128: run(decode_attention<T, KV, 128>); break;
    case 256: run(decode_attention<T, KV, 256>); break;
    default: TORCH_CHECK(false, "paged_decode_attention: head_dim ", q.size(2), " is not compiled in");
  }
}

// Every block a sequence reads must lie in the pool and every length within its table: the kernel indexes
// the pool with them unchecked, so a scheduler bug would read (and, through the prefetch, touch) memory
// outside it instead of raising. One pass over the tables' used entries, O(num_seqs x blocks per
// sequence) integer compares, nothing per token.
void check_tables(const int64_t* tables, const int64_t* seq_lens, const Shape& s, int64_t table_width) {
  const int64_t max_len = table_width * s.block_size;
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = seq_lens[seq];
    TORCH_CHECK(len >= 1 && len <= max_len, "paged_decode_attention: seq_lens[", seq, "] = ", len,
                " is outside [1, ", max_len, "] (block table width ", table_width, " x block_size ", s.block_size, ")");
    const int64_t* table = tables + seq * s.table_stride;
    for (int64_t b = s.first_key(len) / s.block_size, used = (len + s.block_size - 1) / s.block_size; b < used; ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < s.num_blocks, "paged_decode_attention: block_tables[", seq, "][", b,
                  "] = ", table[b], " is outside the pool [0, ", s.num_blocks, ")");
  }
}

}  // namespace

// q [num_seqs, heads, head_dim]; key/value [kv_heads, num_blocks, block_size, head_dim];
// block_tables [num_seqs, >= blocks used] int64; seq_lens [num_seqs] int64 (>= 1, this token included);
// window: the layer's sliding window (>= 1), or none for full attention; key_scale / value_scale: an int8
// pool's [kv_heads, num_blocks, block_size] float16 row scales, none for a pool of q's dtype.
torch::Tensor paged_decode_attention(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                                     const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                                     double scale, std::optional<int64_t> window,
                                     const std::optional<torch::Tensor>& key_scale,
                                     const std::optional<torch::Tensor>& value_scale) {
  TORCH_CHECK(q.dim() == 3 && key.dim() == 4 && key.sizes() == value.sizes() && block_tables.dim() == 2 &&
                  seq_lens.dim() == 1,
              "paged_decode_attention: bad ranks");
  TORCH_CHECK(q.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_decode_attention: all inputs must be on the CPU");
  TORCH_CHECK(q.is_contiguous() && key.is_contiguous() && value.is_contiguous() && seq_lens.is_contiguous() &&
                  block_tables.stride(1) == 1,
              "paged_decode_attention: inputs must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "paged_decode_attention: key and value must share a dtype");
  const bool int8_pool = key.scalar_type() == at::kChar;
  TORCH_CHECK(int8_pool || q.scalar_type() == key.scalar_type(),
              "paged_decode_attention: a float pool must have q's dtype (or the pool is int8 with scales)");
  TORCH_CHECK(int8_pool == (key_scale.has_value() && value_scale.has_value()) &&
                  key_scale.has_value() == value_scale.has_value(),
              "paged_decode_attention: an int8 pool needs key_scale and value_scale, a float pool neither");
  if (int8_pool) {
    for (const auto* t : {&*key_scale, &*value_scale})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->device().is_cpu() &&
                      t->sizes() == key.sizes().slice(0, 3),
                  "paged_decode_attention: scales must be contiguous float16 [kv_heads, num_blocks, block_size]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_decode_attention: block_tables and seq_lens must be int64");
  // sizes the kernel divides by or walks with: a malformed model or pool could make any of them 0
  TORCH_CHECK(q.size(1) >= 1 && key.size(0) >= 1 && key.size(1) >= 1 && key.size(2) >= 1,
              "paged_decode_attention: heads, kv_heads, num_blocks and block_size must be >= 1");
  TORCH_CHECK(q.size(1) % key.size(0) == 0 && q.size(2) == key.size(3) && block_tables.size(0) == q.size(0) &&
                  seq_lens.size(0) == q.size(0),
              "paged_decode_attention: shapes do not match");
  TORCH_CHECK(!window || *window >= 1, "paged_decode_attention: window must be >= 1, got ", window.value_or(0));
  auto out = torch::empty_like(q);
  const Shape s{q.size(0), q.size(1), key.size(0), key.size(1), key.size(2), block_tables.stride(0),
                static_cast<float>(scale), window};
  check_tables(block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), s, block_tables.size(1));
  tinyserve::dispatch_float_types(q, "paged_decode_attention", [&](auto tag) {
    using T = decltype(tag);
    if (int8_pool)
      dispatch_head_dim<T, int8_t>(q, key, value, key_scale->data_ptr<at::Half>(), value_scale->data_ptr<at::Half>(),
                                   block_tables, seq_lens, out, s);
    else
      dispatch_head_dim<T, T>(q, key, value, nullptr, nullptr, block_tables, seq_lens, out, s);
  });
  return out;
}

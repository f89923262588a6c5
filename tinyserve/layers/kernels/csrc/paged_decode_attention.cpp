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

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
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

// 8 floats, an AVX2 register (AVX-512 machines run the same lanes, so the sums are the same on both), loadable
// from any float's address. A row of head_dim D is D / 8 of them (D >= 16).
constexpr int kLanes = 8;
typedef float Lanes __attribute__((vector_size(kLanes * sizeof(float)), aligned(alignof(float))));

inline Lanes load_lanes(const float* p) { return *reinterpret_cast<const Lanes*>(p); }

// A pair: 16 elements of a pool row widened to two Lanes of float32 (exact). A float32 or int8 row keeps its
// order (int8: a sign-extension and a conversion a Lanes). A bfloat16 row does not: bfloat16 is float32's top
// half, so each 32-bit word of two elements gives its even one by a shift and its odd one by a mask, 8 + 8 in
// two instructions and no shuffle; the pair's first Lanes holds its elements 0, 2, .., 14 and the second 1, 3,
// .., 15. pair_source says where element j of a widened row came from: the query is laid out in that order
// before its dots, and each head's output taken back out of it.
inline void load_pair(const float* p, Lanes& first, Lanes& second) {
  first = load_lanes(p);
  second = load_lanes(p + kLanes);
}
inline void load_pair(const int8_t* p, Lanes& first, Lanes& second) {
#if defined(__AVX2__)
  first = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p))));
  second = _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(p + kLanes))));
#else
  for (int l = 0; l < kLanes; ++l) first[l] = static_cast<float>(p[l]), second[l] = static_cast<float>(p[kLanes + l]);
#endif
}
inline void load_pair(const c10::BFloat16* p, Lanes& first, Lanes& second) {
#if defined(__AVX2__)
  const __m256i words = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  first = reinterpret_cast<Lanes>(_mm256_slli_epi32(words, 16));
  second = reinterpret_cast<Lanes>(_mm256_and_si256(words, _mm256_set1_epi32(static_cast<int>(0xffff0000u))));
#else
  for (int l = 0; l < kLanes; ++l) first[l] = to_float(p[2 * l]), second[l] = to_float(p[2 * l + 1]);
#endif
}
template <typename KV>
inline int pair_source(int j) {
  if constexpr (!std::is_same_v<KV, c10::BFloat16>) return j;
  const int w = j % (2 * kLanes);
  return j - w + (w < kLanes ? 2 * w : 2 * (w - kLanes) + 1);
}

inline float sum_lanes(Lanes v) {  // ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7))
  typedef float Half __attribute__((vector_size(16)));
  Half h = __builtin_shufflevector(v, v, 0, 1, 2, 3) + __builtin_shufflevector(v, v, 4, 5, 6, 7);
  h += __builtin_shufflevector(h, h, 2, 3, 0, 1);
  return h[0] + h[1];
}

// Accumulators a V pass keeps in registers: up to this many Lanes of one query head's output at a time.
constexpr int kChunk = 8;

// D is a template parameter so that a row is a fixed number of Lanes. KV is the pool's element type: T, or
// int8_t with key_scale / value_scale (one per row), which are null otherwise.
//
// A job is (sequence, kv head). K pass: each K row is widened once into registers and dotted with the group's
// query heads (two accumulators a dot). Softmax over each head's scores. V pass, block by block: the block's
// rows are widened into an L1 scratch once, then each head's output, kChunk Lanes at a time, stays in
// registers over the block's rows (one broadcast weight a row and head, one FMA a Lanes).
template <typename T, typename KV, int D>
void decode_attention(const T* q, const KV* key, const KV* value, const at::Half* key_scale,
                      const at::Half* value_scale, const int64_t* tables, const int64_t* seq_lens, T* out,
                      const Shape& s) {
  static_assert(D % (2 * kLanes) == 0, "a row is an even number of Lanes");
  constexpr int kRowLanes = D / kLanes;
  constexpr int kChunkLanes = kRowLanes < kChunk ? kRowLanes : kChunk;
  const int64_t group = s.num_heads / s.num_kv_heads;
  const int64_t num_jobs = s.num_seqs * s.num_kv_heads;
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_jobs);
  // Sequences come longest first; jobs are dealt round-robin so that each thread gets long and short ones
  // (parallel_for's contiguous ranges would give one thread all the long ones).
  at::parallel_for(0, num_threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    std::vector<float> scores, query(group * D), acc(group * D), inv_sum(group), rows(s.block_size * D),
        weights(s.block_size);
    for (int64_t thread = first_thread; thread < last_thread; ++thread) {
      for (int64_t job = thread; job < num_jobs; job += num_threads) {
        const int64_t seq = job / s.num_kv_heads, kv_head = job % s.num_kv_heads, end = seq_lens[seq];
        const int64_t begin = s.first_key(end), len = end - begin;  // keys begin .. end - 1, as t = 0 .. len - 1
        const int64_t* table = tables + seq * s.table_stride;
        const int64_t pool_rows = kv_head * s.num_blocks;  // first block of this kv head in the pool
        // Walk block by block from the window's first block: visit(t, rows, n, scales) gets the block's rows
        // of t .. t + n - 1 and their scales (null in a float pool). No division per token.
        auto for_each_block = [&](const KV* pool, const at::Half* pool_scale, auto&& visit) {
          const int64_t end_block = (end + s.block_size - 1) / s.block_size;
          const int64_t block_bytes = s.block_size * D * static_cast<int64_t>(sizeof(KV));
          for (int64_t b = begin / s.block_size; b < end_block; ++b) {
            const int64_t block_row = (pool_rows + table[b]) * s.block_size;  // the block's first row
            if (b + 1 < end_block) {  // blocks are scattered: fetch the next one while this one is used
              const char* next = reinterpret_cast<const char*>(pool + (pool_rows + table[b + 1]) * s.block_size * D);
              for (int64_t byte = 0; byte < block_bytes; byte += 64) __builtin_prefetch(next + byte);
            }
            const int64_t first = b * s.block_size;
            const int64_t i0 = std::max(begin, first) - first, n = std::min(s.block_size, end - first);
            visit(first + i0 - begin, pool + (block_row + i0) * D, n - i0,
                  pool_scale ? pool_scale + block_row + i0 : nullptr);
          }
        };
        const int64_t heads_at = (seq * s.num_heads + kv_head * group) * D;  // the group's first head in q and out
        for (int64_t g = 0; g < group; ++g)
          for (int d = 0; d < D; ++d) query[g * D + d] = to_float(q[heads_at + g * D + pair_source<KV>(d)]) * s.scale;

        scores.resize(group * len);  // [group, len]
        for_each_block(key, key_scale, [&](int64_t t0, const KV* block, int64_t n, const at::Half* row_scales) {
          for (int64_t i = 0; i < n; ++i) {
            Lanes k[kRowLanes];
            for (int l = 0; l < kRowLanes; l += 2) load_pair(block + i * D + l * kLanes, k[l], k[l + 1]);
            const float row_scale = row_scales ? static_cast<float>(row_scales[i]) : 1.f;
            for (int64_t g = 0; g < group; ++g) {
              const float* qg = query.data() + g * D;
              Lanes even = load_lanes(qg) * k[0], odd = load_lanes(qg + kLanes) * k[1];
              for (int l = 2; l < kRowLanes; l += 2) {
                even += load_lanes(qg + l * kLanes) * k[l];
                odd += load_lanes(qg + (l + 1) * kLanes) * k[l + 1];
              }
              scores[g * len + t0 + i] = sum_lanes(even + odd) * row_scale;
            }
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
        for_each_block(value, value_scale, [&](int64_t t0, const KV* block, int64_t n, const at::Half* row_scales) {
          const float* v = nullptr;  // the block's rows in float32
          if constexpr (std::is_same_v<KV, float>) {
            v = block;
          } else {
            for (int64_t i = 0; i < n * kRowLanes; i += 2) {
              Lanes first, second;
              load_pair(block + i * kLanes, first, second);
              *reinterpret_cast<Lanes*>(rows.data() + i * kLanes) = first;
              *reinterpret_cast<Lanes*>(rows.data() + (i + 1) * kLanes) = second;
            }
            v = rows.data();
          }
          for (int64_t g = 0; g < group; ++g) {
            const float* w = scores.data() + g * len + t0;
            if (row_scales) {  // an int8 row is code x scale: the scale goes into the row's weight
              for (int64_t i = 0; i < n; ++i) weights[i] = w[i] * static_cast<float>(row_scales[i]);
              w = weights.data();
            }
            for (int c = 0; c < kRowLanes; c += kChunkLanes) {
              float* out_lanes = acc.data() + g * D + c * kLanes;
              Lanes sum[kChunkLanes];
              for (int l = 0; l < kChunkLanes; ++l) sum[l] = load_lanes(out_lanes + l * kLanes);
              for (int64_t i = 0; i < n; ++i)
                for (int l = 0; l < kChunkLanes; ++l) sum[l] += w[i] * load_lanes(v + i * D + (c + l) * kLanes);
              for (int l = 0; l < kChunkLanes; ++l) *reinterpret_cast<Lanes*>(out_lanes + l * kLanes) = sum[l];
            }
          }
        });
        for (int64_t g = 0; g < group; ++g)
          for (int d = 0; d < D; ++d)
            out[heads_at + g * D + pair_source<KV>(d)] = static_cast<T>(acc[g * D + d] * inv_sum[g]);
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

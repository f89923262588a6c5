// Attention over the paged KV pool on CPU, every sequence of a step in one call: decodes (one query token) and
// prefill chunks (many), reading K and V in place.
//
// Why a kernel of our own: with torch ops, a decode step gathers every sequence's K blocks into a copy
// (index_select), multiplies it in small batched matmuls of 3 query rows, adds a padding mask, softmaxes
// and sums V: K crosses memory three times and every op is paid once per layer; a prefill chunk after a
// cached prefix gathered the whole prefix into a copy for SDPA. Here each job, (sequence, kv head, a tile of
// up to kTile of its queries), walks its block table once: the tile's query heads are dotted with each K row
// as it is read, softmaxed in float32, and V rows are accumulated as they are read. No copy, no padding,
// one call per layer.
//
// A query's output does not depend on the step it is in. Its keys are visited in the order of their
// positions, its dot products, its softmax and its sums are the same instructions in the same order whether
// it is a decode, one query of a prefill tile, or the last query of a chunk that follows a cached prefix, and
// no code path depends on the tile's other queries or its span: float32 tokens are the same bits across
// batching, chunking and prefix-cache hits (tests/test_attention.py checks it). So this file is built without
// -ffast-math (which let the compiler vectorize a loop's sums and expf with a peel and remainder that depend on
// where the loop starts), and exp is our own, lane by lane the same polynomial.
//
// Layout (tinyserve/layers/attention.py): pool [kv_heads, num_blocks, block_size, head_dim]; query head
// h reads kv head h / (heads / kv_heads). Scores, softmax and sums are float32 whatever the pool's dtype.
//
// An int8 pool (`--kv-cache-dtype int8`) holds codes with one float16 scale per row (token and kv head):
// a row is code x scale, so a K row's scale multiplies its dot products and a V row's its softmax weight,
// one multiply per row and group head, and the inner loops are the same as over a float pool.
//
// Sliding window W (a layer's, or none): the query at position p attends to positions max(0, p + 1 - W) .. p.
// The walk starts at the block holding the first of them, so the blocks before the window are never read.
// Logit soft-cap c (Gemma 2's, or none): a score s becomes c * tanh(s / c) before the softmax.

#include <torch/extension.h>
#include <ATen/Parallel.h>

#include "float_types.h"

#include <immintrin.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <type_traits>
#include <vector>

// See the header: the same instructions for a query whatever its step. Products still fuse into FMAs.
#pragma GCC optimize("no-fast-math", "fp-contract=fast")

namespace {

using tinyserve::to_float;

struct Shape {
  int64_t num_seqs, num_heads, num_kv_heads, num_blocks, block_size, table_stride;
  float scale;
  std::optional<int64_t> window;  // keys per query, itself included; none: the whole sequence
  std::optional<float> soft_cap;  // c: a score s becomes c * tanh(s / c); none: left as it is

  // the first key of the query at position `position`
  int64_t first_key(int64_t position) const { return window ? std::max<int64_t>(0, position + 1 - *window) : 0; }
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

// A query head's dot with a K row before its horizontal sum: two chains (even and odd Lanes), then their sum.
// k_lane(l) gives the row's Lanes l (from registers or from memory); both K passes call this, so a score is
// the same instructions either way.
template <int kRowLanes, class KLane>
inline Lanes dot_lanes(const float* q, KLane&& k_lane) {
  Lanes even = load_lanes(q) * k_lane(0), odd = load_lanes(q + kLanes) * k_lane(1);
  for (int l = 2; l < kRowLanes; l += 2) {
    even += load_lanes(q + l * kLanes) * k_lane(l);
    odd += load_lanes(q + (l + 1) * kLanes) * k_lane(l + 1);
  }
  return even + odd;
}

#if defined(__AVX2__)
// sum_lanes of eight vectors at once: lane r of the result is sum_lanes(v[r]), the same additions in the same
// pairs ((l0 + l4) + (l2 + l6)) + ((l1 + l5) + (l3 + l7)), in three steps of two shuffles and an add.
inline Lanes sum8(const Lanes* v) {
  auto m = [](Lanes x) { return reinterpret_cast<__m256>(x); };
  // lanes l + l4 of two vectors side by side: [a0+a4 .. a3+a7 | b0+b4 .. b3+b7], for (a, b) = (v0, v4), ...
  auto halves = [&](Lanes a, Lanes b) {
    return _mm256_add_ps(_mm256_permute2f128_ps(m(a), m(b), 0x20), _mm256_permute2f128_ps(m(a), m(b), 0x31));
  };
  const __m256 x04 = halves(v[0], v[4]), x15 = halves(v[1], v[5]), x26 = halves(v[2], v[6]), x37 = halves(v[3], v[7]);
  // (l0+l4) + (l2+l6) and (l1+l5) + (l3+l7): [v0's, v0's', v1's, v1's' | v4's, v4's', v5's, v5's']
  const __m256 w0 = _mm256_add_ps(_mm256_shuffle_ps(x04, x15, 0x44), _mm256_shuffle_ps(x04, x15, 0xEE));
  const __m256 w1 = _mm256_add_ps(_mm256_shuffle_ps(x26, x37, 0x44), _mm256_shuffle_ps(x26, x37, 0xEE));
  // the two halves of each: [v0, v1, v2, v3 | v4, v5, v6, v7]
  return reinterpret_cast<Lanes>(_mm256_add_ps(_mm256_shuffle_ps(w0, w1, 0x88), _mm256_shuffle_ps(w0, w1, 0xDD)));
}
#endif

// Accumulators a V pass keeps in registers: up to this many Lanes of one query head's output at a time.
constexpr int kChunk = 8;
// Queries of one sequence in a job: they share each K and V row as it is read (a decode is a tile of one).
constexpr int kTile = 16;

// exp(x), lane by lane, for x <= 0 (a score minus its row's largest): x = n ln 2 + r with |r| <= ln 2 / 2, e^r
// by Cephes' degree-6 polynomial (~1 ulp), 2^n into the exponent bits. Below -87 (where e^x leaves float32's
// normal range) it is e^-87, ~1e-38: nothing next to the row's largest term, 1. The same instructions in every
// lane, so a score's exp does not depend on where it sits in the vector.
inline Lanes exp_lanes(Lanes x) {
  typedef int32_t Ints __attribute__((vector_size(kLanes * sizeof(int32_t))));
  const Lanes floor = Lanes{} - 87.f;
  x = x < floor ? floor : x;
  const Lanes shifter = Lanes{} + 12582912.f;  // 1.5 x 2^23: adding it rounds to an integer, to nearest even
  const Lanes t = x * 1.44269504088896341f + shifter;
  const Lanes n = t - shifter;
  const Lanes r = x - n * 0.693359375f + n * 2.12194440e-4f;
  Lanes p = r * 1.9875691500e-4f + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  const Lanes e_r = p * (r * r) + r + 1.f;
  const Ints two_n = (reinterpret_cast<const Ints&>(t) - 0x4B400000 + 127) << 23;  // t's low bits hold n
  return e_r * reinterpret_cast<const Lanes&>(two_n);
}

// A query head's scores sc[0 .. n - 1] (n >= 1) -> their softmax numerators exp(s - max), in place; returns 1 / their
// sum. Sixteen scores a pass from sc[0], the sums kept per lane (two vectors), then eight, the lanes and the tail
// in order: the same arithmetic for the same scores wherever they are.
inline float softmax_numerators(float* sc, int64_t n) {
  float max = sc[0];  // the largest score: exact in any order
  int64_t t = 0;
  if (n >= kLanes) {
    Lanes lanes_max = load_lanes(sc);
    for (t = kLanes; t + kLanes <= n; t += kLanes) {
      const Lanes x = load_lanes(sc + t);
      lanes_max = x > lanes_max ? x : lanes_max;
    }
    for (int l = 0; l < kLanes; ++l) max = std::max(max, lanes_max[l]);
  }
  for (; t < n; ++t) max = std::max(max, sc[t]);
  Lanes total = {}, total_odd = {};  // sums of the even and odd passes of 8
  for (t = 0; t + 2 * kLanes <= n; t += 2 * kLanes) {
    const Lanes e = exp_lanes(load_lanes(sc + t) - max), e_odd = exp_lanes(load_lanes(sc + t + kLanes) - max);
    *reinterpret_cast<Lanes*>(sc + t) = e;
    *reinterpret_cast<Lanes*>(sc + t + kLanes) = e_odd;
    total += e;
    total_odd += e_odd;
  }
  for (; t + kLanes <= n; t += kLanes) {
    const Lanes e = exp_lanes(load_lanes(sc + t) - max);
    *reinterpret_cast<Lanes*>(sc + t) = e;
    total += e;
  }
  float sum = sum_lanes(total + total_odd);
  if (t < n) {
    Lanes tail = {};
    for (int64_t l = 0; t + l < n; ++l) tail[l] = sc[t + l] - max;
    const Lanes e = exp_lanes(tail);
    for (int64_t l = 0; t + l < n; ++l) sc[t + l] = e[l], sum += e[l];
  }
  return 1.f / sum;
}

// One job: queries [first, first + count) of a sequence (count <= kTile), one kv head.
struct Job {
  int64_t seq, kv_head, first, count;
};

// D is a template parameter so that a row is a fixed number of Lanes. KV is the pool's element type: T, or
// int8_t with key_scale / value_scale (one per row), which are null otherwise.
//
// K pass: each K row is widened once into registers and dotted with the query heads of the tile's queries that
// see it (two accumulators a dot). Softmax over each query head's own keys. V pass, block by block: the block's
// rows are widened into an L1 scratch once, then each query head's output, kChunk Lanes at a time, stays in
// registers over the rows it sees (one broadcast weight a row and head, one FMA a Lanes).
template <typename T, typename KV, int D>
void attention(const T* q, const KV* key, const KV* value, const at::Half* key_scale, const at::Half* value_scale,
               const int64_t* tables, const int64_t* seq_lens, const int64_t* query_start, T* out, const Shape& s) {
  static_assert(D % (2 * kLanes) == 0, "a row is an even number of Lanes");
  constexpr int kRowLanes = D / kLanes;
  constexpr int kChunkLanes = kRowLanes < kChunk ? kRowLanes : kChunk;
  const int64_t group = s.num_heads / s.num_kv_heads;
  std::vector<Job> jobs;  // sequences come decodes first, longest first; then the prefill chunks' tiles
  for (int64_t seq = 0; seq < s.num_seqs; ++seq)
    for (int64_t first = 0, n = query_start[seq + 1] - query_start[seq]; first < n; first += kTile)
      for (int64_t kv_head = 0; kv_head < s.num_kv_heads; ++kv_head)
        jobs.push_back({seq, kv_head, first, std::min<int64_t>(kTile, n - first)});
  const int64_t num_jobs = static_cast<int64_t>(jobs.size());
  const int64_t num_threads = std::min<int64_t>(at::get_num_threads(), num_jobs);
  // Jobs are dealt round-robin so that each thread gets long and short ones (parallel_for's contiguous ranges
  // would give one thread all the long ones).
  at::parallel_for(0, num_threads, 1, [&](int64_t first_thread, int64_t last_thread) {
    std::vector<float> scores, query(kTile * group * D), acc(kTile * group * D), inv_sum(kTile * group),
        rows(s.block_size * D), weights(s.block_size);
    for (int64_t thread = first_thread; thread < last_thread; ++thread) {
      for (int64_t index = thread; index < num_jobs; index += num_threads) {
        const Job& job = jobs[index];
        const int64_t q_len = query_start[job.seq + 1] - query_start[job.seq];
        const int64_t position = seq_lens[job.seq] - q_len + job.first;  // the tile's first query's position
        const int64_t begin = s.first_key(position), end = position + job.count;  // keys of the tile
        const int64_t span = end - begin, nq = job.count;
        // query j sees keys lo[j] .. hi[j] - 1, counted from begin
        int64_t lo[kTile], hi[kTile];
        for (int64_t j = 0; j < nq; ++j) lo[j] = s.first_key(position + j) - begin, hi[j] = position + j + 1 - begin;
        const int64_t* table = tables + job.seq * s.table_stride;
        const int64_t pool_rows = job.kv_head * s.num_blocks;  // first block of this kv head in the pool
        // Walk block by block over the tile's keys: visit(t, rows, n, scales) gets the block's rows of keys
        // t .. t + n - 1 (from begin) and their scales (null in a float pool). No division per token.
        auto for_each_block = [&](const KV* pool, const at::Half* pool_scale, auto&& visit) {
          const int64_t end_block = (end + s.block_size - 1) / s.block_size;
          const int64_t block_bytes = s.block_size * D * static_cast<int64_t>(sizeof(KV));
          for (int64_t b = begin / s.block_size; b < end_block; ++b) {
            const int64_t block_row = (pool_rows + table[b]) * s.block_size;  // the block's first row
            if (b + 1 < end_block) {  // blocks are scattered: fetch the next one while this one is used
              const char* next = reinterpret_cast<const char*>(pool + (pool_rows + table[b + 1]) * s.block_size * D);
              for (int64_t byte = 0; byte < block_bytes; byte += 64) __builtin_prefetch(next + byte);
            }
            const int64_t block_first = b * s.block_size;
            const int64_t i0 = std::max(begin, block_first) - block_first, n = std::min(s.block_size, end - block_first);
            visit(block_first + i0 - begin, pool + (block_row + i0) * D, n - i0,
                  pool_scale ? pool_scale + block_row + i0 : nullptr);
          }
        };
        // the tile's query heads, (query j, group head g) at (j * group + g) * D, in the pool rows' lane order
        const int64_t first_row = query_start[job.seq] + job.first;  // the tile's first token row in q and out
        auto heads_at = [&](int64_t j) { return ((first_row + j) * s.num_heads + job.kv_head * group) * D; };
        for (int64_t j = 0; j < nq; ++j)
          for (int64_t g = 0; g < group; ++g)
            for (int d = 0; d < D; ++d)
              query[(j * group + g) * D + d] = to_float(q[heads_at(j) + g * D + pair_source<KV>(d)]) * s.scale;

        scores.resize(nq * group * span);  // [nq, group, span]
        for_each_block(key, key_scale, [&](int64_t t0, const KV* block, int64_t n, const at::Half* row_scales) {
          auto finish = [&](float score, float row_scale) {  // the score as it is stored
            score *= row_scale;
            return s.soft_cap ? *s.soft_cap * std::tanh(score / *s.soft_cap) : score;
          };
          int64_t i = 0;
#if defined(__AVX2__)
          // A float32 pool, eight keys at a time: each query head's eight dots (the same two chains a dot as
          // below), then their eight horizontal sums in one transpose (sum8: the same pairs as sum_lanes, so the
          // same bits). Prefill 512 in 0.51-0.56x SDPA's time, 2,048 0.83-0.86x, against 0.63-0.74x and 1.00x
          // one key at a time; bfloat16 rows, widened into a scratch first, gained nothing and decoded 1.2x
          // slower (docs/PERFORMANCE.md, "Attention of the whole step in C++").
          if constexpr (std::is_same_v<KV, float>) for (; i + 8 <= n; i += 8) {
            const float* rows8 = block + i * D;
            const int64_t t = t0 + i;
            for (int64_t j = 0; j < nq; ++j) {
              if (t + 8 <= lo[j] || t >= hi[j]) continue;  // none of the 8 keys is j's (the rest are never read)
              for (int64_t g = 0; g < group; ++g) {
                const float* qg = query.data() + (j * group + g) * D;
                Lanes dots[8];
                for (int r = 0; r < 8; ++r) {
                  const float* kr = rows8 + r * D;
                  dots[r] = dot_lanes<kRowLanes>(qg, [&](int l) { return load_lanes(kr + l * kLanes); });
                }
                const Lanes sums = sum8(dots);
                float* out_scores = scores.data() + (j * group + g) * span + t;
                for (int r = 0; r < 8; ++r)
                  out_scores[r] = finish(sums[r], row_scales ? static_cast<float>(row_scales[i + r]) : 1.f);
              }
            }
          }
#endif
          for (; i < n; ++i) {
            const int64_t t = t0 + i;
            Lanes k[kRowLanes];
            for (int l = 0; l < kRowLanes; l += 2) load_pair(block + i * D + l * kLanes, k[l], k[l + 1]);
            const float row_scale = row_scales ? static_cast<float>(row_scales[i]) : 1.f;
            for (int64_t j = 0; j < nq; ++j) {
              if (t < lo[j] || t >= hi[j]) continue;
              for (int64_t g = 0; g < group; ++g) {
                const float* qg = query.data() + (j * group + g) * D;
                scores[(j * group + g) * span + t] =
                    finish(sum_lanes(dot_lanes<kRowLanes>(qg, [&](int l) { return k[l]; })), row_scale);
              }
            }
          }
        });
        for (int64_t j = 0; j < nq; ++j)
          for (int64_t g = 0; g < group; ++g)
            inv_sum[j * group + g] = softmax_numerators(scores.data() + (j * group + g) * span + lo[j], hi[j] - lo[j]);
        std::fill(acc.begin(), acc.begin() + nq * group * D, 0.f);
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
          for (int64_t j = 0; j < nq; ++j) {
            const int64_t i_lo = std::max<int64_t>(0, lo[j] - t0), i_hi = std::min(n, hi[j] - t0);  // rows j sees
            if (i_lo >= i_hi) continue;
            for (int64_t g = 0; g < group; ++g) {
              const float* w = scores.data() + (j * group + g) * span + t0;
              if (row_scales) {  // an int8 row is code x scale: the scale goes into the row's weight
                for (int64_t i = i_lo; i < i_hi; ++i) weights[i] = w[i] * static_cast<float>(row_scales[i]);
                w = weights.data();
              }
              for (int c = 0; c < kRowLanes; c += kChunkLanes) {
                float* out_lanes = acc.data() + (j * group + g) * D + c * kLanes;
                Lanes sum[kChunkLanes];
                for (int l = 0; l < kChunkLanes; ++l) sum[l] = load_lanes(out_lanes + l * kLanes);
                for (int64_t i = i_lo; i < i_hi; ++i)
                  for (int l = 0; l < kChunkLanes; ++l) sum[l] += w[i] * load_lanes(v + i * D + (c + l) * kLanes);
                for (int l = 0; l < kChunkLanes; ++l) *reinterpret_cast<Lanes*>(out_lanes + l * kLanes) = sum[l];
              }
            }
          }
        });
        for (int64_t j = 0; j < nq; ++j)
          for (int64_t g = 0; g < group; ++g)
            for (int d = 0; d < D; ++d)
              out[heads_at(j) + g * D + pair_source<KV>(d)] =
                  static_cast<T>(acc[(j * group + g) * D + d] * inv_sum[j * group + g]);
      }
    }
  });
}

template <typename T, typename KV>
void dispatch_head_dim(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                       const at::Half* key_scale, const at::Half* value_scale, const torch::Tensor& tables,
                       const torch::Tensor& seq_lens, const int64_t* query_start, torch::Tensor& out, const Shape& s) {
  auto run = [&](auto kernel) {
    kernel(q.data_ptr<T>(), key.data_ptr<KV>(), value.data_ptr<KV>(), key_scale, value_scale,
           tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), query_start, out.data_ptr<T>(), s);
  };
  switch (q.size(2)) {
    case 16: run(attention<T, KV, 16>); break;
    case 32: run(attention<T, KV, 32>); break;
    case 64: run(attention<T, KV, 64>); break;
    case 128: run(attention<T, KV, 128>); break;
    case 256: run(attention<T, KV, 256>); break;
    default: TORCH_CHECK(false, "paged_attention: head_dim ", q.size(2), " is not compiled in");
  }
}

// Every block a sequence reads must lie in the pool, every length within its table, and the query rows must
// tile q: the kernel indexes with them unchecked, so a scheduler bug would read (and, through the prefetch,
// touch) memory outside them instead of raising. One pass over the tables' used entries, O(num_seqs x blocks
// per sequence) integer compares, nothing per token.
void check_tables(const int64_t* tables, const int64_t* seq_lens, const int64_t* query_start, const Shape& s,
                  int64_t table_width, int64_t num_tokens) {
  const int64_t max_len = table_width * s.block_size;
  TORCH_CHECK(query_start[0] == 0 && query_start[s.num_seqs] == num_tokens, "paged_attention: query_start_loc must run "
              "from 0 to q's ", num_tokens, " rows, got ", query_start[0], " .. ", query_start[s.num_seqs]);
  for (int64_t seq = 0; seq < s.num_seqs; ++seq) {
    const int64_t len = seq_lens[seq], q_len = query_start[seq + 1] - query_start[seq];
    TORCH_CHECK(len >= 1 && len <= max_len, "paged_attention: seq_lens[", seq, "] = ", len,
                " is outside [1, ", max_len, "] (block table width ", table_width, " x block_size ", s.block_size, ")");
    TORCH_CHECK(q_len >= 1 && q_len <= len, "paged_attention: sequence ", seq, " has ", q_len, " queries for ", len,
                " keys (query_start_loc must rise by 1 to seq_lens[i] a sequence)");
    const int64_t* table = tables + seq * s.table_stride;
    for (int64_t b = s.first_key(len - q_len) / s.block_size, used = (len + s.block_size - 1) / s.block_size; b < used;
         ++b)
      TORCH_CHECK(table[b] >= 0 && table[b] < s.num_blocks, "paged_attention: block_tables[", seq, "][", b,
                  "] = ", table[b], " is outside the pool [0, ", s.num_blocks, ")");
  }
}

}  // namespace

// q [num_tokens, heads, head_dim]: each sequence's query rows, its last query_len positions, in order;
// key/value [kv_heads, num_blocks, block_size, head_dim]; block_tables [num_seqs, >= blocks used] int64;
// seq_lens [num_seqs] int64 (>= 1, this step's tokens included); query_start_loc [num_seqs + 1] int64, where each
// sequence's rows start in q (the total last), or none: one row a sequence (decodes); window: the layer's sliding
// window (>= 1), or none for full attention; soft_cap: the logit soft-cap (> 0), or none; key_scale /
// value_scale: an int8 pool's [kv_heads, num_blocks, block_size] float16 row scales, none for a pool of q's dtype.
torch::Tensor paged_attention(const torch::Tensor& q, const torch::Tensor& key, const torch::Tensor& value,
                              const torch::Tensor& block_tables, const torch::Tensor& seq_lens,
                              const std::optional<torch::Tensor>& query_start_loc, double scale,
                              std::optional<int64_t> window, std::optional<double> soft_cap,
                              const std::optional<torch::Tensor>& key_scale,
                              const std::optional<torch::Tensor>& value_scale) {
  TORCH_CHECK(q.dim() == 3 && key.dim() == 4 && key.sizes() == value.sizes() && block_tables.dim() == 2 &&
                  seq_lens.dim() == 1,
              "paged_attention: bad ranks");
  TORCH_CHECK(q.device().is_cpu() && key.device().is_cpu() && value.device().is_cpu() &&
                  block_tables.device().is_cpu() && seq_lens.device().is_cpu(),
              "paged_attention: all inputs must be on the CPU");
  TORCH_CHECK(q.is_contiguous() && key.is_contiguous() && value.is_contiguous() && seq_lens.is_contiguous() &&
                  block_tables.stride(1) == 1,
              "paged_attention: inputs must be contiguous");
  TORCH_CHECK(key.scalar_type() == value.scalar_type(), "paged_attention: key and value must share a dtype");
  const bool int8_pool = key.scalar_type() == at::kChar;
  TORCH_CHECK(int8_pool || q.scalar_type() == key.scalar_type(),
              "paged_attention: a float pool must have q's dtype (or the pool is int8 with scales)");
  TORCH_CHECK(int8_pool == (key_scale.has_value() && value_scale.has_value()) &&
                  key_scale.has_value() == value_scale.has_value(),
              "paged_attention: an int8 pool needs key_scale and value_scale, a float pool neither");
  if (int8_pool) {
    for (const auto* t : {&*key_scale, &*value_scale})
      TORCH_CHECK(t->scalar_type() == at::kHalf && t->is_contiguous() && t->device().is_cpu() &&
                      t->sizes() == key.sizes().slice(0, 3),
                  "paged_attention: scales must be contiguous float16 [kv_heads, num_blocks, block_size]");
  }
  TORCH_CHECK(block_tables.scalar_type() == at::kLong && seq_lens.scalar_type() == at::kLong,
              "paged_attention: block_tables and seq_lens must be int64");
  // sizes the kernel divides by or walks with: a malformed model or pool could make any of them 0
  TORCH_CHECK(q.size(1) >= 1 && key.size(0) >= 1 && key.size(1) >= 1 && key.size(2) >= 1,
              "paged_attention: heads, kv_heads, num_blocks and block_size must be >= 1");
  const int64_t num_seqs = seq_lens.size(0);
  TORCH_CHECK(q.size(1) % key.size(0) == 0 && q.size(2) == key.size(3) && block_tables.size(0) == num_seqs,
              "paged_attention: shapes do not match");
  std::vector<int64_t> one_row_each;  // no query_start_loc: row i is sequence i's one query
  const int64_t* query_start = nullptr;
  if (query_start_loc) {
    TORCH_CHECK(query_start_loc->scalar_type() == at::kLong && query_start_loc->dim() == 1 &&
                    query_start_loc->size(0) == num_seqs + 1 && query_start_loc->is_contiguous() &&
                    query_start_loc->device().is_cpu(),
                "paged_attention: query_start_loc must be contiguous int64 [num_seqs + 1] on the CPU");
    query_start = query_start_loc->data_ptr<int64_t>();
  } else {
    one_row_each.resize(num_seqs + 1);
    for (int64_t i = 0; i <= num_seqs; ++i) one_row_each[i] = i;
    query_start = one_row_each.data();
  }
  TORCH_CHECK(!window || *window >= 1, "paged_attention: window must be >= 1, got ", window.value_or(0));
  TORCH_CHECK(!soft_cap || *soft_cap > 0, "paged_attention: soft_cap must be > 0, got ", soft_cap.value_or(0));
  auto out = torch::empty_like(q);
  const Shape s{num_seqs, q.size(1), key.size(0), key.size(1), key.size(2), block_tables.stride(0),
                static_cast<float>(scale), window,
                soft_cap ? std::optional<float>(static_cast<float>(*soft_cap)) : std::nullopt};
  check_tables(block_tables.data_ptr<int64_t>(), seq_lens.data_ptr<int64_t>(), query_start, s, block_tables.size(1),
               q.size(0));
  tinyserve::dispatch_float_types(q, "paged_attention", [&](auto tag) {
    using T = decltype(tag);
    if (int8_pool)
      dispatch_head_dim<T, int8_t>(q, key, value, key_scale->data_ptr<at::Half>(), value_scale->data_ptr<at::Half>(),
                                   block_tables, seq_lens, query_start, out, s);
    else
      dispatch_head_dim<T, T>(q, key, value, nullptr, nullptr, block_tables, seq_lens, query_start, out, s);
  });
  return out;
}

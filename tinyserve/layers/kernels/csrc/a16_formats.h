// The weight formats of quantized_matmul_a16.cpp: a block's 16 rows in vector lanes, and per format a Groups
// struct that reads what widening a group of 32 inputs needs (its scale and offset; where the codes are wider
// than a nibble, their high bits). Included by quantized_matmul_a16.cpp alone, inside its anonymous namespace
// and under its float pragmas.
//
// The formats' codes: Int4Weight's interleaved nibbles (quantized_matmul.cpp describes them: per group, chunk
// c of 8 inputs and row, 4 bytes, byte k holding input 8c + k in its low nibble and 8c + 4 + k in its high) or
// Int8Weight's bytes. The wide codes (GGUF Q5_0, Q5_1, Q5_K: 5 bits; Q6_K: 6 bits) are the same nibbles plus a
// high plane, code = nibble | high << 4. The high plane holds, per block of 16 rows, group, span of 32 /
// kHighBits inputs (4 chunks at 1 bit, 2 at 2 bits) and row, one 32-bit word laid out as the nibbles are: byte
// k holds the high bits of the span's inputs 4m + k (quad m: chunk m / 2's low or high nibbles) at bits
// kHighBits * m. So a span's high bits of a vector of rows are one plain load, and a chunk's 6-bit (5-bit)
// codes, a byte each, come from its nibble word and that word in a few shifts and masks (HighPlane::codes):
// the per-input work is then Int8Weight's, one shift and one mask.
#pragma once

#include <type_traits>

// A block's 16 rows, one per vector lane, in GCC's vector extensions rather than one instruction set's
// intrinsics: one AVX-512 register of 16 floats, or (kParts = 2) two AVX2 registers of 8. The two halves are
// written out as such: GCC lowers a 64-byte vector on AVX2 through memory (the accumulators lived on the stack
// and prefill ran at 14 GFLOP/s). Every lane does the same operations in the same order on each machine (a
// lane's sum never mixes with another's), so the kernel's numerics are the same on every x86 CPU with FMA,
// and this file's tests exercise the path a machine runs.
#ifdef __AVX512F__
constexpr int kParts = 1;
#else
constexpr int kParts = 2;
#endif
constexpr int kWidth = kRows / kParts;
typedef float lanes __attribute__((vector_size(kWidth * 4)));
typedef uint32_t ulanes __attribute__((vector_size(kWidth * 4)));
typedef int32_t ilanes __attribute__((vector_size(kWidth * 4)));

constexpr int kSuperGroups = 8;  // groups of 32 per super-block of 256 inputs (GGUF's K-quants)

// kWidth values to float32 one by one (exact: float16, bytes), where the CPU has no vector conversion for them.
template <class T>
inline lanes converted(const T* p) {
  lanes v;
  for (int l = 0; l < kWidth; ++l) v[l] = static_cast<float>(p[l]);
  return v;
}

// float16 scales and minimums to float32 (exact either way): one vcvtph2ps where the CPU has it (c10::Half's
// conversion is a dozen scalar instructions a value, which made a one-token step a third slower).
inline lanes load_halves(const at::Half* p) {
#if defined(__AVX512F__)
  return reinterpret_cast<lanes>(_mm512_cvtph_ps(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(p))));
#elif defined(__F16C__)
  return reinterpret_cast<lanes>(_mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p))));
#else
  return converted(p);
#endif
}

// kWidth bytes to float32 (exact), unsigned (uint8_t) or signed (int8_t): a zero- or sign-extension and a
// conversion where the CPU has them (GCC 12 turns __builtin_convertvector from bytes into one scalar conversion
// a lane, which made Q4_K's one-token step 15-20% slower than Int4Weight's).
template <class Byte>
inline lanes load_bytes(const Byte* p) {
  constexpr bool kSigned = std::is_signed_v<Byte>;
#if defined(__AVX512F__)
  const __m128i bytes = _mm_loadu_si128(reinterpret_cast<const __m128i*>(p));
  const __m512i words = kSigned ? _mm512_cvtepi8_epi32(bytes) : _mm512_cvtepu8_epi32(bytes);
  return reinterpret_cast<lanes>(_mm512_cvtepi32_ps(words));
#elif defined(__AVX2__)
  const __m128i bytes = _mm_loadl_epi64(reinterpret_cast<const __m128i*>(p));
  const __m256i words = kSigned ? _mm256_cvtepi8_epi32(bytes) : _mm256_cvtepu8_epi32(bytes);
  return reinterpret_cast<lanes>(_mm256_cvtepi32_ps(words));
#else
  return converted(p);
#endif
}

// The high plane of wide codes (the top of this file describes it), HighBits 1 or 2 bits a code.
template <int HighBits>
struct HighPlane {
  static constexpr int kSpanChunks = 4 / HighBits;  // nibble chunks per 32-bit word
  static constexpr int64_t kGroupBytes = 4 * kRows * HighBits;  // 32 inputs' bits, 16 rows
  const uint8_t* words;
  HighPlane at(int64_t b, int64_t groups) const { return {words + b * groups * kGroupBytes}; }
  // Lane l: row (p * kWidth + l)'s word of span s of group g.
  ulanes get(int64_t g, int s, int p) const {
    ulanes v;
    __builtin_memcpy(&v, words + g * kGroupBytes + (s * kRows + p * kWidth) * 4, sizeof(v));
    return v;
  }
  // A chunk's codes at nibble n (0: the bytes' low nibbles, inputs 8c + k; 1: their high ones, 8c + 4 + k),
  // byte k of each lane, from the chunk's nibbles (moved to bits 0-3 of each byte) and its span's high word:
  // quad m = 2j + n of the span's chunk j sits at bits HighBits * m of each byte, moved to bit 4.
  static ulanes codes(ulanes nibbles, ulanes high, int j, int n) {
    constexpr uint32_t kHighBytes = ((1u << HighBits) - 1) * 0x10101010u;
    const int at = HighBits * (2 * j + n);
    return (nibbles & 0x0f0f0f0fu) | ((at <= 4 ? high << (4 - at) : high >> (at - 4)) & kHighBytes);
  }
};

// What a format reads to widen its codes: per group g of a block, scale h of it (kScales per group: a scale
// for each 32 / kScales inputs) and part p of its rows, the scale and offset of w = code * scale + offset;
// kBits, the bits of the stored codes (a nibble or a byte), kHighBits, those of the high plane (0: none, else
// high(g, s, p) reads span s of it: HighPlane::get). at(b, groups): the same for block b of a weight with
// `groups` groups per row.
// Int4Weight: float16 scale per group and row, and either a float16 minimum (Q4_1's rule) or none (GGUF Q4_0's
// w = (code - 8) * scale: offset = -8 * scale, exact in float32, so w is the same bits as with the minimum -8 d
// stored, which is exact in float16 where it does not overflow).
struct Int4Groups {
  static constexpr int kBits = 4, kHighBits = 0, kScales = 1;
  const at::Half* scales;
  const at::Half* minimums;  // nullptr: none, offset = -zero_code * scale
  float zero_code;           // without minimums, the code that stands for 0: 8 (Int5Weight's: 16)
  Int4Groups at(int64_t b, int64_t groups) const {
    return {scales + b * groups * kRows, minimums == nullptr ? nullptr : minimums + b * groups * kRows, zero_code};
  }
  void get(int64_t g, int, int p, lanes& scale, lanes& offset) const {
    scale = load_halves(scales + g * kRows + p * kWidth);
    offset = minimums == nullptr ? scale * -zero_code : load_halves(minimums + g * kRows + p * kWidth);
  }
};

struct Int8Groups {  // Int8Weight (Q8_0's rule): float16 scale per group; the codes are stored plus 128
  static constexpr int kBits = 8, kHighBits = 0, kScales = 1;
  const at::Half* scales;
  Int8Groups at(int64_t b, int64_t groups) const { return {scales + b * groups * kRows}; }
  void get(int64_t g, int, int p, lanes& scale, lanes& offset) const {
    scale = load_halves(scales + g * kRows + p * kWidth);
    offset = scale * -128.f;  // w = (code - 128) * scale, exact
  }
};

// Int4SuperblockWeight (GGUF Q4_K): per super-block of 8 groups (256 inputs) and row, float16 d and dmin; per
// group and row, 6-bit sc and m: scale = d * sc and offset = -(dmin * m), both exact in float32 (an 11-bit
// float16 significand times a 6-bit integer), and code * scale is exact too (4 more bits), so
// w = code * scale + offset rounds once: ggml's float32 value d * sc * q - dmin * m, bit for bit.
struct SuperblockGroups {
  static constexpr int kBits = 4, kHighBits = 0, kScales = 1;
  const at::Half* d;
  const at::Half* dmin;
  const uint8_t* sc;
  const uint8_t* m;
  SuperblockGroups at(int64_t b, int64_t groups) const {
    const int64_t supers = groups / kSuperGroups;
    return {d + b * supers * kRows, dmin + b * supers * kRows, sc + b * groups * kRows, m + b * groups * kRows};
  }
  void get(int64_t g, int, int p, lanes& scale, lanes& offset) const {
    const int64_t s = g / kSuperGroups;
    scale = load_halves(d + s * kRows + p * kWidth) * load_bytes(sc + g * kRows + p * kWidth);
    offset = -(load_halves(dmin + s * kRows + p * kWidth) * load_bytes(m + g * kRows + p * kWidth));
  }
};

// Int5Weight (GGUF Q5_0 and Q5_1): Int4Weight's scales and minimums, 5-bit codes. Q5_1's w = q * d + m
// rounds once, as ggml's; Q5_0 stores no minimum (zero_code 16): q * d + (-16 d) is exact, ggml's (q - 16) * d.
struct Int5Groups {
  static constexpr int kBits = 4, kHighBits = 1, kScales = 1;
  Int4Groups low;
  HighPlane<1> high_plane;
  Int5Groups at(int64_t b, int64_t groups) const { return {low.at(b, groups), high_plane.at(b, groups)}; }
  void get(int64_t g, int h, int p, lanes& scale, lanes& offset) const { low.get(g, h, p, scale, offset); }
  ulanes high(int64_t g, int s, int p) const { return high_plane.get(g, s, p); }
};

// Int5SuperblockWeight (GGUF Q5_K): Q4_K's scales, 5-bit codes: code * scale is still exact (5 + 17 bits), so
// w rounds once, as ggml's d * sc * q - dmin * m.
struct Int5SuperblockGroups {
  static constexpr int kBits = 4, kHighBits = 1, kScales = 1;
  SuperblockGroups low;
  HighPlane<1> high_plane;
  Int5SuperblockGroups at(int64_t b, int64_t groups) const {
    return {low.at(b, groups), high_plane.at(b, groups)};
  }
  void get(int64_t g, int h, int p, lanes& scale, lanes& offset) const { low.get(g, h, p, scale, offset); }
  ulanes high(int64_t g, int s, int p) const { return high_plane.get(g, s, p); }
};

// Int6SuperblockWeight (GGUF Q6_K): per super-block and row, float16 d; per 16 inputs (two scales a group) and
// row, an int8 sc; code 0..63; w = (code - 32) * d * sc. Nothing rounds: scale = d * sc is exact in float32
// (an 11-bit significand times |sc| <= 128: 18 bits), offset = -32 * scale too, code * scale (6 more bits: 24)
// and their sum (code - 32) * scale (|code - 32| <= 32: 24 bits) as well, so w is ggml's d * sc * (q - 32).
struct Int6SuperblockGroups {
  static constexpr int kBits = 4, kHighBits = 2, kScales = 2;
  const at::Half* d;
  const int8_t* sc;
  HighPlane<2> high_plane;
  Int6SuperblockGroups at(int64_t b, int64_t groups) const {
    return {d + b * (groups / kSuperGroups) * kRows, sc + b * groups * kScales * kRows, high_plane.at(b, groups)};
  }
  void get(int64_t g, int h, int p, lanes& scale, lanes& offset) const {
    scale = load_halves(d + g / kSuperGroups * kRows + p * kWidth) *
            load_bytes(sc + (g * kScales + h) * kRows + p * kWidth);
    offset = scale * -32.f;
  }
  ulanes high(int64_t g, int s, int p) const { return high_plane.get(g, s, p); }
};

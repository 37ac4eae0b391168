// pack_int4's layout (int4_linear.cpp), shared with screened_head.cpp, whose int4 screen is one.
// Per block of 32 columns and group of 32 inputs: 512 bytes of codes, then 32 bfloat16 scales and
// 32 bfloat16 zeros (w = (q - 8) s + z). The codes come in 4 chunks of 8 inputs, each two vectors
// (columns 0-15, 16-31) of one 32-bit lane a column: for the chunk's pair p, the code of its first
// input sits at bits 4p, that of its second at bits 16 + 4p.
#pragma once

#include <cstdint>

#include <immintrin.h>

#include "packed.h"

namespace bucketserve {
constexpr int64_t INT4_GROUP = 32;                              // inputs sharing a scale and zero
constexpr int64_t INT4_CHUNKS = INT4_GROUP / 8;                 // 8 inputs a 32-bit lane
constexpr int64_t INT4_CODES = INT4_GROUP * PACK_BLOCK / 2;     // code bytes of a group and block
constexpr int64_t INT4_GROUP_BYTES = INT4_CODES + 4 * PACK_BLOCK;  // codes, 32 scales, 32 zeros
// Above this many rows, widening each block once and running dot_linear's tiles costs less than
// the codes' tiles (measured on a Zen 4: at 32 rows the two take about the same time a step).
constexpr int64_t INT4_WIDEN_ROWS = 32;

#if defined(__AVX512BF16__)
inline __m512 widen_bf16(const uint8_t* p) {  // 16 bfloat16 to float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif
}  // namespace bucketserve

// pack_int4's layout (int4_linear.cpp), shared with screened_head.cpp, whose int4 screen is one.
// Per block of 32 columns and group of 32 inputs: 512 bytes of codes, then 32 bfloat16 scales and
// 32 bfloat16 zeros (w = (q - 8) s + z). The codes come in 4 chunks of 8 inputs, each two vectors
// (columns 0-15, 16-31) of one 32-bit lane a column: for the chunk's pair p, the code of its first
// input sits at bits 4p, that of its second at bits 16 + 4p.
#pragma once

#include <cstdint>

#include "packed.h"

namespace bucketserve {
constexpr int64_t INT4_GROUP = 32;                              // inputs sharing a scale and zero
constexpr int64_t INT4_CODES = INT4_GROUP * PACK_BLOCK / 2;     // code bytes of a group and block
constexpr int64_t INT4_GROUP_BYTES = INT4_CODES + 4 * PACK_BLOCK;  // codes, 32 scales, 32 zeros
}  // namespace bucketserve

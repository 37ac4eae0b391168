// The packed projections: the bfloat16 layout (pack_bf16, in amx.cpp), the schedule and the
// output rounding their products share, and the products themselves: AMX tiles (amx.cpp),
// AVX512-BF16 dot products (dot_linear.cpp), AVX2 fused multiply-adds (fma_linear.cpp), and
// int4 and int8 codes in AVX512-BF16 dot products (int4_linear.cpp, int8_linear.cpp, their own
// layouts), and a draft's LM head screened in int4 (screened_head.cpp); bound into the module by
// kernels.cpp.
#pragma once

#include <torch/extension.h>

#include "crew.h"

#include <array>
#include <utility>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include <immintrin.h>

namespace bucketserve {
constexpr int64_t PACK_BLOCK = 32;      // output columns per packed block
constexpr int64_t ROWS_RESIDENT = 256;  // rows of x kept in L2 while the weights stream past

torch::Tensor pack_bf16(torch::Tensor w);
void check_packed(const torch::Tensor& packed, int64_t K, int64_t N);  // refuses a mismatch

// Refuses an N that `blocks` packed blocks of PACK_BLOCK columns do not hold (a last one partial).
inline void check_blocks(int64_t N, int64_t blocks) {
  TORCH_CHECK(N > (blocks - 1) * PACK_BLOCK && N <= blocks * PACK_BLOCK,
              "N does not match the packed weight's blocks");
}

// A tile kernel templated on its row count as a table indexed at run time: TILES[rows - 1].
// `tile_of(std::integral_constant<int, R>)` names the kernel for R rows.
template <typename TileFn, typename TileOf, int... R>
constexpr std::array<TileFn, sizeof...(R)> tile_table_of(TileOf tile_of,
                                                         std::integer_sequence<int, R...>) {
  return {tile_of(std::integral_constant<int, R + 1>{})...};
}
template <typename TileFn, int MaxRows, typename TileOf>
constexpr std::array<TileFn, MaxRows> tile_table(TileOf tile_of) {
  return tile_table_of<TileFn>(tile_of, std::make_integer_sequence<int, MaxRows>{});
}

// A packed product: x [M, K] bfloat16 times a packed weight of N columns, into y [M, N].
using ProductInto = void (*)(torch::Tensor x, const torch::Tensor& packed, int64_t N,
                             torch::Tensor& y);

// A product as the module binds it: its output a new tensor each call.
template <ProductInto Into>
torch::Tensor with_new_output(torch::Tensor x, torch::Tensor packed, int64_t N) {
  torch::Tensor y;
  Into(std::move(x), packed, N, y);
  return y;
}

// Every product's output y [M, N] bfloat16: the caller's buffer where y is defined (a fused step's
// workspace, checked), else a new tensor.
inline void claim_output(torch::Tensor& y, int64_t M, int64_t N,
                         const torch::TensorOptions& options) {
  if (!y.defined()) {
    y = torch::empty({M, N}, options);
    return;
  }
  TORCH_CHECK(y.dim() == 2 && y.size(0) == M && y.size(1) == N &&
                  y.scalar_type() == torch::kBFloat16 && y.is_contiguous(),
              "an output [", M, ", ", N, "] of contiguous bfloat16 expected");
}

bool amx_supported();
void amx_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y);

bool dot_linear_supported();
void dot_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y);
// dot_linear's product of `rows` rows of x over one packed block (int4_linear's many-row path)
constexpr int DOT_TILE_ROWS = 12;
void dot_rows(const uint16_t* x, int64_t K, const uint16_t* block, uint16_t* y, int64_t y_stride,
              int64_t cols, int64_t rows);

bool int4_linear_supported();
torch::Tensor pack_int4(torch::Tensor codes, torch::Tensor scale, torch::Tensor zero);
void int4_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y);

torch::Tensor pack_screened(torch::Tensor codes, torch::Tensor scale, torch::Tensor screen_codes,
                            torch::Tensor screen_scale, torch::Tensor screen_zero);
void screened_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N,
                          torch::Tensor& y);

torch::Tensor pack_int8(torch::Tensor codes, torch::Tensor scale);
void int8_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y);

bool fma_linear_supported();
void fma_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y);

// The schedule of the products over M rows and `blocks` packed blocks (N columns): each thread
// owns a range of column blocks and sweeps every row over each block in tiles of up to
// `tile_rows`, ROWS_RESIDENT rows at a time, so a weight is read from memory once per 256 rows and
// a decode batch streams it once. Each thread makes its own `tile = make_tile()` and calls
// tile(first row, rows, block, columns in it, whether this is the block's first pass).
template <typename MakeTile>
void sweep_packed(int64_t M, int64_t N, int64_t blocks, int64_t tile_rows, MakeTile make_tile) {
  parallel_for(0, blocks, 1, [&](int64_t first, int64_t last) {
    auto tile = make_tile();
    for (int64_t outer = 0; outer < M; outer += ROWS_RESIDENT) {
      const int64_t outer_end = std::min(M, outer + ROWS_RESIDENT);
      for (int64_t b = first; b < last; ++b) {
        const int64_t cols = std::min(PACK_BLOCK, N - b * PACK_BLOCK);
        for (int64_t m0 = outer; m0 < outer_end; m0 += tile_rows)
          tile(m0, std::min(tile_rows, outer_end - m0), b, cols, m0 == outer);
      }
    }
  });
}

#if defined(__AVX512BF16__)
// One output row of a block: its 32 float32 sums (two vectors) rounded to bfloat16 to nearest
// even, as torch rounds, and stored up to `cols` (a last block may be partial).
inline void store_block_row(uint16_t* row, __m512 low, __m512 high, int64_t cols) {
  const auto lanes = [](int64_t n) {
    return static_cast<__mmask16>(n >= 16 ? 0xFFFF : n <= 0 ? 0 : (1u << n) - 1);
  };
  _mm256_mask_storeu_epi16(row, lanes(cols), (__m256i)_mm512_cvtneps_pbh(low));
  _mm256_mask_storeu_epi16(row + 16, lanes(cols - 16), (__m256i)_mm512_cvtneps_pbh(high));
}
#endif
}  // namespace bucketserve

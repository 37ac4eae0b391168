// bfloat16 projections in AVX512-BF16 dot products, for CPUs without AMX tiles (AMD Zen 4 and 5,
// Intel before Sapphire Rapids): the weight packed once by pack_bf16, then every product, a lone
// decode row to a prefill, read from it. oneDNN's product through F.linear reorders the plain
// weight on each call, which at decode batch sizes costs more than the product.
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include <immintrin.h>

#include "packed.h"

namespace bucketserve {
namespace {
constexpr int64_t BLOCK = PACK_BLOCK;  // output columns per packed block: two 16-float vectors
constexpr int MAX_TILE_ROWS = DOT_TILE_ROWS;  // 24 accumulators + 2 weights + 1 input

#if defined(__AVX512BF16__)
// y[0..ROWS, block's columns] = x[0..ROWS] . block. Per pair of inputs the block holds its 32
// columns' two weights side by side (64 bfloat16, two vectors); each row's pair is broadcast and
// multiplied into both, so a weight vector loaded once serves every row of the tile.
template <int ROWS>
void dot_tile(const uint16_t* x, int64_t K, const uint16_t* block, uint16_t* y, int64_t y_stride,
              int64_t cols) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    const __m512bh low = (__m512bh)_mm512_loadu_si512(block + pair * 2 * BLOCK);
    const __m512bh high = (__m512bh)_mm512_loadu_si512(block + pair * 2 * BLOCK + BLOCK);
    for (int r = 0; r < ROWS; ++r) {
      int32_t both;  // x[r, 2 pair], x[r, 2 pair + 1] as one 32-bit lane
      std::memcpy(&both, x + r * K + pair * 2, sizeof(both));
      const __m512bh input = (__m512bh)_mm512_set1_epi32(both);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], low, input);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], high, input);
    }
  }
  for (int r = 0; r < ROWS; ++r) store_block_row(y + r * y_stride, acc[r][0], acc[r][1], cols);
}

using TileFn = void (*)(const uint16_t*, int64_t, const uint16_t*, uint16_t*, int64_t, int64_t);

constexpr auto TILES = tile_table<TileFn, MAX_TILE_ROWS>(
    [](auto rows) -> TileFn { return &dot_tile<decltype(rows)::value>; });
#endif
}  // namespace

void dot_rows(const uint16_t* x, int64_t K, const uint16_t* block, uint16_t* y, int64_t y_stride,
              int64_t cols, int64_t rows) {
#if defined(__AVX512BF16__)
  for (int64_t m0 = 0; m0 < rows; m0 += MAX_TILE_ROWS)
    TILES[std::min<int64_t>(MAX_TILE_ROWS, rows - m0) - 1](x + m0 * K, K, block, y + m0 * y_stride,
                                                             y_stride, cols);
#endif
}

bool dot_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// x [M, K] @ w.T in bfloat16 with w packed by pack_bf16 (N columns), float32 accumulation, in
// sweep_packed's schedule.
void dot_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y) {
  TORCH_CHECK(dot_linear_supported(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x [M, K] bfloat16 expected");
  check_packed(packed, x.size(1), N);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  claim_output(y, M, N, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  sweep_packed(M, N, blocks, MAX_TILE_ROWS, [&] {
    return [&](int64_t m0, int64_t rows, int64_t b, int64_t cols, bool) {
      TILES[rows - 1](xp + m0 * K, K, wp + b * BLOCK * K, yp + m0 * N + b * BLOCK, N, cols);
    };
  });
#endif
}

}  // namespace bucketserve

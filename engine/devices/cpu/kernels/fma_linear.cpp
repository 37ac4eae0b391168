// bfloat16 projections in AVX2 FMA, for x86 CPUs with neither AMX nor AVX512-BF16 (AMD Zen 2 and
// 3, Intel before Ice Lake): the weight packed once by pack_bf16 is widened to float32 in
// registers and multiplied in fused multiply-adds. Torch has no fast bfloat16 product there
// (oneDNN refuses to pack bfloat16 without AVX512-BW or AVX-NE-CONVERT, and F.linear emulates it),
// and its float32 product reads twice the bytes of this one.
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include <immintrin.h>

#include "packed.h"

namespace bucketserve {
namespace {
constexpr int64_t BLOCK = PACK_BLOCK;  // output columns per packed block
constexpr int64_t HALF = BLOCK / 2;    // columns per pass over a block: two 8-float vectors
constexpr int MAX_TILE_ROWS = 4;       // 8 accumulators + 4 widened weights + 2 inputs of 16

#if defined(__AVX2__) && defined(__FMA__)
// A pair (w[c, 2p], w[c, 2p + 1]) of bfloat16 is one 32-bit lane: the even weight is its low half,
// the odd one its high half, and a bfloat16 is the top half of its float32.
inline __m256 even_weights(__m256i pairs) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(pairs, 16));
}
inline __m256 odd_weights(__m256i pairs) {
  const __m256i high_halves = _mm256_set1_epi32(static_cast<int>(0xFFFF0000u));
  return _mm256_castsi256_ps(_mm256_and_si256(pairs, high_halves));
}

// float32 to bfloat16, rounded to nearest even as torch rounds (a NaN stays a quiet NaN), and the
// first `cols` of the 8 stored.
inline void store_bf16(uint16_t* out, __m256 value, int64_t cols) {
  const __m256i bits = _mm256_castps_si256(value);
  const __m256i lsb = _mm256_and_si256(_mm256_srli_epi32(bits, 16), _mm256_set1_epi32(1));
  __m256i rounded = _mm256_srli_epi32(
      _mm256_add_epi32(bits, _mm256_add_epi32(lsb, _mm256_set1_epi32(0x7FFF))), 16);
  const __m256 nan = _mm256_cmp_ps(value, value, _CMP_UNORD_Q);
  rounded = _mm256_blendv_epi8(rounded, _mm256_set1_epi32(0x7FC0), _mm256_castps_si256(nan));
  alignas(32) int32_t lanes[8];
  _mm256_store_si256(reinterpret_cast<__m256i*>(lanes), rounded);
  for (int64_t c = 0; c < std::min<int64_t>(cols, 8); ++c) out[c] = static_cast<uint16_t>(lanes[c]);
}

// y[0..ROWS, 16 columns of a block from `half`] = x[0..ROWS] . block, x already float32. Per pair
// of inputs the block holds its 32 columns' two weights side by side; a half's 16 columns are two
// 256-bit loads, widened once and multiplied into every row of the tile.
template <int ROWS>
void fma_tile(const float* x, int64_t K, const uint16_t* block, int64_t half, uint16_t* y,
              int64_t y_stride, int64_t cols) {
  __m256 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm256_setzero_ps();
  const uint16_t* weights = block + half * HALF * 2;
  for (int64_t pair = 0; pair < K / 2; ++pair, weights += BLOCK * 2) {
    const __m256i first = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights));
    const __m256i second = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(weights + 16));
    const __m256 even0 = even_weights(first), odd0 = odd_weights(first);
    const __m256 even1 = even_weights(second), odd1 = odd_weights(second);
    for (int r = 0; r < ROWS; ++r) {
      const __m256 x_even = _mm256_broadcast_ss(x + r * K + pair * 2);
      const __m256 x_odd = _mm256_broadcast_ss(x + r * K + pair * 2 + 1);
      acc[r][0] = _mm256_fmadd_ps(even0, x_even, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(even1, x_even, acc[r][1]);
      acc[r][0] = _mm256_fmadd_ps(odd0, x_odd, acc[r][0]);
      acc[r][1] = _mm256_fmadd_ps(odd1, x_odd, acc[r][1]);
    }
  }
  const int64_t first_col = half * HALF;
  for (int r = 0; r < ROWS; ++r) {
    uint16_t* row = y + r * y_stride + first_col;
    store_bf16(row, acc[r][0], cols - first_col);
    store_bf16(row + 8, acc[r][1], cols - first_col - 8);
  }
}

using TileFn = void (*)(const float*, int64_t, const uint16_t*, int64_t, uint16_t*, int64_t,
                        int64_t);

constexpr auto TILES = tile_table<TileFn, MAX_TILE_ROWS>(
    [](auto rows) -> TileFn { return &fma_tile<decltype(rows)::value>; });
#endif
}  // namespace

bool fma_linear_supported() {
#if defined(__AVX2__) && defined(__FMA__)
  return true;
#else
  return false;
#endif
}

// x [M, K] @ w.T in bfloat16 with w packed by pack_bf16 (N columns), float32 products and sums,
// in sweep_packed's schedule.
void fma_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y) {
  TORCH_CHECK(fma_linear_supported(), "built without AVX2 and FMA");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x [M, K] bfloat16 expected");
  check_packed(packed, x.size(1), N);
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  claim_output(y, M, N, x.options());
#if defined(__AVX2__) && defined(__FMA__)
  // Widened once here, not per block: every thread reads every row of x for each of its blocks.
  const auto wide = x.to(torch::kFloat32).contiguous();
  const auto* xp = wide.data_ptr<float>();
  const auto* wp = reinterpret_cast<const uint16_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  sweep_packed(M, N, blocks, MAX_TILE_ROWS, [&] {
    return [&](int64_t m0, int64_t rows, int64_t b, int64_t cols, bool) {
      for (int64_t half = 0; half * HALF < cols; ++half)
        TILES[rows - 1](xp + m0 * K, K, wp + b * BLOCK * K, half, yp + m0 * N + b * BLOCK, N,
                        cols);
    };
  });
#endif
}

}  // namespace bucketserve

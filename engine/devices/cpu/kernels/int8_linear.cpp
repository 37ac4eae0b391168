// int8 projections (engine.layers.quant.Int8Weight: w = q s, one float scale per output column)
// multiplied from their codes in AVX512-BF16 dot products, at half a bfloat16 weight's bytes: under
// --quantize the vocabulary (embedding and LM head) is int8, and torch's int8 kernel
// (aten._weight_int8pack_mm) spent 3.4 ms of a 7 ms lone-row step on the embedded model's LM head,
// 24 ms of 66 at 32 rows (Zen 4). Each code widens in registers to bfloat16, exact for -128..127,
// so a product is x . q in float32 sums, then times the column's scale, as torch computes it.
//
// Layout (pack_int8), per block of 32 columns: pack_bf16's order in int8 ([K / 2][32][2]), then
// the 32 columns' float32 scales.
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>

#include <immintrin.h>

#include "crew.h"
#include "packed.h"

namespace bucketserve {
namespace {
constexpr int MAX_TILE_ROWS = DOT_TILE_ROWS;  // 24 accumulators + 2 widened weights + 1 input

int64_t block_bytes(int64_t K) { return K * PACK_BLOCK + PACK_BLOCK * sizeof(float); }

#if defined(__AVX512BF16__)
// 16 columns' pairs of codes (32 bytes) as 32 bfloat16 numbers in the same order.
inline __m512bh widen_codes(const int8_t* codes) {
  const __m128i first = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes));
  const __m128i second = _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + 16));
  return _mm512_cvtne2ps_pbh(_mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(second)),
                             _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(first)));
}

template <int ROWS>
void int8_tile(const uint16_t* x, int64_t K, const int8_t* block, uint16_t* y, int64_t y_stride,
               int64_t cols) {
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  for (int64_t pair = 0; pair < K / 2; ++pair) {
    const __m512bh low = widen_codes(block + pair * 2 * PACK_BLOCK);
    const __m512bh high = widen_codes(block + pair * 2 * PACK_BLOCK + PACK_BLOCK);
    for (int r = 0; r < ROWS; ++r) {
      int32_t both;  // x[r, 2 pair], x[r, 2 pair + 1] as one 32-bit lane
      std::memcpy(&both, x + r * K + pair * 2, sizeof(both));
      const __m512bh input = (__m512bh)_mm512_set1_epi32(both);
      acc[r][0] = _mm512_dpbf16_ps(acc[r][0], low, input);
      acc[r][1] = _mm512_dpbf16_ps(acc[r][1], high, input);
    }
  }
  const auto* scales = reinterpret_cast<const float*>(block + K * PACK_BLOCK);
  const __m512 scale_low = _mm512_loadu_ps(scales), scale_high = _mm512_loadu_ps(scales + 16);
  for (int r = 0; r < ROWS; ++r)
    store_block_row(y + r * y_stride, _mm512_mul_ps(acc[r][0], scale_low),
                    _mm512_mul_ps(acc[r][1], scale_high), cols);
}

using TileFn = void (*)(const uint16_t*, int64_t, const int8_t*, uint16_t*, int64_t, int64_t);

constexpr auto TILES = tile_table<TileFn, MAX_TILE_ROWS>(
    [](auto rows) -> TileFn { return &int8_tile<decltype(rows)::value>; });
#endif
}  // namespace

torch::Tensor pack_int8(torch::Tensor codes, torch::Tensor scale) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8, "codes [N, K] int8 expected");
  const int64_t N = codes.size(0), K = codes.size(1);
  TORCH_CHECK(K % 2 == 0, "an even number of inputs expected, got ", K);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == N, "scale [N] expected");
  codes = codes.contiguous();
  const auto s = scale.to(torch::kFloat32).contiguous();
  const int64_t blocks = (N + PACK_BLOCK - 1) / PACK_BLOCK;
  auto packed = torch::zeros({blocks, block_bytes(K)}, codes.options().dtype(torch::kUInt8));
  const auto* q = codes.data_ptr<int8_t>();
  const auto* sp = s.data_ptr<float>();
  auto* out = packed.data_ptr<uint8_t>();
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      uint8_t* block = out + (n / PACK_BLOCK) * block_bytes(K);
      const int64_t c = n % PACK_BLOCK;
      for (int64_t k = 0; k < K; ++k)
        std::memcpy(block + ((k / 2) * PACK_BLOCK + c) * 2 + k % 2, q + n * K + k, 1);
      std::memcpy(block + K * PACK_BLOCK + c * sizeof(float), sp + n, sizeof(float));
    }
  });
  return packed;
}

// x [M, K] bfloat16 through a weight packed by pack_int8 (N columns), in sweep_packed's schedule.
void int8_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y) {
  TORCH_CHECK(dot_linear_supported(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x [M, K] bfloat16 expected");
  const int64_t M = x.size(0), K = x.size(1);
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 &&
                  packed.size(1) == block_bytes(K),
              "a weight packed by pack_int8 for ", K, " inputs expected");
  const int64_t blocks = packed.size(0);
  check_blocks(N, blocks);
  x = x.contiguous();
  claim_output(y, M, N, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = reinterpret_cast<const int8_t*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  sweep_packed(M, N, blocks, MAX_TILE_ROWS, [&] {
    return [&](int64_t m0, int64_t rows, int64_t b, int64_t cols, bool) {
      TILES[rows - 1](xp + m0 * K, K, wp + b * block_bytes(K), yp + m0 * N + b * PACK_BLOCK, N,
                      cols);
    };
  });
#endif
}

}  // namespace bucketserve

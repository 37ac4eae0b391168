// int4 projections (engine.layers.quant.Int4Weight's codes, scales and zeros: w = (q - 8) s + z
// per group of 32 inputs) multiplied straight from 4-bit codes in AVX512-BF16 dot products: a
// decode step streams about a quarter of bfloat16's bytes. Per pair of inputs, a column's two
// codes widen to the bfloat16 numbers 128 + q (bits 0x4300 | q, exact) in one shift and one
// bitwise select, so one dot product takes both; the offset and the zero come back once per
// group through the sum of its inputs: sum_k x_k w_k = s dot(x, 128 + q) + (z - 136 s) sum_k x_k.
// Many rows (a prefill) widen each block to bfloat16 once and run dot_linear's tiles over it.
// The packed layout (pack_int4) is described in int4_layout.h.
#include <torch/extension.h>

#include <array>
#include <cstdint>
#include <cstring>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "int4_layout.h"
#include "packed.h"
#include "vec_math.h"

namespace bucketserve {
namespace {
constexpr int64_t GROUP = INT4_GROUP;
constexpr int64_t CHUNKS = GROUP / 8;  // 8 inputs (4 pairs) a 32-bit lane
constexpr int64_t CODES = INT4_CODES;
constexpr int64_t GROUP_BYTES = INT4_GROUP_BYTES;
constexpr int MAX_TILE_ROWS = 6;  // 24 accumulators + codes, input, scales and zeros
// Above this many rows, widening each block once and running dot_linear's tiles costs less than
// the codes' tiles (measured on a Zen 4: at 32 rows the two take about the same time a step).
constexpr int64_t WIDEN_ROWS = 32;

#if defined(__AVX512BF16__)
// Pair p's codes of 16 columns' lanes as bfloat16 pairs (128 + q[c, first], 128 + q[c, second]).
inline __m512bh widen_codes(__m512i lanes, int p) {
  return (__m512bh)_mm512_ternarylogic_epi32(_mm512_srli_epi32(lanes, 4 * p),
                                             _mm512_set1_epi32(0x000F000F),
                                             _mm512_set1_epi32(0x43004300), 0xEA);  // a & b | c
}

inline __m512 widen_bf16(const uint8_t* p) {  // 16 bfloat16 to float32
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}

// y[0..ROWS, block's columns] from one packed block; xsums [ROWS, groups] the inputs' group sums.
template <int ROWS>
void int4_tile(const uint16_t* x, int64_t K, const float* xsums, const uint8_t* block,
               uint16_t* y, int64_t y_stride, int64_t cols) {
  const int64_t groups = K / GROUP;
  __m512 acc[ROWS][2];
  for (int r = 0; r < ROWS; ++r) acc[r][0] = acc[r][1] = _mm512_setzero_ps();
  // A few rows keep two sets of sums (even and odd pairs), so that no chain of dependent dot
  // products sets the pace; more rows have chains enough.
  constexpr int SETS = ROWS <= 3 ? 2 : 1;
  for (int64_t g = 0; g < groups; ++g) {
    const uint8_t* codes = block + g * GROUP_BYTES;
    __m512 dots[SETS][ROWS][2];
    for (int set = 0; set < SETS; ++set)
      for (int r = 0; r < ROWS; ++r) dots[set][r][0] = dots[set][r][1] = _mm512_setzero_ps();
    for (int64_t chunk = 0; chunk < CHUNKS; ++chunk) {
      const __m512i lanes_low = _mm512_loadu_si512(codes + chunk * 128);
      const __m512i lanes_high = _mm512_loadu_si512(codes + chunk * 128 + 64);
      for (int p = 0; p < 4; ++p) {
        const __m512bh low = widen_codes(lanes_low, p), high = widen_codes(lanes_high, p);
        auto& sums = dots[p % SETS];
        for (int r = 0; r < ROWS; ++r) {
          int32_t both;  // x[r, the pair's two inputs] as one 32-bit lane
          std::memcpy(&both, x + r * K + g * GROUP + chunk * 8 + p * 2, sizeof(both));
          const __m512bh input = (__m512bh)_mm512_set1_epi32(both);
          sums[r][0] = _mm512_dpbf16_ps(sums[r][0], low, input);
          sums[r][1] = _mm512_dpbf16_ps(sums[r][1], high, input);
        }
      }
    }
    if constexpr (SETS == 2)
      for (int r = 0; r < ROWS; ++r)
        for (int h = 0; h < 2; ++h) dots[0][r][h] = _mm512_add_ps(dots[0][r][h], dots[1][r][h]);
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = widen_bf16(codes + CODES + h * 32);
      const __m512 zero = widen_bf16(codes + CODES + 2 * PACK_BLOCK + h * 32);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(136.f), scale, zero);  // z - 136 s
      for (int r = 0; r < ROWS; ++r) {
        acc[r][h] = _mm512_fmadd_ps(scale, dots[0][r][h], acc[r][h]);
        acc[r][h] = _mm512_fmadd_ps(offset, _mm512_set1_ps(xsums[r * groups + g]), acc[r][h]);
      }
    }
  }
  for (int r = 0; r < ROWS; ++r) store_block_row(y + r * y_stride, acc[r][0], acc[r][1], cols);
}

// The sum of one group's 32 bfloat16 inputs, in float32.
inline float group_sum(const uint16_t* x) {
  return _mm512_reduce_add_ps(_mm512_add_ps(load_bf16(x), load_bf16(x + 16)));
}

using TileFn = void (*)(const uint16_t*, int64_t, const float*, const uint8_t*, uint16_t*,
                        int64_t, int64_t);

constexpr auto TILES = tile_table<TileFn, MAX_TILE_ROWS>(
    [](auto rows) -> TileFn { return &int4_tile<decltype(rows)::value>; });

// One packed block widened to bfloat16 in pack_bf16's layout ([K / 2][32][2]): w = (q - 8) s + z,
// rounded once.
void widen_block(const uint8_t* block, int64_t K, uint16_t* out) {
  for (int64_t g = 0; g < K / GROUP; ++g) {
    const uint8_t* codes = block + g * GROUP_BYTES;
    for (int h = 0; h < 2; ++h) {
      const __m512 scale = widen_bf16(codes + CODES + h * 32);
      const __m512 zero = widen_bf16(codes + CODES + 2 * PACK_BLOCK + h * 32);
      const __m512 offset = _mm512_fnmadd_ps(_mm512_set1_ps(8.f), scale, zero);  // z - 8 s
      for (int64_t chunk = 0; chunk < CHUNKS; ++chunk) {
        const __m512i lanes = _mm512_loadu_si512(codes + chunk * 128 + h * 64);
        for (int p = 0; p < 4; ++p) {
          const __m512i both = _mm512_and_si512(_mm512_srli_epi32(lanes, 4 * p),
                                                _mm512_set1_epi32(0x000F000F));
          const __m512 low = _mm512_cvtepi32_ps(_mm512_and_si512(both, _mm512_set1_epi32(0xF)));
          const __m512 high = _mm512_cvtepi32_ps(_mm512_srli_epi32(both, 16));
          const __m256i w_low = (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(low, scale, offset));
          const __m256i w_high =
              (__m256i)_mm512_cvtneps_pbh(_mm512_fmadd_ps(high, scale, offset));
          // lane c of the pair: (w[c, first], w[c, second]) side by side
          const __m512i pairs =
              _mm512_or_si512(_mm512_cvtepu16_epi32(w_low),
                              _mm512_slli_epi32(_mm512_cvtepu16_epi32(w_high), 16));
          const int64_t pair = g * (GROUP / 2) + chunk * 4 + p;
          _mm512_storeu_si512(out + (pair * PACK_BLOCK + h * 16) * 2, pairs);
        }
      }
    }
  }
}
#endif
}  // namespace

bool int4_linear_supported() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

torch::Tensor pack_int4(torch::Tensor codes, torch::Tensor scale, torch::Tensor zero) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kUInt8,
              "codes [N, K] uint8 expected");
  const int64_t N = codes.size(0), K = codes.size(1), groups = K / GROUP;
  TORCH_CHECK(K % GROUP == 0, "a multiple of ", GROUP, " inputs expected, got ", K);
  TORCH_CHECK(codes.le(15).all().item<bool>(), "codes must be 0 to 15");
  for (const auto* t : {&scale, &zero})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->sizes() == torch::IntArrayRef({N, groups}),
                "scale and zero [N, K / 32] bfloat16 expected");
  codes = codes.contiguous();
  const auto s = scale.contiguous(), z = zero.contiguous();
  const int64_t blocks = (N + PACK_BLOCK - 1) / PACK_BLOCK;
  auto packed = torch::zeros({blocks, groups, GROUP_BYTES}, codes.options());
  const auto* q = codes.data_ptr<uint8_t>();
  const auto* sp = reinterpret_cast<const uint16_t*>(s.data_ptr());
  const auto* zp = reinterpret_cast<const uint16_t*>(z.data_ptr());
  auto* out = packed.data_ptr<uint8_t>();
  for (int64_t n = 0; n < N; ++n) {
    const int64_t b = n / PACK_BLOCK, c = n % PACK_BLOCK;
    for (int64_t g = 0; g < groups; ++g) {
      uint8_t* group = out + (b * groups + g) * GROUP_BYTES;
      for (int64_t chunk = 0; chunk < CHUNKS; ++chunk) {
        const uint8_t* inputs = q + n * K + g * GROUP + chunk * 8;
        uint32_t lane = 0;
        for (int p = 0; p < 4; ++p)
          lane |= uint32_t{inputs[2 * p]} << (4 * p) | uint32_t{inputs[2 * p + 1]} << (16 + 4 * p);
        std::memcpy(group + chunk * 128 + (c / 16) * 64 + (c % 16) * 4, &lane, 4);
      }
      std::memcpy(group + CODES + 2 * c, sp + n * groups + g, 2);
      std::memcpy(group + CODES + 2 * PACK_BLOCK + 2 * c, zp + n * groups + g, 2);
    }
  }
  return packed;
}

// x [M, K] bfloat16 through a weight packed by pack_int4 (N columns): up to WIDEN_ROWS rows straight
// from the codes, tiles of MAX_TILE_ROWS, more through each block widened once to bfloat16.
void int4_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y) {
  TORCH_CHECK(int4_linear_supported(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x [M, K] bfloat16 expected");
  TORCH_CHECK(packed.dim() == 3 && packed.size(2) == GROUP_BYTES &&
                  packed.scalar_type() == torch::kUInt8,
              "a weight packed by pack_int4 expected");
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  TORCH_CHECK(K == packed.size(1) * GROUP, "x has ", K, " columns, the weight ",
              packed.size(1) * GROUP);
  check_blocks(N, blocks);
  x = x.contiguous();
  claim_output(y, M, N, x.options());
#if defined(__AVX512BF16__)
  const auto* xp = reinterpret_cast<const uint16_t*>(x.data_ptr());
  const auto* wp = packed.data_ptr<uint8_t>();
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  const int64_t block_bytes = packed.size(1) * GROUP_BYTES;
  if (M > WIDEN_ROWS) {
    sweep_packed(M, N, blocks, DOT_TILE_ROWS, [&] {
      return [&, wide = std::vector<uint16_t>(K * PACK_BLOCK)](int64_t m0, int64_t rows,
                                                                int64_t b, int64_t cols,
                                                                bool first) mutable {
        if (first) widen_block(wp + b * block_bytes, K, wide.data());
        dot_rows(xp + m0 * K, K, wide.data(), yp + m0 * N + b * PACK_BLOCK, N, cols, rows);
      };
    });
    return;
  }
  std::vector<float> sums(M * (K / GROUP));  // each row's group sums, for the zeros and offsets
  for (int64_t g = 0; g < M * (K / GROUP); ++g)  // rows are K apart, and K holds whole groups
    sums[g] = group_sum(xp + g * GROUP);
  const float* xsums = sums.data();
  sweep_packed(M, N, blocks, MAX_TILE_ROWS, [&] {
    return [&](int64_t m0, int64_t rows, int64_t b, int64_t cols, bool) {
      TILES[rows - 1](xp + m0 * K, K, xsums + m0 * (K / GROUP), wp + b * block_bytes,
                      yp + m0 * N + b * PACK_BLOCK, N, cols);
    };
  });
#endif
}

}  // namespace bucketserve

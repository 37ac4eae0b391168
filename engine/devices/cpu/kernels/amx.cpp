// bfloat16 projections in AMX tiles: a weight packed once into the tiles' layout, then every
// product (a lone decode row to a prefill) read straight from it. oneDNN's product through F.linear
// reorders the plain weight on each call, which at decode batch sizes costs more than the product.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cstdint>

#include <immintrin.h>

#include "crew.h"
#include "packed.h"

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <sys/syscall.h>
#include <unistd.h>
#define BUCKETSERVE_AMX 1
#endif

namespace bucketserve {
namespace {
constexpr int64_t AMX_BLOCK = PACK_BLOCK;  // two 16-column tiles

#if defined(BUCKETSERVE_AMX)
struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Tiles: 0, 1 accumulate rows 0-15 (columns 0-15, 16-31), 2, 3 rows 16-31; 4, 5 hold those rows'
// inputs, 6, 7 the block's weights. `top` and `bottom` rows (bottom may be 0).
void configure_tiles(int top, int bottom) {
  TileConfig config;
  auto set = [&](int tile, int rows) {
    config.rows[tile] = rows;
    config.colsb[tile] = 64;
  };
  for (int tile : {0, 1, 4}) set(tile, top);
  if (bottom)
    for (int tile : {2, 3, 5}) set(tile, bottom);
  set(6, 16);
  set(7, 16);
  _tile_loadconfig(&config);
}

// y[m0.., block's columns] for up to 32 rows of x over one packed block.
void amx_block(const char* x, int64_t x_stride, int rows, const char* block, int64_t K,
               bool stream, uint16_t* y, int64_t y_stride, int64_t cols) {
  const bool bottom = rows > 16;
  _tile_zero(0);
  _tile_zero(1);
  if (bottom) {
    _tile_zero(2);
    _tile_zero(3);
  }
  for (int64_t k = 0; k < K; k += 32) {  // 16 input pairs a step: 2 KiB of weights
    if (stream && k + 64 < K)  // the block's first pass reads DRAM: fetch two steps ahead
      for (int line = 0; line < 32; ++line)
        _mm_prefetch(block + (k + 64) * 64 + line * 64, _MM_HINT_T0);
    _tile_loadd(4, x + k * 2, x_stride);
    _tile_loadd(6, block + k * 64, 128);
    _tile_loadd(7, block + k * 64 + 64, 128);
    _tile_dpbf16ps(0, 4, 6);
    _tile_dpbf16ps(1, 4, 7);
    if (bottom) {
      _tile_loadd(5, x + 16 * x_stride + k * 2, x_stride);
      _tile_dpbf16ps(2, 5, 6);
      _tile_dpbf16ps(3, 5, 7);
    }
  }
  alignas(64) float out[32][32];
  _tile_stored(0, &out[0][0], 128);
  _tile_stored(1, &out[0][16], 128);
  if (bottom) {
    _tile_stored(2, &out[16][0], 128);
    _tile_stored(3, &out[16][16], 128);
  }
  for (int r = 0; r < rows; ++r)
    store_block_row(y + r * y_stride, _mm512_load_ps(&out[r][0]), _mm512_load_ps(&out[r][16]),
                    cols);
}

// One thread's tiles: configured for the row count of the tile at hand (a new count reconfigures),
// released when the thread's sweep ends.
class AmxTiles {
 public:
  AmxTiles(const char* x, int64_t K, const char* packed, uint16_t* y, int64_t N)
      : x_(x), K_(K), packed_(packed), y_(y), N_(N) {}
  AmxTiles(const AmxTiles&) = delete;
  AmxTiles& operator=(const AmxTiles&) = delete;
  ~AmxTiles() {
    if (configured_ >= 0) _tile_release();
  }

  void operator()(int64_t m0, int64_t rows, int64_t b, int64_t cols, bool first_pass) {
    const int count = static_cast<int>(rows);
    if (count != configured_) {
      configure_tiles(std::min(count, 16), std::max(count - 16, 0));
      configured_ = count;
    }
    const int64_t x_stride = K_ * 2;
    amx_block(x_ + m0 * x_stride, x_stride, count, packed_ + b * K_ * AMX_BLOCK * 2, K_,
              first_pass, y_ + m0 * N_ + b * AMX_BLOCK, N_, cols);
  }

 private:
  const char* x_;
  int64_t K_;
  const char* packed_;
  uint16_t* y_;
  int64_t N_;
  int configured_ = -1;
};
#endif
}  // namespace

// The CPU runs AMX bfloat16 tiles and Linux lets this process use them (the tile data state is
// off until a process asks: ARCH_REQ_XCOMP_PERM; a VM may list AMX and refuse it).
bool amx_supported() {
#if defined(BUCKETSERVE_AMX)
  static const bool permitted = [] {
    constexpr int ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
    return __builtin_cpu_supports("amx-bf16") &&
           syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) == 0;
  }();
  return permitted;
#else
  return false;
#endif
}

// w [N, K] bfloat16 -> [ceil(N / 32), K / 2, 32, 2]: per block of 32 output columns, each pair of
// inputs of all 32 columns side by side. That is AMX's B-tile layout (a tile row is one pair of
// inputs for 16 columns), so a block's 16 pairs x 32 columns are two tiles 128 bytes apart, and a
// block streams from memory in order. Columns past N are zeros.
torch::Tensor pack_bf16(torch::Tensor w) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16, "w [N, K] bfloat16 expected");
  TORCH_CHECK(w.size(1) % 32 == 0, "a multiple of 32 columns expected");
  w = w.contiguous();
  const int64_t N = w.size(0), K = w.size(1), blocks = (N + AMX_BLOCK - 1) / AMX_BLOCK;
  auto packed = torch::zeros({blocks, K / 2, AMX_BLOCK, 2}, w.options());
  const auto* src = reinterpret_cast<const uint16_t*>(w.data_ptr());
  auto* dst = reinterpret_cast<uint16_t*>(packed.data_ptr());
  parallel_for(0, N, 64, [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n)
      for (int64_t k = 0; k < K; ++k)
        dst[(((n / AMX_BLOCK) * (K / 2) + k / 2) * AMX_BLOCK + n % AMX_BLOCK) * 2 + k % 2] =
            src[n * K + k];
  });
  return packed;
}

void check_packed(const torch::Tensor& packed, int64_t K, int64_t N) {
  TORCH_CHECK(packed.dim() == 4 && packed.size(2) == PACK_BLOCK && packed.size(3) == 2 &&
                  packed.scalar_type() == torch::kBFloat16,
              "a weight packed by pack_bf16 expected");
  TORCH_CHECK(K == packed.size(1) * 2, "x has ", K, " columns, the weight ", packed.size(1) * 2);
  check_blocks(N, packed.size(0));
}

// x [M, K] @ w.T in bfloat16 with w packed by pack_bf16 (N columns), float32 accumulation in AMX
// tiles, in sweep_packed's schedule.
void amx_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N, torch::Tensor& y) {
  TORCH_CHECK(amx_supported(), "AMX bfloat16 tiles are not available on this CPU");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x [M, K] bfloat16 expected");
  check_packed(packed, x.size(1), N);
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1), blocks = packed.size(0);
  claim_output(y, M, N, x.options());
#if defined(BUCKETSERVE_AMX)
  const char* xp = reinterpret_cast<const char*>(x.data_ptr());
  const char* wp = reinterpret_cast<const char*>(packed.data_ptr());
  auto* yp = reinterpret_cast<uint16_t*>(y.data_ptr());
  sweep_packed(M, N, blocks, 32, [&] { return AmxTiles(xp, K, wp, yp, N); });
#endif
}

}  // namespace bucketserve

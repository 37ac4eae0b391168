// A draft model's LM head, screened: every logit from int4 codes of the head (int4_linear), then
// each row's SCREEN_KEEP largest recomputed from the head's int8 codes and written over theirs. A
// lone row's draft step streams its whole head once: int8, a 49152-token vocabulary is a third of
// an int4 draft's bytes; the int4 screen reads about 60% of that. A row's argmax is the int8
// head's own wherever the int8 head's best is among the screen's SCREEN_KEEP best, and the int8
// head's error against the target was what it was already: a draft's proposals are checked, so
// this only moves how many are accepted. The other logits stay the screen's (a sampled draft
// row draws from them all).
//
// Layout (pack_screened): pack_int4's blocks of the screen, then the int8 codes [vocab, K] row by
// row, then their float32 scales.
#include <torch/extension.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <functional>
#include <utility>
#include <vector>

#include <immintrin.h>

#include "int4_layout.h"
#include "packed.h"
#include "vec_math.h"

namespace bucketserve {
namespace {
using BF16 = c10::BFloat16;
// Recomputed logits a row: the screen's error (a few percent of a logit's spread) rarely moves
// the int8 head's best past its 16th place.
constexpr int SCREEN_KEEP = 16;

struct Parts {
  torch::Tensor screen;  // [blocks, groups, INT4_GROUP_BYTES]
  const int8_t* codes;   // [vocab, K]
  const float* scales;   // [vocab]
};

Parts parts_of(const torch::Tensor& packed, int64_t vocab, int64_t K) {
  TORCH_CHECK(K % INT4_GROUP == 0, "a multiple of ", INT4_GROUP, " inputs expected, got ", K);
  const int64_t blocks = (vocab + PACK_BLOCK - 1) / PACK_BLOCK, groups = K / INT4_GROUP;
  const int64_t screen = blocks * groups * INT4_GROUP_BYTES;
  TORCH_CHECK(packed.dim() == 1 && packed.scalar_type() == torch::kUInt8 &&
                  packed.numel() == screen + vocab * K + vocab * 4,
              "a head packed by pack_screened for ", vocab, " tokens of ", K, " inputs expected");
  const auto* base = packed.data_ptr<uint8_t>();
  return {packed.narrow(0, 0, screen).view({blocks, groups, INT4_GROUP_BYTES}),
          reinterpret_cast<const int8_t*>(base + screen),
          reinterpret_cast<const float*>(base + screen + vocab * K)};
}

#if defined(__AVX512BF16__)
// The indices of the `keep` largest of n bfloat16 values (never a NaN), in no particular order: a
// vector pass compares 16 values at a time with the smallest kept so far, so that only the few
// that pass it reach the heap.
std::vector<int64_t> largest(const BF16* v, int64_t n, int keep) {
  std::vector<std::pair<float, int64_t>> kept;  // a min-heap on the value
  kept.reserve(keep + 1);
  float floor = -INFINITY;
  const auto offer = [&](float x, int64_t i) {
    if (!(x > floor) && static_cast<int>(kept.size()) == keep) return;
    if (std::isnan(x)) return;
    kept.emplace_back(x, i);
    std::push_heap(kept.begin(), kept.end(), std::greater<>());
    if (static_cast<int>(kept.size()) > keep) {
      std::pop_heap(kept.begin(), kept.end(), std::greater<>());
      kept.pop_back();
    }
    if (static_cast<int>(kept.size()) == keep) floor = kept.front().first;
  };
  int64_t i = 0;
  for (; i + 16 <= n; i += 16) {
    __mmask16 above = _mm512_cmp_ps_mask(load_bf16(v + i), _mm512_set1_ps(floor), _CMP_GT_OQ);
    if (static_cast<int>(kept.size()) < keep) above = 0xFFFF;  // not full: every value is offered
    for (; above; above &= above - 1) {
      const int64_t j = i + __builtin_ctz(above);
      offer(to_float(v[j]), j);
    }
  }
  for (; i < n; ++i) offer(to_float(v[i]), i);
  std::vector<int64_t> indices;
  for (const auto& entry : kept) indices.push_back(entry.second);
  return indices;
}

// x . codes in float32, times the scale: int8_linear's logit of one token, rounded to bfloat16.
BF16 rescored(const BF16* x, const int8_t* codes, float scale, int64_t K) {
  __m512 sum = _mm512_setzero_ps();
  for (int64_t k = 0; k < K; k += 16) {
    const __m512 w = _mm512_cvtepi32_ps(_mm512_cvtepi8_epi32(
        _mm_loadu_si128(reinterpret_cast<const __m128i*>(codes + k))));
    sum = _mm512_fmadd_ps(load_bf16(x + k), w, sum);
  }
  return BF16(_mm512_reduce_add_ps(sum) * scale);
}
#endif
}  // namespace

torch::Tensor pack_screened(torch::Tensor codes, torch::Tensor scale, torch::Tensor screen_codes,
                            torch::Tensor screen_scale, torch::Tensor screen_zero) {
  TORCH_CHECK(codes.dim() == 2 && codes.scalar_type() == torch::kInt8,
              "int8 codes [vocab, K] expected");
  const int64_t vocab = codes.size(0), K = codes.size(1);
  TORCH_CHECK(scale.dim() == 1 && scale.size(0) == vocab, "scale [vocab] expected");
  TORCH_CHECK(screen_codes.sizes() == codes.sizes(), "the screen's codes [vocab, K] expected");
  const auto screen = pack_int4(screen_codes, screen_scale, screen_zero).flatten();
  return torch::cat({screen, codes.contiguous().view(torch::kUInt8).flatten(),
                     scale.to(torch::kFloat).contiguous().view(torch::kUInt8)});
}

// x [M, K] bfloat16 through a head packed by pack_screened (vocab N): bfloat16 logits [M, N].
void screened_linear_into(torch::Tensor x, const torch::Tensor& packed, int64_t N,
                          torch::Tensor& y) {
  TORCH_CHECK(int4_linear_supported(), "built without AVX512-BF16");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16, "x [M, K] bfloat16 expected");
  x = x.contiguous();
  const int64_t M = x.size(0), K = x.size(1);
  const Parts parts = parts_of(packed, N, K);
  int4_linear_into(x, parts.screen, N, y);
#if defined(__AVX512BF16__)
  const auto* xp = x.data_ptr<BF16>();
  auto* yp = y.data_ptr<BF16>();
  parallel_for(0, M, 1, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r)
      for (const int64_t token : largest(yp + r * N, N, SCREEN_KEEP))
        yp[r * N + token] =
            rescored(xp + r * K, parts.codes + token * K, parts.scales[token], K);
  });
#endif
}

}  // namespace bucketserve

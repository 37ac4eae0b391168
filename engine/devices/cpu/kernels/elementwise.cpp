// Elementwise steps of a bfloat16 decoder layer, each one pass where eager torch makes several
// calls and temporaries: rotary embedding (torch: cat, neg and four products and sums) and SiLU
// times up (chunk, silu, mul). Each rounds to bfloat16 wherever the torch path stores a tensor, so
// the rope is bitwise torch's and SiLU differs only by its exp.
#include <torch/extension.h>

#include <utility>

#include <ATen/Parallel.h>

#include <cmath>
#include <cstdint>

#include "crew.h"
#include "elementwise.h"
#include "vec_math.h"

namespace bucketserve {
using BF16 = c10::BFloat16;

// One head: out = x * cos + rotate_half(x) * sin, rotate_half(x) = (-x[half:], x[:half]).
void rotate_head(const BF16* x, const BF16* cos, const BF16* sin, BF16* out, int64_t dim) {
  const int64_t half = dim / 2;
  int64_t j = 0;
#if defined(__AVX512BF16__)
  for (; half % 16 == 0 && j < half; j += 16) {
    const __m512 x1 = load_bf16(x + j), x2 = load_bf16(x + half + j);
    const __m512 c1 = load_bf16(cos + j), c2 = load_bf16(cos + half + j);
    const __m512 s1 = load_bf16(sin + j), s2 = load_bf16(sin + half + j);
    const __m512 minus_x2 = _mm512_sub_ps(_mm512_setzero_ps(), x2);
    store_bf16(out + j, _mm512_add_ps(round_bf16(_mm512_mul_ps(x1, c1)),
                                      round_bf16(_mm512_mul_ps(minus_x2, s1))));
    store_bf16(out + half + j, _mm512_add_ps(round_bf16(_mm512_mul_ps(x2, c2)),
                                             round_bf16(_mm512_mul_ps(x1, s2))));
  }
#endif
  for (; j < half; ++j) {
    const float x1 = to_float(x[j]), x2 = to_float(x[half + j]);
    out[j] = BF16(round_as<BF16>(x1 * to_float(cos[j])) + round_as<BF16>(-x2 * to_float(sin[j])));
    out[half + j] = BF16(round_as<BF16>(x2 * to_float(cos[half + j])) +
                         round_as<BF16>(x1 * to_float(sin[half + j])));
  }
}

namespace {
torch::Tensor rotate(const torch::Tensor& x, const torch::Tensor& cos, const torch::Tensor& sin) {
  const int64_t tokens = x.size(0), heads = x.size(1), dim = x.size(2);
  auto out = torch::empty({tokens, heads, dim}, x.options());
  const auto* xp = x.data_ptr<BF16>();
  const auto* cp = cos.data_ptr<BF16>();
  const auto* sp = sin.data_ptr<BF16>();
  auto* op = out.data_ptr<BF16>();
  const int64_t token_stride = x.stride(0), head_stride = x.stride(1);
  parallel_for(0, tokens * heads, 64, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t t = item / heads, h = item % heads;
      rotate_head(xp + t * token_stride + h * head_stride, cp + t * dim, sp + t * dim,
                  op + item * dim, dim);
    }
  });
  return out;
}
}  // namespace

// q [tokens, heads, dim] and k [tokens, kv heads, dim], bfloat16, the last dimension contiguous
// (views of the fused q/k/v product); cos and sin [tokens, 1, dim]. New rotated q and k.
std::tuple<torch::Tensor, torch::Tensor> rope_bf16(torch::Tensor q, torch::Tensor k,
                                                   torch::Tensor cos, torch::Tensor sin) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && q.size(0) == k.size(0) && q.size(2) == k.size(2),
              "q [tokens, heads, dim] and k [tokens, kv heads, dim] expected");
  TORCH_CHECK(q.size(2) % 2 == 0, "an even head dim expected");
  for (const auto* t : {&q, &k, &cos, &sin})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16, "bfloat16 expected");
  TORCH_CHECK(cos.numel() == q.size(0) * q.size(2) && sin.numel() == cos.numel(),
              "cos and sin must hold one row of dim values per token");
  TORCH_CHECK(q.stride(2) == 1 && k.stride(2) == 1, "q and k must be contiguous in the head dim");
  cos = cos.contiguous();
  sin = sin.contiguous();
  return {rotate(q, cos, sin), rotate(k, cos, sin)};
}

// gate_up [tokens, 2 * I] bfloat16 (gate, then up) -> silu(gate) * up [tokens, I], with
// silu(x) = x / (1 + e^-x) in float32 rounded to bfloat16 before the product, as torch stores it.
torch::Tensor silu_and_mul(torch::Tensor gate_up) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.size(-1) % 2 == 0,
              "bfloat16 [..., 2 * I] expected");
  auto sizes = gate_up.sizes().vec();
  sizes.back() /= 2;
  auto out = torch::empty(sizes, gate_up.options());
  silu_and_mul_into(std::move(gate_up), out);
  return out;
}

void silu_and_mul_into(torch::Tensor gate_up, torch::Tensor& out) {
  TORCH_CHECK(gate_up.scalar_type() == torch::kBFloat16 && gate_up.size(-1) % 2 == 0,
              "bfloat16 [..., 2 * I] expected");
  gate_up = gate_up.contiguous();
  const int64_t width = gate_up.size(-1) / 2, rows = gate_up.numel() / gate_up.size(-1);
  TORCH_CHECK(out.scalar_type() == torch::kBFloat16 && out.is_contiguous() &&
                  out.numel() == rows * width,
              "an output of ", rows, " contiguous bfloat16 rows of ", width, " expected");
  const auto* in = gate_up.data_ptr<BF16>();
  auto* op = out.data_ptr<BF16>();
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      const BF16* gate = in + r * 2 * width;
      const BF16* up = gate + width;
      BF16* o = op + r * width;
      int64_t i = 0;
#if defined(__AVX512BF16__)
      const __m512 one = _mm512_set1_ps(1.f);
      for (; i + 16 <= width; i += 16) {
        const __m512 g = load_bf16(gate + i);
        const __m512 e = exp16(_mm512_sub_ps(_mm512_setzero_ps(), g));
        const __m512 silu = round_bf16(_mm512_div_ps(g, _mm512_add_ps(one, e)));
        store_bf16(o + i, _mm512_mul_ps(silu, load_bf16(up + i)));
      }
#endif
      for (; i < width; ++i) {
        const float g = to_float(gate[i]);
        o[i] = BF16(round_as<BF16>(g / (1.f + std::exp(-g))) * to_float(up[i]));
      }
    }
  });
}
}  // namespace bucketserve

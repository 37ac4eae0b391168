// The bfloat16 conversions and the vector math that the kernels share.
#pragma once

#include <c10/util/BFloat16.h>

#include <cstdint>
#include <cstring>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace bucketserve {
inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {  // bfloat16 is float32's upper half
  const uint32_t bits = static_cast<uint32_t>(x.x) << 16;
  float out;
  std::memcpy(&out, &bits, sizeof(out));
  return out;
}

template <typename T>
inline T from_float(float x) {
  return static_cast<T>(x);  // BFloat16: round to nearest even, as torch's casts do
}

template <typename T>
inline float round_as(float x) {  // x rounded to T and back: where the torch path stores a T
  return to_float(from_float<T>(x));
}

#if defined(__AVX512F__)
// e^x in 16 lanes: x = n ln2 + r with |r| <= ln2 / 2, e^r by its degree-6 Taylor polynomial
// (relative error under 2e-7), scaled by 2^n. Lanes below -87 give 0 (e^-87 is under float32's
// smallest normal), as the scalar exp's underflow does, -inf included; lanes above 88 give e^88.
inline __m512 exp16(__m512 x) {
  const __mmask16 tiny = _mm512_cmp_ps_mask(x, _mm512_set1_ps(-87.f), _CMP_LT_OQ);
  x = _mm512_min_ps(_mm512_max_ps(x, _mm512_set1_ps(-87.f)), _mm512_set1_ps(88.f));
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145752f), x);  // ln2's high part,
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.42860677e-6f), r);        // then its low part
  __m512 p = _mm512_set1_ps(1.f / 720);
  for (const float c : {1.f / 120, 1.f / 24, 1.f / 6, 0.5f, 1.f, 1.f})
    p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(c));
  return _mm512_maskz_mov_ps(static_cast<__mmask16>(~tiny), _mm512_scalef_ps(p, n));
}

// 16 bfloat16 values widened to float32.
inline __m512 load_bf16(const void* p) {
  const __m256i raw = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

#if defined(__AVX512BF16__)
// float32 -> bfloat16, 16 lanes, rounding to nearest even as torch's casts do.
inline __m512 round_bf16(__m512 x) {  // x rounded to bfloat16 and widened back
  return _mm512_castsi512_ps(_mm512_slli_epi32(
      _mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(x)), 16));
}
inline void store_bf16(void* p, __m512 x) {
  _mm256_storeu_si256(static_cast<__m256i*>(p), (__m256i)_mm512_cvtneps_pbh(x));
}
#endif
}  // namespace bucketserve

// Fused CPU kernels for eager decode: attention over the paged KV cache read in place, and RMS
// norm. Each matches a pure-torch function of the engine (the
// reference in the tests); float32 and bfloat16, computed in float32 and rounded where the torch
// path rounds.
#include <torch/extension.h>

#include "crew.h"
#include "decoder.h"
#include "elementwise.h"
#include "packed.h"
#include "vec_math.h"

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <type_traits>
#include <utility>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

using bucketserve::from_float;
using bucketserve::round_as;
using bucketserve::to_float;

template <typename T>
inline void load_row(const T* src, float* dst, int64_t n) {
#pragma omp simd
  for (int64_t i = 0; i < n; ++i) dst[i] = to_float(src[i]);
}

inline float dot(const float* a, const float* b, int64_t n) {
  float acc = 0.f;
#pragma omp simd reduction(+ : acc)
  for (int64_t i = 0; i < n; ++i) acc += a[i] * b[i];
  return acc;
}

#if defined(__AVX512F__)
inline __m512 load16(const float* p) { return _mm512_loadu_ps(p); }
inline __m512 load16(const c10::BFloat16* p) { return bucketserve::load_bf16(p); }
#endif

// scores[g * stride] = query[g] . key for the `group` query rows of one kv head (dim floats each)
template <typename T>
inline void score_position(const float* query, const T* key, int64_t group, int64_t dim,
                           float* kv, float* scores, int64_t stride) {
#if defined(__AVX512F__)
  if (dim % 16 == 0 && group <= 8) {
    __m512 acc[8];
    for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 k = load16(key + d);
      for (int64_t g = 0; g < group; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * dim + d), k, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) scores[g * stride] = _mm512_reduce_add_ps(acc[g]);
    return;
  }
#endif
  load_row(key, kv, dim);
  for (int64_t g = 0; g < group; ++g) scores[g * stride] = dot(query + g * dim, kv, dim);
}

// acc[g] += weights[g * stride] * value for the `group` query rows of one kv head
template <typename T>
inline void accumulate_position(const float* weights, int64_t stride, const T* value,
                                int64_t group, int64_t dim, float* kv, float* acc) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 v = load16(value + d);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * dim + d;
        const __m512 w = _mm512_set1_ps(weights[g * stride]);
        _mm512_storeu_ps(a, _mm512_fmadd_ps(w, v, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  load_row(value, kv, dim);
  for (int64_t g = 0; g < group; ++g) {
    float* a = acc + g * dim;
    for (int64_t d = 0; d < dim; ++d) a[d] += weights[g * stride] * kv[d];
  }
}

#if defined(__AVX512F__)
// Both phases of one (row, kv head) with the group and head size known at compile time, so the
// queries (phase 1) and the accumulators (phase 2) stay in registers across all positions.
// Scores go to scores[g * stride + j] (stride: the row's positions in all; a chunk of them is n);
// the accumulators start at zero, or with `resume` from what `out` holds.
template <typename T, int G, int D>
void scores_fixed(const float* query, const T* keys, const int64_t* offsets, int64_t n,
                  float* scores, int64_t stride) {
  constexpr int C = D / 16;
  __m512 qv[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) qv[g][c] = _mm512_loadu_ps(query + g * D + c * 16);
  for (int64_t j = 0; j < n; ++j) {
    __m512 k[C];
    for (int c = 0; c < C; ++c) k[c] = load16(keys + offsets[j] + c * 16);
    for (int g = 0; g < G; ++g) {
      __m512 acc = _mm512_mul_ps(qv[g][0], k[0]);
      for (int c = 1; c < C; ++c) acc = _mm512_fmadd_ps(qv[g][c], k[c], acc);
      scores[g * stride + j] = _mm512_reduce_add_ps(acc);
    }
  }
}

template <typename T, int G, int D>
void accumulate_fixed(const float* weights, const T* values, const int64_t* offsets, int64_t n,
                      float* out, int64_t stride, bool resume) {
  constexpr int C = D / 16;
  __m512 acc[G][C];
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c)
      acc[g][c] = resume ? _mm512_loadu_ps(out + g * D + c * 16) : _mm512_setzero_ps();
  for (int64_t j = 0; j < n; ++j) {
    __m512 v[C];
    for (int c = 0; c < C; ++c) v[c] = load16(values + offsets[j] + c * 16);
    for (int g = 0; g < G; ++g) {
      const __m512 w = _mm512_set1_ps(weights[g * stride + j]);
      for (int c = 0; c < C; ++c) acc[g][c] = _mm512_fmadd_ps(w, v[c], acc[g][c]);
    }
  }
  for (int g = 0; g < G; ++g)
    for (int c = 0; c < C; ++c) _mm512_storeu_ps(out + g * D + c * 16, acc[g][c]);
}

// fn(std::integral_constant<int, G>{}) for a run-time query-head group G of 1 to 8, the groups the
// attention kernels are compiled for; false for any other.
template <typename Fn>
bool with_group(int64_t group, Fn&& fn) {
  switch (group) {
    case 1: return fn(std::integral_constant<int, 1>{});
    case 2: return fn(std::integral_constant<int, 2>{});
    case 3: return fn(std::integral_constant<int, 3>{});
    case 4: return fn(std::integral_constant<int, 4>{});
    case 5: return fn(std::integral_constant<int, 5>{});
    case 6: return fn(std::integral_constant<int, 6>{});
    case 7: return fn(std::integral_constant<int, 7>{});
    case 8: return fn(std::integral_constant<int, 8>{});
    default: return false;
  }
}

template <typename T, int D>
bool attend_fixed_dim(int64_t group, bool scores_phase, const float* in, const T* cache,
                      const int64_t* offsets, int64_t n, float* out, int64_t stride,
                      bool resume) {
  return with_group(group, [&](auto g) {
    constexpr int G = decltype(g)::value;
    if (scores_phase)
      scores_fixed<T, G, D>(in, cache, offsets, n, out, stride);
    else
      accumulate_fixed<T, G, D>(in, cache, offsets, n, out, stride, resume);
    return true;
  });
}
#endif

// Whether attend_fixed has a compiled-in shape for this group and head size.
inline bool fixed_shape(int64_t group, int64_t dim) {
#if defined(__AVX512F__)
  return (dim == 64 || dim == 128) && group >= 1 && group <= 8;
#else
  return false;
#endif
}

// One phase over n positions with a compiled-in shape (fixed_shape): scores of one kv head's
// query group (in: its queries) or their weighted values (in: its softmax numerators); `stride`
// and `resume` as scores_fixed's and accumulate_fixed's. False where no shape fits.
template <typename T>
bool attend_fixed(int64_t group, int64_t dim, bool scores_phase, const float* in, const T* cache,
                  const int64_t* offsets, int64_t n, float* out, int64_t stride, bool resume) {
#if defined(__AVX512F__)
  if (dim == 64)
    return attend_fixed_dim<T, 64>(group, scores_phase, in, cache, offsets, n, out, stride,
                                   resume);
  if (dim == 128)
    return attend_fixed_dim<T, 128>(group, scores_phase, in, cache, offsets, n, out, stride,
                                    resume);
#endif
  return false;
}

// scores [group, n] -> e^(score - its group's maximum) in place; `sums` gets each group's total
// and `group_maxima`, where given, each group's maximum.
inline void softmax_numerators(float* scores, int64_t n, int64_t group, float* sums,
                               float* group_maxima = nullptr) {
  for (int64_t g = 0; g < group; ++g) {
    float* row = scores + g * n;
    float maximum = n > 0 ? row[0] : 0.f;
    int64_t j = 0;
#if defined(__AVX512F__)
    __m512 maxima = _mm512_set1_ps(maximum);  // a scalar max chain would wait on each compare
    for (; j + 16 <= n; j += 16) maxima = _mm512_max_ps(maxima, _mm512_loadu_ps(row + j));
    maximum = _mm512_reduce_max_ps(maxima);
#endif
    for (; j < n; ++j) maximum = std::max(maximum, row[j]);
    j = 0;
    float sum = 0.f;
#if defined(__AVX512F__)
    __m512 total = _mm512_setzero_ps();
    for (; j + 16 <= n; j += 16) {
      const __m512 shifted = _mm512_sub_ps(_mm512_loadu_ps(row + j), _mm512_set1_ps(maximum));
      const __m512 e = bucketserve::exp16(shifted);
      _mm512_storeu_ps(row + j, e);
      total = _mm512_add_ps(total, e);
    }
    sum = _mm512_reduce_add_ps(total);
#endif
    for (; j < n; ++j) sum += row[j] = std::exp(row[j] - maximum);
    sums[g] = sum;
    if (group_maxima != nullptr) group_maxima[g] = maximum;
  }
}

}  // namespace

namespace bucketserve {
RowSlots valid_slots(const torch::Tensor& block_list, const torch::Tensor& block_groups,
                     const torch::Tensor& block_bias, int64_t batch, int64_t cache_slots) {
  const auto blocks = block_list.accessor<int64_t, 1>();
  const auto groups = block_groups.accessor<int64_t, 1>();
  const int64_t num_blocks = block_bias.size(0), block_size = block_bias.size(1);
  const float* bias = block_bias.data_ptr<float>();
  RowSlots rows(batch);
  for (int64_t i = 0; i < num_blocks; ++i) {  // a row's blocks come in its sequence order
    const int64_t row = groups[i];
    TORCH_CHECK(row >= 0 && row < batch, "block ", i, " belongs to row ", row, " of ", batch);
    TORCH_CHECK(blocks[i] >= 0 && (blocks[i] + 1) * block_size <= cache_slots, "block ",
                blocks[i], " is outside the cache");
    for (int64_t p = 0; p < block_size; ++p)
      if (bias[i * block_size + p] >= 0.f)  // negative: past the row's length, or windowed
        rows[row].push_back(blocks[i] * block_size + p);
  }
  return rows;
}

#if defined(__AVX512BF16__)
// r[j] = the sum of the 16 lanes of a[j], for 16 vectors: a transposing tree of adds (45 shuffles
// and adds for 16 sums, where one horizontal sum each would take about 9).
// Inlined into its caller, so that the 16 sums stay in registers (a call spilled them to the stack).
__attribute__((always_inline)) inline __m512 sum_lanes16(__m512 a[16]) {
  __m512 b[8], c[4], d[2];
  for (int i = 0; i < 8; ++i)  // per 128-bit lane: [a0+a2, b0+b2, a1+a3, b1+b3]
    b[i] = _mm512_add_ps(_mm512_unpacklo_ps(a[2 * i], a[2 * i + 1]),
                         _mm512_unpackhi_ps(a[2 * i], a[2 * i + 1]));
  for (int i = 0; i < 4; ++i) {  // per 128-bit lane: the lane sums of 4 vectors
    const __m512d x = _mm512_castps_pd(b[2 * i]), y = _mm512_castps_pd(b[2 * i + 1]);
    c[i] = _mm512_add_ps(_mm512_castpd_ps(_mm512_unpacklo_pd(x, y)),
                         _mm512_castpd_ps(_mm512_unpackhi_pd(x, y)));
  }
  for (int i = 0; i < 2; ++i)  // lanes 0+1 and 2+3, of 8 vectors
    d[i] = _mm512_add_ps(_mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0x88),
                         _mm512_shuffle_f32x4(c[2 * i], c[2 * i + 1], 0xDD));
  return _mm512_add_ps(_mm512_shuffle_f32x4(d[0], d[1], 0x88),
                       _mm512_shuffle_f32x4(d[0], d[1], 0xDD));
}

// scores[g * stride + j] = scale * q[g] . k[j] for up to 16 positions and a kv head's G queries,
// in bfloat16 dot products (each pair of products exact in float32) summed in float32.
template <int G, int D>
void scores_chunk_bf16(const c10::BFloat16* q, int64_t q_head, const c10::BFloat16* keys,
                       const int64_t* offsets, int64_t count, float scale, float* scores,
                       int64_t stride) {
  constexpr int C = D / 32;  // 32 bfloat16 a vector
  const __mmask16 valid = static_cast<__mmask16>((1u << count) - 1);
  for (int g = 0; g < G; ++g) {
    __m512bh query[C];
    for (int c = 0; c < C; ++c)
      query[c] = (__m512bh)_mm512_loadu_si512(q + g * q_head + c * 32);
    __m512 acc[16];
    for (int j = 0; j < 16; ++j) {
      acc[j] = _mm512_setzero_ps();
      if (j >= count) continue;
      const c10::BFloat16* key = keys + offsets[j];
      for (int c = 0; c < C; ++c)
        acc[j] = _mm512_dpbf16_ps(acc[j], query[c], (__m512bh)_mm512_loadu_si512(key + c * 32));
    }
    _mm512_mask_storeu_ps(scores + g * stride, valid,
                          _mm512_mul_ps(sum_lanes16(acc), _mm512_set1_ps(scale)));
  }
}

template <int G>
bool scores_chunk_group(int64_t dim, const c10::BFloat16* q, int64_t q_head,
                        const c10::BFloat16* keys, const int64_t* offsets, int64_t count,
                        float scale, float* scores, int64_t stride) {
  if (dim == 64)
    scores_chunk_bf16<G, 64>(q, q_head, keys, offsets, count, scale, scores, stride);
  else if (dim == 128)
    scores_chunk_bf16<G, 128>(q, q_head, keys, offsets, count, scale, scores, stride);
  else
    return false;
  return true;
}

inline bool scores_chunk(int64_t group, int64_t dim, const c10::BFloat16* q, int64_t q_head,
                         const c10::BFloat16* keys, const int64_t* offsets, int64_t count,
                         float scale, float* scores, int64_t stride) {
  return with_group(group, [&](auto g) {
    return scores_chunk_group<decltype(g)::value>(dim, q, q_head, keys, offsets, count, scale,
                                                  scores, stride);
  });
}
#endif

// What one attention call reads and writes, and its shape.
template <typename T>
struct Attention {
  const T *q, *keys, *values;
  T* out;
  int64_t heads, kv_heads, group, dim, q_row, q_head, slot_stride, head_stride;
  float scale;

  // The `count` query heads from `first` of a row, scaled, into query [count, dim].
  void load_queries(int64_t row, int64_t first, int64_t count, float* query) const {
    for (int64_t h = 0; h < count; ++h) {
      load_row(q + row * q_row + (first + h) * q_head, query + h * dim, dim);
      for (int64_t d = 0; d < dim; ++d) query[h * dim + d] *= scale;
    }
  }

  // out[row, first + h] = acc[h] / sums[h] for `count` heads (zeros where a row has no position).
  void store(int64_t row, int64_t first, int64_t count, const float* acc, const float* sums,
             bool empty) const {
    for (int64_t h = 0; h < count; ++h) {
      const float inv = empty ? 0.f : 1.f / sums[h];
      T* o = out + (row * heads + first + h) * dim;
      for (int64_t d = 0; d < dim; ++d) o[d] = from_float<T>(acc[h * dim + d] * inv);
    }
  }
};

constexpr int64_t CHUNK = 16;  // positions a row reads for all its kv heads before moving on

// A bfloat16 head group's scores at n positions (keys + offsets[j]) into scores[g * stride + j],
// in scores_chunk's bfloat16 dot products, 16 positions at a time: attend_row scores so, and
// bfloat16 goes span by span through it on every path. False where it does not (float32, other
// shapes, no AVX512-BF16).
template <typename T>
bool bf16_scores(const Attention<T>& a, int64_t row, int64_t kv_head, const T* keys,
                 const int64_t* offsets, int64_t n, float* scores, int64_t stride) {
#if defined(__AVX512BF16__)
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    if (!fixed_shape(a.group, a.dim)) return false;
    const T* q = a.q + row * a.q_row + kv_head * a.group * a.q_head;
    for (int64_t start = 0; start < n; start += CHUNK)
      scores_chunk(a.group, a.dim, q, a.q_head, keys, offsets + start, std::min(CHUNK, n - start),
                   a.scale, scores + start, stride);
    return true;
  }
#endif
  return false;
}

// Whether bf16_scores takes this attention's scores (its float32 queries then go unused).
template <typename T>
bool scores_in_bf16(const Attention<T>& a) {
#if defined(__AVX512BF16__)
  return std::is_same_v<T, c10::BFloat16> && fixed_shape(a.group, a.dim);
#else
  return false;
#endif
}

// One (row, kv head): every position of the row for that head's query group (float32, and
// bfloat16 heads of a shape attend_row has no compiled form for).
template <typename T>
void attend_head(const Attention<T>& a, int64_t row, int64_t kv_head,
                 const std::vector<int64_t>& mine, std::vector<float>& query,
                 std::vector<float>& acc, std::vector<float>& kv, std::vector<float>& scores,
                 std::vector<float>& sums, std::vector<int64_t>& valid) {
  const int64_t n = static_cast<int64_t>(mine.size()), group = a.group, dim = a.dim;
  scores.resize(group * n);
  valid.resize(n);
  for (int64_t j = 0; j < n; ++j)  // element offsets of the row's keys and values
    valid[j] = mine[j] * a.slot_stride + kv_head * a.head_stride;
  a.load_queries(row, kv_head * group, group, query.data());
  if (!attend_fixed(group, dim, true, query.data(), a.keys, valid.data(), n, scores.data(), n,
                    false))
    for (int64_t j = 0; j < n; ++j)
      score_position(query.data(), a.keys + valid[j], group, dim, kv.data(), &scores[j], n);
  softmax_numerators(scores.data(), n, group, sums.data());
  if (!attend_fixed(group, dim, false, scores.data(), a.values, valid.data(), n, acc.data(), n,
                    false)) {
    std::fill(acc.begin(), acc.end(), 0.f);
    for (int64_t j = 0; j < n; ++j)
      accumulate_position(&scores[j], n, a.values + valid[j], group, dim, kv.data(), acc.data());
  }
  a.store(row, kv_head * group, group, acc.data(), sums.data(), n == 0);
}


// The lines of `count` slots' entries for every kv head (contiguous within a slot), fetched ahead:
// a paged cache's blocks lie anywhere, which no hardware prefetcher foresees.
template <typename T>
void prefetch_slots(const T* cache, const int64_t* offsets, int64_t count, int64_t bytes) {
  for (int64_t j = 0; j < count; ++j) {
    const char* entry = reinterpret_cast<const char*>(cache + offsets[j]);
    for (int64_t line = 0; line < bytes; line += 64) __builtin_prefetch(entry + line, 0, 3);
  }
}


// One row, all its kv heads, chunk by chunk: a chunk's keys (then values) of every head are read
// together, so each slot's entries stream in order, and the next chunk's are fetched meanwhile.
// In bfloat16 the scores are bfloat16 dot products, 16 positions summed at once (scores_chunk),
// the scale applied to the sum; in float32, and for the weighted values, the arithmetic and order
// of attend_head (the accumulators carried between chunks in float32). Needs fixed_shape.
// With `maxima`, over just the n slots given (a span of the row, see attend_spans) and the kv heads
// of `kv` (their query heads' acc, sums and maxima; the others' are left as they were): acc and
// sums are left unnormalized, relative to each head's maximum, which goes to maxima.
struct KvRange {
  int64_t first, count;  // a count of -1: every kv head from `first`
};

template <typename T>
void attend_row(const Attention<T>& a, int64_t row, const int64_t* mine, int64_t n,
                std::vector<float>& query, std::vector<float>& acc, std::vector<float>& scores,
                std::vector<float>& sums, std::vector<int64_t>& offsets,
                float* maxima = nullptr, KvRange kv = {0, -1}) {
  const int64_t group = a.group, dim = a.dim;
  if (kv.count < 0) kv.count = a.kv_heads;
  // the range's part of each slot's entry (its kv heads are side by side)
  const int64_t entry = kv.count * a.head_stride * static_cast<int64_t>(sizeof(T));
  scores.resize(a.heads * n);
  offsets.resize(n);
  for (int64_t j = 0; j < n; ++j) offsets[j] = mine[j] * a.slot_stride;
  const bool in_bf16 = scores_in_bf16(a);
  if (!in_bf16) a.load_queries(row, 0, a.heads, query.data());  // bf16 scores read q as it is
  for (const bool scores_phase : {true, false}) {
    const T* cache = scores_phase ? a.keys : a.values;
    const T* range = cache + kv.first * a.head_stride;
    prefetch_slots(range, offsets.data(), std::min(CHUNK, n), entry);
    for (int64_t start = 0; start < n; start += CHUNK) {
      const int64_t count = std::min(CHUNK, n - start);
      prefetch_slots(range, offsets.data() + start + count, std::min(CHUNK, n - start - count),
                     entry);
      for (int64_t h = kv.first; h < kv.first + kv.count; ++h) {
        float* head_scores = scores.data() + h * group * n + start;
        const T* head_cache = cache + h * a.head_stride;
        if (scores_phase) {
          if (!in_bf16 ||
              !bf16_scores(a, row, h, head_cache, offsets.data() + start, count, head_scores, n))
            attend_fixed(group, dim, true, query.data() + h * group * dim, head_cache,
                         offsets.data() + start, count, head_scores, n, false);
        }
        else
          attend_fixed(group, dim, false, head_scores, head_cache, offsets.data() + start, count,
                       acc.data() + h * group * dim, n, start > 0);
      }
    }
    if (scores_phase) {
      const int64_t first = kv.first * group;  // the range's first query head
      softmax_numerators(scores.data() + first * n, n, kv.count * group, sums.data() + first,
                         maxima ? maxima + first : nullptr);
    }
  }
  if (!maxima) a.store(row, 0, a.heads, acc.data(), sums.data(), n == 0);
}

// Items 0..count dealt into at most `hands` lists of about equal cost, each item to the
// cheapest list so far, the costliest first: work of uneven items for parallel_for's even pieces.
template <typename Cost>
std::vector<std::vector<int64_t>> deal(int64_t count, int64_t hands, const Cost& cost) {
  std::vector<int64_t> order(count);
  for (int64_t i = 0; i < count; ++i) order[i] = i;
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return cost(x) > cost(y); });
  std::vector<std::vector<int64_t>> lists(std::max<int64_t>(1, std::min(hands, count)));
  std::vector<int64_t> load(lists.size(), 0);
  for (const int64_t item : order) {
    const auto lightest = std::min_element(load.begin(), load.end()) - load.begin();
    lists[lightest].push_back(item);
    load[lightest] += cost(item);
  }
  return lists;
}

// Positions a span of attend_spans holds: a fixed count, so that the bits do not depend on how
// the work is split.
constexpr int64_t SPAN = 64;

// bfloat16 attention span by span, as flash-decoding splits it: each row's slots cut into spans
// of SPAN positions, each span's heads attended on their own (attend_row over the span: scores,
// e^(score - the span's maximum), weighted values), then the row's spans merged in order,
// acc = sum over spans of acc_s e^(max_s - max). `by_row`: a thread takes whole rows; else the
// spans are shared out (a lone row, whose few kv heads split badly over the threads) and the rows
// merged after. Both run the same arithmetic in the same order: the same bits either way.
template <typename T>
void attend_spans(const Attention<T>& a, const RowSlots& slots, int64_t batch, bool by_row) {
  const int64_t heads = a.heads, dim = a.dim, stride = heads * (dim + 2);
  std::vector<int64_t> first_span(batch + 1, 0);  // row r's spans: first_span[r] to [r + 1]
  for (int64_t r = 0; r < batch; ++r)
    first_span[r + 1] = first_span[r] + (static_cast<int64_t>(slots[r].size()) + SPAN - 1) / SPAN;
  // per span: acc [heads, dim], then the heads' sums, then their maxima
  std::vector<float> partial(first_span[batch] * stride);
  struct Buffers {
    std::vector<float> query, acc, scores, sums;
    std::vector<int64_t> offsets;
  };
  // where a row's span starts among its slots, and how many it holds
  const auto start_of = [&](int64_t row, int64_t span) { return (span - first_span[row]) * SPAN; };
  const auto positions = [&](int64_t row, int64_t span) {
    return std::min<int64_t>(SPAN, static_cast<int64_t>(slots[row].size()) - start_of(row, span));
  };
  // a span's kv heads `kv`
  const auto attend_span = [&](int64_t row, int64_t span, Buffers& b, KvRange kv) {
    float* out = partial.data() + span * stride;
    attend_row(a, row, slots[row].data() + start_of(row, span), positions(row, span), b.query,
               b.acc, b.scores, b.sums, b.offsets, out + heads * dim + heads, kv);
    const int64_t first = kv.first * a.group, count = kv.count * a.group;  // query heads
    std::copy_n(b.acc.begin() + first * dim, count * dim, out + first * dim);
    std::copy_n(b.sums.begin() + first, count, out + heads * dim + first);
  };
  const KvRange all{0, a.kv_heads};
  // a row's query heads [first, first + count) merged over its spans and stored
  const auto merge_heads = [&](int64_t row, int64_t first, int64_t count, Buffers& b) {
    for (int64_t h = first; h < first + count; ++h) {
      b.sums[h] = 0.f;
      std::fill_n(b.acc.begin() + h * dim, dim, 0.f);
      float maximum = -INFINITY;
      for (int64_t i = first_span[row]; i < first_span[row + 1]; ++i)
        maximum = std::max(maximum, partial[i * stride + heads * dim + heads + h]);
      for (int64_t i = first_span[row]; i < first_span[row + 1]; ++i) {
        const float* span = partial.data() + i * stride;
        const float weight = std::exp(span[heads * dim + heads + h] - maximum);
        b.sums[h] += span[heads * dim + h] * weight;
        for (int64_t d = 0; d < dim; ++d) b.acc[h * dim + d] += span[h * dim + d] * weight;
      }
    }
    a.store(row, first, count, b.acc.data() + first * dim, b.sums.data() + first,
            first_span[row] == first_span[row + 1]);
  };
  const auto buffers = [&] {
    return Buffers{std::vector<float>(heads * dim), std::vector<float>(heads * dim), {},
                   std::vector<float>(heads), {}};
  };
  if (by_row) {
    parallel_for(0, batch, 1, [&](int64_t begin, int64_t end) {
      Buffers b = buffers();
      for (int64_t r = begin; r < end; ++r) {
        for (int64_t i = first_span[r]; i < first_span[r + 1]; ++i) attend_span(r, i, b, all);
        merge_heads(r, 0, heads, b);
      }
    });
    return;
  }
  // Few rows: each span's kv heads are items of their own, dealt out by their positions (a lone
  // row of 160 positions has spans of 64, 64 and 32 over 3 kv heads: whole spans in two halves
  // split 128 positions to 32), and the merged heads too.
  std::vector<int64_t> row_of(first_span[batch]);
  for (int64_t r = 0; r < batch; ++r)
    std::fill(row_of.begin() + first_span[r], row_of.begin() + first_span[r + 1], r);
  const auto hands = deal(first_span[batch] * a.kv_heads, at::get_num_threads(), [&](int64_t item) {
    const int64_t span = item / a.kv_heads;
    return positions(row_of[span], span);
  });
  parallel_for(0, static_cast<int64_t>(hands.size()), 1, [&](int64_t begin, int64_t end) {
    Buffers b = buffers();
    for (int64_t hand = begin; hand < end; ++hand)
      for (const int64_t item : hands[hand]) {
        const int64_t span = item / a.kv_heads;
        attend_span(row_of[span], span, b, KvRange{item % a.kv_heads, 1});
      }
  });
  parallel_for(0, batch * heads, 1, [&](int64_t begin, int64_t end) {
    Buffers b = buffers();
    for (int64_t i = begin; i < end; ++i) merge_heads(i / heads, i % heads, 1, b);
  });
}

// out[b, h] = softmax(q[b, h] . K[row b's slots, h / group]) V[...]. bfloat16 goes span by span
// (attend_spans). float32: a batch of at least two rows a thread goes row by row (attend_row);
// fewer rows split further, by kv head (attend_head).
template <typename T>
void attend_impl(const torch::Tensor& q, const torch::Tensor& key_cache,
                 const torch::Tensor& value_cache, const RowSlots& slots, double scale,
                 torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  const Attention<T> a{q.data_ptr<T>(),      key_cache.data_ptr<T>(), value_cache.data_ptr<T>(),
                       out.data_ptr<T>(),    heads,
                       kv_heads,             group,
                       dim,                  q.stride(0),
                       q.stride(1),          key_cache.stride(0),
                       key_cache.stride(1),  static_cast<float>(scale)};
  const bool by_row = fixed_shape(group, dim) && batch >= 2 * at::get_num_threads();
  if (std::is_same_v<T, c10::BFloat16> && fixed_shape(group, dim)) {
    attend_spans(a, slots, batch, by_row);
    return;
  }
  parallel_for(0, by_row ? batch : batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    // one thread's buffers, sized for its longest row
    std::vector<float> query(heads * dim), acc(heads * dim), kv(dim), scores, sums(heads);
    std::vector<int64_t> offsets;
    for (int64_t item = begin; item < end; ++item) {
      if (by_row)
        attend_row(a, item, slots[item].data(), static_cast<int64_t>(slots[item].size()), query,
                   acc, scores, sums, offsets);
      else
        attend_head(a, item / kv_heads, item % kv_heads, slots[item / kv_heads], query, acc, kv,
                    scores, sums, offsets);
    }
  });
}

void attend(const torch::Tensor& q, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const RowSlots& slots, double scale,
            torch::Tensor& out) {
  if (q.scalar_type() == torch::kFloat) {
    attend_impl<float>(q, key_cache, value_cache, slots, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
    attend_impl<c10::BFloat16>(q, key_cache, value_cache, slots, scale, out);
  }
}
}  // namespace bucketserve

namespace {
torch::Tensor decode_attention(torch::Tensor q, torch::Tensor key_cache, torch::Tensor value_cache,
                               torch::Tensor block_list, torch::Tensor block_groups,
                               torch::Tensor block_bias, double scale) {
  TORCH_CHECK(q.dim() == 3 && key_cache.dim() == 3 && value_cache.dim() == 3,
              "q [batch, heads, dim] and caches [slots, kv_heads, dim] expected");
  TORCH_CHECK(key_cache.sizes() == value_cache.sizes(), "key and value caches differ in shape");
  TORCH_CHECK(q.scalar_type() == key_cache.scalar_type() &&
                  q.scalar_type() == value_cache.scalar_type(),
              "q and the caches must share a dtype");
  TORCH_CHECK(q.size(2) == key_cache.size(2) && q.size(1) % key_cache.size(1) == 0,
              "q's heads must be a multiple of the cache's kv heads, with the same head dim");
  TORCH_CHECK(key_cache.stride(2) == 1 && value_cache.stride(2) == 1 &&
                  key_cache.strides() == value_cache.strides(),
              "caches must be contiguous in their last dimension, with equal strides");
  TORCH_CHECK(block_bias.dim() == 2 && block_list.size(0) == block_bias.size(0) &&
                  block_groups.size(0) == block_bias.size(0),
              "block_list, block_groups and block_bias must have one entry per block");
  q = q.stride(2) == 1 ? q : q.contiguous();
  const auto slots =
      bucketserve::valid_slots(block_list.to(torch::kLong).contiguous(),
                               block_groups.to(torch::kLong).contiguous(),
                               block_bias.to(torch::kFloat).contiguous(), q.size(0),
                               key_cache.size(0));
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  bucketserve::attend(q, key_cache, value_cache, slots, scale, out);
  return out;
}

}  // namespace

namespace bucketserve {
// engine.layers.norm.RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) with x in float32, the
// normalized row stored as T before the product.
template <typename T>
void rms_norm_impl(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> row(hidden);
    for (int64_t r = begin; r < end; ++r) {
      load_row(x + r * hidden, row.data(), hidden);
      const float mean = dot(row.data(), row.data(), hidden) / static_cast<float>(hidden);
      const float inv = 1.f / std::sqrt(mean + eps);
      T* o = out + r * hidden;
      for (int64_t i = 0; i < hidden; ++i)
        o[i] = from_float<T>(to_float(weight[i]) * round_as<T>(row[i] * inv));
    }
  });
}

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps) {
  auto out = torch::empty_like(x, at::MemoryFormat::Contiguous);
  rms_norm_into(std::move(x), std::move(weight), eps, out);
  return out;
}

void rms_norm_into(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor& out) {
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight must match x's last dim");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  TORCH_CHECK(out.scalar_type() == x.scalar_type() && out.is_contiguous() &&
                  out.numel() == x.numel(),
              "an output shaped as x, contiguous, expected");
  if (x.scalar_type() == torch::kFloat) {
    rms_norm_impl(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows,
                  hidden, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
    rms_norm_impl(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>(), rows, hidden, static_cast<float>(eps));
  }
}

}  // namespace bucketserve

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  // The kernels run without the GIL: the shard's server thread answers meanwhile (and a lookahead
  // forward overlaps the router's turn).
  const auto free = py::call_guard<py::gil_scoped_release>();
  m.def("decode_attention", &decode_attention, free,
        "paged decode attention, blocks read in place");
  m.def("rms_norm", &bucketserve::rms_norm, free, "RMS norm as engine.layers.norm.RMSNorm");
  m.def("rope_bf16", &bucketserve::rope_bf16, free, "rotary embedding as engine.layers.rotary");
  m.def("silu_and_mul", &bucketserve::silu_and_mul, free, "silu(gate) * up as LlamaMLP");
  m.def("amx_supported", &bucketserve::amx_supported, "whether AMX bfloat16 tiles may run");
  m.def("pack_bf16", &bucketserve::pack_bf16, free,
        "a bfloat16 weight in amx_linear's blocked layout");
  m.def("amx_linear", &bucketserve::with_new_output<&bucketserve::amx_linear_into>, free,
        "bfloat16 projection in AMX tiles");
  m.def("dot_linear_supported", &bucketserve::dot_linear_supported,
        "whether dot_linear was built (AVX512-BF16)");
  m.def("dot_linear", &bucketserve::with_new_output<&bucketserve::dot_linear_into>, free,
        "bfloat16 projection in AVX512-BF16 dot products");
  m.def("fma_linear_supported", &bucketserve::fma_linear_supported,
        "whether fma_linear was built (AVX2 and FMA)");
  m.def("fma_linear", &bucketserve::with_new_output<&bucketserve::fma_linear_into>, free,
        "bfloat16 projection in AVX2 fused multiply-adds");
  m.def("int4_linear_supported", &bucketserve::int4_linear_supported,
        "whether int4_linear was built (AVX512-BF16)");
  m.def("pack_int4", &bucketserve::pack_int4, free, "int4 codes, scales and zeros packed by block");
  m.def("int4_linear", &bucketserve::with_new_output<&bucketserve::int4_linear_into>, free,
        "int4 projection in AVX512-BF16 dot products");
  m.def("pack_screened", &bucketserve::pack_screened, free,
        "a draft's LM head: an int4 screen and the int8 rows that rescore its best");
  m.def("screened_linear",
        &bucketserve::with_new_output<&bucketserve::screened_linear_into>, free,
        "a screened head's bfloat16 logits: int4 for all, int8 for each row's best");
  m.def("pack_int8", &bucketserve::pack_int8, free, "int8 codes and scales packed by block");
  m.def("int8_linear", &bucketserve::with_new_output<&bucketserve::int8_linear_into>, free,
        "int8 projection in AVX512-BF16 dot products (dot_linear_supported)");
  m.def("decode_layers", &bucketserve::decode_layers, free,
        "every layer of a plain Llama-family bfloat16 decode step in one call");
  m.def("extend_layers", &bucketserve::extend_layers, free,
        "decode_layers for rows of several new tokens over cached context");
  m.def("final_logits", &bucketserve::final_logits, free,
        "the final RMS norm and packed LM head of chosen rows, as float32 logits");
  m.def("greedy_steps", &bucketserve::greedy_steps, free,
        "greedy proposals of one row, prompt lookup's guesses checked on the way: forwards, final "
        "norm, LM head and argmax, in one call");
  m.attr("GUESS_ROWS") = bucketserve::GUESS_ROWS;
  m.def("prompt_lookup", &bucketserve::prompt_lookup, free,
        "for the tests: greedy_steps' guesses (engine.speculative.ngram.NgramIndex.propose's rule)");
  m.def("first_argmax", &bucketserve::first_argmax, free,
        "for the tests: greedy_steps' argmax of bfloat16 logits (torch.argmax's rule)");
  m.def("crew_members", &bucketserve::crew_members, free,
        "for the tests: which crew thread took each item of one parallel_for");
}

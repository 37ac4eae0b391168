// Fused CPU kernels for eager decode: attention over the paged KV cache read in place, and RMS
// norm. Each matches a pure-torch function of the engine (the
// reference in the tests); float32 and bfloat16, computed in float32 and rounded where the torch
// path rounds.
#include <torch/extension.h>

#include <ATen/Parallel.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>

#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

inline float to_float(float x) { return x; }
inline float to_float(c10::BFloat16 x) {
  uint32_t bits = static_cast<uint32_t>(x.x) << 16;
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
inline __m512 load16(const c10::BFloat16* p) {  // bfloat16 is float32's upper half
  const __m256i raw = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(p));
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(raw), 16));
}
#endif

// scores[g] = query[g] . key for the `group` query rows of one kv head (dim floats each)
template <typename T>
inline void score_position(const float* query, const T* key, int64_t group, int64_t dim,
                           float* kv, float* scores) {
#if defined(__AVX512F__)
  if (dim % 16 == 0 && group <= 8) {
    __m512 acc[8];
    for (int64_t g = 0; g < group; ++g) acc[g] = _mm512_setzero_ps();
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 k = load16(key + d);
      for (int64_t g = 0; g < group; ++g)
        acc[g] = _mm512_fmadd_ps(_mm512_loadu_ps(query + g * dim + d), k, acc[g]);
    }
    for (int64_t g = 0; g < group; ++g) scores[g] = _mm512_reduce_add_ps(acc[g]);
    return;
  }
#endif
  load_row(key, kv, dim);
  for (int64_t g = 0; g < group; ++g) scores[g] = dot(query + g * dim, kv, dim);
}

// acc[g] += weights[g] * value for the `group` query rows of one kv head
template <typename T>
inline void accumulate_position(const float* weights, const T* value, int64_t group, int64_t dim,
                                float* kv, float* acc) {
#if defined(__AVX512F__)
  if (dim % 16 == 0) {
    for (int64_t d = 0; d < dim; d += 16) {
      const __m512 v = load16(value + d);
      for (int64_t g = 0; g < group; ++g) {
        float* a = acc + g * dim + d;
        _mm512_storeu_ps(a, _mm512_fmadd_ps(_mm512_set1_ps(weights[g]), v, _mm512_loadu_ps(a)));
      }
    }
    return;
  }
#endif
  load_row(value, kv, dim);
  for (int64_t g = 0; g < group; ++g) {
    float* a = acc + g * dim;
    for (int64_t d = 0; d < dim; ++d) a[d] += weights[g] * kv[d];
  }
}

// out[b, h] = softmax(q[b, h] . K[row b's positions, h / group]) V[...], over every position of
// row b's blocks whose bias is not negative (the blocks of block_list owned by b, in order).
template <typename T>
void decode_attention_impl(const torch::Tensor& q, const torch::Tensor& key_cache,
                           const torch::Tensor& value_cache, const torch::Tensor& block_list,
                           const torch::Tensor& block_groups, const torch::Tensor& block_bias,
                           double scale, torch::Tensor& out) {
  const int64_t batch = q.size(0), heads = q.size(1), dim = q.size(2);
  const int64_t kv_heads = key_cache.size(1), group = heads / kv_heads;
  const int64_t num_blocks = block_bias.size(0), block_size = block_bias.size(1);
  const auto blocks = block_list.accessor<int64_t, 1>();
  const auto groups = block_groups.accessor<int64_t, 1>();
  std::vector<std::vector<int64_t>> owned(batch);  // flat indices of each row's blocks
  for (int64_t i = 0; i < num_blocks; ++i) {
    const int64_t row = groups[i];
    TORCH_CHECK(row >= 0 && row < batch, "block ", i, " belongs to row ", row, " of ", batch);
    owned[row].push_back(i);
  }
  const int64_t slots = key_cache.size(0);
  for (int64_t i = 0; i < num_blocks; ++i)
    TORCH_CHECK(blocks[i] >= 0 && (blocks[i] + 1) * block_size <= slots, "block ", blocks[i],
                " is outside the cache");
  const T* qp = q.data_ptr<T>();
  const T* kp = key_cache.data_ptr<T>();
  const T* vp = value_cache.data_ptr<T>();
  const float* bias = block_bias.data_ptr<float>();
  T* op = out.data_ptr<T>();
  const int64_t q_row = q.stride(0), q_head = q.stride(1);
  const int64_t slot_stride = key_cache.stride(0), head_stride = key_cache.stride(1);

  at::parallel_for(0, batch * kv_heads, 1, [&](int64_t begin, int64_t end) {
    std::vector<float> query(group * dim), acc(group * dim), kv(dim), scores;
    for (int64_t item = begin; item < end; ++item) {
      const int64_t row = item / kv_heads, kv_head = item % kv_heads;
      const auto& mine = owned[row];
      const int64_t positions = static_cast<int64_t>(mine.size()) * block_size;
      scores.assign(group * positions, 0.f);
      std::vector<int64_t> valid;
      valid.reserve(positions);
      for (int64_t g = 0; g < group; ++g) {
        load_row(qp + row * q_row + (kv_head * group + g) * q_head, &query[g * dim], dim);
        for (int64_t d = 0; d < dim; ++d) query[g * dim + d] *= static_cast<float>(scale);
      }
      for (size_t b = 0; b < mine.size(); ++b) {
        const int64_t block = blocks[mine[b]];
        for (int64_t p = 0; p < block_size; ++p) {
          if (bias[mine[b] * block_size + p] < 0.f) continue;  // past the row's length, or windowed
          const int64_t slot = block * block_size + p;
          const int64_t j = static_cast<int64_t>(valid.size());
          score_position(query.data(), kp + slot * slot_stride + kv_head * head_stride, group, dim,
                         kv.data(), &scores[j * group]);
          valid.push_back(slot);
        }
      }
      const int64_t n = static_cast<int64_t>(valid.size());
      std::vector<float> maxima(group, -INFINITY), sums(group, 0.f);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t g = 0; g < group; ++g) maxima[g] = std::max(maxima[g], scores[j * group + g]);
      for (int64_t j = 0; j < n; ++j)
        for (int64_t g = 0; g < group; ++g) {
          float& s = scores[j * group + g];
          s = std::exp(s - maxima[g]);
          sums[g] += s;
        }
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t j = 0; j < n; ++j)
        accumulate_position(&scores[j * group], vp + valid[j] * slot_stride + kv_head * head_stride,
                            group, dim, kv.data(), acc.data());
      for (int64_t g = 0; g < group; ++g) {  // a row with no valid position (padding) gets zeros
        const float inv = n > 0 ? 1.f / sums[g] : 0.f;
        T* o = op + (row * heads + kv_head * group + g) * dim;
        for (int64_t d = 0; d < dim; ++d) o[d] = from_float<T>(acc[g * dim + d] * inv);
      }
    }
  });
}

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
  auto blocks = block_list.to(torch::kLong).contiguous();
  auto groups = block_groups.to(torch::kLong).contiguous();
  auto bias = block_bias.to(torch::kFloat).contiguous();
  auto out = torch::empty({q.size(0), q.size(1), q.size(2)}, q.options());
  if (q.scalar_type() == torch::kFloat) {
    decode_attention_impl<float>(q, key_cache, value_cache, blocks, groups, bias, scale, out);
  } else {
    TORCH_CHECK(q.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
    decode_attention_impl<c10::BFloat16>(q, key_cache, value_cache, blocks, groups, bias, scale,
                                         out);
  }
  return out;
}

// engine.layers.norm.RMSNorm: weight * (x * rsqrt(mean(x^2) + eps)) with x in float32, the
// normalized row stored as T before the product.
template <typename T>
void rms_norm_impl(const T* x, const T* weight, T* out, int64_t rows, int64_t hidden, float eps) {
  at::parallel_for(0, rows, 1, [&](int64_t begin, int64_t end) {
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
  TORCH_CHECK(weight.dim() == 1 && x.size(-1) == weight.size(0), "weight must match x's last dim");
  TORCH_CHECK(x.scalar_type() == weight.scalar_type(), "x and weight must share a dtype");
  x = x.contiguous();
  weight = weight.contiguous();
  const int64_t hidden = x.size(-1), rows = x.numel() / std::max<int64_t>(hidden, 1);
  auto out = torch::empty_like(x);
  if (x.scalar_type() == torch::kFloat) {
    rms_norm_impl(x.data_ptr<float>(), weight.data_ptr<float>(), out.data_ptr<float>(), rows,
                  hidden, static_cast<float>(eps));
  } else {
    TORCH_CHECK(x.scalar_type() == torch::kBFloat16, "float32 or bfloat16 expected");
    rms_norm_impl(x.data_ptr<c10::BFloat16>(), weight.data_ptr<c10::BFloat16>(),
                  out.data_ptr<c10::BFloat16>(), rows, hidden, static_cast<float>(eps));
  }
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("decode_attention", &decode_attention, "paged decode attention, blocks read in place");
  m.def("rms_norm", &rms_norm, "RMS norm as engine.layers.norm.RMSNorm");
}

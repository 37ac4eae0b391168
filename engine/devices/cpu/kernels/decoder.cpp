// A whole bfloat16 decode step of a plain Llama-family decoder (every row one new token) in one
// call: per layer the RMS norm, the q/k/v product, rope with the new key and value written straight
// into the paged cache, attention, the output product and its residual, then the MLP's norm,
// products, SiLU and residual. Each step is the kernel the eager modules call, with the same
// roundings, so the result is the same bits; what the call saves is the Python and the dispatch
// between a step's ~400 kernels, the block tables read once per step instead of once a layer, and
// the layers' outputs allocated once per step (Workspace) instead of once a kernel.
#include <torch/extension.h>

#include <ATen/Parallel.h>
#include <ATen/record_function.h>

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>
#include <tuple>
#include <vector>

#include "crew.h"
#include "decoder.h"
#include "elementwise.h"
#include "packed.h"
#include "vec_math.h"

namespace bucketserve {
namespace {
using BF16 = c10::BFloat16;
using Product = ProductInto;  // packed.h's *_into forms

// A layer's tensors, in the order engine.devices.cpu.kernels.FusedDecoder lists them.
// QKV_BIAS may be empty (no bias).
enum LayerTensor {
  INPUT_NORM,
  QKV,
  QKV_BIAS,
  O,
  POST_NORM,
  GATE_UP,
  DOWN,
  KEY_CACHE,
  VALUE_CACHE,
  COUNT
};

Product product_named(const std::string& name) {
  if (name == "amx_linear") return &amx_linear_into;
  if (name == "dot_linear") return &dot_linear_into;
  if (name == "int4_linear") return &int4_linear_into;
  if (name == "int8_linear") return &int8_linear_into;
  if (name == "screened_linear") return &screened_linear_into;
  TORCH_CHECK(name == "fma_linear", "unknown product ", name);
  return &fma_linear_into;
}

// x [rows, width] += delta in bfloat16, each sum in float32 and rounded, as torch's `x + delta`;
// delta is [rows, width], or one row (a bias) added to every row.
void add_into(torch::Tensor& x, const torch::Tensor& delta) {
  const int64_t width = x.size(-1), rows = x.numel() / width;
  const int64_t delta_stride = delta.numel() == x.numel() ? width : 0;
  auto* xp = x.data_ptr<BF16>();
  const auto* dp = delta.data_ptr<BF16>();
  parallel_for(0, rows, 8, [&](int64_t begin, int64_t end) {
    for (int64_t r = begin; r < end; ++r) {
      BF16* out = xp + r * width;
      const BF16* d = dp + r * delta_stride;
      for (int64_t i = 0; i < width; ++i) out[i] = BF16(to_float(out[i]) + to_float(d[i]));
    }
  });
}

struct Heads {
  int64_t q, kv, dim;
};

// The rotated queries into q [rows, heads, dim]; each row's rotated key and its value go into the
// caches at its slot (as write_kv's index_copy: padding rows write the reserved block).
void rotate_and_cache(const torch::Tensor& qkv, const torch::Tensor& cos, const torch::Tensor& sin,
                      const int64_t* slots, Heads heads, torch::Tensor& key_cache,
                      torch::Tensor& value_cache, torch::Tensor& q) {
  const int64_t rows = qkv.size(0), width = qkv.size(1), dim = heads.dim;
  const auto* in = qkv.data_ptr<BF16>();
  const auto* cp = cos.data_ptr<BF16>();
  const auto* sp = sin.data_ptr<BF16>();
  auto* qp = q.data_ptr<BF16>();
  auto* keys = key_cache.data_ptr<BF16>();
  auto* values = value_cache.data_ptr<BF16>();
  const int64_t slot_stride = key_cache.stride(0), head_stride = key_cache.stride(1);
  const int64_t items = heads.q + 2 * heads.kv;  // q heads, then k heads, then v heads
  parallel_for(0, rows * items, 16, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t r = item / items, h = item % items;
      const BF16* src = in + r * width + h * dim;
      if (h < heads.q) {
        rotate_head(src, cp + r * dim, sp + r * dim, qp + (r * heads.q + h) * dim, dim);
        continue;
      }
      const int64_t kv_head = (h - heads.q) % heads.kv;
      const int64_t cached = slots[r] * slot_stride + kv_head * head_stride;
      if (h < heads.q + heads.kv)
        rotate_head(src, cp + r * dim, sp + r * dim, keys + cached, dim);
      else
        std::memcpy(values + cached, src, dim * sizeof(BF16));
    }
  });
}

void check_inputs(const torch::Tensor& hidden, const std::vector<torch::Tensor>& layers,
                  const torch::Tensor& cos, const torch::Tensor& sin, const torch::Tensor& slots,
                  Heads heads) {
  TORCH_CHECK(hidden.dim() == 2 && hidden.scalar_type() == torch::kBFloat16,
              "hidden [rows, hidden] bfloat16 expected");
  TORCH_CHECK(!layers.empty() && layers.size() % COUNT == 0, COUNT, " tensors a layer expected");
  const int64_t rows = hidden.size(0);
  for (const auto* t : {&cos, &sin})
    TORCH_CHECK(t->scalar_type() == torch::kBFloat16 && t->is_contiguous() &&
                    t->numel() == rows * heads.dim,
                "cos and sin: one contiguous bfloat16 row of head_dim values per row");
  TORCH_CHECK(slots.scalar_type() == torch::kLong && slots.numel() == rows, "one slot a row");
  const auto& first = layers[KEY_CACHE];
  const int64_t qkv_width = (heads.q + 2 * heads.kv) * heads.dim;
  for (size_t l = 0; l < layers.size(); l += COUNT) {
    const auto& bias = layers[l + QKV_BIAS];
    TORCH_CHECK(bias.numel() == 0 || (bias.scalar_type() == torch::kBFloat16 &&
                                      bias.is_contiguous() && bias.numel() == qkv_width),
                "a q/k/v bias of ", qkv_width, " bfloat16 values, or none");
    for (const auto& cache : {layers[l + KEY_CACHE], layers[l + VALUE_CACHE]})
      TORCH_CHECK(cache.scalar_type() == torch::kBFloat16 && cache.dim() == 3 &&
                      cache.size(1) == heads.kv && cache.size(2) == heads.dim &&
                      cache.stride(2) == 1 && cache.sizes() == first.sizes() &&
                      cache.strides() == first.strides(),
                  "every cache [slots, kv heads, head dim] bfloat16, alike");
  }
  const auto* s = slots.data_ptr<int64_t>();
  for (int64_t r = 0; r < rows; ++r)
    TORCH_CHECK(s[r] >= 0 && s[r] < first.size(0), "slot ", s[r], " is outside the cache");
}
}  // namespace

namespace {
// A step's intermediate tensors, made once for its rows and written by every layer's kernels in
// turn: a lone row's draft step otherwise spent a tenth of its time making and freeing the
// layers' outputs.
struct Workspace {
  torch::Tensor normed, qkv, q, attended, attended_rows, gate_up, act, delta;

  Workspace(int64_t tokens, int64_t hidden_size, Heads shape, int64_t intermediate,
            const torch::TensorOptions& options)
      : normed(torch::empty({tokens, hidden_size}, options)),
        qkv(torch::empty({tokens, (shape.q + 2 * shape.kv) * shape.dim}, options)),
        q(torch::empty({tokens, shape.q, shape.dim}, options)),
        attended(torch::empty({tokens, shape.q, shape.dim}, options)),
        attended_rows(attended.view({tokens, shape.q * shape.dim})),
        gate_up(torch::empty({tokens, 2 * intermediate}, options)),
        act(torch::empty({tokens, intermediate}, options)),
        delta(torch::empty({tokens, hidden_size}, options)) {}
};

// Every layer over `hidden` [tokens, hidden size], each token attending over its `plan` entry
// (cache slots, its own new one among them), after its key and value are written at its slot.
torch::Tensor run_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& layers,
                         const torch::Tensor& cos, const torch::Tensor& sin,
                         const torch::Tensor& slots, const RowSlots& plan, Heads shape,
                         int64_t intermediate, double eps, double scale, Product multiply) {
  hidden = hidden.contiguous().clone();  // the residual stream, updated in place
  const int64_t tokens = hidden.size(0), hidden_size = hidden.size(1);
  const int64_t q_size = shape.q * shape.dim, kv_size = shape.kv * shape.dim;
  Workspace ws(tokens, hidden_size, shape, intermediate, hidden.options());
  // Each part named for torch.profiler (scripts/step_bench.py --profile); free while it is off.
#define BUCKETSERVE_PART(name) RECORD_FUNCTION("bucketserve::decode_layers/" name, {})
  for (size_t l = 0; l < layers.size(); l += COUNT) {
    const torch::Tensor* w = &layers[l];
    auto key_cache = w[KEY_CACHE], value_cache = w[VALUE_CACHE];
    {
      BUCKETSERVE_PART("norms");
      rms_norm_into(hidden, w[INPUT_NORM], eps, ws.normed);
    }
    {
      BUCKETSERVE_PART("products");
      multiply(ws.normed, w[QKV], q_size + 2 * kv_size, ws.qkv);
      if (w[QKV_BIAS].numel()) add_into(ws.qkv, w[QKV_BIAS]);
    }
    {
      BUCKETSERVE_PART("rope and cache writes");
      rotate_and_cache(ws.qkv, cos, sin, slots.data_ptr<int64_t>(), shape, key_cache,
                       value_cache, ws.q);
    }
    {
      BUCKETSERVE_PART("attention");
      attend(ws.q, key_cache, value_cache, plan, scale, ws.attended);
    }
    {
      BUCKETSERVE_PART("products");
      multiply(ws.attended_rows, w[O], hidden_size, ws.delta);
      add_into(hidden, ws.delta);
    }
    {
      BUCKETSERVE_PART("norms");
      rms_norm_into(hidden, w[POST_NORM], eps, ws.normed);
    }
    {
      BUCKETSERVE_PART("products");
      multiply(ws.normed, w[GATE_UP], 2 * intermediate, ws.gate_up);
    }
    {
      BUCKETSERVE_PART("silu and product");
      silu_and_mul_into(ws.gate_up, ws.act);
    }
    {
      BUCKETSERVE_PART("products");
      multiply(ws.act, w[DOWN], hidden_size, ws.delta);
      add_into(hidden, ws.delta);
    }
  }
#undef BUCKETSERVE_PART
  return hidden;
}

// run_layers with one crew for the whole step (crew.h): no parallel region opens per kernel.
torch::Tensor layers_with_crew(torch::Tensor hidden, const std::vector<torch::Tensor>& layers,
                               const torch::Tensor& cos, const torch::Tensor& sin,
                               const torch::Tensor& slots, const RowSlots& plan, Heads shape,
                               int64_t intermediate, double eps, double scale, Product multiply) {
  torch::Tensor out;
  with_crew([&] {
    out = run_layers(hidden, layers, cos, sin, slots, plan, shape, intermediate, eps, scale,
                     multiply);
  });
  return out;
}

// The new tokens come row after row, seq_lens[r] of row r: its i-th attends over the row's cached
// context (its first context_lens[r] slots of context_slots) and the row's new tokens up to itself.
RowSlots extended_slots(const torch::Tensor& context_slots, const torch::Tensor& context_lens,
                        const torch::Tensor& slots, const torch::Tensor& seq_lens,
                        int64_t cache_slots) {
  const int64_t rows = context_slots.size(0), span = context_slots.size(1);
  const auto context = context_slots.accessor<int64_t, 2>();
  const auto* lens = context_lens.data_ptr<int64_t>();
  const auto* lengths = seq_lens.data_ptr<int64_t>();
  const auto* own = slots.data_ptr<int64_t>();
  RowSlots plan;
  plan.reserve(slots.numel());
  for (int64_t r = 0; r < rows; ++r) {
    TORCH_CHECK(lens[r] >= 0 && lens[r] <= span, "row ", r, " has ", lens[r],
                " tokens of context, past its table of ", span);
    TORCH_CHECK(lengths[r] >= 0 && static_cast<int64_t>(plan.size()) + lengths[r] <= slots.numel(),
                "seq_lens must add up to the new tokens");
    std::vector<int64_t> row(context[r].data(), context[r].data() + lens[r]);
    for (const int64_t slot : row)
      TORCH_CHECK(slot >= 0 && slot < cache_slots, "slot ", slot, " is outside the cache");
    for (int64_t i = 0; i < lengths[r]; ++i) {
      row.push_back(own[plan.size()]);
      plan.push_back(row);
    }
  }
  TORCH_CHECK(static_cast<int64_t>(plan.size()) == slots.numel(),
              "seq_lens must add up to the new tokens");
  return plan;
}

// The step's shape; cos, sin and slots made contiguous (slots as int64), and every input checked.
Heads prepare_inputs(const torch::Tensor& hidden, const std::vector<torch::Tensor>& layers,
                     torch::Tensor& cos, torch::Tensor& sin, torch::Tensor& slots, int64_t heads,
                     int64_t kv_heads) {
  const Heads shape{heads, kv_heads, cos.size(-1)};
  slots = slots.to(torch::kLong).contiguous();
  cos = cos.contiguous();
  sin = sin.contiguous();
  check_inputs(hidden, layers, cos, sin, slots, shape);
  return shape;
}
}  // namespace

torch::Tensor decode_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& layers,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                            torch::Tensor block_list, torch::Tensor block_groups,
                            torch::Tensor block_bias, int64_t heads, int64_t kv_heads,
                            int64_t intermediate, double eps, double scale,
                            const std::string& product) {
  const Heads shape = prepare_inputs(hidden, layers, cos, sin, slots, heads, kv_heads);
  const auto plan = valid_slots(block_list.to(torch::kLong).contiguous(),
                                block_groups.to(torch::kLong).contiguous(),
                                block_bias.to(torch::kFloat).contiguous(), hidden.size(0),
                                layers[KEY_CACHE].size(0));
  return layers_with_crew(hidden, layers, cos, sin, slots, plan, shape, intermediate, eps, scale,
                          product_named(product));
}

namespace {
// One token's embedding row: a bfloat16 table's row, or an int8 table's codes times the token's
// scale, rounded to bfloat16 as engine.layers.quant.Int8Weight.rows computes it.
torch::Tensor embedding_row(const torch::Tensor& table, const torch::Tensor& scale, int64_t token) {
  if (scale.numel() == 0) return table.narrow(0, token, 1).clone();
  const int64_t width = table.size(1);
  auto row = torch::empty({1, width}, table.options().dtype(torch::kBFloat16));
  const int8_t* codes = table.data_ptr<int8_t>() + token * width;
  const float s = static_cast<float>(scale.data_ptr<BF16>()[token]);
  auto* out = row.data_ptr<BF16>();
  for (int64_t j = 0; j < width; ++j) out[j] = BF16(static_cast<float>(codes[j]) * s);
  return row;
}

}  // namespace

// torch.argmax of one row of bfloat16 logits: the first largest value (the first NaN, if any). One
// vector pass finds the largest value and whether any is NaN, a second the first index holding
// it: a scalar loop over a 49152-token vocabulary cost a draft step tens of microseconds.
int64_t first_argmax(const torch::Tensor& logits) {
  const auto* v = logits.data_ptr<BF16>();
  const int64_t n = logits.numel();
  int64_t whole = 0;  // values the vector passes cover
  float top = -INFINITY;
  bool nan = false;
#if defined(__AVX512F__)
  whole = n - n % 16;
  __m512 tops = _mm512_set1_ps(-INFINITY);
  __mmask16 nans = 0;
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 x = load_bf16(v + i);
    nans |= _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q);
    tops = _mm512_max_ps(tops, x);
  }
  top = _mm512_reduce_max_ps(tops);
  nan = nans != 0;
#endif
  for (int64_t i = whole; i < n; ++i) {
    const float x = to_float(v[i]);
    nan = nan || std::isnan(x);
    top = std::max(top, x);
  }
  const auto wanted = [&](float x) { return nan ? std::isnan(x) : x == top; };
#if defined(__AVX512F__)
  const __m512 target = _mm512_set1_ps(top);
  for (int64_t i = 0; i < whole; i += 16) {
    const __m512 x = load_bf16(v + i);
    const __mmask16 hit = nan ? _mm512_cmp_ps_mask(x, x, _CMP_UNORD_Q)
                              : _mm512_cmp_ps_mask(x, target, _CMP_EQ_OQ);
    if (hit) return i + __builtin_ctz(hit);
  }
#endif
  for (int64_t i = whole; i < n; ++i)
    if (wanted(to_float(v[i]))) return i;
  return 0;  // not reached: the largest value is somewhere
}

namespace {
// The model's last step on some rows of hidden states: the final RMS norm, then the LM head
// (bfloat16 logits, as the modules round them).
torch::Tensor normed_logits(const torch::Tensor& rows, const torch::Tensor& norm_weight,
                            double norm_eps, const torch::Tensor& lm_head, int64_t vocab,
                            Product lm) {
  torch::Tensor logits;
  lm(rms_norm(rows, norm_weight, norm_eps), lm_head, vocab, logits);
  return logits;
}
}  // namespace

torch::Tensor final_logits(torch::Tensor hidden, torch::Tensor indices, torch::Tensor norm_weight,
                           double norm_eps, torch::Tensor lm_head, int64_t vocab,
                           const std::string& lm_product) {
  TORCH_CHECK(hidden.scalar_type() == torch::kBFloat16, "bfloat16 hidden states expected");
  // the norm works row by row: norming the chosen rows alone gives the same bits
  auto rows = hidden.reshape({-1, hidden.size(-1)}).index_select(0, indices);
  return normed_logits(rows, norm_weight, norm_eps, lm_head, vocab, product_named(lm_product))
      .to(torch::kFloat);
}

std::vector<int64_t> prompt_lookup(const std::vector<int64_t>& known, int64_t count) {
  const int64_t n = static_cast<int64_t>(known.size());
  if (count < 1) return {};
  const auto suffix = known.end() - std::min(n, GUESS_SUFFIX);
  for (int64_t end = n - 1; end >= GUESS_SUFFIX; --end)
    if (std::equal(suffix, known.end(), known.begin() + (end - GUESS_SUFFIX)))
      return {known.begin() + end, known.begin() + std::min(n, end + count)};
  return {};
}

namespace {
// The embedded rows of `tokens`, one [rows, hidden] tensor.
torch::Tensor embedded(const std::vector<int64_t>& tokens, const torch::Tensor& table,
                       const torch::Tensor& scale) {
  std::vector<torch::Tensor> rows;
  for (const int64_t token : tokens) rows.push_back(embedding_row(table, scale, token));
  return rows.size() == 1 ? rows[0] : torch::cat(rows);
}
}  // namespace

std::tuple<torch::Tensor, torch::Tensor> greedy_steps(
    torch::Tensor fed, int64_t position, int64_t count, torch::Tensor history, int64_t guesses,
    const std::vector<torch::Tensor>& layers, torch::Tensor embedding,
    torch::Tensor embedding_scale, torch::Tensor norm_weight, double norm_eps,
    torch::Tensor lm_head, int64_t vocab, const std::string& lm_product, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor slots, int64_t heads, int64_t kv_heads, int64_t intermediate,
    double eps, double scale, const std::string& product) {
  fed = fed.to(torch::kLong).contiguous();
  history = history.to(torch::kLong).contiguous();
  const int64_t width = fed.numel(), positions = width + count - 1;
  TORCH_CHECK(width >= 1 && count >= 1 && position >= 0 && guesses >= 0,
              "at least one token fed and one proposal, from a position >= 0");
  TORCH_CHECK(history.numel() == 0 || history.numel() == position,
              "history: the row's tokens before `position`, or none");
  TORCH_CHECK(embedding.dim() == 2, "an embedding table [vocab, hidden] expected");
  const auto* fed_tokens = fed.data_ptr<int64_t>();
  for (int64_t i = 0; i < width; ++i)
    TORCH_CHECK(fed_tokens[i] >= 0 && fed_tokens[i] < embedding.size(0), "token ", fed_tokens[i],
                " is outside the embedding");
  TORCH_CHECK(embedding_scale.numel() == 0
                  ? embedding.scalar_type() == torch::kBFloat16
                  : embedding.scalar_type() == torch::kChar &&
                        embedding_scale.scalar_type() == torch::kBFloat16 &&
                        embedding_scale.numel() == embedding.size(0),
              "a bfloat16 embedding, or int8 codes with one bfloat16 scale a row");
  embedding = embedding.contiguous();
  slots = slots.to(torch::kLong).contiguous();
  cos = cos.reshape({positions, -1}).contiguous();
  sin = sin.reshape({positions, -1}).contiguous();
  TORCH_CHECK(slots.numel() == position + positions,
              "one slot for every position through the last");
  const auto* every = slots.data_ptr<int64_t>();
  const int64_t cache_slots = layers.at(KEY_CACHE).size(0);
  for (int64_t i = 0; i < slots.numel(); ++i)
    TORCH_CHECK(every[i] >= 0 && every[i] < cache_slots, "slot ", every[i], " is outside the cache");
  const Product multiply = product_named(product), lm = product_named(lm_product);
  // the row's tokens so far: its history (where it looks up), then what was fed and chosen
  std::vector<int64_t> known(history.data_ptr<int64_t>(),
                             history.data_ptr<int64_t>() + history.numel());
  const bool looking_up = history.numel() > 0 && guesses > 0;
  auto tokens = torch::empty({count}, torch::kLong);
  auto* chosen = tokens.data_ptr<int64_t>();
  std::vector<int64_t> forwards;  // each forward's rows and choices, in turn
  with_crew([&] {
    // each forward feeds its tokens (fed, then the latest choice) and a guess of what follows
    std::vector<int64_t> feeding(fed_tokens, fed_tokens + width);
    int64_t first = 0, made = 0;  // the forward's first position (from `position`); choices made
    while (made < count) {
      known.insert(known.end(), feeding.begin(), feeding.end());
      const int64_t room = std::min({guesses, count - made - 1,
                                     GUESS_ROWS - static_cast<int64_t>(feeding.size())});
      const auto guess = looking_up ? prompt_lookup(known, room) : std::vector<int64_t>{};
      const int64_t fed_rows = static_cast<int64_t>(feeding.size());
      feeding.insert(feeding.end(), guess.begin(), guess.end());
      const int64_t rows = static_cast<int64_t>(feeding.size());
      auto hidden = embedded(feeding, embedding, embedding_scale);
      auto step_cos = cos.narrow(0, first, rows), step_sin = sin.narrow(0, first, rows);
      auto step_slots = slots.narrow(0, position + first, rows);
      const Heads shape =
          prepare_inputs(hidden, layers, step_cos, step_sin, step_slots, heads, kv_heads);
      // each new token attends over every position through its own, in order (valid_slots' and
      // extended_slots' order)
      RowSlots plan;
      for (int64_t r = 0; r < rows; ++r)
        plan.emplace_back(every, every + position + first + r + 1);
      hidden = run_layers(hidden, layers, step_cos, step_sin, step_slots, plan, shape,
                          intermediate, eps, scale, multiply);
      // the logits of the last fed token and of each guess: a guess stands while the token
      // before it chose it, and then its own choice counts too
      const int64_t scored = static_cast<int64_t>(guess.size()) + 1;
      const auto logits = normed_logits(hidden.narrow(0, fed_rows - 1, scored), norm_weight,
                                        norm_eps, lm_head, vocab, lm);
      int64_t kept = 0;
      for (int64_t j = 0; j < scored; ++j) {
        chosen[made++] = first_argmax(logits[j]);
        if (j == scored - 1 || chosen[made - 1] != guess[j]) break;
        known.push_back(guess[j]);
        ++kept;
      }
      forwards.insert(forwards.end(), {rows, kept + 1});
      first += fed_rows + kept;
      feeding.assign(1, chosen[made - 1]);
    }
  });
  return {tokens, torch::tensor(forwards, torch::kLong).view({-1, 2})};
}

torch::Tensor extend_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& layers,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                            torch::Tensor context_slots, torch::Tensor context_lens,
                            torch::Tensor seq_lens, int64_t heads, int64_t kv_heads,
                            int64_t intermediate, double eps, double scale,
                            const std::string& product) {
  const Heads shape = prepare_inputs(hidden, layers, cos, sin, slots, heads, kv_heads);
  TORCH_CHECK(context_slots.dim() == 2 && context_lens.numel() == context_slots.size(0) &&
                  seq_lens.numel() == context_slots.size(0),
              "context_slots [rows, span], context_lens and seq_lens [rows] expected");
  const auto plan = extended_slots(
      context_slots.to(torch::kLong).contiguous(), context_lens.to(torch::kLong).contiguous(),
      slots, seq_lens.to(torch::kLong).contiguous(), layers[KEY_CACHE].size(0));
  return layers_with_crew(hidden, layers, cos, sin, slots, plan, shape, intermediate, eps, scale,
                          product_named(product));
}
}  // namespace bucketserve

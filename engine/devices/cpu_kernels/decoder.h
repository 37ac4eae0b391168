// What a whole decode step (decoder.cpp) is made of, beside the products of packed.h and the
// elementwise kernels of elementwise.h: RMS norm and the paged attention of kernels.cpp, with the
// attention's reading of the block tables done once per step rather than once per layer.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <vector>

namespace bucketserve {
// Each row's valid KV cache slots in sequence order, from the flat block tensors of
// engine.attention.flat (block_list and block_groups int64, block_bias float32).
using RowSlots = std::vector<std::vector<int64_t>>;
RowSlots valid_slots(const torch::Tensor& block_list, const torch::Tensor& block_groups,
                     const torch::Tensor& block_bias, int64_t batch, int64_t cache_slots);

// out [batch, heads, dim] = each row's query heads attending over its slots of the caches
// [slots, kv heads, dim]; a row without slots gets zeros.
void attend(const torch::Tensor& q, const torch::Tensor& key_cache,
            const torch::Tensor& value_cache, const RowSlots& slots, double scale,
            torch::Tensor& out);

torch::Tensor rms_norm(torch::Tensor x, torch::Tensor weight, double eps);
// rms_norm into out, shaped as x (a fused step's workspace).
void rms_norm_into(torch::Tensor x, torch::Tensor weight, double eps, torch::Tensor& out);

torch::Tensor decode_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& layers,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                            torch::Tensor block_list, torch::Tensor block_groups,
                            torch::Tensor block_bias, int64_t heads, int64_t kv_heads,
                            int64_t intermediate, double eps, double scale,
                            const std::string& product);

// decode_layers for rows of several new tokens each (a prompt, or a verify forward over cached
// context), packed: hidden, cos, sin and slots hold the rows' new tokens one row after the other,
// seq_lens[r] of row r, whose context is the first context_lens[r] slots of context_slots[r].
torch::Tensor extend_layers(torch::Tensor hidden, const std::vector<torch::Tensor>& layers,
                            torch::Tensor cos, torch::Tensor sin, torch::Tensor slots,
                            torch::Tensor context_slots, torch::Tensor context_lens,
                            torch::Tensor seq_lens, int64_t heads, int64_t kv_heads,
                            int64_t intermediate, double eps, double scale,
                            const std::string& product);

// The float32 logits of `indices`' rows of hidden [.., hidden size] (bfloat16): the final RMS norm
// and the packed LM head (`lm_product`, `vocab` columns), as the model's final_logits computes
// them, in one call.
torch::Tensor final_logits(torch::Tensor hidden, torch::Tensor indices, torch::Tensor norm_weight,
                           double norm_eps, torch::Tensor lm_head, int64_t vocab,
                           const std::string& lm_product);

// torch.argmax of one row of bfloat16 logits: the first largest value (the first NaN, if any).
int64_t first_argmax(const torch::Tensor& logits);

// `steps` greedy decode steps of one row (a draft model's proposals) in one call. The first feeds
// every token of `fed` at once at positions `position` on (a catch-up after a verify, or one
// proposal), as extend_layers does; each later step feeds the token the step before chose, at
// the next position. Each step: the embedding (a bfloat16 table, or int8 codes and their per-row
// bfloat16 scales), every layer, the final RMS norm and the LM head (`lm_product` over `lm_head`,
// `vocab` columns) at its last token, and torch.argmax's token as the step's choice.
// slots: the row's cache slots of positions 0 through the last step's. Returns the choices.
torch::Tensor greedy_steps(torch::Tensor fed, int64_t position, int64_t steps,
                           const std::vector<torch::Tensor>& layers, torch::Tensor embedding,
                           torch::Tensor embedding_scale, torch::Tensor norm_weight,
                           double norm_eps, torch::Tensor lm_head, int64_t vocab,
                           const std::string& lm_product, torch::Tensor cos, torch::Tensor sin,
                           torch::Tensor slots, int64_t heads, int64_t kv_heads,
                           int64_t intermediate, double eps, double scale,
                           const std::string& product);
}  // namespace bucketserve

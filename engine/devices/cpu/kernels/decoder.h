// What a whole decode step (decoder.cpp) is made of, beside the products of packed.h and the
// elementwise kernels of elementwise.h: RMS norm and the paged attention of kernels.cpp, with the
// attention's reading of the block tables done once per step rather than once per layer.
#pragma once

#include <torch/extension.h>

#include <cstdint>
#include <string>
#include <tuple>
#include <vector>

namespace bucketserve {
// Rows a forward of greedy_steps feeds at most with guesses: the int4 tiles of up to 3 rows sum
// each row as a lone row's tile does, so each row's bits are those of the one-token forward it
// stands for.
constexpr int64_t GUESS_ROWS = 3;

// Guesses come from the row's last GUESS_SUFFIX tokens found earlier in it. On free text shorter
// matches guessed wrong most of the time (1 token: 7% right, 2 tokens: 19%, the embedded int4
// draft on a story), and a wrong guess costs about a third of a forward; on a rewrite 3-token
// matches guessed right 95% of the time.
constexpr int64_t GUESS_SUFFIX = 3;

// Prompt lookup over `known`: up to `count` tokens that followed the latest earlier occurrence of
// its last GUESS_SUFFIX tokens (engine.speculative.ngram.NgramIndex.propose's rule where it matches
// that many), else none.
std::vector<int64_t> prompt_lookup(const std::vector<int64_t>& known, int64_t count);

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

// `count` greedy proposals of one row (a draft model's) in one call. The first forward feeds
// every token of `fed` at once at positions `position` on (a catch-up after a verify, or one
// proposal), as extend_layers does; each later one feeds the token chosen last, at the next
// position. Each forward: the embedding (a bfloat16 table, or int8 codes and their per-row
// bfloat16 scales), every layer, the final RMS norm and the LM head (`lm_product` over `lm_head`,
// `vocab` columns) at its last fed token, and torch.argmax's token as the choice.
// With `history` (the row's tokens before `position`) and `guesses` > 0, a forward also feeds
// what prompt lookup guesses follows (at most GUESS_ROWS rows in all): where the choice at a
// token is the guess after it, the guess's own row chooses next, so one forward may make several
// choices, each the one a forward of its own would make.
// slots: the row's cache slots of positions 0 through the last proposal's. Returns the choices
// and [forwards, 2]: each forward's rows fed and choices made.
std::tuple<torch::Tensor, torch::Tensor> greedy_steps(
    torch::Tensor fed, int64_t position, int64_t count, torch::Tensor history, int64_t guesses,
    const std::vector<torch::Tensor>& layers, torch::Tensor embedding,
    torch::Tensor embedding_scale, torch::Tensor norm_weight, double norm_eps,
    torch::Tensor lm_head, int64_t vocab, const std::string& lm_product, torch::Tensor cos,
    torch::Tensor sin, torch::Tensor slots, int64_t heads, int64_t kv_heads, int64_t intermediate,
    double eps, double scale, const std::string& product);
}  // namespace bucketserve

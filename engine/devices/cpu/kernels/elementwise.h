// The elementwise kernels of elementwise.cpp, bound into the module by kernels.cpp.
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace bucketserve {
// One rotated head of `dim` values (out may not alias x): apply_rotary's arithmetic and roundings.
void rotate_head(const c10::BFloat16* x, const c10::BFloat16* cos, const c10::BFloat16* sin,
                 c10::BFloat16* out, int64_t dim);
std::tuple<torch::Tensor, torch::Tensor> rope_bf16(torch::Tensor q, torch::Tensor k,
                                                   torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
// silu_and_mul into out [.., I], whose rows follow gate_up's (a fused step's workspace).
void silu_and_mul_into(torch::Tensor gate_up, torch::Tensor& out);
}  // namespace bucketserve

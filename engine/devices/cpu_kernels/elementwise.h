// The elementwise kernels of elementwise.cpp, bound into the module by kernels.cpp.
#pragma once

#include <torch/extension.h>

#include <tuple>

namespace bucketserve {
std::tuple<torch::Tensor, torch::Tensor> rope_bf16(torch::Tensor q, torch::Tensor k,
                                                   torch::Tensor cos, torch::Tensor sin);
torch::Tensor silu_and_mul(torch::Tensor gate_up);
}  // namespace bucketserve

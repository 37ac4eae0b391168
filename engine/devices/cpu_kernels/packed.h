// The packed bfloat16 projections: the layout (pack_bf16, in amx.cpp) and its two products, AMX
// tiles (amx.cpp) and AVX512-BF16 dot products (dot_linear.cpp); bound into the module by
// kernels.cpp.
#pragma once

#include <torch/extension.h>

#include <cstdint>

namespace bucketserve {
constexpr int64_t PACK_BLOCK = 32;  // output columns per packed block

torch::Tensor pack_bf16(torch::Tensor w);
void check_packed(const torch::Tensor& packed, int64_t K, int64_t N);  // refuses a mismatch

bool amx_supported();
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N);

bool dot_linear_supported();
torch::Tensor dot_linear(torch::Tensor x, torch::Tensor packed, int64_t N);
}  // namespace bucketserve

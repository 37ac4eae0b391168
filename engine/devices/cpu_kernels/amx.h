// The AMX projection of amx.cpp, bound into the module by kernels.cpp.
#pragma once

#include <torch/extension.h>

namespace bucketserve {
bool amx_supported();
torch::Tensor pack_bf16(torch::Tensor w);
torch::Tensor amx_linear(torch::Tensor x, torch::Tensor packed, int64_t N);
}  // namespace bucketserve

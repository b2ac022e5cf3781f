// Host-side schedule choices of the sparse-attention kernels.
#pragma once

#include <cstdint>

namespace sparse_attn::cuda {

// SplitKV count when the caller passes num_splits = None; see the .cpp for the model.
int choose_num_splits(int64_t rows, int64_t kv_heads, int64_t width, int num_sms);

// SplitKV count of the gather kernel when the caller passes none; see the .cpp.
int choose_gather_splits(int64_t pairs, int64_t blocks, int max_splits, int num_sms);

}  // namespace sparse_attn::cuda

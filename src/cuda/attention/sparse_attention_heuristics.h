// Host-side schedule choices of the sparse-attention kernels.
#pragma once

#include <cstdint>

#include "cuda/attention/sparse_attention_config.h"

namespace sparse_attn::cuda {

// The forward kernel's gather (config.h), process-wide. The benchmark sets it to compare the
// variants in one run and the GPU suite runs every form under each; the library never changes
// it (kCpAsync until a measurement picks the other).
void set_sparse_attention_gather(Gather g);
Gather sparse_attention_gather();

// SplitKV count when the caller passes num_splits = None; see the .cpp for the model.
int choose_num_splits(int64_t rows, int64_t kv_heads, int64_t width, int num_sms);

}  // namespace sparse_attn::cuda

// Device attributes that launches size their grids by, read from the runtime once per device
// and cached: they do not change while the process runs, and the launches are host hot paths.
#pragma once

namespace sparse_attn::cuda {

int sm_count(int device);        // streaming multiprocessors
int l2_cache_bytes(int device);  // L2 cache size

}  // namespace sparse_attn::cuda

// Tiled TMA descriptors for the kernels' producers (block-sparse attention, the XAttention
// estimate): one encoder, so every descriptor is built and checked the same way.
#pragma once

#include <cuda.h>  // CUtensorMap (a plain struct; no driver call is made through this header)

#include <cstdint>

#include "sparse_attn/dtype.h"

namespace sparse_attn::cuda {

// A tiled descriptor over a bfloat16 or float16 tensor of `rank` (1 to 5) axes, innermost first:
// sizes[i] elements on axis i, strides[i - 1] elements between neighbours on axis i >= 1 (the
// innermost axis is contiguous), boxes of box[i] elements, 128-byte swizzle (box[0] spans at
// most 128 bytes), zeros for the elements of a box outside the sizes. An axis of size 1 takes
// any stride: it is never stepped. A null base gives an empty descriptor (no tile of an empty
// tensor is ever loaded). Throws Error, naming `op`, when the driver rejects the description.
CUtensorMap tiled_tensor_map(const void* base, DType dtype, int rank, const int64_t* sizes,
                             const int64_t* strides, const uint32_t* box, const char* op);

}  // namespace sparse_attn::cuda

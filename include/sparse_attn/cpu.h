// The CPU backend (backend 'native' on CPU tensors): what it runs with on this machine.
#pragma once

#include <string>

namespace sparse_attn {

// The instruction set the CPU backend's kernels dispatch to here, as Highway names it: "AVX3"
// (AVX-512 F/BW/DQ/VL), "AVX3_DL", "AVX2", "SSE4", ... chosen once, at first use.
std::string cpu_backend_isa();

// This machine's FP32 multiply-add rate through the CPU backend's vectors: independent fused
// multiply-adds on `threads` threads (0: OpenMP's default), in multiply-adds per second (a
// FLOP rate is twice it). The best of three runs of about 0.1 s each.
double measure_cpu_fma_rate(int threads = 0);

}  // namespace sparse_attn

// Timing and ceilings for the benchmark programs (METHOD.md's recipe): warm-up, an L2 flush
// before every timed run, CUDA events around the run alone, the median of the runs; and the
// two ceilings measured in the same process: a large device-to-device copy (bytes read plus
// written per second) and a cuBLAS bf16 GEMM on random data.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>
#include <functional>
#include <random>
#include <string>
#include <vector>

#include "sparse_attn/tensor.h"

namespace sparse_attn::bench {

// Aborts with the call and location on a CUDA error (benchmarks have nothing to recover).
void check(cudaError_t err, const char* call, const char* file, int line);
#define BENCH_CUDA(call) ::sparse_attn::bench::check((call), #call, __FILE__, __LINE__)

struct Timing {
  double median_ms;
  double min_ms;
  double max_ms;
};

class Timer {
 public:
  Timer();
  ~Timer();
  // Runs `launch` `warmup` times, then `reps` times each after an L2 flush, timing each.
  Timing time(const std::function<void(cudaStream_t)>& launch, int warmup = 3, int reps = 15);
  // The same timing for a CUDA graph of one `launch` captured on the timer's stream (after one
  // eager call, the warm-up a library needs before capture): what an engine that replays its
  // decode step sees, without the host work of the eager call between the two events.
  Timing time_graph(const std::function<void(cudaStream_t)>& launch, int warmup = 3, int reps = 15);
  // A graph of `repeats` launches back to back, L2 flushed before each replay only; the time a
  // launch: what a kernel of a few microseconds costs inside a captured decode step, where its
  // inputs were just written by the kernel before it (in L2) and no launch gap separates them.
  Timing time_graph_back_to_back(const std::function<void(cudaStream_t)>& launch, int repeats = 20,
                                 int warmup = 3, int reps = 15);
  cudaStream_t stream() const { return stream_; }

 private:
  cudaStream_t stream_ = nullptr;
  cudaEvent_t start_ = nullptr, stop_ = nullptr;
  void* flush_ = nullptr;  // larger than L2: writing it evicts everything else
  size_t flush_bytes_ = 0;
};

struct Ceilings {
  double copy_tbps;    // device-to-device copy, (read + write) bytes per second / 1e12
  double gemm_tflops;  // cuBLAS bf16 GEMM 8192^3, FP32 accumulate, random inputs
};
Ceilings measure_ceilings(Timer& timer);
// Prints the device (name, SMs, L2) and the ceilings measured with `timer`, and returns them:
// every benchmark program opens its output this way.
Ceilings report_device_and_ceilings(Timer& timer);

// The paged layout of requests of the given lengths: the pages of all requests shuffled over one
// pool of `pool` pages, and the block table [lens.size(), max_pages] (-1 past a request's pages).
struct Pages {
  int64_t pool = 0, max_pages = 0;
  std::vector<int32_t> table;
};
Pages make_pages(const std::vector<int64_t>& lens, int64_t page, std::mt19937_64& rng);

// A device tensor of uniform random values in [-1, 1) (16-bit floats; FP8 e4m3: [-448, 448])
// made on the host.
Tensor random_device(const Shape& shape, DType dtype, uint64_t seed);

}  // namespace sparse_attn::bench

#include "bench_util.h"

#include <cublas_v2.h>
#include <fmt/format.h>

#include <algorithm>
#include <cstdlib>
#include <numeric>
#include <vector>

#include "sparse_attn/dtype.h"

namespace sparse_attn::bench {

void check(cudaError_t err, const char* call, const char* file, int line) {
  if (err == cudaSuccess) return;
  fmt::print(stderr, "CUDA error {} in {} at {}:{}\n", cudaGetErrorString(err), call, file, line);
  std::exit(2);
}

Timer::Timer() {
  BENCH_CUDA(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
  BENCH_CUDA(cudaEventCreate(&start_));
  BENCH_CUDA(cudaEventCreate(&stop_));
  int device = 0, l2 = 0;
  BENCH_CUDA(cudaGetDevice(&device));
  BENCH_CUDA(cudaDeviceGetAttribute(&l2, cudaDevAttrL2CacheSize, device));
  flush_bytes_ = std::max<size_t>(4 * size_t(l2), size_t(256) << 20);
  BENCH_CUDA(cudaMalloc(&flush_, flush_bytes_));
}

Timer::~Timer() {
  cudaFree(flush_);
  cudaEventDestroy(start_);
  cudaEventDestroy(stop_);
  cudaStreamDestroy(stream_);
}

Timing Timer::time(const std::function<void(cudaStream_t)>& launch, int warmup, int reps) {
  for (int i = 0; i < warmup; ++i) launch(stream_);
  BENCH_CUDA(cudaStreamSynchronize(stream_));
  std::vector<double> ms;
  for (int i = 0; i < reps; ++i) {
    BENCH_CUDA(cudaMemsetAsync(flush_, i & 0xff, flush_bytes_, stream_));
    BENCH_CUDA(cudaEventRecord(start_, stream_));
    launch(stream_);
    BENCH_CUDA(cudaEventRecord(stop_, stream_));
    BENCH_CUDA(cudaEventSynchronize(stop_));
    float t = 0;
    BENCH_CUDA(cudaEventElapsedTime(&t, start_, stop_));
    ms.push_back(t);
  }
  BENCH_CUDA(cudaGetLastError());
  std::sort(ms.begin(), ms.end());
  return {ms[ms.size() / 2], ms.front(), ms.back()};
}

Timing Timer::time_graph_back_to_back(const std::function<void(cudaStream_t)>& launch, int repeats,
                                      int warmup, int reps) {
  launch(stream_);
  BENCH_CUDA(cudaStreamSynchronize(stream_));
  cudaGraph_t graph = nullptr;
  cudaGraphExec_t exec = nullptr;
  BENCH_CUDA(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
  for (int i = 0; i < repeats; ++i) launch(stream_);
  BENCH_CUDA(cudaStreamEndCapture(stream_, &graph));
  BENCH_CUDA(cudaGraphInstantiate(&exec, graph, 0));
  Timing t = time([&](cudaStream_t s) { BENCH_CUDA(cudaGraphLaunch(exec, s)); }, warmup, reps);
  BENCH_CUDA(cudaGraphExecDestroy(exec));
  BENCH_CUDA(cudaGraphDestroy(graph));
  t.median_ms /= repeats;
  t.min_ms /= repeats;
  t.max_ms /= repeats;
  return t;
}

Timing Timer::time_graph(const std::function<void(cudaStream_t)>& launch, int warmup, int reps) {
  return time_graph_back_to_back(launch, 1, warmup, reps);
}

Pages make_pages(const std::vector<int64_t>& lens, int64_t page, std::mt19937_64& rng) {
  Pages pg;
  for (int64_t l : lens) {
    pg.pool += (l + page - 1) / page;
    pg.max_pages = std::max(pg.max_pages, (l + page - 1) / page);
  }
  std::vector<int32_t> perm(pg.pool);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  pg.table.assign(lens.size() * pg.max_pages, -1);
  int64_t next = 0;
  for (size_t b = 0; b < lens.size(); ++b)
    for (int64_t j = 0; j < (lens[b] + page - 1) / page; ++j)
      pg.table[b * pg.max_pages + j] = perm[next++];
  return pg;
}

Ceilings measure_ceilings(Timer& timer) {
  Ceilings c{};
  {
    const size_t bytes = size_t(4) << 30;  // 4 GiB each way
    void *a = nullptr, *b = nullptr;
    BENCH_CUDA(cudaMalloc(&a, bytes));
    BENCH_CUDA(cudaMalloc(&b, bytes));
    BENCH_CUDA(cudaMemset(a, 1, bytes));
    const Timing t = timer.time([&](cudaStream_t s) {
      BENCH_CUDA(cudaMemcpyAsync(b, a, bytes, cudaMemcpyDeviceToDevice, s));
    });
    c.copy_tbps = 2.0 * bytes / (t.median_ms * 1e-3) / 1e12;
    cudaFree(a);
    cudaFree(b);
  }
  {
    const int n = 8192;
    Tensor a = random_device({n, n}, DType::kBF16, 1), b = random_device({n, n}, DType::kBF16, 2);
    Tensor d = Tensor::empty({n, n}, DType::kBF16, Device::cuda());
    cublasHandle_t h = nullptr;
    if (cublasCreate(&h) != CUBLAS_STATUS_SUCCESS) {
      fmt::print(stderr, "cublasCreate failed\n");
      std::exit(2);
    }
    cublasSetStream(h, timer.stream());
    const float one = 1.f, zero = 0.f;
    const Timing t = timer.time([&](cudaStream_t) {
      const cublasStatus_t st = cublasGemmEx(
          h, CUBLAS_OP_N, CUBLAS_OP_N, n, n, n, &one, a.data(), CUDA_R_16BF, n, b.data(),
          CUDA_R_16BF, n, &zero, d.data(), CUDA_R_16BF, n, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
      if (st != CUBLAS_STATUS_SUCCESS) {
        fmt::print(stderr, "cublasGemmEx failed: {}\n", int(st));
        std::exit(2);
      }
    });
    c.gemm_tflops = 2.0 * n * double(n) * n / (t.median_ms * 1e-3) / 1e12;
    cublasDestroy(h);
  }
  return c;
}

Ceilings report_device_and_ceilings(Timer& timer) {
  cudaDeviceProp prop{};
  BENCH_CUDA(cudaGetDeviceProperties(&prop, 0));
  const Ceilings c = measure_ceilings(timer);
  fmt::print("device {} ({} SMs, L2 {} MB)\n", prop.name, prop.multiProcessorCount,
             prop.l2CacheSize >> 20);
  fmt::print("ceilings: copy {:.2f} TB/s (read + write), cuBLAS bf16 GEMM {:.0f} TFLOP/s\n",
             c.copy_tbps, c.gemm_tflops);
  return c;
}

Tensor random_device(const Shape& shape, DType dtype, uint64_t seed) {
  Tensor host = Tensor::empty(shape, dtype);
  uint64_t x = seed * 0x9e3779b97f4a7c15ull + 1;
  for (int64_t i = 0; i < host.numel(); ++i) {
    x ^= x << 13, x ^= x >> 7, x ^= x << 17;  // xorshift64
    const float u = float(x >> 40) * (2.0f / float(1 << 24)) - 1.0f;
    if (dtype == DType::kF8E4M3) {
      host.data_as<uint8_t>()[i] = float_to_fp8_e4m3(448.f * u);
    } else {
      host.data_as<uint16_t>()[i] = dtype == DType::kBF16 ? float_to_bf16(u) : float_to_fp16(u);
    }
  }
  Tensor dev = Tensor::empty(shape, dtype, Device::cuda());
  copy_into(dev.view(), host.view());
  return dev;
}

}  // namespace sparse_attn::bench

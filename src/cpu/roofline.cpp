// The CPU backend's compute ceiling (include/sparse_attn/cpu.h): fused multiply-adds on
// independent accumulators, so that latency does not bind (12 chains cover a 4-cycle FMA on
// two pipes), in the same vectors and dispatch as the kernels.
#include <omp.h>

#include <algorithm>
#include <chrono>
#include <limits>

#include "sparse_attn/cpu.h"

// clang-format off
#undef HWY_TARGET_INCLUDE
#define HWY_TARGET_INCLUDE "cpu/roofline.cpp"
#include <hwy/foreach_target.h>  // IWYU pragma: keep
#include <hwy/highway.h>
// clang-format on

HWY_BEFORE_NAMESPACE();
namespace sparse_attn::cpu::HWY_NAMESPACE {
namespace hn = hwy::HWY_NAMESPACE;

// Multiply-adds done by one thread in `iters` iterations; `sink` keeps them from being elided.
int64_t FmaLoop(int64_t iters, float* sink) {
  const hn::ScalableTag<float> df;
  constexpr int kChains = 12;
  hn::Vec<decltype(df)> acc[kChains];
  for (int c = 0; c < kChains; ++c) acc[c] = hn::Set(df, 1e-3f * static_cast<float>(c));
  const auto m = hn::Set(df, 0.999999f), a = hn::Set(df, 1e-7f);
  for (int64_t i = 0; i < iters; ++i) {
    for (auto& v : acc) v = hn::MulAdd(v, m, a);
  }
  auto total = acc[0];
  for (int c = 1; c < kChains; ++c) total = hn::Add(total, acc[c]);
  *sink = hn::GetLane(hn::SumOfLanes(df, total));
  return iters * kChains * static_cast<int64_t>(hn::Lanes(df));
}

// The target this file, like every kernel file, dispatches to here.
const char* TargetName() { return hwy::TargetName(HWY_TARGET); }

}  // namespace sparse_attn::cpu::HWY_NAMESPACE
HWY_AFTER_NAMESPACE();

#if HWY_ONCE
namespace sparse_attn {
namespace cpu {
HWY_EXPORT(FmaLoop);
HWY_EXPORT(TargetName);
}  // namespace cpu

std::string cpu_backend_isa() { return HWY_DYNAMIC_DISPATCH(cpu::TargetName)(); }

double measure_cpu_fma_rate(int threads) {
  const int n = threads > 0 ? threads : omp_get_max_threads();
  constexpr int64_t kIters = int64_t{1} << 22;
  double best = std::numeric_limits<double>::infinity();
  int64_t per_run = 0;
  float sink = 0.f;
  for (int rep = 0; rep < 3; ++rep) {
    int64_t done = 0;
    const auto t0 = std::chrono::steady_clock::now();
#pragma omp parallel num_threads(n) reduction(+ : done, sink)
    {
      float s = 0.f;
      done += HWY_DYNAMIC_DISPATCH(cpu::FmaLoop)(kIters, &s);
      sink += s;
    }
    const double t = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    best = std::min(best, t);
    per_run = done;
  }
  return sink == 12345.f ? 0.0 : static_cast<double>(per_run) / best;
}

}  // namespace sparse_attn
#endif

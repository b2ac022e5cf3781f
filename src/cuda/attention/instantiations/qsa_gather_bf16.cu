#include "cuda/attention/qsa_gather_kernel.cuh"
#include "cuda/common/device_guard.h"

namespace sparse_attn::cuda {
template void launch_qsa_gather<__nv_bfloat16, __nv_bfloat16>(const SparseAttentionParams&,
                                                              const SparseAttentionLaunch&,
                                                              cudaStream_t);

// Asked of the BF16 block-hint kernel, whose CTA is the largest (the token kernel's and FP16's
// are the same, FP8's no larger), so its answer holds for every kernel of the family.
int qsa_gather_max_splits(int device_index) {
  using T = __nv_bfloat16;
  constexpr int kSmem = QsaGatherTraits<sm90::CutlassElement<T>, false>::kSmemBytes;
  static_assert(QsaGatherTraits<sm90::CutlassElement<T>, true>::kSmemBytes <= kSmem,
                "the FP8 kernel's CTA is larger: ask it for its own cluster limit");
  constexpr auto kernel = qsa_gather_kernel<T, T, false>;
  static std::once_flag once[64];
  static int limit[64];
  const int device = device_index;
  std::call_once(once[device % 64], [&] {
    DeviceGuard guard(device);
    opt_in_shared_memory<kernel>(kSmem, true);
    allow_non_portable_clusters<kernel>();
    cudaLaunchAttribute attr;
    const cudaLaunchConfig_t cfg =
        cluster_launch_config(QsaGatherConfig::kMaxSplits, QsaGatherConfig::kThreads,
                              QsaGatherConfig::kMaxSplits, kSmem, nullptr, attr);
    int clusters = 0;
    const bool fits =
        cudaOccupancyMaxActiveClusters(&clusters, kernel, &cfg) == cudaSuccess && clusters > 0;
    (void)cudaGetLastError();  // a refused size is an answer, not an error to carry
    limit[device % 64] = fits ? QsaGatherConfig::kMaxSplits : 8;
  });
  return limit[device % 64];
}

}  // namespace sparse_attn::cuda

// Host-side schedule choices of the sparse-attention kernels.
#pragma once

#include <cstdint>

#include "cuda/attention/sparse_attention_config.h"

namespace sparse_attn::cuda {

// The forward kernel's variant, process-wide: its gather (config.h) and its warps per CTA
// (FwdShape: 4, or 8 splitting D in pairs). The benchmark sets it to compare the variants in
// one run and the GPU suite runs every form under each; the library never changes it. The
// default (FwdVariant{}) is the member initializers below: cp.async with 8 warps, the fastest
// at every decode batch size in the first GPU run of the variants (docs/perf-notes.md).
// How the SplitKV merge kernel follows the forward grid: kEarly, a programmatic dependent
// launch that the forward grid triggers at its start (the merge CTAs wait resident); kPdl, the
// same launch triggered only by the forward grid's completion; kPlain, an ordinary launch.
enum class MergeLaunch { kEarly, kPdl, kPlain };
// l2_prefetch_tiles: tiles beyond the ring (2 in flight) whose K/V rows the forward kernel
// prefetches into L2 (one cp.async.bulk.prefetch per row), so that more gathered bytes are in
// flight per SM than the ring's shared memory holds. Off by default: in the final GPU run of
// session 2 every prefetch distance was slower than none at B >= 8 (B = 128: 180 us without,
// 207 / 208 / 241 us with 1 / 2 / 4 tiles; docs/perf-notes.md). A hint only: results are the
// same bits either way.
struct FwdVariant {
  Gather gather = Gather::kCpAsync;
  int warps = 8;
  MergeLaunch merge = MergeLaunch::kEarly;
  int l2_prefetch_tiles = 0;
  bool operator==(const FwdVariant& o) const {
    return gather == o.gather && warps == o.warps && merge == o.merge &&
           l2_prefetch_tiles == o.l2_prefetch_tiles;
  }
};
void set_sparse_attention_variant(FwdVariant v);
FwdVariant sparse_attention_variant();

// SplitKV count when the caller passes num_splits = None; see the .cpp for the model.
int choose_num_splits(int64_t rows, int64_t kv_heads, int64_t width, int num_sms);

}  // namespace sparse_attn::cuda

// Launchers of the sm90 sparse-attention kernels, one explicit instantiation per element type
// (instantiations/*.cu). The runtime dtype becomes T in sparse_attention_native.cpp only.
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "api/qsa_attention_params.h"

namespace sparse_attn::cuda {

// What the launcher adds to the validated params: the split schedule and device workspace.
struct SparseAttentionLaunch {
  int num_splits = 1;  // >= 1
  // The index entries are block_indices' blocks plus the tail entry (the structured path),
  // else token_indices' ids.
  bool block_hint = false;
  // Index entries per split: worth a whole number of 64-token tiles on the per-row kernel; on
  // the gather kernel, blocks (its last split also takes the tail entry).
  int64_t split_cols = 0;
  // [num_splits, rows, Hq, D] normalised partial outputs and [num_splits, rows, Hq] partial
  // LSEs (log2 units, -inf for an empty split); null when num_splits == 1.
  float* o_partial = nullptr;
  float* lse_partial = nullptr;
  // [ceil(rows / union_rows)]: 1 where the union prefill kernel (qsa_union_problem.cuh) wrote
  // the tile of union_rows rows (every KV head); the gather kernel leaves those rows alone.
  // Null when that kernel did not run.
  const uint8_t* union_handled = nullptr;
  int union_rows = 0;
  // The gather kernel is launched as the programmatic dependent of the step kernel before it
  // (qsa_step_kernel.cuh), which marked union_handled: its CTAs may start while that grid runs
  // and wait for it (griddepcontrol.wait) before reading the marks. num_splits == 1 only.
  bool after_step = false;
};

// The union prefill kernel on a chunk of row tiles whose unions launch_qsa_union_build made
// (qsa_union_params.h): it writes the rows of the tiles marked in params.handled; the gather
// kernel (launch_qsa_gather), launched after the last chunk with x.union_handled, takes the
// rest.
struct QsaUnionParams;
template <typename T>
void launch_qsa_union(const QsaUnionParams& params, cudaStream_t stream);

// Index entries a split may have on the gather kernel (qsa_gather_kernel.cuh): the seed's 512
// block hint columns and the tail entry, or (without the hint) 2112 token ids, 33 tiles of 64:
// the seed's 2051 selected tokens and room for an engine's rounding of the width. Wider rows
// take several splits.
inline constexpr int kQsaGatherMaxEntries = 513;
inline constexpr int kQsaGatherMaxTokens = 2112;

// Runs the gather kernel: one CTA per (row, KV head, split), each row reading its own selection;
// rows whose tile x.union_handled marks are left alone. With x.num_splits > 1 (at most
// qsa_gather_max_splits(); no union kernel before it) the splits of a (row, KV head) run as one
// thread-block cluster and merge in it, without workspace. Needs at most kQsaGatherMaxEntries
// entries a split with the block hint (blocks, and the tail on the last split) or
// kQsaGatherMaxTokens token ids without it, group <= 16, K/V keys that fit
// int32, rows * Hkv * splits that fit int32, and the union kernel's 16-byte Q rows
// (sparse_attention_native.cpp decides). KV is T or __nv_fp8_e4m3 (FP8 K/V, with k_scale folded
// into p.scale_log2).
template <typename T, typename KV>
void launch_qsa_gather(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                       cudaStream_t stream);

// The largest split count (cluster size) the gather kernel runs on device `device_index`: 16
// where the device schedules clusters of 16 of its CTAs, else the portable 8. Asked once per
// device.
int qsa_gather_max_splits(int device_index);

// Runs the per-row forward kernel (sparse_attention_kernel.cuh) and, when x.num_splits > 1,
// the merge kernel on `stream`: any call check_native lets through, the rows the step, union
// and gather kernels do not take. KV is T or __nv_fp8_e4m3 (FP8 K/V, with k_scale folded into
// p.scale_log2).
template <typename T, typename KV>
void launch_sparse_attention(const SparseAttentionParams& p, const SparseAttentionLaunch& x,
                             cudaStream_t stream);

}  // namespace sparse_attn::cuda

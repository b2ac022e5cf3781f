// The host-side schedule of native qsa_sparse_attention: which kernels run on a call's rows,
// their split counts and the workspace layout, decided from the validated params and two facts
// of the device. Apart from the launches, so that tests check it without a GPU
// (tests/cpp/test_gpu_sparse_attention_schedule.cpp).
#pragma once

#include <cstddef>

#include "api/qsa_attention_params.h"
#include "cuda/attention/sparse_attention_launch.h"

namespace sparse_attn::cuda {

// What the schedule reads of the device (fixed while the process runs).
struct ScheduleDevice {
  int sm_count = 0;           // streaming multiprocessors
  int max_gather_splits = 8;  // the gather kernel's largest cluster (qsa_gather_max_splits)
};

// The device's facts, read from the runtime once per device (the callees cache them).
ScheduleDevice schedule_device(int device_index);

// Where each scratch buffer of a call lives in its workspace (byte offsets, each kAlign-aligned)
// and how many bytes the whole takes.
struct WorkspaceLayout {
  static constexpr size_t kAlign = 256;
  size_t o_partial = 0, lse_partial = 0, union_handled = 0, union_tiles = 0, bytes = 0;
};

// The launch schedule of a call (pointers unset) and its workspace layout: the one place that
// decides both, so the size qsa_sparse_attention_workspace_size reports and the memory the
// launcher carves up cannot disagree.
struct Schedule {
  SparseAttentionLaunch launch;
  size_t partial_slots = 0;  // num_splits * rows * Hq with SplitKV, else 0
  bool gather_rows = false;  // every row on the gather kernel alone (no union kernel before)
  int union_rows = 0;        // rows per CTA of the union kernel, 0 when it does not run
  int union_row_tiles = 0;   // tiles of union_rows rows
  int union_chunk = 0;       // row tiles per build + union kernel launch pair
  // The step kernel (qsa_step_kernel.cuh): rows per step (a request's R rows), 0 when it does
  // not run. It marks the steps it wrote in union_handled
  // (union_rows = step_rows, union_row_tiles = the steps); the gather kernel takes the rest.
  int step_rows = 0;
  WorkspaceLayout workspace;
};

// Reads sizes, layouts, options and pointer alignments of p only (no tensor contents).
Schedule schedule(const SparseAttentionParams& p, const ScheduleDevice& device);

}  // namespace sparse_attn::cuda

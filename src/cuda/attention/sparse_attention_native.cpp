// native_sparse_attention: the CUDA backend of qsa_sparse_attention. Validation (src/api) has
// passed; this file picks the schedule and the workspace layout that goes with it, takes the
// workspace from the caller (options.workspace) or else stream-ordered from the library's pool
// (so a captured graph owns its allocation), and turns the runtime dtypes into the kernel's T (and
// KV, the K/V element type).
#include <algorithm>
#include <climits>
#include <cstdint>
#include <initializer_list>
#include <limits>
#include <type_traits>

#include "api/qsa_attention_params.h"
#include "cuda/attention/qsa_step_params.h"
#include "cuda/attention/qsa_union_params.h"
#include "cuda/attention/sparse_attention_config.h"
#include "cuda/attention/sparse_attention_heuristics.h"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/attention/sparse_attention_schedule.h"
#include "cuda/common/check.h"
#include "cuda/common/device_guard.h"
#include "cuda/common/device_props.h"
#include "cuda/common/dispatch.h"
#include "cuda/common/narrow_metadata.h"
#include "cuda/common/workspace_pool.h"
#include "sparse_attn/errors.h"

namespace sparse_attn {
namespace cuda {

namespace {

// Whether every K/V row of the call has an int32 key (the union and gather kernels hold keys,
// the physical rows of their tokens, in 32 bits).
bool keys_fit_int32(const SparseAttentionParams& p) {
  constexpr int64_t kMaxKey = INT32_MAX;
  switch (p.kv_layout) {
    case KVLayout::kPaged:
      return p.num_pages * p.page_size <= kMaxKey;
    case KVLayout::kPadded:
      return p.batch * p.kv_capacity <= kMaxKey;
    default:
      return p.kv_layout == KVLayout::kPhysical;  // ids are int32 already
  }
}

// The fewest splits in which the gather kernel takes a row's entries: each split's fit its key
// queue, 512 blocks (32 tiles of 16) and the tail entry with the hint (always one split: the
// API takes at most 512 hint blocks), or 2112 token ids (33 tiles of 64; a top-2048 selection's
// 8195 ids need 4). schedule's partition in whole tiles then gives no split more: at S of
// these, ceil(tiles / S) is at most a split's tiles.
int64_t gather_min_splits(const SparseAttentionParams& p, const SparseAttentionLaunch& x) {
  const int64_t per_split = x.block_hint ? kQsaGatherMaxEntries - 1 : kQsaGatherMaxTokens;
  const int64_t entries = x.block_hint ? p.num_blocks : p.width;
  return std::max<int64_t>(1, (entries + per_split - 1) / per_split);
}

// Whether the gather kernel can take the call's rows in at most max_splits splits (1 where a
// kernel hands it rows at one split: the union and step kernels' leftovers): the row's entries
// in that many splits (gather_min_splits), K/V keys that fit int32, (row, KV head) pairs
// numbered in int32, 16-byte rows and strides for its copies of Q (K and V have them already:
// check_native's vector-load rule; out takes any layout, store_gated8). Any group check_native
// lets through (up to 16 heads) fits: the kernel computes 16 head columns a KV head and masks
// those past the group. Host-side facts of the inputs only: qsa_sparse_attention_workspace_size
// decides the same without out.
bool gather_fits(const SparseAttentionParams& p, const SparseAttentionLaunch& x, int max_splits) {
  const auto aligned = [](const void* ptr, std::initializer_list<int64_t> strides) {
    if (reinterpret_cast<uintptr_t>(ptr) % 16 != 0) return false;
    for (int64_t s : strides) {
      if (s % 8 != 0) return false;  // 16 bytes of 2-byte elements
    }
    return true;
  };
  constexpr int64_t kMaxInt = std::numeric_limits<int32_t>::max();
  return gather_min_splits(p, x) <= max_splits && keys_fit_int32(p) &&
         p.rows * p.num_kv_heads <= kMaxInt && p.q_dim_stride == 1 &&
         aligned(p.q, {p.q_row_stride, p.q_head_stride});
}

// Rows a request has on average from which its rows share K/V tiles through the union kernel
// (prefill); below, decode steps of up to 9 rows a request run row by row on the gather
// kernel, their shared tokens from L2, which beat the union kernel's build, whose tiles of 10
// rows then span requests (docs/perf-notes.md, session 24).
constexpr int64_t kSharedTileMinRows = 10;

// Whether the call's rows share K/V tiles, the prefill gate to the union kernel (use_union has
// the kernel's own conditions: 16-bit K/V, one split, the gather kernel's): on average at least
// kSharedTileMinRows rows per request, because only rows of one request share tokens (decode
// batches go to the gather or the per-row kernel).
bool rows_share_tiles(const SparseAttentionParams& p) {
  return p.rows >= kSharedTileMinRows * std::max<int64_t>(p.batch, 1);
}

// Whether the union prefill kernel runs, and the gather kernel after it on the rows it leaves:
// 16-bit K/V at one split, the gather kernel's conditions, the block hint with at most the
// union's columns, and a group of 12 to 16 heads (4 or 5 rows of them fill each warpgroup's 64
// M rows; the groups its tests cover). Smaller groups' prefill rows take the gather kernel.
bool use_union(const SparseAttentionParams& p, const SparseAttentionLaunch& x) {
  static_assert(QsaUnionConfig::kMaxEntries <= kQsaGatherMaxEntries);
  return p.kv_dtype == p.dtype && x.num_splits == 1 && x.block_hint && p.group >= 12 &&
         gather_fits(p, x, 1) && p.num_blocks <= QsaUnionConfig::kMaxEntries - 1;
}

// Whether the step kernel takes a multi-token decode step of `per_request` rows a request: the
// block hint, an even Hkv (a CTA takes two KV heads), 2 to 4 rows (every request alike), 16-bit
// K/V, no split count asked for, K/V capacities its bitmaps cover (1M tokens), a group of 12 to
// 16 heads (the groups its tests cover; smaller groups' steps take the gather kernel row by
// row), the gather kernel's conditions (it takes the steps the step kernel leaves), and B * Hkv
// at least the SM count. That last rule was measured (session 24) with one CTA a request and KV
// head: below it, the gather kernel's cluster splits over the rows one by one win, and the step
// kernel has none. Its B * Hkv / 2 CTAs then leave up to half the SMs idle (4 of 132 at B = 128
// and Hkv = 2): the threshold for two heads a CTA is still to be measured. The union of 4 rows
// that share 90% of their blocks is ~1.3x one row's bytes.
bool use_step(const SparseAttentionParams& p, const SparseAttentionLaunch& x, int64_t per_request,
              int sm_count) {
  const int64_t max_context = QsaStepConfig::kMaxContext;
  return x.block_hint && p.num_kv_heads % QsaStepConfig::kHeadsPerCta == 0 && per_request >= 2 &&
         per_request <= QsaStepConfig::kRows && p.kv_dtype == p.dtype && p.num_splits <= 1 &&
         p.row_mapping != RowMapping::kNone && p.batch * p.num_kv_heads >= sm_count &&
         p.kv_capacity <= max_context && p.group >= 12 && gather_fits(p, x, 1);
}

}  // namespace

ScheduleDevice schedule_device(int device_index) {
  return ScheduleDevice{sm_count(device_index), qsa_gather_max_splits(device_index)};
}

Schedule schedule(const SparseAttentionParams& p, const ScheduleDevice& device) {
  using C = SparseAttentionConfig;
  Schedule s;
  SparseAttentionLaunch& x = s.launch;
  // The structured path reads block_indices (one entry per 4-token block, the tail derived
  // from the position) when the hint is given and pages hold whole blocks.
  x.block_hint = p.block_indices && (p.kv_layout != KVLayout::kPaged || p.page_size % 4 == 0);
  const int64_t entries_per_tile = x.block_hint ? C::kBlockTokens / 4 : C::kBlockTokens;

  // Splits partition `entries` index entries in whole 64-token tiles, at most `splits` of them;
  // a count above the number of tiles would only add empty splits (which the merges skip), so
  // it is capped there.
  const auto split_tiles = [&](int64_t entries, int64_t splits) {
    const int64_t tiles = std::max<int64_t>(1, (entries + entries_per_tile - 1) / entries_per_tile);
    splits = std::clamp<int64_t>(splits, 1, std::min<int64_t>(tiles, 65535));
    const int64_t tiles_per_split = (tiles + splits - 1) / splits;
    x.split_cols = tiles_per_split * entries_per_tile;
    x.num_splits = static_cast<int>((tiles + tiles_per_split - 1) / tiles_per_split);
  };
  split_tiles(x.block_hint ? p.num_blocks + 1 : p.width,
              p.num_splits > 0
                  ? p.num_splits
                  : choose_num_splits(p.rows, p.num_kv_heads, p.width, device.sm_count));

  // A multi-token decode step of R = rows / batch rows a request, 2 <= R <= 4, goes to the step
  // kernel where the requests' CTAs fill the GPU (use_step). Otherwise a union tile is
  // 2 * (64 / G) consecutive rows (10 at 24/2) where rows share K/V tiles, or, on a
  // multi-token step with the hint that the step kernel does not take, one request's R rows
  // (R even, 4 or more and below a full tile) where the requests' CTAs (one an SM) fill the
  // GPU: R rows of one request share most of their blocks, which beat the rows one by one on
  // the gather kernel (docs/perf-notes.md, session 24; below the SM count, the gather kernel
  // takes the rows one by one). Rows of uneven requests only change which tiles the build (or
  // the step kernel) marks.
  const int full = 2 * static_cast<int>(64 / std::max<int64_t>(p.group, 1));
  const int64_t per_request = p.batch > 0 && p.rows % p.batch == 0 ? p.rows / p.batch : 0;
  const bool step = use_step(p, x, per_request, device.sm_count);
  const bool request_tiles = !step && per_request % 2 == 0 && per_request >= 4 &&
                             per_request < full && p.batch * p.num_kv_heads >= device.sm_count &&
                             use_union(p, x);
  if (step) {
    // The steps the step kernel leaves go to the gather kernel at one split.
    split_tiles(x.block_hint ? p.num_blocks : p.width, 1);
    s.step_rows = static_cast<int>(per_request);
    s.union_rows = s.step_rows;
    s.union_row_tiles = static_cast<int>(p.batch);
  } else if (request_tiles || (rows_share_tiles(p) && use_union(p, x))) {
    s.union_rows = request_tiles ? static_cast<int>(per_request) : full;
    s.union_row_tiles = static_cast<int>((p.rows + s.union_rows - 1) / s.union_rows);
    s.union_chunk = std::min(s.union_row_tiles, QsaUnionConfig::kChunkTiles);
  }
  // Calls neither the union nor the step kernel takes, with the hint (decode batches, FP8
  // prefill, groups below 12), and every token-id call, physical or not: rows one by one, each
  // (row, KV head) a CTA, reading a shared block's repeats from L2, which beat a kernel that
  // gathered 4 rows' union of tokens once a tile at every size measured: prefill of structured,
  // random and indexer selections, groups of 8 and 12, physical rows (docs/perf-notes.md,
  // sessions 39 and 40; physical mode cannot tell a decode batch from a prefill chunk). It keeps
  // more bytes in flight than the per-row one (two CTAs an SM, each with a producer warpgroup), and
  // its SplitKV merges inside a cluster (no workspace, no merge launch). What it does not fit
  // stays on the per-row kernel, which takes any shape, at x's splits: Q without 16-byte rows,
  // split counts past its cluster limit, and explicit counts below a row's fewest (rows past
  // 2112 ids where one split is asked for, prefill or not).
  // The gather kernel's split counts: up to the device's cluster limit, or the count asked for.
  const int max_splits =
      p.num_splits > 0 ? static_cast<int>(std::min<int64_t>(p.num_splits, device.max_gather_splits))
                       : device.max_gather_splits;
  if (s.union_rows == 0 && gather_fits(p, x, max_splits)) {
    const int64_t pairs = p.rows * p.num_kv_heads;
    // The split rule counts 4-token blocks; a token row of width W has about W / 4. Rows wider
    // than a split's key queue take at least gather_min_splits (gather_fits has checked that
    // an explicit count is not below it).
    const int64_t blocks = x.block_hint ? p.num_blocks : p.width / 4;
    const int64_t min_splits = gather_min_splits(p, x);
    const int64_t gather_splits =
        p.num_splits > 0
            ? p.num_splits
            : std::max<int64_t>(min_splits,
                                choose_gather_splits(pairs, blocks, max_splits, device.sm_count));
    if (gather_splits <= device.max_gather_splits &&
        pairs * gather_splits <= std::numeric_limits<int32_t>::max()) {
      s.gather_rows = true;
      // The gather kernel's splits take whole tiles of blocks (its last split also the tail
      // entry, beyond them) or of token ids. (2051 token ids in 8 splits of 257 would give
      // every split a fifth tile of one token; 7 splits of 320 give the slowest split the five
      // tiles it has either way.)
      split_tiles(x.block_hint ? p.num_blocks : p.width, gather_splits);
    }
  }
  s.partial_slots = x.num_splits > 1 && !s.gather_rows
                        ? static_cast<size_t>(x.num_splits) * p.rows * p.num_q_heads
                        : 0;
  const auto align = [](size_t n) {
    return (n + WorkspaceLayout::kAlign - 1) / WorkspaceLayout::kAlign * WorkspaceLayout::kAlign;
  };
  WorkspaceLayout& w = s.workspace;
  w.o_partial = 0;
  w.lse_partial = align(s.partial_slots * C::kHeadDim * sizeof(float));
  w.union_handled = w.lse_partial + align(s.partial_slots * sizeof(float));
  w.union_tiles = w.union_handled + align(static_cast<size_t>(s.union_row_tiles));
  w.bytes = w.union_tiles + align(static_cast<size_t>(s.union_chunk) * sizeof(QsaUnionTile));
  return s;
}

}  // namespace cuda

size_t native_sparse_attention_workspace_size(const SparseAttentionParams& p) {
  return p.rows == 0 ? 0 : cuda::schedule(p, cuda::schedule_device(p.device_index)).workspace.bytes;
}

void native_sparse_attention(const SparseAttentionParams& p) {
  using C = cuda::SparseAttentionConfig;
  // Validation (check_native in src/api/qsa_attention.cpp) has settled head_dim == 256,
  // group <= 16 and a paged, padded or physical K/V layout.
  static_assert(C::kHeadRows == 16 && C::kHeadDim == 256, "check_native's limits");
  if (p.rows == 0) return;
  cuda::DeviceGuard guard(p.device_index);
  auto stream = static_cast<cudaStream_t>(p.stream);
  const cuda::Schedule s = cuda::schedule(p, cuda::schedule_device(p.device_index));
  cuda::SparseAttentionLaunch x = s.launch;

  // The kernels read the ids and the page table as int32 (their hot loops issue a pass's loads
  // together); int64 ones go through int32 copies. The schedule above depends on shapes only.
  SparseAttentionParams q = p;
  // The kernels scale stored K values by k_scale through the softmax scale (1 unless FP8).
  q.scale_log2 = p.scale_log2 * p.k_scale;
  cuda::NarrowedMetadata narrowed(p.device_index, stream);
  narrowed.narrow(q.token_indices, p.rows, p.width, q.token_indices_row_stride,
                  &q.token_indices_col_stride);
  narrowed.narrow(q.block_indices, p.rows, p.num_blocks, q.block_indices_row_stride,
                  &q.block_indices_col_stride);
  narrowed.narrow(q.block_table, p.batch, p.max_pages, q.block_table_batch_stride,
                  &q.block_table_page_stride);
  narrowed.finish();

  // The caller's workspace (validated to hold s.workspace.bytes), else one from the pool.
  const cuda::StreamScratch pooled(p.workspace ? 0 : s.workspace.bytes, p.device_index, stream);
  char* workspace = static_cast<char*>(p.workspace ? p.workspace : pooled.get());
  if (s.partial_slots > 0) {
    x.o_partial = reinterpret_cast<float*>(workspace + s.workspace.o_partial);
    x.lse_partial = reinterpret_cast<float*>(workspace + s.workspace.lse_partial);
  }
  // The union or step kernel marks the row tiles (steps) it wrote; the gather kernel takes the
  // rest.
  uint8_t* const handled = reinterpret_cast<uint8_t*>(workspace + s.workspace.union_handled);
  cuda::QsaUnionParams u;
  if (s.union_rows > 0 && s.step_rows == 0) {
    u.p = q;
    u.x = x;
    u.handled = handled;
    u.tiles = reinterpret_cast<cuda::QsaUnionTile*>(workspace + s.workspace.union_tiles);
    u.rows_per_wg = s.union_rows / 2;
  }
  if (s.union_rows > 0) {
    x.union_handled = handled;
    x.union_rows = s.union_rows;
    x.after_step = s.step_rows > 0;
  }
  cuda::dispatch_dtype(p.dtype, "qsa_sparse_attention", [&](auto tag) {
    using T = typename decltype(tag)::type;
    cuda::dispatch_kv_dtype<T>(p.dtype, p.kv_dtype, "qsa_sparse_attention", [&](auto kv_tag) {
      using KV = typename decltype(kv_tag)::type;
      // The step and union kernels read 16-bit K/V: schedule() gives them no FP8 call.
      if (s.step_rows > 0) {
        cuda::QsaStepParams sp;
        sp.p = q;
        sp.handled = handled;
        sp.steps = p.batch;
        sp.rows_per_step = s.step_rows;
        if constexpr (std::is_same_v<KV, T>) {
          cuda::launch_qsa_step<T>(sp, stream);
        } else {
          // use_step takes 16-bit K/V only; the gather kernel would read unwritten flags.
          throw Error("qsa_sparse_attention: internal: the step kernel reached with FP8 K/V");
        }
      }
      // Chunks of row tiles bound the tiles' workspace: each is built, then attended.
      for (int begin = 0; s.union_chunk > 0 && begin < s.union_row_tiles; begin += s.union_chunk) {
        u.tile_begin = begin;
        u.chunk_tiles = std::min(s.union_chunk, s.union_row_tiles - begin);
        cuda::launch_qsa_union_build(u, stream);
        cuda::launch_qsa_union<T>(u, stream);
      }
      if (s.union_rows > 0 || s.gather_rows) {
        cuda::launch_qsa_gather<T, KV>(q, x, stream);
      } else {
        cuda::launch_sparse_attention<T, KV>(q, x, stream);
      }
    });
  });
}

}  // namespace sparse_attn

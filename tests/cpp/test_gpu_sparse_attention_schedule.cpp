// The native sparse-attention schedule (src/cuda/attention/sparse_attention_schedule.h) on the
// host: which kernel takes a call's rows and with how many splits, for the shapes the docs' worked
// examples and the bench use, and the gather kernel's limits for every width it takes. No GPU is
// needed (the device's facts are given); the file is built with the CUDA backend only.
#include <gtest/gtest.h>

#include <cstdint>
#include <optional>

#include "api/qsa_attention_params.h"
#include "cuda/attention/qsa_step_params.h"
#include "cuda/attention/sparse_attention_launch.h"
#include "cuda/attention/sparse_attention_schedule.h"

namespace sparse_attn::cuda {
namespace {

constexpr ScheduleDevice kH200{132, 16};

// The seed's geometry (24/2/256, bf16, paged K/V of page 64), R rows a request in `batch`
// requests at 32K context; the block hint of nb blocks, or width token ids without it.
struct Shape {
  int64_t batch = 1, rows_per_request = 1;
  std::optional<int64_t> hint_blocks;
  int64_t width = 2051;
  DType kv_dtype = DType::kBF16;
  int num_splits = 0;
};

SparseAttentionParams params(const Shape& s) {
  alignas(16) static char storage[16];
  SparseAttentionParams p;
  p.rows = s.batch * s.rows_per_request;
  p.batch = s.batch;
  p.num_q_heads = 24;
  p.num_kv_heads = 2;
  p.group = 12;
  p.head_dim = 256;
  p.kv_layout = KVLayout::kPaged;
  p.page_size = 64;
  p.max_pages = 512;
  p.num_pages = s.batch * p.max_pages;
  p.kv_capacity = p.max_pages * p.page_size;
  p.dtype = DType::kBF16;
  p.kv_dtype = s.kv_dtype;
  p.q = p.out = storage;
  p.q_row_stride = p.out_row_stride = 24 * 256;
  p.q_head_stride = p.out_head_stride = 256;
  p.q_dim_stride = p.out_dim_stride = 1;
  if (s.hint_blocks) {
    p.num_blocks = *s.hint_blocks;
    p.width = 4 * p.num_blocks + 3;
    p.block_indices = MetaPtr(storage, DType::kI32);
  } else {
    p.width = s.width;
  }
  p.token_indices = MetaPtr(storage, DType::kI32);
  p.row_mapping = RowMapping::kCuSeqlens;
  p.num_splits = s.num_splits;
  return p;
}

// The per-row kernel alone at one split: neither the gather kernel nor the union or step
// kernel, no SplitKV partials, no workspace.
void expect_per_row_one_split(const Schedule& s) {
  EXPECT_FALSE(s.gather_rows);
  EXPECT_EQ(s.union_rows, 0);
  EXPECT_EQ(s.step_rows, 0);
  EXPECT_EQ(s.launch.num_splits, 1);
  EXPECT_EQ(s.partial_slots, 0u);
  EXPECT_EQ(s.workspace.bytes, 0u);
}

// The gather kernel's splits of the docs' worked examples: 16 / 16 / 8 / 4 / 2 / 2 / 1 / 1 at
// B = 1 / 2 / 4 / 8 / 16 / 32 / 64 / 128 with the hint (whole tiles of 16 blocks: 32 to 512
// blocks a split), without a workspace; 2051 token ids at B = 1 in 11 splits of 192 (three
// tiles each).
TEST(SparseAttentionSchedule, DecodeTakesTheGatherKernelsSplits) {
  const int64_t batches[] = {1, 2, 4, 8, 16, 32, 64, 128};
  const int splits[] = {16, 16, 8, 4, 2, 2, 1, 1};
  for (int i = 0; i < 8; ++i) {
    for (bool hint : {true, false}) {
      Shape shape;
      shape.batch = batches[i];
      if (hint) shape.hint_blocks = 512;
      const Schedule s = schedule(params(shape), kH200);
      SCOPED_TRACE(testing::Message() << "B = " << batches[i] << (hint ? " hint" : " tokens"));
      EXPECT_TRUE(s.gather_rows);
      EXPECT_EQ(s.union_rows, 0);
      EXPECT_EQ(s.launch.block_hint, hint);
      EXPECT_EQ(s.workspace.bytes, 0u);
      if (hint) {
        EXPECT_EQ(s.launch.num_splits, splits[i]);
        EXPECT_EQ(s.launch.split_cols, 512 / splits[i]);
      }
    }
  }
  Shape tokens;
  const Schedule s = schedule(params(tokens), kH200);
  EXPECT_EQ(s.launch.num_splits, 11);
  EXPECT_EQ(s.launch.split_cols, 192);
  // Where clusters of 16 do not run, the portable 8.
  Shape one;
  one.hint_blocks = 512;
  EXPECT_EQ(schedule(params(one), ScheduleDevice{132, 8}).launch.num_splits, 8);
}

// Rows wider than a split's key queue (2112 token ids; the hint's 512 blocks always fit one)
// take the gather kernel in enough splits: 2113 ids at B = 1 and a top-2048 selection's 8195
// (the widest the selection ops return) at B = 128 too. Past 16 splits' worth, or with an
// explicit count below the fewest, the per-row kernel with its SplitKV partials in the
// workspace.
TEST(SparseAttentionSchedule, WideRowsTakeTheGatherKernelInEnoughSplits) {
  Shape shape;
  shape.width = 2112;
  Schedule s = schedule(params(shape), kH200);
  EXPECT_TRUE(s.gather_rows);
  shape.width = 2113;
  s = schedule(params(shape), kH200);
  EXPECT_TRUE(s.gather_rows);
  EXPECT_GE(s.launch.num_splits, 2);
  Shape wide;
  wide.batch = 128;
  wide.width = 4 * 2048 + 3;
  s = schedule(params(wide), kH200);
  EXPECT_TRUE(s.gather_rows);
  EXPECT_EQ(s.launch.num_splits, 4);
  EXPECT_EQ(s.launch.split_cols, 2112);
  EXPECT_EQ(s.workspace.bytes, 0u);
  wide.width = 4 * 2112 + 1;
  EXPECT_EQ(schedule(params(wide), kH200).launch.num_splits, 5);
  // Where only clusters of 8 run, 8 splits' worth.
  wide.width = 8 * 2112 + 1;
  EXPECT_TRUE(schedule(params(wide), kH200).gather_rows);
  EXPECT_FALSE(schedule(params(wide), ScheduleDevice{132, 8}).gather_rows);
  shape.width = 16 * 2112 + 1;
  s = schedule(params(shape), kH200);
  EXPECT_FALSE(s.gather_rows);
  EXPECT_EQ(s.union_rows, 0);
  EXPECT_GT(s.launch.num_splits, 1);
  EXPECT_EQ(s.partial_slots, static_cast<size_t>(s.launch.num_splits) * 24);
  EXPECT_GE(s.workspace.bytes, s.partial_slots * (256 + 1) * sizeof(float));
  shape.width = 2113;
  shape.num_splits = 1;
  expect_per_row_one_split(schedule(params(shape), kH200));
}

// FP8 decode takes the gather kernel at every batch, with the bf16 rule's counts (16 / 4 / 2 at
// B = 1 / 8 / 32); an explicit count is honoured.
TEST(SparseAttentionSchedule, Fp8DecodeTakesTheGatherKernel) {
  Shape shape;
  shape.hint_blocks = 512;
  shape.kv_dtype = DType::kF8E4M3;
  const int64_t batches[] = {1, 8, 32};
  const int splits[] = {16, 4, 2};
  for (int i = 0; i < 3; ++i) {
    shape.batch = batches[i];
    const Schedule s = schedule(params(shape), kH200);
    EXPECT_TRUE(s.gather_rows) << "B = " << batches[i];
    EXPECT_EQ(s.launch.num_splits, splits[i]) << "B = " << batches[i];
  }
  shape.batch = 1;
  shape.num_splits = 8;
  const Schedule s = schedule(params(shape), kH200);
  EXPECT_TRUE(s.gather_rows);
  EXPECT_EQ(s.launch.num_splits, 8);
}

// Split counts past the device's cluster limit go to the per-row kernel: 16 where clusters of
// 16 run, 8 where only the portable size does.
TEST(SparseAttentionSchedule, SplitsPastTheClusterLimitTakeThePerRowKernel) {
  Shape shape;
  shape.hint_blocks = 512;
  shape.num_splits = 16;
  EXPECT_TRUE(schedule(params(shape), kH200).gather_rows);
  EXPECT_FALSE(schedule(params(shape), ScheduleDevice{132, 8}).gather_rows);
  shape.num_splits = 17;
  EXPECT_FALSE(schedule(params(shape), kH200).gather_rows);
}

// Prefill with the hint: tiles of 10 rows on the union kernel (its flags and records in the
// workspace), the gather kernel after it at one split; token ids on the gather kernel at one
// split, at two past its 2112 ids a row, and on the per-row kernel at one split where one
// split is asked for.
TEST(SparseAttentionSchedule, PrefillTakesTheUnionGatherOrPerRowKernel) {
  Shape shape;
  shape.rows_per_request = 150;
  shape.hint_blocks = 512;
  Schedule s = schedule(params(shape), kH200);
  EXPECT_EQ(s.union_rows, 10);
  EXPECT_EQ(s.union_row_tiles, 15);
  EXPECT_EQ(s.launch.num_splits, 1);
  EXPECT_GT(s.workspace.bytes, 0u);
  shape.hint_blocks.reset();
  s = schedule(params(shape), kH200);
  EXPECT_EQ(s.union_rows, 0);
  EXPECT_TRUE(s.gather_rows);
  EXPECT_EQ(s.launch.num_splits, 1);
  EXPECT_EQ(s.workspace.bytes, 0u);
  shape.width = 2113;
  s = schedule(params(shape), kH200);
  EXPECT_TRUE(s.gather_rows);
  EXPECT_EQ(s.launch.num_splits, 2);
  shape.num_splits = 1;
  expect_per_row_one_split(schedule(params(shape), kH200));
}

// Q without 16-byte rows (here a Q view 2 bytes past an aligned address) fits neither the
// gather nor the union kernel: prefill rows, with the hint or token ids, take the per-row
// kernel at the one split its rule gives 300 (row, KV head) pairs.
TEST(SparseAttentionSchedule, UnalignedQTakesThePerRowKernel) {
  Shape shape;
  shape.rows_per_request = 150;
  for (bool hint : {false, true}) {
    SCOPED_TRACE(hint ? "hint" : "tokens");
    if (hint) shape.hint_blocks = 512;
    SparseAttentionParams p = params(shape);
    const Schedule aligned = schedule(p, kH200);
    EXPECT_EQ(aligned.gather_rows, !hint);
    EXPECT_EQ(aligned.union_rows, hint ? 10 : 0);
    p.q = static_cast<const char*>(p.q) + 2;
    expect_per_row_one_split(schedule(p, kH200));
  }
}

// Physical calls (selected_kv_indices: no requests, no page table) take the gather kernel at
// any row count where it fits, as token ids do: a decode batch of 128 unrelated rows and a
// 16K-row prefill chunk alike (session 39), and rows past 2112 ids in two splits. The per-row
// kernel takes rows past 2112 ids where one split is asked for.
TEST(SparseAttentionSchedule, PhysicalCallsTakeTheGatherKernel) {
  const auto physical = [](int64_t rows, int64_t width) {
    SparseAttentionParams p = params(Shape{});
    p.rows = rows;
    p.batch = 0;
    p.width = width;
    p.kv_layout = KVLayout::kPhysical;
    p.page_size = p.max_pages = p.num_pages = p.kv_capacity = 0;
    p.total_kv = 1 << 20;
    p.row_mapping = RowMapping::kNone;
    return p;
  };
  for (int64_t rows : {1, 8, 32, 128, 1024, 16384}) {
    const Schedule s = schedule(physical(rows, 2051), kH200);
    SCOPED_TRACE(testing::Message() << rows << " rows");
    EXPECT_TRUE(s.gather_rows);
    EXPECT_EQ(s.union_rows, 0);
    EXPECT_EQ(s.workspace.bytes, 0u);
  }
  EXPECT_EQ(schedule(physical(128, 2051), kH200).launch.num_splits, 1);
  const Schedule wide = schedule(physical(16384, 2113), kH200);
  EXPECT_TRUE(wide.gather_rows);
  EXPECT_EQ(wide.launch.num_splits, 2);
  // The GPU suite's physical case: 10 rows of 2200 ids, the gather kernel's splits, or the
  // per-row kernel at one split where one is asked for.
  SparseAttentionParams ten = physical(10, 2200);
  const Schedule split = schedule(ten, kH200);
  EXPECT_TRUE(split.gather_rows);
  EXPECT_GE(split.launch.num_splits, 2);
  ten.num_splits = 1;
  expect_per_row_one_split(schedule(ten, kH200));
}

// Groups below 12 heads (here 8: 16/2, and 1) take the gather kernel wherever it fits: decode,
// prefill with token ids or the hint (the union kernel takes groups of 12 to 16 only), and
// multi-token steps (the step kernel's groups are the union's). Rows past 2112 ids where one
// split is asked for take the per-row kernel, as at any group.
TEST(SparseAttentionSchedule, SmallGroupsTakeTheGatherKernel) {
  const auto with_group = [](const Shape& shape, int64_t hq) {
    SparseAttentionParams p = params(shape);
    p.num_q_heads = hq;
    p.group = hq / p.num_kv_heads;
    p.q_row_stride = p.out_row_stride = hq * 256;
    return p;
  };
  for (int64_t hq : {16, 2}) {
    SCOPED_TRACE(testing::Message() << "group " << hq / 2);
    Shape shape;
    for (int64_t batch : {1, 128}) {
      shape.batch = batch;
      EXPECT_TRUE(schedule(with_group(shape, hq), kH200).gather_rows);
      shape.hint_blocks = 512;
      EXPECT_TRUE(schedule(with_group(shape, hq), kH200).gather_rows);
      shape.hint_blocks.reset();
    }
    shape.batch = 1;
    shape.rows_per_request = 150;
    for (bool hint : {false, true}) {
      if (hint) shape.hint_blocks = 512;
      const Schedule s = schedule(with_group(shape, hq), kH200);
      EXPECT_TRUE(s.gather_rows);
      EXPECT_EQ(s.union_rows, 0);
      EXPECT_EQ(s.launch.num_splits, 1);
      EXPECT_EQ(s.workspace.bytes, 0u);
    }
    shape.batch = 128;
    shape.rows_per_request = 4;
    const Schedule step = schedule(with_group(shape, hq), kH200);
    EXPECT_EQ(step.step_rows, 0);
    EXPECT_TRUE(step.gather_rows);
    shape.batch = 1;
    shape.rows_per_request = 150;
    shape.hint_blocks.reset();
    shape.width = 2200;
    shape.num_splits = 1;
    expect_per_row_one_split(schedule(with_group(shape, hq), kH200));
  }
}

// Multi-token decode steps with the hint: a request's 2 to 4 rows are one step-kernel CTA (both
// KV heads) once the requests' CTAs fill the SMs (B * Hkv >= 132), the gather kernel after it at
// one split for the steps it leaves; 6 rows are union tiles; below the SM count, and for FP8, an
// explicit split count, contexts past the step kernel's bitmaps or token ids, the gather kernel
// takes the rows one by one.
TEST(SparseAttentionSchedule, MultiTokenStepsTakeTheStepKernel) {
  Shape shape;
  shape.hint_blocks = 512;
  shape.batch = 128;
  for (int64_t r : {2, 3, 4}) {
    shape.rows_per_request = r;
    const Schedule s = schedule(params(shape), kH200);
    EXPECT_EQ(s.step_rows, r);
    EXPECT_EQ(s.union_rows, r);
    EXPECT_EQ(s.union_row_tiles, 128);
    EXPECT_EQ(s.union_chunk, 0);
    EXPECT_FALSE(s.gather_rows);
    EXPECT_EQ(s.launch.num_splits, 1);
    EXPECT_EQ(s.partial_slots, 0u);
    EXPECT_GE(s.workspace.bytes, 128u);  // the steps' flags
  }
  shape.rows_per_request = 4;
  shape.batch = 65;
  const Schedule small = schedule(params(shape), kH200);
  EXPECT_EQ(small.step_rows, 0);
  EXPECT_EQ(small.union_rows, 0);
  EXPECT_TRUE(small.gather_rows);
  shape.batch = 128;
  shape.rows_per_request = 6;
  const Schedule six = schedule(params(shape), kH200);
  EXPECT_EQ(six.step_rows, 0);
  EXPECT_EQ(six.union_rows, 6);
  shape.rows_per_request = 4;
  shape.kv_dtype = DType::kF8E4M3;
  EXPECT_EQ(schedule(params(shape), kH200).step_rows, 0);
  shape.kv_dtype = DType::kBF16;
  shape.num_splits = 2;
  EXPECT_EQ(schedule(params(shape), kH200).step_rows, 0);
  shape.num_splits = 0;
  // K/V capacities past the bitmaps: 1M tokens.
  const auto with_capacity = [&](int64_t tokens) {
    SparseAttentionParams p = params(shape);
    p.max_pages = tokens / 64;
    p.kv_capacity = p.max_pages * 64;
    p.num_pages = p.max_pages;
    return p;
  };
  EXPECT_EQ(schedule(with_capacity(QsaStepConfig::kMaxContext), kH200).step_rows, 4);
  EXPECT_EQ(schedule(with_capacity(QsaStepConfig::kMaxContext + 64), kH200).step_rows, 0);
  shape.hint_blocks.reset();
  const Schedule tokens = schedule(params(shape), kH200);
  EXPECT_EQ(tokens.step_rows, 0);
  EXPECT_TRUE(tokens.gather_rows);
}

// Every width the gather kernel takes (up to 16 splits of a key queue each), at every split
// count, fits its key queue: the largest split (the last: split_cols entries, with the hint
// also the tail) holds at most 2112 token slots (the launcher's check), the splits cover the
// row's entries, and their count is within the cluster limit.
TEST(SparseAttentionSchedule, GatherSplitsFitTheKeyQueue) {
  for (bool hint : {true, false}) {
    const int64_t max_entries = 16 * (hint ? kQsaGatherMaxEntries - 1 : kQsaGatherMaxTokens);
    for (int64_t n = 0; n <= max_entries + 64; n += n < 2200 ? 1 : 7) {
      for (int splits = 0; splits <= 16; ++splits) {
        Shape shape;
        shape.batch = 3;
        if (hint) {
          shape.hint_blocks = n;
        } else {
          shape.width = n;
        }
        shape.num_splits = splits;
        const Schedule s = schedule(params(shape), kH200);
        // The heuristic's count takes every width up to 16 splits' worth to the gather kernel;
        // explicit counts past the limit, or too few for the width, go elsewhere.
        if (splits == 0 && n <= max_entries) ASSERT_TRUE(s.gather_rows) << n << " entries";
        if (!s.gather_rows) continue;
        const SparseAttentionLaunch& x = s.launch;
        const int64_t entries = hint ? n + 1 : n;
        const int64_t largest = x.num_splits == 1 ? entries : x.split_cols + (hint ? 1 : 0);
        ASSERT_LE((hint ? 4 : 1) * largest, 2112) << n << " entries, " << splits << " splits";
        ASSERT_LE(x.num_splits, kH200.max_gather_splits);
        ASSERT_GE(x.num_splits * x.split_cols + (hint ? 1 : 0), entries);
        ASSERT_LT((x.num_splits - 1) * x.split_cols, std::max<int64_t>(entries, 1));
      }
    }
  }
}

}  // namespace
}  // namespace sparse_attn::cuda

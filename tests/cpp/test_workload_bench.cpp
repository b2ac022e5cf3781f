// The shared benchmark cases: unique names, a CPU set, and the work model against counts made
// here entry by entry.
#include <gtest/gtest.h>

#include <algorithm>
#include <set>

#include "sparse_attn/bench_cases.h"

namespace sparse_attn {
namespace {

TEST(BenchCases, NamesAreUniqueAndBothSetsExist) {
  const auto cases = standard_bench_cases();
  std::set<std::string> names;
  int cpu = 0, gpu = 0;
  for (const auto& c : cases) {
    EXPECT_TRUE(names.insert(c.name).second) << "duplicate " << c.name;
    (c.gpu_size ? gpu : cpu)++;
    EXPECT_EQ(c.name.rfind("cpu/", 0) == 0, !c.gpu_size) << c.name;
  }
  EXPECT_GE(cpu, 4);
  EXPECT_GE(gpu, 10);
}

TEST(BenchCases, IndexerPrefillWorkCountsVisibleBlocksExactly) {
  BenchCase c;
  c.op = BenchOp::kIndexerPrefill;
  c.workload.seq_len = 37;
  c.workload.query_len = 37;
  c.workload.dtype = DType::kBF16;
  double pairs = 0;
  for (int p = 0; p < 37; ++p)
    for (int b = 0; b < 37 / 4; ++b) pairs += (4 * b + 3 <= p);
  const BenchWork w = bench_work(c);
  EXPECT_DOUBLE_EQ(w.flops, pairs * 4 * 128 * 2);
  EXPECT_DOUBLE_EQ(w.bytes, 37.0 * 4 * 128 * 2 + 9.0 * 128 * 2 + 37.0 * 9 * 4);
}

TEST(BenchCases, SparsePrefillCountsOnlySelectedTokens) {
  BenchCase c;
  c.op = BenchOp::kSparsePrefill;
  c.topk = 2;  // 11 tokens per row at most
  c.workload.seq_len = 20;
  c.workload.query_len = 5;  // rows at positions 15..19
  double sel = 0;
  for (int p = 15; p < 20; ++p) sel += std::min(11, p + 1);
  const BenchWork w = bench_work(c);
  EXPECT_DOUBLE_EQ(w.flops, sel * 24 * 256 * 4);
}

TEST(BenchCases, BlockSparseScalesWithTheKeptFraction) {
  BenchCase c;
  c.op = BenchOp::kBlockSparse;
  c.workload.seq_len = c.workload.query_len = 1024;
  EXPECT_DOUBLE_EQ(bench_work(c, 0.25).flops * 4, bench_work(c, 1.0).flops);
}

}  // namespace
}  // namespace sparse_attn

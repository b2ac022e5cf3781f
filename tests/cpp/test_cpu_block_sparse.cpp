// The CPU backend's block-sparse attention (backend 'native' on CPU tensors) against the
// reference on fresh random inputs: the forms every native backend must match
// (block_sparse_cases.h), plus what only the CPU backend takes (float32, head dims that are no
// multiple of a vector, any page size), results independent of the thread count, and broken
// metadata refused as the reference refuses it.
#include <gtest/gtest.h>
#include <omp.h>

#include <cstring>
#include <string>
#include <vector>

#include "block_sparse_cases.h"
#include "sparse_attn/cpu.h"
#include "sparse_attn/errors.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::BsCase;
using testing::Problem;

Problem make_cpu_problem(const BsCase& c, std::mt19937_64& rng) {
  Problem pb = testing::make_problem(c, rng);
  testing::share_host_inputs(pb);
  return pb;
}

std::vector<BsCase> cpu_cases() {
  std::vector<BsCase> v = testing::block_sparse_cases();
  for (int64_t d : {40, 96, 200}) {  // padded to whole register blocks inside
    BsCase c;
    c.name = "f32_d" + std::to_string(d) + "_varlen_causal";
    c.dtype = DType::kF32;
    c.d = d;
    c.lq = {150, 2};
    c.lk = {390, 2};
    v.push_back(c);
  }
  for (int64_t page : {1, 6, 130}) {  // pages the CUDA kernel does not take
    BsCase c;
    c.name = "bf16_d64_paged_page" + std::to_string(page);
    c.d = 64;
    c.page_size = page;
    c.lq = {100, 40};
    c.lk = {600, 40};
    c.keep = 0.6;
    v.push_back(c);
  }
  {
    BsCase c;  // many items for the threads: heads x query blocks, GQA 6
    c.name = "bf16_d128_gqa6_1200_rows";
    c.hq = 12;
    c.hkv = 2;
    c.lq = {1200};
    c.lk = {1200};
    v.push_back(c);
  }
  return v;
}

class CpuBlockSparse : public ::testing::TestWithParam<BsCase> {};

TEST_P(CpuBlockSparse, MatchesReference) {
  auto rng = testing::make_rng();
  Problem pb = make_cpu_problem(GetParam(), rng);
  testing::run(pb, false);
  testing::run(pb, true);
  testing::expect_matches_reference(pb);
}

INSTANTIATE_TEST_SUITE_P(Forms, CpuBlockSparse, ::testing::ValuesIn(cpu_cases()),
                         testing::case_name);

// Each (head, query block) is one thread's work from start to end: the bits do not depend on
// how many threads there are.
TEST(CpuBlockSparseDeterminism, OneAndTwoThreadsGiveTheSameBits) {
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {700, 300};
  c.lk = {1500, 300};
  c.hq = 4;
  Problem pb = make_cpu_problem(c, rng);
  const int threads = omp_get_max_threads();
  omp_set_num_threads(1);
  testing::run(pb, true);
  const Tensor first = Tensor::to_host(pb.nout.view()), first_lse = Tensor::to_host(pb.nlse.view());
  omp_set_num_threads(2);
  testing::poison(pb.nout.view());
  testing::run(pb, true);
  omp_set_num_threads(threads);
  ASSERT_EQ(std::memcmp(first.data(), pb.nout.data(), first.numel() * 2), 0);
  ASSERT_EQ(std::memcmp(first_lse.data(), pb.nlse.data(), first_lse.numel() * 4), 0);
}

// Broken promises in the metadata are the reference's ValueErrors, raised before any write.
TEST(CpuBlockSparseValidation, BrokenMetadataIsRefusedByName) {
  auto rng = testing::make_rng();
  BsCase c;
  c.lq = {100, 50};
  c.lk = {200, 80};
  Problem pb = make_cpu_problem(c, rng);
  pb.cu_q.data_as<int32_t>()[1] = 160;  // past cu_q[2] = 150: decreasing
  try {
    testing::run(pb, true);
    FAIL() << "decreasing cu_seqlens_q accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("cu_seqlens_q"), std::string::npos) << e.what();
  }
  BsCase paged = c;
  paged.page_size = 16;
  Problem pp = make_cpu_problem(paged, rng);
  pp.table.data_as<int32_t>()[0] = static_cast<int32_t>(pp.num_pages);
  try {
    testing::run(pp, true);
    FAIL() << "page id past the pool accepted";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("block_table"), std::string::npos) << e.what();
  }
}

TEST(CpuBackend, NamesItsInstructionSetAndMeasuresItsPeak) {
  EXPECT_FALSE(cpu_backend_isa().empty());
  EXPECT_GT(measure_cpu_fma_rate(1), 1e8);  // any x86-64 core does far more
}

}  // namespace
}  // namespace sparse_attn

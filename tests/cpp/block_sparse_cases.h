// The block-sparse attention cases shared by the native backends' suites (CUDA:
// test_gpu_block_sparse.cpp, CPU: test_cpu_block_sparse.cpp): every head dim and dtype, causal and
// not, q_len above and below k_len, dense / block-sparse / streaming heads, GQA, varlen batches
// with empty and 1-row sequences, page sizes smaller than a tile (8, 24), holding whole tiles
// (128, 256) and engine sizes whose tiles sometimes cross a page boundary (800, 1600), NaN in
// unused page slots, poisoned outputs (rows outside every sequence stay untouched).
#pragma once

#include <gtest/gtest.h>

#include <random>
#include <string>
#include <vector>

#include "sparse_attn/tensor.h"
#include "sparse_attn/xattn.h"

namespace sparse_attn::testing {

struct BsCase {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t hq = 4, hkv = 2, d = 128;
  std::vector<int64_t> lq, lk;  // per sequence
  bool causal = true;
  int64_t page_size = 0;            // 0: varlen K/V
  std::vector<int32_t> head_types;  // empty: every head block-sparse
  std::vector<int32_t> streaming;   // (sink, local) per head
  double keep = 0.4;                // share of kept mask blocks
  bool lse = true;
  int64_t extra_q_rows = 0;  // rows after the last sequence (never written)
  double softmax_scale = 0;  // 0: the default, 1 / sqrt(d)
};

std::string case_name(const ::testing::TestParamInfo<BsCase>& info);

// The forms every native backend must match the reference on.
std::vector<BsCase> block_sparse_cases();

// A case's host tensors and the reference's results (out, lse), and the native backend's
// tensors (n*: device copies for CUDA, the host inputs and fresh outputs for the CPU backend).
struct Problem {
  BsCase c;
  int64_t batch = 0, total_q = 0, total_k = 0, max_q = 0, max_k = 0, sparse_heads = 0;
  int64_t num_pages = 0, max_pages = 0;
  Tensor q, k, v, cu_q, cu_k, mask, table, seqlens, out, lse;            // host
  Tensor nq, nk, nv, ncu_q, ncu_k, nmask, ntable, nseqlens, nout, nlse;  // native
  BlockSparseAttentionOptions opts;
};

// Host tensors of a case (outputs poisoned); the native tensors are left for the suite.
Problem make_problem(const BsCase& c, std::mt19937_64& rng);

// The native tensors: the host inputs themselves, outputs fresh and poisoned (CPU backend).
void share_host_inputs(Problem& pb);

// Runs the op on the host tensors (reference) or the native ones (backend native).
void run(Problem& pb, bool native, void* stream = nullptr);

// Native against the reference: -inf and NaN positions first (all_close), then tolerances;
// rows outside every sequence stay poisoned in both.
void expect_matches_reference(const Problem& pb);

}  // namespace sparse_attn::testing

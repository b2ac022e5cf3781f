// The shared benchmark cases and their work model; include/sparse_attn/bench_cases.h.
#include "sparse_attn/bench_cases.h"

#include <fmt/format.h>

#include <algorithm>
#include <cmath>
#include <tuple>

namespace sparse_attn {
namespace {

std::string k_str(int64_t n) {
  return n % 1024 == 0 ? fmt::format("{}k", n / 1024) : std::to_string(n);
}

BenchCase qsa_case(std::string name, BenchOp op, int64_t batch, int64_t ctx, int64_t rows,
                   int64_t page_size, bool gpu) {
  BenchCase c;
  c.name = std::move(name);
  c.op = op;
  c.workload.batch = batch;
  c.workload.seq_len = ctx;
  c.workload.query_len = rows;
  c.page_size = page_size;
  c.gpu_size = gpu;
  return c;
}

BenchCase xattn_case(std::string name, BenchOp op, int64_t tokens, bool gpu) {
  BenchCase c = qsa_case(std::move(name), op, 1, tokens, tokens, 0, gpu);
  c.workload.num_q_heads = 32, c.workload.num_kv_heads = 8, c.workload.head_dim = 128;
  c.workload.indexer_heads = 0;
  return c;
}

}  // namespace

const char* bench_op_name(BenchOp op) {
  switch (op) {
    case BenchOp::kIndexerPrefill:
      return "qsa_indexer_mqa_score";
    case BenchOp::kIndexerDecode:
      return "qsa_mqa_decode";
    case BenchOp::kSparseDecode:
      return "qsa_sparse_attention (decode)";
    case BenchOp::kSparsePrefill:
      return "qsa_sparse_attention (prefill)";
    case BenchOp::kXAttnEstimate:
      return "xattn_estimate";
    case BenchOp::kBlockSparse:
      return "block_sparse_attention";
  }
  return "?";
}

std::vector<BenchCase> standard_bench_cases() {
  std::vector<BenchCase> cases;
  for (int64_t t : {4096, 16384, 65536})
    cases.push_back(
        qsa_case("indexer-prefill/" + k_str(t), BenchOp::kIndexerPrefill, 1, t, t, 0, true));
  for (auto [b, ctx, page] :
       {std::tuple{1, 131072, 64}, {32, 32768, 16}, {32, 32768, 64}, {128, 8192, 64}})
    cases.push_back(qsa_case(fmt::format("indexer-decode/b{}/ctx{}/page{}", b, k_str(ctx), page),
                             BenchOp::kIndexerDecode, b, ctx, 1, page, true));
  for (auto [b, ctx] : {std::pair{1, 131072}, {8, 32768}, {32, 32768}, {128, 8192}})
    cases.push_back(qsa_case(fmt::format("sparse-decode/b{}/ctx{}", b, k_str(ctx)),
                             BenchOp::kSparseDecode, b, ctx, 1, 64, true));
  for (int64_t t : {16384, 65536})
    cases.push_back(
        qsa_case("sparse-prefill/" + k_str(t), BenchOp::kSparsePrefill, 1, t, t, 0, true));
  for (int64_t t : {16384, 65536}) {
    cases.push_back(xattn_case("xattn-estimate/" + k_str(t), BenchOp::kXAttnEstimate, t, true));
    cases.push_back(xattn_case("block-sparse/" + k_str(t), BenchOp::kBlockSparse, t, true));
  }
  // The CPU set: seconds with the reference backend on two cores.
  cases.push_back(
      qsa_case("cpu/indexer-prefill/2k", BenchOp::kIndexerPrefill, 1, 2048, 2048, 0, false));
  cases.push_back(qsa_case("cpu/indexer-decode/b4/ctx8k/page64", BenchOp::kIndexerDecode, 4, 8192,
                           1, 64, false));
  cases.push_back(
      qsa_case("cpu/sparse-decode/b4/ctx8k", BenchOp::kSparseDecode, 4, 8192, 1, 64, false));
  cases.push_back(
      qsa_case("cpu/sparse-prefill/512", BenchOp::kSparsePrefill, 1, 4096, 512, 0, false));
  cases.push_back(xattn_case("cpu/xattn-estimate/2k", BenchOp::kXAttnEstimate, 2048, false));
  cases.push_back(xattn_case("cpu/block-sparse/1k", BenchOp::kBlockSparse, 1024, false));
  // The CPU backend's bar (issue 18): a whole 8K prompt.
  cases.push_back(
      qsa_case("cpu/sparse-prefill/8k", BenchOp::kSparsePrefill, 1, 8192, 8192, 0, false));
  cases.push_back(xattn_case("cpu/block-sparse/8k", BenchOp::kBlockSparse, 8192, false));
  return cases;
}

BenchWork bench_work(const BenchCase& c, double kept_fraction) {
  const WorkloadOptions& o = c.workload;
  const double B = double(o.batch), T = double(o.seq_len),
               Lq = double(o.query_len > 0 ? o.query_len : o.seq_len);
  const double Hq = double(o.num_q_heads), Hkv = double(o.num_kv_heads), D = double(o.head_dim);
  const double Hi = double(o.indexer_heads), Di = double(o.indexer_dim);
  const double in_bytes = dtype_size(o.dtype);
  const double W = double(4 * c.topk + 3);
  BenchWork w;
  switch (c.op) {
    case BenchOp::kIndexerPrefill: {
      const double nb = std::floor(T / 4);
      double pairs = 0;  // causal: the row at position p sees (p + 1) / 4 complete blocks
      for (double p = T - Lq; p < T; ++p) pairs += std::min(nb, std::floor((p + 1) / 4));
      w.flops = B * pairs * Hi * Di * 2;
      w.bytes = B * (Lq * Hi * Di * in_bytes + nb * Di * in_bytes + Lq * nb * 4);
      break;
    }
    case BenchOp::kIndexerDecode: {
      const double nb = std::floor(T / 4);
      w.flops = B * nb * Hi * Di * 2;
      w.bytes = B * (Hi * Di * in_bytes + nb * Di * in_bytes + nb * 4);
      break;
    }
    case BenchOp::kSparseDecode: {
      const double sel = std::min(W, T);
      w.flops = B * Hq * sel * D * 4;
      w.bytes = B * (sel * Hkv * D * in_bytes * 2 + Hq * D * in_bytes * 2 + sel * 4);
      break;
    }
    case BenchOp::kSparsePrefill: {
      // Row at position p keeps min(W, p + 1) tokens; the rows are the last Lq of T.
      double sel = 0;
      for (double p = T - Lq; p < T; ++p) sel += std::min(W, p + 1);
      w.flops = B * Hq * sel * D * 4;
      w.bytes = B * (T * Hkv * D * in_bytes * 2 + Lq * Hq * D * in_bytes * 2 + Lq * W * 4);
      break;
    }
    case BenchOp::kXAttnEstimate: {
      const double stride = 8, nb = std::ceil(T / 128);
      w.flops = B * Hq * (Lq / stride) * (T / stride) / 2 * stride * D * 2;
      w.bytes = B * ((Lq * Hq + T * Hkv) * D * in_bytes + Hq * nb * nb * 5);
      break;
    }
    case BenchOp::kBlockSparse: {
      w.flops = B * Hq * kept_fraction * Lq * T / 2 * D * 4;
      w.bytes = B * (Lq * Hq * D * in_bytes * 2 + T * Hkv * D * in_bytes * 2);
      break;
    }
  }
  return w;
}

}  // namespace sparse_attn

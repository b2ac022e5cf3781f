// The benchmark cases that `sparse-attn bench` and the benchmark programs share: each names an
// op, its shapes, the structured workload behind its inputs, and the work it must do (useful
// FLOPs and the bytes it must move at least), from which a run's TFLOP/s, TB/s and its ratio
// to the floor follow.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "sparse_attn/workload.h"

namespace sparse_attn {

enum class BenchOp : uint8_t {
  kIndexerPrefill,  // qsa_indexer_mqa_score: rows = tokens, keys = tokens / 4, causal
  kIndexerDecode,   // qsa_mqa_decode: one row per request, paged compressed keys
  kSparseDecode,    // qsa_sparse_attention: one row per request, 4k+3 selected tokens, paged K/V
  kSparsePrefill,   // qsa_sparse_attention: every row of a prompt, 4k+3 selected tokens
  kXAttnEstimate,   // xattn_estimate over a whole prompt
  kBlockSparse,     // block_sparse_attention with XAttention's mask of the workload
};
const char* bench_op_name(BenchOp op);

struct BenchCase {
  std::string name;  // e.g. "sparse-decode/b32/ctx64k"
  BenchOp op;
  WorkloadOptions workload;  // batch, seq_len (context per request), query_len, geometry
  int64_t topk = 512;        // QSA blocks per row
  int64_t page_size = 64;    // paged cases
  bool gpu_size = true;      // false: small enough for the CPU reference
};

// The standard cases (the GPU set from the CUDA issues' benchmark lists) followed by a small
// set that the CPU reference finishes in seconds.
std::vector<BenchCase> standard_bench_cases();

// The work of one call: FLOPs that count (multiply-adds x 2 over the entries actually computed:
// visible scores, selected tokens; causal halves counted as halves), and the fewest bytes it
// must move (each input read once, each output written once). kept_fraction: the share of
// causal key blocks a block-sparse mask keeps (kBlockSparse only).
struct BenchWork {
  double flops = 0;
  double bytes = 0;
};
BenchWork bench_work(const BenchCase& c, double kept_fraction = 1.0);

}  // namespace sparse_attn

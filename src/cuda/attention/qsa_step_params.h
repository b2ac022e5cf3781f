// Configuration and kernel parameters of the multi-token decode step kernel
// (qsa_step_kernel.cuh), shared with the host code that decides whether it runs
// (sparse_attention_native.cpp).
#pragma once

#include <cuda_runtime_api.h>

#include <cstdint>

#include "api/qsa_attention_params.h"
#include "cuda/attention/sparse_attention_launch.h"

namespace sparse_attn::cuda {

// The rows' entries are the block hint's blocks and each row's tail entry (x.block_hint): the
// union of four rows' token ids (41 KB of keys and row bits) would not fit beside four stages and
// two Q tiles.
struct QsaStepConfig {
  static constexpr int kRows = 4;                     // a step's query rows, at most
  static constexpr int kHeadsPerRow = 16;             // a KV head's query heads (group <= 16)
  static constexpr int kCols = kRows * kHeadsPerRow;  // N of both GEMMs
  static constexpr int kHeadDim = 256;
  static constexpr int kBlockN = 64;      // union tokens per K/V tile
  static constexpr int kHeadsPerCta = 2;  // KV heads a CTA, a consumer warpgroup each
  static constexpr int kThreads = 128 * (1 + kHeadsPerCta);  // the producer warpgroup first
  // setmaxnreg targets: the producer computes addresses and issues copies; a consumer holds
  // its head's O^T (128 registers), S^T and the softmax (checked in QsaStepTraits).
  static constexpr int kProducerRegisters = 24;
  static constexpr int kConsumerRegisters = 240;
  static constexpr int kPerEntry = 4;  // tokens (K/V slots) a union entry (a block) holds
  // K/V tiles of 32 KB: K_n and V_n of each head (a pipeline a head).
  static constexpr int kStagesPerHead = 2;
  static constexpr int kStages = kStagesPerHead * kHeadsPerCta;
  // A row's entries, and so any union of kRows rows: 2052 blocks.
  static constexpr int kRowEntries = kQsaGatherMaxEntries;
  static constexpr int kMaxUnion = kRows * kRowEntries;
  // A row's bitmap of blocks in the ring (16-bit elements): 8192 words.
  static constexpr int kBitmapWords = kStages * kBlockN * kHeadDim * 2 / 4 / kRows;
  // K/V capacities the bitmaps cover: 1,048,576 tokens.
  static constexpr int64_t kMaxContext = static_cast<int64_t>(kBitmapWords) * 32 * kPerEntry;
};

struct QsaStepParams {
  SparseAttentionParams p;     // validated; ids and the page table narrowed to int32
  uint8_t* handled = nullptr;  // [steps]: 1 where the kernel wrote the step's rows, 0 where it
                               // left them to the gather kernel (x.union_handled there)
  int64_t steps = 0;           // rows / rows_per_step: step s is rows s R .. s R + R - 1
  int rows_per_step = 0;       // R, 2 .. kRows
};

// The step kernel on every step of params.p (block hint): steps * Hkv / 2 CTAs. T is the query's
// and the K/V's 16-bit type.
template <typename T>
void launch_qsa_step(const QsaStepParams& params, cudaStream_t stream);

}  // namespace sparse_attn::cuda

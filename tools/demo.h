// `sparse-attn demo`: each method's pipeline on a structured workload (or users' tensors), with
// the metrics that say how much it keeps, what that costs in accuracy and what it saves.
#pragma once

#include <optional>
#include <string>
#include <utility>
#include <vector>

#include "common.h"
#include "plot.h"
#include "sparse_attn/io.h"
#include "sparse_attn/workload.h"

namespace sparse_attn::cli {

struct DemoOptions {
  std::string method = "all";  // qsa, xattn or all
  WorkloadOptions workload;    // structure knobs; geometry is set per method
  int64_t seq_len = 0;         // 0: 32k on a GPU, 8k on the CPU
  int64_t query_len = 0;       // query rows per request (the last tokens); 0: all
  int64_t rows = -1;           // query rows evaluated: -1 auto (all on a GPU, 64 on the CPU)
  std::string device = "auto", backend = "auto";
  int64_t topk = 512;         // QSA blocks per row
  double threshold = 0.9;     // XAttention
  int64_t stride = 8;         // XAttention
  int64_t xattn_blocks = -1;  // XAttention query blocks evaluated on the CPU: -1 auto
  std::string plot;           // PNG path, "" for none
  std::string save_workload;  // safetensors path for the generated tensors, "" for none
  std::string json;           // append one JSON object per method to this file, "" for none
  bool keep_sink = false;     // XAttention: always keep key block 0
  WorkloadFiles files;        // users' tensors instead of a generated workload
};

// What one method measured.
// The selections an oracle of the true attention makes on the evaluated rows, per row and head
// from the dense softmax mass of each key block: the yardstick of a method's own selection.
struct IdealSelection {
  double threshold = 0;  // the method's
  double density = 0;    // blocks by descending true mass until `threshold` of the mass is kept
  double recall = 0;     // the mass that selection keeps (>= threshold)
  double same_budget_recall = 0;  // the mass of the method's number of blocks, the heaviest
};

struct MethodResult {
  std::string method;
  std::string geometry;        // "24/2/256, indexer 4x128, 8k keys"
  std::string scope;           // which rows the times cover
  int64_t rows_evaluated = 0;  // rows the metrics cover
  int64_t rows_total = 0;
  double density = 0;    // selected / visible tokens
  double recall = 0;     // dense softmax mass on the selected tokens, mean over row-heads
  double rel_error = 0;  // ||out - dense|| / ||dense|| over the evaluated rows
  int64_t needle_hits = 0, needle_total = 0;
  std::vector<std::pair<std::string, double>> stages;  // seconds, with the backend in the name
  double dense_seconds = 0;
  std::string dense_label;
  std::vector<std::string> notes;
  std::optional<IdealSelection> ideal;  // the methods whose selection has a mass threshold
};

MethodResult run_qsa_demo(const DemoOptions& options, const Workload& host_workload,
                          const RunDevice& device, BackendPolicy& policy);
MethodResult run_xattn_demo(const DemoOptions& options, const Workload& host_workload,
                            const RunDevice& device, BackendPolicy& policy);

// Runs the demo and prints the table; returns the process exit code.
int run_demo(const DemoOptions& options);

}  // namespace sparse_attn::cli

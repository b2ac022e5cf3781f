// The verify and bench subcommands: their options, CLI11 registration and entry points.
#pragma once

#include <CLI/CLI.hpp>
#include <string>

#include "sparse_attn/workload.h"

namespace sparse_attn::cli {

struct VerifyOptions {
  std::string op = "all";  // qsa-indexer, qsa-attention, xattn-estimate, block-sparse, all
  int64_t seq_len = 4096, query_len = 256, batch = 1, topk = 512, stride = 8;
  double threshold = 0.9;
  std::string dtype = "bf16", mode = "structured";
  uint64_t seed = 0;
  std::string device = "auto", backend = "native";
  int64_t show = 5;  // worst elements printed per output
};
CLI::App* add_verify_command(CLI::App& app, VerifyOptions& options);
int run_verify(const VerifyOptions& options);

struct BenchOptions {
  std::string cases = "default";         // comma-separated names or prefixes; "list" lists them
  std::string json = "";                 // JSON lines output file
  int64_t warmup = 1, reps = 0;          // reps 0: 10 on a GPU, 1 on the CPU
  double peak_tflops = 0, peak_tbs = 0;  // 0: measure (bandwidth) / measure or spec (compute)
  std::string device = "auto", backend = "auto";
};
CLI::App* add_bench_command(CLI::App& app, BenchOptions& options);
int run_bench(const BenchOptions& options);

}  // namespace sparse_attn::cli

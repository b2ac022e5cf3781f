// sparse-attn: the demo, verify and bench subcommands (docs/cli.md).
#include <fmt/format.h>

#include <CLI/CLI.hpp>
#include <cstdio>
#include <map>

#include "commands.h"
#include "common.h"
#include "demo.h"
#include "sparse_attn/errors.h"

namespace sa = sparse_attn;
namespace cli = sparse_attn::cli;

namespace {

const std::map<std::string, sa::DType> kDTypes = {
    {"bf16", sa::DType::kBF16}, {"fp16", sa::DType::kF16}, {"fp32", sa::DType::kF32}};

void add_device_options(CLI::App* app, std::string& device, std::string& backend) {
  app->add_option("--device", device,
                  "auto (a GPU when one is usable, else the CPU), cpu, cuda or cuda:N")
      ->capture_default_str();
  app->add_option("--backend", backend,
                  "auto (native on a GPU, falling back per op to the reference where native "
                  "is unsupported, and saying so), native, or reference")
      ->check(CLI::IsMember({"auto", "native", "reference", "tilelang"}))
      ->capture_default_str();
}

// --rows: "auto", "all" or a count.
int64_t parse_rows(const std::string& s) {
  if (s == "auto") return -1;
  if (s == "all") return 0;
  const auto v = cli::parse_size(s);
  if (!v || *v == 0)
    throw CLI::ValidationError("--rows", "expected auto, all or a positive count, got '" + s + "'");
  return *v;
}

void add_workload_options(CLI::App* app, sa::WorkloadOptions& w, std::string& mode,
                          std::string& dtype) {
  auto* g = "Workload (generated)";
  app->add_option("--mode", mode, "structured (sinks, locality, needles) or random (i.i.d.)")
      ->check(CLI::IsMember({"structured", "random"}))
      ->capture_default_str()
      ->group(g);
  app->add_option("--seed", w.seed, "random seed")->capture_default_str()->group(g);
  app->add_option("--batch", w.batch, "requests")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--dtype", dtype, "bf16, fp16 or fp32")
      ->check(CLI::IsMember({"bf16", "fp16", "fp32"}))
      ->capture_default_str()
      ->group(g);
  app->add_option("--sinks", w.num_sinks, "attention-sink tokens at the start")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--sink-logit", w.sink_logit, "logit (nats) every query gives the sinks")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--heavy-fraction", w.heavy_fraction,
                  "share of the other keys that are heavy hitters (attended a little by every "
                  "query)")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str()
      ->group(g);
  app->add_option("--heavy-logit", w.heavy_logit, "logit every query gives the heavy hitters")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--needles", w.num_needles, "retrieval needles (far keys matched by later rows)")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--needle-logit", w.needle_logit, "logit of a needle for its query rows")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--needle-queries", w.needle_queries, "query rows that retrieve each needle")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--local-logit", w.local_logit,
                  "RoPE locality: logit of same-content tokens at distance 0")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--topic-logit", w.topic_logit, "logit of the query's segment at any distance")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--segment-len", w.segment_len, "mean length of a content segment")
      ->transform(cli::size_validator())
      ->default_str("512")
      ->group(g);
  app->add_option("--content-rank", w.content_rank, "rank of the content vectors")
      ->check(CLI::PositiveNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--noise", w.noise, "i.i.d. noise relative to the structure's RMS")
      ->check(CLI::NonNegativeNumber)
      ->capture_default_str()
      ->group(g);
  app->add_option("--rope-theta", w.rope_theta, "RoPE base")->capture_default_str()->group(g);
}

void add_file_options(CLI::App* app, sa::WorkloadFiles& f) {
  auto* g = "Your tensors (instead of a generated workload)";
  auto spec = "FILE.npy, FILE.safetensors or FILE.safetensors:NAME";
  app->add_option("--q", f.query, std::string("query [B, Lq, Hq, D] or [Lq, Hq, D]: ") + spec)
      ->group(g);
  app->add_option("--k", f.key, "key [B, Lk, Hkv, D] or [Lk, Hkv, D]")->group(g);
  app->add_option("--v", f.value, "value, shaped like the key")->group(g);
  app->add_option("--index-q", f.index_query, "QSA indexer query [B, Lq, Hi, Di]")->group(g);
  app->add_option("--index-k", f.index_key,
                  "QSA indexer keys: compressed [B, Lk/4, Di] or raw per token [B, Lk, Di]")
      ->group(g);
}

}  // namespace

int main(int argc, char** argv) {
  CLI::App app{
      "sparse-attn: QSA and XAttention sparse attention, shown, checked and timed.\n"
      "Sizes accept k and m suffixes (32k = 32768). Each subcommand has --help."};
  app.require_subcommand(1);
  app.set_version_flag("--version", "sparse-attn 0.1.0");

  // demo
  cli::DemoOptions demo;
  std::string demo_mode = "structured", demo_dtype = "bf16", demo_rows = "auto";
  auto* d = app.add_subcommand(
      "demo",
      "Run QSA and XAttention on a structured workload (or your tensors) and print, per method, "
      "density, attention-mass recall, output error vs dense attention, needle hit rate and the "
      "time of each stage");
  d->add_option("--method", demo.method, "qsa, xattn or all")
      ->check(CLI::IsMember({"qsa", "xattn", "all"}))
      ->capture_default_str();
  d->add_option("--seq-len", demo.seq_len,
                "keys per request (default: 32k with a GPU, 8k on "
                "the CPU)")
      ->transform(cli::size_validator());
  d->add_option("--q-len", demo.query_len,
                "query rows per request, the last tokens (a prefill chunk or decode against the "
                "earlier keys); 0: every token")
      ->transform(cli::size_validator())
      ->default_str("0");
  d->add_option("--rows", demo_rows,
                "query rows the metrics are evaluated on (dense attention runs on the host): "
                "auto (64 evenly spaced plus each needle's row), all, or a count. On a GPU the "
                "pipeline runs every row; on the CPU only these")
      ->capture_default_str();
  d->add_option("--topk", demo.topk, "QSA: blocks of 4 tokens kept per query row")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  d->add_option("--threshold", demo.threshold, "XAttention: attention mass the kept blocks cover")
      ->check(CLI::Range(0.0, 1.0))
      ->capture_default_str();
  d->add_option("--stride", demo.stride, "XAttention: antidiagonal stride")
      ->check(CLI::PositiveNumber)
      ->capture_default_str();
  d->add_option("--plot", demo.plot,
                "write a heatmap PNG of the selection (FILE-qsa.png and FILE-xattn.png with "
                "--method all)");
  d->add_option("--json", demo.json, "append one JSON object of metrics and times per method");
  d->add_flag("--keep-sink", demo.keep_sink,
              "XAttention: always keep key block 0 (upstream's "
              "keep_sink; off by default there too)");
  d->add_option("--save-workload", demo.save_workload,
                "save the generated tensors as safetensors (q, k, v, index_q, index_k; "
                "FILE-qsa/-xattn with --method all) to rerun them with --q/--k/--v");
  add_workload_options(d, demo.workload, demo_mode, demo_dtype);
  add_file_options(d, demo.files);
  add_device_options(d, demo.device, demo.backend);

  // verify, bench
  cli::VerifyOptions verify;
  auto* v = cli::add_verify_command(app, verify);
  cli::BenchOptions bench;
  auto* b = cli::add_bench_command(app, bench);
  add_device_options(b, bench.device, bench.backend);

  try {
    app.parse(argc, argv);
  } catch (const CLI::ParseError& e) {
    // --help and --version exit 0; every wrong flag or value exits 2, as other errors do.
    return app.exit(e) == 0 ? 0 : 2;
  }

  try {
    if (d->parsed()) {
      demo.rows = parse_rows(demo_rows);
      demo.workload.mode = sa::parse_workload_mode(demo_mode);
      demo.workload.dtype = kDTypes.at(demo_dtype);
      const auto& f = demo.files;
      const bool any = !(f.query.empty() && f.key.empty() && f.value.empty() &&
                         f.index_query.empty() && f.index_key.empty());
      if (any && (f.query.empty() || f.key.empty() || f.value.empty()))
        throw sa::ValueError("--q, --k and --v: give all three to run on your tensors");
      return cli::run_demo(demo);
    }
    if (v->parsed()) return cli::run_verify(verify);
    if (b->parsed()) return cli::run_bench(bench);
  } catch (const CLI::ValidationError& e) {
    std::fprintf(stderr, "sparse-attn: error: %s\n", e.what());
    return 2;
  } catch (const sa::Error& e) {
    std::fprintf(stderr, "\nsparse-attn: error: %s\n", e.what());
    return 2;
  } catch (const std::bad_alloc&) {
    std::fprintf(stderr,
                 "\nsparse-attn: error: out of memory; try a smaller --seq-len or "
                 "--batch\n");
    return 2;
  }
  return 0;
}

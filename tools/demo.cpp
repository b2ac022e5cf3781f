#include "demo.h"

#include <fmt/format.h>

#include <cstdio>
#include <fstream>
#include <nlohmann/json.hpp>

#include "sparse_attn/errors.h"

namespace sparse_attn::cli {
namespace {

// The canonical geometries: QSA's model (24/2/256, indexer 4x128) and an XAttention-style
// GQA model (32/8/128, no indexer).
WorkloadOptions geometry(const DemoOptions& opt, const std::string& method, Device dev) {
  WorkloadOptions o = opt.workload;
  o.seq_len = opt.seq_len > 0 ? opt.seq_len : (dev.is_cuda() ? 32768 : 8192);
  if (opt.query_len > o.seq_len)
    throw ValueError(
        fmt::format("--q-len: expected at most --seq-len ({}), got {}", o.seq_len, opt.query_len));
  o.query_len = opt.query_len;
  o.device = Device::cpu();  // generated on the host; each pipeline copies what it needs
  if (method == "qsa") {
    o.num_q_heads = 24, o.num_kv_heads = 2, o.head_dim = 256;
    o.indexer_heads = 4, o.indexer_dim = 128;
  } else {
    o.num_q_heads = 32, o.num_kv_heads = 8, o.head_dim = 128;
    o.indexer_heads = 0;
  }
  return o;
}

void print_result(const MethodResult& r) {
  std::printf("\n%s  (%s)\n", r.method.c_str(), r.geometry.c_str());
  std::printf("  metrics on %s\n",
              r.rows_evaluated == r.rows_total
                  ? fmt::format("all {} query rows", r.rows_total).c_str()
                  : fmt::format("{} of {} query rows (sampled; --rows all evaluates every row)",
                                r.rows_evaluated, r.rows_total)
                        .c_str());
  std::printf("    %-34s %9.2f %%\n", "density (selected / visible)", 100 * r.density);
  std::printf("    %-34s %9.2f %%\n", "attention-mass recall", 100 * r.recall);
  std::printf("    %-34s %9.2e\n", "output relative error vs dense", r.rel_error);
  if (r.needle_total > 0)
    std::printf("    %-34s %9.2f %%  (%lld / %lld)\n", "needle hit rate",
                100.0 * double(r.needle_hits) / double(r.needle_total),
                static_cast<long long>(r.needle_hits), static_cast<long long>(r.needle_total));
  else
    std::printf("    %-34s %9s\n", "needle hit rate", "n/a (no needles)");
  if (r.ideal) {
    const IdealSelection& i = *r.ideal;
    std::printf("  ideal selection of the same rows, from their true block masses\n");
    std::printf("    %-34s %9.2f %%  (recall %.2f %%: blocks by true mass up to %g of it)\n",
                "density at the same threshold", 100 * i.density, 100 * i.recall, i.threshold);
    std::printf("    %-34s %9.2f %%  (the heaviest blocks, as many as selected above)\n",
                "recall at the same budget", 100 * i.same_budget_recall);
  }
  std::printf("  times (%s)\n", r.scope.c_str());
  double total = 0;
  for (const auto& [name, s] : r.stages) {
    std::printf("    %-44s %12s\n", name.c_str(), format_seconds(s).c_str());
    total += s;
  }
  std::printf("    %-44s %12s\n", "total", format_seconds(total).c_str());
  std::printf("    %-44s %12s\n", r.dense_label.c_str(), format_seconds(r.dense_seconds).c_str());
  for (const auto& n : r.notes) std::printf("  note: %s\n", n.c_str());
}

}  // namespace

int run_demo(const DemoOptions& opt) {
  if (opt.method != "qsa" && opt.method != "xattn" && opt.method != "all")
    throw ValueError(fmt::format("--method: expected qsa, xattn or all, got '{}'", opt.method));
  const RunDevice rd = choose_device(opt.device);
  BackendPolicy policy(opt.backend, rd.device);
  const bool from_files = !opt.files.query.empty();
  std::vector<std::string> methods;
  if (opt.method == "all")
    methods = {"qsa", "xattn"};
  else
    methods = {opt.method};
  if (from_files && opt.method == "all")
    methods = opt.files.index_query.empty() ? std::vector<std::string>{"xattn"}
                                            : std::vector<std::string>{"qsa", "xattn"};

  std::printf("sparse-attn demo on %s, backend %s\n", rd.why.c_str(), opt.backend.c_str());
  for (const auto& m : methods) {
    Workload w;
    Stopwatch sw;
    if (from_files) {
      w = load_workload(opt.files, Device::cpu());
      std::printf("\n[%s] tensors from %s: batch %lld, %lld query rows, %lld keys\n", m.c_str(),
                  opt.files.query.c_str(), static_cast<long long>(w.options.batch),
                  static_cast<long long>(w.options.query_len),
                  static_cast<long long>(w.options.seq_len));
    } else {
      w = make_workload(geometry(opt, m, rd.device));
      const auto& o = w.options;
      std::printf(
          "\n[%s] %s workload, seed %llu: batch %lld, %s keys, %s query rows, %s, "
          "%lld sinks, %lld needles (generated in %s)\n",
          m.c_str(), workload_mode_name(o.mode), static_cast<unsigned long long>(o.seed),
          static_cast<long long>(o.batch), format_size(o.seq_len).c_str(),
          format_size(o.query_len).c_str(), dtype_name(o.dtype),
          static_cast<long long>(o.mode == WorkloadMode::kStructured ? o.num_sinks : 0),
          static_cast<long long>(w.needles.size()), format_seconds(sw.seconds()).c_str());
    }
    DemoOptions mo = opt;
    if (!opt.plot.empty() && methods.size() > 1) mo.plot = plot_path_for(opt.plot, m);
    if (!opt.save_workload.empty() && !from_files) {
      const std::string path =
          methods.size() > 1 ? plot_path_for(opt.save_workload, m) : opt.save_workload;
      std::vector<std::pair<std::string, TensorView>> tensors = {
          {"q", w.query}, {"k", w.key}, {"v", w.value}};
      if (w.options.indexer_heads > 0) {
        tensors.push_back({"index_q", w.index_query});
        tensors.push_back({"index_k", w.index_key});
      }
      save_safetensors(path, tensors);
      std::printf("saved the workload's tensors to %s (%s:q, :k, :v%s)\n", path.c_str(),
                  path.c_str(), w.options.indexer_heads > 0 ? ", :index_q, :index_k" : "");
    }
    const MethodResult r =
        m == "qsa" ? run_qsa_demo(mo, w, rd, policy) : run_xattn_demo(mo, w, rd, policy);
    print_result(r);
    if (!opt.json.empty()) {
      std::ofstream out(opt.json, std::ios::app);
      if (!out) throw ValueError(fmt::format("--json {}: cannot open for appending", opt.json));
      nlohmann::json stages = nlohmann::json::object();
      for (const auto& [name, sec] : r.stages) stages[name] = sec;
      nlohmann::json j = {{"method", r.method},
                          {"geometry", r.geometry},
                          {"device", rd.device.str()},
                          {"seq_len", w.options.seq_len},
                          {"query_len", w.options.query_len},
                          {"batch", w.options.batch},
                          {"rows_evaluated", r.rows_evaluated},
                          {"rows_total", r.rows_total},
                          {"density", r.density},
                          {"recall", r.recall},
                          {"rel_error", r.rel_error},
                          {"needle_hits", r.needle_hits},
                          {"needle_total", r.needle_total},
                          {"stages_s", stages},
                          {"times_cover", r.scope},
                          {"dense_s", r.dense_seconds},
                          {"notes", r.notes}};
      if (r.ideal) {
        j["ideal"] = {{"threshold", r.ideal->threshold},
                      {"density", r.ideal->density},
                      {"recall", r.ideal->recall},
                      {"same_budget_recall", r.ideal->same_budget_recall}};
      }
      out << j.dump() << '\n';
    }
  }
  for (const auto& n : policy.notes()) std::printf("note: %s\n", n.c_str());
  return 0;
}

}  // namespace sparse_attn::cli

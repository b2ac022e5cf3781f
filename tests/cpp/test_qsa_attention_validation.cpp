// qsa_sparse_attention validation: one case per rule, each starting from a valid call and
// breaking one thing; the error kind must match and the message must name the argument.
// Native-only rules run on views labelled cuda:0 over host memory: validation reads no
// contents, and each of these calls fails before any kernel could run.
#include <gtest/gtest.h>

#include <functional>
#include <string>
#include <vector>

#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::make_rng;

// A valid call: padded query [2, 3, 4, 256], paged K/V [6, 4, 2, 256] with block_table [2, 3],
// token_indices [2, 3, 11] with block_indices [2, 3, 2], element-wise gate, LSE.
struct Call {
  static constexpr int64_t B = 2, Q = 3, Hq = 4, Hkv = 2, D = 256, W = 11, NB = 2;

  Call() {
    auto rng = make_rng();
    q = keep(testing::random_tensor({B, Q, Hq, D}, DType::kBF16, rng));
    k = keep(testing::random_tensor({6, 4, Hkv, D}, DType::kBF16, rng));
    v = keep(testing::random_tensor({6, 4, Hkv, D}, DType::kBF16, rng));
    token = keep(testing::random_int32({B, Q, W}, rng, -1, 11));
    o.block_indices = keep(testing::random_int32({B, Q, NB}, rng, -1, 2));
    o.block_table = keep(testing::int32_tensor({B, 3}, {0, 1, 2, 3, 4, 5}));
    o.gate = keep(testing::random_tensor({B, Q, Hq, D}, DType::kBF16, rng));
    out = keep(Tensor::empty({B, Q, Hq, D}, DType::kBF16));
    lse = keep(Tensor::empty({B, Q, Hq}, DType::kF32));
    o.backend = Backend::kReference;
  }

  TensorView keep(const Tensor& t) {
    storage.push_back(t);
    return t.view();
  }
  TensorView make(const Shape& shape, DType dtype) { return keep(Tensor::empty(shape, dtype)); }
  TensorView make_i32(const Shape& shape) {
    TensorView t = make(shape, DType::kI32);
    for (int64_t i = 0; i < t.numel(); ++i) t.data_as<int32_t>()[i] = 0;
    return t;
  }

  // Switches to the physical form: flattened query [6, 4, 256], K/V [20, 2, 256], ids [6, 5].
  void physical() {
    auto rng = make_rng();
    q = keep(testing::random_tensor({6, Hq, D}, DType::kBF16, rng));
    k = keep(testing::random_tensor({20, Hkv, D}, DType::kBF16, rng));
    v = keep(testing::random_tensor({20, Hkv, D}, DType::kBF16, rng));
    out = make({6, Hq, D}, DType::kBF16);
    lse = make({6, Hq}, DType::kF32);
    token.reset();
    o = {};
    o.backend = Backend::kReference;
    o.selected_kv_indices = keep(testing::random_int32({6, 5}, rng, -1, 25));
  }

  // The same views labelled cuda:0, with backend native.
  void native() {
    const auto relabel = [](TensorView& t) {
      t = TensorView(t.data(), t.dtype(), Device::cuda(0), t.shape(),
                     Shape(t.strides(), t.strides() + t.dim()));
    };
    const auto relabel_opt = [&](std::optional<TensorView>& t) {
      if (t) relabel(*t);
    };
    for (TensorView* t : {&q, &k, &v, &out}) relabel(*t);
    for (std::optional<TensorView>* t :
         {&token, &lse, &o.block_indices, &o.gate, &o.block_table, &o.cu_seqlens_q, &o.token_to_req,
          &o.cu_seqlens_k, &o.seq_lens_q, &o.seq_lens_k, &o.query_positions,
          &o.selected_kv_indices}) {
      relabel_opt(*t);
    }
    o.backend = Backend::kNative;
  }

  void invoke() const { qsa_sparse_attention(q, k, v, token, out, lse, o); }

  std::vector<Tensor> storage;
  TensorView q, k, v, out;
  std::optional<TensorView> token, lse;
  SparseAttentionOptions o;
};

enum class Kind { kValue, kType, kNotSupported };

struct Rule {
  std::string name;
  std::function<void(Call&)> mutate;
  Kind kind;
  std::string arg;  // must appear in the message
};

void PrintTo(const Rule& r, std::ostream* os) { *os << r.name; }

TensorView on_cuda(const TensorView& t) {
  return TensorView(t.data(), t.dtype(), Device::cuda(0), t.shape(),
                    Shape(t.strides(), t.strides() + t.dim()));
}

std::vector<Rule> rules() {
  using K = Kind;
  std::vector<Rule> r;
  const auto add = [&](std::string name, std::function<void(Call&)> f, K kind, std::string arg) {
    r.push_back({std::move(name), std::move(f), kind, std::move(arg)});
  };
  // ----- query --------------------------------------------------------------------------
  add(
      "query_rank",
      [](Call& c) {
        c.q = c.make({24, 256}, DType::kBF16);
      },
      K::kValue, "query");
  add(
      "query_dtype",
      [](Call& c) {
        c.q = c.make({2, 3, 4, 256}, DType::kF32);
      },
      K::kType, "query");
  add(
      "query_null_data",
      [](Call& c) { c.q = TensorView(nullptr, DType::kBF16, Device::cpu(), c.q.shape()); },
      K::kValue, "query");
  add(
      "query_batch_axes_not_a_row_view",
      [](Call& c) {
        c.q = c.make({2, 5, 4, 256}, DType::kBF16).narrow(1, 0, 3);
      },
      K::kValue, "query");
  add(
      "query_batch_differs_from_kv",
      [](Call& c) {
        c.q = c.make({3, 3, 4, 256}, DType::kBF16);
        c.out = c.make({3, 3, 4, 256}, DType::kBF16);
      },
      K::kValue, "query");
  // ----- key / value --------------------------------------------------------------------
  add(
      "key_dtype_differs_from_query",
      [](Call& c) {
        c.k = c.make({6, 4, 2, 256}, DType::kF16);
      },
      K::kType, "key");
  add(
      "value_dtype_differs_from_key",
      [](Call& c) {
        c.v = c.make({6, 4, 2, 256}, DType::kF16);
      },
      K::kType, "value");
  add(
      "value_shape_differs_from_key",
      [](Call& c) {
        c.v = c.make({6, 4, 1, 256}, DType::kBF16);
      },
      K::kValue, "value");
  add(
      "key_device_differs", [](Call& c) { c.k = on_cuda(c.k); }, K::kValue, "key");
  add(
      "value_device_differs", [](Call& c) { c.v = on_cuda(c.v); }, K::kValue, "value");
  add(
      "key_head_dim_differs",
      [](Call& c) {
        c.k = c.make({6, 4, 2, 128}, DType::kBF16);
        c.v = c.make({6, 4, 2, 128}, DType::kBF16);
      },
      K::kValue, "key");
  add(
      "gqa_heads_not_divisible",
      [](Call& c) {
        c.k = c.make({6, 4, 3, 256}, DType::kBF16);
        c.v = c.make({6, 4, 3, 256}, DType::kBF16);
      },
      K::kValue, "key");
  add(
      "key_rank",
      [](Call& c) {
        c.k = c.make({6, 4, 2, 2, 256}, DType::kBF16);
      },
      K::kValue, "key");
  // ----- K/V layout metadata ------------------------------------------------------------
  add(
      "block_table_dtype",
      [](Call& c) {
        c.o.block_table = c.make({2, 3}, DType::kF32);
      },
      K::kType, "block_table");
  add(
      "block_table_rank", [](Call& c) { c.o.block_table = c.make_i32({6}); }, K::kValue,
      "block_table");
  add(
      "block_table_with_flattened_key",
      [](Call& c) {
        c.k = c.make({24, 2, 256}, DType::kBF16);
        c.v = c.make({24, 2, 256}, DType::kBF16);
      },
      K::kValue, "key");
  add(
      "page_size_differs_from_key", [](Call& c) { c.o.page_size = 8; }, K::kValue, "page_size");
  add(
      "page_size_without_block_table",
      [](Call& c) {
        c.o.block_table.reset();
        c.o.page_size = 4;
      },
      K::kValue, "page_size");
  add(
      "cu_seqlens_k_with_block_table", [](Call& c) { c.o.cu_seqlens_k = c.make_i32({3}); },
      K::kValue, "cu_seqlens_k");
  add(
      "cu_seqlens_k_with_padded_kv",
      [](Call& c) {
        c.o.block_table.reset();
        c.k = c.make({2, 12, 2, 256}, DType::kBF16);
        c.v = c.make({2, 12, 2, 256}, DType::kBF16);
        c.o.cu_seqlens_k = c.make_i32({3});
      },
      K::kValue, "cu_seqlens_k");
  add(
      "flattened_kv_without_cu_seqlens_k",
      [](Call& c) {
        c.o.block_table.reset();
        c.k = c.make({24, 2, 256}, DType::kBF16);
        c.v = c.make({24, 2, 256}, DType::kBF16);
      },
      K::kValue, "cu_seqlens_k");
  add(
      "cu_seqlens_k_dtype",
      [](Call& c) {
        c.o.block_table.reset();
        c.k = c.make({24, 2, 256}, DType::kBF16);
        c.v = c.make({24, 2, 256}, DType::kBF16);
        c.o.cu_seqlens_k = c.make({3}, DType::kF32);
      },
      K::kType, "cu_seqlens_k");
  add(
      "seq_lens_k_shape", [](Call& c) { c.o.seq_lens_k = c.make_i32({3}); }, K::kValue,
      "seq_lens_k");
  add(
      "seq_lens_k_dtype", [](Call& c) { c.o.seq_lens_k = c.make({2}, DType::kF32); }, K::kType,
      "seq_lens_k");
  // ----- query rows -> requests ---------------------------------------------------------
  add(
      "cu_seqlens_q_with_padded_query", [](Call& c) { c.o.cu_seqlens_q = c.make_i32({3}); },
      K::kValue, "cu_seqlens_q");
  add(
      "token_to_req_with_padded_query", [](Call& c) { c.o.token_to_req = c.make_i32({6}); },
      K::kValue, "token_to_req");
  // The flattened variants start from the same call with [6, 4, 256] rows.
  const auto flat = [](Call& c) {
    c.q = c.make({6, 4, 256}, DType::kBF16);
    c.out = c.make({6, 4, 256}, DType::kBF16);
    c.lse = c.make({6, 4}, DType::kF32);
    c.token = c.make_i32({6, 11});
    c.o.block_indices = c.make_i32({6, 2});
    c.o.gate.reset();
  };
  add(
      "cu_seqlens_q_dtype",
      [flat](Call& c) {
        flat(c);
        c.o.cu_seqlens_q = c.make({3}, DType::kF32);
      },
      K::kType, "cu_seqlens_q");
  add(
      "cu_seqlens_q_shape",
      [flat](Call& c) {
        flat(c);
        c.o.cu_seqlens_q = c.make_i32({4});
      },
      K::kValue, "cu_seqlens_q");
  add(
      "cu_seqlens_q_and_token_to_req",
      [flat](Call& c) {
        flat(c);
        c.o.cu_seqlens_q = c.make_i32({3});
        c.o.token_to_req = c.make_i32({6});
      },
      K::kValue, "token_to_req");
  add(
      "token_to_req_shape",
      [flat](Call& c) {
        flat(c);
        c.o.token_to_req = c.make_i32({5});
      },
      K::kValue, "token_to_req");
  add(
      "token_to_req_dtype",
      [flat](Call& c) {
        flat(c);
        c.o.token_to_req = c.make({6}, DType::kF32);
      },
      K::kType, "token_to_req");
  // The position rule (docs/qsa.md, "Metadata"): token_to_req rows are never counted.
  add(
      "token_to_req_without_query_positions",
      [flat](Call& c) {
        flat(c);
        c.o.token_to_req = c.make_i32({6});
      },
      K::kValue, "query_positions");
  add(
      "token_to_req_with_seq_lens_q",
      [flat](Call& c) {
        flat(c);
        c.o.token_to_req = c.make_i32({6});
        c.o.query_positions = c.make_i32({6});
        c.o.seq_lens_q = c.make_i32({2});
      },
      K::kValue, "seq_lens_q");
  add(
      "num_requests_differs_from_kv",
      [flat](Call& c) {
        flat(c);
        c.o.token_to_req = c.make_i32({6});
        c.o.num_requests = 3;
      },
      K::kValue, "num_requests");
  add(
      "num_requests_without_token_to_req",
      [flat](Call& c) {
        flat(c);
        c.o.cu_seqlens_q = c.make_i32({3});
        c.o.num_requests = 2;
      },
      K::kValue, "num_requests");
  add("flattened_query_without_row_mapping", flat, K::kValue, "cu_seqlens_q");
  add(
      "seq_lens_q_shape",
      [](Call& c) {
        c.o.seq_lens_q = c.make_i32({2, 1});
      },
      K::kValue, "seq_lens_q");
  add(
      "seq_lens_q_dtype", [](Call& c) { c.o.seq_lens_q = c.make({2}, DType::kF32); }, K::kType,
      "seq_lens_q");
  add(
      "query_positions_shape", [](Call& c) { c.o.query_positions = c.make_i32({6}); }, K::kValue,
      "query_positions");
  add(
      "query_positions_dtype",
      [](Call& c) {
        c.o.query_positions = c.make({2, 3}, DType::kF32);
      },
      K::kType, "query_positions");
  // ----- token_indices and the block hint -----------------------------------------------
  add(
      "token_indices_missing", [](Call& c) { c.token.reset(); }, K::kValue, "token_indices");
  add(
      "token_indices_dtype",
      [](Call& c) {
        c.token = c.make({2, 3, 11}, DType::kF32);
      },
      K::kType, "token_indices");
  add(
      "token_indices_rank",
      [](Call& c) {
        c.token = c.make_i32({6, 11});
      },
      K::kValue, "token_indices");
  add(
      "token_indices_rows",
      [](Call& c) {
        c.token = c.make_i32({2, 4, 11});
      },
      K::kValue, "token_indices");
  add(
      "token_indices_not_a_row_view",
      [](Call& c) {
        c.token = c.make_i32({2, 4, 11}).narrow(1, 0, 3);
      },
      K::kValue, "token_indices");
  add(
      "token_indices_device", [](Call& c) { c.token = on_cuda(*c.token); }, K::kValue,
      "token_indices");
  add(
      "block_indices_width_rule",
      [](Call& c) {
        c.o.block_indices = c.make_i32({2, 3, 3});
      },
      K::kValue, "block_indices");
  add(
      "block_indices_more_than_512_blocks",
      [](Call& c) {
        c.token = c.make_i32({2, 3, 4 * 513 + 3});
        c.o.block_indices = c.make_i32({2, 3, 513});
      },
      K::kValue, "block_indices");
  add(
      "block_indices_zero_blocks",
      [](Call& c) {
        c.token = c.make_i32({2, 3, 3});
        c.o.block_indices = c.make_i32({2, 3, 0});
      },
      K::kValue, "block_indices");
  add(
      "block_indices_rows",
      [](Call& c) {
        c.o.block_indices = c.make_i32({2, 2, 2});
      },
      K::kValue, "block_indices");
  add(
      "block_indices_dtype",
      [](Call& c) {
        c.o.block_indices = c.make({2, 3, 2}, DType::kF32);
      },
      K::kType, "block_indices");
  // ----- scalars ------------------------------------------------------------------------
  add(
      "scale_and_softmax_scale",
      [](Call& c) {
        c.o.scale = 0.1;
        c.o.softmax_scale = 0.1;
      },
      K::kValue, "softmax_scale");
  add(
      "scale_not_positive", [](Call& c) { c.o.scale = 0.0; }, K::kValue, "scale");
  add(
      "softmax_scale_nan", [](Call& c) { c.o.softmax_scale = std::nan(""); }, K::kValue,
      "softmax_scale");
  add(
      "scale_underflows_float32", [](Call& c) { c.o.scale = 1e-60; }, K::kValue, "scale");
  add(
      "scale_overflows_float32", [](Call& c) { c.o.scale = 1e39; }, K::kValue,
      "scale: expected a value representable as a positive finite float32");
  // Finite in float32, but the exp2-based softmax's scale * log2(e) is not.
  add(
      "scale_log2_overflows_float32", [](Call& c) { c.o.scale = 3e38; }, K::kValue,
      "scale: expected scale * log2(e) to be");
  add(
      "num_splits_beyond_int32", [](Call& c) { c.o.num_splits = int64_t{1} << 40; }, K::kValue,
      "num_splits");
  add(
      "k_scale_not_one", [](Call& c) { c.o.k_scale = 0.5; }, K::kValue, "k_scale");
  add(
      "v_scale_not_one", [](Call& c) { c.o.v_scale = 2.0; }, K::kValue, "v_scale");
  add(
      "compute_dtype_float32", [](Call& c) { c.o.compute_dtype = DType::kF32; }, K::kValue,
      "compute_dtype");
  add(
      "num_splits_zero", [](Call& c) { c.o.num_splits = 0; }, K::kValue, "num_splits");
  // ----- gate ---------------------------------------------------------------------------
  add(
      "gate_dtype",
      [](Call& c) {
        c.o.gate = c.make({2, 3, 4, 256}, DType::kF16);
      },
      K::kType, "gate");
  add(
      "gate_shape",
      [](Call& c) {
        c.o.gate = c.make({2, 3, 4, 1}, DType::kBF16);
      },
      K::kValue, "gate");
  add(
      "gate_not_a_row_view",
      [](Call& c) {
        c.o.gate = c.make({2, 4, 4}, DType::kBF16).narrow(1, 0, 3);
      },
      K::kValue, "gate");
  // ----- out / lse ----------------------------------------------------------------------
  add(
      "out_shape",
      [](Call& c) {
        c.out = c.make({2, 3, 4, 128}, DType::kBF16);
      },
      K::kValue, "out");
  add(
      "out_dtype",
      [](Call& c) {
        c.out = c.make({2, 3, 4, 256}, DType::kF32);
      },
      K::kType, "out");
  add(
      "out_device", [](Call& c) { c.out = on_cuda(c.out); }, K::kValue, "out");
  add(
      "out_broadcast_stride",
      [](Call& c) {
        c.out = c.make({2, 3, 1, 256}, DType::kBF16).as_strided({2, 3, 4, 256}, {768, 256, 0, 1});
      },
      K::kValue, "out");
  add(
      "out_overlapping_itself",
      [](Call& c) {
        c.out =
            c.make({2, 3, 4, 256}, DType::kBF16).as_strided({2, 3, 4, 256}, {3072, 1024, 128, 1});
      },
      K::kValue, "out");
  add(
      "out_not_a_row_view",
      [](Call& c) {
        c.out = c.make({2, 4, 4, 256}, DType::kBF16).narrow(1, 0, 3);
      },
      K::kValue, "out");
  add(
      "out_overlaps_query", [](Call& c) { c.out = c.q; }, K::kValue, "query");
  add(
      "out_overlaps_value",
      [](Call& c) {
        c.out = c.v.as_strided({2, 3, 4, 256}, {3072, 1024, 256, 1});
      },
      K::kValue, "value");
  add(
      "out_overlaps_gate", [](Call& c) { c.out = *c.o.gate; }, K::kValue, "gate");
  add(
      "out_overlaps_token_indices",
      [](Call& c) {
        TensorView big = c.make({2, 3, 4, 256}, DType::kBF16);
        c.out = big;
        c.token = TensorView(big.data(), DType::kI32, Device::cpu(), {2, 3, 11});
      },
      K::kValue, "token_indices");
  add(
      "lse_dtype",
      [](Call& c) {
        c.lse = c.make({2, 3, 4}, DType::kBF16);
      },
      K::kType, "lse");
  add(
      "lse_shape",
      [](Call& c) {
        c.lse = c.make({2, 3, 4, 1}, DType::kF32);
      },
      K::kValue, "lse");
  add(
      "lse_overlaps_out",
      [](Call& c) {
        c.lse = TensorView(c.out.data(), DType::kF32, Device::cpu(), {2, 3, 4});
      },
      K::kValue, "lse");
  add(
      "lse_overlaps_key",
      [](Call& c) {
        c.lse = TensorView(c.k.data(), DType::kF32, Device::cpu(), {2, 3, 4});
      },
      K::kValue, "key");
  // ----- physical mode ------------------------------------------------------------------
  add(
      "selected_kv_indices_with_token_indices",
      [](Call& c) {
        c.o.selected_kv_indices = c.make_i32({2, 3, 11});
      },
      K::kValue, "selected_kv_indices");
  add(
      "selected_kv_indices_dtype",
      [](Call& c) {
        c.physical();
        c.o.selected_kv_indices = c.make({6, 5}, DType::kF32);
      },
      K::kType, "selected_kv_indices");
  add(
      "selected_kv_indices_rows",
      [](Call& c) {
        c.physical();
        c.o.selected_kv_indices = c.make_i32({5, 5});
      },
      K::kValue, "selected_kv_indices");
  add(
      "selected_kv_indices_fp16",
      [](Call& c) {
        c.physical();
        c.q = c.make({6, 4, 256}, DType::kF16);
        c.k = c.make({20, 2, 256}, DType::kF16);
        c.v = c.make({20, 2, 256}, DType::kF16);
        c.out = c.make({6, 4, 256}, DType::kF16);
      },
      K::kType, "query");
  add(
      "selected_kv_indices_padded_query",
      [](Call& c) {
        c.physical();
        c.q = c.make({2, 3, 4, 256}, DType::kBF16);
      },
      K::kValue, "query");
  add(
      "selected_kv_indices_paged_key",
      [](Call& c) {
        c.physical();
        c.k = c.make({5, 4, 2, 256}, DType::kBF16);
        c.v = c.make({5, 4, 2, 256}, DType::kBF16);
      },
      K::kValue, "key");
  for (const char* arg : {"gate", "cu_seqlens_q", "token_to_req", "cu_seqlens_k", "block_table",
                          "seq_lens_q", "seq_lens_k", "query_positions", "block_indices"}) {
    add(
        std::string("selected_kv_indices_with_") + arg,
        [arg](Call& c) {
          c.physical();
          const std::string a = arg;
          if (a == "gate") c.o.gate = c.make({6, 4}, DType::kBF16);
          if (a == "cu_seqlens_q") c.o.cu_seqlens_q = c.make_i32({2});
          if (a == "token_to_req") c.o.token_to_req = c.make_i32({6});
          if (a == "cu_seqlens_k") c.o.cu_seqlens_k = c.make_i32({2});
          if (a == "block_table") c.o.block_table = c.make_i32({1, 1});
          if (a == "seq_lens_q") c.o.seq_lens_q = c.make_i32({1});
          if (a == "seq_lens_k") c.o.seq_lens_k = c.make_i32({1});
          if (a == "query_positions") c.o.query_positions = c.make_i32({6});
          if (a == "block_indices") c.o.block_indices = c.make_i32({6, 1});
        },
        K::kValue, arg);
  }
  add(
      "selected_kv_indices_with_num_requests",
      [](Call& c) {
        c.physical();
        c.o.num_requests = 1;
      },
      K::kValue, "num_requests");
  add(
      "selected_kv_indices_with_page_size",
      [](Call& c) {
        c.physical();
        c.o.page_size = 4;
      },
      K::kValue, "page_size");
  // ----- workspace (checked for every backend; its size only on the native path) ---------
  add(
      "workspace_dtype", [](Call& c) { c.o.workspace = c.make({64}, DType::kF32); }, K::kType,
      "workspace");
  add(
      "workspace_rank",
      [](Call& c) {
        c.o.workspace = c.make({4, 16}, DType::kU8);
      },
      K::kValue, "workspace");
  add(
      "workspace_device", [](Call& c) { c.o.workspace = on_cuda(c.make({64}, DType::kU8)); },
      K::kValue, "workspace");
  add(
      "workspace_not_contiguous",
      [](Call& c) { c.o.workspace = c.make({128}, DType::kU8).as_strided({64}, {2}); }, K::kValue,
      "workspace");
  add(
      "workspace_not_16_byte_aligned",
      [](Call& c) { c.o.workspace = c.make({128}, DType::kU8).narrow(0, 8, 64); }, K::kValue,
      "workspace");
  add(
      "workspace_null_data",
      [](Call& c) { c.o.workspace = TensorView(nullptr, DType::kU8, Device::cpu(), {64}); },
      K::kValue, "workspace");
  add(
      "workspace_overlaps_out",
      [](Call& c) { c.o.workspace = TensorView(c.out.data(), DType::kU8, Device::cpu(), {64}); },
      K::kValue, "workspace");
  add(
      "workspace_overlaps_an_input",
      [](Call& c) {
        c.o.workspace = TensorView(c.o.block_table->data(), DType::kU8, Device::cpu(), {16});
      },
      K::kValue, "workspace");
  add(
      "workspace_and_workspace_allocator",
      [](Call& c) {
        c.o.workspace = c.make({64}, DType::kU8);
        c.o.workspace_allocator = [&c](size_t bytes) {
          return c.make({static_cast<int64_t>(bytes)}, DType::kU8);
        };
      },
      K::kValue, "workspace_allocator");
  add(
      "native_workspace_dtype",
      [](Call& c) {
        c.native();
        c.o.workspace = on_cuda(c.make({64}, DType::kI32));
      },
      K::kType, "workspace");
  add(
      "native_workspace_on_the_host",
      [](Call& c) {
        c.native();
        c.o.workspace = c.make({64}, DType::kU8);
      },
      K::kValue, "workspace");
  // ----- native only --------------------------------------------------------------------
  add(
      "native_head_dim_256",
      [](Call& c) {
        c.q = c.make({2, 3, 4, 128}, DType::kBF16);
        c.k = c.make({6, 4, 2, 128}, DType::kBF16);
        c.v = c.make({6, 4, 2, 128}, DType::kBF16);
        c.out = c.make({2, 3, 4, 128}, DType::kBF16);
        c.o.gate.reset();
        c.native();
      },
      K::kNotSupported, "query");
  add(
      "native_group_at_most_16",
      [](Call& c) {
        c.q = c.make({2, 3, 17, 256}, DType::kBF16);
        c.k = c.make({6, 4, 1, 256}, DType::kBF16);
        c.v = c.make({6, 4, 1, 256}, DType::kBF16);
        c.out = c.make({2, 3, 17, 256}, DType::kBF16);
        c.lse = c.make({2, 3, 17}, DType::kF32);
        c.o.gate.reset();
        c.native();
      },
      K::kNotSupported, "key");
  add(
      "native_warp_specialized_needs_canonical_geometry",
      [](Call& c) {
        c.o.warp_specialized = true;
        c.native();
      },
      K::kNotSupported, "warp_specialized");
  add(
      "native_varlen_kv_is_reference_only",
      [](Call& c) {
        c.o.block_table.reset();
        c.k = c.make({24, 2, 256}, DType::kBF16);
        c.v = c.make({24, 2, 256}, DType::kBF16);
        c.o.cu_seqlens_k = c.make_i32({3});
        c.native();
      },
      K::kNotSupported, "cu_seqlens_k");
  add(
      "native_padded_kv_needs_padded_query",
      [flat](Call& c) {
        flat(c);
        c.o.block_table.reset();
        c.k = c.make({2, 12, 2, 256}, DType::kBF16);
        c.v = c.make({2, 12, 2, 256}, DType::kBF16);
        c.o.cu_seqlens_q = c.make_i32({3});
        c.native();
      },
      K::kNotSupported, "query");
  add(
      "native_padded_kv_needs_one_split",
      [](Call& c) {
        c.o.block_table.reset();
        c.k = c.make({2, 12, 2, 256}, DType::kBF16);
        c.v = c.make({2, 12, 2, 256}, DType::kBF16);
        c.o.num_splits = 2;
        c.native();
      },
      K::kNotSupported, "num_splits");
  add(
      "native_key_unit_feature_stride",
      [](Call& c) {
        c.k = c.make({6, 4, 2, 512}, DType::kBF16).as_strided({6, 4, 2, 256}, {4096, 1024, 512, 2});
        c.native();
      },
      K::kValue, "key");
  add(
      "native_value_16_byte_alignment",
      [](Call& c) {
        c.v = c.make({6 * 4 * 2 * 256 + 1}, DType::kBF16)
                  .as_strided({6, 4, 2, 256}, {2048, 512, 256, 1}, 1);
        c.native();
      },
      K::kValue, "value");
  return r;
}

class SparseAttentionValidation : public ::testing::TestWithParam<Rule> {};

TEST_P(SparseAttentionValidation, RaisesNamingTheArgument) {
  const Rule& rule = GetParam();
  Call c;
  rule.mutate(c);
  try {
    c.invoke();
    FAIL() << "no error";
  } catch (const Error& e) {
    const std::string msg = e.what();
    const bool not_supported = dynamic_cast<const NotSupportedError*>(&e) != nullptr;
    switch (rule.kind) {
      case Kind::kValue:
        EXPECT_TRUE(dynamic_cast<const ValueError*>(&e) && !not_supported) << msg;
        break;
      case Kind::kType:
        EXPECT_TRUE(dynamic_cast<const TypeError*>(&e)) << msg;
        break;
      case Kind::kNotSupported:
        EXPECT_TRUE(not_supported) << msg;
        break;
    }
    EXPECT_NE(msg.find(rule.arg), std::string::npos)
        << "message does not name '" << rule.arg << "': " << msg;
  }
}

INSTANTIATE_TEST_SUITE_P(Rules, SparseAttentionValidation, ::testing::ValuesIn(rules()),
                         [](const auto& info) { return info.param.name; });

// The baselines the rules start from are valid, so each rule fails for its own reason.
TEST(SparseAttentionValidationBaseline, LogicalCallRuns) {
  Call c;
  EXPECT_NO_THROW(c.invoke());
}

TEST(SparseAttentionValidationBaseline, PhysicalCallRuns) {
  Call c;
  c.physical();
  EXPECT_NO_THROW(c.invoke());
}

TEST(SparseAttentionValidationBaseline, NativeCallReachesTheNativeEntry) {
#ifdef SPARSE_ATTN_TEST_HAS_CUDA
  GTEST_SKIP() << "the views are host memory labelled cuda:0; a CUDA build would launch on them";
#else
  Call c;
  c.native();
  try {
    c.invoke();
    FAIL() << "no error";
  } catch (const NotSupportedError& e) {
    EXPECT_NE(std::string(e.what()).find("no CUDA support"), std::string::npos) << e.what();
  }
#endif
}

// The workspace size: 0 wherever the call needs no scratch, the call's errors for bad inputs.
TEST(SparseAttentionWorkspaceSize, ZeroForTheReferenceAndForHostTensors) {
  Call c;
  EXPECT_EQ(qsa_sparse_attention_workspace_size(c.q, c.k, c.v, c.token, c.o), 0u);
  c.o.backend = Backend::kNative;  // the call itself raises NotSupportedError for host tensors
  EXPECT_EQ(qsa_sparse_attention_workspace_size(c.q, c.k, c.v, c.token, c.o), 0u);
  c.physical();
  EXPECT_EQ(qsa_sparse_attention_workspace_size(c.q, c.k, c.v, c.token, c.o), 0u);
}

TEST(SparseAttentionWorkspaceAllocator, NotCalledWhenTheCallNeedsNoScratch) {
  Call c;
  int calls = 0;
  c.o.workspace_allocator = [&](size_t bytes) {
    ++calls;
    return c.make({static_cast<int64_t>(bytes)}, DType::kU8);
  };
  EXPECT_NO_THROW(c.invoke());  // the reference backend
  EXPECT_EQ(calls, 0);
}

TEST(SparseAttentionWorkspaceSize, IgnoresTheWorkspaceAndTheOutputs) {
  Call c;
  c.o.workspace = c.make({3}, DType::kF32);  // would be refused by the call
  c.out = c.make({1}, DType::kF32);
  EXPECT_EQ(qsa_sparse_attention_workspace_size(c.q, c.k, c.v, c.token, c.o), 0u);
}

TEST(SparseAttentionWorkspaceSize, RaisesTheCallsErrorsNamingTheArgument) {
  Call c;
  c.q = c.make({24, 256}, DType::kBF16);
  try {
    qsa_sparse_attention_workspace_size(c.q, c.k, c.v, c.token, c.o);
    FAIL() << "no error";
  } catch (const ValueError& e) {
    EXPECT_NE(std::string(e.what()).find("query"), std::string::npos) << e.what();
  }
  Call t;
  t.o.block_table = t.make({2, 3}, DType::kF32);
  EXPECT_THROW(qsa_sparse_attention_workspace_size(t.q, t.k, t.v, t.token, t.o), TypeError);
  Call p;
  p.physical();
  const std::optional<TensorView> both = p.make_i32({6, 5});  // token_indices as well
  EXPECT_THROW(qsa_sparse_attention_workspace_size(p.q, p.k, p.v, both, p.o), ValueError);
}

TEST(SparseAttentionWorkspaceSize, NativeBuildWithoutCudaNeedsNone) {
#ifdef SPARSE_ATTN_TEST_HAS_CUDA
  GTEST_SKIP() << "a CUDA build asks the device for its SM count (tests/cpp/test_gpu_*)";
#else
  Call c;
  c.native();
  EXPECT_EQ(qsa_sparse_attention_workspace_size(c.q, c.k, c.v, c.token, c.o), 0u);
#endif
}

TEST(SparseAttentionShapes, OutputShapes) {
  Tensor q = Tensor::empty({2, 3, 4, 8}, DType::kBF16);
  EXPECT_EQ(qsa_sparse_attention_out_shape(q), (Shape{2, 3, 4, 8}));
  EXPECT_EQ(qsa_sparse_attention_lse_shape(q), (Shape{2, 3, 4}));
  Tensor flat = Tensor::empty({5, 4, 8}, DType::kBF16);
  EXPECT_EQ(qsa_sparse_attention_lse_shape(flat), (Shape{5, 4}));
  Tensor bad = Tensor::empty({5, 8}, DType::kBF16);
  EXPECT_THROW(qsa_sparse_attention_out_shape(bad), ValueError);
}

}  // namespace
}  // namespace sparse_attn

// qsa_sparse_attention on both host backends (the reference, and backend native on host
// tensors: the CPU backend) against a double-precision computation written here: padded /
// flattened queries, padded / varlen / paged K/V, masks, GQA, gates, LSE, strided outputs, the
// block hint and physical indices.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <limits>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/qsa_select.h"
#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::all_close;
using testing::get;
using testing::make_rng;
using testing::poison;
using testing::set;
using testing::to_vector;

constexpr double kInf = std::numeric_limits<double>::infinity();

// kSingle: flattened rows of a single request, with no row mapping at all.
enum class QForm { kPadded, kCuSeqlens, kTokenToReq, kSingle };
enum class KVForm { kPadded, kVarlen, kPaged };
enum class Gate { kNone, kElementwise, kPerHead };

struct Case {
  std::string name;
  DType dtype = DType::kBF16;
  int64_t hq = 4, hkv = 2, d = 32;
  std::vector<int64_t> q_lens = {3, 5};    // real query rows per request
  std::vector<int64_t> k_lens = {17, 40};  // KV length per request
  QForm q_form = QForm::kPadded;
  int64_t q_pad = 0;       // padded Q; 0: max(q_lens). Rows past q_lens are padding.
  int64_t extra_rows = 0;  // flattened: padding rows per request after its q_lens real rows
  KVForm kv_form = KVForm::kPadded;
  int64_t kv_cap = 0;  // padded S_k; 0: max(k_lens) + 3
  bool pass_seq_lens_k = true;
  int64_t page_size = 8;
  bool bad_pages = false;  // paged: some table entries -1 or >= num_pages
  int64_t width = 24;
  bool explicit_positions = false;
  Gate gate = Gate::kNone;
  bool strided_out = false;  // out / lse are views inside larger poisoned buffers
  bool block_hint = false;   // ids come from blocks + tail; also run with block_indices
  int64_t hint_blocks = 5;
  // kTokenToReq padding rows: keep their request's id and sit at a negative position, instead
  // of carrying id -1.
  bool pad_by_position = false;
  bool int64_metadata = false;  // every metadata tensor (ids, offsets, lengths, ...) as int64
  Backend backend = Backend::kReference;  // or kNative: the CPU backend, same oracle
};

// Both host backends: the reference and the CPU backend (backend native on host tensors).
constexpr Backend kHostBackends[] = {Backend::kReference, Backend::kNative};

// Expected outputs (row-major over query.shape / query.shape[:-1]) from logical K/V in double.
struct Expected {
  std::vector<double> out, lse;
};

double sigmoid(double x) { return 1.0 / (1.0 + std::exp(-x)); }

class Problem {
 public:
  explicit Problem(const Case& c) : c_(c), rng_(make_rng()) { build(); }

  void run(const SparseAttentionOptions& extra, const std::optional<TensorView>& block_hint) {
    // int64_metadata: the same values as int64 tensors, kept alive for the call.
    std::vector<Tensor> wide;
    const auto meta = [&](const Tensor& t) -> TensorView {
      if (!c_.int64_metadata) return t.view();
      wide.push_back(testing::widened(t));
      return wide.back().view();
    };
    SparseAttentionOptions o = extra;
    o.backend = c_.backend;
    if (block_hint) o.block_indices = c_.int64_metadata ? meta(blocks_) : *block_hint;
    if (cu_q_.data()) o.cu_seqlens_q = meta(cu_q_);
    if (t2r_.data()) o.token_to_req = meta(t2r_);
    if (cu_k_.data()) o.cu_seqlens_k = meta(cu_k_);
    if (table_.data()) o.block_table = meta(table_);
    // token_to_req layouts mark padding rows in token_to_req or the positions and always pass
    // positions (docs/qsa.md, "Metadata").
    const bool token_to_req = c_.q_form == QForm::kTokenToReq;
    if (padded_rows_ && !token_to_req) o.seq_lens_q = meta(seq_q_);
    if (c_.pass_seq_lens_k) o.seq_lens_k = meta(seq_k_);
    if (c_.explicit_positions || token_to_req) o.query_positions = meta(positions_);
    if (c_.gate != Gate::kNone) o.gate = gate_.view();
    poison(out_buf_.view());
    poison(lse_buf_.view());
    qsa_sparse_attention(query_.view(), key_, value_, meta(token_), out_, lse_, o);
  }
  void run() { run({}, std::nullopt); }

  Expected expected() const;
  void check() const {
    const Expected e = expected();
    EXPECT_TRUE(
        all_close(out_, e.out, testing::default_atol(c_.dtype), testing::default_rtol(c_.dtype)))
        << c_.name << ": out";
    EXPECT_TRUE(all_close(lse_, e.lse, 1e-4, 1e-4)) << c_.name << ": lse";
    if (c_.strided_out) {
      // Everything of the buffers outside the views is still poison.
      const auto outside_nan = [](const TensorView& buf, const TensorView& view) {
        const std::vector<double> all = to_vector(buf);
        const size_t inside = static_cast<size_t>(view.numel());
        return static_cast<size_t>(std::count_if(all.begin(), all.end(), [](double x) {
                 return std::isnan(x);
               })) == all.size() - inside;
      };
      EXPECT_TRUE(outside_nan(out_buf_.view(), out_)) << "out: memory around the view changed";
      EXPECT_TRUE(outside_nan(lse_buf_.view(), lse_)) << "lse: memory around the view changed";
    }
  }

  const Tensor& blocks() const { return blocks_; }
  const Tensor& gate() const { return gate_; }
  const TensorView& out() const { return out_; }
  const TensorView& lse() const { return lse_; }

 private:
  void build();
  int64_t rows() const { return static_cast<int64_t>(row_req_.size()); }

  Case c_;
  std::mt19937_64 rng_;
  int64_t B_ = 0, Q_ = 0, cap_ = 0;
  bool padded_rows_ = false;
  // Per layout row: request, local index (-1 for padding rows), position.
  std::vector<int64_t> row_req_, row_i_, row_pos_;
  std::vector<std::vector<bool>> page_ok_;  // [b][slot] paged: the table entry is valid
  Tensor logical_k_, logical_v_;            // [B, cap, Hkv, D]
  Tensor query_, token_, gate_, blocks_, positions_;
  Tensor cu_q_, t2r_, cu_k_, table_, seq_q_, seq_k_;
  Tensor key_store_, value_store_;
  TensorView key_, value_;
  Tensor out_buf_, lse_buf_;
  TensorView out_, lse_;
};

void Problem::build() {
  const DType dt = c_.dtype;
  B_ = static_cast<int64_t>(c_.q_lens.size());
  const int64_t max_k = *std::max_element(c_.k_lens.begin(), c_.k_lens.end());
  cap_ = c_.kv_cap ? c_.kv_cap : max_k + 3;
  if (!c_.pass_seq_lens_k) cap_ = max_k;  // each request fills the capacity of its layout
  logical_k_ = testing::random_tensor({B_, cap_, c_.hkv, c_.d}, dt, rng_);
  logical_v_ = testing::random_tensor({B_, cap_, c_.hkv, c_.d}, dt, rng_);
  seq_k_ = testing::int32_tensor({B_}, std::vector<int32_t>(c_.k_lens.begin(), c_.k_lens.end()));
  seq_q_ = testing::int32_tensor({B_}, std::vector<int32_t>(c_.q_lens.begin(), c_.q_lens.end()));

  // ----- query rows ---------------------------------------------------------------------
  Shape row_shape;
  if (c_.q_form == QForm::kPadded) {
    const int64_t max_q = *std::max_element(c_.q_lens.begin(), c_.q_lens.end());
    Q_ = c_.q_pad ? c_.q_pad : max_q;
    padded_rows_ =
        std::any_of(c_.q_lens.begin(), c_.q_lens.end(), [&](int64_t n) { return n != Q_; });
    for (int64_t b = 0; b < B_; ++b) {
      for (int64_t i = 0; i < Q_; ++i) {
        row_req_.push_back(b);
        row_i_.push_back(i < c_.q_lens[b] ? i : -1);
      }
    }
    row_shape = {B_, Q_};
  } else {
    padded_rows_ = c_.extra_rows > 0;
    const auto local = [&](int64_t b, int64_t i) { return i < c_.q_lens[b] ? i : -1; };
    std::vector<int32_t> cu = {0};
    for (int64_t b = 0; b < B_; ++b) {
      cu.push_back(cu.back() + static_cast<int32_t>(c_.q_lens[b] + c_.extra_rows));
    }
    if (c_.q_form != QForm::kTokenToReq) {
      for (int64_t b = 0; b < B_; ++b) {
        for (int64_t i = 0; i < c_.q_lens[b] + c_.extra_rows; ++i) {
          row_req_.push_back(b);
          row_i_.push_back(local(b, i));
        }
      }
      if (c_.q_form == QForm::kCuSeqlens) cu_q_ = testing::int32_tensor({B_ + 1}, cu);
    } else {
      // Requests interleaved: a row's local index is its rank among its request's rows.
      std::vector<int64_t> left = c_.q_lens, seen(B_, 0);
      for (int64_t& n : left) n += c_.extra_rows;
      while (std::any_of(left.begin(), left.end(), [](int64_t n) { return n > 0; })) {
        for (int64_t b = B_ - 1; b >= 0; --b) {
          if (left[b]-- > 0) {
            row_req_.push_back(b);
            row_i_.push_back(local(b, seen[b]++));
          }
        }
      }
      std::vector<int32_t> t2r(row_req_.begin(), row_req_.end());
      for (int64_t r = 0; r < rows(); ++r) {
        if (row_i_[r] < 0 && !c_.pad_by_position) t2r[r] = -1;
      }
      t2r_ = testing::int32_tensor({rows()}, t2r);
    }
    row_shape = {rows()};
  }
  std::uniform_int_distribution<int64_t> coin(0, 3);
  std::vector<int32_t> pos(rows());
  for (int64_t r = 0; r < rows(); ++r) {
    const int64_t b = row_req_[r];
    const int64_t k_len = c_.pass_seq_lens_k ? c_.k_lens[b] : cap_;
    if (c_.explicit_positions) {
      pos[r] = static_cast<int32_t>(
          std::uniform_int_distribution<int64_t>(0, std::max<int64_t>(k_len - 1, 0))(rng_));
    } else {
      pos[r] = static_cast<int32_t>(k_len - c_.q_lens[b] + std::max<int64_t>(row_i_[r], 0));
    }
    if (row_i_[r] < 0 && c_.pad_by_position) pos[r] = static_cast<int32_t>(-1 - r % 3);
    row_pos_.push_back(pos[r]);
  }
  positions_ = testing::int32_tensor(row_shape, pos);

  Shape qshape = row_shape;
  qshape.insert(qshape.end(), {c_.hq, c_.d});
  query_ = testing::random_tensor(qshape, dt, rng_);

  // ----- selections -----------------------------------------------------------------------
  const int64_t W = c_.block_hint ? 4 * c_.hint_blocks + 3 : c_.width;
  Shape tshape = row_shape;
  tshape.push_back(W);
  std::vector<int32_t> ids(rows() * W, -1);
  std::vector<int32_t> blk(rows() * c_.hint_blocks, -1);
  for (int64_t r = 0; r < rows(); ++r) {
    if (r % 7 == 3) continue;  // an empty selection: all -1
    const int64_t b = row_req_[r];
    const int64_t k_len = c_.pass_seq_lens_k ? c_.k_lens[b] : cap_;
    if (c_.block_hint) {
      // Distinct complete visible blocks, then the tail of the current incomplete block.
      const int64_t p = row_pos_[r];
      const int64_t visible = std::min((p + 1) / 4, k_len / 4);
      std::vector<int32_t> all(visible);
      std::iota(all.begin(), all.end(), 0);
      std::shuffle(all.begin(), all.end(), rng_);
      const int64_t nsel = std::min<int64_t>(visible, c_.hint_blocks);
      int64_t w = 0;
      for (int64_t j = 0; j < nsel; ++j) {
        blk[r * c_.hint_blocks + j] = all[j];
        for (int t = 0; t < 4; ++t) ids[r * W + w++] = 4 * all[j] + t;
      }
      for (int64_t t = 4 * ((p + 1) / 4); t <= p; ++t) ids[r * W + w++] = static_cast<int32_t>(t);
    } else {
      // -1 padding, masked future / out-of-range ids, duplicates: all possible.
      std::uniform_int_distribution<int32_t> id(-1, static_cast<int32_t>(cap_ + 4));
      for (int64_t j = 0; j < W; ++j) ids[r * W + j] = coin(rng_) == 0 ? -1 : id(rng_);
    }
  }
  token_ = testing::int32_tensor(tshape, ids);
  if (c_.block_hint) {
    Shape bshape = row_shape;
    bshape.push_back(c_.hint_blocks);
    blocks_ = testing::int32_tensor(bshape, blk);
  }

  // ----- K/V storage ----------------------------------------------------------------------
  const Shape kv_logical = {B_, cap_, c_.hkv, c_.d};
  if (c_.kv_form == KVForm::kPadded) {
    // A strided view: one spare KV head per token so the token stride is not dense.
    key_store_ = testing::random_tensor({B_, cap_, c_.hkv + 1, c_.d}, dt, rng_);
    value_store_ = testing::random_tensor({B_, cap_, c_.hkv + 1, c_.d}, dt, rng_);
    key_ = key_store_.view().narrow(2, 1, c_.hkv);
    value_ = value_store_.view().narrow(2, 0, c_.hkv);
    copy_into(key_, logical_k_);
    copy_into(value_, logical_v_);
  } else if (c_.kv_form == KVForm::kVarlen) {
    // Requests back to back, each holding its seq_len_k tokens, plus two unused rows at the end.
    std::vector<int32_t> cu = {0};
    for (int64_t b = 0; b < B_; ++b) cu.push_back(cu.back() + static_cast<int32_t>(c_.k_lens[b]));
    cu_k_ = testing::int32_tensor({B_ + 1}, cu);
    key_store_ = testing::random_tensor({cu.back() + 2, c_.hkv, c_.d}, dt, rng_);
    value_store_ = testing::random_tensor({cu.back() + 2, c_.hkv, c_.d}, dt, rng_);
    for (int64_t b = 0; b < B_; ++b) {
      copy_into(key_store_.view().narrow(0, cu[b], c_.k_lens[b]),
                logical_k_.view().select(0, b).narrow(0, 0, c_.k_lens[b]));
      copy_into(value_store_.view().narrow(0, cu[b], c_.k_lens[b]),
                logical_v_.view().select(0, b).narrow(0, 0, c_.k_lens[b]));
    }
    key_ = key_store_.view();
    value_ = value_store_.view();
  } else {
    const int64_t ps = c_.page_size;
    const int64_t max_pages = (cap_ + ps - 1) / ps + 1;  // one slot more than needed
    const int64_t num_pages = B_ * max_pages + 2;
    std::vector<int32_t> perm(num_pages);
    std::iota(perm.begin(), perm.end(), 0);
    std::shuffle(perm.begin(), perm.end(), rng_);
    key_store_ = testing::random_tensor({num_pages, ps, c_.hkv, c_.d}, dt, rng_);
    value_store_ = testing::random_tensor({num_pages, ps, c_.hkv, c_.d}, dt, rng_);
    std::vector<int32_t> table(B_ * max_pages);
    page_ok_.assign(B_, std::vector<bool>(max_pages, true));
    int64_t next = 0;
    for (int64_t b = 0; b < B_; ++b) {
      for (int64_t s = 0; s < max_pages; ++s) {
        int32_t page = perm[next++];
        if (c_.bad_pages && (b + s) % 3 == 1) {
          page = (s % 2) ? -1 : static_cast<int32_t>(num_pages + s);
          page_ok_[b][s] = false;
        }
        table[b * max_pages + s] = page;
        if (page < 0 || page >= num_pages) continue;
        for (int64_t t = s * ps; t < std::min((s + 1) * ps, cap_); ++t) {
          copy_into(key_store_.view().select(0, page).select(0, t - s * ps),
                    logical_k_.view().select(0, b).select(0, t));
          copy_into(value_store_.view().select(0, page).select(0, t - s * ps),
                    logical_v_.view().select(0, b).select(0, t));
        }
      }
    }
    table_ = testing::int32_tensor({B_, max_pages}, table);
    key_ = key_store_.view();
    value_ = value_store_.view();
  }

  // Drawn last, so a case with and without a gate sees the same other inputs.
  if (c_.gate == Gate::kElementwise) gate_ = testing::random_tensor(qshape, dt, rng_, -3, 3);
  if (c_.gate == Gate::kPerHead) {
    Shape gshape = qshape;
    gshape.pop_back();
    gate_ = testing::random_tensor(gshape, dt, rng_, -3, 3);
  }

  // ----- outputs --------------------------------------------------------------------------
  if (c_.strided_out) {
    Shape big = qshape;
    big.back() += 5;
    out_buf_ = Tensor::empty(big, dt);
    out_ = out_buf_.view().narrow(static_cast<int>(big.size()) - 1, 2, c_.d);
    Shape lbig = qshape;
    lbig.pop_back();
    lbig.back() = c_.hq + 3;
    lse_buf_ = Tensor::empty(lbig, DType::kF32);
    lse_ = lse_buf_.view().narrow(static_cast<int>(lbig.size()) - 1, 1, c_.hq);
  } else {
    out_buf_ = Tensor::empty(qshape, dt);
    out_ = out_buf_.view();
    Shape lshape = qshape;
    lshape.pop_back();
    lse_buf_ = Tensor::empty(lshape, DType::kF32);
    lse_ = lse_buf_.view();
  }
}

Expected Problem::expected() const {
  Expected e;
  const int64_t W = token_.view().size(-1);
  const int64_t group = c_.hq / c_.hkv;
  for (int64_t r = 0; r < rows(); ++r) {
    const int64_t b = row_req_[r];
    const int64_t k_len = c_.pass_seq_lens_k ? c_.k_lens[b] : cap_;
    // Valid tokens of this row (duplicates count once per occurrence).
    std::vector<int64_t> valid;
    if (row_i_[r] >= 0) {
      for (int64_t j = 0; j < W; ++j) {
        const int64_t t = token_.data_as<int32_t>()[r * W + j];
        if (t < 0 || t >= k_len || t > row_pos_[r]) continue;
        if (c_.kv_form == KVForm::kPaged && !page_ok_[b][t / c_.page_size]) continue;
        valid.push_back(t);
      }
    }
    for (int64_t h = 0; h < c_.hq; ++h) {
      const int64_t g = h / group;
      std::vector<double> qv(c_.d);
      for (int64_t d = 0; d < c_.d; ++d) {
        qv[d] = c_.q_form == QForm::kPadded ? get(query_, {r / Q_, r % Q_, h, d})
                                            : get(query_, {r, h, d});
      }
      std::vector<double> s;
      for (int64_t t : valid) {
        double acc = 0;
        for (int64_t d = 0; d < c_.d; ++d) acc += qv[d] * get(logical_k_, {b, t, g, d});
        s.push_back(acc / std::sqrt(static_cast<double>(c_.d)));
      }
      const double m = s.empty() ? -kInf : *std::max_element(s.begin(), s.end());
      double l = 0;
      for (double x : s) l += std::exp(x - m);
      e.lse.push_back(s.empty() ? -kInf : m + std::log(l));
      for (int64_t d = 0; d < c_.d; ++d) {
        double o = 0;
        for (size_t j = 0; j < valid.size(); ++j) {
          o += std::exp(s[j] - m) / l * get(logical_v_, {b, valid[j], g, d});
        }
        if (c_.gate != Gate::kNone) {
          std::vector<int64_t> gi = c_.q_form == QForm::kPadded
                                        ? std::vector<int64_t>{r / Q_, r % Q_, h, d}
                                        : std::vector<int64_t>{r, h, d};
          if (c_.gate == Gate::kPerHead) gi.pop_back();
          o = round_to(c_.dtype, static_cast<float>(o)) * sigmoid(get(gate_, gi));
        }
        e.out.push_back(o);
      }
    }
  }
  return e;
}

class SparseAttentionHost : public ::testing::TestWithParam<Case> {};

TEST_P(SparseAttentionHost, MatchesDoublePrecision) {
  Problem p(GetParam());
  p.run();
  p.check();
  if (GetParam().block_hint) {
    p.run({}, p.blocks().view());
    p.check();
  }
}

void PrintTo(const Case& c, std::ostream* os) { *os << c.name; }

Case with(Case c, const std::string& name) {
  c.name = name;
  return c;
}

std::vector<Case> cases() {
  std::vector<Case> v;
  Case c;
  v.push_back(with(c, "padded_bf16"));
  c.dtype = DType::kF16;
  v.push_back(with(c, "padded_fp16"));
  c = {};
  c.q_lens = {3, 5, 1};
  c.k_lens = {17, 40, 9};
  c.q_pad = 6;
  v.push_back(with(c, "padded_rows_past_seq_lens_q"));
  c = {};
  c.q_lens = {4, 4};
  c.k_lens = {30, 30};
  c.pass_seq_lens_k = false;
  v.push_back(with(c, "padded_kv_full_capacity"));
  c = {};
  c.explicit_positions = true;
  v.push_back(with(c, "padded_explicit_positions"));
  c = {};
  c.q_form = QForm::kCuSeqlens;
  c.q_lens = {3, 0, 6};
  c.k_lens = {12, 5, 33};
  v.push_back(with(c, "cu_seqlens_q_with_empty_request"));
  c.q_form = QForm::kTokenToReq;
  v.push_back(with(c, "token_to_req_interleaved"));
  c.q_form = QForm::kCuSeqlens;
  c.kv_form = KVForm::kVarlen;
  v.push_back(with(c, "varlen_kv"));
  c.q_form = QForm::kTokenToReq;
  c.explicit_positions = true;
  v.push_back(with(c, "varlen_kv_token_to_req_positions"));
  for (int64_t ps : {1, 3, 8, 64}) {
    c = {};
    c.kv_form = KVForm::kPaged;
    c.page_size = ps;
    c.k_lens = {17, 70};
    c.width = 40;
    v.push_back(with(c, "paged_page" + std::to_string(ps)));
    c.bad_pages = true;
    c.q_form = QForm::kCuSeqlens;
    v.push_back(with(c, "paged_page" + std::to_string(ps) + "_bad_pages_flat"));
  }
  for (int64_t g : {1, 2, 3, 8, 12, 16}) {
    c = {};
    c.hkv = 2;
    c.hq = 2 * g;
    c.d = 16;
    v.push_back(with(c, "gqa_group" + std::to_string(g)));
  }
  c = {};
  c.hkv = 1;
  c.hq = 3;
  c.kv_form = KVForm::kPaged;
  v.push_back(with(c, "paged_hq3_hkv1"));
  c = {};
  c.gate = Gate::kElementwise;
  v.push_back(with(c, "gate_elementwise"));
  c.gate = Gate::kPerHead;
  c.q_form = QForm::kCuSeqlens;
  v.push_back(with(c, "gate_per_head_flat"));
  c.dtype = DType::kF16;
  c.kv_form = KVForm::kPaged;
  v.push_back(with(c, "gate_per_head_paged_fp16"));
  c = {};
  c.strided_out = true;
  v.push_back(with(c, "strided_out_and_lse"));
  c.q_form = QForm::kTokenToReq;
  c.gate = Gate::kElementwise;
  v.push_back(with(c, "strided_out_flat_gate"));
  c = {};
  c.q_form = QForm::kCuSeqlens;
  c.extra_rows = 2;
  v.push_back(with(c, "cu_seqlens_q_rows_past_seq_lens_q"));
  c.q_form = QForm::kTokenToReq;
  c.kv_form = KVForm::kPaged;
  v.push_back(with(c, "token_to_req_rows_past_seq_lens_q_paged"));
  c.pad_by_position = true;
  v.push_back(with(c, "token_to_req_padding_rows_at_negative_positions"));
  c.int64_metadata = true;
  v.push_back(with(c, "token_to_req_padding_rows_at_negative_positions_int64"));
  c.pad_by_position = false;
  v.push_back(with(c, "token_to_req_padding_rows_int64"));
  // int64 metadata in every layout: the same results as int32 (each tensor read as stored).
  c = {};
  c.q_lens = {3, 5, 1};
  c.k_lens = {17, 40, 9};
  c.q_pad = 6;
  c.int64_metadata = true;
  v.push_back(with(c, "padded_rows_past_seq_lens_q_int64"));
  c.explicit_positions = true;
  v.push_back(with(c, "padded_explicit_positions_int64"));
  c = {};
  c.q_form = QForm::kCuSeqlens;
  c.q_lens = {3, 0, 6};
  c.k_lens = {12, 5, 33};
  c.kv_form = KVForm::kVarlen;
  c.int64_metadata = true;
  v.push_back(with(c, "varlen_kv_int64"));
  c = {};
  c.kv_form = KVForm::kPaged;
  c.page_size = 8;
  c.k_lens = {17, 70};
  c.width = 40;
  c.bad_pages = true;
  c.q_form = QForm::kCuSeqlens;
  c.int64_metadata = true;
  v.push_back(with(c, "paged_page8_bad_pages_flat_int64"));
  c.block_hint = true;
  c.explicit_positions = true;
  c.page_size = 4;
  v.push_back(with(c, "paged_page4_block_hint_int64"));
  c = {};
  c.q_form = QForm::kSingle;
  c.q_lens = {7};
  c.k_lens = {29};
  v.push_back(with(c, "flattened_single_request_no_mapping"));
  c.kv_form = KVForm::kVarlen;
  v.push_back(with(c, "flattened_single_request_varlen_kv"));
  c = {};
  c.width = 0;
  v.push_back(with(c, "width0_all_rows_empty"));
  c = {};
  c.d = 256;
  c.hq = 24;
  c.hkv = 2;
  c.q_lens = {2};
  c.k_lens = {300};
  c.width = 64;
  c.kv_form = KVForm::kPaged;
  c.page_size = 64;
  v.push_back(with(c, "canonical_24_2_256_paged"));
  return v;
}

std::vector<Case> on_cpu_backend(std::vector<Case> v) {
  for (Case& c : v) c.backend = Backend::kNative;
  return v;
}

INSTANTIATE_TEST_SUITE_P(Reference, SparseAttentionHost, ::testing::ValuesIn(cases()),
                         [](const auto& info) { return info.param.name; });
INSTANTIATE_TEST_SUITE_P(CpuBackend, SparseAttentionHost,
                         ::testing::ValuesIn(on_cpu_backend(cases())),
                         [](const auto& info) { return info.param.name; });

// The block hint changes nothing: the same output and LSE, bitwise, as the token-only call,
// for query positions with every remainder p % 4 (tails of 0 to 3 tokens).
TEST(SparseAttentionBlockHint, SameResultAsTokenOnlyForEveryTailLength) {
  for (auto [kv, backend] : {std::pair{KVForm::kPadded, Backend::kReference},
                             {KVForm::kPaged, Backend::kReference},
                             {KVForm::kPadded, Backend::kNative},
                             {KVForm::kPaged, Backend::kNative}}) {
    Case c;
    c.backend = backend;
    c.name = "block_hint";
    c.block_hint = true;
    c.hint_blocks = 4;
    c.q_lens = {8, 8};
    c.k_lens = {37, 50};
    c.explicit_positions = true;
    c.kv_form = kv;
    c.page_size = 4;
    Problem p(c);
    p.run();
    p.check();
    const std::vector<double> out = to_vector(p.out()), lse = to_vector(p.lse());
    p.run({}, p.blocks().view());
    p.check();
    EXPECT_EQ(to_vector(p.out()), out);
    EXPECT_EQ(to_vector(p.lse()), lse);
  }
}

TEST(SparseAttentionBlockHint, RightAlignedPositionsCoverEveryRemainder) {
  // Default positions p_i = seq_len_k - seq_len_q + i; with 4 rows the remainders are 0..3.
  Case c;
  c.name = "block_hint_default_positions";
  c.block_hint = true;
  c.hint_blocks = 3;
  c.q_lens = {4};
  c.k_lens = {23};
  Problem p(c);
  p.run({}, p.blocks().view());
  p.check();
}

// The gate equals the unfused path bitwise: attention rounded to the output dtype, times
// sigmoid(gate) in FP32, rounded again.
TEST(SparseAttentionGate, EqualsUnfusedPathBitwise) {
  for (Gate kind : {Gate::kElementwise, Gate::kPerHead}) {
    for (DType dt : {DType::kBF16, DType::kF16}) {
      for (Backend backend : kHostBackends) {
        Case c;
        c.backend = backend;
        c.name = "gate_unfused";
        c.dtype = dt;
        c.gate = kind;
        Problem p(c);
        p.run();
        const std::vector<double> gated = to_vector(p.out());
        c.gate = Gate::kNone;
        Problem plain(c);  // same test name -> same random draws, minus the gate tensor
        plain.run();
        const std::vector<double> attn = to_vector(plain.out());
        const std::vector<double> g = to_vector(p.gate());
        const int64_t d = c.d;
        for (size_t i = 0; i < attn.size(); ++i) {
          const double gv = kind == Gate::kElementwise ? g[i] : g[i / d];
          const float sig = 1.f / (1.f + std::exp(-static_cast<float>(gv)));
          const float want = round_to(dt, static_cast<float>(attn[i]) * sig);
          ASSERT_EQ(gated[i], static_cast<double>(want)) << "element " << i;
        }
      }
    }
  }
}

// The selection helpers feed attention: top-k over block scores, expansion with the tail of
// the current block, then attention with and without the block hint. The expected output is
// dense attention restricted to exactly the kept blocks' tokens plus the tail.
TEST(SparseAttentionPipeline, TopkExpandThenAttentionMatchesRestrictedDense) {
  auto rng = make_rng();
  const int64_t Q = 8, Hq = 4, Hkv = 2, D = 32, S = 64, NB = S / 4, K = 5;
  Tensor q = testing::random_tensor({1, Q, Hq, D}, DType::kBF16, rng);
  Tensor k = testing::random_tensor({1, S, Hkv, D}, DType::kBF16, rng);
  Tensor v = testing::random_tensor({1, S, Hkv, D}, DType::kBF16, rng);
  const std::vector<int32_t> pos = {2, 3, 20, 33, 46, 59, 62, 63};  // every p % 4
  Tensor positions = testing::int32_tensor({1, Q}, pos);
  Tensor scores = testing::random_tensor({1, Q, NB}, DType::kF32, rng);
  for (int64_t r = 0; r < Q; ++r) {
    for (int64_t b = 0; b < NB; ++b) {
      if (4 * b + 3 > pos[r]) set(scores, {0, r, b}, -kInf);
    }
  }
  Tensor top = Tensor::empty({1, Q, K}, DType::kI32);
  qsa_topk_blocks(scores, K, top);
  Tensor tokens = Tensor::empty({1, Q, 4 * K + 3}, DType::kI32);
  Tensor blocks = Tensor::empty({1, Q, K}, DType::kI32);
  qsa_expand_blocks(top, positions, tokens, blocks.view());

  SparseAttentionOptions o;
  o.backend = Backend::kReference;
  o.query_positions = positions.view();
  Tensor out = Tensor::empty({1, Q, Hq, D}, DType::kBF16);
  Tensor lse = Tensor::empty({1, Q, Hq}, DType::kF32);
  poison(out);
  qsa_sparse_attention(q, k, v, tokens.view(), out, lse.view(), o);
  const std::vector<double> plain = to_vector(out), plain_lse = to_vector(lse);
  o.block_indices = blocks.view();
  poison(out);
  qsa_sparse_attention(q, k, v, tokens.view(), out, lse.view(), o);
  EXPECT_EQ(to_vector(out), plain);
  EXPECT_EQ(to_vector(lse), plain_lse);

  std::vector<double> eo;
  for (int64_t r = 0; r < Q; ++r) {
    std::vector<int64_t> sel;
    for (int64_t j = 0; j < K; ++j) {
      const int64_t b = static_cast<int64_t>(get(top, {0, r, j}));
      if (b < 0) continue;
      for (int64_t t = 4 * b; t < 4 * b + 4; ++t) sel.push_back(t);
    }
    for (int64_t t = 4 * ((pos[r] + 1) / 4); t <= pos[r]; ++t) sel.push_back(t);
    for (int64_t h = 0; h < Hq; ++h) {
      const int64_t g = h / (Hq / Hkv);
      std::vector<double> sc;
      for (int64_t t : sel) {
        double acc = 0;
        for (int64_t d = 0; d < D; ++d) acc += get(q, {0, r, h, d}) * get(k, {0, t, g, d});
        sc.push_back(acc / std::sqrt(static_cast<double>(D)));
      }
      const double m = *std::max_element(sc.begin(), sc.end());
      double l = 0;
      for (double x : sc) l += std::exp(x - m);
      for (int64_t d = 0; d < D; ++d) {
        double acc = 0;
        for (size_t j = 0; j < sel.size(); ++j) {
          acc += std::exp(sc[j] - m) / l * get(v, {0, sel[j], g, d});
        }
        eo.push_back(acc);
      }
    }
  }
  EXPECT_TRUE(all_close(out, eo, 1e-2, 1e-2));
}

TEST(SparseAttentionScale, ExplicitScaleAndAlias) {
  // scale and softmax_scale both rescale the logits; 1/sqrt(D) is the default.
  Case c;
  c.name = "scale";
  c.d = 16;
  Problem p(c);
  p.run();
  const std::vector<double> def = to_vector(p.out());
  SparseAttentionOptions o;
  o.softmax_scale = 0.25;  // == 1/sqrt(16)
  p.run(o, std::nullopt);
  EXPECT_EQ(to_vector(p.out()), def);
  o = {};
  o.scale = 0.5;
  p.run(o, std::nullopt);
  EXPECT_NE(to_vector(p.out()), def);
}

// Physical mode: ids are rows of flattened K/V; duplicates count, ids < 0 or >= total_kv are
// masked, no causal filtering.
TEST(SparseAttentionPhysical, DuplicatesKeptOutOfCapacityMasked) {
  auto rng = make_rng();
  const int64_t rows = 9, hq = 6, hkv = 2, d = 32, total = 50, W = 12;
  Tensor q = testing::random_tensor({rows, hq, d}, DType::kBF16, rng);
  Tensor k = testing::random_tensor({total, hkv, d}, DType::kBF16, rng);
  Tensor v = testing::random_tensor({total, hkv, d}, DType::kBF16, rng);
  std::vector<int32_t> ids(rows * W);
  std::uniform_int_distribution<int32_t> id(-3, total + 3);
  for (int64_t r = 0; r < rows; ++r) {
    for (int64_t j = 0; j < W; ++j) ids[r * W + j] = r == 4 ? -1 : id(rng);
    if (r != 4) ids[r * W + 1] = ids[r * W] = 7;  // a duplicate in every nonempty row
  }
  Tensor sel = testing::int32_tensor({rows, W}, ids);
  const testing::AttentionExpectation e =
      testing::expected_physical_attention(q, k, v, ids, W, 0.1);
  for (Backend backend : kHostBackends) {
    Tensor out = Tensor::empty({rows, hq, d}, DType::kBF16);
    Tensor lse = Tensor::empty({rows, hq}, DType::kF32);
    poison(out);
    poison(lse);
    SparseAttentionOptions o;
    o.backend = backend;
    o.selected_kv_indices = sel.view();
    o.scale = 0.1;
    qsa_sparse_attention(q, k, v, std::nullopt, out, lse.view(), o);
    EXPECT_TRUE(all_close(out, e.out, 1e-2, 1e-2)) << backend_name(backend);
    EXPECT_TRUE(all_close(lse, e.lse, 1e-4, 1e-4)) << backend_name(backend);
  }
}

TEST(SparseAttentionReference, ZeroRowsIsANoOp) {
  auto rng = make_rng();
  Tensor q = Tensor::empty({0, 4, 16}, DType::kBF16);
  Tensor k = testing::random_tensor({1, 8, 2, 16}, DType::kBF16, rng);
  Tensor v = testing::random_tensor({1, 8, 2, 16}, DType::kBF16, rng);
  Tensor t = Tensor::empty({0, 5}, DType::kI32);
  Tensor out = Tensor::empty({0, 4, 16}, DType::kBF16);
  for (Backend backend : kHostBackends) {
    SparseAttentionOptions o;
    o.backend = backend;
    EXPECT_NO_THROW(qsa_sparse_attention(q, k, v, t.view(), out, std::nullopt, o));
  }
}

TEST(SparseAttentionReference, EmptyRowsGiveZeroAndMinusInfNeverNan) {
  // Every id masked for a different reason: -1, >= seq_len_k, after the position.
  auto rng = make_rng();
  Tensor q = testing::random_tensor({1, 3, 2, 8}, DType::kBF16, rng);
  Tensor k = testing::random_tensor({1, 10, 1, 8}, DType::kBF16, rng);
  Tensor v = testing::random_tensor({1, 10, 1, 8}, DType::kBF16, rng);
  // Positions 7, 8, 9 (right-aligned); seq_len_k 10.
  Tensor t = testing::int32_tensor({1, 3, 2}, {-1, -1, 10, 11, -5, 12});
  for (Backend backend : kHostBackends) {
    Tensor out = Tensor::empty({1, 3, 2, 8}, DType::kBF16);
    Tensor lse = Tensor::empty({1, 3, 2}, DType::kF32);
    poison(out);
    poison(lse);
    SparseAttentionOptions o;
    o.backend = backend;
    qsa_sparse_attention(q, k, v, t.view(), out, lse.view(), o);
    EXPECT_TRUE(all_close(out, std::vector<double>(48, 0.0), 0, 0)) << backend_name(backend);
    EXPECT_TRUE(all_close(lse, std::vector<double>(6, -kInf), 0, 0)) << backend_name(backend);
  }
}

// Contents the caller promises are checked by both host backends, which read them anyway.
TEST(SparseAttentionReferenceContents, BrokenMetadataRaisesValueError) {
  for (Backend backend : kHostBackends) {
    auto rng = make_rng();
    Tensor q = testing::random_tensor({4, 2, 8}, DType::kBF16, rng);
    Tensor k = testing::random_tensor({2, 6, 1, 8}, DType::kBF16, rng);
    Tensor v = testing::random_tensor({2, 6, 1, 8}, DType::kBF16, rng);
    Tensor t = testing::random_int32({4, 3}, rng, -1, 5);
    Tensor out = Tensor::empty({4, 2, 8}, DType::kBF16);
    const auto expect_error = [&](const SparseAttentionOptions& o, const std::string& arg) {
      try {
        qsa_sparse_attention(q, k, v, t.view(), out, std::nullopt, o);
        ADD_FAILURE() << arg << ": no error";
      } catch (const ValueError& e) {
        EXPECT_NE(std::string(e.what()).find(arg), std::string::npos) << e.what();
      }
    };
    SparseAttentionOptions o;
    o.backend = backend;
    Tensor cu_bad = testing::int32_tensor({3}, {0, 3, 2});
    o.cu_seqlens_q = cu_bad.view();
    expect_error(o, "cu_seqlens_q");
    Tensor cu_short = testing::int32_tensor({3}, {0, 1, 3});
    o.cu_seqlens_q = cu_short.view();
    expect_error(o, "cu_seqlens_q");
    Tensor cu_ok = testing::int32_tensor({3}, {0, 2, 4});
    o.cu_seqlens_q = cu_ok.view();
    Tensor lens_q = testing::int32_tensor({2}, {3, 2});  // request 0 has 2 rows
    o.seq_lens_q = lens_q.view();
    expect_error(o, "seq_lens_q");
    o.seq_lens_q.reset();
    o.cu_seqlens_q.reset();
    Tensor positions = testing::int32_tensor({4}, {0, 1, 2, 3});
    o.query_positions = positions.view();
    Tensor t2r = testing::int32_tensor({4}, {0, 1, 2, 0});
    o.token_to_req = t2r.view();
    expect_error(o, "token_to_req");
    Tensor t2r_below = testing::int64_tensor({4}, {0, -2, 1, 0});  // -1 is padding, -2 broken
    o.token_to_req = t2r_below.view();
    expect_error(o, "token_to_req");
    Tensor t2r_ok = testing::int32_tensor({4}, {0, 1, 1, 0});
    o.token_to_req = t2r_ok.view();
    Tensor lens = testing::int32_tensor({2}, {6, 7});
    o.seq_lens_k = lens.view();
    expect_error(o, "seq_lens_k");
  }
}

TEST(SparseAttentionReferenceContents, VarlenKeyOffsetsChecked) {
  auto rng = make_rng();
  Tensor q = testing::random_tensor({2, 1, 2, 8}, DType::kBF16, rng);
  Tensor k = testing::random_tensor({10, 1, 8}, DType::kBF16, rng);
  Tensor v = testing::random_tensor({10, 1, 8}, DType::kBF16, rng);
  Tensor t = testing::random_int32({2, 1, 3}, rng, -1, 5);
  Tensor out = Tensor::empty({2, 1, 2, 8}, DType::kBF16);
  for (Backend backend : kHostBackends) {
    SparseAttentionOptions o;
    o.backend = backend;
    Tensor cu = testing::int32_tensor({3}, {0, 6, 11});  // past key.shape[0]
    o.cu_seqlens_k = cu.view();
    EXPECT_THROW(qsa_sparse_attention(q, k, v, t.view(), out, std::nullopt, o), ValueError);
    Tensor cu2 = testing::int32_tensor({3}, {0, 6, 4});
    o.cu_seqlens_k = cu2.view();
    EXPECT_THROW(qsa_sparse_attention(q, k, v, t.view(), out, std::nullopt, o), ValueError);
  }
}

}  // namespace
}  // namespace sparse_attn

// Dense causal attention on selected query rows, on the host, as the yardstick of the demo's
// metrics: FP32 dot products, softmax and output in FP64 over every key the row may see
// (0 .. its position), so sparse outputs are compared with the exact dense answer and the
// attention mass of any token set follows from the LSE.
#pragma once

#include <cstdint>
#include <vector>

#include "sparse_attn/tensor.h"

namespace sparse_attn::cli {

class DenseRows {
 public:
  // q_rows: host [1, R, Hq, D] (the rows to evaluate); key, value: host [1, Lk, Hkv, D];
  // positions: the request-local position of each row. Runs on every host core.
  DenseRows(const TensorView& q_rows, const TensorView& key, const TensorView& value,
            const std::vector<int64_t>& positions, const char* progress_label);

  int64_t rows() const { return rows_; }
  int64_t heads() const { return hq_; }
  int64_t dim() const { return d_; }
  // Dense output of (row, head) as float [D], and its log-sum-exp (natural log, of scale*q.k).
  const float* out(int64_t r, int64_t h) const { return &out_[(r * hq_ + h) * d_]; }
  double lse(int64_t r, int64_t h) const { return lse_[r * hq_ + h]; }
  // Dense softmax probability of key `t` for (row, head); 0 for keys the row cannot see.
  double prob(int64_t r, int64_t h, int64_t t) const;
  // Time the dense computation took (host, all cores).
  double seconds() const { return seconds_; }

 private:
  int64_t rows_, hq_, hkv_, d_, lk_;
  double scale_, seconds_ = 0;
  std::vector<int64_t> pos_;
  std::vector<float> q_, k_, out_;  // q_ [R, Hq, D]; k_ [Hkv, Lk, D]
  std::vector<double> lse_;
};

}  // namespace sparse_attn::cli

#include "dense.h"

#include <omp.h>

#include <algorithm>
#include <cmath>

#include "common.h"
#include "sparse_attn/dtype.h"

namespace sparse_attn::cli {
namespace {

// [.., L, H, D] element (l, h, d) of a host view of request 0.
float at(const TensorView& t, int64_t l, int64_t h, int64_t d) {
  return load_as_float(t.data(), t.dtype(), l * t.stride(1) + h * t.stride(2) + d * t.stride(3));
}

}  // namespace

DenseRows::DenseRows(const TensorView& q_rows, const TensorView& key, const TensorView& value,
                     const std::vector<int64_t>& positions, const char* progress_label)
    : rows_(q_rows.size(1)),
      hq_(q_rows.size(2)),
      hkv_(key.size(2)),
      d_(q_rows.size(3)),
      lk_(key.size(1)),
      scale_(1.0 / std::sqrt(double(q_rows.size(3)))),
      pos_(positions) {
  Stopwatch clock;
  q_.resize(static_cast<size_t>(rows_ * hq_ * d_));
  k_.resize(static_cast<size_t>(hkv_ * lk_ * d_));
  std::vector<float> v(k_.size());
#pragma omp parallel for schedule(static)
  for (int64_t r = 0; r < rows_; ++r)
    for (int64_t h = 0; h < hq_; ++h)
      for (int64_t d = 0; d < d_; ++d) q_[(r * hq_ + h) * d_ + d] = at(q_rows, r, h, d);
#pragma omp parallel for schedule(static)
  for (int64_t t = 0; t < lk_; ++t)
    for (int64_t g = 0; g < hkv_; ++g)
      for (int64_t d = 0; d < d_; ++d) {
        k_[(g * lk_ + t) * d_ + d] = at(key, t, g, d);
        v[(g * lk_ + t) * d_ + d] = at(value, t, g, d);
      }
  out_.assign(static_cast<size_t>(rows_ * hq_ * d_), 0.f);
  lse_.assign(static_cast<size_t>(rows_ * hq_), 0.0);
  Progress progress(progress_label, rows_ * hq_, "row-heads");
  int64_t done = 0;
  const int64_t group = hq_ / hkv_;
#pragma omp parallel
  {
    std::vector<double> s, acc(static_cast<size_t>(d_));
#pragma omp for schedule(dynamic, 1)
    for (int64_t rh = 0; rh < rows_ * hq_; ++rh) {
      const int64_t r = rh / hq_, h = rh % hq_, g = h / group;
      const int64_t n = std::min(pos_[r] + 1, lk_);
      const float* q = &q_[rh * d_];
      s.resize(static_cast<size_t>(n));
      double mx = -INFINITY;
      for (int64_t t = 0; t < n; ++t) {
        const float* k = &k_[(g * lk_ + t) * d_];
        float dot = 0.f;
        for (int64_t d = 0; d < d_; ++d) dot += q[d] * k[d];
        s[t] = scale_ * dot;
        mx = std::max(mx, s[t]);
      }
      double sum = 0;
      std::fill(acc.begin(), acc.end(), 0.0);
      for (int64_t t = 0; t < n; ++t) {
        const double p = std::exp(s[t] - mx);
        sum += p;
        const float* vv = &v[(g * lk_ + t) * d_];
        for (int64_t d = 0; d < d_; ++d) acc[d] += p * vv[d];
      }
      lse_[rh] = n > 0 ? mx + std::log(sum) : -INFINITY;
      for (int64_t d = 0; d < d_ && n > 0; ++d) out_[rh * d_ + d] = float(acc[d] / sum);
#pragma omp atomic
      ++done;
      if (omp_get_thread_num() == 0) {  // one thread prints
        int64_t now;
#pragma omp atomic read
        now = done;
        progress.update(now);
      }
    }
  }
  progress.finish();
  seconds_ = clock.seconds();
}

double DenseRows::prob(int64_t r, int64_t h, int64_t t) const {
  if (t < 0 || t > pos_[r] || t >= lk_) return 0.0;
  const int64_t g = h / (hq_ / hkv_);
  const float* q = &q_[(r * hq_ + h) * d_];
  const float* k = &k_[(g * lk_ + t) * d_];
  float dot = 0.f;
  for (int64_t d = 0; d < d_; ++d) dot += q[d] * k[d];
  return std::exp(scale_ * dot - lse(r, h));
}

}  // namespace sparse_attn::cli

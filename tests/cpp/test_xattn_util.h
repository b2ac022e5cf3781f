// Double-precision expectations shared by the XAttention tests, written from
// docs/xattention.md independently of src/reference.
#pragma once

#include <cstdint>
#include <exception>
#include <string>
#include <type_traits>
#include <vector>

#include "sparse_attn/errors.h"

#include "sparse_attn/tensor.h"
#include "test_util.h"

namespace sparse_attn::xattn_testing {

// The selection rule's inputs besides the sums.
struct SelectRule {
  std::vector<double> thresholds;  // per head
  bool causal = true;
  bool keep_sink = false;
  bool keep_recent = false;
  int64_t q_len = 0;
  int64_t k_len = 0;
  int64_t block = 128;
};

// Expected block mask (row-major, 0/1) for sums [B, H, q_blocks, k_blocks]: forced blocks,
// then repeatedly the largest remaining eligible block (lowest index on ties) while the mass
// taken so far is below threshold * eligible mass; threshold 1 takes every eligible block.
inline std::vector<double> expected_mask(const TensorView& sums, const SelectRule& r) {
  const int64_t B = sums.size(0), H = sums.size(1), QB = sums.size(2), KB = sums.size(3);
  std::vector<double> out;
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t i = 0; i < QB; ++i) {
        const int64_t last_pos = (r.k_len - r.q_len) + std::min((i + 1) * r.block, r.q_len) - 1;
        const int64_t diag = last_pos / r.block;
        std::vector<double> keep(KB, 0.0);
        std::vector<bool> eligible(KB, false), forced(KB, false);
        for (int64_t j = 0; j < KB; ++j) eligible[j] = !r.causal || j <= diag;
        if (r.causal || r.keep_recent) forced[diag] = true;
        if (r.keep_sink) forced[0] = true;
        std::vector<int64_t> order;
        for (int64_t j = 0; j < KB; ++j)
          if (forced[j]) order.push_back(j);
        std::vector<bool> used = forced;
        for (;;) {
          int64_t best = -1;
          for (int64_t j = 0; j < KB; ++j) {
            if (!eligible[j] || used[j]) continue;
            if (best < 0 || testing::get(sums, {b, h, i, j}) > testing::get(sums, {b, h, i, best}))
              best = j;
          }
          if (best < 0) break;
          used[best] = true;
          order.push_back(best);
        }
        double total = 0;
        for (int64_t j : order) total += testing::get(sums, {b, h, i, j});
        const double t = r.thresholds[h];
        double taken = 0;
        for (int64_t j : order) {
          if (t >= 1.0 || forced[j] || taken < t * total) {
            keep[j] = 1.0;
            taken += testing::get(sums, {b, h, i, j});
          } else {
            break;
          }
        }
        out.insert(out.end(), keep.begin(), keep.end());
      }
  return out;
}

// Runs f and expects exactly the error kind E (a ValueError expectation rejects the
// NotSupportedError subclass) with a message that starts by naming `argument`.
template <typename E, typename F>
void expect_error(F&& f, const std::string& argument) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one naming " << argument;
  } catch (const E& e) {
    const std::string msg = e.what();
    EXPECT_EQ(msg.rfind(argument + ":", 0), 0u) << "message does not start with '" << argument
                                                 << ":': " << msg;
    if constexpr (std::is_same_v<E, ValueError>) {
      EXPECT_EQ(dynamic_cast<const NotSupportedError*>(&e), nullptr)
          << "NotSupportedError where a ValueError was expected: " << msg;
    }
  } catch (const std::exception& e) {
    ADD_FAILURE() << "wrong error kind for " << argument << ": " << e.what();
  }
}

}  // namespace sparse_attn::xattn_testing

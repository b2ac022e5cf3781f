#include "cuda/attention/sparse_attention_heuristics.h"

#include <algorithm>

#include "cuda/attention/sparse_attention_config.h"

namespace sparse_attn::cuda {

// A CTA (one row, one KV head, one split) holds a whole SM (over 200 KB of shared memory), so
// the schedule is a sequence of waves of num_sms CTAs. A CTA costs a fixed
// latency L (resolve the row, read its index columns and page table, compact, first gather)
// plus T per 64-token tile it gathers. For tiles-per-split n (splits = ceil(tiles / n)):
//   cost(n) = waves(rows * kv_heads * splits) * (L/T + n)   [in units of T]
// and the cheapest n wins (ties: fewer splits, less merge traffic). L/T = 2 was fitted to the
// first kernel (T about 4 us); the 8-warp kernel shortens T more than L, i.e. L/T of about 3
// to 4, and the choices below are the same for any L/T from 2 to 4, so one model serves until a
// measured split sweep says otherwise.
// Worked example, decode with 2051 selected tokens (33 tiles), Hkv = 2, 132 SMs, L/T = 2:
//   B = 1:   2 CTAs per split. n = 1 -> 33 splits, 66 CTAs, 1 wave, cost 3 (best); n = 2 ->
//            17 splits, 34 CTAs, cost 4.
//   B = 8:   16 per split. n = 5 -> 7 splits, 112 CTAs, 1 wave, cost 7; n = 1 -> 528 CTAs,
//            4 waves, cost 12; n = 3 -> 176 CTAs, 2 waves, cost 10. Picks 7 splits.
//   B = 32:  64 per split. n = 17 -> 2 splits, 128 CTAs, cost 19; n = 33 -> 1 split, cost 35;
//            n = 9 -> 4 splits, 256 CTAs, 2 waves, cost 22.
//   B = 128: 256 per split. n = 33 -> 1 split, 2 waves, cost 70; 2 splits: 4 waves, cost 76.
//   L/T = 4 picks the same: B = 1 costs 5 against 6 (n = 2), B = 8 9 against 10 (n = 6),
//   B = 32 21 against 26 (n = 9).
//   Prefill (thousands of rows): 1 split.
int choose_num_splits(int64_t rows, int64_t kv_heads, int64_t width, int num_sms) {
  using C = SparseAttentionConfig;
  const int64_t tiles = std::max<int64_t>(1, (width + C::kBlockTokens - 1) / C::kBlockTokens);
  const int64_t work = std::max<int64_t>(1, rows * kv_heads);
  if (work >= num_sms) return 1;
  constexpr int64_t kFixedTiles = 2;  // L in units of T
  int64_t best_splits = 1, best_cost = -1;
  for (int64_t n = tiles; n >= 1; --n) {
    const int64_t splits = (tiles + n - 1) / n;
    if (splits > C::kMaxSplits) break;
    const int64_t waves = (work * splits + num_sms - 1) / num_sms;
    const int64_t cost = waves * (kFixedTiles + n);
    if (best_cost < 0 || cost < best_cost) {
      best_cost = cost;
      best_splits = splits;
    }
  }
  return static_cast<int>(best_splits);
}

// The gather kernel's splits of a (row, KV head) pair merge inside their cluster, so a split
// costs no launch and no workspace, but each adds a CTA's fixed latency chain (metadata, page
// table, first gather) and its share of the merge's remote reads. Measured on an H100 (session
// 36, 2051 tokens at Hkv = 2, graph-replayed split sweeps of bf16 and FP8, token ids and the
// hint), the best counts were 16 / 16 / 8 / 4-8 / 2-8 / 2 / 1-2 at B = 1 / 2 / 4 / 8 / 16 / 32 /
// 64 (2 / 4 / 8 / 16 / 32 / 64 / 128 pairs): about SMs / 2 CTAs in all while that gives more
// than one split, the balance of fewer tiles a CTA against more CTAs and a longer merge, and 2
// splits while they still fit one CTA an SM. So: the largest power of two S <= 16 with
// pairs * S <= SMs / 2, at least 2 where 2 * pairs <= SMs, capped at one split per 16 blocks
// (a 64-token tile) and at the device's cluster limit. Every pick is within 8% of its row's
// best. Worked examples (132 SMs, 512 blocks): B = 1 -> 66 / 2 = 33 -> 16; B = 2 -> 16.5 -> 16;
// B = 4 -> 8; B = 8 -> 4; B = 16 -> 2; B = 32 -> 1, raised to 2 (128 <= 132); B >= 64 -> 1.
int choose_gather_splits(int64_t pairs, int64_t blocks, int max_splits, int num_sms) {
  constexpr int64_t kMinBlocks = 16, kCap = 16;
  pairs = std::max<int64_t>(1, pairs);
  int64_t splits = 1;
  while (2 * splits <= kCap && pairs * 2 * splits <= num_sms / 2) splits *= 2;
  if (splits == 1 && 2 * pairs <= num_sms) splits = 2;
  const int64_t by_blocks = std::max<int64_t>(1, blocks / kMinBlocks);
  return static_cast<int>(std::clamp<int64_t>(std::min(splits, by_blocks), 1, max_splits));
}

}  // namespace sparse_attn::cuda

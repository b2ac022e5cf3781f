// Validation and params filling shared by the indexer score ops (src/api/qsa_indexer.cpp) and
// the fused selections (src/api/qsa_select_fused.cpp), which take the score ops' arguments and
// must accept and refuse exactly what the score ops do. Metadata only, as api/check.h; the
// definitions live in qsa_indexer.cpp.
#pragma once

#include <array>
#include <cstdint>
#include <optional>
#include <span>
#include <string_view>
#include <utility>

#include "api/qsa_indexer_params.h"
#include "api/staging.h"
#include "sparse_attn/qsa.h"
#include "sparse_attn/tensor.h"

namespace sparse_attn::detail {

// An input of an op and its name, for the overlap checks of the outputs; null: not given.
using NamedInput = std::pair<const TensorView*, const char*>;

inline const TensorView* opt_ptr(const std::optional<TensorView>& t) { return t ? &*t : nullptr; }

// scale is a multiplier, score_scale a denominator; at most one, each a positive float32 (and so
// is the multiplier 1 / score_scale); default 1/sqrt(dim).
float resolve_indexer_scale(const std::optional<double>& scale,
                            const std::optional<double>& score_scale, int64_t dim);

// Integer metadata of an exact shape on `device`: int32 or int64, read as stored.
void check_indexer_metadata(const TensorView& t, const char* name, const Shape& shape,
                            std::string_view what, Device device, const char* device_ref);

// What every native indexer kernel on CUDA requires of a call: heads == 4, dim == 128
// (NotSupportedError naming q_name, with `op` in the message).
void check_indexer_native(const char* op, const TensorView& q, const char* q_name);

// ---------------------------------------------------------------------------------------
// qsa_indexer_mqa_score's arguments
// ---------------------------------------------------------------------------------------

// The validated layout of a score call, everything but its output.
struct ScoreLayout {
  bool varlen;
  bool paged;
  int64_t batch;       // requests
  int64_t q_len;       // padded: Q; varlen: total_q
  int64_t num_blocks;  // N_B
  int64_t page_size;   // paged only
  Shape out_shape;     // the score matrix: [B, Q, N_B] or [total_q, N_B]
};

// q_idx and every option; block_keys as resolve_cache_dtype returned it.
ScoreLayout check_score(const TensorView& q_idx, const TensorView& block_keys,
                        const IndexerScoreOptions& o);

// The native CUDA rules of a score call (check_indexer_native, then the vector-load layout of
// q_idx and block_keys).
void check_score_native(const char* op, const TensorView& q_idx, const TensorView& block_keys);

// The inputs of a score call (given ones first, then nulls), for the outputs' overlap checks.
std::array<NamedInput, 7> score_inputs(const TensorView& q_idx, const TensorView& block_keys,
                                       const IndexerScoreOptions& o);

// Params of a checked score call with `out` null (and its strides 0); set_score_out adds it.
MqaScoreParams score_params(const ScoreLayout& l, const TensorView& q_idx,
                            const TensorView& block_keys, const IndexerScoreOptions& o,
                            float scale);
void set_score_out(MqaScoreParams& p, const ScoreLayout& l, const TensorView& out);

// ---------------------------------------------------------------------------------------
// qsa_mqa_decode's arguments
// ---------------------------------------------------------------------------------------

// The native decode kernels score up to this many query rows of a request (multi-token decode:
// the speculative tokens of one step) against each key tile they load.
inline constexpr int64_t kNativeDecodeRows = 4;

// Requests, query rows per request and the score shape of a decode call: q [B, H, D] is R = 1
// row per request, q [B, R, H, D] R >= 1 rows; the scores are [B * R, max_model_len].
struct DecodeLayout {
  int64_t batch;
  int64_t rows;
  Shape out_shape;
};

// q's rank and rows, and max_model_len (what the shape function checks).
DecodeLayout check_decode_layout(const TensorView& q, int64_t max_model_len);

// The other inputs: k_cache, page_table and context_lens against q. Returns k_cache as its bytes
// are read (resolve_cache_dtype).
TensorView check_decode_inputs(const TensorView& q, const TensorView& k_cache_stored,
                               const TensorView& page_table, const TensorView& context_lens,
                               const DecodeLayout& l, const std::optional<DType>& kv_cache_dtype);

// The native CUDA rules of a decode call: check_indexer_native and R <= kNativeDecodeRows.
void check_decode_native(const char* op, const TensorView& q, const DecodeLayout& l);

// Params of a checked decode call with `out` null (and its strides 0); set_decode_out adds it.
MqaDecodeParams decode_params(const TensorView& q, const TensorView& k_cache,
                              const TensorView& page_table, const TensorView& context_lens,
                              int64_t max_model_len, float scale, StreamHandle stream);
void set_decode_out(MqaDecodeParams& p, const TensorView& out);

// The score options with every metadata tensor staged to the host (the reference backend).
IndexerScoreOptions stage_score_options(HostStaging& host, const IndexerScoreOptions& o);

}  // namespace sparse_attn::detail

// QSA selection helpers: block top-k over indexer scores and the expansion of selected blocks
// to the token ids (and block hint) that sparse attention takes.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "convert.h"
#include "sparse_attn/qsa_select.h"

namespace sparse_attn::python {
namespace {

using nb::handle;

void topk_blocks(handle scores, handle k, handle out, handle stream) {
  Borrowed b;
  const TensorView s = b.tensor(scores, "scores");
  const int64_t kk = to_int(k, "k");
  const TensorView o = b.tensor(out, "out", true);
  const StreamHandle st = to_stream(stream);
  nb::gil_scoped_release release;
  qsa_topk_blocks(s, kk, o, st);
}

Shape topk_blocks_shape(handle scores, handle k) {
  Borrowed b;
  return qsa_topk_blocks_shape(b.tensor(scores, "scores"), to_int(k, "k"));
}

void expand_blocks(handle block_ids, handle query_positions, handle token_indices,
                   handle block_indices, handle stream) {
  Borrowed b;
  const TensorView ids = b.tensor(block_ids, "block_ids");
  const TensorView pos = b.tensor(query_positions, "query_positions");
  const TensorView tokens = b.tensor(token_indices, "token_indices", true);
  const std::optional<TensorView> blocks = b.optional_tensor(block_indices, "block_indices", true);
  const StreamHandle st = to_stream(stream);
  nb::gil_scoped_release release;
  qsa_expand_blocks(ids, pos, tokens, blocks, st);
}

Shape expand_blocks_token_shape(handle block_ids) {
  Borrowed b;
  return qsa_expand_blocks_token_shape(b.tensor(block_ids, "block_ids"));
}

}  // namespace

void bind_select(nb::module_& m) {
  m.attr("QSA_TOPK_BLOCKS") = kQsaTopkBlocks;
  def(m, "qsa_topk_blocks", &topk_blocks, "scores", "k", "out", "stream");
  def(m, "qsa_topk_blocks_shape", &topk_blocks_shape, "scores", "k");
  def(m, "qsa_expand_blocks", &expand_blocks, "block_ids", "query_positions", "token_indices",
      "block_indices", "stream");
  def(m, "qsa_expand_blocks_token_shape", &expand_blocks_token_shape, "block_ids");
}

}  // namespace sparse_attn::python

// merge_attention_states: N partial attention results (outputs and LSEs over disjoint key sets)
// combined into the result over their union.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "convert.h"
#include "sparse_attn/merge.h"

namespace sparse_attn::python {
namespace {

using nb::handle;

void merge(handle partial_out, handle partial_lse, handle out, handle lse_out, handle backend,
           handle stream) {
  Borrowed b;
  const TensorView po = b.tensor(partial_out, "partial_out");
  const TensorView pl = b.tensor(partial_lse, "partial_lse");
  const TensorView o = b.tensor(out, "out", true);
  const std::optional<TensorView> lo = b.optional_tensor(lse_out, "lse_out", true);
  MergeOptions opt;
  opt.backend = to_backend(backend);
  opt.stream = to_stream(stream);
  nb::gil_scoped_release release;
  merge_attention_states(po, pl, o, lo, opt);
}

Shape merge_shape(handle partial_out) {
  Borrowed b;
  return merge_attention_states_shape(b.tensor(partial_out, "partial_out"));
}

}  // namespace

void bind_merge(nb::module_& m) {
  def(m, "merge_attention_states", &merge, "partial_out", "partial_lse", "out", "lse_out",
      "backend", "stream");
  def(m, "merge_attention_states_shape", &merge_shape, "partial_out");
}

}  // namespace sparse_attn::python

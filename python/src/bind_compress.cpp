// QSA compressed indexer keys: raw index keys -> the (1 + w)-RMS-normed, rotated block keys.
#include <nanobind/nanobind.h>
#include <nanobind/stl/vector.h>

#include "bind.h"
#include "convert.h"
#include "sparse_attn/qsa_compress.h"

namespace sparse_attn::python {
namespace {

using nb::handle;

void compress_block_keys(handle keys, handle weight, handle out, handle eps, handle cos, handle sin,
                         handle rope_theta, handle rope_dim, handle rope_style, handle cu_seqlens,
                         handle start_positions, handle block_table, handle page_size,
                         handle backend, handle stream) {
  Borrowed b;
  const TensorView k = b.tensor(keys, "keys");
  const TensorView w = b.tensor(weight, "weight");
  const TensorView o = b.tensor(out, "out", true);
  CompressBlockKeysOptions opt;
  opt.eps = to_float(eps, "eps");
  opt.cos = b.optional_tensor(cos, "cos");
  opt.sin = b.optional_tensor(sin, "sin");
  opt.rope_theta = optional_float(rope_theta, "rope_theta");
  opt.rope_dim = to_int(rope_dim, "rope_dim");
  opt.rope_style = parse_rope_style(to_str(rope_style, "rope_style"));
  opt.cu_seqlens = b.optional_tensor(cu_seqlens, "cu_seqlens");
  opt.start_positions = b.optional_tensor(start_positions, "start_positions");
  opt.block_table = b.optional_tensor(block_table, "block_table");
  opt.page_size = optional_int(page_size, "page_size");
  opt.backend = to_backend(backend);
  opt.stream = to_stream(stream);
  nb::gil_scoped_release release;
  qsa_compress_block_keys(k, w, o, opt);
}

Shape compress_block_keys_shape(handle keys) {
  Borrowed b;
  return qsa_compress_block_keys_shape(b.tensor(keys, "keys"));
}

}  // namespace

void bind_compress(nb::module_& m) {
  def(m, "qsa_compress_block_keys", &compress_block_keys, "keys", "weight", "out", "eps", "cos",
      "sin", "rope_theta", "rope_dim", "rope_style", "cu_seqlens", "start_positions", "block_table",
      "page_size", "backend", "stream");
  def(m, "qsa_compress_block_keys_shape", &compress_block_keys_shape, "keys");
}

}  // namespace sparse_attn::python

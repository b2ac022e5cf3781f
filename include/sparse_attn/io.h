// Reading and writing tensors in NumPy .npy and safetensors files, so the CLI, the tests and
// users' scripts exchange real activations (Q/K/V dumped from a model) with sparse_attn.
//
// Every problem with a file (missing, truncated, a malformed header, an unsupported dtype, a
// shape that does not match its data) raises ValueError (TypeError for an unsupported dtype)
// whose message starts with the file's path and says what is wrong. Loading never reads past
// the data the header announces and never trusts a size before checking it against the file.
//
// Supported dtypes: safetensors BF16, F16, F32, F64 (read as float32), I32, I64, BOOL;
// .npy little-endian <f2, <f4, <f8 (read as float32), <i4, <i8, |b1, C order only (numpy has
// no bfloat16: use safetensors for it).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "sparse_attn/tensor.h"
#include "sparse_attn/workload.h"

namespace sparse_attn {

struct TensorInfo {
  std::string name;
  DType dtype;
  Shape shape;
};

// The tensors a safetensors file holds, in the order of their data.
std::vector<TensorInfo> list_safetensors(const std::string& path);
// One tensor of a safetensors file (ValueError listing the names present when it is absent).
Tensor load_safetensors(const std::string& path, const std::string& name);
Tensor load_npy(const std::string& path);

// "FILE.npy", "FILE.safetensors:NAME", or "FILE.safetensors" when the file holds exactly one
// tensor. The format comes from the extension.
Tensor load_tensor(const std::string& spec);

// Writers (host tensors, any strides; written contiguous).
void save_npy(const std::string& path, const TensorView& tensor);
void save_safetensors(const std::string& path,
                      const std::vector<std::pair<std::string, TensorView>>& tensors);

// A workload from users' tensors, checked against each other (names in messages are the
// spec strings): query [B, Lq, Hq, D] or [Lq, Hq, D]; key, value [B, Lk, Hkv, D] or
// [Lk, Hkv, D]; optionally the QSA indexer's query [B, Lq, Hi, Di] and keys, either
// compressed [B, Lk / 4, Di] or raw per token [B, Lk, Di] (then compressed here as the
// generator does: mean of 4, RMS-normalised). The result has no needles.
struct WorkloadFiles {
  std::string query, key, value;
  std::string index_query, index_key;  // both or neither
};
Workload load_workload(const WorkloadFiles& files, Device device = Device::cpu());

}  // namespace sparse_attn

// Uses the installed headers and library the way a C++ user does: a reference-backend call and
// an error type, with nothing from the source tree.
#include <sparse_attn/errors.h>
#include <sparse_attn/qsa.h>

#include <cstdio>
#include <vector>

int main() {
  using namespace sparse_attn;
  std::vector<uint16_t> q(4 * 128, 0x3f80);  // bf16 1.0
  std::vector<uint16_t> k(4 * 128, 0x3f80);
  std::vector<int32_t> starts{0}, ends{4};
  std::vector<float> out(4);
  MqaScoreOptions options;
  options.backend = Backend::kReference;
  qsa_mqa_prefill(TensorView(q.data(), DType::kBF16, Device::cpu(), {1, 4, 128}),
                  TensorView(k.data(), DType::kBF16, Device::cpu(), {4, 128}),
                  TensorView(starts.data(), DType::kI32, Device::cpu(), {1}),
                  TensorView(ends.data(), DType::kI32, Device::cpu(), {1}),
                  TensorView(out.data(), DType::kF32, Device::cpu(), {1, 4}), options);
  // 4 heads x ReLU(128) / sqrt(128) = 45.25...
  if (out[0] < 45.2f || out[0] > 45.3f) {
    std::printf("unexpected score %g\n", out[0]);
    return 1;
  }
  try {
    parse_backend("auto");
  } catch (const ValueError&) {
    std::printf("installed package works\n");
    return 0;
  }
  return 1;
}

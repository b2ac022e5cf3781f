// Tensor files: good .npy and safetensors files (written byte by byte here, not by the code
// under test) load with the right dtype, shape and values; the writers round-trip; every
// malformed or mismatched file gives an error that names the file and the problem.
#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <string>

#include "sparse_attn/dtype.h"
#include "sparse_attn/errors.h"
#include "sparse_attn/io.h"
#include "test_util.h"

namespace sparse_attn {
namespace {

using testing::to_vector;

std::string temp_path(const std::string& name) {
  const auto* info = ::testing::UnitTest::GetInstance()->current_test_info();
  return ::testing::TempDir() + "sparse_attn_io_" + info->name() + "_" + name;
}

std::string write_file(const std::string& name, const std::string& bytes) {
  const std::string path = temp_path(name);
  std::ofstream(path, std::ios::binary) << bytes;
  return path;
}

template <typename T>
std::string raw_bytes(const std::vector<T>& v) {
  return std::string(reinterpret_cast<const char*>(v.data()), v.size() * sizeof(T));
}

// A version-1 .npy file with the given header dict text and data.
std::string npy_bytes(const std::string& dict, const std::string& data) {
  std::string header = dict;
  header.append(63 - (10 + header.size()) % 64, ' ');
  header += '\n';
  std::string out = "\x93NUMPY";
  out += '\x01';
  out += '\x00';
  out += static_cast<char>(header.size() & 0xff);
  out += static_cast<char>(header.size() >> 8);
  return out + header + data;
}

std::string safetensors_bytes(const std::string& json, const std::string& data) {
  std::string out(8, '\0');
  for (int i = 0; i < 8; ++i) out[i] = static_cast<char>(uint64_t(json.size()) >> (8 * i));
  return out + json + data;
}

// Asserts that `f` throws E with a message containing the path and `problem`.
template <typename E, typename F>
void expect_file_error(F&& f, const std::string& path, const std::string& problem) {
  try {
    f();
    ADD_FAILURE() << "no error; expected one about: " << problem;
  } catch (const E& e) {
    const std::string msg = e.what();
    EXPECT_NE(msg.find(path), std::string::npos) << msg;
    EXPECT_NE(msg.find(problem), std::string::npos) << msg;
  }
}

TEST(TensorFiles, NpyFloat32LoadsShapeAndValues) {
  const std::vector<float> v = {1.5f, -2.f, 3.25f, 0.f, 1e-3f, 7.f};
  const auto path = write_file("a.npy", npy_bytes("{'descr': '<f4', 'fortran_order': False, "
                                                  "'shape': (2, 3), }",
                                                  raw_bytes(v)));
  const Tensor t = load_npy(path);
  EXPECT_EQ(t.dtype(), DType::kF32);
  EXPECT_EQ(t.shape(), (Shape{2, 3}));
  const auto got = to_vector(t);
  for (size_t i = 0; i < v.size(); ++i) EXPECT_EQ(got[i], v[i]);
}

TEST(TensorFiles, NpyFloat64IsReadAsFloat32AndInt32AndScalarShapesWork) {
  const std::vector<double> d = {0.1, 2.5};
  const auto p64 = write_file("d.npy", npy_bytes("{'descr': '<f8', 'fortran_order': False, "
                                                 "'shape': (2,), }",
                                                 raw_bytes(d)));
  const Tensor t = load_npy(p64);
  EXPECT_EQ(t.dtype(), DType::kF32);
  EXPECT_FLOAT_EQ(t.data_as<float>()[0], 0.1f);
  const std::vector<int32_t> i = {42};
  const auto pi = write_file("i.npy", npy_bytes("{'descr': '<i4', 'fortran_order': False, "
                                                "'shape': (), }",
                                                raw_bytes(i)));
  const Tensor s = load_npy(pi);
  EXPECT_EQ(s.dtype(), DType::kI32);
  EXPECT_EQ(s.shape(), Shape{});
  EXPECT_EQ(s.data_as<int32_t>()[0], 42);
}

TEST(TensorFiles, SafetensorsBf16AndF32LoadByName) {
  const std::vector<uint16_t> bf = {float_to_bf16(1.f), float_to_bf16(-0.5f), float_to_bf16(3.f),
                                    float_to_bf16(4.f)};
  const std::vector<float> f = {9.f, 8.f};
  const std::string json =
      R"({"__metadata__":{"format":"pt"},"k":{"dtype":"BF16","shape":[2,2],"data_offsets":[0,8]},)"
      R"("v":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})";
  const auto path =
      write_file("m.safetensors", safetensors_bytes(json, raw_bytes(bf) + raw_bytes(f)));
  const auto infos = list_safetensors(path);
  ASSERT_EQ(infos.size(), 2u);
  EXPECT_EQ(infos[0].name, "k");
  EXPECT_EQ(infos[1].dtype, DType::kF32);
  const Tensor k = load_tensor(path + ":k");
  EXPECT_EQ(k.dtype(), DType::kBF16);
  EXPECT_EQ(k.shape(), (Shape{2, 2}));
  EXPECT_EQ(to_vector(k), (std::vector<double>{1, -0.5, 3, 4}));
  EXPECT_EQ(to_vector(load_safetensors(path, "v")), (std::vector<double>{9, 8}));
}

TEST(TensorFiles, WritersRoundTripEveryDtype) {
  auto rng = testing::make_rng();
  for (DType dt : {DType::kBF16, DType::kF16, DType::kF32}) {
    const Tensor t = testing::random_tensor({3, 1, 5}, dt, rng);
    const auto st = temp_path(std::string(dtype_name(dt)) + ".safetensors");
    save_safetensors(st, {{"x", t.view()}, {"y", t.view().select(0, 1)}});
    EXPECT_EQ(to_vector(load_safetensors(st, "x")), to_vector(t));
    EXPECT_EQ(to_vector(load_safetensors(st, "y")), to_vector(t.view().select(0, 1)));
    if (dt == DType::kBF16) {
      EXPECT_THROW(save_npy(temp_path("bf16.npy"), t), TypeError);
      continue;
    }
    const auto np = temp_path(std::string(dtype_name(dt)) + ".npy");
    save_npy(np, t);
    const Tensor back = load_tensor(np);
    EXPECT_EQ(back.dtype(), dt);
    EXPECT_EQ(to_vector(back), to_vector(t));
  }
  const Tensor ids = testing::int32_tensor({4}, {1, -1, 7, 3});
  const auto np = temp_path("ids.npy");
  save_npy(np, ids);
  EXPECT_EQ(to_vector(load_npy(np)), (std::vector<double>{1, -1, 7, 3}));
}

TEST(TensorFiles, MissingFileAndDirectory) {
  const std::string missing = temp_path("nope.npy");
  expect_file_error<ValueError>([&] { load_npy(missing); }, missing, "no such file");
  const std::string dir = temp_path("dir.safetensors");
  std::filesystem::create_directories(dir);
  expect_file_error<ValueError>([&] { list_safetensors(dir); }, dir, "not a regular file");
}

TEST(TensorFiles, MalformedNpyFiles) {
  const std::vector<float> six(6, 1.f);
  const std::string good_dict = "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }";
  struct Case {
    const char* name;
    std::string bytes;
    const char* problem;
  };
  std::string bad_version = npy_bytes(good_dict, raw_bytes(six));
  bad_version[6] = 9;
  const Case cases[] = {
      {"magic", "NOTNUMPYATALL" + raw_bytes(six), "bad magic"},
      {"short", "\x93NUM", "only 4 bytes"},
      {"version", bad_version, "version 9"},
      {"truncated_data", npy_bytes(good_dict, raw_bytes(std::vector<float>(5, 1.f))),
       "20 data bytes, but shape [2, 3] of <f4 needs 24"},
      {"fortran",
       npy_bytes("{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }", raw_bytes(six)),
       "Fortran-order"},
      {"no_shape", npy_bytes("{'descr': '<f4', 'fortran_order': False, }", raw_bytes(six)),
       "needs descr, fortran_order and shape"},
      {"shape_text",
       npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (2, x), }", raw_bytes(six)),
       "non-integer entry"},
      {"header_past_end", std::string("\x93NUMPY\x01\x00\xff\x7f", 10) + "{'descr'",
       "truncated: the header"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto path = write_file(std::string(c.name) + ".npy", c.bytes);
    expect_file_error<ValueError>([&] { load_npy(path); }, path, c.problem);
  }
  const auto be = write_file("be.npy", npy_bytes("{'descr': '>f4', 'fortran_order': False, "
                                                 "'shape': (2, 3), }",
                                                 raw_bytes(six)));
  expect_file_error<TypeError>([&] { load_npy(be); }, be, "'>f4' is not supported");
}

TEST(TensorFiles, MalformedSafetensorsFiles) {
  const std::string data = raw_bytes(std::vector<float>(4, 1.f));
  struct Case {
    const char* name;
    std::string bytes;
    const char* problem;
  };
  std::string huge_len = safetensors_bytes("{}", data);
  huge_len[7] = 0x10;
  const Case cases[] = {
      {"short", "abc", "shorter than the 8-byte header length"},
      {"huge_header", huge_len, "exceeds the"},
      {"json", safetensors_bytes("{\"x\": {", data), "invalid JSON"},
      {"not_object", safetensors_bytes("[1, 2]", data), "not a JSON object"},
      {"fields", safetensors_bytes(R"({"x":{"dtype":"F32","shape":[4]}})", data),
       "tensor \"x\" needs an object with dtype, shape and data_offsets"},
      {"negative_dim",
       safetensors_bytes(R"({"x":{"dtype":"F32","shape":[-4],"data_offsets":[0,16]}})", data),
       "not a non-negative integer"},
      {"outside",
       safetensors_bytes(R"({"x":{"dtype":"F32","shape":[8],"data_offsets":[0,32]}})", data),
       "outside the 16 data bytes"},
      {"byte_count",
       safetensors_bytes(R"({"x":{"dtype":"F32","shape":[3],"data_offsets":[0,16]}})", data),
       "has 16 data bytes but its shape [3] and dtype F32 need 12"},
      {"offsets",
       safetensors_bytes(R"({"x":{"dtype":"F32","shape":[4],"data_offsets":[16]}})", data),
       "needs data_offsets [begin, end]"},
  };
  for (const Case& c : cases) {
    SCOPED_TRACE(c.name);
    const auto path = write_file(std::string(c.name) + ".safetensors", c.bytes);
    expect_file_error<ValueError>([&] { list_safetensors(path); }, path, c.problem);
  }
  const auto i8 = write_file(
      "i8.safetensors",
      safetensors_bytes(R"({"x":{"dtype":"I8","shape":[16],"data_offsets":[0,16]}})", data));
  expect_file_error<TypeError>([&] { list_safetensors(i8); }, i8, "dtype I8");
}

// Truncations and random byte flips of good files: each load either succeeds or raises one of
// the library's errors; never a crash, a hang or an unbounded allocation.
TEST(TensorFiles, MutatedFilesRaiseErrorsNeverCrash) {
  auto rng = testing::make_rng();
  const std::vector<float> data(12, 0.5f);
  const std::string npy =
      npy_bytes("{'descr': '<f4', 'fortran_order': False, 'shape': (3, 4), }", raw_bytes(data));
  const std::string st = safetensors_bytes(
      R"({"a":{"dtype":"F32","shape":[3,4],"data_offsets":[0,48]}})", raw_bytes(data));
  int errors = 0, loads = 0;
  for (const auto& [good, ext] : {std::pair{npy, std::string(".npy")}, {st, ".safetensors"}}) {
    for (int trial = 0; trial < 300; ++trial) {
      std::string bytes = good;
      if (trial % 3 == 0) {
        bytes.resize(rng() % bytes.size());
      } else {
        for (int flips = 1 + int(rng() % 3); flips > 0; --flips)
          bytes[rng() % bytes.size()] = static_cast<char>(rng());
      }
      const auto path = write_file("mutant" + ext, bytes);
      try {
        const Tensor t = load_tensor(path);
        ++loads;
        EXPECT_LE(t.numel() * dtype_size(t.dtype()), bytes.size());
      } catch (const Error& e) {
        ++errors;
        EXPECT_NE(std::string(e.what()).find(path), std::string::npos) << e.what();
      }
    }
  }
  EXPECT_GT(errors, 100);
  EXPECT_GT(loads, 10);  // flips inside the data leave valid files
}

TEST(TensorFiles, SpecsNameTheProblem) {
  const std::string data = raw_bytes(std::vector<float>(4, 1.f));
  const auto two =
      write_file("two.safetensors",
                 safetensors_bytes(R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},)"
                                   R"("b":{"dtype":"F32","shape":[2],"data_offsets":[8,16]}})",
                                   data));
  expect_file_error<ValueError>([&] { load_tensor(two); }, two, "holds 2 tensors; name one");
  expect_file_error<ValueError>([&] { load_tensor(two + ":c"); }, two,
                                "no tensor named \"c\" (the file has: a, b)");
  expect_file_error<ValueError>([&] { load_tensor("x.pt"); }, "x.pt", "unknown tensor file format");
}

class WorkloadFilesTest : public ::testing::Test {
 protected:
  // Writes q [1, Lq, 4, 8], k/v [1, 16, 2, 8] (and indexer files) as safetensors.
  WorkloadFiles write(int64_t lq, int64_t k_heads, int64_t index_key_len, bool batch_axis = true) {
    auto rng = testing::make_rng();
    const auto shape = [&](Shape s) {
      if (!batch_axis) s.erase(s.begin());
      return s;
    };
    const Tensor q = testing::random_tensor(shape({1, lq, 4, 8}), DType::kBF16, rng);
    const Tensor k = testing::random_tensor(shape({1, 16, k_heads, 8}), DType::kBF16, rng);
    const Tensor v = testing::random_tensor(shape({1, 16, k_heads, 8}), DType::kBF16, rng);
    const Tensor qi = testing::random_tensor({1, lq, 2, 6}, DType::kBF16, rng);
    raw_index_key_ = testing::random_tensor({1, index_key_len, 6}, DType::kF32, rng);
    const auto path = temp_path("w.safetensors");
    save_safetensors(path, {{"q", q}, {"k", k}, {"v", v}, {"qi", qi}, {"ki", raw_index_key_}});
    return {path + ":q", path + ":k", path + ":v", path + ":qi", path + ":ki"};
  }
  Tensor raw_index_key_;
};

TEST_F(WorkloadFilesTest, LoadsAndCompressesRawIndexerKeys) {
  const Workload w = load_workload(write(16, 2, 16));
  EXPECT_EQ(w.options.seq_len, 16);
  EXPECT_EQ(w.options.num_kv_heads, 2);
  EXPECT_EQ(w.options.indexer_heads, 2);
  ASSERT_EQ(w.index_key.shape(), (Shape{1, 4, 6}));
  // Block 1 = mean of raw keys 4..7, divided by its RMS (computed here in double), then
  // rotated at position 4 on dims 0 and 1 (the first half, rounded down to even: a rotation
  // keeps the pair's norm); dims 2..5 are not rotated.
  const auto raw = to_vector(raw_index_key_);
  std::vector<double> mean(6, 0.0);
  for (int t = 4; t < 8; ++t)
    for (int d = 0; d < 6; ++d) mean[d] += raw[t * 6 + d] / 4;
  double ms = 0;
  for (double m : mean) ms += m * m / 6;
  const auto got = to_vector(w.index_key);
  for (int d = 2; d < 6; ++d)
    EXPECT_NEAR(got[6 + d], mean[d] / std::sqrt(ms),
                1e-2 * std::abs(mean[d] / std::sqrt(ms)) + 1e-3);
  const double pair = std::hypot(mean[0], mean[1]) / std::sqrt(ms);
  EXPECT_NEAR(std::hypot(got[6], got[7]), pair, 1e-2 * pair + 1e-3);
  EXPECT_GT(std::abs(got[6] - mean[0] / std::sqrt(ms)), 1e-3) << "dim 0 was not rotated";
}

TEST_F(WorkloadFilesTest, AcceptsCompressedKeysAndUnbatchedTensors) {
  const Workload w = load_workload(write(5, 1, 4, false));
  EXPECT_EQ(w.query.shape(), (Shape{1, 5, 4, 8}));
  EXPECT_EQ(w.index_key.shape(), (Shape{1, 4, 6}));
  EXPECT_EQ(w.query_position(0), 11);
}

TEST_F(WorkloadFilesTest, MismatchesNameTheFile) {
  auto files = write(16, 3, 16);
  expect_file_error<ValueError>([&] { load_workload(files); }, files.key, "KV heads (shape[2])");
  files = write(16, 2, 7);
  expect_file_error<ValueError>([&] { load_workload(files); }, files.index_key,
                                "must be the key length 16 (raw keys) or 4");
  files = write(17, 2, 16);
  expect_file_error<ValueError>([&] { load_workload(files); }, files.query,
                                "at most the key length");
  files = write(16, 2, 16);
  files.index_key.clear();
  EXPECT_THROW(load_workload(files), ValueError);
}

}  // namespace
}  // namespace sparse_attn

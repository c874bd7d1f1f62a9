#include "kvbridge/model/safetensors.h"

#include <gtest/gtest.h>

#include <cstring>
#include <fstream>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "model/numerics.h"
#include "model/test_util.h"

namespace kvbridge {
namespace {

using testing_model::TempDir;

std::string F32Bytes(std::initializer_list<float> v) {
  std::string s(v.size() * 4, '\0');
  size_t i = 0;
  for (float f : v) std::memcpy(s.data() + 4 * i++, &f, 4);
  return s;
}

std::string Bf16Bytes(std::initializer_list<float> v) {
  std::string s(v.size() * 2, '\0');
  size_t i = 0;
  for (float f : v) {
    const uint16_t h = model_internal::FloatToBf16(f);
    std::memcpy(s.data() + 2 * i++, &h, 2);
  }
  return s;
}

// A file from a raw header string and data bytes.
std::string RawFile(const std::string& header, const std::string& data) {
  std::string out;
  const uint64_t n = header.size();
  for (int i = 0; i < 8; ++i) out.push_back(static_cast<char>((n >> (8 * i)) & 0xff));
  return out + header + data;
}

void ExpectError(const std::string& bytes, StatusCode code, const std::string& part) {
  auto f = SafetensorsFile::Parse(bytes, "x.safetensors");
  ASSERT_FALSE(f.ok()) << "expected error containing: " << part;
  EXPECT_EQ(f.status().code(), code) << f.status().ToString();
  EXPECT_NE(f.status().message().find(part), std::string::npos) << f.status().ToString();
  EXPECT_EQ(f.status().message().rfind("x.safetensors", 0), 0u) << f.status().ToString();
}

TEST(Safetensors, WritesAndReadsBackEveryFloatDtype) {
  const uint16_t half_one = 0x3c00, half_m2 = 0xc000;
  std::string f16(4, '\0');
  std::memcpy(f16.data(), &half_one, 2);
  std::memcpy(f16.data() + 2, &half_m2, 2);
  double d[2] = {0.25, -8.0};
  std::vector<SafetensorsTensor> ts = {
      {"a", "F32", {2, 2}, F32Bytes({1.0f, -2.5f, 3.25f, 1e-3f})},
      {"b", "BF16", {3}, Bf16Bytes({1.0f, 0.5f, -4.0f})},
      {"c", "F16", {2}, f16},
      {"d", "F64", {2}, std::string(reinterpret_cast<const char*>(d), 16)},
      {"e", "I32", {1}, std::string(4, '\1')},
  };
  auto bytes = SerializeSafetensors(ts, {{"format", "pt"}});
  ASSERT_TRUE(bytes.ok()) << bytes.status().ToString();
  auto f = SafetensorsFile::Parse(*bytes, "m.safetensors");
  ASSERT_TRUE(f.ok()) << f.status().ToString();
  EXPECT_EQ(f->tensors().size(), 5u);
  EXPECT_EQ(f->metadata().at("format"), "pt");
  const int64_t s22[] = {2, 2};
  EXPECT_EQ(*f->ReadFloat32("a", s22), (std::vector<float>{1.0f, -2.5f, 3.25f, 1e-3f}));
  EXPECT_EQ(*f->ReadFloat32("b", {}), (std::vector<float>{1.0f, 0.5f, -4.0f}));
  EXPECT_EQ(*f->ReadFloat32("c", {}), (std::vector<float>{1.0f, -2.0f}));
  EXPECT_EQ(*f->ReadFloat32("d", {}), (std::vector<float>{0.25f, -8.0f}));
  EXPECT_EQ(f->Find("e")->shape, (std::vector<int64_t>{1}));
  // Header is padded to 8 bytes, as the reference writer does.
  uint64_t n;
  std::memcpy(&n, bytes->data(), 8);
  EXPECT_EQ(n % 8, 0u);
}

TEST(Safetensors, ReadErrorsNameFileTensorExpectedAndFound) {
  auto bytes = SerializeSafetensors(
      {{"w", "F32", {2, 3}, F32Bytes({1, 2, 3, 4, 5, 6})}, {"i", "I32", {1}, std::string(4, '\0')}},
      {});
  ASSERT_TRUE(bytes.ok());
  auto f = SafetensorsFile::Parse(*bytes, "/dir/model-00001.safetensors");
  ASSERT_TRUE(f.ok());
  const int64_t want[] = {3, 2};
  auto r = f->ReadFloat32("w", want);
  ASSERT_FALSE(r.ok());
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(r.status().message(),
            "model-00001.safetensors: tensor 'w': expected shape [3,2], found [2,3]");
  auto d = f->ReadFloat32("i", {});
  ASSERT_FALSE(d.ok());
  EXPECT_EQ(d.status().message(),
            "model-00001.safetensors: tensor 'i': expected dtype BF16, F16, F32 or F64, found I32");
  auto missing = f->ReadFloat32("nope", {});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("'nope'"), std::string::npos);
}

TEST(Safetensors, RejectsMalformedFiles) {
  const std::string ok_header = R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,8]}})";
  const std::string data8(8, '\0');
  ASSERT_TRUE(SafetensorsFile::Parse(RawFile(ok_header, data8), "x.safetensors").ok());

  ExpectError("", StatusCode::kDataLoss, "truncated");
  ExpectError("abc", StatusCode::kDataLoss, "truncated");
  // Header length beyond the file.
  ExpectError(RawFile(ok_header, data8).substr(0, 20), StatusCode::kDataLoss, "truncated");
  // Huge header length.
  ExpectError(std::string("\xff\xff\xff\xff\xff\xff\xff\xff", 8) + "{}",
              StatusCode::kInvalidArgument, "exceeds 100 MB");
  ExpectError(RawFile("{\"t\": [", data8), StatusCode::kInvalidArgument, "not valid JSON");
  ExpectError(RawFile("[]", ""), StatusCode::kInvalidArgument, "not a JSON object");
  ExpectError(RawFile(R"({"t":5})", ""), StatusCode::kInvalidArgument, "tensor 't': entry is not");
  ExpectError(RawFile(R"({"t":{"shape":[1],"data_offsets":[0,4]}})", data8),
              StatusCode::kInvalidArgument, "missing string 'dtype'");
  ExpectError(RawFile(R"({"t":{"dtype":"Q4","shape":[1],"data_offsets":[0,4]}})", data8),
              StatusCode::kInvalidArgument, "unknown dtype 'Q4'");
  ExpectError(RawFile(R"({"t":{"dtype":"F32","shape":[-1],"data_offsets":[0,4]}})", data8),
              StatusCode::kInvalidArgument, "negative dimension");
  ExpectError(RawFile(R"({"t":{"dtype":"F32","shape":[1.5],"data_offsets":[0,4]}})", data8),
              StatusCode::kInvalidArgument, "non-integer");
  ExpectError(RawFile(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0,16]}})", data8),
              StatusCode::kInvalidArgument, "outside the data section of 8 bytes");
  ExpectError(RawFile(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[8,4]}})", data8),
              StatusCode::kInvalidArgument, "outside the data section");
  ExpectError(RawFile(R"({"t":{"dtype":"F32","shape":[2],"data_offsets":[0]}})", data8),
              StatusCode::kInvalidArgument, "'data_offsets' must be two");
  ExpectError(RawFile(R"({"t":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", data8),
              StatusCode::kInvalidArgument,
              "shape [3] of F32 needs 12 bytes but data_offsets span 8");
  ExpectError(
      RawFile(
          R"({"t":{"dtype":"F32","shape":[4611686018427387904,4611686018427387904],"data_offsets":[0,8]}})",
          data8),
      StatusCode::kInvalidArgument, "needs too many bytes");
  ExpectError(
      RawFile(
          R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[1],"data_offsets":[4,8]}})",
          data8),
      StatusCode::kInvalidArgument, "overlap");
  ExpectError(RawFile(R"({"__metadata__":{"k":1}})", ""), StatusCode::kInvalidArgument,
              "__metadata__ value 'k'");
}

TEST(Safetensors, SerializeRejectsInconsistentTensors) {
  EXPECT_FALSE(SerializeSafetensors({{"a", "F32", {3}, std::string(8, '\0')}}, {}).ok());
  EXPECT_FALSE(
      SerializeSafetensors(
          {{"a", "F32", {1}, std::string(4, '\0')}, {"a", "F32", {1}, std::string(4, '\0')}}, {})
          .ok());
  EXPECT_FALSE(SerializeSafetensors({{"a", "X", {1}, std::string(4, '\0')}}, {}).ok());
}

void WriteText(const std::string& path, const std::string& text) {
  std::ofstream(path, std::ios::binary) << text;
}

TEST(TensorStore, ReadsShardsThroughTheIndex) {
  TempDir dir;
  ASSERT_TRUE(
      WriteSafetensors(dir.path() + "/s1.safetensors", {{"x", "F32", {2}, F32Bytes({1, 2})}}, {})
          .ok());
  ASSERT_TRUE(
      WriteSafetensors(dir.path() + "/s2.safetensors", {{"y", "BF16", {1}, Bf16Bytes({3})}}, {})
          .ok());
  WriteText(dir.path() + "/model.safetensors.index.json",
            R"({"metadata": {}, "weight_map": {"x": "s1.safetensors", "y": "s2.safetensors"}})");
  auto store = TensorStore::OpenDir(dir.path());
  ASSERT_TRUE(store.ok()) << store.status().ToString();
  EXPECT_EQ(store->Names(), (std::vector<std::string>{"x", "y"}));
  EXPECT_EQ(*store->ReadFloat32("y", {}), (std::vector<float>{3.0f}));
  const int64_t bad[] = {5};
  auto r = store->ReadFloat32("x", bad);
  EXPECT_EQ(r.status().message(), "s1.safetensors: tensor 'x': expected shape [5], found [2]");
  auto missing = store->ReadFloat32("z", {});
  EXPECT_EQ(missing.status().code(), StatusCode::kNotFound);
  EXPECT_NE(missing.status().message().find("s1.safetensors, s2.safetensors"), std::string::npos);
}

TEST(TensorStore, RejectsBadIndexes) {
  TempDir dir;
  ASSERT_TRUE(
      WriteSafetensors(dir.path() + "/s1.safetensors", {{"x", "F32", {2}, F32Bytes({1, 2})}}, {})
          .ok());
  const std::string index = dir.path() + "/model.safetensors.index.json";
  WriteText(index, R"({"weight_map": {"x": "../s1.safetensors"}})");
  EXPECT_NE(TensorStore::OpenDir(dir.path()).status().message().find("plain file name"),
            std::string::npos);
  WriteText(index, R"({"weight_map": {"q": "s1.safetensors"}})");
  EXPECT_NE(TensorStore::OpenDir(dir.path()).status().message().find("does not hold it"),
            std::string::npos);
  WriteText(index, R"({"weight_map": {"x": "missing.safetensors"}})");
  EXPECT_EQ(TensorStore::OpenDir(dir.path()).status().code(), StatusCode::kNotFound);
  WriteText(index, R"({"nothing": 1})");
  EXPECT_NE(TensorStore::OpenDir(dir.path()).status().message().find("weight_map"),
            std::string::npos);
  WriteText(index, "{");
  EXPECT_EQ(TensorStore::OpenDir(dir.path()).status().code(), StatusCode::kInvalidArgument);
}

// A weightless model (a preset a GPU engine generates on the device): the preset's config and
// byte tokenizer, a fingerprint that depends on config and seed only, no weights, and a Forward
// that refuses with the reason (issue 18: `serve qwen2.5-7b --device cuda` without a directory).
TEST(ModelWeightless, ConfigTokenizerAndFingerprintWithoutWeights) {
  auto spec = RandomModelPreset("qwen2.5-7b", 0);
  ASSERT_TRUE(spec.ok()) << spec.status().ToString();
  auto m = Model::CreateWeightless(*spec);
  ASSERT_TRUE(m.ok()) << m.status().ToString();
  const Model& model = **m;
  ASSERT_NE(model.weightless_spec(), nullptr);
  EXPECT_EQ(model.weightless_spec()->seed, 0u);
  EXPECT_EQ(model.config().hidden_size, 3584);
  EXPECT_EQ(model.config().num_hidden_layers, 28);
  EXPECT_EQ(model.config().vocab_size, 152064);
  EXPECT_EQ(model.tokenizer().vocab_size(), 152064);
  EXPECT_EQ(model.tokenizer().eos_id(), 151645);
  EXPECT_EQ(model.weight_bytes(), 0u);
  EXPECT_EQ(model.weight_types(), "none");
  EXPECT_EQ(model.fingerprint().size(), 32u);
  // Same preset and seed: same fingerprint; another seed or preset: another.
  auto again = Model::CreateWeightless(*spec);
  ASSERT_TRUE(again.ok());
  EXPECT_EQ((*again)->fingerprint(), model.fingerprint());
  auto seeded = RandomModelPreset("qwen2.5-7b", 1);
  ASSERT_TRUE(seeded.ok());
  EXPECT_NE((*Model::CreateWeightless(*seeded))->fingerprint(), model.fingerprint());
  auto small = RandomModelPreset("small", 0);
  ASSERT_TRUE(small.ok());
  EXPECT_NE((*Model::CreateWeightless(*small))->fingerprint(), model.fingerprint());
  // The KV layout follows the config (what a GPU engine's pool and the transfer agent use).
  const PagedKvLayout l = model.KvLayout(8, 16, KvDtype::kFp8E4M3);
  EXPECT_EQ(l.num_layers, 28);
  EXPECT_EQ(l.num_kv_heads, 4);
  EXPECT_EQ(l.head_dim, 128);
  LocalKvCache kv(model.KvLayout(1, 16, KvDtype::kBf16), std::vector<float>(28, 1.0f),
                  std::vector<float>(28, 1.0f));
  std::vector<int32_t> ids = {1, 2, 3};
  std::vector<int32_t> table = {0};
  ForwardBatch batch;
  batch.sequences.push_back({ids.data(), 3, 0, table.data(), 1, true});
  std::vector<float> logits;
  const Status st = model.Forward(batch, kv.view(), &logits);
  EXPECT_EQ(st.code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(st.message().find("weightless"), std::string::npos) << st.ToString();
}

// Model::Load surfaces the parser's errors with the directory, file, tensor and shapes.
TEST(ModelLoad, NamesFileTensorAndShapeOfAMismatchedWeight) {
  TempDir dir;
  auto spec = RandomModelPreset("tiny", ModelArch::kLlama, 1);
  ASSERT_TRUE(spec.ok());
  ASSERT_TRUE(WriteRandomModel(*spec, dir.path()).ok());
  // Rewrite the file with one tensor of the wrong shape and one missing.
  auto f = SafetensorsFile::Open(dir.path() + "/model.safetensors");
  ASSERT_TRUE(f.ok());
  std::vector<SafetensorsTensor> ts;
  for (const auto& t : f->tensors()) {
    SafetensorsTensor out{t.name, t.dtype, t.shape, std::string(f->Data(t))};
    if (t.name == "model.layers.1.self_attn.k_proj.weight") out.shape = {16, 128};
    ts.push_back(out);
  }
  ASSERT_TRUE(WriteSafetensors(dir.path() + "/model.safetensors", ts, {}).ok());
  auto m = Model::Load(dir.path());
  ASSERT_FALSE(m.ok());
  EXPECT_EQ(m.status().message(), dir.path() +
                                      ": model.safetensors: tensor "
                                      "'model.layers.1.self_attn.k_proj.weight': expected shape "
                                      "[32,64], found [16,128]");
  ts.erase(ts.begin());  // drop one tensor entirely
  for (auto& t : ts) {
    if (t.name == "model.layers.1.self_attn.k_proj.weight") t.shape = {32, 64};
  }
  ASSERT_TRUE(WriteSafetensors(dir.path() + "/model.safetensors", ts, {}).ok());
  auto m2 = Model::Load(dir.path());
  ASSERT_FALSE(m2.ok());
  EXPECT_EQ(m2.status().code(), StatusCode::kNotFound);
  EXPECT_NE(m2.status().message().find("not found in model.safetensors"), std::string::npos)
      << m2.status().ToString();
  // A truncated file.
  std::string bytes;
  {
    std::ifstream in(dir.path() + "/model.safetensors", std::ios::binary);
    bytes.assign(std::istreambuf_iterator<char>(in), {});
  }
  WriteText(dir.path() + "/model.safetensors", bytes.substr(0, bytes.size() / 2));
  auto m3 = Model::Load(dir.path());
  ASSERT_FALSE(m3.ok());
  EXPECT_NE(m3.status().message().find("model.safetensors"), std::string::npos);
  EXPECT_NE(m3.status().message().find("outside the data section"), std::string::npos)
      << m3.status().ToString();
}

}  // namespace
}  // namespace kvbridge

#include "kvbridge/transfer/metadata.h"

#include <gtest/gtest.h>

namespace kvbridge::transfer {
namespace {

AgentMetadata Sample() {
  AgentMetadata m;
  m.agent_name = "p0/r1";
  m.incarnation = 0xfeedfacecafebeefULL;
  m.host_id = "boot/net:[1]";
  m.endpoints = {{"tcp", "127.0.0.1:5000"}, {"shm", "@x"}};
  m.tp_size = 2;
  m.tp_rank = 1;
  m.head_begin = 4;
  m.head_count = 4;
  m.layout = {3, 4, 64, 16, 100, KvDtype::kFp8E4M3};
  m.layer_base = {1, 2, 3};
  m.layer_bytes.assign(3, m.layout.LayerBytes());
  m.k_scale = {0.5f, 1.0f, 2.0f};
  m.v_scale = {1.0f, 1.0f, 0.25f};
  m.model_fingerprint = "abc123";
  m.backend_blobs = {{"ucx", "00ff"}};
  m.compat_hash = ComputeCompatHash(m);
  return m;
}

TEST(Metadata, EncodeDecodeRoundTrip) {
  AgentMetadata m = Sample();
  auto d = DecodeMetadata(EncodeMetadata(m));
  ASSERT_TRUE(d.ok()) << d.status().ToString();
  EXPECT_EQ(d->agent_name, m.agent_name);
  EXPECT_EQ(d->incarnation, m.incarnation);
  EXPECT_EQ(d->endpoints, m.endpoints);
  EXPECT_EQ(d->layout.dtype, KvDtype::kFp8E4M3);
  EXPECT_EQ(d->layout.num_blocks, 100);
  EXPECT_EQ(d->layer_bytes, m.layer_bytes);
  EXPECT_EQ(d->k_scale, m.k_scale);
  EXPECT_EQ(d->v_scale, m.v_scale);
  EXPECT_EQ(d->head_begin, 4);
  EXPECT_EQ(d->backend_blobs, m.backend_blobs);
  EXPECT_EQ(d->compat_hash, m.compat_hash);
}

TEST(Metadata, DecodeRejectsMalformedAndTampered) {
  EXPECT_FALSE(DecodeMetadata("").ok());
  EXPECT_FALSE(DecodeMetadata("[1,2]").ok());
  EXPECT_FALSE(DecodeMetadata("{\"version\":1}").ok());
  AgentMetadata m = Sample();
  m.layout.head_dim = 128;  // without recomputing the hash
  auto d = DecodeMetadata(EncodeMetadata(m));
  ASSERT_FALSE(d.ok());
  EXPECT_NE(d.status().message().find("compat_hash"), std::string::npos);
  m = Sample();
  m.layer_base.pop_back();
  EXPECT_FALSE(DecodeMetadata(EncodeMetadata(m)).ok());
  std::string text = EncodeMetadata(Sample());
  text.replace(text.find("\"fp8\""), 5, "\"fp7\"");
  EXPECT_NE(DecodeMetadata(text).status().message().find("dtype"), std::string::npos);
}

TEST(Metadata, CompatibilityNamesTheMismatchedField) {
  AgentMetadata a = Sample(), b = Sample();
  b.agent_name = "d0/r0";
  EXPECT_TRUE(CheckCompatible(a, b).ok());
  b.layout.num_kv_heads = 8;  // heterogeneous TP is allowed
  b.layer_bytes.assign(3, b.layout.LayerBytes());
  EXPECT_TRUE(CheckCompatible(a, b).ok());
  AgentMetadata c = b;
  c.version = 2;
  EXPECT_EQ(CheckCompatible(a, c).message(), "peer metadata mismatch: version (local 1, peer 2)");
  c = b;
  c.layout.block_size = 32;
  EXPECT_EQ(CheckCompatible(a, c).message(),
            "peer metadata mismatch: block_size (local 16, peer 32)");
  c = b;
  c.layout.num_layers = 4;
  EXPECT_EQ(CheckCompatible(a, c).code(), StatusCode::kFailedPrecondition);
  c = b;
  c.model_fingerprint = "zzz";
  EXPECT_EQ(CheckCompatible(a, c).message(),
            "peer metadata mismatch: model_fingerprint (local abc123, peer zzz)");
  c = b;
  c.memory_kind = MemoryKind::kCuda;
  EXPECT_NE(CheckCompatible(a, c).message().find("memory_kind"), std::string::npos);
  c = b;
  c.agent_name = a.agent_name;
  EXPECT_FALSE(CheckCompatible(a, c).ok());
}

}  // namespace
}  // namespace kvbridge::transfer

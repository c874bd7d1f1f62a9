#include "transfer/wire.h"

#include <gtest/gtest.h>

#include <cstdio>

#include "transfer/auth.h"

namespace kvbridge::transfer::wire {
namespace {

TEST(Wire, FrameHeaderRoundTripAndRejectsGarbage) {
  FrameHeader h;
  h.type = FrameType::kWriteReq;
  h.status = 9;
  h.request_id = 0x1122334455667788ULL;
  h.meta_len = 77;
  h.payload_len = 1ULL << 33;
  uint8_t buf[kFrameHeaderBytes];
  EncodeFrameHeader(h, buf);
  auto d = DecodeFrameHeader(buf, sizeof(buf));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->type, FrameType::kWriteReq);
  EXPECT_EQ(d->status, 9);
  EXPECT_EQ(d->request_id, h.request_id);
  EXPECT_EQ(d->meta_len, 77u);
  EXPECT_EQ(d->payload_len, 1ULL << 33);
  EXPECT_FALSE(DecodeFrameHeader(buf, 31).ok());
  uint8_t bad[kFrameHeaderBytes];
  std::memcpy(bad, buf, sizeof(buf));
  bad[0] ^= 1;
  EXPECT_EQ(DecodeFrameHeader(bad, sizeof(bad)).status().message(), "bad frame magic");
  std::memcpy(bad, buf, sizeof(buf));
  bad[5] = 99;
  EXPECT_FALSE(DecodeFrameHeader(bad, sizeof(bad)).ok());
  h.meta_len = kMaxMetaBytes + 1;
  EncodeFrameHeader(h, bad);
  EXPECT_FALSE(DecodeFrameHeader(bad, sizeof(bad)).ok());
}

TEST(Wire, DataRequestRoundTripAndValidation) {
  std::vector<Segment> segs = {{nullptr, 1, 4096, 1024}, {nullptr, 0, 0, 3072}};
  Writer w;
  EncodeDataRequest("tx-7", segs.data(), segs.size(), w);
  auto r = DecodeDataRequest(w.buf());
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(r->transfer_id, "tx-7");
  ASSERT_EQ(r->segments.size(), 2u);
  EXPECT_EQ(r->segments[0].layer, 1u);
  EXPECT_EQ(r->segments[0].offset, 4096u);
  EXPECT_EQ(r->total_bytes, 4096u);

  KvRegistration reg;
  reg.layout.num_layers = 2;
  reg.layout.num_kv_heads = 1;
  reg.layout.head_dim = 16;
  reg.layout.block_size = 16;  // 1024 B per half, 2048 B per block
  reg.layout.num_blocks = 4;
  reg.layers.resize(2);
  std::vector<int> blocks;
  ASSERT_TRUE(ValidateSegments(*r, reg, &blocks).ok());
  EXPECT_EQ(blocks, (std::vector<int>{0, 1, 2}));
  DataRequest bad = *r;
  bad.segments[0].offset = 8192 - 1023;  // one byte past the 8 KiB layer
  EXPECT_EQ(ValidateSegments(bad, reg, &blocks).code(), StatusCode::kInvalidArgument);
  bad.segments[0] = {2, 0, 1};
  EXPECT_EQ(ValidateSegments(bad, reg, &blocks).code(), StatusCode::kInvalidArgument);
  bad.segments[0] = {0, ~0ULL - 10, 100};  // overflow attempt
  EXPECT_EQ(ValidateSegments(bad, reg, &blocks).code(), StatusCode::kInvalidArgument);

  std::string truncated = w.buf().substr(0, w.buf().size() - 1);
  EXPECT_FALSE(DecodeDataRequest(truncated).ok());
  Writer z;
  EncodeDataRequest("t", segs.data(), 0, z);
  z.U32(1);  // trailing bytes that are not a whole segment
  EXPECT_FALSE(DecodeDataRequest(z.buf()).ok());
  std::vector<Segment> empty = {{nullptr, 0, 0, 0}};
  Writer e;
  EncodeDataRequest("t", empty.data(), 1, e);
  EXPECT_FALSE(DecodeDataRequest(e.buf()).ok());
}

TEST(Wire, AgentMessageRoundTripAndRejectsGarbage) {
  AgentMessage m{MessageKind::kNotify, 42, true, "tx", std::string("a\0b", 3)};
  auto d = DecodeAgentMessage(EncodeAgentMessage(m));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->id, 42u);
  EXPECT_TRUE(d->wants_reply);
  EXPECT_EQ(d->transfer_id, "tx");
  EXPECT_EQ(d->payload, std::string("a\0b", 3));
  std::string enc = EncodeAgentMessage(m);
  EXPECT_FALSE(DecodeAgentMessage(enc.substr(0, enc.size() - 1)).ok());
  EXPECT_FALSE(DecodeAgentMessage(enc + "x").ok());
  enc[0] = 3;
  EXPECT_FALSE(DecodeAgentMessage(enc).ok());
  EXPECT_FALSE(DecodeAgentMessage("").ok());
}

TEST(Wire, HelloRoundTrip) {
  Hello h{"agent", 5, 6, 2};
  auto d = DecodeHello(EncodeHello(h));
  ASSERT_TRUE(d.ok());
  EXPECT_EQ(d->agent_name, "agent");
  EXPECT_EQ(d->expect_incarnation, 6u);
  EXPECT_EQ(d->connection_index, 2u);
  EXPECT_FALSE(DecodeHello(EncodeHello(Hello{"", 1, 2, 0})).ok());
}

// The handshake proof is HMAC-SHA256(token, context || nonce): RFC 4231 test case 2 (key
// "Jefe", data "what do ya want for nothing?"), split into context and nonce.
TEST(HandshakeAuth, ProofIsHmacSha256OfContextAndNonce) {
  auto hex = [](const std::string& b) {
    std::string out;
    char buf[3];
    for (unsigned char c : b) {
      std::snprintf(buf, sizeof(buf), "%02x", c);
      out += buf;
    }
    return out;
  };
  const std::string p = auth::Proof("Jefe", "what do ya want ", "for nothing?");
  EXPECT_EQ(hex(p), "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  EXPECT_TRUE(auth::ProofMatches("Jefe", "what do ya want ", "for nothing?", p));
  EXPECT_FALSE(auth::ProofMatches("Jeff", "what do ya want ", "for nothing?", p));
  EXPECT_FALSE(auth::ProofMatches("Jefe", "what do ya want ", "for nothing!", p));
  EXPECT_FALSE(auth::ProofMatches("Jefe", "what do ya want ", "for nothing?", ""));
  EXPECT_FALSE(auth::ProofMatches("Jefe", "what do ya want ", "for nothing?", p.substr(1)));
  EXPECT_EQ(auth::HandshakeContext("tcp", 0xabcULL, "d/rank0"),
            "kvbridge-tcp-v1|0000000000000abc|d/rank0");
  EXPECT_EQ(auth::ServerContext("tcp", 0xabcULL, "d/rank0"),
            "kvbridge-tcp-v1-server|0000000000000abc|d/rank0");
  // The challenge answer: empty (no token) or proof || client nonce, nothing else.
  EXPECT_TRUE(auth::DecodeChallengeAnswer("").ok());
  EXPECT_TRUE(auth::DecodeChallengeAnswer("").value().proof.empty());
  auto ans = auth::DecodeChallengeAnswer(std::string(32, 'p') + std::string(32, 'n'));
  ASSERT_TRUE(ans.ok());
  EXPECT_EQ(ans->proof, std::string(32, 'p'));
  EXPECT_EQ(ans->client_nonce, std::string(32, 'n'));
  EXPECT_FALSE(auth::DecodeChallengeAnswer(std::string(32, 'p')).ok());
  EXPECT_FALSE(auth::DecodeChallengeAnswer(std::string(65, 'p')).ok());
  auto n1 = auth::RandomNonce(), n2 = auth::RandomNonce();
  ASSERT_TRUE(n1.ok() && n2.ok());
  EXPECT_EQ(n1->size(), auth::kNonceBytes);
  EXPECT_NE(*n1, *n2);
}

}  // namespace
}  // namespace kvbridge::transfer::wire

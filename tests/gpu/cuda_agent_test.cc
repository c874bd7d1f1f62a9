// The transfer agent with its KV cache in CUDA device memory (MemoryKind::kCuda) and the cuda_ipc
// backend: this test process (initiator) and a cuda_agent_peer process (target), each a
// TransferAgent over one cudaMalloc pool. The GPUs come from the environment, so the same suite
// runs on one GPU and across two (issue 12: prefill pool on GPU 0, decode pool on GPU 1):
//   KVB_GPU_LOCAL (this process, default 0), KVB_GPU_PEER (the peer, default 0).
// Every GPU test skips with a printed reason where no CUDA device is usable (CI).
//
// Checked, through the agent API only: registration exports the pool and the peer imports it;
// READ over all layers and WRITE of one layer land exactly (every byte compared, untouched blocks
// still poisoned); adjacent blocks coalesce; a WRITE's notification reaches the peer only after
// its data (the peer verifies on arrival); the READ notification's reply path; out-of-range
// blocks are refused before anything moves; metadata mismatches are refused naming the field;
// 1000 concurrent transfers; a killed peer fails later posts promptly with Unavailable; a host
// pointer registered as device memory is refused.
#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <future>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/transfer/agent.h"
#include "kvbridge/transfer/metadata.h"
#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/peer_link.h"

namespace kvbridge::transfer {
namespace {

using cuda_ipc::Message;
using cuda_ipc::MsgType;
constexpr auto kStart = static_cast<MsgType>(30);

// 4 layers x 512 blocks x 16 KiB (fp32, 8 KV heads x 16 tokens x 16 dims x 2) = 32 MiB a side.
PagedKvLayout Layout() {
  PagedKvLayout l;
  l.num_layers = 4;
  l.num_kv_heads = 8;
  l.head_dim = 16;
  l.block_size = 16;
  l.num_blocks = 512;
  l.dtype = KvDtype::kFp32;
  return l;
}

int EnvInt(const char* name, int dflt) {
  const char* v = std::getenv(name);
  return v != nullptr && *v ? std::atoi(v) : dflt;
}

std::string PeerBinary() {
  if (const char* env = std::getenv("KVBRIDGE_CUDA_AGENT_PEER"); env != nullptr && *env) return env;
  char buf[4096];
  ssize_t n = ::readlink("/proc/self/exe", buf, sizeof(buf) - 1);
  std::string dir = n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("./x");
  dir = dir.substr(0, dir.rfind('/'));
  for (const std::string& p : {dir + "/cuda_agent_peer", dir + "/../bin/cuda_agent_peer"}) {
    if (::access(p.c_str(), X_OK) == 0) return p;
  }
  return dir + "/cuda_agent_peer";
}

class CudaAgentTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<int> n = cuda_ipc::CudaDeviceCount();
    if (!n.ok()) GTEST_SKIP() << "skipped: " << n.status().message();
    local_dev_ = EnvInt("KVB_GPU_LOCAL", 0);
    peer_dev_ = EnvInt("KVB_GPU_PEER", 0);
    if (std::max(local_dev_, peer_dev_) >= *n) {
      GTEST_SKIP() << "skipped: GPUs " << local_dev_ << " and " << peer_dev_ << " asked, " << *n
                   << " present";
    }
    layout_ = Layout();
    auto p = cuda_ipc::SpawnPeer(PeerBinary(), peer_dev_);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    peer_ = std::move(*p);
    std::ostringstream start;
    start << "target " << layout_.num_layers << " " << layout_.num_kv_heads << " "
          << layout_.head_dim << " " << layout_.block_size << " " << layout_.num_blocks
          << " model-A";
    if (!peer_token_.empty()) start << " " << peer_token_;
    Message ep = Call(kStart, start.str());
    ASSERT_EQ(ep.type, MsgType::kEndpoint) << ep.payload;
    auto meta = DecodeMetadata(ep.payload);
    ASSERT_TRUE(meta.ok()) << meta.status().ToString();
    peer_meta_ = *meta;
    EXPECT_EQ(peer_meta_.memory_kind, MemoryKind::kCuda);
    EXPECT_EQ(peer_meta_.endpoints.size(), 1u);
    EXPECT_EQ(peer_meta_.endpoints.count("cuda_ipc"), 1u);

    auto pool = cuda_ipc::DevicePool::Create(local_dev_, Bytes());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    pool_ = std::move(*pool);
    ASSERT_EQ(cudaSetDevice(local_dev_), cudaSuccess);
    ASSERT_EQ(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking), cudaSuccess);
    AgentConfig cfg;
    cfg.name = "initiator";
    cfg.backends = {"cuda_ipc"};
    cfg.force_backend = "cuda_ipc";
    cfg.model_fingerprint = "model-A";
    cfg.peer_timeout_ms = 2000;
    cfg.reply_timeout_ms = 5000;
    cfg.cluster_token = peer_token_;
    auto a = TransferAgent::Create(cfg);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    agent_ = std::move(*a);
    Status st = agent_->RegisterMemory(
        KvRegistration::FromDeviceMemory(layout_, pool_->data(), local_dev_));
    ASSERT_TRUE(st.ok()) << st.ToString();
    auto mine = agent_->Metadata();
    ASSERT_TRUE(mine.ok());
    EXPECT_EQ(mine->memory_kind, MemoryKind::kCuda);
    EXPECT_EQ(mine->layer_base[1],
              reinterpret_cast<uint64_t>(pool_->data()) + layout_.LayerBytes());
  }
  void TearDown() override {
    agent_.reset();
    if (stream_) cudaStreamDestroy(stream_);
    if (peer_.pid > 0 && peer_.channel && peer_.channel->PeerAlive()) {
      EXPECT_TRUE(peer_.Stop(10000).ok());
    }
  }

  uint64_t Bytes() const { return layout_.LayerBytes() * layout_.num_layers; }
  uint64_t Units() const { return uint64_t(layout_.num_layers) * layout_.num_blocks; }
  int32_t Unit(int layer, int block) const { return layer * layout_.num_blocks + block; }

  Message Call(MsgType t, std::string_view payload) {
    Status st = peer_.channel->Send(t, payload);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) return {MsgType::kError, st.ToString()};
    auto m = peer_.channel->Recv(60000);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    return m.ok() ? *m : Message{MsgType::kError, m.status().ToString()};
  }
  static std::string U64(uint64_t v) { return cuda_ipc::EncodeU64s(std::vector<uint64_t>{v}); }

  void Connect() {
    auto added = agent_->AddPeer(peer_meta_);
    ASSERT_TRUE(added.ok()) << added.status().ToString();
    ASSERT_EQ(*added, "cuda_ipc");
  }
  // Source side filled with src_seed, destination side poisoned.
  void Prime(TransferOp op, uint64_t src_seed, uint64_t poison) {
    const bool read = op == TransferOp::kRead;
    ASSERT_EQ(Call(MsgType::kFill, U64(read ? src_seed : poison)).type, MsgType::kOk);
    ASSERT_TRUE(
        cuda_ipc::FillPattern(pool_->data(), Bytes(), read ? poison : src_seed, stream_).ok());
    ASSERT_EQ(cudaStreamSynchronize(stream_), cudaSuccess);
  }
  cuda_ipc::VerifySpec Spec(const std::vector<int32_t>& src_of, uint64_t src_seed,
                            uint64_t poison) const {
    return {src_seed, poison, layout_.BlockBytes(), src_of};
  }
  // Mismatched 8-byte words on the destination side (READ: here; WRITE: at the peer).
  uint64_t Mismatches(TransferOp op, const std::vector<int32_t>& src_of, uint64_t src_seed,
                      uint64_t poison) {
    if (op == TransferOp::kRead) {
      auto r = cuda_ipc::VerifyBlocks({pool_->data(), layout_.BlockBytes(), Units()}, src_of,
                                      src_seed, poison, stream_);
      return r.ok() ? *r : ~uint64_t{0};
    }
    Message m = Call(MsgType::kVerify, Spec(src_of, src_seed, poison).Encode());
    auto v = cuda_ipc::DecodeU64s(m.payload);
    return v.ok() && v->size() == 1 ? (*v)[0] : ~uint64_t{0};
  }
  // What each destination unit must hold after `pairs` over `layers`.
  std::vector<int32_t> Expected(TransferOp op, const std::vector<BlockPair>& pairs,
                                int layer = -1) const {
    std::vector<int32_t> src_of(Units(), -1);
    for (int l = 0; l < layout_.num_layers; ++l) {
      if (layer >= 0 && l != layer) continue;
      for (const BlockPair& p : pairs) {
        if (op == TransferOp::kRead)
          src_of[Unit(l, p.local)] = Unit(l, p.remote);
        else
          src_of[Unit(l, p.remote)] = Unit(l, p.local);
      }
    }
    return src_of;
  }
  std::vector<BlockPair> Scattered(int n, uint32_t seed) const {
    std::vector<int> a(layout_.num_blocks), b(layout_.num_blocks);
    std::iota(a.begin(), a.end(), 0);
    std::iota(b.begin(), b.end(), 0);
    std::mt19937 rng(seed);
    std::shuffle(a.begin(), a.end(), rng);
    std::shuffle(b.begin(), b.end(), rng);
    std::vector<BlockPair> pairs;
    for (int i = 0; i < n; ++i) pairs.push_back({a[i], b[i]});
    return pairs;
  }
  TransferHandle PostOk(const TransferSpec& spec, PostOptions opt = {}) {
    auto p = agent_->Prepare(spec);
    EXPECT_TRUE(p.ok()) << p.status().ToString();
    if (!p.ok()) return {};
    auto h = agent_->Post(*p, std::move(opt));
    EXPECT_TRUE(h.ok()) << h.status().ToString();
    return h.ok() ? *h : TransferHandle{};
  }
  std::string PeerNotes(size_t want_lines) {
    std::string got;
    for (int i = 0; i < 1000; ++i) {
      got = Call(MsgType::kMessages, {}).payload;
      if (static_cast<size_t>(std::count(got.begin(), got.end(), '\n')) >= want_lines) break;
      std::this_thread::sleep_for(std::chrono::milliseconds(2));
    }
    return got;
  }

  int local_dev_ = 0, peer_dev_ = 0;
  std::string peer_token_;  ///< The peer's and the initiator's cluster token ("" = none).
  PagedKvLayout layout_;
  cuda_ipc::PeerProcess peer_;
  AgentMetadata peer_meta_;
  std::unique_ptr<cuda_ipc::DevicePool> pool_;
  cudaStream_t stream_ = nullptr;
  std::unique_ptr<TransferAgent> agent_;
};

// Issue 22: the cuda_ipc handshake proves the cluster token both ways before the serving agent
// sends its IPC handles. The peer runs with a token: an initiator without one or with another is
// refused (Unauthenticated, counted on both sides) and nothing can move; the fixture's
// initiator, holding the same token, connects and reads every byte.
class CudaAgentTokenTest : public CudaAgentTest {
 protected:
  void SetUp() override {
    peer_token_ = "gpu-s3cret";
    CudaAgentTest::SetUp();
  }
};

TEST_F(CudaAgentTokenTest, TokenlessAndWrongTokenInitiatorsAreRefused) {
  for (const std::string token : {"", "another-token"}) {
    auto pool = cuda_ipc::DevicePool::Create(local_dev_, Bytes());
    ASSERT_TRUE(pool.ok()) << pool.status().ToString();
    AgentConfig cfg;
    cfg.name = "stranger";
    cfg.backends = {"cuda_ipc"};
    cfg.force_backend = "cuda_ipc";
    cfg.model_fingerprint = "model-A";
    cfg.peer_timeout_ms = 2000;
    cfg.cluster_token = token;
    auto a = TransferAgent::Create(cfg);
    ASSERT_TRUE(a.ok()) << a.status().ToString();
    ASSERT_TRUE(
        (*a)->RegisterMemory(KvRegistration::FromDeviceMemory(layout_, (*pool)->data(), local_dev_))
            .ok());
    auto added = (*a)->AddPeer(peer_meta_);
    ASSERT_FALSE(added.ok()) << "token '" << token << "' was accepted";
    EXPECT_EQ(added.status().code(), StatusCode::kUnauthenticated) << added.status().ToString();
    EXPECT_NE(
        added.status().message().find(token.empty() ? "the peer has none" : "wrong cluster token"),
        std::string::npos)
        << added.status().ToString();
    EXPECT_EQ((*a)->HandshakeRefusalCounts().servers, 1);
    EXPECT_FALSE((*a)->Prepare({TransferOp::kRead, "target", {{1, 2}}}).ok());
  }
  Connect();
  const auto pairs = Scattered(16, 3);
  Prime(TransferOp::kRead, 21, 22);
  TransferHandle h = PostOk({TransferOp::kRead, "target", pairs});
  ASSERT_TRUE(h.Wait(30000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  EXPECT_EQ(Mismatches(TransferOp::kRead, Expected(TransferOp::kRead, pairs), 21, 22), 0u);
  EXPECT_EQ(agent_->HandshakeRefusalCounts().servers, 0);
}

TEST_F(CudaAgentTest, ReadScatteredBlocksAllLayersEveryByte) {
  Connect();
  const auto pairs = Scattered(200, 1);  // 200 x 4 layers = 800 segments: uploaded list
  Prime(TransferOp::kRead, 11, 12);
  TransferHandle h = PostOk({TransferOp::kRead, "target", pairs});
  ASSERT_TRUE(h.Wait(30000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  EXPECT_EQ(Mismatches(TransferOp::kRead, Expected(TransferOp::kRead, pairs), 11, 12), 0u);
}

TEST_F(CudaAgentTest, WriteOneLayerEveryByte) {
  Connect();
  const auto pairs = Scattered(37, 2);  // inline list (<= 128 units)
  Prime(TransferOp::kWrite, 21, 22);
  TransferSpec spec{TransferOp::kWrite, "target", pairs};
  spec.layer = 2;
  TransferHandle h = PostOk(spec);
  ASSERT_TRUE(h.Wait(30000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  EXPECT_EQ(Mismatches(TransferOp::kWrite, Expected(TransferOp::kWrite, pairs, 2), 21, 22), 0u);
}

TEST_F(CudaAgentTest, AdjacentBlocksCoalesceAndLandExactly) {
  Connect();
  std::vector<BlockPair> pairs = {{3, 10}, {4, 11}, {5, 12}, {100, 7}};
  auto p = agent_->Prepare({TransferOp::kRead, "target", pairs});
  ASSERT_TRUE(p.ok()) << p.status().ToString();
  EXPECT_EQ((*p)->segment_count(), 2u * layout_.num_layers);
  EXPECT_EQ((*p)->bytes(), 4 * layout_.BlockBytes() * layout_.num_layers);
  Prime(TransferOp::kRead, 31, 32);
  auto h = agent_->Post(*p);
  ASSERT_TRUE(h.ok());
  ASSERT_TRUE(h->Wait(30000));
  ASSERT_EQ(h->state(), TransferState::kDone) << h->status().ToString();
  EXPECT_EQ(Mismatches(TransferOp::kRead, Expected(TransferOp::kRead, pairs), 31, 32), 0u);
}

TEST_F(CudaAgentTest, WriteNotificationArrivesOnlyAfterTheData) {
  Connect();
  constexpr int kRounds = 8;
  for (int r = 0; r < kRounds; ++r) {
    const auto pairs = Scattered(400, 40 + r);  // 1600 x 16 KiB = 25 MiB per round
    const uint64_t src = 100 + 2 * r, poison = 101 + 2 * r;
    Prime(TransferOp::kWrite, src, poison);
    PostOptions opt;
    opt.transfer_id = "w" + std::to_string(r);
    opt.notification = "verify:" + Spec(Expected(TransferOp::kWrite, pairs), src, poison).Encode();
    TransferHandle h = PostOk({TransferOp::kWrite, "target", pairs}, opt);
    ASSERT_TRUE(h.Wait(30000));
    ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
    std::string notes = PeerNotes(r + 1);
    EXPECT_NE(notes.find("w" + std::to_string(r) + " verify 0\n"), std::string::npos) << notes;
  }
  std::string notes = PeerNotes(kRounds);
  EXPECT_EQ(std::count(notes.begin(), notes.end(), '\n'), kRounds) << notes;
}

TEST_F(CudaAgentTest, ReadNotificationGetsTheTargetsReply) {
  Connect();
  const auto pairs = Scattered(16, 3);
  Prime(TransferOp::kRead, 41, 42);
  std::promise<Result<std::string>> reply;
  PostOptions opt;
  opt.transfer_id = "req-7";
  opt.notification = "read-done";
  opt.on_reply = [&reply](Result<std::string> r) { reply.set_value(std::move(r)); };
  TransferHandle h = PostOk({TransferOp::kRead, "target", pairs}, opt);
  ASSERT_TRUE(h.Wait(30000));
  ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  auto f = reply.get_future();
  ASSERT_EQ(f.wait_for(std::chrono::seconds(10)), std::future_status::ready);
  Result<std::string> r = f.get();
  ASSERT_TRUE(r.ok()) << r.status().ToString();
  EXPECT_EQ(*r, "held:req-7");
  EXPECT_EQ(PeerNotes(1), "req-7 read-done -1\n");
  EXPECT_EQ(Mismatches(TransferOp::kRead, Expected(TransferOp::kRead, pairs), 41, 42), 0u);
}

TEST_F(CudaAgentTest, OutOfRangeIsRefusedAndNothingMoves) {
  Connect();
  Prime(TransferOp::kRead, 51, 52);
  const int nb = layout_.num_blocks;
  for (const std::vector<BlockPair>& bad :
       {std::vector<BlockPair>{{0, 0}, {1, nb}}, std::vector<BlockPair>{{nb, 0}},
        std::vector<BlockPair>{{-1, 3}}}) {
    auto p = agent_->Prepare({TransferOp::kRead, "target", bad});
    EXPECT_EQ(p.status().code(), StatusCode::kInvalidArgument) << p.status().ToString();
  }
  TransferSpec bad_layer{TransferOp::kRead, "target", {{0, 0}}};
  bad_layer.layer = layout_.num_layers;
  EXPECT_EQ(agent_->Prepare(bad_layer).status().code(), StatusCode::kInvalidArgument);
  ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
  EXPECT_EQ(Mismatches(TransferOp::kRead, std::vector<int32_t>(Units(), -1), 51, 52), 0u);
}

TEST_F(CudaAgentTest, MetadataMismatchIsRefusedNamingTheField) {
  AgentMetadata other_model = peer_meta_;
  other_model.model_fingerprint = "model-B";
  auto r = agent_->AddPeer(other_model);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("model_fingerprint"), std::string::npos)
      << r.status().ToString();
  AgentMetadata host_peer = peer_meta_;
  host_peer.memory_kind = MemoryKind::kHost;
  r = agent_->AddPeer(host_peer);
  EXPECT_EQ(r.status().code(), StatusCode::kFailedPrecondition);
  EXPECT_NE(r.status().message().find("memory_kind"), std::string::npos) << r.status().ToString();
}

TEST_F(CudaAgentTest, ThousandConcurrentTransfersAllLand) {
  Connect();
  Prime(TransferOp::kRead, 61, 62);
  std::vector<TransferHandle> hs;
  std::vector<BlockPair> all;
  for (int i = 0; i < 1000; ++i) {
    BlockPair p{i % layout_.num_blocks, (i * 7 + 3) % layout_.num_blocks};
    TransferSpec spec{TransferOp::kRead, "target", {p}};
    spec.layer = i / layout_.num_blocks;  // blocks 0..511 of layer 0, then 0..487 of layer 1
    hs.push_back(PostOk(spec));
  }
  for (auto& h : hs) {
    ASSERT_TRUE(h.Wait(30000));
    ASSERT_EQ(h.state(), TransferState::kDone) << h.status().ToString();
  }
  std::vector<int32_t> src_of(Units(), -1);
  for (int i = 0; i < 1000; ++i) {
    const int l = i / layout_.num_blocks;
    src_of[Unit(l, i % layout_.num_blocks)] = Unit(l, (i * 7 + 3) % layout_.num_blocks);
  }
  EXPECT_EQ(Mismatches(TransferOp::kRead, src_of, 61, 62), 0u);
}

TEST_F(CudaAgentTest, KilledPeerFailsLaterPostsWithUnavailable) {
  Connect();
  TransferHandle ok = PostOk({TransferOp::kRead, "target", {{1, 1}}});
  ASSERT_TRUE(ok.Wait(30000));
  ASSERT_EQ(ok.state(), TransferState::kDone) << ok.status().ToString();
  peer_.Kill();
  auto p = agent_->Prepare({TransferOp::kRead, "target", {{2, 2}}});
  ASSERT_TRUE(p.ok());
  Status last;
  const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(5);
  while (std::chrono::steady_clock::now() < deadline) {
    auto h = agent_->Post(*p);
    if (!h.ok()) {
      last = h.status();
    } else {
      h->Wait(5000);
      last = h->status();
    }
    if (!last.ok()) break;
    std::this_thread::sleep_for(std::chrono::milliseconds(5));
  }
  EXPECT_EQ(last.code(), StatusCode::kUnavailable) << last.ToString();
  EXPECT_EQ(agent_->Notify("target", "t", "x").code(), StatusCode::kUnavailable);
}

TEST_F(CudaAgentTest, HostPointerRegisteredAsDeviceMemoryIsRefused) {
  AgentConfig cfg;
  cfg.name = "liar";
  cfg.backends = {"cuda_ipc"};
  auto a = TransferAgent::Create(cfg);
  ASSERT_TRUE(a.ok());
  PagedKvLayout l = layout_;
  l.num_blocks = 4;
  std::vector<uint8_t> host(l.LayerBytes() * l.num_layers + 16);
  uint8_t* aligned = host.data() + (16 - reinterpret_cast<uintptr_t>(host.data()) % 16) % 16;
  Status st = (*a)->RegisterMemory(KvRegistration::FromDeviceMemory(l, aligned, local_dev_));
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("not device memory from cudaMalloc"), std::string::npos)
      << st.ToString();
  // A registration that runs past its cudaMalloc allocation is refused too.
  KvRegistration past = KvRegistration::FromDeviceMemory(layout_, pool_->data(), local_dev_);
  past.layers.back().bytes += layout_.BlockBytes();
  auto b = TransferAgent::Create(cfg);
  ASSERT_TRUE(b.ok());
  st = (*b)->RegisterMemory(past);
  EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
  EXPECT_NE(st.message().find("runs past its allocation"), std::string::npos) << st.ToString();
}

}  // namespace
}  // namespace kvbridge::transfer

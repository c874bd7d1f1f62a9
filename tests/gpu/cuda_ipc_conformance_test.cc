// Conformance of the cuda_ipc core on a GPU: two processes (this test and cuda_ipc_peer) on one
// device. Every GPU test skips with a printed reason where no CUDA device is usable (CI).
//
// Checked: READ and WRITE of scattered block lists (inline and uploaded lists, block sizes with
// and without a partial 4 KiB chunk) land exactly (every byte compared, untouched blocks still
// poisoned); invalid lists are refused before anything is launched and no byte changes; the
// notification reaches the peer only after the data (the peer verifies on arrival); a peer that
// is gone makes posts and notifications fail with Unavailable; bad IPC handles are refused.
#include <gtest/gtest.h>
#include <signal.h>
#include <time.h>

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/peer_link.h"

namespace kvbridge::cuda_ipc {
namespace {

constexpr uint64_t kPoolBytes = uint64_t{128} << 20;  // 128 MiB on each side

// GPUs from the environment, so the suite also runs across two GPUs (issue 12):
// KVB_GPU_LOCAL (this process: local pool, kernels), KVB_GPU_PEER (the peer process's pool).
int EnvDevice(const char* name) {
  const char* v = std::getenv(name);
  return v != nullptr && *v ? std::atoi(v) : 0;
}

// ---- CPU-only checks (run everywhere) ----

TEST(CudaIpcValidate, RefusesOutOfRangeAndDuplicateAndMisaligned) {
  alignas(16) static char a[1024], b[1024];
  BlockRegion local{a, 64, 16}, remote{b, 64, 8};
  std::vector<BlockPair> ok = {{0, 0}, {15, 7}};
  EXPECT_TRUE(ValidateBlockList(CopyOp::kRead, local, remote, ok).ok());
  std::vector<BlockPair> bad_local = {{0, 0}, {16, 1}};
  Status st = ValidateBlockList(CopyOp::kRead, local, remote, bad_local);
  EXPECT_EQ(st.code(), StatusCode::kOutOfRange);
  EXPECT_NE(st.message().find("pair 1 (local 16, remote 1)"), std::string::npos) << st.ToString();
  std::vector<BlockPair> bad_remote = {{3, 8}};
  EXPECT_EQ(ValidateBlockList(CopyOp::kWrite, local, remote, bad_remote).code(),
            StatusCode::kOutOfRange);
  std::vector<BlockPair> dup_dst_read = {{1, 0}, {1, 1}};  // READ writes local block 1 twice
  EXPECT_EQ(ValidateBlockList(CopyOp::kRead, local, remote, dup_dst_read).code(),
            StatusCode::kInvalidArgument);
  EXPECT_TRUE(ValidateBlockList(CopyOp::kWrite, local, remote, dup_dst_read).ok());
  BlockRegion odd{a, 40, 4};
  EXPECT_EQ(ValidateBlockList(CopyOp::kRead, odd, BlockRegion{b, 40, 4}, ok).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBlockList(CopyOp::kRead, local, BlockRegion{b, 128, 4}, {}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBlockList(CopyOp::kRead, BlockRegion{a + 8, 64, 4}, remote, {}).code(),
            StatusCode::kInvalidArgument);
  EXPECT_EQ(ValidateBlockList(CopyOp::kRead, BlockRegion{nullptr, 64, 4}, remote, {}).code(),
            StatusCode::kInvalidArgument);
}

TEST(CudaIpcHandle, SerializeRoundTripAndRejectsGarbage) {
  IpcHandle h;
  for (size_t i = 0; i < h.handle.size(); ++i) h.handle[i] = static_cast<char>(i * 7);
  h.bytes = 12345;
  h.device = 3;
  h.pid = 4242;
  std::string s = h.Serialize();
  ASSERT_EQ(s.size(), IpcHandle::kSerializedBytes);
  Result<IpcHandle> back = IpcHandle::Parse(s);
  ASSERT_TRUE(back.ok()) << back.status().ToString();
  EXPECT_EQ(back->handle, h.handle);
  EXPECT_EQ(back->bytes, 12345u);
  EXPECT_EQ(back->device, 3);
  EXPECT_EQ(back->pid, 4242);
  EXPECT_EQ(IpcHandle::Parse(s.substr(1)).status().code(), StatusCode::kInvalidArgument);
  std::string bad_magic = s;
  bad_magic[0] ^= 1;
  EXPECT_EQ(IpcHandle::Parse(bad_magic).status().code(), StatusCode::kInvalidArgument);
  IpcHandle zero = h;
  zero.bytes = 0;
  EXPECT_EQ(IpcHandle::Parse(zero.Serialize()).status().code(), StatusCode::kInvalidArgument);
}

TEST(CudaIpcVerifySpec, RoundTripAndRejectsTruncated) {
  VerifySpec v{11, 22, 4096, {3, -1, 0}};
  Result<VerifySpec> back = VerifySpec::Decode(v.Encode());
  ASSERT_TRUE(back.ok());
  EXPECT_EQ(back->src_seed, 11u);
  EXPECT_EQ(back->poison_seed, 22u);
  EXPECT_EQ(back->block_bytes, 4096u);
  EXPECT_EQ(back->src_of, v.src_of);
  std::string enc = v.Encode();
  EXPECT_FALSE(VerifySpec::Decode(enc.substr(0, enc.size() - 1)).ok());
}

// ---- GPU tests ----

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

class CudaIpcTest : public ::testing::Test {
 protected:
  void SetUp() override {
    Result<int> n = CudaDeviceCount();
    if (!n.ok()) GTEST_SKIP() << "skipped: " << n.status().message();
    local_dev_ = EnvDevice("KVB_GPU_LOCAL");
    peer_dev_ = EnvDevice("KVB_GPU_PEER");
    if (std::max(local_dev_, peer_dev_) >= *n) {
      GTEST_SKIP() << "skipped: GPUs " << local_dev_ << " and " << peer_dev_ << " asked, " << *n
                   << " present";
    }
    auto p = SpawnPeer(DefaultPeerBinary(), peer_dev_);
    ASSERT_TRUE(p.ok()) << p.status().ToString();
    peer_ = std::move(*p);
    Message m = Call(MsgType::kAlloc, EncodeU64s(std::vector<uint64_t>{kPoolBytes}));
    ASSERT_EQ(m.type, MsgType::kHandle) << m.payload;
    auto h = IpcHandle::Parse(m.payload);
    ASSERT_TRUE(h.ok()) << h.status().ToString();
    EXPECT_EQ(h->bytes, kPoolBytes);
    EXPECT_EQ(h->pid, peer_.pid);
    EXPECT_EQ(h->device, peer_dev_);
    auto imported = ImportedPool::Open(*h, local_dev_);
    ASSERT_TRUE(imported.ok()) << imported.status().ToString();
    remote_pool_ = std::move(*imported);
    auto local = DevicePool::Create(local_dev_, kPoolBytes);
    ASSERT_TRUE(local.ok()) << local.status().ToString();
    local_pool_ = std::move(*local);
    auto e = CopyEngine::Create({.device = local_dev_});
    ASSERT_TRUE(e.ok()) << e.status().ToString();
    engine_ = std::move(*e);
  }
  void TearDown() override {
    engine_.reset();
    remote_pool_.reset();
    local_pool_.reset();
    if (peer_.pid > 0 && peer_.channel->PeerAlive()) {
      EXPECT_TRUE(peer_.Stop(10000).ok());
    }
  }

  Message Call(MsgType t, std::string_view payload) {
    Status st = peer_.channel->Send(t, payload);
    EXPECT_TRUE(st.ok()) << st.ToString();
    if (!st.ok()) return {MsgType::kError, st.ToString()};
    auto m = peer_.channel->Recv(60000);
    EXPECT_TRUE(m.ok()) << m.status().ToString();
    if (!m.ok()) return {MsgType::kError, m.status().ToString()};
    return *m;
  }

  // Source filled with src_seed, destination poisoned with poison_seed.
  void Prime(CopyOp op, uint64_t src_seed, uint64_t poison_seed) {
    const uint64_t own = op == CopyOp::kRead ? poison_seed : src_seed;
    const uint64_t theirs = op == CopyOp::kRead ? src_seed : poison_seed;
    ASSERT_EQ(Call(MsgType::kFill, EncodeU64s(std::vector<uint64_t>{theirs})).type, MsgType::kOk);
    ASSERT_TRUE(FillPattern(local_pool_->data(), kPoolBytes, own, engine_->stream()).ok());
    ASSERT_EQ(cudaStreamSynchronize(engine_->stream()), cudaSuccess);
  }

  // Mismatched 8-byte words in the destination side (READ: local, checked here; WRITE: the
  // peer's pool, checked by the peer in its own process).
  uint64_t Mismatches(CopyOp op, uint64_t bb, const std::vector<int32_t>& src_of, uint64_t src_seed,
                      uint64_t poison_seed) {
    if (op == CopyOp::kRead) {
      auto r = VerifyBlocks(BlockRegion{local_pool_->data(), bb, src_of.size()}, src_of, src_seed,
                            poison_seed, engine_->stream());
      EXPECT_TRUE(r.ok()) << r.status().ToString();
      return r.ok() ? *r : ~uint64_t{0};
    }
    Message m = Call(MsgType::kVerify, VerifySpec{src_seed, poison_seed, bb, src_of}.Encode());
    EXPECT_EQ(m.type, MsgType::kCount) << m.payload;
    auto v = DecodeU64s(m.payload);
    return v.ok() && v->size() == 1 ? (*v)[0] : ~uint64_t{0};
  }

  BlockRegion Local(uint64_t bb) { return {local_pool_->data(), bb, kPoolBytes / bb}; }
  BlockRegion Remote(uint64_t bb) { return {remote_pool_->data(), bb, kPoolBytes / bb}; }

  int local_dev_ = 0, peer_dev_ = 0;
  PeerProcess peer_;
  std::unique_ptr<ImportedPool> remote_pool_;
  std::unique_ptr<DevicePool> local_pool_;
  std::unique_ptr<CopyEngine> engine_;
};

// Random pairs over distinct destinations and distinct sources; src_of maps destination ids.
std::vector<BlockPair> RandomPairs(CopyOp op, uint64_t blocks, size_t count, uint64_t seed,
                                   std::vector<int32_t>* src_of) {
  std::mt19937_64 rng(seed);
  std::vector<uint32_t> a(blocks), b(blocks);
  std::iota(a.begin(), a.end(), 0u);
  std::iota(b.begin(), b.end(), 0u);
  std::shuffle(a.begin(), a.end(), rng);
  std::shuffle(b.begin(), b.end(), rng);
  src_of->assign(blocks, -1);
  std::vector<BlockPair> pairs(count);
  for (size_t i = 0; i < count; ++i) {
    pairs[i] = {a[i], b[i]};
    if (op == CopyOp::kRead)
      (*src_of)[a[i]] = static_cast<int32_t>(b[i]);
    else
      (*src_of)[b[i]] = static_cast<int32_t>(a[i]);
  }
  return pairs;
}

class CudaIpcCopyTest : public CudaIpcTest,
                        public ::testing::WithParamInterface<std::tuple<CopyOp, uint64_t, size_t>> {
};

TEST_P(CudaIpcCopyTest, ScatteredBlocksLandExactlyAndNothingElseChanges) {
  const auto [op, bb, count] = GetParam();
  const uint64_t blocks = kPoolBytes / bb;
  ASSERT_LE(count, blocks);
  std::vector<int32_t> src_of;
  std::vector<BlockPair> pairs = RandomPairs(op, blocks, count, bb * 131 + count, &src_of);
  Prime(op, 1000 + bb, 2000 + count);
  auto h = engine_->Post(op, Local(bb), Remote(bb), pairs);
  ASSERT_TRUE(h.ok()) << h.status().ToString();
  ASSERT_TRUE(h->Wait().ok()) << h->status().ToString();
  EXPECT_EQ(h->Poll(), CopyState::kDone);
  EXPECT_EQ(Mismatches(op, bb, src_of, 1000 + bb, 2000 + count), 0u);
}

INSTANTIATE_TEST_SUITE_P(
    Lists, CudaIpcCopyTest,
    ::testing::Combine(::testing::Values(CopyOp::kRead, CopyOp::kWrite),
                       // 16 B, 1 KiB and 16400 B have a partial chunk; 4/16/256 KiB do not.
                       ::testing::Values(uint64_t{16}, uint64_t{1024}, uint64_t{4096},
                                         uint64_t{16384}, uint64_t{16400}, uint64_t{262144}),
                       // 1 pair, inline (<= 256), uploaded (> 256).
                       ::testing::Values(size_t{1}, size_t{64}, size_t{300})),
    [](const auto& info) {
      return std::string(CopyOpName(std::get<0>(info.param))) + "_" +
             std::to_string(std::get<1>(info.param)) + "B_" +
             std::to_string(std::get<2>(info.param)) + "pairs";
    });

TEST_F(CudaIpcTest, LongUploadedListsCoverTheWholePool) {
  for (CopyOp op : {CopyOp::kRead, CopyOp::kWrite}) {
    const uint64_t bb = 4096, blocks = kPoolBytes / bb;  // 32768 pairs: uploaded list
    std::vector<int32_t> src_of;
    auto pairs = RandomPairs(op, blocks, blocks, 77 + static_cast<int>(op), &src_of);
    Prime(op, 31, 32);
    auto prepared = engine_->Prepare(op, Local(bb), Remote(bb), pairs);
    ASSERT_TRUE(prepared.ok()) << prepared.status().ToString();
    auto h = engine_->Post(*prepared);
    ASSERT_TRUE(h.ok() && h->Wait().ok());
    EXPECT_EQ(Mismatches(op, bb, src_of, 31, 32), 0u) << CopyOpName(op);
    Prime(op, 41, 42);
    auto h2 = engine_->Post(op, Local(bb), Remote(bb), pairs);
    ASSERT_TRUE(h2.ok() && h2->Wait().ok());
    EXPECT_EQ(Mismatches(op, bb, src_of, 41, 42), 0u) << CopyOpName(op);
  }
}

TEST_F(CudaIpcTest, InvalidListIsRefusedAndNothingIsTouched) {
  for (CopyOp op : {CopyOp::kRead, CopyOp::kWrite}) {
    const uint64_t bb = 16384, blocks = kPoolBytes / bb;
    Prime(op, 51, 52);
    std::vector<BlockPair> pairs = {{1, 2}, {3, 4}, {static_cast<uint32_t>(blocks), 5}};
    auto h = engine_->Post(op, Local(bb), Remote(bb), pairs);
    EXPECT_EQ(h.status().code(), StatusCode::kOutOfRange);
    pairs = {{1, 2}, {3, static_cast<uint32_t>(blocks) + 100}};
    EXPECT_EQ(engine_->Post(op, Local(bb), Remote(bb), pairs).status().code(),
              StatusCode::kOutOfRange);
    EXPECT_EQ(engine_->Prepare(op, Local(bb), Remote(bb), pairs).status().code(),
              StatusCode::kOutOfRange);
    // A region claiming more blocks than the mapping cannot be caught by ids alone; the caller
    // builds regions from registered sizes. Misaligned sizes are refused:
    EXPECT_EQ(engine_
                  ->Post(op, BlockRegion{local_pool_->data(), 100, 10},
                         BlockRegion{remote_pool_->data(), 100, 10}, std::vector<BlockPair>{{0, 0}})
                  .status()
                  .code(),
              StatusCode::kInvalidArgument);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(Mismatches(op, bb, std::vector<int32_t>(blocks, -1), 51, 52), 0u) << CopyOpName(op);
  }
}

TEST_F(CudaIpcTest, EmptyListCompletesAtOnce) {
  auto h = engine_->Post(CopyOp::kRead, Local(4096), Remote(4096), {});
  ASSERT_TRUE(h.ok());
  EXPECT_EQ(h->Poll(), CopyState::kDone);
}

TEST_F(CudaIpcTest, NotificationArrivesOnlyAfterTheDataLanded) {
  const uint64_t bb = 16384, blocks = kPoolBytes / bb;
  for (int round = 0; round < 20; ++round) {
    std::vector<int32_t> src_of;
    // Large enough (1024 x 16 KiB = 16 MiB) that a notification sent before completion would
    // be seen while the kernel still runs.
    auto pairs = RandomPairs(CopyOp::kWrite, blocks, 1024, 500 + round, &src_of);
    Prime(CopyOp::kWrite, 600 + round, 700 + round);
    std::string note(16, '\0');
    const uint64_t id = round;
    const int64_t t0 = NowNs();
    std::memcpy(note.data(), &id, 8);
    std::memcpy(note.data() + 8, &t0, 8);
    note += VerifySpec{600u + round, 700u + round, bb, src_of}.Encode();
    auto t =
        PostToPeer(*engine_, *peer_.channel, CopyOp::kWrite, Local(bb), Remote(bb), pairs, note);
    ASSERT_TRUE(t.ok()) << t.status().ToString();
    Status st;
    while (Progress(*t, *peer_.channel, &st) == CopyState::kInProgress) {
    }
    ASSERT_TRUE(st.ok()) << st.ToString();
  }
  Message m = Call(MsgType::kReport, {});
  ASSERT_EQ(m.type, MsgType::kReportList);
  auto rep = DecodeU64s(m.payload);
  ASSERT_TRUE(rep.ok());
  ASSERT_EQ(rep->size(), 20u * 3);
  for (size_t i = 0; i < 20; ++i) {
    EXPECT_EQ((*rep)[3 * i], i);
    EXPECT_EQ(static_cast<int64_t>((*rep)[3 * i + 2]), 0)
        << "round " << i << ": data incomplete at notification";
  }
}

TEST_F(CudaIpcTest, PeerGoneMakesPostAndNotifyUnavailable) {
  const uint64_t bb = 4096;
  std::vector<int32_t> src_of;
  auto pairs = RandomPairs(CopyOp::kRead, kPoolBytes / bb, 64, 9, &src_of);
  // A transfer completes, then the peer dies before its notification is sent.
  auto t = PostToPeer(*engine_, *peer_.channel, CopyOp::kRead, Local(bb), Remote(bb), pairs,
                      std::string(16, '\0'));
  ASSERT_TRUE(t.ok());
  ASSERT_TRUE(t->copy.Wait().ok());
  peer_.Kill();
  EXPECT_FALSE(peer_.channel->PeerAlive());
  Status st;
  EXPECT_EQ(Progress(*t, *peer_.channel, &st), CopyState::kFailed);
  EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
  // New posts are refused before anything is launched.
  auto t2 = PostToPeer(*engine_, *peer_.channel, CopyOp::kRead, Local(bb), Remote(bb), pairs, "");
  EXPECT_EQ(t2.status().code(), StatusCode::kUnavailable);
  EXPECT_EQ(peer_.channel->Send(MsgType::kNotify, "x").code(), StatusCode::kUnavailable);
  EXPECT_EQ(peer_.channel->Recv(1000).status().code(), StatusCode::kUnavailable);
}

TEST_F(CudaIpcTest, BadHandlesAreRefused) {
  auto h = local_pool_->Export();
  ASSERT_TRUE(h.ok());
  // Our own handle cannot be opened by ourselves.
  EXPECT_EQ(ImportedPool::Open(*h, local_dev_).status().code(), StatusCode::kInvalidArgument);
  IpcHandle garbage = *h;
  garbage.pid = peer_.pid;
  for (auto& c : garbage.handle) c = static_cast<char>(0x5a);
  auto r = ImportedPool::Open(garbage, local_dev_);
  EXPECT_FALSE(r.ok());
  EXPECT_EQ(ImportedPool::Open(garbage, 99).status().code(), StatusCode::kInvalidArgument);
  // The context is still usable afterwards.
  auto t = engine_->Post(CopyOp::kRead, Local(4096), Remote(4096), std::vector<BlockPair>{{0, 0}});
  ASSERT_TRUE(t.ok());
  EXPECT_TRUE(t->Wait().ok());
}

}  // namespace
}  // namespace kvbridge::cuda_ipc

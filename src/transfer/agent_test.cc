#include "kvbridge/transfer/agent.h"

#include <gtest/gtest.h>

namespace kvbridge::transfer {
namespace {

TEST(TransferAgent, CreateValidatesConfigAndRegistration) {
  EXPECT_EQ(TransferAgent::Create(AgentConfig{}).status().code(), StatusCode::kInvalidArgument);
  AgentConfig c;
  c.name = "x";
  c.backends = {"nope"};
  EXPECT_EQ(TransferAgent::Create(c).status().code(), StatusCode::kNotFound);
  c.backends = {"tcp"};
  auto a = TransferAgent::Create(c);
  ASSERT_TRUE(a.ok());
  EXPECT_EQ((*a)->Metadata().status().code(), StatusCode::kFailedPrecondition);
  KvRegistration reg;
  reg.layout = {1, 1, 8, 4, 4, KvDtype::kFp32};
  EXPECT_EQ((*a)->RegisterMemory(reg).code(), StatusCode::kInvalidArgument);  // no regions
  std::vector<uint8_t> mem(reg.layout.LayerBytes());
  reg.layers.push_back(MemoryRegion{MemoryKind::kCuda, 0, mem.data(), mem.size()});
  EXPECT_EQ((*a)->RegisterMemory(reg).code(), StatusCode::kInvalidArgument);  // cuda: not yet
  reg.layers[0].kind = MemoryKind::kHost;
  ASSERT_TRUE((*a)->RegisterMemory(reg).ok());
  EXPECT_EQ((*a)->RegisterMemory(reg).code(), StatusCode::kFailedPrecondition);
  auto m = (*a)->Metadata();
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->endpoints.count("tcp"), 1u);
  EXPECT_EQ(m->endpoints.count("shm"), 0u);
  EXPECT_EQ(m->layer_base[0], reinterpret_cast<uint64_t>(mem.data()));
}

TEST(TransferAgent, PlainHeapMemoryIsNotOfferedOverShm) {
  AgentConfig c;
  c.name = "x";
  c.backends = {"shm"};
  auto a = TransferAgent::Create(c);
  ASSERT_TRUE(a.ok());
  KvRegistration reg;
  reg.layout = {1, 1, 8, 4, 4, KvDtype::kFp32};
  std::vector<uint8_t> mem(reg.layout.LayerBytes());
  reg.layers.push_back(MemoryRegion{MemoryKind::kHost, -1, mem.data(), mem.size()});
  EXPECT_EQ((*a)->RegisterMemory(reg).code(), StatusCode::kFailedPrecondition);
}

TEST(TransferAgent, IncarnationIsNewAtEveryStart) {
  AgentConfig c;
  c.name = "x";
  c.backends = {"tcp"};
  PagedKvLayout l{1, 1, 8, 4, 4, KvDtype::kFp32};
  auto b1 = HostBuffer::Allocate(l.LayerBytes()).value();
  auto a1 = TransferAgent::Create(c).value();
  auto a2 = TransferAgent::Create(c).value();
  ASSERT_TRUE(a1->RegisterMemory(KvRegistration::FromHostBuffer(l, b1)).ok());
  ASSERT_TRUE(a2->RegisterMemory(KvRegistration::FromHostBuffer(l, b1)).ok());
  EXPECT_NE(a1->Metadata()->incarnation, a2->Metadata()->incarnation);
}

TEST(TransferAgent, HeadRangeBytes) {
  PagedKvLayout l{1, 8, 128, 16, 4, KvDtype::kBf16};
  ByteRange r = HeadRangeBytes(l, 2, 3);
  EXPECT_EQ(r.offset, 2u * 16 * 128 * 2);
  EXPECT_EQ(r.length, 3u * 16 * 128 * 2);
}

}  // namespace
}  // namespace kvbridge::transfer

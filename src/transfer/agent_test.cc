#include "kvbridge/transfer/agent.h"

#include <gtest/gtest.h>
#include <unistd.h>

#include <algorithm>
#include <string>
#include <vector>

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
  // Device memory is never handed to tcp: without a backend that moves it, a clear refusal.
  Status cuda_on_tcp = (*a)->RegisterMemory(reg);
  EXPECT_EQ(cuda_on_tcp.code(), StatusCode::kFailedPrecondition) << cuda_on_tcp.ToString();
  EXPECT_NE(cuda_on_tcp.message().find("no configured backend moves CUDA device memory"),
            std::string::npos)
      << cuda_on_tcp.ToString();
  reg.layers[0].kind = MemoryKind::kHost;
  ASSERT_TRUE((*a)->RegisterMemory(reg).ok());
  EXPECT_EQ((*a)->RegisterMemory(reg).code(), StatusCode::kFailedPrecondition);
  auto m = (*a)->Metadata();
  ASSERT_TRUE(m.ok());
  EXPECT_EQ(m->endpoints.count("tcp"), 1u);
  EXPECT_EQ(m->endpoints.count("shm"), 0u);
  EXPECT_EQ(m->layer_base[0], reinterpret_cast<uint64_t>(mem.data()));
}

TEST(KvRegistration, CudaMemoryIsValidatedLikeHostMemory) {
  PagedKvLayout l{2, 1, 8, 4, 4, KvDtype::kFp32};
  alignas(16) static uint8_t fake[16];  // never dereferenced: Validate is bookkeeping only
  KvRegistration reg = KvRegistration::FromDeviceMemory(l, fake, 1);
  ASSERT_EQ(reg.layers.size(), 2u);
  EXPECT_EQ(reg.layers[1].kind, MemoryKind::kCuda);
  EXPECT_EQ(reg.layers[1].device, 1);
  EXPECT_EQ(reg.layers[1].base, fake + l.LayerBytes());
  EXPECT_EQ(reg.layers[1].bytes, l.LayerBytes());
  EXPECT_EQ(reg.layers[1].shm_fd, -1);
  EXPECT_TRUE(reg.Validate().ok()) << reg.Validate().ToString();
  EXPECT_EQ(MemoryKindName(MemoryKind::kCuda), "cuda");

  auto refused = [](KvRegistration r, const std::string& needle) {
    Status st = r.Validate();
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << needle;
    EXPECT_NE(st.message().find(needle), std::string::npos) << st.ToString();
  };
  KvRegistration small = reg;
  small.layers[1].bytes = l.LayerBytes() - 1;
  refused(small, "layer 1 region is smaller than");
  KvRegistration null_base = reg;
  null_base.layers[0].base = nullptr;
  refused(null_base, "layer 0 region is smaller than");
  KvRegistration no_device = reg;
  no_device.layers[0].device = no_device.layers[1].device = -1;
  refused(no_device, "layer 0: cuda memory needs a device ordinal >= 0 (got -1)");
  KvRegistration two_devices = reg;
  two_devices.layers[1].device = 0;
  refused(two_devices, "layer 1: cuda device 0 differs from layer 0's (1)");
  KvRegistration mixed = reg;
  mixed.layers[1].kind = MemoryKind::kHost;
  refused(mixed, "layer 1: memory kind host differs from layer 0's (cuda)");
  KvRegistration with_fd = reg;
  with_fd.layers[0].shm_fd = 3;
  refused(with_fd, "layer 0: cuda memory cannot carry an shm_fd");
  KvRegistration misaligned = reg;
  misaligned.layers[1].base += 8;
  refused(misaligned, "layer 1: cuda memory base is not 16-byte aligned");
  KvRegistration bad_kind = reg;
  bad_kind.layers[0].kind = static_cast<MemoryKind>(7);
  refused(bad_kind, "layer 0: unknown memory kind 7");
}

// Registering device memory with the cuda_ipc backend. Here (CI: no GPU) the agent refuses it
// with the reason; where cuda_ipc is not compiled in, the backend itself is unknown. On a GPU
// machine a host pointer posing as device memory is refused by the allocation check.
TEST(TransferAgent, CudaRegistrationWithoutGpuIsAClearError) {
  AgentConfig c;
  c.name = "gpu-less";
  c.backends = {"cuda_ipc"};
  const std::vector<std::string> built = AvailableBackends();
  auto a = TransferAgent::Create(c);
  if (std::find(built.begin(), built.end(), "cuda_ipc") == built.end()) {
    ASSERT_EQ(a.status().code(), StatusCode::kNotFound) << a.status().ToString();
    EXPECT_NE(a.status().message().find("'cuda_ipc' is not built in"), std::string::npos);
    return;
  }
  ASSERT_TRUE(a.ok()) << a.status().ToString();
  PagedKvLayout l{1, 1, 8, 4, 4, KvDtype::kFp32};
  alignas(16) static uint8_t not_device[1024];
  Status st = (*a)->RegisterMemory(KvRegistration::FromDeviceMemory(l, not_device, 0));
  const bool gpu_machine = ::access("/dev/nvidiactl", F_OK) == 0;
  if (gpu_machine) {
    EXPECT_EQ(st.code(), StatusCode::kInvalidArgument) << st.ToString();
    EXPECT_NE(st.message().find("not device memory from cudaMalloc"), std::string::npos)
        << st.ToString();
  } else {
    EXPECT_EQ(st.code(), StatusCode::kUnavailable) << st.ToString();
    EXPECT_NE(st.message().find("no CUDA device"), std::string::npos) << st.ToString();
  }
  EXPECT_EQ((*a)->Metadata().status().code(), StatusCode::kFailedPrecondition);
  // Host memory offered only to cuda_ipc: no backend serves it.
  std::vector<uint8_t> mem(l.LayerBytes());
  KvRegistration host;
  host.layout = l;
  host.layers.push_back(MemoryRegion{MemoryKind::kHost, -1, mem.data(), mem.size()});
  EXPECT_EQ((*a)->RegisterMemory(host).code(), StatusCode::kFailedPrecondition);
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

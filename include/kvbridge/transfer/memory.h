// kvbridge/transfer/memory.h — memory that the transfer agent can move KV blocks in and out of.
//
// The engine's KV pool registers its per-layer regions with its TransferAgent once. Any host
// memory can be registered (tcp moves it with readv/writev); memory that should also be reachable
// by a same-host peer through the shm backend must be shareable, i.e. come from HostBuffer
// (a memfd mapping the peer can map too). CUDA device memory (MemoryKind::kCuda: a KV pool
// allocated with cudaMalloc) is moved by the cuda_ipc backend only (built with
// KVBRIDGE_WITH_CUDA): the agent exports CUDA IPC handles of the allocations at handshake and
// a peer on the same host maps them (docs/gpu.md). Host backends never see device memory.
//
//   ASSIGN_OR_RETURN(HostBuffer buf, HostBuffer::Allocate(layout.LayerBytes() *
//   layout.num_layers)); KvRegistration reg = KvRegistration::FromHostBuffer(layout, buf);
//   RETURN_IF_ERROR(agent->RegisterMemory(reg));
//
//   // Device memory (agent configured with backends = {"cuda_ipc"}):
//   void* kv = nullptr; cudaMalloc(&kv, layout.LayerBytes() * layout.num_layers);
//   RETURN_IF_ERROR(agent->RegisterMemory(KvRegistration::FromDeviceMemory(layout, kv, 0)));
#pragma once

#include <cstddef>
#include <cstdint>
#include <string_view>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"

namespace kvbridge::transfer {

/// Where a region lives. Backends advertise which kinds they can move.
enum class MemoryKind : uint8_t { kHost = 0, kCuda = 1 };
/// "host" | "cuda".
std::string_view MemoryKindName(MemoryKind kind);

/// One registered, contiguous region (one layer of one rank's KV cache).
struct MemoryRegion {
  MemoryKind kind = MemoryKind::kHost;
  int device = -1;          ///< CUDA device ordinal for kCuda; -1 for host.
  uint8_t* base = nullptr;  ///< First byte; must stay valid while the agent lives.
  size_t bytes = 0;         ///< Length in bytes (>= layout.LayerBytes()).
  int shm_fd = -1;          ///< memfd that maps `base` at `shm_offset`, or -1 (not shareable).
  size_t shm_offset = 0;    ///< Byte offset of `base` inside `shm_fd`.
};

/// The KV cache of one rank as the agent sees it: the layout, one region per layer, fp8 scales.
struct KvRegistration {
  PagedKvLayout layout;
  std::vector<MemoryRegion> layers;  ///< size layout.num_layers; each >= LayerBytes().
  std::vector<float> k_scale;        ///< size num_layers (or empty: 1.0).
  std::vector<float> v_scale;        ///< size num_layers (or empty: 1.0).

  /// Layers laid out back to back in `buffer` (layer i at i * LayerBytes()).
  static KvRegistration FromHostBuffer(const PagedKvLayout& layout, const class HostBuffer& buffer);
  /// Layers laid out back to back in device memory at `base` (layer i at i * LayerBytes()) on
  /// CUDA device `device`; `base` must come from cudaMalloc (or point inside such an allocation
  /// of >= num_layers * LayerBytes() bytes). Pure bookkeeping: nothing is dereferenced here; the
  /// cuda_ipc backend checks the allocation when the agent registers it.
  static KvRegistration FromDeviceMemory(const PagedKvLayout& layout, void* base, int device);
  /// Checks shape and sizes: InvalidArgument naming the bad field. Every layer must have the
  /// same kind; kCuda layers have device >= 0 (all the same), a
  /// 16-byte aligned base and no shm_fd.
  Status Validate() const;
};

/// Move-only RAII host memory backed by a memfd (MAP_SHARED, pre-faulted), so a same-host peer
/// can map it (shm backend). Thread-safety: the handle is not synchronized; the bytes are plain
/// memory.
class HostBuffer {
 public:
  /// Allocates `bytes` (> 0) zeroed, pre-faulted bytes. ResourceExhausted / Internal on failure.
  static Result<HostBuffer> Allocate(size_t bytes);
  HostBuffer() = default;
  ~HostBuffer();
  HostBuffer(HostBuffer&& other) noexcept;
  HostBuffer& operator=(HostBuffer&& other) noexcept;
  HostBuffer(const HostBuffer&) = delete;
  HostBuffer& operator=(const HostBuffer&) = delete;

  uint8_t* data() const { return data_; }
  size_t size() const { return size_; }
  int fd() const { return fd_; }

 private:
  uint8_t* data_ = nullptr;
  size_t size_ = 0;
  int fd_ = -1;
};

}  // namespace kvbridge::transfer

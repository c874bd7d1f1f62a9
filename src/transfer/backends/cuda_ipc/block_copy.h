// cuda_ipc/block_copy.h — the standalone core of the cuda_ipc backend (needs only CUDA).
//
// Device KV pools (cudaMalloc), CUDA IPC export/import between two processes on one host, and
// READ/WRITE of block lists between a local pool and a peer's mapped pool through ONE
// gather/scatter kernel launch per transfer: 16-byte coalesced accesses, a persistent grid of
// warps looping over (block pair, 4 KiB chunk) work items, a dedicated stream, completion by a
// CUDA event. Every block id is validated against both regions before anything is launched: a
// bad list is refused and no byte is touched.
//
//   ASSIGN_OR_RETURN(auto pool, DevicePool::Create(/*device=*/0, 1 << 30));
//   ASSIGN_OR_RETURN(IpcHandle h, pool->Export());          // send h.Serialize() to the peer
//   ASSIGN_OR_RETURN(auto peer, ImportedPool::Open(IpcHandle::Parse(bytes).value(), 0));
//   ASSIGN_OR_RETURN(auto engine, CopyEngine::Create({.device = 0}));
//   BlockRegion local{pool->data(), 16384, pool->bytes() / 16384};
//   BlockRegion remote{peer->data(), 16384, peer->bytes() / 16384};
//   ASSIGN_OR_RETURN(CopyHandle h, engine->Post(CopyOp::kRead, local, remote, pairs));
//   RETURN_IF_ERROR(h.Wait());                              // then notify the peer
//
// One-sided: the peer is not asked; use only between trusted processes of one deployment.
// Thread-safety: DevicePool/ImportedPool are immutable after creation; CopyEngine::Post and
// Prepare may be called from several threads (the CUDA stream serializes launches); a
// CopyHandle is owned by one thread.
#pragma once

#include <cuda_runtime.h>

#include <array>
#include <cstdint>
#include <memory>
#include <span>
#include <string>
#include <string_view>
#include <vector>

#include "kvbridge/common/status.h"

namespace kvbridge::cuda_ipc {

/// READ pulls remote blocks into local ones (the kernel gathers from the peer's pool); WRITE
/// pushes local blocks into the peer's pool (the kernel scatters into it).
enum class CopyOp : uint8_t { kRead = 0, kWrite = 1 };
std::string_view CopyOpName(CopyOp op);

/// `block_count` blocks of `block_bytes` at device address `base` (block i at i * block_bytes).
struct BlockRegion {
  void* base = nullptr;
  uint64_t block_bytes = 0;
  uint64_t block_count = 0;
};

/// One block of a transfer: local block id <-> remote block id.
struct BlockPair {
  uint32_t local = 0;
  uint32_t remote = 0;
};

/// One unit of an address-list transfer: `unit_bytes` at device address `local` <-> `remote`
/// (an address inside a mapped peer pool). Used by the transfer-agent backend, whose segments
/// span several registered layers.
struct AddressPair {
  void* local = nullptr;
  void* remote = nullptr;
};

/// Largest work-item count one launch accepts (pairs x 4 KiB chunks); bigger lists are split by
/// the caller. 2^31 items = 8 TiB.
constexpr uint64_t kMaxWorkItems = uint64_t{1} << 31;
/// Pair lists up to this length travel inside the kernel's parameters (no upload, lower latency).
constexpr uint32_t kInlinePairs = 256;
constexpr uint32_t kInlineAddressPairs = 128;

/// Checks `pairs` against both regions without touching the GPU: InvalidArgument when a region
/// is null, block_bytes is 0 or not a multiple of 16, a base is not 16-byte aligned, the two
/// block sizes differ, the list is too long (kMaxWorkItems); OutOfRange naming the first
/// offending pair when a block id is >= its region's block_count; InvalidArgument when two pairs
/// name the same destination block (READ: local, WRITE: remote), which would race.
Status ValidateBlockList(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                         std::span<const BlockPair> pairs);

/// A CUDA IPC handle of a device allocation, as sent to a peer process on the same host.
struct IpcHandle {
  std::array<char, CUDA_IPC_HANDLE_SIZE> handle{};
  uint64_t bytes = 0;  ///< Size of the exported allocation.
  int32_t device = 0;  ///< Exporting device ordinal.
  int32_t pid = 0;     ///< Exporting process (a mapping is refused inside the same process).

  /// Fixed-size little-endian encoding (kSerializedBytes bytes).
  static constexpr size_t kSerializedBytes = CUDA_IPC_HANDLE_SIZE + 16 + 4;
  std::string Serialize() const;
  /// InvalidArgument when `bytes` has the wrong size, a bad magic or a zero size.
  static Result<IpcHandle> Parse(std::string_view bytes);
};

/// Move-only owner of a cudaMalloc'ed pool on one device.
class DevicePool {
 public:
  /// `bytes` > 0. Unavailable without a device, ResourceExhausted when out of memory.
  static Result<std::unique_ptr<DevicePool>> Create(int device, uint64_t bytes);
  ~DevicePool();
  DevicePool(const DevicePool&) = delete;
  DevicePool& operator=(const DevicePool&) = delete;

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }
  int device() const { return device_; }
  /// The IPC handle a peer process opens with ImportedPool::Open.
  Result<IpcHandle> Export() const;

 private:
  DevicePool(int device, void* data, uint64_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  int device_;
  void* data_;
  uint64_t bytes_;
};

/// Move-only mapping of a peer's pool (cudaIpcOpenMemHandle); closed on destruction.
class ImportedPool {
 public:
  /// Maps `h` on `device` (peer access enabled when devices differ). InvalidArgument for a
  /// handle from this same process or one the driver rejects; Unavailable without a device.
  static Result<std::unique_ptr<ImportedPool>> Open(const IpcHandle& h, int device);
  ~ImportedPool();
  ImportedPool(const ImportedPool&) = delete;
  ImportedPool& operator=(const ImportedPool&) = delete;

  void* data() const { return data_; }
  uint64_t bytes() const { return bytes_; }

 private:
  ImportedPool(int device, void* data, uint64_t bytes)
      : device_(device), data_(data), bytes_(bytes) {}
  int device_;
  void* data_;
  uint64_t bytes_;
};

/// State of a posted copy.
enum class CopyState : uint8_t { kInProgress = 0, kDone = 1, kFailed = 2 };

/// Completion of one posted copy (a CUDA event recorded after its kernel). Move-only.
class CopyHandle {
 public:
  CopyHandle() = default;
  ~CopyHandle();
  CopyHandle(CopyHandle&& other) noexcept;
  CopyHandle& operator=(CopyHandle&& other) noexcept;
  CopyHandle(const CopyHandle&) = delete;
  CopyHandle& operator=(const CopyHandle&) = delete;

  /// Non-blocking: kInProgress, kDone, or kFailed (then `status()` says why).
  CopyState Poll();
  /// Spins on Poll until done or failed; the final Status.
  Status Wait();
  const Status& status() const { return status_; }

 private:
  friend class CopyEngine;
  cudaEvent_t event_ = nullptr;
  bool done_ = false;
  Status status_;
};

/// Block-pair list already validated and resident on the device (re-posted without upload).
class PreparedList {
 public:
  PreparedList() = default;
  ~PreparedList();
  PreparedList(PreparedList&& other) noexcept;
  PreparedList& operator=(PreparedList&& other) noexcept;
  PreparedList(const PreparedList&) = delete;
  PreparedList& operator=(const PreparedList&) = delete;
  uint32_t size() const { return count_; }

 private:
  friend class CopyEngine;
  BlockPair* device_pairs_ = nullptr;
  uint32_t count_ = 0;
  CopyOp op_ = CopyOp::kRead;
  BlockRegion local_;
  BlockRegion remote_;
};

struct CopyEngineOptions {
  int device = 0;
  /// 16-byte loads each lane keeps in flight per work item: 4 or 8 (chunk = 32 x unroll x 16 B).
  int unroll = 8;
  /// Resident CTAs per SM of the persistent grid; 0 = as many as occupancy allows.
  int ctas_per_sm = 0;
  /// Streaming cache hints (ld.global.cs / st.global.cs): the bytes are touched once.
  bool streaming = true;
};

/// Launches gather/scatter kernels on its own non-blocking stream.
class CopyEngine {
 public:
  /// InvalidArgument for a bad unroll; Unavailable without a device.
  static Result<std::unique_ptr<CopyEngine>> Create(const CopyEngineOptions& options);
  ~CopyEngine();
  CopyEngine(const CopyEngine&) = delete;
  CopyEngine& operator=(const CopyEngine&) = delete;

  /// Validates (ValidateBlockList; on error nothing is launched) and posts one kernel launch
  /// moving every pair. Lists of <= kInlinePairs travel in the kernel parameters; longer ones
  /// are uploaded on the same stream first. An empty list completes at once.
  Result<CopyHandle> Post(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                          std::span<const BlockPair> pairs);
  /// Validates and uploads `pairs` once (synchronously), for repeated posts.
  Result<PreparedList> Prepare(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                               std::span<const BlockPair> pairs);
  Result<CopyHandle> Post(const PreparedList& list);
  /// One launch over `units` of `unit_bytes` each. The caller has checked every address against
  /// its registered regions; this checks only shape: InvalidArgument when unit_bytes is not a
  /// positive multiple of 16, an address is null or not 16-byte aligned, or the list is too long.
  Result<CopyHandle> PostAddresses(CopyOp op, std::span<const AddressPair> units,
                                   uint64_t unit_bytes);

  cudaStream_t stream() const { return stream_; }
  int device() const { return options_.device; }
  /// CTAs of a full persistent grid.
  int grid_ctas() const { return grid_ctas_; }
  int sm_count() const { return sm_count_; }

 private:
  CopyEngine() = default;
  Status Launch(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                const BlockPair* device_pairs, std::span<const BlockPair> inline_pairs,
                uint32_t count);
  Result<CopyHandle> RecordCompletion();

  CopyEngineOptions options_;
  cudaStream_t stream_ = nullptr;
  int grid_ctas_ = 0;
  int sm_count_ = 0;
};

// ---- Helpers for tests and benchmarks (deterministic patterns, checked on the GPU) ----

/// Fills `bytes` (multiple of 16) at `base` with Pattern(seed, word index); async on `stream`.
Status FillPattern(void* base, uint64_t bytes, uint64_t seed, cudaStream_t stream);
/// Compares every byte of `region` on the GPU: block d must equal block src_of[d] of a region
/// filled with `src_seed` when src_of[d] >= 0, else still hold `poison_seed`'s pattern.
/// Returns the number of mismatched 8-byte words (0 = all correct); synchronizes `stream`.
Result<uint64_t> VerifyBlocks(const BlockRegion& region, std::span<const int32_t> src_of,
                              uint64_t src_seed, uint64_t poison_seed, cudaStream_t stream);

}  // namespace kvbridge::cuda_ipc

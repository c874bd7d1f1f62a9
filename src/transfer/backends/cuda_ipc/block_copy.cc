#include "transfer/backends/cuda_ipc/block_copy.h"

#include <unistd.h>

#include <cstring>
#include <utility>

#include "transfer/backends/cuda_ipc/block_copy_launch.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"

namespace kvbridge::cuda_ipc {

std::string_view CopyOpName(CopyOp op) { return op == CopyOp::kRead ? "READ" : "WRITE"; }

namespace {

Status CheckRegion(const BlockRegion& r, const char* which) {
  if (r.base == nullptr) return InvalidArgumentError(std::string(which) + " region: null base");
  if (r.block_bytes == 0 || r.block_bytes % 16 != 0) {
    return InvalidArgumentError(std::string(which) + " region: block_bytes " +
                                std::to_string(r.block_bytes) +
                                " is not a positive multiple of 16");
  }
  if (reinterpret_cast<uintptr_t>(r.base) % 16 != 0) {
    return InvalidArgumentError(std::string(which) + " region: base not 16-byte aligned");
  }
  return OkStatus();
}

}  // namespace

Status ValidateBlockList(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                         std::span<const BlockPair> pairs) {
  RETURN_IF_ERROR(CheckRegion(local, "local"));
  RETURN_IF_ERROR(CheckRegion(remote, "remote"));
  if (local.block_bytes != remote.block_bytes) {
    return InvalidArgumentError("block_bytes differ: local " + std::to_string(local.block_bytes) +
                                ", remote " + std::to_string(remote.block_bytes));
  }
  const uint64_t chunk = 32 * 8 * 16;
  const uint64_t chunks = (local.block_bytes + chunk - 1) / chunk;
  if (pairs.size() > UINT32_MAX || pairs.size() * chunks * 2 > kMaxWorkItems) {
    return InvalidArgumentError("block list too long (" + std::to_string(pairs.size()) +
                                " pairs): split the transfer");
  }
  const uint64_t dst_count = op == CopyOp::kRead ? local.block_count : remote.block_count;
  std::vector<bool> seen(dst_count, false);
  for (size_t i = 0; i < pairs.size(); ++i) {
    const BlockPair& p = pairs[i];
    if (p.local >= local.block_count || p.remote >= remote.block_count) {
      return OutOfRangeError("pair " + std::to_string(i) + " (local " + std::to_string(p.local) +
                             ", remote " + std::to_string(p.remote) + ") outside the regions (" +
                             std::to_string(local.block_count) + " local, " +
                             std::to_string(remote.block_count) + " remote blocks)");
    }
    const uint32_t dst = op == CopyOp::kRead ? p.local : p.remote;
    if (seen[dst]) {
      return InvalidArgumentError("pair " + std::to_string(i) + ": destination block " +
                                  std::to_string(dst) + " appears twice");
    }
    seen[dst] = true;
  }
  return OkStatus();
}

// ---- IpcHandle ----

namespace {
constexpr uint32_t kHandleMagic = 0x4b564349;  // "ICVK"
void PutU64(std::string& s, uint64_t v) {
  for (int i = 0; i < 8; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
void PutU32(std::string& s, uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>((v >> (8 * i)) & 0xff));
}
uint64_t GetU(std::string_view s, size_t at, int n) {
  uint64_t v = 0;
  for (int i = 0; i < n; ++i) v |= uint64_t{static_cast<uint8_t>(s[at + i])} << (8 * i);
  return v;
}
}  // namespace

std::string IpcHandle::Serialize() const {
  std::string s;
  s.reserve(kSerializedBytes);
  PutU32(s, kHandleMagic);
  s.append(handle.data(), handle.size());
  PutU64(s, bytes);
  PutU32(s, static_cast<uint32_t>(device));
  PutU32(s, static_cast<uint32_t>(pid));
  return s;
}

Result<IpcHandle> IpcHandle::Parse(std::string_view s) {
  if (s.size() != kSerializedBytes) {
    return InvalidArgumentError("IPC handle: expected " + std::to_string(kSerializedBytes) +
                                " bytes, got " + std::to_string(s.size()));
  }
  if (GetU(s, 0, 4) != kHandleMagic) return InvalidArgumentError("IPC handle: bad magic");
  IpcHandle h;
  std::memcpy(h.handle.data(), s.data() + 4, h.handle.size());
  size_t at = 4 + h.handle.size();
  h.bytes = GetU(s, at, 8);
  h.device = static_cast<int32_t>(GetU(s, at + 8, 4));
  h.pid = static_cast<int32_t>(GetU(s, at + 12, 4));
  if (h.bytes == 0) return InvalidArgumentError("IPC handle: zero-size allocation");
  if (h.device < 0) return InvalidArgumentError("IPC handle: negative device");
  return h;
}

// ---- DevicePool / ImportedPool ----

Result<std::unique_ptr<DevicePool>> DevicePool::Create(int device, uint64_t bytes) {
  if (bytes == 0) return InvalidArgumentError("DevicePool: zero bytes");
  ASSIGN_OR_RETURN(int n, CudaDeviceCount());
  if (device < 0 || device >= n)
    return InvalidArgumentError("DevicePool: no device " + std::to_string(device));
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  void* p = nullptr;
  KVB_CUDA_RETURN_IF_ERROR(cudaMalloc(&p, bytes));
  return std::unique_ptr<DevicePool>(new DevicePool(device, p, bytes));
}

DevicePool::~DevicePool() {
  if (data_ != nullptr) {
    cudaSetDevice(device_);
    cudaFree(data_);
  }
}

Result<IpcHandle> DevicePool::Export() const {
  cudaIpcMemHandle_t raw;
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
  KVB_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&raw, data_));
  IpcHandle h;
  static_assert(sizeof(raw) == CUDA_IPC_HANDLE_SIZE);
  std::memcpy(h.handle.data(), &raw, sizeof(raw));
  h.bytes = bytes_;
  h.device = device_;
  h.pid = static_cast<int32_t>(getpid());
  return h;
}

Result<std::unique_ptr<ImportedPool>> ImportedPool::Open(const IpcHandle& h, int device) {
  if (h.pid == static_cast<int32_t>(getpid())) {
    return InvalidArgumentError("IPC handle exported by this same process; use the pool directly");
  }
  ASSIGN_OR_RETURN(int n, CudaDeviceCount());
  if (device < 0 || device >= n)
    return InvalidArgumentError("ImportedPool: no device " + std::to_string(device));
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device));
  cudaIpcMemHandle_t raw;
  std::memcpy(&raw, h.handle.data(), sizeof(raw));
  void* p = nullptr;
  cudaError_t err = cudaIpcOpenMemHandle(&p, raw, cudaIpcMemLazyEnablePeerAccess);
  if (err != cudaSuccess) {
    cudaGetLastError();  // clear the non-sticky error so later calls are not affected
    Status st = CudaStatus(err, "cudaIpcOpenMemHandle");
    if (st.code() == StatusCode::kInternal) return InvalidArgumentError(st.message());
    return st;
  }
  return std::unique_ptr<ImportedPool>(new ImportedPool(device, p, h.bytes));
}

ImportedPool::~ImportedPool() {
  if (data_ != nullptr) {
    cudaSetDevice(device_);
    cudaIpcCloseMemHandle(data_);
  }
}

// ---- CopyHandle / PreparedList ----

CopyHandle::~CopyHandle() {
  if (event_ != nullptr) cudaEventDestroy(event_);
}
CopyHandle::CopyHandle(CopyHandle&& o) noexcept
    : event_(std::exchange(o.event_, nullptr)), done_(o.done_), status_(std::move(o.status_)) {}
CopyHandle& CopyHandle::operator=(CopyHandle&& o) noexcept {
  if (this != &o) {
    if (event_ != nullptr) cudaEventDestroy(event_);
    event_ = std::exchange(o.event_, nullptr);
    done_ = o.done_;
    status_ = std::move(o.status_);
  }
  return *this;
}

CopyState CopyHandle::Poll() {
  if (done_) return status_.ok() ? CopyState::kDone : CopyState::kFailed;
  if (event_ == nullptr) {
    done_ = true;
    return CopyState::kDone;
  }
  cudaError_t err = cudaEventQuery(event_);
  if (err == cudaErrorNotReady) return CopyState::kInProgress;
  done_ = true;
  status_ = CudaStatus(err, "copy kernel");
  return status_.ok() ? CopyState::kDone : CopyState::kFailed;
}

Status CopyHandle::Wait() {
  while (Poll() == CopyState::kInProgress) {
  }
  return status_;
}

PreparedList::~PreparedList() {
  if (device_pairs_ != nullptr) cudaFree(device_pairs_);
}
PreparedList::PreparedList(PreparedList&& o) noexcept
    : device_pairs_(std::exchange(o.device_pairs_, nullptr)),
      count_(o.count_),
      op_(o.op_),
      local_(o.local_),
      remote_(o.remote_) {}
PreparedList& PreparedList::operator=(PreparedList&& o) noexcept {
  if (this != &o) {
    if (device_pairs_ != nullptr) cudaFree(device_pairs_);
    device_pairs_ = std::exchange(o.device_pairs_, nullptr);
    count_ = o.count_;
    op_ = o.op_;
    local_ = o.local_;
    remote_ = o.remote_;
  }
  return *this;
}

// ---- CopyEngine ----

Result<std::unique_ptr<CopyEngine>> CopyEngine::Create(const CopyEngineOptions& options) {
  if (options.unroll != 4 && options.unroll != 8) {
    return InvalidArgumentError("CopyEngine: unroll must be 4 or 8");
  }
  if (options.ctas_per_sm < 0) return InvalidArgumentError("CopyEngine: negative ctas_per_sm");
  ASSIGN_OR_RETURN(int n, CudaDeviceCount());
  if (options.device < 0 || options.device >= n) {
    return InvalidArgumentError("CopyEngine: no device " + std::to_string(options.device));
  }
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options.device));
  std::unique_ptr<CopyEngine> e(new CopyEngine());
  e->options_ = options;
  KVB_CUDA_RETURN_IF_ERROR(
      cudaDeviceGetAttribute(&e->sm_count_, cudaDevAttrMultiProcessorCount, options.device));
  ASSIGN_OR_RETURN(int per_sm, BlockCopyOccupancy(options.unroll, options.streaming));
  if (options.ctas_per_sm > 0) per_sm = std::min(per_sm, options.ctas_per_sm);
  e->grid_ctas_ = std::max(1, per_sm) * e->sm_count_;
  KVB_CUDA_RETURN_IF_ERROR(cudaStreamCreateWithFlags(&e->stream_, cudaStreamNonBlocking));
  return e;
}

CopyEngine::~CopyEngine() {
  if (stream_ != nullptr) {
    cudaStreamSynchronize(stream_);
    cudaStreamDestroy(stream_);
  }
}

Result<CopyHandle> CopyEngine::RecordCompletion() {
  CopyHandle h;
  KVB_CUDA_RETURN_IF_ERROR(cudaEventCreateWithFlags(&h.event_, cudaEventDisableTiming));
  KVB_CUDA_RETURN_IF_ERROR(cudaEventRecord(h.event_, stream_));
  return h;
}

Status CopyEngine::Launch(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                          const BlockPair* device_pairs, std::span<const BlockPair> inline_pairs,
                          uint32_t count) {
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  return LaunchBlockCopy(options_.unroll, options_.streaming, grid_ctas_, op, local, remote,
                         device_pairs, inline_pairs, count, stream_);
}

Result<CopyHandle> CopyEngine::Post(CopyOp op, const BlockRegion& local, const BlockRegion& remote,
                                    std::span<const BlockPair> pairs) {
  RETURN_IF_ERROR(ValidateBlockList(op, local, remote, pairs));
  if (pairs.empty()) return CopyHandle();
  const auto count = static_cast<uint32_t>(pairs.size());
  if (count <= kInlinePairs) {
    RETURN_IF_ERROR(Launch(op, local, remote, nullptr, pairs, count));
    return RecordCompletion();
  }
  // Stream-ordered scratch for the list: freed by the stream once the kernel has run. The
  // pageable upload is staged by the driver before cudaMemcpyAsync returns.
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  BlockPair* d = nullptr;
  KVB_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&d), pairs.size_bytes(), stream_));
  Status st = CudaStatus(
      cudaMemcpyAsync(d, pairs.data(), pairs.size_bytes(), cudaMemcpyHostToDevice, stream_),
      "upload block list");
  if (st.ok()) st = Launch(op, local, remote, d, {}, count);
  cudaFreeAsync(d, stream_);
  RETURN_IF_ERROR(st);
  return RecordCompletion();
}

Result<PreparedList> CopyEngine::Prepare(CopyOp op, const BlockRegion& local,
                                         const BlockRegion& remote,
                                         std::span<const BlockPair> pairs) {
  RETURN_IF_ERROR(ValidateBlockList(op, local, remote, pairs));
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  PreparedList list;
  list.count_ = static_cast<uint32_t>(pairs.size());
  list.op_ = op;
  list.local_ = local;
  list.remote_ = remote;
  if (!pairs.empty()) {
    KVB_CUDA_RETURN_IF_ERROR(
        cudaMalloc(reinterpret_cast<void**>(&list.device_pairs_), pairs.size_bytes()));
    KVB_CUDA_RETURN_IF_ERROR(
        cudaMemcpy(list.device_pairs_, pairs.data(), pairs.size_bytes(), cudaMemcpyHostToDevice));
  }
  return list;
}

Result<CopyHandle> CopyEngine::Post(const PreparedList& list) {
  if (list.count_ == 0) return CopyHandle();
  RETURN_IF_ERROR(Launch(list.op_, list.local_, list.remote_, list.device_pairs_, {}, list.count_));
  return RecordCompletion();
}

Result<CopyHandle> CopyEngine::PostAddresses(CopyOp op, std::span<const AddressPair> units,
                                             uint64_t unit_bytes) {
  if (unit_bytes == 0 || unit_bytes % 16 != 0) {
    return InvalidArgumentError("unit_bytes " + std::to_string(unit_bytes) +
                                " is not a positive multiple of 16");
  }
  const uint64_t chunks = (unit_bytes + 2047) / 2048;
  if (units.size() > UINT32_MAX || units.size() * chunks > kMaxWorkItems) {
    return InvalidArgumentError("address list too long: split the transfer");
  }
  for (const AddressPair& u : units) {
    if (u.local == nullptr || u.remote == nullptr ||
        (reinterpret_cast<uintptr_t>(u.local) | reinterpret_cast<uintptr_t>(u.remote)) % 16 != 0) {
      return InvalidArgumentError("address pair null or not 16-byte aligned");
    }
  }
  if (units.empty()) return CopyHandle();
  KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(options_.device));
  const auto count = static_cast<uint32_t>(units.size());
  if (count <= kInlineAddressPairs) {
    RETURN_IF_ERROR(LaunchAddressCopy(options_.unroll, options_.streaming, grid_ctas_, op,
                                      unit_bytes, nullptr, units, count, stream_));
    return RecordCompletion();
  }
  AddressPair* d = nullptr;
  KVB_CUDA_RETURN_IF_ERROR(
      cudaMallocAsync(reinterpret_cast<void**>(&d), units.size_bytes(), stream_));
  Status st = CudaStatus(
      cudaMemcpyAsync(d, units.data(), units.size_bytes(), cudaMemcpyHostToDevice, stream_),
      "upload address list");
  if (st.ok()) {
    st = LaunchAddressCopy(options_.unroll, options_.streaming, grid_ctas_, op, unit_bytes, d, {},
                           count, stream_);
  }
  cudaFreeAsync(d, stream_);
  RETURN_IF_ERROR(st);
  return RecordCompletion();
}

}  // namespace kvbridge::cuda_ipc

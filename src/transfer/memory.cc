#include "kvbridge/transfer/memory.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <string>
#include <utility>

namespace kvbridge::transfer {

std::string_view MemoryKindName(MemoryKind kind) {
  switch (kind) {
    case MemoryKind::kHost:
      return "host";
    case MemoryKind::kCuda:
      return "cuda";
  }
  return "unknown";
}

KvRegistration KvRegistration::FromHostBuffer(const PagedKvLayout& layout,
                                              const HostBuffer& buffer) {
  KvRegistration reg;
  reg.layout = layout;
  const size_t lb = layout.LayerBytes();
  for (int l = 0; l < layout.num_layers; ++l) {
    MemoryRegion r;
    r.base = buffer.data() + static_cast<size_t>(l) * lb;
    r.bytes = lb;
    r.shm_fd = buffer.fd();
    r.shm_offset = static_cast<size_t>(l) * lb;
    reg.layers.push_back(r);
  }
  reg.k_scale.assign(layout.num_layers, 1.0f);
  reg.v_scale.assign(layout.num_layers, 1.0f);
  return reg;
}

KvRegistration KvRegistration::FromDeviceMemory(const PagedKvLayout& layout, void* base,
                                                int device) {
  KvRegistration reg;
  reg.layout = layout;
  const size_t lb = layout.LayerBytes();
  for (int l = 0; l < layout.num_layers; ++l) {
    MemoryRegion r;
    r.kind = MemoryKind::kCuda;
    r.device = device;
    r.base = static_cast<uint8_t*>(base) + static_cast<size_t>(l) * lb;
    r.bytes = lb;
    reg.layers.push_back(r);
  }
  reg.k_scale.assign(layout.num_layers, 1.0f);
  reg.v_scale.assign(layout.num_layers, 1.0f);
  return reg;
}

Status KvRegistration::Validate() const {
  const PagedKvLayout& l = layout;
  if (l.num_layers <= 0 || l.num_kv_heads <= 0 || l.head_dim <= 0 || l.block_size <= 0 ||
      l.num_blocks <= 0) {
    return InvalidArgumentError("registration layout has a non-positive dimension");
  }
  if (layers.size() != static_cast<size_t>(l.num_layers)) {
    return InvalidArgumentError("registration has " + std::to_string(layers.size()) +
                                " layer regions for " + std::to_string(l.num_layers) + " layers");
  }
  for (size_t i = 0; i < layers.size(); ++i) {
    const MemoryRegion& r = layers[i];
    const std::string where = "layer " + std::to_string(i) + ": ";
    if (r.kind != MemoryKind::kHost && r.kind != MemoryKind::kCuda) {
      return InvalidArgumentError(where + "unknown memory kind " +
                                  std::to_string(static_cast<int>(r.kind)));
    }
    if (r.kind != layers[0].kind) {
      return InvalidArgumentError(where + "memory kind " + std::string(MemoryKindName(r.kind)) +
                                  " differs from layer 0's (" +
                                  std::string(MemoryKindName(layers[0].kind)) +
                                  "): one registration is all host or all cuda");
    }
    if (r.kind == MemoryKind::kCuda) {
      if (r.device < 0) {
        return InvalidArgumentError(where + "cuda memory needs a device ordinal >= 0 (got " +
                                    std::to_string(r.device) + ")");
      }
      if (r.device != layers[0].device) {
        return InvalidArgumentError(where + "cuda device " + std::to_string(r.device) +
                                    " differs from layer 0's (" + std::to_string(layers[0].device) +
                                    "): one registration lives on one device");
      }
      if (r.shm_fd >= 0) {
        return InvalidArgumentError(where + "cuda memory cannot carry an shm_fd");
      }
      if (reinterpret_cast<uintptr_t>(r.base) % 16 != 0) {
        return InvalidArgumentError(where + "cuda memory base is not 16-byte aligned");
      }
    }
    if (r.base == nullptr || r.bytes < l.LayerBytes()) {
      return InvalidArgumentError("layer " + std::to_string(i) + " region is smaller than " +
                                  std::to_string(l.LayerBytes()) + " bytes");
    }
  }
  if ((!k_scale.empty() && k_scale.size() != layers.size()) ||
      (!v_scale.empty() && v_scale.size() != layers.size())) {
    return InvalidArgumentError("fp8 scales need one value per layer");
  }
  return OkStatus();
}

Result<HostBuffer> HostBuffer::Allocate(size_t bytes) {
  if (bytes == 0) return InvalidArgumentError("HostBuffer of 0 bytes");
  int fd = ::memfd_create("kvbridge-kv", MFD_CLOEXEC);
  if (fd < 0) return ErrnoToStatus(errno, "memfd_create");
  if (::ftruncate(fd, static_cast<off_t>(bytes)) != 0) {
    int e = errno;
    ::close(fd);
    return ErrnoToStatus(e, "ftruncate");
  }
  void* p = ::mmap(nullptr, bytes, PROT_READ | PROT_WRITE, MAP_SHARED | MAP_POPULATE, fd, 0);
  if (p == MAP_FAILED) {
    int e = errno;
    ::close(fd);
    return ResourceExhaustedError("mmap of " + std::to_string(bytes) +
                                  " bytes: " + ErrnoToStatus(e, "mmap").message());
  }
  HostBuffer b;
  b.data_ = static_cast<uint8_t*>(p);
  b.size_ = bytes;
  b.fd_ = fd;
  return b;
}

HostBuffer::~HostBuffer() {
  if (data_) ::munmap(data_, size_);
  if (fd_ >= 0) ::close(fd_);
}

HostBuffer::HostBuffer(HostBuffer&& o) noexcept
    : data_(std::exchange(o.data_, nullptr)),
      size_(std::exchange(o.size_, 0)),
      fd_(std::exchange(o.fd_, -1)) {}

HostBuffer& HostBuffer::operator=(HostBuffer&& o) noexcept {
  if (this != &o) {
    if (data_) ::munmap(data_, size_);
    if (fd_ >= 0) ::close(fd_);
    data_ = std::exchange(o.data_, nullptr);
    size_ = std::exchange(o.size_, 0);
    fd_ = std::exchange(o.fd_, -1);
  }
  return *this;
}

}  // namespace kvbridge::transfer

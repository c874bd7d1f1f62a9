#include "kvbridge/engine/kv_cache_storage.h"

#include <sys/mman.h>
#include <unistd.h>

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>

#include "kvbridge/common/logging.h"

namespace kvbridge {

namespace {
Status CheckLayoutShape(const PagedKvLayout& l) {
  if (l.num_layers <= 0 || l.num_kv_heads <= 0 || l.head_dim <= 0 || l.block_size <= 0) {
    return InvalidArgumentError("kv cache: layers, kv heads, head_dim and block_size must be > 0");
  }
  return OkStatus();
}
constexpr size_t kAlign = 64;
}  // namespace

Result<int64_t> KvCacheStorage::BlocksForBudget(const PagedKvLayout& layout, int64_t budget_bytes) {
  RETURN_IF_ERROR(CheckLayoutShape(layout));
  int64_t per_block = static_cast<int64_t>(layout.BlockBytes()) * layout.num_layers;
  int64_t n = budget_bytes / per_block;
  if (n < 1) {
    return ResourceExhaustedError("kv cache: budget of " + std::to_string(budget_bytes) +
                                  " bytes is below one block (" + std::to_string(per_block) + ")");
  }
  return std::min<int64_t>(n, std::numeric_limits<int32_t>::max() - 1);
}

Result<std::unique_ptr<KvCacheStorage>> KvCacheStorage::Create(const PagedKvLayout& layout) {
  RETURN_IF_ERROR(CheckLayoutShape(layout));
  if (layout.num_blocks <= 0) return InvalidArgumentError("kv cache: num_blocks must be > 0");
  std::unique_ptr<KvCacheStorage> s(new KvCacheStorage(layout));
  const size_t stride = (layout.LayerBytes() + kAlign - 1) / kAlign * kAlign;
  const size_t total = stride * static_cast<size_t>(layout.num_layers);
  int fd = ::memfd_create("kvbridge-kv-pool", MFD_CLOEXEC);
  if (fd < 0) {
    KVB_LOG_WARN(
        "kv cache: memfd_create failed ({}); the KV pool uses anonymous memory and "
        "cannot be shared with a same-host peer (shm transport unavailable)",
        std::strerror(errno));
  } else if (::ftruncate(fd, static_cast<off_t>(total)) != 0) {
    const int err = errno;
    ::close(fd);
    return ResourceExhaustedError("kv cache: cannot size the memfd to " + std::to_string(total) +
                                  " bytes: " + std::strerror(err));
  }
  void* p =
      fd >= 0 ? ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0)
              : ::mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
  if (p == MAP_FAILED) {
    const int err = errno;
    if (fd >= 0) ::close(fd);
    return ResourceExhaustedError("kv cache: cannot map " + std::to_string(total) +
                                  " bytes: " + std::strerror(err));
  }
  s->map_ = static_cast<uint8_t*>(p);
  s->map_bytes_ = total;
  s->fd_ = fd;
  // Fresh memfd/anonymous pages read as zero; touching them now keeps first-use page faults out
  // of the forward pass (as the zero-fill of the old heap regions did).
  std::memset(s->map_, 0, total);
  for (int l = 0; l < layout.num_layers; ++l) {
    s->layer_offsets_[l] = static_cast<uint64_t>(l) * stride;
    s->view_.layer_base[l] = s->map_ + static_cast<size_t>(l) * stride;
  }
  return s;
}

KvCacheStorage::KvCacheStorage(const PagedKvLayout& layout) {
  view_.layout = layout;
  view_.layer_base.assign(layout.num_layers, nullptr);
  view_.k_scale.assign(layout.num_layers, 1.0f);
  view_.v_scale.assign(layout.num_layers, 1.0f);
  layer_offsets_.assign(layout.num_layers, 0);
}

KvCacheStorage::~KvCacheStorage() {
  if (map_ != nullptr) ::munmap(map_, map_bytes_);
  if (fd_ >= 0) ::close(fd_);
}

void KvCacheStorage::CopyBlock(int32_t src, int32_t dst) {
  const size_t bb = view_.layout.BlockBytes();
  for (uint8_t* base : view_.layer_base) {
    std::memcpy(base + static_cast<size_t>(dst) * bb, base + static_cast<size_t>(src) * bb, bb);
  }
}

void KvCacheStorage::FillNaN() {
  const PagedKvLayout& l = view_.layout;
  const size_t bytes = l.LayerBytes();
  for (uint8_t* base : view_.layer_base) {
    switch (l.dtype) {
      case KvDtype::kFp32: {
        float nan = std::numeric_limits<float>::quiet_NaN();
        for (size_t i = 0; i + 4 <= bytes; i += 4) std::memcpy(base + i, &nan, 4);
        break;
      }
      case KvDtype::kBf16: {
        const uint16_t nan = 0x7FC0;
        for (size_t i = 0; i + 2 <= bytes; i += 2) std::memcpy(base + i, &nan, 2);
        break;
      }
      case KvDtype::kFp8E4M3:
        std::memset(base, 0x7F, bytes);  // e4m3: S.1111.111 is NaN
        break;
    }
  }
}

}  // namespace kvbridge

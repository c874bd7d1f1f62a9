// kvbridge/engine/kv_cache_storage.h — the memory of one rank's paged KV cache.
//
// Owns one 64-byte-aligned region per layer, in the layout of kv_cache_view.h:
//   [num_blocks][2 (K, V)][num_kv_heads][block_size][head_dim] elements of dtype.
// All layers live in one mapping of a memfd (memfd_create + ftruncate + mmap MAP_SHARED), layer l
// at byte layer_offsets()[l] of shm_fd(), so a same-host transfer peer can map the pool (the
// transfer agent's shm backend). If memfd_create fails the pool falls back to anonymous memory
// (logged) and shm_fd() is -1: not shareable, tcp only.
// The block pool (block_pool.h) decides which block ids are in use; this class only holds bytes.
//
//   PagedKvLayout layout{.num_layers = 2, .num_kv_heads = 2, .head_dim = 16, .block_size = 16};
//   ASSIGN_OR_RETURN(int64_t n, KvCacheStorage::BlocksForBudget(layout, 64 << 20));
//   layout.num_blocks = static_cast<int>(n);
//   ASSIGN_OR_RETURN(auto storage, KvCacheStorage::Create(layout));
//   model.Forward(batch, storage->view(), &logits);
//
// Thread-safety: the object is immutable after Create except through the memory it exposes;
// CopyBlock/FillNaN must not race with a forward pass or transfer touching the same blocks.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "kvbridge/common/kv_cache_view.h"
#include "kvbridge/common/status.h"

namespace kvbridge {

class KvCacheStorage {
 public:
  /// Blocks that fit in `budget_bytes` across all layers (budget / (num_layers * BlockBytes())).
  /// Errors: InvalidArgument (non-positive shape), ResourceExhausted (budget below one block).
  static Result<int64_t> BlocksForBudget(const PagedKvLayout& layout, int64_t budget_bytes);
  /// Allocates and zero-fills the regions. Errors: InvalidArgument (bad layout),
  /// ResourceExhausted (allocation failed).
  static Result<std::unique_ptr<KvCacheStorage>> Create(const PagedKvLayout& layout);
  ~KvCacheStorage();
  KvCacheStorage(const KvCacheStorage&) = delete;
  KvCacheStorage& operator=(const KvCacheStorage&) = delete;

  const PagedKvView& view() const { return view_; }
  PagedKvView& mutable_view() { return view_; }
  const PagedKvLayout& layout() const { return view_.layout; }
  /// The memfd holding every layer (owned: closed with the storage), or -1 when the pool is
  /// anonymous memory (memfd_create failed) and cannot be shared with a same-host peer.
  int shm_fd() const { return fd_; }
  /// Byte offset of each layer's region inside shm_fd() (size num_layers, multiples of 64).
  const std::vector<uint64_t>& layer_offsets() const { return layer_offsets_; }
  /// Total bytes over all layers.
  size_t TotalBytes() const { return view_.layout.LayerBytes() * view_.layout.num_layers; }

  /// Copies block `src` to block `dst` in every layer (copy on write of a shared partial block).
  void CopyBlock(int32_t src, int32_t dst);
  /// Fills every byte pattern with NaN (fp32/bf16) or 0x7F (fp8 NaN) — to catch reads of KV that
  /// was never written.
  void FillNaN();

 private:
  explicit KvCacheStorage(const PagedKvLayout& layout);
  PagedKvView view_;
  std::vector<uint64_t> layer_offsets_;
  uint8_t* map_ = nullptr;  ///< the whole mapping (munmap'd in the destructor)
  size_t map_bytes_ = 0;
  int fd_ = -1;  ///< memfd (closed in the destructor), or -1
};

}  // namespace kvbridge

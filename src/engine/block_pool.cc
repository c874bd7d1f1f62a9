#include "kvbridge/engine/block_pool.h"

#include <cstring>
#include <string>

namespace kvbridge {

Result<std::unique_ptr<BlockPool>> BlockPool::Create(const BlockPoolOptions& options) {
  if (options.num_blocks <= 0 || options.num_blocks >= (int64_t{1} << 31)) {
    return InvalidArgumentError("block pool: num_blocks must be in [1, 2^31), got " +
                                std::to_string(options.num_blocks));
  }
  if (options.block_size <= 0) {
    return InvalidArgumentError("block pool: block_size must be > 0, got " +
                                std::to_string(options.block_size));
  }
  return std::unique_ptr<BlockPool>(new BlockPool(options));
}

BlockPool::BlockPool(const BlockPoolOptions& options)
    : options_(options), blocks_(static_cast<size_t>(options.num_blocks)) {
  free_list_.reserve(blocks_.size());
  // Push in reverse so block 0 is handed out first (readable traces).
  for (int64_t b = options.num_blocks - 1; b >= 0; --b)
    free_list_.push_back(static_cast<int32_t>(b));
  num_free_ = options.num_blocks;
}

void BlockPool::LruPushBack(int32_t b) {
  Block& blk = blocks_[b];
  blk.lru_prev = lru_tail_;
  blk.lru_next = -1;
  if (lru_tail_ >= 0) blocks_[lru_tail_].lru_next = b;
  lru_tail_ = b;
  if (lru_head_ < 0) lru_head_ = b;
  blk.in_lru = true;
}

void BlockPool::LruRemove(int32_t b) {
  Block& blk = blocks_[b];
  if (blk.lru_prev >= 0)
    blocks_[blk.lru_prev].lru_next = blk.lru_next;
  else
    lru_head_ = blk.lru_next;
  if (blk.lru_next >= 0)
    blocks_[blk.lru_next].lru_prev = blk.lru_prev;
  else
    lru_tail_ = blk.lru_prev;
  blk.lru_prev = blk.lru_next = -1;
  blk.in_lru = false;
}

void BlockPool::Retire(int32_t b) {
  --num_active_;
  if (blocks_[b].has_hash) {
    LruPushBack(b);
    ++num_cached_free_;
  } else {
    free_list_.push_back(b);
    ++num_free_;
  }
}

int32_t BlockPool::TakeFresh() {
  int32_t b;
  if (!free_list_.empty()) {
    b = free_list_.back();
    free_list_.pop_back();
    --num_free_;
  } else {
    b = lru_head_;
    LruRemove(b);
    --num_cached_free_;
    Block& blk = blocks_[b];
    cached_.erase(blk.hash);
    if (listener_ != nullptr) listener_->OnBlockEvicted(blk.hash);
    blk.has_hash = false;
    blk.hash = {};
    ++num_evictions_;
  }
  blocks_[b].ref = 1;
  ++num_active_;
  return b;
}

int BlockPool::MatchPrefix(std::span<const BlockHash> hashes,
                           std::vector<int32_t>* block_ids) const {
  if (!options_.enable_prefix_caching) return 0;
  int n = 0;
  for (const BlockHash& h : hashes) {
    auto it = cached_.find(h);
    if (it == cached_.end()) break;
    block_ids->push_back(it->second);
    ++n;
  }
  return n;
}

bool BlockPool::CanAllocate(int64_t num_new, std::span<const int32_t> reuse) const {
  if (num_new < 0) return false;
  int64_t available = NumAvailable();
  // Reused cached-free blocks leave the LRU list, so they no longer count as available.
  std::vector<int32_t> seen;
  for (int32_t b : reuse) {
    if (b < 0 || b >= num_blocks()) return false;
    const Block& blk = blocks_[b];
    if (blk.ref == 0 && blk.hold == 0) {
      if (!blk.has_hash) return false;
      bool dup = false;
      for (int32_t s : seen) dup |= s == b;
      if (!dup) {
        seen.push_back(b);
        --available;
      }
    }
  }
  return num_new <= available;
}

Status BlockPool::Allocate(int64_t num_new, std::span<const int32_t> reuse,
                           std::vector<int32_t>* out) {
  if (num_new < 0) return InvalidArgumentError("block pool: negative allocation");
  for (int32_t b : reuse) {
    if (b < 0 || b >= num_blocks()) {
      return InvalidArgumentError("block pool: reuse of block " + std::to_string(b) +
                                  " out of range");
    }
    const Block& blk = blocks_[b];
    if (blk.ref == 0 && blk.hold == 0 && !blk.has_hash) {
      return InvalidArgumentError("block pool: reuse of free block " + std::to_string(b));
    }
  }
  if (!CanAllocate(num_new, reuse)) {
    return ResourceExhaustedError("block pool: need " + std::to_string(num_new) + " blocks, " +
                                  std::to_string(NumAvailable()) + " available");
  }
  // Apply: take the prefix hits first so eviction below cannot pick them.
  for (int32_t b : reuse) {
    Block& blk = blocks_[b];
    if (blk.ref == 0 && blk.hold == 0) {
      LruRemove(b);
      --num_cached_free_;
      ++num_active_;
    }
    ++blk.ref;
  }
  for (int64_t i = 0; i < num_new; ++i) out->push_back(TakeFresh());
  return OkStatus();
}

Status BlockPool::Share(std::span<const int32_t> blocks) {
  for (int32_t b : blocks) {
    if (b < 0 || b >= num_blocks()) {
      return InvalidArgumentError("block pool: share of block " + std::to_string(b) +
                                  " out of range");
    }
    if (blocks_[b].ref == 0) {
      return FailedPreconditionError("block pool: share of unreferenced block " +
                                     std::to_string(b));
    }
  }
  for (int32_t b : blocks) ++blocks_[b].ref;
  return OkStatus();
}

Status BlockPool::Release(std::span<const int32_t> blocks) {
  std::unordered_map<int32_t, int> count;
  for (int32_t b : blocks) {
    if (b < 0 || b >= num_blocks()) {
      return InvalidArgumentError("block pool: release of block " + std::to_string(b) +
                                  " out of range");
    }
    if (++count[b] > blocks_[b].ref) {
      return FailedPreconditionError("block pool: release of block " + std::to_string(b) +
                                     " with ref " + std::to_string(blocks_[b].ref));
    }
  }
  for (int32_t b : blocks) {
    Block& blk = blocks_[b];
    if (--blk.ref == 0 && blk.hold == 0) Retire(b);
  }
  return OkStatus();
}

void BlockPool::CacheFullBlock(int32_t block, const BlockHash& hash) {
  if (!options_.enable_prefix_caching || block < 0 || block >= num_blocks()) return;
  Block& blk = blocks_[block];
  if (blk.has_hash || (blk.ref == 0 && blk.hold == 0)) return;
  if (!cached_.emplace(hash, block).second) return;
  blk.has_hash = true;
  blk.hash = hash;
  if (listener_ != nullptr) listener_->OnBlockCached(hash);
}

Status BlockPool::Hold(std::string_view key, std::span<const int32_t> blocks) {
  std::string k(key);
  if (holds_.count(k)) return AlreadyExistsError("block pool: hold '" + k + "' already exists");
  for (int32_t b : blocks) {
    if (b < 0 || b >= num_blocks()) {
      return InvalidArgumentError("block pool: hold of block " + std::to_string(b) +
                                  " out of range");
    }
    if (blocks_[b].ref == 0 && blocks_[b].hold == 0) {
      return FailedPreconditionError("block pool: hold of inactive block " + std::to_string(b));
    }
  }
  for (int32_t b : blocks) {
    if (blocks_[b].hold++ == 0) ++num_held_;
  }
  holds_.emplace(std::move(k), std::vector<int32_t>(blocks.begin(), blocks.end()));
  return OkStatus();
}

Status BlockPool::ReleaseHold(std::string_view key) {
  auto it = holds_.find(std::string(key));
  if (it == holds_.end()) {
    return FailedPreconditionError("block pool: hold '" + std::string(key) +
                                   "' is not held (never held or already released)");
  }
  for (int32_t b : it->second) {
    Block& blk = blocks_[b];
    if (--blk.hold == 0) {
      --num_held_;
      if (blk.ref == 0) Retire(b);
    }
  }
  holds_.erase(it);
  return OkStatus();
}

Status BlockPool::CheckInvariants() const {
  int64_t free = 0, cached_free = 0, active = 0, held = 0, lru_len = 0;
  for (int64_t i = 0; i < num_blocks(); ++i) {
    const Block& b = blocks_[i];
    if (b.ref < 0 || b.hold < 0)
      return InternalError("negative count on block " + std::to_string(i));
    if (b.ref > 0 || b.hold > 0) {
      ++active;
      if (b.in_lru) return InternalError("active block in LRU: " + std::to_string(i));
    } else if (b.has_hash) {
      ++cached_free;
      if (!b.in_lru) return InternalError("cached-free block not in LRU: " + std::to_string(i));
    } else {
      ++free;
    }
    if (b.hold > 0) ++held;
    if (b.has_hash) {
      auto it = cached_.find(b.hash);
      if (it == cached_.end() || it->second != i) {
        return InternalError("hash of block " + std::to_string(i) + " not mapped to it");
      }
    }
  }
  for (int32_t b = lru_head_; b >= 0; b = blocks_[b].lru_next) {
    if (++lru_len > num_blocks()) return InternalError("LRU cycle");
  }
  if (free != num_free_ || cached_free != num_cached_free_ || active != num_active_ ||
      held != num_held_) {
    return InternalError("counters drifted");
  }
  if (free + cached_free + active != num_blocks()) return InternalError("accounting broken");
  if (static_cast<int64_t>(free_list_.size()) != free) return InternalError("free list size");
  if (lru_len != cached_free) return InternalError("LRU length");
  if (static_cast<int64_t>(cached_.size()) > num_blocks()) return InternalError("hash map size");
  std::unordered_map<int32_t, int> hold_refs;
  for (const auto& [k, v] : holds_) {
    for (int32_t b : v) ++hold_refs[b];
  }
  for (int64_t i = 0; i < num_blocks(); ++i) {
    auto it = hold_refs.find(static_cast<int32_t>(i));
    int expected = it == hold_refs.end() ? 0 : it->second;
    if (expected != blocks_[i].hold)
      return InternalError("hold count of block " + std::to_string(i));
  }
  return OkStatus();
}

}  // namespace kvbridge

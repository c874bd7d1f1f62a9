#include "kvbridge/proxy/kv_index.h"

#include <algorithm>
#include <bit>

namespace kvbridge::proxy {

KvIndex::KvIndex(KvIndexOptions options) : options_(options) {
  options_.max_blocks = std::max<size_t>(options_.max_blocks, 1);
}

std::string KvIndex::NextQuery(const std::string& id, int timeout_ms) const {
  uint64_t since = 0;
  std::string inc;
  if (auto it = engines_.find(id); it != engines_.end()) {
    since = it->second.view.next_since;
    inc = it->second.view.incarnation;
  }
  std::string q = "since=" + std::to_string(inc.empty() ? 0 : since);
  if (!inc.empty()) q += "&incarnation=" + inc;  // hex digits: nothing to escape
  q += "&timeout_ms=" + std::to_string(std::max(timeout_ms, 0));
  return q;
}

void KvIndex::Insert(const BlockHash& h, int slot) {
  const uint64_t bit = uint64_t{1} << slot;
  auto it = entries_.find(h);
  if (it != entries_.end()) {
    if ((it->second.mask & bit) == 0) {
      it->second.mask |= bit;
      ++slot_count_[slot];
    }
    lru_.splice(lru_.end(), lru_, it->second.lru);  // most recently stored
    return;
  }
  if (entries_.size() >= options_.max_blocks) {
    const BlockHash victim = lru_.front();
    auto v = entries_.find(victim);
    for (uint64_t m = v->second.mask; m != 0; m &= m - 1) --slot_count_[std::countr_zero(m)];
    entries_.erase(v);
    lru_.pop_front();
    ++evictions_;
  }
  lru_.push_back(h);
  entries_.emplace(h, Entry{bit, std::prev(lru_.end())});
  ++slot_count_[slot];
}

void KvIndex::Remove(const BlockHash& h, int slot) {
  const uint64_t bit = uint64_t{1} << slot;
  auto it = entries_.find(h);
  if (it == entries_.end() || (it->second.mask & bit) == 0) return;
  it->second.mask &= ~bit;
  --slot_count_[slot];
  if (it->second.mask == 0) {
    lru_.erase(it->second.lru);
    entries_.erase(it);
  }
}

void KvIndex::ClearSlot(int slot) {
  if (slot_count_[slot] == 0) return;
  const uint64_t bit = uint64_t{1} << slot;
  for (auto it = entries_.begin(); it != entries_.end();) {
    if ((it->second.mask & bit) != 0) {
      it->second.mask &= ~bit;
      if (it->second.mask == 0) {
        lru_.erase(it->second.lru);
        it = entries_.erase(it);
        continue;
      }
    }
    ++it;
  }
  slot_count_[slot] = 0;
}

void KvIndex::ApplyEvent(const KvEvent& e, EngineState& st) {
  if (e.op == KvEventOp::kStored) {
    Insert(e.hash, st.slot);
  } else {
    Remove(e.hash, st.slot);
  }
  st.view.next_since = e.seq;
}

Status KvIndex::Apply(const std::string& id, const KvEventBatch& batch) {
  auto it = engines_.find(id);
  if (it == engines_.end()) {
    if (free_slots_ == 0) {
      return ResourceExhaustedError("kv index: " + std::to_string(kMaxEngines) +
                                    " engines indexed already; " + id + " is not");
    }
    EngineState st;
    st.slot = std::countr_zero(free_slots_);
    free_slots_ &= ~(uint64_t{1} << st.slot);
    it = engines_.emplace(id, std::move(st)).first;
  }
  EngineState& st = it->second;
  auto refuse = [&](std::string why) {
    st.view.incarnation.clear();  // the next poll asks for a snapshot
    ++st.view.gaps;
    return FailedPreconditionError("kv index: " + id + ": " + why);
  };
  if (batch.reset) {
    ClearSlot(st.slot);
    st.view.incarnation = batch.incarnation;
    st.view.block_size = batch.block_size;
    st.view.root = batch.root;
    ++st.view.resets;
    for (const BlockHash& h : batch.snapshot) Insert(h, st.slot);
    st.view.next_since = batch.next_since;
    for (const KvEvent& e : batch.events) {
      if (e.seq > st.view.next_since) ApplyEvent(e, st);
    }
  } else {
    if (st.view.incarnation.empty() || batch.incarnation != st.view.incarnation) {
      st.view.num_blocks = slot_count_[st.slot];
      return refuse("events of incarnation '" + batch.incarnation + "' without a snapshot");
    }
    for (const KvEvent& e : batch.events) {
      if (e.seq <= st.view.next_since) continue;  // duplicate or stale
      if (e.seq != st.view.next_since + 1) {
        st.view.num_blocks = slot_count_[st.slot];
        return refuse("gap: seq " + std::to_string(e.seq) + " after " +
                      std::to_string(st.view.next_since));
      }
      ApplyEvent(e, st);
    }
  }
  st.view.num_blocks = slot_count_[st.slot];
  return OkStatus();
}

void KvIndex::DropEngine(const std::string& id) {
  auto it = engines_.find(id);
  if (it == engines_.end()) return;
  ClearSlot(it->second.slot);
  free_slots_ |= uint64_t{1} << it->second.slot;
  engines_.erase(it);
}

std::vector<int> KvIndex::PrefixBlocks(std::span<const BlockHash> hashes,
                                       std::span<const std::string> engines) const {
  std::vector<int> out(engines.size(), 0);
  uint64_t alive = 0;
  int slot_of[kMaxEngines];
  std::fill(std::begin(slot_of), std::end(slot_of), -1);
  for (size_t i = 0; i < engines.size(); ++i) {
    auto it = engines_.find(engines[i]);
    if (it == engines_.end() || it->second.view.incarnation.empty()) continue;
    alive |= uint64_t{1} << it->second.slot;
    slot_of[it->second.slot] = static_cast<int>(i);
  }
  // Each engine's prefix ends where its bit drops out of `alive`: each bit is written once.
  int depth = 0;
  for (const BlockHash& h : hashes) {
    if (alive == 0) break;
    auto it = entries_.find(h);
    const uint64_t next = it == entries_.end() ? 0 : alive & it->second.mask;
    for (uint64_t m = alive & ~next; m != 0; m &= m - 1) out[slot_of[std::countr_zero(m)]] = depth;
    alive = next;
    if (alive == 0) break;
    ++depth;
  }
  for (uint64_t m = alive; m != 0; m &= m - 1) out[slot_of[std::countr_zero(m)]] = depth;
  return out;
}

std::optional<KvEngineView> KvIndex::Engine(const std::string& id) const {
  auto it = engines_.find(id);
  if (it == engines_.end()) return std::nullopt;
  return it->second.view;
}

std::vector<std::string> KvIndex::Engines() const {
  std::vector<std::string> out;
  for (const auto& [id, st] : engines_) out.push_back(id);
  return out;
}

size_t KvIndex::num_entries() const {
  size_t n = 0;
  for (size_t c : slot_count_) n += c;
  return n;
}

}  // namespace kvbridge::proxy

#include "kvbridge/engine/kv_event_log.h"

#include <algorithm>
#include <charconv>
#include <cstdio>
#include <random>

namespace kvbridge {

namespace {

std::string RandomIncarnation() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  char buf[17];
  std::snprintf(buf, sizeof buf, "%016llx", static_cast<unsigned long long>(v));
  return buf;
}

}  // namespace

KvEventLog::KvEventLog(KvEventLogOptions options)
    : options_(std::move(options)),
      incarnation_(options_.incarnation.empty() ? RandomIncarnation() : options_.incarnation),
      root_(RootBlockHash(options_.model_fingerprint)) {}

void KvEventLog::OnBlockCached(const BlockHash& hash) { Append(KvEventOp::kStored, hash); }
void KvEventLog::OnBlockEvicted(const BlockHash& hash) { Append(KvEventOp::kRemoved, hash); }

void KvEventLog::Append(KvEventOp op, const BlockHash& hash) {
  MutexLock l(&mu_);
  if (op == KvEventOp::kStored) {
    cached_.insert(hash);
  } else {
    cached_.erase(hash);
  }
  ring_.push_back(KvEvent{++head_seq_, op, hash});
  while (ring_.size() > std::max<size_t>(options_.capacity, 1)) ring_.pop_front();
  if (waiters_ > 0) cv_.notify_all();
}

uint64_t KvEventLog::head_seq() const {
  MutexLock l(&mu_);
  return head_seq_;
}

size_t KvEventLog::num_cached() const {
  MutexLock l(&mu_);
  return cached_.size();
}

bool KvEventLog::HasNewsLocked(uint64_t since, std::string_view incarnation) const {
  if (incarnation != incarnation_ || since > head_seq_) return true;  // a reset
  return since < head_seq_;
}

KvEventBatch KvEventLog::ReadLocked(uint64_t since, std::string_view incarnation,
                                    size_t max_events) const {
  KvEventBatch b;
  b.incarnation = incarnation_;
  b.block_size = options_.block_size;
  b.root = root_;
  b.head_seq = head_seq_;
  const uint64_t oldest = ring_.empty() ? head_seq_ + 1 : ring_.front().seq;
  if (incarnation != incarnation_ || since > head_seq_ || since + 1 < oldest) {
    b.reset = true;
    b.snapshot.assign(cached_.begin(), cached_.end());
    b.next_since = head_seq_;
    return b;
  }
  const size_t first = static_cast<size_t>(since + 1 - oldest);  // index of seq since + 1
  const size_t n = std::min(ring_.size() - first, std::max<size_t>(max_events, 1));
  b.events.assign(ring_.begin() + static_cast<std::ptrdiff_t>(first),
                  ring_.begin() + static_cast<std::ptrdiff_t>(first + n));
  b.next_since = n > 0 ? b.events.back().seq : since;
  return b;
}

KvEventBatch KvEventLog::Read(uint64_t since, std::string_view incarnation,
                              size_t max_events) const {
  MutexLock l(&mu_);
  return ReadLocked(since, incarnation, max_events);
}

KvEventBatch KvEventLog::WaitAndRead(uint64_t since, std::string_view incarnation,
                                     size_t max_events, std::chrono::milliseconds timeout) {
  MutexLock l(&mu_);
  if (timeout.count() > 0 && !closed_ && !HasNewsLocked(since, incarnation)) {
    const auto deadline = std::chrono::steady_clock::now() + timeout;
    ++waiters_;
    while (!closed_ && !HasNewsLocked(since, incarnation)) {
      if (cv_.wait_until(l.native(), deadline) == std::cv_status::timeout) break;
    }
    --waiters_;
  }
  return ReadLocked(since, incarnation, max_events);
}

void KvEventLog::Close() {
  MutexLock l(&mu_);
  closed_ = true;
  cv_.notify_all();
}

namespace {

// The query value of `key` as an integer in [0, max]; `def` when absent; nullopt when malformed.
std::optional<uint64_t> QueryInt(const HttpRequest& req, const char* key, uint64_t def,
                                 uint64_t max) {
  auto it = req.query.find(key);
  if (it == req.query.end()) return def;
  const std::string& s = it->second;
  uint64_t v = 0;
  auto [p, ec] = std::from_chars(s.data(), s.data() + s.size(), v);
  if (ec != std::errc() || p != s.data() + s.size() || s.empty()) return std::nullopt;
  return std::min(v, max);
}

}  // namespace

Route KvEventsRoute(std::shared_ptr<KvEventLog> log, std::string cluster_token) {
  return Route{"GET", "/v1/kv/events",
               [log = std::move(log), token = std::move(cluster_token)](const HttpRequest& req) {
                 if (!ClusterTokenMatches(req, token)) {
                   return OpenAiErrorResponse(401, "missing or wrong cluster token");
                 }
                 auto since = QueryInt(req, "since", 0, UINT64_MAX);
                 auto timeout_ms = QueryInt(req, "timeout_ms", 0, 30000);
                 auto max_events = QueryInt(req, "max_events", 4096, 65536);
                 if (!since || !timeout_ms || !max_events) {
                   return OpenAiErrorResponse(
                       400, "since, timeout_ms and max_events must be integers >= 0", "since");
                 }
                 std::string incarnation;
                 if (auto it = req.query.find("incarnation"); it != req.query.end())
                   incarnation = it->second;
                 KvEventBatch b = log->WaitAndRead(*since, incarnation, *max_events,
                                                   std::chrono::milliseconds(*timeout_ms));
                 return HttpResponse{200, KvEventBatchJson(b), "application/json"};
               }};
}

}  // namespace kvbridge

#include "kvbridge/connector/kvbridge_connector.h"

#include <httplib.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <map>
#include <mutex>
#include <optional>
#include <random>
#include <set>
#include <thread>
#include <variant>

#include "kvbridge/common/http_route.h"
#include "kvbridge/common/logging.h"
#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/connector/connector_logic.h"
#include "kvbridge/connector/decode_core.h"
#include "kvbridge/connector/prefill_core.h"
#include "kvbridge/connector/tp_plan.h"
#include "kvbridge/connector/write_decode_core.h"
#include "kvbridge/connector/write_prefill_core.h"
#include "kvbridge/transfer/agent.h"
#include "kvbridge/transfer/metadata.h"

namespace kvbridge {
namespace {

using nlohmann::json;
namespace xfer = transfer;

std::string RandomHex(int n) {
  std::random_device rd;
  std::mt19937_64 g(
      (static_cast<uint64_t>(rd()) << 32) ^ rd() ^
      static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count()));
  static const char* kHex = "0123456789abcdef";
  std::string s;
  for (int i = 0; i < n; ++i) s += kHex[g() % 16];
  return s;
}

// Test-only knob (docs/protocol.md "Test-only switches"): KVBRIDGE_DEBUG_READ_DONE_DELAY_MS=N
// holds every ended READ for N ms before the decode core hears of it (so a test can kill a decode
// "after its READ began"). Refused unless KVBRIDGE_DEBUG=1, so it never slips into production.
Result<int> DebugReadDoneDelayMs() {
  const char* v = std::getenv("KVBRIDGE_DEBUG_READ_DONE_DELAY_MS");
  if (v == nullptr || *v == '\0') return 0;
  const char* dbg = std::getenv("KVBRIDGE_DEBUG");
  if (dbg == nullptr || std::string_view(dbg) != "1") {
    return FailedPreconditionError(
        "kv connector: KVBRIDGE_DEBUG_READ_DONE_DELAY_MS is a test-only switch; it is refused "
        "unless KVBRIDGE_DEBUG=1");
  }
  char* end = nullptr;
  const long ms = std::strtol(v, &end, 10);
  if (end == v || *end != '\0' || ms < 0 || ms > 600000) {
    return InvalidArgumentError(
        "kv connector: KVBRIDGE_DEBUG_READ_DONE_DELAY_MS must be an "
        "integer in [0, 600000], got \"" +
        std::string(v) + "\"");
  }
  return static_cast<int>(ms);
}

std::string AgentName(const std::string& engine_id, int rank) {
  return engine_id + "/rank" + std::to_string(rank);
}

// True when a same-host peer can map this KV memory (shm backend): the engine gave its memfd and
// one offset per layer.
bool KvShareable(const PagedKvView& view, int shm_fd, const std::vector<uint64_t>& layer_offsets) {
  return shm_fd >= 0 && layer_offsets.size() == static_cast<size_t>(view.layout.num_layers);
}

// One rank's KV memory as its transfer agent registers it (host memory; the memfd and per-layer
// offsets when `shareable`).
xfer::KvRegistration KvHostRegistration(const PagedKvView& view, int shm_fd,
                                        const std::vector<uint64_t>& layer_offsets,
                                        bool shareable) {
  xfer::KvRegistration reg;
  reg.layout = view.layout;
  for (int l = 0; l < view.layout.num_layers; ++l) {
    reg.layers.push_back(
        xfer::MemoryRegion{.kind = xfer::MemoryKind::kHost,
                           .device = -1,
                           .base = view.layer_base[l],
                           .bytes = view.layout.LayerBytes(),
                           .shm_fd = shareable ? shm_fd : -1,
                           .shm_offset = shareable ? static_cast<size_t>(layer_offsets[l]) : 0});
  }
  reg.k_scale = view.k_scale;
  reg.v_scale = view.v_scale;
  return reg;
}

// A GPU engine's KV pool (device memory of `device`, one cudaMalloc) as its agent registers it:
// MemoryKind::kCuda, moved by cuda_ipc only.
xfer::KvRegistration KvDeviceRegistration(const PagedKvView& view, int device) {
  xfer::KvRegistration reg;
  reg.layout = view.layout;
  for (int l = 0; l < view.layout.num_layers; ++l) {
    reg.layers.push_back(xfer::MemoryRegion{.kind = xfer::MemoryKind::kCuda,
                                            .device = device,
                                            .base = view.layer_base[l],
                                            .bytes = view.layout.LayerBytes()});
  }
  reg.k_scale = view.k_scale;
  reg.v_scale = view.v_scale;
  return reg;
}

// Registers local rank `rank`'s KV memory with its agent, shareable with a same-host peer (shm
// backend) when it can be (KvShareable); otherwise only tcp/ucx can move it. A GPU engine's pool
// (cuda_device >= 0) is registered as device memory (cuda_ipc). FailedPrecondition when
// `transport` is shm and the memory is not shareable; the agent's error otherwise.
Status RegisterKvMemory(xfer::TransferAgent& agent, KvTransport transport, int rank,
                        const PagedKvView& view, int shm_fd,
                        const std::vector<uint64_t>& layer_offsets, int cuda_device = -1) {
  if (cuda_device >= 0) {
    return agent.RegisterMemory(KvDeviceRegistration(view, cuda_device))
        .WithPrefix("kv connector: registering the GPU KV pool (device " +
                    std::to_string(cuda_device) + ")");
  }
  const bool shareable = KvShareable(view, shm_fd, layer_offsets);
  if (transport == KvTransport::kShm && !shareable) {
    if (rank != 0) {
      return FailedPreconditionError("kv connector: transport \"shm\" needs rank " +
                                     std::to_string(rank) + "'s KV pool in shareable memory");
    }
    return FailedPreconditionError(
        "kv connector: transport \"shm\" needs the engine's KV pool in shareable (memfd) "
        "memory, and this pool is not (memfd_create failed?); use transport \"tcp\" or "
        "\"auto\"");
  }
  return agent.RegisterMemory(KvHostRegistration(view, shm_fd, layer_offsets, shareable))
      .WithPrefix(rank == 0
                      ? std::string("kv connector: registering the KV pool")
                      : "kv connector: registering rank " + std::to_string(rank) + "'s KV shard");
}

// Events that other threads hand to the engine thread.
// A posted READ (decode side) or WRITE (prefill side, WRITE mode) ended.
struct EvTransferEnded {
  KvTransferMode op;
  uint64_t id;
  Status status;
  double seconds;  // from its post to its end (the watcher's clock)
};
struct EvMessage {
  ControlMessage msg;
  uint64_t reply_token;
};
struct EvPeer {
  std::string key;  // engine_id + "/rank" + r
  Result<std::string> agent_name;
};
// A local agent saw its connection to or from peer agent `agent_name` close (issue 21).
struct EvPeerLost {
  std::string agent_name;
};
using Event = std::variant<EvTransferEnded, EvMessage, EvPeer, EvPeerLost>;

}  // namespace

// Shared between the runtime handle, the engine's connector, HTTP routes and agent callbacks.
class KvBridgeRuntime::Impl {
 public:
  KvBridgeOptions options;
  std::string engine_id;

  Mutex mu;
  std::deque<Event> inbox GUARDED_BY(mu);
  std::function<void()> wake GUARDED_BY(mu);
  std::string metadata_blob GUARDED_BY(mu);
  std::map<std::string, std::set<int>> held_snapshot GUARDED_BY(mu);      // READ holds
  std::map<std::string, std::set<int>> writable_snapshot GUARDED_BY(mu);  // WRITE offers
  std::map<uint64_t, xfer::Notification> reply_paths GUARDED_BY(mu);
  std::map<uint64_t, int> reply_ranks GUARDED_BY(mu);  // token -> local rank (absent: rank 0)
  std::vector<std::string> rank_metadata_blobs GUARDED_BY(mu);  // rank r's metadata, r < tp
  uint64_t next_reply_token GUARDED_BY(mu) = 1;
  bool connector_made GUARDED_BY(mu) = false;
  std::map<std::string, std::string> peer_backends GUARDED_BY(mu);  // peer agent -> backend
  KvBridgeStats stats GUARDED_BY(mu);
  std::atomic<int64_t> reads_inflight{0};
  // Peer requests the hold check refused (tcp serving side), by the peer's op.
  std::atomic<int64_t> refused_reads{0}, refused_writes{0};
  std::atomic<int> block_size{16};  // the engine's, once its connector exists

  void Push(Event e) {
    std::function<void()> w;
    {
      MutexLock l(&mu);
      inbox.push_back(std::move(e));
      w = wake;
    }
    if (w) w();
  }
  // A control message that local rank `rank`'s agent received (any agent thread): decoded and
  // queued for the engine thread, with a reply path (and the rank to reply through) when the
  // sender waits for a reply. One that does not decode is logged and dropped.
  void OnNotification(transfer::Notification n, int rank) {
    auto m = DecodeMessage(n.payload);
    if (!m.ok()) {
      KVB_LOG_WARN("kv connector: bad control message from {}: {}", n.peer, m.status().ToString());
      return;
    }
    uint64_t token = 0;
    if (n.wants_reply) {
      MutexLock l(&mu);
      token = next_reply_token++;
      reply_paths[token] = n;
      if (rank != 0) reply_ranks[token] = rank;
    }
    Push(EvMessage{std::move(*m), token});
  }
  std::deque<Event> TakeInbox() {
    MutexLock l(&mu);
    std::deque<Event> out;
    out.swap(inbox);
    return out;
  }
};

namespace {

// One background thread running queued jobs (metadata fetch + AddPeer: may block on the network).
class Worker {
 public:
  Worker() : thread_([this] { Run(); }) {}
  ~Worker() {
    {
      MutexLock l(&mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Add(std::function<void()> job) {
    {
      MutexLock l(&mu_);
      jobs_.push_back(std::move(job));
    }
    cv_.notify_all();
  }

 private:
  void Run() {
    MutexLock l(&mu_);
    while (true) {
      cv_.wait(l.native(), [&]() REQUIRES(mu_) { return stop_ || !jobs_.empty(); });
      if (stop_) return;
      auto job = std::move(jobs_.front());
      jobs_.pop_front();
      l.Unlock();
      job();
      l.Lock();
    }
  }
  Mutex mu_;
  std::condition_variable cv_;
  std::deque<std::function<void()>> jobs_ GUARDED_BY(mu_);
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;
};

// Watches posted READ and WRITE handles (the agent has no completion callback) and reports their
// end as EvTransferEnded.
class TransferWatcher {
 public:
  explicit TransferWatcher(std::shared_ptr<KvBridgeRuntime::Impl> impl)
      : impl_(std::move(impl)), thread_([this] { Run(); }) {}
  ~TransferWatcher() {
    {
      MutexLock l(&mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Add(KvTransferMode op, uint64_t id, xfer::TransferHandle h) {
    {
      MutexLock l(&mu_);
      items_.push_back({op, id, std::move(h), std::chrono::steady_clock::now()});
    }
    cv_.notify_all();
  }
  // Test-only (KVBRIDGE_DEBUG_READ_DONE_DELAY_MS): hold each ended READ this long before
  // reporting it, so a test can act "after the READ began, before the decode notified".
  void SetDebugReadReportDelay(std::chrono::milliseconds d) {
    MutexLock l(&mu_);
    debug_read_delay_ = d;
  }

 private:
  struct Item {
    KvTransferMode op;
    uint64_t id;
    xfer::TransferHandle handle;
    std::chrono::steady_clock::time_point t0;
    std::chrono::steady_clock::time_point due{};  // when an ended transfer may be reported
  };
  void Run() {
    MutexLock l(&mu_);
    while (true) {
      cv_.wait(l.native(),
               [&]() REQUIRES(mu_) { return stop_ || !items_.empty() || !delayed_.empty(); });
      if (stop_) return;
      std::vector<Item> done;
      const auto now = std::chrono::steady_clock::now();
      for (auto it = items_.begin(); it != items_.end();) {
        if (it->handle.state() != xfer::TransferState::kPending) {
          it->due = now + (it->op == KvTransferMode::kRead ? debug_read_delay_
                                                           : std::chrono::milliseconds(0));
          delayed_.push_back(std::move(*it));
          it = items_.erase(it);
        } else {
          ++it;
        }
      }
      for (auto it = delayed_.begin(); it != delayed_.end();) {
        if (it->due <= now) {
          done.push_back(std::move(*it));
          it = delayed_.erase(it);
        } else {
          ++it;
        }
      }
      // Nothing ended: block on the oldest pending handle (the agent offers no completion
      // callback, but each handle's Wait is woken by its own completion) instead of polling.
      // Transfers of one peer end in posting order, so the oldest is the next to end; a newer
      // one ending first is seen when the oldest ends or within the 1 ms slice.
      std::optional<xfer::TransferHandle> oldest;
      if (done.empty() && !items_.empty()) oldest = items_.front().handle;
      l.Unlock();
      for (Item& d : done) {
        const double secs =
            std::chrono::duration<double>(std::chrono::steady_clock::now() - d.t0).count();
        Status st = d.handle.state() == xfer::TransferState::kDone ? OkStatus() : d.handle.status();
        if (st.ok() && d.handle.state() != xfer::TransferState::kDone) {
          st = InternalError(d.op == KvTransferMode::kRead ? "READ failed" : "WRITE failed");
        }
        impl_->Push(EvTransferEnded{d.op, d.id, st, secs});
      }
      if (oldest) {
        oldest->Wait(1);
      } else if (done.empty()) {
        std::this_thread::sleep_for(std::chrono::milliseconds(1));  // only test-delayed ends
      }
      l.Lock();
    }
  }
  std::shared_ptr<KvBridgeRuntime::Impl> impl_;
  Mutex mu_;
  std::condition_variable cv_;
  std::vector<Item> items_ GUARDED_BY(mu_);
  std::vector<Item> delayed_ GUARDED_BY(mu_);  // ended, held back by debug_read_delay_
  std::chrono::milliseconds debug_read_delay_ GUARDED_BY(mu_){0};
  bool stop_ GUARDED_BY(mu_) = false;
  std::thread thread_;  // last: starts after the members it uses
};

// One transfer's phase timestamps on this engine (SteadyNow µs = CLOCK_MONOTONIC, so
// comparable across the processes of one host), for the "kv timeline" debug log line and the
// per-phase histograms (docs/protocol.md "One request's timeline"). Engine thread only.
class PhaseTimeline {
 public:
  // Records `phase` of transfer `tid` on this side (the first mark of a phase wins).
  void Mark(bool prefill, const std::string& tid, const char* phase) {
    auto& recs = prefill ? prefill_ : decode_;
    if (recs.size() > kMaxRecords) recs.clear();  // bounded: aborted requests never end theirs
    recs[tid].emplace(phase, SteadyNow());
  }
  // Adds `value` to the numeric attribute `key` of transfer `tid` (bytes, reads), or keeps the
  // largest (`max`: blocks, the same for every rank's READ); attributes end up in the record.
  void Add(bool prefill, const std::string& tid, const char* key, double value, bool max = false) {
    auto& attrs = prefill ? prefill_attrs_ : decode_attrs_;
    if (attrs.size() > kMaxRecords) attrs.clear();
    double& v = attrs[tid][key];
    v = max ? std::max(v, value) : v + value;
  }
  void SetBackend(const std::string& tid, const std::string& backend) {
    if (backends_.size() > kMaxRecords) backends_.clear();
    backends_[tid] = backend;
  }
  void MapRequest(bool prefill, const std::string& request_id, const std::string& tid) {
    auto& m = prefill ? prefill_req_ : decode_req_;
    if (m.size() > kMaxRecords) m.clear();
    m[request_id] = tid;
  }
  // Ends request_id's record with `phase`: its phases (µs) plus "side" and "transfer_id", or
  // null when the request is not tracked.
  json End(bool prefill, const std::string& request_id, const char* phase) {
    auto& m = prefill ? prefill_req_ : decode_req_;
    auto r = m.find(request_id);
    if (r == m.end()) return json();
    const std::string tid = r->second;
    m.erase(r);
    Mark(prefill, tid, phase);
    auto& recs = prefill ? prefill_ : decode_;
    json out = {{"side", prefill ? "prefill" : "decode"}, {"transfer_id", tid}};
    for (const auto& [k, v] : recs[tid]) out[k + "_us"] = v;
    recs.erase(tid);
    auto& attrs = prefill ? prefill_attrs_ : decode_attrs_;
    if (auto a = attrs.find(tid); a != attrs.end()) {
      for (const auto& [k, v] : a->second) out[k] = static_cast<int64_t>(v);
      attrs.erase(a);
    }
    if (auto b = backends_.find(tid); !prefill && b != backends_.end()) {
      out["backend"] = b->second;
      backends_.erase(b);
    }
    return out;
  }
  void Drop(const std::string& request_id) {
    for (auto* m : {&prefill_req_, &decode_req_}) {
      auto r = m->find(request_id);
      if (r == m->end()) continue;
      (m == &prefill_req_ ? prefill_ : decode_).erase(r->second);
      (m == &prefill_req_ ? prefill_attrs_ : decode_attrs_).erase(r->second);
      m->erase(r);
    }
  }
  // Seconds between two phases of an ended record (json from End), or < 0 when one is missing.
  static double Seconds(const json& rec, const char* from, const char* to) {
    const std::string a = std::string(from) + "_us", b = std::string(to) + "_us";
    if (!rec.contains(a) || !rec.contains(b)) return -1;
    return static_cast<double>(rec[b].get<int64_t>() - rec[a].get<int64_t>()) / 1e6;
  }

 private:
  static constexpr size_t kMaxRecords = 16384;
  // transfer id -> phase -> µs; request id -> transfer id
  std::map<std::string, std::map<std::string, TimePoint>> prefill_, decode_;
  std::map<std::string, std::string> prefill_req_, decode_req_;
  std::map<std::string, std::map<std::string, double>> prefill_attrs_, decode_attrs_;
  std::map<std::string, std::string> backends_;  // transfer id -> backend of its READs
};

// The runtime's I/O shell around ConnectorLogic (connector_logic.h): it performs the logic's
// actions on the transfer agents (one per TP rank), keeps the peer directory (metadata fetches,
// transfers and messages queued behind a peer not ready yet), watches posted transfers, and
// feeds every result back to the logic as an event on the engine thread. Metrics, the stats
// snapshot, the hold check's snapshot and the phase timeline are kept here too.
class KvBridgeConnector final : public KvConnector, private ConnectorSink {
 public:
  static Result<std::unique_ptr<KvConnector>> Create(std::shared_ptr<KvBridgeRuntime::Impl> impl,
                                                     const EngineHooks& hooks) {
    auto c = std::unique_ptr<KvBridgeConnector>(new KvBridgeConnector(impl, hooks));
    RETURN_IF_ERROR(c->Init());
    return std::unique_ptr<KvConnector>(std::move(c));
  }

  ~KvBridgeConnector() override {
    {
      MutexLock l(&impl_->mu);
      impl_->wake = nullptr;
      impl_->metadata_blob.clear();
      impl_->held_snapshot.clear();
      impl_->writable_snapshot.clear();
      impl_->reply_paths.clear();
      impl_->reply_ranks.clear();
      impl_->rank_metadata_blobs.clear();
    }
    // Order: stop the threads that call into the agent, then the agent (joins its threads).
    worker_.reset();
    watcher_.reset();
    if (agent_) {
      agent_->SetNotificationHandler(nullptr);
      agent_->SetPeerLostHandler(nullptr);
      agent_->SetHoldCheck(nullptr);
    }
    StopRankAgents();
    agent_.reset();
  }

  // ---- Engine hooks: the logic maps them; the shell keeps its snapshot in step. ----

  Result<Match> GetNumNewMatchedTokens(const ConnectorRequestInfo& req, int num_local_computed,
                                       TimePoint now) override {
    if (!HasParams(req)) return Match{};
    Result<Match> m = logic_.GetNumNewMatchedTokens(req, num_local_computed, now);
    SyncState();
    return m;
  }

  void UpdateStateAfterAlloc(const ConnectorRequestInfo& req, std::span<const int32_t> block_ids,
                             int num_local_computed, int num_external, TimePoint now) override {
    Status st = logic_.UpdateStateAfterAlloc(req, block_ids, num_local_computed, num_external, now);
    // NotFound: not a remote load of ours; FailedPrecondition: a second allocation (refused).
    if (st.code() == StatusCode::kFailedPrecondition) {
      KVB_LOG_ERROR("kv connector: {}: {}", req.request_id, st.ToString());
    }
    SyncState();
  }

  FinishDecision RequestFinished(const ConnectorRequestInfo& req,
                                 std::span<const int32_t> block_ids, std::string_view finish_reason,
                                 TimePoint now) override {
    FinishDecision d = logic_.RequestFinished(req, block_ids, finish_reason, now);
    if (HasParams(req)) SyncState();
    return d;
  }

  bool RequestAborted(const ConnectorRequestInfo& req, TimePoint now) override {
    timeline_.Drop(req.request_id);
    const bool keep = logic_.RequestAborted(req, now);
    SyncState();
    return keep;
  }

  void RequestQueued(const ConnectorRequestInfo& req, TimePoint now) override {
    if (HasParams(req)) logic_.RequestQueued(req, now);
  }

  StepReport Poll(TimePoint now) override {
    HandleInbox(now);
    StepReport out = logic_.Poll(now);
    SyncState();
    return out;
  }

  std::optional<TimePoint> NextDeadline() const override { return logic_.NextDeadline(); }

  // Only a WRITE-mode prefill request needs the per-layer calls (a GPU pass then waits per layer).
  bool WantsLayerKvWritten() const override { return logic_.WantsLayers(); }

  void OnLayerKvWritten(int layer, std::span<const LayerKvChunk> chunks, TimePoint now) override {
    if (!logic_.WantsLayers()) return;  // no WRITE-mode prefill request here
    // The layer's real time (`now` is the step's start): the overlap is measured from it.
    const TimePoint at = SteadyNow();
    // What arrived while this forward pass ran (a decode's block ids, its metadata, earlier
    // layers' WRITE completions) is taken now, not after the pass: the writes start at this
    // layer and the last layer's WRITE can carry the WriteDone.
    HandleInbox(at);
    logic_.OnLayerKvWritten(layer, chunks, at);
    SyncState();
  }

  bool Idle() const override {
    MutexLock l(&impl_->mu);
    return logic_.Idle() && impl_->inbox.empty() && handles_.empty();
  }

 private:
  struct PeerState {
    std::string agent_name;  // set when ready
    bool ready = false;
    std::vector<ConnectorAction> queued;  // PostRead / PostWrite / SendMessage waiting for it
  };
  // A posted transfer, by (op, id).
  struct Posted {
    xfer::TransferHandle handle;
    uint64_t bytes = 0;
    int32_t first_local_block = -1;  // READ: the first destination block (test-only corruption)
    TimePoint posted_at = 0;         // SteadyNow at Post
  };
  using HandleKey = std::pair<KvTransferMode, uint64_t>;

  KvBridgeConnector(std::shared_ptr<KvBridgeRuntime::Impl> impl, const EngineHooks& hooks)
      : impl_(std::move(impl)),
        hooks_(hooks),
        logic_(impl_->options.config,
               {.engine_id = impl_->engine_id,
                .rank = impl_->options.tp_rank,
                .tp_size = EngineTp(hooks),
                .num_kv_heads = GlobalKvHeads(hooks),
                .block_size = hooks.kv_view.layout.block_size,
                .num_layers = hooks.kv_view.layout.num_layers},
               this) {}

  const KvBridgeOptions& opt() const { return impl_->options; }
  static bool HasParams(const ConnectorRequestInfo& req) {
    return req.kv_transfer_params != nullptr && !req.kv_transfer_params->is_null();
  }

  // ---- ConnectorSink: what the logic asks, performed on the agents. ----

  Status PostTransfer(const TransferAction& t) override {
    PeerState* peer = Ready(t.peer);
    if (peer == nullptr) return QueueBehindPeer(t.peer, t);
    if (t.op == KvTransferMode::kRead) {
      timeline_.Mark(false, t.transfer_id, "read_posted");
      timeline_.Add(false, t.transfer_id, "blocks", static_cast<double>(t.local_block_ids.size()),
                    /*max=*/true);
      timeline_.Add(false, t.transfer_id, "reads", 1);
      MutexLock l(&impl_->mu);
      if (auto b = impl_->peer_backends.find(peer->agent_name); b != impl_->peer_backends.end()) {
        timeline_.SetBackend(t.transfer_id, b->second);
      }
    }
    return Post(t, peer->agent_name);
  }

  Status CancelTransfer(KvTransferMode op, uint64_t id) override {
    auto it = handles_.find({op, id});
    if (it != handles_.end()) {
      it->second.handle.Cancel();
      return OkStatus();
    }
    // Not posted yet (queued behind a metadata fetch): drop it from the queue; it ends now.
    for (auto& [key, peer] : peers_) {
      auto& q = peer.queued;
      auto qi = std::find_if(q.begin(), q.end(), [&](const ConnectorAction& x) {
        const auto* t = std::get_if<PostTransferAction>(&x);
        return t != nullptr && t->op == op && t->id == id;
      });
      if (qi != q.end()) {
        q.erase(qi);
        return CancelledError("cancelled before posting");
      }
    }
    return OkStatus();
  }

  void Send(const SendMessageAction& s) override {
    // The tcp write check must know a WRITE decode's blocks before its WriteBlocks leaves.
    if (std::holds_alternative<WriteBlocksMsg>(s.msg)) SyncHeldSnapshot();
    SendMessage(s);
  }

  void OnReport(const ConnectorLogic::Report& r) override {
    if (const auto* d = std::get_if<ReportLoadDoneAction>(&r)) {
      EndTimeline(false, d->request_id, "load_done");
    } else if (const auto* f = std::get_if<ReportLoadFailedAction>(&r)) {
      EndTimeline(false, f->request_id, "load_failed");
    } else {
      EndTimeline(true, std::get<ReportBlocksFreeAction>(r).request_id, "freed");
    }
    Wake();
  }

  void PreparePeer(const PeerEndpoint& p) override {
    EnsurePeer(p.engine_id, p.host, p.port, p.rank);
  }

  void Note(const RequestNote& n) override {
    if (n.mode == KvTransferMode::kWrite) {  // WRITE: the decode's side of the timeline
      if (n.kind == RequestNote::Kind::kLoadStarted) {
        timeline_.MapRequest(false, n.request_id, n.transfer_id);
        timeline_.Mark(false, n.transfer_id, "admitted");
      }
      return;
    }
    switch (n.kind) {
      case RequestNote::Kind::kPrefillAdmitted:
        timeline_.Mark(true, n.transfer_id, "admitted");
        break;
      case RequestNote::Kind::kLoadStarted:
        timeline_.MapRequest(false, n.request_id, n.transfer_id);
        timeline_.Mark(false, n.transfer_id, "admitted");
        break;
      case RequestNote::Kind::kHeld:
        timeline_.MapRequest(true, n.request_id, n.transfer_id);
        timeline_.Mark(true, n.transfer_id, "held");
        break;
      case RequestNote::Kind::kReleased:
        break;
    }
  }

  std::pair<std::string, int> AdvertisedEndpoint() const override {
    MutexLock l(&impl_->mu);
    return {opt().advertise_host, opt().advertise_port};
  }

  // ---- Events from other threads, fed to the logic on the engine thread. ----

  void HandleInbox(TimePoint now) {
    for (Event& e : impl_->TakeInbox()) {
      if (auto* t = std::get_if<EvTransferEnded>(&e)) {
        OnTransferEnded(*t, now);
      } else if (auto* m = std::get_if<EvMessage>(&e)) {
        OnMessage(*m, now);
      } else if (auto* l = std::get_if<EvPeerLost>(&e)) {
        OnPeerLost(*l, now);
      } else {
        OnPeer(std::get<EvPeer>(e), now);
      }
    }
  }

  void OnTransferEnded(const EvTransferEnded& e, TimePoint now) {
    auto it = handles_.find({e.op, e.id});
    if (it == handles_.end()) {
      if (m_ignored_) m_ignored_->Inc();
      return;
    }
    const Posted& p = it->second;
    TimePoint at = now;
    if (e.op == KvTransferMode::kRead) {
      timeline_.Mark(false, p.handle.transfer_id(), "read_ended");
      if (e.status.ok()) {
        timeline_.Add(false, p.handle.transfer_id(), "bytes", static_cast<double>(p.bytes));
        if (m_bytes_) m_bytes_->Inc(static_cast<double>(p.bytes));
        bytes_read_ += static_cast<double>(p.bytes);
        if (m_seconds_) m_seconds_->Observe(e.seconds);
        if (opt().debug_corrupt_first_read_block && p.first_local_block >= 0) {
          const PagedKvLayout& l = hooks_.kv_view.layout;
          const size_t offset = static_cast<size_t>(p.first_local_block) * l.BlockBytes();
          if (hooks_.kv_cuda_device >= 0) {  // device memory: through the engine
            if (hooks_.kv_xor_byte) {
              Status xs = hooks_.kv_xor_byte(0, offset, 0x40);
              if (!xs.ok()) KVB_LOG_WARN("kv connector: debug corruption: {}", xs.ToString());
            }
          } else {
            hooks_.kv_view.layer_base[0][offset] ^= 0x40;
          }
        }
      }
    } else {
      if (e.status.ok()) {
        if (m_bytes_) m_bytes_->Inc(static_cast<double>(p.bytes));
        bytes_written_ += static_cast<double>(p.bytes);
      }
      // The WRITE's real end (the watcher measured it from the post), not when this thread got
      // to it (after a forward pass, perhaps): the transfer time is measured from it.
      at = p.posted_at + static_cast<TimePoint>(e.seconds * 1e6);
    }
    Forget(it);
    logic_.OnTransferEnded(e.op, e.id, e.status, at);
  }

  void OnMessage(EvMessage& e, TimePoint now) {
    if (auto* rd = std::get_if<ReadDoneMsg>(&e.msg)) {
      timeline_.Mark(true, rd->transfer_id, "read_done");
    } else if (auto* hr = std::get_if<HoldReplyMsg>(&e.msg)) {
      timeline_.Mark(false, hr->transfer_id, "ack");
    } else if (auto* wd = std::get_if<WriteDoneMsg>(&e.msg)) {
      // The slowest prefill rank's first write posted -> last write done, on its clock.
      timeline_.Mark(false, wd->transfer_id, "write_done");
      timeline_.Add(false, wd->transfer_id, "write_micros", static_cast<double>(wd->write_us),
                    /*max=*/true);
    }
    Status st = logic_.OnMessage(e.msg, e.reply_token, now);
    if (!st.ok()) KVB_LOG_WARN("kv connector: release: {}", st.ToString());
    if (e.reply_token != 0) {
      // A reply path the cores did not use (e.g. a message that needs none): forget it.
      unused_tokens_.push_back(e.reply_token);
    }
  }

  // A peer's connection closed: its incarnation is gone (DESIGN.md "Peer loss is observed, not
  // waited out"). Told to the logic once per engine incarnation, whichever rank's agent saw it.
  void OnPeerLost(const EvPeerLost& e, TimePoint now) {
    const size_t cut = e.agent_name.rfind("/rank");
    const std::string engine = e.agent_name.substr(0, cut);
    if (engine.empty() || engine == impl_->engine_id) return;
    if (lost_engines_.size() > 4096) lost_engines_.clear();
    if (!lost_engines_.insert(engine).second) return;
    const int64_t n = logic_.OnPeerLost(engine, PeerLoss::kGone, now);
    if (m_peer_lost_) m_peer_lost_->Inc();
    if (m_peer_lost_released_) m_peer_lost_released_->Inc(static_cast<double>(n));
    KVB_LOG_INFO("kv connector: peer {} lost (connection closed): {} released or failed", engine,
                 n);
    SyncState();
    Wake();
  }

  void OnPeer(const EvPeer& e, TimePoint now) {
    auto it = peers_.find(e.key);
    if (it == peers_.end()) return;
    std::vector<ConnectorAction> queued;
    queued.swap(it->second.queued);
    if (!e.agent_name.ok()) {
      KVB_LOG_WARN("kv connector: {}", e.agent_name.status().ToString());
      peers_.erase(it);  // the next request retries the fetch
      for (ConnectorAction& a : queued) {
        if (auto* t = std::get_if<PostTransferAction>(&a))
          logic_.OnTransferEnded(t->op, t->id, e.agent_name.status(), now);
        // Messages to an unreachable prefill are dropped: its lease frees the hold.
      }
      return;
    }
    it->second.ready = true;
    it->second.agent_name = *e.agent_name;
    for (ConnectorAction& a : queued) {
      if (auto* s = std::get_if<SendMessageAction>(&a)) {
        Send(*s);
        continue;
      }
      const auto& t = std::get<PostTransferAction>(a);
      if (Status st = PostTransfer(t); !st.ok()) logic_.OnTransferEnded(t.op, t.id, st, now);
    }
  }

  Status Init() {
    ASSIGN_OR_RETURN(const int debug_delay_ms, DebugReadDoneDelayMs());
    const PagedKvLayout& layout = hooks_.kv_view.layout;
    impl_->block_size.store(layout.block_size);
    xfer::AgentConfig ac;
    ac.name = AgentName(impl_->engine_id, opt().tp_rank);
    const bool device_pool = hooks_.kv_cuda_device >= 0;
    const KvTransport transport = opt().config.transport;
    if (device_pool && transport != KvTransport::kAuto && transport != KvTransport::kCudaIpc) {
      return InvalidArgumentError(
          "kv connector: transport \"" + std::string(KvTransportName(transport)) +
          "\" moves host memory, and this GPU engine's KV pool is device memory: use transport "
          "\"auto\" or \"cuda_ipc\" (GPU engines on one host)");
    }
    if (!device_pool && transport == KvTransport::kCudaIpc) {
      return InvalidArgumentError(
          "kv connector: transport \"cuda_ipc\" moves device memory, and this engine's KV pool "
          "is host memory (a CPU engine): use --device cuda, or transport auto|shm|tcp|ucx");
    }
    switch (device_pool ? KvTransport::kCudaIpc : transport) {
      case KvTransport::kCudaIpc:  // between GPU engines on one host (auto with a device pool)
        ac.backends = {"cuda_ipc"};
        ac.force_backend = "cuda_ipc";
        break;
      case KvTransport::kAuto:
        ac.backends = {"shm", "tcp"};
        break;
      case KvTransport::kShm:
        ac.backends = {"shm"};
        ac.force_backend = "shm";
        break;
      case KvTransport::kTcp:
        ac.backends = {"tcp"};
        ac.force_backend = "tcp";
        break;
      case KvTransport::kUcx:
        ac.backends = {"ucx"};
        ac.force_backend = "ucx";
        break;
    }
    ac.bind_host = opt().bind_host;
    ac.tp_size = EngineTp(hooks_);
    ac.tp_rank = 0;
    ac.head_begin = hooks_.ranks.empty() ? 0 : hooks_.ranks[0].kv_head_begin;
    ac.model_fingerprint = hooks_.model_fingerprint;
    ac.cluster_token = opt().cluster_token;  // every handshake proves it both ways (issue 22)
    ac.reply_timeout_ms = static_cast<int>(opt().config.reply_timeout / kMillisecond);
    std::weak_ptr<KvBridgeRuntime::Impl> weak = impl_;
    // A peer READs only blocks held for that transfer, WRITEs only into blocks this decode
    // offered for it (its write_blocks); anything else is refused and counted.
    ac.hold_check = [weak](xfer::TransferOp op, std::string_view tid,
                           const std::vector<int>& blocks) {
      auto impl = weak.lock();
      if (!impl) return false;
      const bool read = op == xfer::TransferOp::kRead;
      const bool ok = [&] {
        MutexLock l(&impl->mu);
        const auto& snap = read ? impl->held_snapshot : impl->writable_snapshot;
        auto it = snap.find(std::string(tid));
        if (it == snap.end()) return false;
        for (int b : blocks) {
          if (!it->second.count(b)) return false;
        }
        return true;
      }();
      if (!ok) (read ? impl->refused_reads : impl->refused_writes) += 1;
      return ok;
    };
    ASSIGN_OR_RETURN(agent_, xfer::TransferAgent::Create(ac));
    RETURN_IF_ERROR(RegisterKvMemory(*agent_, opt().config.transport, /*rank=*/0, hooks_.kv_view,
                                     hooks_.kv_shm_fd, hooks_.kv_layer_offsets,
                                     hooks_.kv_cuda_device));
    ASSIGN_OR_RETURN(xfer::AgentMetadata md, agent_->Metadata());
    agent_->SetNotificationHandler([weak](xfer::Notification n) {
      if (auto impl = weak.lock()) impl->OnNotification(std::move(n), /*rank=*/0);
    });
    agent_->SetPeerLostHandler([weak](const std::string& peer) {
      if (auto impl = weak.lock()) impl->Push(EvPeerLost{peer});
    });
    worker_ = std::make_unique<Worker>();
    watcher_ = std::make_unique<TransferWatcher>(impl_);
    if (debug_delay_ms > 0) {
      KVB_LOG_WARN("kv connector: test-only: every ended READ is reported {} ms late",
                   debug_delay_ms);
      watcher_->SetDebugReadReportDelay(std::chrono::milliseconds(debug_delay_ms));
    }
    if (hooks_.metrics != nullptr) RegisterMetrics(*hooks_.metrics);
    {
      MutexLock l(&impl_->mu);
      impl_->metadata_blob = xfer::EncodeMetadata(md);
      impl_->wake = hooks_.wake;
    }
    RETURN_IF_ERROR(InitRankAgents(ac, xfer::EncodeMetadata(md)));
    KVB_LOG_INFO("kv connector: engine {} ({}), agent {} backends {}", impl_->engine_id,
                 KvRoleName(opt().config.role), ac.name, json(md.endpoints).dump());
    return OkStatus();
  }

  void RegisterMetrics(MetricsRegistry& reg) {
    auto impl = impl_;
    reg.AddCallbackGauge("kvbridge_kv_transfers_inflight", "KV READs posted and not yet ended.",
                         [impl] { return static_cast<double>(impl->reads_inflight.load()); });
    reg.AddCallbackGauge("kvbridge_kv_notifications_parked",
                         "Control messages parked for transfers not yet registered.", [impl] {
                           MutexLock l(&impl->mu);
                           return static_cast<double>(impl->stats.parked);
                         });
    reg.AddCallbackGauge("kvbridge_kv_transfer_table_entries",
                         "Prefill transfer-table entries (transfer ids with mapped siblings).",
                         [impl] {
                           MutexLock l(&impl->mu);
                           return static_cast<double>(impl->stats.transfers);
                         });
    m_bytes_ =
        &reg.AddCounter("kvbridge_kv_transfer_bytes_total",
                        "Bytes of KV moved by transfers this engine posted (READs as a decode, "
                        "WRITEs as a prefill).");
    m_seconds_ =
        &reg.AddHistogram("kvbridge_kv_transfer_seconds",
                          "Decode side: time from posting a KV READ to its end (READ mode); "
                          "from the prefill's first layer WRITE posted to its last done (WRITE).",
                          Histogram::FineLatencyBucketsSeconds());
    m_hold_ = &reg.AddHistogram(
        "kvbridge_kv_hold_seconds",
        "READ mode, prefill side: time a finished request's blocks were held for a transfer "
        "(hold → free).",
        Histogram::FineLatencyBucketsSeconds());
    m_ack_ = &reg.AddHistogram(
        "kvbridge_kv_ack_seconds",
        "READ mode, decode side: time from a READ's end to the prefill's hold reply (the ack "
        "that lets the decode use the bytes).",
        Histogram::FineLatencyBucketsSeconds());
    m_peer_lost_ = &reg.AddCounter(
        "kvbridge_kv_peer_lost_total",
        "Transfer peers (engine incarnations) whose connection closed (issue 21: what was bound "
        "to them is released or failed at once).");
    m_peer_lost_released_ = &reg.AddCounter(
        "kvbridge_kv_peer_lost_released_total",
        "Holds, remote loads and WRITE targets released or failed because their peer was lost.");
    m_claim_ = &reg.AddCounter("kvbridge_kv_claim_expired_total",
                               "READ holds no decode claimed, freed by the claim lease (0 in "
                               "fault-free runs; the proxy died between the legs).");
    m_lease_ = &reg.AddCounter("kvbridge_kv_lease_expired_total",
                               "Transfer holds freed by lease expiry (0 in fault-free runs).");
    m_load_fail_ = &reg.AddCounter("kvbridge_kv_load_failures_total",
                                   "Remote KV loads that failed (recomputed or failed by policy).");
    m_write_overlap_ = &reg.AddHistogram(
        "kvbridge_kv_write_overlap_seconds",
        "WRITE mode, decode side: time from the prefill's last layer computed to this decode's "
        "go (all writes landed and confirmed).",
        Histogram::FineLatencyBucketsSeconds());
    const char* refused_help =
        "Peer transfer requests refused by the serving side (tcp): a READ of blocks not held for "
        "its transfer, a WRITE into blocks not offered for it (0 in fault-free runs).";
    m_refused_read_ =
        &reg.AddCounter("kvbridge_kv_transfer_refused_total", refused_help, "op=\"read\"");
    m_refused_write_ =
        &reg.AddCounter("kvbridge_kv_transfer_refused_total", refused_help, "op=\"write\"");
    const char* handshake_help =
        "Transfer-agent handshakes refused (issue 22): side=serve, a peer this engine's agents "
        "refused (no or wrong cluster token, another uid on shm); side=connect, a serving peer "
        "this engine refused (it did not prove the cluster token back). 0 in fault-free runs.";
    m_handshake_serve_ =
        &reg.AddCounter("kvbridge_kv_handshake_refused_total", handshake_help, "side=\"serve\"");
    m_handshake_connect_ =
        &reg.AddCounter("kvbridge_kv_handshake_refused_total", handshake_help, "side=\"connect\"");
    m_ignored_ = &reg.AddCounter("kvbridge_kv_notifications_ignored_total",
                                 "Duplicate, late, unknown or expired control messages and "
                                 "completions (0 in fault-free runs).");
  }

  void EnsurePeer(const std::string& engine_id, const std::string& host, int port, int rank) {
    const std::string key = AgentName(engine_id, rank);
    if (peers_.count(key)) return;
    peers_[key];
    std::weak_ptr<KvBridgeRuntime::Impl> weak = impl_;
    xfer::TransferAgent* agent = agent_.get();
    std::vector<xfer::TransferAgent*> rank_agents;  // ranks 1.. read and notify on their own
    for (auto& a : rank_agents_) rank_agents.push_back(a.get());
    const std::string token = opt().cluster_token;
    const HttpTarget target{.https = opt().peer_https, .host = host, .port = port};
    const HttpClientTls tls = opt().peer_tls;
    worker_->Add([weak, agent, rank_agents, key, target, tls, rank, token] {
      auto impl = weak.lock();
      if (!impl) return;
      const std::string& host = target.host;
      const int port = target.port;
      Result<std::string> out = [&]() -> Result<std::string> {
        std::unique_ptr<httplib::Client> cli = MakeHttpClient(target, tls);
        cli->set_connection_timeout(2, 0);
        cli->set_read_timeout(5, 0);
        httplib::Headers h;
        if (!token.empty()) h.emplace(std::string(kClusterTokenHeader), token);
        auto res = cli->Get("/v1/kv/metadata/" + std::to_string(rank), h);
        if (!res) {
          return UnavailableError("GET " + target.Url() +
                                  "/v1/kv/metadata: " + HttpErrorText(*cli, res.error(), tls));
        }
        if (res->status != 200) {
          return UnavailableError("GET /v1/kv/metadata from " + host + ":" + std::to_string(port) +
                                  ": HTTP " + std::to_string(res->status) + " " + res->body);
        }
        ASSIGN_OR_RETURN(xfer::AgentMetadata md, xfer::DecodeMetadata(res->body));
        if (md.agent_name != key) {
          return UnavailableError("prefill at " + host + ":" + std::to_string(port) + " is " +
                                  md.agent_name + ", not " + key + " (restarted?)");
        }
        ASSIGN_OR_RETURN(xfer::AgentMetadata local_md, agent->Metadata());
        if (md.memory_kind != local_md.memory_kind) {
          // A CPU engine and a GPU engine in one topology: no transport moves between host and
          // device pools (not staged through host memory).
          return FailedPreconditionError(
              "P/D between a CPU engine and a GPU engine is not supported: this engine's KV "
              "pool is " +
              std::string(xfer::MemoryKindName(local_md.memory_kind)) + " memory, the peer " +
              md.agent_name + "'s is " + std::string(xfer::MemoryKindName(md.memory_kind)) +
              " memory; run every engine of a topology with the same --device (cpu, or cuda)");
        }
        ASSIGN_OR_RETURN(std::string backend, agent->AddPeer(md));
        for (xfer::TransferAgent* a : rank_agents) RETURN_IF_ERROR(a->AddPeer(md).status());
        KVB_LOG_INFO("kv connector: peer {} via {}", key, backend);
        {
          MutexLock l(&impl->mu);
          impl->peer_backends[key] = backend;
        }
        return md.agent_name;
      }();
      impl->Push(EvPeer{key, std::move(out)});
    });
  }

  void EndTimeline(bool prefill, const std::string& request_id, const char* phase) {
    json rec = timeline_.End(prefill, request_id, phase);
    if (rec.is_null()) return;
    const double hold = PhaseTimeline::Seconds(rec, "held", "freed");
    const double ack = PhaseTimeline::Seconds(rec, "read_ended", "ack");
    if (m_hold_ && hold >= 0) m_hold_->Observe(hold);
    if (m_ack_ && ack >= 0) m_ack_->Observe(ack);
    rec["request_id"] = request_id;
    // spdlog's runtime level (KVB_LOG_DEBUG is compiled out of release builds).
    spdlog::debug("kv timeline {}", rec.dump());
    if (!prefill) {
      // Kept for the engine to take with the request's final output (TakeLoadRecord); bounded:
      // a request that fails before its output never takes its record.
      if (load_records_.size() >= kMaxLoadRecords) load_records_.erase(load_records_.begin());
      load_records_[request_id] = std::move(rec);
    }
  }

  json TakeLoadRecord(const std::string& request_id) override {
    auto it = load_records_.find(request_id);
    if (it == load_records_.end()) return nullptr;
    json rec = std::move(it->second);
    load_records_.erase(it);
    return rec;
  }

  PeerState* Ready(const PeerEndpoint& p) {
    auto it = peers_.find(AgentName(p.engine_id, p.rank));
    return it != peers_.end() && it->second.ready ? &it->second : nullptr;
  }

  // A transfer or message for a peer whose metadata is not here yet: it waits for the fetch
  // (OnPeer posts or fails it).
  Status QueueBehindPeer(const PeerEndpoint& p, ConnectorAction a) {
    EnsurePeer(p.engine_id, p.host, p.port, p.rank);
    peers_[AgentName(p.engine_id, p.rank)].queued.push_back(std::move(a));
    return OkStatus();
  }

  // Prepares and posts a READ or WRITE on its local rank's agent, to the peer agent `peer`; the
  // watcher reports its end. Not OK: it did not start.
  Status Post(const PostTransferAction& t, const std::string& peer) {
    xfer::TransferAgent* agent = AgentFor(t.local_rank);
    if (agent == nullptr)
      return InternalError("no transfer agent for rank " + std::to_string(t.local_rank));
    const bool read = t.op == KvTransferMode::kRead;
    xfer::TransferSpec spec;
    spec.op = read ? xfer::TransferOp::kRead : xfer::TransferOp::kWrite;
    spec.peer = peer;
    spec.layer = t.layer;
    for (size_t i = 0; i < t.local_block_ids.size(); ++i) {
      spec.blocks.push_back({t.local_block_ids[i], t.remote_block_ids[i]});
    }
    SetHeadSlice(t, spec);
    xfer::PostOptions po;
    po.transfer_id = t.transfer_id;
    if (t.notification) po.notification = EncodeMessage(*t.notification);
    const int32_t first_local_block =
        read && !t.local_block_ids.empty() ? t.local_block_ids[0] : -1;
    ASSIGN_OR_RETURN(auto prepared, agent->Prepare(spec));
    const uint64_t bytes = prepared->bytes();
    ASSIGN_OR_RETURN(xfer::TransferHandle h, agent->Post(prepared, po));
    handles_[{t.op, t.id}] = Posted{h, bytes, first_local_block, SteadyNow()};
    (read ? reads_inflight_ : writes_inflight_) += 1;
    impl_->reads_inflight.store(reads_inflight_);
    watcher_->Add(t.op, t.id, h);
    return OkStatus();
  }

  // A WRITE decode's timeline: what it asked this prefill rank to write (the bytes that land in
  // this engine's pool: the listed blocks of every layer, this rank's share of the heads) and the
  // backend of that peer.
  void NoteWriteBlocks(const WriteBlocksMsg& wb, const std::string& agent_name) {
    const PagedKvLayout& l = hooks_.kv_view.layout;
    const double bytes = static_cast<double>(wb.block_ids.size()) *
                         static_cast<double>(l.BlockBytes()) * l.num_layers /
                         std::max(1, wb.decode_tp_size);
    timeline_.Mark(false, wb.transfer_id, "write_requested");
    timeline_.Add(false, wb.transfer_id, "blocks", static_cast<double>(wb.block_ids.size()),
                  /*max=*/true);
    timeline_.Add(false, wb.transfer_id, "writes", 1);
    timeline_.Add(false, wb.transfer_id, "bytes", bytes);
    MutexLock lock(&impl_->mu);
    if (auto b = impl_->peer_backends.find(agent_name); b != impl_->peer_backends.end()) {
      timeline_.SetBackend(wb.transfer_id, b->second);
    }
  }

  void Forget(std::map<HandleKey, Posted>::iterator it) {
    (it->first.first == KvTransferMode::kRead ? reads_inflight_ : writes_inflight_) -= 1;
    handles_.erase(it);
    impl_->reads_inflight.store(reads_inflight_);
  }

  void SendMessage(const SendMessageAction& s) {
    const std::string payload = EncodeMessage(s.msg);
    if (s.reply_token != 0) {
      xfer::Notification n;
      int via = 0;  // the local rank whose agent received the message
      {
        MutexLock l(&impl_->mu);
        auto it = impl_->reply_paths.find(s.reply_token);
        if (it == impl_->reply_paths.end()) return;
        n = it->second;
        impl_->reply_paths.erase(it);
        auto rr = impl_->reply_ranks.find(s.reply_token);
        if (rr != impl_->reply_ranks.end()) {
          via = rr->second;
          impl_->reply_ranks.erase(rr);
        }
      }
      xfer::TransferAgent* reply_agent = AgentFor(via);
      if (reply_agent == nullptr) return;
      Status st = reply_agent->Reply(n, payload);
      if (!st.ok()) KVB_LOG_WARN("kv connector: reply to {}: {}", n.peer, st.ToString());
      return;
    }
    PeerState* peer = Ready(s.to);
    if (peer == nullptr) {
      QueueBehindPeer(s.to, s).IgnoreError();
      return;
    }
    std::string tid;
    bool want_reply = false;
    if (auto* rd = std::get_if<ReadDoneMsg>(&s.msg)) {
      tid = rd->transfer_id;
      want_reply = rd->want_reply;
    } else if (auto* hb = std::get_if<HeartbeatMsg>(&s.msg)) {
      tid = hb->transfer_id;
    } else if (auto* wb = std::get_if<WriteBlocksMsg>(&s.msg)) {
      tid = wb->transfer_id;
      NoteWriteBlocks(*wb, peer->agent_name);
    } else if (auto* wd = std::get_if<WriteDoneMsg>(&s.msg)) {
      tid = wd->transfer_id;
    } else if (auto* wc = std::get_if<WriteCancelMsg>(&s.msg)) {
      tid = wc->transfer_id;
    }
    xfer::ReplyCallback cb;
    if (want_reply) {
      std::weak_ptr<KvBridgeRuntime::Impl> weak = impl_;
      cb = [weak](Result<std::string> r) {
        auto impl = weak.lock();
        if (!impl) return;
        if (!r.ok()) return;  // no reply: the decode core's reply timeout decides
        auto m = DecodeMessage(*r);
        if (!m.ok() || !std::holds_alternative<HoldReplyMsg>(*m)) {
          KVB_LOG_WARN("kv connector: bad hold reply");
          return;
        }
        impl->Push(EvMessage{std::move(*m), 0});
      };
    }
    xfer::TransferAgent* from = AgentFor(SenderRank(s.msg));
    if (from == nullptr) return;
    Status st = from->Notify(peer->agent_name, tid, payload, std::move(cb));
    if (!st.ok()) KVB_LOG_WARN("kv connector: notify {}: {}", peer->agent_name, st.ToString());
  }

  // ---- Tensor parallelism: one transfer agent per rank (docs/protocol.md "Tensor
  // parallelism"). Rank 0's agent is agent_; ranks 1.. are rank_agents_[r - 1]. ----

  static int EngineTp(const EngineHooks& h) { return std::max(1, h.tp_size); }
  // The model's global KV heads (a rank's kv_head_end is at most that; rank 0 alone at TP 1).
  static int GlobalKvHeads(const EngineHooks& h) {
    int heads = h.kv_view.layout.num_kv_heads;
    for (const KvRankHooks& r : h.ranks) heads = std::max(heads, r.kv_head_end);
    return heads;
  }

  xfer::TransferAgent* AgentFor(int rank) const {
    if (rank == 0) return agent_.get();
    if (rank < 0 || rank > static_cast<int>(rank_agents_.size())) return nullptr;
    return rank_agents_[static_cast<size_t>(rank) - 1].get();
  }

  // The local rank that sends `m`: a decode rank's messages leave from its own agent.
  static int SenderRank(const ControlMessage& m) {
    if (auto* rd = std::get_if<ReadDoneMsg>(&m)) return rd->decode_rank;
    if (auto* hb = std::get_if<HeartbeatMsg>(&m)) return hb->decode_rank;
    if (auto* wb = std::get_if<WriteBlocksMsg>(&m)) return wb->decode_rank;
    if (auto* wd = std::get_if<WriteDoneMsg>(&m)) return wd->prefill_rank;
    if (auto* wc = std::get_if<WriteCancelMsg>(&m)) return wc->decode_rank;
    return 0;
  }

  // A head slice (the TP plan, from the core): the same head range inside each K and V half
  // block; src is the prefill side (remote for a READ, local for a WRITE).
  void SetHeadSlice(const PostTransferAction& t, xfer::TransferSpec& spec) const {
    if (t.head_count <= 0) return;
    const PagedKvLayout& l = hooks_.kv_view.layout;  // block_size/head_dim/dtype equal on all ranks
    const xfer::ByteRange src = xfer::HeadRangeBytes(l, t.src_head_begin, t.head_count);
    const xfer::ByteRange dst = xfer::HeadRangeBytes(l, t.dst_head_begin, t.head_count);
    if (t.op == KvTransferMode::kRead) {
      spec.remote_range = src;
      spec.local_range = dst;
    } else {
      spec.local_range = src;
      spec.remote_range = dst;
    }
  }

  // Checks the engine's rank hooks against the TP plan's head split and starts the agents of
  // ranks 1..tp-1 (each registers its rank's KV shard, shares the hold check, and answers
  // notifications on its own reply path). `rank0_blob` is rank 0's metadata.
  Status InitRankAgents(const xfer::AgentConfig& rank0, const std::string& rank0_blob) {
    const int tp = EngineTp(hooks_);
    if (opt().tp_size != 1 && opt().tp_size != tp) {
      return FailedPreconditionError("kv connector: options.tp_size " +
                                     std::to_string(opt().tp_size) + " != the engine's " +
                                     std::to_string(tp));
    }
    const int heads = GlobalKvHeads(hooks_);
    if (tp > 1 && static_cast<int>(hooks_.ranks.size()) != tp) {
      return FailedPreconditionError("kv connector: engine TP " + std::to_string(tp) + " gave " +
                                     std::to_string(hooks_.ranks.size()) + " rank hooks");
    }
    for (const KvRankHooks& rh : hooks_.ranks) {
      const TpHeadRange want = TpRankHeads(rh.rank, tp, heads);
      if (rh.kv_head_begin != want.begin || rh.kv_head_end - rh.kv_head_begin != want.count ||
          rh.kv_view.layout.num_kv_heads != want.count) {
        return FailedPreconditionError("kv connector: rank " + std::to_string(rh.rank) +
                                       " holds KV heads [" + std::to_string(rh.kv_head_begin) +
                                       ", " + std::to_string(rh.kv_head_end) +
                                       "), the TP plan expects [" + std::to_string(want.begin) +
                                       ", " + std::to_string(want.begin + want.count) + ")");
      }
    }
    std::vector<std::string> blobs = {rank0_blob};
    std::weak_ptr<KvBridgeRuntime::Impl> weak = impl_;
    for (int r = 1; r < tp; ++r) {
      const KvRankHooks& rh = hooks_.ranks[static_cast<size_t>(r)];
      xfer::AgentConfig ac = rank0;
      ac.name = AgentName(impl_->engine_id, r);
      ac.tp_rank = r;
      ac.head_begin = rh.kv_head_begin;
      ASSIGN_OR_RETURN(auto agent, xfer::TransferAgent::Create(ac));
      RETURN_IF_ERROR(RegisterKvMemory(*agent, opt().config.transport, r, rh.kv_view, rh.kv_shm_fd,
                                       rh.kv_layer_offsets));
      ASSIGN_OR_RETURN(xfer::AgentMetadata md, agent->Metadata());
      blobs.push_back(xfer::EncodeMetadata(md));
      agent->SetNotificationHandler([weak, r](xfer::Notification n) {
        if (auto impl = weak.lock()) impl->OnNotification(std::move(n), r);
      });
      agent->SetPeerLostHandler([weak](const std::string& peer) {
        if (auto impl = weak.lock()) impl->Push(EvPeerLost{peer});
      });
      rank_agents_.push_back(std::move(agent));
    }
    MutexLock l(&impl_->mu);
    impl_->rank_metadata_blobs = std::move(blobs);
    return OkStatus();
  }

  void StopRankAgents() {
    for (auto& a : rank_agents_) {
      a->SetNotificationHandler(nullptr);
      a->SetPeerLostHandler(nullptr);
      a->SetHoldCheck(nullptr);
    }
    rank_agents_.clear();
  }

  void Wake() {
    if (hooks_.wake) hooks_.wake();
  }

  // What the agents' hold check lets a peer touch: READs of blocks held for a READ transfer
  // (first), WRITEs into blocks a WRITE-mode decode offered for a transfer (second).
  using Snapshot = std::map<std::string, std::set<int>>;
  std::pair<Snapshot, Snapshot> HeldSnapshot() const {
    std::pair<Snapshot, Snapshot> out;
    for (const auto& [tid, blocks] : logic_.cores().prefill.HeldBlocksByTransfer())
      out.first[tid].insert(blocks.begin(), blocks.end());
    for (const auto& [tid, blocks] : logic_.cores().wdecode.WritableBlocksByTransfer())
      out.second[tid].insert(blocks.begin(), blocks.end());
    return out;
  }
  void SyncHeldSnapshot() {
    auto [held, writable] = HeldSnapshot();
    MutexLock l(&impl_->mu);
    impl_->held_snapshot = std::move(held);
    impl_->writable_snapshot = std::move(writable);
  }

  // Mirrors core state into the thread-safe snapshot (hold check, stats, metrics).
  void SyncState() {
    const ConnectorCores& cores = logic_.cores();
    auto [held, writable] = HeldSnapshot();
    const auto& pc = cores.prefill.counters();
    const auto& dc = cores.decode.counters();
    const auto& wpc = cores.wprefill.counters();
    const auto& wdc = cores.wdecode.counters();
    const int64_t ignored = pc.notifications_ignored + dc.notifications_ignored +
                            wpc.notifications_ignored + wdc.notifications_ignored;
    const int64_t lease = pc.lease_expired + wpc.lease_expired;
    if (m_claim_) m_claim_->Inc(static_cast<double>(pc.claims_expired - synced_claim_));
    synced_claim_ = pc.claims_expired;
    const int64_t fails = dc.load_failures + wdc.load_failures;
    if (m_lease_) m_lease_->Inc(static_cast<double>(lease - synced_lease_));
    if (m_ignored_) m_ignored_->Inc(static_cast<double>(ignored - synced_ignored_));
    if (m_load_fail_) m_load_fail_->Inc(static_cast<double>(fails - synced_fail_));
    synced_lease_ = lease;
    synced_ignored_ = ignored;
    synced_fail_ = fails;
    const int64_t refused_r = impl_->refused_reads.load(), refused_w = impl_->refused_writes.load();
    if (m_refused_read_) m_refused_read_->Inc(static_cast<double>(refused_r - synced_refused_r_));
    if (m_refused_write_) m_refused_write_->Inc(static_cast<double>(refused_w - synced_refused_w_));
    synced_refused_r_ = refused_r;
    synced_refused_w_ = refused_w;
    int64_t hs_serve = 0, hs_connect = 0;
    auto add_refusals = [&](const xfer::TransferAgent* a) {
      if (!a) return;
      const xfer::TransferAgent::HandshakeRefusals r = a->HandshakeRefusalCounts();
      hs_serve += r.peers;
      hs_connect += r.servers;
    };
    add_refusals(agent_.get());
    for (auto& a : rank_agents_) add_refusals(a.get());
    if (m_handshake_serve_ && hs_serve > synced_hs_serve_) {
      m_handshake_serve_->Inc(static_cast<double>(hs_serve - synced_hs_serve_));
      synced_hs_serve_ = hs_serve;
    }
    if (m_handshake_connect_ && hs_connect > synced_hs_connect_) {
      m_handshake_connect_->Inc(static_cast<double>(hs_connect - synced_hs_connect_));
      synced_hs_connect_ = hs_connect;
    }
    for (const WriteDecodeCore::LoadTiming& t : logic_.TakeWriteLoadTimings()) {
      // One host shares CLOCK_MONOTONIC (SteadyNow): then the exact interval from the prefill's
      // last layer to this go; otherwise (an implausible difference) the cores' estimate.
      int64_t us = t.go_at - t.last_layer_at_us;
      if (t.last_layer_at_us <= 0 || us < 0 || us > 3600 * kSecond) us = t.overlap_us;
      write_overlap_us_sum_ += us;
      if (m_write_overlap_) m_write_overlap_->Observe(static_cast<double>(us) * 1e-6);
    }
    for (int64_t us : logic_.TakeWriteTransferTimes()) {
      if (m_seconds_) m_seconds_->Observe(static_cast<double>(us) * 1e-6);
    }
    MutexLock l(&impl_->mu);
    impl_->held_snapshot = std::move(held);
    impl_->writable_snapshot = std::move(writable);
    for (uint64_t t : unused_tokens_) impl_->reply_paths.erase(t);
    unused_tokens_.clear();
    KvBridgeStats& s = impl_->stats;
    s.transfers = cores.prefill.NumTransfers() + cores.wprefill.NumTransfers();
    s.held_blocks = cores.prefill.NumHeldBlocks() + cores.wprefill.NumHeldBlocks();
    s.parked = cores.prefill.NumParked() + cores.wprefill.NumParked();
    s.waiting_for_remote = cores.decode.NumWaiting() + cores.wdecode.NumWaiting();
    s.reads_inflight = reads_inflight_;
    s.lease_expired = lease;
    s.notifications_ignored = ignored;
    s.load_failures = fails;
    s.loads_done = dc.loads_done + wdc.loads_done;
    s.bytes_read = bytes_read_;
    s.writes_inflight = writes_inflight_;
    s.bytes_written = bytes_written_;
    s.write_loads_done = wdc.loads_done;
    s.write_overlap_us_sum = write_overlap_us_sum_;
    s.write_targets_done = wpc.targets_ok;
    s.write_transfer_us_sum = wpc.transfer_us_sum;
    s.write_compute_us_sum = wpc.compute_us_sum;
    s.idle = logic_.Idle() && handles_.empty();
  }

  std::shared_ptr<KvBridgeRuntime::Impl> impl_;
  EngineHooks hooks_;
  ConnectorLogic logic_;
  std::unique_ptr<xfer::TransferAgent> agent_;
  std::vector<std::unique_ptr<xfer::TransferAgent>> rank_agents_;  // ranks 1..tp-1 (TP)
  std::unique_ptr<Worker> worker_;
  std::unique_ptr<TransferWatcher> watcher_;
  std::map<std::string, PeerState> peers_;            // "<engine>/rank<r>" -> state (engine thread)
  std::map<HandleKey, Posted> handles_;               // posted READs and WRITEs (engine thread)
  int64_t reads_inflight_ = 0, writes_inflight_ = 0;  // of handles_
  double bytes_read_ = 0;
  double bytes_written_ = 0;
  int64_t write_overlap_us_sum_ = 0;
  std::vector<uint64_t> unused_tokens_;
  int64_t synced_lease_ = 0, synced_ignored_ = 0, synced_fail_ = 0;
  int64_t synced_refused_r_ = 0, synced_refused_w_ = 0;
  int64_t synced_hs_serve_ = 0, synced_hs_connect_ = 0;
  PhaseTimeline timeline_;
  static constexpr size_t kMaxLoadRecords = 4096;
  std::map<std::string, json> load_records_;  // decode: ended load records by request id
  Counter* m_bytes_ = nullptr;
  Histogram* m_seconds_ = nullptr;
  Histogram* m_hold_ = nullptr;
  Histogram* m_ack_ = nullptr;
  Histogram* m_write_overlap_ = nullptr;
  Counter* m_lease_ = nullptr;
  Counter* m_peer_lost_ = nullptr;
  Counter* m_peer_lost_released_ = nullptr;
  Counter* m_claim_ = nullptr;
  int64_t synced_claim_ = 0;
  std::set<std::string> lost_engines_;  // engine incarnations told lost (engine thread)
  Counter* m_load_fail_ = nullptr;
  Counter* m_ignored_ = nullptr;
  Counter* m_refused_read_ = nullptr;
  Counter* m_refused_write_ = nullptr;
  Counter* m_handshake_serve_ = nullptr;
  Counter* m_handshake_connect_ = nullptr;
};

}  // namespace

KvBridgeRuntime::KvBridgeRuntime(std::shared_ptr<Impl> impl) : impl_(std::move(impl)) {}
KvBridgeRuntime::~KvBridgeRuntime() = default;

Result<std::shared_ptr<KvBridgeRuntime>> KvBridgeRuntime::Create(KvBridgeOptions options) {
  if (options.tp_size < 1 || options.tp_rank < 0 || options.tp_rank >= options.tp_size) {
    return InvalidArgumentError("kv connector: tp_rank must be in [0, tp_size)");
  }
  auto impl = std::make_shared<Impl>();
  impl->engine_id =
      (options.config.engine_id.empty() ? std::string("kvb") : options.config.engine_id) + "-" +
      RandomHex(12);
  impl->options = std::move(options);
  return std::shared_ptr<KvBridgeRuntime>(new KvBridgeRuntime(std::move(impl)));
}

KvConnectorFactory KvBridgeRuntime::Factory() {
  std::shared_ptr<Impl> impl = impl_;
  return [impl](const EngineHooks& hooks) -> Result<std::unique_ptr<KvConnector>> {
    {
      MutexLock l(&impl->mu);
      if (impl->connector_made) {
        return FailedPreconditionError("kv connector: one engine per KvBridgeRuntime");
      }
      impl->connector_made = true;
    }
    return KvBridgeConnector::Create(impl, hooks);
  };
}

std::function<Status(nlohmann::json&)> KvBridgeRuntime::ValidateHook() const {
  std::shared_ptr<Impl> impl = impl_;
  return [impl](nlohmann::json& j) -> Status {
    // The remote pool size is unknown here; the transfer agent checks ranges when posting.
    ASSIGN_OR_RETURN(KvTransferParams p,
                     ParseKvTransferParams(j, {.block_size = impl->block_size.load()}));
    if (p.do_remote_decode && !impl->options.config.IsProducer()) {
      return InvalidArgumentError("kv_transfer_params.do_remote_decode: this engine is a " +
                                  std::string(KvRoleName(impl->options.config.role)));
    }
    if (p.do_remote_prefill && !impl->options.config.IsConsumer()) {
      return InvalidArgumentError("kv_transfer_params.do_remote_prefill: this engine is a " +
                                  std::string(KvRoleName(impl->options.config.role)));
    }
    j = KvTransferParamsToJson(p);
    return OkStatus();
  };
}

namespace {

// GET /v1/kv/metadata/<rank>: that TP rank's transfer-agent metadata (endpoints, tp_size,
// tp_rank, head range, layout); 404 for a rank the engine does not have.
RouteHandler RankMetadataRoute(std::shared_ptr<KvBridgeRuntime::Impl> impl) {
  return [impl](const HttpRequest& r) {
    if (!ClusterTokenMatches(r, impl->options.cluster_token)) {
      return OpenAiErrorResponse(403, "cluster token required");
    }
    const int rank = r.path_matches.size() > 1 ? std::stoi(r.path_matches[1]) : 0;
    MutexLock l(&impl->mu);
    if (impl->metadata_blob.empty()) return OpenAiErrorResponse(503, "kv connector not ready");
    if (rank == 0) return HttpResponse{.status = 200, .body = impl->metadata_blob};
    if (rank >= static_cast<int>(impl->rank_metadata_blobs.size())) {
      return OpenAiErrorResponse(
          404, "no TP rank " + std::to_string(rank) + " on this engine (tp_size " +
                   std::to_string(std::max<size_t>(1, impl->rank_metadata_blobs.size())) + ")");
    }
    return HttpResponse{.status = 200,
                        .body = impl->rank_metadata_blobs[static_cast<size_t>(rank)]};
  };
}

}  // namespace

std::vector<Route> KvBridgeRuntime::Routes() {
  std::shared_ptr<Impl> impl = impl_;
  std::vector<Route> routes;
  routes.push_back({"GET", "/v1/kv/metadata", [impl](const HttpRequest& r) {
                      if (!ClusterTokenMatches(r, impl->options.cluster_token)) {
                        return OpenAiErrorResponse(403, "cluster token required");
                      }
                      MutexLock l(&impl->mu);
                      if (impl->metadata_blob.empty()) {
                        return OpenAiErrorResponse(503, "kv connector not ready");
                      }
                      return HttpResponse{.status = 200, .body = impl->metadata_blob};
                    }});
  routes.push_back({"GET", R"(/v1/kv/metadata/(\d{1,4}))", RankMetadataRoute(impl)});
  routes.push_back(
      {"POST", "/v1/kv/release", [impl](const HttpRequest& r) {
         if (!ClusterTokenMatches(r, impl->options.cluster_token)) {
           return OpenAiErrorResponse(403, "cluster token required");
         }
         json j = json::parse(r.body, nullptr, false);
         if (j.is_discarded() || !j.is_object()) {
           return OpenAiErrorResponse(400, "body must be a JSON object {\"transfer_id\"}");
         }
         j["type"] = "release";
         if (!j.contains("prefill_engine_id")) j["prefill_engine_id"] = "";
         auto m = DecodeMessage(j.dump());
         if (!m.ok()) return OpenAiErrorResponse(400, m.status().message());
         const ReleaseMsg rel = std::get<ReleaseMsg>(*m);
         if (!rel.prefill_engine_id.empty() && rel.prefill_engine_id != impl->engine_id) {
           return OpenAiErrorResponse(404, "engine " + rel.prefill_engine_id +
                                               " is not this incarnation (" + impl->engine_id +
                                               ")");
         }
         impl->Push(EvMessage{rel, 0});
         return HttpResponse{
             .status = 200,
             .body = json{{"transfer_id", rel.transfer_id}, {"status", "accepted"}}.dump()};
       }});
  return routes;
}

void KvBridgeRuntime::SetAdvertisedEndpoint(const std::string& host, int port) {
  MutexLock l(&impl_->mu);
  impl_->options.advertise_host = host;
  impl_->options.advertise_port = port;
}

const std::string& KvBridgeRuntime::engine_id() const { return impl_->engine_id; }

std::map<std::string, std::string> KvBridgeRuntime::PeerBackends() const {
  MutexLock l(&impl_->mu);
  return impl_->peer_backends;
}

std::vector<std::string> KvBridgeRuntime::LocalBackends() const {
  MutexLock l(&impl_->mu);
  std::vector<std::string> out;
  if (impl_->metadata_blob.empty()) return out;
  auto md = xfer::DecodeMetadata(impl_->metadata_blob);
  if (!md.ok()) return out;
  for (const auto& [name, ep] : md->endpoints) out.push_back(name);
  return out;
}

KvBridgeStats KvBridgeRuntime::Stats() const {
  MutexLock l(&impl_->mu);
  KvBridgeStats s = impl_->stats;
  s.idle = s.idle && impl_->inbox.empty();
  return s;
}

}  // namespace kvbridge

#include "kvbridge/transfer/agent.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <condition_variable>
#include <fstream>
#include <map>
#include <mutex>
#include <random>
#include <thread>

#include "kvbridge/common/logging.h"
#include "transfer/auth.h"
#include "transfer/backend_registry.h"
#include "transfer/wire.h"

namespace kvbridge::transfer {

// ---------------------------------------------------------------- TransferHandle

struct TransferHandle::State {
  std::mutex mu;
  std::condition_variable cv;
  TransferState state = TransferState::kPending;
  Status status;
  std::string transfer_id;
  std::shared_ptr<TransferJob> job;

  void Finish(Status s) {
    {
      std::lock_guard<std::mutex> l(mu);
      if (state != TransferState::kPending) return;
      state = s.ok() ? TransferState::kDone : TransferState::kFailed;
      status = std::move(s);
    }
    cv.notify_all();
  }
};

TransferState TransferHandle::state() const {
  if (!s_) return TransferState::kFailed;
  std::lock_guard<std::mutex> l(s_->mu);
  return s_->state;
}

Status TransferHandle::status() const {
  if (!s_) return FailedPreconditionError("empty transfer handle");
  std::lock_guard<std::mutex> l(s_->mu);
  return s_->status;
}

bool TransferHandle::Wait(int timeout_ms) const {
  if (!s_) return true;
  // The waiter does the work no backend thread has started (shm: the copy), on this thread.
  if (s_->job && s_->job->help) s_->job->help();
  std::unique_lock<std::mutex> l(s_->mu);
  return s_->cv.wait_for(l, std::chrono::milliseconds(timeout_ms),
                         [&] { return s_->state != TransferState::kPending; });
}

void TransferHandle::Cancel() const {
  if (s_ && s_->job) s_->job->cancel.store(true);
}

const std::string& TransferHandle::transfer_id() const {
  static const std::string kEmpty;
  return s_ ? s_->transfer_id : kEmpty;
}

ByteRange HeadRangeBytes(const PagedKvLayout& layout, int head_begin, int head_count) {
  const uint64_t per_head =
      static_cast<uint64_t>(layout.block_size) * layout.head_dim * KvDtypeSize(layout.dtype);
  return ByteRange{per_head * static_cast<uint64_t>(head_begin),
                   per_head * static_cast<uint64_t>(head_count)};
}

// ---------------------------------------------------------------- Impl

namespace {

uint64_t NewIncarnation() {
  std::random_device rd;
  uint64_t v = (static_cast<uint64_t>(rd()) << 32) ^ rd();
  v ^= static_cast<uint64_t>(std::chrono::steady_clock::now().time_since_epoch().count());
  v ^= static_cast<uint64_t>(::getpid()) << 16;
  return v == 0 ? 1 : v;
}

std::string HostId() {
  std::string boot;
  std::ifstream f("/proc/sys/kernel/random/boot_id");
  std::getline(f, boot);
  char buf[256] = {0};
  ssize_t n = ::readlink("/proc/self/ns/net", buf, sizeof(buf) - 1);
  return boot + "/" + (n > 0 ? std::string(buf, static_cast<size_t>(n)) : std::string("net?"));
}

}  // namespace

class TransferAgent::Impl {
 public:
  // Declared first: outlive the backends, whose threads count into them.
  std::atomic<int64_t> refused_peers_{0}, refused_servers_{0}, refused_released_{0};
  explicit Impl(AgentConfig cfg) : cfg_(std::move(cfg)), incarnation_(NewIncarnation()) {}

  ~Impl() {
    {
      std::lock_guard<std::mutex> l(timer_mu_);
      stop_ = true;
    }
    timer_cv_.notify_all();
    if (timer_.joinable()) timer_.join();
    std::vector<std::shared_ptr<BackendPeer>> conns;
    {
      std::lock_guard<std::mutex> l(mu_);
      for (auto& [n, p] : peers_) conns.push_back(p.conn);
      peers_.clear();
      inbound_.clear();
    }
    for (auto& c : conns) c->Close();
    for (auto& b : backends_) b->Shutdown();
    FailReplies([](const PendingReply&) { return true; }, "agent shut down");
  }

  Status Init() {
    if (cfg_.name.empty()) return InvalidArgumentError("AgentConfig.name is required");
    if (cfg_.backends.empty()) return InvalidArgumentError("AgentConfig.backends is empty");
    if (cfg_.tcp_connections < 1 || cfg_.tcp_connections > 64) {
      return InvalidArgumentError("tcp_connections must be in [1, 64]");
    }
    if (cfg_.copy_threads < 1 || cfg_.copy_threads > 64) {
      return InvalidArgumentError("copy_threads must be in [1, 64]");
    }
    if (!cfg_.force_backend.empty() && std::find(cfg_.backends.begin(), cfg_.backends.end(),
                                                 cfg_.force_backend) == cfg_.backends.end()) {
      cfg_.backends.push_back(cfg_.force_backend);
    }
    hold_check_ = cfg_.hold_check;
    BackendContext ctx;
    ctx.agent_name = cfg_.name;
    ctx.incarnation = incarnation_;
    ctx.bind_host = cfg_.bind_host;
    ctx.tcp_port = cfg_.tcp_port;
    ctx.tcp_connections = cfg_.tcp_connections;
    ctx.copy_threads = cfg_.copy_threads;
    ctx.peer_timeout_ms = cfg_.peer_timeout_ms;
    ctx.cluster_token = cfg_.cluster_token;
    if (!cfg_.cluster_token.empty()) {
      const std::string token = cfg_.cluster_token;
      ctx.crypto.nonce = [] { return auth::RandomNonce(); };
      ctx.crypto.proof = [token](std::string_view context, std::string_view nonce) {
        return auth::Proof(token, context, nonce);
      };
      ctx.crypto.matches = [token](std::string_view context, std::string_view nonce,
                                   std::string_view proof) {
        return auth::ProofMatches(token, context, nonce, proof);
      };
    }
    ctx.on_message = [this](const std::string& peer, std::string bytes) {
      OnMessage(peer, std::move(bytes));
    };
    ctx.on_inbound = [this](const std::string& peer, std::shared_ptr<BackendPeer> ch) {
      std::lock_guard<std::mutex> l(mu_);
      inbound_[peer] = std::move(ch);
    };
    ctx.on_peer_lost = [this](const std::string& peer) { OnPeerLost(peer); };
    ctx.on_refused = [this](const std::string&, const Status&) { refused_peers_ += 1; };
    ctx.on_refused_released = [this](const std::string&) { refused_released_ += 1; };
    ctx.hold_check = [this](TransferOp op, std::string_view tid, const std::vector<int>& blocks) {
      HoldCheck hc;
      {
        std::lock_guard<std::mutex> l(mu_);
        hc = hold_check_;
      }
      return hc ? hc(op, tid, blocks) : true;
    };
    for (const std::string& name : cfg_.backends) {
      ASSIGN_OR_RETURN(auto b, MakeBackend(name, ctx));
      backends_.push_back(std::move(b));
    }
    timer_ = std::thread([this] { TimerLoop(); });
    return OkStatus();
  }

  Status RegisterMemory(const KvRegistration& reg) {
    RETURN_IF_ERROR(reg.Validate());
    std::lock_guard<std::mutex> reg_lock(register_mu_);
    if (registered_) return FailedPreconditionError("memory is already registered");
    reg_ = reg;
    if (reg_.k_scale.empty()) reg_.k_scale.assign(reg_.layers.size(), 1.0f);
    if (reg_.v_scale.empty()) reg_.v_scale.assign(reg_.layers.size(), 1.0f);
    AgentMetadata m;
    m.agent_name = cfg_.name;
    m.incarnation = incarnation_;
    m.host_id = HostId();
    m.tp_size = cfg_.tp_size;
    m.tp_rank = cfg_.tp_rank;
    m.head_begin = cfg_.head_begin;
    m.head_count = reg_.layout.num_kv_heads;
    m.layout = reg_.layout;
    for (const MemoryRegion& r : reg_.layers) {
      m.layer_base.push_back(reinterpret_cast<uint64_t>(r.base));
      m.layer_bytes.push_back(r.bytes);
    }
    m.memory_kind = reg_.layers[0].kind;
    m.k_scale = reg_.k_scale;
    m.v_scale = reg_.v_scale;
    m.model_fingerprint = cfg_.model_fingerprint;
    for (auto& b : backends_) {
      // A backend never sees memory it cannot move (tcp/shm/ucx would treat a device pointer
      // as host memory).
      if (!b->Supports(m.memory_kind)) continue;
      ASSIGN_OR_RETURN(std::string ep, b->Start(reg_));
      if (!ep.empty()) m.endpoints[std::string(b->name())] = ep;
      b->Describe(m);
    }
    if (m.endpoints.empty()) {
      if (m.memory_kind == MemoryKind::kCuda) {
        return FailedPreconditionError(
            "no configured backend moves CUDA device memory: configure backends = {\"cuda_ipc\"} "
            "(built only with KVBRIDGE_WITH_CUDA; this build has: " +
            [] {
              std::string s;
              for (const auto& n : AvailableBackends()) s += (s.empty() ? "" : ",") + n;
              return s;
            }() +
            ")");
      }
      return FailedPreconditionError("no backend can serve this memory");
    }
    m.compat_hash = ComputeCompatHash(m);
    std::lock_guard<std::mutex> l(mu_);
    meta_ = m;
    registered_ = true;
    return OkStatus();
  }

  Result<AgentMetadata> Metadata() const {
    std::lock_guard<std::mutex> l(mu_);
    if (!registered_) return FailedPreconditionError("RegisterMemory first");
    return meta_;
  }

  Result<std::string> AddPeer(const AgentMetadata& peer) {
    ASSIGN_OR_RETURN(AgentMetadata local, Metadata());
    RETURN_IF_ERROR(CheckCompatible(local, peer));
    Backend* chosen = nullptr;
    for (auto& b : backends_) {
      std::string n(b->name());
      if (!cfg_.force_backend.empty() && n != cfg_.force_backend) continue;
      if (!peer.endpoints.count(n) || !local.endpoints.count(n)) continue;
      if (!b->CanReach(local, peer)) continue;
      chosen = b.get();
      break;
    }
    if (!chosen) {
      std::string offered;
      for (auto& [n, e] : peer.endpoints) offered += (offered.empty() ? "" : ",") + n;
      return UnavailableError(
          "no common reachable backend with peer '" + peer.agent_name + "' (peer offers " +
          offered + (cfg_.force_backend.empty() ? "" : ", forced " + cfg_.force_backend) + ")");
    }
    Result<std::shared_ptr<BackendPeer>> connected = chosen->Connect(peer);
    if (!connected.ok()) {
      const StatusCode c = connected.status().code();
      if (c == StatusCode::kUnauthenticated || c == StatusCode::kPermissionDenied) {
        refused_servers_ += 1;
      }
      return connected.status();
    }
    std::shared_ptr<BackendPeer> conn = std::move(connected).value();
    std::shared_ptr<BackendPeer> old;
    {
      std::lock_guard<std::mutex> l(mu_);
      PeerEntry& e = peers_[peer.agent_name];
      old = std::move(e.conn);
      e.meta = peer;
      e.conn = std::move(conn);
      e.backend = std::string(chosen->name());
    }
    if (old) old->Close();
    return std::string(chosen->name());
  }

  Status RemovePeer(const std::string& name) {
    std::shared_ptr<BackendPeer> conn;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = peers_.find(name);
      if (it == peers_.end()) return NotFoundError("unknown peer '" + name + "'");
      conn = std::move(it->second.conn);
      peers_.erase(it);
    }
    conn->Close();
    return OkStatus();
  }

  Result<std::string> PeerBackend(const std::string& name) const {
    std::lock_guard<std::mutex> l(mu_);
    auto it = peers_.find(name);
    if (it == peers_.end()) return NotFoundError("unknown peer '" + name + "'");
    return it->second.backend;
  }

  Result<std::shared_ptr<const PreparedTransfer>> Prepare(const TransferSpec& spec) const {
    AgentMetadata peer;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!registered_) return FailedPreconditionError("RegisterMemory first");
      auto it = peers_.find(spec.peer);
      if (it == peers_.end())
        return NotFoundError("unknown peer '" + spec.peer + "' (AddPeer first)");
      peer = it->second.meta;
    }
    const PagedKvLayout& ll = reg_.layout;
    const PagedKvLayout& rl = peer.layout;
    if (spec.blocks.empty()) return InvalidArgumentError("transfer has no blocks");
    if (spec.layer < -1 || spec.layer >= ll.num_layers) {
      return InvalidArgumentError("layer " + std::to_string(spec.layer) + " out of range");
    }
    if (spec.local_range.has_value() != spec.remote_range.has_value()) {
      return InvalidArgumentError("local_range and remote_range go together");
    }
    const uint64_t lhalf = ll.HalfBlockBytes(), rhalf = rl.HalfBlockBytes();
    bool full = true;
    ByteRange lr{0, lhalf}, rr{0, rhalf};
    if (spec.local_range) {
      lr = *spec.local_range;
      rr = *spec.remote_range;
      if (lr.length == 0 || lr.length != rr.length) {
        return InvalidArgumentError("sub-block ranges must be non-empty and of equal length");
      }
      if (lr.offset > lhalf || lr.length > lhalf - lr.offset) {
        return InvalidArgumentError("local_range outside the half block");
      }
      if (rr.offset > rhalf || rr.length > rhalf - rr.offset) {
        return InvalidArgumentError("remote_range outside the peer's half block");
      }
      full = lr.offset == 0 && rr.offset == 0 && lr.length == lhalf && rr.length == rhalf;
    } else if (lhalf != rhalf) {
      return InvalidArgumentError("block sizes differ (" + std::to_string(lhalf) + " vs " +
                                  std::to_string(rhalf) + " bytes per half); give a range");
    }
    std::vector<BlockPair> pairs = spec.blocks;
    for (const BlockPair& p : pairs) {
      if (p.local < 0 || p.local >= ll.num_blocks) {
        return InvalidArgumentError("local block " + std::to_string(p.local) +
                                    " out of range [0, " + std::to_string(ll.num_blocks) + ")");
      }
      if (p.remote < 0 || p.remote >= rl.num_blocks) {
        return InvalidArgumentError("remote block " + std::to_string(p.remote) +
                                    " out of range [0, " + std::to_string(rl.num_blocks) + ")");
      }
    }
    std::sort(pairs.begin(), pairs.end(),
              [](const BlockPair& a, const BlockPair& b) { return a.local < b.local; });
    const int l0 = spec.layer < 0 ? 0 : spec.layer;
    const int l1 = spec.layer < 0 ? ll.num_layers : spec.layer + 1;
    auto segs = std::make_shared<std::vector<Segment>>();
    segs->reserve(pairs.size() * (full ? 1 : 2) * static_cast<size_t>(l1 - l0));
    uint64_t total = 0;
    const uint64_t lblock = ll.BlockBytes(), rblock = rl.BlockBytes();
    for (int layer = l0; layer < l1; ++layer) {
      uint8_t* lbase = reg_.layers[static_cast<size_t>(layer)].base;
      for (size_t i = 0; i < pairs.size();) {
        size_t j = i + 1;
        if (full) {
          while (j < pairs.size() && pairs[j].local == pairs[j - 1].local + 1 &&
                 pairs[j].remote == pairs[j - 1].remote + 1) {
            ++j;
          }
          Segment s;
          s.local = lbase + static_cast<uint64_t>(pairs[i].local) * lblock;
          s.remote_layer = static_cast<uint32_t>(layer);
          s.remote_offset = static_cast<uint64_t>(pairs[i].remote) * rblock;
          s.length = lblock * (j - i);
          total += s.length;
          segs->push_back(s);
        } else {
          for (int kv = 0; kv < 2; ++kv) {
            Segment s;
            s.local =
                lbase + static_cast<uint64_t>(pairs[i].local) * lblock + kv * lhalf + lr.offset;
            s.remote_layer = static_cast<uint32_t>(layer);
            s.remote_offset =
                static_cast<uint64_t>(pairs[i].remote) * rblock + kv * rhalf + rr.offset;
            s.length = lr.length;
            total += s.length;
            segs->push_back(s);
          }
        }
        i = j;
      }
    }
    auto p = std::shared_ptr<PreparedTransfer>(new PreparedTransfer());
    p->op_ = spec.op;
    p->peer_ = spec.peer;
    p->bytes_ = total;
    p->segments_ = std::move(segs);
    return std::shared_ptr<const PreparedTransfer>(std::move(p));
  }

  Result<TransferHandle> Post(std::shared_ptr<const PreparedTransfer> prepared, PostOptions opt) {
    if (!prepared) return InvalidArgumentError("null prepared transfer");
    std::shared_ptr<BackendPeer> conn;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = peers_.find(prepared->peer());
      if (it == peers_.end()) return NotFoundError("unknown peer '" + prepared->peer() + "'");
      conn = it->second.conn;
    }
    if (!conn->alive()) {
      return UnavailableError("peer '" + prepared->peer() + "' is dead");
    }
    auto state = std::make_shared<TransferHandle::State>();
    state->transfer_id = opt.transfer_id;
    auto job = std::make_shared<TransferJob>();
    job->op = prepared->op();
    job->transfer_id = opt.transfer_id;
    job->segments = prepared->segments_;
    job->total_bytes = prepared->bytes();
    state->job = job;
    std::string peer = prepared->peer();
    std::weak_ptr<BackendPeer> weak_conn = conn;
    std::weak_ptr<TransferHandle::State> weak_state = state;  // no cycle state -> job -> state
    job->finish = [this, weak_state, peer, weak_conn, note = std::move(opt.notification),
                   on_reply = std::move(opt.on_reply), tid = opt.transfer_id](Status s) mutable {
      if (s.ok() && note.has_value()) {
        auto c = weak_conn.lock();
        Status ns = c ? SendNotify(peer, c, tid, std::move(*note), std::move(on_reply))
                      : UnavailableError("peer connection closed");
        if (!ns.ok())
          s = UnavailableError("transfer done but notification failed: " + ns.message());
      }
      if (auto st = weak_state.lock()) st->Finish(std::move(s));
    };
    conn->Submit(job);
    return TransferHandle(state);
  }

  void SetNotificationHandler(NotificationHandler h) {
    std::lock_guard<std::mutex> l(mu_);
    handler_ = std::move(h);
  }

  void SetPeerLostHandler(std::function<void(const std::string&)> h) {
    std::lock_guard<std::mutex> l(mu_);
    peer_lost_handler_ = std::move(h);
  }

  void SetHoldCheck(HoldCheck h) {
    std::lock_guard<std::mutex> l(mu_);
    hold_check_ = std::move(h);
  }

  Status Notify(const std::string& peer, const std::string& tid, std::string payload,
                ReplyCallback on_reply) {
    ASSIGN_OR_RETURN(auto path, PathTo(peer));
    return SendNotify(peer, path, tid, std::move(payload), std::move(on_reply));
  }

  Status Reply(const Notification& n, std::string payload) {
    if (!n.wants_reply) return FailedPreconditionError("notification did not ask for a reply");
    ASSIGN_OR_RETURN(auto path, PathTo(n.peer));
    wire::AgentMessage m;
    m.kind = wire::MessageKind::kReply;
    m.id = n.id;
    m.transfer_id = n.transfer_id;
    m.payload = std::move(payload);
    return path->SendMessage(wire::EncodeAgentMessage(m));
  }

 private:
  struct PeerEntry {
    AgentMetadata meta;
    std::shared_ptr<BackendPeer> conn;
    std::string backend;
  };
  struct PendingReply {
    std::string peer;
    std::weak_ptr<BackendPeer> path;
    ReplyCallback cb;
    std::chrono::steady_clock::time_point deadline;
  };

  Result<std::shared_ptr<BackendPeer>> PathTo(const std::string& peer) {
    std::lock_guard<std::mutex> l(mu_);
    auto it = peers_.find(peer);
    if (it != peers_.end() && it->second.conn->alive()) return it->second.conn;
    auto in = inbound_.find(peer);
    if (in != inbound_.end() && in->second->alive()) return in->second;
    return UnavailableError("no live connection to peer '" + peer + "'");
  }

  Status SendNotify(const std::string& peer, const std::shared_ptr<BackendPeer>& path,
                    const std::string& tid, std::string payload, ReplyCallback on_reply) {
    wire::AgentMessage m;
    m.kind = wire::MessageKind::kNotify;
    m.id = next_id_.fetch_add(1);
    m.transfer_id = tid;
    m.payload = std::move(payload);
    m.wants_reply = static_cast<bool>(on_reply);
    if (m.wants_reply) {
      std::lock_guard<std::mutex> l(timer_mu_);
      replies_[m.id] = PendingReply{
          peer, path, std::move(on_reply),
          std::chrono::steady_clock::now() + std::chrono::milliseconds(cfg_.reply_timeout_ms)};
    }
    Status s = path->SendMessage(wire::EncodeAgentMessage(m));
    if (!s.ok() && m.wants_reply) {
      std::lock_guard<std::mutex> l(timer_mu_);
      replies_.erase(m.id);
    }
    return s;
  }

  void OnMessage(const std::string& peer, std::string bytes) {
    Result<wire::AgentMessage> m = wire::DecodeAgentMessage(bytes);
    if (!m.ok()) {
      KVB_LOG_WARN("transfer agent {}: dropped bad message from {}: {}", cfg_.name, peer,
                   m.status().ToString());
      return;
    }
    if (m->kind == wire::MessageKind::kReply) {
      ReplyCallback cb;
      {
        std::lock_guard<std::mutex> l(timer_mu_);
        auto it = replies_.find(m->id);
        if (it == replies_.end() || it->second.peer != peer) return;  // late or foreign
        cb = std::move(it->second.cb);
        replies_.erase(it);
      }
      cb(std::move(m->payload));
      return;
    }
    NotificationHandler h;
    {
      std::lock_guard<std::mutex> l(mu_);
      h = handler_;
    }
    Notification n{peer, m->id, std::move(m->transfer_id), std::move(m->payload), m->wants_reply};
    if (h) {
      h(std::move(n));
    } else {
      KVB_LOG_WARN("transfer agent {}: notification from {} without a handler", cfg_.name, peer);
    }
  }

  void OnPeerLost(const std::string& peer) {
    std::function<void(const std::string&)> lost;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto in = inbound_.find(peer);
      if (in != inbound_.end() && !in->second->alive()) inbound_.erase(in);
      lost = peer_lost_handler_;
    }
    FailReplies(
        [&](const PendingReply& r) {
          auto p = r.path.lock();
          return r.peer == peer && (!p || !p->alive());
        },
        "peer '" + peer + "' lost");
    if (lost) lost(peer);
  }

  template <typename Pred>
  void FailReplies(Pred pred, const std::string& why) {
    std::vector<ReplyCallback> cbs;
    {
      std::lock_guard<std::mutex> l(timer_mu_);
      for (auto it = replies_.begin(); it != replies_.end();) {
        if (pred(it->second)) {
          cbs.push_back(std::move(it->second.cb));
          it = replies_.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (auto& cb : cbs) cb(UnavailableError(why));
  }

  void TimerLoop() {
    std::unique_lock<std::mutex> l(timer_mu_);
    while (!stop_) {
      timer_cv_.wait_for(l, std::chrono::milliseconds(20));
      auto now = std::chrono::steady_clock::now();
      std::vector<ReplyCallback> expired;
      for (auto it = replies_.begin(); it != replies_.end();) {
        if (it->second.deadline <= now) {
          expired.push_back(std::move(it->second.cb));
          it = replies_.erase(it);
        } else {
          ++it;
        }
      }
      if (expired.empty()) continue;
      l.unlock();
      for (auto& cb : expired) cb(DeadlineExceededError("no reply within reply_timeout_ms"));
      l.lock();
    }
  }

  AgentConfig cfg_;
  const uint64_t incarnation_;
  std::vector<std::unique_ptr<Backend>> backends_;
  std::mutex register_mu_;
  KvRegistration reg_;  // written once under register_mu_ before registered_ is set

  mutable std::mutex mu_;
  bool registered_ = false;
  AgentMetadata meta_;
  std::map<std::string, PeerEntry> peers_;
  std::map<std::string, std::shared_ptr<BackendPeer>> inbound_;
  NotificationHandler handler_;
  HoldCheck hold_check_;
  std::function<void(const std::string&)> peer_lost_handler_;

  std::atomic<uint64_t> next_id_{1};
  std::mutex timer_mu_;
  std::condition_variable timer_cv_;
  bool stop_ = false;
  std::map<uint64_t, PendingReply> replies_;
  std::thread timer_;
};

// ---------------------------------------------------------------- TransferAgent

Result<std::unique_ptr<TransferAgent>> TransferAgent::Create(AgentConfig config) {
  auto impl = std::make_unique<Impl>(std::move(config));
  RETURN_IF_ERROR(impl->Init());
  return std::unique_ptr<TransferAgent>(new TransferAgent(std::move(impl)));
}

TransferAgent::TransferAgent(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TransferAgent::~TransferAgent() = default;

Status TransferAgent::RegisterMemory(const KvRegistration& reg) {
  return impl_->RegisterMemory(reg);
}
Result<AgentMetadata> TransferAgent::Metadata() const { return impl_->Metadata(); }
Result<std::string> TransferAgent::AddPeer(const AgentMetadata& peer) {
  return impl_->AddPeer(peer);
}
Status TransferAgent::RemovePeer(const std::string& n) { return impl_->RemovePeer(n); }
Result<std::string> TransferAgent::PeerBackend(const std::string& n) const {
  return impl_->PeerBackend(n);
}
Result<std::shared_ptr<const PreparedTransfer>> TransferAgent::Prepare(
    const TransferSpec& s) const {
  return impl_->Prepare(s);
}
Result<TransferHandle> TransferAgent::Post(std::shared_ptr<const PreparedTransfer> p,
                                           PostOptions o) {
  return impl_->Post(std::move(p), std::move(o));
}
void TransferAgent::SetPeerLostHandler(std::function<void(const std::string&)> h) {
  impl_->SetPeerLostHandler(std::move(h));
}

void TransferAgent::SetNotificationHandler(NotificationHandler h) {
  impl_->SetNotificationHandler(std::move(h));
}
Status TransferAgent::Notify(const std::string& peer, const std::string& tid, std::string payload,
                             ReplyCallback on_reply) {
  return impl_->Notify(peer, tid, std::move(payload), std::move(on_reply));
}
Status TransferAgent::Reply(const Notification& n, std::string payload) {
  return impl_->Reply(n, std::move(payload));
}
void TransferAgent::SetHoldCheck(HoldCheck check) { impl_->SetHoldCheck(std::move(check)); }
TransferAgent::HandshakeRefusals TransferAgent::HandshakeRefusalCounts() const {
  return {impl_->refused_peers_.load(), impl_->refused_servers_.load(),
          impl_->refused_released_.load()};
}

}  // namespace kvbridge::transfer

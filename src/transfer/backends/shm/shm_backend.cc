#include "transfer/backends/shm/shm_backend.h"

#include <sys/mman.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <thread>

#include "kvbridge/common/logging.h"
#include "transfer/auth.h"
#include "transfer/backend_util.h"
#include "transfer/socket_util.h"
#include "transfer/stream_copy.h"
#include "transfer/wire.h"

namespace kvbridge::transfer {
namespace {

using wire::FrameHeader;
using wire::FrameType;

constexpr uint64_t kSplitBytes = 8u << 20;  // split a job over workers above this
constexpr uint64_t kChunkBytes = 4u << 20;  // cancel is polled at least this often
// Jobs of at least this many bytes copy with streaming stores: more than a core's L2 (2 MiB
// here), so their destination would not stay in cache anyway.
constexpr uint64_t kStreamJobBytes = 4u << 20;

// The uid at the other end of a connected unix socket must be ours: shm hands out (and maps)
// the whole KV pool's memfds, so only processes of the same user may take part.
Status CheckPeerUid(int sock, const char* who) {
  struct ucred cred {};
  socklen_t len = sizeof(cred);
  if (::getsockopt(sock, SOL_SOCKET, SO_PEERCRED, &cred, &len) != 0) {
    return PermissionDeniedError(std::string("shm: cannot read the ") + who + "'s credentials");
  }
  const uid_t self = ::geteuid();
  if (cred.uid != self) {
    return PermissionDeniedError(std::string("shm ") + who + " runs as uid " +
                                 std::to_string(cred.uid) + " (pid " + std::to_string(cred.pid) +
                                 "), this agent as uid " + std::to_string(self) +
                                 ": shm peers must be processes of the same user");
  }
  return OkStatus();
}

// Peer memory mapped into this process; kept alive by every in-flight copy.
struct RemoteMap {
  std::vector<std::pair<void*, size_t>> maps;
  std::vector<uint8_t*> layer_base;
  std::vector<uint64_t> layer_bytes;
  ~RemoteMap() {
    for (auto& [p, n] : maps) ::munmap(p, n);
  }
};

struct Work {
  std::shared_ptr<TransferJob> job;
  std::shared_ptr<RemoteMap> map;
  std::shared_ptr<JobParts> parts;  // a part's Copy returns OK or Cancelled only
  size_t begin = 0, end = 0;
};

class CopyPool {
 public:
  explicit CopyPool(int threads) : q_(std::make_shared<Queue>()) {
    for (int i = 0; i < threads; ++i) threads_.emplace_back([q = q_] { Loop(*q); });
  }
  ~CopyPool() {
    {
      std::lock_guard<std::mutex> l(q_->mu);
      q_->stop = true;
    }
    q_->cv.notify_all();
    for (auto& t : threads_) t.join();
  }
  // Queues the parts of one job and sets its `help` (a waiter runs the parts not yet started).
  void Push(std::vector<Work> w) {
    TransferJob* job = w.front().job.get();
    job->help = [weak = std::weak_ptr<Queue>(q_), job] {
      if (auto q = weak.lock()) RunQueued(*q, job);
    };
    {
      std::lock_guard<std::mutex> l(q_->mu);
      for (auto& x : w) q_->q.push_back(std::move(x));
    }
    if (w.size() == 1) {
      q_->cv.notify_one();
    } else {
      q_->cv.notify_all();
    }
  }
  size_t size() const { return threads_.size(); }

 private:
  struct Queue {
    std::mutex mu;
    std::condition_variable cv;
    std::deque<Work> q;
    bool stop = false;
  };

  static void Loop(Queue& q) {
    for (;;) {
      Work w;
      {
        std::unique_lock<std::mutex> l(q.mu);
        q.cv.wait(l, [&] { return q.stop || !q.q.empty(); });
        if (q.q.empty()) return;  // stop with nothing left
        w = std::move(q.q.front());
        q.q.pop_front();
      }
      w.parts->Done(w.job, Copy(w));
    }
  }

  // Takes `job`'s parts still queued and copies them on the calling thread.
  static void RunQueued(Queue& q, const TransferJob* job) {
    std::vector<Work> mine;
    {
      std::lock_guard<std::mutex> l(q.mu);
      for (auto it = q.q.begin(); it != q.q.end();) {
        if (it->job.get() == job) {
          mine.push_back(std::move(*it));
          it = q.q.erase(it);
        } else {
          ++it;
        }
      }
    }
    for (Work& w : mine) w.parts->Done(w.job, Copy(w));
  }

  static Status Copy(const Work& w) {
    const auto& segs = *w.job->segments;
    const bool read = w.job->op == TransferOp::kRead;
    // Large transfers: streaming stores (stream_copy.h), fenced before the part reports done
    // (Done publishes the bytes to the waiter and the notification). Small ones stay memcpy:
    // their destination may well be read while still in cache.
    const bool stream = w.job->total_bytes >= kStreamJobBytes;
    struct Fence {
      bool on;
      ~Fence() {
        if (on) StreamCopyFence();
      }
    } fence{stream};
    uint64_t since_check = 0;
    for (size_t i = w.begin; i < w.end; ++i) {
      const Segment& s = segs[i];
      uint8_t* remote = w.map->layer_base[s.remote_layer] + s.remote_offset;
      if (i + 1 < w.end) {
        // Blocks are scattered: start the next segment's page walks and first lines now (the
        // hardware prefetchers stop at page ends); 4 KiB blocks gained ~10-20 % with it.
        const Segment& nx = segs[i + 1];
        const uint8_t* nr = w.map->layer_base[nx.remote_layer] + nx.remote_offset;
        const uint8_t* nsrc = read ? nr : nx.local;
        const uint8_t* ndst = read ? nx.local : nr;
        for (int line = 0; line < 4; ++line) __builtin_prefetch(nsrc + 64 * line, 0);
        if (!stream) __builtin_prefetch(ndst, 1);  // streaming stores need no line in cache
      }
      for (uint64_t done = 0; done < s.length;) {
        // relaxed: cancel is advisory; bytes before it is seen may still land, which the
        // contract allows (terminal only once this copy stops).
        if (since_check >= kChunkBytes || (done == 0 && i == w.begin)) {
          if (w.job->cancel.load(std::memory_order_relaxed)) return CancelledError("cancelled");
          since_check = 0;
        }
        uint64_t n = std::min<uint64_t>(s.length - done, kChunkBytes);
        uint8_t* dst = read ? s.local + done : remote + done;
        const uint8_t* src = read ? remote + done : s.local + done;
        if (stream) {
          StreamCopy(dst, src, n);
        } else {
          std::memcpy(dst, src, n);
        }
        done += n;
        since_check += n;
      }
    }
    return OkStatus();
  }

  std::shared_ptr<Queue> q_;
  std::vector<std::thread> threads_;
};

// A unix-socket message path (both directions), with a reader thread.
class ShmChannel : public BackendPeer, public std::enable_shared_from_this<ShmChannel> {
 public:
  ShmChannel(net::Fd sock, std::string peer_name, const BackendContext* ctx, CopyPool* pool,
             std::shared_ptr<RemoteMap> map)
      : sock_(std::move(sock)),
        peer_(std::move(peer_name)),
        ctx_(ctx),
        pool_(pool),
        map_(std::move(map)) {}
  ~ShmChannel() override { Close(); }

  void StartReader() {
    reader_ = std::thread([this] { ReadLoop(); });
  }

  void Submit(std::shared_ptr<TransferJob> job) override {
    if (!map_) {
      job->finish(FailedPreconditionError("inbound shm channel carries messages only"));
      return;
    }
    if (!alive()) {
      job->finish(UnavailableError("shm peer '" + peer_ + "' is dead"));
      return;
    }
    const auto& segs = *job->segments;
    for (const Segment& s : segs) {  // defence in depth: Prepare checked against the metadata
      if (!SegmentFitsPeer(s, map_->layer_bytes)) {
        job->finish(InvalidArgumentError("segment outside the peer's mapped region"));
        return;
      }
    }
    int nparts = 1;
    if (job->total_bytes >= kSplitBytes && pool_->size() > 1 && segs.size() > 1) {
      nparts = static_cast<int>(std::min<size_t>(pool_->size(), segs.size()));
    }
    auto parts = std::make_shared<JobParts>(nparts);
    std::vector<Work> work;
    size_t begin = 0;
    uint64_t acc = 0;
    for (int p = 0; p < nparts; ++p) {
      size_t end = begin;
      uint64_t target = job->total_bytes * static_cast<uint64_t>(p + 1) / nparts;
      while (end < segs.size() && (acc < target || end == begin)) acc += segs[end++].length;
      if (p == nparts - 1) end = segs.size();
      work.push_back(Work{job, map_, parts, begin, end});
      begin = end;
    }
    pool_->Push(std::move(work));
  }

  Status SendMessage(std::string_view bytes) override {
    if (!alive()) return UnavailableError("shm peer '" + peer_ + "' is dead");
    FrameHeader h;
    h.type = FrameType::kMsg;
    std::lock_guard<std::mutex> l(send_mu_);
    Status s = net::SendFrame(sock_.get(), h, bytes);
    if (!s.ok()) MarkDead();
    return s;
  }

  bool alive() const override { return alive_.load(); }

  void Close() override {
    MarkDead();
    JoinOrDetach(reader_);
  }

 private:
  void MarkDead() {
    if (alive_.exchange(false)) net::Shutdown(sock_.get());
  }

  void ReadLoop() {
    for (;;) {
      FrameHeader h;
      std::string meta;
      Status s = net::RecvFrameHead(sock_.get(), &h, &meta);
      if (s.ok() && (h.type != FrameType::kMsg || h.payload_len != 0)) {
        s = InvalidArgumentError("unexpected frame on shm control socket");
      }
      if (!s.ok()) break;
      if (ctx_->on_message) ctx_->on_message(peer_, std::move(meta));
    }
    bool was_alive = alive_.exchange(false);
    net::Shutdown(sock_.get());
    if (was_alive && ctx_->on_peer_lost) ctx_->on_peer_lost(peer_);
  }

  net::Fd sock_;
  std::string peer_;
  const BackendContext* ctx_;
  CopyPool* pool_;
  std::shared_ptr<RemoteMap> map_;  // null for inbound (message-only) channels
  std::atomic<bool> alive_{true};
  std::mutex send_mu_;
  std::thread reader_;
};

class ShmBackend : public Backend {
 public:
  explicit ShmBackend(const BackendContext& ctx) : ctx_(ctx), pool_(ctx.copy_threads) {}
  ~ShmBackend() override { Shutdown(); }

  std::string_view name() const override { return "shm"; }
  bool one_sided() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind == MemoryKind::kHost; }

  Result<std::string> Start(const KvRegistration& reg) override {
    reg_ = &reg;
    for (const MemoryRegion& r : reg.layers) {
      if (r.shm_fd < 0 || r.kind != MemoryKind::kHost) return std::string();  // not shareable
    }
    char name[96];
    std::snprintf(name, sizeof(name), "@kvbridge-shm-%016llx",
                  static_cast<unsigned long long>(ctx_.incarnation));
    ASSIGN_OR_RETURN(listen_, net::UnixListen(name));
    accept_ = std::thread([this] { AcceptLoop(); });
    return std::string(name);
  }

  bool CanReach(const AgentMetadata& local, const AgentMetadata& peer) const override {
    return !local.host_id.empty() && local.host_id == peer.host_id;
  }

  Result<std::shared_ptr<BackendPeer>> Connect(const AgentMetadata& peer) override {
    auto ep = peer.endpoints.find("shm");
    if (ep == peer.endpoints.end()) return UnavailableError("peer has no shm endpoint");
    ASSIGN_OR_RETURN(net::Fd sock, net::UnixConnect(ep->second));
    // The abstract name is not owned: whoever answers on it must be of our uid too.
    if (Status u = CheckPeerUid(sock.get(), "server"); !u.ok()) return u;
    net::SetTimeouts(sock.get(), ctx_.peer_timeout_ms, ctx_.peer_timeout_ms);
    wire::Hello hello{ctx_.agent_name, ctx_.incarnation, peer.incarnation, 0};
    FrameHeader h;
    h.type = FrameType::kHello;
    RETURN_IF_ERROR(net::SendFrame(sock.get(), h, wire::EncodeHello(hello)));
    uint8_t head[wire::kFrameHeaderBytes];
    std::vector<net::Fd> fds;
    FrameHeader ack;
    std::string meta;
    const auth::HandshakeIds ids{"shm", peer.incarnation, ctx_.agent_name};
    bool answered = false;
    // A challenge (token configured there) and the server's proof precede the ack.
    for (int round = 0; round < 2; ++round) {
      RETURN_IF_ERROR(net::RecvWithFds(sock.get(), head, sizeof(head), &fds));
      ASSIGN_OR_RETURN(ack, wire::DecodeFrameHeader(head, sizeof(head)));
      meta.assign(ack.meta_len, '\0');
      if (ack.meta_len) RETURN_IF_ERROR(net::RecvAll(sock.get(), meta.data(), meta.size()));
      if (round == 1) break;
      RETURN_IF_ERROR(
          auth::ClientAnswer(sock.get(), ack, meta, ctx_.cluster_token, ids, &answered));
      if (!answered) break;
      if (!fds.empty()) return UnavailableError("shm handshake: fds on a challenge");
    }
    if (ack.type != FrameType::kHelloAck) return UnavailableError("shm handshake: bad reply");
    wire::Reader r(meta);
    if (ack.status != 0) {
      std::string msg;
      r.Str(msg, 4096);
      return Status(static_cast<StatusCode>(ack.status), "shm handshake refused: " + msg);
    }
    // An unproven server's fds are closed unmapped (fds' destructors).
    RETURN_IF_ERROR(auth::RequireServerProof(ctx_.cluster_token, answered, "shm"));
    auto map = std::make_shared<RemoteMap>();
    for (net::Fd& f : fds) {
      struct stat st;
      if (::fstat(f.get(), &st) != 0 || st.st_size <= 0) return UnavailableError("shm: bad fd");
      void* p = ::mmap(nullptr, static_cast<size_t>(st.st_size), PROT_READ | PROT_WRITE, MAP_SHARED,
                       f.get(), 0);
      if (p == MAP_FAILED) return ResourceExhaustedError("shm: mmap of peer region failed");
      map->maps.emplace_back(p, static_cast<size_t>(st.st_size));
    }
    uint32_t n;
    if (!r.U32(n) || n != peer.layer_bytes.size())
      return UnavailableError("shm handshake: bad table");
    for (uint32_t i = 0; i < n; ++i) {
      uint32_t fi;
      uint64_t off, bytes;
      if (!r.U32(fi) || !r.U64(off) || !r.U64(bytes) || fi >= map->maps.size() ||
          off > map->maps[fi].second || bytes > map->maps[fi].second - off ||
          bytes != peer.layer_bytes[i]) {
        return UnavailableError("shm handshake: region " + std::to_string(i) + " does not fit");
      }
      map->layer_base.push_back(static_cast<uint8_t*>(map->maps[fi].first) + off);
      map->layer_bytes.push_back(bytes);
    }
    net::SetTimeouts(sock.get(), 0, ctx_.peer_timeout_ms);
    auto ch = std::make_shared<ShmChannel>(std::move(sock), peer.agent_name, &ctx_, &pool_, map);
    ch->StartReader();
    return std::shared_ptr<BackendPeer>(ch);
  }

  void Shutdown() override {
    std::list<std::shared_ptr<ShmChannel>> inbound;
    if (!inbound_.Shut(&inbound)) return;
    net::Shutdown(listen_.get());
    if (accept_.joinable()) accept_.join();
    for (auto& c : inbound) c->Close();
  }

 private:
  void AcceptLoop() {
    for (int fd; (fd = AcceptRetrying(listen_.get())) >= 0;) {
      net::Fd sock(fd);
      // The handshake is short and bounded by the timeout; do it inline.
      net::SetTimeouts(sock.get(), ctx_.peer_timeout_ms, ctx_.peer_timeout_ms);
      FrameHeader h;
      std::string meta;
      if (!net::RecvFrameHead(sock.get(), &h, &meta).ok() || h.type != FrameType::kHello) continue;
      Result<wire::Hello> hello = wire::DecodeHello(meta);
      FrameHeader ack;
      ack.type = FrameType::kHelloAck;
      wire::Writer w;
      std::vector<int> fds;
      // Refusals, in order: a bad hello, stale metadata, another uid, no / wrong cluster token.
      // A refused peer gets the reason and no fd.
      Status st;
      if (!hello.ok() || hello->expect_incarnation != ctx_.incarnation) {
        st = FailedPreconditionError(hello.ok() ? "stale metadata: agent incarnation changed"
                                                : hello.status().message());
      } else if (st = CheckPeerUid(sock.get(), "peer"); st.ok()) {
        st = auth::ServerChallenge(sock.get(), ctx_.cluster_token,
                                   {"shm", ctx_.incarnation, hello->agent_name});
        if (st.code() == StatusCode::kUnavailable) continue;  // the socket is gone
      }
      if (!st.ok()) {
        ack.status = static_cast<uint16_t>(st.code());
        w.Str(st.message());
        if (hello.ok() && st.code() != StatusCode::kFailedPrecondition) {
          KVB_LOG_WARN("shm transfer server: refused peer '{}': {}", hello->agent_name,
                       st.message());
          if (ctx_.on_refused) ctx_.on_refused(hello->agent_name, st);
        }
      } else {
        w.U32(static_cast<uint32_t>(reg_->layers.size()));
        for (const MemoryRegion& r : reg_->layers) {
          auto it = std::find(fds.begin(), fds.end(), r.shm_fd);
          uint32_t idx = static_cast<uint32_t>(it - fds.begin());
          if (it == fds.end()) fds.push_back(r.shm_fd);
          w.U32(idx);
          w.U64(r.shm_offset);
          w.U64(r.bytes);
        }
      }
      std::string meta_out = w.Take();
      ack.meta_len = static_cast<uint32_t>(meta_out.size());
      uint8_t head[wire::kFrameHeaderBytes];
      wire::EncodeFrameHeader(ack, head);
      std::string frame(reinterpret_cast<char*>(head), sizeof(head));
      frame += meta_out;
      if (!net::SendWithFds(sock.get(), frame, fds).ok() || ack.status != 0) continue;
      net::SetTimeouts(sock.get(), 0, ctx_.peer_timeout_ms);
      auto ch =
          std::make_shared<ShmChannel>(std::move(sock), hello->agent_name, &ctx_, &pool_, nullptr);
      // Drops channels whose peer is gone (their reader has finished).
      if (!inbound_.Add(ch, [](const ShmChannel& c) { return !c.alive(); })) return;
      if (ctx_.on_inbound) ctx_.on_inbound(hello->agent_name, ch);
      ch->StartReader();
    }
  }

  BackendContext ctx_;
  CopyPool pool_;
  const KvRegistration* reg_ = nullptr;
  net::Fd listen_;
  std::thread accept_;
  InboundConns<ShmChannel> inbound_;
};

}  // namespace

std::unique_ptr<Backend> MakeShmBackend(const BackendContext& ctx) {
  return std::make_unique<ShmBackend>(ctx);
}

}  // namespace kvbridge::transfer

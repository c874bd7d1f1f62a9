#include "transfer/backends/tcp/tcp_backend.h"

#include <sys/socket.h>

#include <algorithm>
#include <condition_variable>
#include <deque>
#include <list>
#include <map>
#include <mutex>
#include <thread>

#include "kvbridge/common/logging.h"
#include "transfer/auth.h"
#include "transfer/backend_util.h"
#include "transfer/socket_util.h"
#include "transfer/wire.h"

namespace kvbridge::transfer {
namespace {

using wire::FrameHeader;
using wire::FrameType;

constexpr uint64_t kMaxRequestBytes = 16u << 20;
constexpr uint64_t kMinStripeBytes = 256u << 10;
constexpr size_t kMaxRequestSegments = 16384;

struct Request {
  uint64_t id = 0;
  std::shared_ptr<TransferJob> job;
  std::shared_ptr<JobParts> parts;
  size_t begin = 0, end = 0;
  uint64_t bytes = 0;
};

std::vector<struct iovec> LocalIov(const Request& r) {
  std::vector<struct iovec> iov;
  iov.reserve(r.end - r.begin);
  const auto& segs = *r.job->segments;
  for (size_t i = r.begin; i < r.end; ++i) iov.push_back({segs[i].local, segs[i].length});
  return iov;
}

// Reports a peer's loss (BackendContext::on_peer_lost) only once no byte of that peer can land
// in our memory any more (issue 21). A peer stripes its WRITEs over several connections to us;
// when it dies, the server thread of one of them may still be copying bytes it sent before it
// died (they sit in our receive buffer) after its message channel (connection 0) closed or our
// own connection to it failed. Such a loss is held back until every inbound connection of that
// peer has ended; a new channel from the peer before then cancels it (it reconnected: alive).
// Thread-safe; the report runs outside the lock.
class LossGate {
 public:
  explicit LossGate(std::function<void(const std::string&)> report) : report_(std::move(report)) {}

  // An inbound connection of `name` passed its handshake (`channel`: connection index 0).
  void Opened(const std::string& name, bool channel) {
    std::lock_guard<std::mutex> l(mu_);
    Entry& e = peers_[name];
    ++e.live;
    if (channel) {
      ++e.channels;
      e.lost = false;
    }
  }
  // That connection's server thread ended (no byte of it lands any more); `loss`: it was the
  // peer's channel and the peer closed it (not our shutdown).
  void Closed(const std::string& name, bool channel, bool loss) {
    bool report = false;
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = peers_.find(name);
      if (it == peers_.end()) return;
      Entry& e = it->second;
      --e.live;
      if (channel) --e.channels;
      if (loss && e.channels == 0) e.lost = true;
      if (e.live == 0) {
        report = e.lost;
        peers_.erase(it);
      }
    }
    if (report) Report(name);
  }
  // Our connection to `name` failed: reported now when no inbound connection of it is open,
  // else when the last one ends.
  void Lost(const std::string& name) {
    {
      std::lock_guard<std::mutex> l(mu_);
      auto it = peers_.find(name);
      if (it != peers_.end()) {
        it->second.lost = true;
        return;
      }
    }
    Report(name);
  }

 private:
  struct Entry {
    int live = 0;      // inbound connections whose server thread runs
    int channels = 0;  // of them, message channels (connection index 0)
    bool lost = false;
  };
  void Report(const std::string& name) {
    if (report_) report_(name);
  }
  std::function<void(const std::string&)> report_;
  std::mutex mu_;
  std::map<std::string, Entry> peers_;
};

class TcpPeer;

// One client connection: a sender thread writes requests, a receiver thread reads responses
// (in order: the server serves one connection sequentially) and messages.
class TcpConn {
 public:
  TcpConn(net::Fd sock, TcpPeer* peer) : sock_(std::move(sock)), peer_(peer) {}
  void Start() {
    sender_ = std::thread([this] { SendLoop(); });
    receiver_ = std::thread([this] { RecvLoop(); });
  }
  void Enqueue(Request r) {
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!dead_) {
        queue_.push_back(std::move(r));
        cv_.notify_one();
        return;
      }
    }
    r.parts->Done(r.job, UnavailableError("tcp peer is dead"));
  }
  Status SendMsg(std::string_view bytes) {
    FrameHeader h;
    h.type = FrameType::kMsg;
    std::lock_guard<std::mutex> l(send_mu_);
    return net::SendFrame(sock_.get(), h, bytes);
  }
  // Stops both threads' I/O; pending requests fail with `why`.
  void Kill(const Status& why) {
    std::deque<Request> failed;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (!dead_) {
        dead_ = true;
        net::Shutdown(sock_.get());
      }
      failed.swap(queue_);
      for (auto& r : outstanding_) failed.push_back(std::move(r));
      outstanding_.clear();
    }
    cv_.notify_all();
    for (auto& r : failed) r.parts->Done(r.job, why);
  }
  void Join() {
    if (sender_.joinable()) sender_.join();
    if (receiver_.joinable()) receiver_.join();
  }

 private:
  void SendLoop();
  void RecvLoop();

  net::Fd sock_;
  TcpPeer* peer_;
  std::mutex send_mu_;  // whole frames
  std::mutex mu_;
  std::condition_variable cv_;
  bool dead_ = false;
  std::deque<Request> queue_;        // not yet sent
  std::deque<Request> outstanding_;  // sent, response not yet read
  uint64_t next_id_ = 1;
  std::thread sender_, receiver_;
};

class TcpPeer : public BackendPeer {
 public:
  TcpPeer(std::string name, const BackendContext* ctx, std::shared_ptr<LossGate> gate)
      : name_(std::move(name)), ctx_(ctx), gate_(std::move(gate)) {}
  ~TcpPeer() override { Close(); }

  void Add(std::unique_ptr<TcpConn> c) { conns_.push_back(std::move(c)); }
  void Start() {
    for (auto& c : conns_) c->Start();
  }

  void Submit(std::shared_ptr<TransferJob> job) override {
    if (!alive()) {
      job->finish(UnavailableError("tcp peer '" + name_ + "' is dead"));
      return;
    }
    const auto& segs = *job->segments;
    const uint64_t stripe =
        std::clamp<uint64_t>(job->total_bytes / conns_.size(), kMinStripeBytes, kMaxRequestBytes);
    std::vector<Request> reqs;
    Request cur;
    for (size_t i = 0; i < segs.size(); ++i) {
      if (cur.end > cur.begin &&
          (cur.bytes + segs[i].length > stripe || cur.end - cur.begin >= kMaxRequestSegments)) {
        reqs.push_back(cur);
        cur = Request{};
        cur.begin = cur.end = i;
      }
      cur.end = i + 1;
      cur.bytes += segs[i].length;
    }
    reqs.push_back(cur);
    auto parts = std::make_shared<JobParts>(static_cast<int>(reqs.size()));
    for (auto& r : reqs) {
      r.job = job;
      r.parts = parts;
      size_t c = rr_.fetch_add(1, std::memory_order_relaxed) % conns_.size();
      conns_[c]->Enqueue(std::move(r));
    }
  }

  Status SendMessage(std::string_view bytes) override {
    if (!alive()) return UnavailableError("tcp peer '" + name_ + "' is dead");
    Status s = conns_[0]->SendMsg(bytes);
    if (!s.ok()) Fail(s);
    return s;
  }
  bool alive() const override { return alive_.load(); }
  void Close() override {
    Fail(UnavailableError("tcp connection to '" + name_ + "' closed"), /*report=*/false);
    for (auto& c : conns_) c->Join();
  }

  // Marks the peer dead: every connection is shut down and every pending request fails. The
  // loss is reported through the gate (once the peer's connections to us ended too).
  void Fail(const Status& why, bool report = true) {
    bool was = alive_.exchange(false);
    for (auto& c : conns_) c->Kill(why);
    if (was && report) gate_->Lost(name_);
  }
  const BackendContext* ctx() const { return ctx_; }
  const std::string& name() const { return name_; }

 private:
  std::string name_;
  const BackendContext* ctx_;
  std::shared_ptr<LossGate> gate_;
  std::vector<std::unique_ptr<TcpConn>> conns_;
  std::atomic<bool> alive_{true};
  std::atomic<size_t> rr_{0};
};

void TcpConn::SendLoop() {
  for (;;) {
    Request r;
    {
      std::unique_lock<std::mutex> l(mu_);
      cv_.wait(l, [&] { return dead_ || !queue_.empty(); });
      if (dead_) return;
      r = std::move(queue_.front());
      queue_.pop_front();
      // relaxed: advisory flag; a request already sent is drained by the receiver.
      if (!r.job->cancel.load(std::memory_order_relaxed)) {
        r.id = next_id_++;
        outstanding_.push_back(r);
      }
    }
    if (r.id == 0) {  // cancelled before sending: no byte of it can land
      r.parts->Done(r.job, CancelledError("cancelled"));
      continue;
    }
    wire::Writer w;
    wire::EncodeDataRequest(r.job->transfer_id, r.job->segments->data() + r.begin, r.end - r.begin,
                            w);
    FrameHeader h;
    h.request_id = r.id;
    Status s;
    {
      std::lock_guard<std::mutex> l(send_mu_);
      if (r.job->op == TransferOp::kRead) {
        h.type = FrameType::kReadReq;
        s = net::SendFrame(sock_.get(), h, w.buf());
      } else {
        h.type = FrameType::kWriteReq;
        h.payload_len = r.bytes;
        std::vector<struct iovec> iov = LocalIov(r);
        s = net::SendFrame(sock_.get(), h, w.buf(), iov.data(), iov.size());
      }
    }
    if (!s.ok()) {
      peer_->Fail(s);
      return;
    }
  }
}

void TcpConn::RecvLoop() {
  const BackendContext* ctx = peer_->ctx();
  Status fail;
  for (;;) {
    FrameHeader h;
    std::string meta;
    Status s = net::RecvFrameHead(sock_.get(), &h, &meta, /*idle_ok=*/true);
    if (s.code() == StatusCode::kDeadlineExceeded) {
      std::lock_guard<std::mutex> l(mu_);
      if (dead_) break;
      if (outstanding_.empty()) continue;  // idle connection
      fail = UnavailableError("tcp peer '" + peer_->name() + "' sent nothing for " +
                              std::to_string(ctx->peer_timeout_ms) + " ms");
      break;
    }
    if (!s.ok()) {
      fail = UnavailableError("tcp peer '" + peer_->name() + "': " + s.message());
      break;
    }
    if (h.type == FrameType::kMsg) {
      if (h.payload_len != 0) {
        fail = UnavailableError("tcp protocol error: message with payload");
        break;
      }
      if (ctx->on_message) ctx->on_message(peer_->name(), std::move(meta));
      continue;
    }
    Request r;
    {
      std::lock_guard<std::mutex> l(mu_);
      if (outstanding_.empty() || outstanding_.front().id != h.request_id) {
        fail = UnavailableError("tcp protocol error: response to unknown request");
        break;
      }
      r = std::move(outstanding_.front());
      outstanding_.pop_front();
    }
    const FrameType want =
        r.job->op == TransferOp::kRead ? FrameType::kReadResp : FrameType::kWriteAck;
    if (h.type != want) {
      r.parts->Done(r.job, UnavailableError("tcp protocol error: wrong response type"));
      fail = UnavailableError("tcp protocol error");
      break;
    }
    if (h.status != 0) {
      wire::Reader rd(meta);
      std::string msg;
      rd.Str(msg, 65536);
      if (h.payload_len != 0) {
        r.parts->Done(r.job, UnavailableError("tcp protocol error: error with payload"));
        fail = UnavailableError("tcp protocol error");
        break;
      }
      r.parts->Done(r.job, Status(static_cast<StatusCode>(h.status), "peer refused: " + msg));
      continue;
    }
    Status ps;
    if (want == FrameType::kReadResp) {
      if (h.payload_len != r.bytes) {
        r.parts->Done(r.job, UnavailableError("tcp protocol error: read size mismatch"));
        fail = UnavailableError("tcp protocol error");
        break;
      }
      if (r.job->cancel.load(std::memory_order_relaxed)) {
        ps = net::Discard(sock_.get(), h.payload_len);
        if (ps.ok()) ps = CancelledError("cancelled");
      } else {
        std::vector<struct iovec> iov = LocalIov(r);
        ps = net::RecvIov(sock_.get(), iov.data(), iov.size());
      }
      if (!ps.ok() && ps.code() != StatusCode::kCancelled) {
        r.parts->Done(r.job, UnavailableError("tcp peer '" + peer_->name() + "': " + ps.message()));
        fail = ps;
        break;
      }
    } else if (h.payload_len != 0) {
      r.parts->Done(r.job, UnavailableError("tcp protocol error: ack with payload"));
      fail = UnavailableError("tcp protocol error");
      break;
    }
    r.parts->Done(r.job, ps);
  }
  peer_->Fail(fail.ok() ? UnavailableError("tcp connection closed") : fail);
}

// Server side of one accepted connection.
class ServerConn : public BackendPeer {
 public:
  ServerConn(net::Fd sock, const BackendContext* ctx, const KvRegistration* reg,
             std::shared_ptr<LossGate> gate)
      : sock_(std::move(sock)), ctx_(ctx), reg_(reg), gate_(std::move(gate)) {}
  ~ServerConn() override { Close(); }

  void Start() {
    thread_ = std::thread([this] { Serve(); });
  }
  bool finished() const { return finished_.load(); }

  void Submit(std::shared_ptr<TransferJob> job) override {
    job->finish(FailedPreconditionError("inbound tcp connection carries messages only"));
  }
  Status SendMessage(std::string_view bytes) override {
    if (!alive()) return UnavailableError("tcp peer '" + name_ + "' is dead");
    FrameHeader h;
    h.type = FrameType::kMsg;
    std::lock_guard<std::mutex> l(send_mu_);
    Status s = net::SendFrame(sock_.get(), h, bytes);
    if (!s.ok()) Kill();
    return s;
  }
  bool alive() const override { return alive_.load(); }
  void Close() override {
    Kill();
    JoinOrDetach(thread_);
  }
  void SetSelf(std::weak_ptr<ServerConn> self) { self_ = std::move(self); }

 private:
  void Kill() {
    if (alive_.exchange(false)) net::Shutdown(sock_.get());
  }

  Status Reply(FrameType type, uint64_t id, const Status& st, struct iovec* iov = nullptr,
               size_t n = 0, uint64_t payload = 0) {
    FrameHeader h;
    h.type = type;
    h.request_id = id;
    h.status = static_cast<uint16_t>(st.code());
    h.payload_len = payload;
    wire::Writer w;
    if (!st.ok()) w.Str(st.message());
    std::lock_guard<std::mutex> l(send_mu_);
    return net::SendFrame(sock_.get(), h, w.buf(), iov, n);
  }

  // Validation + direction/ownership check of one request (never touches memory when it
  // fails): a READ only from blocks held for its transfer, a WRITE only into blocks offered for it.
  Status Check(TransferOp op, const wire::DataRequest& req, std::vector<int>* blocks) {
    RETURN_IF_ERROR(wire::ValidateSegments(req, *reg_, blocks));
    if (ctx_->hold_check && !ctx_->hold_check(op, req.transfer_id, *blocks)) {
      return FailedPreconditionError(
          op == TransferOp::kRead
              ? "READ refused: blocks not held for transfer '" + req.transfer_id + "'"
              : "WRITE refused: blocks not offered for writing by transfer '" + req.transfer_id +
                    "'");
    }
    return OkStatus();
  }

  std::vector<struct iovec> Iov(const wire::DataRequest& req) {
    std::vector<struct iovec> iov;
    iov.reserve(req.segments.size());
    for (const auto& s : req.segments) {
      iov.push_back({reg_->layers[s.layer].base + s.offset, s.length});
    }
    return iov;
  }

  Status Handshake() {
    net::SetTimeouts(sock_.get(), ctx_->peer_timeout_ms, ctx_->peer_timeout_ms);
    FrameHeader h;
    std::string meta;
    RETURN_IF_ERROR(net::RecvFrameHead(sock_.get(), &h, &meta));
    if (h.type != FrameType::kHello) return InvalidArgumentError("expected hello");
    ASSIGN_OR_RETURN(wire::Hello hello, wire::DecodeHello(meta));
    Status st;
    if (hello.expect_incarnation != ctx_->incarnation) {
      st = FailedPreconditionError("stale metadata: agent incarnation changed");
    } else {
      st = auth::ServerChallenge(sock_.get(), ctx_->cluster_token,
                                 {"tcp", ctx_->incarnation, hello.agent_name});
      if (st.code() == StatusCode::kUnavailable) return st;  // the socket is gone
      if (!st.ok()) {
        KVB_LOG_WARN("tcp transfer server: refused peer '{}': {}", hello.agent_name, st.message());
        if (ctx_->on_refused) ctx_->on_refused(hello.agent_name, st);
      }
    }
    RETURN_IF_ERROR(Reply(FrameType::kHelloAck, 0, st));
    RETURN_IF_ERROR(st);
    name_ = hello.agent_name;
    is_channel_ = hello.connection_index == 0;
    gate_->Opened(name_, is_channel_);
    opened_ = true;
    if (is_channel_ && ctx_->on_inbound) {
      if (auto self = self_.lock()) ctx_->on_inbound(name_, self);
    }
    return OkStatus();
  }

  void Serve() {
    Status s = Handshake();
    std::vector<int> blocks;
    while (s.ok()) {
      FrameHeader h;
      std::string meta;
      s = net::RecvFrameHead(sock_.get(), &h, &meta, /*idle_ok=*/true);
      if (s.code() == StatusCode::kDeadlineExceeded) {
        s = OkStatus();
        continue;
      }
      if (!s.ok()) break;
      if (h.type == FrameType::kMsg) {
        if (h.payload_len != 0) {
          s = InvalidArgumentError("message with payload");
          break;
        }
        if (ctx_->on_message) ctx_->on_message(name_, std::move(meta));
        continue;
      }
      if (h.type != FrameType::kReadReq && h.type != FrameType::kWriteReq) {
        s = InvalidArgumentError("unexpected frame type");
        break;
      }
      Result<wire::DataRequest> req = wire::DecodeDataRequest(meta);
      if (h.type == FrameType::kReadReq) {
        Status st = req.ok() ? Check(TransferOp::kRead, *req, &blocks) : req.status();
        if (st.ok() && h.payload_len != 0) st = InvalidArgumentError("read request with payload");
        if (!st.ok()) {
          s = Reply(FrameType::kReadResp, h.request_id, st);
          if (h.payload_len != 0) s = st;  // framing is lost: drop the connection
          continue;
        }
        std::vector<struct iovec> iov = Iov(*req);
        s = Reply(FrameType::kReadResp, h.request_id, OkStatus(), iov.data(), iov.size(),
                  req->total_bytes);
      } else {
        Status st = req.ok() ? Check(TransferOp::kWrite, *req, &blocks) : req.status();
        if (st.ok() && h.payload_len != req->total_bytes) {
          st = InvalidArgumentError("write payload does not match its segments");
        }
        if (!st.ok()) {
          s = net::Discard(sock_.get(), h.payload_len);  // refused: never touch memory
          if (s.ok()) s = Reply(FrameType::kWriteAck, h.request_id, st);
          continue;
        }
        std::vector<struct iovec> iov = Iov(*req);
        s = net::RecvIov(sock_.get(), iov.data(), iov.size());
        if (s.ok()) s = Reply(FrameType::kWriteAck, h.request_id, OkStatus());
      }
    }
    if (s.code() == StatusCode::kInvalidArgument) {
      KVB_LOG_WARN("tcp transfer server: dropping connection from '{}': {}", name_, s.message());
    }
    bool was = alive_.exchange(false);
    net::Shutdown(sock_.get());
    finished_.store(true);
    // No byte of this connection lands any more; the peer's loss is reported once none of its
    // connections can (LossGate).
    if (opened_) gate_->Closed(name_, is_channel_, was && is_channel_);
  }

  net::Fd sock_;
  const BackendContext* ctx_;
  const KvRegistration* reg_;
  std::shared_ptr<LossGate> gate_;
  std::string name_ = "?";
  bool is_channel_ = false;  // connection index 0
  bool opened_ = false;      // passed the handshake: counted in the gate
  std::weak_ptr<ServerConn> self_;
  std::mutex send_mu_;
  std::atomic<bool> alive_{true};
  std::atomic<bool> finished_{false};
  std::thread thread_;
};

class TcpBackend : public Backend {
 public:
  explicit TcpBackend(const BackendContext& ctx)
      : ctx_(ctx), gate_(std::make_shared<LossGate>(ctx.on_peer_lost)) {}
  ~TcpBackend() override { Shutdown(); }

  std::string_view name() const override { return "tcp"; }
  bool one_sided() const override { return false; }
  bool Supports(MemoryKind kind) const override { return kind == MemoryKind::kHost; }

  Result<std::string> Start(const KvRegistration& reg) override {
    reg_ = &reg;
    int port = 0;
    ASSIGN_OR_RETURN(listen_, net::TcpListen(ctx_.bind_host, ctx_.tcp_port, &port));
    accept_ = std::thread([this] { AcceptLoop(); });
    return ctx_.bind_host + ":" + std::to_string(port);
  }

  bool CanReach(const AgentMetadata&, const AgentMetadata&) const override { return true; }

  Result<std::shared_ptr<BackendPeer>> Connect(const AgentMetadata& peer) override {
    auto ep = peer.endpoints.find("tcp");
    if (ep == peer.endpoints.end()) return UnavailableError("peer has no tcp endpoint");
    std::string host;
    int port;
    RETURN_IF_ERROR(net::ParseHostPort(ep->second, &host, &port));
    auto p = std::make_shared<TcpPeer>(peer.agent_name, &ctx_, gate_);
    for (int i = 0; i < ctx_.tcp_connections; ++i) {
      ASSIGN_OR_RETURN(net::Fd sock, net::TcpConnect(host, port, ctx_.peer_timeout_ms));
      net::SetTimeouts(sock.get(), ctx_.peer_timeout_ms, ctx_.peer_timeout_ms);
      wire::Hello hello{ctx_.agent_name, ctx_.incarnation, peer.incarnation,
                        static_cast<uint32_t>(i)};
      FrameHeader h;
      h.type = FrameType::kHello;
      RETURN_IF_ERROR(net::SendFrame(sock.get(), h, wire::EncodeHello(hello)));
      FrameHeader ack;
      std::string meta;
      RETURN_IF_ERROR(net::RecvFrameHead(sock.get(), &ack, &meta));
      bool answered = false;
      RETURN_IF_ERROR(auth::ClientAnswer(sock.get(), ack, meta, ctx_.cluster_token,
                                         {"tcp", peer.incarnation, ctx_.agent_name}, &answered));
      if (answered) RETURN_IF_ERROR(net::RecvFrameHead(sock.get(), &ack, &meta));
      if (ack.type != FrameType::kHelloAck) return UnavailableError("tcp handshake: bad reply");
      if (ack.status != 0) {
        wire::Reader r(meta);
        std::string msg;
        r.Str(msg, 4096);
        return Status(static_cast<StatusCode>(ack.status), "tcp handshake refused: " + msg);
      }
      RETURN_IF_ERROR(auth::RequireServerProof(ctx_.cluster_token, answered, "tcp"));
      p->Add(std::make_unique<TcpConn>(std::move(sock), p.get()));
    }
    p->Start();
    return std::shared_ptr<BackendPeer>(p);
  }

  void Shutdown() override {
    std::list<std::shared_ptr<ServerConn>> conns;
    if (!conns_.Shut(&conns)) return;
    net::Shutdown(listen_.get());
    if (accept_.joinable()) accept_.join();
    for (auto& c : conns) c->Close();
  }

 private:
  void AcceptLoop() {
    for (int fd; (fd = AcceptRetrying(listen_.get())) >= 0;) {
      net::TuneTcp(fd, ctx_.peer_timeout_ms);
      auto c = std::make_shared<ServerConn>(net::Fd(fd), &ctx_, reg_, gate_);
      c->SetSelf(c);
      if (!conns_.Add(c, [](const ServerConn& x) { return x.finished(); })) return;
      // Started after it is listed: Shutdown closes the listed ones only once this thread ended.
      c->Start();
    }
  }

  BackendContext ctx_;
  std::shared_ptr<LossGate> gate_;
  const KvRegistration* reg_ = nullptr;
  net::Fd listen_;
  std::thread accept_;
  InboundConns<ServerConn> conns_;
};

}  // namespace

std::unique_ptr<Backend> MakeTcpBackend(const BackendContext& ctx) {
  return std::make_unique<TcpBackend>(ctx);
}

}  // namespace kvbridge::transfer

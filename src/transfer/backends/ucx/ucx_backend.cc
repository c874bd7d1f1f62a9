#include "transfer/backends/ucx/ucx_backend.h"

#include <poll.h>
#include <ucp/api/ucp.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <list>
#include <mutex>
#include <set>
#include <thread>

#include "kvbridge/common/logging.h"
#include "transfer/auth.h"

namespace kvbridge::transfer {
namespace {

constexpr unsigned kAmHello = 10;
constexpr unsigned kAmMsg = 11;
// The cluster-token handshake (issue 22; auth.h), when the serving agent has a token (its
// metadata blob then carries "-" for every rkey: the rkeys travel only in kCtlAccept):
//   client -> kAmHello       our worker address (the server opens the reverse endpoint)
//   server -> kCtlChallenge  server nonce
//   client -> kCtlAnswer     proof || client nonce (empty without a token)
//   server -> kCtlAccept     server proof || the rkey table  | kCtlRefuse: u16 code || reason
// (kAmControl messages; the first data byte is the kCtl* id.) Peers are identified by the
// endpoint an active message came in on (reply_ep), not by the name they claim; with a token,
// messages count only from endpoints that completed the handshake.
constexpr unsigned kAmControl = 12;
constexpr unsigned kCtlChallenge = 1;
constexpr unsigned kCtlAnswer = 2;
constexpr unsigned kCtlAccept = 3;
constexpr unsigned kCtlRefuse = 4;
constexpr std::string_view kNoRkey = "-";
// A refused peer's reverse endpoint is closed this long after the refusal was sent: by then the
// refusal and the endpoint's wireup are done (closing an endpoint whose wireup reply is still
// pending is where UCX 1.13 asserts, at ucp_worker_destroy).
constexpr auto kRefusedReleaseDelay = std::chrono::milliseconds(1000);
using SteadyTime = std::chrono::steady_clock::time_point;

Status UcsError(ucs_status_t s, const std::string& what) {
  return UnavailableError(what + ": " + ucs_status_string(s));
}

std::string Hex(const void* p, size_t n) {
  static const char* d = "0123456789abcdef";
  std::string s;
  s.reserve(2 * n);
  for (size_t i = 0; i < n; ++i) {
    uint8_t b = static_cast<const uint8_t*>(p)[i];
    s.push_back(d[b >> 4]);
    s.push_back(d[b & 15]);
  }
  return s;
}

bool Unhex(std::string_view h, std::string* out) {
  if (h.size() % 2) return false;
  out->clear();
  auto v = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    return -1;
  };
  for (size_t i = 0; i < h.size(); i += 2) {
    int a = v(h[i]), b = v(h[i + 1]);
    if (a < 0 || b < 0) return false;
    out->push_back(static_cast<char>(a * 16 + b));
  }
  return true;
}

class UcxBackend;

// One endpoint to a peer: outbound (with rkeys, moves data) or inbound (messages only).
class UcxPeer : public BackendPeer, public std::enable_shared_from_this<UcxPeer> {
 public:
  UcxPeer(UcxBackend* b, std::string name) : b_(b), name_(std::move(name)) {}
  ~UcxPeer() override;
  void Submit(std::shared_ptr<TransferJob> job) override;
  void Post(const std::shared_ptr<TransferJob>& job);  // on the progress thread, mu_ held
  Status SendMessage(std::string_view bytes) override;
  bool alive() const override { return alive_.load(); }
  void Close() override;

  UcxBackend* b_;
  std::string name_;
  ucp_ep_h ep_ = nullptr;
  std::vector<ucp_rkey_h> rkeys_;
  std::vector<uint64_t> base_, bytes_;
  std::atomic<bool> alive_{true};
  bool inbound_ = false;
  // Handshake (token), under UcxBackend::mu_ unless noted.
  enum class Hs { kNone, kWaitChallenge, kWaitAccept, kChallenged, kAuthed, kFailed };
  Hs hs_ = Hs::kNone;
  ucp_ep_h hs_ep_ = nullptr;  ///< The endpoint the peer's handshake messages come in on.
  std::string nonce_;         ///< Ours: the server's challenge, the client's nonce.
  Status hs_status_;          ///< kFailed: why.
  size_t expect_layers_ = 0;  ///< Client: rkeys the accept must carry.
  std::vector<uint64_t> expect_bytes_;
  std::atomic<bool> hs_done_{false};  ///< Client: kAuthed or kFailed reached (hs_cv_).
  uint64_t incarnation_ = 0;          ///< Client: the server's, from its metadata.
  SteadyTime hs_since_{};             ///< Server: when the challenge went out / refusal sent.
};

class UcxBackend : public Backend {
 public:
  explicit UcxBackend(const BackendContext& ctx) : ctx_(ctx) {}
  ~UcxBackend() override { Shutdown(); }

  Status Init() {
    ucp_config_t* cfg;
    ucs_status_t s = ucp_config_read(nullptr, nullptr, &cfg);
    if (s != UCS_OK) return UcsError(s, "ucp_config_read");
    if (!std::getenv("UCX_TLS")) ucp_config_modify(cfg, "TLS", "sm,self,tcp");
    ucp_params_t p{};
    p.field_mask = UCP_PARAM_FIELD_FEATURES;
    p.features = UCP_FEATURE_RMA | UCP_FEATURE_AM | UCP_FEATURE_WAKEUP;
    s = ucp_init(&p, cfg, &context_);
    ucp_config_release(cfg);
    if (s != UCS_OK) return UcsError(s, "ucp_init");
    ucp_worker_params_t wp{};
    wp.field_mask = UCP_WORKER_PARAM_FIELD_THREAD_MODE;
    wp.thread_mode = UCS_THREAD_MODE_MULTI;
    s = ucp_worker_create(context_, &wp, &worker_);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_create");
    s = ucp_worker_get_efd(worker_, &efd_);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_get_efd");
    for (unsigned id : {kAmHello, kAmMsg, kAmControl}) {
      ucp_am_handler_param_t hp{};
      hp.field_mask = UCP_AM_HANDLER_PARAM_FIELD_ID | UCP_AM_HANDLER_PARAM_FIELD_CB |
                      UCP_AM_HANDLER_PARAM_FIELD_ARG;
      hp.id = id;
      hp.cb = id == kAmHello ? &UcxBackend::OnHello
              : id == kAmMsg ? &UcxBackend::OnMsg
                             : &UcxBackend::OnControl;
      hp.arg = this;
      s = ucp_worker_set_am_recv_handler(worker_, &hp);
      if (s != UCS_OK) return UcsError(s, "ucp_worker_set_am_recv_handler");
    }
    ucp_address_t* addr;
    size_t len;
    s = ucp_worker_get_address(worker_, &addr, &len);
    if (s != UCS_OK) return UcsError(s, "ucp_worker_get_address");
    address_.assign(reinterpret_cast<char*>(addr), len);
    ucp_worker_release_address(worker_, addr);
    progress_ = std::thread([this] { ProgressLoop(); });
    return OkStatus();
  }

  std::string_view name() const override { return "ucx"; }
  bool one_sided() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind == MemoryKind::kHost; }

  Result<std::string> Start(const KvRegistration& reg) override {
    std::lock_guard<std::recursive_mutex> l(mu_);
    blob_ = std::to_string(ctx_.incarnation) + ":" + Hex(address_.data(), address_.size());
    for (const MemoryRegion& r : reg.layers) {
      ucp_mem_map_params_t mp{};
      mp.field_mask = UCP_MEM_MAP_PARAM_FIELD_ADDRESS | UCP_MEM_MAP_PARAM_FIELD_LENGTH;
      mp.address = r.base;
      mp.length = r.bytes;
      ucp_mem_h memh;
      ucs_status_t s = ucp_mem_map(context_, &mp, &memh);
      if (s != UCS_OK) return UcsError(s, "ucp_mem_map");
      memh_.push_back(memh);
      void* rk;
      size_t rk_len;
      s = ucp_rkey_pack(context_, memh, &rk, &rk_len);
      if (s != UCS_OK) return UcsError(s, "ucp_rkey_pack");
      // With a token the rkeys are handed out only to peers that proved it (kCtlAccept).
      const std::string sizes = "," + std::to_string(r.bytes);
      rkeys_.append(rkeys_.empty() ? "" : ";").append(Hex(rk, rk_len)).append(sizes);
      blob_.append(";")
          .append(ctx_.cluster_token.empty() ? Hex(rk, rk_len) : std::string(kNoRkey))
          .append(sizes);
      ucp_rkey_buffer_release(rk);
    }
    return std::string("ucp");
  }

  void Describe(AgentMetadata& m) const override { m.backend_blobs["ucx"] = blob_; }

  bool CanReach(const AgentMetadata&, const AgentMetadata& peer) const override {
    return peer.backend_blobs.count("ucx") > 0;
  }

  Result<std::shared_ptr<BackendPeer>> Connect(const AgentMetadata& peer) override {
    auto it = peer.backend_blobs.find("ucx");
    if (it == peer.backend_blobs.end()) return UnavailableError("peer has no ucx blob");
    std::vector<std::string> parts;
    size_t pos = 0;
    const std::string& blob = it->second;
    for (;;) {
      size_t e = blob.find(';', pos);
      parts.push_back(blob.substr(pos, e == std::string::npos ? std::string::npos : e - pos));
      if (e == std::string::npos) break;
      pos = e + 1;
    }
    if (parts.size() != peer.layer_base.size() + 1) {
      return InvalidArgumentError("ucx blob does not have one rkey per layer");
    }
    std::string addr;
    size_t colon = parts[0].find(':');
    if (colon == std::string::npos) return InvalidArgumentError("bad ucx address");
    if (parts[0].substr(0, colon) != std::to_string(peer.incarnation)) {
      return FailedPreconditionError("stale metadata: agent incarnation changed");
    }
    if (!Unhex(parts[0].substr(colon + 1), &addr) || addr.empty()) {
      return InvalidArgumentError("bad ucx address");
    }
    // Validate everything before creating the endpoint (closing a half-wired endpoint trips
    // UCX 1.13 assertions).
    std::vector<std::string> rkeys;
    bool withheld = false;
    const std::vector<std::string> tail(parts.begin() + 1, parts.end());
    RETURN_IF_ERROR(ParseRkeys(tail, peer.layer_bytes, /*allow_withheld=*/true, &rkeys, &withheld));
    if (!withheld && !ctx_.cluster_token.empty()) {
      // It published its rkeys: it runs without a token and would prove nothing.
      return UnauthenticatedError(
          "ucx handshake: the serving agent did not prove the cluster token (it has no "
          "--cluster-token, or is not the agent its metadata names); refused");
    }
    auto p = std::make_shared<UcxPeer>(this, peer.agent_name);
    p->incarnation_ = peer.incarnation;
    {
      std::lock_guard<std::recursive_mutex> l(mu_);
      RETURN_IF_ERROR(CreateEp(p.get(), addr));
      // Every Connect waits for the server's first answer (challenge, or an unchallenged accept
      // without a token): both directions are wired up before AddPeer returns.
      p->hs_ = UcxPeer::Hs::kWaitChallenge;
      p->expect_layers_ = peer.layer_base.size();
      p->expect_bytes_ = peer.layer_bytes;
      p->base_ = peer.layer_base;
      p->bytes_ = peer.layer_bytes;
      if (!withheld) RETURN_IF_ERROR(UnpackRkeys(p.get(), rkeys));
      // Hello: our name + worker address, so the peer can open the reverse path for replies.
      RETURN_IF_ERROR(AmSend(p.get(), kAmHello, address_));
      handshaking_.push_back(p);
      Wake();
    }
    {
      std::unique_lock<std::mutex> hl(hs_mu_);
      const bool done = hs_cv_.wait_for(hl, std::chrono::milliseconds(ctx_.peer_timeout_ms),
                                        [&] { return p->hs_done_.load(); });
      hl.unlock();
      Status st;
      {
        std::lock_guard<std::recursive_mutex> l(mu_);
        handshaking_.remove(p);
        if (!done) {
          st = UnavailableError("ucx handshake: no answer from '" + peer.agent_name + "' within " +
                                std::to_string(ctx_.peer_timeout_ms) + " ms");
        } else if (p->hs_ != UcxPeer::Hs::kAuthed) {
          st = p->hs_status_;
        }
      }
      if (!st.ok()) {
        p->Close();
        return st;
      }
    }
    std::lock_guard<std::recursive_mutex> l(mu_);
    peers_.push_back(p);
    return std::shared_ptr<BackendPeer>(p);
  }

  // "hex,size" per layer (hex = kNoRkey when withheld: all or none).
  static Status ParseRkeys(const std::vector<std::string>& parts,
                           const std::vector<uint64_t>& layer_bytes, bool allow_withheld,
                           std::vector<std::string>* rkeys, bool* withheld) {
    if (parts.size() != layer_bytes.size()) {
      return InvalidArgumentError("ucx blob does not have one rkey per layer");
    }
    size_t none = 0;
    for (size_t i = 0; i < parts.size(); ++i) {
      std::string rk;
      size_t comma = parts[i].find(',');
      if (comma == std::string::npos) return InvalidArgumentError("bad ucx rkey");
      const std::string hex = parts[i].substr(0, comma);
      if (allow_withheld && hex == kNoRkey) {
        ++none;
      } else if (!Unhex(hex, &rk) || rk.empty()) {
        return InvalidArgumentError("bad ucx rkey");
      }
      if (parts[i].substr(comma + 1) != std::to_string(layer_bytes[i])) {
        return UnavailableError("ucx: region " + std::to_string(i) +
                                " size disagrees with the peer's metadata");
      }
      rkeys->push_back(std::move(rk));
    }
    if (none != 0 && none != parts.size()) return InvalidArgumentError("bad ucx rkey");
    *withheld = none != 0;
    return OkStatus();
  }

  // Callers hold mu_.
  Status UnpackRkeys(UcxPeer* p, const std::vector<std::string>& rkeys) {
    for (const std::string& rk : rkeys) {
      ucp_rkey_h h;
      ucs_status_t s = ucp_ep_rkey_unpack(p->ep_, rk.data(), &h);
      if (s != UCS_OK) return UcsError(s, "ucp_ep_rkey_unpack");
      p->rkeys_.push_back(h);
    }
    return OkStatus();
  }

  void Shutdown() override {
    {
      std::lock_guard<std::recursive_mutex> l(mu_);
      if (shut_) return;
      shut_ = true;
    }
    if (progress_.joinable()) {
      Wake();
      progress_.join();
    }
    std::deque<std::pair<std::shared_ptr<TransferJob>, std::shared_ptr<UcxPeer>>> left;
    {
      std::lock_guard<std::mutex> q(queue_mu_);
      left.swap(queue_);
    }
    for (auto& [job, peer] : left) job->finish(UnavailableError("ucx backend shut down"));
    std::lock_guard<std::recursive_mutex> l(mu_);
    for (auto& w : peers_) {
      if (auto p = w.lock()) CloseEp(p.get());
    }
    for (auto& p : inbound_) CloseEp(p.get());
    inbound_.clear();
    for (auto m : memh_) ucp_mem_unmap(context_, m);
    memh_.clear();
    if (worker_) ucp_worker_destroy(worker_);
    if (context_) ucp_cleanup(context_);
    worker_ = nullptr;
    context_ = nullptr;
  }

  // ---- used by UcxPeer (callers hold mu_) ----
  Status CreateEp(UcxPeer* p, const std::string& addr) {
    ucp_ep_params_t ep{};
    ep.field_mask = UCP_EP_PARAM_FIELD_REMOTE_ADDRESS | UCP_EP_PARAM_FIELD_ERR_HANDLING_MODE |
                    UCP_EP_PARAM_FIELD_ERR_HANDLER;
    ep.address = reinterpret_cast<const ucp_address_t*>(addr.data());
    ep.err_mode = UCP_ERR_HANDLING_MODE_PEER;
    ep.err_handler.cb = &UcxBackend::OnEpError;
    ep.err_handler.arg = p;
    ucs_status_t s = ucp_ep_create(worker_, &ep, &p->ep_);
    if (s != UCS_OK) return UcsError(s, "ucp_ep_create");
    return OkStatus();
  }

  void CloseEp(UcxPeer* p) {
    const bool was_alive = p->alive_.exchange(false);
    if (!p->ep_ || !worker_) return;
    for (auto rk : p->rkeys_) ucp_rkey_destroy(rk);
    p->rkeys_.clear();
    ucp_request_param_t rp{};
    rp.op_attr_mask = UCP_OP_ATTR_FIELD_FLAGS;
    // Graceful close while the peer lives (a forced close can race UCX's wireup); forced once
    // the peer is known dead.
    rp.flags = was_alive ? 0 : UCP_EP_CLOSE_FLAG_FORCE;
    ucs_status_ptr_t r = ucp_ep_close_nbx(p->ep_, &rp);
    if (UCS_PTR_IS_PTR(r)) {
      for (int i = 0; i < 1000 && ucp_request_check_status(r) == UCS_INPROGRESS; ++i) {
        ucp_worker_progress(worker_);
      }
      ucp_request_free(r);
    }
    p->ep_ = nullptr;
  }

  struct AmBuf {
    std::string header, data;
  };
  static void AmDone(void* req, ucs_status_t, void* user) {
    delete static_cast<AmBuf*>(user);
    ucp_request_free(req);
  }
  Status AmSend(UcxPeer* p, unsigned id, std::string_view data) {
    auto* buf = new AmBuf{ctx_.agent_name, std::string(data)};
    ucp_request_param_t rp{};
    rp.op_attr_mask =
        UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA | UCP_OP_ATTR_FIELD_FLAGS;
    rp.cb.send = &UcxBackend::AmDone;
    rp.user_data = buf;
    rp.flags = UCP_AM_SEND_FLAG_REPLY | UCP_AM_SEND_FLAG_EAGER;
    ucs_status_ptr_t r = ucp_am_send_nbx(p->ep_, id, buf->header.data(), buf->header.size(),
                                         buf->data.data(), buf->data.size(), &rp);
    if (UCS_PTR_IS_PTR(r)) {
      Wake();
      return OkStatus();
    }
    delete buf;
    ucs_status_t s = UCS_PTR_STATUS(r);
    return s == UCS_OK ? OkStatus() : UcsError(s, "ucp_am_send_nbx");
  }

  // One posted job: every RMA operation and the flush hold a reference; the job finishes when
  // the last completes, failed if any of them failed. (The flush alone is not enough: when the
  // peer dies UCX 1.13 can complete the flush OK after purging operations that never moved
  // their bytes — seen as a "done" READ with wrong data after SIGKILL of the peer.)
  struct XferCtx {
    XferCtx(std::shared_ptr<TransferJob> j, std::string p)
        : job(std::move(j)), peer(std::move(p)) {}
    std::shared_ptr<TransferJob> job;
    std::string peer;
    std::atomic<int> refs{1};              // the flush's
    std::atomic<int> status{int{UCS_OK}};  // the first failure
    void Fail(ucs_status_t s) {
      int ok = UCS_OK;
      status.compare_exchange_strong(ok, static_cast<int>(s));
    }
    void Release() {
      if (refs.fetch_sub(1) != 1) return;
      const auto s = static_cast<ucs_status_t>(status.load());
      job->finish(s == UCS_OK
                      ? OkStatus()
                      : UnavailableError("ucx peer '" + peer + "': " + ucs_status_string(s)));
      delete this;
    }
  };
  static void OpDone(void* req, ucs_status_t s, void* user) {
    auto* x = static_cast<XferCtx*>(user);
    if (s != UCS_OK) x->Fail(s);
    ucp_request_free(req);
    x->Release();
  }
  static void FlushDone(void* req, ucs_status_t s, void* user) {
    auto* x = static_cast<XferCtx*>(user);
    if (req) ucp_request_free(req);
    if (s != UCS_OK) x->Fail(s);
    x->Release();
  }

  void Wake() {
    if (worker_) ucp_worker_signal(worker_);
  }

  std::recursive_mutex mu_;
  BackendContext ctx_;
  std::mutex queue_mu_;
  std::deque<std::pair<std::shared_ptr<TransferJob>, std::shared_ptr<UcxPeer>>> queue_;

 private:
  static void OnEpError(void* arg, ucp_ep_h, ucs_status_t s) {
    auto* p = static_cast<UcxPeer*>(arg);
    // A connection that never proved the token names nobody: its loss is no peer's.
    const bool counts = p->b_->ctx_.cluster_token.empty() || p->hs_ == UcxPeer::Hs::kAuthed;
    if (p->alive_.exchange(false) && counts && p->b_->ctx_.on_peer_lost) {
      p->b_->ctx_.on_peer_lost(p->name_);
    }
  }

  struct Am {
    unsigned id = 0;
    std::string name, data;
    ucp_ep_h from = nullptr;  ///< reply_ep: the connection it came in on (nullptr: none given).
  };
  static ucp_ep_h ReplyEp(const ucp_am_recv_param_t* param) {
    return (param->recv_attr & UCP_AM_RECV_ATTR_FIELD_REPLY_EP) ? param->reply_ep : nullptr;
  }

  static ucs_status_t OnHello(void* arg, const void* header, size_t hlen, void* data, size_t len,
                              const ucp_am_recv_param_t* param) {
    auto* b = static_cast<UcxBackend*>(arg);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV || hlen == 0 || hlen > 4096 || len == 0) {
      return UCS_OK;  // malformed: ignore
    }
    b->pending_hellos_.push_back({kAmHello, std::string(static_cast<const char*>(header), hlen),
                                  std::string(static_cast<const char*>(data), len),
                                  ReplyEp(param)});
    return UCS_OK;
  }

  static ucs_status_t OnMsg(void* arg, const void* header, size_t hlen, void* data, size_t len,
                            const ucp_am_recv_param_t* param) {
    auto* b = static_cast<UcxBackend*>(arg);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV || hlen == 0 || hlen > 4096) return UCS_OK;
    // Delivered from the progress loop after pending hellos, so a reply path exists.
    b->pending_msgs_.push_back({kAmMsg, std::string(static_cast<const char*>(header), hlen),
                                std::string(static_cast<const char*>(data), len), ReplyEp(param)});
    return UCS_OK;
  }

  // kAmControl: the handshake, handled in the loop.
  static ucs_status_t OnControl(void* arg, const void* header, size_t hlen, void* data, size_t len,
                                const ucp_am_recv_param_t* param) {
    auto* b = static_cast<UcxBackend*>(arg);
    if (param->recv_attr & UCP_AM_RECV_ATTR_FLAG_RNDV || hlen == 0 || hlen > 4096 ||
        len > (1u << 20)) {
      return UCS_OK;
    }
    // The AM id is not passed to the callback: it is the first byte of the data.
    if (len == 0) return UCS_OK;
    const auto* d = static_cast<const char*>(data);
    b->pending_msgs_.push_back({static_cast<unsigned char>(d[0]),
                                std::string(static_cast<const char*>(header), hlen),
                                std::string(d + 1, len - 1), ReplyEp(param)});
    return UCS_OK;
  }

  // ---- the handshake (progress thread, mu_ held) ----
  void OnHelloLocked(Am& h) {
    auto p = std::make_shared<UcxPeer>(this, h.name);
    p->inbound_ = true;
    if (!CreateEp(p.get(), h.data).ok()) return;
    inbound_.push_back(p);
    if (ctx_.cluster_token.empty()) {
      // An empty accept over the reverse path: the client's AddPeer returns only once both
      // directions are wired up (UCX 1.13 asserts in ucp_worker_destroy on a wireup reply still
      // pending: a peer torn down right after AddPeer left one behind; issue 22).
      if (ctx_.on_inbound) ctx_.on_inbound(h.name, p);
      (void)Control(p.get(), kCtlAccept, "");
      return;
    }
    Result<std::string> nonce = auth::RandomNonce();
    if (!h.from || !nonce.ok()) {
      Refuse(p.get(), UnauthenticatedError("ucx handshake: no reply endpoint on the hello"));
      return;
    }
    p->hs_ = UcxPeer::Hs::kChallenged;
    p->hs_ep_ = h.from;
    p->nonce_ = *nonce;
    p->hs_since_ = std::chrono::steady_clock::now();
    (void)Control(p.get(), kCtlChallenge, p->nonce_);
  }

  // Server: a peer's answer to our challenge.
  void OnAnswerLocked(Am& a) {
    UcxPeer* p = nullptr;
    for (auto& q : inbound_) {
      if (q->hs_ == UcxPeer::Hs::kChallenged && a.from && q->hs_ep_ == a.from) p = q.get();
    }
    if (!p) return;  // not a handshake we started: ignore
    Result<auth::ChallengeAnswer> ans = auth::DecodeChallengeAnswer(a.data);
    Status st;
    if (!ans.ok()) {
      st = UnauthenticatedError(ans.status().message());
    } else if (ans->proof.empty()) {
      st = UnauthenticatedError(
          "this agent requires the cluster token (--cluster-token); the peer has none");
    } else if (!auth::ProofMatches(ctx_.cluster_token,
                                   auth::HandshakeContext("ucx", ctx_.incarnation, p->name_),
                                   p->nonce_, ans->proof)) {
      st = UnauthenticatedError("wrong cluster token (the peer's --cluster-token differs)");
    }
    if (!st.ok()) {
      Refuse(p, st);
      return;
    }
    p->hs_ = UcxPeer::Hs::kAuthed;
    authed_.insert(p->hs_ep_);
    std::string accept =
        auth::Proof(ctx_.cluster_token, auth::ServerContext("ucx", ctx_.incarnation, p->name_),
                    ans->client_nonce);
    accept += rkeys_;
    if (!Control(p, kCtlAccept, accept).ok()) return;
    for (auto& q : inbound_) {
      if (q.get() == p && ctx_.on_inbound) ctx_.on_inbound(p->name_, q);
    }
  }

  void Refuse(UcxPeer* p, const Status& st) {
    p->hs_ = UcxPeer::Hs::kFailed;
    p->hs_since_ = std::chrono::steady_clock::now();
    KVB_LOG_WARN("ucx transfer server: refused peer '{}': {}", p->name_, st.message());
    if (ctx_.on_refused) ctx_.on_refused(p->name_, st);
    std::string r(2, '\0');
    const uint16_t code = static_cast<uint16_t>(st.code());
    std::memcpy(r.data(), &code, 2);
    r += st.message();
    (void)Control(p, kCtlRefuse, r);
  }

  // Client: the server's challenge / accept / refusal, matched to the connection it came in on.
  void OnClientControlLocked(Am& m) {
    std::shared_ptr<UcxPeer> p;
    for (auto& q : handshaking_) {
      if (q->hs_ == UcxPeer::Hs::kWaitChallenge && q->name_ == m.name) {
        p = q;  // the server's first message: its challenge, or (no token) accept / refusal
      } else if (m.id != kCtlChallenge && q->hs_ == UcxPeer::Hs::kWaitAccept && m.from &&
                 q->hs_ep_ == m.from) {
        p = q;
      }
      if (p) break;
    }
    if (!p) return;
    Status st;
    if (m.id == kCtlChallenge) {
      if (m.data.size() != auth::kNonceBytes || !m.from) {
        st = UnavailableError("ucx handshake: malformed cluster-token challenge");
      } else {
        std::string answer;
        if (!ctx_.cluster_token.empty()) {
          Result<std::string> nonce = auth::RandomNonce();
          if (!nonce.ok()) {
            st = nonce.status();
          } else {
            p->nonce_ = *nonce;
            answer = auth::Proof(
                         ctx_.cluster_token,
                         auth::HandshakeContext("ucx", peer_incarnation(p.get()), ctx_.agent_name),
                         m.data) +
                     p->nonce_;
          }
        }
        if (st.ok()) {
          p->hs_ep_ = m.from;
          p->hs_ = UcxPeer::Hs::kWaitAccept;
          st = Control(p.get(), kCtlAnswer, answer);
          if (st.ok()) return;
        }
      }
    } else if (m.id == kCtlRefuse) {
      uint16_t code = static_cast<uint16_t>(StatusCode::kUnauthenticated);
      if (m.data.size() >= 2) std::memcpy(&code, m.data.data(), 2);
      st = Status(static_cast<StatusCode>(code),
                  "ucx handshake refused: " + m.data.substr(std::min<size_t>(2, m.data.size())));
      if (st.ok()) st = UnauthenticatedError("ucx handshake refused");
    } else if (m.id == kCtlAccept && p->hs_ == UcxPeer::Hs::kWaitChallenge) {
      // A server without a token: accepted unchallenged — only on the published-rkey path (a
      // client with a token refused such metadata in Connect; withheld rkeys mean a token).
      if (!m.data.empty() || p->rkeys_.empty()) {
        st = UnauthenticatedError(
            "ucx handshake: the serving agent did not prove the cluster token (it has no "
            "--cluster-token, or is not the agent its metadata names); refused");
      } else {
        p->hs_ep_ = m.from;
        p->hs_ = UcxPeer::Hs::kAuthed;
        if (m.from) authed_.insert(m.from);
      }
    } else if (m.id == kCtlAccept) {
      const bool proven =
          !ctx_.cluster_token.empty() && m.data.size() >= auth::kProofBytes &&
          auth::ProofMatches(ctx_.cluster_token,
                             auth::ServerContext("ucx", peer_incarnation(p.get()), ctx_.agent_name),
                             p->nonce_, std::string_view(m.data).substr(0, auth::kProofBytes));
      if (!proven) {
        st = UnauthenticatedError(
            "ucx handshake: the serving agent's proof of the cluster token is wrong (it is not "
            "the agent its metadata names, or its --cluster-token differs); refused");
      } else {
        std::vector<std::string> parts;
        const std::string table = m.data.substr(auth::kProofBytes);
        for (size_t pos = 0;;) {
          size_t e = table.find(';', pos);
          parts.push_back(table.substr(pos, e == std::string::npos ? std::string::npos : e - pos));
          if (e == std::string::npos) break;
          pos = e + 1;
        }
        std::vector<std::string> rkeys;
        bool withheld = false;
        st = ParseRkeys(parts, p->expect_bytes_, /*allow_withheld=*/false, &rkeys, &withheld);
        if (st.ok()) st = UnpackRkeys(p.get(), rkeys);
        if (st.ok()) {
          p->hs_ = UcxPeer::Hs::kAuthed;
          authed_.insert(p->hs_ep_);
        }
      }
    } else {
      return;
    }
    if (!st.ok()) {
      p->hs_ = UcxPeer::Hs::kFailed;
      p->hs_status_ = st;
    }
    {
      std::lock_guard<std::mutex> hl(hs_mu_);
      p->hs_done_.store(true);
    }
    hs_cv_.notify_all();
  }

  static uint64_t peer_incarnation(const UcxPeer* p) { return p->incarnation_; }

  // Server: refuses a peer that let its challenge go unanswered for peer_timeout_ms, and closes
  // and forgets refused peers' reverse endpoints kRefusedReleaseDelay after the refusal, so a
  // stream of refused connects holds nothing (mu_ held).
  void ReleaseRefusedLocked(SteadyTime now) {
    for (auto it = inbound_.begin(); it != inbound_.end();) {
      UcxPeer* p = it->get();
      if (p->hs_ == UcxPeer::Hs::kChallenged &&
          now - p->hs_since_ > std::chrono::milliseconds(ctx_.peer_timeout_ms)) {
        Refuse(p, UnauthenticatedError("no answer to the cluster-token challenge within " +
                                       std::to_string(ctx_.peer_timeout_ms) + " ms"));
      }
      if (p->hs_ != UcxPeer::Hs::kFailed || now - p->hs_since_ < kRefusedReleaseDelay) {
        ++it;
        continue;
      }
      const std::string name = p->name_;
      CloseEp(p);
      it = inbound_.erase(it);
      if (ctx_.on_refused_released) ctx_.on_refused_released(name);
    }
  }

  // A handshake message: the id is the first data byte (one AM handler serves them all).
  Status Control(UcxPeer* p, unsigned id, std::string_view data) {
    std::string d(1, static_cast<char>(id));
    d += data;
    return AmSend(p, kAmControl, d);
  }

  void ProgressLoop() {
    for (;;) {
      ucs_status_t armed;
      {
        std::lock_guard<std::recursive_mutex> l(mu_);
        if (shut_) return;
        while (ucp_worker_progress(worker_) != 0) {
        }
        // Reverse paths for peers that said hello (created outside the AM callback).
        while (!pending_hellos_.empty()) {
          Am h = std::move(pending_hellos_.front());
          pending_hellos_.pop_front();
          OnHelloLocked(h);
        }
        while (!pending_msgs_.empty()) {
          Am m = std::move(pending_msgs_.front());
          pending_msgs_.pop_front();
          if (m.id == kCtlAnswer) {
            OnAnswerLocked(m);
          } else if (m.id != kAmMsg) {
            OnClientControlLocked(m);
          } else if (ctx_.cluster_token.empty() || (m.from && authed_.count(m.from))) {
            if (ctx_.on_message) ctx_.on_message(m.name, std::move(m.data));
          }  // else: from a connection that did not complete the handshake: dropped
        }
        if (!inbound_.empty()) ReleaseRefusedLocked(std::chrono::steady_clock::now());
        std::deque<std::pair<std::shared_ptr<TransferJob>, std::shared_ptr<UcxPeer>>> jobs;
        {
          std::lock_guard<std::mutex> q(queue_mu_);
          jobs.swap(queue_);
        }
        for (auto& [job, peer] : jobs) peer->Post(job);
        if (!jobs.empty()) continue;
        armed = ucp_worker_arm(worker_);
      }
      if (armed == UCS_ERR_BUSY) continue;
      pollfd pfd{efd_, POLLIN, 0};
      ::poll(&pfd, 1, 1);
    }
  }

  ucp_context_h context_ = nullptr;
  ucp_worker_h worker_ = nullptr;
  int efd_ = -1;
  std::string address_, blob_;
  std::vector<ucp_mem_h> memh_;
  std::list<std::weak_ptr<UcxPeer>> peers_;
  std::list<std::shared_ptr<UcxPeer>> inbound_;
  std::deque<Am> pending_hellos_;
  std::deque<Am> pending_msgs_;  ///< Messages and handshake controls, in arrival order.
  std::string rkeys_;            ///< Our rkey table ("hex,size;..."): in kCtlAccept.
  std::set<ucp_ep_h> authed_;    ///< Connections whose handshake completed (token).
  std::list<std::shared_ptr<UcxPeer>> handshaking_;  ///< Client: Connects waiting.
  std::mutex hs_mu_;
  std::condition_variable hs_cv_;
  bool shut_ = false;
  std::thread progress_;
};

UcxPeer::~UcxPeer() { Close(); }

void UcxPeer::Close() {
  std::lock_guard<std::recursive_mutex> l(b_->mu_);
  b_->CloseEp(this);
}

void UcxPeer::Submit(std::shared_ptr<TransferJob> job) {
  if (inbound_) {
    job->finish(FailedPreconditionError("inbound ucx endpoint carries messages only"));
    return;
  }
  if (!alive()) {
    job->finish(UnavailableError("ucx peer '" + name_ + "' is dead"));
    return;
  }
  {
    std::lock_guard<std::mutex> q(b_->queue_mu_);
    b_->queue_.emplace_back(job, shared_from_this());
  }
  b_->Wake();
}

void UcxPeer::Post(const std::shared_ptr<TransferJob>& job) {
  std::lock_guard<std::recursive_mutex> l(b_->mu_);
  if (!alive() || !ep_) {
    job->finish(UnavailableError("ucx peer '" + name_ + "' is dead"));
    return;
  }
  // relaxed: advisory flag; operations not yet posted are never posted after it is seen.
  if (job->cancel.load(std::memory_order_relaxed)) {
    job->finish(CancelledError("cancelled"));
    return;
  }
  const bool read = job->op == TransferOp::kRead;
  for (const Segment& s : *job->segments) {
    if (s.remote_layer >= base_.size() || s.remote_offset > bytes_[s.remote_layer] ||
        s.length > bytes_[s.remote_layer] - s.remote_offset) {
      job->finish(InvalidArgumentError("segment outside the peer's registered region"));
      return;
    }
  }
  auto* x = new UcxBackend::XferCtx(job, name_);
  ucp_request_param_t rp{};
  rp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  rp.cb.send = &UcxBackend::OpDone;
  rp.user_data = x;
  for (const Segment& s : *job->segments) {
    uint64_t raddr = base_[s.remote_layer] + s.remote_offset;
    x->refs.fetch_add(1);  // the operation's, released by OpDone unless it completes here
    ucs_status_ptr_t r =
        read ? ucp_get_nbx(ep_, s.local, s.length, raddr, rkeys_[s.remote_layer], &rp)
             : ucp_put_nbx(ep_, s.local, s.length, raddr, rkeys_[s.remote_layer], &rp);
    if (UCS_PTR_IS_PTR(r)) continue;
    x->refs.fetch_sub(1);  // completed (or failed) at once: no callback; the flush's ref stays
    if (UCS_PTR_IS_ERR(r)) {
      x->Fail(UCS_PTR_STATUS(r));
      break;
    }
  }
  // Flush: completes when every operation above is complete at the target.
  ucp_request_param_t fp{};
  fp.op_attr_mask = UCP_OP_ATTR_FIELD_CALLBACK | UCP_OP_ATTR_FIELD_USER_DATA;
  fp.cb.send = &UcxBackend::FlushDone;
  fp.user_data = x;
  ucs_status_ptr_t r = ucp_ep_flush_nbx(ep_, &fp);
  if (UCS_PTR_IS_PTR(r)) {
    b_->Wake();
    return;
  }
  UcxBackend::FlushDone(nullptr, UCS_PTR_STATUS(r), x);
}

Status UcxPeer::SendMessage(std::string_view bytes) {
  std::lock_guard<std::recursive_mutex> l(b_->mu_);
  if (!alive() || !ep_) return UnavailableError("ucx peer '" + name_ + "' is dead");
  return b_->AmSend(this, kAmMsg, bytes);
}

}  // namespace

Result<std::unique_ptr<Backend>> MakeUcxBackend(const BackendContext& ctx) {
  auto b = std::make_unique<UcxBackend>(ctx);
  RETURN_IF_ERROR(b->Init());
  return std::unique_ptr<Backend>(std::move(b));
}

}  // namespace kvbridge::transfer

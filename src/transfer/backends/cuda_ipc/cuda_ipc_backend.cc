#include "transfer/backends/cuda_ipc/cuda_ipc_backend.h"

#include <cuda.h>
#include <cuda_runtime.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include <algorithm>
#include <condition_variable>
#include <cstring>
#include <deque>
#include <iterator>
#include <list>
#include <mutex>
#include <numeric>
#include <thread>

#include "kvbridge/common/thread_annotations.h"
#include "transfer/backend_util.h"
#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/ipc_handshake.h"
#include "transfer/backends/cuda_ipc/peer_link.h"

namespace kvbridge::transfer {
namespace {

using cuda_ipc::AddressPair;
using cuda_ipc::Channel;
using cuda_ipc::CopyEngine;
using cuda_ipc::CopyHandle;
using cuda_ipc::CopyOp;
using cuda_ipc::CopyState;
using cuda_ipc::CudaStatus;
using cuda_ipc::ImportedPool;
using cuda_ipc::IpcHandle;
using cuda_ipc::MsgType;

constexpr auto kHello = static_cast<MsgType>(101);     // u64 incarnation, u64 expected, name
constexpr auto kHelloAck = static_cast<MsgType>(102);  // u32 status; table or error text
constexpr auto kAgentMsg = static_cast<MsgType>(103);  // opaque agent message
// 104..106: the cluster-token challenge (ipc_handshake.h).
static_assert(static_cast<uint32_t>(kHelloAck) == cuda_ipc_auth::kHelloAck);

// The handshake functions' view of a Channel.
cuda_ipc_auth::FrameIo FramesOf(Channel& ch) {
  return {.send =
              [&ch](uint32_t type, std::string_view payload) {
                return ch.Send(static_cast<MsgType>(type), payload);
              },
          .recv = [&ch](int timeout_ms) -> Result<cuda_ipc_auth::Frame> {
            ASSIGN_OR_RETURN(cuda_ipc::Message m, ch.Recv(timeout_ms));
            return cuda_ipc_auth::Frame{static_cast<uint32_t>(m.type), std::move(m.payload)};
          }};
}

void PutU32(std::string& s, uint32_t v) { s.append(reinterpret_cast<const char*>(&v), 4); }
void PutU64(std::string& s, uint64_t v) { s.append(reinterpret_cast<const char*>(&v), 8); }
// Little-endian reads (byte-wise: GCC 12 -O2 flags a memcpy out of a moved-into string).
template <typename T>
bool GetLe(std::string_view s, size_t& at, T& v) {
  if (s.size() < at + sizeof(T)) return false;
  T x = 0;
  for (size_t i = 0; i < sizeof(T); ++i)
    x |= static_cast<T>(static_cast<uint8_t>(s[at + i])) << (8 * i);
  v = x;
  at += sizeof(T);
  return true;
}
bool GetU32(std::string_view s, size_t& at, uint32_t& v) { return GetLe(s, at, v); }
bool GetU64(std::string_view s, size_t& at, uint64_t& v) { return GetLe(s, at, v); }

Result<sockaddr_un> AbstractAddr(const std::string& name, socklen_t* len) {
  sockaddr_un a{};
  a.sun_family = AF_UNIX;
  if (name.size() < 2 || name[0] != '@' || name.size() > sizeof(a.sun_path)) {
    return InvalidArgumentError("cuda_ipc endpoint '" + name + "' is not an abstract socket name");
  }
  a.sun_path[0] = '\0';
  std::memcpy(a.sun_path + 1, name.data() + 1, name.size() - 1);
  *len = static_cast<socklen_t>(offsetof(sockaddr_un, sun_path) + name.size());
  return a;
}

// Base and size of the cudaMalloc allocation holding `p` (cuMemGetAddressRange through the
// runtime's driver entry point, so no link against libcuda: CI machines have no driver).
Result<std::pair<uint8_t*, size_t>> AllocationOf(void* p) {
  using Fn = CUresult (*)(CUdeviceptr*, size_t*, CUdeviceptr);
  void* fn = nullptr;
  cudaDriverEntryPointQueryResult q{};
  KVB_CUDA_RETURN_IF_ERROR(
      cudaGetDriverEntryPointByVersion("cuMemGetAddressRange", &fn, 12000, cudaEnableDefault, &q));
  if (fn == nullptr || q != cudaDriverEntryPointSuccess) {
    return UnavailableError("cuMemGetAddressRange not available from the driver");
  }
  CUdeviceptr base = 0;
  size_t size = 0;
  if (reinterpret_cast<Fn>(fn)(&base, &size, reinterpret_cast<CUdeviceptr>(p)) != CUDA_SUCCESS) {
    return InvalidArgumentError("registered region is not device memory from cudaMalloc");
  }
  return std::make_pair(reinterpret_cast<uint8_t*>(base), size);
}

// The peer's layers mapped into this process; kept alive by every in-flight copy.
struct RemoteMap {
  std::vector<std::unique_ptr<ImportedPool>> pools;
  std::vector<uint8_t*> layer_base;
  std::vector<uint64_t> layer_bytes;
};

struct Pending {
  CopyHandle copy;
  std::shared_ptr<TransferJob> job;
  std::shared_ptr<RemoteMap> map;
  std::function<bool()> peer_alive;
};

// Calls job->finish once each copy's event completed (FIFO: one stream).
class Completer {
 public:
  explicit Completer(int device) : device_(device), thread_([this] { Loop(); }) {}
  ~Completer() {
    {
      std::lock_guard<std::mutex> l(mu_);
      stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
  }
  void Push(Pending p) {
    {
      std::lock_guard<std::mutex> l(mu_);
      q_.push_back(std::move(p));
    }
    cv_.notify_one();
  }

 private:
  void Loop() {
    cudaSetDevice(device_);
    for (;;) {
      Pending p;
      {
        std::unique_lock<std::mutex> l(mu_);
        cv_.wait(l, [&] { return stop_ || !q_.empty(); });
        if (q_.empty()) return;  // stopped, nothing left
        p = std::move(q_.front());
        q_.pop_front();
      }
      CopyState s;
      while ((s = p.copy.Poll()) == CopyState::kInProgress) std::this_thread::yield();
      Status st = p.copy.status();
      if (st.ok() && !p.peer_alive()) st = UnavailableError("cuda_ipc peer lost during transfer");
      p.job->finish(std::move(st));
    }
  }
  int device_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::deque<Pending> q_;
  bool stop_ = false;
  std::thread thread_;
};

// The registered layers, sorted by base: Contains is a binary search (a transfer checks every
// segment, e.g. 64 blocks x 32 layers = 2048 of them; a linear scan over the layers cost ~50 us
// per such transfer on the H200 host).
struct LocalLayers {
  std::vector<std::pair<uint8_t*, uint64_t>> regions;  // (base, bytes), sorted by base
  void Add(uint8_t* base, uint64_t bytes) {
    regions.insert(std::upper_bound(regions.begin(), regions.end(), std::make_pair(base, bytes)),
                   {base, bytes});
  }
  // True when [p, p + n) lies inside one registered layer (layers never overlap, so only the
  // last one starting at or below p can hold it).
  bool Contains(const uint8_t* p, uint64_t n) const {
    auto it = std::upper_bound(regions.begin(), regions.end(), p,
                               [](const uint8_t* x, const auto& r) { return x < r.first; });
    if (it == regions.begin()) return false;
    const auto& [base, bytes] = *std::prev(it);
    return n <= bytes && static_cast<uint64_t>(p - base) <= bytes - n;
  }
};

class CudaIpcChannel : public BackendPeer, public std::enable_shared_from_this<CudaIpcChannel> {
 public:
  CudaIpcChannel(int fd, std::string peer, const BackendContext* ctx, CopyEngine* engine,
                 Completer* completer, const LocalLayers* local, std::shared_ptr<RemoteMap> map)
      : ch_(fd),
        peer_(std::move(peer)),
        ctx_(ctx),
        engine_(engine),
        completer_(completer),
        local_(local),
        map_(std::move(map)),
        outbound_(map_ != nullptr) {}
  ~CudaIpcChannel() override { Close(); }

  void StartReader() {
    reader_ = std::thread([this] { ReadLoop(); });
  }

  void Submit(std::shared_ptr<TransferJob> job) override {
    if (!outbound_)
      return job->finish(FailedPreconditionError("inbound cuda_ipc channel carries messages only"));
    // The mapping of the peer's pool; released when the peer dies (ReleaseMapping).
    std::shared_ptr<RemoteMap> map = Mapping();
    if (!alive() || !map)
      return job->finish(UnavailableError("cuda_ipc peer '" + peer_ + "' is dead"));
    // relaxed: advisory; once launched the kernel runs to the end (finish after its event).
    if (job->cancel.load(std::memory_order_relaxed))
      return job->finish(CancelledError("cancelled"));
    const auto& segs = *job->segments;
    uint64_t unit = 0;
    for (const Segment& s : segs) {  // defence in depth: Prepare checked against the metadata
      if (!SegmentFitsPeer(s, map->layer_bytes)) {
        return job->finish(InvalidArgumentError("segment outside the peer's mapped region"));
      }
      if (!local_->Contains(s.local, s.length)) {
        return job->finish(
            InvalidArgumentError("segment outside the local registered device memory"));
      }
      if (s.length == 0 || s.length % 16 != 0 || reinterpret_cast<uintptr_t>(s.local) % 16 != 0 ||
          s.remote_offset % 16 != 0) {
        return job->finish(InvalidArgumentError("cuda_ipc moves 16-byte aligned segments only"));
      }
      unit = std::gcd(unit, s.length);
    }
    std::vector<AddressPair> units;
    if (unit != 0) units.reserve(job->total_bytes / unit);
    for (const Segment& s : segs) {
      uint8_t* remote = map->layer_base[s.remote_layer] + s.remote_offset;
      for (uint64_t off = 0; off < s.length; off += unit)
        units.push_back({s.local + off, remote + off});
    }
    const CopyOp op = job->op == TransferOp::kRead ? CopyOp::kRead : CopyOp::kWrite;
    Result<CopyHandle> h = engine_->PostAddresses(op, units, unit == 0 ? 16 : unit);
    if (!h.ok()) return job->finish(h.status());
    std::weak_ptr<CudaIpcChannel> weak = weak_from_this();
    completer_->Push(Pending{std::move(*h), std::move(job), std::move(map), [weak] {
                               auto c = weak.lock();
                               return c && c->alive();
                             }});
  }

  Status SendMessage(std::string_view bytes) override {
    if (!alive()) return UnavailableError("cuda_ipc peer '" + peer_ + "' is dead");
    std::lock_guard<std::mutex> l(send_mu_);
    Status s = ch_.Send(kAgentMsg, bytes);
    if (!s.ok()) MarkDead();
    return s;
  }

  bool alive() const override { return alive_.load() && ch_.PeerAlive(); }

  void Close() override {
    MarkDead();
    JoinOrDetach(reader_);
    ReleaseMapping();
  }

 private:
  void MarkDead() {
    if (alive_.exchange(false)) ch_.Shutdown();
  }
  std::shared_ptr<RemoteMap> Mapping() {
    MutexLock l(&map_mu_);
    return map_;
  }
  // Drops this channel's reference to the peer's mapped pool: once the copies in flight (each
  // holds a reference) are done, cudaIpcCloseMemHandle runs and a dead peer's device memory goes
  // back to the driver (a mapping would otherwise keep it allocated as long as we live).
  void ReleaseMapping() {
    std::shared_ptr<RemoteMap> old;
    {
      MutexLock l(&map_mu_);
      old = std::move(map_);
    }
  }
  void ReadLoop() {
    for (;;) {
      Result<cuda_ipc::Message> m = ch_.Recv(-1);
      if (!m.ok() || m->type != kAgentMsg) break;
      if (ctx_->on_message) ctx_->on_message(peer_, std::move(m->payload));
    }
    const bool was_alive = alive_.exchange(false);
    ch_.Shutdown();
    ReleaseMapping();  // the peer is gone: close our IPC mapping of its pool
    if (was_alive && ctx_->on_peer_lost) ctx_->on_peer_lost(peer_);
  }

  Channel ch_;
  std::string peer_;
  const BackendContext* ctx_;
  CopyEngine* engine_;
  Completer* completer_;
  const LocalLayers* local_;
  Mutex map_mu_;
  std::shared_ptr<RemoteMap> map_ GUARDED_BY(map_mu_);  // null for inbound channels, or once dead
  const bool outbound_;                                 // false: an inbound (message-only) channel
  std::atomic<bool> alive_{true};
  std::mutex send_mu_;
  std::thread reader_;
};

class CudaIpcBackend : public Backend {
 public:
  explicit CudaIpcBackend(const BackendContext& ctx) : ctx_(ctx) {}
  ~CudaIpcBackend() override { Shutdown(); }

  std::string_view name() const override { return "cuda_ipc"; }
  bool one_sided() const override { return true; }
  bool Supports(MemoryKind kind) const override { return kind == MemoryKind::kCuda; }

  Result<std::string> Start(const KvRegistration& reg) override {
    if (reg.layers.empty()) return std::string();
    for (const MemoryRegion& r : reg.layers) {
      if (r.kind != MemoryKind::kCuda || r.device != reg.layers[0].device) return std::string();
    }
    ASSIGN_OR_RETURN(int n, cuda_ipc::CudaDeviceCount());
    device_ = reg.layers[0].device;
    if (device_ < 0 || device_ >= n)
      return InvalidArgumentError("cuda_ipc: no device " + std::to_string(device_));
    KVB_CUDA_RETURN_IF_ERROR(cudaSetDevice(device_));
    // Handshake table: one IPC handle per allocation, each layer = (handle, offset, bytes).
    std::vector<uint8_t*> alloc_base;
    std::string handles, layers;
    for (const MemoryRegion& r : reg.layers) {
      ASSIGN_OR_RETURN(auto alloc, AllocationOf(r.base));
      if (r.bytes > alloc.second - static_cast<size_t>(r.base - alloc.first)) {
        return InvalidArgumentError("cuda_ipc: registered layer runs past its allocation");
      }
      auto it = std::find(alloc_base.begin(), alloc_base.end(), alloc.first);
      const auto idx = static_cast<uint32_t>(it - alloc_base.begin());
      if (it == alloc_base.end()) {
        cudaIpcMemHandle_t raw;
        KVB_CUDA_RETURN_IF_ERROR(cudaIpcGetMemHandle(&raw, alloc.first));
        IpcHandle h;
        std::memcpy(h.handle.data(), &raw, sizeof(raw));
        h.bytes = alloc.second;
        h.device = device_;
        h.pid = static_cast<int32_t>(getpid());
        handles += h.Serialize();
        alloc_base.push_back(alloc.first);
      }
      PutU32(layers, idx);
      PutU64(layers, static_cast<uint64_t>(r.base - alloc.first));
      PutU64(layers, r.bytes);
      local_.Add(r.base, r.bytes);
    }
    table_.clear();
    PutU32(table_, 0);  // status OK
    PutU32(table_, static_cast<uint32_t>(alloc_base.size()));
    table_ += handles;
    PutU32(table_, static_cast<uint32_t>(reg.layers.size()));
    table_ += layers;
    ASSIGN_OR_RETURN(engine_, CopyEngine::Create({.device = device_}));
    completer_ = std::make_unique<Completer>(device_);
    char name[96];
    std::snprintf(name, sizeof(name), "@kvbridge-cuda-ipc-%016llx",
                  static_cast<unsigned long long>(ctx_.incarnation));
    socklen_t len = 0;
    ASSIGN_OR_RETURN(sockaddr_un addr, AbstractAddr(name, &len));
    listen_fd_ = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (listen_fd_ < 0) return ErrnoToStatus(errno, "socket");
    if (::bind(listen_fd_, reinterpret_cast<sockaddr*>(&addr), len) != 0 ||
        ::listen(listen_fd_, 64) != 0) {
      return ErrnoToStatus(errno, std::string("cuda_ipc listen ") + name);
    }
    accept_ = std::thread([this] { AcceptLoop(); });
    return std::string(name);
  }

  bool CanReach(const AgentMetadata& local, const AgentMetadata& peer) const override {
    return !local.host_id.empty() && local.host_id == peer.host_id &&
           local.memory_kind == MemoryKind::kCuda && peer.memory_kind == MemoryKind::kCuda;
  }

  Result<std::shared_ptr<BackendPeer>> Connect(const AgentMetadata& peer) override {
    if (!engine_) return FailedPreconditionError("cuda_ipc: Start with CUDA memory before Connect");
    auto ep = peer.endpoints.find("cuda_ipc");
    if (ep == peer.endpoints.end()) return UnavailableError("peer has no cuda_ipc endpoint");
    socklen_t len = 0;
    ASSIGN_OR_RETURN(sockaddr_un addr, AbstractAddr(ep->second, &len));
    int fd = ::socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return ErrnoToStatus(errno, "socket");
    if (::connect(fd, reinterpret_cast<sockaddr*>(&addr), len) != 0) {
      Status st = UnavailableError("cuda_ipc connect " + ep->second + ": " + std::strerror(errno));
      ::close(fd);
      return st;
    }
    Channel hs(fd);  // the handshake's view; the channel below gets its own descriptor
    // Anyone can bind an abstract name: the server must be a process of our uid (issue 22).
    RETURN_IF_ERROR(cuda_ipc_auth::CheckPeerUid(fd, "server"));
    std::string hello;
    PutU64(hello, ctx_.incarnation);
    PutU64(hello, peer.incarnation);
    hello += ctx_.agent_name;
    RETURN_IF_ERROR(hs.Send(kHello, hello));
    // Challenge-response first (with a token, a table only after the server proved it); the
    // IPC handles are opened only from an accepting HelloAck.
    cuda_ipc_auth::FrameIo io = FramesOf(hs);
    ASSIGN_OR_RETURN(cuda_ipc_auth::Frame ack,
                     cuda_ipc_auth::AwaitHelloAck(io, ctx_.crypto, peer.incarnation,
                                                  ctx_.agent_name, ctx_.peer_timeout_ms));
    size_t at = 4;  // the status word (0: AwaitHelloAck returns accepting replies only)
    uint32_t nh = 0, nl = 0;
    auto map = std::make_shared<RemoteMap>();
    if (!GetU32(ack.payload, at, nh) || nh > 1024)
      return UnavailableError("cuda_ipc handshake: bad table");
    for (uint32_t i = 0; i < nh; ++i) {
      if (ack.payload.size() < at + IpcHandle::kSerializedBytes)
        return UnavailableError("cuda_ipc handshake: short table");
      ASSIGN_OR_RETURN(
          IpcHandle h,
          IpcHandle::Parse(std::string_view(ack.payload).substr(at, IpcHandle::kSerializedBytes)));
      at += IpcHandle::kSerializedBytes;
      ASSIGN_OR_RETURN(auto pool, ImportedPool::Open(h, device_));
      map->pools.push_back(std::move(pool));
    }
    if (!GetU32(ack.payload, at, nl) || nl != peer.layer_bytes.size()) {
      return UnavailableError("cuda_ipc handshake: layer count differs from the peer's metadata");
    }
    for (uint32_t i = 0; i < nl; ++i) {
      uint32_t idx = 0;
      uint64_t off = 0, bytes = 0;
      if (!GetU32(ack.payload, at, idx) || !GetU64(ack.payload, at, off) ||
          !GetU64(ack.payload, at, bytes) || idx >= map->pools.size() ||
          off > map->pools[idx]->bytes() || bytes > map->pools[idx]->bytes() - off ||
          bytes != peer.layer_bytes[i]) {
        return UnavailableError("cuda_ipc handshake: region " + std::to_string(i) +
                                " does not fit");
      }
      map->layer_base.push_back(static_cast<uint8_t*>(map->pools[idx]->data()) + off);
      map->layer_bytes.push_back(bytes);
    }
    auto ch = std::make_shared<CudaIpcChannel>(::dup(fd), peer.agent_name, &ctx_, engine_.get(),
                                               completer_.get(), &local_, std::move(map));
    ch->StartReader();
    return std::shared_ptr<BackendPeer>(ch);
  }

  void Shutdown() override {
    std::list<std::shared_ptr<CudaIpcChannel>> inbound;
    if (!inbound_.Shut(&inbound)) return;
    if (listen_fd_ >= 0) ::shutdown(listen_fd_, SHUT_RDWR);
    if (accept_.joinable()) accept_.join();
    if (listen_fd_ >= 0) ::close(listen_fd_);
    listen_fd_ = -1;
    for (auto& c : inbound) c->Close();
    completer_.reset();  // finishes every posted job first
  }

 private:
  void AcceptLoop() {
    for (int fd; (fd = AcceptRetrying(listen_fd_)) >= 0;) {
      Channel hs(::dup(fd));
      Result<cuda_ipc::Message> m = hs.Recv(ctx_.peer_timeout_ms);
      uint64_t inc = 0, expect = 0;
      size_t at = 0;
      if (!m.ok() || m->type != kHello || !GetU64(m->payload, at, inc) ||
          !GetU64(m->payload, at, expect)) {
        ::close(fd);
        continue;
      }
      std::string peer_name = m->payload.substr(at);
      if (expect != ctx_.incarnation) {
        std::string refuse;
        PutU32(refuse, static_cast<uint32_t>(StatusCode::kFailedPrecondition));
        refuse += "stale metadata: agent incarnation changed";
        (void)hs.Send(kHelloAck, refuse);
        ::close(fd);
        continue;
      }
      // Issue 22: a peer of another uid, or one that does not prove the cluster token, gets a
      // refusal and nothing else (no IPC handle).
      Status admitted = cuda_ipc_auth::CheckPeerUid(fd, "peer");
      if (admitted.ok()) {
        cuda_ipc_auth::FrameIo io = FramesOf(hs);
        admitted = cuda_ipc_auth::ServeChallenge(io, ctx_.crypto, ctx_.incarnation, peer_name,
                                                 ctx_.peer_timeout_ms);
      }
      if (!admitted.ok()) {
        if (admitted.code() == StatusCode::kUnauthenticated ||
            admitted.code() == StatusCode::kPermissionDenied) {
          (void)hs.Send(kHelloAck, cuda_ipc_auth::RefusalPayload(admitted));
          if (ctx_.on_refused) ctx_.on_refused(peer_name, admitted);
        }
        ::close(fd);
        continue;
      }
      if (!hs.Send(kHelloAck, table_).ok()) {
        ::close(fd);
        continue;
      }
      auto ch = std::make_shared<CudaIpcChannel>(fd, peer_name, &ctx_, engine_.get(),
                                                 completer_.get(), &local_, nullptr);
      if (!inbound_.Add(ch, [](const CudaIpcChannel& c) { return !c.alive(); })) return;
      if (ctx_.on_inbound) ctx_.on_inbound(peer_name, ch);
      ch->StartReader();
    }
  }

  BackendContext ctx_;
  int device_ = 0;
  LocalLayers local_;
  std::string table_;
  std::unique_ptr<CopyEngine> engine_;
  std::unique_ptr<Completer> completer_;
  int listen_fd_ = -1;
  std::thread accept_;
  InboundConns<CudaIpcChannel> inbound_;
};

}  // namespace

std::unique_ptr<Backend> MakeCudaIpcBackend(const BackendContext& ctx) {
  return std::make_unique<CudaIpcBackend>(ctx);
}

}  // namespace kvbridge::transfer

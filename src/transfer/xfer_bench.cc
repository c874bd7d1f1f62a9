#include "transfer/xfer_bench.h"

#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <memory>
#include <nlohmann/json.hpp>
#include <random>
#include <sstream>
#include <thread>
#include <vector>

#include "kvbridge/transfer/agent.h"
#include "transfer/fill_pattern.h"
#include "transfer/socket_util.h"
#if KVBRIDGE_HAVE_CUDA_IPC
#include <cuda_runtime.h>

#include <numeric>

#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_bench.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/peer_link.h"
#endif

namespace kvbridge::transfer {
namespace {

using Clock = std::chrono::steady_clock;
constexpr uint8_t kPoison = 0xAB;
constexpr uint64_t kRemoteSeed = 101, kLocalSeed = 202;

double Us(Clock::duration d) { return std::chrono::duration<double, std::micro>(d).count(); }

// Line-oriented control connection between the bench and its peer.
class Control {
 public:
  explicit Control(net::Fd fd) : fd_(std::move(fd)) {}
  int fd() const { return fd_.get(); }
  Status Send(const std::string& line) { return net::SendAll(fd_.get(), line.data(), line.size()); }
  Result<std::string> Line() {
    for (;;) {
      size_t nl = buf_.find('\n');
      if (nl != std::string::npos) {
        std::string l = buf_.substr(0, nl);
        buf_.erase(0, nl + 1);
        return l;
      }
      char tmp[65536];
      ssize_t n = ::recv(fd_.get(), tmp, sizeof(tmp), 0);
      if (n <= 0) return UnavailableError("control connection closed");
      buf_.append(tmp, static_cast<size_t>(n));
    }
  }
  // Raw bytes (after a line): the buffered part first.
  Status Recv(uint8_t* p, uint64_t n) {
    uint64_t k = std::min<uint64_t>(n, buf_.size());
    std::memcpy(p, buf_.data(), k);
    buf_.erase(0, k);
    return n > k ? net::RecvAll(fd_.get(), p + k, n - k) : OkStatus();
  }

 private:
  net::Fd fd_;
  std::string buf_;
};

PagedKvLayout LayoutFor(uint64_t block_bytes, int num_blocks, int layers) {
  PagedKvLayout l;
  l.num_layers = layers;
  l.num_kv_heads = 1;
  l.block_size = 16;
  l.head_dim = static_cast<int>(block_bytes / (2 * 16 * 4));
  l.num_blocks = num_blocks;
  l.dtype = KvDtype::kFp32;
  return l;
}

struct Side {
  PagedKvLayout layout;
  HostBuffer buf;
  std::unique_ptr<TransferAgent> agent;
  uint8_t* Block(int layer, int block) {
    return buf.data() + static_cast<size_t>(layer) * layout.LayerBytes() +
           static_cast<size_t>(block) * layout.BlockBytes();
  }
};

Result<std::unique_ptr<Side>> MakeSide(const std::string& name, const XferBenchOptions& o,
                                       const PagedKvLayout& layout, const std::string& bind) {
  auto s = std::make_unique<Side>();
  s->layout = layout;
  ASSIGN_OR_RETURN(s->buf, HostBuffer::Allocate(layout.LayerBytes() * layout.num_layers));
  AgentConfig cfg;
  cfg.name = name;
  cfg.backends = {o.backend};
  cfg.force_backend = o.backend;
  cfg.bind_host = bind;
  cfg.copy_threads = o.copy_threads;
  cfg.tcp_connections = o.tcp_connections;
  cfg.model_fingerprint = "xfer-bench";
  ASSIGN_OR_RETURN(s->agent, TransferAgent::Create(cfg));
  RETURN_IF_ERROR(s->agent->RegisterMemory(KvRegistration::FromHostBuffer(layout, s->buf)));
  return s;
}

// ------------------------------------------------------------------ peer

int Serve(const XferBenchOptions& o) {
  std::string host;
  int port = 0, bound = 0;
  if (Status s = net::ParseHostPort(o.listen, &host, &port); !s.ok()) {
    std::fprintf(stderr, "xfer-bench --serve: %s\n", s.ToString().c_str());
    return 2;
  }
  auto lis = net::TcpListen(host, port, &bound);
  if (!lis.ok()) {
    std::fprintf(stderr, "xfer-bench --serve: %s\n", lis.status().ToString().c_str());
    return 1;
  }
  std::printf("PORT %d\n", bound);
  std::fflush(stdout);
  int cfd = ::accept(lis->get(), nullptr, nullptr);
  if (cfd < 0) return 1;
  Control ctl{net::Fd(cfd)};
  std::unique_ptr<Side> side;
  std::vector<uint8_t> scratch;
  for (;;) {
    auto line = ctl.Line();
    if (!line.ok()) return 0;
    std::istringstream in(*line);
    std::string cmd;
    in >> cmd;
    if (cmd == "CONFIG") {
      XferBenchOptions po = o;
      uint64_t block_bytes;
      int nblocks, layers;
      in >> po.backend >> block_bytes >> nblocks >> layers >> po.copy_threads >> po.tcp_connections;
      auto s = MakeSide("xfer-bench-peer", po, LayoutFor(block_bytes, nblocks, layers), host);
      if (!s.ok()) {
        (void)ctl.Send("ERR " + s.status().ToString() + "\n");
        continue;
      }
      side = std::move(s).value();
      for (int l = 0; l < layers; ++l) {
        for (int b = 0; b < nblocks; ++b)
          FillPattern(side->Block(l, b), block_bytes, kRemoteSeed, l, b);
      }
      side->agent->SetNotificationHandler([a = side->agent.get()](Notification n) {
        if (n.wants_reply) (void)a->Reply(n, "held");
      });
      (void)ctl.Send("META " + EncodeMetadata(*side->agent->Metadata()) + "\n");
    } else if (cmd == "POISON" && side) {
      std::memset(side->buf.data(), kPoison, side->buf.size());
      (void)ctl.Send("OK\n");
    } else if (cmd == "CHECK" && side) {
      // CHECK layers n l0 r0 l1 r1 ...: remote block r must hold the local pattern of block l.
      int layers, n;
      in >> layers >> n;
      std::vector<uint8_t> want(side->layout.BlockBytes());
      bool ok = true;
      for (int i = 0; i < n && ok; ++i) {
        int lb, rb;
        in >> lb >> rb;
        for (int l = 0; l < layers && ok; ++l) {
          FillPattern(want.data(), want.size(), kLocalSeed, l, lb);
          ok = std::memcmp(side->Block(l, rb), want.data(), want.size()) == 0;
        }
      }
      (void)ctl.Send(ok ? "OK\n" : "BAD\n");
    } else if (cmd == "STREAM") {  // baseline: send N bytes as one blocking stream
      // From a buffer of all N bytes (touched once), as the transfer reads N distinct bytes: a
      // small reused buffer would stay in cache and flatter the baseline.
      uint64_t n;
      in >> n;
      if (scratch.size() < n) scratch.assign(n, 1);
      if (!net::SendAll(ctl.fd(), scratch.data(), n).ok()) return 1;
    } else if (cmd == "SINK") {
      uint64_t n;
      in >> n;
      if (scratch.size() < n) scratch.assign(n, 1);
      if (!ctl.Recv(scratch.data(), n).ok()) return 1;
      (void)ctl.Send("OK\n");
    } else if (cmd == "QUIT") {
      return 0;
    } else {
      (void)ctl.Send("ERR unknown command\n");
    }
  }
}

// ------------------------------------------------------------------ bench

struct Spawned {
  pid_t pid = -1;
  ~Spawned() {
    if (pid > 0) {
      int st;
      for (int i = 0; i < 100; ++i) {
        if (::waitpid(pid, &st, WNOHANG) == pid) return;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
      }
      ::kill(pid, SIGKILL);
      ::waitpid(pid, &st, 0);
    }
  }
};

Result<int> SpawnPeer(Spawned* sp) {
  int fds[2];
  if (::pipe(fds) != 0) return ErrnoToStatus(errno, "pipe");
  pid_t pid = ::fork();
  if (pid < 0) return ErrnoToStatus(errno, "fork");
  if (pid == 0) {
    ::dup2(fds[1], 1);
    ::close(fds[0]);
    ::close(fds[1]);
    const char* argv[] = {"kvbridge", "xfer-bench", "--serve", "--listen", "127.0.0.1:0", nullptr};
    ::execv("/proc/self/exe", const_cast<char* const*>(argv));
    ::_exit(127);
  }
  sp->pid = pid;
  ::close(fds[1]);
  std::string out;
  char c;
  while (::read(fds[0], &c, 1) == 1 && c != '\n') out.push_back(c);
  ::close(fds[0]);
  if (out.rfind("PORT ", 0) != 0) return UnavailableError("peer did not start: '" + out + "'");
  return std::stoi(out.substr(5));
}

double Percentile(std::vector<double> v, double q) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(q * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

Status Check(bool ok, const std::string& what) { return ok ? OkStatus() : InternalError(what); }

Status Bench(const XferBenchOptions& o, nlohmann::json* out) {
  if (o.block_size == 0 || o.block_size % 128 != 0) {
    return InvalidArgumentError("--block-size must be a positive multiple of 128 bytes");
  }
  if (o.blocks < 1 || o.layers < 1 || o.iters < 1) {
    return InvalidArgumentError("--blocks, --layers and --iters must be >= 1");
  }
  if (o.op != "read" && o.op != "write") return InvalidArgumentError("--op is read or write");
  const int pool = 2 * o.blocks;
  const PagedKvLayout layout = LayoutFor(o.block_size, pool, o.layers);
  Spawned spawned;
  std::string host = "127.0.0.1";
  int port;
  if (o.peer.empty()) {
    ASSIGN_OR_RETURN(port, SpawnPeer(&spawned));
  } else {
    RETURN_IF_ERROR(net::ParseHostPort(o.peer, &host, &port));
  }
  ASSIGN_OR_RETURN(net::Fd cfd, net::TcpConnect(host, port, 5000));
  Control ctl(std::move(cfd));
  RETURN_IF_ERROR(ctl.Send("CONFIG " + o.backend + " " + std::to_string(o.block_size) + " " +
                           std::to_string(pool) + " " + std::to_string(o.layers) + " " +
                           std::to_string(o.copy_threads) + " " +
                           std::to_string(o.tcp_connections) + "\n"));
  ASSIGN_OR_RETURN(std::string meta_line, ctl.Line());
  if (meta_line.rfind("META ", 0) != 0) return UnavailableError("peer: " + meta_line);
  ASSIGN_OR_RETURN(AgentMetadata peer, DecodeMetadata(meta_line.substr(5)));
  ASSIGN_OR_RETURN(auto side, MakeSide("xfer-bench", o, layout, host));
  ASSIGN_OR_RETURN(std::string chosen, side->agent->AddPeer(peer));
  const bool read = o.op == "read";

  // Scattered block ids on both sides.
  std::vector<int> la(pool), ra(pool);
  for (int i = 0; i < pool; ++i) la[i] = ra[i] = i;
  std::mt19937 rng(12345);
  std::shuffle(la.begin(), la.end(), rng);
  std::shuffle(ra.begin(), ra.end(), rng);
  std::vector<BlockPair> pairs;
  for (int i = 0; i < o.blocks; ++i) pairs.push_back({la[i], ra[i]});
  TransferSpec spec{read ? TransferOp::kRead : TransferOp::kWrite, peer.agent_name, pairs};
  ASSIGN_OR_RETURN(auto prepared, side->agent->Prepare(spec));
  const uint64_t bytes = prepared->bytes();

  auto run_once = [&]() -> Result<double> {
    auto t0 = Clock::now();
    ASSIGN_OR_RETURN(TransferHandle h, side->agent->Post(prepared));
    if (!h.Wait(120000)) return DeadlineExceededError("transfer did not finish in 120 s");
    double us = Us(Clock::now() - t0);
    RETURN_IF_ERROR(h.status());
    return us;
  };

  // Verify before timing: destination poisoned, every byte checked.
  if (read) {
    std::memset(side->buf.data(), kPoison, side->buf.size());
    ASSIGN_OR_RETURN(double ignored, run_once());
    (void)ignored;
    std::vector<uint8_t> want(o.block_size);
    for (int l = 0; l < o.layers; ++l) {
      for (auto p : pairs) {
        FillPattern(want.data(), want.size(), kRemoteSeed, l, p.remote);
        RETURN_IF_ERROR(Check(std::memcmp(side->Block(l, p.local), want.data(), want.size()) == 0,
                              "verification failed: local block " + std::to_string(p.local)));
      }
    }
  } else {
    for (int l = 0; l < o.layers; ++l) {
      for (int b = 0; b < pool; ++b) FillPattern(side->Block(l, b), o.block_size, kLocalSeed, l, b);
    }
    RETURN_IF_ERROR(ctl.Send("POISON\n"));
    ASSIGN_OR_RETURN(std::string ok, ctl.Line());
    ASSIGN_OR_RETURN(double ignored, run_once());
    (void)ignored;
    std::string check = "CHECK " + std::to_string(o.layers) + " " + std::to_string(pairs.size());
    for (auto p : pairs) check += " " + std::to_string(p.local) + " " + std::to_string(p.remote);
    RETURN_IF_ERROR(ctl.Send(check + "\n"));
    ASSIGN_OR_RETURN(std::string res, ctl.Line());
    RETURN_IF_ERROR(Check(res == "OK", "verification failed: peer says " + res));
  }

  // Baseline of the same bytes (buffers made and touched once, before the rounds).
  std::string baseline_kind;
  HostBuffer src, dst;
  std::vector<uint8_t> sink;
  if (o.backend == "shm") {
    baseline_kind = "memcpy, 1 thread, pre-faulted";
    ASSIGN_OR_RETURN(src, HostBuffer::Allocate(bytes));
    ASSIGN_OR_RETURN(dst, HostBuffer::Allocate(bytes));
    std::memset(src.data(), 1, bytes);
    std::memset(dst.data(), 2, bytes);
  } else {
    baseline_kind = "one blocking loopback TCP stream";
    sink.assign(bytes, 1);  // all N bytes, as the transfer's (a small reused one stays cached)
  }
  auto baseline_once = [&]() -> Result<double> {
    auto t0 = Clock::now();
    if (o.backend == "shm") {
      std::memcpy(dst.data(), src.data(), bytes);
    } else if (read) {
      RETURN_IF_ERROR(ctl.Send("STREAM " + std::to_string(bytes) + "\n"));
      RETURN_IF_ERROR(ctl.Recv(sink.data(), bytes));
    } else {
      RETURN_IF_ERROR(ctl.Send("SINK " + std::to_string(bytes) + "\n"));
      RETURN_IF_ERROR(net::SendAll(ctl.fd(), sink.data(), bytes));
      ASSIGN_OR_RETURN(std::string ok, ctl.Line());
    }
    return Us(Clock::now() - t0);
  };
  RETURN_IF_ERROR(baseline_once().status());  // warm-up (the transfer's was its check)

  // Rounds of --iters pairs, one transfer then one baseline run (odd rounds: baseline first), so
  // that load drift on a shared machine hits both alike; one ratio per round (best / best).
  std::vector<double> times, base, round_ratio;
  const int rounds = std::max(1, o.rounds);
  for (int r = 0; r < rounds; ++r) {
    std::vector<double> ours_r, base_r;
    for (int i = 0; i < o.iters; ++i) {
      for (int half = 0; half < 2; ++half) {
        const bool ours_now = (half == 0) == (r % 2 == 0);
        ASSIGN_OR_RETURN(double us, ours_now ? run_once() : baseline_once());
        (ours_now ? ours_r : base_r).push_back(us);
      }
    }
    round_ratio.push_back(*std::min_element(base_r.begin(), base_r.end()) /
                          *std::min_element(ours_r.begin(), ours_r.end()));
    times.insert(times.end(), ours_r.begin(), ours_r.end());
    base.insert(base.end(), base_r.begin(), base_r.end());
  }
  const double best = *std::min_element(times.begin(), times.end());
  const double base_best = *std::min_element(base.begin(), base.end());

  // Preparing + posting a 15,000-descriptor transfer (one layer, no coalescing).
  std::vector<double> prep, prep_only;
  {
    std::vector<BlockPair> many;
    for (int i = 0; i < 15000; ++i) many.push_back({la[i % pool], ra[(i * 7 + 3) % pool]});
    // Make every pair non-adjacent so nothing coalesces.
    for (int rep = 0; rep < 5; ++rep) {
      TransferSpec s15{TransferOp::kRead, peer.agent_name, many, 0};
      auto t0 = Clock::now();
      ASSIGN_OR_RETURN(auto p15, side->agent->Prepare(s15));
      prep_only.push_back(Us(Clock::now() - t0));
      ASSIGN_OR_RETURN(TransferHandle h, side->agent->Post(p15));
      prep.push_back(Us(Clock::now() - t0));
      h.Wait(120000);
      RETURN_IF_ERROR(h.status());
    }
  }

  // 1 KiB READ (512 B of the K half + 512 B of the V half of one block) + notification +
  // reply: post -> reply received.
  std::vector<double> rt;
  {
    TransferSpec s1{TransferOp::kRead, peer.agent_name, {{la[0], ra[0]}}, 0};
    s1.local_range = ByteRange{0, 512};
    s1.remote_range = ByteRange{0, 512};
    ASSIGN_OR_RETURN(auto p1, side->agent->Prepare(s1));
    for (int i = 0; i < 1000; ++i) {
      std::promise<Result<std::string>> pr;
      PostOptions opt;
      opt.transfer_id = "rt" + std::to_string(i);
      opt.notification = "read-done";
      opt.on_reply = [&pr](Result<std::string> r) { pr.set_value(std::move(r)); };
      auto t0 = Clock::now();
      ASSIGN_OR_RETURN(TransferHandle h, side->agent->Post(p1, std::move(opt)));
      auto f = pr.get_future();
      Result<std::string> r = f.get();
      rt.push_back(Us(Clock::now() - t0));
      RETURN_IF_ERROR(r.status());
      RETURN_IF_ERROR(Check(*r == "held", "unexpected reply " + *r));
      h.Wait(1000);
    }
  }
  (void)ctl.Send("QUIT\n");

  const double gbps = bytes / best / 1e3;
  const double gbps_p50 = bytes / Percentile(times, 0.5) / 1e3;
  const double base_gbps = bytes / base_best / 1e3;
  (*out) = {{"backend", chosen},
            {"op", o.op},
            {"block_size", o.block_size},
            {"blocks", o.blocks},
            {"layers", o.layers},
            {"iters", o.iters},
            {"bytes", bytes},
            {"segments", prepared->segment_count()},
            {"verified", true},
            {"gbps", gbps},
            {"gbps_p50", gbps_p50},
            {"baseline", baseline_kind},
            {"baseline_gbps", base_gbps},
            {"rounds", rounds},
            {"round_ratios", round_ratio},
            {"ratio", Percentile(round_ratio, 0.5)},
            {"ratio_min", *std::min_element(round_ratio.begin(), round_ratio.end())},
            {"ratio_max", *std::max_element(round_ratio.begin(), round_ratio.end())},
            {"p50_us", Percentile(times, 0.5)},
            {"p99_us", Percentile(times, 0.99)},
            {"prep_post_15k_us", Percentile(prep, 0.5)},
            {"prep_15k_us", Percentile(prep_only, 0.5)},
            {"notify_rt_1k_p50_us", Percentile(rt, 0.5)},
            {"notify_rt_1k_p99_us", Percentile(rt, 0.99)}};
  return OkStatus();
}

#if KVBRIDGE_HAVE_CUDA_IPC
// --mem cuda --agent: the whole agent path over device memory. This process: a TransferAgent
// (cuda_ipc) over a cudaMalloc pool on --device; the peer: cuda_ipc_peer serving a cuda_ipc
// Backend over its pool on --peer-device, split into --layers regions. One transfer = --blocks
// scattered blocks x every layer (Prepare once, Post + Wait per iteration: address-list build,
// upload, one kernel, event, finish callback). Checked once (poisoned destination, every byte
// compared on the GPU) before timing; baseline = one contiguous copy of the same bytes
// (cudaMemcpyAsync, cudaMemcpyPeerAsync across GPUs) timed the same way (post to done).
Status CudaAgentBench(const XferBenchOptions& o, nlohmann::json* out) {
  using cuda_ipc::MsgType;
  if (o.block_size == 0 || o.block_size % 128 != 0 || o.blocks < 1 || o.layers < 1 || o.iters < 1) {
    return InvalidArgumentError("--block-size (multiple of 128), --blocks, --layers, --iters");
  }
  ASSIGN_OR_RETURN(int ndev, cuda_ipc::CudaDeviceCount());
  const int dev = o.device, peer_dev = o.peer_device < 0 ? o.device : o.peer_device;
  if (dev < 0 || dev >= ndev || peer_dev >= ndev) {
    return InvalidArgumentError("GPUs " + std::to_string(dev) + " and " + std::to_string(peer_dev) +
                                " asked, " + std::to_string(ndev) + " present");
  }
  const int nb = 2 * o.blocks;
  const PagedKvLayout layout = LayoutFor(o.block_size, nb, o.layers);
  const uint64_t pool_bytes = layout.LayerBytes() * o.layers;
  const uint64_t units = uint64_t(nb) * o.layers;
  auto call = [](cuda_ipc::Channel& ch, MsgType t,
                 std::string_view p) -> Result<cuda_ipc::Message> {
    RETURN_IF_ERROR(ch.Send(t, p));
    ASSIGN_OR_RETURN(cuda_ipc::Message m, ch.Recv(120000));
    if (m.type == MsgType::kError) return InternalError("peer: " + m.payload);
    return m;
  };
  auto u64 = [](uint64_t v) { return cuda_ipc::EncodeU64s(std::vector<uint64_t>{v}); };
  ASSIGN_OR_RETURN(cuda_ipc::PeerProcess peer,
                   cuda_ipc::SpawnPeer(cuda_ipc::DefaultPeerBinary(), peer_dev));
  cuda_ipc::Channel& ch = *peer.channel;
  ASSIGN_OR_RETURN(cuda_ipc::Message hm, call(ch, MsgType::kAlloc, u64(pool_bytes)));
  ASSIGN_OR_RETURN(cuda_ipc::IpcHandle handle, cuda_ipc::IpcHandle::Parse(hm.payload));
  ASSIGN_OR_RETURN(auto pool, cuda_ipc::DevicePool::Create(dev, pool_bytes));
  const TransferOp op = o.op == "write" ? TransferOp::kWrite : TransferOp::kRead;
  const uint64_t bytes = uint64_t(o.blocks) * layout.BlockBytes() * o.layers;
  cudaStream_t s = nullptr;
  RETURN_IF_ERROR(cuda_ipc::CudaStatus(cudaSetDevice(dev), "cudaSetDevice"));
  RETURN_IF_ERROR(cuda_ipc::CudaStatus(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking),
                                       "cudaStreamCreate"));
  std::unique_ptr<CUstream_st, void (*)(cudaStream_t)> stream_guard(
      s, [](cudaStream_t x) { cudaStreamDestroy(x); });
  // Baseline first, through our own mapping of the peer's pool (closed before the agent maps
  // it): one contiguous copy of the transfer's bytes, timed post -> done like the transfers.
  std::vector<double> times, base;
  {
    ASSIGN_OR_RETURN(auto remote, cuda_ipc::ImportedPool::Open(handle, dev));
    void* dst = op == TransferOp::kRead ? pool->data() : remote->data();
    void* src = op == TransferOp::kRead ? remote->data() : pool->data();
    for (int i = 0; i < o.iters + 1; ++i) {
      const auto t0 = Clock::now();
      cudaError_t e = dev == peer_dev
                          ? cudaMemcpyAsync(dst, src, bytes, cudaMemcpyDeviceToDevice, s)
                          : cudaMemcpyPeerAsync(dst, op == TransferOp::kRead ? dev : peer_dev, src,
                                                op == TransferOp::kRead ? peer_dev : dev, bytes, s);
      RETURN_IF_ERROR(cuda_ipc::CudaStatus(e, "contiguous copy"));
      RETURN_IF_ERROR(cuda_ipc::CudaStatus(cudaStreamSynchronize(s), "contiguous copy"));
      if (i > 0) base.push_back(Us(Clock::now() - t0));  // first = warm-up
    }
  }
  ASSIGN_OR_RETURN(cuda_ipc::Message ep, call(ch, MsgType::kServeBackend, u64(o.layers)));
  if (ep.type != MsgType::kEndpoint || ep.payload.size() <= 8) {
    return InternalError("peer: no cuda_ipc endpoint");
  }
  AgentConfig cfg;
  cfg.name = "xfer-bench";
  cfg.backends = {"cuda_ipc"};
  cfg.force_backend = "cuda_ipc";
  cfg.model_fingerprint = "xfer-bench";
  ASSIGN_OR_RETURN(auto agent, TransferAgent::Create(cfg));
  RETURN_IF_ERROR(
      agent->RegisterMemory(KvRegistration::FromDeviceMemory(layout, pool->data(), dev)));
  // The peer serves a bare Backend (no agent): its metadata is ours with its name, incarnation
  // and endpoint (same layout, same host).
  ASSIGN_OR_RETURN(AgentMetadata pm, agent->Metadata());
  pm.agent_name = "cuda-ipc-peer";
  std::memcpy(&pm.incarnation, ep.payload.data(), 8);
  pm.endpoints = {{"cuda_ipc", ep.payload.substr(8)}};
  ASSIGN_OR_RETURN(std::string backend, agent->AddPeer(pm));

  std::mt19937 rng(7);
  std::vector<int> a(nb), b(nb);
  std::iota(a.begin(), a.end(), 0);
  std::iota(b.begin(), b.end(), 0);
  std::shuffle(a.begin(), a.end(), rng);
  std::shuffle(b.begin(), b.end(), rng);
  TransferSpec spec{op, pm.agent_name, {}};
  std::vector<int32_t> src_of(units, -1);
  for (int i = 0; i < o.blocks; ++i) {
    spec.blocks.push_back({a[i], b[i]});
    for (int l = 0; l < o.layers; ++l) {
      if (op == TransferOp::kRead)
        src_of[uint64_t(l) * nb + a[i]] = l * nb + b[i];
      else
        src_of[uint64_t(l) * nb + b[i]] = l * nb + a[i];
    }
  }
  ASSIGN_OR_RETURN(auto prepared, agent->Prepare(spec));
  if (prepared->bytes() != bytes) return InternalError("prepared bytes differ from the shape");
  // Check once: source pattern 301, destination poisoned with 302.
  RETURN_IF_ERROR(call(ch, MsgType::kFill, u64(op == TransferOp::kRead ? 301 : 302)).status());
  RETURN_IF_ERROR(
      cuda_ipc::FillPattern(pool->data(), pool_bytes, op == TransferOp::kRead ? 302 : 301, s));
  RETURN_IF_ERROR(cuda_ipc::CudaStatus(cudaStreamSynchronize(s), "fill"));
  auto post_wait = [&]() -> Status {
    ASSIGN_OR_RETURN(TransferHandle h, agent->Post(prepared));
    if (!h.Wait(60000)) return DeadlineExceededError("transfer did not finish");
    return h.state() == TransferState::kDone ? OkStatus() : h.status();
  };
  RETURN_IF_ERROR(post_wait());
  uint64_t bad = 0;
  if (op == TransferOp::kRead) {
    ASSIGN_OR_RETURN(bad, cuda_ipc::VerifyBlocks({pool->data(), layout.BlockBytes(), units}, src_of,
                                                 301, 302, s));
  } else {
    ASSIGN_OR_RETURN(cuda_ipc::Message m,
                     call(ch, MsgType::kVerify,
                          cuda_ipc::VerifySpec{301, 302, layout.BlockBytes(), src_of}.Encode()));
    ASSIGN_OR_RETURN(std::vector<uint64_t> v, cuda_ipc::DecodeU64s(m.payload));
    bad = v.empty() ? ~uint64_t{0} : v[0];
  }
  if (bad != 0) return InternalError(std::to_string(bad) + " mismatched 8-byte words");
  for (int i = 0; i < o.iters; ++i) {
    const auto t0 = Clock::now();
    RETURN_IF_ERROR(post_wait());
    times.push_back(Us(Clock::now() - t0));
  }
  agent.reset();
  RETURN_IF_ERROR(peer.Stop(10000));
  const double p50 = Percentile(times, 0.5), b50 = Percentile(base, 0.5);
  *out = {{"backend", backend},
          {"mem", "cuda"},
          {"device", dev},
          {"peer_device", peer_dev},
          {"bytes", bytes},
          {"segments", prepared->segment_count()},
          {"gbps_p50", bytes / p50 / 1e3},
          {"p50_us", p50},
          {"p99_us", Percentile(times, 0.99)},
          {"baseline", dev == peer_dev ? "cudaMemcpyAsync" : "cudaMemcpyPeerAsync"},
          {"baseline_gbps_p50", bytes / b50 / 1e3},
          {"ratio", b50 / p50}};
  return OkStatus();
}
#endif

int RunCuda(const XferBenchOptions& o) {
  if (o.backend != "cuda_ipc") {
    std::fprintf(stderr,
                 "xfer-bench: --mem cuda moves device memory with --backend cuda_ipc "
                 "only (got --backend %s)\n",
                 o.backend.c_str());
    return 64;
  }
  if (o.serve || !o.peer.empty()) {
    std::fprintf(stderr,
                 "xfer-bench: --mem cuda spawns its own peer process (no --serve/--peer)\n");
    return 64;
  }
#if KVBRIDGE_HAVE_CUDA_IPC
  if (o.agent) {
    nlohmann::json r;
    Status st = CudaAgentBench(o, &r);
    if (!st.ok()) {
      std::fprintf(stderr, "xfer-bench --mem cuda --agent: %s\n", st.ToString().c_str());
      return 1;
    }
    std::printf(
        "xfer-bench cuda_ipc agent %s GPU %d <-> GPU %d: %d blocks x %llu B x %d layers = %llu B "
        "in %llu segments, verified\n  transfer (post -> done): %.1f GB/s p50; p50 %.1f us, p99 "
        "%.1f us\n  baseline (%s, post -> done): %.1f GB/s -> ratio %.3f\n",
        o.op.c_str(), r["device"].get<int>(), r["peer_device"].get<int>(), o.blocks,
        static_cast<unsigned long long>(o.block_size), o.layers,
        static_cast<unsigned long long>(r["bytes"].get<uint64_t>()),
        static_cast<unsigned long long>(r["segments"].get<uint64_t>()), r["gbps_p50"].get<double>(),
        r["p50_us"].get<double>(), r["p99_us"].get<double>(),
        r["baseline"].get<std::string>().c_str(), r["baseline_gbps_p50"].get<double>(),
        r["ratio"].get<double>());
    if (o.json) std::printf("%s\n", r.dump().c_str());
    return 0;
  }
  cuda_ipc::CudaBenchOptions c;
  c.bytes = o.cuda_bytes;
  c.runs = o.cuda_runs;
  c.sizes = o.cuda_sizes;
  c.device = o.device;
  c.peer_device = o.peer_device;
  c.lat_iters = o.lat_iters;
  c.sweep = o.sweep;
  c.baselines = !o.no_baselines;
  c.out = o.out;
  return cuda_ipc::RunCudaBench(c);
#else
  std::fprintf(stderr,
               "xfer-bench: --mem cuda: this kvbridge was built without CUDA (configure with "
               "-DKVBRIDGE_WITH_CUDA=ON where nvcc is installed; built backends: %s)\n",
               [] {
                 std::string s;
                 for (const auto& n : AvailableBackends()) s += (s.empty() ? "" : ",") + n;
                 return s;
               }()
                   .c_str());
  return 2;
#endif
}

}  // namespace

int RunXferBench(const XferBenchOptions& o) {
  ::signal(SIGPIPE, SIG_IGN);
  if (o.mem == "cuda") return RunCuda(o);
  if (o.mem != "host") {
    std::fprintf(stderr, "xfer-bench: --mem is host or cuda (got %s)\n", o.mem.c_str());
    return 64;
  }
  if (o.backend == "cuda_ipc") {
    std::fprintf(stderr, "xfer-bench: --backend cuda_ipc moves device memory: add --mem cuda\n");
    return 64;
  }
  if (o.serve) return Serve(o);
  nlohmann::json r;
  Status s = Bench(o, &r);
  if (!s.ok()) {
    std::fprintf(stderr, "xfer-bench: %s\n", s.ToString().c_str());
    return 1;
  }
  std::printf(
      "xfer-bench %s %s: %d blocks x %llu B x %d layers = %llu B in %llu segments, verified\n"
      "  transfer: %.2f GB/s best, %.2f GB/s p50; per transfer p50 %.1f us, p99 %.1f us\n"
      "  baseline (%s): %.2f GB/s best\n"
      "  ratio (baseline best / transfer best, per round, %d alternating rounds of %d): median "
      "%.3f, min-max %.3f-%.3f\n"
      "  prepare+post 15,000 descriptors: %.0f us (p50; prepare alone %.0f us)\n"
      "  1 KiB READ + notification + reply: p50 %.1f us, p99 %.1f us\n",
      r["backend"].get<std::string>().c_str(), o.op.c_str(), o.blocks,
      static_cast<unsigned long long>(o.block_size), o.layers,
      static_cast<unsigned long long>(r["bytes"].get<uint64_t>()),
      static_cast<unsigned long long>(r["segments"].get<uint64_t>()), r["gbps"].get<double>(),
      r["gbps_p50"].get<double>(), r["p50_us"].get<double>(), r["p99_us"].get<double>(),
      r["baseline"].get<std::string>().c_str(), r["baseline_gbps"].get<double>(),
      r["rounds"].get<int>(), o.iters, r["ratio"].get<double>(), r["ratio_min"].get<double>(),
      r["ratio_max"].get<double>(), r["prep_post_15k_us"].get<double>(),
      r["prep_15k_us"].get<double>(), r["notify_rt_1k_p50_us"].get<double>(),
      r["notify_rt_1k_p99_us"].get<double>());
  if (o.json) std::printf("%s\n", r.dump().c_str());
  return 0;
}

}  // namespace kvbridge::transfer

// cuda_ipc/cuda_bench.cc — the cuda_ipc benchmark shared by `kvbridge xfer-bench --mem cuda` and
// the standalone cuda_ipc_bench (cuda_bench.h says what it measures).
#include "transfer/backends/cuda_ipc/cuda_bench.h"

#include <cuda_runtime.h>
#include <time.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <functional>
#include <numeric>
#include <random>
#include <sstream>
#include <string>
#include <vector>

#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/peer_link.h"

namespace kvbridge::cuda_ipc {
namespace {

using Args = CudaBenchOptions;

[[noreturn]] void Die(const std::string& what, const Status& st) {
  std::fprintf(stderr, "FATAL %s: %s\n", what.c_str(), st.ToString().c_str());
  std::exit(2);
}
#define CHECK_OK(expr)               \
  do {                               \
    ::kvbridge::Status st_ = (expr); \
    if (!st_.ok()) Die(#expr, st_);  \
  } while (0)
#define CUDA_OK(call) CHECK_OK(CudaStatus((call), #call))
template <typename T>
T Must(Result<T> r, const char* what) {
  if (!r.ok()) Die(what, r.status());
  return std::move(r).value();
}

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v[v.size() / 2];
}
double Percentile(std::vector<double> v, double p) {
  std::sort(v.begin(), v.end());
  size_t i = static_cast<size_t>(p * (v.size() - 1) + 0.5);
  return v[std::min(i, v.size() - 1)];
}

Message Call(Channel& ch, MsgType t, std::string_view payload) {
  CHECK_OK(ch.Send(t, payload));
  Message m = Must(ch.Recv(120000), "peer reply");
  if (m.type == MsgType::kError) Die("peer", InternalError(m.payload));
  return m;
}

struct Ctx {
  Args args;
  int peer_device = 0;
  Channel* ch = nullptr;
  CopyEngine* engine = nullptr;
  void* local = nullptr;
  void* remote = nullptr;
  cudaEvent_t ev0 = nullptr, ev1 = nullptr;
  bool failed = false;
  std::ostringstream table;
};

void PeerFill(Ctx& c, uint64_t seed) {
  Call(*c.ch, MsgType::kFill, EncodeU64s(std::vector<uint64_t>{seed}));
}

// Fills the source side with `src_seed` and the destination side with `poison_seed`.
void Prime(Ctx& c, CopyOp op, uint64_t src_seed, uint64_t poison_seed) {
  void* own = c.local;
  if (op == CopyOp::kRead) {
    PeerFill(c, src_seed);
    CHECK_OK(FillPattern(own, c.args.bytes, poison_seed, c.engine->stream()));
  } else {
    PeerFill(c, poison_seed);
    CHECK_OK(FillPattern(own, c.args.bytes, src_seed, c.engine->stream()));
  }
  CUDA_OK(cudaStreamSynchronize(c.engine->stream()));
}

uint64_t CheckDst(Ctx& c, CopyOp op, uint64_t bb, const std::vector<int32_t>& src_of,
                  uint64_t src_seed, uint64_t poison_seed) {
  if (op == CopyOp::kRead) {
    BlockRegion r{c.local, bb, src_of.size()};
    return Must(VerifyBlocks(r, src_of, src_seed, poison_seed, c.engine->stream()), "verify");
  }
  VerifySpec v{src_seed, poison_seed, bb, src_of};
  Message m = Call(*c.ch, MsgType::kVerify, v.Encode());
  return Must(DecodeU64s(m.payload), "count").at(0);
}

// Checks `run` once (poisoned destination, every byte compared), then times it `runs` times.
// Returns GB/s (bytes / median seconds / 1e9), or -1 when the check failed.
double Measure(Ctx& c, const std::string& name, CopyOp op, uint64_t bb,
               const std::vector<int32_t>& src_of, const std::function<void()>& run, bool warmup,
               uint64_t* seed) {
  const uint64_t src_seed = ++*seed * 1000003, poison_seed = ++*seed * 7919;
  Prime(c, op, src_seed, poison_seed);
  run();
  CUDA_OK(cudaStreamSynchronize(c.engine->stream()));
  CUDA_OK(cudaGetLastError());
  const uint64_t bad = CheckDst(c, op, bb, src_of, src_seed, poison_seed);
  if (bad != 0) {
    std::printf("CHECK FAILED: %s %s bb=%llu: %llu mismatched 8-byte words\n",
                std::string(CopyOpName(op)).c_str(), name.c_str(), (unsigned long long)bb,
                (unsigned long long)bad);
    c.failed = true;
    return -1;
  }
  if (warmup) run();
  std::vector<double> ms;
  for (int i = 0; i < c.args.runs; ++i) {
    CUDA_OK(cudaEventRecord(c.ev0, c.engine->stream()));
    run();
    CUDA_OK(cudaEventRecord(c.ev1, c.engine->stream()));
    CUDA_OK(cudaEventSynchronize(c.ev1));
    float t = 0;
    CUDA_OK(cudaEventElapsedTime(&t, c.ev0, c.ev1));
    ms.push_back(t);
  }
  return double(c.args.bytes) / (Median(ms) * 1e-3) / 1e9;
}

// One copy of the whole pool: cudaMemcpyAsync on one GPU, cudaMemcpyPeerAsync across two.
void ContiguousCopy(Ctx& c, CopyOp op, void* dst, const void* src, cudaStream_t s) {
  if (c.peer_device == c.args.device) {
    CUDA_OK(cudaMemcpyAsync(dst, src, c.args.bytes, cudaMemcpyDeviceToDevice, s));
    return;
  }
  const int dst_dev = op == CopyOp::kRead ? c.args.device : c.peer_device;
  const int src_dev = op == CopyOp::kRead ? c.peer_device : c.args.device;
  CUDA_OK(cudaMemcpyPeerAsync(dst, dst_dev, src, src_dev, c.args.bytes, s));
}

std::string Fmt(double gbs) {
  char b[32];
  if (gbs < 0) return "FAIL";
  std::snprintf(b, sizeof(b), gbs < 100 ? "%.2f" : "%.0f", gbs);
  return b;
}
std::string Ratio(double a, double base) {
  char b[32];
  if (a < 0 || base <= 0) return "-";
  std::snprintf(b, sizeof(b), "%.3f", a / base);
  return b;
}

void BandwidthPoint(Ctx& c, uint64_t bb, CopyOp op, uint64_t* seed) {
  const uint64_t n = c.args.bytes / bb;
  std::mt19937_64 rng(bb * 31 + static_cast<int>(op));
  std::vector<uint32_t> pl(n), pr(n);
  std::iota(pl.begin(), pl.end(), 0u);
  std::iota(pr.begin(), pr.end(), 0u);
  std::shuffle(pl.begin(), pl.end(), rng);
  std::shuffle(pr.begin(), pr.end(), rng);
  std::vector<BlockPair> pairs(n);
  std::vector<int32_t> src_of(n), identity(n);
  std::iota(identity.begin(), identity.end(), 0);
  for (uint64_t i = 0; i < n; ++i) {
    pairs[i] = {pl[i], pr[i]};
    if (op == CopyOp::kRead)
      src_of[pl[i]] = static_cast<int32_t>(pr[i]);
    else
      src_of[pr[i]] = static_cast<int32_t>(pl[i]);
  }
  BlockRegion local{c.local, bb, n}, remote{c.remote, bb, n};
  char* src = static_cast<char*>(op == CopyOp::kRead ? c.remote : c.local);
  char* dst = static_cast<char*>(op == CopyOp::kRead ? c.local : c.remote);
  cudaStream_t s = c.engine->stream();

  PreparedList prepared = Must(c.engine->Prepare(op, local, remote, pairs), "prepare");
  const double kernel = Measure(
      c, "kernel", op, bb, src_of,
      [&] {
        CopyHandle h = Must(c.engine->Post(prepared), "post");
        (void)h;  // completion is observed through the stream events
      },
      true, seed);
  const double kernel_up = Measure(
      c, "kernel+upload", op, bb, src_of,
      [&] {
        CopyHandle h = Must(c.engine->Post(op, local, remote, pairs), "post");
        (void)h;
      },
      true, seed);
  const double contig = Measure(
      c, "contiguous", op, bb, identity, [&] { ContiguousCopy(c, op, dst, src, s); }, true, seed);
  double per_block = -2, batch = -2;
  if (c.args.baselines) {
    std::vector<void*> dsts(n);
    std::vector<const void*> srcs(n);
    std::vector<size_t> sizes(n, bb);
    for (uint64_t i = 0; i < n; ++i) {
      const uint64_t sb = op == CopyOp::kRead ? pairs[i].remote : pairs[i].local;
      const uint64_t db = op == CopyOp::kRead ? pairs[i].local : pairs[i].remote;
      srcs[i] = src + sb * bb;
      dsts[i] = dst + db * bb;
    }
    per_block = Measure(
        c, "per-block memcpy", op, bb, src_of,
        [&] {
          for (uint64_t i = 0; i < n; ++i) {
            CUDA_OK(cudaMemcpyAsync(dsts[i], srcs[i], bb, cudaMemcpyDeviceToDevice, s));
          }
        },
        false, seed);
#if CUDART_VERSION >= 12080
    batch = Measure(
        c, "cudaMemcpyBatchAsync", op, bb, src_of,
        [&] {
          cudaMemcpyAttributes attr{};
          attr.srcAccessOrder = cudaMemcpySrcAccessOrderStream;
          size_t idx = 0;
          CUDA_OK(
              cudaMemcpyBatchAsync(dsts.data(), srcs.data(), sizes.data(), n, &attr, &idx, 1, s));
        },
        false, seed);
#endif
  }
  auto opt = [](double v) { return v == -2 ? std::string("n/a") : Fmt(v); };
  char line[512];
  std::snprintf(
      line, sizeof(line), "| %s | %llu KiB | %llu | %s | %s | %s | %s | %s | %s (%s) | %s (%s) |\n",
      std::string(CopyOpName(op)).c_str(), (unsigned long long)(bb / 1024), (unsigned long long)n,
      Fmt(kernel).c_str(), Ratio(kernel, contig).c_str(), Fmt(kernel_up).c_str(),
      Ratio(kernel_up, contig).c_str(), Fmt(contig).c_str(), opt(per_block).c_str(),
      Ratio(per_block, contig).c_str(), opt(batch).c_str(), Ratio(batch, contig).c_str());
  std::fputs(line, stdout);
  std::fflush(stdout);
  c.table << line;
}

void Latency(Ctx& c, uint64_t bb, CopyOp op) {
  const uint64_t n = c.args.bytes / bb;
  BlockRegion local{c.local, bb, n}, remote{c.remote, bb, n};
  std::mt19937_64 rng(99 + bb);
  std::vector<double> local_us;
  const int iters = c.args.lat_iters, warm = 100;
  for (int it = 0; it < iters + warm; ++it) {
    std::vector<BlockPair> pairs(64);
    for (int i = 0; i < 64; ++i) {
      // distinct destinations: block i*stride + random offset inside its stride
      const uint64_t stride = n / 64;
      pairs[i] = {static_cast<uint32_t>(i * stride + rng() % stride),
                  static_cast<uint32_t>(i * stride + rng() % stride)};
    }
    std::string note(16, '\0');
    const uint64_t id = static_cast<uint64_t>(it);
    const int64_t t0 = NowNs();
    std::memcpy(note.data(), &id, 8);
    std::memcpy(note.data() + 8, &t0, 8);
    PendingTransfer t = Must(PostToPeer(*c.engine, *c.ch, op, local, remote, pairs, note), "post");
    Status st;
    while (Progress(t, *c.ch, &st) == CopyState::kInProgress) {
    }
    CHECK_OK(st);
    if (it >= warm) local_us.push_back((NowNs() - t0) / 1e3);
  }
  Message m = Call(*c.ch, MsgType::kReport, {});
  std::vector<uint64_t> rep = Must(DecodeU64s(m.payload), "report");
  std::vector<double> notify_us;
  for (size_t i = 0; i + 2 < rep.size(); i += 3) {
    if (rep[i] >= static_cast<uint64_t>(warm))
      notify_us.push_back(static_cast<int64_t>(rep[i + 1]) / 1e3);
  }
  if (notify_us.size() != static_cast<size_t>(iters)) {
    std::printf("LATENCY: expected %d notifications, peer saw %zu\n", iters, notify_us.size());
    c.failed = true;
    return;
  }
  char line[256];
  std::snprintf(line, sizeof(line), "| %s | 64 x %llu KiB | %d | %.1f | %.1f | %.1f | %.1f |\n",
                std::string(CopyOpName(op)).c_str(), (unsigned long long)(bb / 1024), iters,
                Percentile(local_us, 0.5), Percentile(local_us, 0.99), Percentile(notify_us, 0.5),
                Percentile(notify_us, 0.99));
  std::fputs(line, stdout);
  c.table << line;
}

}  // namespace

int RunCudaBench(const CudaBenchOptions& a) {
  if (a.runs < 1 || a.bytes == 0 || a.bytes % 262144 != 0 || a.sizes.empty()) {
    std::fprintf(stderr, "cuda bench: --runs >= 1 and --bytes a positive multiple of 256 KiB\n");
    return 64;
  }
  for (uint64_t bb : a.sizes) {
    if (bb < 4096 || bb % 4096 != 0 || a.bytes % bb != 0 || a.bytes / bb < 64) {
      std::fprintf(stderr,
                   "cuda bench: block size %llu must be a multiple of 4 KiB dividing --bytes "
                   "into >= 64 blocks\n",
                   (unsigned long long)bb);
      return 64;
    }
  }
  Result<int> devices = CudaDeviceCount();
  if (!devices.ok()) {
    std::fprintf(stderr, "cuda bench: %s\n", devices.status().ToString().c_str());
    return 2;
  }
  const int peer_device = a.peer_device < 0 ? a.device : a.peer_device;
  if (a.device < 0 || a.device >= *devices || peer_device >= *devices) {
    std::fprintf(stderr, "cuda bench: devices %d and %d requested, %d present\n", a.device,
                 peer_device, *devices);
    return 2;
  }
  Ctx c;
  c.args = a;
  c.peer_device = peer_device;
  if (peer_device != a.device) {
    int fwd = 0, back = 0;
    CUDA_OK(cudaDeviceCanAccessPeer(&fwd, a.device, peer_device));
    CUDA_OK(cudaDeviceCanAccessPeer(&back, peer_device, a.device));
    std::printf("cudaDeviceCanAccessPeer(%d -> %d) = %d, (%d -> %d) = %d\n", a.device, peer_device,
                fwd, peer_device, a.device, back);
    if (!fwd || !back) {
      std::printf("RESULT: no peer access between GPU %d and GPU %d (no host-staged fallback)\n",
                  a.device, peer_device);
      return 3;
    }
  }
  CUDA_OK(cudaSetDevice(a.device));
  cudaDeviceProp prop{};
  CUDA_OK(cudaGetDeviceProperties(&prop, a.device));
  int rt = 0, drv = 0;
  CUDA_OK(cudaRuntimeGetVersion(&rt));
  CUDA_OK(cudaDriverGetVersion(&drv));
  std::printf(
      "device %d: %s, %d SMs, L2 %d MiB; CUDA runtime %d, driver %d; %llu MiB per point; "
      "local pool + kernels on GPU %d, peer pool on GPU %d; contiguous baseline = %s\n",
      a.device, prop.name, prop.multiProcessorCount, prop.l2CacheSize >> 20, rt, drv,
      (unsigned long long)(a.bytes >> 20), a.device, peer_device,
      peer_device == a.device ? "cudaMemcpyAsync" : "cudaMemcpyPeerAsync");
#if CUDART_VERSION < 12080
  std::printf("cudaMemcpyBatchAsync: absent (built against CUDA %d < 12.8)\n", CUDART_VERSION);
#endif

  PeerProcess peer =
      Must(SpawnPeer(a.peer_binary.empty() ? DefaultPeerBinary() : a.peer_binary, peer_device),
           "spawn peer");
  c.ch = peer.channel.get();
  Message hm = Call(*c.ch, MsgType::kAlloc, EncodeU64s(std::vector<uint64_t>{a.bytes}));
  IpcHandle handle = Must(IpcHandle::Parse(hm.payload), "handle");
  auto imported = Must(ImportedPool::Open(handle, a.device), "open peer pool");
  auto pool = Must(DevicePool::Create(a.device, a.bytes), "local pool");
  c.local = pool->data();
  c.remote = imported->data();
  auto engine = Must(CopyEngine::Create({.device = a.device}), "engine");
  c.engine = engine.get();
  std::printf("persistent grid: %d CTAs x 256 threads (%d per SM)\n", engine->grid_ctas(),
              engine->grid_ctas() / engine->sm_count());
  CUDA_OK(cudaEventCreate(&c.ev0));
  CUDA_OK(cudaEventCreate(&c.ev1));
  uint64_t seed = 1;

  c.table
      << "GPU " << a.device << " (local pool, kernels) <-> GPU " << peer_device
      << " (peer pool); contiguous = "
      << (peer_device == a.device ? "cudaMemcpyAsync" : "cudaMemcpyPeerAsync") << "\n\n"
      << "| op | block | blocks | kernel GB/s | x contig | kernel+list upload GB/s | x contig | "
         "contiguous GB/s | per-block memcpy GB/s (x) | cudaMemcpyBatchAsync GB/s (x) |\n"
         "|---|---|---|---|---|---|---|---|---|---|\n";
  std::fputs(c.table.str().c_str(), stdout);
  for (uint64_t bb : a.sizes) {
    for (CopyOp op : {CopyOp::kRead, CopyOp::kWrite}) BandwidthPoint(c, bb, op, &seed);
  }

  std::string lat_hdr =
      "\n| op | transfer | iterations | post->event p50 us | p99 us | post->notified p50 us | p99 "
      "us |\n"
      "|---|---|---|---|---|---|---|\n";
  c.table << lat_hdr;
  std::fputs(lat_hdr.c_str(), stdout);
  if (a.lat_iters > 0) {
    for (uint64_t bb : {uint64_t{4096}, uint64_t{16384}, uint64_t{65536}}) {
      for (CopyOp op : {CopyOp::kRead, CopyOp::kWrite}) Latency(c, bb, op);
    }
  }

  if (a.sweep) {
    std::string hdr =
        "\n| variant (unroll, streaming, CTAs/SM) | op | block | kernel GB/s | x contig "
        "|\n|---|---|---|---|---|\n";
    c.table << hdr;
    std::fputs(hdr.c_str(), stdout);
    for (uint64_t bb : {uint64_t{4096}, uint64_t{16384}}) {
      for (CopyOp op : {CopyOp::kRead, CopyOp::kWrite}) {
        const uint64_t n = a.bytes / bb;
        std::vector<int32_t> identity(n);
        std::iota(identity.begin(), identity.end(), 0);
        const double contig = Measure(
            c, "contiguous", op, bb, identity,
            [&] {
              char* src = static_cast<char*>(op == CopyOp::kRead ? c.remote : c.local);
              char* dst = static_cast<char*>(op == CopyOp::kRead ? c.local : c.remote);
              ContiguousCopy(c, op, dst, src, c.engine->stream());
            },
            true, &seed);
        for (int unroll : {4, 8}) {
          for (bool streaming : {false, true}) {
            for (int ctas : {0, 2}) {
              auto e = Must(CopyEngine::Create({.device = a.device,
                                                .unroll = unroll,
                                                .ctas_per_sm = ctas,
                                                .streaming = streaming}),
                            "variant engine");
              std::mt19937_64 rng(bb * 7 + 3);
              std::vector<uint32_t> pl(n), pr(n);
              std::iota(pl.begin(), pl.end(), 0u);
              std::iota(pr.begin(), pr.end(), 0u);
              std::shuffle(pl.begin(), pl.end(), rng);
              std::shuffle(pr.begin(), pr.end(), rng);
              std::vector<BlockPair> pairs(n);
              std::vector<int32_t> src_of(n);
              for (uint64_t i = 0; i < n; ++i) {
                pairs[i] = {pl[i], pr[i]};
                if (op == CopyOp::kRead)
                  src_of[pl[i]] = static_cast<int32_t>(pr[i]);
                else
                  src_of[pr[i]] = static_cast<int32_t>(pl[i]);
              }
              BlockRegion local{c.local, bb, n}, remote{c.remote, bb, n};
              PreparedList pl2 = Must(e->Prepare(op, local, remote, pairs), "prepare");
              // Time on the variant engine's stream by swapping it in for Measure's events.
              CopyEngine* saved = c.engine;
              c.engine = e.get();
              const double g = Measure(
                  c, "variant", op, bb, src_of,
                  [&] {
                    CopyHandle h = Must(e->Post(pl2), "post");
                    (void)h;
                  },
                  true, &seed);
              c.engine = saved;
              char line[256];
              std::snprintf(line, sizeof(line), "| %d, %s, %d | %s | %llu KiB | %s | %s |\n",
                            unroll, streaming ? "cs" : "default", e->grid_ctas() / e->sm_count(),
                            std::string(CopyOpName(op)).c_str(), (unsigned long long)(bb / 1024),
                            Fmt(g).c_str(), Ratio(g, contig).c_str());
              std::fputs(line, stdout);
              c.table << line;
            }
          }
        }
      }
    }
  }

  if (!a.out.empty()) {
    std::ofstream f(a.out);
    f << c.table.str();
  }
  engine.reset();
  imported.reset();
  CHECK_OK(peer.Stop(10000));
  std::printf("%s\n", c.failed ? "RESULT: FAILED CHECKS" : "RESULT: all checks passed");
  return c.failed ? 1 : 0;
}

}  // namespace kvbridge::cuda_ipc

// cuda_ipc_peer — the other process of a cuda_ipc pair, for tests and the benchmark.
//
//   cuda_ipc_peer --fd 3 --device 0
//
// Owns one device pool (kAlloc), exports its IPC handle, fills and verifies it on request, and
// records each notification's arrival (latency from the sender's CLOCK_MONOTONIC stamp, and,
// when the notification carries a VerifySpec, the pool's state at that moment).
#include <time.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "kvbridge/transfer/backend.h"
#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_ipc_backend.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/peer_link.h"

namespace kvbridge::cuda_ipc {
namespace {

int64_t NowNs() {
  timespec ts;
  clock_gettime(CLOCK_MONOTONIC, &ts);
  return int64_t{ts.tv_sec} * 1000000000 + ts.tv_nsec;
}

Result<uint64_t> Verify(const DevicePool& pool, const VerifySpec& v, cudaStream_t s) {
  if (v.block_bytes == 0 || v.src_of.size() * v.block_bytes > pool.bytes()) {
    return InvalidArgumentError("verify spec larger than the pool");
  }
  BlockRegion r{pool.data(), v.block_bytes, v.src_of.size()};
  return VerifyBlocks(r, v.src_of, v.src_seed, v.poison_seed, s);
}

int Serve(int fd, int device) {
  Channel ch(fd);
  std::unique_ptr<DevicePool> pool;
  cudaStream_t stream = nullptr;
  std::vector<uint64_t> report;  // triples: id, latency_ns, mismatches (or -1)
  // kServeBackend: a transfer Backend over the pool (declared after the pool: destroyed first).
  transfer::KvRegistration reg;
  std::mutex msg_mu;
  std::string messages;
  std::unique_ptr<transfer::Backend> backend;
  auto reply_error = [&](const Status& st) { return ch.Send(MsgType::kError, st.ToString()); };
  while (true) {
    Result<Message> m = ch.Recv(-1);
    if (!m.ok()) return m.status().code() == StatusCode::kUnavailable ? 0 : 2;
    Status sent;
    switch (m->type) {
      case MsgType::kAlloc: {
        uint64_t bytes = 0;
        if (m->payload.size() != 8) {
          sent = reply_error(InvalidArgumentError("kAlloc: bad payload"));
          break;
        }
        std::memcpy(&bytes, m->payload.data(), 8);
        pool.reset();
        auto p = DevicePool::Create(device, bytes);
        if (!p.ok()) {
          sent = reply_error(p.status());
          break;
        }
        pool = std::move(*p);
        if (stream == nullptr &&
            cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess) {
          sent = reply_error(InternalError("cudaStreamCreate"));
          break;
        }
        auto h = pool->Export();
        sent = h.ok() ? ch.Send(MsgType::kHandle, h->Serialize()) : reply_error(h.status());
        break;
      }
      case MsgType::kFill: {
        uint64_t seed = 0;
        if (!pool || m->payload.size() != 8) {
          sent = reply_error(FailedPreconditionError("kFill: no pool or bad payload"));
          break;
        }
        std::memcpy(&seed, m->payload.data(), 8);
        Status st = FillPattern(pool->data(), pool->bytes() / 16 * 16, seed, stream);
        if (st.ok()) st = CudaStatus(cudaStreamSynchronize(stream), "fill sync");
        sent = st.ok() ? ch.Send(MsgType::kOk, {}) : reply_error(st);
        break;
      }
      case MsgType::kVerify: {
        auto spec = VerifySpec::Decode(m->payload);
        if (!pool || !spec.ok()) {
          sent = reply_error(pool ? spec.status() : FailedPreconditionError("no pool"));
          break;
        }
        auto bad = Verify(*pool, *spec, stream);
        sent = bad.ok() ? ch.Send(MsgType::kCount, EncodeU64s(std::vector<uint64_t>{*bad}))
                        : reply_error(bad.status());
        break;
      }
      case MsgType::kNotify: {
        const int64_t now = NowNs();
        if (m->payload.size() < 16) break;  // malformed: ignored (no reply on this path)
        uint64_t id = 0;
        int64_t t0 = 0;
        std::memcpy(&id, m->payload.data(), 8);
        std::memcpy(&t0, m->payload.data() + 8, 8);
        int64_t mismatches = -1;
        if (m->payload.size() > 16 && pool) {
          auto spec = VerifySpec::Decode(std::string_view(m->payload).substr(16));
          auto bad = spec.ok() ? Verify(*pool, *spec, stream) : Result<uint64_t>(spec.status());
          mismatches = bad.ok() ? static_cast<int64_t>(*bad) : -2;
        }
        report.push_back(id);
        report.push_back(static_cast<uint64_t>(now - t0));
        report.push_back(static_cast<uint64_t>(mismatches));
        break;
      }
      case MsgType::kServeBackend: {
        uint64_t layers = 0;
        if (!pool || m->payload.size() != 8) {
          sent = reply_error(FailedPreconditionError("kServeBackend: no pool or bad payload"));
          break;
        }
        std::memcpy(&layers, m->payload.data(), 8);
        if (layers == 0 || pool->bytes() % (layers * 16) != 0) {
          sent = reply_error(InvalidArgumentError("kServeBackend: pool does not split evenly"));
          break;
        }
        reg.layers.clear();
        for (uint64_t i = 0; i < layers; ++i) {
          transfer::MemoryRegion r;
          r.kind = transfer::MemoryKind::kCuda;
          r.device = device;
          r.bytes = pool->bytes() / layers;
          r.base = static_cast<uint8_t*>(pool->data()) + i * r.bytes;
          reg.layers.push_back(r);
        }
        transfer::BackendContext ctx;
        ctx.agent_name = "cuda-ipc-peer";
        ctx.incarnation = (static_cast<uint64_t>(getpid()) << 20) ^ static_cast<uint64_t>(NowNs());
        ctx.on_message = [&](const std::string& from, std::string bytes) {
          std::lock_guard<std::mutex> l(msg_mu);
          messages += from + ":" + bytes + "\n";
        };
        backend = transfer::MakeCudaIpcBackend(ctx);
        auto ep = backend->Start(reg);
        if (!ep.ok() || ep->empty()) {
          sent = reply_error(ep.ok() ? InternalError("backend refused the registration")
                                     : ep.status());
          break;
        }
        std::string out = EncodeU64s(std::vector<uint64_t>{ctx.incarnation}) + *ep;
        sent = ch.Send(MsgType::kEndpoint, out);
        break;
      }
      case MsgType::kMessages: {
        std::lock_guard<std::mutex> l(msg_mu);
        sent = ch.Send(MsgType::kMessages, messages);
        break;
      }
      case MsgType::kReport:
        sent = ch.Send(MsgType::kReportList, EncodeU64s(report));
        report.clear();
        break;
      case MsgType::kExit:
        if (backend) backend->Shutdown();
        backend.reset();
        (void)ch.Send(MsgType::kOk, {});
        pool.reset();
        if (stream) cudaStreamDestroy(stream);
        return 0;
      default:
        sent = reply_error(InvalidArgumentError("unknown message type"));
    }
    if (!sent.ok()) return sent.code() == StatusCode::kUnavailable ? 0 : 3;
  }
}

}  // namespace
}  // namespace kvbridge::cuda_ipc

int main(int argc, char** argv) {
  int fd = -1;
  int device = 0;
  for (int i = 1; i + 1 < argc; i += 2) {
    if (std::strcmp(argv[i], "--fd") == 0) fd = std::atoi(argv[i + 1]);
    if (std::strcmp(argv[i], "--device") == 0) device = std::atoi(argv[i + 1]);
  }
  if (fd < 0) {
    std::fprintf(stderr, "usage: cuda_ipc_peer --fd N [--device D]\n");
    return 64;
  }
  return kvbridge::cuda_ipc::Serve(fd, device);
}

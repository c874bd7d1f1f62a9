// cuda_agent_peer — the other process of tests/gpu/cuda_agent_test: a TransferAgent whose KV
// cache lives in device memory (MemoryKind::kCuda, one cudaMalloc pool), served by the cuda_ipc
// backend. Driven over a socketpair (cuda_ipc/peer_link.h framing):
//
//   cuda_agent_peer --fd 3 --device N
//
//   kStart (text "name num_layers num_kv_heads head_dim block_size num_blocks fingerprint
//          [cluster_token]") -> kEndpoint: EncodeMetadata of the registered agent
//   kFill (u64 seed) -> kOk            whole pool = FillPattern(seed)
//   kVerify (VerifySpec over the pool seen as units of spec.block_bytes) -> kCount
//   kMessages -> one line per notification received: "transfer_id payload mismatches"
//   kExit -> kOk, exits 0
//
// A notification whose payload starts with "verify:" carries a VerifySpec that is checked
// against the pool the moment it arrives (mismatches, -1 when none asked); one that wants a reply
// is answered "held:<transfer_id>".
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <mutex>
#include <sstream>
#include <string>

#include "kvbridge/transfer/agent.h"
#include "kvbridge/transfer/metadata.h"
#include "transfer/backends/cuda_ipc/block_copy.h"
#include "transfer/backends/cuda_ipc/cuda_status.h"
#include "transfer/backends/cuda_ipc/peer_link.h"

namespace kvbridge::cuda_ipc {
namespace {

constexpr auto kStart = static_cast<MsgType>(30);

int Serve(int fd, int device) {
  Channel ch(fd);
  std::unique_ptr<DevicePool> pool;
  cudaStream_t stream = nullptr;  // used by the main thread only
  cudaStream_t notify_stream = nullptr;
  std::mutex mu;
  std::string notes;
  std::unique_ptr<transfer::TransferAgent> agent;  // destroyed before the pool
  auto reply_error = [&](const Status& st) { return ch.Send(MsgType::kError, st.ToString()); };
  auto verify = [&](const VerifySpec& v, cudaStream_t s) -> Result<uint64_t> {
    if (!pool || v.block_bytes == 0 || v.src_of.size() * v.block_bytes > pool->bytes()) {
      return InvalidArgumentError("verify spec larger than the pool");
    }
    return VerifyBlocks({pool->data(), v.block_bytes, v.src_of.size()}, v.src_of, v.src_seed,
                        v.poison_seed, s);
  };
  while (true) {
    Result<Message> m = ch.Recv(-1);
    if (!m.ok()) return m.status().code() == StatusCode::kUnavailable ? 0 : 2;
    Status sent;
    // kStart is this helper's own type (not in MsgType): mapped to a switch label below.
    const uint32_t type = static_cast<uint32_t>(m->type);
    switch (type) {
      case static_cast<uint32_t>(kStart): {
        std::istringstream in(m->payload);
        std::string name, fingerprint;
        PagedKvLayout l;
        in >> name >> l.num_layers >> l.num_kv_heads >> l.head_dim >> l.block_size >>
            l.num_blocks >> fingerprint;
        std::string token;
        if (in) std::getline(in >> std::ws, token);  // optional: the agent's cluster token
        if (in.fail() && !in.eof()) in.clear();
        if (name.empty() || fingerprint.empty() || agent) {
          sent = reply_error(InvalidArgumentError("kStart: bad payload or started twice"));
          break;
        }
        auto p = DevicePool::Create(device, l.LayerBytes() * l.num_layers);
        if (!p.ok()) {
          sent = reply_error(p.status());
          break;
        }
        pool = std::move(*p);
        if (cudaStreamCreateWithFlags(&stream, cudaStreamNonBlocking) != cudaSuccess ||
            cudaStreamCreateWithFlags(&notify_stream, cudaStreamNonBlocking) != cudaSuccess) {
          sent = reply_error(InternalError("cudaStreamCreate"));
          break;
        }
        transfer::AgentConfig cfg;
        cfg.name = name;
        cfg.backends = {"cuda_ipc"};
        cfg.force_backend = "cuda_ipc";
        cfg.model_fingerprint = fingerprint;
        cfg.peer_timeout_ms = 2000;
        cfg.cluster_token = token;
        auto a = transfer::TransferAgent::Create(cfg);
        if (!a.ok()) {
          sent = reply_error(a.status());
          break;
        }
        agent = std::move(*a);
        transfer::TransferAgent* ag = agent.get();
        agent->SetNotificationHandler([&, ag, device](transfer::Notification n) {
          cudaSetDevice(device);  // backend reader thread: its current device is 0
          int64_t mismatches = -1;
          if (n.payload.rfind("verify:", 0) == 0) {
            auto spec = VerifySpec::Decode(std::string_view(n.payload).substr(7));
            auto bad = spec.ok() ? verify(*spec, notify_stream) : Result<uint64_t>(spec.status());
            mismatches = bad.ok() ? static_cast<int64_t>(*bad) : -2;
          }
          {
            std::lock_guard<std::mutex> l(mu);
            const bool verified = n.payload.rfind("verify:", 0) == 0;
            notes += n.transfer_id + " " + (verified ? std::string("verify") : n.payload) + " " +
                     std::to_string(mismatches) + "\n";
          }
          if (n.wants_reply) (void)ag->Reply(n, "held:" + n.transfer_id);
        });
        Status st = agent->RegisterMemory(
            transfer::KvRegistration::FromDeviceMemory(l, pool->data(), device));
        if (!st.ok()) {
          sent = reply_error(st);
          break;
        }
        sent = ch.Send(MsgType::kEndpoint, transfer::EncodeMetadata(*agent->Metadata()));
        break;
      }
      case static_cast<uint32_t>(MsgType::kFill): {
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
      case static_cast<uint32_t>(MsgType::kVerify): {
        auto spec = VerifySpec::Decode(m->payload);
        auto bad = spec.ok() ? verify(*spec, stream) : Result<uint64_t>(spec.status());
        sent = bad.ok() ? ch.Send(MsgType::kCount, EncodeU64s(std::vector<uint64_t>{*bad}))
                        : reply_error(bad.status());
        break;
      }
      case static_cast<uint32_t>(MsgType::kMessages): {
        std::lock_guard<std::mutex> l(mu);
        sent = ch.Send(MsgType::kMessages, notes);
        break;
      }
      case static_cast<uint32_t>(MsgType::kExit):
        agent.reset();
        (void)ch.Send(MsgType::kOk, {});
        pool.reset();
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
    std::fprintf(stderr, "usage: cuda_agent_peer --fd N [--device D]\n");
    return 64;
  }
  return kvbridge::cuda_ipc::Serve(fd, device);
}

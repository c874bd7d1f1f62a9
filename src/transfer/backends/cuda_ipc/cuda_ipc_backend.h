// cuda_ipc/cuda_ipc_backend.h — the transfer agent's backend for CUDA device memory of
// processes on one host: registered KV layers (MemoryKind::kCuda) are exported as CUDA IPC
// handles at handshake, the initiator maps them and moves a job's segments with one
// gather/scatter kernel launch (block_copy.h); completion by CUDA event. One-sided: the target
// is never asked, so use it only between trusted peers. A Unix socket (abstract namespace)
// carries the handshake and agent messages; its closing tells that the peer died.
//
//   BackendContext ctx; ctx.agent_name = "decode-0/rank0"; ctx.incarnation = inc;
//   auto b = MakeCudaIpcBackend(ctx);
//   ASSIGN_OR_RETURN(std::string endpoint, b->Start(reg));   // "" when reg is not CUDA memory
//   ASSIGN_OR_RETURN(auto peer, b->Connect(peer_metadata));   // endpoints["cuda_ipc"]
//   peer->Submit(job);                                        // job->finish once, after the event
//
// Thread-safety: as Backend (any thread); callbacks run on the backend's reader and completion
// threads.
#pragma once

#include <memory>

#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer {

std::unique_ptr<Backend> MakeCudaIpcBackend(const BackendContext& ctx);

}  // namespace kvbridge::transfer

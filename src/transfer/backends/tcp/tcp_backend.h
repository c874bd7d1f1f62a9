// src/transfer/backends/tcp/tcp_backend.h — two-sided backend for hosts without RDMA.
//
// The initiator sends READ/WRITE requests naming (layer, offset, length) segments and the
// transfer_id; the target validates every segment against its registration, asks the hold
// check, then streams the bytes straight from / into registered memory with sendmsg/recvmsg
// scatter-gather (no staging copy). Several connections per peer; a job is striped over them.
// Peer failure: connection close, or no progress on an outstanding request for
// peer_timeout_ms, fails every pending request with Unavailable and marks the peer dead.
#pragma once

#include <memory>

#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer {

std::unique_ptr<Backend> MakeTcpBackend(const BackendContext& ctx);

}  // namespace kvbridge::transfer

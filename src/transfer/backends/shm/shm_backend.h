// src/transfer/backends/shm/shm_backend.h — same-host backend: the target's memfd regions are
// mapped by the initiator, which copies with memcpy (one-sided: trusted peers only; the target
// is never asked). A unix socket (abstract namespace) carries the handshake (fds by
// SCM_RIGHTS) and agent messages; its closing tells that the peer died.
#pragma once

#include <memory>

#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer {

std::unique_ptr<Backend> MakeShmBackend(const BackendContext& ctx);

}  // namespace kvbridge::transfer

// src/transfer/backends/ucx/ucx_backend.h — UCX (UCP) backend: one-sided put/get with packed
// remote keys (trusted peers only: the target is never asked), active messages for agent
// messages. Transports come from UCX_TLS (default here "sm,self,tcp" when unset). A peer's
// failure reaches us through the endpoint's error handler (UCP_ERR_HANDLING_MODE_PEER).
#pragma once

#include <memory>

#include "kvbridge/transfer/backend.h"

namespace kvbridge::transfer {

Result<std::unique_ptr<Backend>> MakeUcxBackend(const BackendContext& ctx);

}  // namespace kvbridge::transfer

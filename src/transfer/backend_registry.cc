#include "transfer/backend_registry.h"

#include "kvbridge/transfer/agent.h"
#include "transfer/backends/shm/shm_backend.h"
#include "transfer/backends/tcp/tcp_backend.h"
#if KVBRIDGE_HAVE_UCX
#include "transfer/backends/ucx/ucx_backend.h"
#endif
#if KVBRIDGE_HAVE_CUDA_IPC
#include "transfer/backends/cuda_ipc/cuda_ipc_backend.h"
#endif

namespace kvbridge::transfer {

Result<std::unique_ptr<Backend>> MakeBackend(std::string_view name, const BackendContext& ctx) {
  if (name == "shm") return MakeShmBackend(ctx);
  if (name == "tcp") return MakeTcpBackend(ctx);
#if KVBRIDGE_HAVE_UCX
  if (name == "ucx") return MakeUcxBackend(ctx);
#endif
#if KVBRIDGE_HAVE_CUDA_IPC
  if (name == "cuda_ipc") return MakeCudaIpcBackend(ctx);
#endif
  return NotFoundError("transfer backend '" + std::string(name) + "' is not built in");
}

std::vector<std::string> AvailableBackends() {
  std::vector<std::string> v = {"shm", "tcp"};
#if KVBRIDGE_HAVE_UCX
  v.push_back("ucx");
#endif
#if KVBRIDGE_HAVE_CUDA_IPC
  v.push_back("cuda_ipc");
#endif
  return v;
}

}  // namespace kvbridge::transfer

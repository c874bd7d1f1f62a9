// cuda_ipc/cuda_bench.h — the cuda_ipc benchmark (issues 10 and 12), one implementation shared by
// `kvbridge xfer-bench --mem cuda --backend cuda_ipc` and the standalone `cuda_ipc_bench` (which
// builds on the device machine without our Debian dependencies).
//
// Two processes: this one owns the local pool and runs the kernels on GPU `device`; a spawned
// cuda_ipc_peer owns the peer pool on GPU `peer_device` and exports it by CUDA IPC. For every
// block size: READ (pull kernel: gathers the peer's blocks into local ones) and WRITE (push
// kernel: scatters local blocks into the peer's pool) of every block of a `bytes` pool, local
// and remote ids in independent random permutations; in the same run the baselines: one
// contiguous copy of the same bytes (cudaMemcpyAsync on one GPU, cudaMemcpyPeerAsync across
// two), one cudaMemcpyAsync per block, cudaMemcpyBatchAsync (CUDA >= 12.8). Every method is
// checked first (destination poisoned, every byte compared on the GPU). GB/s = bytes moved
// (counted once) / median of `runs` timed runs (CUDA events). Then the latency of a 64-block
// transfer including its notification (p50/p99), and optionally a sweep of kernel variants.
//
//   CudaBenchOptions o; o.device = 0; o.peer_device = 1; o.out = "table.md";
//   int rc = RunCudaBench(o);   // 0: all checks passed
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvbridge::cuda_ipc {

struct CudaBenchOptions {
  uint64_t bytes = uint64_t{2} << 30;  ///< Pool size on each side = bytes moved per point.
  int runs = 5;                        ///< Timed runs per point (median reported).
  std::vector<uint64_t> sizes = {4096, 8192, 16384, 32768, 65536, 131072, 262144};
  int device = 0;           ///< GPU of the local pool and the kernels.
  int peer_device = -1;     ///< GPU of the peer pool; -1 = `device`.
  int lat_iters = 2000;     ///< 64-block latency iterations per point (0 = skip).
  bool sweep = false;       ///< Also time kernel variants (unroll, cache hints, CTAs/SM).
  bool baselines = true;    ///< Per-block memcpy and cudaMemcpyBatchAsync (slow at small blocks).
  std::string out;          ///< Markdown table written here too (empty = stdout only).
  std::string peer_binary;  ///< cuda_ipc_peer; empty = DefaultPeerBinary().
};

/// Runs the benchmark, printing as it goes. Returns 0 when every check passed, 1 when a check
/// failed, 2 when no usable GPU / a CUDA call failed, 3 when the two GPUs have no peer access,
/// 64 for bad options. Not thread-safe (one run per process).
int RunCudaBench(const CudaBenchOptions& options);

}  // namespace kvbridge::cuda_ipc

// src/transfer/xfer_bench.h — `kvbridge xfer-bench`: the transfer engine's benchmark (internal).
#pragma once

#include <cstdint>
#include <string>
#include <vector>

namespace kvbridge::transfer {

struct XferBenchOptions {
  std::string backend = "shm";  ///< shm | tcp | ucx | cuda_ipc (with mem = "cuda")
  /// "host": the agent benchmark below. "cuda": device pools and the cuda_ipc kernels
  /// (transfer/backends/cuda_ipc/cuda_bench.h); needs a build with KVBRIDGE_WITH_CUDA.
  std::string mem = "host";
  std::string op = "read";      ///< read | write
  uint64_t block_size = 16384;  ///< bytes per block (K+V of one layer); multiple of 128
  int blocks = 4096;            ///< blocks per transfer (scattered over a pool of 2x)
  int layers = 1;
  int iters = 10;  ///< timed transfers per round (and as many baseline runs per round)
  /// Rounds of `iters` pairs (one transfer, one baseline run; odd rounds baseline first): each
  /// round's ratio = baseline best / transfer best of that round; reported: the median over rounds
  /// and its min-max (host memory only; >= 1).
  int rounds = 5;
  std::string peer;  ///< HOST:PORT of a running `xfer-bench --serve`; empty = spawn one
  bool json = false;
  int copy_threads = 1;
  int tcp_connections = 2;
  // mem = "cuda" (CudaBenchOptions): block sizes, pool bytes per point, timed runs, GPUs.
  std::vector<uint64_t> cuda_sizes = {4096, 8192, 16384, 32768, 65536, 131072, 262144};
  uint64_t cuda_bytes = uint64_t{2} << 30;
  int cuda_runs = 5;
  int device = 0;
  int peer_device = -1;  ///< -1 = same GPU as `device`
  int lat_iters = 2000;
  bool sweep = false;
  bool no_baselines = false;
  std::string out;  ///< Markdown table file (cuda mode)
  /// cuda: measure the TransferAgent path (cuda_ipc backend) with --op/--block-size/--blocks/
  /// --layers/--iters instead of the kernel benchmark.
  bool agent = false;
  // Peer mode.
  bool serve = false;
  std::string listen = "127.0.0.1:0";
};

/// Runs the benchmark (or the peer when options.serve); returns the process exit code.
/// mem = "cuda" without CUDA compiled in: a clear error and exit code 2.
int RunXferBench(const XferBenchOptions& options);

}  // namespace kvbridge::transfer

// src/transfer/xfer_bench.h — `kvbridge xfer-bench`: the transfer engine's benchmark (internal).
#pragma once

#include <cstdint>
#include <string>

namespace kvbridge::transfer {

struct XferBenchOptions {
  std::string backend = "shm";  ///< shm | tcp | ucx
  std::string op = "read";      ///< read | write
  uint64_t block_size = 16384;  ///< bytes per block (K+V of one layer); multiple of 128
  int blocks = 4096;            ///< blocks per transfer (scattered over a pool of 2x)
  int layers = 1;
  int iters = 10;
  std::string peer;  ///< HOST:PORT of a running `xfer-bench --serve`; empty = spawn one
  bool json = false;
  int copy_threads = 1;
  int tcp_connections = 2;
  // Peer mode.
  bool serve = false;
  std::string listen = "127.0.0.1:0";
};

/// Runs the benchmark (or the peer when options.serve); returns the process exit code.
int RunXferBench(const XferBenchOptions& options);

}  // namespace kvbridge::transfer

// cuda_ipc_bench — the standalone form of `kvbridge xfer-bench --mem cuda` (same code:
// cuda_bench.h), for the device machine, where only CUDA, CMake and ninja exist.
//
//   cuda_ipc_bench [--bytes 2147483648] [--runs 5] [--sizes 4096,16384,...] [--device 0]
//                  [--peer-device 1] [--lat-iters 2000] [--sweep] [--no-baselines] [--out t.md]
#include <cstdio>
#include <sstream>
#include <stdexcept>
#include <string>

#include "transfer/backends/cuda_ipc/cuda_bench.h"

int main(int argc, char** argv) {
  kvbridge::cuda_ipc::CudaBenchOptions a;
  try {
    for (int i = 1; i < argc; ++i) {
      const std::string k = argv[i];
      auto next = [&]() -> std::string {
        if (i + 1 >= argc) throw std::invalid_argument("missing value for " + k);
        return argv[++i];
      };
      if (k == "--bytes") {
        a.bytes = std::stoull(next());
      } else if (k == "--runs") {
        a.runs = std::stoi(next());
      } else if (k == "--device") {
        a.device = std::stoi(next());
      } else if (k == "--peer-device") {
        a.peer_device = std::stoi(next());
      } else if (k == "--lat-iters") {
        a.lat_iters = std::stoi(next());
      } else if (k == "--sweep") {
        a.sweep = true;
      } else if (k == "--no-baselines") {
        a.baselines = false;
      } else if (k == "--out") {
        a.out = next();
      } else if (k == "--sizes") {
        a.sizes.clear();
        std::stringstream ss(next());
        std::string tok;
        while (std::getline(ss, tok, ',')) a.sizes.push_back(std::stoull(tok));
      } else {
        throw std::invalid_argument("unknown argument " + k);
      }
    }
  } catch (const std::exception& e) {
    std::fprintf(stderr, "cuda_ipc_bench: %s\n", e.what());
    return 64;
  }
  return kvbridge::cuda_ipc::RunCudaBench(a);
}

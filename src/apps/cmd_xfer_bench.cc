// `kvbridge xfer-bench`: the transfer engine's two-process benchmark (docs/transfer.md).
#include <memory>

#include "apps/command_registry.h"
#include "transfer/xfer_bench.h"

namespace {
const bool kRegistered = kvbridge::apps::RegisterCommand(
    "xfer-bench", "Benchmark KV block READ/WRITE between two processes",
    [](CLI::App& sub) -> kvbridge::apps::CommandMain {
      auto o = std::make_shared<kvbridge::transfer::XferBenchOptions>();
      sub.add_option("--backend", o->backend, "shm | tcp | ucx | cuda_ipc (with --mem cuda)")
          ->capture_default_str();
      sub.add_option("--mem", o->mem,
                     "host | cuda (device pools, cuda_ipc kernels vs memcpy baselines; needs a "
                     "CUDA build and a GPU)")
          ->capture_default_str();
      sub.add_option("--op", o->op, "read | write")->capture_default_str();
      sub.add_option("--block-size", o->block_size, "bytes per block (K+V, one layer)")
          ->capture_default_str();
      sub.add_option("--blocks", o->blocks, "blocks per transfer")->capture_default_str();
      sub.add_option("--layers", o->layers, "layers per transfer")->capture_default_str();
      sub.add_option("--iters", o->iters, "timed transfers (per round on host memory)")
          ->capture_default_str();
      sub.add_option("--rounds", o->rounds,
                     "host: rounds alternating the transfer and its baseline; the ratio "
                     "reported is the median over rounds with its min-max")
          ->capture_default_str();
      sub.add_option("--peer", o->peer, "HOST:PORT of a running `xfer-bench --serve`");
      sub.add_flag("--json", o->json, "print one JSON object as the last line");
      sub.add_option("--copy-threads", o->copy_threads, "shm copy threads")->capture_default_str();
      sub.add_option("--connections", o->tcp_connections, "tcp connections per peer")
          ->capture_default_str();
      sub.add_option("--sizes", o->cuda_sizes, "cuda: block sizes in bytes (comma-separated)")
          ->delimiter(',')
          ->capture_default_str();
      sub.add_option("--bytes", o->cuda_bytes, "cuda: pool bytes per side = bytes per point")
          ->capture_default_str();
      sub.add_option("--runs", o->cuda_runs, "cuda: timed runs per point (median)")
          ->capture_default_str();
      sub.add_option("--device", o->device, "cuda: GPU of the local pool and the kernels")
          ->capture_default_str();
      sub.add_option("--peer-device", o->peer_device, "cuda: GPU of the peer pool (-1 = --device)")
          ->capture_default_str();
      sub.add_option("--lat-iters", o->lat_iters, "cuda: 64-block latency iterations (0 = skip)")
          ->capture_default_str();
      sub.add_flag("--sweep", o->sweep, "cuda: also time kernel variants");
      sub.add_flag("--no-baselines", o->no_baselines,
                   "cuda: skip per-block memcpy and cudaMemcpyBatchAsync");
      sub.add_option("--out", o->out, "cuda: also write the markdown table here");
      sub.add_flag("--agent", o->agent,
                   "cuda: time the TransferAgent path (--op, --block-size, --blocks, --layers, "
                   "--iters) against a contiguous copy of the same bytes");
      sub.add_flag("--serve", o->serve, "run as the peer process");
      sub.add_option("--listen", o->listen, "peer mode: HOST:PORT to listen on")
          ->capture_default_str();
      return [o]() { return kvbridge::transfer::RunXferBench(*o); };
    });
}  // namespace

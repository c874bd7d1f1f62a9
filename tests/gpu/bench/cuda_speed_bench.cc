// cuda_speed_bench — the speed figures of the GPU forward pass (issue 19), one binary run on the
// device machine by scripts/device_gpu_speed_run.sh (docs/gpu.md "Speed"):
//   roofline   read bandwidth (read-only stream over --stream-gib GiB) and the dense mma.sync rate
//   matmul     LaunchMatmul on qwen2.5-7b's shapes at M = 1, 16, 128, 2048 (+ the 8-shard tree)
//   attention  LaunchAttention: decode rows at context --ctx for each batch, and a 2048 prefill
//   decode     CudaModel::CreateRandom(qwen2.5-7b) decode step time at each batch and KV dtype
//              (wall time of Forward, logits to the host included), roofline ratio, per-stage
//              breakdown (CUDA events), and prefill of one 2048-token prompt
// Tables go to stdout (markdown) and, with --out DIR, to DIR/speed.md; raw numbers to
// DIR/speed.json. Without a GPU it prints the reason and exits 0 (so CI can run it).
#include <cuda_runtime_api.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

#include "bench/cuda_roofline.h"
#include "kvbridge/model/cuda_model.h"
#include "kvbridge/model/random_model.h"
#include "model/cuda/cuda_constants.h"
#include "model/cuda/cuda_kernels.h"

namespace kvbridge {
namespace {

struct Options {
  std::string out;
  std::string sections = "roofline,matmul,attention,decode";
  std::vector<int> batches = {1, 8, 32, 128};
  std::vector<std::string> kv = {"bf16", "fp8"};
  int ctx = 2048;
  int steps = 20;
  double stream_gib = 4.0;
  std::string preset = "qwen2.5-7b";
};

std::vector<int> Ints(const std::string& s) {
  std::vector<int> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(std::atoi(x.c_str()));
  return v;
}
std::vector<std::string> Words(const std::string& s) {
  std::vector<std::string> v;
  std::stringstream ss(s);
  std::string x;
  while (std::getline(ss, x, ',')) v.push_back(x);
  return v;
}
bool Has(const Options& o, const char* s) {
  for (const auto& w : Words(o.sections)) {
    if (w == s) return true;
  }
  return false;
}

std::string md;    // all tables
std::string json;  // "key": value lines
void Out(const std::string& line) {
  std::printf("%s\n", line.c_str());
  std::fflush(stdout);
  md += line + "\n";
}
void J(const std::string& key, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), "%.6g", v);
  json += (json.empty() ? "" : ",\n") + std::string("  \"") + key + "\": " + b;
}
std::string F(const char* fmt, double v) {
  char b[64];
  std::snprintf(b, sizeof(b), fmt, v);
  return b;
}
double Median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  return v.empty() ? 0.0 : v[v.size() / 2];
}
#define CK(expr)                                                                                 \
  do {                                                                                           \
    const cudaError_t e_ = (expr);                                                               \
    if (e_ != cudaSuccess) {                                                                     \
      std::fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #expr, cudaGetErrorString(e_)); \
      std::exit(1);                                                                              \
    }                                                                                            \
  } while (0)

template <class T>
cudaError_t Malloc(T** p, size_t bytes) {
  return cudaMalloc(reinterpret_cast<void**>(p), bytes);
}

double g_bw = 0.0, g_mma = 0.0;  // the measured ceilings (bytes/s, FLOP/s)

// Times fn() with CUDA events on stream 0: median ms of `reps` after 2 warm-ups.
template <class Fn>
double TimeMs(int reps, Fn fn) {
  cudaEvent_t a, b;
  CK(cudaEventCreate(&a));
  CK(cudaEventCreate(&b));
  std::vector<double> t;
  for (int r = 0; r < reps + 2; ++r) {
    CK(cudaEventRecord(a, 0));
    fn(r);
    CK(cudaEventRecord(b, 0));
    CK(cudaEventSynchronize(b));
    float ms = 0;
    CK(cudaEventElapsedTime(&ms, a, b));
    if (r >= 2) t.push_back(ms);
  }
  CK(cudaGetLastError());
  cudaEventDestroy(a);
  cudaEventDestroy(b);
  return Median(t);
}

void Roofline(const Options& o) {
  Out("\n### Ceilings (measured in this run)\n");
  Out("| ceiling | measured |");
  Out("|---|---|");
  std::string err;
  g_bw = bench::MeasureReadBandwidth(static_cast<size_t>(o.stream_gib * 1073741824.0), 10, &err);
  g_mma = bench::MeasureMmaPeak(5, &err);
  if (!err.empty() || g_bw <= 0 || g_mma <= 0) {
    std::fprintf(stderr, "roofline failed: %s\n", err.c_str());
    std::exit(1);
  }
  Out("| read bandwidth (read-only stream, " + F("%.0f", o.stream_gib) +
      " GiB, 16-byte loads, best of 10) | " + F("%.0f", g_bw / 1e9) + " GB/s |");
  Out("| bf16 mma.sync m16n8k16 dense loop (registers only, best of 5) | " +
      F("%.0f", g_mma / 1e12) + " TFLOP/s |");
  J("read_bw_GBps", g_bw / 1e9);
  J("mma_sync_TFLOPs", g_mma / 1e12);
}

struct Shape {
  const char* name;
  int n, k, shards;
};

void MatmulBench(const ModelConfig& c) {
  const int h = c.hidden_size, im = c.intermediate_size, qkv = c.q_dim() + 2 * c.kv_dim();
  const Shape shapes[] = {{"qkv_proj", qkv, h, 1},
                          {"o_proj (8 K-shards + tree)", h, c.q_dim(), 8},
                          {"gate_up_proj", 2 * im, h, 1},
                          {"down_proj (8 K-shards + tree)", h, im, 8},
                          {"lm_head", c.vocab_size, h, 1}};
  const int ms[] = {1, 16, 128, 2048};
  size_t max_a = 0, max_out = 0;
  for (const Shape& s : shapes) {
    max_a = std::max(max_a, static_cast<size_t>(2048) * s.k);
    max_out = std::max(max_out, static_cast<size_t>(s.shards) * 2048 * s.n);
  }
  uint16_t* a = nullptr;
  float* out = nullptr;
  float* x = nullptr;
  CK(Malloc(&a, max_a * 2));
  CK(Malloc(&out, max_out * 4));
  CK(Malloc(&x, static_cast<size_t>(2048) * h * 4));
  cuda_internal::LaunchRandomBf16(a, max_a, 12345, 0.0f, 1.0f, 0);
  CK(cudaMemset(x, 0, static_cast<size_t>(2048) * h * 4));
  Out("\n### Matmul: ours (LaunchMatmul) on qwen2.5-7b's shapes\n");
  Out("Weights rotate over copies totalling >= 512 MB (no L2 reuse between runs); median of 20.\n");
  Out("| shape (N x K) | M | ours us | (+ shard tree us) | TFLOP/s | weight GB/s |");
  Out("|---|---|---|---|---|---|");
  for (const Shape& s : shapes) {
    const size_t wel = static_cast<size_t>(s.n) * s.k;
    const int copies = static_cast<int>(std::max<size_t>(1, (512u << 20) / (wel * 2) + 1));
    std::vector<uint16_t*> w(copies);
    for (auto& p : w) {
      CK(Malloc(&p, wel * 2));
      cuda_internal::LaunchRandomBf16(p, wel, 777, 0.0f, 0.05f, 0);
    }
    for (int m : ms) {
      const double t = TimeMs(20, [&](int r) {
        cuda_internal::LaunchMatmul(a, s.k, w[r % copies], m, s.n, s.k, s.shards, nullptr, out, 0);
      });
      double tree = 0.0;
      if (s.shards > 1) {
        tree =
            TimeMs(20, [&](int) { cuda_internal::LaunchResidualTree(x, out, m, s.n, nullptr, 0); });
      }
      const double flops = 2.0 * m * s.n * s.k;
      const double tot = t + tree;
      Out(std::string("| ") + s.name + " (" + std::to_string(s.n) + " x " + std::to_string(s.k) +
          ") | " + std::to_string(m) + " | " + F("%.1f", t * 1e3) + " | " +
          (s.shards > 1 ? F("%.1f", tree * 1e3) : std::string("-")) + " | " +
          F("%.1f", flops / (tot * 1e-3) / 1e12) + " | " + F("%.0f", wel * 2 / (tot * 1e-3) / 1e9) +
          " |");
      J(std::string("matmul_") + s.name + "_m" + std::to_string(m) + "_us", tot * 1e3);
    }
    for (auto& p : w) cudaFree(p);
  }
  cudaFree(a);
  cudaFree(out);
  cudaFree(x);
}

void AttentionBench(const Options& o, const ModelConfig& c) {
  const int nh = c.num_attention_heads, nkv = c.num_key_value_heads, hd = c.head_dim;
  const int nqkv = c.q_dim() + 2 * c.kv_dim();
  const int bs = 16, bps = (o.ctx + bs - 1) / bs;
  const int maxb = *std::max_element(o.batches.begin(), o.batches.end());
  const int rows_max = std::max(maxb, o.ctx);
  float* qkv = nullptr;
  uint16_t* outp = nullptr;
  int32_t* meta = nullptr;
  CK(Malloc(&qkv, static_cast<size_t>(rows_max) * nqkv * 4));
  CK(Malloc(&outp, static_cast<size_t>(rows_max) * nh * hd * 2));
  float* scratch = nullptr;  // as CudaModel's: the partition states of the split attention
  const size_t scratch_floats = cuda_internal::kAttentionScratchMaxBytes / 4;
  CK(Malloc(&scratch, cuda_internal::kAttentionScratchMaxBytes));
  cuda_internal::LaunchRandomF32(qkv, static_cast<size_t>(rows_max) * nqkv, 99, 0.0f, 1.0f, 0);
  Out("\n### Attention: ours (LaunchAttention, paged KV) — one layer of qwen2.5-7b (" +
      std::to_string(nh) + " q heads, " + std::to_string(nkv) + " KV heads, head_dim " +
      std::to_string(hd) + ")\n");
  Out("| case | KV | ours us | KV bytes read | GB/s |");
  Out("|---|---|---|---|---|");
  for (const std::string& kvn : o.kv) {
    const int dtype = kvn == "fp8" ? 2 : 1;
    const size_t es = dtype == 2 ? 1 : 2;
    cuda_internal::KvParams kv;
    kv.num_kv_heads = nkv;
    kv.head_dim = hd;
    kv.block_size = bs;
    kv.dtype = dtype;
    kv.half_block_bytes = static_cast<size_t>(nkv) * bs * hd * es;
    const int blocks = maxb * bps + 1;
    uint8_t* base = nullptr;
    const size_t pool = static_cast<size_t>(blocks) * 2 * kv.half_block_bytes;
    CK(Malloc(&base, pool));
    cuda_internal::LaunchRandomBf16(reinterpret_cast<uint16_t*>(base), pool / 2, 5, 0.0f, 0.5f, 0);
    if (dtype == 2) CK(cudaMemset(base, 0x30, pool));  // finite fp8
    struct Case {
      std::string name;
      int rows;
      bool prefill;
    };
    std::vector<Case> cases;
    for (int b : o.batches)
      cases.push_back(
          {"decode batch " + std::to_string(b) + ", context " + std::to_string(o.ctx), b, false});
    cases.push_back({"prefill " + std::to_string(o.ctx) + " tokens (causal)", o.ctx, true});
    for (const Case& cs : cases) {
      // meta: pos[rows] | table_off[rows] | tables
      std::vector<int32_t> h(2 * static_cast<size_t>(cs.rows));
      std::vector<int32_t> tables;
      const int seqs = cs.prefill ? 1 : cs.rows;
      for (int sq = 0; sq < seqs; ++sq) {
        for (int j = 0; j < bps; ++j) tables.push_back(sq * bps + j);
      }
      for (int r = 0; r < cs.rows; ++r) {
        h[r] = cs.prefill ? r : o.ctx - 1;
        h[cs.rows + r] = cs.prefill ? 0 : r * bps;
      }
      h.insert(h.end(), tables.begin(), tables.end());
      CK(Malloc(&meta, h.size() * 4));
      CK(cudaMemcpy(meta, h.data(), h.size() * 4, cudaMemcpyHostToDevice));
      const float scale = 1.0f / std::sqrt(static_cast<float>(hd));
      const double t = TimeMs(20, [&](int) {
        cuda_internal::LaunchAttention(qkv, nqkv, cs.rows, meta, meta + cs.rows, meta + 2 * cs.rows,
                                       kv, base, 1.0f, 1.0f, nh, scale, outp, o.ctx - 1, scratch,
                                       scratch_floats, 0);
      });
      const double bytes = static_cast<double>(seqs) * o.ctx * 2 * nkv * hd * es;
      Out("| " + cs.name + " | " + kvn + " | " + F("%.1f", t * 1e3) + " | " +
          F("%.1f MB", bytes / 1e6) + " | " + F("%.0f", bytes / (t * 1e-3) / 1e9) + " |");
      J("attention_" + std::string(cs.prefill ? "prefill" : "decode_b" + std::to_string(cs.rows)) +
            "_" + kvn + "_us",
        t * 1e3);
      cudaFree(meta);
    }
    cudaFree(base);
  }
  cudaFree(qkv);
  cudaFree(outp);
  cudaFree(scratch);
}

// Bytes and FLOPs one decode step of `b` sequences at context `ctx` must at least move / do.
struct StepCost {
  double bytes, flops;
};
StepCost DecodeCost(const ModelConfig& c, int b, int ctx, size_t kv_es) {
  const double h = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), im = c.intermediate_size;
  const double per_layer = (qd + 2 * kvd) * h + h * qd + 2 * im * h + h * im;
  const double mats = c.num_hidden_layers * per_layer + static_cast<double>(c.vocab_size) * h;
  const double kv = static_cast<double>(b) * ctx * c.num_hidden_layers * 2 * kvd * kv_es;
  StepCost s;
  s.bytes = 2.0 * mats + kv + 2.0 * b * h;  // weights once, KV of every position, embed rows
  s.flops =
      2.0 * mats * b + 4.0 * b * ctx * c.num_attention_heads * c.head_dim * c.num_hidden_layers;
  return s;
}

void DecodeBench(const Options& o) {
  auto spec = RandomModelPreset(o.preset, 0);
  if (!spec.ok()) {
    std::fprintf(stderr, "%s\n", spec.status().ToString().c_str());
    std::exit(1);
  }
  const ModelConfig& c = spec->config;
  const int maxb = *std::max_element(o.batches.begin(), o.batches.end());
  const int bps = (o.ctx + 1 + 15) / 16;
  Out("\n### Decode step, " + o.preset + " (bf16 weights, random), context " +
      std::to_string(o.ctx) + "\n");
  Out("Step = `CudaModel::Forward` of B one-token sequences at position " +
      std::to_string(o.ctx - 1) + " (each attends over " + std::to_string(o.ctx) +
      " cached positions), host wall time (logits copied to the host included), median of " +
      std::to_string(o.steps) +
      " after 3 warm-ups. Roofline = max(bytes / read BW, FLOPs / mma peak) with the ceilings "
      "measured above.\n");
  Out("| KV | batch | step ms | tokens/s | roofline ms | x roofline | bytes/step GB | device "
      "busy ms (events) |");
  Out("|---|---|---|---|---|---|---|---|");
  std::string breakdown;
  for (const std::string& kvn : o.kv) {
    const KvDtype dt = kvn == "fp8" ? KvDtype::kFp8E4M3 : KvDtype::kBf16;
    const auto t0 = std::chrono::steady_clock::now();
    auto made = CudaModel::CreateRandom(
        *spec, {.device = 0,
                .kv_dtype = dt,
                .block_size = 16,
                .num_blocks = static_cast<int64_t>(maxb) * bps + 4,
                .max_num_batched_tokens = std::max(2048, o.ctx),
                .max_num_seqs = std::max(128, maxb),
                .max_model_len = std::min(c.max_position_embeddings, o.ctx + 64)});
    if (!made.ok()) {
      std::fprintf(stderr, "CreateRandom: %s\n", made.status().ToString().c_str());
      std::exit(1);
    }
    const double gen_s =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    CudaModel& g = **made;
    if (kvn == o.kv.front()) {
      Out("(CreateRandom: " + F("%.1f", g.memory().weight_bytes / 1e9) +
          " GB of weights generated on the GPU in " + F("%.2f", gen_s) + " s)\n");
      J("create_random_s", gen_s);
    }
    if (!g.FillKv(dt == KvDtype::kFp8E4M3 ? 0x30 : 0x3c).ok()) std::exit(1);
    std::vector<int32_t> tokens(maxb), tables(static_cast<size_t>(maxb) * bps);
    for (int i = 0; i < maxb; ++i) tokens[i] = (i * 7919) % c.vocab_size;
    for (size_t i = 0; i < tables.size(); ++i) tables[i] = static_cast<int32_t>(i);
    std::vector<float> logits;
    for (int b : o.batches) {
      ForwardBatch fb;
      for (int i = 0; i < b; ++i) {
        fb.sequences.push_back(
            {&tokens[i], 1, o.ctx - 1, &tables[static_cast<size_t>(i) * bps], bps, true});
      }
      std::vector<double> t;
      for (int s = 0; s < o.steps + 3; ++s) {
        const auto a = std::chrono::steady_clock::now();
        const Status st = g.Forward(fb, &logits);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
        if (!st.ok()) {
          std::fprintf(stderr, "Forward: %s\n", st.ToString().c_str());
          std::exit(1);
        }
        if (s >= 3) t.push_back(ms);
      }
      const double step = Median(t);
      // Breakdown: 3 more steps with events after every stage.
      g.ResetStageTimes();
      g.SetStageTiming(true);
      for (int s = 0; s < 3; ++s) (void)g.Forward(fb, &logits);
      g.SetStageTiming(false);
      double busy = 0.0;
      std::vector<std::pair<std::string, double>> st = g.StageTimes();
      for (auto& p : st) {
        p.second /= 3.0;
        busy += p.second;
      }
      const StepCost cost = DecodeCost(c, b, o.ctx, dt == KvDtype::kFp8E4M3 ? 1 : 2);
      const double roof = std::max(cost.bytes / g_bw, cost.flops / g_mma) * 1e3;
      Out("| " + kvn + " | " + std::to_string(b) + " | " + F("%.3f", step) + " | " +
          F("%.0f", b / (step * 1e-3)) + " | " + F("%.3f", roof) + " | " + F("%.2f", roof / step) +
          " | " + F("%.2f", cost.bytes / 1e9) + " | " + F("%.3f", busy) + " |");
      J("decode_" + kvn + "_b" + std::to_string(b) + "_ms", step);
      J("decode_" + kvn + "_b" + std::to_string(b) + "_roofline_ms", roof);
      breakdown += "| " + kvn + " | " + std::to_string(b) + " |";
      std::sort(st.begin(), st.end(),
                [](const auto& x, const auto& y) { return x.second > y.second; });
      std::string cells;
      for (size_t i = 0; i < st.size() && i < 7; ++i) {
        cells += " " + st[i].first + " " + F("%.3f", st[i].second) + " (" +
                 F("%.0f", 100.0 * st[i].second / busy) + "%);";
      }
      breakdown += cells + " |\n";
    }
    if (kvn == o.kv.front()) {
      // Prefill: one prompt of ctx tokens in one chunk.
      std::vector<int32_t> prompt(o.ctx);
      for (int i = 0; i < o.ctx; ++i) prompt[i] = (i * 31 + 7) % c.vocab_size;
      ForwardBatch fb;
      fb.sequences.push_back({prompt.data(), o.ctx, 0, tables.data(), bps, true});
      std::vector<double> t;
      for (int s = 0; s < 5 + 1; ++s) {
        const auto a = std::chrono::steady_clock::now();
        if (!g.Forward(fb, &logits).ok()) std::exit(1);
        const double ms =
            std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
        if (s >= 1) t.push_back(ms);
      }
      const double pms = Median(t);
      g.ResetStageTimes();
      g.SetStageTiming(true);
      (void)g.Forward(fb, &logits);
      g.SetStageTiming(false);
      std::vector<std::pair<std::string, double>> st = g.StageTimes();
      std::sort(st.begin(), st.end(),
                [](const auto& x, const auto& y) { return x.second > y.second; });
      std::string cells;
      for (size_t i = 0; i < st.size() && i < 6; ++i)
        cells += " " + st[i].first + " " + F("%.2f", st[i].second) + ";";
      const StepCost cost = DecodeCost(c, o.ctx, 0, 2);  // matmul FLOPs; attention below
      const double attn_flops = 2.0 * o.ctx * o.ctx * c.num_attention_heads * c.head_dim *
                                c.num_hidden_layers;  // causal: half of 4 * n^2
      J("prefill_" + std::to_string(o.ctx) + "_ms", pms);
      breakdown += "| prefill " + std::to_string(o.ctx) + " (" + kvn + ") | " + F("%.1f ms", pms) +
                   " = " + F("%.0f", o.ctx / (pms * 1e-3)) + " tokens/s, " +
                   F("%.0f", (cost.flops + attn_flops) / (pms * 1e-3) / 1e12) + " TFLOP/s |" +
                   cells + " |\n";
    }
  }
  Out("\nPer-stage device time per step (CUDA events after every stage, mean of 3 steps; top "
      "stages, ms and share of the device-busy time):\n");
  Out("| KV | batch | stages |");
  Out("|---|---|---|");
  Out(breakdown);
}

}  // namespace
}  // namespace kvbridge

int main(int argc, char** argv) {
  using namespace kvbridge;  // NOLINT
  Options o;
  for (int i = 1; i + 1 < argc; i += 2) {
    const std::string k = argv[i], v = argv[i + 1];
    if (k == "--out")
      o.out = v;
    else if (k == "--sections")
      o.sections = v;
    else if (k == "--batches")
      o.batches = Ints(v);
    else if (k == "--kv")
      o.kv = Words(v);
    else if (k == "--ctx")
      o.ctx = std::atoi(v.c_str());
    else if (k == "--steps")
      o.steps = std::atoi(v.c_str());
    else if (k == "--stream-gib")
      o.stream_gib = std::atof(v.c_str());
    else if (k == "--preset")
      o.preset = v;
    else {
      std::fprintf(stderr, "unknown option %s\n", k.c_str());
      return 2;
    }
  }
  const Status dev = CudaDeviceAvailable(0);
  if (!dev.ok()) {
    std::printf("skipped: %s\n", dev.ToString().c_str());
    return 0;
  }
  cudaDeviceProp p{};
  CK(cudaGetDeviceProperties(&p, 0));
  Out("GPU: " + std::string(p.name) + ", " + std::to_string(p.multiProcessorCount) + " SMs");
  auto spec = RandomModelPreset(o.preset, 0);
  if (!spec.ok()) return 2;
  if (Has(o, "roofline") || Has(o, "decode")) Roofline(o);
  if (Has(o, "matmul")) MatmulBench(spec->config);
  if (Has(o, "attention")) AttentionBench(o, spec->config);
  if (Has(o, "decode")) DecodeBench(o);
  if (!o.out.empty()) {
    std::ofstream(o.out + "/speed.md") << md;
    std::ofstream(o.out + "/speed.json") << "{\n" << json << "\n}\n";
  }
  return 0;
}

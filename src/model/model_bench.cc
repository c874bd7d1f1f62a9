// Benchmarks of the model module (not timed tests). Figures and the exact command are in
// docs/model.md "Figures":
//   OPENBLAS_NUM_THREADS=1 build/bin/model_bench [--benchmark_filter=...]
// - BM_PeakFma/<threads>/<zmm>: FMA throughput with independent accumulators (1 thread ymm and
//   zmm, all cores zmm), thread CPU time;
// - BM_ReadBandwidth/<threads>: STREAM-like read of a 1 GiB buffer (1 thread, all cores);
// - BM_MatMul/M/N/K/<bf16>: our kernel (default path; KVBRIDGE_KERNEL picks another) vs
//   OpenBLAS sgemm on the same values, alternating, one thread, with the ratio;
// - BM_QwenDecode/<batch>/<context>, BM_QwenPrefill/<tokens>: qwen2.5-0.5b shapes (random bf16
//   weights, resident as stored; KVBRIDGE_BENCH_QWEN_DIR reuses a `make-model` directory), all
//   cores, decode against the roofline measured in the same run;
// - BM_Prefill / BM_Decode: the `small` preset, tokens/s, bf16 KV, all cores.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <time.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <random>
#include <string>
#include <thread>
#include <vector>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "model/kernels.h"
#include "model/numerics.h"

#if KVBRIDGE_HAVE_OPENBLAS
#include <cblas.h>
#endif

namespace kvbridge {
namespace {

double ThreadCpuSeconds() {
  timespec t;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &t);
  return static_cast<double>(t.tv_sec) + 1e-9 * static_cast<double>(t.tv_nsec);
}

// FMA throughput: kAcc independent accumulators (more than latency x ports), so the loop is
// bound by the FMA units, not by one dependency chain. Returns GFLOP/s of one thread.
template <int kAcc>
__attribute__((target("avx2,fma"), noinline)) double FmaLoopAvx2(int64_t iters) {
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(1.0f), b = _mm256_set1_ps(1e-7f);
  const double t0 = ThreadCpuSeconds();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(a, b, acc[i]);
  }
  const double s = ThreadCpuSeconds() - t0;
  benchmark::DoNotOptimize(acc);
  return static_cast<double>(iters) * kAcc * 16 / s * 1e-9;
}
template <int kAcc>
__attribute__((target("avx512f"), noinline)) double FmaLoopAvx512(int64_t iters) {
  __m512 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m512 a = _mm512_set1_ps(1.0f), b = _mm512_set1_ps(1e-7f);
  const double t0 = ThreadCpuSeconds();
  for (int64_t it = 0; it < iters; ++it) {
#pragma GCC unroll 16
    for (int i = 0; i < kAcc; ++i) acc[i] = _mm512_fmadd_ps(a, b, acc[i]);
  }
  const double s = ThreadCpuSeconds() - t0;
  benchmark::DoNotOptimize(acc);
  return static_cast<double>(iters) * kAcc * 32 / s * 1e-9;
}

bool HasAvx512() { return model_internal::KernelIsaSupported(model_internal::KernelIsa::kAvx512); }

// Sum over `threads` threads of the single-thread peak of the widest unit (each thread's own
// CPU time: other load on the machine does not lower it).
double FmaPeak(int threads, bool avx512) {
  std::vector<double> g(threads);
  std::vector<std::thread> ts;
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      g[t] = avx512 ? FmaLoopAvx512<16>(int64_t{1} << 23) : FmaLoopAvx2<12>(int64_t{1} << 23);
    });
  }
  for (auto& t : ts) t.join();
  double sum = 0;
  for (double v : g) sum += v;
  return sum;
}

int Cores() { return std::max(1u, std::thread::hardware_concurrency()); }

// BM_PeakFma/<threads>/<avx512>: GFLOP/s of independent FMA chains (1 thread, all cores).
void BM_PeakFma(benchmark::State& state) {
  const int threads = state.range(0) == 0 ? Cores() : static_cast<int>(state.range(0));
  const bool avx512 = state.range(1) != 0;
  if (avx512 && !HasAvx512()) {
    state.SkipWithError("no AVX-512 on this CPU");
    return;
  }
  double g = 0;
  int64_t n = 0;
  for (auto _ : state) {
    g += FmaPeak(threads, avx512);
    ++n;
  }
  state.counters["GFLOP/s"] = g / static_cast<double>(n);
  state.SetLabel(std::string(avx512 ? "zmm" : "ymm") + ", " + std::to_string(threads) +
                 " thread(s)");
}
BENCHMARK(BM_PeakFma)->Args({1, 0})->Args({1, 1})->Args({0, 1})->Unit(benchmark::kMillisecond);

// STREAM-like read: sums a buffer much larger than the caches (kReadBytes) with `threads`
// threads, each its contiguous part. Returns GB/s (wall clock over the whole pass).
constexpr size_t kReadBytes = size_t{1} << 30;
float* ReadBuffer() {
  static float* p = [] {
    auto* b = static_cast<float*>(std::aligned_alloc(64, kReadBytes));
    if (b == nullptr) std::abort();
    for (size_t i = 0; i < kReadBytes / 4; ++i) b[i] = static_cast<float>(i & 1023);
    return b;
  }();
  return p;
}
__attribute__((target("avx2"), noinline)) float SumRange(const float* p, size_t n) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = 0; i + 32 <= n; i += 32) {
    a0 = _mm256_add_ps(a0, _mm256_load_ps(p + i));
    a1 = _mm256_add_ps(a1, _mm256_load_ps(p + i + 8));
    a2 = _mm256_add_ps(a2, _mm256_load_ps(p + i + 16));
    a3 = _mm256_add_ps(a3, _mm256_load_ps(p + i + 24));
  }
  const __m256 s = _mm256_add_ps(_mm256_add_ps(a0, a1), _mm256_add_ps(a2, a3));
  return s[0] + s[7];
}
// Also `cpu_gbs`: the bytes over the slowest thread's own CPU time — what the threads read while
// running, i.e. the bandwidth an unshared machine would give (wall time counts the time other
// processes hold the cores).
double ReadBandwidth(int threads, double* cpu_gbs = nullptr) {
  const float* p = ReadBuffer();
  const size_t n = kReadBytes / 4, per = n / threads / 32 * 32;
  std::vector<std::thread> ts;
  std::vector<float> sink(threads);
  std::vector<double> cpu(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] {
      const double c0 = ThreadCpuSeconds();
      sink[t] = SumRange(p + per * t, per);
      cpu[t] = ThreadCpuSeconds() - c0;
    });
  }
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(sink.data());
  const double bytes = static_cast<double>(per * threads * 4);
  if (cpu_gbs != nullptr) *cpu_gbs = bytes / *std::max_element(cpu.begin(), cpu.end()) * 1e-9;
  return bytes / s * 1e-9;
}

// BM_ReadBandwidth/<threads> (0 = all cores): GB/s of the read loop over 1 GiB.
void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = state.range(0) == 0 ? Cores() : static_cast<int>(state.range(0));
  ReadBuffer();
  double g = 0, gc = 0;
  int64_t n = 0;
  for (auto _ : state) {
    double c = 0;
    g += ReadBandwidth(threads, &c);
    gc += c;
    ++n;
  }
  state.counters["GB/s"] = g / static_cast<double>(n);
  state.counters["cpu_GB/s"] = gc / static_cast<double>(n);
}
BENCHMARK(BM_ReadBandwidth)->Arg(1)->Arg(0)->Unit(benchmark::kMillisecond)->Iterations(5);

// BM_MatMul/M/N/K/<weights: 0 fp32, 1 bf16>: our kernel (default path, one thread) and
// OpenBLAS sgemm (row-major x . w^T, fp32, OPENBLAS_NUM_THREADS=1) on the same fp32 values,
// alternating call by call so machine load hits both alike; thread CPU time.
void BM_MatMul(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
            k = static_cast<int>(state.range(2));
  const bool bf16 = state.range(3) != 0;
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> x(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k),
      y(static_cast<size_t>(m) * n);
  std::vector<uint16_t> wb(w.size());
  for (auto& v : x) v = d(rng);
  for (size_t i = 0; i < w.size(); ++i) {
    wb[i] = model_internal::FloatToBf16(d(rng));
    w[i] = model_internal::Bf16ToFloat(wb[i]);
  }
  const model_internal::WeightPtr wp =
      bf16 ? model_internal::WeightPtr{wb.data(), model_internal::WeightType::kBf16}
           : model_internal::WeightPtr{w.data(), model_internal::WeightType::kF32};
  double ours = 0, blas = 0;
  for (auto _ : state) {
    double t0 = ThreadCpuSeconds();
    model_internal::MatMulNT(x.data(), m, k, wp, n, k, k, y.data(), n);
    benchmark::DoNotOptimize(y.data());
    ours += ThreadCpuSeconds() - t0;
#if KVBRIDGE_HAVE_OPENBLAS
    t0 = ThreadCpuSeconds();
    cblas_sgemm(CblasRowMajor, CblasNoTrans, CblasTrans, m, n, k, 1.0f, x.data(), k, w.data(), k,
                0.0f, y.data(), n);
    benchmark::DoNotOptimize(y.data());
    blas += ThreadCpuSeconds() - t0;
#endif
  }
  const double flop = static_cast<double>(state.iterations()) * 2.0 * m * n * k;
  state.counters["GFLOP/s"] = flop / ours * 1e-9;
  if (blas > 0) {
    state.counters["blas_GFLOP/s"] = flop / blas * 1e-9;
    state.counters["vs_blas"] = blas / ours;
  }
  state.SetLabel(std::string(model_internal::KernelPath()) + (bf16 ? ", bf16 w" : ", fp32 w"));
}
void MatMulShapes(benchmark::internal::Benchmark* b) {
  // The shapes (small preset), then qwen2.5-0.5b's at prefill M = 64 and 512:
  // q/o (896x896), k/v (128x896), gate/up (4864x896), down (896x4864) and the K-shards the
  // row-parallel o/down actually run (896x112, 896x608), and decode M = 1, 8.
  for (int bf : {0, 1}) {
    b->Args({64, 768, 256, bf})->Args({256, 768, 256, bf});
    for (int m : {64, 512}) {
      b->Args({m, 896, 896, bf})->Args({m, 128, 896, bf})->Args({m, 4864, 896, bf});
      b->Args({m, 896, 4864, bf})->Args({m, 896, 112, bf})->Args({m, 896, 608, bf});
    }
    b->Args({1, 4864, 896, bf})->Args({8, 4864, 896, bf});
  }
}
BENCHMARK(BM_MatMul)->Apply(MatMulShapes)->Unit(benchmark::kMicrosecond);

std::shared_ptr<Model> SmallModel() {
  static std::shared_ptr<Model> model = [] {
    const std::string dir = (std::filesystem::temp_directory_path() /
                             ("kvbridge_bench_small_" + std::to_string(::getpid())))
                                .string();
    auto spec = RandomModelPreset("small", ModelArch::kLlama, 0);
    if (!spec.ok() || !WriteRandomModel(*spec, dir).ok()) std::abort();
    auto m = Model::Load(dir);
    std::filesystem::remove_all(dir);
    if (!m.ok()) std::abort();
    return *m;
  }();
  return model;
}

std::vector<int32_t> Tokens(int n) {
  std::vector<int32_t> t(n);
  for (int i = 0; i < n; ++i) t[i] = 32 + (i * 7) % 90;
  return t;
}

void BM_Prefill(benchmark::State& state) {
  auto model = SmallModel();
  const int n = static_cast<int>(state.range(0));
  const int blocks = (n + 15) / 16;
  std::vector<float> ks, vs;
  model->KvScales(KvDtype::kBf16, &ks, &vs);
  LocalKvCache kv(model->KvLayout(blocks, 16, KvDtype::kBf16), ks, vs);
  std::vector<int32_t> table(blocks);
  for (int i = 0; i < blocks; ++i) table[i] = i;
  auto tokens = Tokens(n);
  std::vector<float> logits;
  for (auto _ : state) {
    ForwardBatch b;
    b.sequences.push_back({tokens.data(), n, 0, table.data(), blocks, true});
    if (!model->Forward(b, kv.view(), &logits).ok()) state.SkipWithError("forward failed");
  }
  state.counters["tok/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * n, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Prefill)->Arg(128)->Arg(1000)->Unit(benchmark::kMillisecond)->UseRealTime();

// `batch` sequences each decoding one token at context `ctx`.
void BM_Decode(benchmark::State& state) {
  auto model = SmallModel();
  const int ctx = static_cast<int>(state.range(0)), batch = static_cast<int>(state.range(1));
  const int per_seq = (ctx + 1 + 15) / 16;
  std::vector<float> ks, vs;
  model->KvScales(KvDtype::kBf16, &ks, &vs);
  LocalKvCache kv(model->KvLayout(per_seq * batch, 16, KvDtype::kBf16), ks, vs);
  std::vector<std::vector<int32_t>> tables(batch);
  auto prompt = Tokens(ctx + 1);
  std::vector<float> logits;
  for (int s = 0; s < batch; ++s) {
    for (int i = 0; i < per_seq; ++i) tables[s].push_back(s * per_seq + i);
    ForwardBatch b;
    b.sequences.push_back({prompt.data(), ctx, 0, tables[s].data(), per_seq, false});
    if (!model->Forward(b, kv.view(), &logits).ok()) std::abort();
  }
  for (auto _ : state) {
    ForwardBatch b;
    for (int s = 0; s < batch; ++s) {
      b.sequences.push_back({prompt.data() + ctx, 1, ctx, tables[s].data(), per_seq, true});
    }
    if (!model->Forward(b, kv.view(), &logits).ok()) state.SkipWithError("forward failed");
  }
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(state.iterations()) * batch,
                                               benchmark::Counter::kIsRate);
}
BENCHMARK(BM_Decode)
    ->Args({128, 1})
    ->Args({1000, 1})
    ->Args({1000, 16})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime();

// ---------- qwen2.5-0.5b shapes, bf16 weights resident (memory-mapped) ----------

// The qwen2.5-0.5b preset (random bf16 weights, the published config), written once per
// process into a temp dir (or taken from KVBRIDGE_BENCH_QWEN_DIR when set) and loaded with
// the weights as stored, on all cores.
std::shared_ptr<Model> QwenModel() {
  static std::shared_ptr<Model> model = [] {
    std::string dir;
    bool remove = false;
    if (const char* d = std::getenv("KVBRIDGE_BENCH_QWEN_DIR"); d != nullptr && *d) {
      dir = d;
    } else {
      dir = (std::filesystem::temp_directory_path() /
             ("kvbridge_bench_qwen_" + std::to_string(::getpid())))
                .string();
      auto spec = RandomModelPreset("qwen2.5-0.5b", 0);
      if (!spec.ok() || !WriteRandomModel(*spec, dir).ok()) std::abort();
      remove = true;
    }
    auto m = Model::Load(dir);
    if (!m.ok()) {
      std::fprintf(stderr, "%s\n", m.status().ToString().c_str());
      std::abort();
    }
    // The mapping stays valid after the file is unlinked.
    if (remove) std::filesystem::remove_all(dir);
    return *m;
  }();
  return model;
}

// The machine's limits, measured once in this run: read bandwidth and FMA peak, all cores.
struct Machine {
  double read_gbs = 0, peak_gflops = 0;
  double cpu_read_gbs = 0;  // over the threads' CPU time (see ReadBandwidth)
};
const Machine& MeasuredMachine() {
  static Machine m = [] {
    Machine r;
    for (int i = 0; i < 3; ++i) {
      double c = 0;
      r.read_gbs = std::max(r.read_gbs, ReadBandwidth(Cores(), &c));
      r.cpu_read_gbs = std::max(r.cpu_read_gbs, c);
    }
    r.peak_gflops = FmaPeak(Cores(), HasAvx512());
    return r;
  }();
  return m;
}

// KV cache for `batch` sequences of `ctx` positions (bf16), filled with small values: a
// decode step's cost does not depend on what the KV holds, so no prefill is needed.
struct DecodeSetup {
  LocalKvCache kv;
  std::vector<std::vector<int32_t>> tables;
  int per_seq;
};
DecodeSetup MakeDecodeSetup(const Model& model, int batch, int ctx) {
  const int per_seq = (ctx + 1 + 15) / 16;
  std::vector<float> ks, vs;
  model.KvScales(KvDtype::kBf16, &ks, &vs);
  DecodeSetup s{
      LocalKvCache(model.KvLayout(per_seq * batch, 16, KvDtype::kBf16), ks, vs), {}, per_seq};
  const PagedKvView& v = s.kv.view();
  uint64_t st = 1;
  for (uint8_t* base : v.layer_base) {
    auto* h = reinterpret_cast<uint16_t*>(base);
    for (size_t i = 0; i < v.layout.LayerBytes() / 2; ++i) {
      st = st * 6364136223846793005ull + 1442695040888963407ull;
      const float f = static_cast<float>(static_cast<int>(st >> 40) % 2001 - 1000) * 1e-3f;
      h[i] = model_internal::FloatToBf16(f);
    }
  }
  s.tables.resize(batch);
  for (int b = 0; b < batch; ++b) {
    for (int i = 0; i < per_seq; ++i) s.tables[b].push_back(b * per_seq + i);
  }
  return s;
}

// BM_QwenDecode/<batch>/<context>: one decode step of `batch` sequences at position `context`
// (bf16 weights and KV, all cores), ms/step against the roofline
//   max((weight bytes + KV bytes) / read bandwidth, FLOPs / FMA peak)
// with both limits measured in this run (MeasuredMachine).
void BM_QwenDecode(benchmark::State& state) {
  auto model = QwenModel();
  const ModelConfig& c = model->config();
  const int batch = static_cast<int>(state.range(0)), ctx = static_cast<int>(state.range(1));
  const Machine& mach = MeasuredMachine();
  DecodeSetup setup = MakeDecodeSetup(*model, batch, ctx);
  std::vector<int32_t> tokens(batch);
  for (int b = 0; b < batch; ++b) tokens[b] = 1000 + 17 * b;
  std::vector<float> logits;
  auto step = [&] {
    ForwardBatch fb;
    for (int b = 0; b < batch; ++b) {
      fb.sequences.push_back(
          {&tokens[b], 1, ctx, setup.tables[b].data(), setup.per_seq, /*compute_logits=*/true});
    }
    return model->Forward(fb, setup.kv.view(), &logits);
  };
  if (!step().ok()) state.SkipWithError("forward failed");
  const auto t0 = std::chrono::steady_clock::now();
  const double c0 = ThreadCpuSeconds();
  for (auto _ : state) {
    if (!step().ok()) state.SkipWithError("forward failed");
  }
  const double cpu_s = ThreadCpuSeconds() - c0;
  const double wall_s =
      std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  // Bytes: every resident weight (tied lm_head = the embeddings, read whole for the logits)
  // and the KV of positions [0, ctx] of every sequence; FLOPs: 2 per weight per row of the
  // matmuls, and q.k + p.v over ctx + 1 positions per head.
  const double layers = c.num_hidden_layers;
  const double mat_params =
      layers * (static_cast<double>(c.hidden_size) * (2.0 * c.q_dim() + 2.0 * c.kv_dim()) +
                3.0 * c.hidden_size * c.intermediate_size) +
      static_cast<double>(c.vocab_size) * c.hidden_size;
  const double kv_bytes = batch * layers * 2.0 * c.kv_dim() * (ctx + 1) * 2;
  const double bytes = static_cast<double>(model->weight_bytes()) + kv_bytes;
  const double flops = batch * (2.0 * mat_params + layers * 4.0 * c.q_dim() * (ctx + 1));
  const double roof_ms =
      std::max(bytes / (mach.read_gbs * 1e9), flops / (mach.peak_gflops * 1e9)) * 1e3;
  const double ms = wall_s * 1e3 / static_cast<double>(std::max<int64_t>(1, state.iterations()));
  state.counters["ms/step"] = ms;
  state.counters["vs_roofline"] = roof_ms / ms;
  // The same on CPU time: the calling thread's CPU per step (it runs its share of every
  // matmul; the other thread the rest) against the roofline at the CPU-time bandwidth — what
  // an unshared machine would show when the box is loaded.
  const double cpu_ms = cpu_s * 1e3 / static_cast<double>(std::max<int64_t>(1, state.iterations()));
  const double cpu_roof_ms =
      std::max(bytes / (mach.cpu_read_gbs * 1e9), flops / (mach.peak_gflops * 1e9)) * 1e3;
  state.counters["cpu_ms/step"] = cpu_ms;
  state.counters["cpu_roofline_ms"] = cpu_roof_ms;
  state.counters["cpu_vs_roofline"] = cpu_roof_ms / cpu_ms;
  state.counters["roofline_ms"] = roof_ms;
  state.counters["read_GB/s"] = mach.read_gbs;
  state.counters["peak_GFLOP/s"] = mach.peak_gflops;
  state.counters["weight_MB"] = static_cast<double>(model->weight_bytes()) / 1e6;
  state.counters["tok/s"] = benchmark::Counter(static_cast<double>(state.iterations()) * batch,
                                               benchmark::Counter::kIsRate);
  state.SetLabel(std::string("weights ") + model->weight_types() + ", kernel " +
                 model_internal::KernelPath());
}
BENCHMARK(BM_QwenDecode)
    ->Args({1, 512})
    ->Args({8, 512})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(2.0);

// BM_QwenPrefill/<tokens>: one prompt of `tokens` tokens in one step (bf16 weights and KV, all
// cores), tokens/s.
void BM_QwenPrefill(benchmark::State& state) {
  auto model = QwenModel();
  const int n = static_cast<int>(state.range(0));
  DecodeSetup setup = MakeDecodeSetup(*model, 1, n);
  std::vector<int32_t> tokens(n);
  for (int i = 0; i < n; ++i) tokens[i] = (i * 7919) % 150000;
  std::vector<float> logits;
  for (auto _ : state) {
    ForwardBatch fb;
    fb.sequences.push_back({tokens.data(), n, 0, setup.tables[0].data(), setup.per_seq, true});
    if (!model->Forward(fb, setup.kv.view(), &logits).ok()) state.SkipWithError("forward failed");
  }
  state.counters["tok/s"] =
      benchmark::Counter(static_cast<double>(state.iterations()) * n, benchmark::Counter::kIsRate);
  state.SetLabel(std::string("weights ") + model->weight_types());
}
BENCHMARK(BM_QwenPrefill)->Arg(512)->Unit(benchmark::kMillisecond)->UseRealTime()->Iterations(3);

}  // namespace
}  // namespace kvbridge

BENCHMARK_MAIN();

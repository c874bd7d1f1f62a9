// Benchmarks of the model module (not timed tests). Figures go into docs/model.md:
//   build/src/model/model_bench   (or build/bin/model_bench)
// - BM_PeakFma: the machine's single-core fp32 peak, an 8-wide FMA throughput loop;
// - BM_MatMul: our fixed-order kernel, one thread, in GFLOP/s (compare with BM_PeakFma);
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
double ReadBandwidth(int threads) {
  const float* p = ReadBuffer();
  const size_t n = kReadBytes / 4, per = n / threads / 32 * 32;
  std::vector<std::thread> ts;
  std::vector<float> sink(threads);
  const auto t0 = std::chrono::steady_clock::now();
  for (int t = 0; t < threads; ++t) {
    ts.emplace_back([&, t] { sink[t] = SumRange(p + per * t, per); });
  }
  for (auto& t : ts) t.join();
  const double s = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
  benchmark::DoNotOptimize(sink.data());
  return static_cast<double>(per * threads * 4) / s * 1e-9;
}

// BM_ReadBandwidth/<threads> (0 = all cores): GB/s of the read loop over 1 GiB.
void BM_ReadBandwidth(benchmark::State& state) {
  const int threads = state.range(0) == 0 ? Cores() : static_cast<int>(state.range(0));
  ReadBuffer();
  double g = 0;
  int64_t n = 0;
  for (auto _ : state) {
    g += ReadBandwidth(threads);
    ++n;
  }
  state.counters["GB/s"] = g / static_cast<double>(n);
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

}  // namespace
}  // namespace kvbridge

BENCHMARK_MAIN();

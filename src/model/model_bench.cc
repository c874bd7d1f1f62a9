// Benchmarks of the model module (not timed tests). Figures go into docs/model.md:
//   build/src/model/model_bench   (or build/bin/model_bench)
// - BM_PeakFma: the machine's single-core fp32 peak, an 8-wide FMA throughput loop;
// - BM_MatMul: our fixed-order kernel, one thread, in GFLOP/s (compare with BM_PeakFma);
// - BM_Prefill / BM_Decode: the `small` preset, tokens/s, bf16 KV, all cores.
#include <benchmark/benchmark.h>
#include <immintrin.h>
#include <unistd.h>

#include <filesystem>
#include <random>
#include <vector>

#include "kvbridge/model/model.h"
#include "kvbridge/model/random_model.h"
#include "model/kernels.h"

namespace kvbridge {
namespace {

__attribute__((target("avx2,fma"))) void BM_PeakFma(benchmark::State& state) {
  constexpr int kAcc = 12;  // enough independent chains to cover FMA latency x ports
  __m256 acc[kAcc];
  for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_set1_ps(static_cast<float>(i) * 1e-3f);
  const __m256 a = _mm256_set1_ps(0.999999f), b = _mm256_set1_ps(1e-7f);
  constexpr int64_t kIters = 1 << 20;
  for (auto _ : state) {
    for (int64_t it = 0; it < kIters; ++it) {
      for (int i = 0; i < kAcc; ++i) acc[i] = _mm256_fmadd_ps(acc[i], a, b);
    }
    benchmark::DoNotOptimize(acc);
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * kIters * kAcc * 16, benchmark::Counter::kIsRate);
}
BENCHMARK(BM_PeakFma)->Unit(benchmark::kMillisecond);

void BM_MatMul(benchmark::State& state) {
  const int m = static_cast<int>(state.range(0)), n = static_cast<int>(state.range(1)),
            k = static_cast<int>(state.range(2));
  std::mt19937 rng(1);
  std::uniform_real_distribution<float> d(-1, 1);
  std::vector<float> x(static_cast<size_t>(m) * k), w(static_cast<size_t>(n) * k),
      y(static_cast<size_t>(m) * n);
  for (auto& v : x) v = d(rng);
  for (auto& v : w) v = d(rng);
  for (auto _ : state) {
    model_internal::MatMulNT(x.data(), m, k, w.data(), n, k, k, y.data(), n);
    benchmark::DoNotOptimize(y.data());
  }
  state.counters["GFLOP/s"] = benchmark::Counter(
      static_cast<double>(state.iterations()) * 2.0 * m * n * k, benchmark::Counter::kIsRate);
  state.SetLabel(model_internal::KernelPath());
}
BENCHMARK(BM_MatMul)
    ->Args({1, 768, 256})
    ->Args({64, 768, 256})
    ->Args({256, 768, 256})
    ->Args({256, 256, 768})
    ->Unit(benchmark::kMicrosecond);

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

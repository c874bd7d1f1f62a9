// Tensor parallelism inside one engine (see include/kvbridge/model/tensor_parallel.h).
//
// A step runs as T rank threads over shared step buffers:
//   stage 0  rows split by rank: x = embed, h = RMSNorm(x, layer 0 input norm)      | barrier
//   per layer:
//   stage 1  each rank: q/k/v of its heads, q/k norm (Qwen3), RoPE, write its KV heads  | barrier*
//            (* only when on_layer_kv_written is set: rank 0 calls it once all wrote)
//   stage 2  each rank: attention of its query heads, o_proj partials of its shards   | barrier
//   stage 3  rows split by rank: x += tree(partials) + bias, h = RMSNorm(post norm)  | barrier
//   stage 4  each rank: gate/up of its columns, SiLU, down_proj partials of its shards | barrier
//   stage 5  rows split by rank: x += tree(partials), h = next layer's input norm     | barrier
//   final    each rank: logits of its vocab range (lm_head replicated).
// Every element goes through the same helper (forward_internal.h) and the same kernel dot
// products as Model::Forward, so the bits match at every T.
#include "kvbridge/model/tensor_parallel.h"

#include <algorithm>
#include <barrier>
#include <cmath>
#include <condition_variable>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>

#include "kvbridge/common/thread_annotations.h"
#include "kvbridge/model/model.h"
#include "model/forward_internal.h"
#include "model/kernels.h"
#include "model/model_impl.h"
#include "model/numerics.h"

namespace kvbridge {

using model_internal::kRowParallelShards;
using model_internal::MatMulNT;
using model_internal::Row;
using model_internal::ShardBegin;

Status ValidateTensorParallelSize(const ModelConfig& c, int tp_size) {
  const std::string t = std::to_string(tp_size);
  if (tp_size < 1) return InvalidArgumentError("tensor_parallel_size must be >= 1, got " + t);
  if (kRowParallelShards % tp_size != 0) {
    return InvalidArgumentError("tensor_parallel_size " + t +
                                " must divide 8 (the fixed K-shards of the row-parallel "
                                "matmuls): use 1, 2, 4 or 8");
  }
  if (c.num_attention_heads % tp_size != 0) {
    return InvalidArgumentError("tensor_parallel_size " + t +
                                " must divide the model's num_attention_heads (" +
                                std::to_string(c.num_attention_heads) + ")");
  }
  const int nkv = c.num_key_value_heads;
  if (nkv <= 0 || (nkv % tp_size != 0 && tp_size % nkv != 0)) {
    return InvalidArgumentError("tensor_parallel_size " + t +
                                ": the model's num_key_value_heads (" + std::to_string(nkv) +
                                ") must be a multiple of it, or it a multiple of "
                                "num_key_value_heads (KV heads replicated)");
  }
  return OkStatus();
}

HeadRange TpKvHeads(int num_kv_heads, int tp_size, int rank) {
  if (num_kv_heads >= tp_size) {
    return {rank * num_kv_heads / tp_size, (rank + 1) * num_kv_heads / tp_size};
  }
  const int h = rank * num_kv_heads / tp_size;
  return {h, h + 1};
}

HeadRange TpQueryHeads(int num_attention_heads, int tp_size, int rank) {
  return {rank * num_attention_heads / tp_size, (rank + 1) * num_attention_heads / tp_size};
}

namespace {

// A rank's slice of a weight matrix, viewed in place in the model's weights (no copy):
// `rows` rows from `ptr` on, `ld` elements apart. Column-parallel slices (q/k/v, gate/up) are
// contiguous row ranges (ld = the matrix's cols); row-parallel ones (o_proj, down_proj) are
// the rank's K columns of every row (ptr at the first column, ld = the full row length).
struct WeightSlice {
  model_internal::WeightPtr ptr;
  int64_t rows = 0, ld = 0;
  model_internal::WeightPtr Row(int64_t r) const { return ptr.Offset(r * ld); }
};
WeightSlice RowsOf(const model_internal::Matrix& w, int begin, int n) {
  return {w.Row(begin), n, w.cols};
}
WeightSlice ColsOf(const model_internal::Matrix& w, int begin) {
  return {w.ptr.Offset(begin), w.rows, w.cols};
}
// A rank's slice of a bias: [begin, begin + n) of the model's fp32 vector, or empty.
struct BiasSlice {
  const float* data = nullptr;
  int n = 0;
  bool empty() const { return data == nullptr; }
};
BiasSlice BiasOf(const std::vector<float>& b, int begin, int n) {
  if (b.empty()) return {};
  return {b.data() + begin, n};
}

// Rank r's weight slices of one decoder layer: wq [q_cols][hidden], wk/wv [kv_cols][hidden],
// wo [hidden][q_cols], w_gate/w_up [im_cols][hidden], w_down [hidden][im_cols].
struct RankLayer {
  WeightSlice wq, wk, wv, wo, w_gate, w_up, w_down;
  BiasSlice bq, bk, bv;
};

struct RankSlice {
  HeadRange q_heads, kv_heads;
  int shard_begin = 0, shard_end = 0;  // row-parallel shards [begin, end)
  int q_col_begin = 0, q_cols = 0;     // attention output columns (= o_proj K range)
  int im_begin = 0, im_cols = 0;       // MLP intermediate columns (= down_proj K range)
  std::vector<RankLayer> layers;
  size_t bytes = 0;
};

// T-1 threads that each run rank r >= 1 of a job; the caller runs rank 0.
class RankTeam {
 public:
  explicit RankTeam(int ranks) {
    for (int r = 1; r < ranks; ++r) threads_.emplace_back([this, r] { Loop(r); });
  }
  ~RankTeam() {
    {
      MutexLock lock(&mu_);
      stop_ = true;
    }
    cv_.notify_all();
    for (auto& t : threads_) t.join();
  }
  RankTeam(const RankTeam&) = delete;
  RankTeam& operator=(const RankTeam&) = delete;

  // Runs fn(r) for every rank concurrently; returns when all returned. Not reentrant.
  void Run(const std::function<void(int)>& fn) {
    {
      MutexLock lock(&mu_);
      job_ = &fn;
      pending_ = static_cast<int>(threads_.size());
      ++generation_;
    }
    cv_.notify_all();
    fn(0);
    MutexLock lock(&mu_);
    done_cv_.wait(lock.native(), [&]() REQUIRES(mu_) { return pending_ == 0; });
    job_ = nullptr;
  }

 private:
  void Loop(int rank) {
    uint64_t seen = 0;
    for (;;) {
      const std::function<void(int)>* job;
      {
        MutexLock lock(&mu_);
        cv_.wait(lock.native(), [&]() REQUIRES(mu_) { return stop_ || generation_ != seen; });
        if (stop_) return;
        seen = generation_;
        job = job_;
      }
      (*job)(rank);
      MutexLock lock(&mu_);
      if (--pending_ == 0) done_cv_.notify_all();
    }
  }

  Mutex mu_;
  std::condition_variable cv_, done_cv_;
  const std::function<void(int)>* job_ GUARDED_BY(mu_) = nullptr;
  uint64_t generation_ GUARDED_BY(mu_) = 0;
  int pending_ GUARDED_BY(mu_) = 0;
  bool stop_ GUARDED_BY(mu_) = false;
  std::vector<std::thread> threads_;
};

}  // namespace

struct TensorParallelModel::Impl {
  std::shared_ptr<const Model> model;
  int tp = 1;
  std::vector<RankSlice> ranks;
  size_t replicated_bytes = 0;
  std::unique_ptr<RankTeam> team;           // null at tp 1
  std::unique_ptr<std::barrier<>> barrier;  // tp participants; null at tp 1
  mutable Mutex forward_mu;                 // one Forward at a time (team + barrier)

  Status ForwardTp(const ForwardBatch& batch, std::span<const PagedKvView> rank_kv,
                   std::vector<float>* logits) const;
};

TensorParallelModel::TensorParallelModel(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
TensorParallelModel::~TensorParallelModel() = default;

Result<std::unique_ptr<TensorParallelModel>> TensorParallelModel::Create(
    std::shared_ptr<const Model> model, int tp_size) {
  if (model == nullptr) return InvalidArgumentError("tensor parallel: no model");
  const ModelConfig& c = model->config();
  RETURN_IF_ERROR(ValidateTensorParallelSize(c, tp_size));
  if (model->weightless_spec() != nullptr) {
    return FailedPreconditionError(
        "tensor parallel: the model is weightless (a random-model preset without a model "
        "directory): the CPU forward pass needs weights; use --device cuda, or write the preset "
        "with `kvbridge make-model --preset NAME --out DIR` and serve DIR");
  }
  auto impl = std::make_unique<Impl>();
  impl->model = model;
  impl->tp = tp_size;
  const model_internal::Weights& w = model->impl().weights;
  const int hd = c.head_dim, qd = c.q_dim(), im = c.intermediate_size;
  impl->replicated_bytes = w.embed.bytes() + w.lm_head.bytes() + w.final_norm.size() * 4;
  for (const auto& l : w.layers) {
    impl->replicated_bytes += (l.input_norm.size() + l.post_norm.size() + l.bo.size() +
                               l.q_norm.size() + l.k_norm.size()) *
                              4;
  }
  auto slice_bytes = [](const WeightSlice& v, int64_t cols, model_internal::WeightType t) {
    return static_cast<size_t>(v.rows * cols) * model_internal::WeightTypeSize(t);
  };
  for (int r = 0; r < tp_size; ++r) {
    RankSlice& s = impl->ranks.emplace_back();
    s.q_heads = TpQueryHeads(c.num_attention_heads, tp_size, r);
    s.kv_heads = TpKvHeads(c.num_key_value_heads, tp_size, r);
    s.shard_begin = r * kRowParallelShards / tp_size;
    s.shard_end = (r + 1) * kRowParallelShards / tp_size;
    s.q_col_begin = ShardBegin(s.shard_begin, qd);
    s.q_cols = ShardBegin(s.shard_end, qd) - s.q_col_begin;
    s.im_begin = ShardBegin(s.shard_begin, im);
    s.im_cols = ShardBegin(s.shard_end, im) - s.im_begin;
    if (s.q_col_begin != s.q_heads.begin * hd || s.q_cols != s.q_heads.size() * hd) {
      return InternalError("tensor parallel: query heads not aligned with the K-shards");
    }
    const int kv_row = s.kv_heads.begin * hd, kv_rows = s.kv_heads.size() * hd;
    for (const auto& l : w.layers) {
      RankLayer& rl = s.layers.emplace_back();
      rl.wq = RowsOf(l.wq, s.q_col_begin, s.q_cols);
      rl.wk = RowsOf(l.wk, kv_row, kv_rows);
      rl.wv = RowsOf(l.wv, kv_row, kv_rows);
      rl.bq = BiasOf(l.bq, s.q_col_begin, s.q_cols);
      rl.bk = BiasOf(l.bk, kv_row, kv_rows);
      rl.bv = BiasOf(l.bv, kv_row, kv_rows);
      rl.wo = ColsOf(l.wo, s.q_col_begin);
      rl.w_gate = RowsOf(l.w_gate, s.im_begin, s.im_cols);
      rl.w_up = RowsOf(l.w_up, s.im_begin, s.im_cols);
      rl.w_down = ColsOf(l.w_down, s.im_begin);
      const int64_t hsz = c.hidden_size;
      s.bytes += slice_bytes(rl.wq, hsz, l.wq.type()) + slice_bytes(rl.wk, hsz, l.wk.type()) +
                 slice_bytes(rl.wv, hsz, l.wv.type()) + slice_bytes(rl.wo, s.q_cols, l.wo.type()) +
                 slice_bytes(rl.w_gate, hsz, l.w_gate.type()) +
                 slice_bytes(rl.w_up, hsz, l.w_up.type()) +
                 slice_bytes(rl.w_down, s.im_cols, l.w_down.type()) +
                 (static_cast<size_t>(rl.bq.n) + rl.bk.n + rl.bv.n) * 4;
    }
  }
  if (tp_size > 1) {
    impl->team = std::make_unique<RankTeam>(tp_size);
    impl->barrier = std::make_unique<std::barrier<>>(tp_size);
  }
  return std::unique_ptr<TensorParallelModel>(new TensorParallelModel(std::move(impl)));
}

int TensorParallelModel::tp_size() const { return impl_->tp; }
const Model& TensorParallelModel::model() const { return *impl_->model; }
HeadRange TensorParallelModel::kv_heads(int rank) const { return impl_->ranks.at(rank).kv_heads; }
size_t TensorParallelModel::RankWeightBytes(int rank) const { return impl_->ranks.at(rank).bytes; }
size_t TensorParallelModel::ReplicatedWeightBytes() const { return impl_->replicated_bytes; }

PagedKvLayout TensorParallelModel::KvLayout(int rank, int num_blocks, int block_size,
                                            KvDtype dtype) const {
  PagedKvLayout l = impl_->model->KvLayout(num_blocks, block_size, dtype);
  l.num_kv_heads = kv_heads(rank).size();
  return l;
}

Status TensorParallelModel::Forward(const ForwardBatch& batch, std::span<const PagedKvView> rank_kv,
                                    std::vector<float>* logits) const {
  if (static_cast<int>(rank_kv.size()) != impl_->tp) {
    return InvalidArgumentError("Forward: " + std::to_string(rank_kv.size()) +
                                " KV views for tensor_parallel_size " + std::to_string(impl_->tp));
  }
  if (impl_->tp == 1) return impl_->model->Forward(batch, rank_kv[0], logits);
  MutexLock lock(&impl_->forward_mu);
  return impl_->ForwardTp(batch, rank_kv, logits);
}

Status TensorParallelModel::Impl::ForwardTp(const ForwardBatch& batch,
                                            std::span<const PagedKvView> rank_kv,
                                            std::vector<float>* logits) const {
  const Model::Impl& mi = model->impl();
  const ModelConfig& c = mi.config;
  if (logits == nullptr) return InvalidArgumentError("Forward: logits must not be null");
  for (int r = 0; r < tp; ++r) {
    Status st = model_internal::CheckView(c, rank_kv[r], ranks[r].kv_heads.size());
    if (!st.ok()) return st.WithPrefix("rank " + std::to_string(r));
    const PagedKvLayout& a = rank_kv[0].layout;
    const PagedKvLayout& b = rank_kv[r].layout;
    if (a.block_size != b.block_size || a.num_blocks != b.num_blocks || a.dtype != b.dtype) {
      return InvalidArgumentError("Forward: rank " + std::to_string(r) +
                                  "'s KV view differs from rank 0's in block size, block count "
                                  "or dtype (the block table is shared by all ranks)");
    }
  }
  std::vector<Row> rows;
  std::vector<int> logit_rows;
  RETURN_IF_ERROR(model_internal::BuildRows(c, rank_kv[0].layout, batch, &rows, &logit_rows));

  const int m = static_cast<int>(rows.size());
  const int hd = c.head_dim, hsz = c.hidden_size, vocab = c.vocab_size;
  const int nl = static_cast<int>(logit_rows.size());
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float attn_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const model_internal::Weights& w = mi.weights;
  const model_internal::Matrix& head = w.LmHead();
  const size_t stride = static_cast<size_t>(m) * hsz;

  // Shared step buffers: the residual stream, its normed copy and every shard's partial sums.
  std::vector<float> x(stride), h(stride), partial(kRowParallelShards * stride);
  logits->assign(static_cast<size_t>(nl) * vocab, 0.0f);
  float* out_logits = logits->data();
  const bool hook = static_cast<bool>(batch.on_layer_kv_written);
  // With more model threads than ranks (ModelLoadOptions::num_threads > T), each rank also
  // splits its matmuls and attention over the model's pool (shared by the ranks; it takes
  // concurrent callers). Splits only change which thread computes an element, never how.
  model_internal::ThreadPool* pool = mi.pool->num_threads() > tp ? mi.pool.get() : nullptr;
  auto par = [&](int64_t n, const std::function<void(int64_t, int64_t)>& fn) {
    if (pool == nullptr || n <= 1) {
      fn(0, n);
      return;
    }
    const int64_t per = 4 * (pool->num_threads() + tp - 1) / tp;
    pool->ParallelFor(n, std::max<int64_t>(1, (n + per - 1) / per), fn);
  };

  auto rank_fn = [&](int r) {
    const RankSlice& s = ranks[r];
    const PagedKvView& kv = rank_kv[r];
    const PagedKvLayout& layout = kv.layout;
    const int nq = s.q_heads.size(), nkv = s.kv_heads.size();
    const int qc = s.q_cols, kvc = nkv * hd, imc = s.im_cols;
    const int group = nq / nkv;  // this rank's query heads per KV head
    const int row_begin = r * m / tp, row_end = (r + 1) * m / tp;
    std::vector<float> q(static_cast<size_t>(m) * qc), k(static_cast<size_t>(m) * kvc), v(k.size()),
        attn(q.size()), gate(static_cast<size_t>(m) * imc), up(gate.size());
    auto linear = [&](const WeightSlice& wt, const BiasSlice& bias, int n, float* y) {
      par(n, [&](int64_t b, int64_t e) {
        MatMulNT(h.data(), m, hsz, wt.Row(b), static_cast<int>(e - b), static_cast<int>(wt.ld), hsz,
                 y + b, n);
      });
      if (!bias.empty()) {
        for (int i = 0; i < m; ++i) {
          for (int j = 0; j < n; ++j) y[static_cast<size_t>(i) * n + j] += bias.data[j];
        }
      }
    };
    // Partials of this rank's shards of a row-parallel matmul whose K columns [col_begin,
    // col_begin + cols) this rank holds in `in` ([m][cols]) and views in `wt` ([hsz] rows of
    // the full matrix, starting at column col_begin).
    auto shard_partials = [&](const float* in, const WeightSlice& wt, int k_total, int col_begin,
                              int cols) {
      for (int sh = s.shard_begin; sh < s.shard_end; ++sh) {
        const int k0 = ShardBegin(sh, k_total) - col_begin;
        const int k1 = ShardBegin(sh + 1, k_total) - col_begin;
        par(hsz, [&](int64_t b, int64_t e) {
          MatMulNT(in + k0, m, cols, wt.Row(b).Offset(k0), static_cast<int>(e - b),
                   static_cast<int>(wt.ld), k1 - k0,
                   partial.data() + static_cast<size_t>(sh) * stride + b, hsz);
        });
      }
    };
    // x[i] += tree(partials) (+ bias) for this rank's rows, then h = RMSNorm(x, norm).
    auto reduce_rows = [&](const std::vector<float>& bias, const std::vector<float>* norm) {
      for (int i = row_begin; i < row_end; ++i) {
        for (int j = 0; j < hsz; ++j) {
          const size_t e = static_cast<size_t>(i) * hsz + j;
          float t = model_internal::ShardTreeSum(partial.data() + e, stride);
          if (!bias.empty()) t += bias[j];
          x[e] += t;
        }
      }
      if (norm != nullptr) {
        model_internal::RmsNormRows(x.data(), row_begin, row_end, hsz, norm->data(), eps, h.data());
      }
    };

    for (int i = row_begin; i < row_end; ++i) {
      model_internal::WidenWeights(w.embed.Row(rows[i].token), hsz,
                                   x.data() + static_cast<size_t>(i) * hsz);
    }
    model_internal::RmsNormRows(x.data(), row_begin, row_end, hsz, w.layers[0].input_norm.data(),
                                eps, h.data());
    barrier->arrive_and_wait();

    for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
      const RankLayer& rl = s.layers[layer];
      const model_internal::LayerWeights& lw = w.layers[layer];
      uint8_t* base = kv.layer_base[layer];
      const float ks = kv.k_scale[layer], vs = kv.v_scale[layer];

      linear(rl.wq, rl.bq, qc, q.data());
      linear(rl.wk, rl.bk, kvc, k.data());
      linear(rl.wv, rl.bv, kvc, v.data());
      if (c.qk_norm) {  // per-head norms, replicated: each rank normalizes its own heads
        model_internal::RmsNormRows(q.data(), 0, m * nq, hd, lw.q_norm.data(), eps, q.data());
        model_internal::RmsNormRows(k.data(), 0, m * nkv, hd, lw.k_norm.data(), eps, k.data());
      }
      for (int i = 0; i < m; ++i) {
        for (int hh = 0; hh < nq; ++hh) {
          model_internal::ApplyRope(q.data() + static_cast<size_t>(i) * qc + hh * hd, hd,
                                    rows[i].pos, mi.rope_cos.data(), mi.rope_sin.data());
        }
        for (int g = 0; g < nkv; ++g) {
          model_internal::ApplyRope(k.data() + static_cast<size_t>(i) * kvc + g * hd, hd,
                                    rows[i].pos, mi.rope_cos.data(), mi.rope_sin.data());
        }
      }
      for (int i = 0; i < m; ++i) {
        const SequenceChunk& sq = batch.sequences[rows[i].seq];
        const int block = sq.block_table[rows[i].pos / layout.block_size];
        const int slot = rows[i].pos % layout.block_size;
        for (int g = 0; g < nkv; ++g) {
          model_internal::StoreKv(k.data() + static_cast<size_t>(i) * kvc + g * hd, hd,
                                  layout.dtype, ks, base + layout.Offset(block, 0, g, slot));
          model_internal::StoreKv(v.data() + static_cast<size_t>(i) * kvc + g * hd, hd,
                                  layout.dtype, vs, base + layout.Offset(block, 1, g, slot));
        }
      }
      if (hook) {
        barrier->arrive_and_wait();  // every rank has written this layer's KV
        if (r == 0) batch.on_layer_kv_written(layer);
      }

      // One task per (row, this rank's KV head).
      par(static_cast<int64_t>(m) * nkv, [&](int64_t tb, int64_t te) {
        model_internal::AttentionScratch scratch(group, hd);
        for (int64_t task = tb; task < te; ++task) {
          const int i = static_cast<int>(task / nkv), g = static_cast<int>(task % nkv);
          const size_t off = static_cast<size_t>(i) * qc + static_cast<size_t>(g) * group * hd;
          model_internal::AttendKvHead(q.data() + off, group, batch.sequences[rows[i].seq],
                                       rows[i].pos, layout, base, g, ks, vs, attn_scale, &scratch,
                                       attn.data() + off);
        }
      });
      shard_partials(attn.data(), rl.wo, c.q_dim(), s.q_col_begin, qc);
      barrier->arrive_and_wait();
      reduce_rows(lw.bo, &lw.post_norm);
      barrier->arrive_and_wait();

      linear(rl.w_gate, {}, imc, gate.data());
      linear(rl.w_up, {}, imc, up.data());
      model_internal::SiluMul(gate.data(), up.data(), static_cast<int64_t>(gate.size()));
      shard_partials(gate.data(), rl.w_down, c.intermediate_size, s.im_begin, imc);
      barrier->arrive_and_wait();
      const bool last = layer + 1 == c.num_hidden_layers;
      reduce_rows({}, last ? nullptr : &w.layers[layer + 1].input_norm);
      barrier->arrive_and_wait();
    }

    // Logits of this rank's vocab range (lm_head replicated).
    std::vector<float> last(static_cast<size_t>(nl) * hsz), normed(last.size());
    for (int lr = 0; lr < nl; ++lr) {
      std::memcpy(last.data() + static_cast<size_t>(lr) * hsz,
                  x.data() + static_cast<size_t>(logit_rows[lr]) * hsz, hsz * 4);
    }
    model_internal::RmsNormRows(last.data(), 0, nl, hsz, w.final_norm.data(), eps, normed.data());
    const int v0 = r * vocab / tp, v1 = (r + 1) * vocab / tp;
    par(v1 - v0, [&](int64_t b, int64_t e) {
      MatMulNT(normed.data(), nl, hsz, head.Row(v0 + b), static_cast<int>(e - b), hsz, hsz,
               out_logits + v0 + b, vocab);
    });
  };
  team->Run(rank_fn);
  return OkStatus();
}

}  // namespace kvbridge

// The batch-invariant forward pass (DESIGN.md "The model and its numerics").
//
// Every row (token) of the batch is computed by arithmetic that depends only on that row and on
// the KV of its sequence: matmuls use the fixed-order kernel (kernels.h), row-parallel matmuls
// sum kRowParallelShards fixed K-shards in a fixed tree, and attention walks positions
// [0, pos] in kAttentionChunk-aligned chunks reading K/V back through the cache dtype.
// Code is organized by head range and shard range so a TP rank can compute its slice.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>

#include "model/forward_internal.h"
#include "model/kernels.h"
#include "model/model_impl.h"
#include "model/numerics.h"

namespace kvbridge {
namespace model_internal {

Status CheckView(const ModelConfig& c, const PagedKvView& kv, int expected_kv_heads) {
  const PagedKvLayout& l = kv.layout;
  if (l.num_layers != c.num_hidden_layers || l.num_kv_heads != expected_kv_heads ||
      l.head_dim != c.head_dim) {
    return InvalidArgumentError(
        "KV view layout (layers " + std::to_string(l.num_layers) + ", kv heads " +
        std::to_string(l.num_kv_heads) + ", head_dim " + std::to_string(l.head_dim) +
        ") does not match the model (" + std::to_string(c.num_hidden_layers) + ", " +
        std::to_string(expected_kv_heads) + ", " + std::to_string(c.head_dim) + ")");
  }
  if (l.block_size <= 0 || l.num_blocks < 0) {
    return InvalidArgumentError("KV view: block_size must be > 0 and num_blocks >= 0");
  }
  if (l.dtype != KvDtype::kFp32 && l.dtype != KvDtype::kBf16 && l.dtype != KvDtype::kFp8E4M3) {
    return InvalidArgumentError("KV view: unknown dtype");
  }
  if (static_cast<int>(kv.layer_base.size()) != l.num_layers ||
      static_cast<int>(kv.k_scale.size()) != l.num_layers ||
      static_cast<int>(kv.v_scale.size()) != l.num_layers) {
    return InvalidArgumentError(
        "KV view: layer_base, k_scale and v_scale need one entry per layer");
  }
  for (int i = 0; i < l.num_layers; ++i) {
    if (kv.layer_base[i] == nullptr) return InvalidArgumentError("KV view: null layer_base");
    for (float s : {kv.k_scale[i], kv.v_scale[i]}) {
      if (!(s > 0) || !std::isfinite(s)) {
        return InvalidArgumentError("KV view: scales must be finite and > 0");
      }
    }
  }
  return OkStatus();
}

Status BuildRows(const ModelConfig& c, const PagedKvLayout& layout, const ForwardBatch& batch,
                 std::vector<Row>* rows, std::vector<int>* logit_rows) {
  int64_t total = 0;
  for (size_t s = 0; s < batch.sequences.size(); ++s) {
    const SequenceChunk& q = batch.sequences[s];
    const std::string where = "Forward: sequence " + std::to_string(s) + ": ";
    if (q.num_tokens <= 0 || q.tokens == nullptr) {
      return InvalidArgumentError(where + "needs num_tokens >= 1 and tokens");
    }
    total += q.num_tokens;
    if (total > (1 << 20)) return InvalidArgumentError(where + "batch holds over 2^20 tokens");
    if (q.start_pos < 0 ||
        static_cast<int64_t>(q.start_pos) + q.num_tokens > c.max_position_embeddings) {
      return InvalidArgumentError(where + "positions [" + std::to_string(q.start_pos) + ", " +
                                  std::to_string(int64_t{q.start_pos} + q.num_tokens) +
                                  ") exceed max_position_embeddings " +
                                  std::to_string(c.max_position_embeddings));
    }
    const int64_t end = static_cast<int64_t>(q.start_pos) + q.num_tokens;
    const int64_t blocks_needed = (end + layout.block_size - 1) / layout.block_size;
    if (q.block_table == nullptr || q.num_blocks < blocks_needed) {
      return InvalidArgumentError(where + "block table has " + std::to_string(q.num_blocks) +
                                  " blocks, positions up to " + std::to_string(end) + " need " +
                                  std::to_string(blocks_needed));
    }
    for (int64_t b = 0; b < blocks_needed; ++b) {
      if (q.block_table[b] < 0 || q.block_table[b] >= layout.num_blocks) {
        return InvalidArgumentError(where + "block id " + std::to_string(q.block_table[b]) +
                                    " outside the cache's " + std::to_string(layout.num_blocks) +
                                    " blocks");
      }
    }
    for (int t = 0; t < q.num_tokens; ++t) {
      if (q.tokens[t] < 0 || q.tokens[t] >= c.vocab_size) {
        return InvalidArgumentError(where + "token id " + std::to_string(q.tokens[t]) +
                                    " outside the vocabulary of " + std::to_string(c.vocab_size));
      }
      rows->push_back({static_cast<int>(s), q.start_pos + t, q.tokens[t]});
    }
    if (q.compute_logits) logit_rows->push_back(static_cast<int>(rows->size()) - 1);
  }
  return OkStatus();
}

void StoreKv(const float* src, int n, KvDtype dtype, float scale, uint8_t* dst) {
  switch (dtype) {
    case KvDtype::kFp32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      break;
    case KvDtype::kBf16:
      for (int i = 0; i < n; ++i) {
        const uint16_t h = FloatToBf16(src[i]);
        std::memcpy(dst + 2 * i, &h, 2);
      }
      break;
    case KvDtype::kFp8E4M3:
      for (int i = 0; i < n; ++i) dst[i] = FloatToFp8E4M3(src[i] / scale);
      break;
  }
}

void LoadKv(const uint8_t* src, int n, KvDtype dtype, float scale, float* dst) {
  switch (dtype) {
    case KvDtype::kFp32:
      std::memcpy(dst, src, static_cast<size_t>(n) * 4);
      break;
    case KvDtype::kBf16:  // exact widening (vectorized in kernels.cc)
      WidenWeights(WeightPtr{src, WeightType::kBf16}, n, dst);
      break;
    case KvDtype::kFp8E4M3:
      for (int i = 0; i < n; ++i) dst[i] = Fp8E4M3ToFloat(src[i]) * scale;
      break;
  }
}

// HF LlamaRMSNorm: x * rsqrt(mean(x^2) + eps), then * w. `y` may be `x` (in place).
void RmsNormRows(const float* x, int row_begin, int row_end, int h, const float* w, float eps,
                 float* y) {
  for (int i = row_begin; i < row_end; ++i) {
    const float* xr = x + static_cast<size_t>(i) * h;
    float* yr = y + static_cast<size_t>(i) * h;
    const float ss = Dot(xr, xr, h);
    const float inv = 1.0f / std::sqrt(ss / static_cast<float>(h) + eps);
    for (int j = 0; j < h; ++j) yr[j] = w[j] * (xr[j] * inv);
  }
}

void ApplyRope(float* vec, int head_dim, int pos, const float* rope_cos, const float* rope_sin) {
  const int half = head_dim / 2;
  const float* cs = rope_cos + static_cast<size_t>(pos) * half;
  const float* sn = rope_sin + static_cast<size_t>(pos) * half;
  for (int i = 0; i < half; ++i) {
    const float x1 = vec[i], x2 = vec[i + half];
    vec[i] = x1 * cs[i] - x2 * sn[i];
    vec[i + half] = x2 * cs[i] + x1 * sn[i];
  }
}

AttentionScratch::AttentionScratch(int group, int head_dim)
    : kbuf(static_cast<size_t>(kAttentionChunk) * head_dim),
      vbuf(static_cast<size_t>(kAttentionChunk) * head_dim),
      scores(static_cast<size_t>(group) * kAttentionChunk),
      acc(static_cast<size_t>(group) * head_dim),
      mx(group),
      den(group) {}

void AttendKvHead(const float* qg, int group, const SequenceChunk& sq, int pos,
                  const PagedKvLayout& layout, const uint8_t* base, int kv_head, float k_scale,
                  float v_scale, float attn_scale, AttentionScratch* s, float* out) {
  const int hd = layout.head_dim;
  std::fill(s->acc.begin(), s->acc.end(), 0.0f);
  std::fill(s->mx.begin(), s->mx.end(), -std::numeric_limits<float>::infinity());
  std::fill(s->den.begin(), s->den.end(), 0.0f);
  for (int c0 = 0; c0 <= pos; c0 += kAttentionChunk) {
    const int n = std::min(kAttentionChunk, pos + 1 - c0);
    // The chunk's positions in runs of consecutive slots of one block: a run's K rows (and V
    // rows) are contiguous in the cache. scores[j][t] = q_j . k_t (the fixed-order dot:
    // MatMulNT gives the same bits for any n and tile), read straight from the cache when it
    // holds fp32 or bf16 (the kernel widens bf16 exactly, as LoadKv does); V widened per run.
    for (int t = 0; t < n;) {
      const int p = c0 + t;
      const int block = sq.block_table[p / layout.block_size];
      const int slot = p % layout.block_size;
      const int run = std::min(n - t, layout.block_size - slot);
      const uint8_t* kp = base + layout.Offset(block, 0, kv_head, slot);
      const uint8_t* vp = base + layout.Offset(block, 1, kv_head, slot);
      float* sc = s->scores.data() + t;
      if (layout.dtype == KvDtype::kFp32) {
        MatMulNT(qg, group, hd, WeightPtr{kp, WeightType::kF32}, run, hd, hd, sc, kAttentionChunk);
      } else if (layout.dtype == KvDtype::kBf16) {
        MatMulNT(qg, group, hd, WeightPtr{kp, WeightType::kBf16}, run, hd, hd, sc, kAttentionChunk);
      } else {
        LoadKv(kp, run * hd, layout.dtype, k_scale, s->kbuf.data());
        MatMulNT(qg, group, hd, s->kbuf.data(), run, hd, hd, sc, kAttentionChunk);
      }
      LoadKv(vp, run * hd, layout.dtype, v_scale, s->vbuf.data() + static_cast<size_t>(t) * hd);
      t += run;
    }
    // Online softmax per query head (kernels.h: fixed operation order on every path).
    for (int j = 0; j < group; ++j) {
      OnlineSoftmaxChunk(s->scores.data() + static_cast<size_t>(j) * kAttentionChunk, n, attn_scale,
                         s->vbuf.data(), hd, &s->mx[j], &s->den[j],
                         s->acc.data() + static_cast<size_t>(j) * hd);
    }
  }
  for (int j = 0; j < group; ++j) {
    for (int d = 0; d < hd; ++d) out[j * hd + d] = s->acc[j * hd + d] / s->den[j];
  }
}

}  // namespace model_internal

using model_internal::kRowParallelShards;
using model_internal::MatMulNT;
using model_internal::Row;

Status Model::Impl::Forward(const ForwardBatch& batch, const PagedKvView& kv,
                            std::vector<float>* logits) const {
  const ModelConfig& c = config;
  if (logits == nullptr) return InvalidArgumentError("Forward: logits must not be null");
  RETURN_IF_ERROR(model_internal::CheckView(c, kv, c.num_key_value_heads));
  const PagedKvLayout& layout = kv.layout;

  // ---- validate every sequence before touching the cache ----
  std::vector<Row> rows;
  std::vector<int> logit_rows;
  RETURN_IF_ERROR(model_internal::BuildRows(c, layout, batch, &rows, &logit_rows));

  const int m = static_cast<int>(rows.size());
  const int hd = c.head_dim, nh = c.num_attention_heads, nkv = c.num_key_value_heads;
  const int hsz = c.hidden_size, qd = c.q_dim(), kvd = c.kv_dim(), im = c.intermediate_size;
  const int group = nh / nkv;
  const float eps = static_cast<float>(c.rms_norm_eps);
  const float attn_scale = 1.0f / std::sqrt(static_cast<float>(hd));
  const int threads = pool->num_threads();
  auto grain_for = [&](int64_t n) {
    return std::max<int64_t>(1, (n + 4 * threads - 1) / (4 * threads));
  };

  // y[m][n] = x[m][k] . w[n][k] (+ bias), parallel over output columns.
  auto linear = [&](const float* x, const model_internal::Matrix& w, const std::vector<float>& bias,
                    float* y) {
    const int n = static_cast<int>(w.rows);
    pool->ParallelFor(n, grain_for(n), [&](int64_t b, int64_t e) {
      model_internal::LinearSlice(x, m, w, b, e, y, n);
    });
    if (!bias.empty()) {
      for (int i = 0; i < m; ++i) {
        for (int j = 0; j < n; ++j) y[static_cast<size_t>(i) * n + j] += bias[j];
      }
    }
  };
  // Row-parallel: shard s covers K range [s*k/S, (s+1)*k/S); y = fixed tree over shards.
  // A TP rank would compute its shards' partials and exchange them; the tree stays the same.
  std::vector<float> partial;
  auto row_parallel = [&](const float* x, const model_internal::Matrix& w,
                          const std::vector<float>& bias, float* y) {
    const int n = static_cast<int>(w.rows), k = static_cast<int>(w.cols);
    partial.resize(static_cast<size_t>(kRowParallelShards) * m * n);
    pool->ParallelFor(n, grain_for(n), [&](int64_t b, int64_t e) {
      for (int s = 0; s < kRowParallelShards; ++s) {
        const int k0 = model_internal::ShardBegin(s, k), k1 = model_internal::ShardBegin(s + 1, k);
        MatMulNT(x + k0, m, k, w.Row(b).Offset(k0), static_cast<int>(e - b), k, k1 - k0,
                 partial.data() + static_cast<size_t>(s) * m * n + b, n);
      }
      const size_t stride = static_cast<size_t>(m) * n;
      for (int i = 0; i < m; ++i) {
        for (int64_t j = b; j < e; ++j) {
          float v =
              model_internal::ShardTreeSum(partial.data() + static_cast<size_t>(i) * n + j, stride);
          if (!bias.empty()) v += bias[j];
          y[static_cast<size_t>(i) * n + j] = v;
        }
      }
    });
  };
  static_assert(kRowParallelShards == 8, "the sum tree above is written for 8 shards");

  std::vector<float> x(static_cast<size_t>(m) * hsz), h(x.size()), tmp(x.size());
  std::vector<float> q(static_cast<size_t>(m) * qd), k(static_cast<size_t>(m) * kvd),
      v(static_cast<size_t>(m) * kvd), attn(static_cast<size_t>(m) * qd);
  std::vector<float> gate(static_cast<size_t>(m) * im), up(gate.size());
  for (int i = 0; i < m; ++i) {
    model_internal::WidenWeights(weights.embed.Row(rows[i].token), hsz,
                                 x.data() + static_cast<size_t>(i) * hsz);
  }
  auto rope = [&](float* vec, int pos) {
    model_internal::ApplyRope(vec, hd, pos, rope_cos.data(), rope_sin.data());
  };

  for (int layer = 0; layer < c.num_hidden_layers; ++layer) {
    const model_internal::LayerWeights& w = weights.layers[layer];
    uint8_t* base = kv.layer_base[layer];
    const float ks = kv.k_scale[layer], vs = kv.v_scale[layer];

    model_internal::RmsNormRows(x.data(), 0, m, hsz, w.input_norm.data(), eps, h.data());
    linear(h.data(), w.wq, w.bq, q.data());
    linear(h.data(), w.wk, w.bk, k.data());
    linear(h.data(), w.wv, w.bv, v.data());
    if (c.qk_norm) {  // Qwen3: RMSNorm of every q and k head vector, before RoPE
      model_internal::RmsNormRows(q.data(), 0, m * nh, hd, w.q_norm.data(), eps, q.data());
      model_internal::RmsNormRows(k.data(), 0, m * nkv, hd, w.k_norm.data(), eps, k.data());
    }
    for (int i = 0; i < m; ++i) {
      for (int hh = 0; hh < nh; ++hh)
        rope(q.data() + static_cast<size_t>(i) * qd + hh * hd, rows[i].pos);
      for (int g = 0; g < nkv; ++g)
        rope(k.data() + static_cast<size_t>(i) * kvd + g * hd, rows[i].pos);
    }
    // Write this step's K/V into the cache; attention then reads every position back from it.
    for (int i = 0; i < m; ++i) {
      const SequenceChunk& sq = batch.sequences[rows[i].seq];
      const int block = sq.block_table[rows[i].pos / layout.block_size];
      const int slot = rows[i].pos % layout.block_size;
      for (int g = 0; g < nkv; ++g) {
        model_internal::StoreKv(k.data() + static_cast<size_t>(i) * kvd + g * hd, hd, layout.dtype,
                                ks, base + layout.Offset(block, 0, g, slot));
        model_internal::StoreKv(v.data() + static_cast<size_t>(i) * kvd + g * hd, hd, layout.dtype,
                                vs, base + layout.Offset(block, 1, g, slot));
      }
    }
    if (batch.on_layer_kv_written) batch.on_layer_kv_written(layer);

    // Attention, one task per (row, kv head): the `group` query heads sharing that KV head.
    const int64_t tasks = static_cast<int64_t>(m) * nkv;
    pool->ParallelFor(tasks, grain_for(tasks), [&](int64_t tb, int64_t te) {
      model_internal::AttentionScratch scratch(group, hd);
      for (int64_t task = tb; task < te; ++task) {
        const int i = static_cast<int>(task / nkv), g = static_cast<int>(task % nkv);
        const size_t off = static_cast<size_t>(i) * qd + static_cast<size_t>(g) * group * hd;
        model_internal::AttendKvHead(q.data() + off, group, batch.sequences[rows[i].seq],
                                     rows[i].pos, layout, base, g, ks, vs, attn_scale, &scratch,
                                     attn.data() + off);
      }
    });

    row_parallel(attn.data(), w.wo, w.bo, tmp.data());
    for (size_t e = 0; e < x.size(); ++e) x[e] += tmp[e];

    model_internal::RmsNormRows(x.data(), 0, m, hsz, w.post_norm.data(), eps, h.data());
    linear(h.data(), w.w_gate, {}, gate.data());
    linear(h.data(), w.w_up, {}, up.data());
    model_internal::SiluMul(gate.data(), up.data(), static_cast<int64_t>(gate.size()));
    row_parallel(gate.data(), w.w_down, {}, tmp.data());
    for (size_t e = 0; e < x.size(); ++e) x[e] += tmp[e];
  }

  // Logits for the requested rows only.
  const int nl = static_cast<int>(logit_rows.size());
  std::vector<float> last(static_cast<size_t>(nl) * hsz), normed(last.size());
  for (int r = 0; r < nl; ++r) {
    std::memcpy(last.data() + static_cast<size_t>(r) * hsz,
                x.data() + static_cast<size_t>(logit_rows[r]) * hsz, hsz * 4);
  }
  model_internal::RmsNormRows(last.data(), 0, nl, hsz, weights.final_norm.data(), eps,
                              normed.data());
  logits->assign(static_cast<size_t>(nl) * c.vocab_size, 0.0f);
  const model_internal::Matrix& head = weights.LmHead();
  const int vocab = c.vocab_size;
  pool->ParallelFor(vocab, grain_for(vocab), [&](int64_t b, int64_t e) {
    model_internal::LinearSlice(normed.data(), nl, head, b, e, logits->data(), vocab);
  });
  return OkStatus();
}

}  // namespace kvbridge

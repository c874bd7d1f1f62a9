#include "kvbridge/model/model.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <thread>

#include "kvbridge/model/safetensors.h"
#include "model/model_impl.h"
#include "model/rope.h"

namespace kvbridge {
namespace model_internal {

std::vector<TensorSlot> TensorSlots(const ModelConfig& c, Weights* w) {
  const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), im = c.intermediate_size,
                v = c.vocab_size;
  std::vector<TensorSlot> s;
  w->layers.resize(c.num_hidden_layers);
  s.push_back({"model.embed_tokens.weight", {v, h}, &w->embed});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& lw = w->layers[l];
    s.push_back({p + "input_layernorm.weight", {h}, &lw.input_norm});
    s.push_back({p + "self_attn.q_proj.weight", {q, h}, &lw.wq});
    s.push_back({p + "self_attn.k_proj.weight", {kv, h}, &lw.wk});
    s.push_back({p + "self_attn.v_proj.weight", {kv, h}, &lw.wv});
    if (c.qk_norm) {
      s.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, &lw.q_norm});
      s.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, &lw.k_norm});
    }
    if (c.qkv_bias) {
      s.push_back({p + "self_attn.q_proj.bias", {q}, &lw.bq});
      s.push_back({p + "self_attn.k_proj.bias", {kv}, &lw.bk});
      s.push_back({p + "self_attn.v_proj.bias", {kv}, &lw.bv});
    }
    s.push_back({p + "self_attn.o_proj.weight", {h, q}, &lw.wo});
    if (c.o_bias) s.push_back({p + "self_attn.o_proj.bias", {h}, &lw.bo});
    s.push_back({p + "post_attention_layernorm.weight", {h}, &lw.post_norm});
    s.push_back({p + "mlp.gate_proj.weight", {im, h}, &lw.w_gate});
    s.push_back({p + "mlp.up_proj.weight", {im, h}, &lw.w_up});
    s.push_back({p + "mlp.down_proj.weight", {h, im}, &lw.w_down});
  }
  s.push_back({"model.norm.weight", {h}, &w->final_norm});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {v, h}, &w->lm_head});
  return s;
}

}  // namespace model_internal

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;

Result<std::shared_ptr<Model>> Model::Load(const std::string& dir, ModelLoadOptions options) {
  auto impl = std::make_unique<Impl>();
  ASSIGN_OR_RETURN(impl->config, ModelConfig::FromFile(dir + "/config.json"));
  const ModelConfig& c = impl->config;
  ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::Load(dir, c));
  ASSIGN_OR_RETURN(TensorStore store, TensorStore::OpenDir(dir));

  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) return InternalError("XXH3_createState failed");
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(st, &XXH3_freeState);
  XXH3_128bits_reset(st);
  const std::string canonical = c.ToJson("").dump();  // keys sorted; dtype-independent
  XXH3_128bits_update(st, canonical.data(), canonical.size());

  auto slots = model_internal::TensorSlots(c, &impl->weights);
  std::sort(slots.begin(), slots.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  for (auto& slot : slots) {
    auto data = store.ReadFloat32(slot.name, slot.shape);
    if (!data.ok()) return data.status().WithPrefix(dir);
    *slot.dest = std::move(data).value();
    for (float f : *slot.dest) {
      if (!std::isfinite(f)) {
        return InvalidArgumentError(dir + ": tensor '" + slot.name + "' holds a non-finite value");
      }
    }
    XXH3_128bits_update(st, slot.name.data(), slot.name.size() + 1);  // with the NUL separator
    XXH3_128bits_update(st, slot.shape.data(), slot.shape.size() * sizeof(int64_t));
    XXH3_128bits_update(st, slot.dest->data(), slot.dest->size() * sizeof(float));
  }
  const XXH128_hash_t digest = XXH3_128bits_digest(st);
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(digest.high64),
                static_cast<unsigned long long>(digest.low64));
  impl->fingerprint = hex;

  // RoPE tables of the config's rope type (src/model/rope.h), computed in double and rounded
  // once to fp32 (deterministic, no fp32 drift at large positions).
  model_internal::BuildRopeTables(c, &impl->rope_cos, &impl->rope_sin);
  int threads = options.num_threads;
  if (threads <= 0) threads = std::clamp<int>(std::thread::hardware_concurrency(), 1, 8);
  impl->pool = std::make_unique<model_internal::ThreadPool>(threads);
  return std::shared_ptr<Model>(new Model(std::move(impl)));
}

const ModelConfig& Model::config() const { return impl_->config; }
const Tokenizer& Model::tokenizer() const { return impl_->tokenizer; }
const std::string& Model::fingerprint() const { return impl_->fingerprint; }

PagedKvLayout Model::KvLayout(int num_blocks, int block_size, KvDtype dtype) const {
  PagedKvLayout l;
  l.num_layers = impl_->config.num_hidden_layers;
  l.num_kv_heads = impl_->config.num_key_value_heads;
  l.head_dim = impl_->config.head_dim;
  l.block_size = block_size;
  l.num_blocks = num_blocks;
  l.dtype = dtype;
  return l;
}

void Model::KvScales(KvDtype dtype, std::vector<float>* k_scale,
                     std::vector<float>* v_scale) const {
  const size_t n = static_cast<size_t>(impl_->config.num_hidden_layers);
  if (dtype == KvDtype::kFp8E4M3) {
    *k_scale = impl_->config.fp8_k_scale;
    *v_scale = impl_->config.fp8_v_scale;
  } else {
    k_scale->assign(n, 1.0f);
    v_scale->assign(n, 1.0f);
  }
}

Status Model::Forward(const ForwardBatch& batch, const PagedKvView& kv,
                      std::vector<float>* logits) const {
  return impl_->Forward(batch, kv, logits);
}

LocalKvCache::LocalKvCache(const PagedKvLayout& layout, std::vector<float> k_scale,
                           std::vector<float> v_scale) {
  view_.layout = layout;
  layers_.resize(layout.num_layers);
  for (auto& l : layers_) {
    l.assign(layout.LayerBytes(), 0);
    view_.layer_base.push_back(l.data());
  }
  view_.k_scale = std::move(k_scale);
  view_.v_scale = std::move(v_scale);
}

}  // namespace kvbridge

#include "kvbridge/model/model.h"

#include <xxhash.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <thread>

#include "kvbridge/model/safetensors.h"
#include "model/model_impl.h"
#include "model/numerics.h"
#include "model/rope.h"

namespace kvbridge {
namespace model_internal {

std::vector<TensorSlot> TensorSlots(const ModelConfig& c, Weights* w) {
  const int64_t h = c.hidden_size, q = c.q_dim(), kv = c.kv_dim(), im = c.intermediate_size,
                v = c.vocab_size;
  std::vector<TensorSlot> s;
  w->layers.resize(c.num_hidden_layers);
  s.push_back({"model.embed_tokens.weight", {v, h}, nullptr, &w->embed});
  for (int l = 0; l < c.num_hidden_layers; ++l) {
    const std::string p = "model.layers." + std::to_string(l) + ".";
    LayerWeights& lw = w->layers[l];
    s.push_back({p + "input_layernorm.weight", {h}, &lw.input_norm});
    s.push_back({p + "self_attn.q_proj.weight", {q, h}, nullptr, &lw.wq});
    s.push_back({p + "self_attn.k_proj.weight", {kv, h}, nullptr, &lw.wk});
    s.push_back({p + "self_attn.v_proj.weight", {kv, h}, nullptr, &lw.wv});
    if (c.qk_norm) {
      s.push_back({p + "self_attn.q_norm.weight", {c.head_dim}, &lw.q_norm});
      s.push_back({p + "self_attn.k_norm.weight", {c.head_dim}, &lw.k_norm});
    }
    if (c.qkv_bias) {
      s.push_back({p + "self_attn.q_proj.bias", {q}, &lw.bq});
      s.push_back({p + "self_attn.k_proj.bias", {kv}, &lw.bk});
      s.push_back({p + "self_attn.v_proj.bias", {kv}, &lw.bv});
    }
    s.push_back({p + "self_attn.o_proj.weight", {h, q}, nullptr, &lw.wo});
    if (c.o_bias) s.push_back({p + "self_attn.o_proj.bias", {h}, &lw.bo});
    s.push_back({p + "post_attention_layernorm.weight", {h}, &lw.post_norm});
    s.push_back({p + "mlp.gate_proj.weight", {im, h}, nullptr, &lw.w_gate});
    s.push_back({p + "mlp.up_proj.weight", {im, h}, nullptr, &lw.w_up});
    s.push_back({p + "mlp.down_proj.weight", {h, im}, nullptr, &lw.w_down});
  }
  s.push_back({"model.norm.weight", {h}, &w->final_norm});
  if (!c.tie_word_embeddings) s.push_back({"lm_head.weight", {v, h}, nullptr, &w->lm_head});
  return s;
}

std::vector<float> Matrix::ToFloat32() const {
  std::vector<float> out(static_cast<size_t>(rows * cols));
  WidenWeights(ptr, rows * cols, out.data());
  return out;
}

namespace {

WeightType StoredType(const std::string& dtype) {
  if (dtype == "BF16") return WeightType::kBf16;
  if (dtype == "F16") return WeightType::kF16;
  return WeightType::kF32;  // F32, and F64 (converted to fp32)
}

// Element i of a stored float tensor as fp32 (F64 rounded once, as ReadFloat32 does).
float StoredValue(const TensorBytes& t, size_t i) {
  const char* d = t.data.data();
  if (t.dtype == "F64") {
    double v;
    std::memcpy(&v, d + 8 * i, 8);
    return static_cast<float>(v);
  }
  if (t.dtype == "F32") {
    float v;
    std::memcpy(&v, d + 4 * i, 4);
    return v;
  }
  uint16_t h;
  std::memcpy(&h, d + 2 * i, 2);
  return t.dtype == "BF16" ? Bf16ToFloat(h) : Fp16ToFloat(h);
}

// The stored tensor converted to `type` (round to nearest even when narrowing).
std::vector<uint8_t> ConvertTensor(const TensorBytes& t, size_t count, WeightType type) {
  std::vector<uint8_t> out(count * WeightTypeSize(type));
  for (size_t i = 0; i < count; ++i) {
    const float v = StoredValue(t, i);
    if (type == WeightType::kF32) {
      std::memcpy(out.data() + 4 * i, &v, 4);
    } else {
      const uint16_t h = type == WeightType::kBf16 ? FloatToBf16(v) : FloatToFp16(v);
      std::memcpy(out.data() + 2 * i, &h, 2);
    }
  }
  return out;
}

WeightType ResidentType(WeightDtype requested, WeightType stored) {
  switch (requested) {
    case WeightDtype::kAuto:
      return stored;
    case WeightDtype::kBfloat16:
      return WeightType::kBf16;
    case WeightDtype::kFloat16:
      return WeightType::kF16;
    case WeightDtype::kFloat32:
      return WeightType::kF32;
  }
  return stored;
}

}  // namespace
}  // namespace model_internal

Result<WeightDtype> ParseWeightDtype(std::string_view s) {
  if (s == "auto") return WeightDtype::kAuto;
  if (s == "bfloat16" || s == "bf16") return WeightDtype::kBfloat16;
  if (s == "float16" || s == "half" || s == "fp16") return WeightDtype::kFloat16;
  if (s == "float32" || s == "float" || s == "fp32") return WeightDtype::kFloat32;
  return InvalidArgumentError("unknown dtype '" + std::string(s) +
                              "' (expected auto, bfloat16, float16 or float32)");
}

const char* WeightDtypeName(WeightDtype d) {
  switch (d) {
    case WeightDtype::kAuto:
      return "auto";
    case WeightDtype::kBfloat16:
      return "bfloat16";
    case WeightDtype::kFloat16:
      return "float16";
    case WeightDtype::kFloat32:
      return "float32";
  }
  return "?";
}

Model::Model(std::unique_ptr<Impl> impl) : impl_(std::move(impl)) {}
Model::~Model() = default;

Result<std::shared_ptr<Model>> Model::Load(const std::string& dir, ModelLoadOptions options) {
  auto impl = std::make_unique<Impl>();
  ASSIGN_OR_RETURN(impl->config, ModelConfig::FromFile(dir + "/config.json"));
  const ModelConfig& c = impl->config;
  ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::Load(dir, c));
  ASSIGN_OR_RETURN(TensorStore opened, TensorStore::OpenDir(dir));
  auto store = std::make_shared<const TensorStore>(std::move(opened));
  impl->weight_file_bytes = store->FileBytes();

  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) return InternalError("XXH3_createState failed");
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(st, &XXH3_freeState);
  XXH3_128bits_reset(st);
  const std::string canonical = c.ToJson("").dump();  // keys sorted; dtype-independent
  XXH3_128bits_update(st, canonical.data(), canonical.size());

  using model_internal::WeightType;
  auto slots = model_internal::TensorSlots(c, &impl->weights);
  std::sort(slots.begin(), slots.end(),
            [](const auto& a, const auto& b) { return a.name < b.name; });
  bool any_view = false;
  size_t resident = 0;
  std::vector<float> chunk(4096);
  for (auto& slot : slots) {
    auto bytes = store->Bytes(slot.name, slot.shape);
    if (!bytes.ok()) return bytes.status().WithPrefix(dir);
    const TensorBytes& t = *bytes;
    size_t count = 1;
    for (int64_t d : t.shape) count *= static_cast<size_t>(d);
    const WeightType stored = model_internal::StoredType(t.dtype);
    const WeightType type = model_internal::ResidentType(options.dtype, stored);
    // The resident values: a view of the mapped bytes when the type is kept (and F32 data is
    // 4-byte aligned), else a converted copy.
    model_internal::WeightPtr values;
    std::vector<uint8_t> converted;
    const bool view =
        type == stored && t.dtype != "F64" &&
        (type != WeightType::kF32 || reinterpret_cast<uintptr_t>(t.data.data()) % 4 == 0);
    if (view) {
      values = {t.data.data(), type};
    } else {
      converted = model_internal::ConvertTensor(t, count, type);
      values = {converted.data(), type};
    }
    if (slot.matrix != nullptr) {
      model_internal::Matrix& mx = *slot.matrix;
      mx.rows = slot.shape[0];
      mx.cols = slot.shape[1];
      mx.owned = std::move(converted);
      mx.ptr = view ? values : model_internal::WeightPtr{mx.owned.data(), type};
      values = mx.ptr;
      any_view = any_view || view;
      resident += mx.bytes();
    } else {
      slot.dest->resize(count);
      model_internal::WidenWeights(values, static_cast<int64_t>(count), slot.dest->data());
      resident += count * 4;
    }
    // Fingerprint and finiteness over the fp32 widening of the resident values, streamed.
    XXH3_128bits_update(st, slot.name.data(), slot.name.size() + 1);  // with the NUL separator
    XXH3_128bits_update(st, slot.shape.data(), slot.shape.size() * sizeof(int64_t));
    for (size_t i = 0; i < count; i += chunk.size()) {
      const size_t n = std::min(chunk.size(), count - i);
      model_internal::WidenWeights(values.Offset(static_cast<int64_t>(i)), static_cast<int64_t>(n),
                                   chunk.data());
      for (size_t e = 0; e < n; ++e) {
        if (!std::isfinite(chunk[e])) {
          return InvalidArgumentError(dir + ": tensor '" + slot.name +
                                      "' holds a non-finite value");
        }
      }
      XXH3_128bits_update(st, chunk.data(), n * sizeof(float));
    }
  }
  impl->weights.bytes = resident;
  if (any_view) impl->weights.mapped = store;  // else nothing points into it: unmapped now
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

Result<std::shared_ptr<Model>> Model::CreateWeightless(const RandomModelSpec& spec) {
  RETURN_IF_ERROR(spec.config.Validate());
  auto impl = std::make_unique<Impl>();
  impl->config = spec.config;
  ASSIGN_OR_RETURN(impl->tokenizer, Tokenizer::ForConfig(spec.config));
  const std::string canonical = spec.config.ToJson("").dump();
  const std::string tag = "weightless random model seed=" + std::to_string(spec.seed);
  XXH3_state_t* st = XXH3_createState();
  if (st == nullptr) return InternalError("XXH3_createState failed");
  std::unique_ptr<XXH3_state_t, decltype(&XXH3_freeState)> state(st, &XXH3_freeState);
  XXH3_128bits_reset(st);
  XXH3_128bits_update(st, canonical.data(), canonical.size());
  XXH3_128bits_update(st, tag.data(), tag.size() + 1);  // with the NUL separator
  const XXH128_hash_t digest = XXH3_128bits_digest(st);
  char hex[33];
  std::snprintf(hex, sizeof(hex), "%016llx%016llx", static_cast<unsigned long long>(digest.high64),
                static_cast<unsigned long long>(digest.low64));
  impl->fingerprint = hex;
  impl->weightless = spec;
  return std::shared_ptr<Model>(new Model(std::move(impl)));
}

const RandomModelSpec* Model::weightless_spec() const {
  return impl_->weightless ? &*impl_->weightless : nullptr;
}

const ModelConfig& Model::config() const { return impl_->config; }
const Tokenizer& Model::tokenizer() const { return impl_->tokenizer; }
const std::string& Model::fingerprint() const { return impl_->fingerprint; }
size_t Model::weight_bytes() const { return impl_->weights.bytes; }
uint64_t Model::weight_file_bytes() const { return impl_->weight_file_bytes; }

std::string Model::weight_types() const {
  if (impl_->weightless) return "none";
  const model_internal::Weights& w = impl_->weights;
  std::vector<std::string> seen;
  auto note = [&](const model_internal::Matrix& m) {
    if (m.empty()) return;
    const std::string n = model_internal::WeightTypeName(m.type());
    if (std::find(seen.begin(), seen.end(), n) == seen.end()) seen.push_back(n);
  };
  note(w.embed);
  note(w.lm_head);
  for (const auto& l : w.layers) {
    for (const auto* m : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) note(*m);
  }
  std::sort(seen.begin(), seen.end());
  std::string out;
  for (const auto& n : seen) out += (out.empty() ? "" : "+") + n;
  return out;
}

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
  if (impl_->weightless) {
    return FailedPreconditionError(
        "Model::Forward: this model is weightless (a random-model preset whose weights only a GPU "
        "engine generates, on the device): run it with --device cuda, or write it with make-model");
  }
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

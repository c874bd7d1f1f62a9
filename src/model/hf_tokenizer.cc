// The Hugging Face tokenizer.json kind: the file's components wired as Hugging Face
// `tokenizers` runs them (Tokenizer::encode / decode), the added vocabulary, the
// post-processor and the tokenizer_config.json special tokens.
#include <algorithm>
#include <unordered_set>

#include "model/hf_internal.h"
#include "model/tokenizer_backend.h"

namespace kvbridge::model_internal {
namespace {

using hf::Json;
using hf::JsonCtx;
using hf::Piece;

struct AddedToken {
  int32_t id = 0;
  std::string content;
  bool single_word = false;
  bool lstrip = false;
  bool rstrip = false;
  bool normalized = true;
  bool special = false;
};

// Leftmost-longest matching of a set of strings (aho-corasick's MatchKind::LeftmostLongest).
class TokenTrie {
 public:
  void Add(std::string_view s, int index) {
    if (s.empty()) return;
    int node = 0;
    for (unsigned char c : s) {
      int next = -1;
      for (auto [ch, child] : nodes_[node].children) {
        if (ch == c) next = child;
      }
      if (next < 0) {
        next = static_cast<int>(nodes_.size());
        nodes_[node].children.emplace_back(c, next);
        nodes_.emplace_back();
      }
      node = next;
    }
    if (nodes_[node].value < 0) nodes_[node].value = index;  // first added wins a duplicate
    first_[static_cast<unsigned char>(s[0])] = true;
    empty_ = false;
  }
  bool empty() const { return empty_; }

  struct Match {
    size_t start, end;
    int index;
  };
  void FindAll(std::string_view text, std::vector<Match>* out) const {
    if (empty_) return;
    size_t i = 0;
    while (i < text.size()) {
      if (!first_[static_cast<unsigned char>(text[i])]) {
        ++i;
        continue;
      }
      int node = 0, best = -1;
      size_t best_end = 0;
      for (size_t k = i; k < text.size(); ++k) {
        int next = -1;
        for (auto [ch, child] : nodes_[node].children) {
          if (ch == static_cast<unsigned char>(text[k])) next = child;
        }
        if (next < 0) break;
        node = next;
        if (nodes_[node].value >= 0) {
          best = nodes_[node].value;
          best_end = k + 1;
        }
      }
      if (best < 0) {
        ++i;
        continue;
      }
      out->push_back(Match{i, best_end, best});
      i = best_end;
    }
  }

 private:
  struct Node {
    std::vector<std::pair<unsigned char, int>> children;
    int value = -1;
  };
  std::vector<Node> nodes_ = std::vector<Node>(1);
  bool first_[256] = {};
  bool empty_ = true;
};

// Rust regex's \w (single_word's word boundaries).
bool IsWordChar(char32_t c) { return hf::IsRustWordChar(c); }

char32_t LastChar(std::string_view s) {
  size_t k = s.size() - 1;
  while (k > 0 && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
  int len = 0;
  return hf::DecodeUtf8(s, k, &len);
}

// One item of a TemplateProcessing `single` template: a run of special ids or the sequence.
struct TemplateItem {
  bool is_sequence = false;
  std::vector<int32_t> ids;
};
using PostProcessor = std::vector<std::vector<TemplateItem>>;  // applied in order

class HfBackend final : public TokenizerBackend {
 public:
  explicit HfBackend(SpecialIds s) : TokenizerBackend(std::move(s)) {}
  using TokenizerBackend::set_special;

  std::unique_ptr<hf::Normalizer> normalizer;
  std::unique_ptr<hf::PreTokenizer> pre_tokenizer;
  std::unique_ptr<hf::BpeModel> model;
  std::unique_ptr<hf::Decoder> decoder;
  PostProcessor post;
  std::vector<AddedToken> added;
  std::unordered_map<int32_t, size_t> added_by_id;
  std::unordered_map<std::string, size_t> added_by_content;
  // Rust's normalized_cache: what a normalized added token decodes as (its normalized form,
  // when that differs from its content).
  std::unordered_map<int32_t, std::string> normalized_content;
  // Contents of the special added tokens: decode with skip_special_tokens drops every token
  // whose string is one of them (Rust's is_special_token).
  std::unordered_set<std::string> special_contents;
  TokenTrie raw_trie, normalized_trie;  // values: index into `added`

  Tokenizer::Kind kind() const override { return Tokenizer::Kind::kHuggingFace; }

  // AddedVocabulary::find_matches + split_with_indices: the pieces of `text` and the added
  // tokens found in it (id >= 0).
  struct Section {
    std::string text;
    int32_t id = -1;
    bool at_origin = false;
  };
  void SplitAdded(const TokenTrie& trie, std::string_view text, bool at_origin,
                  std::vector<Section>* out) const {
    if (trie.empty() || text.empty()) {
      if (!text.empty()) out->push_back(Section{std::string(text), -1, at_origin});
      return;
    }
    std::vector<TokenTrie::Match> matches;
    trie.FindAll(text, &matches);
    size_t start_offset = 0;
    for (const auto& m : matches) {
      const AddedToken& t = added[static_cast<size_t>(m.index)];
      size_t start = m.start, stop = m.end;
      if (t.single_word) {
        const bool start_space = start == 0 || !IsWordChar(LastChar(text.substr(0, start)));
        int len = 0;
        const bool stop_space =
            stop == text.size() || !IsWordChar(hf::DecodeUtf8(text, stop, &len));
        if (!start_space || !stop_space) continue;
      }
      if (t.lstrip) {
        size_t s = start;
        while (s > 0) {
          size_t k = s - 1;
          while (k > 0 && (static_cast<uint8_t>(text[k]) & 0xC0) == 0x80) --k;
          int len = 0;
          if (!hf::IsWhitespace(hf::DecodeUtf8(text, k, &len))) break;
          s = k;
        }
        start = std::max(s, start_offset);
      }
      if (t.rstrip) {
        while (stop < text.size()) {
          int len = 0;
          if (!hf::IsWhitespace(hf::DecodeUtf8(text, stop, &len))) break;
          stop += static_cast<size_t>(len);
        }
      }
      if (start_offset < start) {
        out->push_back(Section{std::string(text.substr(start_offset, start - start_offset)), -1,
                               at_origin && start_offset == 0});
      }
      out->push_back(Section{std::string(), t.id, false});
      start_offset = stop;
    }
    if (start_offset < text.size()) {
      out->push_back(
          Section{std::string(text.substr(start_offset)), -1, at_origin && start_offset == 0});
    }
  }

  Result<std::vector<int32_t>> Encode(std::string_view text,
                                      bool add_special_tokens) const override {
    if (!hf::IsValidUtf8(text)) {
      return InvalidArgumentError("text to tokenize is not valid UTF-8");
    }
    std::vector<int32_t> ids;
    ids.reserve(text.size() / 3 + 4);
    std::vector<Section> raw, normalized;
    SplitAdded(raw_trie, text, true, &raw);
    std::vector<Piece> pieces;
    for (Section& sec : raw) {
      if (sec.id >= 0) {
        ids.push_back(sec.id);
        continue;
      }
      std::string norm = normalizer ? normalizer->Apply(std::move(sec.text)) : std::move(sec.text);
      normalized.clear();
      SplitAdded(normalized_trie, norm, sec.at_origin, &normalized);
      for (Section& sub : normalized) {
        if (sub.id >= 0) {
          ids.push_back(sub.id);
          continue;
        }
        pieces.clear();
        pieces.push_back(Piece{std::move(sub.text), sub.at_origin});
        if (pre_tokenizer) pre_tokenizer->Apply(&pieces);
        for (const Piece& p : pieces) RETURN_IF_ERROR(model->Tokenize(p.text, &ids));
      }
    }
    if (add_special_tokens) {
      for (const auto& tmpl : post) {
        std::vector<int32_t> out;
        out.reserve(ids.size() + 4);
        for (const TemplateItem& item : tmpl) {
          if (item.is_sequence) {
            out.insert(out.end(), ids.begin(), ids.end());
          } else {
            out.insert(out.end(), item.ids.begin(), item.ids.end());
          }
        }
        ids.swap(out);
      }
    }
    return ids;
  }

  const std::string* TokenOf(int32_t id) const {
    auto it = added_by_id.find(id);
    if (it != added_by_id.end()) {
      auto n = normalized_content.find(id);
      return n != normalized_content.end() ? &n->second : &added[it->second].content;
    }
    const auto& table = model->id_to_token();
    if (id < 0 || static_cast<size_t>(id) >= table.size() || table[id].empty()) return nullptr;
    return &table[id];
  }

  std::string Decode(std::span<const int32_t> ids, bool skip_special_tokens) const override {
    std::vector<std::string> tokens;
    tokens.reserve(ids.size());
    for (int32_t id : ids) {
      const std::string* t = TokenOf(id);
      if (t == nullptr) continue;
      if (skip_special_tokens && special_contents.contains(*t)) continue;
      tokens.push_back(*t);
    }
    if (!decoder) {
      std::string out;
      for (size_t i = 0; i < tokens.size(); ++i) {
        if (i > 0) out.push_back(' ');
        out += tokens[i];
      }
      return out;
    }
    std::string out;
    for (const auto& t : decoder->DecodeChain(std::move(tokens))) out += t;
    return out;
  }

  std::optional<std::string> IdToToken(int32_t id) const override {
    const std::string* t = TokenOf(id);
    if (t == nullptr) return std::nullopt;
    return *t;
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    auto it = added_by_content.find(std::string(token));
    if (it != added_by_content.end()) return added[it->second].id;
    auto v = model->vocab().find(token);
    if (v != model->vocab().end()) return v->second;
    return std::nullopt;
  }
  bool IsSpecial(int32_t id) const override {
    auto it = added_by_id.find(id);
    return it != added_by_id.end() && added[it->second].special;
  }
  bool EndsIncomplete(std::span<const int32_t> window_ids, std::string_view text) const override {
    if (EndsInIncompleteUtf8(text)) return true;
    // A byte-fallback run may still grow into a different character (or into U+FFFDs). Ids
    // that render nothing (outside the vocab) or may be skipped (special) do not end a run:
    // look at the last one that renders.
    if (decoder && decoder->HasByteFallback()) {
      for (auto it = window_ids.rbegin(); it != window_ids.rend(); ++it) {
        const std::string* t = TokenOf(*it);
        if (t == nullptr || special_contents.contains(*t)) continue;
        if (!added_by_id.contains(*it) && hf::ByteFallbackValue(*t) >= 0) return true;
        break;
      }
    }
    return false;
  }
};

// ---- Parsing ----

Result<AddedToken> ParseAddedToken(const JsonCtx& ctx, const Json& j, const std::string& path) {
  if (!j.is_object()) return ctx.Invalid(path, "expected an object");
  AddedToken t;
  ASSIGN_OR_RETURN(const Json* id, hf::Field(ctx, j, path, "id"));
  if (!id->is_number_integer() || id->get<int64_t>() < 0 ||
      id->get<int64_t>() >= 16 * 1024 * 1024) {
    return ctx.Invalid(path + ".id", "expected an id in [0, 2^24)");
  }
  t.id = static_cast<int32_t>(id->get<int64_t>());
  ASSIGN_OR_RETURN(t.content, hf::StringField(ctx, j, path, "content"));
  ASSIGN_OR_RETURN(t.special, hf::OptBoolField(ctx, j, path, "special", false));
  ASSIGN_OR_RETURN(t.single_word, hf::OptBoolField(ctx, j, path, "single_word", false));
  ASSIGN_OR_RETURN(t.lstrip, hf::OptBoolField(ctx, j, path, "lstrip", false));
  ASSIGN_OR_RETURN(t.rstrip, hf::OptBoolField(ctx, j, path, "rstrip", false));
  ASSIGN_OR_RETURN(t.normalized, hf::OptBoolField(ctx, j, path, "normalized", !t.special));
  return t;
}

// The ids of a special-token name in TemplateProcessing's special_tokens.
Result<std::vector<int32_t>> TemplateSpecialIds(const JsonCtx& ctx, const Json& specials,
                                                const std::string& spath, const std::string& name,
                                                const std::string& item_path) {
  if (!specials.is_object() || !specials.contains(name)) {
    return ctx.Invalid(item_path, "special token \"" + name + "\" is not in special_tokens");
  }
  const std::string p = spath + "[\"" + name + "\"]";
  ASSIGN_OR_RETURN(const Json* ids, hf::Field(ctx, specials[name], p, "ids"));
  if (!ids->is_array()) return ctx.Invalid(p + ".ids", "expected an array of ids");
  std::vector<int32_t> out;
  for (size_t i = 0; i < ids->size(); ++i) {
    const Json& v = (*ids)[i];
    if (!v.is_number_integer() || v.get<int64_t>() < 0 || v.get<int64_t>() >= (1 << 24)) {
      return ctx.Invalid(p + ".ids[" + std::to_string(i) + "]", "expected an id");
    }
    out.push_back(static_cast<int32_t>(v.get<int64_t>()));
  }
  return out;
}

// A [token, id] pair of RobertaProcessing / BertProcessing.
Result<int32_t> PairId(const JsonCtx& ctx, const Json& j, const std::string& path,
                       const char* key) {
  ASSIGN_OR_RETURN(const Json* v, hf::Field(ctx, j, path, key));
  if (!v->is_array() || v->size() != 2 || !(*v)[0].is_string() || !(*v)[1].is_number_integer() ||
      (*v)[1].get<int64_t>() < 0 || (*v)[1].get<int64_t>() >= (1 << 24)) {
    return ctx.Invalid(path + "." + key, "expected [token, id]");
  }
  return static_cast<int32_t>((*v)[1].get<int64_t>());
}

Status ParsePostProcessor(const JsonCtx& ctx, const Json& j, const std::string& path,
                          PostProcessor* out) {
  if (path.size() > 2048) return ctx.Invalid(path, "nested too deep");
  if (!j.is_object()) return ctx.Invalid(path, "expected an object");
  ASSIGN_OR_RETURN(std::string type, hf::TypeField(ctx, j, path));
  if (type == "ByteLevel") return OkStatus();  // offsets only
  if (type == "TemplateProcessing") {
    ASSIGN_OR_RETURN(const Json* single, hf::Field(ctx, j, path, "single"));
    const std::string spath = path + ".single";
    if (!single->is_array()) return ctx.Invalid(spath, "expected an array");
    const Json empty = Json::object();
    const Json& specials = j.contains("special_tokens") ? j["special_tokens"] : empty;
    std::vector<TemplateItem> tmpl;
    for (size_t i = 0; i < single->size(); ++i) {
      const Json& item = (*single)[i];
      const std::string ipath = spath + "[" + std::to_string(i) + "]";
      if (item.is_object() && item.contains("Sequence")) {
        ASSIGN_OR_RETURN(std::string id,
                         hf::StringField(ctx, item["Sequence"], ipath + ".Sequence", "id"));
        if (id != "A") return ctx.Invalid(ipath + ".Sequence.id", "expected \"A\" in single");
        tmpl.push_back(TemplateItem{true, {}});
      } else if (item.is_object() && item.contains("SpecialToken")) {
        ASSIGN_OR_RETURN(std::string id,
                         hf::StringField(ctx, item["SpecialToken"], ipath + ".SpecialToken", "id"));
        ASSIGN_OR_RETURN(auto ids, TemplateSpecialIds(ctx, specials, path + ".special_tokens", id,
                                                      ipath + ".SpecialToken.id"));
        tmpl.push_back(TemplateItem{false, std::move(ids)});
      } else {
        return ctx.Invalid(ipath, "expected {\"Sequence\": ...} or {\"SpecialToken\": ...}");
      }
    }
    out->push_back(std::move(tmpl));
    return OkStatus();
  }
  if (type == "RobertaProcessing" || type == "BertProcessing") {
    ASSIGN_OR_RETURN(int32_t cls, PairId(ctx, j, path, "cls"));
    ASSIGN_OR_RETURN(int32_t sep, PairId(ctx, j, path, "sep"));
    out->push_back(
        {TemplateItem{false, {cls}}, TemplateItem{true, {}}, TemplateItem{false, {sep}}});
    return OkStatus();
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, hf::Field(ctx, j, path, "processors"));
    const std::string lpath = path + ".processors";
    if (!list->is_array()) return ctx.Invalid(lpath, "expected an array");
    for (size_t i = 0; i < list->size(); ++i) {
      RETURN_IF_ERROR(
          ParsePostProcessor(ctx, (*list)[i], lpath + "[" + std::to_string(i) + "]", out));
    }
    return OkStatus();
  }
  return ctx.Unsupported(path + ".type", "\"" + type + "\" is not supported");
}

Result<Json> ParseJsonText(std::string_view text, std::string_view source) {
  try {
    return Json::parse(text.begin(), text.end());
  } catch (const Json::exception& e) {
    return InvalidArgumentError(std::string(source) + ": not valid JSON: " + e.what());
  }
}

// A special-token entry of tokenizer_config.json: a string, {"content": ...}, or null.
Result<std::optional<std::string>> ConfigToken(const JsonCtx& ctx, const Json& cfg,
                                               const char* key) {
  if (!cfg.is_object() || !cfg.contains(key) || cfg[key].is_null()) {
    return std::optional<std::string>();
  }
  const Json& v = cfg[key];
  if (v.is_string()) return std::optional<std::string>(v.get<std::string>());
  if (v.is_object()) {
    ASSIGN_OR_RETURN(std::string content, hf::StringField(ctx, v, key, "content"));
    return std::optional<std::string>(content);
  }
  return ctx.Invalid(key, "expected a string, {\"content\": ...} or null");
}

}  // namespace

Result<std::shared_ptr<const TokenizerBackend>> MakeHuggingFaceBackend(
    std::string_view tokenizer_json, std::string_view tokenizer_config_json,
    std::string_view source) {
  const JsonCtx ctx{source};
  ASSIGN_OR_RETURN(Json j, ParseJsonText(tokenizer_json, source));
  if (!j.is_object()) return ctx.Invalid("(top)", "expected an object");

  for (const char* key : {"truncation", "padding"}) {
    if (j.contains(key) && !j[key].is_null()) {
      return ctx.Unsupported(key, "is not supported (only null)");
    }
  }
  auto backend = std::make_shared<HfBackend>(SpecialIds{});
  HfBackend& b = *backend;
  if (j.contains("normalizer") && !j["normalizer"].is_null()) {
    ASSIGN_OR_RETURN(b.normalizer, hf::ParseNormalizer(ctx, j["normalizer"], "normalizer"));
  }
  if (j.contains("pre_tokenizer") && !j["pre_tokenizer"].is_null()) {
    ASSIGN_OR_RETURN(b.pre_tokenizer,
                     hf::ParsePreTokenizer(ctx, j["pre_tokenizer"], "pre_tokenizer"));
  }
  ASSIGN_OR_RETURN(const Json* model, hf::Field(ctx, j, "", "model"));
  if (!model->is_object()) return ctx.Invalid("model", "expected an object");
  std::string model_type = "BPE";
  if (model->contains("type") || !model->contains("merges")) {
    ASSIGN_OR_RETURN(model_type, hf::TypeField(ctx, *model, "model"));
  }
  if (model_type != "BPE") {
    return ctx.Unsupported("model.type", "\"" + model_type + "\" is not supported");
  }
  ASSIGN_OR_RETURN(b.model, hf::BpeModel::Parse(ctx, *model, "model"));
  if (j.contains("post_processor") && !j["post_processor"].is_null()) {
    RETURN_IF_ERROR(ParsePostProcessor(ctx, j["post_processor"], "post_processor", &b.post));
  }
  if (j.contains("decoder") && !j["decoder"].is_null()) {
    ASSIGN_OR_RETURN(b.decoder, hf::ParseDecoder(ctx, j["decoder"], "decoder"));
  }
  int64_t max_id = static_cast<int64_t>(b.model->id_to_token().size()) - 1;
  if (j.contains("added_tokens") && !j["added_tokens"].is_null()) {
    const Json& list = j["added_tokens"];
    if (!list.is_array()) return ctx.Invalid("added_tokens", "expected an array");
    // Ids as Rust's AddedVocabulary::add_tokens gives them (the file's ids are only checked
    // there, with a warning): an added token already in the vocab (or added before) keeps that
    // id, a new one gets the next id past the model's vocab (its entry count) and the added
    // ones. Well-formed files list the same ids.
    const int64_t model_size = static_cast<int64_t>(b.model->vocab().size());
    int64_t max_added = -1;
    for (size_t i = 0; i < list.size(); ++i) {
      ASSIGN_OR_RETURN(AddedToken t,
                       ParseAddedToken(ctx, list[i], "added_tokens[" + std::to_string(i) + "]"));
      if (t.content.empty()) continue;  // Rust ignores empty added tokens
      auto existing = b.added_by_content.find(t.content);
      if (existing != b.added_by_content.end()) {
        t.id = b.added[existing->second].id;
        b.added[existing->second] = std::move(t);  // same content: the later flags win
        continue;
      }
      auto in_vocab = b.model->vocab().find(t.content);
      if (in_vocab != b.model->vocab().end()) {
        t.id = in_vocab->second;
      } else {
        t.id = static_cast<int32_t>(max_added < 0             ? model_size
                                    : max_added >= model_size ? max_added + 1
                                                              : model_size);
      }
      if (t.id >= 16 * 1024 * 1024) return ctx.Invalid("added_tokens", "more than 2^24 ids");
      max_added = std::max<int64_t>(max_added, t.id);
      max_id = std::max<int64_t>(max_id, t.id);
      const size_t index = b.added.size();
      if (auto old = b.added_by_id.find(t.id); old != b.added_by_id.end()) {
        b.added_by_content.erase(b.added[old->second].content);  // the id is taken over
      }
      b.added_by_id[t.id] = index;
      b.added_by_content[t.content] = index;
      b.added.push_back(std::move(t));
    }
    for (size_t index = 0; index < b.added.size(); ++index) {
      const AddedToken& t = b.added[index];
      if (b.added_by_id.at(t.id) != index) continue;  // an id taken over by a later token
      if (t.special) b.special_contents.insert(t.content);
      if (t.normalized && b.normalizer) {
        std::string normalized = b.normalizer->Apply(t.content);
        if (normalized != t.content) b.normalized_content[t.id] = normalized;
        b.normalized_trie.Add(normalized, static_cast<int>(index));
      } else if (t.normalized) {
        b.normalized_trie.Add(t.content, static_cast<int>(index));
      } else {
        b.raw_trie.Add(t.content, static_cast<int>(index));
      }
    }
  }

  // tokenizer_config.json: the special-token strings.
  SpecialIds special;
  special.vocab_size = static_cast<int>(max_id + 1);
  Json cfg = Json::object();
  std::string cfg_source = std::string(source);
  if (const size_t slash = cfg_source.find_last_of('/'); slash != std::string::npos) {
    cfg_source = cfg_source.substr(0, slash + 1) + "tokenizer_config.json";
  } else {
    cfg_source = "tokenizer_config.json";
  }
  const JsonCtx cfg_ctx{cfg_source};
  if (!tokenizer_config_json.empty()) {
    ASSIGN_OR_RETURN(cfg, ParseJsonText(tokenizer_config_json, cfg_source));
    if (!cfg.is_object()) return cfg_ctx.Invalid("(top)", "expected an object");
  }
  auto id_of = [&](const std::optional<std::string>& tok) -> int {
    if (!tok) return -1;
    auto id = backend->TokenToId(*tok);
    return id ? *id : -1;
  };
  ASSIGN_OR_RETURN(auto bos, ConfigToken(cfg_ctx, cfg, "bos_token"));
  ASSIGN_OR_RETURN(auto eos, ConfigToken(cfg_ctx, cfg, "eos_token"));
  ASSIGN_OR_RETURN(auto pad, ConfigToken(cfg_ctx, cfg, "pad_token"));
  if (!cfg.contains("bos_token") && !b.post.empty() && !b.post.back().empty() &&
      !b.post.back()[0].is_sequence && b.post.back()[0].ids.size() == 1) {
    // No config: the special token the template puts first is the BOS.
    const auto tok = backend->IdToToken(b.post.back()[0].ids[0]);
    if (tok) bos = *tok;
  }
  special.bos_id = id_of(bos);
  special.eos_id = id_of(eos);
  special.pad_id = id_of(pad);
  special.bos_token = bos.value_or("");
  special.eos_token = eos.value_or("");
  b.set_special(std::move(special));
  return std::shared_ptr<const TokenizerBackend>(std::move(backend));
}

}  // namespace kvbridge::model_internal

#include "kvbridge/model/tokenizer.h"

#include <charconv>
#include <filesystem>
#include <fstream>
#include <sstream>

#include "kvbridge/model/config.h"
#include "model/tokenizer_backend.h"

namespace kvbridge {
namespace model_internal {
namespace {

// The byte tokenizer: ids 0..255 are bytes, specials >= 256.
class ByteBackend final : public TokenizerBackend {
 public:
  explicit ByteBackend(SpecialIds s) : TokenizerBackend(std::move(s)) {}
  Tokenizer::Kind kind() const override { return Tokenizer::Kind::kBytes; }

  Result<std::vector<int32_t>> Encode(std::string_view text,
                                      bool add_special_tokens) const override {
    std::vector<int32_t> ids;
    ids.reserve(text.size() + 1);
    if (add_special_tokens && special().bos_id >= 0) ids.push_back(special().bos_id);
    for (char c : text) ids.push_back(static_cast<uint8_t>(c));
    return ids;
  }
  std::string Decode(std::span<const int32_t> ids, bool) const override {
    std::string out;
    out.reserve(ids.size());
    for (int32_t id : ids) {
      if (id >= 0 && id < Tokenizer::kNumByteTokens) out.push_back(static_cast<char>(id));
    }
    return out;
  }
  std::optional<std::string> IdToToken(int32_t id) const override {
    if (id >= 0 && id < Tokenizer::kNumByteTokens) return std::string(1, static_cast<char>(id));
    if (id == special().bos_id) return "<bos>";
    if (id == special().eos_id) return "<eos>";
    if (id == special().pad_id) return "<pad>";
    return std::nullopt;
  }
  std::optional<int32_t> TokenToId(std::string_view token) const override {
    if (token.size() == 1) return static_cast<uint8_t>(token[0]);
    if (token == "<bos>" && special().bos_id >= 0) return special().bos_id;
    if (token == "<eos>" && special().eos_id >= 0) return special().eos_id;
    if (token == "<pad>" && special().pad_id >= 0) return special().pad_id;
    return std::nullopt;
  }
  bool IsSpecial(int32_t id) const override { return id >= Tokenizer::kNumByteTokens; }
  bool EndsIncomplete(std::span<const int32_t>, std::string_view text) const override {
    return EndsInIncompleteUtf8(text);
  }
};

}  // namespace

bool EndsInIncompleteUtf8(std::string_view text) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  if (text.ends_with(kReplacement)) return true;
  // Walk back over at most 3 continuation bytes to a lead byte; incomplete when the lead
  // announces more bytes than follow it.
  const size_t n = text.size();
  for (size_t back = 1; back <= 4 && back <= n; ++back) {
    const auto b = static_cast<uint8_t>(text[n - back]);
    if ((b & 0xC0) == 0x80) continue;  // continuation byte
    size_t need = 0;
    if ((b & 0xE0) == 0xC0) {
      need = 2;
    } else if ((b & 0xF0) == 0xE0) {
      need = 3;
    } else if ((b & 0xF8) == 0xF0) {
      need = 4;
    } else {
      return false;  // ASCII or an invalid lead: nothing to wait for
    }
    return back < need;
  }
  return false;
}

}  // namespace model_internal

using model_internal::ByteBackend;
using model_internal::SpecialIds;

Result<Tokenizer> Tokenizer::ForConfig(const ModelConfig& config) {
  const int eos = config.eos_token_ids.empty() ? -1 : config.eos_token_ids[0];
  if (config.vocab_size < kNumByteTokens + 1) {
    return InvalidArgumentError("byte tokenizer needs vocab_size >= 257, model has " +
                                std::to_string(config.vocab_size));
  }
  for (int id : {config.bos_token_id, eos, config.pad_token_id}) {
    if (id != -1 && (id < kNumByteTokens || id >= config.vocab_size)) {
      return InvalidArgumentError(
          "byte tokenizer needs special token ids in [256, vocab_size), "
          "config has " +
          std::to_string(id));
    }
  }
  return Tokenizer(config.vocab_size, config.bos_token_id, eos, config.pad_token_id);
}

namespace {
Result<std::string> ReadWholeFile(const std::filesystem::path& path) {
  std::ifstream in(path, std::ios::binary);
  if (!in) return NotFoundError(path.string() + ": cannot open");
  std::ostringstream ss;
  ss << in.rdbuf();
  return ss.str();
}
}  // namespace

Result<Tokenizer> Tokenizer::Load(const std::string& model_dir, const ModelConfig& config) {
  const std::filesystem::path dir(model_dir);
  const auto json_path = dir / "tokenizer.json";
  std::error_code ec;
  if (!std::filesystem::exists(json_path, ec)) return ForConfig(config);
  ASSIGN_OR_RETURN(std::string json, ReadWholeFile(json_path));
  std::string config_json;
  const auto config_path = dir / "tokenizer_config.json";
  if (std::filesystem::exists(config_path, ec)) {
    ASSIGN_OR_RETURN(config_json, ReadWholeFile(config_path));
  }
  return FromHuggingFaceJson(json, config_json, json_path.string());
}

Result<Tokenizer> Tokenizer::FromHuggingFaceJson(std::string_view tokenizer_json,
                                                 std::string_view tokenizer_config_json,
                                                 std::string_view source) {
  ASSIGN_OR_RETURN(auto backend, model_internal::MakeHuggingFaceBackend(
                                     tokenizer_json, tokenizer_config_json, source));
  return Tokenizer(std::move(backend));
}

Tokenizer::Tokenizer(int vocab_size, int bos_id, int eos_id, int pad_id)
    : backend_(std::make_shared<ByteBackend>(SpecialIds{.vocab_size = vocab_size,
                                                        .bos_id = bos_id,
                                                        .eos_id = eos_id,
                                                        .pad_id = pad_id,
                                                        .bos_token = bos_id >= 0 ? "<bos>" : "",
                                                        .eos_token = eos_id >= 0 ? "<eos>" : ""})) {
}

Tokenizer::Tokenizer(std::shared_ptr<const model_internal::TokenizerBackend> backend)
    : backend_(std::move(backend)) {}

Tokenizer::Kind Tokenizer::kind() const { return backend_->kind(); }
Result<std::vector<int32_t>> Tokenizer::Encode(std::string_view text,
                                               bool add_special_tokens) const {
  return backend_->Encode(text, add_special_tokens);
}
std::string Tokenizer::Decode(std::span<const int32_t> ids, bool skip_special_tokens) const {
  return backend_->Decode(ids, skip_special_tokens);
}
std::optional<std::string> Tokenizer::IdToToken(int32_t id) const {
  return backend_->IdToToken(id);
}
std::optional<int32_t> Tokenizer::TokenToId(std::string_view token) const {
  return backend_->TokenToId(token);
}
bool Tokenizer::IsSpecial(int32_t id) const { return backend_->IsSpecial(id); }
int Tokenizer::vocab_size() const { return backend_->special().vocab_size; }
int Tokenizer::bos_id() const { return backend_->special().bos_id; }
int Tokenizer::eos_id() const { return backend_->special().eos_id; }
int Tokenizer::pad_id() const { return backend_->special().pad_id; }
const std::string& Tokenizer::bos_token() const { return backend_->special().bos_token; }
const std::string& Tokenizer::eos_token() const { return backend_->special().eos_token; }

Result<std::vector<int32_t>> Tokenizer::ParseTokenIds(std::string_view text) const {
  std::vector<int32_t> ids;
  size_t i = 0;
  while (i < text.size()) {
    if (text[i] == ',' || text[i] == ' ' || text[i] == '\t' || text[i] == '\n') {
      ++i;
      continue;
    }
    int64_t v = 0;
    auto [ptr, ec] = std::from_chars(text.data() + i, text.data() + text.size(), v);
    if (ec != std::errc() || ptr == text.data() + i) {
      return InvalidArgumentError("token ids: not a number at offset " + std::to_string(i));
    }
    if (v < 0 || v >= vocab_size()) {
      return InvalidArgumentError("token ids: id " + std::to_string(v) + " outside [0, " +
                                  std::to_string(vocab_size()) + ")");
    }
    ids.push_back(static_cast<int32_t>(v));
    i = static_cast<size_t>(ptr - text.data());
  }
  return ids;
}

std::string Tokenizer::ApplyChatTemplate(std::span<const ChatMessage> messages,
                                         bool add_generation_prompt) const {
  std::string out;
  for (const auto& m : messages) out += "<|" + m.role + "|>\n" + m.content + "\n";
  if (add_generation_prompt) out += "<|assistant|>\n";
  return out;
}

// Streaming as Hugging Face's DecodeStream does it: decode a window that starts a few ids back
// (so decoders that look at neighbours, like Metaspace or byte fallback, see them) and emit
// what the newest id added once it no longer ends incomplete.
IncrementalDecoder::IncrementalDecoder(const Tokenizer& tokenizer, bool skip_special_tokens)
    : tokenizer_(tokenizer), skip_special_tokens_(skip_special_tokens) {}

std::string IncrementalDecoder::Push(int32_t id) {
  ids_.push_back(id);
  const std::span<const int32_t> all(ids_);
  const std::string prefix_text = tokenizer_.Decode(
      all.subspan(prefix_offset_, read_offset_ - prefix_offset_), skip_special_tokens_);
  const std::string window_text =
      tokenizer_.Decode(all.subspan(prefix_offset_), skip_special_tokens_);
  if (window_text.size() <= prefix_text.size() || !window_text.starts_with(prefix_text) ||
      tokenizer_.backend().EndsIncomplete(all.subspan(prefix_offset_), window_text)) {
    return "";
  }
  std::string delta = window_text.substr(prefix_text.size());
  // The next window starts at the old read offset, unless the ids from there decode to nothing
  // (e.g. skipped special tokens): a window must start with text of its own, so that rules for
  // the start of a decode (Strip, Metaspace's prepended space) act on it as on the whole text.
  if (!tokenizer_.Decode(all.subspan(read_offset_), skip_special_tokens_).empty()) {
    prefix_offset_ = read_offset_;
  }
  read_offset_ = ids_.size();
  emitted_ += delta;
  return delta;
}

std::string IncrementalDecoder::Finish() {
  const std::string full = tokenizer_.Decode(ids_, skip_special_tokens_);
  if (!full.starts_with(emitted_)) return "";  // cannot happen for a consistent decoder
  std::string rest = full.substr(emitted_.size());
  emitted_ = full;
  prefix_offset_ = read_offset_ = ids_.size();
  return rest;
}

}  // namespace kvbridge

// Normalizers of tokenizer.json, as Hugging Face tokenizers' normalizers module.
#include "model/hf_internal.h"

namespace kvbridge::model_internal::hf {
namespace {

class UnicodeNormalizer final : public Normalizer {
 public:
  explicit UnicodeNormalizer(NormForm form) : form_(form) {}
  std::string Apply(std::string s) const override { return Normalize(form_, s); }

 private:
  NormForm form_;
};

class LowercaseNormalizer final : public Normalizer {
 public:
  std::string Apply(std::string s) const override { return Lowercase(s); }
};

// Replace: every match of the pattern (literal or regex) becomes `content`.
class ReplaceNormalizer final : public Normalizer {
 public:
  ReplaceNormalizer(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  std::string Apply(std::string s) const override { return ReplaceAll(pattern_, s, content_); }

 private:
  Pattern pattern_;
  std::string content_;
};

// Prepend: only a non-empty string gets the prefix.
class PrependNormalizer final : public Normalizer {
 public:
  explicit PrependNormalizer(std::string prepend) : prepend_(std::move(prepend)) {}
  std::string Apply(std::string s) const override {
    if (s.empty()) return s;
    return prepend_ + s;
  }

 private:
  std::string prepend_;
};

// Strip: whitespace (char::is_whitespace) off the left and/or right end.
class StripNormalizer final : public Normalizer {
 public:
  StripNormalizer(bool left, bool right) : left_(left), right_(right) {}
  std::string Apply(std::string s) const override {
    size_t begin = 0, end = s.size();
    if (left_) {
      while (begin < end) {
        int len = 0;
        const char32_t c = DecodeUtf8(s, begin, &len);
        if (!IsWhitespace(c)) break;
        begin += static_cast<size_t>(len);
      }
    }
    if (right_) {
      while (end > begin) {
        size_t k = end - 1;
        while (k > begin && (static_cast<uint8_t>(s[k]) & 0xC0) == 0x80) --k;
        int len = 0;
        const char32_t c = DecodeUtf8(s, k, &len);
        if (!IsWhitespace(c)) break;
        end = k;
      }
    }
    return s.substr(begin, end - begin);
  }

 private:
  bool left_, right_;
};

// ByteLevel: every byte becomes its ByteLevel code point.
class ByteLevelNormalizer final : public Normalizer {
 public:
  std::string Apply(std::string s) const override {
    const auto& chars = ByteLevelChars();
    std::string out;
    out.reserve(s.size() * 2);
    for (char c : s) out += chars[static_cast<uint8_t>(c)];
    return out;
  }
};

class SequenceNormalizer final : public Normalizer {
 public:
  explicit SequenceNormalizer(std::vector<std::unique_ptr<Normalizer>> parts)
      : parts_(std::move(parts)) {}
  std::string Apply(std::string s) const override {
    for (const auto& p : parts_) s = p->Apply(std::move(s));
    return s;
  }

 private:
  std::vector<std::unique_ptr<Normalizer>> parts_;
};

}  // namespace

Result<std::unique_ptr<Normalizer>> ParseNormalizer(const JsonCtx& ctx, const Json& j,
                                                    const std::string& path) {
  if (path.size() > 2048) return ctx.Invalid(path, "nested too deep");
  if (!j.is_object()) return ctx.Invalid(path, "expected an object");
  ASSIGN_OR_RETURN(std::string type, TypeField(ctx, j, path));
  if (type == "NFC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormForm::kNfc));
  if (type == "NFD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormForm::kNfd));
  if (type == "NFKC") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormForm::kNfkc));
  if (type == "NFKD") return std::unique_ptr<Normalizer>(new UnicodeNormalizer(NormForm::kNfkd));
  if (type == "Lowercase") return std::unique_ptr<Normalizer>(new LowercaseNormalizer());
  if (type == "ByteLevel") return std::unique_ptr<Normalizer>(new ByteLevelNormalizer());
  if (type == "Replace") {
    ASSIGN_OR_RETURN(Pattern pattern, PatternField(ctx, j, path));
    ASSIGN_OR_RETURN(std::string content, StringField(ctx, j, path, "content"));
    return std::unique_ptr<Normalizer>(new ReplaceNormalizer(std::move(pattern), content));
  }
  if (type == "Prepend") {
    ASSIGN_OR_RETURN(std::string prepend, StringField(ctx, j, path, "prepend"));
    return std::unique_ptr<Normalizer>(new PrependNormalizer(prepend));
  }
  if (type == "Strip") {
    ASSIGN_OR_RETURN(bool left, OptBoolField(ctx, j, path, "strip_left", false));
    ASSIGN_OR_RETURN(bool right, OptBoolField(ctx, j, path, "strip_right", false));
    return std::unique_ptr<Normalizer>(new StripNormalizer(left, right));
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Field(ctx, j, path, "normalizers"));
    const std::string lpath = path + ".normalizers";
    if (!list->is_array()) return ctx.Invalid(lpath, "expected an array");
    std::vector<std::unique_ptr<Normalizer>> parts;
    for (size_t i = 0; i < list->size(); ++i) {
      ASSIGN_OR_RETURN(auto part,
                       ParseNormalizer(ctx, (*list)[i], lpath + "[" + std::to_string(i) + "]"));
      parts.push_back(std::move(part));
    }
    return std::unique_ptr<Normalizer>(new SequenceNormalizer(std::move(parts)));
  }
  return ctx.Unsupported(path + ".type", "\"" + type + "\" is not supported");
}

}  // namespace kvbridge::model_internal::hf

// Decoders of tokenizer.json, as Hugging Face tokenizers' decoders module (decode_chain).
#include "model/hf_internal.h"

namespace kvbridge::model_internal::hf {

int ByteFallbackValue(std::string_view t) {
  // Rust: len 6, "<0x" .. ">", u8::from_str_radix(&t[3..5], 16) (which takes a leading '+').
  if (t.size() != 6 || !t.starts_with("<0x") || t[5] != '>') return -1;
  auto hex = [](char c) -> int {
    if (c >= '0' && c <= '9') return c - '0';
    if (c >= 'a' && c <= 'f') return c - 'a' + 10;
    if (c >= 'A' && c <= 'F') return c - 'A' + 10;
    return -1;
  };
  if (t[3] == '+') return hex(t[4]);
  const int hi = hex(t[3]), lo = hex(t[4]);
  if (hi < 0 || lo < 0) return -1;
  return hi * 16 + lo;
}

namespace {

using Tokens = std::vector<std::string>;

class ByteLevelDecoder final : public Decoder {
 public:
  Tokens DecodeChain(Tokens tokens) const override {
    // Each token's characters map back to bytes; a token with a character outside the
    // alphabet contributes its own UTF-8 bytes. One lossy UTF-8 string for all.
    std::string bytes;
    for (const std::string& t : tokens) {
      const size_t mark = bytes.size();
      bool ok = true;
      size_t i = 0;
      while (i < t.size()) {
        int len = 0;
        const char32_t c = DecodeUtf8(t, i, &len);
        const int b = ByteLevelByte(c);
        if (b < 0) {
          ok = false;
          break;
        }
        bytes.push_back(static_cast<char>(b));
        i += static_cast<size_t>(len);
      }
      if (!ok) {
        bytes.resize(mark);
        bytes += t;
      }
    }
    return Tokens{Utf8Lossy(bytes)};
  }
};

class ByteFallbackDecoder final : public Decoder {
 public:
  bool HasByteFallback() const override { return true; }
  Tokens DecodeChain(Tokens tokens) const override {
    Tokens out;
    out.reserve(tokens.size());
    std::string run;
    size_t run_len = 0;
    auto flush = [&] {
      if (run_len == 0) return;
      if (IsValidUtf8(run)) {
        out.push_back(run);
      } else {
        for (size_t k = 0; k < run_len; ++k) out.emplace_back("\xEF\xBF\xBD");
      }
      run.clear();
      run_len = 0;
    };
    for (std::string& t : tokens) {
      const int b = ByteFallbackValue(t);
      if (b >= 0) {
        run.push_back(static_cast<char>(b));
        ++run_len;
        continue;
      }
      flush();
      out.push_back(std::move(t));
    }
    flush();
    return out;
  }
};

class FuseDecoder final : public Decoder {
 public:
  Tokens DecodeChain(Tokens tokens) const override {
    std::string all;
    for (const auto& t : tokens) all += t;
    return Tokens{std::move(all)};
  }
};

class StripDecoder final : public Decoder {
 public:
  StripDecoder(char32_t content, size_t start, size_t stop)
      : content_(content), start_(start), stop_(stop) {}
  Tokens DecodeChain(Tokens tokens) const override {
    for (std::string& t : tokens) {
      std::vector<std::pair<size_t, char32_t>> chars;  // (byte offset, char)
      size_t i = 0;
      while (i < t.size()) {
        int len = 0;
        chars.emplace_back(i, DecodeUtf8(t, i, &len));
        i += static_cast<size_t>(len);
      }
      size_t start_cut = 0;
      for (size_t k = 0; k < start_ && k < chars.size(); ++k) {
        if (chars[k].second != content_) break;
        start_cut = k + 1;
      }
      size_t stop_cut = chars.size();
      for (size_t k = 0; k < stop_ && k < chars.size(); ++k) {
        const size_t index = chars.size() - k - 1;
        if (chars[index].second != content_) break;
        stop_cut = index;
      }
      if (stop_cut < start_cut) stop_cut = start_cut;
      const size_t b0 = start_cut < chars.size() ? chars[start_cut].first : t.size();
      const size_t b1 = stop_cut < chars.size() ? chars[stop_cut].first : t.size();
      t = t.substr(b0, b1 - b0);
    }
    return tokens;
  }

 private:
  char32_t content_;
  size_t start_, stop_;
};

class ReplaceDecoder final : public Decoder {
 public:
  ReplaceDecoder(Pattern pattern, std::string content)
      : pattern_(std::move(pattern)), content_(std::move(content)) {}
  Tokens DecodeChain(Tokens tokens) const override {
    for (std::string& t : tokens) t = ReplaceAll(pattern_, t, content_);
    return tokens;
  }

 private:
  Pattern pattern_;
  std::string content_;
};

class MetaspaceDecoder final : public Decoder {
 public:
  MetaspaceDecoder(char32_t replacement, bool prepend) : prepend_(prepend) {
    AppendUtf8(replacement, &rep_);
  }
  Tokens DecodeChain(Tokens tokens) const override {
    // Rust: every replacement becomes a space, except in the first token (when a prefix is
    // prepended), where every replacement is dropped.
    for (size_t i = 0; i < tokens.size(); ++i) {
      const bool drop = i == 0 && prepend_;
      std::string out;
      const std::string& t = tokens[i];
      size_t k = 0;
      while (k < t.size()) {
        if (t.compare(k, rep_.size(), rep_) == 0) {
          if (!drop) out.push_back(' ');
          k += rep_.size();
        } else {
          out.push_back(t[k]);
          ++k;
        }
      }
      tokens[i] = std::move(out);
    }
    return tokens;
  }

 private:
  std::string rep_;
  bool prepend_;
};

class SequenceDecoder final : public Decoder {
 public:
  explicit SequenceDecoder(std::vector<std::unique_ptr<Decoder>> parts)
      : parts_(std::move(parts)) {}
  Tokens DecodeChain(Tokens tokens) const override {
    for (const auto& p : parts_) tokens = p->DecodeChain(std::move(tokens));
    return tokens;
  }
  bool HasByteFallback() const override {
    for (const auto& p : parts_) {
      if (p->HasByteFallback()) return true;
    }
    return false;
  }

 private:
  std::vector<std::unique_ptr<Decoder>> parts_;
};

}  // namespace

Result<std::unique_ptr<Decoder>> ParseDecoder(const JsonCtx& ctx, const Json& j,
                                              const std::string& path) {
  if (path.size() > 2048) return ctx.Invalid(path, "nested too deep");
  if (!j.is_object()) return ctx.Invalid(path, "expected an object");
  ASSIGN_OR_RETURN(std::string type, TypeField(ctx, j, path));
  using Ptr = std::unique_ptr<Decoder>;
  if (type == "ByteLevel") return Ptr(new ByteLevelDecoder());
  if (type == "ByteFallback") return Ptr(new ByteFallbackDecoder());
  if (type == "Fuse") return Ptr(new FuseDecoder());
  if (type == "Strip") {
    ASSIGN_OR_RETURN(char32_t content, CharField(ctx, j, path, "content", U' '));
    ASSIGN_OR_RETURN(int64_t start, OptIntField(ctx, j, path, "start", 0));
    ASSIGN_OR_RETURN(int64_t stop, OptIntField(ctx, j, path, "stop", 0));
    if (start < 0) return ctx.Invalid(path + ".start", "expected an integer >= 0");
    if (stop < 0) return ctx.Invalid(path + ".stop", "expected an integer >= 0");
    return Ptr(new StripDecoder(content, static_cast<size_t>(start), static_cast<size_t>(stop)));
  }
  if (type == "Replace") {
    ASSIGN_OR_RETURN(Pattern pattern, PatternField(ctx, j, path));
    ASSIGN_OR_RETURN(std::string content, StringField(ctx, j, path, "content"));
    return Ptr(new ReplaceDecoder(std::move(pattern), content));
  }
  if (type == "Metaspace") {
    ASSIGN_OR_RETURN(char32_t rep, CharField(ctx, j, path, "replacement", U'\u2581'));
    ASSIGN_OR_RETURN(std::string scheme, OptStringField(ctx, j, path, "prepend_scheme", ""));
    bool prepend = true;
    if (scheme.empty()) {
      ASSIGN_OR_RETURN(prepend, OptBoolField(ctx, j, path, "add_prefix_space", true));
    } else if (scheme == "never") {
      prepend = false;
    } else if (scheme != "always" && scheme != "first") {
      return ctx.Invalid(path + ".prepend_scheme", "unknown prepend_scheme \"" + scheme + "\"");
    }
    return Ptr(new MetaspaceDecoder(rep, prepend));
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Field(ctx, j, path, "decoders"));
    const std::string lpath = path + ".decoders";
    if (!list->is_array()) return ctx.Invalid(lpath, "expected an array");
    std::vector<Ptr> parts;
    for (size_t i = 0; i < list->size(); ++i) {
      ASSIGN_OR_RETURN(auto part,
                       ParseDecoder(ctx, (*list)[i], lpath + "[" + std::to_string(i) + "]"));
      parts.push_back(std::move(part));
    }
    return Ptr(new SequenceDecoder(std::move(parts)));
  }
  return ctx.Unsupported(path + ".type", "\"" + type + "\" is not supported");
}

}  // namespace kvbridge::model_internal::hf

// Pre-tokenizers of tokenizer.json, as Hugging Face tokenizers' pre_tokenizers module.
#include <array>
#include <functional>

#include "model/hf_internal.h"

namespace kvbridge::model_internal::hf {

const std::vector<std::string>& ByteLevelChars() {
  static const std::vector<std::string> table = [] {
    std::vector<std::string> t(256);
    int n = 0;
    for (int b = 0; b < 256; ++b) {
      const bool printable = (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || b >= 0xAE;
      const char32_t c = printable ? static_cast<char32_t>(b) : static_cast<char32_t>(256 + n++);
      AppendUtf8(c, &t[b]);
    }
    return t;
  }();
  return table;
}

int ByteLevelByte(char32_t c) {
  static const std::vector<int> inverse = [] {
    std::vector<int> inv(512, -1);
    const auto& chars = ByteLevelChars();
    for (int b = 0; b < 256; ++b) {
      int len = 0;
      inv[DecodeUtf8(chars[b], 0, &len)] = b;
    }
    return inv;
  }();
  return c < inverse.size() ? inverse[c] : -1;
}

namespace {

enum class Behavior { kRemoved, kIsolated, kMergedWithPrevious, kMergedWithNext, kContiguous };

Result<Behavior> ParseBehavior(const JsonCtx& ctx, const Json& j, const std::string& path,
                               Behavior fallback) {
  ASSIGN_OR_RETURN(std::string b, OptStringField(ctx, j, path, "behavior", ""));
  if (b.empty()) return fallback;
  if (b == "Removed") return Behavior::kRemoved;
  if (b == "Isolated") return Behavior::kIsolated;
  if (b == "MergedWithPrevious") return Behavior::kMergedWithPrevious;
  if (b == "MergedWithNext") return Behavior::kMergedWithNext;
  if (b == "Contiguous") return Behavior::kContiguous;
  return ctx.Invalid(path + ".behavior", "unknown behavior \"" + b + "\"");
}

struct Span {
  size_t start, end;
  bool is_match;
};

// Rust's SplitDelimiterBehavior applied to the (offsets, is_match) list of find_matches.
std::vector<Span> ApplyBehavior(std::vector<Span> m, Behavior behavior) {
  std::vector<Span> out;
  out.reserve(m.size());
  bool previous_match = false;
  switch (behavior) {
    case Behavior::kIsolated:
      return m;
    case Behavior::kRemoved:
      for (const Span& s : m) {
        if (!s.is_match) out.push_back(s);
      }
      return out;
    case Behavior::kMergedWithPrevious:
      for (const Span& s : m) {
        if (s.is_match && !previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.start, s.end, false});
        }
        previous_match = s.is_match;
      }
      return out;
    case Behavior::kMergedWithNext:
      for (auto it = m.rbegin(); it != m.rend(); ++it) {
        if (it->is_match && !previous_match && !out.empty()) {
          out.back().start = it->start;
        } else {
          out.push_back({it->start, it->end, false});
        }
        previous_match = it->is_match;
      }
      std::reverse(out.begin(), out.end());
      return out;
    case Behavior::kContiguous:
      for (const Span& s : m) {
        if (s.is_match == previous_match && !out.empty()) {
          out.back().end = s.end;
        } else {
          out.push_back({s.start, s.end, false});
        }
        previous_match = s.is_match;
      }
      return out;
  }
  return m;
}

// find_matches of a match list: the whole text covered by alternating non-match/match spans.
std::vector<Span> CoverWithMatches(size_t size,
                                   const std::vector<std::pair<size_t, size_t>>& matches,
                                   bool invert) {
  std::vector<Span> spans;
  if (size == 0) {
    spans.push_back({0, 0, invert});
    return spans;
  }
  spans.reserve(matches.size() * 2 + 1);
  size_t prev = 0;
  for (auto [a, b] : matches) {
    if (prev != a) spans.push_back({prev, a, invert});
    spans.push_back({a, b, !invert});
    prev = b;
  }
  if (prev != size) spans.push_back({prev, size, invert});
  return spans;
}

// Char-predicate find_matches: every character satisfying `pred` is its own match.
std::vector<Span> CoverWithChars(std::string_view text, const std::function<bool(char32_t)>& pred) {
  std::vector<Span> spans;
  if (text.empty()) {
    spans.push_back({0, 0, false});
    return spans;
  }
  size_t last = 0, i = 0;
  while (i < text.size()) {
    int len = 0;
    const char32_t c = DecodeUtf8(text, i, &len);
    if (pred(c)) {
      if (last < i) spans.push_back({last, i, false});
      spans.push_back({i, i + static_cast<size_t>(len), true});
      last = i + static_cast<size_t>(len);
    }
    i += static_cast<size_t>(len);
  }
  if (i > last) spans.push_back({last, i, false});
  return spans;
}

// Replaces `piece` by its parts per `spans` (after behavior), dropping empty ones.
void EmitSpans(Piece&& piece, const std::vector<Span>& spans, std::vector<Piece>* out) {
  if (spans.size() == 1 && spans[0].start == 0 && spans[0].end == piece.text.size()) {
    if (!piece.text.empty()) out->push_back(std::move(piece));
    return;
  }
  for (const Span& s : spans) {
    if (s.end <= s.start) continue;
    out->push_back(
        Piece{piece.text.substr(s.start, s.end - s.start), piece.at_origin && s.start == 0});
  }
}

// Applies `fn` (piece -> parts) to every piece.
template <typename Fn>
void SplitEach(std::vector<Piece>* pieces, Fn&& fn) {
  std::vector<Piece> out;
  out.reserve(pieces->size() * 4);
  for (Piece& p : *pieces) fn(std::move(p), &out);
  pieces->swap(out);
}

class SplitPreTokenizer final : public PreTokenizer {
 public:
  SplitPreTokenizer(std::shared_ptr<const Regex> re, Behavior behavior, bool invert)
      : re_(std::move(re)), behavior_(behavior), invert_(invert) {}
  void Apply(std::vector<Piece>* pieces) const override {
    std::vector<std::pair<size_t, size_t>> matches;
    SplitEach(pieces, [&](Piece&& p, std::vector<Piece>* out) {
      matches.clear();
      if (!p.text.empty()) re_->FindAll(p.text, &matches);
      EmitSpans(std::move(p),
                ApplyBehavior(CoverWithMatches(p.text.size(), matches, invert_), behavior_), out);
    });
  }

 private:
  std::shared_ptr<const Regex> re_;
  Behavior behavior_;
  bool invert_;
};

class CharSplitPreTokenizer final : public PreTokenizer {
 public:
  CharSplitPreTokenizer(std::function<bool(char32_t)> pred, Behavior behavior)
      : pred_(std::move(pred)), behavior_(behavior) {}
  void Apply(std::vector<Piece>* pieces) const override {
    SplitEach(pieces, [&](Piece&& p, std::vector<Piece>* out) {
      EmitSpans(std::move(p), ApplyBehavior(CoverWithChars(p.text, pred_), behavior_), out);
    });
  }

 private:
  std::function<bool(char32_t)> pred_;
  Behavior behavior_;
};

// GPT-2's pattern, which ByteLevel uses when use_regex is true.
constexpr std::string_view kGpt2Pattern =
    R"('s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+)";

class ByteLevelPreTokenizer final : public PreTokenizer {
 public:
  ByteLevelPreTokenizer(bool add_prefix_space, std::shared_ptr<const Regex> re)
      : add_prefix_space_(add_prefix_space), re_(std::move(re)) {}
  void Apply(std::vector<Piece>* pieces) const override {
    if (add_prefix_space_ || re_) {
      std::vector<std::pair<size_t, size_t>> matches;
      SplitEach(pieces, [&](Piece&& p, std::vector<Piece>* out) {
        if (add_prefix_space_ && !p.text.starts_with(' ')) p.text.insert(0, 1, ' ');
        if (!re_) {
          if (!p.text.empty()) out->push_back(std::move(p));
          return;
        }
        matches.clear();
        re_->FindAll(p.text, &matches);
        EmitSpans(std::move(p), CoverWithMatches(p.text.size(), matches, false), out);
      });
    }
    // Every byte becomes its ByteLevel character (1 or 2 UTF-8 bytes: all are below U+0800).
    static const auto table = [] {
      std::array<std::array<char, 3>, 256> t{};  // [0..1] bytes, [2] length
      const auto& chars = ByteLevelChars();
      for (int b = 0; b < 256; ++b) {
        t[b][2] = static_cast<char>(chars[b].size());
        for (size_t k = 0; k < chars[b].size(); ++k) t[b][k] = chars[b][k];
      }
      return t;
    }();
    std::string mapped;
    for (Piece& p : *pieces) {
      mapped.resize(p.text.size() * 2);
      char* out = mapped.data();
      for (char c : p.text) {
        const auto& e = table[static_cast<uint8_t>(c)];
        out[0] = e[0];
        out[1] = e[1];
        out += e[2];
      }
      mapped.resize(static_cast<size_t>(out - mapped.data()));
      p.text.swap(mapped);
    }
  }

 private:
  bool add_prefix_space_;
  std::shared_ptr<const Regex> re_;
};

class MetaspacePreTokenizer final : public PreTokenizer {
 public:
  enum class Prepend { kAlways, kFirst, kNever };
  MetaspacePreTokenizer(char32_t replacement, Prepend prepend, bool split)
      : replacement_(replacement), prepend_(prepend), split_(split) {
    AppendUtf8(replacement, &rep_);
  }
  void Apply(std::vector<Piece>* pieces) const override {
    SplitEach(pieces, [&](Piece&& p, std::vector<Piece>* out) {
      std::string s;
      s.reserve(p.text.size() + 8);
      for (char c : p.text) {
        if (c == ' ') {
          s += rep_;
        } else {
          s.push_back(c);
        }
      }
      const bool starts = s.starts_with(rep_);
      if ((prepend_ == Prepend::kAlways && !starts) ||
          (prepend_ == Prepend::kFirst && !starts && p.at_origin)) {
        s.insert(0, rep_);
      }
      p.text = std::move(s);
      if (!split_) {
        if (!p.text.empty()) out->push_back(std::move(p));
        return;
      }
      const char32_t r = replacement_;
      EmitSpans(std::move(p),
                ApplyBehavior(CoverWithChars(p.text, [r](char32_t c) { return c == r; }),
                              Behavior::kMergedWithNext),
                out);
    });
  }

 private:
  char32_t replacement_;
  std::string rep_;
  Prepend prepend_;
  bool split_;
};

class SequencePreTokenizer final : public PreTokenizer {
 public:
  explicit SequencePreTokenizer(std::vector<std::unique_ptr<PreTokenizer>> parts)
      : parts_(std::move(parts)) {}
  void Apply(std::vector<Piece>* pieces) const override {
    for (const auto& p : parts_) p->Apply(pieces);
  }

 private:
  std::vector<std::unique_ptr<PreTokenizer>> parts_;
};

Result<std::shared_ptr<const Regex>> CompileOrFail(const JsonCtx& ctx, const std::string& path,
                                                   std::string_view pattern, Regex::Syntax syntax) {
  auto re = Regex::Compile(pattern, syntax);
  if (!re.ok()) return ctx.Invalid(path, re.status().message());
  return re;
}

}  // namespace

Result<std::unique_ptr<PreTokenizer>> ParsePreTokenizer(const JsonCtx& ctx, const Json& j,
                                                        const std::string& path) {
  if (path.size() > 2048) return ctx.Invalid(path, "nested too deep");
  if (!j.is_object()) return ctx.Invalid(path, "expected an object");
  ASSIGN_OR_RETURN(std::string type, TypeField(ctx, j, path));
  using Ptr = std::unique_ptr<PreTokenizer>;
  if (type == "Split") {
    ASSIGN_OR_RETURN(Pattern pattern, PatternField(ctx, j, path));
    if (!pattern.regex) {
      // Rust compiles regex::escape(s): an empty string matches everywhere (empty matches).
      auto re = Regex::Literal(pattern.literal);
      if (!re.ok()) return ctx.Invalid(path + ".pattern", re.status().message());
      pattern.regex = std::move(*re);
    }
    ASSIGN_OR_RETURN(Behavior behavior, ParseBehavior(ctx, j, path, Behavior::kIsolated));
    if (!j.contains("behavior")) return ctx.Invalid(path + ".behavior", "missing");
    ASSIGN_OR_RETURN(bool invert, OptBoolField(ctx, j, path, "invert", false));
    return Ptr(new SplitPreTokenizer(pattern.regex, behavior, invert));
  }
  if (type == "ByteLevel") {
    ASSIGN_OR_RETURN(bool add_prefix_space, OptBoolField(ctx, j, path, "add_prefix_space", true));
    ASSIGN_OR_RETURN(bool use_regex, OptBoolField(ctx, j, path, "use_regex", true));
    ASSIGN_OR_RETURN(bool trim_offsets, OptBoolField(ctx, j, path, "trim_offsets", true));
    (void)trim_offsets;  // offsets only; ids are the same
    std::shared_ptr<const Regex> re;
    if (use_regex) {
      ASSIGN_OR_RETURN(re, CompileOrFail(ctx, path, kGpt2Pattern, Regex::Syntax::kOniguruma));
    }
    return Ptr(new ByteLevelPreTokenizer(add_prefix_space, std::move(re)));
  }
  if (type == "Metaspace") {
    ASSIGN_OR_RETURN(char32_t rep, CharField(ctx, j, path, "replacement", U'\u2581'));
    ASSIGN_OR_RETURN(bool split, OptBoolField(ctx, j, path, "split", true));
    ASSIGN_OR_RETURN(std::string scheme, OptStringField(ctx, j, path, "prepend_scheme", ""));
    MetaspacePreTokenizer::Prepend prepend = MetaspacePreTokenizer::Prepend::kAlways;
    if (scheme.empty()) {
      // Older files: add_prefix_space true = "always", false = "never".
      ASSIGN_OR_RETURN(bool aps, OptBoolField(ctx, j, path, "add_prefix_space", true));
      prepend =
          aps ? MetaspacePreTokenizer::Prepend::kAlways : MetaspacePreTokenizer::Prepend::kNever;
    } else if (scheme == "always") {
      prepend = MetaspacePreTokenizer::Prepend::kAlways;
    } else if (scheme == "first") {
      prepend = MetaspacePreTokenizer::Prepend::kFirst;
    } else if (scheme == "never") {
      prepend = MetaspacePreTokenizer::Prepend::kNever;
    } else {
      return ctx.Invalid(path + ".prepend_scheme", "unknown prepend_scheme \"" + scheme + "\"");
    }
    return Ptr(new MetaspacePreTokenizer(rep, prepend, split));
  }
  if (type == "Digits") {
    ASSIGN_OR_RETURN(bool individual, OptBoolField(ctx, j, path, "individual_digits", false));
    return Ptr(new CharSplitPreTokenizer(IsNumeric,
                                         individual ? Behavior::kIsolated : Behavior::kContiguous));
  }
  if (type == "Punctuation") {
    ASSIGN_OR_RETURN(Behavior behavior, ParseBehavior(ctx, j, path, Behavior::kIsolated));
    return Ptr(new CharSplitPreTokenizer(IsPunctuation, behavior));
  }
  if (type == "WhitespaceSplit") {
    return Ptr(new CharSplitPreTokenizer(IsWhitespace, Behavior::kRemoved));
  }
  if (type == "CharDelimiterSplit") {
    ASSIGN_OR_RETURN(const Json* d, Field(ctx, j, path, "delimiter"));
    (void)d;
    ASSIGN_OR_RETURN(char32_t delim, CharField(ctx, j, path, "delimiter", 0));
    return Ptr(
        new CharSplitPreTokenizer([delim](char32_t c) { return c == delim; }, Behavior::kRemoved));
  }
  if (type == "BertPreTokenizer") {
    std::vector<Ptr> parts;
    parts.push_back(Ptr(new CharSplitPreTokenizer(IsWhitespace, Behavior::kRemoved)));
    parts.push_back(Ptr(new CharSplitPreTokenizer(IsPunctuation, Behavior::kIsolated)));
    return Ptr(new SequencePreTokenizer(std::move(parts)));
  }
  if (type == "Whitespace") {
    // Rust: the `regex` crate's \w+|[^\w\s]+, keeping the matches (Invert + Removed).
    ASSIGN_OR_RETURN(auto re,
                     CompileOrFail(ctx, path, R"(\w+|[^\w\s]+)", Regex::Syntax::kRustRegex));
    return Ptr(new SplitPreTokenizer(std::move(re), Behavior::kRemoved, /*invert=*/true));
  }
  if (type == "Sequence") {
    ASSIGN_OR_RETURN(const Json* list, Field(ctx, j, path, "pretokenizers"));
    const std::string lpath = path + ".pretokenizers";
    if (!list->is_array()) return ctx.Invalid(lpath, "expected an array");
    std::vector<Ptr> parts;
    for (size_t i = 0; i < list->size(); ++i) {
      ASSIGN_OR_RETURN(auto part,
                       ParsePreTokenizer(ctx, (*list)[i], lpath + "[" + std::to_string(i) + "]"));
      parts.push_back(std::move(part));
    }
    return Ptr(new SequencePreTokenizer(std::move(parts)));
  }
  return ctx.Unsupported(path + ".type", "\"" + type + "\" is not supported");
}

}  // namespace kvbridge::model_internal::hf

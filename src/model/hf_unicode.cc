// Unicode helpers and the PCRE2 regex wrapper of the Hugging Face tokenizer kind.
#define PCRE2_CODE_UNIT_WIDTH 8
#include <pcre2.h>
#include <unicode/bytestream.h>
#include <unicode/normalizer2.h>
#include <unicode/uchar.h>
#include <unicode/ustring.h>

#include "model/hf_internal.h"

namespace kvbridge::model_internal::hf {

bool IsValidUtf8(std::string_view s) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data());
  const size_t n = s.size();
  size_t i = 0;
  while (i < n) {
    // ASCII fast path, 8 bytes at a time.
    while (i + 8 <= n) {
      uint64_t w;
      __builtin_memcpy(&w, p + i, 8);
      if (w & 0x8080808080808080ULL) break;
      i += 8;
    }
    if (i >= n) break;
    const uint8_t b = p[i];
    if (b < 0x80) {
      ++i;
      continue;
    }
    auto cont = [&](size_t k, uint8_t lo, uint8_t hi) {
      return i + k < n && p[i + k] >= lo && p[i + k] <= hi;
    };
    if (b >= 0xC2 && b <= 0xDF) {
      if (!cont(1, 0x80, 0xBF)) return false;
      i += 2;
    } else if (b == 0xE0) {
      if (!cont(1, 0xA0, 0xBF) || !cont(2, 0x80, 0xBF)) return false;
      i += 3;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
      if (!cont(1, 0x80, 0xBF) || !cont(2, 0x80, 0xBF)) return false;
      i += 3;
    } else if (b == 0xED) {
      if (!cont(1, 0x80, 0x9F) || !cont(2, 0x80, 0xBF)) return false;
      i += 3;
    } else if (b == 0xF0) {
      if (!cont(1, 0x90, 0xBF) || !cont(2, 0x80, 0xBF) || !cont(3, 0x80, 0xBF)) return false;
      i += 4;
    } else if (b >= 0xF1 && b <= 0xF3) {
      if (!cont(1, 0x80, 0xBF) || !cont(2, 0x80, 0xBF) || !cont(3, 0x80, 0xBF)) return false;
      i += 4;
    } else if (b == 0xF4) {
      if (!cont(1, 0x80, 0x8F) || !cont(2, 0x80, 0xBF) || !cont(3, 0x80, 0xBF)) return false;
      i += 4;
    } else {
      return false;
    }
  }
  return true;
}

char32_t DecodeUtf8(std::string_view s, size_t i, int* len) {
  const auto* p = reinterpret_cast<const uint8_t*>(s.data()) + i;
  const uint8_t b = p[0];
  if (b < 0x80) {
    *len = 1;
    return b;
  }
  if (b < 0xE0) {
    *len = 2;
    return (char32_t(b & 0x1F) << 6) | (p[1] & 0x3F);
  }
  if (b < 0xF0) {
    *len = 3;
    return (char32_t(b & 0x0F) << 12) | (char32_t(p[1] & 0x3F) << 6) | (p[2] & 0x3F);
  }
  *len = 4;
  return (char32_t(b & 0x07) << 18) | (char32_t(p[1] & 0x3F) << 12) | (char32_t(p[2] & 0x3F) << 6) |
         (p[3] & 0x3F);
}

void AppendUtf8(char32_t c, std::string* out) {
  if (c < 0x80) {
    out->push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out->push_back(static_cast<char>(0xC0 | (c >> 6)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else if (c < 0x10000) {
    out->push_back(static_cast<char>(0xE0 | (c >> 12)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  } else {
    out->push_back(static_cast<char>(0xF0 | (c >> 18)));
    out->push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3F)));
    out->push_back(static_cast<char>(0x80 | (c & 0x3F)));
  }
}

std::string Utf8Lossy(std::string_view bytes) {
  static constexpr std::string_view kReplacement = "\xEF\xBF\xBD";
  const auto* p = reinterpret_cast<const uint8_t*>(bytes.data());
  const size_t n = bytes.size();
  std::string out;
  out.reserve(n);
  size_t i = 0;
  while (i < n) {
    const uint8_t b = p[i];
    if (b < 0x80) {
      out.push_back(static_cast<char>(b));
      ++i;
      continue;
    }
    // Expected length and the range of the first continuation byte (Unicode table 3-7).
    int need = 0;
    uint8_t lo = 0x80, hi = 0xBF;
    if (b >= 0xC2 && b <= 0xDF) {
      need = 2;
    } else if (b == 0xE0) {
      need = 3, lo = 0xA0;
    } else if ((b >= 0xE1 && b <= 0xEC) || b == 0xEE || b == 0xEF) {
      need = 3;
    } else if (b == 0xED) {
      need = 3, hi = 0x9F;
    } else if (b == 0xF0) {
      need = 4, lo = 0x90;
    } else if (b >= 0xF1 && b <= 0xF3) {
      need = 4;
    } else if (b == 0xF4) {
      need = 4, hi = 0x8F;
    }
    if (need == 0) {
      out += kReplacement;
      ++i;
      continue;
    }
    int got = 1;
    while (got < need && i + got < n) {
      const uint8_t c = p[i + got];
      const uint8_t l = got == 1 ? lo : 0x80;
      const uint8_t h = got == 1 ? hi : 0xBF;
      if (c < l || c > h) break;
      ++got;
    }
    if (got == need) {
      out.append(bytes.substr(i, need));
    } else {
      out += kReplacement;  // one U+FFFD for the maximal valid prefix
    }
    i += got;
  }
  return out;
}

bool IsWhitespace(char32_t c) {
  if (c < 0x80) return c == ' ' || (c >= 0x09 && c <= 0x0D);
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_WHITE_SPACE);
}

bool IsNumeric(char32_t c) {
  if (c < 0x80) return c >= '0' && c <= '9';
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_DECIMAL_DIGIT_NUMBER || t == U_LETTER_NUMBER || t == U_OTHER_NUMBER;
}

bool IsAlphanumeric(char32_t c) {
  if (c < 0x80) return (c >= '0' && c <= '9') || ((c | 0x20) >= 'a' && (c | 0x20) <= 'z');
  return u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC) || IsNumeric(c);
}

bool IsPunctuation(char32_t c) {
  if (c < 0x80) {
    return (c >= 0x21 && c <= 0x2F) || (c >= 0x3A && c <= 0x40) || (c >= 0x5B && c <= 0x60) ||
           (c >= 0x7B && c <= 0x7E);
  }
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_CONNECTOR_PUNCTUATION || t == U_DASH_PUNCTUATION || t == U_START_PUNCTUATION ||
         t == U_END_PUNCTUATION || t == U_INITIAL_PUNCTUATION || t == U_FINAL_PUNCTUATION ||
         t == U_OTHER_PUNCTUATION;
}

bool IsRustWordChar(char32_t c) {
  if (c < 0x80) return IsAlphanumeric(c) || c == '_';
  if (c == 0x200C || c == 0x200D) return true;  // Join_Control
  if (u_hasBinaryProperty(static_cast<UChar32>(c), UCHAR_ALPHABETIC)) return true;
  const int8_t t = u_charType(static_cast<UChar32>(c));
  return t == U_NON_SPACING_MARK || t == U_COMBINING_SPACING_MARK || t == U_ENCLOSING_MARK ||
         t == U_DECIMAL_DIGIT_NUMBER || t == U_CONNECTOR_PUNCTUATION;
}

namespace {
bool IsAscii(std::string_view s) {
  for (char c : s) {
    if (static_cast<uint8_t>(c) >= 0x80) return false;
  }
  return true;
}
}  // namespace

std::string Normalize(NormForm form, std::string_view s) {
  if (IsAscii(s)) return std::string(s);
  UErrorCode err = U_ZERO_ERROR;
  const icu::Normalizer2* n = nullptr;
  switch (form) {
    case NormForm::kNfc:
      n = icu::Normalizer2::getNFCInstance(err);
      break;
    case NormForm::kNfd:
      n = icu::Normalizer2::getNFDInstance(err);
      break;
    case NormForm::kNfkc:
      n = icu::Normalizer2::getNFKCInstance(err);
      break;
    case NormForm::kNfkd:
      n = icu::Normalizer2::getNFKDInstance(err);
      break;
  }
  if (U_FAILURE(err) || n == nullptr) return std::string(s);
  const icu::StringPiece piece(s.data(), static_cast<int32_t>(s.size()));
  if (n->isNormalizedUTF8(piece, err) && U_SUCCESS(err)) return std::string(s);
  err = U_ZERO_ERROR;
  std::string out;
  icu::StringByteSink<std::string> sink(&out, static_cast<int32_t>(s.size()));
  n->normalizeUTF8(0, piece, sink, nullptr, err);
  if (U_FAILURE(err)) return std::string(s);
  return out;
}

std::string Lowercase(std::string_view s) {
  std::string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    const auto b = static_cast<uint8_t>(s[i]);
    if (b < 0x80) {
      out.push_back(static_cast<char>(b >= 'A' && b <= 'Z' ? b + 32 : b));
      ++i;
      continue;
    }
    int len = 0;
    const char32_t c = DecodeUtf8(s, i, &len);
    i += static_cast<size_t>(len);
    UChar src[2];
    int32_t src_len = 0;
    U16_APPEND_UNSAFE(src, src_len, static_cast<UChar32>(c));
    UChar dst[8];
    UErrorCode err = U_ZERO_ERROR;
    const int32_t n = u_strToLower(dst, 8, src, src_len, "", &err);
    if (U_FAILURE(err) || n > 8) {
      AppendUtf8(c, &out);
      continue;
    }
    for (int32_t k = 0; k < n;) {
      UChar32 cp;
      U16_NEXT_UNSAFE(dst, k, cp);
      AppendUtf8(static_cast<char32_t>(cp), &out);
    }
  }
  return out;
}

// ---- Regex ----

namespace {

// White_Space (what Oniguruma's and Rust regex's \s match in Unicode mode).
constexpr std::string_view kSpaceSet =
    "\\t\\n\\x0B\\f\\r\\x{20}\\x{85}\\x{A0}\\x{1680}\\x{2000}-\\x{200A}\\x{2028}\\x{2029}"
    "\\x{202F}\\x{205F}\\x{3000}";
// Oniguruma's Unicode \w: Alphabetic | Mark | Decimal_Number | Connector_Punctuation, plus the
// Latin-1 numbers ² ³ ¹ ¼ ½ ¾ of its Latin-1 table (checked against the Python tokenizers: "½"
// is a word character, "①" is not).
constexpr std::string_view kOnigWordSet =
    "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\x{B2}\\x{B3}\\x{B9}\\x{BC}-\\x{BE}";
// Rust regex's \w: Alphabetic | Mark | Decimal_Number | Connector_Punctuation | Join_Control.
constexpr std::string_view kRustWordSet = "\\p{Alphabetic}\\p{M}\\p{Nd}\\p{Pc}\\p{Join_Control}";

// Rewrites \s \S \w \W \h \H so PCRE2 gives them the meaning of the source syntax. Nested
// classes and class intersections (Oniguruma `[a[b]]`, `[a&&b]`) are refused.
Result<std::string> TranslatePattern(std::string_view p, Regex::Syntax syntax) {
  const std::string_view word = syntax == Regex::Syntax::kOniguruma ? kOnigWordSet : kRustWordSet;
  std::string out;
  out.reserve(p.size() + 16);
  bool in_class = false;
  for (size_t i = 0; i < p.size(); ++i) {
    const char c = p[i];
    if (c == '\\' && i + 1 < p.size()) {
      const char e = p[++i];
      auto put_set = [&](std::string_view set, bool negated) {
        if (in_class) {
          out += set;  // (negated classes inside a class are passed through below)
        } else {
          out += negated ? "[^" : "[";
          out += set;
          out += "]";
        }
      };
      if (e == 's') {
        put_set(kSpaceSet, false);
      } else if (e == 'S' && !in_class) {
        put_set(kSpaceSet, true);
      } else if (e == 'w') {
        put_set(word, false);
      } else if (e == 'W' && !in_class) {
        put_set(word, true);
      } else if (syntax == Regex::Syntax::kOniguruma && e == 'h') {
        put_set("0-9a-fA-F", false);
      } else if (syntax == Regex::Syntax::kOniguruma && e == 'H' && !in_class) {
        put_set("0-9a-fA-F", true);
      } else {
        out.push_back('\\');
        out.push_back(e);
      }
      continue;
    }
    if (!in_class && c == '[') {
      in_class = true;
      out.push_back(c);
      // A ']' or '^]' right after the opening bracket is a literal.
      if (i + 1 < p.size() && p[i + 1] == '^') out.push_back(p[++i]);
      if (i + 1 < p.size() && p[i + 1] == ']') out.push_back(p[++i]);
      continue;
    }
    if (in_class && c == '[' && i + 1 < p.size() && p[i + 1] == ':') {
      const size_t end = p.find(":]", i + 2);
      if (end != std::string_view::npos) {
        out.append(p.substr(i, end + 2 - i));
        i = end + 1;
        continue;
      }
    }
    if (in_class && (c == '[' || (c == '&' && i + 1 < p.size() && p[i + 1] == '&'))) {
      return UnimplementedError("regex \"" + std::string(p) +
                                "\": nested character classes or class intersections are not "
                                "supported");
    }
    if (in_class && c == ']') in_class = false;
    out.push_back(c);
  }
  return out;
}

struct MatchScratch {
  pcre2_match_data* data = nullptr;
  pcre2_match_context* ctx = nullptr;
  pcre2_jit_stack* stack = nullptr;
  MatchScratch() {
    data = pcre2_match_data_create(1, nullptr);
    ctx = pcre2_match_context_create(nullptr);
    stack = pcre2_jit_stack_create(32 * 1024, 4 * 1024 * 1024, nullptr);
    if (ctx != nullptr && stack != nullptr) pcre2_jit_stack_assign(ctx, nullptr, stack);
  }
  ~MatchScratch() {
    pcre2_match_data_free(data);
    pcre2_match_context_free(ctx);
    pcre2_jit_stack_free(stack);
  }
};

MatchScratch& Scratch() {
  thread_local MatchScratch scratch;
  return scratch;
}

}  // namespace

Result<std::shared_ptr<const Regex>> Regex::Compile(std::string_view pattern, Syntax syntax) {
  ASSIGN_OR_RETURN(const std::string translated, TranslatePattern(pattern, syntax));
  int err = 0;
  PCRE2_SIZE err_offset = 0;
  pcre2_code* code =
      pcre2_compile(reinterpret_cast<PCRE2_SPTR>(translated.data()), translated.size(),
                    PCRE2_UTF | PCRE2_UCP, &err, &err_offset, nullptr);
  if (code == nullptr) {
    PCRE2_UCHAR buf[256];
    pcre2_get_error_message(err, buf, sizeof(buf));
    return InvalidArgumentError("regex \"" + std::string(pattern) +
                                "\" does not compile: " + reinterpret_cast<const char*>(buf));
  }
  pcre2_jit_compile(code, PCRE2_JIT_COMPLETE);  // falls back to the interpreter when absent
  std::shared_ptr<Regex> re(new Regex());
  re->code_ = code;
  return std::shared_ptr<const Regex>(std::move(re));
}

Result<std::shared_ptr<const Regex>> Regex::Literal(std::string_view literal) {
  std::string quoted;
  for (char c : literal) {
    if (std::string_view("\\^$.|?*+()[]{}-#&~ ").find(c) != std::string_view::npos) {
      quoted.push_back('\\');
    }
    quoted.push_back(c);
  }
  return Compile(quoted, Syntax::kRustRegex);
}

Regex::~Regex() { pcre2_code_free(static_cast<pcre2_code*>(code_)); }

void Regex::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  auto* code = static_cast<pcre2_code*>(code_);
  MatchScratch& s = Scratch();
  const auto* subject = reinterpret_cast<PCRE2_SPTR>(text.data());
  size_t pos = 0;
  size_t last_end = static_cast<size_t>(-1);
  while (pos <= text.size()) {
    const int rc = pcre2_match(code, subject, text.size(), pos, PCRE2_NO_UTF_CHECK, s.data, s.ctx);
    if (rc < 0) break;  // no match (or a resource error: treat as no more matches)
    const PCRE2_SIZE* ov = pcre2_get_ovector_pointer(s.data);
    const size_t start = ov[0], end = ov[1];
    if (start == end && start == last_end) {
      // An empty match right after the previous match: step one character and retry.
      if (start >= text.size()) break;
      pos = start + static_cast<size_t>(Utf8Len(static_cast<uint8_t>(text[start])));
      continue;
    }
    out->emplace_back(start, end);
    last_end = end;
    if (end == start) {
      if (end >= text.size()) break;
      pos = end;  // retried above: skipped, then one character further
    } else {
      pos = end;
    }
  }
}

}  // namespace kvbridge::model_internal::hf

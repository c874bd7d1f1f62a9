// src/model/jinja/parser.cc — lexer and parser of kvbridge's Jinja2 subset.
//
// The lexer follows Jinja2 3.1's rules (jinja2/lexer.py): "\r\n" and "\r" become "\n" and one
// trailing newline is dropped (keep_trailing_newline=False); `{%-`/`-%}` strip all whitespace
// beside the tag; trim_blocks drops the first "\n" after a block or comment tag; lstrip_blocks
// drops the spaces and tabs before a block or comment tag that starts its line (`{%+` keeps
// them); `}}`/`%}` inside open brackets are operators. The parser follows jinja2/parser.py's
// grammar and precedence (e.g. `**` is left-associative, filters bind tighter than `-x`).
#include <algorithm>
#include <array>
#include <cstdlib>
#include <cstring>

#include "model/jinja/ast.h"

namespace kvbridge::jinja {
namespace {

enum class Tok : uint8_t {
  kData,
  kVarBegin,
  kVarEnd,
  kBlockBegin,
  kBlockEnd,
  kName,
  kString,
  kInt,
  kFloat,
  kOp,
  kEof
};

struct Token {
  Tok type;
  std::string text;  // data, name, operator, string value
  Value number;      // kInt / kFloat
  int line = 1;
};

[[noreturn]] void SyntaxError(std::string message, int line) {
  throw Error{std::move(message), line};
}

bool IsSpaceAscii(char c) {
  return c == ' ' || c == '\t' || c == '\n' || c == '\r' || c == '\v' || c == '\f';
}

// Python's str.rstrip() of UTF-8 text (Unicode whitespace).
void RstripPy(std::string& s) {
  while (!s.empty()) {
    size_t start = s.size() - 1;
    while (start > 0 && (static_cast<unsigned char>(s[start]) & 0xc0) == 0x80) --start;
    std::u32string cp = DecodeUtf8(std::string_view(s).substr(start));
    if (cp.size() != 1 || !IsPySpace(cp[0])) break;
    s.resize(start);
  }
}

// Length of the Python-`\s*` run at s[pos..].
size_t SkipPySpace(std::string_view s, size_t pos) {
  size_t p = pos;
  while (p < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[p]);
    if (c < 0x80) {
      if (!IsPySpace(c)) break;
      ++p;
      continue;
    }
    size_t len = (c & 0xe0) == 0xc0 ? 2 : (c & 0xf0) == 0xe0 ? 3 : 4;
    if (p + len > s.size()) break;
    std::u32string cp = DecodeUtf8(s.substr(p, len));
    if (cp.size() != 1 || !IsPySpace(cp[0])) break;
    p += len;
  }
  return p - pos;
}

// Python unicode-escape decoding of a string literal's body (as Jinja's lexer does).
std::string UnescapeLiteral(std::string_view body, int line) {
  std::string out;
  for (size_t i = 0; i < body.size(); ++i) {
    char c = body[i];
    if (c != '\\' || i + 1 >= body.size()) {
      out.push_back(c);
      continue;
    }
    char e = body[++i];
    auto hex = [&](size_t n) -> char32_t {
      if (i + n >= body.size()) {
        SyntaxError("truncated \\" + std::string(1, e) + " escape in a string literal", line);
      }
      char32_t v = 0;
      for (size_t k = 1; k <= n; ++k) {
        char h = body[i + k];
        int d = (h >= '0' && h <= '9')   ? h - '0'
                : (h >= 'a' && h <= 'f') ? h - 'a' + 10
                : (h >= 'A' && h <= 'F') ? h - 'A' + 10
                                         : -1;
        if (d < 0)
          SyntaxError("truncated \\" + std::string(1, e) + " escape in a string literal", line);
        v = v * 16 + static_cast<char32_t>(d);
      }
      i += n;
      return v;
    };
    switch (e) {
      case '\n':
        break;  // line continuation
      case '\\':
        out.push_back('\\');
        break;
      case '\'':
        out.push_back('\'');
        break;
      case '"':
        out.push_back('"');
        break;
      case 'a':
        out.push_back('\a');
        break;
      case 'b':
        out.push_back('\b');
        break;
      case 'f':
        out.push_back('\f');
        break;
      case 'n':
        out.push_back('\n');
        break;
      case 'r':
        out.push_back('\r');
        break;
      case 't':
        out.push_back('\t');
        break;
      case 'v':
        out.push_back('\v');
        break;
      case 'x':
        AppendUtf8(hex(2), out);
        break;
      case 'u':
        AppendUtf8(hex(4), out);
        break;
      case 'U': {
        char32_t v = hex(8);
        if (v > 0x10ffff) SyntaxError("illegal Unicode character in a string literal", line);
        AppendUtf8(v, out);
        break;
      }
      default:
        if (e >= '0' && e <= '7') {
          char32_t v = static_cast<char32_t>(e - '0');
          for (int k = 0; k < 2 && i + 1 < body.size() && body[i + 1] >= '0' && body[i + 1] <= '7';
               ++k) {
            v = v * 8 + static_cast<char32_t>(body[++i] - '0');
          }
          AppendUtf8(v, out);
        } else if (static_cast<unsigned char>(e) >= 0x80) {
          // Jinja backslash-replaces non-ASCII first: "\é" reads as the text "\xe9".
          size_t start = i;
          while (i + 1 < body.size() && (static_cast<unsigned char>(body[i + 1]) & 0xc0) == 0x80)
            ++i;
          std::u32string cp = DecodeUtf8(body.substr(start, i - start + 1));
          char buf[16];
          char32_t v = cp.empty() ? 0 : cp[0];
          if (v <= 0xff) {
            std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(v));
          } else if (v <= 0xffff) {
            std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(v));
          } else {
            std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(v));
          }
          out += buf;
        } else {
          out.push_back('\\');
          out.push_back(e);
        }
    }
  }
  return out;
}

class Lexer {
 public:
  Lexer(std::string_view source, bool trim_blocks, bool lstrip_blocks)
      : trim_blocks_(trim_blocks), lstrip_blocks_(lstrip_blocks) {
    // newline_re.split(source)[::2], minus one trailing empty line, joined by "\n".
    src_.reserve(source.size());
    for (size_t i = 0; i < source.size(); ++i) {
      if (source[i] == '\r') {
        if (i + 1 < source.size() && source[i + 1] == '\n') ++i;
        src_.push_back('\n');
      } else {
        src_.push_back(source[i]);
      }
    }
    if (!src_.empty() && src_.back() == '\n') src_.pop_back();
  }

  std::vector<Token> Run() {
    DecodeUtf8(src_);  // fails on malformed UTF-8
    bool line_starting = true;
    while (pos_ < src_.size()) {
      size_t start = FindTagStart(pos_);
      if (start == std::string::npos) {
        Emit(Tok::kData, src_.substr(pos_), LineAt(pos_));
        pos_ = src_.size();
        break;
      }
      std::string text = src_.substr(pos_, start - pos_);
      int text_line = LineAt(pos_);
      char kind = src_[start + 1];  // '{', '%', '#'
      size_t after = start + 2;
      char sign = 0;
      if (after < src_.size() && (src_[after] == '-' || src_[after] == '+')) sign = src_[after];
      // raw blocks: {%[-+]?\s*raw\s*(-%}\s*|%})
      size_t raw_end = 0;
      bool raw = kind == '%' && MatchRawBegin(start, &raw_end, &sign);
      if (sign == '-') {
        RstripPy(text);
      } else if (sign != '+' && lstrip_blocks_ && kind != '{') {
        LstripLine(text, line_starting);
      }
      if (!text.empty()) Emit(Tok::kData, text, text_line);
      if (raw) {
        LexRaw(raw_end, &line_starting);
        continue;
      }
      pos_ = after + ((sign == '-' || sign == '+') ? 1 : 0);
      if (kind == '#') {
        LexComment(start, &line_starting);
      } else {
        Emit(kind == '{' ? Tok::kVarBegin : Tok::kBlockBegin, "", LineAt(start));
        LexTag(kind == '{', &line_starting);
      }
    }
    Emit(Tok::kEof, "", LineAt(src_.size()));
    return std::move(tokens_);
  }

 private:
  int LineAt(size_t pos) {
    while (line_pos_ < pos && line_pos_ < src_.size()) {
      if (src_[line_pos_] == '\n') ++line_;
      ++line_pos_;
    }
    return line_;
  }

  void Emit(Tok type, std::string text, int line) {
    Token t;
    t.type = type;
    t.text = std::move(text);
    t.line = line;
    tokens_.push_back(std::move(t));
  }

  size_t FindTagStart(size_t from) const {
    for (size_t i = from; i + 1 < src_.size(); ++i) {
      if (src_[i] == '{' && (src_[i + 1] == '{' || src_[i + 1] == '%' || src_[i + 1] == '#')) {
        return i;
      }
    }
    return std::string::npos;
  }

  // lstrip_blocks: drop the whitespace between the last newline (or the start, when the tag
  // begins a line) and the tag.
  static void LstripLine(std::string& text, bool line_starting) {
    size_t nl = text.rfind('\n');
    size_t l_pos = nl == std::string::npos ? 0 : nl + 1;
    if (l_pos == 0 && !line_starting) return;
    if (l_pos >= text.size()) return;
    if (SkipPySpace(text, l_pos) == text.size() - l_pos) text.resize(l_pos);
  }

  bool MatchRawBegin(size_t start, size_t* end, char* sign) const {
    size_t p = start + 2;
    char s = 0;
    if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) s = src_[p++];
    p += SkipPySpace(src_, p);
    if (src_.compare(p, 3, "raw") != 0) return false;
    p += 3;
    p += SkipPySpace(src_, p);
    if (src_.compare(p, 3, "-%}") == 0) {
      p += 3;
      p += SkipPySpace(src_, p);
    } else if (src_.compare(p, 2, "%}") == 0) {
      p += 2;
    } else {
      return false;
    }
    *end = p;
    *sign = s;
    return true;
  }

  void LexRaw(size_t body_start, bool* line_starting) {
    int line = LineAt(body_start);
    for (size_t i = body_start; i + 1 < src_.size(); ++i) {
      if (src_[i] != '{' || src_[i + 1] != '%') continue;
      size_t p = i + 2;
      char s = 0;
      if (p < src_.size() && (src_[p] == '-' || src_[p] == '+')) s = src_[p++];
      p += SkipPySpace(src_, p);
      if (src_.compare(p, 6, "endraw") != 0) continue;
      p += 6;
      p += SkipPySpace(src_, p);
      size_t end;
      if (src_.compare(p, 3, "+%}") == 0) {
        end = p + 3;
      } else if (src_.compare(p, 3, "-%}") == 0) {
        end = p + 3;
        end += SkipPySpace(src_, end);
      } else if (src_.compare(p, 2, "%}") == 0) {
        end = p + 2;
        if (trim_blocks_ && end < src_.size() && src_[end] == '\n') ++end;
      } else {
        continue;
      }
      std::string body = src_.substr(body_start, i - body_start);
      if (s == '-') {
        RstripPy(body);
      } else if (s != '+' && lstrip_blocks_) {
        LstripLine(body, *line_starting);
      }
      if (!body.empty()) Emit(Tok::kData, body, line);
      *line_starting = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    SyntaxError("Missing end of raw directive", line);
  }

  void LexComment(size_t start, bool* line_starting) {
    for (size_t i = pos_; i + 1 < src_.size(); ++i) {
      size_t end = 0;
      if (src_[i] == '+' && src_.compare(i + 1, 2, "#}") == 0) {
        end = i + 3;
      } else if (src_[i] == '-' && src_.compare(i + 1, 2, "#}") == 0) {
        end = i + 3;
        end += SkipPySpace(src_, end);
      } else if (src_[i] == '#' && src_[i + 1] == '}') {
        end = i + 2;
        if (trim_blocks_ && end < src_.size() && src_[end] == '\n') ++end;
      } else {
        continue;
      }
      *line_starting = src_[end - 1] == '\n';
      pos_ = end;
      return;
    }
    SyntaxError("Missing end of comment tag", LineAt(start));
  }

  // Expression tokens up to the end of a {{ }} or {% %} tag.
  void LexTag(bool variable, bool* line_starting) {
    std::vector<char> balance;
    while (true) {
      if (pos_ >= src_.size()) {
        SyntaxError(std::string("unexpected end of template, expected '") +
                        (variable ? "end of print statement" : "end of statement block") + "'",
                    LineAt(pos_));
      }
      if (balance.empty() && MatchTagEnd(variable, line_starting)) return;
      char c = src_[pos_];
      int line = LineAt(pos_);
      if (IsSpaceAscii(c)) {
        ++pos_;
        continue;
      }
      if (std::isdigit(static_cast<unsigned char>(c))) {
        LexNumber(line);
        continue;
      }
      if (std::isalpha(static_cast<unsigned char>(c)) || c == '_') {
        size_t p = pos_;
        while (p < src_.size() &&
               (std::isalnum(static_cast<unsigned char>(src_[p])) || src_[p] == '_'))
          ++p;
        Emit(Tok::kName, src_.substr(pos_, p - pos_), line);
        pos_ = p;
        continue;
      }
      if (c == '\'' || c == '"') {
        size_t p = pos_ + 1;
        while (p < src_.size() && src_[p] != c) {
          if (src_[p] == '\\') ++p;
          ++p;
        }
        if (p >= src_.size()) SyntaxError("unexpected char '" + std::string(1, c) + "'", line);
        Token t;
        t.type = Tok::kString;
        t.text = UnescapeLiteral(std::string_view(src_).substr(pos_ + 1, p - pos_ - 1), line);
        t.line = line;
        tokens_.push_back(std::move(t));
        pos_ = p + 1;
        continue;
      }
      static constexpr std::array<const char*, 26> kOps = {
          "//", "**", "==", "!=", ">=", "<=", "+", "-", "/", "*", "%", "~", "[",
          "]",  "(",  ")",  "{",  "}",  ">",  "<", "=", ".", ":", "|", ",", ";"};
      bool found = false;
      for (const char* op : kOps) {
        size_t n = std::strlen(op);
        if (src_.compare(pos_, n, op) == 0) {
          std::string o(op);
          if (o == "(" || o == "[" || o == "{") {
            balance.push_back(o == "(" ? ')' : o == "[" ? ']' : '}');
          } else if (o == ")" || o == "]" || o == "}") {
            if (balance.empty()) SyntaxError("unexpected '" + o + "'", line);
            if (balance.back() != o[0]) {
              SyntaxError(
                  "unexpected '" + o + "', expected '" + std::string(1, balance.back()) + "'",
                  line);
            }
            balance.pop_back();
          }
          Emit(Tok::kOp, o, line);
          pos_ += n;
          found = true;
          break;
        }
      }
      if (!found) {
        size_t len = 1;
        unsigned char u = static_cast<unsigned char>(c);
        if (u >= 0x80) len = (u & 0xe0) == 0xc0 ? 2 : (u & 0xf0) == 0xe0 ? 3 : 4;
        SyntaxError("unexpected char " + StringRepr(src_.substr(pos_, len)), line);
      }
    }
  }

  bool MatchTagEnd(bool variable, bool* line_starting) {
    const char* end = variable ? "}}" : "%}";
    size_t end_pos;
    int line = LineAt(pos_);
    if (src_.compare(pos_, 3, std::string("-") + end) == 0) {
      end_pos = pos_ + 3;
      end_pos += SkipPySpace(src_, end_pos);
    } else if (!variable && src_.compare(pos_, 3, "+%}") == 0) {
      end_pos = pos_ + 3;
    } else if (src_.compare(pos_, 2, end) == 0) {
      end_pos = pos_ + 2;
      if (!variable && trim_blocks_ && end_pos < src_.size() && src_[end_pos] == '\n') ++end_pos;
    } else {
      return false;
    }
    Emit(variable ? Tok::kVarEnd : Tok::kBlockEnd, "", line);
    *line_starting = src_[end_pos - 1] == '\n';
    pos_ = end_pos;
    return true;
  }

  // Jinja's integer_re / float_re (with '_' digit separators, 0b/0o/0x prefixes).
  void LexNumber(int line) {
    auto digits = [&](size_t p, auto is_digit) {
      // (\d+_)*\d+  → returns end or p when none
      size_t q = p;
      if (q >= src_.size() || !is_digit(src_[q])) return p;
      while (q < src_.size()) {
        if (is_digit(src_[q])) {
          ++q;
        } else if (src_[q] == '_' && q + 1 < src_.size() && is_digit(src_[q + 1])) {
          ++q;
        } else {
          break;
        }
      }
      return q;
    };
    auto dec = [](char ch) { return ch >= '0' && ch <= '9'; };
    size_t int_end = digits(pos_, dec);
    // float: int part, then (.digits)?(e[+-]?digits) or .digits
    size_t p = int_end;
    bool is_float = false;
    size_t frac_end = p;
    if (p < src_.size() && src_[p] == '.') {
      size_t q = digits(p + 1, dec);
      if (q > p + 1) {
        frac_end = q;
        is_float = true;
      }
    }
    size_t exp_end = frac_end;
    if (exp_end < src_.size() && (src_[exp_end] == 'e' || src_[exp_end] == 'E')) {
      size_t q = exp_end + 1;
      if (q < src_.size() && (src_[q] == '+' || src_[q] == '-')) ++q;
      size_t r = digits(q, dec);
      if (r > q) {
        exp_end = r;
        is_float = true;
      }
    }
    if (is_float) {
      std::string text;
      for (size_t i = pos_; i < exp_end; ++i) {
        if (src_[i] != '_') text.push_back(src_[i]);
      }
      Token t;
      t.type = Tok::kFloat;
      t.number = Value::Float(std::strtod(text.c_str(), nullptr));
      t.line = line;
      tokens_.push_back(std::move(t));
      pos_ = exp_end;
      return;
    }
    int base = 10;
    size_t start = pos_;
    size_t end = int_end;
    if (src_[pos_] == '0' && pos_ + 1 < src_.size()) {
      char x = static_cast<char>(std::tolower(static_cast<unsigned char>(src_[pos_ + 1])));
      auto prefixed = [&](int b, auto is_digit) {
        size_t q = pos_ + 2;
        size_t last = q;
        while (q < src_.size()) {
          if (src_[q] == '_' && q + 1 < src_.size() && is_digit(src_[q + 1])) {
            q += 2;
            last = q;
          } else if (is_digit(src_[q])) {
            ++q;
            last = q;
          } else {
            break;
          }
        }
        if (last > pos_ + 2) {
          base = b;
          start = pos_ + 2;
          end = last;
        }
      };
      if (x == 'b') prefixed(2, [](char ch) { return ch == '0' || ch == '1'; });
      if (x == 'o') prefixed(8, [](char ch) { return ch >= '0' && ch <= '7'; });
      if (x == 'x')
        prefixed(16, [](char ch) { return std::isxdigit(static_cast<unsigned char>(ch)) != 0; });
      if (base == 10) {
        // 0(_?0)* : a leading zero takes only zeros
        end = pos_ + 1;
        while (end < src_.size() &&
               (src_[end] == '0' ||
                (src_[end] == '_' && end + 1 < src_.size() && src_[end + 1] == '0')))
          ++end;
      }
    }
    std::string text;
    for (size_t i = start; i < end; ++i) {
      if (src_[i] != '_') text.push_back(src_[i]);
    }
    errno = 0;
    long long v = std::strtoll(text.c_str(), nullptr, base);
    if (errno == ERANGE) SyntaxError("integer literal " + text + " is out of range", line);
    Token t;
    t.type = Tok::kInt;
    t.number = Value::Int(v);
    t.line = line;
    tokens_.push_back(std::move(t));
    pos_ = end;
  }

  std::string src_;
  bool trim_blocks_;
  bool lstrip_blocks_;
  size_t pos_ = 0;
  size_t line_pos_ = 0;
  int line_ = 1;
  std::vector<Token> tokens_;
};

constexpr std::array<std::string_view, 52> kFilterNames = {
    "abs",    "attr",       "batch",       "capitalize", "center",   "count",
    "d",      "default",    "dictsort",    "e",          "escape",   "filesizeformat",
    "first",  "float",      "forceescape", "format",     "groupby",  "indent",
    "int",    "items",      "join",        "last",       "length",   "list",
    "lower",  "map",        "max",         "min",        "pprint",   "random",
    "reject", "rejectattr", "replace",     "reverse",    "round",    "safe",
    "select", "selectattr", "slice",       "sort",       "string",   "striptags",
    "sum",    "title",      "tojson",      "trim",       "truncate", "unique",
    "upper",  "urlencode",  "urlize",      "wordcount"};
constexpr std::array<std::string_view, 3> kMoreFilterNames = {"wordwrap", "xmlattr", "indent"};

constexpr std::array<std::string_view, 38> kTestNames = {
    "boolean", "callable", "defined",  "divisibleby", "eq",    "equalto",  "escaped",
    "even",    "false",    "filter",   "float",       "ge",    "gt",       "greaterthan",
    "in",      "integer",  "iterable", "le",          "lower", "lessthan", "lt",
    "mapping", "ne",       "none",     "number",      "odd",   "sameas",   "sequence",
    "string",  "test",     "true",     "undefined",   "upper", "==",       "!=",
    "<",       "<=",       ">"};

class Parser {
 public:
  Parser(std::vector<Token> tokens, int max_depth)
      : toks_(std::move(tokens)), max_depth_(max_depth) {}

  NodePtr ParseTemplate() {
    auto root = MakeNode(NodeKind::kTemplate, 1);
    root->kids = ParseStatements({});
    if (Cur().type != Tok::kEof) Fail("unexpected token", Cur().line);
    return root;
  }

 private:
  struct DepthGuard {
    explicit DepthGuard(Parser* p) : p_(p) {
      if (++p_->depth_ > p_->max_depth_) {
        throw Error{"the template nests deeper than " + std::to_string(p_->max_depth_) + " levels",
                    p_->Cur().line, false, true};
      }
    }
    ~DepthGuard() { --p_->depth_; }
    Parser* p_;
  };

  // A left-associative chain (a + b + c, x|f|g, a.b.c) nests one level per link although it is
  // parsed by a loop: each link counts toward the depth until the chain is done.
  struct ChainDepth {
    explicit ChainDepth(Parser* p) : p_(p) {}
    void Add() {
      ++n_;
      if (++p_->depth_ > p_->max_depth_) {
        throw Error{"the template nests deeper than " + std::to_string(p_->max_depth_) + " levels",
                    p_->Cur().line, false, true};
      }
    }
    ~ChainDepth() { p_->depth_ -= n_; }
    Parser* p_;
    int n_ = 0;
  };

  static NodePtr MakeNode(NodeKind kind, int line) {
    auto n = std::make_unique<Node>();
    n->kind = kind;
    n->line = line;
    return n;
  }

  [[noreturn]] void Fail(const std::string& msg, int line) { SyntaxError(msg, line); }

  const Token& Cur() const { return toks_[pos_]; }
  const Token& Peek(size_t n = 1) const { return toks_[std::min(pos_ + n, toks_.size() - 1)]; }
  Token Next() {
    Token t = toks_[pos_];
    if (pos_ + 1 < toks_.size()) ++pos_;
    return t;
  }
  bool IsOp(std::string_view op) const { return Cur().type == Tok::kOp && Cur().text == op; }
  bool IsName(std::string_view name) const {
    return Cur().type == Tok::kName && Cur().text == name;
  }
  bool SkipOp(std::string_view op) {
    if (!IsOp(op)) return false;
    Next();
    return true;
  }
  bool SkipName(std::string_view name) {
    if (!IsName(name)) return false;
    Next();
    return true;
  }

  static std::string Describe(const Token& t) {
    switch (t.type) {
      case Tok::kEof:
        return "end of template";
      case Tok::kBlockEnd:
        return "end of statement block";
      case Tok::kVarEnd:
        return "end of print statement";
      case Tok::kBlockBegin:
        return "begin of statement block";
      case Tok::kVarBegin:
        return "begin of print statement";
      case Tok::kData:
        return "template data";
      case Tok::kString:
        return "string";
      case Tok::kInt:
        return "integer";
      case Tok::kFloat:
        return "float";
      default:
        return t.text;
    }
  }

  void ExpectOp(std::string_view op) {
    if (!SkipOp(op)) {
      Fail("expected token '" + std::string(op) + "', got '" + Describe(Cur()) + "'", Cur().line);
    }
  }
  std::string ExpectName() {
    if (Cur().type != Tok::kName) {
      Fail("expected token 'name', got '" + Describe(Cur()) + "'", Cur().line);
    }
    return Next().text;
  }
  void ExpectBlockEnd() {
    if (Cur().type != Tok::kBlockEnd) {
      Fail("expected token 'end of statement block', got '" + Describe(Cur()) + "'", Cur().line);
    }
    Next();
  }

  // Statements until a {% tag %} whose name is one of `end_tags` (left as the current token,
  // the block-begin consumed) or the end of the template when `end_tags` is empty.
  std::vector<NodePtr> ParseStatements(const std::vector<std::string_view>& end_tags) {
    DepthGuard guard(this);
    std::vector<NodePtr> body;
    while (true) {
      const Token& t = Cur();
      if (t.type == Tok::kEof) {
        if (!end_tags.empty()) {
          std::string expected;
          for (size_t i = 0; i < end_tags.size(); ++i) {
            expected += (i ? " or '" : "'") + std::string(end_tags[i]) + "'";
          }
          Fail("unexpected end of template, expected " + expected + ".", t.line);
        }
        return body;
      }
      if (t.type == Tok::kData) {
        auto n = MakeNode(NodeKind::kData, t.line);
        n->value = Value::String(t.text);
        body.push_back(std::move(n));
        Next();
        continue;
      }
      if (t.type == Tok::kVarBegin) {
        Next();
        auto n = MakeNode(NodeKind::kOutput, t.line);
        n->kids.push_back(ParseTuple(true, {}, false));
        if (Cur().type != Tok::kVarEnd) {
          Fail("expected token 'end of print statement', got '" + Describe(Cur()) + "'",
               Cur().line);
        }
        Next();
        body.push_back(std::move(n));
        continue;
      }
      if (t.type != Tok::kBlockBegin) Fail("unexpected '" + Describe(t) + "'", t.line);
      Next();
      if (Cur().type == Tok::kName &&
          std::find(end_tags.begin(), end_tags.end(), Cur().text) != end_tags.end()) {
        return body;
      }
      body.push_back(ParseStatement(end_tags));
    }
  }

  NodePtr ParseStatement(const std::vector<std::string_view>& enclosing) {
    const Token& t = Cur();
    if (t.type != Tok::kName) Fail("tag name expected", t.line);
    std::string tag = t.text;
    int line = t.line;
    if (tag == "if") return ParseIf();
    if (tag == "for") return ParseFor();
    if (tag == "set") return ParseSet();
    if (tag == "macro") return ParseMacro();
    if (tag == "call") return ParseCallBlock();
    if (tag == "filter") return ParseFilterBlock();
    if (tag == "with") return ParseWith();
    if (tag == "break" || tag == "continue") {
      Next();
      ExpectBlockEnd();
      if (loop_depth_ == 0) Fail("'" + tag + "' outside of a loop", line);
      return MakeNode(tag == "break" ? NodeKind::kBreak : NodeKind::kContinue, line);
    }
    if (tag == "generation") return ParseBodyOnly("endgeneration");
    if (tag == "block") {
      Next();
      ExpectName();
      SkipName("scoped");
      SkipName("required");
      ExpectBlockEnd();
      auto n = MakeNode(NodeKind::kBody, line);
      n->kids = ParseStatements({"endblock"});
      Next();
      if (Cur().type == Tok::kName) Next();
      ExpectBlockEnd();
      return n;
    }
    static constexpr std::array<std::string_view, 8> kUnsupported = {
        "extends", "include", "import", "from", "autoescape", "do", "trans", "print"};
    if (std::find(kUnsupported.begin(), kUnsupported.end(), tag) != kUnsupported.end()) {
      Fail("the '" + tag + "' tag is not supported in chat templates", line);
    }
    std::string msg = "Encountered unknown tag '" + tag + "'.";
    if (!enclosing.empty()) {
      msg += " The innermost block that needs to be closed is '" + std::string(enclosing.back()) +
             "'.";
    }
    Fail(msg, line);
  }

  NodePtr ParseBodyOnly(std::string_view end_tag) {
    int line = Next().line;
    ExpectBlockEnd();
    auto n = MakeNode(NodeKind::kBody, line);
    n->kids = ParseStatements({end_tag});
    Next();
    ExpectBlockEnd();
    return n;
  }

  NodePtr Body(std::vector<NodePtr> stmts, int line) {
    auto n = MakeNode(NodeKind::kBody, line);
    n->kids = std::move(stmts);
    return n;
  }

  NodePtr ParseIf() {
    int line = Next().line;  // if / elif
    auto n = MakeNode(NodeKind::kIf, line);
    n->kids.push_back(ParseTuple(false, {}, false));
    ExpectBlockEnd();
    n->kids.push_back(Body(ParseStatements({"elif", "else", "endif"}), line));
    if (IsName("elif")) {
      n->kids.push_back(ParseIf());  // consumes through endif
      return n;
    }
    if (SkipName("else")) {
      ExpectBlockEnd();
      n->kids.push_back(Body(ParseStatements({"endif"}), line));
    } else {
      n->kids.push_back(nullptr);
    }
    Next();  // endif
    ExpectBlockEnd();
    return n;
  }

  NodePtr ParseFor() {
    int line = Next().line;
    auto n = MakeNode(NodeKind::kFor, line);
    n->kids.push_back(ParseAssignTarget({"in"}, false));
    if (!SkipName("in")) Fail("expected token 'in', got '" + Describe(Cur()) + "'", Cur().line);
    n->kids.push_back(ParseTuple(false, {"recursive"}, false, false));
    if (SkipName("if")) {
      n->kids.push_back(ParseExpression(true));
    } else {
      n->kids.push_back(nullptr);
    }
    n->recursive = SkipName("recursive");
    ExpectBlockEnd();
    ++loop_depth_;
    n->kids.push_back(Body(ParseStatements({"endfor", "else"}), line));
    --loop_depth_;
    if (SkipName("else")) {
      ExpectBlockEnd();
      n->kids.push_back(Body(ParseStatements({"endfor"}), line));
    } else {
      n->kids.push_back(nullptr);
    }
    Next();  // endfor
    ExpectBlockEnd();
    return n;
  }

  NodePtr ParseSet() {
    int line = Next().line;
    NodePtr target = ParseAssignTarget({}, true);
    if (SkipOp("=")) {
      auto n = MakeNode(NodeKind::kSet, line);
      n->kids.push_back(std::move(target));
      n->kids.push_back(ParseTuple(true, {}, false));
      ExpectBlockEnd();
      return n;
    }
    auto n = MakeNode(NodeKind::kSetBlock, line);
    n->kids.push_back(std::move(target));
    NodePtr filter = ParseFilterChain(nullptr);
    ExpectBlockEnd();
    int saved_loop = loop_depth_;
    n->kids.push_back(Body(ParseStatements({"endset"}), line));
    loop_depth_ = saved_loop;
    n->kids.push_back(std::move(filter));
    Next();
    ExpectBlockEnd();
    return n;
  }

  // name | name.attr (set only) | tuple of names
  NodePtr ParseAssignTarget(const std::vector<std::string_view>& extra_end, bool with_namespace) {
    int line = Cur().line;
    std::vector<NodePtr> names;
    bool is_tuple = false;
    bool paren = SkipOp("(");
    while (true) {
      if (!names.empty()) ExpectOp(",");
      if (IsTupleEnd(extra_end) || (paren && IsOp(")"))) break;
      if (Cur().type != Tok::kName)
        Fail("expected token 'name', got '" + Describe(Cur()) + "'", Cur().line);
      Token name = Next();
      NodePtr target;
      if (with_namespace && IsOp(".")) {
        Next();
        target = MakeNode(NodeKind::kGetattr, name.line);
        auto ns = MakeNode(NodeKind::kName, name.line);
        ns->name = name.text;
        target->kids.push_back(std::move(ns));
        target->name = ExpectName();
      } else {
        if (name.text == "true" || name.text == "false" || name.text == "none" ||
            name.text == "True" || name.text == "False" || name.text == "None") {
          Fail("can't assign to a constant", name.line);
        }
        target = MakeNode(NodeKind::kName, name.line);
        target->name = name.text;
      }
      names.push_back(std::move(target));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (paren) ExpectOp(")");
    if (names.empty()) Fail("expected an assignment target", line);
    if (!is_tuple && !paren) return std::move(names[0]);
    if (!is_tuple && names.size() == 1) return std::move(names[0]);
    auto t = MakeNode(NodeKind::kTuple, line);
    t->kids = std::move(names);
    return t;
  }

  void ParseSignature(Node* n) {
    ExpectOp("(");
    bool defaults = false;
    while (!IsOp(")")) {
      if (!n->arg_names.empty()) ExpectOp(",");
      if (IsOp(")")) break;
      n->arg_names.push_back(ExpectName());
      if (SkipOp("=")) {
        n->kids.push_back(ParseExpression(true));
        defaults = true;
      } else {
        if (defaults) Fail("non-default argument follows default argument", Cur().line);
        n->kids.push_back(nullptr);
      }
    }
    ExpectOp(")");
  }

  NodePtr ParseMacro() {
    int line = Next().line;
    auto n = MakeNode(NodeKind::kMacro, line);
    n->name = ExpectName();
    ParseSignature(n.get());
    ExpectBlockEnd();
    int saved_loop = loop_depth_;
    loop_depth_ = 0;
    n->kids.push_back(Body(ParseStatements({"endmacro"}), line));
    loop_depth_ = saved_loop;
    n->value = Value::Int(MacroFlags(*n->kids.back()));
    Next();
    ExpectBlockEnd();
    return n;
  }

  // bit 0: the body reads `varargs`; bit 1: it reads `kwargs` (then extra arguments are kept).
  static int64_t MacroFlags(const Node& n) {
    int64_t flags = 0;
    if (n.kind == NodeKind::kName && n.name == "varargs") flags |= 1;
    if (n.kind == NodeKind::kName && n.name == "kwargs") flags |= 2;
    for (const NodePtr& k : n.kids) {
      if (k) flags |= MacroFlags(*k);
    }
    return flags;
  }

  NodePtr ParseCallBlock() {
    int line = Next().line;
    auto n = MakeNode(NodeKind::kCallBlock, line);
    auto sig = MakeNode(NodeKind::kMacro, line);
    sig->name = "caller";
    if (IsOp("(")) ParseSignature(sig.get());
    NodePtr call = ParseExpression(true);
    if (call->kind != NodeKind::kCall) Fail("expected call", line);
    ExpectBlockEnd();
    int saved_loop = loop_depth_;
    loop_depth_ = 0;
    sig->kids.push_back(Body(ParseStatements({"endcall"}), line));
    loop_depth_ = saved_loop;
    sig->value = Value::Int(MacroFlags(*sig->kids.back()));
    Next();
    ExpectBlockEnd();
    n->kids.push_back(std::move(call));
    n->kids.push_back(std::move(sig));
    return n;
  }

  NodePtr ParseFilterBlock() {
    int line = Next().line;
    auto n = MakeNode(NodeKind::kFilterBlock, line);
    NodePtr filter = ParseFilterChain(nullptr, true);
    ExpectBlockEnd();
    n->kids.push_back(std::move(filter));
    n->kids.push_back(Body(ParseStatements({"endfilter"}), line));
    Next();
    ExpectBlockEnd();
    return n;
  }

  NodePtr ParseWith() {
    int line = Next().line;
    auto n = MakeNode(NodeKind::kWith, line);
    while (Cur().type != Tok::kBlockEnd) {
      if (!n->kids.empty()) ExpectOp(",");
      n->kids.push_back(ParseAssignTarget({}, false));
      ExpectOp("=");
      n->kids.push_back(ParseExpression(true));
    }
    ExpectBlockEnd();
    n->kids.push_back(Body(ParseStatements({"endwith"}), line));
    Next();
    ExpectBlockEnd();
    return n;
  }

  bool IsTupleEnd(const std::vector<std::string_view>& extra_end) const {
    if (Cur().type == Tok::kVarEnd || Cur().type == Tok::kBlockEnd || Cur().type == Tok::kEof)
      return true;
    if (IsOp(")")) return true;
    for (auto e : extra_end) {
      if (IsName(e)) return true;
    }
    return false;
  }

  NodePtr ParseTuple(bool with_condexpr, const std::vector<std::string_view>& extra_end,
                     bool explicit_parens, bool allow_empty_fail = true) {
    int line = Cur().line;
    std::vector<NodePtr> items;
    bool is_tuple = false;
    while (true) {
      if (!items.empty()) ExpectOp(",");
      if (IsTupleEnd(extra_end)) break;
      items.push_back(ParseExpression(with_condexpr));
      if (IsOp(",")) {
        is_tuple = true;
      } else {
        break;
      }
    }
    if (!is_tuple) {
      if (!items.empty()) return std::move(items[0]);
      if (!explicit_parens) {
        Fail("Expected an expression, got '" + Describe(Cur()) + "'", Cur().line);
      }
    }
    auto t = MakeNode(NodeKind::kTuple, line);
    t->kids = std::move(items);
    return t;
  }

  NodePtr ParseExpression(bool with_condexpr) {
    DepthGuard guard(this);
    if (!with_condexpr) return ParseOr();
    NodePtr expr = ParseOr();
    ChainDepth chain(this);
    while (IsName("if")) {
      chain.Add();
      int line = Next().line;
      auto n = MakeNode(NodeKind::kCondExpr, line);
      NodePtr test = ParseOr();
      NodePtr otherwise;
      if (SkipName("else")) otherwise = ParseExpression(true);
      n->kids.push_back(std::move(expr));
      n->kids.push_back(std::move(test));
      n->kids.push_back(std::move(otherwise));
      expr = std::move(n);
    }
    return expr;
  }

  NodePtr Binary(std::string op, NodePtr a, NodePtr b, int line) {
    auto n = MakeNode(NodeKind::kBinary, line);
    n->name = std::move(op);
    n->kids.push_back(std::move(a));
    n->kids.push_back(std::move(b));
    return n;
  }

  NodePtr ParseOr() {
    NodePtr left = ParseAnd();
    ChainDepth chain(this);
    while (IsName("or")) {
      chain.Add();
      int line = Next().line;
      left = Binary("or", std::move(left), ParseAnd(), line);
    }
    return left;
  }
  NodePtr ParseAnd() {
    NodePtr left = ParseNot();
    ChainDepth chain(this);
    while (IsName("and")) {
      chain.Add();
      int line = Next().line;
      left = Binary("and", std::move(left), ParseNot(), line);
    }
    return left;
  }
  NodePtr ParseNot() {
    DepthGuard guard(this);
    if (IsName("not")) {
      int line = Next().line;
      auto n = MakeNode(NodeKind::kUnary, line);
      n->name = "not";
      n->kids.push_back(ParseNot());
      return n;
    }
    return ParseCompare();
  }
  NodePtr ParseCompare() {
    int line = Cur().line;
    NodePtr expr = ParseMath1();
    NodePtr cmp;
    while (true) {
      std::string op;
      if (Cur().type == Tok::kOp &&
          (Cur().text == "==" || Cur().text == "!=" || Cur().text == "<" || Cur().text == "<=" ||
           Cur().text == ">" || Cur().text == ">=")) {
        op = Next().text;
      } else if (SkipName("in")) {
        op = "in";
      } else if (IsName("not") && Peek().type == Tok::kName && Peek().text == "in") {
        Next();
        Next();
        op = "notin";
      } else {
        break;
      }
      if (!cmp) {
        cmp = MakeNode(NodeKind::kCompare, line);
        cmp->kids.push_back(std::move(expr));
      }
      cmp->arg_names.push_back(op);
      cmp->kids.push_back(ParseMath1());
    }
    return cmp ? std::move(cmp) : std::move(expr);
  }
  NodePtr ParseMath1() {
    NodePtr left = ParseConcat();
    ChainDepth chain(this);
    while (IsOp("+") || IsOp("-")) {
      chain.Add();
      Token t = Next();
      left = Binary(t.text, std::move(left), ParseConcat(), t.line);
    }
    return left;
  }
  NodePtr ParseConcat() {
    NodePtr left = ParseMath2();
    ChainDepth chain(this);
    while (IsOp("~")) {
      chain.Add();
      int line = Next().line;
      left = Binary("~", std::move(left), ParseMath2(), line);
    }
    return left;
  }
  NodePtr ParseMath2() {
    NodePtr left = ParsePow();
    ChainDepth chain(this);
    while (IsOp("*") || IsOp("/") || IsOp("//") || IsOp("%")) {
      chain.Add();
      Token t = Next();
      left = Binary(t.text, std::move(left), ParsePow(), t.line);
    }
    return left;
  }
  NodePtr ParsePow() {
    NodePtr left = ParseUnary(true);
    ChainDepth chain(this);
    while (IsOp("**")) {
      chain.Add();
      int line = Next().line;
      left = Binary("**", std::move(left), ParseUnary(true), line);
    }
    return left;
  }
  NodePtr ParseUnary(bool with_filter) {
    DepthGuard guard(this);
    NodePtr node;
    if (IsOp("-") || IsOp("+")) {
      Token t = Next();
      node = MakeNode(NodeKind::kUnary, t.line);
      node->name = t.text;
      node->kids.push_back(ParseUnary(false));
    } else {
      node = ParsePostfix(ParsePrimary());
    }
    if (with_filter) node = ParseFilterExpr(std::move(node));
    return node;
  }

  NodePtr ParsePrimary() {
    DepthGuard guard(this);
    const Token& t = Cur();
    int line = t.line;
    if (t.type == Tok::kName) {
      Token name = Next();
      auto n = MakeNode(NodeKind::kConst, line);
      if (name.text == "true" || name.text == "True") {
        n->value = Value::Bool(true);
      } else if (name.text == "false" || name.text == "False") {
        n->value = Value::Bool(false);
      } else if (name.text == "none" || name.text == "None") {
        n->value = Value::None();
      } else {
        n->kind = NodeKind::kName;
        n->name = name.text;
      }
      return n;
    }
    if (t.type == Tok::kString) {
      std::string s;
      while (Cur().type == Tok::kString) s += Next().text;
      auto n = MakeNode(NodeKind::kConst, line);
      n->value = Value::String(std::move(s));
      return n;
    }
    if (t.type == Tok::kInt || t.type == Tok::kFloat) {
      auto n = MakeNode(NodeKind::kConst, line);
      n->value = Next().number;
      return n;
    }
    if (IsOp("(")) {
      Next();
      NodePtr n = ParseTuple(true, {}, true);
      ExpectOp(")");
      return n;
    }
    if (IsOp("[")) {
      Next();
      auto n = MakeNode(NodeKind::kList, line);
      while (!IsOp("]")) {
        if (!n->kids.empty()) ExpectOp(",");
        if (IsOp("]")) break;
        n->kids.push_back(ParseExpression(true));
      }
      ExpectOp("]");
      return n;
    }
    if (IsOp("{")) {
      Next();
      auto n = MakeNode(NodeKind::kDict, line);
      while (!IsOp("}")) {
        if (!n->kids.empty()) ExpectOp(",");
        if (IsOp("}")) break;
        n->kids.push_back(ParseExpression(true));
        ExpectOp(":");
        n->kids.push_back(ParseExpression(true));
      }
      ExpectOp("}");
      return n;
    }
    Fail("unexpected '" + Describe(t) + "'", line);
  }

  NodePtr ParsePostfix(NodePtr node) {
    ChainDepth chain(this);
    while (true) {
      chain.Add();
      if (IsOp(".") || IsOp("[")) {
        node = ParseSubscript(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  NodePtr ParseFilterExpr(NodePtr node) {
    ChainDepth chain(this);
    while (true) {
      chain.Add();
      if (IsOp("|")) {
        node = ParseFilterChain(std::move(node));
      } else if (IsName("is")) {
        node = ParseTest(std::move(node));
      } else if (IsOp("(")) {
        node = ParseCall(std::move(node));
      } else {
        return node;
      }
    }
  }

  NodePtr ParseSubscript(NodePtr node) {
    Token t = Next();
    if (t.text == ".") {
      if (Cur().type == Tok::kName) {
        auto n = MakeNode(NodeKind::kGetattr, t.line);
        n->name = Next().text;
        n->kids.push_back(std::move(node));
        return n;
      }
      if (Cur().type != Tok::kInt) Fail("expected name or number", Cur().line);
      auto n = MakeNode(NodeKind::kGetitem, t.line);
      auto c = MakeNode(NodeKind::kConst, t.line);
      c->value = Next().number;
      n->kids.push_back(std::move(node));
      n->kids.push_back(std::move(c));
      return n;
    }
    std::vector<NodePtr> args;
    while (!IsOp("]")) {
      if (!args.empty()) ExpectOp(",");
      args.push_back(ParseSubscribed());
    }
    ExpectOp("]");
    auto n = MakeNode(NodeKind::kGetitem, t.line);
    n->kids.push_back(std::move(node));
    if (args.size() == 1) {
      n->kids.push_back(std::move(args[0]));
    } else {
      auto tup = MakeNode(NodeKind::kTuple, t.line);
      tup->kids = std::move(args);
      n->kids.push_back(std::move(tup));
    }
    return n;
  }

  NodePtr ParseSubscribed() {
    int line = Cur().line;
    NodePtr start;
    if (!IsOp(":")) {
      start = ParseExpression(true);
      if (!IsOp(":")) return start;
    }
    Next();  // ':'
    auto n = MakeNode(NodeKind::kSlice, line);
    n->kids.push_back(std::move(start));
    if (IsOp(":") || IsOp("]") || IsOp(",")) {
      n->kids.push_back(nullptr);
    } else {
      n->kids.push_back(ParseExpression(true));
    }
    if (SkipOp(":")) {
      if (IsOp("]") || IsOp(",")) {
        n->kids.push_back(nullptr);
      } else {
        n->kids.push_back(ParseExpression(true));
      }
    } else {
      n->kids.push_back(nullptr);
    }
    return n;
  }

  // Appends `(args)` to n: kids and arg_names as documented for kCall.
  void ParseCallArgs(Node* n) {
    int line = Cur().line;
    ExpectOp("(");
    bool require_comma = false;
    bool have_kw = false, have_star = false, have_dstar = false;
    while (!IsOp(")")) {
      if (require_comma) {
        ExpectOp(",");
        if (IsOp(")")) break;
      }
      if (IsOp("*")) {
        if (have_star || have_dstar) Fail("invalid syntax for function call expression", line);
        Next();
        n->arg_names.push_back("*");
        n->kids.push_back(ParseExpression(true));
        have_star = true;
      } else if (IsOp("**")) {
        if (have_dstar) Fail("invalid syntax for function call expression", line);
        Next();
        n->arg_names.push_back("**");
        n->kids.push_back(ParseExpression(true));
        have_dstar = true;
      } else if (Cur().type == Tok::kName && Peek().type == Tok::kOp && Peek().text == "=") {
        if (have_dstar) Fail("invalid syntax for function call expression", line);
        n->arg_names.push_back(Next().text);
        Next();
        n->kids.push_back(ParseExpression(true));
        have_kw = true;
      } else {
        if (have_star || have_dstar || have_kw)
          Fail("invalid syntax for function call expression", line);
        n->arg_names.push_back("");
        n->kids.push_back(ParseExpression(true));
      }
      require_comma = true;
    }
    ExpectOp(")");
  }

  NodePtr ParseCall(NodePtr callee) {
    auto n = MakeNode(NodeKind::kCall, Cur().line);
    n->kids.push_back(std::move(callee));
    n->arg_names.push_back("");  // slot of the callee, keeps kids/arg_names aligned
    ParseCallArgs(n.get());
    return n;
  }

  NodePtr ParseFilterChain(NodePtr node, bool start_inline = false) {
    ChainDepth chain(this);
    while (IsOp("|") || start_inline) {
      chain.Add();
      if (!start_inline) Next();
      start_inline = false;
      int line = Cur().line;
      std::string name = ExpectName();
      while (IsOp(".")) {
        Next();
        name += "." + ExpectName();
      }
      if (!IsJinjaFilterName(name)) Fail("No filter named '" + name + "'.", line);
      auto n = MakeNode(NodeKind::kFilter, line);
      n->name = name;
      n->kids.push_back(std::move(node));
      n->arg_names.push_back("");
      if (IsOp("(")) ParseCallArgs(n.get());
      node = std::move(n);
    }
    return node;
  }

  NodePtr ParseTest(NodePtr node) {
    int line = Next().line;  // 'is'
    bool negate = SkipName("not");
    std::string name = ExpectName();
    while (IsOp(".")) {
      Next();
      name += "." + ExpectName();
    }
    if (!IsJinjaTestName(name)) Fail("No test named '" + name + "'.", line);
    auto n = MakeNode(NodeKind::kTest, line);
    n->name = name;
    n->negate = negate;
    n->kids.push_back(std::move(node));
    n->arg_names.push_back("");
    if (IsOp("(")) {
      ParseCallArgs(n.get());
    } else if ((Cur().type == Tok::kName || Cur().type == Tok::kString || Cur().type == Tok::kInt ||
                Cur().type == Tok::kFloat || IsOp("(") || IsOp("[") || IsOp("{")) &&
               !IsName("else") && !IsName("or") && !IsName("and")) {
      if (IsName("is")) Fail("You cannot chain multiple tests with is", Cur().line);
      n->arg_names.push_back("");
      n->kids.push_back(ParsePostfix(ParsePrimary()));
    }
    return n;
  }

  std::vector<Token> toks_;
  size_t pos_ = 0;
  int depth_ = 0;
  int max_depth_;
  int loop_depth_ = 0;
};

}  // namespace

bool IsJinjaFilterName(std::string_view name) {
  return std::find(kFilterNames.begin(), kFilterNames.end(), name) != kFilterNames.end() ||
         std::find(kMoreFilterNames.begin(), kMoreFilterNames.end(), name) !=
             kMoreFilterNames.end();
}

bool IsJinjaTestName(std::string_view name) {
  return std::find(kTestNames.begin(), kTestNames.end(), name) != kTestNames.end() || name == ">=";
}

NodePtr ParseTemplate(std::string_view source, bool trim_blocks, bool lstrip_blocks,
                      int max_depth) {
  Lexer lexer(source, trim_blocks, lstrip_blocks);
  Parser parser(lexer.Run(), max_depth);
  return parser.ParseTemplate();
}

}  // namespace kvbridge::jinja

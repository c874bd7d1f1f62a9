// src/model/jinja/builtins.cc — the globals, str/dict/list methods, filters and tests of
// kvbridge's Jinja2 subset, each as Python Jinja2 3.1 (jinja2/filters.py, jinja2/tests.py) and
// CPython's str methods define them, under transformers' set-up (its tojson, raise_exception,
// strftime_now; ImmutableSandboxedEnvironment, which refuses list.append and dict.update).
//
// Case mapping (upper, lower, title, capitalize, swapcase) covers ASCII, Latin-1, Greek and
// Cyrillic; other scripts pass through unchanged (Python maps all of Unicode).
#include "model/jinja/builtins.h"

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <ctime>

namespace kvbridge::jinja {
namespace {

Value MakeFn(std::string name, std::function<Value(Interpreter&, const CallArgs&)> fn) {
  auto c = std::make_shared<Callable>();
  c->name = std::move(name);
  c->fn = std::move(fn);
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::move(c);
  return v;
}

// ---------------- text helpers (code points) ----------------

bool IsUpperCp(char32_t c) {
  return (c >= 'A' && c <= 'Z') || (c >= 0xc0 && c <= 0xde && c != 0xd7) ||
         (c >= 0x391 && c <= 0x3a9) || (c >= 0x400 && c <= 0x42f);
}
bool IsLowerCp(char32_t c) {
  return (c >= 'a' && c <= 'z') || (c >= 0xdf && c <= 0xff && c != 0xf7) ||
         (c >= 0x3b1 && c <= 0x3c9) || (c >= 0x430 && c <= 0x45f);
}
bool IsCased(char32_t c) { return IsUpperCp(c) || IsLowerCp(c); }
bool IsAlphaCp(char32_t c) {
  return IsCased(c) || (c >= 0x80 && !IsPySpace(c) && !(c >= 0x2000 && c <= 0x2bff) &&
                        !(c >= 0x3000 && c <= 0x303f) && !(c >= 0xff00 && c <= 0xff0f) &&
                        c != 0xd7 && c != 0xf7 && !(c >= 0xa1 && c <= 0xbf));
}
bool IsDigitCp(char32_t c) { return c >= '0' && c <= '9'; }

std::u32string ToUpperCps(std::u32string_view s) {
  std::u32string r;
  r.reserve(s.size());
  for (char32_t c : s) {
    if (c >= 'a' && c <= 'z') {
      r.push_back(c - 32);
    } else if (c == 0xdf) {
      r += U"SS";
    } else if (c == 0xff) {
      r.push_back(0x178);
    } else if (c >= 0xe0 && c <= 0xfe && c != 0xf7) {
      r.push_back(c - 32);
    } else if (c >= 0x3b1 && c <= 0x3c9 && c != 0x3c2) {
      r.push_back(c - 32);
    } else if (c == 0x3c2) {
      r.push_back(0x3a3);
    } else if (c >= 0x430 && c <= 0x44f) {
      r.push_back(c - 32);
    } else if (c >= 0x450 && c <= 0x45f) {
      r.push_back(c - 80);
    } else {
      r.push_back(c);
    }
  }
  return r;
}

char32_t LowerCp(char32_t c) {
  if (c >= 'A' && c <= 'Z') return c + 32;
  if (c >= 0xc0 && c <= 0xde && c != 0xd7) return c + 32;
  if (c >= 0x391 && c <= 0x3a9 && c != 0x3a2) return c + 32;
  if (c >= 0x410 && c <= 0x42f) return c + 32;
  if (c >= 0x400 && c <= 0x40f) return c + 80;
  return c;
}

std::u32string ToLowerCps(std::u32string_view s) {
  std::u32string r;
  r.reserve(s.size());
  for (char32_t c : s) r.push_back(LowerCp(c));
  return r;
}

std::string Upper(const std::string& s) {
  if (IsAscii(s)) {
    std::string r = s;
    for (char& c : r) {
      if (c >= 'a' && c <= 'z') c = static_cast<char>(c - 32);
    }
    return r;
  }
  return EncodeUtf8(ToUpperCps(DecodeUtf8(s)));
}

std::string Lower(const std::string& s) {
  if (IsAscii(s)) {
    std::string r = s;
    for (char& c : r) {
      if (c >= 'A' && c <= 'Z') c = static_cast<char>(c + 32);
    }
    return r;
  }
  return EncodeUtf8(ToLowerCps(DecodeUtf8(s)));
}

std::string Capitalize(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  if (cps.empty()) return "";
  std::u32string first = ToUpperCps(cps.substr(0, 1));
  if (first == U"SS") first = U"Ss";
  return EncodeUtf8(first + ToLowerCps(std::u32string_view(cps).substr(1)));
}

// str.title(): a cased character after an uncased one is upper-cased, others lower-cased.
std::string PyTitle(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  std::u32string r;
  bool prev_cased = false;
  for (char32_t c : cps) {
    if (IsCased(c)) {
      if (prev_cased) {
        r.push_back(LowerCp(c));
      } else {
        std::u32string u = ToUpperCps(std::u32string(1, c));
        r += u == U"SS" ? U"Ss" : u;
      }
      prev_cased = true;
    } else {
      r.push_back(c);
      prev_cased = false;
    }
  }
  return EncodeUtf8(r);
}

std::string SwapCase(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  std::u32string r;
  for (char32_t c : cps) {
    if (IsUpperCp(c)) {
      r.push_back(LowerCp(c));
    } else if (IsLowerCp(c)) {
      r += ToUpperCps(std::u32string(1, c));
    } else {
      r.push_back(c);
    }
  }
  return EncodeUtf8(r);
}

// Jinja's title filter: words start after [-\s({\[<]+ runs.
std::string JinjaTitle(const std::string& s) {
  std::u32string cps = DecodeUtf8(s);
  std::u32string r;
  auto is_sep = [](char32_t c) {
    return IsPySpace(c) || c == '-' || c == '(' || c == '{' || c == '[' || c == '<';
  };
  bool word_start = true;
  for (char32_t c : cps) {
    if (is_sep(c)) {
      r.push_back(c);
      word_start = true;
    } else if (word_start) {
      std::u32string u = ToUpperCps(std::u32string(1, c));
      r += u;
      word_start = false;
    } else {
      r.push_back(LowerCp(c));
    }
  }
  return EncodeUtf8(r);
}

bool InSet(char32_t c, const std::u32string* chars) {
  if (chars == nullptr) return IsPySpace(c);
  return chars->find(c) != std::u32string::npos;
}

std::string PyStrip(const std::string& s, const Value* chars_arg, bool left, bool right) {
  std::u32string chars;
  const std::u32string* set = nullptr;
  if (chars_arg != nullptr && !chars_arg->is_none()) {
    if (!chars_arg->is_string()) Fail("strip arg must be None or str");
    chars = DecodeUtf8(chars_arg->str);
    set = &chars;
  }
  std::u32string cps = DecodeUtf8(s);
  size_t a = 0, b = cps.size();
  if (left) {
    while (a < b && InSet(cps[a], set)) ++a;
  }
  if (right) {
    while (b > a && InSet(cps[b - 1], set)) --b;
  }
  return EncodeUtf8(std::u32string_view(cps).substr(a, b - a));
}

ValueList PySplit(const std::string& s, const Value* sep, int64_t maxsplit, bool from_right) {
  ValueList out;
  if (sep == nullptr || sep->is_none()) {
    std::u32string cps = DecodeUtf8(s);
    std::vector<std::u32string> parts;
    if (!from_right) {
      size_t i = 0;
      while (true) {
        while (i < cps.size() && IsPySpace(cps[i])) ++i;
        if (i >= cps.size()) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          size_t end = cps.size();
          while (end > i && IsPySpace(cps[end - 1])) --end;
          parts.push_back(cps.substr(i, end - i));
          break;
        }
        size_t j = i;
        while (j < cps.size() && !IsPySpace(cps[j])) ++j;
        parts.push_back(cps.substr(i, j - i));
        i = j;
      }
    } else {
      size_t i = cps.size();
      while (true) {
        while (i > 0 && IsPySpace(cps[i - 1])) --i;
        if (i == 0) break;
        if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) {
          size_t start = 0;
          while (start < i && IsPySpace(cps[start])) ++start;
          parts.push_back(cps.substr(start, i - start));
          break;
        }
        size_t j = i;
        while (j > 0 && !IsPySpace(cps[j - 1])) --j;
        parts.push_back(cps.substr(j, i - j));
        i = j;
      }
      std::reverse(parts.begin(), parts.end());
    }
    for (auto& p : parts) out.push_back(Value::String(EncodeUtf8(p)));
    return out;
  }
  if (!sep->is_string()) Fail("must be str or None, not " + TypeName(*sep));
  const std::string& d = sep->str;
  if (d.empty()) Fail("empty separator");
  std::vector<std::string> parts;
  if (!from_right) {
    size_t start = 0;
    while (true) {
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
      size_t p = s.find(d, start);
      if (p == std::string::npos) break;
      parts.push_back(s.substr(start, p - start));
      start = p + d.size();
    }
    parts.push_back(s.substr(start));
  } else {
    size_t end = s.size();
    while (true) {
      if (maxsplit >= 0 && static_cast<int64_t>(parts.size()) == maxsplit) break;
      if (end < d.size()) break;
      size_t p = s.rfind(d, end - d.size());
      if (p == std::string::npos) break;
      parts.push_back(s.substr(p + d.size(), end - p - d.size()));
      end = p;
    }
    parts.push_back(s.substr(0, end));
    std::reverse(parts.begin(), parts.end());
  }
  for (auto& p : parts) out.push_back(Value::String(std::move(p)));
  return out;
}

bool IsLineBreak(char32_t c) {
  return c == '\n' || c == '\r' || c == 0x0b || c == 0x0c || c == 0x1c || c == 0x1d || c == 0x1e ||
         c == 0x85 || c == 0x2028 || c == 0x2029;
}

std::vector<std::u32string> SplitLines(std::u32string_view cps, bool keepends) {
  std::vector<std::u32string> lines;
  size_t i = 0, start = 0;
  while (i < cps.size()) {
    if (IsLineBreak(cps[i])) {
      size_t eol = i;
      if (cps[i] == '\r' && i + 1 < cps.size() && cps[i + 1] == '\n') ++i;
      ++i;
      lines.emplace_back(cps.substr(start, (keepends ? i : eol) - start));
      start = i;
    } else {
      ++i;
    }
  }
  if (start < cps.size()) lines.emplace_back(cps.substr(start));
  return lines;
}

std::string Replace(Interpreter& in, const std::string& s, const std::string& old,
                    const std::string& repl, int64_t count) {
  if (old.empty()) {
    std::u32string cps = DecodeUtf8(s);
    std::string out;
    int64_t n = 0;
    for (size_t i = 0; i <= cps.size(); ++i) {
      if (count < 0 || n < count) {
        out += repl;
        ++n;
      }
      if (i < cps.size()) AppendUtf8(cps[i], out);
      in.budget().CheckSize(out.size());
    }
    return out;
  }
  // count first so a huge result fails before it is built
  size_t hits = 0;
  for (size_t p = s.find(old);
       p != std::string::npos && (count < 0 || static_cast<int64_t>(hits) < count);
       p = s.find(old, p + old.size())) {
    ++hits;
  }
  if (repl.size() > old.size()) {
    in.budget().CheckSize(s.size() + hits * (repl.size() - old.size()));
  }
  std::string out;
  size_t start = 0;
  for (size_t i = 0; i < hits; ++i) {
    size_t p = s.find(old, start);
    out.append(s, start, p - start);
    out += repl;
    start = p + old.size();
  }
  out.append(s, start, std::string::npos);
  return out;
}

int64_t CountSub(const std::string& s, const std::string& sub) {
  if (sub.empty()) return static_cast<int64_t>(CodePointCount(s)) + 1;
  int64_t n = 0;
  for (size_t p = s.find(sub); p != std::string::npos; p = s.find(sub, p + sub.size())) ++n;
  return n;
}

// byte offset → code point index
int64_t CpIndex(const std::string& s, size_t byte_pos) {
  return static_cast<int64_t>(CodePointCount(std::string_view(s).substr(0, byte_pos)));
}

std::string Pad(Interpreter& in, const std::string& s, int64_t width, char32_t fill, int align) {
  int64_t len = static_cast<int64_t>(CodePointCount(s));
  if (width <= len) return s;
  in.budget().CheckSize(static_cast<size_t>(width) * 4);
  int64_t marg = width - len;
  int64_t left = 0;
  if (align < 0) left = 0;
  if (align > 0) left = marg;
  if (align == 0) left = marg / 2 + (marg & width & 1);
  std::string fill_s;
  AppendUtf8(fill, fill_s);
  std::string out;
  for (int64_t i = 0; i < left; ++i) out += fill_s;
  out += s;
  for (int64_t i = 0; i < marg - left; ++i) out += fill_s;
  return out;
}

// A run of decimal digits as an int; fails (no exception of the standard library) when too big.
int64_t DigitsToInt(const std::string& digits) {
  int64_t v = 0;
  for (char c : digits) {
    if (v > (INT64_MAX - 9) / 10)
      Fail("integer overflow (kvbridge's templates use 64-bit integers)");
    v = v * 10 + (c - '0');
  }
  return v;
}

const Value& Need(const CallArgs& a, size_t i, const char* name, const char* fn) {
  const Value* v = a.Get(i, name);
  if (v == nullptr) {
    Fail(std::string(fn) + "() missing required argument '" + name + "' (pos " +
         std::to_string(i + 1) + ")");
  }
  return *v;
}

int64_t IntArg(const Value* v, int64_t def, const char* what) {
  if (v == nullptr || v->is_none()) return def;
  if (!v->is_integral()) {
    if (v->is_undefined()) Interpreter::FailUndefined(*v);
    Fail(std::string("'") + TypeName(*v) + "' object cannot be interpreted as an integer (" + what +
         ")");
  }
  return v->as_int();
}

const std::string& StrArg(const Value& v, const char* what) {
  if (v.is_undefined()) Interpreter::FailUndefined(v);
  if (!v.is_string()) Fail(std::string(what) + " must be str, not " + TypeName(v));
  return v.str;
}

// str.startswith / endswith with a str or a tuple of str
bool AffixMatch(const std::string& s, const Value& affix, bool prefix) {
  auto one = [&](const Value& a) {
    const std::string& x = StrArg(a, prefix ? "startswith first arg" : "endswith first arg");
    if (x.size() > s.size()) return false;
    return prefix ? s.compare(0, x.size(), x) == 0
                  : s.compare(s.size() - x.size(), x.size(), x) == 0;
  };
  if (affix.kind == Kind::kTuple) {
    for (const Value& a : *affix.list) {
      if (one(a)) return true;
    }
    return false;
  }
  return one(affix);
}

std::string StrFormat(Interpreter& in, const std::string& fmt, const CallArgs& a);

Value StrMethod(Interpreter& in, const std::string& self, const std::string& name,
                const CallArgs& a) {
  auto str = [](std::string s) { return Value::String(std::move(s)); };
  if (name == "startswith" || name == "endswith") {
    return Value::Bool(AffixMatch(self, Need(a, 0, "prefix", name.c_str()), name == "startswith"));
  }
  if (name == "strip") return str(PyStrip(self, a.Get(0, "chars"), true, true));
  if (name == "lstrip") return str(PyStrip(self, a.Get(0, "chars"), true, false));
  if (name == "rstrip") return str(PyStrip(self, a.Get(0, "chars"), false, true));
  if (name == "split" || name == "rsplit") {
    return Value::List(PySplit(self, a.Get(0, "sep"), IntArg(a.Get(1, "maxsplit"), -1, "maxsplit"),
                               name == "rsplit"));
  }
  if (name == "splitlines") {
    const Value* k = a.Get(0, "keepends");
    ValueList out;
    for (auto& l : SplitLines(DecodeUtf8(self), k != nullptr && Truthy(*k))) {
      out.push_back(Value::String(EncodeUtf8(l)));
    }
    return Value::List(std::move(out));
  }
  if (name == "replace") {
    return str(Replace(in, self, StrArg(Need(a, 0, "old", "replace"), "replace() argument 1"),
                       StrArg(Need(a, 1, "new", "replace"), "replace() argument 2"),
                       IntArg(a.Get(2, "count"), -1, "count")));
  }
  if (name == "upper") return str(Upper(self));
  if (name == "lower" || name == "casefold") return str(Lower(self));
  if (name == "title") return str(PyTitle(self));
  if (name == "capitalize") return str(Capitalize(self));
  if (name == "swapcase") return str(SwapCase(self));
  if (name == "find" || name == "rfind" || name == "index" || name == "rindex") {
    const std::string& sub = StrArg(Need(a, 0, "sub", name.c_str()), "must be str");
    size_t p = (name == "find" || name == "index") ? self.find(sub) : self.rfind(sub);
    if (p == std::string::npos) {
      if (name == "index" || name == "rindex") Fail("substring not found");
      return Value::Int(-1);
    }
    return Value::Int(CpIndex(self, p));
  }
  if (name == "count")
    return Value::Int(CountSub(self, StrArg(Need(a, 0, "sub", "count"), "must be str")));
  if (name == "join") {
    ValueList items = in.Iterate(Need(a, 0, "iterable", "join"));
    std::string out;
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += self;
      if (!items[i].is_string()) {
        Fail("sequence item " + std::to_string(i) + ": expected str instance, " +
             TypeName(items[i]) + " found");
      }
      out += items[i].str;
      in.budget().CheckSize(out.size());
    }
    return str(std::move(out));
  }
  if (name == "format") return str(StrFormat(in, self, a));
  std::u32string cps;
  auto all = [&](auto pred) {
    cps = DecodeUtf8(self);
    if (cps.empty()) return Value::Bool(false);
    return Value::Bool(std::all_of(cps.begin(), cps.end(), pred));
  };
  if (name == "isdigit" || name == "isdecimal" || name == "isnumeric") return all(IsDigitCp);
  if (name == "isalpha") return all(IsAlphaCp);
  if (name == "isalnum") return all([](char32_t c) { return IsAlphaCp(c) || IsDigitCp(c); });
  if (name == "isspace") return all(IsPySpace);
  if (name == "isupper" || name == "islower") {
    cps = DecodeUtf8(self);
    bool any_cased = false, ok = true;
    for (char32_t c : cps) {
      if (!IsCased(c)) continue;
      any_cased = true;
      if (name == "isupper" ? IsLowerCp(c) : IsUpperCp(c)) ok = false;
    }
    return Value::Bool(any_cased && ok);
  }
  if (name == "center" || name == "ljust" || name == "rjust") {
    int64_t width = IntArg(&Need(a, 0, "width", name.c_str()), 0, "width");
    char32_t fill = ' ';
    if (const Value* f = a.Get(1, "fillchar")) {
      std::u32string fc = DecodeUtf8(StrArg(*f, "fillchar"));
      if (fc.size() != 1) Fail("The fill character must be exactly one character long");
      fill = fc[0];
    }
    return str(Pad(in, self, width, fill, name == "center" ? 0 : name == "ljust" ? -1 : 1));
  }
  if (name == "zfill") {
    int64_t width = IntArg(&Need(a, 0, "width", "zfill"), 0, "width");
    int64_t len = static_cast<int64_t>(CodePointCount(self));
    if (width <= len) return str(self);
    in.budget().CheckSize(static_cast<size_t>(width));
    std::string sign;
    std::string rest = self;
    if (!rest.empty() && (rest[0] == '+' || rest[0] == '-')) {
      sign = rest.substr(0, 1);
      rest = rest.substr(1);
    }
    return str(sign + std::string(static_cast<size_t>(width - len), '0') + rest);
  }
  if (name == "removeprefix" || name == "removesuffix") {
    const std::string& x = StrArg(Need(a, 0, "prefix", name.c_str()), "must be str");
    if (name == "removeprefix" && self.compare(0, x.size(), x) == 0 && x.size() <= self.size()) {
      return str(self.substr(x.size()));
    }
    if (name == "removesuffix" && x.size() <= self.size() &&
        self.compare(self.size() - x.size(), x.size(), x) == 0 && !x.empty()) {
      return str(self.substr(0, self.size() - x.size()));
    }
    return str(self);
  }
  if (name == "partition" || name == "rpartition") {
    const std::string& sep = StrArg(Need(a, 0, "sep", name.c_str()), "must be str");
    if (sep.empty()) Fail("empty separator");
    size_t p = name == "partition" ? self.find(sep) : self.rfind(sep);
    if (p == std::string::npos) {
      if (name == "partition") return Value::List({str(self), str(""), str("")}, Kind::kTuple);
      return Value::List({str(""), str(""), str(self)}, Kind::kTuple);
    }
    return Value::List({str(self.substr(0, p)), str(sep), str(self.substr(p + sep.size()))},
                       Kind::kTuple);
  }
  Fail("'str' object has no attribute '" + name + "'");
}

constexpr const char* kStrMethods[] = {
    "startswith",   "endswith",  "strip",     "lstrip",    "rstrip",   "split",   "rsplit",
    "splitlines",   "replace",   "upper",     "lower",     "casefold", "title",   "capitalize",
    "swapcase",     "find",      "rfind",     "index",     "rindex",   "count",   "join",
    "format",       "isdigit",   "isdecimal", "isnumeric", "isalpha",  "isalnum", "isspace",
    "isupper",      "islower",   "center",    "ljust",     "rjust",    "zfill",   "removeprefix",
    "removesuffix", "partition", "rpartition"};

bool IsOneOf(const std::string& name, std::initializer_list<const char*> names) {
  for (const char* n : names) {
    if (name == n) return true;
  }
  return false;
}

Value UnsafeMethod(const std::string& name, const Value& obj) {
  std::string type = TypeName(obj);
  return MakeFn(name, [name, type](Interpreter&, const CallArgs&) -> Value {
    Fail("access to attribute '" + name + "' of '" + type + "' object is unsafe.");
  });
}

// ---------------- str.format and % ----------------

std::string StrFormat(Interpreter& in, const std::string& fmt, const CallArgs& a) {
  std::string out;
  size_t auto_index = 0;
  for (size_t i = 0; i < fmt.size(); ++i) {
    char c = fmt[i];
    if (c == '}') {
      if (i + 1 < fmt.size() && fmt[i + 1] == '}') {
        out.push_back('}');
        ++i;
        continue;
      }
      Fail("Single '}' encountered in format string");
    }
    if (c != '{') {
      out.push_back(c);
      continue;
    }
    if (i + 1 < fmt.size() && fmt[i + 1] == '{') {
      out.push_back('{');
      ++i;
      continue;
    }
    size_t end = fmt.find('}', i);
    if (end == std::string::npos) Fail("Single '{' encountered in format string");
    std::string field = fmt.substr(i + 1, end - i - 1);
    i = end;
    char conversion = 0;
    size_t bang = field.find('!');
    size_t colon = field.find(':');
    if (colon != std::string::npos && colon + 1 < field.size()) {
      Fail("format specs in str.format are not supported in chat templates");
    }
    if (colon != std::string::npos) field = field.substr(0, colon);
    if (bang != std::string::npos && bang < field.size()) {
      conversion = bang + 1 < field.size() ? field[bang + 1] : 0;
      field = field.substr(0, bang);
    }
    size_t head_end = field.find_first_of(".[");
    std::string head = field.substr(0, head_end);
    Value v;
    if (head.empty()) {
      if (auto_index >= a.args.size())
        Fail("Replacement index " + std::to_string(auto_index) +
             " out of range for positional args tuple");
      v = a.args[auto_index++];
    } else if (std::all_of(head.begin(), head.end(),
                           [](char ch) { return ch >= '0' && ch <= '9'; })) {
      size_t idx = static_cast<size_t>(DigitsToInt(head));
      if (idx >= a.args.size())
        Fail("Replacement index " + head + " out of range for positional args tuple");
      v = a.args[idx];
    } else {
      const Value* kv = nullptr;
      for (const auto& [k, val] : a.kwargs) {
        if (k == head) kv = &val;
      }
      if (kv == nullptr) Fail("'" + head + "'");
      v = *kv;
    }
    size_t p = head_end;
    while (p != std::string::npos && p < field.size()) {
      if (field[p] == '.') {
        size_t q = field.find_first_of(".[", p + 1);
        v = in.GetAttr(v,
                       field.substr(p + 1, q == std::string::npos ? std::string::npos : q - p - 1));
        p = q;
      } else {
        size_t q = field.find(']', p);
        if (q == std::string::npos) Fail("Missing ']' in format string");
        std::string key = field.substr(p + 1, q - p - 1);
        bool digits = !key.empty() && std::all_of(key.begin(), key.end(),
                                                  [](char ch) { return ch >= '0' && ch <= '9'; });
        v = in.GetItem(v, digits ? Value::Int(DigitsToInt(key)) : Value::String(key));
        p = q + 1;
      }
    }
    out += conversion == 'r' ? Repr(v, in.budget()) : in.Str(v);
    in.budget().CheckSize(out.size());
  }
  return out;
}

}  // namespace

std::string PercentFormat(Interpreter& in, const std::string& format, const Value& args) {
  ValueList positional;
  const Value* mapping = nullptr;
  if (args.kind == Kind::kTuple) {
    positional = *args.list;
  } else {
    positional.push_back(args);
    if (args.kind == Kind::kDict) mapping = &args;
  }
  size_t next = 0;
  bool used_mapping = false;
  std::string out;
  auto take = [&]() -> Value {
    if (next >= positional.size()) Fail("not enough arguments for format string");
    return positional[next++];
  };
  for (size_t i = 0; i < format.size(); ++i) {
    if (format[i] != '%') {
      out.push_back(format[i]);
      continue;
    }
    if (++i >= format.size()) Fail("incomplete format");
    Value v;
    bool have_value = false;
    if (format[i] == '(') {
      size_t close = format.find(')', i);
      if (close == std::string::npos) Fail("incomplete format key");
      if (mapping == nullptr) Fail("format requires a mapping");
      const Value* found = DictFind(*mapping->dict, format.substr(i + 1, close - i - 1));
      if (found == nullptr) Fail("'" + format.substr(i + 1, close - i - 1) + "'");
      v = *found;
      have_value = true;
      used_mapping = true;
      i = close + 1;
    }
    std::string flags;
    while (i < format.size() && std::strchr("-+ #0", format[i]) != nullptr)
      flags.push_back(format[i++]);
    std::string width, precision;
    bool has_precision = false;
    if (i < format.size() && format[i] == '*') {
      Value w = take();
      width = std::to_string(IntArg(&w, 0, "*"));
      ++i;
    }
    while (i < format.size() && std::isdigit(static_cast<unsigned char>(format[i])))
      width.push_back(format[i++]);
    if (i < format.size() && format[i] == '.') {
      has_precision = true;
      ++i;
      while (i < format.size() && std::isdigit(static_cast<unsigned char>(format[i])))
        precision.push_back(format[i++]);
    }
    if (i >= format.size()) Fail("incomplete format");
    char type = format[i];
    if (type == '%') {
      out.push_back('%');
      continue;
    }
    if (!have_value) v = take();
    if (width.size() > 6 || precision.size() > 6) Fail("width or precision too large");
    std::string spec = "%" + flags + width + (has_precision ? "." + precision : "");
    char buf[512];
    std::string piece;
    if (type == 's' || type == 'r' || type == 'a') {
      std::string s = type == 's' ? in.Str(v) : Repr(v, in.budget());
      if (has_precision) {
        std::u32string cps = DecodeUtf8(s);
        size_t prec = precision.empty() ? 0 : std::stoul(precision);
        if (cps.size() > prec) s = EncodeUtf8(std::u32string_view(cps).substr(0, prec));
      }
      int64_t w = width.empty() ? 0 : std::stoll(width);
      piece = Pad(in, s, w, ' ', flags.find('-') != std::string::npos ? -1 : 1);
    } else if (std::strchr("diouxXc", type) != nullptr) {
      if (!v.is_number())
        Fail(std::string("%") + type + " format: a real number is required, not " + TypeName(v));
      long long iv = v.kind == Kind::kFloat ? static_cast<long long>(v.number) : v.as_int();
      if (type == 'c') {
        AppendUtf8(static_cast<char32_t>(iv), piece);
      } else {
        char t = type == 'i' || type == 'u' ? 'd' : type;
        std::snprintf(buf, sizeof(buf), (spec + "ll" + t).c_str(), iv);
        piece = buf;
      }
    } else if (std::strchr("eEfFgG", type) != nullptr) {
      if (!v.is_number()) Fail(std::string("must be real number, not ") + TypeName(v));
      std::snprintf(buf, sizeof(buf), (spec + type).c_str(), v.as_double());
      piece = buf;
    } else {
      Fail(std::string("unsupported format character '") + type + "'");
    }
    out += piece;
    in.budget().CheckSize(out.size());
  }
  if (!used_mapping && mapping == nullptr && next < positional.size()) {
    Fail("not all arguments converted during string formatting");
  }
  return out;
}

Value AttributeOf(Interpreter& in, const Value& obj, const std::string& name) {
  if (!name.empty() && name[0] == '_') return Value::Undefined();
  switch (obj.kind) {
    case Kind::kString: {
      for (const char* m : kStrMethods) {
        if (name == m) {
          std::string self = obj.str;
          return MakeFn(name, [self, name](Interpreter& i, const CallArgs& a) {
            return StrMethod(i, self, name, a);
          });
        }
      }
      return Value::Undefined();
    }
    case Kind::kDict: {
      if (IsOneOf(name, {"pop", "popitem", "setdefault", "update", "clear"})) {
        return UnsafeMethod(name, obj);
      }
      if (!IsOneOf(name, {"items", "keys", "values", "get", "copy"})) return Value::Undefined();
      Value self = obj;
      return MakeFn(name, [self, name](Interpreter& i, const CallArgs& a) -> Value {
        const ValueDict& d = *self.dict;
        if (name == "get") {
          const Value& key = Need(a, 0, "key", "get");
          if (const Value* v = DictFind(d, key, i.budget())) return *v;
          const Value* def = a.Get(1, "default");
          return def ? *def : Value::None();
        }
        if (name == "copy") return Value::Dict(d);
        ValueList out;
        for (const auto& [k, v] : d) {
          if (name == "items") {
            out.push_back(Value::List({k, v}, Kind::kTuple));
          } else {
            out.push_back(name == "keys" ? k : v);
          }
        }
        return Value::List(std::move(out));
      });
    }
    case Kind::kList:
    case Kind::kTuple: {
      if (obj.kind == Kind::kList && IsOneOf(name, {"append", "extend", "insert", "pop", "remove",
                                                    "reverse", "sort", "clear"})) {
        return UnsafeMethod(name, obj);
      }
      if (!IsOneOf(name, {"index", "count", "copy"})) return Value::Undefined();
      if (name == "copy" && obj.kind == Kind::kTuple) return Value::Undefined();
      Value self = obj;
      return MakeFn(name, [self, name](Interpreter& i, const CallArgs& a) -> Value {
        if (name == "copy") return Value::List(*self.list);
        const Value& x = Need(a, 0, "value", name.c_str());
        int64_t n = 0;
        for (size_t k = 0; k < self.list->size(); ++k) {
          if (Equal((*self.list)[k], x, i.budget())) {
            if (name == "index") return Value::Int(static_cast<int64_t>(k));
            ++n;
          }
        }
        if (name == "index") Fail(Repr(x, i.budget()) + " is not in list");
        return Value::Int(n);
      });
    }
    case Kind::kObject: {
      if (const Value* v = DictFind(*obj.dict, name)) return *v;
      return Value::Undefined();
    }
    default:
      return Value::Undefined();
  }
}

bool Contains(Interpreter& in, const Value& container, const Value& item) {
  switch (container.kind) {
    case Kind::kString:
      if (!item.is_string()) {
        if (item.is_undefined()) Interpreter::FailUndefined(item);
        Fail("'in <string>' requires string as left operand, not " + TypeName(item));
      }
      return container.str.find(item.str) != std::string::npos;
    case Kind::kList:
    case Kind::kTuple:
      for (const Value& v : *container.list) {
        if (Equal(v, item, in.budget())) return true;
      }
      return false;
    case Kind::kDict:
      if (item.kind == Kind::kList || item.kind == Kind::kDict)
        Fail("unhashable type: '" + TypeName(item) + "'");
      return DictFind(*container.dict, item, in.budget()) != nullptr;
    case Kind::kUndefined:
      return false;
    default:
      Fail("argument of type '" + TypeName(container) + "' is not iterable");
  }
}

namespace {

// dict(...) / namespace(...): a mapping or pairs, then keywords.
ValueDict DictFromArgs(Interpreter& in, const CallArgs& a) {
  ValueDict d;
  auto put = [&](const Value& k, const Value& v) {
    for (auto& [ek, ev] : d) {
      if (Equal(ek, k, in.budget())) {
        ev = v;
        return;
      }
    }
    d.emplace_back(k, v);
  };
  if (!a.args.empty()) {
    const Value& src = a.args[0];
    if (src.kind == Kind::kDict) {
      for (const auto& [k, v] : *src.dict) put(k, v);
    } else {
      for (const Value& pair : in.Iterate(src)) {
        ValueList kv = in.Iterate(pair);
        if (kv.size() != 2)
          Fail("dictionary update sequence element has length " + std::to_string(kv.size()) +
               "; 2 is required");
        put(kv[0], kv[1]);
      }
    }
  }
  for (const auto& [k, v] : a.kwargs) put(Value::String(k), v);
  return d;
}

}  // namespace

std::vector<std::pair<std::string, Value>> MakeGlobals() {
  std::vector<std::pair<std::string, Value>> g;
  g.emplace_back(
      "range", MakeFn("range", [](Interpreter& in, const CallArgs& a) -> Value {
        if (a.args.empty() || a.args.size() > 3) Fail("range expected 1 to 3 arguments");
        int64_t start = 0, stop, step = 1;
        if (a.args.size() == 1) {
          stop = IntArg(&a.args[0], 0, "range");
        } else {
          start = IntArg(&a.args[0], 0, "range");
          stop = IntArg(&a.args[1], 0, "range");
          if (a.args.size() == 3) step = IntArg(&a.args[2], 1, "range");
        }
        if (step == 0) Fail("range() arg 3 must not be zero");
        long double count = step > 0 ? std::ceil(static_cast<long double>(stop - start) / step)
                                     : std::ceil(static_cast<long double>(start - stop) / -step);
        if (count > 100000) {
          Fail("Range too big. The sandbox blocks ranges larger than MAX_RANGE (100000).");
        }
        ValueList out;
        for (int64_t i = start; step > 0 ? i < stop : i > stop; i += step) {
          in.budget().Step();
          out.push_back(Value::Int(i));
        }
        return Value::List(std::move(out));
      }));
  g.emplace_back("dict", MakeFn("dict", [](Interpreter& in, const CallArgs& a) {
                   return Value::Dict(DictFromArgs(in, a));
                 }));
  g.emplace_back("namespace", MakeFn("namespace", [](Interpreter& in, const CallArgs& a) {
                   Value ns = Value::Object("Namespace", DictFromArgs(in, a));
                   in.Track(ns.dict);
                   return ns;
                 }));
  g.emplace_back("raise_exception",
                 MakeFn("raise_exception", [](Interpreter& in, const CallArgs& a) -> Value {
                   const Value* m = a.Get(0, "message");
                   throw Error{m ? in.Str(*m) : std::string(), 0, true};
                 }));
  g.emplace_back("strftime_now",
                 MakeFn("strftime_now", [](Interpreter& in, const CallArgs& a) -> Value {
                   return Value::String(
                       in.StrftimeNow(StrArg(Need(a, 0, "format", "strftime_now"), "format")));
                 }));
  return g;
}

std::string Interpreter::StrftimeNow(const std::string& format) const {
  std::tm tm{};
  if (limits_.now.has_value()) {
    tm = *limits_.now;
  } else {
    std::time_t t = std::time(nullptr);
    localtime_r(&t, &tm);
  }
  if (format.empty()) return "";
  std::string buf(format.size() * 8 + 64, '\0');
  size_t n = std::strftime(buf.data(), buf.size(), format.c_str(), &tm);
  if (n == 0) Fail("strftime_now: the formatted time is too long");
  buf.resize(n);
  return buf;
}

namespace {

// Jinja's make_attrgetter: "a.b.0" → getitem per part (digits become ints).
Value GetPath(Interpreter& in, const Value& item, const std::string& path) {
  Value v = item;
  size_t start = 0;
  while (true) {
    size_t dot = path.find('.', start);
    std::string part =
        path.substr(start, dot == std::string::npos ? std::string::npos : dot - start);
    bool digits = !part.empty() && std::all_of(part.begin(), part.end(),
                                               [](char c) { return c >= '0' && c <= '9'; });
    v = in.GetItem(v, digits ? Value::Int(DigitsToInt(part)) : Value::String(part));
    if (dot == std::string::npos) return v;
    start = dot + 1;
  }
}

Value IgnoreCase(const Value& v) {
  if (v.is_string()) return Value::String(Lower(v.str));
  return v;
}

// Key of an item for sort / unique / min / max / dictsort.
Value SortKey(Interpreter& in, const Value& item, const Value* attribute, bool case_sensitive) {
  if (attribute == nullptr || attribute->is_none()) return case_sensitive ? item : IgnoreCase(item);
  if (attribute->is_string() && attribute->str.find(',') != std::string::npos) {
    ValueList parts;
    std::string attrs = attribute->str;
    size_t start = 0;
    while (true) {
      size_t c = attrs.find(',', start);
      Value k = GetPath(
          in, item, attrs.substr(start, c == std::string::npos ? std::string::npos : c - start));
      parts.push_back(case_sensitive ? k : IgnoreCase(k));
      if (c == std::string::npos) break;
      start = c + 1;
    }
    return Value::List(std::move(parts));
  }
  Value k = attribute->is_integral() ? in.GetItem(item, *attribute)
                                     : GetPath(in, item, in.Str(*attribute));
  return case_sensitive ? k : IgnoreCase(k);
}

bool ArgTruthy(const CallArgs& a, size_t i, const char* name, bool def) {
  const Value* v = a.Get(i, name);
  return v ? Truthy(*v) : def;
}

std::string HtmlEscape(const std::string& s) {
  std::string out;
  for (char c : s) {
    switch (c) {
      case '&':
        out += "&amp;";
        break;
      case '<':
        out += "&lt;";
        break;
      case '>':
        out += "&gt;";
        break;
      case '"':
        out += "&#34;";
        break;
      case '\'':
        out += "&#39;";
        break;
      default:
        out.push_back(c);
    }
  }
  return out;
}

// Python int(str) / float(str) for the int and float filters.
std::optional<int64_t> ParseIntText(const std::string& text, int base) {
  std::string t = PyStrip(text, nullptr, true, true);
  std::string digits;
  size_t i = 0;
  bool neg = false;
  if (i < t.size() && (t[i] == '+' || t[i] == '-')) neg = t[i++] == '-';
  if (base == 16 && t.compare(i, 2, "0x") == 0) i += 2;
  if (base == 8 && t.compare(i, 2, "0o") == 0) i += 2;
  if (base == 2 && t.compare(i, 2, "0b") == 0) i += 2;
  bool last_us = true;
  for (; i < t.size(); ++i) {
    if (t[i] == '_') {
      if (last_us) return std::nullopt;
      last_us = true;
      continue;
    }
    last_us = false;
    digits.push_back(t[i]);
  }
  if (digits.empty() || last_us) return std::nullopt;
  char* end = nullptr;
  errno = 0;
  long long v = std::strtoll(digits.c_str(), &end, base);
  if (*end != '\0' || errno == ERANGE) return std::nullopt;
  if (digits[0] == '+' || digits[0] == '-') return std::nullopt;
  return neg ? -v : v;
}

std::optional<double> ParseFloatText(const std::string& text) {
  std::string t = PyStrip(text, nullptr, true, true);
  if (t.empty()) return std::nullopt;
  std::string low = Lower(t);
  std::string body = (low[0] == '+' || low[0] == '-') ? low.substr(1) : low;
  double sign = (low[0] == '-') ? -1.0 : 1.0;
  if (body == "inf" || body == "infinity") return sign * HUGE_VAL;
  if (body == "nan") return std::nan("");
  std::string clean;
  for (size_t i = 0; i < t.size(); ++i) {
    if (t[i] == '_') {
      if (i == 0 || i + 1 >= t.size() || !std::isdigit(static_cast<unsigned char>(t[i - 1])) ||
          !std::isdigit(static_cast<unsigned char>(t[i + 1]))) {
        return std::nullopt;
      }
      continue;
    }
    if (!std::isdigit(static_cast<unsigned char>(t[i])) && std::strchr("+-.eE", t[i]) == nullptr)
      return std::nullopt;
    clean.push_back(t[i]);
  }
  if (body.find_first_of("0123456789") == std::string::npos) return std::nullopt;
  char* end = nullptr;
  double v = std::strtod(clean.c_str(), &end);
  if (*end != '\0') return std::nullopt;
  return v;
}

// Python round(x, ndigits) for floats: correctly rounded, ties to even (as glibc's printf).
double PyRound(double x, int64_t ndigits) {
  if (!std::isfinite(x)) return x;
  if (ndigits > 300) return x;
  if (ndigits < -300) return 0.0 * x;
  if (ndigits >= 0) {
    char buf[512];
    std::snprintf(buf, sizeof(buf), "%.*f", static_cast<int>(ndigits), x);
    return std::strtod(buf, nullptr);
  }
  double p = std::pow(10.0, static_cast<double>(-ndigits));
  double y = x / p;
  double r = std::nearbyint(y);  // default rounding mode: ties to even
  return r * p;
}

}  // namespace

Value Interpreter::ApplyFilter(const std::string& name, const Value& v, const CallArgs& a) {
  budget_.Step();
  auto str = [](std::string s) { return Value::String(std::move(s)); };
  if (name == "default" || name == "d") {
    const Value* def = a.Get(0, "default_value");
    bool boolean = ArgTruthy(a, 1, "boolean", false);
    if (v.is_undefined() || (boolean && !Truthy(v))) return def ? *def : str("");
    return v;
  }
  if (name == "trim") return str(PyStrip(Str(v), a.Get(0, "chars"), true, true));
  if (name == "upper") return str(Upper(Str(v)));
  if (name == "lower") return str(Lower(Str(v)));
  if (name == "capitalize") return str(Capitalize(Str(v)));
  if (name == "title") return str(JinjaTitle(Str(v)));
  if (name == "string") return str(Str(v));
  if (name == "safe") return str(Str(v));
  if (name == "e" || name == "escape" || name == "forceescape") return str(HtmlEscape(Str(v)));
  if (name == "replace") {
    const Value& old = Need(a, 0, "old", "replace");
    const Value& repl = Need(a, 1, "new", "replace");
    return str(Replace(*this, Str(v), Str(old), Str(repl), IntArg(a.Get(2, "count"), -1, "count")));
  }
  if (name == "length" || name == "count") {
    switch (v.kind) {
      case Kind::kUndefined:
        return Value::Int(0);
      case Kind::kString:
        return Value::Int(static_cast<int64_t>(CodePointCount(v.str)));
      case Kind::kList:
      case Kind::kTuple:
        return Value::Int(static_cast<int64_t>(v.list->size()));
      case Kind::kDict:
        return Value::Int(static_cast<int64_t>(v.dict->size()));
      default:
        Fail("object of type '" + TypeName(v) + "' has no len()");
    }
  }
  if (name == "list") return Value::List(Iterate(v));
  if (name == "first" || name == "last") {
    ValueList items = Iterate(v);
    if (items.empty()) {
      return Value::Undefined(std::string("No ") + name + " item, sequence was empty.");
    }
    return name == "first" ? items.front() : items.back();
  }
  if (name == "items") {
    if (v.is_undefined()) return Value::List({});
    if (v.kind != Kind::kDict) Fail("Can only get item pairs from a mapping.");
    ValueList out;
    for (const auto& [k, val] : *v.dict) out.push_back(Value::List({k, val}, Kind::kTuple));
    return Value::List(std::move(out));
  }
  if (name == "join") {
    const Value* d = a.Get(0, "d");
    const Value* attribute = a.Get(1, "attribute");
    std::string sep = d ? Str(*d) : "";
    std::string out;
    ValueList items = Iterate(v);
    for (size_t i = 0; i < items.size(); ++i) {
      if (i) out += sep;
      const Value item =
          attribute && !attribute->is_none() ? GetPath(*this, items[i], Str(*attribute)) : items[i];
      out += Str(item);
      budget_.CheckSize(out.size());
    }
    return str(std::move(out));
  }
  if (name == "tojson") {
    JsonOptions o;
    o.ensure_ascii = ArgTruthy(a, 0, "ensure_ascii", false);
    const Value* indent = a.Get(1, "indent");
    if (indent != nullptr && !indent->is_none()) {
      o.has_indent = true;
      if (indent->is_string()) {
        o.indent = indent->str;
      } else {
        int64_t n = IntArg(indent, 0, "indent");
        if (n > 1024) Fail("tojson indent too large");
        o.indent = std::string(static_cast<size_t>(std::max<int64_t>(n, 0)), ' ');
      }
      o.item_separator = ",";
    }
    const Value* seps = a.Get(2, "separators");
    if (seps != nullptr && !seps->is_none()) {
      ValueList s = Iterate(*seps);
      if (s.size() != 2 || !s[0].is_string() || !s[1].is_string())
        Fail("separators must be a pair of strings");
      o.item_separator = s[0].str;
      o.key_separator = s[1].str;
    }
    o.sort_keys = ArgTruthy(a, 3, "sort_keys", false);
    return str(ToJson(v, o, budget_));
  }
  if (name == "int") {
    const Value* def = a.Get(0, "default");
    int64_t base = IntArg(a.Get(1, "base"), 10, "base");
    Value fallback = def ? *def : Value::Int(0);
    if (v.is_undefined()) FailUndefined(v);
    if (v.is_integral()) return Value::Int(v.as_int());
    if (v.kind == Kind::kFloat) {
      if (!std::isfinite(v.number)) Fail("cannot convert float infinity or NaN to integer");
      if (std::fabs(v.number) >= 9.2e18)
        Fail("integer overflow (kvbridge's templates use 64-bit integers)");
      return Value::Int(static_cast<int64_t>(v.number));
    }
    if (v.is_string()) {
      if (base < 2 || base > 36) Fail("int() base must be >= 2 and <= 36, or 0");
      if (auto i = ParseIntText(v.str, static_cast<int>(base))) return Value::Int(*i);
      if (auto f = ParseFloatText(v.str)) {
        // int(float(text)); inf and nan give the default (Jinja catches OverflowError there)
        if (std::isfinite(*f) && std::fabs(*f) < 9.2e18)
          return Value::Int(static_cast<int64_t>(*f));
        if (std::isfinite(*f)) Fail("integer overflow (kvbridge's templates use 64-bit integers)");
      }
    }
    return fallback;
  }
  if (name == "float") {
    const Value* def = a.Get(0, "default");
    if (v.is_undefined()) FailUndefined(v);
    if (v.is_number()) return Value::Float(v.as_double());
    if (v.is_string()) {
      if (auto f = ParseFloatText(v.str)) return Value::Float(*f);
    }
    return def ? *def : Value::Float(0.0);
  }
  if (name == "abs") {
    if (v.is_integral()) {
      if (v.as_int() == INT64_MIN)
        Fail("integer overflow (kvbridge's templates use 64-bit integers)");
      return Value::Int(std::llabs(v.as_int()));
    }
    if (v.kind == Kind::kFloat) return Value::Float(std::fabs(v.number));
    if (v.is_undefined()) FailUndefined(v);
    Fail("bad operand type for abs(): '" + TypeName(v) + "'");
  }
  if (name == "round") {
    int64_t precision = IntArg(a.Get(0, "precision"), 0, "precision");
    const Value* method = a.Get(1, "method");
    std::string m = method ? Str(*method) : "common";
    if (m != "common" && m != "ceil" && m != "floor") Fail("method must be common, ceil or floor");
    if (v.is_undefined()) FailUndefined(v);
    if (!v.is_number()) Fail("type " + TypeName(v) + " doesn't define __round__ method");
    if (m == "common") {
      if (v.is_integral()) {
        if (precision >= 0) return Value::Int(v.as_int());
        return Value::Int(
            static_cast<int64_t>(PyRound(static_cast<double>(v.as_int()), precision)));
      }
      return Value::Float(PyRound(v.number, precision));
    }
    double p = std::pow(10.0, static_cast<double>(precision));
    double x = v.as_double() * p;
    return Value::Float((m == "ceil" ? std::ceil(x) : std::floor(x)) / p);
  }
  if (name == "reverse") {
    if (v.is_string()) {
      std::u32string cps = DecodeUtf8(v.str);
      std::reverse(cps.begin(), cps.end());
      return str(EncodeUtf8(cps));
    }
    ValueList items = Iterate(v);
    std::reverse(items.begin(), items.end());
    return Value::List(std::move(items));
  }
  if (name == "sort") {
    bool reverse = ArgTruthy(a, 0, "reverse", false);
    bool case_sensitive = ArgTruthy(a, 1, "case_sensitive", false);
    const Value* attribute = a.Get(2, "attribute");
    ValueList items = Iterate(v);
    std::vector<std::pair<Value, size_t>> keyed;
    for (size_t i = 0; i < items.size(); ++i)
      keyed.emplace_back(SortKey(*this, items[i], attribute, case_sensitive), i);
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
      return reverse ? Less(y.first, x.first, budget_) : Less(x.first, y.first, budget_);
    });
    ValueList out;
    for (auto& [k, i] : keyed) out.push_back(items[i]);
    return Value::List(std::move(out));
  }
  if (name == "dictsort") {
    bool case_sensitive = ArgTruthy(a, 0, "case_sensitive", false);
    const Value* by = a.Get(1, "by");
    bool reverse = ArgTruthy(a, 2, "reverse", false);
    std::string by_s = by ? Str(*by) : "key";
    if (by_s != "key" && by_s != "value") Fail("You can only sort by either \"key\" or \"value\"");
    if (v.is_undefined()) FailUndefined(v);
    if (v.kind != Kind::kDict) Fail("'" + TypeName(v) + "' object has no attribute 'items'");
    std::vector<std::pair<Value, size_t>> keyed;
    const ValueDict& d = *v.dict;
    for (size_t i = 0; i < d.size(); ++i) {
      const Value& k = by_s == "key" ? d[i].first : d[i].second;
      keyed.emplace_back(case_sensitive ? k : IgnoreCase(k), i);
    }
    std::stable_sort(keyed.begin(), keyed.end(), [&](const auto& x, const auto& y) {
      return reverse ? Less(y.first, x.first, budget_) : Less(x.first, y.first, budget_);
    });
    ValueList out;
    for (auto& [k, i] : keyed) out.push_back(Value::List({d[i].first, d[i].second}, Kind::kTuple));
    return Value::List(std::move(out));
  }
  if (name == "unique") {
    bool case_sensitive = ArgTruthy(a, 0, "case_sensitive", false);
    const Value* attribute = a.Get(1, "attribute");
    ValueList out, seen;
    for (const Value& item : Iterate(v)) {
      Value k = SortKey(*this, item, attribute, case_sensitive);
      bool dup = false;
      for (const Value& s : seen) {
        if (Equal(s, k, budget_)) {
          dup = true;
          break;
        }
      }
      if (!dup) {
        seen.push_back(k);
        out.push_back(item);
      }
    }
    return Value::List(std::move(out));
  }
  if (name == "min" || name == "max") {
    bool case_sensitive = ArgTruthy(a, 0, "case_sensitive", false);
    const Value* attribute = a.Get(1, "attribute");
    ValueList items = Iterate(v);
    if (items.empty()) return Value::Undefined("No aggregated item, sequence was empty.");
    size_t best = 0;
    Value best_key = SortKey(*this, items[0], attribute, case_sensitive);
    for (size_t i = 1; i < items.size(); ++i) {
      Value k = SortKey(*this, items[i], attribute, case_sensitive);
      if (name == "min" ? Less(k, best_key, budget_) : Less(best_key, k, budget_)) {
        best = i;
        best_key = k;
      }
    }
    return items[best];
  }
  if (name == "sum") {
    const Value* attribute = a.Get(0, "attribute");
    const Value* start = a.Get(1, "start");
    Value total = start ? *start : Value::Int(0);
    for (const Value& item : Iterate(v)) {
      Value x = attribute && !attribute->is_none() ? GetPath(*this, item, Str(*attribute)) : item;
      total = EvalBinary("+", total, x);
    }
    return total;
  }
  if (name == "map") {
    ValueList out;
    ValueList items = Iterate(v);
    const Value* attribute = nullptr;
    for (const auto& [k, val] : a.kwargs) {
      if (k == "attribute") attribute = &val;
    }
    if (a.args.empty() && attribute != nullptr) {
      const Value* def = nullptr;
      for (const auto& [k, val] : a.kwargs) {
        if (k == "default") def = &val;
      }
      for (const Value& item : items) {
        Value x = GetPath(*this, item, Str(*attribute));
        if (x.is_undefined() && def != nullptr && !def->is_none()) x = *def;
        out.push_back(std::move(x));
      }
      return Value::List(std::move(out));
    }
    if (a.args.empty()) Fail("map requires a filter argument");
    std::string filter = Str(a.args[0]);
    if (!IsJinjaFilterName(filter)) Fail("No filter named '" + filter + "'.");
    CallArgs rest;
    rest.args.assign(a.args.begin() + 1, a.args.end());
    rest.kwargs = a.kwargs;
    for (const Value& item : items) out.push_back(ApplyFilter(filter, item, rest));
    return Value::List(std::move(out));
  }
  if (name == "select" || name == "reject" || name == "selectattr" || name == "rejectattr") {
    bool attr = name == "selectattr" || name == "rejectattr";
    bool keep_when = name == "select" || name == "selectattr";
    size_t off = attr ? 1 : 0;
    std::string attribute = attr ? Str(Need(a, 0, "attribute", name.c_str())) : "";
    std::string test;
    CallArgs rest;
    if (a.args.size() > off) {
      test = Str(a.args[off]);
      if (!IsJinjaTestName(test)) Fail("No test named '" + test + "'.");
      rest.args.assign(a.args.begin() + static_cast<std::ptrdiff_t>(off + 1), a.args.end());
      rest.kwargs = a.kwargs;
    }
    ValueList out;
    for (const Value& item : Iterate(v)) {
      Value x = attr ? GetPath(*this, item, attribute) : item;
      bool r = test.empty() ? Truthy(x) : ApplyTest(test, x, rest);
      if (r == keep_when) out.push_back(item);
    }
    return Value::List(std::move(out));
  }
  if (name == "batch") {
    int64_t n = IntArg(&Need(a, 0, "linecount", "batch"), 1, "linecount");
    if (n <= 0) Fail("batch size must be positive");
    const Value* fill = a.Get(1, "fill_with");
    ValueList out, cur;
    for (const Value& item : Iterate(v)) {
      cur.push_back(item);
      if (static_cast<int64_t>(cur.size()) == n) {
        out.push_back(Value::List(std::move(cur)));
        cur.clear();
      }
    }
    if (!cur.empty()) {
      if (fill != nullptr && !fill->is_none()) {
        while (static_cast<int64_t>(cur.size()) < n) cur.push_back(*fill);
      }
      out.push_back(Value::List(std::move(cur)));
    }
    return Value::List(std::move(out));
  }
  if (name == "attr") {
    std::string attr_name = Str(Need(a, 0, "name", "attr"));
    if (v.is_undefined()) FailUndefined(v);
    Value r = AttributeOf(*this, v, attr_name);
    if (r.is_undefined()) {
      return Value::Undefined("'" + TypeName(v) + " object' has no attribute " +
                              StringRepr(attr_name));
    }
    return r;
  }
  if (name == "format") {
    if (!a.kwargs.empty() && !a.args.empty())
      Fail("can't handle positional and keyword arguments at the same time");
    if (!a.kwargs.empty()) {
      ValueDict d;
      for (const auto& [k, val] : a.kwargs) d.emplace_back(Value::String(k), val);
      return str(PercentFormat(*this, Str(v), Value::Dict(std::move(d))));
    }
    return str(PercentFormat(*this, Str(v), Value::List(a.args, Kind::kTuple)));
  }
  if (name == "indent") {
    const Value* width = a.Get(0, "width");
    bool first = ArgTruthy(a, 1, "first", false);
    bool blank = ArgTruthy(a, 2, "blank", false);
    std::string ind;
    if (width != nullptr && width->is_string()) {
      ind = width->str;
    } else {
      int64_t w = IntArg(width, 4, "width");
      if (w > 4096) Fail("indent width too large");
      ind = std::string(static_cast<size_t>(std::max<int64_t>(w, 0)), ' ');
    }
    std::string s = Str(v) + "\n";
    std::vector<std::u32string> lines = SplitLines(DecodeUtf8(s), false);
    std::string rv;
    if (blank) {
      for (size_t i = 0; i < lines.size(); ++i) {
        if (i) rv += "\n" + ind;
        rv += EncodeUtf8(lines[i]);
        budget_.CheckSize(rv.size());
      }
    } else {
      rv = lines.empty() ? "" : EncodeUtf8(lines[0]);
      for (size_t i = 1; i < lines.size(); ++i) {
        rv += "\n";
        if (!lines[i].empty()) rv += ind;
        rv += EncodeUtf8(lines[i]);
        budget_.CheckSize(rv.size());
      }
    }
    if (first) rv = ind + rv;
    return str(std::move(rv));
  }
  if (name == "center") {
    return str(Pad(*this, Str(v), IntArg(a.Get(0, "width"), 80, "width"), ' ', 0));
  }
  if (name == "wordcount") {
    std::u32string cps = DecodeUtf8(Str(v));
    int64_t n = 0;
    bool in_word = false;
    for (char32_t c : cps) {
      bool w = IsAlphaCp(c) || IsDigitCp(c) || c == '_';
      if (w && !in_word) ++n;
      in_word = w;
    }
    return Value::Int(n);
  }
  Fail("the filter '" + name + "' is not supported in kvbridge's chat templates");
}

bool Interpreter::ApplyTest(const std::string& name, const Value& v, const CallArgs& a) {
  budget_.Step();
  if (name == "defined") return !v.is_undefined();
  if (name == "undefined") return v.is_undefined();
  if (name == "none") return v.is_none();
  if (name == "boolean") return v.kind == Kind::kBool;
  if (name == "true") return v.kind == Kind::kBool && v.boolean;
  if (name == "false") return v.kind == Kind::kBool && !v.boolean;
  if (name == "integer") return v.kind == Kind::kInt;
  if (name == "float") return v.kind == Kind::kFloat;
  if (name == "number") return v.is_number();
  if (name == "string") return v.is_string();
  if (name == "mapping") return v.kind == Kind::kDict;
  if (name == "iterable") {
    return v.is_undefined() || v.is_string() || v.is_sequence() || v.kind == Kind::kDict;
  }
  if (name == "sequence") {
    return v.is_undefined() || v.is_string() || v.is_sequence() || v.kind == Kind::kDict;
  }
  if (name == "callable") return v.kind == Kind::kCallable;
  if (name == "escaped") return false;
  if (name == "filter") return v.is_string() && IsJinjaFilterName(v.str);
  if (name == "test") return v.is_string() && IsJinjaTestName(v.str);
  if (name == "lower" || name == "upper") {
    std::string s = Str(v);
    CallArgs none;
    return Truthy(StrMethod(*this, s, name == "lower" ? "islower" : "isupper", none));
  }
  if (name == "odd" || name == "even" || name == "divisibleby") {
    Value d = name == "divisibleby" ? Need(a, 0, "num", "divisibleby") : Value::Int(2);
    Value r = EvalBinary("%", v, d);
    if (name == "odd") return Equal(r, Value::Int(1), budget_);
    return Equal(r, Value::Int(0), budget_);
  }
  const Value* other = a.Get(0, "b");
  auto need = [&]() -> const Value& {
    if (other == nullptr) Fail("the test '" + name + "' needs an argument");
    return *other;
  };
  if (name == "eq" || name == "equalto" || name == "==") return Equal(v, need(), budget_);
  if (name == "ne" || name == "!=") return !Equal(v, need(), budget_);
  if (name == "lt" || name == "lessthan" || name == "<") return Less(v, need(), budget_);
  if (name == "gt" || name == "greaterthan" || name == ">") return Less(need(), v, budget_);
  if (name == "le" || name == "<=") return Less(v, need(), budget_) || Equal(v, need(), budget_);
  if (name == "ge" || name == ">=") return Less(need(), v, budget_) || Equal(v, need(), budget_);
  if (name == "in") return Contains(*this, need(), v);
  if (name == "sameas") {
    const Value& o = need();
    if (v.kind != o.kind) return false;
    switch (v.kind) {
      case Kind::kNone:
      case Kind::kUndefined:
        return v.kind == Kind::kNone;
      case Kind::kBool:
        return v.boolean == o.boolean;
      case Kind::kInt:
        return v.integer == o.integer && v.integer >= -5 && v.integer <= 256;
      case Kind::kList:
      case Kind::kTuple:
        return v.list == o.list;
      case Kind::kDict:
      case Kind::kObject:
        return v.dict == o.dict;
      case Kind::kCallable:
        return v.fn == o.fn;
      default:
        return false;
    }
  }
  Fail("the test '" + name + "' is not supported in kvbridge's chat templates");
}

}  // namespace kvbridge::jinja

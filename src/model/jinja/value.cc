// src/model/jinja/value.cc — Python semantics of jinja::Value: truthiness, ==, <, str, repr,
// json.dumps, and UTF-8 code-point helpers.
#include "model/jinja/value.h"

#include <algorithm>
#include <charconv>
#include <cmath>
#include <cstdio>
#include <cstring>

namespace kvbridge::jinja {

const Value* CallArgs::Get(size_t index, std::string_view name) const {
  if (index < args.size()) return &args[index];
  for (const auto& [k, v] : kwargs) {
    if (k == name) return &v;
  }
  return nullptr;
}

std::string TypeName(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "Undefined";
    case Kind::kNone:
      return "NoneType";
    case Kind::kBool:
      return "bool";
    case Kind::kInt:
      return "int";
    case Kind::kFloat:
      return "float";
    case Kind::kString:
      return "str";
    case Kind::kList:
      return "list";
    case Kind::kTuple:
      return "tuple";
    case Kind::kDict:
      return "dict";
    case Kind::kObject:
      return v.str;
    case Kind::kCallable:
      return "function";
  }
  return "object";
}

bool Truthy(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return false;
    case Kind::kBool:
      return v.boolean;
    case Kind::kInt:
      return v.integer != 0;
    case Kind::kFloat:
      return v.number != 0;
    case Kind::kString:
      return !v.str.empty();
    case Kind::kList:
    case Kind::kTuple:
      return !v.list->empty();
    case Kind::kDict:
      return !v.dict->empty();
    case Kind::kObject:
    case Kind::kCallable:
      return true;
  }
  return true;
}

bool Equal(const Value& a, const Value& b, Budget& budget) {
  budget.Step();
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return a.as_double() == b.as_double();
    return a.as_int() == b.as_int();
  }
  if (a.kind != b.kind) return false;
  switch (a.kind) {
    case Kind::kUndefined:
    case Kind::kNone:
      return true;
    case Kind::kString:
      return a.str == b.str;
    case Kind::kList:
    case Kind::kTuple: {
      if (a.list == b.list) return true;
      if (a.list->size() != b.list->size()) return false;
      for (size_t i = 0; i < a.list->size(); ++i) {
        if (!Equal((*a.list)[i], (*b.list)[i], budget)) return false;
      }
      return true;
    }
    case Kind::kDict: {
      if (a.dict == b.dict) return true;
      if (a.dict->size() != b.dict->size()) return false;
      for (const auto& [k, v] : *a.dict) {
        const Value* other = DictFind(*b.dict, k, budget);
        if (other == nullptr || !Equal(v, *other, budget)) return false;
      }
      return true;
    }
    case Kind::kObject:
      return a.dict == b.dict;
    case Kind::kCallable:
      return a.fn == b.fn;
    default:
      return false;
  }
}

bool Less(const Value& a, const Value& b, Budget& budget) {
  budget.Step();
  if (a.is_number() && b.is_number()) {
    if (a.kind == Kind::kFloat || b.kind == Kind::kFloat) return a.as_double() < b.as_double();
    return a.as_int() < b.as_int();
  }
  if (a.kind == Kind::kString && b.kind == Kind::kString) return a.str < b.str;  // UTF-8 order
  if (a.is_sequence() && a.kind == b.kind) {
    const ValueList& x = *a.list;
    const ValueList& y = *b.list;
    for (size_t i = 0; i < x.size() && i < y.size(); ++i) {
      if (!Equal(x[i], y[i], budget)) return Less(x[i], y[i], budget);
    }
    return x.size() < y.size();
  }
  if (a.is_undefined() || b.is_undefined()) {
    Fail("'" + (a.is_undefined() ? a.str : b.str) + "' is undefined");
  }
  Fail("'<' not supported between instances of '" + TypeName(a) + "' and '" + TypeName(b) + "'");
}

std::string FloatRepr(double d) {
  if (std::isnan(d)) return "nan";
  if (std::isinf(d)) return d < 0 ? "-inf" : "inf";
  char buf[64];
  auto res = std::to_chars(buf, buf + sizeof(buf), d, std::chars_format::scientific);
  std::string sci(buf, res.ptr);
  std::string out;
  size_t p = 0;
  if (sci[0] == '-') {
    out.push_back('-');
    p = 1;
  }
  size_t e = sci.find('e');
  std::string digits;
  for (size_t i = p; i < e; ++i) {
    if (sci[i] != '.') digits.push_back(sci[i]);
  }
  int exp = std::atoi(sci.c_str() + e + 1);
  int decpt = exp + 1;
  int n = static_cast<int>(digits.size());
  if (decpt <= -4 || decpt > 16) {
    out.push_back(digits[0]);
    if (n > 1) {
      out.push_back('.');
      out.append(digits, 1, std::string::npos);
    }
    char eb[16];
    std::snprintf(eb, sizeof(eb), "e%c%02d", exp < 0 ? '-' : '+', std::abs(exp));
    out += eb;
  } else if (decpt <= 0) {
    out += "0.";
    out.append(static_cast<size_t>(-decpt), '0');
    out += digits;
  } else if (decpt >= n) {
    out += digits;
    out.append(static_cast<size_t>(decpt - n), '0');
    out += ".0";
  } else {
    out.append(digits, 0, static_cast<size_t>(decpt));
    out.push_back('.');
    out.append(digits, static_cast<size_t>(decpt), std::string::npos);
  }
  return out;
}

namespace {

// Python's str.isprintable() for the code points a repr must escape (the C0/C1 controls and a
// few format characters; other non-ASCII text prints as itself).
bool ReprPrintable(char32_t c) {
  if (c < 0x20 || c == 0x7f) return false;
  if (c >= 0x80 && c <= 0xa0) return false;
  if (c == 0xad) return false;
  if (c >= 0x2028 && c <= 0x202e) return false;
  if (c >= 0x200b && c <= 0x200f) return false;
  if (c >= 0x2060 && c <= 0x2064) return false;
  if (c == 0xfeff) return false;
  if (c >= 0xd800 && c <= 0xdfff) return false;
  return true;
}

void AppendHexEscape(char32_t c, std::string& out) {
  char buf[16];
  if (c <= 0xff) {
    std::snprintf(buf, sizeof(buf), "\\x%02x", static_cast<unsigned>(c));
  } else if (c <= 0xffff) {
    std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
  } else {
    std::snprintf(buf, sizeof(buf), "\\U%08x", static_cast<unsigned>(c));
  }
  out += buf;
}

}  // namespace

std::string StringRepr(std::string_view s) {
  bool has_single = s.find('\'') != std::string_view::npos;
  bool has_double = s.find('"') != std::string_view::npos;
  char quote = (has_single && !has_double) ? '"' : '\'';
  std::string out;
  out.reserve(s.size() + 2);
  out.push_back(quote);
  std::u32string cps = DecodeUtf8(s);
  for (char32_t c : cps) {
    if (c == static_cast<char32_t>(quote) || c == '\\') {
      out.push_back('\\');
      out.push_back(static_cast<char>(c));
    } else if (c == '\n') {
      out += "\\n";
    } else if (c == '\r') {
      out += "\\r";
    } else if (c == '\t') {
      out += "\\t";
    } else if (!ReprPrintable(c)) {
      AppendHexEscape(c, out);
    } else {
      AppendUtf8(c, out);
    }
  }
  out.push_back(quote);
  return out;
}

void AppendRepr(const Value& v, std::string& out, Budget& budget, int depth) {
  budget.Step();
  if (depth > budget.max_depth)
    Fail("a value nests deeper than " + std::to_string(budget.max_depth));
  budget.CheckSize(out.size());
  switch (v.kind) {
    case Kind::kUndefined:
      out += "Undefined";
      return;
    case Kind::kNone:
      out += "None";
      return;
    case Kind::kBool:
      out += v.boolean ? "True" : "False";
      return;
    case Kind::kInt:
      out += std::to_string(v.integer);
      return;
    case Kind::kFloat:
      out += FloatRepr(v.number);
      return;
    case Kind::kString:
      out += StringRepr(v.str);
      return;
    case Kind::kList:
    case Kind::kTuple: {
      bool tuple = v.kind == Kind::kTuple;
      out.push_back(tuple ? '(' : '[');
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += ", ";
        AppendRepr((*v.list)[i], out, budget, depth + 1);
      }
      if (tuple && v.list->size() == 1) out.push_back(',');
      out.push_back(tuple ? ')' : ']');
      return;
    }
    case Kind::kDict: {
      out.push_back('{');
      bool first = true;
      for (const auto& [k, val] : *v.dict) {
        if (!first) out += ", ";
        first = false;
        AppendRepr(k, out, budget, depth + 1);
        out += ": ";
        AppendRepr(val, out, budget, depth + 1);
      }
      out.push_back('}');
      return;
    }
    case Kind::kObject: {
      if (v.str == "Namespace") {
        out += "<Namespace ";
        Value attrs = Value::Dict(*v.dict);
        AppendRepr(attrs, out, budget, depth + 1);
        out += ">";
      } else if (v.str == "LoopContext") {
        const Value* index = DictFind(*v.dict, "index");
        const Value* length = DictFind(*v.dict, "length");
        out += "<LoopContext " + std::to_string(index ? index->integer : 0) + "/" +
               std::to_string(length ? length->integer : 0) + ">";
      } else {
        out += "<" + v.str + ">";
      }
      return;
    }
    case Kind::kCallable:
      out += "<function " + v.fn->name + ">";
      return;
  }
}

std::string Repr(const Value& v, Budget& budget) {
  std::string out;
  AppendRepr(v, out, budget, 0);
  budget.CheckSize(out.size());
  return out;
}

std::string ToStr(const Value& v, Budget& budget) {
  switch (v.kind) {
    case Kind::kUndefined:
      return "";
    case Kind::kString:
      return v.str;
    default:
      return Repr(v, budget);
  }
}

namespace {

void AppendJsonString(std::string_view s, bool ensure_ascii, std::string& out) {
  out.push_back('"');
  std::u32string cps = DecodeUtf8(s);
  char buf[16];
  for (char32_t c : cps) {
    switch (c) {
      case '"':
        out += "\\\"";
        continue;
      case '\\':
        out += "\\\\";
        continue;
      case '\n':
        out += "\\n";
        continue;
      case '\r':
        out += "\\r";
        continue;
      case '\t':
        out += "\\t";
        continue;
      case '\b':
        out += "\\b";
        continue;
      case '\f':
        out += "\\f";
        continue;
      default:
        break;
    }
    if (c < 0x20 || (ensure_ascii && c >= 0x7f)) {
      if (c > 0xffff) {
        char32_t u = c - 0x10000;
        std::snprintf(buf, sizeof(buf), "\\u%04x\\u%04x", static_cast<unsigned>(0xd800 | (u >> 10)),
                      static_cast<unsigned>(0xdc00 | (u & 0x3ff)));
      } else {
        std::snprintf(buf, sizeof(buf), "\\u%04x", static_cast<unsigned>(c));
      }
      out += buf;
    } else {
      AppendUtf8(c, out);
    }
  }
  out.push_back('"');
}

std::string JsonFloat(double d) {
  if (std::isnan(d)) return "NaN";
  if (std::isinf(d)) return d < 0 ? "-Infinity" : "Infinity";
  return FloatRepr(d);
}

// json.dumps turns keys into strings: str keys as they are, int/float/bool/None converted.
std::string JsonKey(const Value& k) {
  switch (k.kind) {
    case Kind::kString:
      return k.str;
    case Kind::kBool:
      return k.boolean ? "true" : "false";
    case Kind::kNone:
      return "null";
    case Kind::kInt:
      return std::to_string(k.integer);
    case Kind::kFloat:
      return JsonFloat(k.number);
    default:
      Fail("keys must be str, int, float, bool or None, not " + TypeName(k));
  }
}

void AppendJson(const Value& v, const JsonOptions& o, int level, std::string& out, Budget& budget) {
  budget.Step();
  if (level > budget.max_depth)
    Fail("a value nests deeper than " + std::to_string(budget.max_depth));
  budget.CheckSize(out.size());
  auto newline = [&](int lvl) {
    out.push_back('\n');
    for (int i = 0; i < lvl; ++i) out += o.indent;
  };
  switch (v.kind) {
    case Kind::kNone:
      out += "null";
      return;
    case Kind::kBool:
      out += v.boolean ? "true" : "false";
      return;
    case Kind::kInt:
      out += std::to_string(v.integer);
      return;
    case Kind::kFloat:
      out += JsonFloat(v.number);
      return;
    case Kind::kString:
      AppendJsonString(v.str, o.ensure_ascii, out);
      return;
    case Kind::kList:
    case Kind::kTuple: {
      if (v.list->empty()) {
        out += "[]";
        return;
      }
      out.push_back('[');
      for (size_t i = 0; i < v.list->size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline(level + 1);
        AppendJson((*v.list)[i], o, level + 1, out, budget);
      }
      if (o.has_indent) newline(level);
      out.push_back(']');
      return;
    }
    case Kind::kDict: {
      if (v.dict->empty()) {
        out += "{}";
        return;
      }
      std::vector<std::pair<std::string, const Value*>> items;
      items.reserve(v.dict->size());
      for (const auto& [k, val] : *v.dict) {
        if (o.sort_keys && !k.is_string())
          Fail("'<' not supported between keys of type " + TypeName(k));
        items.emplace_back(JsonKey(k), &val);
      }
      if (o.sort_keys) {
        std::stable_sort(items.begin(), items.end(),
                         [](const auto& a, const auto& b) { return a.first < b.first; });
      }
      out.push_back('{');
      for (size_t i = 0; i < items.size(); ++i) {
        if (i) out += o.item_separator;
        if (o.has_indent) newline(level + 1);
        AppendJsonString(items[i].first, o.ensure_ascii, out);
        out += o.key_separator;
        AppendJson(*items[i].second, o, level + 1, out, budget);
      }
      if (o.has_indent) newline(level);
      out.push_back('}');
      return;
    }
    default:
      Fail("Object of type " + TypeName(v) + " is not JSON serializable");
  }
}

}  // namespace

std::string ToJson(const Value& v, const JsonOptions& options, Budget& budget) {
  std::string out;
  AppendJson(v, options, 0, out, budget);
  budget.CheckSize(out.size());
  return out;
}

const Value* DictFind(const ValueDict& dict, const Value& key, Budget& budget) {
  if (key.is_string()) return DictFind(dict, key.str);
  for (const auto& [k, v] : dict) {
    if (Equal(k, key, budget)) return &v;
  }
  return nullptr;
}

const Value* DictFind(const ValueDict& dict, std::string_view key) {
  for (const auto& [k, v] : dict) {
    if (k.kind == Kind::kString && k.str == key) return &v;
  }
  return nullptr;
}

std::u32string DecodeUtf8(std::string_view s) {
  std::u32string out;
  out.reserve(s.size());
  size_t i = 0;
  while (i < s.size()) {
    unsigned char c = static_cast<unsigned char>(s[i]);
    if (c < 0x80) {
      out.push_back(c);
      ++i;
      continue;
    }
    int n = 0;
    char32_t cp = 0;
    if ((c & 0xe0) == 0xc0) {
      n = 1;
      cp = c & 0x1f;
    } else if ((c & 0xf0) == 0xe0) {
      n = 2;
      cp = c & 0x0f;
    } else if ((c & 0xf8) == 0xf0) {
      n = 3;
      cp = c & 0x07;
    } else {
      Fail("text is not valid UTF-8");
    }
    if (i + static_cast<size_t>(n) >= s.size()) Fail("text is not valid UTF-8");
    for (int k = 1; k <= n; ++k) {
      unsigned char cc = static_cast<unsigned char>(s[i + static_cast<size_t>(k)]);
      if ((cc & 0xc0) != 0x80) Fail("text is not valid UTF-8");
      cp = (cp << 6) | (cc & 0x3f);
    }
    static constexpr char32_t kMin[] = {0, 0x80, 0x800, 0x10000};
    if (cp < kMin[n] || cp > 0x10ffff || (cp >= 0xd800 && cp <= 0xdfff)) {
      Fail("text is not valid UTF-8");
    }
    out.push_back(cp);
    i += static_cast<size_t>(n) + 1;
  }
  return out;
}

void AppendUtf8(char32_t c, std::string& out) {
  if (c < 0x80) {
    out.push_back(static_cast<char>(c));
  } else if (c < 0x800) {
    out.push_back(static_cast<char>(0xc0 | (c >> 6)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else if (c < 0x10000) {
    out.push_back(static_cast<char>(0xe0 | (c >> 12)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  } else {
    out.push_back(static_cast<char>(0xf0 | (c >> 18)));
    out.push_back(static_cast<char>(0x80 | ((c >> 12) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | ((c >> 6) & 0x3f)));
    out.push_back(static_cast<char>(0x80 | (c & 0x3f)));
  }
}

std::string EncodeUtf8(std::u32string_view s) {
  std::string out;
  out.reserve(s.size());
  for (char32_t c : s) AppendUtf8(c, out);
  return out;
}

bool IsAscii(std::string_view s) {
  return std::all_of(s.begin(), s.end(),
                     [](char c) { return static_cast<unsigned char>(c) < 0x80; });
}

bool IsPySpace(char32_t c) {
  if (c == ' ' || (c >= 0x09 && c <= 0x0d) || (c >= 0x1c && c <= 0x1f)) return true;
  if (c < 0x80) return false;
  return c == 0x85 || c == 0xa0 || c == 0x1680 || (c >= 0x2000 && c <= 0x200a) || c == 0x2028 ||
         c == 0x2029 || c == 0x202f || c == 0x205f || c == 0x3000;
}

size_t CodePointCount(std::string_view s) {
  size_t n = 0;
  for (char c : s) {
    if ((static_cast<unsigned char>(c) & 0xc0) != 0x80) ++n;
  }
  return n;
}

}  // namespace kvbridge::jinja

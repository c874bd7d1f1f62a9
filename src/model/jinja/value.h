// src/model/jinja/value.h — the values of kvbridge's Jinja2 interpreter (internal).
//
// A Value models the Python objects a chat template sees: Jinja's Undefined, None, bool, int,
// float, str, list, tuple, dict, a few objects (namespace, loop) and callables. Lists and dicts
// are shared and immutable once built (the ImmutableSandboxedEnvironment transformers uses
// forbids list.append / dict.update), except namespaces, which `{% set ns.x = ... %}` changes.
//
// Errors inside the interpreter are thrown as jinja::Error and turned into a Status at the
// public API (src/model/chat_template.cc); they never leave the module.
//
// Thread-safety: values are not synchronized; one render uses them on one thread.
#pragma once

#include <algorithm>
#include <cstdint>
#include <functional>
#include <memory>
#include <stdexcept>
#include <string>
#include <string_view>
#include <utility>
#include <vector>

namespace kvbridge::jinja {

/// An error while lexing, parsing or rendering. `line` is the 1-based template line (0: none).
/// `raised` marks the template's own raise_exception(message).
struct Error {
  std::string message;
  int line = 0;
  bool raised = false;
  bool resource = false;  ///< a limit (output size, steps, depth) was reached
};

[[noreturn]] inline void Fail(std::string message) { throw Error{std::move(message)}; }

/// Work limits of one render, checked by every loop and every growing string.
struct Budget {
  int64_t steps_left = 0;
  size_t max_string_bytes = 0;
  int max_depth = 0;
  void Step(int64_t n = 1) {
    steps_left -= n;
    if (steps_left < 0) {
      throw Error{"the render took more than its step budget (a loop or recursion too long)", 0,
                  false, true};
    }
  }
  void CheckSize(size_t n) const {
    if (n > max_string_bytes) {
      throw Error{"a string grew past " + std::to_string(max_string_bytes) + " bytes", 0, false,
                  true};
    }
  }
};

struct Value;
struct Callable;
using ValueList = std::vector<Value>;
using ValueDict = std::vector<std::pair<Value, Value>>;  // insertion order, as Python dicts

enum class Kind : uint8_t {
  kUndefined,
  kNone,
  kBool,
  kInt,
  kFloat,
  kString,
  kList,
  kTuple,
  kDict,
  kObject,  // namespace, loop: attributes in `dict`, type name in `str`
  kCallable,
};

struct Value {
  Kind kind = Kind::kUndefined;
  bool boolean = false;
  int64_t integer = 0;
  double number = 0;
  std::string str;  // kString: the text (UTF-8); kUndefined: the hint; kObject: the type name
  std::shared_ptr<ValueList> list;
  std::shared_ptr<ValueDict> dict;
  std::shared_ptr<Callable> fn;
  /// Nesting depth of lists / dicts inside (0 for scalars), bounded by kMaxValueNesting so
  /// that printing, comparing and destroying a value cannot overflow the stack.
  uint32_t depth = 0;

  static constexpr uint32_t kMaxValueNesting = 1000;
  void CheckDepth() const {
    if (depth > kMaxValueNesting) {
      throw Error{"a value nests deeper than " + std::to_string(kMaxValueNesting) + " levels", 0,
                  false, true};
    }
  }

  static Value Undefined(std::string hint = {}) {
    Value v;
    v.str = std::move(hint);
    return v;
  }
  static Value None() {
    Value v;
    v.kind = Kind::kNone;
    return v;
  }
  static Value Bool(bool b) {
    Value v;
    v.kind = Kind::kBool;
    v.boolean = b;
    return v;
  }
  static Value Int(int64_t i) {
    Value v;
    v.kind = Kind::kInt;
    v.integer = i;
    return v;
  }
  static Value Float(double d) {
    Value v;
    v.kind = Kind::kFloat;
    v.number = d;
    return v;
  }
  static Value String(std::string s) {
    Value v;
    v.kind = Kind::kString;
    v.str = std::move(s);
    return v;
  }
  static Value List(ValueList items, Kind kind = Kind::kList) {
    Value v;
    v.kind = kind;
    for (const Value& x : items) v.depth = std::max(v.depth, x.depth + 1);
    v.CheckDepth();
    v.list = std::make_shared<ValueList>(std::move(items));
    return v;
  }
  static Value Dict(ValueDict items) {
    Value v;
    v.kind = Kind::kDict;
    for (const auto& [k, x] : items) v.depth = std::max({v.depth, k.depth + 1, x.depth + 1});
    v.CheckDepth();
    v.dict = std::make_shared<ValueDict>(std::move(items));
    return v;
  }
  static Value Object(std::string type_name, ValueDict attrs) {
    Value v = Dict(std::move(attrs));
    v.kind = Kind::kObject;
    v.str = std::move(type_name);
    return v;
  }

  bool is_undefined() const { return kind == Kind::kUndefined; }
  bool is_none() const { return kind == Kind::kNone; }
  bool is_string() const { return kind == Kind::kString; }
  bool is_sequence() const { return kind == Kind::kList || kind == Kind::kTuple; }
  /// int or bool (a Python bool is an int).
  bool is_integral() const { return kind == Kind::kInt || kind == Kind::kBool; }
  bool is_number() const { return is_integral() || kind == Kind::kFloat; }
  int64_t as_int() const { return kind == Kind::kBool ? (boolean ? 1 : 0) : integer; }
  double as_double() const { return kind == Kind::kFloat ? number : static_cast<double>(as_int()); }
};

/// Arguments of a call: positional, then keyword (in call order).
struct CallArgs {
  ValueList args;
  std::vector<std::pair<std::string, Value>> kwargs;
  /// Takes the argument at `index` or named `name` (removing the keyword); nullptr if absent.
  const Value* Get(size_t index, std::string_view name) const;
};

class Interpreter;

struct Callable {
  std::string name;
  std::function<Value(Interpreter&, const CallArgs&)> fn;
};

/// Python's type name of a value ("str", "int", "dict", "NoneType", "Undefined", ...).
std::string TypeName(const Value& v);
/// Python truthiness (Undefined is false).
bool Truthy(const Value& v);
/// Python `==` (numbers across int/float/bool; lists and tuples never equal).
bool Equal(const Value& a, const Value& b, Budget& budget);
/// Python `<`; fails with TypeError's wording for unorderable types.
bool Less(const Value& a, const Value& b, Budget& budget);
/// Python str(v) as Jinja prints it: Undefined → "", None → "None", lists as repr.
std::string ToStr(const Value& v, Budget& budget);
/// Python repr(v).
std::string Repr(const Value& v, Budget& budget);
void AppendRepr(const Value& v, std::string& out, Budget& budget, int depth);
/// Python repr(float): shortest round-trip digits, "1.0", "1e+16", "1e-05", "inf", "nan".
std::string FloatRepr(double d);
/// Python repr(str): single quotes unless the text holds ' and no ".
std::string StringRepr(std::string_view s);

/// json.dumps(v, ensure_ascii, indent, separators, sort_keys) as transformers' tojson calls it.
struct JsonOptions {
  bool ensure_ascii = false;
  bool has_indent = false;
  std::string indent;  // one level
  std::string item_separator = ", ";
  std::string key_separator = ": ";
  bool sort_keys = false;
};
std::string ToJson(const Value& v, const JsonOptions& options, Budget& budget);

/// Looks up `key` in a dict value's items (Python equality on keys); nullptr if absent.
const Value* DictFind(const ValueDict& dict, const Value& key, Budget& budget);
const Value* DictFind(const ValueDict& dict, std::string_view key);

// ---- UTF-8 text as Python sees it (code points) ----
/// Decodes UTF-8; fails on malformed text.
std::u32string DecodeUtf8(std::string_view s);
std::string EncodeUtf8(std::u32string_view s);
void AppendUtf8(char32_t c, std::string& out);
bool IsAscii(std::string_view s);
/// Python str.isspace() of one code point.
bool IsPySpace(char32_t c);
/// Number of code points.
size_t CodePointCount(std::string_view s);

}  // namespace kvbridge::jinja

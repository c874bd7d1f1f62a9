// src/model/jinja/interp.h — the tree-walking evaluator of kvbridge's Jinja2 subset (internal).
//
// Renders a parsed template (ast.h) against a context, with the semantics of Python Jinja2 in
// transformers' set-up: default Undefined, the immutable sandbox (no list.append), tojson as
// json.dumps(ensure_ascii=False), raise_exception and strftime_now as globals.
//
// Thread-safety: an Interpreter is one render on one thread; the Node tree it reads is shared
// read-only.
#pragma once

#include <ctime>
#include <memory>
#include <optional>
#include <string>
#include <string_view>
#include <vector>

#include "model/jinja/ast.h"
#include "model/jinja/value.h"

namespace kvbridge::jinja {

struct Scope {
  std::shared_ptr<Scope> parent;
  std::vector<std::pair<std::string, Value>> vars;

  const Value* Find(std::string_view name) const;
  void Set(const std::string& name, Value v);
};

struct RenderLimits {
  int64_t max_steps = 100'000'000;
  size_t max_output_bytes = 32u << 20;
  int max_depth = 200;
  /// strftime_now's clock: nullopt = the local time now (datetime.now()); else this time.
  std::optional<std::tm> now;
};

class Interpreter {
 public:
  explicit Interpreter(const RenderLimits& limits);
  /// Breaks the reference cycles a render can make (a macro in the scope it closes over, a
  /// namespace holding itself) by clearing every namespace and closure it created.
  ~Interpreter();
  Interpreter(const Interpreter&) = delete;
  Interpreter& operator=(const Interpreter&) = delete;

  /// Renders `root` (a kTemplate node) with `context` (top-level variables). Throws Error.
  std::string Render(const Node& root, std::vector<std::pair<std::string, Value>> context);

  Budget& budget() { return budget_; }

  // ---- used by the builtins (builtins.cc) ----
  Value Call(const Value& callee, const CallArgs& args);
  Value GetAttr(const Value& obj, const std::string& name);
  Value GetItem(const Value& obj, const Value& key);
  /// Python iteration: list/tuple items, str code points, dict keys, Undefined → empty.
  ValueList Iterate(const Value& v);
  Value ApplyFilter(const std::string& name, const Value& operand, const CallArgs& args);
  bool ApplyTest(const std::string& name, const Value& operand, const CallArgs& args);
  std::string Str(const Value& v) { return ToStr(v, budget_); }
  /// Fails as Jinja's Undefined does when used (UndefinedError with its message).
  [[noreturn]] static void FailUndefined(const Value& v);
  std::string StrftimeNow(const std::string& format) const;
  /// Records a namespace / closure created by this render (cleared by the destructor).
  void Track(const std::shared_ptr<ValueDict>& ns) { namespaces_.push_back(ns); }
  void Track(const std::shared_ptr<Callable>& fn) { callables_.push_back(fn); }

 private:
  enum class Flow { kNormal, kBreak, kContinue };

  Flow Exec(const Node& n, std::string& out);
  Flow ExecBody(const Node& body, std::string& out);
  Flow ExecFor(const Node& n, std::string& out);
  Flow RunLoop(const Node& n, const Value& iterable, std::string& out, int depth,
               const std::shared_ptr<Scope>& outer);
  Value Eval(const Node& n);
  Value EvalImpl(const Node& n);
  Value EvalBinary(const std::string& op, const Value& a, const Value& b);
  Value EvalGetitem(const Node& n);
  CallArgs EvalArgs(const Node& n, size_t first);
  void Assign(const Node& target, const Value& v);
  Value MakeMacro(const Node& macro, std::shared_ptr<Scope> closure, std::string name);
  Value Lookup(const std::string& name);
  void Append(std::string& out, std::string_view text);

  RenderLimits limits_;
  Budget budget_;
  std::shared_ptr<Scope> scope_;
  std::shared_ptr<Scope> globals_;
  int call_depth_ = 0;
  std::vector<std::shared_ptr<ValueDict>> namespaces_;
  std::vector<std::shared_ptr<Callable>> callables_;
};

}  // namespace kvbridge::jinja

// src/model/jinja/interp.cc — statements, expressions, operators, attribute and item access,
// calls and macros of kvbridge's Jinja2 subset. Filters, tests, methods and globals are in
// builtins.cc.
#include "model/jinja/interp.h"

#include <cmath>
#include <limits>

#include "model/jinja/builtins.h"

namespace kvbridge::jinja {

const Value* Scope::Find(std::string_view name) const {
  for (const Scope* s = this; s != nullptr; s = s->parent.get()) {
    for (const auto& [k, v] : s->vars) {
      if (k == name) return &v;
    }
  }
  return nullptr;
}

void Scope::Set(const std::string& name, Value v) {
  for (auto& [k, old] : vars) {
    if (k == name) {
      old = std::move(v);
      return;
    }
  }
  vars.emplace_back(name, std::move(v));
}

namespace {

// A child scope made current for the lifetime of the guard.
class ScopeGuard {
 public:
  explicit ScopeGuard(std::shared_ptr<Scope>& current, std::shared_ptr<Scope> parent = nullptr)
      : current_(current), saved_(current) {
    auto s = std::make_shared<Scope>();
    s->parent = parent ? std::move(parent) : current;
    current_ = std::move(s);
  }
  ~ScopeGuard() { current_ = saved_; }
  ScopeGuard(const ScopeGuard&) = delete;
  ScopeGuard& operator=(const ScopeGuard&) = delete;

 private:
  std::shared_ptr<Scope>& current_;
  std::shared_ptr<Scope> saved_;
};

[[noreturn]] void FailOverflow() {
  Fail("integer overflow (kvbridge's templates use 64-bit integers)");
}
int64_t AddInt(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_add_overflow(a, b, &r)) FailOverflow();
  return r;
}
int64_t SubInt(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_sub_overflow(a, b, &r)) FailOverflow();
  return r;
}
int64_t MulInt(int64_t a, int64_t b) {
  int64_t r = 0;
  if (__builtin_mul_overflow(a, b, &r)) FailOverflow();
  return r;
}

// Python's float floor division and modulo (Objects/floatobject.c float_divmod).
std::pair<double, double> FloatDivmod(double a, double b) {
  if (b == 0) Fail("float floor division by zero");
  double mod = std::fmod(a, b);
  double div = (a - mod) / b;
  if (mod != 0) {
    if ((b < 0) != (mod < 0)) {
      mod += b;
      div -= 1.0;
    }
  } else {
    mod = std::copysign(0.0, b);
  }
  double floordiv;
  if (div != 0) {
    floordiv = std::floor(div);
    if (div - floordiv > 0.5) floordiv += 1.0;
  } else {
    floordiv = std::copysign(0.0, a / b);
  }
  return {floordiv, mod};
}

std::string OperandError(const std::string& op, const Value& a, const Value& b) {
  return "unsupported operand type(s) for " + op + ": '" + TypeName(a) + "' and '" + TypeName(b) +
         "'";
}

}  // namespace

Interpreter::Interpreter(const RenderLimits& limits) : limits_(limits) {
  budget_.steps_left = limits.max_steps;
  budget_.max_string_bytes = limits.max_output_bytes;
  budget_.max_depth = limits.max_depth;
}

Interpreter::~Interpreter() {
  // One at a time, so that destroying a long chain of namespaces never recurses deeply.
  for (auto& fn : callables_) fn->fn = nullptr;
  for (auto& ns : namespaces_) {
    ValueDict attrs;
    attrs.swap(*ns);
  }
  scope_.reset();
  globals_.reset();
}

void Interpreter::FailUndefined(const Value& v) {
  Fail(v.str.empty() ? std::string("a value is undefined") : v.str);
}

std::string Interpreter::Render(const Node& root,
                                std::vector<std::pair<std::string, Value>> context) {
  globals_ = std::make_shared<Scope>();
  globals_->vars = MakeGlobals();
  auto ctx = std::make_shared<Scope>();
  ctx->parent = globals_;
  ctx->vars = std::move(context);
  scope_ = std::make_shared<Scope>();
  scope_->parent = ctx;
  std::string out;
  ExecBody(root, out);
  return out;
}

void Interpreter::Append(std::string& out, std::string_view text) {
  budget_.CheckSize(out.size() + text.size());
  out.append(text);
}

Value Interpreter::Lookup(const std::string& name) {
  if (const Value* v = scope_->Find(name)) return *v;
  return Value::Undefined("'" + name + "' is undefined");
}

Interpreter::Flow Interpreter::ExecBody(const Node& body, std::string& out) {
  for (const NodePtr& stmt : body.kids) {
    Flow f = Exec(*stmt, out);
    if (f != Flow::kNormal) return f;
  }
  return Flow::kNormal;
}

Interpreter::Flow Interpreter::Exec(const Node& n, std::string& out) {
  budget_.Step();
  try {
    switch (n.kind) {
      case NodeKind::kData:
        Append(out, n.value.str);
        return Flow::kNormal;
      case NodeKind::kOutput: {
        Value v = Eval(*n.kids[0]);
        if (v.kind == Kind::kString) {
          Append(out, v.str);
        } else {
          Append(out, Str(v));
        }
        return Flow::kNormal;
      }
      case NodeKind::kBody:
        return ExecBody(n, out);
      case NodeKind::kIf: {
        if (Truthy(Eval(*n.kids[0]))) return ExecBody(*n.kids[1], out);
        if (n.kids[2]) return Exec(*n.kids[2], out);
        return Flow::kNormal;
      }
      case NodeKind::kFor:
        return ExecFor(n, out);
      case NodeKind::kBreak:
        return Flow::kBreak;
      case NodeKind::kContinue:
        return Flow::kContinue;
      case NodeKind::kSet:
        Assign(*n.kids[0], Eval(*n.kids[1]));
        return Flow::kNormal;
      case NodeKind::kSetBlock: {
        std::string text;
        {
          ScopeGuard guard(scope_);
          ExecBody(*n.kids[1], text);
        }
        Value v = Value::String(std::move(text));
        if (n.kids[2]) {
          // the filter chain's innermost operand is nullptr: apply outermost-last
          std::vector<const Node*> chain;
          for (const Node* f = n.kids[2].get(); f != nullptr; f = f->kids[0].get())
            chain.push_back(f);
          for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
            v = ApplyFilter((*it)->name, v, EvalArgs(**it, 1));
          }
        }
        Assign(*n.kids[0], v);
        return Flow::kNormal;
      }
      case NodeKind::kFilterBlock: {
        std::string text;
        {
          ScopeGuard guard(scope_);
          ExecBody(*n.kids[1], text);
        }
        Value v = Value::String(std::move(text));
        std::vector<const Node*> chain;
        for (const Node* f = n.kids[0].get(); f != nullptr; f = f->kids[0].get())
          chain.push_back(f);
        for (auto it = chain.rbegin(); it != chain.rend(); ++it) {
          v = ApplyFilter((*it)->name, v, EvalArgs(**it, 1));
        }
        Append(out, Str(v));
        return Flow::kNormal;
      }
      case NodeKind::kMacro:
        scope_->Set(n.name, MakeMacro(n, scope_, n.name));
        return Flow::kNormal;
      case NodeKind::kCallBlock: {
        const Node& call = *n.kids[0];
        Value caller = MakeMacro(*n.kids[1], scope_, "caller");
        Value callee = Eval(*call.kids[0]);
        CallArgs args = EvalArgs(call, 1);
        args.kwargs.emplace_back("caller", caller);
        Append(out, Str(Call(callee, args)));
        return Flow::kNormal;
      }
      case NodeKind::kWith: {
        ScopeGuard guard(scope_);
        for (size_t i = 0; i + 1 < n.kids.size(); i += 2) Assign(*n.kids[i], Eval(*n.kids[i + 1]));
        return ExecBody(*n.kids.back(), out);
      }
      default:
        Fail("unexpected statement");
    }
  } catch (Error& e) {
    if (e.line == 0) e.line = n.line;
    throw;
  }
}

Interpreter::Flow Interpreter::ExecFor(const Node& n, std::string& out) {
  return RunLoop(n, Eval(*n.kids[1]), out, 1, scope_);
}

Interpreter::Flow Interpreter::RunLoop(const Node& n, const Value& iterable, std::string& out,
                                       int depth, const std::shared_ptr<Scope>& outer) {
  const Node& target = *n.kids[0];
  ValueList items = Iterate(iterable);
  if (n.kids[2]) {
    ValueList kept;
    for (Value& item : items) {
      budget_.Step();
      ScopeGuard guard(scope_);
      Assign(target, item);
      if (Truthy(Eval(*n.kids[2]))) kept.push_back(std::move(item));
    }
    items = std::move(kept);
  }
  if (items.empty()) {
    if (n.kids[4]) {
      ScopeGuard guard(scope_);
      return ExecBody(*n.kids[4], out) == Flow::kBreak ? Flow::kNormal : Flow::kNormal;
    }
    return Flow::kNormal;
  }
  const int64_t length = static_cast<int64_t>(items.size());
  auto changed_last = std::make_shared<std::optional<Value>>();
  for (int64_t i = 0; i < length; ++i) {
    budget_.Step();
    ScopeGuard guard(scope_);
    Assign(target, items[static_cast<size_t>(i)]);
    ValueDict loop;
    loop.reserve(14);
    auto attr = [&](const char* name, Value v) {
      loop.emplace_back(Value::String(name), std::move(v));
    };
    attr("index", Value::Int(i + 1));
    attr("index0", Value::Int(i));
    attr("revindex", Value::Int(length - i));
    attr("revindex0", Value::Int(length - i - 1));
    attr("first", Value::Bool(i == 0));
    attr("last", Value::Bool(i == length - 1));
    attr("length", Value::Int(length));
    attr("depth", Value::Int(depth));
    attr("depth0", Value::Int(depth - 1));
    attr("previtem",
         i > 0 ? items[static_cast<size_t>(i - 1)] : Value::Undefined("there is no previous item"));
    attr("nextitem", i + 1 < length ? items[static_cast<size_t>(i + 1)]
                                    : Value::Undefined("there is no next item"));
    auto cycle = std::make_shared<Callable>();
    cycle->name = "cycle";
    cycle->fn = [i](Interpreter&, const CallArgs& a) -> Value {
      if (a.args.empty()) Fail("no items for cycling given");
      return a.args[static_cast<size_t>(i) % a.args.size()];
    };
    Value cycle_v;
    cycle_v.kind = Kind::kCallable;
    cycle_v.fn = std::move(cycle);
    attr("cycle", std::move(cycle_v));
    auto changed = std::make_shared<Callable>();
    changed->name = "changed";
    changed->fn = [changed_last](Interpreter& in, const CallArgs& a) -> Value {
      Value now = Value::List(a.args);
      if (changed_last->has_value() && Equal(**changed_last, now, in.budget())) {
        return Value::Bool(false);
      }
      *changed_last = now;
      return Value::Bool(true);
    };
    Track(changed);
    Value changed_v;
    changed_v.kind = Kind::kCallable;
    changed_v.fn = std::move(changed);
    attr("changed", std::move(changed_v));
    Value loop_v = Value::Object("LoopContext", std::move(loop));
    if (n.recursive) {
      // loop(items): the loop body again over `items`, one level deeper, in the loop's scope
      auto again = std::make_shared<Callable>();
      again->name = "loop";
      const Node* node = &n;
      std::shared_ptr<Scope> loop_scope = outer;
      again->fn = [node, depth, loop_scope](Interpreter& in, const CallArgs& a) -> Value {
        if (a.args.size() != 1)
          Fail("loop() takes exactly one argument (the items to recurse into)");
        if (depth >= in.limits_.max_depth) {
          throw Error{"recursive loops nest deeper than " + std::to_string(in.limits_.max_depth), 0,
                      false, true};
        }
        std::shared_ptr<Scope> saved = in.scope_;
        in.scope_ = loop_scope;
        std::string text;
        try {
          in.RunLoop(*node, a.args[0], text, depth + 1, loop_scope);
        } catch (...) {
          in.scope_ = saved;
          throw;
        }
        in.scope_ = saved;
        return Value::String(std::move(text));
      };
      Track(again);
      loop_v.fn = std::move(again);
    }
    scope_->Set("loop", std::move(loop_v));
    Flow f = ExecBody(*n.kids[3], out);
    if (f == Flow::kBreak) break;
  }
  return Flow::kNormal;
}

void Interpreter::Assign(const Node& target, const Value& v) {
  if (target.kind == NodeKind::kName) {
    scope_->Set(target.name, v);
    return;
  }
  if (target.kind == NodeKind::kGetattr) {
    const std::string& ns_name = target.kids[0]->name;
    Value ns = Lookup(ns_name);
    if (ns.kind != Kind::kObject || ns.str != "Namespace") {
      Fail("cannot assign attribute on non-namespace object");
    }
    Value nested;
    nested.depth = v.depth + 1;
    nested.CheckDepth();
    for (auto& [k, old] : *ns.dict) {
      if (k.is_string() && k.str == target.name) {
        old = v;
        return;
      }
    }
    ns.dict->emplace_back(Value::String(target.name), v);
    return;
  }
  // tuple unpacking
  ValueList items = Iterate(v);
  size_t want = target.kids.size();
  if (items.size() < want) {
    Fail("not enough values to unpack (expected " + std::to_string(want) + ", got " +
         std::to_string(items.size()) + ")");
  }
  if (items.size() > want)
    Fail("too many values to unpack (expected " + std::to_string(want) + ")");
  for (size_t i = 0; i < want; ++i) Assign(*target.kids[i], items[i]);
}

Value Interpreter::MakeMacro(const Node& macro, std::shared_ptr<Scope> closure, std::string name) {
  auto fn = std::make_shared<Callable>();
  fn->name = name;
  const Node* node = &macro;
  fn->fn = [node, closure, name](Interpreter& in, const CallArgs& a) -> Value {
    if (in.call_depth_ >= in.limits_.max_depth) {
      throw Error{"macro calls nest deeper than " + std::to_string(in.limits_.max_depth), 0, false,
                  true};
    }
    ++in.call_depth_;
    struct DepthRestore {
      int& d;
      ~DepthRestore() { --d; }
    } restore{in.call_depth_};
    std::shared_ptr<Scope> saved = in.scope_;
    auto scope = std::make_shared<Scope>();
    scope->parent = closure;
    in.scope_ = scope;
    struct ScopeRestore {
      std::shared_ptr<Scope>& cur;
      std::shared_ptr<Scope> saved;
      ~ScopeRestore() { cur = saved; }
    } scope_restore{in.scope_, saved};
    const size_t nparams = node->arg_names.size();
    if (a.args.size() > nparams && !(node->value.is_integral() && (node->value.integer & 1))) {
      Fail("macro '" + name + "' takes not more than " + std::to_string(nparams) + " argument(s)");
    }
    std::vector<bool> bound(nparams, false);
    for (size_t i = 0; i < nparams && i < a.args.size(); ++i) {
      scope->Set(node->arg_names[i], a.args[i]);
      bound[i] = true;
    }
    ValueDict extra_kwargs;
    for (const auto& [k, v] : a.kwargs) {
      bool found = false;
      for (size_t i = 0; i < nparams; ++i) {
        if (node->arg_names[i] == k) {
          if (bound[i]) Fail("macro '" + name + "' got multiple values for argument '" + k + "'");
          scope->Set(k, v);
          bound[i] = true;
          found = true;
        }
      }
      if (found) continue;
      if (k == "caller") {
        scope->Set("caller", v);
        continue;
      }
      if (!(node->value.is_integral() && (node->value.integer & 2))) {
        Fail("macro '" + name + "' takes no keyword argument '" + k + "'");
      }
      extra_kwargs.emplace_back(Value::String(k), v);
    }
    for (size_t i = 0; i < nparams; ++i) {
      if (bound[i]) continue;
      if (node->kids[i]) {
        scope->Set(node->arg_names[i], in.Eval(*node->kids[i]));
      } else {
        scope->Set(node->arg_names[i],
                   Value::Undefined("parameter '" + node->arg_names[i] + "' was not provided"));
      }
    }
    ValueList varargs;
    for (size_t i = nparams; i < a.args.size(); ++i) varargs.push_back(a.args[i]);
    scope->Set("varargs", Value::List(std::move(varargs), Kind::kTuple));
    scope->Set("kwargs", Value::Dict(std::move(extra_kwargs)));
    std::string out;
    in.ExecBody(*node->kids.back(), out);
    return Value::String(std::move(out));
  };
  Track(fn);
  Value v;
  v.kind = Kind::kCallable;
  v.fn = std::move(fn);
  return v;
}

Value Interpreter::Call(const Value& callee, const CallArgs& args) {
  budget_.Step();
  if (callee.kind == Kind::kCallable || (callee.kind == Kind::kObject && callee.fn)) {
    return callee.fn->fn(*this, args);
  }
  if (callee.is_undefined()) FailUndefined(callee);
  Fail("'" + TypeName(callee) + "' object is not callable");
}

CallArgs Interpreter::EvalArgs(const Node& n, size_t first) {
  CallArgs a;
  for (size_t i = first; i < n.kids.size(); ++i) {
    const std::string& name = n.arg_names[i];
    Value v = Eval(*n.kids[i]);
    if (name.empty()) {
      a.args.push_back(std::move(v));
    } else if (name == "*") {
      for (Value& x : Iterate(v)) a.args.push_back(std::move(x));
    } else if (name == "**") {
      if (v.kind != Kind::kDict) Fail("argument after ** must be a mapping, not " + TypeName(v));
      for (const auto& [k, val] : *v.dict) {
        if (!k.is_string()) Fail("keywords must be strings");
        a.kwargs.emplace_back(k.str, val);
      }
    } else {
      a.kwargs.emplace_back(name, std::move(v));
    }
  }
  return a;
}

Value Interpreter::Eval(const Node& n) {
  budget_.Step();
  try {
    return EvalImpl(n);
  } catch (Error& e) {
    if (e.line == 0) e.line = n.line;
    throw;
  }
}

Value Interpreter::EvalImpl(const Node& n) {
  switch (n.kind) {
    case NodeKind::kConst:
      return n.value;
    case NodeKind::kName:
      return Lookup(n.name);
    case NodeKind::kGetattr:
      return GetAttr(Eval(*n.kids[0]), n.name);
    case NodeKind::kGetitem:
      return EvalGetitem(n);
    case NodeKind::kCall: {
      Value callee = Eval(*n.kids[0]);
      return Call(callee, EvalArgs(n, 1));
    }
    case NodeKind::kFilter: {
      Value operand = Eval(*n.kids[0]);
      return ApplyFilter(n.name, operand, EvalArgs(n, 1));
    }
    case NodeKind::kTest: {
      Value operand = Eval(*n.kids[0]);
      bool r = ApplyTest(n.name, operand, EvalArgs(n, 1));
      return Value::Bool(n.negate ? !r : r);
    }
    case NodeKind::kUnary: {
      Value v = Eval(*n.kids[0]);
      if (n.name == "not") return Value::Bool(!Truthy(v));
      if (v.is_undefined()) FailUndefined(v);
      if (v.is_integral()) {
        if (n.name == "+") return Value::Int(v.as_int());
        return Value::Int(SubInt(int64_t{0}, v.as_int()));
      }
      if (v.kind == Kind::kFloat) return Value::Float(n.name == "-" ? -v.number : v.number);
      Fail("bad operand type for unary " + n.name + ": '" + TypeName(v) + "'");
    }
    case NodeKind::kBinary: {
      if (n.name == "and") {
        Value a = Eval(*n.kids[0]);
        return Truthy(a) ? Eval(*n.kids[1]) : a;
      }
      if (n.name == "or") {
        Value a = Eval(*n.kids[0]);
        return Truthy(a) ? a : Eval(*n.kids[1]);
      }
      Value a = Eval(*n.kids[0]);
      Value b = Eval(*n.kids[1]);
      return EvalBinary(n.name, a, b);
    }
    case NodeKind::kCompare: {
      Value left = Eval(*n.kids[0]);
      for (size_t i = 1; i < n.kids.size(); ++i) {
        Value right = Eval(*n.kids[i]);
        const std::string& op = n.arg_names[i - 1];
        bool r;
        if (op == "==") {
          r = Equal(left, right, budget_);
        } else if (op == "!=") {
          r = !Equal(left, right, budget_);
        } else if (op == "<") {
          r = Less(left, right, budget_);
        } else if (op == ">") {
          r = Less(right, left, budget_);
        } else if (op == "<=") {
          r = Less(left, right, budget_) || Equal(left, right, budget_);
        } else if (op == ">=") {
          r = Less(right, left, budget_) || Equal(left, right, budget_);
        } else if (op == "in") {
          r = Contains(*this, right, left);
        } else {
          r = !Contains(*this, right, left);
        }
        if (!r) return Value::Bool(false);
        left = std::move(right);
      }
      return Value::Bool(true);
    }
    case NodeKind::kCondExpr: {
      if (Truthy(Eval(*n.kids[1]))) return Eval(*n.kids[0]);
      if (n.kids[2]) return Eval(*n.kids[2]);
      return Value::Undefined("the inline if-expression on line " + std::to_string(n.line) +
                              " evaluated to false and no else section was defined.");
    }
    case NodeKind::kList:
    case NodeKind::kTuple: {
      ValueList items;
      items.reserve(n.kids.size());
      for (const NodePtr& k : n.kids) items.push_back(Eval(*k));
      return Value::List(std::move(items), n.kind == NodeKind::kList ? Kind::kList : Kind::kTuple);
    }
    case NodeKind::kDict: {
      ValueDict items;
      for (size_t i = 0; i + 1 < n.kids.size(); i += 2) {
        Value k = Eval(*n.kids[i]);
        Value v = Eval(*n.kids[i + 1]);
        if (k.kind == Kind::kList || k.kind == Kind::kDict || k.is_undefined()) {
          Fail("unhashable type: '" + TypeName(k) + "'");
        }
        bool replaced = false;
        for (auto& [ek, ev] : items) {
          if (Equal(ek, k, budget_)) {
            ev = v;
            replaced = true;
            break;
          }
        }
        if (!replaced) items.emplace_back(std::move(k), std::move(v));
      }
      return Value::Dict(std::move(items));
    }
    default:
      Fail("unexpected expression");
  }
}

Value Interpreter::EvalBinary(const std::string& op, const Value& a, const Value& b) {
  if (op == "~") {
    std::string s = Str(a);
    std::string t = Str(b);
    budget_.CheckSize(s.size() + t.size());
    return Value::String(s + t);
  }
  if (a.is_undefined()) FailUndefined(a);
  if (b.is_undefined()) FailUndefined(b);
  const bool ints = a.is_integral() && b.is_integral();
  const bool nums = a.is_number() && b.is_number();
  if (op == "+") {
    if (ints) {
      return Value::Int(AddInt(a.as_int(), b.as_int()));
    }
    if (nums) return Value::Float(a.as_double() + b.as_double());
    if (a.is_string() && b.is_string()) {
      budget_.CheckSize(a.str.size() + b.str.size());
      return Value::String(a.str + b.str);
    }
    if (a.is_sequence() && a.kind == b.kind) {
      budget_.Step(static_cast<int64_t>(a.list->size() + b.list->size()));
      ValueList items = *a.list;
      items.insert(items.end(), b.list->begin(), b.list->end());
      return Value::List(std::move(items), a.kind);
    }
    if (a.is_string()) Fail("can only concatenate str (not \"" + TypeName(b) + "\") to str");
    if (a.is_sequence()) {
      Fail("can only concatenate " + TypeName(a) + " (not \"" + TypeName(b) + "\") to " +
           TypeName(a));
    }
    Fail(OperandError("+", a, b));
  }
  if (op == "-") {
    if (ints) {
      return Value::Int(SubInt(a.as_int(), b.as_int()));
    }
    if (nums) return Value::Float(a.as_double() - b.as_double());
    Fail(OperandError("-", a, b));
  }
  if (op == "*") {
    if (ints) {
      return Value::Int(MulInt(a.as_int(), b.as_int()));
    }
    if (nums) return Value::Float(a.as_double() * b.as_double());
    const Value* seq = (a.is_string() || a.is_sequence()) ? &a : &b;
    const Value* count = seq == &a ? &b : &a;
    if ((seq->is_string() || seq->is_sequence()) && count->is_integral()) {
      int64_t times = std::max<int64_t>(count->as_int(), 0);
      if (seq->is_string()) {
        if (times > 0 && seq->str.size() > budget_.max_string_bytes / static_cast<size_t>(times)) {
          budget_.CheckSize(budget_.max_string_bytes + 1);
        }
        std::string s;
        s.reserve(seq->str.size() * static_cast<size_t>(times));
        for (int64_t i = 0; i < times; ++i) s += seq->str;
        return Value::String(std::move(s));
      }
      if (times > 0 && seq->list->size() > 0 &&
          static_cast<int64_t>(seq->list->size()) > (budget_.steps_left / times)) {
        budget_.Step(budget_.steps_left + 1);
      }
      budget_.Step(static_cast<int64_t>(seq->list->size()) * times);
      ValueList items;
      for (int64_t i = 0; i < times; ++i)
        items.insert(items.end(), seq->list->begin(), seq->list->end());
      return Value::List(std::move(items), seq->kind);
    }
    if (seq->is_string() || seq->is_sequence()) {
      Fail("can't multiply sequence by non-int of type '" + TypeName(*count) + "'");
    }
    Fail(OperandError("*", a, b));
  }
  if (op == "/") {
    if (!nums) Fail(OperandError("/", a, b));
    if (b.as_double() == 0) Fail("division by zero");
    return Value::Float(a.as_double() / b.as_double());
  }
  if (op == "//") {
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) Fail("integer division or modulo by zero");
      if (x == std::numeric_limits<int64_t>::min() && y == -1) FailOverflow();
      int64_t q = x / y;
      if ((x % y != 0) && ((x < 0) != (y < 0))) --q;
      return Value::Int(q);
    }
    if (nums) return Value::Float(FloatDivmod(a.as_double(), b.as_double()).first);
    Fail(OperandError("//", a, b));
  }
  if (op == "%") {
    if (a.is_string()) return Value::String(PercentFormat(*this, a.str, b));
    if (ints) {
      int64_t x = a.as_int(), y = b.as_int();
      if (y == 0) Fail("integer division or modulo by zero");
      if (y == -1) return Value::Int(0);
      int64_t r = x % y;
      if (r != 0 && ((r < 0) != (y < 0))) r += y;
      return Value::Int(r);
    }
    if (nums) {
      if (b.as_double() == 0) Fail("float modulo");
      return Value::Float(FloatDivmod(a.as_double(), b.as_double()).second);
    }
    Fail(OperandError("%", a, b));
  }
  if (op == "**") {
    if (ints && b.as_int() >= 0) {
      int64_t base = a.as_int(), e = b.as_int(), r = 1;
      while (e > 0) {
        budget_.Step();
        if (e & 1) r = MulInt(r, base);
        e >>= 1;
        if (e > 0) base = MulInt(base, base);
      }
      return Value::Int(r);
    }
    if (nums) {
      double x = a.as_double(), y = b.as_double();
      if (x == 0 && y < 0) Fail("0.0 cannot be raised to a negative power");
      if (x < 0 && y != std::floor(y)) Fail("complex results are not supported");
      double r = std::pow(x, y);
      if (std::isinf(r) && std::isfinite(x) && std::isfinite(y))
        Fail("(34, 'Numerical result out of range')");
      return Value::Float(r);
    }
    Fail(OperandError("** or pow()", a, b));
  }
  Fail("unknown operator " + op);
}

namespace {

// Python's slice.indices(length): normalized start, stop, step.
void SliceIndices(int64_t length, const Value* start, const Value* stop, const Value* step,
                  int64_t* out_start, int64_t* out_stop, int64_t* out_step) {
  auto as_index = [](const Value* v) -> std::optional<int64_t> {
    if (v == nullptr || v->is_none()) return std::nullopt;
    if (!v->is_integral())
      Fail("slice indices must be integers or None or have an __index__ method");
    return v->as_int();
  };
  int64_t st = as_index(step).value_or(1);
  if (st == 0) Fail("slice step cannot be zero");
  std::optional<int64_t> a = as_index(start), b = as_index(stop);
  int64_t lo, hi;
  if (st > 0) {
    lo = a.value_or(0);
    hi = b.value_or(length);
    if (lo < 0) lo = std::max<int64_t>(lo + length, 0);
    if (lo > length) lo = length;
    if (hi < 0) hi = std::max<int64_t>(hi + length, 0);
    if (hi > length) hi = length;
  } else {
    lo = a.value_or(length - 1);
    hi = b.value_or(-1 - length);
    if (lo < 0) lo = std::max<int64_t>(lo + length, -1);
    if (lo >= length) lo = length - 1;
    if (hi < 0) hi = std::max<int64_t>(hi + length, -1);
    if (hi >= length) hi = length - 1;
    if (!b.has_value()) hi = -1;
  }
  *out_start = lo;
  *out_stop = hi;
  *out_step = st;
}

}  // namespace

Value Interpreter::EvalGetitem(const Node& n) {
  Value obj = Eval(*n.kids[0]);
  const Node& key = *n.kids[1];
  if (key.kind != NodeKind::kSlice) return GetItem(obj, Eval(key));
  Value parts[3];
  const Value* ptrs[3] = {nullptr, nullptr, nullptr};
  for (int i = 0; i < 3; ++i) {
    if (key.kids[static_cast<size_t>(i)]) {
      parts[i] = Eval(*key.kids[static_cast<size_t>(i)]);
      ptrs[i] = &parts[i];
    }
  }
  if (obj.is_undefined()) FailUndefined(obj);
  if (!obj.is_string() && !obj.is_sequence()) {
    if (obj.kind == Kind::kDict) Fail("unhashable type: 'slice'");
    return Value::Undefined("'" + TypeName(obj) + " object' has no element slice");
  }
  if (obj.is_string()) {
    std::u32string cps = DecodeUtf8(obj.str);
    int64_t lo, hi, st;
    SliceIndices(static_cast<int64_t>(cps.size()), ptrs[0], ptrs[1], ptrs[2], &lo, &hi, &st);
    std::u32string r;
    for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st)
      r.push_back(cps[static_cast<size_t>(i)]);
    return Value::String(EncodeUtf8(r));
  }
  int64_t lo, hi, st;
  SliceIndices(static_cast<int64_t>(obj.list->size()), ptrs[0], ptrs[1], ptrs[2], &lo, &hi, &st);
  ValueList r;
  for (int64_t i = lo; st > 0 ? i < hi : i > hi; i += st) {
    budget_.Step();
    r.push_back((*obj.list)[static_cast<size_t>(i)]);
  }
  return Value::List(std::move(r), obj.kind);
}

namespace {

std::string ObjectTypeRepr(const Value& v) {
  if (v.is_none()) return "None";
  return TypeName(v) + " object";
}

}  // namespace

Value Interpreter::GetItem(const Value& obj, const Value& key) {
  if (obj.is_undefined()) FailUndefined(obj);
  if ((obj.is_sequence() || obj.is_string()) && key.is_integral()) {
    int64_t i = key.as_int();
    if (obj.is_string()) {
      std::u32string cps = DecodeUtf8(obj.str);
      int64_t len = static_cast<int64_t>(cps.size());
      if (i < 0) i += len;
      if (i >= 0 && i < len) {
        std::string s;
        AppendUtf8(cps[static_cast<size_t>(i)], s);
        return Value::String(std::move(s));
      }
    } else {
      int64_t len = static_cast<int64_t>(obj.list->size());
      if (i < 0) i += len;
      if (i >= 0 && i < len) return (*obj.list)[static_cast<size_t>(i)];
    }
    return Value::Undefined("'" + ObjectTypeRepr(obj) + "' has no element " + Repr(key, budget_));
  }
  if (obj.kind == Kind::kDict) {
    if (key.kind == Kind::kList || key.kind == Kind::kDict)
      Fail("unhashable type: '" + TypeName(key) + "'");
    if (const Value* v = DictFind(*obj.dict, key, budget_)) return *v;
  }
  if (key.is_string()) {
    // item lookup failed: Jinja's getitem falls back to the attribute
    Value attr = AttributeOf(*this, obj, key.str);
    if (!attr.is_undefined()) return attr;
  }
  if (key.is_string()) {
    return Value::Undefined("'" + ObjectTypeRepr(obj) + "' has no attribute " +
                            StringRepr(key.str));
  }
  return Value::Undefined("'" + ObjectTypeRepr(obj) + "' has no element " + Repr(key, budget_));
}

Value Interpreter::GetAttr(const Value& obj, const std::string& name) {
  if (obj.is_undefined()) FailUndefined(obj);
  Value attr = AttributeOf(*this, obj, name);
  if (!attr.is_undefined()) return attr;
  if (obj.kind == Kind::kDict) {
    if (const Value* v = DictFind(*obj.dict, name)) return *v;
  }
  return Value::Undefined("'" + ObjectTypeRepr(obj) + "' has no attribute " + StringRepr(name));
}

ValueList Interpreter::Iterate(const Value& v) {
  switch (v.kind) {
    case Kind::kUndefined:
      return {};
    case Kind::kList:
    case Kind::kTuple:
      budget_.Step(static_cast<int64_t>(v.list->size()));
      return *v.list;
    case Kind::kDict: {
      budget_.Step(static_cast<int64_t>(v.dict->size()));
      ValueList keys;
      keys.reserve(v.dict->size());
      for (const auto& [k, val] : *v.dict) keys.push_back(k);
      return keys;
    }
    case Kind::kString: {
      ValueList chars;
      std::u32string cps = DecodeUtf8(v.str);
      budget_.Step(static_cast<int64_t>(cps.size()));
      chars.reserve(cps.size());
      for (char32_t c : cps) {
        std::string s;
        AppendUtf8(c, s);
        chars.push_back(Value::String(std::move(s)));
      }
      return chars;
    }
    default:
      Fail("'" + TypeName(v) + "' object is not iterable");
  }
}

}  // namespace kvbridge::jinja

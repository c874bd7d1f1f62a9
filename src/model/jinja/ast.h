// src/model/jinja/ast.h — the syntax tree of a parsed template (internal), and the parser.
//
// One Node type for expressions and statements: `kind` says which, `kids` holds the operands
// in the order each kind documents below, `name` a name or operator, `value` a constant.
#pragma once

#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "model/jinja/value.h"

namespace kvbridge::jinja {

enum class NodeKind : uint8_t {
  // ---- expressions ----
  kConst,     // value
  kName,      // name
  kGetattr,   // kids[0].name
  kGetitem,   // kids[0][kids[1]]
  kSlice,     // kids: start, stop, step (nullptr when absent)
  kCall,      // kids[0](args): args = kids[1..], keyword args named in arg_names ("" = positional,
              // "*" = *args, "**" = **kwargs)
  kFilter,    // name; kids[0] = operand (nullptr inside filter blocks), then args as kCall
  kTest,      // name; kids[0] = operand, then args as kCall; negate
  kUnary,     // name: "-", "+", "not"; kids[0]
  kBinary,    // name: + - * / // % ** ~ and or; kids[0], kids[1]
  kCompare,   // kids[0] op[0] kids[1] op[1] kids[2] ... ; ops in arg_names (== != < <= > >= in
              // notin)
  kCondExpr,  // kids: then, test, else (nullptr when absent)
  kList,      // kids
  kTuple,     // kids
  kDict,      // kids: key0, value0, key1, value1, ...
  // ---- statements ----
  kTemplate,     // kids: body statements
  kData,         // value: the text
  kOutput,       // kids[0]: the expression printed
  kIf,           // kids: test, then (kBody), else (kBody or nullptr); elif is a nested kIf in else
  kBody,         // kids: statements
  kFor,          // kids: target, iter, filter (or nullptr), body, else (or nullptr); recursive
  kSet,          // kids: target, value
  kSetBlock,     // kids: target, body, filter chain (kFilter with nullptr operand, or nullptr)
  kMacro,        // name; arg_names; kids: defaults (nullptr for none), ..., body (last)
  kCallBlock,    // kids: call expression, body; arg_names/defaults as kMacro: kids[2..]
  kFilterBlock,  // kids: filter chain, body
  kWith,         // kids: target0, value0, ..., body (last)
  kBreak,
  kContinue,
};

struct Node;
using NodePtr = std::unique_ptr<Node>;

struct Node {
  NodeKind kind;
  int line = 0;
  std::string name;
  Value value;
  std::vector<NodePtr> kids;
  std::vector<std::string> arg_names;
  bool negate = false;
  bool recursive = false;
};

/// Parses template source (already newline-normalized by the lexer) into a kTemplate node.
/// Throws Error with the line of the offending construct. `max_depth` bounds nesting.
NodePtr ParseTemplate(std::string_view source, bool trim_blocks, bool lstrip_blocks, int max_depth);

/// Whether Jinja2 has a filter / test of this name (unknown names are parse errors there).
bool IsJinjaFilterName(std::string_view name);
bool IsJinjaTestName(std::string_view name);

}  // namespace kvbridge::jinja

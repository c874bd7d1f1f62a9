// src/model/jinja/builtins.h — globals, methods, filters and tests of kvbridge's Jinja2
// subset (internal; see interp.h).
#pragma once

#include <string>
#include <utility>
#include <vector>

#include "model/jinja/interp.h"
#include "model/jinja/value.h"

namespace kvbridge::jinja {

/// range, dict, namespace, raise_exception, strftime_now.
std::vector<std::pair<std::string, Value>> MakeGlobals();
/// Python `item in container`.
bool Contains(Interpreter& in, const Value& container, const Value& item);
/// Python `format % args` (printf-style: %s %r %d %i %f %x %o %e %g %%).
std::string PercentFormat(Interpreter& in, const std::string& format, const Value& args);
/// Python getattr(obj, name) under the immutable sandbox: a bound method of str / dict / list,
/// a namespace or loop attribute; Undefined when none (the caller then tries the item).
Value AttributeOf(Interpreter& in, const Value& obj, const std::string& name);

}  // namespace kvbridge::jinja

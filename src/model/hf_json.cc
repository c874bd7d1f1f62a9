// JSON reading with paths for the Hugging Face tokenizer kind: every error names the file and
// the JSON path of the field ("tokenizer.json: model.merges[3]: expected a string").
#include "model/hf_internal.h"

namespace kvbridge::model_internal::hf {

Status JsonCtx::Invalid(const std::string& path, const std::string& what) const {
  return InvalidArgumentError(std::string(source) + ": " + path + ": " + what);
}

Status JsonCtx::Unsupported(const std::string& path, const std::string& what) const {
  return UnimplementedError(std::string(source) + ": " + path + " " + what);
}

namespace {
std::string Join(const std::string& path, const char* key) {
  return path.empty() ? std::string(key) : path + "." + key;
}
}  // namespace

Result<const Json*> Field(const JsonCtx& ctx, const Json& obj, const std::string& path,
                          const char* key) {
  if (!obj.is_object()) return ctx.Invalid(path.empty() ? "(top)" : path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end()) return ctx.Invalid(Join(path, key), "missing");
  return &*it;
}

Result<std::string> StringField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                                const char* key) {
  ASSIGN_OR_RETURN(const Json* v, Field(ctx, obj, path, key));
  if (!v->is_string()) return ctx.Invalid(Join(path, key), "expected a string");
  return v->get<std::string>();
}

Result<std::string> OptStringField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                                   const char* key, std::string fallback) {
  if (!obj.is_object()) return ctx.Invalid(path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_string()) return ctx.Invalid(Join(path, key), "expected a string");
  return it->get<std::string>();
}

Result<bool> OptBoolField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                          const char* key, bool fallback) {
  if (!obj.is_object()) return ctx.Invalid(path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_boolean()) return ctx.Invalid(Join(path, key), "expected true or false");
  return it->get<bool>();
}

Result<int64_t> OptIntField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                            const char* key, int64_t fallback) {
  if (!obj.is_object()) return ctx.Invalid(path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_number_integer()) return ctx.Invalid(Join(path, key), "expected an integer");
  return it->get<int64_t>();
}

Result<std::string> TypeField(const JsonCtx& ctx, const Json& obj, const std::string& path) {
  return StringField(ctx, obj, path, "type");
}

Result<Pattern> PatternField(const JsonCtx& ctx, const Json& obj, const std::string& path) {
  ASSIGN_OR_RETURN(const Json* p, Field(ctx, obj, path, "pattern"));
  const std::string ppath = Join(path, "pattern");
  if (!p->is_object() || p->size() != 1) {
    return ctx.Invalid(ppath, "expected {\"String\": ...} or {\"Regex\": ...}");
  }
  Pattern out;
  if (p->contains("String")) {
    ASSIGN_OR_RETURN(out.literal, StringField(ctx, *p, ppath, "String"));
    return out;
  }
  if (p->contains("Regex")) {
    ASSIGN_OR_RETURN(std::string re, StringField(ctx, *p, ppath, "Regex"));
    auto compiled = Regex::Compile(re, Regex::Syntax::kOniguruma);
    if (!compiled.ok()) {
      const Status& st = compiled.status();
      if (st.code() == StatusCode::kUnimplemented) {
        return ctx.Unsupported(ppath + ".Regex", "is not supported: " + st.message());
      }
      return ctx.Invalid(ppath + ".Regex", st.message());
    }
    out.regex = std::move(*compiled);
    return out;
  }
  return ctx.Invalid(ppath, "expected {\"String\": ...} or {\"Regex\": ...}");
}

Result<char32_t> CharField(const JsonCtx& ctx, const Json& obj, const std::string& path,
                           const char* key, char32_t fallback) {
  if (!obj.is_object()) return ctx.Invalid(path, "expected an object");
  auto it = obj.find(key);
  if (it == obj.end() || it->is_null()) return fallback;
  if (!it->is_string()) return ctx.Invalid(Join(path, key), "expected a one-character string");
  const std::string s = it->get<std::string>();
  if (s.empty() || !IsValidUtf8(s)) {
    return ctx.Invalid(Join(path, key), "expected a one-character string");
  }
  int len = 0;
  const char32_t c = DecodeUtf8(s, 0, &len);
  if (static_cast<size_t>(len) != s.size()) {
    return ctx.Invalid(Join(path, key), "expected a one-character string");
  }
  return c;
}

void Pattern::FindAll(std::string_view text, std::vector<std::pair<size_t, size_t>>* out) const {
  if (regex) {
    regex->FindAll(text, out);
    return;
  }
  if (literal.empty()) return;
  size_t pos = 0;
  while (true) {
    const size_t at = text.find(literal, pos);
    if (at == std::string_view::npos) break;
    out->emplace_back(at, at + literal.size());
    pos = at + literal.size();
  }
}

std::string ReplaceAll(const Pattern& pattern, std::string_view s, std::string_view content) {
  std::vector<std::pair<size_t, size_t>> matches;
  pattern.FindAll(s, &matches);
  if (matches.empty()) return std::string(s);
  std::string out;
  out.reserve(s.size() + matches.size() * content.size());
  size_t last = 0;
  for (auto [a, b] : matches) {
    out.append(s.substr(last, a - last));
    out.append(content);
    last = b;
  }
  out.append(s.substr(last));
  return out;
}

}  // namespace kvbridge::model_internal::hf

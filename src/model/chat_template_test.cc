// ChatTemplate against Python Jinja2 set up as transformers sets it up
// (tests/tools/jinja_render.py, run here with python3): every case is rendered by both and
// must agree byte for byte, or both must fail. The reference needs python3 with jinja2
// (Debian python3-jinja2, in scripts/install-deps.sh): without it these tests FAIL.
#include "kvbridge/model/chat_template.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <sstream>
#include <string>
#include <vector>

namespace kvbridge {
namespace {

using Json = nlohmann::ordered_json;
namespace fs = std::filesystem;

std::string SourceDir() {
  if (const char* s = std::getenv("KVBRIDGE_SOURCE_DIR")) return s;
  return fs::path(__FILE__).parent_path().parent_path().parent_path().string();
}

// The fixed clock of strftime_now: 2024-07-23 14:05:09 (a Tuesday).
constexpr const char* kNowIso = "2024-07-23T14:05:09";
std::tm FixedNow() {
  std::tm tm{};
  tm.tm_year = 124;
  tm.tm_mon = 6;
  tm.tm_mday = 23;
  tm.tm_hour = 14;
  tm.tm_min = 5;
  tm.tm_sec = 9;
  std::time_t t = timegm(&tm);
  std::tm out{};
  gmtime_r(&t, &out);
  return out;
}

struct Case {
  std::string name;
  std::string source;
  Json context;
};

struct Outcome {
  bool ok = false;
  std::string text;  // the render, or the error message
};

std::string Shell(const std::string& cmd, int* status) {
  std::string out;
  FILE* p = popen(cmd.c_str(), "r");
  if (p == nullptr) {
    *status = -1;
    return out;
  }
  char buf[65536];
  size_t n;
  while ((n = fread(buf, 1, sizeof(buf), p)) > 0) out.append(buf, n);
  *status = pclose(p);
  return out;
}

// Renders every case with Python Jinja2; fails the test when python3 or jinja2 is missing.
std::vector<Outcome> ReferenceRender(const std::vector<Case>& cases) {
  Json in = Json::array();
  for (const Case& c : cases)
    in.push_back({{"template", c.source}, {"context", c.context}, {"now", kNowIso}});
  const fs::path dir = fs::temp_directory_path() / ("kvb_jinja_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  const fs::path input = dir / "cases.json";
  std::ofstream(input) << in.dump();
  const std::string script = SourceDir() + "/tests/tools/jinja_render.py";
  int status = 0;
  std::string out = Shell("python3 '" + script + "' < '" + input.string() + "' 2>&1", &status);
  fs::remove_all(dir);
  std::vector<Outcome> results;
  if (status != 0) {
    ADD_FAILURE() << "the reference renderer (python3 " << script
                  << ", needs Debian python3-jinja2) failed: " << out;
    return results;
  }
  Json parsed = Json::parse(out);
  for (const auto& r : parsed) {
    Outcome o;
    o.ok = r["ok"].get<bool>();
    o.text = o.ok ? r["text"].get<std::string>()
                  : r["type"].get<std::string>() + ": " + r["error"].get<std::string>();
    results.push_back(o);
  }
  return results;
}

Outcome OurRender(const Case& c) {
  Outcome o;
  Result<ChatTemplate> t = ChatTemplate::Parse(c.source, c.name);
  if (!t.ok()) {
    o.text = t.status().ToString();
    return o;
  }
  ChatTemplateRenderOptions options;
  options.now = FixedNow();
  Result<std::string> r = t->Render(c.context, options);
  if (!r.ok()) {
    o.text = r.status().ToString();
    return o;
  }
  o.ok = true;
  o.text = *r;
  return o;
}

// Every case renders equal to the reference, or both fail; a template's raise_exception
// message must be the same text.
void ExpectSameAsReference(const std::vector<Case>& cases) {
  std::vector<Outcome> ref = ReferenceRender(cases);
  ASSERT_EQ(ref.size(), cases.size());
  for (size_t i = 0; i < cases.size(); ++i) {
    const Outcome ours = OurRender(cases[i]);
    SCOPED_TRACE("case " + cases[i].name + ": " + cases[i].source.substr(0, 300));
    EXPECT_EQ(ours.ok, ref[i].ok) << "ours: " << ours.text << "\nreference: " << ref[i].text;
    if (ours.ok && ref[i].ok) {
      EXPECT_EQ(ours.text, ref[i].text);
    }
    if (!ref[i].ok && ref[i].text.rfind("TemplateError: ", 0) == 0) {
      EXPECT_EQ(ours.text, "INVALID_ARGUMENT: " + std::string(kChatTemplateRejectionPrefix) +
                               ref[i].text.substr(std::string("TemplateError: ").size()));
    }
  }
}

Json SuiteContext() {
  return Json::parse(R"({
    "x": {"k": "v", "n": 1},
    "d": {"items": 5},
    "users": [{"name": "bob", "age": 40, "admin": true},
              {"name": "al", "age": 25, "admin": false},
              {"name": "Cy", "age": 33, "admin": true}],
    "msgs": [{"role": "user"}, {"role": "assistant"}, {"role": "system"}],
    "data": {"a": [1, 2.0, "é", "\"q\"", null, true], "b": {"c": "<>&'", "e": []}, "f": {}},
    "text": "  Hello\n  World  ",
    "name": "Ann"
  })");
}

// One small template per construct (issue 17's list and what real templates use).
std::vector<Case> InterpreterSuite() {
  const char* kTemplates[][2] = {
      // printing of values
      {"ints_floats",
       "{{ 1 }} {{ 1.0 }} {{ 1.5e3 }} {{ 1e20 }} {{ 1e16 }} {{ 1e15 }} {{ 0.1 + 0.2 }} {{ 1/3 }} "
       "{{ 10/2 }} {{ 2**0.5 }} {{ -0.0 }} {{ 1e-7 }} {{ 0.0001 }} {{ 123456789.123 }} {{ 1_000 }} "
       "{{ 0x1f }} {{ 0o17 }} {{ 0b101 }}"},
      {"consts", "{{ true }} {{ True }} {{ none }} {{ None }} {{ false }} {{ False }}"},
      {"list_repr", "{{ [1, 'a', \"b'c\", 'd\"e', none, true, 1.5, [], {}] }}"},
      {"dict_repr", "{{ {'a': 1, 'b': [1, 2], 'c': {'d': none}} }} {{ data }}"},
      {"tuple_repr", "{{ (1,) }} {{ (1, 2) }} {{ () }} {{ 1, 2 }}"},
      {"repr_escapes", "{{ ['a\\nb', 'é', '\\x01', 'tab\\t', 'back\\\\slash', '\\u00a0', '😀'] }}"},
      {"string_escapes",
       "{{ 'a\\nb\\tc\\\\d\\'e' }}|{{ \"\\u00e9\\x41\\101\\q\" }}|{{ 'con' 'cat' }}"},
      {"quotes", "{{ \"it's\" }} {{ 'say \"hi\"' }} {{ [\"it's\", 'say \"hi\"', 'both \\' \"'] }}"},
      // arithmetic and operators
      {"arith",
       "{{ 7 // 2 }} {{ -7 // 2 }} {{ 7 % 3 }} {{ -7 % 3 }} {{ 7 % -3 }} {{ 7.5 // 2 }} {{ -7.5 % "
       "2 }} {{ 2 ** 10 }} {{ 2 ** -1 }} {{ 2 ** 3 ** 2 }} {{ 1 + 2 * 3 - 4 / 2 }} {{ (1 + 2) * 3 "
       "}} {{ -2 ** 2 }} {{ 10 - 3 - 2 }} {{ 1 + true }} {{ 5 % 2.5 }} {{ -1 | abs }}"},
      {"seq_ops",
       "{{ 'ab' * 3 }} {{ [1] * 3 }} {{ 3 * 'x' }} {{ 'a' + 'b' }} {{ [1] + [2] }} {{ 1 ~ 2 ~ 'x' "
       "~ none ~ true ~ [1] }} {{ 'x' * 0 }} {{ (1,) + (2,) }}"},
      {"compare",
       "{{ 1 == 1.0 }} {{ 1 != 2 }} {{ 'a' < 'b' }} {{ [1,2] < [1,3] }} {{ 1 < 2 < 3 }} {{ 3 > 2 > "
       "2 }} {{ 2 >= 2 }} {{ 'b' <= 'a' }} {{ none == none }} {{ [1] == [1] }} {{ {'a':1} == "
       "{'a':1} }} {{ [1] == (1,) }} {{ 1 == true }} {{ 'a' == 1 }}"},
      {"in",
       "{{ 'a' in 'cat' }} {{ 1 in [1,2] }} {{ 'k' in {'k':1} }} {{ 3 not in [1] }} {{ 'x' not in "
       "'y' }} {{ 'k' in x }} {{ 'v' in x }} {{ '' in 'abc' }}"},
      {"logic",
       "{{ 1 and 2 }} {{ 0 and 2 }} {{ 0 or 'x' }} {{ '' or [] }} {{ not 0 }} {{ not [] }} {{ not "
       "'a' }} {{ none or 'd' }} {{ not 1 == 2 }} {{ 1 if not x else 2 }}"},
      {"condexpr",
       "{{ 'y' if 1 else 'n' }} {{ 'y' if 0 else 'n' }} [{{ 'y' if 0 }}] {{ 'a' if 0 else 'b' if 1 "
       "else 'c' }}"},
      // control flow
      {"if_elif",
       "{% for n in [1, 2, 3, 4] %}{% if n == 1 %}one{% elif n == 2 %}two{% elif n == 3 %}three{% "
       "else %}many{% endif %},{% endfor %}"},
      {"loop_vars",
       "{% for x in ['a','b','c'] %}{{ loop.index }}{{ loop.index0 }}{{ loop.revindex }}{{ "
       "loop.revindex0 }}{{ loop.first }}{{ loop.last }}{{ loop.length }}{{ loop.previtem }}{{ "
       "loop.nextitem }}{{ loop.depth }}{{ loop.depth0 }}|{% endfor %}"},
      {"for_else",
       "{% for x in [] %}x{% else %}empty{% endfor %}{% for x in [1] %}{{ x }}{% else %}no{% "
       "endfor %}"},
      {"for_if",
       "{% for x in range(10) if x is odd %}{{ x }}:{{ loop.index }}/{{ loop.length }}{{ ',' if "
       "not loop.last }}{% endfor %}"},
      {"for_if_else", "{% for x in [1, 3] if x is even %}{{ x }}{% else %}none even{% endfor %}"},
      {"break_continue",
       "{% for x in range(10) %}{% if x == 7 %}{% break %}{% endif %}{% if x is even %}{% continue "
       "%}{% endif %}{{ x }}{% endfor %}"},
      {"nested_loops",
       "{% for a in [1,2] %}{% for b in [3,4] %}{{ loop.index }}{{ a }}{{ b }} {% endfor %}{{ "
       "loop.index }};{% endfor %}"},
      {"dict_iter",
       "{% for k in {'b':1,'a':2} %}{{ k }}{% endfor %} {% for k, v in {'b':1,'a':2}.items() %}{{ "
       "k }}={{ v }};{% endfor %} {% for k, v in x | items %}{{ k }}:{{ v }} {% endfor %}"},
      {"string_iter", "{% for c in 'héllo' %}[{{ c }}]{% endfor %}"},
      {"loop_cycle", "{% for x in range(5) %}{{ loop.cycle('a','b','c') }}{% endfor %}"},
      {"loop_changed",
       "{% for x in [1, 1, 2, 2, 1] %}{% if loop.changed(x) %}{{ x }}{% endif %}{% endfor %}"},
      {"recursive_loop",
       "{% for item in [{'n': 'a', 'c': [{'n': 'b', 'c': [{'n': 'c'}]}, {'n': 'd'}]}, {'n': 'e'}] "
       "recursive %}{{ loop.depth }}{{ loop.depth0 }}{{ item.n }}{% if item.c %}[{{ loop(item.c) "
       "}}]{% endif %}{{ loop.index }}{% endfor %}"},
      {"recursive_loop_filter",
       "{% for x in [[1, [2, 3]], 4, []] recursive if x != 2 %}{% if x is iterable %}({{ loop(x) "
       "}}){% else %}{{ x }}{% endif %}{% else %}-{% endfor %}"},
      {"unpack",
       "{% for a, b in [[1,2],[3,4]] %}{{ a }}{{ b }}{% endfor %}{% for (a, b) in [(5, 6)] %}{{ a "
       "+ b }}{% endfor %}"},
      {"set_scoping",
       "{% set x = 1 %}{% for i in [1,2] %}{% set x = x + i %}{{x}},{% endfor %}{{x}}"},
      {"if_no_scope", "{% if true %}{% set y = 5 %}{% endif %}{{ y }}"},
      {"namespace",
       "{% set ns = namespace(count=0, items=[]) %}{% for x in [1,2,3] %}{% set ns.count = "
       "ns.count + x %}{% set ns.items = ns.items + [x * 2] %}{% endfor %}{{ ns.count }} {{ "
       "ns.items }} {{ ns.missing is defined }} {{ ns['count'] }}"},
      {"namespace_print", "{{ namespace(a=1, b='x') }}"},
      {"set_block", "{% set greeting %}Hello {{ name }}!{% endset %}[{{ greeting }}]"},
      {"set_block_filter", "{% set s | upper | replace('B', 'x') %}abc{% endset %}{{ s }}"},
      {"set_tuple", "{% set a, b = 1, 2 %}{{ a }}{{ b }}{% set t = 1, 2 %}{{ t }}"},
      {"macro",
       "{% macro greet(name, punct='!') %}Hi {{ name }}{{ punct }}{% endmacro %}{{ greet('A') }} "
       "{{ greet('B', '?') }} {{ greet(punct='.', name='C') }}"},
      {"macro_caller",
       "{% macro wrap(tag) %}<{{ tag }}>{{ caller() }}</{{ tag }}>{% endmacro %}{% call wrap('b') "
       "%}bold {{ 1 + 1 }}{% endcall %}"},
      {"call_args",
       "{% macro each(items) %}{% for i in items %}{{ caller(i) }}{% endfor %}{% endmacro %}{% "
       "call(x) each([1,2]) %}[{{ x }}]{% endcall %}"},
      {"macro_varargs",
       "{% macro m(a) %}{{ a }}{{ varargs }}{{ kwargs }}{% endmacro %}{{ m(1, 2, 3, k=4) }}"},
      {"macro_recursive",
       "{% macro fact(n) %}{% if n <= 1 %}1{% else %}{{ n * fact(n - 1)|int }}{% endif %}{% "
       "endmacro %}{{ fact(6) }}"},
      {"macro_missing_arg",
       "{% macro m(a, b) %}{{ a }}|{{ b }}|{{ b is defined }}{% endmacro %}{{ m(1) }}"},
      {"macro_sees_globals",
       "{% set v = 1 %}{% macro m() %}{{ v }}{{ name }}{% endmacro %}{% set v = 2 %}{{ m() }}"},
      {"with", "{% with a = 1, b = 2 %}{{ a + b }}{% endwith %}{{ a is defined }}"},
      {"filter_block", "{% filter upper %}hello {{ 'x' }}{% endfilter %}"},
      {"raw", "{% raw %}{{ not rendered }}{% if %}{% endraw %}"},
      {"comments", "a{# comment #}b{#- strip -#}  c {# multi\nline #}d"},
      {"generation", "{% generation %}gen {{ 1 }}{% endgeneration %}"},
      // whitespace control
      {"trim_lstrip",
       "<ul>\n    {% for x in [1,2] %}\n    <li>{{ x }}</li>\n    {% endfor %}\n</ul>\n"},
      {"dash_blocks", "a  \n  {%- if true -%}  \n  b  \n  {%- endif -%}  \n  c"},
      {"dash_vars", "a   {{- 'x' -}}   b {{ 'y' }}  \n{{- 'z' }}"},
      {"plus_lstrip", "  {%+ if true %}x{% endif %}\n  {% if true %}y{% endif %}"},
      {"plus_trim", "{% if true +%}\nkeep{% endif %}"},
      {"comment_lstrip", "  {# c #}\nx\n  {#- d #}y"},
      {"trailing_newline", "abc\n"},
      {"trailing_newlines", "abc\n\n"},
      {"crlf", "a\r\nb\rc{% if true %}\r\nd{% endif %}"},
      {"lstrip_mid_line", "x  {% if true %}y{% endif %}  {{ 'z' }}"},
      {"var_no_lstrip", "  {{ 'v' }}\n  {{ 'w' }}"},
      {"var_newlines", "{{ 1 }}\n{{ 2 }}\n"},
      {"qwen_style",
       "{%- if true %}\n    {{- 'a' }}\n    {%- if false %}\n        {{- 'b' }}\n    {%- endif "
       "%}\n{%- endif %}\n{{- 'c' }}\n"},
      {"raw_ws", "  {% raw %}  x  {% endraw %}\ny  {%- raw -%}  z  {%- endraw -%}  w"},
      // tests
      {"tests",
       "{{ x is defined }} {{ y is undefined }} {{ none is none }} {{ 'a' is string }} {{ {} is "
       "mapping }} {{ [] is iterable }} {{ 'a' is iterable }} {{ 1 is number }} {{ 1.0 is number "
       "}} {{ true is number }} {{ 1 is integer }} {{ true is integer }} {{ 1.0 is float }} {{ [] "
       "is sequence }} {{ {} is sequence }} {{ true is true }} {{ 1 is true }} {{ false is false "
       "}} {{ true is boolean }} {{ 1 is boolean }} {{ 3 is odd }} {{ 4 is even }} {{ 9 is "
       "divisibleby 3 }} {{ 9 is divisibleby(2) }} {{ 1 is eq 1 }} {{ 1 is equalto 2 }} {{ 2 is gt "
       "1 }} {{ 2 is lt 1 }} {{ 2 is ge 2 }} {{ 2 is le 1 }} {{ 2 is ne 2 }} {{ 1 is in [1] }} {{ "
       "'abc' is lower }} {{ 'ABC' is upper }} {{ none is sameas none }} {{ x is not none }} {{ "
       "range is callable }} {{ 'upper' is filter }} {{ 'odd' is test }} {{ u is mapping }} {{ u "
       "is iterable }} {{ x is mapping }} {{ 1 is string }} {{ 'a' is not string }} {{ 2 is == 2 "
       "}} {{ 3 is >= 4 }}"},
      // filters
      {"trim",
       "[{{ '  a b \\n' | trim }}] [{{ 'xxaxx' | trim('x') }}] [{{ u | trim }}] [{{ text | trim "
       "}}] [{{ '\\u3000x\\u00a0' | trim }}]"},
      {"tojson", "{{ data | tojson }}"},
      {"tojson_indent",
       "{{ data | tojson(indent=2) }}|{{ [] | tojson(indent=2) }}|{{ {} | tojson(indent=4) }}|{{ "
       "[1, [2]] | tojson(indent=0) }}"},
      {"tojson_opts",
       "{{ 'é😀' | tojson(ensure_ascii=True) }} {{ data | tojson(sort_keys=true) }} {{ data | "
       "tojson(separators=(',', ':')) }} {{ '\\u0001\\n\\t\\u007f\\b\\f' | tojson }} {{ 1.0 | "
       "tojson }} {{ (1,2) | tojson }} {{ none | tojson }} {{ 'x' | tojson(indent='\\t') }} {{ "
       "{'a': {'b': 1}} | tojson(indent='--') }}"},
      {"length",
       "{{ 'héllo' | length }} {{ [1,2] | count }} {{ {'a':1} | length }} {{ u | length }} {{ "
       "users | length }}"},
      {"first_last",
       "{{ [1,2,3] | first }} {{ [1,2,3] | last }} {{ 'abc' | first }} {{ 'abc' | last }} [{{ [] | "
       "first }}] {{ {'a':1,'b':2} | first }} {{ users | first }}"},
      {"join",
       "{{ [1,2,3] | join(', ') }} {{ ['a','b'] | join }} {{ users | join(', ', attribute='name') "
       "}} {{ [[1], none] | join('|') }}"},
      {"default",
       "{{ u | default('d') }} [{{ '' | default('d') }}] {{ '' | default('d', true) }} {{ 0 | "
       "d('z', boolean=true) }} {{ none | default('n') }} {{ x | default('no') }} {{ x.zz | "
       "default('zz') }} [{{ u | default }}]"},
      {"map",
       "{{ users | map(attribute='name') | join(',') }} {{ ['a','b'] | map('upper') | list }} {{ "
       "users | map(attribute='missing', default='?') | list }} {{ [1.5, 2.7] | map('int') | list "
       "}} {{ ['a','b'] | map('replace', 'a', 'z') | list }} {{ users | map(attribute='name') | "
       "map('title') | join }}"},
      {"select",
       "{{ range(10) | select('odd') | list }} {{ range(10) | reject('odd') | list }} {{ [0, 1, "
       "'', 'a', none] | select | list }} {{ users | selectattr('admin') | map(attribute='name') | "
       "list }} {{ users | rejectattr('admin') | map(attribute='name') | list }} {{ users | "
       "selectattr('age', 'gt', 30) | map(attribute='name') | list }} {{ users | "
       "selectattr('name', 'equalto', 'bob') | list | length }} {{ msgs | selectattr('role', 'in', "
       "['user', 'system']) | list | length }} {{ range(10) | select('divisibleby', 3) | list }} "
       "{{ msgs | selectattr('content', 'defined') | list }} {{ msgs | rejectattr('content') | "
       "list | length }}"},
      {"conversions",
       "{{ 'abc' | list }} {{ {'a':1} | list }} {{ 12 | string }} {{ [1] | string }} {{ '42' | int "
       "}} {{ '4.7' | int }} {{ 'x' | int }} {{ 'x' | int(7) }} {{ 3.9 | int }} {{ -3.9 | int }} "
       "{{ '0x1A' | int(0, 16) }} {{ '3.5' | float }} {{ 'x' | float }} {{ 2 | float }} {{ true | "
       "int }} {{ ' 12 ' | int }} {{ '1_000' | int }} {{ '1e3' | float }} {{ none | int }} {{ '' | "
       "float(1.5) }} {{ none | string }}"},
      {"case",
       "{{ 'hello WORLD' | upper }} {{ 'Hello' | lower }} {{ 'hello world' | capitalize }} {{ "
       "\"hello wORLD it's-me (x) [y] <z>\" | title }} {{ 'ÉCOLE straße Ωμέγα' | lower }} {{ "
       "'straße éa' | upper }} {{ 'ÀB' | capitalize }}"},
      {"replace",
       "{{ 'aaa' | replace('a', 'b') }} {{ 'aaa' | replace('a', 'b', 2) }} {{ 'abc' | replace('', "
       "'-') }} {{ 'héé' | replace('é', 'e') }} {{ 5 | replace('5', 'five') }}"},
      {"safe_escape",
       "{{ '<b>' | safe }} {{ '<a href=\"x\">&\\'' | e }} {{ '<>' | escape }} {{ 5 | e }}"},
      {"unique",
       "{{ [1, 2, 1, 3, 2] | unique | list }} {{ ['a', 'A', 'b'] | unique | list }} {{ ['a', 'A', "
       "'b'] | unique(case_sensitive=true) | list }} {{ users | unique(attribute='admin') | "
       "map(attribute='name') | list }}"},
      {"reverse",
       "{{ [1,2,3] | reverse | list }} {{ 'abcé' | reverse }} {{ {'a': 1, 'b': 2} | reverse | list "
       "}}"},
      {"sort",
       "{{ [3,1,2] | sort }} {{ ['b','A','c'] | sort }} {{ ['b','A','c'] | "
       "sort(case_sensitive=true) }} {{ [3,1,2] | sort(reverse=true) }} {{ users | "
       "sort(attribute='age') | map(attribute='name') | join(',') }} {{ users | "
       "sort(attribute='admin,name') | map(attribute='name') | join(',') }} {{ [[2, 'b'], [1, "
       "'z'], [2, 'a']] | sort }}"},
      {"dictsort",
       "{{ {'b':1,'a':2,'C':0} | dictsort }} {{ {'b':1,'a':2} | dictsort(by='value') }} {{ "
       "{'b':1,'a':2} | dictsort(reverse=true) }} {{ {'b':1,'a':2,'C':0} | dictsort(true) }}"},
      {"abs_round",
       "{{ -3 | abs }} {{ -2.5 | abs }} {{ 2.5 | round }} {{ 3.5 | round }} {{ 2.675 | round(2) }} "
       "{{ 0.125 | round(2) }} {{ 2.1 | round(0, 'ceil') }} {{ 2.9 | round(method='floor') }} {{ "
       "1234 | round(-2) }} {{ 7 | round }} {{ 1250.0 | round(-2) }} {{ -0.5 | round }}"},
      {"wordcount", "{{ \"hello big world, yes_no it's 42\" | wordcount }} {{ '' | wordcount }}"},
      {"indent",
       "{{ 'a\\nb\\n\\nc' | indent }}|{{ 'a\\nb' | indent(2, true) }}|{{ 'a\\n\\nb' | indent(2, "
       "blank=true) }}|{{ 'x\\ny' | indent('> ') }}|{{ 'x\\n' | indent }}|{{ '' | "
       "indent(first=true) }}"},
      {"center", "[{{ 'ab' | center(7) }}] [{{ 'abc' | center(8) }}] [{{ 'abc' | center(2) }}]"},
      {"sum_min_max",
       "{{ [1,2,3] | sum }} {{ users | sum(attribute='age') }} {{ [3,1,2] | min }} {{ ['b','A'] | "
       "max }} {{ users | max(attribute='age') }} {{ [1.5, 2] | sum(start=10) }} [{{ [] | max }}]"},
      {"batch", "{{ [1,2,3,4,5] | batch(2) | list }} {{ [1,2,3] | batch(2, 'x') | list }}"},
      {"format",
       "{{ '%s-%d-%.2f-%5s-%-5s|%x|%05.1f' | format('a', 3, 1.234, 'r', 'l', 255, 3.14159) }} {{ "
       "'%s' % 'x' }} {{ '%s and %s' % (1, 2) }} {{ '%(a)s!' % {'a': 5} }} {{ '%r %s' % ('q', "
       "none) }} {{ '100%%' % () }}"},
      {"attr_filter",
       "[{{ x | attr('k') }}] {{ (x | attr('keys'))() | list }} {{ ns is defined }}"},
      // string methods
      {"str_methods",
       "{{ 'abc'.startswith('a') }} {{ 'abc'.endswith(('x', 'c')) }} {{ 'a,b,,c'.split(',') }} {{ "
       "' a  b '.split() }} {{ 'a b c'.split(' ', 1) }} {{ 'a b c'.rsplit(' ', 1) }} {{ 'a  b c "
       "'.rsplit(none, 1) }} {{ '  x  '.strip() }} {{ 'xxyxx'.strip('x') }} {{ "
       "'\\n\\nx\\n'.lstrip('\\n') }} [{{ 'x  '.rstrip() }}] {{ 'aXbX'.replace('X', '-') }} {{ "
       "'aXbX'.replace('X', '-', 1) }} {{ 'hi'.upper() }} {{ 'HI'.lower() }}"},
      {"str_methods2",
       "{{ \"they're bill's 1st\".title() }} {{ 'hELLO wORLD'.capitalize() }} {{ 'hello'.find('l') "
       "}} {{ 'hello'.rfind('l') }} {{ 'hello'.find('z') }} {{ 'héllo'.find('l') }} {{ "
       "'hello'.count('l') }} {{ 'hello'.index('e') }} {{ '-'.join(['a', 'b']) }} {{ "
       "'12'.isdigit() }} {{ 'ab'.isalpha() }} {{ ' '.isspace() }} {{ "
       "'a\\nb\\r\\nc\\n'.splitlines() }} {{ 'ab'.center(6, '*') }} {{ '5'.zfill(3) }} {{ "
       "'Hello'.swapcase() }} {{ 'abc'.removeprefix('a') }} {{ 'a=b=c'.partition('=') }} {{ "
       "'ab'.ljust(4, '.') }}{{ 'ab'.rjust(4) }} {{ 'Ab1'.isalnum() }} {{ 'AB'.isupper() }} {{ "
       "'ab'.islower() }}"},
      {"str_format",
       "{{ '{} is {}'.format('a', 1) }} {{ '{0}{1}{0}'.format('x', 'y') }} {{ "
       "'{name}!'.format(name='n') }} {{ '{{}} {0!r}'.format('q') }} {{ '{0[k]} {1.k}'.format(x, "
       "x) }}"},
      {"content_split",
       "{% set c = '<think>\\nreason\\n</think>\\n\\nanswer' %}{{ "
       "c.split('</think>')[-1].lstrip('\\n') }}|{{ "
       "c.split('</think>')[0].rstrip('\\n').split('<think>')[-1].lstrip('\\n') }}"},
      // subscripts and slices
      {"slices",
       "{{ 'abc'[1] }} {{ 'abc'[-1] }} {{ 'abcdef'[1:4] }} {{ 'abcdef'[::-1] }} {{ 'abcdef'[::2] "
       "}} {{ 'abcdef'[-3:] }} {{ 'abcdef'[:-2] }} {{ [1,2,3,4,5][1:-1] }} {{ [1,2,3,4,5][::-2] }} "
       "{{ [1,2,3][5:] }} {{ [1,2,3][-10:2] }} {{ 'héllo'[1:3] }} {{ [1,2,3][-1] }} {{ [1,2,3][3] "
       "is defined }} {{ (1,2,3)[1:] }} {{ [1,2,3,4][3:0:-1] }} {{ users[0].name }} {{ "
       "users[-1]['age'] }} {{ msgs[::-1] | map(attribute='role') | join(',') }} {{ users.0.name "
       "}} {{ [1,2,3][1:] + [9] }}"},
      // dicts
      {"dict_methods",
       "{{ x.keys() | list }} {{ x.values() | list }} {{ x.items() | list }} {{ x.get('k') }} {{ "
       "x.get('zz') }} {{ x.get('zz', 'dflt') }} {{ x['k'] }} {{ x.k }} {{ x.zz is defined }} {{ "
       "x['zz'] is defined }} {{ d.items is defined }} {{ d['items'] }} {{ dict(a=1, b='x') }} {{ "
       "dict(x, z=2) }} {{ {'a': 1, 'a': 2} }} {{ {1: 'one', none: 'n'} }}"},
      // globals
      {"range",
       "{{ range(3) | list }} {{ range(1, 10, 3) | list }} {{ range(5, 0, -2) | list }} {{ "
       "range(0) | list }} {{ range(-3) | list }}"},
      {"strftime", "{{ strftime_now('%Y-%m-%d %H:%M:%S|%d %b %Y|%A %B %j|%I %p|%e|%y') }}"},
      // Undefined
      {"undefined_soft",
       "[{{ u }}] {{ u is defined }} {{ u | length }} {{ not u }} {{ u ~ 'x' }} {{ u == u }} {{ u "
       "== none }} {{ u | default('d') }} {% for i in u %}no{% else %}empty{% endfor %} {{ u | "
       "list }} {{ 'a' in u }} {% if u %}t{% else %}f{% endif %} [{{ x.missing }}] {{ x.missing is "
       "defined }} [{{ none.x }}] {{ u | string }} [{{ u | upper }}] {{ u | items | list }} {{ u | "
       "join(',') }} [{{ u | first }}] {{ u is sequence }}"},
      // errors (both must fail)
      {"err_undefined_attr", "{{ u.attr }}"},
      {"err_undefined_add", "{{ u + 1 }}"},
      {"err_undefined_tojson", "{{ u | tojson }}"},
      {"err_nested_undefined", "{{ x.missing.deeper }}"},
      {"err_type_add", "{{ 1 + 'a' }}"},
      {"err_append", "{% set l = [1] %}{{ l.append(2) }}"},
      {"err_dict_update", "{{ x.update({'a': 1}) }}"},
      {"err_div_zero", "{{ 1 / 0 }}"},
      {"err_mod_zero", "{{ 1 % 0 }}"},
      {"err_big_range", "{{ range(200000) | length }}"},
      {"err_order", "{{ 'a' < 1 }}"},
      {"err_not_iterable", "{% for x in 1 %}{% endfor %}"},
      {"err_call_undefined", "{{ u() }}"},
      {"err_unpack", "{% for a, b in [[1, 2, 3]] %}{% endfor %}"},
      {"err_ns_assign", "{% set x.k = 1 %}"},
      {"err_raise",
       "{% if u is not defined %}{{ raise_exception('u is required: ' ~ 'really') }}{% endif %}"},
      {"err_raise_in_macro",
       "{% macro check(m) %}{% if m.role not in ['user', 'assistant'] %}{{ raise_exception('Only "
       "user and assistant roles are supported!') }}{% endif %}{% endmacro %}{% for m in msgs %}{{ "
       "check(m) }}{% endfor %}"},
      {"err_macro_args", "{% macro m(a) %}{% endmacro %}{{ m(1, 2) }}"},
      {"err_str_int_concat", "{{ 'a' + 1 }}"},
      {"err_split_empty", "{{ 'a'.split('') }}"},
      {"err_items_non_mapping", "{{ [1] | items | list }}"},
      // ('inf' | int is the default since Jinja2 3.1.5, an OverflowError in Debian 12's 3.1.2)
      {"int_inf", "{{ 'nan' | int(5) }} {{ '-1e400' | float }}"},
      {"err_int_float_inf", "{{ ('inf' | float) | int }}"},
      // syntax errors
      {"syn_no_endif", "{% if x %}\nabc\n"},
      {"syn_bad_expr", "line1\n{{ 1 + }}"},
      {"syn_stray_endfor", "{% endfor %}"},
      {"syn_unknown_tag", "{% foo %}"},
      {"syn_unknown_filter", "{{ x | nofilter }}"},
      {"syn_unknown_test", "{{ x is notatest }}"},
      {"syn_for", "{% for %}{% endfor %}"},
      {"syn_comment", "{# x"},
      {"syn_string", "{{ 'abc }}"},
      {"syn_paren", "{{ (1 }}"},
      {"syn_bracket", "{{ [1, 2) }}"},
      {"syn_set", "{% set %}"},
      {"syn_break_outside", "{% break %}"},
      {"syn_chained_is", "{{ 1 is odd is even }}"},
      {"syn_else_twice", "{% if 1 %}{% else %}{% else %}{% endif %}"},
      {"syn_raw", "{% raw %}abc"},
      {"syn_const_assign", "{% set true = 1 %}"},
  };
  std::vector<Case> cases;
  const Json base = SuiteContext();
  for (const auto& t : kTemplates) cases.push_back({t[0], t[1], base});
  return cases;
}

TEST(ChatTemplate, InterpreterSuiteMatchesJinja2) { ExpectSameAsReference(InterpreterSuite()); }

TEST(ChatTemplate, SyntaxErrorNamesTheLine) {
  Result<ChatTemplate> t =
      ChatTemplate::Parse("line one\n{% if x %}\n{{ 1 + }}\n{% endif %}", "t.jinja");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kInvalidArgument);
  EXPECT_EQ(t.status().message(), "chat template t.jinja:3: unexpected 'end of print statement'");
  Result<ChatTemplate> u = ChatTemplate::Parse("a\nb\n{% for m in messages %}", "u.jinja");
  ASSERT_FALSE(u.ok());
  EXPECT_EQ(u.status().message(),
            "chat template u.jinja:3: unexpected end of template, expected 'endfor' or 'else'.");
  Result<ChatTemplate> f = ChatTemplate::Parse("\n\n\n{{ x | frobnicate }}", "f.jinja");
  ASSERT_FALSE(f.ok());
  EXPECT_EQ(f.status().message(), "chat template f.jinja:4: No filter named 'frobnicate'.");
}

TEST(ChatTemplate, RaiseExceptionIsARecognisableRejection) {
  Result<ChatTemplate> t = ChatTemplate::Parse(
      "{% for m in messages %}\n{% if m.role == 'tool' %}{{ raise_exception('no tools: ' + m.role) "
      "}}{% endif %}{% endfor %}",
      "t");
  ASSERT_TRUE(t.ok()) << t.status().ToString();
  Result<std::string> r = t->Render(Json::parse(R"({"messages": [{"role": "tool"}]})"));
  ASSERT_FALSE(r.ok());
  EXPECT_TRUE(IsChatTemplateRejection(r.status()));
  EXPECT_EQ(ChatTemplateRejectionMessage(r.status()), "no tools: tool");
  EXPECT_EQ(r.status().code(), StatusCode::kInvalidArgument);
  // other render errors are not rejections, and name the line
  Result<std::string> e = t->Render(Json::parse(R"({"messages": [1]})"));
  ASSERT_TRUE(e.ok());
  Result<ChatTemplate> bad = ChatTemplate::Parse("\n{{ messages[0].content.upper() + 1 }}", "b");
  ASSERT_TRUE(bad.ok());
  Result<std::string> be = bad->Render(Json::parse(R"({"messages": [{"content": "x"}]})"));
  ASSERT_FALSE(be.ok());
  EXPECT_FALSE(IsChatTemplateRejection(be.status()));
  EXPECT_EQ(be.status().message(),
            "chat template b:2: can only concatenate str (not \"int\") to str");
}

TEST(ChatTemplate, LimitsStopRunawayTemplates) {
  ChatTemplateRenderOptions small;
  small.max_steps = 10000;
  small.max_output_bytes = 1 << 16;
  auto render = [&](const char* src) {
    Result<ChatTemplate> t = ChatTemplate::Parse(src, "limit");
    EXPECT_TRUE(t.ok()) << t.status().ToString();
    return t->Render(Json::object(), small).status();
  };
  EXPECT_EQ(
      render("{% for i in range(100000) %}{% for j in range(100000) %}{% endfor %}{% endfor %}")
          .code(),
      StatusCode::kResourceExhausted);
  EXPECT_EQ(render("{{ 'x' * 100000000 }}").code(), StatusCode::kResourceExhausted);
  EXPECT_EQ(render("{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}").code(),
            StatusCode::kResourceExhausted);
  EXPECT_EQ(render("{% set ns = namespace(s='ab') %}{% for i in range(40) %}{% set ns.s = ns.s ~ "
                   "ns.s %}{% endfor %}")
                .code(),
            StatusCode::kResourceExhausted);
  std::string deep(2000, '(');
  Result<ChatTemplate> t =
      ChatTemplate::Parse("{{ " + deep + "1" + std::string(2000, ')') + " }}", "deep");
  ASSERT_FALSE(t.ok());
  EXPECT_EQ(t.status().code(), StatusCode::kResourceExhausted);
}

TEST(ChatTemplate, ContextIsBuiltAsTransformersDoes) {
  ChatTemplates t;
  t.special_tokens = {{"bos_token", "<s>"}, {"eos_token", "</s>"}};
  Json ctx =
      MakeChatTemplateContext(t, Json::array(), nullptr, true,
                              {{"enable_thinking", false}, {"eos_token", "E"}, {"messages", 1}});
  EXPECT_EQ(ctx.dump(),
            R"({"bos_token":"<s>","eos_token":"E","messages":[],"tools":null,"documents":null,)"
            R"("add_generation_prompt":true,"enable_thinking":false})");
}

TEST(ChatTemplate, KeyOrderOfOrderedJsonIsKept) {
  Result<ChatTemplate> t = ChatTemplate::Parse("{{ tool | tojson }}", "t");
  ASSERT_TRUE(t.ok());
  Result<std::string> r = t->Render(Json::parse(R"({"tool": {"z": 1, "a": 2}})"));
  ASSERT_TRUE(r.ok());
  EXPECT_EQ(*r, "{\"z\": 1, \"a\": 2}");
}

// ---------------- the real checkpoints' templates ----------------

fs::path SharedTokenizers() {
  return fs::path(SourceDir()) / ".." / "shared" / "data" / "tokenizers";
}

Json Conversation(const char* json) { return Json::parse(json); }

const char* kWeatherTool = R"({"type": "function", "function": {"name": "get_weather",
  "description": "Get the weather in a city.", "parameters": {"type": "object",
  "properties": {"city": {"type": "string", "description": "City name, e.g. Zürich"},
  "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}}, "required": ["city"]}}})";

// The conversation table: system or not, multi-turn, assistant last or not, tools or not,
// tool calls (arguments as object and as string) and tool results, reasoning.
std::vector<std::pair<std::string, Json>> ConversationTable() {
  std::vector<std::pair<std::string, Json>> t;
  t.emplace_back("user", Conversation(R"({"messages": [{"role": "user", "content": "Hello!"}]})"));
  t.emplace_back("system_user",
                 Conversation(R"({"messages": [{"role": "system", "content": "You are terse."},
      {"role": "user", "content": "  What is 2+2?  \n"}]})"));
  t.emplace_back("multi_turn",
                 Conversation(R"({"messages": [{"role": "system", "content": "Be kind."},
      {"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
      {"role": "user", "content": "Tell me a joke about café ☕ and 東京."}]})"));
  t.emplace_back("assistant_last", Conversation(R"({"messages": [{"role": "user", "content": "Hi"},
      {"role": "assistant", "content": "Hello there."}]})"));
  t.emplace_back("thinking_history",
                 Conversation(R"({"messages": [{"role": "user", "content": "2+2?"},
      {"role": "assistant", "content": "<think>\nadd them\n</think>\n\n4"},
      {"role": "user", "content": "and 3+3?"},
      {"role": "assistant", "content": "<think>\nagain\n</think>\n\n6"}]})"));
  t.emplace_back("reasoning_field", Conversation(R"({"messages": [{"role": "user", "content": "q"},
      {"role": "assistant", "content": "a", "reasoning_content": "because"}]})"));
  Json tools = Json::array({Json::parse(kWeatherTool)});
  Json with_tools =
      Conversation(R"({"messages": [{"role": "user", "content": "Weather in Paris?"}]})");
  with_tools["tools"] = tools;
  t.emplace_back("tools_user", with_tools);
  Json tools_system =
      Conversation(R"({"messages": [{"role": "system", "content": "You help with weather."},
      {"role": "user", "content": "Weather in Paris and Rome?"}]})");
  tools_system["tools"] = tools;
  t.emplace_back("tools_system", tools_system);
  Json tool_calls = Conversation(R"({"messages": [
      {"role": "system", "content": "You help with weather."},
      {"role": "user", "content": "Weather in Paris and Rome?"},
      {"role": "assistant", "content": "", "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}},
        {"id": "call_2", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
      {"role": "tool", "tool_call_id": "call_1", "content": "22°C, sunny"},
      {"role": "tool", "tool_call_id": "call_2", "content": "25°C"},
      {"role": "assistant", "content": "Paris is 22°C and sunny; Rome is 25°C."},
      {"role": "user", "content": "Thanks!"}]})");
  tool_calls["tools"] = tools;
  t.emplace_back("tool_calls_results", tool_calls);
  Json tool_last = Conversation(R"({"messages": [
      {"role": "user", "content": "Weather in Oslo?"},
      {"role": "assistant", "content": "Let me check.", "tool_calls": [
        {"name": "get_weather", "arguments": {"city": "Oslo"}}]},
      {"role": "tool", "content": "-3°C"}]})");
  tool_last["tools"] = tools;
  t.emplace_back("tool_result_last", tool_last);
  t.emplace_back("tool_response_user", Conversation(R"({"messages": [
      {"role": "user", "content": "<tool_response>\nold\n</tool_response>"},
      {"role": "assistant", "content": "ok"}]})"));
  return t;
}

std::vector<Case> RealTemplateCases(const fs::path& dir, const std::string& model) {
  std::vector<Case> cases;
  Result<ChatTemplates> loaded = LoadChatTemplates(dir.string());
  EXPECT_TRUE(loaded.ok()) << loaded.status().ToString();
  if (!loaded.ok()) return cases;
  const ChatTemplate* t = loaded->Select("", false);
  EXPECT_NE(t, nullptr) << model << " has no chat template";
  if (t == nullptr) return cases;
  for (const auto& [name, conv] : ConversationTable()) {
    for (bool gen : {false, true}) {
      for (int thinking : {-1, 0, 1}) {
        Json kwargs = nullptr;
        if (thinking >= 0) kwargs = {{"enable_thinking", thinking == 1}};
        Json ctx = MakeChatTemplateContext(*loaded, conv["messages"], conv.value("tools", Json()),
                                           gen, kwargs);
        cases.push_back({model + "/" + name + (gen ? "/gen" : "") +
                             (thinking < 0 ? ""
                              : thinking   ? "/think"
                                           : "/nothink"),
                         t->source(), ctx});
      }
    }
  }
  return cases;
}

TEST(ChatTemplate, RealTemplatesMatchJinja2) {
  const fs::path root = SharedTokenizers();
  if (!fs::exists(root)) GTEST_SKIP() << "no " << root << " (the shared test data is absent)";
  std::vector<Case> cases;
  for (const char* model : {"qwen3", "llama3_1"}) {
    std::vector<Case> c = RealTemplateCases(root / model, model);
    cases.insert(cases.end(), c.begin(), c.end());
  }
  ASSERT_GT(cases.size(), 100u);
  ExpectSameAsReference(cases);
  // KVBRIDGE_DUMP_CHAT_CASES=FILE writes the cases and our renders, for
  // tests/tools/transformers_check.py (the one-time check against transformers itself).
  if (const char* dump = std::getenv("KVBRIDGE_DUMP_CHAT_CASES")) {
    Json out = Json::array();
    for (const Case& c : cases) {
      Outcome o = OurRender(c);
      out.push_back({{"name", c.name}, {"context", c.context}, {"ours", o.text}, {"ok", o.ok}});
    }
    std::ofstream(dump) << out.dump();
  }
}

// Templates of the shapes other checkpoints use (written for this test): a Llama 3.1-like one
// (strftime_now, tools as tojson(indent=4), a single tool call or raise_exception) and a
// macro / namespace / rejectattr one, over the same conversation table.
constexpr const char* kLlamaStyle = R"T({{- bos_token }}
{%- set date = strftime_now("%d %B %Y") if strftime_now is defined else "1 Jan 2024" %}
{%- if messages and messages[0].role == 'system' %}
    {%- set sys = messages[0].content | trim %}
    {%- set rest = messages[1:] %}
{%- else %}
    {%- set sys = '' %}
    {%- set rest = messages %}
{%- endif %}
{{- '<|hdr|>system<|/hdr|>\n\n' }}
{{- 'Today: ' ~ date ~ '\n' }}
{%- if tools is defined and tools is not none and tools | length > 0 %}
    {{- 'Functions:\n' }}
    {%- for t in tools %}
        {{- t | tojson(indent=4) }}
        {{- '\n\n' }}
    {%- endfor %}
{%- endif %}
{{- sys ~ '<|end|>' }}
{%- for m in rest %}
    {%- if m.role not in ['user', 'assistant', 'tool', 'ipython'] %}
        {{- raise_exception('Unknown role: ' ~ m.role) }}
    {%- endif %}
    {%- if m.tool_calls is defined and m.tool_calls %}
        {%- if m.tool_calls | length != 1 %}
            {{- raise_exception('Only one tool call per message is supported.') }}
        {%- endif %}
        {%- set call = m.tool_calls[0].function if m.tool_calls[0].function is defined else m.tool_calls[0] %}
        {{- '<|hdr|>assistant<|/hdr|>\n\n' }}
        {{- '{"name": "' + call.name + '", "parameters": ' }}
        {%- if call.arguments is string %}{{- call.arguments }}{%- else %}{{- call.arguments | tojson }}{%- endif %}
        {{- '}<|eom|>' }}
    {%- elif m.role in ['tool', 'ipython'] %}
        {{- '<|hdr|>ipython<|/hdr|>\n\n' }}
        {%- if m.content is mapping or (m.content is iterable and m.content is not string) %}
            {{- m.content | tojson }}
        {%- else %}
            {{- m.content }}
        {%- endif %}
        {{- '<|end|>' }}
    {%- else %}
        {{- '<|hdr|>' ~ m.role ~ '<|/hdr|>\n\n' ~ m.content | trim ~ '<|end|>' }}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}{{- '<|hdr|>assistant<|/hdr|>\n\n' }}{%- endif %}
)T";

constexpr const char* kMacroStyle = R"T({%- macro render_args(args) -%}
{%- for k, v in args | items -%}
{{ k }}={{ v | tojson }}{{ ', ' if not loop.last }}
{%- endfor -%}
{%- endmacro -%}
{%- set ns = namespace(system=none, turns=0) -%}
{%- for m in messages -%}
{%- if m.role == 'system' -%}{%- set ns.system = m.content -%}{%- endif -%}
{%- endfor -%}
{% if tools %}[TOOLS]{{ tools | map(attribute='function.name') | join(',') }}[/TOOLS]
{% endif -%}
[SYSTEM]{{ ns.system if ns.system is not none else 'default system' }}[/SYSTEM]
{% for m in messages | rejectattr('role', 'equalto', 'system') -%}
{%- set ns.turns = ns.turns + 1 -%}
{%- if m.role == 'user' -%}
[INST] {{ m.content }} [/INST]
{% elif m.role == 'assistant' -%}
{%- if m.tool_calls -%}
{%- for tc in m.tool_calls -%}
{%- set f = tc.function if tc.function is defined else tc -%}
[CALL {{ loop.index }}] {{ f.name }}({{ render_args(f.arguments) if f.arguments is mapping else f.arguments }})
{% endfor -%}
{%- endif -%}
{{ m.content }}{{ eos_token }}
{% else -%}
[RESULT {{ m.tool_call_id | default('?') }}] {{ m.content }}
{% endif -%}
{%- endfor -%}
turns={{ ns.turns }}{% if add_generation_prompt %} >>{% endif %}
)T";

TEST(ChatTemplate, OtherTemplateShapesMatchJinja2) {
  std::vector<Case> cases;
  for (const auto& [name, conv] : ConversationTable()) {
    for (bool gen : {false, true}) {
      Json ctx = Json::parse(R"({"bos_token": "<s>", "eos_token": "</s>"})");
      for (auto it = conv.begin(); it != conv.end(); ++it) ctx[it.key()] = it.value();
      ctx["add_generation_prompt"] = gen;
      cases.push_back({"llama_style/" + name, kLlamaStyle, ctx});
      cases.push_back({"macro_style/" + name, kMacroStyle, ctx});
    }
  }
  Json odd_role =
      Json::parse(R"({"messages": [{"role": "narrator", "content": "x"}], "bos_token": ""})");
  cases.push_back({"llama_style/unknown_role", kLlamaStyle, odd_role});
  ExpectSameAsReference(cases);
}

TEST(ChatTemplate, LoadsSpecialTokensAndPrecedence) {
  const fs::path root = SharedTokenizers();
  if (!fs::exists(root)) GTEST_SKIP() << "no " << root << " (the shared test data is absent)";
  Result<ChatTemplates> qwen = LoadChatTemplates((root / "qwen3").string());
  ASSERT_TRUE(qwen.ok()) << qwen.status().ToString();
  EXPECT_FALSE(qwen->bos_token.has_value());
  EXPECT_EQ(qwen->eos_token, "<|im_end|>");
  EXPECT_EQ(qwen->special_tokens.dump(),
            R"({"eos_token":"<|im_end|>","pad_token":"<|endoftext|>"})");
  Result<ChatTemplates> llama = LoadChatTemplates((root / "llama3_1").string());
  ASSERT_TRUE(llama.ok());
  EXPECT_EQ(llama->bos_token, "<|begin_of_text|>");
  EXPECT_EQ(llama->eos_token, "<|eot_id|>");
}

TEST(ChatTemplate, LoaderSourcesAndNamedTemplates) {
  const fs::path dir = fs::temp_directory_path() / ("kvb_ct_" + std::to_string(::getpid()));
  fs::create_directories(dir);
  auto write = [&](const std::string& name, const std::string& text) {
    std::ofstream(dir / name) << text;
  };
  // no template at all: empty, not an error
  write(
      "tokenizer_config.json",
      R"({"bos_token": {"content": "<s>", "__type": "AddedToken"}, "eos_token": "</s>", "unk_token": null})");
  Result<ChatTemplates> none = LoadChatTemplates(dir.string());
  ASSERT_TRUE(none.ok()) << none.status().ToString();
  EXPECT_TRUE(none->empty());
  EXPECT_EQ(none->Select("", false), nullptr);
  EXPECT_EQ(none->bos_token, "<s>");
  EXPECT_EQ(none->special_tokens.dump(), R"({"bos_token":"<s>","eos_token":"</s>"})");
  // a list of named templates
  write("tokenizer_config.json",
        R"({"chat_template": [{"name": "default", "template": "D{{ bos_token }}"},
      {"name": "tool_use", "template": "T"}, {"name": "rag", "template": "R"}], "bos_token": "<s>"})");
  Result<ChatTemplates> named = LoadChatTemplates(dir.string());
  ASSERT_TRUE(named.ok()) << named.status().ToString();
  ASSERT_EQ(named->templates.size(), 3u);
  EXPECT_EQ(named->Select("", false)->source(), "D{{ bos_token }}");
  EXPECT_EQ(named->Select("", true)->source(), "T");
  EXPECT_EQ(named->Select("rag", true)->source(), "R");
  EXPECT_EQ(named->Select("nope", false), nullptr);
  // chat_template.jinja wins over tokenizer_config.json
  write("chat_template.jinja", "J{{ messages | length }}\n");
  Result<ChatTemplates> jinja = LoadChatTemplates(dir.string());
  ASSERT_TRUE(jinja.ok());
  ASSERT_EQ(jinja->templates.size(), 1u);
  EXPECT_EQ(*jinja->Select("", false)->Render(Json::parse(R"({"messages": [1, 2]})")), "J2");
  // --chat-template FILE wins over both; an inline template too; a missing file is NotFound
  write("override.jinja", "O");
  Result<ChatTemplates> over = LoadChatTemplates(dir.string(), (dir / "override.jinja").string());
  ASSERT_TRUE(over.ok());
  EXPECT_EQ(over->Select("", false)->source(), "O");
  EXPECT_EQ(over->bos_token, "<s>");
  Result<ChatTemplates> inline_t = LoadChatTemplates(dir.string(), "{{ 'inline' }}");
  ASSERT_TRUE(inline_t.ok());
  EXPECT_EQ(*inline_t->Select("", false)->Render(Json::object()), "inline");
  EXPECT_EQ(LoadChatTemplates(dir.string(), "/no/such/file.jinja").status().code(),
            StatusCode::kNotFound);
  // a template that does not parse names the file and line
  write("chat_template.jinja", "ok\n{% if %}");
  Result<ChatTemplates> bad = LoadChatTemplates(dir.string());
  ASSERT_FALSE(bad.ok());
  EXPECT_EQ(bad.status().message(), "chat template " + (dir / "chat_template.jinja").string() +
                                        ":2: Expected an expression, got 'end of statement block'");
  fs::remove_all(dir);
}

}  // namespace
}  // namespace kvbridge

#!/usr/bin/env python3
"""Reference renderer for kvbridge's chat-template tests: Python Jinja2 set up as
Hugging Face transformers sets it up for apply_chat_template (transformers
utils/chat_template_utils.py: ImmutableSandboxedEnvironment with trim_blocks,
lstrip_blocks and the loopcontrols extension; tojson overridden to json.dumps with
ensure_ascii=False; raise_exception and strftime_now as globals; the `generation`
block tag of its AssistantTracker extension rendered as its body).

stdin: a JSON list of {"template": str, "context": object, "now": str (optional)}
       ("now" is an ISO date-time that strftime_now formats instead of datetime.now()).
stdout: a JSON list, one per input, of {"ok": true, "text": str} or
        {"ok": false, "error": str, "type": exception class name}.
"""
import datetime
import json
import sys

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment


class GenerationTag(jinja2.ext.Extension):
    """{% generation %}...{% endgeneration %}: renders its body (transformers'
    AssistantTracker does the same when no assistant mask is asked for)."""

    tags = {"generation"}

    def parse(self, parser):
        lineno = next(parser.stream).lineno
        body = parser.parse_statements(["name:endgeneration"], drop_needle=True)
        return jinja2.nodes.CallBlock(self.call_method("_render", []), [], [], body).set_lineno(lineno)

    def _render(self, caller):
        return caller()


def make_env(now):
    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators,
                          sort_keys=sort_keys)

    def strftime_now(fmt):
        return now.strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[GenerationTag, jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env


def render(case):
    now = datetime.datetime.fromisoformat(case["now"]) if case.get("now") else datetime.datetime.now()
    try:
        template = make_env(now).from_string(case["template"])
        return {"ok": True, "text": template.render(**case.get("context", {}))}
    except Exception as e:  # noqa: BLE001 - every failure is a result to compare
        return {"ok": False, "error": str(e), "type": type(e).__name__}


def main():
    cases = json.load(sys.stdin)
    json.dump([render(c) for c in cases], sys.stdout, ensure_ascii=False)


if __name__ == "__main__":
    main()

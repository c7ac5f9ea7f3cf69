#!/usr/bin/env python3
"""Renders tool-calling conversations with Qwen 2.5's and Qwen 3's chat templates, as
Hugging Face's apply_chat_template does (jinja2 with trim_blocks and lstrip_blocks, tojson as
json.dumps with ensure_ascii off), into tests/reference/tool_turns/renders.json, which
tokenizer_test holds the engine's rendering to.

Messages are in the API's form; as vLLM and llama.cpp's server do before rendering, a call's
arguments given as JSON text are parsed into an object (text that is not a JSON object stays
text). Tools are given with their keys sorted, as the engine holds them.

    python3 -m venv /tmp/jv && /tmp/jv/bin/pip install jinja2
    /tmp/jv/bin/python tests/reference/make_tool_turn_goldens.py models/vocab/templates
"""
import json
import sys
from pathlib import Path

import jinja2

TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja"]


def sort_keys(value):
    return json.loads(json.dumps(value, sort_keys=True))


WEATHER = sort_keys({"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}})
TIME = sort_keys({"type": "function", "function": {
    "name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}}})


def call(i, name, arguments):
    return {"id": f"call_{i}", "type": "function", "function": {"name": name, "arguments": arguments}}


CASES = [
    {"name": "tools, system", "tools": [WEATHER, TIME],
     "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"}]},
    {"name": "tools, no system", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "round trip", "tools": [WEATHER, TIME],
     "messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather and time in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      call(1, "get_weather", "{\"city\": \"Paris\", \"unit\": \"C\"}"), call(2, "get_time", "{}")]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
                  {"role": "tool", "tool_call_id": "call_2", "content": "14:05"},
                  {"role": "assistant", "content": "18 C and 14:05."},
                  {"role": "user", "content": "Thanks. And Rome?"}]},
    {"name": "content beside a call, then an answer", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": "Let me check.", "tool_calls": [call(3, "get_weather", "{\"city\":\"Rome\"}")]},
                  {"role": "tool", "tool_call_id": "call_3", "content": "{\"temp\": 21}"}]},
    {"name": "history without tools", "tools": [],
     "messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": "", "tool_calls": [call(4, "get_weather", "{\"city\": \"Oslo\"}")]},
                  {"role": "tool", "tool_call_id": "call_4", "content": "-3 C"},
                  {"role": "assistant", "content": "It is -3 C."},
                  {"role": "user", "content": "Warm enough?"}]},
    {"name": "arguments that are not JSON", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "", "tool_calls": [call(5, "get_weather", "city=Paris")]},
                  {"role": "tool", "tool_call_id": "call_5", "content": "bad arguments"}]},
]


def rendered_messages(messages):
    out = []
    for m in messages:
        m = dict(m)
        if "tool_calls" in m:
            calls = []
            for c in m["tool_calls"]:
                c = json.loads(json.dumps(c))
                try:
                    parsed = json.loads(c["function"]["arguments"])
                    if isinstance(parsed, dict):
                        c["function"]["arguments"] = parsed
                except ValueError:
                    pass
                calls.append(c)
            m["tool_calls"] = calls
        out.append(m)
    return out


def main():
    directory = Path(sys.argv[1] if len(sys.argv) > 1 else "models/vocab/templates")
    env = jinja2.Environment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    env.filters["tojson"] = lambda x, indent=None: json.dumps(x, ensure_ascii=False, indent=indent)
    results = []
    for name in TEMPLATES:
        template = env.from_string((directory / name).read_text())
        for case in CASES:
            text = template.render(messages=rendered_messages(case["messages"]), tools=case["tools"] or None,
                                   add_generation_prompt=True)
            results.append({"template": name, "case": case["name"], "tools": case["tools"],
                            "messages": case["messages"], "expected": text})
    out = Path(__file__).parent / "tool_turns" / "renders.json"
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(results)} renderings -> {out}")


if __name__ == "__main__":
    main()

#!/usr/bin/env python3
"""Renders tool-calling conversations with Qwen 2.5's, Qwen 3's and Llama 3.1's, 3.2's and 3.3's
chat templates, as
Hugging Face's apply_chat_template does (jinja2 with trim_blocks and lstrip_blocks, tojson as
json.dumps with ensure_ascii off), into tests/reference/tool_turns/renders.json, which
tokenizer_test holds the engine's rendering to.

Messages are in the API's form; as vLLM does before rendering, a call's arguments given as
JSON text are parsed (text that is not JSON stays text). Tools keep their keys in the order
written, as a client's request body gives them. Llama 3.2's template dates its system turn with
today's date, written here as @DATE@ for the test to fill in.

    python3 -m venv /tmp/jv && /tmp/jv/bin/pip install jinja2
    /tmp/jv/bin/python tests/reference/make_tool_turn_goldens.py models/vocab/templates
"""
import json
import random
import sys
from pathlib import Path

import jinja2

TEMPLATES = ["Qwen-Qwen2.5-7B-Instruct.jinja", "Qwen-Qwen3-0.6B.jinja"]
LLAMA_TEMPLATES = ["meta-llama-Llama-3.1-8B-Instruct.jinja", "meta-llama-Llama-3.2-3B-Instruct.jinja",
                   "meta-llama-Llama-3.3-70B-Instruct.jinja"]


WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city (°C).",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Local time", "parameters": {"type": "object", "properties": {}}}}
# Properties out of alphabetical order, and floats in every range Python writes differently.
THERMOSTAT = {"type": "function", "function": {
    "name": "set_thermostat", "description": "Set a room's temperature.",
    "parameters": {"type": "object", "properties": {
        "room": {"type": "string"},
        "celsius": {"type": "number", "minimum": 5.0, "maximum": 30.5, "multipleOf": 0.5,
                    "examples": [1e15, 1234567890123456.7, -2.5e15, 9999999999999998.0, 1e16, 1e-05, 0.0001,
                                 100.0, 3, 1.5e300]}},
        "required": ["room", "celsius"]}}}
# And floats of every size, whose shortest digits Python chooses by closeness at a tie.
_r = random.Random(7)
THERMOSTAT["function"]["parameters"]["properties"]["offset"] = {"type": "number", "enum": [
    round(_r.uniform(-10, 10), _r.randint(0, 17)) * 10.0 ** _r.randint(-22, 22) for _ in range(300)]}


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
    {"name": "keys as written, floats as Python writes them", "tools": [THERMOSTAT, WEATHER],
     "messages": [{"role": "user", "content": "Kitchen to 21.5, please."},
                  {"role": "assistant", "content": "", "tool_calls": [
                      call(6, "set_thermostat", "{\"room\": \"kitchen\", \"celsius\": 21.5, \"at\": 1e15, \"z\": 0, \"a\": -0.0}")]},
                  {"role": "tool", "tool_call_id": "call_6", "content": "ok"}]},
    {"name": "arguments that are JSON but not an object", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      call(7, "get_weather", "[\"Paris\",1]"), call(8, "get_weather", "42"),
                      call(9, "get_weather", "\"Oslo\"")]},
                  {"role": "tool", "tool_call_id": "call_7", "content": "?"}]},
    # Reasoning given apart (an API's reasoning_content), which Qwen 3's template writes in place
    # of a <think> block in the content, only after the last user query; Qwen 2.5's ignores it.
    {"name": "reasoning given apart", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather in Oslo?"},
                  {"role": "assistant", "content": "-3 C.", "reasoning_content": "Before the query: left out."},
                  {"role": "user", "content": "And in Rome?"},
                  {"role": "assistant", "content": "", "reasoning_content": "\nI should look it up.\n",
                   "tool_calls": [call(10, "get_weather", "{\"city\": \"Rome\"}")]},
                  {"role": "tool", "tool_call_id": "call_10", "content": "21 C"},
                  {"role": "assistant", "content": "\n\nIt is 21 C.", "reasoning_content": "It is 21 C there."}]},
    # chat_template_kwargs: {enable_thinking: false} (Qwen 3's switch; Qwen 2.5's has none).
    {"name": "thinking off", "tools": [WEATHER], "kwargs": {"enable_thinking": False},
     "messages": [{"role": "user", "content": "Weather in Paris?"}]},
    {"name": "empty reasoning given apart keeps the content whole", "tools": [],
     "messages": [{"role": "user", "content": "Hi"},
                  {"role": "assistant", "content": "<think>\nkept</think>\n\nHello", "reasoning_content": ""}]},
]

# Llama's templates take one call per assistant message, and put the tools in the first user
# message.
LLAMA_CASES = [
    CASES[0],  # tools, system
    {"name": "tools, no system", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "  Weather in Paris?\n"}]},
    {"name": "round trip", "tools": [WEATHER, TIME],
     "messages": [{"role": "system", "content": "Be brief."},
                  {"role": "user", "content": "Weather in Paris?"},
                  {"role": "assistant", "content": "", "tool_calls": [
                      call(1, "get_weather", "{\"city\": \"Paris\", \"unit\": \"C\"}")]},
                  {"role": "tool", "tool_call_id": "call_1", "content": "18 C, clear"},
                  {"role": "assistant", "content": "18 C."},
                  {"role": "user", "content": "Thanks. And Rome?"}]},
    {"name": "content beside a call is not written", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather in Rome?"},
                  {"role": "assistant", "content": "Let me check.", "tool_calls": [call(3, "get_weather", "{\"city\":\"Rome\"}")]},
                  {"role": "tool", "tool_call_id": "call_3", "content": "{\"temp\": 21}"}]},
    next(c for c in CASES if c["name"] == "history without tools"),
    {"name": "keys as written, floats as Python writes them", "tools": [THERMOSTAT, WEATHER],
     "messages": [{"role": "user", "content": "Kitchen to 21.5, please."},
                  {"role": "assistant", "content": "", "tool_calls": [
                      call(6, "set_thermostat", "{\"room\": \"kitchen\", \"celsius\": 21.5, \"at\": 1e15}")]},
                  {"role": "tool", "tool_call_id": "call_6", "content": "ok"}]},
    {"name": "arguments that are not JSON, a result with quotes", "tools": [WEATHER],
     "messages": [{"role": "user", "content": "Weather?"},
                  {"role": "assistant", "content": "", "tool_calls": [call(5, "get_weather", "city=Paris")]},
                  {"role": "tool", "tool_call_id": "call_5", "content": "He said \"hi\" \u2014 5 \u00b0C\n"}]},
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
                    c["function"]["arguments"] = json.loads(c["function"]["arguments"])
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

    def raise_exception(message):
        raise ValueError(message)

    results = []
    for names, cases in ((TEMPLATES, CASES), (LLAMA_TEMPLATES, LLAMA_CASES)):
        for name in names:
            template = env.from_string((directory / name).read_text())
            for case in cases:
                text = template.render(messages=rendered_messages(case["messages"]), tools=case["tools"] or None,
                                       add_generation_prompt=True, bos_token="", raise_exception=raise_exception,
                                       strftime_now=lambda format: "@DATE@", **case.get("kwargs", {}))
                result = {"template": name, "case": case["name"], "tools": case["tools"],
                          "messages": case["messages"], "expected": text}
                if "kwargs" in case:
                    result["chat_template_kwargs"] = case["kwargs"]
                results.append(result)
    out = Path(__file__).parent / "tool_turns" / "renders.json"
    out.write_text(json.dumps(results, indent=1, ensure_ascii=False) + "\n")
    print(f"{len(results)} renderings -> {out}")


if __name__ == "__main__":
    main()

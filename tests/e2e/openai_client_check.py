"""The official `openai` Python client against `batchlm serve` (run by serve_test.cpp).

Usage: openai_client_check.py --base-url http://127.0.0.1:PORT/v1 --api-key KEY --model NAME

Makes the calls a client makes (models.list, chat.completions.create whole and streamed with
usage, completions.create, log-probabilities and logit_bias, vLLM's stop_token_ids and min_tokens, JSON mode, structured outputs
through chat.completions.parse with a pydantic model, and requests the server must refuse) and prints one JSON object
with what came back; the C++ test asserts on it. Exits non-zero when a call fails in a way the
test did not expect.
"""

import argparse
import json
import sys
import typing

import openai
import pydantic
from openai.lib._pydantic import to_strict_json_schema


class City(pydantic.BaseModel):
    """What the structured-output check asks for: the client turns it into a strict JSON schema."""

    name: str = pydantic.Field(max_length=40)
    country: str = pydantic.Field(max_length=40)
    population: int
    kind: typing.Literal["capital", "town"]
    rivers: list[str] = pydantic.Field(max_length=3)
    mayor: typing.Optional[str]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--api-key", required=True)
    parser.add_argument("--model", required=True)
    args = parser.parse_args()

    client = openai.OpenAI(base_url=args.base_url, api_key=args.api_key, max_retries=0, timeout=60)
    out = {}

    out["models"] = [m.id for m in client.models.list()]

    messages = [{"role": "user", "content": "What is the capital of France? Answer in one sentence."}]
    request = {"model": args.model, "messages": messages, "temperature": 0, "max_tokens": 24}

    chat = client.chat.completions.create(**request)
    choice = chat.choices[0]
    out["chat"] = {
        "request": request,
        "text": choice.message.content,
        "role": choice.message.role,
        "finish_reason": choice.finish_reason,
        "model": chat.model,
        "id": chat.id,
        "usage": {
            "prompt_tokens": chat.usage.prompt_tokens,
            "completion_tokens": chat.usage.completion_tokens,
            "total_tokens": chat.usage.total_tokens,
        },
    }

    stream = client.chat.completions.create(**request, stream=True, stream_options={"include_usage": True})
    text, first_role, finish_reason, usage, after_usage, ids = "", None, None, None, 0, set()
    for index, chunk in enumerate(stream):
        ids.add(chunk.id)
        if usage is not None:
            after_usage += 1
        if chunk.usage is not None:
            usage = {
                "prompt_tokens": chunk.usage.prompt_tokens,
                "completion_tokens": chunk.usage.completion_tokens,
                "total_tokens": chunk.usage.total_tokens,
            }
        for c in chunk.choices:
            if index == 0:
                first_role = c.delta.role
            if c.delta.content:
                text += c.delta.content
            if c.finish_reason is not None:
                finish_reason = c.finish_reason
    out["stream"] = {
        "text": text,
        "first_role": first_role,
        "finish_reason": finish_reason,
        "usage": usage,
        "chunks_after_usage": after_usage,
        "ids": len(ids),
    }

    several = client.chat.completions.create(**request, n=2)
    out["several"] = {
        "indexes": [c.index for c in several.choices],
        "texts": [c.message.content for c in several.choices],
        "completion_tokens": several.usage.completion_tokens,
    }

    completion = client.completions.create(
        model=args.model, prompt="The capital of France is", max_tokens=8, temperature=0
    )
    out["completion"] = {
        "object": completion.object,
        "text": completion.choices[0].text,
        "finish_reason": completion.choices[0].finish_reason,
        "completion_tokens": completion.usage.completion_tokens,
    }

    # Log-probabilities, whole and streamed, in the chat form.
    lp = client.chat.completions.create(**request, logprobs=True, top_logprobs=3)
    content = lp.choices[0].logprobs.content
    out["logprobs"] = {
        "text": lp.choices[0].message.content,
        "joined": b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace"),
        "tokens": len(content),
        "completion_tokens": lp.usage.completion_tokens,
        "finish_reason": lp.choices[0].finish_reason,
        "top_sizes": sorted({len(t.top_logprobs) for t in content}),
        "chosen_is_best": all(t.top_logprobs[0].token == t.token and t.top_logprobs[0].logprob == t.logprob for t in content),
        "all_negative": all(t.logprob <= 0 for t in content),
        "logprobs": [t.logprob for t in content],
    }
    streamed = client.chat.completions.create(**request, logprobs=True, top_logprobs=3, stream=True)
    entries, text = [], ""
    for chunk in streamed:
        for c in chunk.choices:
            text += c.delta.content or ""
            if c.logprobs is not None and c.logprobs.content:
                entries.extend(c.logprobs.content)
    out["logprobs_stream"] = {"text": text, "logprobs": [t.logprob for t in entries]}

    # The completions form: logprobs=N, tokens with their offsets.
    prompt = "The capital of France is"
    lc = client.completions.create(model=args.model, prompt=prompt, max_tokens=6, temperature=0, logprobs=2)
    clp = lc.choices[0].logprobs
    out["completion_logprobs"] = {
        "text": lc.choices[0].text,
        "joined": "".join(clp.tokens),
        "tokens": len(clp.tokens),
        # As OpenAI counts them: from the start of the prompt.
        "offsets_ok": all((prompt + lc.choices[0].text)[o:].startswith(t) for o, t in zip(clp.text_offset, clp.tokens)),
        "first_offset": clp.text_offset[0] if clp.text_offset else None,
        "top_sizes": sorted({len(d) for d in clp.top_logprobs}),
    }

    # logit_bias: +100 on one token makes every token that one.
    forced = client.chat.completions.create(
        model=args.model, messages=messages, temperature=0, max_tokens=5, logprobs=True, logit_bias={"28": 100}
    )
    out["logit_bias"] = {
        "distinct_tokens": [list(b) for b in sorted({bytes(t.bytes) for t in forced.choices[0].logprobs.content})],
        "completion_tokens": forced.usage.completion_tokens,
    }
    # vLLM's extensions, as its users send them (extra_body): the forced token as a stop token
    # id ends the answer with it, after min_tokens others.
    stopping = client.chat.completions.create(
        model=args.model,
        messages=messages,
        temperature=0,
        max_tokens=12,
        logit_bias={"28": 100},
        extra_body={"stop_token_ids": [28], "min_tokens": 3},
    )
    out["stop_token_ids"] = {
        "finish_reason": stopping.choices[0].finish_reason,
        "completion_tokens": stopping.usage.completion_tokens,
    }
    # JSON mode: the content is a JSON object, or its beginning when max_tokens cut it.
    asked = [{"role": "user", "content": 'Reply with a JSON object {"answer": <the number>}. What is 2 + 2?'}]
    jm = client.chat.completions.create(
        model=args.model, messages=asked, temperature=0, max_tokens=60, response_format={"type": "json_object"}
    )
    content = jm.choices[0].message.content
    try:
        parsed = json.loads(content)
        kind = type(parsed).__name__
    except json.JSONDecodeError:
        kind = None
    out["json_mode"] = {"finish_reason": jm.choices[0].finish_reason, "starts": content.lstrip()[:1], "parsed": kind}

    # Structured outputs: the client sends City's strict schema and parses the answer into it.
    city_question = [{"role": "user", "content": "Describe Paris as a JSON object."}]
    parsed = client.chat.completions.parse(
        model=args.model, messages=city_question, temperature=0, max_tokens=300, response_format=City
    )
    city = parsed.choices[0].message.parsed
    out["structured"] = {
        "finish_reason": parsed.choices[0].finish_reason,
        "content": parsed.choices[0].message.content,
        "parsed": city.model_dump() if city is not None else None,
    }
    # The same schema streamed: the chunks join into the same text.
    schema = {"name": "City", "schema": to_strict_json_schema(City), "strict": True}
    chunks = client.chat.completions.create(
        model=args.model,
        messages=city_question,
        temperature=0,
        max_tokens=300,
        response_format={"type": "json_schema", "json_schema": schema},
        stream=True,
    )
    out["structured_stream"] = {"text": "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)}
    try:
        client.chat.completions.create(
            model=args.model,
            messages=messages,
            response_format={
                "type": "json_schema",
                "json_schema": {"name": "x", "schema": {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1}}}},
            },
        )
        out["schema_refused"] = {"status": None}
    except openai.BadRequestError as e:
        out["schema_refused"] = {"status": e.status_code, "param": (e.body or {}).get("param"), "message": e.message}

    try:
        client.chat.completions.create(model=args.model, messages=messages, top_logprobs=2)
        out["top_without_logprobs"] = {"status": None}
    except openai.BadRequestError as e:
        out["top_without_logprobs"] = {"status": e.status_code, "param": (e.body or {}).get("param")}

    try:
        client.chat.completions.create(model=args.model, messages=messages, temperature=5)
        out["bad_request"] = {"status": None}
    except openai.BadRequestError as e:
        out["bad_request"] = {"status": e.status_code, "param": (e.body or {}).get("param"), "message": e.message}

    try:
        client.chat.completions.create(model="no-such-model", messages=messages, max_tokens=1)
        out["not_found"] = {"status": None}
    except openai.NotFoundError as e:
        out["not_found"] = {"status": e.status_code, "code": e.code}

    try:
        openai.OpenAI(base_url=args.base_url, api_key="wrong", max_retries=0, timeout=60).models.list()
        out["unauthorized"] = {"status": None}
    except openai.AuthenticationError as e:
        out["unauthorized"] = {"status": e.status_code, "code": e.code}

    json.dump(out, sys.stdout)
    print()
    return 0


if __name__ == "__main__":
    sys.exit(main())

#!/usr/bin/env python3
"""The Python peer of the client benchmark: what a user writes today with the official SDK.

Reads prompts from a JSONL file ({"prompt": "..."} per line), sends each as a streamed chat
completion with AsyncOpenAI, at most `--concurrency` at once (an asyncio.Semaphore), collects
the text and the usage of every stream, and appends one JSON line per item to `--output` as
items finish -- the same work `batchlm run` does for the job in this folder.

Run it from bench/.venv (bench/client/setup.sh creates it). The API key comes from
OPENAI_API_KEY, as in any script using the SDK.
"""

import argparse
import asyncio
import json
import os
import sys
import time

_t0 = time.process_time()
import httpx2  # noqa: E402  (the SDK's HTTP transport)
import openai  # noqa: E402  (timed: the imports are part of what a script pays at start)
from openai import AsyncOpenAI  # noqa: E402

IMPORT_CPU_S = time.process_time() - _t0


def parse_args():
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--input", required=True, help="JSONL of {\"prompt\": ...}")
    p.add_argument("--output", required=True, help="JSONL of results, one line per item")
    p.add_argument("--base-url", required=True, help="e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--concurrency", type=int, required=True)
    p.add_argument("--model", default="bench-model")
    p.add_argument("--max-tokens", type=int, default=256)
    p.add_argument("--connect-timeout", type=float, default=None,
                   help="seconds to connect (default: the SDK's, 5 s)")
    p.add_argument("--stats", help="write {import_cpu_s, ...} as JSON here at the end")
    return p.parse_args()


def make_client(args):
    # The SDK's own pool allows 1,000 connections and keeps 100 idle ones alive. At a
    # concurrency above 1,000 the rest of the streams would wait for a connection inside the
    # pool, so the semaphore would not be what bounds concurrency; and with only 100 idle
    # connections kept, connections beyond those are closed as streams end and opened again
    # for the next request. Raising both limits to the concurrency makes every semaphore slot
    # a live, reused connection -- what batchlm does too. Everything else (timeouts,
    # max_retries=2, redirects) stays the SDK's default: DefaultAsyncHttpxClient keeps them.
    limits = httpx2.Limits(max_connections=args.concurrency,
                           max_keepalive_connections=args.concurrency)
    kwargs = {"limits": limits}
    if args.connect_timeout is not None:
        # The SDK's default is 600 s overall and 5 s to connect; only the latter changes.
        kwargs["timeout"] = httpx2.Timeout(600.0, connect=args.connect_timeout)
    http_client = openai.DefaultAsyncHttpxClient(**kwargs)
    return AsyncOpenAI(base_url=args.base_url, http_client=http_client)


async def one(client, sem, item_id, prompt, args, out):
    record = {"id": item_id, "input": {"prompt": prompt}, "output": None,
              "finish_reason": None, "usage": None, "timings": None, "error": None}
    async with sem:
        start = time.monotonic()
        try:
            stream = await client.chat.completions.create(
                model=args.model,
                messages=[{"role": "user", "content": prompt}],
                max_tokens=args.max_tokens,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
            parts = []
            async for chunk in stream:
                if chunk.choices:
                    choice = chunk.choices[0]
                    if choice.delta.content:
                        parts.append(choice.delta.content)
                    if choice.finish_reason:
                        record["finish_reason"] = choice.finish_reason
                if chunk.usage is not None:
                    record["usage"] = {"prompt_tokens": chunk.usage.prompt_tokens,
                                       "completion_tokens": chunk.usage.completion_tokens}
            record["output"] = "".join(parts)
        except Exception as e:  # noqa: BLE001 -- record every failure, as batchlm does
            cause = e.__cause__ or e.__context__
            record["error"] = {"kind": type(e).__name__, "message": str(e),
                               "cause": type(cause).__name__ if cause else None}
        record["timings"] = {"total_ms": (time.monotonic() - start) * 1000.0}
    out.write(json.dumps(record) + "\n")
    return record["error"] is None


async def main(args):
    with open(args.input, encoding="utf-8") as f:
        prompts = [json.loads(line)["prompt"] for line in f if line.strip()]
    client = make_client(args)
    sem = asyncio.Semaphore(args.concurrency)
    with open(args.output, "w", encoding="utf-8") as out:
        tasks = [one(client, sem, i + 1, p, args, out) for i, p in enumerate(prompts)]
        results = await asyncio.gather(*tasks)
    await client.close()
    ok = sum(results)
    print(f"peer_openai: {ok}/{len(results)} succeeded", file=sys.stderr)
    return ok, len(results)


if __name__ == "__main__":
    args = parse_args()
    ok, total = asyncio.run(main(args))
    if args.stats:
        with open(args.stats, "w", encoding="utf-8") as f:
            json.dump({"import_cpu_s": IMPORT_CPU_S, "openai_version": openai.__version__,
                       "succeeded": ok, "total": total}, f)
    sys.exit(0 if ok == total else 1)

#!/usr/bin/env python3
"""Where a batch run's time goes, from an engine step log (backend.step_log, serve --step-log).

  python3 bench/engine/steps.py STEPS.jsonl [--phase-seconds 2]

Prints, for the run the log holds:
- the run in windows of --phase-seconds: steps, decoding sequences per step, prompt tokens,
  milliseconds per step, decode tokens per second;
- its three phases: the ramp (from the first step to the first with as many decoding sequences
  as the run ever had), the steady part, and the drain (after the last step that left requests
  waiting), with the decode tokens per second of each;
- a least-squares fit of each forward pass's time as fixed + per decode token x decode +
  per prompt token x prompt tokens, and the share of the forward time each term accounts for.

Decode tokens are the sequences' next tokens after their first (which comes with the prompt's
last chunk); with speculative decoding the drafts are counted apart. Standard library only.
"""

import argparse
import json
import sys


def load(path):
    steps = []
    with open(path, encoding="utf-8") as f:
        for number, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                steps.append(json.loads(line))
            except json.JSONDecodeError as e:
                sys.exit(f"{path}:{number}: not a JSON line ({e.msg})")
    if not steps:
        sys.exit(f"{path}: no steps")
    return steps


def solve3(rows):
    """Least squares for y = a + b x1 + c x2 over rows of (x1, x2, y)."""
    m = [[0.0] * 4 for _ in range(3)]
    for x1, x2, y in rows:
        v = (1.0, x1, x2)
        for i in range(3):
            for j in range(3):
                m[i][j] += v[i] * v[j]
            m[i][3] += v[i] * y
    for i in range(3):
        p = max(range(i, 3), key=lambda r: abs(m[r][i]))
        m[i], m[p] = m[p], m[i]
        if abs(m[i][i]) < 1e-12:
            return None
        for r in range(3):
            if r != i:
                f = m[r][i] / m[i][i]
                m[r] = [a - f * b for a, b in zip(m[r], m[i])]
    return [m[i][3] / m[i][i] for i in range(3)]


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("log", help="a step log (JSON lines)")
    ap.add_argument("--phase-seconds", type=float, default=2.0, help="window length (default 2)")
    args = ap.parse_args()
    steps = load(args.log)

    t0 = steps[0]["t"]
    end = steps[-1]["t"] + steps[-1]["step_ms"] / 1000
    span = end - t0
    busy = sum(s["step_ms"] for s in steps) / 1000
    decode = sum(s["decode"] for s in steps)
    prompt = sum(s["prompt"] for s in steps)
    drafts = sum(s.get("drafts", 0) for s in steps)
    print(f"{len(steps)} steps over {span:.1f} s ({busy / span:.0%} of it stepping): "
          f"{decode} decode tokens, {prompt} prompt tokens, {drafts} drafts")

    print(f"\n{'from s':>6} {'steps':>6} {'decode/step':>11} {'prompt':>7} {'ms/step':>8} {'decode tok/s':>12}")
    w = args.phase_seconds
    window = {}
    for s in steps:
        window.setdefault(int((s["t"] - t0) // w), []).append(s)
    for k in sorted(window):
        ws = window[k]
        d = sum(s["decode"] for s in ws)
        print(f"{k * w:6.0f} {len(ws):6d} {d / len(ws):11.1f} {sum(s['prompt'] for s in ws):7d} "
              f"{sum(s['step_ms'] for s in ws) / len(ws):8.1f} {d / w:12.0f}")

    peak = max(s["running"] for s in steps)
    full = [i for i, s in enumerate(steps) if s["running"] == peak]
    first_full, last_full = full[0], full[-1] + 1

    def phase(name, part):
        if not part:
            print(f"  {name:7s} none")
            return
        begin = part[0]["t"]
        stop = part[-1]["t"] + part[-1]["step_ms"] / 1000
        d = sum(s["decode"] for s in part)
        p = sum(s["prompt"] for s in part)
        print(f"  {name:7s} {stop - begin:6.1f} s, {len(part):4d} steps, {d:6d} decode tokens "
              f"({d / max(stop - begin, 1e-9):6.0f}/s), {p:6d} prompt tokens")

    print(f"\nphases (at most {peak} sequences running at once):")
    phase("ramp", steps[:first_full])
    phase("steady", steps[first_full:last_full])
    phase("drain", steps[last_full:])

    # The fit needs steps of several batch sizes; one request at a time gives none.
    fit = None
    if len({s["decode"] for s in steps}) >= 3:
        fit = solve3([(s["decode"], s["prompt"], s["forward_ms"]) for s in steps])
    forward = sum(s["forward_ms"] for s in steps)
    if not fit:
        print("\nno fit: the steps do not vary enough in their decode tokens")
    else:
        a, b, c = fit
        print(f"\nforward ms ~ {a:.2f} + {b:.3f} x decode + {c:.3f} x prompt tokens "
              f"(over {len(steps)} steps, {forward / 1000:.1f} s of forward passes):")
        print(f"  fixed per step  {a * len(steps) / forward:6.1%}")
        print(f"  decode tokens   {b * decode / forward:6.1%}")
        print(f"  prompt tokens   {c * prompt / forward:6.1%}")
    print(f"  outside the forward passes (planning, sampling, output): "
          f"{(busy * 1000 - forward) / (busy * 1000):.1%} of the stepping time")


if __name__ == "__main__":
    main()

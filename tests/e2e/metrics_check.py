#!/usr/bin/env python3
"""Reads a Prometheus text exposition (the file named, else stdin) with `prometheus_client`'s parser and prints, as
one JSON object, every family (name without a counter's `_total`): its type, help, and samples
as [sample name, labels, value]. A text the parser refuses exits 1 with its reason on stderr."""

import json
import sys

from prometheus_client.parser import text_string_to_metric_families


def main() -> int:
    if len(sys.argv) > 1:
        with open(sys.argv[1], encoding="utf-8") as f:
            text = f.read()
    else:
        text = sys.stdin.read()
    families = {}
    try:
        for family in text_string_to_metric_families(text):
            if family.name in families:
                print(f"family {family.name} appears twice", file=sys.stderr)
                return 1
            families[family.name] = {
                "type": family.type,
                "help": family.documentation,
                "samples": [[s.name, s.labels, s.value] for s in family.samples],
            }
    except Exception as e:  # the parser's own ValueError, or anything else it raises
        print(f"not a valid exposition: {e!r}", file=sys.stderr)
        return 1
    json.dump(families, sys.stdout)
    return 0


if __name__ == "__main__":
    sys.exit(main())

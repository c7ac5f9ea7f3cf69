#!/usr/bin/env python3
"""Writes quant_vectors.json: blocks of Q5_0, Q5_1, Q4_K, Q5_K and Q6_K with what gguf-py
decodes them to, so the C++ tests can check their dequantization against an independent
implementation of the GGUF layouts (tests/unit/kernels/quant_types_test.cpp).

Each block is seeded random bytes, except its F16 fields (scales and mins), which are set to
finite values: normal, negative, subnormal and zero ones appear. The decoded values are float32,
written as the decimal of the equal float64, so they read back exactly.

Usage: python make_quant_vectors.py [--out tests/reference/quant_vectors.json]
(needs the packages gguf==0.19.0 and numpy).
"""

import argparse
import json
import math
from pathlib import Path

import gguf
import numpy as np

SEED = 20240611

# Per type: blocks to write, and the byte offsets of its F16 fields within a block.
TYPES = {
    "Q5_0": (4, [0]),
    "Q5_1": (4, [0, 2]),
    "Q4_K": (3, [0, 2]),
    "Q5_K": (3, [0, 2]),
    "Q6_K": (3, [208]),
}


def f16_bytes(value: float) -> bytes:
    return np.array([value], dtype=np.float16).tobytes()


def make_blocks(rng: np.random.Generator, qtype: gguf.GGMLQuantizationType, n_blocks: int,
                f16_offsets: list[int]) -> bytes:
    _, type_size = gguf.GGML_QUANT_SIZES[qtype]
    out = bytearray()
    for b in range(n_blocks):
        block = bytearray(rng.integers(0, 256, size=type_size, dtype=np.uint8).tobytes())
        for k, offset in enumerate(f16_offsets):
            if b == 1 and k == 0:
                value = -float(rng.uniform(0.001, 0.05))      # a negative scale
            elif b == 1 and k == 1:
                value = 0.0                                    # no min
            elif b == 2:
                value = float(rng.uniform(1, 100)) * 2.0**-24  # subnormal in F16
            else:
                value = float(rng.uniform(0.0005, 0.02))
            block[offset:offset + 2] = f16_bytes(value)
        out += block
    return bytes(out)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path(__file__).parent / "quant_vectors.json")
    args = parser.parse_args()

    rng = np.random.default_rng(SEED)
    cases = []
    for name, (n_blocks, f16_offsets) in TYPES.items():
        qtype = gguf.GGMLQuantizationType[name]
        data = make_blocks(rng, qtype, n_blocks, f16_offsets)
        values = gguf.quants.dequantize(np.frombuffer(data, dtype=np.uint8), qtype)
        values = np.asarray(values, dtype=np.float32).reshape(-1)
        block_size, _ = gguf.GGML_QUANT_SIZES[qtype]
        assert values.size == n_blocks * block_size
        decimals = [float(v) for v in values]
        assert all(math.isfinite(v) for v in decimals)
        assert np.array_equal(np.array(decimals, dtype=np.float32).view(np.uint32), values.view(np.uint32))
        cases.append({"type": name, "blocks": n_blocks, "bytes": data.hex(), "values": decimals})

    doc = {
        "generator": "tests/reference/make_quant_vectors.py",
        "gguf_py_version": "0.19.0",
        "seed": SEED,
        "cases": cases,
    }
    args.out.write_text(json.dumps(doc, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()

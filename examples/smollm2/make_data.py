"""Write the SmolLM2 example's prompts: 2-digit additions asked in chat form.

``train.jsonl`` holds 4000 problems and ``eval.jsonl`` 200 others (no problem in
both), each row ``{"messages": [{"role": "user", "content": "What is 27 + 82? Answer with only the number."}],
"answer": "109"}``: the prompt is a chat conversation (rendered with the model's
chat template) and ``answer`` reaches the reward function as ``answer=[...]``.

Run ``python examples/smollm2/make_data.py [OUT_DIR]`` (default: this directory);
the files are the same on every machine (seeded).
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path


def problems(seed: int = 2026) -> list[tuple[int, int]]:
    """Every ordered pair of 2-digit numbers, shuffled."""
    pairs = [(a, b) for a in range(10, 100) for b in range(10, 100)]
    random.Random(seed).shuffle(pairs)
    return pairs


def row(a: int, b: int) -> dict[str, object]:
    return {"messages": [{"role": "user", "content": f"What is {a} + {b}? Answer with only the number."}], "answer": str(a + b)}


def main(out: Path) -> None:
    pairs = problems()
    held_out, train = pairs[:200], pairs[200:4200]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        with open(out / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps(row(a, b)) + "\n")
    print(f"wrote {len(train)} training and {len(held_out)} held-out problems to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)

"""Write the SmolLM2 example's prompts: 2-digit additions asked in chat form.

``train.jsonl`` holds 4000 problems and ``eval.jsonl`` 200 others (no problem in
both), each row ``{"messages": [{"role": "user", "content": "What is 27 + 82? Answer with only the number."}],
"answer": "109"}``: the prompt is a chat conversation (rendered with the model's
chat template) and ``answer`` reaches the reward function as ``answer=[...]``.

``tools_train.jsonl`` and ``tools_eval.jsonl`` (4000 and 200 rows) hold 3-digit
multiplications for the tool example (``tools.toml``): a system message describes
the ``multiply`` tool in the Hermes ``<tool_call>`` format, the user asks for the
product.

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


TOOL_SYSTEM = (
    'To multiply, call <tool_call>{"name": "multiply", "arguments": {"a": 12, "b": 34}}</tool_call> '
    "with your numbers. Then answer with only the number."
)
"""The tool example's system message: the tool and its call format."""


def tool_row(a: int, b: int) -> dict[str, object]:
    return {"messages": [{"role": "system", "content": TOOL_SYSTEM},
                         {"role": "user", "content": f"What is {a} * {b}?"}], "answer": str(a * b)}


def tool_problems(seed: int = 2027) -> list[tuple[int, int]]:
    """4200 distinct ordered pairs of 3-digit numbers."""
    rng, seen = random.Random(seed), set()
    while len(seen) < 4200:
        seen.add((rng.randrange(100, 1000), rng.randrange(100, 1000)))
    return sorted(seen, key=lambda pair: rng.random())


def main(out: Path) -> None:
    pairs = problems()
    held_out, train = pairs[:200], pairs[200:4200]
    out.mkdir(parents=True, exist_ok=True)
    for name, rows in (("train.jsonl", train), ("eval.jsonl", held_out)):
        with open(out / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps(row(a, b)) + "\n")
    print(f"wrote {len(train)} training and {len(held_out)} held-out problems to {out}")
    pairs = tool_problems()
    for name, rows in (("tools_train.jsonl", pairs[200:]), ("tools_eval.jsonl", pairs[:200])):
        with open(out / name, "w") as f:
            for a, b in rows:
                f.write(json.dumps(tool_row(a, b)) + "\n")
    print(f"wrote {len(pairs) - 200} training and 200 held-out tool problems to {out}")


if __name__ == "__main__":
    main(Path(sys.argv[1]) if len(sys.argv) > 1 else Path(__file__).parent)

"""Writes the bundled chat set (`assets/chat.jsonl`): short multi-turn conversations of arithmetic
and word tasks whose answers are computed here, so a fine-tuned model has something exact to learn.

    python -m dsv3_jax.data.make_chat [--out=PATH] [--conversations=480] [--seed=0]

Deterministic: the same seed writes the same bytes. About a third of the conversations open with a
system or developer message (a style the answers then follow); arithmetic conversations continue
with one or two follow-up questions about the previous answer. Every conversation renders to at
most 128 tokens with the bundled template and tokenizer, so it fits the tiny config's rows.
"""

import json
import pathlib
import random
import sys

from absl import flags

from dsv3_jax import cli
from dsv3_jax.data.chat import BUNDLED_CHAT_PATH

WORDS = ("apple", "river", "stone", "garden", "window", "planet", "silver", "candle", "forest", "bridge", "pencil",
         "rabbit", "orange", "castle", "button", "dragon", "island", "mirror", "rocket", "violin", "banana", "cloud",
         "tiger", "lemon", "spoon", "horse", "music", "ocean", "paper", "quiet", "storm", "table", "water", "zebra")
SYSTEMS = (("system", "You are a helpful assistant."), ("system", "Answer briefly."),
           ("developer", "Reply with the answer only."), ("system", "You are a careful calculator."))


def _arithmetic(rng: random.Random, terse: bool) -> list[dict]:
    a, b = rng.randint(2, 60), rng.randint(2, 40)
    op = rng.choice("+-*")
    if op == "*":
        b = rng.randint(2, 9)
    value = {"+": a + b, "-": a - b, "*": a * b}[op]
    turns = [("user", f"What is {a} {op} {b}?"), ("assistant", f"{value}" if terse else f"{a} {op} {b} = {value}.")]
    for _ in range(rng.randint(0, 2)):
        step = rng.choice(("add", "double", "subtract"))
        n = rng.randint(1, 20)
        question, new = {"add": (f"Now add {n} to that.", value + n), "double": ("And double it?", 2 * value),
                         "subtract": (f"Take away {n}.", value - n)}[step]
        turns += [("user", question), ("assistant", f"{new}" if terse else f"That gives {new}.")]
        value = new
    return turns


def _word(rng: random.Random, terse: bool) -> list[dict]:
    word = rng.choice(WORDS)
    task = rng.choice(("reverse", "upper", "count", "first", "last", "compare"))
    if task == "compare":
        x, y = rng.sample(range(1, 100), 2)
        question, answer = f"Which is larger, {x} or {y}?", f"{max(x, y)}" if terse else f"{max(x, y)} is larger."
        return [("user", question), ("assistant", answer)]
    question, answer, sentence = {
        "reverse": (f"Spell {word} backwards.", word[::-1], f"Backwards it is {word[::-1]}."),
        "upper": (f"Write {word} in capitals.", word.upper(), f"In capitals: {word.upper()}."),
        "count": (f"How many letters are in {word}?", str(len(word)), f"{word} has {len(word)} letters."),
        "first": (f"What is the first letter of {word}?", word[0], f"The first letter is {word[0]}."),
        "last": (f"What is the last letter of {word}?", word[-1], f"The last letter is {word[-1]}."),
    }[task]
    turns = [("user", question), ("assistant", answer if terse else sentence)]
    if rng.random() < 0.3:
        turns += [("user", "Thanks!"), ("assistant", "You're welcome.")]
    return turns


def make_conversations(n: int, seed: int = 0) -> list[dict]:
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        opening = [rng.choice(SYSTEMS)] if rng.random() < 0.35 else []
        terse = bool(opening) and opening[0][1] == "Reply with the answer only."
        turns = (_arithmetic if rng.random() < 0.55 else _word)(rng, terse)
        out.append({"messages": [{"role": r, "content": c} for r, c in opening + turns]})
    return out


def define_flags(fv: flags.FlagValues) -> None:
    flags.DEFINE_string("out", str(BUNDLED_CHAT_PATH), "where to write the .jsonl", flag_values=fv)
    flags.DEFINE_integer("conversations", 480, "how many conversations", flag_values=fv)
    flags.DEFINE_integer("seed", 0, "the same seed writes the same bytes", flag_values=fv)


def main(argv=None) -> int:
    args = cli.parse(define_flags, argv, __doc__)
    lines = [json.dumps(c, ensure_ascii=False) for c in make_conversations(args.conversations, args.seed)]
    pathlib.Path(args.out).write_text("\n".join(lines) + "\n", encoding="utf-8")
    print(f"wrote {args.out}: {len(lines)} conversations")
    return 0


if __name__ == "__main__":
    sys.exit(main())

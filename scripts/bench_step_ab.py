"""The host work per decode step of two checkouts side by side:
`scripts/bench_step.py --tiny --noop` run from each checkout (its own script, its package first
on `sys.path`), the two taking turns `--rounds` times, each going first in turn.

Per round and batch size the host work is the sum of the engine's phases with overlapped steps
off (the `off` row: schedule + launch + commit + read + other, each the median of its blocks),
i.e. a step's wall-clock time less its wait for the device. Reported: the median and range of
the rounds per checkout and the ratio A / B within each round. `bench_host_ab.py` times the same
workload by the engine thread's CPU time, which a busy machine disturbs less.

    python scripts/bench_step_ab.py --a .base --b . --seqs 1,8,64 --rounds 5 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys

HOST = ("schedule", "launch", "commit", "read", "other")
PHASES = ("schedule", "launch", "commit", "wait", "read", "other")  # bench_step.py's columns, in order


def parse(text: str) -> dict[int, dict[str, float]]:
    """The `off` rows of bench_step.py's table: batch size -> ms per step of each phase."""
    rows = {}
    for line in text.splitlines():
        cells = [c.strip() for c in line.split("|")]
        head = cells[0].split()
        if len(head) == 2 and head[1] == "off" and head[0].isdigit() and len(cells) >= 5 + len(PHASES):
            rows[int(head[0])] = dict(zip(PHASES, (float(c) for c in cells[-len(PHASES) :])))
    return rows


def run(checkout: str, seqs: str, steps: int, repeats: int, context: int | None) -> dict[int, dict[str, float]]:
    script = os.path.join(checkout, "scripts", "bench_step.py")
    args = [sys.executable, script, "--tiny", "--noop", "--seqs", seqs, "--steps", str(steps)]
    args += ["--repeats", str(repeats)]
    if context is not None:  # (a newer bench_step.py option: both checkouts must have it)
        args += ["--context", str(context)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(checkout))
    res = subprocess.run(args, env=env, capture_output=True, text=True, check=True)
    rows = parse(res.stdout)
    if sorted(rows) != sorted(int(s) for s in seqs.split(",")):
        raise SystemExit(f"bench_step.py in {checkout} printed no `off` row for some batch size:\n{res.stdout}")
    return rows


def summary(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--a", required=True, help="checkout A (the reference, e.g. the older commit)")
    ap.add_argument("--b", default=".", help="checkout B")
    ap.add_argument("--seqs", default="1,8,64")
    ap.add_argument("--steps", type=int, default=20, help="steps per block (bench_step.py --steps)")
    ap.add_argument("--repeats", type=int, default=5, help="blocks per engine (bench_step.py --repeats)")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--context", type=int, default=None, help="prompt tokens a request (bench_step.py --context)")
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    if args.rounds < 1:
        ap.error("--rounds must be >= 1")
    rounds: dict[str, list] = {"a": [], "b": []}
    for r in range(args.rounds):
        for side in ("a", "b") if r % 2 == 0 else ("b", "a"):
            rounds[side].append(run(getattr(args, side), args.seqs, args.steps, args.repeats, args.context))
            print(f"round {r + 1} {side} done", file=sys.stderr)
    result = {
        "command": "python scripts/bench_step_ab.py " + " ".join(sys.argv[1:]),
        "a": args.a,
        "b": args.b,
        "rounds": rounds,
        "by_seqs": {},
    }
    print(f"host ms per step (schedule + launch + commit + read + other), median of {args.rounds} rounds (range)")
    print(f"{'seqs':>4} | {'A':>22} | {'B':>22} | {'A / B within rounds':>22}")
    for n in (int(s) for s in args.seqs.split(",")):
        host = {side: [sum(x[n][p] for p in HOST) for x in rounds[side]] for side in ("a", "b")}
        ratio = [a / b for a, b in zip(host["a"], host["b"])]
        result["by_seqs"][n] = {"a": summary(host["a"]), "b": summary(host["b"]), "ratio": summary(ratio)}

        def cell(s: dict) -> str:
            return f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"

        row = result["by_seqs"][n]
        print(f"{n:>4} | {cell(row['a']):>22} | {cell(row['b']):>22} | {cell(row['ratio']):>22}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()

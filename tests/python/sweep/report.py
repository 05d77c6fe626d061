"""Outcomes, the table, and the CLI (python tests/python/sweep_models.py --help).

Outcomes: "supported" (every combination bitwise), "refused at install: ...", "refused at
run: ..." (an attnstash error in the first training forward, or, for a mask made from
parameters, which a reentrant recompute is the first to show, in its backward), "not
buildable: ...", "skipped: ..." (no SDPA attention, no gradient checkpointing, a GPU, a
download or a package it needs), "baseline not deterministic (...)" and "FAILED: ..." (a crash,
a timeout, a non-attnstash exception, an attnstash error in the backward, a wrong gradient,
wrong counters, something left in the stash).
"""
import argparse
import json
import os
import sys
import time

import torch
import transformers

from .models import model_types
from .pool import sweep

CATEGORIES = ("supported", "refused at install", "refused at run", "not buildable", "skipped",
              "baseline not deterministic", "FAILED")


def category(outcome):
    for name in CATEGORIES:
        if outcome.startswith(name):
            return name
    return "other"


def counts(rows):
    out = {c: 0 for c in CATEGORIES}
    for row in rows:
        out[category(row["outcome"])] = out.get(category(row["outcome"]), 0) + 1
    return out


def _layers_cell(row):
    stashed, attention, layers = row.get("stashed"), row.get("attention_layers"), row.get("layers_found")
    if stashed:
        text = ",".join(map(str, stashed)) + f" of {layers}"
        if attention is not None and attention != stashed:
            text += f" (attention: {','.join(map(str, attention))})"
        return text
    if attention:
        return f"(attention: {','.join(map(str, attention))} of {layers})"
    if layers is not None:
        return f"none of {layers}"
    return ""


def _cell(text):
    return str(text).replace("|", "\\|").replace("\n", " ")


def markdown(rows, title=None):
    """The summary line and the table, sorted by outcome, then type."""
    total = counts(rows)
    lines = [f"### {title}", ""] if title else []
    lines.append(", ".join(f"{n} {c}" for c, n in total.items() if n or c != "baseline not deterministic")
                 + f" (of {len(rows)})")
    lines += ["", "| type | head | outcome | stashed layers | batches | notes |", "|---|---|---|---|---|---|"]
    order = {c: i for i, c in enumerate(CATEGORIES)}
    for row in sorted(rows, key=lambda r: (order.get(category(r["outcome"]), len(order)), r["arch"])):
        notes = [n for n in row.get("notes") or [] if "\n" not in n]
        for combo, result in (row.get("combos") or {}).items():
            if result.get("baseline"):
                notes.append(f"{combo}: baseline {result['baseline']}")
        head = f"{row.get('head') or ''} ({row.get('model_class')})" if row.get("model_class") else ""
        batches = ", ".join(row.get("batches") or [])
        lines.append(f"| {row['arch']} | {_cell(head)} | {_cell(row['outcome'])} | {_layers_cell(row)} | {batches} "
                     f"| {_cell('; '.join(notes))} |")
    return "\n".join(lines) + "\n"


def main(argv=None):
    parser = argparse.ArgumentParser(description="The supported-model sweep: every model type of the installed "
                                                 "transformers, built tiny, trained with and without the stash.")
    parser.add_argument("--archs", help="comma-separated model types (default: every type)")
    parser.add_argument("--out", default="out/sweep", help="directory for sweep.json and sweep.md")
    parser.add_argument("--jobs", type=int, default=1, help="types run at once")
    parser.add_argument("--threads", type=int, default=1, help="torch threads per type")
    parser.add_argument("--timeout", type=int, default=300, help="seconds per type")
    args = parser.parse_args(argv)
    known = model_types()
    archs = args.archs.split(",") if args.archs else list(known)
    unknown = [a for a in archs if a not in known]
    if unknown:
        parser.error(f"not model types of transformers {transformers.__version__}: {', '.join(unknown)}")
    start = time.time()
    done = [0]

    def log(row):
        done[0] += 1
        print(f"[{done[0]}/{len(archs)}] {row['arch']} ({row.get('head')}): {row['outcome'][:200]} "
              f"({row.get('seconds')} s)", file=sys.stderr, flush=True)

    rows = sweep(archs, jobs=args.jobs, timeout=args.timeout, threads=args.threads, log=log)
    elapsed = time.time() - start
    title = (f"transformers {transformers.__version__}, torch {torch.__version__}: {len(rows)} model types "
             f"in {elapsed:.0f} s")
    table = markdown(rows, title)
    print(table)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "sweep.json"), "w") as f:
        json.dump(dict(transformers=transformers.__version__, torch=torch.__version__, seconds=round(elapsed, 1),
                       counts=counts(rows), rows=rows), f, indent=1, default=str)
    with open(os.path.join(args.out, "sweep.md"), "w") as f:
        f.write(table)
    return 1 if any(category(r["outcome"]) == "FAILED" for r in rows) else 0

#!/usr/bin/env python3
"""Reads a kvgate decision log (`kvgate serve --decision-log FILE`) and classifies every request
whose realized cache hit fell short of the best the fleet could have given it.

Usage: scripts/decision_report.py FILE [FILE ...]

Per request the log holds each candidate's predicted cached tokens (from the index at decision
time), router-side load, scores, the pick, and the engine's realized cached tokens. Categories:
- ok: realized >= the best prediction among candidates (minus one block), or nothing to hit;
- load_over_prefix: a candidate predicted more cached tokens, but the scorer preferred the pick
  for its lower load (the pick's total was higher because of load);
- tie: the pick and a better-predicted candidate had equal totals;
- mispredicted: the pick was predicted to hold more than it realized (stale index, eviction
  between decision and prefill, or a speculative entry the engine never confirmed);
- cold_duplicate: nothing predicted anywhere, realized 0, and another request of the same
  first-block prefix was in flight (a concurrent first wave on several engines);
- unknown: anything else.
"""
import json
import sys
from collections import Counter, defaultdict

BLOCK = 16


def classify(rec):
    runs = rec["decision"]["runs"]
    if not runs or rec.get("realized_cached_tokens") is None:
        return "no_data"
    run = runs[0]
    cands = run["candidates"]
    picked = run["picked"]
    pred = {c["endpoint"]: (c.get("predicted_cached_tokens") or 0) for c in cands}
    total = {c["endpoint"]: c["total"] for c in cands}
    best_ep = max(pred, key=pred.get)
    best = pred[best_ep]
    realized = rec["realized_cached_tokens"]
    mine = pred.get(picked, 0)
    if realized + BLOCK < mine:
        return "mispredicted"
    if best <= mine + BLOCK:
        return "ok"
    if abs(total[best_ep] - total[picked]) < 1e-12:
        return "tie"
    return "load_over_prefix"


def main():
    for path in sys.argv[1:]:
        recs = [json.loads(l) for l in open(path) if l.strip()]
        cats = Counter()
        lost = defaultdict(int)
        per_ep = Counter()
        prompt = cached = 0
        for r in recs:
            c = classify(r)
            cats[c] += 1
            runs = r["decision"]["runs"]
            if runs:
                cands = runs[0]["candidates"]
                best = max((x.get("predicted_cached_tokens") or 0) for x in cands)
                lost[c] += max(0, best - (r.get("realized_cached_tokens") or 0))
                per_ep[runs[0]["picked"]] += 1
            prompt += r.get("prompt_tokens") or 0
            cached += r.get("realized_cached_tokens") or 0
        print(f"== {path}: {len(recs)} requests, realized hit {100.0 * cached / max(prompt, 1):.1f}%")
        for c, n in cats.most_common():
            print(f"  {c:18} {n:5}  tokens short of the best prediction: {lost[c]}")
        print("  picks per endpoint:", dict(sorted(per_ep.items())))


if __name__ == "__main__":
    main()

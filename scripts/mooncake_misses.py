#!/usr/bin/env python3
"""Where a router's Mooncake replay lost hits: joins `kvgate bench` per-request records with
kvgate's decision log (the bench sends `x-request-id: bench-INDEX`) and the trace itself.

Usage: scripts/mooncake_misses.py [--window START..[END]] TRACE RESULTS_JSON [DECISIONS_JSONL]
  --window        the bench's --window (minutes): the trace requests it replayed are those
                  whose timestamp falls in [START, END), the first N of them (default: from 0)
  TRACE           ../shared/data/mooncake/conversation_trace.jsonl
  RESULTS_JSON    a bench run's results.json (peers.sh: OUT/raw/mooncake/ROUTER/repN/results.json)
  DECISIONS_JSONL kvgate's --decision-log of that run (peers.sh: OUT/logs/mooncake.kvgate.repN.0.decisions.jsonl)

Per request, the trace gives how many 512-token blocks it shares with an earlier request (its
hit with an infinite cache). Cached tokens are summed by that depth (0, 1 block: the common
system prompt, 2-9, 10+). With a decision log, each request sharing 2+ blocks is classified:
- evicted_everywhere: no engine held within one block of what it shares (bounded caches),
  and whether the request it continues went to the same engine;
- load_over_prefix: an engine held more, the scorer picked another for its load;
- mispredicted: the pick realized less than predicted;
- untokenized: routed without tokens (tokenizer busy or prompt too large);
- ok: the pick realized the best prediction.
"""
import json
import sys
from collections import Counter, defaultdict


def trace_depths(path, n, window=(0.0, None)):
    start, end = window
    reqs = [json.loads(l) for l in open(path) if l.strip()]
    reqs = [r for r in reqs if r["timestamp"] >= start * 60e3 and (end is None or r["timestamp"] < end * 60e3)][:n]
    seen, depth, parent = {}, [], []
    for i, r in enumerate(reqs):
        h, d, p = r["hash_ids"], 0, None
        for k in range(len(h)):
            t = tuple(h[: k + 1])
            if t not in seen:
                break
            d, p = k + 1, seen[t]
        depth.append(d)
        parent.append(p)
        for k in range(len(h)):
            seen[tuple(h[: k + 1])] = i
    return reqs, depth, parent


def parse_window(text):
    start, sep, end = text.partition("..")
    if not sep:
        sys.exit(f"--window {text}: expected START..[END] in minutes")
    return float(start or 0), float(end) if end else None


def main():
    window = (0.0, None)
    if len(sys.argv) > 2 and sys.argv[1] == "--window":
        window = parse_window(sys.argv[2])
        del sys.argv[1:3]
    if len(sys.argv) < 3:
        sys.exit(__doc__)
    recs = {x["index"]: x for x in json.load(open(sys.argv[2]))["runs"][0]["records"]}
    reqs, depth, parent = trace_depths(sys.argv[1], len(recs), window)
    ideal = [min(d * 512, max(r["input_length"] - 1, 0)) for d, r in zip(depth, reqs)]
    buckets = defaultdict(lambda: [0, 0, 0])
    for i, r in recs.items():
        d = depth[i]
        b = "0" if d == 0 else "1" if d == 1 else "2-9" if d < 10 else "10+"
        buckets[b][0] += 1
        buckets[b][1] += r.get("cached_tokens") or 0
        buckets[b][2] += ideal[i]
    prompt = sum(r.get("prompt_tokens") or 0 for r in recs.values())
    cached = sum(r.get("cached_tokens") or 0 for r in recs.values())
    print(f"{sys.argv[2]}: {len(recs)} requests, hit {100.0 * cached / max(prompt, 1):.2f}%")
    print("  shared blocks  requests  cached tokens  infinite-cache tokens")
    for b in ["0", "1", "2-9", "10+"]:
        n, c, i = buckets[b]
        print(f"  {b:>13}  {n:8}  {c:13}  {i:21}")
    if len(sys.argv) < 4:
        return
    log = {}
    for line in open(sys.argv[3]):
        d = json.loads(line)
        log[d["request_id"]] = d
    picked = {i: log[f"bench-{i}"]["decision"]["endpoint"] for i in recs if f"bench-{i}" in log}
    cats, lost = Counter(), Counter()
    for i, r in recs.items():
        if depth[i] < 2:
            continue
        got = r.get("cached_tokens") or 0
        d = log.get(f"bench-{i}")
        if d is None:
            c = "not_in_log"
        elif d.get("prompt_tokens") is None:
            c = "untokenized"
        else:
            cands = d["decision"]["runs"][0]["candidates"]
            best = max((x.get("predicted_cached_tokens") or 0) for x in cands)
            mine = d.get("predicted_cached_tokens") or 0
            if best + 512 < ideal[i]:
                same = picked.get(parent[i]) == d["decision"]["endpoint"]
                c = "evicted_everywhere" + ("" if same else " (continued elsewhere)")
            elif mine + 16 < best:
                c = "load_over_prefix"
            elif got + 16 < mine:
                c = "mispredicted"
            else:
                c = "ok"
        cats[c] += 1
        lost[c] += max(0, ideal[i] - got)
    print("  requests sharing 2+ blocks, by cause (tokens short of the infinite cache):")
    for c, n in cats.most_common():
        print(f"    {c:38} {n:5}  {lost[c]}")


if __name__ == "__main__":
    main()

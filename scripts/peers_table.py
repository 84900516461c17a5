#!/usr/bin/env python3
"""Tables for scripts/peers.sh: median and spread (max - min) over repeats.

    peers_table.py OUT_DIR            # writes OUT_DIR/summary.md and summary.json, prints the md
    peers_table.py --one RESULTS.json # one line about one run (progress output)

OUT_DIR layout (written by peers.sh):
    raw/<workload>/<router>/rep<k>/results.json   `kvgate bench` report (runs[0].summary)
    raw/<workload>/<router>/rep<k>/restart.json   NAME!restart runs: kill/restart times
    status.tsv     workload, router, repeat, status (ok|failed|skipped), reason
    order.txt      "workloads: a b c" and "routers: x y z" lines (table order)
Only the standard library is used.
"""

import json
import statistics
import sys
from pathlib import Path

# (key, header, getter, format)
METRICS = [
    ("hit_rate", "hit rate", lambda s: s.get("hit_rate"), "pct"),
    ("ttft_p50", "TTFT p50 ms", lambda s: s["ttft_ms"]["p50"], "ms"),
    ("ttft_p90", "TTFT p90 ms", lambda s: s["ttft_ms"]["p90"], "ms"),
    ("ttft_p99", "TTFT p99 ms", lambda s: s["ttft_ms"]["p99"], "ms"),
    ("itl_p99", "ITL p99 ms", lambda s: s["itl_ms"]["p99"], "ms"),
    ("req_s", "req/s", lambda s: s["requests_per_s"], "rate"),
    ("errors", "errors", lambda s: s["errors"], "int"),
]


def load_run(path):
    with open(path) as f:
        data = json.load(f)
    runs = data.get("runs") or []
    if not runs:
        raise ValueError(f"{path}: no runs")
    return runs[0]


def load_summary(path):
    return load_run(path)["summary"]


# Window after the restart for the "first N s after" hit rate.
AFTER_WINDOW_S = 2.0


def window_hit_rate(run, lo_ms, hi_ms):
    """cached / prompt tokens of the successful requests sent in [lo_ms, hi_ms) (unix ms)."""
    base = run.get("started_at_unix_ms") or 0
    prompt = cached = n = 0
    for r in run.get("records") or []:
        t = base + (r.get("start_ms") or 0)
        if not (lo_ms <= t < hi_ms) or r.get("error") or r.get("prompt_tokens") is None:
            continue
        prompt += r["prompt_tokens"]
        cached += r.get("cached_tokens") or 0
        n += 1
    return (cached / prompt if prompt else None), n


def restart_row(rep_dir):
    """The Restarts table's cells for one NAME!restart run (None without restart.json)."""
    p = rep_dir / "restart.json"
    if not p.exists():
        return None
    rs = json.loads(p.read_text())
    row = {"repeat": rep_dir.name, "restarted": rs.get("restarted"), "back_up": rs.get("back_up"),
           "downtime_s": rs.get("downtime_s"), "replays_complete": rs.get("replays_complete"),
           "last_replay_s_after_kill": rs.get("last_replay_s_after_kill"),
           "bench_flags": rs.get("bench_flags", "")}
    try:
        run = load_run(rep_dir / "results.json")
    except (OSError, ValueError, KeyError):
        return row
    s = run["summary"]
    row["errors"] = s.get("errors")
    row["requests"] = s.get("requests")
    start = run.get("started_at_unix_ms") or 0
    end = float("inf")
    kill = rs["kill_unix_us"] / 1000 if rs.get("kill_unix_us") else None
    up = rs["up_unix_us"] / 1000 if rs.get("up_unix_us") else None
    row["kill_s"] = (kill - start) / 1000 if kill is not None else None
    row["before"], row["before_n"] = window_hit_rate(run, 0, kill if kill is not None else end)
    if up is not None:
        row["after"], row["after_n"] = window_hit_rate(run, up, end)
        row["after_window"], row["after_window_n"] = window_hit_rate(run, up, up + AFTER_WINDOW_S * 1000)
        base = run.get("started_at_unix_ms") or 0
        row["errors_during_down"] = sum(
            1 for r in run.get("records") or []
            if r.get("error") and kill <= base + (r.get("start_ms") or 0) < up)
    return row


def fmt(kind, value):
    if value is None:
        return "n/a"
    if kind == "pct":
        return f"{value * 100:.1f}%"
    if kind == "ms":
        return f"{value:.1f}"
    if kind == "rate":
        return f"{value:.2f}"
    return f"{value:g}"


def fmt_spread(kind, value):
    if value is None:
        return ""
    if kind == "pct":
        return f"{value * 100:.1f}pp"
    return fmt(kind, value)


def one_line(path):
    s = load_summary(path)
    parts = [f"{header} {fmt(kind, get(s))}" for _, header, get, kind in METRICS]
    return f"{s['requests']} requests, " + ", ".join(parts)


def read_order(out):
    order = {"workloads": [], "routers": []}
    p = out / "order.txt"
    if p.exists():
        for line in p.read_text().splitlines():
            key, _, rest = line.partition(":")
            if key.strip() in order:
                order[key.strip()] = rest.split()
    return order


def read_status(out):
    rows = []
    p = out / "status.tsv"
    if p.exists():
        for line in p.read_text().splitlines():
            cells = line.split("\t")
            if len(cells) >= 4:
                rows.append((cells + [""])[:5])
    return rows


def aggregate(out):
    raw = out / "raw"
    order = read_order(out)
    found = {}
    if raw.exists():
        for res in sorted(raw.glob("*/*/rep*/results.json")):
            rep_dir = res.parent
            router, workload = rep_dir.parent.name, rep_dir.parent.parent.name
            try:
                summary = load_summary(res)
            except (OSError, ValueError, KeyError) as e:
                print(f"warning: {e}", file=sys.stderr)
                continue
            found.setdefault(workload, {}).setdefault(router, []).append((rep_dir.name, summary))
    workloads = [w for w in order["workloads"] if w in found]
    workloads += sorted(w for w in found if w not in workloads)
    result = {"workloads": {}}
    for w in workloads:
        routers = [r for r in order["routers"] if r in found[w]]
        routers += sorted(r for r in found[w] if r not in routers)
        result["workloads"][w] = {}
        for r in routers:
            reps = found[w][r]
            entry = {"repeats": [name for name, _ in reps], "requests": [], "errors_by_kind": {}}
            restarts = [x for x in (restart_row(raw / w / r / name) for name, _ in reps) if x]
            if restarts:
                entry["restarts"] = restarts
            for _, s in reps:
                entry["requests"].append(s["requests"])
                for k, n in (s.get("errors_by_kind") or {}).items():
                    entry["errors_by_kind"][k] = entry["errors_by_kind"].get(k, 0) + n
            for key, _, get, _ in METRICS:
                values = [v for v in (get(s) for _, s in reps) if v is not None]
                entry[key] = {
                    "values": values,
                    "median": statistics.median(values) if values else None,
                    "spread": (max(values) - min(values)) if values else None,
                }
            result["workloads"][w][r] = entry
    return result


def markdown(out, result):
    status = read_status(out)
    lines = ["# kvgate vs peer routers", ""]
    meta = out / "meta.txt"
    if meta.exists():
        lines += ["```", meta.read_text().rstrip(), "```", ""]
    lines += [
        "Each cell: median over repeats, then the spread (max − min) in parentheses;",
        "hit rate is cached / prompt tokens as the engines report them.",
        "",
    ]
    for w, routers in result["workloads"].items():
        lines += [f"## {w}", ""]
        header = ["router", "runs"] + [h for _, h, _, _ in METRICS]
        lines.append("| " + " | ".join(header) + " |")
        lines.append("|" + "---|" * len(header))
        for r, e in routers.items():
            cells = [r, str(len(e["repeats"]))]
            for key, _, _, kind in METRICS:
                m = e[key]
                cell = fmt(kind, m["median"])
                if len(m["values"]) > 1:
                    cell += f" ({fmt_spread(kind, m['spread'])})"
                cells.append(cell)
            lines.append("| " + " | ".join(cells) + " |")
        kinds = {
            r: e["errors_by_kind"] for r, e in routers.items() if e["errors_by_kind"]
        }
        if kinds:
            lines.append("")
            for r, k in kinds.items():
                lines.append(f"- {r} errors (all repeats): " + ", ".join(f"{a}: {n}" for a, n in k.items()))
        restarts = {r: e["restarts"] for r, e in routers.items() if e.get("restarts")}
        if restarts:
            lines += restart_table(restarts)
        lines.append("")
    problems = [row for row in status if row[3] != "ok"]
    if problems:
        lines += ["## Skipped or failed", "", "| workload | router | repeat | status | reason |", "|---|---|---|---|---|"]
        for row in problems:
            lines.append("| " + " | ".join(c.replace("|", "\\|") for c in row) + " |")
        lines.append("")
    return "\n".join(lines)


def restart_table(restarts):
    pct = lambda v, n: "n/a" if v is None else f"{v * 100:.1f}% ({n})"
    sec = lambda v: "n/a" if v is None else f"{v:.2f}"
    lines = [
        "",
        "Restarts (NAME!restart: replica 0 SIGKILLed, then started again on the same ports).",
        "Hit rate over the successful requests sent before the kill / after it answered again"
        f" / in the first {AFTER_WINDOW_S:g} s after (request count in parentheses); killed at:"
        " seconds into the load; replays: complete KV-event replays the restarted replica logged"
        " (and when the last one was, in seconds after the kill).",
        "",
        "| router | repeat | killed at s | down s | errors (while down) | hit rate before | after"
        f" | first {AFTER_WINDOW_S:g} s after | replays |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    flags = set()
    for r, rows in restarts.items():
        for x in rows:
            flags.add(x.get("bench_flags", ""))
            if not x.get("restarted"):
                lines.append(f"| {r} | {x['repeat']} | no restart (the bench ended first) | | | | | | |")
                continue
            errs = "n/a" if x.get("errors") is None else f"{x['errors']}"
            if x.get("errors_during_down") is not None:
                errs += f" ({x['errors_during_down']})"
            down = sec(x.get("downtime_s")) if x.get("back_up") else "did not come back"
            replays = f"{x.get('replays_complete', 'n/a')}"
            if x.get("last_replay_s_after_kill") is not None:
                replays += f" (by {x['last_replay_s_after_kill']:.2f} s)"
            lines.append(
                f"| {r} | {x['repeat']} | {sec(x.get('kill_s'))} | {down} | {errs} | "
                f"{pct(x.get('before'), x.get('before_n'))} | {pct(x.get('after'), x.get('after_n'))} | "
                f"{pct(x.get('after_window'), x.get('after_window_n'))} | {replays} |"
            )
    for f in sorted(flags):
        if f:
            lines += ["", f"Restart rows ran the bench with: `{f}`"]
    return lines


def main(argv):
    if len(argv) == 3 and argv[1] == "--one":
        print(one_line(argv[2]))
        return 0
    if len(argv) != 2:
        print(__doc__, file=sys.stderr)
        return 2
    out = Path(argv[1])
    result = aggregate(out)
    md = markdown(out, result)
    (out / "summary.md").write_text(md + "\n")
    (out / "summary.json").write_text(json.dumps(result, indent=2) + "\n")
    print(md)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))

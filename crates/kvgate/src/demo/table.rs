//! The demo's terminal output: one table and a few plain-words lines, all computed from
//! the runs' summaries (the first run is the baseline).

use std::fmt::Write;

use kvgate_bench::{Ratios, RunSummary};

use super::policies::{Policy, Setup};

/// The table, one sentence per setup after the baseline, and what the replica runs show.
pub(crate) fn render(setups: &[Setup], summaries: &[RunSummary]) -> String {
    let mut out = format!(
        "{:<17} {:>9} {:>10} {:>10} {:>8} {:>8} {:>9} {:>9}\n",
        "policy", "hit rate", "TTFT p50", "TTFT p99", "req/s", "errors", "hit ×RR", "p50 ×RR"
    );
    let Some(base) = summaries.first() else {
        return out;
    };
    for (setup, s) in setups.iter().zip(summaries) {
        let r = Ratios::of(s, base);
        let _ = writeln!(
            out,
            "{:<17} {:>9} {:>8.1}ms {:>8.1}ms {:>8.2} {:>8} {:>9} {:>9}",
            setup.name(),
            percent(s.hit_rate),
            s.ttft_ms.p50,
            s.ttft_ms.p99,
            s.requests_per_s,
            s.errors,
            times(r.hit_rate),
            times(r.ttft_p50),
        );
    }
    out.push('\n');
    for (setup, s) in setups.iter().zip(summaries).skip(1) {
        let _ = writeln!(out, "{}", sentence(&setup.description(), s, base));
    }
    if let Some(text) = replicas(setups, summaries) {
        out.push('\n');
        out += &text;
    }
    out
}

/// "precise prefix routing: 3.4x the cache hit rate of round-robin; TTFT p50 41% lower".
fn sentence(label: &str, s: &RunSummary, base: &RunSummary) -> String {
    let r = Ratios::of(s, base);
    let hits = match (r.hit_rate, s.hit_rate) {
        (Some(x), _) => format!("{x:.1}x the cache hit rate of round-robin"),
        (None, Some(h)) => format!("{:.1}% cache hit rate (round-robin had none)", h * 100.0),
        (None, None) => "no cache hit rate reported".to_owned(),
    };
    let ttft = match r.ttft_p50 {
        Some(x) if x <= 1.0 => format!("TTFT p50 {:.0}% lower", (1.0 - x) * 100.0),
        Some(x) => format!("TTFT p50 {:.0}% higher", (x - 1.0) * 100.0),
        None => "TTFT p50 not comparable".to_owned(),
    };
    let throughput = match r.throughput {
        Some(x) => format!("{x:.2}x the throughput"),
        None => "throughput not comparable".to_owned(),
    };
    format!("{label}: {hits}; {ttft}; {throughput}")
}

/// What the replica runs show: each prefix policy on one router and on N, and precise
/// against approximate on N. `None` unless all four runs reported a hit rate.
fn replicas(setups: &[Setup], summaries: &[RunSummary]) -> Option<String> {
    let hit = |policy: Policy, one: bool| {
        setups
            .iter()
            .zip(summaries)
            .find(|(s, _)| s.policy == policy && (s.replicas == 1) == one)
            .and_then(|(s, r)| Some((s.replicas, r.hit_rate? * 100.0)))
    };
    let (_, approx_1) = hit(Policy::ApproxPrefix, true)?;
    let (n, approx_n) = hit(Policy::ApproxPrefix, false)?;
    let (_, precise_1) = hit(Policy::PrecisePrefix, true)?;
    let (_, precise_n) = hit(Policy::PrecisePrefix, false)?;
    let mut out = format!(
        "{n} router replicas, requests alternating between them (consecutive turns of a \
         conversation\nreach different replicas):\n"
    );
    let approx_why = if approx_n <= approx_1 - 1.0 {
        "each replica knows only the requests it routed itself, so the replicas split\n    \
         a group's conversations across engines that each have to cache its prompt."
    } else {
        "each replica knows only the requests it routed itself; this time their guesses\n    \
         happened to agree."
    };
    let _ = writeln!(
        out,
        "  approximate prefix: {approx_1:.1}% hit rate on one router, {approx_n:.1}% on {n} ({}):\n    \
         {approx_why}",
        change(approx_1, approx_n)
    );
    let _ = writeln!(
        out,
        "  precise prefix:     {precise_1:.1}% on one router, {precise_n:.1}% on {n} ({}):\n    \
         every replica reads every engine's KV events, so all of them see the same cache.",
        change(precise_1, precise_n)
    );
    let verdict = if precise_n > approx_n {
        format!(
            "  On {n} replicas, precise routing hit the cache {:.1} points more often than \
             approximate routing.",
            precise_n - approx_n
        )
    } else {
        format!(
            "  On {n} replicas, precise routing did not beat approximate routing in this run \
             ({precise_n:.1}% vs {approx_n:.1}%)."
        )
    };
    out += &verdict;
    out.push('\n');
    Some(out)
}

/// "down 12.3 points", "up 0.4 points" or "unchanged" (below 0.05 points).
fn change(one: f64, many: f64) -> String {
    let d = many - one;
    if d.abs() < 0.05 {
        "unchanged".to_owned()
    } else {
        let dir = if d < 0.0 { "down" } else { "up" };
        format!("{dir} {:.1} points", d.abs())
    }
}

fn percent(x: Option<f64>) -> String {
    x.map_or_else(|| "n/a".to_owned(), |h| format!("{:.1}%", h * 100.0))
}

fn times(x: Option<f64>) -> String {
    x.map_or_else(|| "n/a".to_owned(), |r| format!("{r:.2}x"))
}

#[cfg(test)]
mod tests {
    use kvgate_bench::Percentiles;

    use super::*;

    fn summary(hit: f64, p50: f64) -> RunSummary {
        RunSummary {
            hit_rate: Some(hit),
            ttft_ms: Percentiles {
                p50,
                ..Percentiles::default()
            },
            requests_per_s: 10.0,
            ..RunSummary::default()
        }
    }

    #[test]
    fn sentences_follow_the_numbers() {
        let base = summary(0.2, 100.0);
        let cases = [
            (
                summary(0.68, 59.0),
                "precise prefix routing: 3.4x the cache hit rate of round-robin; TTFT p50 41% lower",
            ),
            (
                summary(0.2, 120.0),
                "precise prefix routing: 1.0x the cache hit rate of round-robin; TTFT p50 20% higher",
            ),
        ];
        for (s, want) in cases {
            let got = sentence("precise prefix routing", &s, &base);
            assert!(got.starts_with(want), "{got}");
        }
        let table = render(&Setup::ALL[..1], &[base]);
        assert!(
            table.contains("round-robin") && table.contains("1.00x"),
            "{table}"
        );
        assert!(!table.contains("replicas"), "{table}");
    }

    #[test]
    fn replica_lines_follow_the_numbers() {
        let table = |hits: [f64; 5]| {
            let summaries: Vec<_> = hits.iter().map(|&h| summary(h, 50.0)).collect();
            render(&Setup::ALL, &summaries)
        };
        let split = table([0.1, 0.6, 0.7, 0.45, 0.69]);
        for want in [
            "approx-prefix×2",
            "precise-prefix×2",
            "approximate prefix routing on 2 replicas: 4.5x the cache hit rate",
            "approximate prefix: 60.0% hit rate on one router, 45.0% on 2 (down 15.0 points)",
            "the replicas split",
            "precise prefix:     70.0% on one router, 69.0% on 2 (down 1.0 points)",
            "precise routing hit the cache 24.0 points more often than approximate routing.",
        ] {
            assert!(split.contains(want), "{want}:\n{split}");
        }
        let agreed = table([0.1, 0.6, 0.7, 0.7, 0.65]);
        for want in [
            "60.0% hit rate on one router, 70.0% on 2 (up 10.0 points)",
            "happened to agree",
            "did not beat approximate routing in this run (65.0% vs 70.0%)",
        ] {
            assert!(agreed.contains(want), "{want}:\n{agreed}");
        }
    }
}

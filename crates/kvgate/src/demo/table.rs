//! The demo's terminal output: one table and a few plain-words lines, all computed from
//! the runs' summaries (the first run is the baseline).

use std::fmt::Write;

use kvgate_bench::{Ratios, RunSummary};

use super::policies::Policy;

/// The table plus one sentence per policy after the baseline.
pub(crate) fn render(names: &[&str], summaries: &[RunSummary]) -> String {
    let mut out = format!(
        "{:<15} {:>9} {:>10} {:>10} {:>8} {:>8} {:>9} {:>9}\n",
        "policy", "hit rate", "TTFT p50", "TTFT p99", "req/s", "errors", "hit ×RR", "p50 ×RR"
    );
    let Some(base) = summaries.first() else {
        return out;
    };
    for (name, s) in names.iter().zip(summaries) {
        let r = Ratios::of(s, base);
        let _ = writeln!(
            out,
            "{name:<15} {:>9} {:>8.1}ms {:>8.1}ms {:>8.2} {:>8} {:>9} {:>9}",
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
    for (name, s) in names.iter().zip(summaries).skip(1) {
        let _ = writeln!(out, "{}", sentence(name, s, base));
    }
    out
}

/// "precise prefix routing: 3.4x the cache hit rate of round-robin; TTFT p50 41% lower".
fn sentence(name: &str, s: &RunSummary, base: &RunSummary) -> String {
    let label = Policy::ALL
        .iter()
        .find(|p| p.name() == name)
        .map_or(name, |p| p.description());
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
            let got = sentence("precise-prefix", &s, &base);
            assert!(got.starts_with(want), "{got}");
        }
        let table = render(
            &["round-robin", "precise-prefix"],
            &[base, summary(0.5, 50.0)],
        );
        assert!(
            table.contains("round-robin") && table.contains("2.50x"),
            "{table}"
        );
    }
}

//! Prometheus text parser (`kvgate_schedule::parse_text`, `EngineMetrics::from_text`).
//!
//! Any text: never panics. Every sample re-rendered in the text format (labels escaped,
//! special values spelled `NaN`/`+Inf`/`-Inf`) parses back to the same sample, and the
//! malformed-line count agrees between the two entry points.
#![no_main]

use std::fmt::Write as _;

use kvgate_schedule::{EngineMetrics, Sample, parse_text};
use libfuzzer_sys::fuzz_target;

fn render(s: &Sample<'_>) -> String {
    let mut out = String::from(s.name);
    if !s.labels.is_empty() {
        out.push('{');
        for (i, (k, v)) in s.labels.iter().enumerate() {
            if i > 0 {
                out.push(',');
            }
            out.push_str(k);
            out.push_str("=\"");
            for c in v.chars() {
                match c {
                    '\\' => out.push_str("\\\\"),
                    '"' => out.push_str("\\\""),
                    '\n' => out.push_str("\\n"),
                    c => out.push(c),
                }
            }
            out.push('"');
        }
        out.push('}');
    }
    let v = s.value;
    if v.is_nan() {
        out.push_str(" NaN");
    } else if v == f64::INFINITY {
        out.push_str(" +Inf");
    } else if v == f64::NEG_INFINITY {
        out.push_str(" -Inf");
    } else {
        let _ = write!(out, " {v:?}");
    }
    out
}

fn same_value(a: f64, b: f64) -> bool {
    a.to_bits() == b.to_bits() || (a.is_nan() && b.is_nan())
}

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let mut samples = Vec::new();
    let bad = parse_text(text, |s| samples.push(s));
    for s in &samples {
        assert!(!s.name.is_empty());
        let line = render(s);
        let mut again = Vec::new();
        let bad_again = parse_text(&line, |b| {
            let labels: Vec<(String, String)> = b
                .labels
                .iter()
                .map(|(k, v)| ((*k).to_owned(), v.to_string()))
                .collect();
            again.push((b.name.to_owned(), b.value, labels));
        });
        assert_eq!(bad_again, 0, "re-rendered line is malformed: {line:?}");
        assert_eq!(
            again.len(),
            1,
            "re-rendered line gave {} samples: {line:?}",
            again.len()
        );
        let (name, value, labels) = &again[0];
        assert_eq!(name, s.name, "{line:?}");
        assert!(
            same_value(*value, s.value),
            "{value} != {} for {line:?}",
            s.value
        );
        let want: Vec<(String, String)> = s
            .labels
            .iter()
            .map(|(k, v)| ((*k).to_owned(), v.to_string()))
            .collect();
        assert_eq!(labels, &want, "{line:?}");
    }
    let m = EngineMetrics::from_text(text);
    assert_eq!(m.malformed_lines, bad);
});

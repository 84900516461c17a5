//! SVG charts drawn with plotters' SVG backend (text is emitted as SVG `<text>`, so no
//! system fonts are needed).

use plotters::{coord::Shift, prelude::*};

use super::NamedRun;
use crate::BenchError;

const SIZE: (u32, u32) = (960, 540);
/// At most this many points per CDF line; larger runs are sampled at even ranks.
const MAX_POINTS: usize = 400;
/// Time buckets in the hit-rate chart.
const BUCKETS: usize = 24;

/// The TTFT CDF of every run, one line each, on one chart.
pub(super) fn ttft_cdf(runs: &[NamedRun]) -> Result<String, BenchError> {
    let lines: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|run| {
            let mut ttft: Vec<f64> = run
                .result
                .records
                .iter()
                .filter(|r| r.is_ok())
                .filter_map(|r| r.ttft_ms)
                .collect();
            ttft.sort_by(f64::total_cmp);
            (run.name.clone(), cdf_points(&ttft))
        })
        .collect();
    let x_max = lines
        .iter()
        .flat_map(|(_, points)| points.iter().map(|p| p.0))
        .fold(0.0, f64::max);
    draw(
        "ttft_cdf.svg",
        "TTFT CDF",
        "TTFT (ms)",
        "fraction of requests",
        x_max * 1.05,
        &lines,
    )
}

/// Each run's hit rate (cached / prompt tokens) over time, bucketed by completion time.
pub(super) fn hit_rate_over_time(runs: &[NamedRun]) -> Result<String, BenchError> {
    let end_s = |r: &crate::RequestRecord| (r.start_ms + r.e2e_ms) / 1000.0;
    let horizon = runs
        .iter()
        .flat_map(|run| run.result.records.iter().map(end_s))
        .fold(0.0, f64::max)
        .max(1e-3);
    let width = horizon / BUCKETS as f64;
    let lines: Vec<(String, Vec<(f64, f64)>)> = runs
        .iter()
        .map(|run| {
            let mut sums = [(0u64, 0u64); BUCKETS];
            for r in run.result.records.iter().filter(|r| r.is_ok()) {
                if let Some(prompt) = r.prompt_tokens {
                    let b = ((end_s(r) / width) as usize).min(BUCKETS - 1);
                    sums[b].0 += r.cached_tokens.unwrap_or(0);
                    sums[b].1 += prompt;
                }
            }
            let points = sums
                .iter()
                .enumerate()
                .filter(|(_, (_, prompt))| *prompt > 0)
                .map(|(b, (cached, prompt))| {
                    ((b as f64 + 0.5) * width, *cached as f64 / *prompt as f64)
                })
                .collect();
            (run.name.clone(), points)
        })
        .collect();
    draw(
        "hit_rate.svg",
        "Prefix-cache hit rate over time",
        "time (s)",
        "hit rate (cached / prompt tokens)",
        horizon,
        &lines,
    )
}

/// CDF points of sorted samples, sampled down to [`MAX_POINTS`].
fn cdf_points(sorted: &[f64]) -> Vec<(f64, f64)> {
    let n = sorted.len();
    if n == 0 {
        return Vec::new();
    }
    let step = n.div_ceil(MAX_POINTS).max(1);
    let mut points: Vec<(f64, f64)> = (0..n)
        .step_by(step)
        .map(|i| (sorted[i], (i + 1) as f64 / n as f64))
        .collect();
    if points.last().is_some_and(|p| p.1 < 1.0) {
        points.push((sorted[n - 1], 1.0));
    }
    points
}

fn draw(
    file: &str,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    x_max: f64,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<String, BenchError> {
    let plot_err = |e: String| BenchError::Plot {
        name: file.to_owned(),
        reason: e,
    };
    let x_max = if x_max > 0.0 && x_max.is_finite() {
        x_max
    } else {
        1.0
    };
    let mut svg = String::new();
    {
        let root = SVGBackend::with_string(&mut svg, SIZE).into_drawing_area();
        chart(&root, caption, x_desc, y_desc, x_max, lines).map_err(plot_err)?;
        root.present().map_err(|e| plot_err(e.to_string()))?;
    }
    Ok(svg)
}

fn chart(
    root: &DrawingArea<SVGBackend<'_>, Shift>,
    caption: &str,
    x_desc: &str,
    y_desc: &str,
    x_max: f64,
    lines: &[(String, Vec<(f64, f64)>)],
) -> Result<(), String> {
    let e = |e: DrawingAreaErrorKind<_>| e.to_string();
    root.fill(&WHITE).map_err(e)?;
    let mut chart = ChartBuilder::on(root)
        .caption(caption, ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(44)
        .y_label_area_size(60)
        .build_cartesian_2d(0f64..x_max, 0f64..1.0)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc(x_desc)
        .y_desc(y_desc)
        .draw()
        .map_err(e)?;
    for (i, (name, points)) in lines.iter().enumerate() {
        let color = Palette99::pick(i).to_rgba();
        let style = color.stroke_width(2);
        chart
            .draw_series(LineSeries::new(points.iter().copied(), style))
            .map_err(e)?
            .label(name.as_str())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(e)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cdf_points_reach_one_and_are_bounded() {
        let cases = [(0, 0), (1, 1), (10, 10), (1000, 334), (401, 201)];
        for (n, want_len) in cases {
            let samples: Vec<f64> = (0..n).map(f64::from).collect();
            let points = cdf_points(&samples);
            assert_eq!(points.len(), want_len, "n={n}");
            if n > 0 {
                assert_eq!(points.last().map(|p| p.1), Some(1.0), "n={n}");
                assert!(points.len() <= MAX_POINTS + 1);
            }
        }
    }
}

//! Reports: the JSON result file, markdown tables, SVG plots and an HTML page.
//!
//! [`write_report`] writes, into one directory:
//! - `results.json`: every run with its summary and every request's record;
//! - `summary.md`: the summary table (runs as rows, then hit-rate ceilings as `oracle`
//!   rows when [`ScopedCeiling`]s are given) and, with two or more runs, the
//!   comparison table (ratios against the first run);
//! - `ttft_cdf.svg`: the TTFT CDF of every run on one chart;
//! - `hit_rate.svg`: each run's hit rate over time, bucketed by completion time;
//! - `index.html`: the tables as HTML with both SVGs inlined (no external assets).

mod html;
mod plot;

use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::{BenchError, OracleHits, Ratios, RequestRecord, RunResult, RunSummary, ScopedCeiling};

/// A run with the name it has in tables and plots (say, a routing policy).
#[derive(Debug, Clone)]
pub struct NamedRun {
    /// The name shown in reports.
    pub name: String,
    /// The run.
    pub result: RunResult,
}

impl NamedRun {
    /// A run named after its target.
    pub fn from_result(result: RunResult) -> Self {
        Self {
            name: result.target.name.clone(),
            result,
        }
    }
}

/// The files [`write_report`] wrote.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReportFiles {
    /// `results.json`.
    pub json: PathBuf,
    /// `summary.md`.
    pub markdown: PathBuf,
    /// `ttft_cdf.svg`.
    pub ttft_cdf_svg: PathBuf,
    /// `hit_rate.svg`.
    pub hit_rate_svg: PathBuf,
    /// `index.html`.
    pub html: PathBuf,
}

/// Writes the full report for `runs` into `dir` (created if missing). `extra_markdown`
/// (such as the overhead table) is appended to `summary.md` and the HTML page.
///
/// # Errors
/// [`BenchError::Io`] when a file cannot be written, [`BenchError::Plot`] when a chart
/// cannot be drawn.
pub fn write_report(
    dir: &Path,
    runs: &[NamedRun],
    extra_markdown: Option<&str>,
) -> Result<ReportFiles, BenchError> {
    write_report_with(dir, runs, extra_markdown, &[])
}

/// [`write_report`] with hit-rate ceilings: `oracle` rows in the summary table and an
/// `oracles` list in `results.json`.
///
/// # Errors
/// As [`write_report`].
pub fn write_report_with(
    dir: &Path,
    runs: &[NamedRun],
    extra_markdown: Option<&str>,
    ceilings: &[ScopedCeiling],
) -> Result<ReportFiles, BenchError> {
    std::fs::create_dir_all(dir).map_err(|e| BenchError::io(dir, e))?;
    let summaries: Vec<RunSummary> = runs.iter().map(|r| r.result.summary()).collect();
    let files = ReportFiles {
        json: dir.join("results.json"),
        markdown: dir.join("summary.md"),
        ttft_cdf_svg: dir.join("ttft_cdf.svg"),
        hit_rate_svg: dir.join("hit_rate.svg"),
        html: dir.join("index.html"),
    };

    let json = results_json(runs, &summaries, ceilings)?;
    write(&files.json, json.as_bytes())?;

    let tables = tables(runs, &summaries, ceilings);
    let mut markdown = String::new();
    for table in &tables {
        markdown.push_str(&table.to_markdown());
        markdown.push('\n');
    }
    if let Some(extra) = extra_markdown {
        markdown.push_str(extra);
    }
    write(&files.markdown, markdown.as_bytes())?;

    let ttft = plot::ttft_cdf(runs)?;
    write(&files.ttft_cdf_svg, ttft.as_bytes())?;
    let hits = plot::hit_rate_over_time(runs)?;
    write(&files.hit_rate_svg, hits.as_bytes())?;

    let page = html::page(&tables, extra_markdown, &[&ttft, &hits]);
    write(&files.html, page.as_bytes())?;
    Ok(files)
}

/// The markdown summary table (and the comparison table when there are two or more
/// runs), as printed to the terminal.
pub fn summary_markdown(runs: &[NamedRun]) -> String {
    summary_markdown_with(runs, &[])
}

/// [`summary_markdown`] with hit-rate ceilings as `oracle` rows.
pub fn summary_markdown_with(runs: &[NamedRun], ceilings: &[ScopedCeiling]) -> String {
    let summaries: Vec<RunSummary> = runs.iter().map(|r| r.result.summary()).collect();
    tables(runs, &summaries, ceilings)
        .iter()
        .map(Table::to_markdown)
        .collect::<Vec<_>>()
        .join("\n")
}

fn write(path: &Path, bytes: &[u8]) -> Result<(), BenchError> {
    std::fs::write(path, bytes).map_err(|e| BenchError::io(path, e))
}

fn results_json(
    runs: &[NamedRun],
    summaries: &[RunSummary],
    oracles: &[ScopedCeiling],
) -> Result<String, BenchError> {
    #[derive(Serialize)]
    struct Run<'a> {
        name: &'a str,
        target: &'a crate::Target,
        workload: &'a str,
        started_at_unix_ms: u64,
        summary: &'a RunSummary,
        #[serde(skip_serializing_if = "Option::is_none")]
        ratios_to_first: Option<Ratios>,
        records: &'a [RequestRecord],
    }
    #[derive(Serialize)]
    struct File<'a> {
        runs: Vec<Run<'a>>,
        #[serde(skip_serializing_if = "<[_]>::is_empty")]
        oracles: &'a [ScopedCeiling],
    }
    let file = File {
        oracles,
        runs: runs
            .iter()
            .zip(summaries)
            .map(|(run, summary)| Run {
                name: &run.name,
                target: &run.result.target,
                workload: &run.result.workload,
                started_at_unix_ms: run.result.started_at_unix_ms,
                summary,
                ratios_to_first: (runs.len() > 1)
                    .then(|| summaries.first().map(|base| Ratios::of(summary, base)))
                    .flatten(),
                records: &run.result.records,
            })
            .collect(),
    };
    Ok(serde_json::to_string(&file)?)
}

/// A table rendered both as markdown and as HTML.
#[derive(Debug, Clone)]
pub(crate) struct Table {
    pub(crate) title: String,
    pub(crate) header: Vec<&'static str>,
    pub(crate) rows: Vec<Vec<String>>,
}

impl Table {
    pub(crate) fn to_markdown(&self) -> String {
        let mut out = format!("### {}\n\n| {} |\n|", self.title, self.header.join(" | "));
        out.push_str(&"---|".repeat(self.header.len()));
        out.push('\n');
        for row in &self.rows {
            let cells: Vec<String> = row.iter().map(|c| c.replace('|', "\\|")).collect();
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
        out
    }
}

/// The columns of the runs table.
const RUN_HEADER: [&str; 13] = [
    "run",
    "requests",
    "errors",
    "hit rate",
    "TTFT p50",
    "TTFT p90",
    "TTFT p99",
    "ITL p50",
    "ITL p99",
    "E2E p50",
    "E2E p99",
    "req/s",
    "out tok/s",
];

fn tables(runs: &[NamedRun], summaries: &[RunSummary], ceilings: &[ScopedCeiling]) -> Vec<Table> {
    let ms = |x: f64| format!("{x:.1}");
    let pct = |x: Option<f64>| x.map_or_else(|| "n/a".to_owned(), |h| format!("{:.1}%", h * 100.0));
    let mut out = vec![Table {
        title: "Runs".to_owned(),
        header: RUN_HEADER.to_vec(),
        rows: runs
            .iter()
            .zip(summaries)
            .map(|(run, s)| {
                vec![
                    run.name.clone(),
                    s.requests.to_string(),
                    errors_cell(s),
                    pct(s.hit_rate),
                    ms(s.ttft_ms.p50),
                    ms(s.ttft_ms.p90),
                    ms(s.ttft_ms.p99),
                    ms(s.itl_ms.p50),
                    ms(s.itl_ms.p99),
                    ms(s.e2e_ms.p50),
                    ms(s.e2e_ms.p99),
                    format!("{:.2}", s.requests_per_s),
                    format!("{:.1}", s.output_tokens_per_s),
                ]
            })
            .chain(ceilings.iter().flat_map(oracle_rows))
            .collect(),
    }];
    if let (true, Some(base)) = (runs.len() > 1, summaries.first()) {
        let times = |x: Option<f64>| x.map_or_else(|| "n/a".to_owned(), |r| format!("{r:.2}×"));
        out.push(Table {
            title: format!("Compared with {}", runs[0].name),
            header: vec![
                "run",
                "hit rate",
                "hit ratio",
                "TTFT p50",
                "p50 ratio",
                "TTFT p99",
                "p99 ratio",
                "req/s",
                "throughput ratio",
            ],
            rows: runs
                .iter()
                .zip(summaries)
                .map(|(run, s)| {
                    let r = Ratios::of(s, base);
                    vec![
                        run.name.clone(),
                        pct(s.hit_rate),
                        times(r.hit_rate),
                        ms(s.ttft_ms.p50),
                        times(r.ttft_p50),
                        ms(s.ttft_ms.p99),
                        times(r.ttft_p99),
                        format!("{:.2}", s.requests_per_s),
                        times(r.throughput),
                    ]
                })
                .collect(),
        });
    }
    out
}

/// The `oracle` rows of the summary table: the name, the requests and the hit rate.
fn oracle_rows(scoped: &ScopedCeiling) -> Vec<Vec<String>> {
    let (scope, c) = (&scoped.scope, &scoped.ceiling);
    let row = |name: String, hits: &OracleHits| {
        let rate = hits
            .hit_rate
            .map_or_else(|| "n/a".to_owned(), |h| format!("{:.1}%", h * 100.0));
        let mut cells = vec![name, c.requests.to_string(), "—".to_owned(), rate];
        cells.resize(RUN_HEADER.len(), "—".to_owned());
        cells
    };
    let mut rows = vec![row(
        format!(
            "oracle ({scope}): infinite cache, {}-token blocks",
            c.block_size
        ),
        &c.infinite,
    )];
    if let Some(lru) = &c.lru {
        let n = lru.capacity_blocks.unwrap_or(0);
        rows.push(row(format!("oracle ({scope}): LRU {n} blocks"), lru));
    }
    rows
}

fn errors_cell(s: &RunSummary) -> String {
    if s.errors == 0 {
        return "0".to_owned();
    }
    let kinds: Vec<String> = s
        .errors_by_kind
        .iter()
        .map(|(k, n)| format!("{k}: {n}"))
        .collect();
    format!("{} ({})", s.errors, kinds.join(", "))
}

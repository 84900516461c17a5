//! A small Prometheus text-format parser and the engine metrics kvgate reads from it.
//!
//! The parser accepts what vLLM and SGLang emit and what `prometheus-parse` rejects or drops:
//! metric names with colons (`vllm:num_requests_waiting`), label values with `\\`, `\"` and
//! `\n` escapes, `NaN`/`+Inf`/`-Inf` values, optional timestamps, `# HELP`/`# TYPE` and other
//! comments, blank lines and CRLF line ends. A malformed line is skipped and counted; it never
//! fails the whole scrape.
//!
//! [`EngineMetrics::from_text`] maps the samples onto the signals the scheduler uses:
//!
//! | signal | vLLM | SGLang |
//! |---|---|---|
//! | waiting requests | `vllm:num_requests_waiting` | `sglang:num_queue_reqs` |
//! | running requests | `vllm:num_requests_running` | `sglang:num_running_reqs` |
//! | KV usage (0–1) | `vllm:kv_cache_usage_perc` (legacy `vllm:gpu_cache_usage_perc`) | `sglang:token_usage` |
//! | LoRA adapters | `vllm:lora_requests_info` labels `running_lora_adapters`, `waiting_lora_adapters`, `max_lora` (series with the newest value wins) | – |
//! | block size / blocks / hash | `vllm:cache_config_info` labels `block_size`, `num_gpu_blocks`, `prefix_caching_hash_algo` | `sglang:cache_config_info` labels `page_size`, `num_pages` |
//!
//! Several series of one gauge (per DP `engine` or `model_name`) are summed for request counts
//! and maxed for KV usage.

use std::borrow::Cow;

/// One parsed sample line.
#[derive(Debug, Clone, PartialEq)]
pub struct Sample<'a> {
    /// Metric name, e.g. `vllm:num_requests_waiting`.
    pub name: &'a str,
    /// Label pairs in order; values are unescaped.
    pub labels: Vec<(&'a str, Cow<'a, str>)>,
    /// The value (may be NaN or infinite).
    pub value: f64,
}

impl Sample<'_> {
    /// The value of label `key`.
    pub fn label(&self, key: &str) -> Option<&str> {
        self.labels
            .iter()
            .find(|(k, _)| *k == key)
            .map(|(_, v)| v.as_ref())
    }
}

/// Parses Prometheus text, calling `f` for every sample. Returns the number of malformed
/// lines that were skipped.
pub fn parse_text<'a>(text: &'a str, mut f: impl FnMut(Sample<'a>)) -> usize {
    let mut bad = 0;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        match parse_line(line) {
            Some(s) => f(s),
            None => bad += 1,
        }
    }
    bad
}

fn is_name_char(c: char, first: bool) -> bool {
    c.is_ascii_alphabetic() || c == '_' || c == ':' || (!first && c.is_ascii_digit())
}

/// Parses one non-comment line: `name[{labels}] value [timestamp]`.
fn parse_line(line: &str) -> Option<Sample<'_>> {
    let end = line
        .char_indices()
        .find(|&(i, c)| !is_name_char(c, i == 0))
        .map_or(line.len(), |(i, _)| i);
    if end == 0 {
        return None;
    }
    let name = &line[..end];
    let mut rest = &line[end..];
    let mut labels = Vec::new();
    if let Some(after) = rest.strip_prefix('{') {
        rest = parse_labels(after, &mut labels)?;
    }
    let mut parts = rest.split_ascii_whitespace();
    let value = parse_value(parts.next()?)?;
    if let Some(ts) = parts.next() {
        ts.parse::<i64>().ok()?;
    }
    if parts.next().is_some() {
        return None;
    }
    Some(Sample {
        name,
        labels,
        value,
    })
}

/// Parses `k="v",...}` and returns what follows the closing brace.
fn parse_labels<'a>(mut s: &'a str, out: &mut Vec<(&'a str, Cow<'a, str>)>) -> Option<&'a str> {
    loop {
        s = s.trim_start();
        if let Some(rest) = s.strip_prefix('}') {
            return Some(rest);
        }
        let eq = s.find('=')?;
        let key = s[..eq].trim();
        if key.is_empty()
            || !key
                .chars()
                .enumerate()
                .all(|(i, c)| is_name_char(c, i == 0))
        {
            return None;
        }
        let after = s[eq + 1..].trim_start().strip_prefix('"')?;
        let (value, rest) = parse_quoted(after)?;
        out.push((key, value));
        s = rest.trim_start();
        if let Some(rest) = s.strip_prefix(',') {
            s = rest;
        } else if !s.starts_with('}') {
            return None;
        }
    }
}

/// Parses a label value after its opening quote; returns the unescaped value and the rest.
fn parse_quoted(s: &str) -> Option<(Cow<'_, str>, &str)> {
    let bytes = s.as_bytes();
    let mut i = 0;
    let mut owned: Option<String> = None;
    let mut start = 0;
    while i < bytes.len() {
        match bytes[i] {
            b'"' => {
                let value = match owned {
                    Some(mut o) => {
                        o.push_str(&s[start..i]);
                        Cow::Owned(o)
                    }
                    None => Cow::Borrowed(&s[..i]),
                };
                return Some((value, &s[i + 1..]));
            }
            b'\\' => {
                let o = owned.get_or_insert_with(String::new);
                o.push_str(&s[start..i]);
                match bytes.get(i + 1)? {
                    b'n' => o.push('\n'),
                    b'\\' => o.push('\\'),
                    b'"' => o.push('"'),
                    _ => return None,
                }
                i += 2;
                start = i;
            }
            _ => i += 1,
        }
    }
    None
}

fn parse_value(s: &str) -> Option<f64> {
    match s {
        "NaN" => Some(f64::NAN),
        "+Inf" | "Inf" => Some(f64::INFINITY),
        "-Inf" => Some(f64::NEG_INFINITY),
        _ => s.parse().ok(),
    }
}

/// Which engine family the metrics came from (detected by metric prefix).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, serde::Serialize)]
#[serde(rename_all = "snake_case")]
pub enum EngineKind {
    /// No known metric was seen.
    #[default]
    Unknown,
    /// vLLM (`vllm:` names).
    Vllm,
    /// SGLang (`sglang:` names).
    Sglang,
}

/// LoRA adapter state from `vllm:lora_requests_info`.
#[derive(Debug, Clone, PartialEq, Eq, Default, serde::Serialize)]
pub struct LoraState {
    /// Adapters with running requests.
    pub running: Vec<String>,
    /// Adapters with waiting requests.
    pub waiting: Vec<String>,
    /// Adapter slots (`max_lora`).
    pub max: u32,
}

impl LoraState {
    /// True when `adapter` is loaded (has running requests).
    pub fn is_running(&self, adapter: &str) -> bool {
        self.running.iter().any(|a| a == adapter)
    }

    /// True when `adapter` has waiting requests.
    pub fn is_waiting(&self, adapter: &str) -> bool {
        self.waiting.iter().any(|a| a == adapter)
    }

    /// True when another adapter can be loaded without evicting one.
    pub fn has_free_slot(&self) -> bool {
        (self.running.len() as u32) < self.max
    }
}

/// The engine signals the scheduler reads, from one scrape. `None` = not reported.
#[derive(Debug, Clone, PartialEq, Default, serde::Serialize)]
pub struct EngineMetrics {
    /// Engine family.
    pub engine: EngineKind,
    /// Waiting (queued) requests, summed over series.
    pub waiting: Option<f64>,
    /// Running requests, summed over series.
    pub running: Option<f64>,
    /// KV-cache usage in [0, 1], max over series.
    pub kv_usage: Option<f64>,
    /// LoRA adapters (vLLM with LoRA enabled only).
    pub lora: Option<LoraState>,
    /// Engine block (page) size in tokens.
    pub block_size: Option<u32>,
    /// Engine GPU blocks (pages).
    pub num_blocks: Option<u64>,
    /// The engine's prefix-caching block hash (`prefix_caching_hash_algo` of
    /// `vllm:cache_config_info`, e.g. `sha256_cbor`).
    pub hash_algo: Option<String>,
    /// Lines that could not be parsed.
    pub malformed_lines: usize,
}

fn add(slot: &mut Option<f64>, v: f64) {
    if v.is_finite() {
        *slot = Some(slot.unwrap_or(0.0) + v);
    }
}

fn max(slot: &mut Option<f64>, v: f64) {
    if v.is_finite() {
        *slot = Some(slot.map_or(v, |s| s.max(v)));
    }
}

fn names(list: &str) -> Vec<String> {
    list.split(',')
        .map(str::trim)
        .filter(|s| !s.is_empty())
        .map(str::to_owned)
        .collect()
}

impl EngineMetrics {
    /// Extracts the scheduler's signals from a `/metrics` body.
    pub fn from_text(text: &str) -> EngineMetrics {
        let mut m = EngineMetrics::default();
        let mut lora_ts = f64::NEG_INFINITY;
        let mut legacy_kv: Option<f64> = None;
        m.malformed_lines = parse_text(text, |s| {
            if m.engine == EngineKind::Unknown {
                if s.name.starts_with("vllm:") {
                    m.engine = EngineKind::Vllm;
                } else if s.name.starts_with("sglang:") {
                    m.engine = EngineKind::Sglang;
                }
            }
            match s.name {
                "vllm:num_requests_waiting" | "sglang:num_queue_reqs" => {
                    add(&mut m.waiting, s.value)
                }
                "vllm:num_requests_running" | "sglang:num_running_reqs" => {
                    add(&mut m.running, s.value)
                }
                "vllm:kv_cache_usage_perc" | "sglang:token_usage" => max(&mut m.kv_usage, s.value),
                "vllm:gpu_cache_usage_perc" => max(&mut legacy_kv, s.value),
                "vllm:lora_requests_info" if s.value >= lora_ts => {
                    lora_ts = s.value;
                    m.lora = Some(LoraState {
                        running: s
                            .label("running_lora_adapters")
                            .map(names)
                            .unwrap_or_default(),
                        waiting: s
                            .label("waiting_lora_adapters")
                            .map(names)
                            .unwrap_or_default(),
                        max: s
                            .label("max_lora")
                            .and_then(|v| v.parse().ok())
                            .unwrap_or(0),
                    });
                }
                "vllm:cache_config_info" => {
                    m.block_size = m.block_size.or(s.label("block_size").and_then(parse_u32));
                    m.num_blocks = m
                        .num_blocks
                        .or(s.label("num_gpu_blocks").and_then(parse_u64));
                    if m.hash_algo.is_none() {
                        m.hash_algo = s
                            .label("prefix_caching_hash_algo")
                            .filter(|a| !a.is_empty())
                            .map(str::to_owned);
                    }
                }
                "sglang:cache_config_info" => {
                    m.block_size = m.block_size.or(s.label("page_size").and_then(parse_u32));
                    m.num_blocks = m.num_blocks.or(s.label("num_pages").and_then(parse_u64));
                }
                _ => {}
            }
        });
        if m.kv_usage.is_none() {
            m.kv_usage = legacy_kv;
        }
        if let Some(k) = m.kv_usage.as_mut() {
            *k = k.clamp(0.0, 1.0);
        }
        m
    }
}

fn parse_u32(s: &str) -> Option<u32> {
    s.parse().ok().filter(|v| *v > 0)
}

fn parse_u64(s: &str) -> Option<u64> {
    s.parse().ok().filter(|v| *v > 0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_lines() {
        type Want = Option<(&'static str, Vec<(&'static str, &'static str)>, f64)>;
        let cases: Vec<(&str, &str, Want)> = vec![
            ("plain", "up 1", Some(("up", vec![], 1.0))),
            (
                "colon name",
                "vllm:num_requests_waiting 3",
                Some(("vllm:num_requests_waiting", vec![], 3.0)),
            ),
            (
                "labels",
                r#"a{x="1",y="b"} 2.5"#,
                Some(("a", vec![("x", "1"), ("y", "b")], 2.5)),
            ),
            (
                "trailing comma",
                r#"a{x="1",} 2"#,
                Some(("a", vec![("x", "1")], 2.0)),
            ),
            (
                "escapes",
                r#"a{x="q\"b\\s\nl"} 1"#,
                Some(("a", vec![("x", "q\"b\\s\nl")], 1.0)),
            ),
            (
                "braces in value",
                r#"a{x="}{,"} 1"#,
                Some(("a", vec![("x", "}{,")], 1.0)),
            ),
            ("timestamp", "a 1 1700000000000", Some(("a", vec![], 1.0))),
            ("exponent", "a 1.5e+03", Some(("a", vec![], 1500.0))),
            ("+Inf", "a +Inf", Some(("a", vec![], f64::INFINITY))),
            ("-Inf", "a -Inf", Some(("a", vec![], f64::NEG_INFINITY))),
            ("no value", "a", None),
            ("bad value", "a x", None),
            ("unterminated labels", r#"a{x="1" 2"#, None),
            ("bad escape", r#"a{x="\t"} 1"#, None),
            ("bad timestamp", "a 1 x", None),
            ("extra field", "a 1 2 3", None),
            ("digit first", "1a 1", None),
        ];
        for (name, line, want) in cases {
            let got = parse_line(line).map(|s| {
                let labels: Vec<(&str, String)> =
                    s.labels.iter().map(|(k, v)| (*k, v.to_string())).collect();
                (s.name, labels, s.value)
            });
            let want = want.map(|(n, l, v)| {
                (
                    n,
                    l.into_iter()
                        .map(|(k, v)| (k, v.to_owned()))
                        .collect::<Vec<_>>(),
                    v,
                )
            });
            assert_eq!(got, want, "{name}");
        }
        assert!(parse_line("a NaN").is_some_and(|s| s.value.is_nan()));
    }

    #[test]
    fn skips_comments_and_counts_malformed() {
        let text = "# HELP a x\n# TYPE a gauge\n\na 1\r\nbroken{\nb 2\n";
        let mut n = 0;
        let bad = parse_text(text, |_| n += 1);
        assert_eq!((n, bad), (2, 1));
    }

    const VLLM: &str = r#"# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 3.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
vllm:num_requests_waiting{engine="0",model_name="m"} 2.0
vllm:num_requests_waiting{engine="1",model_name="m"} 0.0
vllm:kv_cache_usage_perc{engine="0",model_name="m"} 0.25
vllm:kv_cache_usage_perc{engine="1",model_name="m"} 0.5
vllm:lora_requests_info{max_lora="2",running_lora_adapters="a,b",waiting_lora_adapters=""} 1.7e9
vllm:lora_requests_info{max_lora="2",running_lora_adapters="old",waiting_lora_adapters="x"} 1.6e9
vllm:cache_config_info{block_size="16",cache_dtype="auto",engine="0",num_gpu_blocks="1000",prefix_caching_hash_algo="sha256_cbor"} 1.0
"#;

    #[test]
    fn extracts_vllm() {
        let m = EngineMetrics::from_text(VLLM);
        assert_eq!(m.engine, EngineKind::Vllm);
        assert_eq!(m.running, Some(4.0));
        assert_eq!(m.waiting, Some(2.0));
        assert_eq!(m.kv_usage, Some(0.5));
        assert_eq!(
            m.lora,
            Some(LoraState {
                running: vec!["a".into(), "b".into()],
                waiting: vec![],
                max: 2
            })
        );
        assert_eq!((m.block_size, m.num_blocks), (Some(16), Some(1000)));
        assert_eq!(m.hash_algo.as_deref(), Some("sha256_cbor"));
    }

    #[test]
    fn extracts_sglang_and_missing() {
        let text = "sglang:num_running_reqs{model_name=\"m\"} 5\nsglang:num_queue_reqs{model_name=\"m\"} 7\nsglang:token_usage{model_name=\"m\"} 0.3\nsglang:cache_config_info{page_size=\"64\",num_pages=\"20\"} 1\n";
        let m = EngineMetrics::from_text(text);
        assert_eq!(m.engine, EngineKind::Sglang);
        assert_eq!(
            (m.running, m.waiting, m.kv_usage),
            (Some(5.0), Some(7.0), Some(0.3))
        );
        assert_eq!((m.block_size, m.num_blocks), (Some(64), Some(20)));
        let m = EngineMetrics::from_text("other 1\nvllm:gpu_cache_usage_perc 0.9\n");
        assert_eq!((m.running, m.waiting, m.lora), (None, None, None));
        assert_eq!(m.kv_usage, Some(0.9), "legacy kv name is the fallback");
    }
}

//! `/metrics` in Prometheus text format with vLLM 0.33's names, help texts, labels
//! (`model_name`, `engine`) and histogram buckets (`vllm/v1/metrics/loggers.py`, `buckets.py`).
//!
//! Hand-written because the names contain `:`. Each engine (DP rank) keeps an
//! [`EngineStats`] that it updates after every step; rendering only reads snapshots.
//! `process_start_time_seconds` is the server's (prometheus_client's process collector, in
//! its number format); `POST /sim/restart` moves it as a new process would.

use std::collections::BTreeSet;
use std::fmt::Write;
use std::time::Duration;

/// vLLM's `TIME_TO_FIRST_TOKEN_BUCKETS`.
pub(crate) const TTFT_BUCKETS: &[f64] = &[
    0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
    20.0, 40.0, 80.0, 160.0, 640.0, 2560.0,
];

/// vLLM's `REQUEST_LATENCY_BUCKETS`.
pub(crate) const REQUEST_LATENCY_BUCKETS: &[f64] = &[
    0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0, 240.0,
    480.0, 960.0, 1920.0, 7680.0,
];

/// A cumulative-on-render histogram.
#[derive(Debug, Clone)]
pub(crate) struct Histogram {
    bounds: &'static [f64],
    counts: Vec<u64>,
    sum: f64,
    count: u64,
}

impl Histogram {
    pub(crate) fn new(bounds: &'static [f64]) -> Histogram {
        Histogram {
            bounds,
            counts: vec![0; bounds.len()],
            sum: 0.0,
            count: 0,
        }
    }

    pub(crate) fn observe(&mut self, d: Duration) {
        let v = d.as_secs_f64();
        if let Some(i) = self.bounds.iter().position(|&b| v <= b) {
            self.counts[i] += 1;
        }
        self.sum += v;
        self.count += 1;
    }
}

/// One engine's metric state.
#[derive(Debug, Clone)]
pub(crate) struct EngineStats {
    pub(crate) running: usize,
    pub(crate) waiting: usize,
    pub(crate) kv_usage: f64,
    pub(crate) prefix_queries: u64,
    pub(crate) prefix_hits: u64,
    pub(crate) prompt_tokens: u64,
    pub(crate) generation_tokens: u64,
    pub(crate) preemptions: u64,
    pub(crate) success_stop: u64,
    pub(crate) success_length: u64,
    pub(crate) ttft: Histogram,
    pub(crate) e2e: Histogram,
    pub(crate) running_loras: BTreeSet<String>,
    pub(crate) waiting_loras: BTreeSet<String>,
    /// Unix time of the last LoRA-set change (the value of `vllm:lora_requests_info`).
    pub(crate) lora_updated_at: f64,
    /// Distinct block hashes in the prefix cache (what a KV-event index should hold).
    pub(crate) cached_blocks: usize,
    /// KV event batches dropped on the wire (`--drop-event-batches`); filled at render time.
    pub(crate) dropped_event_batches: u64,
    /// KV events handed to the publisher (in batches sent or dropped on the wire).
    pub(crate) published_events: u64,
}

impl Default for EngineStats {
    fn default() -> Self {
        EngineStats {
            running: 0,
            waiting: 0,
            kv_usage: 0.0,
            prefix_queries: 0,
            prefix_hits: 0,
            prompt_tokens: 0,
            generation_tokens: 0,
            preemptions: 0,
            success_stop: 0,
            success_length: 0,
            ttft: Histogram::new(TTFT_BUCKETS),
            e2e: Histogram::new(REQUEST_LATENCY_BUCKETS),
            running_loras: BTreeSet::new(),
            waiting_loras: BTreeSet::new(),
            lora_updated_at: unix_now(),
            cached_blocks: 0,
            dropped_event_batches: 0,
            published_events: 0,
        }
    }
}

pub(crate) fn unix_now() -> f64 {
    std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// Static facts shown in info metrics.
#[derive(Debug, Clone)]
pub(crate) struct MetricsInfo {
    pub(crate) model_name: String,
    pub(crate) block_size: usize,
    pub(crate) num_gpu_blocks: usize,
    pub(crate) hash_algo: &'static str,
    /// `Some(max_loras)` when LoRA is enabled.
    pub(crate) max_loras: Option<usize>,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\")
        .replace('"', "\\\"")
        .replace('\n', "\\n")
}

fn float(v: f64) -> String {
    if v.fract() == 0.0 && v.abs() < 1e15 {
        format!("{v:.1}")
    } else {
        format!("{v}")
    }
}

/// Renders all engines' metrics (`stats[i]` is engine `i`).
pub(crate) fn render(info: &MetricsInfo, stats: &[EngineStats]) -> String {
    let mut out = String::with_capacity(8 * 1024);
    let model = escape(&info.model_name);
    let labels = |e: usize| format!("engine=\"{e}\",model_name=\"{model}\"");
    let family = |out: &mut String,
                  name: &str,
                  kind: &str,
                  help: &str,
                  value: &dyn Fn(&EngineStats) -> f64| {
        let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} {kind}");
        for (e, s) in stats.iter().enumerate() {
            let _ = writeln!(out, "{name}{{{}}} {}", labels(e), float(value(s)));
        }
    };
    family(
        &mut out,
        "vllm:num_requests_running",
        "gauge",
        "Number of requests in model execution batches.",
        &|s| s.running as f64,
    );
    family(
        &mut out,
        "vllm:num_requests_waiting",
        "gauge",
        "Number of requests waiting to be processed.",
        &|s| s.waiting as f64,
    );
    family(
        &mut out,
        "vllm:kv_cache_usage_perc",
        "gauge",
        "KV-cache usage. 1 means 100 percent usage.",
        &|s| s.kv_usage,
    );
    family(
        &mut out,
        "vllm:prefix_cache_queries_total",
        "counter",
        "Prefix cache queries, in terms of number of queried tokens.",
        &|s| s.prefix_queries as f64,
    );
    family(
        &mut out,
        "vllm:prefix_cache_hits_total",
        "counter",
        "Prefix cache hits, in terms of number of cached tokens.",
        &|s| s.prefix_hits as f64,
    );
    family(
        &mut out,
        "vllm:num_preemptions_total",
        "counter",
        "Cumulative number of preemption from the engine.",
        &|s| s.preemptions as f64,
    );
    family(
        &mut out,
        "vllm:prompt_tokens_total",
        "counter",
        "Number of prefill tokens processed.",
        &|s| s.prompt_tokens as f64,
    );
    family(
        &mut out,
        "vllm:generation_tokens_total",
        "counter",
        "Number of generation tokens processed.",
        &|s| s.generation_tokens as f64,
    );
    // Not vLLM's: the sim's own, for fault-injection tests (chaos suite).
    family(
        &mut out,
        "kvgate_sim:cached_blocks",
        "gauge",
        "Distinct block hashes in the prefix cache (stored and not yet removed in KV events).",
        &|s| s.cached_blocks as f64,
    );
    family(
        &mut out,
        "kvgate_sim:published_events_total",
        "counter",
        "KV events published (each BlockStored, BlockRemoved, AllBlocksCleared; a subscriber that applied them all counts as many).",
        &|s| s.published_events as f64,
    );
    family(
        &mut out,
        "kvgate_sim:dropped_event_batches_total",
        "counter",
        "KV event batches not sent on the wire (--drop-event-batches); still replayable.",
        &|s| s.dropped_event_batches as f64,
    );
    let _ = writeln!(
        out,
        "# HELP vllm:request_success_total Count of successfully processed requests.\n# TYPE vllm:request_success_total counter"
    );
    for (e, s) in stats.iter().enumerate() {
        for (reason, v) in [("stop", s.success_stop), ("length", s.success_length)] {
            let _ = writeln!(
                out,
                "vllm:request_success_total{{{},finished_reason=\"{reason}\"}} {}",
                labels(e),
                float(v as f64)
            );
        }
    }
    histogram(
        &mut out,
        "vllm:time_to_first_token_seconds",
        "Histogram of time to first token in seconds.",
        stats,
        &labels,
        |s| &s.ttft,
    );
    histogram(
        &mut out,
        "vllm:e2e_request_latency_seconds",
        "Histogram of e2e request latency in seconds.",
        stats,
        &labels,
        |s| &s.e2e,
    );
    if let Some(max) = info.max_loras {
        let _ = writeln!(
            out,
            "# HELP vllm:lora_requests_info Running stats on lora requests.\n# TYPE vllm:lora_requests_info gauge"
        );
        // vLLM keeps one series per distinct label set; the newest value wins for readers.
        let running: BTreeSet<&str> = stats
            .iter()
            .flat_map(|s| s.running_loras.iter().map(String::as_str))
            .collect();
        let waiting: BTreeSet<&str> = stats
            .iter()
            .flat_map(|s| s.waiting_loras.iter().map(String::as_str))
            .collect();
        let updated = stats.iter().map(|s| s.lora_updated_at).fold(0.0, f64::max);
        let _ = writeln!(
            out,
            "vllm:lora_requests_info{{max_lora=\"{max}\",running_lora_adapters=\"{}\",waiting_lora_adapters=\"{}\"}} {}",
            escape(&running.into_iter().collect::<Vec<_>>().join(",")),
            escape(&waiting.into_iter().collect::<Vec<_>>().join(",")),
            updated
        );
    }
    let _ = writeln!(
        out,
        "# HELP vllm:cache_config_info Information of the LLMEngine CacheConfig\n# TYPE vllm:cache_config_info gauge"
    );
    // `sliding_window` is CacheConfig's: vLLM sets it only for a model whose every layer is
    // sliding-window (`EngineArgs.create_engine_config`), so it is "None" for a plain model and
    // for a hybrid one alike; the window is in the KV events' `kv_cache_spec_sliding_window`.
    for e in 0..stats.len() {
        let _ = writeln!(
            out,
            "vllm:cache_config_info{{block_size=\"{}\",enable_prefix_caching=\"True\",engine=\"{e}\",num_gpu_blocks=\"{}\",prefix_caching_hash_algo=\"{}\",sliding_window=\"None\"}} 1.0",
            info.block_size, info.num_gpu_blocks, info.hash_algo
        );
    }
    out
}

/// `process_start_time_seconds` of a server started at unix time `start`, as prometheus_client
/// writes it.
pub(crate) fn render_process_start(out: &mut String, start: f64) {
    let _ = writeln!(
        out,
        "# HELP process_start_time_seconds Start time of the process since unix epoch in seconds.\n# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds {}",
        go_float(start)
    );
}

/// prometheus_client's `floatToGoString`: Python's `repr`, with an exponent once the integer
/// part has more than 6 digits (`1733612345.67` → `1.73361234567e+09`).
fn go_float(v: f64) -> String {
    let mut s = format!("{v}");
    if v.is_finite() && !s.contains('.') && !s.contains('e') {
        s.push_str(".0");
    }
    match s.find('.') {
        Some(dot) if v > 0.0 && dot > 6 => {
            let digits = format!("{}{}", &s[1..dot], &s[dot + 1..]);
            let mantissa = format!("{}.{digits}", &s[..1]);
            let mantissa = mantissa.trim_end_matches(['0', '.']);
            format!("{mantissa}e+0{}", dot - 1)
        }
        _ => s,
    }
}

fn histogram(
    out: &mut String,
    name: &str,
    help: &str,
    stats: &[EngineStats],
    labels: &dyn Fn(usize) -> String,
    pick: fn(&EngineStats) -> &Histogram,
) {
    let _ = writeln!(out, "# HELP {name} {help}\n# TYPE {name} histogram");
    for (e, s) in stats.iter().enumerate() {
        let h = pick(s);
        let l = labels(e);
        let mut cum = 0;
        for (b, c) in h.bounds.iter().zip(&h.counts) {
            cum += c;
            let _ = writeln!(
                out,
                "{name}_bucket{{{l},le=\"{}\"}} {}",
                float(*b),
                float(cum as f64)
            );
        }
        let _ = writeln!(
            out,
            "{name}_bucket{{{l},le=\"+Inf\"}} {}",
            float(h.count as f64)
        );
        let _ = writeln!(out, "{name}_count{{{l}}} {}", float(h.count as f64));
        let _ = writeln!(out, "{name}_sum{{{l}}} {}", h.sum);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn renders_vllm_names_and_labels() {
        let info = MetricsInfo {
            model_name: "m".into(),
            block_size: 16,
            num_gpu_blocks: 100,
            hash_algo: "sha256_cbor",
            max_loras: Some(2),
        };
        let mut s = EngineStats {
            running: 3,
            prefix_hits: 32,
            cached_blocks: 7,
            dropped_event_batches: 2,
            published_events: 5,
            ..Default::default()
        };
        s.ttft.observe(Duration::from_millis(30));
        s.running_loras.insert("a".into());
        let text = render(&info, &[s]);
        let want = [
            "vllm:num_requests_running{engine=\"0\",model_name=\"m\"} 3.0",
            "vllm:prefix_cache_hits_total{engine=\"0\",model_name=\"m\"} 32.0",
            "kvgate_sim:cached_blocks{engine=\"0\",model_name=\"m\"} 7.0",
            "kvgate_sim:dropped_event_batches_total{engine=\"0\",model_name=\"m\"} 2.0",
            "kvgate_sim:published_events_total{engine=\"0\",model_name=\"m\"} 5.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"0.04\"} 1.0",
            "vllm:time_to_first_token_seconds_bucket{engine=\"0\",model_name=\"m\",le=\"0.02\"} 0.0",
            "vllm:time_to_first_token_seconds_count{engine=\"0\",model_name=\"m\"} 1.0",
            "max_lora=\"2\",running_lora_adapters=\"a\",waiting_lora_adapters=\"\"",
            "block_size=\"16\"",
            "num_gpu_blocks=\"100\"",
            "prefix_caching_hash_algo=\"sha256_cbor\",sliding_window=\"None\"}",
            "# TYPE vllm:e2e_request_latency_seconds histogram",
        ];
        for w in want {
            assert!(text.contains(w), "missing {w}\n{text}");
        }
    }

    #[test]
    fn process_start_is_written_as_prometheus_client_does() {
        let cases: Vec<(f64, &str)> = vec![
            (1_733_612_345.67, "1.73361234567e+09"),
            (1_733_612_345.0, "1.733612345e+09"),
            (1_733_612_340.0, "1.73361234e+09"),
            (12.5, "12.5"),
        ];
        for (v, want) in cases {
            assert_eq!(go_float(v), want, "{v}");
        }
        let mut out = String::new();
        render_process_start(&mut out, 1_733_612_345.67);
        assert!(
            out.ends_with("# TYPE process_start_time_seconds gauge\nprocess_start_time_seconds 1.73361234567e+09\n"),
            "{out}"
        );
    }
}

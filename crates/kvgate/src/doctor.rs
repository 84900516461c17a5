//! `kvgate doctor URL...`: asks each engine what it is (models, KV cache layout, its KV-event
//! publishers at `/kv_event_sources`, KV events, replay, usage details, tokenization) and
//! prints what precise routing will and will not be able to do, one line per finding, each
//! problem with the flag that fixes it. Without `--kv` for an engine, the events socket the
//! engine reports is probed (as `kvgate serve` subscribes to it).

mod probe;
mod sources;
mod tokens;

use std::{collections::HashMap, time::Duration};

use bytes::Bytes;
use clap::Args;
use serde_json::{Value, json};

use self::probe::{Events, Http, ReplayAnswer};

/// Flags of `kvgate doctor`.
#[derive(Debug, Args)]
pub(crate) struct DoctorArgs {
    /// Engine base URLs (OpenAI-compatible vLLM or `kvgate sim`), e.g. http://10.0.0.1:8000.
    #[arg(required = true, value_name = "URL")]
    urls: Vec<String>,
    /// An engine's KV events PUB socket, URL=tcp://HOST:PORT (repeatable) [default: the one
    /// the engine reports at /kv_event_sources].
    #[arg(long = "kv", value_name = "URL=tcp://HOST:PORT")]
    kv: Vec<String>,
    /// An engine's KV events replay ROUTER socket, URL=tcp://HOST:PORT (repeatable)
    /// [default: the one the engine reports next to its events socket].
    #[arg(long = "replay", value_name = "URL=tcp://HOST:PORT")]
    replay: Vec<String>,
    /// Local tokenizer for a model, MODEL=DIR (repeatable), checked against the engine's
    /// `/render`.
    #[arg(long = "tokenizer", value_name = "MODEL=DIR")]
    tokenizers: Vec<String>,
    /// Longest wait of each probe (an HTTP request, the first event batch, a replay reply).
    #[arg(long, default_value = "5s", value_parser = humantime::parse_duration)]
    timeout: Duration,
}

/// How a finding bears on precise routing.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Level {
    /// Works.
    Ok,
    /// Works, but something optional is missing.
    Warn,
    /// Precise routing cannot work until fixed.
    Fail,
}

/// One line of the report.
#[derive(Debug)]
struct Finding {
    level: Level,
    text: String,
    /// The flag or setting that fixes it.
    fix: Option<String>,
    /// Short name of what is missing, for the summary line.
    missing: Option<&'static str>,
}

impl Finding {
    fn ok(text: impl Into<String>) -> Finding {
        Finding {
            level: Level::Ok,
            text: text.into(),
            fix: None,
            missing: None,
        }
    }

    fn warn(text: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding {
            level: Level::Warn,
            text: text.into(),
            fix: Some(fix.into()),
            missing: None,
        }
    }

    fn fail(missing: &'static str, text: impl Into<String>, fix: impl Into<String>) -> Finding {
        Finding {
            level: Level::Fail,
            text: text.into(),
            fix: Some(fix.into()),
            missing: Some(missing),
        }
    }

    fn line(&self) -> String {
        let tag = match self.level {
            Level::Ok => "ok  ",
            Level::Warn => "warn",
            Level::Fail => "FAIL",
        };
        match &self.fix {
            Some(fix) => format!("  {tag} {}; fix: {fix}", self.text),
            None => format!("  {tag} {}", self.text),
        }
    }
}

/// Splits `KEY=VALUE` flags into a map.
fn pairs(flags: &[String], name: &str) -> anyhow::Result<HashMap<String, String>> {
    flags
        .iter()
        .map(|f| {
            f.split_once('=')
                .map(|(k, v)| (k.trim_end_matches('/').to_owned(), v.to_owned()))
                .ok_or_else(|| anyhow::anyhow!("--{name} `{f}` must be KEY=VALUE"))
        })
        .collect()
}

/// Runs the doctor; returns whether every engine is ready for precise routing.
pub(crate) fn main(args: &DoctorArgs) -> anyhow::Result<bool> {
    let kv = pairs(&args.kv, "kv")?;
    let replay = pairs(&args.replay, "replay")?;
    let tokenizers = pairs(&args.tokenizers, "tokenizer")?;
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let mut all_ready = true;
    for url in &args.urls {
        let key = url.trim_end_matches('/');
        let probe = EngineProbe {
            url: key,
            kv: kv.get(key).map(String::as_str),
            replay: replay.get(key).map(String::as_str),
            tokenizers: &tokenizers,
            timeout: args.timeout,
        };
        let findings = runtime.block_on(probe.run());
        println!("engine {key}");
        for f in &findings {
            println!("{}", f.line());
        }
        let missing: Vec<String> = findings
            .iter()
            .filter(|f| f.level == Level::Fail)
            .map(|f| match (f.missing, &f.fix) {
                (Some(m), Some(fix)) => format!("{m}: {fix}"),
                (Some(m), None) => m.to_owned(),
                (None, _) => f.text.clone(),
            })
            .collect();
        if missing.is_empty() {
            println!("  precise routing: ready");
        } else {
            all_ready = false;
            println!(
                "  precise routing: not ready: {}; kvgate will route approximately",
                missing.join("; ")
            );
        }
    }
    Ok(all_ready)
}

/// Everything known about one engine before probing it.
#[derive(Debug)]
struct EngineProbe<'a> {
    url: &'a str,
    kv: Option<&'a str>,
    replay: Option<&'a str>,
    tokenizers: &'a HashMap<String, String>,
    timeout: Duration,
}

/// A served model from `/v1/models`.
#[derive(Debug)]
struct Served {
    id: String,
    parent: Option<String>,
    max_model_len: Option<u64>,
}

impl EngineProbe<'_> {
    async fn run(&self) -> Vec<Finding> {
        let http = Http::new(self.url, self.timeout);
        let mut out = Vec::new();
        let models = match self.models(&http).await {
            Ok(m) if !m.is_empty() => m,
            Ok(_) => {
                out.push(Finding::fail(
                    "no models",
                    "GET /v1/models lists no model",
                    "check the engine's --model / --served-model-name",
                ));
                return out;
            }
            Err(e) => {
                out.push(Finding::fail(
                    "engine unreachable",
                    format!("GET /v1/models failed: {e:#}"),
                    "check the URL (an OpenAI-compatible engine base URL, e.g. http://HOST:8000)",
                ));
                return out;
            }
        };
        out.push(describe_models(&models));
        let base = models
            .iter()
            .find(|m| m.parent.is_none())
            .unwrap_or(&models[0]);
        let block_size = self.cache(&http, &mut out).await;

        let sources = self.sources(&http, &mut out).await;
        // Subscribe before the probe request, so its blocks are published to us.
        let mut events = match &sources.events {
            Some(ep) => match Events::connect(&ep.url, self.timeout).await {
                Ok(ev) => Some(ev),
                Err(e) => {
                    out.push(no_events(format!(
                        "KV events socket {} unreachable: {e:#}{}",
                        ep.url,
                        ep.origin()
                    )));
                    None
                }
            },
            None => {
                out.push(no_events(format!(
                    "no KV events socket: {}",
                    sources.why_none
                )));
                None
            }
        };
        if events.is_some() {
            // A SUB socket's subscription reaches the publisher shortly after connect.
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let usage = self.completion(&http, &base.id, block_size).await;
        if let (Some(ev), Some(ep)) = (events.as_mut(), &sources.events) {
            out.push(match ev.first_batch(self.timeout).await {
                Ok(b) => Finding::ok(format!(
                    "KV events: reachable on {} (batch seq {}, {} event(s), topic {:?}){}",
                    ep.url,
                    b.seq,
                    b.events,
                    b.topic,
                    ep.origin()
                )),
                Err(e) => no_events(format!(
                    "KV events: {} connected but {e:#}{}",
                    ep.url,
                    ep.origin()
                )),
            });
        }
        out.push(self.replay(sources.replay.as_ref()).await);
        out.push(match usage {
            Ok(u) => details(&u),
            Err(e) => Finding::warn(
                format!("probe completion failed: {e:#}"),
                "check that the engine serves /v1/completions",
            ),
        });
        out.push(self.tokenization(&base.id).await);
        out
    }

    async fn models(&self, http: &Http) -> anyhow::Result<Vec<Served>> {
        let (status, body) = http.get("/v1/models").await?;
        anyhow::ensure!(status == 200, "status {status}");
        let v: Value = serde_json::from_str(&body)?;
        let data = v["data"].as_array().cloned().unwrap_or_default();
        Ok(data
            .iter()
            .filter_map(|m| {
                Some(Served {
                    id: m["id"].as_str()?.to_owned(),
                    parent: m["parent"].as_str().map(str::to_owned),
                    max_model_len: m["max_model_len"].as_u64(),
                })
            })
            .collect())
    }

    /// Reads `vllm:cache_config_info`; returns the block size.
    async fn cache(&self, http: &Http, out: &mut Vec<Finding>) -> Option<u32> {
        let text = match http.get("/metrics").await {
            Ok((200, text)) => text,
            Ok((status, _)) => {
                out.push(no_cache(format!("GET /metrics: status {status}")));
                return None;
            }
            Err(e) => {
                out.push(no_cache(format!("GET /metrics failed: {e:#}")));
                return None;
            }
        };
        let m = kvgate_schedule::EngineMetrics::from_text(&text);
        let mut prefix_caching = None;
        kvgate_schedule::parse_text(&text, |s| {
            if s.name == "vllm:cache_config_info" && prefix_caching.is_none() {
                prefix_caching = s
                    .label("enable_prefix_caching")
                    .map(|v| v.eq_ignore_ascii_case("true"));
            }
        });
        let Some(block_size) = m.block_size else {
            out.push(no_cache(
                "/metrics has no vllm:cache_config_info block_size".to_owned(),
            ));
            return None;
        };
        let blocks = m
            .num_blocks
            .map_or_else(|| "unknown".to_owned(), |n| n.to_string());
        let algo = m.hash_algo.as_deref().unwrap_or("unknown");
        out.push(Finding::ok(format!(
            "KV cache: block size {block_size}, {blocks} GPU blocks, prefix-caching hash {algo}"
        )));
        out.push(match prefix_caching {
            Some(true) => Finding::ok("prefix caching: on"),
            Some(false) => Finding::fail(
                "prefix caching off",
                "prefix caching: off (nothing to route to)",
                "run vLLM with --enable-prefix-caching",
            ),
            None => Finding::warn(
                "prefix caching: not reported by cache_config_info",
                "run vLLM with --enable-prefix-caching",
            ),
        });
        Some(block_size)
    }

    /// One tiny completion, long enough to fill a few blocks; returns its `usage`.
    async fn completion(
        &self,
        http: &Http,
        model: &str,
        block_size: Option<u32>,
    ) -> anyhow::Result<Value> {
        let nonce = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let words = 3 * block_size.unwrap_or(16) as usize;
        let prompt: Vec<String> = (0..words)
            .map(|i| format!("w{}", nonce + i as u128))
            .collect();
        let body = json!({"model": model, "prompt": format!("kvgate doctor probe {}", prompt.join(" ")), "max_tokens": 1});
        let (status, text) = http
            .post("/v1/completions", Bytes::from(body.to_string()))
            .await?;
        anyhow::ensure!(status == 200, "status {status}: {}", first_line(&text));
        let v: Value = serde_json::from_str(&text)?;
        Ok(v["usage"].clone())
    }

    async fn replay(&self, socket: Option<&sources::Socket>) -> Finding {
        let fix = "pass --replay URL=tcp://HOST:PORT (vLLM: \"replay_endpoint\" in --kv-events-config, which /kv_event_sources then reports; kvgate sim: --kv-events-replay-endpoint); without replay a lost batch leaves the index degraded until blocks are stored again";
        let Some(socket) = socket else {
            return Finding::warn("replay: no socket given or found at /kv_event_sources", fix);
        };
        let (ep, origin) = (socket.url.as_str(), socket.origin());
        match probe::replay_first(ep, self.timeout).await {
            Ok(ReplayAnswer::Batch(seq)) => Finding::ok(format!(
                "replay: reachable on {ep} (first retained batch seq {seq}){origin}"
            )),
            Ok(ReplayAnswer::Empty) => Finding::ok(format!(
                "replay: reachable on {ep} (nothing retained yet){origin}"
            )),
            Err(e) => Finding::warn(format!("replay: {ep} did not answer: {e:#}{origin}"), fix),
        }
    }
}

fn describe_models(models: &[Served]) -> Finding {
    let list: Vec<String> = models
        .iter()
        .map(|m| {
            let len = m
                .max_model_len
                .map_or_else(String::new, |n| format!(", max_model_len {n}"));
            match &m.parent {
                Some(p) => format!("{} (LoRA adapter of {p}{len})", m.id),
                None => format!("{} (base{len})", m.id),
            }
        })
        .collect();
    Finding::ok(format!("models: {}", list.join(", ")))
}

fn no_events(text: String) -> Finding {
    Finding::fail(
        "no KV events",
        text,
        "run vLLM with --kv-events-config '{\"enable_kv_cache_events\":true,\"publisher\":\"zmq\",\"endpoint\":\"tcp://*:5557\"}' (or kvgate sim without --no-kv-events, --kv-events-endpoint tcp://*:5557); vLLM ≥ 0.32 reports it at /kv_event_sources, older ones need --kv URL=tcp://HOST:5557",
    )
}

fn no_cache(text: String) -> Finding {
    Finding::fail(
        "block size unknown",
        text,
        "expose vllm:cache_config_info on /metrics, or give kvgate serve --endpoint URL,block_size=N",
    )
}

fn details(usage: &Value) -> Finding {
    if usage["prompt_tokens_details"].is_object() {
        let cached = usage["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap_or(0);
        Finding::ok(format!(
            "usage.prompt_tokens_details: on (probe cached_tokens {cached}); realized cache hits are measured"
        ))
    } else {
        Finding::warn(
            "usage.prompt_tokens_details: off (realized cache hits cannot be measured)",
            "run vLLM with --enable-prompt-tokens-details",
        )
    }
}

fn first_line(s: &str) -> &str {
    s.lines().next().unwrap_or_default()
}

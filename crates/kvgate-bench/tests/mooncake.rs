//! The Mooncake workload against the real bundled Qwen3 tokenizer: equal hash ids give
//! equal token runs, every prompt has exactly its `input_length` tokens, the oracle agrees
//! with token-level prefix matching, and `kvgate bench --workload mooncake` runs end to end
//! against an in-test completions server.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::HashSet,
    convert::Infallible,
    net::SocketAddr,
    path::{Path, PathBuf},
    sync::{Arc, Mutex, OnceLock},
    time::Duration,
};

use bytes::Bytes;
use http::{Request, Response};
use http_body_util::{BodyExt, Full};
use hyper::{body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::rt::TokioIo;
use kvgate_bench::{
    Arrival, BodyOptions, COMPLETIONS_PATH, HitCeiling, Schedule, cli,
    workload::mooncake::{
        Mooncake, PromptBuilder, TraceRequest, TraceWindow, build_workload, parse_trace,
    },
};
use serde_json::{Value, json};
use tokio::net::TcpListener;

fn tokenizer_dir() -> PathBuf {
    PathBuf::from(cli::BUNDLED_TOKENIZER)
}

fn builder() -> &'static PromptBuilder {
    static BUILDER: OnceLock<PromptBuilder> = OnceLock::new();
    BUILDER.get_or_init(|| PromptBuilder::load(&tokenizer_dir(), 0).unwrap())
}

fn tokens(hash_ids: &[u64], input_length: usize) -> Vec<u32> {
    let b = builder();
    b.encode(&b.prompt(hash_ids, input_length).unwrap())
        .unwrap()
}

fn req(timestamp: f64, input_length: usize, output_length: u32, ids: &[u64]) -> TraceRequest {
    TraceRequest {
        timestamp,
        input_length,
        output_length,
        hash_ids: ids.to_vec(),
    }
}

#[test]
fn the_bundled_tokenizer_adds_nothing_and_has_enough_atoms() {
    assert_eq!(builder().added_tokens(), 0);
    assert!(builder().atoms() >= 100, "{} atoms", builder().atoms());
}

#[test]
fn equal_hash_ids_give_equal_token_runs() {
    /// (ids of a, length of a, ids of b, length of b, shared blocks k).
    type Case = (&'static [u64], usize, &'static [u64], usize, usize);
    let cases: [Case; 3] = [
        (&[10, 11, 12], 1500, &[10, 11, 13], 1400, 2),
        (&[10, 11, 12], 1536, &[10, 14], 1000, 1),
        (&[20, 21, 22, 23], 2048, &[20, 21, 22, 24], 1700, 3),
    ];
    for (ids_a, len_a, ids_b, len_b, k) in cases {
        let (a, b) = (tokens(ids_a, len_a), tokens(ids_b, len_b));
        let shared = k * 512;
        assert_eq!(a[..shared], b[..shared], "{ids_a:?} vs {ids_b:?}");
        assert_ne!(
            a[shared..shared + 16],
            b[shared..shared + 16],
            "{ids_a:?} vs {ids_b:?}: the next block differs"
        );
    }
}

#[test]
fn runs_are_additive_across_boundaries() {
    // The prompt of [a, b, c] is the three single-block prompts' tokens back to back, and
    // a cut last block is a prefix of the whole run.
    let whole = tokens(&[30, 31, 32], 1536);
    let parts: Vec<u32> = [30, 31, 32]
        .iter()
        .flat_map(|&id| tokens(&[id], 512))
        .collect();
    assert_eq!(whole, parts);
    let cut = tokens(&[30, 31, 32], 1100);
    assert_eq!(cut[..], whole[..1100]);
    assert_eq!(builder().prompt(&[5], 512), builder().prompt(&[5], 512));
}

#[test]
fn every_prompt_tokenizes_to_its_input_length() {
    for len in [1usize, 2, 15, 16, 17, 511, 512, 513, 1023, 1024, 1500, 4097] {
        let ids: Vec<u64> = (100..100 + len.div_ceil(512) as u64).collect();
        assert_eq!(tokens(&ids, len).len(), len, "input_length {len}");
    }
    let cases = [
        (
            "one id cannot cover 513",
            513,
            "input_length 513 needs 2 blocks",
        ),
        ("no empty prompts", 0, "input_length 0 leaves no text"),
    ];
    for (name, len, want) in cases {
        let err = builder().prompt(&[1], len).expect_err(name);
        assert!(err.starts_with(want), "{name}: {err}");
    }
}

/// Hit tokens of each request when matching real token ids block by block against every
/// earlier request: the longest run of leading 16-token blocks seen before, capped at
/// ⌊(len − 1) / 16⌋.
fn token_level_hits(requests: &[TraceRequest]) -> u64 {
    let mut seen: HashSet<Vec<u32>> = HashSet::new();
    let mut cached = 0;
    for r in requests {
        let ids = tokens(&r.hash_ids, r.input_length);
        let blocks = ids.len() / 16;
        let hits = (0..blocks)
            .take_while(|b| seen.contains(&ids[..(b + 1) * 16]))
            .count();
        cached += (hits.min((ids.len() - 1) / 16) * 16) as u64;
        seen.extend((0..blocks).map(|b| ids[..(b + 1) * 16].to_vec()));
    }
    cached
}

#[test]
fn the_infinite_oracle_agrees_with_token_level_matching() {
    let requests = [
        req(0.0, 1300, 1, &[1, 2, 3]),
        req(1.0, 1024, 1, &[1, 2]),
        req(2.0, 1536, 1, &[1, 2, 4]),
        req(3.0, 700, 1, &[1, 5]),
        req(4.0, 1100, 1, &[1, 2, 3]),
        req(5.0, 2000, 1, &[6, 7, 8, 9]),
        req(6.0, 1537, 1, &[1, 2, 4, 10]),
        req(7.0, 40, 1, &[1]),
    ];
    let ceiling = HitCeiling::of(&requests, 16, None).unwrap();
    assert_eq!(ceiling.infinite.cached_tokens, token_level_hits(&requests));
    assert!(ceiling.infinite.cached_tokens > 0);
}

#[test]
fn workload_bodies_times_and_caps() {
    let text = [
        r#"{"timestamp": 0, "input_length": 600, "output_length": 500, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 250, "input_length": 300, "output_length": 0, "hash_ids": [1]}"#,
        r#"{"timestamp": 1000, "input_length": 512, "output_length": 7, "hash_ids": [3]}"#,
    ]
    .join("\n");
    let requests = parse_trace(&text, "t.jsonl".as_ref()).unwrap();
    let body = BodyOptions {
        model: "m".into(),
        ..BodyOptions::default()
    };
    let w = build_workload(&requests, builder(), &body, Some(32), "t".into()).unwrap();
    let want_max = [32, 1, 7];
    for ((c, r), want_max) in w.conversations.iter().zip(&requests).zip(want_max) {
        assert_eq!(&*c.path, COMPLETIONS_PATH);
        assert_eq!(c.turns.len(), 1);
        let v: Value = serde_json::from_slice(&c.turns[0].body).unwrap();
        let keys: Vec<&str> = v.as_object().unwrap().keys().map(String::as_str).collect();
        assert_eq!(
            keys,
            ["model", "prompt", "max_tokens", "stream", "stream_options"]
        );
        assert_eq!(v["model"], "m");
        assert_eq!(v["max_tokens"], want_max);
        assert_eq!(v["stream_options"], json!({"include_usage": true}));
        let prompt = v["prompt"].as_str().unwrap();
        assert_eq!(builder().encode(prompt).unwrap().len(), r.input_length);
        assert_eq!(c.at, Some(Duration::from_secs_f64(r.timestamp / 1000.0)));
    }
    let Schedule::Open(at) = Schedule::build(Arrival::Trace { speed: 2.0 }, &w, 0).unwrap() else {
        panic!("open")
    };
    assert_eq!(at, [0, 125, 500].map(Duration::from_millis));
}

#[test]
fn the_real_trace_window_selects_and_sizes_prompts() {
    let file = Path::new("/work/shared/data/mooncake/conversation_trace.jsonl");
    if !file.is_file() {
        eprintln!("skipped: {} is absent", file.display());
        return;
    }
    let spec = Mooncake {
        file: file.to_owned(),
        window: Some("10..20".parse::<TraceWindow>().unwrap()),
        max_requests: Some(6),
        max_output_tokens: Some(32),
        tokenizer: tokenizer_dir(),
    };
    let requests = spec.requests().unwrap();
    assert_eq!(requests.len(), 6);
    assert!(
        requests
            .iter()
            .all(|r| (0.0..600_000.0).contains(&r.timestamp))
    );
    let w = spec.generate(&BodyOptions::default(), 0).unwrap();
    for (c, r) in w.conversations.iter().zip(&requests) {
        let v: Value = serde_json::from_slice(&c.turns[0].body).unwrap();
        let prompt = v["prompt"].as_str().unwrap();
        assert_eq!(builder().encode(prompt).unwrap().len(), r.input_length);
        assert_eq!(v["max_tokens"], r.output_length.clamp(1, 32));
    }
}

/// Answers `/v1/completions` with a streamed completion whose usage counts one token per
/// word of the prompt (exact for these prompts) and reports half as cached; remembers
/// every path.
async fn completions_spy(paths: Arc<Mutex<Vec<String>>>) -> SocketAddr {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        loop {
            let (stream, _) = listener.accept().await.unwrap();
            let paths = paths.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req: Request<Incoming>| {
                    let paths = paths.clone();
                    async move {
                        let path = req.uri().path().to_owned();
                        let bytes = req.into_body().collect().await.unwrap().to_bytes();
                        paths.lock().unwrap().push(path);
                        let body: Value = serde_json::from_slice(&bytes).unwrap();
                        let prompt = body["prompt"].as_str().unwrap().split_whitespace().count();
                        let usage = json!({"prompt_tokens": prompt, "completion_tokens": 2,
                            "prompt_tokens_details": {"cached_tokens": prompt / 2}});
                        let sse = format!(
                            "data: {}\n\ndata: {}\n\ndata: {}\n\ndata: [DONE]\n\n",
                            json!({"choices": [{"text": "a"}]}),
                            json!({"choices": [{"text": " b"}]}),
                            json!({"choices": [], "usage": usage}),
                        );
                        let resp = Response::builder()
                            .header("content-type", "text/event-stream")
                            .body(Full::new(Bytes::from(sse)))
                            .unwrap();
                        Ok::<_, Infallible>(resp)
                    }
                });
                let _ = http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    addr
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bench_runs_mooncake_end_to_end_with_oracle_rows() {
    let dir = std::env::temp_dir().join(format!("kvgate-mooncake-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let trace = dir.join("trace.jsonl");
    let lines = [
        r#"{"timestamp": 0, "input_length": 1300, "output_length": 9, "hash_ids": [1, 2, 3]}"#,
        r#"{"timestamp": 30, "input_length": 1024, "output_length": 9, "hash_ids": [1, 2]}"#,
        r#"{"timestamp": 60, "input_length": 900, "output_length": 9, "hash_ids": [4, 5]}"#,
        r#"{"timestamp": 90, "input_length": 1536, "output_length": 9, "hash_ids": [1, 2, 6]}"#,
    ];
    std::fs::write(&trace, lines.join("\n")).unwrap();
    let paths = Arc::new(Mutex::new(Vec::new()));
    let addr = completions_spy(paths.clone()).await;
    let (target, out) = (format!("spy=http://{addr}"), dir.join("out"));
    let args = [
        "--target",
        &target,
        "--model",
        "m",
        "--workload",
        "mooncake",
        "--trace",
        trace.to_str().unwrap(),
        "--trace-speed",
        "100",
        "--max-requests",
        "3",
        "--max-output-tokens",
        "4",
        "--oracle-blocks",
        "64",
        "--quiet",
        "--out",
        out.to_str().unwrap(),
    ];
    let outcome = cli::run(&cli::BenchArgs::from_flags(args).unwrap())
        .await
        .unwrap();
    let records = &outcome.runs[0].result.records;
    assert_eq!(records.len(), 3);
    assert!(records.iter().all(|r| r.is_ok() && r.streamed));
    let prompts: Vec<u64> = records.iter().map(|r| r.prompt_tokens.unwrap()).collect();
    assert_eq!(prompts, [1300, 1024, 900]);
    assert_eq!(*paths.lock().unwrap(), vec![COMPLETIONS_PATH; 3]);

    assert_eq!(outcome.ceilings.len(), 1, "every request was served");
    assert_eq!(outcome.ceilings[0].scope, "trace");
    let ceiling = &outcome.ceilings[0].ceiling;
    // Request 2 is request 1's first 1024 tokens: ⌊1023/16⌋ = 63 blocks hit.
    assert_eq!(ceiling.infinite.cached_tokens, 1008);
    assert_eq!(ceiling.prompt_tokens, 1300 + 1024 + 900);
    let json: Value =
        serde_json::from_str(&std::fs::read_to_string(&outcome.files.json).unwrap()).unwrap();
    let oracle = &json["oracles"][0];
    assert_eq!(oracle["scope"], "trace");
    assert_eq!(oracle["infinite"]["cached_tokens"], 1008);
    assert_eq!(oracle["lru"]["capacity_blocks"], 64);
    // The 64-block LRU keeps request 0's first 64 blocks (its deepest are evicted first).
    assert_eq!(oracle["lru"]["cached_tokens"], 1008);
    let md = std::fs::read_to_string(&outcome.files.markdown).unwrap();
    let rows = [
        "| oracle (trace): infinite cache, 16-token blocks | 3 | — | 31.3% |",
        "| oracle (trace): LRU 64 blocks | 3 | — | 31.3% |",
    ];
    for row in rows {
        assert!(md.contains(row), "{row} in\n{md}");
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn cli_flags_make_the_mooncake_spec() {
    let parse =
        |args: &[&str]| cli::BenchArgs::from_flags(["--workload", "mooncake"].iter().chain(args));
    let args = parse(&[
        "--trace",
        "t.jsonl",
        "--window",
        "10..20",
        "--max-requests",
        "300",
        "--max-output-tokens",
        "32",
        "--oracle-blocks",
        "16384",
        "--trace-speed",
        "20",
    ])
    .unwrap();
    assert_eq!(
        (args.oracle_block_size, args.oracle_blocks),
        (16, Some(16384))
    );
    assert_eq!(args.trace_speed, 20.0);
    let Ok(kvgate_bench::WorkloadSpec::Mooncake(spec)) = args.workload_spec() else {
        panic!("a mooncake spec")
    };
    assert_eq!(
        spec,
        Mooncake {
            file: "t.jsonl".into(),
            window: Some(TraceWindow {
                start_min: 10.0,
                end_min: Some(20.0)
            }),
            max_requests: Some(300),
            max_output_tokens: Some(32),
            tokenizer: tokenizer_dir(),
        }
    );
    let custom = parse(&["--trace", "t", "--tokenizer", "/tok"]).unwrap();
    let Ok(kvgate_bench::WorkloadSpec::Mooncake(spec)) = custom.workload_spec() else {
        panic!("a mooncake spec")
    };
    assert_eq!(spec.tokenizer, PathBuf::from("/tok"));
    let err = parse(&[])
        .unwrap()
        .workload_spec()
        .expect_err("needs --trace");
    assert!(err.to_string().contains("--trace"), "{err}");
    let err = parse(&["--trace", "t", "--window", "20..10"])
        .map(|_| ())
        .expect_err("backwards window")
        .to_string();
    assert!(
        err.contains("--window") && err.contains("ends before it starts"),
        "{err}"
    );
}

//! [`ReplicaUris`]: which replica of a target each request goes to.
//!
//! A target may name several replicas of one server (`NAME=URL1,URL2`). Request number
//! `r` of the workload (its index: conversation by conversation, turn by turn) goes to
//! replica `r mod n`. That is round-robin per request rather than per conversation, so
//! consecutive turns of one conversation land on different replicas; and it depends only
//! on the workload, not on timing, so every run of a seeded workload spreads the same way.

use std::{collections::HashMap, sync::Arc};

use http::Uri;

use super::endpoint_uri;
use crate::{BenchError, Target};

/// Per request path, the request URI on each replica of one target.
#[derive(Debug, Clone)]
pub(crate) struct ReplicaUris {
    by_path: HashMap<Arc<str>, Vec<Uri>>,
}

impl ReplicaUris {
    /// The URIs of `paths` on every replica of `target`.
    ///
    /// # Errors
    /// [`BenchError::InvalidUrl`] when a replica URL is bad.
    pub(crate) fn new<'a>(
        target: &Target,
        paths: impl IntoIterator<Item = &'a Arc<str>>,
    ) -> Result<Self, BenchError> {
        let mut by_path = HashMap::new();
        for path in paths {
            if !by_path.contains_key(path) {
                let uris = target
                    .urls()
                    .map(|url| endpoint_uri(url, path))
                    .collect::<Result<Vec<_>, _>>()?;
                by_path.insert(path.clone(), uris);
            }
        }
        Ok(Self { by_path })
    }

    /// The URI of request `index` on `path`: replica `index mod n`.
    pub(crate) fn get(&self, path: &str, index: usize) -> Option<&Uri> {
        let uris = self.by_path.get(path)?;
        uris.get(index.checked_rem(uris.len())?)
    }
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use std::{
        convert::Infallible,
        sync::{Arc, Mutex},
    };

    use bytes::Bytes;
    use http::{Request, Response};
    use http_body_util::{BodyExt, Full};
    use hyper::{body::Incoming, server::conn::http1, service::service_fn};
    use hyper_util::rt::TokioIo;
    use serde_json::{Value, json};
    use tokio::net::TcpListener;

    use super::*;
    use crate::{
        BodyOptions, CHAT_COMPLETIONS_PATH, LoadOptions, Schedule, SharedPrefix, run_load,
    };

    #[test]
    fn request_index_picks_the_replica() {
        let target = Target::new("t", "http://a:1").with_replicas(["http://b:2", "http://c:3"]);
        let path: Arc<str> = Arc::from("/v1/x");
        let uris = ReplicaUris::new(&target, [&path, &path]).unwrap();
        let hosts: Vec<_> = (0..7)
            .map(|i| uris.get("/v1/x", i).and_then(Uri::host).unwrap_or("-"))
            .collect();
        assert_eq!(hosts, ["a", "b", "c", "a", "b", "c", "a"]);
        assert!(uris.get("/other", 0).is_none());
        let single = ReplicaUris::new(&Target::new("t", "http://a:1"), [&path]).unwrap();
        assert!((0..3).all(|i| single.get("/v1/x", i).and_then(Uri::host) == Some("a")));
    }

    /// Every request the recorders got, in arrival order: (server, conversation, turn).
    type Log = Arc<Mutex<Vec<(usize, u32, u32)>>>;

    /// A server that answers every chat completion with a tiny whole JSON body and logs
    /// the `Question C.T:` tag (conversation, turn) of each request's last message.
    async fn recorder(server: usize, log: Log) -> String {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let url = format!("http://{}", listener.local_addr().unwrap());
        tokio::spawn(async move {
            while let Ok((stream, _)) = listener.accept().await {
                let log = log.clone();
                tokio::spawn(async move {
                    let service = service_fn(move |req| answer(server, log.clone(), req));
                    let _ = http1::Builder::new()
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        url
    }

    async fn answer(
        server: usize,
        log: Log,
        req: Request<Incoming>,
    ) -> Result<Response<Full<Bytes>>, Infallible> {
        let bytes = req.into_body().collect().await.unwrap().to_bytes();
        let body: Value = serde_json::from_slice(&bytes).unwrap();
        let last = body["messages"].as_array().unwrap().last().unwrap();
        let tag = last["content"].as_str().unwrap();
        let tag = tag.strip_prefix("Question ").unwrap().split(':').next();
        let (conversation, turn) = tag.unwrap().split_once('.').unwrap();
        let (c, t) = (conversation.parse().unwrap(), turn.parse().unwrap());
        log.lock().unwrap().push((server, c, t));
        // Later conversations answer faster, so free-running workers would reorder.
        tokio::time::sleep(std::time::Duration::from_millis(u64::from(12 - 2 * c))).await;
        let reply = json!({
            "choices": [{"message": {"role": "assistant", "content": "ok"}}],
            "usage": {"prompt_tokens": 10, "completion_tokens": 1},
        });
        Ok(Response::builder()
            .header("content-type", "application/json")
            .body(Full::new(Bytes::from(reply.to_string())))
            .unwrap())
    }

    /// Two recorders, a `pair=A,B` target and 6 three-turn conversations.
    async fn setup() -> (Log, Target, Arc<crate::Workload>) {
        let log = Log::default();
        let a = recorder(0, log.clone()).await;
        let b = recorder(1, log.clone()).await;
        let target = Target::parse(&format!("pair={a},{b}")).unwrap();
        let body = BodyOptions {
            stream: false,
            ..BodyOptions::default()
        };
        let spec = SharedPrefix {
            groups: 2,
            conversations_per_group: 3,
            turns: 3,
            system_tokens: 20,
            question_tokens: 3,
            answer_tokens: 3,
        };
        let workload = Arc::new(spec.generate(&body, 5));
        assert!(
            workload
                .conversations
                .iter()
                .all(|c| &*c.path == CHAT_COMPLETIONS_PATH)
        );
        (log, target, workload)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn run_load_alternates_replicas_per_request() {
        let (log, target, workload) = setup().await;
        for (concurrency, lockstep) in [(1, false), (4, false), (4, true)] {
            log.lock().unwrap().clear();
            let arrival = crate::Arrival::Closed { concurrency };
            let schedule = Schedule::build(arrival, &workload, 1).unwrap();
            let options = LoadOptions {
                lockstep,
                ..LoadOptions::default()
            };
            let run = run_load(&target, &schedule, workload.clone(), &options)
                .await
                .unwrap();
            assert_eq!(run.target.name, "pair");
            assert_eq!(run.summary().errors, 0);
            // 6 conversations × 3 turns: request index 3c + t goes to replica (3c + t) mod 2.
            let mut got = log.lock().unwrap().clone();
            got.sort_unstable();
            let want: Vec<(usize, u32, u32)> = (0..2)
                .flat_map(|r| {
                    (0..6u32)
                        .flat_map(|c| (0..3u32).map(move |t| (c, t)))
                        .filter(move |(c, t)| ((3 * c + t) % 2) as usize == r)
                        .map(move |(c, t)| (r, c, t))
                })
                .collect();
            assert_eq!(got, want, "concurrency {concurrency}, lockstep {lockstep}");
            // Consecutive turns of every conversation went to different replicas.
            for (server, c, t) in &got {
                assert!(
                    !got.contains(&(*server, *c, t + 1)),
                    "conversation {c} turn {t}"
                );
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn lockstep_rounds_arrive_in_worker_order() {
        let (log, target, workload) = setup().await;
        let schedule = Schedule::build(crate::Arrival::Closed { concurrency: 4 }, &workload, 1);
        let options = LoadOptions {
            lockstep: true,
            ..LoadOptions::default()
        };
        // Workers 0..3 take conversations 0..3, then workers 0 and 1 take 4 and 5; each
        // round sends every worker's next turn in worker order.
        let mut want = Vec::new();
        for (conversations, turns) in [(0..4u32, 0..3u32), (4..6, 0..3)] {
            for t in turns {
                want.extend(conversations.clone().map(|c| (c, t)));
            }
        }
        for _ in 0..2 {
            log.lock().unwrap().clear();
            let schedule = schedule.as_ref().unwrap();
            let run = run_load(&target, schedule, workload.clone(), &options)
                .await
                .unwrap();
            assert_eq!(run.records.len(), 18);
            let got: Vec<(u32, u32)> = log
                .lock()
                .unwrap()
                .iter()
                .map(|&(_, c, t)| (c, t))
                .collect();
            assert_eq!(got, want);
        }
    }
}

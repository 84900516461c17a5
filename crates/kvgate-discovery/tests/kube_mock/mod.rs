#![allow(clippy::unwrap_used, clippy::expect_used)]
//! A tiny stand-in for the Kubernetes API server: list and watch (newline-delimited JSON
//! events) of pods and InferencePools in one namespace, with label and field selectors, an
//! event log that resumed watches replay from their `resourceVersion`, dropping every open
//! watch, and compaction (a watch from before it gets a 410 "too old resource version").

use std::collections::{BTreeMap, HashMap};
use std::convert::Infallible;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::extract::{Query, State};
use axum::http::header::CONTENT_TYPE;
use axum::response::{IntoResponse, Response};
use axum::routing::get;
use bytes::Bytes;
use serde_json::{Value, json};
use tokio::sync::{mpsc, watch};

/// The two resources served.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub(crate) enum Kind {
    Pod,
    Pool,
}

#[derive(Debug)]
struct Ev {
    rv: u64,
    kind: Kind,
    deleted: bool,
    old: Option<Value>,
    new: Value,
}

#[derive(Debug, Default)]
struct Inner {
    rv: u64,
    objects: HashMap<(Kind, String), Value>,
    log: Vec<Ev>,
    /// Watches from a resourceVersion below this get 410.
    compacted_below: u64,
    lists: HashMap<&'static str, u32>,
    watches: HashMap<&'static str, u32>,
}

/// The mock API server's state.
#[derive(Debug)]
pub(crate) struct Mock {
    inner: Mutex<Inner>,
    changed: watch::Sender<u64>,
    drops: watch::Sender<u64>,
}

fn name_of(kind: Kind) -> &'static str {
    match kind {
        Kind::Pod => "pods",
        Kind::Pool => "inferencepools",
    }
}

impl Mock {
    /// Serves on 127.0.0.1 (any port); returns the state and the address.
    pub(crate) async fn start() -> (Arc<Mock>, SocketAddr) {
        let mock = Arc::new(Mock {
            inner: Mutex::new(Inner::default()),
            changed: watch::channel(0).0,
            drops: watch::channel(0).0,
        });
        let app = Router::new()
            .route("/api/v1/namespaces/{ns}/pods", get(pods))
            .route(
                "/apis/inference.networking.k8s.io/v1/namespaces/{ns}/inferencepools",
                get(pools),
            )
            .with_state(Arc::clone(&mock));
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
        (mock, addr)
    }

    /// Creates or replaces an object (logged as an event).
    pub(crate) fn put(&self, kind: Kind, mut object: Value) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        let rv = g.rv;
        object["metadata"]["resourceVersion"] = json!(rv.to_string());
        let name = object["metadata"]["name"].as_str().unwrap().to_string();
        let old = g.objects.insert((kind, name), object.clone());
        g.log.push(Ev {
            rv,
            kind,
            deleted: false,
            old,
            new: object,
        });
        drop(g);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Deletes an object; `logged: false` loses the event (only a relist shows it).
    pub(crate) fn delete(&self, kind: Kind, name: &str, logged: bool) {
        let mut g = self.inner.lock().unwrap();
        g.rv += 1;
        let rv = g.rv;
        let Some(mut old) = g.objects.remove(&(kind, name.to_string())) else {
            return;
        };
        if logged {
            let prev = old.clone();
            old["metadata"]["resourceVersion"] = json!(rv.to_string());
            g.log.push(Ev {
                rv,
                kind,
                deleted: true,
                old: Some(prev),
                new: old,
            });
        }
        drop(g);
        self.changed.send_modify(|v| *v += 1);
    }

    /// Every watch from a resourceVersion up to now answers 410 from here on.
    pub(crate) fn compact(&self) {
        let mut g = self.inner.lock().unwrap();
        g.compacted_below = g.rv + 1;
    }

    /// Ends every open watch response.
    pub(crate) fn drop_watches(&self) {
        // Under the lock, so a watch never sends an event made after the drop.
        let _g = self.inner.lock().unwrap();
        self.drops.send_modify(|v| *v += 1);
    }

    /// (lists, watches) served for `kind`.
    pub(crate) fn calls(&self, kind: Kind) -> (u32, u32) {
        let g = self.inner.lock().unwrap();
        let n = name_of(kind);
        (
            g.lists.get(n).copied().unwrap_or(0),
            g.watches.get(n).copied().unwrap_or(0),
        )
    }
}

/// A query's selector as a predicate over an object.
fn matches(object: &Value, q: &HashMap<String, String>) -> bool {
    if let Some(sel) = q.get("labelSelector").filter(|s| !s.is_empty()) {
        for pair in sel.split(',') {
            let (k, v) = pair.split_once('=').unwrap();
            if object["metadata"]["labels"][k].as_str() != Some(v) {
                return false;
            }
        }
    }
    if let Some(sel) = q.get("fieldSelector").filter(|s| !s.is_empty()) {
        let name = sel.strip_prefix("metadata.name=").unwrap();
        if object["metadata"]["name"].as_str() != Some(name) {
            return false;
        }
    }
    true
}

async fn pods(State(m): State<Arc<Mock>>, Query(q): Query<HashMap<String, String>>) -> Response {
    serve(m, Kind::Pod, q)
}

async fn pools(State(m): State<Arc<Mock>>, Query(q): Query<HashMap<String, String>>) -> Response {
    serve(m, Kind::Pool, q)
}

fn json_response(body: Vec<u8>) -> Response {
    ([(CONTENT_TYPE, "application/json")], body).into_response()
}

fn serve(m: Arc<Mock>, kind: Kind, q: HashMap<String, String>) -> Response {
    let watching = q.get("watch").is_some_and(|w| w == "true" || w == "1");
    if !watching {
        let mut g = m.inner.lock().unwrap();
        *g.lists.entry(name_of(kind)).or_default() += 1;
        let items: Vec<&Value> = g
            .objects
            .iter()
            .filter(|((k, _), o)| *k == kind && matches(o, &q))
            .collect::<BTreeMap<_, _>>()
            .into_values()
            .collect();
        let body = json!({
            "apiVersion": "v1", "kind": "List",
            "metadata": {"resourceVersion": g.rv.to_string()},
            "items": items,
        });
        return json_response(serde_json::to_vec(&body).unwrap());
    }
    let from: u64 = q
        .get("resourceVersion")
        .and_then(|r| r.parse().ok())
        .unwrap_or(0);
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    {
        let mut g = m.inner.lock().unwrap();
        *g.watches.entry(name_of(kind)).or_default() += 1;
        if from < g.compacted_below {
            let gone = json!({"type": "ERROR", "object": {
                "apiVersion": "v1", "kind": "Status", "status": "Failure",
                "message": "too old resource version", "reason": "Expired", "code": 410}});
            let _ = tx.try_send(Bytes::from(format!("{gone}\n")));
            drop(tx);
            return stream_response(rx);
        }
    }
    tokio::spawn(watch_task(m, kind, q, from, tx));
    stream_response(rx)
}

fn stream_response(rx: mpsc::Receiver<Bytes>) -> Response {
    let body = futures_util::stream::unfold(rx, |mut rx| async move {
        rx.recv().await.map(|b| (Ok::<_, Infallible>(b), rx))
    });
    (
        [(CONTENT_TYPE, "application/json")],
        axum::body::Body::from_stream(body),
    )
        .into_response()
}

/// Streams the logged events after `cursor` that the watch's selector sees, until the client
/// goes away or [`Mock::drop_watches`].
async fn watch_task(
    m: Arc<Mock>,
    kind: Kind,
    q: HashMap<String, String>,
    mut cursor: u64,
    tx: mpsc::Sender<Bytes>,
) {
    let mut changed = m.changed.subscribe();
    let mut drops = m.drops.subscribe();
    changed.borrow_and_update();
    drops.borrow_and_update();
    loop {
        let lines: Vec<String> = {
            let g = m.inner.lock().unwrap();
            if drops.has_changed().unwrap_or(true) {
                return;
            }
            let mut out = Vec::new();
            for ev in g.log.iter().filter(|e| e.kind == kind && e.rv > cursor) {
                let was = ev.old.as_ref().is_some_and(|o| matches(o, &q));
                let is = matches(&ev.new, &q);
                let typ = match (ev.deleted, was, is) {
                    (true, true, _) => "DELETED",
                    (false, true, true) => "MODIFIED",
                    (false, false, true) => "ADDED",
                    (false, true, false) => "DELETED",
                    _ => continue,
                };
                out.push(json!({"type": typ, "object": ev.new}).to_string());
            }
            cursor = g.rv;
            out
        };
        for line in lines {
            if tx.send(Bytes::from(format!("{line}\n"))).await.is_err() {
                return;
            }
        }
        tokio::select! {
            biased;
            _ = drops.changed() => return,
            _ = changed.changed() => {}
            () = tx.closed() => return,
        }
    }
}

/// A pod JSON object.
pub(crate) fn pod(name: &str, ip: Option<&str>, ready: bool, labels: &[(&str, &str)]) -> Value {
    let labels: serde_json::Map<String, Value> = labels
        .iter()
        .map(|(k, v)| ((*k).to_string(), json!(v)))
        .collect();
    let mut status = json!({
        "phase": "Running",
        "conditions": [{"type": "Ready", "status": if ready { "True" } else { "False" }}],
    });
    if let Some(ip) = ip {
        status["podIP"] = json!(ip);
    }
    json!({
        "apiVersion": "v1", "kind": "Pod",
        "metadata": {"name": name, "namespace": "llm", "labels": labels},
        "spec": {"containers": [{"name": "vllm", "image": "vllm"}]},
        "status": status,
    })
}

/// An InferencePool JSON object selecting `app=<app>` on `ports`.
pub(crate) fn pool(name: &str, app: &str, ports: &[u16]) -> Value {
    let ports: Vec<Value> = ports.iter().map(|p| json!({"number": p})).collect();
    json!({
        "apiVersion": "inference.networking.k8s.io/v1", "kind": "InferencePool",
        "metadata": {"name": name, "namespace": "llm"},
        "spec": {
            "selector": {"matchLabels": {"app": app}},
            "targetPorts": ports,
            "endpointPickerRef": {"name": "kvgate", "portNumber": 9002},
        },
    })
}

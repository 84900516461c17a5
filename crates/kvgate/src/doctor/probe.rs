//! The doctor's network probes: plain HTTP to the engine, a ZMQ SUB on its KV events socket
//! and one DEALER request on its replay socket.

use std::time::Duration;

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::TokioExecutor,
};
use tokio::time::timeout;
use zeromq::{DealerSocket, Socket, SocketRecv, SocketSend, SubSocket, ZmqMessage};

/// Sequence number vLLM's replay ROUTER sends as its end-of-replay marker.
const END_SEQ: u64 = u64::MAX;

/// A small HTTP/1 client bound to one engine base URL.
#[derive(Debug, Clone)]
pub(crate) struct Http {
    base: String,
    timeout: Duration,
    client: Client<HttpConnector, Full<Bytes>>,
}

impl Http {
    pub(crate) fn new(base: &str, timeout: Duration) -> Http {
        Http {
            base: base.trim_end_matches('/').to_owned(),
            timeout,
            client: Client::builder(TokioExecutor::new()).build(HttpConnector::new()),
        }
    }

    /// `(status, body)` of `GET path`.
    pub(crate) async fn get(&self, path: &str) -> anyhow::Result<(u16, String)> {
        self.send(http::Method::GET, path, Bytes::new()).await
    }

    /// `(status, body)` of `POST path` with a JSON body.
    pub(crate) async fn post(&self, path: &str, body: Bytes) -> anyhow::Result<(u16, String)> {
        self.send(http::Method::POST, path, body).await
    }

    async fn send(
        &self,
        method: http::Method,
        path: &str,
        body: Bytes,
    ) -> anyhow::Result<(u16, String)> {
        let uri = format!("{}{path}", self.base);
        let req = http::Request::builder()
            .method(method)
            .uri(uri.as_str())
            .header(http::header::CONTENT_TYPE, "application/json")
            .body(Full::new(body))?;
        let call = async {
            let resp = self.client.request(req).await?;
            let status = resp.status().as_u16();
            let bytes = resp.into_body().collect().await?.to_bytes();
            anyhow::Ok((status, String::from_utf8_lossy(&bytes).into_owned()))
        };
        match timeout(self.timeout, call).await {
            Ok(r) => r.map_err(|e| anyhow::anyhow!("{uri}: {e}")),
            Err(_) => anyhow::bail!("{uri}: no answer within {:?}", self.timeout),
        }
    }
}

/// A connected SUB socket on an engine's KV events endpoint.
pub(crate) struct Events {
    sock: SubSocket,
}

impl std::fmt::Debug for Events {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Events").finish_non_exhaustive()
    }
}

/// What the first event message held.
#[derive(Debug)]
pub(crate) struct FirstBatch {
    pub(crate) seq: u64,
    pub(crate) events: usize,
    pub(crate) topic: String,
}

impl Events {
    /// Connects and subscribes to every topic.
    pub(crate) async fn connect(endpoint: &str, wait: Duration) -> anyhow::Result<Events> {
        let mut sock = SubSocket::new();
        match timeout(wait, sock.connect(endpoint)).await {
            Ok(Ok(())) => {}
            Ok(Err(e)) => anyhow::bail!("{e}"),
            Err(_) => anyhow::bail!("connect timed out after {wait:?}"),
        }
        sock.subscribe("").await?;
        Ok(Events { sock })
    }

    /// The next message, decoded with kvgate's own batch decoder.
    pub(crate) async fn first_batch(&mut self, wait: Duration) -> anyhow::Result<FirstBatch> {
        let msg = match timeout(wait, self.sock.recv()).await {
            Ok(m) => m?,
            Err(_) => anyhow::bail!("no event batch within {wait:?}"),
        };
        let frames = msg.into_vec();
        let [topic, seq, payload] = frames.as_slice() else {
            anyhow::bail!("malformed message: {} frames, want 3", frames.len());
        };
        let seq = seq_of(seq).ok_or_else(|| anyhow::anyhow!("malformed sequence frame"))?;
        let (batch, _) = kvgate_kvcache::decode_batch(payload)
            .map_err(|e| anyhow::anyhow!("undecodable batch: {e}"))?;
        Ok(FirstBatch {
            seq,
            events: batch.events.len(),
            topic: String::from_utf8_lossy(topic).into_owned(),
        })
    }
}

/// What a replay ROUTER answered to a request for everything from seq 0.
#[derive(Debug)]
pub(crate) enum ReplayAnswer {
    /// A retained batch (its sequence number).
    Batch(u64),
    /// Only the end marker: the publisher retains nothing yet.
    Empty,
}

/// Sends one replay request for seq 0 and reads the first reply.
/// (kvgate-kvcache's replay client is crate-private, so this is the same two-frame request.)
pub(crate) async fn replay_first(endpoint: &str, wait: Duration) -> anyhow::Result<ReplayAnswer> {
    let mut sock = DealerSocket::new();
    match timeout(wait, sock.connect(endpoint)).await {
        Ok(Ok(())) => {}
        Ok(Err(e)) => anyhow::bail!("{e}"),
        Err(_) => anyhow::bail!("connect timed out after {wait:?}"),
    }
    let request = ZmqMessage::try_from(vec![
        Bytes::new(),
        Bytes::copy_from_slice(&0u64.to_be_bytes()),
    ])
    .map_err(|e| anyhow::anyhow!("{e}"))?;
    sock.send(request).await?;
    let msg = match timeout(wait, sock.recv()).await {
        Ok(m) => m?,
        Err(_) => anyhow::bail!("no reply within {wait:?}"),
    };
    let mut frames = msg.into_vec();
    if frames.first().is_some_and(|f| f.is_empty()) {
        frames.remove(0);
    }
    // `[topic, seq, payload]` (vLLM ≥ 0.26) or `[seq, payload]`.
    let seq = match frames.len() {
        3 => seq_of(&frames[1]),
        2 => seq_of(&frames[0]),
        n => anyhow::bail!("malformed reply: {n} frames"),
    }
    .ok_or_else(|| anyhow::anyhow!("malformed sequence frame"))?;
    Ok(if seq == END_SEQ {
        ReplayAnswer::Empty
    } else {
        ReplayAnswer::Batch(seq)
    })
}

fn seq_of(frame: &[u8]) -> Option<u64> {
    let b: [u8; 8] = frame.get(..8)?.try_into().ok()?;
    Some(u64::from_be_bytes(b))
}

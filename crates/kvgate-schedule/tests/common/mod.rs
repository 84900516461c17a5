//! Loopback HTTP servers and waits shared by the registry's integration tests.
#![allow(dead_code, clippy::unwrap_used)]

use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::Bytes;
use http_body_util::Full;
use hyper::service::service_fn;
use hyper_util::rt::TokioIo;
use tokio::net::TcpListener;

/// Serves HTTP/1.1 on a loopback port until the test ends, answering each request with
/// `answer(path)`; returns the base URL.
pub(crate) async fn serve<F, Fut>(answer: F) -> String
where
    F: Fn(String) -> Fut + Send + Sync + 'static,
    Fut: Future<Output = hyper::Response<Full<Bytes>>> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let answer = Arc::new(answer);
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            let answer = Arc::clone(&answer);
            tokio::spawn(async move {
                let svc = service_fn(move |req: hyper::Request<hyper::body::Incoming>| {
                    let reply = answer(req.uri().path().to_owned());
                    async move { Ok::<_, Infallible>(reply.await) }
                });
                let _ = hyper::server::conn::http1::Builder::new()
                    .serve_connection(TokioIo::new(stream), svc)
                    .await;
            });
        }
    });
    format!("http://{addr}")
}

/// A response with `status` and `body`.
pub(crate) fn response(status: u16, body: impl Into<Bytes>) -> hyper::Response<Full<Bytes>> {
    hyper::Response::builder()
        .status(status)
        .body(Full::new(body.into()))
        .unwrap()
}

/// A loopback URL where nothing listens (bound, then released).
pub(crate) async fn refused_url() -> String {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    drop(listener);
    format!("http://{addr}")
}

/// Polls `cond` every 10 ms; panics naming `what` after 20 s.
pub(crate) async fn wait_for(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !cond() {
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

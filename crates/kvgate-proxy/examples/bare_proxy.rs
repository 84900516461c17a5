//! A reference for benchmarks only: the least a proxy built on kvgate's HTTP stack does (the
//! same hyper server and tokio runtime, two workers, and hyper-util's pooled client, which
//! kvgate now uses only for `https://` engines; with a pool like kvgate's own for `http://`
//! ones, this proxy counted 37.3 k instructions a request instead of 50.6 k), with none of
//! kvgate's work: no body parse, no scheduling, no metrics, no accounting, no timeouts.
//! `scripts/proxy_peers.sh --targets hyper-bare` measures it beside the routers, so the
//! report shows how much of a router's cost per request is the stack and how much its own.
//!
//! With `--per-core`, the same proxy runs one single-threaded runtime per core instead, each
//! with its own listener on the address (`SO_REUSEPORT`, the kernel spreads connections) and
//! its own pooled client, so a request and its upstream connection never change threads:
//! what the stack costs without the work-stealing scheduler (`--targets hyper-bare-per-core`).
//!
//! Usage: `bare_proxy LISTEN_ADDR UPSTREAM_URL [--per-core]` (e.g. `127.0.0.1:8080
//! http://127.0.0.1:9000`).

use std::{error::Error, net::SocketAddr};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Request, Response, body::Incoming, server::conn::http1, service::service_fn};
use hyper_util::{
    client::legacy::{Client, connect::HttpConnector},
    rt::{TokioExecutor, TokioIo},
};

type Upstream = Client<HttpConnector, Full<Bytes>>;

/// Reads the client's body whole, then sends it with the client's headers (but `host`) to
/// `upstream` on a pooled connection; the response streams back as it comes.
async fn forward(
    client: Upstream,
    upstream: &'static str,
    req: Request<Incoming>,
) -> Result<Response<Incoming>, Box<dyn Error + Send + Sync>> {
    let (parts, body) = req.into_parts();
    let bytes = body.collect().await?.to_bytes();
    let path = parts.uri.path_and_query().map_or("/", |p| p.as_str());
    let mut out = Request::builder()
        .method(parts.method)
        .uri(format!("{upstream}{path}"));
    for (name, value) in &parts.headers {
        if name != http::header::HOST {
            out = out.header(name, value);
        }
    }
    Ok(client.request(out.body(Full::new(bytes))?).await?)
}

/// Accepts on `listener` until an accept fails, each connection served in its own task with
/// `client` for the upstream.
async fn serve(
    listener: tokio::net::TcpListener,
    client: Upstream,
    upstream: &'static str,
) -> std::io::Result<()> {
    loop {
        let (stream, _) = listener.accept().await?;
        stream.set_nodelay(true)?;
        let client = client.clone();
        tokio::spawn(async move {
            let service = service_fn(move |req| forward(client.clone(), upstream, req));
            // A connection's error ends that connection only.
            let _ = http1::Builder::new()
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
    }
}

fn client() -> Upstream {
    Client::builder(TokioExecutor::new()).build(HttpConnector::new())
}

fn main() -> Result<(), Box<dyn Error>> {
    let mut args = std::env::args().skip(1);
    let (Some(listen), Some(upstream)) = (args.next(), args.next()) else {
        return Err("usage: bare_proxy LISTEN_ADDR UPSTREAM_URL [--per-core]".into());
    };
    let per_core = args.next().as_deref() == Some("--per-core");
    let listen: SocketAddr = listen.parse()?;
    let upstream: &'static str = Box::leak(upstream.trim_end_matches('/').into());
    if !per_core {
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .enable_all()
            .build()?;
        return runtime.block_on(async move {
            let listener = tokio::net::TcpListener::bind(listen).await?;
            Ok(serve(listener, client(), upstream).await?)
        });
    }
    let cores = std::thread::available_parallelism().map_or(2, usize::from);
    let threads: Vec<_> = (0..cores)
        .map(|_| {
            std::thread::spawn(move || -> std::io::Result<()> {
                let runtime = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                runtime.block_on(async move {
                    let socket = if listen.is_ipv4() {
                        tokio::net::TcpSocket::new_v4()?
                    } else {
                        tokio::net::TcpSocket::new_v6()?
                    };
                    socket.set_reuseport(true)?;
                    socket.bind(listen)?;
                    serve(socket.listen(1024)?, client(), upstream).await
                })
            })
        })
        .collect();
    for thread in threads {
        thread.join().map_err(|_| "a serving thread panicked")??;
    }
    Ok(())
}

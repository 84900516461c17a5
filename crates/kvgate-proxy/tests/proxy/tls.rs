//! TLS on both sides, over real sockets: a test CA and a certificate for `127.0.0.1` made at
//! test time, a TLS spy engine that records the decrypted bytes, and kvgate's listener on
//! TLS (HTTP/1.1 and h2 by ALPN).

use std::{path::PathBuf, sync::Arc};

use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::HttpConnector;
use kvgate_proxy::config::ListenerTls;
use rcgen::{BasicConstraints, CertificateParams, IsCa, Issuer, KeyPair, KeyUsagePurpose};
use rustls::{
    ClientConfig, RootCertStore, ServerConfig,
    pki_types::{CertificateDer, PrivateKeyDer, pem::PemObject},
};

use super::*;

/// A certificate and its key, in PEM, and where they were written.
struct Pem {
    cert: String,
    key: String,
    files: ListenerTls,
}

impl Pem {
    fn server_config(&self) -> Arc<ServerConfig> {
        let certs = vec![CertificateDer::from_pem_slice(self.cert.as_bytes()).unwrap()];
        let key = PrivateKeyDer::from_pem_slice(self.key.as_bytes()).unwrap();
        let config = ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(certs, key)
            .unwrap();
        Arc::new(config)
    }
}

/// A test CA (its certificate in `ca.pem`) and a server certificate it signed for
/// `127.0.0.1` and `localhost`, all in a fresh directory.
struct Pki {
    /// Removed with its files when the test ends.
    _tmp: tempfile::TempDir,
    dir: PathBuf,
    ca: CertificateDer<'static>,
    ca_file: PathBuf,
    server: Pem,
}

fn provider() -> Arc<rustls::crypto::CryptoProvider> {
    Arc::new(rustls::crypto::ring::default_provider())
}

fn write(dir: &std::path::Path, name: &str, cert: String, key: String) -> Pem {
    let files = ListenerTls {
        cert_file: dir.join(format!("{name}.pem")),
        key_file: dir.join(format!("{name}.key")),
    };
    std::fs::write(&files.cert_file, &cert).unwrap();
    std::fs::write(&files.key_file, &key).unwrap();
    Pem { cert, key, files }
}

fn pki(name: &str) -> Pki {
    let tmp = tempfile::Builder::new()
        .prefix(&format!("kvgate-tls-{name}-"))
        .tempdir()
        .unwrap();
    let dir = tmp.path().to_owned();
    let mut ca_params = CertificateParams::new(Vec::<String>::new()).unwrap();
    ca_params.is_ca = IsCa::Ca(BasicConstraints::Unconstrained);
    ca_params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign];
    let ca_key = KeyPair::generate().unwrap();
    let ca_cert = ca_params.self_signed(&ca_key).unwrap();
    let ca_file = dir.join("ca.pem");
    std::fs::write(&ca_file, ca_cert.pem()).unwrap();
    let issuer = Issuer::new(ca_params, ca_key);
    let server_key = KeyPair::generate().unwrap();
    let server_cert = CertificateParams::new(vec!["127.0.0.1".to_owned(), "localhost".to_owned()])
        .unwrap()
        .signed_by(&server_key, &issuer)
        .unwrap();
    let server = write(
        &dir,
        "server",
        server_cert.pem(),
        server_key.serialize_pem(),
    );
    Pki {
        _tmp: tmp,
        ca: ca_cert.der().clone(),
        dir,
        ca_file,
        server,
    }
}

/// A self-signed certificate for `127.0.0.1` that no CA of the test vouches for.
fn untrusted(dir: &std::path::Path) -> Pem {
    let key = KeyPair::generate().unwrap();
    let cert = CertificateParams::new(vec!["127.0.0.1".to_owned()])
        .unwrap()
        .self_signed(&key)
        .unwrap();
    write(dir, "untrusted", cert.pem(), key.serialize_pem())
}

/// A client that trusts only `ca`, speaking HTTP/1.1 or (ALPN) h2 only.
fn tls_client(
    ca: &CertificateDer<'static>,
    h2: bool,
) -> Client<HttpsConnector<HttpConnector>, Full<Bytes>> {
    let mut roots = RootCertStore::empty();
    roots.add(ca.clone()).unwrap();
    let config = ClientConfig::builder_with_provider(provider())
        .with_safe_default_protocol_versions()
        .unwrap()
        .with_root_certificates(roots)
        .with_no_client_auth();
    let builder = HttpsConnectorBuilder::new()
        .with_tls_config(config)
        .https_only();
    let connector = if h2 {
        builder.enable_http2().build()
    } else {
        builder.enable_http1().build()
    };
    let mut client = Client::builder(TokioExecutor::new());
    client.http2_only(h2);
    client.build(connector)
}

/// A chat body of at least `size` bytes for the alias `qwen`, and the same with the
/// canonical name spliced in (what the engine must receive).
fn chat_pair(size: usize) -> (String, String) {
    let pad = "x".repeat(size.saturating_sub(80));
    let template = format!(
        r#"{{"model":{{M}},"messages":[{{"role":"user","content":"é {pad}"}}],"max_tokens":3}}"#
    );
    (
        template.replace("{M}", "\"qwen\""),
        template.replace("{M}", &format!("\"{CANONICAL}\"")),
    )
}

/// A client on TLS (HTTP/1.1 and h2) → kvgate's TLS listener → an `https://` engine that
/// kvgate trusts through `upstream_ca` only: the engine gets exactly the bytes kvgate would
/// send over plain HTTP (the alias spliced, nothing else changed), on the pooled connection
/// (small body) and on a dedicated upload connection (a body over 256 KiB), and the client
/// gets exactly the engine's answer with the alias restored.
#[tokio::test]
async fn tls_listener_to_tls_engine_carries_exact_bytes() {
    let pki = pki("e2e");
    let mut spy = Spy::start_tls(
        Behavior::Json(r#"{"id":"x","model":"{MODEL}","choices":[]}"#.into()),
        pki.server.server_config(),
    )
    .await;
    assert!(spy.url().starts_with("https://127.0.0.1:"), "{}", spy.url());
    let proxy = RunningProxy::start(ProxyConfig {
        tls: Some(pki.server.files.clone()),
        upstream_ca: Some(pki.ca_file.clone()),
        ..config(&[spy.url()])
    })
    .await;
    let url = format!(
        "https://127.0.0.1:{}/v1/chat/completions",
        proxy.addr.port()
    );
    let cases = [
        ("h1, pooled", false, 200),
        ("h2, pooled", true, 200),
        ("h1, dedicated upload", false, 300 << 10),
        ("h2, dedicated upload", true, 300 << 10),
    ];
    for (name, h2, size) in cases {
        let (sent, forwarded) = chat_pair(size);
        let req = http::Request::post(&url)
            .header("content-type", "application/json")
            .header("x-request-id", "tls-1")
            .body(Full::new(Bytes::from(sent)))
            .unwrap();
        let resp = tls_client(&pki.ca, h2).request(req).await.unwrap();
        let want_version = if h2 {
            http::Version::HTTP_2
        } else {
            http::Version::HTTP_11
        };
        assert_eq!(resp.version(), want_version, "{name}: ALPN");
        assert_eq!(resp.status(), StatusCode::OK, "{name}");
        assert_eq!(resp.headers()["x-request-id"], "tls-1", "{name}");
        let body = resp.into_body().collect().await.unwrap().to_bytes();
        assert_eq!(
            &body[..],
            br#"{"id":"x","model":"qwen","choices":[]}"#,
            "{name}: response"
        );
        let got = spy.next_request().await;
        assert_eq!(
            got.head,
            format!(
                "POST /v1/chat/completions HTTP/1.1\r\n\
                 content-type: application/json\r\n\
                 x-request-id: tls-1\r\n\
                 host: {}\r\n\
                 content-length: {}",
                spy.addr,
                forwarded.len()
            ),
            "{name}: head"
        );
        assert!(
            got.body == forwarded.as_bytes(),
            "{name}: body bytes differ"
        );
    }
}

/// An engine whose certificate kvgate does not trust: the client gets a JSON 503 at once
/// (not a hang, not a dropped connection), the engine never sees a request byte, and the
/// failure is counted as a TLS error of that endpoint, on the pooled and on the dedicated
/// upload path.
#[tokio::test]
async fn untrusted_engine_certificate_is_a_counted_json_error() {
    let pki = pki("untrusted");
    let bad = untrusted(&pki.dir);
    for (name, size) in [("pooled", 200), ("dedicated upload", 300 << 10)] {
        let mut spy = Spy::start_tls(Behavior::Json("{}".into()), bad.server_config()).await;
        let proxy = RunningProxy::start(ProxyConfig {
            upstream_ca: Some(pki.ca_file.clone()),
            expose_internals: false,
            ..config(&[spy.url()])
        })
        .await;
        let (status, headers, body) = post_chat(&proxy, chat_pair(size).0).await;
        assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{name}");
        assert_eq!(headers["content-type"], "application/json", "{name}");
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        assert_eq!(v["error"]["code"], "no_healthy_endpoint", "{name}: {v}");
        assert_eq!(v["error"]["type"], "service_unavailable_error", "{name}");
        assert_eq!(
            spy.requests.try_recv().unwrap_err(),
            TryRecvError::Empty,
            "{name}: the engine got a request"
        );
        let text = metrics(&proxy).await;
        let line = format!(
            "kvgate_upstream_tls_errors_total{{endpoint=\"{}\"}} 1",
            spy.addr
        );
        assert!(text.contains(&line), "{name}: {line} not in\n{text}");
        assert!(
            text.contains("kvgate_request_errors_total{reason=\"no_healthy_endpoint\"} 1"),
            "{name}"
        );
    }
}

/// Plain HTTP sent to the TLS listener ends in a closed connection, counted as a failed
/// handshake; the listener keeps serving TLS clients.
#[tokio::test]
async fn plain_http_on_the_tls_listener_is_refused_and_counted() {
    let pki = pki("plain");
    let spy = Spy::start(Behavior::Json(r#"{"id":"ok"}"#.into())).await;
    let proxy = RunningProxy::start(ProxyConfig {
        tls: Some(pki.server.files.clone()),
        ..config(&[spy.url()])
    })
    .await;
    let plain = client()
        .request(
            http::Request::get(format!("http://{}/health", proxy.addr))
                .body(Full::new(Bytes::new()))
                .unwrap(),
        )
        .await;
    assert!(plain.is_err(), "plain HTTP was answered: {plain:?}");
    // The client may see the connection close before the server counts the failure.
    let text = metrics_with(&proxy, "kvgate_tls_handshake_failures_total 1").await;
    assert!(
        text.contains("kvgate_tls_handshake_failures_total 1"),
        "{text}"
    );
    let req = http::Request::get(format!("https://127.0.0.1:{}/health", proxy.addr.port()))
        .body(Full::new(Bytes::new()))
        .unwrap();
    let resp = tls_client(&pki.ca, false).request(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::OK);
}

/// Unusable TLS files stop the proxy from starting, naming the file.
#[tokio::test]
async fn unusable_tls_files_are_config_errors() {
    let pki = pki("files");
    let missing = pki.dir.join("missing.pem");
    let cases = [
        (
            "listener cert",
            ProxyConfig {
                tls: Some(ListenerTls {
                    cert_file: missing.clone(),
                    key_file: pki.server.files.key_file.clone(),
                }),
                ..config(&["http://127.0.0.1:1".to_owned()])
            },
        ),
        (
            "upstream ca",
            ProxyConfig {
                upstream_ca: Some(missing.clone()),
                ..config(&["http://127.0.0.1:1".to_owned()])
            },
        ),
    ];
    for (name, config) in cases {
        let err = kvgate_proxy::loopback::RunningProxy::launch(config)
            .await
            .unwrap_err();
        assert!(err.to_string().contains("missing.pem"), "{name}: {err}");
    }
}

/// An `https://` engine's `/metrics` is scraped over TLS with the same trust: the trusted
/// engine's answer (the spy's 404) is read (`outcome="status"`), the untrusted one's
/// connection fails (`outcome="connect"`).
#[tokio::test]
async fn https_engine_metrics_are_scraped_over_tls() {
    let pki = pki("scrape");
    let bad = untrusted(&pki.dir);
    for (name, cert, outcome) in [
        ("trusted", pki.server.server_config(), "status"),
        ("untrusted", bad.server_config(), "connect"),
    ] {
        let spy = Spy::start_tls(Behavior::Json("{}".into()), cert).await;
        let proxy = RunningProxy::start(ProxyConfig {
            upstream_ca: Some(pki.ca_file.clone()),
            ..config(&[spy.url()])
        })
        .await;
        let line = format!(
            "scrapes_total{{endpoint=\"{}\",outcome=\"{outcome}\"}}",
            spy.addr
        );
        let deadline = tokio::time::Instant::now() + Duration::from_secs(10);
        loop {
            let text = metrics(&proxy).await;
            if text.contains(&line) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "{name}: no {line} in\n{text}"
            );
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }
}

/// A render server on `https://` (named for the model) is called over TLS with the same
/// trust as the engines, and receives exactly the bytes the engine then receives.
#[tokio::test]
async fn https_render_server_gets_the_sealed_bytes_over_tls() {
    let pki = pki("render");
    let mut render = Spy::start_tls(
        Behavior::Json(r#"{"token_ids":[1,2,3]}"#.into()),
        pki.server.server_config(),
    )
    .await;
    let mut engine = Spy::start(Behavior::Json(r#"{"id":"x","choices":[]}"#.into())).await;
    let mut cfg = ProxyConfig {
        upstream_ca: Some(pki.ca_file.clone()),
        ..config(&[engine.url()])
    };
    cfg.add_render_flag(&format!("{CANONICAL}={}", render.url()))
        .unwrap();
    let proxy = RunningProxy::start(cfg).await;
    let (sent, forwarded) = chat_pair(200);
    let (status, _, _) = post_chat(&proxy, sent).await;
    assert_eq!(status, StatusCode::OK);
    let rendered = render.next_request().await;
    assert!(
        rendered
            .head
            .starts_with("POST /v1/chat/completions/render HTTP/1.1\r\n"),
        "{}",
        rendered.head
    );
    assert!(
        rendered.body == forwarded.as_bytes(),
        "render got other bytes"
    );
    assert!(engine.next_request().await.body == forwarded.as_bytes());
}

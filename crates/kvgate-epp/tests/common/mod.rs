//! Shared by the ext_proc tests: an EPP on its own runtime (so it can be killed like a
//! process), in-process `kvgate sim` fleets, a real Envoy from a config template, and an HTTP
//! client.
#![allow(dead_code, unreachable_pub, clippy::unwrap_used, clippy::expect_used)]

use std::{
    collections::HashMap,
    future::Future,
    net::SocketAddr,
    path::PathBuf,
    process::Stdio,
    sync::Arc,
    time::{Duration, Instant},
};

use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper_util::{client::legacy::Client, rt::TokioExecutor};
use kvgate_proxy::{FileConfig, Proxy, ProxyConfig};
use kvgate_sim::{BUNDLED_TOKENIZER, Sim, SimArgs};
use prometheus_client::registry::Registry;
use tokio::sync::oneshot;

pub mod conv;
pub mod spy;

pub const MODEL: &str = "Qwen/Qwen3-0.6B";

/// An EPP serving on its own tokio runtime and thread. [`Epp::kill`] drops the runtime, so
/// every socket closes at once, as when the process dies.
pub struct Epp {
    pub addr: SocketAddr,
    /// The admin port (`/metrics`, `/debug/state.json`, `/ready`).
    pub admin: SocketAddr,
    pub proxy: Arc<Proxy>,
    stop: Option<oneshot::Sender<()>>,
    runtime: Option<tokio::runtime::Runtime>,
    done: Option<oneshot::Receiver<()>>,
}

impl Epp {
    /// Starts on `addr` (port 0 for a free one) with `config`.
    pub fn start(config: ProxyConfig, addr: SocketAddr) -> Epp {
        Self::start_with(config, addr, kvgate_epp::EppOptions::default())
    }

    pub fn start_with(
        config: ProxyConfig,
        addr: SocketAddr,
        options: kvgate_epp::EppOptions,
    ) -> Epp {
        let (stop, stopped) = oneshot::channel::<()>();
        let (done_tx, done) = oneshot::channel::<()>();
        // Built on a thread of its own: a runtime cannot be started from within the test's.
        let (runtime, proxy, addr, admin) = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()
                .unwrap();
            let (proxy, listener, side, admin) = runtime.block_on(async {
                let mut registry = Registry::default();
                let proxy = Proxy::new(config, &mut registry).unwrap();
                let admin = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
                let admin_addr = admin.local_addr().unwrap();
                let side = proxy
                    .spawn_side_tasks(admin, Arc::new(registry))
                    .await
                    .unwrap();
                (proxy, bind_retry(addr).await, side, admin_addr)
            });
            let addr = listener.local_addr().unwrap();
            let p = proxy.clone();
            runtime.spawn(async move {
                let _ = kvgate_epp::serve(listener, p, options, async move {
                    let _ = stopped.await;
                })
                .await;
                side.stop();
                let _ = done_tx.send(());
            });
            (runtime, proxy, addr, admin)
        })
        .join()
        .unwrap();
        Epp {
            addr,
            admin,
            proxy,
            stop: Some(stop),
            runtime: Some(runtime),
            done: Some(done),
        }
    }

    /// Kills it: every task and socket gone, no drain.
    pub fn kill(mut self) {
        self.proxy.shutdown();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }

    /// Sends the shutdown signal (drain starts).
    pub fn signal_shutdown(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }

    /// Whether `serve` returned, waiting up to `within`.
    pub async fn finished_within(&mut self, within: Duration) -> bool {
        let Some(done) = self.done.as_mut() else {
            return true;
        };
        tokio::time::timeout(within, done).await.is_ok()
    }
}

impl Drop for Epp {
    fn drop(&mut self) {
        self.proxy.shutdown();
        if let Some(rt) = self.runtime.take() {
            rt.shutdown_background();
        }
    }
}

/// Binds `addr`, retrying for a while (a port just released may still be in use).
async fn bind_retry(addr: SocketAddr) -> tokio::net::TcpListener {
    let deadline = Instant::now() + Duration::from_secs(10);
    loop {
        match tokio::net::TcpListener::bind(addr).await {
            Ok(l) => return l,
            Err(e) if Instant::now() > deadline => panic!("binding {addr}: {e}"),
            Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
        }
    }
}

pub fn any_port() -> SocketAddr {
    "127.0.0.1:0".parse().unwrap()
}

/// A loopback socket bound to a port of its own but not listening: a connect to it is
/// refused until [`tokio::net::TcpSocket::listen`] is called on it. Unlike a port bound and
/// released, no other listener in the test run can be given the port meanwhile.
pub fn reserved_socket() -> (tokio::net::TcpSocket, u16) {
    let socket = tokio::net::TcpSocket::new_v4().unwrap();
    socket.bind(any_port()).unwrap();
    let port = socket.local_addr().unwrap().port();
    (socket, port)
}

/// The proxy config from `yaml`, as `kvgate epp` builds it (no model refresh unless asked).
pub fn config(yaml: &str, models_refresh: Option<Duration>) -> ProxyConfig {
    let file = FileConfig::from_yaml(yaml).unwrap_or_else(|e| panic!("{e}\n{yaml}"));
    let mut config = ProxyConfig {
        models_refresh,
        ..ProxyConfig::default()
    };
    config.merge_file(&file).unwrap();
    // The spy engines record every request and model no `/health`; the readiness probe has
    // tests of its own.
    config.engines.probe_interval_ms = 0;
    config.validate().unwrap();
    config
}

/// A loopback fleet: 16-token blocks (these tests' KV capacities are sized for them, not for
/// the simulator's default of 32), fast prefill, 0.2 ms per token, then `extra`.
pub async fn fleet(extra: &[&str]) -> Sim {
    let base = [
        "--block-size",
        "16",
        "--prefill-base-ms",
        "1",
        "--itl-ms",
        "0.2",
    ];
    let args = SimArgs::loopback(base.iter().chain(extra)).unwrap();
    kvgate_sim::start(&args, &HashMap::<String, String>::new())
        .await
        .unwrap()
}

/// `endpoints:` YAML for a fleet, each with its KV events and replay socket, and the model
/// with the bundled tokenizer.
pub fn fleet_yaml(sim: &Sim) -> String {
    let mut yaml = String::from("endpoints:\n");
    for inst in sim.instances() {
        yaml += &format!("  - url: http://{}\n    model: {MODEL}\n", inst.http);
        if let Some(ev) = inst.events.first() {
            yaml += &format!("    kv_events: {}\n", ev.events);
            if let Some(replay) = &ev.replay {
                yaml += &format!("    kv_replay: {replay}\n");
            }
        }
    }
    yaml + &format!("models:\n  - name: {MODEL}\n    tokenizer: {{ local: {BUNDLED_TOKENIZER} }}\n")
}

/// The Envoy binary: `$KVGATE_ENVOY`, else `envoy` on `PATH`.
pub fn envoy_binary() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("KVGATE_ENVOY").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return p.is_file().then_some(p);
    }
    std::env::var_os("PATH").and_then(|paths| {
        std::env::split_paths(&paths)
            .map(|d| d.join("envoy"))
            .find(|p| p.is_file())
    })
}

/// `Some(binary)`, or prints why the test is skipped.
pub fn envoy_or_skip(test: &str) -> Option<PathBuf> {
    let found = envoy_binary();
    if found.is_none() {
        println!(
            "skipped: envoy not found ({test}: set KVGATE_ENVOY or put envoy on PATH; \
             `bash scripts/ci_envoy.sh` installs it)"
        );
    }
    found
}

/// How Envoy is set up in front of the EPP.
#[derive(Debug, Clone)]
pub struct EnvoySetup {
    /// `FULL_DUPLEX_STREAMED` or `BUFFERED`.
    pub request_body_mode: &'static str,
    /// `FULL_DUPLEX_STREAMED`, `STREAMED`, `BUFFERED` or `NONE`.
    pub response_body_mode: &'static str,
    /// `failure_mode_allow`.
    pub fail_open: bool,
    /// Where requests go without a pick (fail-open), if anywhere.
    pub default_cluster: Option<SocketAddr>,
}

impl Default for EnvoySetup {
    fn default() -> Self {
        EnvoySetup {
            request_body_mode: "FULL_DUPLEX_STREAMED",
            response_body_mode: "FULL_DUPLEX_STREAMED",
            fail_open: false,
            default_cluster: None,
        }
    }
}

/// A running Envoy, killed on drop.
pub struct Envoy {
    pub port: u16,
    child: tokio::process::Child,
    _dir: TempDir,
}

impl Envoy {
    pub fn url(&self, path: &str) -> String {
        format!("http://127.0.0.1:{}{path}", self.port)
    }

    /// Starts Envoy with the template filled in and waits until its listener answers.
    pub async fn start(binary: &PathBuf, epp: SocketAddr, setup: &EnvoySetup) -> Envoy {
        // Envoy binds both ports itself (0: a port of its own) and says which: the admin
        // address in a file, the listener's on the admin API. A port picked here and released
        // could be taken by another test before Envoy binds it.
        let yaml = envoy_yaml(0, 0, epp, setup);
        let dir = TempDir::new();
        let path = dir.0.join("envoy.yaml");
        let admin_path = dir.0.join("admin-address");
        std::fs::write(&path, &yaml).unwrap();
        let log_path = std::env::var_os("KVGATE_ENVOY_LOG")
            .map_or_else(|| dir.0.join("envoy.log"), PathBuf::from);
        let log = std::fs::File::create(&log_path).unwrap();
        let mut child = tokio::process::Command::new(binary)
            .arg("-c")
            .arg(&path)
            .arg("--admin-address-path")
            .arg(&admin_path)
            .args([
                "--disable-hot-restart",
                "--log-level",
                &std::env::var("KVGATE_ENVOY_LOG_LEVEL").unwrap_or_else(|_| "warn".into()),
            ])
            .stdout(Stdio::null())
            .stderr(log)
            .kill_on_drop(true)
            .spawn()
            .unwrap();
        let deadline = Instant::now() + Duration::from_secs(30);
        let port = loop {
            if let Ok(Some(status)) = child.try_wait() {
                let log = std::fs::read_to_string(&log_path).unwrap_or_default();
                panic!("envoy exited ({status}):\n{log}\n{yaml}");
            }
            let admin = std::fs::read_to_string(&admin_path).unwrap_or_default();
            let admin = admin.trim();
            if !admin.is_empty()
                && get(&format!("http://{admin}/ready"))
                    .await
                    .is_some_and(|(s, _)| s == 200)
            {
                break listener_port(admin).await;
            }
            assert!(Instant::now() < deadline, "envoy not ready within 30 s");
            tokio::time::sleep(Duration::from_millis(50)).await;
        };
        Envoy {
            port,
            child,
            _dir: dir,
        }
    }
}

/// The port Envoy's one listener bound, from its admin API (`/listeners?format=json`).
async fn listener_port(admin: &str) -> u16 {
    let url = format!("http://{admin}/listeners?format=json");
    let (status, body) = get(&url).await.expect("envoy's admin API answers");
    assert_eq!(status, 200, "{url}");
    let listeners: serde_json::Value = serde_json::from_slice(&body).unwrap();
    let port = &listeners["listener_statuses"][0]["local_address"]["socket_address"]["port_value"];
    port.as_u64()
        .and_then(|p| u16::try_from(p).ok())
        .filter(|&p| p != 0)
        .unwrap_or_else(|| panic!("no listener port in {listeners}"))
}

/// The Envoy config: listener → (header_to_metadata: `x-test-subset` → subset hint) →
/// ext_proc → router; a route to the `ORIGINAL_DST` cluster keyed by
/// `x-gateway-destination-endpoint` when the header is set, else to the default cluster.
pub fn envoy_yaml(port: u16, admin: u16, epp: SocketAddr, setup: &EnvoySetup) -> String {
    let default_route = match setup.default_cluster {
        Some(_) => {
            "              - match: { prefix: \"/\" }\n                route: { cluster: default_pool, timeout: 60s }\n"
        }
        None => "",
    };
    let default_cluster = match setup.default_cluster {
        Some(addr) => format!(
            "  - name: default_pool\n    type: STATIC\n    connect_timeout: 1s\n    load_assignment:\n      cluster_name: default_pool\n      endpoints: [{{ lb_endpoints: [{{ endpoint: {{ address: {{ socket_address: {{ address: 127.0.0.1, port_value: {} }} }} }} }}] }}]\n",
            addr.port()
        ),
        None => String::new(),
    };
    TEMPLATE
        .replace("{PORT}", &port.to_string())
        .replace("{ADMIN}", &admin.to_string())
        .replace("{EPP}", &epp.port().to_string())
        .replace("{FAIL_OPEN}", &setup.fail_open.to_string())
        .replace("{REQUEST_BODY_MODE}", setup.request_body_mode)
        .replace("{RESPONSE_BODY_MODE}", setup.response_body_mode)
        .replace("{DEFAULT_ROUTE}\n", default_route)
        .replace("{DEFAULT_CLUSTER}\n", &default_cluster)
}

const TEMPLATE: &str = r#"admin:
  address: { socket_address: { address: 127.0.0.1, port_value: {ADMIN} } }
static_resources:
  listeners:
  - name: gateway
    address: { socket_address: { address: 127.0.0.1, port_value: {PORT} } }
    filter_chains:
    - filters:
      - name: envoy.filters.network.http_connection_manager
        typed_config:
          "@type": type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3.HttpConnectionManager
          stat_prefix: gateway
          route_config:
            name: gateway
            virtual_hosts:
            - name: all
              domains: ["*"]
              response_headers_to_add:
              - header: { key: x-upstream-host, value: "%UPSTREAM_HOST%" }
              routes:
              - match:
                  prefix: "/"
                  headers: [{ name: x-gateway-destination-endpoint, present_match: true }]
                route: { cluster: picked, timeout: 60s }
{DEFAULT_ROUTE}
          http_filters:
          - name: envoy.filters.http.header_to_metadata
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.header_to_metadata.v3.Config
              request_rules:
              - header: x-test-subset
                on_header_present: { metadata_namespace: envoy.lb.subset_hint, key: x-gateway-destination-endpoint-subset, type: STRING }
                remove: true
          - name: envoy.filters.http.ext_proc
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor
              grpc_service:
                envoy_grpc: { cluster_name: kvgate_epp }
                timeout: 10s
              failure_mode_allow: {FAIL_OPEN}
              message_timeout: 30s
              processing_mode:
                request_header_mode: SEND
                response_header_mode: SEND
                request_body_mode: {REQUEST_BODY_MODE}
                response_body_mode: {RESPONSE_BODY_MODE}
                request_trailer_mode: SEND
                response_trailer_mode: SEND
              metadata_options:
                forwarding_namespaces: { untyped: ["envoy.lb.subset_hint"] }
                receiving_namespaces: { untyped: ["envoy.lb"] }
          - name: envoy.filters.http.router
            typed_config:
              "@type": type.googleapis.com/envoy.extensions.filters.http.router.v3.Router
  clusters:
  - name: picked
    type: ORIGINAL_DST
    lb_policy: CLUSTER_PROVIDED
    connect_timeout: 2s
    original_dst_lb_config:
      use_http_header: true
      http_header_name: x-gateway-destination-endpoint
  - name: kvgate_epp
    type: STATIC
    connect_timeout: 1s
    typed_extension_protocol_options:
      envoy.extensions.upstreams.http.v3.HttpProtocolOptions:
        "@type": type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions
        explicit_http_config: { http2_protocol_options: {} }
    load_assignment:
      cluster_name: kvgate_epp
      endpoints: [{ lb_endpoints: [{ endpoint: { address: { socket_address: { address: 127.0.0.1, port_value: {EPP} } } } }] }]
{DEFAULT_CLUSTER}
"#;

/// A temporary directory removed on drop.
pub struct TempDir(pub PathBuf);

impl TempDir {
    pub fn new() -> TempDir {
        static N: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let dir = std::env::temp_dir().join(format!("kvgate-epp-{}-{n}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        TempDir(dir)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Polls `check` until it holds; panics with `what` after `within`.
pub async fn wait_for<F, Fut>(what: &str, within: Duration, mut check: F)
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let deadline = Instant::now() + within;
    loop {
        if check().await {
            return;
        }
        assert!(Instant::now() < deadline, "timed out waiting for {what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// An HTTP response as the client saw it.
#[derive(Debug)]
pub struct Answer {
    pub status: u16,
    pub headers: http::HeaderMap,
    pub body: Bytes,
}

impl Answer {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers.get(name).and_then(|v| v.to_str().ok())
    }

    pub fn json(&self) -> serde_json::Value {
        serde_json::from_slice(&self.body).unwrap_or_else(|e| {
            panic!(
                "{e}: {} {}",
                self.status,
                String::from_utf8_lossy(&self.body)
            )
        })
    }
}

fn client() -> Client<hyper_util::client::legacy::connect::HttpConnector, Full<Bytes>> {
    Client::builder(TokioExecutor::new()).build_http()
}

/// `POST url` with `body` (exact bytes) and extra headers.
pub async fn post(url: &str, body: &[u8], headers: &[(&str, &str)]) -> Answer {
    let mut req = http::Request::post(url).header("content-type", "application/json");
    for (k, v) in headers {
        req = req.header(*k, *v);
    }
    let req = req.body(Full::new(Bytes::copy_from_slice(body))).unwrap();
    let resp = tokio::time::timeout(Duration::from_secs(30), client().request(req))
        .await
        .expect("no response within 30 s")
        .unwrap();
    let (parts, body) = resp.into_parts();
    let body = body.collect().await.unwrap().to_bytes();
    Answer {
        status: parts.status.as_u16(),
        headers: parts.headers,
        body,
    }
}

/// `GET url`: status and body, `None` when nothing answers.
pub async fn get(url: &str) -> Option<(u16, Bytes)> {
    let resp = client().get(url.parse().ok()?).await.ok()?;
    let status = resp.status().as_u16();
    let body = resp.into_body().collect().await.ok()?.to_bytes();
    Some((status, body))
}

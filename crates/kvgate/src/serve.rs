//! `kvgate serve`: flags and config file → [`kvgate_proxy::Proxy`] → accept loops.

use std::{net::SocketAddr, path::PathBuf, sync::Arc, time::Duration};

use anyhow::Context;
use kvgate_proxy::{FileConfig, Proxy, ProxyConfig, config};
use prometheus_client::registry::Registry;

/// Flags of `kvgate serve`. Routing settings live in the config file; flags cover the process
/// and the common single-box setup.
#[derive(Debug, clap::Args)]
pub(crate) struct ServeArgs {
    /// YAML config file (`listen`, `admin_listen`, `endpoints`, `models`, scheduler plugins);
    /// endpoints and plugins reload when its content changes.
    #[arg(long)]
    pub(crate) config: Option<PathBuf>,
    /// Proxy listen address [default: the config's `listen`, else 0.0.0.0:8080].
    #[arg(long)]
    pub(crate) listen: Option<SocketAddr>,
    /// Admin listen address for /health, /ready, /metrics, /debug/state [default: the
    /// config's `admin_listen`, else 127.0.0.1:9090].
    #[arg(long)]
    admin_listen: Option<SocketAddr>,
    /// Bearer token every admin route but /health and /ready requires (401 without it)
    /// [default: the config's `admin_token`, else none].
    #[arg(long, env = "KVGATE_ADMIN_TOKEN", hide_env_values = true)]
    admin_token: Option<String>,
    /// Engine endpoint (repeatable; added to the config's): `URL[,kv=tcp://HOST:PORT]
    /// [,replay=tcp://HOST:PORT][,model=NAME][,block_size=N][,label=KEY=VALUE]`. `kv=`
    /// subscribes to the engine's KV-cache events for precise prefix routing; the KV-event
    /// sockets, model and block size default to what the engine reports
    /// (`/kv_event_sources`, `/v1/models`, `/metrics`).
    #[arg(long = "endpoint", value_name = "URL[,kv=…]")]
    endpoints: Vec<String>,
    /// Local tokenizer for a model, MODEL=DIR (repeatable): a directory with
    /// tokenizer.json and tokenizer_config.json (optionally .gz).
    #[arg(long = "tokenizer", value_name = "MODEL=DIR")]
    tokenizers: Vec<String>,
    /// Render server for a model, MODEL=URL (repeatable): a vLLM `/render` endpoint that
    /// tokenizes the exact forwarded bytes (after the local tokenizer, if one is named).
    /// Without it, a model served by endpoints with KV events uses the engine's own render
    /// endpoint.
    #[arg(long = "render", value_name = "MODEL=URL")]
    renders: Vec<String>,
    /// Add `x-kvgate-scores` (every candidate's per-scorer scores) to responses.
    #[arg(long)]
    scores_header: bool,
    /// Show engine addresses and upstream errors to clients (`x-kvgate-endpoint`, detailed
    /// 5xx bodies); off by default, they are logged instead (YAML `expose_internals`).
    #[arg(long)]
    expose_internals: bool,
    /// Built-in scheduling profile when the config file defines none: `cost` (predicted
    /// prefill tokens: queued + uncached, the default) or `weighted` (llm-d-style weighted
    /// prefix ×3, queue ×2, KV utilization ×2).
    #[arg(long, default_value = "cost", value_parser = ["cost", "weighted"])]
    profile: String,
    /// Write one JSON line per routed request (every candidate's scores, predicted and
    /// realized cached tokens, load, the pick) to FILE. Off by default.
    #[arg(long, value_name = "FILE")]
    decision_log: Option<std::path::PathBuf>,
    /// Model alias, ALIAS=MODEL (repeatable): requests for ALIAS reach engines as MODEL.
    #[arg(long = "alias", value_name = "ALIAS=MODEL")]
    aliases: Vec<String>,
    /// Retries on another endpoint after a connect failure or reset before any response byte.
    #[arg(long, default_value_t = 2)]
    retries: u32,
    /// Wait this long for an engine's response headers before answering 504 (e.g. 30s, 10m).
    #[arg(long, default_value = "10m", value_parser = humantime::parse_duration)]
    upstream_timeout: Duration,
    /// Largest accepted request body in bytes; larger gets 413.
    #[arg(long, default_value_t = 32 << 20)]
    max_body_bytes: usize,
    /// Request bodies all requests in flight may hold in memory together, in bytes; a body
    /// that does not fit gets 503 with Retry-After [default: the config's
    /// `limits.max_inflight_body_bytes`, else 1073741824 (1 GiB)].
    #[arg(long, value_name = "BYTES")]
    max_inflight_body_bytes: Option<u64>,
    /// Threads that serve client connections, each with its own runtime and upstream
    /// connections; 0 serves them on the shared runtime [default: the config's
    /// `serving_threads`, else one per core].
    #[arg(long, value_name = "N")]
    serving_threads: Option<usize>,
    /// Serve the proxy port over TLS (HTTP/1.1 and h2 by ALPN) with this PEM certificate
    /// chain; needs --tls-key [default: the config's `tls.cert_file`, else plain HTTP].
    #[arg(long, value_name = "FILE", requires = "tls_key")]
    tls_cert: Option<PathBuf>,
    /// The PEM private key of --tls-cert [default: the config's `tls.key_file`].
    #[arg(long, value_name = "FILE", requires = "tls_cert")]
    tls_key: Option<PathBuf>,
    /// PEM file of CA certificates trusted for https:// endpoints besides the system's roots
    /// [default: the config's `upstream.ca_file`, else the system's roots only].
    #[arg(long, value_name = "FILE")]
    upstream_ca: Option<PathBuf>,
    /// How often to refresh each endpoint's /v1/models (0s disables background refresh).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    models_refresh: Duration,
    /// TCP connect timeout per upstream attempt, e.g. 2s [default: the config's
    /// `upstream.connect_timeout_ms`, else 5s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    upstream_connect_timeout: Option<Duration>,
    /// How long an idle pooled connection to an engine is kept [default: the config's
    /// `upstream.pool_idle_timeout_ms`, else 1m 30s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    upstream_pool_idle_timeout: Option<Duration>,
    /// KV index holdings kept per endpoint whose capacity is not known, in blocks [default:
    /// the config's `kv_index.default_capacity_blocks`, else 1048576].
    #[arg(long, value_name = "BLOCKS")]
    kv_index_capacity_blocks: Option<usize>,
    /// How long the KV index keeps the blocks a routing decision predicts, until the engine's
    /// own events arrive [default: the config's `kv_index.speculative_ttl_ms`, else 2s].
    #[arg(long, value_name = "DURATION", value_parser = humantime::parse_duration)]
    kv_speculative_ttl: Option<Duration>,
    /// Share in-flight load with other kvgate replicas: the ZeroMQ address this replica
    /// publishes on, e.g. tcp://0.0.0.0:5600 [default: the config's `replica_sync.listen`,
    /// else off].
    #[arg(long, value_name = "ZMQ_ADDR")]
    replica_sync_listen: Option<String>,
    /// Another replica's `--replica-sync-listen` address (repeatable; this replica's own
    /// address may be listed too, so every replica can get the same list).
    #[arg(long = "replica-peer", value_name = "ZMQ_ADDR")]
    replica_peers: Vec<String>,
    /// Export one OpenTelemetry span per forwarded request to this OTLP/HTTP collector
    /// (e.g. http://otel-collector:4318) and send engines a `traceparent` naming it
    /// [default: the config's `tracing.otlp_endpoint`, else off]. `kvgate serve` only.
    #[arg(long, value_name = "URL")]
    otlp_endpoint: Option<String>,
}

pub(crate) fn main(args: ServeArgs) -> anyhow::Result<()> {
    let (file, text) = read_config_file(&args)?;
    let config = proxy_config(&args, &file)?;
    let (listen, admin_listen) = listen_addrs(&args, &file);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let args = Arc::new(args);
    runtime.block_on(async move {
        let started = start(config, &args, text, listen, admin_listen, "kvgate serving").await?;
        let Started {
            proxy,
            registry,
            listener,
            admin,
            _discovery,
        } = started;
        kvgate_proxy::run(
            listener,
            admin,
            proxy,
            Arc::new(registry),
            shutdown_signal(),
        )
        .await?;
        Ok(())
    })
}

/// What both front doors run on once started: the proxy, its metrics registry, the bound
/// listeners, and the endpoint discovery (kept alive while serving).
pub(crate) struct Started {
    pub(crate) proxy: Arc<Proxy>,
    pub(crate) registry: Registry,
    pub(crate) listener: tokio::net::TcpListener,
    pub(crate) admin: tokio::net::TcpListener,
    pub(crate) _discovery: Option<kvgate_discovery::Discovery>,
}

/// The start-up both front doors share: the proxy, one pass of what the engines say about
/// themselves (models, block size, each model's tokenizer chain) before the first request,
/// endpoint discovery, both listeners bound, the `serving` log line (`what`), and the config
/// file watcher when `--config` was given.
pub(crate) async fn start(
    config: ProxyConfig,
    args: &Arc<ServeArgs>,
    text: Option<String>,
    listen: SocketAddr,
    admin_listen: SocketAddr,
    what: &str,
) -> anyhow::Result<Started> {
    let mut registry = Registry::default();
    let sources = discover::EndpointSources::new(&config);
    let proxy = Proxy::new(config.clone(), &mut registry)?;
    proxy.refresh_models().await;
    let _discovery = discover::start(&config, &sources, &proxy, &mut registry).await?;
    let listener = tokio::net::TcpListener::bind(listen)
        .await
        .with_context(|| format!("binding {listen}"))?;
    let admin = tokio::net::TcpListener::bind(admin_listen)
        .await
        .with_context(|| format!("binding admin {admin_listen}"))?;
    tracing::info!(
        listen = %listener.local_addr()?,
        admin = %admin.local_addr()?,
        endpoints = proxy.endpoints().len(),
        "{what}"
    );
    if let (Some(path), Some(text)) = (args.config.clone(), text) {
        tokio::spawn(watch_config(
            path,
            SeenConfig(text),
            args.clone(),
            proxy.clone(),
            sources,
        ));
    }
    Ok(Started {
        proxy,
        registry,
        listener,
        admin,
        _discovery,
    })
}

/// The `--config` file, parsed, and its text (for [`watch_config`]); the defaults without
/// one.
pub(crate) fn read_config_file(args: &ServeArgs) -> anyhow::Result<(FileConfig, Option<String>)> {
    Ok(match &args.config {
        Some(path) => {
            let text = std::fs::read_to_string(path)
                .with_context(|| format!("reading {}", path.display()))?;
            let file =
                FileConfig::from_yaml(&text).with_context(|| format!("in {}", path.display()))?;
            (file, Some(text))
        }
        None => (FileConfig::default(), None),
    })
}

/// The proxy and admin listen addresses: the flag, else the config file, else the default
/// ([`config::DEFAULT_LISTEN`], [`config::DEFAULT_ADMIN_LISTEN`]).
pub(crate) fn listen_addrs(args: &ServeArgs, file: &FileConfig) -> (SocketAddr, SocketAddr) {
    let listen = args
        .listen
        .or(file.listen)
        .unwrap_or(config::DEFAULT_LISTEN);
    let admin = args
        .admin_listen
        .or(file.admin_listen)
        .unwrap_or(config::DEFAULT_ADMIN_LISTEN);
    (listen, admin)
}

/// Builds the proxy config: the file first, then flags on top (the one place a flag
/// overrides a config key), validated.
pub(crate) fn proxy_config(args: &ServeArgs, file: &FileConfig) -> anyhow::Result<ProxyConfig> {
    let mut config = ProxyConfig::default();
    config.merge_file(file)?;
    for flag in &args.endpoints {
        config.add_endpoint_flag(flag)?;
    }
    for alias in &args.aliases {
        config.add_alias_flag(alias)?;
    }
    for flag in &args.tokenizers {
        let (model, dir) = flag
            .split_once('=')
            .ok_or_else(|| anyhow::anyhow!("--tokenizer `{flag}` must be MODEL=DIR"))?;
        let spec = kvgate_proxy::TokenizerSpec {
            local: Some(dir.into()),
            render: None,
            backends: None,
            render_timeout_ms: None,
            render_media_timeout_ms: None,
        };
        config.set_tokenizer(model, &spec);
    }
    for flag in &args.renders {
        config.add_render_flag(flag)?;
    }
    config.default_endpoint_models();
    config.scores_header = args.scores_header;
    config.expose_internals |= args.expose_internals;
    if let Some(token) = args.admin_token.as_ref().filter(|t| !t.is_empty()) {
        config.admin_token = Some(token.clone());
    }
    if let Some(url) = &args.otlp_endpoint {
        config.otlp_endpoint = Some(url.clone());
    }
    config.decision_log.clone_from(&args.decision_log);
    // Used while the file defines no scheduler (one that sets only `seed` keeps it); the
    // proxy makes its prefix scorer precise once an endpoint has KV events, configured or
    // found through the engine's /kv_event_sources.
    config.profile.clone_from(&args.profile);
    config.retries = args.retries;
    config.upstream_timeout = args.upstream_timeout;
    config.max_body_bytes = args.max_body_bytes;
    if let Some(bytes) = args.max_inflight_body_bytes {
        config.max_inflight_body_bytes = bytes;
    }
    if let Some(threads) = args.serving_threads {
        config.serving_threads = threads;
    }
    if let (Some(cert_file), Some(key_file)) = (&args.tls_cert, &args.tls_key) {
        config.tls = Some(kvgate_proxy::config::ListenerTls {
            cert_file: cert_file.clone(),
            key_file: key_file.clone(),
        });
    }
    if let Some(ca) = &args.upstream_ca {
        config.upstream_ca = Some(ca.clone());
    }
    config.models_refresh = Some(args.models_refresh).filter(|d| !d.is_zero());
    if let Some(timeout) = args.upstream_connect_timeout {
        config.connect_timeout = timeout;
    }
    if let Some(timeout) = args.upstream_pool_idle_timeout {
        config.pool_idle_timeout = timeout;
    }
    if let Some(blocks) = args.kv_index_capacity_blocks {
        config.kv_index.default_capacity_blocks = blocks;
    }
    if let Some(ttl) = args.kv_speculative_ttl {
        config.kv_index.speculative_ttl = ttl;
    }
    if let Some(listen) = &args.replica_sync_listen {
        match &mut config.replica_sync {
            Some(sync) => sync.listen.clone_from(listen),
            None => {
                config.replica_sync = Some(kvgate_replica::ReplicaSyncConfig::new(
                    listen.clone(),
                    Vec::new(),
                ));
            }
        }
    }
    if !args.replica_peers.is_empty() {
        match &mut config.replica_sync {
            Some(sync) => sync.peers.clone_from(&args.replica_peers),
            None => anyhow::bail!(
                "--replica-peer needs --replica-sync-listen (or replica_sync.listen in the config)"
            ),
        }
    }
    config.validate()?;
    Ok(config)
}

/// The config file's content as last read.
#[derive(Debug)]
pub(crate) struct SeenConfig(pub(crate) String);

impl SeenConfig {
    /// `Some(text)` when `text` differs from the content last seen (and remembers it).
    fn changed(&mut self, text: String) -> Option<&str> {
        if text == self.0 {
            return None;
        }
        self.0 = text;
        Some(&self.0)
    }
}

/// Reloads endpoints and scheduler plugins when the config file's content changes: the file
/// is read every second and compared with the content last read, so an edit counts whatever
/// its modification time (a Kubernetes ConfigMap swap, an editor or copy that keeps the old
/// time, two writes within the clock's resolution), and a `touch` or a rewrite with the same
/// bytes does nothing. `seen` is the content the running config came from. A bad file is
/// logged and ignored; in-flight requests finish on the endpoints and scheduler they started
/// with.
pub(crate) async fn watch_config(
    path: PathBuf,
    mut seen: SeenConfig,
    args: Arc<ServeArgs>,
    proxy: Arc<Proxy>,
    sources: Arc<discover::EndpointSources>,
) {
    let mut tick = tokio::time::interval(Duration::from_secs(1));
    loop {
        tick.tick().await;
        let Ok(text) = tokio::fs::read_to_string(&path).await else {
            continue;
        };
        let Some(text) = seen.changed(text) else {
            continue;
        };
        let result = FileConfig::from_yaml(text)
            .map_err(anyhow::Error::from)
            .and_then(|file| proxy_config(&args, &file))
            .and_then(|config| Ok(sources.reload_file(&proxy, &config)?));
        match result {
            Ok(()) => tracing::info!(path = %path.display(), "config file reloaded"),
            Err(e) => {
                tracing::error!(path = %path.display(), error = %format!("{e:#}"), "config reload rejected; keeping the running config")
            }
        }
    }
}

/// Resolves on Ctrl-C or SIGTERM.
pub(crate) async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        () = ctrl_c => {},
        () = term => {},
    }
}

pub(crate) mod discover;
#[cfg(test)]
mod tests;

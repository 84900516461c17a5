//! Starting one or more simulated servers in this process (`--instances N`), each with
//! `--data-parallel-size` engine cores, and shutting them down.

use std::future::Future;
use std::net::SocketAddr;
use std::sync::Arc;
use std::sync::atomic::AtomicU64;
use std::time::Duration;

use axum::serve::ListenerExt;
use kvgate_kvcache::Encoding;
use tokio::net::TcpListener;
use tokio::sync::watch;
use tokio::task::JoinHandle;

use crate::args::{EventEncoding, SimArgs};
use crate::batch::BatchLimits;
use crate::engine::{EngineConfig, EngineHandle, LatencyModel};
use crate::hashing::{BlockHasher, EnvSource};
use crate::instance::Instance;
use crate::kv_manager::LoraAdapter;
use crate::metrics::MetricsInfo;
use crate::prompt::{LocalPrompts, PromptSource};
use crate::publisher::{EventAddrs, PublisherConfig, PublisherHandle, start_publisher};
use crate::vocab::OutputVocab;
use crate::{SimError, api};

/// The bound addresses of one simulated server.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct InstanceAddrs {
    /// HTTP address (OpenAI API, /metrics, …).
    pub http: SocketAddr,
    /// KV-event endpoints per DP rank (empty with `--no-kv-events`).
    pub events: Vec<EventAddrs>,
}

/// A running fleet; dropping it without [`Sim::shutdown`] leaves the tasks running until
/// the runtime ends.
#[derive(Debug)]
pub struct Sim {
    instances: Vec<InstanceAddrs>,
    shutdown: watch::Sender<bool>,
    servers: Vec<JoinHandle<()>>,
}

impl Sim {
    /// Addresses of every instance, in port order.
    pub fn instances(&self) -> &[InstanceAddrs] {
        &self.instances
    }

    /// Stops accepting connections, lets in-flight responses finish, and waits for the
    /// servers to exit.
    pub async fn shutdown(self) {
        let _ = self.shutdown.send(true);
        for s in self.servers {
            let _ = s.await;
        }
    }
}

/// Starts the fleet described by `args`, tokenizing with `--tokenizer` (or the bundled
/// Qwen3 tokenizer). `env` supplies `PYTHONHASHSEED`.
///
/// # Errors
/// [`SimError`] for invalid flags, an unloadable tokenizer, or a socket that cannot be bound.
pub async fn start(args: &SimArgs, env: &dyn EnvSource) -> Result<Sim, SimError> {
    args.validate()?;
    let dir = args.tokenizer_dir();
    let prompts = tokio::task::spawn_blocking(move || LocalPrompts::load(&dir))
        .await
        .map_err(|e| SimError::Tokenizer(String::new(), e.to_string()))??;
    start_with_prompts(args, env, Arc::new(prompts)).await
}

/// Like [`start`] with a caller-supplied [`PromptSource`].
///
/// # Errors
/// As [`start`].
pub async fn start_with_prompts(
    args: &SimArgs,
    env: &dyn EnvSource,
    prompts: Arc<dyn PromptSource>,
) -> Result<Sim, SimError> {
    args.validate()?;
    let vocab = Arc::new(OutputVocab::from_tokenizer(prompts.tokenizer()));
    let hasher = BlockHasher::from_env(args.prefix_caching_hash_algo, env);
    let loras: Vec<Arc<LoraAdapter>> = args
        .lora_pairs()?
        .into_iter()
        .enumerate()
        .map(|(i, (name, path))| {
            Arc::new(LoraAdapter {
                name,
                path,
                id: i as i64 + 1,
            })
        })
        .collect();
    let served = args.served_names();
    let engine_cfg = EngineConfig {
        limits: BatchLimits {
            max_num_seqs: args.max_num_seqs,
            max_num_batched_tokens: args.max_num_batched_tokens,
            max_loras: args.max_loras.max(1),
        },
        num_gpu_blocks: args.num_gpu_blocks,
        block_size: args.block_size,
        latency: LatencyModel {
            prefill_base: Duration::from_secs_f64(args.prefill_base_ms / 1000.0),
            prefill_tokens_per_s: args.prefill_tokens_per_s,
            itl: Duration::from_secs_f64(args.itl_ms / 1000.0),
            batch_slowdown: args.batch_slowdown,
        },
        hasher,
        restart_every: args.restart_every.map(Duration::from_secs_f64),
        hybrid_window: args.hybrid_sliding_window,
    };
    let (shutdown, shutdown_rx) = watch::channel(false);
    let mut instances = Vec::with_capacity(args.instances);
    let mut servers = Vec::with_capacity(args.instances);
    for i in 0..args.instances {
        let port = if args.port == 0 {
            0
        } else {
            args.port.saturating_add(i as u16)
        };
        let addr = format!("{}:{port}", args.host);
        let listener = TcpListener::bind(&addr)
            .await
            .map_err(|e| SimError::Bind(addr.clone(), e))?;
        let http = listener
            .local_addr()
            .map_err(|e| SimError::Bind(addr.clone(), e))?;
        let topic = args
            .kv_events_topic
            .replace("{host}", &http.ip().to_string())
            .replace("{port}", &http.port().to_string())
            .replace("{model}", &served[0]);
        let mut engines = Vec::with_capacity(args.data_parallel_size);
        let mut events = Vec::new();
        let mut dropped_batches = Vec::with_capacity(args.data_parallel_size);
        for rank in 0..args.data_parallel_size {
            let publisher = if args.no_kv_events {
                PublisherHandle::default()
            } else {
                let cfg = PublisherConfig {
                    endpoint: args.kv_events_endpoint.clone(),
                    replay_endpoint: args.kv_events_replay_endpoint.clone(),
                    topic: topic.clone(),
                    encoding: match args.kv_events_encoding {
                        EventEncoding::Map => Encoding::Map,
                        EventEncoding::Array => Encoding::Array,
                    },
                    rank: rank as u32,
                    buffer_steps: args.kv_events_buffer_steps,
                    drop_probability: args.drop_event_batches,
                    fault_seed: args.fault_seed.wrapping_add(i as u64),
                };
                let offset = (i * args.data_parallel_size + rank) as u16;
                let (handle, bound) = start_publisher(cfg, offset, shutdown_rx.clone()).await?;
                events.push(bound);
                handle
            };
            dropped_batches.push(publisher.dropped_counter());
            engines.push(EngineHandle::spawn(
                engine_cfg.clone(),
                vocab.clone(),
                publisher,
            ));
        }
        let kv_event_sources = crate::sources::kv_event_sources(
            &args.kv_events_endpoint,
            args.kv_events_replay_endpoint.as_deref(),
            &topic,
            args.kv_events_buffer_steps,
            &events,
        );
        let inst = Arc::new(Instance {
            kv_event_sources,
            model: args.model.clone(),
            served: served.clone(),
            loras: loras.clone(),
            engines,
            prompts: prompts.clone(),
            vocab: vocab.clone(),
            max_model_len: args.max_model_len,
            default_max_tokens: args.default_max_tokens.max(1),
            metrics_info: MetricsInfo {
                model_name: served[0].clone(),
                block_size: args.block_size,
                num_gpu_blocks: args.num_gpu_blocks,
                hash_algo: args.prefix_caching_hash_algo.as_str(),
                max_loras: (!loras.is_empty()).then_some(args.max_loras),
            },
            fail_after: args.fail_after,
            requests_seen: AtomicU64::new(0),
            dropped_batches,
            metrics_stall: Duration::from_millis(args.metrics_stall_ms),
            process_start: AtomicU64::new(crate::instance::start_time_now().to_bits()),
        });
        let app = api::router(inst);
        let mut rx = shutdown_rx.clone();
        servers.push(tokio::spawn(async move {
            let stop = async move {
                let _ = rx.wait_for(|s| *s).await;
            };
            // TCP_NODELAY on every connection, as vLLM's server has it (asyncio sets it on
            // every TCP transport): without it a stream's second write waits behind Nagle's
            // algorithm for the client's delayed ACK (~40 ms), one streamed response per 44 ms
            // per connection.
            let listener = listener.tap_io(|tcp| {
                if let Err(e) = tcp.set_nodelay(true) {
                    tracing::debug!(error = %e, "TCP_NODELAY not set");
                }
            });
            if let Err(e) = axum::serve(listener, app)
                .with_graceful_shutdown(stop)
                .await
            {
                tracing::error!(error = %e, "sim http server failed");
            }
        }));
        tracing::info!(instance = i, http = %http, events = ?events, "sim instance started");
        instances.push(InstanceAddrs { http, events });
    }
    Ok(Sim {
        instances,
        shutdown,
        servers,
    })
}

/// Runs the fleet until `shutdown` resolves (what `kvgate sim` calls).
///
/// # Errors
/// As [`start`].
///
/// # Examples
/// ```no_run
/// # async fn f() -> Result<(), kvgate_sim::SimError> {
/// let args = kvgate_sim::SimArgs::defaults();
/// kvgate_sim::run(args, async { let _ = tokio::signal::ctrl_c().await; }).await
/// # }
/// ```
pub async fn run(args: SimArgs, shutdown: impl Future<Output = ()>) -> Result<(), SimError> {
    let sim = start(&args, &crate::hashing::ProcessEnv).await?;
    for (i, inst) in sim.instances().iter().enumerate() {
        let events: Vec<&str> = inst.events.iter().map(|e| e.events.as_str()).collect();
        tracing::info!(instance = i, http = %inst.http, events = ?events, "kvgate sim listening");
    }
    shutdown.await;
    sim.shutdown().await;
    Ok(())
}

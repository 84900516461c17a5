//! `kvgate epp`: kvgate as an Envoy ext_proc endpoint picker. The same endpoint, model,
//! tokenizer, config and admin flags as `kvgate serve` (and the same config reload); the
//! listener speaks gRPC (`envoy.service.ext_proc.v3.ExternalProcessor` and
//! `grpc.health.v1`) instead of HTTP.

use std::{net::SocketAddr, sync::Arc, time::Duration};

use anyhow::Context;

use crate::serve::{self, ServeArgs};

/// Default ext_proc listen address (the port llm-d's EPP uses).
const DEFAULT_EPP_LISTEN: SocketAddr =
    SocketAddr::new(std::net::IpAddr::V4(std::net::Ipv4Addr::UNSPECIFIED), 9002);

/// Flags of `kvgate epp`: `serve`'s, with `--listen` naming the gRPC (ext_proc + health)
/// address [default 0.0.0.0:9002; the config file's `listen` is the HTTP proxy's and is not
/// used].
#[derive(Debug, clap::Args)]
#[command(
    mut_arg("listen", |a| a.help(
        "ext_proc gRPC listen address (also grpc.health.v1) [default: 0.0.0.0:9002]"
    )),
    after_help = "Envoy forwards the request, so --retries, --upstream-timeout, \
        --upstream-connect-timeout and --upstream-pool-idle-timeout do not apply; Envoy's \
        retry policy can use the fallbacks kvgate lists in the envoy.lb metadata. The gRPC \
        listener is plain h2c: --tls-cert and --tls-key (YAML tls:) do not apply, nor does \
        --max-inflight-body-bytes (the HTTP proxy's body budget)."
)]
pub(crate) struct EppArgs {
    #[command(flatten)]
    serve: ServeArgs,
    /// After SIGTERM: gRPC health turns NOT_SERVING and in-flight ext_proc streams get this
    /// long to finish (e.g. 30s).
    #[arg(long, default_value = "30s", value_parser = humantime::parse_duration)]
    drain_timeout: Duration,
}

pub(crate) fn main(args: EppArgs) -> anyhow::Result<()> {
    let EppArgs {
        serve: serve_args,
        drain_timeout,
    } = args;
    let (file, text) = serve::read_config_file(&serve_args)?;
    let config = serve::proxy_config(&serve_args, &file)?;
    if config.tls.is_some() {
        tracing::warn!(
            "tls (--tls-cert/--tls-key) applies to the HTTP proxy port of `kvgate serve`; the ext_proc listener is plain h2c"
        );
    }
    let (_, admin_listen) = serve::listen_addrs(&serve_args, &file);
    let listen = serve_args.listen.unwrap_or(DEFAULT_EPP_LISTEN);
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("starting the async runtime")?;
    let serve_args = Arc::new(serve_args);
    runtime.block_on(async move {
        let serve::Started {
            proxy,
            registry,
            listener,
            admin,
            _discovery,
        } = serve::start(
            config,
            &serve_args,
            text,
            listen,
            admin_listen,
            "kvgate ext_proc endpoint picker serving",
        )
        .await?;
        let side = proxy.spawn_side_tasks(admin, Arc::new(registry)).await?;
        let options = kvgate_epp::EppOptions {
            drain_timeout,
            ..kvgate_epp::EppOptions::default()
        };
        let result =
            kvgate_epp::serve(listener, proxy.clone(), options, serve::shutdown_signal()).await;
        proxy.shutdown();
        side.stop();
        result?;
        Ok(())
    })
}

//! A proxy serving on loopback ports inside this process: the launcher that the tests and
//! `kvgate demo` share.

use std::{io, net::SocketAddr, sync::Arc};

use prometheus_client::registry::Registry;
use tokio::{net::TcpListener, sync::oneshot, task::JoinHandle};

use crate::{ConfigError, Proxy, ProxyConfig};

/// Why a [`RunningProxy`] could not start.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The configuration is invalid.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A loopback listener could not be bound.
    #[error("{listener} listener on 127.0.0.1: {source}")]
    Bind {
        /// `proxy` or `admin`.
        listener: &'static str,
        /// The bind error.
        #[source]
        source: io::Error,
    },
}

/// A proxy running [`crate::run`] on `127.0.0.1` with free ports (proxy and admin), until
/// [`stop`](Self::stop) or until it is dropped.
///
/// Its metrics go to a registry of its own, without a prefix of the launcher's: the families
/// are named `kvgate_*`, exactly as under `kvgate serve`.
#[derive(Debug)]
pub struct RunningProxy {
    /// Proxy address.
    pub addr: SocketAddr,
    /// Admin address (`/health`, `/ready`, `/metrics`, `/debug/state`).
    pub admin: SocketAddr,
    /// The proxy itself (for reloads and readiness).
    pub proxy: Arc<Proxy>,
    /// Dropping it starts a graceful shutdown.
    stop: oneshot::Sender<()>,
    task: JoinHandle<io::Result<()>>,
}

impl RunningProxy {
    /// Builds a [`Proxy`] from `config` and serves it on two fresh loopback ports.
    ///
    /// # Errors
    /// [`LaunchError::Config`] when `config` is invalid, [`LaunchError::Bind`] when a port
    /// cannot be bound.
    pub async fn launch(config: ProxyConfig) -> Result<RunningProxy, LaunchError> {
        let mut registry = Registry::default();
        let proxy = Proxy::new(config, &mut registry)?;
        let (listener, addr) = bind("proxy").await?;
        let (admin, admin_addr) = bind("admin").await?;
        let (stop, stopped) = oneshot::channel::<()>();
        let task = tokio::spawn(crate::run(
            listener,
            admin,
            proxy.clone(),
            Arc::new(registry),
            async move {
                let _ = stopped.await;
            },
        ));
        Ok(RunningProxy {
            addr,
            admin: admin_addr,
            proxy,
            stop,
            task,
        })
    }

    /// `http://addr`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// `http://admin`.
    pub fn admin_url(&self) -> String {
        format!("http://{}", self.admin)
    }

    /// Shuts the server down gracefully and waits for it to finish.
    ///
    /// # Errors
    /// The server's own error, or one saying that its task panicked.
    pub async fn stop(self) -> io::Result<()> {
        let RunningProxy { stop, task, .. } = self;
        let _ = stop.send(());
        task.await.map_err(io::Error::other)?
    }
}

async fn bind(listener: &'static str) -> Result<(TcpListener, SocketAddr), LaunchError> {
    let bound = async {
        let l = TcpListener::bind("127.0.0.1:0").await?;
        let addr = l.local_addr()?;
        Ok((l, addr))
    };
    bound
        .await
        .map_err(|source| LaunchError::Bind { listener, source })
}

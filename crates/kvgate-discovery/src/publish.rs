//! Hands endpoint lists to the sink: only lists that differ from the last accepted one, each
//! counted.

use std::fmt::Display;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use kvgate_schedule::EndpointConfig;

use crate::metrics::DiscoveryMetrics;

/// The sink with its error type erased.
pub(crate) type BoxSink = Box<dyn Fn(Vec<EndpointConfig>) -> Result<(), String> + Send + Sync>;

/// Boxes a caller's sink.
pub(crate) fn boxed<S, E>(sink: S) -> BoxSink
where
    S: Fn(Vec<EndpointConfig>) -> Result<(), E> + Send + Sync + 'static,
    E: Display,
{
    Box::new(move |list| sink(list).map_err(|e| e.to_string()))
}

/// The sink, the list it last accepted, and the metrics.
pub(crate) struct Publisher {
    sink: BoxSink,
    last: Option<Vec<EndpointConfig>>,
    metrics: DiscoveryMetrics,
    synced: Arc<AtomicBool>,
    source: &'static str,
}

impl std::fmt::Debug for Publisher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Publisher")
            .field("last", &self.last)
            .field("source", &self.source)
            .finish_non_exhaustive()
    }
}

impl Publisher {
    pub(crate) fn new(
        sink: BoxSink,
        metrics: DiscoveryMetrics,
        synced: Arc<AtomicBool>,
        source: &'static str,
    ) -> Publisher {
        Publisher {
            sink,
            last: None,
            metrics,
            synced,
            source,
        }
    }

    /// Gives `list` to the sink unless it equals the list last accepted (a pod status update
    /// that changes neither readiness, address nor labels maps to the same list and leaves the
    /// registry alone). A rejected list is counted as an error and not remembered, so the next
    /// change is offered again.
    ///
    /// # Errors
    /// The sink's rejection (already logged and counted).
    pub(crate) fn publish(&mut self, list: Vec<EndpointConfig>) -> Result<(), String> {
        if self.last.as_ref() == Some(&list) {
            return Ok(());
        }
        let n = list.len();
        match (self.sink)(list.clone()) {
            Ok(()) => {
                self.metrics.updates.inc();
                self.metrics
                    .endpoints
                    .set(i64::try_from(n).unwrap_or(i64::MAX));
                self.synced.store(true, Ordering::Release);
                tracing::info!(
                    source = self.source,
                    endpoints = n,
                    "discovered endpoints applied"
                );
                self.last = Some(list);
                Ok(())
            }
            Err(error) => {
                self.metrics.errors.inc();
                tracing::error!(
                    source = self.source,
                    endpoints = n,
                    %error,
                    "discovered endpoint list rejected; keeping the previous one"
                );
                Err(error)
            }
        }
    }

    /// Counts and logs a failure of the source.
    pub(crate) fn error(&self, what: &str, error: &dyn Display) {
        self.metrics.errors.inc();
        tracing::warn!(source = self.source, %error, "{what}");
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Mutex;

    #[test]
    fn publishes_changes_only_and_counts_rejections() {
        let seen = Arc::new(Mutex::new(Vec::new()));
        let s = Arc::clone(&seen);
        let sink = boxed(move |list: Vec<EndpointConfig>| {
            if list.len() > 1 {
                return Err("too many");
            }
            s.lock().unwrap().push(list);
            Ok(())
        });
        let metrics = DiscoveryMetrics::unregistered();
        let synced = Arc::new(AtomicBool::new(false));
        let mut p = Publisher::new(sink, metrics.clone(), Arc::clone(&synced), "test");
        let one = vec![EndpointConfig::new("http://a:1")];
        p.publish(one.clone()).unwrap();
        p.publish(one.clone()).unwrap();
        assert!(synced.load(Ordering::Acquire));
        let two = vec![
            EndpointConfig::new("http://a:1"),
            EndpointConfig::new("http://b:1"),
        ];
        assert_eq!(p.publish(two).unwrap_err(), "too many");
        p.publish(Vec::new()).unwrap();
        assert_eq!(*seen.lock().unwrap(), vec![one, Vec::new()]);
        assert_eq!(metrics.updates.get(), 2);
        assert_eq!(metrics.errors.get(), 1);
        assert_eq!(metrics.endpoints.get(), 0);
    }
}

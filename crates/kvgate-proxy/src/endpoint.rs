//! Engine endpoints: address, passive health (ejection with backoff) and served models.

use std::{
    sync::{Arc, Mutex, PoisonError},
    time::{Duration, Instant},
};

use http::Uri;

use crate::config::{ConfigError, EndpointConfig};

/// One engine replica kvgate forwards to.
#[derive(Debug)]
pub struct Endpoint {
    /// Position in the configured list.
    pub index: usize,
    /// `host:port`, used in `x-kvgate-endpoint`, logs and metric labels.
    pub name: String,
    scheme: http::uri::Scheme,
    authority: http::uri::Authority,
    /// Path prefix without a trailing slash (usually empty).
    prefix: String,
    health: Mutex<Health>,
    models: Mutex<Option<Arc<Vec<serde_json::Value>>>>,
}

#[derive(Debug, Default)]
struct Health {
    consecutive_failures: u32,
    ejected_until: Option<Instant>,
}

impl Endpoint {
    /// Builds an endpoint from its config.
    ///
    /// # Errors
    /// [`ConfigError::BadEndpoint`] when the URL is not `http://host:port[/prefix]`.
    pub fn new(index: usize, config: &EndpointConfig) -> Result<Endpoint, ConfigError> {
        let bad = |reason| ConfigError::BadEndpoint {
            url: config.url.clone(),
            reason,
        };
        let uri: Uri = config.url.parse().map_err(|_| bad("not a valid URL"))?;
        let scheme = uri.scheme().cloned().ok_or_else(|| bad("missing scheme"))?;
        if scheme != http::uri::Scheme::HTTP {
            return Err(bad("only http:// endpoints are supported"));
        }
        let authority = uri
            .authority()
            .cloned()
            .ok_or_else(|| bad("missing host"))?;
        if uri.query().is_some() {
            return Err(bad("must not have a query string"));
        }
        let prefix = uri.path().trim_end_matches('/').to_owned();
        Ok(Endpoint {
            index,
            name: authority.to_string(),
            scheme,
            authority,
            prefix,
            health: Mutex::default(),
            models: Mutex::default(),
        })
    }

    /// The upstream URI for a client path-and-query.
    pub fn uri_for(&self, path_and_query: &str) -> Result<Uri, http::Error> {
        Uri::builder()
            .scheme(self.scheme.clone())
            .authority(self.authority.clone())
            .path_and_query(format!("{}{}", self.prefix, path_and_query))
            .build()
    }

    /// The `Host` header value for upstream requests.
    pub fn authority(&self) -> &http::uri::Authority {
        &self.authority
    }

    /// Whether the endpoint may receive traffic now (not ejected, or its ejection expired:
    /// then it is tried again, half-open).
    pub fn is_healthy(&self, now: Instant) -> bool {
        let h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        h.ejected_until.is_none_or(|until| now >= until)
    }

    /// Records a success: clears failures and ejection.
    pub fn record_success(&self) {
        let mut h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        *h = Health::default();
    }

    /// Records a connect-level failure and ejects the endpoint for `base × 2^(failures-1)`,
    /// capped at `max`. Returns the ejection period.
    pub fn record_failure(&self, now: Instant, base: Duration, max: Duration) -> Duration {
        let mut h = self.health.lock().unwrap_or_else(PoisonError::into_inner);
        h.consecutive_failures = h.consecutive_failures.saturating_add(1);
        let shift = (h.consecutive_failures - 1).min(16);
        let period = base.saturating_mul(1 << shift).min(max);
        h.ejected_until = Some(now + period);
        period
    }

    /// The model objects the endpoint last reported on `/v1/models` (`None`: not known yet).
    pub fn models(&self) -> Option<Arc<Vec<serde_json::Value>>> {
        self.models
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }

    /// Stores the endpoint's `/v1/models` objects.
    pub fn set_models(&self, models: Vec<serde_json::Value>) {
        *self.models.lock().unwrap_or_else(PoisonError::into_inner) = Some(Arc::new(models));
    }

    /// Whether the endpoint serves `model` (true when its models are not known yet).
    pub fn serves(&self, model: &str) -> bool {
        self.models().is_none_or(|models| {
            models
                .iter()
                .any(|m| m.get("id").and_then(|id| id.as_str()) == Some(model))
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ep(url: &str) -> Result<Endpoint, ConfigError> {
        Endpoint::new(0, &EndpointConfig { url: url.into() })
    }

    #[test]
    fn urls() {
        let e = ep("http://10.0.0.1:8000").unwrap();
        assert_eq!(e.name, "10.0.0.1:8000");
        assert_eq!(
            e.uri_for("/v1/chat/completions?a=1").unwrap().to_string(),
            "http://10.0.0.1:8000/v1/chat/completions?a=1"
        );
        let e = ep("http://h:1/prefix/").unwrap();
        assert_eq!(
            e.uri_for("/v1/models").unwrap().to_string(),
            "http://h:1/prefix/v1/models"
        );
        for bad in [
            "https://h:1",
            "h:1",
            "http://",
            "http://h:1/?q=1",
            "not a url",
        ] {
            assert!(ep(bad).is_err(), "{bad}");
        }
    }

    #[test]
    fn ejection_backs_off_and_expires() {
        let e = ep("http://h:1").unwrap();
        let t0 = Instant::now();
        let base = Duration::from_secs(1);
        let max = Duration::from_secs(5);
        assert!(e.is_healthy(t0));
        assert_eq!(e.record_failure(t0, base, max), base);
        assert!(!e.is_healthy(t0));
        assert!(e.is_healthy(t0 + base));
        assert_eq!(e.record_failure(t0, base, max), base * 2);
        assert_eq!(e.record_failure(t0, base, max), base * 4);
        assert_eq!(e.record_failure(t0, base, max), max);
        e.record_success();
        assert!(e.is_healthy(t0));
    }

    #[test]
    fn serves_unknown_until_discovered() {
        let e = ep("http://h:1").unwrap();
        assert!(e.serves("m"));
        e.set_models(vec![serde_json::json!({"id": "a"})]);
        assert!(e.serves("a"));
        assert!(!e.serves("m"));
    }
}

//! `session-affinity-scorer`: keeps a session on the endpoint that served it before.
//!
//! Score = 1 for the endpoint the request's session was last routed to, 0 for the others. The
//! pick is remembered after every decision (`after_pick`), so the pin follows the endpoint the
//! session actually went to (a session whose endpoint was filtered out moves and is re-pinned).
//!
//! Parameters:
//! - `ttl_ms` (default 300,000): a pin not used for this long is forgotten.
//! - `max_sessions` (default 100,000, > 0): bound on remembered sessions; past it expired pins
//!   are swept and then the least recently used pin is dropped.
//!
//! Signal: the `x-session-id` header ([`crate::RequestFacts::session_id`]). Requests without
//! it skip the scorer (`no_session`); the first request of a session scores 0 everywhere.
//! Pins live in the scorer, so a config reload starts with none.
//!
//! Example:
//! ```yaml
//! - type: session-affinity-scorer
//!   parameters: { ttl_ms: 600000, max_sessions: 50000 }
//! ```

use std::collections::HashMap;
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::ConfigError;
use crate::framework::{ScoreOutcome, Scorer, SkipReason};
use crate::plugins::{Built, Registration, params};

/// Parameters of `session-affinity-scorer`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionAffinityScorerConfig {
    /// Idle time after which a session pin is forgotten, in milliseconds.
    pub ttl_ms: u64,
    /// Most sessions remembered.
    pub max_sessions: usize,
}

impl Default for SessionAffinityScorerConfig {
    fn default() -> Self {
        SessionAffinityScorerConfig {
            ttl_ms: 300_000,
            max_sessions: 100_000,
        }
    }
}

/// Scores 1 for the session's pinned endpoint.
#[derive(Debug)]
pub struct SessionAffinityScorer {
    ttl: Duration,
    max_sessions: usize,
    pins: Mutex<HashMap<String, (String, Instant)>>,
}

impl SessionAffinityScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "session-affinity-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`ConfigError::InvalidParameter`] when `max_sessions` is 0.
    pub fn new(config: SessionAffinityScorerConfig) -> Result<SessionAffinityScorer, ConfigError> {
        if config.max_sessions == 0 {
            return Err(ConfigError::InvalidParameter {
                parameter: "max_sessions",
                reason: "must be greater than 0".into(),
            });
        }
        Ok(SessionAffinityScorer {
            ttl: Duration::from_millis(config.ttl_ms),
            max_sessions: config.max_sessions,
            pins: Mutex::new(HashMap::new()),
        })
    }

    fn pinned(&self, session: &str, now: Instant) -> Option<String> {
        let pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        pins.get(session)
            .filter(|(_, at)| now.saturating_duration_since(*at) <= self.ttl)
            .map(|(ep, _)| ep.clone())
    }
}

impl Scorer for SessionAffinityScorer {
    fn score(
        &self,
        cycle: &mut CycleState,
        candidates: &[&EndpointState],
        scores: &mut [f64],
    ) -> ScoreOutcome {
        let Some(session) = cycle.facts().session_id.as_deref() else {
            return ScoreOutcome::Skipped(SkipReason::NoSession);
        };
        if let Some(pinned) = self.pinned(session, cycle.now()) {
            for (s, e) in scores.iter_mut().zip(candidates) {
                *s = if e.name() == pinned { 1.0 } else { 0.0 };
            }
        }
        ScoreOutcome::Scored
    }

    fn after_pick(&self, cycle: &mut CycleState, picked: &EndpointState) {
        let Some(session) = cycle.facts().session_id.clone() else {
            return;
        };
        let now = cycle.now();
        let mut pins = self.pins.lock().unwrap_or_else(PoisonError::into_inner);
        if pins.len() >= self.max_sessions && !pins.contains_key(&session) {
            pins.retain(|_, (_, at)| now.saturating_duration_since(*at) <= self.ttl);
            if pins.len() >= self.max_sessions
                && let Some(oldest) = pins
                    .iter()
                    .min_by_key(|(_, (_, at))| *at)
                    .map(|(k, _)| k.clone())
            {
                pins.remove(&oldest);
            }
        }
        pins.insert(session, (picked.name().to_owned(), now));
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: SessionAffinityScorer::TYPE,
    description: "keeps a session (x-session-id) on the endpoint that served it before",
    example: "{ ttl_ms: 600000, max_sessions: 50000 }",
    build: |p, _| {
        Ok(Built::Scorer(std::sync::Arc::new(
            SessionAffinityScorer::new(params(p)?)?,
        )))
    },
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cycle::RequestFacts;
    use crate::test_util::{ep, facts, run_scorer, setup};

    fn sess(id: &str) -> RequestFacts {
        RequestFacts {
            session_id: Some(id.into()),
            ..facts()
        }
    }

    fn pin(s: &SessionAffinityScorer, session: &str, name: &str) {
        let (built, mut cycle) = setup(&[ep(name)], sess(session));
        s.after_pick(&mut cycle, &built[0]);
    }

    #[test]
    fn table() {
        let s = SessionAffinityScorer::new(SessionAffinityScorerConfig::default()).unwrap();
        pin(&s, "s1", "b:1");
        let eps = || vec![ep("a:1"), ep("b:1")];
        let cases = vec![
            ("pinned", sess("s1"), Ok(vec![0.0, 1.0])),
            ("unknown session", sess("s2"), Ok(vec![0.0, 0.0])),
            ("no session", facts(), Err(SkipReason::NoSession)),
        ];
        for (name, f, want) in cases {
            assert_eq!(run_scorer(&s, &eps(), f), want, "{name}");
        }
        pin(&s, "s1", "a:1");
        assert_eq!(
            run_scorer(&s, &eps(), sess("s1")),
            Ok(vec![1.0, 0.0]),
            "re-pinned"
        );
    }

    #[test]
    fn expiry_and_bound() {
        let s = SessionAffinityScorer::new(SessionAffinityScorerConfig {
            ttl_ms: 0,
            max_sessions: 1,
        })
        .unwrap();
        pin(&s, "s1", "a:1");
        let later = Instant::now() + Duration::from_millis(5);
        assert_eq!(s.pinned("s1", later), None, "expired");
        pin(&s, "s2", "b:1");
        assert_eq!(s.pins.lock().unwrap().len(), 1, "bounded");
        assert!(
            SessionAffinityScorer::new(SessionAffinityScorerConfig {
                ttl_ms: 1,
                max_sessions: 0
            })
            .is_err()
        );
    }
}

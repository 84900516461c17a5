//! `session-affinity-scorer`: keeps a session on the endpoint that served it before.
//!
//! Score = 1 for the endpoint the request's session was last routed to, 0 for the others. The
//! pick is remembered after every decision (`after_pick`), so the pin follows the endpoint the
//! session actually went to (a session whose endpoint was filtered out moves and is re-pinned).
//!
//! Parameters:
//! - `ttl_ms` (default 300,000, > 0): time to idle; a pin neither read nor written for this
//!   long is forgotten.
//! - `max_sessions` (default 100,000, > 0): capacity, the most pins remembered. Past it the
//!   pin table (a `moka` cache: TinyLFU admission, LRU eviction, amortized O(1) per request)
//!   keeps the pins of sessions seen often, so a flood of one-off session ids cannot push out
//!   the pins of sessions in use; a new session may then be pinned only on a later request.
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

use std::fmt;
use std::hash::{BuildHasher, RandomState};
use std::sync::Arc;
use std::time::Duration;

use moka::sync::Cache;
use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::{ScoreOutcome, Scorer, SkipReason};
use crate::plugins::{Registration, build};

/// Parameters of `session-affinity-scorer`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SessionAffinityScorerConfig {
    /// Time to idle of a session pin, in milliseconds: unused this long, it is forgotten.
    pub ttl_ms: u64,
    /// Most sessions remembered (the pin table's capacity).
    pub max_sessions: u64,
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
pub struct SessionAffinityScorer {
    /// Keyed hash of the session id → `host:port` of the endpoint it was last routed to. The
    /// hash, not the client's id, is stored, so long ids cannot inflate the table.
    pins: Cache<u64, Arc<str>>,
    /// Seeded per scorer, so clients cannot choose ids that collide.
    hasher: RandomState,
}

impl fmt::Debug for SessionAffinityScorer {
    // The derived form would list every pin.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SessionAffinityScorer")
            .field("pins", &self.pins.entry_count())
            .finish_non_exhaustive()
    }
}

impl SessionAffinityScorer {
    /// YAML type name.
    pub const TYPE: &'static str = "session-affinity-scorer";

    /// Builds the scorer.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when `max_sessions` or `ttl_ms` is 0, or
    /// `ttl_ms` is beyond a year.
    pub fn new(
        config: SessionAffinityScorerConfig,
    ) -> Result<SessionAffinityScorer, SchedulerConfigError> {
        const YEAR_MS: u64 = 365 * 24 * 3600 * 1000;
        if config.max_sessions == 0 {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "max_sessions",
                reason: "must be greater than 0".into(),
            });
        }
        if config.ttl_ms == 0 || config.ttl_ms > YEAR_MS {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "ttl_ms",
                reason: format!("{} is not in [1, {YEAR_MS}]", config.ttl_ms),
            });
        }
        let pins = Cache::builder()
            .max_capacity(config.max_sessions)
            .time_to_idle(Duration::from_millis(config.ttl_ms))
            .build();
        Ok(SessionAffinityScorer {
            pins,
            hasher: RandomState::new(),
        })
    }

    fn pin_of(&self, session: &str) -> Option<Arc<str>> {
        self.pins.get(&self.hasher.hash_one(session))
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
        if let Some(pinned) = self.pin_of(session) {
            for (s, e) in scores.iter_mut().zip(candidates) {
                *s = if e.name() == &*pinned { 1.0 } else { 0.0 };
            }
        }
        ScoreOutcome::Scored
    }

    fn after_pick(&self, cycle: &mut CycleState, picked: &EndpointState) {
        let Some(session) = cycle.facts().session_id.as_deref() else {
            return;
        };
        if self.pin_of(session).is_none_or(|p| &*p != picked.name()) {
            let key = self.hasher.hash_one(session);
            self.pins.insert(key, Arc::from(picked.name()));
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: SessionAffinityScorer::TYPE,
    description: "keeps a session (x-session-id) on the endpoint that served it before",
    example: "{ ttl_ms: 600000, max_sessions: 50000 }",
    build: |p, _| build(p, SessionAffinityScorer::new),
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

    fn scorer(ttl_ms: u64, max_sessions: u64) -> SessionAffinityScorer {
        let config = SessionAffinityScorerConfig {
            ttl_ms,
            max_sessions,
        };
        SessionAffinityScorer::new(config).unwrap()
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
    fn idle_pins_expire() {
        let s = scorer(1, 100);
        pin(&s, "s1", "a:1");
        // A read refreshes the pin's idle time, so every read comes after a pause longer than
        // the 1 ms time to idle: the first read must already find the pin gone.
        let deadline = std::time::Instant::now() + Duration::from_secs(10);
        loop {
            std::thread::sleep(Duration::from_millis(5));
            if run_scorer(&s, &[ep("a:1")], sess("s1")) == Ok(vec![0.0]) {
                break;
            }
            assert!(std::time::Instant::now() < deadline, "pin never expired");
        }
    }

    /// A flood of one-off session ids (client-chosen) keeps the table at its capacity and does
    /// not push out the pin of a session in use.
    #[test]
    fn flood_of_session_ids_is_bounded_and_keeps_pins_in_use() {
        let s = scorer(300_000, 100);
        let eps = [ep("a:1"), ep("b:1")];
        let (built, _) = setup(&eps, facts());
        let request = |session: &str, picked: usize| {
            let (_, mut cycle) = setup(&eps, sess(session));
            let view: Vec<&EndpointState> = built.iter().map(|e| &**e).collect();
            let mut scores = vec![0.0; view.len()];
            s.score(&mut cycle, &view, &mut scores);
            s.after_pick(&mut cycle, view[picked]);
        };
        // The regular session comes back after every 150 one-off ids: more than the capacity, so
        // least-recently-used eviction alone would have dropped its pin each time.
        let mut kept = 0;
        for round in 0..100 {
            for i in 0..150 {
                request(&format!("one-off-{round}-{i}"), 0);
            }
            if run_scorer(&s, &eps, sess("regular")) == Ok(vec![0.0, 1.0]) {
                kept += 1;
            }
            request("regular", 1);
        }
        s.pins.run_pending_tasks();
        assert!(s.pins.entry_count() <= 100, "{} pins", s.pins.entry_count());
        assert!(
            kept >= 95,
            "the regular session kept its pin {kept} times of 100"
        );
    }

    #[test]
    fn bad_parameters_are_named() {
        let cases = [
            ("max_sessions", 1, 0, "max_sessions"),
            ("ttl 0", 0, 1, "ttl_ms"),
            ("ttl beyond a year", u64::MAX, 1, "ttl_ms"),
        ];
        for (name, ttl_ms, max_sessions, field) in cases {
            let e = SessionAffinityScorer::new(SessionAffinityScorerConfig {
                ttl_ms,
                max_sessions,
            })
            .unwrap_err();
            assert!(e.to_string().contains(field), "{name}: {e}");
        }
    }
}

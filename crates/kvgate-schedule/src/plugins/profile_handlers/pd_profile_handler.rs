//! `pd-profile-handler`: prefill/decode disaggregation, decode first (llm-d's
//! `disagg-profile-handler` with the `prefix-based-pd-decider`).
//!
//! 1. Runs the decode profile; its pick is the primary result (the request goes there).
//! 2. If the decode pick's uncached prompt suffix (`prompt_tokens − predicted cached tokens`)
//!    is at least `non_cached_tokens` (0 disables remote prefill) and the prompt has at least
//!    `min_prompt_tokens`, runs the prefill profile too. Its pick's `host:port` goes into the
//!    `x-prefiller-host-port` request header, which the P/D sidecar on the decode endpoint reads
//!    to run the prefill remotely.
//! 3. When the prefill profile fails (e.g. no prefill endpoint is healthy) the request is
//!    decoded locally: no header, and the decision kind says `decode-only`.
//!
//! Parameters:
//! - `decode_profile` (default `decode`), `prefill_profile` (default `prefill`): profile names.
//! - `non_cached_tokens` (default 16): uncached suffix length that triggers remote prefill.
//! - `min_prompt_tokens` (default 0): shorter prompts are never disaggregated.
//!
//! Signals: the prompt length ([`crate::RequestFacts::prompt_tokens`]) and the decode run's
//! predicted cached tokens (0 without a prefix scorer in the decode profile). A request with
//! an unknown prompt length is decoded locally.
//!
//! Example:
//! ```yaml
//! scheduling:
//!   profile_handler:
//!     type: pd-profile-handler
//!     parameters: { decode_profile: decode, prefill_profile: prefill, non_cached_tokens: 256 }
//! ```

use serde::Deserialize;

use super::resolve;
use crate::cycle::CycleState;
use crate::error::SchedulerConfigError;
use crate::framework::{HandlerResult, ProfileHandler, ProfileRunSummary};
use crate::plugins::{Registration, build};

/// The request header naming the prefill endpoint for the P/D sidecar.
pub const PREFILLER_HEADER: &str = "x-prefiller-host-port";

/// Parameters of `pd-profile-handler`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct PdProfileHandlerConfig {
    /// Name of the decode profile.
    pub decode_profile: String,
    /// Name of the prefill profile.
    pub prefill_profile: String,
    /// Uncached prompt tokens at or above which prefill runs remotely (0 = never).
    pub non_cached_tokens: u64,
    /// Prompts shorter than this are never disaggregated.
    pub min_prompt_tokens: u64,
}

impl Default for PdProfileHandlerConfig {
    fn default() -> Self {
        PdProfileHandlerConfig {
            decode_profile: "decode".into(),
            prefill_profile: "prefill".into(),
            non_cached_tokens: 16,
            min_prompt_tokens: 0,
        }
    }
}

/// Decode first, then prefill when the uncached suffix is long.
#[derive(Debug)]
pub struct PdProfileHandler {
    decode: usize,
    prefill: usize,
    non_cached_tokens: u64,
    min_prompt_tokens: u64,
}

impl PdProfileHandler {
    /// YAML type name.
    pub const TYPE: &'static str = "pd-profile-handler";

    /// Builds the handler over the configured profile names.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when a profile name is unknown or both are
    /// the same.
    pub fn new(
        config: PdProfileHandlerConfig,
        profiles: &[String],
    ) -> Result<PdProfileHandler, SchedulerConfigError> {
        let decode = resolve(profiles, &config.decode_profile, "decode_profile")?;
        let prefill = resolve(profiles, &config.prefill_profile, "prefill_profile")?;
        if decode == prefill {
            return Err(SchedulerConfigError::InvalidParameter {
                parameter: "prefill_profile",
                reason: "must differ from decode_profile".into(),
            });
        }
        Ok(PdProfileHandler {
            decode,
            prefill,
            non_cached_tokens: config.non_cached_tokens,
            min_prompt_tokens: config.min_prompt_tokens,
        })
    }

    fn wants_prefill(&self, cycle: &CycleState, decode: &ProfileRunSummary) -> bool {
        let Some(prompt) = cycle.facts().prompt_tokens else {
            return false;
        };
        let uncached = prompt.saturating_sub(decode.predicted_cached_tokens);
        self.non_cached_tokens > 0
            && uncached >= self.non_cached_tokens
            && prompt >= self.min_prompt_tokens
    }
}

impl ProfileHandler for PdProfileHandler {
    fn next_profile(&self, cycle: &CycleState, runs: &[ProfileRunSummary]) -> Option<usize> {
        match runs {
            [] => Some(self.decode),
            [decode] if decode.picked && self.wants_prefill(cycle, decode) => Some(self.prefill),
            _ => None,
        }
    }

    fn finish(&self, _cycle: &CycleState, runs: &[ProfileRunSummary]) -> Option<HandlerResult> {
        let decode = runs
            .first()
            .filter(|r| r.picked && r.profile == self.decode)?;
        let _ = decode;
        let prefill = runs
            .get(1)
            .filter(|r| r.picked && r.profile == self.prefill)
            .and_then(|r| r.endpoint.clone());
        Some(match prefill {
            Some(hp) => HandlerResult {
                primary: 0,
                headers: vec![(PREFILLER_HEADER, hp)],
                kind: "prefill-decode",
            },
            None => HandlerResult {
                primary: 0,
                headers: Vec::new(),
                kind: "decode-only",
            },
        })
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: PdProfileHandler::TYPE,
    description: "prefill/decode disaggregation: decode first, remote prefill for long uncached suffixes",
    example: "{ decode_profile: decode, prefill_profile: prefill, non_cached_tokens: 256 }",
    build: |p, h| build(p, |c| PdProfileHandler::new(c, h.profiles)),
};

#[cfg(test)]
mod tests {
    use std::time::Instant;

    use super::*;
    use crate::cycle::RequestFacts;

    fn run(profile: usize, picked: bool, cached: u64, ep: &str) -> ProfileRunSummary {
        ProfileRunSummary {
            profile,
            picked,
            predicted_cached_tokens: cached,
            endpoint: Some(ep.into()),
        }
    }

    #[test]
    fn table() {
        let names = ["prefill".to_owned(), "decode".to_owned()];
        let h = PdProfileHandler::new(
            PdProfileHandlerConfig {
                non_cached_tokens: 100,
                min_prompt_tokens: 50,
                ..Default::default()
            },
            &names,
        )
        .unwrap();
        let cycle = |prompt: Option<u64>| {
            CycleState::new(
                RequestFacts {
                    prompt_tokens: prompt,
                    ..Default::default()
                },
                Instant::now(),
            )
        };
        // (name, prompt tokens, decode run, wants prefill)
        let cases = [
            (
                "long uncached suffix",
                Some(1000),
                run(1, true, 0, "d:1"),
                true,
            ),
            ("mostly cached", Some(1000), run(1, true, 950, "d:1"), false),
            (
                "exactly at threshold",
                Some(1000),
                run(1, true, 900, "d:1"),
                true,
            ),
            ("short prompt", Some(40), run(1, true, 0, "d:1"), false),
            ("unknown prompt length", None, run(1, true, 0, "d:1"), false),
            ("decode failed", Some(1000), run(1, false, 0, "d:1"), false),
        ];
        for (name, prompt, decode, want) in cases {
            let c = cycle(prompt);
            assert_eq!(h.next_profile(&c, &[]), Some(1), "{name}: decode first");
            assert_eq!(
                h.next_profile(&c, std::slice::from_ref(&decode)),
                want.then_some(0),
                "{name}"
            );
        }
        let c = cycle(Some(1000));
        let both = h
            .finish(
                &c,
                &[run(1, true, 0, "d:1"), run(0, true, 0, "10.0.0.2:8000")],
            )
            .unwrap();
        assert_eq!(
            both.headers,
            vec![(PREFILLER_HEADER, "10.0.0.2:8000".to_owned())]
        );
        assert_eq!(both.kind, "prefill-decode");
        let local = h
            .finish(&c, &[run(1, true, 0, "d:1"), run(0, false, 0, "")])
            .unwrap();
        assert_eq!((local.headers.len(), local.kind), (0, "decode-only"));
        assert_eq!(h.finish(&c, &[run(1, false, 0, "d:1")]), None);
        let never = PdProfileHandler::new(
            PdProfileHandlerConfig {
                non_cached_tokens: 0,
                ..Default::default()
            },
            &names,
        )
        .unwrap();
        assert_eq!(
            never.next_profile(&c, &[run(1, true, 0, "d:1")]),
            None,
            "0 disables"
        );
        let same = PdProfileHandlerConfig {
            prefill_profile: "decode".into(),
            ..Default::default()
        };
        crate::test_util::assert_error_names(
            PdProfileHandler::new(same, &names),
            &["prefill_profile", "decode_profile"],
        );
    }
}

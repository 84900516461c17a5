//! `model-filter`: keeps endpoints that serve the request's model.
//!
//! An endpoint is kept when its discovered models (`/v1/models`) include the request's model
//! (as forwarded) or, for LoRA requests, the adapter; an adapter currently running there
//! according to `vllm:lora_requests_info` also counts.
//!
//! Parameters:
//! - `keep_unknown` (default true): keep endpoints whose models are not discovered yet.
//!
//! Signals: served models set by discovery ([`crate::EndpointState::set_served_models`]) and,
//! for adapters, fresh LoRA metrics. Missing models → `keep_unknown`; stale metrics are simply
//! not consulted.
//!
//! Example:
//! ```yaml
//! - type: model-filter
//!   parameters: { keep_unknown: false }
//! ```

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::Filter;
use crate::plugins::{Registration, build};

/// Parameters of `model-filter`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ModelFilterConfig {
    /// Keep endpoints whose served models are not known yet.
    pub keep_unknown: bool,
}

impl Default for ModelFilterConfig {
    fn default() -> Self {
        ModelFilterConfig { keep_unknown: true }
    }
}

/// Keeps endpoints serving the model.
#[derive(Debug)]
pub struct ModelFilter {
    keep_unknown: bool,
}

impl ModelFilter {
    /// YAML type name.
    pub const TYPE: &'static str = "model-filter";

    /// Builds the filter.
    ///
    /// # Errors
    /// Never; the signature matches every plugin's.
    pub fn new(config: ModelFilterConfig) -> Result<ModelFilter, SchedulerConfigError> {
        Ok(ModelFilter {
            keep_unknown: config.keep_unknown,
        })
    }
}

impl Filter for ModelFilter {
    fn filter(&self, cycle: &CycleState, candidates: &[&EndpointState], keep: &mut [bool]) {
        let facts = cycle.facts();
        let adapter = facts.lora_adapter.as_deref();
        for (k, e) in keep.iter_mut().zip(candidates) {
            let served = match e.serves(&facts.model) {
                Some(true) => true,
                known => {
                    let by_adapter = adapter.is_some_and(|a| {
                        e.serves(a) == Some(true)
                            || e.with_metrics(cycle.now(), |m| {
                                m.fresh()
                                    .and_then(|m| m.lora.as_ref())
                                    .is_some_and(|l| l.is_running(a))
                            })
                    });
                    by_adapter || (known.is_none() && self.keep_unknown)
                }
            };
            *k = served;
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: ModelFilter::TYPE,
    description: "keeps endpoints that serve the request's model or LoRA adapter",
    example: "{ keep_unknown: false }",
    build: |p, _| build(p, ModelFilter::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::endpoint::ServedModel;
    use crate::test_util::{Fresh, ep, facts, setup};

    #[test]
    fn table() {
        let keep = ModelFilter::new(ModelFilterConfig::default()).unwrap();
        let strict = ModelFilter::new(ModelFilterConfig {
            keep_unknown: false,
        })
        .unwrap();
        let model = |id: &str| ServedModel {
            id: id.into(),
            parent: None,
        };
        type Row<'a> = (
            &'a str,
            &'a ModelFilter,
            Option<Vec<ServedModel>>,
            crate::test_util::Ep,
            Option<&'a str>,
            bool,
        );
        let rows: Vec<Row<'_>> = vec![
            (
                "serves",
                &keep,
                Some(vec![model("m")]),
                ep("a:1"),
                None,
                true,
            ),
            (
                "other model",
                &keep,
                Some(vec![model("x")]),
                ep("a:1"),
                None,
                false,
            ),
            ("unknown kept", &keep, None, ep("a:1"), None, true),
            (
                "unknown dropped when strict",
                &strict,
                None,
                ep("a:1"),
                None,
                false,
            ),
            (
                "adapter listed",
                &strict,
                Some(vec![
                    model("x"),
                    ServedModel {
                        id: "ad".into(),
                        parent: Some("x".into()),
                    },
                ]),
                ep("a:1"),
                Some("ad"),
                true,
            ),
            (
                "adapter running",
                &strict,
                Some(vec![model("x")]),
                ep("a:1").lora(&["ad"], &[], 2),
                Some("ad"),
                true,
            ),
            (
                "adapter running, stale metrics",
                &strict,
                Some(vec![model("x")]),
                ep("a:1").lora(&["ad"], &[], 2).fresh(Fresh::Stale),
                Some("ad"),
                false,
            ),
            (
                "adapter absent",
                &strict,
                Some(vec![model("x")]),
                ep("a:1"),
                Some("ad"),
                false,
            ),
        ];
        for (name, f, models, e, adapter, want) in rows {
            let mut fa = facts();
            if let Some(a) = adapter {
                fa = fa.with_lora_adapter(a);
                fa.model = a.into();
            }
            let (built, cycle) = setup(&[e], fa);
            if let Some(m) = models {
                built[0].set_served_models(m);
            }
            let mut k = vec![true];
            f.filter(&cycle, &[&built[0]], &mut k);
            assert_eq!(k[0], want, "{name}");
        }
    }
}

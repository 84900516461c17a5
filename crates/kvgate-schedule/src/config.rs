//! The scheduler's YAML config (in the spirit of llm-d's `EndpointPickerConfig`):
//!
//! ```yaml
//! plugins:                      # instances: type, optional name (defaults to type), parameters
//!   - type: precise-prefix-cache-scorer
//!   - type: queue-scorer
//!   - type: role-filter
//!     name: prefill-only
//!     parameters: { role: prefill }
//!   - type: max-score-picker
//! profiles:                     # ordered filters, weighted scorers, one picker, by ref
//!   - name: default
//!     plugins:
//!       - { ref: precise-prefix-cache-scorer, weight: 3 }
//!       - { ref: queue-scorer, weight: 2 }
//!       - { ref: max-score-picker }
//! scheduling:                   # optional; default single-profile-handler
//!   profile_handler: { type: pd-profile-handler, parameters: { non_cached_tokens: 256 } }
//! seed: 42                      # optional; seeds the random pickers (absent: OS entropy)
//! ```
//!
//! The file is parsed once into these specs; each plugin's `parameters` stay a located
//! [`Node`] until the plugin type is known, so every error, including a bad parameter deep in
//! a plugin's config, names its line. Defaults (llm-d's loader rules):
//! - no `plugins` and no `profiles` → the default profile ([`SchedulerConfig::default_profile`]);
//! - `plugins` but no `profiles` → one profile `default` with every listed filter, scorer
//!   (weight 1) and picker, in order;
//! - a profile without a picker gets `max-score-picker`;
//! - no `scheduling.profile_handler` → `single-profile-handler` on the first profile.

pub(crate) mod node;

use serde::Deserialize;
use serde_saphyr::{Location, Spanned};

pub use node::{Node, NodeError};

use crate::error::SchedulerConfigError;

/// One plugin instance.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginSpec {
    /// Registered type name, e.g. `queue-scorer`.
    #[serde(rename = "type")]
    pub type_name: Spanned<String>,
    /// Instance name profiles refer to (defaults to the type name).
    #[serde(default)]
    pub name: Option<Spanned<String>>,
    /// Type-specific parameters (absent = the plugin's defaults).
    #[serde(default)]
    pub parameters: Option<Spanned<Node>>,
}

impl PluginSpec {
    /// A spec for `type_name` with default parameters (for configs built in code).
    pub fn new(type_name: &str) -> PluginSpec {
        PluginSpec {
            type_name: unlocated(type_name.to_owned()),
            name: None,
            parameters: None,
        }
    }

    /// The instance name: `name`, else the type name.
    pub fn instance_name(&self) -> &Spanned<String> {
        self.name.as_ref().unwrap_or(&self.type_name)
    }
}

/// A plugin used by a profile.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct PluginRef {
    /// Instance name of a plugin in `plugins`.
    #[serde(rename = "ref")]
    pub reference: Spanned<String>,
    /// Scorer weight (default 1; scorers only).
    #[serde(default)]
    pub weight: Option<Spanned<f64>>,
}

impl PluginRef {
    /// A reference built in code.
    pub fn new(reference: &str, weight: Option<f64>) -> PluginRef {
        PluginRef {
            reference: unlocated(reference.to_owned()),
            weight: weight.map(unlocated),
        }
    }
}

/// A scheduling profile: ordered filters, weighted scorers, one picker.
#[derive(Debug, Clone, PartialEq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ProfileSpec {
    /// Profile name (profile handlers refer to it).
    pub name: Spanned<String>,
    /// The plugins, in order.
    pub plugins: Vec<PluginRef>,
}

/// Cycle-level settings.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulingSpec {
    /// The profile handler (default `single-profile-handler`).
    pub profile_handler: Option<PluginSpec>,
}

/// The scheduler section of `kvgate.yaml`. Its keys may sit at the top level of the file; an
/// embedding config struct can hold them as fields of these types.
#[derive(Debug, Clone, Default, PartialEq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct SchedulerConfig {
    /// Plugin instances.
    pub plugins: Vec<PluginSpec>,
    /// Profiles.
    pub profiles: Vec<ProfileSpec>,
    /// Profile handler selection.
    pub scheduling: SchedulingSpec,
    /// Seed of the random source the pickers draw from (random tie-breaks, `random-picker`,
    /// `weighted-random-picker`). Absent (the default): seeded from OS entropy. With a seed, a
    /// scheduler built from this config makes the same random draws for the same sequence of
    /// requests (tests, benchmarks).
    pub seed: Option<u64>,
}

fn prefix_scorer(precise: bool) -> &'static str {
    if precise {
        "precise-prefix-cache-scorer"
    } else {
        "approx-prefix-cache-scorer"
    }
}

/// One profile `default` of these plugins (type names; scorers with their weight).
fn profile(plugins: &[(&str, Option<f64>)]) -> SchedulerConfig {
    SchedulerConfig {
        plugins: plugins.iter().map(|(t, _)| PluginSpec::new(t)).collect(),
        profiles: vec![ProfileSpec {
            name: unlocated("default".to_owned()),
            plugins: plugins.iter().map(|(t, w)| PluginRef::new(t, *w)).collect(),
        }],
        scheduling: SchedulingSpec::default(),
        seed: None,
    }
}

pub(crate) fn unlocated<T>(value: T) -> Spanned<T> {
    Spanned::new(value, Location::UNKNOWN, Location::UNKNOWN)
}

impl SchedulerConfig {
    /// Parses a YAML document holding only the scheduler keys.
    ///
    /// # Errors
    /// [`SchedulerConfigError::Yaml`] with serde-saphyr's message, which names line and column.
    pub fn from_yaml(text: &str) -> Result<SchedulerConfig, SchedulerConfigError> {
        serde_saphyr::from_str(text).map_err(|e| SchedulerConfigError::Yaml(e.to_string()))
    }

    /// True when no plugin, profile or profile handler is configured (the default profile
    /// applies; a `seed` still does).
    pub fn is_empty(&self) -> bool {
        self.plugins.is_empty()
            && self.profiles.is_empty()
            && self.scheduling.profile_handler.is_none()
    }

    /// The default profile, [`SchedulerConfig::cost_profile`].
    pub fn default_profile(precise: bool) -> SchedulerConfig {
        SchedulerConfig::cost_profile(precise)
    }

    /// The cost profile: `model-filter`, the prefix scorer with weight 0 (precise when
    /// `precise`, else approximate: it records the predicted cached tokens and its speculative
    /// or routing entries), `prefill-cost-scorer` ×1 (queued + uncached prefill tokens),
    /// `max-score-picker` (ties: fewest decode tokens, then least recently picked).
    pub fn cost_profile(precise: bool) -> SchedulerConfig {
        let prefix = prefix_scorer(precise);
        profile(&[
            ("model-filter", None),
            (prefix, Some(0.0)),
            ("prefill-cost-scorer", Some(1.0)),
            ("max-score-picker", None),
        ])
    }

    /// The llm-d-style weighted profile: `model-filter`, the prefix scorer ×3,
    /// `queue-scorer` ×2, `kv-cache-utilization-scorer` ×2, `max-score-picker`.
    pub fn weighted_profile(precise: bool) -> SchedulerConfig {
        let prefix = prefix_scorer(precise);
        profile(&[
            ("model-filter", None),
            (prefix, Some(3.0)),
            ("queue-scorer", Some(2.0)),
            ("kv-cache-utilization-scorer", Some(2.0)),
            ("max-score-picker", None),
        ])
    }

    /// A built-in profile by name: `cost` or `weighted`.
    pub fn builtin(name: &str, precise: bool) -> Option<SchedulerConfig> {
        match name {
            "cost" => Some(SchedulerConfig::cost_profile(precise)),
            "weighted" => Some(SchedulerConfig::weighted_profile(precise)),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_the_documented_shape() {
        let yaml = "plugins:\n  - type: queue-scorer\n  - type: role-filter\n    name: p\n    parameters: { role: prefill }\nprofiles:\n  - name: default\n    plugins:\n      - { ref: queue-scorer, weight: 2 }\nscheduling:\n  profile_handler: { type: single-profile-handler }\n";
        let c = SchedulerConfig::from_yaml(yaml).unwrap();
        assert_eq!(c.plugins.len(), 2);
        assert_eq!(c.plugins[1].instance_name().value, "p");
        assert_eq!(c.plugins[1].type_name.referenced.line(), 3);
        assert_eq!(
            c.profiles[0].plugins[0].weight.as_ref().map(|w| w.value),
            Some(2.0)
        );
        assert!(c.scheduling.profile_handler.is_some());
        assert_eq!(c.seed, None);
        let seeded = SchedulerConfig::from_yaml("seed: 42\n").unwrap();
        assert_eq!(seeded.seed, Some(42));
        assert!(seeded.is_empty(), "a seed alone keeps the default profile");
    }

    #[test]
    fn shape_errors_name_the_line() {
        let e = SchedulerConfig::from_yaml("plugins:\n  - type: queue-scorer\n    wieght: 2\n")
            .unwrap_err();
        let msg = e.to_string();
        assert!(msg.contains("wieght") && msg.contains('3'), "{msg}");
    }
}

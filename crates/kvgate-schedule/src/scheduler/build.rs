//! Config → [`Scheduler`]: resolve plugin types, build instances, wire profiles, pick the
//! profile handler. Every problem is collected with its YAML location before failing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use rand::SeedableRng;
use rand::rngs::StdRng;
use serde_saphyr::Location;

use super::{Profile, Scheduler, SchedulerHandles, WeightedScorer};
use crate::config::{PluginRef, PluginSpec, ProfileSpec, SchedulerConfig, unlocated};
use crate::decision::ScorerColumn;
use crate::error::{ConfigIssue, SchedulerConfigError};
use crate::framework::{Filter, Picker};
use crate::plugins::pickers::max_score_picker::MaxScorePicker;
use crate::plugins::profile_handlers::single_profile_handler::SingleProfileHandler;
use crate::plugins::{BuildError, BuildHandles, Built, known_types, lookup};

fn issue(loc: Location, message: String) -> ConfigIssue {
    ConfigIssue {
        line: loc.line() as u32,
        column: loc.column() as u32,
        message,
    }
}

/// Builds one plugin, turning failures into located issues.
fn build_one(spec: &PluginSpec, handles: &BuildHandles<'_>) -> Result<Built, ConfigIssue> {
    let type_name = &spec.type_name;
    let Some(reg) = lookup(&type_name.value) else {
        return Err(issue(
            type_name.referenced,
            format!(
                "unknown plugin type `{}` (known: {})",
                type_name.value,
                known_types()
            ),
        ));
    };
    let params_loc = spec
        .parameters
        .as_ref()
        .map_or(type_name.referenced, |p| p.referenced);
    (reg.build)(spec.parameters.as_ref(), handles).map_err(|e| match e {
        BuildError::Parameters(e) => ConfigIssue {
            line: if e.line == 0 {
                params_loc.line() as u32
            } else {
                e.line
            },
            column: if e.line == 0 {
                params_loc.column() as u32
            } else {
                e.column
            },
            message: format!(
                "plugin `{}` ({}): {}",
                spec.instance_name().value,
                type_name.value,
                e.message
            ),
        },
        BuildError::Config(e) => issue(
            params_loc,
            format!(
                "plugin `{}` ({}): {e}",
                spec.instance_name().value,
                type_name.value
            ),
        ),
    })
}

/// Profiles from the config, or one `default` profile over every listed plugin.
fn profile_specs(config: &SchedulerConfig) -> Vec<ProfileSpec> {
    if !config.profiles.is_empty() {
        return config.profiles.clone();
    }
    vec![ProfileSpec {
        name: unlocated("default".to_owned()),
        plugins: config
            .plugins
            .iter()
            .filter(|p| !p.type_name.value.ends_with("-profile-handler"))
            .map(|p| PluginRef {
                reference: p.instance_name().clone(),
                weight: None,
            })
            .collect(),
    }]
}

fn resolve_profile(
    spec: &ProfileSpec,
    instances: &HashMap<String, (Built, &'static str)>,
    broken: &[String],
    issues: &mut Vec<ConfigIssue>,
) -> Profile {
    let pname = &spec.name.value;
    let mut filters: Vec<(String, Arc<dyn Filter>)> = Vec::new();
    let mut scorers = Vec::new();
    let mut picker: Option<(String, Arc<dyn Picker>)> = None;
    for r in &spec.plugins {
        let name = &r.reference.value;
        let Some((built, _)) = instances.get(name) else {
            if broken.contains(name) {
                // Already reported where the plugin is defined.
                continue;
            }
            issues.push(issue(
                r.reference.referenced,
                format!("profile `{pname}`: no plugin named `{name}` in `plugins`"),
            ));
            continue;
        };
        let weight_loc = r.weight.as_ref().map(|w| w.referenced);
        match built {
            Built::Scorer(s) => {
                let weight = r.weight.as_ref().map_or(1.0, |w| w.value);
                if !weight.is_finite() || weight < 0.0 {
                    issues.push(issue(
                        weight_loc.unwrap_or(r.reference.referenced),
                        format!("profile `{pname}`: weight {weight} of `{name}` must be a finite number >= 0"),
                    ));
                }
                scorers.push(WeightedScorer {
                    name: name.clone(),
                    short: name.strip_suffix("-scorer").unwrap_or(name).to_owned(),
                    weight,
                    scorer: Arc::clone(s),
                });
            }
            other => {
                if let Some(loc) = weight_loc {
                    issues.push(issue(
                        loc,
                        format!(
                            "profile `{pname}`: `{name}` is a {}; only scorers take a weight",
                            other.kind()
                        ),
                    ));
                }
                match other {
                    Built::Filter(f) => filters.push((name.clone(), Arc::clone(f))),
                    Built::Picker(_) if picker.is_some() => {
                        issues.push(issue(
                            r.reference.referenced,
                            format!("profile `{pname}`: second picker `{name}`; a profile has one picker"),
                        ));
                    }
                    Built::Picker(p) => picker = Some((name.clone(), Arc::clone(p))),
                    Built::ProfileHandler(_) | Built::Scorer(_) => issues.push(issue(
                        r.reference.referenced,
                        format!("profile `{pname}`: `{name}` is a profile handler; set it under scheduling.profile_handler"),
                    )),
                }
            }
        }
    }
    let picker = picker.unwrap_or_else(|| {
        let p: Arc<dyn Picker> = Arc::new(MaxScorePicker {});
        (MaxScorePicker::TYPE.to_owned(), p)
    });
    let columns = scorers
        .iter()
        .map(|s: &WeightedScorer| ScorerColumn {
            name: s.name.clone(),
            short: s.short.clone(),
            weight: s.weight,
        })
        .collect();
    Profile {
        name: pname.clone(),
        filters,
        scorers: scorers.into(),
        columns,
        picker,
    }
}

pub(super) fn from_config(
    config: &SchedulerConfig,
    handles: &SchedulerHandles,
) -> Result<Scheduler, SchedulerConfigError> {
    let seed = config.seed;
    let defaulted;
    let config = if config.is_empty() {
        defaulted = SchedulerConfig::default_profile(handles.precise);
        &defaulted
    } else {
        config
    };
    let mut issues = Vec::new();
    let specs = profile_specs(config);
    let mut profile_names: Vec<String> = Vec::new();
    for p in &specs {
        if profile_names.contains(&p.name.value) {
            issues.push(issue(
                p.name.referenced,
                format!("duplicate profile name `{}`", p.name.value),
            ));
        }
        profile_names.push(p.name.value.clone());
    }
    let bh = BuildHandles {
        kv_index: &handles.kv_index,
        profiles: &profile_names,
    };

    let mut instances: HashMap<String, (Built, &'static str)> = HashMap::new();
    let mut broken: Vec<String> = Vec::new();
    for spec in &config.plugins {
        let name = spec.instance_name();
        if instances.contains_key(&name.value) {
            issues.push(issue(
                name.referenced,
                format!("duplicate plugin name `{}`", name.value),
            ));
            continue;
        }
        match build_one(spec, &bh) {
            Ok(Built::ProfileHandler(_)) => issues.push(issue(
                spec.type_name.referenced,
                format!(
                    "`{}` is a profile handler; set it under scheduling.profile_handler",
                    spec.type_name.value
                ),
            )),
            Ok(b) => {
                let type_name = lookup(&spec.type_name.value).map_or("", |r| r.type_name);
                instances.insert(name.value.clone(), (b, type_name));
            }
            Err(i) => {
                broken.push(name.value.clone());
                issues.push(i);
            }
        }
    }

    let profiles: Vec<Profile> = specs
        .iter()
        .map(|s| resolve_profile(s, &instances, &broken, &mut issues))
        .collect();

    let handler = match &config.scheduling.profile_handler {
        Some(spec) => match build_one(spec, &bh) {
            Ok(Built::ProfileHandler(h)) => {
                Some((h, lookup(&spec.type_name.value).map_or("", |r| r.type_name)))
            }
            Ok(other) => {
                issues.push(issue(
                    spec.type_name.referenced,
                    format!(
                        "`{}` is a {}, not a profile handler",
                        spec.type_name.value,
                        other.kind()
                    ),
                ));
                None
            }
            Err(i) => {
                issues.push(i);
                None
            }
        },
        None => match SingleProfileHandler::new(Default::default(), &profile_names) {
            Ok(h) => Some((Arc::new(h) as _, SingleProfileHandler::TYPE)),
            Err(e) => {
                issues.push(ConfigIssue {
                    line: 0,
                    column: 0,
                    message: e.to_string(),
                });
                None
            }
        },
    };
    match handler {
        Some((handler, handler_type)) if issues.is_empty() => Ok(Scheduler {
            profiles,
            handler,
            handler_type,
            metrics: handles.metrics.clone(),
            seeds: seed.map(|s| Mutex::new(StdRng::seed_from_u64(s))),
            cycle: Mutex::default(),
        }),
        _ => {
            issues.sort_by_key(|i| (i.line, i.column));
            Err(SchedulerConfigError::Invalid(issues))
        }
    }
}

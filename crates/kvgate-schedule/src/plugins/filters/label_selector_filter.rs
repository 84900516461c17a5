//! `label-selector-filter`: keeps endpoints whose labels match a Kubernetes-style selector.
//!
//! An endpoint is kept when every `match_labels` pair is present with that value and every
//! `match_expressions` entry holds: `in` (label present with one of `values`), `not_in`
//! (absent, or present with none of `values`), `exists`, `does_not_exist`.
//!
//! Parameters:
//! - `match_labels` (default empty): `{key: value}` pairs.
//! - `match_expressions` (default empty): `[{key, operator, values}]`.
//!
//! Signal: endpoint labels only. A missing label fails `match_labels`, `in` and `exists`.
//! An empty selector keeps everything.
//!
//! Example:
//! ```yaml
//! - type: label-selector-filter
//!   parameters:
//!     match_labels: { pool: a }
//!     match_expressions: [{ key: zone, operator: in, values: [z1, z2] }]
//! ```

use std::collections::BTreeMap;

use serde::Deserialize;

use crate::cycle::CycleState;
use crate::endpoint::EndpointState;
use crate::error::SchedulerConfigError;
use crate::framework::Filter;
use crate::plugins::{Registration, build};

/// A selector operator.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Operator {
    /// Label present with one of the values.
    In,
    /// Label absent or with none of the values.
    NotIn,
    /// Label present.
    Exists,
    /// Label absent.
    DoesNotExist,
}

/// One selector expression.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Expression {
    /// Label key.
    pub key: String,
    /// Operator.
    pub operator: Operator,
    /// Values for `in` / `not_in`.
    #[serde(default)]
    pub values: Vec<String>,
}

/// Parameters of `label-selector-filter`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct LabelSelectorFilterConfig {
    /// Exact label matches.
    pub match_labels: BTreeMap<String, String>,
    /// Expressions.
    pub match_expressions: Vec<Expression>,
}

/// Keeps endpoints matching a label selector.
#[derive(Debug)]
pub struct LabelSelectorFilter {
    config: LabelSelectorFilterConfig,
}

impl LabelSelectorFilter {
    /// YAML type name.
    pub const TYPE: &'static str = "label-selector-filter";

    /// Builds the filter.
    ///
    /// # Errors
    /// [`SchedulerConfigError::InvalidParameter`] when an `in`/`not_in` expression has no values.
    pub fn new(
        config: LabelSelectorFilterConfig,
    ) -> Result<LabelSelectorFilter, SchedulerConfigError> {
        for e in &config.match_expressions {
            if matches!(e.operator, Operator::In | Operator::NotIn) && e.values.is_empty() {
                return Err(SchedulerConfigError::InvalidParameter {
                    parameter: "match_expressions",
                    reason: format!("expression on `{}` needs values", e.key),
                });
            }
        }
        Ok(LabelSelectorFilter { config })
    }

    fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        self.config
            .match_labels
            .iter()
            .all(|(k, v)| labels.get(k) == Some(v))
            && self.config.match_expressions.iter().all(|e| {
                let v = labels.get(&e.key);
                match e.operator {
                    Operator::In => v.is_some_and(|v| e.values.contains(v)),
                    Operator::NotIn => v.is_none_or(|v| !e.values.contains(v)),
                    Operator::Exists => v.is_some(),
                    Operator::DoesNotExist => v.is_none(),
                }
            })
    }
}

impl Filter for LabelSelectorFilter {
    fn filter(&self, _cycle: &CycleState, candidates: &[&EndpointState], keep: &mut [bool]) {
        for (k, e) in keep.iter_mut().zip(candidates) {
            *k = e.with_labels(|l| self.matches(l));
        }
    }
}

pub(crate) const REGISTRATION: Registration = Registration {
    type_name: LabelSelectorFilter::TYPE,
    description: "keeps endpoints whose labels match a selector (match_labels, match_expressions)",
    example: "match_labels: { pool: a }\nmatch_expressions: [{ key: zone, operator: in, values: [z1, z2] }]\n",
    build: |p, _| build(p, LabelSelectorFilter::new),
};

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_util::{ep, facts, run_filter};

    fn expr(key: &str, operator: Operator, values: &[&str]) -> Expression {
        Expression {
            key: key.into(),
            operator,
            values: values.iter().map(|s| (*s).into()).collect(),
        }
    }

    #[test]
    fn table() {
        let eps = || {
            vec![
                ep("a:1").label("pool", "a").label("zone", "z1"),
                ep("b:1").label("pool", "b"),
                ep("c:1"),
            ]
        };
        let labels = |k: &str, v: &str| [(k.to_owned(), v.to_owned())].into_iter().collect();
        let cases: Vec<(&str, LabelSelectorFilterConfig, Vec<&str>)> = vec![
            (
                "empty keeps all",
                LabelSelectorFilterConfig::default(),
                vec!["a:1", "b:1", "c:1"],
            ),
            (
                "match label",
                LabelSelectorFilterConfig {
                    match_labels: labels("pool", "a"),
                    ..Default::default()
                },
                vec!["a:1"],
            ),
            (
                "in",
                LabelSelectorFilterConfig {
                    match_expressions: vec![expr("pool", Operator::In, &["a", "b"])],
                    ..Default::default()
                },
                vec!["a:1", "b:1"],
            ),
            (
                "not in keeps missing",
                LabelSelectorFilterConfig {
                    match_expressions: vec![expr("pool", Operator::NotIn, &["a"])],
                    ..Default::default()
                },
                vec!["b:1", "c:1"],
            ),
            (
                "exists",
                LabelSelectorFilterConfig {
                    match_expressions: vec![expr("zone", Operator::Exists, &[])],
                    ..Default::default()
                },
                vec!["a:1"],
            ),
            (
                "does not exist",
                LabelSelectorFilterConfig {
                    match_expressions: vec![expr("zone", Operator::DoesNotExist, &[])],
                    ..Default::default()
                },
                vec!["b:1", "c:1"],
            ),
        ];
        for (name, cfg, want) in cases {
            let f = LabelSelectorFilter::new(cfg).unwrap();
            assert_eq!(run_filter(&f, &eps(), facts()), want, "{name}");
        }
        let bad = LabelSelectorFilterConfig {
            match_expressions: vec![expr("k", Operator::In, &[])],
            ..Default::default()
        };
        crate::test_util::assert_error_names(
            LabelSelectorFilter::new(bad),
            &["match_expressions", "`k`", "needs values"],
        );
    }
}

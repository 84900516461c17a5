//! The `InferencePool` resource (`inference.networking.k8s.io/v1`), the fields kvgate reads.
//!
//! Defined by hand with a [`kube::Resource`] impl rather than `#[derive(CustomResource)]`:
//! the derive needs kube's `derive` feature and `schemars`, and kvgate only reads pools, it
//! never generates their CRD. Unknown fields (`status`, future spec fields) are ignored.

use std::borrow::Cow;
use std::collections::BTreeMap;

use k8s_openapi::NamespaceResourceScope;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use serde::Deserialize;

/// API group of `InferencePool`.
pub const GROUP: &str = "inference.networking.k8s.io";
/// API version of `InferencePool`.
pub const VERSION: &str = "v1";

/// An `InferencePool`: the engine pods (by label selector) and their ports.
#[derive(Debug, Clone, Deserialize)]
pub struct InferencePool {
    /// Object metadata.
    pub metadata: ObjectMeta,
    /// The pool's desired state.
    #[serde(default)]
    pub spec: InferencePoolSpec,
}

/// `InferencePool.spec`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct InferencePoolSpec {
    /// Which pods (in the pool's namespace) are members.
    #[serde(default)]
    pub selector: LabelSelector,
    /// The ports of each member pod to route to; each becomes an endpoint.
    #[serde(default)]
    pub target_ports: Vec<Port>,
    /// The endpoint picker serving the pool (kvgate's Service); read for logs only.
    #[serde(default)]
    pub endpoint_picker_ref: Option<EndpointPickerRef>,
}

/// `spec.selector`: the pool API allows `matchLabels` only.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LabelSelector {
    /// Labels a member pod must all carry. Empty selects no pod (as a Service without a
    /// selector does), never the whole namespace.
    #[serde(default)]
    pub match_labels: BTreeMap<String, String>,
}

impl LabelSelector {
    /// True when `labels` carry every `matchLabels` pair (and the selector is not empty).
    pub fn matches(&self, labels: &BTreeMap<String, String>) -> bool {
        !self.match_labels.is_empty()
            && self
                .match_labels
                .iter()
                .all(|(k, v)| labels.get(k) == Some(v))
    }

    /// The selector as a Kubernetes label-selector query (`k=v,k2=v2`); `None` when empty.
    pub fn to_query(&self) -> Option<String> {
        if self.match_labels.is_empty() {
            return None;
        }
        let parts: Vec<String> = self
            .match_labels
            .iter()
            .map(|(k, v)| format!("{k}={v}"))
            .collect();
        Some(parts.join(","))
    }
}

/// `spec.targetPorts[]`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
pub struct Port {
    /// Port number on the member pods (1–65535).
    pub number: i32,
}

/// `spec.endpointPickerRef`.
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct EndpointPickerRef {
    /// API group of the referent ("" = core).
    #[serde(default)]
    pub group: Option<String>,
    /// Kind of the referent (default `Service`).
    #[serde(default)]
    pub kind: Option<String>,
    /// Name of the referent.
    #[serde(default)]
    pub name: String,
    /// Port of the picker's Service (gateways default to 9002).
    #[serde(default)]
    pub port_number: Option<i32>,
    /// `FailOpen` or `FailClose` (default).
    #[serde(default)]
    pub failure_mode: Option<String>,
}

impl kube::Resource for InferencePool {
    type DynamicType = ();
    type Scope = NamespaceResourceScope;

    fn kind(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("InferencePool")
    }
    fn group(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(GROUP)
    }
    fn version(_: &()) -> Cow<'_, str> {
        Cow::Borrowed(VERSION)
    }
    fn plural(_: &()) -> Cow<'_, str> {
        Cow::Borrowed("inferencepools")
    }
    fn meta(&self) -> &ObjectMeta {
        &self.metadata
    }
    fn meta_mut(&mut self) -> &mut ObjectMeta {
        &mut self.metadata
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use kube::Resource;

    #[test]
    fn parses_a_v1_pool_and_builds_its_url() {
        let pool: InferencePool = serde_json::from_str(
            r#"{"apiVersion":"inference.networking.k8s.io/v1","kind":"InferencePool",
                "metadata":{"name":"p","namespace":"llm","resourceVersion":"7"},
                "spec":{"selector":{"matchLabels":{"app":"vllm","tier":"gpu"}},
                        "targetPorts":[{"number":8000}],
                        "endpointPickerRef":{"name":"kvgate","portNumber":9002,"failureMode":"FailOpen"}},
                "status":{"parents":[]}}"#,
        )
        .unwrap();
        assert_eq!(pool.spec.target_ports, vec![Port { number: 8000 }]);
        assert_eq!(
            pool.spec.selector.to_query().as_deref(),
            Some("app=vllm,tier=gpu")
        );
        let epp = pool.spec.endpoint_picker_ref.unwrap();
        assert_eq!((epp.name.as_str(), epp.port_number), ("kvgate", Some(9002)));
        assert_eq!(
            InferencePool::url_path(&(), Some("llm")),
            "/apis/inference.networking.k8s.io/v1/namespaces/llm/inferencepools"
        );
        assert!(!LabelSelector::default().matches(&BTreeMap::new()));
    }
}

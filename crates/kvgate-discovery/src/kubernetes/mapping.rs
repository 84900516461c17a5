//! Pod → endpoints: which pods serve, and the endpoint each target port becomes.

use k8s_openapi::api::core::v1::Pod;
use kvgate_schedule::EndpointConfig;

use super::pool::InferencePoolSpec;
use crate::config::{KubernetesConfig, TemplateVars, render};

/// True when `pod` is Ready (condition `Ready=True`) and not being deleted.
pub fn pod_is_ready(pod: &Pod) -> bool {
    if pod.metadata.deletion_timestamp.is_some() {
        return false;
    }
    pod.status
        .as_ref()
        .and_then(|s| s.conditions.as_ref())
        .is_some_and(|cs| cs.iter().any(|c| c.type_ == "Ready" && c.status == "True"))
}

/// The endpoints `pod` contributes to `pool`: none unless its labels match the pool selector,
/// it has a pod IP, it is Ready and not terminating; else one per target port, with URL
/// `http://{podIP}:{port}`, the pod's labels, and the KV-event / replay / model templates of
/// `config` filled in.
pub fn pod_endpoints(
    pod: &Pod,
    pool: &InferencePoolSpec,
    config: &KubernetesConfig,
) -> Vec<EndpointConfig> {
    let empty = Default::default();
    let labels = pod.metadata.labels.as_ref().unwrap_or(&empty);
    if !pool.selector.matches(labels) || !pod_is_ready(pod) {
        return Vec::new();
    }
    let Some(ip) = pod
        .status
        .as_ref()
        .and_then(|s| s.pod_ip.as_deref())
        .filter(|ip| !ip.is_empty())
    else {
        return Vec::new();
    };
    let host = if ip.contains(':') {
        format!("[{ip}]")
    } else {
        ip.to_string()
    };
    let pod_name = pod.metadata.name.as_deref().unwrap_or_default();
    let namespace = pod
        .metadata
        .namespace
        .as_deref()
        .unwrap_or(config.namespace.as_str());
    pool.target_ports
        .iter()
        .filter_map(|p| u16::try_from(p.number).ok().filter(|n| *n > 0))
        .map(|port| {
            let vars = TemplateVars {
                host: &host,
                port,
                pod_name,
                namespace,
            };
            let fill = |t: &Option<String>| t.as_deref().map(|t| render(t, vars));
            EndpointConfig {
                url: format!("http://{host}:{port}"),
                labels: labels.clone(),
                kv_events: fill(&config.kv_events),
                kv_replay: fill(&config.kv_replay),
                model: fill(&config.model),
                block_size: config.block_size,
            }
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use k8s_openapi::api::core::v1::{PodCondition, PodStatus};
    use k8s_openapi::apimachinery::pkg::apis::meta::v1::{ObjectMeta, Time};

    use super::super::pool::{LabelSelector, Port};
    use super::*;

    fn labels(pairs: &[(&str, &str)]) -> BTreeMap<String, String> {
        pairs
            .iter()
            .map(|(k, v)| ((*k).to_string(), (*v).to_string()))
            .collect()
    }

    /// A Ready pod `vllm-0` at 10.0.0.7 labelled app=vllm, role=decode.
    fn base_pod() -> Pod {
        Pod {
            metadata: ObjectMeta {
                name: Some("vllm-0".into()),
                namespace: Some("llm".into()),
                labels: Some(labels(&[("app", "vllm"), ("role", "decode")])),
                ..ObjectMeta::default()
            },
            status: Some(PodStatus {
                pod_ip: Some("10.0.0.7".into()),
                conditions: Some(vec![
                    PodCondition {
                        type_: "PodScheduled".into(),
                        status: "True".into(),
                        ..PodCondition::default()
                    },
                    PodCondition {
                        type_: "Ready".into(),
                        status: "True".into(),
                        ..PodCondition::default()
                    },
                ]),
                ..PodStatus::default()
            }),
            ..Pod::default()
        }
    }

    fn pool(ports: &[i32]) -> InferencePoolSpec {
        InferencePoolSpec {
            selector: LabelSelector {
                match_labels: labels(&[("app", "vllm")]),
            },
            target_ports: ports.iter().map(|n| Port { number: *n }).collect(),
            endpoint_picker_ref: None,
        }
    }

    fn set_ready(pod: &mut Pod, status: &str) {
        for c in pod
            .status
            .as_mut()
            .unwrap()
            .conditions
            .as_mut()
            .unwrap()
            .iter_mut()
        {
            if c.type_ == "Ready" {
                c.status = status.into();
            }
        }
    }

    type Row = (
        &'static str,
        fn(&mut Pod),
        &'static [i32],
        &'static [&'static str],
    );

    #[test]
    fn one_condition_flipped_per_row() {
        let rows: &[Row] = &[
            (
                "ready pod, one port",
                |_| {},
                &[8000],
                &["http://10.0.0.7:8000"],
            ),
            ("not ready", |p| set_ready(p, "False"), &[8000], &[]),
            ("ready unknown", |p| set_ready(p, "Unknown"), &[8000], &[]),
            (
                "no Ready condition",
                |p| p.status.as_mut().unwrap().conditions = None,
                &[8000],
                &[],
            ),
            (
                "no IP",
                |p| p.status.as_mut().unwrap().pod_ip = None,
                &[8000],
                &[],
            ),
            (
                "empty IP",
                |p| p.status.as_mut().unwrap().pod_ip = Some(String::new()),
                &[8000],
                &[],
            ),
            ("no status", |p| p.status = None, &[8000], &[]),
            (
                "terminating",
                |p| p.metadata.deletion_timestamp = Some(Time(Default::default())),
                &[8000],
                &[],
            ),
            (
                "label mismatch",
                |p| {
                    p.metadata.labels = Some(labels(&[("app", "other")]));
                },
                &[8000],
                &[],
            ),
            ("no labels", |p| p.metadata.labels = None, &[8000], &[]),
            (
                "two target ports",
                |_| {},
                &[8000, 8001],
                &["http://10.0.0.7:8000", "http://10.0.0.7:8001"],
            ),
            (
                "out-of-range port skipped",
                |_| {},
                &[0, 70000, 8000],
                &["http://10.0.0.7:8000"],
            ),
            (
                "IPv6 pod",
                |p| p.status.as_mut().unwrap().pod_ip = Some("fd00::7".into()),
                &[8000],
                &["http://[fd00::7]:8000"],
            ),
        ];
        let config = KubernetesConfig::new("llm", "pool");
        for (name, flip, ports, want) in rows {
            let mut pod = base_pod();
            flip(&mut pod);
            let got: Vec<String> = pod_endpoints(&pod, &pool(ports), &config)
                .into_iter()
                .map(|e| e.url)
                .collect();
            assert_eq!(got, *want, "row `{name}`");
        }
    }

    #[test]
    fn labels_kept_and_template_placeholders_filled() {
        let config = KubernetesConfig {
            kv_events: Some("tcp://{podIP}:5557".into()),
            kv_replay: Some("tcp://{podIP}:{port}9".into()),
            model: Some("{namespace}/{podName}".into()),
            block_size: Some(64),
            ..KubernetesConfig::new("llm", "pool")
        };
        let got = pod_endpoints(&base_pod(), &pool(&[8000, 8001]), &config);
        assert_eq!(got.len(), 2);
        assert_eq!(
            got[0].labels,
            labels(&[("app", "vllm"), ("role", "decode")])
        );
        assert_eq!(got[0].kv_events.as_deref(), Some("tcp://10.0.0.7:5557"));
        assert_eq!(got[0].kv_replay.as_deref(), Some("tcp://10.0.0.7:80009"));
        assert_eq!(got[1].kv_replay.as_deref(), Some("tcp://10.0.0.7:80019"));
        assert_eq!(got[0].model.as_deref(), Some("llm/vllm-0"));
        assert_eq!(got[0].block_size, Some(64));

        let mut v6 = base_pod();
        v6.status.as_mut().unwrap().pod_ip = Some("fd00::7".into());
        let got = pod_endpoints(&v6, &pool(&[8000]), &config);
        assert_eq!(got[0].kv_events.as_deref(), Some("tcp://[fd00::7]:5557"));

        let plain = pod_endpoints(
            &base_pod(),
            &pool(&[8000]),
            &KubernetesConfig::new("llm", "p"),
        );
        assert_eq!(plain[0].kv_events, None);
        assert_eq!(plain[0].model, None);
    }
}

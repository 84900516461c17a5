#![allow(clippy::unwrap_used, clippy::expect_used)]
//! The deployment files parse: every `deploy/examples/*.yaml` document and the chart's
//! `values.yaml`/`Chart.yaml` as YAML; the example InferencePool as kvgate's pool type, naming
//! the chart's Service. With `helm` on PATH (install it with `deploy/helm/install-helm.sh`),
//! the chart is linted and rendered, every rendered document parses, and the rendered
//! `kvgate.yaml` holds a `discovery:` section that [`DiscoveryConfig`] accepts; without it
//! those checks print why they are skipped.

use std::path::{Path, PathBuf};
use std::process::Command;

use kvgate_discovery::DiscoveryConfig;
use serde_json::Value;

fn deploy() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../deploy")
}

/// The non-empty YAML documents of `text`.
fn documents(text: &str, what: &str) -> Vec<Value> {
    let docs: Vec<Value> =
        serde_saphyr::from_multiple(text).unwrap_or_else(|e| panic!("{what}: {e}"));
    docs.into_iter().filter(|d| !d.is_null()).collect()
}

fn read(path: &Path) -> String {
    std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

#[test]
fn examples_and_values_parse() {
    let mut kinds = Vec::new();
    let mut files: Vec<PathBuf> = std::fs::read_dir(deploy().join("examples"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "yaml"))
        .collect();
    files.sort();
    assert!(!files.is_empty(), "no example manifests");
    for file in &files {
        for doc in documents(&read(file), &file.display().to_string()) {
            assert!(
                doc["apiVersion"].is_string(),
                "{}: no apiVersion",
                file.display()
            );
            kinds.push(doc["kind"].as_str().unwrap().to_string());
        }
    }
    assert!(kinds.contains(&"InferencePool".to_string()), "{kinds:?}");
    assert!(kinds.contains(&"Deployment".to_string()), "{kinds:?}");

    let chart = deploy().join("helm/kvgate");
    let values = documents(&read(&chart.join("values.yaml")), "values.yaml");
    assert_eq!(values.len(), 1);
    assert_eq!(values[0]["extProc"]["port"], 9002);
    assert_eq!(values[0]["admin"]["port"], 9090);
    let meta = documents(&read(&chart.join("Chart.yaml")), "Chart.yaml");
    assert_eq!(meta[0]["name"], "kvgate");
}

#[cfg(feature = "kubernetes")]
#[test]
fn example_pool_is_a_v1_pool_naming_kvgate() {
    use kvgate_discovery::kubernetes::InferencePool;
    let text = read(&deploy().join("examples/inferencepool.yaml"));
    let pool = documents(&text, "inferencepool.yaml")
        .into_iter()
        .find(|d| d["kind"] == "InferencePool")
        .unwrap();
    assert_eq!(pool["apiVersion"], "inference.networking.k8s.io/v1");
    let pool: InferencePool = serde_json::from_value(pool).unwrap();
    assert_eq!(pool.spec.target_ports[0].number, 8000);
    assert!(!pool.spec.selector.match_labels.is_empty());
    let epp = pool.spec.endpoint_picker_ref.unwrap();
    // The Service of release `kvgate` (the chart's fullname) on the ext_proc port.
    assert_eq!((epp.name.as_str(), epp.port_number), ("kvgate", Some(9002)));
    // The vLLM stub's pods carry the pool's selector labels.
    let vllm = read(&deploy().join("examples/vllm-deployment.yaml"));
    let deployment = &documents(&vllm, "vllm-deployment.yaml")[0];
    let labels = &deployment["spec"]["template"]["metadata"]["labels"];
    for (k, v) in &pool.spec.selector.match_labels {
        assert_eq!(labels[k], *v, "pod template label {k}");
    }
}

/// `helm` on PATH, or why not.
fn helm() -> Result<(), String> {
    match Command::new("helm").arg("version").arg("--short").output() {
        Ok(out) if out.status.success() => Ok(()),
        Ok(out) => Err(format!(
            "`helm version` failed: {}",
            String::from_utf8_lossy(&out.stderr)
        )),
        Err(e) => Err(format!(
            "no helm on PATH ({e}); run deploy/helm/install-helm.sh"
        )),
    }
}

fn helm_run(args: &[&str]) -> String {
    let out = Command::new("helm").args(args).output().unwrap();
    assert!(
        out.status.success(),
        "helm {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap()
}

#[test]
fn chart_renders_valid_manifests() {
    if let Err(why) = helm() {
        println!("SKIPPED chart_renders_valid_manifests: {why}");
        return;
    }
    let chart = deploy().join("helm/kvgate");
    let chart = chart.to_str().unwrap();
    helm_run(&["lint", chart]);
    let plain = helm_run(&["template", chart]);
    let docs = documents(&plain, "helm template");
    let kinds: Vec<&str> = docs.iter().map(|d| d["kind"].as_str().unwrap()).collect();
    for kind in [
        "ServiceAccount",
        "ConfigMap",
        "Role",
        "RoleBinding",
        "Service",
        "Deployment",
    ] {
        assert!(kinds.contains(&kind), "{kind} missing from {kinds:?}");
    }
    assert!(
        !kinds.contains(&"ServiceMonitor"),
        "ServiceMonitor is opt-in"
    );

    let with = helm_run(&[
        "template",
        "kvgate",
        chart,
        "--namespace",
        "llm",
        "--set",
        "inferencePool.name=qwen",
        "--set",
        "serviceMonitor.enabled=true",
        "--set",
        "discovery.kvReplay=tcp://{podIP}:5558",
    ]);
    let docs = documents(&with, "helm template --set …");
    let find = |kind: &str| docs.iter().find(|d| d["kind"] == kind).unwrap();
    assert_eq!(
        find("ServiceMonitor")["spec"]["endpoints"][0]["port"],
        "http-admin"
    );

    // The container runs `kvgate epp` on the ext_proc port with the mounted config.
    let container = &find("Deployment")["spec"]["template"]["spec"]["containers"][0];
    let args: Vec<&str> = container["args"]
        .as_array()
        .unwrap()
        .iter()
        .map(|a| a.as_str().unwrap())
        .collect();
    assert_eq!(
        args[..7],
        [
            "epp",
            "--listen",
            "0.0.0.0:9002",
            "--admin-listen",
            "0.0.0.0:9090",
            "--config",
            "/etc/kvgate/kvgate.yaml"
        ]
    );
    assert_eq!(container["readinessProbe"]["grpc"]["port"], 9002);

    let service = find("Service");
    let grpc = &service["spec"]["ports"][0];
    assert_eq!(
        (grpc["port"].as_i64(), grpc["appProtocol"].as_str()),
        (Some(9002), Some("http2"))
    );

    // The Role lets the picker read pods and pools in the pool's namespace.
    let role = find("Role");
    assert_eq!(role["metadata"]["namespace"], "llm");
    let rules = role["rules"].to_string();
    assert!(
        rules.contains("inferencepools") && rules.contains("pods") && rules.contains("watch"),
        "{rules}"
    );

    // The generated kvgate.yaml: its discovery section is what kvgate-discovery parses.
    let kvgate_yaml = find("ConfigMap")["data"]["kvgate.yaml"].as_str().unwrap();
    let config: Value = serde_saphyr::from_str(kvgate_yaml).unwrap();
    assert_eq!(config["admin_listen"], "0.0.0.0:9090");
    let section = serde_json::to_string(&config["discovery"]).unwrap();
    let DiscoveryConfig::Kubernetes(k) = DiscoveryConfig::from_yaml(&section).unwrap() else {
        panic!("not a kubernetes discovery: {section}")
    };
    assert_eq!((k.namespace.as_str(), k.pool.as_str()), ("llm", "qwen"));
    assert_eq!(k.kv_events.as_deref(), Some("tcp://{podIP}:5557"));
    assert_eq!(k.kv_replay.as_deref(), Some("tcp://{podIP}:5558"));
    assert!(k.model.is_some(), "kv_events needs model");
}

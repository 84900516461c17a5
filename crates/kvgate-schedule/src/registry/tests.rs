use super::*;

fn registry() -> EndpointRegistry {
    let config = RegistryConfig {
        scrape_interval_ms: 0,
        ..RegistryConfig::default()
    };
    let handles = RegistryHandles::unregistered();
    EndpointRegistry::new(config, handles).unwrap()
}

#[tokio::test]
async fn reconcile_keeps_identity_and_drops_removed() {
    let r = registry();
    let a = EndpointConfig::new("http://a:1");
    let b = EndpointConfig::new("http://b:1");
    let rep = r.reconcile(&[a.clone(), b.clone()]).unwrap();
    assert_eq!(rep.added.len(), 2);
    let a_state = r.get("a:1").unwrap();
    let b_state = r.get("b:1").unwrap();
    let guard = b_state.begin_request(5, 5);
    r.kv_index().record_routing(
        b_state.kv_id(),
        &kvgate_kvcache::block_keys(
            &[1; 32],
            16,
            kvgate_kvcache::KeyScope {
                model: "m",
                cache_salt: None,
            },
        ),
    );
    assert_eq!(r.kv_index().holdings(b_state.kv_id()), 2);

    let mut a2 = a.clone();
    a2.labels.insert("zone".into(), "z1".into());
    let c = EndpointConfig::new("http://c:1/prefix");
    let rep = r.reconcile(&[a2, c]).unwrap();
    assert_eq!(
        rep,
        ReconcileReport {
            added: vec!["http://c:1/prefix".into()],
            removed: vec!["http://b:1".into()],
            kept: vec!["http://a:1".into()]
        }
    );
    assert!(
        Arc::ptr_eq(&a_state, &r.get("a:1").unwrap()),
        "same state object"
    );
    assert_eq!(
        a_state.label("zone").as_deref(),
        Some("z1"),
        "labels updated in place"
    );
    assert!(r.get("b:1").is_none());
    assert_eq!(
        r.kv_index().holdings(b_state.kv_id()),
        0,
        "removed endpoint's holdings dropped"
    );
    assert_eq!(
        b_state.in_flight_requests(),
        1,
        "in-flight request unaffected"
    );
    drop(guard);
    let names: Vec<String> = r.endpoints().iter().map(|e| e.name().to_owned()).collect();
    assert_eq!(names, vec!["a:1", "c:1"]);

    let mut kv = EndpointConfig::new("http://a:1");
    kv.kv_events = Some("tcp://127.0.0.1:1".into());
    kv.model = Some("m".into());
    let rep = r.reconcile(&[kv]).unwrap();
    assert_eq!(
        rep.added,
        vec!["http://a:1".to_owned()],
        "changed kv settings restart the endpoint"
    );
    assert!(r.has_kv_events());
}

#[tokio::test]
async fn reconcile_validates_before_changing() {
    let r = registry();
    r.reconcile(&[EndpointConfig::new("http://a:1")]).unwrap();
    let mut zero = EndpointConfig::new("http://z:1");
    zero.block_size = Some(0);
    let cases = [
        (
            "bad url",
            vec![EndpointConfig::new("ftp://x:1")],
            "only http",
        ),
        (
            "duplicate",
            vec![
                EndpointConfig::new("http://d:1"),
                EndpointConfig::new("http://d:1"),
            ],
            "twice",
        ),
        ("zero block size", vec![zero], "block_size"),
    ];
    for (name, list, word) in cases {
        let e = r.reconcile(&list).unwrap_err().to_string();
        assert!(e.contains(word), "{name}: {e}");
        assert_eq!(r.endpoints().len(), 1, "{name}: unchanged");
    }
}

#[tokio::test]
async fn realized_counters_and_snapshot() {
    let r = registry();
    r.reconcile(&[EndpointConfig::new("http://a:1")]).unwrap();
    let a = r.get("a:1").unwrap();
    r.record_realized(&a, 64, 64);
    r.record_realized(&a, 64, 0);
    let snap = r.snapshot(Instant::now());
    let e = &snap.endpoints[0];
    assert_eq!(
        (
            e.reported_requests,
            e.predicted_tokens,
            e.realized_tokens,
            e.mispredicted_requests
        ),
        (2, 128, 64, 1)
    );
    assert!(e.metrics_stale && e.healthy);
    let json = serde_json::to_value(&snap).unwrap();
    assert_eq!(json["endpoints"][0]["realized_tokens"], 64);
}

/// `kv_events` without `model` is accepted: not subscribed (no precise holdings) until the
/// engine names its model, then restarted with a subscription keyed by that model; the
/// engine's block size replaces the default.
#[tokio::test]
async fn kv_endpoint_without_model_waits_for_discovery() {
    let r = registry();
    let mut c = EndpointConfig::new("http://k:1");
    c.kv_events = Some("tcp://127.0.0.1:1".into());
    r.reconcile(std::slice::from_ref(&c)).unwrap();
    let before = r.get("k:1").unwrap();
    assert!(
        !before.has_kv_events(),
        "no model yet: not scored precisely"
    );
    assert!(
        !r.apply_discovered("http://k:1", None, None, None),
        "nothing new"
    );
    let models = vec![crate::ServedModel {
        id: "m".into(),
        parent: None,
    }];
    let scraped = crate::EngineMetrics {
        block_size: Some(32),
        ..crate::EngineMetrics::default()
    };
    assert!(r.apply_discovered(
        "http://k:1",
        Some(models.clone()),
        Some(4096),
        Some(&scraped)
    ));
    let after = r.get("k:1").unwrap();
    assert!(after.has_kv_events(), "subscribed once the model is known");
    assert_eq!(after.index_block_size(), 32, "the engine's block size");
    assert_eq!(after.serves("m"), Some(true));
    assert!(
        !r.apply_discovered("http://k:1", Some(models), Some(4096), Some(&scraped)),
        "same facts: kept"
    );
    // A config reload with the same endpoint keeps the discovered settings and the state.
    let report = r.reconcile(&[c]).unwrap();
    assert_eq!(report.kept, vec!["http://k:1".to_owned()]);
    assert!(Arc::ptr_eq(&after, &r.get("k:1").unwrap()));
}

/// An endpoint with no `kv_events` subscribes to what its engine's `/kv_event_sources`
/// names; an unreadable answer keeps it; another source moves the subscription; an engine
/// reporting none drops it.
#[tokio::test]
async fn discovered_kv_sources_start_and_move_the_subscription() {
    let r = registry();
    r.reconcile(&[EndpointConfig::new("http://127.0.0.1:1")])
        .unwrap();
    let sources = |port: u16| {
        crate::parse_kv_event_sources(
            format!(r#"{{"0":{{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:{port}","topic":"t"}}}}"#).as_bytes(),
            "127.0.0.1",
        )
    };
    let report = |kv: crate::KvSourcesRead| EngineReport {
        models: Some(vec![crate::ServedModel {
            id: "m".into(),
            parent: None,
        }]),
        kv_sources: Some(kv),
        ..EngineReport::default()
    };
    assert!(r.apply_report("http://127.0.0.1:1", report(sources(5557))));
    let first = r.get("127.0.0.1:1").unwrap();
    assert!(first.has_kv_events(), "subscribed to the discovered source");
    let (source, said) = r.kv_source("http://127.0.0.1:1");
    let source = source.unwrap();
    assert_eq!(
        (source.origin, source.events.as_str(), source.topic.as_str()),
        (KvOrigin::Discovered, "tcp://127.0.0.1:5557", "t")
    );
    assert_eq!(
        said.as_deref(),
        Some("rank 0 tcp://127.0.0.1:5557, no replay, topic \"t\"")
    );

    let unreadable = crate::KvSourcesRead::Unreadable("status 503".into());
    assert!(
        !r.apply_report("http://127.0.0.1:1", report(unreadable)),
        "kept"
    );
    assert!(Arc::ptr_eq(&first, &r.get("127.0.0.1:1").unwrap()));
    assert_eq!(
        r.kv_source("http://127.0.0.1:1").1.as_deref(),
        Some("not read: status 503")
    );

    assert!(
        r.apply_report("http://127.0.0.1:1", report(sources(6000))),
        "moved"
    );
    let (source, _) = r.kv_source("http://127.0.0.1:1");
    assert_eq!(source.unwrap().events, "tcp://127.0.0.1:6000");
    assert!(r.get("127.0.0.1:1").unwrap().has_kv_events());

    let none = crate::parse_kv_event_sources(b"{}", "127.0.0.1");
    assert!(
        r.apply_report("http://127.0.0.1:1", report(none)),
        "dropped"
    );
    assert!(!r.get("127.0.0.1:1").unwrap().has_kv_events());
    assert_eq!(r.kv_source("http://127.0.0.1:1").0, None);
}

/// A configured `kv_events` wins over a contradicting discovered one, and the contradiction
/// is counted once however often the engine repeats it.
#[tokio::test]
async fn configured_kv_events_win_and_a_contradiction_counts_once() {
    let r = registry();
    let mut c = EndpointConfig::new("http://127.0.0.1:2");
    c.kv_events = Some("tcp://127.0.0.1:7000".into());
    c.model = Some("m".into());
    r.reconcile(&[c]).unwrap();
    let engine = || EngineReport {
        kv_sources: Some(crate::parse_kv_event_sources(
            br#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557"}}"#,
            "127.0.0.1",
        )),
        ..EngineReport::default()
    };
    assert!(
        !r.apply_report("http://127.0.0.1:2", engine()),
        "configured: kept"
    );
    assert!(!r.apply_report("http://127.0.0.1:2", engine()));
    let (source, _) = r.kv_source("http://127.0.0.1:2");
    let source = source.unwrap();
    assert_eq!(
        (source.origin, source.events.as_str()),
        (KvOrigin::Configured, "tcp://127.0.0.1:7000")
    );
    assert_eq!(r.conflicts.count("127.0.0.1:2", "kv_events"), 1);
}

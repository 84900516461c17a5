use super::*;

pub(crate) fn endpoint(url: &str, labels: &[(&str, &str)]) -> Arc<EndpointState> {
    let init = EndpointInit {
        labels: labels
            .iter()
            .map(|(k, v)| ((*k).into(), (*v).into()))
            .collect(),
        policy: HealthPolicy {
            failure_threshold: 2,
            ..HealthPolicy::default()
        },
        stale_after: Duration::from_millis(500),
        kv_id: EndpointId(0),
        index_block_size: 16,
        has_kv_events: false,
    };
    Arc::new(EndpointState::new(url, init).unwrap())
}

#[test]
fn urls() {
    let e = endpoint("http://h:1/prefix/", &[]);
    assert_eq!(e.name(), "h:1");
    assert_eq!(
        e.uri_for("/v1/models").unwrap().to_string(),
        "http://h:1/prefix/v1/models"
    );
    let e = endpoint("https://h:1/prefix", &[]);
    assert_eq!(e.name(), "h:1");
    assert_eq!(
        e.uri_for("/v1/models").unwrap().to_string(),
        "https://h:1/prefix/v1/models"
    );
    // No prefix: the path and query as given.
    let e = endpoint("http://h:1", &[]);
    assert_eq!(
        e.uri_for("/v1/x?q=1").unwrap().to_string(),
        "http://h:1/v1/x?q=1"
    );
    assert_eq!(e.host_header(), "h:1");
    assert!(e.uri_for("/a b").is_err());
    // An already parsed path and query gives the same URI as its text, with and without a
    // prefix.
    for url in ["http://h:1", "http://h:1/prefix/", "https://h:1/p"] {
        let e = endpoint(url, &[]);
        for pq in ["/v1/x?q=1", "/", "/v1/chat/completions"] {
            let parsed: http::uri::PathAndQuery = pq.parse().unwrap();
            assert_eq!(
                e.uri_for_parsed(&parsed).unwrap(),
                e.uri_for(pq).unwrap(),
                "{url} {pq}"
            );
        }
    }
    let cases = [
        ("ftp://h:1", "only http:// and https://"),
        ("h:1", "missing scheme"),
        ("http://", "not a valid URL"),
        ("http://h:1/?q=1", "query string"),
        ("not a url", "not a valid URL"),
    ];
    for (bad, reason) in cases {
        crate::test_util::assert_error_names(split_url(bad), &[bad, reason]);
    }
}

#[test]
fn health_threshold_backoff_and_reprobe() {
    let e = endpoint("http://h:1", &[]);
    let t0 = Instant::now();
    let s = Duration::from_secs(1);
    assert_eq!(e.record_failure(t0), None, "under threshold");
    assert!(e.is_healthy(t0));
    assert_eq!(e.record_failure(t0), Some(s));
    assert!(!e.is_healthy(t0));
    assert!(e.is_healthy(t0 + s), "half-open after the period");
    assert_eq!(e.record_failure(t0), Some(2 * s));
    assert_eq!(e.record_failure(t0), Some(4 * s));
    e.record_success();
    assert!(e.is_healthy(t0));
    assert_eq!(e.consecutive_failures(), 0);
    // Successes while healthy change nothing; failures after one count from zero again.
    e.record_success();
    assert_eq!(e.record_failure(t0), None, "under threshold again");
    assert_eq!(e.record_failure(t0), Some(s), "ejected again");
    assert!(!e.is_healthy(t0));
}

#[test]
fn metrics_staleness() {
    let e = endpoint("http://h:1", &[]);
    let t0 = Instant::now();
    let view = |now| {
        e.with_metrics(now, |m| {
            format!("{m:?}").split('(').next().map(str::to_owned)
        })
    };
    assert_eq!(view(t0).as_deref(), Some("Missing"));
    e.store_metrics(EngineMetrics::default(), t0);
    assert_eq!(view(t0).as_deref(), Some("Fresh"));
    assert_eq!(
        view(t0 + Duration::from_millis(600)).as_deref(),
        Some("Stale")
    );
    e.mark_scrape_failed();
    assert_eq!(
        view(t0).as_deref(),
        Some("Stale"),
        "a failed scrape is stale at once"
    );
}

#[test]
fn roles_from_labels() {
    for (v, want) in [
        (Some("prefill"), Role::Prefill),
        (Some("decode"), Role::Decode),
        (Some("prefill-decode"), Role::Both),
        (Some("both"), Role::Both),
        (Some("weird"), Role::Unlabelled),
        (None, Role::Unlabelled),
    ] {
        assert_eq!(Role::from_label(v), want, "{v:?}");
    }
    let e = endpoint("http://h:1", &[(ROLE_LABEL, "prefill")]);
    assert_eq!(e.role(), Role::Prefill);
    e.set_labels([(ROLE_LABEL.to_owned(), "decode".to_owned())].into());
    assert_eq!(e.role(), Role::Decode);
}

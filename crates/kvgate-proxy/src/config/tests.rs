use std::path::PathBuf;

use super::*;

#[test]
fn parses_the_documented_shape() {
    let yaml = "listen: 127.0.0.1:8080\nendpoints:\n  - url: http://10.0.0.1:8000\nmodels:\n  - name: Qwen/Qwen3-0.6B\n    aliases: [qwen, small]\n";
    let file = FileConfig::from_yaml(yaml).unwrap();
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&file).unwrap();
    assert_eq!(cfg.endpoints[0].url, "http://10.0.0.1:8000");
    assert!(cfg.scheduler.is_empty());
    assert_eq!(cfg.aliases["qwen"], "Qwen/Qwen3-0.6B");
    assert_eq!(cfg.aliases["small"], "Qwen/Qwen3-0.6B");
    assert_eq!(cfg.models, vec!["Qwen/Qwen3-0.6B".to_owned()]);
}

#[test]
fn unknown_key_error_names_the_line() {
    let yaml = "listen: 127.0.0.1:8080\nendpoints:\n  - url: http://a:1\n    weight: 3\n";
    let err = FileConfig::from_yaml(yaml).unwrap_err().to_string();
    assert!(err.contains("weight"), "{err}");
    assert!(err.contains('4'), "line 4 not named: {err}");
}

#[test]
fn full_shape_with_tokenizer_kv_events_and_plugins() {
    let yaml = "endpoints:\n  - url: http://a:1\n    kv_events: tcp://a:5557\n    model: m\nmodels:\n  - name: m\n    aliases: [x]\n    tokenizer: { local: /tok, render: http://a:1 }\nplugins:\n  - type: queue-scorer\ntokenize: { pool_threads: 3 }\n";
    let file = FileConfig::from_yaml(yaml).unwrap();
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&file).unwrap();
    assert_eq!(cfg.endpoints[0].kv_events.as_deref(), Some("tcp://a:5557"));
    assert_eq!(cfg.tokenize.pool_threads, 3);
    assert_eq!(
        cfg.tokenize.models[0].tokenizer_dir,
        Some(PathBuf::from("/tok"))
    );
    assert_eq!(
        cfg.tokenize.models[0].render_url.as_deref(),
        Some("http://a:1")
    );
    assert_eq!(cfg.scheduler.plugins.len(), 1);
}

#[test]
fn endpoint_flags() {
    let mut cfg = ProxyConfig::default();
    cfg.add_endpoint_flag("http://a:1,kv=tcp://a:5557,replay=tcp://a:5558,label=role=decode")
        .unwrap();
    cfg.add_alias("x", "m").unwrap();
    cfg.default_endpoint_models();
    let ep = &cfg.endpoints[0];
    assert_eq!(ep.url, "http://a:1");
    assert_eq!(ep.kv_events.as_deref(), Some("tcp://a:5557"));
    assert_eq!(ep.kv_replay.as_deref(), Some("tcp://a:5558"));
    assert_eq!(ep.model.as_deref(), Some("m"));
    assert_eq!(ep.labels["role"], "decode");
    for (bad, reason) in [
        ("", "missing URL"),
        ("http://a:1,bogus=1", "unknown option"),
        ("http://a:1,kv", "options are KEY=VALUE"),
        ("http://a:1,label=x", "label is label=KEY=VALUE"),
        ("http://a:1,block_size=0", "block_size must be"),
        ("http://a:1,block_size=x", "block_size must be"),
    ] {
        let err = cfg.add_endpoint_flag(bad).unwrap_err();
        assert!(
            matches!(&err, ConfigError::BadEndpointFlag { flag, .. } if flag == bad),
            "{bad}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains(&format!("`{bad}`")), "{bad}: {msg}");
        assert!(msg.contains(reason), "{bad}: {msg}");
    }
}

#[test]
fn alias_conflicts_and_flags() {
    let mut cfg = ProxyConfig::default();
    cfg.add_alias_flag("a=m1").unwrap();
    cfg.add_alias_flag("a=m1").unwrap();
    let err = cfg.add_alias_flag("a=m2").unwrap_err();
    assert!(
        matches!(&err, ConfigError::AmbiguousAlias { alias, first, second }
            if alias == "a" && first == "m1" && second == "m2"),
        "{err:?}"
    );
    assert_eq!(
        err.to_string(),
        "alias `a` is ambiguous: it maps to `m1` and `m2`"
    );
    for bad in ["nomodel", "=m", "a="] {
        let err = cfg.add_alias_flag(bad).unwrap_err();
        assert!(
            matches!(&err, ConfigError::BadAliasFlag(flag) if flag == bad),
            "{bad}: {err:?}"
        );
        assert!(err.to_string().contains(&format!("`{bad}`")), "{err}");
    }
}

#[test]
fn kv_index_and_upstream_sections() {
    let yaml = "kv_index:\n  default_capacity_blocks: 4096\n  speculative_ttl_ms: 500\n  tier_weights: { cpu: 0.5 }\n  gallop: false\nupstream: { connect_timeout_ms: 250, pool_idle_timeout_ms: 1000 }\n";
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&FileConfig::from_yaml(yaml).unwrap())
        .unwrap();
    assert_eq!(cfg.kv_index.default_capacity_blocks, 4096);
    assert_eq!(cfg.kv_index.speculative_ttl, Duration::from_millis(500));
    let w = cfg.kv_index.tier_weights;
    assert_eq!((w.gpu, w.cpu, w.disk), (1.0, 0.5, 0.5));
    assert!(!cfg.kv_index.gallop);
    assert_eq!(cfg.connect_timeout, Duration::from_millis(250));
    assert_eq!(cfg.pool_idle_timeout, Duration::from_millis(1000));

    // Absent sections keep the documented defaults, which are the runtime defaults.
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&FileConfig::default()).unwrap();
    let (d, ix) = (ProxyConfig::default(), IndexConfig::default());
    assert_eq!(cfg.connect_timeout, Duration::from_secs(5));
    assert_eq!(cfg.pool_idle_timeout, Duration::from_secs(90));
    assert_eq!(
        (cfg.connect_timeout, cfg.pool_idle_timeout),
        (d.connect_timeout, d.pool_idle_timeout)
    );
    assert_eq!(
        cfg.kv_index.default_capacity_blocks,
        ix.default_capacity_blocks
    );
    assert_eq!(cfg.kv_index.speculative_ttl, ix.speculative_ttl);
    assert_eq!(cfg.kv_index.tier_weights, ix.tier_weights);
    assert_eq!(cfg.kv_index.gallop, ix.gallop);

    let err = FileConfig::from_yaml("upstream: { connect_timeout: 5 }\n")
        .unwrap_err()
        .to_string();
    assert!(err.contains("connect_timeout"), "{err}");
}

/// Each row sets one value out of range; the error names exactly that field.
#[test]
fn out_of_range_settings_name_their_field() {
    let cases: [(&str, &str); 8] = [
        (
            "limits: { max_inflight_body_bytes: 0 }",
            "limits.max_inflight_body_bytes",
        ),
        (
            "upstream: { connect_timeout_ms: 0 }",
            "upstream.connect_timeout_ms",
        ),
        (
            "upstream: { pool_idle_timeout_ms: 0 }",
            "upstream.pool_idle_timeout_ms",
        ),
        (
            "kv_index: { default_capacity_blocks: 0 }",
            "kv_index.default_capacity_blocks",
        ),
        (
            "kv_index: { speculative_ttl_ms: 0 }",
            "kv_index.speculative_ttl_ms",
        ),
        (
            "kv_index: { tier_weights: { gpu: -1.0 } }",
            "kv_index.tier_weights.gpu",
        ),
        (
            "kv_index: { tier_weights: { cpu: .nan } }",
            "kv_index.tier_weights.cpu",
        ),
        (
            "kv_index: { tier_weights: { disk: .inf } }",
            "kv_index.tier_weights.disk",
        ),
    ];
    for (yaml, field) in cases {
        let file = FileConfig::from_yaml(yaml).unwrap_or_else(|e| panic!("{yaml}: {e}"));
        let err = ProxyConfig::default().merge_file(&file).unwrap_err();
        match &err {
            ConfigError::Invalid(issues) => {
                let fields: Vec<&str> = issues.iter().map(|i| i.field).collect();
                assert_eq!(fields, [field], "{yaml}");
            }
            other => panic!("{yaml}: {other:?}"),
        }
        assert!(err.to_string().contains(field), "{yaml}: {err}");
    }
    // Every issue is reported at once.
    let cfg = ProxyConfig {
        connect_timeout: Duration::ZERO,
        pool_idle_timeout: Duration::ZERO,
        ..ProxyConfig::default()
    };
    let err = cfg.validate().unwrap_err().to_string();
    assert_eq!(
        err,
        "config: upstream.connect_timeout_ms: must be greater than 0; \
         upstream.pool_idle_timeout_ms: must be greater than 0"
    );
}

/// `tls:` needs both files and no other key; `limits:` and `upstream.ca_file` reach the
/// runtime config; nothing set keeps plain HTTP and the 1 GiB budget.
#[test]
fn tls_limits_and_upstream_ca_sections() {
    let yaml = "tls: { cert_file: /c.pem, key_file: /k.pem }\n\
                limits: { max_inflight_body_bytes: 4096 }\n\
                upstream: { ca_file: /ca.pem }\n";
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&FileConfig::from_yaml(yaml).unwrap())
        .unwrap();
    assert_eq!(
        cfg.tls,
        Some(ListenerTls {
            cert_file: "/c.pem".into(),
            key_file: "/k.pem".into(),
        })
    );
    assert_eq!(cfg.max_inflight_body_bytes, 4096);
    assert_eq!(cfg.upstream_ca, Some(PathBuf::from("/ca.pem")));

    let mut plain = ProxyConfig::default();
    plain
        .merge_file(&FileConfig::from_yaml("{}").unwrap())
        .unwrap();
    assert_eq!(
        (plain.tls, plain.upstream_ca, plain.max_inflight_body_bytes),
        (None, None, DEFAULT_MAX_INFLIGHT_BODY_BYTES)
    );

    for (yaml, names) in [
        ("tls: { cert_file: /c.pem }", "missing field `key_file`"),
        (
            "tls: { cert_file: /c.pem, key_file: /k.pem, ca: x }",
            "unknown field `ca`",
        ),
        (
            "limits: { max_body_bytes: 1 }",
            "unknown field `max_body_bytes`",
        ),
    ] {
        let err = FileConfig::from_yaml(yaml).unwrap_err().to_string();
        assert!(err.contains(names), "{yaml}: {err}");
    }
}

#[test]
fn timeouts_and_admin_token_from_yaml() {
    let yaml = "endpoints:\n  - url: http://a:1\ntimeouts: { body_read_ms: 300, idle_ms: 400 }\nadmin_token: t0k\n";
    let file = FileConfig::from_yaml(yaml).unwrap();
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&file).unwrap();
    assert_eq!(cfg.timeouts.body_read, Duration::from_millis(300));
    assert_eq!(cfg.timeouts.idle, Duration::from_millis(400));
    assert_eq!(cfg.timeouts.header_read, DEFAULT_HEADER_READ_TIMEOUT);
    assert_eq!(cfg.timeouts.stream_idle, DEFAULT_STREAM_IDLE_TIMEOUT);
    assert_eq!(cfg.admin_token.as_deref(), Some("t0k"));

    let zero = FileConfig::from_yaml("timeouts: { stream_idle_ms: 0 }\n").unwrap();
    let err = ProxyConfig::default()
        .merge_file(&zero)
        .unwrap_err()
        .to_string();
    assert!(err.contains("timeouts.stream_idle_ms"), "{err}");
    let unknown = FileConfig::from_yaml("timeouts: { body_ms: 1 }\n").unwrap_err();
    assert!(unknown.to_string().contains("body_ms"), "{unknown}");
}

#[test]
fn block_size_and_render_flags() {
    let mut cfg = ProxyConfig::default();
    cfg.add_endpoint_flag("http://a:1,kv=tcp://a:5557,block_size=32")
        .unwrap();
    assert_eq!(cfg.endpoints[0].block_size, Some(32));
    assert_eq!(
        cfg.endpoints[0].model, None,
        "no model: the engine names it"
    );
    // `--render` after `--tokenizer` for the same model keeps the local tokenizer first.
    cfg.set_tokenizer(
        "m",
        &TokenizerSpec {
            local: Some("/t".into()),
            render: None,
            backends: None,
            render_timeout_ms: None,
            render_media_timeout_ms: None,
        },
    );
    cfg.add_render_flag("m=http://r:1").unwrap();
    cfg.add_render_flag("n=http://r:2").unwrap();
    let m = cfg.tokenize.models.iter().find(|c| c.model == "m").unwrap();
    assert_eq!(
        (m.tokenizer_dir.as_deref(), m.render_url.as_deref()),
        (Some(std::path::Path::new("/t")), Some("http://r:1"))
    );
    let n = cfg.tokenize.models.iter().find(|c| c.model == "n").unwrap();
    assert_eq!(
        (n.tokenizer_dir.as_deref(), n.render_url.as_deref()),
        (None, Some("http://r:2"))
    );
    assert_eq!(cfg.models, vec!["m".to_owned(), "n".to_owned()]);
    let err = cfg.add_render_flag("nourl").unwrap_err();
    assert!(err.to_string().contains("render flag `nourl`"), "{err}");
}

#[test]
fn flow_control_section_parses_with_defaults_and_is_off_without_it() {
    let base = "endpoints:\n  - url: http://a:1\n";
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&FileConfig::from_yaml(base).unwrap())
        .unwrap();
    assert_eq!(cfg.flow_control, None);

    let yaml = format!(
        "{base}flow_control:\n  max_in_flight: 8\n  max_in_flight_per_endpoint: 2\n  queue: {{ ttl_ms: 500 }}\n  objectives: {{ critical: 10, batch: -1 }}\n"
    );
    let mut cfg = ProxyConfig::default();
    cfg.merge_file(&FileConfig::from_yaml(&yaml).unwrap())
        .unwrap();
    let fc = cfg.flow_control.unwrap();
    assert_eq!(fc.max_in_flight, Some(8));
    assert_eq!(fc.max_in_flight_per_endpoint, Some(2));
    assert_eq!(fc.queue.ttl_ms, 500);
    assert_eq!(fc.queue.max_requests, 1000, "default queue size");
    assert_eq!(fc.objectives["batch"], -1);
    assert_eq!((fc.default_priority, fc.retry_after_s), (0, 1));
}

#[test]
fn bad_flow_control_values_give_clear_errors() {
    let base = "endpoints:\n  - url: http://a:1\n";
    for (section, expect) in [
        (
            "flow_control: {}",
            "set max_in_flight or max_in_flight_per_endpoint",
        ),
        (
            "flow_control: { max_in_flight: 0 }",
            "flow_control.max_in_flight: must be greater than 0",
        ),
        (
            "flow_control: { max_in_flight_per_endpoint: 0 }",
            "flow_control.max_in_flight_per_endpoint: must be greater than 0",
        ),
        (
            "flow_control: { max_in_flight: 1, queue: { ttl_ms: 0 } }",
            "flow_control.queue.ttl_ms: must be greater than 0",
        ),
        (
            "flow_control: { max_in_flight: 1, retry_after_s: 0 }",
            "flow_control.retry_after_s: must be greater than 0",
        ),
    ] {
        let file = FileConfig::from_yaml(&format!("{base}{section}\n")).unwrap();
        let err = ProxyConfig::default()
            .merge_file(&file)
            .unwrap_err()
            .to_string();
        assert!(err.contains(expect), "{section}: {err}");
    }
    for (section, expect) in [
        (
            "flow_control: { max_inflight: 1 }",
            "unknown field `max_inflight`",
        ),
        ("flow_control: { max_in_flight: -1 }", "line 3 column 32"),
        (
            "flow_control: { max_in_flight: 1, objectives: { a: high } }",
            "invalid i32",
        ),
    ] {
        // Shape errors name the line and column.
        let err = FileConfig::from_yaml(&format!("{base}{section}\n"))
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(expect) && err.contains("line 3"),
            "{section}: {err}"
        );
    }
}

#[test]
fn tracing_section_turns_otlp_on_and_rejects_what_cannot_export() {
    /// The endpoint tracing ends up with, or a piece of the error.
    type Want = Result<Option<&'static str>, &'static str>;
    // (name, YAML, flag already set, want)
    let cases: [(&str, &str, Option<&str>, Want); 6] = [
        ("absent: off", "", None, Ok(None)),
        ("empty section: off", "tracing: {}\n", None, Ok(None)),
        (
            "set",
            "tracing: { otlp_endpoint: http://c:4318 }\n",
            None,
            Ok(Some("http://c:4318")),
        ),
        (
            "the flag wins",
            "tracing: { otlp_endpoint: http://c:4318 }\n",
            Some("http://flag:4318"),
            Ok(Some("http://flag:4318")),
        ),
        (
            "https is not built in",
            "tracing: { otlp_endpoint: https://c:4318 }\n",
            None,
            Err("tracing.otlp_endpoint: must be an http:// URL"),
        ),
        (
            "not a URL",
            "tracing: { otlp_endpoint: 'c 4318' }\n",
            None,
            Err("tracing.otlp_endpoint"),
        ),
    ];
    for (name, yaml, flag, want) in cases {
        let file = FileConfig::from_yaml(yaml).unwrap_or_else(|e| panic!("{name}: {e}"));
        let mut cfg = ProxyConfig {
            otlp_endpoint: flag.map(str::to_owned),
            ..ProxyConfig::default()
        };
        match (cfg.merge_file(&file), want) {
            (Ok(()), Ok(endpoint)) => assert_eq!(cfg.otlp_endpoint.as_deref(), endpoint, "{name}"),
            (Err(e), Err(piece)) => assert!(e.to_string().contains(piece), "{name}: {e}"),
            (got, want) => panic!("{name}: got {got:?}, want {want:?}"),
        }
    }
    let unknown = FileConfig::from_yaml("tracing: { endpoint: http://c:4318 }\n").unwrap_err();
    assert!(unknown.to_string().contains("endpoint"), "{unknown}");
}

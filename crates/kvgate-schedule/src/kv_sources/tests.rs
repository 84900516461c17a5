use super::*;

/// vLLM 0.33's answer for one rank with `--kv-events-config
/// '{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558"}'`.
const VLLM: &str = r#"{"0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":"tcp://*:5558","buffer_steps":10000,"hwm":100000,"max_queue_size":100000,"topic":""}}"#;

/// `VLLM` with rank 0's `field` set to `value` (JSON), or removed for `None`.
fn with(field: &str, value: Option<&str>) -> String {
    let mut v: Value = serde_json::from_str(VLLM).unwrap_or_default();
    if let Some(rank) = v.get_mut("0").and_then(Value::as_object_mut) {
        match value {
            Some(json) => {
                rank.insert(field.into(), serde_json::from_str(json).unwrap_or_default());
            }
            None => {
                rank.remove(field);
            }
        }
    }
    v.to_string()
}

fn src(rank: u32, events: &str, replay: Option<&str>, topic: &str, sub: bool) -> KvEventSource {
    KvEventSource {
        rank,
        events: events.into(),
        replay: replay.map(str::to_owned),
        topic: topic.into(),
        host_substituted: sub,
    }
}

/// What one read yields, one condition flipped per row.
#[test]
fn answers_and_their_sources() {
    enum Want {
        Sources(Vec<KvEventSource>, usize),
        NoSource(&'static str),
        Unreadable(&'static str),
    }
    use Want::*;
    let both = |host: &str| {
        Sources(
            vec![src(
                0,
                &format!("tcp://{host}:5557"),
                Some(&format!("tcp://{host}:5558")),
                "",
                true,
            )],
            0,
        )
    };
    let two_ranks = r#"{"1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5558","replay_endpoint":null,"topic":"t"},
                        "0":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5557","replay_endpoint":null,"topic":"t"}}"#;
    let rows: Vec<(&str, String, &str, Want)> = vec![
        ("vLLM's answer, wildcard `*`", VLLM.into(), "10.0.0.1", both("10.0.0.1")),
        ("0.0.0.0 is a wildcard", with("endpoint", Some(r#""tcp://0.0.0.0:5557""#)), "e",
            Sources(vec![src(0, "tcp://e:5557", Some("tcp://e:5558"), "", true)], 0)),
        ("[::] is a wildcard", with("endpoint", Some(r#""tcp://[::]:5557""#)), "e",
            Sources(vec![src(0, "tcp://e:5557", Some("tcp://e:5558"), "", true)], 0)),
        (":: unbracketed is a wildcard", with("endpoint", Some(r#""tcp://:::5557""#)), "e",
            Sources(vec![src(0, "tcp://e:5557", Some("tcp://e:5558"), "", true)], 0)),
        ("an empty host is a wildcard", with("endpoint", Some(r#""tcp://:5557""#)), "e",
            Sources(vec![src(0, "tcp://e:5557", Some("tcp://e:5558"), "", true)], 0)),
        ("an IPv6 engine host is bracketed", VLLM.into(), "fd00::1", both("[fd00::1]")),
        ("an IPv6 engine host already bracketed", VLLM.into(), "[fd00::1]", both("[fd00::1]")),
        ("a specific host is kept", with("endpoint", Some(r#""tcp://10.9.9.9:6000""#)), "e",
            Sources(vec![src(0, "tcp://10.9.9.9:6000", Some("tcp://e:5558"), "", false)], 0)),
        ("a specific IPv6 host is kept", with("endpoint", Some(r#""tcp://[fd00::9]:6000""#)), "e",
            Sources(vec![src(0, "tcp://[fd00::9]:6000", Some("tcp://e:5558"), "", false)], 0)),
        ("no replay endpoint", with("replay_endpoint", Some("null")), "e",
            Sources(vec![src(0, "tcp://e:5557", None, "", true)], 0)),
        ("replay endpoint missing", with("replay_endpoint", None), "e",
            Sources(vec![src(0, "tcp://e:5557", None, "", true)], 0)),
        ("a bad replay endpoint is ignored with a note", with("replay_endpoint", Some(r#""ipc:///tmp/r""#)), "e",
            Sources(vec![src(0, "tcp://e:5557", None, "", true)], 1)),
        ("the topic is kept", with("topic", Some(r#""kv@e:8000@m""#)), "e",
            Sources(vec![src(0, "tcp://e:5557", Some("tcp://e:5558"), "kv@e:8000@m", true)], 0)),
        ("no publisher field with events on: zmq", with("publisher", None), "e",
            Sources(vec![src(0, "tcp://e:5557", Some("tcp://e:5558"), "", true)], 0)),
        ("publisher null", with("publisher", Some(r#""null""#)), "e", NoSource("publisher \"null\"")),
        ("events disabled", with("enable_kv_cache_events", Some("false")), "e", NoSource("enable_kv_cache_events is not true")),
        ("an ipc:// publisher", with("endpoint", Some(r#""ipc:///tmp/kv""#)), "e", NoSource("local to the engine's host")),
        ("port 0", with("endpoint", Some(r#""tcp://*:0""#)), "e", NoSource("port 0")),
        ("no port", with("endpoint", Some(r#""tcp://host""#)), "e", NoSource("no port")),
        ("no endpoint", with("endpoint", None), "e", NoSource("no endpoint")),
        ("empty answer", "{}".into(), "e", NoSource("no KV-event publisher")),
        ("a rank that is not an object", r#"{"0":"zmq"}"#.into(), "e", NoSource("not a JSON object")),
        ("a key that is not a rank", r#"{"x":{}}"#.into(), "e", NoSource("not a data-parallel rank")),
        ("bad JSON", "{\"0\":".into(), "e", Unreadable("not JSON")),
        ("an HTML error page", "<html>Not Found</html>".into(), "e", Unreadable("not JSON")),
        ("a JSON array", "[]".into(), "e", Unreadable("not a JSON object")),
        ("several ranks, sorted", two_ranks.into(), "e", Sources(vec![
            src(0, "tcp://e:5557", None, "t", true),
            src(1, "tcp://e:5558", None, "t", true),
        ], 0)),
        ("several ranks, one unusable", r#"{"0":{"enable_kv_cache_events":true,"publisher":"null","endpoint":"tcp://*:5557"},
                                            "1":{"enable_kv_cache_events":true,"publisher":"zmq","endpoint":"tcp://*:5558"}}"#.into(), "e",
            Sources(vec![src(1, "tcp://e:5558", None, "", true)], 1)),
    ];
    for (name, body, host, want) in rows {
        let got = parse_kv_event_sources(body.as_bytes(), host);
        match (&got, want) {
            (KvSourcesRead::Found { sources, notes }, Sources(want, n)) => {
                assert_eq!(sources, &want, "{name}");
                assert_eq!(notes.len(), n, "{name}: {notes:?}");
                assert_eq!(got.primary(), want.first(), "{name}");
            }
            (KvSourcesRead::NoSource(why), NoSource(part))
            | (KvSourcesRead::Unreadable(why), Unreadable(part)) => {
                assert!(why.contains(part), "{name}: {why}");
                assert_eq!(got.primary(), None, "{name}");
            }
            (got, _) => panic!("{name}: {got:?}"),
        }
    }
}

#[test]
fn descriptions_name_what_was_found() {
    let found = parse_kv_event_sources(VLLM.as_bytes(), "h");
    assert_eq!(found.describe(), "rank 0 tcp://h:5557, replay tcp://h:5558");
    let none = parse_kv_event_sources(b"{}", "h");
    assert!(
        none.describe().starts_with("no usable publisher: "),
        "{}",
        none.describe()
    );
    let bad = parse_kv_event_sources(b"nope", "h");
    assert!(
        bad.describe().starts_with("not read: "),
        "{}",
        bad.describe()
    );
}

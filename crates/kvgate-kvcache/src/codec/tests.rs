use super::*;
use crate::event::{BlockHash, BlockRemoved, BlockStored, ExtraKey, KvEvent, KvEventBatch};

fn hex(s: &str) -> Vec<u8> {
    let s: String = s.split_whitespace().collect();
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// §1.6 golden batch, map form (vLLM ≥ 0.24).
const GOLDEN_MAP: &str = "93 cb41d954fc40200000 93
de000b a474797065 ab426c6f636b53746f726564 ac626c6f636b5f686173686573 92 cf1122334455667788 cff0e1d2c3b4a59687 b1706172656e745f626c6f636b5f68617368 c0 a9746f6b656e5f696473 98 0102030405060708 aa626c6f636b5f73697a65 04 a76c6f72615f6964 c0 a66d656469756d a3475055 a96c6f72615f6e616d65 c0 aa65787472615f6b657973 92c0c0 a967726f75705f696478 00 b26b765f63616368655f737065635f6b696e64 ae66756c6c5f617474656e74696f6e
84 a474797065 ac426c6f636b52656d6f766564 ac626c6f636b5f686173686573 91cf1122334455667788 a66d656469756d a3475055 a967726f75705f696478 00
81 a474797065 b0416c6c426c6f636b73436c6561726564
00";

/// §1.6 golden batch, array form (vLLM ≤ 0.23).
const GOLDEN_ARRAY: &str = "93 cb41d954fc40200000 93
9c ab426c6f636b53746f726564 92cf1122334455667788cff0e1d2c3b4a59687 c0 98 0102030405060708 04 c0 a3475055 c0 92c0c0 00 ae66756c6c5f617474656e74696f6e c0
94 ac426c6f636b52656d6f766564 91cf1122334455667788 a3475055 00
91 b0416c6c426c6f636b73436c6561726564
00";

fn golden_events() -> Vec<KvEvent> {
    vec![
        KvEvent::BlockStored(BlockStored {
            block_hashes: vec![
                BlockHash::Int(0x1122334455667788),
                BlockHash::Int(0xF0E1D2C3B4A59687),
            ],
            parent_block_hash: None,
            token_ids: (1..=8).collect(),
            block_size: 4,
            medium: Some("GPU".into()),
            extra_keys: Some(vec![None, None]),
            group_idx: Some(0),
            kv_cache_spec_kind: Some("full_attention".into()),
            ..Default::default()
        }),
        KvEvent::BlockRemoved(BlockRemoved {
            block_hashes: vec![BlockHash::Int(0x1122334455667788)],
            medium: Some("GPU".into()),
            group_idx: Some(0),
            ..Default::default()
        }),
        KvEvent::AllBlocksCleared,
    ]
}

#[test]
fn encode_matches_golden_bytes() {
    let cases = [
        ("map", Encoding::Map, GOLDEN_MAP),
        ("array", Encoding::Array, GOLDEN_ARRAY),
    ];
    for (name, enc, golden) in cases {
        let got = encode_batch(1700000000.5, &golden_events(), Some(0), enc);
        assert_eq!(got, hex(golden), "{name}");
        // Each event type on its own must also match its slice of the golden bytes.
        for (i, ev) in golden_events().into_iter().enumerate() {
            let one = encode_batch(1700000000.5, std::slice::from_ref(&ev), Some(0), enc);
            let (batch, _) = decode_batch(&one).unwrap();
            assert_eq!(batch.events, vec![ev], "{name} event {i} round trip");
        }
    }
}

#[test]
fn encode_other_vectors() {
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "empty batch without rank",
            encode_batch(0.0, &[], None, Encoding::Array),
            "93 cb0000000000000000 90 c0",
        ),
        (
            "bin hash",
            encode_batch(
                0.0,
                &[KvEvent::BlockRemoved(BlockRemoved {
                    block_hashes: vec![BlockHash::Bytes(vec![7; 32])],
                    ..Default::default()
                })],
                None,
                Encoding::Array,
            ),
            "93 cb0000000000000000 91 94 ac426c6f636b52656d6f766564 91 c420 0707070707070707070707070707070707070707070707070707070707070707 c0 c0 c0",
        ),
    ];
    for (name, got, want) in cases {
        assert_eq!(got, hex(want), "{name}");
    }
    // Map BlockStored with only required fields: map16 header, 8 keys, nil lora_id/medium/lora_name present.
    let s = encode_batch(
        0.0,
        &[KvEvent::BlockStored(BlockStored::default())],
        None,
        Encoding::Map,
    );
    assert_eq!(&s[11..14], &[0xde, 0x00, 0x08]);
    assert!(s.ends_with(&hex(
        "a76c6f72615f6964 c0 a66d656469756d c0 a96c6f72615f6e616d65 c0 c0"
    )));
}

#[test]
fn decode_golden_both_encodings() {
    for (name, golden) in [("map", GOLDEN_MAP), ("array", GOLDEN_ARRAY)] {
        let (batch, stats) = decode_batch(&hex(golden)).unwrap();
        let want = KvEventBatch {
            ts: 1700000000.5,
            events: golden_events(),
            data_parallel_rank: Some(0),
        };
        assert_eq!(batch, want, "{name}");
        assert_eq!(stats, DecodeStats::default(), "{name}");
    }
}

/// Builds msgpack with rmpv for the shapes our encoder does not produce.
fn mp(v: rmpv::Value) -> Vec<u8> {
    let mut out = Vec::new();
    rmpv::encode::write_value(&mut out, &v).unwrap();
    out
}

fn s(x: &str) -> rmpv::Value {
    rmpv::Value::from(x)
}

#[test]
fn decode_table() {
    use rmpv::Value as V;
    let stored_map = |hash: V, extra: Vec<(V, V)>| {
        let mut m = vec![
            (s("type"), s("BlockStored")),
            (s("block_hashes"), V::Array(vec![hash])),
            (s("parent_block_hash"), V::Nil),
            (s("token_ids"), V::Array(vec![V::from(1), V::from(2)])),
            (s("block_size"), V::from(2)),
            (s("medium"), s("GPU")),
        ];
        m.extend(extra);
        V::Map(m)
    };
    let batch = |events: Vec<V>| V::Array(vec![V::F64(1.0), V::Array(events), V::Nil]);
    let hash_of = |b: &KvEventBatch| match &b.events[0] {
        KvEvent::BlockStored(s) => s.block_hashes[0].to_u64(),
        KvEvent::BlockRemoved(r) => r.block_hashes[0].to_u64(),
        KvEvent::AllBlocksCleared => 0,
    };
    // (name, payload, want events, want first hash, want stats)
    type Case = (&'static str, Vec<u8>, usize, u64, DecodeStats);
    let st = |u, f, m| DecodeStats {
        unknown_events: u,
        unknown_fields: f,
        malformed_events: m,
    };
    let cases: Vec<Case> = vec![
        (
            "sglang negative i64 hash (fb)",
            mp(batch(vec![stored_map(V::from(-5), vec![])])),
            1,
            (-5i64) as u64,
            st(0, 0, 0),
        ),
        (
            "u64 hash",
            mp(batch(vec![stored_map(V::from(u64::MAX), vec![])])),
            1,
            u64::MAX,
            st(0, 0, 0),
        ),
        (
            "small int hash",
            mp(batch(vec![stored_map(V::from(7), vec![])])),
            1,
            7,
            st(0, 0, 0),
        ),
        (
            "bin hash",
            mp(batch(vec![stored_map(
                V::Binary((0u8..32).collect()),
                vec![],
            )])),
            1,
            0x18191a1b1c1d1e1f,
            st(0, 0, 0),
        ),
        (
            "unknown map field",
            mp(batch(vec![stored_map(
                V::from(1),
                vec![(s("future"), V::from(3))],
            )])),
            1,
            1,
            st(0, 1, 0),
        ),
        (
            "0.33 map-only fields known",
            mp(batch(vec![stored_map(
                V::from(1),
                vec![(s("locality"), s("LOCAL")), (s("session_id"), V::Nil)],
            )])),
            1,
            1,
            st(0, 0, 0),
        ),
        (
            "unknown event type skipped",
            mp(batch(vec![
                V::Map(vec![(s("type"), s("Future"))]),
                stored_map(V::from(2), vec![]),
            ])),
            1,
            2,
            st(1, 0, 0),
        ),
        (
            "unknown array event skipped",
            mp(batch(vec![
                V::Array(vec![s("Future"), V::from(1)]),
                stored_map(V::from(3), vec![]),
            ])),
            1,
            3,
            st(1, 0, 0),
        ),
        (
            "malformed event skipped, rest kept",
            mp(batch(vec![
                stored_map(s("not a hash"), vec![]),
                stored_map(V::from(4), vec![]),
            ])),
            1,
            4,
            st(0, 0, 1),
        ),
        (
            "bigram token pairs malformed",
            mp(batch(vec![
                V::Array(vec![
                    s("BlockStored"),
                    V::Array(vec![V::from(5)]),
                    V::Nil,
                    V::Array(vec![V::Array(vec![V::from(1), V::from(2)])]),
                    V::from(1),
                ]),
                stored_map(V::from(6), vec![]),
            ])),
            1,
            6,
            st(0, 0, 1),
        ),
        (
            "2-element batch (pre DP rank)",
            mp(V::Array(vec![
                V::F64(1.0),
                V::Array(vec![stored_map(V::from(8), vec![])]),
            ])),
            1,
            8,
            st(0, 0, 0),
        ),
        (
            "map-shaped batch",
            mp(V::Map(vec![
                (s("ts"), V::F32(1.0)),
                (s("events"), V::Array(vec![stored_map(V::from(9), vec![])])),
                (s("data_parallel_rank"), V::from(2)),
            ])),
            1,
            9,
            st(0, 0, 0),
        ),
        (
            "int ts",
            mp(V::Array(vec![
                V::from(1),
                V::Array(vec![stored_map(V::from(10), vec![])]),
                V::from(0),
            ])),
            1,
            10,
            st(0, 0, 0),
        ),
        (
            "sglang 9-elem array stored",
            mp(batch(vec![V::Array(vec![
                s("BlockStored"),
                V::Array(vec![V::from(-1)]),
                V::from(0),
                V::Array(vec![]),
                V::from(16),
                V::Nil,
                s("GPU"),
                V::Nil,
                V::Nil,
            ])])),
            1,
            u64::MAX,
            st(0, 0, 0),
        ),
        (
            "array stored with extra trailing",
            mp(batch(vec![V::Array(vec![
                s("BlockStored"),
                V::Array(vec![V::from(11)]),
                V::Nil,
                V::Array(vec![]),
                V::from(16),
                V::Nil,
                s("GPU"),
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
                V::Nil,
                V::from(99),
            ])])),
            1,
            11,
            st(0, 1, 0),
        ),
        (
            "removed 3-elem array",
            mp(batch(vec![V::Array(vec![
                s("BlockRemoved"),
                V::Array(vec![V::from(12)]),
                s("CPU"),
            ])])),
            1,
            12,
            st(0, 0, 0),
        ),
    ];
    for (name, payload, n, h, want_stats) in cases {
        let (b, stats) = decode_batch(&payload).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(b.events.len(), n, "{name}");
        assert_eq!(hash_of(&b), h, "{name}");
        assert_eq!(stats, want_stats, "{name}");
    }
}

#[test]
fn decode_extra_keys_shapes() {
    use rmpv::Value as V;
    let ev = V::Map(vec![
        (s("type"), s("BlockStored")),
        (s("block_hashes"), V::Array(vec![V::from(1)])),
        (
            s("extra_keys"),
            V::Array(vec![V::Array(vec![
                s("lora"),
                V::Array(vec![s("img"), V::from(-3)]),
                V::Binary(vec![1]),
                s("salt"),
                V::from(5),
            ])]),
        ),
    ]);
    let (b, _) =
        decode_batch(&mp(V::Array(vec![V::F64(0.0), V::Array(vec![ev]), V::Nil]))).unwrap();
    let KvEvent::BlockStored(st) = &b.events[0] else {
        panic!("not stored")
    };
    assert_eq!(
        st.extra_keys,
        Some(vec![Some(vec![
            ExtraKey::Str("lora".into()),
            ExtraKey::Mm {
                identifier: "img".into(),
                offset: -3
            },
            ExtraKey::Bytes(vec![1]),
            ExtraKey::Str("salt".into()),
            ExtraKey::Other("5".into()),
        ])])
    );
}

#[test]
fn decode_rejects_garbage_without_panicking() {
    let golden = hex(GOLDEN_MAP);
    let msgpack = "invalid msgpack payload";
    let mut cases: Vec<(String, Vec<u8>, &str)> = vec![
        ("empty".into(), vec![], msgpack),
        (
            // rmpv reads the reserved marker 0xc1 as a value of its own.
            "garbage".into(),
            b"\xc1\xc1\xc1 not msgpack".to_vec(),
            "14 trailing bytes after the batch",
        ),
        (
            "scalar".into(),
            mp(rmpv::Value::from(5)),
            "payload is not an event batch: neither array nor map",
        ),
        (
            "1-element array".into(),
            mp(rmpv::Value::Array(vec![rmpv::Value::F64(0.0)])),
            "payload is not an event batch: array batch must have 2 or 3 elements",
        ),
        (
            "events not array".into(),
            mp(rmpv::Value::Array(vec![
                rmpv::Value::F64(0.0),
                rmpv::Value::from(1),
                rmpv::Value::Nil,
            ])),
            "payload is not an event batch: events is not an array",
        ),
        (
            "ts not a number".into(),
            mp(rmpv::Value::Array(vec![
                s("x"),
                rmpv::Value::Array(vec![]),
                rmpv::Value::Nil,
            ])),
            "payload is not an event batch: ts is not a number",
        ),
        (
            "rank not an int".into(),
            mp(rmpv::Value::Array(vec![
                rmpv::Value::F64(0.0),
                rmpv::Value::Array(vec![]),
                s("r"),
            ])),
            "payload is not an event batch: data_parallel_rank is not an int",
        ),
        (
            "trailing bytes".into(),
            [golden.clone(), vec![0]].concat(),
            "1 trailing bytes after the batch",
        ),
        (
            "huge declared array".into(),
            vec![0xdd, 0xff, 0xff, 0xff, 0xff],
            msgpack,
        ),
        ("deep nesting".into(), vec![0x91; 100_000], msgpack),
    ];
    // Every truncation of the golden frame must fail cleanly.
    for cut in 0..golden.len() {
        cases.push((
            format!("truncated at {cut}"),
            golden[..cut].to_vec(),
            msgpack,
        ));
    }
    for (name, payload, want) in cases {
        let err = decode_batch(&payload).expect_err(&name).to_string();
        assert!(err.starts_with(want), "{name}: {err:?}");
    }
}

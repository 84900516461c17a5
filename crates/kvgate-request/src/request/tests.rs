use bytes::Bytes;

use crate::{Api, Field, ParseError, Request};

fn parse(body: &str) -> Result<Request, ParseError> {
    Request::parse(
        Api::ChatCompletions,
        Bytes::copy_from_slice(body.as_bytes()),
    )
}

#[test]
fn model_is_located_and_spliced_without_touching_other_bytes() {
    let cases = [
        (
            "first key",
            r#"{"model":"a","messages":[{"role":"user","content":"hi"}]}"#,
        ),
        (
            "last key",
            r#"{"messages":[],"temperature":1.0,"model":"a"}"#,
        ),
        ("pretty", "{\n  \"model\" : \"a\" ,\n  \"x\": 1e2\n}\n"),
        (
            "escaped key",
            r#"{"mo\u0064el":"a","n":18446744073709551616000}"#,
        ),
        (
            "escaped value",
            r#"{"model":"\u0061","m":"caf\u00e9 café"}"#,
        ),
        (
            "model in content",
            r#"{"messages":[{"content":"\"model\":\"b\""}],"model":"a"}"#,
        ),
        (
            "nested model",
            r#"{"tools":[{"model":"b"}],"model":"a","z":{"model":"c"}}"#,
        ),
    ];
    for (name, body) in cases {
        let mut req = parse(body).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(req.model(), Some("a"), "{name}");
        let span = req.clone().seal(String::new()).span(Field::Model).unwrap();
        req.set_model("org/Model-\"7B\"");
        let new_value = r#""org/Model-\"7B\"""#;
        let want = format!("{}{}{}", &body[..span.start], new_value, &body[span.end..]);
        assert_eq!(std::str::from_utf8(req.body()).unwrap(), want, "{name}");
        assert_eq!(req.model(), Some("org/Model-\"7B\""), "{name}");
        // The spliced body parses to the same view.
        let again = parse(&want).unwrap();
        assert_eq!(again.model(), req.model(), "{name}");
        let sealed = req.seal("id");
        assert_eq!(sealed.requested_model(), Some("a"), "{name}");
        assert_eq!(sealed.model(), Some("org/Model-\"7B\""), "{name}");
    }
}

#[test]
fn spans_after_the_model_shift_with_the_splice() {
    let body = r#"{"model":"short","messages":[{"role":"user","content":"x"}],"stream":true}"#;
    let mut req = parse(body).unwrap();
    req.set_model("a-much-longer-model-name");
    let sealed = req.seal("r");
    assert_eq!(
        sealed.raw(Field::Messages),
        Some(&br#"[{"role":"user","content":"x"}]"#[..])
    );
    assert_eq!(sealed.raw(Field::Stream), Some(&b"true"[..]));
    assert!(sealed.stream());
}

#[test]
fn view_reads_typed_fields() {
    let body = r#"{"model":"m","stream":true,"cache_salt":"s","max_tokens":7,
        "max_completion_tokens":9,"add_generation_prompt":false,"prompt":"p",
        "input":["i"],"tools":[],"chat_template_kwargs":{"enable_thinking":false}}"#;
    let s = parse(body).unwrap().seal("r");
    assert!(s.stream());
    assert_eq!(s.cache_salt(), Some("s"));
    assert_eq!(s.max_tokens(), Some(7));
    assert_eq!(s.max_completion_tokens(), Some(9));
    assert_eq!(s.add_generation_prompt(), Some(false));
    assert_eq!(s.raw(Field::Prompt), Some(&br#""p""#[..]));
    assert_eq!(s.raw(Field::Input), Some(&br#"["i"]"#[..]));
    assert_eq!(
        s.raw(Field::ChatTemplateKwargs),
        Some(&br#"{"enable_thinking":false}"#[..])
    );
    let bare = parse(r#"{"model":"m"}"#).unwrap().seal("r");
    assert!(!bare.stream());
    assert_eq!(bare.max_tokens(), None);
    assert_eq!(bare.raw(Field::Messages), None);
}

#[test]
fn rejects_bad_bodies_with_a_reason() {
    let cases: [(&str, &str, &str); 10] = [
        ("truncated", r#"{"model":"m","#, "invalid_json"),
        ("garbage", "not json", "invalid_json"),
        ("trailing", r#"{"model":"m"} x"#, "invalid_json"),
        ("empty", "", "invalid_json"),
        ("array", r#"[{"model":"m"}]"#, "body_not_object"),
        (
            "duplicate model",
            r#"{"model":"a","x":1,"model":"b"}"#,
            "duplicate_model_key",
        ),
        (
            "escaped duplicate",
            r#"{"model":"a","mod\u0065l":"b"}"#,
            "duplicate_model_key",
        ),
        ("missing model", r#"{"messages":[]}"#, "missing_model"),
        ("null model", r#"{"model":null}"#, "missing_model"),
        ("model not string", r#"{"model":3}"#, "wrong_type"),
    ];
    for (name, body, code) in cases {
        let err = parse(body).expect_err(name);
        assert_eq!(err.code(), code, "{name}: {err}");
    }
}

#[test]
fn invalid_json_names_the_position() {
    let body = "{\n  \"model\": \"m\",\n  \"x\": trux, \"y\": 1\n}";
    let err = parse(body).unwrap_err();
    let ParseError::InvalidJson {
        line,
        column,
        offset,
        ..
    } = &err
    else {
        panic!("{err:?}")
    };
    assert_eq!(*line, 3);
    assert!(
        body[..*offset].ends_with("tru"),
        "offset {offset} column {column}"
    );
    assert_eq!(&body[*offset..*offset + 1], "x");
    assert!(err.to_string().contains("line 3 column"), "{err}");
    let json: serde_json::Value = serde_json::from_slice(&err.to_body().to_json()).unwrap();
    assert_eq!(json["error"]["code"], "invalid_json");
    assert_eq!(json["error"]["type"], "invalid_request_error");
}

#[test]
fn duplicate_of_an_unread_key_is_forwarded() {
    // Keys kvgate does not read are the engine's business.
    let req = parse(r#"{"model":"a","temperature":1,"temperature":2}"#).unwrap();
    assert_eq!(req.model(), Some("a"));
}

#[test]
fn passthrough_bodies_are_not_parsed() {
    let req = Request::parse(Api::Passthrough, Bytes::from_static(b"\x00not json")).unwrap();
    assert_eq!(req.model(), None);
    let mut req = req;
    req.set_model("x");
    assert_eq!(&req.body()[..], b"\x00not json");
}

#[test]
fn wrong_types_are_rejected_per_field() {
    let cases = [
        (r#"{"model":"m","stream":"yes"}"#, Field::Stream),
        (r#"{"model":"m","max_tokens":-1}"#, Field::MaxTokens),
        (r#"{"model":"m","cache_salt":1}"#, Field::CacheSalt),
        (
            r#"{"model":"m","add_generation_prompt":1}"#,
            Field::AddGenerationPrompt,
        ),
    ];
    for (body, field) in cases {
        match parse(body) {
            Err(ParseError::WrongType { field: f, .. }) => assert_eq!(f, field, "{body}"),
            other => panic!("{body}: {other:?}"),
        }
    }
}

/// Invalid UTF-8 is invalid JSON wherever it sits, also in values kvgate does not read (found
/// by the `request_parse` fuzz target: serde_json skips those without checking them).
#[test]
fn invalid_utf8_anywhere_is_invalid_json() {
    let rows: [(&str, &[u8], usize, usize, usize); 3] = [
        (
            "in a value no one reads",
            b"{\"model\":\"m\",\"x\":\"\xff\"}",
            1,
            19,
            18,
        ),
        (
            "in a nested key",
            b"{\"model\":\"m\",\"o\":{\"\xc3\":1}}",
            1,
            20,
            19,
        ),
        (
            "on a later line",
            b"{\"model\":\"m\",\n \"x\":\"a\xe2\x82\"}",
            2,
            8,
            21,
        ),
    ];
    // Past the first SIMD blocks: the same offset from the vectorized check.
    let long = [&b"{\"model\":\"m\",\"x\":\""[..], &[b'a'; 300], b"\xff\"}"].concat();
    let rows = rows
        .into_iter()
        .chain([("deep in a long body", &long[..], 1, 319, 318)]);
    for (name, body, line, column, offset) in rows {
        let got = Request::parse(Api::ChatCompletions, Bytes::copy_from_slice(body));
        assert_eq!(
            got.err(),
            Some(ParseError::InvalidJson {
                line,
                column,
                offset,
                reason: "invalid UTF-8".to_owned()
            }),
            "{name}"
        );
    }
    let valid = "{\"model\":\"m\",\"x\":\"é ✓\"}";
    assert!(
        Request::parse(Api::ChatCompletions, Bytes::from(valid)).is_ok(),
        "valid UTF-8 passes"
    );
}

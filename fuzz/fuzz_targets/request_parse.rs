//! Request parse + field probe + model splice + seal (`kvgate-request`).
//!
//! Input: byte 0 picks the API, byte 1 the length `n` of the replacement model name, the next
//! `n` bytes (lossy UTF-8) are that name, the rest is the body. Checked against
//! `serde_json::Value`: a parsed body is valid JSON, each probed span holds exactly the
//! top-level value of its key, and the splice changes only the `model` value's bytes. Most
//! bodies the probe accepts take its fast scan (`kvgate-request`'s `request/scan.rs`), so
//! this also holds that scan's grammar to serde_json's.
#![no_main]

use bytes::Bytes;
use kvgate_request::{Api, Field, Request};
use libfuzzer_sys::fuzz_target;
use serde_json::Value;

const APIS: [Api; 6] = [
    Api::ChatCompletions,
    Api::Completions,
    Api::Messages,
    Api::Responses,
    Api::Embeddings,
    Api::Passthrough,
];

fn hex4(b: &[u8]) -> Option<u16> {
    let s = std::str::from_utf8(b.get(..4)?).ok()?;
    u16::from_str_radix(s, 16)
        .ok()
        .filter(|_| s.bytes().all(|c| c.is_ascii_hexdigit()))
}

/// `bytes` with every unpaired surrogate escape (`\ud800` alone) turned into `\ufffd`, the
/// same length. serde_json::Value refuses lone surrogates; Python's json (the engines)
/// accepts them, and so does the probe, rightly: the reference parse must too.
fn mask_lone_surrogates(bytes: &[u8]) -> Vec<u8> {
    let mut out = bytes.to_vec();
    let mut i = 0;
    while i < out.len() {
        if out[i] != b'\\' {
            i += 1;
            continue;
        }
        if out.get(i + 1) != Some(&b'u') {
            i += 2;
            continue;
        }
        let Some(unit) = hex4(&out[i + 2..]) else {
            i += 2;
            continue;
        };
        let paired = (0xD800..0xDC00).contains(&unit)
            && out.get(i + 6..i + 8) == Some(&b"\\u"[..])
            && hex4(&out[i + 8..]).is_some_and(|low| (0xDC00..0xE000).contains(&low));
        if paired {
            i += 12;
        } else {
            if (0xD800..0xE000).contains(&unit) {
                out[i + 2..i + 6].copy_from_slice(b"fffd");
            }
            i += 6;
        }
    }
    out
}

fuzz_target!(|data: &[u8]| {
    let [sel, n, rest @ ..] = data else { return };
    let api = APIS[usize::from(*sel) % APIS.len()];
    let n = usize::from(*n % 32).min(rest.len());
    let (name, body) = rest.split_at(n);
    let new_model = String::from_utf8_lossy(name).into_owned();
    let body = Bytes::copy_from_slice(body);

    let parsed = Request::parse(api, body.clone());
    let json: Result<Value, _> = serde_json::from_slice(&mask_lone_surrogates(&body));
    let mut req = match parsed {
        Ok(req) => req,
        Err(e) => {
            // Every error renders as a JSON error body.
            let out = e.to_body().to_json();
            assert!(
                serde_json::from_slice::<Value>(&out).is_ok(),
                "error body is JSON"
            );
            assert!(api.is_parsed(), "passthrough never fails");
            return;
        }
    };
    assert_eq!(req.body(), &body);
    if !api.is_parsed() {
        req.set_model(&new_model);
        assert_eq!(req.body(), &body, "passthrough bodies are never spliced");
        return;
    }
    // Fuzz finding 1 (fuzz/README.md), fixed: the probe rejects invalid UTF-8 anywhere.
    assert!(
        std::str::from_utf8(&body).is_ok(),
        "Request::parse accepted a body that is not UTF-8"
    );
    if json
        .as_ref()
        .is_err_and(|e| e.to_string().starts_with("number out of range"))
    {
        // A float beyond f64 (`1e999`) in a value the probe does not read: serde_json::Value
        // refuses it, Python's json (the engines) reads it as inf; forwarding it is right.
        return;
    }
    let Ok(Value::Object(obj)) = json else {
        panic!("Request::parse accepted a body serde_json rejects or that is not an object");
    };
    let sealed = req.clone().seal("r".to_owned());
    for field in Field::ALL {
        let raw = sealed.raw(field);
        let span = sealed.span(field);
        assert_eq!(raw.is_some(), span.is_some());
        assert_eq!(
            raw.is_some(),
            obj.contains_key(field.key()),
            "{field:?} presence"
        );
        if let (Some(raw), Some(span)) = (raw, span) {
            assert_eq!(&body[span], raw);
            let v: Value = serde_json::from_slice(&mask_lone_surrogates(raw)).unwrap_or_else(|e| {
                panic!("{field:?} span is not one JSON value: {e}");
            });
            assert_eq!(Some(&v), obj.get(field.key()), "{field:?} value");
        }
    }
    let model = obj.get("model").and_then(Value::as_str);
    assert_eq!(sealed.model(), model);
    assert_eq!(sealed.requested_model(), model);
    assert_eq!(
        sealed.stream(),
        obj.get("stream").and_then(Value::as_bool).unwrap_or(false)
    );

    // Splice: only the model value's bytes change.
    let before = sealed.span(Field::Model);
    req.set_model(&new_model);
    let sealed2 = req.seal("r".to_owned());
    assert_eq!(sealed2.model(), Some(new_model.as_str()));
    assert_eq!(sealed2.requested_model(), model);
    let after: Value = serde_json::from_slice(&mask_lone_surrogates(sealed2.body()))
        .unwrap_or_else(|e| {
            panic!("spliced body is not JSON: {e}");
        });
    let mut want = Value::Object(obj.clone());
    want["model"] = Value::String(new_model.clone());
    assert_eq!(after, want, "splice changed more than the model");
    if let (Some(b), Some(a)) = (before, sealed2.span(Field::Model)) {
        assert_eq!(&body[..b.start], &sealed2.body()[..a.start]);
        assert_eq!(&body[b.end..], &sealed2.body()[a.end..]);
    }
    for field in Field::ALL {
        if field != Field::Model {
            assert_eq!(
                sealed.raw(field),
                sealed2.raw(field),
                "{field:?} moved wrong"
            );
        }
    }
    // The spliced body parses again to the same view.
    let reparsed = Request::parse(api, sealed2.body().clone())
        .unwrap_or_else(|e| panic!("spliced body fails to parse: {e}"));
    assert_eq!(reparsed.model(), Some(new_model.as_str()));
});

use super::spans;
use crate::request::{Field, Spans, probe_serde};
use crate::test_rng::Lcg;

/// serde_json's verdict on `text`: the spans it gives, or `None` for an error.
fn by_serde(text: &str) -> Option<Spans> {
    probe_serde(text.as_bytes(), text).ok()
}

/// One condition flipped per row: whether the fast path takes the body. Wherever it does,
/// serde_json gives the same spans.
#[test]
fn takes_only_what_it_handles_in_full() {
    let cases: &[(&str, &str, bool)] = &[
        (
            "compact",
            r#"{"model":"m","messages":[{"role":"user","content":"hi"}]}"#,
            true,
        ),
        (
            "pretty",
            "{\n  \"model\" : \"m\" ,\n\t\"x\": [1, 2]\r\n}\n",
            true,
        ),
        ("empty object", "{}", true),
        (
            "escapes in a value",
            r#"{"model":"a\"b\\c\/d\b\f\n\r\t\u00e9\ud800"}"#,
            true,
        ),
        (
            "numbers",
            r#"{"a":[0,-0,12,-7.25,1e5,1E+2,3.0e-7,18446744073709551616000,1e999]}"#,
            true,
        ),
        ("literals", r#"{"stream":true,"b":false,"c":null}"#, true),
        ("unknown key twice", r#"{"x":1,"x":2}"#, true),
        (
            "tab in a string of a pretty body",
            "{\n\"a\":\"x\ty\"}",
            false,
        ),
        ("escaped key", r#"{"mo\u0064el":"m"}"#, false),
        ("read key twice", r#"{"model":"a","model":"b"}"#, false),
        ("trailing comma", r#"{"a":1,}"#, false),
        ("trailing bytes", r#"{"a":1} x"#, false),
        ("leading zero", r#"{"a":01}"#, false),
        ("bare minus", r#"{"a":-}"#, false),
        ("dot without digits", r#"{"a":1.}"#, false),
        ("exponent without digits", r#"{"a":1e+}"#, false),
        ("bad escape", r#"{"a":"\x"}"#, false),
        ("short unicode escape", r#"{"a":"\u00g0"}"#, false),
        ("unterminated string", r#"{"a":"abc"#, false),
        ("truncated literal", r#"{"a":tru}"#, false),
        ("form feed as whitespace", "{\x0c\"a\":1}", false),
        ("an array", "[1]", false),
        ("missing colon", r#"{"a" 1}"#, false),
        ("missing value", r#"{"a":}"#, false),
    ];
    for (name, text, takes) in cases {
        let fast = spans(text.as_bytes());
        assert_eq!(fast.is_some(), *takes, "{name}: {text}");
        if let Some(fast) = fast {
            assert_eq!(Some(fast), by_serde(text), "{name}: serde_json disagrees");
        }
    }
}

/// Nesting: taken up to `MAX_DEPTH`, left to serde_json beyond (whose own limit is 128).
#[test]
fn deep_nesting_is_left_to_serde() {
    let nest = |depth: usize| {
        format!(
            "{{\"a\":{}1{}}}",
            "[".repeat(depth - 1),
            "]".repeat(depth - 1)
        )
    };
    assert!(spans(nest(super::MAX_DEPTH).as_bytes()).is_some());
    assert!(spans(nest(super::MAX_DEPTH + 1).as_bytes()).is_none());
    assert!(by_serde(&nest(super::MAX_DEPTH + 1)).is_some());
}

/// The spans are those of the values, without the whitespace around them.
#[test]
fn spans_are_the_values_bytes() {
    let text = "{ \"model\" :  \"m\" , \"messages\": [ 1 ]\n, \"stream\":false }";
    let got = spans(text.as_bytes()).unwrap();
    let at = |f: Field| got[f.slot()].clone().map(|r| &text[r]);
    assert_eq!(at(Field::Model), Some("\"m\""));
    assert_eq!(at(Field::Messages), Some("[ 1 ]"));
    assert_eq!(at(Field::Stream), Some("false"));
    assert_eq!(at(Field::Tools), None);
}

const WS: [&str; 5] = ["", " ", "\n  ", "\t", "\r\n"];

/// A random JSON value as text: odd whitespace, every number form, escapes (lone surrogates
/// among them), raw control characters, keys kvgate reads (some escaped), deep nesting.
fn value(rng: &mut Lcg, depth: usize, out: &mut String) {
    const NUMBERS: [&str; 10] = [
        "0",
        "-0",
        "12",
        "-7.25",
        "1e5",
        "1E+2",
        "3.0e-7",
        "0.5",
        "18446744073709551616000",
        "1e999",
    ];
    const PIECES: [&str; 12] = [
        "plain",
        "café",
        "\\\"",
        "\\\\",
        "\\/",
        "\\n",
        "\\u00e9",
        "\\ud800",
        "\\uD83D\\uDE00",
        " } ] , : ",
        "\t",
        "\u{7f}",
    ];
    const KEYS: [&str; 8] = [
        "model",
        "messages",
        "stream",
        "x",
        "y",
        "max_tokens",
        "mo\\u0064el",
        "tools",
    ];
    let pick = rng.below(if depth > 6 { 3 } else { 5 });
    match pick {
        0 => out.push_str(rng.pick(&["true", "false", "null"])),
        1 => out.push_str(rng.pick(&NUMBERS)),
        2 => {
            out.push('"');
            for _ in 0..rng.below(4) {
                out.push_str(rng.pick(&PIECES));
            }
            out.push('"');
        }
        3 => {
            out.push('[');
            for i in 0..rng.below(4) {
                if i > 0 {
                    out.push(',');
                }
                out.push_str(rng.pick(&WS));
                value(rng, depth + 1, out);
                out.push_str(rng.pick(&WS));
            }
            out.push(']');
        }
        _ => object(rng, depth + 1, out, &KEYS),
    }
}

fn object(rng: &mut Lcg, depth: usize, out: &mut String, keys: &[&str]) {
    out.push('{');
    for i in 0..rng.below(5) {
        if i > 0 {
            out.push(',');
        }
        out.push_str(rng.pick(&WS));
        out.push('"');
        out.push_str(rng.pick(keys));
        out.push('"');
        out.push_str(rng.pick(&WS));
        out.push(':');
        out.push_str(rng.pick(&WS));
        value(rng, depth, out);
        out.push_str(rng.pick(&WS));
    }
    out.push('}');
}

/// One random edit: a byte deleted, inserted or replaced (from JSON's own alphabet and a few
/// control characters), or the text cut short.
fn mutate(rng: &mut Lcg, text: &str) -> Option<String> {
    const BYTES: &[u8] = b"{}[],:\"\\ 0123456789eE.+-tfnul\x01\x0c\n\x1f";
    let mut bytes = text.as_bytes().to_vec();
    let at = rng.below(bytes.len().max(1) as u64) as usize;
    let byte = BYTES[rng.below(BYTES.len() as u64) as usize];
    match rng.below(4) {
        0 if !bytes.is_empty() => {
            bytes.remove(at);
        }
        1 => bytes.insert(at, byte),
        2 if !bytes.is_empty() => bytes[at] = byte,
        _ => bytes.truncate(at),
    }
    String::from_utf8(bytes).ok()
}

/// Random bodies and random edits of them: wherever the fast path takes one, serde_json takes
/// it too, with the same spans. The generator reaches bodies of both verdicts.
#[test]
fn agrees_with_serde_json_on_random_bodies() {
    const TOP: [&str; 9] = [
        "model",
        "messages",
        "stream",
        "tools",
        "max_tokens",
        "prompt",
        "x",
        "y",
        "mo\\u0064el",
    ];
    let mut rng = Lcg(11);
    let (mut taken, mut valid, mut taken_edits, mut refused_edits) = (0, 0, 0, 0);
    for _ in 0..20_000 {
        let mut text = String::new();
        text.push_str(rng.pick(&WS));
        object(&mut rng, 1, &mut text, &TOP);
        text.push_str(rng.pick(&WS));
        let serde = by_serde(&text);
        valid += usize::from(serde.is_some());
        if let Some(fast) = spans(text.as_bytes()) {
            taken += 1;
            assert_eq!(Some(fast), serde, "{text:?}");
        }
        for _ in 0..3 {
            let Some(edited) = mutate(&mut rng, &text) else {
                continue;
            };
            match spans(edited.as_bytes()) {
                Some(fast) => {
                    taken_edits += 1;
                    assert_eq!(Some(fast), by_serde(&edited), "{edited:?}");
                }
                None => refused_edits += usize::from(by_serde(&edited).is_none()),
            }
        }
    }
    // Most valid bodies go the fast way (the rest have an escaped or repeated read key, or a
    // control character in a string), and edits land on both sides.
    assert!(
        taken * 10 > valid * 6,
        "{taken} of {valid} valid bodies taken"
    );
    assert!(
        taken_edits > 5_000 && refused_edits > 5_000,
        "{taken_edits} / {refused_edits}"
    );
}

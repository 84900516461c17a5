//! Finding one top-level key of a JSON object without parsing the rest.
//!
//! Reading `usage` from an engine's answer needs one small object out of a body whose bulk is
//! `choices` (the generated text). A full parse walks every value to skip it; this scan only
//! follows string boundaries (jumping to the next quote or backslash) and nesting, and the
//! caller parses the one value it needs.

/// Where the value of the top-level key `key` starts in `json`, a JSON object: the offset of
/// the value's first byte. One pass, which follows strings (and their escapes) and nesting but
/// checks nothing else, so the caller parses the value at that offset and treats a failure
/// as not found.
///
/// `None` when `json` is not an object, has no such key at its top level, or ends early. Keys
/// are compared byte for byte, so a key spelled with escapes (`"\u0075sage"`) is not found
/// here; a caller that must honour such spellings falls back to a full parse on `None`.
pub(crate) fn value_start(json: &[u8], key: &[u8]) -> Option<usize> {
    let mut i = skip_ws(json, 0);
    if json.get(i) != Some(&b'{') {
        return None;
    }
    i += 1;
    let mut depth = 1usize;
    // At depth 1, whether the next string is a key (after `{` or `,`) or a value.
    let mut key_next = true;
    while let Some(&b) = json.get(i) {
        match b {
            b'"' => {
                let end = string_end(json, i + 1)?;
                if depth == 1 && key_next {
                    let colon = skip_ws(json, end + 1);
                    if json.get(colon) != Some(&b':') {
                        return None;
                    }
                    if &json[i + 1..end] == key {
                        return Some(skip_ws(json, colon + 1));
                    }
                    key_next = false;
                    i = colon + 1;
                } else {
                    i = end + 1;
                }
            }
            b'{' | b'[' => {
                depth += 1;
                i += 1;
            }
            b'}' | b']' => {
                depth -= 1;
                if depth == 0 {
                    return None;
                }
                i += 1;
            }
            b',' => {
                key_next = depth == 1;
                i += 1;
            }
            _ => i += 1,
        }
    }
    None
}

/// What a scan from the end of a body found.
#[derive(Debug, PartialEq, Eq)]
pub(crate) enum FromEnd {
    /// The value of the last top-level `key` starts at this offset.
    At(usize),
    /// The body is one object, walked back to its opening brace, with no such key at its top
    /// level.
    Absent,
    /// The body does not end as an object or its nesting does not add up: scan it forwards.
    Unsure,
}

/// [`value_start`] from the other end: where the value of the *last* top-level `key` starts.
///
/// Engines write `usage` after `choices` (the generated text), so walking back from the
/// closing brace reaches it after a few dozen bytes, however long the answer. Outside strings
/// a valid body has no backslash, so a quote met there closes a string; its opening quote is
/// the nearest one before it that an odd run of backslashes does not escape. A string at the
/// top level followed by `:` is a key. Like [`value_start`], this checks nothing else: a body
/// broken before its last key still gives that key.
pub(crate) fn value_start_from_end(json: &[u8], key: &[u8]) -> FromEnd {
    let Some(last) = json.iter().rposition(|b| !is_ws(*b)) else {
        return FromEnd::Unsure;
    };
    if json[last] != b'}' {
        return FromEnd::Unsure;
    }
    let mut depth = 1usize;
    let mut i = last;
    while i > 0 {
        i -= 1;
        match json[i] {
            b'"' => {
                let Some(open) = string_start(json, i) else {
                    return FromEnd::Unsure;
                };
                if depth == 1 {
                    let colon = skip_ws(json, i + 1);
                    if json.get(colon) == Some(&b':') && &json[open + 1..i] == key {
                        return FromEnd::At(skip_ws(json, colon + 1));
                    }
                }
                i = open;
            }
            b'}' | b']' => depth += 1,
            b'{' | b'[' => {
                depth -= 1;
                if depth == 0 {
                    return if json[i] == b'{' && json[..i].iter().all(|b| is_ws(*b)) {
                        FromEnd::Absent
                    } else {
                        FromEnd::Unsure
                    };
                }
            }
            _ => {}
        }
    }
    FromEnd::Unsure
}

/// The offset of the quote that opens the string whose closing quote is at `close`.
fn string_start(json: &[u8], close: usize) -> Option<usize> {
    let mut end = close;
    loop {
        let at = memchr::memrchr(b'"', &json[..end])?;
        let backslashes = json[..at].iter().rev().take_while(|b| **b == b'\\').count();
        if backslashes % 2 == 0 {
            return Some(at);
        }
        end = at;
    }
}

fn is_ws(b: u8) -> bool {
    matches!(b, b' ' | b'\t' | b'\n' | b'\r')
}

/// The offset of the quote that closes the string whose content starts at `from`.
fn string_end(json: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let at = from + memchr::memchr2(b'"', b'\\', json.get(from..)?)?;
        if json[at] == b'"' {
            return Some(at);
        }
        // A backslash escapes the byte after it (`\"`, `\\`; `\uXXXX` has no quote to skip).
        from = at + 2;
    }
}

/// The offset of the first byte at or after `i` that is not JSON whitespace.
pub(crate) fn skip_ws(json: &[u8], mut i: usize) -> usize {
    while json.get(i).is_some_and(|b| is_ws(*b)) {
        i += 1;
    }
    i
}

#[cfg(test)]
mod tests {
    use super::*;

    /// One condition a row: where `usage` is, how it is spelled, what surrounds it.
    #[test]
    fn finds_only_the_top_level_key() {
        let rows: [(&str, &str, Option<&str>); 16] = [
            (
                "last key",
                r#"{"id":"x","usage":{"a":1}}"#,
                Some(r#"{"a":1}}"#),
            ),
            (
                "first key",
                r#"{"usage":2,"id":"x"}"#,
                Some(r#"2,"id":"x"}"#),
            ),
            (
                "spaces around the colon",
                "{ \"usage\" \t:\n null }",
                Some("null }"),
            ),
            (
                "after an array of objects holding the key",
                r#"{"choices":[{"usage":1}],"usage":3}"#,
                Some("3}"),
            ),
            ("only nested", r#"{"choices":[{"usage":1}]}"#, None),
            ("nested in an object", r#"{"m":{"usage":1}}"#, None),
            ("a string value, not a key", r#"{"k":"usage","x":1}"#, None),
            (
                "a string value equal to the key, then the key",
                r#"{"k":"usage","usage":4}"#,
                Some("4}"),
            ),
            (
                "inside a string with escaped quotes",
                r#"{"k":"say \"usage\": 1","x":2}"#,
                None,
            ),
            (
                "a key ending in an escaped quote",
                r#"{"a \"usage":1,"usage":5}"#,
                Some("5}"),
            ),
            (
                "an escaped backslash before the closing quote",
                r#"{"k":"c:\\","usage":6}"#,
                Some("6}"),
            ),
            ("escaped spelling", r#"{"\u0075sage":1}"#, None),
            ("a longer key", r#"{"usage_x":1}"#, None),
            ("not an object", r#"["usage",1]"#, None),
            ("truncated in a string", r#"{"id":"x"#, None),
            ("truncated after an escape", r#"{"id":"x\"#, None),
        ];
        for (name, json, want) in rows {
            let got = value_start(json.as_bytes(), b"usage").map(|at| &json[at..]);
            assert_eq!(got, want, "{name}");
        }
    }

    /// One condition a row. `Some` is where the value starts; `Absent` and `Unsure` as named.
    #[test]
    fn from_the_end_finds_the_last_top_level_key_or_says_why_not() {
        use FromEnd::{Absent, Unsure};
        let at = |s: &'static str| Ok::<_, FromEnd>(s);
        let rows: [(&str, &str, Result<&str, FromEnd>); 20] = [
            (
                "last key",
                r#"{"id":"x","usage":{"a":1}}"#,
                at(r#"{"a":1}}"#),
            ),
            ("first key", r#"{"usage":2,"id":"x"}"#, at(r#"2,"id":"x"}"#)),
            (
                "spaces around the colon",
                "{ \"usage\" \t:\n null }",
                at("null }"),
            ),
            ("trailing whitespace", "{\"usage\":1}\n", at("1}\n")),
            (
                "after an array of objects holding the key",
                r#"{"choices":[{"usage":1}],"usage":3}"#,
                at("3}"),
            ),
            ("only nested", r#"{"choices":[{"usage":1}]}"#, Err(Absent)),
            ("nested in an object", r#"{"m":{"usage":1}}"#, Err(Absent)),
            (
                "a string value, not a key",
                r#"{"k":"usage","x":1}"#,
                Err(Absent),
            ),
            (
                "a string value equal to the key, before the key",
                r#"{"usage":4,"k":"usage"}"#,
                at(r#"4,"k":"usage"}"#),
            ),
            (
                "inside a string with escaped quotes",
                r#"{"k":"say \"usage\": 1","x":2}"#,
                Err(Absent),
            ),
            (
                "a key ending in an escaped quote",
                r#"{"usage":5,"a \"usage":1}"#,
                at(r#"5,"a \"usage":1}"#),
            ),
            (
                "an escaped backslash before a closing quote",
                r#"{"usage":6,"k":"c:\\"}"#,
                at(r#"6,"k":"c:\\"}"#),
            ),
            (
                "repeated: the last one",
                r#"{"usage":1,"usage":2}"#,
                at("2}"),
            ),
            ("escaped spelling", r#"{"\u0075sage":1}"#, Err(Absent)),
            ("not an object", r#"["usage",1]"#, Err(Unsure)),
            ("cut short", r#"{"usage":1,"id":"x"#, Err(Unsure)),
            ("a closing brace alone", "}", Err(Unsure)),
            ("opened as an array", r#"["id",{"x":1}}"#, Err(Unsure)),
            (
                "text before the object, no key",
                r#"x{"id":1}"#,
                Err(Unsure),
            ),
            (
                "broken before the key: still read",
                r#"x]{"usage":1}"#,
                at("1}"),
            ),
        ];
        for (name, json, want) in rows {
            let got = match value_start_from_end(json.as_bytes(), b"usage") {
                FromEnd::At(at) => Ok(&json[at..]),
                other => Err(other),
            };
            assert_eq!(got, want, "{name}");
        }
    }
}

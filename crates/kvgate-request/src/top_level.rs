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
    while json
        .get(i)
        .is_some_and(|b| matches!(b, b' ' | b'\t' | b'\n' | b'\r'))
    {
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
}

//! The id a request carries through logs, the decision log and the engine: the client's
//! [`super::REQUEST_ID`] header when it is usable, else a fresh UUIDv4 as 32 lowercase hex digits.
//! Its random bits come from the thread's ChaCha generator (`rand::rng`, seeded from the OS),
//! not a `getrandom` system call per request.
//!
//! Usable means it cannot forge a log line: no spaces, quotes, backslashes or control
//! characters, so `x-request-id: abc status=500` cannot add a field to a `key=value` log line
//! anywhere it is printed (kvgate's own log lines quote it as well).

use std::{
    fmt::{self, Write as _},
    sync::Arc,
};

use http::HeaderMap;

use super::REQUEST_ID_NAME;

/// Longest client-sent request id kept; a longer one is replaced.
const MAX_CLIENT_ID: usize = 128;

/// The client's `x-request-id` when it is 1 to [`MAX_CLIENT_ID`] bytes of printable ASCII
/// other than `"` and `\` (no space), else a generated one.
pub fn request_id(headers: &HeaderMap) -> Arc<str> {
    headers
        .get(REQUEST_ID_NAME)
        .and_then(|v| v.to_str().ok())
        .filter(|v| !v.is_empty() && v.len() <= MAX_CLIENT_ID && v.bytes().all(log_safe))
        .map_or_else(
            || {
                let uuid = uuid::Builder::from_random_bytes(rand::random()).into_uuid();
                // Encoded in place: no formatter, one allocation (the `Arc`).
                let mut hex = [0u8; uuid::fmt::Simple::LENGTH];
                Arc::from(&*uuid.simple().encode_lower(&mut hex))
            },
            Into::into,
        )
}

/// A byte that cannot end a log field or start another: printable ASCII, no quote or
/// backslash.
fn log_safe(b: u8) -> bool {
    b.is_ascii_graphic() && b != b'"' && b != b'\\'
}

/// An id as `fmt::Debug` prints a string (quoted, with escapes), for log fields: the same
/// text, without the per-character escape checks when it needs none, as no id
/// [`request_id`] returns does.
pub(crate) struct Quoted<'a>(pub(crate) &'a str);

impl fmt::Debug for Quoted<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self
            .0
            .bytes()
            .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
        {
            f.write_char('"')?;
            f.write_str(self.0)?;
            f.write_char('"')
        } else {
            fmt::Debug::fmt(self.0, f)
        }
    }
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn is_generated(id: &str) -> bool {
        id.len() == 32 && id.bytes().all(|b| matches!(b, b'0'..=b'9' | b'a'..=b'f'))
    }

    #[test]
    fn client_ids_are_kept_when_usable() {
        let max = "r".repeat(MAX_CLIENT_ID);
        let over = "r".repeat(MAX_CLIENT_ID + 1);
        let cases: [(&str, Option<HeaderValue>, Option<&str>); 10] = [
            ("no header", None, None),
            (
                "client id",
                Some(HeaderValue::from_static("req-1")),
                Some("req-1"),
            ),
            ("empty", Some(HeaderValue::from_static("")), None),
            (
                "longest kept",
                Some(HeaderValue::from_str(&max).unwrap()),
                Some(&max),
            ),
            (
                "one byte too long",
                Some(HeaderValue::from_str(&over).unwrap()),
                None,
            ),
            (
                "not visible ASCII",
                Some(HeaderValue::from_bytes(b"caf\xc3\xa9").unwrap()),
                None,
            ),
            (
                "a forged log field",
                Some(HeaderValue::from_static("abc status=500")),
                None,
            ),
            ("a tab", Some(HeaderValue::from_static("abc\tx=1")), None),
            (
                "a quote",
                Some(HeaderValue::from_static("abc\" status=\"500")),
                None,
            ),
            (
                "punctuation kept",
                Some(HeaderValue::from_static("trace-1:span_2/3+4=5.6@7")),
                Some("trace-1:span_2/3+4=5.6@7"),
            ),
        ];
        for (name, value, want) in cases {
            let mut headers = HeaderMap::new();
            if let Some(v) = value {
                headers.insert(REQUEST_ID_NAME, v);
            }
            let got = request_id(&headers);
            match want {
                Some(want) => assert_eq!(&*got, want, "{name}"),
                None => assert!(is_generated(&got), "{name}: {got}"),
            }
        }
    }

    #[test]
    fn quoted_prints_what_debug_prints() {
        let cases = [
            ("a generated id", "0123456789abcdef0123456789abcdef"),
            ("punctuation", "trace-1:span_2/3+4=5.6@7"),
            ("empty", ""),
            ("a space", "a b"),
            ("a quote", "a\"b"),
            ("a backslash", "a\\b"),
            ("a tab", "a\tb"),
            ("a control", "a\x1bb"),
            ("not ASCII", "café"),
        ];
        for (name, id) in cases {
            assert_eq!(format!("{:?}", Quoted(id)), format!("{id:?}"), "{name}");
        }
    }

    #[test]
    fn generated_ids_are_distinct_version_4_uuids() {
        let ids: std::collections::HashSet<Arc<str>> =
            (0..1000).map(|_| request_id(&HeaderMap::new())).collect();
        assert_eq!(ids.len(), 1000, "distinct");
        for id in &ids {
            let uuid = uuid::Uuid::parse_str(id).expect(id);
            assert_eq!(uuid.get_version_num(), 4, "{id}");
            assert_eq!(uuid.get_variant(), uuid::Variant::RFC4122, "{id}");
        }
    }
}

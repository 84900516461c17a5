//! Integers beyond `u64`/`i64` in request JSON, kept digit for digit as Python keeps them.
//!
//! vLLM parses request bodies and tool-call arguments with Python's `json`, which keeps every
//! digit of an integer, so `{"n": 18446744073709551616}` renders as that integer. serde_json
//! turns an integer beyond `u64`/`i64` into the nearest `f64` instead (its
//! `arbitrary_precision` feature would keep the digits, but it is unified across the
//! workspace and changes `Value` for every crate). So [`BigInts`] records, for each such `f64`,
//! the integer literal it came from, found by lexing the JSON text again, and the template
//! context presents those values as integers ([`WithBigInts`]). The lexing only runs when the
//! parsed value holds an integral `f64` beyond `i64`'s range, so ordinary bodies pay one walk.
//!
//! What cannot be kept exactly is refused, so the chain asks `/render`: an integer beyond 128
//! bits (the template engine's widest integer), and an `f64` that two different literals
//! produced (`18446744073709551616` and `18446744073709551617`, or the float
//! `1.8446744073709552e19` beside the integer).

use std::collections::HashMap;

use serde::{Serialize, Serializer};
use serde_json::Value;

use crate::chat::Rejection;

/// The smallest magnitude where an integral `f64` may stand for an integer that did not fit
/// `i64`/`u64` (2^63).
const WIDE: f64 = 9_223_372_036_854_775_808.0;

/// An integer literal beyond `u64`/`i64`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Wide {
    Positive(u128),
    Negative(i128),
}

/// What one `f64` came from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Source {
    Int(Wide),
    Float,
}

/// The wide integers of one request, keyed by the bits of the `f64` serde_json made of them.
#[derive(Debug, Clone, Default)]
pub(crate) struct BigInts {
    by_bits: HashMap<u64, Source>,
}

fn is_wide(f: f64) -> bool {
    f.abs() >= WIDE && f.fract() == 0.0
}

/// Whether `v` holds an `f64` that may come from a wide integer.
fn has_wide_float(v: &Value) -> bool {
    match v {
        Value::Number(n) => n.as_f64().is_some_and(|f| n.is_f64() && is_wide(f)),
        Value::Array(items) => items.iter().any(has_wide_float),
        Value::Object(map) => map.values().any(has_wide_float),
        _ => false,
    }
}

/// The number literals of a JSON text (outside strings), in order.
fn number_literals(text: &[u8]) -> Vec<&[u8]> {
    let mut out = Vec::new();
    let mut i = 0;
    while i < text.len() {
        match text[i] {
            b'"' => {
                i += 1;
                while i < text.len() {
                    match text[i] {
                        b'\\' => i += 2,
                        b'"' => {
                            i += 1;
                            break;
                        }
                        _ => i += 1,
                    }
                }
            }
            b'-' | b'0'..=b'9' => {
                let start = i;
                while i < text.len()
                    && matches!(text[i], b'0'..=b'9' | b'-' | b'+' | b'.' | b'e' | b'E')
                {
                    i += 1;
                }
                out.push(&text[start..i]);
            }
            _ => i += 1,
        }
    }
    out
}

fn unsupported(detail: String) -> Rejection {
    Rejection::Unsupported(detail)
}

impl BigInts {
    /// Records the wide integers of `text`, which serde_json parsed into `parsed`.
    ///
    /// # Errors
    /// [`Rejection::Unsupported`] for an integer beyond 128 bits or an ambiguous `f64`.
    pub(crate) fn note(&mut self, text: &[u8], parsed: &Value) -> Result<(), Rejection> {
        if !has_wide_float(parsed) {
            return Ok(());
        }
        for literal in number_literals(text) {
            let lit = String::from_utf8_lossy(literal);
            let is_int = !literal.iter().any(|b| matches!(b, b'.' | b'e' | b'E'));
            if is_int && (lit.parse::<u64>().is_ok() || lit.parse::<i64>().is_ok()) {
                continue; // serde_json keeps these exactly
            }
            // The same conversion serde_json applied while parsing.
            let Ok(f) = serde_json::from_str::<f64>(&lit) else {
                continue;
            };
            if !is_wide(f) {
                continue;
            }
            let source = if !is_int {
                Source::Float
            } else if let Ok(n) = lit.parse::<u128>() {
                Source::Int(Wide::Positive(n))
            } else if let Ok(n) = lit.parse::<i128>() {
                Source::Int(Wide::Negative(n))
            } else {
                return Err(unsupported(format!("integer {lit} is beyond 128 bits")));
            };
            match self.by_bits.insert(f.to_bits(), source) {
                Some(seen) if seen != source => {
                    return Err(unsupported(format!(
                        "number {lit} is indistinguishable from another number once parsed"
                    )));
                }
                _ => {}
            }
        }
        Ok(())
    }

    /// Whether no wide integer was recorded.
    pub(crate) fn is_empty(&self) -> bool {
        !self.by_bits.values().any(|s| matches!(s, Source::Int(_)))
    }

    fn get(&self, f: f64) -> Option<Wide> {
        match self.by_bits.get(&f.to_bits()) {
            Some(Source::Int(w)) => Some(*w),
            _ => None,
        }
    }
}

/// A JSON value serialized with its wide integers restored (as `u128`/`i128`).
#[derive(Debug, Clone, Copy)]
pub(crate) struct WithBigInts<'a> {
    /// The value.
    pub(crate) value: &'a Value,
    /// The wide integers of the request it came from.
    pub(crate) ints: &'a BigInts,
}

impl Serialize for WithBigInts<'_> {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        let with = |value| WithBigInts {
            value,
            ints: self.ints,
        };
        match self.value {
            Value::Number(n) if n.is_f64() => match n.as_f64().and_then(|f| self.ints.get(f)) {
                Some(Wide::Positive(u)) => s.serialize_u128(u),
                Some(Wide::Negative(i)) => s.serialize_i128(i),
                None => n.serialize(s),
            },
            Value::Array(items) => s.collect_seq(items.iter().map(with)),
            Value::Object(map) => s.collect_map(map.iter().map(|(k, v)| (k, with(v)))),
            other => other.serialize(s),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn note(text: &str) -> Result<BigInts, Rejection> {
        let mut ints = BigInts::default();
        let parsed: Value = serde_json::from_str(text).unwrap();
        ints.note(text.as_bytes(), &parsed)?;
        Ok(ints)
    }

    fn restored(text: &str) -> Result<String, Rejection> {
        let ints = note(text)?;
        let parsed: Value = serde_json::from_str(text).unwrap();
        let with = WithBigInts {
            value: &parsed,
            ints: &ints,
        };
        let v = minijinja::value::Value::from(minijinja::value::Serde(&with));
        Ok(
            crate::pyjson::dumps_template(&v, &crate::pyjson::DumpOptions::python_default(false))
                .unwrap(),
        )
    }

    #[test]
    fn wide_integers_keep_their_digits() {
        let cases = [
            (
                "u64 max + 1",
                r#"{"n":18446744073709551616}"#,
                r#"{"n": 18446744073709551616}"#,
            ),
            (
                "i64 min - 1",
                r#"[-9223372036854775809]"#,
                "[-9223372036854775809]",
            ),
            (
                "u128 max",
                "[340282366920938463463374607431768211455]",
                "[340282366920938463463374607431768211455]",
            ),
            (
                "i128 min",
                "[-170141183460469231731687303715884105728]",
                "[-170141183460469231731687303715884105728]",
            ),
            (
                "u64 max stays",
                "[18446744073709551615]",
                "[18446744073709551615]",
            ),
            ("float stays a float", "[1e19]", "[1e+19]"),
            (
                "a string is not a number",
                r#"["18446744073709551616", 1e19]"#,
                r#"["18446744073709551616", 1e+19]"#,
            ),
            (
                "escaped quote in a string",
                r#"["\"18446744073709551616", 2]"#,
                r#"["\"18446744073709551616", 2]"#,
            ),
            (
                "same integer twice",
                "[18446744073709551616, 18446744073709551616]",
                "[18446744073709551616, 18446744073709551616]",
            ),
        ];
        for (name, text, want) in cases {
            assert_eq!(restored(text).as_deref(), Ok(want), "{name}");
        }
        assert!(note(r#"{"n":1.5,"m":[1,2]}"#).unwrap().is_empty());
    }

    #[test]
    fn what_cannot_be_kept_is_refused() {
        let cases = [
            (
                "beyond 128 bits",
                "[340282366920938463463374607431768211456]",
                "integer 340282366920938463463374607431768211456 is beyond 128 bits",
            ),
            (
                "two integers, one f64",
                "[18446744073709551616, 18446744073709551617]",
                "number 18446744073709551617 is indistinguishable from another number once parsed",
            ),
            (
                "float and integer, one f64",
                "[1.8446744073709552e19, 18446744073709551616]",
                "number 18446744073709551616 is indistinguishable from another number once parsed",
            ),
        ];
        for (name, text, want) in cases {
            let err = note(text).unwrap_err();
            assert_eq!(err, Rejection::Unsupported(want.to_owned()), "{name}");
        }
    }
}

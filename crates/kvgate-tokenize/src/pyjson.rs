//! Python `json.dumps` byte for byte, for template (`minijinja`) values.
//!
//! Chat templates run `tojson` over tool schemas and tool-call arguments; transformers
//! implements it as `json.dumps(x, ensure_ascii=False, indent=None, separators=None,
//! sort_keys=False)`. Anthropic `tool_use` inputs go through `json.dumps(x)` with the
//! default `ensure_ascii=True`. Both differ from `serde_json` in spacing (`", "`/`": "`),
//! float formatting (Python `repr`: `100.0`, `1e-05`, `1e+16`) and escaping (no HTML
//! escapes, `\uXXXX` only for control characters unless `ensure_ascii`).

use std::fmt::Write as _;

use minijinja::value::{Value as JValue, ValueKind};

/// `json.dumps` options that templates can pass to `tojson`.
#[derive(Debug, Clone)]
pub(crate) struct DumpOptions {
    /// Escape every non-ASCII character as `\uXXXX` (surrogate pairs above the BMP).
    pub(crate) ensure_ascii: bool,
    /// `None`: one line. `Some(s)`: newline plus `s` repeated per level.
    pub(crate) indent: Option<String>,
    /// Item separator (`", "`, or `","` when an indent is set).
    pub(crate) item_sep: String,
    /// Key separator (`": "`).
    pub(crate) key_sep: String,
    /// Sort object keys.
    pub(crate) sort_keys: bool,
}

impl DumpOptions {
    /// `json.dumps(x, ensure_ascii=ensure_ascii)` with every other argument at its default.
    pub(crate) fn python_default(ensure_ascii: bool) -> Self {
        DumpOptions {
            ensure_ascii,
            indent: None,
            item_sep: ", ".to_owned(),
            key_sep: ": ".to_owned(),
            sort_keys: false,
        }
    }
}

/// Appends a JSON string literal the way Python's encoder writes it.
pub(crate) fn write_str(out: &mut String, s: &str, ensure_ascii: bool) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => {
                let _ = write!(out, "\\u{:04x}", c as u32);
            }
            c if ensure_ascii && !c.is_ascii() => {
                let mut units = [0u16; 2];
                for unit in c.encode_utf16(&mut units) {
                    let _ = write!(out, "\\u{unit:04x}");
                }
            }
            c => out.push(c),
        }
    }
    out.push('"');
}

/// Python `float.__repr__` (as `json.dumps` writes floats, with `NaN`/`Infinity`).
pub(crate) fn float_repr(f: f64) -> String {
    if f.is_nan() {
        return "NaN".to_owned();
    }
    if f.is_infinite() {
        return if f > 0.0 { "Infinity" } else { "-Infinity" }.to_owned();
    }
    // `{:e}` gives the shortest round-trip digits: "-1.2345e-7", "1e16", "0e0".
    let sci = format!("{f:e}");
    let (mantissa, exp) = sci.split_once('e').unwrap_or((sci.as_str(), "0"));
    let exp: i32 = exp.parse().unwrap_or(0);
    let (neg, mantissa) = match mantissa.strip_prefix('-') {
        Some(m) => (true, m),
        None => (false, mantissa),
    };
    let digits: String = mantissa.chars().filter(|c| *c != '.').collect();
    let mut out = String::with_capacity(digits.len() + 8);
    if neg {
        out.push('-');
    }
    if (-4..16).contains(&exp) {
        if exp < 0 {
            out.push_str("0.");
            for _ in 0..(-exp - 1) {
                out.push('0');
            }
            out.push_str(&digits);
        } else {
            let int_len = exp as usize + 1;
            if digits.len() <= int_len {
                out.push_str(&digits);
                for _ in digits.len()..int_len {
                    out.push('0');
                }
                out.push_str(".0");
            } else {
                out.push_str(&digits[..int_len]);
                out.push('.');
                out.push_str(&digits[int_len..]);
            }
        }
    } else {
        out.push_str(&digits[..1]);
        if digits.len() > 1 {
            out.push('.');
            out.push_str(&digits[1..]);
        }
        out.push('e');
        out.push(if exp < 0 { '-' } else { '+' });
        let _ = write!(out, "{:02}", exp.unsigned_abs());
    }
    out
}

fn newline_indent(out: &mut String, opts: &DumpOptions, level: usize) {
    if let Some(indent) = &opts.indent {
        out.push('\n');
        for _ in 0..level {
            out.push_str(indent);
        }
    }
}

/// Why a template value cannot be dumped (Python would raise `TypeError`).
#[derive(Debug, thiserror::Error)]
#[error("object of kind {0} is not JSON serializable")]
pub(crate) struct NotSerializable(pub(crate) String);

/// `json.dumps` of a template value (the `tojson` filter).
pub(crate) fn dumps_template(v: &JValue, opts: &DumpOptions) -> Result<String, NotSerializable> {
    let mut out = String::new();
    write_template(&mut out, v, opts, 0)?;
    Ok(out)
}

fn dict_key(k: &JValue) -> Result<String, NotSerializable> {
    Ok(match k.kind() {
        ValueKind::String => k.as_str().unwrap_or_default().to_owned(),
        ValueKind::None => "null".to_owned(),
        ValueKind::Bool => if k.is_true() { "true" } else { "false" }.to_owned(),
        ValueKind::Number if k.is_integer() => k.to_string(),
        ValueKind::Number => float_repr(f64::try_from(k.clone()).unwrap_or(f64::NAN)),
        other => return Err(NotSerializable(format!("{other:?} (as a key)"))),
    })
}

fn write_template(
    out: &mut String,
    v: &JValue,
    opts: &DumpOptions,
    level: usize,
) -> Result<(), NotSerializable> {
    match v.kind() {
        ValueKind::None => out.push_str("null"),
        ValueKind::Bool => out.push_str(if v.is_true() { "true" } else { "false" }),
        ValueKind::Number => {
            if v.is_integer() {
                out.push_str(&v.to_string());
            } else {
                out.push_str(&float_repr(f64::try_from(v.clone()).unwrap_or(f64::NAN)));
            }
        }
        ValueKind::String => write_str(out, v.as_str().unwrap_or_default(), opts.ensure_ascii),
        ValueKind::Bytes => return Err(NotSerializable("bytes".to_owned())),
        ValueKind::Seq | ValueKind::Iterable => {
            let items: Vec<JValue> = v
                .try_iter()
                .map_err(|e| NotSerializable(e.to_string()))?
                .collect();
            if items.is_empty() {
                out.push_str("[]");
                return Ok(());
            }
            out.push('[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_template(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push(']');
        }
        ValueKind::Map => {
            let keys: Vec<JValue> = v
                .try_iter()
                .map_err(|e| NotSerializable(e.to_string()))?
                .collect();
            let mut entries = Vec::with_capacity(keys.len());
            for k in keys {
                let item = v.get_item(&k).map_err(|e| NotSerializable(e.to_string()))?;
                entries.push((dict_key(&k)?, item));
            }
            if entries.is_empty() {
                out.push_str("{}");
                return Ok(());
            }
            if opts.sort_keys {
                entries.sort_by(|a, b| a.0.cmp(&b.0));
            }
            out.push('{');
            for (i, (k, item)) in entries.iter().enumerate() {
                if i > 0 {
                    out.push_str(&opts.item_sep);
                }
                newline_indent(out, opts, level + 1);
                write_str(out, k, opts.ensure_ascii);
                out.push_str(&opts.key_sep);
                write_template(out, item, opts, level + 1)?;
            }
            newline_indent(out, opts, level);
            out.push('}');
        }
        other => return Err(NotSerializable(format!("{other:?}"))),
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn float_repr_matches_python() {
        let cases = [
            (1.0, "1.0"),
            (100.0, "100.0"),
            (0.1, "0.1"),
            (-0.0, "-0.0"),
            (0.0, "0.0"),
            (1e16, "1e+16"),
            (1.5e16, "1.5e+16"),
            (123456789012345.6, "123456789012345.6"),
            (1e15, "1000000000000000.0"),
            (0.0001, "0.0001"),
            (0.00001, "1e-05"),
            (1.5e-7, "1.5e-07"),
            (2.5, "2.5"),
            (1e300, "1e+300"),
            (-3.25, "-3.25"),
            (f64::INFINITY, "Infinity"),
            (f64::NAN, "NaN"),
        ];
        for (f, want) in cases {
            assert_eq!(float_repr(f), want, "{f}");
        }
    }

    #[test]
    fn dumps_like_python() {
        let v: serde_json::Value =
            serde_json::from_str(r#"{"b":1,"a":[1.0,"<&>",{"ü":"\u00fc\n\u0001"}],"e":{},"f":[]}"#)
                .unwrap();
        let cases = [
            (
                DumpOptions::python_default(false),
                "{\"b\": 1, \"a\": [1.0, \"<&>\", {\"ü\": \"ü\\n\\u0001\"}], \"e\": {}, \"f\": []}",
            ),
            (
                DumpOptions::python_default(true),
                "{\"b\": 1, \"a\": [1.0, \"<&>\", {\"\\u00fc\": \"\\u00fc\\n\\u0001\"}], \"e\": {}, \"f\": []}",
            ),
            (
                DumpOptions {
                    indent: Some("  ".into()),
                    item_sep: ",".into(),
                    sort_keys: true,
                    ..DumpOptions::python_default(false)
                },
                "{\n  \"a\": [\n    1.0,\n    \"<&>\",\n    {\n      \"ü\": \"ü\\n\\u0001\"\n    }\n  ],\n  \"b\": 1,\n  \"e\": {},\n  \"f\": []\n}",
            ),
        ];
        for (opts, want) in cases {
            let tv = JValue::from(minijinja::value::Serde(&v));
            assert_eq!(dumps_template(&tv, &opts).unwrap(), want);
        }
    }

    #[test]
    fn astral_escapes_as_surrogates() {
        let mut s = String::new();
        write_str(&mut s, "😀", true);
        assert_eq!(s, "\"\\ud83d\\ude00\"");
    }
}

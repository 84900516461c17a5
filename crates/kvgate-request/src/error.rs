//! Request parse errors and the OpenAI-shaped JSON error body.

use crate::request::Field;

/// Why a request body was rejected. Every case is a client error (HTTP 400).
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParseError {
    /// The body is not valid JSON.
    #[error("invalid JSON at line {line} column {column} (byte {offset}): {reason}")]
    InvalidJson {
        /// 1-based line of the error.
        line: usize,
        /// 1-based column (in bytes) of the error.
        column: usize,
        /// 0-based byte offset of the error in the body.
        offset: usize,
        /// What the JSON parser expected or found there.
        reason: String,
    },
    /// The body is JSON, but its top level is not an object.
    #[error("request body must be a JSON object")]
    NotAnObject,
    /// A top-level key kvgate reads appears twice; engines and kvgate could disagree on it.
    #[error("duplicate top-level key `{}`", .0.key())]
    DuplicateKey(Field),
    /// The API needs a `model` and the body has none (or it is `null`).
    #[error("missing required top-level key `model`")]
    MissingModel,
    /// A top-level key has the wrong JSON type.
    #[error("top-level key `{}` must be {expected}", field.key())]
    WrongType {
        /// The offending key.
        field: Field,
        /// The JSON type it must have.
        expected: &'static str,
    },
}

impl ParseError {
    /// A stable machine-readable code for the `code` member of the error body.
    pub fn code(&self) -> &'static str {
        match self {
            ParseError::InvalidJson { .. } => "invalid_json",
            ParseError::NotAnObject => "body_not_object",
            ParseError::DuplicateKey(Field::Model) => "duplicate_model_key",
            ParseError::DuplicateKey(_) => "duplicate_key",
            ParseError::MissingModel => "missing_model",
            ParseError::WrongType { .. } => "wrong_type",
        }
    }

    /// The error as an OpenAI-shaped JSON body.
    pub fn to_body(&self) -> ErrorBody {
        ErrorBody::new(self.to_string(), "invalid_request_error", self.code())
    }
}

/// An OpenAI-shaped error, `{"error":{"message","type","code"}}`.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ErrorBody {
    /// Human-readable description naming the thing at fault.
    pub message: String,
    /// Error class, e.g. `invalid_request_error`, `upstream_error`, `overloaded_error`.
    #[serde(rename = "type")]
    pub kind: &'static str,
    /// Stable machine-readable code.
    pub code: &'static str,
}

impl ErrorBody {
    /// Builds an error body.
    pub fn new(message: impl Into<String>, kind: &'static str, code: &'static str) -> Self {
        Self {
            message: message.into(),
            kind,
            code,
        }
    }

    /// Serializes to `{"error":{...}}` bytes.
    pub fn to_json(&self) -> Vec<u8> {
        #[derive(serde::Serialize)]
        struct Envelope<'a> {
            error: &'a ErrorBody,
        }
        // Serializing a struct of strings cannot fail; fall back to a fixed body regardless.
        serde_json::to_vec(&Envelope { error: self }).unwrap_or_else(|_| {
            br#"{"error":{"message":"internal error","type":"internal_error","code":"internal"}}"#
                .to_vec()
        })
    }
}

/// Converts a serde_json syntax error into [`ParseError::InvalidJson`] with a byte offset.
pub(crate) fn invalid_json(body: &[u8], err: &serde_json::Error) -> ParseError {
    let (line, column) = (err.line(), err.column());
    let offset = byte_offset(body, line, column);
    let full = err.to_string();
    // serde_json appends " at line L column C"; keep only the reason.
    let reason = match full.rfind(" at line ") {
        Some(i) => full[..i].to_owned(),
        None => full,
    };
    ParseError::InvalidJson {
        line,
        column,
        offset,
        reason,
    }
}

/// [`ParseError::InvalidJson`] for a body whose bytes are not UTF-8 from `offset` on (JSON
/// text is UTF-8; serde_json does not check the values it skips).
pub(crate) fn invalid_utf8(body: &[u8], offset: usize) -> ParseError {
    let before = &body[..offset.min(body.len())];
    let line_start = memchr::memrchr(b'\n', before).map_or(0, |i| i + 1);
    ParseError::InvalidJson {
        line: memchr::memchr_iter(b'\n', before).count() + 1,
        column: before.len() - line_start + 1,
        offset,
        reason: "invalid UTF-8".to_owned(),
    }
}

fn byte_offset(body: &[u8], line: usize, column: usize) -> usize {
    let mut start = 0;
    for _ in 1..line {
        match memchr::memchr(b'\n', &body[start..]) {
            Some(i) => start += i + 1,
            None => break,
        }
    }
    (start + column.saturating_sub(1)).min(body.len())
}

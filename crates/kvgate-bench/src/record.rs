//! [`RequestRecord`]: what the load client measured for one request.

use std::fmt;

use serde::{Deserialize, Serialize};

/// Why a request failed. Failures are data, counted per kind in the summary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ErrorKind {
    /// The TCP connection could not be made.
    Connect,
    /// The server answered with a non-2xx status.
    HttpStatus(u16),
    /// The request did not complete within the timeout.
    Timeout,
    /// The connection or body failed after the request was sent, or the stream ended in
    /// the middle of an event.
    StreamBroken,
    /// An SSE `data:` payload (or a non-stream body) was not valid JSON, or an SSE event was
    /// over the 1 MiB cap (`kvgate_request::DEFAULT_MAX_EVENT_BYTES`) and was skipped.
    BadSse,
    /// The stream carried an `error` object (the engine failed mid-stream).
    StreamError,
}

impl fmt::Display for ErrorKind {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Self::Connect => f.write_str("connect"),
            Self::HttpStatus(code) => write!(f, "http_{code}"),
            Self::Timeout => f.write_str("timeout"),
            Self::StreamBroken => f.write_str("stream_broken"),
            Self::BadSse => f.write_str("bad_sse"),
            Self::StreamError => f.write_str("stream_error"),
        }
    }
}

/// One request's measurements. Times are milliseconds; `start_ms` is measured from the
/// start of the run, the others from the moment the request was handed to the client.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct RequestRecord {
    /// Position in the workload (conversation by conversation, turn by turn); equal
    /// indices in two runs of one workload are the same request.
    pub index: usize,
    /// Conversation number within the workload.
    pub conversation: usize,
    /// Turn number within the conversation (0-based).
    pub turn: usize,
    /// The workload group (shared-prefix group, agent, burst).
    pub group: u32,
    /// When the request was sent, from the run's start.
    pub start_ms: f64,
    /// Time to the first content event (for a non-streamed response: to the whole body).
    pub ttft_ms: Option<f64>,
    /// Gaps between consecutive content events.
    pub itl_ms: Vec<f64>,
    /// Time to the end of the response (or to the failure).
    pub e2e_ms: f64,
    /// The HTTP status, when a response head arrived.
    pub status: Option<u16>,
    /// Whether the response was an SSE stream.
    pub streamed: bool,
    /// Number of SSE events that carried content (text, reasoning or tool-call deltas).
    pub content_events: u32,
    /// `usage.prompt_tokens` from the final usage.
    pub prompt_tokens: Option<u64>,
    /// `usage.prompt_tokens_details.cached_tokens` from the final usage.
    pub cached_tokens: Option<u64>,
    /// `usage.completion_tokens` from the final usage.
    pub completion_tokens: Option<u64>,
    /// Why the request failed; `None` on success.
    pub error: Option<ErrorKind>,
}

impl RequestRecord {
    /// Whether the request completed without error.
    pub fn is_ok(&self) -> bool {
        self.error.is_none()
    }

    /// Output tokens: `usage.completion_tokens`, or the number of content events when the
    /// server reported no usage.
    pub fn output_tokens(&self) -> u64 {
        self.completion_tokens
            .unwrap_or(u64::from(self.content_events))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn error_kind_names() {
        let cases = [
            (ErrorKind::Connect, "connect"),
            (ErrorKind::HttpStatus(503), "http_503"),
            (ErrorKind::Timeout, "timeout"),
            (ErrorKind::StreamBroken, "stream_broken"),
            (ErrorKind::BadSse, "bad_sse"),
            (ErrorKind::StreamError, "stream_error"),
        ];
        for (kind, want) in cases {
            assert_eq!(kind.to_string(), want);
        }
    }
}

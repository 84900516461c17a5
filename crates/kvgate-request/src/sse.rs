//! Server-sent events framing: where an event ends, what its `data` is, and an incremental
//! splitter with a cap on the size of one event.
//!
//! An event is a run of lines ended by a blank line; lines end in `\n` or `\r\n`. Its
//! payload is the value of its `data` fields (one leading space stripped), joined by `\n`.
//! Comment lines (`:` first) and other fields are ignored. This is the one definition of the
//! framing in the tree: the proxy's model rewrite and usage observer and the load client all
//! read streams through it.

use std::borrow::Cow;

/// The default cap on one event's size, blank line included: 1 MiB.
///
/// Engines send one token (or one usage object) per event, a few hundred bytes; an event
/// this large means a broken or hostile stream.
pub const DEFAULT_MAX_EVENT_BYTES: usize = 1 << 20;

/// Offset just past the first complete event in `buf` (its blank line included), or `None`
/// when `buf` holds no complete event.
pub fn event_end(buf: &[u8]) -> Option<usize> {
    let mut from = 0;
    while let Some(i) = memchr::memchr(b'\n', &buf[from..]) {
        let nl = from + i;
        let next = &buf[nl + 1..];
        if next.starts_with(b"\n") {
            return Some(nl + 2);
        }
        if next.starts_with(b"\r\n") {
            return Some(nl + 3);
        }
        from = nl + 1;
    }
    None
}

/// The `data` payload of one event (as [`event_end`] delimits it), or `None` when the
/// event has no `data` field. Borrowed unless several `data` lines have to be joined.
pub fn event_data(event: &[u8]) -> Option<Cow<'_, [u8]>> {
    let mut data: Option<Cow<'_, [u8]>> = None;
    for line in event.split(|b| *b == b'\n') {
        let line = line.strip_suffix(b"\r").unwrap_or(line);
        let (field, value) = match memchr::memchr(b':', line) {
            Some(0) => continue, // a comment
            Some(i) => {
                let value = &line[i + 1..];
                (&line[..i], value.strip_prefix(b" ").unwrap_or(value))
            }
            None => (line, &b""[..]),
        };
        if field != b"data" {
            continue;
        }
        data = Some(match data {
            None => Cow::Borrowed(value),
            Some(joined) => {
                let mut joined = joined.into_owned();
                joined.push(b'\n');
                joined.extend_from_slice(value);
                Cow::Owned(joined)
            }
        });
    }
    data
}

/// What [`SseEvents`] hands out, in stream order: together the pieces are the stream, byte
/// for byte.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SsePiece<'a> {
    /// A complete event, its closing blank line included, within the cap.
    Event(&'a [u8]),
    /// Bytes passed over unread: those of an event over the cap, or at the end of the stream
    /// an incomplete last line (or trailing blank lines).
    Unread(&'a [u8]),
}

/// Splits an SSE byte stream into complete events, holding at most one capped partial event.
///
/// Complete events inside a chunk are handed out in place; only the partial event at the end
/// of a chunk is copied, to join it with the next one. An event longer than the cap (blank
/// line included) is passed over whole, however the stream is chunked: its bytes come out as
/// [`SsePiece::Unread`] as they arrive, it is counted in
/// [`oversize_events`](Self::oversize_events), and the events after it are read as usual.
#[derive(Debug)]
pub struct SseEvents {
    max_event_bytes: usize,
    /// The incomplete event so far; while skipping, only its last two bytes (enough to see a
    /// blank line that straddles two chunks).
    partial: Vec<u8>,
    /// Whether the current event went over the cap and is being passed over.
    skipping: bool,
    oversize: u64,
}

impl Default for SseEvents {
    fn default() -> Self {
        Self::new()
    }
}

impl SseEvents {
    /// A splitter with the [`DEFAULT_MAX_EVENT_BYTES`] cap.
    pub fn new() -> Self {
        Self::with_max_event_bytes(DEFAULT_MAX_EVENT_BYTES)
    }

    /// A splitter that passes over events longer than `max_event_bytes`.
    pub fn with_max_event_bytes(max_event_bytes: usize) -> Self {
        Self {
            max_event_bytes,
            partial: Vec::new(),
            skipping: false,
            oversize: 0,
        }
    }

    /// The cap on one event's size, in bytes.
    pub fn max_event_bytes(&self) -> usize {
        self.max_event_bytes
    }

    /// How many events were passed over so far because they were over the cap.
    pub fn oversize_events(&self) -> u64 {
        self.oversize
    }

    /// Feeds the next chunk; calls `on_piece` with every event it completes and every byte
    /// it passes over, in order.
    pub fn push(&mut self, chunk: &[u8], mut on_piece: impl FnMut(SsePiece<'_>)) {
        let mut rest = chunk;
        if self.skipping || !self.partial.is_empty() {
            let Some(end) = end_after(&self.partial, rest) else {
                self.keep(rest, &mut on_piece);
                return;
            };
            if self.skipping {
                on_piece(SsePiece::Unread(&rest[..end]));
            } else {
                self.partial.extend_from_slice(&rest[..end]);
                let event = std::mem::take(&mut self.partial);
                self.deliver(&event, &mut on_piece);
                self.partial = event;
            }
            self.partial.clear();
            self.skipping = false;
            rest = &rest[end..];
        }
        while let Some(end) = event_end(rest) {
            self.deliver(&rest[..end], &mut on_piece);
            rest = &rest[end..];
        }
        self.keep(rest, &mut on_piece);
    }

    /// Ends the stream and hands out what is left: a last event whose final line is complete
    /// but lacks the blank line as an [`SsePiece::Event`], anything else as
    /// [`SsePiece::Unread`]. Returns `false` when the stream stopped in the middle of a line
    /// (a truncated stream). The splitter is then ready for a new stream.
    pub fn finish(&mut self, mut on_piece: impl FnMut(SsePiece<'_>)) -> bool {
        let partial = std::mem::take(&mut self.partial);
        if std::mem::take(&mut self.skipping) {
            return partial.ends_with(b"\n");
        }
        let last_line =
            memchr::memrchr(b'\n', &partial).map_or(&partial[..], |i| &partial[i + 1..]);
        let clean = last_line.iter().all(u8::is_ascii_whitespace);
        if clean && !partial.trim_ascii().is_empty() {
            self.deliver(&partial, &mut on_piece);
        } else if !partial.is_empty() {
            on_piece(SsePiece::Unread(&partial));
        }
        clean
    }

    /// Bytes held for the partial event.
    pub fn held_bytes(&self) -> usize {
        if self.skipping { 0 } else { self.partial.len() }
    }

    fn deliver(&mut self, event: &[u8], on_piece: &mut impl FnMut(SsePiece<'_>)) {
        if event.len() > self.max_event_bytes {
            self.oversize += 1;
            on_piece(SsePiece::Unread(event));
        } else {
            on_piece(SsePiece::Event(event));
        }
    }

    /// Holds `bytes` of an event that has not ended yet; passes the event over once it is
    /// over the cap.
    fn keep(&mut self, bytes: &[u8], on_piece: &mut impl FnMut(SsePiece<'_>)) {
        if !self.skipping && self.partial.len() + bytes.len() > self.max_event_bytes {
            self.oversize += 1;
            self.skipping = true;
            if !self.partial.is_empty() {
                on_piece(SsePiece::Unread(&self.partial));
            }
        }
        if self.skipping {
            if !bytes.is_empty() {
                on_piece(SsePiece::Unread(bytes));
            }
            keep_tail(&mut self.partial, bytes);
        } else {
            self.partial.extend_from_slice(bytes);
        }
    }
}

/// Where, in `chunk`, the event ends whose earlier bytes ended with `before` (which holds no
/// complete event); only the last two bytes of `before` are looked at.
fn end_after(before: &[u8], chunk: &[u8]) -> Option<usize> {
    let tail = &before[before.len().saturating_sub(2)..];
    let mut seam = [0u8; 4];
    let lead = chunk.len().min(2);
    seam[..tail.len()].copy_from_slice(tail);
    seam[tail.len()..tail.len() + lead].copy_from_slice(&chunk[..lead]);
    if let Some(end) = event_end(&seam[..tail.len() + lead]) {
        return Some(end.saturating_sub(tail.len()));
    }
    event_end(chunk)
}

/// Appends `bytes` to `buf` and keeps only the last two bytes: enough for [`end_after`] to
/// see a blank line that straddles two chunks.
fn keep_tail(buf: &mut Vec<u8>, bytes: &[u8]) {
    buf.extend_from_slice(&bytes[bytes.len().saturating_sub(2)..]);
    let cut = buf.len().saturating_sub(2);
    buf.drain(..cut);
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Splits `stream` at every chunk size; returns the events' payloads, the oversize count
    /// and what `finish` said, asserting that they do not depend on the chunking and that the
    /// pieces add up to the stream.
    fn split(stream: &str, max: usize) -> (Vec<String>, u64, bool) {
        let mut seen: Option<(Vec<String>, u64, bool)> = None;
        for size in 1..=stream.len().max(1) {
            let mut events = SseEvents::with_max_event_bytes(max);
            let (mut out, mut all) = (Vec::new(), Vec::new());
            let mut on_piece = |piece: SsePiece<'_>| match piece {
                SsePiece::Event(e) => {
                    all.extend_from_slice(e);
                    if let Some(data) = event_data(e) {
                        out.push(String::from_utf8(data.into_owned()).unwrap());
                    }
                }
                SsePiece::Unread(bytes) => all.extend_from_slice(bytes),
            };
            for chunk in stream.as_bytes().chunks(size) {
                events.push(chunk, &mut on_piece);
            }
            let clean = events.finish(&mut on_piece);
            assert_eq!(all, stream.as_bytes(), "{stream:?} at chunk size {size}");
            let got = (out, events.oversize_events(), clean);
            if let Some(first) = &seen {
                assert_eq!(&got, first, "{stream:?} at chunk size {size}");
            }
            seen = Some(got);
        }
        seen.unwrap()
    }

    #[test]
    fn framing_at_every_split() {
        let big = "data: 0123456789\n\n"; // 18 bytes, over a cap of 17
        let cases = [
            ("lf", "data: a\n\ndata: b\n\n", 64, vec!["a", "b"], 0, true),
            (
                "crlf",
                "data: a\r\n\r\ndata:b\r\n\r\n",
                64,
                vec!["a", "b"],
                0,
                true,
            ),
            (
                "lf then crlf",
                "data: a\n\r\ndata: b\r\n\n",
                64,
                vec!["a", "b"],
                0,
                true,
            ),
            (
                "multi-line data",
                "data: a\ndata: b\n\n",
                64,
                vec!["a\nb"],
                0,
                true,
            ),
            ("empty data", "data\n\ndata:\n\n", 64, vec!["", ""], 0, true),
            (
                "comments and fields",
                ": ping\nevent: x\nid: 1\ndata: a\n\n: only a comment\n\n",
                64,
                vec!["a"],
                0,
                true,
            ),
            (
                "missing final blank line",
                "data: a\n\ndata: [DONE]\n",
                64,
                vec!["a", "[DONE]"],
                0,
                true,
            ),
            (
                "truncated",
                "data: a\n\ndata: {\"x",
                64,
                vec!["a"],
                0,
                false,
            ),
            ("empty", "", 64, vec![], 0, true),
            (
                "at the cap",
                "data: 012345678\n\n",
                17,
                vec!["012345678"],
                0,
                true,
            ),
            ("over the cap", big, 17, vec![], 1, true),
            (
                "events after an oversize one",
                "data: a\n\ndata: 0123456789\n\ndata: b\r\n\r\n",
                17,
                vec!["a", "b"],
                1,
                true,
            ),
            (
                "two oversize events",
                "data: 0123456789\n\ndata: 0123456789\r\n\r\ndata: c\n\n",
                17,
                vec!["c"],
                2,
                true,
            ),
            (
                "oversize and truncated",
                "data: a\n\ndata: 0123456789012",
                17,
                vec!["a"],
                1,
                false,
            ),
        ];
        for (name, stream, max, want, want_oversize, want_clean) in cases {
            let (got, oversize, clean) = split(stream, max);
            assert_eq!(got, want, "{name}");
            assert_eq!(oversize, want_oversize, "{name}");
            assert_eq!(clean, want_clean, "{name}");
        }
    }

    #[test]
    fn partial_event_stays_under_the_cap() {
        let mut events = SseEvents::with_max_event_bytes(64);
        let (mut read, mut unread) = (Vec::new(), 0);
        let mut on_piece = |piece: SsePiece<'_>| match piece {
            SsePiece::Event(e) => read.push(e.to_vec()),
            SsePiece::Unread(bytes) => unread += bytes.len(),
        };
        let line = b"data: xxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxxx";
        for _ in 0..1000 {
            events.push(line, &mut on_piece);
            assert!(
                events.held_bytes() <= 64,
                "{} bytes held",
                events.held_bytes()
            );
        }
        events.push(b"\n\ndata: after\n\n", &mut on_piece);
        assert_eq!(read, vec![b"data: after\n\n".to_vec()]);
        assert_eq!(unread, 1000 * line.len() + 2);
        assert_eq!(events.oversize_events(), 1);
    }

    #[test]
    fn event_data_payloads() {
        let cases = [
            ("one line", "data: {\"a\":1}\n\n", Some("{\"a\":1}")),
            ("no space", "data:x\n\n", Some("x")),
            ("two spaces keep one", "data:  x\n\n", Some(" x")),
            ("joined", "data: a\r\ndata: b\r\n\r\n", Some("a\nb")),
            ("no data field", "event: ping\nid: 3\n\n", None),
            ("comment", ": data: x\n\n", None),
            ("field prefix is not data", "datum: x\n\n", None),
        ];
        for (name, event, want) in cases {
            let got = event_data(event.as_bytes());
            assert_eq!(got.as_deref(), want.map(str::as_bytes), "{name}");
        }
    }
}

//! The probe's fast path: one pass over a body already checked to be UTF-8, which checks the
//! JSON grammar and notes where each read field's value lies, without allocating or decoding
//! anything.
//!
//! serde_json reads a string a word at a time, checking each byte for a quote, a backslash
//! and a control character: most of a chat body's probe is that walk over `messages`. Here a
//! string is skipped with a SIMD search for its next quote or backslash, and control
//! characters are looked for once, over the whole body (a compact body has none, so no string
//! needs the check; otherwise each string's bytes are checked).
//!
//! It answers only when it is sure: `None` for anything it does not take in full (an error of
//! any kind, a key spelled with an escape, a read key given twice, nesting deeper than
//! [`MAX_DEPTH`]). The caller then runs serde_json, whose verdict and error message stand. So
//! when this accepts a body, serde_json accepts it too, with the same spans: the same
//! grammar (serde_json's whitespace, number forms, escapes; strings it skips need no
//! surrogate pairing, and neither do these).

use std::ops::Range;

use memchr::memchr2;

use super::{Field, Spans};

/// Deepest nesting taken here (the top-level object is 1). serde_json's limit is 128.
const MAX_DEPTH: usize = 100;

/// The spans of the read fields of `body`, a JSON object; `None` when unsure (see the module
/// docs).
pub(super) fn spans(body: &[u8]) -> Option<Spans> {
    let mut scan = Scan {
        b: body,
        i: 0,
        check_controls: has_control(body),
    };
    let mut spans = Spans::default();
    scan.ws();
    scan.eat(b'{')?;
    scan.items(b'}', |scan| {
        let (key, value) = scan.member(1)?;
        let key = &body[key];
        if let Some(field) = Field::ALL.into_iter().find(|f| f.key().as_bytes() == key) {
            let slot = &mut spans[field.slot()];
            if slot.is_some() {
                return None;
            }
            *slot = Some(value);
        }
        Some(())
    })?;
    scan.ws();
    (scan.i == body.len()).then_some(spans)
}

/// Whether `bytes` holds a byte below 0x20: the minimum of each 256-byte block, which the
/// compiler computes with SIMD, one horizontal reduction a block.
fn has_control(bytes: &[u8]) -> bool {
    bytes
        .chunks(256)
        .any(|block| block.iter().fold(u8::MAX, |m, &b| m.min(b)) < 0x20)
}

struct Scan<'b> {
    b: &'b [u8],
    i: usize,
    /// Whether strings must be checked for control characters (the body has some).
    check_controls: bool,
}

impl Scan<'_> {
    fn peek(&self) -> Option<u8> {
        self.b.get(self.i).copied()
    }

    fn next(&mut self) -> Option<u8> {
        let b = self.peek()?;
        self.i += 1;
        Some(b)
    }

    fn eat(&mut self, want: u8) -> Option<()> {
        (self.next()? == want).then_some(())
    }

    fn eat_if(&mut self, want: u8) -> bool {
        let hit = self.peek() == Some(want);
        self.i += usize::from(hit);
        hit
    }

    /// serde_json's whitespace: space, tab, line feed, carriage return.
    fn ws(&mut self) {
        while matches!(self.peek(), Some(b' ' | b'\t' | b'\n' | b'\r')) {
            self.i += 1;
        }
    }

    /// One value at nesting `depth` (that of its container).
    fn value(&mut self, depth: usize) -> Option<()> {
        match self.next()? {
            b'"' => self.string(false).map(drop),
            b'{' if depth < MAX_DEPTH => self.object(depth + 1),
            b'[' if depth < MAX_DEPTH => self.array(depth + 1),
            b't' => self.rest_of(b"rue"),
            b'f' => self.rest_of(b"alse"),
            b'n' => self.rest_of(b"ull"),
            b'-' => match self.next()? {
                b'0'..=b'9' => self.number(),
                _ => None,
            },
            b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    /// The rest of an object after its `{`.
    fn object(&mut self, depth: usize) -> Option<()> {
        self.items(b'}', |s| s.member(depth).map(drop))
    }

    /// The rest of an array after its `[`.
    fn array(&mut self, depth: usize) -> Option<()> {
        self.items(b']', |s| s.value(depth))
    }

    /// The rest of a container after its opening bracket: `item` for each element, the
    /// elements separated by commas, up to `close`.
    fn items(&mut self, close: u8, mut item: impl FnMut(&mut Self) -> Option<()>) -> Option<()> {
        self.ws();
        if self.eat_if(close) {
            return Some(());
        }
        loop {
            item(self)?;
            self.ws();
            match self.next()? {
                b',' => self.ws(),
                b if b == close => return Some(()),
                _ => return None,
            }
        }
    }

    /// One member of an object at nesting `depth`: where its key's text and its value lie.
    fn member(&mut self, depth: usize) -> Option<(Range<usize>, Range<usize>)> {
        self.eat(b'"')?;
        let key_start = self.i;
        let key_end = self.string(true)?;
        self.ws();
        self.eat(b':')?;
        self.ws();
        let start = self.i;
        self.value(depth)?;
        Some((key_start..key_end, start..self.i))
    }

    fn rest_of(&mut self, word: &[u8]) -> Option<()> {
        let end = self.i + word.len();
        (self.b.get(self.i..end)? == word).then(|| self.i = end)
    }

    /// The rest of a number after its first digit: the integer's other digits (none after a
    /// leading `0`), then an optional fraction and exponent, each with at least one digit.
    fn number(&mut self) -> Option<()> {
        if self.b[self.i - 1] != b'0' {
            self.digits();
        }
        if self.eat_if(b'.') {
            self.digit()?;
            self.digits();
        }
        if matches!(self.peek(), Some(b'e' | b'E')) {
            self.i += 1;
            if matches!(self.peek(), Some(b'+' | b'-')) {
                self.i += 1;
            }
            self.digit()?;
            self.digits();
        }
        Some(())
    }

    fn digit(&mut self) -> Option<()> {
        self.next()?.is_ascii_digit().then_some(())
    }

    fn digits(&mut self) {
        while self.peek().is_some_and(|b| b.is_ascii_digit()) {
            self.i += 1;
        }
    }

    /// The rest of a string after its opening quote; the offset of its closing quote, with
    /// the position after it. A key (`key`) with an escape is not taken.
    fn string(&mut self, key: bool) -> Option<usize> {
        loop {
            let rest = &self.b[self.i..];
            let at = memchr2(b'"', b'\\', rest)?;
            if self.check_controls && has_control(&rest[..at]) {
                return None;
            }
            self.i += at + 1;
            if rest[at] == b'"' {
                return Some(self.i - 1);
            }
            if key {
                return None;
            }
            match self.next()? {
                b'"' | b'\\' | b'/' | b'b' | b'f' | b'n' | b'r' | b't' => {}
                b'u' => {
                    let end = self.i + 4;
                    if !self.b.get(self.i..end)?.iter().all(u8::is_ascii_hexdigit) {
                        return None;
                    }
                    self.i = end;
                }
                _ => return None,
            }
        }
    }
}

#[cfg(test)]
#[path = "scan/tests.rs"]
mod tests;

//! A quick reader for the usual shape of a `usage` object.
//!
//! Engines send `usage` as a flat object of counts, perhaps with a details object of counts
//! (vLLM: `{"prompt_tokens":520,"total_tokens":528,"completion_tokens":8,
//! "prompt_tokens_details":{"cached_tokens":496}}`). serde's derived reader matches every key
//! against eight field names through its generic machinery; this one reads that shape
//! directly. It reads nothing else: a value that is not an unsigned integer, `null` or such
//! an object, a key with an escape or a byte outside ASCII, a repeated known key or broken
//! JSON make it give up, and the caller parses with serde. Where it gives an answer, serde
//! gives the same one (a test checks this on random objects).

use super::{RawDetails, RawUsage};

/// The [`RawUsage`] of the object at the start of `json` (leading whitespace allowed), or
/// `None` when it is not of the shape this reader takes.
pub(super) fn raw_usage(json: &[u8]) -> Option<RawUsage> {
    let mut raw = RawUsage::default();
    // One bit a known key, to give up on a repeated one (serde refuses those).
    let mut seen = 0u8;
    Cursor { json, at: 0 }.object(|c, key| {
        let bit = match key {
            b"prompt_tokens" => 0,
            b"completion_tokens" => 1,
            b"prompt_tokens_details" => 2,
            b"input_tokens" => 3,
            b"output_tokens" => 4,
            b"cache_read_input_tokens" => 5,
            b"cache_creation_input_tokens" => 6,
            b"input_tokens_details" => 7,
            // Not read: a count or a flat object of counts is skipped.
            _ => return c.skip_counts(),
        };
        if seen & (1 << bit) != 0 {
            return None;
        }
        seen |= 1 << bit;
        match bit {
            0 => raw.prompt_tokens = c.count()?,
            1 => raw.completion_tokens = c.count()?,
            2 => raw.prompt_tokens_details = c.details()?,
            3 => raw.input_tokens = c.count()?,
            4 => raw.output_tokens = c.count()?,
            5 => raw.cache_read_input_tokens = c.count()?,
            6 => raw.cache_creation_input_tokens = c.count()?,
            _ => raw.input_tokens_details = c.details()?,
        }
        Some(())
    })?;
    Some(raw)
}

/// A position in the JSON text.
struct Cursor<'a> {
    json: &'a [u8],
    at: usize,
}

impl<'a> Cursor<'a> {
    /// The next byte that is not JSON whitespace, not consumed.
    fn peek(&mut self) -> Option<u8> {
        self.at = crate::top_level::skip_ws(self.json, self.at);
        self.json.get(self.at).copied()
    }

    /// Consumes `b` (after whitespace).
    fn eat(&mut self, b: u8) -> Option<()> {
        (self.peek()? == b).then(|| self.at += 1)
    }

    /// An object's members: `member` reads each value after its key and colon.
    fn object(&mut self, mut member: impl FnMut(&mut Self, &'a [u8]) -> Option<()>) -> Option<()> {
        self.eat(b'{')?;
        if self.peek()? == b'}' {
            self.at += 1;
            return Some(());
        }
        loop {
            let key = self.key()?;
            member(self, key)?;
            match self.peek()? {
                b',' => self.at += 1,
                b'}' => {
                    self.at += 1;
                    return Some(());
                }
                _ => return None,
            }
        }
    }

    /// A key of plain ASCII (no escape, no control byte) and the colon after it.
    fn key(&mut self) -> Option<&'a [u8]> {
        self.eat(b'"')?;
        let start = self.at;
        let rest = self.json.get(start..)?;
        let len = rest
            .iter()
            .position(|&b| b == b'"' || b == b'\\' || !(0x20..0x80).contains(&b))?;
        if rest[len] != b'"' {
            return None;
        }
        self.at = start + len + 1;
        self.eat(b':')?;
        Some(&rest[..len])
    }

    /// An unsigned integer that fits `u64` (`Some`) or `null` (`None`).
    fn count(&mut self) -> Option<Option<u64>> {
        match self.peek()? {
            b'n' => {
                let rest = self.json.get(self.at..)?;
                if !rest.starts_with(b"null") {
                    return None;
                }
                self.at += 4;
                Some(None)
            }
            b'0'..=b'9' => {
                let start = self.at;
                let mut n: u64 = 0;
                while let Some(&d) = self.json.get(self.at).filter(|d| d.is_ascii_digit()) {
                    n = n.checked_mul(10)?.checked_add(u64::from(d - b'0'))?;
                    self.at += 1;
                }
                // A leading zero, a fraction or an exponent: not this reader's.
                let leading_zero = self.json[start] == b'0' && self.at - start > 1;
                let more = matches!(self.json.get(self.at), Some(b'.' | b'e' | b'E'));
                (!leading_zero && !more).then_some(Some(n))
            }
            _ => None,
        }
    }

    /// A details object (`Some`) or `null` (`None`).
    fn details(&mut self) -> Option<Option<RawDetails>> {
        if self.peek()? == b'n' {
            return self.count().map(|_| None);
        }
        let mut details = RawDetails::default();
        let mut seen = false;
        self.object(|c, key| {
            if key != b"cached_tokens" {
                return c.count().map(|_| ());
            }
            if std::mem::replace(&mut seen, true) {
                return None;
            }
            details.cached_tokens = c.count()?;
            Some(())
        })?;
        Some(Some(details))
    }

    /// A value that is not read: a count, `null` or a flat object of them.
    fn skip_counts(&mut self) -> Option<()> {
        if self.peek()? == b'{' {
            return self.object(|c, _| c.count().map(|_| ()));
        }
        self.count().map(|_| ())
    }
}

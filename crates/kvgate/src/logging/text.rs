//! The plain-text log line, written with less work.
//!
//! Its lines are byte for byte those of `tracing-subscriber`'s default (`full`) format with
//! colours off: timestamp, level, the spans with their fields, target, then the event's fields.
//! The default formatter spends about 12,000 instructions on a request's log line: styling
//! calls that write nothing when colours are off, a timestamp built up through `fmt`, the
//! message escaped a character at a time, every field through `fmt::Debug`. Here constant
//! parts are written whole, integers with `itoa`, a string that needs no escapes with two
//! quotes around it, and the message checked for the bytes that need escaping before any
//! escaping is done. Whatever is rare (an error's sources, a value only `Debug` can print)
//! takes the default formatter's own code. With colours on, the default formatter is used.

use std::{
    fmt::{self, Write as _},
    time::UNIX_EPOCH,
};

use tracing::{
    Event, Level, Subscriber,
    field::{Field, Visit},
};
use tracing_log::NormalizeEvent;
use tracing_subscriber::{
    field::{MakeVisitor, VisitFmt, VisitOutput},
    fmt::{
        FmtContext, FormatEvent, FormatFields, FormattedFields,
        format::{DefaultVisitor, Writer},
        time::FormatTime,
    },
    registry::LookupSpan,
};

/// The event format (see the module docs); `T` writes the timestamp.
#[derive(Debug)]
pub(crate) struct PlainText<T = Clock> {
    timer: T,
}

impl PlainText {
    /// The format with the wall clock.
    pub(crate) fn new() -> Self {
        Self { timer: Clock }
    }
}

impl<S, N, T> FormatEvent<S, N> for PlainText<T>
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
    T: FormatTime,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        // An event from the `log` crate carries its own target in its fields.
        let normalized = event.normalized_metadata();
        let meta = normalized.as_ref().unwrap_or_else(|| event.metadata());
        if self.timer.format_time(&mut writer).is_err() {
            writer.write_str("<unknown time>")?;
        }
        // The space after the timestamp, the level padded to five, and the space after it.
        writer.write_str(match *meta.level() {
            Level::TRACE => " TRACE ",
            Level::DEBUG => " DEBUG ",
            Level::INFO => "  INFO ",
            Level::WARN => "  WARN ",
            Level::ERROR => " ERROR ",
        })?;
        if let Some(scope) = ctx.event_scope() {
            let mut seen = false;
            for span in scope.from_root() {
                writer.write_str(span.metadata().name())?;
                seen = true;
                let ext = span.extensions();
                if let Some(fields) = ext.get::<FormattedFields<N>>()
                    && !fields.is_empty()
                {
                    writer.write_char('{')?;
                    writer.write_str(fields)?;
                    writer.write_char('}')?;
                }
                writer.write_char(':')?;
            }
            if seen {
                writer.write_char(' ')?;
            }
        }
        writer.write_str(meta.target())?;
        writer.write_str(": ")?;
        ctx.format_fields(writer.by_ref(), event)?;
        writer.write_char('\n')
    }
}

/// The field format for [`PlainText`], for events and spans alike.
#[derive(Debug, Default)]
pub(crate) struct PlainFields;

impl<'a> MakeVisitor<Writer<'a>> for PlainFields {
    type Visitor = PlainVisitor<'a>;

    fn make_visitor(&self, writer: Writer<'a>) -> PlainVisitor<'a> {
        PlainVisitor {
            writer,
            is_empty: true,
            result: Ok(()),
        }
    }
}

/// Writes fields as `name=value`, space-separated, the message first and without its name.
pub(crate) struct PlainVisitor<'a> {
    writer: Writer<'a>,
    /// No field written yet: the next one needs no space before it.
    is_empty: bool,
    result: fmt::Result,
}

impl PlainVisitor<'_> {
    /// A name written as it is: not the message, no `log.` metadata, no `r#` prefix.
    fn is_plain(field: &Field) -> bool {
        let name = field.name();
        name != "message" && !name.starts_with("log.") && !name.starts_with("r#")
    }

    /// Writes the space before any field but the first; false once a write has failed.
    fn pad(&mut self) -> bool {
        if self.result.is_err() {
            return false;
        }
        if self.is_empty {
            self.is_empty = false;
        } else if let Err(e) = self.writer.write_char(' ') {
            self.result = Err(e);
            return false;
        }
        true
    }

    /// A typed value: written by `plain` after a plain name, else as `Debug` prints `value`.
    fn typed(
        &mut self,
        field: &Field,
        value: &dyn fmt::Debug,
        plain: impl FnOnce(&mut Writer<'_>) -> fmt::Result,
    ) {
        if Self::is_plain(field) {
            self.plain(field, plain);
        } else {
            self.record_debug(field, value);
        }
    }

    /// Writes `value` as the field's value after `name=`, once no write has failed.
    fn plain(&mut self, field: &Field, value: impl FnOnce(&mut Writer<'_>) -> fmt::Result) {
        if !self.pad() {
            return;
        }
        self.result = self
            .writer
            .write_str(field.name())
            .and_then(|()| self.writer.write_char('='))
            .and_then(|()| value(&mut self.writer));
    }
}

impl Visit for PlainVisitor<'_> {
    fn record_str(&mut self, field: &Field, value: &str) {
        if field.name() == "message" {
            self.record_debug(field, &format_args!("{value}"));
        } else if Self::is_plain(field) {
            self.plain(field, |w| write_debug_str(w, value));
        } else {
            self.record_debug(field, &value);
        }
    }

    fn record_u64(&mut self, field: &Field, value: u64) {
        self.typed(field, &value, |w| {
            w.write_str(itoa::Buffer::new().format(value))
        });
    }

    fn record_i64(&mut self, field: &Field, value: i64) {
        self.typed(field, &value, |w| {
            w.write_str(itoa::Buffer::new().format(value))
        });
    }

    fn record_bool(&mut self, field: &Field, value: bool) {
        self.typed(field, &value, |w| {
            w.write_str(if value { "true" } else { "false" })
        });
    }

    fn record_f64(&mut self, field: &Field, value: f64) {
        self.typed(field, &value, |w| write!(w, "{value:?}"));
    }

    fn record_error(&mut self, field: &Field, value: &(dyn std::error::Error + 'static)) {
        if self.result.is_err() {
            return;
        }
        // Rare: the default visitor writes the error and its sources.
        let mut default = DefaultVisitor::new(self.writer.by_ref(), self.is_empty);
        default.record_error(field, value);
        self.result = default.finish();
        if !field.name().starts_with("log.") {
            self.is_empty = false;
        }
    }

    fn record_debug(&mut self, field: &Field, value: &dyn fmt::Debug) {
        let name = field.name();
        // The `log` crate's metadata, already in the line's target.
        if name.starts_with("log.") || !self.pad() {
            return;
        }
        self.result = if name == "message" {
            write!(Escaping(&mut self.writer), "{value:?}")
        } else {
            let name = name.strip_prefix("r#").unwrap_or(name);
            self.writer
                .write_str(name)
                .and_then(|()| self.writer.write_char('='))
                .and_then(|()| write!(self.writer, "{value:?}"))
        };
    }
}

impl VisitOutput<fmt::Result> for PlainVisitor<'_> {
    fn finish(self) -> fmt::Result {
        self.result
    }
}

impl VisitFmt for PlainVisitor<'_> {
    fn writer(&mut self) -> &mut dyn fmt::Write {
        &mut self.writer
    }
}

/// `value` as `fmt::Debug` prints a string: quoted, with escapes. A string of printable ASCII
/// with no quote or backslash needs none and is written whole.
fn write_debug_str(w: &mut Writer<'_>, value: &str) -> fmt::Result {
    if value
        .bytes()
        .all(|b| (b' '..=b'~').contains(&b) && b != b'"' && b != b'\\')
    {
        w.write_char('"')?;
        w.write_str(value)?;
        w.write_char('"')
    } else {
        write!(w, "{value:?}")
    }
}

/// Escapes what could drive a terminal, as the default formatter does in messages: ESC, BEL,
/// BS, FF and DEL as `\xNN`, the C1 controls (U+0080 to U+009F) as `\u{NN}`.
struct Escaping<'a, 'w>(&'a mut Writer<'w>);

impl fmt::Write for Escaping<'_, '_> {
    fn write_str(&mut self, s: &str) -> fmt::Result {
        // A C1 control is 0xC2 then 0x80..=0x9F in UTF-8.
        if !s
            .bytes()
            .any(|b| matches!(b, 0x1b | 0x07 | 0x08 | 0x0c | 0x7f | 0xc2))
        {
            return self.0.write_str(s);
        }
        for ch in s.chars() {
            match ch {
                '\x1b' => self.0.write_str("\\x1b")?,
                '\x07' => self.0.write_str("\\x07")?,
                '\x08' => self.0.write_str("\\x08")?,
                '\x0c' => self.0.write_str("\\x0c")?,
                '\x7f' => self.0.write_str("\\x7f")?,
                c if ('\u{80}'..='\u{9f}').contains(&c) => write!(self.0, "\\u{{{:x}}}", c as u32)?,
                c => self.0.write_char(c)?,
            }
        }
        Ok(())
    }
}

/// The wall clock as the default format prints it, `2026-12-06T23:59:59.123456Z` (UTC, to the
/// microsecond), formatted by `humantime` in one pass.
#[derive(Debug, Default, Clone, Copy)]
pub(crate) struct Clock;

/// The first second `humantime` cannot print (year 10000).
const YEAR_10000: u64 = 253_402_300_800;

impl FormatTime for Clock {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        let now = std::time::SystemTime::now();
        match now.duration_since(UNIX_EPOCH) {
            Ok(since) if since.as_secs() < YEAR_10000 => {
                write!(w, "{}", humantime::format_rfc3339_micros(now))
            }
            // Before 1970 or after 9999: the default timer's own signed years.
            _ => tracing_subscriber::fmt::time::SystemTime.format_time(w),
        }
    }
}

#[cfg(test)]
mod tests;

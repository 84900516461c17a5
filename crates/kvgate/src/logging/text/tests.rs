//! The plain-text format against `tracing-subscriber`'s default: the same bytes for the same
//! events, row by row.

use std::{
    error::Error,
    fmt, io,
    sync::{Arc, Mutex},
};

use tracing::{Level, debug, error, field::Empty, info, info_span, trace, warn};
use tracing_subscriber::fmt::{MakeWriter, format::Writer, time::FormatTime};

use super::*;

/// One timestamp for both formatters.
struct Fixed;

impl FormatTime for Fixed {
    fn format_time(&self, w: &mut Writer<'_>) -> fmt::Result {
        w.write_str("2026-12-06T23:59:59.000001Z")
    }
}

/// What a formatter wrote.
#[derive(Clone, Default)]
struct Lines(Arc<Mutex<Vec<u8>>>);

impl Lines {
    fn text(&self) -> String {
        String::from_utf8(self.0.lock().unwrap().clone()).unwrap()
    }
}

impl io::Write for Lines {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        self.0.lock().unwrap().extend_from_slice(buf);
        Ok(buf.len())
    }

    fn flush(&mut self) -> io::Result<()> {
        Ok(())
    }
}

impl MakeWriter<'_> for Lines {
    type Writer = Lines;

    fn make_writer(&self) -> Lines {
        self.clone()
    }
}

/// What the default formatter and the plain one write for the events `emit` makes.
fn both(emit: &dyn Fn()) -> (String, String) {
    let default = Lines::default();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(Level::TRACE)
        .with_timer(Fixed)
        .with_writer(default.clone())
        .finish();
    tracing::subscriber::with_default(subscriber, emit);
    let plain = Lines::default();
    let subscriber = tracing_subscriber::fmt()
        .with_ansi(false)
        .with_max_level(Level::TRACE)
        .with_writer(plain.clone())
        .fmt_fields(PlainFields)
        .event_format(PlainText { timer: Fixed })
        .finish();
    tracing::subscriber::with_default(subscriber, emit);
    (default.text(), plain.text())
}

/// An error with a source.
#[derive(Debug)]
struct Outer(io::Error);

impl fmt::Display for Outer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("outer \x1b failed")
    }
}

impl Error for Outer {
    fn source(&self) -> Option<&(dyn Error + 'static)> {
        Some(&self.0)
    }
}

#[test]
fn lines_equal_the_default_formatters() {
    // `log` records reach tracing through the bridge, as in the binary.
    let _ = tracing_log::LogTracer::init();
    let rows: Vec<(&str, fn())> = vec![
        ("message only", || info!("request finished")),
        ("the request line", || {
            let id: Arc<str> = Arc::from("0123456789abcdef0123456789abcdef");
            info!(
                request_id = ?id,
                api = "chat_completions",
                status = 200u16,
                endpoint = %"http://127.0.0.1:8000",
                duration_ms = 0.4321,
                completed = true,
                "request finished"
            );
        }),
        ("integers, booleans and floats", || {
            info!(
                n = 7u64,
                i = -3i64,
                b = false,
                huge = u128::MAX,
                neg = i128::MIN,
                half = 0.5,
                whole = 2.0,
                big = 1e20,
                small = 1e-7,
                nan = f64::NAN,
                zero = -0.0f64,
                inf = f64::INFINITY,
                "numbers"
            )
        }),
        ("strings that need escapes", || {
            info!(
                quote = "say \"hi\"",
                backslash = "a\\b",
                newline = "two\nlines",
                unicode = "naïve ☃",
                control = "\x1b[31m",
                c1 = "\u{85}",
                empty = "",
                space = "a b",
                "strings"
            )
        }),
        (
            "debug and display values",
            || info!(list = ?vec![1, 2], shown = %"a \"b\"", opt = ?Some("x"), "values"),
        ),
        ("message with arguments", || {
            info!(k = 1u64, "took {} ms for {:?}", 5, "x\ty")
        }),
        ("message escapes", || {
            info!("bell\x07 esc\x1b bs\x08 ff\x0c del\x7f c1\u{85}\u{9f} \u{a0}ok");
            info!("a C1 control alone: \u{9b}");
        }),
        ("message as a field", || {
            info!(message = "field \x1b message", after = 1u64);
            info!(message = 5u64);
            info!(message = true);
            info!(message = 1.5);
        }),
        (
            "raw identifiers",
            || info!(r#type = "t", r#match = 3u64, r#loop = ?(), "r#quoted" = "q", "raw"),
        ),
        ("errors", || {
            let plain = io::Error::other("boom");
            error!(error = &plain as &dyn Error, "failed");
            let nested = Outer(io::Error::other("inner"));
            error!(first = 1u64, error = &nested as &dyn Error);
            error!(error = &nested as &dyn Error, last = 2u64);
        }),
        ("no message", || warn!(a = 1u64, b = "x")),
        ("no fields", || warn!("")),
        ("every level", || {
            trace!("t");
            debug!("d");
            info!("i");
            warn!("w");
            error!("e");
        }),
        ("nested spans", || {
            let outer = info_span!("outer", id = ?"abc", n = 2u64, quote = "a\"b");
            let _outer = outer.enter();
            let inner = info_span!("inner");
            let _inner = inner.enter();
            info!(k = "v", "in spans");
        }),
        ("a field recorded later", || {
            let span = info_span!("req", status = Empty, a = 1u64);
            span.record("status", 200u64);
            span.record("a", 2u64);
            let _span = span.enter();
            info!("after record");
        }),
        ("a span without fields", || {
            let span = info_span!("req", status = Empty);
            let _span = span.enter();
            info!("empty span");
        }),
        (
            "an explicit target",
            || info!(target: "custom::target", x = 1u64, "targeted"),
        ),
        ("the log crate", || {
            log::info!(target: "from_log", "via {}", "log");
            log::warn!("no target \x1b");
        }),
    ];
    for (name, emit) in rows {
        let (default, plain) = both(&emit);
        assert!(
            default.ends_with('\n'),
            "{name}: nothing logged: {default:?}"
        );
        assert_eq!(plain, default, "{name}");
    }
}

#[test]
fn the_clock_prints_what_the_default_timer_prints() {
    let text = |timer: &dyn FormatTime| {
        let mut s = String::new();
        timer.format_time(&mut Writer::new(&mut s)).unwrap();
        s
    };
    let system = tracing_subscriber::fmt::time::SystemTime;
    for _ in 0..100 {
        let before = text(&system);
        let ours = text(&Clock);
        let after = text(&system);
        // The same second on both sides: ours, read between them, is in it too.
        if before[..20] == after[..20] {
            assert_eq!(ours.len(), before.len(), "{ours} {before}");
            assert_eq!(ours[..20], before[..20], "{ours} {before}");
            assert!(ours[20..26].bytes().all(|b| b.is_ascii_digit()), "{ours}");
            assert!(ours.ends_with('Z'), "{ours}");
            return;
        }
    }
    panic!("the second changed between every pair of readings");
}

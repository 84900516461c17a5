//! The `/debug/state` page: an [`AdminView`] rendered through the embedded `state.html` (the
//! page with its refresh script) and `state_live.html` (its live part, also served alone for
//! the refresh) templates, with HTML auto-escaping.

use minijinja::{AutoEscape, Environment};

use super::view::AdminView;

/// The page template (its `.html` suffix is what the escaping is keyed on).
const PAGE: &str = "state.html";
/// The live part the page's script fetches every 2 s.
const LIVE: &str = "state_live.html";

/// What to render.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Part {
    /// The whole page.
    Page,
    /// Only its live part (`?fragment=1`).
    Live,
}

/// Renders `view` as the `/debug/state` page or its live part.
///
/// # Errors
/// A template error (the templates are embedded, so only a bug in them).
pub(crate) fn render(view: &AdminView, part: Part) -> Result<String, minijinja::Error> {
    let mut env = Environment::new();
    env.set_auto_escape_callback(|_| AutoEscape::Html);
    env.add_filter("fixed1", |v: f64| format!("{v:.1}"));
    env.add_filter("fixed3", |v: f64| format!("{v:.3}"));
    env.add_filter("clock", clock);
    env.add_function("pct", pct);
    env.add_template(PAGE, include_str!("state.html"))?;
    env.add_template(LIVE, include_str!("state_live.html"))?;
    let name = match part {
        Part::Page => PAGE,
        Part::Live => LIVE,
    };
    env.get_template(name)?
        .render(minijinja::Value::from(minijinja::value::Serde(view)))
}

/// `part` of `whole` as a percentage with one decimal; `–` when either is missing or
/// `whole` is not positive.
fn pct(part: Option<f64>, whole: Option<f64>) -> String {
    match (part, whole) {
        (Some(p), Some(w)) if w > 0.0 && p.is_finite() && w.is_finite() => {
            format!("{:.1} %", 100.0 * p / w)
        }
        _ => "–".to_owned(),
    }
}

/// Unix milliseconds as `HH:MM:SS.mmm` (UTC).
fn clock(unix_ms: u64) -> String {
    let ms = unix_ms % 1000;
    let s = unix_ms / 1000;
    format!(
        "{:02}:{:02}:{:02}.{ms:03}",
        (s / 3600) % 24,
        (s / 60) % 60,
        s % 60
    )
}

#[cfg(test)]
mod tests;

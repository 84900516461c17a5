//! The `/debug/state` page: a [`StateSnapshot`] rendered through the embedded `state.html`
//! template with HTML auto-escaping (a plain table, no scripts).

use kvgate_schedule::StateSnapshot;
use minijinja::{AutoEscape, Environment};

/// The template's name (its `.html` suffix is what the escaping is keyed on).
const TEMPLATE: &str = "state.html";

/// Renders `snapshot` as the `/debug/state` HTML page.
///
/// # Errors
/// A template error (the template is embedded, so only a bug in it).
pub(crate) fn render(snapshot: &StateSnapshot) -> Result<String, minijinja::Error> {
    let mut env = Environment::new();
    env.set_auto_escape_callback(|_| AutoEscape::Html);
    env.add_filter("fixed2", |v: f64| format!("{v:.2}"));
    env.add_template(TEMPLATE, include_str!("state.html"))?;
    env.get_template(TEMPLATE)?
        .render(minijinja::Value::from(minijinja::value::Serde(snapshot)))
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use kvgate_schedule::{EndpointSnapshot, EngineMetrics, IndexSnapshot, Role};

    use super::*;

    fn endpoint(name: &str) -> EndpointSnapshot {
        EndpointSnapshot {
            name: name.to_owned(),
            url: format!("http://{name}"),
            labels: BTreeMap::new(),
            role: Role::Unlabelled,
            healthy: true,
            consecutive_failures: 0,
            in_flight_requests: 0,
            in_flight_tokens: 0,
            metrics_age_ms: None,
            metrics_stale: true,
            metrics: None,
            served_models: None,
            kv_events: false,
            index_block_size: 16,
            index_holdings: 0,
            index_degraded: false,
            reported_requests: 0,
            predicted_tokens: 0,
            realized_tokens: 0,
            mispredicted_requests: 0,
        }
    }

    fn page(endpoints: Vec<EndpointSnapshot>) -> String {
        let snapshot = StateSnapshot {
            endpoints,
            index: IndexSnapshot {
                blocks: 3,
                holdings: 5,
                estimated_bytes: 4096,
            },
        };
        render(&snapshot).unwrap()
    }

    /// The `<td>` cells of the first endpoint row.
    fn cells(html: &str) -> Vec<String> {
        let row = html
            .split("<tr>")
            .nth(2)
            .and_then(|r| r.split("</tr>").next())
            .unwrap_or_default();
        row.split("<td>")
            .skip(1)
            .map(|c| c.split("</td>").next().unwrap_or_default().to_owned())
            .collect()
    }

    #[test]
    fn hostile_name_and_labels_are_escaped() {
        let mut e = endpoint("<script>alert(\"x\")</script>&");
        e.labels.insert("team".into(), "<b>a&b</b>".into());
        let html = page(vec![e]);
        assert!(!html.contains("<script"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
        let cells = cells(&html);
        assert_eq!(
            cells[0],
            "&lt;script&gt;alert(&quot;x&quot;)&lt;&#x2f;script&gt;&amp;"
        );
        assert_eq!(cells[19], "team=&lt;b&gt;a&amp;b&lt;&#x2f;b&gt;");
    }

    #[test]
    fn cells_follow_the_snapshot() {
        let idle = endpoint("a:1");
        let mut busy = endpoint("b:1");
        busy.metrics = Some(EngineMetrics {
            waiting: Some(3.0),
            kv_usage: Some(0.256),
            ..EngineMetrics::default()
        });
        busy.metrics_age_ms = Some(120);
        busy.kv_events = true;
        busy.predicted_tokens = 128;
        busy.realized_tokens = 64;
        busy.labels.insert("b".into(), "2".into());
        busy.labels.insert("a".into(), "1".into());
        // (name, snapshot, cell index, want): one field flipped per row.
        let cases = [
            ("no metrics: waiting", idle.clone(), 6, "–"),
            ("metrics: waiting", busy.clone(), 6, "3.0"),
            ("metrics without running", busy.clone(), 7, "–"),
            ("no metrics: kv usage", idle.clone(), 8, "–"),
            ("kv usage, two decimals", busy.clone(), 8, "0.26"),
            ("no scrape yet: age", idle.clone(), 9, "–"),
            ("scraped: age", busy.clone(), 9, "120"),
            ("approximate mode", idle.clone(), 11, "approx"),
            ("kv events", busy.clone(), 11, "precise"),
            ("nothing predicted: ratio", idle.clone(), 17, "–"),
            ("predicted: ratio", busy.clone(), 17, "0.50"),
            ("no labels", idle.clone(), 19, ""),
            ("labels sorted, joined", busy.clone(), 19, "a=1, b=2"),
            ("role", idle, 1, "unlabelled"),
        ];
        for (name, e, cell, want) in cases {
            let html = page(vec![e]);
            let cells = cells(&html);
            assert_eq!(cells.len(), 20, "{name}: {html}");
            assert_eq!(cells[cell], want, "{name}");
        }
        let html = page(vec![endpoint("a:1"), endpoint("b:1")]);
        assert!(
            html.contains("index: 3 blocks, 5 holdings, ~4 KiB"),
            "{html}"
        );
        assert_eq!(
            html.matches("<tr>").count(),
            3,
            "header and two rows: {html}"
        );
    }
}

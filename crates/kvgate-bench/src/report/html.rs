//! `index.html`: the report's tables as HTML with the SVG charts inlined.

use minijinja::HtmlEscape;
use pulldown_cmark::{Event, Options, Parser};

use super::Table;

/// The whole page. `extra` (markdown) is rendered as HTML (raw HTML in it is escaped).
pub(super) fn page(tables: &[Table], extra: Option<&str>, svgs: &[&str]) -> String {
    let mut out = String::from(
        "<!DOCTYPE html>\n<html lang=\"en\">\n<head>\n<meta charset=\"utf-8\">\n\
         <title>kvgate bench report</title>\n<style>\n\
         body { font-family: sans-serif; margin: 2em; color: #222; }\n\
         table { border-collapse: collapse; margin-bottom: 1.5em; }\n\
         th, td { border: 1px solid #ccc; padding: 4px 8px; text-align: right; }\n\
         th:first-child, td:first-child { text-align: left; }\n\
         th { background: #f3f3f3; }\n\
         figure { margin: 1em 0; }\n\
         </style>\n</head>\n<body>\n<h1>kvgate bench report</h1>\n\
         <p>Times in milliseconds. Raw data: <a href=\"results.json\">results.json</a>, \
         <a href=\"summary.md\">summary.md</a>.</p>\n",
    );
    for table in tables {
        out.push_str(&format!(
            "<h2>{}</h2>\n<table>\n<tr>",
            HtmlEscape(&table.title)
        ));
        for h in &table.header {
            out.push_str(&format!("<th>{}</th>", HtmlEscape(h)));
        }
        out.push_str("</tr>\n");
        for row in &table.rows {
            out.push_str("<tr>");
            for cell in row {
                out.push_str(&format!("<td>{}</td>", HtmlEscape(cell)));
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</table>\n");
    }
    if let Some(extra) = extra {
        out.push_str(&markdown_to_html(extra));
    }
    for svg in svgs {
        out.push_str("<figure>\n");
        out.push_str(strip_xml_declaration(svg));
        out.push_str("\n</figure>\n");
    }
    out.push_str("</body>\n</html>\n");
    out
}

/// CommonMark (with tables) to HTML; raw HTML blocks and inline HTML are shown as text.
fn markdown_to_html(markdown: &str) -> String {
    let events = Parser::new_ext(markdown, Options::ENABLE_TABLES).map(|e| match e {
        Event::Html(raw) | Event::InlineHtml(raw) => Event::Text(raw),
        other => other,
    });
    let mut html = String::new();
    pulldown_cmark::html::push_html(&mut html, events);
    html
}

fn strip_xml_declaration(svg: &str) -> &str {
    match (svg.starts_with("<?xml"), svg.find("?>")) {
        (true, Some(end)) => svg[end + 2..].trim_start(),
        _ => svg,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_strips() {
        let table = Table {
            title: "a<b>".into(),
            header: vec!["&\"c'"],
            rows: vec![vec!["plain".into()]],
        };
        let html = page(&[table], Some("</pre>"), &[]);
        for want in [
            "<h2>a&lt;b&gt;</h2>",
            "<th>&amp;&quot;c&#x27;</th>",
            "<td>plain</td>",
            "&lt;/pre&gt;",
        ] {
            assert!(html.contains(want), "{want}: {html}");
        }
        assert!(
            !html.contains("</pre>"),
            "raw HTML in the markdown passed through: {html}"
        );
        assert_eq!(
            strip_xml_declaration("<?xml version=\"1.0\"?>\n<svg/>"),
            "<svg/>"
        );
        assert_eq!(strip_xml_declaration("<svg/>"), "<svg/>");
    }

    #[test]
    fn plain_words_markdown_is_rendered_as_html() {
        // The shape `kvgate demo` passes: a heading and a fenced block of printed lines.
        let extra = "### In plain words\n\nPrecise routing *won*:\n\n- TTFT p50 `12 ms` <b>\n- hits 80%\n\n```\nprecise  12 ms\nround-robin 40 ms & more\n```\n";
        let html = page(&[], Some(extra), &[]);
        for want in [
            "<h3>In plain words</h3>",
            "<p>Precise routing <em>won</em>:</p>",
            "<li>TTFT p50 <code>12 ms</code> &lt;b&gt;</li>",
            "<pre><code>precise  12 ms\nround-robin 40 ms &amp; more\n</code></pre>",
        ] {
            assert!(html.contains(want), "{want}: {html}");
        }
        assert!(!html.contains("### "), "{html}");
        assert!(!html.contains("```"), "{html}");
        assert!(!html.contains("<b>"), "{html}");
    }
}

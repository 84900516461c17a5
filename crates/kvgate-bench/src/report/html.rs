//! `index.html`: the report's tables as HTML with the SVG charts inlined.

use minijinja::HtmlEscape;

use super::Table;

/// The whole page. `extra` (markdown) is shown preformatted.
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
        out.push_str(&format!("<pre>{}</pre>\n", HtmlEscape(extra)));
    }
    for svg in svgs {
        out.push_str("<figure>\n");
        out.push_str(strip_xml_declaration(svg));
        out.push_str("\n</figure>\n");
    }
    out.push_str("</body>\n</html>\n");
    out
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
            "<pre>&lt;&#x2f;pre&gt;</pre>",
        ] {
            assert!(html.contains(want), "{want}: {html}");
        }
        assert_eq!(
            strip_xml_declaration("<?xml version=\"1.0\"?>\n<svg/>"),
            "<svg/>"
        );
        assert_eq!(strip_xml_declaration("<svg/>"), "<svg/>");
    }
}

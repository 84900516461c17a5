//! `index.html`: the report's tables as HTML with the SVG charts inlined.

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
        out.push_str(&format!("<h2>{}</h2>\n<table>\n<tr>", escape(&table.title)));
        for h in &table.header {
            out.push_str(&format!("<th>{}</th>", escape(h)));
        }
        out.push_str("</tr>\n");
        for row in &table.rows {
            out.push_str("<tr>");
            for cell in row {
                out.push_str(&format!("<td>{}</td>", escape(cell)));
            }
            out.push_str("</tr>\n");
        }
        out.push_str("</table>\n");
    }
    if let Some(extra) = extra {
        out.push_str(&format!("<pre>{}</pre>\n", escape(extra)));
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

/// Escapes text for HTML element content and attribute values.
pub(super) fn escape(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    for c in text.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&#39;"),
            c => out.push(c),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn escapes_and_strips() {
        let cases = [
            ("a<b>&\"c'", "a&lt;b&gt;&amp;&quot;c&#39;"),
            ("plain", "plain"),
        ];
        for (input, want) in cases {
            assert_eq!(escape(input), want);
        }
        assert_eq!(
            strip_xml_declaration("<?xml version=\"1.0\"?>\n<svg/>"),
            "<svg/>"
        );
        assert_eq!(strip_xml_declaration("<svg/>"), "<svg/>");
    }
}

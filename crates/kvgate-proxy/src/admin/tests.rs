//! The admin routes over a real listener: exact statuses, content types and bodies.

use tokio::{
    io::{AsyncReadExt, AsyncWriteExt},
    net::TcpStream,
};

use crate::{
    EndpointConfig, ProxyConfig,
    test_util::{RunningProxy, dead_addr},
};

/// A proxy in front of one endpoint where nothing listens, labelled with markup.
async fn start() -> (RunningProxy, String) {
    let url = format!("http://{}", dead_addr());
    let mut endpoint = EndpointConfig::new(url.clone());
    endpoint
        .labels
        .insert("team".into(), "<script>alert(1)</script>".into());
    let config = ProxyConfig {
        endpoints: vec![endpoint],
        models_refresh: None,
        ..ProxyConfig::default()
    };
    let name = url.trim_start_matches("http://").to_owned();
    (RunningProxy::start(config).await, name)
}

/// One parsed HTTP/1.1 response.
#[derive(Debug)]
struct Reply {
    status: u16,
    /// Header lines, names lowercased.
    headers: Vec<(String, String)>,
    body: String,
}

impl Reply {
    fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

/// Sends `METHOD path` with `Connection: close` and reads the whole answer.
async fn exchange(proxy: &RunningProxy, method: &str, path: &str) -> Reply {
    let mut stream = TcpStream::connect(proxy.admin).await.unwrap();
    let request = format!(
        "{method} {path} HTTP/1.1\r\nhost: admin\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"
    );
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let mut lines = head.lines();
    let status = lines
        .next()
        .unwrap()
        .split(' ')
        .nth(1)
        .unwrap()
        .parse()
        .unwrap();
    let headers = lines
        .filter_map(|l| l.split_once(": "))
        .map(|(n, v)| (n.to_ascii_lowercase(), v.to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}

fn error_json(message: &str, kind: &str, code: &str) -> String {
    format!(r#"{{"error":{{"message":"{message}","type":"{kind}","code":"{code}"}}}}"#)
}

#[tokio::test]
async fn wrong_method_is_405_and_unknown_path_404_both_json() {
    let (proxy, _) = start().await;
    let not_allowed = Some("GET,HEAD");
    // (method, path, status, `Allow`): a known path with a method it does not serve, or a
    // path with no route whatever the method.
    let cases = [
        ("POST", "/metrics", 405, not_allowed),
        ("PUT", "/health", 405, not_allowed),
        ("DELETE", "/ready", 405, not_allowed),
        ("POST", "/debug/state", 405, not_allowed),
        ("PATCH", "/debug/state.json", 405, not_allowed),
        ("GET", "/nope", 404, None),
        ("POST", "/nope", 404, None),
        ("GET", "/debug", 404, None),
        ("GET", "/metrics/", 404, None),
        ("GET", "/v1/chat/completions", 404, None),
    ];
    for (method, path, status, allow) in cases {
        let reply = exchange(&proxy, method, path).await;
        let want = if status == 405 {
            error_json(
                &format!("method {method} is not allowed on {path}"),
                "invalid_request_error",
                "method_not_allowed",
            )
        } else {
            error_json(
                &format!("no admin route for {method} {path}"),
                "not_found_error",
                "not_found",
            )
        };
        assert_eq!(
            (reply.status, reply.body.as_str()),
            (status, want.as_str()),
            "{method} {path}"
        );
        let content_type = reply.header("content-type");
        assert_eq!(content_type, Some("application/json"), "{method} {path}");
        assert_eq!(reply.header("allow"), allow, "{method} {path}");
    }
}

#[tokio::test]
async fn every_admin_path_answers_get() {
    let (proxy, name) = start().await;
    let html_cell = format!("<td class=\"l\">{name}</td>");
    let url_json = format!("\"name\": \"{name}\"");
    // (method, path, content type, a piece of the body)
    let cases = [
        ("GET", "/health", "text/plain; charset=utf-8", "ok\n"),
        (
            "GET",
            "/metrics",
            "application/openmetrics-text; version=1.0.0; charset=utf-8",
            "kvgate_accept_errors_total{listener=\"admin\"} 0\n",
        ),
        (
            "GET",
            "/debug/state",
            "text/html; charset=utf-8",
            html_cell.as_str(),
        ),
        (
            "GET",
            "/debug/state.json",
            "application/json",
            url_json.as_str(),
        ),
        ("HEAD", "/health", "text/plain; charset=utf-8", ""),
    ];
    for (method, path, content_type, piece) in cases {
        let reply = exchange(&proxy, method, path).await;
        assert_eq!(reply.status, 200, "{method} {path}: {reply:?}");
        assert_eq!(reply.header("content-type"), Some(content_type), "{path}");
        assert!(
            reply.body.contains(piece),
            "{method} {path}: {}",
            reply.body
        );
    }
    assert_eq!(exchange(&proxy, "GET", "/health").await.body, "ok\n");
    assert_eq!(exchange(&proxy, "HEAD", "/health").await.body, "");
}

/// `?fragment=1` is the live part alone (no page shell, no script); other queries, bad ones
/// included, get the whole page.
#[tokio::test]
async fn state_fragment_is_the_live_part() {
    let (proxy, name) = start().await;
    // (path, want the page shell)
    let cases = [
        ("/debug/state", true),
        ("/debug/state?fragment=1", false),
        ("/debug/state?x=1&fragment=1", false),
        ("/debug/state?fragment=0", true),
        ("/debug/state?fragment=%ZZ&&=", true),
    ];
    for (path, page) in cases {
        let r = exchange(&proxy, "GET", path).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
        assert_eq!(r.header("cache-control"), Some("no-store"), "{path}");
        assert_eq!(r.body.contains("<script>"), page, "{path}: {}", r.body);
        assert_eq!(r.body.contains("<!doctype html>"), page, "{path}");
        assert!(
            r.body.contains(&format!("data-endpoint=\"{name}\"")),
            "{path}"
        );
    }
    let json: serde_json::Value =
        serde_json::from_str(&exchange(&proxy, "GET", "/debug/state.json").await.body).unwrap();
    for key in [
        "endpoints",
        "index",
        "models",
        "decisions",
        "generated_unix_ms",
    ] {
        assert!(!json[key].is_null(), "{key} in {json}");
    }
    assert_eq!(json["endpoints"][0]["kv_stream"], serde_json::Value::Null);
}

#[tokio::test]
async fn state_page_escapes_labels() {
    let (proxy, _) = start().await;
    let page = exchange(&proxy, "GET", "/debug/state").await.body;
    assert!(!page.contains("<script>alert"), "{page}");
    assert!(
        page.contains("team=&lt;script&gt;alert(1)&lt;&#x2f;script&gt;"),
        "{page}"
    );
}

/// Sends `GET path` with an optional `Authorization` header and reads the whole answer.
async fn get_with(proxy: &RunningProxy, path: &str, auth: Option<&str>) -> Reply {
    let mut stream = TcpStream::connect(proxy.admin).await.unwrap();
    let auth = auth
        .map(|a| format!("authorization: {a}\r\n"))
        .unwrap_or_default();
    let request = format!("GET {path} HTTP/1.1\r\nhost: admin\r\n{auth}connection: close\r\n\r\n");
    stream.write_all(request.as_bytes()).await.unwrap();
    let mut raw = Vec::new();
    stream.read_to_end(&mut raw).await.unwrap();
    let raw = String::from_utf8(raw).unwrap();
    let status = raw[9..12].parse().unwrap();
    let (head, body) = raw.split_once("\r\n\r\n").unwrap();
    let headers = head
        .lines()
        .skip(1)
        .filter_map(|l| l.split_once(':'))
        .map(|(k, v)| (k.to_ascii_lowercase(), v.trim().to_owned()))
        .collect();
    Reply {
        status,
        headers,
        body: body.to_owned(),
    }
}

/// With an admin token, every route but the probes answers 401 JSON without it (or with
/// another one) and 200 with it; without a token configured nothing changes.
#[tokio::test]
async fn admin_token_guards_all_but_the_probes() {
    let config = ProxyConfig {
        endpoints: vec![EndpointConfig::new(format!("http://{}", dead_addr()))],
        models_refresh: None,
        admin_token: Some("s3cret".into()),
        ..ProxyConfig::default()
    };
    let proxy = RunningProxy::start(config).await;
    let guarded = [
        "/metrics",
        "/debug/state.json",
        "/debug/state",
        "/debug/state?fragment=1",
    ];
    for path in guarded.into_iter().chain(["/nope"]) {
        for auth in [
            None,
            Some("Bearer wrong"),
            Some("s3cret"),
            Some("Basic s3cret"),
        ] {
            let r = get_with(&proxy, path, auth).await;
            assert_eq!(r.status, 401, "{path} with {auth:?}: {}", r.body);
            assert_eq!(r.header("content-type"), Some("application/json"), "{path}");
            assert_eq!(r.header("www-authenticate"), Some("Bearer"), "{path}");
            let v: serde_json::Value = serde_json::from_str(&r.body).unwrap();
            assert_eq!(v["error"]["code"], "unauthorized", "{path}");
        }
    }
    for path in guarded {
        let r = get_with(&proxy, path, Some("Bearer s3cret")).await;
        assert_eq!(r.status, 200, "{path}: {}", r.body);
    }
    assert_eq!(
        get_with(&proxy, "/nope", Some("Bearer s3cret"))
            .await
            .status,
        404
    );
    assert_eq!(get_with(&proxy, "/health", None).await.status, 200);
    let ready = get_with(&proxy, "/ready", None).await;
    assert!(ready.body.contains("ready"), "/ready: {}", ready.body);

    let (open, _) = start().await;
    assert_eq!(get_with(&open, "/metrics", None).await.status, 200);
}

#[test]
fn the_admin_port_binds_loopback_by_default() {
    assert!(crate::config::DEFAULT_ADMIN_LISTEN.ip().is_loopback());
    assert_eq!(crate::config::DEFAULT_ADMIN_LISTEN.port(), 9090);
}

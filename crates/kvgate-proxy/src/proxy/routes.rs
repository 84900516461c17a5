//! The proxy port's path table: which paths kvgate answers itself, which it forwards (and how
//! it routes them), and the method and content type each accepts.
//!
//! | path | method | answer |
//! |---|---|---|
//! | `/v1/chat/completions`, `/v1/completions`, `/v1/messages`, `/v1/responses`, `/v1/embeddings` | `POST` | parsed, tokenized, scheduled ([`Api`]) |
//! | `/tokenize`, `/detokenize`, `/pooling`, `/classify`, `/score`, `/v1/score`, `/rerank`, `/v1/rerank`, `/v2/rerank` | `POST` | routed by `model` and load, not tokenized (a body without a readable `model` goes to the one model served) |
//! | `/v1/models` | `GET` | the pool's model list |
//! | `/v1/models/{id}` | `GET` | one model object, or `404 model_not_found` |
//! | `/health`, `/ready` | `GET` | as on the admin port |
//!
//! `HEAD` works wherever `GET` does. A trailing `/` is ignored. Another method on a known
//! path is `405` with `Allow`; any other path (`//v1/chat/completions` included) is `404`.
//! A `POST` whose `content-type` is present and not `application/json` is `415`, as vLLM
//! answers it; a `POST` without `content-type` is accepted.

use http::{HeaderMap, Method, header};
use kvgate_request::Api;

/// Engine APIs that name a `model` but that kvgate does not tokenize: vLLM's tokenizer,
/// pooling, classification, scoring and reranking endpoints.
const BY_MODEL: [&str; 9] = [
    "/tokenize",
    "/detokenize",
    "/pooling",
    "/classify",
    "/score",
    "/v1/score",
    "/rerank",
    "/v1/rerank",
    "/v2/rerank",
];

/// Where a request goes.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Route {
    /// An inference API: parsed, tokenized and scheduled.
    Inference(Api),
    /// An engine API that carries a `model`: forwarded byte for byte, routed by the model
    /// and scheduled on load.
    ByModel,
    /// `GET /v1/models`.
    Models,
    /// `GET /v1/models/{id}` (the id percent-decoded).
    Model(String),
    /// `GET /health`.
    Health,
    /// `GET /ready`.
    Ready,
}

impl Route {
    /// The API of the forwarded body ([`Api::Passthrough`] for every route but
    /// [`Route::Inference`]), for metric labels.
    pub fn api(&self) -> Api {
        match self {
            Route::Inference(api) => *api,
            _ => Api::Passthrough,
        }
    }

    /// Whether the request's body is a JSON request forwarded to an engine.
    fn takes_json(&self) -> bool {
        matches!(self, Route::Inference(_) | Route::ByModel)
    }
}

/// Why a request has no route.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Refusal {
    /// No such path.
    NotFound,
    /// The path exists with other methods (the `Allow` value).
    MethodNotAllowed(&'static str),
    /// A JSON API called with another content type (the type sent).
    UnsupportedMediaType(String),
}

impl Refusal {
    /// The error answered for `method path` (404, 405 with `Allow`, or 415), for every front
    /// door alike.
    pub fn into_error(self, method: String, path: String) -> crate::ProxyError {
        use crate::ProxyError;
        match self {
            Refusal::NotFound => ProxyError::NotFound { method, path },
            Refusal::MethodNotAllowed(allow) => ProxyError::MethodNotAllowed {
                method,
                path,
                allow,
            },
            Refusal::UnsupportedMediaType(sent) => ProxyError::UnsupportedMediaType(sent),
        }
    }
}

/// The route of `method path`, checking the method and (for JSON APIs) the content type.
///
/// # Errors
/// [`Refusal`] for an unknown path, a wrong method or a non-JSON content type.
pub fn resolve(method: &Method, path: &str, headers: &HeaderMap) -> Result<Route, Refusal> {
    let trimmed = path
        .strip_suffix('/')
        .filter(|p| !p.is_empty())
        .unwrap_or(path);
    let (route, allow) = match trimmed {
        "/v1/models" => (Route::Models, "GET, HEAD"),
        "/health" => (Route::Health, "GET, HEAD"),
        "/ready" => (Route::Ready, "GET, HEAD"),
        p if BY_MODEL.contains(&p) => (Route::ByModel, "POST"),
        p => match p.strip_prefix("/v1/models/") {
            Some(id) if !id.is_empty() => (Route::Model(percent_decode(id)), "GET, HEAD"),
            _ => match Api::from_path(trimmed) {
                Api::Passthrough => return Err(Refusal::NotFound),
                api => (Route::Inference(api), "POST"),
            },
        },
    };
    let allowed = if allow == "POST" {
        method == Method::POST
    } else {
        method == Method::GET || method == Method::HEAD
    };
    if !allowed {
        return Err(Refusal::MethodNotAllowed(allow));
    }
    if route.takes_json() {
        check_json(headers)?;
    }
    Ok(route)
}

/// A present `content-type` must be `application/json` (parameters such as `charset`
/// allowed, any case).
fn check_json(headers: &HeaderMap) -> Result<(), Refusal> {
    let Some(value) = headers.get(header::CONTENT_TYPE) else {
        return Ok(());
    };
    let sent = value.as_bytes();
    let media = sent.split(|b| *b == b';').next().unwrap_or_default();
    if media.trim_ascii().eq_ignore_ascii_case(b"application/json") {
        Ok(())
    } else {
        Err(Refusal::UnsupportedMediaType(
            String::from_utf8_lossy(sent).into_owned(),
        ))
    }
}

/// `%XX` escapes decoded (an id such as `Qwen%2FQwen3-0.6B`); invalid escapes stay as sent.
fn percent_decode(s: &str) -> String {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let hex = bytes
            .get(i + 1..i + 3)
            .and_then(|h| std::str::from_utf8(h).ok())
            .and_then(|h| u8::from_str_radix(h, 16).ok());
        match (bytes[i], hex) {
            (b'%', Some(b)) => {
                out.push(b);
                i += 3;
            }
            (b, _) => {
                out.push(b);
                i += 1;
            }
        }
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[cfg(test)]
mod tests {
    use http::HeaderValue;

    use super::*;

    fn json() -> HeaderMap {
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("application/json"),
        );
        h
    }

    #[test]
    fn paths_methods_and_content_types() {
        use Refusal::*;
        let (get, post, delete) = (Method::GET, Method::POST, Method::DELETE);
        let ok = |r: Route| Ok::<Route, Refusal>(r);
        let cases: Vec<(&Method, &str, Result<Route, Refusal>)> = vec![
            (
                &post,
                "/v1/chat/completions",
                ok(Route::Inference(Api::ChatCompletions)),
            ),
            (
                &post,
                "/v1/chat/completions/",
                ok(Route::Inference(Api::ChatCompletions)),
            ),
            (
                &post,
                "/v1/embeddings",
                ok(Route::Inference(Api::Embeddings)),
            ),
            (&get, "/v1/chat/completions", Err(MethodNotAllowed("POST"))),
            (&post, "//v1/chat/completions", Err(NotFound)),
            (&post, "/v1/chat/completions/render", Err(NotFound)),
            (&post, "/tokenize", ok(Route::ByModel)),
            (&post, "/v1/score", ok(Route::ByModel)),
            (&post, "/v1/rerank", ok(Route::ByModel)),
            (&post, "/pooling/", ok(Route::ByModel)),
            (&get, "/tokenize", Err(MethodNotAllowed("POST"))),
            (&get, "/v1/models", ok(Route::Models)),
            (&Method::HEAD, "/v1/models", ok(Route::Models)),
            (&post, "/v1/models", Err(MethodNotAllowed("GET, HEAD"))),
            (&get, "/v1/models/m", ok(Route::Model("m".into()))),
            (
                &get,
                "/v1/models/Qwen/Qwen3-0.6B",
                ok(Route::Model("Qwen/Qwen3-0.6B".into())),
            ),
            (
                &get,
                "/v1/models/Qwen%2FQwen3-0.6B",
                ok(Route::Model("Qwen/Qwen3-0.6B".into())),
            ),
            (&get, "/v1/models/bad%zz", ok(Route::Model("bad%zz".into()))),
            (&delete, "/v1/models/m", Err(MethodNotAllowed("GET, HEAD"))),
            (&get, "/v1/models/", ok(Route::Models)),
            (&get, "/health", ok(Route::Health)),
            (&get, "/ready", ok(Route::Ready)),
            (&get, "/metrics", Err(NotFound)),
            (&post, "/reset_prefix_cache", Err(NotFound)),
            (&get, "/", Err(NotFound)),
            (&post, "/v1/load_lora_adapter", Err(NotFound)),
        ];
        for (method, path, want) in cases {
            assert_eq!(resolve(method, path, &json()), want, "{method} {path}");
        }
    }

    #[test]
    fn json_apis_refuse_other_content_types() {
        let with = |ct: Option<&'static str>| {
            let mut h = HeaderMap::new();
            if let Some(ct) = ct {
                h.insert(header::CONTENT_TYPE, HeaderValue::from_static(ct));
            }
            resolve(&Method::POST, "/v1/completions", &h)
        };
        let accepted = [
            None,
            Some("application/json"),
            Some("Application/JSON; charset=utf-8"),
            Some("application/json\t ;charset=utf-8"),
        ];
        for ct in accepted {
            assert!(with(ct).is_ok(), "{ct:?}");
        }
        for ct in ["text/plain", "application/x-www-form-urlencoded", ""] {
            assert_eq!(
                with(Some(ct)),
                Err(Refusal::UnsupportedMediaType(ct.to_owned())),
                "{ct}"
            );
        }
        // Not text: refused, the type quoted with the bad byte replaced.
        let mut h = HeaderMap::new();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_bytes(b"application/json\xff").unwrap(),
        );
        assert_eq!(
            resolve(&Method::POST, "/v1/completions", &h),
            Err(Refusal::UnsupportedMediaType(
                "application/json\u{fffd}".into()
            ))
        );
        // GET routes have no body to check.
        let mut h = HeaderMap::new();
        h.insert(header::CONTENT_TYPE, HeaderValue::from_static("text/plain"));
        assert_eq!(resolve(&Method::GET, "/v1/models", &h), Ok(Route::Models));
    }
}

//! Which tokenizer chain a model gets when the operator did not spell one out.
//!
//! 1. A chain named for the model (`--tokenizer MODEL=DIR`, `--render MODEL=URL`, YAML
//!    `models[].tokenizer`) is used as named: local first, then render.
//! 2. Otherwise, when an endpoint serving the model publishes KV events, the engine's own
//!    render endpoint (`/v1/chat/completions/render`, `/v1/completions/render` on the
//!    endpoint's URL): it tokenizes the exact forwarded bytes as the engine will, so precise
//!    prefix scores match what the engine caches.
//! 3. Otherwise no chain: requests for the model are routed on load.
//!
//! The estimate backend stays last in every chain; its token ids are not exact, so the
//! precise prefix scorer never uses them.

use std::fmt::Write as _;

use kvgate_tokenize::{BackendKind, ModelTokenizerConfig};

/// The chain a model gets and why.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ChainChoice {
    /// The model.
    pub model: String,
    /// The chain's config (`None`: no chain; requests are routed on load).
    pub config: Option<ModelTokenizerConfig>,
    /// Why, in words.
    pub reason: String,
}

impl ChainChoice {
    /// The chain in words, e.g. `render(http://10.0.0.1:8000) → estimate`, or `none`.
    pub fn describe(&self) -> String {
        let Some(c) = &self.config else {
            return "none".to_owned();
        };
        let mut out = String::new();
        for (i, kind) in c.backend_order().into_iter().enumerate() {
            if i > 0 {
                out.push_str(" → ");
            }
            match kind {
                BackendKind::Local => {
                    let dir = c
                        .tokenizer_dir
                        .as_ref()
                        .map_or_else(|| "-".to_owned(), |d| d.display().to_string());
                    let _ = write!(out, "local({dir})");
                }
                BackendKind::Render => {
                    let _ = write!(out, "render({})", c.render_url.as_deref().unwrap_or("-"));
                }
                BackendKind::Estimate => out.push_str("estimate"),
            }
        }
        out
    }

    /// The start-up line: `model M: tokenizer chain CHAIN — WHY`.
    pub fn line(&self) -> String {
        format!(
            "model {}: tokenizer chain {} — {}",
            self.model,
            self.describe(),
            self.reason
        )
    }
}

/// Decides `model`'s chain: `configured` (named by flag or YAML) wins; otherwise the render
/// endpoint of `kv_endpoint`, the URL of an endpoint serving the model with KV events;
/// otherwise none.
pub fn choose_chain(
    model: &str,
    configured: Option<&ModelTokenizerConfig>,
    kv_endpoint: Option<&str>,
) -> ChainChoice {
    let (config, reason) = match (configured, kv_endpoint) {
        (Some(c), _) => {
            let reason = match (&c.tokenizer_dir, &c.render_url) {
                (Some(_), Some(_)) => "local tokenizer and render server named",
                (Some(_), None) => "local tokenizer named",
                (None, Some(_)) => "render server named; no local tokenizer named",
                (None, None) => "configured without a local tokenizer or render server",
            };
            (Some(c.clone()), reason)
        }
        (None, Some(url)) => {
            let mut c = ModelTokenizerConfig::new(model);
            c.render_url = Some(url.to_owned());
            (
                Some(c),
                "no local tokenizer named; engine publishes KV events",
            )
        }
        (None, None) => (
            None,
            "no local tokenizer or render server named; no endpoint serving it publishes KV events: routed on load",
        ),
    };
    ChainChoice {
        model: model.to_owned(),
        config,
        reason: reason.to_owned(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn named_chains_win_then_the_engine_render_endpoint() {
        let named = |dir: Option<&str>, render: Option<&str>| {
            let mut c = ModelTokenizerConfig::new("m");
            c.tokenizer_dir = dir.map(Into::into);
            c.render_url = render.map(str::to_owned);
            c
        };
        let local = named(Some("/t"), None);
        let render = named(None, Some("http://r:1"));
        let both = named(Some("/t"), Some("http://r:1"));
        type Case<'a> = (
            &'a str,
            Option<&'a ModelTokenizerConfig>,
            Option<&'a str>,
            &'a str,
            &'a str,
        );
        let cases: [Case<'_>; 6] = [
            (
                "local named, engine with events: local",
                Some(&local),
                Some("http://e:1"),
                "local(/t) → estimate",
                "local tokenizer named",
            ),
            (
                "render named, engine with events: the named render server",
                Some(&render),
                Some("http://e:1"),
                "render(http://r:1) → estimate",
                "render server named",
            ),
            (
                "both named: local then render",
                Some(&both),
                None,
                "local(/t) → render(http://r:1) → estimate",
                "local tokenizer and render server named",
            ),
            (
                "nothing named, engine with events: its render endpoint",
                None,
                Some("http://e:1"),
                "render(http://e:1) → estimate",
                "engine publishes KV events",
            ),
            (
                "nothing named, no events: no chain",
                None,
                None,
                "none",
                "routed on load",
            ),
            (
                "named without backends: estimate only",
                Some(&named(None, None)),
                Some("http://e:1"),
                "estimate",
                "configured without",
            ),
        ];
        for (name, configured, kv, chain, why) in cases {
            let choice = choose_chain("m", configured, kv);
            assert_eq!(choice.describe(), chain, "{name}");
            assert!(choice.reason.contains(why), "{name}: {}", choice.reason);
            assert!(
                choice.line().starts_with("model m: tokenizer chain "),
                "{name}"
            );
        }
    }
}

//! Which inference API a request path belongs to.

/// An inference API kvgate understands, or [`Api::Passthrough`] for every other path.
///
/// Known APIs have their JSON body parsed (and a `model` required); passthrough bodies are
/// forwarded without being looked at.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Api {
    /// OpenAI `POST /v1/chat/completions`.
    ChatCompletions,
    /// OpenAI `POST /v1/completions`.
    Completions,
    /// Anthropic `POST /v1/messages`.
    Messages,
    /// OpenAI `POST /v1/responses`.
    Responses,
    /// OpenAI `POST /v1/embeddings`.
    Embeddings,
    /// Any other path: forwarded untouched, body not parsed.
    Passthrough,
}

impl Api {
    /// Every known API, in a fixed order (useful for metrics and tables).
    pub const KNOWN: [Api; 5] = [
        Api::ChatCompletions,
        Api::Completions,
        Api::Messages,
        Api::Responses,
        Api::Embeddings,
    ];

    /// Classifies a request path (without the query string). Unknown paths are passthrough.
    pub fn from_path(path: &str) -> Api {
        let path = path.split('?').next().unwrap_or(path);
        let path = path.strip_suffix('/').unwrap_or(path);
        match path {
            "/v1/chat/completions" => Api::ChatCompletions,
            "/v1/completions" => Api::Completions,
            "/v1/messages" => Api::Messages,
            "/v1/responses" => Api::Responses,
            "/v1/embeddings" => Api::Embeddings,
            _ => Api::Passthrough,
        }
    }

    /// The canonical path of this API (`""` for passthrough).
    pub fn path(self) -> &'static str {
        match self {
            Api::ChatCompletions => "/v1/chat/completions",
            Api::Completions => "/v1/completions",
            Api::Messages => "/v1/messages",
            Api::Responses => "/v1/responses",
            Api::Embeddings => "/v1/embeddings",
            Api::Passthrough => "",
        }
    }

    /// A short, stable label for metrics and logs.
    pub fn label(self) -> &'static str {
        match self {
            Api::ChatCompletions => "chat_completions",
            Api::Completions => "completions",
            Api::Messages => "messages",
            Api::Responses => "responses",
            Api::Embeddings => "embeddings",
            Api::Passthrough => "passthrough",
        }
    }

    /// Whether the body is JSON that kvgate parses (every known API).
    pub fn is_parsed(self) -> bool {
        self != Api::Passthrough
    }

    /// Whether a request to this API must name a `model`.
    pub fn needs_model(self) -> bool {
        self.is_parsed()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn paths_classify() {
        let cases = [
            ("/v1/chat/completions", Api::ChatCompletions),
            ("/v1/chat/completions/", Api::ChatCompletions),
            ("/v1/chat/completions?x=1", Api::ChatCompletions),
            ("/v1/completions", Api::Completions),
            ("/v1/messages", Api::Messages),
            ("/v1/responses", Api::Responses),
            ("/v1/embeddings", Api::Embeddings),
            ("/v1/chat/completions/render", Api::Passthrough),
            ("/tokenize", Api::Passthrough),
            ("/v1/chat", Api::Passthrough),
            ("/", Api::Passthrough),
        ];
        for (path, want) in cases {
            assert_eq!(Api::from_path(path), want, "{path}");
        }
        for api in Api::KNOWN {
            assert_eq!(Api::from_path(api.path()), api);
        }
    }
}

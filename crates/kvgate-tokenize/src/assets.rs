//! Loading a Hugging Face tokenizer directory: `tokenizer.json`, `tokenizer_config.json`
//! and optionally `chat_template.jinja`, each plain or gzip-compressed (`.gz`).

use std::io::Read as _;
use std::path::{Path, PathBuf};

use flate2::read::GzDecoder;
use serde_json::Value;

/// Errors while loading a tokenizer directory.
#[derive(Debug, thiserror::Error)]
pub enum LoadError {
    /// Neither the plain nor the `.gz` file exists.
    #[error("tokenizer dir {dir}: missing {name} (or {name}.gz)")]
    Missing {
        /// The directory searched.
        dir: PathBuf,
        /// The file name looked for.
        name: &'static str,
    },
    /// Reading or decompressing a file failed.
    #[error("{path}: read failed")]
    Io {
        /// The file.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// `tokenizer_config.json` is not valid JSON.
    #[error("{path}: invalid json")]
    Json {
        /// The file.
        path: PathBuf,
        /// The parse error.
        #[source]
        source: serde_json::Error,
    },
    /// The HF `tokenizers` crate rejected `tokenizer.json`.
    #[error("{path}: tokenizer rejected: {message}")]
    Tokenizer {
        /// The file.
        path: PathBuf,
        /// The library's message.
        message: String,
    },
    /// The chat template does not compile.
    #[error("chat template does not compile: {0}")]
    Template(String),
}

/// Reads `dir/name`, or `dir/name.gz` decompressed, into memory.
pub(crate) fn read_maybe_gz(dir: &Path, name: &'static str) -> Result<Option<Vec<u8>>, LoadError> {
    let plain = dir.join(name);
    if plain.is_file() {
        return std::fs::read(&plain)
            .map(Some)
            .map_err(|source| LoadError::Io {
                path: plain,
                source,
            });
    }
    let gz = dir.join(format!("{name}.gz"));
    if gz.is_file() {
        let file = std::fs::File::open(&gz).map_err(|source| LoadError::Io {
            path: gz.clone(),
            source,
        })?;
        let mut out = Vec::new();
        GzDecoder::new(file)
            .read_to_end(&mut out)
            .map_err(|source| LoadError::Io { path: gz, source })?;
        return Ok(Some(out));
    }
    Ok(None)
}

/// The parts of `tokenizer_config.json` that rendering needs.
#[derive(Debug, Clone, Default)]
pub(crate) struct TokenizerConfig {
    /// The default chat template.
    pub(crate) chat_template: Option<String>,
    /// The `tool_use` named template, when the config holds a list of templates.
    pub(crate) tool_use_template: Option<String>,
    /// `special_tokens_map` as transformers 5 passes it to templates: the named tokens
    /// (`bos_token`, `eos_token`, …) only.
    pub(crate) special_tokens: Vec<(String, Value)>,
}

fn token_content(v: &Value) -> Option<Value> {
    match v {
        Value::String(s) => Some(Value::String(s.clone())),
        Value::Object(m) => m.get("content").cloned(),
        _ => None,
    }
}

impl TokenizerConfig {
    pub(crate) fn from_json(cfg: &Value, jinja_file: Option<String>) -> Self {
        let mut out = TokenizerConfig::default();
        match cfg.get("chat_template") {
            Some(Value::String(s)) => out.chat_template = Some(s.clone()),
            Some(Value::Array(list)) => {
                for item in list {
                    let name = item.get("name").and_then(Value::as_str);
                    let tmpl = item.get("template").and_then(Value::as_str);
                    match (name, tmpl) {
                        (Some("default"), Some(t)) => out.chat_template = Some(t.to_owned()),
                        (Some("tool_use"), Some(t)) => out.tool_use_template = Some(t.to_owned()),
                        _ => {}
                    }
                }
            }
            _ => {}
        }
        if let Some(t) = jinja_file {
            out.chat_template = Some(t);
        }
        for key in [
            "bos_token",
            "eos_token",
            "unk_token",
            "sep_token",
            "pad_token",
            "cls_token",
            "mask_token",
        ] {
            if let Some(v) = cfg.get(key).and_then(token_content) {
                out.special_tokens.push((key.to_owned(), v));
            }
        }
        out
    }
}

/// A loaded tokenizer directory.
#[derive(Debug)]
pub(crate) struct Assets {
    pub(crate) tokenizer: tokenizers::Tokenizer,
    pub(crate) config: TokenizerConfig,
}

impl Assets {
    pub(crate) fn load(dir: &Path) -> Result<Assets, LoadError> {
        let tok_bytes =
            read_maybe_gz(dir, "tokenizer.json")?.ok_or_else(|| LoadError::Missing {
                dir: dir.to_owned(),
                name: "tokenizer.json",
            })?;
        let tokenizer =
            tokenizers::Tokenizer::from_bytes(&tok_bytes).map_err(|e| LoadError::Tokenizer {
                path: dir.join("tokenizer.json"),
                message: e.to_string(),
            })?;
        let cfg = match read_maybe_gz(dir, "tokenizer_config.json")? {
            Some(bytes) => serde_json::from_slice(&bytes).map_err(|source| LoadError::Json {
                path: dir.join("tokenizer_config.json"),
                source,
            })?,
            None => Value::Null,
        };
        let jinja = read_maybe_gz(dir, "chat_template.jinja")?
            .map(|b| String::from_utf8_lossy(&b).into_owned());
        Ok(Assets {
            tokenizer,
            config: TokenizerConfig::from_json(&cfg, jinja),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gz_and_plain_load_the_same() {
        let dir = crate::test_util::qwen3_dir();
        let gz = Assets::load(&dir).unwrap();
        let tmp = std::env::temp_dir().join(format!("kvgate-tok-plain-{}", std::process::id()));
        std::fs::create_dir_all(&tmp).unwrap();
        for name in ["tokenizer.json", "tokenizer_config.json"] {
            let bytes = read_maybe_gz(&dir, name).unwrap().unwrap();
            std::fs::write(tmp.join(name), bytes).unwrap();
        }
        let plain = Assets::load(&tmp).unwrap();
        std::fs::remove_dir_all(&tmp).unwrap();
        assert_eq!(gz.config.chat_template, plain.config.chat_template);
        let a = gz
            .tokenizer
            .encode_fast("hello <|im_end|> 世界", false)
            .unwrap();
        let b = plain
            .tokenizer
            .encode_fast("hello <|im_end|> 世界", false)
            .unwrap();
        assert_eq!(a.get_ids(), b.get_ids());
        assert!(gz.config.chat_template.is_some());
    }

    #[test]
    fn missing_dir_is_an_error() {
        let err = Assets::load(Path::new("/nonexistent/kvgate")).unwrap_err();
        assert!(matches!(err, LoadError::Missing { .. }), "{err}");
        assert_eq!(
            err.to_string(),
            "tokenizer dir /nonexistent/kvgate: missing tokenizer.json (or tokenizer.json.gz)"
        );
    }
}

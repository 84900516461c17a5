//! The chat-template environment, configured like transformers' `apply_chat_template`:
//! jinja2 `ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)` with
//! loop controls, `tojson` = `json.dumps(ensure_ascii=False)` with Python separators,
//! `raise_exception`, `strftime_now` (local time, as Python's `datetime.now()`), Python
//! string/dict methods (minijinja-contrib pycompat), and the `continue_final_message` cut.

use std::collections::HashSet;

use minijinja::syntax::SyntaxConfig;
use minijinja::value::{Kwargs, Rest, Serde, Value as JValue, ValueKind};
use minijinja::{Environment, Error as JError, ErrorKind};
use serde_json::{Map, Value};

use crate::assets::LoadError;
use crate::bigint::BigInts;
use crate::pyjson::{self, DumpOptions};

mod context;

const DEFAULT_NAME: &str = "chat";
const TOOL_USE_NAME: &str = "tool_use";

/// The variables a chat template is rendered with.
#[derive(Debug, Clone, Default)]
pub(crate) struct TemplateInput {
    /// The normalized conversation.
    pub(crate) messages: Vec<Value>,
    /// Tool schemas as vLLM dumps them, or `None`.
    pub(crate) tools: Option<Value>,
    /// RAG documents, or `None`.
    pub(crate) documents: Option<Value>,
    /// Append the assistant header.
    pub(crate) add_generation_prompt: bool,
    /// Cut the output right after the final message's content.
    pub(crate) continue_final_message: bool,
    /// Every other template variable (`chat_template_kwargs`, `enable_thinking`, …).
    pub(crate) kwargs: Map<String, Value>,
    /// The request's integers beyond `u64`/`i64`, rendered with every digit.
    pub(crate) big_ints: BigInts,
}

/// Why a chat template could not be rendered.
#[derive(Debug, thiserror::Error)]
pub(crate) enum RenderError {
    /// The template raised or hit an unsupported construct.
    #[error("chat template failed: {0}")]
    Template(String),
    /// `continue_final_message` was set but the final message is not in the output.
    #[error("continue_final_message: final message not found in the rendered chat")]
    FinalMessageNotFound,
    /// `continue_final_message` with an empty conversation or non-text final content.
    #[error("continue_final_message: final message has no text content")]
    FinalMessageNotText,
}

/// A compiled chat template (plus the optional `tool_use` variant).
#[derive(Debug)]
pub(crate) struct ChatTemplate {
    env: Environment<'static>,
    has_tool_use: bool,
    undeclared: HashSet<String>,
    special_tokens: Vec<(String, Value)>,
}

fn raise_exception(msg: String) -> Result<JValue, JError> {
    Err(JError::new(ErrorKind::InvalidOperation, msg))
}

fn tojson(value: JValue, args: Rest<JValue>, kwargs: Kwargs) -> Result<JValue, JError> {
    // Python: tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False)
    let positional = |i: usize| args.get(i).cloned();
    let ensure_ascii = kwargs
        .get::<Option<JValue>>("ensure_ascii")?
        .or_else(|| positional(0))
        .is_some_and(|v| v.is_true());
    let indent = kwargs
        .get::<Option<JValue>>("indent")?
        .or_else(|| positional(1));
    let separators = kwargs
        .get::<Option<JValue>>("separators")?
        .or_else(|| positional(2));
    let sort_keys = kwargs
        .get::<Option<JValue>>("sort_keys")?
        .or_else(|| positional(3))
        .is_some_and(|v| v.is_true());
    kwargs.assert_all_used()?;
    let mut opts = DumpOptions::python_default(ensure_ascii);
    opts.sort_keys = sort_keys;
    match indent {
        Some(v) if v.kind() == ValueKind::String => {
            opts.indent = Some(v.as_str().unwrap_or_default().to_owned());
        }
        Some(v) if v.kind() == ValueKind::Number => {
            let n = v.as_i64().unwrap_or(0).max(0) as usize;
            opts.indent = Some(" ".repeat(n));
        }
        _ => {}
    }
    if opts.indent.is_some() {
        opts.item_sep = ",".to_owned();
    }
    if let Some(seps) = separators.filter(|v| !v.is_none()) {
        let parts: Vec<JValue> = seps.try_iter()?.collect();
        match parts.as_slice() {
            [a, b] => {
                opts.item_sep = a.as_str().unwrap_or_default().to_owned();
                opts.key_sep = b.as_str().unwrap_or_default().to_owned();
            }
            _ => {
                return Err(JError::new(
                    ErrorKind::InvalidOperation,
                    "tojson separators must be a pair",
                ));
            }
        }
    }
    pyjson::dumps_template(&value, &opts)
        .map(JValue::from)
        .map_err(|e| JError::new(ErrorKind::InvalidOperation, e.to_string()))
}

/// Python's `datetime.now().strftime(fmt)`, as transformers defines `strftime_now`: the
/// wall-clock time in the system time zone (`TZ`, else `/etc/localtime`), so a router and
/// its engines agree when they share a time zone. A directive that has no meaning for a naive
/// local time (`%z`, `%Z`, where Python prints nothing) or that jiff does not know raises,
/// and the chain asks `/render` instead.
fn strftime_now(fmt: String) -> Result<String, JError> {
    strftime_local(&fmt, jiff::ZonedDateTime::now().datetime())
}

fn strftime_local(fmt: &str, local: jiff::civil::DateTime) -> Result<String, JError> {
    jiff::fmt::strtime::format(fmt, local).map_err(|e| {
        JError::new(
            ErrorKind::InvalidOperation,
            format!("strftime_now({fmt:?}): {e}"),
        )
    })
}

/// Python `str.strip()` whitespace.
fn is_py_space(c: char) -> bool {
    c.is_whitespace() || ('\u{1c}'..='\u{1f}').contains(&c)
}

impl ChatTemplate {
    /// Compiles `default` (and `tool_use`, if the tokenizer config names one).
    pub(crate) fn new(
        default: String,
        tool_use: Option<String>,
        special_tokens: Vec<(String, Value)>,
    ) -> Result<ChatTemplate, LoadError> {
        let mut env = Environment::new();
        let syntax = SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| LoadError::Template(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_filter("tojson", tojson);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", strftime_now);
        env.add_template_owned(DEFAULT_NAME, default)
            .map_err(|e| LoadError::Template(e.to_string()))?;
        let has_tool_use = tool_use.is_some();
        if let Some(t) = tool_use {
            env.add_template_owned(TOOL_USE_NAME, t)
                .map_err(|e| LoadError::Template(e.to_string()))?;
        }
        let undeclared = env
            .get_template(DEFAULT_NAME)
            .map(|t| t.undeclared_variables(false))
            .map_err(|e| LoadError::Template(e.to_string()))?;
        Ok(ChatTemplate {
            env,
            has_tool_use,
            undeclared,
            special_tokens,
        })
    }

    /// Whether the template renders `[system, user, system, user]` without raising
    /// (vLLM's Anthropic endpoint merges inline system messages when it does not).
    pub(crate) fn accepts_inline_system(&self) -> bool {
        let msg = |role: &str| serde_json::json!({"role": role, "content": "t"});
        let input = TemplateInput {
            messages: vec![msg("system"), msg("user"), msg("system"), msg("user")],
            ..TemplateInput::default()
        };
        self.render_raw(&input, false).is_ok()
    }

    fn render_raw(
        &self,
        input: &TemplateInput,
        use_tools_template: bool,
    ) -> Result<String, RenderError> {
        let name = if use_tools_template && self.has_tool_use {
            TOOL_USE_NAME
        } else {
            DEFAULT_NAME
        };
        let tmpl = self
            .env
            .get_template(name)
            .map_err(|e| RenderError::Template(e.to_string()))?;
        let ctx = JValue::from(Serde(context::RenderContext {
            special_tokens: &self.special_tokens,
            undeclared: &self.undeclared,
            input,
        }));
        tmpl.render(ctx)
            .map_err(|e| RenderError::Template(format!("{e:#}")))
    }

    /// Renders like `tokenizer.apply_chat_template(..., tokenize=False)` (transformers 5).
    pub(crate) fn render(&self, input: &TemplateInput) -> Result<String, RenderError> {
        let use_tools = input.tools.is_some();
        if !input.continue_final_message {
            return self.render_raw(input, use_tools);
        }
        // transformers 5: tag the final message, render, cut at the tag.
        let mut tagged = input.clone();
        let final_message = tag_final_message(&mut tagged.messages)?;
        let rendered = self.render_raw(&tagged, use_tools)?;
        cut_at_tag(rendered, &final_message)
    }
}

const CONTINUE_TAG: &str = "CONTINUE_FINAL_MESSAGE_TAG ";

/// Appends [`CONTINUE_TAG`] to the final message's text; returns the original text.
fn tag_final_message(messages: &mut [Value]) -> Result<String, RenderError> {
    let content = messages
        .last_mut()
        .and_then(|m| m.get_mut("content"))
        .filter(|c| !c.is_null())
        .ok_or(RenderError::FinalMessageNotText)?;
    match content {
        Value::String(s) => {
            let original = s.clone();
            s.push_str(CONTINUE_TAG);
            Ok(original)
        }
        Value::Array(parts) => {
            for part in parts.iter_mut().rev() {
                if let Some(Value::String(t)) = part.get_mut("text") {
                    let original = t.clone();
                    t.push_str(CONTINUE_TAG);
                    return Ok(original);
                }
            }
            Err(RenderError::FinalMessageNotText)
        }
        _ => Err(RenderError::FinalMessageNotText),
    }
}

fn cut_at_tag(rendered: String, final_message: &str) -> Result<String, RenderError> {
    let tag = CONTINUE_TAG.trim_matches(is_py_space);
    if !rendered.contains(final_message.trim_matches(is_py_space)) || !rendered.contains(tag) {
        return Err(RenderError::FinalMessageNotFound);
    }
    let loc = rendered
        .rfind(tag)
        .ok_or(RenderError::FinalMessageNotFound)?;
    let mut out = rendered;
    if out.get(loc..loc + CONTINUE_TAG.len()) == Some(CONTINUE_TAG) {
        out.truncate(loc);
    } else {
        out.truncate(loc);
        let kept = out.trim_end_matches(is_py_space).len();
        out.truncate(kept);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn render(src: &str, ctx: Value) -> String {
        let t = ChatTemplate::new(src.to_owned(), None, Vec::new()).unwrap();
        let input = TemplateInput {
            messages: ctx["messages"].as_array().cloned().unwrap_or_default(),
            kwargs: ctx.as_object().cloned().unwrap_or_default(),
            ..TemplateInput::default()
        };
        t.render(&input).unwrap()
    }

    #[test]
    fn template_features_match_jinja2() {
        let ctx = serde_json::json!({
            "x": {"b": [1.0, 2], "a": "<é>"},
            "messages": [{"role": "user", "content": "  hi\n"}],
        });
        let cases = [
            (
                "tojson default",
                "{{ x | tojson }}",
                "{\"b\": [1.0, 2], \"a\": \"<é>\"}",
            ),
            (
                "tojson ascii",
                "{{ x | tojson(ensure_ascii=True) }}",
                "{\"b\": [1.0, 2], \"a\": \"<\\u00e9>\"}",
            ),
            (
                "tojson indent",
                "{{ x.b | tojson(indent=2) }}",
                "[\n  1.0,\n  2\n]",
            ),
            (
                "tojson seps",
                "{{ x | tojson(separators=(',', ':')) }}",
                "{\"b\":[1.0,2],\"a\":\"<é>\"}",
            ),
            (
                "tojson sort",
                "{{ x | tojson(sort_keys=true) }}",
                "{\"a\": \"<é>\", \"b\": [1.0, 2]}",
            ),
            ("trim_blocks", "{% if true %}\nA{% endif %}\nB", "AB"),
            ("lstrip_blocks", "  {% if true %}A{% endif %}", "A"),
            (
                "pycompat",
                "{{ messages[0].content.strip() }}|{{ 'a</think>b'.split('</think>')[-1] }}",
                "hi|b",
            ),
            ("startswith", "{{ 'abc'.startswith('ab') }}", "True"),
            (
                "slice reverse",
                "{% for m in [1,2,3][::-1] %}{{ m }}{% endfor %}",
                "321",
            ),
            ("no trailing newline", "A\n", "A"),
        ];
        for (name, src, want) in cases {
            assert_eq!(render(src, ctx.clone()), want, "{name}");
        }
    }

    #[test]
    fn raise_exception_is_an_error() {
        let t = ChatTemplate::new("{{ raise_exception('bad role') }}".into(), None, Vec::new())
            .unwrap();
        let err = t.render(&TemplateInput::default()).unwrap_err();
        assert!(err.to_string().contains("bad role"), "{err}");
    }

    #[test]
    fn strftime_formats() {
        let at = jiff::civil::date(2024, 2, 29).at(13, 5, 9, 0);
        let cases = [
            ("%Y-%m-%d %H:%M:%S", "2024-02-29 13:05:09"),
            ("%d %b %Y", "29 Feb 2024"),
            ("%B %-d, %Y (%A)", "February 29, 2024 (Thursday)"),
            ("%j%%", "060%"),
            ("%a %y", "Thu 24"),
        ];
        for (fmt, want) in cases {
            assert_eq!(strftime_local(fmt, at).unwrap(), want, "{fmt}");
        }
        for fmt in ["%z", "%Z"] {
            let err = strftime_local(fmt, at).unwrap_err();
            assert!(err.to_string().contains(fmt), "{fmt}: {err}");
        }
    }

    /// `strftime_now` is wall-clock time in the system time zone, as Python's
    /// `datetime.now()`: this test re-runs itself in a child process with `TZ` at +05:30.
    #[test]
    fn strftime_now_is_local_time() {
        const CHILD: &str = "KVGATE_TEST_STRFTIME_CHILD";
        const NAME: &str = "template::tests::strftime_now_is_local_time";
        let fmt = "%Y-%m-%d %H:%M";
        if std::env::var_os(CHILD).is_some() {
            let tz = jiff::tz::TimeZone::fixed(
                jiff::tz::offset(5) + jiff::SignedDuration::from_mins(30),
            );
            let local = |t: jiff::Timestamp| t.to_zoned_datetime(tz.clone()).datetime();
            let before = strftime_local(fmt, local(jiff::Timestamp::now())).unwrap();
            let got = strftime_now(fmt.to_owned()).unwrap();
            let after = strftime_local(fmt, local(jiff::Timestamp::now())).unwrap();
            assert!(
                got == before || got == after,
                "{got} is not {before} (+05:30)"
            );
            return;
        }
        let out = std::process::Command::new(std::env::current_exe().unwrap())
            .args([NAME, "--exact", "--test-threads=1"])
            .env(CHILD, "1")
            .env("TZ", "<+0530>-05:30")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("1 passed"),
            "{stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }

    #[test]
    fn continue_final_message_cuts() {
        let cases = [
            ("{{ messages[-1].content }}</a>", "hello", "hello"),
            ("{{ messages[-1].content | trim }}</a>", "hello ", "hello"),
            ("<a>{{ messages[-1].content }}", "  x  ", "<a>  x  "),
        ];
        for (src, content, want) in cases {
            let t = ChatTemplate::new(src.into(), None, Vec::new()).unwrap();
            let input = TemplateInput {
                messages: vec![serde_json::json!({"role": "assistant", "content": content})],
                continue_final_message: true,
                ..TemplateInput::default()
            };
            assert_eq!(t.render(&input).unwrap(), want, "{src}");
        }
    }

    /// Which value a template variable takes when a special token, a kwarg and the renderer
    /// name it alike: kwargs the template reads replace special tokens, and the renderer's
    /// own variables replace both.
    #[test]
    fn render_variables_shadow_in_order() {
        let src = "{{ bos_token }}|{{ eos_token }}|{{ messages | length }}|{{ add_generation_prompt }}|{{ tools }}";
        let special = vec![
            ("bos_token".to_owned(), serde_json::json!("<s>")),
            ("eos_token".to_owned(), serde_json::json!("</s>")),
            ("messages".to_owned(), serde_json::json!("special")),
        ];
        let t = ChatTemplate::new(src.into(), None, special).unwrap();
        let kwargs = |pairs: serde_json::Value| pairs.as_object().unwrap().clone();
        let messages = vec![serde_json::json!({"role": "user", "content": "hi"})];
        let cases = [
            (
                "no kwargs",
                kwargs(serde_json::json!({})),
                "<s>|</s>|1|False|None",
            ),
            (
                "a read kwarg replaces a special token",
                kwargs(serde_json::json!({"bos_token": "[B]"})),
                "[B]|</s>|1|False|None",
            ),
            (
                "the renderer's variables win",
                kwargs(
                    serde_json::json!({"messages": [], "tools": [1], "add_generation_prompt": true}),
                ),
                "<s>|</s>|1|False|None",
            ),
        ];
        for (name, kwargs, want) in cases {
            let input = TemplateInput {
                messages: messages.clone(),
                kwargs,
                ..TemplateInput::default()
            };
            assert_eq!(t.render(&input).unwrap(), want, "{name}");
        }
    }
}

//! Tool schemas as vLLM's pydantic models dump them (`ChatCompletionToolsParam`).

use serde_json::{Map, Value};

use super::{Rejection, invalid, object};

/// The `function` object of a tool or tool call whose `type` is `function` (the default).
pub(super) fn function_of<'a>(
    entry: &'a Value,
    what: &str,
) -> Result<&'a Map<String, Value>, Rejection> {
    let obj = object(entry, what)?;
    if obj
        .get("type")
        .and_then(Value::as_str)
        .unwrap_or("function")
        != "function"
    {
        return Err(invalid(format!("{what} type is not function")));
    }
    obj.get("function")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid(format!("{what} without function")))
}

/// `ChatCompletionToolsParam.model_dump()` (also used for converted Anthropic tools).
pub(crate) fn dump_tool(tool: &Value) -> Result<Value, Rejection> {
    let obj = object(tool, "tool")?;
    let func = function_of(tool, "tool")?;
    let name = match func.get("name") {
        Some(Value::String(s)) => s.clone(),
        _ => return Err(invalid("tool function name is not a string")),
    };
    let opt = |key: &str, ok: fn(&Value) -> bool| -> Result<Value, Rejection> {
        match func.get(key) {
            None | Some(Value::Null) => Ok(Value::Null),
            Some(v) if ok(v) => Ok(v.clone()),
            Some(_) => Err(invalid(format!("tool function {key} has the wrong type"))),
        }
    };
    let description = opt("description", Value::is_string)?;
    let parameters = opt("parameters", Value::is_object)?;
    let strict = opt("strict", Value::is_boolean)?;
    let mut defer = opt("defer_loading", Value::is_boolean)?;
    let tool_defer = match obj.get("defer_loading") {
        None | Some(Value::Null) => Value::Null,
        Some(v @ Value::Bool(_)) => v.clone(),
        Some(_) => return Err(invalid("tool defer_loading is not a bool")),
    };
    if defer.is_null() && !tool_defer.is_null() {
        defer = tool_defer.clone();
    }
    let mut f = Map::new();
    f.insert("name".into(), Value::String(name));
    f.insert("description".into(), description);
    f.insert("parameters".into(), parameters);
    if !strict.is_null() {
        f.insert("strict".into(), strict);
    }
    if !defer.is_null() {
        f.insert("defer_loading".into(), defer);
    }
    let mut t = Map::new();
    t.insert("type".into(), Value::String("function".into()));
    t.insert("function".into(), Value::Object(f));
    if !tool_defer.is_null() {
        t.insert("defer_loading".into(), tool_defer);
    }
    Ok(Value::Object(t))
}

/// The request's `tools`, each dumped; `None` when absent or null.
pub(super) fn dump_tools(tools: Option<&Value>) -> Result<Option<Value>, Rejection> {
    match tools {
        None | Some(Value::Null) => Ok(None),
        Some(Value::Array(t)) if t.is_empty() => Err(invalid("tools is an empty list")),
        Some(Value::Array(t)) => Ok(Some(Value::Array(
            t.iter().map(dump_tool).collect::<Result<Vec<_>, _>>()?,
        ))),
        Some(_) => Err(invalid("tools is not a list")),
    }
}

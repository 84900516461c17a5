#!/usr/bin/env python3
"""Generate the token-parity corpus under testdata/parity/ from a REAL vLLM render server.

Each case is a request body kept as exact text (the bytes sent). The script POSTs those
bytes unchanged to {URL}/v1/chat/completions/render, /v1/completions/render,
/v1/messages/render or /v1/responses/render and writes one file per case:

    testdata/parity/<api>/<name>.json
    {"api": "chat_completions" | "completions" | "messages" | "responses",
     "name": "<name>",
     "body": "<request body text, byte for byte what was sent>",
     "token_ids": [[...], ...]}        # one list per prompt (one for chat/messages/responses)

Usage (server from ../shared/tools/vllm-render/serve.sh, served model name "qwen3"):
    python3 scripts/gen_parity.py [--url http://127.0.0.1:8765] [--out testdata/parity]
Stdlib only. Cases whose render fails abort the run (fix the case, do not commit a hole).
"""
import argparse
import json
import os
import random
import sys
import urllib.error
import urllib.request

MODEL = "qwen3"
PATHS = {
    "chat_completions": "/v1/chat/completions/render",
    "completions": "/v1/completions/render",
    "messages": "/v1/messages/render",
    "responses": "/v1/responses/render",
}

CASES = []  # (api, name, body_text)


def raw(api, name, text):
    """A case whose body is given as exact text (key order, number spelling, escapes)."""
    json.loads(text)  # must be valid JSON
    CASES.append((api, name, text))


def obj(api, name, body, **dump_kwargs):
    """A case built from a Python dict, serialized compactly (non-ASCII kept literal)."""
    text = json.dumps({"model": MODEL, **body}, ensure_ascii=False, **dump_kwargs)
    CASES.append((api, name, text))


def chat(name, body, **kw):
    obj("chat_completions", name, body, **kw)


def user(text):
    return {"role": "user", "content": text}


def asst(text):
    return {"role": "assistant", "content": text}


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Get the current weather for a city",
        "parameters": {
            "type": "object",
            "properties": {
                "city": {"type": "string", "description": "City name"},
                "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            },
            "required": ["city"],
        },
    },
}


def long_text(seed, words):
    rng = random.Random(seed)
    vocab = ("the quick brown fox jumps over lazy dog routing cache token prefix engine "
             "kv block hash scheduler latency throughput model request stream 模型 缓存 "
             "données café naïve 1234 3.14 {json} <tag> a_b-c snake_case CamelCase").split()
    lines = []
    for _ in range(words // 12):
        lines.append(" ".join(rng.choice(vocab) for _ in range(12)))
    return "\n".join(lines)


def build_chat_cases():
    chat("hi", {"messages": [user("hi")]})
    chat("system_prompt", {"messages": [{"role": "system", "content": "You are a terse assistant."}, user("Name three primes.")]})
    chat("multi_turn", {"messages": [
        {"role": "system", "content": "Be brief."}, user("Hello!"), asst("Hi. What do you need?"),
        user("A haiku about caches."), asst("Warm lines wait in rows\nprefix found, no work redone\nlatency sleeps"),
        user("Another one, about queues.")]})
    chat("enable_thinking_false", {"messages": [user("2+2?")], "chat_template_kwargs": {"enable_thinking": False}})
    chat("reasoning_effort_none", {"messages": [user("2+3?")], "reasoning_effort": "none"})
    chat("reasoning_effort_low", {"messages": [user("2+5?")], "reasoning_effort": "low"})
    raw("chat_completions", "tools_unsorted_nested_keys", '{"model":"qwen3","messages":[{"role":"user","content":"Book it"}],'
        '"tools":[{"function":{"parameters":{"required":["when","who"],"properties":{"who":{"type":"object",'
        '"properties":{"name":{"type":"string"},"age":{"minimum":0,"type":"integer"}},"required":["name"]},'
        '"when":{"format":"date-time","type":"string"}},"type":"object"},"name":"book","description":"Book a table"},'
        '"type":"function"}]}')
    raw("chat_completions", "tools_html_quotes", '{"model":"qwen3","messages":[{"role":"user","content":"Search"}],'
        '"tools":[{"type":"function","function":{"name":"search","description":"Find <items> & \\"quoted\\" \'single\' a>b",'
        '"parameters":{"type":"object","properties":{"q":{"type":"string","description":"query <= 100 chars & no \\\\ slashes"}}}}}]}')
    raw("chat_completions", "tools_no_description", '{"model":"qwen3","messages":[{"role":"user","content":"ping"}],'
        '"tools":[{"type":"function","function":{"name":"ping"}}]}')
    raw("chat_completions", "tools_strict_and_extra_keys", '{"model":"qwen3","messages":[{"role":"user","content":"go"}],'
        '"tools":[{"type":"function","x_extra":1,"function":{"name":"go","strict":true,"unknown":"drop me",'
        '"description":"Go","parameters":{"type":"object","properties":{},"additionalProperties":false}}},'
        '{"type":"function","function":{"name":"stop","strict":null,"description":null,"parameters":null}}]}')
    raw("chat_completions", "tools_floats", '{"model":"qwen3","messages":[{"role":"user","content":"Set it"}],'
        '"tools":[{"type":"function","function":{"name":"set_temp","description":"Set temperature",'
        '"parameters":{"type":"object","properties":{"t":{"type":"number","minimum":1.0,"maximum":1e2,'
        '"default":0.5,"multipleOf":0.10,"examples":[-0.0,1E-7,2.50,100,12345678901234567890]}}}}}]}')
    raw("chat_completions", "tools_unicode_escapes", '{"model":"qwen3","messages":[{"role":"user","content":"Wetter?"}],'
        '"tools":[{"type":"function","function":{"name":"wetter","description":"Das Wetter in M\\u00fcnchen \\ud83c\\udf24 und K\\u00f6ln",'
        '"parameters":{"type":"object","properties":{"stadt":{"type":"string","description":"Stadt, z.B. \\"D\\u00fcsseldorf\\""}}}}}]}')
    raw("chat_completions", "tool_calls_and_results", '{"model":"qwen3","messages":[{"role":"user","content":"Weather in Paris?"},'
        '{"role":"assistant","content":null,"tool_calls":[{"id":"call_1","type":"function","function":{"name":"get_weather",'
        '"arguments":"{\\"city\\":\\"Paris\\",\\"unit\\":\\"celsius\\"}"}}]},'
        '{"role":"tool","tool_call_id":"call_1","content":"{\\"temp\\": 18, \\"sky\\": \\"clear\\"}"}],'
        '"tools":' + json.dumps([WEATHER_TOOL]) + '}')
    raw("chat_completions", "tool_call_args_unicode_escape", '{"model":"qwen3","messages":[{"role":"user","content":"Wetter?"},'
        '{"role":"assistant","content":"","tool_calls":[{"id":"c","type":"function","function":{"name":"get_weather",'
        '"arguments":"{\\"city\\": \\"M\\\\u00fcnchen\\", \\"note\\": \\"\\\\u65e5\\\\u672c \\\\ud83d\\\\ude00\\"}"}}]},'
        '{"role":"tool","tool_call_id":"c","content":"sunny"}],"tools":' + json.dumps([WEATHER_TOOL]) + '}')
    raw("chat_completions", "tool_call_args_invalid", '{"model":"qwen3","messages":[{"role":"user","content":"x"},'
        '{"role":"assistant","content":"Calling.","tool_calls":[{"id":"c","type":"function","function":{"name":"get_weather","arguments":"{city: Paris"}}]},'
        '{"role":"tool","tool_call_id":"c","content":"error"}],"tools":' + json.dumps([WEATHER_TOOL]) + '}')
    raw("chat_completions", "tool_call_args_empty_and_array", '{"model":"qwen3","messages":[{"role":"user","content":"x"},'
        '{"role":"assistant","content":null,"tool_calls":[{"id":"a","type":"function","function":{"name":"get_weather","arguments":""}},'
        '{"id":"b","type":"function","function":{"name":"get_weather","arguments":"[1,2]"}}]},'
        '{"role":"tool","tool_call_id":"a","content":"A"},{"role":"tool","tool_call_id":"b","content":"B"}],"tools":' + json.dumps([WEATHER_TOOL]) + '}')
    raw("chat_completions", "tool_call_args_numbers", '{"model":"qwen3","messages":[{"role":"user","content":"x"},'
        '{"role":"assistant","content":null,"tool_calls":[{"id":"n","type":"function","function":{"name":"calc",'
        '"arguments":"{\\"a\\":1e2,\\"b\\":1.0,\\"c\\":10,\\"d\\":-3.50,\\"e\\":true,\\"f\\":null,\\"g\\":[0.1,2E-5],\\"h\\":{\\"z\\":1,\\"a\\":2}}"}}]},'
        '{"role":"tool","tool_call_id":"n","content":"ok"}],'
        '"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]}')
    # Integers beyond u64/i64: Python's json keeps every digit (serde_json alone would not).
    raw("chat_completions", "tool_call_args_big_ints", '{"model":"qwen3","messages":[{"role":"user","content":"x"},'
        '{"role":"assistant","content":null,"tool_calls":[{"id":"b","type":"function","function":{"name":"calc",'
        '"arguments":"{\\"n\\": 18446744073709551616, \\"neg\\": -9223372036854775809, \\"u64\\": 18446744073709551615,'
        ' \\"i128\\": 170141183460469231731687303715884105727, \\"list\\": [99999999999999999999, 1e19, 2.5]}"}}]},'
        '{"role":"tool","tool_call_id":"b","content":"ok"}],'
        '"tools":[{"type":"function","function":{"name":"calc","parameters":{"type":"object"}}}]}')
    raw("chat_completions", "tools_big_int_schema", '{"model":"qwen3","messages":[{"role":"user","content":"Count"}],'
        '"tools":[{"type":"function","function":{"name":"count","description":"Count up",'
        '"parameters":{"type":"object","properties":{"n":{"type":"integer","minimum":-18446744073709551617,'
        '"maximum":340282366920938463463374607431768211455}}}}}]}')
    chat("parallel_tool_calls", {"messages": [
        user("Weather in Paris and Rome?"),
        {"role": "assistant", "content": "Let me check both.", "tool_calls": [
            {"id": "p", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Paris\"}"}},
            {"id": "r", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Rome\"}"}}]},
        {"role": "tool", "tool_call_id": "p", "content": "18C"},
        {"role": "tool", "tool_call_id": "r", "content": "24C"},
        asst("Paris 18C, Rome 24C."), user("Thanks")], "tools": [WEATHER_TOOL]})
    chat("tool_choice_none", {"messages": [user("Weather?")], "tools": [WEATHER_TOOL], "tool_choice": "none"})
    chat("emoji_cjk", {"messages": [user("こんにちは世界 😀🇯🇵👩‍👩‍👧 中文测试 한국어 Ελληνικά עברית")]})
    chat("content_parts", {"messages": [{"role": "user", "content": [{"type": "text", "text": "Hello"}, {"type": "text", "text": "world"}]}]})
    chat("content_parts_system_and_empty", {"messages": [
        {"role": "system", "content": [{"type": "text", "text": "Sys A"}, {"type": "text", "text": ""}, {"type": "text", "text": "Sys B"}]},
        {"role": "user", "content": [{"type": "text", "text": ""}, {"type": "text", "text": "only"}]}]})
    chat("content_parts_tool_message", {"messages": [
        user("x"), {"role": "assistant", "content": None, "tool_calls": [
            {"id": "t", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "t", "content": [{"type": "text", "text": "line1"}, {"type": "text", "text": "line2"}]}],
        "tools": [WEATHER_TOOL]})
    chat("continue_final_message", {"messages": [user("Write a list"), asst("1. apples\n2.")],
                                     "add_generation_prompt": False, "continue_final_message": True})
    chat("continue_final_message_trailing_space", {"messages": [user("Say hi"), asst("Hi there ")],
                                                   "add_generation_prompt": False, "continue_final_message": True})
    chat("add_generation_prompt_false", {"messages": [user("a"), asst("b")], "add_generation_prompt": False})
    chat("reasoning_after_last_user", {"messages": [
        user("Weather in Oslo?"),
        {"role": "assistant", "content": "", "reasoning": "Need the tool.", "tool_calls": [
            {"id": "o", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"}}]},
        {"role": "tool", "tool_call_id": "o", "content": "-2C"}], "tools": [WEATHER_TOOL]})
    chat("reasoning_content_legacy", {"messages": [
        user("q1"), {"role": "assistant", "content": "a1", "reasoning_content": "thinking 1"}, user("q2"),
        {"role": "assistant", "content": "a2", "reasoning_content": "thinking 2"}],
        "add_generation_prompt": False})
    chat("inline_think_tags", {"messages": [user("q"), asst("<think>\nsecret plan\n</think>\n\nThe answer."), user("again")]})
    chat("billing_header_system", {"messages": [
        {"role": "system", "content": "x-anthropic-billing-header: cc_version=1.0; cch=abc123\nYou are Claude Code."},
        user("ls")]})
    chat("developer_role", {"messages": [{"role": "developer", "content": "Dev rules."}, user("hi")]})
    chat("special_token_text_in_user", {"messages": [user("Literal <|im_start|>assistant and <think> tags </think> <tool_call>")]})
    chat("whitespace_heavy", {"messages": [user("  leading\n\n\ttabs\r\ntrailing   \n\n\n"), asst("\n\nok\n"), user("   ")]})
    chat("long_8k", {"messages": [{"role": "system", "content": "Summarize."}, user(long_text(8, 6200))]})
    chat("system_not_first", {"messages": [user("one"), {"role": "system", "content": "Late system."}, user("two")]})
    chat("name_field", {"messages": [{"role": "user", "content": "hi", "name": "alice"}]})
    chat("documents", {"messages": [user("Use the docs")], "documents": [{"title": "A", "text": "alpha"}]})
    chat("unknown_template_kwarg", {"messages": [user("x")], "chat_template_kwargs": {"foo": "bar", "enable_thinking": True}})
    chat("tools_system_multiturn_nothink", {"messages": [
        {"role": "system", "content": "You route requests."}, user("Weather Lima?"),
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "l", "type": "function", "function": {"name": "get_weather", "arguments": "{\"city\": \"Lima\", \"unit\": \"celsius\"}"}}]},
        {"role": "tool", "tool_call_id": "l", "content": "21C"}, asst("21C in Lima."), user("And Quito?")],
        "tools": [WEATHER_TOOL], "chat_template_kwargs": {"enable_thinking": False}})
    raw("chat_completions", "body_escapes", '{"model":"qwen3","messages":[{"role":"user","content":"caf\\u00e9 \\/ \\t tab \\u2028 sep \\ud83d\\ude00"}]}')
    chat("empty_user_content", {"messages": [user("")]})
    chat("sampling_fields_ignored", {"messages": [user("hi")], "temperature": 0.7, "top_p": 0.9, "max_tokens": 64,
                                     "stream": True, "stop": ["\n\n"], "seed": 7, "logprobs": False})
    chat("json_content", {"messages": [user(json.dumps({"k": [1, 2.0, "v"], "nested": {"a": None}}, indent=2))]})
    chat("code_content", {"messages": [user("```rust\nfn main() {\n    println!(\"{}\", 1 << 4);\n}\n```")]})
    chat("refusal_part", {"messages": [user("x"), {"role": "assistant", "content": [{"type": "refusal", "refusal": "I can't."}]}, user("ok")]})
    chat("indent_pretty_body", {"messages": [user("pretty printed request")], "tools": [WEATHER_TOOL]}, indent=2)


def build_completion_cases():
    def comp(name, body):
        obj("completions", name, body)
    comp("simple", {"prompt": "The capital of France is"})
    comp("special_tokens_text", {"prompt": "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"})
    comp("list_of_strings", {"prompt": ["first prompt", "second prompt here"]})
    comp("token_ids", {"prompt": [151644, 872, 198, 6023]})
    comp("list_of_token_lists", {"prompt": [[1, 2, 3], [4, 5]]})
    comp("add_special_tokens_false", {"prompt": "no specials", "add_special_tokens": False})
    comp("emoji_cjk", {"prompt": "日本語のテキスト 😀 and 中文 한국어"})
    comp("long_2k", {"prompt": long_text(2, 1500)})
    comp("whitespace", {"prompt": "\n\n  indented\n\ttabbed  \r\n end  "})
    comp("code", {"prompt": "def f(x):\n    return {'a': x ** 2}  # square\n"})
    comp("nfc_decomposed", {"prompt": "Cafe\u0301 and e\u0301le\u0300ve"})
    comp("sampling_fields", {"prompt": "Once upon a time", "max_tokens": 16, "temperature": 0.0, "stream": False})


def build_messages_cases():
    def msg(name, body):
        obj("messages", name, {"max_tokens": 128, **body})
    msg("simple", {"messages": [{"role": "user", "content": "Hello"}]})
    msg("system_string", {"system": "You are helpful.", "messages": [{"role": "user", "content": "Hi"}]})
    msg("system_blocks_joined", {"system": [{"type": "text", "text": "Part A."}, {"type": "text", "text": "Part B."}],
                                 "messages": [{"role": "user", "content": "Hi"}]})
    msg("system_billing_header", {"system": [{"type": "text", "text": "x-anthropic-billing-header: cc_version=2; cch=ff"},
                                             {"type": "text", "text": "You are Claude Code."}],
                                  "messages": [{"role": "user", "content": "run"}]})
    msg("user_text_blocks", {"messages": [{"role": "user", "content": [{"type": "text", "text": "one"}, {"type": "text", "text": "two"}]}]})
    tools = [{"name": "get_weather", "description": "Weather <now> & later",
              "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]
    msg("tool_use_and_result", {"tools": tools, "messages": [
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather", "input": {"city": "Paris", "n": 1.0}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "18C and clear"}]}]})
    msg("tool_result_blocks_and_text", {"tools": tools, "messages": [
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t2", "name": "get_weather", "input": {"city": "Rome"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t2",
                                      "content": [{"type": "text", "text": "24C"}, {"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "Now summarize."}]}]})
    msg("tool_use_big_int", {"tools": tools, "messages": [
        {"role": "user", "content": "Weather at station 18446744073709551616?"},
        {"role": "assistant", "content": [{"type": "tool_use", "id": "t3", "name": "get_weather",
                                           "input": {"city": "Oslo", "station": 18446744073709551616}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t3", "content": "-4C"}]}]})
    msg("thinking_disabled", {"thinking": {"type": "disabled"}, "messages": [{"role": "user", "content": "2+2"}]})
    msg("thinking_enabled_budget", {"max_tokens": 4096, "thinking": {"type": "enabled", "budget_tokens": 2048}, "messages": [{"role": "user", "content": "2+2"}]})
    msg("assistant_thinking_block", {"messages": [
        {"role": "user", "content": "q"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "let me think", "signature": "sig"},
                                          {"type": "text", "text": "answer"}]},
        {"role": "user", "content": "more"}]})
    msg("tools_schema_without_type", {"tools": [{"name": "noop", "input_schema": {"properties": {"z": {"type": "integer"}, "a": {"type": "string"}}}}],
                                      "messages": [{"role": "user", "content": "x"}]})
    msg("multi_turn_emoji", {"messages": [{"role": "user", "content": "Hi 😀"}, {"role": "assistant", "content": "Hello! 你好"},
                                          {"role": "user", "content": "Bye 👋"}]})
    msg("output_config_effort", {"output_config": {"effort": "low"}, "messages": [{"role": "user", "content": "x"}]})
    msg("inline_system_message", {"messages": [{"role": "user", "content": "a"}, {"role": "system", "content": "reminder"},
                                               {"role": "user", "content": "b"}]})


RESPONSES_WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": WEATHER_TOOL["function"]["parameters"],
}


def build_responses_cases():
    def resp(name, body, **kw):
        obj("responses", name, body, **kw)

    def item(role, content, **extra):
        return {"type": "message", "role": role, "content": content, **extra}

    def out_text(text):
        return [{"type": "output_text", "text": text, "annotations": []}]

    resp("plain_string", {"input": "Hello there"})
    resp("instructions", {"instructions": "You are a terse assistant.", "input": "Name three primes."})
    resp("empty_instructions", {"instructions": "", "input": "hi"})
    resp("multi_turn_items", {"input": [
        {"role": "user", "content": "Hello!"},
        {"role": "assistant", "content": "Hi. What do you need?"},
        {"role": "user", "content": "A haiku about caches."}]})
    resp("input_text_parts", {"input": [item("user", [
        {"type": "input_text", "text": "Hello"}, {"type": "input_text", "text": "world"}])]})
    resp("output_text_assistant", {"instructions": "Be brief.", "input": [
        item("user", [{"type": "input_text", "text": "Write a haiku about queues."}]),
        item("assistant", out_text("Lines wait in the cold\nfirst in, first out, patient rows\nthe head moves at last"),
             id="msg_1", status="completed"),
        item("user", [{"type": "input_text", "text": "Another one, about caches."}])]})
    resp("output_text_first_part_only", {"input": [
        {"role": "user", "content": "q"},
        item("assistant", out_text("first part") + out_text("second part")),
        {"role": "user", "content": "again"}]})
    resp("system_and_developer_items", {"input": [
        {"role": "system", "content": "System rules."},
        {"role": "developer", "content": "Developer rules."},
        {"role": "user", "content": "hi"}]})
    resp("function_tools", {"input": "Weather in Paris?", "tools": [RESPONSES_WEATHER_TOOL]})
    resp("function_call_and_output", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather",
         "arguments": "{\"city\":\"Paris\",\"unit\":\"celsius\"}", "id": "fc_1", "status": "completed"},
        {"type": "function_call_output", "call_id": "call_1", "output": "{\"temp\": 18, \"sky\": \"clear\"}"}]})
    resp("parallel_calls_then_answer", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "Weather in Paris and Rome?"},
        item("assistant", out_text("Let me check both.")),
        {"type": "function_call", "call_id": "p", "name": "get_weather", "arguments": "{\"city\": \"Paris\"}"},
        {"type": "function_call", "call_id": "r", "name": "get_weather", "arguments": "{\"city\": \"Rome\"}"},
        {"type": "function_call_output", "call_id": "p", "output": "18C"},
        {"type": "function_call_output", "call_id": "r", "output": [{"type": "input_text", "text": "24C"},
                                                                    {"type": "input_text", "text": "sunny"}]},
        {"role": "assistant", "content": "Paris 18C, Rome 24C."},
        {"role": "user", "content": "Thanks"}]})
    resp("reasoning_item_and_call", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "Weather in Oslo?"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "short"}],
         "content": [{"type": "reasoning_text", "text": "Need the tool."}]},
        {"type": "function_call", "call_id": "o", "name": "get_weather", "arguments": "{\"city\":\"Oslo\"}"},
        {"type": "function_call_output", "call_id": "o", "output": "-2C"}]})
    resp("reasoning_summary_only", {"input": [
        {"role": "user", "content": "q1"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "thinking 1"}]},
        item("assistant", out_text("a1")),
        {"role": "user", "content": "q2"}]})
    resp("tools_strict_no_description", {"input": "go", "tools": [
        {"type": "function", "name": "go", "strict": True, "x_extra": 1,
         "parameters": {"type": "object", "properties": {}, "additionalProperties": False}},
        {"type": "function", "name": "stop", "parameters": None}]})
    resp("tool_choice_none", {"input": "Weather?", "tools": [RESPONSES_WEATHER_TOOL], "tool_choice": "none"})
    resp("reasoning_effort_none", {"input": "2+3?", "reasoning": {"effort": "none"}})
    resp("reasoning_effort_low", {"input": "2+5?", "reasoning": {"effort": "low"}})
    resp("enable_thinking_false", {"input": "2+2?", "chat_template_kwargs": {"enable_thinking": False}})
    resp("continue_incomplete_assistant", {"input": [
        {"role": "user", "content": "Write a list"},
        item("assistant", out_text("1. apples\n2."), status="incomplete")]})
    resp("emoji_cjk", {"input": "こんにちは世界 😀🇯🇵👩‍👩‍👧 中文测试 한국어 Ελληνικά עברית",
                       "instructions": "Réponds en français, s'il te plaît."})
    raw("responses", "body_escapes", '{"model":"qwen3","input":"caf\\u00e9 \\/ \\t tab \\u2028 sep \\ud83d\\ude00",'
        '"instructions":"M\\u00fcnchen \\"quoted\\""}')
    raw("responses", "tool_call_args_unicode_escape", '{"model":"qwen3","tools":[{"type":"function","name":"get_weather",'
        '"parameters":{"type":"object","properties":{"city":{"type":"string","description":"D\\u00fcsseldorf"}}}}],'
        '"input":[{"role":"user","content":"Wetter?"},{"type":"function_call","call_id":"c","name":"get_weather",'
        '"arguments":"{\\"city\\": \\"M\\\\u00fcnchen\\", \\"n\\": 1e2}"},'
        '{"type":"function_call_output","call_id":"c","output":"sunny"}]}')
    resp("namespace_call", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "namespace": "wx", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c", "output": "ok"}]})
    resp("call_then_output_text", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}", "status": "in_progress"},
        item("assistant", out_text("after the call"))]})
    resp("call_last_in_progress", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "c", "name": "get_weather", "arguments": "{}", "status": "in_progress"}]})
    resp("call_args_invalid_and_big_int", {"tools": [RESPONSES_WEATHER_TOOL], "input": [
        {"role": "user", "content": "q"},
        {"type": "function_call", "call_id": "a", "name": "get_weather", "arguments": "{city"},
        {"type": "function_call", "call_id": "b", "name": "get_weather", "arguments": "{\"n\": 18446744073709551616}"},
        {"type": "function_call_output", "call_id": "a", "output": ""},
        {"type": "function_call_output", "call_id": "b", "output": [{"type": "input_text", "text": ""},
                                                                    {"type": "input_text", "text": "b"}]}]})
    resp("reasoning_last_incomplete", {"input": [
        {"role": "user", "content": "q"},
        {"type": "reasoning", "summary": [], "content": [{"type": "reasoning_text", "text": "hmm"}], "status": "incomplete"}]})
    resp("reasoning_empty_and_after_text", {"input": [
        {"role": "user", "content": "q"}, {"type": "reasoning", "summary": []}, {"role": "assistant", "content": "a"},
        {"role": "user", "content": "q2"}, {"role": "assistant", "content": "t"},
        {"type": "reasoning", "summary": [{"type": "summary_text", "text": "r"}]}, {"role": "user", "content": "q3"}]})
    resp("two_assistant_texts", {"input": [
        {"role": "user", "content": "q"}, {"role": "assistant", "content": "a1"},
        item("assistant", "a2"), {"role": "user", "content": "q2"}]})
    resp("tools_without_parameters_named_choice", {"input": "x", "tool_choice": {"type": "function", "name": "ping"},
                                                   "tools": [{"type": "function", "name": "ping"},
                                                             {"type": "function", "name": "d", "description": "only desc"}]})
    resp("billing_header_instructions", {"instructions": "x-anthropic-billing-header: cc=1\nYou are X.",
                                         "input": [item("developer", [{"type": "input_text", "text": "d1"},
                                                                      {"type": "input_text", "text": "d2"}]),
                                                   {"role": "user", "content": "u", "name": "alice"}]})
    resp("long_8k", {"instructions": "Summarize.", "input": long_text(8, 6200)})
    resp("long_items", {"input": [{"role": "user", "content": long_text(3, 2400)},
                                  {"role": "assistant", "content": long_text(4, 1200)},
                                  {"role": "user", "content": "Shorter, please."}]})
    resp("sampling_fields_ignored", {"input": "hi", "temperature": 0.7, "top_p": 0.9, "max_output_tokens": 64,
                                     "stream": True, "store": False, "metadata": {"k": "v"}})
    resp("indent_pretty_body", {"input": [{"role": "user", "content": "pretty printed request"}],
                                "tools": [RESPONSES_WEATHER_TOOL]}, indent=2)


def post(url, body):
    req = urllib.request.Request(url, data=body, headers={"content-type": "application/json"}, method="POST")
    with urllib.request.urlopen(req, timeout=60) as r:
        return json.loads(r.read())


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--url", default="http://127.0.0.1:8765")
    ap.add_argument("--out", default=os.path.join(os.path.dirname(__file__), "..", "testdata", "parity"))
    args = ap.parse_args()
    build_chat_cases()
    build_completion_cases()
    build_messages_cases()
    build_responses_cases()
    names = set()
    for api, name, text in CASES:
        assert (api, name) not in names, f"duplicate case {api}/{name}"
        names.add((api, name))
    failed = 0
    counts = {}
    for api, name, text in CASES:
        try:
            resp = post(args.url.rstrip("/") + PATHS[api], text.encode("utf-8"))
        except urllib.error.HTTPError as e:
            print(f"FAIL {api}/{name}: HTTP {e.code}: {e.read()[:500]!r}", file=sys.stderr)
            failed += 1
            continue
        items = resp if isinstance(resp, list) else [resp]
        token_ids = [item["token_ids"] for item in items]
        d = os.path.join(args.out, api)
        os.makedirs(d, exist_ok=True)
        with open(os.path.join(d, name + ".json"), "w", encoding="utf-8") as f:
            json.dump({"api": api, "name": name, "body": text, "token_ids": token_ids}, f, ensure_ascii=False)
            f.write("\n")
        counts[api] = counts.get(api, 0) + 1
    print("wrote", counts, "failed", failed)
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()

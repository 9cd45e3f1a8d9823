//! One normalized exchange per API dialect: where the prompt, the context
//! and the response live in OpenAI and Anthropic request and response bodies.
//!
//! Extraction walks the JSON and hands every text field to a visitor with its
//! [`Scope`] and a mutable reference, so the guard can scan each field and
//! redact it in place. Unknown shapes are skipped, never an error: the body
//! is forwarded as the client wrote it.

use serde_json::Value;

use crate::rules::Scope;

/// The API an endpoint speaks.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dialect {
    OpenAi,
    Anthropic,
}

/// The guarded endpoints.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Endpoint {
    /// `POST /v1/chat/completions`
    ChatCompletions,
    /// `POST /v1/completions`
    Completions,
    /// `POST /v1/responses`
    Responses,
    /// `POST /v1/messages`
    Messages,
}

impl Endpoint {
    /// The guarded endpoint a path names, if any.
    pub fn from_path(path: &str) -> Option<Endpoint> {
        match path.trim_end_matches('/') {
            "/v1/chat/completions" => Some(Endpoint::ChatCompletions),
            "/v1/completions" => Some(Endpoint::Completions),
            "/v1/responses" => Some(Endpoint::Responses),
            "/v1/messages" => Some(Endpoint::Messages),
            _ => None,
        }
    }

    pub fn dialect(self) -> Dialect {
        match self {
            Endpoint::Messages => Dialect::Anthropic,
            _ => Dialect::OpenAi,
        }
    }

    /// A short label for metrics.
    pub fn route(self) -> &'static str {
        match self {
            Endpoint::ChatCompletions => "chat_completions",
            Endpoint::Completions => "completions",
            Endpoint::Responses => "responses",
            Endpoint::Messages => "messages",
        }
    }
}

/// Calls `visit(scope, text)` for every text of a request body: system and
/// user messages are the prompt; tool results, function outputs and documents
/// are context. Assistant turns of the history are the model's own words and
/// are not scanned again.
pub fn request_texts(
    endpoint: Endpoint,
    body: &mut Value,
    visit: &mut dyn FnMut(Scope, &mut String),
) {
    match endpoint {
        Endpoint::ChatCompletions => {
            for message in array_mut(body, "messages") {
                let scope = match message.get("role").and_then(Value::as_str) {
                    Some("system" | "developer" | "user") => Scope::Prompt,
                    Some("tool" | "function") => Scope::Context,
                    _ => continue,
                };
                if let Some(content) = message.get_mut("content") {
                    content_texts(content, scope, visit);
                }
            }
        }
        Endpoint::Completions => {
            if let Some(prompt) = body.get_mut("prompt") {
                strings(prompt, Scope::Prompt, visit);
            }
        }
        Endpoint::Responses => {
            if let Some(Value::String(instructions)) = body.get_mut("instructions") {
                visit(Scope::Prompt, instructions);
            }
            match body.get_mut("input") {
                Some(Value::String(input)) => visit(Scope::Prompt, input),
                Some(Value::Array(items)) => {
                    for item in items {
                        match item.get("type").and_then(Value::as_str) {
                            Some("function_call_output") => {
                                if let Some(output) = item.get_mut("output") {
                                    content_texts(output, Scope::Context, visit);
                                }
                            }
                            _ if item.get("role").and_then(Value::as_str) == Some("assistant") => {}
                            _ => {
                                if let Some(content) = item.get_mut("content") {
                                    content_texts(content, Scope::Prompt, visit);
                                }
                            }
                        }
                    }
                }
                _ => {}
            }
        }
        Endpoint::Messages => {
            if let Some(system) = body.get_mut("system") {
                content_texts(system, Scope::Prompt, visit);
            }
            for message in array_mut(body, "messages") {
                if message.get("role").and_then(Value::as_str) != Some("user") {
                    continue;
                }
                match message.get_mut("content") {
                    Some(Value::String(text)) => visit(Scope::Prompt, text),
                    Some(Value::Array(blocks)) => {
                        for block in blocks {
                            anthropic_block(block, Scope::Prompt, visit);
                        }
                    }
                    _ => {}
                }
            }
        }
    }
}

/// Calls `visit` for every text of a (non-streaming) response body: the
/// assistant's text, its refusal, and the arguments of its tool calls.
pub fn response_texts(endpoint: Endpoint, body: &mut Value, visit: &mut dyn FnMut(&mut String)) {
    match endpoint {
        Endpoint::ChatCompletions => {
            for choice in array_mut(body, "choices") {
                let Some(message) = choice.get_mut("message") else {
                    continue;
                };
                for field in ["content", "refusal"] {
                    if let Some(Value::String(text)) = message.get_mut(field) {
                        visit(text);
                    }
                }
                for call in array_mut(message, "tool_calls") {
                    if let Some(Value::String(arguments)) = call.pointer_mut("/function/arguments")
                    {
                        visit(arguments);
                    }
                }
            }
        }
        Endpoint::Completions => {
            for choice in array_mut(body, "choices") {
                if let Some(Value::String(text)) = choice.get_mut("text") {
                    visit(text);
                }
            }
        }
        Endpoint::Responses => {
            for item in array_mut(body, "output") {
                if let Some(Value::String(arguments)) = item.get_mut("arguments") {
                    visit(arguments);
                }
                for part in array_mut(item, "content") {
                    for field in ["text", "refusal"] {
                        if let Some(Value::String(text)) = part.get_mut(field) {
                            visit(text);
                        }
                    }
                }
            }
        }
        Endpoint::Messages => {
            for block in array_mut(body, "content") {
                if let Some(Value::String(text)) = block.get_mut("text") {
                    visit(text);
                }
            }
        }
    }
}

fn array_mut<'a>(value: &'a mut Value, key: &str) -> impl Iterator<Item = &'a mut Value> {
    value
        .get_mut(key)
        .and_then(Value::as_array_mut)
        .into_iter()
        .flat_map(|items| items.iter_mut())
}

/// A string, or an array of strings.
fn strings(value: &mut Value, scope: Scope, visit: &mut dyn FnMut(Scope, &mut String)) {
    match value {
        Value::String(text) => visit(scope, text),
        Value::Array(items) => items
            .iter_mut()
            .for_each(|item| strings(item, scope, visit)),
        _ => {}
    }
}

/// OpenAI message content: a string, or parts of which the text ones count
/// (`text`, `input_text`, `output_text`).
fn content_texts(content: &mut Value, scope: Scope, visit: &mut dyn FnMut(Scope, &mut String)) {
    match content {
        Value::String(text) => visit(scope, text),
        Value::Array(parts) => {
            for part in parts {
                match part {
                    Value::String(text) => visit(scope, text),
                    Value::Object(_) => anthropic_block(part, scope, visit),
                    _ => {}
                }
            }
        }
        _ => {}
    }
}

/// A content block (Anthropic) or part (OpenAI): text in `scope`; tool
/// results and documents are context.
fn anthropic_block(block: &mut Value, scope: Scope, visit: &mut dyn FnMut(Scope, &mut String)) {
    match block.get("type").and_then(Value::as_str) {
        Some("text" | "input_text" | "output_text") => {
            if let Some(Value::String(text)) = block.get_mut("text") {
                visit(scope, text);
            }
        }
        Some("tool_result") => {
            if let Some(content) = block.get_mut("content") {
                content_texts(content, Scope::Context, visit);
            }
        }
        Some("document") => {
            if block_is_text_document(block) {
                if let Some(Value::String(text)) = block.pointer_mut("/source/data") {
                    visit(Scope::Context, text);
                }
            } else if let Some(Value::Array(parts)) = block.pointer_mut("/source/content") {
                for part in parts {
                    anthropic_block(part, Scope::Context, visit);
                }
            }
        }
        _ => {}
    }
}

fn block_is_text_document(block: &Value) -> bool {
    block.pointer("/source/type").and_then(Value::as_str) == Some("text")
}

#[cfg(test)]
mod tests {
    use serde_json::json;

    use super::*;

    fn collect_request(endpoint: Endpoint, mut body: Value) -> Vec<(Scope, String)> {
        let mut out = Vec::new();
        request_texts(endpoint, &mut body, &mut |scope, text| {
            out.push((scope, text.clone()))
        });
        out
    }

    #[test]
    fn chat_completions_prompt_and_tool_context() {
        let body = json!({"model": "gpt", "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": "earlier answer"},
            {"role": "tool", "tool_call_id": "1", "content": "tool said"}
        ]});
        assert_eq!(
            collect_request(Endpoint::ChatCompletions, body),
            [
                (Scope::Prompt, "be nice".into()),
                (Scope::Prompt, "hi".into()),
                (Scope::Context, "tool said".into())
            ]
        );
    }

    #[test]
    fn anthropic_messages_system_tool_results_and_documents() {
        let body = json!({"model": "claude", "system": [{"type": "text", "text": "sys"}], "messages": [
            {"role": "user", "content": [
                {"type": "text", "text": "question"},
                {"type": "tool_result", "tool_use_id": "t", "content": [{"type": "text", "text": "result"}]},
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc text"}}
            ]},
            {"role": "assistant", "content": "old"}
        ]});
        assert_eq!(
            collect_request(Endpoint::Messages, body),
            [
                (Scope::Prompt, "sys".into()),
                (Scope::Prompt, "question".into()),
                (Scope::Context, "result".into()),
                (Scope::Context, "doc text".into())
            ]
        );
    }

    #[test]
    fn responses_and_completions_inputs() {
        let body = json!({"instructions": "inst", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"type": "function_call_output", "call_id": "c", "output": "out"}
        ]});
        assert_eq!(
            collect_request(Endpoint::Responses, body),
            [
                (Scope::Prompt, "inst".into()),
                (Scope::Prompt, "q".into()),
                (Scope::Context, "out".into())
            ]
        );
        let body = json!({"prompt": ["a", "b"]});
        assert_eq!(
            collect_request(Endpoint::Completions, body),
            [(Scope::Prompt, "a".into()), (Scope::Prompt, "b".into())]
        );
    }

    #[test]
    fn texts_are_edited_in_place() {
        let mut body = json!({"messages": [{"role": "user", "content": "secret"}]});
        request_texts(Endpoint::ChatCompletions, &mut body, &mut |_, text| {
            *text = "[x]".into()
        });
        assert_eq!(body["messages"][0]["content"], "[x]");
    }

    #[test]
    fn response_texts_of_each_endpoint() {
        let mut seen = Vec::new();
        let mut body = json!({"choices": [{"message": {"content": "hello", "tool_calls": [{"function": {"arguments": "{\"a\":1}"}}]}}]});
        response_texts(Endpoint::ChatCompletions, &mut body, &mut |t| {
            seen.push(t.clone())
        });
        let mut body = json!({"content": [{"type": "text", "text": "claude says"}, {"type": "tool_use", "input": {}}]});
        response_texts(Endpoint::Messages, &mut body, &mut |t| seen.push(t.clone()));
        let mut body = json!({"output": [{"type": "message", "content": [{"type": "output_text", "text": "resp"}]}]});
        response_texts(Endpoint::Responses, &mut body, &mut |t| {
            seen.push(t.clone())
        });
        assert_eq!(seen, ["hello", "{\"a\":1}", "claude says", "resp"]);
    }
}

//! One normalized exchange per API dialect: where the prompt, the context
//! and the response live in OpenAI and Anthropic request and response bodies.
//!
//! Extraction reads a body through the borrowed views of [`crate::json`] and
//! lists every text with its [`Scope`] and its place in the body, so the
//! guard can scan each one and rewrite only the redacted ones. Unknown shapes
//! are skipped, never an error: the body is forwarded as the client wrote
//! it. The one error besides a body that is not JSON is ambiguity: an object
//! read on the way to a text that holds a key twice.

use std::borrow::Cow;
use std::ops::Range;

use crate::json::{self, BodyError, Fields, Members, Raw};
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

/// A text of a body: its scope, its value, and where its JSON string lies
/// in the body (quotes included), for a redaction to rewrite.
#[derive(Debug, Clone, PartialEq)]
pub struct Text<'a> {
    pub scope: Scope,
    pub text: Cow<'a, str>,
    pub span: Range<usize>,
}

/// What the guard reads of a request body.
#[derive(Debug, Default)]
pub struct RequestBody<'a> {
    pub model: Option<Cow<'a, str>>,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// The `metadata` object, for [`crate::record::ClientMeta`].
    pub metadata: Option<Raw<'a>>,
    /// System and user messages are the prompt; tool results, function
    /// outputs and documents are context. Assistant turns of the history
    /// are the model's own words and are not scanned again.
    pub texts: Vec<Text<'a>>,
}

impl<'a> RequestBody<'a> {
    /// Reads a request body; an error when it is not JSON, or when an
    /// object the guard reads holds one of its keys twice.
    pub fn read(endpoint: Endpoint, body: &'a [u8]) -> Result<RequestBody<'a>, BodyError> {
        let top = Fields::body(body)?;
        let mut texts = Texts::new(body);
        match endpoint {
            Endpoint::ChatCompletions => {
                for message in Fields::objects(top.messages)? {
                    let scope = match json::string(message.role).as_deref() {
                        Some("system" | "developer" | "user") => Scope::Prompt,
                        Some("tool" | "function") => Scope::Context,
                        _ => continue,
                    };
                    texts.content(message.content, scope)?;
                }
            }
            Endpoint::Completions => texts.strings(top.prompt, Scope::Prompt)?,
            Endpoint::Responses => {
                texts.text(top.instructions, Scope::Prompt);
                texts.text(top.input, Scope::Prompt);
                for item in Fields::objects(top.input)? {
                    if json::string(item.kind).as_deref() == Some("function_call_output") {
                        texts.content(item.output, Scope::Context)?;
                    } else if json::string(item.role).as_deref() != Some("assistant") {
                        texts.content(item.content, Scope::Prompt)?;
                    }
                }
            }
            Endpoint::Messages => {
                texts.content(top.system, Scope::Prompt)?;
                for message in Fields::objects(top.messages)? {
                    if json::string(message.role).as_deref() != Some("user") {
                        continue;
                    }
                    texts.text(message.content, Scope::Prompt);
                    for block in json::items(message.content)? {
                        texts.block(block, Scope::Prompt)?;
                    }
                }
            }
        }
        let options = Fields::of(top.stream_options)?;
        Ok(RequestBody {
            model: json::string(top.model),
            stream: json::boolean(top.stream) == Some(true),
            include_usage: json::boolean(options.include_usage) == Some(true),
            metadata: top.metadata,
            texts: texts.found,
        })
    }
}

/// What the guard reads of a (non-streaming) response body.
#[derive(Debug, Default)]
pub struct ResponseBody<'a> {
    /// The assistant's text, its refusal, and the arguments of its tool
    /// calls, all in [`Scope::Response`].
    pub texts: Vec<Text<'a>>,
    /// The `usage` object.
    pub usage: Option<Raw<'a>>,
}

impl<'a> ResponseBody<'a> {
    /// Reads a response body; an error as for [`RequestBody::read`].
    pub fn read(endpoint: Endpoint, body: &'a [u8]) -> Result<ResponseBody<'a>, BodyError> {
        let top = Fields::body(body)?;
        let mut texts = Texts::new(body);
        let scope = Scope::Response;
        match endpoint {
            Endpoint::ChatCompletions => {
                for choice in Fields::objects(top.choices)? {
                    let message = Fields::of(choice.message)?;
                    texts.text(message.content, scope);
                    texts.text(message.refusal, scope);
                    for call in Fields::objects(message.tool_calls)? {
                        let function = Fields::of(call.function)?;
                        texts.text(function.arguments, scope);
                    }
                }
            }
            Endpoint::Completions => {
                for choice in Fields::objects(top.choices)? {
                    texts.text(choice.text, scope);
                }
            }
            Endpoint::Responses => {
                for item in Fields::objects(top.output)? {
                    texts.text(item.arguments, scope);
                    for part in Fields::objects(item.content)? {
                        texts.text(part.text, scope);
                        texts.text(part.refusal, scope);
                    }
                }
            }
            Endpoint::Messages => {
                for block in Fields::objects(top.content)? {
                    texts.text(block.text, scope);
                }
            }
        }
        Ok(ResponseBody {
            texts: texts.found,
            usage: top.usage,
        })
    }
}

/// The texts found so far in a body.
struct Texts<'a> {
    body: &'a [u8],
    found: Vec<Text<'a>>,
}

impl<'a> Texts<'a> {
    fn new(body: &'a [u8]) -> Texts<'a> {
        Texts {
            body,
            found: Vec::new(),
        }
    }

    /// A string value, if `raw` is one.
    fn text(&mut self, raw: Option<Raw<'a>>, scope: Scope) {
        if let Some(raw) = raw
            && let Some(text) = json::string(Some(raw))
        {
            let span = json::span(self.body, raw);
            self.found.push(Text { scope, text, span });
        }
    }

    /// A string, or an array of strings (nested at any depth).
    fn strings(&mut self, raw: Option<Raw<'a>>, scope: Scope) -> Result<(), BodyError> {
        self.text(raw, scope);
        for item in json::items(raw)? {
            self.strings(Some(item), scope)?;
        }
        Ok(())
    }

    /// OpenAI message content: a string, or parts of which the strings and
    /// the text blocks count.
    fn content(&mut self, raw: Option<Raw<'a>>, scope: Scope) -> Result<(), BodyError> {
        self.text(raw, scope);
        for part in json::items(raw)? {
            self.text(Some(part), scope);
            self.block(part, scope)?;
        }
        Ok(())
    }

    /// A content block (Anthropic) or part (OpenAI): text (`text`,
    /// `input_text`, `output_text`) in `scope`; tool results and documents
    /// are context.
    fn block(&mut self, raw: Raw<'a>, scope: Scope) -> Result<(), BodyError> {
        let block = Fields::of(Some(raw))?;
        match json::string(block.kind).as_deref() {
            Some("text" | "input_text" | "output_text") => self.text(block.text, scope),
            Some("tool_result") => self.content(block.content, Scope::Context)?,
            Some("document") => {
                let source = Fields::of(block.source)?;
                if json::string(source.kind).as_deref() == Some("text") {
                    self.text(source.data, Scope::Context);
                } else {
                    for part in json::items(source.content)? {
                        self.block(part, Scope::Context)?;
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use serde_json::{Value, json};

    use super::*;

    fn collect_request(endpoint: Endpoint, body: Value) -> Vec<(Scope, String)> {
        let body = body.to_string();
        let read = RequestBody::read(endpoint, body.as_bytes()).unwrap();
        read.texts
            .into_iter()
            .map(|t| {
                // Each span is the text's JSON string in the body.
                let quoted: String = serde_json::from_str(&body[t.span.clone()]).unwrap();
                assert_eq!(quoted, t.text);
                (t.scope, t.text.into_owned())
            })
            .collect()
    }

    #[test]
    fn chat_completions_prompt_and_tool_context() {
        let body = json!({"model": "gpt", "stream": true, "stream_options": {"include_usage": true}, "messages": [
            {"role": "system", "content": "be nice"},
            {"role": "user", "content": [{"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": "x"}}]},
            {"role": "assistant", "content": "earlier answer"},
            {"role": "tool", "tool_call_id": "1", "content": "tool said"}
        ]});
        let text = body.to_string();
        let read = RequestBody::read(Endpoint::ChatCompletions, text.as_bytes()).unwrap();
        assert_eq!(read.model.as_deref(), Some("gpt"));
        assert!(read.stream && read.include_usage);
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
                {"type": "document", "source": {"type": "text", "media_type": "text/plain", "data": "doc text"}},
                {"type": "document", "source": {"type": "content", "content": [{"type": "text", "text": "part"}]}}
            ]},
            {"role": "assistant", "content": "old"}
        ]});
        assert_eq!(
            collect_request(Endpoint::Messages, body),
            [
                (Scope::Prompt, "sys".into()),
                (Scope::Prompt, "question".into()),
                (Scope::Context, "result".into()),
                (Scope::Context, "doc text".into()),
                (Scope::Context, "part".into())
            ]
        );
    }

    #[test]
    fn responses_and_completions_inputs() {
        let body = json!({"instructions": "inst", "input": [
            {"role": "user", "content": [{"type": "input_text", "text": "q"}]},
            {"role": "assistant", "content": [{"type": "output_text", "text": "mine"}]},
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
        let body = json!({"prompt": ["a", ["b"], 7]});
        assert_eq!(
            collect_request(Endpoint::Completions, body),
            [(Scope::Prompt, "a".into()), (Scope::Prompt, "b".into())]
        );
    }

    #[test]
    fn ambiguous_or_broken_bodies_are_errors_and_odd_shapes_are_skipped() {
        let twice = br#"{"messages": [{"role": "user", "content": "a", "content": "b"}]}"#;
        assert!(RequestBody::read(Endpoint::ChatCompletions, twice).is_err());
        assert!(RequestBody::read(Endpoint::ChatCompletions, b"{\"messages\": [").is_err());
        for odd in [
            &b"[1, 2]"[..],
            b"\"text\"",
            b"{\"messages\": {\"role\": \"user\"}}",
            b"{\"messages\": [null, 3, {\"role\": 1}]}",
        ] {
            let read = RequestBody::read(Endpoint::ChatCompletions, odd).unwrap();
            assert!(read.texts.is_empty());
        }
    }

    #[test]
    fn response_texts_of_each_endpoint() {
        let mut seen = Vec::new();
        for (endpoint, body) in [
            (
                Endpoint::ChatCompletions,
                json!({"choices": [{"message": {"content": "hello", "refusal": null, "tool_calls": [{"function": {"arguments": "{\"a\":1}"}}]}}], "usage": {"total_tokens": 3}}),
            ),
            (
                Endpoint::Messages,
                json!({"content": [{"type": "text", "text": "claude says"}, {"type": "tool_use", "input": {}}]}),
            ),
            (
                Endpoint::Responses,
                json!({"output": [{"type": "message", "content": [{"type": "output_text", "text": "resp"}]}]}),
            ),
            (
                Endpoint::Completions,
                json!({"choices": [{"text": "completed"}]}),
            ),
        ] {
            let body = body.to_string();
            let read = ResponseBody::read(endpoint, body.as_bytes()).unwrap();
            if endpoint == Endpoint::ChatCompletions {
                assert_eq!(read.usage.map(Raw::get), Some(r#"{"total_tokens":3}"#));
            }
            seen.extend(read.texts.into_iter().map(|t| t.text.into_owned()));
        }
        assert_eq!(
            seen,
            ["hello", "{\"a\":1}", "claude says", "resp", "completed"]
        );
    }
}

//! Every response fairgate makes itself, in the dialect of the API that was
//! called: errors, blocked prompts, and the refusal shapes of blocked
//! responses. One place maps each failure to a status and a stable `code`,
//! without leaking internals.

use bytes::Bytes;
use http::{HeaderName, HeaderValue, Response, StatusCode, header};
use http_body_util::{BodyExt, Full};
use serde_json::{Value, json};

use super::ProxyBody;
use crate::exchange::{Dialect, Endpoint};
use crate::json::ReadError;

/// A failure of the proxy, as the client sees it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Failure {
    /// The request body is larger than `guard.max_body_bytes`.
    TooLarge,
    /// The body of a guarded route is not JSON.
    InvalidJson,
    /// An object of the body the guard reads holds a key twice.
    AmbiguousJson,
    /// The body is not compressed as its `Content-Encoding` says.
    BadEncoding,
    /// The body is compressed in a way the guard cannot read.
    UnsupportedEncoding,
    /// The body stopped arriving for `client_body_timeout_ms`.
    ClientTimeout,
    /// The body going up as it arrived broke off before its end (its
    /// client closed the connection, or sent a malformed chunk): the
    /// client's failure, answered as nginx logs it.
    BodyBrokeOff,
    /// No upstream could be reached.
    UpstreamUnreachable,
    /// The upstream did not answer in time.
    UpstreamTimeout,
    /// The upstream's response could not be read.
    UpstreamBroken,
    /// No route matches the path.
    NoRoute,
    /// The path's bytes and its plain form (decoded, normalized) would be
    /// read as different requests.
    AmbiguousPath,
    /// A WebSocket on a guarded path, or anywhere with `guard.upgrades:
    /// refuse` (with `guarded`, any but a Realtime API session's); with
    /// either, the setup of a Realtime session held elsewhere.
    UpgradeRefused,
    /// fairgate itself failed (a panic) while handling the request.
    Fault,
}

impl Failure {
    /// Whether the client's own body failed the request on its way up
    /// (stopped arriving, or broke off): the client's failure, not the
    /// upstream's, and its answer rather than the unread body.
    pub fn of_client_body(self) -> bool {
        matches!(self, Failure::ClientTimeout | Failure::BodyBrokeOff)
    }

    fn status(self) -> StatusCode {
        match self {
            Failure::TooLarge => StatusCode::PAYLOAD_TOO_LARGE,
            Failure::InvalidJson
            | Failure::AmbiguousJson
            | Failure::AmbiguousPath
            | Failure::BadEncoding
            | Failure::BodyBrokeOff => StatusCode::BAD_REQUEST,
            Failure::UnsupportedEncoding => StatusCode::UNSUPPORTED_MEDIA_TYPE,
            Failure::ClientTimeout => StatusCode::REQUEST_TIMEOUT,
            Failure::UpstreamUnreachable | Failure::UpstreamBroken => StatusCode::BAD_GATEWAY,
            Failure::UpstreamTimeout => StatusCode::GATEWAY_TIMEOUT,
            Failure::NoRoute => StatusCode::NOT_FOUND,
            Failure::UpgradeRefused => StatusCode::FORBIDDEN,
            Failure::Fault => StatusCode::INTERNAL_SERVER_ERROR,
        }
    }

    pub fn code(self) -> &'static str {
        match self {
            Failure::TooLarge => "request_too_large",
            Failure::InvalidJson => "invalid_json",
            Failure::AmbiguousJson => "ambiguous_json",
            Failure::BadEncoding => "invalid_encoding",
            Failure::UnsupportedEncoding => "unsupported_content_encoding",
            Failure::ClientTimeout => "request_timeout",
            Failure::BodyBrokeOff => "incomplete_request_body",
            Failure::UpstreamUnreachable => "upstream_unreachable",
            Failure::UpstreamTimeout => "upstream_timeout",
            Failure::UpstreamBroken => "upstream_error",
            Failure::NoRoute => "not_found",
            Failure::AmbiguousPath => "ambiguous_path",
            Failure::UpgradeRefused => "upgrade_refused",
            Failure::Fault => "internal_error",
        }
    }

    pub fn message(self) -> &'static str {
        match self {
            Failure::TooLarge => "The request body is larger than this gateway accepts.",
            Failure::InvalidJson => "The request body is not valid JSON.",
            Failure::AmbiguousJson => {
                "The request body gives a key twice in one object; which value counts is ambiguous."
            }
            Failure::BadEncoding => {
                "The request body could not be decompressed as its Content-Encoding says."
            }
            Failure::UnsupportedEncoding => {
                "This gateway reads request bodies uncompressed or in gzip or deflate; send the body in one of those."
            }
            Failure::ClientTimeout => {
                "The request body stopped arriving before its end; send it again."
            }
            Failure::BodyBrokeOff => {
                "The request body broke off before its end (the connection closed, or a chunk was malformed); send it again."
            }
            Failure::UpstreamUnreachable => "The upstream API could not be reached.",
            Failure::UpstreamTimeout => "The upstream API did not answer in time.",
            Failure::UpstreamBroken => "The upstream API's response could not be read.",
            Failure::NoRoute => "No upstream serves this path.",
            Failure::AmbiguousPath => {
                "The request path has empty or dot segments, percent-encoded characters or ';' parameters, and an API may read it as a path this gateway guards; send the path in its plain form."
            }
            Failure::UpgradeRefused => {
                "This gateway refuses sessions it would not read: WebSockets on the paths it guards as HTTP; with guard.upgrades: guarded, every WebSocket but a Realtime API session's and every Realtime session set up to be held elsewhere; with refuse, every session."
            }
            Failure::Fault => {
                "This gateway failed while handling the request (an internal fault, logged under the request's ID); nothing past the fault was relayed."
            }
        }
    }

    /// The error type of the Anthropic envelope.
    fn anthropic_type(self) -> &'static str {
        match self {
            Failure::TooLarge => "request_too_large",
            Failure::InvalidJson
            | Failure::AmbiguousJson
            | Failure::AmbiguousPath
            | Failure::BadEncoding
            | Failure::UnsupportedEncoding
            | Failure::ClientTimeout
            | Failure::BodyBrokeOff => "invalid_request_error",
            Failure::NoRoute => "not_found_error",
            Failure::UpgradeRefused => "permission_error",
            _ => "api_error",
        }
    }

    fn openai_type(self) -> &'static str {
        match self {
            Failure::TooLarge
            | Failure::InvalidJson
            | Failure::AmbiguousJson
            | Failure::AmbiguousPath
            | Failure::BadEncoding
            | Failure::UnsupportedEncoding
            | Failure::ClientTimeout
            | Failure::BodyBrokeOff
            | Failure::NoRoute
            | Failure::UpgradeRefused => "invalid_request_error",
            _ => "server_error",
        }
    }
}

/// The code of an error fairgate answered itself, kept in the response's
/// extensions for `fairgate_error_answers_total`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ErrorAnswer(pub &'static str);

/// A response of fairgate's own error `code`.
fn error_answer(
    status: StatusCode,
    body: &Value,
    code: &'static str,
    request_id: &str,
) -> Response<ProxyBody> {
    let mut response = json_response(status, body, request_id, None);
    response.extensions_mut().insert(ErrorAnswer(code));
    response
}

/// The response for a failure. A fault is not worth a retry: the same
/// request meets the same fault.
pub fn failure(dialect: Dialect, failure: Failure, request_id: &str) -> Response<ProxyBody> {
    let body = failure_body(dialect, failure, None);
    let mut response = error_answer(failure.status(), &body, failure.code(), request_id);
    if let Failure::Fault = failure {
        response
            .headers_mut()
            .insert("x-should-retry", HeaderValue::from_static("false"));
    }
    response
}

/// The 400 for a request body the guard could not read, saying why (where
/// the JSON breaks off, the key given twice); `what` names what could not
/// be read ("Line 3 of the batch input"), the request body when `None`.
/// The reasons name places and keys the guard reads, never the body's text.
pub fn unreadable(
    dialect: Dialect,
    error: &ReadError,
    what: Option<&str>,
    request_id: &str,
) -> Response<ProxyBody> {
    let (failure, message) = unreadable_failure(error, what.unwrap_or("The request body"));
    let body = failure_body(dialect, failure, Some(&message));
    error_answer(failure.status(), &body, failure.code(), request_id)
}

/// The failure of `what` (a body, an event) that `error` kept from being
/// read, and the message that says why.
pub fn unreadable_failure(error: &ReadError, what: &str) -> (Failure, String) {
    match error {
        ReadError::Invalid(reason) => (
            Failure::InvalidJson,
            format!("{what} could not be read as JSON: {reason}."),
        ),
        ReadError::Ambiguous(key) => (
            Failure::AmbiguousJson,
            format!(
                "{what} gives the key {key:?} twice in one object; which value counts is ambiguous."
            ),
        ),
    }
}

/// The error envelope of `failure` in `dialect`, as the API writes it in a
/// response body or in a stream's error event; `message` in place of the
/// failure's own.
pub fn failure_body(dialect: Dialect, failure: Failure, message: Option<&str>) -> Value {
    let message = message.unwrap_or(failure.message());
    match dialect {
        Dialect::OpenAi => json!({"error": {
            "message": message,
            "type": failure.openai_type(),
            "param": null,
            "code": failure.code(),
        }}),
        Dialect::Anthropic => json!({"type": "error", "error": {
            "type": failure.anthropic_type(),
            "message": message,
        }}),
    }
}

/// A 400 for a malformed fairgate request (such as feedback), in the OpenAI
/// error shape.
pub fn invalid_request(message: &str, code: &'static str, request_id: &str) -> Response<ProxyBody> {
    let body = json!({"error": {
        "message": message,
        "type": "invalid_request_error",
        "param": null,
        "code": code,
    }});
    error_answer(StatusCode::BAD_REQUEST, &body, code, request_id)
}

/// 202: feedback about `about` was queued.
pub fn accepted(about: &str, request_id: &str) -> Response<ProxyBody> {
    json_response(
        StatusCode::ACCEPTED,
        &json!({"status": "queued", "request_id": about}),
        request_id,
        None,
    )
}

/// The 400 that answers a blocked prompt (or, with `on_block: error`, a
/// blocked response). SDKs treat it as a non-retryable bad request.
pub fn blocked(
    dialect: Dialect,
    scope: &str,
    message: &str,
    rules: &[String],
    request_id: &str,
) -> Response<ProxyBody> {
    let body = blocked_body(dialect, scope, message, rules, request_id);
    let mut response = json_response(StatusCode::BAD_REQUEST, &body, request_id, Some("block"));
    response
        .headers_mut()
        .insert("x-should-retry", HeaderValue::from_static("false"));
    response
}

/// The body of [`blocked`]'s 400.
pub fn blocked_body(
    dialect: Dialect,
    scope: &str,
    message: &str,
    rules: &[String],
    request_id: &str,
) -> Value {
    match dialect {
        Dialect::OpenAi => json!({"error": {
            "message": message,
            "type": "invalid_request_error",
            "param": "messages",
            "code": "content_filter",
            "fairgate": {"scope": scope, "rules": rules, "request_id": request_id},
        }}),
        Dialect::Anthropic => json!({"type": "error", "error": {
            "type": "invalid_request_error",
            "message": message,
        }}),
    }
}

/// Rewrites a successful response body into a refusal: OpenAI
/// `finish_reason: "content_filter"` with the message as `refusal`,
/// Anthropic `stop_reason: "refusal"` with the message as the only content.
/// Usage and ids are kept.
pub fn refusal(endpoint: Endpoint, body: &[u8], message: &str) -> Bytes {
    // The body was read by the guard already: it is JSON, though maybe not
    // an object (an upstream's `[]`), which holds no answer to keep.
    let mut body: Value = serde_json::from_slice(body)
        .ok()
        .filter(Value::is_object)
        .unwrap_or_else(|| json!({}));
    refuse_in_place(endpoint, &mut body, message);
    Bytes::from(body.to_string())
}

pub fn refuse_in_place(endpoint: Endpoint, body: &mut Value, message: &str) {
    match endpoint {
        Endpoint::ChatCompletions => {
            if let Some(choices) = body.get_mut("choices").and_then(Value::as_array_mut) {
                for choice in choices {
                    choice["finish_reason"] = json!("content_filter");
                    let message_value =
                        json!({"role": "assistant", "content": null, "refusal": message});
                    choice["message"] = message_value;
                    // Its tokens are the refused text.
                    if let Some(logprobs) = choice.get_mut("logprobs") {
                        *logprobs = Value::Null;
                    }
                }
            }
        }
        Endpoint::Completions => {
            if let Some(choices) = body.get_mut("choices").and_then(Value::as_array_mut) {
                for choice in choices {
                    choice["text"] = json!("");
                    choice["finish_reason"] = json!("content_filter");
                    if let Some(logprobs) = choice.get_mut("logprobs") {
                        *logprobs = Value::Null;
                    }
                }
            }
        }
        Endpoint::Responses => {
            body["status"] = json!("incomplete");
            body["incomplete_details"] = json!({"reason": "content_filter"});
            body["output"] = json!([{
                "type": "message",
                "id": "msg_fairgate_refusal",
                "status": "completed",
                "role": "assistant",
                "content": [{"type": "refusal", "refusal": message}],
            }]);
        }
        Endpoint::Messages => {
            body["content"] = json!([{"type": "text", "text": message}]);
            body["stop_reason"] = json!("refusal");
            body["stop_sequence"] = Value::Null;
            body["stop_details"] = refusal_details(message);
        }
    }
}

/// A JSON response with fairgate's headers.
pub fn json_response(
    status: StatusCode,
    body: &Value,
    request_id: &str,
    verdict: Option<&str>,
) -> Response<ProxyBody> {
    let mut response = Response::new(full(Bytes::from(body.to_string())));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    tag(&mut response, request_id, verdict);
    response
}

/// Adds `x-fairgate-request-id` and, when given, `x-fairgate-verdict`.
pub fn tag(response: &mut Response<ProxyBody>, request_id: &str, verdict: Option<&str>) {
    // Names made once: a name given as a string is parsed on every insert.
    const REQUEST_ID: HeaderName = HeaderName::from_static("x-fairgate-request-id");
    const VERDICT: HeaderName = HeaderName::from_static("x-fairgate-verdict");
    if let Ok(id) = HeaderValue::from_str(request_id) {
        response.headers_mut().insert(REQUEST_ID, id);
    }
    if let Some(verdict) = verdict.and_then(|v| HeaderValue::from_str(v).ok()) {
        response.headers_mut().insert(VERDICT, verdict);
    }
}

pub fn full(bytes: Bytes) -> ProxyBody {
    Full::new(bytes)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// A plain-text response (admin endpoints).
pub fn text(status: StatusCode, body: String) -> Response<ProxyBody> {
    let mut response = Response::new(full(Bytes::from(body)));
    *response.status_mut() = status;
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("text/plain; charset=utf-8"),
    );
    response
}

/// The `stop_details` of an Anthropic refusal, as the API gives its own:
/// no category of the API's applies, the rule's message explains it.
pub fn refusal_details(message: &str) -> Value {
    json!({"type": "refusal", "category": null, "explanation": message})
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_is_made_whatever_json_the_answer_was() {
        for endpoint in [
            Endpoint::ChatCompletions,
            Endpoint::Completions,
            Endpoint::Responses,
            Endpoint::Messages,
        ] {
            for body in ["[1]", "\"text\"", "7", "null", "{}"] {
                let refused: Value =
                    serde_json::from_slice(&refusal(endpoint, body.as_bytes(), "No.")).unwrap();
                assert!(refused.is_object(), "{endpoint:?} {body}");
            }
        }
        let refused = refusal(Endpoint::Responses, b"[]", "No.");
        let refused: Value = serde_json::from_slice(&refused).unwrap();
        assert_eq!(refused["incomplete_details"]["reason"], "content_filter");
        assert_eq!(refused["output"][0]["content"][0]["refusal"], "No.");
    }
}

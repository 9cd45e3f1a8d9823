//! A fast mock LLM upstream for `benches/proxy.sh`: answers
//! `POST /v1/chat/completions` with a fixed completion, or a fixed SSE stream
//! when the request asks for one, `POST /v1/messages` the same in
//! Anthropic's dialect, `POST /v1/responses` in the Responses API's (its
//! events numbered), and everything else with a small JSON (a chat
//! completion's).
//!
//! `cargo bench --bench mock_upstream -- 127.0.0.1:18101`
//!
//! With `MOCK_OBFUSCATION` set, each text chunk ends with an `obfuscation`
//! member of varying length, as OpenAI's chunks do by default: the bytes
//! around a chunk's text then differ from chunk to chunk.
//!
//! With `MOCK_ANSWER_REPEAT=N`, a stream's answer is its sentence N times
//! over (N × 25 text chunks, about N × 141 bytes of text): a long answer, in
//! which holdback reaches its steady state (a window of new text and the
//! hold before it, checked every 64 bytes).
//!
//! With `MOCK_STREAM_PAUSE_MS=N`, a stream's first half is sent at once and
//! the rest after N milliseconds, so that many streams can be held open at
//! the same moment (`benches/memory.sh`).
//!
//! With `MOCK_TOKEN_MS=N`, a stream's events are sent one by one, N
//! milliseconds apart, as a model writes them (`benches/first_text.sh`).
//!
//! With `MOCK_HEADERS` set, every answer carries the 20 headers OpenAI's
//! API adds to one (rate limits, request id, Cloudflare's, cookies), as a
//! proxy in front of it relays them.

use std::convert::Infallible;
use std::net::SocketAddr;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{StreamExt, stream};
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Either, Full, StreamBody};
use hyper::body::{Frame, Incoming};
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use tokio::net::TcpListener;

const COMPLETION: &str = r#"{"id":"chatcmpl-bench","object":"chat.completion","created":1,"model":"bench","choices":[{"index":0,"message":{"role":"assistant","content":"Start with a budget, build an emergency fund of three to six months of expenses, then invest regularly in broad index funds."},"finish_reason":"stop"}],"usage":{"prompt_tokens":20,"completion_tokens":25,"total_tokens":45}}"#;

const MESSAGE: &str = r#"{"id":"msg_bench","type":"message","role":"assistant","model":"bench","content":[{"type":"text","text":"Start with a budget, build an emergency fund of three to six months of expenses, then invest regularly in broad index funds."}],"stop_reason":"end_turn","stop_sequence":null,"usage":{"input_tokens":20,"output_tokens":25}}"#;

const RESPONSE: &str = r#"{"id":"resp_bench","object":"response","created_at":1,"status":"completed","model":"bench","output":[{"id":"msg_bench","type":"message","status":"completed","role":"assistant","content":[{"type":"output_text","text":"Start with a budget, build an emergency fund of three to six months of expenses, then invest regularly in broad index funds.","annotations":[]}]}],"usage":{"input_tokens":20,"output_tokens":25,"total_tokens":45}}"#;

const WORDS: &str = "Start with a budget, build an emergency fund of three to six months of expenses, then invest regularly in broad index funds over many years.";

/// The stream's words (with their spaces), `MOCK_ANSWER_REPEAT` times over.
fn answer_words() -> Vec<String> {
    let repeat = std::env::var("MOCK_ANSWER_REPEAT")
        .ok()
        .and_then(|n| n.parse().ok())
        .unwrap_or(1);
    let words = format!("{WORDS} ").repeat(repeat);
    words
        .trim_end()
        .split_inclusive(' ')
        .map(str::to_owned)
        .collect()
}

/// The stream of a message in Anthropic's dialect, a text delta a word.
fn messages_stream_body() -> String {
    let mut out = String::from(concat!(
        "event: message_start\ndata: {\"type\":\"message_start\",\"message\":{\"id\":\"msg_bench\",\"type\":\"message\",\"role\":\"assistant\",\"model\":\"bench\",\"content\":[],\"stop_reason\":null,\"stop_sequence\":null,\"usage\":{\"input_tokens\":20,\"output_tokens\":1}}}\n\n",
        "event: content_block_start\ndata: {\"type\":\"content_block_start\",\"index\":0,\"content_block\":{\"type\":\"text\",\"text\":\"\"}}\n\n",
        "event: ping\ndata: {\"type\": \"ping\"}\n\n",
    ));
    for word in answer_words() {
        out.push_str(&format!(
            "event: content_block_delta\ndata: {{\"type\":\"content_block_delta\",\"index\":0,\"delta\":{{\"type\":\"text_delta\",\"text\":{}}}}}\n\n",
            serde_json::to_string(&word).unwrap_or_default()
        ));
    }
    out.push_str(concat!(
        "event: content_block_stop\ndata: {\"type\":\"content_block_stop\",\"index\":0}\n\n",
        "event: message_delta\ndata: {\"type\":\"message_delta\",\"delta\":{\"stop_reason\":\"end_turn\",\"stop_sequence\":null},\"usage\":{\"output_tokens\":25}}\n\n",
        "event: message_stop\ndata: {\"type\":\"message_stop\"}\n\n",
    ));
    out
}

/// The stream of a response of the Responses API, a text delta a word,
/// every event numbered, as OpenAI sends one.
fn responses_stream_body() -> String {
    let words = answer_words();
    let text = serde_json::to_string(&words.concat()).unwrap_or_default();
    let at = r#""item_id":"msg_bench","output_index":0,"content_index":0"#;
    let response = |status: &str, output: &str| {
        format!(
            r#"{{"id":"resp_bench","object":"response","created_at":1,"status":"{status}","model":"bench","output":[{output}]}}"#
        )
    };
    let message = |status: &str, content: &str| {
        format!(
            r#"{{"id":"msg_bench","type":"message","status":"{status}","role":"assistant","content":[{content}]}}"#
        )
    };
    let part = format!(r#"{{"type":"output_text","text":{text},"annotations":[]}}"#);
    let mut events = vec![
        (
            "response.created",
            format!(r#""response":{}"#, response("in_progress", "")),
        ),
        (
            "response.in_progress",
            format!(r#""response":{}"#, response("in_progress", "")),
        ),
        (
            "response.output_item.added",
            format!(r#""output_index":0,"item":{}"#, message("in_progress", "")),
        ),
        (
            "response.content_part.added",
            format!(r#"{at},"part":{{"type":"output_text","text":"","annotations":[]}}"#),
        ),
    ];
    for word in &words {
        let delta = serde_json::to_string(word).unwrap_or_default();
        events.push((
            "response.output_text.delta",
            format!(r#"{at},"delta":{delta},"logprobs":[]"#),
        ));
    }
    events.extend([
        (
            "response.output_text.done",
            format!(r#"{at},"text":{text},"logprobs":[]"#),
        ),
        (
            "response.content_part.done",
            format!(r#"{at},"part":{part}"#),
        ),
        (
            "response.output_item.done",
            format!(r#""output_index":0,"item":{}"#, message("completed", &part)),
        ),
        (
            "response.completed",
            format!(
                r#""response":{}"#,
                response("completed", &message("completed", &part))
            ),
        ),
    ]);
    let mut out = String::new();
    for (number, (kind, members)) in events.iter().enumerate() {
        out.push_str(&format!(
            "event: {kind}\ndata: {{\"type\":\"{kind}\",\"sequence_number\":{number},{members}}}\n\n"
        ));
    }
    out
}

fn stream_body() -> String {
    let mut out = String::from(
        "data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{\"role\":\"assistant\",\"content\":\"\"},\"finish_reason\":null}]}\n\n",
    );
    let obfuscation = std::env::var_os("MOCK_OBFUSCATION").is_some();
    for (i, word) in answer_words().iter().enumerate() {
        let padding = if obfuscation {
            format!(r#","obfuscation":"{}""#, &"Xq7pZ2kLm9Rt4vBw"[i % 8..])
        } else {
            String::new()
        };
        out.push_str(&format!(
            "data: {{\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"bench\",\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{}}},\"finish_reason\":null}}]{padding}}}\n\n",
            serde_json::to_string(word).unwrap_or_default()
        ));
    }
    out.push_str("data: {\"id\":\"c\",\"object\":\"chat.completion.chunk\",\"created\":1,\"model\":\"bench\",\"choices\":[{\"index\":0,\"delta\":{},\"finish_reason\":\"stop\"}]}\n\ndata: [DONE]\n\n");
    out
}

/// A whole body in one frame, or a paused stream: the common case stays
/// unboxed, as it was before streams could pause.
type MockBody = Either<Full<Bytes>, UnsyncBoxBody<Bytes, Infallible>>;

/// `payload` in two frames, the second `pause` after the first.
fn paused(mut payload: Bytes, pause: Duration) -> MockBody {
    let rest = payload.split_off(payload.len() / 2);
    let first = stream::once(async move { Ok(Frame::data(payload)) });
    let second = stream::once(async move {
        tokio::time::sleep(pause).await;
        Ok(Frame::data(rest))
    });
    Either::Right(StreamBody::new(first.chain(second)).boxed_unsync())
}

/// `payload`'s events, one frame each, `every` apart.
fn paced(payload: Bytes, every: Duration) -> MockBody {
    let mut events = Vec::new();
    let mut rest = payload;
    while let Some(end) = rest.windows(2).position(|w| w == b"\n\n") {
        events.push(rest.split_to(end + 2));
    }
    let frames = stream::iter(events).then(move |event| async move {
        tokio::time::sleep(every).await;
        Ok(Frame::data(event))
    });
    Either::Right(StreamBody::new(frames).boxed_unsync())
}

/// How a stream is sent: at once, in two halves with a pause between, or
/// event by event.
#[derive(Clone, Copy)]
enum Pace {
    AtOnce,
    Paused(Duration),
    Tokens(Duration),
}

/// The headers of an answer of OpenAI's API, less those hyper writes
/// itself (`date`, `content-length` or `transfer-encoding`).
const OPENAI_HEADERS: [(&str, &str); 20] = [
    ("access-control-expose-headers", "X-Request-ID"),
    ("openai-organization", "user-bench0000000000000000"),
    ("openai-processing-ms", "412"),
    ("openai-project", "proj_bench000000000000000000"),
    ("openai-version", "2020-10-01"),
    ("x-envoy-upstream-service-time", "418"),
    ("x-ratelimit-limit-requests", "10000"),
    ("x-ratelimit-limit-tokens", "10000000"),
    ("x-ratelimit-remaining-requests", "9999"),
    ("x-ratelimit-remaining-tokens", "9999975"),
    ("x-ratelimit-reset-requests", "6ms"),
    ("x-ratelimit-reset-tokens", "0s"),
    ("x-request-id", "req_0123456789abcdef0123456789abcdef"),
    (
        "strict-transport-security",
        "max-age=31536000; includeSubDomains; preload",
    ),
    ("cf-cache-status", "DYNAMIC"),
    (
        "set-cookie",
        "__cf_bm=bench; path=/; expires=Thu, 26-Nov-26 01:00:00 GMT; domain=.api.openai.com; HttpOnly; Secure; SameSite=None",
    ),
    ("x-content-type-options", "nosniff"),
    ("server", "cloudflare"),
    ("cf-ray", "8e0123456789abcd-AMS"),
    ("alt-svc", "h3=\":443\"; ma=86400"),
];

/// The answers of each dialect: a stream and a whole body.
#[derive(Clone)]
struct Answers {
    chat_stream: Bytes,
    messages_stream: Bytes,
    responses_stream: Bytes,
}

async fn reply(
    req: Request<Incoming>,
    answers: Answers,
    pace: Pace,
    openai_headers: bool,
) -> Result<Response<MockBody>, Infallible> {
    let (stream, whole) = match req.uri().path() {
        path if path.ends_with("/v1/messages") => (answers.messages_stream, MESSAGE),
        path if path.ends_with("/v1/responses") => (answers.responses_stream, RESPONSE),
        _ => (answers.chat_stream, COMPLETION),
    };
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let streaming = body.windows(13).any(|w| w == b"\"stream\":true");
    let (content_type, payload) = if streaming {
        let payload = match pace {
            Pace::AtOnce => Either::Left(Full::new(stream)),
            Pace::Paused(pause) => paused(stream, pause),
            Pace::Tokens(every) => paced(stream, every),
        };
        ("text/event-stream", payload)
    } else {
        (
            "application/json",
            Either::Left(Full::new(Bytes::from_static(whole.as_bytes()))),
        )
    };
    let mut response = Response::new(payload);
    response.headers_mut().insert(
        "content-type",
        hyper::header::HeaderValue::from_static(content_type),
    );
    if openai_headers {
        for (name, value) in OPENAI_HEADERS {
            response
                .headers_mut()
                .append(name, hyper::header::HeaderValue::from_static(value));
        }
    }
    Ok(response)
}

fn main() -> std::io::Result<()> {
    let addr: SocketAddr = std::env::args()
        .skip(1)
        .find(|a| !a.starts_with("--"))
        .and_then(|a| a.parse().ok())
        .unwrap_or_else(|| SocketAddr::from(([127, 0, 0, 1], 18101)));
    let millis = |name| {
        std::env::var(name)
            .ok()
            .and_then(|ms| ms.parse().ok())
            .map(Duration::from_millis)
    };
    let pace = match (millis("MOCK_STREAM_PAUSE_MS"), millis("MOCK_TOKEN_MS")) {
        (Some(pause), _) => Pace::Paused(pause),
        (None, Some(every)) => Pace::Tokens(every),
        (None, None) => Pace::AtOnce,
    };
    let openai_headers = std::env::var_os("MOCK_HEADERS").is_some();
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    runtime.block_on(async move {
        let listener = TcpListener::bind(addr).await?;
        let answers = Answers {
            chat_stream: Bytes::from(stream_body()),
            messages_stream: Bytes::from(messages_stream_body()),
            responses_stream: Bytes::from(responses_stream_body()),
        };
        eprintln!("mock upstream on {addr}");
        loop {
            let (socket, _) = listener.accept().await?;
            let answers = answers.clone();
            tokio::spawn(async move {
                let service =
                    service_fn(move |req| reply(req, answers.clone(), pace, openai_headers));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(socket), service)
                    .await;
            });
        }
    })
}

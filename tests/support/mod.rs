//! Test support: a mock LLM upstream that speaks real HTTP and SSE, and a
//! fairgate proxy started on ephemeral ports in front of it.
//!
//! The mock answers in the dialect of the path it is called on. A request
//! header `x-mock-reply` (JSON) says what to answer:
//! `{"text": "...", "chunks": ["..", ".."], "status": 500, "delay_ms": 100,
//! "raw_sse": "...", "raw_json": "...", "raw_pieces": "..."}` (a `raw_json`
//! body goes out as written, with `content_type` and `content_encoding`
//! headers when the script gives them; `raw_sse` and `raw_pieces` go out
//! in pieces of 7 bytes, the latter with its `content_type`, and with
//! `"hold_open": true` the body then stays open, unended, with `"cut":
//! true` the connection is then cut, the body unended; `"headers":
//! [["name", "value"], ..]` are added to whatever it answers); without it
//! the mock echoes "Hello from the mock.". A `raw_sse` with `"whole":
//! true` goes out in one piece; a `starting_after=N` query leaves out its
//! events numbered up to N, as the Responses API resumes a stream.

#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::Path;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;

use fairgate::config::{Config, UpstreamConfig};
use fairgate::proxy::{self, State};
use http_body_util::{BodyExt, Full};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper::{Request, Response};
use hyper_util::rt::{TokioExecutor, TokioIo};
use serde_json::{Value, json};
use tokio::net::TcpListener;
use tokio::sync::oneshot;

/// What the mock received.
#[derive(Debug, Clone)]
pub struct Received {
    pub method: String,
    pub path: String,
    /// The query, without its `?` (empty when none).
    pub query: String,
    pub headers: Vec<(String, String)>,
    pub body: String,
}

impl Received {
    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(n, _)| n == name)
            .map(|(_, v)| v.as_str())
    }
}

pub struct Mock {
    pub addr: SocketAddr,
    pub received: Arc<Mutex<Vec<Received>>>,
}

impl Mock {
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    pub fn requests(&self) -> Vec<Received> {
        self.received.lock().unwrap().clone()
    }

    /// Checks that the last request the mock got has `body` as its body,
    /// sent whole (start and rest), with the length the client gave.
    pub fn assert_last_sent_whole(&self, body: &str) {
        let sent = self.requests().last().unwrap().clone();
        assert_eq!(sent.body, body, "sent whole, start and rest");
        let length = body.len().to_string();
        assert_eq!(sent.header("content-length"), Some(length.as_str()));
    }
}

/// A WebSocket client's connection to the proxy.
pub type WsClient =
    tokio_tungstenite::WebSocketStream<tokio_tungstenite::MaybeTlsStream<tokio::net::TcpStream>>;

/// Listens on an ephemeral port of 127.0.0.1 and serves each connection
/// with `serve`, on a task of its own: a mock upstream of a protocol of its
/// own (WebSockets). The listener's address.
pub async fn serve_each<F, Fut>(serve: F) -> SocketAddr
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + 'static,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move {
        while let Ok((stream, _)) = listener.accept().await {
            tokio::spawn(serve(stream));
        }
    });
    addr
}

pub async fn start_mock() -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let received = Arc::new(Mutex::new(Vec::new()));
    let log = received.clone();
    tokio::spawn(async move {
        loop {
            let Ok((stream, _)) = listener.accept().await else {
                return;
            };
            let log = log.clone();
            tokio::spawn(async move {
                let service = service_fn(move |req| mock_reply(log.clone(), req));
                let _ = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new())
                    .serve_connection(TokioIo::new(stream), service)
                    .await;
            });
        }
    });
    Mock { addr, received }
}

type MockBody = http_body_util::combinators::BoxBody<Bytes, std::io::Error>;

/// The scripted answer, with the script's `headers` added.
async fn mock_reply(
    log: Arc<Mutex<Vec<Received>>>,
    req: Request<Incoming>,
) -> Result<Response<MockBody>, Infallible> {
    let added: Vec<(String, String)> = req
        .headers()
        .get("x-mock-reply")
        .and_then(|script| serde_json::from_slice::<Value>(script.as_bytes()).ok())
        .and_then(|script| serde_json::from_value(script.get("headers")?.clone()).ok())
        .unwrap_or_default();
    let mut reply = scripted_reply(log, req).await?;
    for (name, value) in added {
        let name = hyper::header::HeaderName::from_bytes(name.as_bytes()).unwrap();
        let value = hyper::header::HeaderValue::from_str(&value).unwrap();
        reply.headers_mut().append(name, value);
    }
    Ok(reply)
}

async fn scripted_reply(
    log: Arc<Mutex<Vec<Received>>>,
    req: Request<Incoming>,
) -> Result<Response<MockBody>, Infallible> {
    let method = req.method().to_string();
    let path = req.uri().path().to_owned();
    let query = req.uri().query().unwrap_or_default().to_owned();
    let headers: Vec<(String, String)> = req
        .headers()
        .iter()
        .map(|(n, v)| (n.to_string(), v.to_str().unwrap_or("").to_owned()))
        .collect();
    // Read as bytes: a script may carry any text (the proxy passes a
    // header's bytes on as they are).
    let script: Value = req
        .headers()
        .get("x-mock-reply")
        .and_then(|v| serde_json::from_slice(v.as_bytes()).ok())
        .unwrap_or(json!({}));
    let body = req
        .into_body()
        .collect()
        .await
        .map(|b| b.to_bytes())
        .unwrap_or_default();
    let body = String::from_utf8_lossy(&body).into_owned();
    log.lock().unwrap().push(Received {
        method: method.clone(),
        path: path.clone(),
        query: query.clone(),
        headers,
        body: body.clone(),
    });
    if let Some(ms) = script.get("delay_ms").and_then(Value::as_u64) {
        tokio::time::sleep(Duration::from_millis(ms)).await;
    }
    if let Some(status) = script.get("status").and_then(Value::as_u64) {
        return Ok(json_reply(
            status as u16,
            &json!({"error": {"message": "mock failure", "type": "server_error"}}),
        ));
    }
    if let Some(size) = script.get("bulk_mib").and_then(Value::as_u64) {
        // A large body, as fast as the connection takes it.
        let mib = Bytes::from(vec![b'a'; 1 << 20]);
        let pieces =
            std::iter::repeat_n(mib, size as usize).map(|mib| Ok(hyper::body::Frame::data(mib)));
        let body = http_body_util::StreamBody::new(futures_util::stream::iter(pieces));
        let reply = Response::builder().header("content-type", "application/octet-stream");
        return Ok(reply.body(body.boxed()).unwrap());
    }
    let raw = ["raw_json", "raw_sse", "raw_pieces"]
        .iter()
        .any(|key| script.get(key).is_some());
    if method == "GET" && !raw {
        return Ok(json_reply(
            200,
            &json!({"object": "list", "data": [{"id": "mock-model"}]}),
        ));
    }
    let request: Value = serde_json::from_str(&body).unwrap_or(json!({}));
    let text = script
        .get("text")
        .and_then(Value::as_str)
        .unwrap_or("Hello from the mock.")
        .to_owned();
    let chunks: Vec<String> = match script.get("chunks").and_then(Value::as_array) {
        Some(chunks) => chunks
            .iter()
            .map(|c| c.as_str().unwrap_or("").to_owned())
            .collect(),
        None => vec![text.clone()],
    };
    let stream = request.get("stream").and_then(Value::as_bool) == Some(true);
    let pause = script
        .get("piece_delay_ms")
        .and_then(Value::as_u64)
        .unwrap_or(0);
    if let Some(raw) = script.get("raw_json").and_then(Value::as_str) {
        let field = |name| script.get(name).and_then(Value::as_str);
        let mut reply = Response::builder().header(
            "content-type",
            field("content_type").unwrap_or("application/json"),
        );
        if let Some(encoding) = field("content_encoding") {
            reply = reply.header("content-encoding", encoding);
        }
        return Ok(reply.body(full(raw.to_owned())).unwrap());
    }
    if let Some(raw) = script.get("raw_sse").and_then(Value::as_str) {
        let flag = |name: &str| script.get(name) == Some(&json!(true));
        // A stream resumed, as the Responses API resumes one: the events
        // after the one numbered so.
        let after = query.split('&').find_map(|pair| {
            let number = pair.strip_prefix("starting_after=")?;
            number.parse::<u64>().ok()
        });
        let raw = match after {
            Some(after) => numbered_after(raw, after),
            None => raw.to_owned(),
        };
        let raw = raw.as_str();
        if flag("whole") {
            let reply = Response::builder().header("content-type", "text/event-stream");
            return Ok(reply.body(full(raw.to_owned())).unwrap());
        }
        let cut = flag("cut");
        if cut || flag("hold_open") {
            use futures_util::StreamExt;
            use futures_util::future::Either;
            let pieces = pieces_reply(raw.to_owned(), pause, "text/event-stream");
            let (head, body) = pieces.into_parts();
            let end = match cut {
                // An error ends hyper's connection without the body's end;
                // what it has buffered might go with it: the pieces are
                // given time to leave first.
                true => Either::Left(futures_util::stream::once(async {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    Err(std::io::Error::other("cut"))
                })),
                false => Either::Right(futures_util::stream::pending()),
            };
            let body = body
                .into_data_stream()
                .map(|d| d.map(hyper::body::Frame::data));
            let body = BodyExt::boxed(http_body_util::StreamBody::new(body.chain(end)));
            return Ok(Response::from_parts(head, body));
        }
        return Ok(sse_reply(raw.to_owned(), pause));
    }
    if let Some(raw) = script.get("raw_pieces").and_then(Value::as_str) {
        let content_type = script.get("content_type").and_then(Value::as_str);
        let content_type = content_type.unwrap_or("application/octet-stream");
        return Ok(pieces_reply(raw.to_owned(), pause, content_type));
    }
    if path == "/v1/responses" {
        return Ok(match stream {
            true => sse_reply(responses_stream(&chunks), pause),
            false => json_reply(200, &responses_body(&text, "completed")),
        });
    }
    let anthropic = path.starts_with("/v1/messages");
    Ok(match (anthropic, stream) {
        (false, false) => json_reply(
            200,
            &json!({
                "id": "chatcmpl-mock", "object": "chat.completion", "created": 1, "model": "mock-model",
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}
            }),
        ),
        (true, false) => json_reply(
            200,
            &json!({
                "id": "msg_mock", "type": "message", "role": "assistant", "model": "mock-model",
                "content": [{"type": "text", "text": text}],
                "stop_reason": "end_turn", "stop_sequence": null,
                "usage": {"input_tokens": 5, "output_tokens": 7}
            }),
        ),
        (false, true) => {
            let padded = script.get("obfuscation") == Some(&json!(true));
            let mut body = openai_stream(&chunks, padded);
            if request.pointer("/stream_options/include_usage") == Some(&json!(true)) {
                // The usage chunk comes last, before [DONE].
                let usage = json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": "mock-model",
                                   "choices": [], "usage": {"prompt_tokens": 5, "completion_tokens": 7, "total_tokens": 12}});
                body = body.replace(
                    "data: [DONE]\n\n",
                    &format!("data: {usage}\n\ndata: [DONE]\n\n"),
                );
            }
            sse_reply(body, pause)
        }
        (true, true) => sse_reply(anthropic_stream(&chunks), pause),
    })
}

/// An OpenAI stream of `chunks`; `padded`, each chunk with an
/// `obfuscation` string of another length, as OpenAI's are by default.
pub fn openai_stream(chunks: &[String], padded: bool) -> String {
    let frame = |delta: Value, finish: Value| {
        json!({"id": "chatcmpl-mock", "object": "chat.completion.chunk", "created": 1, "model": "mock-model",
               "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]})
    };
    let data = |chunk: Value| format!("data: {chunk}\n\n");
    let mut out = data(frame(
        json!({"role": "assistant", "content": ""}),
        Value::Null,
    ));
    for (i, chunk) in chunks.iter().enumerate() {
        let mut chunk = frame(json!({"content": chunk}), Value::Null);
        if padded {
            chunk["obfuscation"] = json!("x".repeat(1 + i % 7));
        }
        out.push_str(&data(chunk));
    }
    out.push_str(&data(frame(json!({}), json!("stop"))));
    out.push_str("data: [DONE]\n\n");
    out
}

/// A Messages API stream of `chunks`, its events written byte for byte as
/// the API writes them (members in the API's order, no spaces but in
/// `ping`), so that the guard takes the forms it knows by their bytes.
pub fn anthropic_stream(chunks: &[String]) -> String {
    let event = |name: &str, data: &str| format!("event: {name}\ndata: {data}\n\n");
    let mut out = event(
        "message_start",
        r#"{"type":"message_start","message":{"id":"msg_mock","type":"message","role":"assistant","model":"mock-model","content":[],"stop_reason":null,"stop_sequence":null,"usage":{"input_tokens":5,"output_tokens":1}}}"#,
    );
    out.push_str(&event(
        "content_block_start",
        r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
    ));
    out.push_str(&event("ping", r#"{"type": "ping"}"#));
    for chunk in chunks {
        let text = Value::from(chunk.as_str());
        out.push_str(&event(
            "content_block_delta",
            &format!(
                r#"{{"type":"content_block_delta","index":0,"delta":{{"type":"text_delta","text":{text}}}}}"#
            ),
        ));
    }
    out.push_str(&event(
        "content_block_stop",
        r#"{"type":"content_block_stop","index":0}"#,
    ));
    out.push_str(&event(
        "message_delta",
        r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":7}}"#,
    ));
    out.push_str(&event("message_stop", r#"{"type":"message_stop"}"#));
    out
}

/// A Responses API response whose one message says `text`.
pub fn responses_body(text: &str, status: &str) -> Value {
    let usage = match status {
        "completed" => json!({"input_tokens": 5, "output_tokens": 7, "total_tokens": 12}),
        _ => Value::Null,
    };
    let output = match text {
        "" => json!([]),
        _ => json!([responses_message(text, status)]),
    };
    json!({"id": "resp_mock", "object": "response", "created_at": 1, "status": status,
           "model": "mock-model", "output": output, "usage": usage})
}

fn responses_message(text: &str, status: &str) -> Value {
    json!({"id": "msg_mock", "type": "message", "status": status, "role": "assistant",
           "content": [{"type": "output_text", "text": text, "annotations": []}]})
}

/// A Responses API stream of `chunks`, every event numbered, as OpenAI
/// sends one.
pub fn responses_stream(chunks: &[String]) -> String {
    let text = chunks.concat();
    let part = |text: &str| json!({"type": "output_text", "text": text, "annotations": []});
    let at = json!({"item_id": "msg_mock", "output_index": 0, "content_index": 0});
    let with_at = |extra: Value| merged(&at, extra);
    let mut events = vec![
        (
            "response.created",
            json!({"response": responses_body("", "in_progress")}),
        ),
        (
            "response.in_progress",
            json!({"response": responses_body("", "in_progress")}),
        ),
        (
            "response.output_item.added",
            json!({"output_index": 0, "item": {"id": "msg_mock", "type": "message",
            "status": "in_progress", "role": "assistant", "content": []}}),
        ),
        (
            "response.content_part.added",
            with_at(json!({"part": part("")})),
        ),
    ];
    for chunk in chunks {
        events.push((
            "response.output_text.delta",
            with_at(json!({"delta": chunk, "logprobs": []})),
        ));
    }
    events.extend([
        (
            "response.output_text.done",
            with_at(json!({"text": text, "logprobs": []})),
        ),
        (
            "response.content_part.done",
            with_at(json!({"part": part(&text)})),
        ),
        (
            "response.output_item.done",
            json!({"output_index": 0, "item": responses_message(&text, "completed")}),
        ),
        (
            "response.completed",
            json!({"response": responses_body(&text, "completed")}),
        ),
    ]);
    numbered_stream(events)
}

/// A second place of a Responses API stream's text, after the first
/// part of its first item: a second part of the item, and a second item.
pub const SECOND_PLACES: [(&str, u64, u64); 2] = [("msg_1", 0, 1), ("msg_2", 1, 0)];

/// A Responses API stream that goes back to a part it had left: blocked
/// advice in the first part of its first item, with text of `second`
/// (item id, output index, content index) between its two pieces, which
/// the SDKs would gather apart.
pub fn interleaved_stream((item, output, content): (&str, u64, u64)) -> String {
    let first = json!({"item_id": "msg_1", "output_index": 0, "content_index": 0});
    let second = json!({"item_id": item, "output_index": output, "content_index": content});
    let mut raw = vec![(
        "response.created",
        json!({"response": {"id": "resp_mock", "status": "in_progress", "output": []}}),
    )];
    for place in [&first, &second] {
        let item = json!({"id": place["item_id"], "type": "message", "content": []});
        let index = &place["output_index"];
        raw.push((
            "response.output_item.added",
            json!({"output_index": index, "item": item}),
        ));
        raw.push((
            "response.content_part.added",
            merged(place, json!({"part": {"type": "output_text", "text": ""}})),
        ));
    }
    for (place, text) in [
        (&first, "Put all your "),
        (&second, "Budget first. "),
        (&first, "savings into Dogecoin right now."),
    ] {
        raw.push((
            "response.output_text.delta",
            merged(place, json!({"delta": text})),
        ));
    }
    raw.push((
        "response.completed",
        json!({"response": {"id": "resp_mock", "status": "completed"}}),
    ));
    numbered_stream(raw)
}

/// The members of `base` and `extra` (both objects) in one object, those
/// of `extra` where both have a key: an event at a part's place.
pub fn merged(base: &Value, extra: Value) -> Value {
    let mut out = base.clone();
    if let (Some(out), Value::Object(extra)) = (out.as_object_mut(), extra) {
        out.extend(extra);
    }
    out
}

/// A Responses API stream of these events (names and data), each given
/// its `type` and a `sequence_number` from 0, as raw SSE.
pub fn numbered_stream(events: Vec<(&str, Value)>) -> String {
    let mut out = String::new();
    for (number, (name, mut data)) in events.into_iter().enumerate() {
        data["type"] = json!(name);
        data["sequence_number"] = json!(number);
        out += &format!("event: {name}\ndata: {data}\n\n");
    }
    out
}

fn full(body: String) -> MockBody {
    Full::new(Bytes::from(body))
        .map_err(|never| match never {})
        .boxed()
}

fn json_reply(status: u16, body: &Value) -> Response<MockBody> {
    Response::builder()
        .status(status)
        .header("content-type", "application/json")
        .body(full(body.to_string()))
        .unwrap()
}

/// An SSE body sent in small pieces, `pause_ms` apart, as a real upstream
/// sends it.
fn sse_reply(body: String, pause_ms: u64) -> Response<MockBody> {
    pieces_reply(body, pause_ms, "text/event-stream")
}

/// The events of SSE `body` numbered after `after` (and those with no
/// `sequence_number`).
fn numbered_after(body: &str, after: u64) -> String {
    body.split_inclusive("\n\n")
        .filter(|event| {
            let data = event.lines().find_map(|l| l.strip_prefix("data: "));
            let data: Value = data
                .and_then(|d| serde_json::from_str(d).ok())
                .unwrap_or_default();
            data["sequence_number"].as_u64().is_none_or(|n| n > after)
        })
        .collect()
}

/// `body` in pieces of 7 bytes, `pause_ms` apart.
fn pieces_reply(body: String, pause_ms: u64, content_type: &str) -> Response<MockBody> {
    let pieces: Vec<Bytes> = body
        .as_bytes()
        .chunks(7)
        .map(Bytes::copy_from_slice)
        .collect();
    let stream = futures_util::stream::unfold(pieces.into_iter(), move |mut pieces| async move {
        let piece = pieces.next()?;
        if pause_ms > 0 {
            tokio::time::sleep(Duration::from_millis(pause_ms)).await;
        }
        Some((Ok(hyper::body::Frame::data(piece)), pieces))
    });
    Response::builder()
        .status(200)
        .header("content-type", content_type)
        .body(http_body_util::StreamBody::new(stream).boxed())
        .unwrap()
}

/// The result row of the record `id` among `rows` (see
/// [`Proxy::wait_for_results`]); fails the test, listing them, when there
/// is none.
pub fn row_of<'a>(rows: &'a [Value], id: &str) -> &'a Value {
    let row = rows.iter().find(|row| row["request_id"] == id);
    row.unwrap_or_else(|| panic!("a record of {id}: {rows:#?}"))
}

/// The value of one series of a Prometheus page, named exactly as it is
/// printed (name and labels); `None` when the page does not have it.
pub fn metric(page: &str, series: &str) -> Option<f64> {
    page.lines()
        .filter(|l| !l.starts_with('#'))
        .find_map(|l| l.rsplit_once(' ').filter(|(name, _)| *name == series))
        .and_then(|(_, value)| value.parse().ok())
}

/// A rule pack with one blocking keyword, for reload tests.
pub fn keyword_pack(word: &str) -> String {
    format!(
        "pack: custom
description: test pack
rules:
  - id: custom.word
    category: test
    scopes: [prompt]
    keywords: [{word}]
    weight: 0.9
    action: block
    message: That word is not allowed.
    examples:
      block: [say {word} now]
      allow: [say nothing]
"
    )
}

/// A running proxy.
pub struct Proxy {
    pub addr: SocketAddr,
    pub admin: SocketAddr,
    pub state: Arc<State>,
    shutdown: Option<oneshot::Sender<()>>,
    pub task: Option<tokio::task::JoinHandle<anyhow::Result<()>>>,
    pub pipeline: Option<fairgate::queue::pipeline::Pipeline>,
}

impl Proxy {
    pub fn url(&self, path: &str) -> String {
        format!("http://{}{path}", self.addr)
    }

    pub fn admin_url(&self, path: &str) -> String {
        format!("http://{}{path}", self.admin)
    }

    /// A page of the admin listener, as text.
    async fn admin_page(&self, path: &str) -> String {
        client()
            .get(self.admin_url(path))
            .send()
            .await
            .expect("the admin listener answers")
            .text()
            .await
            .expect("a text page")
    }

    /// The Prometheus page of the admin listener.
    pub async fn metrics(&self) -> String {
        self.admin_page("/metrics").await
    }

    /// Asserts that the client's own failures were answered `n` times
    /// with the error `code`, and that none was counted as the upstream's
    /// (`fairgate_upstream_errors_total` has no series).
    pub async fn assert_client_failures(&self, code: &str, n: f64) {
        let metrics = self.metrics().await;
        let upstream = "fairgate_upstream_errors_total{";
        assert!(!metrics.contains(upstream), "{metrics}");
        let series = format!("fairgate_error_answers_total{{code=\"{code}\"}}");
        assert_eq!(metric(&metrics, &series), Some(n), "{metrics}");
    }

    /// Asserts that `n` blocks of `scope` were counted on `route` (in
    /// `fairgate_blocks_total`, for a model not listed as a label).
    pub async fn assert_blocks(&self, route: &str, scope: &str, n: f64) {
        let metrics = self.metrics().await;
        let series =
            format!(r#"fairgate_blocks_total{{model="other",route="{route}",scope="{scope}"}}"#);
        assert_eq!(metric(&metrics, &series), Some(n), "{metrics}");
    }

    /// The admin dashboard's summary (`/admin/summary`).
    pub async fn summary(&self) -> Value {
        serde_json::from_str(&self.admin_page("/admin/summary").await).expect("a JSON summary")
    }

    /// The dashboard's latest blocked exchanges, newest first.
    pub async fn recent_blocks(&self) -> Vec<Value> {
        let summary = self.summary().await;
        summary["recent_blocks"]
            .as_array()
            .cloned()
            .unwrap_or_default()
    }

    /// POSTs `body` to `path`; the mock answers as `script` says (see the
    /// module documentation).
    pub async fn post(&self, path: &str, script: Value, body: &Value) -> reqwest::Response {
        client()
            .post(self.url(path))
            .header("x-mock-reply", script.to_string())
            .json(body)
            .send()
            .await
            .expect("the proxy answers")
    }

    /// GETs `path`; the mock answers as `script` says.
    pub async fn get(&self, path: &str, script: Value) -> reqwest::Response {
        client()
            .get(self.url(path))
            .header("x-mock-reply", script.to_string())
            .send()
            .await
            .expect("the proxy answers")
    }

    /// POSTs `body` as written (key order, spacing and all) as JSON to
    /// `path`; the mock answers its default.
    pub async fn post_text(&self, path: &str, body: impl Into<reqwest::Body>) -> reqwest::Response {
        self.post_as(path, "application/json", body.into()).await
    }

    /// POSTs `form` to `path` as a form whose boundary is `XyZ`.
    pub async fn post_form(&self, path: &str, form: String) -> reqwest::Response {
        let form_type = "multipart/form-data; boundary=XyZ";
        self.post_as(path, form_type, form.into()).await
    }

    /// POSTs `body` to `path` as of `content_type`.
    async fn post_as(
        &self,
        path: &str,
        content_type: &str,
        body: reqwest::Body,
    ) -> reqwest::Response {
        client()
            .post(self.url(path))
            .header("content-type", content_type)
            .body(body)
            .send()
            .await
            .expect("the proxy answers")
    }

    /// Sends `n` allowed chat completions (`"{tag} question {i}"`); returns
    /// their request ids.
    pub async fn send_questions(&self, n: usize, tag: &str) -> Vec<String> {
        let mut ids = Vec::new();
        for i in 0..n {
            let body = json!({"model": "gpt-4o-mini", "messages": [
                {"role": "user", "content": format!("{tag} question {i}")}
            ]});
            let response = self.post("/v1/chat/completions", json!({}), &body).await;
            assert_eq!(response.status(), 200);
            ids.push(request_id(&response));
        }
        ids
    }

    /// Starts the side queue's consumer of a proxy started without one.
    pub fn start_pipeline(&mut self) {
        self.pipeline = Some(self.state.start_pipeline().expect("the side queue starts"));
    }

    /// Stops the side queue's consumer: it drains and spills what is left.
    pub async fn stop_pipeline(&mut self) {
        if let Some(pipeline) = self.pipeline.take() {
            tokio::task::spawn_blocking(move || pipeline.stop())
                .await
                .unwrap();
        }
    }

    /// The results the JSON-lines sink has written so far, one value per
    /// line.
    pub fn results(&self) -> Vec<Value> {
        self.result_lines()
            .iter()
            .map(|line| serde_json::from_slice::<Value>(line).expect("a JSON line"))
            .collect()
    }

    /// The lines the JSON-lines sink has written so far, as written
    /// (without their newlines). A line still being written (no newline
    /// yet: a write of the sink's buffer may be under way) is left out.
    pub fn result_lines(&self) -> Vec<Vec<u8>> {
        let Some(jsonl) = &self.state.config.sinks.jsonl else {
            return Vec::new();
        };
        let Ok(entries) = std::fs::read_dir(&jsonl.dir) else {
            return Vec::new();
        };
        let mut lines = Vec::new();
        for entry in entries.flatten() {
            let mut text = std::fs::read(entry.path()).unwrap_or_default();
            let written = text.iter().rposition(|&b| b == b'\n').map_or(0, |i| i + 1);
            text.truncate(written);
            lines.extend(
                text.split(|&b| b == b'\n')
                    .filter(|line| !line.is_empty())
                    .map(<[u8]>::to_vec),
            );
        }
        lines
    }

    /// Waits until the JSON-lines sink holds `n` results (or 20 s pass).
    pub async fn wait_for_results(&self, n: usize) -> Vec<Value> {
        for _ in 0..200 {
            let rows = self.results();
            if rows.len() >= n {
                return rows;
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
        self.results()
    }

    /// Tells the proxy to stop accepting and drain, without waiting.
    pub fn begin_shutdown(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
    }

    /// Stops accepting and waits for the proxy to drain.
    pub async fn stop(mut self) {
        self.begin_shutdown();
        if let Some(task) = self.task.take() {
            let _ = tokio::time::timeout(Duration::from_secs(10), task).await;
        }
        self.stop_pipeline().await;
    }
}

/// A configuration with both upstreams on `upstream` and the given rules.
pub fn config(upstream: &str, rules: &Path) -> Config {
    let mut config = Config::default();
    config
        .upstreams
        .insert("openai".into(), UpstreamConfig::new(upstream));
    config
        .upstreams
        .insert("anthropic".into(), UpstreamConfig::new(upstream));
    config.rules.dir = rules.to_owned();
    config.rules.watch = false;
    config.shutdown_grace_ms = 5_000;
    // Results and spills in a directory of this test's own, kept to be
    // looked at after a failure (a test may also start a second proxy on
    // them): under Cargo's scratch directory for integration tests
    // (target/tmp), which `cargo clean` empties, rather than in /tmp.
    let data = tempfile::Builder::new()
        .prefix("fairgate-test-")
        .tempdir_in(env!("CARGO_TARGET_TMPDIR"))
        .unwrap()
        .keep();
    config.queue.spill_dir = data.join("spill");
    config.sinks.jsonl = Some(fairgate::config::JsonlSinkConfig {
        dir: data.join("results"),
    });
    config.quality.lexicon =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/emotions.json");
    config
}

pub async fn start_proxy(config: Config) -> Proxy {
    start_proxy_state(State::new(config).expect("proxy state")).await
}

pub async fn start_proxy_state(state: State) -> Proxy {
    let mut proxy = start_proxy_state_without_pipeline(state).await;
    proxy.start_pipeline();
    proxy
}

/// A proxy whose side queue has no consumer yet: records wait in the queue
/// and then spill (see [`Proxy::start_pipeline`]).
pub async fn start_proxy_state_without_pipeline(state: State) -> Proxy {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let admin = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let admin_addr = admin.local_addr().unwrap();
    let state = Arc::new(state);
    let (tx, rx) = oneshot::channel::<()>();
    let task = tokio::spawn(proxy::run(
        state.clone(),
        listener,
        Some(admin),
        async move {
            let _ = rx.await;
        },
    ));
    Proxy {
        addr,
        admin: admin_addr,
        state,
        shutdown: Some(tx),
        task: Some(task),
        pipeline: None,
    }
}

/// The `x-fairgate-request-id` of a response of the proxy.
/// Asserts that `response` refuses a request with the 400 of a blocked
/// prompt, its message naming `place` (`items`, `session`).
pub async fn assert_refused_at(response: reqwest::Response, place: &str) {
    assert_eq!(response.status(), 400, "{place}");
    assert_eq!(response.headers()["x-should-retry"], "false");
    let answer: Value = response.json().await.unwrap();
    assert_eq!(answer["error"]["code"], "content_filter", "{answer}");
    let message = answer["error"]["message"].as_str().unwrap();
    assert!(message.starts_with(&format!("{place}: ")), "{message}");
}

pub fn request_id(response: &reqwest::Response) -> String {
    response.headers()["x-fairgate-request-id"]
        .to_str()
        .expect("a request id")
        .to_owned()
}

/// Proxy in front of a fresh mock, with the shipped rules, holding
/// bodies of at most `limit` bytes (`guard.max_body_bytes`).
pub async fn start_holding(limit: usize) -> (Mock, Proxy) {
    let mock = start_mock().await;
    let mut config = config(&mock.url(), Path::new("rules"));
    config.guard.max_body_bytes = limit;
    let proxy = start_proxy(config).await;
    (mock, proxy)
}

/// Proxy in front of a fresh mock, with the shipped rules.
pub async fn start() -> (Mock, Proxy) {
    start_with(|_| ()).await
}

/// A proxy in front of two mocks: requests whose path starts with
/// `path_prefix` for a model whose name starts with `model_prefix` go to
/// the first, the others to the second.
pub async fn start_with_model_route(path_prefix: &str, model_prefix: &str) -> (Mock, Mock, Proxy) {
    let other = start_mock().await;
    let other_url = other.url();
    let (mock, proxy) = start_with(move |c| {
        c.upstreams
            .insert("local".into(), UpstreamConfig::new(&other_url));
        let route = fairgate::config::RouteConfig {
            model_prefix: Some(model_prefix.into()),
            ..fairgate::config::RouteConfig::new(path_prefix, "local")
        };
        c.routes.insert(0, route);
    })
    .await;
    (other, mock, proxy)
}

/// The same, with the configuration changed by `configure` first.
pub async fn start_with(configure: impl FnOnce(&mut Config)) -> (Mock, Proxy) {
    let mock = start_mock().await;
    let proxy = start_proxy_with(&mock.url(), configure).await;
    (mock, proxy)
}

/// A proxy with the shipped rules in front of `upstream` (a base URL), its
/// configuration changed by `configure`.
pub async fn start_proxy_with(upstream: &str, configure: impl FnOnce(&mut Config)) -> Proxy {
    let mut config = config(upstream, Path::new("rules"));
    configure(&mut config);
    start_proxy(config).await
}

/// Proxy in front of a fresh mock, with the shipped rules, whose admin
/// listener requires `token` (what `admin.token_env` would have read from
/// the environment).
pub async fn start_with_admin_token(token: &str) -> (Mock, Proxy) {
    let mock = start_mock().await;
    let mut state = State::new(config(&mock.url(), Path::new("rules"))).expect("proxy state");
    state.admin_token = Some(token.to_owned());
    let proxy = start_proxy_state(state).await;
    (mock, proxy)
}

/// Everything a stalled connection gets before the proxy closes it (or
/// until `limit`, which fails the test: the connection was left open).
pub async fn until_closed(stream: &mut tokio::net::TcpStream, limit: Duration) -> String {
    use tokio::io::AsyncReadExt;
    let mut got = Vec::new();
    let read = tokio::time::timeout(limit, stream.read_to_end(&mut got)).await;
    assert!(read.is_ok(), "the proxy left a stalled connection open");
    String::from_utf8_lossy(&got).into_owned()
}

/// The head of a `POST` to `path` with a body of `content_type` and
/// `length` bytes, as a client writes it on the wire.
pub fn post_head(path: &str, content_type: &str, length: usize) -> String {
    format!(
        "POST {path} HTTP/1.1\r\nhost: fairgate\r\ncontent-type: {content_type}\r\ncontent-length: {length}\r\n\r\n"
    )
}

/// Posts `body` to the proxy at `addr` as a client that stops sending
/// after half of it: what the proxy sends before it closes the connection.
pub async fn stalled_post(addr: SocketAddr, path: &str, content_type: &str, body: &[u8]) -> String {
    use tokio::io::AsyncWriteExt;
    let mut stream = tokio::net::TcpStream::connect(addr).await.unwrap();
    let head = post_head(path, content_type, body.len());
    stream.write_all(head.as_bytes()).await.unwrap();
    stream.write_all(&body[..body.len() / 2]).await.unwrap();
    until_closed(&mut stream, Duration::from_secs(10)).await
}

pub fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(30))
        .build()
        .unwrap()
}

/// The text a client gets from an OpenAI chat stream, and the finish reasons.
pub fn openai_stream_text(body: &str) -> (String, Vec<String>, bool) {
    let mut text = String::new();
    let mut finishes = Vec::new();
    let mut done = false;
    for event in body.split("\n\n") {
        let Some(data) = event.strip_prefix("data: ") else {
            continue;
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        let v: Value = serde_json::from_str(data).expect("every data line is JSON");
        if let Some(t) = v
            .pointer("/choices/0/delta/content")
            .and_then(Value::as_str)
        {
            text.push_str(t);
        }
        if let Some(f) = v
            .pointer("/choices/0/finish_reason")
            .and_then(Value::as_str)
        {
            finishes.push(f.to_owned());
        }
    }
    (text, finishes, done)
}

/// The text, the stop reason and the event names of an Anthropic stream.
pub fn anthropic_stream_text(body: &str) -> (String, Option<String>, Vec<String>) {
    let mut text = String::new();
    let mut stop = None;
    let mut names = Vec::new();
    for event in body.split("\n\n").filter(|e| !e.trim().is_empty()) {
        let mut lines = event.lines();
        let name = lines
            .next()
            .and_then(|l| l.strip_prefix("event: "))
            .expect("event line")
            .to_owned();
        let data: Value = serde_json::from_str(
            lines
                .next()
                .and_then(|l| l.strip_prefix("data: "))
                .expect("data line"),
        )
        .expect("JSON data");
        if let Some(t) = data.pointer("/delta/text").and_then(Value::as_str) {
            text.push_str(t);
        }
        if let Some(s) = data.pointer("/delta/stop_reason").and_then(Value::as_str) {
            stop = Some(s.to_owned());
        }
        names.push(name);
    }
    (text, stop, names)
}

/// A port that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

/// A unique name for this test's databases, streams and subjects.
pub fn unique(prefix: &str) -> String {
    use std::sync::atomic::{AtomicU32, Ordering};
    static N: AtomicU32 = AtomicU32::new(0);
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos();
    format!(
        "{prefix}_{}_{}_{nanos}",
        std::process::id(),
        N.fetch_add(1, Ordering::Relaxed)
    )
}

/// A fresh PostgreSQL database on the local server (127.0.0.1:5432, user
/// postgres); returns its connection string.
pub async fn fresh_database() -> String {
    let (admin, connection) = tokio_postgres::connect(
        "host=127.0.0.1 user=postgres dbname=postgres",
        tokio_postgres::NoTls,
    )
    .await
    .expect("PostgreSQL on 127.0.0.1:5432");
    tokio::spawn(connection);
    let name = unique("fairgate_test");
    admin
        .batch_execute(&format!("CREATE DATABASE {name}"))
        .await
        .unwrap();
    format!("host=127.0.0.1 user=postgres dbname={name}")
}

/// A client of the database at `url`.
pub async fn pg(url: &str) -> tokio_postgres::Client {
    let (client, connection) = tokio_postgres::connect(url, tokio_postgres::NoTls)
        .await
        .unwrap();
    tokio::spawn(connection);
    client
}

/// Polls `sql` (a count) until it reaches `n` or 60 s pass; returns the last count.
pub async fn wait_for_count(client: &tokio_postgres::Client, sql: &str, n: i64) -> i64 {
    let mut count = 0;
    for _ in 0..600 {
        count = client
            .query_one(sql, &[])
            .await
            .map(|row| row.get::<_, i64>(0))
            .unwrap_or(0);
        if count >= n {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    count
}

/// How many exchange records among `rows` (the sink's results) hold
/// `text` as context, each checked to hold it there once and not as the
/// answer.
pub fn records_with_context(rows: &[Value], text: &str) -> usize {
    let texts = rows
        .iter()
        .map(|row| &row["exchange"]["texts"])
        .filter(|texts| texts["context"].to_string().contains(text));
    let mut count = 0;
    for texts in texts {
        assert!(!texts["response"].to_string().contains(text), "{texts}");
        let times = texts["context"].to_string().matches(text).count();
        assert_eq!(times, 1, "read once: {texts}");
        count += 1;
    }
    count
}

/// Closes a WebSocket session from the client's side: the close, the
/// other side's answer read, the connection dropped.
pub async fn hang_up<S>(mut ws: tokio_tungstenite::WebSocketStream<S>)
where
    S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin,
{
    use futures_util::StreamExt;
    ws.close(None).await.unwrap();
    while let Some(Ok(_)) = ws.next().await {}
}

/// Waits for a proxy whose shutdown began to stop, once its last session
/// ended: well inside its 5 s grace.
pub async fn stops_soon(task: tokio::task::JoinHandle<anyhow::Result<()>>) {
    tokio::time::timeout(Duration::from_secs(3), task)
        .await
        .expect("the proxy stops when the session ends")
        .unwrap()
        .unwrap();
}

/// The next text message of a WebSocket session, as written (within 5 s).
pub async fn next_text<S>(ws: &mut S) -> String
where
    S: futures_util::Stream<
            Item = Result<
                tokio_tungstenite::tungstenite::Message,
                tokio_tungstenite::tungstenite::Error,
            >,
        > + Unpin,
{
    use futures_util::StreamExt;
    let message = tokio::time::timeout(Duration::from_secs(5), ws.next())
        .await
        .expect("a message within 5 s")
        .expect("the session is open")
        .expect("a well-formed message");
    message.into_text().unwrap().as_str().to_owned()
}

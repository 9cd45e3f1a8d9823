//! Files sent in parts (OpenAI's Uploads API, `/v1/uploads`): a batch's
//! input sent this way has its requests read as one sent whole to
//! `/v1/files` has (see [`super::batch`]), or it would be a way around the
//! rules.
//!
//! - `POST /v1/uploads`: relayed. When the API answers with an upload whose
//!   `purpose` is `batch`, fairgate keeps its id until it expires.
//! - `POST /v1/uploads/{id}/parts`: the part goes up as it arrives, and is
//!   read on its way: each line whole within it is scanned as a request of
//!   the batch. What comes before its first line break and after its last
//!   is kept: the lines that run across parts are read when the order of
//!   the parts is known, at completion.
//! - `POST /v1/uploads/{id}/complete`: with the parts in the order it gives,
//!   the lines across parts are scanned. If a line of the file is blocked,
//!   or holds text a rule redacts (a part that went up cannot be edited),
//!   the completion is refused with the 400 `content_filter` error naming
//!   the line and its `custom_id`, and no file is made. So is one that names
//!   a part fairgate did not read (sent another way, or before a restart),
//!   or a line longer than `guard.max_body_bytes`.
//!
//! Uploads are kept in this process's memory: an upload created before a
//! restart, or through another instance of fairgate, is not known to be a
//! batch's and passes unread. Run one instance for batch uploads in parts,
//! or have clients upload batch inputs with `POST /v1/files`.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use futures_util::StreamExt;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Either, Full, Limited, StreamBody};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::Value;
use tokio::sync::mpsc;

use super::batch::{Refusal, form_boundary, scan_counted};
use super::respond::{self, Failure};
use super::{ProxyBody, State, upstream};
use crate::exchange::{self, Dialect, PartsStep};
use crate::risk::Decision;
use crate::rules::RuleSet;

/// Uploads of batch inputs in progress, by upload id.
#[derive(Default)]
pub struct Uploads {
    open: Mutex<HashMap<String, Upload>>,
}

struct Upload {
    /// When the API forgets the upload (Unix seconds).
    expires_at: i64,
    /// What was read of each part, by part id.
    parts: HashMap<String, Arc<Part>>,
}

/// What fairgate read of one part of a batch's input.
#[derive(Debug, Default)]
struct Part {
    /// The bytes before its first line break; `None` when it has none (its
    /// bytes are all in `tail`).
    head: Option<Vec<u8>>,
    /// The bytes after its last line break.
    tail: Vec<u8>,
    /// The lines between its first line break and its last.
    lines: usize,
    /// The first of those lines that refuses the batch, by its index among
    /// them.
    refused: Option<(usize, Refused)>,
    /// A line, or a head or tail, longer than `guard.max_body_bytes`.
    too_long: bool,
    /// The form could not be read to its end.
    unread: bool,
}

/// Why a line refuses the batch.
#[derive(Debug, Clone)]
enum Refused {
    /// It is not a request (not JSON, or a key given twice).
    Unreadable(Failure),
    Rules(Refusal),
}

impl Uploads {
    fn is_batch(&self, upload: &str) -> bool {
        self.open.lock().is_ok_and(|open| open.contains_key(upload))
    }

    /// Keeps `upload` until `expires_at` (in an hour, the API's default,
    /// when not given), and forgets the expired ones.
    fn begin(&self, upload: String, expires_at: Option<i64>) {
        let Ok(mut open) = self.open.lock() else {
            return;
        };
        let now = crate::record::now_ms() / 1000;
        let expires_at = expires_at.unwrap_or(now + 3600);
        open.retain(|_, upload| upload.expires_at > now);
        let parts = HashMap::new();
        open.insert(upload, Upload { expires_at, parts });
    }

    fn add_part(&self, upload: &str, part: String, read: Part) {
        if let Ok(mut open) = self.open.lock()
            && let Some(upload) = open.get_mut(upload)
        {
            upload.parts.insert(part, Arc::new(read));
        }
    }

    /// The parts named, in order, each with its id; the id of the first
    /// that was not read.
    fn parts(&self, upload: &str, ids: &[String]) -> Result<Vec<(String, Arc<Part>)>, String> {
        let first = || ids.first().cloned().unwrap_or_default();
        let open = self.open.lock().map_err(|_| first())?;
        let upload = open.get(upload).ok_or_else(first)?;
        ids.iter()
            .map(|id| match upload.parts.get(id) {
                Some(part) => Ok((id.clone(), part.clone())),
                None => Err(id.clone()),
            })
            .collect()
    }

    fn end(&self, upload: &str) {
        if let Ok(mut open) = self.open.lock() {
            open.remove(upload);
        }
    }
}

/// A step of an upload in parts, relayed as the guard allows.
pub(super) async fn handle(
    state: &Arc<State>,
    req: Request<Incoming>,
    step: PartsStep,
    request_id: &str,
) -> Response<ProxyBody> {
    let id = upload_id(req.uri().path());
    match step {
        PartsStep::Create => create(state, req, request_id).await,
        PartsStep::Part if state.uploads.is_batch(&id) => part(state, req, id, request_id).await,
        PartsStep::Complete if state.uploads.is_batch(&id) => {
            complete(state, req, id, request_id).await
        }
        // Not a batch's input, or not known to be.
        _ => super::passthrough(state, req, request_id).await,
    }
}

/// The upload id in `.../uploads/{id}/...`.
fn upload_id(path: &str) -> String {
    let mut segments = path.trim_end_matches('/').rsplit('/');
    segments.nth(1).unwrap_or_default().to_owned()
}

/// Creates an upload, and keeps its id when it is a batch's input.
async fn create(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let (status, head, body) = match relay_read(state, req, request_id).await {
        Ok(read) => read,
        Err(out) => return out,
    };
    if status.is_success()
        && let Ok(upload) = serde_json::from_slice::<Value>(&body)
        && let Some(id) = upload["id"].as_str()
    {
        match upload["purpose"] == "batch" {
            true => state
                .uploads
                .begin(id.to_owned(), upload["expires_at"].as_i64()),
            false => state.uploads.end(id),
        }
    }
    super::guarded_response(status, &head, respond::full(body), request_id, None)
}

/// Sends `req` upstream as it came and reads the whole answer.
async fn relay_read(
    state: &State,
    req: Request<Incoming>,
    request_id: &str,
) -> Result<(StatusCode, http::HeaderMap, Bytes), Response<ProxyBody>> {
    let relayed = super::relay(state, req, Dialect::OpenAi, request_id, true).await?;
    read_answer(
        state,
        &relayed.upstream,
        relayed.response,
        relayed.deadline,
        request_id,
    )
    .await
}

/// The status, headers and body of an upstream answer read whole.
async fn read_answer(
    state: &State,
    upstream: &str,
    response: Response<Incoming>,
    deadline: tokio::time::Instant,
    request_id: &str,
) -> Result<(StatusCode, http::HeaderMap, Bytes), Response<ProxyBody>> {
    let dialect = Dialect::OpenAi;
    if super::is_encoded(response.headers()) {
        return Err(super::upstream_broken(
            state, upstream, "encoded", dialect, request_id,
        ));
    }
    let (head, body) = response.into_parts();
    let limit = state.config.guard.max_response_bytes;
    match upstream::read_body(body, limit, deadline).await {
        Ok(body) => Ok((head.status, head.headers, body)),
        Err(error) => {
            tracing::warn!(%error, "an upload's answer could not be read");
            Err(super::upstream_broken(
                state, upstream, "body", dialect, request_id,
            ))
        }
    }
}

/// Sends a part of a batch's input upstream as it arrives, reading its
/// lines on the way, and keeps what was read under the part's id.
async fn part(
    state: &Arc<State>,
    req: Request<Incoming>,
    upload: String,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = Dialect::OpenAi;
    let encoded = super::is_encoded(req.headers());
    let Some(boundary) = form_boundary(req.headers()).filter(|_| !encoded) else {
        // Unreadable here: the part is not recorded, so completing fails.
        return super::passthrough(state, req, request_id).await;
    };
    let Some(route) = state.config.route(req.uri().path(), None) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    let upstream = route.upstream.clone();
    let mut headers = super::upstream_headers(state, &upstream, dialect, req.headers());
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    // Sent with the length the client gave, not chunked.
    if let Some(length) = req.headers().get(header::CONTENT_LENGTH) {
        headers.insert(header::CONTENT_LENGTH, length.clone());
    }
    let (parts, body) = req.into_parts();
    let (copies, read) = mpsc::channel(8);
    let reader = LineReader::new(state.clone(), upstream.clone());
    // Scanning a part of 64 MB takes long: not on a serving thread.
    let runtime = tokio::runtime::Handle::current();
    let reading =
        tokio::task::spawn_blocking(move || runtime.block_on(read_part(reader, read, boundary)));
    let body = tee(body, copies);
    let forwarded = super::forward(state, &upstream, Method::POST, &parts.uri, headers, body);
    let (response, deadline) = match forwarded.await {
        Ok(forwarded) => forwarded,
        Err(failure) => return respond::failure(dialect, failure, request_id),
    };
    let (status, head, body) =
        match read_answer(state, &upstream, response, deadline, request_id).await {
            Ok(read) => read,
            Err(out) => return out,
        };
    let part = serde_json::from_slice::<Value>(&body)
        .ok()
        .and_then(|part| Some(part["id"].as_str()?.to_owned()));
    if status.is_success()
        && let Some(part) = part
        && let Ok(Ok(read)) = tokio::time::timeout_at(deadline, reading).await
    {
        state.uploads.add_part(&upload, part, read);
    }
    super::guarded_response(status, &head, respond::full(body), request_id, None)
}

/// The client's body as it goes upstream, each piece of it copied to
/// `copies` on the way (waiting for room there: the reader keeps pace).
fn tee(body: Incoming, copies: mpsc::Sender<Bytes>) -> upstream::UpstreamBody {
    let frames = http_body_util::BodyStream::new(body);
    let stream =
        futures_util::stream::unfold((frames, copies), |(mut frames, copies)| async move {
            let frame = frames.next().await?;
            if let Some(data) = frame.as_ref().ok().and_then(|f| f.data_ref()) {
                // A reader that gave up leaves the part unread, not stopped.
                let _ = copies.send(data.clone()).await;
            }
            Some((frame, (frames, copies)))
        });
    Either::Right(Either::Right(BodyExt::boxed(StreamBody::new(stream))))
}

/// Reads the `data` field of a part's form, as its copies arrive.
async fn read_part(
    mut reader: LineReader,
    copies: mpsc::Receiver<Bytes>,
    boundary: String,
) -> Part {
    let copies = futures_util::stream::unfold(copies, |mut copies| async move {
        let data = copies.recv().await?;
        Some((Ok::<_, std::convert::Infallible>(data), copies))
    });
    let mut form = multer::Multipart::new(copies, boundary);
    let mut data_fields = 0;
    let whole = loop {
        match form.next_field().await {
            Ok(Some(mut field)) => {
                let data = field.name() == Some("data");
                data_fields += usize::from(data);
                loop {
                    match field.chunk().await {
                        Ok(Some(chunk)) if data => reader.feed(&chunk),
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(_) => break,
                    }
                }
            }
            Ok(None) => break true,
            Err(_) => break false,
        }
    };
    let mut part = reader.finish();
    part.unread |= !whole || data_fields != 1;
    part
}

/// Splits a part's data into lines and scans each one whole within it.
struct LineReader {
    state: Arc<State>,
    rules: Arc<RuleSet>,
    upstream: String,
    part: Part,
    /// The line being read.
    line: Vec<u8>,
}

impl LineReader {
    fn new(state: Arc<State>, upstream: String) -> LineReader {
        let rules = state.rules.snapshot();
        LineReader {
            state,
            rules,
            upstream,
            part: Part::default(),
            line: Vec::new(),
        }
    }

    fn feed(&mut self, mut data: &[u8]) {
        while let Some(at) = memchr::memchr(b'\n', data) {
            self.keep(&data[..at]);
            let line = std::mem::take(&mut self.line);
            match self.part.head {
                None => self.part.head = Some(line),
                Some(_) => {
                    self.check(&line);
                    self.part.lines += 1;
                }
            }
            data = &data[at + 1..];
        }
        self.keep(data);
    }

    fn keep(&mut self, data: &[u8]) {
        if self.line.len() + data.len() > self.state.config.guard.max_body_bytes {
            self.part.too_long = true;
            self.line.clear();
        } else {
            self.line.extend_from_slice(data);
        }
    }

    /// Scans a line whole within the part (the first refusal is kept).
    fn check(&mut self, line: &[u8]) {
        if self.part.refused.is_some() || self.part.too_long {
            return;
        }
        let index = self.part.lines;
        if let Some(refused) = refusal(&self.state, &self.rules, &self.upstream, line) {
            self.part.refused = Some((index, refused));
        }
    }

    fn finish(mut self) -> Part {
        self.part.tail = self.line;
        self.part
    }
}

/// What refuses a batch in `line` of its input, if anything does.
fn refusal(state: &State, rules: &RuleSet, upstream: &str, line: &[u8]) -> Option<Refused> {
    if line.trim_ascii().is_empty() {
        return None;
    }
    let request = match exchange::read_batch_input(line) {
        Ok(request) => request,
        Err(error) => return Some(Refused::Unreadable(Failure::unreadable(&error))),
    };
    let scan = scan_counted(state, rules, upstream, &request);
    let verdict = &scan.verdict;
    match verdict.decision {
        Decision::Redact => Some(Refused::Rules(Refusal::of_redaction(
            &request,
            &verdict.hits,
        ))),
        decision => Refusal::of_block(&request, &verdict.hits, decision).map(Refused::Rules),
    }
}

#[derive(Deserialize)]
struct Completion {
    part_ids: Vec<String>,
}

/// Completes an upload of a batch's input if every line of it, in the
/// order of its parts, is one the rules allow.
async fn complete(
    state: &Arc<State>,
    req: Request<Incoming>,
    upload: String,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = Dialect::OpenAi;
    let limit = state.config.guard.max_body_bytes;
    let (parts, body) = req.into_parts();
    let body = match Limited::new(body, limit).collect().await {
        Ok(body) => body.to_bytes(),
        Err(_) => return respond::failure(dialect, Failure::TooLarge, request_id),
    };
    let mut body = body;
    if let Some(encoding) = parts.headers.get(header::CONTENT_ENCODING)
        && encoding.as_bytes() != b"identity"
    {
        body = match super::decode(Some(encoding), body, limit) {
            Ok(body) => body,
            Err(failure) => return respond::failure(dialect, failure, request_id),
        };
    }
    let Some(route) = state.config.route(parts.uri.path(), None) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    // One the API would refuse goes up for it to answer.
    if let Ok(completion) = serde_json::from_slice::<Completion>(&body) {
        let rules = state.rules.snapshot();
        let refused = match state.uploads.parts(&upload, &completion.part_ids) {
            Ok(read) => check_file(state, &rules, &route.upstream, &read, request_id),
            Err(missing) => Some(not_read(&missing, request_id)),
        };
        if let Some(refused) = refused {
            return refused;
        }
    }
    let upstream = route.upstream.clone();
    let mut headers = super::upstream_headers(state, &upstream, dialect, &parts.headers);
    headers.remove(header::CONTENT_ENCODING);
    let body = Either::Left(Full::new(body));
    let forwarded = super::forward(state, &upstream, Method::POST, &parts.uri, headers, body);
    match forwarded.await {
        Ok((response, deadline)) => {
            if response.status().is_success() {
                state.uploads.end(&upload);
            }
            super::stream_back(response, deadline, request_id, None)
        }
        Err(failure) => respond::failure(dialect, failure, request_id),
    }
}

/// Reads a batch's input from its parts in order: the lines across parts
/// are scanned here, those within one were as it went up. The 400 of the
/// first line that refuses the batch, if one does.
fn check_file(
    state: &State,
    rules: &RuleSet,
    upstream: &str,
    parts: &[(String, Arc<Part>)],
    request_id: &str,
) -> Option<Response<ProxyBody>> {
    let dialect = Dialect::OpenAi;
    let limit = state.config.guard.max_body_bytes;
    let refuse = |refused: &Refused, line: usize| match refused {
        Refused::Unreadable(failure) => respond::failure(dialect, *failure, request_id),
        Refused::Rules(refusal) => refusal.respond(dialect, &format!("line {line}"), request_id),
    };
    // The line begun in earlier parts, and the number of lines before it.
    let (mut carry, mut lines) = (Vec::new(), 0);
    for (id, part) in parts {
        if part.unread {
            return Some(not_read(id, request_id));
        }
        if part.too_long {
            return Some(respond::failure(dialect, Failure::TooLarge, request_id));
        }
        if let Some(head) = &part.head {
            carry.extend_from_slice(head);
            lines += 1;
            if let Some(refused) = refusal(state, rules, upstream, &carry) {
                return Some(refuse(&refused, lines));
            }
            carry.clear();
            if let Some((index, refused)) = &part.refused {
                return Some(refuse(refused, lines + 1 + index));
            }
            lines += part.lines;
        }
        carry.extend_from_slice(&part.tail);
        if carry.len() > limit {
            return Some(respond::failure(dialect, Failure::TooLarge, request_id));
        }
    }
    let refused = refusal(state, rules, upstream, &carry)?;
    Some(refuse(&refused, lines + 1))
}

/// The 400 for a completion that names a part fairgate did not read.
fn not_read(part: &str, request_id: &str) -> Response<ProxyBody> {
    let message = format!(
        "Part {part:?} of this batch input did not come through this gateway whole, so its requests were not read; upload the part again through it."
    );
    respond::invalid_request(&message, "part_not_read", request_id)
}

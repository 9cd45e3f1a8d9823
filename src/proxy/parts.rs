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
//! - `POST /v1/uploads/{id}/cancel`: relayed; once the API has cancelled
//!   the upload, fairgate forgets it.
//!
//! Each line read is recorded as a request of the batch
//! ([`lines::LineRecords`]), its record held on disk until a completion
//! that names its part numbers it in the file and ends it with its status
//! (`<completion's id>.<line>`). The lines of a part no completion names
//! went up all the same, to the API's storage if to no model: their
//! records end with the part's own answer, under the part's id
//! (`<part's id>.<line>`, numbered within the part, what comes before its
//! first line break counting as line 1 and recorded when it is a request
//! of its own), once the upload is completed
//! without it, cancelled or expired, or when the proxy stops (its last
//! serving thread: a completion under way on another still takes them);
//! a part the API refused, or whose sending failed, ends them with that
//! answer at once. Those are the lines it holds whole: the lines across
//! parts are read only at a completion. An upload is found expired within
//! a second (each serving thread looks every second), or sooner at a step
//! of an upload in parts.
//!
//! Uploads are kept in this process's memory: the parts of an upload
//! created before a restart, or through another instance of fairgate, go
//! up unread, and its completion is refused when it makes a batch's input
//! (the 400 `upload_not_read`; the file is deleted before the client
//! learns its id). Run one instance for batch uploads in parts, or have
//! clients upload batch inputs with `POST /v1/files`.

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use http::{HeaderValue, Method, Request, Response, StatusCode, header};
use http_body_util::{Either, Full};
use hyper::body::Incoming;
use serde::Deserialize;
use serde_json::Value;

use super::batch::{OutsideRecords, form_boundary};
use super::held::{Answered, HeldRecords};
use super::lines::{self, LineRecords, Part};
use super::respond::{self, Failure};
use super::{ProxyBody, State, upstream};
use crate::exchange::{Dialect, PartsStep};

/// Uploads of batch inputs in progress, by upload id.
#[derive(Default)]
pub struct Uploads {
    open: Mutex<HashMap<String, Upload>>,
    /// Set when the proxy stops: a part read after it is not kept.
    closed: AtomicBool,
    /// The serving threads still serving: the last to stop closes.
    serving: AtomicUsize,
}

/// A serving thread's hold on the uploads: the last one dropped (the
/// proxy has stopped serving) closes them ([`Uploads::close`]). A
/// completion still under way on another thread then still finds the
/// records of its parts' lines.
pub(super) struct Serving<'a>(&'a Uploads);

impl Drop for Serving<'_> {
    fn drop(&mut self) {
        if self.0.serving.fetch_sub(1, Ordering::AcqRel) == 1 {
            self.0.close();
        }
    }
}

struct Upload {
    /// When the API forgets the upload (Unix seconds).
    expires_at: i64,
    /// What was read of each part, by part id.
    parts: HashMap<String, ReadPart>,
}

struct ReadPart {
    read: Arc<Part>,
    /// The records of its lines, until a completion takes them.
    records: Option<HeldRecords>,
    /// The part's own answer, which ends them if none does.
    answered: Answered,
}

impl ReadPart {
    /// Ends the records of a part no completion took, with the part's own
    /// answer, under its own id.
    fn end_unnamed(&mut self) {
        if let Some(records) = self.records.take() {
            records.end(self.answered.clone());
        }
    }
}

/// A part a completion names, as it was read.
struct Named {
    id: String,
    read: Arc<Part>,
    /// The records of its lines, unless an earlier completion (or an
    /// earlier mention in this one) took them.
    records: Option<HeldRecords>,
}

impl Uploads {
    /// Held by each serving thread while it serves.
    pub(super) fn serving(&self) -> Serving<'_> {
        self.serving.fetch_add(1, Ordering::AcqRel);
        Serving(self)
    }

    /// Whether `upload` is a batch's input in progress (the expired ones
    /// forgotten first).
    fn is_batch(&self, upload: &str) -> bool {
        let Ok(mut open) = self.open.lock() else {
            return false;
        };
        forget_expired(&mut open);
        open.contains_key(upload)
    }

    /// Forgets the uploads the API has forgotten, with no step of theirs
    /// needed: each serving thread calls it every second.
    pub(super) fn forget_expired(&self) {
        if let Ok(mut open) = self.open.lock() {
            forget_expired(&mut open);
        }
    }

    /// Keeps `upload` until `expires_at` (in an hour, the API's default,
    /// when not given), and forgets the expired ones.
    fn begin(&self, upload: String, expires_at: Option<i64>) {
        let Ok(mut open) = self.open.lock() else {
            return;
        };
        let expires_at = expires_at.unwrap_or(forget_expired(&mut open) + 3600);
        let parts = HashMap::new();
        open.insert(upload, Upload { expires_at, parts });
    }

    /// Keeps what was read of `part` of `upload`, answered as `answered`,
    /// for a completion; or, when the upload is not known (any more) or
    /// the proxy is stopping, ends its records with that answer.
    fn add_part(&self, upload: &str, part: String, read: (Part, HeldRecords), answered: Answered) {
        let (read, records) = read;
        let mut part_read = ReadPart {
            read: Arc::new(read),
            records: Some(records),
            answered,
        };
        if !self.closed.load(Ordering::Acquire)
            && let Ok(mut open) = self.open.lock()
            && let Some(upload) = open.get_mut(upload)
        {
            upload.parts.insert(part, part_read);
            return;
        }
        part_read.end_unnamed();
    }

    /// The parts named, in order, with the records of their lines (taken:
    /// they end with this completion); the id of the first that was not
    /// read.
    fn parts(&self, upload: &str, ids: &[String]) -> Result<Vec<Named>, String> {
        let first = || ids.first().cloned().unwrap_or_default();
        let mut open = self.open.lock().map_err(|_| first())?;
        let upload = open.get_mut(upload).ok_or_else(first)?;
        ids.iter()
            .map(|id| match upload.parts.get_mut(id) {
                Some(part) => Ok(Named {
                    id: id.clone(),
                    read: part.read.clone(),
                    records: part.records.take(),
                }),
                None => Err(id.clone()),
            })
            .collect()
    }

    /// Forgets `upload` (completed, cancelled, or not a batch's input):
    /// the records of parts no completion took end with their own answers.
    fn end(&self, upload: &str) {
        let ended = self
            .open
            .lock()
            .ok()
            .and_then(|mut open| open.remove(upload));
        if let Some(mut upload) = ended {
            upload.parts.values_mut().for_each(ReadPart::end_unnamed);
        }
    }

    /// When the proxy stops: the records of every part no completion took
    /// end with their parts' own answers, while what was read of the parts
    /// stays for a completion still under way.
    fn close(&self) {
        self.closed.store(true, Ordering::Release);
        if let Ok(mut open) = self.open.lock() {
            for upload in open.values_mut() {
                upload.parts.values_mut().for_each(ReadPart::end_unnamed);
            }
        }
    }
}

/// Forgets the uploads of `open` the API has forgotten: the records of
/// their parts no completion took end with the parts' own answers. The
/// time now, in Unix seconds.
fn forget_expired(open: &mut HashMap<String, Upload>) -> i64 {
    let now = crate::record::now_ms() / 1000;
    for (_, mut upload) in open.extract_if(|_, upload| upload.expires_at <= now) {
        upload.parts.values_mut().for_each(ReadPart::end_unnamed);
    }
    now
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
        PartsStep::Complete => complete_unknown(state, req, request_id).await,
        PartsStep::Cancel if state.uploads.is_batch(&id) => {
            cancel(state, req, id, request_id).await
        }
        // Not a batch's input, or not known to be: its completion tells.
        PartsStep::Part | PartsStep::Cancel => super::passthrough(state, req, request_id).await,
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
    relay_seen(state, req, request_id, |body| {
        if let Ok(upload) = serde_json::from_slice::<Value>(body)
            && let Some(id) = upload["id"].as_str()
        {
            match upload["purpose"] == "batch" {
                true => state
                    .uploads
                    .begin(id.to_owned(), upload["expires_at"].as_i64()),
                false => state.uploads.end(id),
            }
        }
    })
    .await
}

/// Cancels an upload of a batch's input: once the API has, the records of
/// its parts end with the parts' own answers.
async fn cancel(
    state: &Arc<State>,
    req: Request<Incoming>,
    upload: String,
    request_id: &str,
) -> Response<ProxyBody> {
    relay_seen(state, req, request_id, |_| state.uploads.end(&upload)).await
}

/// Relays `req` and reads its answer whole, which `seen` sees when it is a
/// success before it is passed on.
async fn relay_seen(
    state: &State,
    req: Request<Incoming>,
    request_id: &str,
    seen: impl FnOnce(&Bytes),
) -> Response<ProxyBody> {
    let (status, head, body) = match relay_read(state, req, request_id).await {
        Ok(read) => read,
        Err(out) => return out,
    };
    if status.is_success() {
        seen(&body);
    }
    super::guarded_response(status, head, respond::full(body), request_id, None)
}

/// An upstream's answer read whole (its status, headers and body), or
/// the client's answer when it could not be.
type ReadAnswer = Result<(StatusCode, http::HeaderMap, Bytes), Response<ProxyBody>>;

/// Sends `req` upstream as it came and reads the whole answer.
async fn relay_read(state: &State, req: Request<Incoming>, request_id: &str) -> ReadAnswer {
    let relayed = super::relay(state, req, Dialect::OpenAi, request_id, true).await?;
    read_answer(
        state,
        &relayed.upstream,
        relayed.response,
        relayed.timeout,
        request_id,
    )
    .await
}

/// The status, headers and body of an upstream answer read whole.
async fn read_answer(
    state: &State,
    upstream: &str,
    response: Response<upstream::Answer>,
    timeout: Duration,
    request_id: &str,
) -> ReadAnswer {
    let dialect = Dialect::OpenAi;
    if super::is_encoded(response.headers()) {
        return Err(super::upstream_broken(
            state, upstream, "encoded", dialect, request_id,
        ));
    }
    let (head, body) = response.into_parts();
    let limit = state.config.guard.max_response_bytes;
    match upstream::read_body(body, limit, timeout).await {
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
/// lines on the way, and keeps what was read under the part's id
/// ([`keep`]).
async fn part(
    state: &Arc<State>,
    req: Request<Incoming>,
    upload: String,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let dialect = Dialect::OpenAi;
    let encoded = super::is_encoded(req.headers());
    let Some(boundary) = form_boundary(req.headers()).filter(|_| !encoded) else {
        // Unreadable here: the part is not recorded, so completing fails.
        return super::passthrough(state, req, request_id).await;
    };
    let Some(route) = super::route(state, req.headers(), dialect, req.uri().path(), None) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    let upstream = route.upstream.clone();
    let (mut parts, body) = req.into_parts();
    // Sent with the length the client gave, not chunked.
    let length = parts.headers.remove(header::CONTENT_LENGTH);
    let records = LineRecords::new(state.clone(), parts.headers.clone(), started);
    let mut headers = super::upstream_headers(state, &upstream, dialect, parts.headers);
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    if let Some(length) = length {
        headers.insert(header::CONTENT_LENGTH, length);
    }
    let form = (boundary, "data");
    let (copies, reading) = lines::read(state, &upstream, form, request_id, records);
    let frames = super::client_body(state, body).into_frames();
    let body = lines::tee(frames, copies, None);
    let sent = Instant::now();
    let forwarded = super::forward(state, &upstream, Method::POST, &parts.uri, headers, body);
    let (answer, upstream_time) = match forwarded.await {
        Ok((response, timeout)) => {
            let upstream_time = sent.elapsed();
            let answer = read_answer(state, &upstream, response, timeout, request_id).await;
            (answer, Some(upstream_time))
        }
        Err(failure) => (Err(respond::failure(dialect, failure, request_id)), None),
    };
    let answered = answered_part(&answer, upstream_time);
    keep(state, (&upstream, &upload), reading, answered).await;
    match answer {
        Ok((status, head, body)) => {
            super::guarded_response(status, head, respond::full(body), request_id, None)
        }
        Err(out) => out,
    }
}

/// The part's own answer, from `answer` (the upstream's share of the
/// time `upstream_time`), and the id the API gave the part, when it took
/// it.
fn answered_part(
    answer: &ReadAnswer,
    upstream_time: Option<Duration>,
) -> (Answered, Option<String>) {
    let (status, kept) = match answer {
        Ok((status, head, body)) => (*status, Some((head, body))),
        Err(out) => (out.status(), None),
    };
    let answered = Answered {
        status: status.as_u16(),
        upstream: upstream_time,
        upstream_request_id: kept.and_then(|(head, _)| super::upstream_request_id(head)),
    };
    let part = kept
        .filter(|_| status.is_success())
        .and_then(|(_, body)| serde_json::from_slice::<Value>(body).ok())
        .and_then(|part| Some(part["id"].as_str()?.to_owned()));
    (answered, part)
}

/// Keeps what `reading` reads of a part for a completion, under the id
/// the API gave it ([`answered_part`]); a part it did not take ends its
/// records with its answer at once.
async fn keep(
    state: &State,
    (upstream, upload): (&str, &str),
    reading: tokio::task::JoinHandle<lines::Read>,
    (answered, part): (Answered, Option<String>),
) {
    // The body has gone up, or stopped: the reader ends. One still
    // reading when the upstream's timeout is over ends its records when
    // it does, as abandoned.
    let timeout_ms = state.config.upstreams.get(upstream).map(|u| u.timeout_ms);
    let wait = Duration::from_millis(timeout_ms.unwrap_or_default());
    if let Ok(Ok(read)) = tokio::time::timeout(wait, reading).await {
        let records = read.records.into_held();
        match part {
            Some(part) => {
                let read = (read.part, records);
                state.uploads.add_part(upload, part, read, answered);
            }
            None => records.end(answered),
        }
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
    let started = Instant::now();
    let dialect = Dialect::OpenAi;
    let limit = state.config.guard.max_body_bytes;
    let (parts, body) = req.into_parts();
    let mut body = match super::read_whole(state, body, limit).await {
        Ok(body) => body,
        Err(failure) => return respond::failure(dialect, failure, request_id),
    };
    if let Some(encoding) = parts.headers.get(header::CONTENT_ENCODING)
        && encoding.as_bytes() != b"identity"
    {
        body = match super::decode(Some(encoding), body, limit) {
            Ok(body) => body,
            Err(failure) => return respond::failure(dialect, failure, request_id),
        };
    }
    let Some(route) = super::route(state, &parts.headers, dialect, parts.uri.path(), None) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    let upstream = route.upstream.clone();
    let mut records = OutsideRecords::new(state, (dialect, &upstream), (request_id, started));
    // One the API would refuse goes up for it to answer.
    if let Ok(completion) = serde_json::from_slice::<Completion>(&body) {
        let named = state.uploads.parts(&upload, &completion.part_ids);
        let read = (upstream.as_str(), request_id, started);
        if let Some(refused) = check(state, read, (named, &parts.headers), &mut records) {
            return records.refused(refused);
        }
    }
    let mut headers = super::upstream_headers(state, &upstream, dialect, parts.headers);
    headers.remove(header::CONTENT_ENCODING);
    let body = upstream::whole(body);
    let answer = async {
        let forwarded = super::forward(state, &upstream, Method::POST, &parts.uri, headers, body);
        match forwarded.await {
            Ok((response, timeout)) => {
                if response.status().is_success() {
                    state.uploads.end(&upload);
                }
                super::stream_back(response, timeout, request_id, None)
            }
            Err(failure) => respond::failure(dialect, failure, request_id),
        }
    };
    records.answered_with(answer).await
}

/// The 400 that refuses a completion naming the parts `named` (or the
/// first it names that was not read), if anything does: the lines across
/// parts are read here (`read`: the upstream, and the completion's id
/// and start; `headers`, its headers). The records of the file's lines
/// go to `records` numbered in it: each part's, and those read here.
fn check(
    state: &Arc<State>,
    (upstream, request_id, started): (&str, &str, Instant),
    (named, headers): (Result<Vec<Named>, String>, &http::HeaderMap),
    records: &mut OutsideRecords<'_>,
) -> Option<Response<ProxyBody>> {
    let mut named = match named {
        Ok(named) => named,
        Err(missing) => return Some(not_read(&missing, request_id)),
    };
    // Whether each mention ends its part's records (a part named twice
    // has them at its first).
    let recorded: Vec<bool> = named.iter().map(|part| part.records.is_some()).collect();
    let heads = lines::head_lines(&named.iter().map(|part| &*part.read).collect::<Vec<_>>());
    for (part, head) in named.iter_mut().zip(heads) {
        if let (Some(mut held), Some(head)) = (part.records.take(), head) {
            held.number_after((request_id, started), head - 1);
            records.hold(held);
        }
    }
    if let Some(part) = named.iter().find(|part| part.read.unread) {
        return Some(not_read(&part.id, request_id));
    }
    let read: Vec<(&Part, bool)> = (named.iter().zip(recorded))
        .map(|(part, recorded)| (&*part.read, recorded))
        .collect();
    let rules = state.rules.snapshot();
    let mut across = LineRecords::new(state.clone(), headers.clone(), started);
    let refused = lines::check((state, &rules, upstream), &read, request_id, &mut across);
    records.hold(across.into_held());
    refused
}

/// Completes an upload this process did not see begin as a batch's input
/// (begun before a restart, or through another instance of fairgate, or
/// for another purpose). Its parts were not read, so if the file it makes
/// is a batch's input, that file is deleted before anyone learns its id,
/// and the client gets the 400 `upload_not_read`: a batch's requests never
/// reach the API unread this way.
async fn complete_unknown(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    // The client's headers, for the deletion (its key).
    let sent = req.headers().clone();
    let relayed = match super::relay(state, req, Dialect::OpenAi, request_id, true).await {
        Ok(relayed) => relayed,
        Err(out) => return out,
    };
    let upstream = relayed.upstream;
    let answer = read_answer(
        state,
        &upstream,
        relayed.response,
        relayed.timeout,
        request_id,
    );
    let (status, head, body) = match answer.await {
        Ok(read) => read,
        Err(out) => return out,
    };
    let made = serde_json::from_slice::<Value>(&body)
        .ok()
        .filter(|upload| status.is_success() && upload["purpose"] == "batch");
    let Some(upload) = made else {
        return super::guarded_response(status, head, respond::full(body), request_id, None);
    };
    let file = upload["file"]["id"].as_str().unwrap_or_default();
    let deleted = delete_file(state, &upstream, &sent, file).await;
    if !deleted {
        tracing::error!(
            request_id,
            file,
            "a batch input uploaded in parts that were not read was made into a file that could not be deleted"
        );
    }
    let message = format!(
        "This batch input was uploaded in parts that did not come through this gateway's process (the upload began before a restart, or through another instance), so its requests were not read; {} Upload it again through this gateway.",
        match deleted {
            true => "the file made of it was deleted.",
            false => "the file made of it could not be deleted.",
        }
    );
    respond::invalid_request(&message, "upload_not_read", request_id)
}

/// Deletes file `id` at `upstream`; whether the API said it is gone.
async fn delete_file(state: &State, upstream: &str, sent: &http::HeaderMap, id: &str) -> bool {
    let well_formed = !id.is_empty()
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'-' || b == b'_');
    let Some(uri) = well_formed
        .then(|| format!("/v1/files/{id}").parse::<http::Uri>().ok())
        .flatten()
    else {
        return false;
    };
    let mut headers = super::upstream_headers(state, upstream, Dialect::OpenAi, sent.clone());
    headers.remove(header::CONTENT_TYPE);
    headers.remove(header::CONTENT_ENCODING);
    let body = Either::Left(Full::default());
    match super::forward(state, upstream, Method::DELETE, &uri, headers, body).await {
        Ok((response, _)) => response.status().is_success(),
        Err(_) => false,
    }
}

/// The 400 for a completion that names a part fairgate did not read.
fn not_read(part: &str, request_id: &str) -> Response<ProxyBody> {
    let message = format!(
        "Part {part:?} of this batch input did not come through this gateway whole, so its requests were not read; upload the part again through it."
    );
    respond::invalid_request(&message, "part_not_read", request_id)
}

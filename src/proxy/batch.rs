//! Batches, which would otherwise be a way around the rules: the requests
//! of an Anthropic message batch are scanned when it is created, those of
//! an OpenAI batch when its input file is uploaded, and the results of
//! either as they are fetched.
//!
//! - `POST /v1/messages/batches`: each request's `params` is read as a
//!   `/v1/messages` request. One that a rule blocks fails the whole batch
//!   with the 400 a blocked prompt gets, its message naming the request by
//!   its index and `custom_id`; `redact` hits are redacted in place.
//! - `POST /v1/files` of a form whose `purpose` is `batch`: each line of
//!   its `file` is read as a request to the endpoint its `url` names; a
//!   blocked one refuses the upload (the OpenAI 400, naming the line and
//!   `custom_id`), `redact` hits are redacted in place (the form is
//!   written again). Other uploads go up as they came. A form is read whole
//!   up to `guard.max_body_bytes`; a larger one goes on as it arrives,
//!   unread once its start shows a `purpose` other than `batch`, else read
//!   line by line on its way ([`super::lines`]): its last piece goes only
//!   once every line is allowed, and a line to redact refuses it too.
//! - A batch's input sent in parts (the Uploads API): see [`super::parts`].
//! - Batch objects (created, retrieved, listed, canceled): their
//!   `results_url`, which the SDKs follow, leads back to the proxy as the
//!   client reached it; else the results would come from the API directly.
//! - Results (`GET /v1/messages/batches/{id}/results`), and files
//!   (`GET /v1/files/{id}/content`) whose first line is a batch's line (an
//!   object with a `custom_id`): relayed line by line, as they arrive, each
//!   answer scanned as a response. A blocked answer becomes the refusal its
//!   request would have got (with `on_block: error`, the error, as a failed
//!   request of the batch); `redact` hits are redacted in place. A line
//!   that is not JSON, or longer than `guard.max_response_bytes`, ends the
//!   body with an error. Other files pass unread.
//!
//! The proxy sees a batch's request apart from its answer, so each leaves
//! an exchange record of its own, the two tied by the request's
//! `custom_id`, each numbered after the fairgate request that read it:
//!
//! - a request read when its batch is created ([`OutsideRecords`]: an
//!   Anthropic message batch, an OpenAI batch's input uploaded whole or
//!   read on its way up, or sent in parts and completed; route
//!   [`crate::record::BATCH_REQUESTS`], numbered by its place from 1): its
//!   prompt, verdict and hits, and the status the creation (or the
//!   completion) got. The records of lines read on their way up are held
//!   on disk until that answer ([`super::held`]).
//! - an answer, as it is relayed ([`crate::record::BATCH_RESULTS`],
//!   numbered by its line): the answer, its verdict and hits, the model
//!   and usage, and no prompt.

use std::borrow::Cow;
use std::future::Future;
use std::ops::Range;
use std::sync::Arc;
use std::time::Instant;

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderMap, Method, Request, Response, Uri, header};
use http_body_util::{BodyExt, StreamBody};
use hyper::body::{Frame, Incoming};
use serde_json::{Value, json};
use tokio::sync::oneshot;

use super::held::{Answered, HeldRecords};
use super::respond::{self, Failure};
use super::stored::{ScannedIn, count};
use super::{
    BoxError, Ending, ProxyBody, ReadRequest, RecordDraft, Relayed, State, lines, upstream,
};
use crate::config::OnBlock;
use crate::exchange::{self, Batch, BatchAnswer, BatchRequest, Dialect};
use crate::guard::{self, block_message, rule_ids};
use crate::json::{self, ReadError};
use crate::record::{ClientMeta, Usage, now_ms};
use crate::risk::{self, Decision, Verdict};
use crate::rules::{Hit, RuleSet, Scope};

/// The route label of a batch's requests in the metrics.
const REQUESTS: &str = crate::record::BATCH_REQUESTS;
/// The route label of a batch's answers, and of their records.
const RESULTS: &str = crate::record::BATCH_RESULTS;

/// A request about batches ([`Batch`]), relayed as the guard allows.
pub(super) async fn handle(
    state: &Arc<State>,
    req: Request<Incoming>,
    batch: Batch,
    request_id: &str,
) -> Response<ProxyBody> {
    match batch {
        Batch::Create => create(state, req, request_id).await,
        Batch::Objects => objects(state, req, request_id).await,
        Batch::Results => results(state, req, Dialect::Anthropic, request_id).await,
        Batch::FileContent => results(state, req, Dialect::OpenAi, request_id).await,
        Batch::Upload => upload(state, req, request_id).await,
        Batch::Parts(step) => super::parts::handle(state, req, step, request_id).await,
    }
}

/// Uploads a file: a batch's input (a form whose `purpose` is `batch`)
/// with each request read as a prompt, any other file as it came.
///
/// The body is read whole when it is at most `guard.max_body_bytes`;
/// a larger one goes on as it arrives: unread once its start shows it is
/// not a batch's, else read on the way ([`read_on_the_way`]).
async fn upload(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let dialect = Dialect::OpenAi;
    let Some(boundary) = form_boundary(req.headers()) else {
        return super::passthrough(state, req, request_id).await;
    };
    let form = match HeldForm::of(state, req, request_id).await {
        Ok(form) => form,
        Err(answer) => return answer,
    };
    let upstream = form.upstream.clone();
    let mut records = OutsideRecords::new(state, (dialect, &upstream), (request_id, started));
    let body = match form.held {
        // Too large to read whole: what its start says decides.
        Held::Start(start, body) => match purpose(&fields(&start, &boundary).await.0) {
            Some(purpose) if purpose != b"batch" => upstream::read_on(start, body),
            // A batch's, or its purpose comes later.
            _ => {
                let input = (start, body, boundary);
                let to = (form.upstream, form.headers);
                let sent = read_on_the_way(state, &mut records, form.parts, input, to);
                return sent.await;
            }
        },
        Held::Whole(whole) => {
            let read = batch_input(&mut records, &form.parts.headers, whole, &boundary).await;
            match read {
                Ok(whole) => upstream::whole(whole),
                Err(refused) => return records.refused(refused),
            }
        }
    };
    let uri = &form.parts.uri;
    let answer = async {
        match super::forward(state, &upstream, Method::POST, uri, form.headers, body).await {
            Ok((response, timeout)) => super::stream_back(response, timeout, request_id, None),
            Err(failure) => respond::failure(dialect, failure, request_id),
        }
    };
    records.answered_with(answer).await
}

/// A form's request, its body held up to `guard.max_body_bytes`, with the
/// upstream it goes to and the headers it goes with.
pub(super) struct HeldForm {
    pub parts: http::request::Parts,
    pub upstream: String,
    pub headers: HeaderMap,
    pub held: Held,
}

/// How much of a form too large to hold is read before it goes on.
const START: usize = 64 << 10;

/// What is held of a form.
pub(super) enum Held {
    /// All of it, uncompressed (the headers say so).
    Whole(Bytes),
    /// Its start, and the rest still to come: too large to hold, it goes
    /// on as it arrives, with the length the client gave.
    Start(Bytes, upstream::ClientBody),
}

impl HeldForm {
    /// Reads `req`'s body until it ends or passes `guard.max_body_bytes`
    /// (or its first 64 KiB, when its `content-length` passes it);
    /// the error answer when it cannot be read, has no route, or is too
    /// large to hold and compressed (it could not be read on the way).
    pub(super) async fn of(
        state: &State,
        req: Request<Incoming>,
        request_id: &str,
    ) -> Result<HeldForm, Response<ProxyBody>> {
        let fail = |failure| respond::failure(Dialect::OpenAi, failure, request_id);
        let limit = state.config.guard.max_body_bytes;
        let (parts, body) = req.into_parts();
        // A body its length says is too large to hold is not held: only
        // its start is, enough for the fields before a file.
        let length = parts.headers.get(header::CONTENT_LENGTH);
        let length = length.and_then(|length| length.to_str().ok()?.parse::<usize>().ok());
        let held = match length {
            Some(length) if length > limit => limit.min(START),
            _ => limit,
        };
        let mut body = super::client_body(state, body);
        let mut start = BytesMut::new();
        let whole = loop {
            match super::next_frame(&mut body).await.map_err(fail)? {
                Some(frame) => {
                    if let Ok(data) = frame.into_data() {
                        start.extend_from_slice(&data);
                    }
                    if start.len() > held {
                        break false;
                    }
                }
                None => break true,
            }
        };
        let start = start.freeze();
        let (headers, path) = (&parts.headers, parts.uri.path());
        let Some(route) = super::route(state, headers, Dialect::OpenAi, path, None) else {
            return Err(fail(Failure::NoRoute));
        };
        let upstream = route.upstream.clone();
        let mut headers =
            super::upstream_headers(state, &upstream, Dialect::OpenAi, parts.headers.clone());
        let encoding = parts.headers.get(header::CONTENT_ENCODING);
        let encoded = encoding.is_some_and(|e| e.as_bytes() != b"identity");
        let held = match (whole, encoded) {
            (true, false) => Held::Whole(start),
            (true, true) => {
                let form = super::decode(encoding, start, limit).map_err(fail)?;
                headers.remove(header::CONTENT_ENCODING);
                Held::Whole(form)
            }
            (false, true) => return Err(fail(Failure::TooLarge)),
            (false, false) => {
                // Sent with the length the client gave, not chunked.
                if let Some(length) = parts.headers.get(header::CONTENT_LENGTH) {
                    headers.insert(header::CONTENT_LENGTH, length.clone());
                }
                Held::Start(start, body)
            }
        };
        Ok(HeldForm {
            parts,
            upstream,
            headers,
            held,
        })
    }
}

/// The boundary of a form (`multipart/form-data`), from its content type.
pub(super) fn form_boundary(headers: &HeaderMap) -> Option<String> {
    let content_type = headers.get(header::CONTENT_TYPE)?.to_str().ok()?;
    multer::parse_boundary(content_type).ok()
}

/// Sends an upload too large to hold whole upstream as it arrives (`input`:
/// the start fairgate read, the rest, the form's boundary), reading its
/// file line by line on the way. When its `purpose` is `batch`, the last
/// piece goes up only once every line is allowed: a refused batch's input
/// never arrives whole, so the API makes no file of it, and the client
/// gets the 400 that names the line. Each line read is recorded
/// ([`lines::LineRecords`]); its record ends in `records`, with the
/// others of the upload.
async fn read_on_the_way(
    state: &Arc<State>,
    records: &mut OutsideRecords<'_>,
    parts: http::request::Parts,
    input: (Bytes, upstream::ClientBody, String),
    (upstream, headers): (String, HeaderMap),
) -> Response<ProxyBody> {
    let request_id = records.request_id;
    let (start, rest, boundary) = input;
    let line_records =
        lines::LineRecords::new(state.clone(), parts.headers.clone(), records.started);
    let form = (boundary, "file");
    let (copies, reading) = lines::read(state, &upstream, form, request_id, line_records);
    let judged = {
        let recorded = records.on_the_way();
        let (state, upstream, request_id) =
            (state.clone(), upstream.clone(), request_id.to_owned());
        async move {
            match reading.await {
                Ok(read) => judge(&state, &upstream, read, &request_id, recorded),
                Err(_) => Some(unreadable_form(&request_id)),
            }
        }
    };
    let sent = (&parts, start, rest);
    let answer = send_judged(
        state,
        sent,
        (&upstream, headers),
        copies,
        judged,
        request_id,
    );
    records.answered_with(answer).await
}

/// Sends a body too large to hold upstream as it arrives (`sent`: the
/// request's head, the start fairgate read, the rest), each piece copied
/// to `copies` for a reader on the way. Its last piece goes only once
/// `judged` finds nothing to refuse; else that refusal is the answer, and
/// the upstream never gets the body whole.
pub(super) async fn send_judged(
    state: &Arc<State>,
    sent: (&http::request::Parts, Bytes, upstream::ClientBody),
    (upstream, headers): (&str, HeaderMap),
    copies: tokio::sync::mpsc::Sender<Bytes>,
    judged: impl Future<Output = Option<Response<ProxyBody>>> + Send + 'static,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = Dialect::OpenAi;
    let (parts, start, rest) = sent;
    let (allow, allowed) = tokio::sync::oneshot::channel();
    let judging = tokio::spawn(async move {
        let refused = judged.await;
        let _ = allow.send(refused.is_none());
        refused
    });
    let start = futures_util::stream::iter([Ok(Frame::data(start))]);
    let body = lines::tee(start.chain(rest.into_frames()), copies, Some(allowed));
    let uri = &parts.uri;
    let forwarded = super::forward(state, upstream, Method::POST, uri, headers, body).await;
    // A body cut short by its client is not read to its end either: the
    // timeout, or its breaking off, is the answer, not the unread body.
    if let Err(failure) = forwarded
        && failure.of_client_body()
    {
        return respond::failure(dialect, failure, request_id);
    }
    // The body is over (sent, refused, or dropped with the request), so the
    // judgement is made or about to be.
    if let Ok(Some(refused)) = judging.await {
        return refused;
    }
    match forwarded {
        Ok((response, timeout)) => super::stream_back(response, timeout, request_id, None),
        Err(failure) => respond::failure(dialect, failure, request_id),
    }
}

/// The 400 that refuses an upload read on its way, if anything refuses it:
/// a batch's input with a line the rules refuse, or a form that could not
/// be read and is not known to be another purpose's. A batch's input read
/// hands the records of its lines over to `recorded`; another file's lines
/// were no requests, and leave none.
fn judge(
    state: &State,
    upstream: &str,
    read: lines::Read,
    request_id: &str,
    recorded: LateRecords,
) -> Option<Response<ProxyBody>> {
    let lines::Read {
        part,
        purpose,
        mut records,
    } = read;
    match purpose.as_deref() {
        Some(b"batch") if !part.unread => {
            let rules = state.rules.snapshot();
            let read_by = (state, &*rules, upstream);
            let refused = lines::check(read_by, &[(&part, true)], request_id, &mut records);
            hand_over(state, recorded, Late::Held(records.into_held()));
            refused
        }
        Some(purpose) if purpose != b"batch" => None,
        _ if part.unread => Some(unreadable_form(request_id)),
        _ => None,
    }
}

fn unreadable_form(request_id: &str) -> Response<ProxyBody> {
    respond::invalid_request(
        "The upload's form could not be read to its end, so the requests of its batch were not read.",
        "invalid_form",
        request_id,
    )
}

/// The fields of a form (`multipart/form-data`), in order: each one's
/// headers and data; as many as read before an error.
pub(super) async fn fields(form: &Bytes, boundary: &str) -> (Vec<(HeaderMap, Bytes)>, bool) {
    let form = form.clone();
    let stream = futures_util::stream::iter([Ok::<_, std::convert::Infallible>(form)]);
    let mut multipart = multer::Multipart::new(stream, boundary);
    let mut fields = Vec::new();
    loop {
        match multipart.next_field().await {
            Ok(Some(field)) => {
                let headers = field.headers().clone();
                match field.bytes().await {
                    Ok(data) => fields.push((headers, data)),
                    Err(_) => return (fields, false),
                }
            }
            Ok(None) => return (fields, true),
            Err(_) => return (fields, false),
        }
    }
}

/// The name a form field's `Content-Disposition` gives it.
pub(super) fn field_name(headers: &HeaderMap) -> Option<&str> {
    let disposition = headers.get(header::CONTENT_DISPOSITION)?.to_str().ok()?;
    disposition.split(';').find_map(|part| {
        let value = part.trim().strip_prefix("name=")?;
        Some(value.trim_matches('"'))
    })
}

/// The value of a form's `purpose` field, when it has one.
fn purpose(fields: &[(HeaderMap, Bytes)]) -> Option<&[u8]> {
    let (_, data) = fields
        .iter()
        .find(|(headers, _)| field_name(headers) == Some("purpose"))?;
    Some(data.trim_ascii())
}

/// An upload form as it goes up: a batch's input with its requests
/// scanned (redacted in place) into `records`, refused when one is
/// blocked; any other form as it came. `headers` are the upload's.
async fn batch_input(
    records: &mut OutsideRecords<'_>,
    headers: &HeaderMap,
    form: Bytes,
    boundary: &str,
) -> Result<Bytes, Response<ProxyBody>> {
    let (state, request_id) = (records.state, records.request_id);
    let dialect = Dialect::OpenAi;
    let (mut fields, complete) = fields(&form, boundary).await;
    if purpose(&fields) != Some(b"batch") || !complete {
        // A broken form goes up as it came: the API answers it.
        return Ok(form);
    }
    let file = fields
        .iter_mut()
        .find(|(headers, _)| field_name(headers) == Some("file"));
    let Some((_, file)) = file else {
        return Ok(form);
    };
    let rules = state.rules.snapshot();
    let mut edits = Vec::new();
    // Every line is scanned and recorded; the first that refuses the
    // batch is named in the refusal.
    let mut refused = None;
    let mut at = 0;
    for (index, line) in file.split(|b| *b == b'\n').enumerate() {
        let offset = at;
        at += line.len() + 1;
        if line.trim_ascii().is_empty() {
            continue;
        }
        let request = match exchange::read_batch_input(line) {
            Ok(request) => request,
            Err(error) => {
                refused.get_or_insert_with(|| {
                    let what = format!("Line {} of the batch input", index + 1);
                    respond::unreadable(dialect, &error, Some(&what), request_id)
                });
                continue;
            }
        };
        match records.scan(&rules, headers, index + 1, &request) {
            Ok(found) => {
                let shift = |span: Range<usize>| span.start + offset..span.end + offset;
                edits.extend(found.into_iter().map(|(span, text)| (shift(span), text)));
            }
            Err(refusal) => {
                let place = format!("line {}", index + 1);
                refused.get_or_insert_with(|| refusal.respond(dialect, &place, request_id));
            }
        }
    }
    if let Some(refused) = refused {
        return Err(refused);
    }
    if edits.is_empty() {
        return Ok(form);
    }
    *file = json::splice(file, &edits);
    Ok(form_of(&fields, boundary, form.len()))
}

/// A form (`multipart/form-data`) of `fields`, about `size` bytes long.
pub(super) fn form_of(fields: &[(HeaderMap, Bytes)], boundary: &str, size: usize) -> Bytes {
    let mut out = BytesMut::with_capacity(size + 64);
    for (headers, data) in fields {
        out.extend_from_slice(format!("--{boundary}\r\n").as_bytes());
        for (name, value) in headers {
            out.extend_from_slice(name.as_str().as_bytes());
            out.extend_from_slice(b": ");
            out.extend_from_slice(value.as_bytes());
            out.extend_from_slice(b"\r\n");
        }
        out.extend_from_slice(b"\r\n");
        out.extend_from_slice(data);
        out.extend_from_slice(b"\r\n");
    }
    out.extend_from_slice(format!("--{boundary}--\r\n").as_bytes());
    out.freeze()
}

/// Texts a redaction rewrites: where each lies and its new value.
type Edits = Vec<(Range<usize>, String)>;

/// The records of a request read outside an exchange, each with what it
/// gives a model, its verdict and hits, and no answer (fairgate passes
/// that on unread, or a batch's comes in its results with a record of its
/// own): the request's own ([`OutsideRecords::begin`]: a token count, a
/// compaction, conversation items, a media request held whole), each of a
/// batch's requests read as it is created ([`OutsideRecords::scan`]), or
/// those a reader on the request's way up hands over
/// ([`OutsideRecords::on_the_way`]: a media form too large to hold, the
/// lines of a batch's input too large to hold, held on disk). They
/// end together with the status of the answer its client gets
/// ([`OutsideRecords::end`]); dropped before, with 499 (the client gone)
/// or 500 (a fault).
pub(super) struct OutsideRecords<'a> {
    state: &'a State,
    /// The fairgate request that read them.
    request_id: &'a str,
    started: Instant,
    dialect: Dialect,
    upstream: &'a str,
    read: Vec<(RecordDraft, Verdict)>,
    /// The records a reader on the request's way up makes, once it has
    /// read the request ([`OutsideRecords::on_the_way`]).
    later: Option<oneshot::Receiver<Late>>,
    /// When the request went upstream, once it has.
    sent: Option<Instant>,
    /// Records held on disk (a batch's input read on its way up, the
    /// parts of one sent in parts).
    held: Vec<HeldRecords>,
}

/// Where a reader on a request's way up hands its records over.
pub(super) type LateRecords = oneshot::Sender<Late>;

/// What a reader on a request's way up hands over: the request's record,
/// or the held records of a batch's requests.
pub(super) enum Late {
    One(Box<(RecordDraft, Verdict)>),
    Held(HeldRecords),
}

/// Hands `late` over to the request that read it; if the request is gone
/// (its client left while it was read), ends it with 499, as an
/// exchange's record says.
pub(super) fn hand_over(state: &State, to: LateRecords, late: Late) {
    match to.send(late) {
        Ok(()) => {}
        Err(Late::One(read)) => read.0.finish_unanswered(state, &read.1, 499, None),
        Err(Late::Held(held)) => held.end(Answered {
            status: 499,
            upstream: None,
            upstream_request_id: None,
        }),
    }
}

impl<'a> OutsideRecords<'a> {
    pub(super) fn new(
        state: &'a State,
        (dialect, upstream): (Dialect, &'a str),
        (request_id, started): (&'a str, Instant),
    ) -> OutsideRecords<'a> {
        OutsideRecords {
            state,
            request_id,
            started,
            dialect,
            upstream,
            read: Vec::new(),
            later: None,
            sent: None,
            held: Vec::new(),
        }
    }

    /// The fairgate request that read them.
    pub(super) fn request_id(&self) -> &'a str {
        self.request_id
    }

    /// Records held on disk, to end with the others.
    pub(super) fn hold(&mut self, held: HeldRecords) {
        self.held.push(held);
    }

    /// The record of the request itself, read as `route`: what `request`
    /// (sent with `headers`) gives a model, as its scan found it. Under
    /// the request's id; a second under `<id>.2`, and so on.
    fn begin(
        &mut self,
        route: &'static str,
        (headers, request): (&HeaderMap, &BatchRequest),
        (texts, verdict): (guard::RequestTexts, Verdict),
    ) {
        let read_as = (route, self.dialect, self.upstream);
        // A second one (two configurations in a Realtime call's form) is
        // `<id>.2`: a record's id is its own.
        let id = match self.read.len() + 1 {
            1 => self.request_id.to_owned(),
            number => format!("{}.{number}", self.request_id),
        };
        let draft = RecordDraft::outside(read_as, (headers, request), texts, (&id, self.started));
        self.read.push((draft, verdict));
    }

    /// Begins the record of the request itself, read as `route`, from its
    /// `scan` ([`OutsideRecords::begin`]); or, when a rule blocks it, the
    /// refusal its client gets (naming `place`), the records ended with
    /// it.
    pub(super) fn record(
        &mut self,
        scan: guard::RequestScan,
        route: &'static str,
        (headers, request, place): (&HeaderMap, &BatchRequest, &str),
    ) -> Result<(), Box<Response<ProxyBody>>> {
        let refusal = Refusal::of_block(request, &scan.verdict.hits, scan.verdict.decision);
        self.begin(route, (headers, request), (scan.texts, scan.verdict));
        match refusal {
            Some(refusal) => {
                let refused = refusal.respond(self.dialect, place, self.request_id);
                Err(Box::new(self.refused(refused)))
            }
            None => Ok(()),
        }
    }

    /// Where a reader of the request on its way up (a media form, or a
    /// batch's input, too large to hold) hands over its records
    /// ([`hand_over`]): they end with the others.
    pub(super) fn on_the_way(&mut self) -> LateRecords {
        let (recorded, later) = oneshot::channel();
        self.later = Some(later);
        recorded
    }

    /// One request of the batch, the `number`th (from 1), scanned as a
    /// prompt and counted: its redactions, or why it refuses the batch
    /// when it is blocked. Its record is kept to end with the others.
    fn scan(
        &mut self,
        rules: &RuleSet,
        headers: &HeaderMap,
        number: usize,
        request: &BatchRequest,
    ) -> Result<Edits, Refusal> {
        let id = format!("{}.{number}", self.request_id);
        let read_as = (REQUESTS, self.dialect, self.upstream);
        let of = (headers, request);
        let (draft, scan) = scan_drafted(self.state, rules, read_as, of, (&id, self.started));
        let verdict = scan.verdict;
        let refusal = Refusal::of_block(request, &verdict.hits, verdict.decision);
        self.read.push((draft, verdict));
        match refusal {
            Some(refusal) => Err(refusal),
            None => Ok(scan.edits),
        }
    }

    /// Ends the records with the status the request was answered with,
    /// and the upstream's id of it from `headers`, when it answered.
    pub(super) fn end(&mut self, status: u16, headers: Option<&HeaderMap>) {
        if let Some(mut later) = self.later.take()
            && let Ok(late) = later.try_recv()
        {
            match late {
                Late::One(read) => self.read.push(*read),
                Late::Held(held) => self.held.push(held),
            }
        }
        let upstream = self.sent.map(|sent| sent.elapsed());
        let upstream_request_id = headers.and_then(super::upstream_request_id);
        for (mut draft, verdict) in self.read.drain(..) {
            draft.upstream_request_id = upstream_request_id.clone();
            draft.finish_unanswered(self.state, &verdict, status, upstream);
        }
        for held in self.held.drain(..) {
            let upstream_request_id = upstream_request_id.clone();
            held.end(Answered {
                status,
                upstream,
                upstream_request_id,
            });
        }
    }

    /// `refused`, the answer that refuses the request, the records ended
    /// with it.
    pub(super) fn refused(&mut self, refused: Response<ProxyBody>) -> Response<ProxyBody> {
        self.end(refused.status().as_u16(), None);
        refused
    }

    /// Sends the request on as `answer` does, then ends the records with
    /// the answer its client gets (its status, and the upstream's id of
    /// the request among its headers).
    pub(super) async fn answered_with(
        &mut self,
        answer: impl Future<Output = Response<ProxyBody>>,
    ) -> Response<ProxyBody> {
        self.sent = Some(Instant::now());
        let answer = answer.await;
        self.end(answer.status().as_u16(), Some(answer.headers()));
        answer
    }
}

impl Drop for OutsideRecords<'_> {
    fn drop(&mut self) {
        if self.read.is_empty() && self.later.is_none() && self.held.is_empty() {
            return;
        }
        // As an exchange's record is ended by a fault, or by its client
        // leaving (499, as nginx logs it).
        let status = match std::thread::panicking() {
            true => 500,
            false => {
                let request_id = self.request_id;
                tracing::info!(
                    request_id,
                    "the client closed the request before its answer"
                );
                499
            }
        };
        self.end(status, None);
    }
}

/// What a refusal names: the members its texts were read from, in
/// order, each once (a block has at least one).
pub(super) fn place(names: &[&'static str]) -> String {
    let mut named: Vec<&str> = Vec::new();
    for name in names {
        if !named.contains(name) {
            named.push(name);
        }
    }
    named.join(" and ")
}

/// Reads a JSON body's texts that reach a model outside an exchange, and
/// the place a refusal names them by.
pub(super) type ReadTexts = for<'a> fn(&'a [u8]) -> Result<(BatchRequest<'a>, String), ReadError>;

/// Sends on a request with a JSON body (read as JSON whatever its content
/// type says: the API may) once the texts `read` finds in it are scanned:
/// refused when blocked (in `dialect`), redacted in place. It goes to the
/// upstream its path and model route it to, and its answer carries the
/// verdict (`x-fairgate-verdict`), as an exchange's does. Its record
/// ([`recorded`]) has its texts, verdict and status, and no answer.
pub(super) async fn send_scanned(
    state: &Arc<State>,
    (req, dialect): (Request<Incoming>, Dialect),
    route: &'static str,
    read: ReadTexts,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let limit = state.config.guard.max_body_bytes;
    let body = match ReadRequest::of(state, req, (dialect, limit), request_id).await {
        Ok(body) => body,
        Err(answer) => return answer,
    };
    let (request, place) = match read(&body.bytes) {
        Ok(read) => read,
        Err(error) => return respond::unreadable(dialect, &error, None, request_id),
    };
    let upstream = match body.upstream(state, request.params.model.as_deref(), request_id) {
        Ok(upstream) => upstream,
        Err(answer) => return *answer,
    };
    let rules = state.rules.snapshot();
    let scan = scan_recorded(state, &rules, &upstream, route, &request, request_id);
    let sent = scan.redacted(&body.bytes);
    let verdict = Some(scan.verdict.decision.as_str());
    let read_as = (route, dialect, upstream.as_str());
    let of = (&body.parts.headers, &request, place.as_str());
    let mut records = match recorded(state, scan, read_as, of, (request_id, started)) {
        Ok(records) => records,
        Err(refused) => return *refused,
    };
    let sent = sent.unwrap_or_else(|| body.bytes.clone());
    let answer = async {
        match body.send(state, (&upstream, sent), false).await {
            Ok((response, timeout)) => super::stream_back(response, timeout, request_id, verdict),
            Err(failure) => respond::failure(dialect, failure, request_id),
        }
    };
    records.answered_with(answer).await
}

/// The record of a request read outside an exchange, begun from its
/// `scan` ([`OutsideRecords::begin`]), to end with the answer; or, when a
/// rule blocks it, the refusal its client gets (naming `place`), its
/// record ended with it.
pub(super) fn recorded<'a>(
    state: &'a State,
    scan: guard::RequestScan,
    (route, dialect, upstream): (&'static str, Dialect, &'a str),
    (headers, request, place): (&HeaderMap, &BatchRequest, &str),
    (request_id, started): (&'a str, Instant),
) -> Result<OutsideRecords<'a>, Box<Response<ProxyBody>>> {
    let mut records = OutsideRecords::new(state, (dialect, upstream), (request_id, started));
    records.record(scan, route, (headers, request, place))?;
    Ok(records)
}

/// A request read outside an exchange (`of`: it, and the headers it came
/// with) scanned as a prompt by [`scan_recorded`] under its record's
/// route and `id`, and the draft of that record (`read_as`: its route,
/// dialect and upstream; from `started`), which takes the scan's texts.
pub(super) fn scan_drafted(
    state: &State,
    rules: &RuleSet,
    read_as: (&'static str, Dialect, &str),
    (headers, request): (&HeaderMap, &BatchRequest),
    (id, started): (&str, Instant),
) -> (RecordDraft, guard::RequestScan) {
    let (route, _, upstream) = read_as;
    let mut scan = scan_recorded(state, rules, upstream, route, request, id);
    let texts = std::mem::take(&mut scan.texts);
    let draft = RecordDraft::outside(read_as, (headers, request), texts, (id, started));
    (draft, scan)
}

/// A request's texts scanned as a prompt sent outside an exchange, and
/// counted under `route`, a block with the 400 that refuses it. Such a
/// request leaves a record ([`OutsideRecords`]), which puts a block in
/// the dashboard's log.
pub(super) fn scan_recorded(
    state: &State,
    rules: &RuleSet,
    upstream: &str,
    route: &'static str,
    request: &BatchRequest,
    request_id: &str,
) -> guard::RequestScan {
    let guard = &state.config.guard;
    let texts = &request.params.texts;
    let scan = guard::scan_request(rules, &state.config.risk, &guard.context_tags, texts);
    let scanned_in = ScannedIn {
        route,
        upstream,
        model: request.params.model.as_deref(),
        request_id,
        scope: Scope::Prompt,
        status: Some(400),
        logged: false,
    };
    count(state, scanned_in, &scan.verdict);
    scan
}

/// Why a request refuses its whole batch: what the 400 says of it.
#[derive(Debug, Clone)]
pub(super) struct Refusal {
    custom_id: Option<String>,
    scope: &'static str,
    reason: String,
    rules: Vec<String>,
}

impl Refusal {
    /// The refusal of a request whose verdict is `decision`, if it blocks.
    pub(super) fn of_block(
        request: &BatchRequest,
        hits: &[Hit],
        decision: Decision,
    ) -> Option<Refusal> {
        (decision == Decision::Block).then(|| Refusal {
            custom_id: request.custom_id.as_deref().map(str::to_owned),
            scope: guard::block_scope(hits, Scope::Prompt),
            reason: block_message(hits),
            rules: rule_ids(hits),
        })
    }

    /// The refusal of a request read on its way up, whose body cannot
    /// be edited, if `verdict` refuses it: a block, or a redaction (the
    /// refusal saying `why` that refuses it).
    pub(super) fn of_uneditable(
        request: &BatchRequest,
        verdict: &Verdict,
        why: &str,
    ) -> Option<Refusal> {
        match verdict.decision {
            Decision::Redact => Some(Refusal {
                custom_id: request.custom_id.as_deref().map(str::to_owned),
                scope: Scope::Prompt.as_str(),
                reason: why.to_owned(),
                rules: rule_ids(&verdict.hits),
            }),
            decision => Refusal::of_block(request, &verdict.hits, decision),
        }
    }

    /// The 400 that refuses the batch for this request, at `place`.
    pub(super) fn respond(
        &self,
        dialect: Dialect,
        place: &str,
        request_id: &str,
    ) -> Response<ProxyBody> {
        let named = match &self.custom_id {
            Some(id) => format!("{place} (custom_id {id:?})"),
            None => place.to_owned(),
        };
        let message = match named.as_str() {
            "" => self.reason.clone(),
            named => format!("{named}: {}", self.reason),
        };
        tracing::info!(request_id, named, rules = ?self.rules, "batch request refused");
        respond::blocked(dialect, self.scope, &message, &self.rules, request_id)
    }
}

/// Creates a message batch whose requests the rules allow; each request
/// leaves a record ([`OutsideRecords`]).
async fn create(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let dialect = Dialect::Anthropic;
    let origin = client_origin(req.headers(), req.uri());
    let limit = state.config.guard.max_batch_bytes;
    let read = match ReadRequest::of(state, req, (dialect, limit), request_id).await {
        Ok(read) => read,
        Err(answer) => return answer,
    };
    let requests = match exchange::read_batch(&read.bytes) {
        Ok(requests) => requests,
        Err(error) => return respond::unreadable(dialect, &error, None, request_id),
    };
    // Its requests name models of their own: routed by its path.
    let upstream = match read.upstream(state, None, request_id) {
        Ok(upstream) => upstream,
        Err(answer) => return *answer,
    };
    let rules = state.rules.snapshot();
    let mut records = OutsideRecords::new(state, (dialect, &upstream), (request_id, started));
    let mut edits = Vec::new();
    // Every request is scanned and recorded; the first blocked one is
    // named in the refusal.
    let mut refused = None;
    for (index, request) in requests.iter().enumerate() {
        match records.scan(&rules, &read.parts.headers, index + 1, request) {
            Ok(found) => edits.extend(found),
            Err(refusal) => {
                refused.get_or_insert_with(|| {
                    refusal.respond(dialect, &format!("requests.{index}"), request_id)
                });
            }
        }
    }
    if let Some(refused) = refused {
        return records.refused(refused);
    }
    let body = match edits.is_empty() {
        true => read.bytes.clone(),
        false => json::splice(&read.bytes, &edits),
    };
    let answer = async {
        match read.send(state, (&upstream, body), true).await {
            Ok((response, timeout)) => {
                let relayed = Relayed {
                    upstream: upstream.clone(),
                    stream_mode: None,
                    response,
                    timeout,
                };
                with_results_here(state, relayed, origin, request_id).await
            }
            Err(failure) => respond::failure(dialect, failure, request_id),
        }
    };
    records.answered_with(answer).await
}

/// Relays batch objects with their `results_url` leading to the proxy.
async fn objects(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let origin = client_origin(req.headers(), req.uri());
    match super::relay(state, req, Dialect::Anthropic, request_id, true).await {
        Ok(relayed) => with_results_here(state, relayed, origin, request_id).await,
        Err(out) => out,
    }
}

/// The scheme and authority by which the client reached the proxy:
/// `X-Forwarded-Proto` and `X-Forwarded-Host` where a proxy in front of it
/// sets them, else plain HTTP and `Host`.
fn client_origin(headers: &HeaderMap, uri: &Uri) -> Option<String> {
    let first = |name: &str| {
        let value = headers.get(name)?.to_str().ok()?;
        let first = value.split(',').next()?.trim();
        (!first.is_empty()).then_some(first)
    };
    let host = first("x-forwarded-host")
        .or_else(|| first(header::HOST.as_str()))
        .or_else(|| uri.authority().map(|a| a.as_str()))?;
    let scheme = first("x-forwarded-proto").unwrap_or("http");
    Some(format!("{scheme}://{host}"))
}

/// A batch object, or a list of them, relayed with each `results_url`
/// leading to `origin`, the proxy as the client reached it.
async fn with_results_here(
    state: &State,
    relayed: Relayed,
    origin: Option<String>,
    request_id: &str,
) -> Response<ProxyBody> {
    let Relayed {
        upstream,
        response,
        timeout,
        ..
    } = relayed;
    let dialect = Dialect::Anthropic;
    let config = state.config.upstreams.get(&upstream);
    let (Some(origin), Some(config)) = (origin, config) else {
        return super::stream_back(response, timeout, request_id, None);
    };
    if super::is_encoded(response.headers()) {
        // Asked for uncompressed: a body that is not could not be rewritten.
        return super::upstream_broken(state, &upstream, "encoded", dialect, request_id);
    }
    let (head, body) = response.into_parts();
    let limit = state.config.guard.max_response_bytes;
    let body = match upstream::read_body(body, limit, timeout).await {
        Ok(body) => body,
        Err(error) => {
            tracing::warn!(%error, "batch object could not be read");
            return super::upstream_broken(state, &upstream, "body", dialect, request_id);
        }
    };
    let body = results_here(body, config.url.trim_end_matches('/'), &origin);
    let body = respond::full(body);
    super::guarded_response(head.status, head.headers, body, request_id, None)
}

/// `body` with the `results_url` of its batch object, or of each in its
/// `data`, at `origin`: the upstream's `base` (or whatever scheme and host
/// the URL has) replaced. The body as it was when none changes.
fn results_here(body: Bytes, base: &str, origin: &str) -> Bytes {
    if memchr::memmem::find(&body, b"\"results_url\"").is_none() {
        return body;
    }
    let Ok(mut value) = serde_json::from_slice::<Value>(&body) else {
        return body;
    };
    let mut changed = false;
    let mut point = |object: &mut Value| {
        let Some(Value::String(url)) = object.get_mut("results_url") else {
            return;
        };
        let path = match url.strip_prefix(base) {
            Some(path) => path.to_owned(),
            None => match url.parse::<Uri>() {
                Ok(uri) => uri.path_and_query().map_or("/", |p| p.as_str()).to_owned(),
                Err(_) => return,
            },
        };
        *url = format!("{origin}{path}");
        changed = true;
    };
    point(&mut value);
    if let Some(data) = value.get_mut("data").and_then(Value::as_array_mut) {
        data.iter_mut().for_each(point);
    }
    match changed {
        true => Bytes::from(value.to_string()),
        false => body,
    }
}

/// Relays a batch's results (or a file that may be a batch's output) line
/// by line, each answer as the guard allows.
async fn results(
    state: &Arc<State>,
    req: Request<Incoming>,
    dialect: Dialect,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let client = ClientMeta::read(req.headers(), None);
    let Relayed {
        upstream,
        response,
        timeout,
        ..
    } = match super::relay(state, req, dialect, request_id, true).await {
        Ok(relayed) => relayed,
        Err(out) => return out,
    };
    if !response.status().is_success() {
        return super::stream_back(response, timeout, request_id, None);
    }
    let (head, body) = response.into_parts();
    if super::is_encoded(&head.headers) {
        return super::upstream_broken(state, &upstream, "encoded", dialect, request_id);
    }
    let lines = Lines {
        rules: state.rules.snapshot(),
        state: state.clone(),
        upstream,
        dialect,
        request_id: request_id.to_owned(),
        // Anthropic's results are a batch's; a file tells by its first line.
        reading: (dialect == Dialect::Anthropic).then_some(true),
        pending: Vec::new(),
        fetch: Fetch {
            started,
            started_ms: now_ms() - started.elapsed().as_millis() as i64,
            client,
            upstream_request_id: super::upstream_request_id(&head.headers),
            status: head.status.as_u16(),
        },
        lines: 0,
    };
    let chunks = upstream::body_stream(body, timeout);
    let body = futures_util::stream::unfold(Some((lines, chunks)), |state| async move {
        let (mut lines, mut chunks) = state?;
        loop {
            let out = match chunks.next().await {
                Some(Ok(chunk)) => lines.push(chunk),
                Some(Err(error)) => Err(error),
                None => return lines.finish().map(|out| (out.map(Frame::data), None)),
            };
            match out {
                Ok(out) if out.is_empty() => continue,
                Ok(out) => return Some((Ok(Frame::data(out)), Some((lines, chunks)))),
                Err(error) => return Some((Err(error), None)),
            }
        }
    });
    let body = StreamBody::new(body).boxed_unsync();
    super::guarded_response(head.status, head.headers, body, request_id, None)
}

/// A batch's results as they arrive: the part of a line not yet whole, and
/// what is known of the body.
struct Lines {
    state: Arc<State>,
    rules: Arc<RuleSet>,
    upstream: String,
    dialect: Dialect,
    request_id: String,
    /// Whether the lines are a batch's and read: unknown until a file's
    /// first line tells; `false` passes the rest as it comes.
    reading: Option<bool>,
    pending: Vec<u8>,
    /// What the answers' records have of the fetch.
    fetch: Fetch,
    /// The lines read so far: the number of an answer's record.
    lines: usize,
}

/// The fetch of a batch's results, as the records of its answers give it.
struct Fetch {
    started: Instant,
    started_ms: i64,
    client: ClientMeta,
    upstream_request_id: Option<String>,
    /// The status the client got.
    status: u16,
}

impl Lines {
    /// The lines `chunk` completes, as the guard allows.
    fn push(&mut self, chunk: Bytes) -> Result<Bytes, BoxError> {
        if self.reading == Some(false) {
            return Ok(chunk);
        }
        self.pending.extend_from_slice(&chunk);
        let mut out = Vec::new();
        let mut start = 0;
        while let Some(end) = memchr::memchr(b'\n', &self.pending[start..]) {
            let line = start..start + end + 1;
            start = line.end;
            let pending = std::mem::take(&mut self.pending);
            let read = self.line(&pending[line], &mut out);
            self.pending = pending;
            read?;
            if self.reading == Some(false) {
                break;
            }
        }
        self.pending.drain(..start);
        let undecided = self.reading.is_none();
        if self.reading == Some(false)
            || undecided && self.pending.first().is_some_and(|b| *b != b'{')
        {
            // Not a batch's lines: the rest as it came.
            self.reading = Some(false);
            out.append(&mut self.pending);
        } else if self.pending.len() > self.state.config.guard.max_response_bytes {
            if !undecided {
                return Err(self.broken("a line longer than guard.max_response_bytes"));
            }
            self.reading = Some(false);
            out.append(&mut self.pending);
        }
        Ok(Bytes::from(out))
    }

    /// The last line, if the body does not end with a line break.
    fn finish(&mut self) -> Option<Result<Bytes, BoxError>> {
        if self.pending.is_empty() {
            return None;
        }
        let pending = std::mem::take(&mut self.pending);
        if self.reading == Some(false) {
            return Some(Ok(Bytes::from(pending)));
        }
        let mut out = Vec::new();
        Some(self.line(&pending, &mut out).map(|()| Bytes::from(out)))
    }

    /// One line (its line break included), as the guard allows.
    fn line(&mut self, line: &[u8], out: &mut Vec<u8>) -> Result<(), BoxError> {
        self.lines += 1;
        let text_end = line.len()
            - line
                .iter()
                .rev()
                .take_while(|b| **b == b'\n' || **b == b'\r')
                .count();
        let (text, ending) = line.split_at(text_end);
        if text.trim_ascii().is_empty() {
            out.extend_from_slice(line);
            return Ok(());
        }
        match exchange::read_batch_line(self.dialect, text) {
            Ok(read) if self.reading.is_some() || read.batch => {
                self.reading = Some(true);
                match read.answer {
                    Some(answer) => {
                        out.extend_from_slice(&self.answer(text, read.custom_id, answer))
                    }
                    None => out.extend_from_slice(text),
                }
                out.extend_from_slice(ending);
            }
            Err(error) if self.reading.is_some() => {
                tracing::warn!(%error, "a line of a batch's results is not JSON");
                return Err(self.broken("a line that is not JSON"));
            }
            _ => {
                self.reading = Some(false);
                out.extend_from_slice(line);
            }
        }
        Ok(())
    }

    /// A line whose answer is scanned: as it came, redacted, or refused;
    /// its record goes to the side queue.
    fn answer(&self, line: &[u8], custom_id: Option<Cow<str>>, answer: BatchAnswer) -> Bytes {
        let read = Instant::now();
        let state = &self.state;
        let id = format!("{}.{}", self.request_id, self.lines);
        let scanned = guard::scan_response(&self.rules, line, &answer.texts, None);
        let verdict = risk::assess(&state.config.risk, scanned.hits, &[]);
        let scanned_in = ScannedIn {
            route: RESULTS,
            upstream: &self.upstream,
            model: answer.model.as_deref(),
            request_id: &id,
            scope: Scope::Response,
            status: Some(self.fetch.status),
            // The record puts a block there.
            logged: false,
        };
        count(state, scanned_in, &verdict);
        let out = match verdict.decision {
            Decision::Block => self.refused(line, &answer, &verdict.hits, &id),
            _ => scanned
                .redacted
                .unwrap_or_else(|| Bytes::copy_from_slice(line)),
        };
        let draft = RecordDraft {
            request_id: id,
            started: self.fetch.started,
            started_ms: self.fetch.started_ms,
            route: RESULTS,
            dialect: self.dialect,
            upstream: self.upstream.clone(),
            upstream_request_id: self.fetch.upstream_request_id.clone(),
            model: answer.model.map(Cow::into_owned),
            stream: false,
            custom_id: custom_id.map(Cow::into_owned),
            client: self.fetch.client.clone(),
            prompt: Vec::new(),
            context: Vec::new(),
        };
        // fairgate's share is this line's reading; the rest of the time
        // since the fetch began went to the upstream's sending the lines.
        let proxy = read.elapsed();
        let upstream = self.fetch.started.elapsed().saturating_sub(proxy);
        let ending = Ending {
            verdict: &verdict,
            response: scanned.texts,
            context: scanned.context,
            status: self.fetch.status,
            upstream: Some(upstream),
            proxy,
            usage: answer.usage.map(Usage::from_json_text),
            stream_end: None,
        };
        draft.finish(state, ending);
        out
    }

    /// A line whose answer a rule blocks, turned into the refusal its
    /// request would have got, or (`on_block: error`) a failed request.
    /// `id` is the answer's record's.
    fn refused(&self, line: &[u8], answer: &BatchAnswer, hits: &[Hit], id: &str) -> Bytes {
        let message = block_message(hits);
        let ids = rule_ids(hits);
        tracing::info!(request_id = id, rules = ?ids, "batch answer blocked");
        // The line was read as JSON already.
        let mut value: Value = serde_json::from_slice(line).unwrap_or_default();
        let error = || respond::blocked_body(self.dialect, "response", &message, &ids, id);
        match (self.dialect, self.state.config.guard.on_block) {
            (Dialect::Anthropic, OnBlock::Refusal) => {
                refuse(&mut value["result"]["message"], answer, &message)
            }
            (Dialect::OpenAi, OnBlock::Refusal) => {
                refuse(&mut value["response"]["body"], answer, &message)
            }
            // As a request of the batch that failed.
            (Dialect::Anthropic, OnBlock::Error) => {
                value["result"] = json!({"type": "errored", "error": error()});
            }
            (Dialect::OpenAi, OnBlock::Error) => {
                value["response"]["status_code"] = json!(400);
                value["response"]["body"] = error();
            }
        }
        Bytes::from(value.to_string())
    }

    /// The error that ends the body, counted.
    fn broken(&self, what: &str) -> BoxError {
        self.state
            .metrics
            .upstream_errors
            .with_label_values(&[&self.upstream, "malformed"])
            .inc();
        format!("the batch's results hold {what}").into()
    }
}

/// Turns a batch line's answer into its refusal.
fn refuse(value: &mut Value, answer: &BatchAnswer, message: &str) {
    if !value.is_object() {
        *value = json!({});
    }
    respond::refuse_in_place(answer.endpoint, value, message);
}

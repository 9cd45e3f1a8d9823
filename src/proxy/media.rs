//! Requests that ask a model to make an image, a video or speech, or to
//! transcribe audio ([`exchange::makes_media`]), which would otherwise be
//! a way around the rules: the words an image model is told to draw are a
//! prompt as much as a chat's. What they tell the model
//! ([`exchange::MEDIA_TEXTS`]: `prompt`, speech's `input` and
//! `instructions`) is scanned as a prompt before they go up.
//!
//! - A JSON body (an image's generation, speech, a video's remix): those
//!   strings at its top level. It is read whole, up to
//!   `guard.max_body_bytes` (else 413), as a guarded request's is.
//! - A form (an image's edit, a video, a transcription): every field of
//!   those names, as text. A form of at most `guard.max_body_bytes` is
//!   read whole. A larger one (an image or an audio file of many
//!   megabytes) goes up as it arrives, its fields read on the way; its
//!   last piece goes only once they are allowed, so a refused form never
//!   arrives whole (a text itself longer than the limit: 413). A form
//!   that does not read to its end is refused (`invalid_form`): what the
//!   API would read of it cannot be told.
//!
//! A block answers with the 400 of a blocked prompt, its message naming
//! the field. A redaction rewrites the text in place; in a form sent on
//! as it arrives, which cannot be edited, it refuses the request as a
//! block does. The answer (an image, audio, a video job, a transcript)
//! passes as it comes. A request leaves a record with no response
//! ([`batch::OutsideRecords`]): one read on its way once its form is read,
//! ended with the status its client got (499 when the client left first).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use http::{HeaderMap, Request, Response};
use hyper::body::Incoming;
use tokio::sync::mpsc;

use super::batch::{self, Held, HeldForm, Late, LateRecords, OutsideRecords, Refusal};
use super::respond;
use super::{ProxyBody, State};
use crate::exchange::{self, BatchRequest, Dialect, MEDIA_TEXTS, Text};
use crate::rules::Scope;

/// The route label of media requests, in metrics.
const ROUTE: &str = crate::record::unread_answer::MEDIA;

/// Sends a media request on as the rules allow.
pub(super) async fn handle(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    match batch::form_boundary(req.headers()) {
        Some(boundary) => form(state, req, boundary, request_id).await,
        None => {
            let read: batch::ReadTexts = |body| {
                let (request, names) = exchange::read_media_request(body)?;
                Ok((request, batch::place(&names)))
            };
            batch::send_scanned(state, (req, Dialect::OpenAi), ROUTE, read, request_id).await
        }
    }
}

/// A request with a form: held whole when it is small enough, else read on
/// its way up.
async fn form(
    state: &Arc<State>,
    req: Request<Incoming>,
    boundary: String,
    request_id: &str,
) -> Response<ProxyBody> {
    let started = Instant::now();
    let limit = state.config.guard.max_body_bytes;
    let held = match HeldForm::of(state, req, request_id).await {
        Ok(held) => held,
        Err(answer) => return answer,
    };
    let upstream = held.upstream.as_str();
    let mut form = match held.held {
        Held::Whole(form) => form,
        Held::Start(start, rest) => {
            let (copies, pieces) = mpsc::channel(8);
            let dialect = Dialect::OpenAi;
            let mut records =
                OutsideRecords::new(state, (dialect, upstream), (request_id, started));
            let judged = {
                let recorded = records.on_the_way();
                let (state, upstream, request_id) =
                    (state.clone(), upstream.to_owned(), request_id.to_owned());
                let headers = held.parts.headers.clone();
                async move {
                    let texts = read_texts(pieces, boundary, limit).await;
                    let read = (&headers, request_id.as_str(), started);
                    judge_on_the_way(&state, &upstream, texts, read, recorded)
                }
            };
            let sent = (&held.parts, start, rest);
            let to = (upstream, held.headers);
            let answer = batch::send_judged(state, sent, to, copies, judged, request_id);
            return records.answered_with(answer).await;
        }
    };
    let (mut fields, complete) = batch::fields(&form, &boundary).await;
    if !complete {
        return unreadable_form(request_id);
    }
    let texts: Vec<FormText> = (fields.iter().enumerate())
        .filter_map(|(field, (headers, data))| {
            let name = media_text(batch::field_name(headers)?)?;
            let text = String::from_utf8_lossy(data).into_owned();
            Some(FormText { field, name, text })
        })
        .collect();
    let (request, place) = as_request(&texts);
    let rules = state.rules.snapshot();
    let mut scan = batch::scan_recorded(state, &rules, upstream, ROUTE, &request, request_id);
    let edits = std::mem::take(&mut scan.edits);
    let verdict = Some(scan.verdict.decision.as_str());
    let read_as = (ROUTE, Dialect::OpenAi, upstream);
    let of = (&held.parts.headers, &request, place.as_str());
    let mut records = match batch::recorded(state, scan, read_as, of, (request_id, started)) {
        Ok(records) => records,
        Err(refused) => return *refused,
    };
    if !edits.is_empty() {
        for (span, text) in edits {
            fields[span.start].1 = Bytes::from(text);
        }
        form = batch::form_of(&fields, &boundary, form.len());
    }
    let body = super::upstream::whole(form);
    let uri = &held.parts.uri;
    let answer = async {
        let method = http::Method::POST;
        match super::forward(state, upstream, method, uri, held.headers, body).await {
            Ok((response, timeout)) => super::stream_back(response, timeout, request_id, verdict),
            Err(failure) => respond::failure(Dialect::OpenAi, failure, request_id),
        }
    };
    records.answered_with(answer).await
}

/// The name of [`MEDIA_TEXTS`] that a form field's `name` is, if any.
fn media_text(name: &str) -> Option<&'static str> {
    MEDIA_TEXTS.into_iter().find(|text| *text == name)
}

/// A text of a form ([`MEDIA_TEXTS`]).
struct FormText {
    /// Its field's index in the form.
    field: usize,
    name: &'static str,
    text: String,
}

/// A form's texts as a request to scan, with the place a refusal names
/// them by. A text's span is its field's index: a redaction rewrites the
/// field whole.
fn as_request(texts: &[FormText]) -> (BatchRequest<'_>, String) {
    let found = texts.iter().map(|form_text| Text {
        scope: Scope::Prompt,
        text: form_text.text.as_str().into(),
        span: form_text.field..form_text.field + 1,
        whole: false,
        definition: false,
        continues: false,
    });
    let request = BatchRequest::of_texts(found.collect());
    let names: Vec<&'static str> = texts.iter().map(|text| text.name).collect();
    (request, batch::place(&names))
}

/// Why a form read on its way is not read whole.
enum Unread {
    /// It does not read to its end.
    Broken,
    /// A text is longer than `guard.max_body_bytes`.
    TooLong,
}

/// The texts of a form read as its pieces arrive.
async fn read_texts(
    mut pieces: mpsc::Receiver<Bytes>,
    boundary: String,
    limit: usize,
) -> Result<Vec<FormText>, Unread> {
    let stream = futures_util::stream::poll_fn(move |cx| pieces.poll_recv(cx));
    let mut form = multer::Multipart::new(super::lines::OnePieceAPoll::new(stream), boundary);
    let mut texts = Vec::new();
    let mut field = 0;
    // Every piece is read to the end, so that the copies keep flowing.
    let mut readable = true;
    loop {
        match form.next_field().await {
            Ok(Some(mut found)) => {
                let name = found.name().and_then(media_text);
                let mut value = Vec::new();
                loop {
                    match found.chunk().await {
                        Ok(Some(chunk)) if name.is_some() => {
                            readable &= value.len() + chunk.len() <= limit;
                            if readable {
                                value.extend_from_slice(&chunk);
                            }
                        }
                        Ok(Some(_)) => {}
                        Ok(None) => break,
                        Err(_) => return Err(Unread::Broken),
                    }
                }
                if let Some(name) = name {
                    let text = String::from_utf8_lossy(&value).into_owned();
                    texts.push(FormText { field, name, text });
                }
                field += 1;
            }
            Ok(None) if readable => return Ok(texts),
            Ok(None) => return Err(Unread::TooLong),
            Err(_) => return Err(Unread::Broken),
        }
    }
}

/// The 400 that refuses a form read on its way, if anything refuses it: a
/// text a rule blocks or redacts (what went up cannot be edited), or a
/// form that could not be read (a text too long to hold: 413). A form
/// read hands its record over to `recorded` (`read`: the request's
/// headers, id and start).
fn judge_on_the_way(
    state: &State,
    upstream: &str,
    texts: Result<Vec<FormText>, Unread>,
    (headers, request_id, started): (&HeaderMap, &str, Instant),
    recorded: LateRecords,
) -> Option<Response<ProxyBody>> {
    let texts = match texts {
        Ok(texts) => texts,
        Err(Unread::Broken) => return Some(unreadable_form(request_id)),
        Err(Unread::TooLong) => {
            let too_large = respond::Failure::TooLarge;
            return Some(respond::failure(Dialect::OpenAi, too_large, request_id));
        }
    };
    let (request, place) = as_request(&texts);
    let rules = state.rules.snapshot();
    let read_as = (ROUTE, Dialect::OpenAi, upstream);
    let of = (headers, &request);
    let (draft, scan) = batch::scan_drafted(state, &rules, read_as, of, (request_id, started));
    let why = "it holds text the content policy redacts, and a form larger than this gateway holds goes up as it arrives, so it cannot be edited; redact the text before sending it.";
    let refusal = Refusal::of_uneditable(&request, &scan.verdict, why);
    batch::hand_over(state, recorded, Late::One(Box::new((draft, scan.verdict))));
    refusal.map(|refusal| refusal.respond(Dialect::OpenAi, &place, request_id))
}

fn unreadable_form(request_id: &str) -> Response<ProxyBody> {
    respond::invalid_request(
        "The form could not be read to its end, so what it asks the model to make was not read.",
        "invalid_form",
        request_id,
    )
}

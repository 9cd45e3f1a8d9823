//! A batch's input read line by line on its way upstream, for the files
//! fairgate does not hold whole: a part of an upload in parts
//! ([`super::parts`]), and an upload to `/v1/files` larger than
//! `guard.max_body_bytes` ([`super::batch`]).
//!
//! The form goes upstream as it arrives ([`tee`]), each piece copied to a
//! reader on a blocking thread ([`read`]), which splits the file's field
//! into lines and scans every line whole within it. What comes before the
//! first line break and after the last is kept, for [`check`] to scan with
//! the lines around it; what comes before the first line break is read
//! then too when it is a request of its own (a part that begins with a
//! line), so that the records of a part no completion takes hold it. A
//! file that went up cannot be edited, so a line that a rule redacts
//! refuses the batch, as one it blocks does.
//!
//! Each line read is recorded as a batch's request read whole is
//! ([`LineRecords`]), its record held on disk until the answer of the
//! request that makes the file ends it ([`super::held`]).

use std::sync::Arc;
use std::time::Instant;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, Response};
use http_body_util::{BodyExt, Either, StreamBody};
use hyper::body::Frame;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;

use super::batch::{Refusal, scan_drafted};
use super::held::HeldRecords;
use super::respond::{self, Failure};
use super::{BoxError, ProxyBody, State, upstream};
use crate::exchange::{self, BatchRequest, Dialect};
use crate::json::ReadError;
use crate::record::BATCH_REQUESTS;
use crate::risk::Verdict;
use crate::rules::RuleSet;

/// The largest piece of a body a reader is given at once.
const PIECE: usize = 64 << 10;

/// Why a batch's input with a line to redact is refused.
const UNEDITABLE: &str = "it holds text the content policy redacts, and a file read on its way up (sent in parts, or larger than this gateway holds) cannot be edited; redact it before uploading, or upload it whole with POST /v1/files.";

/// What was read of one file, or one part of it.
#[derive(Debug, Default)]
pub(super) struct Part {
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
    /// When the bytes before its first line break are a request of their
    /// own (the file's first line, or a part's that begins with a line: a
    /// piece of a line is never a whole request), recorded as its line 1:
    /// the refusal that line makes, if any.
    head_read: Option<Option<Refused>>,
    /// A line, or a head or tail, longer than `guard.max_body_bytes`.
    too_long: bool,
    /// The form could not be read to its end, or had no one file field.
    pub unread: bool,
}

/// Why a line refuses the batch.
#[derive(Debug, Clone)]
enum Refused {
    /// It is not a request (not JSON, or a key given twice).
    Unreadable(ReadError),
    Rules(Refusal),
}

/// What [`read`] found in a form.
pub(super) struct Read {
    pub part: Part,
    /// The value of the form's `purpose` field, when it has one.
    pub purpose: Option<Vec<u8>>,
    /// The records of the lines read.
    pub records: LineRecords,
}

/// The records of a batch's requests in a file, or a part of one, read on
/// its way up, each numbered by its line in it as a file read whole is
/// (`fg-….3`, line 3; a part's renumbered once its place in the file is
/// known), and held until the answer of the request that makes the file.
pub(super) struct LineRecords {
    /// The upload's headers, for its client's metadata.
    headers: HeaderMap,
    held: HeldRecords,
}

impl LineRecords {
    /// The records of the upload that arrived at `started` with `headers`.
    pub(super) fn new(state: Arc<State>, headers: HeaderMap, started: Instant) -> LineRecords {
        let held = HeldRecords::new(state, started);
        LineRecords { headers, held }
    }

    /// Scans `request`, the line `number` of the upload `request_id`, as
    /// a prompt, counted and held under its record's id.
    fn scan(
        &mut self,
        (state, rules, upstream): (&State, &RuleSet, &str),
        request: &BatchRequest,
        (request_id, number): (&str, usize),
    ) -> Verdict {
        let id = format!("{request_id}.{number}");
        let read_as = (BATCH_REQUESTS, Dialect::OpenAi, upstream);
        let of = (&self.headers, request);
        let started = self.held.started();
        let (draft, scan) = scan_drafted(state, rules, read_as, of, (&id, started));
        self.held.hold(number, draft, &scan.verdict);
        scan.verdict
    }

    pub(super) fn into_held(self) -> HeldRecords {
        self.held
    }
}

/// Starts reading a form whose file is in the field `field`: the pieces
/// sent to the returned sender are read on a blocking thread (scanning a
/// part of 64 MB takes long), until the sender is dropped. The lines are
/// recorded in `records`.
pub(super) fn read(
    state: &Arc<State>,
    upstream: &str,
    (boundary, field): (String, &'static str),
    request_id: &str,
    records: LineRecords,
) -> (mpsc::Sender<Bytes>, JoinHandle<Read>) {
    let (copies, pieces) = mpsc::channel(8);
    let read_by = (state.clone(), upstream.to_owned());
    let reader = LineReader::new(read_by, request_id.to_owned(), records);
    let runtime = tokio::runtime::Handle::current();
    let reading = tokio::task::spawn_blocking(move || {
        runtime.block_on(read_form(reader, pieces, boundary, field))
    });
    (copies, reading)
}

/// The client's body as it goes upstream, each piece of it copied to
/// `copies` first (waiting for room there: the reader keeps pace). With
/// `allow`, the last piece is held until it says yes, and the body fails
/// instead when it says no: the upstream never gets a refused file whole.
pub(super) fn tee(
    frames: impl Stream<Item = Result<Frame<Bytes>, BoxError>> + Send + Sync + Unpin + 'static,
    copies: mpsc::Sender<Bytes>,
    allow: Option<oneshot::Receiver<bool>>,
) -> upstream::UpstreamBody {
    struct Tee<S> {
        frames: futures_util::stream::Fuse<S>,
        copies: Option<mpsc::Sender<Bytes>>,
        held: Option<Frame<Bytes>>,
        allow: Option<oneshot::Receiver<bool>>,
    }
    let hold = allow.is_some();
    let tee = Tee {
        frames: frames.fuse(),
        copies: Some(copies),
        held: None,
        allow,
    };
    let stream = futures_util::stream::unfold(tee, move |mut tee| async move {
        loop {
            match tee.frames.next().await {
                Some(Ok(frame)) => {
                    if let (Some(data), Some(copies)) = (frame.data_ref(), &tee.copies) {
                        // In pieces the reader's form parser copies one at
                        // a time (the start held, up to
                        // `guard.max_body_bytes`, is one frame). A reader
                        // that gave up leaves the file unread.
                        for at in (0..data.len()).step_by(PIECE) {
                            let piece = data.slice(at..data.len().min(at + PIECE));
                            if copies.send(piece).await.is_err() {
                                break;
                            }
                        }
                    }
                    if !hold {
                        return Some((Ok(frame), tee));
                    }
                    if let Some(held) = tee.held.replace(frame) {
                        return Some((Ok(held), tee));
                    }
                }
                Some(Err(error)) => return Some((Err(error), tee)),
                None => {
                    // The reader sees the end.
                    tee.copies = None;
                    let allow = tee.allow.take()?;
                    return match allow.await {
                        Ok(true) => tee.held.take().map(|frame| (Ok(frame), tee)),
                        _ => Some((Err("the batch's input is refused".into()), tee)),
                    };
                }
            }
        }
    });
    upstream::Upload::new(Either::Right(BodyExt::boxed(StreamBody::new(stream))))
}

/// Reads the file in `field` of a form, and its `purpose`, as the pieces
/// arrive.
async fn read_form(
    mut reader: LineReader,
    mut pieces: mpsc::Receiver<Bytes>,
    boundary: String,
    field: &str,
) -> Read {
    let pieces = OnePieceAPoll::new(futures_util::stream::poll_fn(move |cx| {
        pieces.poll_recv(cx)
    }));
    let mut form = multer::Multipart::new(pieces, boundary);
    let (mut files, mut purpose) = (0, None);
    let whole = loop {
        match form.next_field().await {
            Ok(Some(mut found)) => {
                let name = found.name().unwrap_or_default().to_owned();
                files += usize::from(name == field);
                let mut value = Vec::new();
                loop {
                    match found.chunk().await {
                        Ok(Some(chunk)) if name == field => reader.feed(&chunk),
                        // A purpose is a word: what is longer is not one.
                        Ok(Some(chunk)) if name == "purpose" && value.len() < 64 => {
                            value.extend_from_slice(&chunk)
                        }
                        Ok(Some(_)) => {}
                        Ok(None) | Err(_) => break,
                    }
                }
                if name == "purpose" {
                    purpose = Some(value.trim_ascii().to_vec());
                }
            }
            Ok(None) => break true,
            Err(_) => break false,
        }
    };
    let (mut part, records) = reader.finish();
    part.unread |= !whole || files != 1;
    Read {
        part,
        purpose,
        records,
    }
}

/// A stream that gives one item per poll: after each item it answers "not
/// yet" once (and asks to be polled again), so that an item and the
/// stream's end never come out of one poll.
///
/// multer 3.1 reads its stream until it is pending or ended, and while it
/// looks for the form's first boundary it may do so twice in one poll:
/// when the second read brings the rest of the form and the end together,
/// it sees the end and reports the form incomplete without looking at what
/// that read brought (rwf2/multer#70). Under load, about one form in ten
/// arrived that way, and a batch's input was refused as unread.
pub(super) struct OnePieceAPoll<S> {
    stream: S,
    /// Whether the last poll gave an item.
    gave: bool,
}

impl<S> OnePieceAPoll<S> {
    pub(super) fn new(stream: S) -> Self {
        OnePieceAPoll {
            stream,
            gave: false,
        }
    }
}

impl<S: Stream<Item = Bytes> + Unpin> Stream for OnePieceAPoll<S> {
    type Item = Result<Bytes, std::convert::Infallible>;

    fn poll_next(
        mut self: std::pin::Pin<&mut Self>,
        cx: &mut std::task::Context<'_>,
    ) -> std::task::Poll<Option<Self::Item>> {
        if std::mem::take(&mut self.gave) {
            cx.waker().wake_by_ref();
            return std::task::Poll::Pending;
        }
        let next = std::pin::Pin::new(&mut self.stream).poll_next(cx);
        self.gave = matches!(next, std::task::Poll::Ready(Some(_)));
        next.map(|item| item.map(Ok))
    }
}

/// Splits a file into lines and scans each one whole within it.
struct LineReader {
    state: Arc<State>,
    rules: Arc<RuleSet>,
    upstream: String,
    /// The upload that sends the form.
    request_id: String,
    part: Part,
    /// The line being read.
    line: Vec<u8>,
    records: LineRecords,
}

impl LineReader {
    fn new(
        (state, upstream): (Arc<State>, String),
        request_id: String,
        records: LineRecords,
    ) -> LineReader {
        let rules = state.rules.snapshot();
        LineReader {
            state,
            rules,
            upstream,
            request_id,
            part: Part::default(),
            line: Vec::new(),
            records,
        }
    }

    fn feed(&mut self, mut data: &[u8]) {
        while let Some(at) = memchr::memchr(b'\n', data) {
            self.keep(&data[..at]);
            let line = std::mem::take(&mut self.line);
            match self.part.head {
                None => {
                    self.read_head(&line);
                    self.part.head = Some(line);
                }
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

    /// Scans and records the bytes before the first line break as line 1
    /// when they are a request of their own ([`Part::head_read`]): the
    /// records of a part no completion takes then hold it too.
    fn read_head(&mut self, head: &[u8]) {
        if self.part.too_long {
            return;
        }
        let Ok(request) = exchange::read_batch_input(head) else {
            return;
        };
        let read_by = (&*self.state, &*self.rules, self.upstream.as_str());
        let recorded = (&mut self.records, 1);
        self.part.head_read = Some(read_line(read_by, &request, &self.request_id, recorded));
    }

    /// Scans a line whole within the file, and records it (the first
    /// refusal is kept).
    fn check(&mut self, line: &[u8]) {
        if self.part.too_long {
            return;
        }
        let index = self.part.lines;
        let read_by = (&*self.state, &*self.rules, self.upstream.as_str());
        // The first line is the file's head: this is line 2 on.
        let recorded = (&mut self.records, index + 2);
        if let Some(refused) = refusal(read_by, line, &self.request_id, recorded) {
            self.part.refused.get_or_insert((index, refused));
        }
    }

    fn finish(mut self) -> (Part, LineRecords) {
        self.part.tail = self.line;
        (self.part, self.records)
    }
}

/// What refuses a batch in `line` of its input, if anything does. The
/// line is recorded in `records` under its number.
fn refusal(
    read_by: (&State, &RuleSet, &str),
    line: &[u8],
    request_id: &str,
    (records, number): (&mut LineRecords, usize),
) -> Option<Refused> {
    if line.trim_ascii().is_empty() {
        return None;
    }
    match exchange::read_batch_input(line) {
        Ok(request) => read_line(read_by, &request, request_id, (records, number)),
        Err(error) => Some(Refused::Unreadable(error)),
    }
}

/// What refuses a batch in `request`, line `number` of its input, if
/// anything does; the line is recorded in `records`.
fn read_line(
    read_by: (&State, &RuleSet, &str),
    request: &BatchRequest,
    request_id: &str,
    (records, number): (&mut LineRecords, usize),
) -> Option<Refused> {
    let verdict = records.scan(read_by, request, (request_id, number));
    Refusal::of_uneditable(request, &verdict, UNEDITABLE).map(Refused::Rules)
}

/// The number of each part's first line in the file of `parts` in order
/// (the line its first line break ends), or `None` for a part without a
/// line break: as [`check`] counts them.
pub(super) fn head_lines(parts: &[&Part]) -> Vec<Option<usize>> {
    let mut lines = 0;
    let head = |part: &&Part| {
        part.head.as_ref()?;
        lines += 1;
        let head = lines;
        lines += part.lines;
        Some(head)
    };
    parts.iter().map(head).collect()
}

/// Reads a batch's input from its parts in order (a file read whole is one
/// part), each with whether its records end with this reading's (a part
/// named twice has them once): the lines across parts, and the first
/// and last, are scanned here, and recorded in `records`; those within
/// one were as it went up, and so was a part's first line when the part
/// begins with it ([`Part::head_read`]). The 400 of the first line that
/// refuses the batch, if one does. Parts must have been read whole (see
/// [`Part::unread`]).
pub(super) fn check(
    read_by: (&State, &RuleSet, &str),
    parts: &[(&Part, bool)],
    request_id: &str,
    records: &mut LineRecords,
) -> Option<Response<ProxyBody>> {
    let state = read_by.0;
    let dialect = Dialect::OpenAi;
    let limit = state.config.guard.max_body_bytes;
    let refuse = |refused: &Refused, line: usize| match refused {
        Refused::Unreadable(error) => {
            let what = format!("Line {line} of the batch input");
            respond::unreadable(dialect, error, Some(&what), request_id)
        }
        Refused::Rules(refusal) => refusal.respond(dialect, &format!("line {line}"), request_id),
    };
    // The line begun in earlier parts, and the number of lines before it.
    let (mut carry, mut lines) = (Vec::new(), 0);
    // Every line is scanned and recorded; the first that refuses the
    // batch is named in the refusal.
    let mut first = None;
    for &(part, recorded) in parts {
        let too_large = || respond::failure(dialect, Failure::TooLarge, request_id);
        if part.too_long {
            return Some(first.unwrap_or_else(too_large));
        }
        if let Some(head) = &part.head {
            // The part's first line when nothing but blanks comes before
            // it: read and recorded with the part. (After a line begun in
            // an earlier part, the two make a line that is no request,
            // which refuses the batch: the part's record of it stays.)
            let read =
                (part.head_read.as_ref()).filter(|_| recorded && carry.trim_ascii().is_empty());
            carry.extend_from_slice(head);
            lines += 1;
            let refused = match read {
                Some(read) => read.clone(),
                None => refusal(read_by, &carry, request_id, (records, lines)),
            };
            if let Some(refused) = refused {
                first.get_or_insert_with(|| refuse(&refused, lines));
            }
            carry.clear();
            if let Some((index, refused)) = &part.refused {
                first.get_or_insert_with(|| refuse(refused, lines + 1 + index));
            }
            lines += part.lines;
        }
        carry.extend_from_slice(&part.tail);
        if carry.len() > limit {
            return Some(first.unwrap_or_else(too_large));
        }
    }
    if let Some(refused) = refusal(read_by, &carry, request_id, (records, lines + 1)) {
        first.get_or_insert_with(|| refuse(&refused, lines + 1));
    }
    first
}

#[cfg(test)]
mod tests {
    use std::task::Poll;

    use bytes::Bytes;

    use super::OnePieceAPoll;

    const FORM: &str = "--XyZ\r\ncontent-disposition: form-data; name=\"data\"; filename=\"data\"\r\n\r\n{\"custom_id\":\"first\"}\n\r\n--XyZ--\r\n";

    /// A stream that is not ready when first polled, then gives the whole
    /// form and ends at once: the order in which a form's pieces came to
    /// multer under load when it judged them incomplete.
    fn late_form() -> impl futures_util::Stream<Item = Bytes> + Unpin {
        let mut polls = 0;
        futures_util::stream::poll_fn(move |cx| {
            polls += 1;
            match polls {
                1 => {
                    cx.waker().wake_by_ref();
                    Poll::Pending
                }
                2 => Poll::Ready(Some(Bytes::from_static(FORM.as_bytes()))),
                _ => Poll::Ready(None),
            }
        })
    }

    #[tokio::test]
    async fn a_form_whose_last_piece_comes_with_its_end_is_read_whole() {
        let mut form = multer::Multipart::new(OnePieceAPoll::new(late_form()), "XyZ");
        let mut field = form.next_field().await.unwrap().unwrap();
        assert_eq!(field.name(), Some("data"));
        assert_eq!(
            field.chunk().await.unwrap().unwrap(),
            "{\"custom_id\":\"first\"}\n"
        );
        assert_eq!(field.chunk().await.unwrap(), None);
        drop(field);
        assert!(form.next_field().await.unwrap().is_none());
    }
}

//! The guard of streamed (SSE) responses.
//!
//! # What each mode guarantees
//!
//! * **`holdback`** (default): the text of the response is released to the
//!   client only up to where a match of some response rule may be under
//!   way: a point from which the rules' patterns, run over the text
//!   since, could still match as more text comes (a phrase half written,
//!   a secret whose regex has no end). The search for such points reads
//!   the patterns without their word boundaries, so it may hold back more
//!   than needed, never less ([`crate::rules::RuleSet::open_match_start`]).
//!   Text is also never released inside a word that normalization may
//!   still join with what follows: it is released up to a space after a
//!   word of two letters or more in any script, or after a mark (the
//!   danda । of Hindi too), or, in CJK text, which has no spaces, after a
//!   sentence mark such as 。. Should the search give up (more than 16 KB
//!   unreleased, or walks too long), text is held back by the longest
//!   match the rules can make, plus 256 bytes. A match therefore begins in
//!   text not yet released, so **no text that a rule would block, not even
//!   its first word, reaches the client, however the upstream chunks
//!   it**. The text is re-framed: the client gets well-formed deltas that
//!   need not line up with the upstream's (a chat completion chunk, or a
//!   Responses API text delta, carries the `logprobs` entries of the
//!   upstream chunks whose text it completes, but for redacted text; a
//!   chat chunk, the running `usage` of the last of them, when the
//!   upstream puts one on every chunk, see `RunningUsage`). An
//!   OpenAI text chunk is the upstream's first one with only its text
//!   changed, when that one is plain (see `plain_text`); else it is
//!   rebuilt from it (with the `role` of the chunk that began the text,
//!   when it gave one). A chunk
//!   with both text and its finish is read as two (see `split_finish`),
//!   the finish held until the choice's text is over. On a block the
//!   stream ends as the SDKs expect: OpenAI, a chunk with
//!   `finish_reason: "content_filter"` and `data: [DONE]` (when the
//!   client asked for usage, the upstream is read on, unsent, for up to
//!   10 s until its usage chunk, which goes out before `[DONE]`; a stream
//!   of several choices, `n` > 1, is guarded choice by choice, each a text
//!   of its own, and a block ends every choice not yet finished; a chunk
//!   that carries several choices is read, and sent, as a chunk of each
//!   (see `split_choices`), in every mode but monitor; a stream that goes
//!   back to a tool call, content block, item or part it had left, which
//!   the SDKs would gather apart from what the guard read with it, or
//!   starts a Responses API item or content part again (whose deltas the
//!   SDKs would join to the first one's text), is malformed, see
//!   `Reached`);
//!   Anthropic, `content_block_stop`, a `message_delta` with
//!   `stop_reason: "refusal"` (its `stop_details` explained by the rule's
//!   message), and `message_stop`, after a `message_start` (content
//!   emptied) when the client has not had one: a start that carried
//!   content (which the API never sends; the SDKs' helpers would show
//!   it) is held, its text read as the answer's, and so is a tool's block
//!   whose start carries its input (which the API sends empty, and the
//!   helpers keep when no delta follows). Redactions apply before
//!   release. A part's end sends all of its text; should the upstream
//!   go on with a part it ended (a chat choice's text after its finish, a
//!   content block's after its stop, a Responses API part's after its
//!   `.done`), which the SDKs join to it, the text is read joined too,
//!   and a redaction that begins in what went out blocks. *Cost*: text
//!   that no match may cover goes out at the next
//!   check; a phrase that a rule would block if it went on waits until it
//!   ends or turns harmless. A check rescans a window of the longest
//!   match plus 256 bytes (or back to the release point, if further),
//!   not the whole response, and looks for matches under way in the text
//!   not yet released, once every 64 bytes of new text
//!   (not on every word-sized delta): text is released, and a block found,
//!   at most 64 bytes later than a check per delta would. Events that
//!   arrive in one read from the upstream are checked once, after the
//!   last of them: their frames leave together anyway.
//! * **`buffer`**: nothing is sent until the upstream has finished and the
//!   whole response is scanned; then the stream is replayed (redacted) or
//!   replaced by the block ending. Guarantees the same, and also that the
//!   client never sees a partial answer; *cost*: time to first token becomes
//!   the whole generation time.
//! * **`monitor`**: every event passes through untouched as it arrives;
//!   hits are counted and recorded only. *Cost*: none; guarantees nothing.
//!
//! Text the guard cannot re-frame (tool-call arguments and refusals,
//! OpenAI, and a hosted shell's commands in the Responses API; a tool's
//! `input_json_delta`, Anthropic; reasoning: Anthropic `thinking` blocks,
//! whose signature covers their text, the Responses API's reasoning
//! summaries and text, the `reasoning_content` or `reasoning` of
//! OpenAI-compatible servers, Mistral's `thinking` parts of a chat
//! completion's content; the summary of an Anthropic compaction block,
//! signed too; the transcript of a chat completion's or a Responses API
//! answer's audio, with the audio that says it; a Responses API delta of
//! a kind the guard does not know) is response text too. In
//! `holdback` its events are held back as text is, but whole: an event
//! goes out unchanged, as it came, once all of its text lies before any
//! match under way (checked as text is: every delta of the first 64
//! bytes, then every 64 bytes; a block's start waits for its first
//! text), so long reasoning and calls stream. A call's arguments and a
//! tool's input are JSON the client's code reads parsed, so they are
//! read with their escapes decoded too: once one holds an escape (a
//! quote, a line break: code, a file), the held text is also kept
//! decoded, with an escape cut across two events decoded once it is
//! whole, and held back as the text as written is (which no longer tells
//! where a match is under way): an event goes out once its text lies
//! before any match under way in both. The
//! rest go out when the content block or the response ends (in a chat completion, which has no
//! blocks, when text follows), once all the text is scanned; or the stream
//! ends blocked, closing a thinking block whose start went out. Held
//! events never overtake text sent before them. Audio waits for its end:
//! a piece of audio may say words its transcript has not sent yet. Such
//! text cannot be redacted piece by piece (nor, signed, at all), so a
//! `redact` hit in it blocks. Other events (roles, usage, pings,
//! signatures) pass through in order, but behind held events still
//! unsent. An upstream that sends a malformed event, or breaks off
//! before the answer's final event (its connection lost, or its deadline
//! passed), or sends more than `guard.max_stream_bytes` (the guard keeps
//! the answer's text, and an event until its end comes), gets the held
//! text checked as at an end, then the API's error
//! event (`upstream_error`), and the error is counted: the client's SDK
//! raises, rather than take a cut answer for whole. The upstream's own
//! error event (an OpenAI chunk with an `error`, or vLLM's older
//! `{"object":"error"}` chunk, the Responses and Messages APIs' `error`
//! event) ends the stream the same way, in
//! holdback and buffer modes: the held text, checked as at an end, goes
//! out before it (the SDK shows it, then raises at the error), the error
//! as the upstream wrote it, and nothing after it; blocked, the stream
//! ends as a blocked one does. A fault of the
//! guard's own (a panic) ends the stream with the same event
//! (`internal_error`), the held text dropped.
//!
//! The Responses API's events repeat text: a part's `.done` event, the
//! finished output item and `response.completed` hold it whole. In
//! `holdback` a text part's end is its `response.output_text.done` (all
//! of the part's text is checked and released before it goes out) and an
//! output item's end is its `response.output_item.done`; an annotation
//! waits for the end of the part it points into; redacted text is
//! replaced wherever an event repeats it. Repeated text the stream never
//! carried (an upstream whose deltas and repetitions disagree), or that
//! no scan has read yet (an event of a kind the guard does not know,
//! which goes out with no check before it), is scanned on its own:
//! redacted in place, or the stream ends blocked; so does an event that
//! nests its texts deeper than the guard reads. Since
//! re-framing merges text events and a block adds one, the events'
//! `sequence_number`s are rewritten in the order sent. A blocked stream
//! ends with `response.incomplete` whose `incomplete_details.reason` is
//! `content_filter`, for the response the stream began with. Responses
//! API events are checked one by one, however the upstream's reads cut
//! them (other streams' events that arrive in one read are checked once,
//! after the last): what is sent, and how it is numbered, then follows
//! from the events alone. So a stream read again from its start is sent
//! as it was the first time, and a client that resumes a background
//! response's stream after the last event it got (`starting_after`, see
//! [`StreamSetup::resume_after`]) gets the rest of it, no more, no less.
//!
//! What a hosted or server tool gives the model during the answer comes
//! whole in one event: a Responses API item's start or end
//! (`response.output_item.added`, `.done`: an MCP call's output, the tools
//! an MCP server listed, a file search's results, a code interpreter's
//! logs, a shell's output; a shell's output streamed in
//! `response.shell_call_output_content.delta` events is held until its
//! `.done` event brings it whole), an Anthropic block's start
//! (`content_block_start` of an `mcp_tool_result`,
//! `web_fetch_tool_result`, `code_execution_tool_result`,
//! `advisor_tool_result` and the like, and of an `mcp_tool_listing`), as
//! does the title of a web page an OpenAI answer cites (a chat chunk's
//! `annotations`, `response.output_text.annotation.added`), and the text
//! that an Anthropic citation quotes from a document or a web page (its
//! `citations_delta`). It is scanned as
//! context when that event arrives. In `holdback` and `buffer` a `redact`
//! hit rewrites the text in the event (and where `response.completed`
//! repeats it); if a hit blocks, the event does not go out and the stream
//! ends blocked.
//!
//! An answer that continues a prefill (the request's last assistant
//! turn: Anthropic, or a chat completion of an OpenAI-compatible server
//! that continues one) is read after it, as the client shows it: the text
//! starts with the prefill, released already and scanned whole when the
//! stream starts. A match in the prefill, or one that begins there and
//! runs into the answer, stops the answer as any match does (holdback
//! looks for matches under way from as far back in the prefill as a
//! match can reach), but for a redaction wholly in the prefill, the
//! client's own text; a redaction that begins there blocks. Each choice
//! of a chat completion continues the prefill, with its text, not with
//! the reasoning held before it.
//!
//! Events are read as the client will read them ([`SseParser`]): a line
//! ends at `\r\n`, `\n` or `\r`, and a byte-order mark before the first
//! line, which the SSE standard's decoding drops, is dropped (the events
//! go out without it), so no event the client reads is one the guard
//! passed over. A line of a field no reader of the standard reads (any
//! but `event`, `data`, `id`, `retry` and comments) does not go out
//! either: a body of such lines is something else (a JSON answer
//! labelled as a stream), which a client that asked for no stream reads
//! as such, unguarded.

mod event;

use std::borrow::Cow;
use std::cell::OnceCell;
use std::collections::HashMap;
use std::fmt::Display;
use std::ops::Range;
use std::sync::Arc;
use std::time::{Duration, Instant};

use bytes::{Buf, Bytes, BytesMut};
use bytestring::ByteString;
use futures_util::{Stream, StreamExt};
use http_body::Frame;
use http_body_util::{BodyExt, StreamBody};
use jiter::Peek;
use serde::de::IgnoredAny;
use serde_json::{Map, Value, json};

use crate::config::StreamMode;
use crate::exchange::{self, Dialect, Endpoint};
use crate::json::{ReadError, Reader};
use crate::proxy::ProxyBody;
use crate::proxy::respond::{self, Failure};
use crate::record::{StreamEnd, Usage};
use crate::risk::{self, Decision, RiskConfig, Verdict};
use crate::rules::normalize::{Normalized, clean_point_at_or_before, clean_point_in};
use crate::rules::{Action, Hit, RuleSet, Scope, redact, redact_spans, redacted_spans};

use event::{Event, Shape, Text};

/// The most choices a stream may have (OpenAI's limit on `n`).
const MAX_CHOICES: usize = 128;

/// OpenAI's last event.
const DONE: &[u8] = b"data: [DONE]\n\n";

/// How long a blocked stream waits for the upstream's usage chunk.
const USAGE_WAIT: Duration = Duration::from_secs(10);

/// Text scanned again before the longest match, in bytes (and held back
/// beyond it, when the search for matches under way gives up).
const MARGIN: usize = 256;

/// The most unreleased text in which holdback looks for matches under way,
/// in bytes; past it, text is held `hold` bytes back instead.
const OPEN_SEARCH_MOST: usize = 16 << 10;

/// Holdback checks the text once this many bytes have arrived since the
/// last check (and at the end of each block and of the stream), so that
/// word-sized deltas do not each rescan the window. Until the answer (or
/// held text: reasoning, a call) is that long, it checks every delta: its
/// first words go out as soon as nothing may be under way in them.
const CHECK_STEP: usize = 64;

/// Everything the guard of one stream needs.
#[derive(Clone)]
pub struct StreamSetup {
    pub endpoint: Endpoint,
    pub mode: StreamMode,
    pub rules: Arc<RuleSet>,
    pub risk: RiskConfig,
    /// Hits of the request (prompt and context), for the total risk.
    pub request_hits: Vec<Hit>,
    pub relevance: Vec<f64>,
    /// When the exchange started, for time to first byte.
    pub started: Instant,
    /// The client asked for a usage chunk (OpenAI
    /// `stream_options.include_usage`).
    pub include_usage: bool,
    /// The text the answer continues (a prefill), empty when
    /// none: the client shows the answer after it, so a match the two
    /// make together counts.
    pub prefill: String,
    /// Responses API: the client resumes the stream after the event it
    /// got numbered so (`GET /v1/responses/{id}?stream=true&starting_after=N`).
    /// The upstream is read from the start, since the client's numbers
    /// are the guard's, not the upstream's: every event is guarded as
    /// before, and those numbered up to N are not sent again.
    pub resume_after: Option<u64>,
    /// The most bytes the upstream's stream may send
    /// (`guard.max_stream_bytes`): the guard keeps the answer's text to
    /// scan it whole, and an event whose end has not come. Past it the
    /// stream ends as one the upstream broke off does.
    pub max_bytes: usize,
}

/// How a stream ended.
pub struct StreamOutcome {
    pub verdict: Verdict,
    /// The whole response text the upstream sent, redacted.
    pub text: String,
    /// What hosted or server tools gave the model in the answer: the
    /// exchange's context too.
    pub context: Vec<String>,
    /// The upstream's `usage`, when the stream reported one.
    pub usage: Option<Usage>,
    /// Time spent in the guard itself (parsing, scanning, re-framing).
    pub guard_time: Duration,
    pub malformed: bool,
    pub upstream_failed: bool,
    /// The guard failed (a panic): the stream ended with an error event.
    pub faulted: bool,
    pub first_byte: Option<Duration>,
    /// How the stream ended, as its record says.
    pub end: StreamEnd,
}

/// Guards `upstream` (the upstream's body) and returns the body for the
/// client. `done` is called once the stream has ended, or once the client
/// has gone away (the body dropped before its end).
///
/// The guard runs inside the body's own poll, on the client connection's
/// task: each poll reads the upstream until it has frames for the client.
/// A task of its own, with a channel to the body, cost a spawn and a wake
/// of the connection for each chunk, and read ahead of a client that was
/// not reading.
pub fn guard_body<S, E>(
    setup: StreamSetup,
    upstream: S,
    done: impl FnOnce(StreamOutcome) + Send + 'static,
) -> ProxyBody
where
    S: Stream<Item = Result<Bytes, E>> + Send + Unpin + 'static,
    E: Display,
{
    let run = Run {
        guard: Guard::new(setup),
        parser: SseParser::default(),
        upstream,
        first_byte: None,
        guard_time: Duration::ZERO,
        ended: false,
        done: Some(done),
    };
    let frames = futures_util::stream::unfold(Some(run), |run| async move {
        use futures_util::FutureExt;
        let mut run = run?;
        let next = std::panic::AssertUnwindSafe(run.next_frame())
            .catch_unwind()
            .await;
        let frame = match next {
            Ok(frame) => frame?,
            Err(_) => {
                // A fault in the guard: what it held is dropped with it,
                // and the client gets an error in place of the rest. The
                // drop reports the outcome, fault noted.
                let ending = run.guard.fault_ending();
                drop(run);
                return Some((Ok(Frame::data(ending)), None));
            }
        };
        Some((
            Ok::<_, std::convert::Infallible>(Frame::data(frame)),
            Some(run),
        ))
    });
    StreamBody::new(frames)
        .map_err(|never| match never {})
        .boxed_unsync()
}

/// One guarded stream, as its body is polled. Dropped, at its end or when
/// the client goes away, it reports its outcome to `done`.
struct Run<S, F: FnOnce(StreamOutcome)> {
    guard: Guard,
    parser: SseParser,
    upstream: S,
    first_byte: Option<Duration>,
    guard_time: Duration,
    /// The stream has reached its end: what is left to give out is the
    /// usage ending of a blocked stream, if any.
    ended: bool,
    done: Option<F>,
}

impl<S, E, F> Run<S, F>
where
    S: Stream<Item = Result<Bytes, E>> + Unpin,
    E: Display,
    F: FnOnce(StreamOutcome),
{
    /// The next body frame for the client; `None` at the end. The frames of
    /// one upstream chunk go out as one body frame: each frame costs a pass
    /// through hyper's chunked encoder, more than copying a few events'
    /// bytes, and frames that are ready together change nothing for the
    /// client apart.
    async fn next_frame(&mut self) -> Option<Bytes> {
        while !self.ended {
            let mut frames = self.next_frames().await;
            if let Some(after) = self.guard.setup.resume_after {
                frames.retain_mut(|frame| unsent(frame, after));
            }
            let frame = match frames.len() {
                0 => continue,
                1 => frames.swap_remove(0),
                _ => Bytes::from(frames.concat()),
            };
            if self.first_byte.is_none() {
                self.first_byte = Some(self.guard.setup.started.elapsed());
            }
            return Some(frame);
        }
        None
    }

    /// The frames of the upstream's next chunk, or of the stream's end.
    async fn next_frames(&mut self) -> Vec<Bytes> {
        let guard = &mut self.guard;
        if guard.finished {
            self.ended = true;
            if !guard.awaiting_usage() {
                return Vec::new();
            }
            // Blocked, and the client asked for usage: read the upstream
            // on (sending nothing of it) until it reports usage, ends, or
            // USAGE_WAIT passes.
            let wait = tokio::time::sleep(USAGE_WAIT);
            tokio::pin!(wait);
            'drain: loop {
                let chunk = tokio::select! {
                    chunk = self.upstream.next() => chunk,
                    () = &mut wait => break,
                };
                let Some(Ok(chunk)) = chunk else { break };
                for event in self.parser.push(chunk) {
                    if guard.drain_event(&event) {
                        break 'drain;
                    }
                }
            }
            return guard.usage_ending();
        }
        match self.upstream.next().await {
            Some(Ok(chunk)) => {
                if guard.took(chunk.len()) {
                    return guard.oversized_ending();
                }
                let began = Instant::now();
                let mut frames = Vec::new();
                // Numbered events are framed the same whatever the reads
                // (see the module's doc).
                let defer = guard.setup.endpoint != Endpoint::Responses;
                guard.deferring = defer;
                for event in self.parser.push(chunk) {
                    if !guard.finished {
                        frames.extend(guard.on_event(event));
                    } else if guard.awaiting_usage() {
                        // The rest of the chunk may carry the usage.
                        guard.drain_event(&event);
                    }
                }
                if defer {
                    frames.extend(guard.deferred_check());
                }
                self.guard_time += began.elapsed();
                frames
            }
            Some(Err(error)) => {
                tracing::warn!(%error, "upstream stream failed");
                guard.broken_ending(&error)
            }
            None => {
                // The last event, if a `\r` that waited for the byte after
                // it ended it.
                let mut frames = match self.parser.finish() {
                    Some(event) if !guard.finished => guard.on_event(event),
                    _ => Vec::new(),
                };
                frames.extend(guard.on_end());
                frames
            }
        }
    }
}

impl<S, F: FnOnce(StreamOutcome)> Drop for Run<S, F> {
    fn drop(&mut self) {
        if !self.ended {
            tracing::debug!(
                "a stream ended before the upstream's end: the client went away, or a fault"
            );
        }
        if let Some(done) = self.done.take() {
            done(self.guard.outcome(self.first_byte, self.guard_time));
        }
    }
}

/// The first text delta of a Responses API content part, the template of
/// the deltas the guard writes in the part: with their type, a
/// `sequence_number` (rewritten as they go out) and their own `logprobs`
/// (the template's belong to its own text).
struct PartTemplate {
    part: u64,
    /// Its members, read from `first` when first needed.
    json: OnceCell<Map<String, Value>>,
    /// The delta it was made from, as it came (JSON).
    first: Option<String>,
    /// The frame of the template cut where its text goes: most deltas
    /// are the two with a text between (see [`PartTemplate::frame`]).
    around: Option<(String, String)>,
}

/// The members of a Responses API text delta (`stream_id` a socket's
/// lane).
const DELTA_MEMBERS: [&str; 9] = [
    "type",
    "item_id",
    "output_index",
    "content_index",
    "delta",
    "sequence_number",
    "logprobs",
    "obfuscation",
    "stream_id",
];

impl PartTemplate {
    /// The template of a part's deltas with `json`'s members (a part's
    /// start gives them).
    fn new(part: u64, json: Map<String, Value>) -> PartTemplate {
        let json = Self::delta_members(json);
        // No text holds NUL characters; the marker cannot occur otherwise.
        const MARKER: &str = "\0fairgate\0";
        let mut marked = json.clone();
        marked.insert("delta".into(), json!(MARKER));
        let frame = sse(Some("response.output_text.delta"), &Value::Object(marked));
        let frame = String::from_utf8_lossy(&frame);
        let around = frame
            .split_once(&json_text(&json!(MARKER)))
            .map(|(before, after)| (before.to_owned(), after.to_owned()));
        PartTemplate {
            part,
            json: OnceCell::from(json),
            first: None,
            around,
        }
    }

    /// The template of the part whose first delta is `data`, its text at
    /// `token`. A delta `plain` (no logprobs entries: its own tokens are
    /// not the template's), written on one line and numbered, as the APIs
    /// write deltas, with no member the API does not define, is cut
    /// around its text, its bytes kept as they came; any other is read as
    /// JSON, and keeps the API's members only.
    fn of_delta(part: u64, data: &str, token: &Range<usize>, plain: bool) -> PartTemplate {
        let one_line = memchr::memchr(b'\n', data.as_bytes()).is_none();
        // Every delta cut from the template carries its members: only the
        // API's, which hold no text but the delta's. (Read by their names
        // alone; a name with escapes is read as JSON.)
        let members = serde_json::from_str::<HashMap<&str, IgnoredAny>>(data);
        let only_the_apis = members.is_ok_and(|m| m.keys().all(|key| DELTA_MEMBERS.contains(key)));
        if !plain || !one_line || !only_the_apis || event::sequence_number(data).is_none() {
            let json: Map<String, Value> = serde_json::from_str(data).unwrap_or_default();
            let json = json
                .into_iter()
                .filter(|(key, _)| DELTA_MEMBERS.contains(&key.as_str()));
            return PartTemplate::new(part, json.collect());
        }
        let around = (
            format!(
                "event: response.output_text.delta\ndata: {}",
                &data[..token.start]
            ),
            format!("{}\n\n", &data[token.end..]),
        );
        PartTemplate {
            part,
            json: OnceCell::new(),
            first: Some(data.to_owned()),
            around: Some(around),
        }
    }

    /// A text delta's members, from the event's.
    fn delta_members(mut json: Map<String, Value>) -> Map<String, Value> {
        json.insert("type".into(), json!("response.output_text.delta"));
        json.entry("sequence_number").or_insert_with(|| json!(0));
        if json.contains_key("logprobs") {
            json.insert("logprobs".into(), json!([]));
        }
        json
    }

    fn members(&self) -> &Map<String, Value> {
        self.json.get_or_init(|| {
            let first = self.first.as_deref().unwrap_or("{}");
            Self::delta_members(serde_json::from_str(first).unwrap_or_default())
        })
    }

    /// The delta of `text`, with `logprobs`.
    fn frame(&self, text: &str, logprobs: Vec<Value>) -> Bytes {
        if let Some((before, after)) = &self.around
            && logprobs.is_empty()
        {
            return around(before, text, after);
        }
        let mut json = self.members().clone();
        json.insert("delta".into(), json!(text));
        json.insert("logprobs".into(), Value::Array(logprobs));
        sse(Some("response.output_text.delta"), &Value::Object(json))
    }
}

/// A frame of a template cut around its text: `before`, `text` as a JSON
/// string, `after`.
fn around(before: &str, text: &str, after: &str) -> Bytes {
    let mut frame = Vec::with_capacity(before.len() + text.len() + after.len() + 8);
    frame.extend_from_slice(before.as_bytes());
    // Writing a string into a Vec cannot fail.
    let _ = serde_json::to_writer(&mut frame, text);
    frame.extend_from_slice(after.as_bytes());
    Bytes::from(frame)
}

/// The entries of a Responses API text delta's `logprobs`, when it has
/// any: the API sends an empty list unless the client asked for them, and
/// the event is then not read again.
fn logprob_entries(data: &str) -> Option<Vec<Value>> {
    let key = memchr::memmem::find(data.as_bytes(), b"\"logprobs\"")?;
    let list = data[key + "\"logprobs\"".len()..].trim_start();
    let list = list.strip_prefix(':')?.trim_start().strip_prefix('[')?;
    if list.trim_start().starts_with(']') {
        return None;
    }
    let mut event: Map<String, Value> = serde_json::from_str(data).ok()?;
    match event.remove("logprobs") {
        Some(Value::Array(entries)) if !entries.is_empty() => Some(entries),
        _ => None,
    }
}

/// Whether `frame` keeps an event to send to a client that resumes after
/// event `after`: the events in it numbered up to `after` are taken out.
fn unsent(frame: &mut Bytes, after: u64) -> bool {
    let sent_before = |event: &SseEvent| {
        let data = event.data.as_deref().unwrap_or_default();
        event::sequence_number(data).is_some_and(|(number, _)| number <= after)
    };
    let mut parser = SseParser::default();
    let events: Vec<SseEvent> = parser.push(frame.clone()).collect();
    if !events.iter().any(sent_before) {
        return true;
    }
    let kept: Vec<Bytes> = events
        .into_iter()
        .filter(|e| !sent_before(e))
        .map(|e| e.raw)
        .collect();
    *frame = Bytes::from(kept.concat());
    !frame.is_empty()
}

/// The guard of a stream whose events come one by one, each its JSON, not
/// in an SSE body: a response of the Responses API's WebSocket mode. The
/// same guard as [`guard_body`]'s, event by event; what it gives out is
/// the JSON of each event to send.
pub struct EventGuard {
    guard: Guard,
    first_byte: Option<Duration>,
    guard_time: Duration,
}

impl EventGuard {
    pub fn new(setup: StreamSetup) -> EventGuard {
        EventGuard {
            guard: Guard::new(setup),
            first_byte: None,
            guard_time: Duration::ZERO,
        }
    }

    /// Takes one event (its JSON); returns the events to send.
    pub fn on_event(&mut self, data: &str) -> Vec<ByteString> {
        let began = Instant::now();
        let frames = if self.guard.finished {
            Vec::new()
        } else if self.guard.took(data.len()) {
            self.guard.oversized_ending()
        } else {
            match parse_event(sse_text(None, data)) {
                Some(event) => self.guard.on_event(event),
                None => Vec::new(),
            }
        };
        self.sent(frames, began)
    }

    /// The upstream's response is over (its last event taken, or the
    /// connection gone): the events still to send.
    pub fn on_end(&mut self) -> Vec<ByteString> {
        let began = Instant::now();
        let frames = self.guard.on_end();
        self.sent(frames, began)
    }

    /// The guard has ended the response: blocked, or at its end.
    pub fn finished(&self) -> bool {
        self.guard.finished
    }

    /// A fault of fairgate's own ends the response: the API's error event
    /// to send. What the guard held is dropped; the outcome says `Fault`.
    pub fn fault_ending(&mut self) -> Vec<ByteString> {
        let began = Instant::now();
        let frame = self.guard.fault_ending();
        self.sent(vec![frame], began)
    }

    pub fn outcome(&self) -> StreamOutcome {
        self.guard.outcome(self.first_byte, self.guard_time)
    }

    /// The data of `frames`, each an event.
    fn sent(&mut self, frames: Vec<Bytes>, began: Instant) -> Vec<ByteString> {
        let mut parser = SseParser::default();
        let events: Vec<ByteString> = frames
            .into_iter()
            .flat_map(|frame| {
                parser
                    .push(frame)
                    .filter_map(|e| e.data)
                    .collect::<Vec<_>>()
            })
            .collect();
        if self.first_byte.is_none() && !events.is_empty() {
            self.first_byte = Some(self.guard.setup.started.elapsed());
        }
        self.guard_time += began.elapsed();
        events
    }
}

/// One server-sent event. Its name and data are, in the forms the APIs
/// send, slices of `raw` (not copies).
#[derive(Debug, Clone)]
pub struct SseEvent {
    /// The event as received, with its blank line.
    pub raw: Bytes,
    pub event: Option<ByteString>,
    pub data: Option<ByteString>,
}

/// Splits a byte stream into events at blank lines.
#[derive(Default)]
pub struct SseParser {
    /// The start of an event whose end has not arrived yet; or, before
    /// `begun`, the stream's first bytes while they may be a byte-order
    /// mark's.
    buf: BytesMut,
    /// Past where a byte-order mark could stand.
    begun: bool,
}

/// The byte-order mark that the SSE standard's decoding drops from a
/// stream's start, as a client's UTF-8 decoder does (Node's `TextDecoder`,
/// which the Node SDKs read streams with). Before the first line it would
/// hide that line's field from a reader that keeps it: the guard drops it,
/// reads the event as such a client would, and sends it without the mark.
const BYTE_ORDER_MARK: &[u8] = b"\xef\xbb\xbf";

impl SseParser {
    /// The events that `chunk` completes, read one by one as they are
    /// taken. Events that lie whole in the chunk are split off it, not
    /// copied (an upstream that sends many events at once costs no copy,
    /// and no buffer of that size kept for the rest of the stream); only an
    /// event cut between chunks is put together in `buf`. Nor are they
    /// gathered in a vector first: an upstream's burst of hundreds of
    /// events grew one, copied at each doubling.
    pub fn push(&mut self, mut chunk: Bytes) -> Events<'_> {
        if !self.begun {
            let seen = self.buf.len();
            let more = (BYTE_ORDER_MARK.len() - seen).min(chunk.len());
            if chunk[..more] == BYTE_ORDER_MARK[seen..seen + more] {
                if seen + more < BYTE_ORDER_MARK.len() {
                    // All of the chunk may still be the mark's.
                    self.buf.extend_from_slice(&chunk);
                    chunk = Bytes::new();
                } else {
                    self.buf.clear();
                    chunk.advance(more);
                    self.begun = true;
                }
            } else {
                // No mark: what `buf` kept is the stream's.
                self.begun = true;
            }
        }
        let mut joined = None;
        if !self.buf.is_empty() {
            match self.end_across(&chunk) {
                Some(end) => {
                    self.buf.extend_from_slice(&chunk.split_to(end));
                    joined = Some(self.buf.split().freeze());
                }
                None => {
                    self.buf.extend_from_slice(&chunk);
                    chunk = Bytes::new();
                }
            }
        }
        Events {
            parser: self,
            joined,
            rest: chunk,
        }
    }

    /// The event left when the stream ends, when it ends with a blank
    /// line whose `\r` waited for the byte after it (see [`event_end`]):
    /// no `\n` can follow it now. Any other rest is an event cut short.
    pub fn finish(&mut self) -> Option<SseEvent> {
        if self.buf.last() != Some(&b'\r') {
            return None;
        }
        // Any byte but `\n` after the `\r` tells where the event ends.
        let mut closed = self.buf.to_vec();
        closed.push(b'.');
        let (end, _) = event_end(&closed)?;
        (end == self.buf.len()).then(|| read_event(self.buf.split().freeze(), Lines::Other))?
    }

    /// Where in `chunk` the event begun in `buf` ends, if it does. `buf`
    /// holds no end: one that runs into `chunk` starts on its last three
    /// bytes (`\r\n\r`, waiting for the byte after), and its last two
    /// are enough to find it, since a `\n` ends a line whatever is before.
    fn end_across(&self, chunk: &[u8]) -> Option<usize> {
        let tail = &self.buf[self.buf.len().saturating_sub(2)..];
        let mut seam = [0u8; 5];
        let head = chunk.len().min(3);
        seam[..tail.len()].copy_from_slice(tail);
        seam[tail.len()..tail.len() + head].copy_from_slice(&chunk[..head]);
        match event_end(&seam[..tail.len() + head]) {
            Some((end, _)) => Some(end.saturating_sub(tail.len())),
            None => event_end(chunk).map(|(end, _)| end),
        }
    }
}

/// The events a chunk completes ([`SseParser::push`]). Once dropped, what
/// follows the chunk's last complete event waits in the parser for the
/// next chunk; complete events not taken are dropped with it.
pub struct Events<'p> {
    parser: &'p mut SseParser,
    /// The event begun in earlier chunks that this one completes.
    joined: Option<Bytes>,
    /// The chunk from the next event on.
    rest: Bytes,
}

impl Iterator for Events<'_> {
    type Item = SseEvent;

    fn next(&mut self) -> Option<SseEvent> {
        if let Some(event) = self.joined.take().and_then(parse_event) {
            return Some(event);
        }
        while let Some((end, lines)) = event_end(&self.rest) {
            if let Some(event) = read_event(self.rest.split_to(end), lines) {
                return Some(event);
            }
        }
        None
    }
}

impl Drop for Events<'_> {
    fn drop(&mut self) {
        while let Some((end, _)) = event_end(&self.rest) {
            self.rest.advance(end);
        }
        self.parser.buf.extend_from_slice(&self.rest);
    }
}

/// The lines of an event, as the search for its end saw them: the forms
/// the APIs send, which are read without a second look for line ends.
#[derive(Debug, Clone, Copy, PartialEq)]
enum Lines {
    /// One line, ended by `\n` (and the blank line's `\n`), no `\r`.
    One,
    /// Two lines, the first ending at this `\n`, no `\r`: Anthropic's
    /// `event:` and `data:`.
    Two(usize),
    /// Any other: read line by line.
    Other,
}

/// What the events of Anthropic's stream that carry nothing but their
/// type (and a block's index) mean, known by their bytes as the API writes
/// them, without a read: `ping`, the start of a text block (empty, as the
/// API starts every one), `content_block_stop` and `message_stop`, four of
/// the six events of a message that are not text deltas. Every other
/// form of them (spaces, other members, a long index) is read in full.
fn anthropic_bare_kind(data: &str) -> Option<(Kind, Option<u64>)> {
    match data {
        r#"{"type": "ping"}"# | r#"{"type":"ping"}"# => return Some((Kind::Other, None)),
        r#"{"type":"message_stop"}"# => return Some((Kind::Done, None)),
        _ => {}
    }
    if let Some(rest) = data.strip_prefix(r#"{"type":"content_block_stop","index":"#) {
        let (block, rest) = bare_index(rest)?;
        return (rest == "}").then_some((Kind::BlockEnd, Some(block)));
    }
    let rest = data.strip_prefix(r#"{"type":"content_block_start","index":"#)?;
    let (block, rest) = bare_index(rest)?;
    let start = Kind::BlockStart {
        block,
        text: String::new(),
    };
    (rest == r#","content_block":{"type":"text","text":""}}"#).then_some((start, Some(block)))
}

/// The usage an Anthropic `message_delta` reports, when the event is as
/// the API writes it (the stop reason a plain string or `null`, no stop
/// sequence): known by its bytes but for the usage, which is read (checked
/// as JSON and taken as its text). The event means [`Kind::Final`]. `None`
/// for any other form, which is read in full.
fn anthropic_bare_message_delta(data: &str) -> Option<&str> {
    let rest = data.strip_prefix(r#"{"type":"message_delta","delta":{"stop_reason":"#)?;
    let reason = match rest.starts_with("null") {
        true => 4,
        false => event::plain_token(rest)?,
    };
    let rest = rest[reason..].strip_prefix(r#","stop_sequence":null},"usage":"#)?;
    let mut reader = crate::json::Reader::new(rest);
    let usage = reader.object_text().ok()??;
    (&rest[reader.jiter.current_index()..] == "}").then_some(usage)
}

/// The block index that `text` starts with, as a read would take it (a
/// JSON number: no leading zero; at most nine digits), and what follows.
fn bare_index(text: &str) -> Option<(u64, &str)> {
    let digits = text.bytes().take_while(u8::is_ascii_digit).count();
    let (index, rest) = text.split_at(digits);
    let number = matches!(index.as_bytes(), [b'0'] | [b'1'..=b'9', ..]);
    match number && digits <= 9 {
        true => Some((index.parse().ok()?, rest)),
        false => None,
    }
}

/// The end (after the blank line) of the first complete event in `buf`,
/// and its [`Lines`]. A line ends as SSE has it end, and as the SDKs
/// split lines: at `\r\n`, `\n` or `\r`, so that every event the client
/// will read is one the guard reads (a `\r` inside a line of another
/// field does not hide a `data:` line from the guard). An empty line
/// ends the event: a line end right after another. A `\r` that ends
/// `buf` may begin a `\r\n`: what follows it decides.
fn event_end(buf: &[u8]) -> Option<(usize, Lines)> {
    let mut first = None;
    let mut breaks = 0usize;
    let mut cr = false;
    let mut ends = memchr::memchr2_iter(b'\n', b'\r', buf);
    while let Some(at) = ends.next() {
        // Where the line after this end starts.
        let next = match buf[at] {
            b'\n' => at + 1,
            _ => {
                cr = true;
                match buf.get(at + 1) {
                    None => return None,
                    Some(b'\n') => {
                        ends.next();
                        at + 2
                    }
                    Some(_) => at + 1,
                }
            }
        };
        match buf.get(next..).unwrap_or_default() {
            [b'\n', ..] => {
                let lines = match (breaks, first) {
                    _ if cr => Lines::Other,
                    (0, _) => Lines::One,
                    (1, Some(first)) => Lines::Two(first),
                    _ => Lines::Other,
                };
                return Some((next + 1, lines));
            }
            [b'\r', b'\n', ..] => return Some((next + 2, Lines::Other)),
            [b'\r'] => return None,
            [b'\r', ..] => return Some((next + 1, Lines::Other)),
            _ => {
                breaks += 1;
                first.get_or_insert(at);
            }
        }
    }
    None
}

/// One whole event (its blank line included) read.
fn parse_event(raw: Bytes) -> Option<SseEvent> {
    let lines = match event_end(&raw) {
        Some((end, lines)) if end == raw.len() => lines,
        _ => Lines::Other,
    };
    read_event(raw, lines)
}

/// Reads the event `raw`, whose lines are `lines`.
fn read_event(raw: Bytes, lines: Lines) -> Option<SseEvent> {
    // The forms the APIs send, read as the loop below would read them:
    // their name and data are the places in `raw` that follow `event:` and
    // `data: `. Either form ends in the blank line's "\n\n".
    let body = raw.len().saturating_sub(2);
    let starts =
        |at: usize, prefix: &[u8]| raw.get(at..).is_some_and(|line| line.starts_with(prefix));
    let (event, data) = match lines {
        Lines::One if starts(0, b"data: ") => (None, Some(6..body)),
        Lines::Two(end) if starts(0, b"event:") && starts(end + 1, b"data: ") => {
            // The name after its spaces; one that starts with other
            // whitespace is read line by line.
            let name = 6 + raw[6..end].iter().take_while(|&&b| b == b' ').count();
            let plain = raw.get(name).is_some_and(u8::is_ascii_graphic);
            (plain.then_some(name..end), plain.then_some(end + 7..body))
        }
        _ => (None, None),
    };
    if let Some(data) = data
        && data.start <= data.end
        && let Ok(data) = ByteString::try_from(raw.slice(data))
        && let Ok(event) = event
            .map(|name| ByteString::try_from(raw.slice(name)))
            .transpose()
    {
        return Some(SseEvent {
            raw,
            event,
            data: Some(data),
        });
    }
    let text = match std::str::from_utf8(&raw) {
        Ok(text) => std::borrow::Cow::Borrowed(text),
        Err(_) => String::from_utf8_lossy(&raw),
    };
    let mut event = None;
    let mut data: Option<String> = None;
    // The lines a reader of the standard reads: all of them, unless some
    // are of fields it ignores.
    let mut kept: Option<Vec<&str>> = None;
    // Lines end at `\r\n`, `\n` or `\r` (see `event_end`); the empty piece
    // between a `\r\n`'s two bytes is no field.
    let lines: Vec<&str> = text.split(['\r', '\n']).filter(|l| !l.is_empty()).collect();
    for (i, line) in lines.iter().enumerate() {
        let (field, value) = field_of(line);
        match field {
            "event" => event = Some(ByteString::from(value.trim_start())),
            "data" => match &mut data {
                Some(d) => {
                    d.push('\n');
                    d.push_str(value);
                }
                None => data = Some(value.to_owned()),
            },
            // A comment, or a field the guard need not read.
            _ if SSE_FIELDS.contains(&field) => {}
            // A field no reader of the standard reads. It does not go
            // out: what could read it, when the rest of the body is such
            // lines too, is a reader that takes the body for something
            // else (a JSON answer labelled as a stream, to an SDK that
            // asked for no stream and reads any body as JSON).
            _ => {
                kept.get_or_insert_with(|| lines[..i].to_vec());
                continue;
            }
        }
        if let Some(kept) = &mut kept {
            kept.push(line);
        }
    }
    if event.is_none() && data.is_none() && text.trim().is_empty() {
        return None;
    }
    let rebuilt = match kept {
        Some(kept) if kept.is_empty() => return None,
        Some(kept) => Some(Bytes::from(kept.join("\n") + "\n\n")),
        None => None,
    };
    drop(lines);
    drop(text);
    let raw = rebuilt.unwrap_or(raw);
    let data = data.map(ByteString::from);
    Some(SseEvent { raw, event, data })
}

/// The fields of SSE, as its readers read them: a comment (no name), the
/// event's name, its data, its id and the client's retry delay.
const SSE_FIELDS: [&str; 5] = ["", "event", "data", "id", "retry"];

/// A line's field and value as the SSE standard reads them: the field
/// before the first colon (the whole line without one), the value after
/// it, without one space.
fn field_of(line: &str) -> (&str, &str) {
    let (field, value) = line.split_once(':').unwrap_or((line, ""));
    (field, value.strip_prefix(' ').unwrap_or(value))
}

/// Anthropic's `message_start` event `raw`, its message's `content`
/// emptied, as the API writes it; `None` for any other event.
fn empty_start(raw: &Bytes) -> Option<Bytes> {
    memchr::memmem::find(raw, b"message_start")?;
    let data = parse_event(raw.clone())?.data?;
    let mut start: Value = serde_json::from_str(&data).ok()?;
    if start["type"] != "message_start" {
        return None;
    }
    start["message"]["content"] = json!([]);
    Some(sse(Some("message_start"), &start))
}

/// An event held back in buffer mode, with the range of `acc` its text
/// occupies and its content block, when it carries text.
type Held = (SseEvent, Option<(usize, usize, u64)>);

/// An event that waits in holdback behind held text: where `held_text`
/// ended once its text was in, and the content block it opens.
struct HeldFrame {
    raw: Bytes,
    end: usize,
    /// Where [`Decoded`]'s text ended then (`end` while there is none).
    decoded_end: usize,
    opens: Option<u64>,
}

/// The held text as the client's code reads it parsed, its JSON escapes
/// decoded (see [`Guard::hold_json`]): kept from the first escape in a
/// call's arguments or a tool's input, and held back as the text as it
/// stands is, with hits of its own.
#[derive(Default)]
struct Decoded {
    text: String,
    /// The held text's end when it may be an escape cut short, not
    /// decoded until what follows tells how it reads.
    pending: String,
    checked: usize,
    released: usize,
    hits: Vec<Hit>,
}

impl Decoded {
    /// Decodes `text`, which follows the held text decoded so far; at the
    /// `last`, an escape cut short as it stands.
    fn push(&mut self, text: &str, last: bool) {
        if self.pending.is_empty() {
            let used = super::unescape_into(&mut self.text, text, last);
            self.pending.push_str(&text[used..]);
            return;
        }
        self.pending.push_str(text);
        let used = super::unescape_into(&mut self.text, &self.pending, last);
        self.pending.drain(..used);
    }

    /// Scans the text not scanned yet (and enough before it), as
    /// [`Guard::scan_held`] scans the text as written; a redaction in it
    /// blocks, as the text as written cannot show where it lies.
    fn scan(&mut self, rules: &RuleSet, hold: usize) -> Window {
        let from = window_start(&self.text, self.checked, self.released, hold);
        if self.checked == self.text.len() {
            return (from, None);
        }
        self.checked = self.text.len();
        let view = scan_into(rules, &self.text, from, &mut self.hits);
        super::redactions_block(&mut self.hits);
        (from, view)
    }

    /// How far the text can be released (see [`safe_end`]), once scanned
    /// from `from` (with its normalized view when the scan made one).
    fn safe_end(&self, rules: &RuleSet, (from, view): Window) -> usize {
        let view = view.unwrap_or_else(|| Normalized::new(&self.text[from..]));
        let released = self.released;
        safe_end(
            rules, &self.text, released, released, from, &view, &self.hits,
        )
    }
}

/// Where a scan's window starts, and its normalized view when the scan
/// made one.
type Window = (usize, Option<Normalized>);

/// An event's text: where it lies in the event's data when it stands
/// there as it reads (a JSON string without escapes, as most are), or else
/// the text itself, decoded. The first is not copied out of the event.
enum EventText {
    In(Range<usize>),
    Decoded(String),
}

impl EventText {
    /// A text read from an event's data.
    fn of(text: Text<'_>) -> EventText {
        match text.value {
            // The token without its quotes: a string read as it stands.
            Cow::Borrowed(_) => EventText::In(text.token.start + 1..text.token.end - 1),
            Cow::Owned(text) => EventText::Decoded(text),
        }
    }

    /// The text, of `event` (the event it was read from).
    fn of_event<'e>(&'e self, event: &'e SseEvent) -> &'e str {
        match self {
            EventText::In(span) => event
                .data
                .as_deref()
                .and_then(|data| data.get(span.clone()))
                .unwrap_or_default(),
            EventText::Decoded(text) => text,
        }
    }
}

/// What an event means to the guard.
enum Kind {
    /// Response text, with the content block it belongs to (Anthropic).
    Text {
        text: EventText,
        block: u64,
    },
    /// Text the guard cannot re-frame, in an event it holds whole: a
    /// refusal, tool-call arguments, a tool's input, reasoning, audio.
    /// `finished` when the event also ends the response; `opens`, the
    /// content block it starts (an Anthropic thinking block); `whole`
    /// when no event of its kind may go out before its whole text is read
    /// (audio, which says what its transcript says, sent ahead of it or
    /// behind it).
    Held {
        text: String,
        finished: bool,
        opens: Option<u64>,
        whole: bool,
    },
    /// A content block ends (Anthropic `content_block_stop`).
    BlockEnd,
    /// A content block starts (Anthropic `content_block_start`, a
    /// Responses API part), with any text it carries already.
    BlockStart {
        block: u64,
        text: String,
    },
    /// The response is complete: a finish reason, `message_delta`.
    Final,
    /// The very last event: `[DONE]`, `message_stop`.
    Done,
    /// An OpenAI chunk of another choice than the guard's (`n` > 1).
    Choice(u64),
    /// An OpenAI chunk of several choices, read as a chunk of each.
    Choices,
    Other,
    Malformed,
    /// The upstream's error event, which ends its stream.
    Error,
}

impl Kind {
    /// Held text (see [`Kind::Held`]) of an event that neither ends the
    /// response nor opens a block, and may go out before all of its kind
    /// is read.
    fn held(text: String) -> Kind {
        Kind::Held {
            text,
            finished: false,
            opens: None,
            whole: false,
        }
    }
}

/// The bytes of answer text a stream guard makes room for at once.
const ANSWER_ROOM: usize = 1024;

/// How far a stream has come, by index, through what the SDKs gather
/// apart: Anthropic's content blocks, OpenAI's tool calls (each choice's
/// guard its own), the Responses API's items and their content and
/// summary parts. The APIs send each in turn, and the guard reads the text
/// of each as it comes; a server that went back to one (interleaved two)
/// would have the SDKs join pieces the guard read apart, so an event of
/// one before the last reached is malformed.
#[derive(Debug, Default)]
struct Reached {
    block: u64,
    call: u64,
    item: u64,
    part: u64,
    summary: u64,
    /// The last Responses API item added, and content part: the SDKs add
    /// another on a second start, but put the deltas of its index in the
    /// first, joined to its text.
    item_added: Option<u64>,
    part_added: Option<(u64, u64)>,
}

/// The stream guard as a state machine: events in, frames out. No I/O, so
/// the tests drive it directly.
pub struct Guard {
    setup: StreamSetup,
    dialect: Dialect,
    /// All response text so far; separators between content blocks are
    /// included but never sent. It starts with the prefill, which the
    /// client has: released, and scanned only for matches that reach past
    /// it.
    acc: String,
    /// Where the upstream's text starts in `acc`: the prefill's length.
    prefill: usize,
    released: usize,
    /// How much of `acc` the last check saw.
    checked: usize,
    /// Response hits found so far, with offsets into `acc`.
    hits: Vec<Hit>,
    /// The text of the [`Kind::Held`] events so far; a line break between
    /// content blocks.
    held_text: String,
    /// A content block ended after held text: the next held text starts
    /// after a line break (put then, so that the text ends with its own).
    held_break: bool,
    /// The hits found in `held_text`, and how much of it the last scan
    /// saw.
    held_hits: Vec<Hit>,
    held_checked: usize,
    /// Holdback: the [`Kind::Held`] events not yet sent, and the others
    /// that wait behind them; how far into `held_text` the events sent
    /// reached; whether those unsent must wait for the end of their text
    /// (audio).
    held_frames: Vec<HeldFrame>,
    held_released: usize,
    held_whole: bool,
    /// The held text decoded, once its JSON has had an escape.
    decoded: Option<Box<Decoded>>,
    /// Hits in text that Responses API events repeat but the stream did
    /// not carry.
    repeated_hits: Vec<Hit>,
    /// Hits in what a hosted or server tool gave the model, which the
    /// stream carries whole in one event (a Responses API item's end, an
    /// Anthropic block's start), scanned as context.
    context_hits: Vec<Hit>,
    /// Those texts, redacted, for the record.
    context_texts: Vec<String>,
    /// Each such text that a `redact` hit rewrote, and its rewriting: the
    /// Responses API repeats the item in `response.completed`.
    context_redactions: Vec<(String, String)>,
    /// The data of the event being classified, when it carried such a
    /// text and a redaction rewrote it: the event goes on in its place.
    redacted_data: Option<String>,
    /// Whether the event being classified, an OpenAI chunk, carries both
    /// text and its choice's finish ([`split_finish`]).
    text_with_finish: bool,
    /// The finish of a chunk read with its text, until the choice's text
    /// is over.
    finish_held: Option<SseEvent>,
    /// The `role` of the chunk that began the answer's text, until a
    /// re-framed chunk carries it out.
    role: Option<String>,
    /// The first OpenAI chunk with text (its JSON text), the template for
    /// re-framed chunks.
    template: Option<String>,
    /// `template`'s JSON tree, read once a frame is first built from it
    /// (a plain text chunk needs none, see [`plain_text`]).
    template_tree: OnceCell<Option<Value>>,
    /// Responses API: the first text event of each content part, the
    /// template for its re-framed text; the data of `response.created`
    /// (or of the latest event like it), whose response a blocked stream's
    /// last event is made from, read only then; the parts started; the
    /// `sequence_number` of the next event sent.
    part_templates: Vec<PartTemplate>,
    response_event: Option<String>,
    parts: u64,
    next_number: Option<u64>,
    /// A text chunk of the template, serialized, cut where its text goes:
    /// re-framed text is written between the two, with no JSON tree built.
    text_frame_parts: Option<(String, String)>,
    /// The Anthropic content block the pending text belongs to.
    block: u64,
    block_open: bool,
    /// Buffer mode: events kept for replay, with the text range of each.
    held: Vec<Held>,
    blocked: bool,
    finished: bool,
    malformed: bool,
    upstream_failed: bool,
    faulted: bool,
    /// The upstream sent the answer's final event (OpenAI's finish, the
    /// Responses API's `response.completed`, Anthropic's `message_delta`):
    /// what follows it only closes the stream.
    final_seen: bool,
    /// The upstream's usage: the JSON text of its object, as the upstream
    /// wrote it (Anthropic's two reports merged).
    usage: Option<String>,
    /// A blocked OpenAI stream whose client asked for usage: the upstream
    /// is read on (nothing of it sent) until its usage chunk, which is then
    /// sent before `[DONE]`.
    awaiting_usage: bool,
    /// The shape of the last text event read in full: the next ones that
    /// differ from it only in their strings are read by those alone.
    shape: Option<Shape>,
    /// Whether the event of `shape` carried its choice's finish with its
    /// text ([`split_finish`]).
    shape_finishes: bool,
    /// OpenAI: the choice this guard reads (0 but in `others`), and a guard
    /// of its own for each other choice of a stream of several (`n` > 1),
    /// whose chunks come interleaved: each choice is a text of its own.
    choice: u64,
    others: Vec<Guard>,
    /// How far the stream has come through what the SDKs gather apart by
    /// index (see [`Reached`]).
    reached: Reached,
    /// The client has this guard's final event (OpenAI: its choice's
    /// finish), so a block ends its choice no more.
    ended: bool,
    /// The events being read arrived together, in one read from the
    /// upstream: their text is checked once, after the last of them
    /// ([`Guard::deferred_check`]), rather than every 64 bytes. Their frames
    /// leave together anyway, so the client gets the same text at the same
    /// moment, for fewer scans of the window.
    pub deferring: bool,
    /// Chat completions asked for `logprobs`: each text chunk's
    /// `logprobs.content` entries (a Responses API text delta's
    /// `logprobs`), with the range of `acc` its text took.
    /// A re-framed chunk carries the entries of the chunks whose text it
    /// completes (`logprobs_sent` of them so far), but for those of text
    /// that was redacted: their tokens are that text.
    logprobs: Vec<(std::ops::Range<usize>, Vec<Value>)>,
    logprobs_sent: usize,
    /// The entries of the chunk being read, until its text is in `acc`.
    pending_logprobs: Option<Vec<Value>>,
    /// Text chunks that carry a `usage` of their own, as some
    /// OpenAI-compatible servers send on every chunk.
    running_usage: Option<Box<RunningUsage>>,
    /// The bytes of the upstream's stream taken so far.
    taken: usize,
}

/// The running `usage` that some OpenAI-compatible servers put on every
/// chunk (vLLM's `stream_options.continuous_usage_stats`), the counts so
/// far. A re-framed text chunk carries the latest of the chunks whose
/// text it completes, or else the latest that went out before it.
#[derive(Default)]
struct RunningUsage {
    /// The usage of the chunk being read, until its text is in `acc`.
    reading: Option<String>,
    /// Each text chunk's not yet shown, by where its text ends in `acc`.
    pending: std::collections::VecDeque<(usize, String)>,
    /// The latest that went out.
    shown: Option<Value>,
}

impl Guard {
    pub fn new(setup: StreamSetup) -> Guard {
        let dialect = setup.endpoint.dialect();
        // Room for a short answer, which grown from empty was moved six
        // times.
        let mut acc = String::with_capacity(setup.prefill.len() + ANSWER_ROOM);
        acc.push_str(&setup.prefill);
        let prefill = acc.len();
        // The prefill's matches, all of them: windows reach back into it
        // only as far as a match can run on from it.
        let mut hits = Vec::new();
        if prefill > 0 {
            scan_into(&setup.rules, &acc, 0, &mut hits);
            super::continuation_hits(&mut hits, prefill);
        }
        Guard {
            setup,
            dialect,
            acc,
            prefill,
            released: prefill,
            checked: prefill,
            hits,
            held_text: String::new(),
            held_break: false,
            held_hits: Vec::new(),
            held_checked: 0,
            held_frames: Vec::new(),
            held_released: 0,
            held_whole: false,
            decoded: None,
            repeated_hits: Vec::new(),
            context_hits: Vec::new(),
            context_texts: Vec::new(),
            context_redactions: Vec::new(),
            redacted_data: None,
            text_with_finish: false,
            finish_held: None,
            shape_finishes: false,
            role: None,
            template: None,
            template_tree: OnceCell::new(),
            part_templates: Vec::new(),
            response_event: None,
            parts: 0,
            next_number: None,
            text_frame_parts: None,
            block: 0,
            block_open: false,
            held: Vec::new(),
            blocked: false,
            finished: false,
            malformed: false,
            upstream_failed: false,
            faulted: false,
            final_seen: false,
            usage: None,
            awaiting_usage: false,
            shape: None,
            choice: 0,
            others: Vec::new(),
            reached: Reached::default(),
            ended: false,
            deferring: false,
            logprobs: Vec::new(),
            logprobs_sent: 0,
            pending_logprobs: None,
            running_usage: None,
            taken: 0,
        }
    }

    /// The guard of choice `index`, made on its first chunk: it ends its
    /// choice, but the stream's `[DONE]` and usage are this guard's.
    fn other_choice(&mut self, index: u64) -> &mut Guard {
        let at = match self.others.iter().position(|g| g.choice == index) {
            Some(at) => at,
            None => {
                let mut setup = self.setup.clone();
                setup.include_usage = false;
                let mut guard = Guard::new(setup);
                guard.choice = index;
                self.others.push(guard);
                self.others.len() - 1
            }
        };
        &mut self.others[at]
    }

    /// A chunk of another choice, guarded by that choice's guard; when it
    /// blocks, the whole stream ends blocked. A stream of more choices than
    /// the API allows is malformed (each choice holds a guard's state).
    fn on_other_choice(&mut self, index: u64, event: SseEvent) -> Vec<Bytes> {
        if self.others.len() + 1 >= MAX_CHOICES && !self.others.iter().any(|g| g.choice == index) {
            return self.by_mode(event, Kind::Malformed);
        }
        let guard = self.other_choice(index);
        let mut frames = guard.on_event(event);
        if guard.blocked {
            frames.append(&mut self.block());
        }
        frames
    }

    /// A chunk of several choices, as the chunks of one choice each that
    /// OpenAI sends ([`split_choices`]), each guarded as it would be.
    /// Monitor mode passes the chunk as it came.
    fn on_choices(&mut self, event: SseEvent) -> Vec<Bytes> {
        let Some(pieces) = split_choices(&event) else {
            return self.by_mode(event, Kind::Malformed);
        };
        let mut frames = Vec::new();
        for piece in pieces {
            if self.finished {
                break;
            }
            frames.append(&mut self.on_event(piece));
        }
        if self.setup.mode == StreamMode::Monitor {
            frames = vec![event.raw];
        }
        frames
    }

    /// The other choices' guards at the end of the stream: their last
    /// frames, and whether one of them blocked.
    fn end_other_choices(&mut self) -> (Vec<Bytes>, bool) {
        let mut frames = Vec::new();
        for guard in &mut self.others {
            frames.append(&mut guard.on_end());
            if guard.blocked {
                return (frames, true);
            }
        }
        (frames, false)
    }

    /// Takes one upstream event; returns the frames to send.
    pub fn on_event(&mut self, event: SseEvent) -> Vec<Bytes> {
        if self.finished {
            return Vec::new();
        }
        let kind = self.classify(&event);
        if matches!(kind, Kind::Choices) {
            return self.on_choices(event);
        }
        let event = match self.redacted_data.take() {
            Some(data) => parse_event(sse_text(event.event.as_deref(), &data)).unwrap_or(event),
            None => event,
        };
        // A finish read with its chunk's text goes on once the choice's
        // text is over: at the next event that is not more of it (some
        // servers mark every chunk with text as finished).
        let mut frames = Vec::new();
        if !matches!(kind, Kind::Text { .. }) {
            frames = self.finish_held_text();
            if self.finished {
                return self.outgoing(frames);
            }
        }
        self.final_seen |= matches!(kind, Kind::Final);
        frames.append(&mut match kind {
            Kind::Text { text, block } if std::mem::take(&mut self.text_with_finish) => {
                match split_finish(&event, self.setup.endpoint) {
                    Some((with_text, finish)) => {
                        // Its text, read from it before it is set apart.
                        let text = EventText::Decoded(text.of_event(&event).to_owned());
                        self.finish_held = Some(finish);
                        self.by_mode(with_text, Kind::Text { text, block })
                    }
                    None => self.by_mode(event, Kind::Text { text, block }),
                }
            }
            Kind::Text { text, block } => {
                // More text: the finish before it was not the end.
                self.finish_held = None;
                self.by_mode(event, Kind::Text { text, block })
            }
            Kind::Choice(index) => self.on_other_choice(index, event),
            Kind::Done if !self.others.is_empty() => {
                let (mut frames, blocked) = self.end_other_choices();
                if blocked {
                    frames.append(&mut self.block());
                } else {
                    frames.append(&mut self.by_mode(event, Kind::Done));
                }
                frames
            }
            // The APIs start a block empty and send its text in deltas; text
            // in the start is split off as a delta of its own, which every
            // mode then reads as text (monitor passes the start as it came).
            Kind::BlockStart { block, text } if !text.is_empty() => {
                if self.setup.mode == StreamMode::Monitor {
                    let text = EventText::Decoded(text);
                    return self.monitor(event, Kind::Text { text, block });
                }
                let start = self.emptied_start(&event);
                let kind = Kind::BlockStart {
                    block,
                    text: String::new(),
                };
                let mut frames = self.by_mode(start, kind);
                let delta = parse_event(self.text_frame(&text, block)).unwrap_or(event);
                let text = EventText::Decoded(text);
                frames.extend(self.by_mode(delta, Kind::Text { text, block }));
                frames
            }
            Kind::Error if self.setup.mode != StreamMode::Monitor => self.upstream_error(event),
            kind => self.by_mode(event, kind),
        });
        let mut frames = self.outgoing(frames);
        if self.malformed && self.finished {
            frames.extend(self.malformed_ending());
        }
        frames
    }

    /// The check put off while `deferring`, when one is due.
    pub fn deferred_check(&mut self) -> Vec<Bytes> {
        self.deferring = false;
        if self.finished || self.setup.mode != StreamMode::Holdback || !self.check_due() {
            return Vec::new();
        }
        let frames = self.check(false);
        self.outgoing(frames)
    }

    fn by_mode(&mut self, event: SseEvent, kind: Kind) -> Vec<Bytes> {
        match self.setup.mode {
            StreamMode::Monitor => self.monitor(event, kind),
            StreamMode::Buffer => self.buffer(event, kind),
            StreamMode::Holdback => self.holdback(event, kind),
        }
    }

    /// A block's start with its text taken out.
    fn emptied_start(&self, event: &SseEvent) -> SseEvent {
        let data = event.data.as_deref().unwrap_or("{}");
        let mut json: Value = serde_json::from_str(data).unwrap_or(Value::Null);
        for key in ["content_block", "part"] {
            if let Some(block) = json.get_mut(key).and_then(Value::as_object_mut) {
                block.insert("text".into(), json!(""));
            }
        }
        parse_event(sse(event.event.as_deref(), &json)).unwrap_or_else(|| event.clone())
    }

    /// The finish held back with the text of its chunk ([`split_finish`]),
    /// read as the choice's final event.
    fn finish_held_text(&mut self) -> Vec<Bytes> {
        let Some(finish) = self.finish_held.take() else {
            return Vec::new();
        };
        self.final_seen = true;
        self.by_mode(finish, Kind::Final)
    }

    /// The upstream ended (or failed) without a final event.
    pub fn on_end(&mut self) -> Vec<Bytes> {
        let frames = self.end_frames();
        self.outgoing(frames)
    }

    /// The frames that end the stream: what is held, checked as at an
    /// end, or the block's ending.
    fn end_frames(&mut self) -> Vec<Bytes> {
        if self.finished {
            return Vec::new();
        }
        let held = self.finish_held_text();
        if self.finished {
            return held;
        }
        let (mut frames, blocked) = self.end_other_choices();
        frames.splice(0..0, held);
        if blocked {
            frames.append(&mut self.block());
            return frames;
        }
        self.finished = true;
        frames.append(&mut match self.setup.mode {
            StreamMode::Monitor => {
                self.scan_window(0);
                self.scan_held(true);
                Vec::new()
            }
            StreamMode::Buffer => self.replay_or_block(),
            StreamMode::Holdback => self.check(true),
        });
        frames
    }

    /// The upstream's error event, which ends its stream: what is held is
    /// checked as at an end and goes out before it (the client's SDK
    /// raises at the error, having shown what came before), or, when a
    /// rule blocks it, the block's ending goes out instead.
    #[cold]
    fn upstream_error(&mut self, event: SseEvent) -> Vec<Bytes> {
        let mut frames = self.end_frames();
        if !self.blocked {
            self.upstream_failed = true;
            frames.push(event.raw);
        }
        frames
    }

    /// The frames as the client gets them. Responses API events are
    /// numbered in the order sent, and the text they repeat goes out as
    /// the guard read it, redacted (see the module's doc); an event that
    /// repeats text the stream did not carry, and a rule blocks, ends the
    /// stream instead. Monitor mode changes nothing.
    fn outgoing(&mut self, frames: Vec<Bytes>) -> Vec<Bytes> {
        if self.setup.endpoint != Endpoint::Responses || self.setup.mode == StreamMode::Monitor {
            return frames;
        }
        let mut out = Vec::with_capacity(frames.len());
        let first_number = self.next_number;
        for frame in frames {
            match self.responses_frame(frame) {
                Some(frame) => out.push(frame),
                None => {
                    if self.setup.mode == StreamMode::Buffer {
                        // Nothing of a blocked answer: the frames are
                        // its replay.
                        out.clear();
                        self.next_number = first_number;
                    }
                    let ending = self.block();
                    out.extend(ending.into_iter().filter_map(|f| self.responses_frame(f)));
                    break;
                }
            }
        }
        out
    }

    /// One Responses API event as sent, or `None` when it must not be.
    fn responses_frame(&mut self, frame: Bytes) -> Option<Bytes> {
        let Some(SseEvent {
            event,
            data: Some(data),
            ..
        }) = parse_event(frame.clone())
        else {
            return Some(frame);
        };
        let mut rewritten = None;
        // A text delta carries its piece in `delta`, never text repeated
        // (and the text deltas the guard writes are most of what it sends).
        if !is_text_delta(&data) {
            rewritten = self.check_repeated(&data)?;
        }
        let data = rewritten.as_deref().unwrap_or(&data);
        let Some((number, span)) = event::sequence_number(data) else {
            return Some(match rewritten {
                Some(data) => sse_text(event.as_deref(), &data),
                None => frame,
            });
        };
        let next = self.next_number.unwrap_or(number);
        self.next_number = Some(next.saturating_add(1));
        if next == number && rewritten.is_none() {
            return Some(frame);
        }
        let mut digits = itoa::Buffer::new();
        let digits = digits.format(next);
        // The number replaced in the frame as it stands, when its data
        // is there as it reads.
        if rewritten.is_none()
            && let Some(at) = offset_in(&frame, data.as_bytes())
        {
            let (from, to) = (at + span.start, at + span.end);
            let mut out = Vec::with_capacity(frame.len() + digits.len());
            out.extend_from_slice(&frame[..from]);
            out.extend_from_slice(digits.as_bytes());
            out.extend_from_slice(&frame[to..]);
            return Some(Bytes::from(out));
        }
        let data = format!("{}{digits}{}", &data[..span.start], &data[span.end..]);
        Some(sse_text(event.as_deref(), &data))
    }

    /// Checks the text an event repeats (a part's, an item's, the whole
    /// response's). Text the stream carried, and the guard read (scanned),
    /// is redacted as it was; other text (an upstream whose deltas and
    /// repetitions disagree) is scanned now, and redacted in place, or
    /// `None` when a rule blocks it. The event's data rewritten, when it
    /// changed. The texts are read where they stand in the data, and only
    /// a change writes it again.
    fn check_repeated(&mut self, data: &str) -> Option<Option<String>> {
        let mut texts = Vec::new();
        // The events sent are JSON (read whole as they came, or written
        // by the guard): one this read cannot finish nests deeper than
        // the guard reads, and could hide text from the check.
        if repeated_texts(&mut Reader::new(data), &mut texts).is_err() {
            return None;
        }
        let mut edits = Vec::new();
        // Text is read once its scan has come past it: an event the guard
        // does not know goes out with no check before it.
        let read = |text: &str, checked: usize, value: &str| {
            text.get(..checked).is_some_and(|read| read.contains(value))
        };
        for Text { value, token } in texts {
            if read(&self.acc, self.checked, &value)
                || read(&self.held_text, self.held_checked, &value)
            {
                let mut edited: Option<String> = None;
                // Matches that overlap go as one, as `redact` takes them.
                for (span, placeholder) in redacted_spans(&self.hits, 0) {
                    let original = &self.acc[span];
                    let text = edited.as_deref().unwrap_or(&value);
                    if text.contains(original) {
                        edited = Some(text.replace(original, placeholder));
                    }
                }
                edits.extend(edited.map(|text| (token, text)));
                continue;
            }
            let hits = self.setup.rules.scan(Scope::Response, &value);
            let blocks = hits.iter().any(|h| h.action == Action::Block);
            if hits.iter().any(|h| h.action == Action::Redact) {
                edits.push((token, redact(&value, &hits)));
            }
            self.repeated_hits.extend(hits);
            if blocks {
                return None;
            }
        }
        // The tokens of a redacted text are that text.
        let mut rewritten = (!edits.is_empty())
            .then(|| super::without_logprobs(crate::json::splice(data.as_bytes(), &edits)));
        // What a tool gave the model, redacted when its item streamed, is
        // redacted where the event repeats it.
        if !self.context_redactions.is_empty() {
            let data = rewritten.as_deref().unwrap_or(data.as_bytes());
            if let Ok(mut json) = serde_json::from_slice::<Value>(data)
                && replace_strings(&mut json, &self.context_redactions)
            {
                rewritten = Some(Bytes::from(json_text(&json)));
            }
        }
        Some(rewritten.map(|data| match String::from_utf8(data.into()) {
            Ok(data) => data,
            Err(_) => unreachable!("JSON strings spliced into UTF-8 are UTF-8"),
        }))
    }

    fn outcome(&self, first_byte: Option<Duration>, guard_time: Duration) -> StreamOutcome {
        let mut hits = self.all_hits();
        let mut text = self.read_text();
        for guard in &self.others {
            hits.extend(guard.response_hits());
            text.push('\n');
            text.push_str(&guard.read_text());
        }
        let mut verdict = risk::assess(&self.setup.risk, hits, &self.setup.relevance);
        if self.blocked {
            verdict.decision = Decision::Block;
        }
        StreamOutcome {
            verdict,
            text,
            context: self.context_texts.clone(),
            usage: self.usage.as_deref().map(Usage::from_json_text),
            guard_time,
            malformed: self.malformed,
            upstream_failed: self.upstream_failed,
            faulted: self.faulted,
            first_byte,
            end: self.end(),
        }
    }

    /// How the stream ended, read when its body is dropped: a guard that
    /// has not finished (read the upstream's last event or its end, or
    /// ended the stream itself) was left by its client: hyper drops the
    /// body of a connection that closed, or that a shutdown's grace cut
    /// off.
    fn end(&self) -> StreamEnd {
        if self.faulted {
            StreamEnd::Fault
        } else if !self.finished {
            StreamEnd::ClientClosed
        } else if self.upstream_failed {
            StreamEnd::UpstreamFailed
        } else if self.blocked {
            StreamEnd::Blocked
        } else if self.malformed && self.setup.mode != StreamMode::Monitor {
            StreamEnd::Malformed
        } else {
            StreamEnd::Complete
        }
    }

    /// The event that ends a stream whose guard failed.
    #[cold]
    fn fault_ending(&mut self) -> Bytes {
        self.faulted = true;
        self.error_ending(Failure::Fault, None)
    }

    /// The frames that end a stream whose upstream broke off (an error, or
    /// the deadline) before its last event: the text the guard holds, once
    /// checked as at an end, then an error event.
    #[cold]
    fn broken_ending(&mut self, error: &dyn Display) -> Vec<Bytes> {
        let message = format!("The upstream API's stream broke off before its end: {error}.");
        self.failed_ending(&message)
    }

    /// Counts `bytes` more of the upstream's stream: whether that is more
    /// than `max_bytes`, so that the stream ends ([`Guard::oversized_ending`]).
    fn took(&mut self, bytes: usize) -> bool {
        self.taken = self.taken.saturating_add(bytes);
        self.taken > self.setup.max_bytes
    }

    /// The end of a stream that sent more than `max_bytes`: as the end of
    /// one that broke off, the bytes past the limit unread.
    #[cold]
    fn oversized_ending(&mut self) -> Vec<Bytes> {
        let message = format!(
            "The upstream API's stream sent more than guard.max_stream_bytes ({} bytes); it ends there.",
            self.setup.max_bytes
        );
        self.failed_ending(&message)
    }

    /// The held text, checked as at an end, then the API's error event
    /// with `message`: the upstream failed.
    fn failed_ending(&mut self, message: &str) -> Vec<Bytes> {
        self.upstream_failed = true;
        let mut frames = self.on_end();
        frames.extend(self.cut_ending(message));
        frames
    }

    /// The error event that ends a stream at a malformed event (monitor
    /// mode passes the event on, and ends nothing).
    #[cold]
    fn malformed_ending(&mut self) -> Option<Bytes> {
        if self.setup.mode == StreamMode::Monitor {
            return None;
        }
        let message =
            "The upstream API's stream held an event that is not well formed; it ends there.";
        self.cut_ending(message)
    }

    /// The error event that ends a stream the upstream cut short, so that
    /// the client's SDK raises rather than take the answer for whole; none
    /// when the answer's final event came (the client has it, or will with
    /// the held text), or a block ended the stream.
    fn cut_ending(&mut self, message: &str) -> Option<Bytes> {
        if self.blocked || self.final_seen {
            return None;
        }
        Some(self.error_ending(Failure::UpstreamBroken, Some(message)))
    }

    /// The event that ends a stream in error, as each API ends a stream on
    /// a server error (which its SDK raises): the API's error envelope, or
    /// the Responses API's numbered `error` event.
    #[cold]
    fn error_ending(&mut self, failure: Failure, message: Option<&str>) -> Bytes {
        self.finished = true;
        if self.setup.endpoint != Endpoint::Responses {
            return sse(
                (self.dialect == Dialect::Anthropic).then_some("error"),
                &respond::failure_body(self.dialect, failure, message),
            );
        }
        let number = self.next_number.unwrap_or(0);
        self.next_number = Some(number.saturating_add(1));
        let event = json!({
            "type": "error",
            "code": failure.code(),
            "message": message.unwrap_or(failure.message()),
            "param": null,
            "sequence_number": number,
        });
        sse(Some("error"), &event)
    }

    /// Whether an event of Anthropic content block `block` comes in turn:
    /// not of a block before the last one reached.
    fn block_in_order(&mut self, block: Option<u64>) -> bool {
        let Some(block) = block else {
            return true;
        };
        self.reach(|reached| &mut reached.block, block)
    }

    /// Whether a delta's OpenAI tool calls (the indexes of its first and
    /// last, in order within it) come in turn: none before the last one
    /// reached.
    fn calls_in_order(&mut self, calls: Option<(u64, u64)>) -> bool {
        let Some((first, last)) = calls else {
            return true;
        };
        self.reach(|reached| &mut reached.call, first)
            && self.reach(|reached| &mut reached.call, last)
    }

    /// Whether a Responses API event comes in turn: not of an item before
    /// the last one reached, nor of a content or summary part of the item
    /// before its last one reached, nor the start of an item or a content
    /// part that has started already.
    fn item_in_order(&mut self, event: &Event) -> bool {
        let Some(item) = event.output_index else {
            return true;
        };
        if item > self.reached.item {
            (self.reached.part, self.reached.summary) = (0, 0);
        }
        let reached = &mut self.reached;
        let started_again = match event.kind.as_deref() {
            Some("response.output_item.added") => reached.item_added.replace(item) >= Some(item),
            Some("response.content_part.added") => {
                let part = (item, event.content_index.unwrap_or(0));
                reached.part_added.replace(part) >= Some(part)
            }
            _ => false,
        };
        !started_again
            && self.reach(|reached| &mut reached.item, item)
            && event
                .content_index
                .is_none_or(|part| self.reach(|reached| &mut reached.part, part))
            && event
                .summary_index
                .is_none_or(|part| self.reach(|reached| &mut reached.summary, part))
    }

    /// Moves the place `at` picks out of [`Reached`] on to `index`: false
    /// when `index` is before it. A text event's shape holds its place,
    /// so the shape goes once the stream moves on.
    fn reach(&mut self, at: impl Fn(&mut Reached) -> &mut u64, index: u64) -> bool {
        let reached = at(&mut self.reached);
        if index > *reached {
            *reached = index;
            self.shape = None;
        }
        index == *reached
    }

    fn classify(&mut self, event: &SseEvent) -> Kind {
        let Some(data) = event.data.as_deref() else {
            return Kind::Other;
        };
        if data.trim() == "[DONE]" {
            return Kind::Done;
        }
        // An event of the last text event's shape means the same, and any
        // usage it holds is that one's, already noted.
        if let Some(shape) = &self.shape
            && let Some(text) = shape.text(data)
        {
            // Its finish too, if that one's had one.
            self.text_with_finish = self.shape_finishes;
            return Kind::Text {
                text: EventText::of(text),
                block: shape.block,
            };
        }
        if self.dialect == Dialect::Anthropic {
            if let Some((kind, block)) = anthropic_bare_kind(data) {
                return match self.block_in_order(block) {
                    true => kind,
                    false => Kind::Malformed,
                };
            }
            if let Some(usage) = anthropic_bare_message_delta(data) {
                self.note_usage(usage);
                return Kind::Final;
            }
        }
        // Another choice's text chunk, known by that choice's shape (its
        // index is among the fixed bytes), goes to its guard unread here.
        if let Some(other) = self
            .others
            .iter()
            .find(|guard| guard.shape.as_ref().is_some_and(|s| s.text(data).is_some()))
        {
            return Kind::Choice(other.choice);
        }
        let Ok(fields) = Event::read(data) else {
            return Kind::Malformed;
        };
        if let Some(usage) = fields.usage {
            self.note_usage(usage);
        }
        let kind = match self.dialect {
            Dialect::OpenAi => self.classify_openai(&fields, data),
            Dialect::Anthropic => self.classify_anthropic(&fields, data),
        };
        // A shape's events carry their logprobs and usage in their fixed
        // bytes, which are not read again: an event that has some leaves
        // no shape.
        let usage = self
            .running_usage
            .as_ref()
            .is_some_and(|r| r.reading.is_some());
        if self.pending_logprobs.is_some() || usage {
            self.shape = None;
        }
        kind
    }

    /// Keeps the usage an event reports (its JSON text): OpenAI's final
    /// `usage` chunk, Anthropic's `message_start` and `message_delta`
    /// (merged), the Responses API's `response.completed`.
    fn note_usage(&mut self, usage: &str) {
        self.usage = Some(match self.usage.take() {
            None => usage.to_owned(),
            Some(known) => merged_usage(&known, usage),
        });
    }

    /// The usage as a JSON tree, or null when the stream reported none.
    fn usage_value(&self) -> Value {
        let usage = self.usage.as_deref();
        usage
            .and_then(|text| serde_json::from_str(text).ok())
            .unwrap_or(Value::Null)
    }

    /// A text event: its kind, and its shape for the events that follow.
    fn text(&mut self, event: &Event, text: &Text, block: u64, data: &str) -> Kind {
        // Each Responses API event has another `sequence_number`: a place
        // of the shape.
        let number = match self.setup.endpoint {
            Endpoint::Responses => event::sequence_number(data).map(|(_, span)| span),
            _ => None,
        };
        if self.setup.endpoint != Endpoint::Responses || number.is_some() {
            let token = text.token.clone();
            self.shape = Some(Shape::of(data, token, &event.skipped, number, block));
            self.shape_finishes = self.text_with_finish;
        }
        Kind::Text {
            text: EventText::of(text.clone()),
            block,
        }
    }

    fn classify_openai(&mut self, event: &Event, data: &str) -> Kind {
        if self.setup.endpoint == Endpoint::Responses {
            return self.classify_responses(event, data);
        }
        if event.error {
            return Kind::Error;
        }
        let choice = &event.choice;
        // Only the stream's own guard sees such chunks: the others get
        // their choice's part of one.
        if choice.several {
            return Kind::Choices;
        }
        if let Some(index) = choice.index.filter(|&index| index != self.choice) {
            return Kind::Choice(index);
        }
        // The titles of the pages the answer cites, read when they come.
        if choice.delta.annotated {
            self.scan_tool_results(data);
        }
        if !self.calls_in_order(choice.delta.calls) {
            return Kind::Malformed;
        }
        if let Some(held) = choice.delta.held_text() {
            self.hold_json(choice.delta.json_texts());
            let content = choice.delta.content.as_ref().map_or("", |t| &t.value);
            return Kind::Held {
                text: format!("{content}{held}"),
                finished: choice.finished,
                opens: None,
                whole: choice.delta.audio,
            };
        }
        let text = match self.setup.endpoint {
            Endpoint::Completions => &choice.text,
            _ => &choice.delta.content,
        };
        // A chunk with both text and a finish reason (as some
        // OpenAI-compatible servers send their last) is read as two: its
        // text, then its finish ([`split_finish`]).
        let kind = match text {
            Some(text) if !text.value.is_empty() => {
                // In holdback only: monitor mode passes the chunk as it
                // came, and buffer mode replays it so (see `replay_or_block`).
                self.text_with_finish = choice.finished && self.setup.mode == StreamMode::Holdback;
                if let Some(role) = &choice.delta.role
                    && self.released == 0
                {
                    self.role = Some(role.value.clone().into_owned());
                }
                self.text(event, text, 0, data)
            }
            _ if choice.finished => Kind::Final,
            _ if event::is_error_object(data) => return Kind::Error,
            _ => return Kind::Other,
        };
        if self.setup.endpoint == Endpoint::ChatCompletions
            && matches!(kind, Kind::Text { .. })
            && let Some(logprobs) = choice.logprobs
        {
            self.pending_logprobs = serde_json::from_str::<Map<String, Value>>(logprobs)
                .ok()
                .and_then(|mut l| match l.remove("content") {
                    Some(Value::Array(entries)) => Some(entries),
                    _ => None,
                });
        }
        // A finish's usage goes with the finish ([`split_finish`]).
        if matches!(kind, Kind::Text { .. })
            && !choice.finished
            && let Some(usage) = event.usage
        {
            self.running_usage.get_or_insert_default().reading = Some(usage.to_owned());
        }
        if self.template.is_none() {
            let plain = match text {
                Some(text) if matches!(kind, Kind::Text { .. }) => {
                    plain_text(event, data, &text.token, self.setup.endpoint)
                        .then(|| text.token.clone())
                }
                _ => None,
            };
            self.set_template(data, plain);
        }
        kind
    }

    fn classify_responses(&mut self, event: &Event, data: &str) -> Kind {
        if !self.item_in_order(event) {
            return Kind::Malformed;
        }
        let part = self.parts;
        // The text of a delta the guard holds whole.
        let delta_text =
            || (event.delta_text.as_ref()).map_or_else(String::new, |t| t.value.to_string());
        match event.kind.as_deref() {
            Some("response.output_text.delta") => {
                let Some(text) = &event.delta_text else {
                    return Kind::Text {
                        text: EventText::Decoded(String::new()),
                        block: part,
                    };
                };
                self.pending_logprobs = logprob_entries(data);
                if !self.part_templates.iter().any(|t| t.part == part) {
                    let plain = self.pending_logprobs.is_none();
                    let template = PartTemplate::of_delta(part, data, &text.token, plain);
                    self.part_templates.push(template);
                }
                self.text(event, text, part, data)
            }
            Some("response.content_part.added") => {
                self.parts += 1;
                // The deltas of another part are read in full first.
                self.shape = None;
                let text = event
                    .content_block
                    .text
                    .as_ref()
                    .map(|t| t.value.to_string())
                    .unwrap_or_default();
                if !text.is_empty() {
                    // Split off as a delta (see `on_event`) in the part's
                    // place.
                    let json: Value = serde_json::from_str(data).unwrap_or_default();
                    let mut template = Map::new();
                    for key in ["item_id", "output_index", "content_index"] {
                        if let Some(value) = json.get(key) {
                            template.insert(key.into(), value.clone());
                        }
                    }
                    self.part_templates
                        .push(PartTemplate::new(self.parts, template));
                }
                Kind::BlockStart {
                    block: self.parts,
                    text,
                }
            }
            // An item's end carries it whole (checked before it goes out):
            // what a hosted tool gave the model is there, if not in its
            // start already.
            Some("response.output_item.added" | "response.output_item.done") => {
                self.scan_tool_results(data);
                match event.kind.as_deref() {
                    Some("response.output_item.done") => Kind::BlockEnd,
                    _ => Kind::Other,
                }
            }
            Some("response.output_text.done") => Kind::BlockEnd,
            // The model's words in a call: a function's or MCP tool's
            // arguments, a custom tool's input, the code it runs.
            Some(
                "response.function_call_arguments.delta" | "response.mcp_call_arguments.delta",
            ) => {
                let arguments = event.delta_text.as_ref().map(|t| &*t.value);
                self.hold_json(arguments.into_iter());
                Kind::held(arguments.unwrap_or_default().to_owned())
            }
            Some(
                "response.custom_tool_call_input.delta"
                | "response.code_interpreter_call_code.delta"
                | "response.refusal.delta"
                | "response.reasoning_summary_text.delta"
                | "response.reasoning_text.delta"
                | "response.shell_call_command.delta",
            ) => Kind::held(delta_text()),
            // They repeat the text of the deltas held before them, or (an
            // annotation) point into text that may not be released yet.
            Some(
                "response.function_call_arguments.done"
                | "response.mcp_call_arguments.done"
                | "response.custom_tool_call_input.done"
                | "response.code_interpreter_call_code.done"
                | "response.refusal.done"
                | "response.reasoning_summary_text.done"
                | "response.reasoning_text.done"
                | "response.shell_call_command.added"
                | "response.shell_call_command.done",
            ) => Kind::held(String::new()),
            // The title of a page the text cites is read when it comes.
            Some("response.output_text.annotation.added") => {
                self.scan_tool_results(data);
                Kind::held(String::new())
            }
            // What a shell printed, streamed: held until its `.done`, which
            // carries it whole, is read as context.
            Some("response.shell_call_output_content.delta") => Kind::Held {
                text: String::new(),
                finished: false,
                opens: None,
                whole: true,
            },
            Some("response.shell_call_output_content.done") => {
                self.scan_tool_results(data);
                Kind::BlockEnd
            }
            // Spoken output: the audio says what its transcript does, so
            // none of either goes out before the transcript's whole text
            // is read (as a chat completion's audio).
            Some(kind @ ("response.audio.delta" | "response.audio.transcript.delta")) => {
                Kind::Held {
                    text: match kind {
                        "response.audio.transcript.delta" => delta_text(),
                        _ => String::new(),
                    },
                    finished: false,
                    opens: None,
                    whole: true,
                }
            }
            Some("response.audio.done" | "response.audio.transcript.done") => {
                Kind::held(String::new())
            }
            Some("response.completed" | "response.incomplete" | "response.failed") => Kind::Final,
            Some("error") => Kind::Error,
            Some("response.created" | "response.in_progress" | "response.queued") => {
                self.response_event = Some(data.to_owned());
                Kind::Other
            }
            // A delta of a kind the guard does not know carries the
            // model's words all the same: held, and read as the others.
            Some(kind) if kind.ends_with(".delta") && event.delta_text.is_some() => {
                Kind::held(delta_text())
            }
            _ => Kind::Other,
        }
    }

    fn classify_anthropic(&mut self, event: &Event, data: &str) -> Kind {
        if event
            .kind
            .as_deref()
            .is_some_and(|kind| kind.starts_with("content_block_"))
            && !self.block_in_order(event.index)
        {
            return Kind::Malformed;
        }
        match event.kind.as_deref() {
            Some("content_block_delta") => {
                let delta = &event.delta;
                match (&delta.kind, &delta.text) {
                    (Some(kind), Some(text)) if kind == "text_delta" => {
                        self.text(event, text, event.index.unwrap_or(0), data)
                    }
                    (Some(kind), None) if kind == "text_delta" => Kind::Text {
                        text: EventText::Decoded(String::new()),
                        block: event.index.unwrap_or(0),
                    },
                    // The text a citation quotes, whole in its event.
                    (Some(kind), _) if kind == "citations_delta" => {
                        self.scan_tool_results(data);
                        Kind::Other
                    }
                    // A compaction's summary, signed as thinking is.
                    (Some(kind), _) if kind == "compaction_delta" => Kind::held(
                        delta
                            .content
                            .as_ref()
                            .map_or_else(String::new, |t| t.value.to_string()),
                    ),
                    _ => {
                        self.hold_json(delta.json_texts());
                        delta.held_text().map_or(Kind::Other, Kind::held)
                    }
                }
            }
            // A thinking block's events are held, its start too: its text
            // is signed, so it can be neither re-framed nor redacted. So
            // is a compaction block's, whose text is the model's summary
            // of the conversation (`content`, in its start or its delta).
            Some("content_block_start")
                if matches!(
                    event.content_block.kind.as_deref(),
                    Some("thinking" | "compaction")
                ) =>
            {
                self.separate_held();
                let block = &event.content_block;
                let summary = block.content.as_ref().map(|t| &*t.value);
                Kind::Held {
                    text: block.held_text().unwrap_or_default() + summary.unwrap_or_default(),
                    finished: false,
                    opens: Some(event.index.unwrap_or(0)),
                    whole: false,
                }
            }
            // A server tool's result, or the tools an MCP server listed,
            // come whole in their block's start.
            Some("content_block_start")
                if event.content_block.kind.as_deref().is_some_and(|kind| {
                    kind.ends_with("_tool_result") || kind == "mcp_tool_listing"
                }) =>
            {
                self.scan_tool_results(data);
                Kind::BlockStart {
                    block: event.index.unwrap_or(0),
                    text: String::new(),
                }
            }
            // A tool's input written in its block's start, which the API
            // sends empty: held with the block's input deltas, as JSON.
            Some("content_block_start")
                if event
                    .content_block
                    .input
                    .is_some_and(|input| input.trim() != "{}") =>
            {
                self.separate_held();
                let input = event.content_block.input.unwrap_or_default();
                self.hold_json(std::iter::once(input));
                Kind::Held {
                    text: input.to_owned(),
                    finished: false,
                    opens: Some(event.index.unwrap_or(0)),
                    whole: false,
                }
            }
            Some("content_block_start") => Kind::BlockStart {
                block: event.index.unwrap_or(0),
                text: event
                    .content_block
                    .text
                    .as_ref()
                    .map(|t| t.value.to_string())
                    .unwrap_or_default(),
            },
            // A message begun with content, which the API never sends, but
            // the SDKs' helpers would show: held until its text is read.
            Some("message_start") if event.message.is_some() => {
                let message = event.message.unwrap_or_default().as_bytes();
                match exchange::ResponseBody::read(Endpoint::Messages, message) {
                    Ok(read) => {
                        let texts: Vec<&str> = read.texts.iter().map(|t| &*t.text).collect();
                        Kind::held(texts.join("\n"))
                    }
                    Err(_) => Kind::Malformed,
                }
            }
            Some("content_block_stop") => Kind::BlockEnd,
            Some("message_delta") => Kind::Final,
            Some("message_stop") => Kind::Done,
            Some("error") => Kind::Error,
            _ => Kind::Other,
        }
    }

    /// Keeps the chunk `data` as the template of re-framed chunks, and the
    /// parts of a text chunk around its text: `data`'s own, cut at
    /// `plain` (the place of its text, when the chunk is a plain text
    /// chunk, see [`plain_text`]), or else the template's as
    /// [`Guard::openai_chunk`] makes it.
    fn set_template(&mut self, data: &str, plain: Option<Range<usize>>) {
        self.template = Some(data.to_owned());
        self.template_tree = OnceCell::new();
        if let Some(text) = plain {
            self.text_frame_parts = Some((
                format!("data: {}", &data[..text.start]),
                format!("{}\n\n", &data[text.end..]),
            ));
            return;
        }
        // No text holds NUL characters; the marker cannot occur otherwise.
        const MARKER: &str = "\0fairgate\0";
        let frame = json_text(&self.openai_chunk(MARKER, Value::Null));
        let marker = json_text(&Value::from(MARKER));
        self.text_frame_parts = frame
            .split_once(&marker)
            .map(|(before, after)| (format!("data: {before}"), format!("{after}\n\n")));
    }

    fn monitor(&mut self, event: SseEvent, kind: Kind) -> Vec<Bytes> {
        match kind {
            Kind::Text { text, .. } => self.acc.push_str(text.of_event(&event)),
            Kind::Held { text, .. } => self.push_held(&text),
            Kind::BlockStart { .. } => self.separate_held(),
            Kind::Malformed => self.malformed = true,
            Kind::Done => {
                self.finished = true;
                self.scan_window(0);
                self.scan_held(true);
            }
            _ => {}
        }
        vec![event.raw]
    }

    fn buffer(&mut self, event: SseEvent, kind: Kind) -> Vec<Bytes> {
        match kind {
            Kind::Text { text, block } => {
                let start = self.acc.len();
                self.push_text(text.of_event(&event));
                self.held
                    .push((event, Some((start, self.acc.len(), block))));
                Vec::new()
            }
            Kind::BlockStart { .. } => {
                self.separate_block();
                self.held.push((event, None));
                Vec::new()
            }
            Kind::Held { text, .. } => {
                self.push_held(&text);
                self.held.push((event, None));
                Vec::new()
            }
            Kind::Malformed => {
                self.malformed = true;
                self.finished = true;
                self.replay_or_block()
            }
            Kind::Done => {
                self.held.push((event, None));
                self.finished = true;
                self.replay_or_block()
            }
            _ => {
                self.held.push((event, None));
                Vec::new()
            }
        }
    }

    fn holdback(&mut self, event: SseEvent, kind: Kind) -> Vec<Bytes> {
        // A tool's result that blocks never goes out, nor anything after
        // it: the event that carried it is this one.
        if self.tool_results_block() {
            return self.block();
        }
        match kind {
            Kind::Text { text, block } => {
                // A chat completion has no blocks: held chunks before text
                // (reasoning, or a call, before the answer) go out first,
                // their text scanned whole, and the text after them is
                // scanned apart from the text before. (Elsewhere a block's
                // end releases held events, and an annotation held in a
                // part waits for the part's text to its end.)
                let mut frames = Vec::new();
                if !self.held_frames.is_empty() && self.setup.endpoint == Endpoint::ChatCompletions
                {
                    frames = self.check(true);
                    if self.blocked {
                        return frames;
                    }
                    self.separate_block();
                }
                self.block = block;
                self.block_open = true;
                self.push_text(text.of_event(&event));
                if !self.deferring && self.check_due() {
                    frames.append(&mut self.check(false));
                }
                frames
            }
            Kind::BlockStart { block, .. } => {
                self.separate_block();
                self.block = block;
                self.block_open = true;
                self.after_held(event.raw)
            }
            Kind::Held {
                text,
                finished,
                opens,
                whole,
            } => {
                self.push_held(&text);
                self.held_whole |= whole;
                let frame = self.held_frame(event.raw, opens);
                self.held_frames.push(frame);
                if finished {
                    return self.check(true);
                }
                // Held events go out behind any text before them.
                if !self.held_whole
                    && self.released == self.acc.len()
                    && check_due(self.held_text.len(), self.held_checked)
                {
                    return self.check_held();
                }
                Vec::new()
            }
            Kind::BlockEnd | Kind::Final | Kind::Done => {
                let mut frames = self.check(true);
                if self.blocked {
                    return frames;
                }
                if matches!(kind, Kind::BlockEnd) {
                    self.block_open = false;
                }
                match kind {
                    Kind::Done => self.finished = true,
                    Kind::Final => self.ended = true,
                    _ => {}
                }
                frames.push(event.raw);
                frames
            }
            Kind::Malformed => {
                self.malformed = true;
                let frames = self.check(true);
                self.finished = true;
                frames
            }
            // Chunks of other choices, or of several, and errors never
            // come here (see `on_event`).
            Kind::Choice(_) | Kind::Choices | Kind::Other | Kind::Error => {
                self.after_held(event.raw)
            }
        }
    }

    /// An event sent in order: after the held events, when there are any.
    fn after_held(&mut self, frame: Bytes) -> Vec<Bytes> {
        if self.held_frames.is_empty() {
            return vec![frame];
        }
        let frame = self.held_frame(frame, None);
        self.held_frames.push(frame);
        Vec::new()
    }

    /// Anthropic content blocks are scanned as one text with a line break
    /// between them. The break is never sent: a block is released in full at
    /// its end, before the next one starts.
    fn separate_block(&mut self) {
        self.separate_held();
        // The prefill runs on into the first block's text.
        if self.acc.len() > self.prefill {
            self.acc.push('\n');
            if self.released == self.acc.len() - 1 {
                self.released = self.acc.len();
            }
        }
    }

    /// The held text of two content blocks never runs together.
    fn separate_held(&mut self) {
        self.held_break |= !self.held_text.is_empty() && !self.held_text.ends_with('\n');
    }

    fn push_held(&mut self, text: &str) {
        let from = self.held_text.len();
        if self.held_break && !text.is_empty() {
            self.held_text.push('\n');
            self.held_break = false;
        }
        self.held_text.push_str(text);
        if let Some(decoded) = &mut self.decoded {
            decoded.push(&self.held_text[from..], false);
        }
    }

    /// Held text that is JSON (a call's arguments, a tool's input) reaches
    /// the client's code parsed, its escapes decoded. Once it has an
    /// escape, the text as it stands no longer tells where a match is
    /// under way, so the held text is also kept decoded ([`Decoded`]),
    /// and an event goes out once its text lies before any match under
    /// way in both.
    fn hold_json<'t>(&mut self, mut json: impl Iterator<Item = &'t str>) {
        if self.decoded.is_some()
            || !json.any(|text| memchr::memchr(b'\\', text.as_bytes()).is_some())
        {
            return;
        }
        // The held text so far, decoded up to each unsent event's end.
        let mut decoded = Box::<Decoded>::default();
        decoded.push(&self.held_text[..self.held_released], false);
        decoded.released = decoded.text.len();
        let mut fed = self.held_released;
        for frame in &mut self.held_frames {
            decoded.push(&self.held_text[fed..frame.end], false);
            frame.decoded_end = decoded.text.len();
            fed = frame.end;
        }
        decoded.push(&self.held_text[fed..], false);
        self.decoded = Some(decoded);
    }

    /// An event that waits behind the held text, or carries some of it:
    /// it ends where the held text ends now.
    fn held_frame(&self, raw: Bytes, opens: Option<u64>) -> HeldFrame {
        let end = self.held_text.len();
        let decoded_end = self.decoded.as_ref().map_or(end, |d| d.text.len());
        HeldFrame {
            raw,
            end,
            decoded_end,
            opens,
        }
    }

    /// Whether the text is due a check: see [`CHECK_STEP`].
    fn check_due(&self) -> bool {
        check_due(self.acc.len() - self.prefill, self.checked - self.prefill)
    }

    /// Scans the unreleased text (and enough before it); blocks, or
    /// releases what is safe. When `final_check`, that is all the text,
    /// and the held events too once their text is scanned.
    fn check(&mut self, final_check: bool) -> Vec<Bytes> {
        let window_start = window_start(&self.acc, self.checked, self.released, self.hold());
        // Text scanned to its end already has its hits: the checks at a
        // block's end, the answer's and the stream's (Anthropic's
        // `content_block_stop`, `message_delta` and `message_stop`; OpenAI's
        // finish chunk and `[DONE]`) follow one another with no text between.
        let view = if self.checked == self.acc.len() {
            None
        } else {
            self.checked = self.acc.len();
            self.scan_window(window_start)
        };
        if final_check {
            self.scan_held(true);
        }
        if self.should_block() {
            return self.block();
        }
        let safe = if final_check {
            self.acc.len()
        } else {
            let view = view.unwrap_or_else(|| Normalized::new(&self.acc[window_start..]));
            let rules = &self.setup.rules;
            // A match under way may have begun in the prefill.
            let open_from = match window_start < self.prefill {
                true => window_start,
                false => self.released,
            };
            safe_end(
                rules,
                &self.acc,
                self.released,
                open_from,
                window_start,
                &view,
                &self.hits,
            )
        };
        let mut frames = self.release(safe);
        if final_check && !self.held_frames.is_empty() {
            frames.append(&mut self.release_held(self.held_text.len(), usize::MAX));
        }
        frames
    }

    /// Holdback of held text, as of text: scans its unsent part (and
    /// enough before it); blocks, or sends the held events whose text
    /// lies before any match under way. They go out as they came, so a
    /// long thinking block or call streams rather than arriving at once.
    fn check_held(&mut self) -> Vec<Bytes> {
        let ((from, view), decoded_window) = self.scan_held(false);
        if self.should_block() {
            return self.block();
        }
        let view = view.unwrap_or_else(|| Normalized::new(&self.held_text[from..]));
        let (rules, text) = (&self.setup.rules, &self.held_text);
        let safe = safe_end(
            rules,
            text,
            self.held_released,
            self.held_released,
            from,
            &view,
            &self.held_hits,
        );
        let decoded_safe = match (&self.decoded, decoded_window) {
            (Some(decoded), Some(window)) => decoded.safe_end(rules, window),
            _ => usize::MAX,
        };
        self.release_held(safe, decoded_safe)
    }

    /// Sends the held events whose text ends by `safe`, and by
    /// `decoded_safe` in the decoded text (and the events waiting behind
    /// them); all of them when `safe` is the end.
    fn release_held(&mut self, safe: usize, decoded_safe: usize) -> Vec<Bytes> {
        let mut count = self
            .held_frames
            .iter()
            .take_while(|f| f.end <= safe && f.decoded_end <= decoded_safe)
            .count();
        // A block's start waits for its first text: a block that ends
        // blocked before any went out is never begun.
        while count < self.held_frames.len()
            && count > 0
            && self.held_frames[count - 1].opens.is_some()
        {
            count -= 1;
        }
        let mut frames = Vec::with_capacity(count);
        for frame in self.held_frames.drain(..count) {
            self.held_released = frame.end;
            if let Some(decoded) = &mut self.decoded {
                decoded.released = frame.decoded_end;
            }
            if let Some(block) = frame.opens {
                // A block the client saw start must be ended, if blocked.
                self.block = block;
                self.block_open = true;
            }
            frames.push(frame.raw);
        }
        if self.held_frames.is_empty() {
            self.held_whole = false;
        }
        frames
    }

    /// Scans the held text not scanned yet (and enough before it: see
    /// `window_start`), keeping new hits, and so its decoded text, to the
    /// end when `last`; returns the window of each.
    fn scan_held(&mut self, last: bool) -> (Window, Option<Window>) {
        let hold = self.hold();
        let decoded = self.decoded.as_mut().map(|decoded| {
            if last {
                decoded.push("", true);
            }
            decoded.scan(&self.setup.rules, hold)
        });
        let text = &self.held_text;
        let from = window_start(text, self.held_checked, self.held_released, hold);
        if self.held_checked == text.len() {
            return ((from, None), decoded);
        }
        self.held_checked = text.len();
        let view = scan_into(&self.setup.rules, text, from, &mut self.held_hits);
        ((from, view), decoded)
    }

    /// The request's hits and the response's so far.
    fn all_hits(&self) -> Vec<Hit> {
        let mut all = self.setup.request_hits.clone();
        all.extend(self.response_hits());
        all
    }

    /// The hits in the text this guard read.
    fn response_hits(&self) -> impl Iterator<Item = Hit> + '_ {
        // A rule found in the decoded text that the text as it stands
        // showed too counts once.
        let decoded = self.decoded.iter().flat_map(|decoded| &decoded.hits);
        let decoded = decoded.filter(|hit| !self.held_hits.iter().any(|h| h.rule == hit.rule));
        let all = self.hits.iter().chain(&self.held_hits).chain(decoded);
        all.chain(&self.repeated_hits)
            .chain(&self.context_hits)
            .cloned()
    }

    /// The text this guard read, redacted, and the text it held after it.
    fn read_text(&self) -> String {
        let mut text = self.redacted(self.prefill, self.acc.len());
        if !self.held_text.is_empty() {
            text.push('\n');
            text.push_str(&self.held_text);
        }
        text
    }

    fn hold(&self) -> usize {
        hold(&self.setup.rules)
    }

    /// Scans `acc[window_start..]`, keeping new hits; returns the window's
    /// normalized view when the scan made one. A redaction that begins in
    /// text sent already blocks: it can no longer be replaced whole.
    /// Holdback never sends the start of a match under way, but a part's
    /// end sends all of its text, and an upstream may go on with a part it
    /// ended (whose text the SDKs join).
    fn scan_window(&mut self, window_start: usize) -> Option<Normalized> {
        let view = scan_into(&self.setup.rules, &self.acc, window_start, &mut self.hits);
        if window_start < self.prefill {
            super::continuation_hits(&mut self.hits, self.prefill);
        }
        let released = self.released;
        let sent_in_part = |hit: &&mut Hit| hit.start < released && released < hit.end;
        super::redactions_block(self.hits.iter_mut().filter(sent_in_part));
        view
    }

    /// Whether a hit blocks, or the total risk does. Held text cannot be
    /// redacted piece by piece, so a redaction in it blocks too.
    fn should_block(&self) -> bool {
        if self.hits.iter().any(|h| h.action == Action::Block)
            || self
                .held_hits
                .iter()
                .chain(self.decoded.iter().flat_map(|decoded| &decoded.hits))
                .any(|h| matches!(h.action, Action::Block | Action::Redact))
            || self.tool_results_block()
        {
            return true;
        }
        risk::assess(&self.setup.risk, self.all_hits(), &self.setup.relevance).decision
            == Decision::Block
    }

    /// Whether what a tool gave the model blocks.
    fn tool_results_block(&self) -> bool {
        self.context_hits.iter().any(|h| h.action == Action::Block)
    }

    /// Scans, as context, what a hosted or server tool gave the model and
    /// event `data` carries whole (see [`exchange::streamed_tool_results`]).
    /// A `redact` hit rewrites the text in the event's data, which goes
    /// on in its place (`redacted_data`), but in monitor mode.
    fn scan_tool_results(&mut self, data: &str) {
        let Ok(texts) = exchange::streamed_tool_results(self.dialect, data) else {
            return;
        };
        let mut edits = Vec::new();
        for text in texts {
            // A Responses API item's start and end may both carry it: read
            // once, and redacted alike in both.
            let redacted = self
                .context_redactions
                .iter()
                .find(|(from, _)| *from == text.text);
            if let Some((_, redacted)) = redacted {
                edits.push((text.span, redacted.clone()));
                continue;
            }
            if self.context_texts.iter().any(|seen| *seen == text.text) {
                continue;
            }
            let hits = self.setup.rules.scan(Scope::Context, &text.text);
            let kept = match hits.iter().any(|h| h.action == Action::Redact) {
                true => {
                    let redacted = redact(&text.text, &hits);
                    edits.push((text.span, redacted.clone()));
                    self.context_redactions
                        .push((text.text.into_owned(), redacted.clone()));
                    redacted
                }
                false => text.text.into_owned(),
            };
            self.context_hits.extend(hits);
            self.context_texts.push(kept);
        }
        if !edits.is_empty() && self.setup.mode != StreamMode::Monitor {
            let data = crate::json::splice(data.as_bytes(), &edits);
            self.redacted_data = String::from_utf8(data.into()).ok();
        }
    }

    /// Appends a text event's text to `acc`, with its logprobs.
    fn push_text(&mut self, text: &str) {
        let start = self.acc.len();
        self.acc.push_str(text);
        if let Some(entries) = self.pending_logprobs.take() {
            self.logprobs.push((start..self.acc.len(), entries));
        }
        if let Some(running) = self.running_usage.as_deref_mut()
            && let Some(usage) = running.reading.take()
        {
            running.pending.push_back((self.acc.len(), usage));
        }
    }

    /// The running usage a re-framed chunk whose text ends at `to` carries
    /// (see [`RunningUsage`]), when the stream's text chunks have one.
    fn take_usage(&mut self, to: usize) -> Option<Value> {
        let running = self.running_usage.as_deref_mut()?;
        let mut latest = None;
        while let Some((end, _)) = running.pending.front()
            && *end <= to
        {
            latest = running.pending.pop_front().map(|(_, usage)| usage);
        }
        if let Some(value) = latest.and_then(|usage| serde_json::from_str(&usage).ok()) {
            running.shown = Some(value);
        }
        running.shown.clone()
    }

    /// The logprobs entries of the chunks whose text ends by `to` and were
    /// not sent yet, but for those of redacted text.
    fn take_logprobs(&mut self, to: usize) -> Vec<Value> {
        let mut entries = Vec::new();
        while let Some((range, chunk)) = self.logprobs.get(self.logprobs_sent) {
            if range.end > to {
                break;
            }
            let redacted = self
                .hits
                .iter()
                .any(|h| h.action == Action::Redact && h.start < range.end && range.start < h.end);
            if !redacted {
                entries.extend(chunk.iter().cloned());
            }
            self.logprobs_sent += 1;
        }
        entries
    }

    /// Sends `acc[released..safe]`, redacted, as re-framed text.
    fn release(&mut self, safe: usize) -> Vec<Bytes> {
        if safe <= self.released {
            return Vec::new();
        }
        let text = self.redacted(self.released, safe);
        self.released = safe;
        if text.is_empty() {
            return Vec::new();
        }
        vec![self.text_frame_with(&text, self.block, safe)]
    }

    /// `acc[from..to]` with the redact hits inside it replaced, as
    /// [`redact`] replaces them: matches that overlap go as one, under the
    /// first one's placeholder.
    fn redacted(&self, from: usize, to: usize) -> String {
        let inside = self.hits.iter().filter(|h| h.end <= to);
        redact_spans(&self.acc[from..to], redacted_spans(inside, from))
    }

    /// A re-framed chat completion chunk of `text`, which ends at `to` in
    /// `acc`, that carries the `logprobs` entries of the chunks it
    /// completes, when the stream has them, their running `usage`, when
    /// they have one, and the message's `role`, when the chunk that began
    /// the text gave it and none went out yet; else as
    /// [`Guard::text_frame`].
    fn text_frame_with(&mut self, text: &str, block: u64, to: usize) -> Bytes {
        let logprobs = self.take_logprobs(to);
        if self.setup.endpoint == Endpoint::Responses {
            return self.responses_text_frame(text, block, logprobs);
        }
        let usage = self.take_usage(to);
        // Only a chat completion's chunk gives one.
        let role = self.role.take();
        if role.is_none()
            && usage.is_none()
            && (self.logprobs.is_empty() || self.dialect != Dialect::OpenAi)
        {
            return self.text_frame(text, block);
        }
        let mut chunk = self.openai_chunk(text, Value::Null);
        if let Some(usage) = usage {
            chunk["usage"] = usage;
        }
        if let Some(choice) = chunk.pointer_mut("/choices/0") {
            if let Some(role) = role
                && let Some(delta) = choice.get_mut("delta").and_then(Value::as_object_mut)
            {
                delta.insert("role".into(), json!(role));
            }
            if !self.logprobs.is_empty() {
                choice["logprobs"] = json!({"content": logprobs, "refusal": null});
            }
        }
        sse(None, &chunk)
    }

    fn text_frame(&self, text: &str, block: u64) -> Bytes {
        if self.setup.endpoint == Endpoint::Responses {
            return self.responses_text_frame(text, block, Vec::new());
        }
        match self.dialect {
            Dialect::Anthropic => anthropic_text_frame(text, block),
            Dialect::OpenAi => match &self.text_frame_parts {
                Some((before, after)) => around(before, text, after),
                None => sse(None, &self.openai_chunk(text, Value::Null)),
            },
        }
    }

    /// A Responses API text delta of `text` in content part `block`, like
    /// the part's first, with `logprobs`.
    fn responses_text_frame(&self, text: &str, block: u64, logprobs: Vec<Value>) -> Bytes {
        match self.part_templates.iter().find(|t| t.part == block) {
            Some(template) => template.frame(text, logprobs),
            None => PartTemplate::new(block, Map::new()).frame(text, logprobs),
        }
    }

    /// A chunk like the upstream's, carrying `text` and `finish_reason`.
    fn openai_chunk(&self, text: &str, finish_reason: Value) -> Value {
        let tree = self.template_tree.get_or_init(|| {
            let template = self.template.as_deref()?;
            serde_json::from_str(template).ok()
        });
        let mut chunk = tree
            .clone()
            .unwrap_or_else(|| json!({"choices": [{"index": self.choice}]}));
        // This guard's choice only: the template's others have their text.
        if let Some(Value::Array(choices)) = chunk.get_mut("choices") {
            choices.truncate(1);
        }
        if let Some(choice) = chunk.get_mut("choices").and_then(|c| c.get_mut(0)) {
            if self.setup.endpoint == Endpoint::Completions {
                choice["text"] = json!(text);
            } else if text.is_empty() {
                choice["delta"] = json!({});
            } else {
                choice["delta"] = json!({"content": text});
            }
            choice["finish_reason"] = finish_reason;
            // The template's belong to its own text.
            if let Some(logprobs) = choice.get_mut("logprobs") {
                *logprobs = Value::Null;
            }
        }
        // The template's belongs to its own text; a `null` one (every
        // chunk's but the last, when the client asked for usage) stays.
        if let Some(object) = chunk.as_object_mut()
            && object.get("usage").is_some_and(|usage| !usage.is_null())
        {
            object.remove("usage");
        }
        chunk
    }

    /// Ends the stream with the dialect's refusal: OpenAI, every choice
    /// that has not ended yet gets its `content_filter` chunk (the guard
    /// of another choice ends only its own; the stream's end is this
    /// guard's).
    fn block(&mut self) -> Vec<Bytes> {
        // Its choice is still open: its end not sent, nor blocked already.
        let open = !self.ended && !self.blocked;
        self.blocked = true;
        self.finished = true;
        if self.setup.endpoint == Endpoint::Responses {
            return vec![self.responses_ending()];
        }
        if self.dialect == Dialect::Anthropic {
            // A message whose start the client has not had (buffer mode
            // sends nothing before the end; a start with content is held)
            // begins the ending with it, without content: the SDKs' stream
            // helpers build the message from it and take no event before.
            let unsent = (self.held.iter().map(|(event, _)| &event.raw))
                .chain(self.held_frames.iter().map(|frame| &frame.raw));
            let mut frames: Vec<Bytes> = unsent.filter_map(empty_start).take(1).collect();
            if self.block_open {
                frames.push(sse(
                    Some("content_block_stop"),
                    &json!({"type": "content_block_stop", "index": self.block}),
                ));
            }
            let details = respond::refusal_details(&super::block_message(&self.all_hits()));
            frames.push(sse(
                Some("message_delta"),
                &json!({"type": "message_delta", "delta": {"stop_reason": "refusal", "stop_sequence": null,
                    "stop_details": details}, "usage": {"output_tokens": 0}}),
            ));
            frames.push(sse(Some("message_stop"), &json!({"type": "message_stop"})));
            return frames;
        }
        let filtered = |guard: &Guard| sse(None, &guard.openai_chunk("", json!("content_filter")));
        let mut frames: Vec<Bytes> = open.then(|| filtered(self)).into_iter().collect();
        if self.choice != 0 {
            return frames;
        }
        for guard in &mut self.others {
            if !guard.ended && !guard.blocked {
                guard.finished = true;
                guard.ended = true;
                frames.push(filtered(guard));
            }
        }
        if self.setup.include_usage && self.usage.is_none() {
            self.awaiting_usage = true;
        } else if self.setup.include_usage {
            frames.extend([self.usage_frame(), Bytes::from_static(DONE)]);
        } else {
            frames.push(Bytes::from_static(DONE));
        }
        frames
    }

    /// A blocked Responses API stream's last event: the response it began
    /// with, incomplete for `content_filter`, with no output.
    fn responses_ending(&self) -> Bytes {
        let event = self.response_event.as_deref();
        let mut response = match event.and_then(|data| serde_json::from_str(data).ok()) {
            Some(Value::Object(mut event)) => match event.remove("response") {
                Some(Value::Object(response)) => response,
                _ => Map::new(),
            },
            _ => Map::new(),
        };
        response.insert("status".into(), json!("incomplete"));
        response.insert(
            "incomplete_details".into(),
            json!({"reason": "content_filter"}),
        );
        response.insert("output".into(), json!([]));
        if self.usage.is_some() {
            response.insert("usage".into(), self.usage_value());
        }
        sse(
            Some("response.incomplete"),
            &json!({"type": "response.incomplete", "sequence_number": 0, "response": response}),
        )
    }

    /// OpenAI's usage chunk: no choices, the upstream's usage (null if it
    /// never reported one).
    fn usage_frame(&self) -> Bytes {
        let mut chunk = self.openai_chunk("", Value::Null);
        chunk["choices"] = json!([]);
        chunk["usage"] = self.usage_value();
        sse(None, &chunk)
    }

    /// Whether the stream was blocked and still owes its usage chunk.
    pub fn awaiting_usage(&self) -> bool {
        self.awaiting_usage && self.usage.is_none()
    }

    /// Reads the usage, if any, of an upstream event after a block; returns
    /// whether the upstream is done.
    pub fn drain_event(&mut self, event: &SseEvent) -> bool {
        let Some(data) = event.data.as_deref() else {
            return false;
        };
        if data.trim() == "[DONE]" {
            return true;
        }
        if let Ok(Some(usage)) = Event::read(data).map(|event| event.usage) {
            self.note_usage(usage);
        }
        self.usage.is_some()
    }

    /// The end of a blocked stream that waited for its usage.
    pub fn usage_ending(&mut self) -> Vec<Bytes> {
        self.awaiting_usage = false;
        vec![self.usage_frame(), Bytes::from_static(DONE)]
    }

    /// Buffer mode at the end: the whole response is known.
    fn replay_or_block(&mut self) -> Vec<Bytes> {
        self.scan_window(0);
        self.scan_held(true);
        if self.should_block() {
            return self.block();
        }
        let redacting = self.hits.iter().any(|h| h.action == Action::Redact);
        let held = std::mem::take(&mut self.held);
        let mut frames = Vec::new();
        let mut sent_blocks: Vec<u64> = Vec::new();
        for (event, text) in &held {
            match *text {
                Some((_, _, block)) if redacting => {
                    // The first text event of a block carries the block's
                    // whole (redacted) text; the others are dropped.
                    if !sent_blocks.contains(&block) {
                        sent_blocks.push(block);
                        let (from, to) = self.block_range(&held, block);
                        let text = self.redacted(from, to);
                        frames.push(self.text_frame_with(&text, block, to));
                    }
                    // A finish that came with text goes on after it.
                    if self.dialect == Dialect::OpenAi
                        && let Some((_, finish)) = split_finish(event, self.setup.endpoint)
                    {
                        frames.push(finish.raw);
                    }
                }
                _ => frames.push(event.raw.clone()),
            }
        }
        self.released = self.acc.len();
        self.ended = true;
        frames
    }

    /// The text range of one content block among the held events.
    fn block_range(&self, held: &[Held], block: u64) -> (usize, usize) {
        let ranges = held.iter().filter_map(|(_, t)| t.filter(|t| t.2 == block));
        let from = ranges.clone().map(|t| t.0).min().unwrap_or(0);
        let to = ranges.map(|t| t.1).max().unwrap_or(from);
        (from, to)
    }
}

/// A chunk of several choices (`choices` holding more than one item) as
/// the chunks of one choice each that OpenAI sends, in order: each the
/// chunk with that one choice, the chunk's `usage` on the last (`null` on
/// the others). None when it is not a JSON object, or holds more choices
/// than the API allows.
fn split_choices(event: &SseEvent) -> Option<Vec<SseEvent>> {
    let mut chunk: Map<String, Value> = serde_json::from_str(event.data.as_deref()?).ok()?;
    let Some(Value::Array(choices)) = chunk.remove("choices") else {
        return None;
    };
    if choices.len() > MAX_CHOICES {
        return None;
    }
    let usage = chunk.remove("usage");
    let last = choices.len().saturating_sub(1);
    choices
        .into_iter()
        .enumerate()
        .map(|(at, choice)| {
            let mut piece = chunk.clone();
            piece.insert("choices".into(), Value::Array(vec![choice]));
            if let Some(usage) = &usage {
                let usage = if at == last {
                    usage.clone()
                } else {
                    Value::Null
                };
                piece.insert("usage".into(), usage);
            }
            parse_event(sse(event.event.as_deref(), &Value::Object(piece)))
        })
        .collect()
}

/// An OpenAI chunk of one choice that carries both text and its finish,
/// as the two chunks the API itself sends: the text, `finish_reason` null
/// and with no `usage`; then the finish, with no text (an empty delta),
/// no `logprobs`, and the chunk's `usage`. Read as one, its finish would
/// be lost: its text is re-framed as it is released, and a re-framed
/// chunk carries text only. `None` for a chunk of several choices, or
/// with no finish.
fn split_finish(event: &SseEvent, endpoint: Endpoint) -> Option<(SseEvent, SseEvent)> {
    let mut finish: Value = serde_json::from_str(event.data.as_deref()?).ok()?;
    let one = finish["choices"].as_array().is_some_and(|c| c.len() == 1);
    if !one || finish["choices"][0]["finish_reason"].is_null() {
        return None;
    }
    let mut text = finish.clone();
    text.pointer_mut("/choices/0")?["finish_reason"] = Value::Null;
    text.as_object_mut()?.remove("usage");
    let choice = finish.pointer_mut("/choices/0")?;
    match endpoint {
        Endpoint::Completions => choice["text"] = json!(""),
        _ => choice["delta"] = json!({}),
    }
    if let Some(logprobs) = choice.get_mut("logprobs") {
        *logprobs = Value::Null;
    }
    let name = event.event.as_deref();
    Some((
        parse_event(sse(name, &text))?,
        parse_event(sse(name, &finish))?,
    ))
}

/// Whether `data`, an OpenAI chunk whose text is at `token`, is plain: a
/// chunk that carries other text is this one with only that string
/// changed, as [`Guard::openai_chunk`] would make it (one choice, its
/// delta, in chat, holding the text alone, `finish_reason` null, no
/// `logprobs` and no `usage`), written on one line (a chunk's frame is
/// one `data:` line). Such a chunk is cut around its text without
/// building its JSON tree, and re-framed chunks keep the upstream's order
/// of members.
fn plain_text(event: &Event, data: &str, token: &Range<usize>, endpoint: Endpoint) -> bool {
    let choice = &event.choice;
    let (before, after) = (&data[..token.start], &data[token.end..]);
    let alone = match endpoint {
        Endpoint::ChatCompletions => {
            before.ends_with(r#""delta":{"content":"#) && after.starts_with('}')
        }
        Endpoint::Completions => before.ends_with(r#""text":"#),
        _ => false,
    };
    alone
        && !choice.several
        && !choice.finished
        && choice.logprobs.is_none()
        && event.usage.is_none()
        && memchr::memmem::find(data.as_bytes(), br#""finish_reason":null"#).is_some()
        && memchr::memchr(b'\n', data.as_bytes()).is_none()
}

/// An Anthropic `content_block_delta` of `text` in block `block`, its
/// members in the API's order, written straight out: no JSON tree.
fn anthropic_text_frame(text: &str, block: u64) -> Bytes {
    const HEAD: &[u8] =
        b"event: content_block_delta\ndata: {\"type\":\"content_block_delta\",\"index\":";
    let mut frame = Vec::with_capacity(HEAD.len() + text.len() + 64);
    frame.extend_from_slice(HEAD);
    frame.extend_from_slice(itoa::Buffer::new().format(block).as_bytes());
    frame.extend_from_slice(br#","delta":{"type":"text_delta","text":"#);
    // Writing a string into a Vec cannot fail; escaped, it holds no line end.
    let _ = serde_json::to_writer(&mut frame, text);
    frame.extend_from_slice(b"}}\n\n");
    Bytes::from(frame)
}

/// The usage objects `known` and `found` (JSON texts, checked) as one:
/// the members of both, `found`'s where both have one, in the order of
/// their names. Read as members of raw values, not as trees, unless a
/// name has escapes.
fn merged_usage(known: &str, found: &str) -> String {
    type Members<'a> = std::collections::BTreeMap<&'a str, &'a serde_json::value::RawValue>;
    if let (Ok(mut members), Ok(later)) = (
        serde_json::from_str::<Members>(known),
        serde_json::from_str::<Members>(found),
    ) {
        members.extend(later);
        // Names and raw values always serialize.
        return serde_json::to_string(&members).unwrap_or_default();
    }
    let tree = |text| serde_json::from_str::<Map<String, Value>>(text).unwrap_or_default();
    let mut members = tree(known);
    members.extend(tree(found));
    json_text(&Value::Object(members))
}

/// `value` as JSON text. Written straight into a buffer: its `Display`
/// (`to_string`) goes through the formatter, a call per piece.
fn json_text(value: &Value) -> String {
    // A `Value` always serializes: its keys are strings.
    serde_json::to_string(value).unwrap_or_default()
}

fn sse(event: Option<&str>, data: &Value) -> Bytes {
    sse_text(event, &json_text(data))
}

/// Whether a Responses API event's data is a text delta's
/// (`response.output_text.delta`), by its `type`, as the SDKs know an
/// event, whatever its SSE name. Known from the bytes when the type is
/// written first, as the APIs write it (a type written there with escapes
/// reads as another: the event's repeated texts are looked for, which
/// loses nothing); otherwise read as JSON.
fn is_text_delta(data: &str) -> bool {
    const FIRST: &str = r#"{"type":""#;
    const TEXT_DELTA: &str = "response.output_text.delta";
    if let Some(kind) = data.strip_prefix(FIRST) {
        return kind
            .strip_prefix(TEXT_DELTA)
            .is_some_and(|rest| rest.starts_with('"'));
    }
    let mut delta = false;
    let mut reader = Reader::new(data);
    let _ = reader.is_object().and_then(|object| match object {
        true => reader.object(["type"], |reader, _| {
            delta = reader
                .string()?
                .is_some_and(|kind| kind.value == TEXT_DELTA);
            Ok(())
        }),
        false => Ok(()),
    });
    delta
}

/// Where `part` starts in `whole`, when it is a piece of it.
fn offset_in(whole: &[u8], part: &[u8]) -> Option<usize> {
    let at = (part.as_ptr() as usize).checked_sub(whole.as_ptr() as usize)?;
    (at + part.len() <= whole.len()).then_some(at)
}

/// An event of `data`, one `data:` line per line of it.
fn sse_text(event: Option<&str>, data: &str) -> Bytes {
    let mut out = String::with_capacity(data.len() + 32);
    if let Some(event) = event {
        out.push_str("event: ");
        out.push_str(event);
        out.push('\n');
    }
    for line in data.split('\n') {
        out.push_str("data: ");
        out.push_str(line);
        out.push('\n');
    }
    out.push('\n');
    Bytes::from(out)
}

/// The strings of a Responses API event that repeat response text: a
/// done event's `text`, `refusal`, `arguments`, `input` (a custom tool's),
/// `code` or `command` (a shell's), and those of the `part`, the `item`
/// (its `content` or reasoning `summary`; what a hosted tool's call tells
/// it to do, in its `action`, `actions` or `operation`: see
/// `exchange::Texts::call_words`) or the `response.output` it carries.
fn repeated_texts<'a>(reader: &mut Reader<'a>, out: &mut Vec<Text<'a>>) -> Result<(), ReadError> {
    const KEYS: [&str; 18] = [
        "text",
        "refusal",
        "arguments",
        "input",
        "code",
        "query",
        "diff",
        "command",
        "commands",
        "part",
        "item",
        "response",
        "action",
        "operation",
        "content",
        "output",
        "summary",
        "actions",
    ];
    if !reader.is_object()? {
        return Ok(());
    }
    let string = |reader: &mut Reader<'a>, out: &mut Vec<Text<'a>>| {
        out.extend(reader.string()?);
        Ok(())
    };
    reader.every_member(KEYS, |reader, key| match KEYS[key] {
        "part" | "item" | "response" | "action" | "operation" => repeated_texts(reader, out),
        "content" | "output" | "summary" | "actions" => {
            items(reader, |item| repeated_texts(item, out))
        }
        "commands" => items(reader, |item| string(item, out)),
        // A string, or strings.
        "command" => {
            let span = reader.span()?;
            string(&mut reader.part(span.clone()), out)?;
            items(&mut reader.part(span), |item| string(item, out))
        }
        _ => string(reader, out),
    })
}

/// Reads each item of an array, when the value is one.
fn items<'a>(
    reader: &mut Reader<'a>,
    item: impl FnMut(&mut Reader<'a>) -> Result<(), ReadError>,
) -> Result<(), ReadError> {
    match reader.is(Peek::Array)? {
        true => reader.array(item),
        false => Ok(()),
    }
}

/// Replaces, anywhere in `value`, each string that is the first of a
/// pair in `pairs` by the second. Whether any was.
fn replace_strings(value: &mut Value, pairs: &[(String, String)]) -> bool {
    match value {
        Value::String(text) => match pairs.iter().find(|(from, _)| from == text) {
            Some((_, to)) => {
                text.clone_from(to);
                true
            }
            None => false,
        },
        Value::Array(items) => items.iter_mut().fold(false, |changed, item| {
            replace_strings(item, pairs) | changed
        }),
        Value::Object(members) => members.values_mut().fold(false, |changed, item| {
            replace_strings(item, pairs) | changed
        }),
        _ => false,
    }
}

/// Whether a text `len` bytes long, checked to `checked`, is due a check:
/// see [`CHECK_STEP`].
fn check_due(len: usize, checked: usize) -> bool {
    let new = len - checked;
    new >= CHECK_STEP || (new > 0 && len < CHECK_STEP)
}

/// Scans `text[from..]` with the response rules, adding what it finds to
/// `hits`; returns the scan's normalized view when it made one.
fn scan_into(rules: &RuleSet, text: &str, from: usize, hits: &mut Vec<Hit>) -> Option<Normalized> {
    let (found, view) = rules.scan_with_view(Scope::Response, &text[from..]);
    for mut hit in found {
        hit.start += from;
        hit.end += from;
        // A match can grow as text arrives ("a@b.co", then "a@b.com"): the
        // longest is the one that counts.
        match hits
            .iter_mut()
            .find(|h| h.rule == hit.rule && h.start == hit.start)
        {
            Some(known) if known.end < hit.end => *known = hit,
            Some(_) => {}
            None => hits.push(hit),
        }
    }
    view
}

/// Where the scan window of `text` starts, at a clean point, when the last
/// scan read it to `checked` and it is released to `released` (never
/// after `checked`). A match found now ends after `checked` (or grew past
/// it), and no match spans more than `hold` bytes: it starts after
/// `checked - hold`. The window also reaches back to `released`, so that
/// the text the next release can take is in its view (the release point
/// is measured back from the end in normalized bytes, which can be fewer
/// than the raw ones). In a long answer that is about `hold` bytes before
/// the last check rather than `hold` before the release point, which
/// lies `hold` further back: half the bytes scanned again.
pub(crate) fn window_start(text: &str, checked: usize, released: usize, hold: usize) -> usize {
    let back = checked.saturating_sub(hold).min(released);
    if back == 0 {
        return 0;
    }
    clean_point_at_or_before(text, back).unwrap_or(0)
}

/// The longest match of the response rules, and the margin: how far
/// before the last check a scan window starts.
pub(crate) fn hold(rules: &RuleSet) -> usize {
    let limits = rules.match_limits(Scope::Response);
    limits.normalized.max(limits.raw) + MARGIN
}

/// The end of `text` that can be released now, at a clean point, never
/// inside a redaction, never before `released`: before any match that may
/// still be under way (see [`RuleSet::open_match_start`]), begun at
/// `open_from` or later (`released`, or before it in a prefill, which
/// the client has but a match may run on from). Should that
/// search give up, or the unreleased text grow past [`OPEN_SEARCH_MOST`],
/// [`hold`] bytes of the normalized window (which starts at `from`) before
/// its end, which is as safe for every match up to that long.
pub(crate) fn safe_end(
    rules: &RuleSet,
    text: &str,
    released: usize,
    open_from: usize,
    from: usize,
    normalized: &Normalized,
    hits: &[Hit],
) -> usize {
    // What follows the last clean point can still change its view.
    let Some(clean) = clean_point_in(text, released + 1, text.len()) else {
        return released;
    };
    let open = (clean - released <= OPEN_SEARCH_MOST)
        .then(|| {
            let window = &text[from..];
            let open = rules.open_match_start(
                Scope::Response,
                window,
                normalized,
                open_from - from..clean - from,
            );
            open.map(|at| from + at)
        })
        .flatten();
    let at = open.unwrap_or_else(|| {
        let hold = hold(rules);
        if normalized.text.len() <= hold {
            return released;
        }
        let mut cut = normalized.text.len() - hold;
        while !normalized.text.is_char_boundary(cut) {
            cut -= 1;
        }
        from + normalized.original_span(cut..cut).start
    });
    let Some(mut safe) = clean_point_in(text, released + 1, at) else {
        return released;
    };
    // Never split a redaction, nor one that overlaps the one it moved
    // back to.
    let splits = |safe: usize, hit: &&Hit| {
        hit.action == Action::Redact && hit.start < safe && safe < hit.end
    };
    while let Some(hit) = hits.iter().find(|hit| splits(safe, hit)) {
        safe = hit.start;
    }
    safe.max(released)
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use super::*;
    use crate::rules::CompileOptions;

    /// The shipped rules, compiled once for all the tests here.
    static RULES: std::sync::LazyLock<Arc<RuleSet>> = std::sync::LazyLock::new(|| {
        Arc::new(RuleSet::load_dir(Path::new("rules"), &CompileOptions::default()).unwrap())
    });

    fn setup(endpoint: Endpoint, mode: StreamMode) -> StreamSetup {
        StreamSetup {
            endpoint,
            mode,
            rules: RULES.clone(),
            risk: RiskConfig::default(),
            request_hits: Vec::new(),
            relevance: Vec::new(),
            started: Instant::now(),
            include_usage: false,
            prefill: String::new(),
            resume_after: None,
            max_bytes: usize::MAX,
        }
    }

    /// Harmless text of every kind of character JSON writes (quotes,
    /// backslashes, controls, line separators, accents, CJK, emoji), cut
    /// at random into deltas and written as JSON writes it (characters
    /// as they are, or every one but ASCII escaped, as Python's
    /// `json.dumps` writes them; in every event, or some), its lines
    /// ended by `\n`, `\r\n` or `\r` and its bytes read in random pieces,
    /// comes out of the parser and the guard as it went in, in each API's
    /// stream.
    #[test]
    fn any_text_streams_as_it_came_in_every_api() {
        use crate::testing::Lcg;
        let alphabet = [
            "a", "b", "e", "o", "x", "The", "plain", "words", " ", " ", " ", ".", ",", "\"", "\\",
            "/", "\n", "\t", "\r", "\u{1}", "é", "ü", "日本", "😀", "\u{2028}", "\u{7f}", "ß", "İ",
            "ﬁ", "\u{301}", "'", "<", "&",
        ];
        // JSON with every character but ASCII as `\uXXXX`.
        let ascii = |json: String| {
            let escaped = |c: char| match c.is_ascii() {
                true => c.to_string(),
                false => crate::testing::unicode_escaped(c),
            };
            json.chars().map(escaped).collect::<String>()
        };
        let mut random = Lcg(11);
        for round in 0..300 {
            let len = 1 + random.below(40);
            let text: String = (0..len).map(|_| *random.pick(&alphabet)).collect();
            let pieces = random.pieces(&text, 6);
            // Escaped in every event, in none, or in some.
            let escaping = random.below(3);
            let write = |value: Value, random: &mut Lcg| match escaping == 0
                || (escaping == 2 && random.below(2) == 0)
            {
                true => ascii(value.to_string()),
                false => value.to_string(),
            };
            let endpoints = [
                Endpoint::ChatCompletions,
                Endpoint::Completions,
                Endpoint::Messages,
                Endpoint::Responses,
            ];
            let modes = [StreamMode::Holdback, StreamMode::Buffer];
            for (endpoint, mode) in endpoints.into_iter().flat_map(|e| modes.map(|m| (e, m))) {
                let mut guard = Guard::new(setup(endpoint, mode));
                let mut events: Vec<(Option<&str>, Value)> = Vec::new();
                let merged = |at: &Value, extra: Value| {
                    let mut out = at.clone();
                    if let (Some(out), Value::Object(extra)) = (out.as_object_mut(), extra) {
                        out.extend(extra);
                    }
                    out
                };
                let at = json!({"item_id": "m", "output_index": 0, "content_index": 0});
                match endpoint {
                    Endpoint::Messages => {
                        events.push((Some("message_start"), json!({"type": "message_start", "message": {"id": "m", "type": "message", "role": "assistant", "content": [], "usage": {"input_tokens": 1, "output_tokens": 1}}})));
                        events.push((Some("content_block_start"), json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}})));
                    }
                    Endpoint::Responses => {
                        events.push((Some("response.created"), json!({"type": "response.created", "sequence_number": 0, "response": {"id": "r", "status": "in_progress", "output": []}})));
                        events.push((Some("response.content_part.added"), merged(&at, json!({"type": "response.content_part.added", "part": {"type": "output_text", "text": ""}}))));
                    }
                    _ => {}
                }
                for piece in &pieces {
                    let event = match endpoint {
                        Endpoint::ChatCompletions => (
                            None,
                            json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": piece}, "finish_reason": null}]}),
                        ),
                        Endpoint::Completions => (
                            None,
                            json!({"id": "c", "object": "text_completion", "choices": [{"index": 0, "text": piece, "finish_reason": null}]}),
                        ),
                        Endpoint::Messages => (
                            Some("content_block_delta"),
                            json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}}),
                        ),
                        _ => (
                            Some("response.output_text.delta"),
                            merged(
                                &at,
                                json!({"type": "response.output_text.delta", "delta": piece}),
                            ),
                        ),
                    };
                    events.push(event);
                }
                match endpoint {
                    Endpoint::Messages => {
                        events.push((Some("content_block_stop"), json!({"type": "content_block_stop", "index": 0})));
                        events.push((Some("message_delta"), json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}, "usage": {"output_tokens": 2}})));
                        events.push((Some("message_stop"), json!({"type": "message_stop"})));
                    }
                    Endpoint::Responses => {
                        events.push((Some("response.output_text.done"), merged(&at, json!({"type": "response.output_text.done", "text": text}))));
                        events.push((Some("response.completed"), json!({"type": "response.completed", "response": {"id": "r", "status": "completed"}})));
                    }
                    _ => events.push((None, json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {}, "text": "", "finish_reason": "stop"}]}))),
                }
                // The stream's bytes, its lines ended as a server may end
                // them, read in random pieces as `Run` reads them.
                let ending = *random.pick(&["\n", "\r\n", "\r"]);
                let mut body = Vec::new();
                for (name, data) in events {
                    let event = sse_text(name, &write(data, &mut random));
                    let event = String::from_utf8(event.to_vec()).unwrap();
                    body.extend_from_slice(event.replace('\n', ending).as_bytes());
                }
                let (mut parser, mut frames) = (SseParser::default(), Vec::new());
                let mut rest = &body[..];
                while !rest.is_empty() {
                    let cut = (1 + random.below(200)).min(rest.len());
                    let read = Bytes::copy_from_slice(&rest[..cut]);
                    rest = &rest[cut..];
                    guard.deferring = endpoint != Endpoint::Responses;
                    for event in parser.push(read) {
                        frames.extend(guard.on_event(event));
                    }
                    frames.extend(guard.deferred_check());
                }
                frames.extend(
                    parser
                        .finish()
                        .map(|event| guard.on_event(event))
                        .unwrap_or_default(),
                );
                frames.extend(guard.on_end());
                let mut got = String::new();
                for frame in &frames {
                    let frame = String::from_utf8_lossy(frame).replace('\r', "\n");
                    let Some(data) = frame.lines().find_map(|l| l.strip_prefix("data: ")) else {
                        continue;
                    };
                    let Ok(value) = serde_json::from_str::<Value>(data) else {
                        continue;
                    };
                    let piece = match endpoint {
                        Endpoint::ChatCompletions => value.pointer("/choices/0/delta/content"),
                        Endpoint::Completions => value.pointer("/choices/0/text"),
                        Endpoint::Messages => value.pointer("/delta/text"),
                        _ => {
                            (value["type"] == "response.output_text.delta").then(|| &value["delta"])
                        }
                    };
                    got.push_str(piece.and_then(Value::as_str).unwrap_or_default());
                }
                assert_eq!(
                    got, text,
                    "round {round}, {endpoint:?}, {mode:?}, pieces {pieces:?}, escaping {escaping}"
                );
            }
        }
    }

    /// A call's arguments of random harmless JSON text, escapes and all,
    /// with a phrase a rule blocks written somewhere in it (some of its
    /// letters escaped, as `\u0061`), cut at random into deltas: the
    /// stream ends blocked, and what went out of the call before, read
    /// as the client's code reads it (parsed), holds none of the phrase.
    /// Without the phrase the whole call goes out as it came.
    #[test]
    fn a_phrase_in_a_calls_escaped_arguments_never_goes_out() {
        use crate::testing::Lcg;
        let alphabet = [
            "code", "line", "print", " ", " ", " ", "\\n", "\\\"", "\\\\", "\\t", "\\u00e9", "é",
            "(", ")", ":", ".", "x",
        ];
        let phrase = "Put all your savings into one coin.";
        let mut random = Lcg(5);
        for round in 0..200 {
            let words = |random: &mut Lcg, n: usize| -> String {
                (0..n).map(|_| *random.pick(&alphabet)).collect()
            };
            // Some of the phrase's letters escaped.
            let hidden: String = phrase
                .chars()
                .map(|c| match c.is_ascii_lowercase() && random.below(4) == 0 {
                    true => format!("\\u{:04x}", c as u32),
                    false => c.to_string(),
                })
                .collect();
            let (many, few) = (random.below(120), random.below(20));
            let before = words(&mut random, many);
            let after = words(&mut random, few);
            let blocked = random.below(4) != 0;
            let middle = if blocked {
                format!(" {hidden} ")
            } else {
                " ".to_owned()
            };
            let arguments = format!("{{\"code\": \"{before}{middle}{after}\"}}");
            let pieces = random.pieces(&arguments, 12);
            let mut guard = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Holdback));
            let chunk = |delta: Value, finish: Value| {
                let data = json!({"id": "c", "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
                data_event(&data.to_string())
            };
            let mut frames = guard.on_event(chunk(
                json!({"role": "assistant", "tool_calls": [{"index": 0, "id": "call_1", "type": "function", "function": {"name": "write", "arguments": ""}}]}),
                Value::Null,
            ));
            let mut sent_before_end = 0;
            for piece in &pieces {
                let delta = json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]});
                frames.extend(guard.on_event(chunk(delta, Value::Null)));
                sent_before_end = frames.len();
            }
            frames.extend(guard.on_event(chunk(json!({}), json!("tool_calls"))));
            let mut sent = String::new();
            let mut finishes = Vec::new();
            for frame in &frames {
                let frame = String::from_utf8_lossy(frame);
                let Some(data) = frame.trim().strip_prefix("data: ") else {
                    continue;
                };
                let Ok(value) = serde_json::from_str::<Value>(data) else {
                    continue;
                };
                let arguments = value.pointer("/choices/0/delta/tool_calls/0/function/arguments");
                sent.push_str(arguments.and_then(Value::as_str).unwrap_or_default());
                if let Some(finish) = value
                    .pointer("/choices/0/finish_reason")
                    .and_then(Value::as_str)
                {
                    finishes.push(finish.to_owned());
                }
            }
            let context = format!("round {round}: {arguments}");
            if blocked {
                assert_eq!(finishes, ["content_filter"], "{context}");
                let parsed = super::super::json_unescaped(&sent).unwrap_or(sent.clone());
                assert!(!parsed.contains("Put all"), "{context}: sent {sent}");
            } else {
                assert_eq!(finishes, ["tool_calls"], "{context}");
                assert_eq!(sent, arguments, "{context}");
                // And most of it before the end: only what a match may
                // still cover waits.
                assert!(sent_before_end > 1 || arguments.len() < 400, "{context}");
            }
        }
    }

    /// The event of one `data:` line of `data`.
    fn data_event(data: &str) -> SseEvent {
        parse_event(format!("data: {data}\n\n").into_bytes().into()).unwrap()
    }

    fn openai_delta(text: &str) -> SseEvent {
        let data = json!({"id": "c", "object": "chat.completion.chunk", "choices": [{"index": 0, "delta": {"content": text}, "finish_reason": null}]});
        data_event(&data.to_string())
    }

    fn released_text(frames: &[Bytes]) -> String {
        let mut text = String::new();
        for frame in frames {
            let frame = String::from_utf8_lossy(frame);
            if let Some(data) = frame.trim().strip_prefix("data: ")
                && let Ok(v) = serde_json::from_str::<Value>(data)
                && let Some(t) = v
                    .pointer("/choices/0/delta/content")
                    .and_then(Value::as_str)
            {
                text.push_str(t);
            }
        }
        text
    }

    /// What `guard` makes of an event with data `data`.
    fn describe(guard: &mut Guard, data: &str) -> String {
        let event = data_event(data);
        let kind = guard.classify(&event);
        describe_kind(kind, &event)
    }

    fn describe_kind(kind: Kind, event: &SseEvent) -> String {
        match kind {
            Kind::Text { text, block } => format!("text {:?} {block}", text.of_event(event)),
            Kind::BlockEnd => "block end".into(),
            Kind::Held { text, finished, .. } => format!("held {text:?} {finished}"),
            Kind::BlockStart { block, text } => format!("block start {block} {text:?}"),
            Kind::Final => "final".into(),
            Kind::Done => "done".into(),
            Kind::Choice(index) => format!("choice {index}"),
            Kind::Choices => "choices".to_owned(),
            Kind::Other => "other".into(),
            Kind::Error => "error".into(),
            Kind::Malformed => "malformed".into(),
        }
    }

    #[test]
    fn re_framed_text_keeps_a_plain_chunk_as_it_came_and_rebuilds_another() {
        let frame_after = |endpoint: Endpoint, first: &str| {
            let mut guard = Guard::new(setup(endpoint, StreamMode::Holdback));
            // A `data:` line for each line of the data.
            guard.classify(&parse_event(sse_text(None, first)).unwrap());
            String::from_utf8(guard.text_frame("caf\u{e9} \"x\"", 0).to_vec()).unwrap()
        };
        // Plain text chunks: the upstream's bytes, only the text changed.
        let plain = [
            (
                Endpoint::ChatCompletions,
                r#"{"id":"c","object":"chat.completion.chunk","created":1,"choices":[{"index":0,"delta":{"content":"first"},"logprobs":null,"finish_reason":null}],"usage":null,"obfuscation":"pad"}"#,
            ),
            (
                Endpoint::Completions,
                r#"{"id":"c","choices":[{"text":"first","index":0,"logprobs":null,"finish_reason":null}],"model":"m"}"#,
            ),
        ];
        for (endpoint, first) in plain {
            let expected = format!(
                "data: {}\n\n",
                first.replace(r#""first""#, r#""café \"x\"""#)
            );
            assert_eq!(frame_after(endpoint, first), expected, "{first}");
        }
        // Anything more in the chunk (a role, a finish, logprobs, usage,
        // no finish_reason), or a chunk written over
        // several lines (its data several `data:` lines), and the chunk
        // is rebuilt: on one line, the delta holding the text alone,
        // finish_reason null, no usage.
        let rebuilt = [
            "{\"id\":\"c\",\n\"choices\":[{\"index\":0,\"delta\":{\"content\":\"first\"},\"finish_reason\":null}]}",
            "{\"id\":\"c\",\r\n\"choices\":[{\"index\":0,\"delta\":{\"content\":\"first\"},\"finish_reason\":null}]}",
            r#"{"id":"c","choices":[{"index":0,"delta":{"role":"assistant","content":"first"},"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"first","refusal":null},"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"first"},"logprobs":{"content":[]},"finish_reason":null}]}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"first"},"finish_reason":null}],"usage":{"total_tokens":3}}"#,
            r#"{"id":"c","choices":[{"index":0,"delta":{"content":"first"}}]}"#,
        ];
        for first in rebuilt {
            let frame = frame_after(Endpoint::ChatCompletions, first);
            assert!(
                !frame[..frame.len() - 2].contains(['\n', '\r']),
                "{frame:?}"
            );
            let data: Value = serde_json::from_str(
                frame
                    .strip_prefix("data: ")
                    .unwrap()
                    .strip_suffix("\n\n")
                    .unwrap(),
            )
            .unwrap();
            let choice = &data["choices"][0];
            assert_eq!(choice["delta"], json!({"content": "café \"x\""}), "{first}");
            assert_eq!(choice["finish_reason"], Value::Null, "{first}");
            assert!(choice.get("logprobs").is_none_or(Value::is_null), "{first}");
            assert!(data.get("usage").is_none(), "{first}");
            assert_eq!(data["id"], "c", "{first}");
            assert_eq!(data["choices"].as_array().unwrap().len(), 1, "{first}");
        }
    }

    #[test]
    fn a_responses_delta_is_its_parts_first_with_its_own_text_and_logprobs() {
        let first = json!({"type": "response.output_text.delta", "sequence_number": 7,
            "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": "first",
            "logprobs": [{"token": "first", "logprob": -0.1}], "obfuscation": "pad"});
        let Value::Object(first) = first else {
            unreachable!()
        };
        let template = PartTemplate::new(1, first);
        let data = |frame: Bytes| -> Value {
            let frame = String::from_utf8(frame.to_vec()).unwrap();
            let data = frame
                .strip_prefix("event: response.output_text.delta\ndata: ")
                .and_then(|f| f.strip_suffix("\n\n"))
                .unwrap_or_else(|| panic!("one event: {frame:?}"));
            assert!(!data.contains(['\n', '\r']), "one data line: {frame:?}");
            serde_json::from_str(data).unwrap()
        };
        let text = "caf\u{e9} \"x\"\nnext\u{0}";
        let expected = json!({"type": "response.output_text.delta", "sequence_number": 7,
            "item_id": "msg_1", "output_index": 0, "content_index": 0, "delta": text,
            "logprobs": [], "obfuscation": "pad"});
        assert_eq!(data(template.frame(text, Vec::new())), expected);
        let entries = vec![json!({"token": "caf", "logprob": -0.2})];
        let mut with_entries = expected.clone();
        with_entries["logprobs"] = json!(entries);
        assert_eq!(data(template.frame(text, entries)), with_entries);
        // A first delta with no logprobs entries, on one line and
        // numbered, as the APIs write them: its bytes, only the text
        // changed (its members in its order), unless the frame has entries.
        let of_delta_plain = |data: &str, plain: bool| {
            let token = Event::read(data).unwrap().delta_text.unwrap().token;
            PartTemplate::of_delta(1, data, &token, plain)
        };
        let of_delta = |data: &str| of_delta_plain(data, true);
        let plain = r#"{"type":"response.output_text.delta","sequence_number":7,"item_id":"msg_1","output_index":0,"content_index":0,"delta":"first","logprobs":[],"obfuscation":"pad"}"#;
        let template = of_delta(plain);
        let written = plain.replace(r#""first""#, &json_text(&json!(text)));
        let frame = format!("event: response.output_text.delta\ndata: {written}\n\n");
        assert_eq!(template.frame(text, Vec::new()), frame.as_bytes());
        let entries = vec![json!({"token": "caf", "logprob": -0.2})];
        assert_eq!(data(template.frame(text, entries)), with_entries);
        // One with logprobs entries, which are its own text's: read as
        // JSON, its entries not in the deltas written.
        let with_tokens = plain.replace(
            r#""logprobs":[]"#,
            r#""logprobs":[{"token":"first","logprob":-0.1}]"#,
        );
        let template = of_delta_plain(&with_tokens, false);
        assert_eq!(data(template.frame(text, Vec::new())), expected);
        // Written over several lines, or not numbered: read as JSON.
        let lines = plain.replace(r#","item_id""#, "\n,\"item_id\"");
        assert_eq!(data(of_delta(&lines).frame(text, Vec::new())), expected);
        let unnumbered = plain.replace(r#""sequence_number":7,"#, "");
        let mut numbered = expected.clone();
        numbered["sequence_number"] = json!(0);
        assert_eq!(
            data(of_delta(&unnumbered).frame(text, Vec::new())),
            numbered
        );
        // A part with no delta to copy: the members a delta must have.
        let bare = PartTemplate::new(2, Map::new());
        assert_eq!(
            data(bare.frame("a", Vec::new())),
            json!({"type": "response.output_text.delta", "sequence_number": 0, "delta": "a"})
        );
    }

    #[test]
    fn an_event_is_a_text_delta_by_its_type_wherever_it_stands() {
        for (data, delta) in [
            (r#"{"type":"response.output_text.delta","delta":"a"}"#, true),
            (r#"{"delta":"a","type":"response.output_text.delta"}"#, true),
            (r#"{ "type" : "response.output_text.delta"}"#, true),
            (r#"{"type":"response.output_text\u002edelta"}"#, false),
            (
                r#"{"delta":"a","type":"response.output_text\u002edelta"}"#,
                true,
            ),
            (r#"{"type":"response.output_text.deltas"}"#, false),
            (
                r#"{"type":"response.output_item.done","item":{"type":"response.output_text.delta"}}"#,
                false,
            ),
            (
                r#"{"item":{"type":"response.output_text.delta"},"type":"response.completed"}"#,
                false,
            ),
            (
                r#"{"type":"response.reasoning_text.delta","delta":"a"}"#,
                false,
            ),
            (r#"{"type":"response.output_text.delta\u0022"}"#, false),
            (r#"["response.output_text.delta"]"#, false),
            ("", false),
        ] {
            assert_eq!(is_text_delta(data), delta, "{data}");
        }
    }

    #[test]
    fn an_event_shaped_like_the_last_text_reads_as_if_read_in_full() {
        let shapes = [
            (
                Endpoint::ChatCompletions,
                r#"{"id":"c","choices":[{"index":0,"delta":{"content":"#,
                r#"},"finish_reason":null}]}"#,
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"id":"c","choices":[{"index":0,"delta":{"content":"#,
                r#"},"finish_reason":null}],"obfuscation":"pad"}"#,
            ),
            (
                Endpoint::ChatCompletions,
                r#"{"id":"c","choices":[{"index":0,"delta":{"content":"#,
                r#"},"finish_reason":"stop"}],"usage":{"total_tokens":3}}"#,
            ),
            (
                Endpoint::Completions,
                r#"{"choices":[{"text":"#,
                r#","finish_reason":null}]}"#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"#,
                "}}",
            ),
        ];
        let texts = [
            r#""next""#,
            r#" "caf\u00e9 \"x\"" "#,
            r#""""#,
            "7",
            "null",
            r#""a","content":"b","text":"c""#,
            r#""a"}}"#,
            r#""open"#,
        ];
        for (endpoint, before, after) in shapes {
            let mut guard = Guard::new(setup(endpoint, StreamMode::Holdback));
            let first = format!(r#"{before}"first"{after}"#);
            assert!(describe(&mut guard, &first).starts_with("text"), "{first}");
            assert!(guard.shape.is_some(), "{first}");
            // The skipped strings (`id`, the padding) may differ too.
            let others = [
                after.to_owned(),
                after.replace(r#""pad""#, r#""p\u0061d 2""#),
            ];
            for text in texts {
                for after in &others {
                    let data = format!("{before}{text}{after}").replace(r#""c""#, r#""c9""#);
                    let fresh = &mut Guard::new(setup(endpoint, StreamMode::Holdback));
                    assert_eq!(
                        describe(&mut guard, &data),
                        describe(fresh, &data),
                        "{data}"
                    );
                }
            }
        }
    }

    #[test]
    fn events_are_read_by_the_fields_the_guard_needs() {
        let kind = |endpoint, data: &str| {
            let mut guard = Guard::new(setup(endpoint, StreamMode::Holdback));
            describe(&mut guard, data)
        };
        let chat = Endpoint::ChatCompletions;
        let cases = [
            (
                chat,
                r#"{"choices":[{"delta":{"content":"caf\u00e9 \"x\""}}]}"#,
                r#"text "café \"x\"" 0"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{},"finish_reason":null}]}"#,
                "other",
            ),
            (
                chat,
                r#"{"choices":[{"delta":{},"finish_reason":"stop"}]}"#,
                "final",
            ),
            (chat, r#"{"choices":[{"delta":{"content":7}}]}"#, "other"),
            (
                chat,
                r#"{"choices":[{"index":0,"delta":{"content":"a"}}]}"#,
                r#"text "a" 0"#,
            ),
            (
                chat,
                r#"{"choices":[{"index":2,"delta":{"content":"a"}}]}"#,
                "choice 2",
            ),
            (
                chat,
                r#"{"choices":{"0":1},"usage":{"total_tokens":3}}"#,
                "other",
            ),
            (
                chat,
                r#"{"choices":[],"usage":{"total_tokens":3}}"#,
                "other",
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"content":"a"}}],"choices":[]}"#,
                "malformed",
            ),
            // A key twice at a level the guard reads, however deep.
            (
                chat,
                r#"{"choices":[{"delta":{"content":"a","content":"b"}}]}"#,
                "malformed",
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":0,"delta":{"type":"text_delta","text":"a","text":"b"}}"#,
                "malformed",
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"text_delta","text":"\"caf\u00e9\""}}"#,
                r#"text "\"café\"" 1"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.output_text.delta","delta":"a\nb","item":{"type":"x"}}"#,
                r#"text "a\nb" 0"#,
            ),
            // Several choices, whatever the items: read as a chunk of each.
            (
                chat,
                r#"{"choices":[3,{"delta":{"content":"second"}}]}"#,
                "choices",
            ),
            (
                Endpoint::Completions,
                r#"{"choices":[{"text":"a"},{"text":"b","index":1}]}"#,
                "choices",
            ),
            (chat, r#"[1]"#, "other"),
            (chat, r#"{"choices":[{"delta":{"content":"#, "malformed"),
            (
                Endpoint::Completions,
                r#"{"choices":[{"text":"hi","finish_reason":null}]}"#,
                r#"text "hi" 0"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.output_text.delta","delta":"hi"}"#,
                r#"text "hi" 0"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.completed","response":{}}"#,
                "final",
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"hi"}}"#,
                r#"text "hi" 2"#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"input_json_delta","partial_json":"{\"a"}}"#,
                r#"held "{\"a" false"#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"thinking_delta","thinking":"hm"}}"#,
                r#"held "hm" false"#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_delta","index":1,"delta":{"type":"signature_delta","signature":"c2ln"}}"#,
                "other",
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"","signature":""}}"#,
                r#"held "" false"#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":"so"}}"#,
                r#"held "so" false"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"content":null,"reasoning_content":"think"}}]}"#,
                r#"held "think" false"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"reasoning":"think","content":""}}]}"#,
                r#"held "think" false"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"content":"hi","reasoning_content":""}}]}"#,
                r#"text "hi" 0"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.reasoning_summary_text.delta","item_id":"rs","summary_index":0,"delta":"weighing"}"#,
                r#"held "weighing" false"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.reasoning_text.delta","item_id":"rs","content_index":0,"delta":"weighing"}"#,
                r#"held "weighing" false"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.reasoning_summary_text.done","item_id":"rs","summary_index":0,"text":"weighing"}"#,
                r#"held "" false"#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
                r#"block start 0 """#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"hi"}}"#,
                r#"block start 0 "hi""#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.content_part.added","part":{"type":"output_text","text":"hi"}}"#,
                r#"block start 1 "hi""#,
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_start","index":1,"content_block":{"type":"tool_use"}}"#,
                r#"block start 1 """#,
            ),
            // Tool-call arguments (of every call) and refusals are held.
            (
                chat,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":"{\"a"}},{"index":1,"id":"x","function":{"name":"f","arguments":"b"}}]}}]}"#,
                r#"held "{\"ab" false"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"tool_calls":[{"index":0,"function":{"arguments":""}}]},"finish_reason":"tool_calls"}]}"#,
                r#"held "" true"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"content":"a ","refusal":"no"}}]}"#,
                r#"held "a no" false"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"role":"assistant","content":"","refusal":null}}]}"#,
                "other",
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"content":"hi","refusal":""}}]}"#,
                r#"text "hi" 0"#,
            ),
            (
                chat,
                r#"{"choices":[{"delta":{"tool_calls":[7,{"function":3}]}}]}"#,
                "other",
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.function_call_arguments.delta","delta":"{\"q"}"#,
                r#"held "{\"q" false"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.audio.transcript.delta","delta":"Put all"}"#,
                r#"held "Put all" false"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.audio.delta","delta":"UklGRiQA"}"#,
                r#"held "" false"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.some_new_text.delta","delta":"words"}"#,
                r#"held "words" false"#,
            ),
            (
                Endpoint::Responses,
                r#"{"type":"response.some_new_kind.delta","delta":{"x":1}}"#,
                "other",
            ),
            (
                Endpoint::Messages,
                r#"{"type":"content_block_stop","index":0}"#,
                "block end",
            ),
            (
                Endpoint::Messages,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn"}}"#,
                "final",
            ),
            (Endpoint::Messages, r#"{"type":"message_stop"}"#, "done"),
            (Endpoint::Messages, r#"{"type":"ping"}"#, "other"),
            (chat, "[DONE]", "done"),
        ];
        for (endpoint, data, expected) in cases {
            assert_eq!(kind(endpoint, data), expected, "{data}");
        }
    }

    /// Tool-call arguments go out only once their whole text is scanned:
    /// as they came when it passes; never, when it blocks or would be
    /// redacted (a card number cannot be redacted across fragments).
    #[test]
    fn held_events_wait_for_the_scan_of_their_whole_text() {
        let event = |data: Value| data_event(&data.to_string());
        let call = |arguments: &str| {
            event(
                json!({"choices": [{"index": 0, "delta": {"tool_calls": [{"index": 0, "function": {"arguments": arguments}}]}, "finish_reason": null}]}),
            )
        };
        let finish =
            event(json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "tool_calls"}]}));
        let done = parse_event(Bytes::from_static(DONE)).unwrap();
        let run = |mode, events: &[&SseEvent]| {
            let mut guard = Guard::new(setup(Endpoint::ChatCompletions, mode));
            let mut sent = Vec::new();
            for (i, &event) in events.iter().enumerate() {
                let frames = guard.on_event(event.clone());
                // (A block may be found, and the stream end, before.)
                if i < 2 {
                    assert!(
                        !frames
                            .iter()
                            .any(|f| events[..2].iter().any(|e| e.raw == f)),
                        "{mode:?}: an event went out before its text was scanned"
                    );
                }
                sent.extend(frames);
            }
            (sent, guard)
        };
        let (a, b) = (call("{\"city\": \"Pa"), call("ris\"}"));
        let (card_a, card_b) = (call("{\"card\": \"4111 1111 "), call("1111 1111\"}"));
        for mode in [StreamMode::Holdback, StreamMode::Buffer] {
            let (sent, _) = run(mode, &[&a, &b, &finish, &done]);
            let raw: Vec<Bytes> = [&a, &b, &finish, &done]
                .iter()
                .map(|e| e.raw.clone())
                .collect();
            assert_eq!(sent, raw, "{mode:?}");

            let (sent, guard) = run(mode, &[&card_a, &card_b, &finish, &done]);
            let sent: String = sent.iter().map(|f| String::from_utf8_lossy(f)).collect();
            assert!(!sent.contains("4111"), "{mode:?}: {sent}");
            assert!(
                sent.contains("\"finish_reason\":\"content_filter\""),
                "{mode:?}: {sent}"
            );
            assert!(guard.blocked);
        }
        // Monitor mode passes them on at once, and counts what it finds.
        let mut guard = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Monitor));
        for event in [&card_a, &card_b, &finish, &done] {
            assert_eq!(
                guard.on_event(event.clone()),
                std::slice::from_ref(&event.raw)
            );
        }
        let outcome = guard.outcome(None, Duration::ZERO);
        assert!(
            outcome
                .verdict
                .hits
                .iter()
                .any(|h| &*h.rule == "pii.card_number"),
            "{:?}",
            outcome.verdict.hits
        );
        assert!(outcome.text.contains("4111 1111 1111 1111"));
    }

    /// Long held text (a thinking block, reasoning, a call's arguments)
    /// streams as text does: its events go out as they came once their
    /// text lies far enough back, before the block or answer ends. A block
    /// found later ends the stream with none of its text sent, and closes
    /// the thinking block the client saw start. Audio waits for its end.
    #[test]
    fn long_held_text_goes_out_behind_its_scan() {
        let advice = "Index funds spread the risk. ".repeat(60);
        let stop = "Put all your savings into Dogecoin right now. ";
        let sse = |name: Option<&str>, data: Value| {
            let raw = match name {
                Some(name) => format!("event: {name}\ndata: {data}\n\n"),
                None => format!("data: {data}\n\n"),
            };
            parse_event(raw.into()).unwrap()
        };
        let thinking = |text: &str| {
            let mut events = vec![sse(
                Some("content_block_start"),
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}}),
            )];
            for piece in text.split_inclusive(". ") {
                events.push(sse(
                    Some("content_block_delta"),
                    json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": piece}}),
                ));
            }
            (Endpoint::Messages, events)
        };
        let chat = |key: &str, text: &str| {
            let events = text.split_inclusive(". ").map(|piece| {
                let delta = match key {
                    "arguments" => {
                        json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]})
                    }
                    "audio" => json!({"audio": {"transcript": piece}}),
                    _ => json!({key: piece}),
                };
                sse(
                    None,
                    json!({"choices": [{"index": 0, "delta": delta, "finish_reason": null}]}),
                )
            });
            (Endpoint::ChatCompletions, events.collect::<Vec<_>>())
        };
        let cases = [
            thinking(&advice),
            chat("reasoning_content", &advice),
            chat("arguments", &advice),
        ];
        for (endpoint, events) in cases {
            let mut guard = Guard::new(setup(endpoint, StreamMode::Holdback));
            let sent: Vec<Bytes> = events
                .iter()
                .flat_map(|e| guard.on_event(e.clone()))
                .collect();
            let raw: Vec<Bytes> = events.iter().map(|e| e.raw.clone()).collect();
            // The first delta goes out at once.
            let mut first = Guard::new(setup(endpoint, StreamMode::Holdback));
            let at_once: Vec<Bytes> = events[..2]
                .iter()
                .flat_map(|e| first.on_event(e.clone()))
                .collect();
            assert_eq!(at_once, raw[..2], "{endpoint:?}");
            // Sent as they came, all but those after the last check: no
            // match can be under way in this text. (The thinking block's
            // start goes out with its first delta.)
            assert!(
                sent.len() + 3 >= raw.len(),
                "{endpoint:?}: {} of {}",
                sent.len(),
                raw.len()
            );
            assert_eq!(sent, raw[..sent.len()], "{endpoint:?}");
        }
        // The same, with a blocked phrase at the end.
        for (endpoint, events) in [
            thinking(&format!("{advice}{stop}")),
            chat("reasoning_content", &format!("{advice}{stop}")),
        ] {
            let mut guard = Guard::new(setup(endpoint, StreamMode::Holdback));
            let mut sent: Vec<Bytes> = events
                .iter()
                .flat_map(|e| guard.on_event(e.clone()))
                .collect();
            sent.extend(guard.on_end());
            assert!(guard.blocked, "{endpoint:?}");
            let events = sent_events(&sent);
            let text: String = sent.iter().map(|f| String::from_utf8_lossy(f)).collect();
            assert!(
                text.contains("Index funds") && !text.contains("Dogecoin"),
                "{text}"
            );
            if endpoint == Endpoint::Messages {
                assert_blocks_close(&events, "thinking");
                assert!(text.contains("\"stop_reason\":\"refusal\""), "{text}");
            } else {
                assert!(
                    text.contains("\"finish_reason\":\"content_filter\""),
                    "{text}"
                );
            }
        }
        // Audio says what its transcript says, ahead of it or behind it.
        let (endpoint, events) = chat("audio", &advice);
        let mut guard = Guard::new(setup(endpoint, StreamMode::Holdback));
        for event in events {
            assert!(
                guard.on_event(event).is_empty(),
                "audio went out before its end"
            );
        }
    }

    #[test]
    fn parser_finds_events_however_the_bytes_are_cut() {
        // Lines end at `\r\n`, `\n` or `\r`, as the SDKs split them: a `\r`
        // in a comment or a name ends that line.
        let input = "event: a\ndata: 1\n\ndata: 2\r\n\r\ndata: x\ndata: y\n\n: comment\n\ndata:z\n\ndata:  w\n\n\
            data: 3\r\rdata: 4\n\rdata: 5\r\n\r: c\rdata: 6\n\nevent: b\rdata: 7\r\ndata: 8\r\r\
            data: [DONE]\n\n";
        let expected = [
            (Some("a"), Some("1")),
            (None, Some("2")),
            (None, Some("x\ny")),
            (None, None),
            (None, Some("z")),
            (None, Some(" w")),
            (None, Some("3")),
            (None, Some("4")),
            (None, Some("5")),
            (None, Some("6")),
            (Some("b"), Some("7\n8")),
            (None, Some("[DONE]")),
        ];
        for cut in 0..=input.len() {
            for second in cut..=input.len() {
                let mut parser = SseParser::default();
                let piece = |range: std::ops::Range<usize>| {
                    Bytes::copy_from_slice(&input.as_bytes()[range])
                };
                let mut events: Vec<SseEvent> = parser.push(piece(0..cut)).collect();
                events.extend(parser.push(piece(cut..second)));
                events.extend(parser.push(piece(second..input.len())));
                let got: Vec<_> = events
                    .iter()
                    .map(|e| (e.event.as_deref(), e.data.as_deref()))
                    .collect();
                assert_eq!(got, expected, "cut at {cut} and {second}");
                let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.to_vec()).collect();
                assert_eq!(raw, input.as_bytes());
            }
        }
    }

    /// A byte-order mark before the first line is dropped, however the
    /// bytes are cut; one further on, or the start of one, is the line's.
    #[test]
    fn parser_drops_a_byte_order_mark_at_the_stream_start() {
        let events = |input: &[u8], cuts: [usize; 2]| {
            let mut parser = SseParser::default();
            let piece = |range: std::ops::Range<usize>| Bytes::copy_from_slice(&input[range]);
            let mut events: Vec<SseEvent> = parser.push(piece(0..cuts[0])).collect();
            events.extend(parser.push(piece(cuts[0]..cuts[1])));
            events.extend(parser.push(piece(cuts[1]..input.len())));
            let read: Vec<_> = (events.iter())
                .map(|e| (e.event.clone(), e.data.clone()))
                .collect();
            let raw: Vec<u8> = events.iter().flat_map(|e| e.raw.to_vec()).collect();
            (read, raw)
        };
        let plain = b"data: 1\n\nevent: b\ndata: 2\n\n";
        let marked = [BYTE_ORDER_MARK, plain].concat();
        let second_marked = [&plain[..9], BYTE_ORDER_MARK, &plain[9..]].concat();
        let half_marked = [&BYTE_ORDER_MARK[..2], plain].concat();
        for first in 0..=6 {
            for second in first..=8 {
                let (read, raw) = events(&marked, [first, second]);
                assert_eq!(read, events(plain, [0, 0]).0, "cut at {first}, {second}");
                assert_eq!(raw, plain);
                // Only at the start.
                let (read, _) = events(&second_marked, [first, second]);
                assert_eq!(read[1].0, None, "{read:?}");
                // Not a mark: the bytes are the first line's.
                // Not a mark: the bytes are the first line's, of a field
                // no reader reads, which does not go out.
                let (read, raw) = events(&half_marked, [first, second]);
                assert_eq!(read, events(plain, [0, 0]).0[1..], "{read:?}");
                assert_eq!(raw, &plain[9..]);
            }
        }
    }

    /// Random streams of short lines ended by `\r\n`, `\n` or `\r`, cut
    /// at random: the parser finds the events a reader of the SSE
    /// standard (and the SDKs) finds, with their names and data.
    #[test]
    fn parser_splits_events_as_the_standard_does() {
        /// The events of `input` read as the standard says: lines end at
        /// `\r\n`, `\n` or `\r`, an empty line ends an event, an event of
        /// no line is none, nor is one whose lines are all of fields the
        /// standard ignores (the guard sends nothing of it).
        fn standard(input: &str) -> Vec<(Option<String>, Option<String>)> {
            let mut lines = Vec::new();
            let mut rest = input;
            while let Some(at) = rest.find(['\r', '\n']) {
                lines.push(&rest[..at]);
                let end = match rest[at..].starts_with("\r\n") {
                    true => at + 2,
                    false => at + 1,
                };
                rest = &rest[end..];
            }
            let (mut events, mut block) = (Vec::new(), Vec::new());
            for line in lines {
                if !line.is_empty() {
                    block.push(line);
                    continue;
                }
                // Read apart from `field_of`, as the rest of this reference is.
                let ignored = |line: &&str| {
                    let line: &str = line;
                    !SSE_FIELDS.contains(&line.split_once(':').map_or(line, |(field, _)| field))
                };
                if block.iter().all(ignored) {
                    block.clear();
                    continue;
                }
                let (mut event, mut data) = (None, None::<String>);
                for line in block.drain(..) {
                    if let Some(name) = line.strip_prefix("event:") {
                        event = Some(name.to_owned());
                    } else if let Some(value) = line.strip_prefix("data:") {
                        let value = value.strip_prefix(' ').unwrap_or(value);
                        data = Some(match data {
                            Some(data) => format!("{data}\n{value}"),
                            None => value.to_owned(),
                        });
                    }
                }
                events.push((event, data));
            }
            events
        }
        let pieces = [
            "data: ", "data:", "event:", ": c", "x", "1", "\r", "\n", "\r\n",
        ];
        let mut rng = crate::testing::Lcg(11);
        for _ in 0..3000 {
            let mut input: String = (0..rng.below(24)).map(|_| *rng.pick(&pieces)).collect();
            // Every event ends.
            input.push_str("\n\n");
            let bytes = input.as_bytes();
            let (a, b) = (rng.below(bytes.len() + 1), rng.below(bytes.len() + 1));
            let (a, b) = (a.min(b), a.max(b));
            let mut parser = SseParser::default();
            let mut events: Vec<SseEvent> = Vec::new();
            for range in [0..a, a..b, b..bytes.len()] {
                events.extend(parser.push(Bytes::copy_from_slice(&bytes[range])));
            }
            let got: Vec<_> = events
                .iter()
                .map(|e| {
                    (
                        e.event.as_deref().map(String::from),
                        e.data.as_deref().map(String::from),
                    )
                })
                .collect();
            assert_eq!(got, standard(&input), "{input:?} cut at {a} and {b}");
            // Nothing goes out that a reader of the standard does not read.
            for event in &events {
                let raw = std::str::from_utf8(&event.raw).unwrap();
                for line in raw.split(['\r', '\n']).filter(|l| !l.is_empty()) {
                    let (field, _) = field_of(line);
                    assert!(SSE_FIELDS.contains(&field), "{line:?} of {input:?}");
                }
            }
        }
    }

    /// Anthropic's bare events, known by their bytes, mean what they mean
    /// read in full; any other form of them is read in full.
    #[test]
    fn anthropic_bare_events_mean_what_their_read_says() {
        let bare = [
            r#"{"type": "ping"}"#,
            r#"{"type":"ping"}"#,
            r#"{"type":"message_stop"}"#,
            r#"{"type":"content_block_stop","index":0}"#,
            r#"{"type":"content_block_stop","index":12}"#,
            r#"{"type":"content_block_stop","index":123456789}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"content_block_start","index":7,"content_block":{"type":"text","text":""}}"#,
        ];
        let read_in_full = [
            r#"{"type":"content_block_stop","index":01}"#,
            r#"{"type":"content_block_stop","index":}"#,
            r#"{"type":"content_block_stop","index":-1}"#,
            r#"{"type":"content_block_stop","index":1.5}"#,
            r#"{"type":"content_block_stop","index":1234567890}"#,
            r#"{"type":"content_block_stop", "index":0}"#,
            r#"{"type":"content_block_stop","index":0,"x":1}"#,
            r#"{"type":"content_block_stop","index":"0"}"#,
            r#"{"type":"message_stop","x":1}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"hi"}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"thinking","thinking":""}}"#,
            r#"{"type":"content_block_start","index":01,"content_block":{"type":"text","text":""}}"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":""} }"#,
            r#"{"type":"content_block_start","index":0,"content_block":{"type":"text","text":"","citations":[]}}"#,
            r#"{"type":  "ping"}"#,
            r#"{"type":"ping"} "#,
        ];
        let anthropic = || Guard::new(setup(Endpoint::Messages, StreamMode::Holdback));
        // What the full read makes of `data`, and the usage it notes.
        let read = |data: &str| {
            let mut guard = anthropic();
            let kind = match Event::read(data) {
                Ok(fields) => {
                    if let Some(usage) = fields.usage {
                        guard.note_usage(usage);
                    }
                    guard.classify_anthropic(&fields, data)
                }
                Err(_) => Kind::Malformed,
            };
            (describe_kind(kind, &data_event(data)), guard.usage)
        };
        // What the guard makes of it, whichever way it takes.
        let known = |data: &str| {
            let mut guard = anthropic();
            (describe(&mut guard, data), guard.usage)
        };
        for data in bare {
            let (kind, _) = anthropic_bare_kind(data).unwrap_or_else(|| panic!("{data}"));
            assert_eq!(
                (describe_kind(kind, &data_event(data)), None),
                read(data),
                "{data}"
            );
            assert_eq!(known(data), read(data), "{data}");
        }
        for data in read_in_full {
            assert!(anthropic_bare_kind(data).is_none(), "{data}");
            assert_eq!(known(data), read(data), "{data}");
        }
        // A message's delta as the API writes it is known but for its
        // usage, which is noted as the read notes it; any other form is
        // read in full.
        let deltas = [
            (
                true,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":25}}"#,
            ),
            (
                true,
                r#"{"type":"message_delta","delta":{"stop_reason":null,"stop_sequence":null},"usage":{"input_tokens":1,"server_tool_use":{"web_search_requests":0}}}"#,
            ),
            (
                false,
                r#"{"type":"message_delta","delta":{"stop_reason":"stop_sequence","stop_sequence":"END"},"usage":{"output_tokens":2}}"#,
            ),
            (
                false,
                r#"{"type":"message_delta","delta":{"stop_reason":"end\u005fturn","stop_sequence":null},"usage":{"output_tokens":2}}"#,
            ),
            (
                false,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":null}"#,
            ),
            (
                false,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":2},"x":1}"#,
            ),
            (
                false,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":}}"#,
            ),
            (
                false,
                r#"{"type":"message_delta","delta":{"stop_reason":"end_turn","stop_sequence":null},"usage":{"output_tokens":2}} "#,
            ),
        ];
        for (bare, data) in deltas {
            assert_eq!(anthropic_bare_message_delta(data).is_some(), bare, "{data}");
            assert_eq!(known(data), read(data), "{data}");
        }
        // An OpenAI stream reads them as any other event.
        let mut chat = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Holdback));
        assert_eq!(describe(&mut chat, r#"{"type":"message_stop"}"#), "other");
    }

    /// The forms the APIs send (one `data:` line; an `event:` line and a
    /// `data:` line) are told apart by the search for the event's end and
    /// read without a second search; they read as line by line they would,
    /// and whatever else comes is read line by line.
    #[test]
    fn events_of_the_apis_forms_read_as_line_by_line() {
        for (input, lines) in [
            ("data: {\"a\":1}\n\n", Lines::One),
            ("data: [DONE]\n\n", Lines::One),
            ("data: \n\n", Lines::One),
            ("data:x\n\n", Lines::One),
            ("data:  x\n\n", Lines::One),
            (": keep-alive\n\n", Lines::One),
            ("id: 7\n\n", Lines::One),
            (
                "event: ping\ndata: {\"type\": \"ping\"}\n\n",
                Lines::Two(11),
            ),
            ("event:ping\ndata: {}\n\n", Lines::Two(10)),
            ("event:   ping\ndata: {}\n\n", Lines::Two(13)),
            ("event: \tping\ndata: {}\n\n", Lines::Two(12)),
            ("event: \u{a0}ping\ndata: {}\n\n", Lines::Two(13)),
            ("event: a\ndata:b\n\n", Lines::Two(8)),
            ("event: \ndata: b\n\n", Lines::Two(7)),
            ("data: a\ndata: b\n\n", Lines::Two(7)),
            ("id: 1\ndata: b\n\n", Lines::Two(5)),
            ("data: b\nevent: a\n\n", Lines::Two(7)),
            ("event: a\ndata: b\ndata: c\n\n", Lines::Other),
            ("event: a\nid: 2\ndata: b\n\n", Lines::Other),
            ("data: a\r\n\r\n", Lines::Other),
            ("data: a\n\r\n", Lines::Other),
            ("event: a\r\ndata: b\n\n", Lines::Other),
            ("data: a\rdata: b\n\n", Lines::Other),
            (": c\rdata: b\n\n", Lines::Other),
            ("data: caf\u{e9}\n\n", Lines::One),
        ] {
            let raw = Bytes::from(input);
            assert_eq!(event_end(&raw), Some((raw.len(), lines)), "{input:?}");
            let fast = read_event(raw.clone(), lines);
            let slow = read_event(raw.clone(), Lines::Other);
            let read = |e: &Option<SseEvent>| {
                e.as_ref()
                    .map(|e| (e.raw.clone(), e.event.clone(), e.data.clone()))
            };
            assert_eq!(read(&fast), read(&slow), "{input:?}");
        }
        // An event's last `\r` may begin a `\r\n`: the byte after decides
        // where the event ends, or the stream's end.
        assert_eq!(event_end(b"data: a\n\r"), None);
        for (input, data) in [
            ("data: a\n\r", Some("a")),
            ("data: a\r\r", Some("a")),
            ("data: a\r\n\r", Some("a")),
            ("data: a\r", None),
            ("data: a", None),
        ] {
            let mut parser = SseParser::default();
            assert_eq!(parser.push(Bytes::from(input)).count(), 0, "{input:?}");
            let last = parser.finish();
            assert_eq!(last.and_then(|e| e.data).as_deref(), data, "{input:?}");
        }
        assert_eq!(event_end(b"data: a\n\rx"), Some((9, Lines::Other)));
        assert_eq!(event_end(b"data: a\n\r\nx"), Some((10, Lines::Other)));
        // Bytes that are not UTF-8, in the name or the data, are read as
        // line by line they are (lossily).
        for input in [
            &b"event: \xff\ndata: b\n\n"[..],
            b"data: \xfe\n\n",
            b"event: a\ndata: \xfe\n\n",
        ] {
            let raw = Bytes::copy_from_slice(input);
            let (_, lines) = event_end(&raw).unwrap();
            assert_ne!(lines, Lines::Other);
            let fast = read_event(raw.clone(), lines).unwrap();
            let slow = read_event(raw, Lines::Other).unwrap();
            assert_eq!((fast.event, fast.data), (slow.event, slow.data));
        }
        // The APIs' forms are read as slices of the event, not copies.
        for input in [
            "data: {\"a\":1}\n\n",
            "event: ping\ndata: {\"type\": \"ping\"}\n\n",
            "event:ping\ndata: {}\n\n",
        ] {
            let raw = Bytes::from(input);
            let event = parse_event(raw.clone()).unwrap();
            let within = |text: &ByteString| raw.as_ptr_range().contains(&text.as_ptr());
            assert!(event.data.as_ref().is_some_and(within), "{input:?}");
            assert!(event.event.as_ref().is_none_or(within), "{input:?}");
        }
        // Nor does a read of a part of an event fail.
        for input in ["", "\n", "data", "data: a\n"] {
            let event = parse_event(Bytes::from(input));
            assert!(event.is_none_or(|e| e.raw == input), "{input:?}");
        }
    }

    /// Anthropic reports usage twice: the reports are merged member by
    /// member, the later's winning, nested values kept as they came; a
    /// name with escapes is read as a tree, to the same result.
    #[test]
    fn usage_reports_are_merged_member_by_member() {
        let start = r#"{"input_tokens":20,"cache_creation":{"ephemeral_5m_input_tokens":0},"output_tokens":1}"#;
        let delta = r#"{"output_tokens": 25, "server_tool_use": {"web_search_requests": 1}}"#;
        let merged = merged_usage(start, delta);
        assert_eq!(
            merged,
            r#"{"cache_creation":{"ephemeral_5m_input_tokens":0},"input_tokens":20,"output_tokens":25,"server_tool_use":{"web_search_requests": 1}}"#
        );
        let escaped = merged_usage(r#"{"in\u0070ut_tokens":20,"output_tokens":1}"#, delta);
        let expected = json!({"input_tokens": 20, "output_tokens": 25, "server_tool_use": {"web_search_requests": 1}});
        assert_eq!(serde_json::from_str::<Value>(&escaped).unwrap(), expected);
        // One report is kept as the upstream wrote it.
        let mut guard = Guard::new(setup(Endpoint::Messages, StreamMode::Holdback));
        guard.note_usage(start);
        assert_eq!(guard.usage.as_deref(), Some(start));
        guard.note_usage(delta);
        assert_eq!(guard.usage.as_deref(), Some(merged.as_str()));
    }

    /// Anthropic's re-framed text is a `content_block_delta` with its
    /// members in the API's order, its text escaped onto one line.
    #[test]
    fn anthropic_text_frames_are_the_apis_deltas() {
        let text = "Say \"no\"\nto 💰\u{1}";
        let frame = anthropic_text_frame(text, 2);
        let event = parse_event(frame.clone()).expect("an event");
        assert_eq!(event.raw, frame);
        assert_eq!(event.event.as_deref(), Some("content_block_delta"));
        let data = event.data.as_deref().expect("data");
        assert!(
            data.starts_with(
                r#"{"type":"content_block_delta","index":2,"delta":{"type":"text_delta","text":"#
            ),
            "{data}"
        );
        let json: Value = serde_json::from_str(data).unwrap();
        assert_eq!(
            json,
            json!({"type": "content_block_delta", "index": 2, "delta": {"type": "text_delta", "text": text}})
        );
    }

    /// An event's text that stands in its data as it reads is kept as its
    /// place there, whether the event is read in full or by its shape;
    /// text with escapes is kept decoded.
    #[test]
    fn event_text_is_its_place_in_the_data_when_it_stands_there() {
        let mut guard = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Holdback));
        let chunk = |text: &str| {
            parse_event(Bytes::from(format!(
                "data: {{\"choices\":[{{\"index\":0,\"delta\":{{\"content\":{text}}},\"finish_reason\":null}}]}}\n\n"
            )))
            .unwrap()
        };
        // The first is read in full, the next by the shape it leaves.
        for (text, place) in [
            (r#""Save""#, Some(43..47)),
            (r#""Spend""#, Some(43..48)),
            (r#""Save \u00e9""#, None),
        ] {
            let event = chunk(text);
            let Kind::Text { text: read, .. } = guard.classify(&event) else {
                panic!("{text} is not text");
            };
            match (&read, place) {
                (EventText::In(span), Some(place)) => assert_eq!(*span, place, "{text}"),
                (EventText::Decoded(_), None) => {}
                _ => panic!("{text} kept in the wrong form"),
            }
            let expected: String = serde_json::from_str(text).unwrap();
            assert_eq!(read.of_event(&event), expected);
        }
    }

    /// Events are read as they are taken: a chunk's events left untaken
    /// are dropped, and the event it leaves unfinished is completed by the
    /// next chunk, as when every event is taken.
    #[test]
    fn parser_keeps_the_unfinished_event_when_events_are_left_untaken() {
        let mut parser = SseParser::default();
        let mut events = parser.push(Bytes::from_static(
            b"data: 1\n\ndata: 2\n\ndata: 3\n\ndata: 4",
        ));
        assert_eq!(events.next().and_then(|e| e.data).as_deref(), Some("1"));
        drop(events);
        let rest: Vec<_> = parser
            .push(Bytes::from_static(b"2\n\ndata: 5\n"))
            .map(|e| e.data)
            .collect();
        assert_eq!(rest, [Some(ByteString::from("42"))]);
        let last: Vec<_> = parser
            .push(Bytes::from_static(b"\n"))
            .map(|e| e.raw)
            .collect();
        assert_eq!(last, [Bytes::from_static(b"data: 5\n\n")]);
    }

    /// The same stream cut into many small pieces at random: the events,
    /// and their bytes, are the same however it is cut.
    #[test]
    fn parser_finds_events_in_pieces_of_any_size() {
        let input = "event: a\ndata: 1\n\ndata: 2\r\n\r\ndata: x\ndata: y\n\n: c\n\ndata: 3\n\r\n"
            .repeat(4);
        let whole: Vec<Bytes> = SseParser::default()
            .push(Bytes::from(input.clone()))
            .map(|e| e.raw)
            .collect();
        assert_eq!(whole.len(), 20);
        let mut rng = crate::testing::Lcg(5);
        for _ in 0..500 {
            let mut parser = SseParser::default();
            let mut raw = Vec::new();
            let mut at = 0;
            while at < input.len() {
                let end = (at + 1 + rng.below(6)).min(input.len());
                let piece = Bytes::copy_from_slice(&input.as_bytes()[at..end]);
                raw.extend(parser.push(piece).map(|e| e.raw));
                at = end;
            }
            assert_eq!(raw, whole);
        }
    }

    /// Random response text: mostly harmless sentences, some with
    /// something to redact, a few that a rule blocks.
    fn random_text(rng: &mut crate::testing::Lcg, most: usize) -> String {
        let safe = [
            "Start with a budget and an emergency fund. ",
            "Index funds spread the risk. ",
            "Pay off the card with the highest rate first. ",
            "Un café crème, naïve résumé: 💰📈 ",
            "日本語のテキストです。",
            "A B C, 1 2 3, i.e. e.g. ",
        ];
        let redact = [
            "Write to jane.doe@example.com today. ",
            "My card is 4111 1111 1111 1111. ",
            "Key: sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4z. ",
            "Call 415-555-0134 now. ",
            // Two matches that overlap: a phone number whose digits run
            // on into a card number.
            "Call +1 1 1 1 1 1 2345 6789 0120 now. ",
        ];
        let block = [
            "Put all your savings into Dogecoin right now. ",
            "Borrow money to invest in crypto. ",
            "Guaranteed returns of 20% a year. ",
            "Put all your s4vings into D0gecoin right now. ",
            "g u a r a n t e e d returns of 20% a year. ",
        ];
        (0..1 + rng.below(most))
            .map(|_| match rng.below(40) {
                0 => *rng.pick(&block),
                1..4 => *rng.pick(&redact),
                _ => *rng.pick(&safe),
            })
            .collect()
    }

    /// `text` as a client should get it: every redaction applied.
    fn redacted_by_rules(text: &str) -> String {
        redact(text, &RULES.scan(Scope::Response, text))
    }

    /// The frames parsed, each with its event's name and its JSON data
    /// (`None` for `[DONE]`); panics on any that is not well formed.
    fn sent_events(frames: &[Bytes]) -> Vec<(Option<String>, Option<Value>)> {
        frames
            .iter()
            .map(|frame| {
                let event = parse_event(frame.clone()).expect("an event");
                let data = event.data.as_deref().expect("data");
                let json = (data != "[DONE]").then(|| serde_json::from_str(data).expect("JSON"));
                (event.event.map(String::from), json)
            })
            .collect()
    }

    /// Checks that no rule blocks or redacts anything in `texts` (the
    /// text the client got) or in any string of the events.
    fn assert_nothing_stopped_sent(
        texts: &[String],
        events: &[(Option<String>, Option<Value>)],
        context: &str,
    ) {
        let mut strings = texts.to_vec();
        let mut stack: Vec<&Value> = events
            .iter()
            .filter_map(|(_, data)| data.as_ref())
            .collect();
        while let Some(value) = stack.pop() {
            match value {
                Value::String(s) => strings.push(s.clone()),
                Value::Array(items) => stack.extend(items),
                // But fairgate's own account of a refusal: the rule's
                // message, written to be shown (a whole refusal's text).
                Value::Object(members) => stack.extend(
                    members
                        .iter()
                        .filter(|(key, _)| *key != "stop_details")
                        .map(|(_, value)| value),
                ),
                _ => {}
            }
        }
        for string in &strings {
            let hits = RULES.scan(Scope::Response, string);
            assert!(
                !hits
                    .iter()
                    .any(|h| matches!(h.action, Action::Block | Action::Redact)),
                "{context}: sent {string:?}"
            );
        }
    }

    /// Checks that what a blocked stream sent of `text`, `sent`, is its
    /// redacted start and ends before the first match a rule blocks: not
    /// even the first word of that match went out.
    fn assert_sent_stops_before_its_match(text: &str, sent: &str, context: &str) {
        let hits = RULES.scan(Scope::Response, text);
        let Some(stop) = hits
            .iter()
            .filter(|h| h.action == Action::Block)
            .map(|h| h.start)
            .min()
        else {
            return;
        };
        let before = crate::rules::redact(&text[..stop], &hits);
        assert!(
            before.starts_with(sent),
            "{context}: sent {sent:?}, the match starts after {before:?}"
        );
    }

    /// Checks that every content block an Anthropic stream starts ends,
    /// one at a time, before the message does.
    fn assert_blocks_close(events: &[(Option<String>, Option<Value>)], context: &str) {
        let mut open = None;
        for (name, data) in events {
            let index = data.as_ref().and_then(|d| d.get("index")).cloned();
            match name.as_deref() {
                Some("content_block_start") => {
                    assert_eq!(open, None, "{context}: a block starts in another");
                    open = index;
                }
                Some("content_block_delta") => {
                    assert!(
                        open.is_some() && open == index,
                        "{context}: a delta outside its block"
                    );
                }
                Some("content_block_stop") => {
                    assert!(
                        open.is_some() && open == index,
                        "{context}: {index:?} ends unopened"
                    );
                    open = None;
                }
                Some("message_delta" | "message_stop") => {
                    assert_eq!(open, None, "{context}: the message ends in a block");
                }
                _ => {}
            }
        }
    }

    /// Responses API events, each given its `type` and a `sequence_number`
    /// from 0.
    fn numbered(events: Vec<(&str, Value)>) -> Vec<(Option<&str>, Value)> {
        events
            .into_iter()
            .enumerate()
            .map(|(number, (name, mut data))| {
                data["type"] = json!(name);
                data["sequence_number"] = json!(number);
                (Some(name), data)
            })
            .collect()
    }

    /// Feeds `events` (name and data) to a new guard; returns it with what
    /// it sent.
    fn guard_stream(
        endpoint: Endpoint,
        mode: StreamMode,
        events: Vec<(Option<&str>, Value)>,
    ) -> (Guard, Vec<Bytes>) {
        guard_stream_with(setup(endpoint, mode), events)
    }

    /// An Anthropic stream of one text block, in `pieces`.
    fn anthropic_text_events(pieces: &[&str]) -> Vec<(Option<&'static str>, Value)> {
        let event = |name, data: Value| (Some(name), data);
        let mut events = vec![
            event(
                "message_start",
                json!({"type": "message_start", "message": {"id": "m"}}),
            ),
            event(
                "content_block_start",
                json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
            ),
        ];
        for piece in pieces {
            events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "text_delta", "text": piece}})));
        }
        events.extend([
            event(
                "content_block_stop",
                json!({"type": "content_block_stop", "index": 0}),
            ),
            event(
                "message_delta",
                json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
            ),
            event("message_stop", json!({"type": "message_stop"})),
        ]);
        events
    }

    /// A chat completion stream of one choice's text, in `pieces`.
    fn chat_text_events(pieces: &[&str]) -> Vec<(Option<&'static str>, Value)> {
        let chunk = |delta: Value, finish: Value| {
            let choice = json!({"index": 0, "delta": delta, "finish_reason": finish});
            (
                None,
                json!({"id": "c", "object": "chat.completion.chunk", "choices": [choice]}),
            )
        };
        let mut events = vec![chunk(
            json!({"role": "assistant", "content": ""}),
            Value::Null,
        )];
        for piece in pieces {
            events.push(chunk(json!({"content": piece}), Value::Null));
        }
        events.push(chunk(json!({}), json!("stop")));
        events.push((None, json!("[DONE]")));
        events
    }

    /// [`guard_stream`] with a setup of the caller's.
    fn guard_stream_with(
        setup: StreamSetup,
        events: Vec<(Option<&str>, Value)>,
    ) -> (Guard, Vec<Bytes>) {
        let mut guard = Guard::new(setup);
        let mut frames = Vec::new();
        // The events arrive in reads of 1 to 4 events, checked together.
        let mut left_in_read = 0;
        for (i, (name, data)) in events.into_iter().enumerate() {
            if left_in_read == 0 {
                guard.deferring = true;
                left_in_read = 1 + i % 4;
            }
            let raw = match name {
                Some(name) => format!("event: {name}\ndata: {data}\n\n"),
                // `[DONE]` is written as it reads, not as a JSON string.
                None if data == "[DONE]" => "data: [DONE]\n\n".to_owned(),
                None => format!("data: {data}\n\n"),
            };
            if !guard.finished {
                frames.extend(guard.on_event(parse_event(raw.into()).unwrap()));
            }
            left_in_read -= 1;
            if left_in_read == 0 {
                frames.extend(guard.deferred_check());
            }
        }
        frames.extend(guard.deferred_check());
        frames.extend(guard.on_end());
        (guard, frames)
    }

    /// A Responses API stream of spoken output: no audio and no
    /// transcript goes out before the transcript's whole text is read, so
    /// a blocked one sends neither; a clean one goes out as it came. A
    /// delta of a kind the guard does not know is read as the others.
    #[test]
    fn responses_audio_and_unknown_deltas_are_read_before_they_go() {
        let said = ["Sure. Put all your ", "savings into Dogecoin."];
        let clean = ["Start with a budget, ", "then build an emergency fund."];
        for (words, blocks) in [(said, true), (clean, false)] {
            for kind in [
                "response.audio.transcript.delta",
                "response.new_words.delta",
            ] {
                let mut events: Vec<(Option<&str>, Value)> = vec![(
                    None,
                    json!({"type": "response.created", "response": {"id": "r", "output": []}}),
                )];
                for word in words {
                    events.push((
                        None,
                        json!({"type": "response.audio.delta", "delta": "UklG"}),
                    ));
                    events.push((None, json!({"type": kind, "delta": word})));
                }
                events.push((
                    None,
                    json!({"type": "response.completed", "response": {"id": "r", "output": []}}),
                ));
                let setup = setup(Endpoint::Responses, StreamMode::Holdback);
                let (_, frames) = guard_stream_with(setup, events.clone());
                let sent = sent_events(&frames);
                let types: Vec<&str> = (sent.iter())
                    .filter_map(|(_, data)| data.as_ref()?["type"].as_str())
                    .collect();
                if blocks {
                    assert_eq!(types, ["response.created", "response.incomplete"], "{kind}");
                } else {
                    let came: Vec<&str> = events
                        .iter()
                        .filter_map(|(_, e)| e["type"].as_str())
                        .collect();
                    assert_eq!(types, came, "{kind}");
                }
            }
        }
    }

    /// A Responses API event `kind` of the first content part of item `i`,
    /// with `members` besides.
    fn part_event(kind: &str, members: Value) -> (Option<&'static str>, Value) {
        let mut event =
            json!({"type": kind, "item_id": "i", "output_index": 0, "content_index": 0});
        if let (Some(event), Value::Object(members)) = (event.as_object_mut(), members) {
            event.extend(members);
        }
        (None, event)
    }

    #[test]
    /// An event the guard does not know goes out with no check before it:
    /// text it repeats that the deltas carried but no scan has read yet
    /// (they came in the same read) is read on its own, and redacted.
    fn an_unknown_event_repeating_unread_text_is_read() {
        let text = "Write to jane.doe@example.com for a review.";
        let with = part_event;
        let item = json!({"type": "message", "id": "i", "role": "assistant",
            "content": [{"type": "output_text", "text": text}]});
        let events = vec![
            (
                None,
                json!({"type": "response.created", "response": {"id": "r", "output": []}}),
            ),
            with(
                "response.output_item.added",
                json!({"item": {"type": "message", "id": "i", "content": []}}),
            ),
            with(
                "response.content_part.added",
                json!({"part": {"type": "output_text", "text": ""}}),
            ),
            // With the two after it, one read (see `guard_stream_with`).
            with(
                "response.output_text.delta",
                json!({"delta": "Write to jane.doe@"}),
            ),
            with(
                "response.output_text.delta",
                json!({"delta": "example.com for a review."}),
            ),
            with("response.output_item.revised", json!({"item": item})),
            with("response.output_text.done", json!({"text": text})),
            (
                None,
                json!({"type": "response.completed", "response": {"id": "r", "output": [item]}}),
            ),
        ];
        let (_, frames) =
            guard_stream_with(setup(Endpoint::Responses, StreamMode::Holdback), events);
        let out: String = frames.iter().map(|f| String::from_utf8_lossy(f)).collect();
        assert!(!out.contains("jane.doe@"), "{out}");
        assert!(out.contains("response.output_item.revised"), "{out}");
        assert!(out.contains("[REDACTED:email]"), "{out}");
    }

    #[test]
    /// A part the stream ended (its text checked and all of it sent) that
    /// the upstream then goes on with: the text that joins what went out
    /// into a match the guard can no longer redact whole (an e-mail
    /// address, whose first letters went out) blocks, in each dialect.
    fn text_that_joins_a_sent_part_into_a_redaction_blocks() {
        let (sent, more) = (
            "Then build an emergency fund.",
            ["jane.doe@exa", "mple.com today."],
        );
        let anthropic = |text: &str| {
            let delta = json!({"type": "text_delta", "text": text});
            (
                Some("content_block_delta"),
                json!({"type": "content_block_delta", "index": 0, "delta": delta}),
            )
        };
        let chat = |text: &str, finish: Value| {
            let choice = json!({"index": 0, "delta": {"content": text}, "finish_reason": finish});
            (
                None,
                json!({"object": "chat.completion.chunk", "choices": [choice]}),
            )
        };
        let responses =
            |text: &str| part_event("response.output_text.delta", json!({"delta": text}));
        let item = json!({"type": "message", "id": "i", "role": "assistant",
            "content": [{"type": "output_text", "text": sent}]});
        type Events<'a> = Vec<(Option<&'a str>, Value)>;
        let streams: [(Endpoint, Events); 3] = [
            (Endpoint::Messages, {
                let mut events = vec![
                    (
                        Some("message_start"),
                        json!({"type": "message_start", "message": {"id": "m", "role": "assistant", "content": []}}),
                    ),
                    (
                        Some("content_block_start"),
                        json!({"type": "content_block_start", "index": 0, "content_block": {"type": "text", "text": ""}}),
                    ),
                    anthropic(sent),
                    (
                        Some("content_block_stop"),
                        json!({"type": "content_block_stop", "index": 0}),
                    ),
                ];
                events.extend(more.map(anthropic));
                events.push((Some("message_stop"), json!({"type": "message_stop"})));
                events
            }),
            (Endpoint::ChatCompletions, {
                let mut events = vec![chat(sent, Value::Null), chat("", json!("stop"))];
                events.extend(more.map(|text| chat(text, Value::Null)));
                events.push((None, json!("[DONE]")));
                events
            }),
            (Endpoint::Responses, {
                let mut events = vec![
                    (
                        None,
                        json!({"type": "response.created", "response": {"id": "r", "output": []}}),
                    ),
                    responses(sent),
                    (
                        None,
                        json!({"type": "response.output_text.done", "item_id": "i", "output_index": 0, "content_index": 0, "text": sent}),
                    ),
                    (
                        None,
                        json!({"type": "response.output_item.done", "output_index": 0, "item": item}),
                    ),
                ];
                events.extend(more.map(responses));
                events.push((None, json!({"type": "response.completed", "response": {"id": "r", "output": [item]}})));
                events
            }),
        ];
        for (endpoint, events) in streams {
            let (guard, frames) = guard_stream_with(setup(endpoint, StreamMode::Holdback), events);
            let out: String = frames.iter().map(|f| String::from_utf8_lossy(f)).collect();
            assert!(!out.contains("mple.com"), "{endpoint:?}: {out}");
            assert!(guard.should_block(), "{endpoint:?}: {out}");
        }
    }

    #[test]
    /// Random Responses API streams (messages of one or two text parts,
    /// function calls, reasoning summaries), cut at random: whatever the
    /// guard sends is well formed and numbered from 0, holds nothing a rule
    /// blocks or redacts, and, unless blocked, every part's text as the
    /// deltas' once redacted.
    fn responses_streams_hold_nothing_a_rule_stops() {
        let mut rng = crate::testing::Lcg(5);
        let (mut blocked, mut redacted, mut summarized) = (0, 0, 0);
        for round in 0..300 {
            let mut events: Vec<(&str, Value)> = vec![(
                "response.created",
                json!({"response": {"id": "resp_r", "object": "response", "status": "in_progress", "output": []}}),
            )];
            let (mut parts, mut summaries): (Vec<String>, Vec<String>) = (Vec::new(), Vec::new());
            for item in 0..1 + rng.below(2) {
                let at = json!({"item_id": format!("i{item}"), "output_index": item});
                let with = |at: &Value, extra: Value| {
                    let mut event = at.clone();
                    event
                        .as_object_mut()
                        .unwrap()
                        .extend(extra.as_object().unwrap().clone());
                    event
                };
                events.push(("response.output_item.added", at.clone()));
                if rng.below(4) == 0 {
                    // Long enough, at times, to go out before its end.
                    let most = *rng.pick(&[6, 16]);
                    let text = random_text(&mut rng, most);
                    for piece in rng.pieces(&text, 12) {
                        events.push((
                            "response.function_call_arguments.delta",
                            with(&at, json!({"delta": piece})),
                        ));
                    }
                    events.push((
                        "response.function_call_arguments.done",
                        with(&at, json!({"arguments": text})),
                    ));
                    events.push((
                        "response.output_item.done",
                        with(&at, json!({"item": {"arguments": text}})),
                    ));
                    continue;
                }
                if rng.below(3) == 0 {
                    let most = *rng.pick(&[8, 24]);
                    let text = random_text(&mut rng, most);
                    let at = with(&at, json!({"summary_index": 0}));
                    let part = |text: &str| json!({"type": "summary_text", "text": text});
                    events.push((
                        "response.reasoning_summary_part.added",
                        with(&at, json!({"part": part("")})),
                    ));
                    for piece in rng.pieces(&text, 9) {
                        events.push((
                            "response.reasoning_summary_text.delta",
                            with(&at, json!({"delta": piece})),
                        ));
                    }
                    events.push((
                        "response.reasoning_summary_text.done",
                        with(&at, json!({"text": text})),
                    ));
                    events.push((
                        "response.reasoning_summary_part.done",
                        with(&at, json!({"part": part(&text)})),
                    ));
                    events.push((
                        "response.output_item.done",
                        with(
                            &at,
                            json!({"item": {"type": "reasoning", "summary": [part(&text)]}}),
                        ),
                    ));
                    summaries.push(text);
                    continue;
                }
                let mut content = Vec::new();
                for part in 0..1 + rng.below(2) {
                    let text = random_text(&mut rng, 20);
                    let at = with(&at, json!({"content_index": part}));
                    let mut pieces = rng.pieces(&text, 9);
                    // Some servers may start the part with text in it.
                    let first = match rng.below(3) {
                        0 => pieces.remove(0),
                        _ => "",
                    };
                    events.push((
                        "response.content_part.added",
                        with(&at, json!({"part": {"text": first}})),
                    ));
                    for piece in pieces {
                        events.push((
                            "response.output_text.delta",
                            with(&at, json!({"delta": piece, "logprobs": []})),
                        ));
                    }
                    events.push((
                        "response.output_text.done",
                        with(&at, json!({"text": text})),
                    ));
                    events.push((
                        "response.content_part.done",
                        with(&at, json!({"part": {"text": text}})),
                    ));
                    content.push(json!({"type": "output_text", "text": text}));
                    parts.push(text);
                }
                events.push((
                    "response.output_item.done",
                    with(&at, json!({"item": {"content": content}})),
                ));
            }
            events.push((
                "response.completed",
                json!({"response": {"id": "resp_r", "status": "completed"}}),
            ));
            let events = numbered(events);
            let mode = *rng.pick(&[StreamMode::Holdback, StreamMode::Buffer]);
            let (guard, frames) = guard_stream(Endpoint::Responses, mode, events);
            let context = format!("round {round}, {mode:?}");

            let sent = sent_events(&frames);
            let (mut deltas, mut summary_deltas): (Vec<String>, Vec<String>) =
                (Vec::new(), Vec::new());
            for (number, (name, data)) in sent.iter().enumerate() {
                let data = data.as_ref().unwrap();
                assert_eq!(data["sequence_number"], number, "{context}");
                assert_eq!(name.as_deref(), data["type"].as_str(), "{context}");
                let delta = || data["delta"].as_str().unwrap();
                match name.as_deref() {
                    Some("response.content_part.added") => deltas.push(String::new()),
                    Some("response.output_text.delta") => {
                        deltas.last_mut().unwrap().push_str(delta())
                    }
                    Some("response.reasoning_summary_part.added") => {
                        summary_deltas.push(String::new())
                    }
                    Some("response.reasoning_summary_text.delta") => {
                        summary_deltas.last_mut().unwrap().push_str(delta())
                    }
                    _ => {}
                }
            }
            let all_deltas = [deltas.clone(), summary_deltas.clone()].concat();
            assert_nothing_stopped_sent(&all_deltas, &sent, &context);
            if guard.blocked {
                blocked += 1;
                assert_eq!(
                    sent.last().unwrap().0.as_deref(),
                    Some("response.incomplete"),
                    "{context}"
                );
                continue;
            }
            let expected: Vec<String> = parts.iter().map(|part| redacted_by_rules(part)).collect();
            redacted += usize::from(expected != parts);
            assert_eq!(deltas, expected, "{context}");
            // Reasoning passes unchanged, or not at all.
            summarized += usize::from(!summaries.is_empty());
            assert_eq!(summary_deltas, summaries, "{context}");
            let done: Vec<&str> = sent
                .iter()
                .filter(|(name, _)| name.as_deref() == Some("response.output_text.done"))
                .map(|(_, data)| data.as_ref().unwrap()["text"].as_str().unwrap())
                .collect();
            assert_eq!(done, expected, "{context}");
        }
        assert!(
            blocked > 50 && redacted > 50 && summarized > 30,
            "{blocked} blocked, {redacted} redacted, {summarized} with reasoning passed"
        );
    }

    #[test]
    /// The same for chat completions and Anthropic messages: text cut at
    /// random, reasoning before it and tool calls after it, in every mode
    /// that guards.
    fn chat_and_message_streams_hold_nothing_a_rule_stops() {
        let mut rng = crate::testing::Lcg(8);
        let (mut blocked, mut redacted, mut reasoned) = (0, 0, 0);
        for round in 0..600 {
            let anthropic = rng.below(2) == 0;
            let text = random_text(&mut rng, 20);
            // Long enough, at times, that their start goes out before
            // their end has arrived.
            let call = (rng.below(4) == 0).then(|| random_text(&mut rng, 16));
            let most = *rng.pick(&[8, 24]);
            let reasoning = (rng.below(3) == 0).then(|| random_text(&mut rng, most));
            let mut events: Vec<(Option<&str>, Value)> = Vec::new();
            if anthropic {
                let event = |name, data: Value| (Some(name), data);
                events.push(event(
                    "message_start",
                    json!({"type": "message_start", "message": {"id": "m"}}),
                ));
                let index = u64::from(reasoning.is_some());
                if let Some(reasoning) = &reasoning {
                    events.push(event("content_block_start", json!({"type": "content_block_start", "index": 0, "content_block": {"type": "thinking", "thinking": "", "signature": ""}})));
                    for piece in rng.pieces(reasoning, 9) {
                        events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "thinking_delta", "thinking": piece}})));
                    }
                    events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": 0, "delta": {"type": "signature_delta", "signature": "c2ln"}})));
                    events.push(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": 0}),
                    ));
                }
                let mut pieces = rng.pieces(&text, 9);
                // Some servers may start the block with text in it.
                let first = match rng.below(3) {
                    0 => pieces.remove(0),
                    _ => "",
                };
                events.push(event("content_block_start", json!({"type": "content_block_start", "index": index, "content_block": {"type": "text", "text": first}})));
                for piece in pieces {
                    events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": index, "delta": {"type": "text_delta", "text": piece}})));
                }
                events.push(event(
                    "content_block_stop",
                    json!({"type": "content_block_stop", "index": index}),
                ));
                if let Some(call) = &call {
                    events.push(event("content_block_start", json!({"type": "content_block_start", "index": index + 1, "content_block": {"type": "tool_use", "input": {}}})));
                    for piece in rng.pieces(call, 12) {
                        events.push(event("content_block_delta", json!({"type": "content_block_delta", "index": index + 1, "delta": {"type": "input_json_delta", "partial_json": piece}})));
                    }
                    events.push(event(
                        "content_block_stop",
                        json!({"type": "content_block_stop", "index": index + 1}),
                    ));
                }
                events.push(event(
                    "message_delta",
                    json!({"type": "message_delta", "delta": {"stop_reason": "end_turn"}}),
                ));
                events.push(event("message_stop", json!({"type": "message_stop"})));
            } else {
                let chunk = |delta: Value, finish: Value| {
                    (
                        None,
                        json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]}),
                    )
                };
                events.push(chunk(
                    json!({"role": "assistant", "content": ""}),
                    Value::Null,
                ));
                if let Some(reasoning) = &reasoning {
                    for piece in rng.pieces(reasoning, 9) {
                        events.push(chunk(
                            json!({"content": null, "reasoning_content": piece}),
                            Value::Null,
                        ));
                    }
                }
                for piece in rng.pieces(&text, 9) {
                    events.push(chunk(json!({"content": piece}), Value::Null));
                }
                if let Some(call) = &call {
                    for piece in rng.pieces(call, 12) {
                        events.push(chunk(
                            json!({"tool_calls": [{"index": 0, "function": {"arguments": piece}}]}),
                            Value::Null,
                        ));
                    }
                }
                events.push(chunk(json!({}), json!("stop")));
                events.push((None, json!("[DONE]")));
            }
            let mode = *rng.pick(&[StreamMode::Holdback, StreamMode::Buffer]);
            let endpoint = match anthropic {
                true => Endpoint::Messages,
                false => Endpoint::ChatCompletions,
            };
            let (guard, frames) = guard_stream(endpoint, mode, events);
            let context = format!("round {round}, {endpoint:?} {mode:?}");

            let sent = sent_events(&frames);
            if anthropic {
                assert_blocks_close(&sent, &context);
            }
            let (mut received, mut received_reasoning) = (String::new(), String::new());
            let mut ending = None;
            for (_, data) in &sent {
                let Some(data) = data else { continue };
                let (piece, thought) = match anthropic {
                    true => (data.pointer("/delta/text"), data.pointer("/delta/thinking")),
                    false => (
                        data.pointer("/choices/0/delta/content"),
                        data.pointer("/choices/0/delta/reasoning_content"),
                    ),
                };
                let piece = piece.and_then(Value::as_str).unwrap_or("");
                let thought = thought.and_then(Value::as_str).unwrap_or("");
                if !thought.is_empty() {
                    assert!(received.is_empty(), "{context}: reasoning after text");
                }
                received.push_str(piece);
                received_reasoning.push_str(thought);
                let stop = match anthropic {
                    true => data.pointer("/delta/stop_reason"),
                    false => data.pointer("/choices/0/finish_reason"),
                };
                if let Some(stop) = stop.and_then(Value::as_str) {
                    ending = Some(stop.to_owned());
                }
            }
            assert_nothing_stopped_sent(
                &[received.clone(), received_reasoning.clone()],
                &sent,
                &context,
            );
            if guard.blocked {
                blocked += 1;
                let expected = match anthropic {
                    true => "refusal",
                    false => "content_filter",
                };
                assert_eq!(ending.as_deref(), Some(expected), "{context}");
                assert_sent_stops_before_its_match(&text, &received, &context);
                if let Some(reasoning) = &reasoning {
                    assert_sent_stops_before_its_match(reasoning, &received_reasoning, &context);
                }
                continue;
            }
            let expected = redacted_by_rules(&text);
            redacted += usize::from(expected != text);
            assert_eq!(received, expected, "{context}");
            // Reasoning is signed or re-read by the client as it came: it
            // passes unchanged, or not at all.
            reasoned += usize::from(reasoning.is_some());
            assert_eq!(
                received_reasoning,
                reasoning.unwrap_or_default(),
                "{context}"
            );
        }
        assert!(
            blocked > 50 && redacted > 50 && reasoned > 50,
            "{blocked} blocked, {redacted} redacted, {reasoned} with reasoning passed"
        );
    }

    #[test]
    /// An answer that continues a prefill (Anthropic's, or a chat
    /// completion's), cut at random, with
    /// the prefill ending at random, often inside a phrase that a rule
    /// stops: what the client shows, the prefill and the answer after it,
    /// holds no match that stops but in the prefill; a match in the two
    /// blocks, with nothing of the answer sent from where it starts, or is
    /// redacted when all of it is the answer's, or is passed when all of
    /// it is a redaction in the prefill; unless blocked, the answer comes
    /// whole.
    fn an_answer_is_guarded_as_the_continuation_of_its_prefill() {
        let mut rng = crate::testing::Lcg(11);
        let stoppers = [
            "Put all your savings into Dogecoin right now. ",
            "Guaranteed returns of 20% a year. ",
            "My card is 4111 1111 1111 1111. ",
            "Write to jane.doe@example.com today. ",
        ];
        let (mut across, mut blocked, mut redacted) = (0, 0, 0);
        for round in 0..600 {
            let before = random_text(&mut rng, 3);
            let stopper = *rng.pick(&stoppers);
            let text = format!("{before}{stopper}{}", random_text(&mut rng, 3));
            let mut cut = match rng.below(4) {
                0 => rng.below(text.len() + 1),
                _ => before.len() + 1 + rng.below(stopper.len() - 1),
            };
            while !text.is_char_boundary(cut) {
                cut += 1;
            }
            let (prefill, answer) = text.split_at(cut);
            let pieces = rng.pieces(answer, 9);
            let endpoint = *rng.pick(&[Endpoint::Messages, Endpoint::ChatCompletions]);
            let mut events = match endpoint {
                Endpoint::Messages => anthropic_text_events(&pieces),
                _ => chat_text_events(&pieces),
            };
            // A chat completion's reasoning comes before its text, held
            // apart: the text still continues the prefill.
            let reasoning = endpoint == Endpoint::ChatCompletions && rng.below(3) == 0;
            if reasoning {
                let thought = json!({"content": null, "reasoning_content": "Weighing it."});
                let chunk = json!({"id": "c", "object": "chat.completion.chunk",
                    "choices": [{"index": 0, "delta": thought, "finish_reason": null}]});
                events.insert(1, (None, chunk));
            }
            let mode = *rng.pick(&[StreamMode::Holdback, StreamMode::Buffer]);
            let mut setup = setup(endpoint, mode);
            setup.prefill = prefill.to_owned();
            let (guard, frames) = guard_stream_with(setup, events);
            let context = format!(
                "round {round}, {endpoint:?} (reasoning {reasoning}), {mode:?}, {prefill:?} + {answer:?}"
            );

            let sent = sent_events(&frames);
            assert_blocks_close(&sent, &context);
            let text_at = ["/delta/text", "/choices/0/delta/content"];
            let received: String = sent
                .iter()
                .filter_map(|(_, data)| {
                    let data = data.as_ref()?;
                    text_at.iter().find_map(|at| data.pointer(at)?.as_str())
                })
                .collect();
            let shown = format!("{prefill}{received}");
            let stops = |h: &&Hit| matches!(h.action, Action::Block | Action::Redact);
            for hit in RULES.scan(Scope::Response, &shown).iter().filter(stops) {
                assert!(hit.end <= cut, "{context}: sent {:?}", &shown[hit.start..]);
            }
            // What the whole text's matches call for: all but redactions in
            // the prefill.
            let hits: Vec<Hit> = RULES
                .scan(Scope::Response, &text)
                .into_iter()
                .filter(|h| h.end > cut || h.action != Action::Redact)
                .collect();
            across += usize::from(hits.iter().any(|h| h.start < cut && h.end > cut));
            let blocks =
                |h: &&Hit| h.action == Action::Block || h.action == Action::Redact && h.start < cut;
            let must_block = hits.iter().any(|h| blocks(&h));
            // The text to `end` as shown once the answer's own redactions
            // (those that end by `end`) are made.
            let own: Vec<Hit> = hits.iter().filter(|h| h.start >= cut).cloned().collect();
            let shown_to = |end: usize| crate::rules::redact(&text[..end], &own);
            let expected = shown_to(text.len());
            if guard.blocked {
                blocked += 1;
                let ending = sent.iter().find_map(|(_, data)| {
                    let data = data.as_ref()?;
                    let at = ["/delta/stop_reason", "/choices/0/finish_reason"];
                    at.iter().find_map(|at| data.pointer(at)?.as_str())
                });
                let refusal = match endpoint {
                    Endpoint::Messages => "refusal",
                    _ => "content_filter",
                };
                assert_eq!(ending, Some(refusal), "{context}");
                // Nothing of the first match that stops went out, but what
                // the prefill holds of it.
                let stop = hits
                    .iter()
                    .filter(blocks)
                    .map(|h| h.start.max(cut))
                    .min()
                    .unwrap_or(text.len());
                assert!(
                    shown_to(stop).starts_with(&shown),
                    "{context}: sent {received:?}"
                );
                continue;
            }
            assert!(!must_block, "{context}: not blocked");
            redacted += usize::from(expected != text);
            assert_eq!(shown, expected, "{context}");
            // The record holds the text, then the reasoning.
            let read = match reasoning {
                true => format!("{received}\nWeighing it."),
                false => received,
            };
            assert_eq!(guard.read_text(), read, "{context}: the record");
        }
        assert!(
            across > 200 && blocked > 150 && redacted > 50,
            "{across} across the prefill, {blocked} blocked, {redacted} redacted"
        );
    }

    #[test]
    /// Chat completion streams of audio: the transcript cut at random, the
    /// audio's pieces between its pieces. The audio arrives whole with its
    /// transcript, or none of it: a transcript that a rule would block or
    /// redact ends the stream with `content_filter`.
    fn audio_streams_send_no_audio_of_a_transcript_a_rule_stops() {
        let mut rng = crate::testing::Lcg(13);
        let (mut blocked, mut passed) = (0, 0);
        for round in 0..200 {
            let text = random_text(&mut rng, 20);
            let chunk = |delta: Value, finish: Value| {
                let data = json!({"id": "c", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
                (None, data)
            };
            let audio = json!({"id": "a", "transcript": ""});
            let mut events = vec![chunk(
                json!({"role": "assistant", "audio": audio}),
                Value::Null,
            )];
            let mut sounds = Vec::new();
            for piece in rng.pieces(&text, 9) {
                if rng.below(2) == 0 {
                    let sound = format!("QUJD{}", sounds.len());
                    events.push(chunk(json!({"audio": {"data": sound}}), Value::Null));
                    sounds.push(sound);
                }
                events.push(chunk(json!({"audio": {"transcript": piece}}), Value::Null));
            }
            events.push(chunk(json!({}), json!("stop")));
            events.push((None, json!("[DONE]")));
            let mode = *rng.pick(&[StreamMode::Holdback, StreamMode::Buffer]);
            let (guard, frames) = guard_stream(Endpoint::ChatCompletions, mode, events);
            let context = format!("round {round}, {mode:?}");

            let sent = sent_events(&frames);
            let (mut transcript, mut heard) = (String::new(), Vec::new());
            for data in sent.iter().filter_map(|(_, data)| data.as_ref()) {
                let audio = data.pointer("/choices/0/delta/audio");
                let said = audio.and_then(|a| a["transcript"].as_str());
                transcript.push_str(said.unwrap_or(""));
                heard.extend(audio.and_then(|a| a["data"].as_str()).map(str::to_owned));
            }
            assert_nothing_stopped_sent(std::slice::from_ref(&transcript), &sent, &context);
            let stops = RULES.scan(Scope::Response, &text);
            if guard.blocked {
                blocked += 1;
                assert!(heard.is_empty() && transcript.is_empty(), "{context}");
                let ending = sent.iter().rev().find_map(|(_, data)| {
                    data.as_ref()?.pointer("/choices/0/finish_reason")?.as_str()
                });
                assert_eq!(ending, Some("content_filter"), "{context}");
                continue;
            }
            passed += 1;
            let stopping = |h: &Hit| matches!(h.action, Action::Block | Action::Redact);
            assert!(!stops.iter().any(stopping), "{context}: {text:?}");
            assert_eq!((transcript, heard), (text, sounds), "{context}");
        }
        assert!(
            blocked > 30 && passed > 30,
            "{blocked} blocked, {passed} passed"
        );
    }

    #[test]
    /// Chat completion streams of two or three choices (`n` > 1), their
    /// chunks interleaved at random: each choice is guarded as a text of
    /// its own, arrives under its own index redacted as the rules redact
    /// it whole, or every choice ends with `content_filter`.
    fn choices_of_a_stream_hold_nothing_a_rule_stops() {
        let mut rng = crate::testing::Lcg(11);
        let (mut blocked, mut redacted) = (0, 0);
        for round in 0..200 {
            let n = 2 + rng.below(2);
            let texts: Vec<String> = (0..n).map(|_| random_text(&mut rng, 12)).collect();
            let mut pieces: Vec<Vec<&str>> = texts.iter().map(|t| rng.pieces(t, 9)).collect();
            pieces.iter_mut().for_each(|p| p.reverse());
            let chunk = |index: usize, delta: Value, finish: Value| {
                (
                    None,
                    json!({"id": "c", "choices": [{"index": index, "delta": delta, "finish_reason": finish}]}),
                )
            };
            let mut events: Vec<(Option<&str>, Value)> = (0..n)
                .map(|i| chunk(i, json!({"role": "assistant", "content": ""}), Value::Null))
                .collect();
            let mut finished = vec![false; n];
            while finished.iter().any(|f| !f) {
                let index = rng.below(n);
                match pieces[index].pop() {
                    Some(piece) => {
                        events.push(chunk(index, json!({"content": piece}), Value::Null))
                    }
                    None if !finished[index] => {
                        finished[index] = true;
                        events.push(chunk(index, json!({}), json!("stop")));
                    }
                    None => {}
                }
            }
            events.push((None, json!("[DONE]")));
            let mode = *rng.pick(&[StreamMode::Holdback, StreamMode::Buffer]);
            let (guard, frames) = guard_stream(Endpoint::ChatCompletions, mode, events);
            let context = format!("round {round}, {n} choices, {mode:?}");

            let sent = sent_events(&frames);
            let mut received = vec![String::new(); n];
            let mut finishes: Vec<Option<String>> = vec![None; n];
            for (_, data) in &sent {
                let Some(data) = data else { continue };
                let choice = &data["choices"][0];
                let index = choice["index"].as_u64().unwrap() as usize;
                assert!(
                    finishes[index].is_none(),
                    "{context}: text after the finish: {sent:?}"
                );
                received[index] += choice["delta"]["content"].as_str().unwrap_or("");
                finishes[index] = choice["finish_reason"].as_str().map(String::from);
            }
            assert_eq!(sent.last().unwrap().1, None, "{context}: [DONE] last");
            assert_eq!(
                sent.iter().filter(|(_, d)| d.is_none()).count(),
                1,
                "{context}"
            );
            assert_nothing_stopped_sent(&received, &sent, &context);
            let expected: Vec<String> = texts.iter().map(|t| redacted_by_rules(t)).collect();
            if guard.blocked {
                blocked += 1;
                // A choice that ended before the block keeps its whole
                // text and its finish; every other one is filtered.
                for ((finish, received), expected) in finishes.iter().zip(&received).zip(&expected)
                {
                    match finish.as_deref() {
                        Some("stop") => assert_eq!(received, expected, "{context}"),
                        finish => assert_eq!(finish, Some("content_filter"), "{context}"),
                    }
                }
                assert!(
                    finishes
                        .iter()
                        .any(|f| f.as_deref() == Some("content_filter")),
                    "{context}"
                );
                continue;
            }
            redacted += usize::from(expected != texts);
            assert_eq!(received, expected, "{context}");
            assert_eq!(finishes, vec![Some("stop".to_owned()); n], "{context}");
        }
        assert!(
            blocked > 30 && redacted > 30,
            "{blocked} blocked, {redacted} redacted"
        );
    }

    #[test]
    /// The deltas the guard writes are cut from the part's first one: they
    /// carry the API's members of it, not a member that holds other text.
    fn re_framed_deltas_carry_only_the_apis_members() {
        let delta = |text: &str| {
            let delta = json!({"type": "response.output_text.delta", "item_id": "i", "output_index": 0,
                "content_index": 0, "sequence_number": 1, "delta": text,
                "note": "Put all your savings into Dogecoin."});
            (None, delta)
        };
        let events = vec![
            (
                None,
                json!({"type": "response.created", "response": {"id": "r", "output": []}}),
            ),
            delta("Start with a budget, "),
            delta("then build an emergency fund."),
            (
                None,
                json!({"type": "response.completed", "response": {"id": "r", "output": []}}),
            ),
        ];
        let (_, frames) =
            guard_stream_with(setup(Endpoint::Responses, StreamMode::Holdback), events);
        let sent = sent_events(&frames);
        let deltas: Vec<&Value> = (sent.iter().filter_map(|(_, data)| data.as_ref()))
            .filter(|data| data["type"] == "response.output_text.delta")
            .collect();
        let text: String = deltas.iter().filter_map(|d| d["delta"].as_str()).collect();
        assert_eq!(text, "Start with a budget, then build an emergency fund.");
        assert!(deltas.iter().all(|d| d.get("note").is_none()), "{deltas:?}");
        assert_eq!(deltas[0]["item_id"], "i");
    }

    #[test]
    /// A Responses API item or content part started a second time: the
    /// SDKs add another, but put the deltas of its index in the first,
    /// joined to its text (an e-mail address from two halves the guard
    /// would read apart). The stream ends as malformed at the second
    /// start, nothing of the second part sent.
    fn a_part_or_item_started_again_is_malformed() {
        let with = part_event;
        let item = json!({"type": "message", "id": "i", "role": "assistant", "content": []});
        let part_added = with(
            "response.content_part.added",
            json!({"part": {"type": "output_text", "text": ""}}),
        );
        let item_added = (
            None,
            json!({"type": "response.output_item.added", "output_index": 0, "item": item}),
        );
        for again in [
            vec![part_added.clone()],
            vec![item_added.clone(), part_added.clone()],
        ] {
            let mut events = vec![
                (
                    None,
                    json!({"type": "response.created", "response": {"id": "r", "output": []}}),
                ),
                item_added.clone(),
                part_added.clone(),
                with(
                    "response.output_text.delta",
                    json!({"delta": "Write to jane.doe@exa"}),
                ),
                with(
                    "response.output_text.done",
                    json!({"text": "Write to jane.doe@exa"}),
                ),
            ];
            events.extend(again);
            events.push(with(
                "response.output_text.delta",
                json!({"delta": "mple.com today."}),
            ));
            let (guard, frames) =
                guard_stream_with(setup(Endpoint::Responses, StreamMode::Holdback), events);
            let out: String = frames.iter().map(|f| String::from_utf8_lossy(f)).collect();
            assert!(guard.malformed, "{out}");
            assert!(!out.contains("mple.com"), "{out}");
        }
        // Parts and items in turn are no such thing.
        let events = vec![
            item_added.clone(),
            part_added.clone(),
            with(
                "response.content_part.added",
                json!({"content_index": 1, "part": {"type": "output_text", "text": ""}}),
            ),
            (
                None,
                json!({"type": "response.output_item.added", "output_index": 1, "item": item}),
            ),
            with(
                "response.content_part.added",
                json!({"output_index": 1, "part": {"type": "output_text", "text": ""}}),
            ),
        ];
        let (guard, _) =
            guard_stream_with(setup(Endpoint::Responses, StreamMode::Holdback), events);
        assert!(!guard.malformed);
    }

    #[test]
    /// An upstream that numbers more choices than the API allows ends the
    /// stream as malformed rather than hold a guard for each.
    fn a_stream_of_too_many_choices_is_malformed() {
        let chunk = |index: u64| {
            let chunk =
                json!({"choices": [{"index": index, "delta": {"content": "Budget first. "}}]});
            (None, chunk)
        };
        let mut events: Vec<(Option<&str>, Value)> = (0..1000).map(chunk).collect();
        events.push((None, json!("[DONE]")));
        for mode in [StreamMode::Holdback, StreamMode::Buffer] {
            let (guard, frames) = guard_stream(Endpoint::ChatCompletions, mode, events.clone());
            assert!(guard.malformed, "{mode:?}");
            assert_eq!(guard.others.len(), MAX_CHOICES - 1, "{mode:?}");
            sent_events(&frames);
        }
    }

    #[test]
    /// Events are numbered on from the upstream's first number, whatever
    /// it is: the largest one stays there rather than overflow.
    fn responses_events_are_numbered_from_the_first() {
        for first in [0, 7, u64::MAX - 1, u64::MAX] {
            let events = ["response.created", "response.in_progress", "error"]
                .into_iter()
                .enumerate()
                .map(|(i, name)| {
                    let number = first.saturating_add(i as u64);
                    (Some(name), json!({"type": name, "sequence_number": number}))
                })
                .collect();
            let (_, frames) = guard_stream(Endpoint::Responses, StreamMode::Holdback, events);
            let numbers: Vec<Value> = sent_events(&frames)
                .into_iter()
                .map(|(_, data)| data.unwrap()["sequence_number"].clone())
                .collect();
            let expected: Vec<u64> = (0..3).map(|i| first.saturating_add(i)).collect();
            assert_eq!(numbers, expected, "{first}");
        }
    }

    #[test]
    /// A repeated text nested deeper than the guard reads is not sent
    /// unchecked: the stream ends blocked there.
    fn an_event_nesting_its_texts_too_deep_to_read_ends_the_stream() {
        let stream = |depth: usize| {
            let mut item = json!({"type": "output_text", "text": "Budget first."});
            for _ in 0..depth {
                item = json!({"type": "message", "content": [item]});
            }
            numbered(vec![
                ("response.created", json!({"response": {"id": "r"}})),
                (
                    "response.completed",
                    json!({"response": {"id": "r", "output": [item]}}),
                ),
            ])
        };
        for mode in [StreamMode::Holdback, StreamMode::Buffer] {
            let (guard, frames) = guard_stream(Endpoint::Responses, mode, stream(10));
            assert!(!guard.blocked, "{mode:?}");
            let sent = sent_events(&frames);
            assert_eq!(
                sent.last().unwrap().0.as_deref(),
                Some("response.completed")
            );

            let (guard, frames) = guard_stream(Endpoint::Responses, mode, stream(40));
            assert!(guard.blocked, "{mode:?}");
            let sent = sent_events(&frames);
            assert_eq!(
                sent.last().unwrap().0.as_deref(),
                Some("response.incomplete")
            );
            assert!(
                !sent
                    .iter()
                    .any(|(name, _)| name.as_deref() == Some("response.completed"))
            );
        }
    }

    #[test]
    fn the_texts_an_event_repeats_are_read_where_they_stand() {
        let data = json!({
            "type": "response.completed",
            "text": "t", "refusal": "r", "arguments": "a", "input": "i",
            "code": "c", "query": "q", "diff": "d", "command": "one",
            "commands": ["two", 3, "th\"ree"],
            "part": {"text": "p", "id": "not read"},
            "item": {"content": [{"text": "ct"}, "x"], "summary": [{"text": "s"}],
                     "action": {"command": ["ls", "-l"], "query": 4}},
            "response": {"output": [{"operation": {"diff": "od"}}, {"actions": [{"text": "at"}]}]},
            // Of another type than the walk reads: skipped.
            "output": "o", "content": {"text": "no"}, "summary": "no",
            "logprobs": [{"text": "no"}],
            "sequence_number": 3,
        })
        .to_string();
        let mut texts = Vec::new();
        repeated_texts(&mut Reader::new(&data), &mut texts).unwrap();
        let mut found: Vec<String> = texts.iter().map(|t| t.value.to_string()).collect();
        // The token of each, its quotes and escapes as they stand.
        for text in &texts {
            let token: String = serde_json::from_str(&data[text.token.clone()]).unwrap();
            assert_eq!(token, text.value);
        }
        found.sort();
        let mut expected = [
            "t", "r", "a", "i", "c", "q", "d", "one", "two", "th\"ree", "p", "ct", "s", "ls", "-l",
            "od", "at",
        ];
        expected.sort();
        assert_eq!(found, expected);
        // Data that is not JSON repeats nothing.
        assert!(repeated_texts(&mut Reader::new(r#"{"text":"#), &mut Vec::new()).is_err());
    }

    #[test]
    /// Text an event repeats that the deltas never carried is read as
    /// well; in buffer mode, nothing of an answer it blocks is sent.
    fn repeated_text_that_was_not_streamed_is_read() {
        let stream = |repeated: &str| -> Vec<(Option<&str>, Value)> {
            let at = json!({"item_id": "m", "output_index": 0, "content_index": 0});
            let mut part = at.clone();
            part["part"] = json!({"text": ""});
            let mut delta = at.clone();
            delta["delta"] = json!("Budget first.");
            let mut done = at;
            done["text"] = json!(repeated);
            numbered(vec![
                ("response.created", json!({"response": {"id": "r"}})),
                ("response.content_part.added", part),
                ("response.output_text.delta", delta),
                ("response.output_text.done", done),
                ("response.completed", json!({"response": {"id": "r"}})),
            ])
        };
        for mode in [StreamMode::Holdback, StreamMode::Buffer] {
            let blocked = stream("Borrow money to invest in crypto.");
            let (guard, frames) = guard_stream(Endpoint::Responses, mode, blocked);
            assert!(guard.blocked, "{mode:?}");
            let sent = sent_events(&frames);
            let names: Vec<&str> = sent.iter().filter_map(|(n, _)| n.as_deref()).collect();
            let expected = match mode {
                StreamMode::Buffer => vec!["response.incomplete"],
                // "Budget " goes out at once, "first." at the part's end.
                _ => vec![
                    "response.created",
                    "response.content_part.added",
                    "response.output_text.delta",
                    "response.output_text.delta",
                    "response.incomplete",
                ],
            };
            assert_eq!(names, expected, "{mode:?}");
            for (number, (_, data)) in sent.iter().enumerate() {
                assert_eq!(data.as_ref().unwrap()["sequence_number"], number);
            }

            let (guard, frames) =
                guard_stream(Endpoint::Responses, mode, stream("Mail a@b.example.com."));
            assert!(!guard.blocked, "{mode:?}");
            let sent = sent_events(&frames);
            let done = sent
                .iter()
                .find(|(n, _)| n.as_deref() == Some("response.output_text.done"));
            assert_eq!(
                done.unwrap().1.as_ref().unwrap()["text"],
                "Mail [REDACTED:email]."
            );
        }
    }

    #[test]
    /// An annotation points into its part's text: it goes out after all of
    /// that text, however much was still held back when it came.
    fn annotations_follow_the_text_they_point_into() {
        let at = json!({"item_id": "m", "output_index": 0, "content_index": 0});
        let with = |name: &'static str, extra: Value| {
            let mut data = at.clone();
            data.as_object_mut()
                .unwrap()
                .extend(extra.as_object().unwrap().clone());
            (name, data)
        };
        let text = "Index funds spread the risk. ".repeat(30);
        let mut events = vec![with(
            "response.content_part.added",
            json!({"part": {"text": ""}}),
        )];
        let pieces: Vec<&str> = text.split_inclusive(' ').collect();
        for (i, piece) in pieces.iter().enumerate() {
            events.push(with("response.output_text.delta", json!({"delta": piece})));
            if i == pieces.len() - 3 {
                events.push(with(
                    "response.output_text.annotation.added",
                    json!({"annotation_index": 0, "annotation": {"type": "url_citation", "start_index": 0, "end_index": 5}}),
                ));
            }
        }
        events.push(with("response.output_text.done", json!({"text": text})));
        let events = numbered(events);
        let (_, frames) = guard_stream(Endpoint::Responses, StreamMode::Holdback, events);
        let names: Vec<String> = sent_events(&frames)
            .into_iter()
            .filter_map(|(name, _)| name)
            .collect();
        let annotation = names
            .iter()
            .position(|n| n == "response.output_text.annotation.added")
            .unwrap();
        let last_delta = names
            .iter()
            .rposition(|n| n == "response.output_text.delta")
            .unwrap();
        assert!(annotation > last_delta, "{names:?}");
        assert_eq!(names.last().unwrap(), "response.output_text.done");
    }

    #[test]
    /// A redaction whose match grows as text arrives (an address or a key
    /// is a match at each of its ends) covers the whole of it, however the
    /// checks fall: none of it reaches the client.
    fn a_redaction_covers_its_match_as_it_grows() {
        let padding = "Here is my advice for you today, step by step. ".repeat(3);
        for (secret, placeholder) in [
            ("jane.doe@example.com", "[REDACTED:email]"),
            (
                "sk-proj-Ab3dEf6hIj9kLm2nOp5qRs8tUv1wXy4zAb3dEf6h",
                "[REDACTED:openai_key]",
            ),
        ] {
            // Each offset of the secret against the checks' 64-byte steps.
            for shift in 0..CHECK_STEP {
                let text = format!("{}Write to {secret} today. {padding}", "x".repeat(shift));
                let mut guard = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Holdback));
                let mut frames = Vec::new();
                for c in text.chars() {
                    frames.extend(guard.on_event(openai_delta(&c.to_string())));
                }
                frames.extend(guard.on_end());
                assert_eq!(
                    released_text(&frames),
                    text.replace(secret, placeholder),
                    "shift {shift}"
                );
            }
        }
    }

    /// A release point is never inside a redaction, nor inside one that
    /// overlaps the redaction it moved back to, in whichever order the
    /// hits were found.
    #[test]
    fn a_release_point_splits_no_redaction_that_overlaps_another() {
        let rules = setup(Endpoint::ChatCompletions, StreamMode::Holdback).rules;
        let text = "Call me on the phone now, it is fine by me. ";
        let view = Normalized::new(text);
        let free = safe_end(&rules, text, 0, 0, 0, &view, &[]);
        assert!(free > 20, "{free}");
        let email = rules
            .scan(Scope::Response, "jane.doe@example.com")
            .remove(0);
        let span = |start, end| Hit {
            start,
            end,
            ..email.clone()
        };
        let (first, second) = (span(5, 17), span(6, free + 1));
        for hits in [[first.clone(), second.clone()], [second, first]] {
            assert_eq!(safe_end(&rules, text, 0, 0, 0, &view, &hits), 5, "{hits:?}");
        }
    }

    /// Two redactions that overlap (a phone number whose digits run on
    /// into a card number) go out as one placeholder, as the whole
    /// answer is redacted: none of the second match's digits reach the
    /// client, however the text is cut.
    #[test]
    fn overlapping_redactions_leave_nothing_of_either_match() {
        let padding = "Here is my advice for you today, step by step. ".repeat(3);
        let numbers = "+1 1 1 1 1 1 2345 6789 0120";
        let text = format!("Call {numbers} now. {padding}");
        let rules = setup(Endpoint::ChatCompletions, StreamMode::Holdback).rules;
        let whole = redact(&text, &rules.scan(Scope::Response, &text));
        assert_eq!(whole, format!("Call [REDACTED:phone] now. {padding}"));
        let mut random = crate::testing::Lcg(9);
        for round in 0..50 {
            let mut guard = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Holdback));
            let mut frames = Vec::new();
            let pieces = match round {
                0 => text.chars().map(String::from).collect(),
                _ => random
                    .pieces(&text, 12)
                    .into_iter()
                    .map(String::from)
                    .collect::<Vec<_>>(),
            };
            for piece in &pieces {
                frames.extend(guard.on_event(openai_delta(piece)));
            }
            frames.extend(guard.on_end());
            assert_eq!(released_text(&frames), whole, "{pieces:?}");
        }
    }

    /// Long answers, several times the hold, with one phrase a rule stops
    /// (or none) anywhere in them, cut at random: each check scans only
    /// the text since the last one and the hold before it, and still
    /// finds every match. Held text (reasoning) the same.
    #[test]
    fn long_answers_are_read_whole_by_windows() {
        let mut rng = crate::testing::Lcg(21);
        let safe = [
            "Start with a budget and an emergency fund. ",
            "Index funds spread the risk. ",
            "Un café crème, naïve résumé: 💰📈 ",
            "A B C, 1 2 3, i.e. e.g. ",
            "毎月の予算を立てて、緊急資金を貯めましょう。",
            "インデックスファンドはリスクを分散します！\n",
        ];
        let stops = [
            "Put all your savings into Dogecoin right now. ",
            "Put all your s4vings into D0gecoin right now. ",
            "g u a r a n t e e d returns of 20% a year. ",
            "Write to jane.doe@example.com today. ",
            "My card is 4111 1111 1111 1111. ",
        ];
        let (mut blocked, mut redacted) = (0, 0);
        for round in 0..300 {
            let mut sentences: Vec<&str> =
                (0..40 + rng.below(80)).map(|_| *rng.pick(&safe)).collect();
            if rng.below(4) != 0 {
                let at = rng.below(sentences.len() + 1);
                sentences.insert(at, *rng.pick(&stops));
            }
            let text: String = sentences.concat();
            let reasoning = rng.below(2) == 0;
            let delta = |piece: &str| match reasoning {
                true => json!({"content": null, "reasoning_content": piece}),
                false => json!({"content": piece}),
            };
            let mut events: Vec<(Option<&str>, Value)> = rng.pieces(&text, 12)
                .into_iter()
                .map(|piece| (None, json!({"choices": [{"index": 0, "delta": delta(piece), "finish_reason": null}]})))
                .collect();
            events.push((
                None,
                json!({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}),
            ));
            events.push((None, json!("[DONE]")));
            let (guard, frames) =
                guard_stream(Endpoint::ChatCompletions, StreamMode::Holdback, events);
            let context = format!("round {round}, reasoning {reasoning}");
            let sent = sent_events(&frames);
            let key = if reasoning {
                "reasoning_content"
            } else {
                "content"
            };
            let received: String = sent
                .iter()
                .filter_map(|(_, data)| {
                    data.as_ref()?
                        .pointer(&format!("/choices/0/delta/{key}"))?
                        .as_str()
                })
                .collect();
            assert_nothing_stopped_sent(std::slice::from_ref(&received), &sent, &context);
            let hits = RULES.scan(Scope::Response, &text);
            // Held text cannot be redacted: a redaction blocks it.
            let stopping = |action: &Action| match reasoning {
                true => matches!(action, Action::Block | Action::Redact),
                false => *action == Action::Block,
            };
            assert_eq!(
                guard.blocked,
                hits.iter().any(|h| stopping(&h.action)),
                "{context}"
            );
            if guard.blocked {
                blocked += 1;
                continue;
            }
            let expected = redacted_by_rules(&text);
            redacted += usize::from(expected != text);
            assert_eq!(received, expected, "{context}");
            let mut found: Vec<_> = guard
                .response_hits()
                .map(|h| (h.rule, h.start, h.end))
                .collect();
            let mut whole: Vec<_> = hits.into_iter().map(|h| (h.rule, h.start, h.end)).collect();
            found.sort();
            whole.sort();
            assert_eq!(found, whole, "{context}");
        }
        assert!(
            blocked > 50 && redacted > 20,
            "{blocked} blocked, {redacted} redacted"
        );
    }

    /// Holdback releases all the text in which no match can be under way,
    /// up to its last check (at first, every delta), and nothing from
    /// where one may be: not the
    /// start of a phrase a rule stops, nor of a secret, however long it
    /// grows (its regex has no longest match).
    #[test]
    fn holdback_releases_text_up_to_a_match_under_way() {
        let stream = |pieces: &[&str]| {
            let mut guard = Guard::new(setup(Endpoint::ChatCompletions, StreamMode::Holdback));
            let mut frames = Vec::new();
            for piece in pieces {
                frames.extend(guard.on_event(openai_delta(piece)));
            }
            (guard, frames)
        };
        // Japanese has no spaces: it is released after its sentence marks.
        // Hindi and Thai have no ASCII punctuation: after their words.
        for sentence in [
            "Here is my advice for you today, step by step. ",
            "毎月の予算を立てて、緊急資金を貯めましょう。",
            "हर महीने बजट बनाएं और आपातकालीन निधि में पैसे जमा करें। ",
            "วางแผนงบประมาณทุกเดือน และเก็บเงินฉุกเฉิน ",
        ] {
            let (guard, frames) = stream(&[sentence; 40]);
            let released = released_text(&frames);
            let total = sentence.len() * 40;
            assert!(
                released.len() + 64 + sentence.len() >= total,
                "{} of {total}",
                released.len()
            );
            assert!(!guard.blocked);
        }
        // The first words go out at once, before a whole step of text.
        let (_, frames) = stream(&["Start ", "with ", "a ", "budget"]);
        assert_eq!(released_text(&frames), "Start with ");
        let advice = "Index funds spread the risk. ".repeat(10);
        let key = format!("Your key: sk-proj-{}", "Ab3dEf6hIj".repeat(100));
        let stop = "Then put all your savings in";
        for (under_way, end) in [(key.as_str(), " for now. "), (stop, "to Dogecoin. ")] {
            let text = format!("{advice}{under_way}");
            let pieces: Vec<&str> = crate::testing::Lcg(3).pieces(&text, 7);
            let (mut guard, mut frames) = stream(&pieces);
            let released = released_text(&frames);
            let start = under_way.find(['s', 'p']).unwrap();
            assert!(
                released.len() + 64 >= advice.len() && released.len() <= advice.len() + start,
                "{released:?}"
            );
            frames.extend(guard.on_event(openai_delta(end)));
            frames.extend(guard.on_end());
            let sent = released_text(&frames);
            assert!(
                !sent.contains("sk-proj") && !sent.contains("savings"),
                "{sent:?}"
            );
        }
    }

    /// A panic while the body is polled (here the upstream's; the guard's
    /// own unwinds the same way) ends the stream with the API's error
    /// event, as the API ends a stream on a server error: what was sent
    /// stays sent, and the drop of the guard still reports it, fault
    /// noted, so the exchange is recorded.
    #[tokio::test]
    async fn a_stream_whose_poll_panics_ends_with_an_error_event_and_reports_its_outcome() {
        let first = openai_delta("Start with a budget, ").raw;
        let upstream = futures_util::stream::iter([Ok::<_, String>(first.clone())]).chain(
            futures_util::stream::poll_fn::<Result<Bytes, String>, _>(|_| {
                panic!("a fault while the stream is read")
            }),
        );
        let (tx, rx) = std::sync::mpsc::channel();
        let body = guard_body(
            setup(Endpoint::ChatCompletions, StreamMode::Holdback),
            upstream,
            move |outcome| tx.send(outcome).unwrap(),
        );
        let sent = served(body).await;
        let outcome = rx.try_recv().expect("no outcome reported");
        assert_eq!(outcome.text, "Start with a budget, ");
        assert_eq!(outcome.verdict.decision, Decision::Allow);
        assert!(outcome.faulted);
        assert_eq!(outcome.end, StreamEnd::Fault);
        let mut events = SseParser::default()
            .push(sent)
            .collect::<Vec<_>>()
            .into_iter();
        assert_eq!(events.next().unwrap().raw, first);
        let ending = events.next().expect("no error event");
        assert!(ending.event.is_none() && events.next().is_none());
        let error: Value = serde_json::from_str(ending.data.as_deref().unwrap()).unwrap();
        assert_eq!(error["error"]["type"], "server_error");
        assert_eq!(error["error"]["code"], "internal_error");
    }

    /// `body` as a client reads it from a server over a real connection.
    async fn served(body: ProxyBody) -> Bytes {
        use hyper_util::rt::{TokioExecutor, TokioIo};
        let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let body = std::sync::Mutex::new(Some(body));
        tokio::spawn(async move {
            let (stream, _) = listener.accept().await.unwrap();
            let service = hyper::service::service_fn(move |_| {
                let body = body.lock().unwrap().take().expect("one request");
                let mut response = http::Response::new(body);
                response.headers_mut().insert(
                    http::header::CONTENT_TYPE,
                    http::HeaderValue::from_static("text/event-stream"),
                );
                async move { Ok::<_, std::convert::Infallible>(response) }
            });
            let builder = hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
            let _ = builder
                .serve_connection(TokioIo::new(stream), service)
                .await;
        });
        let response = reqwest::get(format!("http://{addr}/")).await.unwrap();
        assert_eq!(response.status(), 200);
        response.bytes().await.expect("the stream was cut")
    }

    /// Each API's own error event ends a stream whose guard failed.
    #[tokio::test]
    async fn a_fault_ends_each_apis_stream_with_its_error_event() {
        for (endpoint, name, kind) in [
            (Endpoint::Completions, None, "/error/type"),
            (Endpoint::Responses, Some("error"), "/code"),
            (Endpoint::Messages, Some("error"), "/error/type"),
        ] {
            let upstream = futures_util::stream::poll_fn::<Result<Bytes, String>, _>(|_| {
                panic!("a fault while the stream is read")
            });
            let (tx, rx) = std::sync::mpsc::channel();
            let body = guard_body(setup(endpoint, StreamMode::Buffer), upstream, move |o| {
                tx.send(o).unwrap()
            });
            let sent = body.collect().await.unwrap().to_bytes();
            assert!(rx.try_recv().unwrap().faulted);
            let events: Vec<SseEvent> = SseParser::default().push(sent).collect();
            let [ending] = &events[..] else {
                panic!("{endpoint:?}: {events:?}")
            };
            assert_eq!(ending.event.as_deref(), name, "{endpoint:?}");
            let error: Value = serde_json::from_str(ending.data.as_deref().unwrap()).unwrap();
            let expected = match endpoint {
                Endpoint::Messages => "api_error",
                Endpoint::Responses => "internal_error",
                _ => "server_error",
            };
            assert_eq!(error.pointer(kind).unwrap(), expected, "{endpoint:?}");
            if endpoint == Endpoint::Responses {
                assert_eq!(error["sequence_number"], 0);
            }
        }
    }
}

//! What the stream guard reads of an event's data: the few fields that
//! say what the event means and the text it carries, in one pass with
//! jiter's pull parser, which checks the whole event is JSON while it
//! skips what the guard does not read. The rules are those of the bodies
//! ([`crate::json`]): a field of another type than expected reads as
//! absent, and an object the guard reads that holds one of its keys twice
//! makes the event malformed, since two parsers may disagree on which
//! value counts.
//!
//! Most text events of a stream differ from the one before only in some
//! strings: the text, and members the guard skips (OpenAI's `obfuscation`
//! padding, say), between the same keys, numbers and punctuation. A
//! [`Shape`] keeps the last text event read in full as its fixed bytes and
//! the places of those strings. An event made of the same fixed bytes with
//! one JSON string in each place is the same event with other strings
//! there (putting one string token in place of another keeps a JSON text
//! valid and its structure unchanged), so only the strings are read: the
//! text is taken, the others only checked to be strings.

use std::borrow::Cow;
use std::ops::Range;
use std::sync::LazyLock;

use jiter::Peek;
use memchr::memmem;

pub use crate::json::Text;
use crate::json::{ReadError, Reader};

/// An event that is not JSON, or that holds a key the guard reads twice
/// in one object.
#[derive(Debug)]
pub struct Malformed;

impl From<ReadError> for Malformed {
    fn from(_: ReadError) -> Self {
        Malformed
    }
}

impl From<jiter::JiterError> for Malformed {
    fn from(_: jiter::JiterError) -> Self {
        Malformed
    }
}

/// The fields the guard reads of an event, at every level it reads.
/// Absent fields, and fields of another type, are `None`.
#[derive(Debug, Default)]
pub struct Event<'a> {
    /// `type` (Anthropic, Responses API).
    pub kind: Option<Cow<'a, str>>,
    /// `index`: Anthropic's content block.
    pub index: Option<u64>,
    /// Where a Responses API event is in the response: its item
    /// (`output_index`), and in it its content part (`content_index`) or
    /// reasoning summary part (`summary_index`).
    pub output_index: Option<u64>,
    pub content_index: Option<u64>,
    pub summary_index: Option<u64>,
    /// `delta` when it is an object (Anthropic).
    pub delta: Delta<'a>,
    /// `delta` when it is a string (Responses API).
    pub delta_text: Option<Text<'a>>,
    /// A block's start as it comes: `content_block` (Anthropic's
    /// `content_block_start`) or `part` (the Responses API's
    /// `response.content_part.added`), read as a delta is.
    pub content_block: Delta<'a>,
    /// The first of `choices` (OpenAI).
    pub choice: Choice<'a>,
    /// The JSON text of `usage`, or else of `message.usage` or
    /// `response.usage`, when it is an object.
    pub usage: Option<&'a str>,
    /// The JSON text of `message` (Anthropic's `message_start`) when its
    /// `content` is not empty, as the API never sends it: the SDKs' stream
    /// helpers start the message they build from it.
    pub message: Option<&'a str>,
    /// Where the strings lie that are members of the objects read, but
    /// not read themselves (ids, model names, padding), in order.
    pub skipped: Vec<Range<usize>>,
    /// Whether it has an `error` object: an OpenAI chunk that reports an
    /// error mid-stream, an Anthropic `error` event.
    pub error: bool,
}

/// A delta object: Anthropic's `type`, `text`, `partial_json` (a tool's
/// input) and `thinking`, OpenAI's `content`, `refusal` and the
/// `arguments` (or custom `input`) of each of its `tool_calls`, and the reasoning of
/// OpenAI-compatible servers (`reasoning_content`, `reasoning`, Mistral's
/// `thinking` parts of `content`).
#[derive(Debug, Default)]
pub struct Delta<'a> {
    pub kind: Option<Cow<'a, str>>,
    pub text: Option<Text<'a>>,
    pub content: Option<Text<'a>>,
    pub refusal: Option<Text<'a>>,
    pub partial_json: Option<Text<'a>>,
    pub arguments: Vec<Text<'a>>,
    /// The texts of `content` when it is an array of parts (strings, or
    /// objects with a `text`), as some OpenAI-compatible servers send it:
    /// held whole, not re-framed.
    pub content_parts: Vec<Text<'a>>,
    /// `thinking` (Anthropic's, or the text parts of Mistral's),
    /// `reasoning_content` and `reasoning`, in order.
    pub reasoning: Vec<Text<'a>>,
    /// Whether it carries `audio` (OpenAI), and the audio's `transcript`.
    pub audio: bool,
    pub transcript: Option<Text<'a>>,
    /// Whether it carries `annotations` (OpenAI: the pages a web search
    /// found, which its text cites).
    pub annotated: bool,
    /// Its `role` (OpenAI: the first delta of a choice's message).
    pub role: Option<Text<'a>>,
    /// The `index` of the first and the last of its `tool_calls` that
    /// have one (OpenAI), which come in order.
    pub calls: Option<(u64, u64)>,
    /// The JSON text of `input` when it is an object: a tool's input in
    /// its block's start (Anthropic), which the API sends empty and the
    /// SDKs' stream helpers keep as the input when no delta follows.
    pub input: Option<&'a str>,
}

/// An OpenAI choice.
#[derive(Debug, Default)]
pub struct Choice<'a> {
    /// Its `index`: which of several choices (`n` > 1) the chunk is of.
    pub index: Option<u64>,
    pub delta: Delta<'a>,
    /// Legacy completions' `text`.
    pub text: Option<Text<'a>>,
    /// The JSON text of `logprobs`, when it is an object.
    pub logprobs: Option<&'a str>,
    /// Whether `finish_reason` is there and not `null`.
    pub finished: bool,
    /// Whether `choices` has more items than this one (whatever they
    /// are): a chunk of several choices, read choice by choice (see
    /// [`super::split_choices`]).
    pub several: bool,
}

impl<'a> Event<'a> {
    /// Reads an event's data. JSON that is not an object has none of the
    /// fields.
    pub fn read(data: &'a str) -> Result<Event<'a>, Malformed> {
        let mut reader = Reader::new(data).noting_skipped();
        let mut event = Event::default();
        if reader.jiter.peek()? == Peek::Object {
            let keys = [
                "type",
                "index",
                "delta",
                "choices",
                "usage",
                "content_block",
                "part",
                "message",
                "response",
                "output_index",
                "content_index",
                "summary_index",
                "error",
            ];
            let mut inner_usage = None;
            reader.object(keys, |reader, key| {
                match key {
                    0 => event.kind = reader.string()?.map(|s| s.value),
                    1 => event.index = reader.index()?,
                    2 => match reader.jiter.peek()? {
                        Peek::String => event.delta_text = reader.string()?,
                        Peek::Object => event.delta = Delta::read(reader)?,
                        other => reader.jiter.known_skip(other)?,
                    },
                    3 => event.choice = Choice::first(reader)?,
                    4 => event.usage = reader.object_text()?,
                    5 | 6 => {
                        if reader.is_object()? {
                            event.content_block = Delta::read(reader)?;
                        }
                    }
                    7 => {
                        let start = reader.jiter.current_index();
                        if reader.is_object()? {
                            let mut content = false;
                            reader.object(["usage", "content"], |reader, key| {
                                match key {
                                    0 => inner_usage = inner_usage.or(reader.object_text()?),
                                    _ => content = data[reader.span()?].trim() != "[]",
                                }
                                Ok(())
                            })?;
                            if content {
                                event.message = Some(&data[start..reader.jiter.current_index()]);
                            }
                        }
                    }
                    9 => event.output_index = reader.index()?,
                    10 => event.content_index = reader.index()?,
                    11 => event.summary_index = reader.index()?,
                    12 => event.error = reader.object_text()?.is_some(),
                    _ => {
                        if reader.is_object()? {
                            reader.object(["usage"], |reader, _| {
                                inner_usage = inner_usage.or(reader.object_text()?);
                                Ok(())
                            })?;
                        }
                    }
                }
                Ok(())
            })?;
            event.usage = event.usage.or(inner_usage);
        } else {
            reader.jiter.next_skip()?;
        }
        reader.jiter.finish()?;
        event.skipped = reader.skipped.unwrap_or_default();
        Ok(event)
    }
}

impl<'a> Choice<'a> {
    /// The first item of `choices`, when it is an object; the other items
    /// are only checked to be JSON, and counted (`several`).
    fn first(reader: &mut Reader<'a>) -> Result<Choice<'a>, ReadError> {
        let mut choice = Choice::default();
        let peek = reader.jiter.peek()?;
        if peek != Peek::Array {
            reader.jiter.known_skip(peek)?;
            return Ok(choice);
        }
        let mut item = reader.jiter.known_array()?;
        if item == Some(Peek::Object) {
            reader.object(
                ["delta", "text", "finish_reason", "index", "logprobs"],
                |reader, key| {
                    match key {
                        0 => {
                            if reader.is_object()? {
                                choice.delta = Delta::read(reader)?;
                            }
                        }
                        1 => choice.text = reader.string()?,
                        2 => choice.finished = reader.not_null()?,
                        3 => choice.index = reader.index()?,
                        _ => choice.logprobs = reader.object_text()?,
                    }
                    Ok(())
                },
            )?;
        } else if let Some(peek) = item {
            reader.jiter.known_skip(peek)?;
        }
        if item.is_some() {
            item = reader.jiter.array_step()?;
            choice.several = item.is_some();
        }
        while let Some(peek) = item {
            reader.jiter.known_skip(peek)?;
            item = reader.jiter.array_step()?;
        }
        Ok(choice)
    }
}

impl<'a> Delta<'a> {
    /// Reads a delta object, the reader at its start.
    fn read(reader: &mut Reader<'a>) -> Result<Delta<'a>, ReadError> {
        let mut delta = Delta::default();
        let keys = [
            "type",
            "text",
            "content",
            "refusal",
            "partial_json",
            "tool_calls",
            "thinking",
            "reasoning_content",
            "reasoning",
            "audio",
            "function_call",
            "annotations",
            "role",
            "input",
        ];
        reader
            .object(keys, |reader, key| {
                if key == 5 {
                    return delta.read_tool_calls(reader);
                }
                // Read with the whole event when they matter.
                if key == 11 {
                    delta.annotated = reader.is(Peek::Array)?;
                    return match delta.annotated {
                        true => reader.skip(),
                        false => Ok(()),
                    };
                }
                // Content as parts, as some OpenAI-compatible servers send
                // it: text, and Mistral's reasoning (`thinking`, a list of
                // text parts).
                if key == 2 && reader.jiter.peek()? == Peek::Array {
                    return reader.array(|reader| match reader.jiter.peek()? {
                        Peek::String => {
                            delta.content_parts.extend(reader.string()?);
                            Ok(())
                        }
                        Peek::Object => reader.object(["text", "thinking"], |reader, key| {
                            if key == 0 {
                                delta.content_parts.extend(reader.string()?);
                                return Ok(());
                            }
                            if !reader.is(Peek::Array)? {
                                return Ok(());
                            }
                            reader.array(|reader| match reader.is_object()? {
                                true => reader.object(["text"], |reader, _| {
                                    delta.reasoning.extend(reader.string()?);
                                    Ok(())
                                }),
                                false => Ok(()),
                            })
                        }),
                        _ => reader.skip(),
                    });
                }
                // The deprecated functions API's one call.
                if key == 10 {
                    if !reader.is_object()? {
                        return Ok(());
                    }
                    return reader.object(["arguments"], |reader, _| {
                        delta.arguments.extend(reader.string()?);
                        Ok(())
                    });
                }
                if key == 13 {
                    delta.input = reader.object_text()?;
                    return Ok(());
                }
                if key == 9 {
                    delta.audio = reader.is_object()?;
                    return match delta.audio {
                        true => reader.object(["transcript"], |reader, _| {
                            delta.transcript = reader.string()?;
                            Ok(())
                        }),
                        false => Ok(()),
                    };
                }
                let string = reader.string()?;
                match key {
                    0 => delta.kind = string.map(|s| s.value),
                    1 => delta.text = string,
                    2 => delta.content = string,
                    3 => delta.refusal = string,
                    4 => delta.partial_json = string,
                    12 => delta.role = string,
                    _ => delta.reasoning.extend(string),
                }
                Ok(())
            })
            .map(|()| delta)
    }

    /// The `function.arguments` (or a custom tool's `custom.input`) of
    /// each item of `tool_calls`, in order.
    /// A call whose `index` is below one before it is an error: the
    /// SDKs gather each call's arguments by its index, and the guard reads
    /// them in the order they come (see [`Delta::calls`]).
    fn read_tool_calls(&mut self, reader: &mut Reader<'a>) -> Result<(), ReadError> {
        if !reader.is(Peek::Array)? {
            return Ok(());
        }
        reader.array(|reader| {
            if !reader.is_object()? {
                return Ok(());
            }
            reader.object(["function", "custom", "index"], |reader, call| {
                if call == 2 {
                    let Some(index) = reader.index()? else {
                        return Ok(());
                    };
                    self.calls = match self.calls {
                        Some((_, last)) if index < last => {
                            return Err(ReadError::Invalid("tool calls out of order".into()));
                        }
                        Some((first, _)) => Some((first, index)),
                        None => Some((index, index)),
                    };
                    return Ok(());
                }
                if !reader.is_object()? {
                    return Ok(());
                }
                reader.object(["arguments", "input"], |reader, key| {
                    if key == call {
                        self.arguments.extend(reader.string()?);
                        return Ok(());
                    }
                    reader.skip()
                })
            })
        })
    }

    /// The texts of the delta that are JSON: a tool's input, a call's
    /// arguments.
    pub fn json_texts(&self) -> impl Iterator<Item = &str> {
        let texts = self.partial_json.iter().chain(&self.arguments);
        texts.map(|t| &*t.value)
    }

    /// The text of a delta that the guard cannot re-frame and so holds
    /// whole: content sent as parts, a refusal, tool-call arguments (a call's opening, with none
    /// yet, too), a tool's input, reasoning, audio (its transcript; a
    /// piece of the audio alone, too, since it says what the transcript
    /// writes). An empty refusal or reasoning, which some servers send
    /// beside every piece of text, holds nothing.
    pub fn held_text(&self) -> Option<String> {
        let refusal = self.refusal.as_ref().filter(|t| !t.value.is_empty());
        let reasoning = self.reasoning.iter().filter(|t| !t.value.is_empty());
        if refusal.is_none()
            && self.partial_json.is_none()
            && self.arguments.is_empty()
            && self.content_parts.is_empty()
            && reasoning.clone().next().is_none()
            && !self.audio
        {
            return None;
        }
        let parts = refusal
            .into_iter()
            .chain(&self.content_parts)
            .chain(&self.partial_json)
            .chain(&self.arguments)
            .chain(reasoning)
            .chain(&self.transcript);
        Some(parts.map(|t| &*t.value).collect())
    }
}

/// Whether a chunk is an error in the shape vLLM's OpenAI server once
/// sent mid-stream, `{"object":"error","message":…,"code":…}`, with no
/// `error` member. Read only for chunks with no text, and only when the
/// word is there.
pub fn is_error_object(data: &str) -> bool {
    #[derive(serde::Deserialize)]
    struct Object<'a> {
        #[serde(borrow)]
        object: Option<Cow<'a, str>>,
    }
    memmem::find(data.as_bytes(), b"\"error\"").is_some()
        && serde_json::from_str::<Object>(data).is_ok_and(|o| o.object.as_deref() == Some("error"))
}

/// The `sequence_number` of a Responses API event (its data), and where
/// its digits lie; `None` when it has none that is a non-negative integer,
/// or has it twice.
///
/// Every event going out is renumbered, so this runs on each: it scans
/// the bytes for the top level's keys, stepping over strings with
/// `memchr` rather than decoding them, as [`sequence_number_read`] does.
/// The data is JSON the guard has read whole (an upstream event) or
/// written; a scan that meets a top-level key written with escapes, or
/// does not end at the object's end, leaves the answer to that reading.
/// The scan stops at the key when the key is nowhere after it (as the
/// APIs write it: once, second) and the data ends as an object does:
/// for JSON, which is all it is given, the rest cannot change the answer.
pub fn sequence_number(data: &str) -> Option<(u64, Range<usize>)> {
    match scan_sequence_number(data.as_bytes()) {
        Scan::Found(found) => found,
        Scan::Unsure => sequence_number_read(data),
    }
}

enum Scan {
    Found(Option<(u64, Range<usize>)>),
    Unsure,
}

/// The key of a Responses API event's number, quoted, and a search for it.
const KEY: &[u8] = b"\"sequence_number\"";
static SEQUENCE_NUMBER_KEY: LazyLock<memmem::Finder<'static>> =
    LazyLock::new(|| memmem::Finder::new(KEY));

fn scan_sequence_number(bytes: &[u8]) -> Scan {
    if bytes.first() != Some(&b'{') {
        return Scan::Unsure;
    }
    let (mut depth, mut key_next, mut found) = (0usize, false, None);
    let mut at = 0;
    while let Some(&byte) = bytes.get(at) {
        match byte {
            b'"' => {
                let Some(end) = string_end(bytes, at + 1) else {
                    return Scan::Unsure;
                };
                if depth == 1 && std::mem::take(&mut key_next) {
                    let key = &bytes[at..end];
                    if key.contains(&b'\\') {
                        return Scan::Unsure;
                    }
                    if key == KEY {
                        if found.is_some() {
                            return Scan::Found(None);
                        }
                        let number = number_after_key(bytes, end);
                        // The APIs write it early, and once: when the key
                        // is nowhere after, the rest need not be scanned.
                        if SEQUENCE_NUMBER_KEY.find(&bytes[end..]).is_none()
                            && bytes.trim_ascii_end().last() == Some(&b'}')
                        {
                            return Scan::Found(number);
                        }
                        found = Some(number);
                    }
                }
                at = end;
                continue;
            }
            b'{' | b'[' => {
                depth += 1;
                key_next = depth == 1;
            }
            b'}' | b']' => {
                let Some(up) = depth.checked_sub(1) else {
                    return Scan::Unsure;
                };
                depth = up;
                if depth == 0 {
                    let rest = &bytes[at + 1..];
                    if !rest.iter().all(u8::is_ascii_whitespace) {
                        return Scan::Unsure;
                    }
                    return Scan::Found(found.flatten());
                }
            }
            b',' => key_next = depth == 1,
            _ => {}
        }
        at += 1;
    }
    Scan::Unsure
}

/// The index just past the string whose contents start at `from`.
fn string_end(bytes: &[u8], mut from: usize) -> Option<usize> {
    loop {
        let at = from + memchr::memchr2(b'"', b'\\', bytes.get(from..)?)?;
        if bytes[at] == b'"' {
            return Some(at + 1);
        }
        from = at + 2;
    }
}

/// The value of a key whose token ends at `key_end`, when it is a
/// non-negative integer, and where its digits lie.
fn number_after_key(bytes: &[u8], key_end: usize) -> Option<(u64, Range<usize>)> {
    let skip = |from: usize| {
        from + bytes[from..]
            .iter()
            .take_while(|b| b.is_ascii_whitespace())
            .count()
    };
    let colon = skip(key_end);
    if bytes.get(colon) != Some(&b':') {
        return None;
    }
    let start = skip(colon + 1);
    let end = start + integer_token(&bytes[start..])?;
    // The value ends with its digits (not `1.5`, `1e2`).
    let after = bytes.get(end).copied().unwrap_or(b' ');
    if !matches!(after, b',' | b'}' | b']') && !after.is_ascii_whitespace() {
        return None;
    }
    let number = std::str::from_utf8(&bytes[start..end]).ok()?.parse().ok()?;
    Some((number, start..end))
}

/// [`sequence_number`] by jiter's full reading of the data.
fn sequence_number_read(data: &str) -> Option<(u64, Range<usize>)> {
    let mut reader = Reader::new(data);
    let mut found = None;
    if !reader.is_object().ok()? {
        return None;
    }
    reader
        .object(["sequence_number"], |reader, _| {
            let span = reader.span()?;
            found = data[span.clone()].parse().ok().map(|n| (n, span));
            Ok(())
        })
        .ok()?;
    found
}

/// A text event as its fixed bytes and the places of its strings that
/// may differ, one of them the text, and of its number, if it has one
/// that differs in every event (the Responses API's `sequence_number`);
/// and its content block.
#[derive(Debug)]
pub struct Shape {
    /// The bytes before and after the text: most often the only string
    /// that differs, and then the quicker test.
    before: String,
    after: String,
    /// The bytes before, between and after the places.
    fixed: Vec<String>,
    /// Which place holds the text.
    text: usize,
    /// Which place holds the number.
    number: Option<usize>,
    pub block: u64,
}

impl Shape {
    /// The shape of `data` with the text at `text`, other strings at
    /// `skipped` (string tokens, in order, none overlapping the text) and
    /// a non-negative integer at `number`.
    pub fn of(
        data: &str,
        text: Range<usize>,
        skipped: &[Range<usize>],
        number: Option<Range<usize>>,
        block: u64,
    ) -> Shape {
        let mut places: Vec<&Range<usize>> = skipped.iter().chain([&text]).collect();
        places.extend(&number);
        places.sort_by_key(|place| place.start);
        let at = |wanted: &Range<usize>| places.iter().position(|place| *place == wanted);
        let mut fixed = Vec::with_capacity(places.len() + 1);
        let mut from = 0;
        for place in &places {
            fixed.push(data[from..place.start].to_owned());
            from = place.end;
        }
        fixed.push(data[from..].to_owned());
        Shape {
            before: data[..text.start].to_owned(),
            after: data[text.end..].to_owned(),
            text: at(&text).unwrap_or_default(),
            number: number.as_ref().and_then(at),
            fixed,
            block,
        }
    }

    /// The text of an event of this shape that carries some, its token
    /// placed in `data`. `None` when the event has another shape (and must
    /// be read in full).
    pub fn text<'a>(&self, data: &'a str) -> Option<Text<'a>> {
        // A string read from `data[at..]`, its token placed in `data`.
        let placed = |mut text: Text<'a>, at: usize| {
            text.token = text.token.start + at..text.token.end + at;
            text
        };
        if let Some(between) = data
            .strip_prefix(self.before.as_str())
            .and_then(|rest| rest.strip_suffix(self.after.as_str()))
        {
            // One string token and nothing else.
            let whole = match plain_string(between) {
                Some(text) => Some(text).filter(|text| text.token.end == between.len()),
                None => {
                    let mut reader = Reader::new(between);
                    let text = reader.string().ok().flatten();
                    text.filter(|_| reader.jiter.finish().is_ok())
                }
            };
            if let Some(text) = whole {
                return Some(placed(text, self.before.len())).filter(|text| !text.value.is_empty());
            }
        }
        let (last, before) = self.fixed.split_last()?;
        let mut rest = data;
        let mut text = None;
        for (place, fixed) in before.iter().enumerate() {
            rest = rest.strip_prefix(fixed.as_str())?;
            if Some(place) == self.number {
                rest = &rest[integer_token(rest.as_bytes())?..];
                continue;
            }
            // Exactly one string token, from the first byte on.
            if !rest.starts_with('"') {
                return None;
            }
            let string = match plain_string(rest) {
                Some(text) => text,
                None => Reader::new(rest).string().ok()??,
            };
            let at = data.len() - rest.len();
            rest = &rest[string.token.end..];
            if place == self.text {
                text = Some(placed(string, at));
            }
        }
        if rest != last {
            return None;
        }
        text.filter(|text| !text.value.is_empty())
    }
}

/// The length of the JSON string token at the start of `text` when it
/// holds no escape, and so is its quotes around its value as it stands
/// (most text and ids); `None` for any other (escapes, control
/// characters, no string), which a [`Reader`] reads. As jiter would read
/// it: a string's characters are any but `"`, `\` and controls.
pub(super) fn plain_token(text: &str) -> Option<usize> {
    let bytes = text.as_bytes();
    if bytes.first() != Some(&b'"') {
        return None;
    }
    for (at, &byte) in bytes.iter().enumerate().skip(1) {
        match byte {
            b'"' => return Some(at + 1),
            b'\\' | 0..0x20 => return None,
            _ => {}
        }
    }
    None
}

/// The JSON string token at the start of `text` when it holds no escape,
/// its value taken as it stands ([`plain_token`]).
/// The length of the digits that `text` starts with, as JSON writes a
/// non-negative integer (no leading zeros). Whether the value ends there
/// is the caller's to see (a shape's fixed bytes follow it; a member's
/// end does).
fn integer_token(text: &[u8]) -> Option<usize> {
    let len = text.iter().take_while(|b| b.is_ascii_digit()).count();
    (len > 0 && !(len > 1 && text[0] == b'0')).then_some(len)
}

fn plain_string(text: &str) -> Option<Text<'_>> {
    let end = plain_token(text)?;
    Some(Text {
        value: Cow::Borrowed(&text[1..end - 1]),
        token: 0..end,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A string token without escapes is read as jiter reads it: the same
    /// end and value; any other is left to jiter.
    #[test]
    fn plain_tokens_read_as_jiter_reads_them() {
        let plain = [
            r#""""#,
            r#""word ""#,
            "\"café 日本 \u{7f}\"",
            r#""a"b"#,
            r#""a", "b""#,
        ];
        for token in plain {
            let end = plain_token(token).unwrap_or_else(|| panic!("{token}"));
            let read = Reader::new(token).string().unwrap().unwrap();
            assert_eq!(read.token, 0..end, "{token}");
            assert_eq!(read.value, &token[1..end - 1], "{token}");
        }
        let others = [
            r#""a\"b""#,
            r#""a\nb""#,
            "\"a\tb\"",
            "\"a\u{1}\"",
            r#""open"#,
            "x",
            "",
        ];
        for token in others {
            assert_eq!(plain_token(token), None, "{token}");
        }
    }

    #[test]
    fn texts_know_their_tokens() {
        let data = r#"{"type":"content_block_delta","index":3,"delta":{"type":"text_delta","text":"a\"b"}}"#;
        let event = Event::read(data).unwrap();
        assert_eq!(event.kind.as_deref(), Some("content_block_delta"));
        assert_eq!(event.index, Some(3));
        assert_eq!(event.delta.kind.as_deref(), Some("text_delta"));
        let text = event.delta.text.unwrap();
        assert_eq!(text.value, "a\"b");
        assert!(matches!(text.value, Cow::Owned(_)));
        assert_eq!(&data[text.token], r#""a\"b""#);
    }

    #[test]
    fn strings_without_escapes_are_borrowed() {
        let event = Event::read(r#"{"choices":[{"delta":{"content":"plain"}}]}"#).unwrap();
        let content = event.choice.delta.content.unwrap();
        assert!(matches!(content.value, Cow::Borrowed("plain")));
    }

    #[test]
    fn a_chunk_of_several_choices_is_told_whatever_its_items() {
        let several = |choices: &str| {
            let data = format!(r#"{{"choices":{choices},"id":"c"}}"#);
            Event::read(&data).unwrap().choice.several
        };
        assert!(several(r#"[{"index":0},{"index":1}]"#));
        assert!(several(r#"[null,{"delta":{"content":"a"}}]"#));
        assert!(several(r#"[[],2,3]"#));
        assert!(!several(r#"[{"delta":{"content":"a"}}]"#));
        assert!(!several("[null]"));
        assert!(!several("[]"));
        assert!(!several("{}"));
    }

    #[test]
    fn usage_is_kept_as_its_json_text() {
        let event = Event::read(r#"{"usage": {"a": [1, 2]} ,"x":1}"#).unwrap();
        assert_eq!(event.usage, Some(r#"{"a": [1, 2]}"#));
        let event = Event::read(r#"{"message":{"usage":{"b":1}},"usage":null}"#).unwrap();
        assert_eq!(event.usage, Some(r#"{"b":1}"#));
        let event = Event::read(r#"{"usage":null}"#).unwrap();
        assert_eq!(event.usage, None);
    }

    #[test]
    fn skipped_parts_must_be_json_too() {
        assert!(Event::read(r#"{"x": [1, tru], "type": "a"}"#).is_err());
        assert!(Event::read(r#"{"choices":[{}, {"a":}]}"#).is_err());
        assert!(Event::read(r#"{"type":"a"} x"#).is_err());
        assert!(Event::read(r#""just a string""#).is_ok());
    }

    #[test]
    fn every_cut_of_an_event_is_malformed_never_a_panic() {
        let data = r#"{"type":"x","index":1,"delta":{"type":"text_delta","text":"caf\u00e9 \"q\""},"choices":[{"delta":{"content":"b"},"text":"c","finish_reason":null},2],"usage":{"n":[1.5e3,true]},"message":{"usage":{}}}"#;
        assert!(Event::read(data).is_ok());
        for cut in 0..data.len() {
            assert!(Event::read(&data[..cut]).is_err(), "{}", &data[..cut]);
        }
    }

    #[test]
    fn sequence_numbers_are_found_at_the_top_level_only() {
        let data = r#"{"type":"x", "sequence_number" :  17 ,"item":{"sequence_number":3}}"#;
        let (number, span) = sequence_number(data).unwrap();
        assert_eq!(number, 17);
        assert_eq!(&data[span], "17");
        for data in [
            r#"{"item":{"sequence_number":3}}"#,
            r#"{"sequence_number":-1}"#,
            r#"{"sequence_number":"4"}"#,
            r#"[{"sequence_number":4}]"#,
            r#"{"sequence_number":4"#,
            r#"{"sequence_number":4,"sequence_number":5}"#,
            r#"{"sequence_number":4.5}"#,
            r#"{"sequence_number":null}"#,
        ] {
            assert_eq!(sequence_number(data), None, "{data}");
        }
    }

    #[test]
    fn the_scan_for_a_sequence_number_reads_as_jiter_does() {
        for data in [
            r#"{"type":"x","sequence_number":17,"item":{"sequence_number":3}}"#,
            r#"{"text":"a \"sequence_number\":9 b","sequence_number":2}"#,
            r#"{"text":"\\","sequence_number":2,"x":"\\\""}"#,
            r#"{"list":[{"sequence_number":1},"]}"],"sequence_number":0}"#,
            r#"{"sequence_number":1,"item":{"a":[1,{"b":"}"}]},"sequence_number":2}"#,
            r#" {"sequence_number":1}"#,
            r#"{"sequence_number":1} "#,
            r#"{"sequence_number":1}}"#,
            r#"{"sequence_number":1}x"#,
            r#"{"sequence\u005fnumber":8}"#,
            r#"{"sequence\u005fnumber":8,"sequence_number":9}"#,
            r#"{"sequence_number":-0}"#,
            r#"{"sequence_number":007}"#,
            r#"{"sequence_number":1e2}"#,
            r#"{"sequence_number" : 12 }"#,
            r#"{"sequence_number":18446744073709551616}"#,
            r#"{"a":"unterminated"#,
            r#"{"a":"ends in a backslash\"#,
            r#"{"sequence_number":1,"a":"cut short"#,
            r#"{"sequence_number":4,"text":"\"sequence_number\":5"}"#,
            r#"{"sequence_number":4,"item":{"sequence_number":3}}"#,
            "{}",
            "",
        ] {
            assert_eq!(sequence_number(data), sequence_number_read(data), "{data}");
        }
        // The scan answers alone for escaped strings that are not keys,
        // and nested values, and steps over them.
        for (data, number) in [
            (
                r#"{"text":"a \"sequence_number\":9 b","sequence_number":2}"#,
                Some(2),
            ),
            (r#"{"text":"\\","sequence_number":2,"x":"\\\""}"#, Some(2)),
            (r#"{"a":{"sequence_number":1,"b":["\"}"]},"c":"}"}"#, None),
        ] {
            let Scan::Found(found) = scan_sequence_number(data.as_bytes()) else {
                panic!("unsure of {data}");
            };
            assert_eq!(found.map(|(n, _)| n), number, "{data}");
        }
        // Nor does it read past the key when the key is nowhere after:
        // a key written with escapes there is not seen.
        let data = br#"{"type":"x","sequence_number":4,"te\u0078t":"a"}"#;
        assert!(matches!(
            scan_sequence_number(data),
            Scan::Found(Some((4, ref span))) if &data[span.clone()] == b"4"
        ));
        // A key written with escapes is left to jiter's reading.
        assert!(matches!(
            scan_sequence_number(br#"{"sequence\u005fnumber":8}"#),
            Scan::Unsure
        ));
        assert_eq!(
            sequence_number(r#"{"sequence\u005fnumber":8}"#).map(|(n, _)| n),
            Some(8)
        );
    }

    #[test]
    fn a_shape_with_a_number_reads_events_that_differ_in_it_too() {
        let event = |number: &str, text: &str| {
            format!(
                r#"{{"type":"response.output_text.delta","sequence_number":{number},"item_id":"msg_1","output_index":0,"content_index":0,"delta":{text},"logprobs":[]}}"#
            )
        };
        let first = event("4", r#""one""#);
        let read = Event::read(&first).unwrap();
        let text = read.delta_text.unwrap().token;
        let number = sequence_number(&first).map(|(_, span)| span);
        let shape = Shape::of(&first, text, &read.skipped, number, 3);
        let text = |data: &str| shape.text(data).map(|text| text.value.into_owned());
        assert_eq!(text(&event("5", r#""two""#)), Some("two".into()));
        assert_eq!(text(&event("0", r#""t\"o""#)), Some("t\"o".into()));
        assert_eq!(text(&event("123456", r#""x""#)), Some("x".into()));
        // A number of another form, or anything else there, is read in full.
        for number in ["07", "-5", "5.0", "5e1", r#""5""#, "null", "", "5 ,\"x\":1"] {
            let data = event(number, r#""two""#);
            assert!(shape.text(&data).is_none(), "{data}");
        }
        assert_eq!(shape.block, 3);
    }

    #[test]
    fn a_shape_reads_events_that_differ_only_in_their_strings() {
        let event = |id: &str, text: &str, pad: &str| {
            format!(
                r#"{{"id":{id},"choices":[{{"delta":{{"content":{text}}},"finish_reason":null}}],"obfuscation":{pad}}}"#
            )
        };
        let first = event(r#""c1""#, r#""one""#, r#""xyz""#);
        let read = Event::read(&first).unwrap();
        assert_eq!(read.skipped.len(), 2);
        let text = read.choice.delta.content.unwrap().token;
        let shape = Shape::of(&first, text, &read.skipped, None, 0);
        // The text and where its token lies in the event.
        let text = |data: &str| {
            shape
                .text(data)
                .map(|text| (text.value.into_owned(), data[text.token].to_owned()))
        };
        let two = event(r#""c1""#, r#""two""#, r#""q""#);
        assert_eq!(text(&two), Some(("two".into(), r#""two""#.into())));
        let escaped = event(r#""c2""#, r#""t\nw""#, r#""""#);
        assert_eq!(text(&escaped), Some(("t\nw".into(), r#""t\nw""#.into())));
        // By the quicker test, when only the text differs, too.
        let three = event(r#""c1""#, r#""three""#, r#""xyz""#);
        assert_eq!(text(&three), Some(("three".into(), r#""three""#.into())));
        // Anything but one string in each place is read in full.
        for (id, text, pad) in [
            (r#""c1""#, r#""""#, r#""x""#),
            (r#""c1""#, "7", r#""x""#),
            (r#""c1""#, r#" "two""#, r#""x""#),
            (r#""c1""#, r#""a","content":"b""#, r#""x""#),
            (r#""c1""#, r#""a"}},{"delta":{"content":"b""#, r#""x""#),
            (r#""c1""#, r#""open"#, r#""x""#),
            ("1", r#""two""#, r#""x""#),
            (r#""c1""#, r#""two""#, "null"),
            (r#""c1""#, r#""two""#, r#""x","choices":[]"#),
        ] {
            let data = event(id, text, pad);
            assert!(shape.text(&data).is_none(), "{data}");
        }
    }
}

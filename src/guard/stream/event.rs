//! What the stream guard reads of an event's data: the few fields that
//! say what the event means and the text it carries, in one pass with
//! jiter's pull parser, which checks the whole event is JSON while it
//! skips what the guard does not read. The rules are those of the bodies
//! ([`crate::json`]): a field of another type than expected reads as
//! absent, and an object the guard reads that holds one of its keys twice
//! makes the event malformed, since two parsers may disagree on which
//! value counts.
//!
//! Most text events of a stream differ from the one before only in their
//! text: the same keys, ids and numbers around one string. A [`Shape`]
//! keeps the bytes around the text of the last text event read in full.
//! An event that starts and ends with the same bytes and holds exactly one
//! JSON string between them is the same event with another text (putting
//! one string token in place of another keeps a JSON text valid and its
//! structure unchanged), so only that string is read.

use std::borrow::Cow;
use std::ops::Range;

use jiter::{Jiter, JiterError, Peek};

/// An event that is not JSON, or that holds a key the guard reads twice
/// in one object.
#[derive(Debug)]
pub struct Malformed;

impl From<JiterError> for Malformed {
    fn from(_: JiterError) -> Self {
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
    /// `delta` when it is an object (Anthropic).
    pub delta: Delta<'a>,
    /// `delta` when it is a string (Responses API).
    pub delta_text: Option<Text<'a>>,
    /// `content_block.type` (Anthropic).
    pub block_kind: Option<Cow<'a, str>>,
    /// The first of `choices` (OpenAI).
    pub choice: Choice<'a>,
    /// The JSON text of `usage`, or else of `message.usage` or
    /// `response.usage`, when it is an object.
    pub usage: Option<&'a str>,
}

/// A delta object: Anthropic's `type` and `text`, OpenAI's `content`.
#[derive(Debug, Default)]
pub struct Delta<'a> {
    pub kind: Option<Cow<'a, str>>,
    pub text: Option<Text<'a>>,
    pub content: Option<Text<'a>>,
}

/// An OpenAI choice.
#[derive(Debug, Default)]
pub struct Choice<'a> {
    pub delta: Delta<'a>,
    /// Legacy completions' `text`.
    pub text: Option<Text<'a>>,
    /// Whether `finish_reason` is there and not `null`.
    pub finished: bool,
}

/// A string of the response's text, and where its JSON token lies in the
/// event's data.
#[derive(Debug)]
pub struct Text<'a> {
    pub value: Cow<'a, str>,
    pub token: Range<usize>,
}

impl<'a> Event<'a> {
    /// Reads an event's data. JSON that is not an object has none of the
    /// fields.
    pub fn read(data: &'a str) -> Result<Event<'a>, Malformed> {
        let mut reader = Reader::new(data);
        let mut event = Event::default();
        if reader.jiter.peek()? == Peek::Object {
            let keys = [
                "type",
                "index",
                "delta",
                "content_block",
                "choices",
                "usage",
                "message",
                "response",
            ];
            let mut inner_usage = None;
            reader.object(keys, |reader, key| {
                match key {
                    0 => event.kind = reader.string()?.map(|s| s.value),
                    1 => event.index = reader.u64()?,
                    2 => match reader.jiter.peek()? {
                        Peek::String => event.delta_text = reader.string()?,
                        Peek::Object => event.delta = Delta::read(reader)?,
                        other => reader.jiter.known_skip(other)?,
                    },
                    3 => {
                        if reader.is_object()? {
                            reader.object(["type"], |reader, _| {
                                event.block_kind = reader.string()?.map(|s| s.value);
                                Ok(())
                            })?;
                        }
                    }
                    4 => event.choice = Choice::first(reader)?,
                    5 => event.usage = reader.object_text()?,
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
        Ok(event)
    }
}

impl<'a> Choice<'a> {
    /// The first item of `choices`, when it is an object; the other items
    /// are only checked to be JSON.
    fn first(reader: &mut Reader<'a>) -> Result<Choice<'a>, Malformed> {
        let mut choice = Choice::default();
        let peek = reader.jiter.peek()?;
        if peek != Peek::Array {
            reader.jiter.known_skip(peek)?;
            return Ok(choice);
        }
        let mut item = reader.jiter.known_array()?;
        if item == Some(Peek::Object) {
            reader.object(["delta", "text", "finish_reason"], |reader, key| {
                match key {
                    0 => {
                        if reader.is_object()? {
                            choice.delta = Delta::read(reader)?;
                        }
                    }
                    1 => choice.text = reader.string()?,
                    _ => choice.finished = reader.not_null()?,
                }
                Ok(())
            })?;
            item = reader.jiter.array_step()?;
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
    fn read(reader: &mut Reader<'a>) -> Result<Delta<'a>, Malformed> {
        let mut delta = Delta::default();
        reader.object(["type", "text", "content"], |reader, key| {
            let string = reader.string()?;
            match key {
                0 => delta.kind = string.map(|s| s.value),
                1 => delta.text = string,
                _ => delta.content = string,
            }
            Ok(())
        })?;
        Ok(delta)
    }
}

/// The bytes around the text of a text event, and its content block.
#[derive(Debug)]
pub struct Shape {
    before: String,
    after: String,
    pub block: u64,
}

impl Shape {
    /// The shape of `data` around the text token `token`.
    pub fn around(data: &str, token: Range<usize>, block: u64) -> Shape {
        Shape {
            before: data[..token.start].to_owned(),
            after: data[token.end..].to_owned(),
            block,
        }
    }

    /// The text of an event of this shape that carries some: the one JSON
    /// string between the shape's bytes. `None` when the event has another
    /// shape (and must be read in full).
    pub fn text<'a>(&self, data: &'a str) -> Option<Cow<'a, str>> {
        let between = data
            .strip_prefix(self.before.as_str())?
            .strip_suffix(self.after.as_str())?;
        let mut reader = Reader::new(between);
        let text = reader.string().ok()??;
        reader.jiter.finish().ok()?;
        Some(text.value).filter(|text| !text.is_empty())
    }
}

/// A jiter pull parser over an event's data, with the reads the guard
/// makes.
struct Reader<'a> {
    data: &'a str,
    jiter: Jiter<'a>,
}

impl<'a> Reader<'a> {
    fn new(data: &'a str) -> Reader<'a> {
        Reader {
            data,
            jiter: Jiter::new(data.as_bytes()),
        }
    }

    /// Reads an object, the reader at its start: `member` reads the value
    /// of each of the `keys` (given its position in them); every other
    /// value is skipped. A key of `keys` twice is malformed.
    fn object<const N: usize>(
        &mut self,
        keys: [&str; N],
        mut member: impl FnMut(&mut Self, usize) -> Result<(), Malformed>,
    ) -> Result<(), Malformed> {
        let position = |key: &str| keys.iter().position(|known| *known == key);
        let mut seen = 0u32;
        let mut key = self.jiter.known_object()?.map(position);
        while let Some(found) = key {
            match found {
                Some(at) if seen & (1 << at) != 0 => return Err(Malformed),
                Some(at) => {
                    seen |= 1 << at;
                    member(self, at)?;
                }
                None => self.jiter.next_skip()?,
            }
            key = self.jiter.next_key()?.map(position);
        }
        Ok(())
    }

    /// The next value if it is a string: borrowed when the data holds it
    /// as it reads (no escapes), owned otherwise.
    fn string(&mut self) -> Result<Option<Text<'a>>, Malformed> {
        let peek = self.jiter.peek()?;
        if peek != Peek::String {
            self.jiter.known_skip(peek)?;
            return Ok(None);
        }
        let start = self.jiter.current_index();
        let decoded = self.jiter.known_str()?;
        // Without escapes the string is its token's bytes.
        let raw = &self.data[start + 1..];
        let value = if raw.starts_with(decoded) {
            Cow::Borrowed(&raw[..decoded.len()])
        } else {
            Cow::Owned(decoded.to_owned())
        };
        let token = start..self.jiter.current_index();
        Ok(Some(Text { value, token }))
    }

    /// The next value if it is a non-negative integer.
    fn u64(&mut self) -> Result<Option<u64>, Malformed> {
        let peek = self.jiter.peek()?;
        if !peek.is_num() {
            self.jiter.known_skip(peek)?;
            return Ok(None);
        }
        let digits = self.jiter.known_number_bytes(peek)?;
        Ok(std::str::from_utf8(digits)
            .ok()
            .and_then(|n| n.parse().ok()))
    }

    /// Whether the next value is an object; any other value is skipped.
    fn is_object(&mut self) -> Result<bool, Malformed> {
        let peek = self.jiter.peek()?;
        if peek == Peek::Object {
            return Ok(true);
        }
        self.jiter.known_skip(peek)?;
        Ok(false)
    }

    /// Skips the next value; whether it was not `null`.
    fn not_null(&mut self) -> Result<bool, Malformed> {
        let peek = self.jiter.peek()?;
        self.jiter.known_skip(peek)?;
        Ok(peek != Peek::Null)
    }

    /// The JSON text of the next value if it is an object.
    fn object_text(&mut self) -> Result<Option<&'a str>, Malformed> {
        let peek = self.jiter.peek()?;
        let start = self.jiter.current_index();
        self.jiter.known_skip(peek)?;
        Ok((peek == Peek::Object).then(|| &self.data[start..self.jiter.current_index()]))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

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
    fn a_shape_reads_only_events_that_differ_in_their_text() {
        let first = r#"{"id":"c1","choices":[{"delta":{"content":"one"},"finish_reason":null}]}"#;
        let token = Event::read(first)
            .unwrap()
            .choice
            .delta
            .content
            .unwrap()
            .token;
        let shape = Shape::around(first, token, 0);
        let same = |text: &str| {
            format!(
                r#"{{"id":"c1","choices":[{{"delta":{{"content":{text}}},"finish_reason":null}}]}}"#
            )
        };
        assert_eq!(shape.text(&same(r#""two""#)).as_deref(), Some("two"));
        assert_eq!(shape.text(&same(r#" "t\nw" "#)).as_deref(), Some("t\nw"));
        // Anything but one string between the same bytes is read in full.
        for other in [
            r#""""#,
            r#"7"#,
            r#""a","content":"b""#,
            r#""a"}},{"delta":{"content":"b""#,
            r#""unterminated"#,
        ] {
            assert_eq!(shape.text(&same(other)), None, "{other}");
        }
        assert_eq!(shape.text(&first.replace("c1", "c2")), None);
    }
}

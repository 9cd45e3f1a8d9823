//! Borrowed, lazy views of the JSON bodies the guard reads: no tree is
//! built for a body. An object is read for the few [`Fields`] the guard
//! knows, each kept as its JSON text ([`Raw`], a slice of the body) and read
//! further only when the guard needs it; every other member is skipped
//! without being copied. Strings without escapes stay borrowed.
//!
//! Bodies are read by jiter's pull parser, which skips a value without
//! building anything: a nested value is skipped once by the level that
//! holds it and read once by the level that needs it.
//!
//! (Stream events, whose every text is needed and which are never
//! rewritten in place, have their own reader: `guard::stream::event`.)
//!
//! Because every value is a slice of the body, a text's place in the body is
//! known ([`span`]), and a redaction rewrites only that string ([`splice`]):
//! the rest of the body goes on byte for byte as the client or upstream
//! wrote it (key order, number formatting, whitespace).
//!
//! Reading is lenient about types (a field of another type than expected is
//! skipped, as an absent one) and strict about ambiguity: an object that the
//! guard reads and that holds one of its keys twice is an error, since two
//! JSON parsers may disagree on which value counts, and the guard must scan
//! the one the upstream (or client) will use.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use jiter::{Jiter, JiterError, Peek};

/// Why a body cannot be read.
#[derive(Debug, thiserror::Error)]
pub enum BodyError {
    #[error("not JSON: {0}")]
    Invalid(String),
    /// An object the guard reads holds one of its keys twice.
    #[error("the key {0:?} is given twice in one object")]
    Ambiguous(String),
}

impl From<JiterError> for BodyError {
    fn from(error: JiterError) -> Self {
        BodyError::Invalid(error.to_string())
    }
}

/// A JSON value as its text, a slice of the body it was read from.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Raw<'a>(&'a str);

impl<'a> Raw<'a> {
    /// `text` if it is one JSON value.
    pub fn parse(text: &'a str) -> Result<Raw<'a>, BodyError> {
        let mut jiter = Jiter::new(text.as_bytes());
        jiter.next_skip()?;
        jiter.finish()?;
        Ok(Raw(text.trim()))
    }

    pub fn get(self) -> &'a str {
        self.0
    }
}

/// A set of members the guard reads of an object: each is a slot for its
/// value, found by its key.
pub trait Members<'a>: Default {
    fn slot(&mut self, key: &str) -> Option<&mut Option<Raw<'a>>>;

    /// Members given as `null` read as absent; they count as given for
    /// the check of keys given twice.
    fn clear_nulls(&mut self);

    /// The members of the object `raw`; none when `raw` is absent or not
    /// an object. An error when the object holds one of the keys twice.
    fn of(raw: Option<Raw<'a>>) -> Result<Self, BodyError> {
        match raw {
            Some(raw) if raw.0.starts_with('{') => {
                let mut jiter = Jiter::new(raw.0.as_bytes());
                jiter.peek()?;
                read_object(&mut jiter, raw.0)
            }
            _ => Ok(Self::default()),
        }
    }
}

/// Reads the object at the parser's place (just peeked) into `M`,
/// skipping the members it does not read.
fn read_object<'a, M: Members<'a>>(jiter: &mut Jiter<'a>, text: &'a str) -> Result<M, BodyError> {
    let mut members = M::default();
    let mut key = jiter.known_object()?;
    while let Some(name) = key {
        let slot = members.slot(name);
        if slot.as_ref().is_some_and(|slot| slot.is_some()) {
            return Err(BodyError::Ambiguous(name.to_owned()));
        }
        let peek = jiter.peek()?;
        let start = jiter.current_index();
        jiter.known_skip(peek)?;
        if let Some(slot) = slot {
            *slot = Some(Raw(&text[start..jiter.current_index()]));
        }
        key = jiter.next_key()?;
    }
    members.clear_nulls();
    Ok(members)
}

/// Declares a set of [`Members`]: a struct with one `Option<Raw>` per
/// member, named as given, read from the key given.
macro_rules! members {
    ($(#[$meta:meta])* $vis:vis struct $name:ident { $($(#[$doc:meta])* $field:ident: $key:literal,)* }) => {
        $(#[$meta])*
        #[derive(Debug, Default, Clone, Copy)]
        $vis struct $name<'a> {
            $($(#[$doc])* pub $field: Option<$crate::json::Raw<'a>>,)*
        }

        impl<'a> $crate::json::Members<'a> for $name<'a> {
            fn slot(&mut self, key: &str) -> Option<&mut Option<$crate::json::Raw<'a>>> {
                match key {
                    $($key => Some(&mut self.$field),)*
                    _ => None,
                }
            }

            fn clear_nulls(&mut self) {
                $(if self.$field.is_some_and(|raw| raw.get() == "null") {
                    self.$field = None;
                })*
            }
        }
    };
}
pub(crate) use members;

members! {
    /// The members the guard reads at any level of a request or response
    /// body, each as its JSON text. A member of value `null` is `None`, as
    /// an absent one. (Stream events have their own, smaller set: the
    /// fewer the fields, the cheaper each event is to read.)
    pub struct Fields {
        // Requests.
        model: "model",
        stream: "stream",
        stream_options: "stream_options",
        include_usage: "include_usage",
        metadata: "metadata",
        messages: "messages",
        role: "role",
        system: "system",
        prompt: "prompt",
        instructions: "instructions",
        input: "input",
        source: "source",
        data: "data",
        // Responses.
        choices: "choices",
        message: "message",
        refusal: "refusal",
        tool_calls: "tool_calls",
        function: "function",
        arguments: "arguments",
        output: "output",
        usage: "usage",
        // Any level.
        kind: "type",
        content: "content",
        text: "text",
    }
}

impl<'a> Fields<'a> {
    /// The fields of a whole body, in one pass; none when it is JSON but not
    /// an object. An error when it is not JSON, or an object with one of the
    /// keys twice.
    pub fn body(body: &'a [u8]) -> Result<Fields<'a>, BodyError> {
        let text = std::str::from_utf8(body).map_err(|e| BodyError::Invalid(e.to_string()))?;
        let mut jiter = Jiter::new(body);
        let fields = match jiter.peek()? {
            Peek::Object => read_object(&mut jiter, text)?,
            other => {
                jiter.known_skip(other)?;
                Fields::default()
            }
        };
        jiter.finish()?;
        Ok(fields)
    }

    /// The fields of each item of an array, in one pass (items that are not
    /// objects have none); no items when `raw` is absent or not an array.
    pub fn objects(raw: Option<Raw<'a>>) -> Result<Vec<Fields<'a>>, BodyError> {
        let mut objects = Vec::new();
        if let Some(raw) = raw.filter(|raw| raw.0.starts_with('[')) {
            let mut jiter = Jiter::new(raw.0.as_bytes());
            jiter.peek()?;
            let mut item = jiter.known_array()?;
            while let Some(peek) = item {
                if peek == Peek::Object {
                    objects.push(read_object(&mut jiter, raw.0)?);
                } else {
                    jiter.known_skip(peek)?;
                    objects.push(Fields::default());
                }
                item = jiter.array_step()?;
            }
        }
        Ok(objects)
    }
}

/// The string at the parser's place (just peeked as one) in `data`:
/// borrowed when the data holds it as it reads (no escapes), owned
/// otherwise; and where its token ends.
pub fn decoded_string<'a>(
    jiter: &mut Jiter<'a>,
    data: &'a str,
) -> Result<(Cow<'a, str>, usize), JiterError> {
    let start = jiter.current_index();
    let decoded = jiter.known_str()?;
    // Without escapes the string is its token's bytes.
    let raw = &data[start + 1..];
    let value = if raw.starts_with(decoded) && raw.as_bytes().get(decoded.len()) == Some(&b'"') {
        Cow::Borrowed(&raw[..decoded.len()])
    } else {
        Cow::Owned(decoded.to_owned())
    };
    Ok((value, jiter.current_index()))
}

/// The string a value holds; `None` when absent or not a string.
pub fn string(raw: Option<Raw<'_>>) -> Option<Cow<'_, str>> {
    let raw = raw?.0;
    if !raw.starts_with('"') {
        return None;
    }
    let mut jiter = Jiter::new(raw.as_bytes());
    jiter.peek().ok()?;
    decoded_string(&mut jiter, raw).ok().map(|(value, _)| value)
}

/// The boolean a value holds; `None` when absent or not a boolean.
pub fn boolean(raw: Option<Raw<'_>>) -> Option<bool> {
    match raw?.0 {
        "true" => Some(true),
        "false" => Some(false),
        _ => None,
    }
}

/// The items of an array; none when `raw` is absent or not an array.
pub fn items(raw: Option<Raw<'_>>) -> Result<Vec<Raw<'_>>, BodyError> {
    let mut items = Vec::new();
    if let Some(raw) = raw.filter(|raw| raw.0.starts_with('[')) {
        let mut jiter = Jiter::new(raw.0.as_bytes());
        jiter.peek()?;
        let mut item = jiter.known_array()?;
        while let Some(peek) = item {
            let start = jiter.current_index();
            jiter.known_skip(peek)?;
            items.push(Raw(&raw.0[start..jiter.current_index()]));
            item = jiter.array_step()?;
        }
    }
    Ok(items)
}

/// Where `raw`, a value read from `body`, lies in it.
pub fn span(body: &[u8], raw: Raw<'_>) -> Range<usize> {
    // Every view is a slice of the body it was read from, so its address
    // is inside the body's.
    let start = (raw.0.as_ptr() as usize).saturating_sub(body.as_ptr() as usize);
    start..start + raw.0.len()
}

/// `body` with each span replaced by its new text, written as a JSON
/// string. Spans are in order and do not overlap.
pub fn splice(body: &[u8], edits: &[(Range<usize>, String)]) -> Bytes {
    let mut out = Vec::with_capacity(body.len() + 64);
    let mut at = 0;
    for (span, text) in edits {
        out.extend_from_slice(&body[at..span.start]);
        out.extend_from_slice(
            serde_json::Value::from(text.as_str())
                .to_string()
                .as_bytes(),
        );
        at = span.end;
    }
    out.extend_from_slice(&body[at..]);
    Bytes::from(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fields_are_borrowed_slices_of_the_body() {
        let body = br#"{"model": "gpt", "skip": {"deep": [1, {"x": "y"}]}, "messages": [{"role": "user", "content": "hi \"you\""}]}"#;
        let top = Fields::body(body).unwrap();
        assert_eq!(string(top.model).as_deref(), Some("gpt"));
        assert!(matches!(string(top.model), Some(Cow::Borrowed("gpt"))));
        let messages = items(top.messages).unwrap();
        assert_eq!(messages.len(), 1);
        let message = Fields::of(Some(messages[0])).unwrap();
        assert_eq!(string(message.role).as_deref(), Some("user"));
        let content = message.content.unwrap();
        assert_eq!(string(Some(content)).as_deref(), Some("hi \"you\""));
        assert_eq!(&body[span(body, content)], br#""hi \"you\"""#);
        // Other types read as absent.
        assert_eq!(string(top.messages), None);
        assert_eq!(boolean(top.model), None);
        assert!(items(top.model).unwrap().is_empty());
        assert!(Fields::of(top.model).unwrap().content.is_none());
        // So do nulls.
        let top = Fields::body(br#"{"model": null, "stream": true}"#).unwrap();
        assert_eq!(top.model, None);
        assert_eq!(boolean(top.stream), Some(true));
    }

    #[test]
    fn objects_reads_each_item_and_gives_others_none() {
        let raw = Raw::parse(r#"[{"role": "user"}, 3, "x", {"text": "t"}, []]"#).unwrap();
        let objects = Fields::objects(Some(raw)).unwrap();
        assert_eq!(objects.len(), 5);
        assert_eq!(string(objects[0].role).as_deref(), Some("user"));
        assert!(objects[1].role.is_none() && objects[2].text.is_none());
        assert_eq!(string(objects[3].text).as_deref(), Some("t"));
        assert!(
            Fields::objects(Some(Raw::parse("{}").unwrap()))
                .unwrap()
                .is_empty()
        );
    }

    #[test]
    fn a_key_given_twice_is_an_error() {
        let body = br#"{"messages": [], "messages": [{"role": "user"}]}"#;
        assert!(matches!(Fields::body(body), Err(BodyError::Ambiguous(key)) if key == "messages"));
        let raw = Raw::parse(r#"{"content": "a", "content": "b"}"#).unwrap();
        assert!(matches!(
            Fields::of(Some(raw)),
            Err(BodyError::Ambiguous(_))
        ));
        // A null counts as given.
        assert!(Fields::body(br#"{"model": null, "model": "a"}"#).is_err());
        // Keys the guard does not read may repeat.
        assert!(Fields::body(br#"{"x": 1, "x": 2}"#).is_ok());
    }

    #[test]
    fn what_is_not_json_is_invalid() {
        for body in [
            &b"{"[..],
            b"{\"a\": tru}",
            b"{\"a\": 1} x",
            b"{\"a\": \"\\q\"}",
            b"[1,]",
            b"\"\xff\"",
            b"",
        ] {
            assert!(
                matches!(Fields::body(body), Err(BodyError::Invalid(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
        assert!(Fields::body(b" [1, {\"a\": 2}] ").is_ok());
    }

    #[test]
    fn splice_rewrites_only_the_spans() {
        let body = br#"{"b": 1.50, "a": "my secret", "c": "keep"}"#;
        members! {
            struct Keys {
                a: "a",
            }
        }
        let keys = Keys::of(Some(
            Raw::parse(std::str::from_utf8(body).unwrap()).unwrap(),
        ))
        .unwrap();
        let edits = [(span(body, keys.a.unwrap()), "my \"[x]\"".to_owned())];
        assert_eq!(
            &splice(body, &edits)[..],
            br#"{"b": 1.50, "a": "my \"[x]\"", "c": "keep"}"#
        );
    }
}

//! Borrowed, one-pass reading of the JSON the guard reads: request and
//! response bodies ([`crate::exchange`]) and stream events
//! (`guard::stream::event`). No tree is built: a [`Reader`], over jiter's
//! pull parser, reads the members the guard needs where they stand and skips
//! every other value without copying it, while still checking that the
//! whole text is JSON. Strings without escapes stay borrowed.
//!
//! A text's place in the body is known (its string token's [`Text::token`]),
//! so a redaction rewrites only that string ([`splice`]): the rest of the
//! body goes on byte for byte as the client or upstream wrote it (key
//! order, number formatting, whitespace).
//!
//! Reading is lenient about types (a member of another type than expected
//! is skipped, as an absent one) and strict about ambiguity: an object the
//! guard reads that holds one of the keys it reads twice is an error, since
//! two JSON parsers may disagree on which value counts, and the guard must
//! scan the one the upstream (or client) will use.

use std::borrow::Cow;
use std::ops::Range;

use bytes::Bytes;
use jiter::{Jiter, JiterError, Peek};

/// Why a JSON text cannot be read.
#[derive(Debug, Clone, thiserror::Error)]
pub enum ReadError {
    #[error("not JSON: {0}")]
    Invalid(String),
    /// An object the guard reads holds one of the keys it reads twice.
    #[error("the key {0:?} is given twice in one object")]
    Ambiguous(String),
}

impl From<JiterError> for ReadError {
    fn from(error: JiterError) -> Self {
        ReadError::Invalid(error.to_string())
    }
}

/// A string read, and where its JSON token lies in the text read.
#[derive(Debug, Clone)]
pub struct Text<'a> {
    pub value: Cow<'a, str>,
    pub token: Range<usize>,
}

/// A pull parser over a JSON text (or a part of one), with the reads the
/// guard makes. Places ([`Text::token`], spans) count from the start of
/// the whole text, also in a reader of a part ([`Reader::part`]).
pub struct Reader<'a> {
    data: &'a str,
    /// Where `data` starts in the whole text.
    base: usize,
    pub jiter: Jiter<'a>,
    /// Where the strings skipped as members of objects read lie, when
    /// noted ([`Reader::noting_skipped`]).
    pub skipped: Option<Vec<Range<usize>>>,
    /// The objects and arrays being read, one in another.
    depth: usize,
}

/// How deep objects and arrays the guard reads may nest. Each level is a
/// call deeper on the stack: a body nested a hundred thousand deep would
/// overflow it and take the whole process down. The bodies of the APIs
/// nest a few levels.
pub const MAX_DEPTH: usize = 64;

impl<'a> Reader<'a> {
    pub fn new(data: &'a str) -> Reader<'a> {
        Reader {
            data,
            base: 0,
            jiter: Jiter::new(data.as_bytes()),
            skipped: None,
            depth: 0,
        }
    }

    /// The reader, noting where the strings it skips as members lie.
    pub fn noting_skipped(mut self) -> Reader<'a> {
        self.skipped = Some(Vec::new());
        self
    }

    /// A reader of bytes that must be UTF-8 to be JSON.
    pub fn bytes(data: &'a [u8]) -> Result<Reader<'a>, ReadError> {
        std::str::from_utf8(data)
            .map(Reader::new)
            .map_err(|e| ReadError::Invalid(e.to_string()))
    }

    /// A reader of `data`, a JSON text that lies at `base` of a whole
    /// text (as [`Reader::array_text`] found it), counting places from the
    /// whole text's start.
    pub fn at_base(data: &'a str, base: usize) -> Reader<'a> {
        Reader {
            base,
            ..Reader::new(data)
        }
    }

    /// A reader of the value at `span` of the whole text read by `self`
    /// (a span an earlier read returned).
    pub fn part(&self, span: Range<usize>) -> Reader<'a> {
        let local = span.start - self.base..span.end - self.base;
        Reader {
            data: &self.data[local.clone()],
            base: span.start,
            jiter: Jiter::new(&self.data.as_bytes()[local]),
            skipped: None,
            depth: self.depth,
        }
    }

    /// Goes one object or array deeper: `read` reads it.
    fn nested(
        &mut self,
        read: impl FnOnce(&mut Self) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        if self.depth == MAX_DEPTH {
            return Err(ReadError::Invalid(format!(
                "objects and arrays nested deeper than {MAX_DEPTH} levels"
            )));
        }
        self.depth += 1;
        let read = read(self);
        self.depth -= 1;
        read
    }

    /// Where the parser is, in the whole text.
    fn at(&self) -> usize {
        self.base + self.jiter.current_index()
    }

    /// Checks that nothing but whitespace follows.
    pub fn finish(&mut self) -> Result<(), ReadError> {
        Ok(self.jiter.finish()?)
    }

    /// Reads an object, the reader at its start: `member` reads the value
    /// of each of the `keys` (given its position in them); every other
    /// value is skipped. A key of `keys` twice is an error.
    pub fn object<const N: usize>(
        &mut self,
        keys: [&str; N],
        member: impl FnMut(&mut Self, usize) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        self.keyed(keys, true, member)
    }

    /// As [`Reader::object`], but a key of `keys` given twice is read both
    /// times, so that no parser reads one unscanned.
    pub fn every_member<const N: usize>(
        &mut self,
        keys: [&str; N],
        member: impl FnMut(&mut Self, usize) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        self.keyed(keys, false, member)
    }

    /// [`Reader::object`] when `once`, else [`Reader::every_member`].
    fn keyed<const N: usize>(
        &mut self,
        keys: [&str; N],
        once: bool,
        mut member: impl FnMut(&mut Self, usize) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        let position = |key: &str| keys.iter().position(|known| *known == key);
        let mut seen = 0u64;
        self.nested(|reader| {
            // jiter's `known_*` reads expect the parser past any whitespace.
            reader.jiter.peek()?;
            let mut key = reader.jiter.known_object()?;
            while let Some(name) = key {
                match position(name) {
                    Some(at) if once && seen & (1 << at) != 0 => {
                        return Err(ReadError::Ambiguous(name.to_owned()));
                    }
                    Some(at) => {
                        seen |= 1 << at;
                        member(reader, at)?;
                    }
                    None => reader.skip_member()?,
                }
                key = reader.jiter.next_key()?;
            }
            Ok(())
        })
    }

    /// Reads an object, the reader at its start, whose member `keys[0]`
    /// decides how its other members of `keys` are read: `decide` reads
    /// that member's value, and `member` each other member (given its
    /// position in `keys`) with the decision, `T::default()` when the
    /// object has no deciding member. Clients write the deciding member
    /// first; members before it are skipped and read again from their
    /// place once the object is read.
    pub fn decided_object<T: Default, const N: usize>(
        &mut self,
        keys: [&str; N],
        mut decide: impl FnMut(&mut Self) -> Result<T, ReadError>,
        mut member: impl FnMut(&mut Self, &T, usize) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        let mut decided = None;
        let mut later = Vec::new();
        self.object(keys, |reader, key| {
            match (key, &decided) {
                (0, _) => decided = Some(decide(reader)?),
                (_, Some(decided)) => member(reader, decided, key)?,
                (_, None) => later.push((key, reader.span()?)),
            }
            Ok(())
        })?;
        let decided = decided.unwrap_or_default();
        for (key, span) in later {
            member(&mut self.part(span), &decided, key)?;
        }
        Ok(())
    }

    /// Reads an object, the reader at its start, whatever its keys:
    /// `member` reads each value.
    pub fn members(
        &mut self,
        mut member: impl FnMut(&mut Self) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        self.nested(|reader| {
            reader.jiter.peek()?;
            let mut key = reader.jiter.known_object()?;
            while key.is_some() {
                member(reader)?;
                key = reader.jiter.next_key()?;
            }
            Ok(())
        })
    }

    /// Reads an array, the reader at its start: `item` reads each item.
    pub fn array(
        &mut self,
        mut item: impl FnMut(&mut Self) -> Result<(), ReadError>,
    ) -> Result<(), ReadError> {
        self.nested(|reader| {
            reader.jiter.peek()?;
            let mut next = reader.jiter.known_array()?;
            while next.is_some() {
                item(reader)?;
                next = reader.jiter.array_step()?;
            }
            Ok(())
        })
    }

    /// Skips a member the guard does not read, noting where it lies when
    /// it is a string and skipped strings are noted.
    fn skip_member(&mut self) -> Result<(), ReadError> {
        let peek = self.jiter.peek()?;
        let start = self.at();
        self.jiter.known_skip(peek)?;
        if peek == Peek::String
            && let Some(skipped) = &mut self.skipped
        {
            skipped.push(start..self.base + self.jiter.current_index());
        }
        Ok(())
    }

    /// Skips the next value.
    pub fn skip(&mut self) -> Result<(), ReadError> {
        self.span().map(drop)
    }

    /// Skips the next value; where it lies.
    pub fn span(&mut self) -> Result<Range<usize>, ReadError> {
        let peek = self.jiter.peek()?;
        let start = self.at();
        self.jiter.known_skip(peek)?;
        Ok(start..self.at())
    }

    /// Whether the next value is of type `kind`; any other value is skipped.
    pub fn is(&mut self, kind: Peek) -> Result<bool, ReadError> {
        let peek = self.jiter.peek()?;
        if peek == kind {
            return Ok(true);
        }
        self.jiter.known_skip(peek)?;
        Ok(false)
    }

    /// Whether the next value is an object; any other value is skipped.
    pub fn is_object(&mut self) -> Result<bool, ReadError> {
        self.is(Peek::Object)
    }

    /// The next value if it is a string: borrowed when the text holds it
    /// as it reads (no escapes), owned otherwise.
    pub fn string(&mut self) -> Result<Option<Text<'a>>, ReadError> {
        if !self.is(Peek::String)? {
            return Ok(None);
        }
        let start = self.jiter.current_index();
        let decoded = self.jiter.known_str()?;
        // Without escapes the string is its token's bytes, up to the
        // closing quote. The quote matters: the value of `"a \\"` is `a \`,
        // which its token also starts with.
        let raw = &self.data[start + 1..];
        let value = if raw.starts_with(decoded) && raw.as_bytes().get(decoded.len()) == Some(&b'"')
        {
            Cow::Borrowed(&raw[..decoded.len()])
        } else {
            Cow::Owned(decoded.to_owned())
        };
        Ok(Some(Text {
            value,
            token: self.base + start..self.at(),
        }))
    }

    /// The next value if it is a boolean.
    pub fn boolean(&mut self) -> Result<Option<bool>, ReadError> {
        let peek = self.jiter.peek()?;
        if peek == Peek::True || peek == Peek::False {
            return Ok(Some(self.jiter.known_bool(peek)?));
        }
        self.jiter.known_skip(peek)?;
        Ok(None)
    }

    /// The next value as an index (of a choice, a content block): a
    /// non-negative integer, or `None` for `null`. Anything else is an
    /// error, not no index: an SDK reads `true` as 1, `1.0` as 1 (a key of
    /// a Python dict), `"1"` as a key of an object in JavaScript, so the
    /// guard, which would have read it as no index, would join the text to
    /// another choice's or block's than the client does.
    pub fn index(&mut self) -> Result<Option<u64>, ReadError> {
        let peek = self.jiter.peek()?;
        if peek == Peek::Null {
            self.jiter.known_skip(peek)?;
            return Ok(None);
        }
        let digits = match peek.is_num() {
            true => self.jiter.known_number_bytes(peek)?,
            false => b"",
        };
        match std::str::from_utf8(digits).ok().map(str::parse) {
            Some(Ok(index)) => Ok(Some(index)),
            _ => Err(ReadError::Invalid(
                "an index that is not a non-negative integer".into(),
            )),
        }
    }

    /// Skips the next value; whether it was not `null`.
    pub fn not_null(&mut self) -> Result<bool, ReadError> {
        let peek = self.jiter.peek()?;
        self.jiter.known_skip(peek)?;
        Ok(peek != Peek::Null)
    }

    /// The JSON text of the next value if it is an array, and where it
    /// lies in the whole text.
    pub fn array_text(&mut self) -> Result<Option<(&'a str, Range<usize>)>, ReadError> {
        self.text_of(Peek::Array)
    }

    /// The JSON text of the next value if it is of type `kind`, and where
    /// it lies in the whole text.
    pub fn text_of(&mut self, kind: Peek) -> Result<Option<(&'a str, Range<usize>)>, ReadError> {
        let peek = self.jiter.peek()?;
        let start = self.jiter.current_index();
        self.jiter.known_skip(peek)?;
        let end = self.jiter.current_index();
        Ok((peek == kind).then(|| (&self.data[start..end], self.base + start..self.base + end)))
    }

    /// The JSON text of the next value if it is an object.
    pub fn object_text(&mut self) -> Result<Option<&'a str>, ReadError> {
        let peek = self.jiter.peek()?;
        let start = self.jiter.current_index();
        self.jiter.known_skip(peek)?;
        Ok((peek == Peek::Object).then(|| &self.data[start..self.jiter.current_index()]))
    }
}

/// `body` with each span replaced by its new text, written as a JSON
/// string. Spans do not overlap; they may come in any order (the texts of
/// a body are listed system prompt first, wherever it stands).
pub fn splice(body: &[u8], edits: &[(Range<usize>, String)]) -> Bytes {
    let mut edits: Vec<&(Range<usize>, String)> = edits.iter().collect();
    edits.sort_by_key(|(span, _)| span.start);
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

    /// A string is borrowed only when its token holds it as it reads:
    /// one that ends in escaped backslashes starts with its value too.
    #[test]
    fn strings_with_escapes_are_owned_wherever_the_escapes_are() {
        let cases = [
            (r#""plain""#, "plain", true),
            (r#""a \\""#, r"a \", false),
            (r#""\\""#, r"\", false),
            (r#""\\\\""#, r"\\", false),
            (r#""a \\b""#, r"a \b", false),
            (r#""\"a""#, r#""a"#, false),
        ];
        for (token, value, borrowed) in cases {
            let text = Reader::new(token).string().unwrap().unwrap();
            assert_eq!(text.value, value, "{token}");
            assert_eq!(matches!(text.value, Cow::Borrowed(_)), borrowed, "{token}");
            assert_eq!(text.token, 0..token.len(), "{token}");
        }
    }

    #[test]
    fn members_are_read_where_they_stand_and_know_their_tokens() {
        let body = r#"{"model": "gpt", "skip": {"deep": [1, {"x": "y"}]}, "messages": [{"role": "user", "content": "hi \"you\""}], "id": "c1"}"#;
        let mut reader = Reader::new(body).noting_skipped();
        let (mut model, mut content) = (None, None);
        assert!(reader.is_object().unwrap());
        reader
            .object(["model", "messages"], |reader, key| {
                if key == 0 {
                    model = reader.string()?;
                    return Ok(());
                }
                reader.array(|reader| {
                    if reader.is_object()? {
                        reader.object(["content"], |reader, _| {
                            content = reader.string()?;
                            Ok(())
                        })?;
                    }
                    Ok(())
                })
            })
            .unwrap();
        reader.finish().unwrap();
        let model = model.unwrap();
        assert!(matches!(model.value, Cow::Borrowed("gpt")));
        let content = content.unwrap();
        assert_eq!(content.value, "hi \"you\"");
        assert_eq!(&body[content.token], r#""hi \"you\"""#);
        // The skipped strings of the objects read, not of those skipped.
        let skipped: Vec<&str> = reader
            .skipped
            .iter()
            .flatten()
            .map(|s| &body[s.clone()])
            .collect();
        assert_eq!(skipped, [r#""user""#, r#""c1""#]);
    }

    #[test]
    fn a_part_reads_with_the_places_of_the_whole() {
        let body = r#"{"a": {"b": "x"}}"#;
        let mut reader = Reader::new(body);
        assert!(reader.is_object().unwrap());
        let mut span = None;
        reader
            .object(["a"], |reader, _| {
                span = Some(reader.span()?);
                Ok(())
            })
            .unwrap();
        let mut part = reader.part(span.unwrap());
        let mut b = None;
        assert!(part.is_object().unwrap());
        part.object(["b"], |reader, _| {
            b = reader.string()?;
            Ok(())
        })
        .unwrap();
        assert_eq!(&body[b.unwrap().token], r#""x""#);
    }

    #[test]
    fn a_deciding_member_applies_wherever_it_stands_and_defaults_when_absent() {
        let read = |body: &str| {
            let mut reader = Reader::new(body);
            let mut read = Vec::new();
            assert!(reader.is_object().unwrap());
            reader
                .decided_object(
                    ["kind", "a", "b"],
                    |reader| Ok(reader.string()?.map(|t| t.value.into_owned())),
                    |reader, kind: &Option<String>, key| {
                        let text = reader.string()?.map(|t| t.value.into_owned());
                        read.push((kind.clone(), key, text, reader.at()));
                        Ok(())
                    },
                )
                .unwrap();
            reader.finish().unwrap();
            read
        };
        // Where a string token ends in `body`, as places in the whole text.
        let end = |body: &str, token: &str| body.find(token).unwrap() + token.len();
        let k = || Some("k".to_owned());
        let body = r#"{"a": "x", "kind": "k", "b": "y"}"#;
        assert_eq!(
            read(body),
            // "b" is read where it stands; "a", before the kind, after the
            // object, from its place.
            [
                (k(), 2, Some("y".into()), end(body, r#""y""#)),
                (k(), 1, Some("x".into()), end(body, r#""x""#))
            ]
        );
        let body = r#"{"a": "x"}"#;
        assert_eq!(
            read(body),
            [(None, 1, Some("x".into()), end(body, r#""x""#))]
        );
    }

    #[test]
    fn other_types_read_as_absent() {
        let mut reader = Reader::new(r#"[1, "s", true, null, {}]"#);
        let mut strings = Vec::new();
        reader
            .array(|reader| {
                strings.push(reader.string()?.map(|t| t.value.into_owned()));
                Ok(())
            })
            .unwrap();
        assert_eq!(strings, [None, Some("s".into()), None, None, None]);
        let mut reader = Reader::new("[true, 1, \"true\"]");
        let mut booleans = Vec::new();
        reader
            .array(|reader| {
                booleans.push(reader.boolean()?);
                Ok(())
            })
            .unwrap();
        assert_eq!(booleans, [Some(true), None, None]);
    }

    #[test]
    fn a_key_read_twice_is_ambiguous_and_others_may_repeat() {
        let read = |body: &str| {
            let mut reader = Reader::new(body);
            reader.is_object()?;
            reader.object(["messages"], |reader, _| reader.skip())?;
            reader.finish()
        };
        assert!(matches!(
            read(r#"{"messages": [], "messages": [{"role": "user"}]}"#),
            Err(ReadError::Ambiguous(key)) if key == "messages"
        ));
        assert!(matches!(
            read(r#"{"messages": null, "messages": 1}"#),
            Err(ReadError::Ambiguous(_))
        ));
        assert!(read(r#"{"x": 1, "x": 2}"#).is_ok());
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
            let read = Reader::bytes(body).and_then(|mut reader| {
                reader.skip()?;
                reader.finish()
            });
            assert!(
                matches!(read, Err(ReadError::Invalid(_))),
                "{}",
                String::from_utf8_lossy(body)
            );
        }
    }

    #[test]
    fn splice_rewrites_only_the_spans() {
        let body = br#"{"b": 1.50, "a": "my secret", "c": "keep"}"#;
        let mut reader = Reader::bytes(body).unwrap();
        let mut a = None;
        reader.is_object().unwrap();
        reader
            .object(["a"], |reader, _| {
                a = reader.string()?;
                Ok(())
            })
            .unwrap();
        let edits = [(a.unwrap().token, "my \"[x]\"".to_owned())];
        assert_eq!(
            &splice(body, &edits)[..],
            br#"{"b": 1.50, "a": "my \"[x]\"", "c": "keep"}"#
        );
        // Edits out of order (a system prompt after the messages).
        let edits = [(35..41, "K".to_owned()), (17..28, "S".to_owned())];
        assert_eq!(
            &splice(body, &edits)[..],
            br#"{"b": 1.50, "a": "S", "c": "K"}"#
        );
    }
}

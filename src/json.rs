//! Borrowed, lazy views of the JSON bodies the guard reads: no tree is
//! built for a body. An object is read for the few [`Fields`] the guard
//! knows, each kept as its JSON text ([`RawValue`], borrowed from the
//! body) and read further only when the guard needs it; every other member
//! is skipped without being copied. Strings without escapes stay borrowed.
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
use std::fmt;
use std::marker::PhantomData;
use std::ops::Range;

use bytes::Bytes;
use serde::Deserialize;
use serde::de::value::MapAccessDeserializer;
use serde::de::{Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// The members the guard reads at any level of a request or response body,
/// each as its JSON text. A member of value `null` is `None`, as an absent
/// one. (Stream events have their own, smaller set: the fewer the fields,
/// the cheaper each event is to read.)
#[derive(Debug, Deserialize, Default)]
#[serde(default)]
pub struct Fields<'a> {
    // Requests.
    #[serde(borrow)]
    pub model: Option<&'a RawValue>,
    #[serde(borrow)]
    pub stream: Option<&'a RawValue>,
    #[serde(borrow)]
    pub stream_options: Option<&'a RawValue>,
    #[serde(borrow)]
    pub include_usage: Option<&'a RawValue>,
    #[serde(borrow)]
    pub metadata: Option<&'a RawValue>,
    #[serde(borrow)]
    pub messages: Option<&'a RawValue>,
    #[serde(borrow)]
    pub role: Option<&'a RawValue>,
    #[serde(borrow)]
    pub system: Option<&'a RawValue>,
    #[serde(borrow)]
    pub prompt: Option<&'a RawValue>,
    #[serde(borrow)]
    pub instructions: Option<&'a RawValue>,
    #[serde(borrow)]
    pub input: Option<&'a RawValue>,
    #[serde(borrow)]
    pub source: Option<&'a RawValue>,
    #[serde(borrow)]
    pub data: Option<&'a RawValue>,
    // Responses.
    #[serde(borrow)]
    pub choices: Option<&'a RawValue>,
    #[serde(borrow)]
    pub message: Option<&'a RawValue>,
    #[serde(borrow)]
    pub refusal: Option<&'a RawValue>,
    #[serde(borrow)]
    pub tool_calls: Option<&'a RawValue>,
    #[serde(borrow)]
    pub function: Option<&'a RawValue>,
    #[serde(borrow)]
    pub arguments: Option<&'a RawValue>,
    #[serde(borrow)]
    pub output: Option<&'a RawValue>,
    #[serde(borrow)]
    pub usage: Option<&'a RawValue>,
    // Any level.
    #[serde(rename = "type", borrow)]
    pub kind: Option<&'a RawValue>,
    #[serde(borrow)]
    pub content: Option<&'a RawValue>,
    #[serde(borrow)]
    pub text: Option<&'a RawValue>,
}

impl<'a> Fields<'a> {
    /// The fields of a whole body, in one pass; none when it is JSON but not
    /// an object. An error when it is not JSON, or an object with one of the
    /// keys twice.
    pub fn body(body: &'a [u8]) -> Result<Fields<'a>, serde_json::Error> {
        serde_json::from_slice::<Object<Fields>>(body).map(|o| o.0)
    }

    /// The fields of an object; none when `raw` is absent or not an object.
    /// An object with one of the keys twice is an error.
    pub fn of(raw: Option<&'a RawValue>) -> Result<Fields<'a>, serde_json::Error> {
        match raw {
            Some(raw) if raw.get().starts_with('{') => serde_json::from_str(raw.get()),
            _ => Ok(Fields::default()),
        }
    }

    /// The fields of each item of an array, in one pass (items that are not
    /// objects have none); no items when `raw` is absent or not an array.
    pub fn objects(raw: Option<&'a RawValue>) -> Result<Vec<Fields<'a>>, serde_json::Error> {
        match raw {
            Some(raw) if raw.get().starts_with('[') => {
                let items: Vec<Object<Fields>> = serde_json::from_str(raw.get())?;
                Ok(items.into_iter().map(|o| o.0).collect())
            }
            _ => Ok(Vec::new()),
        }
    }
}

/// Read from any JSON value: the fields `T` of an object, the default for
/// anything else.
struct Object<T>(T);

impl<'de, T: Deserialize<'de> + Default> Deserialize<'de> for Object<T> {
    fn deserialize<D: Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        deserializer.deserialize_any(ObjectVisitor(PhantomData))
    }
}

struct ObjectVisitor<T>(PhantomData<T>);

impl<'de, T: Deserialize<'de> + Default> Visitor<'de> for ObjectVisitor<T> {
    type Value = Object<T>;

    fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
        f.write_str("any JSON value")
    }

    fn visit_map<A: MapAccess<'de>>(self, map: A) -> Result<Object<T>, A::Error> {
        T::deserialize(MapAccessDeserializer::new(map)).map(Object)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Object<T>, A::Error> {
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(Object(T::default()))
    }

    fn visit_bool<E>(self, _: bool) -> Result<Object<T>, E> {
        Ok(Object(T::default()))
    }

    fn visit_i64<E>(self, _: i64) -> Result<Object<T>, E> {
        Ok(Object(T::default()))
    }

    fn visit_u64<E>(self, _: u64) -> Result<Object<T>, E> {
        Ok(Object(T::default()))
    }

    fn visit_f64<E>(self, _: f64) -> Result<Object<T>, E> {
        Ok(Object(T::default()))
    }

    fn visit_str<E>(self, _: &str) -> Result<Object<T>, E> {
        Ok(Object(T::default()))
    }

    fn visit_unit<E>(self) -> Result<Object<T>, E> {
        Ok(Object(T::default()))
    }
}

/// A JSON string, borrowed unless it has escapes.
#[derive(Deserialize)]
struct JsonStr<'a>(#[serde(borrow)] Cow<'a, str>);

/// The string a value holds; `None` when absent or not a string.
pub fn string(raw: Option<&RawValue>) -> Option<Cow<'_, str>> {
    serde_json::from_str::<JsonStr>(raw?.get())
        .ok()
        .map(|s| s.0)
}

/// The boolean a value holds; `None` when absent or not a boolean.
pub fn boolean(raw: Option<&RawValue>) -> Option<bool> {
    serde_json::from_str(raw?.get()).ok()
}

/// The items of an array; none when `raw` is absent or not an array.
pub fn items(raw: Option<&RawValue>) -> Result<Vec<&RawValue>, serde_json::Error> {
    match raw {
        Some(raw) if raw.get().starts_with('[') => serde_json::from_str(raw.get()),
        _ => Ok(Vec::new()),
    }
}

/// Where `raw`, a value read from `body`, lies in it.
pub fn span(body: &[u8], raw: &RawValue) -> Range<usize> {
    // Every view is a slice of the body it was read from, so its address
    // is inside the body's.
    let start = (raw.get().as_ptr() as usize).saturating_sub(body.as_ptr() as usize);
    start..start + raw.get().len()
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
        let top: Fields = serde_json::from_slice(body).unwrap();
        assert_eq!(string(top.model).as_deref(), Some("gpt"));
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
    }

    #[test]
    fn a_key_given_twice_is_an_error() {
        let body = r#"{"messages": [], "messages": [{"role": "user"}]}"#;
        assert!(serde_json::from_str::<Fields>(body).is_err());
        let raw: &RawValue = serde_json::from_str(r#"{"content": "a", "content": "b"}"#).unwrap();
        assert!(Fields::of(Some(raw)).is_err());
        // Keys the guard does not read may repeat.
        assert!(serde_json::from_str::<Fields>(r#"{"x": 1, "x": 2}"#).is_ok());
    }

    #[test]
    fn splice_rewrites_only_the_spans() {
        let body = br#"{"b": 1.50, "a": "my secret", "c": "keep"}"#;
        let top: &RawValue = serde_json::from_slice(body).unwrap();
        let members: std::collections::BTreeMap<&str, &RawValue> =
            serde_json::from_str(top.get()).unwrap();
        let edits = [(span(body, members["a"]), "my \"[x]\"".to_owned())];
        assert_eq!(
            &splice(body, &edits)[..],
            br#"{"b": 1.50, "a": "my \"[x]\"", "c": "keep"}"#
        );
    }
}

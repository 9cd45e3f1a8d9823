//! A guarded session driven without its sockets: each side's messages
//! go in as the relay hands them on, and what fairgate sends each side
//! comes back in order. The fuzz target `sessions` drives it: the session
//! code, not the sockets, is what reads what either side may send.

use std::sync::Arc;

use bytes::Bytes;
use tokio_tungstenite::tungstenite::Message;

use super::realtime::{self, Relay, Send};
use super::{State, responses_socket};
use crate::config::StreamMode;
use crate::record::{ClientMeta, StreamEnd};

/// The kind of session.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    /// A Realtime API session.
    Realtime,
    /// A Responses API socket.
    ResponsesSocket,
}

/// A message fairgate sends: to the client or the upstream, and its text
/// (`None` for a close).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sent {
    pub to_client: bool,
    pub text: Option<String>,
}

/// A session of one kind, on `state`'s rules and limits.
pub struct Replay {
    session: Box<dyn Relay>,
}

impl Replay {
    /// A session of `kind`, guarded in `mode`.
    pub fn new(state: Arc<State>, kind: Kind, mode: StreamMode) -> Replay {
        let (request_id, upstream) = ("fg-replay".to_owned(), "openai".to_owned());
        let client = ClientMeta::default();
        let session: Box<dyn Relay> = match kind {
            Kind::Realtime => realtime::unsocketed(
                state,
                realtime::Handshake {
                    request_id,
                    upstream,
                    model: None,
                    client,
                    monitor: mode == StreamMode::Monitor,
                },
            ),
            Kind::ResponsesSocket => responses_socket::unsocketed(
                state,
                responses_socket::Handshake {
                    request_id,
                    upstream,
                    client,
                    mode,
                },
            ),
        };
        Replay { session }
    }

    /// What fairgate sends for a message from the client, text or binary.
    pub fn from_client(&mut self, message: &[u8]) -> Vec<Sent> {
        let text = realtime::as_text(Bytes::copy_from_slice(message));
        sent(self.session.client_event(text))
    }

    /// What fairgate sends for a message from the upstream.
    pub fn from_upstream(&mut self, message: &[u8]) -> Vec<Sent> {
        let text = realtime::as_text(Bytes::copy_from_slice(message));
        sent(self.session.upstream_event(text))
    }

    /// The session ends as `end` tells; dropped, it records what is open.
    pub fn end(mut self, end: StreamEnd) {
        self.session.ending(end);
    }
}

fn sent(sends: Vec<Send>) -> Vec<Sent> {
    let text = |message: Message| match message {
        Message::Text(text) => Some(text.as_str().to_owned()),
        Message::Binary(bytes) => Some(String::from_utf8_lossy(&bytes).into_owned()),
        _ => None,
    };
    sends
        .into_iter()
        .map(|send| match send {
            Send::Client(message) => Sent {
                to_client: true,
                text: text(message),
            },
            Send::Upstream(message) => Sent {
                to_client: false,
                text: text(message),
            },
        })
        .collect()
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]

    use serde_json::{Value, json};

    use super::*;
    use crate::config::Config;

    fn events(sent: &[Sent], to_client: bool) -> Vec<Value> {
        (sent.iter())
            .filter(|s| s.to_client == to_client)
            .filter_map(|s| serde_json::from_str(s.text.as_deref()?).ok())
            .collect()
    }

    /// A Realtime answer blocked midway, driven through a replay: the
    /// client gets the clean text before the phrase and the filtered end,
    /// the upstream the deletion of the item.
    #[tokio::test]
    async fn a_replayed_realtime_answer_is_guarded() {
        let state = Arc::new(State::new(Config::default()).unwrap());
        let mut replay = Replay::new(state, Kind::Realtime, StreamMode::Holdback);
        let at = |mut event: Value| {
            let place = json!({"response_id": "r", "item_id": "i", "output_index": 0,
                "content_index": 0});
            (event.as_object_mut().unwrap()).extend(place.as_object().unwrap().clone());
            event
        };
        let mut upstream = vec![
            json!({"type": "response.created", "response": {"id": "r", "output": []}}),
            json!({"type": "response.output_item.added", "response_id": "r",
                "item": {"id": "i", "type": "message", "content": []}}),
            at(
                json!({"type": "response.content_part.added", "part": {"type": "text", "text": ""}}),
            ),
        ];
        let said = "Start with a budget, then build an emergency fund. Or put all your savings into Dogecoin.";
        for word in said.split_inclusive(' ') {
            upstream.push(at(
                json!({"type": "response.output_text.delta", "delta": word}),
            ));
        }
        upstream.push(json!({"type": "response.done", "response": {"id": "r",
            "status": "completed", "output": []}}));
        let mut sent =
            replay.from_client(json!({"type": "response.create"}).to_string().as_bytes());
        for event in &upstream {
            sent.extend(replay.from_upstream(event.to_string().as_bytes()));
        }
        let client = events(&sent, true);
        let text: String = (client.iter())
            .filter_map(|e| e.get("delta").and_then(Value::as_str))
            .collect();
        assert!(
            said.starts_with(&text) && !text.contains("savings"),
            "{text:?}"
        );
        let done = client.last().unwrap();
        assert_eq!(
            done["response"]["status_details"]["reason"],
            "content_filter"
        );
        let upstream = events(&sent, false);
        let types: Vec<&str> = upstream.iter().filter_map(|e| e["type"].as_str()).collect();
        assert_eq!(types, ["response.create", "conversation.item.delete"]);
        replay.end(StreamEnd::ClientClosed);
    }

    /// A Responses API socket's blocked answer ends, for the client, as
    /// the stream guard ends it.
    #[tokio::test]
    async fn a_replayed_responses_socket_answer_is_guarded() {
        let state = Arc::new(State::new(Config::default()).unwrap());
        let mut replay = Replay::new(state, Kind::ResponsesSocket, StreamMode::Holdback);
        let ask = json!({"type": "response.create", "model": "m", "input": "Hello"});
        let mut sent = replay.from_client(ask.to_string().as_bytes());
        let upstream = [
            json!({"type": "response.created", "response": {"id": "r", "output": []}}),
            json!({"type": "response.output_text.delta", "item_id": "i", "output_index": 0,
                "content_index": 0, "delta": "Put all your savings "}),
            json!({"type": "response.output_text.delta", "item_id": "i", "output_index": 0,
                "content_index": 0, "delta": "into Dogecoin."}),
        ];
        for event in &upstream {
            sent.extend(replay.from_upstream(event.to_string().as_bytes()));
        }
        let client = events(&sent, true);
        assert!(
            client.iter().all(|e| !e.to_string().contains("Dogecoin")),
            "{client:?}"
        );
        assert_eq!(
            client.last().unwrap()["type"],
            "response.incomplete",
            "{client:?}"
        );
        replay.end(StreamEnd::ClientClosed);
    }
}

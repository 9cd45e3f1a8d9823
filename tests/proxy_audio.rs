//! Audio answers (OpenAI chat completions with audio output) through the
//! proxy over real sockets: the transcript is the answer's text, and the
//! audio that speaks it goes only where the transcript may.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use fairgate::config::StreamMode;
use serde_json::{Value, json};
use support::start;

const HARMFUL: &str = "Sure! Put all your savings into Dogecoin right now.";
const HARMLESS: &str = "Start with a budget.";
const CARD: &str = "Your card 4111 1111 1111 1111 is on file.";
/// The audio's pieces, base64 that no rule reads.
const SOUND: [&str; 3] = ["UklGRgAB", "V0FWRWZt", "ZGF0YQAA"];

fn request(stream: bool) -> Value {
    json!({"model": "gpt-4o-audio-preview", "modalities": ["text", "audio"],
        "audio": {"voice": "alloy", "format": "wav"}, "stream": stream,
        "messages": [{"role": "user", "content": "Any tips?"}]})
}

/// A whole answer whose audio says `transcript`.
fn spoken(transcript: &str) -> Value {
    json!({"id": "chatcmpl-1", "object": "chat.completion", "created": 1, "model": "m",
        "choices": [{"index": 0, "finish_reason": "stop", "message": {"role": "assistant",
            "content": null, "refusal": null, "audio": {"id": "audio_1", "data": SOUND.concat(),
            "expires_at": 1, "transcript": transcript}}}],
        "usage": {"prompt_tokens": 3, "completion_tokens": 9, "total_tokens": 12}})
}

/// A stream whose audio says `transcript`: its words and the audio's
/// pieces in chunks of their own, interleaved, as OpenAI sends them.
fn spoken_stream(transcript: &str) -> String {
    let chunk = |delta: Value, finish: Value| {
        let chunk = json!({"id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 1,
            "model": "m", "choices": [{"index": 0, "delta": delta, "finish_reason": finish}]});
        format!("data: {chunk}\n\n")
    };
    let mut body = chunk(
        json!({"role": "assistant", "content": null, "refusal": null,
            "audio": {"id": "audio_1", "transcript": ""}}),
        Value::Null,
    );
    let words: Vec<&str> = transcript.split_inclusive(' ').collect();
    for (i, word) in words.iter().enumerate() {
        body += &chunk(json!({"audio": {"transcript": word}}), Value::Null);
        if let Some(sound) = SOUND.get(i) {
            body += &chunk(json!({"audio": {"data": sound}}), Value::Null);
        }
    }
    body += &chunk(json!({"audio": {"expires_at": 1}}), Value::Null);
    body += &chunk(json!({}), json!("stop"));
    body + "data: [DONE]\n\n"
}

#[tokio::test]
async fn an_answer_whose_audio_a_rule_blocks_is_refused_audio_and_all() {
    let (_mock, proxy) = start().await;
    for (transcript, verdict) in [(HARMFUL, "block"), (CARD, "block"), (HARMLESS, "allow")] {
        let answer = spoken(transcript);
        let script = json!({"raw_json": answer.to_string()});
        let response = proxy
            .post("/v1/chat/completions", script, &request(false))
            .await;
        assert_eq!(response.status(), 200);
        assert_eq!(
            response.headers()["x-fairgate-verdict"],
            verdict,
            "{transcript}"
        );
        let body = response.text().await.unwrap();
        if verdict == "allow" {
            assert_eq!(body, answer.to_string(), "relayed byte for byte");
            continue;
        }
        // A card number in the transcript cannot be redacted in the audio
        // that says it: the answer is refused.
        for said in ["Dogecoin", "4111", SOUND[0]] {
            assert!(!body.contains(said), "{transcript}: {body}");
        }
        let body: Value = serde_json::from_str(&body).unwrap();
        assert_eq!(body["choices"][0]["finish_reason"], "content_filter");
        assert!(body["choices"][0]["message"]["refusal"].is_string());
    }
    proxy.stop().await;
}

#[tokio::test]
async fn a_stream_sends_no_audio_of_a_blocked_transcript() {
    let (_mock, holding_back) = start().await;
    let mock = support::start_mock().await;
    let mut config = support::config(&mock.url(), std::path::Path::new("rules"));
    config.guard.stream_mode = StreamMode::Buffer;
    let buffering = support::start_proxy(config).await;
    for proxy in [&holding_back, &buffering] {
        for transcript in [HARMFUL, CARD] {
            let script = json!({"raw_sse": spoken_stream(transcript)});
            let response = proxy
                .post("/v1/chat/completions", script, &request(true))
                .await;
            assert_eq!(response.status(), 200);
            let body = response.text().await.unwrap();
            for said in ["Dogecoin", "4111", SOUND[0], SOUND[1], SOUND[2]] {
                assert!(!body.contains(said), "{transcript}: {body}");
            }
            let (_, finishes, done) = support::openai_stream_text(&body);
            assert_eq!(finishes, ["content_filter"], "{body}");
            assert!(done, "{body}");
        }
        // An allowed one arrives as it was sent.
        let sent = spoken_stream(HARMLESS);
        let script = json!({"raw_sse": sent});
        let response = proxy
            .post("/v1/chat/completions", script, &request(true))
            .await;
        assert_eq!(response.text().await.unwrap(), sent);
    }
    holding_back.stop().await;
    buffering.stop().await;
}

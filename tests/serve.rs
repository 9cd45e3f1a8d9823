//! `fairgate serve` as a process: flags, SIGHUP reload, SIGTERM shutdown.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::process::{Command, Stdio};
use std::time::Duration;

use serde_json::json;

fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

async fn status(url: &str, content: &str) -> Option<u16> {
    support::client()
        .post(url)
        .json(&json!({"model": "m", "messages": [{"role": "user", "content": content}]}))
        .send()
        .await
        .ok()
        .map(|r| r.status().as_u16())
}

#[cfg(unix)]
#[tokio::test]
async fn serve_reloads_on_sighup_and_stops_on_sigterm() {
    let dir = tempfile::tempdir().unwrap();
    std::fs::write(
        dir.path().join("custom.yaml"),
        support::keyword_pack("pineapple"),
    )
    .unwrap();
    let mock = support::start_mock().await;
    let (port, admin) = (free_port(), free_port());
    // No file watcher: only the SIGHUP can reload.
    let config_dir = tempfile::tempdir().unwrap();
    let config = config_dir.path().join("fairgate.yaml");
    std::fs::write(&config, "rules:\n  watch: false\nshutdown_grace_ms: 500\n").unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fairgate"))
        .args([
            "serve",
            "--listen",
            &format!("127.0.0.1:{port}"),
            "--admin-listen",
            &format!("127.0.0.1:{admin}"),
        ])
        .args([
            "--rules",
            dir.path().to_str().unwrap(),
            "--upstream-openai",
            &mock.url(),
            "--threads",
            "2",
        ])
        .env("FAIRGATE_CONFIG", &config)
        // Results go to ./data on the embedded defaults.
        .current_dir(config_dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    let mut up = false;
    for _ in 0..300 {
        if status(&url, "hello").await == Some(200) {
            up = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(up, "fairgate serve did not come up");
    assert_eq!(status(&url, "I like pineapple").await, Some(400));

    std::fs::write(
        dir.path().join("custom.yaml"),
        support::keyword_pack("mango"),
    )
    .unwrap();
    Command::new("kill")
        .args(["-HUP", &child.id().to_string()])
        .status()
        .unwrap();
    let mut blocked = false;
    for _ in 0..100 {
        if status(&url, "I like mango").await == Some(400) {
            blocked = true;
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    assert!(blocked, "the edited rules were not loaded on SIGHUP");
    let rules: serde_json::Value = support::client()
        .get(format!("http://127.0.0.1:{admin}/admin/rules"))
        .send()
        .await
        .unwrap()
        .json()
        .await
        .unwrap();
    assert!(rules["reload"]["reloads"].as_u64().unwrap() >= 1, "{rules}");

    // An exchange whose upstream answers long after the shutdown's grace:
    // the shutdown cuts it off, and it is recorded all the same.
    let asked = mock.requests().len();
    let slow = tokio::spawn(
        support::client()
            .post(&url)
            .header(
                "x-mock-reply",
                json!({"text": "Too late.", "delay_ms": 30_000}).to_string(),
            )
            .json(&json!({"model": "m", "messages": [{"role": "user", "content": "a slow question"}]}))
            .send(),
    );
    while mock.requests().len() == asked {
        tokio::time::sleep(Duration::from_millis(20)).await;
    }

    Command::new("kill")
        .args(["-TERM", &child.id().to_string()])
        .status()
        .unwrap();
    let mut exited = None;
    for _ in 0..100 {
        if let Some(code) = child.try_wait().unwrap() {
            exited = Some(code);
            break;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let code = exited.unwrap_or_else(|| {
        let _ = child.kill();
        panic!("fairgate did not stop on SIGTERM")
    });
    assert!(code.success(), "{code:?}");

    // The exchanges' records were flushed and stored before the exit.
    let results = config_dir.path().join("data/results");
    let mut rows = Vec::new();
    for entry in std::fs::read_dir(&results).unwrap().flatten() {
        let text = std::fs::read_to_string(entry.path()).unwrap();
        rows.extend(
            text.lines()
                .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()),
        );
    }
    let blocked_prompt = |word: &str| {
        rows.iter().any(|r| {
            r["exchange"]["verdict"] == "block"
                && r["exchange"]["texts"]["prompt"].to_string().contains(word)
        })
    };
    assert!(
        blocked_prompt("pineapple") && blocked_prompt("mango"),
        "{rows:#?}"
    );
    let cut = rows
        .iter()
        .find(|r| r["exchange"]["texts"]["prompt"][0] == "a slow question")
        .unwrap_or_else(|| panic!("no record of the exchange cut off: {rows:#?}"));
    assert_eq!(cut["exchange"]["status"], 499, "{cut:#}");
    assert!(
        slow.await.unwrap().is_err(),
        "the cut exchange got no answer"
    );
}

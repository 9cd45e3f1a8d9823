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

/// Waits until `fairgate serve` answers a chat completion at `url`.
async fn wait_until_serving(url: &str) {
    for _ in 0..300 {
        if status(url, "hello").await == Some(200) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("fairgate serve did not come up");
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
    wait_until_serving(&url).await;
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

/// The CPU time `pid` has used, in clock ticks (user and system).
fn cpu_ticks(pid: u32) -> u64 {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap();
    // The fields after the command's name, which is in parentheses.
    let fields: Vec<&str> = stat
        .rsplit_once(')')
        .unwrap()
        .1
        .split_whitespace()
        .collect();
    fields[11].parse::<u64>().unwrap() + fields[12].parse::<u64>().unwrap()
}

/// Sets the soft limit of `pid`'s open files.
fn limit_files(pid: u32, soft: usize) {
    let set = Command::new("prlimit")
        .args(["--pid", &pid.to_string(), &format!("--nofile={soft}:")])
        .status()
        .unwrap();
    assert!(set.success());
}

/// A proxy out of file descriptors does not spin on the connections it
/// cannot accept: it pauses, and accepts them once descriptors are free.
#[cfg(target_os = "linux")]
#[tokio::test]
async fn serve_out_of_file_descriptors_waits_instead_of_spinning() {
    let mock = support::start_mock().await;
    let (port, admin) = (free_port(), free_port());
    let dir = tempfile::tempdir().unwrap();
    let mut child = Command::new(env!("CARGO_BIN_EXE_fairgate"))
        .args(["serve", "--listen", &format!("127.0.0.1:{port}")])
        .args(["--admin-listen", &format!("127.0.0.1:{admin}")])
        .args(["--upstream-openai", &mock.url(), "--threads", "1"])
        .args(["--rules", &format!("{}/rules", env!("CARGO_MANIFEST_DIR"))])
        .current_dir(dir.path())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = child.id();
    let url = format!("http://127.0.0.1:{port}/v1/chat/completions");
    wait_until_serving(&url).await;

    let open = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .unwrap()
        .count();
    limit_files(pid, open + 2);
    // More connections than it can take: the rest wait in the backlog.
    let mut held = Vec::new();
    for _ in 0..20 {
        held.push(
            tokio::net::TcpStream::connect(("127.0.0.1", port))
                .await
                .unwrap(),
        );
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let before = cpu_ticks(pid);
    tokio::time::sleep(Duration::from_secs(1)).await;
    let spent = cpu_ticks(pid) - before;
    // Spinning on accept takes a whole core: some 100 ticks a second.
    assert!(
        spent < 30,
        "{spent} ticks of CPU in a second while out of descriptors"
    );

    limit_files(pid, open + 1000);
    drop(held);
    let mut served = None;
    for _ in 0..50 {
        served = status(&url, "hello").await;
        if served == Some(200) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert_eq!(served, Some(200), "accepting did not resume");
    child.kill().unwrap();
    child.wait().unwrap();
}

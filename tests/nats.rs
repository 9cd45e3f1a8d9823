//! The NATS JetStream queue with real servers: `fairgate worker` processes
//! sharing a durable consumer, one killed mid-stream, and a NATS server
//! restarted while the proxy serves. Every exchange is stored exactly once
//! (PostgreSQL on 127.0.0.1:5432 is the store that proves it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod support;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::Duration;

use fairgate::config::{Config, NatsConfig, PostgresSinkConfig, QueueKind};
use serde_json::Value;

/// The queue and sink settings shared by the proxy and its workers.
fn queue_config(config: &mut Config, nats_url: &str, db: &str) {
    config.queue.kind = QueueKind::Nats;
    config.queue.replay_interval_ms = 100;
    config.queue.nats = NatsConfig {
        url: nats_url.to_owned(),
        stream: support::unique("FGTEST"),
        subject: support::unique("fgtest.records").replace('_', "."),
        consumer: "workers".into(),
        max_age_secs: 3600,
        ack_wait_ms: 1500,
    };
    config.sinks.jsonl = None;
    config.sinks.postgres = Some(PostgresSinkConfig { url: db.to_owned() });
}

/// Starts `fairgate worker` with `config`, logging to a file in `dir`.
fn start_worker(config: &Config, dir: &Path, name: &str) -> Child {
    start_worker_with(config, dir, name, &[])
}

fn start_worker_with(config: &Config, dir: &Path, name: &str, args: &[&str]) -> Child {
    let path = dir.join(format!("{name}.yaml"));
    std::fs::write(&path, serde_yaml_ng::to_string(config).unwrap()).unwrap();
    let log = std::fs::File::create(dir.join(format!("{name}.log"))).unwrap();
    Command::new(env!("CARGO_BIN_EXE_fairgate"))
        .arg("worker")
        .args(args)
        .env("FAIRGATE_CONFIG", &path)
        .env("RUST_LOG", "info,fairgate=debug")
        .current_dir(dir)
        .stdout(log.try_clone().unwrap())
        .stderr(log)
        .spawn()
        .unwrap()
}

async fn wait_for_log(dir: &Path, name: &str, line: &str) {
    for _ in 0..300 {
        let log = std::fs::read_to_string(dir.join(format!("{name}.log"))).unwrap_or_default();
        if log.contains(line) {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("{name} never logged {line:?}: {}", logs(dir));
}

fn logs(dir: &Path) -> String {
    let mut out = String::new();
    for entry in std::fs::read_dir(dir).unwrap().flatten() {
        if entry.path().extension().is_some_and(|e| e == "log") {
            out.push_str(&format!("--- {}\n", entry.path().display()));
            out.push_str(&std::fs::read_to_string(entry.path()).unwrap_or_default());
        }
    }
    out
}

async fn stored_ids(db: &tokio_postgres::Client) -> Vec<String> {
    db.query(
        "SELECT request_id FROM fairgate_exchanges ORDER BY request_id",
        &[],
    )
    .await
    .unwrap()
    .iter()
    .map(|r| r.get(0))
    .collect()
}

#[tokio::test]
async fn two_workers_share_the_stream_and_a_killed_worker_loses_nothing() {
    let db_url = support::fresh_database().await;
    let mock = support::start_mock().await;
    let mut config = support::config(&mock.url(), Path::new("rules"));
    queue_config(&mut config, "nats://127.0.0.1:4222", &db_url);
    let dir = tempfile::tempdir().unwrap();
    let mut first = start_worker(&config, dir.path(), "first");
    let metrics_port = support::free_port();
    let mut second = start_worker_with(
        &config,
        dir.path(),
        "second",
        &["--metrics-listen", &format!("127.0.0.1:{metrics_port}")],
    );
    let proxy = support::start_proxy(config).await;
    let db = support::pg(&db_url).await;
    wait_for_log(dir.path(), "first", "worker consuming").await;
    wait_for_log(dir.path(), "second", "worker consuming").await;

    let mut ids = proxy.send_questions(30, "before").await;
    // Kill one worker while records are still arriving.
    support::wait_for_count(&db, "SELECT count(*) FROM fairgate_exchanges", 5).await;
    first.kill().unwrap();
    first.wait().unwrap();
    ids.extend(proxy.send_questions(30, "after").await);

    let count = support::wait_for_count(&db, "SELECT count(*) FROM fairgate_exchanges", 60).await;
    let log = logs(dir.path());
    assert_eq!(count, 60, "{log}");
    ids.sort();
    assert_eq!(stored_ids(&db).await, ids, "every exchange exactly once");
    let metrics: i64 = db
        .query_one("SELECT count(*) FROM fairgate_metric_results", &[])
        .await
        .unwrap()
        .get(0);
    assert_eq!(metrics, 60 * 10);
    // Both workers did part of the work.
    for name in ["first", "second"] {
        let log = std::fs::read_to_string(dir.path().join(format!("{name}.log"))).unwrap();
        assert!(log.contains("results stored"), "{name}: {log}");
    }
    let page = proxy.metrics().await;
    assert_eq!(
        support::metric(&page, "fairgate_queue_records_total{event=\"published\"}"),
        Some(60.0)
    );
    // The surviving worker's own metrics.
    let page = support::client()
        .get(format!("http://127.0.0.1:{metrics_port}/metrics"))
        .send()
        .await
        .unwrap()
        .text()
        .await
        .unwrap();
    let processed =
        support::metric(&page, "fairgate_queue_records_total{event=\"processed\"}").unwrap_or(0.0);
    assert!((1.0..=60.0).contains(&processed), "{page}");
    assert!(
        page.contains("fairgate_quality_score_bucket{metric=\"answer_length\""),
        "{page}"
    );
    second.kill().unwrap();
    second.wait().unwrap();
    proxy.stop().await;
}

/// A NATS server of this test's own, on `port`, storing in `store`.
fn start_nats(port: u16, store: &Path) -> Child {
    Command::new(nats_server())
        .args(["-a", "127.0.0.1", "-p", &port.to_string(), "-js", "-sd"])
        .arg(store)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("nats-server (installed by .ci/run)")
}

fn nats_server() -> PathBuf {
    [
        "/usr/sbin/nats-server",
        "/usr/bin/nats-server",
        "/usr/local/bin/nats-server",
    ]
    .iter()
    .map(PathBuf::from)
    .find(|p| p.exists())
    .unwrap_or_else(|| PathBuf::from("nats-server"))
}

async fn wait_for_port(port: u16) {
    for _ in 0..100 {
        if tokio::net::TcpStream::connect(("127.0.0.1", port))
            .await
            .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("nats-server did not listen on {port}");
}

#[tokio::test]
async fn nats_restarted_while_serving_loses_nothing() {
    let db_url = support::fresh_database().await;
    let mock = support::start_mock().await;
    let port = support::free_port();
    let store = tempfile::tempdir().unwrap();
    let mut nats = start_nats(port, store.path());
    wait_for_port(port).await;
    let mut config = support::config(&mock.url(), Path::new("rules"));
    queue_config(&mut config, &format!("nats://127.0.0.1:{port}"), &db_url);
    let dir = tempfile::tempdir().unwrap();
    let mut worker = start_worker(&config, dir.path(), "worker");
    let proxy = support::start_proxy(config).await;
    let db = support::pg(&db_url).await;

    let mut ids = proxy.send_questions(10, "up").await;
    assert_eq!(
        support::wait_for_count(&db, "SELECT count(*) FROM fairgate_exchanges", 10).await,
        10,
        "{}",
        logs(dir.path())
    );

    // NATS goes away; the proxy keeps serving and spills.
    nats.kill().unwrap();
    nats.wait().unwrap();
    ids.extend(proxy.send_questions(15, "down").await);
    let page = proxy.metrics().await;
    let spilled =
        support::metric(&page, "fairgate_queue_records_total{event=\"spilled\"}").unwrap_or(0.0);
    assert!(spilled >= 1.0, "{page}");

    // NATS comes back on the same port and store: the spill is replayed.
    let mut nats = start_nats(port, store.path());
    wait_for_port(port).await;
    ids.extend(proxy.send_questions(5, "back").await);
    let count = support::wait_for_count(&db, "SELECT count(*) FROM fairgate_exchanges", 30).await;
    assert_eq!(count, 30, "{}", logs(dir.path()));
    ids.sort();
    assert_eq!(stored_ids(&db).await, ids, "every exchange exactly once");
    let page = proxy.metrics().await;
    assert!(
        support::metric(&page, "fairgate_queue_records_total{event=\"replayed\"}").unwrap_or(0.0)
            >= 1.0,
        "{page}"
    );

    worker.kill().unwrap();
    worker.wait().unwrap();
    proxy.stop().await;
    nats.kill().unwrap();
    nats.wait().unwrap();
}

#[tokio::test]
async fn results_are_published_on_the_results_subject() {
    let mock = support::start_mock().await;
    let mut config = support::config(&mock.url(), Path::new("rules"));
    let subject = support::unique("fgtest.results").replace('_', ".");
    config.sinks.nats = Some(fairgate::config::NatsSinkConfig {
        url: Some("nats://127.0.0.1:4222".into()),
        subject: subject.clone(),
    });
    let nats = async_nats::connect("nats://127.0.0.1:4222").await.unwrap();
    let mut results = nats.subscribe(subject).await.unwrap();
    nats.flush().await.unwrap();
    let proxy = support::start_proxy(config).await;
    let mut ids = proxy.send_questions(3, "published").await;
    let mut seen = Vec::new();
    while seen.len() < 3 {
        let message = tokio::time::timeout(
            Duration::from_secs(20),
            futures_util::StreamExt::next(&mut results),
        )
        .await
        .expect("a result within 20 s")
        .unwrap();
        let result: Value = serde_json::from_slice(&message.payload).unwrap();
        assert_eq!(result["kind"], "exchange");
        assert_eq!(result["metrics"].as_array().unwrap().len(), 10);
        seen.push((
            result["request_id"].as_str().unwrap().to_owned(),
            message.payload.to_vec(),
        ));
    }
    seen.sort();
    ids.sort();
    assert_eq!(
        seen.iter().map(|(id, _)| id).collect::<Vec<_>>(),
        ids.iter().collect::<Vec<_>>()
    );
    // With the JSON-lines sink too, what is published is the line written,
    // byte for byte.
    proxy.wait_for_results(3).await;
    let mut lines = proxy.result_lines();
    lines.sort();
    let mut published: Vec<Vec<u8>> = seen.into_iter().map(|(_, payload)| payload).collect();
    published.sort();
    assert_eq!(lines, published);
    proxy.stop().await;
}

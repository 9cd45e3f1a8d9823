//! The `fairgate` binary: `rules check`, `rules test` and `scan`, run as a
//! user runs them.

// Test helpers fail the test the way a test fails: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output, Stdio};

fn fairgate(args: &[&str], stdin: &[u8]) -> Output {
    fairgate_with(args, &[], stdin)
}

/// [`fairgate`] with the environment variables `env` set.
fn fairgate_with(args: &[&str], env: &[(&str, &str)], stdin: &[u8]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_fairgate"))
        .args(args)
        .envs(env.iter().copied())
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("fairgate runs");
    child
        .stdin
        .take()
        .expect("stdin")
        .write_all(stdin)
        .expect("write stdin");
    child.wait_with_output().expect("fairgate finishes")
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

fn write_pack(dir: &Path, name: &str, yaml: &str) {
    std::fs::write(dir.join(name), yaml).expect("write pack");
}

const PACK: &str = "pack: t
description: test
rules:
  - id: t.rich
    category: financial_safety
    scopes: [response]
    keywords: [get rich quick]
    weight: 0.9
    action: block
    message: no
    examples:
      block: [you will get rich quick]
      allow: [get rich slowly]
";

#[test]
fn rules_check_lists_the_shipped_packs() {
    let out = fairgate(&["rules", "check", "rules"], b"");
    assert!(out.status.success(), "{}", stdout(&out));
    let text = stdout(&out);
    for pack in [
        "financial_safety",
        "prompt_injection",
        "jailbreak",
        "secrets",
        "pii",
        "harm",
        "shame_language",
    ] {
        assert!(text.contains(pack), "{pack} missing:\n{text}");
    }
    assert!(text.contains("ok: "), "{text}");
}

#[test]
fn rules_check_reports_every_error_and_fails() {
    let dir = tempfile::tempdir().unwrap();
    let broken = PACK
        .replace("weight: 0.9", "weight: 9")
        .replace("action: block", "action: stop");
    write_pack(dir.path(), "broken.yaml", &broken);
    let out = fairgate(&["rules", "check", dir.path().to_str().unwrap()], b"");
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("broken.yaml:8: rule t.rich: weight 9 is out of range"),
        "{text}"
    );
    assert!(
        text.contains("broken.yaml:9: rule t.rich: unknown action `stop`"),
        "{text}"
    );
    assert!(text.contains("error: 2 problem(s)"), "{text}");
}

#[test]
fn rules_test_passes_on_the_shipped_packs() {
    let out = fairgate(&["rules", "test", "rules"], b"");
    assert!(out.status.success(), "{}", stdout(&out));
    assert!(stdout(&out).contains(" 0 failed"), "{}", stdout(&out));
}

#[test]
fn rules_test_prints_each_failing_example() {
    let dir = tempfile::tempdir().unwrap();
    write_pack(
        dir.path(),
        "t.yaml",
        &PACK.replace("allow: [get rich slowly]", "allow: [get rich quick now]"),
    );
    let out = fairgate(&["rules", "test", dir.path().to_str().unwrap()], b"");
    assert_eq!(out.status.code(), Some(1));
    let text = stdout(&out);
    assert!(
        text.contains("FAIL t.rich (response): allow example matched: \"get rich quick now\""),
        "{text}"
    );
    assert!(text.contains("1 passed, 1 failed"), "{text}");
}

#[test]
fn scan_json_reports_hits_with_byte_offsets_into_the_original() {
    let input = "Honestly? Ｉｎｖｅｓｔ everything in one stock.";
    let out = fairgate(&["scan", "--scope", "response", "--json"], input.as_bytes());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).expect("one JSON object");
    assert_eq!(v["verdict"], "block");
    assert!(
        (v["risk"]["response"].as_f64().unwrap() - 0.9).abs() < 1e-9,
        "{v}"
    );
    assert!(
        (v["risk"]["total"].as_f64().unwrap() - 0.3).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(v["risk"]["prompt"], 0.0);
    let hit = &v["hits"][0];
    assert_eq!(hit["rule"], "fin.invest_everything");
    assert_eq!(hit["category"], "financial_safety");
    assert_eq!(hit["scope"], "response");
    assert_eq!(hit["action"], "block");
    let (start, end) = (
        hit["start"].as_u64().unwrap() as usize,
        hit["end"].as_u64().unwrap() as usize,
    );
    assert_eq!(&input[start..end], "Ｉｎｖｅｓｔ everything in");
    assert_eq!(hit["snippet"], "Ｉｎｖｅｓｔ everything in");
}

#[test]
fn scan_table_reads_a_file() {
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("reply.txt");
    std::fs::write(&file, "Pay with 4111 1111 1111 1111 today.").unwrap();
    let out = fairgate(&["scan", "--scope", "prompt", file.to_str().unwrap()], b"");
    assert!(out.status.success());
    let text = stdout(&out);
    assert!(text.starts_with("verdict: redact\n"), "{text}");
    assert!(text.contains("pii.card_number"), "{text}");
    assert!(text.contains("9..28"), "{text}");
}

#[test]
fn scan_context_with_a_question_scores_relevance() {
    let out = fairgate(
        &[
            "scan",
            "--scope",
            "context",
            "--question",
            "how much should I save for retirement",
            "--json",
        ],
        b"The weather in Lisbon is mild all year.",
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["context_relevance"], 0.0);
    assert!(
        (v["risk"]["context"].as_f64().unwrap() - 0.5).abs() < 1e-9,
        "{v}"
    );
    assert_eq!(v["verdict"], "allow");
}

#[test]
fn scan_rejects_input_that_is_not_text() {
    let out = fairgate(&["scan", "--scope", "prompt"], &[b'h', b'i', 0xff, 0xfe]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("input is not UTF-8 text (invalid byte at offset 2)"),
        "{err}"
    );
}

#[test]
fn scan_with_a_missing_rules_directory_says_so() {
    let out = fairgate(
        &["scan", "--scope", "prompt", "--rules", "/nonexistent"],
        b"hi",
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/nonexistent: cannot read rules directory"),
        "{err}"
    );
}

#[test]
fn config_file_changes_the_risk_weights() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fairgate.yaml");
    std::fs::write(
        &config,
        "risk:\n  weights: {prompt: 0, response: 1, context: 0}\n  block_threshold: 0.99\n",
    )
    .unwrap();
    let out = fairgate(
        &[
            "--config",
            config.to_str().unwrap(),
            "scan",
            "--scope",
            "response",
            "--json",
        ],
        b"That was a pathetic budget.",
    );
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["verdict"], "flag");
    assert!(
        (v["risk"]["total"].as_f64().unwrap() - 0.2).abs() < 1e-9,
        "{v}"
    );

    std::fs::write(&config, "risk:\n  block_treshold: 0.5\n").unwrap();
    let out = fairgate(
        &["--config", config.to_str().unwrap(), "rules", "check"],
        b"",
    );
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unknown field `block_treshold`"));
}

#[test]
fn config_check_prints_the_effective_configuration_or_every_problem() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fairgate.yaml");
    std::fs::write(
        &config,
        "listen: 127.0.0.1:7000\nguard:\n  stream_mode: buffer\n",
    )
    .unwrap();
    let out = fairgate(
        &[
            "--config",
            config.to_str().unwrap(),
            "config",
            "check",
            "--upstream-anthropic",
            "http://127.0.0.1:9",
        ],
        b"",
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_yaml_ng::from_str(&stdout(&out)).unwrap();
    assert_eq!(printed["listen"], "127.0.0.1:7000");
    assert_eq!(printed["guard"]["stream_mode"], "buffer");
    // Defaults are filled in, flags override the file.
    assert_eq!(printed["admin"]["listen"], "127.0.0.1:9090");
    assert_eq!(
        printed["upstreams"]["openai"]["url"],
        "https://api.openai.com"
    );
    assert_eq!(
        printed["upstreams"]["anthropic"]["url"],
        "http://127.0.0.1:9"
    );

    let broken = "admin:\n  listen: 0.0.0.0:9090\nroutes:\n  - {path_prefix: v1, upstream: nowhere}\n\
                  metrics:\n  models: [other, gpt-4o, gpt-4o]\n";
    std::fs::write(&config, broken).unwrap();
    let out = fairgate(
        &["--config", config.to_str().unwrap(), "config", "check"],
        b"",
    );
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for problem in [
        "routes[0].upstream: no upstream named \"nowhere\"",
        "routes[0].path_prefix: \"v1\" must start with /",
        "admin.token_env: the admin listener 0.0.0.0:9090 is not on loopback",
        "metrics.models[0]: \"other\" cannot be a model's label",
        "metrics.models[2]: \"gpt-4o\" is listed twice",
    ] {
        assert!(err.contains(problem), "{problem} missing from:\n{err}");
    }
}

/// Any setting can come from a `FAIRGATE__` variable, over the file's and
/// under the flags; a variable that names no setting, or whose value does
/// not fit it, is named in the error.
#[test]
fn any_setting_can_come_from_the_environment() {
    let dir = tempfile::tempdir().unwrap();
    let config = dir.path().join("fairgate.yaml");
    let file = "listen: 127.0.0.1:7000\nguard:\n  max_body_bytes: 1000\n  stream_mode: buffer\n";
    std::fs::write(&config, file).unwrap();
    let check = |env: &[(&str, &str)], flags: &[&str]| {
        let mut args = vec!["--config", config.to_str().unwrap(), "config", "check"];
        args.extend(flags);
        fairgate_with(&args, env, b"")
    };
    let env = [
        ("FAIRGATE__GUARD__MAX_BODY_BYTES", "2048"),
        ("FAIRGATE__client_body_timeout_ms", "1500"),
        ("FAIRGATE__UPSTREAMS__OPENAI__TIMEOUT_MS", "120000"),
        ("FAIRGATE__RISK__BLOCK_THRESHOLD", "0.9"),
        ("FAIRGATE__LISTEN", "127.0.0.1:7001"),
        // Not settings: the variable of a flag, and any other.
        ("FAIRGATE_OPENAI_KEY", "sk-not-a-setting"),
    ];
    let out = check(&env, &["--admin-listen", "127.0.0.1:9999"]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let printed: serde_json::Value = serde_yaml_ng::from_str(&stdout(&out)).unwrap();
    assert_eq!(printed["guard"]["max_body_bytes"], 2048);
    assert_eq!(
        printed["guard"]["stream_mode"], "buffer",
        "the file's, kept"
    );
    assert_eq!(printed["client_body_timeout_ms"], 1500);
    assert_eq!(printed["risk"]["block_threshold"], 0.9);
    assert_eq!(printed["listen"], "127.0.0.1:7001");
    assert_eq!(printed["admin"]["listen"], "127.0.0.1:9999");
    // One setting of an upstream changes; the rest of it, and the other
    // upstream, stay as they were.
    assert_eq!(printed["upstreams"]["openai"]["timeout_ms"], 120000);
    assert_eq!(
        printed["upstreams"]["openai"]["url"],
        "https://api.openai.com"
    );
    assert_eq!(
        printed["upstreams"]["anthropic"]["url"],
        "https://api.anthropic.com"
    );
    assert!(!stdout(&out).contains("sk-not-a-setting"));

    // The flag's own variable wins over the setting's.
    let out = check(
        &[
            ("FAIRGATE__LISTEN", "127.0.0.1:7001"),
            ("FAIRGATE_LISTEN", "127.0.0.1:7002"),
        ],
        &[],
    );
    let printed: serde_json::Value = serde_yaml_ng::from_str(&stdout(&out)).unwrap();
    assert_eq!(printed["listen"], "127.0.0.1:7002");

    let wrong = [
        ("FAIRGATE__GUARD__MAX_BODY", "1", "unknown field `max_body`"),
        ("FAIRGATE__GUARD__MAX_BODY_BYTES", "lots", "invalid type"),
        ("FAIRGATE__LISTEN__PORT", "1", "listen is not a section"),
        ("FAIRGATE__GUARD____X", "1", "names no setting"),
    ];
    for (name, value, why) in wrong {
        let out = check(&[(name, value), ("FAIRGATE__THREADS", "2")], &[]);
        assert_eq!(out.status.code(), Some(2), "{name}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(name) && err.contains(why), "{name}: {err}");
        assert!(!err.contains("FAIRGATE__THREADS"), "{err}");
    }
    // Any other variable may hold bytes that are not UTF-8.
    #[cfg(unix)]
    {
        use std::os::unix::ffi::OsStrExt;
        let out = Command::new(env!("CARGO_BIN_EXE_fairgate"))
            .args(["config", "check"])
            .env(
                "FAIRGATE_NOT_TEXT",
                std::ffi::OsStr::from_bytes(b"\xff\xfe"),
            )
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // A value that fits but is not valid: the same problems as the file's.
    let zero = [
        ("FAIRGATE__GUARD__MAX_BODY_BYTES", "0"),
        ("FAIRGATE__GUARD__MAX_BATCH_BYTES", "0"),
        ("FAIRGATE__GUARD__MAX_RESPONSE_BYTES", "0"),
        ("FAIRGATE__GUARD__MAX_STREAM_BYTES", "0"),
    ];
    let out = check(&zero, &[]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for key in [
        "max_body_bytes",
        "max_batch_bytes",
        "max_response_bytes",
        "max_stream_bytes",
    ] {
        assert!(
            err.contains(&format!("guard.{key}: must be at least 1")),
            "{err}"
        );
    }
}

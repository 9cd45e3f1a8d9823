//! `fairgate lexicon import` and `fairgate eval`, run as a user runs them.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::io::Write;
use std::path::Path;
use std::process::{Command, Output};

use serde_json::{Value, json};

fn fairgate(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_fairgate"))
        .args(args)
        .output()
        .expect("fairgate runs")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

const NRCLEX_JSON: &str = r#"{"abandon": ["fear", "negative", "sadness"], "happy": ["anticipation", "joy", "positive", "trust"], "plan": ["anticipation"], "nothing": ["negative"]}"#;

fn table(path: &Path) -> Value {
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

#[test]
fn lexicon_import_reads_the_wheel_the_json_and_the_nrc_file_alike() {
    let dir = tempfile::tempdir().unwrap();
    // A wheel is a zip archive holding nrclex/data/nrc_en.json.
    let wheel = dir.path().join("NRCLex-4.1.0-py3-none-any.whl");
    let mut zip = zip::ZipWriter::new(std::fs::File::create(&wheel).unwrap());
    zip.start_file(
        "nrclex/__init__.py",
        zip::write::SimpleFileOptions::default(),
    )
    .unwrap();
    zip.start_file(
        "nrclex/data/nrc_en.json",
        zip::write::SimpleFileOptions::default(),
    )
    .unwrap();
    zip.write_all(NRCLEX_JSON.as_bytes()).unwrap();
    zip.finish().unwrap();
    let json = dir.path().join("nrc_en.json");
    std::fs::write(&json, NRCLEX_JSON).unwrap();
    let tsv = dir.path().join("NRC-Emotion-Lexicon-Wordlevel-v0.92.txt");
    std::fs::write(
        &tsv,
        "abandon\tanger\t0\nabandon\tfear\t1\nabandon\tsadness\t1\nabandon\tnegative\t1\n\
         happy\tanticipation\t1\nhappy\tjoy\t1\nhappy\ttrust\t1\nplan\tanticipation\t1\nnothing\tnegative\t1\n",
    )
    .unwrap();
    let mut tables = Vec::new();
    for (i, source) in [&wheel, &json, &tsv].iter().enumerate() {
        let out = dir.path().join(format!("emotions-{i}.json"));
        let output = fairgate(&[
            "lexicon",
            "import",
            source.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ]);
        assert!(output.status.success(), "{}", text(&output));
        assert!(text(&output).contains("wrote 3 words"), "{}", text(&output));
        tables.push(table(&out));
    }
    assert_eq!(tables[0], tables[1]);
    assert_eq!(tables[1], tables[2]);
    assert_eq!(
        tables[0]["words"]["happy"],
        json!(["anticipation", "joy", "trust"])
    );
    assert_eq!(
        tables[0]["words"].get("nothing"),
        None,
        "no emotion, no entry"
    );

    // Bad input is a clear error.
    let bad = dir.path().join("bad.txt");
    std::fs::write(&bad, "happy joy 1\n").unwrap();
    let output = fairgate(&[
        "lexicon",
        "import",
        bad.to_str().unwrap(),
        "--out",
        "/dev/null",
    ]);
    assert!(!output.status.success());
    assert!(text(&output).contains("line 1"), "{}", text(&output));
    let output = fairgate(&["lexicon", "import", "/no/such/file"]);
    assert!(!output.status.success());
}

fn write_lines(path: &Path, rows: &[Value]) {
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).unwrap();
}

#[test]
fn eval_summarizes_writes_rows_in_order_and_compares_rule_sets() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dir.path().join("traffic.jsonl");
    write_lines(
        &dataset,
        &[
            json!({"input": "How do I save?", "output": "I am happy to help you plan. Thanks!", "expected": "  i am HAPPY to help you plan.\n thanks!", "ground_truth": "Happy plan."}),
            json!({"input": "Quick money?", "output": "Guaranteed returns with no risk: borrow to invest in crypto, it will moon."}),
            json!({"input": "Where do I keep savings?", "output": "A savings account.", "context": "Savings accounts keep savings safe.", "user_action": "saved", "stake_type": "loss_pool", "goal_completed": true}),
        ],
    );
    let lexicon = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/emotions.json");
    let out = dir.path().join("rows.jsonl");
    let output = fairgate(&[
        "eval",
        dataset.to_str().unwrap(),
        "--rules",
        "rules",
        "--lexicon",
        lexicon.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    let report = text(&output);
    assert!(output.status.success(), "{report}");
    assert!(report.contains("3 rows"), "{report}");
    assert!(report.contains("blocked 1"), "{report}");
    assert!(report.contains("pass rate 66.7%"), "{report}");
    assert!(report.contains("fin.guaranteed_returns"), "{report}");
    // exact_match: one score (1.0), two without an expected answer.
    let line = report
        .lines()
        .find(|l| l.starts_with("exact_match"))
        .unwrap();
    let fields: Vec<&str> = line.split_whitespace().collect();
    assert_eq!(
        fields,
        ["exact_match", "1.0000", "1.0000", "1.0000", "1", "2"],
        "{report}"
    );

    let rows: Vec<Value> = std::fs::read_to_string(&out)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 3);
    for (i, row) in rows.iter().enumerate() {
        assert_eq!(row["row"], i);
        let names: Vec<&String> = row["metrics"].as_object().unwrap().keys().collect();
        assert_eq!(names.len(), 11, "{names:?}");
    }
    assert_eq!(rows[0]["verdict"], "allow");
    assert_eq!(rows[0]["metrics"]["exact_match"]["score"], 1.0);
    assert_eq!(rows[0]["metrics"]["politeness"]["score"], 1.0);
    assert_eq!(rows[0]["metrics"]["emotional_entropy"]["details"]["joy"], 1);
    assert_eq!(rows[1]["verdict"], "block");
    assert_eq!(rows[1]["metrics"]["financial_safety"]["score"], 0.0);
    assert_eq!(
        rows[1]["metrics"]["intervention_success"]["score"],
        Value::Null
    );
    assert_eq!(rows[2]["metrics"]["intervention_success"]["score"], 1.0);
    assert_eq!(rows[2]["metrics"]["stake_effectiveness"]["score"], 0.72);
    let relevance = rows[2]["metrics"]["context_relevance"]["score"]
        .as_f64()
        .unwrap();
    assert!(relevance > 0.3, "{relevance}");

    // A candidate rule set that no longer blocks guaranteed returns.
    let candidate = dir.path().join("candidate");
    std::fs::create_dir(&candidate).unwrap();
    for entry in std::fs::read_dir("rules").unwrap().flatten() {
        let name = entry.file_name();
        if name.to_string_lossy().ends_with(".yaml") && name != "financial_safety.yaml" {
            std::fs::copy(entry.path(), candidate.join(&name)).unwrap();
        }
    }
    let output = fairgate(&[
        "eval",
        dataset.to_str().unwrap(),
        "--rules",
        candidate.to_str().unwrap(),
        "--compare",
        "rules",
    ]);
    let report = text(&output);
    assert!(output.status.success(), "{report}");
    assert!(
        report.contains("verdicts changed against rules: 1"),
        "{report}"
    );
    assert!(report.contains("row 1: block -> "), "{report}");
}

#[test]
fn eval_names_the_bad_line() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dir.path().join("bad.jsonl");
    std::fs::write(
        &dataset,
        "{\"input\": \"a\", \"output\": \"b\"}\n{\"input\": \"a\"}\n",
    )
    .unwrap();
    let output = fairgate(&["eval", dataset.to_str().unwrap()]);
    assert!(!output.status.success());
    assert!(
        text(&output).contains("bad.jsonl:2: not a dataset row"),
        "{}",
        text(&output)
    );
}

#[test]
fn eval_without_a_lexicon_says_why_entropy_has_no_score() {
    let dir = tempfile::tempdir().unwrap();
    let dataset = dir.path().join("d.jsonl");
    write_lines(&dataset, &[json!({"input": "hi", "output": "happy"})]);
    let out = dir.path().join("rows.jsonl");
    let output = fairgate(&[
        "eval",
        dataset.to_str().unwrap(),
        "--lexicon",
        "/no/such/lexicon.json",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(output.status.success(), "{}", text(&output));
    assert!(text(&output).contains("no lexicon"), "{}", text(&output));
    let row: Value = serde_json::from_str(std::fs::read_to_string(&out).unwrap().trim()).unwrap();
    assert_eq!(row["metrics"]["emotional_entropy"]["score"], Value::Null);
    assert!(
        row["metrics"]["emotional_entropy"]["reason"]
            .as_str()
            .unwrap()
            .contains("fairgate lexicon import"),
        "{row}"
    );
}

#[test]
fn worker_refuses_an_open_metrics_listener_without_a_token() {
    let output = fairgate(&["worker", "--metrics-listen", "0.0.0.0:0"]);
    assert!(!output.status.success());
    assert!(
        text(&output).contains("admin.token_env must name a bearer token"),
        "{}",
        text(&output)
    );
}

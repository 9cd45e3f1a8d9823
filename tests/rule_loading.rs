//! Loading rule packs: every kind of mistake is reported, all at once, each
//! with its file, line and rule id.

// Test helpers fail the test the way a test fails: by panicking.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use fairgate::rules::{CompileOptions, LoadError, RuleSet};

/// A rule that loads: the base the broken variants below start from. In a
/// pack it starts on line 4 (`id`), with `keywords` on line 7 and `weight`
/// on line 8.
const GOOD_RULE: &str = "
  - id: t.good
    category: test
    scopes: [prompt]
    keywords: [forbidden phrase]
    weight: 0.5
    action: block
    message: no
    examples:
      block: [a forbidden phrase here]
      allow: [nothing to see]
";

fn pack(rules: &str) -> String {
    format!("pack: test\ndescription: d\nrules:{rules}")
}

fn errors(sources: &[(&str, &str)]) -> Vec<LoadError> {
    match RuleSet::from_sources(sources.iter().copied(), &CompileOptions::default()) {
        Ok(_) => panic!("expected load errors"),
        Err(e) => e.0,
    }
}

fn only_error(yaml: &str) -> LoadError {
    let errors = errors(&[("pack.yaml", yaml)]);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    errors.into_iter().next().unwrap()
}

#[test]
fn a_good_pack_loads() {
    let rules = RuleSet::from_sources(
        [("pack.yaml", pack(GOOD_RULE).as_str())],
        &CompileOptions::default(),
    )
    .unwrap();
    assert_eq!(rules.rules().len(), 1);
    assert_eq!(rules.packs()[0].name, "test");
}

#[test]
fn unknown_field_points_at_its_line() {
    let yaml = pack(&GOOD_RULE.replace("    weight: 0.5\n", "    weight: 0.5\n    wieght: 0.7\n"));
    let e = only_error(&yaml);
    assert!(e.message.contains("unknown field `wieght`"), "{e}");
    assert_eq!(e.rule.as_deref(), Some("t.good"));
    assert_eq!(e.line, Some(9));
    assert_eq!(e.file, Path::new("pack.yaml"));
}

#[test]
fn unknown_pack_field_is_reported() {
    let e = only_error(&format!("pak: test\n{}", pack(GOOD_RULE)));
    assert!(e.message.contains("unknown field `pak`"), "{e}");
}

#[test]
fn yaml_syntax_error_has_a_line() {
    let e = only_error("pack: test\nrules:\n  - id: [unclosed\n");
    assert!(e.message.starts_with("invalid YAML"), "{e}");
    assert!(e.line.is_some(), "{e}");
}

#[test]
fn duplicate_ids_name_the_first_definition() {
    let errors = errors(&[
        ("a.yaml", &pack(GOOD_RULE)),
        (
            "b.yaml",
            &pack(GOOD_RULE).replace("pack: test", "pack: other"),
        ),
    ]);
    assert_eq!(errors.len(), 1, "{errors:#?}");
    assert_eq!(errors[0].file, Path::new("b.yaml"));
    assert!(
        errors[0]
            .message
            .contains("duplicate rule id; first defined at a.yaml:4"),
        "{}",
        errors[0]
    );
}

#[test]
fn duplicate_pack_names_are_reported() {
    let second = pack(&GOOD_RULE.replace("t.good", "t.other"));
    let errors = errors(&[("a.yaml", &pack(GOOD_RULE)), ("b.yaml", &second)]);
    assert!(
        errors
            .iter()
            .any(|e| e.message.contains("pack `test` is also defined in a.yaml")),
        "{errors:#?}"
    );
}

#[test]
fn empty_patterns_are_rejected() {
    let e = only_error(&pack(
        &GOOD_RULE.replace("[forbidden phrase]", "['forbidden', '\u{200B}']"),
    ));
    assert!(e.message.contains("empty after normalization"), "{e}");
    assert_eq!(e.line, Some(7));

    let e = only_error(&pack(
        &GOOD_RULE.replace("keywords: [forbidden phrase]", "regex: ''"),
    ));
    assert!(e.message.contains("empty regex"), "{e}");

    let e = only_error(&pack(
        &GOOD_RULE.replace("    keywords: [forbidden phrase]\n", ""),
    ));
    assert!(e.message.contains("matches nothing"), "{e}");
}

#[test]
fn invalid_regex_points_at_the_pattern() {
    let rule = GOOD_RULE.replace(
        "keywords: [forbidden phrase]",
        "regex:\n      - 'fine'\n      - '(unclosed'",
    );
    let e = only_error(&pack(&rule));
    assert!(e.message.contains("invalid regex \"(unclosed\""), "{e}");
    assert!(e.message.contains("unclosed group"), "{e}");
    assert_eq!(e.line, Some(9));
}

#[test]
fn oversized_regex_is_rejected() {
    let rule = GOOD_RULE.replace("keywords: [forbidden phrase]", r"regex: '\w{500}\w{500}'");
    let e = only_error(&pack(&rule));
    assert!(e.message.contains("too large"), "{e}");
}

#[test]
fn regex_that_matches_nothing_is_rejected() {
    let rule = GOOD_RULE.replace("keywords: [forbidden phrase]", "regex: 'a*'");
    let e = only_error(&pack(&rule));
    assert!(e.message.contains("can match the empty string"), "{e}");
}

#[test]
fn weight_out_of_range_points_at_the_weight() {
    let e = only_error(&pack(&GOOD_RULE.replace("weight: 0.5", "weight: 1.5")));
    assert!(e.message.contains("weight 1.5 is out of range"), "{e}");
    assert_eq!(e.line, Some(8));
}

#[test]
fn unknown_scope_action_and_validator_are_reported() {
    let e = only_error(&pack(
        &GOOD_RULE.replace("scopes: [prompt]", "scopes: [prompt, reply]"),
    ));
    assert!(e.message.contains("unknown scope `reply`"), "{e}");
    let e = only_error(&pack(&GOOD_RULE.replace("action: block", "action: deny")));
    assert!(e.message.contains("unknown action `deny`"), "{e}");
    let e = only_error(&pack(
        &GOOD_RULE.replace("action: block", "action: block\n    validate: crc"),
    ));
    assert!(e.message.contains("unknown validator `crc`"), "{e}");
}

#[test]
fn rules_without_both_kinds_of_examples_are_rejected() {
    let e = only_error(&pack(
        &GOOD_RULE.replace("      allow: [nothing to see]\n", ""),
    ));
    assert!(
        e.message.contains("at least one `block` and one `allow`"),
        "{e}"
    );
}

#[test]
fn bad_unless_settings_are_rejected() {
    let rule = GOOD_RULE.replace(
        "action: block",
        "action: block\n    unless: {patterns: [], before: 3}",
    );
    assert!(only_error(&pack(&rule)).message.contains("unless.patterns"));
    let rule = GOOD_RULE.replace(
        "action: block",
        "action: block\n    unless: {patterns: [never], before: 0}",
    );
    assert!(only_error(&pack(&rule)).message.contains("unless.before"));
    let rule = GOOD_RULE.replace(
        "action: block",
        "action: block\n    unless: {patterns: ['(never'], before: 2}",
    );
    assert!(
        only_error(&pack(&rule))
            .message
            .contains("invalid `unless` pattern")
    );
}

#[test]
fn every_problem_is_reported_at_once() {
    let broken = format!(
        "{}{}{}",
        GOOD_RULE
            .replace("t.good", "t.one")
            .replace("weight: 0.5", "weight: -1"),
        GOOD_RULE
            .replace("t.good", "t.two")
            .replace("action: block", "action: nope")
            .replace("scopes: [prompt]", "scopes: [nowhere]"),
        GOOD_RULE
            .replace("t.good", "t.three")
            .replace("message: no", "mesage: no"),
    );
    let errors = errors(&[("pack.yaml", &pack(&broken))]);
    // Unknown fields are found while parsing, the rest while compiling; each
    // error is on the line of the bad value in its own rule.
    let found: Vec<_> = errors
        .iter()
        .map(|e| (e.rule.clone().unwrap_or_default(), e.line.unwrap_or(0)))
        .collect();
    let expected = [("t.three", 32), ("t.one", 8), ("t.two", 17), ("t.two", 20)];
    assert_eq!(
        found,
        expected.map(|(r, l)| (r.to_owned(), l)),
        "{errors:#?}"
    );
    let text = fairgate::rules::LoadErrors(errors).to_string();
    assert!(text.lines().all(|l| l.starts_with("pack.yaml:")), "{text}");
}

#[test]
fn missing_directory_and_empty_directory_are_errors() {
    let e =
        RuleSet::load_dir(Path::new("/nonexistent/rules"), &CompileOptions::default()).unwrap_err();
    assert!(
        e.0[0].message.contains("cannot read rules directory"),
        "{e}"
    );
    let dir = tempfile::tempdir().unwrap();
    let e = RuleSet::load_dir(dir.path(), &CompileOptions::default()).unwrap_err();
    assert!(e.0[0].message.contains("no rule files"), "{e}");
}

#[test]
fn version_follows_the_content() {
    let load = |yaml: &str| {
        RuleSet::from_sources([("pack.yaml", yaml)], &CompileOptions::default()).unwrap()
    };
    let a = load(&pack(GOOD_RULE));
    let b = load(&pack(GOOD_RULE));
    let c = load(&pack(&GOOD_RULE.replace("weight: 0.5", "weight: 0.6")));
    assert_eq!(a.version(), b.version());
    assert_ne!(a.version(), c.version());
}

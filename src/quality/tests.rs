use super::*;
use crate::rules::Action;

fn lexicon() -> Lexicon {
    // A small lexicon written for the tests (the NRC one is not in the repo).
    Lexicon::from_words([
        ("happy", vec!["joy", "trust"]),
        ("worried", vec!["fear", "sadness"]),
        ("debt", vec!["fear", "sadness", "anger"]),
        ("plan", vec!["anticipation"]),
        ("café", vec!["joy"]),
        ("don't", vec!["disgust"]),
    ])
}

fn metrics() -> Metrics {
    Metrics::new(
        Ok(lexicon()),
        POLITENESS_MARKERS.iter().map(|m| (*m).to_owned()).collect(),
    )
}

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() < 1e-12
}

#[test]
fn entropy_of_counts() {
    // happy: joy, trust; worried ×2: fear, sadness ×2 → joy 1, trust 1,
    // fear 2, sadness 2 of 6: H = 2·(1/6·log2 6) + 2·(1/3·log2 3).
    let r = metrics().emotional_entropy("Happy? Worried, WORRIED.");
    let expected = 2.0 * (1.0 / 6.0) * 6f64.log2() + 2.0 * (1.0 / 3.0) * 3f64.log2();
    assert!(close(r.score.unwrap(), expected), "{r:?}");
    assert_eq!(r.details["fear"], 2);
    assert_eq!(r.details["anger"], 0);
}

#[test]
fn entropy_single_emotion_is_zero_and_no_words_says_so() {
    let m = metrics();
    let one = m.emotional_entropy("plan plan plan");
    assert_eq!(one.score, Some(0.0));
    assert!(one.score.unwrap().is_sign_positive());
    let none = m.emotional_entropy("");
    assert_eq!(none.score, Some(0.0));
    assert!(none.reason.contains("no emotion words"), "{}", none.reason);
}

#[test]
fn entropy_tokens_are_unicode_and_curly_apostrophes() {
    let r = metrics().emotional_entropy("Un café. I don’t know.");
    assert_eq!(r.details["joy"], 1);
    assert_eq!(r.details["disgust"], 1);
    assert!(close(r.score.unwrap(), 1.0));
}

#[test]
fn without_lexicon_entropy_and_spearman_are_null_with_the_reason() {
    let m = Metrics::new(Err("data/emotions.json not found".into()), vec![]);
    let r = m.emotional_entropy("happy");
    assert_eq!(r.score, None);
    assert!(r.reason.contains("data/emotions.json not found"));
    assert_eq!(m.ground_truth_spearman("happy", Some("happy")).score, None);
}

#[test]
fn average_ranks_like_scipy() {
    assert_eq!(
        average_ranks(&[0., 0., 1., 2., 0., 0., 3., 0.]),
        [3., 3., 6., 7., 3., 3., 8., 3.]
    );
    assert_eq!(average_ranks(&[5., 1., 5.]), [2.5, 1., 2.5]);
}

#[test]
fn spearman_values() {
    let a = [1., 2., 3., 4., 5., 6., 7., 8.];
    let b = [2., 1., 4., 3., 6., 5., 8., 7.];
    assert!(close(
        spearman(&a, &b).unwrap(),
        1.0 - 6.0 * 8.0 / (8.0 * 63.0)
    ));
    assert!(close(spearman(&a, &a).unwrap(), 1.0));
    let reversed: Vec<f64> = a.iter().rev().copied().collect();
    assert!(close(spearman(&a, &reversed).unwrap(), -1.0));
    // With ties; scipy.stats.spearmanr gives 0.8838834764831844.
    let t1 = [0., 0., 1., 2., 0., 0., 3., 0.];
    let t2 = [1., 0., 1., 2., 0., 0., 2., 0.];
    assert!((spearman(&t1, &t2).unwrap() - 0.8838834764831844).abs() < 1e-12);
    // Constant vectors have no correlation.
    assert_eq!(spearman(&[0.; 8], &a), None);
    assert_eq!(spearman(&a, &[2.; 8]), None);
}

#[test]
fn spearman_metric_with_constant_counts_is_null() {
    let m = metrics();
    let r = m.ground_truth_spearman("nothing emotional", Some("happy worried debt plan"));
    assert_eq!(r.score, None);
    assert!(r.reason.contains("all equal"), "{}", r.reason);
    assert_eq!(m.ground_truth_spearman("x", None).score, None);
    let r = m.ground_truth_spearman("happy worried worried", Some("happy worried"));
    assert!(r.score.unwrap() > 0.9, "{r:?}");
}

#[test]
fn exact_match_normalizes() {
    assert_eq!(
        exact_match("  Save   50\tEUR ", Some("save 50 eur")).score,
        Some(1.0)
    );
    assert_eq!(exact_match("Save 50", Some("Save 60")).score, Some(0.0));
    assert_eq!(exact_match("", Some("")).score, Some(1.0));
    assert_eq!(exact_match("x", None).score, None);
}

#[test]
fn keyword_recall_over_token_sets() {
    let r = keyword_recall(
        "Build an emergency fund first.",
        Some("emergency fund, then invest; fund!"),
    );
    // E = {emergency, fund, then, invest}; found 2.
    assert_eq!(r.score, Some(0.5));
    assert_eq!(r.details["missing"], json!(["invest", "then"]));
    assert_eq!(keyword_recall("anything", Some("!!")).score, Some(0.0));
    assert_eq!(keyword_recall("", Some("naïve")).score, Some(0.0));
    assert_eq!(keyword_recall("Naïve", Some("naïve")).score, Some(1.0));
}

#[test]
fn length_counts_scalar_values() {
    assert_eq!(answer_length("café €5").score, Some(7.0));
    assert_eq!(answer_length("e\u{301}").score, Some(2.0));
    assert_eq!(answer_length("").score, Some(0.0));
    assert_eq!(answer_length("café €5").reason, "7 characters");
}

#[test]
fn politeness_counts_whole_word_markers() {
    let m = metrics();
    let politeness = |text: &str| m.politeness(text);
    assert_eq!(politeness("Here is the plan.").score, Some(0.0));
    assert_eq!(politeness("Thanks for asking.").score, Some(0.5));
    assert_eq!(
        politeness("Thanks for asking.").reason,
        "1 politeness markers"
    );
    assert_eq!(
        politeness("Please note, thank you, I hope this helps").score,
        Some(1.0)
    );
    // Whole words only: "thanksgiving" and "pleased" are not markers.
    assert_eq!(politeness("Thanksgiving pleased everyone").score, Some(0.0));
    assert_eq!(politeness("You’re welcome!").score, Some(0.5));
    // A marker cut by the end of the text is not one; found markers are
    // listed in the configured order, each once.
    assert_eq!(politeness("I must thank").score, Some(0.0));
    let found = politeness("Sorry. Thank you, thank you, and please.");
    assert_eq!(
        found.details["markers"],
        serde_json::json!(["please", "thank you", "sorry"])
    );
}

#[test]
fn context_relevance_is_cosine_of_word_sets() {
    let r = context_relevance(
        "How do I save for a house?",
        "Saving for a house takes years.",
    );
    assert!(close(r.score.unwrap(), 3.0 / (42f64).sqrt()));
    assert_eq!(context_relevance("question", "").score, Some(0.0));
    assert_eq!(context_relevance("", "context").score, Some(0.0));
}

fn hit(rule: &str, category: &str, scope: Scope, snippet: &str) -> RecordHit {
    RecordHit {
        rule: rule.into(),
        category: category.into(),
        scope,
        action: Action::Block,
        start: 0,
        end: 1,
        snippet: Some(snippet.into()),
    }
}

#[test]
fn financial_safety_and_tone_from_response_hits() {
    assert_eq!(financial_safety(&[]).score, Some(1.0));
    let hits = [
        hit(
            "fin.guaranteed_returns",
            "financial_safety",
            Scope::Response,
            "guaranteed",
        ),
        hit(
            "fin.guaranteed_returns",
            "financial_safety",
            Scope::Response,
            "no risk",
        ),
        hit("fin.crypto_hype", "financial_safety", Scope::Prompt, "moon"),
        hit(
            "shame.judgmental_words",
            "shame_language",
            Scope::Response,
            "irresponsible",
        ),
    ];
    let r = financial_safety(&hits);
    assert_eq!(r.score, Some(0.0));
    assert_eq!(r.details["violations"], json!(["fin.guaranteed_returns"]));
    let t = tone_banned_words(&hits);
    assert_eq!(t.score, Some(1.0));
    assert_eq!(t.details["words"], json!(["irresponsible"]));
    assert_eq!(tone_banned_words(&hits[..3]).score, None);
}

#[test]
fn outcome_metrics() {
    let saved = Outcome {
        user_action: UserAction::Saved,
        stake_type: Some(StakeType::AntiCharity),
        goal_completed: Some(true),
    };
    let r = outcome(Some(&saved));
    assert_eq!(r[0].score, Some(1.0));
    assert_eq!(r[1].score, Some(0.85));
    let spent = Outcome {
        user_action: UserAction::Spent,
        stake_type: None,
        goal_completed: Some(true),
    };
    let r = outcome(Some(&spent));
    assert_eq!(r[0].score, Some(0.0));
    assert_eq!(r[1].score, Some(0.35), "no stake counts as `none`");
    let unknown = Outcome {
        user_action: UserAction::Saved,
        stake_type: Some(StakeType::Social),
        goal_completed: None,
    };
    assert_eq!(outcome(Some(&unknown))[1].score, None);
    let failed = Outcome {
        user_action: UserAction::Saved,
        stake_type: Some(StakeType::LossPool),
        goal_completed: Some(false),
    };
    assert_eq!(outcome(Some(&failed))[1].score, Some(0.0));
    assert!(outcome(None).iter().all(|m| m.score.is_none()));
}

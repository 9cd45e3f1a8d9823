//! Scan throughput: the shipped packs and a generated pack of 1,000 keyword
//! rules and 100 regex rules, on benign texts of 1 KiB, 16 KiB and 256 KiB.
//!
//! `cargo bench --bench scan`; criterion prints throughput in MiB/s.

// A benchmark that cannot load its rules has nothing to measure.
#![allow(clippy::expect_used)]

use std::fmt::Write;
use std::hint::black_box;
use std::path::Path;

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use fairgate::rules::{CompileOptions, RuleSet, Scope};

/// A tiny deterministic generator, so every run scans the same text.
struct Lcg(u64);

impl Lcg {
    fn next(&mut self, n: usize) -> usize {
        self.0 = self
            .0
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        ((self.0 >> 33) as usize) % n
    }
}

const WORDS: &[&str] = &[
    "the",
    "a",
    "your",
    "savings",
    "account",
    "budget",
    "monthly",
    "interest",
    "rate",
    "fund",
    "index",
    "invest",
    "returns",
    "money",
    "plan",
    "retirement",
    "goal",
    "credit",
    "card",
    "pay",
    "debt",
    "loan",
    "stock",
    "market",
    "bond",
    "risk",
    "diversify",
    "emergency",
    "expenses",
    "income",
    "tax",
    "and",
    "to",
    "of",
    "in",
    "for",
    "with",
    "can",
    "should",
    "consider",
    "over",
    "time",
    "years",
    "growth",
    "fees",
    "compare",
    "options",
    "is",
    "it",
    "that",
    "you",
    "may",
    "help",
    "keep",
    "track",
    "spending",
    "rent",
];

/// Benign advice-like English of `len` bytes, with punctuation and numbers.
fn benign_text(len: usize) -> String {
    let mut rng = Lcg(42);
    let mut text = String::with_capacity(len + 16);
    while text.len() < len {
        let words = 6 + rng.next(12);
        for i in 0..words {
            let w = WORDS[rng.next(WORDS.len())];
            if i == 0 {
                let mut c = w.chars();
                if let Some(f) = c.next() {
                    text.extend(f.to_uppercase());
                    text.push_str(c.as_str());
                }
            } else {
                text.push(' ');
                text.push_str(w);
            }
            if rng.next(20) == 0 {
                let _ = write!(text, " {}%", rng.next(100));
            }
        }
        text.push_str(if rng.next(5) == 0 { "! " } else { ". " });
    }
    text.truncate(len);
    text
}

/// A pack of 1,000 keyword rules and 100 regex rules with made-up terms.
fn generated_pack() -> String {
    let mut rng = Lcg(7);
    let syllables = [
        "ka", "lo", "mi", "ru", "ze", "po", "ta", "ne", "vi", "so", "gu", "fe",
    ];
    let word = |rng: &mut Lcg| -> String {
        (0..3)
            .map(|_| syllables[rng.next(syllables.len())])
            .collect()
    };
    let mut yaml = String::from(
        "pack: generated\ndescription: load test\ndefaults: {category: gen, scopes: [prompt, response, context], action: flag, weight: 0.1}\nrules:\n",
    );
    for i in 0..1000 {
        let phrase = format!("{} {}", word(&mut rng), word(&mut rng));
        let _ = writeln!(
            yaml,
            "  - {{id: gen.kw{i}, message: m, keywords: ['{phrase}'], examples: {{block: ['{phrase}'], allow: ['plain text']}}}}"
        );
    }
    for i in 0..100 {
        let stem = word(&mut rng);
        let _ = writeln!(
            yaml,
            "  - {{id: gen.re{i}, message: m, regex: '\\b{stem}(?:ka|lo|mi)? \\d{{2,4}} (?:units|coins)\\b', examples: {{block: ['{stem} 123 units'], allow: ['plain text']}}}}"
        );
    }
    yaml
}

fn bench_scan(c: &mut Criterion) {
    let options = CompileOptions::default();
    let shipped = RuleSet::load_dir(Path::new("rules"), &options).expect("shipped packs compile");
    let pack = generated_pack();
    let generated = RuleSet::from_sources([("generated.yaml", pack.as_str())], &options)
        .expect("generated pack compiles");
    let mut group = c.benchmark_group("scan");
    for size in [1 << 10, 16 << 10, 256 << 10] {
        let text = benign_text(size);
        group.throughput(Throughput::Bytes(text.len() as u64));
        group.bench_with_input(BenchmarkId::new("shipped", size), &text, |b, text| {
            b.iter(|| black_box(shipped.scan(Scope::Response, black_box(text))))
        });
        group.bench_with_input(
            BenchmarkId::new("generated_1100", size),
            &text,
            |b, text| b.iter(|| black_box(generated.scan(Scope::Response, black_box(text)))),
        );
    }
    group.finish();
}

criterion_group!(benches, bench_scan);
criterion_main!(benches);

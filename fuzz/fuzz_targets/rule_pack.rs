//! A rule file of any content: compiled, or rejected with errors, never a
//! panic; a compiled set scans its own examples without one.

#![no_main]

use fairgate::rules::{CompileOptions, RuleSet, Scope};
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(rules) = RuleSet::from_sources([("fuzz.yaml", text)], &CompileOptions::default()) {
        for scope in [Scope::Prompt, Scope::Response, Scope::Context] {
            let _ = rules.scan(scope, text);
        }
    }
});

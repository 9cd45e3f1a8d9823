//! fairgate: an inline guardrail proxy for LLM APIs.
//!
//! The modules, in the order one text goes through them:
//!
//! * [`rules`]: rule packs (`rules/*.yaml`) are loaded ([`rules::load`]),
//!   compiled into one Aho-Corasick automaton and `RegexSet`s per scope, and
//!   scanned: a text is normalized ([`rules::normalize`]) so that disguised
//!   words match, run through the matchers once, and each match that survives
//!   its rule's `unless` window and validator becomes a [`rules::Hit`] with its
//!   span in the original text.
//! * [`risk`]: the hits of the prompt, response and context scopes become
//!   three risk scores, a weighted total, and a [`risk::Verdict`]
//!   (allow, flag, redact or block).
//! * [`text`]: word tokens and cosine similarity, for context relevance.
//! * [`config`]: the configuration file, with a default for every setting.
//! * [`commands`]: the `rules check`, `rules test` and `scan` commands, as
//!   functions that write to any output (the binary only parses arguments).

pub mod admin;
pub mod commands;
pub mod config;
pub mod exchange;
pub mod guard;
pub mod proxy;
pub mod risk;
pub mod rules;
pub mod telemetry;
pub mod text;
pub mod watch;

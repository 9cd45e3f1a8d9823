//! fairgate: an inline guardrail proxy for LLM APIs.
//!
//! The path of one guarded exchange through the modules:
//!
//! 1. [`proxy`] accepts the request (one single-threaded runtime per
//!    thread), picks a route and upstream from the [`config`], and reads the
//!    body.
//! 2. [`exchange`] says where the prompt and the context (tool results,
//!    documents) live in the JSON of the OpenAI or Anthropic dialect.
//! 3. [`guard`] scans each text with a snapshot of the [`rules`] taken from
//!    the [`rules::store`] at the start of the exchange: a text is
//!    normalized ([`rules::normalize`]) so that disguised words match, read
//!    once by one automaton holding every keyword and every regex's trigger
//!    literals, and each match that survives its rule's `unless` window and
//!    validator becomes a [`rules::Hit`] with its span in the original text.
//!    Redactions are applied in place.
//! 4. [`risk`] turns the hits of the prompt, response and context into three
//!    scores, a weighted total and a [`risk::Verdict`]. A blocked prompt is
//!    answered by [`proxy::respond`] in the caller's dialect and never goes
//!    upstream.
//! 5. The upstream's answer is scanned the same way before it is released:
//!    whole for a JSON response, as it streams for SSE
//!    ([`guard::stream`], which holds text back until no rule can still
//!    match it).
//!
//! 6. What the block decision does not need leaves the request path as a
//!    [`record::ExchangeRecord`], pushed without waiting to the [`queue`]
//!    (in process, or NATS JetStream). Workers ([`worker`]) compute the
//!    [`quality`] metrics and store them in the [`sink`]s, each result as
//!    one [`line`] of JSON; [`eval`] runs the same rules and metrics
//!    offline over a dataset.
//!
//! Around that path: [`admin`] (metrics, health, rules, reload),
//! [`telemetry`] (the Prometheus collectors), [`watch`] (reload on file
//! change and SIGHUP), [`text`] (word tokens and cosine similarity), and
//! [`commands`] (`rules check`, `rules test`, `scan`, as functions that write
//! to any output; the binary only parses arguments).

pub mod admin;
pub mod commands;
pub mod config;
pub mod eval;
pub mod exchange;
pub mod guard;
pub mod json;
pub mod line;
pub mod proxy;
pub mod quality;
pub mod queue;
pub mod record;
pub mod risk;
pub mod rules;
pub mod sink;
pub mod telemetry;
#[cfg(test)]
mod testing;
pub mod text;
pub mod watch;
pub mod worker;

//! fairgate's configuration file: raw serde structs with defaults for every
//! setting, then a validation step that reports every problem at once.
//!
//! Any setting can also come from an environment variable (see
//! [`ENV_PREFIX`]), which wins over the file.

use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::exchange::Dialect;
use crate::record::TextMode;
use crate::risk::RiskConfig;
use crate::rules::CompileOptions;

/// The whole configuration. Every field has a default, so an empty file (or
/// none) is a valid configuration: the proxy on 127.0.0.1:8080 in front of the
/// public OpenAI and Anthropic APIs, with the rules in `./rules`.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct Config {
    /// Where the proxy listens.
    pub listen: SocketAddr,
    pub admin: AdminConfig,
    /// Upstream APIs by name.
    pub upstreams: BTreeMap<String, UpstreamConfig>,
    /// Which upstream serves a request, first match wins.
    pub routes: Vec<RouteConfig>,
    pub guard: GuardConfig,
    pub rules: RulesConfig,
    pub risk: RiskConfig,
    pub records: RecordsConfig,
    pub queue: QueueConfig,
    pub quality: QualityConfig,
    pub sinks: SinksConfig,
    pub metrics: MetricsConfig,
    /// How long in-flight exchanges may take to finish on shutdown.
    pub shutdown_grace_ms: u64,
    /// How long a client connection may take to send a request's head,
    /// counted from the connection's start or the end of its last answer
    /// (so also how long it may sit idle between requests; an HTTP/2
    /// connection with no request open, between one and two times this);
    /// then it is closed. 0: no limit.
    pub client_header_timeout_ms: u64,
    /// How long a request's body may stop arriving, between two parts of
    /// it; then the request is answered 408 (one going upstream as it
    /// arrives is given up). 0: no limit.
    pub client_body_timeout_ms: u64,
    /// How long a write to a client may wait for the client to read
    /// (its socket's buffers full), or an HTTP/2 answer for its stream's
    /// window to open; then the connection is closed. 0: no limit.
    pub client_send_timeout_ms: u64,
    /// How many client connections the proxy port holds at once; more
    /// wait in the listen backlog until one closes. 0: no limit.
    pub max_connections: usize,
    /// Serving threads; 0 means one per processor core.
    pub threads: usize,
}

impl Default for Config {
    fn default() -> Self {
        Config {
            listen: SocketAddr::from(([127, 0, 0, 1], 8080)),
            admin: AdminConfig::default(),
            upstreams: BTreeMap::from([
                (
                    "openai".to_owned(),
                    UpstreamConfig::new("https://api.openai.com"),
                ),
                (
                    "anthropic".to_owned(),
                    UpstreamConfig::new("https://api.anthropic.com"),
                ),
            ]),
            routes: vec![
                RouteConfig::new("/v1/messages", "anthropic"),
                // The rest of Anthropic's API (models, files, skills), as
                // its SDKs call it.
                RouteConfig {
                    api: Some(Dialect::Anthropic),
                    ..RouteConfig::new("/", "anthropic")
                },
                RouteConfig::new("/", "openai"),
            ],
            guard: GuardConfig::default(),
            rules: RulesConfig::default(),
            risk: RiskConfig::default(),
            records: RecordsConfig::default(),
            queue: QueueConfig::default(),
            quality: QualityConfig::default(),
            sinks: SinksConfig::default(),
            metrics: MetricsConfig::default(),
            shutdown_grace_ms: 30_000,
            client_header_timeout_ms: 60_000,
            client_body_timeout_ms: 60_000,
            client_send_timeout_ms: 60_000,
            max_connections: 10_000,
            threads: 0,
        }
    }
}

/// What the Prometheus metrics tell apart.
#[derive(Debug, Clone, PartialEq, Default, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct MetricsConfig {
    /// The models that requests and blocks are counted by: a request's
    /// model is labelled with the longest of these its name starts with
    /// (`gpt-4o` counts `gpt-4o-2024-08-06`), any other as `other`. Model
    /// names come from clients, so only these reach the labels.
    pub models: Vec<String>,
}

/// The `model` label of a model the configuration does not list.
pub const OTHER_MODEL: &str = "other";

/// How many models [`MetricsConfig::models`] may list: each multiplies
/// the series of the request and block counters.
pub const MAX_MODEL_LABELS: usize = 50;

impl MetricsConfig {
    /// The `model` label of a request for `model`.
    pub fn model_label(&self, model: Option<&str>) -> &str {
        let Some(model) = model else {
            return OTHER_MODEL;
        };
        self.models
            .iter()
            .filter(|listed| model.starts_with(listed.as_str()))
            .max_by_key(|listed| listed.len())
            .map_or(OTHER_MODEL, String::as_str)
    }

    fn problems(&self) -> Vec<String> {
        let mut problems = Vec::new();
        if self.models.len() > MAX_MODEL_LABELS {
            problems.push(format!(
                "metrics.models: {} models, more than {MAX_MODEL_LABELS}",
                self.models.len()
            ));
        }
        for (i, model) in self.models.iter().enumerate() {
            if model.is_empty() || model == OTHER_MODEL {
                problems.push(format!(
                    "metrics.models[{i}]: {model:?} cannot be a model's label"
                ));
            } else if self.models[..i].contains(model) {
                problems.push(format!("metrics.models[{i}]: {model:?} is listed twice"));
            }
        }
        problems
    }
}

/// The admin listener: metrics, health, rules, reload.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct AdminConfig {
    pub listen: SocketAddr,
    /// The environment variable holding the bearer token that admin requests
    /// must carry. Required when `listen` is not a loopback address.
    pub token_env: Option<String>,
}

impl Default for AdminConfig {
    fn default() -> Self {
        AdminConfig {
            listen: SocketAddr::from(([127, 0, 0, 1], 9090)),
            token_env: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct UpstreamConfig {
    /// Base URL, such as `https://api.openai.com`.
    pub url: String,
    /// The environment variable holding this upstream's API key. Without one
    /// the client's own `Authorization` / `x-api-key` / `api-key` is
    /// forwarded; with one, the client's are dropped and this key sent.
    pub api_key_env: Option<String>,
    /// The header that carries the key: by default, `x-api-key` for a
    /// request to Anthropic's API, else `authorization` (a bearer token);
    /// `api-key` for Azure OpenAI's API keys.
    pub api_key_header: Option<KeyHeader>,
    pub connect_timeout_ms: u64,
    /// How long a connection to it may wait unused for its next request
    /// before it is closed (within a second after); 0: none is reused.
    pub idle_timeout_ms: u64,
    /// The longest the upstream may send nothing: before its answer's
    /// head, and between two parts of its body. Each wait, as the SDKs'
    /// own read timeout, not the whole exchange: a stream goes on as long
    /// as the upstream keeps sending.
    pub timeout_ms: u64,
}

impl UpstreamConfig {
    pub fn new(url: &str) -> Self {
        UpstreamConfig {
            url: url.to_owned(),
            ..UpstreamConfig::default()
        }
    }
}

impl Default for UpstreamConfig {
    fn default() -> Self {
        UpstreamConfig {
            url: String::new(),
            api_key_env: None,
            api_key_header: None,
            connect_timeout_ms: 5_000,
            idle_timeout_ms: 90_000,
            timeout_ms: 600_000,
        }
    }
}

/// The header an upstream's own key goes in.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum KeyHeader {
    /// `Authorization: Bearer <key>`.
    Authorization,
    /// `x-api-key: <key>`, as Anthropic's API takes it.
    XApiKey,
    /// `api-key: <key>`, as Azure OpenAI's API takes it.
    ApiKey,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct RouteConfig {
    pub path_prefix: String,
    /// Only requests whose `model` starts with this.
    #[serde(default)]
    pub model_prefix: Option<String>,
    /// Only requests to this API: `anthropic`, those that carry the
    /// `anthropic-version` header (Anthropic's API requires it of every
    /// request, and its SDKs send it) or go to the Messages API's path;
    /// `openai`, the others.
    #[serde(default)]
    pub api: Option<Dialect>,
    pub upstream: String,
    /// Overrides `guard.stream_mode` for this route.
    #[serde(default)]
    pub stream_mode: Option<StreamMode>,
}

impl RouteConfig {
    /// Every request whose path starts with `path_prefix` to `upstream`.
    pub fn new(path_prefix: &str, upstream: &str) -> Self {
        RouteConfig {
            path_prefix: path_prefix.to_owned(),
            model_prefix: None,
            api: None,
            upstream: upstream.to_owned(),
            stream_mode: None,
        }
    }
}

/// How a streamed response is guarded (see `guard::stream`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum StreamMode {
    Holdback,
    Buffer,
    Monitor,
}

/// What a blocked response looks like.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnBlock {
    /// 200 with `finish_reason: content_filter` / `stop_reason: refusal`.
    Refusal,
    /// The 400 error of a blocked prompt.
    Error,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct GuardConfig {
    pub stream_mode: StreamMode,
    pub on_block: OnBlock,
    /// Larger request bodies get 413, and a larger message from a
    /// WebSocket session's client closes the socket with 1009. The default
    /// is no less than what the APIs themselves take: 32 MB for
    /// Anthropic's Messages API, 50 MB of images in an OpenAI request.
    pub max_body_bytes: usize,
    /// Larger bodies of a message batch's creation (`POST
    /// /v1/messages/batches`, read whole so that each of its requests is
    /// scanned) get 413. The default is the Batch API's own limit.
    pub max_batch_bytes: usize,
    /// Largest non-streaming response body the guard reads, and largest
    /// message it takes from a WebSocket session's upstream (a larger one
    /// ends the session: the client's socket is closed with 1011).
    pub max_response_bytes: usize,
    /// Most bytes a streamed answer (an SSE body, a Responses API
    /// socket's response, or a Realtime session's) may send: the guard keeps its text to scan it
    /// whole. Past it the stream ends as one the upstream broke off does,
    /// with the API's error event. Streamed events weigh several times
    /// their text, so the default is above `max_response_bytes`.
    pub max_stream_bytes: usize,
    /// Tags that mark retrieved context inside a prompt text: with
    /// `[documents]`, the text between `<documents>` and `</documents>` in a
    /// user or system message is scanned as context, not prompt.
    pub context_tags: Vec<String>,
    /// What to do with sessions: a request to upgrade the connection (a
    /// WebSocket), and a Realtime API session set up to be held
    /// elsewhere.
    pub upgrades: Upgrades,
}

/// Sessions (WebSockets, and Realtime API sessions held elsewhere):
/// taken, taken only when the guard reads them, or refused. What is
/// refused is answered with 403 `upgrade_refused`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Upgrades {
    /// A Realtime API session and a Responses API socket guarded event by
    /// event; any other WebSocket relayed as a byte tunnel, as every other
    /// unguarded path is; a session held elsewhere set up with its
    /// configuration scanned.
    Tunnel,
    /// Only the sessions the guard reads: Realtime API sessions and
    /// Responses API sockets through fairgate. Other WebSockets, and the
    /// setups of sessions held elsewhere (a browser's key, a WebRTC or
    /// SIP call), are refused.
    Guarded,
    /// Every session refused, so that none goes around the rules.
    Refuse,
}

impl Default for GuardConfig {
    fn default() -> Self {
        GuardConfig {
            stream_mode: StreamMode::Holdback,
            on_block: OnBlock::Refusal,
            max_body_bytes: 50 << 20,
            max_batch_bytes: 256 << 20,
            max_response_bytes: 50 << 20,
            max_stream_bytes: 256 << 20,
            context_tags: Vec::new(),
            upgrades: Upgrades::Tunnel,
        }
    }
}

/// What exchange records keep.
#[derive(Debug, Clone, Default, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RecordsConfig {
    /// `full` (texts after redaction) or `hashes` (only their SHA-256).
    pub texts: TextMode,
}

/// The side queue between the proxy and the workers.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QueueConfig {
    pub kind: QueueKind,
    /// Records the in-process channel holds before `on_full` applies.
    pub capacity: usize,
    pub on_full: OnFull,
    /// Where records spill when the queue is full or NATS is unreachable.
    pub spill_dir: PathBuf,
    /// In-process workers (memory queue) or concurrent consumers
    /// (`fairgate worker`). With 0, the proxy runs no workers: records
    /// wait in the queue and then spill.
    pub workers: usize,
    /// How often spilled records are tried again.
    pub replay_interval_ms: u64,
    pub nats: NatsConfig,
}

impl Default for QueueConfig {
    fn default() -> Self {
        QueueConfig {
            kind: QueueKind::Memory,
            capacity: 2048,
            on_full: OnFull::Spill,
            spill_dir: PathBuf::from("data/spill"),
            workers: 2,
            replay_interval_ms: 500,
            nats: NatsConfig::default(),
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum QueueKind {
    /// A bounded channel inside the proxy, with in-process workers.
    Memory,
    /// A NATS JetStream stream, consumed by `fairgate worker` processes.
    Nats,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum OnFull {
    /// Append to the spill file; replayed when the queue drains.
    Spill,
    /// Drop the record and count it.
    Drop,
}

/// NATS JetStream settings of the queue.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct NatsConfig {
    pub url: String,
    /// The stream, created if missing.
    pub stream: String,
    pub subject: String,
    /// The durable pull consumer the workers share.
    pub consumer: String,
    /// How long the stream keeps records, in seconds (0: no limit).
    pub max_age_secs: u64,
    /// How long a worker has to acknowledge a record before it is
    /// delivered again.
    pub ack_wait_ms: u64,
}

impl Default for NatsConfig {
    fn default() -> Self {
        NatsConfig {
            url: "nats://127.0.0.1:4222".into(),
            stream: "FAIRGATE".into(),
            subject: "fairgate.records".into(),
            consumer: "fairgate-workers".into(),
            max_age_secs: 7 * 24 * 3600,
            ack_wait_ms: 30_000,
        }
    }
}

/// The quality metrics' settings.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct QualityConfig {
    /// The emotion table written by `fairgate lexicon import`.
    pub lexicon: PathBuf,
    pub politeness_markers: Vec<String>,
}

impl Default for QualityConfig {
    fn default() -> Self {
        QualityConfig {
            lexicon: PathBuf::from("data/emotions.json"),
            politeness_markers: crate::quality::POLITENESS_MARKERS
                .iter()
                .map(|m| (*m).to_owned())
                .collect(),
        }
    }
}

/// Where results go; any combination.
#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct SinksConfig {
    pub jsonl: Option<JsonlSinkConfig>,
    pub postgres: Option<PostgresSinkConfig>,
    pub nats: Option<NatsSinkConfig>,
}

impl Default for SinksConfig {
    fn default() -> Self {
        SinksConfig {
            jsonl: Some(JsonlSinkConfig {
                dir: PathBuf::from("data/results"),
            }),
            postgres: None,
            nats: None,
        }
    }
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct JsonlSinkConfig {
    /// One file per day, `results-YYYY-MM-DD.jsonl`.
    pub dir: PathBuf,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct PostgresSinkConfig {
    /// A libpq-style connection string, such as
    /// `host=127.0.0.1 user=postgres dbname=fairgate`.
    pub url: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct NatsSinkConfig {
    /// The NATS server (the queue's when not given).
    #[serde(default)]
    pub url: Option<String>,
    pub subject: String,
}

#[derive(Debug, Clone, PartialEq, Deserialize, Serialize)]
#[serde(deny_unknown_fields, default)]
pub struct RulesConfig {
    /// The directory of rule packs.
    pub dir: PathBuf,
    /// The length assumed for regexes with unbounded matches, in bytes (see
    /// [`crate::rules::RuleSet::match_limits`]).
    pub unbounded_match_cap: usize,
    /// Reload when a rule file changes.
    pub watch: bool,
    /// Changes closer together than this reload once.
    pub debounce_ms: u64,
}

impl Default for RulesConfig {
    fn default() -> Self {
        RulesConfig {
            dir: PathBuf::from("rules"),
            unbounded_match_cap: CompileOptions::default().unbounded_match_cap,
            watch: true,
            debounce_ms: 200,
        }
    }
}

impl RulesConfig {
    pub fn compile_options(&self) -> CompileOptions {
        CompileOptions {
            unbounded_match_cap: self.unbounded_match_cap,
        }
    }
}

/// The text of the configuration file at `path`.
fn read(path: &Path) -> Result<String, ConfigError> {
    std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
        path: path.to_owned(),
        source,
    })
}

/// Sets the setting that the variable `name` (see [`ENV_PREFIX`]) names in
/// `tree`, a whole configuration as YAML, to `value` read as YAML.
fn set(tree: &mut serde_yaml_ng::Value, name: &str, value: &str) -> Result<(), String> {
    use serde_yaml_ng::{Mapping, Value};
    let path = name[ENV_PREFIX.len()..].to_lowercase();
    let keys: Vec<&str> = path.split("__").collect();
    if keys.iter().any(|key| key.is_empty()) {
        return Err("names no setting (keys are joined by two underscores)".into());
    }
    let mut at = tree;
    for (depth, key) in keys.iter().enumerate() {
        if at.is_null() {
            *at = Value::Mapping(Mapping::new());
        }
        let Value::Mapping(section) = at else {
            return Err(format!("{} is not a section", keys[..depth].join(".")));
        };
        at = section.entry(Value::from(*key)).or_insert(Value::Null);
    }
    // A value that is not YAML (`a: b: c`) is the text it is.
    *at = serde_yaml_ng::from_str(value).unwrap_or_else(|_| Value::from(value));
    Ok(())
}

/// A configuration file that could not be used.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("{path}: cannot read: {source}")]
    Read {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {message}")]
    Parse { path: PathBuf, message: String },
    #[error("{path}: invalid configuration:\n  {}", .problems.join("\n  "))]
    Invalid {
        path: PathBuf,
        problems: Vec<String>,
    },
}

/// The prefix of the environment variables that set any setting: the
/// setting's path follows, its keys joined by `__`, in either case
/// (`FAIRGATE__GUARD__MAX_BODY_BYTES=1048576`,
/// `FAIRGATE__UPSTREAMS__OPENAI__TIMEOUT_MS=120000`). The value is read as
/// YAML: `true`, `0.5`, `[a, b]` and `{url: ...}` are what they say in the
/// file. Two underscores after `FAIRGATE` keep these apart from the
/// variables of the `serve` flags (`FAIRGATE_LISTEN`) and from any other
/// variable of the deployment's (such as an API key's).
pub const ENV_PREFIX: &str = "FAIRGATE__";

impl Config {
    /// The configuration of the file at `path` (the defaults without one),
    /// with the settings of the [`ENV_PREFIX`] variables among `env` over
    /// it, validated. A variable that names no setting, or whose value does
    /// not fit it, is named in the error.
    pub fn from_sources(
        path: Option<&Path>,
        env: impl IntoIterator<Item = (String, String)>,
    ) -> Result<Config, ConfigError> {
        let mut settings: Vec<(String, String)> = env
            .into_iter()
            .filter(|(name, _)| name.starts_with(ENV_PREFIX))
            .collect();
        settings.sort();
        let source = path.map_or_else(|| PathBuf::from("environment"), Path::to_owned);
        // The file's own mistakes come with their lines.
        let file = match path {
            Some(path) => Config::parse_only(path, &read(path)?)?,
            None => Config::default(),
        };
        if settings.is_empty() {
            return file.validated(source);
        }
        let parse_error = |message: String| ConfigError::Parse {
            path: source.clone(),
            message,
        };
        // Every setting, so that a variable changes only the one it names.
        let file = serde_yaml_ng::to_value(&file).map_err(|e| parse_error(e.to_string()))?;
        let with = |chosen: &[(String, String)]| -> Result<Config, String> {
            let mut tree = file.clone();
            for (name, value) in chosen {
                set(&mut tree, name, value)?;
            }
            serde_yaml_ng::from_value(tree).map_err(|e| e.to_string())
        };
        let config = with(&settings).map_err(|combined| {
            // Which variables are wrong, each on its own.
            let wrong: Vec<String> = settings
                .iter()
                .filter_map(|setting| {
                    let error = with(std::slice::from_ref(setting)).err()?;
                    Some(format!("{}: {error}", setting.0))
                })
                .collect();
            match wrong.is_empty() {
                true => parse_error(combined),
                false => parse_error(wrong.join("; ")),
            }
        })?;
        config.validated(source)
    }

    /// Parses and validates the text of a configuration file; `path` is only
    /// used in messages.
    pub fn parse(path: &Path, text: &str) -> Result<Config, ConfigError> {
        Config::parse_only(path, text)?.validated(path.to_owned())
    }

    /// The configuration, if its values have no problem; else every
    /// problem, for the source at `path`.
    fn validated(self, path: PathBuf) -> Result<Config, ConfigError> {
        let problems = self.problems();
        match problems.is_empty() {
            true => Ok(self),
            false => Err(ConfigError::Invalid { path, problems }),
        }
    }

    /// The text of a configuration file parsed, not validated.
    fn parse_only(path: &Path, text: &str) -> Result<Config, ConfigError> {
        if text.trim().is_empty() {
            return Ok(Config::default());
        }
        serde_yaml_ng::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.to_owned(),
            message: e.to_string(),
        })
    }

    /// Every problem with the values.
    pub fn problems(&self) -> Vec<String> {
        let mut problems = self.risk.problems();
        if self.rules.unbounded_match_cap == 0 {
            problems.push("rules.unbounded_match_cap: must be at least 1".into());
        }
        for (name, upstream) in &self.upstreams {
            let url = upstream.url.parse::<http::Uri>().ok();
            let plain = url.as_ref().is_some_and(|url| {
                matches!(url.scheme_str(), Some("http" | "https"))
                    && url.host().is_some_and(|host| !host.is_empty())
                    && url.query().is_none()
            });
            if !plain {
                problems.push(format!(
                    "upstreams.{name}.url: {:?} is not an http(s) URL with a host and no query",
                    upstream.url
                ));
            }
        }
        for (i, route) in self.routes.iter().enumerate() {
            if !self.upstreams.contains_key(&route.upstream) {
                problems.push(format!(
                    "routes[{i}].upstream: no upstream named {:?}",
                    route.upstream
                ));
            }
            if !route.path_prefix.starts_with('/') {
                problems.push(format!(
                    "routes[{i}].path_prefix: {:?} must start with /",
                    route.path_prefix
                ));
            }
        }
        if !self.admin.listen.ip().is_loopback() && self.admin.token_env.is_none() {
            problems.push(format!(
                "admin.token_env: the admin listener {} is not on loopback, so it needs a bearer token",
                self.admin.listen
            ));
        }
        if self.queue.capacity == 0 {
            problems.push("queue.capacity: must be at least 1".into());
        }
        if let Some(pg) = &self.sinks.postgres
            && pg.url.parse::<tokio_postgres::Config>().is_err()
        {
            problems.push(format!(
                "sinks.postgres.url: {:?} is not a PostgreSQL connection string",
                pg.url
            ));
        }
        if self.guard.max_body_bytes == 0 {
            problems.push("guard.max_body_bytes: must be at least 1".into());
        }
        if self.guard.max_batch_bytes == 0 {
            problems.push("guard.max_batch_bytes: must be at least 1".into());
        }
        if self.guard.max_response_bytes == 0 {
            problems.push("guard.max_response_bytes: must be at least 1".into());
        }
        if self.guard.max_stream_bytes == 0 {
            problems.push("guard.max_stream_bytes: must be at least 1".into());
        }
        problems.extend(self.metrics.problems());
        problems
    }

    /// [`Config::client_header_timeout_ms`], `None` for no limit.
    pub fn client_header_timeout(&self) -> Option<std::time::Duration> {
        millis(self.client_header_timeout_ms)
    }

    /// [`Config::client_body_timeout_ms`], `None` for no limit.
    pub fn client_body_timeout(&self) -> Option<std::time::Duration> {
        millis(self.client_body_timeout_ms)
    }

    /// [`Config::client_send_timeout_ms`], `None` for no limit.
    pub fn client_send_timeout(&self) -> Option<std::time::Duration> {
        millis(self.client_send_timeout_ms)
    }

    /// The route for a request to `api`, by its path and model.
    pub fn route(&self, api: Dialect, path: &str, model: Option<&str>) -> Option<&RouteConfig> {
        self.routes.iter().find(|r| {
            path.starts_with(&r.path_prefix)
                && r.api.is_none_or(|only| only == api)
                && r.model_prefix
                    .as_deref()
                    .is_none_or(|prefix| model.is_some_and(|m| m.starts_with(prefix)))
        })
    }
}

/// A limit in milliseconds, where 0 means none.
fn millis(ms: u64) -> Option<std::time::Duration> {
    (ms > 0).then(|| std::time::Duration::from_millis(ms))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn empty_file_gives_defaults() {
        assert_eq!(
            Config::parse(Path::new("f"), "").unwrap(),
            Config::default()
        );
    }

    #[test]
    fn unknown_keys_and_bad_values_are_rejected() {
        let e = Config::parse(Path::new("f.yaml"), "risk:\n  treshold: 1\n").unwrap_err();
        assert!(e.to_string().contains("unknown field `treshold`"), "{e}");
        let e = Config::parse(
            Path::new("f.yaml"),
            "risk:\n  block_threshold: 3\n  weights: {prompt: 2}\n",
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(
            text.contains("risk.block_threshold") && text.contains("risk.weights.prompt"),
            "{text}"
        );
    }

    #[test]
    fn a_route_may_take_only_the_requests_of_one_api() {
        let text = "routes:\n  - {path_prefix: /, api: anthropic, upstream: anthropic}\n  - {path_prefix: /v1/, api: openai, upstream: openai}\n";
        let parsed = Config::parse(Path::new("f.yaml"), text).unwrap();
        let upstream = |api, path| parsed.route(api, path, None).map(|r| r.upstream.as_str());
        assert_eq!(
            upstream(Dialect::Anthropic, "/v1/models"),
            Some("anthropic")
        );
        assert_eq!(upstream(Dialect::OpenAi, "/v1/models"), Some("openai"));
        assert_eq!(upstream(Dialect::OpenAi, "/models"), None);
        // The defaults: Anthropic's API to its upstream, the rest to OpenAI's.
        let defaults = Config::default();
        let upstream = |api, path| defaults.route(api, path, None).map(|r| r.upstream.as_str());
        assert_eq!(upstream(Dialect::Anthropic, "/v1/files"), Some("anthropic"));
        assert_eq!(upstream(Dialect::OpenAi, "/v1/files"), Some("openai"));
        assert_eq!(upstream(Dialect::OpenAi, "/v1/messages"), Some("anthropic"));
        let e = Config::parse(
            Path::new("f.yaml"),
            "routes:\n  - {path_prefix: /, api: gemini, upstream: openai}\n",
        )
        .unwrap_err();
        assert!(e.to_string().contains("unknown variant `gemini`"), "{e}");
    }

    #[test]
    fn an_upstream_key_header_is_one_the_apis_take() {
        let text = "upstreams:\n  openai:\n    url: \"https://x.openai.azure.com\"\n    api_key_header: api-key\n  anthropic:\n    url: \"https://api.anthropic.com\"\n";
        let parsed = Config::parse(Path::new("f.yaml"), text).unwrap();
        assert_eq!(
            parsed.upstreams["openai"].api_key_header,
            Some(KeyHeader::ApiKey)
        );
        let e = Config::parse(Path::new("f.yaml"), &text.replace("api-key", "bearer")).unwrap_err();
        let e = e.to_string();
        assert!(
            e.contains("upstreams.openai.api_key_header: unknown variant `bearer`"),
            "{e}"
        );
    }

    #[test]
    fn an_upstream_url_needs_a_scheme_a_host_and_no_query() {
        for url in [
            "api.openai.com",
            "ftp://host",
            "https://",
            "https://host/v1?key=1",
        ] {
            let text = format!("upstreams:\n  openai:\n    url: {url:?}\n");
            let e = Config::parse(Path::new("f.yaml"), &text).unwrap_err();
            assert!(e.to_string().contains("upstreams.openai.url"), "{url}: {e}");
        }
        let text = "upstreams:\n  openai:\n    url: \"http://127.0.0.1:9/base/\"\n  anthropic:\n    url: \"https://api.anthropic.com\"\n";
        let parsed = Config::parse(Path::new("f.yaml"), text).unwrap();
        assert_eq!(parsed.upstreams["openai"].url, "http://127.0.0.1:9/base/");
    }
}

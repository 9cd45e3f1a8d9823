//! The `fairgate` command line: parses arguments and calls into the library.

#[global_allocator]
static GLOBAL: mimalloc::MiMalloc = mimalloc::MiMalloc;

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use fairgate::commands::{self, ScanRequest};
use fairgate::config::Config;
use fairgate::rules::Scope;

#[derive(Parser)]
#[command(
    name = "fairgate",
    version,
    about = "Inline guardrail proxy for LLM APIs"
)]
struct Cli {
    /// Configuration file (YAML); every setting has a default.
    #[arg(long, global = true, env = "FAIRGATE_CONFIG")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run the proxy (and its admin listener) until SIGTERM or Ctrl-C.
    Serve {
        #[command(flatten)]
        overrides: Overrides,
    },
    /// Validate a configuration file and print the effective configuration.
    Config {
        #[command(subcommand)]
        command: ConfigCommand,
    },
    /// Check or test rule packs.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
    },
    /// Run side-queue workers only: consume the NATS JetStream stream and
    /// store results, until SIGTERM or Ctrl-C.
    Worker {
        /// Serve GET /metrics (Prometheus) and /healthz here; a non-loopback
        /// address needs admin.token_env.
        #[arg(long, env = "FAIRGATE_WORKER_METRICS_LISTEN")]
        metrics_listen: Option<std::net::SocketAddr>,
    },
    /// Import the NRC emotion lexicon (it is not shipped with fairgate).
    Lexicon {
        #[command(subcommand)]
        command: LexiconCommand,
    },
    /// Run the rules and quality metrics over a JSON-lines dataset.
    Eval {
        /// Rows of {input, output, context?, expected?, ground_truth?, user_action?}.
        dataset: PathBuf,
        /// Rule directory [default: the configuration's, else ./rules].
        #[arg(long)]
        rules: Option<PathBuf>,
        /// Baseline rule directory: list the rows whose verdict differs.
        #[arg(long)]
        compare: Option<PathBuf>,
        /// The emotion table [default: the configuration's quality.lexicon].
        #[arg(long)]
        lexicon: Option<PathBuf>,
        /// Write one JSON line of results per row here.
        #[arg(long)]
        out: Option<PathBuf>,
    },
    /// Scan a text: print its hits, risk scores and verdict.
    Scan {
        /// Where the text comes from in an exchange.
        #[arg(long, value_enum)]
        scope: ScopeArg,
        /// Rule directory [default: the configuration's, else ./rules].
        #[arg(long)]
        rules: Option<PathBuf>,
        /// The user's question, to score how relevant a context text is.
        #[arg(long)]
        question: Option<String>,
        /// Print one JSON object instead of a table.
        #[arg(long)]
        json: bool,
        /// The text to scan; `-` or nothing reads standard input.
        file: Option<PathBuf>,
    },
}

/// The essentials, settable without a configuration file.
#[derive(clap::Args, Clone, Default)]
struct Overrides {
    /// Proxy listen address.
    #[arg(long, env = "FAIRGATE_LISTEN")]
    listen: Option<std::net::SocketAddr>,
    /// Admin listen address (/metrics, /healthz, /admin/*).
    #[arg(long, env = "FAIRGATE_ADMIN_LISTEN")]
    admin_listen: Option<std::net::SocketAddr>,
    /// Rule directory.
    #[arg(long, env = "FAIRGATE_RULES")]
    rules: Option<PathBuf>,
    /// Base URL of the OpenAI-compatible upstream.
    #[arg(long, env = "FAIRGATE_UPSTREAM_OPENAI")]
    upstream_openai: Option<String>,
    /// Base URL of the Anthropic upstream.
    #[arg(long, env = "FAIRGATE_UPSTREAM_ANTHROPIC")]
    upstream_anthropic: Option<String>,
    /// Serving threads (0: one per core).
    #[arg(long, env = "FAIRGATE_THREADS")]
    threads: Option<usize>,
}

impl Overrides {
    fn apply(&self, config: &mut Config) {
        if let Some(listen) = self.listen {
            config.listen = listen;
        }
        if let Some(admin) = self.admin_listen {
            config.admin.listen = admin;
        }
        if let Some(rules) = &self.rules {
            config.rules.dir = rules.clone();
        }
        if let Some(threads) = self.threads {
            config.threads = threads;
        }
        for (name, url) in [
            ("openai", &self.upstream_openai),
            ("anthropic", &self.upstream_anthropic),
        ] {
            if let Some(url) = url {
                config.upstreams.entry(name.to_owned()).or_default().url = url.clone();
            }
        }
    }
}

#[derive(Subcommand)]
enum ConfigCommand {
    /// Load and validate the configuration; print it with every default.
    Check {
        #[command(flatten)]
        overrides: Overrides,
    },
}

#[derive(Subcommand)]
enum LexiconCommand {
    /// Read the lexicon from the nrclex wheel (`pip download nrclex==4.1.0
    /// --no-deps`), its nrc_en.json, or NRC's word<TAB>emotion<TAB>0|1 file,
    /// and write fairgate's emotion table.
    Import {
        path: PathBuf,
        /// Where to write it [default: the configuration's quality.lexicon].
        #[arg(long)]
        out: Option<PathBuf>,
    },
}

#[derive(Subcommand)]
enum RulesCommand {
    /// Load and compile the packs; list them, or every error.
    Check {
        /// Rule directory [default: the configuration's, else ./rules].
        dir: Option<PathBuf>,
    },
    /// Run every rule's block and allow examples.
    Test {
        /// Rule directory [default: the configuration's, else ./rules].
        dir: Option<PathBuf>,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum ScopeArg {
    Prompt,
    Response,
    Context,
}

impl From<ScopeArg> for Scope {
    fn from(s: ScopeArg) -> Scope {
        match s {
            ScopeArg::Prompt => Scope::Prompt,
            ScopeArg::Response => Scope::Response,
            ScopeArg::Context => Scope::Context,
        }
    }
}

/// Runs the proxy until SIGTERM or Ctrl-C, then drains.
fn serve(config: Config) -> anyhow::Result<()> {
    init_logging();
    let state = std::sync::Arc::new(fairgate::proxy::State::new(config)?);
    if let Err(reason) = fairgate::quality::lexicon::Lexicon::load(&state.config.quality.lexicon) {
        tracing::warn!(%reason, "no emotion lexicon: emotional entropy and Spearman will have no score (see `fairgate lexicon import`)");
    }
    let pipeline = state.start_pipeline()?;
    let listener = fairgate::proxy::bind_shared(state.config.listen)
        .map_err(|e| anyhow::anyhow!("listen {}: {e}", state.config.listen))?;
    let admin = std::net::TcpListener::bind(state.config.admin.listen)?;
    let threads = match state.config.threads {
        0 => std::thread::available_parallelism().map_or(1, |n| n.get()),
        n => n,
    };
    let (stop, stopped) = tokio::sync::watch::channel(false);
    // Signals, the rule watcher and reloads run on a small runtime of their
    // own thread. The main thread serves: it compiled the rules, and the
    // allocator keeps the memory that compilation freed in this thread's
    // heap, where serving reuses it rather than taking more.
    let control = {
        let state = state.clone();
        std::thread::Builder::new()
            .name("fairgate-control".into())
            .spawn(move || -> anyhow::Result<()> {
                let control = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()?;
                control.block_on(async {
                    let _watcher = if state.config.rules.watch {
                        Some(fairgate::watch::watch_rules(state.clone())?)
                    } else {
                        None
                    };
                    #[cfg(unix)]
                    fairgate::watch::reload_on_sighup(state.clone())?;
                    tracing::info!(
                        listen = %state.config.listen,
                        admin = %state.config.admin.listen,
                        threads,
                        rules = state.rules.snapshot().rules().len(),
                        "fairgate serving"
                    );
                    shutdown_signal().await;
                    let _ = stop.send(true);
                    anyhow::Ok(())
                })
            })?
    };
    // Returns once `stop` is sent, or dropped by a control thread that failed.
    let served = fairgate::proxy::serve_on_threads(state, listener, admin, threads, stopped);
    // Every exchange has ended: flush the side queue.
    pipeline.stop();
    tracing::info!("side queue flushed");
    served?;
    control
        .join()
        .map_err(|_| anyhow::anyhow!("the control thread panicked"))?
}

fn init_logging() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| "info,hyper=warn".into()),
        )
        .init();
}

/// `fairgate worker`: NATS JetStream consumers until SIGTERM or Ctrl-C.
fn worker(config: Config, metrics_listen: Option<std::net::SocketAddr>) -> anyhow::Result<()> {
    init_logging();
    let token = match &config.admin.token_env {
        Some(var) => Some(std::env::var(var).map_err(|_| {
            anyhow::anyhow!("admin.token_env: environment variable {var} is not set")
        })?),
        None => None,
    };
    if let Some(addr) = metrics_listen
        && !addr.ip().is_loopback()
        && token.is_none()
    {
        anyhow::bail!(
            "--metrics-listen {addr} is not on loopback, so admin.token_env must name a bearer token"
        );
    }
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(config.queue.workers.clamp(1, 8))
        .enable_all()
        .build()?;
    runtime.block_on(async {
        let telemetry = std::sync::Arc::new(fairgate::telemetry::Metrics::new());
        let (stop, stopped) = tokio::sync::watch::channel(false);
        if let Some(addr) = metrics_listen {
            let listener = tokio::net::TcpListener::bind(addr).await?;
            tokio::spawn(fairgate::admin::serve_worker_metrics(
                listener,
                telemetry.clone(),
                token,
                stopped.clone(),
            ));
        }
        let mut consumers = tokio::spawn({
            let config = config.clone();
            async move { fairgate::queue::nats::run_worker(&config, telemetry, stopped).await }
        });
        tokio::select! {
            () = shutdown_signal() => {
                let _ = stop.send(true);
                consumers.await?
            }
            result = &mut consumers => result?,
        }
    })
}

async fn shutdown_signal() {
    #[cfg(unix)]
    {
        let mut term =
            match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                Ok(term) => term,
                Err(_) => {
                    let _ = tokio::signal::ctrl_c().await;
                    return;
                }
            };
        tokio::select! {
            _ = tokio::signal::ctrl_c() => {}
            _ = term.recv() => {}
        }
    }
    #[cfg(not(unix))]
    let _ = tokio::signal::ctrl_c().await;
    tracing::info!("shutting down: finishing in-flight exchanges");
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(true) => ExitCode::SUCCESS,
        Ok(false) => ExitCode::FAILURE,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}

fn run(cli: Cli) -> anyhow::Result<bool> {
    // Not `std::env::vars`, which panics on a variable that is not UTF-8.
    let env = std::env::vars_os().filter_map(|(name, value)| {
        Some((
            name.into_string().ok()?,
            value.to_string_lossy().into_owned(),
        ))
    });
    let config = Config::from_sources(cli.config.as_deref(), env)?;
    // The proxy logs to stdout from many threads: it must not run while this
    // thread holds the lock, so it is started before the lock is taken.
    if let Command::Worker { metrics_listen } = &cli.command {
        worker(config, *metrics_listen)?;
        return Ok(true);
    }
    if let Command::Serve { overrides } = &cli.command {
        let mut config = config.clone();
        overrides.apply(&mut config);
        let problems = config.problems();
        if !problems.is_empty() {
            anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "));
        }
        serve(config)?;
        return Ok(true);
    }
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let dir = |d: &Option<PathBuf>| d.clone().unwrap_or_else(|| config.rules.dir.clone());
    let ok = match &cli.command {
        Command::Serve { .. } | Command::Worker { .. } => true,
        Command::Lexicon {
            command: LexiconCommand::Import { path, out: to },
        } => {
            let to = to.clone().unwrap_or_else(|| config.quality.lexicon.clone());
            let lexicon = fairgate::quality::lexicon::Lexicon::import(path)
                .map_err(|e| anyhow::anyhow!(e))?;
            if let Some(parent) = to.parent().filter(|p| !p.as_os_str().is_empty()) {
                std::fs::create_dir_all(parent)?;
            }
            std::fs::write(&to, lexicon.to_json())?;
            writeln!(out, "wrote {} words to {}", lexicon.len(), to.display())?;
            true
        }
        Command::Eval {
            dataset,
            rules,
            compare,
            lexicon,
            out: to,
        } => {
            let request = fairgate::eval::EvalRequest {
                dataset,
                rules_dir: &dir(rules),
                compare: compare.as_deref(),
                lexicon: lexicon.as_deref(),
                out: to.as_deref(),
            };
            fairgate::eval::run(&config, &request, &mut out)?
        }
        Command::Config {
            command: ConfigCommand::Check { overrides },
        } => {
            let mut config = config.clone();
            overrides.apply(&mut config);
            let problems = config.problems();
            if !problems.is_empty() {
                anyhow::bail!("invalid configuration:\n  {}", problems.join("\n  "));
            }
            write!(out, "{}", serde_yaml_ng::to_string(&config)?)?;
            true
        }
        Command::Rules {
            command: RulesCommand::Check { dir: d },
        } => commands::rules_check(&config, &dir(d), &mut out)?,
        Command::Rules {
            command: RulesCommand::Test { dir: d },
        } => commands::rules_test(&config, &dir(d), &mut out)?,
        Command::Scan {
            scope,
            rules,
            question,
            json,
            file,
        } => {
            let request = ScanRequest {
                scope: (*scope).into(),
                rules_dir: &dir(rules),
                question: question.as_deref(),
                input: file.as_deref().filter(|f| *f != Path::new("-")),
                json: *json,
            };
            commands::scan(&config, &request, &mut out)?;
            true
        }
    };
    out.flush()?;
    Ok(ok)
}

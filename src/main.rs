//! The `fairgate` command line: parses arguments and calls into the library.

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
    /// Check or test rule packs.
    Rules {
        #[command(subcommand)]
        command: RulesCommand,
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
    let config = match &cli.config {
        Some(path) => Config::load(path)?,
        None => Config::default(),
    };
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    let dir = |d: &Option<PathBuf>| d.clone().unwrap_or_else(|| config.rules.dir.clone());
    let ok = match &cli.command {
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

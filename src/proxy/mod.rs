//! The reverse proxy: accept loop, routing, the upstream client, and the path
//! of one exchange through the guard.
//!
//! `POST /v1/chat/completions`, `/v1/completions`, `/v1/responses` (OpenAI)
//! and `/v1/messages` (Anthropic) are guarded: the request is read, scanned
//! (prompt and context), redacted or refused, forwarded, and the response is
//! scanned before it is released (streams through [`crate::guard::stream`]).
//! `GET`s of answers the API stored are scanned as responses (`stored`).
//! Every other path and method is passed through, bodies streamed both ways.

mod batch;
mod held;
mod lines;
mod media;
mod parts;
mod realtime;
pub mod replay;
pub mod respond;
mod responses_socket;
mod stall;
mod stored;
mod tunnel;
pub mod upstream;

use std::collections::HashMap;
use std::convert::Infallible;
use std::future::Future;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::task::Poll;
use std::time::{Duration, Instant, SystemTime};

use bytes::{Bytes, BytesMut};
use futures_util::StreamExt;
use http::{HeaderMap, HeaderName, HeaderValue, Method, Request, Response, StatusCode, header};
use http_body::Frame;
use http_body_util::combinators::UnsyncBoxBody;
use http_body_util::{BodyExt, Either, Limited, StreamBody};
use hyper::body::Incoming;
use hyper::service::service_fn;
use hyper_util::rt::{TokioExecutor, TokioIo, TokioTimer};
use hyper_util::server::conn::auto;
use tokio::net::TcpListener;

use crate::config::{Config, KeyHeader, OnBlock, RouteConfig, StreamMode};
use crate::exchange::{self, Batch, Dialect, Endpoint, RequestBody, ResponseBody, Stored};
use crate::guard::stream::{StreamOutcome, StreamSetup, guard_body};
use crate::guard::{self, block_message, rule_ids};
use crate::json::ReadError;
use crate::queue::Queue;
use crate::queue::pipeline::Pipeline;
use crate::record::{
    ClientMeta, ExchangeRecord, FeedbackRecord, FeedbackRequest, QueueItem, StreamEnd, Texts,
    Usage, now_ms, record_hits,
};
use crate::risk::{self, Decision, Verdict};
use crate::rules::store::RuleStore;
use crate::rules::{Hit, RuleSet, Scope};
use crate::telemetry::{BlockLog, Blocked, Metrics};
use respond::Failure;
use upstream::{UpstreamBody, UpstreamClient};

/// The error type of response bodies.
pub type BoxError = Box<dyn std::error::Error + Send + Sync>;
/// Every response body the proxy sends.
pub type ProxyBody = UnsyncBoxBody<Bytes, BoxError>;

/// Everything the proxy shares between requests.
pub struct State {
    pub config: Config,
    pub rules: RuleStore,
    pub metrics: Arc<Metrics>,
    /// The side queue every exchange record goes to.
    pub queue: Arc<Queue>,
    /// API keys of the upstreams that have one configured.
    keys: HashMap<String, HeaderValue>,
    /// The bearer token the admin listener requires, if any.
    pub admin_token: Option<String>,
    /// The last blocked exchanges, for the admin dashboard.
    pub blocked: BlockLog,
    /// Upgraded connections open now, which a shutdown waits for too.
    tunnels: tokio::sync::watch::Sender<usize>,
    /// The connections the proxy port may still take
    /// (`max_connections`), shared by the serving threads.
    connections: Option<Arc<tokio::sync::Semaphore>>,
    /// Batch inputs being uploaded in parts.
    uploads: parts::Uploads,
    next_id: AtomicU64,
}

impl State {
    /// Builds the shared state: loads the rules, reads the keys named in the
    /// configuration from the environment, and checks that each upstream's
    /// client can be made (each serving thread makes its own on first use:
    /// [`UpstreamClient::of_this_thread`]).
    pub fn new(config: Config) -> anyhow::Result<State> {
        let rules = RuleStore::load(config.rules.dir.clone(), config.rules.compile_options())?;
        let metrics = Arc::new(Metrics::new());
        let queue = Arc::new(Queue::new(
            &config.queue,
            metrics.queue_records.clone(),
            metrics.queue_depth.clone(),
        ));
        let snapshot = rules.snapshot();
        metrics.rules_swapped(snapshot.version(), snapshot.rules().len());
        let mut keys = HashMap::new();
        for (name, upstream) in &config.upstreams {
            // Built once here so that a bad setting fails at start.
            if UpstreamClient::new(upstream).is_none() {
                anyhow::bail!(
                    "upstreams.{name}.url: {:?} is not an http(s) URL with a host",
                    upstream.url
                );
            }
            if let Some(var) = &upstream.api_key_env {
                let key = std::env::var(var).map_err(|_| {
                    anyhow::anyhow!(
                        "upstreams.{name}.api_key_env: environment variable {var} is not set"
                    )
                })?;
                keys.insert(name.clone(), HeaderValue::from_str(&key)?);
            }
        }
        let admin_token = match &config.admin.token_env {
            Some(var) => Some(std::env::var(var).map_err(|_| {
                anyhow::anyhow!("admin.token_env: environment variable {var} is not set")
            })?),
            None => None,
        };
        // The dashboard's list of blocks, as the results left it.
        let blocked = BlockLog::default();
        if let Some(jsonl) = &config.sinks.jsonl {
            match blocked.restore(&jsonl.dir) {
                Ok(0) => {}
                Ok(blocks) => {
                    tracing::info!(blocks, "blocked exchanges read back from the results")
                }
                Err(error) => {
                    tracing::warn!(%error, "blocked exchanges could not be read back from the results")
                }
            }
        }
        let limit = config.max_connections;
        let connections = (limit > 0).then(|| Arc::new(tokio::sync::Semaphore::new(limit)));
        Ok(State {
            config,
            rules,
            metrics,
            queue,
            keys,
            admin_token,
            blocked,
            tunnels: tokio::sync::watch::Sender::new(0),
            connections,
            uploads: parts::Uploads::default(),
            next_id: AtomicU64::new(0),
        })
    }

    /// Starts consuming the side queue (in-process workers or the NATS
    /// publisher) on a thread of its own; stop it after the proxy stopped
    /// serving so that it flushes what the queue holds.
    pub fn start_pipeline(self: &Arc<Self>) -> anyhow::Result<Pipeline> {
        self.restore_blocks_from_postgres();
        Pipeline::start(
            self.queue.clone(),
            self.config.clone(),
            self.metrics.clone(),
        )
    }

    /// When the results go to PostgreSQL and not to JSON lines, reads the
    /// dashboard's list of blocks back from there, on a thread of its own:
    /// the proxy serves meanwhile, and blocks that come first stay newest.
    fn restore_blocks_from_postgres(self: &Arc<Self>) {
        let (None, Some(postgres)) = (&self.config.sinks.jsonl, &self.config.sinks.postgres) else {
            return;
        };
        let url = postgres.url.clone();
        let state = Arc::downgrade(self);
        let read = move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()?;
            // A database that does not answer is given up on.
            let read = crate::sink::postgres::recent_blocks(&url, BlockLog::KEPT);
            let records = runtime
                .block_on(async { tokio::time::timeout(Duration::from_secs(30), read).await })
                .map_err(|_| anyhow::anyhow!("no answer in 30 s"))??;
            Ok::<_, anyhow::Error>(match state.upgrade() {
                Some(state) => state.blocked.restore_older(&records),
                None => 0,
            })
        };
        let spawned = std::thread::Builder::new()
            .name("fairgate-blocks".into())
            .spawn(move || match read() {
                Ok(0) => {}
                Ok(blocks) => tracing::info!(blocks, "blocked exchanges read back from PostgreSQL"),
                Err(error) => {
                    tracing::warn!(%error, "blocked exchanges could not be read back from PostgreSQL")
                }
            });
        if let Err(error) = spawned {
            tracing::warn!(%error, "blocked exchanges could not be read back from PostgreSQL");
        }
    }

    /// `fg-<microseconds, low 48 bits>-<sequence>`, both in hex. Written
    /// digit by digit rather than by `format!`: with two metric reasons
    /// built the same way, 130,435 -> 128,646 instructions per exchange
    /// (`benches/instructions.sh`).
    fn request_id(&self) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let t = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let mut id = String::with_capacity(32);
        id.push_str("fg-");
        push_hex(&mut id, (t & 0xffff_ffff_ffff) as u64);
        id.push('-');
        push_hex(&mut id, n);
        id
    }

    /// Compiles the rule directory off the request path and swaps it in if
    /// it compiles; the old set keeps serving otherwise.
    pub async fn reload_rules(self: &Arc<Self>) -> Result<Arc<RuleSet>, String> {
        let state = self.clone();
        let result = tokio::task::spawn_blocking(move || state.rules.reload()).await;
        match result {
            Ok(Ok(rules)) => {
                self.metrics.reloads.with_label_values(&["ok"]).inc();
                self.metrics.reload_failing.set(0);
                self.metrics
                    .rules_swapped(rules.version(), rules.rules().len());
                tracing::info!(
                    version = rules.version(),
                    rules = rules.rules().len(),
                    "rules reloaded"
                );
                Ok(rules)
            }
            Ok(Err(errors)) => {
                self.metrics.reloads.with_label_values(&["error"]).inc();
                self.metrics.reload_errors.inc();
                self.metrics.reload_failing.set(1);
                tracing::error!(errors = %errors, "rule reload failed; the previous rules keep serving");
                Err(errors.to_string())
            }
            Err(join) => Err(format!("reload did not finish: {join}")),
        }
    }
}

/// A listening socket that other sockets of this process can bind to the
/// same address (`SO_REUSEPORT`): the kernel then spreads new connections
/// over them.
pub fn bind_shared(addr: std::net::SocketAddr) -> std::io::Result<std::net::TcpListener> {
    use socket2::{Domain, Protocol, Socket, Type};
    let socket = Socket::new(Domain::for_address(addr), Type::STREAM, Some(Protocol::TCP))?;
    socket.set_reuse_address(true)?;
    socket.set_reuse_port(true)?;
    socket.set_nonblocking(true)?;
    socket.bind(&addr.into())?;
    socket.listen(1024)?;
    Ok(socket.into())
}

/// Serves the proxy with one single-threaded runtime per thread until
/// `shutdown` turns true. The first thread accepts on `listener`; each other
/// thread binds a socket of its own to the same address, which works when
/// `listener` came from [`bind_shared`] (otherwise they share `listener`).
/// With a socket each, the kernel spreads connections evenly; threads
/// sharing one socket let whichever wakes first take them, and under load
/// one thread ends up with most connections. The first thread also serves
/// `admin`.
///
/// Why threads of single-threaded runtimes rather than one work-stealing
/// runtime: an exchange is a chain of short steps across two connections
/// (client and upstream, each thread with its own upstream pool), and on a
/// work-stealing runtime each hop can wake another thread. With
/// `benches/proxy.sh` on the 2-core development machine, a work-stealing
/// runtime measured 77 µs of CPU per request and one single-threaded runtime
/// 48 µs; see the README for the figures and how much they vary there.
pub fn serve_on_threads(
    state: Arc<State>,
    listener: std::net::TcpListener,
    admin: std::net::TcpListener,
    threads: usize,
    shutdown: tokio::sync::watch::Receiver<bool>,
) -> anyhow::Result<()> {
    listener.set_nonblocking(true)?;
    admin.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let serve = move |listener: std::net::TcpListener,
                      admin: Option<std::net::TcpListener>,
                      state: Arc<State>,
                      mut shutdown: tokio::sync::watch::Receiver<bool>|
          -> anyhow::Result<()> {
        let runtime = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        runtime.block_on(async move {
            let listener = TcpListener::from_std(listener)?;
            let admin = admin.map(TcpListener::from_std).transpose()?;
            run(state, listener, admin, async move {
                let _ = shutdown.wait_for(|stop| *stop).await;
            })
            .await
        })
    };
    let mut handles = Vec::new();
    for i in 1..threads.max(1) {
        let listener = bind_shared(addr).or_else(|_| listener.try_clone())?;
        let (state, shutdown) = (state.clone(), shutdown.clone());
        let thread = std::thread::Builder::new()
            .name(format!("fairgate-{i}"))
            .spawn(move || serve(listener, None, state, shutdown))?;
        handles.push(thread);
    }
    // The first serving thread is the calling one.
    let served = serve(listener, Some(admin), state, shutdown);
    for handle in handles {
        handle
            .join()
            .map_err(|_| anyhow::anyhow!("a serving thread panicked"))??;
    }
    served
}

/// Serves the proxy on `listener` and, when given, the admin endpoints on
/// `admin` until `shutdown` completes, then lets in-flight exchanges (streams
/// included) finish for up to `shutdown_grace_ms`.
pub async fn run(
    state: Arc<State>,
    listener: TcpListener,
    admin: Option<TcpListener>,
    shutdown: impl Future<Output = ()>,
) -> anyhow::Result<()> {
    let serving = state.uploads.serving();
    let (closing, _) = tokio::sync::watch::channel(false);
    let mut builder = auto::Builder::new(TokioExecutor::new());
    let idle = state.config.client_header_timeout();
    let sending = state.config.client_send_timeout();
    builder
        .http1()
        .timer(TokioTimer::new())
        .header_read_timeout(idle);
    tokio::pin!(shutdown);
    let mut warned = None;
    let mut sweep = tokio::time::interval(Duration::from_secs(1));
    sweep.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
    loop {
        tokio::select! {
            (accepted, slot) = accept_within(&listener, state.connections.as_ref()) => {
                let Some(stream) = taken(accepted, &mut warned).await else { continue };
                let connection = Arc::new(Connection::open(slot, &state.metrics));
                // Stream events are small writes: without this, each one
                // after the first can wait for the client's delayed ACK.
                let _ = stream.set_nodelay(true);
                let state = state.clone();
                let held = connection.clone();
                let (requests, handle) = counting(move |mut req, open| {
                    // A tunnel outlives the connection's HTTP serving, and
                    // keeps its slot.
                    if req.headers().contains_key(http::header::UPGRADE) {
                        req.extensions_mut().insert(held.clone());
                    }
                    answer(state.clone(), req, open)
                });
                let stream = TokioIo::new(stall::SendTimeout::new(stream, sending));
                let served = builder.serve_connection_with_upgrades(stream, service_fn(handle)).into_owned();
                let closing = closing.subscribe();
                tokio::spawn(async move {
                    drive(served, requests, (idle, sending), closing, |c| c.graceful_shutdown()).await;
                    drop(connection);
                });
            }
            accepted = async { admin.as_ref()?.accept().await.map(Some).transpose() }, if admin.is_some() => {
                let Some(accepted) = accepted else { continue };
                let Some(stream) = taken(accepted, &mut warned).await else { continue };
                let state = state.clone();
                let (requests, handle) = counting(move |req, open| {
                    let answered = crate::admin::handle(state.clone(), req);
                    async move { answered.await.map(|answer| tracked(answer, open)) }
                });
                let stream = TokioIo::new(stall::SendTimeout::new(stream, sending));
                let connection = builder.serve_connection(stream, service_fn(handle)).into_owned();
                let closing = closing.subscribe();
                tokio::spawn(drive(connection, requests, (idle, sending), closing, |c| c.graceful_shutdown()));
            }
            // An expired upload's records end without waiting for a
            // step of another, and upstream connections unused too long
            // are closed without waiting for the next request.
            _ = sweep.tick() => {
                state.uploads.forget_expired();
                upstream::sweep_idle();
            }
            () = &mut shutdown => break,
        }
    }
    // New connections are refused from here on, not left waiting.
    drop(listener);
    drop(admin);
    let grace = Duration::from_millis(state.config.shutdown_grace_ms);
    let mut tunnels = state.tunnels.subscribe();
    let finished = async {
        let _ = closing.send(true);
        // Each connection holds a receiver until it has ended.
        closing.closed().await;
        let _ = tunnels.wait_for(|open| *open == 0).await;
    };
    tokio::select! {
        () = finished => tracing::info!("all connections finished"),
        () = tokio::time::sleep(grace) => tracing::warn!("shutdown grace period over; closing remaining connections"),
    }
    // Records held for completions that will not come, once no thread
    // serves.
    drop(serving);
    Ok(())
}

/// The next connection of `listener`, once `slots` (when limited) has room
/// for it, with its slot: while the proxy holds `max_connections`, new
/// ones wait in the listen backlog.
async fn accept_within(
    listener: &TcpListener,
    slots: Option<&Arc<tokio::sync::Semaphore>>,
) -> (
    std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)>,
    Option<tokio::sync::OwnedSemaphorePermit>,
) {
    let slot = match slots {
        // The semaphore is never closed.
        Some(slots) => slots.clone().acquire_owned().await.ok(),
        None => None,
    };
    (listener.accept().await, slot)
}

/// An open client connection of the proxy port: its slot of
/// `max_connections` and its count in `fairgate_connections_open`, both
/// given back when it is dropped (shared with its tunnel once upgraded).
struct Connection {
    _slot: Option<tokio::sync::OwnedSemaphorePermit>,
    open: prometheus::IntGauge,
}

impl Connection {
    fn open(slot: Option<tokio::sync::OwnedSemaphorePermit>, metrics: &Metrics) -> Connection {
        metrics.connections_open.inc();
        Connection {
            _slot: slot,
            open: metrics.connections_open.clone(),
        }
    }
}

impl Drop for Connection {
    fn drop(&mut self) {
        self.open.dec();
    }
}

/// How long accepting pauses after an error that would come again at once.
const ACCEPT_PAUSE: Duration = Duration::from_millis(100);

/// The connection `accept` took, or `None` when it failed. A connection
/// reset before it was taken is passed over at once. Any other error (out
/// of file descriptors or memory) would come again at once while the
/// connection waits in the backlog, so a loop that retried at once would
/// spin a core and starve the exchanges in flight: accepting pauses for
/// [`ACCEPT_PAUSE`]. The error is logged at most every ten seconds
/// (`warned`: when it last was).
pub(crate) async fn taken(
    accepted: std::io::Result<(tokio::net::TcpStream, std::net::SocketAddr)>,
    warned: &mut Option<Instant>,
) -> Option<tokio::net::TcpStream> {
    use std::io::ErrorKind;
    let error = match accepted {
        Ok((stream, _)) => return Some(stream),
        Err(error) => error,
    };
    let passing = [
        ErrorKind::ConnectionAborted,
        ErrorKind::ConnectionReset,
        ErrorKind::Interrupted,
        ErrorKind::WouldBlock,
    ];
    if passing.contains(&error.kind()) {
        return None;
    }
    if warned.is_none_or(|at| at.elapsed() >= Duration::from_secs(10)) {
        tracing::warn!(%error, "cannot accept connections: pausing accepts");
        *warned = Some(Instant::now());
    }
    tokio::time::sleep(ACCEPT_PAUSE).await;
    None
}

/// What [`drive`] knows of the requests made on one connection.
struct Requests {
    /// How many have begun.
    begun: AtomicU64,
    /// HTTP/2 requests whose answer has not ended. HTTP/1 requests are not
    /// counted: hyper's header timeout bounds the idle time between them.
    open: AtomicUsize,
    http2: AtomicBool,
    /// When the connection opened: the clock of [`Open::held`].
    opened: Instant,
    /// The [`Open::held`] of each open HTTP/2 answer.
    answers: std::sync::Mutex<Vec<std::sync::Weak<AtomicU64>>>,
}

impl Requests {
    fn new() -> Requests {
        Requests {
            begun: AtomicU64::new(0),
            open: AtomicUsize::new(0),
            http2: AtomicBool::new(false),
            opened: Instant::now(),
            answers: std::sync::Mutex::new(Vec::new()),
        }
    }

    /// Milliseconds since the connection opened, plus one (0 is "not").
    fn now(&self) -> u64 {
        self.opened.elapsed().as_millis() as u64 + 1
    }

    /// Whether an open HTTP/2 answer has had a frame taken and not sent on
    /// for `limit`: hyper polls an answer for its next frame only once
    /// the client's flow-control window has room, so a client that stops
    /// taking one stream's data while the connection's others flow (no
    /// write of the connection waits) holds it there.
    fn stalled(&self, limit: Duration) -> bool {
        let Ok(mut answers) = self.answers.lock() else {
            return false;
        };
        answers.retain(|held| held.strong_count() > 0);
        let now = self.now();
        let limit = limit.as_millis() as u64;
        answers
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .any(|held| {
                let since = held.load(Ordering::Relaxed);
                since != 0 && now.saturating_sub(since) >= limit
            })
    }
}

/// An HTTP/2 request in [`Requests::open`] until dropped with its answer.
struct Open {
    requests: Arc<Requests>,
    /// Since when ([`Requests::now`]) the answer's last frame has waited
    /// for the next poll; 0 while it does not (see [`Requests::stalled`]).
    held: Arc<AtomicU64>,
}

impl Open {
    fn new(requests: &Arc<Requests>) -> Open {
        requests.http2.store(true, Ordering::Relaxed);
        requests.open.fetch_add(1, Ordering::Relaxed);
        let held = Arc::new(AtomicU64::new(0));
        if let Ok(mut answers) = requests.answers.lock() {
            // The ended answers go when they outnumber the open ones, not
            // only at a check: a busy connection would hold thousands.
            let open = requests.open.load(Ordering::Relaxed);
            if answers.len() >= 2 * open + 16 {
                answers.retain(|held| held.strong_count() > 0);
            }
            answers.push(Arc::downgrade(&held));
        }
        Open {
            requests: requests.clone(),
            held,
        }
    }
}

impl Drop for Open {
    fn drop(&mut self) {
        self.requests.open.fetch_sub(1, Ordering::Relaxed);
    }
}

/// `handle`, given each request and, for an HTTP/2 one, an [`Open`] to
/// drop with its answer ([`tracked`]); the connection's [`Requests`].
fn counting<R>(
    handle: impl Fn(Request<Incoming>, Option<Open>) -> R,
) -> (Arc<Requests>, impl Fn(Request<Incoming>) -> R) {
    let requests = Arc::new(Requests::new());
    let counted = requests.clone();
    let handle = move |req: Request<Incoming>| {
        counted.begun.fetch_add(1, Ordering::Relaxed);
        let open = (req.version() == http::Version::HTTP_2).then(|| Open::new(&counted));
        handle(req, open)
    };
    (requests, handle)
}

/// `answer` holding `open` until its body has been sent or dropped, and
/// noting in it when a frame waits for the next poll.
fn tracked(answer: Response<ProxyBody>, open: Option<Open>) -> Response<ProxyBody> {
    let Some(open) = open else {
        return answer;
    };
    struct Tracked {
        body: ProxyBody,
        open: Open,
    }
    impl http_body::Body for Tracked {
        type Data = Bytes;
        type Error = BoxError;
        fn poll_frame(
            mut self: std::pin::Pin<&mut Self>,
            cx: &mut std::task::Context<'_>,
        ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
            self.open.held.store(0, Ordering::Relaxed);
            let polled = std::pin::Pin::new(&mut self.body).poll_frame(cx);
            if let Poll::Ready(Some(Ok(_))) = polled {
                let now = self.open.requests.now();
                self.open.held.store(now, Ordering::Relaxed);
            }
            polled
        }
        fn is_end_stream(&self) -> bool {
            self.body.is_end_stream()
        }
        fn size_hint(&self) -> http_body::SizeHint {
            self.body.size_hint()
        }
    }
    answer.map(|body| Tracked { body, open }.boxed_unsync())
}

/// Serves one accepted connection to its end, closing it (`close`: a
/// graceful shutdown, HTTP/2's GOAWAY) when the server shuts down
/// (`closing`), or when it has been idle for `idle`.
///
/// hyper's header timeout bounds each HTTP/1 request's head and the idle
/// time before it, but only once hyper has told HTTP/1 from HTTP/2 by the
/// first bytes, and hyper has no idle timeout for HTTP/2. So a connection
/// is also checked here every `idle`: one that has made no request by the
/// first check (silent, a partial HTTP/2 preface, an HTTP/2 client that
/// never asks), or an HTTP/2 one that began none since the last check and
/// has none open, is closed, and dropped if it has not ended by the next
/// check: an idle HTTP/2 connection lasts one to two `idle` after its
/// last answer. An HTTP/2 connection is also checked every `sending`
/// (`client_send_timeout_ms`) for an answer its client stopped taking
/// ([`Requests::stalled`]), and dropped if one has been for that long.
async fn drive<C, E>(
    connection: C,
    requests: Arc<Requests>,
    (idle, sending): (Option<Duration>, Option<Duration>),
    mut closing: tokio::sync::watch::Receiver<bool>,
    close: impl Fn(std::pin::Pin<&mut C>),
) where
    C: Future<Output = Result<(), E>>,
    E: std::fmt::Display,
{
    let every = |period: Duration| {
        let first = tokio::time::Instant::now() + period;
        let mut checks = tokio::time::interval_at(first, period);
        // A check is about the time since the last: late ones do not bunch.
        checks.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
        checks
    };
    let (mut idle_checks, mut send_checks) = (idle.map(every), sending.map(every));
    let mut connection = std::pin::pin!(connection);
    let mut checked = 0;
    let (mut shut, mut closed_idle) = (false, false);
    loop {
        tokio::select! {
            served = &mut connection => return ended(served),
            () = shutting(&mut closing), if !shut => {
                close(connection.as_mut());
                shut = true;
            }
            () = tick(&mut idle_checks), if !shut => {
                if closed_idle {
                    tracing::debug!("dropped an idle connection that did not close");
                    return;
                }
                let begun = requests.begun.load(Ordering::Relaxed);
                let http2 = requests.http2.load(Ordering::Relaxed);
                let quiet = begun == checked && requests.open.load(Ordering::Relaxed) == 0;
                if quiet && (begun == 0 || http2) {
                    tracing::debug!(begun, "closing an idle connection");
                    close(connection.as_mut());
                    closed_idle = true;
                } else if !http2 {
                    // HTTP/1: hyper's header timeout takes over.
                    idle_checks = None;
                }
                checked = begun;
            }
            () = tick(&mut send_checks), if !shut => {
                // An HTTP/1 connection has no answer in `stalled`.
                if let Some(limit) = sending
                    && requests.stalled(limit)
                {
                    tracing::info!("dropped an HTTP/2 connection whose client stopped taking an answer");
                    return;
                }
            }
        }
    }
}

/// The next tick of `checks`; never, when there are none.
async fn tick(checks: &mut Option<tokio::time::Interval>) {
    match checks {
        Some(checks) => {
            checks.tick().await;
        }
        None => std::future::pending().await,
    }
}

/// Completes once the server is shutting down.
async fn shutting(closing: &mut tokio::sync::watch::Receiver<bool>) {
    let _ = closing.wait_for(|stop| *stop).await;
}

fn ended<E: std::fmt::Display>(served: Result<(), E>) {
    if let Err(error) = served {
        tracing::debug!(%error, "connection ended with an error");
    }
}

/// One request on the proxy port, answered even when fairgate fails: if
/// its handler panics, with a 500 in the caller's dialect (not worth a
/// retry) rather than a connection cut without an answer, which SDKs
/// retry. Whatever the handler held is dropped with it: a stream's guard
/// reports its outcome, and nothing it held back goes out.
async fn answer(
    state: Arc<State>,
    req: Request<Incoming>,
    open: Option<Open>,
) -> Result<Response<ProxyBody>, Infallible> {
    let started = Instant::now();
    let request_id = state.request_id();
    // Looked up once: the dialect of a fault's answer and the route of an
    // exchange both read it.
    let to_anthropic = req.headers().contains_key(ANTHROPIC_VERSION);
    let dialect = path_dialect(req.uri().path(), to_anthropic);
    let handled = handle(&state, req, &request_id, started, to_anthropic);
    let answer = caught(handled, &state.metrics, dialect, &request_id).await;
    if let Some(respond::ErrorAnswer(code)) = answer.extensions().get() {
        let answers = &state.metrics.error_answers;
        answers.with_label_values(&[code]).inc();
    }
    Ok(tracked(answer, open))
}

/// `handled`'s response, or the 500 of a fault if it panics. A combinator,
/// not an async fn: the handler's future is large, and each async layer
/// around it moved it whole once more (2.8k more instructions a request).
fn caught<'a>(
    handled: impl Future<Output = Response<ProxyBody>> + 'a,
    metrics: &'a Metrics,
    dialect: Dialect,
    request_id: &'a str,
) -> impl Future<Output = Response<ProxyBody>> + 'a {
    use futures_util::FutureExt;
    std::panic::AssertUnwindSafe(handled)
        .catch_unwind()
        .map(move |handled| {
            handled.unwrap_or_else(|_| {
                metrics.faults.with_label_values(&["request"]).inc();
                tracing::error!(
                    request_id,
                    "a fault while handling the request: answered 500"
                );
                respond::failure(dialect, Failure::Fault, request_id)
            })
        })
}

/// One request on the proxy port.
async fn handle(
    state: &Arc<State>,
    req: Request<Incoming>,
    request_id: &str,
    started: Instant,
    to_anthropic: bool,
) -> Response<ProxyBody> {
    let reading = Reading::of(req.method(), req.uri().path());
    if let Some(plain) = plain_path(req.uri().path())
        && Reading::of(req.method(), &plain) != reading
    {
        let dialect = path_dialect(&plain, to_anthropic);
        return respond::failure(dialect, Failure::AmbiguousPath, request_id);
    }
    if tunnel::is_websocket(req.headers()) {
        return Box::pin(tunnel::relay(state, req, request_id)).await;
    }
    // The future of every request is as large as the largest of these,
    // and is copied as it is handed to hyper: all but the exchange's and
    // the pass-through's are boxed, so that theirs stay small.
    match reading {
        Reading::Guarded(endpoint) => {
            guarded(state, req, (endpoint, to_anthropic), request_id, started).await
        }
        Reading::Passed => passthrough(state, req, request_id).await,
        Reading::Feedback => Box::pin(feedback(state, req, request_id)).await,
        Reading::Stored(stored) => Box::pin(stored::fetch(state, req, stored, request_id)).await,
        Reading::ConversationItems => Box::pin(stored::add_items(state, req, request_id)).await,
        Reading::Compaction => Box::pin(stored::compact(state, req, request_id)).await,
        Reading::TokenCount(endpoint) => {
            Box::pin(stored::count_tokens(state, req, endpoint, request_id)).await
        }
        Reading::RealtimeSetup => Box::pin(realtime::setup(state, req, request_id)).await,
        Reading::Media => Box::pin(media::handle(state, req, request_id)).await,
        Reading::Batch(batch) => Box::pin(batch::handle(state, req, batch, request_id)).await,
    }
}

/// What fairgate does with a request, by its method and path. One
/// classification for serving it and for telling whether its path's plain
/// form ([`plain_path`]) would be served otherwise.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Reading {
    /// `POST` to a guarded endpoint: an exchange.
    Guarded(Endpoint),
    /// fairgate's own `POST /v1/feedback`.
    Feedback,
    /// A request answered with an answer the API stored.
    Stored(Stored),
    /// `POST` of items to a stored conversation.
    ConversationItems,
    /// `POST` of a conversation to compact.
    Compaction,
    /// `POST` of a request to an endpoint, to count its tokens.
    TokenCount(Endpoint),
    /// `POST` that sets up a Realtime session held elsewhere.
    RealtimeSetup,
    /// `POST` that asks for an image, a video, speech or a transcript.
    Media,
    /// A request about batches.
    Batch(Batch),
    /// Anything else, passed through unread.
    Passed,
}

impl Reading {
    fn of(method: &Method, path: &str) -> Reading {
        if *method == Method::POST {
            if let Some(endpoint) = Endpoint::from_path(path) {
                return Reading::Guarded(endpoint);
            }
            if path.trim_end_matches('/') == "/v1/feedback" {
                return Reading::Feedback;
            }
            if exchange::adds_conversation_items(path) {
                return Reading::ConversationItems;
            }
            if exchange::compacts_conversation(path) {
                return Reading::Compaction;
            }
            if let Some(endpoint) = exchange::counts_tokens(path) {
                return Reading::TokenCount(endpoint);
            }
            if exchange::sets_up_realtime(path) {
                return Reading::RealtimeSetup;
            }
            if exchange::makes_media(path) {
                return Reading::Media;
            }
        }
        if let Some(stored) = Stored::from_request(method, path) {
            return Reading::Stored(stored);
        }
        Batch::from_request(method, path).map_or(Reading::Passed, Reading::Batch)
    }
}

/// The plain form of a request path whose bytes an upstream may read as
/// another path: percent-decoded (as Starlette and Go's `net/http` route),
/// `;` parameters taken off each segment (as Java servers do), empty and
/// `.` segments dropped and `..` taking off the segment before it (as URL
/// normalization does), in lower case (as Express and ASP.NET route by
/// default). `None` for a path with none of these, as nearly every path
/// is: two quick passes over its bytes. A request whose path's
/// plain form [`Reading`] reads otherwise is refused: the upstream might
/// serve the plain form, and the guard would have read the wrong thing
/// (or nothing).
fn plain_path(path: &str) -> Option<String> {
    let bytes = path.as_bytes();
    let unusual = bytes
        .iter()
        .any(|&b| b == b'%' || b == b';' || b.is_ascii_uppercase())
        || bytes
            .windows(2)
            .any(|pair| pair[0] == b'/' && matches!(pair[1], b'/' | b'.'));
    if !unusual {
        return None;
    }
    let decoded = percent_encoding::percent_decode_str(path)
        .decode_utf8_lossy()
        .to_lowercase();
    let mut segments: Vec<&str> = Vec::new();
    for segment in decoded.split('/') {
        match segment.split(';').next().unwrap_or_default() {
            "" | "." => {}
            ".." => {
                segments.pop();
            }
            segment => segments.push(segment),
        }
    }
    Some(format!("/{}", segments.join("/")))
}

/// Headers that describe one connection, not the message (`name` in
/// lower case, as a header name is).
fn is_hop_by_hop(name: &str) -> bool {
    matches!(
        name,
        "connection"
            | "keep-alive"
            | "proxy-authenticate"
            | "proxy-authorization"
            | "te"
            | "trailer"
            | "transfer-encoding"
            | "upgrade"
            | "host"
            | "content-length"
    )
}

/// Takes out of `headers` those that describe one connection rather than
/// the message and, with `ours`, fairgate's own (`x-fairgate-*`). In place:
/// copying the rest into a new map would hash each of them again, and an
/// SDK's request and an API's answer carry some 40 between them.
fn strip_hop_by_hop(headers: &mut HeaderMap, ours: bool) {
    // The headers that `Connection` names are the connection's too (RFC
    // 9110, 7.6.1), as in `Connection: close, X-Trace-Hop`.
    let named: Vec<HeaderName> = (headers.get_all(header::CONNECTION).iter())
        .filter_map(|value| value.to_str().ok())
        .flat_map(|value| value.split(','))
        .map(str::trim)
        // `keep-alive`, `close`: no header to take out, or one anyway.
        .filter(|name| !name.eq_ignore_ascii_case("close") && !is_hop_by_hop(name))
        .filter_map(|name| HeaderName::from_bytes(name.as_bytes()).ok())
        .collect();
    let strip = |name: &HeaderName| {
        is_hop_by_hop(name.as_str())
            || named.contains(name)
            || (ours && name.as_str().starts_with("x-fairgate-"))
    };
    let found: Vec<HeaderName> = headers.keys().filter(|name| strip(name)).cloned().collect();
    for name in found {
        headers.remove(name);
    }
}

const X_API_KEY: HeaderName = HeaderName::from_static("x-api-key");
/// Azure OpenAI's key header.
const AZURE_API_KEY: HeaderName = HeaderName::from_static("api-key");
const ANTHROPIC_VERSION: HeaderName = HeaderName::from_static("anthropic-version");

/// The headers to send upstream: the client's, less hop-by-hop headers and
/// fairgate's own, with the upstream's key in place of the client's when one
/// is configured: in its `api_key_header`, by default `x-api-key` for a
/// request to Anthropic's API ([`api_of`]), else a bearer token.
fn upstream_headers(
    state: &State,
    upstream: &str,
    dialect: Dialect,
    mut headers: HeaderMap,
) -> HeaderMap {
    strip_hop_by_hop(&mut headers, true);
    if let Some(key) = state.keys.get(upstream) {
        let configured = state.config.upstreams.get(upstream);
        let in_header = configured
            .and_then(|u| u.api_key_header)
            .unwrap_or_else(|| match api_of(&headers, dialect) {
                Dialect::Anthropic => KeyHeader::XApiKey,
                Dialect::OpenAi => KeyHeader::Authorization,
            });
        // Whichever the client sent: only the proxy's key goes up.
        headers.remove(header::AUTHORIZATION);
        headers.remove(X_API_KEY);
        headers.remove(AZURE_API_KEY);
        match in_header {
            KeyHeader::XApiKey => {
                headers.insert(X_API_KEY, key.clone());
            }
            KeyHeader::ApiKey => {
                headers.insert(AZURE_API_KEY, key.clone());
            }
            KeyHeader::Authorization => {
                let bearer = format!("Bearer {}", key.to_str().unwrap_or_default());
                if let Ok(bearer) = HeaderValue::from_str(&bearer) {
                    headers.insert(header::AUTHORIZATION, bearer);
                }
            }
        }
    }
    headers
}

/// The API a request is for: Anthropic's when it carries the
/// `anthropic-version` header, which Anthropic's API requires of every
/// request (its SDKs send it with each, to `/v1/models` and the Files API
/// too), else `dialect`, its path's or its endpoint's.
fn api_of(headers: &HeaderMap, dialect: Dialect) -> Dialect {
    api_by(headers.contains_key(ANTHROPIC_VERSION), dialect)
}

/// [`api_of`] once the header is looked up: `to_anthropic`, it is there.
fn api_by(to_anthropic: bool, dialect: Dialect) -> Dialect {
    match to_anthropic {
        true => Dialect::Anthropic,
        false => dialect,
    }
}

/// The route of a request in `dialect`, by the API it is for
/// ([`api_of`]), its path and the model it names.
fn route<'a>(
    state: &'a State,
    headers: &HeaderMap,
    dialect: Dialect,
    path: &str,
    model: Option<&str>,
) -> Option<&'a RouteConfig> {
    state.config.route(api_of(headers, dialect), path, model)
}

/// Sends a request to `upstream` for the client's method and path, with
/// `headers`, `body` and the upstream's timeout. Returns the response head
/// and that timeout, which each later wait on the upstream (for a part of
/// its body) is held to; a failure is counted and mapped to what the
/// caller sees.
async fn forward(
    state: &State,
    upstream: &str,
    method: Method,
    uri: &http::Uri,
    headers: HeaderMap,
    body: UpstreamBody,
) -> Result<(Response<upstream::Answer>, Duration), Failure> {
    forward_on(state, upstream, method, uri, headers, body, false).await
}

/// [`forward`]; with `upgrade`, on a connection of its own that the
/// response can take over (see [`upstream::send`]).
async fn forward_on(
    state: &State,
    upstream: &str,
    method: Method,
    uri: &http::Uri,
    headers: HeaderMap,
    body: UpstreamBody,
    upgrade: bool,
) -> Result<(Response<upstream::Answer>, Duration), Failure> {
    let Some(config) = state.config.upstreams.get(upstream) else {
        return Err(Failure::NoRoute);
    };
    let Some(client) = UpstreamClient::of_this_thread(config) else {
        return Err(Failure::NoRoute);
    };
    let path = uri.path_and_query().map_or("/", |p| p.as_str());
    let timeout = Duration::from_millis(config.timeout_ms);
    match upstream::send(&client, method, path, headers, body, timeout, upgrade).await {
        Ok(response) => Ok((response, timeout)),
        // The client's fault, not the upstream's.
        Err((failure, ..)) if failure.of_client_body() => {
            tracing::debug!(upstream, ?failure, "a request body failed on its way up");
            Err(failure)
        }
        Err((failure, kind, error)) => {
            state
                .metrics
                .upstream_errors
                .with_label_values(&[upstream, kind])
                .inc();
            match error {
                Some(error) => tracing::warn!(upstream, %error, "upstream request failed"),
                None => tracing::warn!(upstream, "upstream request timed out"),
            }
            Err(failure)
        }
    }
}

/// Appends `value` in lower-case hex, without leading zeros.
fn push_hex(out: &mut String, value: u64) {
    let digits = (64 - value.leading_zeros()).div_ceil(4).max(1);
    for i in (0..digits).rev() {
        out.push(char::from(
            b"0123456789abcdef"[(value >> (4 * i)) as usize & 0xf],
        ));
    }
}

/// The dialect of a request, by its path and headers: Anthropic's for the
/// Messages API's paths and any request to Anthropic's API ([`api_of`]),
/// else OpenAI's.
fn dialect_of(headers: &HeaderMap, path: &str) -> Dialect {
    path_dialect(path, headers.contains_key(ANTHROPIC_VERSION))
}

/// [`dialect_of`] once the header is looked up (`to_anthropic`).
fn path_dialect(path: &str, to_anthropic: bool) -> Dialect {
    match path.starts_with("/v1/messages") {
        true => Dialect::Anthropic,
        false => api_by(to_anthropic, Dialect::OpenAi),
    }
}

/// `POST /v1/feedback`: what the user did after an exchange, queued for the
/// outcome metrics. Answers 202 once queued, 400 on a bad body.
async fn feedback(state: &State, req: Request<Incoming>, request_id: &str) -> Response<ProxyBody> {
    let body = match Limited::new(req.into_body(), 64 << 10).collect().await {
        Ok(collected) => collected.to_bytes(),
        Err(_) => return respond::failure(Dialect::OpenAi, Failure::TooLarge, request_id),
    };
    let parsed: FeedbackRequest = match serde_json::from_slice(&body) {
        Ok(parsed) => parsed,
        Err(error) => {
            return respond::invalid_request(
                &format!(
                    "Invalid feedback: {error}. Expected {{\"request_id\", \"user_action\": \"saved\"|\"spent\", \"stake_type\"?, \"goal_completed\"?}}."
                ),
                "invalid_feedback",
                request_id,
            );
        }
    };
    if parsed.request_id.trim().is_empty() {
        return respond::invalid_request(
            "Invalid feedback: request_id is empty.",
            "invalid_feedback",
            request_id,
        );
    }
    let record = FeedbackRecord {
        schema_version: crate::record::SCHEMA_VERSION,
        request_id: parsed.request_id.clone(),
        user_action: parsed.user_action,
        stake_type: parsed.stake_type,
        goal_completed: parsed.goal_completed,
        received_ms: now_ms(),
    };
    state.queue.push(QueueItem::Feedback(record));
    respond::accepted(&parsed.request_id, request_id)
}

/// The parts of an exchange record known before the upstream answers.
struct RecordDraft {
    request_id: String,
    started: Instant,
    started_ms: i64,
    /// The record's `route` (the endpoint's, or `realtime`) and dialect.
    route: &'static str,
    dialect: Dialect,
    upstream: String,
    /// The upstream's id of the request, once it has answered.
    upstream_request_id: Option<String>,
    model: Option<String>,
    stream: bool,
    /// The `custom_id` of the batch's request a batch's answer answers.
    custom_id: Option<String>,
    client: ClientMeta,
    prompt: Vec<String>,
    context: Vec<String>,
}

/// How an exchange ended, for its record.
struct Ending<'a> {
    verdict: &'a Verdict,
    response: Vec<String>,
    /// What hosted tools gave the model in the answer, after the
    /// request's context.
    context: Vec<String>,
    status: u16,
    /// The upstream's share of the time, when it was called.
    upstream: Option<Duration>,
    /// fairgate's own share.
    proxy: Duration,
    usage: Option<Usage>,
    /// How a streamed answer ended; `None` when none was streamed.
    stream_end: Option<StreamEnd>,
}

impl RecordDraft {
    /// Completes the record and hands it to the side queue; a blocked
    /// exchange also goes to the dashboard's log, its entry made from the
    /// record as a restart makes it from the record read back.
    fn finish(self, state: &State, end: Ending) {
        let record = self.record(state.config.records.texts, end);
        send_record(state, record);
    }

    /// The record, its texts kept as `mode` says.
    fn record(mut self, mode: crate::record::TextMode, end: Ending) -> ExchangeRecord {
        let ms = |d: Duration| d.as_secs_f64() * 1000.0;
        self.context.extend(end.context);
        ExchangeRecord {
            schema_version: crate::record::SCHEMA_VERSION,
            request_id: self.request_id,
            started_ms: self.started_ms,
            finished_ms: now_ms(),
            route: self.route.to_owned(),
            dialect: match self.dialect {
                Dialect::OpenAi => "openai",
                Dialect::Anthropic => "anthropic",
            }
            .to_owned(),
            upstream: self.upstream,
            upstream_request_id: self.upstream_request_id,
            model: self.model,
            stream: self.stream,
            status: end.status,
            stream_end: end.stream_end,
            custom_id: self.custom_id,
            texts: Texts::new(mode, self.prompt, self.context, end.response),
            verdict: end.verdict.decision,
            risk: end.verdict.risk,
            hits: record_hits(end.verdict, mode),
            upstream_ms: end.upstream.map(ms),
            proxy_ms: ms(end.proxy),
            total_ms: ms(self.started.elapsed()),
            usage: end.usage,
            client: self.client,
        }
    }
}

/// Hands a record to the side queue; a blocked exchange's also goes to
/// the dashboard's log, its entry made from the record as a restart makes
/// it from the record read back.
fn send_record(state: &State, record: ExchangeRecord) {
    if record.verdict == Decision::Block {
        state.blocked.push(Blocked::of_record(&record));
    }
    state.queue.push(QueueItem::Exchange(Box::new(record)));
}

impl RecordDraft {
    /// The draft of a request read outside an exchange (see
    /// [`batch::OutsideRecords`]), read as `route` and sent
    /// to `upstream`, with the prompt and context `texts` its scan found.
    fn outside(
        (route, dialect, upstream): (&'static str, Dialect, &str),
        (headers, request): (&HeaderMap, &exchange::BatchRequest),
        texts: guard::RequestTexts,
        (request_id, started): (&str, Instant),
    ) -> RecordDraft {
        RecordDraft {
            request_id: request_id.to_owned(),
            started,
            started_ms: now_ms() - started.elapsed().as_millis() as i64,
            route,
            dialect,
            upstream: upstream.to_owned(),
            upstream_request_id: None,
            client: ClientMeta::read(headers, request.params.metadata),
            model: request.params.model.as_deref().map(str::to_owned),
            stream: false,
            custom_id: request.custom_id.as_deref().map(str::to_owned),
            prompt: texts.prompt,
            context: texts.context,
        }
    }

    /// Completes the record of a request that ended with no response
    /// read: `status`, and the upstream's share of the time when it was
    /// called.
    fn finish_unanswered(
        self,
        state: &State,
        verdict: &Verdict,
        status: u16,
        upstream: Option<Duration>,
    ) {
        let proxy = self
            .started
            .elapsed()
            .saturating_sub(upstream.unwrap_or_default());
        let ending = Ending {
            verdict,
            response: Vec::new(),
            context: Vec::new(),
            status,
            upstream,
            proxy,
            usage: None,
            stream_end: None,
        };
        self.finish(state, ending);
    }
}

/// A guarded exchange's record from the moment its prompt is scanned,
/// which reaches the side queue however the exchange ends. The handler
/// finishes it ([`Pending::take`], then [`RecordDraft::finish`]). If the
/// handler's future is dropped first, because the client went away before
/// its answer (hyper drops the future of a connection that closed) or a
/// fault unwound it, the drop records what is known: the prompt and its
/// verdict, no response, and the status 499 (the client closed the
/// request, as nginx logs it) or 500 (what a fault is answered with).
struct Pending<'a> {
    state: &'a State,
    /// The prompt's verdict.
    verdict: &'a Verdict,
    /// `Some` until taken; `take` consumes the `Pending`.
    draft: Option<RecordDraft>,
    /// When the request went upstream, once it has.
    sent: Option<Instant>,
}

impl<'a> Pending<'a> {
    fn new(state: &'a State, verdict: &'a Verdict, draft: RecordDraft) -> Pending<'a> {
        Pending {
            state,
            verdict,
            draft: Some(draft),
            sent: None,
        }
    }

    /// Records the exchange as ended before a response was scanned: no
    /// response, `status`, and the upstream's share of the time when it was
    /// called.
    fn end_early(mut self, status: StatusCode, upstream: Option<Duration>) {
        self.record_unanswered(status.as_u16(), upstream);
    }

    fn record_unanswered(&mut self, status: u16, upstream: Option<Duration>) {
        if let Some(draft) = self.draft.take() {
            draft.finish_unanswered(self.state, self.verdict, status, upstream);
        }
    }

    /// The draft, for the handler to finish.
    fn take(mut self) -> RecordDraft {
        match self.draft.take() {
            Some(draft) => draft,
            None => unreachable!("a pending record's draft is taken once, with the Pending"),
        }
    }
}

impl Drop for Pending<'_> {
    fn drop(&mut self) {
        let Some(draft) = &self.draft else {
            return;
        };
        let (status, counted) = match std::thread::panicking() {
            true => (500, "error"),
            false => (499, "client_closed"),
        };
        if status == 499 {
            tracing::info!(
                request_id = draft.request_id,
                "the client closed the request before its answer"
            );
        }
        self.state
            .metrics
            .requests
            .with_label_values(&[
                draft.route,
                &draft.upstream,
                self.state
                    .config
                    .metrics
                    .model_label(draft.model.as_deref()),
                counted,
            ])
            .inc();
        self.record_unanswered(status, self.sent.map(|sent| sent.elapsed()));
    }
}

/// Forwards a request that is not guarded, bodies streamed both ways.
async fn passthrough(
    state: &State,
    req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = dialect_of(req.headers(), req.uri().path());
    match relay(state, req, dialect, request_id, false).await {
        Ok(relayed) => stream_back(relayed.response, relayed.timeout, request_id, None),
        Err(out) => out,
    }
}

/// The upstream's own id of a request, from its answer's head: OpenAI's
/// `x-request-id`, Anthropic's `request-id`.
fn upstream_request_id(headers: &HeaderMap) -> Option<String> {
    const OPENAI: HeaderName = HeaderName::from_static("x-request-id");
    const ANTHROPIC: HeaderName = HeaderName::from_static("request-id");
    let id = headers.get(OPENAI).or_else(|| headers.get(ANTHROPIC))?;
    // Kept as a label of the record, not a text: a short id, as sent.
    let id = id.to_str().ok().filter(|id| id.len() <= 200)?;
    Some(id.to_owned())
}

/// A request sent upstream as the client wrote it: its route's upstream and
/// stream mode, and the upstream's response head.
struct Relayed {
    upstream: String,
    stream_mode: Option<StreamMode>,
    response: Response<upstream::Answer>,
    timeout: Duration,
}

/// Sends `req` upstream as it came (method, path and query, headers less
/// hop-by-hop ones, body streamed) on the route of its path; with
/// `uncompressed`, asking for the answer uncompressed, for the guard to
/// read. A failure is answered in `dialect`.
async fn relay(
    state: &State,
    req: Request<Incoming>,
    dialect: Dialect,
    request_id: &str,
    uncompressed: bool,
) -> Result<Relayed, Response<ProxyBody>> {
    let Some(route) = route(state, req.headers(), dialect, req.uri().path(), None) else {
        return Err(respond::failure(dialect, Failure::NoRoute, request_id));
    };
    let (upstream, stream_mode) = (route.upstream.clone(), route.stream_mode);
    let (parts, body) = req.into_parts();
    let mut headers = upstream_headers(state, &upstream, dialect, parts.headers);
    if uncompressed {
        headers.insert(
            header::ACCEPT_ENCODING,
            HeaderValue::from_static("identity"),
        );
    }
    let body = upstream::Upload::new(Either::Left(client_body(state, body)));
    match forward(state, &upstream, parts.method, &parts.uri, headers, body).await {
        Ok((response, timeout)) => Ok(Relayed {
            upstream,
            stream_mode,
            response,
            timeout,
        }),
        Err(failure) => Err(respond::failure(dialect, failure, request_id)),
    }
}

/// Relays an upstream response as it arrives, the upstream silent for no
/// more than `timeout` at a time.
fn stream_back(
    response: Response<upstream::Answer>,
    timeout: Duration,
    request_id: &str,
    verdict: Option<&str>,
) -> Response<ProxyBody> {
    let (parts, body) = response.into_parts();
    let body = upstream::body_stream(body, timeout).map(|chunk| chunk.map(Frame::data));
    let mut out = Response::new(StreamBody::new(body).boxed_unsync());
    *out.status_mut() = parts.status;
    *out.headers_mut() = response_headers(parts.headers);
    respond::tag(&mut out, request_id, verdict);
    out
}

/// The upstream's answer headers, to be relayed: less hop-by-hop ones.
fn response_headers(mut headers: HeaderMap) -> HeaderMap {
    strip_hop_by_hop(&mut headers, false);
    headers
}

/// The response with a body the guard read (uncompressed, as fairgate
/// asked for it): the upstream's status and headers, tagged.
fn guarded_response(
    status: StatusCode,
    headers: HeaderMap,
    body: ProxyBody,
    request_id: &str,
    verdict: Option<&str>,
) -> Response<ProxyBody> {
    let mut out = Response::new(body);
    *out.status_mut() = status;
    *out.headers_mut() = response_headers(headers);
    out.headers_mut().remove(header::CONTENT_ENCODING);
    respond::tag(&mut out, request_id, verdict);
    out
}

/// The 502 for an upstream answer that cannot be relayed, counted by
/// `kind` (see `fairgate_upstream_errors_total`).
fn upstream_broken(
    state: &State,
    upstream: &str,
    kind: &str,
    dialect: Dialect,
    request_id: &str,
) -> Response<ProxyBody> {
    state
        .metrics
        .upstream_errors
        .with_label_values(&[upstream, kind])
        .inc();
    respond::failure(dialect, Failure::UpstreamBroken, request_id)
}

/// Whether an upstream body is compressed although fairgate asked for it
/// uncompressed: the guard cannot read what the client would, so it is
/// not relayed.
fn is_encoded(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_ENCODING)
        .is_some_and(|v| v.as_bytes() != b"identity")
}

/// An answer's body as the SDKs' JSON readers take it (Python's
/// `json.loads` of bytes, a UTF-8 decode in Node): after a UTF-8
/// byte-order mark, which they skip, so that the guard does not read a
/// JSON answer behind one as plain text, where its escapes (`\n`,
/// `\u0063`) would hide words from the rules. `None` for a body that
/// `json.loads` would read as UTF-16 or UTF-32, told by their marks or by
/// a zero byte among the first two (RFC 4627): the guard reads UTF-8
/// only, so such a body is not relayed.
fn as_sdks_read(body: Bytes) -> Option<Bytes> {
    const UTF8_MARK: &[u8] = b"\xef\xbb\xbf";
    if body.starts_with(UTF8_MARK) {
        return Some(body.slice(UTF8_MARK.len()..));
    }
    let marked = body.starts_with(b"\xff\xfe") || body.starts_with(b"\xfe\xff");
    let zero_led = (body.len() == 2 || body.len() >= 4) && body[..2].contains(&0);
    (!marked && !zero_led).then_some(body)
}

/// Counts the hits and risk of a verdict.
fn record_verdict(metrics: &Metrics, verdict: &Verdict) {
    for hit in &verdict.hits {
        metrics
            .rule_hits
            .with_label_values(&[
                &*hit.rule,
                &*hit.category,
                hit.scope.as_str(),
                hit.action.as_str(),
            ])
            .inc();
    }
    metrics.observe_risk(&verdict.risk);
}

/// A guarded exchange.
/// `to_anthropic`: the request carries the `anthropic-version` header
/// ([`api_of`]).
async fn guarded(
    state: &Arc<State>,
    req: Request<Incoming>,
    (endpoint, to_anthropic): (Endpoint, bool),
    request_id: &str,
    started: Instant,
) -> Response<ProxyBody> {
    let dialect = endpoint.dialect();
    let route_label = endpoint.route();
    let (parts, body) = req.into_parts();
    let limit = state.config.guard.max_body_bytes;
    let (bytes, decoded) = match read_request(state, &parts.headers, body, limit).await {
        Ok(read) => read,
        Err(failure) => return respond::failure(dialect, failure, request_id),
    };
    let read = match RequestBody::read(endpoint, &bytes) {
        Ok(read) => read,
        Err(error) => return respond::unreadable(dialect, &error, None, request_id),
    };
    let model = read.model.as_deref().map(str::to_owned);
    let model_label = state.config.metrics.model_label(model.as_deref());
    let (streaming, include_usage) = (read.stream, read.include_usage);
    let api = api_by(to_anthropic, dialect);
    let Some(route) = state.config.route(api, parts.uri.path(), model.as_deref()) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    let upstream = route.upstream.clone();
    let stream_mode = route.stream_mode.unwrap_or(state.config.guard.stream_mode);

    // The rules of this exchange, start to end, whatever reloads happen.
    let rules = state.rules.snapshot();
    let mut scan = guard::scan_request(
        &rules,
        &state.config.risk,
        &state.config.guard.context_tags,
        &read.texts,
    );
    let texts = std::mem::take(&mut scan.texts);
    scan.prefill = read.prefill.map(std::borrow::Cow::into_owned);
    let draft = RecordDraft {
        request_id: request_id.to_owned(),
        started,
        started_ms: now_ms() - started.elapsed().as_millis() as i64,
        route: route_label,
        dialect,
        upstream: upstream.clone(),
        upstream_request_id: None,
        client: ClientMeta::read(&parts.headers, read.metadata),
        model,
        stream: streaming,
        custom_id: None,
        prompt: texts.prompt,
        context: texts.context,
    };
    let mut pending = Pending::new(state, &scan.verdict, draft);
    if scan.verdict.decision == Decision::Block {
        record_verdict(&state.metrics, &scan.verdict);
        let scope = guard::block_scope(&scan.verdict.hits, Scope::Prompt);
        state
            .metrics
            .blocks
            .with_label_values(&[route_label, model_label, scope])
            .inc();
        state
            .metrics
            .requests
            .with_label_values(&[route_label, &upstream, model_label, "block"])
            .inc();
        let message = block_message(&scan.verdict.hits);
        tracing::info!(request_id, scope, rules = ?rule_ids(&scan.verdict.hits), "request blocked");
        let out = respond::blocked(
            dialect,
            scope,
            &message,
            &rule_ids(&scan.verdict.hits),
            request_id,
        );
        pending.end_early(out.status(), None);
        return out;
    }

    let mut headers = upstream_headers(state, &upstream, dialect, parts.headers);
    if decoded {
        headers.remove(header::CONTENT_ENCODING);
    }
    // The guard reads response bodies: ask for them uncompressed.
    headers.insert(
        header::ACCEPT_ENCODING,
        HeaderValue::from_static("identity"),
    );
    headers.insert(
        header::CONTENT_TYPE,
        HeaderValue::from_static("application/json"),
    );
    let sent = Instant::now();
    pending.sent = Some(sent);
    // Byte for byte what the client sent, unless a redaction rewrote it.
    let body = scan.redacted(&bytes).unwrap_or(bytes);
    let forwarded = forward(
        state,
        &upstream,
        Method::POST,
        &parts.uri,
        headers,
        upstream::whole(body),
    )
    .await;
    let (response, timeout) = match forwarded {
        Ok(sent) => sent,
        Err(failure) => {
            state
                .metrics
                .requests
                .with_label_values(&[route_label, &upstream, model_label, "error"])
                .inc();
            let out = respond::failure(dialect, failure, request_id);
            pending.end_early(out.status(), None);
            return out;
        }
    };
    if let Some(draft) = pending.draft.as_mut() {
        draft.upstream_request_id = upstream_request_id(response.headers());
    }
    let upstream_time = sent.elapsed();
    state
        .metrics
        .upstream_latency
        .with_label_values(&[&upstream])
        .observe(upstream_time.as_secs_f64());
    let prompt_verdict = scan.verdict.decision.as_str();

    // Upstream errors pass through unchanged.
    if !response.status().is_success() {
        state
            .metrics
            .requests
            .with_label_values(&[route_label, &upstream, model_label, "upstream_error"])
            .inc();
        pending.end_early(response.status(), Some(upstream_time));
        return stream_back(response, timeout, request_id, Some(prompt_verdict));
    }
    // An answer whose body cannot be relayed: counted by `kind`, and a 502
    // in the caller's dialect.
    let broken = |kind: &str, pending: Pending| {
        let out = upstream_broken(state, &upstream, kind, dialect, request_id);
        pending.end_early(out.status(), Some(upstream_time));
        out
    };
    // Streamed or whole.
    if is_encoded(response.headers()) {
        tracing::warn!("upstream answer is compressed although fairgate asked for it uncompressed");
        return broken("encoded", pending);
    }
    let is_stream = response
        .headers()
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("text/event-stream"));
    if is_stream || streaming && !is_json(response.headers()) {
        // hyper polls the body, where the guard runs, right after it has
        // put the head in its buffer: head and first frames leave in one
        // write without a yield first.
        return guarded_stream(
            state,
            endpoint,
            response,
            timeout,
            stream_mode,
            rules,
            &scan,
            pending,
            sent.duration_since(started),
            include_usage,
        );
    }

    let (head, body) = response.into_parts();
    let status = head.status;
    let upstream_headers = head.headers;
    let body = match upstream::read_body(body, state.config.guard.max_response_bytes, timeout).await
    {
        Ok(body) => body,
        Err(error) => {
            tracing::warn!(%error, "upstream body could not be read");
            return broken("body", pending);
        }
    };
    let Some(body) = as_sdks_read(body) else {
        tracing::warn!("upstream answer is in UTF-16 or UTF-32, which the guard does not read");
        return broken("encoded", pending);
    };
    let (scanned, usage, unreadable) = match ResponseBody::read(endpoint, &body) {
        Ok(read) => (
            guard::scan_response(&rules, &body, &read.texts, scan.prefill.as_deref()),
            read.usage,
            false,
        ),
        Err(error @ ReadError::Ambiguous(_)) => {
            // A key twice: the client's parser may read another value
            // than the guard would scan. Not relayed.
            tracing::warn!(%error, "upstream response holds a key twice");
            return broken("ambiguous", pending);
        }
        Err(_) => {
            // Not JSON: the whole body is scanned as the answer's text.
            state
                .metrics
                .upstream_errors
                .with_label_values(&[&upstream, "not_json"])
                .inc();
            (guard::scan_plain_response(&rules, &body), None, true)
        }
    };
    let usage = usage.map(Usage::from_json_text);
    let mut all: Vec<Hit> = scan.verdict.hits.clone();
    all.extend(scanned.hits);
    let verdict = risk::assess(&state.config.risk, all, &scan.relevance);
    record_verdict(&state.metrics, &verdict);
    state
        .metrics
        .requests
        .with_label_values(&[
            route_label,
            &upstream,
            model_label,
            verdict.decision.as_str(),
        ])
        .inc();
    let proxy_time = started.elapsed().saturating_sub(upstream_time);
    state
        .metrics
        .added_latency
        .with_label_values(&[route_label])
        .observe(proxy_time.as_secs_f64());
    let ending = |pending: Pending, status: StatusCode| {
        pending.take().finish(
            state,
            Ending {
                verdict: &verdict,
                response: scanned.texts,
                context: scanned.context,
                status: status.as_u16(),
                upstream: Some(upstream_time),
                proxy: proxy_time,
                usage,
                stream_end: None,
            },
        );
    };
    let mut refused = None;
    if verdict.decision == Decision::Block {
        state
            .metrics
            .blocks
            .with_label_values(&[route_label, model_label, "response"])
            .inc();
        let response_hits: Vec<Hit> = verdict
            .hits
            .iter()
            .filter(|h| h.scope == Scope::Response)
            .cloned()
            .collect();
        let message = block_message(if response_hits.is_empty() {
            &verdict.hits
        } else {
            &response_hits
        });
        tracing::info!(request_id, rules = ?rule_ids(&verdict.hits), "response blocked");
        // A body that is not JSON has no answer to turn into a refusal.
        if state.config.guard.on_block == OnBlock::Error || unreadable {
            let out = respond::blocked(
                dialect,
                "response",
                &message,
                &rule_ids(&verdict.hits),
                request_id,
            );
            ending(pending, out.status());
            return out;
        }
        refused = Some(respond::refusal(
            endpoint,
            scanned.redacted.as_deref().unwrap_or(&body),
            &message,
        ));
    }
    // Byte for byte what the upstream sent, unless the guard changed it.
    let body = respond::full(refused.or(scanned.redacted).unwrap_or(body));
    let verdict_name = Some(verdict.decision.as_str());
    let out = guarded_response(status, upstream_headers, body, request_id, verdict_name);
    ending(pending, status);
    out
}

/// A guarded request's body, read whole (to at most `limit` bytes, read
/// or decompressed) and decompressed as its `Content-Encoding` says;
/// whether it was compressed (it goes upstream uncompressed).
async fn read_request(
    state: &State,
    headers: &HeaderMap,
    body: Incoming,
    limit: usize,
) -> Result<(Bytes, bool), Failure> {
    let bytes = read_whole(state, body, limit).await?;
    let encoding = headers.get(header::CONTENT_ENCODING);
    match encoding.is_some_and(|e| e.as_bytes() != b"identity") {
        true => Ok((decode(encoding, bytes, limit)?, true)),
        false => Ok((bytes, false)),
    }
}

/// A request that fairgate reads whole to scan what it sends, outside an
/// exchange (a message batch, items added to a conversation): its head
/// and its body as read (decompressed).
pub(super) struct ReadRequest {
    pub parts: http::request::Parts,
    pub bytes: Bytes,
    /// Whether `bytes` were decompressed from the body sent.
    decoded: bool,
    dialect: Dialect,
}

impl ReadRequest {
    /// Reads `req`'s body ([`read_request`], to at most `limit` bytes);
    /// the error answer in `dialect` when that fails.
    pub(super) async fn of(
        state: &State,
        req: Request<Incoming>,
        (dialect, limit): (Dialect, usize),
        request_id: &str,
    ) -> Result<ReadRequest, Response<ProxyBody>> {
        let (parts, body) = req.into_parts();
        let (bytes, decoded) = match read_request(state, &parts.headers, body, limit).await {
            Ok(read) => read,
            Err(failure) => return Err(respond::failure(dialect, failure, request_id)),
        };
        Ok(ReadRequest {
            parts,
            bytes,
            decoded,
            dialect,
        })
    }

    /// The upstream the request's path routes it to, with the `model` its
    /// body names (a route may pick by it), as an exchange is routed; the
    /// error answer in its dialect when no route takes it.
    pub(super) fn upstream(
        &self,
        state: &State,
        model: Option<&str>,
        request_id: &str,
    ) -> Result<String, Box<Response<ProxyBody>>> {
        let (headers, path) = (&self.parts.headers, self.parts.uri.path());
        match route(state, headers, self.dialect, path, model) {
            Some(route) => Ok(route.upstream.clone()),
            None => Err(Box::new(respond::failure(
                self.dialect,
                Failure::NoRoute,
                request_id,
            ))),
        }
    }

    /// Sends the request to `upstream` with `body` (what was read,
    /// redacted or not), uncompressed; with `identity`, asking for an
    /// uncompressed answer too.
    pub(super) async fn send(
        &self,
        state: &State,
        (upstream, body): (&str, Bytes),
        identity: bool,
    ) -> Result<(Response<upstream::Answer>, Duration), Failure> {
        let head = self.parts.headers.clone();
        let mut headers = upstream_headers(state, upstream, self.dialect, head);
        if self.decoded {
            headers.remove(header::CONTENT_ENCODING);
        }
        if identity {
            headers.insert(
                header::ACCEPT_ENCODING,
                HeaderValue::from_static("identity"),
            );
        }
        let (uri, body) = (&self.parts.uri, upstream::whole(body));
        forward(state, upstream, Method::POST, uri, headers, body).await
    }
}

/// A client's request body, read whole: [`Failure::TooLarge`] past `limit`
/// bytes, [`Failure::ClientTimeout`] when no part of it has come for
/// `client_body_timeout_ms`, [`Failure::BodyBrokeOff`] when the client
/// breaks it off. A body that came in one frame is not copied.
async fn read_whole(state: &State, body: Incoming, limit: usize) -> Result<Bytes, Failure> {
    // Memory is taken as the body arrives, never for the length the
    // client declares: a client that declares the limit and sends a byte
    // would otherwise hold that much of it.
    if http_body::Body::size_hint(&body).lower() > limit as u64 {
        return Err(Failure::TooLarge);
    }
    let mut body = client_body(state, body);
    let (mut first, mut more) = (None::<Bytes>, BytesMut::new());
    while let Some(frame) = next_frame(&mut body).await? {
        let Ok(data) = frame.into_data() else {
            continue; // trailers
        };
        let read = first.as_ref().map_or(0, Bytes::len) + more.len();
        if read + data.len() > limit {
            return Err(Failure::TooLarge);
        }
        match first.take() {
            None if more.is_empty() => first = Some(data),
            earlier => {
                more.extend_from_slice(&earlier.unwrap_or_default());
                more.extend_from_slice(&data);
            }
        }
    }
    Ok(first.unwrap_or_else(|| more.freeze()))
}

/// A client's body, with `client_body_timeout_ms` on each wait for its
/// next part.
fn client_body(state: &State, body: Incoming) -> upstream::ClientBody {
    upstream::ClientBody::new(body, state.config.client_body_timeout())
}

/// The next frame of a client's body read by the proxy:
/// [`Failure::ClientTimeout`] when none has come in time,
/// [`Failure::BodyBrokeOff`] when the client broke the body off.
async fn next_frame(body: &mut upstream::ClientBody) -> Result<Option<Frame<Bytes>>, Failure> {
    match body.frame().await {
        None => Ok(None),
        Some(Ok(frame)) => Ok(Some(frame)),
        Some(Err(error)) if error.is::<upstream::Stalled>() => Err(Failure::ClientTimeout),
        Some(Err(_)) => Err(Failure::BodyBrokeOff),
    }
}

/// A request body compressed as `encoding` says (`gzip` or `deflate`),
/// decompressed to at most `limit` bytes.
fn decode(encoding: Option<&HeaderValue>, body: Bytes, limit: usize) -> Result<Bytes, Failure> {
    use std::io::Read;
    let encoding = encoding.and_then(|e| e.to_str().ok()).unwrap_or_default();
    let mut reader: Box<dyn Read> = match encoding.trim().to_ascii_lowercase().as_str() {
        "gzip" | "x-gzip" => Box::new(flate2::read::GzDecoder::new(&body[..])),
        "deflate" => Box::new(flate2::read::ZlibDecoder::new(&body[..])),
        _ => return Err(Failure::UnsupportedEncoding),
    };
    let mut out = Vec::with_capacity((body.len() * 4).min(limit + 1));
    // One byte past the limit tells a body that is over it.
    match (&mut reader).take(limit as u64 + 1).read_to_end(&mut out) {
        Ok(_) if out.len() > limit => Err(Failure::TooLarge),
        Ok(_) => Ok(Bytes::from(out)),
        Err(_) => Err(Failure::BadEncoding),
    }
}

fn is_json(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.contains("json"))
}

#[allow(clippy::too_many_arguments)]
fn guarded_stream(
    state: &Arc<State>,
    endpoint: Endpoint,
    response: Response<upstream::Answer>,
    timeout: Duration,
    mode: StreamMode,
    rules: Arc<RuleSet>,
    scan: &guard::RequestScan,
    pending: Pending,
    before_upstream: Duration,
    include_usage: bool,
) -> Response<ProxyBody> {
    let (head, body) = response.into_parts();
    let status = head.status;
    let headers = head.headers;
    let Some(draft) = &pending.draft else {
        unreachable!("a pending record's draft is taken once, with the Pending")
    };
    let started = draft.started;
    let request_id = draft.request_id.clone();
    let setup = StreamSetup {
        endpoint,
        mode,
        rules,
        risk: state.config.risk.clone(),
        request_hits: scan.verdict.hits.clone(),
        relevance: scan.relevance.clone(),
        started,
        include_usage,
        prefill: scan.prefill.clone().unwrap_or_default(),
        resume_after: None,
        max_bytes: state.config.guard.max_stream_bytes,
    };
    // From here the guard's outcome records the exchange, however the
    // stream ends (its body dropped included).
    let (route, status_code) = (endpoint.route(), status.as_u16());
    let done = stream_recorder(state, route, status_code, before_upstream, pending.take());
    let body = guard_body(setup, upstream::body_stream(body, timeout), done);
    let verdict = Some(scan.verdict.decision.as_str());
    guarded_response(status, headers, body, &request_id, verdict)
}

/// What records a guarded stream's exchange once its guard reports how it
/// ended (see [`guard_body`]): the metrics of its verdict and its end, and
/// the record, of `status`. `before_upstream`: fairgate's time before the
/// upstream was called.
fn stream_recorder(
    state: &Arc<State>,
    route: &'static str,
    status: u16,
    before_upstream: Duration,
    draft: RecordDraft,
) -> impl FnOnce(StreamOutcome) + Send + 'static {
    let metrics_state = state.clone();
    let upstream_name = draft.upstream.clone();
    let id = draft.request_id.clone();
    move |outcome: StreamOutcome| {
        let metrics = &metrics_state.metrics;
        // fairgate's share: before the upstream call, and the guard's own
        // work on the events; the rest is the upstream's.
        let proxy = before_upstream + outcome.guard_time;
        metrics
            .added_latency
            .with_label_values(&[route])
            .observe(proxy.as_secs_f64());
        record_verdict(metrics, &outcome.verdict);
        let decision = outcome.verdict.decision;
        let model = metrics_state
            .config
            .metrics
            .model_label(draft.model.as_deref());
        metrics
            .requests
            .with_label_values(&[route, &upstream_name, model, decision.as_str()])
            .inc();
        if decision == Decision::Block {
            metrics
                .blocks
                .with_label_values(&[route, model, "response"])
                .inc();
            tracing::info!(request_id = id, rules = ?rule_ids(&outcome.verdict.hits), "stream blocked");
        }
        if let Some(first) = outcome.first_byte {
            metrics
                .stream_first_byte
                .with_label_values(&[route])
                .observe(first.as_secs_f64());
        }
        if outcome.malformed {
            metrics
                .stream_errors
                .with_label_values(&[route, "malformed"])
                .inc();
        }
        if outcome.upstream_failed {
            metrics
                .stream_errors
                .with_label_values(&[route, "upstream"])
                .inc();
        }
        metrics
            .stream_ends
            .with_label_values(&[route, outcome.end.as_str()])
            .inc();
        if outcome.end == StreamEnd::ClientClosed {
            tracing::info!(request_id = id, "the client left the stream before its end");
        }
        if outcome.faulted {
            metrics.faults.with_label_values(&["stream"]).inc();
            tracing::error!(
                request_id = id,
                "a fault while guarding the stream: ended it with an error event"
            );
        }
        let total = draft.started.elapsed();
        draft.finish(
            &metrics_state,
            Ending {
                verdict: &outcome.verdict,
                response: vec![outcome.text],
                context: outcome.context,
                status,
                upstream: Some(total.saturating_sub(proxy)),
                proxy,
                usage: outcome.usage,
                stream_end: Some(outcome.end),
            },
        );
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn plain_paths_are_decoded_and_normalized_and_plain_ones_left_alone() {
        for path in [
            "/v1/chat/completions",
            "/v1/files/file-abc/content",
            "/",
            "",
        ] {
            assert_eq!(plain_path(path), None, "{path}");
        }
        for (path, plain) in [
            ("//v1/chat/completions", "/v1/chat/completions"),
            ("/v1//chat/completions/", "/v1/chat/completions"),
            ("/v1/./messages", "/v1/messages"),
            ("/v1/a/b/../../responses", "/v1/responses"),
            ("/../../v1/responses", "/v1/responses"),
            ("/v1/chat%2Fcompletions", "/v1/chat/completions"),
            ("/v1/%2e%2e/v1/messages", "/v1/messages"),
            ("/v1/chat;x=1/completions;y", "/v1/chat/completions"),
            ("/v1/files/%ff", "/v1/files/\u{fffd}"),
            ("/V1/Chat/Completions", "/v1/chat/completions"),
            ("/v1/files/file-AbC/content", "/v1/files/file-abc/content"),
        ] {
            assert_eq!(plain_path(path).as_deref(), Some(plain), "{path}");
        }
    }

    /// A fault in a handler is answered, over a real connection, with a
    /// 500 in the caller's dialect that SDKs do not retry; the connection
    /// stays open for the client's next request, and the fault is counted.
    #[tokio::test]
    async fn a_handler_that_panics_is_answered_500_in_the_callers_dialect() {
        let metrics = Arc::new(Metrics::new());
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let served = metrics.clone();
        let connections = Arc::new(AtomicU64::new(0));
        let accepted = connections.clone();
        tokio::spawn(async move {
            loop {
                let (stream, _) = listener.accept().await.unwrap();
                accepted.fetch_add(1, Ordering::Relaxed);
                let metrics = served.clone();
                let service = service_fn(move |req: Request<Incoming>| {
                    let metrics = metrics.clone();
                    async move {
                        let dialect = dialect_of(req.headers(), req.uri().path());
                        let fails = req.uri().query() == Some("fail");
                        let handled = async move {
                            assert!(!fails, "a fault in the handler");
                            respond::text(StatusCode::OK, "fine".to_owned())
                        };
                        Ok::<_, Infallible>(caught(handled, &metrics, dialect, "req-7").await)
                    }
                });
                let builder = auto::Builder::new(TokioExecutor::new());
                tokio::spawn(async move {
                    let _ = builder
                        .serve_connection(TokioIo::new(stream), service)
                        .await;
                });
            }
        });
        let client = reqwest::Client::builder()
            .pool_max_idle_per_host(1)
            .build()
            .unwrap();
        let base = format!("http://{addr}");
        for (path, kind) in [
            ("/v1/chat/completions", "/error/type"),
            ("/v1/messages", "/error/type"),
        ] {
            let response = client
                .post(format!("{base}{path}?fail"))
                .body("{}")
                .send()
                .await
                .unwrap();
            assert_eq!(response.status(), 500, "{path}");
            let headers = response.headers();
            assert_eq!(headers["x-should-retry"], "false");
            assert_eq!(headers["x-fairgate-request-id"], "req-7");
            let body: serde_json::Value = response.json().await.unwrap();
            let expected = match path {
                "/v1/messages" => "api_error",
                _ => "server_error",
            };
            assert_eq!(body.pointer(kind).unwrap(), expected, "{body}");
            assert!(body.to_string().contains("internal fault"), "{body}");
            if path == "/v1/messages" {
                assert_eq!(body["type"], "error");
            } else {
                assert_eq!(body["error"]["code"], "internal_error");
            }
            let next = client.post(format!("{base}{path}")).send().await.unwrap();
            assert_eq!(next.text().await.unwrap(), "fine");
        }
        let faults = metrics.faults.with_label_values(&["request"]).get();
        assert_eq!(faults, 2);
        assert_eq!(connections.load(Ordering::Relaxed), 1);
    }

    /// An exchange whose handler ends before it finishes the record is
    /// still recorded when its future goes: with status 500 when a fault
    /// unwound it (the 500 the client was answered with), with 499 when it
    /// was dropped (its client left). The record is held across an await,
    /// as in the handler, so it is the future's state that the unwinding
    /// drops.
    #[tokio::test]
    async fn an_exchange_a_fault_or_a_leaving_client_ends_is_still_recorded() {
        let state = State::new(Config::default()).unwrap();
        let mut records = state.queue.take_receiver().unwrap();
        let verdict = risk::assess(&state.config.risk, Vec::new(), &[]);
        let draft = |id: &str| RecordDraft {
            request_id: id.to_owned(),
            started: Instant::now(),
            started_ms: now_ms(),
            route: Endpoint::Messages.route(),
            dialect: Dialect::Anthropic,
            upstream: "anthropic".to_owned(),
            upstream_request_id: None,
            model: Some("claude-test".to_owned()),
            stream: false,
            custom_id: None,
            client: ClientMeta::default(),
            prompt: vec!["Where do I start?".to_owned()],
            context: Vec::new(),
        };
        let exchange = |id: &'static str, fails: bool| {
            let (state, verdict) = (&state, &verdict);
            async move {
                let mut pending = Pending::new(state, verdict, draft(id));
                pending.sent = Some(Instant::now());
                tokio::task::yield_now().await;
                assert!(!fails, "a fault in the handler");
                // The upstream's answer never comes.
                std::future::pending::<()>().await;
                respond::text(StatusCode::OK, "answered".to_owned())
            }
        };

        let faulted = caught(
            exchange("fg-fault", true),
            &state.metrics,
            Dialect::Anthropic,
            "fg-fault",
        );
        assert_eq!(faulted.await.status(), 500);
        let left = tokio::time::timeout(Duration::from_millis(50), exchange("fg-left", false));
        assert!(left.await.is_err(), "the client left before the answer");

        for (id, status, counted) in [
            ("fg-fault", 500, "error"),
            ("fg-left", 499, "client_closed"),
        ] {
            let Ok(QueueItem::Exchange(record)) = records.try_recv() else {
                panic!("no record of {id}");
            };
            assert_eq!(record.request_id, id);
            assert_eq!(record.status, status, "{id}");
            assert_eq!(record.route, "messages");
            assert_eq!(record.texts.prompt, ["Where do I start?"]);
            assert!(record.texts.response.is_empty());
            assert!(record.upstream_ms.is_some());
            let requests = &state.metrics.requests;
            let count = requests.with_label_values(&["messages", "anthropic", "other", counted]);
            assert_eq!(count.get(), 1, "{id}");
        }
        assert!(records.try_recv().is_err(), "one record each");
    }

    /// A busy HTTP/2 connection's list of answers keeps the open ones and
    /// not every one it ever served.
    #[test]
    fn the_answers_of_a_connection_do_not_pile_up() {
        let requests = Arc::new(Requests::new());
        let kept: Vec<Open> = (0..10).map(|_| Open::new(&requests)).collect();
        for _ in 0..10_000 {
            drop(Open::new(&requests));
        }
        let listed = requests.answers.lock().unwrap().len();
        assert!(listed < 2 * kept.len() + 17, "{listed} answers listed");
        assert_eq!(requests.open.load(Ordering::Relaxed), 10);
        kept[3].held.store(1, Ordering::Relaxed);
        assert!(requests.stalled(Duration::ZERO));
    }

    #[test]
    fn a_body_is_read_as_the_sdks_json_readers_read_it() {
        let read = |body: &'static [u8]| as_sdks_read(Bytes::from_static(body));
        assert_eq!(read(b"\xef\xbb\xbf{\"a\":1}").unwrap(), &b"{\"a\":1}"[..]);
        assert_eq!(read(b"{\"a\":1}").unwrap(), &b"{\"a\":1}"[..]);
        // Not JSON, but UTF-8: read as plain text further on.
        for plain in [&b""[..], b"x", b"\x00", b"ab\x00", b"<html>"] {
            assert_eq!(read(plain).unwrap(), plain);
        }
        for wide in [
            &b"\xff\xfe{\x00"[..],
            b"\xfe\xff\x00{",
            b"\x00\x00\xfe\xff",
            b"{\x00\"\x00",
            b"\x00{\x00\"",
            b"{\x00\x00\x00",
            b"\x00\x00\x00{",
            b"{\x00",
        ] {
            assert!(read(wide).is_none(), "{wide:?}");
        }
    }

    #[test]
    fn hex_is_written_as_format_writes_it() {
        for value in [0, 1, 0xf, 0x10, 0xabc, 0xffff_ffff_ffff, u64::MAX] {
            let mut out = String::from("x");
            push_hex(&mut out, value);
            assert_eq!(out, format!("x{value:x}"));
        }
    }
}

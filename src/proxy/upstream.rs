//! The client side of the proxy: the connections to each upstream, kept
//! open between requests (HTTP/1.1 keep-alive, HTTP/2 when the upstream
//! offers it by ALPN, TLS by rustls with the webpki roots), and the
//! timeout of each wait on an upstream.
//!
//! Each serving thread has its own [`UpstreamClient`] per upstream, so that
//! a connection is driven by the thread that uses it. Its pool is a short
//! list on hyper's connection API rather than hyper-util's legacy client,
//! which keys its pool by scheme and authority (hashed on every request),
//! spawns a task per HTTP/1 request to put the connection back, races a
//! lazy connect against every checkout and builds the `Host` header from
//! the URI each time: together some 10k instructions per request, about 8%
//! of a guarded exchange (`benches/README.md`). A proxy relays requests as
//! they are, so it needs none of a full client's URL parsing, redirects,
//! retries or cookies either.
//!
//! What the pool keeps of hyper-util's behaviour: a connection the upstream
//! closed is never handed out; a request that a reused connection did not
//! take (closed between the check and the send) is sent again, once, on a
//! new connection; one HTTP/2 connection is shared by all requests. An
//! HTTP/1 connection goes back into the pool when its answer's body has
//! been read to the end ([`Answer`]), with no task spawned to wait for
//! that; one whose answer is dropped before its end is closed by hyper.
//! A connection unused for the upstream's `idle_timeout_ms` is closed,
//! and one the upstream closed is let go, within a second: each serving
//! thread sweeps its pools once a second ([`sweep_idle`]), in its accept
//! loop, rather than keeping a timer task per connection as hyper-util does.

use std::cell::RefCell;
use std::collections::VecDeque;
use std::future::poll_fn;
use std::pin::Pin;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::{Duration, Instant};

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::uri::{Authority, PathAndQuery, Scheme};
use http::{HeaderMap, HeaderValue, Method, Request, Response, Uri, header};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::{Body, Frame, Incoming, SizeHint};
use hyper::client::conn::{TrySendError, http1, http2};
use hyper_rustls::builderstates::WantsSchemes;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::connect::{Connection, HttpConnector};
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tower_service::Service;

use super::BoxError;
use super::respond::Failure;
use crate::config::UpstreamConfig;

/// A request body sent upstream: a guarded request's (read and scanned) or
/// a passed-through request's, streamed as it arrives ([`Upload`]; boxed,
/// so that the body, held in each future on its way up, is as small as a
/// whole one).
pub type UpstreamBody = Either<Full<Bytes>, Box<Upload>>;

/// A client's body of which the proxy read the start (a file upload too
/// large to read whole): that start, then the rest as it arrives.
pub type ReadOn = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// The body of [`ReadOn`]: `start`, then `rest`.
pub fn read_on(start: Bytes, rest: ClientBody) -> UpstreamBody {
    let start = futures_util::stream::iter([Ok(Frame::data(start))]);
    let body = http_body_util::StreamBody::new(start.chain(rest.into_frames()));
    Upload::new(Either::Right(BodyExt::boxed(body)))
}

/// How much of a body read whole goes up at a time ([`whole`]).
const PIECE: usize = 1 << 20;

/// A body fairgate read whole (a guarded request's), to go upstream. One
/// larger than `PIECE` goes in pieces of that size as an [`Upload`], so
/// that the upstream's timeout bounds its taking of each piece rather than
/// of them all (50 MB of images over a slow link may take longer than
/// `timeout_ms` to send); a smaller one goes in one.
pub fn whole(body: Bytes) -> UpstreamBody {
    if body.len() <= PIECE {
        return Either::Left(Full::new(body));
    }
    Upload::new(Either::Right(BodyExt::boxed(Pieces(body))))
}

/// A body read whole, given [`PIECE`] by [`PIECE`], its length known (so
/// that it goes with a `content-length`, as it would in one piece).
struct Pieces(Bytes);

impl Body for Pieces {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        _: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let rest = &mut self.get_mut().0;
        if rest.is_empty() {
            return Poll::Ready(None);
        }
        let piece = rest.split_to(PIECE.min(rest.len()));
        Poll::Ready(Some(Ok(Frame::data(piece))))
    }

    fn is_end_stream(&self) -> bool {
        self.0.is_empty()
    }

    fn size_hint(&self) -> SizeHint {
        SizeHint::with_exact(self.0.len() as u64)
    }
}

/// A request body that goes upstream as it arrives from the client (its
/// start, when the proxy has read that, sent first: [`ReadOn`]), noting
/// when it last moved: the wait for the answer's head is counted from the
/// upstream's taking of the body's last part, not from its first ([`send`]),
/// so that an upload longer than the upstream's timeout is not cut off
/// while it is still going up.
pub struct Upload {
    body: Either<ClientBody, ReadOn>,
    progress: Arc<Progress>,
}

impl Upload {
    pub fn new(body: Either<ClientBody, ReadOn>) -> UpstreamBody {
        Either::Right(Box::new(Upload {
            body,
            progress: Arc::new(Progress {
                start: tokio::time::Instant::now(),
                moved: AtomicU64::new(0),
            }),
        }))
    }
}

impl Body for Upload {
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        this.progress.note(polled.is_pending());
        polled
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// When an [`Upload`] last moved: microseconds from its start, with
/// [`Progress::WAITING`] set while it waits on the client (whose own
/// `client_body_timeout_ms` then bounds the wait).
struct Progress {
    start: tokio::time::Instant,
    moved: AtomicU64,
}

impl Progress {
    const WAITING: u64 = 1 << 63;

    /// Notes that the body moved now, or that it waits on the client:
    /// from now, if it did not already.
    fn note(&self, waiting: bool) {
        if waiting && self.moved.load(Ordering::Relaxed) & Progress::WAITING != 0 {
            return;
        }
        let at = u64::try_from(self.start.elapsed().as_micros()).unwrap_or(u64::MAX >> 1);
        let flag = if waiting { Progress::WAITING } else { 0 };
        self.moved.store(at | flag, Ordering::Relaxed);
    }

    /// When the wait on the upstream ends: `timeout` after the body last
    /// moved, or after now while the client is what it waits on.
    fn deadline(&self, timeout: Duration) -> tokio::time::Instant {
        let moved = self.moved.load(Ordering::Relaxed);
        if moved & Progress::WAITING != 0 {
            return tokio::time::Instant::now() + timeout;
        }
        self.start + Duration::from_micros(moved) + timeout
    }
}

/// A body that fails when nothing of it has come for a while, while it
/// is waited on: the timer is armed only when its next frame is not
/// already there.
pub struct Watched<B> {
    body: B,
    stall: super::stall::Stall,
    /// The error it fails with.
    silent: fn() -> BoxError,
    /// What the body's own errors become.
    broken: fn(BoxError) -> BoxError,
}

/// A client's body, read whole by the proxy or going upstream as it
/// arrives. It fails with [`Stalled`]
/// when no part of it has come for `idle` (`client_body_timeout_ms`), so
/// that a client that stops sending holds neither its request nor an
/// upstream connection for as long as the upstream's own timeout.
pub type ClientBody = Watched<Incoming>;

/// The error of a [`ClientBody`] whose client stopped sending it.
#[derive(Debug, thiserror::Error)]
#[error("the client's request body stopped arriving")]
pub struct Stalled;

/// The error of a [`ClientBody`] that broke off: its client closed the
/// connection before the body's end, or sent it malformed (a bad chunk).
#[derive(Debug, thiserror::Error)]
#[error("the client's request body broke off: {0}")]
pub struct BrokeOff(BoxError);

/// The error of an upstream's answer that stopped arriving
/// ([`Answer::watched`]).
#[derive(Debug, thiserror::Error)]
#[error("the upstream sent nothing more within its timeout")]
pub struct Silent;

impl ClientBody {
    pub fn new(body: Incoming, idle: Option<Duration>) -> ClientBody {
        Watched {
            body,
            stall: super::stall::Stall::new(idle),
            silent: || Box::new(Stalled),
            broken: |error| Box::new(BrokeOff(error)),
        }
    }
}

impl<B> Watched<B> {
    /// The body's frames as a stream.
    pub fn into_frames(self) -> http_body_util::BodyStream<Watched<B>> {
        http_body_util::BodyStream::new(self)
    }
}

impl<B> Body for Watched<B>
where
    B: Body<Data = Bytes> + Unpin,
    B::Error: Into<BoxError>,
{
    type Data = Bytes;
    type Error = BoxError;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, BoxError>>> {
        let this = self.get_mut();
        let polled = Pin::new(&mut this.body).poll_frame(cx);
        this.stall.watch(polled, cx).map(|frame| match frame {
            Some(frame) => frame.map(|frame| frame.map_err(|e| (this.broken)(e.into()))),
            None => Some(Err((this.silent)())),
        })
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

/// An upstream's answer body. On a pooled HTTP/1 connection, the
/// connection goes back into its pool once the body has been read to its
/// end (or is dropped at its end), so the pool holds only connections that
/// are done with their answers.
pub struct Answer {
    body: Incoming,
    back: Option<(Arc<Pool>, http1::SendRequest<UpstreamBody>)>,
}

impl Answer {
    /// The body, failing with [`Silent`] when the upstream has sent
    /// nothing of it for `timeout` (its `timeout_ms`).
    pub fn watched(self, timeout: Duration) -> Watched<Answer> {
        Watched {
            body: self,
            stall: super::stall::Stall::new(Some(timeout)),
            silent: || Box::new(Silent),
            broken: |error| error,
        }
    }

    /// Puts the connection back, if it goes back and has not yet.
    fn give_back(&mut self) {
        if let Some((pool, sender)) = self.back.take() {
            pool.put_back(sender);
        }
    }
}

impl Body for Answer {
    type Data = Bytes;
    type Error = hyper::Error;

    fn poll_frame(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<Frame<Bytes>, hyper::Error>>> {
        let this = self.get_mut();
        let frame = Pin::new(&mut this.body).poll_frame(cx);
        if let Poll::Ready(None) = frame {
            this.give_back();
        }
        frame
    }

    fn is_end_stream(&self) -> bool {
        self.body.is_end_stream()
    }

    fn size_hint(&self) -> SizeHint {
        self.body.size_hint()
    }
}

impl Drop for Answer {
    fn drop(&mut self) {
        // A body read to its last byte but not polled for its end; one
        // dropped before that leaves its connection to be closed.
        if self.body.is_end_stream() {
            self.give_back();
        }
    }
}

thread_local! {
    /// This serving thread's clients ([`UpstreamClient::of_this_thread`]).
    static CLIENTS: RefCell<Vec<UpstreamClient>> = Default::default();
}

/// Closes the connections in this serving thread's pools that have been
/// unused for longer than their upstream's `idle_timeout_ms`, and lets go
/// of those the upstream has closed. Each serving thread calls it once a
/// second.
pub fn sweep_idle() {
    CLIENTS.with_borrow(|clients| {
        for client in clients {
            client.pool.sweep();
        }
    });
}

/// The connections of one serving thread to one upstream. Cloning it is
/// cheap and shares the pool.
#[derive(Clone)]
pub struct UpstreamClient {
    pool: Arc<Pool>,
}

struct Pool {
    /// The upstream's base URL as configured, to find this client again.
    url: String,
    connect_timeout_ms: u64,
    /// How long a connection may stay unused in the pool.
    idle_timeout: Duration,
    /// Offers HTTP/2 and HTTP/1.1 by ALPN.
    connector: HttpsConnector<HttpConnector>,
    /// Offers HTTP/1.1 only: an upgrade has no meaning on HTTP/2.
    upgrade_connector: HttpsConnector<HttpConnector>,
    /// `scheme://authority` of the upstream, what the connectors dial.
    origin: Uri,
    scheme: Scheme,
    authority: Authority,
    /// The base URL's path, without its final `/`, put before every path.
    prefix: String,
    /// The `Host` header of HTTP/1 requests (HTTP/2 has `:authority`).
    host: HeaderValue,
    idle: Mutex<Idle>,
}

#[derive(Default)]
struct Idle {
    /// HTTP/1 connections done with their answers, with when they were
    /// last seen in use, oldest first.
    http1: VecDeque<(http1::SendRequest<UpstreamBody>, Instant)>,
    /// The HTTP/2 connection, with when a request last took it.
    http2: Option<(http2::SendRequest<UpstreamBody>, Instant)>,
}

enum Sender {
    Http1(http1::SendRequest<UpstreamBody>),
    Http2(http2::SendRequest<UpstreamBody>),
}

/// Why an upstream exchange failed.
#[derive(Debug, thiserror::Error)]
pub enum SendError {
    #[error("cannot connect: {0}")]
    Connect(BoxError),
    #[error("{0}")]
    Request(BoxError),
}

/// How one attempt on a connection ended, when it did not end in a response.
enum Unsent {
    /// The connection did not take the request: it can go on another.
    Returned(Box<Request<UpstreamBody>>),
    Failed(SendError),
}

impl UpstreamClient {
    /// A client of `upstream`, with no connection yet; `None` when its URL
    /// has no host.
    pub fn new(upstream: &UpstreamConfig) -> Option<UpstreamClient> {
        UpstreamClient::with_tls(upstream, || {
            HttpsConnectorBuilder::new().with_webpki_roots()
        })
    }

    /// [`UpstreamClient::new`] with the TLS settings `tls` makes (each
    /// connector offers its own ALPN protocols).
    fn with_tls(
        upstream: &UpstreamConfig,
        tls: impl Fn() -> HttpsConnectorBuilder<WantsSchemes>,
    ) -> Option<UpstreamClient> {
        let base = Uri::try_from(upstream.url.trim_end_matches('/')).ok()?;
        let (scheme, authority) = (base.scheme()?.clone(), base.authority()?.clone());
        let origin = Uri::builder()
            .scheme(scheme.clone())
            .authority(authority.clone())
            .path_and_query("/")
            .build()
            .ok()?;
        let default_port = if scheme == Scheme::HTTPS { 443 } else { 80 };
        let host = match authority.port_u16() {
            Some(port) if port != default_port => authority.as_str(),
            _ => authority.host(),
        };
        let mut http = HttpConnector::new();
        http.set_connect_timeout(Some(Duration::from_millis(upstream.connect_timeout_ms)));
        http.set_nodelay(true);
        http.enforce_http(false);
        let https = || tls().https_or_http().enable_http1();
        Some(UpstreamClient {
            pool: Arc::new(Pool {
                url: upstream.url.clone(),
                connect_timeout_ms: upstream.connect_timeout_ms,
                idle_timeout: Duration::from_millis(upstream.idle_timeout_ms),
                connector: https().enable_http2().wrap_connector(http.clone()),
                upgrade_connector: https().wrap_connector(http),
                prefix: base.path().trim_end_matches('/').to_owned(),
                host: HeaderValue::from_str(host).ok()?,
                origin,
                scheme,
                authority,
                idle: Mutex::default(),
            }),
        })
    }

    /// This thread's client of `upstream`, made on first use; `None` when
    /// its URL has no host. Each serving thread keeps its own connections,
    /// so that a connection is driven by the thread that uses it, with no
    /// wake-ups across threads. Clients are told apart by their settings,
    /// not their names: proxies in one process (tests) may name different
    /// upstreams alike.
    pub fn of_this_thread(upstream: &UpstreamConfig) -> Option<UpstreamClient> {
        CLIENTS.with_borrow_mut(|clients| {
            if let Some(client) = clients.iter().find(|client| client.serves(upstream)) {
                return Some(client.clone());
            }
            let client = UpstreamClient::new(upstream)?;
            clients.push(client.clone());
            Some(client)
        })
    }

    /// Whether this is the client of `upstream` (the same URL and settings).
    fn serves(&self, upstream: &UpstreamConfig) -> bool {
        let pool = &self.pool;
        pool.url == upstream.url
            && pool.connect_timeout_ms == upstream.connect_timeout_ms
            && pool.idle_timeout == Duration::from_millis(upstream.idle_timeout_ms)
    }

    /// Sends `method path_and_query` with `headers` and `body` and waits for
    /// the response head. With `upgrade`, on a connection of its own that
    /// is never pooled and can be taken over (`hyper::upgrade::on`).
    async fn request(
        &self,
        method: Method,
        path_and_query: &str,
        headers: HeaderMap,
        body: UpstreamBody,
        upgrade: bool,
    ) -> Result<Response<Answer>, SendError> {
        let mut request = Request::new(body);
        *request.method_mut() = method;
        *request.headers_mut() = headers;
        let pool = &self.pool;
        let path = if pool.prefix.is_empty() {
            Bytes::copy_from_slice(path_and_query.as_bytes())
        } else {
            Bytes::from([pool.prefix.as_str(), path_and_query].concat())
        };
        let reused = if upgrade { None } else { pool.checkout() };
        let request = match reused {
            Some(sender) => match self.send_on(sender, request, &path, true).await {
                Ok(response) => return Ok(response),
                Err(Unsent::Returned(request)) => *request,
                Err(Unsent::Failed(error)) => return Err(error),
            },
            None => request,
        };
        let sender = pool.connect(upgrade).await?;
        match self.send_on(sender, request, &path, !upgrade).await {
            Ok(response) => Ok(response),
            Err(Unsent::Returned(_)) => Err(SendError::Request(
                "the upstream closed a new connection before the request was sent".into(),
            )),
            Err(Unsent::Failed(error)) => Err(error),
        }
    }

    /// Sends `request` for `path` on `sender`; with `pool`, an HTTP/1
    /// connection goes back to the pool once its answer has been read
    /// ([`Answer`]).
    async fn send_on(
        &self,
        sender: Sender,
        mut request: Request<UpstreamBody>,
        path: &Bytes,
        pool: bool,
    ) -> Result<Response<Answer>, Unsent> {
        let failed = |error: BoxError| Unsent::Failed(SendError::Request(error));
        let unsent = |mut error: TrySendError<Request<UpstreamBody>>| match error.take_message() {
            Some(request) => Unsent::Returned(Box::new(request)),
            None => failed(Box::new(error.into_error())),
        };
        match sender {
            Sender::Http1(mut sender) => {
                // Origin form, as HTTP/1 asks of a request that is not
                // to a proxy.
                *request.uri_mut() =
                    Uri::from_maybe_shared(path.clone()).map_err(|e| failed(e.into()))?;
                request
                    .headers_mut()
                    .insert(header::HOST, self.pool.host.clone());
                let response = sender.try_send_request(request).await.map_err(unsent)?;
                let back = pool.then(|| (self.pool.clone(), sender));
                Ok(response.map(|body| Answer { body, back }))
            }
            Sender::Http2(mut sender) => {
                *request.uri_mut() = Uri::builder()
                    .scheme(self.pool.scheme.clone())
                    .authority(self.pool.authority.clone())
                    .path_and_query(
                        PathAndQuery::from_maybe_shared(path.clone())
                            .map_err(|e| failed(e.into()))?,
                    )
                    .build()
                    .map_err(|e| failed(e.into()))?;
                request.headers_mut().remove(header::HOST);
                let response = sender.try_send_request(request).await.map_err(unsent)?;
                Ok(response.map(|body| Answer { body, back: None }))
            }
        }
    }
}

impl Pool {
    /// A connection ready for a request, if one is open: the HTTP/2 one, or
    /// the HTTP/1 one put back longest ago. One that hyper has not yet
    /// made ready after its answer's end goes to the back; those found
    /// closed or idle too long are dropped.
    fn checkout(&self) -> Option<Sender> {
        let mut idle = self.idle.lock().ok()?;
        let now = Instant::now();
        if let Some((http2, seen)) = &mut idle.http2 {
            if self.usable(http2.is_closed(), *seen, now) {
                *seen = now;
                return Some(Sender::Http2(http2.clone()));
            }
            idle.http2 = None;
        }
        for _ in 0..idle.http1.len() {
            let (sender, seen) = idle.http1.pop_front()?;
            if !self.usable(sender.is_closed(), seen, now) {
                continue;
            }
            if sender.is_ready() {
                return Some(Sender::Http1(sender));
            }
            // Not ready yet: idle from no earlier than now.
            idle.http1.push_back((sender, now));
        }
        None
    }

    /// Puts an HTTP/1 connection whose answer has been read back into the
    /// pool.
    fn put_back(&self, sender: http1::SendRequest<UpstreamBody>) {
        if let Ok(mut idle) = self.idle.lock() {
            idle.http1.push_back((sender, Instant::now()));
        }
    }

    /// Drops the connections unused for longer than the idle timeout, and
    /// those the upstream has closed. Dropped, an HTTP/1 connection is
    /// closed; the HTTP/2 one once the requests that took it are done.
    fn sweep(&self) {
        let Ok(mut idle) = self.idle.lock() else {
            return;
        };
        let now = Instant::now();
        idle.http1
            .retain(|(sender, seen)| self.usable(sender.is_closed(), *seen, now));
        if let Some((http2, seen)) = &idle.http2
            && !self.usable(http2.is_closed(), *seen, now)
        {
            idle.http2 = None;
        }
    }

    /// Whether a pooled connection can take a request at `now`: it is open,
    /// and was last used (`seen`) no longer than the idle timeout ago.
    fn usable(&self, closed: bool, seen: Instant, now: Instant) -> bool {
        !closed && now.duration_since(seen) <= self.idle_timeout
    }

    /// Opens a connection: HTTP/2 when the upstream chose it by ALPN (it is
    /// then shared), HTTP/1.1 otherwise.
    async fn connect(&self, upgrade: bool) -> Result<Sender, SendError> {
        let mut connector = if upgrade {
            self.upgrade_connector.clone()
        } else {
            self.connector.clone()
        };
        poll_fn(|cx| connector.poll_ready(cx))
            .await
            .map_err(SendError::Connect)?;
        let io = connector
            .call(self.origin.clone())
            .await
            .map_err(SendError::Connect)?;
        let handshake = |error: hyper::Error| SendError::Connect(Box::new(error));
        if !upgrade && io.connected().is_negotiated_h2() {
            let (sender, connection) = handshake_http2(io).await.map_err(handshake)?;
            drive(connection);
            if let Ok(mut idle) = self.idle.lock() {
                idle.http2
                    .get_or_insert_with(|| (sender.clone(), Instant::now()));
            }
            return Ok(Sender::Http2(sender));
        }
        let (mut sender, connection) = handshake_http1(io).await.map_err(handshake)?;
        if upgrade {
            drive(connection.with_upgrades());
        } else {
            drive(connection);
        }
        sender.ready().await.map_err(handshake)?;
        Ok(Sender::Http1(sender))
    }
}

/// A connection to an upstream, TLS or not.
type Io = hyper_rustls::MaybeHttpsStream<hyper_util::rt::TokioIo<tokio::net::TcpStream>>;

/// A boxed future; see [`handshake_http1`].
type Boxed<T> = Pin<Box<dyn Future<Output = hyper::Result<T>> + Send>>;

/// hyper's HTTP/1 handshake on `io`. Boxed in a function of its own: awaited
/// inside an `async fn`, the compiler cannot prove the handshake's future
/// `Send` for every lifetime of the body's error (its `Into` bound).
fn handshake_http1(
    io: Io,
) -> Boxed<(
    http1::SendRequest<UpstreamBody>,
    http1::Connection<Io, UpstreamBody>,
)> {
    Box::pin(http1::handshake(io))
}

/// hyper's HTTP/2 handshake on `io` (see [`handshake_http1`]).
fn handshake_http2(
    io: Io,
) -> Boxed<(
    http2::SendRequest<UpstreamBody>,
    http2::Connection<Io, UpstreamBody, TokioExecutor>,
)> {
    Box::pin(
        http2::Builder::new(TokioExecutor::new())
            .timer(TokioTimer::new())
            .handshake(io),
    )
}

/// Runs a connection on the current runtime until it ends (in a function
/// of its own for the reason given at [`handshake_http1`]).
fn drive(connection: impl Future<Output = hyper::Result<()>> + Send + 'static) {
    tokio::spawn(async move {
        if let Err(error) = connection.await {
            tracing::debug!(%error, "upstream connection ended with an error");
        }
    });
}

/// Why an upstream exchange failed, with the label it is counted under.
/// A client's body that failed the request is labelled `client`: not the
/// upstream's failure.
pub fn classify(error: &SendError) -> (Failure, &'static str) {
    if from_client_body::<Stalled>(error) {
        return (Failure::ClientTimeout, "client");
    }
    if from_client_body::<BrokeOff>(error) {
        return (Failure::BodyBrokeOff, "client");
    }
    match error {
        SendError::Connect(_) => (Failure::UpstreamUnreachable, "connect"),
        SendError::Request(_) => (Failure::UpstreamBroken, "other"),
    }
}

/// Whether `error` is that of a client's body going up with the request
/// ([`Stalled`] or [`BrokeOff`]), which fails the request.
fn from_client_body<E: std::error::Error + 'static>(error: &SendError) -> bool {
    let SendError::Request(error) = error else {
        return false;
    };
    let mut source: Option<&(dyn std::error::Error + 'static)> = Some(&**error);
    while let Some(error) = source {
        if error.is::<E>() {
            return true;
        }
        source = error.source();
    }
    false
}

/// The failure of an exchange whose upstream was silent for its timeout.
pub const TIMED_OUT: (Failure, &str) = (Failure::UpstreamTimeout, "timeout");

/// Sends `method path_and_query` with `headers` and `body` on `client`, and
/// waits for the response head for up to `timeout`; with `upgrade`, on a
/// connection of its own (see [`UpstreamClient`]).
///
/// An upstream's `timeout_ms` bounds each wait on it, as the SDKs' own
/// read and write timeouts do: for it to take each part of a body sent as
/// it arrives ([`Upload`]), for the answer's head here, then for each part
/// of the answer's body ([`read_body`], [`body_stream`]). It is not a
/// deadline on the whole exchange: an upload goes on for as long as the
/// client keeps sending and the upstream keeps taking it, a stream for as
/// long as the upstream keeps sending (a model writing 64,000 tokens takes
/// some twenty minutes).
pub async fn send(
    client: &UpstreamClient,
    method: Method,
    path_and_query: &str,
    headers: HeaderMap,
    body: UpstreamBody,
    timeout: Duration,
    upgrade: bool,
) -> Result<Response<Answer>, (Failure, &'static str, Option<BoxError>)> {
    let progress = match &body {
        Either::Left(_) => None,
        Either::Right(upload) => Some(upload.progress.clone()),
    };
    // Pinned where it is made: the future is large, and each move of it
    // is a copy (a second place for it would grow every future it is in).
    let mut sent = std::pin::pin!(client.request(method, path_and_query, headers, body, upgrade));
    let mut deadline = tokio::time::Instant::now() + timeout;
    let answered = loop {
        if let Ok(answered) = tokio::time::timeout_at(deadline, sent.as_mut()).await {
            break Some(answered);
        }
        // An upload that moved since restarts the wait.
        match progress.as_ref().map(|progress| progress.deadline(timeout)) {
            Some(later) if later > deadline => deadline = later,
            _ => break None,
        }
    };
    match answered {
        Some(Ok(response)) => Ok(response),
        Some(Err(error)) => {
            let (failure, kind) = classify(&error);
            Err((failure, kind, Some(Box::new(error))))
        }
        None => Err((TIMED_OUT.0, TIMED_OUT.1, None)),
    }
}

/// Reads a whole response body of at most `limit` bytes, the upstream
/// silent for no more than `timeout` at a time.
pub async fn read_body(body: Answer, limit: usize, timeout: Duration) -> Result<Bytes, BoxError> {
    let collected = Limited::new(body.watched(timeout), limit).collect().await?;
    Ok(collected.to_bytes())
}

/// A response body as a stream of chunks that fails when the upstream has
/// been silent for `timeout`, and ends at its first error.
pub fn body_stream(
    body: Answer,
    timeout: Duration,
) -> Pin<Box<dyn Stream<Item = Result<Bytes, BoxError>> + Send>> {
    let chunks = body.watched(timeout).into_data_stream();
    Box::pin(chunks.scan(false, |failed, chunk| {
        let ended = std::mem::replace(failed, chunk.is_err());
        std::future::ready((!ended).then_some(chunk))
    }))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used, clippy::expect_used)]

    use std::sync::atomic::{AtomicUsize, Ordering};

    use http::Version;
    use hyper::service::service_fn;
    use hyper_util::rt::TokioIo;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    use tokio::net::TcpListener;

    use super::*;

    /// What a test upstream saw of one request.
    #[derive(Debug, Clone)]
    struct Seen {
        connection: usize,
        version: Version,
        host: Option<String>,
        uri: String,
    }

    /// A test upstream over real sockets: hyper's server (HTTP/1.1, and
    /// HTTP/2 when TLS offers it), answering `ok` and noting each request.
    /// The answer to `/held` sends its `o`, then waits for `release`
    /// before its `k`.
    struct Upstream {
        addr: std::net::SocketAddr,
        seen: Arc<Mutex<Vec<Seen>>>,
        release: Arc<tokio::sync::Notify>,
    }

    impl Upstream {
        async fn start(tls: Option<tokio_rustls::TlsAcceptor>) -> Upstream {
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let seen = Arc::new(Mutex::new(Vec::new()));
            let release = Arc::new(tokio::sync::Notify::new());
            let (log, held) = (seen.clone(), release.clone());
            tokio::spawn(async move {
                for connection in 0.. {
                    let (stream, _) = listener.accept().await.unwrap();
                    let (log, tls, held) = (log.clone(), tls.clone(), held.clone());
                    tokio::spawn(async move {
                        let service = service_fn(move |req: Request<Incoming>| {
                            log.lock().unwrap().push(Seen {
                                connection,
                                version: req.version(),
                                host: req
                                    .headers()
                                    .get(header::HOST)
                                    .map(|h| h.to_str().unwrap().to_owned()),
                                uri: req.uri().to_string(),
                            });
                            let body = if req.uri().path() == "/held" {
                                let held = held.clone();
                                let pieces =
                                    futures_util::stream::iter(["o", "k"]).then(move |piece| {
                                        let held = held.clone();
                                        async move {
                                            if piece == "k" {
                                                held.notified().await;
                                            }
                                            Ok::<_, std::convert::Infallible>(Frame::data(
                                                Bytes::from(piece),
                                            ))
                                        }
                                    });
                                BodyExt::boxed(http_body_util::StreamBody::new(pieces))
                            } else {
                                BodyExt::boxed(Full::new(Bytes::from("ok")))
                            };
                            async { Ok::<_, std::convert::Infallible>(Response::new(body)) }
                        });
                        let server =
                            hyper_util::server::conn::auto::Builder::new(TokioExecutor::new());
                        let _ = match tls {
                            Some(tls) => {
                                let stream = tls.accept(stream).await.unwrap();
                                server.serve_connection(TokioIo::new(stream), service).await
                            }
                            None => server.serve_connection(TokioIo::new(stream), service).await,
                        };
                    });
                }
            });
            Upstream {
                addr,
                seen,
                release,
            }
        }

        fn seen(&self) -> Vec<Seen> {
            self.seen.lock().unwrap().clone()
        }
    }

    fn timeout() -> Duration {
        Duration::from_secs(10)
    }

    /// Sends a POST of `path` and reads the whole answer.
    async fn post(client: &UpstreamClient, path: &str) -> Bytes {
        let body = Either::Left(Full::new(Bytes::from("hi")));
        let sent = send(
            client,
            Method::POST,
            path,
            HeaderMap::new(),
            body,
            timeout(),
            false,
        );
        let response = sent
            .await
            .map_err(|(_, kind, error)| (kind, error))
            .unwrap();
        read_body(response.into_body(), 1024, timeout())
            .await
            .unwrap()
    }

    #[tokio::test]
    async fn http1_connections_are_reused_with_the_host_and_path_of_the_upstream() {
        let upstream = Upstream::start(None).await;
        let config = UpstreamConfig::new(&format!("http://{}/base/", upstream.addr));
        let client = UpstreamClient::new(&config).unwrap();
        for i in 0..5 {
            assert_eq!(post(&client, &format!("/v1/x?i={i}")).await, "ok");
        }
        let seen = upstream.seen();
        assert_eq!(seen.len(), 5);
        let host = upstream.addr.to_string();
        for (i, seen) in seen.iter().enumerate() {
            assert_eq!(seen.connection, 0, "{seen:?}");
            assert_eq!(seen.version, Version::HTTP_11);
            assert_eq!(seen.host.as_deref(), Some(host.as_str()));
            assert_eq!(seen.uri, format!("/base/v1/x?i={i}"));
        }
    }

    /// How many HTTP/1 connections the pool holds.
    fn pooled(client: &UpstreamClient) -> usize {
        client.pool.idle.lock().unwrap().http1.len()
    }

    #[tokio::test]
    async fn a_connection_goes_back_to_the_pool_when_its_answer_has_been_read() {
        let upstream = Upstream::start(None).await;
        let config = UpstreamConfig::new(&format!("http://{}", upstream.addr));
        let client = UpstreamClient::new(&config).unwrap();
        let held = || async {
            let body = Either::Left(Full::new(Bytes::from("hi")));
            let sent = send(
                &client,
                Method::POST,
                "/held",
                HeaderMap::new(),
                body,
                timeout(),
                false,
            );
            sent.await.map_err(|(_, kind, _)| kind).unwrap()
        };
        // While the first answer is not over, its connection is not in the
        // pool, and another request takes a new one.
        let first = held().await;
        assert_eq!(pooled(&client), 0);
        assert_eq!(post(&client, "/second").await, "ok");
        assert_eq!(pooled(&client), 1);
        upstream.release.notify_one();
        let first = read_body(first.into_body(), 1024, timeout()).await.unwrap();
        assert_eq!(first, "ok");
        assert_eq!(pooled(&client), 2);
        // Both are reused.
        assert_eq!(post(&client, "/third").await, "ok");
        assert_eq!(post(&client, "/fourth").await, "ok");
        let connections: Vec<(String, usize)> = upstream
            .seen()
            .into_iter()
            .map(|s| (s.uri, s.connection))
            .collect();
        assert_eq!(connections[0], ("/held".to_owned(), 0));
        assert_eq!(connections[1], ("/second".to_owned(), 1));
        assert!(
            connections[2..].iter().all(|(_, c)| *c < 2),
            "{connections:?}"
        );

        // An answer dropped before its end leaves its connection out of the
        // pool (hyper closes it); the next request does not wait on it.
        let pooled_before = pooled(&client);
        let unread = held().await;
        assert_eq!(pooled(&client), pooled_before - 1);
        drop(unread);
        assert_eq!(pooled(&client), pooled_before - 1);
        assert_eq!(post(&client, "/fifth").await, "ok");
    }

    /// An upstream that answers one request per connection and then closes
    /// it, without saying so (no `connection: close`).
    async fn closing_upstream() -> (std::net::SocketAddr, Arc<AtomicUsize>) {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let connections = Arc::new(AtomicUsize::new(0));
        let count = connections.clone();
        tokio::spawn(async move {
            loop {
                let (mut stream, _) = listener.accept().await.unwrap();
                count.fetch_add(1, Ordering::SeqCst);
                tokio::spawn(async move {
                    let mut request = Vec::new();
                    let mut buf = [0u8; 1024];
                    while !request.ends_with(b"hi") {
                        match stream.read(&mut buf).await {
                            Ok(0) | Err(_) => return,
                            Ok(n) => request.extend_from_slice(&buf[..n]),
                        }
                    }
                    let answer = b"HTTP/1.1 200 OK\r\ncontent-length: 2\r\n\r\nok";
                    let _ = stream.write_all(answer).await;
                });
            }
        });
        (addr, connections)
    }

    #[tokio::test]
    async fn a_connection_the_upstream_closed_is_not_used_again() {
        let (addr, connections) = closing_upstream().await;
        let client = UpstreamClient::new(&UpstreamConfig::new(&format!("http://{addr}"))).unwrap();
        for _ in 0..20 {
            assert_eq!(post(&client, "/v1/x").await, "ok");
        }
        assert_eq!(connections.load(Ordering::SeqCst), 20);
    }

    /// A test upstream behind TLS offering `alpn`, and a client TLS
    /// configuration that trusts its certificate (made for 127.0.0.1).
    async fn tls_upstream(alpn: &[&[u8]]) -> (Upstream, rustls::ClientConfig) {
        let made = rcgen::generate_simple_self_signed(vec!["127.0.0.1".to_owned()]).unwrap();
        let certificate = made.cert.der().clone();
        let key = rustls::pki_types::PrivatePkcs8KeyDer::from(made.signing_key.serialize_der());
        let provider = Arc::new(rustls::crypto::ring::default_provider());
        let mut server = rustls::ServerConfig::builder_with_provider(provider.clone())
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_no_client_auth()
            .with_single_cert(vec![certificate.clone()], key.into())
            .unwrap();
        server.alpn_protocols = alpn.iter().map(|p| p.to_vec()).collect();
        let mut roots = rustls::RootCertStore::empty();
        roots.add(certificate).unwrap();
        let client = rustls::ClientConfig::builder_with_provider(provider)
            .with_safe_default_protocol_versions()
            .unwrap()
            .with_root_certificates(roots)
            .with_no_client_auth();
        let acceptor = tokio_rustls::TlsAcceptor::from(Arc::new(server));
        (Upstream::start(Some(acceptor)).await, client)
    }

    #[tokio::test]
    async fn over_tls_http2_is_taken_when_offered_and_its_connection_shared() {
        let (upstream, tls) = tls_upstream(&[b"h2", b"http/1.1"]).await;
        let config = UpstreamConfig::new(&format!("https://{}", upstream.addr));
        let client = UpstreamClient::with_tls(&config, || {
            HttpsConnectorBuilder::new().with_tls_config(tls.clone())
        })
        .unwrap();
        assert_eq!(post(&client, "/v1/first").await, "ok");
        let together = (0..8).map(|i| {
            let client = client.clone();
            async move { post(&client, &format!("/v1/together?i={i}")).await }
        });
        for answer in futures_util::future::join_all(together).await {
            assert_eq!(answer, "ok");
        }
        let seen = upstream.seen();
        assert_eq!(seen.len(), 9);
        for seen in &seen {
            assert_eq!(seen.version, Version::HTTP_2, "{seen:?}");
            assert_eq!(seen.connection, 0, "{seen:?}");
        }
        assert_eq!(seen[0].uri, format!("https://{}/v1/first", upstream.addr));
    }

    #[tokio::test]
    async fn an_http2_connection_unused_for_the_idle_timeout_is_not_taken_again() {
        let (upstream, tls) = tls_upstream(&[b"h2", b"http/1.1"]).await;
        let mut config = UpstreamConfig::new(&format!("https://{}", upstream.addr));
        config.idle_timeout_ms = 300;
        let client = UpstreamClient::with_tls(&config, || {
            HttpsConnectorBuilder::new().with_tls_config(tls.clone())
        })
        .unwrap();
        // Each request takes it again, and so keeps it.
        for _ in 0..3 {
            assert_eq!(post(&client, "/v1/x").await, "ok");
            tokio::time::sleep(Duration::from_millis(200)).await;
            client.pool.sweep();
        }
        tokio::time::sleep(Duration::from_millis(400)).await;
        client.pool.sweep();
        assert!(client.pool.idle.lock().unwrap().http2.is_none());
        assert_eq!(post(&client, "/v1/x").await, "ok");
        let connections: Vec<usize> = upstream.seen().iter().map(|s| s.connection).collect();
        assert_eq!(connections, [0, 0, 0, 1]);
    }

    #[tokio::test]
    async fn over_tls_http1_is_kept_when_the_upstream_offers_only_that() {
        let (upstream, tls) = tls_upstream(&[b"http/1.1"]).await;
        let config = UpstreamConfig::new(&format!("https://{}", upstream.addr));
        let client = UpstreamClient::with_tls(&config, || {
            HttpsConnectorBuilder::new().with_tls_config(tls.clone())
        })
        .unwrap();
        for _ in 0..3 {
            assert_eq!(post(&client, "/v1/x").await, "ok");
        }
        let host = upstream.addr.to_string();
        let seen = upstream.seen();
        assert_eq!(seen.len(), 3);
        for seen in &seen {
            assert_eq!(seen.version, Version::HTTP_11, "{seen:?}");
            assert_eq!(seen.connection, 0, "{seen:?}");
            assert_eq!(seen.host.as_deref(), Some(host.as_str()));
            assert_eq!(seen.uri, "/v1/x");
        }
    }
}

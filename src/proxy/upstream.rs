//! The client side of the proxy: one pooled hyper client per upstream and
//! serving thread (HTTP/1.1 keep-alive, HTTP/2 by ALPN, TLS by rustls with
//! the webpki roots), and the deadline of one upstream exchange.
//!
//! A plain hyper client rather than a full HTTP client library: the proxy
//! relays requests as they are, so it needs no URL parsing, redirects,
//! retries or cookies, and each of those layers cost CPU on every request
//! (see the README's figures).

use std::pin::Pin;
use std::time::Duration;

use bytes::Bytes;
use futures_util::{Stream, StreamExt};
use http::{HeaderMap, Method, Request, Response, Uri};
use http_body_util::{BodyExt, Either, Full, Limited};
use hyper::body::Incoming;
use hyper_rustls::{HttpsConnector, HttpsConnectorBuilder};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use tokio::time::Instant;

use super::BoxError;
use super::respond::Failure;
use crate::config::UpstreamConfig;

/// A request body sent upstream: a guarded request's (read and scanned) or
/// a passed-through request's, streamed as it arrives (its start, when the
/// proxy has read that, sent first: [`ReadOn`]).
pub type UpstreamBody = Either<Full<Bytes>, Either<Incoming, ReadOn>>;

/// A client's body of which the proxy read the start (a file upload too
/// large to read whole): that start, then the rest as it arrives.
pub type ReadOn = http_body_util::combinators::BoxBody<Bytes, BoxError>;

/// The body of [`ReadOn`]: `start`, then `rest`.
pub fn read_on(start: Bytes, rest: Incoming) -> UpstreamBody {
    let start = futures_util::stream::iter([Ok(hyper::body::Frame::data(start))]);
    let rest = http_body_util::BodyStream::new(rest).map(|frame| frame.map_err(BoxError::from));
    let body = http_body_util::StreamBody::new(start.chain(rest));
    Either::Right(Either::Right(BodyExt::boxed(body)))
}

/// A pooled client for one upstream.
pub type UpstreamClient = Client<HttpsConnector<HttpConnector>, UpstreamBody>;

/// Builds the pooled client of `upstream`.
pub fn build_client(upstream: &UpstreamConfig) -> UpstreamClient {
    build(upstream, true)
}

/// Builds the client of `upstream` for connection upgrades: HTTP/1.1 only
/// (an upgrade has no meaning on HTTP/2), a connection per request (an
/// upgraded connection is never reused).
pub fn build_upgrade_client(upstream: &UpstreamConfig) -> UpstreamClient {
    build(upstream, false)
}

/// A client of `upstream`: pooled, HTTP/2 when the upstream offers it,
/// with `pooled`; otherwise HTTP/1.1 only, a connection per request.
fn build(upstream: &UpstreamConfig, pooled: bool) -> UpstreamClient {
    let mut http = HttpConnector::new();
    http.set_connect_timeout(Some(Duration::from_millis(upstream.connect_timeout_ms)));
    http.set_nodelay(true);
    http.enforce_http(false);
    let https = HttpsConnectorBuilder::new()
        .with_webpki_roots()
        .https_or_http()
        .enable_http1();
    let https = if pooled {
        https.enable_http2().wrap_connector(http)
    } else {
        https.wrap_connector(http)
    };
    let mut client = Client::builder(TokioExecutor::new());
    client
        .pool_idle_timeout(Duration::from_secs(90))
        .pool_timer(TokioTimer::new());
    if !pooled {
        client.pool_max_idle_per_host(0);
    }
    client.build(https)
}

/// Why an upstream exchange failed, with the label it is counted under.
pub fn classify(error: &hyper_util::client::legacy::Error) -> (Failure, &'static str) {
    if error.is_connect() {
        (Failure::UpstreamUnreachable, "connect")
    } else {
        (Failure::UpstreamBroken, "other")
    }
}

/// The failure of an exchange that ran past its deadline.
pub const TIMED_OUT: (Failure, &str) = (Failure::UpstreamTimeout, "timeout");

/// The URI of `path_and_query` on the upstream at `base`, such as
/// `https://api.openai.com`; a base with a path keeps it as a prefix.
pub fn uri(base: &str, path_and_query: &str) -> Option<Uri> {
    let base = base.trim_end_matches('/');
    let mut joined = String::with_capacity(base.len() + path_and_query.len());
    joined.push_str(base);
    joined.push_str(path_and_query);
    Uri::try_from(joined).ok()
}

/// Sends `method uri` with `headers` and `body`, and waits for the response
/// head until `deadline`.
pub async fn send(
    client: &UpstreamClient,
    method: Method,
    uri: Uri,
    headers: HeaderMap,
    body: UpstreamBody,
    deadline: Instant,
) -> Result<Response<Incoming>, (Failure, &'static str, Option<BoxError>)> {
    let mut request = Request::new(body);
    *request.method_mut() = method;
    *request.uri_mut() = uri;
    *request.headers_mut() = headers;
    match tokio::time::timeout_at(deadline, client.request(request)).await {
        Ok(Ok(response)) => Ok(response),
        Ok(Err(error)) => {
            let (failure, kind) = classify(&error);
            Err((failure, kind, Some(Box::new(error))))
        }
        Err(_) => Err((TIMED_OUT.0, TIMED_OUT.1, None)),
    }
}

/// Reads a whole response body of at most `limit` bytes until `deadline`.
pub async fn read_body(body: Incoming, limit: usize, deadline: Instant) -> Result<Bytes, BoxError> {
    match tokio::time::timeout_at(deadline, Limited::new(body, limit).collect()).await {
        Ok(Ok(collected)) => Ok(collected.to_bytes()),
        Ok(Err(error)) => Err(error),
        Err(_) => Err("the upstream did not finish the response in time".into()),
    }
}

/// A response body as a stream of chunks that fails at `deadline`.
pub fn body_stream(
    body: Incoming,
    deadline: Instant,
) -> Pin<Box<dyn Stream<Item = Result<Bytes, BoxError>> + Send>> {
    let frames = body.into_data_stream();
    Box::pin(futures_util::stream::unfold(
        Some(frames),
        move |frames| async move {
            let mut frames = frames?;
            match tokio::time::timeout_at(deadline, frames.next()).await {
                Ok(Some(Ok(chunk))) => Some((Ok(chunk), Some(frames))),
                Ok(Some(Err(error))) => Some((Err(Box::new(error) as BoxError), None)),
                Ok(None) => None,
                Err(_) => Some((
                    Err("the upstream did not finish the response in time".into()),
                    None,
                )),
            }
        },
    ))
}

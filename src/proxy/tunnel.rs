//! Connection upgrades (a WebSocket, such as OpenAI's Realtime API at
//! `/v1/realtime`), relayed as a byte tunnel.
//!
//! The handshake goes upstream over a connection of its own (HTTP/1.1 only:
//! an upgrade has no meaning on HTTP/2), with the client's `Upgrade` and
//! `Connection: upgrade` kept and its other headers treated as on any
//! passed-through request (the upstream's key replaces the client's when one
//! is configured). When the upstream switches protocols, fairgate answers
//! the client with the upstream's 101 and copies bytes both ways until
//! either side closes; any other answer is relayed as it is.
//!
//! A shutdown waits for open tunnels as for streams, up to
//! `shutdown_grace_ms`, then closes them. A tunnel keeps its client
//! connection's slot of `max_connections` until it closes.
//!
//! What goes through a tunnel is not scanned: fairgate reads HTTP messages,
//! not WebSocket frames. So a WebSocket on a path the guard reads (a
//! Responses API session at `/v1/responses`, say) is refused with 403
//! `upgrade_refused`, and `guard.upgrades: refuse` refuses every one, for
//! deployments where no session may go around the rules.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Either, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::respond::{self, Failure};
use super::{
    ProxyBody, State, dialect_of_path, forward_on, response_headers, stream_back, upstream_headers,
};
use crate::config::Upgrades;
use crate::exchange::{Batch, Endpoint, Stored};

/// Whether a request asks to upgrade its connection to a WebSocket:
/// `websocket` among its `Upgrade` protocols and `upgrade` among its
/// `Connection` options. Other upgrades (`h2c`) are not taken: their
/// headers are dropped and the request is served as it is.
pub fn is_websocket(headers: &HeaderMap) -> bool {
    let has = |name, token: &str| {
        headers
            .get_all(name)
            .iter()
            .filter_map(|value| value.to_str().ok())
            .flat_map(|value| value.split(','))
            .any(|option| option.trim().eq_ignore_ascii_case(token))
    };
    has(header::UPGRADE, "websocket") && has(header::CONNECTION, "upgrade")
}

/// Whether fairgate reads what is said on `path`: a session there would
/// carry past the rules what they stop in an HTTP exchange.
fn is_guarded(method: &http::Method, path: &str) -> bool {
    Endpoint::from_path(path).is_some()
        || Stored::from_path(path).is_some()
        || Batch::from_request(method, path).is_some()
}

/// Relays an upgrade request, and the tunnel after it (see the module doc).
pub async fn relay(
    state: &State,
    mut req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let dialect = dialect_of_path(req.uri().path());
    if state.config.guard.upgrades == Upgrades::Refuse || is_guarded(req.method(), req.uri().path())
    {
        return respond::failure(dialect, Failure::UpgradeRefused, request_id);
    }
    let Some(route) = state.config.route(req.uri().path(), None) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    let mut headers = upstream_headers(state, &route.upstream, dialect, req.headers().clone());
    if let Some(protocol) = req.headers().get(header::UPGRADE) {
        headers.insert(header::UPGRADE, protocol.clone());
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    let from_client = hyper::upgrade::on(&mut req);
    let connection = req.extensions_mut().remove::<Arc<super::Connection>>();
    let (method, body) = (req.method().clone(), Either::Left(Full::default()));
    let forwarded = forward_on(
        state,
        &route.upstream,
        method,
        req.uri(),
        headers,
        body,
        true,
    );
    let (mut response, deadline) = match forwarded.await {
        Ok(forwarded) => forwarded,
        Err(failure) => return respond::failure(dialect, failure, request_id),
    };
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return stream_back(response, deadline, request_id, None);
    }
    let mut out = Response::new(Empty::new().map_err(|never| match never {}).boxed_unsync());
    *out.status_mut() = StatusCode::SWITCHING_PROTOCOLS;
    *out.headers_mut() = response_headers(response.headers().clone());
    for name in [header::UPGRADE, header::CONNECTION] {
        if let Some(value) = response.headers().get(&name) {
            out.headers_mut().insert(name, value.clone());
        }
    }
    respond::tag(&mut out, request_id, None);
    let from_upstream = hyper::upgrade::on(&mut response);
    // Counted from here, so that a shutdown from now on waits for it.
    let open = OpenTunnel::new(state);
    let (metrics, upstream_name) = (state.metrics.clone(), route.upstream.clone());
    tokio::spawn(async move {
        let (_open, _connection) = (open, connection);
        let (client, upstream) = match tokio::join!(from_client, from_upstream) {
            (Ok(client), Ok(upstream)) => (client, upstream),
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(%error, "a connection upgrade did not complete");
                return;
            }
        };
        metrics
            .tunnels
            .with_label_values(&[upstream_name.as_str()])
            .inc();
        let (mut client, mut upstream) = (TokioIo::new(client), TokioIo::new(upstream));
        if let Err(error) = tokio::io::copy_bidirectional(&mut client, &mut upstream).await {
            tracing::debug!(%error, "a tunnel ended with an error");
        }
    });
    out
}

/// One tunnel in `fairgate_tunnels_open` and in the count a shutdown waits
/// on, until dropped.
struct OpenTunnel {
    count: tokio::sync::watch::Sender<usize>,
    gauge: prometheus::IntGauge,
}

impl OpenTunnel {
    fn new(state: &State) -> OpenTunnel {
        state.tunnels.send_modify(|open| *open += 1);
        state.metrics.tunnels_open.inc();
        OpenTunnel {
            count: state.tunnels.clone(),
            gauge: state.metrics.tunnels_open.clone(),
        }
    }
}

impl Drop for OpenTunnel {
    fn drop(&mut self) {
        self.count.send_modify(|open| *open -= 1);
        self.gauge.dec();
    }
}

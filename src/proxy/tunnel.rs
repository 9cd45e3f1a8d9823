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
//! A Realtime API session (a path whose last segment is `realtime`) is
//! read event by event by [`realtime`], a Responses API socket (a path
//! the guard reads as the Responses API's, `/v1/responses`) by
//! [`responses_socket`]; what goes through any other tunnel is not
//! scanned. So a WebSocket on any other path the guard reads as HTTP (a
//! chat completion's, say) is refused with 403 `upgrade_refused`;
//! `guard.upgrades: guarded` refuses every one but those the guard reads,
//! for deployments where no session may go around the rules, and
//! `refuse` every one.

use std::sync::Arc;

use http::{HeaderMap, HeaderValue, Request, Response, StatusCode, header};
use http_body_util::{BodyExt, Either, Empty, Full};
use hyper::body::Incoming;
use hyper_util::rt::TokioIo;

use super::respond::{self, Failure};
use super::{
    ProxyBody, State, dialect_of, forward_on, plain_path, realtime, response_headers,
    responses_socket, route, stream_back, upstream_headers,
};
use crate::config::{StreamMode, Upgrades};
use crate::exchange::{Batch, Endpoint, Stored};
use crate::record::ClientMeta;

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
        || Stored::from_request(method, path).is_some()
        || Batch::from_request(method, path).is_some()
}

/// Relays an upgrade request, and the tunnel after it (see the module doc).
pub async fn relay(
    state: &Arc<State>,
    mut req: Request<Incoming>,
    request_id: &str,
) -> Response<ProxyBody> {
    let path = req.uri().path();
    let dialect = dialect_of(req.headers(), path);
    // A Responses API socket is read event by event.
    let responses = responses_socket::is_responses_socket(path);
    if state.config.guard.upgrades == Upgrades::Refuse
        || (is_guarded(req.method(), path) && !responses)
    {
        return respond::failure(dialect, Failure::UpgradeRefused, request_id);
    }
    // A path that reads as a Realtime session's once normalized is read
    // as one: the upstream may serve it so.
    let realtime =
        realtime::is_realtime(path) || plain_path(path).is_some_and(|p| realtime::is_realtime(&p));
    if state.config.guard.upgrades == Upgrades::Guarded && !realtime && !responses {
        return respond::failure(dialect, Failure::UpgradeRefused, request_id);
    }
    let Some(route) = route(state, req.headers(), dialect, path, None) else {
        return respond::failure(dialect, Failure::NoRoute, request_id);
    };
    let mut headers = upstream_headers(state, &route.upstream, dialect, req.headers().clone());
    if let Some(protocol) = req.headers().get(header::UPGRADE) {
        headers.insert(header::UPGRADE, protocol.clone());
        headers.insert(header::CONNECTION, HeaderValue::from_static("upgrade"));
    }
    // The guard reads frames as they are: no compression.
    if realtime || responses {
        headers.remove(header::SEC_WEBSOCKET_EXTENSIONS);
    }
    let mode = route.stream_mode.unwrap_or(state.config.guard.stream_mode);
    let handshake = if realtime {
        Some(Read::Realtime(realtime::Handshake {
            request_id: request_id.to_owned(),
            upstream: route.upstream.clone(),
            model: realtime::Handshake::model_of(req.uri().query()),
            client: ClientMeta::read(req.headers(), None),
            monitor: mode == StreamMode::Monitor,
        }))
    } else if responses {
        Some(Read::Responses(responses_socket::Handshake {
            request_id: request_id.to_owned(),
            upstream: route.upstream.clone(),
            client: ClientMeta::read(req.headers(), None),
            mode,
        }))
    } else {
        None
    };
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
    let (mut response, timeout) = match forwarded.await {
        Ok(forwarded) => forwarded,
        Err(failure) => return respond::failure(dialect, failure, request_id),
    };
    if response.status() != StatusCode::SWITCHING_PROTOCOLS {
        return stream_back(response, timeout, request_id, None);
    }
    if handshake.is_some()
        && response
            .headers()
            .contains_key(header::SEC_WEBSOCKET_EXTENSIONS)
    {
        tracing::warn!("the upstream took a WebSocket extension that was not offered");
        return respond::failure(dialect, Failure::UpstreamBroken, request_id);
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
    let state = state.clone();
    tokio::spawn(async move {
        let (_open, _connection) = (open, connection);
        let (client, upstream) = match tokio::join!(from_client, from_upstream) {
            (Ok(client), Ok(upstream)) => (client, upstream),
            (Err(error), _) | (_, Err(error)) => {
                tracing::debug!(%error, "a connection upgrade did not complete");
                return;
            }
        };
        match handshake {
            Some(Read::Realtime(handshake)) => {
                return realtime::run(state, handshake, client, upstream).await;
            }
            Some(Read::Responses(handshake)) => {
                return responses_socket::run(state, handshake, client, upstream).await;
            }
            None => {}
        }
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

/// A session the guard reads, as its handshake set it up.
enum Read {
    Realtime(realtime::Handshake),
    Responses(responses_socket::Handshake),
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

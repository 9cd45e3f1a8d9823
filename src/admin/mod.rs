//! The admin listener: `/metrics` (Prometheus), `/healthz`, `/readyz`,
//! `/admin/rules` (packs, counts, version, last reload and error),
//! `POST /admin/reload`, and the built-in dashboard (`/dashboard`, which
//! polls `/admin/summary`; see [`dashboard`]). When the configuration
//! names a token, every request must carry it as
//! `Authorization: Bearer <token>`, but for the dashboard's page and its
//! assets, which hold no data.

pub mod dashboard;

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde_json::json;

use crate::proxy::respond::{self, json_response};
use crate::proxy::{ProxyBody, State};

/// The metrics listener of `fairgate worker`: `GET /metrics` and
/// `GET /healthz`, with the same bearer token rule as the proxy's admin
/// listener, until `stop` turns true.
pub async fn serve_worker_metrics(
    listener: tokio::net::TcpListener,
    metrics: Arc<crate::telemetry::Metrics>,
    token: Option<String>,
    mut stop: tokio::sync::watch::Receiver<bool>,
) {
    let builder =
        hyper_util::server::conn::auto::Builder::new(hyper_util::rt::TokioExecutor::new());
    let mut warned = None;
    loop {
        let accepted = tokio::select! {
            accepted = listener.accept() => accepted,
            _ = stop.wait_for(|s| *s) => return,
        };
        let Some(stream) = crate::proxy::taken(accepted, &mut warned).await else {
            continue;
        };
        let (metrics, token) = (metrics.clone(), token.clone());
        let service = hyper::service::service_fn(move |req: Request<Incoming>| {
            let (metrics, token) = (metrics.clone(), token.clone());
            async move {
                if let Some(denied) = check_token(token.as_deref(), &req) {
                    return Ok::<_, Infallible>(denied);
                }
                Ok(match (req.method(), req.uri().path()) {
                    (&Method::GET, "/metrics") => metrics_page(metrics.render()),
                    (&Method::GET, "/healthz") => respond::text(StatusCode::OK, "ok\n".into()),
                    _ => respond::text(StatusCode::NOT_FOUND, "not found\n".into()),
                })
            }
        });
        let connection = builder
            .serve_connection(hyper_util::rt::TokioIo::new(stream), service)
            .into_owned();
        tokio::spawn(async move {
            let _ = connection.await;
        });
    }
}

/// The 401 for a request without the configured bearer token.
fn check_token(token: Option<&str>, req: &Request<Incoming>) -> Option<Response<ProxyBody>> {
    let token = token?;
    let expected = format!("Bearer {token}");
    let given = req
        .headers()
        .get(header::AUTHORIZATION)
        .and_then(|v| v.to_str().ok());
    if given == Some(expected.as_str()) {
        return None;
    }
    let mut response = respond::text(
        StatusCode::UNAUTHORIZED,
        "a bearer token is required\n".into(),
    );
    response.headers_mut().insert(
        header::WWW_AUTHENTICATE,
        http::HeaderValue::from_static("Bearer"),
    );
    Some(response)
}

/// A file of the dashboard, fixed at build time, with the page's
/// Content-Security-Policy.
fn page_asset(body: &'static str, kind: &'static str) -> Response<ProxyBody> {
    let mut response = Response::new(respond::full(bytes::Bytes::from_static(body.as_bytes())));
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_TYPE, http::HeaderValue::from_static(kind));
    headers.insert(
        header::CONTENT_SECURITY_POLICY,
        http::HeaderValue::from_static(dashboard::POLICY),
    );
    headers.insert(
        header::X_CONTENT_TYPE_OPTIONS,
        http::HeaderValue::from_static("nosniff"),
    );
    response
}

fn metrics_page(text: String) -> Response<ProxyBody> {
    let mut response = respond::text(StatusCode::OK, text);
    response.headers_mut().insert(
        header::CONTENT_TYPE,
        http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
    );
    response
}

pub async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    if req.method() == Method::GET {
        let asset = match req.uri().path() {
            "/dashboard" => Some((dashboard::PAGE, "text/html; charset=utf-8")),
            "/dashboard.js" => Some((dashboard::SCRIPT, "text/javascript; charset=utf-8")),
            "/dashboard.css" => Some((dashboard::STYLE, "text/css; charset=utf-8")),
            _ => None,
        };
        if let Some((body, kind)) = asset {
            return Ok(page_asset(body, kind));
        }
    }
    if let Some(denied) = check_token(state.admin_token.as_deref(), &req) {
        return Ok(denied);
    }
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => metrics_page(state.metrics.render()),
        (&Method::GET, "/healthz") => respond::text(StatusCode::OK, "ok\n".into()),
        (&Method::GET, "/readyz") => respond::text(StatusCode::OK, "ready\n".into()),
        (&Method::GET, "/admin/summary") => {
            let mut response =
                json_response(StatusCode::OK, &dashboard::summary(&state), "admin", None);
            response.headers_mut().insert(
                header::CACHE_CONTROL,
                http::HeaderValue::from_static("no-store"),
            );
            response
        }
        (&Method::GET, "/admin/rules") => {
            let rules = state.rules.snapshot();
            let body = json!({
                "version": rules.version(),
                "rules": rules.rules().len(),
                "dir": state.rules.dir(),
                "packs": rules.packs(),
                "reload": state.rules.status(),
            });
            json_response(StatusCode::OK, &body, "admin", None)
        }
        (&Method::POST, "/admin/reload") => match state.reload_rules().await {
            Ok(rules) => json_response(
                StatusCode::OK,
                &json!({"ok": true, "version": rules.version(), "rules": rules.rules().len()}),
                "admin",
                None,
            ),
            Err(errors) => json_response(
                StatusCode::UNPROCESSABLE_ENTITY,
                &json!({"ok": false, "errors": errors.lines().collect::<Vec<_>>()}),
                "admin",
                None,
            ),
        },
        _ => respond::text(StatusCode::NOT_FOUND, "not found\n".into()),
    })
}

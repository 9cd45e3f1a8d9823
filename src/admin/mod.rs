//! The admin listener: `/metrics` (Prometheus), `/healthz`, `/readyz`,
//! `/admin/rules` (packs, counts, version, last reload and error) and
//! `POST /admin/reload`. When the configuration names a token, every request
//! must carry it as `Authorization: Bearer <token>`.

use std::convert::Infallible;
use std::sync::Arc;

use http::{Method, Request, Response, StatusCode, header};
use hyper::body::Incoming;
use serde_json::json;

use crate::proxy::respond::{self, json_response};
use crate::proxy::{ProxyBody, State};

pub async fn handle(
    state: Arc<State>,
    req: Request<Incoming>,
) -> Result<Response<ProxyBody>, Infallible> {
    if let Some(token) = &state.admin_token {
        let expected = format!("Bearer {token}");
        let given = req
            .headers()
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok());
        if given != Some(expected.as_str()) {
            let mut response = respond::text(
                StatusCode::UNAUTHORIZED,
                "a bearer token is required\n".into(),
            );
            response.headers_mut().insert(
                header::WWW_AUTHENTICATE,
                http::HeaderValue::from_static("Bearer"),
            );
            return Ok(response);
        }
    }
    Ok(match (req.method(), req.uri().path()) {
        (&Method::GET, "/metrics") => {
            let mut response = respond::text(StatusCode::OK, state.metrics.render());
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                http::HeaderValue::from_static("text/plain; version=0.0.4; charset=utf-8"),
            );
            response
        }
        (&Method::GET, "/healthz") => respond::text(StatusCode::OK, "ok\n".into()),
        (&Method::GET, "/readyz") => respond::text(StatusCode::OK, "ready\n".into()),
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

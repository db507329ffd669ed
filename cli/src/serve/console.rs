//! The web console's files, built into the binary (no build step, nothing fetched from
//! elsewhere), and the headers every answer carries: a strict Content-Security-Policy
//! (scripts and styles from this origin only, no inline script), no framing, no sniffing.

use axum::extract::Request;
use axum::http::{header, HeaderValue};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};

/// The page, its script and style, and uPlot (MIT, vendored unchanged; see
/// `console/vendor/README.md`) for the live charts.
const FILES: [(&str, &str, &str); 5] = [
    ("/", "text/html; charset=utf-8", include_str!("console/index.html")),
    ("/assets/console.js", "text/javascript; charset=utf-8", include_str!("console/console.js")),
    ("/assets/console.css", "text/css; charset=utf-8", include_str!("console/console.css")),
    ("/assets/uPlot.iife.min.js", "text/javascript; charset=utf-8", include_str!("console/vendor/uPlot.iife.min.js")),
    ("/assets/uPlot.min.css", "text/css; charset=utf-8", include_str!("console/vendor/uPlot.min.css")),
];

/// The console's paths.
pub fn paths() -> impl Iterator<Item = &'static str> {
    FILES.iter().map(|(path, _, _)| *path)
}

/// The file at `path` (one of [`paths`]).
pub fn file(path: &str) -> Response {
    match FILES.iter().find(|(at, _, _)| *at == path) {
        Some((_, content_type, text)) => ([(header::CONTENT_TYPE, *content_type), (header::CACHE_CONTROL, "no-cache")], *text).into_response(),
        None => axum::http::StatusCode::NOT_FOUND.into_response(),
    }
}

/// Scripts, styles, images and requests from this origin only; nothing inline; no
/// plugins, frames, forms posted elsewhere or `<base>` tricks.
const CONTENT_SECURITY_POLICY: &str =
    "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'";

/// Adds the security headers to every answer.
pub async fn security_headers(request: Request, next: Next) -> Response {
    let mut response = next.run(request).await;
    let headers = response.headers_mut();
    headers.insert(header::CONTENT_SECURITY_POLICY, HeaderValue::from_static(CONTENT_SECURITY_POLICY));
    headers.insert(header::X_CONTENT_TYPE_OPTIONS, HeaderValue::from_static("nosniff"));
    headers.insert(header::X_FRAME_OPTIONS, HeaderValue::from_static("DENY"));
    headers.insert(header::REFERRER_POLICY, HeaderValue::from_static("no-referrer"));
    response
}

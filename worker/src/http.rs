//! The generic HTTP caller: sends a job's request to the configured API and nowhere else.
//!
//! Paths are joined under the base URL, the result must keep the base's origin and
//! path prefix, redirects are never followed, and the configured headers (secrets) are
//! marked sensitive so they never show in logs or `Debug` output. Configured headers
//! always win: a job that sets one is refused, so no producer can replace the lane's
//! credential. The body goes out as the producer wrote it.

use std::time::Duration;

use paceline_shared::config::{ApiConfig, RequestLimits};
use paceline_shared::job::ApiRequest;
use reqwest::header::{HeaderMap, HeaderName, HeaderValue};
use reqwest::Url;
use secrecy::ExposeSecret;

use crate::classify::{CallResult, CappedBody};

/// Why a client or request could not be built.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ApiError {
    #[error("api.headers.{0}: not a valid header name or value")]
    Header(String),
    #[error("request would leave the configured API: {0}")]
    OffApi(String),
    #[error("cannot build the HTTP client: {0}")]
    Client(String),
    /// The job's request cannot be sent as it is: its fault, never the API's.
    #[error("{0}")]
    Malformed(String),
}

/// A client for one API.
#[derive(Clone, Debug)]
pub struct ApiClient {
    client: reqwest::Client,
    base: Url,
    limits: RequestLimits,
    /// `api.idempotency_header`: carries the job id on a job's calls.
    idempotency_header: Option<HeaderName>,
    /// How many bytes of an answer's body to keep (for outcome records; 0 keeps none).
    keep_body: usize,
}

impl ApiClient {
    /// Builds the client once (connections are pooled and reused).
    ///
    /// # Errors
    /// [`ApiError`] for a bad header or a client that cannot be built.
    pub fn new(config: &ApiConfig) -> Result<Self, ApiError> {
        let mut headers = HeaderMap::new();
        for (name, value) in &config.headers {
            let header_name = HeaderName::from_bytes(name.as_bytes()).map_err(|_| ApiError::Header(name.clone()))?;
            let mut header_value = HeaderValue::from_str(value.expose_secret()).map_err(|_| ApiError::Header(name.clone()))?;
            header_value.set_sensitive(true);
            headers.insert(header_name, header_value);
        }
        let client = reqwest::Client::builder()
            .default_headers(headers)
            .timeout(config.timeout)
            .connect_timeout(config.timeout.min(Duration::from_secs(5)))
            .redirect(reqwest::redirect::Policy::none())
            .pool_idle_timeout(Duration::from_secs(30))
            .build()
            .map_err(|e| ApiError::Client(e.to_string()))?;
        let idempotency_header =
            config.idempotency_header.as_ref().map(|name| HeaderName::from_bytes(name.as_bytes()).map_err(|_| ApiError::Header(name.clone()))).transpose()?;
        Ok(Self { client, base: config.base_url.clone(), limits: config.request_limits(), idempotency_header, keep_body: 0 })
    }

    /// The same client keeping the first `max` bytes of each answer's body.
    #[must_use]
    pub fn keeping_bodies(self, max: usize) -> Self {
        Self { keep_body: max, ..self }
    }

    /// The URL a request goes to: the base URL's path, then the request's.
    ///
    /// # Errors
    /// [`ApiError::OffApi`] if the result would not be on the configured API.
    pub fn url_for(&self, request: &ApiRequest) -> Result<Url, ApiError> {
        let base_path = self.base.path().trim_end_matches('/');
        let mut url = self.base.clone();
        url.set_path(&format!("{base_path}{}", request.path));
        url.set_query(None);
        url.set_fragment(None);
        if !request.query.is_empty() {
            url.query_pairs_mut().extend_pairs(&request.query);
        }
        // The final path, after the URL parser resolved what it would, must sit under
        // the base path segment by segment (`/v1x` is not under `/v1`).
        let under_base = url.path() == base_path || url.path().starts_with(&format!("{base_path}/"));
        let dot_segment = url.path_segments().is_some_and(|mut segments| segments.any(|s| s == "." || s == ".."));
        if url.origin() != self.base.origin() || !under_base || dot_segment || !request.path.starts_with('/') {
            return Err(ApiError::OffApi(request.path.chars().take(80).flat_map(char::escape_default).collect()));
        }
        Ok(url)
    }

    /// Builds the request: nothing is sent.
    ///
    /// # Errors
    /// [`ApiError::OffApi`] when the request is not for this API; [`ApiError::Malformed`]
    /// when it sets a configured header, its body is over `api.max_body`, or it cannot be
    /// built.
    pub fn build(&self, request: &ApiRequest) -> Result<reqwest::Request, ApiError> {
        let url = self.url_for(request)?;
        self.limits.check(request).map_err(ApiError::Malformed)?;
        let method = reqwest::Method::from_bytes(request.method.as_bytes()).map_err(|_| ApiError::Malformed(format!("request.method `{}`", request.method)))?;
        let mut builder = self.client.request(method, url);
        for (name, value) in &request.headers {
            builder = builder.header(name.as_str(), value.as_str());
        }
        builder = match &request.body {
            Some(body) => match body.as_text() {
                Some(text) => builder.body(text),
                None => builder.header("content-type", "application/json").body(body.json().to_owned()),
            },
            None => builder,
        };
        builder.build().map_err(|e| ApiError::Malformed(format!("the request cannot be built: {}", paceline_shared::error_chain(&e))))
    }

    /// Sends the request (for job `job_id`, which `api.idempotency_header` carries);
    /// transport failures come back as [`CallResult`] values.
    ///
    /// # Errors
    /// As for [`ApiClient::build`] (nothing is sent).
    pub async fn call(&self, request: &ApiRequest, job_id: Option<&str>) -> Result<CallResult, ApiError> {
        let mut request = self.build(request)?;
        if let (Some(name), Some(id)) = (&self.idempotency_header, job_id) {
            let value = HeaderValue::from_str(id).map_err(|_| ApiError::Malformed(format!("the job id `{id}` cannot be a header value")))?;
            request.headers_mut().insert(name.clone(), value);
        }
        Ok(match self.client.execute(request).await {
            Ok(response) => {
                let status = response.status().as_u16();
                let headers = response.headers().iter().filter_map(|(n, v)| v.to_str().ok().map(|v| (n.as_str().to_owned(), v.to_owned()))).collect();
                let body = self.read_body(response).await;
                CallResult::Response { status, headers, body }
            }
            Err(e) if e.is_timeout() => CallResult::Timeout,
            Err(e) => CallResult::Connect(paceline_shared::error_chain(&e)),
        })
    }
}

impl ApiClient {
    /// Reads the whole body (so the connection goes back to the pool) and keeps its first
    /// `keep_body` bytes. A body that breaks off keeps what arrived.
    async fn read_body(&self, mut response: reqwest::Response) -> CappedBody {
        let mut body = CappedBody::default();
        while let Ok(Some(chunk)) = response.chunk().await {
            let room = self.keep_body - body.bytes.len();
            body.bytes.extend_from_slice(&chunk[..chunk.len().min(room)]);
            body.truncated |= chunk.len() > room;
        }
        body
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    fn client(base: &str) -> ApiClient {
        let config = ApiConfig {
            base_url: base.parse().unwrap(),
            timeout: Duration::from_secs(1),
            headers: vec![("Authorization".into(), "Bearer s3cret".to_owned().into()), ("X-Lane".into(), "lane-key".to_owned().into())],
            health_check: request("GET", "/"),
            max_body: 1024,
            idempotency_header: None,
        };
        ApiClient::new(&config).unwrap()
    }

    fn request(method: &str, path: &str) -> ApiRequest {
        ApiRequest { method: method.into(), path: path.into(), query: BTreeMap::new(), headers: BTreeMap::new(), body: None }
    }

    #[test]
    fn joins_paths_under_the_base_and_encodes_queries() {
        let api = client("https://api.example.com/v1/");
        let mut req = request("GET", "/items/7");
        req.query.insert("q".into(), "a b&c".into());
        assert_eq!(api.url_for(&req).unwrap().as_str(), "https://api.example.com/v1/items/7?q=a+b%26c");
    }

    #[test]
    fn never_leaves_the_configured_api() {
        let api = client("https://api.example.com/v1");
        for path in ["//evil.example/x", "/../admin", "https://evil.example/"] {
            let url = api.url_for(&request("GET", path));
            assert!(url.as_ref().map_or(true, |u| u.host_str() == Some("api.example.com") && u.path().starts_with("/v1")), "{path} -> {url:?}");
        }
        assert!(api.url_for(&request("GET", "https://evil.example/")).is_err());
    }

    #[test]
    fn encoded_dot_segments_cannot_reach_a_sibling_of_the_base_path() {
        let api = client("https://api.example.com/v1");
        for path in ["/.%2E/v1x/secret", "/%2e./v1x/secret", "/%2E%2E/v1x"] {
            assert!(matches!(api.url_for(&request("GET", path)), Err(ApiError::OffApi(_))), "{path} was allowed");
        }
    }

    #[test]
    fn a_job_cannot_replace_a_configured_header() {
        let api = client("https://api.example.com/v1");
        let mut req = request("GET", "/x");
        req.headers.insert("x-lane".into(), "forged".into());
        let err = api.build(&req).unwrap_err();
        assert!(matches!(&err, ApiError::Malformed(m) if m.contains("x-lane")), "{err:?}");
    }

    #[test]
    fn bodies_over_max_body_are_refused_and_others_go_out_byte_for_byte() {
        let api = client("https://api.example.com/v1");
        let job = |body: &str| paceline_shared::job::Job::parse(&format!(r#"{{"request":{{"method":"POST","path":"/x","body":{body}}}}}"#)).unwrap().request;
        let big = format!("\"{}\"", "a".repeat(2000));
        assert!(matches!(api.build(&job(&big)), Err(ApiError::Malformed(m)) if m.contains("api.max_body")));
        let exact = r#"{"z":1,"a":123456789012345678901234567890,"e":1e3}"#;
        let built = api.build(&job(exact)).unwrap();
        assert_eq!(built.body().and_then(reqwest::Body::as_bytes), Some(exact.as_bytes()));
        assert_eq!(built.headers()["content-type"], "application/json");
    }

    #[test]
    fn secrets_do_not_show_in_debug_output() {
        let api = client("https://api.example.com");
        assert!(!format!("{api:?}").contains("s3cret"));
    }
}

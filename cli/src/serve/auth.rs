//! Who may reach `paceline serve`: a bearer token that may act, and one that may only
//! read. Only their SHA-256 hashes are kept (in memory, and in the embedded store for
//! generated ones); a request's token is hashed and compared with them.

use anyhow::{bail, Context as _};
use axum::extract::{Request, State};
use axum::http::{header, Method};
use axum::middleware::Next;
use axum::response::{IntoResponse as _, Response};
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::config::ServeConfig;
use secrecy::ExposeSecret as _;
use serde::{Deserialize, Serialize};
use sha2::{Digest as _, Sha256};
use std::sync::Arc;

use super::api::ApiError;
use super::Served;

/// What a token lets its bearer do.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Access {
    /// Read: status, lanes, results, dead letters, events, metrics.
    Read,
    /// Read, and act: enqueue, redrive, open or close a circuit.
    Act,
}

/// The hashes of the tokens `serve` accepts.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tokens {
    act: String,
    read: Option<String>,
}

/// Where generated tokens' hashes are kept in the embedded store.
const STORED: &str = "serve_tokens";

/// Tokens generated at a first start, shown once.
pub struct Generated {
    pub act: String,
    pub read: String,
}

fn hash(token: &str) -> String {
    hex(&Sha256::digest(token.as_bytes()))
}

fn hex(bytes: &[u8]) -> String {
    use std::fmt::Write as _;
    bytes.iter().fold(String::with_capacity(bytes.len() * 2), |mut text, byte| {
        let _ = write!(text, "{byte:02x}");
        text
    })
}

/// A new random token (244 random bits, from the OS's generator through UUID v4s).
fn new_token() -> String {
    format!("pl_{}{}", uuid::Uuid::new_v4().simple(), uuid::Uuid::new_v4().simple())
}

impl Tokens {
    /// The configured tokens (`[serve] token`, `read_token`), or the ones generated at the
    /// first start and kept hashed in `store`, generating them now (and returning them
    /// to be shown once) when there are none, or when `renew` asks for new ones.
    ///
    /// # Errors
    /// No token configured and no embedded store to keep generated ones in, or a store
    /// that cannot be read or written.
    pub fn resolve(config: &ServeConfig, store: Option<&EmbeddedStore>, renew: bool) -> anyhow::Result<(Self, Option<Generated>)> {
        if let Some(act) = &config.token {
            if renew {
                bail!("--new-tokens makes new generated tokens; these come from [serve] token and read_token: change them there");
            }
            let tokens = Self { act: hash(act.expose_secret()), read: config.read_token.as_ref().map(|read| hash(read.expose_secret())) };
            return Ok((tokens, None));
        }
        let Some(store) = store else {
            bail!("set [serve] token = {{ env = \"VARIABLE\" }} in the config: an AWS stack has no local store to keep a generated token in");
        };
        if !renew {
            if let Some(kept) = store.operator_setting::<Self>(STORED).context("reading serve's token hashes")? {
                return Ok((kept, None));
            }
        }
        let generated = Generated { act: new_token(), read: new_token() };
        let tokens = Self { act: hash(&generated.act), read: Some(hash(&generated.read)) };
        if renew {
            store.set_operator_setting(STORED, &tokens).context("keeping serve's token hashes")?;
        } else if !store.keep_operator_setting(STORED, &tokens).context("keeping serve's token hashes")? {
            // Another `serve` started at the same moment and kept its own.
            let kept = store.operator_setting::<Self>(STORED)?.context("serve's token hashes vanished")?;
            return Ok((kept, None));
        }
        Ok((tokens, Some(generated)))
    }

    /// What `presented` lets its bearer do, if anything.
    #[must_use]
    pub fn access_of(&self, presented: &str) -> Option<Access> {
        let presented = hash(presented);
        if presented == self.act {
            Some(Access::Act)
        } else if self.read.as_ref() == Some(&presented) {
            Some(Access::Read)
        } else {
            None
        }
    }
}

/// The access a request needs: reads are `GET` (and `HEAD`), everything else acts.
fn needed(method: &Method) -> Access {
    if method == Method::GET || method == Method::HEAD {
        Access::Read
    } else {
        Access::Act
    }
}

/// Lets a request through with a bearer token that allows it: 401 without one or with
/// a wrong one, 403 for a read-only token that would act. The token travels in the
/// `Authorization` header only (never a cookie, so a page elsewhere cannot act with it).
pub async fn require_token(State(served): State<Arc<Served>>, request: Request, next: Next) -> Response {
    let presented = request.headers().get(header::AUTHORIZATION).and_then(|value| value.to_str().ok()).and_then(|value| value.strip_prefix("Bearer "));
    let Some(presented) = presented else {
        return ApiError::unauthorized("no bearer token: send `Authorization: Bearer <token>`").into_response();
    };
    match served.tokens.access_of(presented.trim()) {
        None => ApiError::unauthorized("wrong token").into_response(),
        Some(access) if access < needed(request.method()) => ApiError::forbidden("this token may only read").into_response(),
        Some(_) => next.run(request).await,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use paceline_shared::time::SystemClock;

    #[test]
    fn generated_tokens_are_kept_hashed_and_the_same_ones_hold_at_the_next_start() {
        let store = EmbeddedStore::in_memory(Arc::new(SystemClock)).unwrap();
        let (tokens, generated) = Tokens::resolve(&ServeConfig::default(), Some(&store), false).unwrap();
        let generated = generated.expect("generated at the first start");
        assert_eq!(tokens.access_of(&generated.act), Some(Access::Act));
        assert_eq!(tokens.access_of(&generated.read), Some(Access::Read));
        assert_eq!(tokens.access_of("pl_guess"), None);
        let kept: Tokens = store.operator_setting(STORED).unwrap().unwrap();
        assert!(!serde_json::to_string(&kept).unwrap().contains(&generated.act), "the token itself is never stored");

        let (again, none) = Tokens::resolve(&ServeConfig::default(), Some(&store), false).unwrap();
        assert!(none.is_none(), "shown once");
        assert_eq!(again, tokens);
        let (renewed, new) = Tokens::resolve(&ServeConfig::default(), Some(&store), true).unwrap();
        assert_eq!(renewed.access_of(&generated.act), None, "--new-tokens retires the old ones");
        assert_eq!(renewed.access_of(&new.unwrap().act), Some(Access::Act));
    }

    #[test]
    fn an_aws_stack_without_a_configured_token_is_refused_with_what_to_set() {
        let Err(refused) = Tokens::resolve(&ServeConfig::default(), None, false) else { panic!("served with no token") };
        assert!(refused.to_string().contains("[serve] token"), "{refused}");
    }
}

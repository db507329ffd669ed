//! `[serve]`: who may reach `paceline serve` (its bearer tokens, from the environment)
//! and how much one request or one client may ask of it.

use secrecy::{ExposeSecret as _, SecretString};
use serde::Deserialize;

use super::{ConfigProblem, HeaderSource};

/// The shortest token `[serve]` accepts: a guessable one would guard nothing.
pub const MIN_TOKEN_LEN: usize = 24;

/// `paceline serve`'s settings.
#[derive(Debug, Clone)]
pub struct ServeConfig {
    /// The token that may read and act (`{ env = "..." }`); none: one is generated at
    /// first start and kept hashed in the state store.
    pub token: Option<SecretString>,
    /// A token that may only read.
    pub read_token: Option<SecretString>,
    /// The largest request body, in bytes (a bigger one gets 413).
    pub max_request: usize,
    /// The most NDJSON lines one `POST /v1/jobs` may hold.
    pub max_lines: usize,
    /// The most event streams open at once.
    pub max_streams: usize,
}

impl Default for ServeConfig {
    fn default() -> Self {
        Self { token: None, read_token: None, max_request: 16 << 20, max_lines: 10_000, max_streams: 100 }
    }
}

/// `[serve]` as written.
#[derive(Deserialize, Default)]
#[serde(deny_unknown_fields)]
pub(super) struct RawServe {
    token: Option<HeaderSource>,
    read_token: Option<HeaderSource>,
    #[serde(deserialize_with = "super::optional_size", default)]
    max_request: Option<usize>,
    max_lines: Option<usize>,
    max_streams: Option<usize>,
}

impl RawServe {
    pub(super) fn settings(self, env: &dyn Fn(&str) -> Option<String>) -> Result<ServeConfig, ConfigProblem> {
        let defaults = ServeConfig::default();
        let token = |name: &str, source: Option<HeaderSource>| -> Result<Option<SecretString>, ConfigProblem> {
            let Some(source) = source else { return Ok(None) };
            let key = format!("serve.{name}");
            let value = match source {
                HeaderSource::Value { .. } => return Err(ConfigProblem::at(key, "a token is a secret: take it from the environment, { env = \"VARIABLE\" }")),
                HeaderSource::Env { env: var, prefix } => {
                    let value = env(&var).ok_or_else(|| ConfigProblem::at(key.clone(), format!("environment variable {var} is not set")))?;
                    SecretString::from(format!("{prefix}{value}"))
                }
            };
            // It travels in a header: a control or non-ASCII character could never match.
            if !crate::job::is_header_value(value.expose_secret()) {
                return Err(ConfigProblem::at(key, "has a control (CR, LF...) or non-ASCII character"));
            }
            if value.expose_secret().len() < MIN_TOKEN_LEN {
                return Err(ConfigProblem::at(key, format!("shorter than {MIN_TOKEN_LEN} characters (or empty): a token that short is guessable")));
            }
            Ok(Some(value))
        };
        let settings = ServeConfig {
            token: token("token", self.token)?,
            read_token: token("read_token", self.read_token)?,
            max_request: self.max_request.unwrap_or(defaults.max_request),
            max_lines: self.max_lines.unwrap_or(defaults.max_lines),
            max_streams: self.max_streams.unwrap_or(defaults.max_streams),
        };
        for (field, value) in [("max_request", settings.max_request), ("max_lines", settings.max_lines), ("max_streams", settings.max_streams)] {
            if value == 0 {
                return Err(ConfigProblem::at(format!("serve.{field}"), "must be at least 1"));
            }
        }
        if settings.read_token.is_some() && settings.token.is_none() {
            return Err(ConfigProblem::at("serve.read_token", "needs serve.token too (the token that may act)"));
        }
        Ok(settings)
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use secrecy::ExposeSecret as _;

    use crate::config::Config;

    const MINIMAL: &str = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"10/s\"]\n";

    fn serve(lines: &str) -> Result<super::ServeConfig, String> {
        let env = |name: &str| match name {
            "LONG" => Some("a-token-of-thirty-characters-00".to_owned()),
            "SHORT" => Some("short".to_owned()),
            _ => None,
        };
        Config::parse(&format!("{MINIMAL}[serve]\n{lines}"), Path::new("."), &env).map(|config| config.serve).map_err(|problem| problem.to_string())
    }

    #[test]
    fn tokens_come_from_the_environment_and_a_guessable_or_missing_one_is_refused_by_key() {
        let settings = serve("token = { env = \"LONG\" }\nread_token = { env = \"LONG\", prefix = \"r-\" }\nmax_lines = 5\n").unwrap();
        assert_eq!(settings.token.unwrap().expose_secret(), "a-token-of-thirty-characters-00");
        assert_eq!(settings.read_token.unwrap().expose_secret(), "r-a-token-of-thirty-characters-00");
        assert_eq!((settings.max_lines, settings.max_request, settings.max_streams), (5, 16 << 20, 100));
        let refusals = [
            ("token = { env = \"SHORT\" }", "serve.token: shorter than 24 characters"),
            ("token = { env = \"UNSET\" }", "serve.token: environment variable UNSET is not set"),
            ("token = { value = \"a-token-written-in-the-file-itself\" }", "serve.token: a token is a secret"),
            ("read_token = { env = \"LONG\" }", "serve.read_token: needs serve.token too"),
            ("max_streams = 0", "serve.max_streams: must be at least 1"),
            ("colour = \"red\"", "unknown field `colour`"),
        ];
        for (lines, says) in refusals {
            let refused = serve(lines).unwrap_err();
            assert!(refused.contains(says), "{lines}: {refused}");
        }
    }
}

//! `[lanes]`: the lanes of a stack, each with its own quota under the stack's shared
//! `[quota]`, a weight for its share, and its own headers (a tenant's key) or base URL
//! (another API). The table's own keys are every lane's defaults; `[lanes.NAME]`
//! overrides any of them for one lane. `{lane}` in a header's value or environment
//! variable name is replaced by the lane id, so a lane nobody configured gets its key
//! from `KEY_{lane}` like the others.

use std::collections::BTreeMap;
use std::time::Duration;

use secrecy::SecretString;
use serde::Deserialize;

use super::{resolve_headers, ApiConfig, ConfigProblem, HeaderSource};
use crate::lane::{LaneId, RESERVED};
use crate::order::{JobOrder, LaneOrdering};
use crate::quota::{Quota, QuotaError, Tier};

/// What `{lane}` stands for in a header's value or environment variable name.
pub const LANE_PLACEHOLDER: &str = "{lane}";

/// Which lanes a 429 cools down.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum CoolDownScope {
    /// The lane whose call met it (each tenant has its own quota at the provider).
    #[default]
    Lane,
    /// Every lane (the provider's shared quota is the one refusing).
    Stack,
}

/// One lane's settings, as `[lanes]` and `[lanes.NAME]` give them.
#[derive(Clone, Debug)]
pub struct LaneSettings {
    /// The lane's own quota; every lane is also under the stack's `[quota]`.
    pub quota: Quota,
    /// The lane's share of the shared quota among lanes with jobs ready, relative to
    /// the others' (3 takes three times what 1 takes).
    pub weight: f64,
    /// Headers added to the `[api]` headers on this lane's calls (same name: this one),
    /// `{lane}` not yet replaced.
    headers: Vec<(String, HeaderSource)>,
    /// This lane's API, if not `[api] base_url`.
    pub base_url: Option<url::Url>,
    /// How the lane's jobs are ordered.
    pub ordering: JobOrder,
}

impl LaneSettings {
    /// The lane's headers for `lane`, read from `env` (the `[api]` headers not
    /// included). `key` names the setting in errors.
    ///
    /// # Errors
    /// A [`ConfigProblem`] naming the header whose environment variable is not set.
    pub fn headers_for(&self, lane: &LaneId, key: &str, env: &dyn Fn(&str) -> Option<String>) -> Result<Vec<(String, SecretString)>, ConfigProblem> {
        let sources = self.headers.iter().map(|(name, source)| (name.clone(), source.for_lane(lane))).collect();
        resolve_headers(sources, key, env)
    }

    /// The API as lane `lane` calls it: `api` with this lane's headers over its own
    /// (same name: the lane's) and this lane's base URL, if it has one.
    ///
    /// # Errors
    /// A [`ConfigProblem`] naming the header whose variable `env` does not have.
    pub fn api_for(&self, lane: &LaneId, api: &ApiConfig, env: &dyn Fn(&str) -> Option<String>) -> Result<ApiConfig, ConfigProblem> {
        let mut api = api.clone();
        let own = self.headers_for(lane, &format!("lanes.{lane}.headers"), env)?;
        api.headers.retain(|(name, _)| !own.iter().any(|(mine, _)| mine.eq_ignore_ascii_case(name)));
        api.headers.extend(own);
        if let Some(base_url) = &self.base_url {
            api.base_url = base_url.clone();
        }
        Ok(api)
    }

    /// Whether any header of this lane depends on the lane's id.
    #[must_use]
    pub fn headers_name_the_lane(&self) -> bool {
        self.headers.iter().any(|(_, source)| source.names_the_lane())
    }
}

/// `[lanes]` parsed: every lane's defaults and the named lanes' settings.
#[derive(Clone, Debug)]
pub struct LanesConfig {
    /// What a lane not named in `[lanes.NAME]` gets (the default lane included).
    pub defaults: LaneSettings,
    /// The named lanes, each with the defaults under its own overrides.
    pub named: BTreeMap<LaneId, LaneSettings>,
    /// Which lanes a 429 cools down.
    pub on_429: CoolDownScope,
}

impl LanesConfig {
    /// Which lanes of a stack are ordered: `lanes`' settings say, or for a stack without
    /// lanes, `quota_ordering` (`[quota] ordering`).
    #[must_use]
    pub fn ordering_of_stack(lanes: Option<&Self>, quota_ordering: JobOrder) -> LaneOrdering {
        lanes.map_or_else(|| LaneOrdering { default: quota_ordering, ..LaneOrdering::default() }, Self::ordering)
    }

    /// Which lanes are ordered.
    #[must_use]
    pub fn ordering(&self) -> LaneOrdering {
        LaneOrdering { default: self.defaults.ordering, named: self.named.iter().map(|(lane, settings)| (lane.clone(), settings.ordering)).collect() }
    }

    /// `lane`'s settings: its own if named, else the defaults.
    #[must_use]
    pub fn lane(&self, lane: &LaneId) -> &LaneSettings {
        self.named.get(lane).unwrap_or(&self.defaults)
    }

    /// Every lane's tiers widened by `margin` against the network's jitter, as `[quota]
    /// safety_margin` widens them (`simulate --safety-margin`).
    ///
    /// # Errors
    /// The [`QuotaError`] of a lane's tiers that `margin` does not fit.
    pub fn with_safety_margin(mut self, margin: Duration) -> Result<Self, QuotaError> {
        for settings in std::iter::once(&mut self.defaults).chain(self.named.values_mut()) {
            settings.quota = settings.quota.with_safety_margin(margin)?;
        }
        Ok(self)
    }

    /// `lane`'s settings with an operator's change (`paceline lanes set`) over them.
    ///
    /// # Errors
    /// A [`ConfigProblem`] naming the setting of `change` that cannot be used.
    pub fn lane_changed(&self, lane: &LaneId, change: &LaneChange) -> Result<LaneSettings, ConfigProblem> {
        let mut settings = self.lane(lane).clone();
        let key = format!("lane {lane}");
        if let Some(tiers) = &change.tiers {
            let quota = &settings.quota;
            settings.quota = Quota::new(tiers.clone(), quota.zone(), quota.safety_margin())
                .map_err(|e| ConfigProblem::at(format!("{key}: tiers"), e))?
                .with_max_in_flight(quota.max_in_flight());
        }
        if let Some(max) = change.max_in_flight {
            let max = super::check_max_in_flight(Some(max)).map_err(|e| ConfigProblem::at(format!("{key}: max_in_flight"), e))?;
            settings.quota = settings.quota.with_max_in_flight(max);
        }
        if let Some(weight) = change.weight {
            settings.weight = checked_weight(weight).map_err(|e| ConfigProblem::at(format!("{key}: weight"), e))?;
        }
        Ok(settings)
    }

    /// Parses `[lanes]` given as text (`PACELINE_LANES` on Lambda): the table's body as
    /// TOML (`tiers = ["5/s"]`, then `[acme]` tables, not `[lanes]` itself), or the same
    /// as one JSON object (`{"tiers": ["5/s"], "acme": {"weight": 3}}`, which fits a
    /// template parameter's one line); `shared` is the stack's quota. Keys are not read:
    /// on Lambda a lane's come from Secrets Manager when its first job does.
    ///
    /// # Errors
    /// A [`ConfigProblem`] naming the setting.
    pub fn parse_text(text: &str, shared: &Quota) -> Result<Self, ConfigProblem> {
        let table: toml::Table = if text.trim_start().starts_with('{') {
            serde_json::from_str(text).map_err(|e| ConfigProblem::at("lanes", format!("not a JSON object of [lanes] settings: {e}")))?
        } else {
            text.parse().map_err(|e: toml::de::Error| ConfigProblem::at("lanes", e.message()))?
        };
        Self::parse(table, shared)
    }

    /// Checks that every lane whose keys do not depend on its id (the named lanes, and
    /// the defaults when they name no `{lane}`) finds them in `env`: a missing one is a
    /// config error, found before any job.
    ///
    /// # Errors
    /// A [`ConfigProblem`] naming the header whose environment variable is not set.
    pub fn check_keys(&self, env: &dyn Fn(&str) -> Option<String>) -> Result<(), ConfigProblem> {
        for (lane, settings) in &self.named {
            settings.headers_for(lane, &format!("lanes.{lane}.headers"), env)?;
        }
        if !self.defaults.headers_name_the_lane() {
            self.defaults.headers_for(&LaneId::default_lane(), "lanes.headers", env)?;
        }
        Ok(())
    }

    /// Parses the `[lanes]` table; `shared` is the stack's `[quota]`, whose tiers a lane
    /// without tiers of its own takes.
    pub(crate) fn parse(table: toml::Table, shared: &Quota) -> Result<Self, ConfigProblem> {
        let mut defaults = RawLane::default();
        let mut on_429 = CoolDownScope::default();
        let mut overrides = Vec::new();
        for (key, value) in table {
            match key.as_str() {
                "on_429" => on_429 = value.try_into().map_err(|e| ConfigProblem::at("lanes.on_429", format!("{e} (\"lane\" or \"stack\")")))?,
                setting if RESERVED.contains(&setting) => defaults.set(setting, value)?,
                name => {
                    let lane = LaneId::parse(name).map_err(|e| ConfigProblem::at(format!("lanes.{name}"), e))?;
                    let toml::Value::Table(table) = value else {
                        return Err(ConfigProblem::at(
                            format!("lanes.{name}"),
                            format!("is not a [lanes] setting ({}) nor a [lanes.{name}] table", RESERVED.join(", ")),
                        ));
                    };
                    let raw: RawLane = toml::Value::Table(table).try_into().map_err(|e| ConfigProblem::at(format!("lanes.{name}"), e))?;
                    overrides.push((lane, raw));
                }
            }
        }
        let defaults_settings = defaults.clone().settings("lanes", shared)?;
        let mut named = BTreeMap::new();
        for (lane, raw) in overrides {
            let settings = raw.over(&defaults).settings(&format!("lanes.{lane}"), shared)?;
            named.insert(lane, settings);
        }
        Ok(Self { defaults: defaults_settings, named, on_429 })
    }
}

impl HeaderSource {
    /// This source with `{lane}` replaced by `lane`.
    fn for_lane(&self, lane: &LaneId) -> Self {
        let fill = |text: &str| text.replace(LANE_PLACEHOLDER, lane.as_str());
        match self {
            Self::Value { value } => Self::Value { value: fill(value) },
            Self::Env { env, prefix } => Self::Env { env: fill(env), prefix: fill(prefix) },
        }
    }

    fn names_the_lane(&self) -> bool {
        match self {
            Self::Value { value } => value.contains(LANE_PLACEHOLDER),
            Self::Env { env, prefix } => env.contains(LANE_PLACEHOLDER) || prefix.contains(LANE_PLACEHOLDER),
        }
    }
}

/// What an operator changed of one lane's settings while the stack runs (`paceline
/// lanes set`), kept in the lane's state and taken up by a run within `state_refresh`.
/// What is not set here comes from the config. Headers and the base URL stay in the
/// config: they name secrets and where calls go.
#[derive(Clone, Debug, Default, PartialEq, serde::Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LaneChange {
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tiers: Option<Vec<Tier>>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub weight: Option<f64>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub max_in_flight: Option<u32>,
}

impl LaneChange {
    /// `other`'s settings over these: what `other` sets wins.
    #[must_use]
    pub fn then(&self, other: &Self) -> Self {
        Self {
            tiers: other.tiers.clone().or_else(|| self.tiers.clone()),
            weight: other.weight.or(self.weight),
            max_in_flight: other.max_in_flight.or(self.max_in_flight),
        }
    }
}

/// `weight` if it can be one: finite and over 0.
fn checked_weight(weight: f64) -> Result<f64, String> {
    if weight.is_finite() && weight > 0.0 {
        Ok(weight)
    } else {
        Err(format!("{weight} is not a weight: give a number over 0 (1 is every lane's share)"))
    }
}

/// A lane's settings as written (every one optional: unset ones come from `[lanes]`).
#[derive(Clone, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct RawLane {
    tiers: Option<Vec<Tier>>,
    weight: Option<f64>,
    max_in_flight: Option<u32>,
    headers: Option<BTreeMap<String, HeaderSource>>,
    base_url: Option<String>,
    ordering: Option<JobOrder>,
}

impl RawLane {
    /// Sets one of `[lanes]`' own keys.
    fn set(&mut self, setting: &str, value: toml::Value) -> Result<(), ConfigProblem> {
        let mut one = toml::Table::new();
        one.insert(setting.to_owned(), value);
        let parsed: Self = toml::Value::Table(one).try_into().map_err(|e: toml::de::Error| ConfigProblem::at(format!("lanes.{setting}"), e.message()))?;
        *self = parsed.over(self);
        Ok(())
    }

    /// These settings over `defaults`: what is set here wins.
    fn over(self, defaults: &Self) -> Self {
        Self {
            tiers: self.tiers.or_else(|| defaults.tiers.clone()),
            weight: self.weight.or(defaults.weight),
            max_in_flight: self.max_in_flight.or(defaults.max_in_flight),
            headers: self.headers.or_else(|| defaults.headers.clone()),
            base_url: self.base_url.or_else(|| defaults.base_url.clone()),
            ordering: self.ordering.or(defaults.ordering),
        }
    }

    /// The settings, checked; `key` names the table in errors.
    fn settings(self, key: &str, shared: &Quota) -> Result<LaneSettings, ConfigProblem> {
        let quota = match self.tiers {
            Some(tiers) => Quota::new(tiers, shared.zone(), shared.safety_margin()).map_err(|e| ConfigProblem::at(format!("{key}.tiers"), e))?,
            None if shared.tiers().is_empty() => {
                return Err(ConfigProblem::at(format!("{key}.tiers"), "missing: without [quota], the lanes share no quota and each needs tiers of its own"));
            }
            None => Quota::new(shared.tiers().to_vec(), shared.zone(), shared.safety_margin()).expect("the shared quota's tiers are checked"),
        };
        let max_in_flight = super::check_max_in_flight(self.max_in_flight).map_err(|e| ConfigProblem::at(format!("{key}.max_in_flight"), e))?;
        let weight = checked_weight(self.weight.unwrap_or(1.0)).map_err(|e| ConfigProblem::at(format!("{key}.weight"), e))?;
        let headers: Vec<(String, HeaderSource)> = self.headers.unwrap_or_default().into_iter().collect();
        if let Some((name, _)) = headers.iter().find(|(name, _)| name.contains(LANE_PLACEHOLDER)) {
            return Err(ConfigProblem::at(format!("{key}.headers.{name}"), "`{lane}` is replaced in a header's value or env name, not in its name"));
        }
        let base_url = self.base_url.map(|text| super::parse_base_url(&text)).transpose().map_err(|e| ConfigProblem::at(format!("{key}.base_url"), e))?;
        Ok(LaneSettings { quota: quota.with_max_in_flight(max_in_flight), weight, headers, base_url, ordering: self.ordering.unwrap_or_default() })
    }
}

#[cfg(test)]
mod tests {
    use std::path::Path;

    use secrecy::ExposeSecret;

    use super::*;
    use crate::config::Config;

    const STACK: &str = "[api]\nbase_url = \"https://api.example.com/v1\"\n[quota]\ntiers = [\"20/s\"]\n";

    fn env(name: &str) -> Option<String> {
        match name {
            "KEY_acme" => Some("k-acme".into()),
            "KEY_gold" => Some("k-gold".into()),
            _ => None,
        }
    }

    fn parse(lanes: &str) -> Result<Config, String> {
        Config::parse(&format!("{STACK}{lanes}"), Path::new("/stack"), &env).map_err(|problem| problem.to_string())
    }

    fn lane(id: &str) -> LaneId {
        LaneId::parse(id).unwrap()
    }

    #[test]
    fn lanes_take_the_defaults_under_their_own_overrides_and_fill_in_their_id() {
        let config = parse(
            "[lanes]\ntiers = [\"5/s\"]\nheaders = { X-Tenant = { value = \"{lane}\" }, Authorization = { env = \"KEY_{lane}\", prefix = \"Bearer \" } }\n\
             [lanes.gold]\nweight = 3\ntiers = [\"10/s\", \"1000/day\"]\n[lanes.other-api]\nbase_url = \"https://other.example.com\"\nheaders = {}\n",
        )
        .unwrap();
        let lanes = config.lanes.as_ref().unwrap();
        assert_eq!(config.quota.tiers().len(), 1, "[quota] is the shared quota");
        assert_eq!(lanes.lane(&lane("acme")).quota.tiers()[0].to_string(), "5/s");
        assert_eq!(lanes.lane(&lane("acme")).weight, 1.0);
        assert_eq!(lanes.lane(&lane("gold")).weight, 3.0);
        assert_eq!(config.lane_quota(&lane("gold")).tiers().len(), 2);
        let headers = lanes.lane(&lane("acme")).headers_for(&lane("acme"), "lanes.headers", &env).unwrap();
        let shown: Vec<(&str, &str)> = headers.iter().map(|(name, value)| (name.as_str(), value.expose_secret())).collect();
        assert_eq!(shown, [("Authorization", "Bearer k-acme"), ("X-Tenant", "acme")]);
        let other = lanes.lane(&lane("other-api"));
        assert_eq!(other.base_url.as_ref().map(url::Url::as_str), Some("https://other.example.com/"));
        assert_eq!(other.quota.tiers()[0].to_string(), "5/s", "the defaults' tiers");
        let unknown = lanes.lane(&lane("nobody")).headers_for(&lane("nobody"), "lanes.headers", &env).unwrap_err();
        assert_eq!(unknown.to_string(), "lanes.headers.Authorization: environment variable KEY_nobody is not set");
        assert_eq!(lanes.on_429, CoolDownScope::Lane);
    }

    /// Lanes that are different APIs with nothing in common: `[quota]` left out, the
    /// shared quota has no tier, and every lane needs tiers of its own.
    #[test]
    fn without_quota_the_lanes_share_nothing_and_each_needs_tiers_of_its_own() {
        let api = "[api]\nbase_url = \"https://api.example.com/v1\"\n";
        let parse_alone = |text: &str| Config::parse(&format!("{api}{text}"), Path::new("/stack"), &env).map_err(|problem| problem.to_string());
        let config = parse_alone("[lanes]\ntiers = [\"5/s\"]\n[lanes.crm]\ntiers = [\"2/s\", \"1000/day\"]\nbase_url = \"https://crm.example.com\"\n").unwrap();
        assert!(config.quota.tiers().is_empty(), "no shared tier");
        assert_eq!(config.lane_quota(&lane("crm")).tiers().len(), 2);
        assert_eq!(config.lane_quota(&lane("other")).tiers()[0].to_string(), "5/s");
        let no_tiers = parse_alone("[lanes]\n[lanes.crm]\ntiers = [\"2/s\"]\n").unwrap_err();
        assert!(no_tiers.starts_with("lanes.tiers: missing: without [quota]"), "{no_tiers}");
        let one_lane = parse_alone("").unwrap_err();
        assert!(one_lane.starts_with("quota: missing"), "{one_lane}");
    }

    #[test]
    fn a_lane_without_tiers_of_its_own_goes_under_the_shared_ones_and_a_stack_without_lanes_is_one_lane() {
        let stack = parse("[lanes]\non_429 = \"stack\"\n").unwrap();
        assert_eq!(stack.lanes.as_ref().unwrap().on_429, CoolDownScope::Stack);
        let config = parse("[lanes]\nweight = 2\non_429 = \"lane\"\n").unwrap();
        let lanes = config.lanes.as_ref().unwrap();
        assert_eq!(lanes.lane(&lane("x")).quota.tiers(), config.quota.tiers());
        assert_eq!(lanes.on_429, CoolDownScope::Lane);
        let one = parse("").unwrap();
        assert!(one.lanes.is_none());
        assert_eq!(one.lane_quota(&LaneId::default_lane()).tiers(), one.quota.tiers());
    }

    #[test]
    fn an_operator_s_change_goes_over_the_lane_s_config_and_a_bad_one_is_refused_naming_the_setting() {
        let config = parse("[lanes]\ntiers = [\"5/s\"]\nmax_in_flight = 4\n[lanes.gold]\nweight = 3\n").unwrap();
        let lanes = config.lanes.as_ref().unwrap();
        let change = LaneChange { tiers: Some(vec!["2/s".parse().unwrap()]), weight: None, max_in_flight: Some(2) };
        let gold = lanes.lane_changed(&lane("gold"), &change).unwrap();
        assert_eq!((gold.quota.tiers()[0].to_string(), gold.weight, gold.quota.max_in_flight()), ("2/s".to_owned(), 3.0, Some(2)));
        let acme = lanes.lane_changed(&lane("acme"), &LaneChange { weight: Some(0.5), ..LaneChange::default() }).unwrap();
        assert_eq!((acme.quota.tiers()[0].to_string(), acme.weight, acme.quota.max_in_flight()), ("5/s".to_owned(), 0.5, Some(4)), "the rest from [lanes]");
        let zero = lanes.lane_changed(&lane("acme"), &LaneChange { weight: Some(0.0), ..LaneChange::default() }).unwrap_err();
        assert!(zero.to_string().starts_with("lane acme: weight: 0 is not a weight"), "{zero}");
        assert_eq!(LaneChange { weight: Some(2.0), ..LaneChange::default() }.then(&change), LaneChange { weight: Some(2.0), ..change });
    }

    #[test]
    fn bad_lanes_are_refused_naming_the_key() {
        for (lanes, expected) in [
            ("[lanes]\nwieght = 2\n", "lanes.wieght: is not a [lanes] setting"),
            ("[lanes.\"a b\"]\nweight = 2\n", "lanes.a b: lane id \"a b\" has ' '"),
            ("[lanes.gold]\nwieght = 2\n", "lanes.gold: unknown field `wieght`"),
            ("[lanes]\nweight = 0\n", "lanes.weight: 0 is not a weight"),
            ("[lanes.gold]\nweight = -1\n", "lanes.gold.weight: -1 is not a weight"),
            ("[lanes.gold]\nbase_url = \"ftp://x.example.com\"\n", "lanes.gold.base_url: "),
            ("[lanes]\nheaders = { \"X-{lane}\" = { value = \"1\" } }\n", "lanes.headers.X-{lane}: `{lane}` is replaced"),
            (
                "[lanes.gold]\nheaders = { Authorization = { env = \"KEY_{lane}x\" } }\n",
                "lanes.gold.headers.Authorization: environment variable KEY_goldx is not set",
            ),
            ("[lanes]\ntiers = [\"5/fortnight\"]\n", "lanes.tiers"),
            ("[lanes]\non_429 = \"everyone\"\n", "lanes.on_429: "),
        ] {
            let problem = parse(lanes).unwrap_err();
            assert!(problem.starts_with(expected), "{lanes:?}: {problem}");
        }
        let daily = Config::parse(&(STACK.replace("[\"20/s\"]", "[\"20/s\", \"1000/day\"]") + "[lanes]\n"), Path::new("/stack"), &env).unwrap();
        assert_eq!(daily.quota.tiers().len(), 2, "a shared day tier is reserved in the store as a lane's is");
        // On AWS a lane's key is a secret the worker reads, not this machine's variable.
        let aws = "[backend]\nkind = \"aws\"\nqueue_url = \"q\"\ndlq_url = \"d\"\ntable = \"t\"\nworker_function = \"w\"\n\
                   [lanes.gold]\nheaders = { Authorization = { env = \"KEY_{lane}x\" } }\n";
        assert!(parse(aws).unwrap().lanes.is_some_and(|lanes| lanes.named.contains_key(&lane("gold"))));
    }

    #[test]
    fn ordering_is_a_lane_setting_with_the_table_s_default_and_a_wrong_one_is_named() {
        let config = parse("[lanes]\nordering = \"fifo\"\n[lanes.bulk]\nordering = \"none\"\n").unwrap();
        let ordering = config.ordering();
        assert_eq!((ordering.of(&lane("acme")), ordering.of(&lane("bulk"))), (JobOrder::Fifo, JobOrder::None));
        assert_eq!(parse("[lanes]\n").unwrap().ordering(), LaneOrdering::default(), "unordered unless asked");
        let wrong = parse("[lanes.acme]\nordering = \"strict\"\n").unwrap_err();
        assert!(wrong.contains("lanes.acme") && wrong.contains("strict"), "{wrong}");
        let one_lane = Config::parse(&STACK.replace("tiers = [\"20/s\"]", "tiers = [\"20/s\"]\nordering = \"fifo\""), Path::new("/stack"), &env).unwrap();
        assert_eq!(one_lane.ordering().of(&LaneId::default_lane()), JobOrder::Fifo, "[quota] orders a stack of one lane");
        let misplaced =
            Config::parse(&format!("{}[lanes]\n", STACK.replace("tiers = [\"20/s\"]", "tiers = [\"20/s\"]\nordering = \"fifo\"")), Path::new("/stack"), &env);
        assert!(misplaced.unwrap_err().to_string().contains("quota.ordering"), "with [lanes], [quota] is the shared quota: order is a lane's");
    }

    #[test]
    fn ordered_lanes_on_a_standard_sqs_queue_are_refused_at_load_naming_the_lane_and_a_fifo_queue_is_taken() {
        let aws = |queue: &str, lanes: &str| {
            parse(&format!("[backend]\nkind = \"aws\"\nqueue_url = \"{queue}\"\ndlq_url = \"d\"\ntable = \"t\"\nworker_function = \"w\"\n{lanes}"))
        };
        let refused = aws("https://sqs/1/jobs", "[lanes.gold]\nordering = \"fifo\"\n").unwrap_err();
        assert!(refused.contains("lane gold") && refused.contains("FIFO") && refused.contains("QueueType=fifo"), "{refused}");
        assert!(aws("https://sqs/1/jobs.fifo", "[lanes.gold]\nordering = \"fifo\"\n").is_ok());
        assert!(aws("https://sqs/1/jobs", "[lanes.gold]\nweight = 2\n").is_ok(), "no ordered lane: a standard queue serves");
    }
}

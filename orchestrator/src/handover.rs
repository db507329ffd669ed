//! The hand-over between runs: what a run trusts of the last one's pacer snapshot, the
//! relay (the next run, started by the current one before it stops, waiting on the
//! lease) and how long the relay waits for the release.
//!
//! A run that stops cleanly saves its pacer state (each tier's spacing and window log)
//! and then releases the lease; the relay takes the lease the moment it is free and
//! continues the exact schedule. Anything less certain (no snapshot after earlier runs,
//! one written mid-run, older than the longest window, from other tiers, unreadable)
//! falls back to the crash rule: hold dispatch one window of the longest rolling tier.

use std::time::Duration;

use paceline_shared::pacer::PacerState;
use paceline_shared::ports::{PacerSnapshot, PortError, PortResult, StateStore};
use paceline_shared::quota::Quota;
use paceline_shared::time::{Clock, UnixMillis};
use serde::{Deserialize, Serialize};
use tracing::{info, warn};

/// How long before it stops a run starts its relay: time for Lambda to start the relay
/// (an async invoke, a cold start, a throttled attempt retried) before the release.
pub const RELAY_LEAD: Duration = Duration::from_secs(5);

/// How often a relay looks at the lease around the announced release.
pub const RELEASE_POLL: Duration = Duration::from_millis(10);

/// How long after the announced release the relay keeps looking every [`RELEASE_POLL`]
/// (the old run saves its snapshot and releases right after it stops dispatching).
const CLOSE_WATCH: Duration = Duration::from_secs(2);

/// How often the relay looks after that, until the lease expires (a run that died
/// without releasing).
const SLOW_POLL: Duration = Duration::from_millis(250);

/// What a run asks of its relay: wait for `after`'s lease, released by `release_by`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct RelayRequest {
    /// The holder of the lease the relay waits for.
    pub after: String,
    /// When that run stops dispatching and releases the lease.
    pub release_by: UnixMillis,
}

/// Starts the next run before this one stops (on Lambda, an asynchronous invoke of the
/// orchestrator function itself).
#[async_trait::async_trait]
pub trait Relay: Send + Sync {
    /// Starts a run that waits for `request`'s lease and takes it when released.
    async fn start_next(&self, request: &RelayRequest) -> PortResult<()>;
}

/// What the last run left, as this run may trust it.
#[derive(Clone, Debug, PartialEq)]
pub enum LastRun {
    /// No run before this one: nothing to continue.
    None,
    /// The snapshot of a run that stopped cleanly: its schedule goes on exactly.
    Clean(PacerSnapshot),
    /// The last run may have dispatched more than any snapshot says: hold one window of
    /// the longest rolling tier. Keeps what of the snapshot can still be used.
    Unclean { snapshot: Option<PacerSnapshot>, why: String },
}

impl LastRun {
    /// Judges the snapshot `loaded` from the store for `quota` at `now`. `earlier_runs`:
    /// a run held this lease before, so a missing snapshot was lost, not never written.
    ///
    /// # Errors
    /// A store error other than an unreadable snapshot.
    pub fn judge(loaded: PortResult<Option<PacerSnapshot>>, quota: &Quota, earlier_runs: bool, now: UnixMillis) -> PortResult<Self> {
        let unclean = |snapshot, why: String| Ok(Self::Unclean { snapshot, why });
        let snapshot = match loaded {
            Ok(Some(snapshot)) => snapshot,
            Ok(None) if earlier_runs => return unclean(None, "no pacer snapshot, though runs held the lease before".into()),
            Ok(None) => return Ok(Self::None),
            Err(PortError::Unreadable(why)) => return unclean(None, format!("the pacer snapshot cannot be read ({why})")),
            Err(e) => return Err(e),
        };
        let longest = PacerState::restored(quota, &snapshot.state).longest_window(quota);
        if !snapshot.at_exit {
            return unclean(Some(snapshot), "the last run did not stop cleanly".into());
        }
        if let Some(age) = snapshot.saved_at.map(|saved| now.since(saved)).filter(|age| *age > longest) {
            let why = format!("the pacer snapshot is {:.1} s old, older than the longest window", age.as_secs_f64());
            return unclean(Some(snapshot), why);
        }
        if !snapshot.state.covers_rolling_tiers(quota) {
            return unclean(Some(snapshot), "the pacer snapshot is of other tiers than the config's".into());
        }
        Ok(Self::Clean(snapshot))
    }

    /// The snapshot to start from, and whether to hold one window first (logging why).
    #[must_use]
    pub fn into_start(self) -> (Option<PacerSnapshot>, bool) {
        match self {
            Self::None => (None, false),
            Self::Clean(snapshot) => (Some(snapshot), false),
            Self::Unclean { snapshot, why } => {
                warn!(%why, "the last run's snapshot is not trusted: holding dispatch for one window of the longest tier");
                (snapshot, true)
            }
        }
    }
}

/// How a relay's wait for the lease ended.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Release {
    /// Released (or expired, its run gone): take it now.
    Free,
    /// Another run took it first (a kick, another relay): nothing to do.
    TakenBy(String),
    /// Still held at `give_up`.
    StillHeld,
}

/// Waits, as `request`'s relay, until the lease is released or expires, looking every
/// [`RELEASE_POLL`] from the announced release for 2 s, then every 250 ms, until
/// `give_up`. A read that fails for a passing fault is tried again.
///
/// # Errors
/// A read that retrying will not mend.
pub async fn await_release(store: &dyn StateStore, clock: &dyn Clock, request: &RelayRequest, give_up: UnixMillis) -> PortResult<Release> {
    clock.sleep_until(request.release_by.min(give_up)).await;
    loop {
        let now = clock.now();
        match store.lease().await {
            Ok(None) => return Ok(Release::Free),
            Ok(Some(lease)) if lease.expires_at <= now => {
                if lease.holder == request.after {
                    warn!(holder = %lease.holder, "the run before expired without releasing its lease");
                }
                return Ok(Release::Free);
            }
            Ok(Some(lease)) if lease.holder != request.after => return Ok(Release::TakenBy(lease.holder)),
            Ok(Some(_)) => {}
            Err(e) if e.is_retryable() => info!(error = %e, "could not read the lease; looking again"),
            Err(e) => return Err(e),
        }
        let next = now.plus(if now < request.release_by.plus(CLOSE_WATCH) { RELEASE_POLL } else { SLOW_POLL });
        if next > give_up {
            return Ok(Release::StillHeld);
        }
        clock.sleep_until(next).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use paceline_shared::adapters::embedded::EmbeddedStore;
    use paceline_shared::time::TokioClock;
    use std::sync::Arc;

    fn quota(tiers: &[&str]) -> Quota {
        Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::ZERO).unwrap()
    }

    fn clean(quota: &Quota, saved_at: u64) -> PacerSnapshot {
        let mut state = PacerState::new(quota);
        state.commit(quota, 1, UnixMillis(saved_at - 100));
        PacerSnapshot { state, at_exit: true, effective_rate: None, saved_at: Some(UnixMillis(saved_at)) }
    }

    fn why(judged: PortResult<LastRun>) -> String {
        match judged.unwrap() {
            LastRun::Unclean { why, .. } => why,
            other => panic!("trusted: {other:?}"),
        }
    }

    #[test]
    fn a_clean_fresh_snapshot_of_the_same_tiers_is_trusted_and_anything_else_holds_a_window() {
        let q = quota(&["10/s", "500/min"]);
        let now = UnixMillis(1_000_000);
        let fresh = clean(&q, 1_000_000 - 59_000);
        assert_eq!(LastRun::judge(Ok(Some(fresh.clone())), &q, true, now).unwrap(), LastRun::Clean(fresh.clone()));
        assert_eq!(LastRun::judge(Ok(None), &q, false, now).unwrap(), LastRun::None, "a first run");
        assert!(why(LastRun::judge(Ok(None), &q, true, now)).contains("no pacer snapshot"));
        assert!(why(LastRun::judge(Ok(Some(PacerSnapshot { at_exit: false, ..fresh.clone() })), &q, true, now)).contains("did not stop cleanly"));
        let stale = clean(&q, 1_000_000 - 61_000);
        assert_eq!(why(LastRun::judge(Ok(Some(stale)), &q, true, now)), "the pacer snapshot is 61.0 s old, older than the longest window");
        assert!(why(LastRun::judge(Ok(Some(fresh.clone())), &quota(&["10/s", "600/min"]), true, now)).contains("other tiers"));
        let unreadable = Err(PortError::Unreadable("expected value at line 1".into()));
        assert!(why(LastRun::judge(unreadable, &q, true, now)).contains("cannot be read (expected value at line 1)"));
        let failed = LastRun::judge(Err(PortError::Transient("timeout".into())), &q, true, now);
        assert!(matches!(failed, Err(PortError::Transient(_))), "a passing fault is the run's, to retry");
        let older_version = PacerSnapshot { saved_at: None, ..fresh };
        assert!(matches!(LastRun::judge(Ok(Some(older_version)), &q, true, now).unwrap(), LastRun::Clean(_)), "kept by an earlier version: trusted as it was");
    }

    #[tokio::test(start_paused = true)]
    async fn a_relay_takes_the_lease_when_released_or_expired_and_leaves_it_to_another_holder() {
        let clock = Arc::new(TokioClock::anchored_at(UnixMillis(1_000_000)));
        let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
        let ttl = Duration::from_secs(30);
        let lease = store.acquire_lease("run-1", ttl, clock.now()).await.unwrap();
        let request = RelayRequest { after: "run-1".into(), release_by: clock.now().plus(Duration::from_secs(5)) };
        let give_up = clock.now().plus(Duration::from_secs(60));
        let releasing = {
            let (store, clock) = (store.clone(), clock.clone());
            async move {
                clock.sleep_until(UnixMillis(1_005_025)).await;
                store.release_lease(&lease).await.unwrap();
            }
        };
        let (waited, ()) = tokio::join!(await_release(store.as_ref(), clock.as_ref(), &request, give_up), releasing);
        assert_eq!(waited.unwrap(), Release::Free);
        assert_eq!(clock.now(), UnixMillis(1_005_030), "seen within one poll of the release");

        let second = store.acquire_lease("run-2", ttl, clock.now()).await.unwrap();
        let late = RelayRequest { after: "run-1".into(), release_by: clock.now() };
        assert_eq!(await_release(store.as_ref(), clock.as_ref(), &late, give_up).await.unwrap(), Release::TakenBy("run-2".into()));
        let relay = RelayRequest { after: "run-2".into(), release_by: clock.now().plus(Duration::from_secs(1)) };
        let soon = clock.now().plus(Duration::from_secs(10));
        assert_eq!(await_release(store.as_ref(), clock.as_ref(), &relay, soon).await.unwrap(), Release::StillHeld);
        assert_eq!(await_release(store.as_ref(), clock.as_ref(), &relay, give_up).await.unwrap(), Release::Free, "a run that died: its lease expired");
        assert!(clock.now() >= second.expires_at && clock.now() <= second.expires_at.plus(SLOW_POLL));
    }
}

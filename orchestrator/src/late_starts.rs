//! The lead a stack learns from workers that started after their job's slot: every job
//! is handed off that much earlier for a while, so the schedule stays dense.
//!
//! A worker Lambda that starts after its slot's last moment puts the job back uncalled,
//! carrying how late it was (`Job::late_start_ms`, at least doubled at each miss). Handing
//! only that job off earlier means giving it a slot that much after the lane's next: the
//! pacers take their slots in order, so every later slot of the lane, and under a shared
//! quota every lane's, moved out as far, at each late start (1,000 lanes evenly under
//! 10,000/s with Lambda workers used 88.7% of the shared tier, 98.1% without). Learned
//! for the whole stack instead, the lead grows once and the slots after it keep their
//! spacing; a lead that no late start has asked for in [`REMEMBERED_FOR`] falls back.
//! It grows to the most a job learns (`MAX_LATE_START`, a second; Lambda's asynchronous
//! starts are late by hundreds of milliseconds at their worst), which the shards count on
//! (`Settings::furthest_ahead`); a job whose workers start later than that goes to the
//! DLQ (`Job::after_late_start`).

use std::time::Duration;

use paceline_shared::job::MAX_LATE_START;
use paceline_shared::time::UnixMillis;

/// `lead` and `late_starts` added to it, where jobs are handed off ahead (a job handed
/// off at its slot has no worker to start late).
pub(crate) fn with_late_starts(lead: Duration, late_starts: Duration) -> Duration {
    if lead.is_zero() {
        lead
    } else {
        lead + late_starts
    }
}

/// How long a late start is remembered at least (and at most twice that).
pub(crate) const REMEMBERED_FOR: Duration = Duration::from_secs(60);

/// The longest late start of the jobs received lately, in two periods of
/// [`REMEMBERED_FOR`]: the one under way and the one before it.
#[derive(Debug, Default)]
pub(crate) struct LateStartLead {
    period_started: UnixMillis,
    this_period: Duration,
    last_period: Duration,
}

impl LateStartLead {
    /// A job received at `now` whose worker started `late` after its slot before.
    pub fn learn(&mut self, late: Duration, now: UnixMillis) {
        self.roll(now);
        self.this_period = self.this_period.max(late.min(MAX_LATE_START));
    }

    /// How much earlier than the configured lead every job is handed off at `now`.
    pub fn lead(&mut self, now: UnixMillis) -> Duration {
        self.roll(now);
        self.this_period.max(self.last_period)
    }

    fn roll(&mut self, now: UnixMillis) {
        if now < self.period_started.plus(REMEMBERED_FOR) {
            return;
        }
        let two_periods_on = now >= self.period_started.plus(REMEMBERED_FOR * 2);
        self.last_period = if two_periods_on { Duration::ZERO } else { self.this_period };
        self.this_period = Duration::ZERO;
        self.period_started = now;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const T0: UnixMillis = UnixMillis(1_700_000_000_000);

    #[test]
    fn the_longest_late_start_is_the_lead_for_one_to_two_periods_then_it_falls_back() {
        let mut lead = LateStartLead::default();
        assert_eq!(lead.lead(T0), Duration::ZERO);
        lead.learn(Duration::from_millis(120), T0);
        lead.learn(Duration::from_millis(80), T0.plus(Duration::from_secs(10)));
        assert_eq!(lead.lead(T0.plus(Duration::from_secs(20))), Duration::from_millis(120));
        // The next period remembers the last one's longest.
        lead.learn(Duration::from_millis(50), T0.plus(Duration::from_secs(70)));
        assert_eq!(lead.lead(T0.plus(Duration::from_secs(100))), Duration::from_millis(120));
        // A period later only what that period learned.
        assert_eq!(lead.lead(T0.plus(Duration::from_secs(135))), Duration::from_millis(50));
        assert_eq!(lead.lead(T0.plus(Duration::from_secs(200))), Duration::ZERO);
    }

    #[test]
    fn a_quiet_spell_of_two_periods_forgets_everything_and_no_lead_passes_the_most_a_job_learns() {
        let mut lead = LateStartLead::default();
        lead.learn(Duration::from_secs(60), T0);
        assert_eq!(lead.lead(T0), MAX_LATE_START);
        assert_eq!(lead.lead(T0.plus(Duration::from_secs(125))), Duration::ZERO);
    }
}

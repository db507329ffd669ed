//! Day and month units reserved in the store before they are spent, a block at a time (a
//! lane's own, or the quota its lanes share): a run that starts after a crash reads the
//! store's count, which already holds every unit spent, so no restart overruns a tier.
//! The shards of a stack reserve the shared quota's units from one counter that never
//! passes the limit: a shard may be granted fewer than it asked, and then spends only
//! what it holds until the window resets.

use std::collections::BTreeMap;
use std::time::Duration;

use paceline_shared::pacer::PacerState;
use paceline_shared::quota::Quota;
use paceline_shared::time::UnixMillis;

/// Units reserved at a time when no rolling tier sets a pace.
const RESERVATION_WITHOUT_PACE: u64 = 10;

/// Units of one calendar tier to reserve before they are spent.
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct Reservation {
    /// The tier's counter for the calendar window that holds `slot`.
    pub key: String,
    pub units: u64,
    /// The tier's index in its quota.
    pub tier: usize,
    /// The tier's limit: a counter that a stack's shards reserve from together is never
    /// taken past it.
    pub limit: u64,
    /// The slot the units are for.
    pub slot: UnixMillis,
}

/// What the store granted of a [`Reservation`].
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Granted {
    pub units: u64,
    /// The counter after them where a stack's shards all reserve from it (every shard's
    /// reservations, spent or not); `None` for a counter of this shard's alone, whose
    /// count its own pacer keeps.
    pub shared_count: Option<u64>,
}

/// Calendar units reserved in the store and not yet spent, by usage key.
#[derive(Debug, Default)]
pub(crate) struct Reservations {
    reserved: BTreeMap<String, u64>,
}

impl Reservations {
    /// What to add to the store before `cost` units go at `slot` under `quota` (`pacer`:
    /// what it used so far): for each calendar tier whose reserved units fall short, a
    /// block of what the pace uses in `block_for`, no more than the tier has left and
    /// at least the shortfall. Empty in the common case, on every dispatch.
    pub fn needed(&self, quota: &Quota, pacer: &PacerState, cost: u64, slot: UnixMillis, block_for: Duration) -> Vec<Reservation> {
        let mut needed = Vec::new();
        for (index, tier) in quota.tiers().iter().enumerate().filter(|(_, t)| t.is_calendar()) {
            let key = tier.usage_key(quota.zone(), slot);
            let have = self.reserved.get(&key).copied().unwrap_or(0);
            if have >= cost {
                continue;
            }
            let rate = quota.pace_per_second();
            let block = if rate.is_finite() { (rate * block_for.as_secs_f64()).ceil() as u64 } else { RESERVATION_WITHOUT_PACE };
            let left = tier.limit.saturating_sub(pacer.usage(quota, slot)[index]).saturating_sub(have);
            needed.push(Reservation { key, units: block.min(left).max(cost - have), tier: index, limit: tier.limit, slot });
        }
        needed
    }

    /// The store granted `units` under `key`.
    pub fn add(&mut self, key: String, units: u64) {
        *self.reserved.entry(key).or_default() += units;
    }

    /// The units held under `key` and not yet spent.
    pub fn held(&self, key: &str) -> u64 {
        self.reserved.get(key).copied().unwrap_or(0)
    }

    /// `cost` units went at `slot` under `quota`.
    pub fn spend(&mut self, quota: &Quota, cost: u64, slot: UnixMillis) {
        for tier in quota.tiers().iter().filter(|t| t.is_calendar()) {
            if let Some(reserved) = self.reserved.get_mut(&tier.usage_key(quota.zone(), slot)) {
                *reserved = reserved.saturating_sub(cost);
            }
        }
    }

    /// The `cost` units spent at `slot` were not used after all (a worker made no call).
    pub fn give_back(&mut self, quota: &Quota, cost: u64, slot: UnixMillis) {
        for tier in quota.tiers().iter().filter(|t| t.is_calendar()) {
            if let Some(reserved) = self.reserved.get_mut(&tier.usage_key(quota.zone(), slot)) {
                *reserved += cost;
            }
        }
    }

    /// The units reserved and not spent, as negative deltas for the store, forgotten here.
    pub fn take_unspent(&mut self) -> Vec<(String, i64)> {
        std::mem::take(&mut self.reserved)
            .into_iter()
            .filter(|(_, units)| *units > 0)
            .map(|(key, units)| (key, -i64::try_from(units).unwrap_or(i64::MAX)))
            .collect()
    }
}

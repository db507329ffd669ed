//! The lanes' promise, as a property: over random lane sets, tiers (rolling and
//! calendar, a lane's and shared), weights, costs and arrivals, no window of any tier
//! ever holds more than its limit. The stack's decision step drains each backlog with
//! every port answering at once (`decision_bench::drain`), each call at its slot.

use std::collections::BTreeMap;
use std::path::Path;

use paceline_shared::config::Config;
use paceline_shared::lane::LaneId;
use paceline_shared::quota::{Period, Quota};
use proptest::prelude::*;

use super::*;
use crate::decision_bench::{drain, QueuedJob};

/// The first call of `calls` (in time order) that a tier of `quota` would have refused:
/// a rolling tier holds at most its limit in every window `(t - length, t]`, a calendar
/// tier in each of its days or months.
fn first_over(quota: &Quota, calls: &[(UnixMillis, u64)]) -> Option<String> {
    for tier in quota.tiers() {
        for (i, (at, _)) in calls.iter().enumerate() {
            let in_window = |then: &UnixMillis| match tier.period {
                Period::Rolling(length) => *then <= *at && then.plus(length) > *at,
                Period::Day | Period::Month => *then <= *at && tier.window_at(quota.zone(), *then) == tier.window_at(quota.zone(), *at),
            };
            let units: u64 = calls[..=i].iter().filter(|(then, _)| in_window(then)).map(|(_, cost)| cost).sum();
            if units > tier.limit {
                return Some(format!("{units} units in the {tier} window ending at {at}"));
            }
        }
    }
    None
}

fn tiers_toml(tiers: &[&str]) -> String {
    tiers.iter().map(|tier| format!("\"{tier}\"")).collect::<Vec<_>>().join(", ")
}

/// A lane's own tiers: a rolling one and maybe a minute's and a day's.
fn lane_tiers() -> impl Strategy<Value = Vec<&'static str>> {
    (prop::sample::select(vec!["2/s", "3/s", "5/s", "10/s", "4/500ms"]), any::<bool>(), any::<bool>()).prop_map(|(rolling, minute, day)| {
        let mut tiers = vec![rolling];
        tiers.extend(minute.then_some("40/min"));
        tiers.extend(day.then_some("60/day"));
        tiers
    })
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]

    #[test]
    fn no_window_of_any_tier_lane_or_shared_ever_holds_more_than_its_limit(
        shared in (prop::sample::select(vec!["8/s", "20/s", "50/s"]), any::<bool>(), any::<bool>()),
        lanes in prop::collection::vec((lane_tiers(), 1u32..=4), 1..6),
        jobs in prop::collection::vec((0usize..6, 1u64..=3, 0u64..6_000), 1..120),
    ) {
        let (rolling, minute, day) = shared;
        let mut shared_tiers = vec![rolling];
        shared_tiers.extend(minute.then_some("150/min"));
        shared_tiers.extend(day.then_some("100/day"));
        let mut text = format!(
            "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [{}]\nsafety_margin = \"0ms\"\n[orchestrator]\ndispatch_ahead = \"0s\"\n[lanes]\ntiers = [\"5/s\"]\n",
            tiers_toml(&shared_tiers)
        );
        for (index, (tiers, weight)) in lanes.iter().enumerate() {
            text += &format!("[lanes.l{index}]\ntiers = [{}]\nweight = {weight}\n", tiers_toml(tiers));
        }
        let config = Config::parse(&text, Path::new("/stack"), &|_| None).unwrap();
        let settings = Settings::from_config(&config, WorkerHost::InProcess);
        let queued: Vec<QueuedJob> = jobs
            .iter()
            .map(|(lane, cost, after_ms)| QueuedJob { lane: format!("l{}", lane % lanes.len()), cost: *cost, after: Duration::from_millis(*after_ms) })
            .collect();
        let mut calls: BTreeMap<LaneId, Vec<(UnixMillis, u64)>> = BTreeMap::new();
        let mut all: Vec<(UnixMillis, u64)> = Vec::new();
        let mut called: BTreeMap<String, u32> = BTreeMap::new();
        let figures = drain(&settings, &queued, Duration::from_secs(600), |slot, job| {
            calls.entry(job.lane.clone()).or_default().push((slot, job.cost));
            all.push((slot, job.cost));
            *called.entry(job.id.as_str().to_owned()).or_default() += 1;
        }, || {});
        let twice: Vec<&String> = called.iter().filter(|(_, n)| **n > 1).map(|(id, _)| id).collect();
        prop_assert!(twice.is_empty(), "called more than once: {:?}", twice);
        all.sort_by_key(|(at, _)| *at);
        prop_assert_eq!(first_over(&config.quota, &all), None, "shared tiers {:?}", shared_tiers);
        for (lane, lane_calls) in &mut calls {
            lane_calls.sort_by_key(|(at, _)| *at);
            let quota = config.lane_quota(lane);
            prop_assert_eq!(first_over(quota, lane_calls), None, "lane {}", lane);
        }
        // Day tiers may leave jobs on the queue; the others all went, but for those over
        // a whole tier (dead-lettered: they can never go).
        if !day && lanes.iter().all(|(tiers, _)| !tiers.contains(&"60/day")) {
            let fits = |job: &QueuedJob| {
                let lane = config.lane_quota(&job.lane.parse().unwrap());
                lane.tiers().iter().chain(config.quota.tiers()).all(|tier| job.cost <= tier.limit)
            };
            prop_assert_eq!(figures.dispatched, queued.iter().filter(|job| fits(job)).count() as u64);
        }
    }
}

/// Jobs of cost 3 under a 3/s tier take a second each: a stack must not take into hand
/// more of them than it can hand off before their visibility timeout (30 s), or they
/// come back on the queue while still in hand and go twice. One lane and many.
#[test]
fn jobs_of_more_than_one_unit_are_never_held_past_their_visibility_timeout_and_go_once() {
    for lanes in ["", "[lanes]\n"] {
        let text = format!("[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"3/s\"]\n[orchestrator]\ndispatch_ahead = \"0s\"\n{lanes}");
        let config = Config::parse(&text, Path::new("/stack"), &|_| None).unwrap();
        let settings = Settings::from_config(&config, WorkerHost::InProcess);
        let jobs: Vec<QueuedJob> = (0..80).map(|_| QueuedJob { cost: 3, ..QueuedJob::of("acme".into()) }).collect();
        let mut called: BTreeMap<String, u32> = BTreeMap::new();
        let figures = drain(&settings, &jobs, Duration::from_secs(600), |_, job| *called.entry(job.id.as_str().to_owned()).or_default() += 1, || {});
        let twice: Vec<&String> = called.iter().filter(|(_, n)| **n > 1).map(|(id, _)| id).collect();
        assert!(twice.is_empty(), "{lanes:?}: called more than once: {twice:?}");
        assert_eq!(figures.dispatched, 80, "{lanes:?}");
    }
}

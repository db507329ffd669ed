//! Drain-loop tests under paused tokio time: exact dispatch instants, malformed
//! messages, the circuit, deadlines, the lease and invoke throttling.
#![expect(clippy::disallowed_methods, reason = "paused-time tests move tokio's clock, the source of the TokioClock under test")]

use std::sync::Arc;
use std::time::Duration;

use async_trait::async_trait;
use paceline_shared::adapters::embedded::EmbeddedStore;
use paceline_shared::adapters::memory::RecordingInvoker;
use paceline_shared::adaptive::ProviderReading;
use paceline_shared::breaker::{CircuitStatus, TripRule};
use paceline_shared::config::{CircuitConfig, OrchestratorConfig, WorkerHost};
use paceline_shared::job::{DeadLetterCause, WorkerPayload};
use paceline_shared::order::JobOrder;
use paceline_shared::ports::{JobQueue, OutgoingMessage, PortError, StateStore, WorkerHandler};
use paceline_shared::quota::{chrono_tz, Quota};
use paceline_shared::testing::faults::{Faulty, Method};
use paceline_shared::time::{Clock, TokioClock, UnixMillis};

use super::*;

mod faults;
mod handover;
mod shares;
mod windows;

const T0: UnixMillis = UnixMillis(1_795_824_000_000); // 2026-11-28T00:00:00Z

struct Lane {
    clock: Arc<TokioClock>,
    store: Arc<EmbeddedStore>,
    invoker: Arc<RecordingInvoker>,
    orchestrator: Orchestrator,
}

fn lane_built(tiers: &[&str], margin_ms: u64, invoker: impl FnOnce(Arc<TokioClock>) -> RecordingInvoker, adjust: impl FnOnce(&mut Settings)) -> Lane {
    let clock = Arc::new(TokioClock::anchored_at(T0));
    let store = Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap());
    let invoker = Arc::new(invoker(clock.clone()));
    let quota = Quota::new(tiers.iter().map(|t| t.parse().unwrap()).collect(), chrono_tz::UTC, Duration::from_millis(margin_ms)).unwrap();
    let mut settings = Settings {
        quota,
        // At the slot unless a test sets `dispatch_ahead`.
        orchestrator: OrchestratorConfig { deadline_margin: Duration::from_secs(1), dispatch_ahead: Some(Duration::ZERO), ..OrchestratorConfig::default() },
        circuit: CircuitConfig { health_check_interval: Duration::from_secs(2), ..CircuitConfig::default() },
        workers: WorkerHost::InProcess,
        lanes: None,
        ordering: JobOrder::None,
        shard: paceline_shared::keys::Shard::WHOLE,
        share_most: None,
    };
    adjust(&mut settings);
    let orchestrator = Orchestrator::new(store.clone(), store.clone(), invoker.clone(), clock.clone(), settings);
    Lane { clock, store, invoker, orchestrator }
}

fn lane_with(tiers: &[&str], margin_ms: u64, invoker: impl FnOnce(Arc<TokioClock>) -> RecordingInvoker) -> Lane {
    lane_built(tiers, margin_ms, invoker, |_| {})
}

fn lane_with_settings(tiers: &[&str], margin_ms: u64, adjust: impl FnOnce(&mut Settings)) -> Lane {
    lane_built(tiers, margin_ms, |clock| RecordingInvoker::new(clock), adjust)
}

fn lane(tiers: &[&str], margin_ms: u64) -> Lane {
    lane_with(tiers, margin_ms, |clock| RecordingInvoker::new(clock))
}

/// Hands off as on Lambda: workers there, batches of up to 1,000 jobs, the hand-off's
/// lead `lead_ms` (500 ms by default there) and the batch window before it.
fn as_on_lambda(settings: &mut Settings, lead_ms: u64) {
    settings.workers = WorkerHost::Lambda;
    settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(lead_ms));
    settings.orchestrator.worker_batch = Some(1_000);
}

fn job(id: &str) -> String {
    format!(r#"{{"id":"{id}","request":{{"method":"GET","path":"/items/{id}"}}}}"#)
}

async fn enqueue(lane: &Lane, bodies: impl IntoIterator<Item = String>) {
    let messages: Vec<OutgoingMessage> = bodies.into_iter().map(OutgoingMessage::fresh).collect();
    for batch in messages.chunks(10) {
        lane.store.send(batch).await.unwrap();
    }
}

fn opts(drain: bool, deadline_after: Duration) -> RunOptions {
    RunOptions { holder: "test".into(), deadline: T0.plus(deadline_after), drain, stop: None }
}

fn offsets(lane: &Lane) -> Vec<u64> {
    lane.invoker.accepted().iter().map(|(t, _)| t.0 - T0.0).collect()
}

/// The slots of the jobs handed off ahead of them, in ms from `T0`, in hand-off order.
fn slot_offsets(lane: &Lane) -> Vec<u64> {
    lane.invoker
        .accepted()
        .iter()
        .filter_map(|(_, p)| match p {
            WorkerPayload::Job { slot: Some(slot), .. } => Some(slot.not_before.0 - T0.0),
            _ => None,
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn one_per_second_dispatches_exactly_on_the_second() {
    let lane = lane(&["1/s"], 0);
    enqueue(&lane, (0..5).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&lane), vec![0, 1_000, 2_000, 3_000, 4_000]);
    assert_eq!((report.dispatched, report.stop), (5, StopReason::Drained));
    assert_eq!(lane.store.depth().await.unwrap(), Default::default(), "every dispatched message is deleted");
    assert!((report.tiers[0].utilization - 1.0).abs() < 1e-9, "{:?}", report.tiers);
    assert_eq!(report.tiers[0].peak_window, 1);
}

#[tokio::test(start_paused = true)]
async fn a_backlog_goes_at_the_shortest_tiers_pace_while_the_minute_has_room() {
    let lane = lane(&["10/s", "300/min"], 10);
    enqueue(&lane, (0..12).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    // One every (1 s + 10 ms) / 10 = 101 ms: 12 calls are far from the minute's 300.
    assert_eq!(offsets(&lane), vec![0, 101, 202, 303, 404, 505, 606, 707, 808, 909, 1_010, 1_111]);
}

#[tokio::test(start_paused = true)]
async fn the_report_names_the_tier_that_set_the_pace_and_a_long_tiers_share_over_its_window() {
    let lane = lane(&["10/s", "20/min"], 0);
    enqueue(&lane, (0..21).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(120))).await.unwrap();
    // 20 go at 10/s, the 21st waits for the first to leave the minute.
    assert_eq!(offsets(&lane)[19..], [1_900, 60_000]);
    assert_eq!(report.paced_by.map(|t| t.to_string()).as_deref(), Some("20/min"));
    let minute = &report.tiers[1];
    assert_eq!((minute.units, minute.peak_window), (21, 20));
    assert!((minute.utilization - 20.0 / 20.0).abs() < 0.01, "20 paced units in one minute: {}", minute.utilization);
}

/// Draining 150 jobs under `10/s + 50/10s`, the summary said the 10/s tier set the pace
/// and the 50/10s tier was used at 119.9%, while the 10 s tier held the backlog for 20
/// of the 25 s (after its first 50, every wait ends when both tiers allow a call).
#[tokio::test(start_paused = true)]
async fn the_report_names_the_tier_that_held_jobs_back_longest_and_no_tier_over_100_percent() {
    let lane = lane(&["10/s", "50/10s"], 0);
    enqueue(&lane, (0..150).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&lane)[48..52], [4_800, 4_900, 10_000, 10_100]);
    assert_eq!(report.paced_by.map(|t| t.to_string()).as_deref(), Some("50/10s"));
    let shares: Vec<f64> = report.tiers.iter().map(|t| t.utilization).collect();
    assert!(shares.iter().all(|s| *s <= 1.0), "{shares:?}");
    // 149 paced units in 24.8 s: 249 admitted by 10/s (one every 100 ms), 150 by 50/10s.
    assert!((shares[0] - 149.0 / 249.0).abs() < 1e-9 && (shares[1] - 149.0 / 150.0).abs() < 1e-9, "{shares:?}");
}

#[tokio::test(start_paused = true)]
async fn a_smooth_tier_paces_at_its_own_rate_with_the_margin() {
    let lane = lane(&["10/s", "300/min smooth"], 10);
    enqueue(&lane, (0..12).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    // 300/min binds: one every (60 s + 10 ms) / 300 = 200.0333 ms, rounded up to the ms.
    assert_eq!(offsets(&lane), vec![0, 201, 401, 601, 801, 1_001, 1_201, 1_401, 1_601, 1_801, 2_001, 2_201]);
}

#[tokio::test(start_paused = true)]
async fn malformed_and_oversized_jobs_go_to_the_dlq_with_a_reason_and_the_rest_flow() {
    let lane = lane(&["5/s"], 0);
    let heavy = r#"{"id":"heavy","request":{"method":"GET","path":"/"},"cost":9}"#.to_string();
    enqueue(&lane, vec![job("a"), "{oops".into(), job("b"), heavy, r#"{"request":{"method":"GET","path":"https://evil.example/"}}"#.into(), job("c")]).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&lane), vec![0, 200, 400]);
    assert_eq!(report.dead_lettered, 3);
    let dead = lane.store.dead_letters().unwrap();
    let causes: Vec<(String, &str)> = dead.iter().map(|d| (d.reason.cause.label(), d.body.as_str())).collect();
    assert_eq!(causes[0], ("malformed".to_string(), "{oops"));
    assert_eq!(causes[1].0, "never_fits");
    assert!(dead[1].reason.detail.contains("5/s"), "{}", dead[1].reason.detail);
    assert!(dead[2].reason.detail.contains("request.path"), "{}", dead[2].reason.detail);
}

/// Half-opens the circuit on the first health check it sees, the way a worker whose API
/// answered would.
struct HealthyApi(Arc<EmbeddedStore>, Arc<TokioClock>);

#[async_trait]
impl WorkerHandler for HealthyApi {
    async fn handle(&self, payload: WorkerPayload) -> Result<Option<paceline_shared::outcome::OutcomeRecord>, PortError> {
        if let WorkerPayload::HealthCheck { circuit_epoch, .. } = payload {
            let current = self.0.circuit().await.unwrap();
            if let Ok(next) = current.half_open(circuit_epoch, "health check ok", self.1.now()) {
                self.0.swap_circuit(current.epoch, &next).await?;
            }
        }
        Ok(None)
    }
}

#[tokio::test(start_paused = true)]
async fn open_circuit_holds_jobs_sends_health_checks_and_resumes_when_closed() {
    let lane = lane_with(&["2/s"], 0, |clock| RecordingInvoker::new(clock));
    let healthy: Arc<dyn WorkerHandler> = Arc::new(HealthyApi(lane.store.clone(), lane.clock.clone()));
    let invoker = Arc::new(RecordingInvoker::new(lane.clock.clone()).forwarding_to(healthy));
    let open = lane.store.circuit().await.unwrap().open(0, "HTTP 503", T0).unwrap();
    lane.store.swap_circuit(0, &open).await.unwrap();
    enqueue(&lane, (0..3).map(|i| job(&format!("j{i}")))).await;
    let orchestrator = lane.orchestrator.with_invoker(invoker.clone());
    let report = orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    let sent: Vec<(u64, &str)> =
        invoker.accepted().iter().map(|(t, p)| (t.0 - T0.0, if matches!(p, WorkerPayload::HealthCheck { .. }) { "check" } else { "job" })).collect();
    // First check one interval after opening; the circuit is re-read within a second;
    // then the jobs flow at 2/s after the check's own slot.
    assert_eq!(sent[0], (2_000, "check"));
    assert_eq!(sent.iter().filter(|(_, k)| *k == "job").count(), 3);
    let first_job = sent.iter().find(|(_, k)| *k == "job").unwrap().0;
    assert!((2_500..=3_000).contains(&first_job), "first job at {first_job}");
    assert_eq!(report.health_checks, 1);
    match &invoker.accepted()[1].1 {
        WorkerPayload::Job { circuit_epoch, .. } => assert_eq!(*circuit_epoch, 2),
        other => panic!("expected a job, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_half_open_circuit_ramps_jobs_back_to_the_full_pace_then_closes() {
    let lane = lane_with_settings(&["10/s"], 0, |settings| {
        settings.circuit =
            CircuitConfig { health_check_interval: Duration::from_secs(2), ramp_start: 0.25, ramp_step: Duration::from_secs(1), ..CircuitConfig::default() };
    });
    let healthy: Arc<dyn WorkerHandler> = Arc::new(HealthyApi(lane.store.clone(), lane.clock.clone()));
    let invoker = Arc::new(RecordingInvoker::new(lane.clock.clone()).forwarding_to(healthy));
    let open = lane.store.circuit().await.unwrap().open(0, "HTTP 503", T0).unwrap();
    lane.store.swap_circuit(0, &open).await.unwrap();
    enqueue(&lane, (0..10).map(|i| job(&format!("j{i}")))).await;
    let orchestrator = lane.orchestrator.with_invoker(invoker.clone());
    orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    let jobs: Vec<u64> = invoker.accepted().iter().filter(|(_, p)| matches!(p, WorkerPayload::Job { .. })).map(|(t, _)| t.0 - T0.0).collect();
    // Half-open at 2 s (the check); seen at the 3 s refresh, when the ramp is one step
    // in: half the pace, one job every 200 ms; the full pace (100 ms) 2 s after the check.
    assert_eq!(jobs, vec![3_000, 3_200, 3_400, 3_600, 3_800, 4_000, 4_100, 4_200, 4_300, 4_400]);
    let circuit = lane.store.circuit().await.unwrap();
    assert_eq!((circuit.status, circuit.epoch, circuit.reason.as_str()), (CircuitStatus::Closed, 3, "the ramp reached the full pace"));
}

#[tokio::test(start_paused = true)]
async fn a_first_run_with_warm_up_ramps_from_a_share_of_the_pace() {
    let lane = lane_with_settings(&["10/s"], 0, |settings| {
        settings.circuit = CircuitConfig { warm_up: true, ramp_start: 0.25, ramp_step: Duration::from_secs(1), ..CircuitConfig::default() };
    });
    enqueue(&lane, (0..8).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    // A quarter of the pace for a second (400 ms apart), half for the next (200 ms).
    assert_eq!(offsets(&lane), vec![0, 400, 800, 1_200, 1_400, 1_600, 1_800, 2_000]);
    // The next run has the pacer's snapshot: no warm-up.
    enqueue(&lane, (0..3).map(|i| job(&format!("k{i}")))).await;
    let start = lane.clock.now();
    lane.orchestrator.run(&RunOptions { deadline: start.plus(Duration::from_secs(60)), ..opts(true, Duration::ZERO) }).await.unwrap();
    let later: Vec<u64> = offsets(&lane)[8..].iter().map(|t| t - (start.0 - T0.0)).collect();
    assert_eq!(later, vec![0, 100, 200]);
}

#[tokio::test(start_paused = true)]
async fn a_ramp_s_spacing_holds_for_slots_dispatched_ahead() {
    let lane = lane_with_settings(&["10/s"], 0, |settings| {
        settings.circuit = CircuitConfig { warm_up: true, ramp_start: 0.25, ramp_step: Duration::from_secs(1), ..CircuitConfig::default() };
        settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(300));
    });
    enqueue(&lane, (0..5).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    let slots = slot_offsets(&lane);
    // A quarter of the pace, 400 ms apart, for slots in the ramp's first second; then
    // half. A loop that wakes within its 2 ms slack must not take the slack off the
    // spacing (it did: 300, 698, 1096, 1294, 1492).
    assert_eq!(slots, vec![300, 700, 1_100, 1_300, 1_500]);
}

#[tokio::test(start_paused = true)]
async fn every_job_carries_the_trip_rule_of_the_pace() {
    let lane = lane(&["100/s"], 0);
    enqueue(&lane, vec![job("a")]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(10))).await.unwrap();
    match &lane.invoker.accepted()[0].1 {
        // 20 calls looked at, half of them failed: buckets of 10 calls (100 ms at 100/s).
        WorkerPayload::Job { trip, .. } => assert_eq!(*trip, Some(TripRule { bucket_ms: 100, failures: 10 })),
        other => panic!("expected a job, got {other:?}"),
    }
}

#[tokio::test(start_paused = true)]
async fn deadline_stops_dispatch_with_a_margin_and_releases_what_it_holds() {
    let lane = lane(&["1/s"], 0);
    enqueue(&lane, (0..10).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(false, Duration::from_millis(4_500))).await.unwrap();
    // Deadline 4.5 s, margin 1 s: dispatches at 0..3 s, none after 3.5 s.
    assert_eq!(offsets(&lane), vec![0, 1_000, 2_000, 3_000]);
    assert_eq!(report.stop, StopReason::Deadline);
    assert_eq!(lane.clock.now(), T0.plus(Duration::from_millis(3_500)));
    let depth = lane.store.depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible), (6, 0), "undispatched messages are visible again");
    assert_eq!(lane.store.lease().await.unwrap(), None, "lease released");
}

#[tokio::test(start_paused = true)]
async fn a_held_lease_keeps_a_second_orchestrator_out_and_a_lost_one_stops_dispatch() {
    let lane = lane(&["1/s"], 0);
    enqueue(&lane, (0..30).map(|i| job(&format!("j{i}")))).await;
    let other = lane.store.acquire_lease("other", Duration::from_secs(30), T0).await.unwrap();
    let err = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
    assert!(matches!(err, RunError::LeaseHeld(ref why) if why.contains("other")), "{err}");
    assert!(lane.invoker.accepted().is_empty());
    lane.store.release_lease(&other).await.unwrap();

    // Another holder takes over at 12 s (as if our lease had expired): we stop at the
    // next renewal (every ttl/3 = 10 s) and dispatch nothing after it.
    let store = lane.store.clone();
    let thief = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(12)).await;
        store.clear_lease().unwrap();
        store.acquire_lease("thief", Duration::from_secs(30), T0.plus(Duration::from_secs(12))).await.unwrap()
    });
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    thief.await.unwrap();
    assert_eq!(report.stop, StopReason::LeaseLost);
    assert!(offsets(&lane).iter().all(|t| *t <= 20_000));
    assert_eq!(*offsets(&lane).last().unwrap(), 19_000);
}

#[tokio::test(start_paused = true)]
async fn throttled_invokes_are_retried_with_backoff_and_nothing_is_lost() {
    let lane = lane(&["10/s"], 0);
    lane.invoker.fail_next([PortError::Throttled("TooManyRequestsException".into()), PortError::Transient("503".into())]);
    enqueue(&lane, vec![job("a"), job("b")]).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    // Refused at 0 (throttled, 50 ms backoff) and again at its next slot, 100 ms
    // (100 ms backoff): a refused hand-off keeps its slot spent, since it may have run.
    // Accepted at 200; the next job takes the following slot.
    assert_eq!(offsets(&lane), vec![200, 300]);
    assert_eq!(report.dispatched, 2);
    assert_eq!(lane.store.depth().await.unwrap(), Default::default());
}

#[tokio::test(start_paused = true)]
async fn exhausted_day_tier_is_not_polled_and_counters_survive_the_run() {
    let lane = lane(&["10/s", "3/day"], 0);
    enqueue(&lane, (0..5).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(false, Duration::from_secs(30))).await.unwrap();
    assert_eq!(offsets(&lane), vec![0, 100, 200]);
    assert_eq!(report.tiers[1].units, 3);
    let depth = lane.store.depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible), (2, 0), "nothing held while the day is exhausted");
    let key = "3/day".parse::<paceline_shared::quota::Tier>().unwrap().usage_key(chrono_tz::UTC, T0);
    assert_eq!(lane.store.load_usage(&[key]).await.unwrap(), vec![3]);

    // A second run the same day dispatches nothing more.
    let again = lane.orchestrator.run(&RunOptions { deadline: lane.clock.now().plus(Duration::from_secs(10)), ..opts(false, Duration::ZERO) }).await.unwrap();
    assert_eq!(again.dispatched, 0);
    assert_eq!(lane.invoker.accepted().len(), 3);
}

#[tokio::test(start_paused = true)]
async fn pacing_carries_over_between_runs() {
    let lane = lane(&["1/m"], 0);
    enqueue(&lane, vec![job("a"), job("b")]).await;
    lane.orchestrator.run(&opts(false, Duration::from_secs(10))).await.unwrap();
    let second = RunOptions { deadline: lane.clock.now().plus(Duration::from_secs(120)), ..opts(false, Duration::ZERO) };
    lane.orchestrator.run(&second).await.unwrap();
    assert_eq!(offsets(&lane), vec![0, 60_000], "the second run waits for the first run's slot");
}

#[tokio::test(start_paused = true)]
async fn dead_letter_cause_labels_reach_the_store() {
    let lane = lane(&["1/s"], 0);
    enqueue(&lane, vec!["[]".to_string()]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(10))).await.unwrap();
    assert_eq!(lane.store.dead_letters().unwrap()[0].reason.cause, DeadLetterCause::Malformed);
}

#[tokio::test(start_paused = true)]
async fn after_a_crashed_run_dispatch_waits_one_window_of_the_longest_tier() {
    let lane = lane(&["5/s", "60/min"], 0);
    // A run that crashed leaves a mid-run snapshot behind.
    let lease = lane.store.acquire_lease("crashed", Duration::from_secs(30), T0).await.unwrap();
    let snapshot = paceline_shared::ports::PacerSnapshot {
        state: paceline_shared::pacer::PacerState::new(&lane.orchestrator.settings().quota),
        at_exit: false,
        effective_rate: None,
        saved_at: None,
    };
    lane.store.save_pacer(&lease, &snapshot).await.unwrap();
    lane.store.clear_lease().unwrap();
    enqueue(&lane, vec![job("a"), job("b")]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(300))).await.unwrap();
    assert_eq!(offsets(&lane), vec![60_000, 60_200]);
    // That run ended cleanly: the next one trusts its snapshot and waits no extra window.
    enqueue(&lane, vec![job("c")]).await;
    let second_run = lane.clock.now();
    assert!(second_run.since(T0) > Duration::from_millis(60_400), "c's slot has passed");
    lane.orchestrator.run(&RunOptions { deadline: second_run.plus(Duration::from_secs(60)), ..opts(true, Duration::ZERO) }).await.unwrap();
    assert_eq!(offsets(&lane)[2], second_run.since(T0).as_millis() as u64, "c goes as the run starts");
}

/// A run killed while it handed off ahead with the lead late starts add (1.9 s in all),
/// its lease's time-to-live short (1 s): the next run took the lease the moment it ran
/// out and held one window from there, but the killed run's calls went on past that
/// window's end, and windows held both runs' calls. The hold now also waits out how far
/// the killed run's calls may reach past the lease's end: its furthest lead, less the
/// fifth of the time-to-live it stops deciding before the lease runs out.
#[tokio::test(start_paused = true)]
async fn a_crashed_run_s_calls_decided_far_ahead_are_waited_out_whatever_the_lease_s_ttl() {
    let lane = lane_with_settings(&["100/s"], 0, |settings| {
        as_on_lambda(settings, 400);
        settings.orchestrator.lease_ttl = Duration::from_secs(1);
    });
    let late = r#"{"id":"late","request":{"method":"GET","path":"/late"},"late_start_ms":1000}"#.to_owned();
    enqueue(&lane, std::iter::once(late).chain((0..1_000).map(|i| job(&format!("j{i}"))))).await;
    // Killed at 3.3 s, just before the renewal due at 3.33 s: its lease runs out at 4 s.
    let killed = tokio::time::timeout(Duration::from_millis(3_300), lane.orchestrator.run(&opts(false, Duration::from_secs(60)))).await;
    assert!(killed.is_err(), "the run was meant to be cut off");
    let killed_run = slot_offsets(&lane);
    assert!(*killed_run.last().unwrap() > 5_000, "decided 1.9 s ahead: {:?}", killed_run.last());
    let next = loop {
        match lane.orchestrator.run(&opts(false, Duration::from_secs(12))).await {
            Err(RunError::LeaseHeld(_)) => tokio::time::sleep(Duration::from_millis(10)).await,
            next => break next,
        }
    };
    next.unwrap();
    let slots = slot_offsets(&lane);
    assert!(slots.len() > killed_run.len() + 100, "the next run went on: {} slots", slots.len() - killed_run.len());
    let busiest = slots.iter().map(|end| slots.iter().filter(|slot| **slot + 1_000 > *end && **slot <= *end).count()).max().unwrap();
    assert!(busiest <= 100, "{busiest} slots in a second across the crash");
}

#[tokio::test(start_paused = true)]
async fn slow_invokes_do_not_delay_the_next_slot() {
    // Each hand-off takes 350 ms to be answered; at 10/s the slots still come every 100 ms.
    let lane = lane_with(&["10/s"], 0, |clock| RecordingInvoker::new(clock).with_latency(Duration::from_millis(350)));
    enqueue(&lane, (0..6).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&lane), vec![0, 100, 200, 300, 400, 500]);
    assert_eq!(report.dispatched, 6);
    assert_eq!(lane.store.depth().await.unwrap(), Default::default(), "deleted once answered");
}

#[tokio::test(start_paused = true)]
async fn dispatch_ahead_hands_jobs_off_early_with_their_slot() {
    let lane = lane_with_settings(&["1/s"], 20, |settings| settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(300)));
    enqueue(&lane, (0..4).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    let slots: Vec<(u64, u64, u64)> = lane
        .invoker
        .accepted()
        .iter()
        .map(|(t, p)| match p {
            WorkerPayload::Job { slot: Some(slot), .. } => (t.0 - T0.0, slot.not_before.0 - T0.0, slot.call_by.0 - T0.0),
            other => panic!("expected a job with a slot, got {other:?}"),
        })
        .collect();
    // The first slot is 300 ms out; then one per 1 s + 20 ms, each handed off 300 ms early
    // plus the 2 ms a coarse wake-up may be late, and valid for half the margin.
    assert_eq!(slots, vec![(0, 300, 310), (1_018, 1_320, 1_330), (2_038, 2_340, 2_350), (3_058, 3_360, 3_370)]);
}

#[tokio::test(start_paused = true)]
async fn dispatching_ahead_one_wake_up_hands_off_several_milliseconds_of_slots() {
    let lane = lane_with_settings(&["1000/s"], 0, |settings| settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(50)));
    enqueue(&lane, (0..60).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    let accepted = lane.invoker.accepted();
    let slots: Vec<u64> = accepted
        .iter()
        .map(|(_, p)| match p {
            WorkerPayload::Job { slot: Some(slot), .. } => slot.not_before.0 - T0.0,
            other => panic!("expected a job with a slot, got {other:?}"),
        })
        .collect();
    assert_eq!(slots, (50..110).collect::<Vec<u64>>(), "a slot every millisecond, the first 50 ms out");
    for ((handed_off, _), slot) in accepted.iter().zip(&slots) {
        let ahead = slot - (handed_off.0 - T0.0);
        assert!((50..=57).contains(&ahead), "handed off {ahead} ms before its slot");
    }
    let wake_ups = accepted.iter().map(|(t, _)| t.0).collect::<std::collections::BTreeSet<_>>().len();
    assert!(wake_ups <= 11, "60 slots handed off on {wake_ups} wake-ups");
}

/// Handing off as on Lambda (a 400 ms lead and a 500 ms batch window), a backlog that
/// came to an idle lane took its first slot 900 ms out, the whole lead, so that a batch
/// could gather: half a second of the quota unused at every start (at 10,000 calls/s
/// over 1,000 lanes by a Zipf law, the shared tier binds for ten seconds or so). A lane
/// that holds a batch window's worth of jobs starts at the hand-off's own lead, its first
/// batch going at once; jobs that come one at a time still go the whole lead ahead,
/// gathering in a batch.
#[tokio::test(start_paused = true)]
async fn a_backlog_starts_at_the_hand_off_s_own_lead_and_jobs_coming_one_at_a_time_still_gather_in_a_batch() {
    let backlog = lane_with_settings(&["10/s"], 0, |settings| as_on_lambda(settings, 400));
    enqueue(&backlog, (0..30).map(|i| job(&format!("j{i}")))).await;
    backlog.orchestrator.run(&opts(true, Duration::from_secs(10))).await.unwrap();
    assert_eq!(slot_offsets(&backlog), (0..30).map(|i| 400 + 100 * i).collect::<Vec<u64>>());

    let one_at_a_time = lane_with_settings(&["10/s"], 0, |settings| as_on_lambda(settings, 400));
    let producer = {
        let store = one_at_a_time.store.clone();
        tokio::spawn(async move {
            for i in 0..5 {
                store.send(&[OutgoingMessage::fresh(job(&format!("k{i}")))]).await.unwrap();
                tokio::time::sleep(Duration::from_millis(1_000)).await;
            }
        })
    };
    one_at_a_time.orchestrator.run(&opts(false, Duration::from_secs(7))).await.unwrap();
    producer.await.unwrap();
    let accepted = one_at_a_time.invoker.accepted();
    let leads: Vec<u64> = accepted.iter().zip(slot_offsets(&one_at_a_time)).map(|((t, _), slot)| slot - (t.0 - T0.0)).collect();
    assert_eq!(leads.len(), 5);
    assert!(leads.iter().all(|lead| (900..=910).contains(lead)), "each decided the whole lead ahead: {leads:?}");
}

/// A 10 MB body's hand-off (its payload written to the store) took longer than the lead,
/// and its worker missed the slot every time: a large job is handed off earlier by that
/// much, for the same slots.
#[tokio::test(start_paused = true)]
async fn a_large_job_is_handed_off_earlier_for_the_same_slot() {
    let lane = lane_with_settings(&["1/s"], 20, |settings| settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(300)));
    let large = format!(r#"{{"id":"large","request":{{"method":"POST","path":"/a","body":"{}"}}}}"#, "x".repeat(2_000_000 - 2));
    enqueue(&lane, [job("j0"), large, job("j2")]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    let hand_offs: Vec<(u64, u64)> = lane
        .invoker
        .accepted()
        .iter()
        .map(|(t, p)| match p {
            WorkerPayload::Job { slot: Some(slot), .. } => (t.0 - T0.0, slot.not_before.0 - T0.0),
            other => panic!("expected a job with a slot, got {other:?}"),
        })
        .collect();
    // 2 MB take 100 ms to hand off; the large call arrives 200 ms after its slot (its
    // upload), and the next keeps its distance from that arrival.
    assert_eq!(hand_offs, vec![(0, 300), (1_018 - 100, 1_320), (2_238, 2_540)]);
}

/// A job whose worker started 250 ms after its slot before comes back: from then on
/// every job of the lane is handed off 250 ms earlier, and the slots keep their pace.
#[tokio::test(start_paused = true)]
async fn a_job_back_from_a_late_start_makes_every_job_go_that_much_earlier_for_the_same_slots() {
    let lane = lane_with_settings(&["1/s"], 20, |settings| settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(300)));
    enqueue(&lane, [job("j0")]).await;
    let late = r#"{"id":"late","request":{"method":"GET","path":"/b"},"late_start_ms":250}"#.to_owned();
    let producer = {
        let store = lane.store.clone();
        tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            let bodies = std::iter::once(late).chain((3..6).map(|i| job(&format!("j{i}"))));
            store.send(&bodies.map(OutgoingMessage::fresh).collect::<Vec<_>>()).await.unwrap();
        })
    };
    lane.orchestrator.run(&opts(false, Duration::from_secs(10))).await.unwrap();
    producer.await.unwrap();
    let accepted = lane.invoker.accepted();
    let leads: Vec<u64> = accepted.iter().zip(slot_offsets(&lane)).map(|((t, _), slot)| slot - (t.0 - T0.0)).collect();
    let slots = slot_offsets(&lane);
    assert_eq!((slots.len(), slots[0], leads[0]), (5, 300, 300));
    assert!(leads[1..].iter().all(|lead| (550..=560).contains(lead)), "handed off 300 + 250 ms ahead after the late one came back: {leads:?}");
    let gaps: Vec<u64> = slots[1..].windows(2).map(|w| w[1] - w[0]).collect();
    assert_eq!(gaps, [1_020, 1_020, 1_020], "one a second, with the margin, from the first after the wait: {slots:?}");
}

/// A worker that makes no call for the job `miss` (it started too late), as the
/// in-process worker reports it.
struct MissesOne(Arc<paceline_shared::pacer::MissedSlots>);

#[async_trait]
impl WorkerHandler for MissesOne {
    async fn handle(&self, payload: WorkerPayload) -> PortResult<Option<paceline_shared::outcome::OutcomeRecord>> {
        if let WorkerPayload::Job { job, slot: Some(slot), .. } = payload {
            if job.id.as_str() == "miss" {
                self.0.push(paceline_shared::pacer::MissedSlot { slot: slot.not_before, arrival: slot.not_before, cost: job.cost, lane: job.lane.clone() });
            }
        }
        Ok(None)
    }
}

/// Under CPU load 13.8% of in-process hand-offs missed their slot and went back without
/// a call, and the quota of each was lost: the summary said 91.2% of a tier of which the
/// API got 78.6%. A slot that made no call is given back to the pacer, and the report
/// counts calls.
#[tokio::test(start_paused = true)]
async fn a_slot_whose_worker_made_no_call_is_given_back_and_the_report_counts_calls() {
    let missed = Arc::new(paceline_shared::pacer::MissedSlots::default());
    let lane = lane_built(
        &["10/s", "3/10s"],
        0,
        |clock| RecordingInvoker::new(clock).forwarding_to(Arc::new(MissesOne(missed.clone()))),
        |settings| settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(300)),
    );
    let lane = Lane { orchestrator: lane.orchestrator.with_missed_slots(missed.clone()), ..lane };
    enqueue(&lane, ["miss", "j1", "j2", "j3", "j4"].map(job)).await;
    let report = lane.orchestrator.run(&opts(false, Duration::from_secs(5))).await.unwrap();
    let slots = slot_offsets(&lane);
    // Without the give-back, j3 would wait for the first slot to leave the 10 s window.
    assert_eq!(slots, vec![300, 400, 500, 600], "three calls and one slot without a call in the 10 s window");
    assert_eq!(report.slots_given_back, 1);
    let ten_seconds = &report.tiers[1];
    assert_eq!((ten_seconds.units, ten_seconds.peak_window), (3, 3), "the report counts calls, not slots");
}

#[tokio::test(start_paused = true)]
async fn without_dispatch_ahead_payloads_carry_no_slot() {
    let lane = lane(&["5/s"], 0);
    enqueue(&lane, [job("a")]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert!(matches!(lane.invoker.accepted()[0].1, WorkerPayload::Job { slot: None, .. }));
}

#[test]
fn a_scheduled_run_hands_over_just_before_the_last_kick_it_would_overlap() {
    let margin = Duration::from_secs(5);
    // Kicked for 12:00:00, started at 12:00:00.3 with a 70 s timeout: the 12:01:00 kick
    // falls inside, so dispatch stops at 12:00:59.75 (deadline 12:01:04.75 less the margin).
    let tick = T0;
    let deadline = T0.plus(Duration::from_millis(70_300));
    assert_eq!(handover_deadline(deadline, tick, Duration::from_secs(60), margin), T0.plus(Duration::from_millis(64_750)));
    // A 15-minute timeout covers 14 kicks: it runs until just before the 14th.
    let long = T0.plus(Duration::from_secs(900));
    assert_eq!(handover_deadline(long, tick, Duration::from_secs(60), margin), T0.plus(Duration::from_millis(14 * 60_000 - 250 + 5_000)));
    // No kick inside the run: the deadline stands.
    let short = T0.plus(Duration::from_secs(30));
    assert_eq!(handover_deadline(short, tick, Duration::from_secs(60), margin), short);
}

async fn day_usage(lane: &Lane, tier: &str) -> u64 {
    let key = tier.parse::<paceline_shared::quota::Tier>().unwrap().usage_key(chrono_tz::UTC, T0);
    lane.store.load_usage(&[key]).await.unwrap()[0]
}

#[tokio::test(start_paused = true)]
async fn a_crash_never_leaves_the_day_counter_under_what_was_dispatched() {
    let lane = lane(&["5/s", "60/day"], 0);
    enqueue(&lane, (0..100).map(|i| job(&format!("j{i}")))).await;
    // kill -9 at 5.7 s: the run's future is dropped where it stands, nothing flushed.
    let crashed = tokio::time::timeout(Duration::from_millis(5_700), lane.orchestrator.run(&opts(true, Duration::from_secs(600)))).await;
    assert!(crashed.is_err(), "the run was meant to be cut off");
    let dispatched = lane.invoker.accepted().len() as u64;
    assert_eq!(dispatched, 29);
    assert!(day_usage(&lane, "60/day").await >= dispatched, "the day counter is under what the crashed run spent");

    // The restart may under-use the day (the crashed run's unspent reservation stays
    // counted), never over-use it.
    lane.store.clear_lease().unwrap();
    let deadline = lane.clock.now().plus(Duration::from_secs(600));
    lane.orchestrator.run(&RunOptions { deadline, ..opts(true, Duration::ZERO) }).await.unwrap();
    assert!(lane.invoker.accepted().len() <= 60, "{} calls in a 60/day tier", lane.invoker.accepted().len());
    assert!(day_usage(&lane, "60/day").await <= 60);
}

#[tokio::test(start_paused = true)]
async fn a_clean_stop_gives_back_the_day_units_it_reserved_and_did_not_spend() {
    let lane = lane(&["5/s", "1000/day"], 0);
    enqueue(&lane, (0..3).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(report.dispatched, 3);
    assert_eq!(day_usage(&lane, "1000/day").await, 3);
}

#[tokio::test(start_paused = true)]
async fn while_renewals_fail_dispatch_stops_when_the_lease_runs_out_locally() {
    let mut lane = lane(&["1/s"], 0);
    let store = Arc::new(Faulty::new(lane.store.clone()));
    store.fail_next(Method::RenewLease, 100, &PortError::Transient("dynamodb: timed out".into()));
    lane.orchestrator = lane.orchestrator.with_store(store);
    enqueue(&lane, (0..60).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(120))).await.unwrap();
    // lease_ttl 30 s, of which this process counts on 24 s: the last slot before that.
    assert_eq!(report.stop, StopReason::LeaseLost);
    assert_eq!(*offsets(&lane).last().unwrap(), 23_000);
    let depth = lane.store.depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible), (36, 0), "what was not dispatched is visible again");
}

#[tokio::test(start_paused = true)]
async fn a_payload_over_the_invoker_s_limit_is_dead_lettered_and_the_run_goes_on() {
    let lane = lane(&["10/s"], 0);
    lane.invoker.fail_next([PortError::TooLarge("RequestTooLargeException: 262144 bytes".into())]);
    enqueue(&lane, vec![job("big"), job("b")]).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(report.stop, StopReason::Drained);
    assert_eq!(offsets(&lane), vec![100]);
    let dead = lane.store.dead_letters().unwrap();
    assert_eq!(dead.len(), 1);
    assert!(dead[0].body.contains("\"big\"") && dead[0].reason.detail.contains("RequestTooLarge"), "{:?}", dead[0]);
    assert_eq!(lane.store.depth().await.unwrap().visible, 0);
}

#[tokio::test(start_paused = true)]
async fn a_cleared_cool_down_no_longer_holds_the_next_run() {
    let lane = lane(&["10/s"], 0);
    lane.store.extend_cool_down(UnixMillis(253_402_300_799_000)).await.unwrap();
    enqueue(&lane, vec![job("a")]).await;
    let first = lane.orchestrator.run(&opts(false, Duration::from_secs(5))).await.unwrap();
    assert_eq!(first.dispatched, 0);
    lane.store.clear_cool_down().await.unwrap();
    let at = lane.clock.now();
    lane.orchestrator.run(&RunOptions { deadline: at.plus(Duration::from_secs(10)), ..opts(true, Duration::ZERO) }).await.unwrap();
    assert_eq!(lane.invoker.accepted().first().map(|(t, _)| *t), Some(at));
}

#[tokio::test(start_paused = true)]
async fn a_large_body_is_paced_on_its_arrival_so_the_next_call_keeps_its_distance() {
    let lane = lane(&["5/s"], 0);
    let body = format!("\"{}\"", "x".repeat(1_000_000));
    let big = format!(r#"{{"id":"big","request":{{"method":"POST","path":"/upload","body":{body}}}}}"#);
    enqueue(&lane, vec![job("a"), big, job("b"), job("c")]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    // The 1 MB body may arrive 100 ms after its slot (200): the next call goes 200 ms
    // after that arrival, not after the slot.
    assert_eq!(offsets(&lane), vec![0, 200, 500, 700]);
}

/// A provider reading with nothing left until `resets_after` past `T0`, on a quota the
/// config does not name (the hostile probe's `X-RateLimit-Limit: 7, Remaining: 0`).
fn nothing_left_until(resets_after: Duration) -> ProviderReading {
    ProviderReading { limit: 7, remaining: 0, window_ms: None, resets_at: T0.plus(resets_after), at: T0 }
}

#[tokio::test(start_paused = true)]
async fn a_rate_of_zero_until_a_reading_s_reset_ends_at_the_reset_instead_of_stalling_the_lane() {
    let lane = lane(&["10/s"], 0);
    lane.store.record_provider_reading(&nothing_left_until(Duration::from_secs(5))).await.unwrap();
    enqueue(&lane, (0..20).map(|i| job(&format!("j{i}")))).await;
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!((report.dispatched, report.stop), (20, StopReason::Drained));
    let sent = offsets(&lane);
    // Jobs go until the first refresh reads the reading, none until its reset, then the
    // pace resumes.
    assert!(sent.iter().all(|t| *t <= 1_000 || *t >= 5_000), "{sent:?}");
    assert!(*sent.last().unwrap() < 7_000, "the pace resumed at the reset: {sent:?}");
}

#[tokio::test(start_paused = true)]
async fn an_operator_s_clear_ends_a_rate_the_provider_s_reading_set() {
    let lane = lane(&["10/s"], 0);
    // A reading stored before resets were capped: nothing left for an hour.
    lane.store.record_provider_reading(&nothing_left_until(Duration::from_secs(3_600))).await.unwrap();
    enqueue(&lane, (0..20).map(|i| job(&format!("j{i}")))).await;
    let store = lane.store.clone();
    let clear = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        store.clear_cool_down().await.unwrap();
    });
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    clear.await.unwrap();
    assert_eq!((report.dispatched, report.stop), (20, StopReason::Drained));
    assert_eq!(lane.store.provider_reading().await.unwrap(), None, "the clear forgets the reading");
    let sent = offsets(&lane);
    assert!(sent.iter().all(|t| *t <= 1_000 || *t >= 3_000), "{sent:?}");
    assert!(*sent.last().unwrap() < 6_000, "the configured pace after the clear: {sent:?}");
}

/// Under `10/s + 50/10s` one 429 for a call made on its slot (jitter at a window's
/// edge) cut the rate to 70% and the sliding windows carried the slow stretch into every
/// later one: 30.2 s for a 25 s drain. Now the pace is whole again once the cool-down is
/// over, and the windows' margin grows by what the 429 showed.
#[tokio::test(start_paused = true)]
async fn a_lone_429_widens_the_margin_and_the_pace_recovers_within_a_window_of_the_longest_tier() {
    let lane = lane(&["10/s", "50/10s"], 10);
    enqueue(&lane, (0..150).map(|i| job(&format!("j{i}")))).await;
    let store = lane.store.clone();
    let refused = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(2_050)).await;
        store.extend_cool_down(T0.plus(Duration::from_millis(2_550))).await.unwrap();
    });
    let report = lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    refused.await.unwrap();
    assert_eq!((report.dispatched, report.stop), (150, StopReason::Drained));
    let sent = offsets(&lane);
    assert_eq!(sent[..3], [0, 101, 202], "the configured margin until the 429");
    let after: Vec<u64> = sent.iter().copied().filter(|t| (4_000..5_000).contains(t)).collect();
    assert!(after.len() >= 9 && after.windows(2).all(|w| w[1] - w[0] == 102), "the margin doubled to 20 ms: {after:?}");
    // Without a cut the 150 calls take three 10 s windows and what the cool-down and the
    // wider margin cost (a 429 that cut the rate took 30.2 s).
    assert!(*sent.last().unwrap() < 26_000, "{:?}", &sent[140..]);
    assert_eq!(report.slowest_rate, None, "a lone 429 cuts no rate");
}

/// Enqueues four jobs and drains them in a run that starts now.
async fn next_run_of_four(lane: &Lane, prefix: &str) {
    enqueue(lane, (0..4).map(|i| job(&format!("{prefix}{i}")))).await;
    let at = lane.clock.now();
    lane.orchestrator.run(&RunOptions { deadline: at.plus(Duration::from_secs(60)), ..opts(true, Duration::ZERO) }).await.unwrap();
}

/// The margin a 429 taught is saved with the pacer: the next run keeps it, unless an
/// operator's `paceline rate reset` (or `circuit close`) cleared the 429's cool-down
/// between the runs.
#[tokio::test(start_paused = true)]
async fn the_next_run_keeps_a_learned_margin_until_an_operator_clears_it() {
    let lane = lane(&["10/s"], 10);
    enqueue(&lane, (0..30).map(|i| job(&format!("a{i}")))).await;
    let store = lane.store.clone();
    let refused = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_050)).await;
        store.extend_cool_down(T0.plus(Duration::from_millis(1_200))).await.unwrap();
    });
    lane.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    refused.await.unwrap();
    let gaps = |lane: &Lane, from: usize| offsets(lane)[from..].windows(2).map(|w| w[1] - w[0]).collect::<Vec<_>>();
    next_run_of_four(&lane, "b").await;
    assert_eq!(gaps(&lane, 30), [102, 102, 102], "the learned 20 ms margin carried over");
    lane.store.clear_cool_down().await.unwrap();
    next_run_of_four(&lane, "c").await;
    assert_eq!(gaps(&lane, 34), [101, 101, 101], "the configured 10 ms after the operator's clear");
}

/// A stack of many lanes from `lanes` (a `[lanes]` table), under a shared 100/s.
fn lanes_stack(lanes: &str) -> Lane {
    lanes_stack_sharing("\"100/s\"", lanes)
}

/// A stack of many lanes from `lanes`, under the shared `tiers` (TOML, `"10/s", "5/day"`).
fn lanes_stack_sharing(tiers: &str, lanes: &str) -> Lane {
    lanes_stack_adjusted(tiers, lanes, |_| {})
}

/// [`lanes_stack_sharing`], its settings then changed by `adjust`.
fn lanes_stack_adjusted(tiers: &str, lanes: &str, adjust: impl FnOnce(&mut Settings)) -> Lane {
    let text = format!("[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [{tiers}]\nsafety_margin = \"0ms\"\n{lanes}");
    let config = paceline_shared::config::Config::parse(&text, std::path::Path::new("/stack"), &|_| None).unwrap();
    let mut lane = lane_with_settings(&["100/s"], 0, |settings| {
        settings.lanes = config.lanes.clone();
        settings.quota = config.quota.clone();
        settings.orchestrator.state_refresh = Duration::from_secs(1);
        adjust(settings);
    });
    lane.orchestrator = lane.orchestrator.with_scoped_stores(lane.store.clone());
    lane
}

fn lane_job(lane: &str, id: &str) -> String {
    format!(r#"{{"id":"{id}","lane":"{lane}","request":{{"method":"GET","path":"/items/{id}"}}}}"#)
}

/// `paceline lanes set acme --tiers 2/s` while a run goes on: taken up at the next
/// refresh, after which no window of the new tier holds more than its limit (the lane
/// waits a window of it after its last call at the old pace), and jobs go at 2/s.
#[tokio::test(start_paused = true)]
async fn an_operator_s_change_of_a_lane_s_tiers_is_taken_up_within_state_refresh_and_its_windows_hold_the_new_limit() {
    let stack = lanes_stack("[lanes]\ntiers = [\"10/s\"]\n");
    enqueue(&stack, (0..40).map(|i| lane_job("acme", &format!("a{i}")))).await;
    let acme = stack.store.scoped(&StoreScope::Lane("acme".parse().unwrap()));
    let operator = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        let change = paceline_shared::config::LaneChange { tiers: Some(vec!["2/s".parse().unwrap()]), ..Default::default() };
        acme.set_lane_change(Some(&change)).await.unwrap();
    });
    let report = stack.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    operator.await.unwrap();
    assert_eq!(report.dispatched, 40);
    let at = offsets(&stack);
    assert!(at.iter().filter(|t| **t < 2_000).count() >= 15, "10/s before the change: {at:?}");
    for (i, t) in at.iter().enumerate().filter(|(_, t)| **t >= 2_500) {
        let in_window = at[..=i].iter().filter(|earlier| **earlier + 1_000 > *t).count();
        assert!(in_window <= 2, "{in_window} calls in the second up to {t} ms: {at:?}");
    }
    let last = *at.last().unwrap();
    assert!(last < 20_000, "the rest went at 2/s, not slower: the last at {last} ms");
}

/// Jobs whose workers started 150 ms late before, in a stack of lanes under a shared
/// quota, handed off 400 ms ahead: each was given a slot its lateness after its lane's
/// next, and since the pacers take slots in order, every lane's later slots moved out as
/// far (1,000 lanes evenly under 10,000/s with Lambda workers used 88.7% of the shared
/// tier, 98.1% before the simulated workers learned late starts). The stack learns the
/// lead instead: every job goes that much earlier, and the shared quota's slots move
/// out once, when the lead grows.
#[tokio::test(start_paused = true)]
async fn late_started_jobs_make_every_lane_hand_off_earlier_and_leave_no_gap_in_the_shared_quota() {
    let stack = lanes_stack_adjusted("\"100/s\"", "[lanes]\ntiers = [\"1000/s\"]\n", |settings| {
        settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(400));
    });
    let late = |lane: &str, id: &str| lane_job(lane, id).replacen(r#""request""#, r#""late_start_ms":150,"request""#, 1);
    let jobs =
        (0..100).flat_map(|i| ["a", "b", "c"].map(|lane| if i % 25 == 24 { late(lane, &format!("{lane}{i}")) } else { lane_job(lane, &format!("{lane}{i}")) }));
    enqueue(&stack, jobs).await;
    stack.orchestrator.run(&opts(true, Duration::from_secs(30))).await.unwrap();
    let mut slots = slot_offsets(&stack);
    assert_eq!(slots.len(), 300);
    slots.sort_unstable();
    // One step of the lead's 150 ms when the first late job is received, none after.
    let gaps: Vec<u64> = slots.windows(2).map(|w| w[1] - w[0]).filter(|gap| *gap > 10).collect();
    assert!(gaps.len() <= 1 && gaps.iter().all(|gap| *gap <= 160), "the shared 100/s went unused between slots: gaps of {gaps:?} ms");
    let accepted = stack.invoker.accepted();
    let late_leads: Vec<u64> = accepted
        .iter()
        .filter_map(|(t, payload)| match payload {
            WorkerPayload::Job { job, slot: Some(slot), .. } if job.late_start_ms > 0 => Some(slot.not_before.since(*t).as_millis() as u64),
            _ => None,
        })
        .collect();
    assert_eq!(late_leads.len(), 12);
    assert!(late_leads.iter().all(|lead| *lead >= 550), "a late-started job's worker gets its lateness more: {late_leads:?}");
}

/// A backlog over three lanes, handed off as on Lambda: each lane holds a few jobs of
/// the stack's batch window, the stack all of it, and the first slot is the hand-off's
/// own 400 ms out, not the whole lead's 900 (the lanes' batches go together).
#[tokio::test(start_paused = true)]
async fn a_backlog_over_many_lanes_starts_at_the_hand_off_s_own_lead() {
    let slots = slots_of_a_backlog_over_three_lanes("\"100/s\"", 20).await;
    assert_eq!(slots, (0..60).map(|i| 400 + 10 * i).collect::<Vec<u64>>());
}

/// The slots, in order, of `per_lane` jobs in each of three lanes of 1,000/s under the
/// shared `tiers`, handed off as on Lambda (a 400 ms lead) and drained.
async fn slots_of_a_backlog_over_three_lanes(tiers: &str, per_lane: usize) -> Vec<u64> {
    let stack = lanes_stack_adjusted(tiers, "[lanes]\ntiers = [\"1000/s\"]\n", |settings| as_on_lambda(settings, 400));
    enqueue(&stack, (0..per_lane).flat_map(|i| ["a", "b", "c"].map(|lane| lane_job(lane, &format!("{lane}{i}"))))).await;
    stack.orchestrator.run(&opts(true, Duration::from_secs(10))).await.unwrap();
    let mut slots = slot_offsets(&stack);
    slots.sort_unstable();
    slots
}

/// A backlog of fewer jobs than a batch window takes at the stack's pace (600, where
/// 10,000/s takes 5,000 in the window) starts at the hand-off's own lead too: receives
/// that come back full say the queue holds a backlog, not jobs coming one at a time.
/// Its first slot was the whole lead and the window out (900 ms), half a second of the
/// shared quota unused.
#[tokio::test(start_paused = true)]
async fn a_backlog_smaller_than_a_batch_window_starts_at_the_hand_off_s_own_lead() {
    let slots = slots_of_a_backlog_over_three_lanes("\"10000/s\"", 200).await;
    assert_eq!((slots.len(), slots[0]), (600, 400), "{slots:?}");
}

/// Lanes held by nothing but the shared quota divide it by weight: 2:1:1 weights give
/// 2:1:1 calls within 2%, and Jain's index over them (by weight) is at least 0.99; the
/// lanes whose jobs are behind gold's on the queue are reached, and the shared quota is
/// used without a gap.
#[tokio::test(start_paused = true)]
async fn lanes_contending_for_the_shared_quota_divide_it_by_weight_and_the_run_reports_jain_s_index() {
    let stack = lanes_stack("[lanes]\ntiers = [\"1000/s\"]\n[lanes.gold]\nweight = 2\n");
    // Gold's jobs first on the queue: the others' are reached behind them.
    let jobs = [("gold", 2_000), ("a", 1_000), ("b", 1_000)].into_iter().flat_map(|(lane, n)| (0..n).map(move |i| lane_job(lane, &format!("{lane}{i}"))));
    enqueue(&stack, jobs).await;
    let report = stack.orchestrator.run(&opts(false, Duration::from_secs(35))).await.unwrap();
    let at = offsets(&stack);
    let gaps: Vec<u64> = at.windows(2).map(|w| w[1] - w[0]).filter(|gap| *gap > 10).collect();
    assert!(gaps.is_empty(), "the shared 100/s went unused while lanes had jobs: gaps of {gaps:?} ms");
    let calls = |lane: &str| report.lanes.iter().find(|l| l.lane == lane).map_or(0, |l| l.dispatched) as f64;
    let total = calls("gold") + calls("a") + calls("b");
    assert!(total >= 3_390.0, "the shared 100/s used: {total} calls in 34 s");
    // Once the others' jobs were reached behind gold's (within the first second):
    let accepted = stack.invoker.accepted();
    let calls_after = |lane: &str| {
        let of_lane = |payload: &WorkerPayload| matches!(payload, WorkerPayload::Job { job, .. } if job.lane.as_str() == lane);
        accepted.iter().filter(|(at, payload)| at.since(T0) >= Duration::from_secs(2) && of_lane(payload)).count() as f64
    };
    let (gold, a, b) = (calls_after("gold"), calls_after("a"), calls_after("b"));
    for light in [a, b] {
        assert!((gold / light - 2.0).abs() <= 0.04, "weights 2:1 gave {gold}:{light}");
    }
    let fairness = report.fairness.expect("two windows of three lanes contending");
    assert!(fairness.jain_index >= 0.99 && fairness.windows >= 1, "{fairness:?}");
}

/// `[lanes] on_429 = "stack"`: a 429 that cooled the stack holds every lane until it
/// ends (taken up within `state_refresh` and the read, which goes in the background:
/// the call of the very instant the read goes may go too); without it, a lane's
/// cool-down is its own.
#[tokio::test(start_paused = true)]
async fn a_stack_wide_cool_down_holds_every_lane_when_429s_cool_the_stack() {
    for (on_429, holds_all) in [("stack", true), ("lane", false)] {
        let stack = lanes_stack(&format!("[lanes]\ntiers = [\"10/s\"]\non_429 = \"{on_429}\"\n"));
        enqueue(&stack, ["a", "b"].into_iter().flat_map(|lane| (0..40).map(move |i| lane_job(lane, &format!("{lane}{i}"))))).await;
        let store = stack.store.clone();
        let refused = tokio::spawn(async move {
            tokio::time::sleep(Duration::from_millis(1_500)).await;
            store.scoped(&StoreScope::Stack).extend_cool_down(T0.plus(Duration::from_secs(4))).await.unwrap();
        });
        stack.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
        refused.await.unwrap();
        let during = offsets(&stack).into_iter().filter(|t| (2_001..4_000).contains(t)).count();
        if holds_all {
            assert_eq!(during, 0, "a call went while the stack cooled down");
        } else {
            assert!(during >= 30, "the stack's state held lanes whose 429s are their own: {during} calls");
        }
    }
}

/// A lane with nothing to send is not re-read on every `state_refresh`; when jobs come
/// in again, it is re-read before any of them goes: an operator's hold made while it
/// was idle holds them.
#[tokio::test(start_paused = true)]
async fn an_idle_lane_is_re_read_before_its_next_jobs_go() {
    let stack = lanes_stack("[lanes]\ntiers = [\"10/s\"]\n");
    enqueue(&stack, (0..3).map(|i| lane_job("a", &format!("first{i}")))).await;
    let store = stack.store.clone();
    let operator = tokio::spawn(async move {
        tokio::time::sleep(Duration::from_secs(3)).await;
        let acme = store.scoped(&StoreScope::Lane("a".parse().unwrap()));
        let held = acme.circuit().await.unwrap().hold(0, "operator", T0.plus(Duration::from_secs(3))).unwrap();
        acme.swap_circuit(0, &held).await.unwrap();
        let later: Vec<OutgoingMessage> = (0..3).map(|i| OutgoingMessage::fresh(lane_job("a", &format!("later{i}")))).collect();
        store.send(&later).await.unwrap();
    });
    stack.orchestrator.run(&opts(false, Duration::from_secs(8))).await.unwrap();
    operator.await.unwrap();
    let jobs_after_hold: Vec<String> = stack
        .invoker
        .accepted()
        .into_iter()
        .filter(|(at, _)| at.since(T0) >= Duration::from_secs(3))
        .map(|(at, payload)| format!("{} ms: {payload:?}", at.since(T0).as_millis()))
        .collect();
    assert!(jobs_after_hold.is_empty(), "the held lane sent: {jobs_after_hold:#?}");
}

/// `paceline circuit open --hold`: the circuit stays open, and no health check is sent
/// while it is held (an operator closes it).
#[tokio::test(start_paused = true)]
async fn a_held_circuit_sends_no_health_checks() {
    let lane = lane(&["10/s"], 0);
    let held = lane.store.circuit().await.unwrap().hold(0, "operator", T0).unwrap();
    lane.store.swap_circuit(0, &held).await.unwrap();
    enqueue(&lane, (0..3).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&opts(false, Duration::from_secs(8))).await.unwrap();
    assert_eq!(offsets(&lane), Vec::<u64>::new(), "a held circuit let a call through: {:?}", lane.invoker.accepted());
}

async fn stack_day_usage(stack: &Lane, tier: &str) -> u64 {
    let key = tier.parse::<paceline_shared::quota::Tier>().unwrap().usage_key(chrono_tz::UTC, T0);
    stack.store.scoped(&StoreScope::Stack).load_usage(&[key]).await.unwrap()[0]
}

/// A day tier in `[quota]` with `[lanes]`: every lane's calls count against it, no more
/// go that day whatever lane they are on, and a clean stop gives back what it reserved
/// and did not spend, so the store holds exactly what was called.
#[tokio::test(start_paused = true)]
async fn a_shared_day_tier_holds_every_lane_and_the_store_counts_exactly_what_was_called() {
    let stack = lanes_stack_sharing("\"100/s\", \"30/day\"", "[lanes]\ntiers = [\"10/s\"]\n");
    enqueue(&stack, (0..25).flat_map(|i| [lane_job("acme", &format!("a{i}")), lane_job("globex", &format!("g{i}"))])).await;
    let report = stack.orchestrator.run(&opts(false, Duration::from_secs(30))).await.unwrap();
    assert_eq!(report.dispatched, 30);
    assert_eq!(stack_day_usage(&stack, "30/day").await, 30);
    let again = stack.orchestrator.run(&RunOptions { deadline: stack.clock.now().plus(Duration::from_secs(10)), ..opts(false, Duration::ZERO) }).await.unwrap();
    assert_eq!(again.dispatched, 0, "the day is spent for every lane");
}

/// kill -9 in the middle of a run of many lanes: the shared day counter in the store is
/// never under what was called, so the restart cannot overrun the day.
#[tokio::test(start_paused = true)]
async fn a_crash_never_leaves_the_shared_day_counter_under_what_was_dispatched() {
    let stack = lanes_stack_sharing("\"10/s\", \"60/day\"", "[lanes]\ntiers = [\"5/s\"]\n");
    enqueue(&stack, (0..50).flat_map(|i| [lane_job("acme", &format!("a{i}")), lane_job("globex", &format!("g{i}"))])).await;
    let crashed = tokio::time::timeout(Duration::from_millis(3_700), stack.orchestrator.run(&opts(true, Duration::from_secs(600)))).await;
    assert!(crashed.is_err(), "the run was meant to be cut off");
    let dispatched = stack.invoker.accepted().len() as u64;
    assert!(dispatched >= 30, "{dispatched} calls before the crash");
    assert!(stack_day_usage(&stack, "60/day").await >= dispatched, "the shared day counter is under what the crashed run spent");
    stack.store.clear_lease().unwrap();
    let deadline = stack.clock.now().plus(Duration::from_secs(600));
    stack.orchestrator.run(&RunOptions { deadline, ..opts(true, Duration::ZERO) }).await.unwrap();
    assert!(stack.invoker.accepted().len() <= 60, "{} calls in a shared 60/day tier", stack.invoker.accepted().len());
}

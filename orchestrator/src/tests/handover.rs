//! The hand-over between runs under paused time: the relay is asked for `RELAY_LEAD`
//! before the stop, the lease is released with the final snapshot before the last
//! hand-offs settle, the next run continues the schedule slot for slot, and a snapshot
//! the next run cannot trust holds one window instead of failing the run.

use std::sync::Mutex;

use super::*;
use crate::handover::{await_release, Relay, RelayRequest, Release, RELAY_LEAD};

/// A relay that only records what it was asked.
#[derive(Default)]
struct RecordingRelay {
    asked: Mutex<Vec<(UnixMillis, RelayRequest)>>,
    clock: Mutex<Option<Arc<TokioClock>>>,
}

#[async_trait]
impl Relay for RecordingRelay {
    async fn start_next(&self, request: &RelayRequest) -> PortResult<()> {
        let at = self.clock.lock().unwrap().as_ref().map_or(UnixMillis(0), |clock| clock.now());
        self.asked.lock().unwrap().push((at, request.clone()));
        Ok(())
    }
}

/// A lane handing off ahead as on Lambda: a 400 ms lead and a 500 ms batch window (the
/// full lead 900 ms), 10/s, the stop 1 s before the deadline.
fn lambda_lane() -> Lane {
    lane_with_settings(&["10/s"], 0, |settings| as_on_lambda(settings, 400))
}

fn run_until(holder: &str, deadline: UnixMillis) -> RunOptions {
    RunOptions { holder: holder.into(), deadline, drain: false, stop: None }
}

/// The second run started 300 ms after the first stopped, within the batch window: it
/// took its first slot 900 ms ahead, skipping the two the first run's schedule had next
/// (10.0 s and 10.1 s went unused: the dip at every hand-over). It continues them now.
#[tokio::test(start_paused = true)]
async fn a_run_that_starts_within_the_batch_window_of_the_last_one_s_stop_continues_its_schedule_slot_for_slot() {
    let lane = lambda_lane();
    assert_eq!(lane.orchestrator.settings().dispatch_ahead(), Duration::from_millis(900));
    enqueue(&lane, (0..150).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&run_until("run-1", T0.plus(Duration::from_secs(10)))).await.unwrap();
    let first = slot_offsets(&lane);
    // A backlog: the first slot at the hand-off's own 400 ms lead (its batch went at
    // once); stopped at 9 s with slots decided up to 9 s + 900 ms.
    assert_eq!((first.first(), first.last(), first.len()), (Some(&400), Some(&9_900), 96));
    lane.clock.sleep_until(T0.plus(Duration::from_millis(9_300))).await;
    lane.orchestrator.run(&run_until("run-2", T0.plus(Duration::from_secs(13)))).await.unwrap();
    let all = slot_offsets(&lane);
    let second = &all[first.len()..];
    assert_eq!(second.first(), Some(&10_000), "one interval after the last run's last slot");
    assert!(all.windows(2).all(|w| w[1] - w[0] == 100), "no slot skipped across the runs: {all:?}");
}

#[tokio::test(start_paused = true)]
async fn a_run_asks_for_its_relay_before_it_stops_and_releases_the_lease_before_its_last_hand_offs_are_answered() {
    let lane = lane_built(
        &["10/s"],
        0,
        |clock| RecordingInvoker::new(clock).with_latency(Duration::from_secs(2)),
        |settings| {
            settings.workers = WorkerHost::Lambda;
            settings.orchestrator.dispatch_ahead = Some(Duration::from_millis(400));
        },
    );
    let relay = Arc::new(RecordingRelay::default());
    *relay.clock.lock().unwrap() = Some(lane.clock.clone());
    let orchestrator =
        Orchestrator::new(lane.store.clone(), lane.store.clone(), lane.invoker.clone(), lane.clock.clone(), lane.orchestrator.settings().clone())
            .with_relay(relay.clone());
    enqueue(&lane, (0..200).map(|i| job(&format!("j{i}")))).await;
    let stop = T0.plus(Duration::from_secs(19));
    let request = RelayRequest { after: "run-1".into(), release_by: stop };
    let give_up = T0.plus(Duration::from_secs(60));
    let waiting = async {
        let released = await_release(lane.store.as_ref(), lane.clock.as_ref(), &request, give_up).await.unwrap();
        (released, lane.clock.now())
    };
    let run = run_until("run-1", T0.plus(Duration::from_secs(20)));
    let (report, (released, seen_free_at)) = tokio::join!(orchestrator.run(&run), waiting);
    let ended_at = lane.clock.now();
    report.unwrap();
    assert_eq!(relay.asked.lock().unwrap().clone(), vec![(stop.minus(RELAY_LEAD), request)]);
    assert_eq!(released, Release::Free);
    assert!(seen_free_at <= stop.plus(Duration::from_millis(20)), "free at {seen_free_at}, the stop at {stop}");
    assert!(ended_at.since(seen_free_at) >= Duration::from_millis(1_900), "the run itself ended when its last hand-offs were answered ({ended_at})");
    let snapshot = lane.store.load_pacer().await.unwrap().expect("the final snapshot");
    assert!(snapshot.at_exit && snapshot.saved_at.is_some_and(|at| at <= seen_free_at));
}

#[tokio::test(start_paused = true)]
async fn a_drain_run_starts_no_relay() {
    let lane = lane(&["10/s"], 0);
    let relay = Arc::new(RecordingRelay::default());
    let orchestrator =
        Orchestrator::new(lane.store.clone(), lane.store.clone(), lane.invoker.clone(), lane.clock.clone(), lane.orchestrator.settings().clone())
            .with_relay(relay.clone());
    enqueue(&lane, (0..3).map(|i| job(&format!("j{i}")))).await;
    orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert!(relay.asked.lock().unwrap().is_empty());
}

/// An unreadable snapshot ended the run with a fatal error; the run now holds one
/// window of the longest tier and goes on.
#[tokio::test(start_paused = true)]
async fn an_unreadable_snapshot_holds_one_window_of_the_longest_tier_instead_of_failing_the_run() {
    let lane = lane(&["5/s", "60/min"], 0);
    let store = Arc::new(Faulty::new(lane.store.clone()));
    let orchestrator = Orchestrator::new(store.clone(), store.clone(), lane.invoker.clone(), lane.clock.clone(), lane.orchestrator.settings().clone());
    // Earlier runs held the lease.
    let lease = lane.store.acquire_lease("earlier", Duration::from_secs(30), T0).await.unwrap();
    lane.store.release_lease(&lease).await.unwrap();
    store.fail_next(Method::LoadPacer, 1, &PortError::Unreadable("stored pacer: expected value at line 1 column 1".into()));
    enqueue(&lane, vec![job("a"), job("b")]).await;
    orchestrator.run(&opts(true, Duration::from_secs(300))).await.unwrap();
    assert_eq!(offsets(&lane), vec![60_000, 60_200]);
}

#[tokio::test(start_paused = true)]
async fn a_missing_snapshot_after_earlier_runs_holds_one_window_and_a_first_run_does_not() {
    let lane = lane(&["5/s", "60/min"], 0);
    enqueue(&lane, vec![job("a")]).await;
    lane.orchestrator.run(&opts(true, Duration::from_secs(300))).await.unwrap();
    assert_eq!(offsets(&lane), vec![0], "the first run ever: nothing to hold for");
    lane.store.forget_pacer().unwrap();
    enqueue(&lane, vec![job("b")]).await;
    let second = lane.clock.now();
    lane.orchestrator.run(&RunOptions { deadline: second.plus(Duration::from_secs(300)), ..opts(true, Duration::ZERO) }).await.unwrap();
    assert_eq!(offsets(&lane)[1], second.plus(Duration::from_secs(60)).0 - T0.0);
}

/// A dispatch-ahead longer than the tier's window (a 600 ms lead and the 500 ms batch
/// window: 1.1 s ahead of 100/s) keeps the last run's calls going after the next run
/// starts. A worker's reading of the provider's count then (the window's 100 used, all by
/// the last run's calls) was read by the next run as other clients' use: it cut its pace
/// to 2/s and won it back over seconds, a dip at every hand-over (the simulated 30
/// minutes at 100/s used 94.7% of the tier instead of 99.0%). A run tells its own calls
/// from others' only in windows after the last run's last slot.
#[tokio::test(start_paused = true)]
async fn a_reading_of_the_last_run_s_calls_is_not_taken_for_other_clients_use() {
    let lane = lane_with_settings(&["100/s"], 0, |settings| as_on_lambda(settings, 600));
    assert_eq!(lane.orchestrator.settings().dispatch_ahead(), Duration::from_millis(1_100));
    enqueue(&lane, (0..1_500).map(|i| job(&format!("j{i}")))).await;
    lane.orchestrator.run(&run_until("run-1", T0.plus(Duration::from_secs(10)))).await.unwrap();
    let first = slot_offsets(&lane);
    assert_eq!(first.last(), Some(&10_100), "stopped at 9 s with slots decided up to 1.1 s later");
    // The last run's calls at 9.11 to 10.1 s fill the provider's window ending at 10.1 s.
    let reading = ProviderReading {
        limit: 100,
        remaining: 0,
        window_ms: Some(1_000),
        resets_at: T0.plus(Duration::from_millis(10_110)),
        at: T0.plus(Duration::from_millis(10_100)),
    };
    lane.store.record_provider_reading(&reading).await.unwrap();
    lane.clock.sleep_until(T0.plus(Duration::from_millis(9_020))).await;
    let report = lane.orchestrator.run(&run_until("run-2", T0.plus(Duration::from_secs(14)))).await.unwrap();
    let second = &slot_offsets(&lane)[first.len()..];
    let from_11_to_13 = second.iter().filter(|slot| (11_000..13_000).contains(*slot)).count();
    assert!(from_11_to_13 >= 198, "{from_11_to_13} calls in the 2 s from 11 s on; the slowest rate: {:?}", report.slowest_rate);
    assert_eq!(report.slowest_rate, None, "the pace never cut");
}

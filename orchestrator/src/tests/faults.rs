//! Every failure path of the drain loop under paused time: each port method the loop
//! calls fails (passing faults and fatal ones, a panic, a clock that jumps), and each
//! test asserts what the run did about it (dispatched, released, retried, ended) at
//! exact instants.
#![expect(clippy::disallowed_methods, reason = "paused-time tests move tokio's clock, the source of the TokioClock under test")]

use super::*;

/// A lane whose queue, store and invoker fail on request.
struct FaultyLane {
    lane: Lane,
    store: Arc<Faulty<EmbeddedStore>>,
    invoker: Arc<Faulty<RecordingInvoker>>,
    orchestrator: Orchestrator,
}

fn faulty_lane(tiers: &[&str]) -> FaultyLane {
    let lane = lane(tiers, 0);
    let store = Arc::new(Faulty::new(lane.store.clone()));
    let invoker = Arc::new(Faulty::new(lane.invoker.clone()));
    let settings = lane.orchestrator.settings().clone();
    let orchestrator = Orchestrator::new(store.clone(), store.clone(), invoker.clone(), lane.clock.clone(), settings);
    FaultyLane { lane, store, invoker, orchestrator }
}

/// Makes the next `n` calls of `method` fail with `error`, from `after` into the run on.
fn fail_from<T: ?Sized + Send + Sync + 'static>(faulty: &Arc<Faulty<T>>, after: Duration, method: Method, n: usize, error: PortError) {
    let faulty = faulty.clone();
    tokio::spawn(async move {
        tokio::time::sleep(after).await;
        faulty.fail_next(method, n, &error);
    });
}

fn throttled() -> PortError {
    PortError::Throttled("ThrottlingException".into())
}

fn transient() -> PortError {
    PortError::Transient("connection reset".into())
}

fn jobs(n: usize) -> impl Iterator<Item = String> {
    (0..n).map(|i| job(&format!("j{i}")))
}

fn seconds(n: u64) -> Vec<u64> {
    (0..n).map(|i| i * 1_000).collect()
}

async fn visible(lane: &Lane) -> (u64, u64) {
    let depth = lane.store.depth().await.unwrap();
    (depth.visible, depth.not_visible)
}

#[tokio::test(start_paused = true)]
async fn a_throttled_circuit_read_is_retried_with_back_off_and_dispatch_goes_on() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(8)).await;
    fail_from(&f.store, Duration::from_millis(1_500), Method::Circuit, 3, throttled());
    let report = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&f.lane), seconds(8));
    assert_eq!(report.stop, StopReason::Drained);
    // At the start, then every second: 1 s ok; 2 s, 3 s and 5 s throttled (back-off 1, 2,
    // 4 s); the next at 9 s is after the drain at 7.5 s.
    assert_eq!(f.store.calls(Method::Circuit), 5);
}

#[tokio::test(start_paused = true)]
async fn a_failed_snapshot_write_is_retried_and_the_final_one_lands() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(8)).await;
    fail_from(&f.store, Duration::from_millis(500), Method::SavePacer, 2, transient());
    f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&f.lane), seconds(8));
    // At the start; every 2 s: 2 s and 3 s fail (back-off 1 s, then 2 s), 5 s and 7 s land;
    // the last at the clean stop.
    assert_eq!(f.store.calls(Method::SavePacer), 6);
    assert!(f.lane.store.load_pacer().await.unwrap().is_some_and(|snapshot| snapshot.at_exit));
}

#[tokio::test(start_paused = true)]
async fn a_failed_receive_is_retried_after_a_second() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(3)).await;
    f.store.fail_next(Method::Receive, 1, &transient());
    f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&f.lane), vec![1_000, 2_000, 3_000]);
}

#[tokio::test(start_paused = true)]
async fn a_failed_delete_is_sent_again_and_no_job_is_dispatched_twice() {
    let f = faulty_lane(&["10/s"]);
    enqueue(&f.lane, jobs(25)).await;
    f.store.fail_next(Method::Delete, 1, &throttled());
    let report = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(report.dispatched, 25);
    let ids: std::collections::BTreeSet<String> = f.lane.invoker.accepted().iter().map(|(_, p)| format!("{p:?}")).collect();
    assert_eq!(ids.len(), 25, "every job handed off once");
    assert_eq!(visible(&f.lane).await, (0, 0), "the receipts of the failed delete were deleted later");
    assert!(f.store.calls(Method::Delete) >= 4, "{} deletes for 25 receipts and one failure", f.store.calls(Method::Delete));
}

#[tokio::test(start_paused = true)]
async fn a_fatal_prefetch_ends_the_run_with_everything_released() {
    let f = faulty_lane(&["10/s"]);
    enqueue(&f.lane, jobs(40)).await;
    fail_from(&f.store, Duration::from_millis(50), Method::Receive, 1, PortError::Fatal("AccessDenied: sqs:ReceiveMessage".into()));
    let err = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
    assert!(matches!(err, RunError::Port(PortError::Fatal(ref why)) if why.contains("AccessDenied")), "{err}");
    assert!(!err.is_retryable());
    let dispatched = offsets(&f.lane).len() as u64;
    assert!(dispatched > 0 && dispatched < 40);
    assert_eq!(visible(&f.lane).await, (40 - dispatched, 0), "what was in hand is visible again");
    assert_eq!(f.lane.store.lease().await.unwrap(), None, "the lease is given up");
}

#[tokio::test(start_paused = true)]
async fn a_lease_lost_at_renewal_stops_dispatch_before_the_next_slot() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(30)).await;
    f.store.fail_next(Method::RenewLease, 1, &PortError::Conflict("lease epoch 1 was lost".into()));
    let report = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    // The renewal is due at 10 s, before that second's slot: nothing goes at 10 s.
    assert_eq!(report.stop, StopReason::LeaseLost);
    assert_eq!(offsets(&f.lane), seconds(10));
    assert_eq!(visible(&f.lane).await, (20, 0));
}

#[tokio::test(start_paused = true)]
async fn a_refused_invoke_that_is_fatal_ends_the_run_and_the_job_is_released() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(3)).await;
    f.invoker.fail_next(Method::Invoke, 1, &PortError::Fatal("ResourceNotFoundException: paceline-worker".into()));
    let err = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
    assert!(err.to_string().contains("ResourceNotFound"), "{err}");
    assert!(offsets(&f.lane).is_empty());
    assert_eq!(visible(&f.lane).await, (3, 0), "the refused job and the rest are visible again");
}

#[tokio::test(start_paused = true)]
async fn a_panicking_invoke_ends_the_run_and_loses_no_job() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(3)).await;
    f.invoker.panic_next(Method::Invoke);
    let err = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
    assert!(err.to_string().contains("a background task failed"), "{err}");
    // The job whose hand-off panicked stays hidden until its visibility timeout; the rest
    // are released.
    assert_eq!(visible(&f.lane).await, (2, 1));
    f.lane.clock.sleep_until(f.lane.clock.now().plus(Duration::from_secs(61))).await;
    assert_eq!(visible(&f.lane).await, (3, 0));
}

/// Runs 60 jobs at 1/s while the clock jumps 40 s at 5.5 s (a frozen process, a
/// suspended VM), with `meanwhile` done at the jump.
async fn run_through_a_clock_jump(f: &FaultyLane, meanwhile: impl FnOnce() + Send + 'static) -> RunReport {
    enqueue(&f.lane, jobs(60)).await;
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(5_500)).await;
        meanwhile();
        tokio::time::advance(Duration::from_secs(40)).await;
    });
    f.orchestrator.run(&opts(false, Duration::from_secs(60))).await.unwrap()
}

#[tokio::test(start_paused = true)]
async fn a_process_frozen_past_its_lease_stops_if_another_took_the_lease_meanwhile() {
    let f = faulty_lane(&["1/s"]);
    let store = f.lane.store.clone();
    let report = run_through_a_clock_jump(&f, move || {
        let taken = futures_now(store.acquire_lease("other", Duration::from_secs(30), T0.plus(Duration::from_millis(45_500))));
        assert!(taken.is_ok(), "{taken:?}");
    })
    .await;
    assert_eq!(report.stop, StopReason::LeaseLost);
    assert_eq!(offsets(&f.lane), seconds(6), "no hand-off after the jump");
}

#[tokio::test(start_paused = true)]
async fn a_process_frozen_past_its_lease_renews_it_before_dispatching_again() {
    let f = faulty_lane(&["1/s"]);
    let report = run_through_a_clock_jump(&f, || {}).await;
    assert_eq!(report.stop, StopReason::Deadline);
    let after_jump: Vec<u64> = offsets(&f.lane).into_iter().skip(6).take(3).collect();
    assert_eq!(after_jump, vec![45_500, 46_500, 47_500], "dispatch resumes once the renewal came through");
}

/// Polls a future that completes at once (the embedded store's calls never wait).
fn futures_now<F: std::future::Future>(future: F) -> F::Output {
    let mut future = std::pin::pin!(future);
    match future.as_mut().poll(&mut std::task::Context::from_waker(std::task::Waker::noop())) {
        std::task::Poll::Ready(output) => output,
        std::task::Poll::Pending => panic!("the embedded store answered later"),
    }
}

#[tokio::test(start_paused = true)]
async fn a_failed_reservation_holds_dispatch_for_its_back_off() {
    let f = faulty_lane(&["5/s", "100/day"]);
    enqueue(&f.lane, jobs(3)).await;
    f.store.fail_next(Method::AddUsage, 1, &throttled());
    f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(offsets(&f.lane), vec![1_000, 1_200, 1_400]);
    assert_eq!(day_usage(&f.lane, "100/day").await, 3, "the unspent reservation is given back");
}

#[tokio::test(start_paused = true)]
async fn a_message_that_could_not_be_dead_lettered_comes_back_and_goes_to_the_dlq_then() {
    let f = faulty_lane(&["5/s"]);
    enqueue(&f.lane, vec![job("a"), "{oops".into(), job("b")]).await;
    f.store.fail_next(Method::DeadLetter, 1, &transient());
    let report = f.orchestrator.run(&opts(true, Duration::from_secs(120))).await.unwrap();
    assert_eq!(offsets(&f.lane), vec![0, 200]);
    assert_eq!((report.dead_lettered, report.stop), (1, StopReason::Drained));
    assert!(f.lane.clock.now() >= T0.plus(Duration::from_secs(60)), "dead-lettered after its visibility timeout");
    assert_eq!(f.lane.store.dead_letters().unwrap().len(), 1);
}

#[tokio::test(start_paused = true)]
async fn a_failed_depth_read_is_asked_again_before_a_draining_run_ends() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(2)).await;
    f.store.fail_next(Method::Depth, 1, &throttled());
    let report = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!((report.stop, report.dispatched), (StopReason::Drained, 2));
    assert_eq!(f.store.calls(Method::Depth), 2);
}

#[tokio::test(start_paused = true)]
async fn a_release_that_fails_at_the_end_is_the_run_s_error_and_the_messages_come_back() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(10)).await;
    f.store.fail_next(Method::Release, 1, &transient());
    let (stop, stop_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        stop.send(true).unwrap();
        std::future::pending::<()>().await; // keep the channel open
    });
    let err = f.orchestrator.run(&RunOptions { stop: Some(stop_rx), ..opts(false, Duration::from_secs(60)) }).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert_eq!(offsets(&f.lane), seconds(2));
    assert_eq!(visible(&f.lane).await, (0, 8), "the release failed: hidden until the visibility timeout");
    f.lane.clock.sleep_until(f.lane.clock.now().plus(Duration::from_secs(61))).await;
    assert_eq!(visible(&f.lane).await, (8, 0));
    assert_eq!(f.lane.store.lease().await.unwrap(), None, "the lease is given up all the same");
}

#[tokio::test(start_paused = true)]
async fn a_run_that_cannot_read_its_state_at_start_ends_at_once_and_gives_the_lease_up() {
    for method in [Method::LoadPacer, Method::LoadUsage, Method::Circuit, Method::CoolDown] {
        let f = faulty_lane(&["1/s", "100/day"]);
        enqueue(&f.lane, jobs(2)).await;
        f.store.fail_next(method, 1, &throttled());
        let err = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
        assert!(err.is_retryable(), "{method:?}: {err}");
        assert!(offsets(&f.lane).is_empty(), "{method:?}");
        assert_eq!(f.lane.store.lease().await.unwrap(), None, "{method:?}");
    }
}

#[tokio::test(start_paused = true)]
async fn a_throttled_lease_acquire_is_a_retryable_error_and_nothing_is_received() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(2)).await;
    f.store.fail_next(Method::AcquireLease, 1, &throttled());
    let err = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
    assert!(err.is_retryable());
    assert_eq!(f.store.calls(Method::Receive), 0);
}

/// The next run (a relay waiting on the lease) would wait for the lease to expire, 30 s,
/// after one passing fault of the release: it is tried again, 20 ms later.
#[tokio::test(start_paused = true)]
async fn a_release_that_fails_once_is_tried_again_and_the_lease_given_up() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(2)).await;
    f.store.fail_next(Method::ReleaseLease, 1, &transient());
    f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap();
    assert_eq!(f.store.calls(Method::ReleaseLease), 2);
    assert_eq!(f.lane.store.lease().await.unwrap(), None, "given up");
}

#[tokio::test(start_paused = true)]
async fn a_lease_that_could_not_be_given_up_is_the_run_s_error_and_runs_out_on_its_own() {
    let f = faulty_lane(&["1/s"]);
    enqueue(&f.lane, jobs(2)).await;
    // The release and its three tries again.
    f.store.fail_next(Method::ReleaseLease, 4, &transient());
    let err = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await.unwrap_err();
    assert!(err.is_retryable(), "{err}");
    assert_eq!(f.store.calls(Method::ReleaseLease), 4);
    assert_eq!(offsets(&f.lane), seconds(2));
    let held = f.lane.store.lease().await.unwrap().expect("the lease is still held");
    let kept_out = f.orchestrator.run(&opts(true, Duration::from_secs(60))).await;
    assert!(matches!(kept_out, Err(RunError::LeaseHeld(_))), "not even its own holder re-takes an unexpired lease: {kept_out:?}");
    f.lane.clock.sleep_until(held.expires_at).await;
    enqueue(&f.lane, jobs(1)).await;
    let next = f.orchestrator.run(&RunOptions { deadline: f.lane.clock.now().plus(Duration::from_secs(60)), ..opts(true, Duration::ZERO) }).await.unwrap();
    assert_eq!((next.stop, next.dispatched), (StopReason::Drained, 1), "once it ran out, the next run takes it");
}

//! The rules every adapter of a port must keep, written once as test suites and run
//! against each adapter: the embedded store, the simulator's and SQS/DynamoDB on the
//! moto server. The rules themselves are documented on the traits in `ports.rs`.
//!
//! Each suite takes an adapter that starts empty and a [`Clock`] that lets time pass
//! for it (paused tokio time, or the wall clock against a server).

use std::sync::Arc;
use std::time::Duration;

use crate::adaptive::ProviderReading;
use crate::breaker::Circuit;
use crate::dlq::DlqSource;
use crate::job::{DeadLetterCause, DeadLetterReason, WorkerPayload};
use crate::keys::StoreScope;
use crate::lane::LaneId;
use crate::order::{OrderMark, OrderState};
use crate::pacer::PacerState;
use crate::ports::{
    BatchClaim, BatchProgress, CallClaim, DeadLetterQueues, Invoker, JobQueue, LaneSignals, Lease, OutgoingMessage, PacerSnapshot, PortError, ScopedStores,
    StackDocuments, StateStore, VisibleAgain,
};
use crate::quota::Quota;
use crate::time::{Clock, UnixMillis};

/// A job message for the suites.
#[must_use]
pub fn message(id: &str, attempt: u32) -> OutgoingMessage {
    OutgoingMessage::again(format!(r#"{{"id":"{id}","request":{{"method":"GET","path":"/items/{id}"}}}}"#), attempt, Duration::ZERO)
}

async fn pass(clock: &dyn Clock, d: Duration) {
    clock.sleep_until(clock.now().plus(d)).await;
}

fn ids(messages: &[crate::ports::QueuedMessage]) -> Vec<String> {
    let mut ids: Vec<String> =
        messages.iter().map(|m| serde_json::from_str::<serde_json::Value>(&m.body).unwrap()["id"].as_str().unwrap().to_owned()).collect();
    ids.sort();
    ids
}

/// The [`JobQueue`] rules: attempts carried, received messages hidden until deleted,
/// released or their visibility timeout passes, unknown receipts ignored, `max` kept,
/// dead letters counted with their reason.
///
/// # Panics
/// On the first rule the adapter breaks, naming it.
pub async fn job_queue(queue: &dyn JobQueue, clock: &dyn Clock) {
    let visibility = Duration::from_secs(2);
    queue.send(&[message("a", 0), message("b", 3), message("c", 0)]).await.unwrap();
    let mut got = queue.receive(2, Duration::ZERO, visibility).await.unwrap();
    assert!(!got.is_empty() && got.len() <= 2, "receive returns at most `max`: {} messages for max 2", got.len());
    while got.len() < 3 {
        let more = queue.receive(10, Duration::from_secs(1), visibility).await.unwrap();
        assert!(!more.is_empty(), "the rest comes on the next receive");
        got.extend(more);
    }
    assert_eq!(ids(&got), ["a", "b", "c"]);
    let b = got.iter().find(|m| m.body.contains(r#""b""#)).unwrap();
    assert_eq!(b.attempt, 3, "a message's attempt count is carried");
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible), (0, 3), "received messages are hidden");
    assert!(queue.receive(10, Duration::ZERO, visibility).await.unwrap().is_empty(), "a hidden message is not received again");

    let receipts = |id: &str| vec![got.iter().find(|m| m.body.contains(&format!(r#""{id}""#))).unwrap().receipt.clone()];
    queue.delete(&receipts("a")).await.unwrap();
    queue.release(&VisibleAgain::all(receipts("b"), Duration::ZERO)).await.unwrap();
    queue.delete(&["not-a-receipt".to_owned()]).await.expect("an unknown receipt is ignored");
    let again = queue.receive(10, Duration::from_secs(1), visibility).await.unwrap();
    assert_eq!(ids(&again), ["b"], "a released message is visible at once; a deleted one is gone");
    let hidden = vec![again[0].receipt.clone()];
    queue.release(&VisibleAgain::all(hidden.clone(), Duration::from_secs(60))).await.unwrap();
    assert!(queue.receive(10, Duration::ZERO, visibility).await.unwrap().is_empty(), "a message released for later is hidden until then");
    queue.release(&VisibleAgain::all(hidden.clone(), Duration::ZERO)).await.unwrap();
    let recalled = queue.receive(10, Duration::from_secs(1), visibility).await.unwrap();
    assert_eq!(ids(&recalled), ["b"], "its receipt brings it back sooner, until it is received again");

    pass(clock, visibility + Duration::from_millis(1_500)).await;
    let back = queue.receive(10, Duration::from_secs(1), visibility).await.unwrap();
    assert_eq!(ids(&back), ["b", "c"], "a message neither deleted nor released comes back after its visibility timeout");
    let c = back.iter().find(|m| m.body.contains(r#""c""#)).unwrap();
    let b = back.iter().find(|m| m.body.contains(r#""b""#)).unwrap();
    let each_its_own =
        [VisibleAgain { receipt: b.receipt.clone(), after: Duration::ZERO }, VisibleAgain { receipt: c.receipt.clone(), after: Duration::from_secs(60) }];
    queue.release(&each_its_own).await.unwrap();
    let b_again = queue.receive(10, Duration::from_secs(1), visibility).await.unwrap();
    assert_eq!(ids(&b_again), ["b"], "one release keeps each message's own time: b now, c in a minute");
    let receipts = vec![b_again[0].receipt.clone(), c.receipt.clone()];

    let reason = DeadLetterReason { cause: DeadLetterCause::Rejected { status: 404 }, detail: "HTTP 404 from /items/c".into(), outcome: None };
    queue.dead_letter(&c.message_id, &c.body, 2, &reason).await.unwrap();
    queue.delete(&receipts).await.unwrap();
    let depth = queue.depth().await.unwrap();
    assert_eq!((depth.visible, depth.not_visible, depth.dead), (0, 0, 1), "a dead letter is counted in the DLQ and nowhere else");
}

/// The [`DeadLetterQueues`] rules: a dead letter is read with its job, attempt and
/// reason; removed for good; redriven onto the jobs queue (attempts reset) and then gone
/// from the DLQ.
///
/// # Panics
/// On the first rule the adapter breaks, naming it.
pub async fn dead_letter_queues(dlq: &dyn DeadLetterQueues) {
    let reason = |status| DeadLetterReason { cause: DeadLetterCause::Rejected { status }, detail: format!("HTTP {status}"), outcome: None };
    for (id, status) in [("a", 404), ("b", 410), ("c", 422)] {
        let body = message(id, 0).body;
        dlq.dead_letter(&format!("m-{id}"), &body, 4, &reason(status)).await.unwrap();
    }
    assert_eq!(dlq.count(DlqSource::Jobs).await.unwrap(), 3);
    let mut page = dlq.page(DlqSource::Jobs, None, 10, Duration::from_secs(30)).await.unwrap();
    while page.len() < 3 {
        let after = page.last().map(|r| r.handle.clone());
        let more = dlq.page(DlqSource::Jobs, after.as_deref(), 10, Duration::from_secs(30)).await.unwrap();
        assert!(!more.is_empty(), "every dead letter is read");
        page.extend(more);
    }
    page.sort_by(|x, y| x.job_id.cmp(&y.job_id));
    let first = &page[0];
    assert_eq!((first.job_id.as_deref(), first.attempt, first.cause.as_str()), (Some("a"), 4, "http_404"), "a dead letter keeps its job, attempt and reason");
    assert!(first.job_body.as_deref().is_some_and(|body| body.contains(r#""a""#)));

    dlq.remove(DlqSource::Jobs, std::slice::from_ref(&page[0].handle)).await.unwrap();
    dlq.redrive(&page[1..], false).await.unwrap();
    assert_eq!(dlq.count(DlqSource::Jobs).await.unwrap(), 0, "removed and redriven records leave the DLQ");
    let requeued = dlq.receive(10, Duration::from_secs(1), Duration::from_secs(30)).await.unwrap();
    assert_eq!(ids(&requeued), ["b", "c"], "a redrive puts the jobs back on the jobs queue");
    assert!(requeued.iter().all(|m| m.attempt == 0), "a redrive resets attempts unless asked to keep them");
}

/// The [`StateStore`] rules:
/// - the lease: an unexpired lease is never re-taken, by its own holder neither; an
///   expired or released one is, with an epoch higher than any before; its holder may
///   renew it after it expired as long as no one took it; a lost or released lease is
///   neither renewed nor given up by its old holder;
/// - the pacer snapshot is saved only under the current lease;
/// - usage adds are atomic, negative deltas included;
/// - the circuit is swapped only from the epoch the writer saw;
/// - a cool-down is only ever extended, until cleared.
///
/// # Panics
/// On the first rule the adapter breaks, naming it.
pub async fn state_store(store: Arc<dyn StateStore>, quota: &Quota) {
    let ttl = Duration::from_secs(30);
    let t0 = UnixMillis(1_795_824_000_000);
    let at = |s: u64| t0.plus(Duration::from_secs(s));

    // Lease.
    assert_eq!(store.lease().await.unwrap(), None, "no lease at first");
    let a = store.acquire_lease("a", ttl, at(0)).await.unwrap();
    match store.acquire_lease("b", ttl, at(10)).await {
        Err(PortError::Conflict(why)) => assert!(why.contains('a'), "the conflict names the holder: {why}"),
        other => panic!("an unexpired lease is not taken by another: {other:?}"),
    }
    assert!(matches!(store.acquire_lease("a", ttl, at(10)).await, Err(PortError::Conflict(_))), "an unexpired lease is not re-taken by its own holder");
    let a = store.renew_lease(&a, ttl, at(20)).await.expect("the holder renews its lease");
    assert_eq!(a.expires_at, at(50));
    let a = store.renew_lease(&a, ttl, at(55)).await.expect("an expired lease no one took is renewed by its holder");
    let b = store.acquire_lease("b", ttl, at(90)).await.expect("an expired lease is taken");
    assert!(b.epoch > a.epoch, "every acquire raises the fencing epoch: {} after {}", b.epoch, a.epoch);
    assert!(matches!(store.renew_lease(&a, ttl, at(91)).await, Err(PortError::Conflict(_))), "a lost lease is not renewed");
    let snapshot = PacerSnapshot { state: PacerState::new(quota), at_exit: false, effective_rate: None, saved_at: None };
    assert!(matches!(store.save_pacer(&a, &snapshot).await, Err(PortError::Conflict(_))), "a stale holder's snapshot is refused");
    store.release_lease(&a).await.expect("giving up a lost lease is a no-op");
    assert_eq!(store.lease().await.unwrap().map(|l| l.holder), Some("b".into()), "a stale holder cannot give up the current lease");
    store.save_pacer(&b, &snapshot).await.expect("the holder saves its snapshot");
    assert_eq!(store.load_pacer().await.unwrap(), Some(snapshot));
    store.release_lease(&b).await.unwrap();
    assert_eq!(store.lease().await.unwrap(), None, "a released lease is no one's");
    assert!(matches!(store.renew_lease(&b, ttl, at(92)).await, Err(PortError::Conflict(_))), "a released lease is not renewed");
    let c = store.acquire_lease("c", ttl, at(93)).await.expect("a released lease is taken at once");
    assert!(c.epoch > b.epoch, "the epoch never repeats, releases included");

    // Usage.
    let keys = ["day:2026-11-28".to_owned(), "month:2026-11".to_owned()];
    assert_eq!(store.load_usage(&keys).await.unwrap(), [0, 0], "unknown keys count 0");
    let adds = (0..8).map(|_| {
        let store = store.clone();
        let keys = keys.clone();
        async move { store.add_usage(&[(keys[0].clone(), 2), (keys[1].clone(), 1)]).await }
    });
    for result in join_all(adds.collect()).await {
        result.unwrap();
    }
    store.add_usage(&[(keys[0].clone(), -5)]).await.unwrap();
    assert_eq!(store.load_usage(&keys).await.unwrap(), [11, 8], "concurrent adds all count; a negative delta gives units back");

    // Circuit.
    let closed = store.circuit().await.unwrap();
    assert_eq!((closed.is_closed(), closed.epoch), (true, 0), "the circuit starts closed at epoch 0");
    let open = closed.open(0, "HTTP 503", at(100)).unwrap();
    store.swap_circuit(0, &open).await.unwrap();
    let stale = Circuit::default().open(0, "HTTP 500", at(101)).unwrap();
    assert!(matches!(store.swap_circuit(0, &stale).await, Err(PortError::Conflict(_))), "a swap from a stale epoch is refused");
    assert_eq!(store.circuit().await.unwrap(), open);
    let half_open = open.half_open(open.epoch, "health check ok", at(102)).unwrap();
    store.swap_circuit(open.epoch, &half_open).await.unwrap();
    let reopened = half_open.open(half_open.epoch, "HTTP 503", at(103)).unwrap();
    store.swap_circuit(half_open.epoch, &reopened).await.unwrap();
    assert_eq!(store.circuit().await.unwrap(), reopened, "half-open, re-openings and reasons are kept");
    let held = reopened.hold(reopened.epoch, "operator: maintenance", at(104)).unwrap();
    store.swap_circuit(reopened.epoch, &held).await.unwrap();
    assert!(store.circuit().await.unwrap().held, "an operator's hold is kept");

    // Cool-down.
    assert_eq!(store.cool_down().await.unwrap(), UnixMillis(0));
    store.extend_cool_down(at(200)).await.unwrap();
    store.extend_cool_down(at(150)).await.unwrap();
    assert_eq!(store.cool_down().await.unwrap(), at(200), "a cool-down is never shortened");

    // The provider's rate-limit reading: only a later call's replaces it.
    assert_eq!(store.provider_reading().await.unwrap(), None);
    let reading = ProviderReading { limit: 100, remaining: 40, window_ms: Some(1_000), resets_at: at(1_200), at: at(210) };
    store.record_provider_reading(&reading).await.unwrap();
    store.record_provider_reading(&ProviderReading { remaining: 90, window_ms: None, at: at(205), ..reading }).await.unwrap();
    assert_eq!(store.provider_reading().await.unwrap(), Some(reading), "an older reading does not replace a later one");
    let later = ProviderReading { remaining: 10, window_ms: None, at: at(220), ..reading };
    store.record_provider_reading(&later).await.unwrap();
    let signals = LaneSignals { circuit: held, cool_down: at(200), provider_reading: Some(later) };
    assert_eq!(store.shared_state().await.unwrap(), signals, "circuit, cool-down and reading read together");

    // Call records: one claim per attempt; a crashed claimant's claim expires.
    let key = crate::ports::call_record_key("job-1", 0);
    assert_eq!(store.claim_call(&key, "a", at(400), at(410)).await.unwrap(), CallClaim::Taken);
    assert_eq!(store.claim_call(&key, "b", at(405), at(415)).await.unwrap(), CallClaim::Calling, "a repeated delivery finds it calling");
    assert_eq!(store.claim_call(&key, "b", at(410), at(420)).await.unwrap(), CallClaim::Taken, "an expired claim is taken over");
    store.release_call(&key, "a").await.unwrap();
    assert_eq!(store.claim_call(&key, "c", at(411), at(421)).await.unwrap(), CallClaim::Calling, "only the holder releases");
    store.release_call(&key, "b").await.unwrap();
    assert_eq!(store.claim_call(&key, "c", at(412), at(422)).await.unwrap(), CallClaim::Taken, "a released claim is free");
    store.finish_call(&key, at(100_000)).await.unwrap();
    store.release_call(&key, "c").await.unwrap();
    assert_eq!(store.claim_call(&key, "d", at(50_000), at(50_010)).await.unwrap(), CallClaim::Done, "a done call is never claimed again");
    let next = crate::ports::call_record_key("job-1", 1);
    assert_eq!(store.claim_call(&next, "d", at(50_000), at(50_010)).await.unwrap(), CallClaim::Taken, "the next attempt is its own");
    crate::ports::forget_calls(store.as_ref(), "job-1", 1).await.unwrap();
    assert_eq!(store.claim_call(&key, "e", at(50_001), at(50_011)).await.unwrap(), CallClaim::Taken, "a redriven job calls again");
    assert_eq!(store.claim_call(&key, "e", at(50_002), at(50_012)).await.unwrap(), CallClaim::ClaimedBefore, "the holder's own earlier claim");

    // Worker batches: one delivery at a time; a stopped one's progress is the next one's.
    let batch = crate::ports::batch_record_key("run-1#1");
    let taken = |before| BatchClaim::Taken { before };
    assert_eq!(store.claim_batch(&batch, "d1", at(600), at(700)).await.unwrap(), taken(None));
    assert_eq!(store.claim_batch(&batch, "d2", at(650), at(750)).await.unwrap(), BatchClaim::Running, "a delivery runs it");
    let partway = BatchProgress { settled: [0, 2, 5, 1_001].into_iter().collect(), done: false };
    store.save_batch(&batch, "d1", &partway, at(700)).await.unwrap();
    assert!(matches!(store.save_batch(&batch, "d2", &partway, at(700)).await, Err(PortError::Conflict(_))), "only the holder saves");
    assert_eq!(store.claim_batch(&batch, "d2", at(700), at(800)).await.unwrap(), taken(Some(partway.clone())), "taken over with its progress");
    assert!(matches!(store.save_batch(&batch, "d1", &partway, at(800)).await, Err(PortError::Conflict(_))), "the stopped delivery saves no more");
    store.save_batch(&batch, "d2", &BatchProgress { done: true, ..partway }, at(100_000)).await.unwrap();
    assert_eq!(store.claim_batch(&batch, "d3", at(900), at(1_000)).await.unwrap(), BatchClaim::Done, "a done batch is never run again");

    // Call slots (`quota.max_in_flight`).
    let (now, until) = (at(300), at(310));
    let first = store.take_call_slot(2, "a", now, until).await.unwrap().expect("a free slot");
    let second = store.take_call_slot(2, "b", now, until).await.unwrap().expect("the other slot");
    assert_ne!(first, second);
    assert_eq!(store.take_call_slot(2, "c", now, until).await.unwrap(), None, "both slots are held");
    assert_eq!(store.call_slots_in_use(2, now).await.unwrap(), 2);
    store.release_call_slot(first, "a").await.unwrap();
    assert_eq!(store.call_slots_in_use(2, now).await.unwrap(), 1);
    assert_eq!(store.take_call_slot(2, "c", now, until).await.unwrap(), Some(first), "a released slot is free");
    // At `until` the holders' slots free themselves (a crashed worker's too).
    assert_eq!(store.call_slots_in_use(2, until).await.unwrap(), 0);
    let late = store.take_call_slot(2, "d", until, at(400)).await.unwrap().expect("an expired slot is free");
    let holder = if late == first { "c" } else { "b" };
    store.release_call_slot(late, holder).await.unwrap();
    assert_eq!(store.call_slots_in_use(2, until).await.unwrap(), 1, "a holder whose slot expired and was taken cannot give it back");
    store.clear_cool_down().await.unwrap();
    assert_eq!(store.cool_down().await.unwrap(), UnixMillis(0), "a cleared cool-down is over");
    assert_eq!(store.provider_reading().await.unwrap(), None, "a clear forgets the provider's reading too");

    // An ordered lane's mark.
    assert_eq!(store.order_mark().await.unwrap(), None, "no mark before the first ordered job");
    store.open_order(&OrderMark::open("job-1", 0, at(500))).await.unwrap();
    assert!(!store.settle_order("job-1", 1, OrderState::Settled { at: at(501) }).await.unwrap(), "another attempt's settlement changes nothing");
    assert!(!store.settle_order("job-0", 0, OrderState::Settled { at: at(501) }).await.unwrap(), "another job's settlement changes nothing");
    assert_eq!(store.order_mark().await.unwrap(), Some(OrderMark::open("job-1", 0, at(500))));
    assert!(store.settle_order("job-1", 0, OrderState::Retrying { at: at(502) }).await.unwrap());
    let retrying = OrderMark { job_id: "job-1".into(), attempt: 0, state: OrderState::Retrying { at: at(502) } };
    assert_eq!(store.order_mark().await.unwrap(), Some(retrying), "the mark says the job comes back, and when");
    store.open_order(&OrderMark::open("job-1", 1, at(503))).await.unwrap();
    assert!(store.settle_order("job-1", 1, OrderState::Settled { at: at(504) }).await.unwrap());
    assert!(!store.settle_order("job-1", 0, OrderState::Retrying { at: at(504) }).await.unwrap(), "a late repeat of an earlier attempt changes nothing");
    assert_eq!(store.order_mark().await.unwrap().map(|mark| mark.state), Some(OrderState::Settled { at: at(504) }));
}

/// Polls borrowing futures together on this task (they cannot be spawned) and
/// collects their outputs in order.
async fn join_all<F: std::future::Future>(futures: Vec<F>) -> Vec<F::Output> {
    let mut futures: Vec<std::pin::Pin<Box<F>>> = futures.into_iter().map(Box::pin).collect();
    let mut outputs: Vec<Option<F::Output>> = futures.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        let mut pending = false;
        for (future, output) in futures.iter_mut().zip(outputs.iter_mut()) {
            if output.is_none() {
                match future.as_mut().poll(cx) {
                    std::task::Poll::Ready(value) => *output = Some(value),
                    std::task::Poll::Pending => pending = true,
                }
            }
        }
        if pending {
            std::task::Poll::Pending
        } else {
            std::task::Poll::Ready(())
        }
    })
    .await;
    outputs.into_iter().map(|o| o.expect("every future finished")).collect()
}

/// The [`Invoker`] rules: an accepted payload is handed off as sent, once; `settle`
/// waits until the adapter's worker has run what was handed off and returns what it
/// ran.
///
/// # Panics
/// On the first rule the adapter breaks, naming it.
pub async fn invoker<S, Fut>(invoker: &dyn Invoker, settle: S)
where
    S: Fn() -> Fut,
    Fut: std::future::Future<Output = Vec<WorkerPayload>>,
{
    let health = WorkerPayload::HealthCheck { circuit_epoch: 7, sent_at: UnixMillis(1_795_824_000_000), slot: None, lane: Default::default() };
    invoker.invoke(&health, None).await.expect("a health check is handed off");
    let ran = settle().await;
    assert_eq!(ran, vec![health], "an accepted payload reaches the worker once, as sent");
}

/// The stack-wide counters a stack's shards reserve the shared quota's day and month
/// units from ([`StackDocuments::reserve_shared`]): a reservation gets what it asks while
/// the limit allows, what is left once it does not, and nothing at the limit, also when
/// reservations race; units given back can be reserved again. `stack`, where the adapter
/// has one, is the stack's scope of the same store: shard 0's counters are these.
///
/// # Panics
/// On the first rule the adapter breaks, naming it.
pub async fn shared_counters(documents: Arc<dyn StackDocuments>, stack: Option<Arc<dyn StateStore>>) {
    let (day, month) = ("usage#100/day#0".to_owned(), "usage#5/month#0".to_owned());
    assert_eq!(documents.shared_counts(&[day.clone(), month.clone()]).await.unwrap(), vec![0, 0], "counters start at 0");
    let reserve = |key: &str, wanted: u64, limit: u64| {
        let (documents, key) = (documents.clone(), key.to_owned());
        async move {
            let reserved = documents.reserve_shared(&key, wanted, limit).await.unwrap();
            (reserved.units, reserved.count)
        }
    };
    assert_eq!(reserve(&day, 30, 100).await, (30, 30));
    assert_eq!(reserve(&day, 60, 100).await, (60, 90));
    assert_eq!(reserve(&day, 30, 100).await, (10, 100), "what is left, once the limit does not allow all");
    assert_eq!(reserve(&day, 1, 100).await, (0, 100), "nothing at the limit");
    assert_eq!(reserve(&month, 9, 5).await, (5, 5), "never more than the limit");
    documents.return_shared(&day, 25).await.unwrap();
    assert_eq!(documents.shared_counts(std::slice::from_ref(&day)).await.unwrap(), vec![75]);

    let mut racing = tokio::task::JoinSet::new();
    for _ in 0..8 {
        let (documents, day) = (documents.clone(), day.clone());
        racing.spawn(async move { documents.reserve_shared(&day, 10, 100).await.unwrap().units });
    }
    let granted: u64 = racing.join_all().await.into_iter().sum();
    assert_eq!(granted, 25, "racing reservations share what was left, no more");
    assert_eq!(documents.shared_counts(std::slice::from_ref(&day)).await.unwrap(), vec![100]);
    assert_eq!(reserve(&day, 0, 100).await, (0, 100), "asking nothing still says the count");
    if let Some(stack) = stack {
        assert_eq!(stack.load_usage(std::slice::from_ref(&day)).await.unwrap(), vec![100], "shard 0's counter in the stack's scope is the same");
    }
}

/// Many lanes' pacer snapshots saved together (250: more than one request holds) are
/// each its own lane's, read alone or together, and none is saved without the lease.
///
/// # Panics
/// When the stores break the contract.
pub async fn pacers_saved_together(stores: &dyn ScopedStores, now: UnixMillis) {
    let quota = Quota::new(vec!["5/s".parse().unwrap()], crate::quota::chrono_tz::UTC, Duration::ZERO).unwrap();
    let stack = stores.scoped(&StoreScope::Stack);
    let lease = stack.acquire_lease("saver", Duration::from_secs(30), now).await.unwrap();
    let snapshots: Vec<(StoreScope, PacerSnapshot)> = (0..250_u64)
        .map(|n| {
            let snapshot =
                PacerSnapshot { state: PacerState::new(&quota), at_exit: true, effective_rate: None, saved_at: Some(now.plus(Duration::from_millis(n))) };
            (StoreScope::Lane(LaneId::parse(&format!("tenant{n}")).unwrap()), snapshot)
        })
        .collect();
    let stale = Lease { epoch: lease.epoch + 1, ..lease.clone() };
    assert!(matches!(stores.save_pacers(&stale, &snapshots).await, Err(PortError::Conflict(_))), "saved without the lease");
    assert_eq!(stores.scoped(&snapshots[0].0).load_pacer().await.unwrap(), None, "nothing saved without the lease");
    stores.save_pacers(&lease, &snapshots).await.unwrap();
    for (scope, snapshot) in &snapshots {
        assert_eq!(stores.scoped(scope).load_pacer().await.unwrap().as_ref(), Some(snapshot), "{scope:?}");
    }
    // Read together the first time (more than one request holds them), and one lane
    // never saved.
    let lanes: Vec<LaneId> = (0..=250_u64).map(|n| LaneId::parse(&format!("tenant{n}")).unwrap()).collect();
    let reads = stores.lanes_first_reads(&lanes).await.unwrap();
    assert_eq!(reads.len(), lanes.len());
    for ((scope, snapshot), read) in snapshots.iter().zip(&reads) {
        assert_eq!(read.pacer, Ok(Some(snapshot.clone())), "{scope:?} read with the others");
    }
    assert_eq!(reads[250].pacer, Ok(None), "a lane never saved has no snapshot");
    stack.release_lease(&lease).await.unwrap();
}

/// Lanes keep apart: each lane's circuit, cool-down, counters, call records, call
/// slots and operator's change are its own, many lanes read together are each read as
/// alone, and the stack lists the lanes an operator changed. `stores` are a fresh
/// store's scopes; `now` is its clock's.
///
/// # Panics
/// On the first rule the adapter breaks, naming it.
pub async fn lanes_apart(stores: &dyn ScopedStores, now: UnixMillis) {
    use crate::config::LaneChange;
    let lane = |id: &str| stores.scoped(&StoreScope::Lane(LaneId::parse(id).unwrap()));
    let (default, acme, acme_b, gold) = (lane("default"), lane("acme"), lane("acme_b"), lane("gold:eu"));
    let later = now.plus(Duration::from_secs(30));
    let open = Circuit::default().open(0, "HTTP 503", now).unwrap();
    acme.swap_circuit(0, &open).await.unwrap();
    acme.extend_cool_down(now.plus(Duration::from_secs(5))).await.unwrap();
    acme.add_usage(&[("failures#1000#1".to_owned(), 3)]).await.unwrap();
    assert_eq!(acme.claim_call("call#j1#1", "w1", now, later).await.unwrap(), CallClaim::Taken);
    assert_eq!(acme.take_call_slot(1, "w1", now, later).await.unwrap(), Some(0));
    for other in [&default, &acme_b] {
        assert!(other.circuit().await.unwrap().is_closed(), "another lane sees acme's circuit");
        assert_eq!(other.shared_state().await.unwrap().cool_down, UnixMillis(0), "another lane sees acme's cool-down");
        assert_eq!(other.load_usage(&["failures#1000#1".to_owned()]).await.unwrap(), vec![0], "another lane sees acme's counters");
        assert_eq!(other.claim_call("call#j1#1", "w2", now, later).await.unwrap(), CallClaim::Taken, "a call record of its own");
        assert_eq!(other.take_call_slot(1, "w2", now, later).await.unwrap(), Some(0), "a call slot of its own");
    }
    assert_eq!(acme.call_slots_in_use(1, now).await.unwrap(), 1);
    assert!(!acme.shared_state().await.unwrap().circuit.is_closed(), "acme's own circuit, read with its signals");

    let change = LaneChange { weight: Some(3.0), tiers: Some(vec!["2/s".parse().unwrap()]), max_in_flight: None };
    gold.set_lane_change(Some(&change)).await.unwrap();
    assert_eq!(gold.lane_change().await.unwrap(), Some(change.clone()));
    assert_eq!(acme.lane_change().await.unwrap(), None, "gold's change is gold's alone");
    let ids: Vec<LaneId> = ["acme", "default", "gold:eu"].iter().map(|id| LaneId::parse(id).unwrap()).collect();
    let together = stores.lanes_signals(&ids).await.unwrap();
    let alone = [(acme.shared_state().await.unwrap(), None), (default.shared_state().await.unwrap(), None), (gold.shared_state().await.unwrap(), Some(change))];
    let first_reads = stores.lanes_first_reads(&ids).await.unwrap();
    assert_eq!(together, alone, "many lanes read together are each read as alone");
    for (first, (signals, change)) in first_reads.iter().zip(&alone) {
        assert_eq!((&first.pacer, &first.signals, &first.change), (&Ok(None), signals, change), "a lane's first read, with the others, is as alone");
    }
    let listed: Vec<String> = stores.scoped(&StoreScope::Stack).lanes_with_state().await.unwrap().iter().map(ToString::to_string).collect();
    assert!(listed.contains(&"gold:eu".to_owned()), "a changed lane is listed: {listed:?}");
    gold.set_lane_change(None).await.unwrap();
    assert_eq!(gold.lane_change().await.unwrap(), None, "forgotten: the config's settings again");
}

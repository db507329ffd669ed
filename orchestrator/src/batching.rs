//! Hands jobs to Lambda workers in batches: an invoker over another that gathers the
//! jobs handed off ahead of their slots into one payload, sent when its first job must
//! go (its slot less the hand-off's lead), or at once when it is full (`worker_batch`
//! jobs, or the async invoke's payload limit). Where the pace is more than one worker
//! should call at (`worker_pace`), several batches gather at once, in stripes: each job
//! goes to the next, so each worker calls at its share of the pace; where the pace moves
//! (a shard's share of the shared quota, or the lanes in hand going slower than it at
//! their own paces), so does the number of stripes in use. Each job's hand-off is
//! answered when its batch's invoke is: the drain loop above sees one hand-off per job,
//! as without batches, and deletes each job's message once Lambda took its batch.
//!
//! Nothing waits for a batch to fill: a slow lane's job goes at the time it would have
//! gone alone, in a batch of one (sent as a plain job payload). A batch Lambda refuses as
//! too large is split in two and each half sent, down to single jobs, whose refusal is
//! then the job's own (the loop dead-letters it).

use std::hash::{BuildHasher as _, Hasher as _};
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use paceline_shared::job::WorkerPayload;
use paceline_shared::ports::{Invoker, PortError, PortResult};
use paceline_shared::time::{Clock, UnixMillis};
use tokio::sync::oneshot;

/// Lambda's limit on an asynchronous invoke's payload, less room for the batch's own
/// fields.
pub const MAX_BATCH_BYTES: usize = 1_000_000;

/// Hand-offs the drain loop may have awaiting their answer beside a batch's jobs.
const UNBATCHED_PIPELINE: usize = 256;

/// Jobs gathered for one invoke.
struct OpenBatch {
    number: u64,
    /// When it goes at the latest.
    send_by: UnixMillis,
    calls: Vec<WorkerPayload>,
    bytes: usize,
    answers: Vec<oneshot::Sender<PortResult<()>>>,
}

/// An [`Invoker`] that sends jobs handed off ahead of their slots in batches.
pub struct BatchingInvoker(Arc<Batcher>);

/// What the invoker and its batches' timers share.
struct Batcher {
    inner: Arc<dyn Invoker>,
    clock: Arc<dyn Clock>,
    /// A batch goes this long before its first job's slot, and this many milliseconds
    /// more while workers started late lately ([`Invoker::lead_changed`]).
    lead: Duration,
    late_start_ms: AtomicU64,
    max_calls: usize,
    max_bytes: usize,
    /// Names the batches: `{prefix}#{number}`, the prefix telling this invoker's from
    /// any other's (the time it was built and a random number: the shards of a stack
    /// build theirs in one cold start, and other runs' may be built in the same
    /// millisecond; the worker skips a batch id it saw settle).
    prefix: String,
    numbers: AtomicU64,
    /// The batches gathering, one a stripe: jobs go to them in turn, so that no worker
    /// is given more than its share of the pace. As many stripes as the most the pace
    /// may need; the first `in_use` take jobs.
    open: Mutex<Vec<Option<OpenBatch>>>,
    in_use: AtomicUsize,
    next_stripe: AtomicU64,
    /// The most calls a second a worker is given: the stripes in use follow the pace by
    /// it (`None`: they stay as built).
    worker_pace: Option<f64>,
}

impl BatchingInvoker {
    /// Batches of at most `max_calls` jobs over `inner`, each sent `lead` before its
    /// first job's slot, `stripes` of them gathering at once (each job to the next).
    #[must_use]
    pub fn new(inner: Arc<dyn Invoker>, clock: Arc<dyn Clock>, lead: Duration, max_calls: u32, stripes: usize) -> Self {
        let random = std::collections::hash_map::RandomState::new().build_hasher().finish();
        let prefix = format!("batch-{}-{random:016x}", clock.now().0);
        Self(Arc::new(Batcher {
            inner,
            clock,
            lead,
            late_start_ms: AtomicU64::new(0),
            max_calls: usize::try_from(max_calls).unwrap_or(usize::MAX).max(1),
            max_bytes: MAX_BATCH_BYTES,
            prefix,
            numbers: AtomicU64::new(0),
            open: Mutex::new((0..stripes.max(1)).map(|_| None).collect()),
            in_use: AtomicUsize::new(stripes.max(1)),
            next_stripe: AtomicU64::new(0),
            worker_pace: None,
        }))
    }

    /// Batches over `inner` as `settings` say: sent the hand-off's lead before their first
    /// slot, of at most `worker_batch` jobs, in as many stripes as the pace needs workers
    /// (for a shard whose share moves, as many as its share needs as it moves: see
    /// [`Invoker::pace_changed`]).
    #[must_use]
    pub fn for_settings(inner: Arc<dyn Invoker>, clock: Arc<dyn Clock>, settings: &crate::Settings) -> Self {
        let invoker = Self::new(inner, clock, settings.hand_off_lead(), settings.worker_batch(), settings.most_worker_stripes());
        if settings.most_worker_stripes() > 1 {
            invoker.following_pace(settings.orchestrator.worker_pace, settings.quota.sustained_per_second())
        } else {
            invoker
        }
    }

    /// The same invoker putting to use as many of its stripes as the pace needs at
    /// `worker_pace` calls a second a worker: as many as `pace` needs now, then as
    /// [`Invoker::pace_changed`] says.
    ///
    /// # Panics
    /// Once a batch was gathered (the invoker is shared then).
    #[must_use]
    pub fn following_pace(self, worker_pace: u32, pace: f64) -> Self {
        let mut batcher = Arc::into_inner(self.0).expect("set before use");
        batcher.worker_pace = Some(f64::from(worker_pace.max(1)));
        let invoker = Self(Arc::new(batcher));
        invoker.pace_changed(pace);
        invoker
    }

    /// The same invoker holding batches to `max_bytes` of payload.
    ///
    /// # Panics
    /// Once a batch was gathered (the invoker is shared then).
    #[must_use]
    pub fn with_max_bytes(self, max_bytes: usize) -> Self {
        let mut batcher = Arc::into_inner(self.0).expect("set before use");
        batcher.max_bytes = max_bytes;
        Self(Arc::new(batcher))
    }
}

impl Batcher {
    fn open(&self) -> MutexGuard<'_, Vec<Option<OpenBatch>>> {
        self.open.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// Adds `call` (due to go by `send_by`) to the open batch, opening one (and the timer
    /// that sends it) if none is. Returns the answer to wait for, and a batch to send now
    /// if adding it filled one.
    fn gather(self: &Arc<Self>, call: WorkerPayload, send_by: UnixMillis) -> (oneshot::Receiver<PortResult<()>>, Option<OpenBatch>) {
        let bytes = call.to_json().len();
        let (answer, answered) = oneshot::channel();
        let mut stripes = self.open();
        let in_use = self.in_use.load(Ordering::Relaxed).clamp(1, stripes.len());
        let stripe = usize::try_from(self.next_stripe.fetch_add(1, Ordering::Relaxed) % in_use as u64).unwrap_or(0);
        let open = &mut stripes[stripe];
        // A call that would take the batch over its payload limit starts the next one.
        let overflowing = open.as_ref().is_some_and(|batch| batch.bytes + bytes > self.max_bytes);
        let full_before = if overflowing { open.take() } else { None };
        let batch = open.get_or_insert_with(|| {
            let number = self.numbers.fetch_add(1, Ordering::Relaxed) + 1;
            OpenBatch { number, send_by: UnixMillis(u64::MAX), calls: Vec::new(), bytes: 0, answers: Vec::new() }
        });
        // The batch goes when its most pressing job must: a job handed off later may have
        // an earlier slot (its worker once started late, so it goes earlier).
        if send_by < batch.send_by {
            batch.send_by = send_by;
            self.arm(stripe, batch.number, send_by);
        }
        batch.calls.push(call);
        batch.bytes += bytes;
        batch.answers.push(answer);
        let full = batch.calls.len() >= self.max_calls || batch.bytes >= self.max_bytes;
        let send_now = if full { open.take() } else { None };
        drop(stripes);
        if let Some(earlier) = full_before {
            let this = self.clone();
            tokio::spawn(async move { this.send(earlier).await });
        }
        (answered, send_now)
    }

    /// Sends batch `number` of stripe `stripe` at `at`, unless it went before. A batch
    /// gathered by an invoker that is gone (its orchestrator was dropped mid-run, as a
    /// crash drops it) is not sent: its jobs' messages come back on the queue.
    fn arm(self: &Arc<Self>, stripe: usize, number: u64, at: UnixMillis) {
        let (weak, clock) = (Arc::downgrade(self), self.clock.clone());
        tokio::spawn(async move {
            clock.sleep_until(at).await;
            let Some(this) = weak.upgrade() else { return };
            let due = {
                let mut stripes = this.open();
                let open = &mut stripes[stripe];
                if open.as_ref().is_some_and(|batch| batch.number == number) {
                    open.take()
                } else {
                    None
                }
            };
            if let Some(batch) = due {
                this.send(batch).await;
            }
        });
    }

    /// Sends a batch and answers each of its jobs' hand-offs with the outcome.
    async fn send(&self, batch: OpenBatch) {
        let id = format!("{}#{}", self.prefix, batch.number);
        let mut parts = vec![(id, batch.calls, batch.answers)];
        while let Some((id, calls, answers)) = parts.pop() {
            let payload = if calls.len() == 1 { calls[0].clone() } else { WorkerPayload::batch(id.clone(), &calls) };
            match self.inner.invoke(&payload, None).await {
                Err(PortError::TooLarge(why)) if calls.len() > 1 => {
                    tracing::info!(batch = %id, calls = calls.len(), %why, "batch over the invoke's limit: sent in two halves");
                    let (mut calls, mut answers) = (calls, answers);
                    let (later_calls, later_answers) = (calls.split_off(calls.len() / 2), answers.split_off(answers.len() / 2));
                    parts.push((format!("{id}b"), later_calls, later_answers));
                    parts.push((format!("{id}a"), calls, answers));
                }
                result => {
                    for answer in answers {
                        // A hand-off no one waits for any more (the run ended) needs no answer.
                        let _ = answer.send(result.clone());
                    }
                }
            }
        }
    }
}

#[async_trait]
impl Invoker for BatchingInvoker {
    async fn invoke(&self, payload: &WorkerPayload, from_receipt: Option<&str>) -> PortResult<()> {
        let this = &self.0;
        let send_by = match payload {
            WorkerPayload::Job { slot: Some(slot), .. } => {
                slot.not_before.minus(this.lead).minus(Duration::from_millis(this.late_start_ms.load(Ordering::Relaxed)))
            }
            // At its slot already, or a health check: nothing to gather it with.
            _ => return this.inner.invoke(payload, from_receipt).await,
        };
        let (answered, send_now) = this.gather(payload.clone(), send_by.max(this.clock.now()));
        if let Some(batch) = send_now {
            this.send(batch).await;
        }
        answered.await.unwrap_or_else(|_| Err(PortError::Transient("the batch was not sent (the run ended)".into())))
    }

    async fn flush(&self) {
        let gathered: Vec<OpenBatch> = self.0.open().iter_mut().filter_map(Option::take).collect();
        for batch in gathered {
            self.0.send(batch).await;
        }
    }

    fn in_flight(&self) -> usize {
        self.0.inner.in_flight()
    }

    fn lead_changed(&self, extra: Duration) {
        self.0.late_start_ms.store(u64::try_from(extra.as_millis()).unwrap_or(u64::MAX), Ordering::Relaxed);
    }

    /// Puts as many stripes to use as `per_second` needs at `worker_pace` each (a batch
    /// gathering in a stripe put out of use still goes at its time).
    fn pace_changed(&self, per_second: f64) {
        let Some(worker_pace) = self.0.worker_pace else { return };
        if per_second.is_finite() && per_second > 0.0 {
            let stripes = self.0.open().len();
            let wanted = ((per_second / worker_pace).ceil() as usize).clamp(1, stripes);
            self.0.in_use.store(wanted, Ordering::Relaxed);
        }
    }

    fn pipeline(&self) -> usize {
        UNBATCHED_PIPELINE + 2 * self.0.max_calls * self.0.open().len()
    }
}

#[cfg(test)]
#[expect(clippy::disallowed_methods, reason = "paused-time tests move tokio's clock, the source of the TokioClock under test")]
mod tests {
    use paceline_shared::adapters::memory::RecordingInvoker;
    use paceline_shared::job::{CallSlot, Job};
    use paceline_shared::time::TokioClock;

    use super::*;

    const LEAD: Duration = Duration::from_millis(400);

    fn slotted(n: u64, not_before: UnixMillis) -> WorkerPayload {
        let job = Job::parse(&format!(r#"{{"id":"j-{n}","request":{{"method":"GET","path":"/{n}"}}}}"#)).unwrap();
        let slot = Some(CallSlot { not_before, call_by: not_before.plus(Duration::from_millis(5)) });
        WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot, trip: None, report_limits: false }
    }

    /// Hands `calls` off at once, each on its own task as the drain loop does; returns
    /// when every hand-off was answered, with the answers.
    async fn hand_off(invoker: &Arc<BatchingInvoker>, calls: Vec<WorkerPayload>) -> Vec<PortResult<()>> {
        let mut tasks = tokio::task::JoinSet::new();
        for (i, call) in calls.into_iter().enumerate() {
            let invoker = invoker.clone();
            tasks.spawn(async move { (i, invoker.invoke(&call, None).await) });
        }
        let mut answers: Vec<_> = tasks.join_all().await;
        answers.sort_by_key(|(i, _)| *i);
        answers.into_iter().map(|(_, answer)| answer).collect()
    }

    /// The jobs' ids of each payload sent, with when it was sent.
    fn sent(inner: &RecordingInvoker) -> Vec<(UnixMillis, Vec<String>)> {
        let ids = |payload: &WorkerPayload| {
            payload.batch_calls().into_iter().map(|call| match call.unwrap() {
                WorkerPayload::Job { job, .. } => job.id.to_string(),
                other => panic!("not a job: {other:?}"),
            })
        };
        inner.accepted().iter().map(|(at, payload)| (*at, ids(payload).collect())).collect()
    }

    /// A batching invoker of `max_calls` a batch in `stripes` over a recording one, on a
    /// paused clock, and the time it starts at.
    fn rig(max_calls: u32, stripes: usize) -> (Arc<TokioClock>, UnixMillis, Arc<RecordingInvoker>, Arc<BatchingInvoker>) {
        let clock = Arc::new(TokioClock::new());
        let inner = Arc::new(RecordingInvoker::new(clock.clone()));
        let invoker = Arc::new(BatchingInvoker::new(inner.clone(), clock.clone(), LEAD, max_calls, stripes));
        (clock.clone(), clock.now(), inner, invoker)
    }

    #[tokio::test(start_paused = true)]
    async fn jobs_handed_off_ahead_go_in_one_batch_sent_when_its_first_job_must_go() {
        let (clock, t0, inner, invoker) = rig(100, 1);
        let calls = vec![
            slotted(1, t0.plus(Duration::from_millis(1_000))),
            slotted(2, t0.plus(Duration::from_millis(1_100))),
            slotted(3, t0.plus(Duration::from_millis(1_900))),
        ];
        let answers = hand_off(&invoker, calls).await;
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        assert_eq!(sent(&inner), vec![(t0.plus(Duration::from_millis(600)), vec!["j-1".into(), "j-2".into(), "j-3".into()])]);
        assert!(matches!(inner.accepted()[0].1, WorkerPayload::Batch { .. }));

        // Alone, a job goes as a plain job payload at its own time: nothing waits to fill.
        let t1 = clock.now();
        hand_off(&invoker, vec![slotted(4, t1.plus(LEAD))]).await;
        assert_eq!(inner.accepted()[1], (t1, slotted(4, t1.plus(LEAD))));
    }

    /// The shards of one stack each batch their jobs for one worker function, their
    /// invokers built at the same instant (one cold start builds every shard's): a batch
    /// id the worker saw settle is skipped as a repeated delivery, so two shards' first
    /// batches named alike lost the second's jobs uncalled.
    #[tokio::test(start_paused = true)]
    async fn invokers_built_at_the_same_instant_name_their_batches_apart() {
        let (clock, t0, inner, first) = rig(100, 1);
        let second = Arc::new(BatchingInvoker::new(inner.clone(), clock.clone(), LEAD, 100, 1));
        let slot = t0.plus(Duration::from_millis(1_000));
        let (a, b) = tokio::join!(hand_off(&first, vec![slotted(1, slot), slotted(2, slot)]), hand_off(&second, vec![slotted(3, slot), slotted(4, slot)]));
        assert!(a.iter().chain(&b).all(Result::is_ok));
        let ids: Vec<String> = inner
            .accepted()
            .iter()
            .map(|(_, payload)| match payload {
                WorkerPayload::Batch { id, .. } => id.clone(),
                other => panic!("not a batch: {other:?}"),
            })
            .collect();
        assert_eq!(ids.len(), 2);
        assert_ne!(ids[0], ids[1], "two batches of one worker named alike");
    }

    /// Workers started late lately, and the orchestrator hands jobs off 150 ms earlier:
    /// a batch goes that much earlier too (it went at the configured lead before, and
    /// its worker had no more time to start than the one that missed).
    #[tokio::test(start_paused = true)]
    async fn a_batch_goes_as_much_earlier_as_late_starts_added_to_the_lead() {
        let (_, t0, inner, invoker) = rig(100, 1);
        invoker.lead_changed(Duration::from_millis(150));
        let calls = vec![slotted(1, t0.plus(Duration::from_millis(1_000))), slotted(2, t0.plus(Duration::from_millis(1_010)))];
        hand_off(&invoker, calls).await;
        assert_eq!(sent(&inner), vec![(t0.plus(Duration::from_millis(1_000 - 400 - 150)), vec!["j-1".into(), "j-2".into()])]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_goes_when_its_most_pressing_job_must_whatever_order_they_came_in() {
        let (_, t0, inner, invoker) = rig(100, 1);
        let calls = vec![slotted(1, t0.plus(Duration::from_millis(1_400))), slotted(2, t0.plus(Duration::from_millis(900)))];
        hand_off(&invoker, calls).await;
        assert_eq!(sent(&inner), vec![(t0.plus(Duration::from_millis(500)), vec!["j-1".into(), "j-2".into()])]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_pace_above_one_worker_s_goes_to_batches_in_stripes_each_job_to_the_next() {
        let (_, t0, inner, invoker) = rig(100, 2);
        let calls = (1..=4).map(|n| slotted(n, t0.plus(Duration::from_millis(1_000 + n)))).collect();
        hand_off(&invoker, calls).await;
        let mut sent: Vec<_> = sent(&inner).into_iter().map(|(_, ids)| ids).collect();
        sent.sort();
        assert_eq!(sent, vec![vec!["j-1".to_string(), "j-3".into()], vec!["j-2".into(), "j-4".into()]]);
    }

    /// A shard's share of the shared quota grows from 100/s to 350/s and falls to 150/s:
    /// its batches gather in one stripe, then four (each worker at most 100 calls a
    /// second), then two.
    #[tokio::test(start_paused = true)]
    async fn the_stripes_in_use_follow_the_pace_as_a_shard_s_share_moves() {
        let clock = Arc::new(TokioClock::new());
        let inner = Arc::new(RecordingInvoker::new(clock.clone()));
        let t0 = clock.now();
        let invoker = Arc::new(BatchingInvoker::new(inner.clone(), clock, LEAD, 100, 4).following_pace(100, 100.0));
        // How many batches eight jobs went in once the pace changed to `pace`.
        let batches_at = |pace: f64, first: u64| {
            invoker.pace_changed(pace);
            let (invoker, inner) = (invoker.clone(), inner.clone());
            async move {
                let before = inner.accepted().len();
                let calls = (first..first + 8).map(|n| slotted(n, t0.plus(Duration::from_millis(1_000 + n)))).collect();
                hand_off(&invoker, calls).await;
                inner.accepted().len() - before
            }
        };
        assert_eq!(batches_at(100.0, 0).await, 1, "one stripe");
        assert_eq!(batches_at(350.0, 100).await, 4, "four, at 87.5 calls a second each");
        assert_eq!(batches_at(150.0, 200).await, 2, "two");
        assert_eq!(batches_at(f64::INFINITY, 300).await, 2, "an unknown pace changes nothing");
        assert_eq!(batches_at(10_000.0, 400).await, 4, "never more than it was built with");
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_gathered_by_an_orchestrator_that_died_is_never_sent() {
        let (_, t0, inner, invoker) = rig(100, 1);
        let handing_off = {
            let invoker = invoker.clone();
            tokio::spawn(async move { invoker.invoke(&slotted(1, t0.plus(Duration::from_secs(1))), None).await })
        };
        tokio::time::sleep(Duration::from_millis(100)).await;
        // The run is cut off where it stands: its hand-off and the invoker with it.
        handing_off.abort();
        drop(invoker);
        tokio::time::sleep(Duration::from_secs(2)).await;
        assert!(inner.accepted().is_empty(), "its message comes back on the queue instead");
    }

    #[tokio::test(start_paused = true)]
    async fn a_full_batch_goes_at_once_and_the_next_job_opens_another() {
        let (_, t0, inner, invoker) = rig(2, 1);
        let calls = (1..=3).map(|n| slotted(n, t0.plus(Duration::from_millis(1_000 + n)))).collect();
        hand_off(&invoker, calls).await;
        let at = |ms| t0.plus(Duration::from_millis(ms));
        assert_eq!(sent(&inner), vec![(at(0), vec!["j-1".into(), "j-2".into()]), (at(603), vec!["j-3".into()])]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_batch_over_the_payload_limit_is_split_never_dropped() {
        let (clock, t0, inner, invoker) = rig(100, 1);
        // Lambda refuses the first two sends as too large: the batch of four, then its
        // first half.
        inner.fail_next([PortError::TooLarge("over 1 MB".into()), PortError::TooLarge("over 1 MB".into())]);
        let calls = (1..=4).map(|n| slotted(n, t0.plus(Duration::from_secs(1)))).collect();
        let answers = hand_off(&invoker, calls).await;
        assert!(answers.iter().all(Result::is_ok), "{answers:?}");
        let mut sent: Vec<_> = sent(&inner).into_iter().map(|(_, ids)| ids).collect();
        sent.sort();
        assert_eq!(sent, vec![vec!["j-1".to_string()], vec!["j-2".into()], vec!["j-3".into(), "j-4".into()]]);

        // By its own bytes: a call that would take the batch over the limit starts the next.
        let bytes = slotted(5, t0).to_json().len();
        let small = Arc::new(BatchingInvoker::new(inner.clone(), clock.clone(), LEAD, 100, 1).with_max_bytes(bytes * 2 + 1));
        let t1 = clock.now();
        hand_off(&small, (5..=7).map(|n| slotted(n, t1.plus(Duration::from_secs(1)))).collect()).await;
        assert_eq!(inner.accepted().len(), 3 + 2, "two batches: of two, then of one");
    }

    #[tokio::test(start_paused = true)]
    async fn a_refused_batch_answers_each_of_its_jobs_with_the_refusal() {
        let (_, t0, inner, invoker) = rig(100, 1);
        inner.fail_next([PortError::Throttled("rate exceeded".into())]);
        let answers = hand_off(&invoker, (1..=3).map(|n| slotted(n, t0.plus(Duration::from_secs(1)))).collect()).await;
        assert_eq!(answers, vec![Err(PortError::Throttled("rate exceeded".into())); 3], "each job goes back in hand and goes again");
    }
}

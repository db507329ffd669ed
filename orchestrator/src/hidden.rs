//! The jobs a run gave back to the queue for later and that are still hidden there:
//! SQS counts them as in flight, with those in hand, and lets about 120,000 be (a
//! receive past that is refused). A run keeps what it holds in hand and hides within
//! [`MOST_IN_FLIGHT`] and [`most_hidden`] (see `ManyLanes::room_to_hide`); a lane's
//! surplus past that is sent again with a delay (a delayed message is not in flight)
//! and the received one deleted.

use std::collections::BTreeMap;

use paceline_shared::job::Job;
use paceline_shared::ports::QueuedMessage;
use paceline_shared::time::UnixMillis;

/// The most messages a run holds in flight on its jobs queue, in hand and hidden for
/// later: SQS lets "approximately 120,000" be on a standard queue, and the rest is for
/// the hand-offs whose delete has not gone yet and what a run before hid.
pub(crate) const MOST_IN_FLIGHT: usize = 110_000;

/// The most a run hides for later when it may hold `in_hand_most` jobs in hand: what
/// [`MOST_IN_FLIGHT`] leaves, so that its receives keep room. On a standard queue, room
/// for all it may hold in hand: the busy lanes' jobs come in line with the quiet
/// lanes', and reaching these takes receives. On a fair queue, room for
/// [`FAIR_QUEUE_ROOM_IN_HAND`] of it: the queue passes over the busy lanes' jobs.
pub(crate) fn most_hidden(in_hand_most: usize, fair_queue: bool) -> usize {
    let room = if fair_queue { (in_hand_most as f64 * FAIR_QUEUE_ROOM_IN_HAND) as usize } else { in_hand_most };
    MOST_IN_FLIGHT.saturating_sub(room)
}

/// The share of what a run may hold in hand that its hiding leaves room for on a fair
/// queue. With no room kept, at 10,000 calls/s over 1,000 lanes by a Zipf law, hand and
/// hidden reached SQS's limit 6 s in and the light lanes' last jobs were read at the
/// pace the jobs went: their wait's p99 was 12.2 s (13.0 s as deployed), where their
/// fair share's is 9.2 s. A half gives 10.6 s (11.4 s) for 0.045 SQS requests a job
/// more; five eighths, 10.3 s (11.2 s) for 0.072 more; three quarters, no shorter.
pub(crate) const FAIR_QUEUE_ROOM_IN_HAND: f64 = 0.625;

/// The body a received job is sent again with: its job stamped with when it was first
/// put on the queue (its outcome's `enqueued` and its wait count from then, not from
/// the send again), as a re-queue's is; the body as it came where it does not parse
/// (it is dead-lettered with its reason when received again).
pub(crate) fn body_sent_again(message: &QueuedMessage) -> String {
    match Job::parse(&message.body) {
        Ok(mut job) => {
            job.enqueued_at.get_or_insert(message.enqueued_at);
            job.to_json()
        }
        Err(_) => message.body.clone(),
    }
}

/// How many of the jobs given back come back when: each is hidden until then.
#[derive(Default)]
pub(crate) struct HiddenOnQueue {
    by_due: BTreeMap<UnixMillis, usize>,
    total: usize,
}

impl HiddenOnQueue {
    /// `count` jobs hidden until `until`.
    pub fn hide(&mut self, until: UnixMillis, count: usize) {
        *self.by_due.entry(until).or_default() += count;
        self.total += count;
    }

    /// `count` of the jobs hidden until `until` made visible at once (brought back).
    pub fn shown(&mut self, until: UnixMillis, count: usize) {
        let Some(hidden) = self.by_due.get_mut(&until) else { return };
        let shown = count.min(*hidden);
        *hidden -= shown;
        self.total -= shown;
        if *hidden == 0 {
            self.by_due.remove(&until);
        }
    }

    /// How many are still hidden at `now` (those due by then are visible again).
    pub fn at(&mut self, now: UnixMillis) -> usize {
        while let Some(entry) = self.by_due.first_entry() {
            if *entry.key() > now {
                break;
            }
            self.total -= entry.remove();
        }
        self.total
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn jobs_hidden_count_until_they_are_due_or_shown() {
        let mut hidden = HiddenOnQueue::default();
        hidden.hide(UnixMillis(2_000), 10);
        hidden.hide(UnixMillis(5_000), 7);
        hidden.hide(UnixMillis(2_000), 3);
        assert_eq!(hidden.at(UnixMillis(1_999)), 20);
        hidden.shown(UnixMillis(5_000), 4);
        assert_eq!(hidden.at(UnixMillis(2_000)), 3, "13 due at 2 s, 4 shown");
        hidden.shown(UnixMillis(2_000), 5);
        assert_eq!(hidden.at(UnixMillis(2_000)), 3, "those due already are not counted twice");
        assert_eq!(hidden.at(UnixMillis(5_000)), 0);
    }

    #[test]
    fn a_job_sent_again_keeps_when_it_was_first_put_on_the_queue() {
        let received = |body: &str, at: u64| QueuedMessage {
            message_id: "m".into(),
            receipt: "r".into(),
            body: body.into(),
            attempt: 2,
            enqueued_at: UnixMillis(at),
            group: None,
        };
        let first = received(r#"{"id":"j1","lane":"acme","request":{"method":"GET","path":"/x"}}"#, 1_795_824_000_000);
        let again = Job::parse(&body_sent_again(&first)).unwrap();
        assert_eq!((again.id.as_str(), again.lane.as_str(), again.enqueued_at), ("j1", "acme", Some(UnixMillis(1_795_824_000_000))));
        let later = received(&body_sent_again(&first), 1_795_824_060_000);
        assert_eq!(Job::parse(&body_sent_again(&later)).unwrap().enqueued_at, Some(UnixMillis(1_795_824_000_000)), "sent again twice: still the first");
        assert_eq!(body_sent_again(&received("not a job", 0)), "not a job");
    }

    #[test]
    fn a_run_hides_what_the_queues_most_in_flight_leaves_past_its_jobs_in_hand() {
        assert_eq!(most_hidden(50_000, false), 60_000);
        assert_eq!(most_hidden(60_000, false), 50_000);
        assert_eq!(most_hidden(40_000, true), 85_000, "on a fair queue, room for five eighths of it");
    }
}

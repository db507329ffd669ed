//! Reads a dead-letter queue through once, page by page. On SQS, what was read stays
//! hidden for the hold so the next page brings new records; a record the caller did not
//! remove is made visible again when the scan ends.

use std::collections::HashSet;
use std::time::Duration;

use paceline_shared::dlq::{DeadLetterRecord, DlqSource};
use paceline_shared::ports::{DeadLetterQueues, PortResult};

/// Records per page (SQS's most per receive).
const PAGE: usize = 10;

/// One pass over one DLQ.
pub struct Scan<'a> {
    queues: &'a dyn DeadLetterQueues,
    source: DlqSource,
    hold: Duration,
    after: Option<String>,
    seen: HashSet<String>,
    held: Vec<String>,
    done: bool,
}

impl<'a> Scan<'a> {
    #[must_use]
    pub fn new(queues: &'a dyn DeadLetterQueues, source: DlqSource, hold: Duration) -> Self {
        Self { queues, source, hold, after: None, seen: HashSet::new(), held: Vec::new(), done: false }
    }

    /// The next records not seen before in this pass; empty at the end. A page of only
    /// records seen before (their hold ran out while we read) also ends the pass.
    ///
    /// # Errors
    /// The queue's error.
    pub async fn next_page(&mut self) -> PortResult<Vec<DeadLetterRecord>> {
        if self.done {
            return Ok(Vec::new());
        }
        let page = self.queues.page(self.source, self.after.as_deref(), PAGE, self.hold).await?;
        self.after = page.last().map(|r| r.handle.clone());
        self.held.extend(page.iter().map(|r| r.handle.clone()));
        let fresh: Vec<DeadLetterRecord> = page.into_iter().filter(|r| self.seen.insert(r.message_id.clone())).collect();
        self.done = fresh.is_empty();
        Ok(fresh)
    }

    /// These records left the DLQ (redriven or purged): nothing to make visible again.
    pub fn removed(&mut self, records: &[DeadLetterRecord]) {
        let gone: HashSet<&str> = records.iter().map(|r| r.handle.as_str()).collect();
        self.held.retain(|h| !gone.contains(h.as_str()));
    }

    /// Ends the pass: what is still held is made visible to other readers again.
    ///
    /// # Errors
    /// The queue's error (the records then come back when their hold ends).
    pub async fn finish(self) -> PortResult<()> {
        if self.held.is_empty() {
            return Ok(());
        }
        self.queues.unhide(self.source, &self.held).await
    }
}

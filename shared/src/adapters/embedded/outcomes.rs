//! The embedded store's outcome records: kept in SQLite for `[outcomes] retention`, read
//! by `paceline results` (filtered by job, time and status; followed by row number).

use std::sync::atomic::Ordering;
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::params;

use super::{fatal, sql_err, to_i64, EmbeddedStore};
use crate::lane::LaneId;
use crate::outcome::{Ending, OutcomeRecord, StatusFilter};
use crate::ports::{OutcomeSink, PortResult};
use crate::time::UnixMillis;

/// How often old records are swept (on a write).
const SWEEP_EVERY: Duration = Duration::from_secs(60);

/// Which records to read.
#[derive(Clone, Debug, Default)]
pub struct OutcomeQuery {
    pub job_id: Option<String>,
    pub lane: Option<LaneId>,
    /// Recorded at or after this time.
    pub since: Option<UnixMillis>,
    pub status: Option<StatusFilter>,
    /// Only records kept after this row (what `--follow` has shown).
    pub after_row: i64,
    pub limit: usize,
}

/// A record as kept, with its row number (for `--follow`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct KeptOutcome {
    pub row: i64,
    pub record: OutcomeRecord,
}

impl EmbeddedStore {
    /// Records matching `query`, oldest first, at most `query.limit`.
    ///
    /// # Errors
    /// `Fatal` when the database cannot be read or holds an unreadable record.
    pub fn outcomes(&self, query: &OutcomeQuery) -> PortResult<Vec<KeptOutcome>> {
        self.on_db(|| {
            let (class_from, ending) = match query.status {
                None => (None, None),
                Some(StatusFilter::Class(class)) => (Some(i64::from(class) * 100), None),
                Some(StatusFilter::Dead) => (None, Some(Ending::DeadLettered.label())),
            };
            let conn = self.conn();
            let mut select = conn
                .prepare_cached(
                    "SELECT seq, record FROM outcomes WHERE seq > ?1 AND recorded_at >= ?2 AND (?3 IS NULL OR job_id = ?3)
                     AND (?4 IS NULL OR outcome = ?4) AND (?5 IS NULL OR status BETWEEN ?5 AND ?5 + 99)
                     AND (?7 IS NULL OR coalesce(json_extract(record, '$.lane'), ?8) = ?7)
                     ORDER BY seq LIMIT ?6",
                )
                .map_err(sql_err)?;
            let since = to_i64(query.since.unwrap_or_default().0);
            let limit = i64::try_from(query.limit).unwrap_or(i64::MAX);
            let lane = query.lane.as_ref().map(LaneId::as_str);
            let rows = select
                .query_map(params![query.after_row, since, query.job_id, ending, class_from, limit, lane, LaneId::DEFAULT_NAME], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?))
                })
                .map_err(sql_err)?;
            rows.map(|row| {
                let (row, text) = row.map_err(sql_err)?;
                let record = serde_json::from_str(&text).map_err(|e| fatal(format!("outcome record {row} is unreadable: {e}")))?;
                Ok(KeptOutcome { row, record })
            })
            .collect()
        })
    }

    /// The row of the newest record kept (0 with none): where a reader that wants only
    /// what comes next starts.
    ///
    /// # Errors
    /// `Fatal` when the database cannot be read.
    pub fn newest_outcome_row(&self) -> PortResult<i64> {
        self.on_db(|| self.conn().query_row("SELECT coalesce(max(seq), 0) FROM outcomes", [], |r| r.get(0)).map_err(sql_err))
    }

    /// Deletes records kept longer than the retention, at most once a minute.
    fn sweep_outcomes(&self, conn: &rusqlite::Connection, now: UnixMillis) -> PortResult<()> {
        let last = self.last_outcome_sweep.load(Ordering::Relaxed);
        if now.0 < last.saturating_add(SWEEP_EVERY.as_millis().try_into().unwrap_or(u64::MAX)) {
            return Ok(());
        }
        self.last_outcome_sweep.store(now.0, Ordering::Relaxed);
        conn.execute("DELETE FROM outcomes WHERE recorded_at < ?1", [to_i64(now.minus(self.outcome_retention).0)]).map_err(sql_err)?;
        Ok(())
    }
}

#[async_trait]
impl OutcomeSink for EmbeddedStore {
    async fn record_outcome(&self, record: &OutcomeRecord) -> PortResult<()> {
        self.on_db(|| {
            let now = self.clock.now();
            let text = serde_json::to_string(record).map_err(fatal)?;
            let conn = self.conn();
            conn.execute(
                "INSERT INTO outcomes (job_id, outcome, attempts, status, recorded_at, record) VALUES (?1, ?2, ?3, ?4, ?5, ?6)
                 ON CONFLICT (job_id, outcome, attempts) DO UPDATE SET status = excluded.status, record = excluded.record",
                params![record.job_id, record.outcome.label(), record.attempts, record.status, to_i64(now.0), text],
            )
            .map_err(sql_err)?;
            self.sweep_outcomes(&conn, now)
        })
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::job::Job;
    use crate::outcome::{Answer, OutcomeTimes};
    use crate::time::ManualClock;

    fn record(id: &str, ending: Ending, status: Option<u16>, attempts: u32) -> OutcomeRecord {
        record_in("default", id, ending, status, attempts)
    }

    fn record_in(lane: &str, id: &str, ending: Ending, status: Option<u16>, attempts: u32) -> OutcomeRecord {
        let job = Job::parse(&format!(r#"{{"id":"{id}","lane":"{lane}","request":{{"method":"GET","path":"/"}}}}"#)).unwrap();
        OutcomeRecord::new(&job, ending, attempts, &Answer { status, ..Answer::default() }, &[], OutcomeTimes::default())
    }

    fn all() -> OutcomeQuery {
        OutcomeQuery { limit: 100, ..OutcomeQuery::default() }
    }

    fn ids(kept: &[KeptOutcome]) -> Vec<&str> {
        kept.iter().map(|k| k.record.job_id.as_str()).collect()
    }

    #[tokio::test]
    async fn records_carry_their_lane_and_are_filtered_by_it_the_default_lane_included() {
        let store = EmbeddedStore::in_memory(Arc::new(ManualClock::new(UnixMillis(1_000_000)))).unwrap();
        store.record_outcome(&record("a", Ending::Succeeded, Some(200), 1)).await.unwrap();
        store.record_outcome(&record_in("acme", "b", Ending::Succeeded, Some(200), 1)).await.unwrap();
        store.record_outcome(&record_in("gold", "c", Ending::Succeeded, Some(200), 1)).await.unwrap();
        let q = |lane: &str| OutcomeQuery { lane: Some(lane.parse().unwrap()), ..all() };
        assert_eq!(ids(&store.outcomes(&q("acme")).unwrap()), ["b"]);
        assert_eq!(ids(&store.outcomes(&q("default")).unwrap()), ["a"]);
        assert_eq!(store.outcomes(&q("gold")).unwrap()[0].record.lane.as_str(), "gold");
        assert_eq!(ids(&store.outcomes(&all()).unwrap()), ["a", "b", "c"]);
    }

    #[tokio::test]
    async fn records_are_filtered_by_job_status_time_and_row_and_a_repeat_replaces_its_twin() {
        let clock = Arc::new(ManualClock::new(UnixMillis(1_000_000)));
        let store = EmbeddedStore::in_memory(clock.clone()).unwrap();
        store.record_outcome(&record("a", Ending::Succeeded, Some(200), 1)).await.unwrap();
        store.record_outcome(&record("b", Ending::DeadLettered, Some(404), 1)).await.unwrap();
        clock.advance(Duration::from_secs(10));
        store.record_outcome(&record("c", Ending::DeadLettered, None, 5)).await.unwrap();
        store.record_outcome(&record("a", Ending::Succeeded, Some(200), 1)).await.unwrap();

        assert_eq!(ids(&store.outcomes(&all()).unwrap()), ["a", "b", "c"], "the repeated write replaced its record");
        let q = |status: &str| OutcomeQuery { status: Some(status.parse().unwrap()), ..all() };
        assert_eq!(ids(&store.outcomes(&q("2xx")).unwrap()), ["a"]);
        assert_eq!(ids(&store.outcomes(&q("4xx")).unwrap()), ["b"]);
        assert_eq!(ids(&store.outcomes(&q("dead")).unwrap()), ["b", "c"]);
        assert_eq!(ids(&store.outcomes(&OutcomeQuery { job_id: Some("b".into()), ..all() }).unwrap()), ["b"]);
        assert_eq!(ids(&store.outcomes(&OutcomeQuery { since: Some(UnixMillis(1_005_000)), ..all() }).unwrap()), ["c"]);
        let first = store.outcomes(&all()).unwrap()[0].row;
        assert_eq!(ids(&store.outcomes(&OutcomeQuery { after_row: first, ..all() }).unwrap()), ["b", "c"]);
    }

    #[tokio::test]
    async fn records_older_than_the_retention_are_swept() {
        let clock = Arc::new(ManualClock::new(UnixMillis(1_000_000)));
        let store = EmbeddedStore::in_memory(clock.clone()).unwrap().with_outcome_retention(Duration::from_secs(3600));
        store.record_outcome(&record("old", Ending::Succeeded, Some(200), 1)).await.unwrap();
        clock.advance(Duration::from_secs(3601));
        store.record_outcome(&record("new", Ending::Succeeded, Some(200), 1)).await.unwrap();
        assert_eq!(ids(&store.outcomes(&all()).unwrap()), ["new"]);
    }
}

//! The embedded backend: one SQLite file holds the jobs queue (with visibility
//! timeouts), the dead-letter queue, quota usage, pacer snapshot, circuit, cool-down and
//! lease; the in-process invoker keeps each hand-off durable until its worker finishes.
//!
//! Durability: WAL with `synchronous=NORMAL` survives a killed process (not a power cut
//! on every filesystem). Each port call is one short transaction. Calls are synchronous
//! under a mutex: they take microseconds, and staying off `spawn_blocking` keeps paused
//! tokio time deterministic in tests. But another process can hold SQLite's write lock
//! for seconds (a DB browser, the `sqlite3` shell, a backup), and a call then waits for
//! it: on a multi-threaded runtime each call runs in `blocking`, so the wait never
//! holds up the async threads (where the workers' API calls and their timeouts run).

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use async_trait::async_trait;
use rusqlite::{params, Connection, OpenFlags, OptionalExtension};

use crate::adaptive::ProviderReading;
use crate::breaker::{failure_bucket_end, Circuit, FAILURE_BUCKET_PREFIX, FAILURE_BUCKET_TTL};
use crate::calls_coming::{calls_coming, CHECKPOINT_ROOM, CHECKPOINT_WAIT};
use crate::config::LaneChange;
use crate::dlq::{jobs_record, DeadLetterRecord, DlqSource};
use crate::job::{DeadLetterReason, WorkerPayload};
use crate::keys::{StoreScope, LANE_CHANGE};
use crate::lane::LaneId;
use crate::order::{LaneOrdering, OrderMark, OrderState, ORDER_MARK};
use crate::ports::{
    redrive_messages, BatchClaim, BatchProgress, CallClaim, DeadLetter, DeadLetterQueues, Invoker, JobQueue, Lease, OutgoingMessage, PacerSnapshot, PortError,
    PortResult, QueueDepth, QueuedMessage, ScopedStores, StateStore, VisibleAgain, WorkerHandler,
};
use crate::retry;
use crate::time::{Clock, UnixMillis};

mod outcomes;

pub use outcomes::{KeptOutcome, OutcomeQuery};

/// The schema's version, kept in SQLite's `user_version`. 1: the first (unversioned,
/// `user_version` 0 in its files); 2: outcome records; 3: call slots by scope (lane);
/// 4: ordered lanes (a message's FIFO group, and retries received ahead). `SCHEMA`
/// creates what is missing, so opening a file of an older version migrates it (after
/// `BEFORE_SCHEMA_3` and `before_schema_4`); a newer version is refused.
pub const SCHEMA_VERSION: u32 = 4;

/// Run on a file older than schema 3 before [`SCHEMA`]: its call slots table has no scope
/// column. Call slots are held only while a call runs, so the table is made anew: at
/// most the slots of calls under way are forgotten (they expire within a timeout anyway).
const BEFORE_SCHEMA_3: &str = "DROP TABLE IF EXISTS call_slots;";

const SCHEMA: &str = "
PRAGMA journal_mode = WAL;
PRAGMA synchronous = NORMAL;
CREATE TABLE IF NOT EXISTS messages (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id TEXT NOT NULL UNIQUE,
    body TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    visible_at INTEGER NOT NULL,
    receipt TEXT,
    receive_count INTEGER NOT NULL DEFAULT 0,
    enqueued_at INTEGER NOT NULL,
    -- An ordered lane's retry: received before every other message.
    ahead INTEGER NOT NULL DEFAULT 0,
    -- An ordered lane's job: its lane, a FIFO group (see `try_receive`).
    grp TEXT
);
CREATE INDEX IF NOT EXISTS messages_visible ON messages (visible_at, seq) WHERE grp IS NULL;
CREATE INDEX IF NOT EXISTS messages_ahead ON messages (visible_at, seq) WHERE ahead = 1;
CREATE INDEX IF NOT EXISTS messages_group ON messages (grp, seq) WHERE grp IS NOT NULL;
-- Deletes and releases find a message by its receipt (not a scan of the queue).
CREATE INDEX IF NOT EXISTS messages_receipt ON messages (receipt);
CREATE TABLE IF NOT EXISTS dead_letters (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    message_id TEXT NOT NULL,
    body TEXT NOT NULL,
    attempt INTEGER NOT NULL,
    reason TEXT NOT NULL,
    dead_at INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
-- The done call records by the end of their keep: a sweep reads the expired ones alone.
-- And the circuits apart from the call records kept beside them.
CREATE INDEX IF NOT EXISTS kv_circuits ON kv (key) WHERE key GLOB '*circuit';
CREATE INDEX IF NOT EXISTS kv_done_calls ON kv (json_extract(value, '$.expires_at')) WHERE json_extract(value, '$.state') = 'done';
CREATE TABLE IF NOT EXISTS usage (key TEXT PRIMARY KEY, used INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS call_slots (
    scope TEXT NOT NULL,
    idx INTEGER NOT NULL,
    holder TEXT,
    expires_at INTEGER NOT NULL,
    PRIMARY KEY (scope, idx)
);
CREATE TABLE IF NOT EXISTS outcomes (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    outcome TEXT NOT NULL,
    attempts INTEGER NOT NULL,
    status INTEGER,
    recorded_at INTEGER NOT NULL,
    record TEXT NOT NULL,
    UNIQUE (job_id, outcome, attempts)
);
CREATE INDEX IF NOT EXISTS outcomes_recorded ON outcomes (recorded_at);
CREATE TABLE IF NOT EXISTS invocations (
    seq INTEGER PRIMARY KEY AUTOINCREMENT,
    payload TEXT NOT NULL,
    created_at INTEGER NOT NULL
);
";

/// Deletes the done call records of a scope (`?2`, a GLOB of its call keys) whose keep
/// ended before `?1`, reading the expired records alone (through `kv_done_calls`: left
/// to itself, SQLite takes the key's range, every record of the scope, kept a day).
const SWEEP_DONE_CALLS: &str = "DELETE FROM kv INDEXED BY kv_done_calls
     WHERE json_extract(value, '$.state') = 'done' AND json_extract(value, '$.expires_at') < ?1 AND key GLOB ?2";

/// Every lane's circuit. Its run reads them every 100 ms, and `serve` twice a second:
/// through `kv_circuits`, which holds the circuits alone (the key's range would read
/// every lane's call records too).
const READ_CIRCUITS: &str = "SELECT key, value FROM kv INDEXED BY kv_circuits WHERE key GLOB '*circuit' AND (key = 'circuit' OR key GLOB 'lane#*#circuit')";

/// How long a call waits for another process's lock before it fails as `Transient`.
const BUSY_TIMEOUT: Duration = Duration::from_secs(5);

/// How often `receive` looks again while long polling an empty queue.
const POLL_STEP: Duration = Duration::from_millis(50);

/// A call record as the embedded store keeps it (in `kv`, under its key).
#[derive(serde::Serialize, serde::Deserialize)]
struct CallRecord {
    state: CallClaim,
    holder: String,
    expires_at: UnixMillis,
}

/// A worker batch's progress record as the kv table keeps it.
#[derive(serde::Serialize, serde::Deserialize)]
struct BatchRecord {
    holder: String,
    expires_at: UnixMillis,
    settled: String,
    done: bool,
}

/// The embedded store: queue, DLQ and state in one SQLite database.
///
/// A store keeps one scope's state ([`EmbeddedStore::scoped`]: a lane's, or the stack's);
/// the queue, the DLQ, the lease and the outcome records are the whole file's.
pub struct EmbeddedStore {
    conn: Arc<Mutex<Connection>>,
    clock: Arc<dyn Clock>,
    /// How long outcome records are kept (`[outcomes] retention`).
    outcome_retention: Duration,
    /// When outcome records were last swept.
    last_outcome_sweep: Arc<AtomicU64>,
    /// The file, named in errors (none in memory).
    path: Option<std::path::PathBuf>,
    /// Whose state this store reads and writes, and its keys' prefix.
    scope: StoreScope,
    prefix: String,
    /// The thread that checkpoints the WAL, where this store's process runs the stack.
    checkpointer: Option<Arc<Checkpointer>>,
    /// Which lanes are ordered: their jobs go in FIFO groups (none without it).
    ordering: Option<Arc<LaneOrdering>>,
}

/// How often a run's store moves its WAL into the database (see
/// [`EmbeddedStore::with_background_checkpoints`], whose doc says 200 ms).
const CHECKPOINT_EVERY: Duration = Duration::from_millis(200);

/// Stops the checkpointing thread when the last handle on its store goes.
struct Checkpointer {
    stop: Arc<AtomicBool>,
}

impl Drop for Checkpointer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Relaxed);
    }
}

/// Runs store work that may wait on SQLite's lock: on a multi-threaded runtime through
/// `block_in_place`, so the thread's other tasks move to another thread meanwhile (an
/// API answer that came in 0.3 s is read then, not taken for a timeout after the lock is
/// gone); elsewhere (tests on a current-thread runtime, plain threads) directly.
fn blocking<T>(work: impl FnOnce() -> T) -> T {
    match tokio::runtime::Handle::try_current() {
        Ok(handle) if handle.runtime_flavor() == tokio::runtime::RuntimeFlavor::MultiThread => tokio::task::block_in_place(work),
        _ => work(),
    }
}

fn fatal(e: impl std::fmt::Display) -> PortError {
    PortError::Fatal(format!("embedded store: {e}"))
}

fn sql_err(e: rusqlite::Error) -> PortError {
    // A damaged header or WAL can also surface as a mismatched text encoding: this
    // store attaches no databases, so the main file's own header is what changed.
    if matches!(e.sqlite_error_code(), Some(rusqlite::ErrorCode::DatabaseCorrupt | rusqlite::ErrorCode::NotADatabase))
        || e.to_string().contains("text encoding")
    {
        return fatal(format!(
            "the database file (or its -wal file) is damaged: {e}; check it with `sqlite3 FILE 'PRAGMA integrity_check'` \
             or restore it from a backup"
        ));
    }
    match e.sqlite_error_code() {
        Some(rusqlite::ErrorCode::DatabaseBusy | rusqlite::ErrorCode::DatabaseLocked) => PortError::Transient(format!(
            "the database was locked for over {} s by another process (a DB browser, the sqlite3 shell, a backup?); retrying ({e})",
            BUSY_TIMEOUT.as_secs()
        )),
        _ => fatal(e),
    }
}

fn to_i64(v: u64) -> i64 {
    i64::try_from(v).unwrap_or(i64::MAX)
}

fn to_u64(v: i64) -> u64 {
    u64::try_from(v).unwrap_or(0)
}

impl EmbeddedStore {
    /// Opens (creating if needed) the database at `path`, as a run or an enqueue does.
    ///
    /// # Errors
    /// `Fatal` naming the path when it cannot be opened or initialised, has more than
    /// one hard link, or holds another application's tables.
    pub fn open(path: &Path, clock: Arc<dyn Clock>) -> PortResult<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir).map_err(|e| fatal(format!("cannot create {}: {e}", dir.display())))?;
        }
        Self::open_with(path, clock, OpenFlags::default())
    }

    /// Opens the database at `path` only if it exists, as commands that inspect or
    /// repair a lane do: a mistyped path is an error, not a new empty lane.
    ///
    /// # Errors
    /// `Fatal` when there is no file at `path`, and as [`EmbeddedStore::open`].
    pub fn open_existing(path: &Path, clock: Arc<dyn Clock>) -> PortResult<Self> {
        if !path.try_exists().unwrap_or(true) {
            return Err(fatal(format!("no database at {}: nothing was enqueued or run with this config yet (is [backend] path right?)", path.display())));
        }
        Self::open_with(path, clock, OpenFlags::default().difference(OpenFlags::SQLITE_OPEN_CREATE))
    }

    fn open_with(path: &Path, clock: Arc<dyn Clock>, flags: OpenFlags) -> PortResult<Self> {
        refuse_extra_links(path)?;
        let conn = Connection::open_with_flags(path, flags).map_err(|e| fatal(format!("cannot open {}: {e}", path.display())))?;
        refuse_foreign_schema(&conn).map_err(|e| fatal(format!("{} {e}", path.display())))?;
        // Initialising writes (schema, WAL): a read-only file fails here, named.
        let store = Self::init(conn, clock).map_err(|e| fatal(format!("cannot use {}: {e}", path.display())))?;
        Ok(Self { path: Some(path.to_owned()), ..store })
    }

    /// A private in-memory database, for tests.
    ///
    /// # Errors
    /// `Fatal` if SQLite cannot initialise.
    pub fn in_memory(clock: Arc<dyn Clock>) -> PortResult<Self> {
        Self::init(Connection::open_in_memory().map_err(fatal)?, clock)
    }

    fn init(conn: Connection, clock: Arc<dyn Clock>) -> PortResult<Self> {
        conn.busy_timeout(BUSY_TIMEOUT).map_err(fatal)?;
        let version: u32 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(fatal)?;
        if version > SCHEMA_VERSION {
            return Err(fatal(format!(
                "the database has schema version {version}, written by a newer paceline; this one knows up to {SCHEMA_VERSION} (upgrade paceline)"
            )));
        }
        if version < 3 {
            conn.execute_batch(BEFORE_SCHEMA_3).map_err(fatal)?;
        }
        if version < 4 {
            before_schema_4(&conn).map_err(fatal)?;
        }
        conn.execute_batch(SCHEMA).map_err(fatal)?;
        if version < SCHEMA_VERSION {
            conn.pragma_update(None, "user_version", SCHEMA_VERSION).map_err(fatal)?;
        }
        let retention = crate::outcome::OutcomeSettings::default().retention;
        Ok(Self {
            conn: Arc::new(Mutex::new(conn)),
            clock,
            outcome_retention: retention,
            last_outcome_sweep: Arc::new(AtomicU64::new(0)),
            path: None,
            scope: StoreScope::default_lane(),
            prefix: String::new(),
            checkpointer: None,
            ordering: None,
        })
    }

    /// The same database, reading and writing `scope`'s state (a lane's pacer, circuit,
    /// cool-down, counters, call records and slots, or the stack's); the queue, the
    /// lease and the outcome records are shared.
    #[must_use]
    pub fn scoped(&self, scope: &StoreScope) -> Self {
        Self {
            conn: Arc::clone(&self.conn),
            clock: Arc::clone(&self.clock),
            outcome_retention: self.outcome_retention,
            last_outcome_sweep: Arc::clone(&self.last_outcome_sweep),
            path: self.path.clone(),
            prefix: scope.prefix(),
            scope: scope.clone(),
            checkpointer: self.checkpointer.clone(),
            ordering: self.ordering.clone(),
        }
    }

    /// The same store, putting the jobs of the lanes `ordering` orders in FIFO groups
    /// (see `try_receive`): every process that sends to an ordered stack's queue
    /// opens it so.
    #[must_use]
    pub fn with_ordering(mut self, ordering: LaneOrdering) -> Self {
        self.ordering = ordering.any().then(|| Arc::new(ordering));
        self
    }

    /// Where a message with `body` goes in the queue: its lane's FIFO group if the lane
    /// is ordered.
    fn place_of(&self, body: &str) -> Place {
        let Some(ordering) = &self.ordering else { return Place::Unordered };
        let lane = LaneId::named_in(body);
        if ordering.of(&lane).is_ordered() {
            Place::Group(lane.to_string())
        } else {
            Place::Unordered
        }
    }

    /// Whose state this store holds.
    #[must_use]
    pub fn scope(&self) -> &StoreScope {
        &self.scope
    }

    /// `name` under this store's scope.
    fn key(&self, name: &str) -> String {
        format!("{}{name}", self.prefix)
    }

    /// The same store, its WAL checkpointed into the database every 200 ms on a thread
    /// and connection of their own, passively (writers never wait for it), instead of by
    /// SQLite inside the commit that grows the WAL past 1,000 pages: that commit held the
    /// store, and a run's hand-offs and calls behind it, for the copy (and its fsync).
    /// For the process that runs the stack; in memory, the store is returned as it is.
    ///
    /// # Errors
    /// `Fatal` when the second connection cannot be opened or the thread started.
    pub fn with_background_checkpoints(self) -> PortResult<Self> {
        let Some(path) = self.path.clone() else { return Ok(self) };
        let checkpoints = Connection::open(&path).map_err(|e| fatal(format!("cannot open {} to checkpoint it: {e}", path.display())))?;
        checkpoints.busy_timeout(BUSY_TIMEOUT).map_err(fatal)?;
        self.on_db(|| self.conn().pragma_update(None, "wal_autocheckpoint", 0).map_err(sql_err))?;
        let stop = Arc::new(AtomicBool::new(false));
        let stopped = Arc::clone(&stop);
        std::thread::Builder::new()
            .name("paceline-checkpoint".into())
            .spawn(move || {
                // Copying the WAL takes milliseconds of the core: a lane that wakes for its slot goes first.
                crate::priority::yield_to_the_lanes();
                while !stopped.load(Ordering::Relaxed) {
                    // Its `fsync` holds the core: between the lanes' calls.
                    calls_coming().wait_for_room_blocking(CHECKPOINT_ROOM, CHECKPOINT_WAIT);
                    // A checkpoint a reader keeps from finishing is finished by a later one.
                    let _ = checkpoints.query_row("PRAGMA wal_checkpoint(PASSIVE)", [], |_| Ok(()));
                    std::thread::sleep(CHECKPOINT_EVERY);
                }
            })
            .map_err(|e| fatal(format!("cannot start the checkpoint thread: {e}")))?;
        Ok(Self { checkpointer: Some(Arc::new(Checkpointer { stop })), ..self })
    }

    /// The same store keeping outcome records for `retention`.
    #[must_use]
    pub fn with_outcome_retention(self, retention: Duration) -> Self {
        Self { outcome_retention: retention, ..self }
    }

    /// Runs store work through [`blocking`], naming the database file in a fatal error.
    fn on_db<T>(&self, work: impl FnOnce() -> PortResult<T>) -> PortResult<T> {
        blocking(work).map_err(|e| match (e, &self.path) {
            (PortError::Fatal(what), Some(path)) => {
                PortError::Fatal(format!("embedded store {}: {}", path.display(), what.strip_prefix("embedded store: ").unwrap_or(&what)))
            }
            (e, _) => e,
        })
    }

    fn conn(&self) -> MutexGuard<'_, Connection> {
        self.conn.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    fn get_kv<T: serde::de::DeserializeOwned>(&self, key: &str) -> PortResult<Option<T>> {
        self.on_db(|| Self::read_kv(&self.conn(), key))
    }

    fn read_kv<T: serde::de::DeserializeOwned>(conn: &Connection, key: &str) -> PortResult<Option<T>> {
        let mut read = conn.prepare_cached("SELECT value FROM kv WHERE key = ?1").map_err(sql_err)?;
        let text: Option<String> = read.query_row([key], |r| r.get(0)).optional().map_err(sql_err)?;
        text.map(|t| serde_json::from_str(&t).map_err(|e| PortError::Unreadable(format!("stored {key}: {e}")))).transpose()
    }

    /// What an operator tool keeps beside the stack's state under `name` (`paceline
    /// serve`'s token hashes), if anything.
    ///
    /// # Errors
    /// `Fatal` on a database failure, `Unreadable` for a value that is not `T`.
    pub fn operator_setting<T: serde::de::DeserializeOwned>(&self, name: &str) -> PortResult<Option<T>> {
        self.get_kv(&format!("operator#{name}"))
    }

    /// When the oldest job on the queue was first enqueued (none on an empty queue).
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn oldest_enqueued(&self) -> PortResult<Option<UnixMillis>> {
        self.on_db(|| {
            let oldest: Option<i64> = self.conn().query_row("SELECT min(enqueued_at) FROM messages", [], |r| r.get(0)).map_err(sql_err)?;
            Ok(oldest.map(|at| UnixMillis(to_u64(at))))
        })
    }

    /// Keeps `value` under `name`, over what was there.
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn set_operator_setting<T: serde::Serialize>(&self, name: &str, value: &T) -> PortResult<()> {
        self.on_db(|| Self::put_kv(&self.conn(), &format!("operator#{name}"), value))
    }

    /// Keeps `value` under `name` unless a value is there already; whether it was kept
    /// (two processes starting at once keep one of theirs, never both).
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn keep_operator_setting<T: serde::Serialize>(&self, name: &str, value: &T) -> PortResult<bool> {
        let text = serde_json::to_string(value).map_err(fatal)?;
        self.on_db(|| {
            let kept =
                self.conn().execute("INSERT INTO kv (key, value) VALUES (?1, ?2) ON CONFLICT(key) DO NOTHING", params![format!("operator#{name}"), text]);
            Ok(kept.map_err(sql_err)? == 1)
        })
    }

    /// Every lane's stored circuit as JSON text, by lane (the default lane's too), in one
    /// read: what a run's circuit watcher compares from one look to the next.
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn circuits_as_stored(&self) -> PortResult<Vec<(LaneId, String)>> {
        self.on_db(|| {
            let conn = self.conn();
            let mut statement = conn.prepare(READ_CIRCUITS).map_err(sql_err)?;
            let rows = statement.query_map([], |r| Ok((r.get::<_, String>(0)?, r.get::<_, String>(1)?))).map_err(sql_err)?;
            let mut circuits = Vec::new();
            for row in rows {
                let (key, value) = row.map_err(sql_err)?;
                let lane = key.strip_prefix("lane#").and_then(|rest| rest.strip_suffix("#circuit")).map_or(Ok(LaneId::default_lane()), LaneId::parse);
                if let Ok(lane) = lane {
                    circuits.push((lane, value));
                }
            }
            Ok(circuits)
        })
    }

    /// The queue's and the jobs DLQ's depths by the lane each job names (`default` for
    /// a job that names none, or that does not parse), for `status` and `lanes`.
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn depth_by_lane(&self) -> PortResult<BTreeMap<LaneId, QueueDepth>> {
        self.on_db(|| {
            let now = to_i64(self.clock.now().0);
            let conn = self.conn();
            let lane_of = "COALESCE(CASE WHEN json_valid(body) THEN json_extract(body, '$.lane') END, 'default')";
            let mut depths: BTreeMap<LaneId, QueueDepth> = BTreeMap::new();
            let queries = [
                format!("SELECT {lane_of}, SUM(visible_at <= ?1), SUM(visible_at > ?1), 0 FROM messages GROUP BY 1"),
                format!("SELECT {lane_of}, 0, 0, COUNT(*) FROM dead_letters WHERE ?1 = ?1 GROUP BY 1"),
            ];
            for sql in &queries {
                let mut statement = conn.prepare(sql).map_err(sql_err)?;
                let rows = statement
                    .query_map([now], |r| Ok((r.get::<_, String>(0)?, r.get::<_, i64>(1)?, r.get::<_, i64>(2)?, r.get::<_, i64>(3)?)))
                    .map_err(sql_err)?;
                for row in rows {
                    let (lane, visible, not_visible, dead) = row.map_err(sql_err)?;
                    let depth = depths.entry(LaneId::parse(&lane).unwrap_or_default()).or_default();
                    depth.visible += to_u64(visible);
                    depth.not_visible += to_u64(not_visible);
                    depth.dead += to_u64(dead);
                }
            }
            Ok(depths)
        })
    }

    /// Deletes the failure buckets that ended [`FAILURE_BUCKET_TTL`] before `now` (what
    /// DynamoDB's TTL does for the AWS store).
    fn sweep_failure_buckets(&self, conn: &Connection, now: UnixMillis) -> PortResult<()> {
        // GLOB, not LIKE: a lane id may hold `_`, LIKE's wildcard, and never `*?[`.
        let keys: Vec<String> = conn
            .prepare("SELECT key FROM usage WHERE key GLOB ?1")
            .and_then(|mut statement| statement.query_map([self.key(&format!("{FAILURE_BUCKET_PREFIX}*"))], |row| row.get(0))?.collect())
            .map_err(sql_err)?;
        let horizon = now.minus(FAILURE_BUCKET_TTL);
        let ended = |key: &String| self.scope.name_of(key).and_then(failure_bucket_end).is_some_and(|end| end < horizon);
        for key in keys.iter().filter(|key| ended(key)) {
            conn.execute("DELETE FROM usage WHERE key = ?1", [key]).map_err(sql_err)?;
        }
        Ok(())
    }

    fn put_kv<T: serde::Serialize>(conn: &Connection, key: &str, value: &T) -> PortResult<()> {
        let text = serde_json::to_string(value).map_err(fatal)?;
        conn.execute("INSERT INTO kv (key, value) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET value = ?2", params![key, text]).map_err(sql_err)?;
        Ok(())
    }

    /// Receives up to `max` (at most 10) visible messages, hiding each for `visibility`:
    /// an ordered lane's retries first; then, as an SQS FIFO queue does, the first ones
    /// of each FIFO group (an ordered lane's jobs) none of whose messages is hidden, in
    /// their order; then the others, the longest visible first.
    fn try_receive(&self, max: usize, visibility: Duration) -> PortResult<Vec<QueuedMessage>> {
        self.on_db(|| {
            let received_at = self.clock.now();
            let now = to_i64(received_at.0);
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let max = max.min(10);
            let mut rows: Vec<MessageRow> = select_rows(&tx, "SELECT seq, message_id, body, attempt, enqueued_at, visible_at FROM messages INDEXED BY messages_ahead WHERE ahead = 1 AND visible_at <= ?1 ORDER BY visible_at, seq LIMIT ?2", params![now, to_i64(max as u64)])?;
            if self.ordering.is_some() {
                for group in fifo_groups(&tx)? {
                    let room = max.saturating_sub(rows.len());
                    if room == 0 {
                        break;
                    }
                    // Its hidden messages are among its first ten: a group is received
                    // only when none is hidden, ten at most, from its front.
                    let front = select_rows(&tx, "SELECT seq, message_id, body, attempt, enqueued_at, visible_at FROM messages INDEXED BY messages_group WHERE grp = ?1 ORDER BY seq LIMIT ?2", params![group, 10])?;
                    if front.iter().all(|row| row.visible_at <= now) {
                        rows.extend(front.into_iter().take(room));
                    }
                }
            }
            let room = max.saturating_sub(rows.len());
            if room > 0 {
                rows.extend(select_rows(&tx, "SELECT seq, message_id, body, attempt, enqueued_at, visible_at FROM messages INDEXED BY messages_visible WHERE grp IS NULL AND ahead = 0 AND visible_at <= ?1 ORDER BY visible_at, seq LIMIT ?2", params![now, to_i64(room as u64)])?);
            }
            let hidden_until = to_i64(received_at.plus(visibility).0);
            let mut received = Vec::with_capacity(rows.len());
            {
                let mut update = tx
                    .prepare_cached("UPDATE messages SET visible_at = ?1, receipt = ?2, receive_count = receive_count + 1 WHERE seq = ?3")
                    .map_err(sql_err)?;
                for row in rows {
                    let receipt = uuid::Uuid::new_v4().to_string();
                    update.execute(params![hidden_until, receipt, row.seq]).map_err(sql_err)?;
                    received.push(QueuedMessage {
                        message_id: row.message_id,
                        receipt,
                        body: row.body,
                        attempt: row.attempt,
                        enqueued_at: UnixMillis(to_u64(row.enqueued_at)),
                        group: None,
                    });
                }
            }
            tx.commit().map_err(sql_err)?;
            Ok(received)
        })
    }

    /// Every dead letter, oldest first.
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn dead_letters(&self) -> PortResult<Vec<DeadLetter>> {
        Ok(self.dead_letter_rows(0, i64::MAX)?.into_iter().map(|(_, dead)| dead).collect())
    }

    /// Up to `limit` dead letters after row `after`, with their row numbers.
    fn dead_letter_rows(&self, after: i64, limit: i64) -> PortResult<Vec<(i64, DeadLetter)>> {
        self.on_db(|| {
            let conn = self.conn();
            let mut select = conn
                .prepare("SELECT seq, message_id, body, attempt, reason, dead_at FROM dead_letters WHERE seq > ?1 ORDER BY seq LIMIT ?2")
                .map_err(sql_err)?;
            let rows = select
                .query_map(params![after, limit], |r| {
                    Ok((r.get::<_, i64>(0)?, r.get::<_, String>(1)?, r.get::<_, String>(2)?, r.get::<_, u32>(3)?, r.get::<_, String>(4)?, r.get::<_, i64>(5)?))
                })
                .map_err(sql_err)?;
            rows.map(|row| {
                let (seq, message_id, body, attempt, reason, dead_at) = row.map_err(sql_err)?;
                let reason: DeadLetterReason = serde_json::from_str(&reason).map_err(fatal)?;
                Ok((seq, DeadLetter { message_id, body, attempt, reason, dead_at: UnixMillis(to_u64(dead_at)) }))
            })
            .collect()
        })
    }

    /// The lease as recorded, whether or not it has expired.
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn recorded_lease(&self) -> PortResult<Option<Lease>> {
        self.get_kv("lease_holder")
    }

    /// Takes the lease whoever holds it. Only for a caller that knows no other process
    /// can (it holds the database's file lock, see [`lock_exclusive`]).
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn clear_lease(&self) -> PortResult<()> {
        self.on_db(|| {
            self.conn().execute("DELETE FROM kv WHERE key = 'lease_holder'", []).map_err(sql_err)?;
            Ok(())
        })
    }

    /// Deletes this scope's pacer snapshot (tests of a lost snapshot).
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    #[cfg(feature = "test-util")]
    pub fn forget_pacer(&self) -> PortResult<()> {
        self.on_db(|| {
            self.conn().execute("DELETE FROM kv WHERE key = ?1", [self.key("pacer")]).map_err(sql_err)?;
            Ok(())
        })
    }

    /// Records a hand-off and, in the same transaction, deletes the message it comes
    /// from: after a crash either the message is back on the queue (not handed off) or
    /// the invocation is re-queued, never both.
    fn record_invocation(&self, payload: &WorkerPayload, from_receipt: Option<&str>) -> PortResult<i64> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            tx.execute("INSERT INTO invocations (payload, created_at) VALUES (?1, ?2)", params![payload.to_json(), to_i64(self.clock.now().0)])
                .map_err(sql_err)?;
            let seq = tx.last_insert_rowid();
            if let Some(receipt) = from_receipt {
                tx.execute("DELETE FROM messages WHERE receipt = ?1", [receipt]).map_err(sql_err)?;
            }
            tx.commit().map_err(sql_err)?;
            Ok(seq)
        })
    }

    fn finish_invocation(&self, seq: i64) -> PortResult<()> {
        self.on_db(|| {
            self.conn().execute("DELETE FROM invocations WHERE seq = ?1", [seq]).map_err(sql_err)?;
            Ok(())
        })
    }

    /// Makes visible again every message a killed process had received but not deleted,
    /// puts back the jobs of invocations it left unfinished, and drops its claims on calls
    /// (their calls may have gone out: the re-queued jobs call again, at least once where
    /// the answer is unknown). Only for a caller that holds the file lock
    /// ([`lock_exclusive`]): no live process can own them.
    /// Returns (messages released, jobs re-queued).
    ///
    /// # Errors
    /// `Fatal` on a database failure.
    pub fn recover_after_crash(&self) -> PortResult<(usize, usize)> {
        self.on_db(|| {
            let now = to_i64(self.clock.now().0);
            let released = self
                .conn()
                .execute("UPDATE messages SET visible_at = ?1, receipt = NULL WHERE receipt IS NOT NULL AND visible_at > ?1", [now])
                .map_err(sql_err)?;
            // Every lane's claims: the default lane's `call#..`, another's `lane#ID#call#..`.
            self.conn()
                .execute("DELETE FROM kv WHERE (key GLOB 'call#*' OR key GLOB 'lane#*#call#*') AND json_extract(value, '$.state') = 'calling'", [])
                .map_err(sql_err)?;
            Ok((released, self.requeue_invocations(None)?))
        })
    }

    /// Puts the job of one invocation (or of all, with `None`) back on the queue, to be
    /// paced again, and forgets health checks. Returns how many jobs.
    fn requeue_invocations(&self, only: Option<i64>) -> PortResult<usize> {
        self.on_db(|| {
            let now = to_i64(self.clock.now().0);
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let payloads: Vec<String> = {
                let mut select = tx.prepare("SELECT payload FROM invocations WHERE ?1 IS NULL OR seq = ?1 ORDER BY seq").map_err(sql_err)?;
                let rows = select.query_map([only], |r| r.get(0)).map_err(sql_err)?;
                rows.collect::<Result<_, _>>().map_err(sql_err)?
            };
            let mut jobs = 0;
            for text in payloads {
                if let Ok(WorkerPayload::Job { job, attempt, .. }) = WorkerPayload::from_json(&text) {
                    // An ordered lane's job goes back first, and its lane waits for it.
                    let place = if job.ordered { Place::Ahead } else { self.place_of(&job.to_json()) };
                    insert_message(&tx, &job.to_json(), attempt, now, &place)?;
                    if job.ordered {
                        let mark = format!("{}{ORDER_MARK}", StoreScope::Lane(job.lane.clone()).prefix());
                        settle_order_in(&tx, &mark, job.id.as_str(), attempt, OrderState::Retrying { at: UnixMillis(to_u64(now)) })?;
                    }
                    jobs += 1;
                }
            }
            tx.execute("DELETE FROM invocations WHERE ?1 IS NULL OR seq = ?1", [only]).map_err(sql_err)?;
            tx.commit().map_err(sql_err)?;
            Ok(jobs)
        })
    }
}

/// A message as a receive reads it.
struct MessageRow {
    seq: i64,
    message_id: String,
    body: String,
    attempt: u32,
    enqueued_at: i64,
    visible_at: i64,
}

/// The messages `sql` selects (`seq, message_id, body, attempt, enqueued_at,
/// visible_at`).
fn select_rows(conn: &Connection, sql: &str, params: impl rusqlite::Params) -> PortResult<Vec<MessageRow>> {
    let mut select = conn.prepare_cached(sql).map_err(sql_err)?;
    let rows = select
        .query_map(params, |r| {
            Ok(MessageRow { seq: r.get(0)?, message_id: r.get(1)?, body: r.get(2)?, attempt: r.get(3)?, enqueued_at: r.get(4)?, visible_at: r.get(5)? })
        })
        .and_then(Iterator::collect)
        .map_err(sql_err)?;
    Ok(rows)
}

/// The FIFO groups with messages on the queue (one index seek each, not a read of their
/// messages).
fn fifo_groups(conn: &Connection) -> PortResult<Vec<String>> {
    let mut select = conn
        .prepare_cached(
            "WITH RECURSIVE groups(grp) AS (SELECT (SELECT MIN(grp) FROM messages WHERE grp IS NOT NULL) \
             UNION ALL SELECT (SELECT MIN(grp) FROM messages WHERE grp > groups.grp) FROM groups WHERE groups.grp IS NOT NULL) \
             SELECT grp FROM groups WHERE grp IS NOT NULL",
        )
        .map_err(sql_err)?;
    let groups = select.query_map([], |r| r.get(0)).and_then(Iterator::collect).map_err(sql_err)?;
    Ok(groups)
}

/// Where a message goes in the queue: ahead of the others (an ordered lane's retry), in
/// its ordered lane's FIFO group, or neither.
#[derive(Clone, Debug, PartialEq, Eq)]
enum Place {
    Ahead,
    Group(String),
    Unordered,
}

fn insert_message(conn: &Connection, body: &str, attempt: u32, visible_at: i64, place: &Place) -> PortResult<()> {
    let (ahead, group) = match place {
        Place::Ahead => (true, None),
        Place::Group(lane) => (false, Some(lane.as_str())),
        Place::Unordered => (false, None),
    };
    conn.prepare_cached("INSERT INTO messages (message_id, body, attempt, visible_at, enqueued_at, ahead, grp) VALUES (?1, ?2, ?3, ?4, ?4, ?5, ?6)")
        .and_then(|mut insert| insert.execute(params![uuid::Uuid::new_v4().to_string(), body, attempt, visible_at, ahead, group]))
        .map_err(sql_err)?;
    Ok(())
}

/// Sets the state of the order mark at `key` if it is still that of job `job_id`'s
/// `attempt` (see `StateStore::settle_order`); whether it did.
fn settle_order_in(conn: &Connection, key: &str, job_id: &str, attempt: u32, state: OrderState) -> PortResult<bool> {
    let Some(mut mark) = EmbeddedStore::read_kv::<OrderMark>(conn, key)? else {
        return Ok(false);
    };
    if !mark.names(job_id, attempt) {
        return Ok(false);
    }
    mark.state = state;
    EmbeddedStore::put_kv(conn, key, &mark)?;
    Ok(true)
}

/// Before schema 4: a file with a jobs queue gets the `ahead` and `grp` columns (every
/// message in it was sent unordered), and its index of visible messages is made anew
/// for the unordered ones.
fn before_schema_4(conn: &Connection) -> rusqlite::Result<()> {
    let columns: Vec<String> = conn.prepare("SELECT name FROM pragma_table_info('messages')")?.query_map([], |row| row.get(0))?.collect::<Result<_, _>>()?;
    if !columns.is_empty() && !columns.iter().any(|column| column == "ahead") {
        conn.execute_batch("ALTER TABLE messages ADD COLUMN ahead INTEGER NOT NULL DEFAULT 0; ALTER TABLE messages ADD COLUMN grp TEXT; DROP INDEX IF EXISTS messages_visible;")?;
    }
    Ok(())
}

/// Refuses a database file with more than one hard link: SQLite names the WAL and the
/// lock after the path, so each name would get its own (SQLite's documented way to
/// corrupt a database) and two runs could share one lane.
fn refuse_extra_links(path: &Path) -> PortResult<()> {
    use std::os::unix::fs::MetadataExt;
    match std::fs::metadata(path) {
        Ok(meta) if meta.nlink() > 1 => Err(fatal(format!(
            "{} has {} hard links: each name would get its own WAL and lock, and two runs could share the lane; \
             keep one name (find the others with `find / -samefile {}`) and remove the rest",
            path.display(),
            meta.nlink(),
            path.display()
        ))),
        _ => Ok(()),
    }
}

/// The tables Paceline's first schema (`user_version` 0) has.
const SCHEMA_1_TABLES: [&str; 7] = ["messages", "dead_letters", "kv", "usage", "call_slots", "invocations", "sqlite_sequence"];

/// Refuses a non-empty file of another application before anything is written to it
/// (the schema, the switch to WAL): one without a version holding tables other than
/// Paceline's first schema's, or a `messages` table that is not Paceline's.
fn refuse_foreign_schema(conn: &Connection) -> Result<(), String> {
    let version: u32 = conn.query_row("PRAGMA user_version", [], |r| r.get(0)).map_err(|e| format!("cannot be read: {e}"))?;
    if version > 0 {
        return Ok(());
    }
    let mut tables = conn.prepare("SELECT name FROM sqlite_master WHERE type = 'table' ORDER BY name").map_err(|e| e.to_string())?;
    let tables: Vec<String> = tables.query_map([], |r| r.get(0)).map_err(|e| e.to_string())?.collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let mut columns = conn.prepare("SELECT name FROM pragma_table_info('messages')").map_err(|e| e.to_string())?;
    let columns: Vec<String> = columns.query_map([], |r| r.get(0)).map_err(|e| e.to_string())?.collect::<Result<_, _>>().map_err(|e| e.to_string())?;
    let paceline_messages = ["message_id", "body", "attempt", "visible_at", "receipt"].iter().all(|c| columns.iter().any(|have| have == c));
    let foreign: Vec<&str> = tables.iter().map(String::as_str).filter(|t| !SCHEMA_1_TABLES.contains(t)).collect();
    if tables.is_empty() || (foreign.is_empty() && paceline_messages) {
        return Ok(());
    }
    Err(format!(
        "is not a Paceline database (it holds {}); it was left unchanged: point [backend] path at a new file",
        if foreign.is_empty() { "a `messages` table of another shape".to_owned() } else { format!("tables {}", foreign.join(", ")) }
    ))
}

/// The database's real path: symlinks and `..` resolved, so that two spellings of one
/// file are one lane. A file not created yet is named under its folder's real path.
///
/// # Errors
/// `Fatal` when neither the file nor its folder can be resolved.
pub fn canonical_db_path(db_path: &Path) -> PortResult<std::path::PathBuf> {
    if let Ok(real) = std::fs::canonicalize(db_path) {
        return Ok(real);
    }
    let dir = db_path.parent().filter(|d| !d.as_os_str().is_empty()).unwrap_or(Path::new("."));
    let name = db_path.file_name().ok_or_else(|| fatal(format!("{} names no file", db_path.display())))?;
    let real_dir = std::fs::canonicalize(dir).map_err(|e| fatal(format!("cannot resolve {}: {e}", dir.display())))?;
    Ok(real_dir.join(name))
}

/// Takes an exclusive lock on a file beside the database (its real path, however it
/// is spelled, with `.lock` added: `lane.db.lock`), held as long as the returned handle lives: proof that no other
/// `paceline run` uses it. The OS drops the lock when the process dies, however it dies.
///
/// # Errors
/// `Conflict` when another process holds it; `Fatal` when the file cannot be opened.
pub fn lock_exclusive(db_path: &Path) -> PortResult<std::fs::File> {
    refuse_extra_links(db_path)?;
    let mut lock_path = canonical_db_path(db_path)?.into_os_string();
    lock_path.push(".lock");
    let lock_path = std::path::PathBuf::from(lock_path);
    let file = std::fs::OpenOptions::new()
        .create(true)
        .truncate(false)
        .write(true)
        .open(&lock_path)
        .map_err(|e| fatal(format!("cannot open {}: {e}", lock_path.display())))?;
    match file.try_lock() {
        Ok(()) => Ok(file),
        Err(std::fs::TryLockError::WouldBlock) => {
            Err(PortError::Conflict(format!("another paceline run is using {} (lock file {})", db_path.display(), lock_path.display())))
        }
        Err(std::fs::TryLockError::Error(e)) => Err(fatal(format!("cannot lock {}: {e}", lock_path.display()))),
    }
}

#[async_trait]
impl JobQueue for EmbeddedStore {
    async fn receive(&self, max: usize, wait: Duration, visibility: Duration) -> PortResult<Vec<QueuedMessage>> {
        let until = self.clock.now().plus(wait);
        loop {
            let received = self.try_receive(max, visibility)?;
            let now = self.clock.now();
            if !received.is_empty() || now >= until {
                return Ok(received);
            }
            self.clock.sleep_until(now.plus(POLL_STEP).min(until)).await;
        }
    }

    async fn delete(&self, receipts: &[String]) -> PortResult<()> {
        self.on_db(|| {
            let conn = self.conn();
            let mut delete = conn.prepare_cached("DELETE FROM messages WHERE receipt = ?1").map_err(sql_err)?;
            for receipt in receipts {
                delete.execute([receipt]).map_err(sql_err)?;
            }
            Ok(())
        })
    }

    async fn release(&self, messages: &[VisibleAgain]) -> PortResult<()> {
        self.on_db(|| {
            let now = self.clock.now();
            let conn = self.conn();
            // The receipt stays good until the message is received again, as an SQS
            // receipt handle does: a later release may bring it back sooner.
            let mut release = conn.prepare_cached("UPDATE messages SET visible_at = ?1 WHERE receipt = ?2").map_err(sql_err)?;
            for message in messages {
                release.execute(params![to_i64(now.plus(message.after).0), message.receipt]).map_err(sql_err)?;
            }
            Ok(())
        })
    }

    /// A few hundred messages in one transaction: a producer's batch goes in at a fraction
    /// of the cost of many small ones, and holds the store (which a run in the same
    /// process shares) for about a millisecond at a time.
    fn most_per_send(&self) -> usize {
        100
    }

    async fn send(&self, messages: &[OutgoingMessage]) -> PortResult<()> {
        self.on_db(|| {
            let now = self.clock.now();
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            for m in messages {
                let place = if m.ahead { Place::Ahead } else { self.place_of(&m.body) };
                insert_message(&tx, &m.body, m.attempt, to_i64(now.plus(m.delay).0), &place)?;
            }
            tx.commit().map_err(sql_err)
        })
    }

    async fn dead_letter(&self, message_id: &str, body: &str, attempt: u32, reason: &DeadLetterReason) -> PortResult<()> {
        self.on_db(|| {
            let reason = serde_json::to_string(reason).map_err(fatal)?;
            self.conn()
                .execute(
                    "INSERT INTO dead_letters (message_id, body, attempt, reason, dead_at) VALUES (?1, ?2, ?3, ?4, ?5)",
                    params![message_id, body, attempt, reason, to_i64(self.clock.now().0)],
                )
                .map_err(sql_err)?;
            Ok(())
        })
    }

    async fn depth(&self) -> PortResult<QueueDepth> {
        self.on_db(|| {
            let now = to_i64(self.clock.now().0);
            let conn = self.conn();
            let count = |sql: &str, p: &[&dyn rusqlite::ToSql]| conn.query_row(sql, p, |r| r.get::<_, i64>(0)).map(to_u64).map_err(sql_err);
            Ok(QueueDepth {
                visible: count("SELECT COUNT(*) FROM messages WHERE visible_at <= ?1", &[&now])?,
                not_visible: count("SELECT COUNT(*) FROM messages WHERE visible_at > ?1", &[&now])? + count("SELECT COUNT(*) FROM invocations", &[])?,
                dead: count("SELECT COUNT(*) FROM dead_letters", &[])?,
            })
        })
    }
}

/// In one process, a worker that fails is retried by the embedded invoker: there is no
/// worker DLQ, only the jobs DLQ.
fn only_jobs_dlq(source: DlqSource) -> PortResult<()> {
    match source {
        DlqSource::Jobs => Ok(()),
        DlqSource::Worker => Err(PortError::Fatal("the embedded store has no worker DLQ (in one process a failed worker run is re-queued)".into())),
    }
}

fn row_number(handle: &str) -> PortResult<i64> {
    handle.parse().map_err(|_| PortError::Fatal(format!("`{handle}` is not a dead-letter row number")))
}

fn row_numbers(handles: &[String]) -> PortResult<Vec<i64>> {
    handles.iter().map(|h| row_number(h)).collect()
}

#[async_trait]
impl DeadLetterQueues for EmbeddedStore {
    fn sources(&self) -> Vec<DlqSource> {
        vec![DlqSource::Jobs]
    }

    async fn page(&self, source: DlqSource, after: Option<&str>, max: usize, _hold: Duration) -> PortResult<Vec<DeadLetterRecord>> {
        only_jobs_dlq(source)?;
        let after = after.map(row_number).transpose()?.unwrap_or(0);
        let rows = self.dead_letter_rows(after, i64::try_from(max).unwrap_or(i64::MAX))?;
        Ok(rows
            .into_iter()
            // The row number names a dead letter: the same job may be dead-lettered twice.
            .map(|(seq, d)| {
                jobs_record(seq.to_string(), format!("dead-{seq}"), d.body, d.attempt, d.reason.cause.label(), d.reason.detail, d.dead_at)
                    .with_outcome(d.reason.outcome.map(|outcome| *outcome))
            })
            .collect())
    }

    async fn unhide(&self, source: DlqSource, _handles: &[String]) -> PortResult<()> {
        only_jobs_dlq(source)
    }

    async fn remove(&self, source: DlqSource, handles: &[String]) -> PortResult<()> {
        self.on_db(|| {
            only_jobs_dlq(source)?;
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            for seq in row_numbers(handles)? {
                tx.execute("DELETE FROM dead_letters WHERE seq = ?1", [seq]).map_err(sql_err)?;
            }
            tx.commit().map_err(sql_err)
        })
    }

    async fn count(&self, source: DlqSource) -> PortResult<u64> {
        only_jobs_dlq(source)?;
        Ok(self.depth().await?.dead)
    }

    /// Exactly once: the copies are enqueued and the dead letters removed in one
    /// transaction.
    async fn redrive(&self, records: &[DeadLetterRecord], keep_attempts: bool) -> PortResult<()> {
        self.on_db(|| {
            let messages = redrive_messages(records, keep_attempts)?;
            for r in records {
                only_jobs_dlq(r.source)?;
            }
            let handles: Vec<String> = records.iter().map(|r| r.handle.clone()).collect();
            let now = to_i64(self.clock.now().0);
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            for (m, seq) in messages.iter().zip(row_numbers(&handles)?) {
                // A record another operator redrove or purged meanwhile is not sent twice.
                if tx.execute("DELETE FROM dead_letters WHERE seq = ?1", [seq]).map_err(sql_err)? == 1 {
                    insert_message(&tx, &m.body, m.attempt, now, &self.place_of(&m.body))?;
                }
            }
            tx.commit().map_err(sql_err)
        })
    }
}

#[async_trait]
impl StateStore for EmbeddedStore {
    // Each lease operation reads and writes in one transaction, under the one connection
    // lock: no other call sees or changes the lease between its check and its write.
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            if let Some(current) = Self::read_kv::<Lease>(&tx, "lease_holder")?.filter(|lease| lease.expires_at > now) {
                return Err(PortError::Conflict(format!("lease held by {} until {}", current.holder, current.expires_at)));
            }
            let epoch = Self::read_kv::<u64>(&tx, "lease_epoch")?.unwrap_or(0) + 1;
            let lease = Lease { holder: holder.to_owned(), epoch, expires_at: now.plus(ttl) };
            Self::put_kv(&tx, "lease_holder", &lease)?;
            Self::put_kv(&tx, "lease_epoch", &epoch)?;
            tx.commit().map_err(sql_err)?;
            Ok(lease)
        })
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            match Self::read_kv::<Lease>(&tx, "lease_holder")? {
                Some(current) if current.epoch == lease.epoch && current.holder == lease.holder => {
                    let renewed = Lease { expires_at: now.plus(ttl), ..current };
                    Self::put_kv(&tx, "lease_holder", &renewed)?;
                    tx.commit().map_err(sql_err)?;
                    Ok(renewed)
                }
                _ => Err(PortError::Conflict(format!("lease epoch {} was lost", lease.epoch))),
            }
        })
    }

    async fn release_lease(&self, lease: &Lease) -> PortResult<()> {
        self.on_db(|| {
            let conn = self.conn();
            if Self::read_kv::<Lease>(&conn, "lease_holder")?.is_some_and(|c| c.epoch == lease.epoch) {
                conn.execute("DELETE FROM kv WHERE key = 'lease_holder'", []).map_err(sql_err)?;
            }
            Ok(())
        })
    }

    async fn lease(&self) -> PortResult<Option<Lease>> {
        self.recorded_lease()
    }

    async fn load_usage(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        self.on_db(|| {
            let conn = self.conn();
            keys.iter()
                .map(|k| {
                    conn.query_row("SELECT used FROM usage WHERE key = ?1", [self.key(k)], |r| r.get::<_, i64>(0))
                        .optional()
                        .map(|v| v.map_or(0, to_u64))
                        .map_err(sql_err)
                })
                .collect()
        })
    }

    async fn add_usage(&self, deltas: &[(String, i64)]) -> PortResult<()> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            for (key, delta) in deltas {
                tx.execute("INSERT INTO usage (key, used) VALUES (?1, ?2) ON CONFLICT(key) DO UPDATE SET used = used + ?2", params![self.key(key), delta])
                    .map_err(sql_err)?;
            }
            if deltas.iter().any(|(key, _)| key.starts_with(FAILURE_BUCKET_PREFIX)) {
                self.sweep_failure_buckets(&tx, self.clock.now())?;
            }
            tx.commit().map_err(sql_err)
        })
    }

    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>> {
        self.get_kv(&self.key("pacer"))
    }

    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        self.on_db(|| {
            let conn = self.conn();
            let current: Option<Lease> = Self::read_kv(&conn, "lease_holder")?;
            if current.is_none_or(|c| c.epoch != lease.epoch || c.holder != lease.holder) {
                return Err(PortError::Conflict(format!("lease epoch {} was lost", lease.epoch)));
            }
            Self::put_kv(&conn, &self.key("pacer"), snapshot)
        })
    }

    async fn circuit(&self) -> PortResult<Circuit> {
        Ok(self.get_kv(&self.key("circuit"))?.unwrap_or_default())
    }

    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let stored: Option<String> =
                tx.query_row("SELECT value FROM kv WHERE key = ?1", [self.key("circuit")], |r| r.get(0)).optional().map_err(sql_err)?;
            let current: Circuit = stored.and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
            if current.epoch != expected_epoch {
                return Err(PortError::Conflict(format!("circuit is at epoch {}, not {expected_epoch}", current.epoch)));
            }
            Self::put_kv(&tx, &self.key("circuit"), next)?;
            tx.commit().map_err(sql_err)
        })
    }

    async fn cool_down(&self) -> PortResult<UnixMillis> {
        Ok(self.get_kv(&self.key("cool_down"))?.unwrap_or_default())
    }

    async fn extend_cool_down(&self, until: UnixMillis) -> PortResult<()> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let stored: Option<String> =
                tx.query_row("SELECT value FROM kv WHERE key = ?1", [self.key("cool_down")], |r| r.get(0)).optional().map_err(sql_err)?;
            let current: UnixMillis = stored.and_then(|t| serde_json::from_str(&t).ok()).unwrap_or_default();
            Self::put_kv(&tx, &self.key("cool_down"), &current.max(until))?;
            tx.commit().map_err(sql_err)
        })
    }

    async fn clear_cool_down(&self) -> PortResult<()> {
        self.on_db(|| {
            self.conn().execute("DELETE FROM kv WHERE key IN (?1, ?2)", [self.key("cool_down"), self.key("provider_reading")]).map_err(sql_err)?;
            Ok(())
        })
    }

    async fn provider_reading(&self) -> PortResult<Option<ProviderReading>> {
        self.get_kv(&self.key("provider_reading"))
    }

    async fn record_provider_reading(&self, reading: &ProviderReading) -> PortResult<()> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let stored: Option<String> =
                tx.query_row("SELECT value FROM kv WHERE key = ?1", [self.key("provider_reading")], |r| r.get(0)).optional().map_err(sql_err)?;
            let current: Option<ProviderReading> = stored.and_then(|t| serde_json::from_str(&t).ok());
            if current.is_none_or(|current| current.at < reading.at) {
                Self::put_kv(&tx, &self.key("provider_reading"), reading)?;
            }
            tx.commit().map_err(sql_err)
        })
    }

    async fn claim_call(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<CallClaim> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let key = self.key(key);
            let stored: Option<String> = tx.query_row("SELECT value FROM kv WHERE key = ?1", [&key], |r| r.get(0)).optional().map_err(sql_err)?;
            let current: Option<CallRecord> = stored.and_then(|t| serde_json::from_str(&t).ok());
            match current {
                Some(record) if record.state == CallClaim::Done => return Ok(CallClaim::Done),
                Some(record) if record.expires_at > now && record.holder == holder => return Ok(CallClaim::ClaimedBefore),
                Some(record) if record.expires_at > now => return Ok(CallClaim::Calling),
                _ => {}
            }
            Self::put_kv(&tx, &key, &CallRecord { state: CallClaim::Calling, holder: holder.to_owned(), expires_at })?;
            tx.commit().map_err(sql_err)?;
            Ok(CallClaim::Taken)
        })
    }

    async fn finish_call(&self, key: &str, keep_until: UnixMillis) -> PortResult<()> {
        self.on_db(|| {
            let conn = self.conn();
            let now = self.clock.now();
            // Done records past their keep are swept as new ones come (DynamoDB's TTL on AWS).
            conn.execute(SWEEP_DONE_CALLS, params![to_i64(now.0), self.key("call#*")]).map_err(sql_err)?;
            Self::put_kv(&conn, &self.key(key), &CallRecord { state: CallClaim::Done, holder: String::new(), expires_at: keep_until })
        })
    }

    async fn claim_batch(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<BatchClaim> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let key = self.key(key);
            let before = match Self::read_kv::<BatchRecord>(&tx, &key)? {
                Some(record) if record.done => return Ok(BatchClaim::Done),
                Some(record) if record.expires_at > now => return Ok(BatchClaim::Running),
                Some(record) => BatchProgress::from_bits(&record.settled, false),
                None => None,
            };
            let settled = before.as_ref().map(BatchProgress::settled_bits).unwrap_or_default();
            Self::put_kv(&tx, &key, &BatchRecord { holder: holder.to_owned(), expires_at, settled, done: false })?;
            tx.commit().map_err(sql_err)?;
            Ok(BatchClaim::Taken { before })
        })
    }

    async fn save_batch(&self, key: &str, holder: &str, progress: &BatchProgress, expires_at: UnixMillis) -> PortResult<()> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let key = self.key(key);
            if Self::read_kv::<BatchRecord>(&tx, &key)?.is_none_or(|record| record.holder != holder) {
                return Err(PortError::Conflict(format!("batch {key} is held by another delivery")));
            }
            let record = BatchRecord { holder: holder.to_owned(), expires_at, settled: progress.settled_bits(), done: progress.done };
            Self::put_kv(&tx, &key, &record)?;
            tx.commit().map_err(sql_err)
        })
    }

    async fn release_call(&self, key: &str, holder: &str) -> PortResult<()> {
        self.on_db(|| {
            let conn = self.conn();
            conn.execute(
                "DELETE FROM kv WHERE key = ?1 AND json_extract(value, '$.holder') = ?2 AND json_extract(value, '$.state') = 'calling'",
                params![self.key(key), holder],
            )
            .map_err(sql_err)?;
            Ok(())
        })
    }

    async fn forget_call(&self, key: &str) -> PortResult<()> {
        self.on_db(|| {
            self.conn().execute("DELETE FROM kv WHERE key = ?1 AND key GLOB ?2", [self.key(key), self.key("call#*")]).map_err(sql_err)?;
            Ok(())
        })
    }

    async fn take_call_slot(&self, capacity: u32, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<Option<u32>> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let taken: Vec<u32> = tx
                .prepare("SELECT idx FROM call_slots WHERE scope = ?3 AND idx < ?1 AND holder IS NOT NULL AND expires_at > ?2")
                .and_then(|mut statement| statement.query_map(params![capacity, to_i64(now.0), self.prefix], |row| row.get(0))?.collect())
                .map_err(sql_err)?;
            let Some(free) = (0..capacity).find(|index| !taken.contains(index)) else { return Ok(None) };
            tx.execute(
                "INSERT OR REPLACE INTO call_slots (scope, idx, holder, expires_at) VALUES (?4, ?1, ?2, ?3)",
                params![free, holder, to_i64(expires_at.0), self.prefix],
            )
            .map_err(sql_err)?;
            tx.commit().map_err(sql_err)?;
            Ok(Some(free))
        })
    }

    async fn release_call_slot(&self, index: u32, holder: &str) -> PortResult<()> {
        self.on_db(|| {
            self.conn()
                .execute(
                    "UPDATE call_slots SET holder = NULL, expires_at = 0 WHERE scope = ?3 AND idx = ?1 AND holder = ?2",
                    params![index, holder, self.prefix],
                )
                .map_err(sql_err)?;
            Ok(())
        })
    }

    async fn call_slots_in_use(&self, capacity: u32, now: UnixMillis) -> PortResult<u32> {
        self.on_db(|| {
            self.conn()
                .query_row(
                    "SELECT COUNT(*) FROM call_slots WHERE scope = ?3 AND idx < ?1 AND holder IS NOT NULL AND expires_at > ?2",
                    params![capacity, to_i64(now.0), self.prefix],
                    |row| row.get(0),
                )
                .map_err(sql_err)
        })
    }

    async fn lane_change(&self) -> PortResult<Option<LaneChange>> {
        self.get_kv(&self.key(LANE_CHANGE))
    }

    async fn set_lane_change(&self, change: Option<&LaneChange>) -> PortResult<()> {
        self.on_db(|| {
            let conn = self.conn();
            match change {
                Some(change) => Self::put_kv(&conn, &self.key(LANE_CHANGE), change),
                None => conn.execute("DELETE FROM kv WHERE key = ?1", [self.key(LANE_CHANGE)]).map(drop).map_err(sql_err),
            }
        })
    }

    async fn order_mark(&self) -> PortResult<Option<OrderMark>> {
        self.get_kv(&self.key(ORDER_MARK))
    }

    async fn open_order(&self, mark: &OrderMark) -> PortResult<()> {
        self.on_db(|| Self::put_kv(&self.conn(), &self.key(ORDER_MARK), mark))
    }

    async fn settle_order(&self, job_id: &str, attempt: u32, state: OrderState) -> PortResult<bool> {
        self.on_db(|| {
            let mut conn = self.conn();
            let tx = conn.transaction().map_err(sql_err)?;
            let settled = settle_order_in(&tx, &self.key(ORDER_MARK), job_id, attempt, state)?;
            tx.commit().map_err(sql_err)?;
            Ok(settled)
        })
    }

    async fn lanes_with_state(&self) -> PortResult<Vec<LaneId>> {
        self.on_db(|| {
            // `lane#ID#...`: the id is up to the second `#` (no lane id holds one).
            let ids: Vec<String> = self
                .conn()
                .prepare("SELECT DISTINCT substr(key, 6, instr(substr(key, 6), '#') - 1) FROM kv WHERE key GLOB 'lane#*#*' ORDER BY 1")
                .and_then(|mut statement| statement.query_map([], |row| row.get(0))?.collect())
                .map_err(sql_err)?;
            Ok(ids.iter().filter_map(|id| LaneId::parse(id).ok()).collect())
        })
    }
}

/// The embedded store keeps every scope's state in its one database.
impl ScopedStores for EmbeddedStore {
    fn scoped(&self, scope: &StoreScope) -> Arc<dyn StateStore> {
        Arc::new(EmbeddedStore::scoped(self, scope))
    }
}

/// Runs workers in this process. Each hand-off is first written to the database (like
/// Lambda's async event queue), so a killed process loses nothing: on restart,
/// [`EmbeddedStore::recover_after_crash`] re-queues what had not finished.
pub struct EmbeddedInvoker {
    store: Arc<EmbeddedStore>,
    handler: Arc<dyn WorkerHandler>,
    in_flight: Arc<AtomicUsize>,
}

impl EmbeddedInvoker {
    #[must_use]
    pub fn new(store: Arc<EmbeddedStore>, handler: Arc<dyn WorkerHandler>) -> Self {
        Self { store, handler, in_flight: Arc::new(AtomicUsize::new(0)) }
    }
}

#[async_trait]
impl Invoker for EmbeddedInvoker {
    async fn invoke(&self, payload: &WorkerPayload, from_receipt: Option<&str>) -> PortResult<()> {
        let seq = self.store.record_invocation(payload, from_receipt)?;
        self.in_flight.fetch_add(1, Ordering::SeqCst);
        let (store, handler, in_flight, payload) = (self.store.clone(), self.handler.clone(), self.in_flight.clone(), payload.clone());
        tokio::spawn(async move {
            let handled = handler.handle(payload).await;
            if let Err(e) = &handled {
                tracing::warn!(error = %e, "worker could not finish; its job goes back on the queue");
            }
            // Settled it must be: a hand-off left recorded counts as in flight (a drain
            // would wait for it for ever) and runs again at the next start. A busy store
            // (another process holding the lock) is waited out.
            let settle = || {
                std::future::ready(match &handled {
                    Ok(_) => store.finish_invocation(seq),
                    Err(_) => store.requeue_invocations(Some(seq)).map(|_| ()),
                })
            };
            if let Err(e) = retry::while_busy(store.clock.as_ref(), None, "could not settle an invocation", settle).await {
                tracing::error!(error = %e, "could not settle an invocation; it will be re-queued on restart");
            }
            in_flight.fetch_sub(1, Ordering::SeqCst);
        });
        Ok(())
    }

    fn in_flight(&self) -> usize {
        self.in_flight.load(Ordering::SeqCst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::job::{DeadLetterCause, Job};
    use crate::order::JobOrder;
    use crate::time::ManualClock;

    fn store() -> (Arc<ManualClock>, EmbeddedStore) {
        let clock = Arc::new(ManualClock::new(UnixMillis(1_000_000)));
        let store = EmbeddedStore::in_memory(clock.clone()).unwrap();
        (clock, store)
    }

    /// Every call's record is kept a day, and each call's "done" swept the expired ones
    /// by reading every record kept: at 100 calls/s a lane's CPU grew by a tenth of a
    /// core a minute (serve's benchmark saw 15.8% become 30.5% in a minute), and within
    /// hours each call read millions of records.
    #[tokio::test]
    async fn the_sweep_of_done_call_records_reads_only_the_expired_ones_not_every_record_kept() {
        let (clock, store) = store();
        let keep = |ms: u64| clock.now().plus(Duration::from_millis(ms));
        store.finish_call("call#old#0", keep(10)).await.unwrap();
        store.finish_call("call#new#0", keep(60_000)).await.unwrap();
        let plan: Vec<String> = {
            let conn = store.conn();
            let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {SWEEP_DONE_CALLS}")).unwrap();
            explain.query_map(params![0, "call#*"], |row| row.get::<_, String>(3)).unwrap().map(Result::unwrap).collect()
        };
        assert!(plan.iter().any(|step| step.contains("USING INDEX kv_done_calls")), "the sweep reads every record: {plan:?}");
        clock.advance(Duration::from_millis(20));
        store.finish_call("call#next#0", keep(60_000)).await.unwrap();
        let left: Vec<String> = {
            let conn = store.conn();
            let mut keys = conn.prepare("SELECT key FROM kv WHERE key GLOB 'call#*' ORDER BY key").unwrap();
            keys.query_map([], |row| row.get(0)).unwrap().map(Result::unwrap).collect()
        };
        assert_eq!(left, vec!["call#new#0", "call#next#0"], "the expired record is swept, the others kept");
    }

    /// A stack of lanes keeps each lane's call records under `lane#ID#`, beside its
    /// circuit: reading the circuits (a run's watcher, every 100 ms) read every call
    /// record of every lane, kept a day: 45 ms at 300,000 records.
    #[tokio::test]
    async fn reading_the_circuits_of_a_stack_of_lanes_reads_no_call_record() {
        let (_, store) = store();
        let acme = store.scoped(&StoreScope::Lane("acme".parse().unwrap()));
        acme.finish_call("call#a#0", UnixMillis(u64::MAX / 2)).await.unwrap();
        acme.swap_circuit(0, &Circuit::default().open(0, "test", UnixMillis(1)).unwrap()).await.unwrap();
        let plan: Vec<String> = {
            let conn = store.conn();
            let mut explain = conn.prepare(&format!("EXPLAIN QUERY PLAN {READ_CIRCUITS}")).unwrap();
            explain.query_map([], |row| row.get::<_, String>(3)).unwrap().map(Result::unwrap).collect()
        };
        assert!(plan.iter().all(|step| step.contains("USING INDEX kv_circuits")), "reads the call records: {plan:?}");
        let lanes: Vec<String> = store.circuits_as_stored().unwrap().into_iter().map(|(lane, _)| lane.to_string()).collect();
        assert_eq!(lanes, vec!["acme"]);
    }

    /// SQLite checkpointed a run's WAL inside whichever commit grew it past 1,000 pages,
    /// holding the store, and the run's hand-offs and calls behind it, for the copy and
    /// its fsync: pacing went 2 to 5 ms late while jobs were enqueued in bulk.
    #[tokio::test(flavor = "multi_thread")]
    async fn a_runs_store_moves_its_wal_into_the_database_on_a_thread_of_its_own() {
        let dir = std::env::temp_dir().join(format!("paceline-checkpoints-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("lane.db");
        let store = EmbeddedStore::open(&path, Arc::new(crate::time::SystemClock)).unwrap().with_background_checkpoints().unwrap();
        let in_commits: i64 = store.conn().query_row("PRAGMA wal_autocheckpoint", [], |r| r.get(0)).unwrap();
        assert_eq!(in_commits, 0, "commits still checkpoint");
        let body = "x".repeat(2_000);
        for _ in 0..30 {
            let batch: Vec<OutgoingMessage> = (0..100).map(|_| msg(&body, 0)).collect();
            store.send(&batch).await.unwrap();
        }
        let in_the_database = || std::fs::metadata(&path).map_or(0, |m| m.len());
        for _ in 0..50 {
            if in_the_database() > 4 << 20 {
                break;
            }
            std::thread::sleep(Duration::from_millis(100));
        }
        assert!(in_the_database() > 4 << 20, "the WAL was not moved into the database: {} bytes", in_the_database());
        drop(store);
        std::fs::remove_dir_all(dir).unwrap();
    }

    fn msg(body: &str, attempt: u32) -> OutgoingMessage {
        OutgoingMessage::again(body, attempt, Duration::ZERO)
    }

    #[tokio::test]
    async fn received_messages_hide_until_released_deleted_or_timed_out() {
        let (clock, q) = store();
        q.send(&[msg("a", 0), msg("b", 2), msg("c", 0)]).await.unwrap();
        let got = q.receive(2, Duration::ZERO, Duration::from_secs(30)).await.unwrap();
        assert_eq!(got.iter().map(|m| (m.body.as_str(), m.attempt)).collect::<Vec<_>>(), vec![("a", 0), ("b", 2)]);
        assert_eq!(q.depth().await.unwrap(), QueueDepth { visible: 1, not_visible: 2, dead: 0 });
        q.delete(&[got[0].receipt.clone()]).await.unwrap();
        q.release(&VisibleAgain::all([got[1].receipt.clone()], Duration::ZERO)).await.unwrap();
        let again = q.receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap();
        assert_eq!(again.iter().map(|m| m.body.as_str()).collect::<Vec<_>>(), vec!["b", "c"]);
        clock.advance(Duration::from_secs(31));
        assert_eq!(q.receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap().len(), 2);
    }

    #[tokio::test]
    async fn delayed_messages_wait_and_long_polling_finds_them() {
        let (clock, q) = store();
        q.send(&[OutgoingMessage::again("later", 1, Duration::from_secs(2))]).await.unwrap();
        assert!(q.receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap().is_empty());
        let got = q.receive(10, Duration::from_secs(5), Duration::from_secs(30)).await.unwrap();
        assert_eq!(got[0].body, "later");
        assert!(clock.now() >= UnixMillis(1_002_000));
    }

    fn lane_job(lane: &str, id: &str) -> String {
        format!(r#"{{"id":"{id}","lane":"{lane}","request":{{"method":"GET","path":"/"}}}}"#)
    }

    fn ids(received: &[QueuedMessage]) -> Vec<String> {
        received.iter().map(|m| Job::parse(&m.body).unwrap().id.to_string()).collect()
    }

    #[tokio::test]
    async fn an_ordered_lane_s_jobs_come_as_from_an_sqs_fifo_group_and_its_retries_come_first() {
        let (clock, q) = store();
        let q = q.with_ordering(LaneOrdering { default: JobOrder::None, named: [(LaneId::parse("a").unwrap(), JobOrder::Fifo)].into() });
        let ordered: Vec<OutgoingMessage> = (1..=15).map(|n| msg(&lane_job("a", &format!("a{n}")), 0)).collect();
        q.send(&ordered).await.unwrap();
        q.send(&[msg(&lane_job("b", "b1"), 0), msg(&lane_job("b", "b2"), 0)]).await.unwrap();
        let visibility = Duration::from_secs(30);
        let first = q.receive(10, Duration::ZERO, visibility).await.unwrap();
        assert_eq!(ids(&first), (1..=10).map(|n| format!("a{n}")).collect::<Vec<_>>(), "a group's first ten, in order");
        assert_eq!(ids(&q.receive(10, Duration::ZERO, visibility).await.unwrap()), ["b1", "b2"], "a group with a message in flight gives none");
        // The lane hands a1 to a5 off and gives a6 to a10 back: a11 does not pass them.
        q.delete(&first[..5].iter().map(|m| m.receipt.clone()).collect::<Vec<_>>()).await.unwrap();
        q.release(&VisibleAgain::all(first[5..].iter().map(|m| m.receipt.clone()), Duration::from_secs(5))).await.unwrap();
        assert!(q.receive(10, Duration::ZERO, visibility).await.unwrap().is_empty(), "a6 to a10 are still in flight");
        // a5's retry goes ahead of the group, which is held.
        q.send(&[OutgoingMessage { ahead: true, ..msg(&lane_job("a", "a5"), 1) }]).await.unwrap();
        assert_eq!(ids(&q.receive(10, Duration::ZERO, visibility).await.unwrap()), ["a5"]);
        clock.advance(Duration::from_secs(6));
        let rest = q.receive(10, Duration::ZERO, visibility).await.unwrap();
        assert_eq!(ids(&rest), (6..=15).map(|n| format!("a{n}")).collect::<Vec<_>>(), "given back, they come first again, in order");
    }

    /// The first schema, as files written before versions were kept have it.
    const SCHEMA_1: &str = "
        CREATE TABLE messages (seq INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL UNIQUE, body TEXT NOT NULL,
            attempt INTEGER NOT NULL, visible_at INTEGER NOT NULL, receipt TEXT, receive_count INTEGER NOT NULL DEFAULT 0, enqueued_at INTEGER NOT NULL);
        CREATE INDEX messages_visible ON messages (visible_at, seq);
        CREATE TABLE dead_letters (seq INTEGER PRIMARY KEY AUTOINCREMENT, message_id TEXT NOT NULL, body TEXT NOT NULL,
            attempt INTEGER NOT NULL, reason TEXT NOT NULL, dead_at INTEGER NOT NULL);
        CREATE TABLE kv (key TEXT PRIMARY KEY, value TEXT NOT NULL);
        CREATE TABLE usage (key TEXT PRIMARY KEY, used INTEGER NOT NULL);
        CREATE TABLE call_slots (idx INTEGER PRIMARY KEY, holder TEXT, expires_at INTEGER NOT NULL);
        CREATE TABLE invocations (seq INTEGER PRIMARY KEY AUTOINCREMENT, payload TEXT NOT NULL, created_at INTEGER NOT NULL);
        INSERT INTO messages (message_id, body, attempt, visible_at, enqueued_at) VALUES ('m1', '{\"id\":\"old\",\"request\":{\"method\":\"GET\",\"path\":\"/\"}}', 2, 0, 5);
        INSERT INTO usage (key, used) VALUES ('usage#100/day#2026-11-23', 42);
    ";

    #[tokio::test]
    async fn a_file_of_the_first_schema_is_migrated_keeping_its_jobs_and_counters_and_a_newer_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("paceline-schema-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("lane.db");
        Connection::open(&path).unwrap().execute_batch(SCHEMA_1).unwrap();
        let clock = Arc::new(ManualClock::new(UnixMillis(1_000_000)));
        let store = EmbeddedStore::open(&path, clock.clone()).unwrap();
        let got = store.receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap();
        assert_eq!((got.len(), got[0].attempt, got[0].enqueued_at), (1, 2, UnixMillis(5)), "the queued job survived");
        assert_eq!(store.load_usage(&["usage#100/day#2026-11-23".to_owned()]).await.unwrap(), vec![42]);
        let all = OutcomeQuery { limit: 10, ..OutcomeQuery::default() };
        assert!(store.outcomes(&all).unwrap().is_empty(), "the outcomes table was added");
        let version: u32 = store.conn().query_row("PRAGMA user_version", [], |r| r.get(0)).unwrap();
        assert_eq!(version, SCHEMA_VERSION);
        drop(store);

        Connection::open(&path).unwrap().pragma_update(None, "user_version", SCHEMA_VERSION + 1).unwrap();
        let Err(refused) = EmbeddedStore::open(&path, clock) else { panic!("a newer schema was opened") };
        assert!(refused.to_string().contains("newer paceline"), "{refused}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn dead_letters_keep_body_attempt_and_reason() {
        let (_, q) = store();
        let reason = DeadLetterReason { cause: DeadLetterCause::Malformed, detail: "not a job: EOF".into(), outcome: None };
        q.dead_letter("m1", "{", 0, &reason).await.unwrap();
        let dead = q.dead_letters().unwrap();
        assert_eq!((dead[0].message_id.as_str(), dead[0].body.as_str(), &dead[0].reason), ("m1", "{", &reason));
        assert_eq!(q.depth().await.unwrap().dead, 1);
    }

    #[tokio::test]
    async fn lease_excludes_others_until_it_expires_and_fences_by_epoch() {
        let (_, s) = store();
        let ttl = Duration::from_secs(10);
        let a = s.acquire_lease("a", ttl, UnixMillis(0)).await.unwrap();
        assert!(matches!(s.acquire_lease("b", ttl, UnixMillis(5_000)).await, Err(PortError::Conflict(_))));
        let b = s.acquire_lease("b", ttl, UnixMillis(10_000)).await.unwrap();
        assert_eq!((a.epoch, b.epoch), (1, 2));
        assert!(matches!(s.renew_lease(&a, ttl, UnixMillis(10_001)).await, Err(PortError::Conflict(_))));
        let quota = crate::quota::Quota::new(vec!["5/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
        let mut state = crate::pacer::PacerState::new(&quota);
        state.set_hold_until(UnixMillis(7));
        let snapshot = PacerSnapshot { state, at_exit: true, effective_rate: None, saved_at: None };
        assert!(matches!(s.save_pacer(&a, &snapshot).await, Err(PortError::Conflict(_))));
        s.save_pacer(&b, &snapshot).await.unwrap();
        assert_eq!(s.load_pacer().await.unwrap(), Some(snapshot));
        s.release_lease(&b).await.unwrap();
        assert_eq!(s.acquire_lease("c", ttl, UnixMillis(10_002)).await.unwrap().epoch, 3);
    }

    #[tokio::test]
    async fn failure_buckets_older_than_a_day_are_swept_when_a_failure_is_counted() {
        let clock = Arc::new(crate::time::ManualClock::new(UnixMillis(10 * 86_400_000)));
        let s = EmbeddedStore::in_memory(clock.clone()).unwrap();
        let old = "failures#1000#100".to_owned(); // ended at 101 s
        let recent = format!("failures#1000#{}", 9 * 86_400 + 100); // ended within the day
        s.add_usage(&[(old.clone(), 1), (recent.clone(), 2)]).await.unwrap();
        assert_eq!(s.load_usage(&[old.clone(), recent.clone()]).await.unwrap(), vec![0, 2], "swept with the count");
        s.add_usage(&[("10/day@0".into(), 1)]).await.unwrap();
        let now = format!("failures#1000#{}", 10 * 86_400);
        s.add_usage(&[(now.clone(), 1)]).await.unwrap();
        assert_eq!(s.load_usage(&[recent, now, "10/day@0".into()]).await.unwrap(), vec![2, 1, 1], "other keys stay");
    }

    #[tokio::test]
    async fn usage_adds_up_and_circuit_swaps_only_from_the_expected_epoch() {
        let (_, s) = store();
        s.add_usage(&[("10/day@0".into(), 3)]).await.unwrap();
        s.add_usage(&[("10/day@0".into(), 4)]).await.unwrap();
        assert_eq!(s.load_usage(&["10/day@0".into(), "other".into()]).await.unwrap(), vec![7, 0]);
        let open = s.circuit().await.unwrap().open(0, "503", UnixMillis(1)).unwrap();
        s.swap_circuit(0, &open).await.unwrap();
        assert!(matches!(s.swap_circuit(0, &open).await, Err(PortError::Conflict(_))));
        assert_eq!(s.circuit().await.unwrap(), open);
        s.extend_cool_down(UnixMillis(50)).await.unwrap();
        s.extend_cool_down(UnixMillis(20)).await.unwrap();
        assert_eq!(s.cool_down().await.unwrap(), UnixMillis(50));
    }

    #[test]
    fn the_file_lock_admits_one_process_at_a_time() {
        let dir = std::env::temp_dir().join(format!("paceline-lock-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(&dir).unwrap();
        let db = dir.join("lane.db");
        let held = lock_exclusive(&db).unwrap();
        assert!(matches!(lock_exclusive(&db), Err(PortError::Conflict(_))));
        drop(held);
        assert!(lock_exclusive(&db).is_ok());
    }

    #[test]
    fn the_file_lock_follows_the_real_file_not_its_spelling() {
        let dir = std::env::temp_dir().join(format!("paceline-lock-{}", uuid::Uuid::new_v4()));
        std::fs::create_dir_all(dir.join("sub")).unwrap();
        let db = dir.join("lane.db");
        std::fs::write(&db, b"").unwrap();
        std::os::unix::fs::symlink(&db, dir.join("alias.db")).unwrap();
        let held = lock_exclusive(&db).unwrap();
        assert!(matches!(lock_exclusive(&dir.join("alias.db")), Err(PortError::Conflict(_))), "a symlink got past the lock");
        assert!(matches!(lock_exclusive(&dir.join("sub/../lane.db")), Err(PortError::Conflict(_))), "a `..` spelling got past the lock");
        drop(held);
    }

    fn temp_dir(what: &str) -> std::path::PathBuf {
        let dir = std::env::temp_dir().join(format!("paceline-{what}-{}", uuid::Uuid::new_v4().simple()));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// `lane.db` and `lane.sqlite` in one folder shared `lane.lock`, and a database
    /// named `x.lock` was its own lock file.
    #[test]
    fn databases_differing_only_in_extension_have_their_own_locks() {
        let dir = temp_dir("lock");
        let _db = lock_exclusive(&dir.join("lane.db")).unwrap();
        let _sqlite = lock_exclusive(&dir.join("lane.sqlite")).expect("an unrelated lane was refused as in use");
        let db_named_lock = dir.join("x.lock");
        std::fs::write(&db_named_lock, b"").unwrap();
        let _x = lock_exclusive(&db_named_lock).unwrap();
        assert_eq!(std::fs::read(&db_named_lock).unwrap(), b"", "the database is not its own lock file");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// `ln lane.db hard.db` gave a second run its own lock and its own WAL on the same
    /// database: 30 of 50 jobs called twice.
    #[test]
    fn a_database_with_a_second_hard_link_is_refused_by_name_and_link_count() {
        let dir = temp_dir("hardlink");
        let clock = Arc::new(ManualClock::new(UnixMillis(0)));
        drop(EmbeddedStore::open(&dir.join("lane.db"), clock.clone()).unwrap());
        std::fs::hard_link(dir.join("lane.db"), dir.join("hard.db")).unwrap();
        for name in ["lane.db", "hard.db"] {
            let Err(refused) = EmbeddedStore::open(&dir.join(name), clock.clone()) else { panic!("{name} opened with two links") };
            let text = refused.to_string();
            assert!(text.contains(name) && text.contains("2 hard links"), "{text}");
            assert!(matches!(lock_exclusive(&dir.join(name)), Err(PortError::Fatal(_))), "{name} was locked with two links");
        }
        std::fs::remove_file(dir.join("hard.db")).unwrap();
        assert!(EmbeddedStore::open(&dir.join("lane.db"), clock).is_ok(), "one link again: it opens");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// Opening another application's SQLite file added 8 tables and switched it to WAL;
    /// one with its own `messages` table was taken for Paceline's first schema.
    #[test]
    fn another_applications_sqlite_file_is_refused_and_left_unchanged() {
        let dir = temp_dir("foreign");
        let clock = Arc::new(ManualClock::new(UnixMillis(0)));
        let schemas = [
            ("crm.db", "CREATE TABLE customers (id INTEGER PRIMARY KEY, name TEXT); INSERT INTO customers (name) VALUES ('ada');"),
            ("chat.db", "CREATE TABLE messages (id INTEGER PRIMARY KEY, text TEXT); INSERT INTO messages (text) VALUES ('hi');"),
        ];
        for (name, schema) in schemas {
            let path = dir.join(name);
            Connection::open(&path).unwrap().execute_batch(schema).unwrap();
            let before = std::fs::read(&path).unwrap();
            let Err(refused) = EmbeddedStore::open(&path, clock.clone()) else { panic!("{name} was opened as a lane") };
            let text = refused.to_string();
            assert!(text.contains(name) && text.contains("not a Paceline database"), "{text}");
            assert_eq!(std::fs::read(&path).unwrap(), before, "{name} was changed");
            assert!(!dir.join(format!("{name}-wal")).exists(), "{name} was switched to WAL");
        }
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A damaged database ended a run with SQLite's words alone ("attached databases
    /// must use the same text encoding as main database"), naming neither the damage nor
    /// the file.
    #[tokio::test]
    async fn a_damaged_database_is_called_damaged_with_its_file_named() {
        let dir = temp_dir("damaged");
        let path = dir.join("lane.db");
        let clock = Arc::new(ManualClock::new(UnixMillis(0)));
        let store = EmbeddedStore::open(&path, clock.clone()).unwrap();
        let jobs: Vec<OutgoingMessage> = (0..200).map(|n| msg(&format!(r#"{{"id":"j{n}","request":{{"method":"GET","path":"/{n}"}}}}"#), 0)).collect();
        store.send(&jobs).await.unwrap();
        drop(store);
        // Every page but the first (the header and the schema) overwritten.
        let mut bytes = std::fs::read(&path).unwrap();
        bytes[4096..].fill(0xA5);
        std::fs::write(&path, bytes).unwrap();

        let store = EmbeddedStore::open(&path, clock).unwrap();
        let Err(failed) = store.depth().await else { panic!("a damaged table was read") };
        let text = failed.to_string();
        assert!(text.contains(&path.display().to_string()) && text.contains("damaged"), "{text}");
        std::fs::remove_dir_all(dir).unwrap();
    }

    /// A mistyped `path` in an operator command created an empty database and reported
    /// an empty queue.
    #[test]
    fn opening_an_existing_lane_creates_no_file_where_there_is_none() {
        let dir = temp_dir("missing");
        let path = dir.join("typo.db");
        let Err(refused) = EmbeddedStore::open_existing(&path, Arc::new(ManualClock::new(UnixMillis(0)))) else { panic!("a missing file was opened") };
        assert!(refused.to_string().contains("no database at"), "{refused}");
        assert!(!path.exists(), "the file was created");
        std::fs::remove_dir_all(dir).unwrap();
    }

    #[tokio::test]
    async fn a_hand_off_deletes_its_message_in_the_same_transaction() {
        struct Idle;
        #[async_trait]
        impl WorkerHandler for Idle {
            async fn handle(&self, _payload: WorkerPayload) -> PortResult<Option<crate::outcome::OutcomeRecord>> {
                std::future::pending().await
            }
        }
        let (_, store) = store();
        let store = Arc::new(store);
        store.send(&[msg(r#"{"id":"j","request":{"method":"GET","path":"/"}}"#, 0)]).await.unwrap();
        let got = store.receive(1, Duration::ZERO, Duration::from_secs(30)).await.unwrap();
        let job = crate::job::Job::parse(&got[0].body).unwrap();
        let invoker = EmbeddedInvoker::new(store.clone(), Arc::new(Idle));
        let payload = WorkerPayload::Job { job, attempt: 0, circuit_epoch: 0, dispatched_at: UnixMillis(0), slot: None, trip: None, report_limits: false };
        invoker.invoke(&payload, Some(&got[0].receipt)).await.unwrap();
        // As after a kill -9 here, before the orchestrator deleted the message: the
        // restart finds one copy of the job, not two.
        assert_eq!(store.recover_after_crash().unwrap(), (0, 1));
        assert_eq!(store.receive(10, Duration::ZERO, Duration::from_secs(30)).await.unwrap().len(), 1);
    }

    mod contract {
        use super::*;
        use crate::adapters::memory::RecordingWorker;
        use crate::testing::contract;
        use crate::time::TokioClock;

        fn paused_store() -> (Arc<TokioClock>, Arc<EmbeddedStore>) {
            let clock = Arc::new(TokioClock::anchored_at(UnixMillis(1_795_824_000_000)));
            (clock.clone(), Arc::new(EmbeddedStore::in_memory(clock).unwrap()))
        }

        #[tokio::test(start_paused = true)]
        async fn the_embedded_queue_keeps_the_job_queue_contract() {
            let (clock, store) = paused_store();
            contract::job_queue(store.as_ref(), clock.as_ref()).await;
        }

        #[tokio::test(start_paused = true)]
        async fn the_embedded_queue_keeps_the_dead_letter_contract() {
            let (_, store) = paused_store();
            contract::dead_letter_queues(store.as_ref()).await;
        }

        #[tokio::test(start_paused = true)]
        async fn the_embedded_store_keeps_the_state_store_contract() {
            let (_, store) = paused_store();
            let quota = crate::quota::Quota::new(vec!["5/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
            contract::state_store(store, &quota).await;
        }

        #[tokio::test(start_paused = true)]
        async fn a_lane_scoped_embedded_store_keeps_the_state_store_contract_too() {
            let (_, store) = paused_store();
            let quota = crate::quota::Quota::new(vec!["5/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
            let acme = StoreScope::Lane(crate::lane::LaneId::parse("acme").unwrap());
            contract::state_store(Arc::new(store.scoped(&acme)), &quota).await;
        }

        #[tokio::test(start_paused = true)]
        async fn each_lane_s_state_is_apart_from_every_other_lane_s_and_the_default_lane_keeps_the_old_keys() {
            let (clock, store) = paused_store();
            let now = clock.now();
            contract::lanes_apart(store.as_ref(), now).await;
            contract::pacers_saved_together(store.as_ref(), now).await;
            let lane = |id: &str| store.scoped(&StoreScope::Lane(crate::lane::LaneId::parse(id).unwrap()));
            let (default, acme) = (lane("default"), lane("acme"));
            // The default lane's keys are a stack-without-lanes' keys.
            default.add_usage(&[("10/day@0".to_owned(), 2)]).await.unwrap();
            assert_eq!(store.load_usage(&["10/day@0".to_owned()]).await.unwrap(), vec![2]);
            let stored: Option<Circuit> = store.get_kv("lane#acme#circuit").unwrap();
            assert!(stored.is_some_and(|c| !c.is_closed()), "acme's circuit is under its lane's key");
            // A crash drops every lane's claims on calls.
            store.recover_after_crash().unwrap();
            assert_eq!(acme.claim_call("call#j1#1", "w3", now, now.plus(Duration::from_secs(30))).await.unwrap(), CallClaim::Taken);
        }

        #[tokio::test(start_paused = true)]
        async fn an_operator_s_lane_change_is_kept_per_lane_and_every_lane_with_state_is_listed() {
            let (_clock, store) = paused_store();
            let lane = |id: &str| store.scoped(&StoreScope::Lane(LaneId::parse(id).unwrap()));
            let (acme, gold) = (lane("acme"), lane("gold:eu"));
            let change = LaneChange { weight: Some(3.0), tiers: Some(vec!["2/s".parse().unwrap()]), max_in_flight: None };
            gold.set_lane_change(Some(&change)).await.unwrap();
            assert_eq!(gold.lane_change().await.unwrap(), Some(change));
            assert_eq!(acme.lane_change().await.unwrap(), None, "gold's change is gold's alone");
            assert_eq!(store.lane_change().await.unwrap(), None);
            acme.extend_cool_down(UnixMillis(5)).await.unwrap();
            let listed: Vec<String> = store.lanes_with_state().await.unwrap().iter().map(ToString::to_string).collect();
            assert_eq!(listed, ["acme", "gold:eu"]);
            let jobs = ["{\"id\":\"1\",\"lane\":\"acme\"}", "{\"id\":\"2\",\"lane\":\"acme\"}", "{\"id\":\"3\"}", "not json"];
            let messages: Vec<OutgoingMessage> = jobs.iter().map(|body| OutgoingMessage::fresh((*body).to_owned())).collect();
            store.send(&messages).await.unwrap();
            store
                .dead_letter("m", jobs[0], 0, &DeadLetterReason { cause: crate::job::DeadLetterCause::Malformed, detail: "x".into(), outcome: None })
                .await
                .unwrap();
            let depths = store.depth_by_lane().unwrap();
            let acme = depths[&LaneId::parse("acme").unwrap()];
            assert_eq!((acme.visible, acme.dead), (2, 1));
            assert_eq!(depths[&LaneId::default_lane()].visible, 2, "a job naming no lane, and one that does not parse");
            gold.set_lane_change(None).await.unwrap();
            assert_eq!(gold.lane_change().await.unwrap(), None, "forgotten: the config's settings again");
        }

        #[tokio::test(start_paused = true)]
        async fn the_embedded_invoker_keeps_the_invoker_contract() {
            let (clock, store) = paused_store();
            let worker = Arc::new(RecordingWorker::default());
            let invoker = EmbeddedInvoker::new(store, worker.clone());
            contract::invoker(&invoker, || async {
                while invoker.in_flight() > 0 {
                    clock.sleep_until(clock.now().plus(Duration::from_millis(10))).await;
                }
                worker.ran()
            })
            .await;
        }
    }

    /// One step of a run of workers against the call slots.
    #[derive(Clone, Debug)]
    enum SlotStep {
        /// A worker asks for a slot, to hold it this long (ms) at most.
        Take(u64),
        /// The worker that took the n-th slot (of those taken so far) gives it back.
        Release(usize),
        /// Time passes (ms).
        Wait(u64),
    }

    fn slot_step() -> impl proptest::strategy::Strategy<Value = SlotStep> {
        use proptest::prelude::*;
        prop_oneof![(1u64..3_000).prop_map(SlotStep::Take), (0usize..40).prop_map(SlotStep::Release), (0u64..1_500).prop_map(SlotStep::Wait)]
    }

    proptest::proptest! {
        /// Whatever workers take, give back, or leave to expire (a crash), no more than
        /// the capacity ever holds a slot, and a slot is refused only when all are held.
        #[test]
        fn the_concurrency_cap_is_never_exceeded(capacity in 1u32..6, steps in proptest::collection::vec(slot_step(), 1..80)) {
            let (clock, store) = store();
            let runtime = tokio::runtime::Builder::new_current_thread().build().unwrap();
            let mut taken: Vec<(u32, String, UnixMillis)> = Vec::new();
            for (n, step) in steps.iter().enumerate() {
                let now = clock.now();
                match step {
                    SlotStep::Take(hold_ms) => {
                        let holder = format!("w{n}");
                        let until = now.plus(Duration::from_millis(*hold_ms));
                        let held_before = taken.iter().filter(|(_, _, until)| *until > now).count();
                        match runtime.block_on(store.take_call_slot(capacity, &holder, now, until)).unwrap() {
                            Some(index) => {
                                proptest::prop_assert!(index < capacity);
                                proptest::prop_assert!(!taken.iter().any(|(i, _, until)| *i == index && *until > now), "slot {index} was held");
                                taken.push((index, holder, until));
                            }
                            None => proptest::prop_assert_eq!(held_before, capacity as usize, "refused with a slot free"),
                        }
                    }
                    SlotStep::Release(k) => {
                        if let Some((index, holder, until)) = taken.get(*k).cloned() {
                            runtime.block_on(store.release_call_slot(index, &holder)).unwrap();
                            // Given back: free from now (if it had not expired and gone to another).
                            if let Some(entry) = taken.get_mut(*k) {
                                entry.2 = until.min(now);
                            }
                        }
                    }
                    SlotStep::Wait(ms) => clock.advance(Duration::from_millis(*ms)),
                }
                let now = clock.now();
                let held = taken.iter().filter(|(_, _, until)| *until > now).count();
                proptest::prop_assert!(held <= capacity as usize);
                proptest::prop_assert_eq!(runtime.block_on(store.call_slots_in_use(capacity, now)).unwrap() as usize, held);
            }
        }
    }
}

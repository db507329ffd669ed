//! `paceline dlq list|show|summary|redrive|purge`: the operator's view of both
//! dead-letter queues, and the way back onto the jobs queue after an outage. A dead
//! letter leaves its DLQ only after its copy is safely enqueued.

use std::time::Duration;

use anyhow::bail;
use clap::Subcommand;
use indicatif::{ProgressBar, ProgressStyle};
use paceline_shared::dlq::{CauseSummary, DeadLetterFilter, DeadLetterRecord, DlqSource};
use paceline_shared::keys::StoreScope;
use paceline_shared::lane::LaneId;
use paceline_shared::ports::{forget_calls, DeadLetterQueues};
use paceline_shared::table::{one_line_row, text_table};
use paceline_shared::time::system_now;
use serde::Serialize;

use crate::access::{OperatorStack, StackArgs};
use crate::dlq_scan::Scan;

/// Inspect the dead-letter queues, and redrive or purge what is in them.
#[derive(Debug, clap::Args)]
pub struct DlqArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// How long records being read stay hidden from other readers (SQS); it must
    /// cover one pass over the DLQ.
    #[arg(long, global = true, default_value = "2m", value_parser = humantime::parse_duration)]
    pub hold: Duration,
    #[command(subcommand)]
    pub action: DlqAction,
}

#[derive(Debug, Subcommand)]
pub enum DlqAction {
    /// List dead letters, oldest first in each DLQ.
    List {
        #[command(flatten)]
        select: Selection,
        /// Show at most this many.
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Show one dead letter in full, by its id or its job's id.
    Show {
        id: String,
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Count dead letters by DLQ and cause, with when the first and last arrived.
    Summary {
        #[command(flatten)]
        select: Selection,
        /// Print as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Put dead letters back on the jobs queue, where they are paced like any job.
    Redrive {
        #[command(flatten)]
        target: RemovalTarget,
        /// Say what would move, and move nothing.
        #[arg(long)]
        dry_run: bool,
        /// Keep each job's attempt count (by default it starts again from 0).
        #[arg(long)]
        keep_attempts: bool,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
    /// Delete dead letters for good.
    Purge {
        #[command(flatten)]
        target: RemovalTarget,
        /// Say what would be deleted, and delete nothing.
        #[arg(long)]
        dry_run: bool,
        /// Print the outcome as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Which dead letters a command acts on.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct Selection {
    /// Only this DLQ: `jobs`, or `worker` (the worker's Lambda on-failure destination).
    #[arg(long)]
    pub dlq: Option<DlqSource>,
    /// Only these causes: a label (`http_404`), part of one (`attempts_exhausted`,
    /// `worker`), a status (`503`) or a status class (`5xx`). Repeat or separate with
    /// commas.
    #[arg(long, value_delimiter = ',')]
    pub cause: Vec<String>,
    /// Only these job ids or dead-letter ids. Repeat or separate with commas.
    #[arg(long, value_delimiter = ',')]
    pub id: Vec<String>,
    /// Only those dead-lettered at least this long ago (e.g. `1h`).
    #[arg(long, value_parser = humantime::parse_duration)]
    pub older_than: Option<Duration>,
    /// Only those dead-lettered at most this long ago.
    #[arg(long, value_parser = humantime::parse_duration)]
    pub newer_than: Option<Duration>,
    /// Only the dead letters of this lane's jobs (`default`: jobs that name no lane).
    #[arg(long, value_name = "ID")]
    pub lane: Option<LaneId>,
}

/// Which dead letters a redrive or purge acts on: a selection, or every one with `--all`.
#[derive(Debug, Clone, Default, clap::Args)]
pub struct RemovalTarget {
    #[command(flatten)]
    pub select: Selection,
    /// Every dead letter (a redrive or purge refuses to act without a filter or this).
    #[arg(long)]
    pub all: bool,
}

impl Selection {
    /// The dead letters this selection keeps.
    pub(crate) fn filter(&self) -> DeadLetterFilter {
        DeadLetterFilter { causes: self.cause.clone(), ids: self.id.clone(), older_than: self.older_than, newer_than: self.newer_than, lane: self.lane.clone() }
    }

    fn sources(&self, queues: &dyn DeadLetterQueues) -> anyhow::Result<Vec<DlqSource>> {
        let have = queues.sources();
        match self.dlq {
            None => Ok(have),
            Some(wanted) if have.contains(&wanted) => Ok(vec![wanted]),
            Some(DlqSource::Worker) => {
                bail!("this stack has no worker DLQ configured (set worker_dlq_url in [backend], --worker-dlq-url or PACELINE_WORKER_DLQ_URL; the embedded backend has none)")
            }
            Some(wanted) => bail!("this stack has no {wanted} DLQ"),
        }
    }
}

/// What a redrive or purge did.
#[derive(Debug, Default, Serialize)]
pub struct Removal {
    pub matched: u64,
    /// Redriven or purged (0 on a dry run).
    pub done: u64,
    /// Matched but hold no job to redrive (a health check, an unreadable record).
    pub no_job: u64,
    pub dry_run: bool,
    /// On a dry run, what would be redriven or purged.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub would: Vec<DeadLetterRecord>,
}

/// What to do with the dead letters selected.
#[derive(Clone, Copy, Debug)]
pub enum RemovalKind {
    Redrive { keep_attempts: bool },
    Purge,
}

impl DlqArgs {
    /// # Errors
    /// A bad lane, an unavailable queue, or a redrive/purge without a filter or `--all`.
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open().await?;
        let queues = stack.queues.as_ref();
        let hold = self.hold;
        match self.action {
            DlqAction::List { select, limit, json } => list(queues, &select, hold, limit, json).await,
            DlqAction::Show { id, json } => show(queues, &id, hold, json).await,
            DlqAction::Summary { select, json } => summary(queues, &select, hold, json).await,
            DlqAction::Redrive { target, dry_run, keep_attempts, json } => {
                remove_and_say(&stack, &target, hold, RemovalKind::Redrive { keep_attempts }, dry_run, json).await
            }
            DlqAction::Purge { target, dry_run, json } => remove_and_say(&stack, &target, hold, RemovalKind::Purge, dry_run, json).await,
        }
    }
}

/// Reads every selected dead letter (up to `limit`) and gives each to `visit`,
/// leaving them all in place.
async fn each_selected(
    queues: &dyn DeadLetterQueues,
    select: &Selection,
    hold: Duration,
    limit: usize,
    mut visit: impl FnMut(DeadLetterRecord),
) -> anyhow::Result<()> {
    let filter = select.filter();
    let now = system_now();
    let mut seen = 0;
    for source in select.sources(queues)? {
        let mut scan = Scan::new(queues, source, hold);
        while seen < limit {
            let page = scan.next_page().await?;
            if page.is_empty() {
                break;
            }
            for record in page.into_iter().filter(|r| filter.matches(r, now)).take(limit - seen) {
                seen += 1;
                visit(record);
            }
        }
        scan.finish().await?;
    }
    Ok(())
}

/// The selected dead letters (up to `limit`).
///
/// # Errors
/// A DLQ the stack does not have, or one that cannot be read.
pub async fn collect(queues: &dyn DeadLetterQueues, select: &Selection, hold: Duration, limit: usize) -> anyhow::Result<Vec<DeadLetterRecord>> {
    let mut found = Vec::new();
    each_selected(queues, select, hold, limit, |r| found.push(r)).await?;
    Ok(found)
}

/// Dead letters as a table, a row each (text cut to the terminal's width).
fn records_table(records: &[DeadLetterRecord]) -> comfy_table::Table {
    let mut table = text_table(&["dlq", "dead since", "cause", "calls", "job", "id", "detail"], &[3]);
    for record in records {
        table.add_row(one_line_row(vec![
            record.source.to_string(),
            record.dead_at.to_rfc3339(),
            record.cause.clone(),
            record.calls_made().to_string(),
            record.job_id.clone().unwrap_or_else(|| "-".into()),
            record.message_id.clone(),
            record.detail.clone(),
        ]));
    }
    table
}

async fn list(queues: &dyn DeadLetterQueues, select: &Selection, hold: Duration, limit: usize, json: bool) -> anyhow::Result<()> {
    let records = collect(queues, select, hold, limit).await?;
    if json {
        println!("{}", serde_json::to_string_pretty(&records)?);
        return Ok(());
    }
    if !records.is_empty() {
        println!("{}", records_table(&records));
    }
    println!("{} dead letter(s){}", records.len(), if records.len() == limit { " (the limit; --limit shows more)" } else { "" });
    Ok(())
}

async fn show(queues: &dyn DeadLetterQueues, id: &str, hold: Duration, json: bool) -> anyhow::Result<()> {
    let select = Selection { id: vec![id.to_owned()], ..Selection::default() };
    let Some(record) = collect(queues, &select, hold, 1).await?.pop() else {
        bail!("no dead letter has the id or job id `{id}` (`paceline dlq list` shows what there is)");
    };
    if json {
        println!("{}", serde_json::to_string_pretty(&record)?);
        return Ok(());
    }
    println!("dlq:        {}", record.source);
    println!("id:         {}", record.message_id);
    println!("job id:     {}", record.job_id.as_deref().unwrap_or("-"));
    println!("cause:      {}", record.cause);
    println!("detail:     {}", record.detail);
    println!("calls:      {}", record.calls_made());
    println!("dead since: {}", record.dead_at.to_rfc3339());
    let body =
        serde_json::from_str::<serde_json::Value>(&record.raw).map_or_else(|_| record.raw.clone(), |v| serde_json::to_string_pretty(&v).unwrap_or_default());
    println!("message:\n{body}");
    if let Some(outcome) = &record.outcome {
        println!("outcome (the API's answer):\n{}", serde_json::to_string_pretty(outcome)?);
    }
    Ok(())
}

/// The selected dead letters counted by DLQ and cause.
///
/// # Errors
/// A DLQ the stack does not have, or one that cannot be read.
pub async fn summarize(queues: &dyn DeadLetterQueues, select: &Selection, hold: Duration) -> anyhow::Result<CauseSummary> {
    let mut summary = CauseSummary::default();
    each_selected(queues, select, hold, usize::MAX, |r| summary.add(&r)).await?;
    Ok(summary)
}

async fn summary(queues: &dyn DeadLetterQueues, select: &Selection, hold: Duration, json: bool) -> anyhow::Result<()> {
    let summary = summarize(queues, select, hold).await?;
    let total = summary.total();
    let groups = summary.groups();
    if json {
        println!("{}", serde_json::to_string_pretty(&groups)?);
        return Ok(());
    }
    let mut table = text_table(&["dlq", "cause", "count", "first seen", "last seen", "example"], &[2]);
    for g in &groups {
        table.add_row(one_line_row(vec![
            g.source.to_string(),
            g.cause.clone(),
            g.count.to_string(),
            g.first_seen.to_rfc3339(),
            g.last_seen.to_rfc3339(),
            g.example.clone(),
        ]));
    }
    if !groups.is_empty() {
        println!("{table}");
    }
    println!("{total} dead letter(s) in {} group(s); redrive a group with `paceline dlq redrive --cause <cause>`", groups.len());
    Ok(())
}

fn progress_bar(len: u64, verb: &str) -> ProgressBar {
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!("{{spinner}} {verb} {{wide_bar}} {{pos}}/{{len}} read  {{msg}}  ETA {{eta}}"))
            .unwrap_or_else(|_| ProgressStyle::default_bar()),
    );
    bar
}

impl RemovalKind {
    /// What the progress bar and the closing line say.
    fn verbs(self) -> (&'static str, &'static str) {
        match self {
            Self::Redrive { .. } => ("redriving", "redrove"),
            Self::Purge => ("purging", "purged"),
        }
    }
}

/// Redrives or purges the selected dead letters, a page at a time, counting what it
/// reads on `bar`. A redrive puts each job back on the jobs queue, where it is paced
/// like any job.
///
/// # Errors
/// No filter and no `all`, a DLQ the stack does not have, or a queue that fails.
pub async fn remove(
    stack: &OperatorStack,
    target: &RemovalTarget,
    hold: Duration,
    kind: RemovalKind,
    dry_run: bool,
    bar: &ProgressBar,
) -> anyhow::Result<Removal> {
    let select = &target.select;
    let queues = stack.queues.as_ref();
    let filter = select.filter();
    if filter.is_everything() && !target.all {
        bail!("say which dead letters: --cause, --id, --older-than, --newer-than, or --all for every one (add --dry-run to see first)");
    }
    let sources = select.sources(queues)?;
    let mut total = 0;
    for source in &sources {
        total += queues.count(*source).await?;
    }
    bar.set_length(total);
    let done_verb = kind.verbs().1;
    let mut outcome = Removal { dry_run, ..Removal::default() };
    let now = system_now();
    for source in sources {
        let mut scan = Scan::new(queues, source, hold);
        loop {
            let page = scan.next_page().await?;
            if page.is_empty() {
                break;
            }
            bar.inc(page.len() as u64);
            let (act_on, no_job): (Vec<DeadLetterRecord>, Vec<DeadLetterRecord>) =
                page.into_iter().filter(|r| filter.matches(r, now)).partition(|r| matches!(kind, RemovalKind::Purge) || r.job_body.is_some());
            outcome.matched += (act_on.len() + no_job.len()) as u64;
            outcome.no_job += no_job.len() as u64;
            if dry_run {
                outcome.would.extend(act_on);
                continue;
            }
            if act_on.is_empty() {
                continue;
            }
            match kind {
                RemovalKind::Redrive { keep_attempts } => {
                    // The jobs' attempts go again: their call records (in each job's
                    // lane's state) must not skip them.
                    for record in &act_on {
                        if let Some(job_id) = &record.job_id {
                            let lane_state = stack.stores.scoped(&StoreScope::Lane(record.lane.clone()));
                            forget_calls(lane_state.as_ref(), job_id, record.attempt).await?;
                        }
                    }
                    queues.redrive(&act_on, keep_attempts).await?;
                }
                RemovalKind::Purge => queues.remove_records(source, &act_on).await?,
            }
            scan.removed(&act_on);
            outcome.done += act_on.len() as u64;
            bar.set_message(format!("{} {done_verb}", outcome.done));
        }
        scan.finish().await?;
    }
    Ok(outcome)
}

/// Redrives or purges the selected dead letters and says what it did.
async fn remove_and_say(stack: &OperatorStack, target: &RemovalTarget, hold: Duration, kind: RemovalKind, dry_run: bool, json: bool) -> anyhow::Result<()> {
    let (verb, done_verb) = kind.verbs();
    let bar = progress_bar(0, verb);
    let outcome = remove(stack, target, hold, kind, dry_run, &bar).await?;
    bar.finish_and_clear();
    if json {
        println!("{}", serde_json::to_string_pretty(&outcome)?);
        return Ok(());
    }
    if dry_run {
        let verb = if matches!(kind, RemovalKind::Purge) { "purge" } else { "redrive" };
        if !outcome.would.is_empty() {
            println!("would {verb}:\n{}", records_table(&outcome.would));
        }
        println!("dry run: {} dead letter(s) match; nothing was changed", outcome.would.len());
    } else {
        let attempts = match kind {
            RemovalKind::Redrive { keep_attempts: true } => " to the jobs queue (attempts kept)",
            RemovalKind::Redrive { keep_attempts: false } => " to the jobs queue (attempts reset)",
            RemovalKind::Purge => "",
        };
        println!("{done_verb} {} dead letter(s){attempts}", outcome.done);
    }
    if outcome.no_job > 0 {
        println!("{} matching dead letter(s) hold no job to redrive (health checks or unreadable records); `dlq purge` removes them", outcome.no_job);
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use paceline_shared::job::{DeadLetterCause, DeadLetterReason};
    use paceline_shared::ports::{call_record_key, CallClaim};

    use super::*;

    /// A redrive of a lane's job must forget the call records the job left in its lane's
    /// state: a record still marked done would have the worker skip the redriven attempt
    /// as a repeat, and the job would be gone.
    #[tokio::test]
    async fn a_redrive_forgets_the_call_records_of_the_job_s_own_lane() {
        let dir = std::env::temp_dir().join(format!("paceline-dlq-lane-redrive-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let config = dir.join("paceline.toml");
        std::fs::write(&config, "[api]\nbase_url = \"http://127.0.0.1:9\"\n[quota]\ntiers = [\"5/s\"]\n[lanes]\ntiers = [\"2/s\"]\n").unwrap();
        let stack = StackArgs { config, ..StackArgs::default() }.open_to_enqueue().await.unwrap();
        let acme = stack.stores.scoped(&StoreScope::Lane("acme".parse().unwrap()));
        let record = call_record_key("j-1", 0);
        let now = system_now();
        // The worker called attempt 0 of acme's job, and the API refused it for good.
        assert_eq!(acme.claim_call(&record, "worker-1", now, now.plus(Duration::from_secs(30))).await.unwrap(), CallClaim::Taken);
        acme.finish_call(&record, now.plus(Duration::from_secs(3600))).await.unwrap();
        let reason = DeadLetterReason { cause: DeadLetterCause::Rejected { status: 404 }, detail: "not found".into(), outcome: None };
        let job = r#"{"id":"j-1","lane":"acme","request":{"method":"GET","path":"/items/1"}}"#;
        stack.queues.dead_letter("m-1", job, 0, &reason).await.unwrap();

        let target = RemovalTarget { all: true, ..RemovalTarget::default() };
        let removal =
            remove(&stack, &target, Duration::from_secs(5), RemovalKind::Redrive { keep_attempts: false }, false, &ProgressBar::hidden()).await.unwrap();
        assert_eq!(removal.done, 1);
        let claim = acme.claim_call(&record, "worker-2", now, now.plus(Duration::from_secs(30))).await.unwrap();
        assert_eq!(claim, CallClaim::Taken, "the redriven attempt is called again, not skipped as a repeat");
        std::fs::remove_dir_all(&dir).unwrap();
    }
}

//! `paceline enqueue`: JSON lines from a file or stdin onto the jobs queue, checked
//! first; bad lines are reported with their line numbers and the rest still go.

use std::io::BufRead;
use std::path::PathBuf;

use anyhow::Context;
use indicatif::{ProgressBar, ProgressStyle};
use paceline_shared::calls_coming::{calls_coming, SEND_ROOM, SEND_WAIT};
use paceline_shared::config::{Config, RequestLimits};
use paceline_shared::job::Job;
use paceline_shared::lane::LaneId;
use paceline_shared::ports::{JobQueue, OutgoingMessage};
use paceline_shared::time::SystemClock;

use crate::access::{OperatorStack, StackArgs};

/// Put jobs (one JSON object per line) on the queue, in batches (of 10 on SQS).
#[derive(Debug, clap::Args)]
pub struct EnqueueArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    /// File of JSON lines; `-` or nothing reads standard input.
    pub file: Option<PathBuf>,
    /// The lane of the jobs whose line names none (a line's own `"lane"` wins).
    #[arg(long = "lane", value_name = "ID", env = "PACELINE_JOB_LANE")]
    pub into_lane: Option<LaneId>,
    /// Print what was enqueued as JSON: the job ids (generated ones too, to find their
    /// outcomes by) and the rejected lines.
    #[arg(long)]
    pub json: bool,
}

/// `enqueue --json`.
#[derive(serde::Serialize)]
struct Enqueued<'a> {
    enqueued: usize,
    job_ids: Vec<&'a str>,
    rejected: &'a [String],
}

/// What the lane's configuration forbids `job`: its request breaks the lane's
/// [`RequestLimits`], or its cost is over a whole tier (the orchestrator would
/// dead-letter it).
fn check_for_lane(job: &Job, config: &Config, limits: &RequestLimits) -> Result<(), String> {
    limits.check(&job.request)?;
    // Its lane's own tiers (the lane's under `[lanes]`), then the shared ones.
    let too_small = config.lane_quota(&job.lane).tier_too_small_for(job.cost).or_else(|| config.quota.tier_too_small_for(job.cost));
    match too_small {
        Some(tier) if config.lanes.is_some() => Err(format!("cost {} exceeds the whole {tier} tier of lane {}: it could never be called", job.cost, job.lane)),
        Some(tier) => Err(format!("cost {} exceeds the whole {tier} tier: it could never be called", job.cost)),
        None => Ok(()),
    }
}

/// The good jobs and the numbered complaints about the bad lines; with the lane's
/// configuration, a job it forbids (a request over its limits, a cost over a whole
/// tier) is a bad line too.
#[must_use]
pub fn parse_lines(lines: impl Iterator<Item = std::io::Result<String>>, lane: Option<&Config>, into_lane: &LaneId) -> (Vec<Job>, Vec<String>) {
    let limits = lane.map(|config| config.api.request_limits());
    let mut jobs = Vec::new();
    let mut errors = Vec::new();
    for (index, line) in lines.enumerate() {
        let number = index + 1;
        match line {
            Ok(line) if line.trim().is_empty() => {}
            Ok(line) => match Job::parse_in_lane(&line, into_lane).map_err(|e| e.to_string()).and_then(|job| match (lane, &limits) {
                (Some(config), Some(limits)) => check_for_lane(&job, config, limits).map(|()| job),
                _ => Ok(job),
            }) {
                Ok(job) => jobs.push(job),
                Err(e) => errors.push(format!("line {number}: {e}")),
            },
            Err(e) => errors.push(format!("line {number}: unreadable: {e}")),
        }
    }
    (jobs, errors)
}

/// Puts `jobs` on `queue` in order, as many at a time as it takes in one send (ten on
/// SQS, each deduplicated by its job id on a FIFO queue), telling `sent` how many went
/// after each send.
///
/// # Errors
/// A send that failed, saying how many jobs went before it (the first ones, in order).
pub async fn send_jobs(queue: &dyn JobQueue, jobs: &[Job], mut sent: impl FnMut(usize)) -> anyhow::Result<()> {
    let per_send = queue.most_per_send();
    for (index, batch) in jobs.chunks(per_send).enumerate() {
        let messages: Vec<OutgoingMessage> =
            batch.iter().map(|job| OutgoingMessage { dedup_id: Some(job.id.to_string()), ..OutgoingMessage::fresh(job.to_json()) }).collect();
        // In a process that runs lanes (`serve`), between their calls.
        calls_coming().wait_for_room(&SystemClock, SEND_ROOM, SEND_WAIT).await;
        queue.send(&messages).await.with_context(|| format!("after {} job(s) were enqueued", index * per_send))?;
        sent(batch.len());
    }
    Ok(())
}

/// Puts `jobs` on the stack's queue, or in a stack of shards each on its lane's shard's
/// queue (in order within each shard: where its id's hash puts it, or where an operator
/// moved it), telling `sent` how many went after each send.
///
/// # Errors
/// A send that failed, saying which shard's, and how many of that shard's jobs went
/// before it (the shards before it took all of theirs).
pub async fn send_to_shards(stack: &OperatorStack, jobs: &[Job], mut sent: impl FnMut(usize)) -> anyhow::Result<()> {
    if stack.shard_queues.len() <= 1 {
        return send_jobs(stack.queues.as_ref(), jobs, sent).await;
    }
    let shards = stack.shard_queues.len();
    let homes = stack.lane_homes().await?.0;
    for (index, queue) in stack.shard_queues.iter().enumerate() {
        let own: Vec<Job> = jobs.iter().filter(|job| homes.home_of(&job.lane, shards) == index).cloned().collect();
        send_jobs(queue.as_ref(), &own, &mut sent).await.with_context(|| format!("shard {index} of {shards}'s queue"))?;
    }
    Ok(())
}

impl EnqueueArgs {
    /// # Errors
    /// Bad config, unreadable input, a failed send, or rejected lines (after the good
    /// ones were sent).
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open_to_enqueue().await?;
        let config = stack.config.as_ref();
        let into_lane = self.into_lane.unwrap_or_default();
        let (jobs, errors) = match self.file.as_deref() {
            None => parse_lines(std::io::stdin().lock().lines(), config, &into_lane),
            Some(path) if path.as_os_str() == "-" => parse_lines(std::io::stdin().lock().lines(), config, &into_lane),
            Some(path) => {
                let file = std::fs::File::open(path).with_context(|| format!("cannot read {}", path.display()))?;
                parse_lines(std::io::BufReader::new(file).lines(), config, &into_lane)
            }
        };
        if !self.json {
            for error in &errors {
                eprintln!("{error}");
            }
        }
        let bar = ProgressBar::new(jobs.len() as u64);
        bar.set_style(ProgressStyle::with_template("enqueueing {wide_bar} {pos}/{len} {per_sec} ETA {eta}").unwrap_or_else(|_| ProgressStyle::default_bar()));
        send_to_shards(&stack, &jobs, |sent| bar.inc(sent as u64)).await?;
        bar.finish_and_clear();
        if self.json {
            let job_ids = jobs.iter().map(|job| job.id.as_str()).collect();
            println!("{}", serde_json::to_string_pretty(&Enqueued { enqueued: jobs.len(), job_ids, rejected: &errors })?);
        } else {
            println!("enqueued {} job(s); {} line(s) rejected", jobs.len(), errors.len());
        }
        if errors.is_empty() {
            Ok(())
        } else {
            anyhow::bail!("{} line(s) were not enqueued (see above)", errors.len())
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a stack of shards each job goes to its lane's shard's queue (by the FNV-1a hash
    /// of the lane id, as the orchestrators and the documented producer recipe place it),
    /// in order within each shard.
    #[tokio::test]
    async fn a_stack_of_shards_takes_each_job_on_its_lane_s_shard_s_queue() {
        use paceline_shared::adapters::embedded::EmbeddedStore;
        use paceline_shared::time::SystemClock;
        let config =
            Config::parse("[api]\nbase_url = \"http://127.0.0.1:9\"\n[quota]\ntiers = [\"5/s\"]\n[lanes]\n", std::path::Path::new("."), &|_| None).unwrap();
        let clock: std::sync::Arc<dyn paceline_shared::time::Clock> = std::sync::Arc::new(SystemClock);
        let shard_stores: Vec<std::sync::Arc<EmbeddedStore>> = (0..2).map(|_| std::sync::Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap())).collect();
        let mut stack = OperatorStack::embedded(config, std::sync::Arc::new(EmbeddedStore::in_memory(clock.clone()).unwrap()));
        stack.shard_queues = shard_stores.iter().map(|store| store.clone() as std::sync::Arc<dyn JobQueue>).collect();
        let lines: String =
            (0..20).map(|n| format!("{{\"id\":\"j{n}\",\"lane\":\"tenant-{}\",\"request\":{{\"method\":\"GET\",\"path\":\"/{n}\"}}}}\n", n % 5)).collect();
        let (jobs, errors) = parse_lines(std::io::Cursor::new(lines).lines(), None, &LaneId::default());
        assert!(errors.is_empty(), "{errors:?}");
        let mut went = 0;
        send_to_shards(&stack, &jobs, |sent| went += sent).await.unwrap();
        assert_eq!(went, 20);
        for (index, store) in shard_stores.iter().enumerate() {
            let mut ids: Vec<String> = Vec::new();
            loop {
                let received = store.receive(10, std::time::Duration::ZERO, std::time::Duration::from_secs(30)).await.unwrap();
                if received.is_empty() {
                    break;
                }
                ids.extend(received.iter().map(|message| Job::parse(&message.body).unwrap().id.to_string()));
            }
            let expected: Vec<String> = jobs.iter().filter(|job| job.lane.shard(2) == index).map(|job| job.id.to_string()).collect();
            assert_eq!(ids, expected, "shard {index}: its lanes' jobs, in order");
        }
        assert_eq!(stack.queues.depth().await.unwrap().visible, 0, "nothing on a queue no shard reads");
    }

    #[test]
    fn bad_lines_are_numbered_and_do_not_stop_the_rest() {
        let input = "{\"request\":{\"method\":\"GET\",\"path\":\"/a\"}}\n\nnot json\n{\"request\":{\"method\":\"GET\",\"path\":\"http://x/\"}}\n{\"id\":\"z\",\"request\":{\"method\":\"GET\",\"path\":\"/b\"}}\n";
        let (jobs, errors) = parse_lines(std::io::Cursor::new(input).lines(), None, &LaneId::default());
        assert_eq!(jobs.len(), 2);
        assert_eq!(jobs[1].id.as_str(), "z");
        assert_eq!(errors.len(), 2);
        assert!(errors[0].starts_with("line 3: not a job"), "{}", errors[0]);
        assert!(errors[1].starts_with("line 4: request.path"), "{}", errors[1]);
    }

    #[test]
    fn lines_without_a_lane_go_in_the_lane_given_and_a_bad_lane_is_refused_with_its_line_number() {
        let input = "{\"id\":\"a\",\"request\":{\"method\":\"GET\",\"path\":\"/a\"}}\n{\"id\":\"b\",\"lane\":\"gold\",\"request\":{\"method\":\"GET\",\"path\":\"/b\"}}\n{\"id\":\"c\",\"lane\":\"no/slash\",\"request\":{\"method\":\"GET\",\"path\":\"/c\"}}\n";
        let (jobs, errors) = parse_lines(std::io::Cursor::new(input).lines(), None, &"acme".parse().unwrap());
        let lanes: Vec<(&str, &str)> = jobs.iter().map(|job| (job.id.as_str(), job.lane.as_str())).collect();
        assert_eq!(lanes, vec![("a", "acme"), ("b", "gold")]);
        assert_eq!(errors, vec!["line 3: lane: lane id \"no/slash\" has '/': only A-Za-z0-9._:- are allowed".to_owned()]);
    }

    #[test]
    fn bodies_over_max_body_and_lane_headers_are_refused_with_their_line_numbers() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\nmax_body = 64\nheaders = { X-Lane = { value = \"k\" } }\n[quota]\ntiers = [\"1/s\"]\n";
        let config = paceline_shared::config::Config::parse(text, std::path::Path::new("."), &|_| None).unwrap();
        let big = format!("{{\"request\":{{\"method\":\"POST\",\"path\":\"/a\",\"body\":\"{}\"}}}}", "x".repeat(100));
        let input = format!("{big}\n{{\"request\":{{\"method\":\"GET\",\"path\":\"/a\",\"headers\":{{\"x-lane\":\"forged\"}}}}}}\n{{\"request\":{{\"method\":\"GET\",\"path\":\"/a\"}}}}\n");
        let (jobs, errors) = parse_lines(std::io::Cursor::new(input).lines(), Some(&config), &LaneId::default());
        assert_eq!(jobs.len(), 1);
        assert!(errors[0].starts_with("line 1: request.body: 102 bytes, over api.max_body (64 bytes)"), "{}", errors[0]);
        assert!(errors[1].starts_with("line 2: request.headers: `x-lane`"), "{}", errors[1]);
    }

    /// A body `max_body` allows but that takes longer to send than `api.timeout` lets a
    /// call take was enqueued, and could only ever time out.
    #[test]
    fn a_body_that_cannot_be_sent_within_the_timeout_is_refused_with_its_reason() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\nmax_body = \"64MiB\"\ntimeout = \"2s\"\n[quota]\ntiers = [\"1/s\"]\n";
        let config = paceline_shared::config::Config::parse(text, std::path::Path::new("."), &|_| None).unwrap();
        let job = |mb: usize| format!("{{\"request\":{{\"method\":\"POST\",\"path\":\"/a\",\"body\":\"{}\"}}}}\n", "x".repeat(mb << 20));
        let (jobs, errors) = parse_lines(std::io::Cursor::new(format!("{}{}", job(30), job(10))).lines(), Some(&config), &LaneId::default());
        assert_eq!(jobs.len(), 1, "10 MiB go in about 1 s");
        assert!(errors[0].starts_with("line 1: request.body: 31457282 bytes take about 3.1 s to send"), "{}", errors[0]);
        assert!(errors[0].contains("not within api.timeout (2 s)"), "{}", errors[0]);
    }

    #[test]
    fn a_job_whose_cost_a_tier_can_never_hold_is_refused_with_its_line_number() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"10/s\", \"5/min burst=3\"]\n";
        let config = paceline_shared::config::Config::parse(text, std::path::Path::new("."), &|_| None).unwrap();
        let input = "{\"id\":\"a\",\"request\":{\"method\":\"GET\",\"path\":\"/a\"},\"cost\":3}\n{\"id\":\"b\",\"request\":{\"method\":\"GET\",\"path\":\"/b\"},\"cost\":4}\n";
        let (jobs, errors) = parse_lines(std::io::Cursor::new(input).lines(), Some(&config), &LaneId::default());
        assert_eq!(jobs.iter().map(|job| job.id.as_str()).collect::<Vec<_>>(), vec!["a"]);
        assert_eq!(errors, vec!["line 2: cost 4 exceeds the whole 5/min burst=3 tier: it could never be called".to_owned()]);
    }

    #[test]
    fn a_job_whose_cost_its_lane_s_own_tier_can_never_hold_is_refused_naming_the_lane() {
        let text = "[api]\nbase_url = \"https://api.example.com\"\n[quota]\ntiers = [\"20/s\"]\n[lanes]\ntiers = [\"5/s\"]\n[lanes.big]\ntiers = [\"10/s\"]\n";
        let config = paceline_shared::config::Config::parse(text, std::path::Path::new("."), &|_| None).unwrap();
        let input = "{\"id\":\"a\",\"lane\":\"big\",\"request\":{\"method\":\"GET\",\"path\":\"/a\"},\"cost\":8}\n{\"id\":\"b\",\"request\":{\"method\":\"GET\",\"path\":\"/b\"},\"cost\":8}\n";
        let (jobs, errors) = parse_lines(std::io::Cursor::new(input).lines(), Some(&config), &LaneId::default());
        assert_eq!(jobs.iter().map(|job| job.id.as_str()).collect::<Vec<_>>(), vec!["a"], "lane big's own 10/s holds 8");
        assert_eq!(errors, vec!["line 2: cost 8 exceeds the whole 5/s tier of lane default: it could never be called".to_owned()]);
    }
}

//! The simulator's SQS queue, DynamoDB store and Lambda keep the same port contracts as the
//! embedded store and the AWS adapters (`paceline_shared::testing::contract`).

use std::sync::Arc;
use std::time::Duration;

use paceline_shared::adapters::memory::RecordingWorker;
use paceline_shared::quota::{chrono_tz, Quota};
use paceline_shared::testing::contract;
use paceline_shared::time::{Clock, TokioClock, UnixMillis};
use paceline_sim::aws::{SimLambda, SimQueue, SimStore, World};
use paceline_sim::profile::{LatencyProfile, Sampler};

fn world() -> Arc<World> {
    let clock = Arc::new(TokioClock::anchored_at(UnixMillis(1_795_824_000_000)));
    Arc::new(World::new(clock, Sampler::new(1, LatencyProfile::default())))
}

#[tokio::test(start_paused = true)]
async fn the_simulated_queue_keeps_the_job_queue_contract() {
    let world = world();
    contract::job_queue(&SimQueue::new(world.clone()), world.clock.as_ref()).await;
}

#[tokio::test(start_paused = true)]
async fn the_simulated_store_keeps_the_state_store_contract() {
    let quota = Quota::new(vec!["5/s".parse().unwrap()], chrono_tz::UTC, Duration::ZERO).unwrap();
    contract::state_store(Arc::new(SimStore::new(world())), &quota).await;
}

#[tokio::test(start_paused = true)]
async fn the_simulated_lambda_keeps_the_invoker_contract() {
    let world = world();
    let worker = Arc::new(RecordingWorker::default());
    let lambda = SimLambda::new(world.clone(), worker.clone(), Arc::default(), 0);
    contract::invoker(&lambda, || async {
        // Lambda's async start, as the default profile draws it, is well under a minute.
        world.clock.sleep_until(world.clock.now().plus(Duration::from_secs(60))).await;
        worker.ran()
    })
    .await;
}

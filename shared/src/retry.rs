//! Waiting out a busy store: an operation that meets a passing fault (another process
//! holding SQLite's lock, a throttled request) is tried again after a pause that starts
//! at [`FIRST_WAIT`] and doubles up to [`MAX_WAIT`], until it succeeds, fails for good,
//! or a deadline passes. The worker settles an answer with it, and the embedded invoker
//! a hand-off: both must not leave half-done what a call already did.

use std::future::Future;
use std::time::Duration;

use tracing::warn;

use crate::ports::PortResult;
use crate::time::{Clock, UnixMillis};

/// The first pause after a passing fault.
pub const FIRST_WAIT: Duration = Duration::from_millis(100);
/// The longest pause between tries.
pub const MAX_WAIT: Duration = Duration::from_secs(5);

/// Runs `operation` until it succeeds or fails for good, pausing on `clock` after each
/// passing fault; past `give_up_at` (if any) a passing fault is returned as it is.
/// `what` names the operation in the warning each retry logs.
///
/// # Errors
/// The operation's last error: one that is not retryable, or any after `give_up_at`.
pub async fn while_busy<T, F, Fut>(clock: &dyn Clock, give_up_at: Option<UnixMillis>, what: &str, mut operation: F) -> PortResult<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = PortResult<T>>,
{
    let mut wait = FIRST_WAIT;
    loop {
        match operation().await {
            Err(e) if e.is_retryable() && give_up_at.is_none_or(|at| clock.now() < at) => {
                warn!(error = %e, retry_in_ms = wait.as_millis() as u64, "{what}; retrying");
                clock.sleep_until(clock.now().plus(wait)).await;
                wait = (wait * 2).min(MAX_WAIT);
            }
            settled => return settled,
        }
    }
}

#[cfg(test)]
mod tests {
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::sync::Arc;

    use super::*;
    use crate::ports::PortError;
    use crate::time::TokioClock;

    const T0: UnixMillis = UnixMillis(1_795_824_000_000);

    /// Fails with `error` the first `failures` times, then succeeds; counts the tries.
    fn flaky(failures: u32, error: PortError) -> (Arc<AtomicU32>, impl FnMut() -> std::future::Ready<PortResult<u32>>) {
        let tries = Arc::new(AtomicU32::new(0));
        let counted = tries.clone();
        (tries, move || {
            let n = counted.fetch_add(1, Ordering::SeqCst) + 1;
            std::future::ready(if n <= failures { Err(error.clone()) } else { Ok(n) })
        })
    }

    #[tokio::test(start_paused = true)]
    async fn a_passing_fault_is_waited_out_with_doubling_pauses_up_to_the_most() {
        let clock = TokioClock::anchored_at(T0);
        let (_, operation) = flaky(7, PortError::Throttled("locked".into()));
        assert_eq!(while_busy(&clock, None, "settling", operation).await, Ok(8));
        // 100 + 200 + 400 + 800 + 1600 + 3200 + 5000 ms.
        assert_eq!(clock.now().since(T0), Duration::from_millis(11_300));
    }

    #[tokio::test(start_paused = true)]
    async fn a_lasting_fault_is_returned_past_the_deadline_and_a_fatal_one_at_once() {
        let clock = TokioClock::anchored_at(T0);
        let (tries, operation) = flaky(u32::MAX, PortError::Throttled("locked".into()));
        let gave_up = while_busy(&clock, Some(T0.plus(Duration::from_secs(1))), "settling", operation).await;
        assert_eq!((gave_up, tries.load(Ordering::SeqCst)), (Err(PortError::Throttled("locked".into())), 5), "tries at 0, 100, 300, 700 and 1500 ms");
        let (tries, operation) = flaky(u32::MAX, PortError::Fatal("no table".into()));
        assert!(while_busy(&clock, None, "settling", operation).await.is_err());
        assert_eq!(tries.load(Ordering::SeqCst), 1);
    }
}

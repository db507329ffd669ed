//! Ending the background tasks a command started before it returns.

/// Ends `tasks` and waits until each has. A task aborted but not awaited may still be in
/// its poll when the runtime shuts down; if it then touches a timer, tokio panics ("A
/// Tokio 1.x context was found, but it is being shutdown") and the panic lands on stderr.
pub async fn end_all(tasks: impl IntoIterator<Item = tokio::task::JoinHandle<()>>) {
    for task in tasks {
        task.abort();
        let _ = task.await;
    }
}

//! A `paceline` built without the `aws` feature: every command on the embedded store,
//! and a clear refusal for a stack on AWS.

use paceline_shared::config::{AwsBackend, Config};

use super::{OperatorStack, StackArgs};

/// No orchestrator function can be reached without AWS: this is never made.
pub enum OrchestratorFunction {}

impl OrchestratorFunction {
    /// Never called: there is no value to call it on.
    ///
    /// # Errors
    /// None.
    pub async fn kick(&self, _event: String) -> anyhow::Result<()> {
        match *self {}
    }
}

/// Refuses an AWS stack, saying how to get a `paceline` that reaches it.
pub(super) async fn open(_args: &StackArgs, _config: Option<Config>, _aws: AwsBackend) -> anyhow::Result<OperatorStack> {
    anyhow::bail!("this paceline was built without AWS (--no-default-features): `cargo install --path cli` builds one that reaches an AWS stack")
}

//! `paceline circuit open [--hold]|close`: an operator's hand on the circuit breaker.
//! Like a worker's or a health check's, the change is conditioned on the epoch it was
//! decided from, so it never undoes a newer change it did not see. A hold keeps the
//! circuit open until an operator closes it: no health check is sent meanwhile.

use anyhow::bail;
use clap::Subcommand;
use paceline_shared::adaptive::ProviderReading;
use paceline_shared::breaker::{Circuit, Refusal};
use paceline_shared::lane::LaneId;
use paceline_shared::ports::{PortError, StateStore};
use paceline_shared::time::{system_now, UnixMillis};

use crate::access::{OperatorStack, StackArgs};

/// What an operator's clear of the provider's limits ended.
pub(crate) struct ClearedLimits {
    /// The end of the cool-down it cleared.
    pub cool_down: Option<UnixMillis>,
    /// The reading it forgot.
    pub reading: Option<ProviderReading>,
}

impl ClearedLimits {
    pub fn print(&self) {
        if let Some(until) = self.cool_down {
            println!("cool-down until {} cleared", until.to_rfc3339());
        }
        if let Some(r) = &self.reading {
            println!("the provider's reading forgotten ({} of {} left until {}): the configured pace again", r.remaining, r.limit, r.resets_at.to_rfc3339());
        }
    }
}

/// Ends the cool-down and forgets the provider's reading (a run forgets what they said
/// within `state_refresh`): what `circuit close` and `rate reset` share. In a stack
/// whose 429s cool every lane, the stack's cool-down ends too.
pub(crate) async fn clear_provider_limits(stack: &OperatorStack, state: &dyn StateStore) -> anyhow::Result<ClearedLimits> {
    let now = system_now();
    let mut cool_down = Some(state.cool_down().await?).filter(|until| *until > now);
    let reading = state.provider_reading().await?;
    state.clear_cool_down().await?;
    if let Some(shared) = stack.stack_cool_down() {
        cool_down = cool_down.max(Some(shared.cool_down().await?).filter(|until| *until > now));
        shared.clear_cool_down().await?;
    }
    Ok(ClearedLimits { cool_down, reading })
}

/// `Circuit::open`, `Circuit::hold` or `Circuit::close`.
type Transition = fn(&Circuit, u64, &str, UnixMillis) -> Result<Circuit, Refusal>;

/// Open or close the circuit.
#[derive(Debug, clap::Args)]
pub struct CircuitArgs {
    #[command(flatten)]
    pub stack: StackArgs,
    #[command(subcommand)]
    pub action: CircuitAction,
    /// The lane whose state this acts on, with `[lanes]` (`default` without).
    #[arg(long, global = true, value_name = "ID")]
    pub lane: Option<LaneId>,
    /// Print the outcome as JSON: the circuit after the command, whether it changed,
    /// and a cool-down it cleared.
    #[arg(long, global = true)]
    pub json: bool,
}

/// `circuit --json`.
#[derive(serde::Serialize)]
pub struct CircuitChanged {
    changed: bool,
    status: paceline_shared::breaker::CircuitStatus,
    epoch: u64,
    reason: String,
    held: bool,
    since: String,
    /// The end of a cool-down `close` cleared.
    cool_down_cleared: Option<String>,
    /// Why nothing changed.
    note: Option<String>,
}

impl CircuitChanged {
    fn of(circuit: &Circuit, changed: bool, cool_down_cleared: Option<String>, note: Option<String>) -> Self {
        Self {
            changed,
            status: circuit.status,
            epoch: circuit.epoch,
            reason: circuit.reason.clone(),
            held: circuit.held,
            since: circuit.since.to_rfc3339(),
            cool_down_cleared,
            note,
        }
    }
}

#[derive(Debug, Subcommand)]
pub enum CircuitAction {
    /// Stop dispatching jobs. The orchestrator then sends health checks; a healthy one
    /// half-opens the circuit and jobs ramp back up. With `--hold`, it stays open (no
    /// health checks) until `paceline circuit close`.
    Open(OpenChange),
    /// Let jobs flow again now at the full pace, without waiting for a health check;
    /// lifts a hold, ends a cool-down the API asked for and forgets the API's rate-limit
    /// reading (as `paceline rate reset`).
    Close(Change),
}

#[derive(Debug, clap::Args)]
pub struct OpenChange {
    #[command(flatten)]
    pub change: Change,
    /// Keep it open until an operator closes it: health checks do not undo it.
    #[arg(long)]
    pub hold: bool,
}

#[derive(Debug, clap::Args)]
pub struct Change {
    /// Why (shown by `paceline status` as `operator: REASON`).
    #[arg(long)]
    pub reason: Option<String>,
    /// Change it only if it is still at this epoch (as `paceline status` showed it).
    #[arg(long)]
    pub epoch: Option<u64>,
}

impl CircuitArgs {
    /// # Errors
    /// A bad lane, an unavailable store, or a circuit that moved past `--epoch`.
    pub async fn run(self) -> anyhow::Result<()> {
        let stack = self.stack.open().await?;
        let (changed, said, cleared) = change_circuit(&stack, self.lane.as_ref(), &self.action).await?;
        if self.json {
            println!("{}", serde_json::to_string_pretty(&changed)?);
        } else {
            if let Some(cleared) = cleared {
                cleared.print();
            }
            println!("{said}");
        }
        Ok(())
    }
}

/// Opens, holds or closes `lane`'s circuit (the stack's without lanes) as `action` says:
/// the circuit after it, what to say of it, and what a close cleared.
///
/// # Errors
/// A bad lane, an unavailable store, or a circuit that moved past the epoch given.
pub(crate) async fn change_circuit(
    stack: &OperatorStack,
    lane: Option<&LaneId>,
    action: &CircuitAction,
) -> anyhow::Result<(CircuitChanged, String, Option<ClearedLimits>)> {
    let state = stack.lane_state(lane)?;
    let cleared = match action {
        CircuitAction::Close(_) => Some(clear_provider_limits(stack, state.as_ref()).await?),
        CircuitAction::Open(_) => None,
    };
    let cool_down_cleared = cleared.as_ref().and_then(|cleared| cleared.cool_down).map(|until| until.to_rfc3339());
    let said = |circuit: &Circuit, changed: bool, note: String| {
        let json = CircuitChanged::of(circuit, changed, cool_down_cleared.clone(), (!changed).then(|| note.clone()));
        (json, note)
    };
    let current = state.circuit().await?;
    let (change, transition): (&Change, Transition) = match action {
        CircuitAction::Open(OpenChange { change, hold: true }) => (change, Circuit::hold),
        CircuitAction::Open(OpenChange { change, hold: false }) => (change, Circuit::open),
        CircuitAction::Close(change) => (change, Circuit::close),
    };
    let seen = change.epoch.unwrap_or(current.epoch);
    let reason = change.reason.as_ref().map_or_else(|| "operator".to_owned(), |why| format!("operator: {why}"));
    let next = match transition(&current, seen, &reason, system_now()) {
        Ok(next) => next,
        Err(Refusal::Already(status)) => {
            let (json, note) = said(&current, false, format!("the circuit is already {status} (epoch {}): nothing to do", current.epoch));
            return Ok((json, note, cleared));
        }
        Err(Refusal::Held) => {
            let (json, note) =
                said(&current, false, format!("the circuit is already held open (epoch {}): `paceline circuit close` lifts the hold", current.epoch));
            return Ok((json, note, cleared));
        }
        Err(Refusal::Stale { seen, current }) => {
            bail!("the circuit is at epoch {current}, not {seen}: it changed since; check `paceline status` and decide again")
        }
    };
    match state.swap_circuit(seen, &next).await {
        Ok(()) => {
            let held = if next.held { ", held until `paceline circuit close`" } else { "" };
            let (json, note) = said(&next, true, format!("circuit {} at epoch {} ({}){held}", next.status, next.epoch, next.reason));
            Ok((json, note, cleared))
        }
        Err(PortError::Conflict(_)) => bail!("the circuit changed while we wrote (epoch {seen} is gone); check `paceline status` and decide again"),
        Err(e) => Err(e.into()),
    }
}

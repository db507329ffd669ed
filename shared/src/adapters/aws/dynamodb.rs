//! Lane state in one DynamoDB table keyed by `pk` (string): the lease with its fencing
//! epoch, quota usage counters (atomic `ADD`), the pacer snapshot (written only while the
//! lease's epoch is unchanged, in a transaction), the circuit (epoch-conditioned) and
//! the cool-down (only ever extended).

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{AttributeValue, ConditionCheck, Put, ReturnValue, TransactWriteItem};
use aws_sdk_dynamodb::Client;

use super::{build_error, map_sdk_error};
use crate::breaker::{Circuit, CircuitStatus};
use crate::ports::{Lease, PacerSnapshot, PortError, PortResult, StateStore};
use crate::time::UnixMillis;

const LEASE: &str = "lease";
const PACER: &str = "pacer";
const CIRCUIT: &str = "circuit";
const COOL_DOWN: &str = "cool_down";

/// The state store on DynamoDB.
#[derive(Clone, Debug)]
pub struct DynamoStateStore {
    client: Client,
    table: String,
}

type Item = HashMap<String, AttributeValue>;

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

fn get_n(item: &Item, key: &str) -> u64 {
    item.get(key).and_then(|v| v.as_n().ok()).and_then(|v| v.parse().ok()).unwrap_or(0)
}

fn get_s<'a>(item: &'a Item, key: &str) -> &'a str {
    item.get(key).and_then(|v| v.as_s().ok()).map_or("", String::as_str)
}

fn lease_of(item: &Item) -> Lease {
    Lease { holder: get_s(item, "holder").to_owned(), epoch: get_n(item, "epoch"), expires_at: UnixMillis(get_n(item, "expires_at")) }
}

impl DynamoStateStore {
    #[must_use]
    pub fn new(client: Client, table: impl Into<String>) -> Self {
        Self { client, table: table.into() }
    }

    async fn get(&self, pk: &str) -> PortResult<Option<Item>> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", s(pk))
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb GetItem", &e))?;
        Ok(out.item().cloned())
    }
}

#[async_trait]
impl StateStore for DynamoStateStore {
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(LEASE))
            .update_expression("SET holder = :h, expires_at = :e ADD epoch :one")
            .condition_expression("attribute_not_exists(pk) OR expires_at <= :now")
            .expression_attribute_values(":h", s(holder))
            .expression_attribute_values(":e", n(now.plus(ttl).0))
            .expression_attribute_values(":now", n(now.0))
            .expression_attribute_values(":one", n(1))
            .return_values(ReturnValue::AllNew)
            .send()
            .await;
        match result {
            Ok(out) => Ok(lease_of(&out.attributes().cloned().unwrap_or_default())),
            Err(e) => match map_sdk_error("dynamodb UpdateItem (lease)", &e) {
                PortError::Conflict(_) => {
                    let current = self.get(LEASE).await?.map(|i| lease_of(&i));
                    let who = current.map_or_else(|| "someone".to_owned(), |l| format!("{} until {}", l.holder, l.expires_at));
                    Err(PortError::Conflict(format!("lease held by {who}")))
                }
                other => Err(other),
            },
        }
    }

    async fn renew_lease(&self, lease: &Lease, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        let out = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(LEASE))
            .update_expression("SET expires_at = :e")
            .condition_expression("epoch = :epoch AND holder = :h")
            .expression_attribute_values(":e", n(now.plus(ttl).0))
            .expression_attribute_values(":epoch", n(lease.epoch))
            .expression_attribute_values(":h", s(&lease.holder))
            .return_values(ReturnValue::AllNew)
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb UpdateItem (lease renewal)", &e))?;
        Ok(lease_of(&out.attributes().cloned().unwrap_or_default()))
    }

    async fn release_lease(&self, lease: &Lease) -> PortResult<()> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(LEASE))
            // No holder: the old holder can neither renew it nor save under it.
            .update_expression("SET expires_at = :zero REMOVE holder")
            .condition_expression("epoch = :epoch")
            .expression_attribute_values(":zero", n(0))
            .expression_attribute_values(":epoch", n(lease.epoch))
            .send()
            .await;
        match result.map_err(|e| map_sdk_error("dynamodb UpdateItem (lease release)", &e)) {
            Ok(_) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn lease(&self) -> PortResult<Option<Lease>> {
        Ok(self.get(LEASE).await?.map(|i| lease_of(&i)).filter(|l| !l.holder.is_empty()))
    }

    async fn load_usage(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        let mut used = Vec::with_capacity(keys.len());
        for key in keys {
            used.push(self.get(key).await?.map_or(0, |i| get_n(&i, "used")));
        }
        Ok(used)
    }

    async fn add_usage(&self, deltas: &[(String, i64)]) -> PortResult<()> {
        for (key, delta) in deltas {
            self.client
                .update_item()
                .table_name(&self.table)
                .key("pk", s(key))
                .update_expression("ADD used :d")
                .expression_attribute_values(":d", n(delta))
                .send()
                .await
                .map_err(|e| map_sdk_error("dynamodb UpdateItem (usage)", &e))?;
        }
        Ok(())
    }

    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>> {
        let Some(item) = self.get(PACER).await? else { return Ok(None) };
        serde_json::from_str(get_s(&item, "snapshot")).map(Some).map_err(|e| PortError::Fatal(format!("stored pacer snapshot is unreadable: {e}")))
    }

    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        let json = serde_json::to_string(snapshot).map_err(|e| PortError::Fatal(e.to_string()))?;
        let check = ConditionCheck::builder()
            .table_name(&self.table)
            .key("pk", s(LEASE))
            .condition_expression("epoch = :epoch AND holder = :h")
            .expression_attribute_values(":epoch", n(lease.epoch))
            .expression_attribute_values(":h", s(&lease.holder))
            .build()
            .map_err(build_error)?;
        let put = Put::builder().table_name(&self.table).item("pk", s(PACER)).item("snapshot", s(json)).build().map_err(build_error)?;
        self.client
            .transact_write_items()
            .transact_items(TransactWriteItem::builder().condition_check(check).build())
            .transact_items(TransactWriteItem::builder().put(put).build())
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb TransactWriteItems (pacer)", &e))?;
        Ok(())
    }

    async fn circuit(&self) -> PortResult<Circuit> {
        let Some(item) = self.get(CIRCUIT).await? else { return Ok(Circuit::default()) };
        Ok(Circuit {
            status: if get_s(&item, "status") == "open" { CircuitStatus::Open } else { CircuitStatus::Closed },
            epoch: get_n(&item, "epoch"),
            since: UnixMillis(get_n(&item, "since")),
            reason: get_s(&item, "reason").to_owned(),
        })
    }

    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()> {
        let condition = if expected_epoch == 0 { "attribute_not_exists(epoch) OR epoch = :expected" } else { "epoch = :expected" };
        self.client
            .put_item()
            .table_name(&self.table)
            .item("pk", s(CIRCUIT))
            .item("status", s(next.status.to_string()))
            .item("epoch", n(next.epoch))
            .item("since", n(next.since.0))
            .item("reason", s(if next.reason.is_empty() { "-" } else { next.reason.as_str() }))
            .condition_expression(condition)
            .expression_attribute_values(":expected", n(expected_epoch))
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb PutItem (circuit)", &e))?;
        Ok(())
    }

    async fn cool_down(&self) -> PortResult<UnixMillis> {
        Ok(UnixMillis(self.get(COOL_DOWN).await?.map_or(0, |i| get_n(&i, "until"))))
    }

    async fn extend_cool_down(&self, until: UnixMillis) -> PortResult<()> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(COOL_DOWN))
            .update_expression("SET #until = :u")
            .condition_expression("attribute_not_exists(#until) OR #until < :u")
            .expression_attribute_names("#until", "until")
            .expression_attribute_values(":u", n(until.0))
            .send()
            .await;
        match result.map_err(|e| map_sdk_error("dynamodb UpdateItem (cool-down)", &e)) {
            // Already later: nothing to do.
            Ok(_) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn clear_cool_down(&self) -> PortResult<()> {
        self.client
            .delete_item()
            .table_name(&self.table)
            .key("pk", s(COOL_DOWN))
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb DeleteItem (cool-down)", &e))?;
        Ok(())
    }
}

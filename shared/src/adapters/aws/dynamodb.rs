//! A stack's state in one DynamoDB table keyed by `pk` (string): the lease with its
//! fencing epoch, quota usage counters (atomic `ADD`), the pacer snapshot (written only
//! while the lease's epoch is unchanged, in a transaction), the circuit
//! (epoch-conditioned), the cool-down (only ever extended), the provider's latest
//! rate-limit reading (only ever replaced by a later one) and an operator's change of a
//! lane's settings. Each lane's items are its own, their keys prefixed by the lane
//! ([`StoreScope`]), so 1,000 lanes spread over the table's partitions; the lease is the
//! stack's.

use std::collections::HashMap;
use std::time::Duration;

use async_trait::async_trait;
use aws_sdk_dynamodb::types::{AttributeValue, ConditionCheck, KeysAndAttributes, Put, ReturnValue, TransactWriteItem};
use aws_sdk_dynamodb::Client;

use super::{build_error, map_sdk_error};
use crate::adaptive::ProviderReading;
use crate::breaker::{Circuit, FAILURE_BUCKET_PREFIX, FAILURE_BUCKET_TTL};
use crate::config::LaneChange;
use crate::keys::{Shard, StoreScope, LANE_CHANGE};
use crate::lane::LaneId;
use crate::order::{OrderMark, OrderState, ORDER_MARK};
use crate::ports::{
    slot_probe_start, BatchClaim, BatchProgress, CallClaim, LaneFirstRead, LaneSignals, Lease, PacerSnapshot, PortError, PortResult, ScopedStores,
    SharedReservation, StackDocument, StackDocuments, StateStore, PACERS_A_TRANSACTION,
};
use crate::time::UnixMillis;

const PACER: &str = "pacer";
/// How many shards the stack's runs run as (see [`DynamoStateStore::shard_layout`]).
const SHARD_LAYOUT: &str = "shard_layout";
/// How many times a shard asks a shared counter for units that other shards' writes keep
/// taking first (a few shards reserve a block every few seconds each: one retry is rare).
const SHARED_RESERVATION_TRIES: usize = 8;
const CIRCUIT: &str = "circuit";
const COOL_DOWN: &str = "cool_down";
const PROVIDER_READING: &str = "provider_reading";
/// Call slot items are this prefix and their index (see `take_call_slot`).
const CALL_SLOT: &str = "call_slot#";
/// The stack's item listing the lanes an operator changed (a string set `lanes`), so
/// `lanes_with_state` needs no scan of the table.
const CHANGED_LANES: &str = "stack#changed_lanes";

/// The state store on DynamoDB: one scope's state (the default lane's unless
/// [`DynamoStateStore::scoped`]).
#[derive(Clone, Debug)]
pub struct DynamoStateStore {
    client: Client,
    table: String,
    scope: StoreScope,
    /// The item of the lease its orchestrator holds: its shard's.
    lease_key: String,
}

type Item = HashMap<String, AttributeValue>;

fn s(v: impl Into<String>) -> AttributeValue {
    AttributeValue::S(v.into())
}

fn n(v: impl ToString) -> AttributeValue {
    AttributeValue::N(v.to_string())
}

/// The circuit as stored in its item.
fn circuit_of(item: &Item) -> PortResult<Circuit> {
    Ok(Circuit {
        status: get_s(item, "status").parse().map_err(PortError::Fatal)?,
        epoch: get_n(item, "epoch"),
        since: UnixMillis(get_n(item, "since")),
        reason: get_s(item, "reason").to_owned(),
        reopened: u32::try_from(get_n(item, "reopened")).unwrap_or(u32::MAX),
        held: item.get("held").and_then(|v| v.as_bool().ok()).copied().unwrap_or(false),
    })
}

/// The provider reading as stored in its item (`None` before the first).
fn provider_reading_of(item: &Item) -> Option<ProviderReading> {
    item.contains_key("at").then(|| ProviderReading {
        limit: get_n(item, "quota_limit"),
        remaining: get_n(item, "remaining"),
        window_ms: item.get("window_ms").and_then(|v| v.as_n().ok()).and_then(|v| v.parse().ok()),
        resets_at: UnixMillis(get_n(item, "resets_at")),
        at: UnixMillis(get_n(item, "at")),
    })
}

/// A lane's signals from its items, found by name (none: a closed circuit, no cool-down,
/// no reading).
fn signals_of<'a>(item: impl Fn(&str) -> Option<&'a Item>) -> PortResult<LaneSignals> {
    Ok(LaneSignals {
        circuit: item(CIRCUIT).map_or_else(|| Ok(Circuit::default()), circuit_of)?,
        cool_down: UnixMillis(item(COOL_DOWN).map_or(0, |i| get_n(i, "until"))),
        provider_reading: item(PROVIDER_READING).and_then(provider_reading_of),
    })
}

/// A pacer snapshot from its item.
fn pacer_of(item: &Item) -> PortResult<PacerSnapshot> {
    serde_json::from_str(get_s(item, "snapshot")).map_err(|e| PortError::Unreadable(format!("stored pacer snapshot: {e}")))
}

/// An operator's change of `scope`'s lane settings, as stored in its item.
fn lane_change_of(item: &Item, scope: &StoreScope) -> PortResult<LaneChange> {
    serde_json::from_str(get_s(item, "change")).map_err(|e| PortError::Unreadable(format!("stored settings of {scope}: {e}")))
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
        Self { client, table: table.into(), scope: StoreScope::default_lane(), lease_key: Shard::WHOLE.lease_key() }
    }

    /// The same table, for the orchestrator of shard `shard`: its lease is the shard's
    /// (shard 0's is a stack of one shard's).
    #[must_use]
    pub fn for_shard(self, shard: Shard) -> Self {
        Self { lease_key: shard.lease_key(), ..self }
    }

    /// The same table, reading and writing `scope`'s state (a lane's pacer, circuit,
    /// cool-down, counters, call records and slots, settings; or the stack's); the
    /// lease is shared.
    #[must_use]
    pub fn scoped(&self, scope: &StoreScope) -> Self {
        Self { scope: scope.clone(), ..self.clone() }
    }

    /// How many shards the stack's runs last ran as: 1 for a stack that never had more.
    ///
    /// # Errors
    /// Transport errors.
    pub async fn shard_layout(&self) -> PortResult<usize> {
        let item = self.get_item(s(SHARD_LAYOUT)).await?;
        Ok(item.map_or(1, |item| usize::try_from(get_n(&item, "shards")).unwrap_or(1).max(1)))
    }

    /// Records that the stack's runs run as `to` shards from now, if they ran as `from`:
    /// `false` when another run changed it first.
    ///
    /// # Errors
    /// Transport errors.
    pub async fn switch_shard_layout(&self, from: usize, to: usize) -> PortResult<bool> {
        let put = self.client.put_item().table_name(&self.table).item("pk", s(SHARD_LAYOUT)).item("shards", n(to));
        let put = if from == 1 { put.condition_expression("attribute_not_exists(pk) OR shards = :from") } else { put.condition_expression("shards = :from") };
        match put.expression_attribute_values(":from", n(from)).send().await.map_err(|e| map_sdk_error("dynamodb PutItem (shard layout)", &e)) {
            Ok(_) => Ok(true),
            Err(PortError::Conflict(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The item key of `name` in this store's scope.
    fn pk(&self, name: &str) -> AttributeValue {
        s(self.scope.key(name))
    }

    /// A transaction's check that `lease` is still held.
    fn lease_check(&self, lease: &Lease) -> PortResult<ConditionCheck> {
        ConditionCheck::builder()
            .table_name(&self.table)
            .key("pk", s(&self.lease_key))
            .condition_expression("epoch = :epoch AND holder = :h")
            .expression_attribute_values(":epoch", n(lease.epoch))
            .expression_attribute_values(":h", s(&lease.holder))
            .build()
            .map_err(build_error)
    }

    /// The put of `scope`'s pacer snapshot, and its size in bytes.
    fn pacer_put(&self, scope: &StoreScope, snapshot: &PacerSnapshot) -> PortResult<(usize, Put)> {
        let json = serde_json::to_string(snapshot).map_err(|e| PortError::Fatal(e.to_string()))?;
        let bytes = json.len();
        let put = Put::builder().table_name(&self.table).item("pk", s(scope.key(PACER))).item("snapshot", s(json)).build().map_err(build_error)?;
        Ok((bytes, put))
    }

    /// `puts` in one transaction with the check that `lease` is still held.
    async fn save_while_held(&self, lease: &Lease, puts: Vec<Put>, what: &str) -> PortResult<()> {
        let items = std::iter::once(TransactWriteItem::builder().condition_check(self.lease_check(lease)?).build())
            .chain(puts.into_iter().map(|put| TransactWriteItem::builder().put(put).build()));
        let request = self.client.transact_write_items().set_transact_items(Some(items.collect()));
        request.send().await.map_err(|e| map_sdk_error(what, &e))?;
        Ok(())
    }

    /// The items of these names (in this scope) that exist, read consistently, 100 a
    /// request.
    async fn batch_get(&self, names: &[String], what: &str) -> PortResult<Vec<Item>> {
        let keys: Vec<String> = names.iter().map(|name| self.scope.key(name)).collect();
        self.batch_get_keys(&keys, what).await
    }

    /// The items of these keys (in any scope) that exist, read consistently, 100 a
    /// request.
    async fn batch_get_keys(&self, keys: &[String], what: &str) -> PortResult<Vec<Item>> {
        let mut found = Vec::new();
        for batch in keys.chunks(100) {
            let keys: Vec<Item> = batch.iter().map(|key| HashMap::from([("pk".to_owned(), s(key.as_str()))])).collect();
            let wanted = KeysAndAttributes::builder().set_keys(Some(keys)).consistent_read(true).build().map_err(build_error)?;
            let out = self
                .client
                .batch_get_item()
                .request_items(&self.table, wanted)
                .send()
                .await
                .map_err(|e| map_sdk_error(&format!("dynamodb BatchGetItem ({what})"), &e))?;
            if out.unprocessed_keys().is_some_and(|left| !left.is_empty()) {
                return Err(PortError::Throttled(format!("dynamodb BatchGetItem left {what} unread")));
            }
            found.extend(out.responses().and_then(|by_table| by_table.get(&self.table)).into_iter().flatten().cloned());
        }
        Ok(found)
    }

    /// The items `names` of each of `lanes`, read together ([`Self::batch_get_keys`]),
    /// each lane's made into what `each` makes of them (its scope, and its item of a name).
    async fn lanes_items<T>(
        &self,
        lanes: &[LaneId],
        names: &[&str],
        what: &str,
        each: impl for<'i> Fn(&StoreScope, &dyn Fn(&str) -> Option<&'i Item>) -> PortResult<T>,
    ) -> PortResult<Vec<T>> {
        let scopes: Vec<StoreScope> = lanes.iter().map(|lane| StoreScope::Lane(lane.clone())).collect();
        let keys: Vec<String> = scopes.iter().flat_map(|scope| names.iter().map(|name| scope.key(name))).collect();
        let items = self.batch_get_keys(&keys, what).await?;
        let by_key: HashMap<&str, &Item> = items.iter().map(|item| (get_s(item, "pk"), item)).collect();
        scopes.iter().map(|scope| each(scope, &|name: &str| by_key.get(scope.key(name).as_str()).copied())).collect()
    }

    /// Claims record `key` (a call's or a batch's) for `holder` until `expires_at`: taken
    /// when there is none, or a claim that expired.
    fn claim(
        &self,
        key: &str,
        holder: &str,
        now: UnixMillis,
        expires_at: UnixMillis,
    ) -> aws_sdk_dynamodb::operation::update_item::builders::UpdateItemFluentBuilder {
        self.client
            .update_item()
            .table_name(&self.table)
            .key("pk", self.pk(key))
            .update_expression("SET #state = :calling, holder = :h, expires_at = :x, expires_at_seconds = :xs")
            .condition_expression("attribute_not_exists(#state) OR (#state = :calling AND expires_at <= :now)")
            .expression_attribute_names("#state", "state")
            .expression_attribute_values(":calling", s("calling"))
            .expression_attribute_values(":h", s(holder))
            .expression_attribute_values(":x", n(expires_at.0))
            .expression_attribute_values(":xs", n(expires_at.plus(FAILURE_BUCKET_TTL).0 / 1_000))
            .expression_attribute_values(":now", n(now.0))
    }

    /// The item of `name` in this scope.
    async fn get(&self, name: &str) -> PortResult<Option<Item>> {
        self.get_item(self.pk(name)).await
    }

    /// Deletes the item of `name` in this scope (`what` names it in errors).
    async fn delete(&self, name: &str, what: &str) -> PortResult<()> {
        let request = self.client.delete_item().table_name(&self.table).key("pk", self.pk(name));
        request.send().await.map_err(|e| map_sdk_error(&format!("dynamodb DeleteItem ({what})"), &e))?;
        Ok(())
    }

    async fn get_item(&self, pk: AttributeValue) -> PortResult<Option<Item>> {
        let out = self
            .client
            .get_item()
            .table_name(&self.table)
            .key("pk", pk)
            .consistent_read(true)
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb GetItem", &e))?;
        Ok(out.item().cloned())
    }
}

/// A stack's documents are items of their own (never scoped), each its JSON and its
/// version: a few hundred bytes; the share book is read and written by each shard once a
/// second, the lanes' homes read each `state_refresh`.
#[async_trait]
impl StackDocuments for DynamoStateStore {
    async fn document(&self, document: StackDocument) -> PortResult<Option<(String, u64)>> {
        let Some(item) = self.get_item(s(document.key())).await? else { return Ok(None) };
        Ok(Some((get_s(&item, "json").to_owned(), get_n(&item, "version"))))
    }

    async fn put_document(&self, document: StackDocument, json: &str, expected: Option<u64>) -> PortResult<bool> {
        let put = self.client.put_item().table_name(&self.table).item("pk", s(document.key())).item("json", s(json));
        let put = match expected {
            None => put.item("version", n(1)).condition_expression("attribute_not_exists(pk)"),
            Some(version) => put.item("version", n(version + 1)).condition_expression("version = :read").expression_attribute_values(":read", n(version)),
        };
        match put.send().await.map_err(|e| map_sdk_error("dynamodb PutItem (a stack's document)", &e)) {
            Ok(_) => Ok(true),
            Err(PortError::Conflict(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    async fn shared_counts(&self, keys: &[String]) -> PortResult<Vec<u64>> {
        let mut counts = Vec::with_capacity(keys.len());
        for key in keys {
            counts.push(self.get_item(s(StoreScope::Stack.key(key))).await?.map_or(0, |item| get_n(&item, "used")));
        }
        Ok(counts)
    }

    /// A conditional `ADD` (the counter at most `limit - units` before it); where another
    /// shard took units meanwhile, the counter is read and what is left asked for.
    async fn reserve_shared(&self, key: &str, wanted: u64, limit: u64) -> PortResult<SharedReservation> {
        let pk = s(StoreScope::Stack.key(key));
        let read_count = || async { Ok::<u64, PortError>(self.get_item(pk.clone()).await?.map_or(0, |item| get_n(&item, "used"))) };
        let mut units = wanted.min(limit);
        if units == 0 {
            return Ok(SharedReservation { units, count: read_count().await? });
        }
        for _ in 0..SHARED_RESERVATION_TRIES {
            let added = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("pk", pk.clone())
                .update_expression("ADD used :units")
                .condition_expression("attribute_not_exists(used) OR used <= :most")
                .expression_attribute_values(":units", n(units))
                .expression_attribute_values(":most", n(limit - units))
                .return_values(ReturnValue::UpdatedNew)
                .send()
                .await;
            match added.map_err(|e| map_sdk_error("dynamodb UpdateItem (a reservation from a shared counter)", &e)) {
                Ok(out) => {
                    let count = out.attributes().and_then(|item| item.get("used")).and_then(|used| used.as_n().ok()).and_then(|used| used.parse().ok());
                    return Ok(SharedReservation { units, count: count.unwrap_or(limit) });
                }
                Err(PortError::Conflict(_)) => {
                    let count = read_count().await?;
                    units = wanted.min(limit.saturating_sub(count));
                    if units == 0 {
                        return Ok(SharedReservation { units, count });
                    }
                }
                Err(e) => return Err(e),
            }
        }
        Err(PortError::Transient(format!("the shared counter {key} changed under each of {SHARED_RESERVATION_TRIES} reservations")))
    }

    async fn return_shared(&self, key: &str, units: u64) -> PortResult<()> {
        let delta = -i64::try_from(units).unwrap_or(i64::MAX);
        let update = self.client.update_item().table_name(&self.table).key("pk", s(StoreScope::Stack.key(key)));
        let update = update.update_expression("ADD used :d").expression_attribute_values(":d", n(delta));
        update.send().await.map_err(|e| map_sdk_error("dynamodb UpdateItem (units given back to a shared counter)", &e))?;
        Ok(())
    }
}

/// The stack's table keeps every scope's state, each lane's items under keys of its own.
#[async_trait]
impl ScopedStores for DynamoStateStore {
    fn scoped(&self, scope: &StoreScope) -> std::sync::Arc<dyn StateStore> {
        std::sync::Arc::new(DynamoStateStore::scoped(self, scope))
    }

    /// Four items a lane, 25 lanes a BatchGetItem: 40 requests for 1,000 lanes.
    async fn lanes_signals(&self, lanes: &[LaneId]) -> PortResult<Vec<(LaneSignals, Option<LaneChange>)>> {
        let names = [CIRCUIT, COOL_DOWN, PROVIDER_READING, LANE_CHANGE];
        self.lanes_items(lanes, &names, "lanes' circuits, cool-downs, readings and settings", |scope, item| {
            Ok((signals_of(item)?, item(LANE_CHANGE).map(|item| lane_change_of(item, scope)).transpose()?))
        })
        .await
    }

    /// Five items a lane, 20 lanes a BatchGetItem: 50 requests for 1,000 lanes, where
    /// each lane's own reads took four.
    async fn lanes_first_reads(&self, lanes: &[LaneId]) -> PortResult<Vec<LaneFirstRead>> {
        let names = [PACER, CIRCUIT, COOL_DOWN, PROVIDER_READING, LANE_CHANGE];
        self.lanes_items(lanes, &names, "lanes' pacers, circuits, cool-downs, readings and settings", |scope, item| {
            let change = item(LANE_CHANGE).map(|item| lane_change_of(item, scope)).transpose()?;
            Ok(LaneFirstRead { pacer: item(PACER).map(pacer_of).transpose(), signals: signals_of(item)?, change })
        })
        .await
    }

    /// Up to 99 snapshots a transaction, each with the lease's condition check: 11
    /// requests for 1,000 lanes, where one each took 1,000 one after the other (they
    /// cannot go at once: transactions on the same lease item conflict).
    async fn save_pacers(&self, lease: &Lease, snapshots: &[(StoreScope, PacerSnapshot)]) -> PortResult<()> {
        let puts = snapshots.iter().map(|(scope, snapshot)| self.pacer_put(scope, snapshot)).collect::<PortResult<Vec<_>>>()?;
        for transaction in transactions_of(puts) {
            self.save_while_held(lease, transaction, "dynamodb TransactWriteItems (pacers)").await?;
        }
        Ok(())
    }
}

/// The most bytes of puts in one transaction (DynamoDB takes 4 MB).
const BYTES_A_TRANSACTION: usize = 3_000_000;

/// `puts` (each with its size) in transactions of at most [`PACERS_A_TRANSACTION`] and
/// [`BYTES_A_TRANSACTION`], in their order.
fn transactions_of(puts: Vec<(usize, Put)>) -> Vec<Vec<Put>> {
    let mut transactions: Vec<(usize, Vec<Put>)> = Vec::new();
    for (bytes, put) in puts {
        match transactions.last_mut() {
            Some((size, open)) if open.len() < PACERS_A_TRANSACTION && *size + bytes <= BYTES_A_TRANSACTION => {
                *size += bytes;
                open.push(put);
            }
            _ => transactions.push((bytes, vec![put])),
        }
    }
    transactions.into_iter().map(|(_, puts)| puts).collect()
}

#[async_trait]
impl StateStore for DynamoStateStore {
    async fn acquire_lease(&self, holder: &str, ttl: Duration, now: UnixMillis) -> PortResult<Lease> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", s(&self.lease_key))
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
                    let current = self.get_item(s(&self.lease_key)).await?.map(|i| lease_of(&i));
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
            .key("pk", s(&self.lease_key))
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
            .key("pk", s(&self.lease_key))
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
        Ok(self.get_item(s(&self.lease_key)).await?.map(|i| lease_of(&i)).filter(|l| !l.holder.is_empty()))
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
            let update = self.client.update_item().table_name(&self.table).key("pk", self.pk(key)).expression_attribute_values(":d", n(delta));
            // The breaker's failure buckets matter for seconds: the table's TTL removes
            // them a day later. Calendar counters stay.
            let update = if key.starts_with(FAILURE_BUCKET_PREFIX) {
                let expires = crate::time::system_now().plus(FAILURE_BUCKET_TTL);
                update.update_expression("ADD used :d SET expires_at_seconds = :x").expression_attribute_values(":x", n(expires.0 / 1_000))
            } else {
                update.update_expression("ADD used :d")
            };
            update.send().await.map_err(|e| map_sdk_error("dynamodb UpdateItem (usage)", &e))?;
        }
        Ok(())
    }

    async fn load_pacer(&self) -> PortResult<Option<PacerSnapshot>> {
        self.get(PACER).await?.as_ref().map(pacer_of).transpose()
    }

    async fn save_pacer(&self, lease: &Lease, snapshot: &PacerSnapshot) -> PortResult<()> {
        let (_, put) = self.pacer_put(&self.scope, snapshot)?;
        self.save_while_held(lease, vec![put], "dynamodb TransactWriteItems (pacer)").await
    }

    async fn circuit(&self) -> PortResult<Circuit> {
        self.get(CIRCUIT).await?.map_or_else(|| Ok(Circuit::default()), |item| circuit_of(&item))
    }

    async fn take_call_slot(&self, capacity: u32, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<Option<u32>> {
        let start = slot_probe_start(holder, capacity);
        for k in 0..capacity {
            let index = (start + k) % capacity.max(1);
            let result = self
                .client
                .update_item()
                .table_name(&self.table)
                .key("pk", self.pk(&format!("{CALL_SLOT}{index}")))
                .update_expression("SET holder = :h, expires_at = :e")
                .condition_expression("attribute_not_exists(holder) OR expires_at <= :now")
                .expression_attribute_values(":h", s(holder))
                .expression_attribute_values(":e", n(expires_at.0))
                .expression_attribute_values(":now", n(now.0))
                .send()
                .await;
            match result.map_err(|e| map_sdk_error("dynamodb UpdateItem (call slot)", &e)) {
                Ok(_) => return Ok(Some(index)),
                Err(PortError::Conflict(_)) => continue,
                Err(e) => return Err(e),
            }
        }
        Ok(None)
    }

    async fn release_call_slot(&self, index: u32, holder: &str) -> PortResult<()> {
        let result = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", self.pk(&format!("{CALL_SLOT}{index}")))
            .update_expression("REMOVE holder SET expires_at = :zero")
            .condition_expression("holder = :h")
            .expression_attribute_values(":h", s(holder))
            .expression_attribute_values(":zero", n(0))
            .send()
            .await;
        match result.map_err(|e| map_sdk_error("dynamodb UpdateItem (call slot)", &e)) {
            // Not ours any more (it expired and another worker took it): nothing to give back.
            Ok(_) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn claim_call(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<CallClaim> {
        let result = self.claim(key, holder, now, expires_at).send().await;
        match result.map_err(|e| map_sdk_error("dynamodb UpdateItem (call record)", &e)) {
            Ok(_) => Ok(CallClaim::Taken),
            // Someone has it: a read tells which (only repeated deliveries come here).
            Err(PortError::Conflict(_)) => Ok(match self.get(key).await? {
                Some(item) if get_s(&item, "state") == "done" => CallClaim::Done,
                Some(item) if get_s(&item, "holder") == holder => CallClaim::ClaimedBefore,
                _ => CallClaim::Calling,
            }),
            Err(e) => Err(e),
        }
    }

    async fn finish_call(&self, key: &str, keep_until: UnixMillis) -> PortResult<()> {
        self.client
            .update_item()
            .table_name(&self.table)
            .key("pk", self.pk(key))
            .update_expression("SET #state = :done, expires_at = :x, expires_at_seconds = :xs REMOVE holder")
            .expression_attribute_names("#state", "state")
            .expression_attribute_values(":done", s("done"))
            .expression_attribute_values(":x", n(keep_until.0))
            .expression_attribute_values(":xs", n(keep_until.0 / 1_000))
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb UpdateItem (call record)", &e))?;
        Ok(())
    }

    async fn claim_batch(&self, key: &str, holder: &str, now: UnixMillis, expires_at: UnixMillis) -> PortResult<BatchClaim> {
        let result = self.claim(key, holder, now, expires_at).return_values(aws_sdk_dynamodb::types::ReturnValue::AllOld).send().await;
        match result.map_err(|e| map_sdk_error("dynamodb UpdateItem (batch record)", &e)) {
            // Where an earlier delivery stopped, its progress is the old item's.
            Ok(out) => Ok(BatchClaim::Taken { before: out.attributes().and_then(|old| BatchProgress::from_bits(get_s(old, "settled"), false)) }),
            Err(PortError::Conflict(_)) => {
                let done = self.get(key).await?.is_some_and(|item| get_s(&item, "state") == "done");
                Ok(if done { BatchClaim::Done } else { BatchClaim::Running })
            }
            Err(e) => Err(e),
        }
    }

    async fn save_batch(&self, key: &str, holder: &str, progress: &BatchProgress, expires_at: UnixMillis) -> PortResult<()> {
        self.client
            .update_item()
            .table_name(&self.table)
            .key("pk", self.pk(key))
            .update_expression("SET #state = :state, settled = :settled, expires_at = :x, expires_at_seconds = :xs")
            .condition_expression("holder = :h")
            .expression_attribute_names("#state", "state")
            .expression_attribute_values(":state", s(if progress.done { "done" } else { "calling" }))
            .expression_attribute_values(":settled", s(progress.settled_bits()))
            .expression_attribute_values(":h", s(holder))
            .expression_attribute_values(":x", n(expires_at.0))
            .expression_attribute_values(":xs", n(expires_at.plus(FAILURE_BUCKET_TTL).0 / 1_000))
            .send()
            .await
            .map_err(|e| map_sdk_error("dynamodb UpdateItem (batch record)", &e))?;
        Ok(())
    }

    async fn release_call(&self, key: &str, holder: &str) -> PortResult<()> {
        let result = self
            .client
            .delete_item()
            .table_name(&self.table)
            .key("pk", self.pk(key))
            .condition_expression("#state = :calling AND holder = :h")
            .expression_attribute_names("#state", "state")
            .expression_attribute_values(":calling", s("calling"))
            .expression_attribute_values(":h", s(holder))
            .send()
            .await;
        match result.map_err(|e| map_sdk_error("dynamodb DeleteItem (call record)", &e)) {
            // Not ours (done, or another delivery's claim): nothing to release.
            Ok(_) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn forget_call(&self, key: &str) -> PortResult<()> {
        self.delete(key, "call record").await
    }

    async fn call_slots_in_use(&self, capacity: u32, now: UnixMillis) -> PortResult<u32> {
        let keys: Vec<String> = (0..capacity).map(|index| format!("{CALL_SLOT}{index}")).collect();
        let items = self.batch_get(&keys, "call slots").await?;
        let in_use = items.iter().filter(|item| item.contains_key("holder") && get_n(item, "expires_at") > now.0).count();
        Ok(u32::try_from(in_use).unwrap_or(u32::MAX))
    }

    async fn shared_state(&self) -> PortResult<LaneSignals> {
        let keys = [CIRCUIT.to_owned(), COOL_DOWN.to_owned(), PROVIDER_READING.to_owned()];
        let items = self.batch_get(&keys, "circuit, cool-down, provider reading").await?;
        signals_of(|name: &str| {
            let pk = self.scope.key(name);
            items.iter().find(|item| get_s(item, "pk") == pk)
        })
    }

    async fn provider_reading(&self) -> PortResult<Option<ProviderReading>> {
        Ok(self.get(PROVIDER_READING).await?.as_ref().and_then(provider_reading_of))
    }

    async fn record_provider_reading(&self, reading: &ProviderReading) -> PortResult<()> {
        let window = reading.window_ms.map_or_else(|| "REMOVE window_ms".to_owned(), |_| String::new());
        let set = if reading.window_ms.is_some() { ", window_ms = :w" } else { "" };
        let mut update = self
            .client
            .update_item()
            .table_name(&self.table)
            .key("pk", self.pk(PROVIDER_READING))
            .update_expression(format!("SET quota_limit = :l, remaining = :r, resets_at = :z, #at = :at{set} {window}"))
            .condition_expression("attribute_not_exists(#at) OR #at < :at")
            .expression_attribute_names("#at", "at")
            .expression_attribute_values(":l", n(reading.limit))
            .expression_attribute_values(":r", n(reading.remaining))
            .expression_attribute_values(":z", n(reading.resets_at.0))
            .expression_attribute_values(":at", n(reading.at.0));
        if let Some(window_ms) = reading.window_ms {
            update = update.expression_attribute_values(":w", n(window_ms));
        }
        match update.send().await.map_err(|e| map_sdk_error("dynamodb UpdateItem (provider reading)", &e)) {
            // A later reading is already there.
            Ok(_) | Err(PortError::Conflict(_)) => Ok(()),
            Err(e) => Err(e),
        }
    }

    async fn swap_circuit(&self, expected_epoch: u64, next: &Circuit) -> PortResult<()> {
        let condition = if expected_epoch == 0 { "attribute_not_exists(epoch) OR epoch = :expected" } else { "epoch = :expected" };
        self.client
            .put_item()
            .table_name(&self.table)
            .item("pk", self.pk(CIRCUIT))
            .item("status", s(next.status.to_string()))
            .item("epoch", n(next.epoch))
            .item("since", n(next.since.0))
            .item("reason", s(if next.reason.is_empty() { "-" } else { next.reason.as_str() }))
            .item("reopened", n(next.reopened))
            .item("held", AttributeValue::Bool(next.held))
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
            .key("pk", self.pk(COOL_DOWN))
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
        for key in [COOL_DOWN, PROVIDER_READING] {
            self.delete(key, key).await?;
        }
        Ok(())
    }
    async fn lane_change(&self) -> PortResult<Option<LaneChange>> {
        self.get(LANE_CHANGE).await?.map(|item| lane_change_of(&item, &self.scope)).transpose()
    }

    async fn set_lane_change(&self, change: Option<&LaneChange>) -> PortResult<()> {
        let StoreScope::Lane(lane) = &self.scope else {
            return Err(PortError::Fatal("lane settings are a lane's: this store holds the stack's state".into()));
        };
        let what = "dynamodb UpdateItem (lane settings)";
        let listed = self.client.update_item().table_name(&self.table).key("pk", s(CHANGED_LANES));
        match change {
            Some(change) => {
                let json = serde_json::to_string(change).map_err(|e| PortError::Fatal(e.to_string()))?;
                let put = self.client.put_item().table_name(&self.table).item("pk", self.pk(LANE_CHANGE)).item("change", s(json));
                put.send().await.map_err(|e| map_sdk_error("dynamodb PutItem (lane settings)", &e))?;
                let listed = listed.update_expression("ADD lanes :lane").expression_attribute_values(":lane", AttributeValue::Ss(vec![lane.to_string()]));
                listed.send().await.map_err(|e| map_sdk_error(what, &e))?;
            }
            None => {
                self.delete(LANE_CHANGE, "lane settings").await?;
                let listed = listed.update_expression("DELETE lanes :lane").expression_attribute_values(":lane", AttributeValue::Ss(vec![lane.to_string()]));
                listed.send().await.map_err(|e| map_sdk_error(what, &e))?;
            }
        }
        Ok(())
    }

    async fn order_mark(&self) -> PortResult<Option<OrderMark>> {
        let Some(item) = self.get(ORDER_MARK).await? else { return Ok(None) };
        serde_json::from_str(get_s(&item, "mark")).map(Some).map_err(|e| PortError::Unreadable(format!("stored order mark of {}: {e}", self.scope)))
    }

    async fn open_order(&self, mark: &OrderMark) -> PortResult<()> {
        let json = serde_json::to_string(mark).map_err(|e| PortError::Fatal(e.to_string()))?;
        let put = self.client.put_item().table_name(&self.table).item("pk", self.pk(ORDER_MARK));
        let put = put.item("job_id", s(mark.job_id.as_str())).item("attempt", n(mark.attempt)).item("mark", s(json));
        put.send().await.map_err(|e| map_sdk_error("dynamodb PutItem (order mark)", &e))?;
        Ok(())
    }

    async fn settle_order(&self, job_id: &str, attempt: u32, state: OrderState) -> PortResult<bool> {
        let mark = OrderMark { job_id: job_id.to_owned(), attempt, state };
        let json = serde_json::to_string(&mark).map_err(|e| PortError::Fatal(e.to_string()))?;
        let update = self.client.update_item().table_name(&self.table).key("pk", self.pk(ORDER_MARK)).update_expression("SET mark = :mark");
        let update = update.condition_expression("job_id = :job AND attempt = :attempt");
        let update = update
            .expression_attribute_values(":mark", s(json))
            .expression_attribute_values(":job", s(job_id))
            .expression_attribute_values(":attempt", n(attempt));
        match update.send().await.map_err(|e| map_sdk_error("dynamodb UpdateItem (order mark)", &e)) {
            Ok(_) => Ok(true),
            Err(PortError::Conflict(_)) => Ok(false),
            Err(e) => Err(e),
        }
    }

    /// The lanes an operator changed (their settings are items of their own): a scan of
    /// every lane's items would read the whole table, call records and all.
    async fn lanes_with_state(&self) -> PortResult<Vec<LaneId>> {
        let Some(item) = self.get_item(s(CHANGED_LANES)).await? else { return Ok(Vec::new()) };
        let listed = item.get("lanes").and_then(|v| v.as_ss().ok()).cloned().unwrap_or_default();
        let mut lanes: Vec<LaneId> = listed.iter().filter_map(|id| LaneId::parse(id).ok()).filter(|lane| !lane.is_default()).collect();
        lanes.sort();
        Ok(lanes)
    }
}

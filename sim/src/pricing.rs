//! A dated AWS price table and the cost estimate of a simulated run, per million jobs.

use serde::Serialize;

use crate::aws::Ledger;

/// List prices the estimate uses (USD, us-east-1, on-demand, no free tier).
#[derive(Clone, Debug, Serialize)]
pub struct PriceTable {
    pub as_of: &'static str,
    pub region: &'static str,
    pub sqs_per_million_requests: f64,
    pub lambda_per_million_requests: f64,
    /// arm64 (Graviton), first pricing tier.
    pub lambda_per_gb_second: f64,
    /// On-demand, after the 2024-11-01 reduction.
    pub dynamodb_per_million_write_units: f64,
    pub dynamodb_per_million_read_units: f64,
    /// Provisioned capacity: a write capacity unit (a write a second) for an hour.
    pub dynamodb_per_wcu_hour: f64,
    /// Provisioned capacity: a read capacity unit (a read unit a second) for an hour.
    pub dynamodb_per_rcu_hour: f64,
    pub excludes: &'static str,
}

/// The table in use: AWS's published list prices as of its `as_of` date.
pub const PRICES: PriceTable = PriceTable {
    as_of: "2025-01",
    region: "us-east-1",
    sqs_per_million_requests: 0.40,
    lambda_per_million_requests: 0.20,
    lambda_per_gb_second: 0.000_013_333_4,
    dynamodb_per_million_write_units: 0.625,
    dynamodb_per_million_read_units: 0.125,
    dynamodb_per_wcu_hour: 0.000_65,
    dynamodb_per_rcu_hour: 0.000_13,
    excludes: "free tiers, CloudWatch logs and alarms, KMS, data transfer, the API's own price",
};

/// How the stack's state table is billed: the template's `TableCapacity`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "kebab-case")]
pub enum TableCapacity {
    /// Per request (the template's default).
    #[default]
    OnDemand,
    /// Provisioned capacity that Application Auto Scaling keeps at
    /// [`PROVISIONED_TARGET_USE`] of what is provisioned: priced as a steady load, the
    /// capacity following it.
    Provisioned,
}

impl std::str::FromStr for TableCapacity {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        match text {
            "on-demand" => Ok(Self::OnDemand),
            "provisioned" => Ok(Self::Provisioned),
            other => Err(format!("`{other}` is not a table capacity: on-demand or provisioned")),
        }
    }
}

/// The use of its provisioned capacity the template's auto scaling keeps the table at.
pub const PROVISIONED_TARGET_USE: f64 = 0.70;

impl PriceTable {
    /// What a million units cost at `per_unit_hour` (a unit a second for an hour),
    /// provisioned at [`PROVISIONED_TARGET_USE`].
    fn provisioned_per_million(per_unit_hour: f64) -> f64 {
        per_unit_hour / 3600.0 / PROVISIONED_TARGET_USE * 1e6
    }

    /// The price of a million write units and of a million read units when the table is
    /// billed as `table` says.
    #[must_use]
    pub fn dynamodb_per_million(&self, table: TableCapacity) -> (f64, f64) {
        match table {
            TableCapacity::OnDemand => (self.dynamodb_per_million_write_units, self.dynamodb_per_million_read_units),
            TableCapacity::Provisioned => {
                (Self::provisioned_per_million(self.dynamodb_per_wcu_hour), Self::provisioned_per_million(self.dynamodb_per_rcu_hour))
            }
        }
    }
}

/// One line of the estimate.
#[derive(Clone, Debug, Serialize)]
pub struct CostLine {
    pub item: String,
    pub quantity: f64,
    pub unit: &'static str,
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub usd: f64,
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub per_million_jobs_usd: f64,
}

/// What the simulated run would cost on AWS, and per million jobs.
#[derive(Clone, Debug, Serialize)]
pub struct CostEstimate {
    pub prices: PriceTable,
    pub lines: Vec<CostLine>,
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub total_usd: f64,
    #[serde(serialize_with = "paceline_shared::figures::six_digits")]
    pub per_million_jobs_usd: f64,
}

/// Memory of each function, for Lambda's GB-seconds.
#[derive(Clone, Copy, Debug, Serialize)]
pub struct FunctionMemory {
    pub orchestrator_mb: u32,
    pub worker_mb: u32,
}

impl Default for FunctionMemory {
    /// The SAM template's settings.
    fn default() -> Self {
        Self { orchestrator_mb: 128, worker_mb: 128 }
    }
}

/// Prices the ledger of a run that handled `jobs` jobs, its table billed as `table` says.
#[must_use]
pub fn estimate(ledger: &Ledger, memory: FunctionMemory, table: TableCapacity, jobs: u64) -> CostEstimate {
    let p = PRICES;
    let requests = ledger.requests();
    let sum = |prefix: &str| requests.iter().filter(|(op, _)| op.starts_with(prefix)).map(|(_, n)| *n as f64).sum::<f64>();
    let gb_seconds = |ms: u64, mb: u32| ms as f64 / 1e3 * f64::from(mb) / 1024.0;
    let load = std::sync::atomic::Ordering::Relaxed;
    let (sqs, invokes) = (sum("sqs:"), sum("lambda:"));
    let worker_gbs = gb_seconds(ledger.worker_ms.load(load), memory.worker_mb);
    let orchestrator_gbs = gb_seconds(ledger.orchestrator_ms.load(load), memory.orchestrator_mb);
    let (wru, rru) = (ledger.dynamodb_write_units.load(load) as f64, ledger.dynamodb_read_units.load(load) as f64);
    let line = |item: &str, quantity: f64, unit: &'static str, usd: f64| CostLine {
        item: item.into(),
        quantity,
        unit,
        usd,
        per_million_jobs_usd: if jobs == 0 { 0.0 } else { usd / jobs as f64 * 1e6 },
    };
    let (per_million_writes, per_million_reads) = p.dynamodb_per_million(table);
    let billed = match table {
        TableCapacity::OnDemand => String::new(),
        TableCapacity::Provisioned => format!(" (provisioned, {:.0}% used)", PROVISIONED_TARGET_USE * 100.0),
    };
    let lines = vec![
        line("SQS requests", sqs, "requests", sqs / 1e6 * p.sqs_per_million_requests),
        line("Lambda requests", invokes, "requests", invokes / 1e6 * p.lambda_per_million_requests),
        line("Lambda worker compute", worker_gbs, "GB-s", worker_gbs * p.lambda_per_gb_second),
        line("Lambda orchestrator compute", orchestrator_gbs, "GB-s", orchestrator_gbs * p.lambda_per_gb_second),
        line(&format!("DynamoDB writes{billed}"), wru, "write units", wru / 1e6 * per_million_writes),
        line(&format!("DynamoDB reads{billed}"), rru, "read units", rru / 1e6 * per_million_reads),
    ];
    let total_usd: f64 = lines.iter().map(|l| l.usd).sum();
    let per_million_jobs_usd = if jobs == 0 { 0.0 } else { total_usd / jobs as f64 * 1e6 };
    CostEstimate { prices: p, lines, total_usd, per_million_jobs_usd }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_million_invokes_of_one_second_at_128_mb_cost_what_the_table_says() {
        let ledger = Ledger::default();
        ledger.count("lambda:Invoke", 1_000_000);
        ledger.worker_ms.store(1_000_000_000, std::sync::atomic::Ordering::Relaxed);
        let cost = estimate(&ledger, FunctionMemory::default(), TableCapacity::OnDemand, 1_000_000);
        // 0.20 for the requests + 125,000 GB-s x 0.0000133334.
        assert!((cost.total_usd - (0.20 + 125_000.0 * 0.000_013_333_4)).abs() < 1e-9, "{}", cost.total_usd);
        assert!((cost.per_million_jobs_usd - cost.total_usd).abs() < 1e-9);
    }

    #[test]
    fn a_provisioned_table_prices_a_write_unit_as_a_capacity_unit_second_at_seventy_percent_use() {
        let ledger = Ledger::default();
        ledger.dynamodb_write_units.store(1_000_000, std::sync::atomic::Ordering::Relaxed);
        ledger.dynamodb_read_units.store(2_000_000, std::sync::atomic::Ordering::Relaxed);
        let on_demand = estimate(&ledger, FunctionMemory::default(), TableCapacity::OnDemand, 1_000_000);
        let provisioned = estimate(&ledger, FunctionMemory::default(), TableCapacity::Provisioned, 1_000_000);
        assert!((on_demand.total_usd - (0.625 + 2.0 * 0.125)).abs() < 1e-9, "{}", on_demand.total_usd);
        // A million write units are a million WCU-seconds: 277.8 WCU-hours at $0.00065,
        // over 0.7 for the 30% kept free; reads likewise at $0.00013.
        let writes = 1e6 / 3600.0 * 0.000_65 / 0.7;
        let reads = 2e6 / 3600.0 * 0.000_13 / 0.7;
        assert!((provisioned.total_usd - (writes + reads)).abs() < 1e-9, "{}", provisioned.total_usd);
        assert!((writes - 0.258).abs() < 0.001, "{writes}");
        assert!(provisioned.lines.iter().any(|line| line.item == "DynamoDB writes (provisioned, 70% used)"), "{:?}", provisioned.lines);
    }
}

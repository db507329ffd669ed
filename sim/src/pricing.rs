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
    excludes: "free tiers, CloudWatch logs and alarms, KMS, data transfer, the API's own price",
};

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

/// Prices the ledger of a run that handled `jobs` jobs.
#[must_use]
pub fn estimate(ledger: &Ledger, memory: FunctionMemory, jobs: u64) -> CostEstimate {
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
    let lines = vec![
        line("SQS requests", sqs, "requests", sqs / 1e6 * p.sqs_per_million_requests),
        line("Lambda requests", invokes, "requests", invokes / 1e6 * p.lambda_per_million_requests),
        line("Lambda worker compute", worker_gbs, "GB-s", worker_gbs * p.lambda_per_gb_second),
        line("Lambda orchestrator compute", orchestrator_gbs, "GB-s", orchestrator_gbs * p.lambda_per_gb_second),
        line("DynamoDB writes", wru, "write units", wru / 1e6 * p.dynamodb_per_million_write_units),
        line("DynamoDB reads", rru, "read units", rru / 1e6 * p.dynamodb_per_million_read_units),
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
        let cost = estimate(&ledger, FunctionMemory::default(), 1_000_000);
        // 0.20 for the requests + 125,000 GB-s x 0.0000133334.
        assert!((cost.total_usd - (0.20 + 125_000.0 * 0.000_013_333_4)).abs() < 1e-9, "{}", cost.total_usd);
        assert!((cost.per_million_jobs_usd - cost.total_usd).abs() < 1e-9);
    }
}

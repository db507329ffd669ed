//! The AWS adapters: SQS for the jobs queue and its DLQ, DynamoDB for lease, usage,
//! pacer snapshot, circuit and cool-down, Lambda `Event` invokes for the hand-off.
//!
//! Clients are built once from one `SdkConfig`; every service honours the standard
//! endpoint overrides (`AWS_ENDPOINT_URL`, `AWS_ENDPOINT_URL_SQS`, ...), so the same code
//! runs against a local emulator. SDK errors are mapped to [`PortError`] by what the
//! caller can do: throttling, passing faults, conflicts (failed conditions), fatal.

mod dynamodb;
mod lambda;
mod results;
mod sqs;

pub use dynamodb::DynamoStateStore;
pub use lambda::LambdaInvoker;
pub use results::SqsResults;
pub use sqs::SqsQueue;

use aws_sdk_sqs::error::{ProvideErrorMetadata, SdkError};

use crate::ports::PortError;

/// Error codes that mean "slow down".
const THROTTLING: &[&str] = &[
    "Throttling",
    "ThrottlingException",
    "ThrottledException",
    "RequestThrottled",
    "RequestThrottledException",
    "TooManyRequestsException",
    "ProvisionedThroughputExceededException",
    "RequestLimitExceeded",
    "LimitExceededException",
    "EC2ThrottledException",
    // SQS refusing a short-poll receive while the queue holds its most messages in
    // flight (about 120,000 on a standard queue): some are deleted or visible soon.
    "OverLimit",
];

/// Error codes of passing faults on the service's side.
const TRANSIENT: &[&str] = &[
    "InternalFailure",
    "InternalError",
    "InternalServerError",
    "ServiceUnavailable",
    "ServiceException",
    "ResourceNotReadyException",
    "TransactionInProgressException",
    "KMSThrottlingException",
];

/// Error codes of one request over a size limit (Lambda's async payload, an SQS batch).
const TOO_LARGE: &[&str] = &["RequestTooLargeException", "RequestEntityTooLargeException", "BatchRequestTooLong", "AWS.SimpleQueueService.BatchRequestTooLong"];

/// Error codes of a failed condition.
const CONFLICT: &[&str] = &["ConditionalCheckFailedException", "TransactionCanceledException", "TransactionConflictException"];

/// Maps an error code from any AWS service to a [`PortError`].
#[must_use]
pub fn classify_code(what: &str, code: &str, message: &str) -> PortError {
    let text = format!("{what}: {code}: {message}");
    if CONFLICT.contains(&code) {
        PortError::Conflict(text)
    } else if THROTTLING.contains(&code) {
        PortError::Throttled(text)
    } else if TRANSIENT.contains(&code) {
        PortError::Transient(text)
    } else if TOO_LARGE.contains(&code) || (code == "InvalidParameterValue" && message.contains("shorter than")) {
        PortError::TooLarge(text)
    } else {
        PortError::Fatal(text)
    }
}

/// Maps an SDK error (any service) to a [`PortError`].
pub fn map_sdk_error<E, R>(what: &str, err: &SdkError<E, R>) -> PortError
where
    E: ProvideErrorMetadata + std::error::Error + 'static,
    R: std::fmt::Debug,
{
    match err {
        SdkError::ServiceError(service) => {
            let e = service.err();
            classify_code(what, e.code().unwrap_or("Unknown"), e.message().unwrap_or(""))
        }
        SdkError::ConstructionFailure(_) => PortError::Fatal(format!("{what}: request could not be built: {err:?}")),
        SdkError::TimeoutError(_) => PortError::Transient(format!("{what}: timed out")),
        _ => PortError::Transient(format!("{what}: {}", crate::error_chain(err))),
    }
}

/// The names of a lane's AWS resources.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct AwsNames {
    pub queue_url: String,
    pub dlq_url: String,
    pub table: String,
    pub worker_function: String,
    /// The worker's Lambda on-failure destination, read by operator commands.
    pub worker_dlq_url: Option<String>,
}

impl AwsNames {
    /// `PACELINE_QUEUE_URL`, `PACELINE_DLQ_URL`, `PACELINE_TABLE`, (for the
    /// orchestrator) `PACELINE_WORKER_FUNCTION`, and the optional
    /// `PACELINE_WORKER_DLQ_URL`.
    ///
    /// # Errors
    /// Names the missing variable.
    pub fn from_env(env: &crate::lambda_env::Env<'_>, with_worker: bool) -> Result<Self, String> {
        Ok(Self {
            queue_url: env.required("PACELINE_QUEUE_URL")?,
            dlq_url: env.required("PACELINE_DLQ_URL")?,
            table: env.required("PACELINE_TABLE")?,
            worker_function: if with_worker { env.required("PACELINE_WORKER_FUNCTION")? } else { String::new() },
            worker_dlq_url: env.required("PACELINE_WORKER_DLQ_URL").ok(),
        })
    }
}

/// The adapters of one lane, built once from one SDK configuration.
#[derive(Clone, Debug)]
pub struct AwsAdapters {
    pub queue: SqsQueue,
    pub store: DynamoStateStore,
    pub invoker: LambdaInvoker,
}

impl AwsAdapters {
    /// Builds the clients; `lambda_endpoint` overrides Lambda's endpoint alone (tests).
    #[must_use]
    pub fn new(config: &aws_config::SdkConfig, names: &AwsNames, lambda_endpoint: Option<&str>) -> Self {
        // The drain loop retries a refused hand-off itself, in a new pacer slot. An SDK
        // retry would hand the job off late, after later slots: its API call would then
        // bunch up with theirs at the provider.
        // Nor does a hand-off need stalled-stream protection: its request is a few KB and
        // its answer an empty 202; the check's future costs CPU on every one of them.
        let mut lambda = aws_sdk_lambda::config::Builder::from(config)
            .retry_config(aws_sdk_lambda::config::retry::RetryConfig::disabled())
            .stalled_stream_protection(aws_sdk_lambda::config::StalledStreamProtectionConfig::disabled());
        if let Some(url) = lambda_endpoint {
            lambda = lambda.endpoint_url(url);
        }
        Self {
            queue: SqsQueue::new(aws_sdk_sqs::Client::new(config), &names.queue_url, &names.dlq_url).with_worker_dlq(names.worker_dlq_url.clone()),
            store: DynamoStateStore::new(aws_sdk_dynamodb::Client::new(config), &names.table),
            invoker: LambdaInvoker::new(aws_sdk_lambda::Client::from_conf(lambda.build()), &names.worker_function),
        }
    }
}

/// The SDK configuration loader every SDK configuration starts from: its HTTPS client
/// is rustls with ring, the TLS provider the worker's HTTP client uses too (one provider
/// in every binary).
#[must_use]
pub fn sdk_config_loader() -> aws_config::ConfigLoader {
    use aws_smithy_http_client::tls::{rustls_provider::CryptoMode, Provider};
    let https = aws_smithy_http_client::Builder::new().tls_provider(Provider::Rustls(CryptoMode::Ring)).build_https();
    aws_config::defaults(aws_config::BehaviorVersion::latest()).http_client(https)
}

/// The SDK configuration from the environment (region, credentials, and the standard
/// `AWS_ENDPOINT_URL*` overrides).
pub async fn load_sdk_config() -> aws_config::SdkConfig {
    sdk_config_loader().load().await
}

/// The SDK configuration for an operator's command: the environment's, with the
/// profile, region and endpoint a config file or flags may set.
pub async fn load_sdk_config_with(profile: Option<&str>, region: Option<&str>, endpoint_url: Option<&str>) -> aws_config::SdkConfig {
    let mut loader = sdk_config_loader();
    if let Some(profile) = profile {
        loader = loader.profile_name(profile);
    }
    if let Some(region) = region {
        loader = loader.region(aws_config::Region::new(region.to_owned()));
    }
    if let Some(url) = endpoint_url {
        loader = loader.endpoint_url(url);
    }
    loader.load().await
}

fn build_error(e: impl std::fmt::Display) -> PortError {
    PortError::Fatal(format!("cannot build AWS request: {e}"))
}

#[cfg(test)]
mod tests;

//! The simulator's client: one connection per call, typed results and typed errors.

use std::io;
use std::net::SocketAddr;
use std::time::Duration;

use tokio::io::BufReader;
use tokio::net::TcpStream;

use super::wire::{read_line, write_line, WireReply, WireRequest};
use super::{ChargeRequest, ChargeResult, Fault, Receipt};

/// How long a client waits for a reply unless told otherwise.
pub const DEFAULT_CLIENT_TIMEOUT: Duration = Duration::from_secs(2);

/// Why a call got no answer.
#[derive(Debug, thiserror::Error)]
pub enum GatewayError {
    /// The connection could not be opened: nothing was sent.
    #[error("gateway unreachable: {0}")]
    Unreachable(io::Error),
    /// The request was sent and the connection closed without a reply: the charge may
    /// or may not have been applied.
    #[error("gateway closed the connection without replying; the charge may have been applied")]
    DroppedReply,
    /// No reply within the client's timeout: the charge may or may not have been applied.
    #[error("no reply from the gateway within {0:?}; the charge may have been applied")]
    Timeout(Duration),
    /// Sending failed after connecting.
    #[error("gateway i/o error: {0}")]
    Io(io::Error),
    /// The reply was not what the protocol says.
    #[error("gateway protocol error: {0}")]
    Protocol(String),
}

impl GatewayError {
    /// True when the request may have reached the gateway and been applied, so the only
    /// safe retry is one with the same idempotency key.
    pub fn may_have_applied(&self) -> bool {
        !matches!(self, GatewayError::Unreachable(_))
    }
}

/// A client of the simulator: one connection per call, every call bounded by its
/// timeout.
#[derive(Clone, Debug)]
pub struct GatewayClient {
    addr: SocketAddr,
    timeout: Duration,
}

impl GatewayClient {
    /// A client of the gateway at `addr`, with [`DEFAULT_CLIENT_TIMEOUT`].
    pub fn new(addr: SocketAddr) -> Self {
        GatewayClient {
            addr,
            timeout: DEFAULT_CLIENT_TIMEOUT,
        }
    }

    /// Wait at most `timeout` for each reply.
    pub fn with_timeout(mut self, timeout: Duration) -> Self {
        self.timeout = timeout;
        self
    }

    /// Charge under idempotency key `key`, fenced by `token` if given.
    pub async fn charge(
        &self,
        key: &str,
        token: Option<u64>,
        request: &ChargeRequest,
    ) -> Result<ChargeResult, GatewayError> {
        self.charge_with_fault(key, token, request, None).await
    }

    /// [`GatewayClient::charge`], asking the gateway to inject `fault` into this request.
    pub async fn charge_with_fault(
        &self,
        key: &str,
        token: Option<u64>,
        request: &ChargeRequest,
        fault: Option<Fault>,
    ) -> Result<ChargeResult, GatewayError> {
        let wire = WireRequest::Charge {
            key: key.to_string(),
            token,
            request: request.clone(),
            fault,
        };
        match self.call(&wire).await? {
            WireReply::Applied { receipt } => Ok(ChargeResult::Applied(receipt)),
            WireReply::Duplicate { receipt } => Ok(ChargeResult::Duplicate(receipt)),
            WireReply::Fenced { seen, got } => Ok(ChargeResult::Fenced { seen, got }),
            WireReply::Mismatch { .. } => Ok(ChargeResult::Mismatch),
            WireReply::Failed { reason } => Ok(ChargeResult::Failed(reason)),
            other => Err(GatewayError::Protocol(format!(
                "unexpected reply to a charge: {other:?}"
            ))),
        }
    }

    /// The receipt of the charge applied under `key`, if any (reconciliation before
    /// acting, for callers that cannot rely on deduplication).
    pub async fn lookup(&self, key: &str) -> Result<Option<Receipt>, GatewayError> {
        match self.call(&WireRequest::Lookup { key: key.into() }).await? {
            WireReply::Found { receipt } => Ok(receipt),
            other => Err(GatewayError::Protocol(format!(
                "unexpected reply to a lookup: {other:?}"
            ))),
        }
    }

    async fn call(&self, request: &WireRequest) -> Result<WireReply, GatewayError> {
        let exchange = async {
            let stream = TcpStream::connect(self.addr)
                .await
                .map_err(GatewayError::Unreachable)?;
            let (read, mut write) = stream.into_split();
            write_line(&mut write, request)
                .await
                .map_err(GatewayError::Io)?;
            let mut reader = BufReader::new(read);
            let line = match read_line(&mut reader).await {
                Ok(Some(line)) => line,
                Ok(None) => return Err(GatewayError::DroppedReply),
                Err(e) if e.kind() == io::ErrorKind::InvalidData => {
                    return Err(GatewayError::Protocol(e.to_string()))
                }
                // Reset or aborted after the request went out: no reply will come.
                Err(_) => return Err(GatewayError::DroppedReply),
            };
            match serde_json::from_slice::<WireReply>(&line) {
                Ok(WireReply::Invalid { reason }) => Err(GatewayError::Protocol(format!(
                    "gateway refused the request: {reason}"
                ))),
                Ok(reply) => Ok(reply),
                Err(e) => Err(GatewayError::Protocol(format!("undecodable reply: {e}"))),
            }
        };
        tokio::time::timeout(self.timeout, exchange)
            .await
            .map_err(|_| GatewayError::Timeout(self.timeout))?
    }
}

//! The wire protocol: one JSON object per line each way.

use std::io;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, AsyncReadExt, AsyncWriteExt};

use super::{ChargeRequest, Fault, Receipt};

/// Longest request or reply line, in bytes.
pub const MAX_LINE_BYTES: u64 = 64 * 1024;

/// The wire form of a request.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "op", rename_all = "snake_case")]
pub(super) enum WireRequest {
    Charge {
        key: String,
        token: Option<u64>,
        request: ChargeRequest,
        #[serde(default)]
        fault: Option<Fault>,
    },
    Lookup {
        key: String,
    },
}

/// The wire form of a reply.
#[derive(Debug, Serialize, Deserialize)]
#[serde(tag = "result", rename_all = "snake_case")]
pub(super) enum WireReply {
    Applied { receipt: Receipt },
    Duplicate { receipt: Receipt },
    Fenced { seen: u64, got: u64 },
    Mismatch { key: String },
    Failed { reason: String },
    Found { receipt: Option<Receipt> },
    Invalid { reason: String },
}

/// Read one line of at most [`MAX_LINE_BYTES`]. `Ok(None)` at end of stream.
pub(super) async fn read_line<R: tokio::io::AsyncBufRead + Unpin>(
    reader: &mut R,
) -> io::Result<Option<Vec<u8>>> {
    let mut buf = Vec::new();
    let n = (&mut *reader)
        .take(MAX_LINE_BYTES + 1)
        .read_until(b'\n', &mut buf)
        .await?;
    if n == 0 {
        return Ok(None);
    }
    if buf.last() != Some(&b'\n') {
        return Err(io::Error::new(
            io::ErrorKind::InvalidData,
            "line too long or cut short",
        ));
    }
    buf.pop();
    Ok(Some(buf))
}

pub(super) async fn write_line<W: tokio::io::AsyncWrite + Unpin>(
    writer: &mut W,
    value: &impl Serialize,
) -> io::Result<()> {
    let mut line = serde_json::to_vec(value).map_err(io::Error::other)?;
    line.push(b'\n');
    writer.write_all(&line).await?;
    writer.flush().await
}

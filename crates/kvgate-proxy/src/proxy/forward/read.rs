//! Reading a client's body within `max_body_bytes`, `timeouts.body_read` and the in-flight
//! body budget (`limits.max_inflight_body_bytes`).

use bytes::Bytes;
use http::{HeaderMap, header};
use http_body_util::{BodyExt, Limited};
use hyper::body::Incoming;

use crate::{
    budget::{BudgetExhausted, Reservation},
    error::ProxyError,
    proxy::Proxy,
};

impl Proxy {
    /// Reads the client's body: 413 beyond `max_body_bytes` (or the whole body budget, when
    /// that is smaller), whether declared by
    /// `content-length` or found while reading; 408 when it has not all arrived within
    /// `timeouts.body_read` (a stalled upload or a trickle); 503 when it does not fit in the
    /// in-flight body budget (a declared length is reserved before reading, the rest as it
    /// arrives). The reservation holds the bytes until it is dropped.
    pub(super) async fn read_body(
        &self,
        headers: &HeaderMap,
        body: Incoming,
    ) -> Result<(Bytes, Reservation<'_>), ProxyError> {
        let limit = self.body_limit();
        let declared = headers
            .get(header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|len| len > limit as u64) {
            return Err(ProxyError::BodyTooLarge { limit });
        }
        let mut reservation = self.body_budget.borrowed();
        if let Some(len) = declared {
            reservation
                .grow_to(len)
                .map_err(|e| self.budget_exhausted(e))?;
        }
        let timeout = self.config.timeouts.body_read;
        let collect = collect_body(Limited::new(body, limit), &mut reservation);
        let Ok(collected) = tokio::time::timeout(timeout, collect).await else {
            self.metrics.timed_out("body_read");
            return Err(ProxyError::BodyTimeout {
                timeout_ms: timeout.as_millis(),
            });
        };
        match collected {
            Ok(bytes) => Ok((bytes, reservation)),
            Err(BodyReadError::Budget(e)) => Err(self.budget_exhausted(e)),
            Err(BodyReadError::Body(e)) if e.is::<http_body_util::LengthLimitError>() => {
                Err(ProxyError::BodyTooLarge { limit })
            }
            Err(BodyReadError::Body(e)) => Err(ProxyError::ClientBody(e.to_string())),
        }
    }

    /// The largest request body accepted: `max_body_bytes`, or the whole in-flight body
    /// budget when that is smaller (a body larger than the budget could never fit: 413, not a
    /// 503 to retry). Both front doors check bodies against it.
    pub fn body_limit(&self) -> usize {
        let budget = usize::try_from(self.body_budget.limit()).unwrap_or(usize::MAX);
        self.config.max_body_bytes.min(budget)
    }

    /// The error for a body the budget refused, logged with the figures (also for the
    /// ext_proc front door, which reserves its bodies in the same budget).
    pub fn budget_exhausted(&self, e: BudgetExhausted) -> ProxyError {
        tracing::warn!(
            limit_bytes = e.limit,
            held_bytes = e.held,
            wanted_bytes = e.wanted,
            "request body refused: the in-flight body budget is exhausted"
        );
        ProxyError::BodyBudgetExhausted(e)
    }
}

/// Why reading a client's body stopped.
enum BodyReadError {
    /// The body stream failed (or went over `max_body_bytes`).
    Body(Box<dyn std::error::Error + Send + Sync>),
    /// The body did not fit in the in-flight budget.
    Budget(BudgetExhausted),
}

/// Collects `body`, growing `reservation` by each frame before keeping it.
async fn collect_body<B>(body: B, reservation: &mut Reservation<'_>) -> Result<Bytes, BodyReadError>
where
    B: http_body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let mut body = std::pin::pin!(body);
    let mut frames: Vec<Bytes> = Vec::new();
    let mut total = 0u64;
    while let Some(frame) = body.frame().await {
        let frame = frame.map_err(|e| BodyReadError::Body(e.into()))?;
        let Ok(data) = frame.into_data() else {
            continue;
        };
        total += data.len() as u64;
        reservation.grow_to(total).map_err(BodyReadError::Budget)?;
        frames.push(data);
    }
    Ok(match frames.len() {
        0 => Bytes::new(),
        1 => frames.swap_remove(0),
        _ => {
            let mut all = bytes::BytesMut::with_capacity(total as usize);
            for frame in frames {
                all.extend_from_slice(&frame);
            }
            all.freeze()
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A body without a declared length grows its reservation frame by frame: it is
    /// refused at the first frame that does not fit, and keeps what it had until dropped.
    #[tokio::test]
    async fn body_frames_grow_the_reservation() {
        use crate::budget::BodyBudget;
        use prometheus_client::metrics::{counter::Counter, gauge::Gauge};

        let frames = |sizes: &[usize]| {
            let frames: Vec<Result<http_body::Frame<Bytes>, std::convert::Infallible>> = sizes
                .iter()
                .map(|n| Ok(http_body::Frame::data(Bytes::from(vec![b'a'; *n]))))
                .collect();
            http_body_util::StreamBody::new(futures_util::stream::iter(frames))
        };
        // (frame sizes, budget, bytes collected or None for refused, bytes held after)
        let cases: [(&[usize], u64, Option<usize>, u64); 4] = [
            (&[], 10, Some(0), 0),
            (&[4, 6], 10, Some(10), 10),
            (&[4, 6, 1], 10, None, 10),
            (&[11], 10, None, 0),
        ];
        for (sizes, limit, want, held) in cases {
            let budget = BodyBudget::new(limit, Gauge::default(), Counter::default());
            let mut reservation = budget.reservation();
            let got = collect_body(frames(sizes), &mut reservation).await;
            match (got, want) {
                (Ok(bytes), Some(n)) => assert_eq!(bytes.len(), n, "{sizes:?}"),
                (Err(BodyReadError::Budget(e)), None) => assert_eq!(e.limit, limit),
                (Err(_), _) => panic!("{sizes:?}: unexpected error"),
                (Ok(bytes), None) => panic!("{sizes:?}: {} bytes accepted", bytes.len()),
            }
            assert_eq!(budget.held(), held, "{sizes:?}");
            drop(reservation);
            assert_eq!(budget.held(), 0, "{sizes:?}");
        }
    }
}

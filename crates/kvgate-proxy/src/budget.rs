//! The global in-flight body budget (`limits.max_inflight_body_bytes`): the request bodies
//! that all requests in flight hold in memory together.
//!
//! A request reserves its body's bytes as they are read (all of a declared `content-length`
//! at once, before reading), and its [`Reservation`] gives them back when it is dropped:
//! once kvgate has let go of the body (the engine's response headers arrived), or on any
//! error, or when the client goes away. A body that would take the total over the budget is
//! refused with 503 and `Retry-After` ([`crate::ProxyError::BodyBudgetExhausted`]), so many
//! large uploads at once cannot exhaust the router's memory.

use std::sync::{
    Arc,
    atomic::{AtomicU64, Ordering},
};

use prometheus_client::metrics::{counter::Counter, gauge::Gauge};

/// The shared budget. Cloning shares it.
#[derive(Debug, Clone)]
pub struct BodyBudget {
    inner: Arc<Inner>,
}

#[derive(Debug)]
struct Inner {
    /// The budget, in bytes.
    limit: u64,
    /// Bytes reserved now.
    held: AtomicU64,
    /// `kvgate_inflight_body_bytes`.
    gauge: Gauge,
    /// `kvgate_body_budget_rejected_total`.
    rejected: Counter,
}

/// A body that did not fit: what it asked for and what was held when it asked.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error(
    "the in-flight body budget of {limit} bytes is exhausted ({held} held, {wanted} more wanted)"
)]
pub struct BudgetExhausted {
    /// The budget.
    pub limit: u64,
    /// Bytes held by other requests at the time.
    pub held: u64,
    /// Bytes this request wanted on top of what it already holds.
    pub wanted: u64,
}

impl BodyBudget {
    /// A budget of `limit` bytes, reporting the bytes held in `gauge` and each refusal in
    /// `rejected`.
    pub fn new(limit: u64, gauge: Gauge, rejected: Counter) -> BodyBudget {
        BodyBudget {
            inner: Arc::new(Inner {
                limit,
                held: AtomicU64::new(0),
                gauge,
                rejected,
            }),
        }
    }

    /// An empty reservation, grown with [`Reservation::grow_to`].
    pub fn reservation(&self) -> Reservation {
        Reservation {
            budget: self.inner.clone(),
            bytes: 0,
        }
    }

    /// The bytes reserved now.
    pub fn held(&self) -> u64 {
        self.inner.held.load(Ordering::Acquire)
    }

    /// The budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }
}

impl Inner {
    /// Takes `more` bytes if they fit.
    fn take(&self, more: u64) -> Result<(), BudgetExhausted> {
        let mut held = self.held.load(Ordering::Acquire);
        loop {
            let next = held
                .checked_add(more)
                .filter(|next| *next <= self.limit)
                .ok_or({
                    BudgetExhausted {
                        limit: self.limit,
                        held,
                        wanted: more,
                    }
                });
            let next = match next {
                Ok(next) => next,
                Err(e) => {
                    self.rejected.inc();
                    return Err(e);
                }
            };
            match self
                .held
                .compare_exchange_weak(held, next, Ordering::AcqRel, Ordering::Acquire)
            {
                Ok(_) => {
                    self.gauge.inc_by(more as i64);
                    return Ok(());
                }
                Err(now) => held = now,
            }
        }
    }

    fn give_back(&self, bytes: u64) {
        self.held.fetch_sub(bytes, Ordering::AcqRel);
        self.gauge.dec_by(bytes as i64);
    }
}

/// One request's share of the budget; dropping it gives the bytes back.
#[derive(Debug)]
pub struct Reservation {
    budget: Arc<Inner>,
    bytes: u64,
}

impl Reservation {
    /// Grows the reservation to `total` bytes (nothing when it already holds that many).
    ///
    /// # Errors
    /// [`BudgetExhausted`] when the growth does not fit; the reservation keeps what it had.
    pub fn grow_to(&mut self, total: u64) -> Result<(), BudgetExhausted> {
        if total <= self.bytes {
            return Ok(());
        }
        self.budget.take(total - self.bytes)?;
        self.bytes = total;
        Ok(())
    }

    /// The bytes this reservation holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.give_back(self.bytes);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn budget(limit: u64) -> BodyBudget {
        BodyBudget::new(limit, Gauge::default(), Counter::default())
    }

    /// Each step grows one of two reservations; the outcome and the total held after it.
    #[test]
    fn reservations_fit_within_the_limit() {
        let b = budget(100);
        let mut r = [b.reservation(), b.reservation()];
        let steps: [(usize, u64, bool, u64); 7] = [
            (0, 60, true, 60),
            (1, 40, true, 100),
            (1, 41, false, 100),       // one byte over
            (0, 60, true, 100),        // already holds that much
            (0, 30, true, 100),        // shrinking is not a thing: keeps 60
            (0, u64::MAX, false, 100), // overflow is refused, not wrapped
            (1, 0, true, 100),
        ];
        for (i, (which, total, fits, held)) in steps.into_iter().enumerate() {
            assert_eq!(r[which].grow_to(total).is_ok(), fits, "step {i}");
            assert_eq!(b.held(), held, "step {i}");
        }
        assert_eq!(b.inner.rejected.get(), 2);
        assert_eq!(b.inner.gauge.get(), 100);
        let [first, second] = r;
        drop(first);
        assert_eq!((b.held(), b.inner.gauge.get()), (40, 40));
        drop(second);
        assert_eq!((b.held(), b.inner.gauge.get()), (0, 0));
    }

    #[test]
    fn refusal_says_what_was_held_and_wanted() {
        let b = budget(10);
        let mut a = b.reservation();
        a.grow_to(7).unwrap();
        let err = b.reservation().grow_to(5).unwrap_err();
        assert_eq!(
            err,
            BudgetExhausted {
                limit: 10,
                held: 7,
                wanted: 5
            }
        );
    }

    /// Concurrent reservations never hold more than the limit together.
    #[test]
    fn concurrent_reservations_stay_within_the_limit() {
        let b = budget(1000);
        let threads: Vec<_> = (0..4)
            .map(|_| {
                let b = b.clone();
                std::thread::spawn(move || {
                    for _ in 0..10_000 {
                        let mut r = b.reservation();
                        if r.grow_to(300).is_ok() {
                            assert!(b.held() <= 1000);
                        }
                    }
                })
            })
            .collect();
        for t in threads {
            t.join().unwrap();
        }
        assert_eq!(b.held(), 0);
    }
}

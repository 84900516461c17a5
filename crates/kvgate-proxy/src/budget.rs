//! The global in-flight body budget (`limits.max_inflight_body_bytes`): the request bodies
//! that all requests in flight hold in memory together.
//!
//! A request reserves its body's bytes as they are read (all of a declared `content-length`
//! at once, before reading), and its [`Reservation`] gives them back when it is dropped:
//! once kvgate has let go of the body (the engine's response headers arrived), or on any
//! error, or when the client goes away. A body that would take the total over the budget is
//! refused with 503 and `Retry-After` ([`crate::ProxyError::BodyBudgetExhausted`]), so many
//! large uploads at once cannot exhaust the router's memory.

use std::sync::{Arc, atomic::Ordering};

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
    /// `kvgate_inflight_body_bytes`: the bytes reserved now. Its atomic is the count itself,
    /// so a reservation writes one shared word, not a count and a copy of it.
    held: Gauge,
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
    /// A budget of `limit` bytes (at most `i64::MAX`), held in `gauge` (which counts
    /// them: it must start at zero and nothing else may change it), each refusal counted in
    /// `rejected`.
    pub fn new(limit: u64, gauge: Gauge, rejected: Counter) -> BodyBudget {
        BodyBudget {
            inner: Arc::new(Inner {
                // The gauge counts in an i64.
                limit: limit.min(i64::MAX as u64),
                held: gauge,
                rejected,
            }),
        }
    }

    /// An empty reservation, grown with [`Reservation::grow_to`], that keeps the budget
    /// alive on its own.
    pub fn reservation(&self) -> Reservation<'static> {
        Reservation {
            budget: Share::Owned(self.inner.clone()),
            bytes: 0,
        }
    }

    /// An empty reservation that borrows the budget: no reference count is taken, which
    /// requests on every serving thread would otherwise all write.
    pub fn borrowed(&self) -> Reservation<'_> {
        Reservation {
            budget: Share::Borrowed(&self.inner),
            bytes: 0,
        }
    }

    /// The bytes reserved now.
    pub fn held(&self) -> u64 {
        self.inner.held_now()
    }

    /// The budget, in bytes.
    pub fn limit(&self) -> u64 {
        self.inner.limit
    }
}

impl Inner {
    /// The bytes reserved now.
    fn held_now(&self) -> u64 {
        held_bytes(self.held.inner().load(Ordering::Acquire))
    }

    /// Takes `more` bytes if they fit.
    fn take(&self, more: u64) -> Result<(), BudgetExhausted> {
        let mut seen = self.held.inner().load(Ordering::Acquire);
        loop {
            let held = held_bytes(seen);
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
            // `next` is at most `limit`, which fits an i64.
            let next = i64::try_from(next).unwrap_or(i64::MAX);
            match self.held.inner().compare_exchange_weak(
                seen,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return Ok(()),
                Err(now) => seen = now,
            }
        }
    }

    fn give_back(&self, bytes: u64) {
        let bytes = i64::try_from(bytes).unwrap_or(i64::MAX);
        self.held.inner().fetch_sub(bytes, Ordering::AcqRel);
    }
}

/// The gauge's count as bytes (it never goes below zero).
fn held_bytes(count: i64) -> u64 {
    u64::try_from(count).unwrap_or(0)
}

/// One request's share of the budget; dropping it gives the bytes back.
#[derive(Debug)]
pub struct Reservation<'a> {
    budget: Share<'a>,
    bytes: u64,
}

/// How a reservation reaches its budget.
#[derive(Debug)]
enum Share<'a> {
    Owned(Arc<Inner>),
    Borrowed(&'a Inner),
}

impl Share<'_> {
    fn get(&self) -> &Inner {
        match self {
            Share::Owned(inner) => inner,
            Share::Borrowed(inner) => inner,
        }
    }
}

impl Reservation<'_> {
    /// Grows the reservation to `total` bytes (nothing when it already holds that many).
    ///
    /// # Errors
    /// [`BudgetExhausted`] when the growth does not fit; the reservation keeps what it had.
    pub fn grow_to(&mut self, total: u64) -> Result<(), BudgetExhausted> {
        if total <= self.bytes {
            return Ok(());
        }
        self.budget.get().take(total - self.bytes)?;
        self.bytes = total;
        Ok(())
    }

    /// The bytes this reservation holds.
    pub fn bytes(&self) -> u64 {
        self.bytes
    }
}

impl Drop for Reservation<'_> {
    fn drop(&mut self) {
        if self.bytes > 0 {
            self.budget.get().give_back(self.bytes);
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
        let gauge = Gauge::default();
        let b = BodyBudget::new(100, gauge.clone(), Counter::default());
        // One owning its share of the budget, one borrowing it: the same accounting.
        let mut r = [b.reservation(), b.borrowed()];
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
        // The registered gauge is the count itself.
        assert_eq!(gauge.get(), 100);
        let [first, second] = r;
        drop(first);
        assert_eq!((b.held(), gauge.get()), (40, 40));
        drop(second);
        assert_eq!((b.held(), gauge.get()), (0, 0));
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

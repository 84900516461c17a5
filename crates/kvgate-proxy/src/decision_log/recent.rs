//! The last few finished decisions that `/debug/state` shows.

use std::cell::Cell;
use std::collections::VecDeque;
use std::num::NonZeroUsize;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::Instant;

use super::{DecisionRecord, Kept};

/// The last few finished decisions, newest first when read (bounded: the oldest is dropped
/// when full). A record keeps its scheduler decision unrendered until it is read: rendering
/// takes allocations for every candidate and scorer, and most records are never read.
///
/// Kept in one ring per thread that finishes requests (up to one per core, then shared), so a
/// request neither takes a lock that every serving thread writes nor frees a record another
/// thread allocated: each ring drops only what its own thread kept. Reading merges the rings
/// by when each decision was made.
#[derive(Debug)]
pub struct RecentDecisions {
    capacity: usize,
    shards: Box<[Shard]>,
}

/// One thread's ring, on a cache line of its own.
#[derive(Debug, Default)]
#[repr(align(128))]
struct Shard(Mutex<VecDeque<(Instant, Box<Kept>)>>);

/// Hands each thread its shard number the first time it keeps a record.
static NEXT_SHARD: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static SHARD: Cell<Option<usize>> = const { Cell::new(None) };
}

/// This thread's shard number (any number: taken modulo the shard count).
fn this_threads_shard() -> usize {
    SHARD.with(|s| {
        s.get().unwrap_or_else(|| {
            let n = NEXT_SHARD.fetch_add(1, Ordering::Relaxed);
            s.set(Some(n));
            n
        })
    })
}

impl RecentDecisions {
    /// Decisions kept by default.
    pub const DEFAULT_CAPACITY: usize = 50;

    /// An empty ring keeping at most `capacity` records.
    pub fn new(capacity: usize) -> RecentDecisions {
        let cores = std::thread::available_parallelism().map_or(1, NonZeroUsize::get);
        RecentDecisions::with_shards(capacity, cores)
    }

    /// An empty ring of `shards` rings (at least one, at most 64), each keeping up to
    /// `capacity`, read as one of `capacity`.
    fn with_shards(capacity: usize, shards: usize) -> RecentDecisions {
        RecentDecisions {
            capacity,
            shards: (0..shards.clamp(1, 64)).map(|_| Shard::default()).collect(),
        }
    }

    /// Keeps `kept`, decided at `at`; drops this thread's oldest when its ring is full.
    pub(super) fn push(&self, at: Instant, kept: Box<Kept>) {
        if self.capacity == 0 {
            return;
        }
        let shard = &self.shards[this_threads_shard() % self.shards.len()];
        let evicted = {
            let mut ring = shard.0.lock().unwrap_or_else(PoisonError::into_inner);
            let evicted = (ring.len() >= self.capacity)
                .then(|| ring.pop_front())
                .flatten();
            ring.push_back((at, kept));
            evicted
        };
        // Freed outside the lock.
        drop(evicted);
    }

    /// The records, newest first: the newest `capacity` of all threads' rings. Only those
    /// are rendered; every ring is held while they are picked (a request holds one, so
    /// the order of taking them cannot deadlock).
    pub fn newest_first(&self) -> Vec<DecisionRecord> {
        let rings: Vec<_> = self
            .shards
            .iter()
            .map(|s| s.0.lock().unwrap_or_else(PoisonError::into_inner))
            .collect();
        let mut all: Vec<&(Instant, Box<Kept>)> =
            rings.iter().flat_map(|ring| ring.iter().rev()).collect();
        // Stable: records of one ring made at the same instant stay newest first.
        all.sort_by_key(|(at, _)| std::cmp::Reverse(*at));
        all.truncate(self.capacity);
        all.into_iter().map(|(_, k)| k.rendered()).collect()
    }
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;
    use std::time::Duration;

    use super::*;

    fn kept(id: &str) -> Box<Kept> {
        Box::new(Kept {
            record: DecisionRecord::new(id, Some("m"), None, None, None),
            source: None,
        })
    }

    /// Records kept by several threads read back as one ring: the newest `capacity` of them,
    /// newest first, whichever thread kept each; and a thread's full ring drops its oldest.
    #[test]
    fn threads_rings_read_as_one() {
        let t0 = Instant::now();
        let at = |i: u64| t0 + Duration::from_millis(i);
        // (name, shards, capacity, records as (thread, time), want ids newest first)
        type Case = (
            &'static str,
            usize,
            usize,
            &'static [(usize, u64)],
            &'static [&'static str],
        );
        let cases: [Case; 5] = [
            ("one thread", 4, 3, &[(0, 1), (0, 2)], &["2", "1"]),
            (
                "two threads interleaved",
                4,
                3,
                &[(0, 1), (1, 2), (0, 3), (1, 4)],
                &["4", "3", "2"],
            ),
            (
                "a full ring drops its oldest",
                4,
                2,
                &[(0, 1), (0, 2), (0, 3)],
                &["3", "2"],
            ),
            (
                "an idle thread's old records lose to newer ones",
                4,
                2,
                &[(1, 1), (0, 2), (0, 3), (0, 4)],
                &["4", "3"],
            ),
            (
                "more threads than rings share one",
                1,
                3,
                &[(0, 1), (1, 2), (2, 3), (3, 4)],
                &["4", "3", "2"],
            ),
        ];
        for (name, shards, capacity, records, want) in cases {
            let recent = Arc::new(RecentDecisions::with_shards(capacity, shards));
            // Each record from a thread of its own number (threads 0..4), in order.
            for &(thread, time) in records {
                let (recent, when) = (Arc::clone(&recent), at(time));
                std::thread::spawn(move || {
                    SHARD.with(|s| s.set(Some(thread)));
                    recent.push(when, kept(&time.to_string()));
                })
                .join()
                .unwrap();
            }
            let got = recent.newest_first();
            let ids: Vec<&str> = got.iter().map(|r| r.request_id.as_str()).collect();
            assert_eq!(ids, want, "{name}");
        }
    }
}
